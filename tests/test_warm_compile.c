/* test_warm_compile.c: a warm compile on the compiling CPU backend loads its
 * module through the disk cache's program index (no C is generated), and the
 * executable it gives computes exactly what a freshly generated one does.
 *
 * Runs on the compiling backend with RF_CHECK=1 (every run is also checked
 * against the interpreter) and a private RF_CACHE_DIR under a fresh
 * temporary directory. The program is a small CNN's training step (a
 * convolution, max-pooling, a dense layer, cross-entropy, Adam), so CALL
 * steps (oneDNN or the reference kernels) are part of it. Checks, each by
 * the counters of generated sources, index hits and compiler runs and by a
 * digest of the step's loss and updated parameters (bitwise), and by the
 * count of compiles the lowering memo served (runtime/lower_memo.h):
 *   - the first compile generates and compiles; a second compile in the same
 *     process and one in a second process take the lowered and optimised
 *     programs from the memo, generate nothing and compute the same bits;
 *   - a cut-short or others-writable index file is ignored, the source is
 *     generated again (a disk hit, no compiler) and the index rewritten;
 *   - an index file whose module is gone falls back to generating and
 *     compiling;
 *   - RF_DUMP always generates (the C text is dumped) and skips the memo;
 *   - a memo record with a byte altered, writable by others, or missing is a
 *     miss (the module still comes through the index) and is written again;
 *   - RF_UNROLL_POOLS=0 (read by the optimise stage) gets a record of its own,
 *     RF_BF16_KERNELS=0 (read by the renderer) an index entry of its own;
 *   - a program whose independent nodes are created in another order traces
 *     to the same canonical program: it generates nothing and takes the first
 *     order's module.
 *
 * Child mode (`test_warm_compile child`, environment inherited) compiles and
 * runs the step once and prints
 * "sources=N index_hits=N compiles=N memo_hits=N digest=H".
 */
#include <dirent.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend/cpu/cc.h"
#include "runtime/lower_memo.h"
#include "test_util.h"

static char root[256];
static char cache_dir[512];

/* ---- The step -------------------------------------------------------------------------- */

typedef struct step_case {
    rf_model *model;
    rf_opt *opt;
    rf_array *batch[2];
} step_case;

static void step_trace(rf_trace *t, void *ctx)
{
    step_case *c = ctx;
    tu_train_step(t, c->model, c->opt);
}

/* The same model, optimiser and batch every time (fixed seeds). */
static bool step_case_new(step_case *c)
{
    memset(c, 0, sizeof *c);
    rf_nn_seed(7);
    rf_model *host = rf_chain(rf_conv2d(3, 3, 1, 4, RF_ACT_RELU, NULL), rf_maxpool(2, 2, 0, 0),
                              rf_flatten_layer(), rf_dense(64, 10, RF_ACT_IDENTITY));
    c->model = host ? rf_model_to(host, rf_device_cpu()) : NULL;
    rf_model_free(host);
    c->opt = c->model ? rf_setup(rf_adam(1e-2), c->model) : NULL;
    rf_array *x = rf_randn(RF_F32, RF_SHAPE(8, 1, 10, 10), 11);
    int32_t labels[8] = {0, 3, 9, 1, 4, 4, 7, 2};
    rf_array *y = rf_array_from(RF_I32, RF_SHAPE(8), labels);
    c->batch[0] = x ? rf_array_to(x, rf_device_cpu()) : NULL;
    c->batch[1] = y ? rf_array_to(y, rf_device_cpu()) : NULL;
    rf_array_free(x);
    rf_array_free(y);
    return c->model && c->opt && c->batch[0] && c->batch[1];
}

static void step_case_free(step_case *c)
{
    rf_opt_free(c->opt);
    rf_model_free(c->model);
    rf_array_free(c->batch[0]);
    rf_array_free(c->batch[1]);
}

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

static void digest_array(const char *path, rf_array *a, bool trainable, void *ud)
{
    (void)trainable;
    uint64_t *h = ud;
    size_t n = rf_array_nbytes(a);
    void *data = malloc(n ? n : 1);
    if (data && rf_array_read(a, data, n) == RF_OK) {
        *h = fnv(*h, path, strlen(path));
        *h = fnv(*h, data, n);
    }
    free(data);
}

typedef struct outcome {
    bool ok;
    uint64_t digest;     /* the loss and every updated model array, bitwise */
    uint64_t sources, index_hits, compiles, memo_hits; /* during the compile */
} outcome;

/* Compiles the step on fresh copies of everything and runs it once. */
static outcome compile_and_run(void)
{
    outcome o = {0};
    step_case c;
    rf_exec *e = NULL;
    rf_array *loss = NULL;
    uint64_t s0 = rfi_cc_n_sources(), i0 = rfi_cc_n_index_hits(), c0 = rfi_cc_n_compiles();
    uint64_t m0 = rfi_lower_memo_n_hits();
    if (step_case_new(&c) && rf_compile(step_trace, &c, c.batch, 2, &e) == RF_OK) {
        o.sources = rfi_cc_n_sources() - s0;
        o.index_hits = rfi_cc_n_index_hits() - i0;
        o.compiles = rfi_cc_n_compiles() - c0;
        o.memo_hits = rfi_lower_memo_n_hits() - m0;
        float l = 0;
        if (rf_exec_run(e, c.batch, 2, &loss, 1) == RF_OK &&
            rf_array_read(loss, &l, sizeof l) == RF_OK) {
            o.digest = fnv(0xcbf29ce484222325ull, &l, sizeof l);
            rf_model_visit(c.model, digest_array, &o.digest);
            o.ok = true;
        }
    }
    if (!o.ok)
        fprintf(stderr, "compile_and_run: %s\n", rf_errmsg());
    rf_array_free(loss);
    rf_exec_free(e);
    step_case_free(&c);
    return o;
}

/* ---- Files and processes ------------------------------------------------------------------ */

/* The one file in the cache directory whose name ends with ext, into path. */
static bool only_file(const char *ext, char *path, size_t n)
{
    DIR *d = opendir(cache_dir);
    int found = 0;
    if (!d)
        return false;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        size_t len = strlen(e->d_name), el = strlen(ext);
        if (len > el && strcmp(e->d_name + len - el, ext) == 0 && found++ == 0)
            snprintf(path, n, "%s/%s", cache_dir, e->d_name);
    }
    closedir(d);
    return found == 1;
}

static unsigned mode_of(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 ? (unsigned)(st.st_mode & 07777) : 0xffff;
}

/* Runs this binary in child mode; parses its report. */
static outcome child_outcome(void)
{
    outcome o = {0};
    int p[2];
    if (pipe(p) != 0)
        return o;
    pid_t pid = fork();
    if (pid == 0) {
        dup2(p[1], 1);
        close(p[0]);
        close(p[1]);
        char *argv[] = {"test_warm_compile", "child", NULL};
        execv("/proc/self/exe", argv);
        _exit(127);
    }
    close(p[1]);
    char buf[256] = {0};
    size_t got = 0;
    ssize_t r;
    while (got < sizeof buf - 1 && (r = read(p[0], buf + got, sizeof buf - 1 - got)) > 0)
        got += (size_t)r;
    close(p[0]);
    int ws = 0;
    if (pid < 0 || waitpid(pid, &ws, 0) != pid || !WIFEXITED(ws) || WEXITSTATUS(ws) != 0)
        return o;
    unsigned long long s, i, c, m, d;
    if (sscanf(buf, "sources=%llu index_hits=%llu compiles=%llu memo_hits=%llu digest=%llx", &s,
               &i, &c, &m, &d) == 5)
        o = (outcome){true, d, s, i, c, m};
    return o;
}

static int child_main(void)
{
    outcome o = compile_and_run();
    printf("sources=%llu index_hits=%llu compiles=%llu memo_hits=%llu digest=%llx\n",
           (unsigned long long)o.sources, (unsigned long long)o.index_hits,
           (unsigned long long)o.compiles, (unsigned long long)o.memo_hits,
           (unsigned long long)o.digest);
    return o.ok ? 0 : 1;
}

/* ---- Tests ------------------------------------------------------------------------------- */

static uint64_t fresh_digest;

/* Checks one compile: what it generated, hit and compiled, whether the
 * lowering memo served it, and its bits. */
static void check_outcome(outcome o, unsigned sources, unsigned index_hits, unsigned compiles,
                          unsigned memo_hits)
{
    CHECK(o.ok);
    CHECK(o.sources == sources);
    CHECK(o.index_hits == index_hits);
    CHECK(o.compiles == compiles);
    CHECK(o.memo_hits == memo_hits);
    CHECK(o.digest == fresh_digest);
    if (o.ok && (o.sources != sources || o.index_hits != index_hits || o.compiles != compiles ||
                 o.memo_hits != memo_hits))
        fprintf(stderr,
                "  got sources=%llu index_hits=%llu compiles=%llu memo_hits=%llu, expected %u %u "
                "%u %u\n",
                (unsigned long long)o.sources, (unsigned long long)o.index_hits,
                (unsigned long long)o.compiles, (unsigned long long)o.memo_hits, sources,
                index_hits, compiles, memo_hits);
}

static void test_warm_compiles_use_the_index(void)
{
    outcome fresh = compile_and_run(); /* cold: generated and compiled */
    CHECK(fresh.ok && fresh.sources == 1 && fresh.index_hits == 0 && fresh.compiles == 1 &&
          fresh.memo_hits == 0);
    fresh_digest = fresh.digest;
    char idx[700];
    CHECK(only_file(".idx", idx, sizeof idx));
    CHECK(mode_of(idx) == 0600);
    check_outcome(compile_and_run(), 0, 1, 0, 1); /* same process */
    check_outcome(child_outcome(), 0, 1, 0, 1);   /* another process */
}

static void test_bad_index_file_is_rebuilt(void)
{
    char idx[700];
    CHECK(only_file(".idx", idx, sizeof idx));
    FILE *f = fopen(idx, "r+b");
    CHECK(f != NULL);
    if (f) { /* cut short in place: the description no longer matches */
        CHECK(ftruncate(fileno(f), 100) == 0);
        fclose(f);
    }
    check_outcome(compile_and_run(), 1, 0, 0, 1); /* generated; the module is a disk hit */
    check_outcome(compile_and_run(), 0, 1, 0, 1); /* rewritten */
    CHECK(chmod(idx, 0666) == 0);                 /* writable by others: never trusted */
    check_outcome(compile_and_run(), 1, 0, 0, 1);
    CHECK(mode_of(idx) == 0600);
    check_outcome(child_outcome(), 0, 1, 0, 1);
}

static void test_index_to_missing_module_falls_back(void)
{
    char so[700];
    CHECK(only_file(".so", so, sizeof so));
    CHECK(unlink(so) == 0);
    check_outcome(compile_and_run(), 1, 0, 1, 1); /* generated and compiled again */
    check_outcome(compile_and_run(), 0, 1, 0, 1);
}

static void test_dump_always_generates(void)
{
    char dump[600];
    snprintf(dump, sizeof dump, "%s/dump", root);
    setenv("RF_DUMP", dump, 1);
    check_outcome(compile_and_run(), 1, 0, 0, 0); /* the C text (and every stage) is wanted */
    unsetenv("RF_DUMP");
    char cmd[800];
    snprintf(cmd, sizeof cmd, "ls %s | grep -q '\\.c\\.txt$\\|\\.c$'", dump);
    CHECK(system(cmd) == 0);
    snprintf(cmd, sizeof cmd, "ls %s | grep -q '\\.ad\\.txt$'", dump);
    CHECK(system(cmd) == 0); /* autodiff ran: no memo */
    check_outcome(compile_and_run(), 0, 1, 0, 1);
}

/* The lowering memo's record: damaged, untrusted or missing, it is a miss
 * (the program is lowered and optimised again, which finds the module
 * through the index) and is written again. */
static void test_bad_record_is_rebuilt(void)
{
    char rec[700];
    CHECK(only_file(".rec", rec, sizeof rec));
    CHECK(mode_of(rec) == 0600);
    FILE *f = fopen(rec, "r+b");
    CHECK(f != NULL);
    if (f) { /* one byte of the payload altered: its digest no longer matches */
        fseek(f, -100, SEEK_END);
        int c = fgetc(f);
        fseek(f, -100, SEEK_END);
        fputc(c ^ 1, f);
        fclose(f);
    }
    check_outcome(compile_and_run(), 0, 1, 0, 0);
    check_outcome(compile_and_run(), 0, 1, 0, 1); /* rewritten */
    CHECK(chmod(rec, 0606) == 0);                 /* writable by others: never trusted */
    check_outcome(compile_and_run(), 0, 1, 0, 0);
    CHECK(mode_of(rec) == 0600);
    CHECK(unlink(rec) == 0);
    check_outcome(child_outcome(), 0, 1, 0, 0);
    check_outcome(child_outcome(), 0, 1, 0, 1);
}

/* What the backend's optimise stage reads from the environment is part of the
 * record's context: RF_UNROLL_POOLS=0 gets a record (and a module) of its own. */
static void test_optimise_switches_key_the_record(void)
{
    setenv("RF_UNROLL_POOLS", "0", 1);
    outcome o = compile_and_run();
    CHECK(o.ok && o.memo_hits == 0 && o.sources == 1 && o.compiles == 1);
    o = compile_and_run();
    CHECK(o.ok && o.memo_hits == 1 && o.sources == 0 && o.index_hits == 1);
    unsetenv("RF_UNROLL_POOLS");
    check_outcome(compile_and_run(), 0, 1, 0, 1);
}

/* What the renderer reads from the environment keys the program index: under
 * RF_BF16_KERNELS=0 the source is generated again (for this f32 step the same bytes,
 * so the module is a disk hit, no compiler; a bf16 product's would differ). */
static void test_render_switches_key_the_index(void)
{
    setenv("RF_BF16_KERNELS", "0", 1);
    check_outcome(compile_and_run(), 1, 0, 0, 1);
    check_outcome(compile_and_run(), 0, 1, 0, 1);
    unsetenv("RF_BF16_KERNELS");
    check_outcome(compile_and_run(), 0, 1, 0, 1);
}

/* exp(x) and tanh(x), created in either order: the traced programs are put in
 * one canonical order, so they are one program for every cache. */
static void exp_then_tanh(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_tensor *u = rf_exp(x);
    rf_tensor *v = rf_tanh(x);
    rf_return(t, u);
    rf_return(t, v);
}

static void tanh_then_exp(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_tensor *v = rf_tanh(x);
    rf_tensor *u = rf_exp(x);
    rf_return(t, u);
    rf_return(t, v);
}

/* Compiles and runs fn on x (RF_CHECK compares with the interpreter); returns
 * the sources generated and the index hits of the compile. */
static void compile_order(rf_trace_fn fn, rf_array *x, uint64_t *hash, unsigned *sources,
                          unsigned *hits)
{
    uint64_t s0 = rfi_cc_n_sources(), i0 = rfi_cc_n_index_hits();
    rf_exec *e = NULL;
    rf_array *outs[2] = {NULL, NULL};
    CHECK_OK(rf_compile(fn, NULL, &x, 1, &e));
    *sources = (unsigned)(rfi_cc_n_sources() - s0);
    *hits = (unsigned)(rfi_cc_n_index_hits() - i0);
    *hash = e ? rf_exec_hash(e) : 0;
    if (e)
        CHECK_OK(rf_exec_run(e, &x, 1, outs, 2));
    rf_array_free(outs[0]);
    rf_array_free(outs[1]);
    rf_exec_free(e);
}

static void test_creation_order_is_not_part_of_the_program(void)
{
    rf_array *h = rf_randn(RF_F32, RF_SHAPE(3, 5), 5);
    rf_array *x = h ? rf_array_to(h, rf_device_cpu()) : NULL;
    rf_array_free(h);
    CHECK(x != NULL);
    uint64_t ha, hb;
    unsigned sa, ia, sb, ib;
    compile_order(exp_then_tanh, x, &ha, &sa, &ia);
    compile_order(tanh_then_exp, x, &hb, &sb, &ib);
    CHECK(ha == hb);
    CHECK(sa == 1 && ia == 0);
    CHECK(sb == 0 && ib == 1); /* the other order's module */
    compile_order(exp_then_tanh, x, &ha, &sa, &ia);
    compile_order(tanh_then_exp, x, &hb, &sb, &ib);
    CHECK(sa == 0 && ia == 1 && sb == 0 && ib == 1);
    rf_array_free(x);
}

int main(int argc, char **argv)
{
    if (argc >= 2 && strcmp(argv[1], "child") == 0)
        return child_main();
    const char *tmp = getenv("TMPDIR");
    snprintf(root, sizeof root, "%s/rf-warm-compile-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(root)) {
        perror("mkdtemp");
        return 1;
    }
    snprintf(cache_dir, sizeof cache_dir, "%s/cache", root);
    setenv("RF_CACHE_DIR", cache_dir, 1);
    setenv("RF_BACKEND", "cpu", 1);
    setenv("RF_CHECK", "1", 1);
    unsetenv("RF_DUMP");
    test_warm_compiles_use_the_index();
    test_bad_index_file_is_rebuilt();
    test_index_to_missing_module_falls_back();
    test_dump_always_generates();
    test_bad_record_is_rebuilt();
    test_optimise_switches_key_the_record();
    test_render_switches_key_the_index();
    test_creation_order_is_not_part_of_the_program();
    tu_remove_tree(root);
    return tu_finish("test_warm_compile");
}
