/* test_steady_state.c: what the compiling backend promises once a step is
 * compiled: no allocation per step, the planned memory known before the first
 * run, and one compiled module reused (the disk cache makes a second compile
 * of the same program call no compiler).
 *
 * Runs on the compiling backend only (it tests that backend's promises).
 */
#include "backend/cpu/cc.h"
#include "core/core.h"
#include "test_util.h"

static rf_tensor *mse_loss(rf_model *m, rf_tensor *const *b, int n, rf_aux *aux, void *ctx)
{
    (void)n, (void)ctx;
    rf_tensor *yhat = rf_apply(m, b[0]);
    rf_aux_set(aux, "mean", rf_mean_all(yhat));
    return rf_mse(yhat, b[1]);
}

/* A random f32 array on the CPU device (the host copy is freed). */
static rf_array *cpu_randn(const int64_t *dims, int rank, uint64_t seed)
{
    rf_array *h = rf_randn(RF_F32, dims, rank, seed);
    rf_array *d = h ? rf_array_to(h, rf_device_cpu()) : NULL;
    rf_array_free(h);
    return d;
}

static void forward(rf_trace *t, void *ctx) { rf_return(t, rf_apply(ctx, rf_arg(t, 0))); }

static rf_model *seed_model(void)
{
    rf_nn_seed(3);
    rf_model *host = rf_chain(rf_dense(4, 8, RF_ACT_TANH), rf_dense(8, 2, RF_ACT_IDENTITY));
    rf_model *m = host ? rf_model_to(host, rf_device_cpu()) : NULL;
    rf_model_free(host);
    return m;
}

/* After the first (compiling) step, trainsteps allocate nothing. */
static void test_trainstep_allocates_nothing(void)
{
    rf_model *m = seed_model();
    rf_opt *opt = m ? rf_setup(rf_adam(1e-2), m) : NULL;
    rf_array *x = cpu_randn(RF_SHAPE(16, 4), 1);
    rf_array *y = cpu_randn(RF_SHAPE(16, 2), 2);
    CHECK(m && opt && x && y);
    rf_array *batch[2] = {x, y};
    double loss = 0;
    rf_stats stats;
    CHECK_OK(rf_trainstep(mse_loss, NULL, m, batch, 2, opt, &loss, &stats));
    CHECK_OK(rf_trainstep(mse_loss, NULL, m, batch, 2, opt, &loss, &stats));
    uint64_t before = rfi_alloc_count();
    for (int i = 0; i < 20; i++)
        CHECK_OK(rf_trainstep(mse_loss, NULL, m, batch, 2, opt, &loss, &stats));
    uint64_t after = rfi_alloc_count();
    CHECK(after == before);
    if (after != before)
        fprintf(stderr, "20 steps made %llu allocations\n",
                (unsigned long long)(after - before));
    CHECK(isfinite(loss) && stats.n == 1);
    rf_cache_stats cs = rf_model_cache_stats(m);
    CHECK(cs.compiles == 1 && cs.hits == 21);
    rf_opt_free(opt);
    rf_model_free(m);
    rf_array_free(x);
    rf_array_free(y);
}

/* The planned bytes are known at compile time, before any run. */
static void test_memory_known_before_first_run(void)
{
    rf_model *m = seed_model();
    rf_array *x = cpu_randn(RF_SHAPE(64, 4), 4);
    rf_exec *e = NULL;
    CHECK_OK(rf_compile(forward, m, &x, 1, &e));
    if (e) {
        CHECK(strcmp(rf_exec_backend_name(e), "cpu") == 0);
        /* the hidden layer [64, 8] f32 lives in the arena */
        CHECK(rf_exec_memory(e) >= 64 * 8 * sizeof(float));
    }
    rf_exec_free(e);
    rf_model_free(m);
    rf_array_free(x);
}

/* Compiling the same program twice in one process calls the compiler once:
 * the second load is a disk-cache hit. */
static void test_second_compile_hits_the_disk_cache(void)
{
    rf_model *m = seed_model();
    rf_array *x = cpu_randn(RF_SHAPE(7, 4), 5);
    rf_exec *a = NULL, *b = NULL;
    CHECK_OK(rf_compile(forward, m, &x, 1, &a));
    uint64_t compiles = rfi_cc_n_compiles(), hits = rfi_cc_n_disk_hits();
    CHECK_OK(rf_compile(forward, m, &x, 1, &b));
    CHECK(rfi_cc_n_compiles() == compiles);
    CHECK(rfi_cc_n_disk_hits() == hits + 1);
    rf_exec_free(a);
    rf_exec_free(b);
    rf_model_free(m);
    rf_array_free(x);
}

int main(void)
{
    setenv("RF_BACKEND", "cpu", 1);
    unsetenv("RF_CHECK"); /* the differential mode allocates by design */
    test_trainstep_allocates_nothing();
    test_memory_known_before_first_run();
    test_second_compile_hits_the_disk_cache();
    return tu_finish("test_steady_state");
}
