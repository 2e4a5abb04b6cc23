/* fuzz_idx.c: libFuzzer target for rf_idx_load, the reader of IDX files
 * (plain or gzip-compressed) behind the Fashion-MNIST loader. The input is
 * written to a file and loaded, then written again gzip-compressed and
 * loaded (mutations of the compressed bytes themselves seldom get past the
 * CRC, so this is how the compressed path sees headers and data that make
 * sense); every input must load or be refused with an error status, never
 * crash, and leak nothing, and both files must give the same answer. */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "fuzz_file.h"
#include "reflux.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Loads path: the status, and the array's bytes (malloc'd) in *bytes. */
static rf_status load(const char *path, void **bytes, size_t *len)
{
    rf_array *a = NULL;
    rf_status st = rf_idx_load(path, &a);
    *bytes = NULL;
    *len = 0;
    if (st == RF_OK) {
        *len = rf_array_nbytes(a);
        *bytes = malloc(*len ? *len : 1);
        if (!*bytes || rf_array_read(a, *bytes, *len) != RF_OK)
            abort();
        rf_array_free(a);
    }
    return st;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *path = fuzz_input_file("idx", data, size);
    void *plain = NULL, *packed = NULL;
    size_t plain_len = 0, packed_len = 0;
    rf_status plain_st = load(path, &plain, &plain_len);
    unlink(path);
    /* a gzip stream can also hold an input that starts like one: the plain
     * load of such an input decompresses it, and the answers differ */
    bool gzip_already = size >= 2 && data[0] == 0x1f && data[1] == 0x8b;
    gzFile f = gzopen(path, "wb");
    if (!f || (size && gzwrite(f, data, (unsigned)size) != (int)size) || gzclose(f) != Z_OK)
        abort();
    rf_status packed_st = load(path, &packed, &packed_len);
    unlink(path);
    if (!gzip_already && (plain_st != packed_st || plain_len != packed_len ||
                          (plain_len && memcmp(plain, packed, plain_len) != 0)))
        abort(); /* one file's contents, two answers */
    free(plain);
    free(packed);
    return 0;
}
