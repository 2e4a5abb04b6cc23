/* test_disk_cache.c: the compiler driver and the on-disk module cache.
 *
 * Runs with a private RF_CACHE_DIR under a fresh temporary directory. Checks:
 * a small module compiles, loads and runs (including vector libm through
 * -fopenmp-simd); a second load, and a second process, call no compiler; two
 * processes racing on a new key compile exactly once; a truncated object or a
 * group/other-writable object is deleted and rebuilt; an untrusted cache
 * directory falls back to a private temporary one; a syntax error, a missing
 * compiler and an unloadable object give RF_E_COMPILE with the command line,
 * the compiler's output and the kept source; the compiler inherits no stray
 * file descriptors; the directory is created 0700; memoised values (the
 * compiler's version line) round-trip and untrusted ones are ignored; the
 * flag that keeps modules free of gathers is the first one the compiler
 * accepts, asked once per compiler binary, and a loop gcc would gather
 * compiles without them (objdump);
 * records (rfi_disk_cache_record_get/put) round-trip any bytes and read as
 * missing for another key or context, with any byte altered, cut short,
 * writable by others, or a header number written with a sign, a blank or
 * more than 19 digits, and a directory made at a record's name is replaced by
 * the next write. The size limit (RF_CACHE_MAX_MB) deletes the entries
 * used least recently (another backend's with all their files), never one
 * whose lock another holder has, nor the entry just built, nor temporary
 * files or files that are not the cache's; 0 means no limit. A child forked
 * while the parent holds an entry's lock (from inside its compile) neither
 * waits for ever on that entry nor keeps the parent or anyone else waiting.
 *
 * The program index (rfi_cc_load_program): a second load of a described
 * program, and a second process, generate no source; a truncated, garbled,
 * group/other-writable or foreign-owned index file is ignored and rewritten;
 * an index file that names a missing module, or holds another description,
 * falls back to generating the source; no index is kept in a fallback
 * directory; the build-id is found for the running binary and for no heap
 * address.
 *
 * Child mode (`test_disk_cache child VARIANT`, RF_CACHE_DIR inherited) loads
 * one module and prints "compiles=N hits=N value=V sources=N index_hits=N" on
 * stdout; `childidx VARIANT` does the same loading it as a described program.
 */
#include <dirent.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "backend/cpu/cc.h"
#include "runtime/disk_cache.h"
#include "test_util.h"

static char root[256];      /* the test's temporary directory */
static char cache_dir[512]; /* RF_CACHE_DIR */

/* A module that writes 42 + variant into buffer 0 and expf(0) (= 1) into the
 * 16 floats of buffer 1 through a vectorised libm call. */
static void module_source(char *buf, size_t n, int variant)
{
    snprintf(buf, n,
             "#include <stdint.h>\n"
             "#include <math.h>\n"
             "typedef struct rf_module_services rf_module_services;\n"
             "#pragma omp declare simd notinbranch\n"
             "float expf(float);\n"
             "int rf_module_run_v1(const rf_module_services *s, void *const *buffers)\n"
             "{\n"
             "    (void)s;\n"
             "    float *restrict y = buffers[1];\n"
             "    *(float *)buffers[0] = 42.0f + %d.0f;\n"
             "#pragma omp simd\n"
             "    for (int i = 0; i < 16; i++)\n"
             "        y[i] = expf(y[i] - (float)i * 0.0f);\n"
             "    return 0;\n"
             "}\n",
             variant);
}

/* Loads variant, runs it, returns the value it wrote (or -1). */
static float load_and_run(int variant, rfi_module **out, rf_status *st)
{
    char src[2048];
    module_source(src, sizeof src, variant);
    *st = rfi_cc_load_module(src, "test", out);
    if (*st != RF_OK)
        return -1;
    float v = 0, y[16] = {0};
    void *bufs[2] = {&v, y};
    rf_module_entry entry = rfi_module_entry_fn(*out);
    if (!entry || entry(NULL, bufs) != 0)
        return -1;
    for (int i = 0; i < 16; i++)
        if (y[i] != 1.0f)
            return -2;
    return v;
}

/* ---- Described programs (the index) ---------------------------------------------------- */

typedef struct generator {
    int variant;
    int calls;
} generator;

static rf_status generate(void *ctx, char **source)
{
    generator *g = ctx;
    g->calls++;
    char src[2048];
    module_source(src, sizeof src, g->variant);
    *source = rfi_strdup(src);
    return *source ? RF_OK : RF_E_NOMEM;
}

/* The description of variant's program (any bytes do; a NUL inside shows they
 * are compared as bytes). */
static size_t describe_variant(int variant, char *buf, size_t n)
{
    int len = snprintf(buf, n, "test program%cvariant %d", '\0', variant);
    return (size_t)len;
}

/* Loads variant as a described program and runs it; *gen_calls: how often its
 * source was generated. */
static float load_described(int variant, rfi_module **out, rf_status *st, int *gen_calls)
{
    char desc[64];
    size_t len = describe_variant(variant, desc, sizeof desc);
    generator g = {variant, 0};
    *st = rfi_cc_load_program(desc, len, generate, &g, "described", out);
    *gen_calls = g.calls;
    if (*st != RF_OK)
        return -1;
    float v = 0, y[16] = {0};
    void *bufs[2] = {&v, y};
    rf_module_entry entry = rfi_module_entry_fn(*out);
    return entry && entry(NULL, bufs) == 0 ? v : -1;
}

static int child_main(int variant, bool described)
{
    rfi_module *m = NULL;
    rf_status st;
    int calls = 0;
    float v = described ? load_described(variant, &m, &st, &calls) : load_and_run(variant, &m, &st);
    printf("compiles=%llu hits=%llu value=%g sources=%llu index_hits=%llu\n",
           (unsigned long long)rfi_cc_n_compiles(), (unsigned long long)rfi_cc_n_disk_hits(),
           (double)v, (unsigned long long)rfi_cc_n_sources(),
           (unsigned long long)rfi_cc_n_index_hits());
    if (st != RF_OK)
        fprintf(stderr, "child: %s\n", rf_errmsg());
    rfi_module_free(m);
    return st == RF_OK ? 0 : 1;
}

/* ---- Child processes ------------------------------------------------------------------ */

typedef struct child {
    pid_t pid;
    int out; /* read end of its stdout */
} child;

/* Starts this binary in child mode. If gate >= 0 the child's stdin is that fd
 * and it waits for EOF on it before loading (a start barrier); gate_w, the
 * barrier's write end, is closed in the child. */
static child spawn_child_mode(const char *mode, int variant, int gate, int gate_w)
{
    child c = {-1, -1};
    int p[2];
    if (pipe(p) != 0)
        return c;
    char var[16];
    snprintf(var, sizeof var, "%d", variant);
    c.pid = fork();
    if (c.pid == 0) {
        dup2(p[1], 1);
        close(p[0]);
        close(p[1]);
        if (gate >= 0) {
            dup2(gate, 0);
            close(gate);
            close(gate_w);
        }
        char *argv[] = {"test_disk_cache", (char *)mode, var, gate >= 0 ? "gate" : NULL, NULL};
        execv("/proc/self/exe", argv);
        _exit(127);
    }
    close(p[1]);
    c.out = p[0];
    return c;
}

static child spawn_child(int variant, int gate, int gate_w)
{
    return spawn_child_mode("child", variant, gate, gate_w);
}

typedef struct child_report {
    unsigned compiles, hits, sources, index_hits;
    float value;
} child_report;

/* Waits for a child; parses its report. Returns its exit code (or -1). */
static int finish_child_report(child c, child_report *r)
{
    char buf[256] = {0};
    size_t got = 0;
    ssize_t n;
    while (got < sizeof buf - 1 && (n = read(c.out, buf + got, sizeof buf - 1 - got)) > 0)
        got += (size_t)n;
    close(c.out);
    int ws = 0;
    if (c.pid < 0 || waitpid(c.pid, &ws, 0) != c.pid)
        return -1;
    r->compiles = r->hits = r->sources = r->index_hits = 999;
    r->value = -1;
    if (sscanf(buf, "compiles=%u hits=%u value=%f sources=%u index_hits=%u", &r->compiles,
               &r->hits, &r->value, &r->sources, &r->index_hits) != 5)
        fprintf(stderr, "child report: \"%s\"\n", buf);
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : -1;
}

static int finish_child(child c, unsigned *compiles, unsigned *hits, float *value)
{
    child_report r;
    int rc = finish_child_report(c, &r);
    *compiles = r.compiles;
    *hits = r.hits;
    *value = r.value;
    return rc;
}

/* ---- Helpers ------------------------------------------------------------------------- */

static bool exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0;
}

static unsigned mode_of(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 ? (unsigned)(st.st_mode & 07777) : 0xffff;
}

/* Replaces path with its first half under a new inode (what a torn write leaves). */
static void truncate_by_rename(const char *path)
{
    FILE *f = fopen(path, "rb");
    CHECK(f != NULL);
    if (!f)
        return;
    static char data[1 << 20];
    size_t n = fread(data, 1, sizeof data, f);
    fclose(f);
    char tmp[700];
    snprintf(tmp, sizeof tmp, "%s.cut", path);
    FILE *g = fopen(tmp, "wb");
    CHECK(g != NULL);
    if (!g)
        return;
    fwrite(data, 1, n / 2, g);
    fclose(g);
    chmod(tmp, 0700);
    CHECK(rename(tmp, path) == 0);
}

/* ---- Tests ------------------------------------------------------------------------------ */

static void test_first_load_and_hit(void)
{
    uint64_t c0 = rfi_cc_n_compiles(), h0 = rfi_cc_n_disk_hits();
    rfi_module *a = NULL, *b = NULL;
    rf_status st;
    CHECK_NEAR(load_and_run(0, &a, &st), 42.0, 0, 0);
    CHECK_OK(st);
    CHECK(a && a->compiled && a->cached);
    CHECK(rfi_cc_n_compiles() == c0 + 1);
    /* The directory and its missing parent were created 0700. */
    CHECK(mode_of(cache_dir) == 0700);
    char parent[600];
    snprintf(parent, sizeof parent, "%s/cache", root);
    CHECK(mode_of(parent) == 0700);
    if (a) {
        CHECK(exists(a->so_path) && exists(a->src_path));
        CHECK(strncmp(a->so_path, cache_dir, strlen(cache_dir)) == 0);
        CHECK(mode_of(a->so_path) == 0700);
        CHECK(mode_of(a->src_path) == 0600);
    }
    /* Same process, same source: a hit, no compiler. */
    CHECK_NEAR(load_and_run(0, &b, &st), 42.0, 0, 0);
    CHECK_OK(st);
    CHECK(b && !b->compiled);
    CHECK(rfi_cc_n_compiles() == c0 + 1);
    CHECK(rfi_cc_n_disk_hits() == h0 + 1);
    rfi_module_free(a);
    rfi_module_free(b);
}

static void test_second_process_calls_no_compiler(void)
{
    unsigned compiles, hits;
    float v;
    CHECK(finish_child(spawn_child(0, -1, -1), &compiles, &hits, &v) == 0);
    CHECK(compiles == 0);
    CHECK(hits == 1);
    CHECK_NEAR(v, 42.0, 0, 0);
}

static void test_concurrent_processes_compile_once(void)
{
    int gate[2];
    CHECK(pipe(gate) == 0);
    child a = spawn_child(1, gate[0], gate[1]);
    child b = spawn_child(1, gate[0], gate[1]);
    close(gate[0]);
    close(gate[1]); /* both start loading now */
    unsigned ca, ha, cb, hb;
    float va, vb;
    CHECK(finish_child(a, &ca, &ha, &va) == 0);
    CHECK(finish_child(b, &cb, &hb, &vb) == 0);
    CHECK(ca + cb == 1);
    CHECK(ha + hb == 1);
    CHECK_NEAR(va, 43.0, 0, 0);
    CHECK_NEAR(vb, 43.0, 0, 0);
}

/* Loads program 0 (from the cache or compiled) and writes its object's path
 * into so; the module is freed again, so nothing of it stays mapped. */
static void entry_object(char *so, size_t n)
{
    rfi_module *m = NULL;
    rf_status st;
    CHECK_NEAR(load_and_run(0, &m, &st), 42.0, 0, 0);
    snprintf(so, n, "%s", m ? m->so_path : "");
    rfi_module_free(m);
}

static void test_corrupt_entry_is_rebuilt(void)
{
    rfi_module *m = NULL;
    rf_status st;
    char so[600];
    entry_object(so, sizeof so);
    truncate_by_rename(so);
    uint64_t c0 = rfi_cc_n_compiles();
    CHECK_NEAR(load_and_run(0, &m, &st), 42.0, 0, 0);
    CHECK_OK(st);
    CHECK(m && m->compiled);
    CHECK(rfi_cc_n_compiles() == c0 + 1);
    rfi_module_free(m);
    /* The rebuilt entry is whole again: the next load is a hit. */
    CHECK_NEAR(load_and_run(0, &m, &st), 42.0, 0, 0);
    CHECK(m && !m->compiled);
    rfi_module_free(m);
}

/* Policy: an entry file writable by group or others is never loaded; the
 * entry is deleted and rebuilt. */
static void test_writable_file_is_never_loaded(void)
{
    rfi_module *m = NULL;
    rf_status st;
    char so[600];
    entry_object(so, sizeof so);
    CHECK(chmod(so, 0666) == 0);
    uint64_t c0 = rfi_cc_n_compiles();
    CHECK_NEAR(load_and_run(0, &m, &st), 42.0, 0, 0);
    CHECK(m && m->compiled);
    CHECK(rfi_cc_n_compiles() == c0 + 1);
    CHECK(mode_of(so) == 0700);
    rfi_module_free(m);
}

/* Something other than a regular file where an entry's file belongs is
 * never read: a FIFO (opening it for reading would wait for a writer for
 * ever, holding the entry's lock) or an empty directory (no file could be
 * renamed over it) is removed and the entry rebuilt. */
static void test_special_files_are_replaced(void)
{
    for (int kind = 0; kind < 2; kind++) {
        rfi_module *m = NULL;
        rf_status st;
        char so[600];
        entry_object(so, sizeof so);
        CHECK(unlink(so) == 0);
        CHECK(kind == 0 ? mkfifo(so, 0600) == 0 : mkdir(so, 0700) == 0);
        uint64_t c0 = rfi_cc_n_compiles();
        CHECK_NEAR(load_and_run(0, &m, &st), 42.0, 0, 0);
        CHECK_OK(st);
        CHECK(m && m->compiled);
        CHECK(rfi_cc_n_compiles() == c0 + 1);
        struct stat sb;
        CHECK(stat(so, &sb) == 0 && S_ISREG(sb.st_mode));
        rfi_module_free(m);
    }
}

/* A directory or a symlink at an entry's lock file is removed and the lock made again:
 * the intact entry loads (no compile), where every compile of it failed to lock. */
static void test_bad_lock_path_is_replaced(void)
{
    for (int kind = 0; kind < 2; kind++) {
        char so[600], lock[620];
        entry_object(so, sizeof so);
        size_t len = strlen(so);
        const char *dot = strrchr(so, '.');
        CHECK(dot != NULL);
        snprintf(lock, sizeof lock, "%.*s.lock", (int)(dot ? (size_t)(dot - so) : len), so);
        unlink(lock);
        CHECK(kind == 0 ? mkdir(lock, 0700) == 0 : symlink("/nonexistent", lock) == 0);
        rfi_module *m = NULL;
        rf_status st;
        uint64_t c0 = rfi_cc_n_compiles();
        CHECK_NEAR(load_and_run(0, &m, &st), 42.0, 0, 0);
        CHECK_OK(st);
        CHECK(rfi_cc_n_compiles() == c0);
        struct stat sb;
        CHECK(lstat(lock, &sb) != 0 || S_ISREG(sb.st_mode)); /* a file, or gone */
        rfi_module_free(m);
    }
}

/* Memoised values (the compiler's version line): round trip, a memo of the
 * compiler was written by the loads above, names are checked, an untrusted or
 * multi-line memo is ignored. */
static void test_memo(void)
{
    char *v = NULL;
    rfi_disk_cache_memo_put("test-memo_1", "value one");
    CHECK(rfi_disk_cache_memo_get("test-memo_1", &v) && v && strcmp(v, "value one") == 0);
    rfi_free(v);
    rfi_disk_cache_memo_put("test-memo_1", "two\nlines"); /* refused: keeps the old value */
    CHECK(rfi_disk_cache_memo_get("test-memo_1", &v) && v && strcmp(v, "value one") == 0);
    rfi_free(v);
    rfi_disk_cache_memo_put("../escape", "x");
    CHECK(!rfi_disk_cache_memo_get("../escape", &v) && v == NULL);
    char path[700];
    snprintf(path, sizeof path, "%s/../escape.memo", cache_dir);
    CHECK(!exists(path));
    CHECK(!rfi_disk_cache_memo_get("missing", &v) && v == NULL);
    snprintf(path, sizeof path, "%s/test-memo_1.memo", cache_dir);
    CHECK(chmod(path, 0666) == 0);
    CHECK(!rfi_disk_cache_memo_get("test-memo_1", &v) && v == NULL);
    /* the compiler's version line was memoised by the first load */
    char cmd[800];
    snprintf(cmd, sizeof cmd, "ls %s | grep -q '^cc-version-.*\\.memo$'", cache_dir);
    CHECK(system(cmd) == 0);
}

/* The one record file in the cache directory into path. */
static bool record_file(char *path, size_t n)
{
    DIR *d = opendir(cache_dir);
    int found = 0;
    if (!d)
        return false;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        size_t len = strlen(e->d_name);
        if (len > 4 && strcmp(e->d_name + len - 4, ".rec") == 0 && found++ == 0)
            snprintf(path, n, "%s/%s", cache_dir, e->d_name);
    }
    closedir(d);
    return found == 1;
}

/* Whether the record of (key, context) reads back as exactly want. */
static bool record_is(const char *key, const char *context, const char *want, size_t want_len)
{
    char *got = NULL;
    size_t len = 0;
    bool ok = rfi_disk_cache_record_get(key, strlen(key), context, &got, &len);
    bool same = ok && got && len == want_len && memcmp(got, want, len) == 0 && got[len] == '\0';
    rfi_free(got);
    return same;
}

static void test_records(void)
{
    char payload[3000];
    for (size_t i = 0; i < sizeof payload; i++)
        payload[i] = (char)(i * 7 + 3); /* any bytes, NULs included */
    const char *key = "the key\0", *ctx = "context one\n";
    char *got = NULL;
    size_t len = 0;
    CHECK(!rfi_disk_cache_record_get(key, strlen(key), ctx, &got, &len) && !got);
    rfi_disk_cache_record_put(key, strlen(key), ctx, payload, sizeof payload);
    CHECK(record_is(key, ctx, payload, sizeof payload));
    CHECK(!record_is(key, "context two\n", payload, sizeof payload)); /* another context */
    CHECK(!record_is("the kez", ctx, payload, sizeof payload));         /* another key */
    char path[700];
    CHECK(record_file(path, sizeof path));
    CHECK(mode_of(path) == 0600);
    struct stat st;
    CHECK(stat(path, &st) == 0);
    /* every byte altered, one at a time: the record reads as missing */
    int fd = open(path, O_RDWR);
    CHECK(fd >= 0);
    int misses = 0, tried = 0;
    for (off_t at = 0; fd >= 0 && at < st.st_size; at += 97) {
        unsigned char c, flipped;
        CHECK(pread(fd, &c, 1, at) == 1);
        flipped = (unsigned char)(c ^ 0x20);
        CHECK(pwrite(fd, &flipped, 1, at) == 1);
        misses += !rfi_disk_cache_record_get(key, strlen(key), ctx, &got, &len);
        rfi_free(got);
        got = NULL;
        tried++;
        CHECK(pwrite(fd, &c, 1, at) == 1);
    }
    CHECK(misses == tried && tried > 10);
    CHECK(record_is(key, ctx, payload, sizeof payload)); /* restored */
    /* the header's numbers are exactly what the writer prints: no sign, no
     * blank, no number past 19 digits (sscanf took the first two, and the
     * third is undefined behaviour there) */
    static const char *const fields[] = {"key=+", "key= ", "key=0000000000000000000000"};
    for (size_t i = 0; fd >= 0 && i < sizeof fields / sizeof fields[0]; i++) {
        size_t size = (size_t)st.st_size, extra = strlen(fields[i]) - 4;
        char *file = malloc(size), *edited = malloc(size + extra);
        CHECK(file && edited && pread(fd, file, size, 0) == (ssize_t)size);
        char *at = file ? memmem(file, size, "key=", 4) : NULL;
        CHECK(at != NULL);
        if (at && edited) {
            size_t before = (size_t)(at - file);
            memcpy(edited, file, before);
            memcpy(edited + before, fields[i], extra + 4);
            memcpy(edited + before + extra + 4, at + 4, size - before - 4);
            CHECK(pwrite(fd, edited, size + extra, 0) == (ssize_t)(size + extra));
            CHECK(!record_is(key, ctx, payload, sizeof payload));
            CHECK(ftruncate(fd, st.st_size) == 0 && pwrite(fd, file, size, 0) == (ssize_t)size);
            CHECK(record_is(key, ctx, payload, sizeof payload));
        }
        free(file);
        free(edited);
    }
    CHECK(fd >= 0 && ftruncate(fd, st.st_size - 1) == 0); /* cut short */
    CHECK(!record_is(key, ctx, payload, sizeof payload));
    if (fd >= 0)
        close(fd);
    rfi_disk_cache_record_put(key, strlen(key), ctx, payload, sizeof payload); /* rewritten */
    CHECK(record_is(key, ctx, payload, sizeof payload));
    CHECK(chmod(path, 0620) == 0); /* writable by the group: never trusted */
    CHECK(!record_is(key, ctx, payload, sizeof payload));
    CHECK(unlink(path) == 0);
    rfi_disk_cache_record_put(key, strlen(key), ctx, "", 0); /* an empty payload is a payload */
    CHECK(record_is(key, ctx, "", 0));
    CHECK(record_file(path, sizeof path) && unlink(path) == 0);
    /* a directory made at the record's name is replaced (renaming over it failed
     * for good, so the record was never kept again) */
    CHECK(mkdir(path, 0700) == 0);
    CHECK(!record_is(key, ctx, payload, sizeof payload));
    rfi_disk_cache_record_put(key, strlen(key), ctx, payload, sizeof payload);
    CHECK(record_is(key, ctx, payload, sizeof payload));
    CHECK(stat(path, &st) == 0 && S_ISREG(st.st_mode));
    CHECK(unlink(path) == 0 || rmdir(path) == 0);
}

/* Loads variant 0 with RF_CACHE_DIR=dir, which must be refused. */
static void check_falls_back(const char *dir)
{
    setenv("RF_CACHE_DIR", dir, 1);
    rfi_module *m = NULL;
    rf_status st;
    CHECK_NEAR(load_and_run(0, &m, &st), 42.0, 0, 0);
    CHECK_OK(st);
    CHECK(m && m->compiled && !m->cached);
    if (m) {
        CHECK(strncmp(m->so_path, dir, strlen(dir)) != 0);
        CHECK(!exists(m->so_path)); /* private files are removed once loaded */
        char key_so[700];
        snprintf(key_so, sizeof key_so, "%s/%s.so", dir, m->key);
        CHECK(!exists(key_so));
    }
    rfi_module_free(m);
    setenv("RF_CACHE_DIR", cache_dir, 1);
}

static void test_untrusted_dir_falls_back(void)
{
    char bad[600];
    snprintf(bad, sizeof bad, "%s/open", root);
    CHECK(mkdir(bad, 0700) == 0);
    CHECK(chmod(bad, 0777) == 0);
    check_falls_back(bad);
    char *dir = NULL;
    setenv("RF_CACHE_DIR", bad, 1);
    CHECK_STATUS(rfi_disk_cache_dir(&dir), RF_E_INVALID);
    CHECK_MSG("writable by group or others");
    setenv("RF_CACHE_DIR", cache_dir, 1);
    rfi_free(dir);
    /* a file where the directory should be */
    snprintf(bad, sizeof bad, "%s/plainfile", root);
    FILE *f = fopen(bad, "w");
    CHECK(f != NULL);
    if (f)
        fclose(f);
    check_falls_back(bad);
    setenv("RF_CACHE_DIR", bad, 1);
    dir = NULL;
    CHECK_STATUS(rfi_disk_cache_dir(&dir), RF_E_INVALID);
    CHECK_MSG("plainfile: not a directory");
    setenv("RF_CACHE_DIR", cache_dir, 1);
    rfi_free(dir);
    if (geteuid() == 0) { /* root can give the directory away */
        snprintf(bad, sizeof bad, "%s/foreign", root);
        CHECK(mkdir(bad, 0700) == 0);
        CHECK(chown(bad, 65534, 65534) == 0);
        check_falls_back(bad);
        setenv("RF_CACHE_DIR", bad, 1);
        CHECK_STATUS(rfi_disk_cache_dir(&dir), RF_E_INVALID);
        CHECK_MSG("not owned by the current user");
        setenv("RF_CACHE_DIR", cache_dir, 1);
    }
    /* a path too long for the file system: said so (it said no variable named one) */
    static char long_path[PATH_MAX + 16];
    memset(long_path, 'a', sizeof long_path - 1);
    long_path[0] = '/';
    setenv("RF_CACHE_DIR", long_path, 1);
    CHECK_STATUS(rfi_disk_cache_dir(&dir), RF_E_INVALID);
    CHECK_MSG("the directory's path is too long");
    setenv("RF_CACHE_DIR", cache_dir, 1);
}

static void test_dir_from_xdg_and_home(void)
{
    char want[700], env[600];
    char *dir = NULL;
    unsetenv("RF_CACHE_DIR");
    snprintf(env, sizeof env, "%s/xdg", root);
    setenv("XDG_CACHE_HOME", env, 1);
    CHECK_OK(rfi_disk_cache_dir(&dir));
    snprintf(want, sizeof want, "%s/xdg/reflux", root);
    CHECK(dir && strcmp(dir, want) == 0);
    rfi_free(dir);
    unsetenv("XDG_CACHE_HOME");
    snprintf(env, sizeof env, "%s/home", root);
    setenv("HOME", env, 1);
    CHECK_OK(rfi_disk_cache_dir(&dir));
    snprintf(want, sizeof want, "%s/home/.cache/reflux", root);
    CHECK(dir && strcmp(dir, want) == 0);
    CHECK(mode_of(want) == 0700);
    rfi_free(dir);
    setenv("RF_CACHE_DIR", cache_dir, 1);
}

/* A source in parts (RF_PARTS, RF_IN_PART as render_c.c writes them): the
 * driver compiles each part apart and links them, so the entry point in the
 * last part calls functions of the others, leaving no object behind; a part
 * that does not compile is reported with its own command line. */
static const char parts_source[] =
    "#define RF_PARTS 3\n"
    "#ifndef RF_PART\n#define RF_KERNEL static\n#define RF_IN_PART(p) 1\n"
    "#else\n#define RF_KERNEL __attribute__((visibility(\"hidden\")))\n"
    "#define RF_IN_PART(p) ((p) == RF_PART)\n#endif\n"
    "typedef struct rf_module_services rf_module_services;\n"
    "RF_KERNEL float one(void);\nRF_KERNEL float two(void);\n"
    "#if RF_IN_PART(0)\nRF_KERNEL float one(void) { return 1.0f; }\n#endif\n"
    "#if RF_IN_PART(1)\nRF_KERNEL float two(void) { return %s; }\n#endif\n"
    "#if RF_IN_PART(2)\n"
    "int rf_module_run_v1(const rf_module_services *s, void *const *buffers)\n"
    "{\n    (void)s;\n    *(float *)buffers[0] = one() + two() + %d.0f;\n    return 0;\n}\n"
    "#endif\n";

static void test_module_in_parts(void)
{
    char src[2048];
    snprintf(src, sizeof src, parts_source, "2.0f", 7);
    rfi_module *m = NULL;
    uint64_t before = rfi_cc_n_compiles();
    CHECK_OK(rfi_cc_load_module(src, "parts", &m));
    CHECK(rfi_cc_n_compiles() == before + 1);
    float v = 0;
    void *bufs[1] = {&v};
    rf_module_entry entry = m ? rfi_module_entry_fn(m) : NULL;
    CHECK(entry && entry(NULL, bufs) == 0 && v == 10.0f);
    rfi_module_free(m);
    DIR *d = opendir(cache_dir);
    int objects = 0;
    for (struct dirent *e = d ? readdir(d) : NULL; e; e = readdir(d))
        objects += strstr(e->d_name, ".o") != NULL && strstr(e->d_name, ".part") != NULL;
    if (d)
        closedir(d);
    CHECK(objects == 0);
    snprintf(src, sizeof src, parts_source, "oops", 8);
    CHECK_STATUS(rfi_cc_load_module(src, "broken parts", &m), RF_E_COMPILE);
    CHECK(m == NULL);
    CHECK_MSG("compiling module broken parts failed (exit status 1)");
    CHECK_MSG(" -c -DRF_PART=1 -o ");
    CHECK_MSG("oops");
    printf("module in parts: 3 parts linked into one module (%g), a failing part reported\n", v);
}

/* The flags cc.c adds for this architecture after the common ones. */
#if defined(__x86_64__)
#define ARCH_FLAGS " -mno-red-zone"
#else
#define ARCH_FLAGS ""
#endif

static void test_syntax_error_reports(void)
{
    const char *src = "int rf_module_run_v1(void *s, void **b) { return oops; }\n";
    rfi_module *m = NULL;
    CHECK_STATUS(rfi_cc_load_module(src, "broken", &m), RF_E_COMPILE);
    CHECK(m == NULL);
    CHECK_MSG("compiling module broken failed (exit status 1)");
    CHECK_MSG("-O2 -std=c11 -fPIC -shared -fopenmp-simd -fno-math-errno -fno-trapping-math "
              "-funswitch-loops -march=native -ffp-contract=fast" ARCH_FLAGS " ");
    CHECK_MSG(" -o "); /* after the gather flag this compiler takes, if any */
    CHECK_MSG("-lm");
    CHECK_MSG("oops"); /* the compiler's diagnostic */
    CHECK_MSG("error");
    char *context = NULL, key[RFI_CACHE_KEY_HEX], kept[700];
    CHECK_OK(rfi_cc_context(&context));
    rfi_disk_cache_key(src, context ? context : "", key);
    rfi_free(context);
    snprintf(kept, sizeof kept, "source kept at: %s/%s.c", cache_dir, key);
    CHECK_MSG(kept);
    CHECK(exists(kept + strlen("source kept at: ")));
}

static void test_unloadable_object_reports(void)
{
    const char *src = "void rf_no_such_function_anywhere(void);\n"
                      "int rf_module_run_v1(void *s, void **b)\n"
                      "{ (void)s; (void)b; rf_no_such_function_anywhere(); return 0; }\n";
    rfi_module *m = NULL;
    CHECK_STATUS(rfi_cc_load_module(src, "unloadable", &m), RF_E_COMPILE);
    CHECK_MSG("rf_no_such_function_anywhere");
    const char *missing_entry = "int not_the_entry(void) { return 0; }\n";
    CHECK_STATUS(rfi_cc_load_module(missing_entry, "noentry", &m), RF_E_COMPILE);
    CHECK_MSG("no entry point rf_module_run_v1");
    CHECK(m == NULL);
}

/* $CC as it is (NULL: unset), for cc_restore after a test sets its own. */
static char *cc_save(void)
{
    const char *cc = getenv("CC");
    return cc ? strdup(cc) : NULL;
}

static void cc_restore(char *saved)
{
    if (saved)
        setenv("CC", saved, 1);
    else
        unsetenv("CC");
    free(saved);
}

static void test_compiler_override_and_fds(void)
{
    char *saved_cc = cc_save();
    /* A missing compiler. */
    setenv("CC", "/nonexistent/reflux-cc", 1);
    rfi_module *m = NULL;
    CHECK_STATUS(rfi_cc_load_module("int x;", "nocc", &m), RF_E_COMPILE);
    CHECK_MSG("/nonexistent/reflux-cc");
    /* A fake compiler that reports whether fd 100 (open in this process, not
     * close-on-exec) reached it, then fails. */
    char script[600];
    snprintf(script, sizeof script, "%s/fake-cc", root);
    FILE *f = fopen(script, "w");
    CHECK(f != NULL);
    if (f) {
        fputs("#!/bin/sh\n"
              "if [ \"$1\" = --version ]; then echo 'fake-cc 1.0'; exit 0; fi\n"
              "if [ -e /proc/$$/fd/100 ]; then echo FD-LEAKED; else echo FDS-CLEAN; fi\n"
              "exit 3\n",
              f);
        fclose(f);
    }
    chmod(script, 0700);
    int marker = fcntl(0, F_DUPFD, 100);
    CHECK(marker == 100);
    setenv("CC", script, 1);
    CHECK_STATUS(rfi_cc_load_module("int y;", "fake", &m), RF_E_COMPILE);
    CHECK_MSG("(exit status 3)");
    CHECK_MSG("FDS-CLEAN");
    CHECK_MSG("fake-cc -O2");
    char *context = NULL;
    CHECK_OK(rfi_cc_context(&context));
    CHECK(context && strstr(context, "compiler_version=fake-cc 1.0"));
    rfi_free(context);
    close(marker);
    cc_restore(saved_cc);
    CHECK_OK(rfi_cc_context(&context));
    CHECK(context && !strstr(context, "fake-cc"));
    rfi_free(context);
}

/* A compiler that does not finish is killed after RF_CC_TIMEOUT seconds, with
 * what it started (its process group), and the compile fails saying so; one
 * that leaves a background process holding its output is not waited for. */
static void test_compiler_timeout(void)
{
    char *saved_cc = cc_save();
    char script[600], log[600];
    snprintf(script, sizeof script, "%s/slow-cc", root);
    snprintf(log, sizeof log, "%s/slow-cc.log", root);
    for (int kind = 0; kind < 2; kind++) {
        char text[1000];
        if (kind == 0) /* every run but --version's leaves a line in the log */
            snprintf(text, sizeof text, "#!/bin/sh\n"
                     "if [ \"$1\" = --version ]; then echo 'slow-cc 1.0'; exit 0; fi\n"
                     "echo run >> %s\n"
                     "sleep 300\n", log);
        else
            snprintf(text, sizeof text, "#!/bin/sh\n"
                     "sleep 30 &\n"
                     "if [ \"$1\" = --version ]; then echo 'bg-cc 1.0'; exit 0; fi\n"
                     "exit 4\n");
        tu_write_script(script, text);
        setenv("CC", script, 1);
        setenv("RF_CC_TIMEOUT", "1", 1);
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        rfi_module *m = NULL;
        CHECK_STATUS(rfi_cc_load_module(kind ? "int b;" : "int s;", "slow", &m), RF_E_COMPILE);
        CHECK_MSG(kind == 0 ? "timed out after 1 s (RF_CC_TIMEOUT) and killed" : "exit status 4");
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double secs = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
        CHECK(secs < 20);
        unsetenv("RF_CC_TIMEOUT");
        if (kind == 0) {
            /* one flag probe timed out and ended the probing (each would have
             * waited as long), then the compile itself */
            int runs = 0;
            FILE *l = fopen(log, "r");
            for (int c; l && (c = fgetc(l)) != EOF;)
                runs += c == '\n';
            if (l)
                fclose(l);
            CHECK(runs == 2);
        }
    }
    cc_restore(saved_cc);
}

/* A compiler that exits 0 without writing its object: RF_E_COMPILE naming
 * the command, where the cache said it could not read the object back
 * (RF_E_IO). */
static void test_compiler_writes_nothing(void)
{
    char *saved_cc = cc_save();
    char script[600];
    snprintf(script, sizeof script, "%s/silent-cc", root);
    tu_write_script(script, "#!/bin/sh\n"
                         "if [ \"$1\" = --version ]; then echo 'silent-cc 1.0'; exit 0; fi\n"
                         "exit 0\n");
    setenv("CC", script, 1);
    rfi_module *m = NULL;
    CHECK_STATUS(rfi_cc_load_module("int silent;", "silent", &m), RF_E_COMPILE);
    CHECK_MSG("the compiler exited 0 but wrote no object");
    CHECK_MSG("silent-cc");
    CHECK(m == NULL);
    cc_restore(saved_cc);
}

/* Whether process pid has ended (gone, or a zombie nobody reaped yet). */
static bool process_ended(pid_t pid)
{
    char path[64], stat[256] = "";
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return true;
    size_t n = fread(stat, 1, sizeof stat - 1, f);
    fclose(f);
    stat[n] = '\0';
    const char *paren = strrchr(stat, ')');
    return paren && paren[1] == ' ' && paren[2] == 'Z';
}

/* A process killed while its compiler runs takes the compiler with it: the
 * compiler used to run on and write into the cache. */
static void test_compiler_dies_with_its_process(void)
{
    char *saved_cc = cc_save();
    char script[600], pidfile[600];
    snprintf(script, sizeof script, "%s/stuck-cc", root);
    snprintf(pidfile, sizeof pidfile, "%s/stuck-cc.pid", root);
    unlink(pidfile);
    char text[2200];
    snprintf(text, sizeof text, "#!/bin/sh\n"
             "if [ \"$1\" = --version ]; then echo 'stuck-cc 1.0'; exit 0; fi\n"
             "echo $$ > %s.new && mv %s.new %s\n"
             "exec sleep 300\n", pidfile, pidfile, pidfile);
    tu_write_script(script, text);
    setenv("CC", script, 1);
    pid_t child = fork();
    if (child == 0) {
        rfi_module *m = NULL;
        rfi_cc_load_module("int stuck;", "stuck", &m);
        _exit(0);
    }
    pid_t compiler = 0;
    for (int i = 0; i < 400 && compiler <= 0; i++) { /* up to 20 s */
        FILE *p = fopen(pidfile, "r");
        if (p) {
            int v = 0;
            if (fscanf(p, "%d", &v) == 1)
                compiler = v;
            fclose(p);
        }
        if (compiler <= 0)
            usleep(50000);
    }
    CHECK(compiler > 0);
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    bool ended = false;
    for (int i = 0; i < 100 && compiler > 0 && !(ended = process_ended(compiler)); i++)
        usleep(50000);
    CHECK(ended);
    if (compiler > 0 && !ended)
        kill(compiler, SIGKILL);
    cc_restore(saved_cc);
}

/* $CC with more words, as make's: a wrapper and the compiler it runs ("ccache
 * gcc"), plus a flag. Every command starts with them: the version probe and the
 * compile (a wrapper that logs its arguments and runs them); the identity names
 * them. Too many words are refused with a message. */
static void test_compiler_with_arguments(void)
{
    char *saved_cc = cc_save();
    char script[600], log[600], cc[1400];
    snprintf(script, sizeof script, "%s/wrap-cc", root);
    snprintf(log, sizeof log, "%s/wrap-cc.log", root);
    FILE *f = fopen(script, "w");
    CHECK(f != NULL);
    if (f) {
        fprintf(f, "#!/bin/sh\necho \"$*\" >> '%s'\nexec \"$@\"\n", log);
        fclose(f);
    }
    chmod(script, 0700);
    snprintf(cc, sizeof cc, " %s\tcc  -DRF_WRAPPED=1 ", script);
    setenv("CC", cc, 1);
    rfi_module *m = NULL;
    rf_status st = RF_OK;
    CHECK(load_and_run(7, &m, &st) == 49.0f);
    CHECK_OK(st);
    rfi_module_free(m);
    char *context = NULL;
    CHECK_OK(rfi_cc_context(&context));
    CHECK(context && strstr(context, "\ncompiler_args=cc -DRF_WRAPPED=1\n"));
    rfi_free(context);
    int version = 0, compile = 0;
    char line[2048];
    f = fopen(log, "r");
    CHECK(f != NULL);
    while (f && fgets(line, sizeof line, f)) {
        version += strcmp(line, "cc -DRF_WRAPPED=1 --version\n") == 0;
        compile += strncmp(line, "cc -DRF_WRAPPED=1 -O2 ", 22) == 0;
    }
    if (f)
        fclose(f);
    CHECK(version == 1);
    CHECK(compile == 1);
    setenv("CC", "cc 1 2 3 4 5 6 7 8 9", 1);
    CHECK_STATUS(rfi_cc_context(&context), RF_E_COMPILE);
    CHECK_MSG("CC='cc 1 2 3 4 5 6 7 8 9': a compiler and at most 8 more words");
    cc_restore(saved_cc);
}

/* The compiler's memos are written when its identity is first worked out, also before
 * anything has made the cache directory (a second process asked the compiler again). */
static void test_memos_in_a_fresh_dir(void)
{
    char fresh[700], cmd[800];
    snprintf(fresh, sizeof fresh, "%s/fresh-cache", root);
    char *saved_cc = cc_save();
    setenv("RF_CACHE_DIR", fresh, 1);
    setenv("CC", "cc -std=c11", 1); /* an identity this process has not worked out */
    char *context = NULL;
    CHECK_OK(rfi_cc_context(&context));
    rfi_free(context);
    snprintf(cmd, sizeof cmd, "ls '%s' | grep -q '^cc-version-.*\\.memo$'", fresh);
    CHECK(system(cmd) == 0);
    cc_restore(saved_cc);
    setenv("RF_CACHE_DIR", cache_dir, 1);
}

/* The context of the compiler `cc` worked out again: another compiler's first, so this
 * process's identity cache does not answer (owned). */
static char *context_again(const char *cc)
{
    char *context = NULL;
    unsetenv("CC");
    CHECK_OK(rfi_cc_context(&context));
    rfi_free(context);
    context = NULL;
    setenv("CC", cc, 1);
    CHECK_OK(rfi_cc_context(&context));
    return context;
}

/* Lines of a fake compiler's log that are flag probes. */
static int count_probes(const char *log)
{
    int probes = 0;
    char line[1024];
    FILE *f = fopen(log, "r");
    CHECK(f != NULL);
    while (f && fgets(line, sizeof line, f))
        probes += strncmp(line, "-fsyntax-only", 13) == 0;
    if (f)
        fclose(f);
    return probes;
}

/* The flag that keeps modules free of gathers (cc.c): a fake compiler that
 * accepts Debian's gcc 12.2's and gcc 11's spellings gets the more complete one, in
 * its context and in its compile command, and is asked once: a second lookup
 * of the same binary reads the memo. The fake logs every run that is not
 * --version. */
static void test_no_gather_flag(void)
{
#if defined(__x86_64__) || defined(__i386__)
    char *saved_cc = cc_save();
    char script[600], log[600];
    snprintf(script, sizeof script, "%s/gather-cc", root);
    snprintf(log, sizeof log, "%s/gather-cc.log", root);
    FILE *f = fopen(script, "w");
    CHECK(f != NULL);
    if (f) {
        fprintf(f,
                "#!/bin/sh\n"
                "if [ \"$1\" = --version ]; then echo 'gather-cc 2.0'; exit 0; fi\n"
                "echo \"$*\" >> '%s'\n"
                "if [ \"$1\" = -fsyntax-only ]; then\n"
                "    [ \"$4\" = '-mtune-ctrl=^use_gather' ] && exit 0\n"
                "    [ \"$4\" = '-mtune-ctrl=^use_gather,^use_gather_2parts,"
                "^use_gather_4parts' ] && exit 0\n"
                "    echo \"unknown option $4\" >&2; exit 1\n"
                "fi\n"
                "exit 3\n",
                log);
        fclose(f);
    }
    chmod(script, 0700);
    setenv("CC", script, 1);
    static const char chosen[] =
        "-mno-red-zone -mtune-ctrl=^use_gather,^use_gather_2parts,^use_gather_4parts -lm";
    char *context = NULL;
    CHECK_OK(rfi_cc_context(&context));
    CHECK(context && strstr(context, chosen));
    rfi_free(context);
    rfi_module *m = NULL;
    CHECK_STATUS(rfi_cc_load_module("int z;", "gather", &m), RF_E_COMPILE);
    CHECK_MSG("-mtune-ctrl=^use_gather,^use_gather_2parts,^use_gather_4parts -o");
    context = context_again(script); /* from the memo */
    CHECK(context && strstr(context, chosen));
    rfi_free(context);
    /* a damaged memo (a torn write: "-mtune-ctrl") never reaches a command line: the
     * compiler is asked again */
    char cmd[900];
    snprintf(cmd, sizeof cmd,
             "for f in '%s'/cc-gather2-*.memo; do printf %%s -mtune-ctrl > \"$f\"; done",
             cache_dir);
    CHECK(system(cmd) == 0);
    context = context_again(script);
    CHECK(context && strstr(context, chosen));
    rfi_free(context);
    /* -mno-gather and gcc 13's names refused, then Debian's gcc 12.2's accepted; again
     * after the damage */
    CHECK(count_probes(log) == 6);

    /* a probe that could not finish (the compiler killed) gives no answer to remember:
     * asked again next time, where a stored "none" would drop the flag for good */
    snprintf(script, sizeof script, "%s/crash-cc", root);
    snprintf(log, sizeof log, "%s/crash-cc.log", root);
    f = fopen(script, "w");
    CHECK(f != NULL);
    if (f) {
        fprintf(f,
                "#!/bin/sh\n"
                "if [ \"$1\" = --version ]; then echo 'crash-cc 1.0'; exit 0; fi\n"
                "echo \"$*\" >> '%s'\n"
                "kill -KILL $$\n",
                log);
        fclose(f);
    }
    chmod(script, 0700);
    for (int k = 0; k < 2; k++) {
        context = context_again(script);
        CHECK(context && !strstr(context, "gather"));
        rfi_free(context);
    }
    CHECK(count_probes(log) == 2); /* asked again; the first probe's failure ends each */
    cc_restore(saved_cc);
#endif
}

/* A module whose loop gcc 12 vectorises with gathers (clamped loads) is
 * compiled without any when the compiler took a flag against them, and
 * computes the same values; objdump reads the object (skipped without it). */
static void test_module_has_no_gathers(void)
{
#if defined(__x86_64__) || defined(__i386__)
    static const char src[] =
        "#include <stdint.h>\n"
        "int rf_module_run_v1(const void *s, void *const *b)\n"
        "{\n"
        "    (void)s;\n"
        "    float *y = b[0];\n"
        "    const float *x = b[1];\n"
        "    #pragma omp simd\n"
        "    for (int64_t i = 0; i < 64; i++) {\n"
        "        const int64_t j = (i < 20 ? i : 20) * 3 + (i > 40 ? 1 : 0);\n"
        "        y[i] = x[j] + 1.0f;\n"
        "    }\n"
        "    return 0;\n"
        "}\n";
    rfi_module *m = NULL;
    CHECK_OK(rfi_cc_load_module(src, "clamped", &m));
    float x[64], y[64];
    for (int i = 0; i < 64; i++)
        x[i] = (float)i * 0.5f;
    void *bufs[2] = {y, x};
    rf_module_entry entry = m ? rfi_module_entry_fn(m) : NULL;
    CHECK(entry && entry(NULL, bufs) == 0);
    for (int i = 0; entry && i < 64; i++)
        CHECK(y[i] == x[(i < 20 ? i : 20) * 3 + (i > 40)] + 1.0f);
    char *context = NULL;
    CHECK_OK(rfi_cc_context(&context));
    bool flagged = context && strstr(context, "gather");
    rfi_free(context);
    char cmd[1400], out[64] = "";
    snprintf(cmd, sizeof cmd,
             "command -v objdump >/dev/null && objdump -d '%s' | grep -ci gather || "
             "command -v objdump >/dev/null || echo none",
             m ? m->so_path : "");
    FILE *p = m ? popen(cmd, "r") : NULL;
    if (p) {
        if (!fgets(out, sizeof out, p))
            out[0] = '\0';
        pclose(p);
    }
    if (strncmp(out, "none", 4) == 0)
        printf("module without gathers: not checked (no objdump)\n");
    else if (flagged)
        CHECK(atoi(out) == 0);
    else
        printf("module without gathers: not checked (the compiler takes no flag)\n");
    rfi_module_free(m);
#endif
}

/* ---- The program index ------------------------------------------------------------------ */

#define MAX_INDEX_FILES 16

/* The index files (*.idx) in dir, by name; returns how many (at most max). */
static int index_files(const char *dir, char names[][128], int max)
{
    int n = 0;
    DIR *d = opendir(dir);
    if (!d)
        return 0;
    for (struct dirent *e; (e = readdir(d)) != NULL && n < max;) {
        size_t len = strlen(e->d_name);
        if (len > 4 && len < 128 && strcmp(e->d_name + len - 4, ".idx") == 0)
            memcpy(names[n++], e->d_name, len + 1);
    }
    closedir(d);
    return n;
}

/* The path of the index file that appeared for variant: the one in the
 * directory that is not in before[0..n_before). */
static bool new_index_file(char before[][128], int n_before, char *path, size_t n)
{
    char now[MAX_INDEX_FILES][128];
    int k = index_files(cache_dir, now, MAX_INDEX_FILES);
    for (int i = 0; i < k; i++) {
        bool seen = false;
        for (int j = 0; j < n_before; j++)
            seen = seen || strcmp(now[i], before[j]) == 0;
        if (!seen)
            return (size_t)snprintf(path, n, "%s/%s", cache_dir, now[i]) < n;
    }
    return false;
}

/* Loads variant as a described program and checks its value, whether its
 * source was generated and whether the compiler ran. */
static void check_described(int variant, bool generated, bool compiled)
{
    uint64_t c0 = rfi_cc_n_compiles(), s0 = rfi_cc_n_sources(), i0 = rfi_cc_n_index_hits();
    rfi_module *m = NULL;
    rf_status st;
    int calls = 0;
    CHECK_NEAR(load_described(variant, &m, &st, &calls), 42.0 + variant, 0, 0);
    CHECK_OK(st);
    CHECK(calls == (generated ? 1 : 0));
    CHECK(rfi_cc_n_sources() == s0 + (generated ? 1 : 0));
    CHECK(rfi_cc_n_index_hits() == i0 + (generated ? 0 : 1));
    CHECK(rfi_cc_n_compiles() == c0 + (compiled ? 1 : 0));
    CHECK(m && m->compiled == compiled && m->cached);
    rfi_module_free(m);
}

/* Loads a new variant as a described program (generated and compiled) and
 * finds the index file that load recorded. */
static bool first_described_load(int variant, char *path, size_t n)
{
    char before[MAX_INDEX_FILES][128];
    int k = index_files(cache_dir, before, MAX_INDEX_FILES);
    check_described(variant, true, true);
    return new_index_file(before, k, path, n);
}

static void test_index_skips_generation(void)
{
    char idx[700];
    /* Variant 2 is new: generated and compiled once; its index file is 0600. */
    CHECK(first_described_load(2, idx, sizeof idx));
    CHECK(mode_of(idx) == 0600);
    /* Then: no source, no compiler, in this process and in another. */
    check_described(2, false, false);
    child_report r;
    CHECK(finish_child_report(spawn_child_mode("childidx", 2, -1, -1), &r) == 0);
    CHECK(r.sources == 0 && r.index_hits == 1 && r.compiles == 0 && r.hits == 1);
    CHECK_NEAR(r.value, 44.0, 0, 0);
    /* An undescribed load of the same source still works as before. */
    rfi_module *m = NULL;
    rf_status st;
    CHECK_NEAR(load_and_run(2, &m, &st), 44.0, 0, 0);
    CHECK(m && !m->compiled);
    rfi_module_free(m);
}

/* Replaces path's contents (same name, a new file) with data. */
static void replace_file(const char *path, const char *data, size_t len, unsigned mode)
{
    char tmp[800];
    snprintf(tmp, sizeof tmp, "%s.new", path);
    FILE *f = fopen(tmp, "wb");
    CHECK(f != NULL);
    if (!f)
        return;
    fwrite(data, 1, len, f);
    fclose(f);
    chmod(tmp, mode);
    CHECK(rename(tmp, path) == 0);
}

/* An index file that is cut short, garbled, writable by others or owned by
 * someone else is ignored (the source is generated; the entry itself is a
 * disk hit) and rewritten, after which the index serves again. */
static void test_bad_index_files_are_rebuilt(void)
{
    char idx[700];
    CHECK(first_described_load(3, idx, sizeof idx));
    check_described(3, false, false);

    truncate_by_rename(idx);
    check_described(3, true, false);
    check_described(3, false, false);

    FILE *f = fopen(idx, "r+b"); /* one byte of the stored description flipped */
    CHECK(f != NULL);
    if (f) {
        CHECK(fseek(f, -1, SEEK_END) == 0);
        int c = fgetc(f);
        CHECK(fseek(f, -1, SEEK_END) == 0);
        fputc(c ^ 0x20, f);
        fclose(f);
    }
    check_described(3, true, false);
    check_described(3, false, false);

    replace_file(idx, "reflux program index v1\nentry=zz\n", 33, 0600); /* malformed */
    check_described(3, true, false);
    check_described(3, false, false);

    CHECK(chmod(idx, 0666) == 0); /* writable by others: never trusted */
    check_described(3, true, false);
    CHECK(mode_of(idx) == 0600);
    check_described(3, false, false);

    CHECK(chmod(idx, 0620) == 0); /* writable by the group */
    check_described(3, true, false);
    check_described(3, false, false);

    if (geteuid() == 0) { /* root can give the file away */
        CHECK(chown(idx, 65534, 65534) == 0);
        check_described(3, true, false);
        struct stat st;
        CHECK(stat(idx, &st) == 0 && st.st_uid == 0);
        check_described(3, false, false);
    }
}

/* An index file whose entry lost its object, or its manifest, falls back to
 * the full path: the source is generated and compiled again, the index
 * rewritten. */
static void test_index_to_missing_module_falls_back(void)
{
    char so[700], ok[700];
    rfi_module *m = NULL;
    rf_status st;
    CHECK_NEAR(load_and_run(4, &m, &st), 46.0, 0, 0); /* the entry, before any index */
    snprintf(so, sizeof so, "%s", m ? m->so_path : "");
    snprintf(ok, sizeof ok, "%s/%s.ok", cache_dir, m ? m->key : "");
    rfi_module_free(m);
    check_described(4, true, false); /* records the index */
    check_described(4, false, false);

    CHECK(unlink(so) == 0);
    check_described(4, true, true);
    check_described(4, false, false);

    CHECK(unlink(ok) == 0);
    check_described(4, true, true);
    check_described(4, false, false);
}

/* An index file holding another program's description (here: variant 5's file
 * copied over variant 6's name) is never taken for variant 6. */
static void test_index_compares_the_description(void)
{
    char idx5[700], idx6[700];
    CHECK(first_described_load(5, idx5, sizeof idx5));
    CHECK(first_described_load(6, idx6, sizeof idx6));
    static char data5[1 << 16];
    FILE *f = fopen(idx5, "rb");
    CHECK(f != NULL);
    if (!f)
        return;
    size_t len = fread(data5, 1, sizeof data5, f);
    fclose(f);
    replace_file(idx6, data5, len, 0600);
    check_described(6, true, false); /* 6's own source (value 48), not 5's module */
    check_described(6, false, false);
}

/* The build-id of the object holding an address: this test binary's for one
 * of its functions (what `readelf -n` prints), none for a heap address. */
static void test_build_id(void)
{
    char id[160], heap_id[160];
    CHECK(rfi_cc_build_id((uintptr_t)test_build_id, id, sizeof id));
    CHECK(strlen(id) >= 16 && strlen(id) % 2 == 0 && strspn(id, "0123456789abcdef") == strlen(id));
    char *heap = malloc(16);
    CHECK(!rfi_cc_build_id((uintptr_t)heap, heap_id, sizeof heap_id) && heap_id[0] == '\0');
    free(heap);
    CHECK(!rfi_cc_build_id((uintptr_t)test_build_id, id, 8)); /* no room: none */
    char cmd[128];
    snprintf(cmd, sizeof cmd, "readelf -n /proc/%ld/exe 2>/dev/null", (long)getpid());
    FILE *p = popen(cmd, "r");
    if (!p)
        return;
    char line[512];
    bool seen = false, readelf_ran = false;
    CHECK(rfi_cc_build_id((uintptr_t)test_build_id, id, sizeof id));
    while (fgets(line, sizeof line, p)) {
        readelf_ran = true;
        seen = seen || (strstr(line, "Build ID") && strstr(line, id));
    }
    pclose(p);
    CHECK(seen || !readelf_ran);
}

/* A private fallback directory keeps no index: every load generates. */
static void test_no_index_in_fallback_dir(void)
{
    char bad[600];
    snprintf(bad, sizeof bad, "%s/open2", root);
    CHECK(mkdir(bad, 0700) == 0);
    CHECK(chmod(bad, 0777) == 0);
    setenv("RF_CACHE_DIR", bad, 1);
    rfi_module *m = NULL;
    rf_status st;
    int calls = 0;
    for (int i = 0; i < 2; i++) {
        CHECK_NEAR(load_described(7, &m, &st, &calls), 49.0, 0, 0);
        CHECK(calls == 1 && m && !m->cached);
        rfi_module_free(m);
        m = NULL;
    }
    char names[MAX_INDEX_FILES][128];
    CHECK(index_files(bad, names, MAX_INDEX_FILES) == 0);
    setenv("RF_CACHE_DIR", cache_dir, 1);
}

/* ---- The size limit ---------------------------------------------------------------------- */

static size_t fake_object_bytes; /* what fake_compile writes */

/* A "compiler" that writes fake_object_bytes bytes: no C compiler needed. */
static rf_status fake_compile(void *ctx, const char *src_path, const char *out_path)
{
    (void)ctx, (void)src_path;
    FILE *f = fopen(out_path, "wb");
    if (!f)
        return rfi_error(RF_E_IO, "fake compile: cannot write %s", out_path);
    for (size_t i = 0; i < fake_object_bytes; i++)
        fputc('x', f);
    fclose(f);
    return RF_OK;
}

static rf_status fake_load(void *ctx, const char *path)
{
    (void)ctx, (void)path;
    return RF_OK;
}

static const rfi_disk_cache_ops fake_ops = {fake_compile, fake_load, NULL, ".so", ".c"};
/* another backend's files in the same directory */
static const rfi_disk_cache_ops other_ops = {fake_compile, fake_load, NULL, ".bin", ".src"};

/* Gets the entry of `source` through ops; returns whether it was compiled
 * (-1: the call failed). Then waits 20 ms, so the next file operation has a
 * later modification time. */
static int fake_get_with(const char *source, const rfi_disk_cache_ops *ops)
{
    rfi_disk_cache_result res;
    rf_status st = rfi_disk_cache_get(source, "size-limit-context", ops, &res);
    CHECK_OK(st);
    int compiled = st == RF_OK ? res.compiled : -1;
    if (st == RF_OK)
        rfi_disk_cache_result_free(&res);
    struct timespec pause = {0, 20 * 1000 * 1000};
    nanosleep(&pause, NULL);
    return compiled;
}

static int fake_get(const char *source) { return fake_get_with(source, &fake_ops); }

/* dir/<key of source><ext> into buf. */
static void fake_file(char *buf, size_t n, const char *dir, const char *source, const char *ext)
{
    char key[RFI_CACHE_KEY_HEX];
    rfi_disk_cache_key(source, "size-limit-context", key);
    snprintf(buf, n, "%s/%s%s", dir, key, ext);
}

/* Whether the entry of `source` is in dir (its manifest and its object). */
static bool fake_present(const char *dir, const char *source)
{
    char key[RFI_CACHE_KEY_HEX], ok[700], so[700];
    rfi_disk_cache_key(source, "size-limit-context", key);
    snprintf(ok, sizeof ok, "%s/%s.ok", dir, key);
    snprintf(so, sizeof so, "%s/%s.so", dir, key);
    return exists(ok) && exists(so);
}

static void test_size_limit(void)
{
    char dir[600], notes[700], lock[700], key[RFI_CACHE_KEY_HEX], other[700], tmp[700];
    snprintf(dir, sizeof dir, "%s/limited", root);
    setenv("RF_CACHE_DIR", dir, 1);
    setenv("RF_CACHE_MAX_MB", "1", 1);
    fake_object_bytes = 400 << 10;
    CHECK(fake_get_with("entry Z", &other_ops) == 1); /* another backend's, used first */
    fake_file(other, sizeof other, dir, "entry Z", ".bin");
    fake_file(tmp, sizeof tmp, dir, "entry Z", ".so.tmp.99.0"); /* someone's write */
    FILE *t = fopen(tmp, "wb");
    CHECK(t != NULL);
    if (t)
        fclose(t);
    CHECK(exists(other));
    CHECK(fake_get("entry A") == 1);
    CHECK(fake_get("entry B") == 1);
    CHECK(fake_get("entry A") == 0); /* a hit: A is now used later than B */
    /* Not the cache's: never counted, never deleted. */
    snprintf(notes, sizeof notes, "%s/notes.txt", dir);
    FILE *f = fopen(notes, "wb");
    CHECK(f != NULL);
    for (int i = 0; f && i < (2 << 20); i++)
        fputc('n', f);
    if (f)
        fclose(f);
    /* 1.6 MB of entries > 1 MB: Z (all its files) and B, used least recently,
     * go (down to 0.8 MB); A, used after B, stays. */
    CHECK(fake_get("entry C") == 1);
    CHECK(fake_present(dir, "entry A") && fake_present(dir, "entry C"));
    CHECK(!fake_present(dir, "entry B"));
    CHECK(!exists(other));
    CHECK(exists(notes) && exists(tmp));
    /* An entry whose lock someone holds stays: A is the oldest now, C goes instead. */
    rfi_disk_cache_key("entry A", "size-limit-context", key);
    snprintf(lock, sizeof lock, "%s/%s.lock", dir, key);
    int fd = open(lock, O_RDWR);
    CHECK(fd >= 0 && flock(fd, LOCK_EX) == 0);
    CHECK(fake_get("entry D") == 1);
    if (fd >= 0)
        close(fd);
    CHECK(fake_present(dir, "entry A") && fake_present(dir, "entry D"));
    CHECK(!fake_present(dir, "entry C"));
    /* The entry just built stays even when it alone is over the limit. */
    fake_object_bytes = 3 << 20;
    CHECK(fake_get("entry E") == 1);
    CHECK(fake_present(dir, "entry E"));
    CHECK(!fake_present(dir, "entry A") && !fake_present(dir, "entry D"));
    /* 0: no limit. */
    setenv("RF_CACHE_MAX_MB", "0", 1);
    CHECK(fake_get("entry F") == 1);
    CHECK(fake_present(dir, "entry E") && fake_present(dir, "entry F"));
    CHECK(fake_get("entry A") == 1); /* rebuilt after its eviction */
    unsetenv("RF_CACHE_MAX_MB");
    setenv("RF_CACHE_DIR", cache_dir, 1);
}

/* Makes an empty file aged `seconds`. */
static void aged_file(const char *path, time_t seconds)
{
    FILE *f = fopen(path, "wb");
    CHECK(f != NULL);
    if (f)
        fclose(f);
    struct timespec t[2] = {{time(NULL) - seconds, 0}, {time(NULL) - seconds, 0}};
    CHECK(utimensat(AT_FDCWD, path, t, 0) == 0);
}

/* Temporaries of a writer that died (a process killed mid-compile) are
 * deleted by the next compile in the directory: over an hour old and their
 * process gone, or a day old; younger ones, or a live process's, stay. They
 * used to stay for good, outside the size limit. */
static void test_stale_temporaries(void)
{
    char dir[600], dead_old[700], dead_part[700], dead_new[700], live_old[700], day_old[700];
    snprintf(dir, sizeof dir, "%s/stale", root);
    setenv("RF_CACHE_DIR", dir, 1);
    CHECK(fake_get("entry S") == 1);
    pid_t dead = fork();
    if (dead == 0)
        _exit(0);
    waitpid(dead, NULL, 0);
    char ext[64];
    snprintf(ext, sizeof ext, ".so.tmp.%d.0", (int)dead);
    fake_file(dead_old, sizeof dead_old, dir, "entry T", ext);
    aged_file(dead_old, 2 * 3600);
    snprintf(ext, sizeof ext, ".so.tmp.%d.1.part0.o", (int)dead);
    fake_file(dead_part, sizeof dead_part, dir, "entry T", ext);
    aged_file(dead_part, 2 * 3600);
    snprintf(ext, sizeof ext, ".so.tmp.%d.2", (int)dead);
    fake_file(dead_new, sizeof dead_new, dir, "entry T", ext);
    aged_file(dead_new, 60);
    snprintf(ext, sizeof ext, ".so.tmp.%d.3", (int)getpid());
    fake_file(live_old, sizeof live_old, dir, "entry T", ext);
    aged_file(live_old, 2 * 3600);
    snprintf(ext, sizeof ext, ".so.tmp.%d.4", (int)getpid());
    fake_file(day_old, sizeof day_old, dir, "entry T", ext);
    aged_file(day_old, 25 * 3600);
    CHECK(fake_get("entry U") == 1);
    CHECK(!exists(dead_old) && !exists(dead_part) && !exists(day_old));
    CHECK(exists(dead_new) && exists(live_old));
    setenv("RF_CACHE_DIR", cache_dir, 1);
}

/* ---- A child forked while an entry's lock is held --------------------------------------- */

/* What forking_compile's child does with the entry its parent is building. */
typedef struct fork_plan {
    const char *source;
    bool use_entry; /* get the same entry (else wait for the parent's word) */
    int pipe_fds[2]; /* the parent closes the write end when the waiting child may end */
    pid_t child;
} fork_plan;

/* A child that gets the entry its parent is building: once the parent is done
 * it finds the entry built (exit 0); one that waits for ever (on a lock it
 * inherited, which is its own) is ended by the alarm. */
static void child_gets_entry(const char *source)
{
    alarm(3);
    rfi_disk_cache_result res;
    rf_status st = rfi_disk_cache_get(source, "fork-context", &fake_ops, &res);
    _exit(st == RF_OK && !res.compiled ? 0 : 1);
}

/* fake_compile, forking first, as a fork from another thread may while this
 * one holds the entry's lock; the child never returns here. */
static rf_status forking_compile(void *ctx, const char *src_path, const char *out_path)
{
    fork_plan *plan = ctx;
    fflush(NULL);
    plan->child = fork();
    if (plan->child == 0) {
        if (plan->use_entry)
            child_gets_entry(plan->source);
        char c;
        close(plan->pipe_fds[1]);
        while (read(plan->pipe_fds[0], &c, 1) > 0) { /* no reflux call: waits for the parent */
        }
        _exit(0);
    }
    return fake_compile(NULL, src_path, out_path);
}

/* A child forked while the parent holds an entry's lock keeps no part of that
 * lock: the child's own use of the entry waits for the parent only, and when
 * the child makes no call the entry is free as soon as the parent is done. */
static void test_fork_while_locked(void)
{
    for (int use_entry = 1; use_entry >= 0; use_entry--) {
        fork_plan plan = {use_entry ? "fork entry A" : "fork entry B", use_entry, {-1, -1}, -1};
        CHECK(pipe(plan.pipe_fds) == 0);
        rfi_disk_cache_ops ops = {forking_compile, fake_load, &plan, ".so", ".c"};
        rfi_disk_cache_result res;
        CHECK_OK(rfi_disk_cache_get(plan.source, "fork-context", &ops, &res));
        CHECK(res.compiled);
        char lock[700];
        snprintf(lock, sizeof lock, "%s/%s.lock", cache_dir, res.key);
        rfi_disk_cache_result_free(&res);
        if (!use_entry) { /* free now, though the child still runs */
            int fd = open(lock, O_RDWR | O_CLOEXEC);
            bool free_now = fd >= 0 && flock(fd, LOCK_EX | LOCK_NB) == 0;
            CHECK(free_now);
            if (fd >= 0)
                close(fd);
            if (free_now) { /* (else it would wait for the child, which waits for us) */
                CHECK_OK(rfi_disk_cache_get(plan.source, "fork-context", &fake_ops, &res));
                CHECK(!res.compiled);
                rfi_disk_cache_result_free(&res);
            }
        }
        close(plan.pipe_fds[0]);
        close(plan.pipe_fds[1]); /* the waiting child's end of file */
        int ws = 0;
        CHECK(plan.child > 0 && waitpid(plan.child, &ws, 0) == plan.child);
        CHECK(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
        if (!WIFEXITED(ws))
            fprintf(stderr, "forked child (%s): signal %d\n", plan.source, WTERMSIG(ws));
    }
}

int main(int argc, char **argv)
{
    if (argc >= 3 && strcmp(argv[1], "child") == 0) {
        if (argc >= 4) { /* wait at the start barrier */
            char c;
            while (read(0, &c, 1) > 0) {
            }
        }
        return child_main(atoi(argv[2]), false);
    }
    if (argc >= 3 && strcmp(argv[1], "childidx") == 0) {
        return child_main(atoi(argv[2]), true);
    }
    const char *tmp = getenv("TMPDIR");
    snprintf(root, sizeof root, "%s/rf-disk-cache-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(root)) {
        perror("mkdtemp");
        return 1;
    }
    snprintf(cache_dir, sizeof cache_dir, "%s/cache/reflux", root);
    setenv("RF_CACHE_DIR", cache_dir, 1);
    test_first_load_and_hit();
    test_second_process_calls_no_compiler();
    test_concurrent_processes_compile_once();
    test_corrupt_entry_is_rebuilt();
    test_writable_file_is_never_loaded();
    test_special_files_are_replaced();
    test_bad_lock_path_is_replaced();
    test_memos_in_a_fresh_dir();
    test_memo();
    test_records();
    test_untrusted_dir_falls_back();
    test_dir_from_xdg_and_home();
    test_syntax_error_reports();
    test_module_in_parts();
    test_unloadable_object_reports();
    test_compiler_override_and_fds();
    test_compiler_timeout();
    test_compiler_with_arguments();
    test_no_gather_flag();
    test_module_has_no_gathers();
    test_index_skips_generation();
    test_bad_index_files_are_rebuilt();
    test_index_to_missing_module_falls_back();
    test_index_compares_the_description();
    test_no_index_in_fallback_dir();
    test_build_id();
    test_size_limit();
    test_stale_temporaries();
    test_compiler_dies_with_its_process();
    test_compiler_writes_nothing();
    test_fork_while_locked();
    tu_remove_tree(root);
    return tu_finish("test_disk_cache");
}
