/* test_array_cache.c: the memory of freed arrays kept for the next array of
 * the same size (src/runtime/block_cache.c): reuse, what is not kept, the
 * budget and its oldest-first eviction, clearing, failure injection, threads,
 * forks, and the loader batches and executable outputs that reuse it.
 *
 * The budget is read from RF_ARRAY_CACHE_MB when the first block is freed:
 * main sets 1 MiB before anything is freed.
 */
#include <pthread.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/core.h"
#include "test_util.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define KEPT_IS_POISONED(p) (__asan_address_is_poisoned(p) != 0)
#else
#define KEPT_IS_POISONED(p) ((void)(p), true) /* nothing to check without the sanitizer */
#endif

#define KIB 1024
#define BIG_FLOATS (256 * KIB / 4) /* 256 KiB of f32: kept */

#define SOURCE_FLOATS (4 * 1024 * KIB / 4)
static rf_array *source; /* SOURCE_FLOATS zeros, made once in main */

/* `floats` zeros as a loop makes its arrays anew at every pass: a copy of rows
 * (rf_array_rows), whose memory is kept when it is freed. */
static rf_array *big(int64_t floats) { return rf_array_rows(source, 0, floats); }

/* A freed 256 KiB copy's memory is the next one's once its size recurs; the new
 * array holds its own values, whatever the old one held. Under AddressSanitizer
 * the kept block is poisoned (a use after rf_array_free is reported). */
static void test_reuse(void)
{
    rf_array_cache_clear();
    rf_array *a = big(BIG_FLOATS), *b = big(BIG_FLOATS);
    CHECK(a && b);
    float *pb = b ? rf_array_data(b) : NULL;
    for (int64_t i = 0; pb && i < BIG_FLOATS; i++)
        pb[i] = 7.0f;
    rf_array_free(a);
    rf_array_free(b); /* its size was freed just before: kept */
    CHECK(rf_array_cache_bytes() >= 256 * KIB);
    CHECK(pb && KEPT_IS_POISONED(pb) && KEPT_IS_POISONED(pb + BIG_FLOATS - 1));
    rf_array *c = big(BIG_FLOATS);
    CHECK(c && rf_array_data(c) == pb);
    float *pc = c ? rf_array_data(c) : NULL;
    bool zero = pc != NULL;
    for (int64_t i = 0; pc && i < BIG_FLOATS; i++)
        zero = zero && pc[i] == 0.0f;
    CHECK(zero);
    rf_array_free(c);
    rf_array_cache_clear();
    CHECK(rf_array_cache_bytes() == 0);

    /* a size freed for the first time goes back to malloc; the second time it is kept,
     * and another size does not take it */
    int64_t once = BIG_FLOATS + 48;
    rf_array_free(big(once));
    CHECK(rf_array_cache_bytes() == 0);
    rf_array_free(big(once));
    CHECK(rf_array_cache_bytes() == (size_t)once * 4);
    rf_array *d = big(BIG_FLOATS);
    CHECK(d && rf_array_cache_bytes() == (size_t)once * 4);
    rf_array_free(d);
    CHECK(rf_array_cache_bytes() == (size_t)once * 4 + 256 * KIB);
    CHECK(rf_array_cache_clear() == (size_t)once * 4 + 256 * KIB);
    CHECK(rf_array_cache_bytes() == 0);
}

/* Arrays made once (rf_zeros, rf_array_new, ...) and arrays under 64 KiB are left
 * to malloc. */
static void test_not_kept(void)
{
    rf_array_cache_clear();
    int64_t n = BIG_FLOATS;
    for (int k = 0; k < 3; k++)
        rf_array_free(rf_zeros(RF_F32, &n, 1));
    CHECK(rf_array_cache_bytes() == 0);
    for (int k = 0; k < 3; k++)
        rf_array_free(big(64 * KIB / 4 - 1));
    CHECK(rf_array_cache_bytes() == 0);
    for (int k = 0; k < 3; k++)
        rf_array_free(big(64 * KIB / 4));
    CHECK(rf_array_cache_bytes() == 64 * KIB);
    rf_array_cache_clear();
}

/* With a 1 MiB budget, freeing five 256 KiB arrays keeps the last four; the
 * first is the one given back. A block larger than the budget is not kept. */
static void test_budget(void)
{
    rf_array_cache_clear();
    rf_array *a[5];
    void *data[5];
    for (int i = 0; i < 5; i++) {
        a[i] = big(BIG_FLOATS);
        data[i] = a[i] ? rf_array_data(a[i]) : NULL;
    }
    for (int i = 0; i < 5; i++)
        rf_array_free(a[i]);
    CHECK(rf_array_cache_bytes() == 1024 * KIB);
    /* the newest kept block comes back first */
    rf_array *b = big(BIG_FLOATS);
    CHECK(b && rf_array_data(b) == data[4]);
    rf_array_free(b);
    rf_array *huge = big(2 * 1024 * KIB / 4); /* over the budget */
    rf_array_free(huge);
    CHECK(rf_array_cache_bytes() == 1024 * KIB);
    /* the four kept are data[1..4]: taking four gives those */
    int found = 0;
    for (int i = 0; i < 4; i++) {
        a[i] = big(BIG_FLOATS);
        for (int j = 1; j < 5; j++)
            found += a[i] && rf_array_data(a[i]) == data[j];
    }
    CHECK(found == 4);
    CHECK(rf_array_cache_bytes() == 0);
    for (int i = 0; i < 4; i++)
        rf_array_free(a[i]);
    rf_array_cache_clear();
}

/* A kept block is an allocation for the failure hook: a failed one reports
 * RF_E_NOMEM naming the array and gives the block back (no leak). */
static void test_failure_injection(void)
{
    rf_array_cache_clear();
    rf_array_free(big(BIG_FLOATS));
    CHECK(rf_array_cache_bytes() == 256 * KIB);
    rfi_alloc_fail_after(1, false); /* the array struct succeeds, its data fails */
    rf_array *a = big(BIG_FLOATS);
    rfi_alloc_fail_after(-1, false);
    CHECK(a == NULL);
    CHECK(rf_errstatus() == RF_E_NOMEM);
    CHECK_MSG("f32[65536]");
    CHECK(rf_array_cache_bytes() == 0);
    rf_clear_error();
}

static void *churn(void *arg)
{
    int64_t floats = *(const int64_t *)arg;
    for (int i = 0; i < 2000; i++) {
        rf_array *a = big(floats);
        float *p = a ? rf_array_data(a) : NULL;
        if (p)
            p[floats - 1] = (float)i;
        rf_array_free(a);
    }
    return NULL;
}

/* Threads making and freeing arrays of two sizes share the cache safely
 * (the sanitizer build checks the memory). */
static void test_threads(void)
{
    int64_t sizes[4] = {BIG_FLOATS, BIG_FLOATS * 2, BIG_FLOATS, BIG_FLOATS * 2};
    pthread_t th[4];
    for (int i = 0; i < 4; i++)
        CHECK(pthread_create(&th[i], NULL, churn, &sizes[i]) == 0);
    for (int i = 0; i < 4; i++)
        pthread_join(th[i], NULL);
    CHECK(rf_array_cache_bytes() <= 1024 * KIB);
    rf_array_cache_clear();
}

/* Children forked while another thread makes and frees arrays make and free
 * their own (an alarm ends a child that would wait forever for a mutex
 * inherited held). A smoke test: the other thread holds the cache's mutex for
 * too short a time for a fork to land inside it often. */
static void test_fork(void)
{
    int64_t floats = BIG_FLOATS;
    pthread_t th;
    CHECK(pthread_create(&th, NULL, churn, &floats) == 0);
    int ok = 0;
    for (int k = 0; k < 20; k++) {
        pid_t pid = fork();
        if (pid == 0) {
            alarm(20);
            rf_array *a = big(BIG_FLOATS), *b = big(BIG_FLOATS);
            rf_array_free(a);
            rf_array_free(b); /* a size freed just before: kept */
            _exit(a && b && rf_array_cache_bytes() >= 256 * KIB ? 0 : 1);
        }
        int ws = 0;
        ok += pid > 0 && waitpid(pid, &ws, 0) == pid && WIFEXITED(ws) && WEXITSTATUS(ws) == 0;
    }
    pthread_join(th, NULL);
    CHECK(ok == 20);
    rf_array_cache_clear();
}

/* A loader's batches are recycled: after a pass, a batch's block is in the cache
 * for the next, and each batch holds its own rows. */
static void test_loader_batches(void)
{
    rf_array_cache_clear();
    enum { ROWS = 4096, COLS = 64, BATCH = 512 }; /* 128 KiB batches */
    rf_array *x = rf_array_rows(source, 0, ROWS * COLS);
    float *px = x ? rf_array_data(x) : NULL;
    for (int64_t i = 0; px && i < ROWS * COLS; i++)
        px[i] = (float)(i / COLS);
    rf_array *xs = NULL;
    if (x)
        xs = rf_array_new(rf_device_host(), RF_F32, (const int64_t[]){ROWS, COLS}, 2, px);
    rf_loader_opts opts = {BATCH, false, 0, false};
    rf_loader *l = xs ? rf_loader_new(&xs, 1, &opts) : NULL;
    CHECK(l != NULL);
    int batches = 0;
    bool rows_right = true;
    for (rf_array *const *b = NULL; l && rf_loader_next(l, &b) == RF_OK && b; batches++) {
        const float *pb = rf_array_data(b[0]);
        rows_right = rows_right && pb[0] == (float)(batches * BATCH) &&
                     pb[BATCH * COLS - 1] == (float)(batches * BATCH + BATCH - 1);
    }
    CHECK(batches == ROWS / BATCH && rows_right);
    CHECK(rf_array_cache_bytes() >= (size_t)BATCH * COLS * 4);
    rf_loader_free(l);
    rf_array_free(xs);
    rf_array_free(x);
    rf_array_cache_clear();
}

static void twice_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_return(t, rf_add(x, x));
}

/* An executable's outputs come from the cache: a loop that runs and frees its
 * output reuses one block, and the values are right each time. */
static void test_exec_outputs(void)
{
    rf_array_cache_clear();
    int64_t n = BIG_FLOATS;
    rf_array *x = rf_fill(RF_F32, &n, 1, 1.5);
    rf_array *xd = x ? rf_array_to(x, rf_device_cpu()) : NULL;
    rf_exec *e = NULL;
    CHECK_OK(rf_compile(twice_fn, NULL, &xd, 1, &e));
    void *first = NULL;
    for (int k = 0; e && k < 4; k++) {
        rf_array *y = NULL;
        CHECK_OK(rf_exec_run(e, &xd, 1, &y, 1));
        const float *py = y ? rf_array_data(y) : NULL;
        CHECK(py && py[0] == 3.0f && py[n - 1] == 3.0f);
        if (k == 0)
            first = (void *)py;
        else
            CHECK(py == first);
        rf_array_free(y);
    }
    rf_exec_free(e);
    rf_array_free(xd);
    rf_array_free(x);
    rf_array_cache_clear();
}

int main(void)
{
    setenv("RF_ARRAY_CACHE_MB", "1", 1);
    int64_t n = SOURCE_FLOATS;
    source = rf_zeros(RF_F32, &n, 1);
    CHECK(source != NULL);
    if (!source)
        return tu_finish("test_array_cache");
    test_reuse();
    test_not_kept();
    test_budget();
    test_failure_injection();
    test_threads();
    test_fork();
    test_loader_batches();
    test_exec_outputs();
    rf_array_free(source);
    return tu_finish("test_array_cache");
}
