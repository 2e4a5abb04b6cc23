/* fuzz_cache.c: libFuzzer target for the disk cache's file readers
 * (runtime/disk_cache.c): an entry's manifest, object and source, a program
 * index file, a record and a memo file. Each input first has the cache write
 * the files valid, then edits one of them (the input: which file, a length
 * to cut it to, then bytes to change and bytes to append), then reads
 * through the cache again. A read must report a miss (and an entry must be
 * built again) or give back exactly what was written: the load callback
 * never sees an object other than the one compiled, a record's payload is
 * never other bytes, and nothing crashes or leaks.
 *
 * Input: byte 0 picks the file (mod 6); bytes 1-2, little endian, the
 * length to cut it to (0xffff: no cut); then triples (offset low, offset
 * high, value): the byte at offset mod the length becomes value; one or two
 * bytes left over are appended. */
#include <dirent.h>
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reflux.h"
#include "runtime/disk_cache.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

enum { MANIFEST, OBJECT, SOURCE, INDEX, RECORD, MEMO, N_FILES };

static const char source[] = "int f(void) { return 42; }\n";
static const char object[] = "object of f\n";
static const char context[] = "fuzz_cache context\n";
static const char description[] = "the program that generates f";
static const char record_key[] = "record key";
static const char payload[] = "record payload, 31 bytes long.";
static const char memo_name[] = "fuzz-memo";
static const char memo_value[] = "a memoised line";

static char cache_dir[64];

static int remove_path(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

static void remove_cache_dir(void) { nftw(cache_dir, remove_path, 16, FTW_DEPTH | FTW_PHYS); }

static rf_status compile_object(void *ctx, const char *src_path, const char *out_path)
{
    (void)ctx, (void)src_path;
    FILE *f = fopen(out_path, "wb");
    if (!f || fwrite(object, 1, strlen(object), f) != strlen(object) || fclose(f) != 0)
        abort();
    return RF_OK;
}

/* The cache checks an object against its manifest before loading it, so the
 * object loaded is always the one compiled. */
static rf_status load_object(void *ctx, const char *path)
{
    (void)ctx;
    char got[64] = {0};
    FILE *f = fopen(path, "rb");
    size_t n = f ? fread(got, 1, sizeof got - 1, f) : 0;
    if (f)
        fclose(f);
    if (n != strlen(object) || memcmp(got, object, n) != 0) {
        fprintf(stderr, "fuzz_cache: loaded an object that is not the one compiled\n");
        abort();
    }
    return RF_OK;
}

static const rfi_disk_cache_ops ops = {compile_object, load_object, NULL, ".so", ".c"};
static const rfi_disk_cache_index index_of_f = {description, sizeof description - 1};

/* The cache's file of the given kind: an entry's files are named by its
 * key, index and record files are the only ones with their extension. */
static void file_path(int kind, const char *key, char *buf, size_t n)
{
    static const char *const ext[N_FILES] = {".ok", ".so", ".c", ".idx", ".rec", ".memo"};
    if (kind <= SOURCE || kind == MEMO) {
        snprintf(buf, n, "%s/%s%s", cache_dir, kind == MEMO ? memo_name : key, ext[kind]);
        return;
    }
    buf[0] = '\0';
    DIR *d = opendir(cache_dir);
    for (struct dirent *e; d && (e = readdir(d)) != NULL;) {
        size_t len = strlen(e->d_name), el = strlen(ext[kind]);
        if (len > el && strcmp(e->d_name + len - el, ext[kind]) == 0)
            snprintf(buf, n, "%s/%s", cache_dir, e->d_name);
    }
    if (d)
        closedir(d);
}

/* Rewrites the file at path as the input says (see the top of the file). */
static void edit_file(const char *path, const uint8_t *data, size_t size)
{
    unsigned char buf[4096];
    FILE *f = fopen(path, "rb");
    size_t len = f ? fread(buf, 1, sizeof buf - 8, f) : 0;
    if (f)
        fclose(f);
    size_t cut = (size_t)data[1] | (size_t)data[2] << 8;
    if (cut != 0xffff && cut < len)
        len = cut;
    size_t at = 3;
    for (; at + 3 <= size && len > 0; at += 3)
        buf[((size_t)data[at] | (size_t)data[at + 1] << 8) % len] = data[at + 2];
    for (; at < size && len < sizeof buf; at++)
        buf[len++] = data[at];
    f = fopen(path, "wb");
    if (!f || (len && fwrite(buf, 1, len, f) != len) || fclose(f) != 0)
        abort();
}

/* The files as the cache writes them; the entry's key into key. */
static void write_valid_files(char key[RFI_CACHE_KEY_HEX])
{
    rfi_disk_cache_result res;
    if (rfi_disk_cache_get_indexed(source, context, &index_of_f, &ops, &res) != RF_OK)
        abort();
    memcpy(key, res.key, RFI_CACHE_KEY_HEX);
    rfi_disk_cache_result_free(&res);
    rfi_disk_cache_record_put(record_key, strlen(record_key), context, payload, strlen(payload));
    rfi_disk_cache_memo_put(memo_name, memo_value);
}

/* Every reader over the edited files: a miss, or what was written. */
static void read_back(void)
{
    rfi_disk_cache_result res;
    if (rfi_disk_cache_find_indexed(&index_of_f, context, &ops, &res))
        rfi_disk_cache_result_free(&res);
    if (rfi_disk_cache_get_indexed(source, context, &index_of_f, &ops, &res) != RF_OK) {
        fprintf(stderr, "fuzz_cache: no entry after an edit: %s\n", rf_errmsg());
        abort();
    }
    rfi_disk_cache_result_free(&res);
    char *got = NULL;
    size_t len = 0;
    if (rfi_disk_cache_record_get(record_key, strlen(record_key), context, &got, &len) &&
        (len != strlen(payload) || memcmp(got, payload, len) != 0)) {
        fprintf(stderr, "fuzz_cache: a record's payload changed\n");
        abort();
    }
    rfi_free(got);
    if (rfi_disk_cache_memo_get(memo_name, &got) && (strchr(got, '\n') || !*got))
        abort();
    rfi_free(got);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!cache_dir[0]) {
        snprintf(cache_dir, sizeof cache_dir, "/tmp/rf-fuzz-cache.XXXXXX");
        if (!mkdtemp(cache_dir) || setenv("RF_CACHE_DIR", cache_dir, 1) != 0)
            abort();
        atexit(remove_cache_dir);
    }
    if (size < 3)
        return 0;
    char key[RFI_CACHE_KEY_HEX], path[512];
    write_valid_files(key);
    file_path(data[0] % N_FILES, key, path, sizeof path);
    if (path[0])
        edit_file(path, data, size);
    read_back();
    return 0;
}
