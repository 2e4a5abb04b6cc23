/* test_runtime.c: devices, arrays (creation, access, moving, random fills,
 * reference counting) and the compile/run pipeline's checks: captures kept
 * alive by executables, updates applied after a run, argument errors with
 * their messages, RF_DUMP files.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* setenv, mkdtemp */
#endif
#include <dirent.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "runtime/runtime.h"
#include "test_util.h"

/* ---- Devices ---------------------------------------------------------------------- */

static void test_devices(void)
{
    /* Before any other call: RF_DEVICE=cpu forces the CPU. */
    setenv("RF_DEVICE", "cpu", 1);
    CHECK(rf_device_default() == rf_device_cpu());
    CHECK(rf_device_kind_of(rf_device_cpu()) == RF_DEVICE_CPU);
    CHECK(rf_device_kind_of(rf_device_host()) == RF_DEVICE_HOST);
    CHECK(strcmp(rf_device_name(rf_device_cpu()), "cpu") == 0);
    CHECK(strcmp(rf_device_name(rf_device_host()), "host") == 0);
    CHECK(rfi_device_is_compute(rf_device_cpu()));
    CHECK(!rfi_device_is_compute(rf_device_host()));
    CHECK(!rfi_device_is_compute(NULL));

    /* No CUDA backend in this build: CUDA is never usable. */
    rf_clear_error();
    CHECK(rf_device_cuda(0) == NULL);
    CHECK_MSG("rf_device_cuda: ");
    CHECK(rf_device_cuda(-1) == NULL);
    CHECK_MSG("negative");

    /* An unusable or unknown choice falls back to the CPU (warning once). */
    setenv("RF_DEVICE", "cuda:3", 1);
    CHECK(rf_device_default() == rf_device_cpu());
    setenv("RF_DEVICE", "tpu", 1);
    CHECK(rf_device_default() == rf_device_cpu());
    unsetenv("RF_DEVICE");
    CHECK(rf_device_default() == rf_device_cpu());
}

/* ---- Arrays ------------------------------------------------------------------------- */

static void test_array_basics(void)
{
    float data[6] = {1, 2, 3, 4, 5, 6};
    rf_array *a = rf_array_from(RF_F32, RF_SHAPE(2, 3), data);
    CHECK(a != NULL);
    CHECK(rf_array_device(a) == rf_device_host());
    CHECK(rf_array_dtype(a) == RF_F32);
    CHECK(rf_array_rank(a) == 2);
    CHECK(rf_array_dims(a)[0] == 2 && rf_array_dims(a)[1] == 3);
    CHECK(rf_array_numel(a) == 6);
    CHECK(rf_array_nbytes(a) == 24);
    CHECK(((float *)rf_array_data(a))[4] == 5.0f);

    float back[6] = {0};
    CHECK_OK(rf_array_read(a, back, sizeof back));
    CHECK(memcmp(back, data, sizeof data) == 0);
    CHECK_STATUS(rf_array_read(a, back, 8), RF_E_INVALID);
    CHECK_MSG("f32[2,3]");
    CHECK_MSG("24 bytes");
    float nw[6] = {6, 5, 4, 3, 2, 1};
    CHECK_OK(rf_array_write(a, nw, sizeof nw));
    CHECK_OK(rf_array_read(a, back, sizeof back));
    CHECK(back[0] == 6.0f && back[5] == 1.0f);
    CHECK_STATUS(rf_array_write(a, nw, 20), RF_E_INVALID);
    CHECK_MSG("needs exactly 24 bytes, got 20");
    CHECK_STATUS(rf_array_read(NULL, back, sizeof back), RF_E_INVALID);
    rf_array_free(a);
    rf_array_free(NULL);

    /* Zeros, ones, fill, integer and bool dtypes, rank 0, empty arrays. */
    rf_array *z = rf_zeros(RF_I32, RF_SHAPE(4));
    rf_array *o = rf_ones(RF_BOOL, RF_SHAPE(3));
    rf_array *f = rf_fill(RF_U8, RF_SHAPE(2), 300.0); /* saturates */
    rf_array *s = rf_fill(RF_F64, RF_SCALAR_SHAPE, 2.5);
    rf_array *e = rf_zeros(RF_F32, RF_SHAPE(0, 5));
    CHECK(z && o && f && s && e);
    if (z && o && f && s && e) {
        CHECK(((int32_t *)rf_array_data(z))[3] == 0);
        CHECK(((uint8_t *)rf_array_data(o))[2] == 1);
        CHECK(((uint8_t *)rf_array_data(f))[1] == 255);
        CHECK(rf_array_rank(s) == 0 && rf_array_numel(s) == 1);
        CHECK(rf_to_number(s) == 2.5);
        CHECK(rf_array_numel(e) == 0 && rf_array_nbytes(e) == 0);
    }
    /* Elements start on a 64-byte boundary at every size, also past
     * malloc's mmap threshold (whose blocks start 16 bytes into a page). */
    rf_array *big = rf_zeros(RF_F32, RF_SHAPE(784, 512));
    CHECK(big != NULL);
    rf_array *all[] = {z, o, f, s, e, big};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        CHECK(all[i] && (uintptr_t)rf_array_data(all[i]) % 64 == 0);
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        rf_array_free(all[i]);

    /* Validation. */
    CHECK(rf_zeros(RF_F32, (const int64_t[]){1}, -1) == NULL);
    CHECK_MSG("rank -1");
    CHECK(rf_zeros(RF_F32, (const int64_t[]){1, 1, 1, 1, 1, 1, 1, 1, 1}, 9) == NULL);
    CHECK_MSG("rank 9");
    CHECK(rf_zeros(RF_F32, RF_SHAPE(2, -3)) == NULL);
    CHECK_MSG("negative");
    CHECK(rf_zeros((rf_dtype)42, RF_SHAPE(2)) == NULL);
    CHECK_MSG("invalid dtype");
    CHECK(rf_zeros(RF_F64, RF_SHAPE(INT64_MAX / 4, 4)) == NULL);
    CHECK_MSG("overflow");
    /* an empty array too: its nonzero dims' product must fit in bytes, in any order */
    CHECK(rf_zeros(RF_F32, RF_SHAPE(INT64_MAX, 2, 0)) == NULL);
    CHECK(rf_zeros(RF_F32, RF_SHAPE(INT64_MAX / 2, 0)) == NULL);
    CHECK_MSG("too large");
    rf_array *empty = rf_zeros(RF_F32, RF_SHAPE(INT64_MAX / 8, 0, 2));
    CHECK(empty && rf_array_numel(empty) == 0 && rf_array_nbytes(empty) == 0);
    rf_array_free(empty);
    CHECK(rf_array_new(NULL, RF_F32, RF_SHAPE(2), NULL) == NULL);
    CHECK_MSG("device is NULL");
}

static void test_array_to(void)
{
    double d[4] = {1.5, -2.25, 3.0, 1e-3};
    rf_array *h = rf_array_from(RF_F64, RF_SHAPE(2, 2), d);
    rf_array *c = rf_array_to(h, rf_device_cpu());
    CHECK(c && rf_array_device(c) == rf_device_cpu());
    CHECK(rf_array_dtype(c) == RF_F32); /* Flux's f64 -> f32 rule */
    float cf[4] = {0};
    CHECK_OK(rf_array_read(c, cf, sizeof cf));
    CHECK(cf[0] == 1.5f && cf[1] == -2.25f && cf[3] == (float)1e-3);

    rf_to_opts keep = {.keep_f64 = true};
    rf_array *c64 = rf_array_to_opts(h, rf_device_cpu(), &keep);
    CHECK(c64 && rf_array_dtype(c64) == RF_F64);

    /* Back to the host never converts. */
    rf_array *h2 = rf_array_to(c64, rf_device_host());
    CHECK(h2 && rf_array_dtype(h2) == RF_F64 && rf_array_device(h2) == rf_device_host());
    double d2[4];
    CHECK_OK(rf_array_read(h2, d2, sizeof d2));
    CHECK(memcmp(d, d2, sizeof d) == 0);
    rf_array *h3 = rf_array_to(c, rf_device_host());
    CHECK(h3 && rf_array_dtype(h3) == RF_F32);

    CHECK(rf_array_to(NULL, rf_device_cpu()) == NULL);
    CHECK(rf_array_to(h, NULL) == NULL);
    rf_array_free(h);
    rf_array_free(c);
    rf_array_free(c64);
    rf_array_free(h2);
    rf_array_free(h3);
}

static void test_array_rows(void)
{
    const float v[10] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
    rf_array *h = rf_array_from(RF_F32, RF_SHAPE(5, 2), v);
    rf_array *c = rf_array_to(h, rf_device_cpu());
    rf_array *r = rf_array_rows(c, 1, 3);
    CHECK(r && rf_array_device(r) == rf_device_cpu() && rf_array_rank(r) == 2 &&
          rf_array_dims(r)[0] == 2 && rf_array_dims(r)[1] == 2);
    float got[4] = {0};
    CHECK_OK(rf_array_read(r, got, sizeof got));
    CHECK(got[0] == 2 && got[1] == 3 && got[2] == 4 && got[3] == 5);
    rf_array_free(r);
    r = rf_array_rows(h, 5, 5); /* empty, on the host */
    CHECK(r && rf_array_dims(r)[0] == 0 && rf_array_device(r) == rf_device_host());
    rf_array_free(r);
    CHECK(rf_array_rows(c, 3, 6) == NULL);
    CHECK_MSG("rf_array_rows: rows [3, 6) are not within the 5 of f32[5,2]");
    CHECK(rf_array_rows(c, 2, 1) == NULL && rf_array_rows(c, -1, 1) == NULL);
    CHECK(rf_array_rows(NULL, 0, 0) == NULL);
    CHECK_MSG("rf_array_rows: array is NULL");
    rf_array *s = rf_fill(RF_F32, NULL, 0, 1.0);
    CHECK(rf_array_rows(s, 0, 0) == NULL);
    CHECK_MSG("rank 0");
    rf_array_free(s);
    rf_array_free(c);
    rf_array_free(h);
}

static void test_random(void)
{
    enum { N = 20000 };
    rf_array *a = rf_randn(RF_F32, RF_SHAPE(N), 42);
    rf_array *b = rf_randn(RF_F32, RF_SHAPE(N), 42);
    rf_array *c = rf_randn(RF_F32, RF_SHAPE(N), 43);
    CHECK(a && b && c);
    if (!(a && b && c))
        return;
    CHECK(memcmp(rf_array_data(a), rf_array_data(b), rf_array_nbytes(a)) == 0);
    CHECK(memcmp(rf_array_data(a), rf_array_data(c), rf_array_nbytes(a)) != 0);
    const float *x = rf_array_data(a);
    double sum = 0, sq = 0;
    for (int i = 0; i < N; i++) {
        sum += x[i];
        sq += (double)x[i] * x[i];
    }
    double mean = sum / N, var = sq / N - mean * mean;
    CHECK_NEAR(mean, 0.0, 0.05, 0);
    CHECK_NEAR(var, 1.0, 0.05, 0);

    rf_array *u = rf_rand(RF_F64, RF_SHAPE(N), 7);
    CHECK(u != NULL);
    if (u) {
        const double *y = rf_array_data(u);
        double lo = 1, hi = 0, usum = 0;
        for (int i = 0; i < N; i++) {
            lo = y[i] < lo ? y[i] : lo;
            hi = y[i] > hi ? y[i] : hi;
            usum += y[i];
        }
        CHECK(lo >= 0.0 && hi < 1.0);
        CHECK_NEAR(usum / N, 0.5, 0.02, 0);
    }
    CHECK(rf_randn(RF_I32, RF_SHAPE(3), 1) == NULL);
    CHECK_MSG("not a float type");
    rf_array_free(a);
    rf_array_free(b);
    rf_array_free(c);
    rf_array_free(u);
}

static void test_to_number(void)
{
    int64_t v = 7;
    rf_array *one = rf_array_from(RF_I64, RF_SHAPE(1, 1), &v);
    CHECK(rf_to_number(one) == 7.0);
    float two[2] = {1, 2};
    rf_array *t = rf_array_from(RF_F32, RF_SHAPE(2), two);
    rf_clear_error();
    CHECK(isnan(rf_to_number(t)));
    CHECK_MSG("f32[2] has 2 elements");
    CHECK(isnan(rf_to_number(NULL)));
    rf_array_free(one);
    rf_array_free(t);
}

static void *retain_release_many(void *arg)
{
    rf_array *a = arg;
    for (int i = 0; i < 100000; i++) {
        rfi_array_retain(a);
        rfi_array_release(a);
    }
    return NULL;
}

static void test_refcount_threads(void)
{
    rf_array *a = rf_zeros(RF_F32, RF_SHAPE(4));
    pthread_t th[4];
    for (int i = 0; i < 4; i++)
        pthread_create(&th[i], NULL, retain_release_many, a);
    for (int i = 0; i < 4; i++)
        pthread_join(th[i], NULL);
    CHECK(atomic_load(&a->refs) == 1);
    rf_array_free(a);
}

/* ---- Compile and run --------------------------------------------------------------- */

typedef struct model {
    rf_array *w; /* f32[4] on the cpu */
    rf_array *counter;
} model;

/* y = x + w (broadcast over the batch). */
static void add_weights(rf_trace *t, void *ctx)
{
    model *m = ctx;
    rf_return(t, rf_add(rf_arg(t, 0), rf_capture(t, m->w)));
}

/* Returns the old counter and records counter <- counter + 1. */
static void bump_counter(rf_trace *t, void *ctx)
{
    model *m = ctx;
    rf_tensor *c = rf_capture(t, m->counter);
    CHECK(rf_capture(t, m->counter) == c); /* same array, same node */
    rf_return(t, c);
    rf_assign(t, m->counter, rf_add_s(c, 100.0)); /* replaced below: the last one wins */
    rf_assign(t, m->counter, rf_add_s(c, 1.0));
}

static void returns_nothing(rf_trace *t, void *ctx)
{
    (void)t;
    (void)ctx;
}

static void fails_itself(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_trace_fail(t, RF_E_DOMAIN, "my_layer: learning rate %g is negative", -0.5);
    rf_trace_fail(t, RF_E_SHAPE, "second error is ignored");
    CHECK(rf_trace_status(t) == RF_E_DOMAIN);
    rf_return(t, rf_arg(t, 0));
}

static void captures_host(rf_trace *t, void *ctx)
{
    rf_array *host = ctx;
    rf_return(t, rf_capture(t, host));
}

static void captures_null(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_return(t, rf_capture(t, NULL));
}

static void bad_assign(rf_trace *t, void *ctx)
{
    model *m = ctx;
    rf_assign(t, m->w, rf_arg(t, 0)); /* f32[16,4] into f32[4] */
}

static void check_accessors(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = rf_arg(t, 0);
    CHECK(rf_arg(t, 0) == x); /* created once */
    CHECK(rf_n_args(t) == 1);
    CHECK(rf_tensor_trace(x) == t);
    CHECK(rf_tensor_dtype(x) == RF_F32);
    CHECK(rf_tensor_rank(x) == 2);
    CHECK(rf_tensor_dim(x, 0) == 16 && rf_tensor_dim(x, -1) == 4);
    CHECK(rf_tensor_dims(x)[1] == 4);
    CHECK(rf_tensor_numel(x) == 64);
    CHECK(rf_trace_status(t) == RF_OK);
    CHECK(rf_arg(t, 1) == NULL);
    CHECK(rf_trace_status(t) == RF_E_INVALID);
}

static rf_array *cpu_fill(const int64_t *dims, int rank, double v)
{
    rf_array *h = rf_fill(RF_F32, dims, rank, v);
    rf_array *c = rf_array_to(h, rf_device_cpu());
    rf_array_free(h);
    return c;
}

static void test_capture_keeps_alive(void)
{
    model m = {0};
    m.w = cpu_fill(RF_SHAPE(4), 0.5);
    rf_array *x = cpu_fill(RF_SHAPE(16, 4), 2.0);
    rf_exec *e = NULL;
    CHECK_OK(rf_compile(add_weights, &m, &x, 1, &e));
    if (!e)
        goto done;
    CHECK(rf_exec_n_args(e) == 1 && rf_exec_n_outputs(e) == 1 && rf_exec_n_updates(e) == 0);
    CHECK(rf_exec_output_dtype(e, 0) == RF_F32 && rf_exec_output_rank(e, 0) == 2);
    CHECK(rf_exec_output_dims(e, 0)[0] == 16);
    CHECK(rf_exec_output_dims(e, 1) == NULL);
    CHECK(rf_exec_device(e) == rf_device_cpu());
    /* RF_BACKEND unset: the compiling backend of the CPU device. */
    const char *want_backend = getenv("RF_BACKEND") ? getenv("RF_BACKEND") : "cpu";
    CHECK(strcmp(rf_exec_backend_name(e), want_backend) == 0);
    CHECK(rf_exec_program_text(e) && strstr(rf_exec_program_text(e), "capture"));

    /* The user's reference goes; the executable's keeps w alive. */
    float *w = rf_array_data(m.w);
    w[1] = 1.5f; /* read by reference at run time */
    rf_array_free(m.w);
    m.w = NULL;
    rf_array *y = NULL;
    CHECK_OK(rf_exec_run(e, &x, 1, &y, 1));
    if (y) {
        const float *yv = rf_array_data(y);
        CHECK(rf_array_device(y) == rf_device_cpu());
        CHECK_NEAR(yv[0], 2.5, 0, 0);
        CHECK_NEAR(yv[1], 3.5, 0, 0);
        CHECK_NEAR(yv[63], 2.5, 0, 0);
    }
    rf_array_free(y);

    /* nouts 0 drops the output. */
    CHECK_OK(rf_exec_run(e, &x, 1, NULL, 0));
done:
    rf_exec_free(e);
    rf_exec_free(NULL);
    rf_array_free(x);
}

static void test_updates(void)
{
    model m = {0};
    m.counter = cpu_fill(RF_SHAPE(3), 10.0);
    rf_exec *e = NULL;
    CHECK_OK(rf_compile(bump_counter, &m, NULL, 0, &e));
    if (!e)
        goto done;
    CHECK(rf_exec_n_updates(e) == 1);
    for (int run = 0; run < 2; run++) {
        rf_array *old = NULL;
        CHECK_OK(rf_exec_run(e, NULL, 0, &old, 1));
        if (old)
            CHECK_NEAR(((float *)rf_array_data(old))[2], 10.0 + run, 0, 0); /* old value */
        CHECK_NEAR(((float *)rf_array_data(m.counter))[2], 11.0 + run, 0, 0);
        rf_array_free(old);
    }
    /* A user write is seen by the next run. */
    float reset[3] = {0, 0, 0};
    CHECK_OK(rf_array_write(m.counter, reset, sizeof reset));
    CHECK_OK(rf_exec_run(e, NULL, 0, NULL, 0));
    CHECK_NEAR(((float *)rf_array_data(m.counter))[0], 1.0, 0, 0);
done:
    rf_exec_free(e);
    rf_array_free(m.counter);
}

/* The argument is the very array the program captures and updates (in place, in the
 * compiled step's first loop); every output and the update read its old bytes. */
static void arg_is_capture_fn(rf_trace *t, void *ctx)
{
    rf_array *w = ctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_return(t, rf_mul_s(x, 2));
    rf_return(t, rf_sum(x, (const int64_t[]){0}, 1, false));
    rf_assign(t, w, rf_add(rf_capture(t, w), x));
}

static void test_argument_is_updated_capture(void)
{
    float v[16];
    for (int i = 0; i < 16; i++)
        v[i] = (float)(i + 1);
    rf_array *w = rf_array_new(rf_device_cpu(), RF_F32, RF_SHAPE(4, 4), v);
    rf_exec *e = NULL;
    CHECK_OK(rf_compile(arg_is_capture_fn, w, &w, 1, &e));
    for (int run = 0; e && run < 2; run++) {
        rf_array *o[2] = {0};
        CHECK_OK(rf_exec_run(e, &w, 1, o, 2));
        float twice[16], colsum[4], now[16];
        CHECK_OK(rf_array_read(o[0], twice, sizeof twice));
        CHECK_OK(rf_array_read(o[1], colsum, sizeof colsum));
        CHECK_OK(rf_array_read(w, now, sizeof now));
        for (int i = 0; i < 16; i++)
            CHECK(twice[i] == 2 * v[i] && now[i] == 2 * v[i]);
        for (int j = 0; j < 4; j++)
            CHECK(colsum[j] == v[j] + v[4 + j] + v[8 + j] + v[12 + j]);
        memcpy(v, now, sizeof v);
        rf_array_free(o[0]);
        rf_array_free(o[1]);
    }
    rf_exec_free(e);
    rf_array_free(w);
}

/* ---- rf_jitted: one executable per argument types ---------------------------------- */

/* sum(x) * w, w captured: [rows, 3] arguments of any row count */
static void weighted_sum_fn(rf_trace *t, void *ctx)
{
    rf_return(t, rf_mul(rf_sum_all(rf_arg(t, 0)), rf_capture(t, ctx)));
}

static void test_jitted(void)
{
    rf_array *w = cpu_fill(NULL, 0, 2.0);
    rf_jitted *f = rf_jitted_new(weighted_sum_fn, w);
    CHECK(f != NULL && rf_jitted_n_compiled(f) == 0);
    const int rows[6] = {8, 8, 3, 8, 3, 5};
    for (int k = 0; f && k < 6; k++) {
        rf_array *x = cpu_fill(RF_SHAPE(rows[k], 3), 1.0), *y = NULL;
        CHECK_OK(rf_jitted_run(f, &x, 1, &y, 1));
        CHECK(y && rf_to_number(y) == 2.0 * 3 * rows[k]);
        rf_array_free(y);
        rf_array_free(x);
    }
    CHECK(rf_jitted_n_compiled(f) == 3); /* 8, 3 and 5 rows */
    /* captured by reference: a new w is seen without compiling */
    float three = 3.0f;
    CHECK_OK(rf_array_write(w, &three, sizeof three));
    rf_array *x = cpu_fill(RF_SHAPE(3, 3), 1.0), *y = NULL;
    CHECK_OK(rf_jitted_run(f, &x, 1, &y, 1));
    CHECK(y && rf_to_number(y) == 27.0 && rf_jitted_n_compiled(f) == 3);
    rf_array_free(y);
    /* errors: nothing cached, outputs NULL */
    rf_array *host = rf_fill(RF_F32, RF_SHAPE(4, 3), 1.0);
    y = (rf_array *)&three;
    CHECK_STATUS(rf_jitted_run(f, &host, 1, &y, 1), RF_E_DEVICE);
    CHECK(y == NULL && rf_jitted_n_compiled(f) == 3);
    rf_array *none = NULL;
    CHECK_STATUS(rf_jitted_run(f, &none, 1, NULL, 0), RF_E_INVALID);
    CHECK_MSG("rf_jitted_run: argument 0 is NULL");
    CHECK_STATUS(rf_jitted_run(NULL, &x, 1, NULL, 0), RF_E_INVALID);
    CHECK_STATUS(rf_jitted_run(f, NULL, 1, NULL, 0), RF_E_INVALID);
    CHECK(rf_jitted_new(NULL, NULL) == NULL);
    /* past 8 executables each new one warns */
    captured c;
    capture_start(&c);
    for (int r = 10; f && r < 16; r++) {
        rf_array *xr = cpu_fill(RF_SHAPE(r, 3), 1.0);
        CHECK_OK(rf_jitted_run(f, &xr, 1, NULL, 0));
        rf_array_free(xr);
    }
    char *err = capture_end(&c);
    CHECK(rf_jitted_n_compiled(f) == 9);
    CHECK(err && strstr(err, "reflux: warning: rf_jitted_run: 9 executables compiled for one "
                             "function, the new one for arguments f32[15,3]") != NULL);
    CHECK(err && strstr(err, "8 executables") == NULL);
    free(err);
    rf_array_free(host);
    rf_array_free(x);
    rf_jitted_free(f);
    rf_jitted_free(NULL);
    rf_array_free(w);
}

/* A traced function that runs its own jitted function: refused (it used to
 * wait for itself forever on the function's lock). */
typedef struct self_caller {
    rf_jitted *f;
    rf_array *x;
    rf_status inner;
    int n_compiled;
} self_caller;

static void self_calling_fn(rf_trace *t, void *ctx)
{
    self_caller *c = ctx;
    c->n_compiled = rf_jitted_n_compiled(c->f);
    c->inner = rf_jitted_run(c->f, &c->x, 1, NULL, 0);
    rf_return(t, rf_sum_all(rf_arg(t, 0)));
}

static void test_jitted_reentry(void)
{
    self_caller c = {NULL, cpu_fill(RF_SHAPE(2, 3), 1.0), RF_OK, -1};
    c.f = rf_jitted_new(self_calling_fn, &c);
    rf_array *y = NULL;
    CHECK_OK(c.f && c.x ? rf_jitted_run(c.f, &c.x, 1, &y, 1) : RF_E_NOMEM);
    CHECK(c.inner == RF_E_INVALID && c.n_compiled == 0);
    CHECK(y && rf_to_number(y) == 6.0 && rf_jitted_n_compiled(c.f) == 1);
    rf_array_free(y);
    rf_jitted_free(c.f);
    rf_array_free(c.x);
}

static void test_run_checks(void)
{
    model m = {0};
    m.w = cpu_fill(RF_SHAPE(4), 0.0);
    rf_array *x = cpu_fill(RF_SHAPE(16, 4), 1.0);
    rf_exec *e = NULL;
    CHECK_OK(rf_compile(add_weights, &m, &x, 1, &e));
    if (!e)
        goto done;
    rf_array *y = (rf_array *)&m; /* garbage: must be reset to NULL on failure */

    rf_array *args3[3] = {x, x, x};
    CHECK_STATUS(rf_exec_run(e, args3, 3, &y, 1), RF_E_INVALID);
    CHECK_MSG("rf_exec_run: expected 1 argument, got 3");
    CHECK(y == NULL);
    CHECK_STATUS(rf_exec_run(NULL, &x, 1, &y, 1), RF_E_INVALID);
    CHECK_STATUS(rf_exec_run(e, NULL, 1, &y, 1), RF_E_INVALID);
    rf_array *null_arg = NULL;
    CHECK_STATUS(rf_exec_run(e, &null_arg, 1, &y, 1), RF_E_INVALID);
    CHECK_MSG("argument 0 is NULL");

    rf_array *host = rf_zeros(RF_F32, RF_SHAPE(16, 4));
    CHECK_STATUS(rf_exec_run(e, &host, 1, &y, 1), RF_E_DEVICE);
    CHECK_MSG("host");
    rf_array_free(host);

    rf_array *h64 = rf_zeros(RF_F64, RF_SHAPE(16, 4));
    rf_to_opts keep = {.keep_f64 = true};
    rf_array *x64 = rf_array_to_opts(h64, rf_device_cpu(), &keep);
    CHECK_STATUS(rf_exec_run(e, &x64, 1, &y, 1), RF_E_DTYPE);
    CHECK_MSG("argument 0: expected f32[16,4], got f64[16,4]");
    rf_array_free(h64);
    rf_array_free(x64);

    rf_array *x8 = cpu_fill(RF_SHAPE(8, 4), 1.0);
    CHECK_STATUS(rf_exec_run(e, &x8, 1, &y, 1), RF_E_SHAPE);
    CHECK_MSG("rf_exec_run: argument 0: expected f32[16,4], got f32[8,4] (compiled for batch "
              "16; compile again for other shapes)");
    rf_array_free(x8);

    rf_array *two[2];
    CHECK_STATUS(rf_exec_run(e, &x, 1, two, 2), RF_E_INVALID);
    CHECK_STATUS(rf_exec_run(e, &x, 1, NULL, 1), RF_E_INVALID);
    CHECK_STATUS(rf_exec_run(e, &x, 1, &y, -1), RF_E_INVALID);
done:
    rf_exec_free(e);
    rf_array_free(m.w);
    rf_array_free(x);
}

static void test_compile_checks(void)
{
    model m = {0};
    m.w = cpu_fill(RF_SHAPE(4), 0.0);
    rf_array *x = cpu_fill(RF_SHAPE(16, 4), 1.0);
    rf_exec *e = (rf_exec *)&m;

    CHECK_STATUS(rf_compile(NULL, &m, &x, 1, &e), RF_E_INVALID);
    CHECK(e == NULL);
    CHECK_STATUS(rf_compile(add_weights, &m, NULL, 1, &e), RF_E_INVALID);
    CHECK_STATUS(rf_compile(add_weights, &m, &x, -1, &e), RF_E_INVALID);
    rf_array *null_arg = NULL;
    CHECK_STATUS(rf_compile(add_weights, &m, &null_arg, 1, &e), RF_E_INVALID);
    CHECK_STATUS(rf_compile(add_weights, &m, &x, 1, NULL), RF_E_INVALID);

    rf_array *host = rf_zeros(RF_F32, RF_SHAPE(8, 4));
    rf_array *hargs[2] = {x, host};
    CHECK_STATUS(rf_compile(add_weights, &m, hargs, 2, &e), RF_E_DEVICE);
    CHECK_MSG("argument 1 (f32[8,4])");
    CHECK_STATUS(rf_compile(captures_host, host, &x, 1, &e), RF_E_DEVICE);
    CHECK_MSG("rf_capture: array f32[8,4] lives on the host; move it to cpu with rf_array_to");
    CHECK_STATUS(rf_compile(captures_null, NULL, &x, 1, &e), RF_E_INVALID);
    CHECK_MSG("rf_capture");

    CHECK_STATUS(rf_compile(returns_nothing, NULL, &x, 1, &e), RF_E_INVALID);
    CHECK_MSG("rf_compile: the traced function returned nothing (call rf_return or rf_assign)");
    CHECK_STATUS(rf_compile(fails_itself, NULL, &x, 1, &e), RF_E_DOMAIN);
    CHECK(strcmp(rf_errmsg(), "my_layer: learning rate -0.5 is negative") == 0);
    CHECK_STATUS(rf_compile(bad_assign, &m, &x, 1, &e), RF_E_SHAPE);
    CHECK_MSG("rf_assign: value f32[16,4] does not match array f32[4]");
    CHECK_STATUS(rf_compile(check_accessors, NULL, &x, 1, &e), RF_E_INVALID);
    CHECK_MSG("rf_arg: argument 1");

    rf_compile_opts on_host = {.device = rf_device_host(), .name = "h"};
    CHECK_STATUS(rf_compile_with(add_weights, &m, &x, 1, &on_host, &e), RF_E_DEVICE);

    setenv("RF_BACKEND", "warp-drive", 1);
    CHECK_STATUS(rf_compile(add_weights, &m, &x, 1, &e), RF_E_UNSUPPORTED);
    CHECK_MSG("warp-drive");
    CHECK_MSG("interp");
    setenv("RF_BACKEND", "interp", 1);
    CHECK_OK(rf_compile(add_weights, &m, &x, 1, &e));
    rf_exec_free(e);
    unsetenv("RF_BACKEND");
    CHECK(e != NULL);

    /* rf_jit and rf_trace_text. */
    rf_array *y = NULL;
    CHECK_OK(rf_jit(add_weights, &m, &x, 1, &y, 1));
    CHECK(y && rf_array_numel(y) == 64);
    rf_array_free(y);
    char *text = NULL;
    uint64_t h1 = 0, h2 = 0;
    CHECK_OK(rf_trace_text(add_weights, &m, &x, 1, &text, &h1));
    CHECK(text && strstr(text, "argument"));
    free(text);
    CHECK_OK(rf_trace_text(add_weights, &m, &x, 1, &text, &h2));
    free(text);
    CHECK(h1 == h2 && h1 != 0);

    rf_array_free(host);
    rf_array_free(m.w);
    rf_array_free(x);
}

static int count_dump_files(const char *dir, const char *suffix)
{
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    int n = 0;
    struct dirent *ent;
    while ((ent = readdir(d))) {
        size_t len = strlen(ent->d_name), sl = strlen(suffix);
        if (len >= sl && strcmp(ent->d_name + len - sl, suffix) == 0 &&
            strncmp(ent->d_name, "dumped-", 7) == 0)
            n++;
    }
    closedir(d);
    return n;
}

static void remove_dump_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *ent;
    char path[4096];
    while ((ent = readdir(d))) {
        if (ent->d_name[0] == '.')
            continue;
        snprintf(path, sizeof path, "%s/%s", dir, ent->d_name);
        remove(path);
    }
    closedir(d);
    rmdir(dir);
}

static void test_dump(void)
{
    char root[] = "/tmp/rf_dump_test_XXXXXX";
    if (!mkdtemp(root)) {
        CHECK(!"mkdtemp failed");
        return;
    }
    char dir[256];
    snprintf(dir, sizeof dir, "%s/nested", root); /* created by the dump */
    setenv("RF_DUMP", dir, 1);

    model m = {0};
    m.w = cpu_fill(RF_SHAPE(4), 0.0);
    rf_array *x = cpu_fill(RF_SHAPE(16, 4), 1.0);
    rf_compile_opts opts = {.name = "dumped"};
    rf_exec *e = NULL;
    CHECK_OK(rf_compile_with(add_weights, &m, &x, 1, &opts, &e));
    /* traced, ad, final; and from the compiling backend: optimised, plan, c */
    bool compiled = strcmp(rf_exec_backend_name(e), "cpu") == 0;
    CHECK(count_dump_files(dir, ".txt") == (compiled ? 6 : 3));
    CHECK(count_dump_files(dir, ".traced.txt") == 1);
    if (compiled) {
        CHECK(count_dump_files(dir, ".optimised.txt") == 1);
        CHECK(count_dump_files(dir, ".plan.txt") == 1);
        CHECK(count_dump_files(dir, ".c.txt") == 1);
    }
    CHECK(count_dump_files(dir, ".ad.txt") == 1);
    CHECK(count_dump_files(dir, ".final.txt") == 1);
    struct stat st;
    CHECK(stat(dir, &st) == 0 && (st.st_mode & 0777) == 0700);
    rf_exec_free(e);
    unsetenv("RF_DUMP");

    remove_dump_dir(dir);
    rmdir(root);
    rf_array_free(m.w);
    rf_array_free(x);
}

int main(void)
{
    test_devices();
    test_array_basics();
    test_array_to();
    test_array_rows();
    test_random();
    test_to_number();
    test_refcount_threads();
    test_capture_keeps_alive();
    test_updates();
    test_argument_is_updated_capture();
    test_jitted();
    test_jitted_reentry();
    test_run_checks();
    test_compile_checks();
    test_dump();
    return tu_finish("test_runtime");
}
