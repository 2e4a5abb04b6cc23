/* test_math_range.c: exp and the functions built on it (expm1, sigmoid, softplus, elu,
 * softmax) over
 * their whole range, f32 and f64: results that overflow, that are subnormal or round to
 * zero, infinities and NaN, and, on the compiling backend, their cost there: a masked
 * score of -1e9 must cost about what a score of -1 costs. glibc's vector exp took a
 * scalar path for such lanes, 20-30 times slower than its vector one.
 *
 * Oracle: the C library's scalar functions in long double (expl, expm1l), rounded to
 * the dtype; the values must agree to a few ulp, subnormal results to a few of the
 * smallest subnormal. Timings compare the same compiled program on two inputs.
 */
#define _POSIX_C_SOURCE 200809L
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "test_prog.h"

static const double inputs[] = {
    -1e9, -INFINITY, -1e30, -800, -746, -745.1, -720, -708.5, -200, -150, -104.5, -103.9,
    -103.3, -95, -90, -87.5, -50, -20.5, -1, -0.0, 0, 1e-8, 1, 50, 88.5, 88.72, 88.73, 89,
    100, 709.7, 709.8, 720, 1e9, INFINITY, NAN,
};
#define N_INPUTS ((int)(sizeof inputs / sizeof inputs[0]))

typedef enum fn { FN_EXP, FN_EXPM1, FN_SIGMOID, FN_SOFTPLUS, FN_ELU, N_FN } fn;
static const char *const fn_names[N_FN] = {"exp", "expm1", "sigmoid", "softplus", "elu"};

static void build_fn(rf_trace *t, rf_tensor *const *a, int n, void *user)
{
    (void)n;
    fn f = *(const fn *)user;
    rf_tensor *y = f == FN_EXP        ? rf_exp(a[0])
                   : f == FN_EXPM1    ? rf_expm1(a[0])
                   : f == FN_SIGMOID  ? rf_sigmoid(a[0])
                   : f == FN_SOFTPLUS ? rf_softplus(a[0])
                                      : rf_elu(a[0], 1.0);
    rf_return(t, y);
}

static long double oracle(fn f, long double x)
{
    if (f == FN_EXP)
        return expl(x);
    if (f == FN_EXPM1)
        return expm1l(x);
    if (f == FN_SOFTPLUS)
        return x != x ? x : (x > 0 ? x : 0) + log1pl(expl(-fabsl(x)));
    if (f == FN_ELU)
        return x > 0 ? x : expm1l(x);
    return x >= 0 ? 1 / (1 + expl(-x)) : expl(x) / (1 + expl(x));
}

/* Every input, three times and two more (vector bodies and scalar tails), against the
 * oracle: 4 ulp relative (logistic in f64: 5) or 4 of the smallest subnormal. */
static void test_values(rf_dtype dt, fn f)
{
    enum { N = 3 * N_INPUTS + 2 };
    double x[N], want[N];
    for (int i = 0; i < N; i++) {
        x[i] = inputs[i % N_INPUTS];
        if (dt == RF_F32)
            x[i] = (float)x[i];
        long double w = oracle(f, (long double)x[i]);
        want[i] = dt == RF_F32 ? (double)(float)w : (double)w;
    }
    rf_array *in = tp_host(dt, RF_SHAPE(N), x), *out = NULL;
    CHECK_OK(tp_run(build_fn, &f, &in, 1, &out, 1));
    double eps = dt == RF_F32 ? FLT_EPSILON : DBL_EPSILON;
    double tiny = dt == RF_F32 ? 0x1p-149 : 0x1p-1074;
    char label[64];
    snprintf(label, sizeof label, "%s %s", fn_names[f], rf_dtype_name(dt));
    tp_expect(label, out, dt, RF_SHAPE(N), want, 4 * tiny, (f == FN_SIGMOID ? 5 : 4) * eps);
    rf_array_free(out);
    rf_array_free(in);
}

static void build_softmax(rf_trace *t, rf_tensor *const *a, int n, void *user)
{
    (void)n, (void)user;
    rf_return(t, rf_softmax(a[0], 1));
}

/* Rows of scores, half of them masked by -1e9 or -inf: those get exactly 0, the others
 * the softmax of the unmasked scores. */
static void test_masked_softmax(rf_dtype dt)
{
    enum { R = 6, C = 37 };
    double x[R * C], want[R * C];
    for (int r = 0; r < R; r++) {
        double m = -INFINITY, s = 0;
        for (int c = 0; c < C; c++) {
            double v = (double)((r * 7 + c * 13) % 17) * 0.37 - 3;
            x[r * C + c] = (c + r) % 2 ? (r % 3 ? -1e9 : -INFINITY) : v;
            m = fmax(m, x[r * C + c]);
        }
        for (int c = 0; c < C; c++)
            s += exp(x[r * C + c] - m);
        for (int c = 0; c < C; c++)
            want[r * C + c] = exp(x[r * C + c] - m) / s;
    }
    rf_array *in = tp_host(dt, RF_SHAPE(R, C), x), *out = NULL;
    CHECK_OK(tp_run(build_softmax, NULL, &in, 1, &out, 1));
    tp_expect(dt == RF_F32 ? "masked softmax f32" : "masked softmax f64", out, dt,
              RF_SHAPE(R, C), want, 0, dt == RF_F32 ? 1e-6 : 1e-14);
    rf_array_free(out);
    rf_array_free(in);
}

/* ---- Cost ----------------------------------------------------------------------------- */

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* A CPU array of n copies of v. */
static rf_array *filled(rf_dtype dt, int64_t n, double v)
{
    double *vals = malloc(sizeof *vals * (size_t)n);
    for (int64_t i = 0; vals && i < n; i++)
        vals[i] = v;
    rf_array *a = vals ? tp_dev(dt, RF_SHAPE(n), vals) : NULL;
    free(vals);
    return a;
}

/* Seconds of one run of e on in. */
static double run_time(rf_exec *e, rf_array *in)
{
    rf_array *out = NULL;
    double t0 = now();
    CHECK_OK(rf_exec_run(e, &in, 1, &out, 1));
    double t = now() - t0;
    rf_array_free(out);
    return t;
}

/* Compiled, each function on inputs whose results underflow or overflow costs at most 3
 * times what it costs at -1 (measured on an AVX2 core: at most 1.1 times, against 6-30
 * times through glibc's vector functions). Only the compiling backend is timed, and
 * without RF_CHECK, which runs the interpreter beside it. */
static void test_cost(rf_dtype dt, fn f)
{
    const char *backend = getenv("RF_BACKEND"), *check = getenv("RF_CHECK");
    if (backend && strcmp(backend, "cpu") != 0)
        return;
    char *saved = check ? strdup(check) : NULL;
    unsetenv("RF_CHECK");
    enum { N = 1 << 20 };
    rf_array *shape = tp_dev(dt, RF_SHAPE(N), NULL);
    rf_exec *e = NULL;
    CHECK_OK(tp_compile(build_fn, &f, &shape, 1, &e));
    const double xs[] = {-1, -1e9, -200, 1e9};
    bool up = f != FN_EXPM1 && f != FN_ELU; /* expm1 overflowing: not fixed */
    int nx = up ? 4 : 3;
    rf_array *in[4] = {0};
    double best[4];
    for (int i = 0; i < nx; i++)
        in[i] = filled(dt, N, xs[i]);
    /* interleaved, so that a busy moment slows every input alike; measured again (up
     * to 3 times) while an input looks slow, as another process may have taken the
     * core: a cliff is slow every time */
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < nx; i++)
            best[i] = INFINITY;
        for (int rep = 0; e && rep < 15; rep++)
            for (int i = 0; i < nx; i++)
                if (in[i])
                    best[i] = fmin(best[i], run_time(e, in[i]));
        bool slow = false;
        for (int i = 1; i < nx; i++)
            slow |= !(best[i] <= 3 * best[0]);
        if (!slow)
            break;
    }
    printf("%s %s, ns per element: %.2f at -1", fn_names[f], rf_dtype_name(dt),
           best[0] / N * 1e9);
    for (int i = 1; i < nx; i++) {
        printf(", %.2f at %g", best[i] / N * 1e9, xs[i]);
        tu_checks++;
        if (!(best[i] <= 3 * best[0])) {
            tu_failures++;
            fprintf(stderr, "%s %s: %.2f ns per element at %g, %.2f at -1\n", fn_names[f],
                    rf_dtype_name(dt), best[i] / N * 1e9, xs[i], best[0] / N * 1e9);
        }
    }
    printf("\n");
    for (int i = 0; i < nx; i++)
        rf_array_free(in[i]);
    rf_exec_free(e);
    rf_array_free(shape);
    if (saved)
        setenv("RF_CHECK", saved, 1);
    free(saved);
}

int main(void)
{
    for (int d = 0; d < 2; d++) {
        rf_dtype dt = d ? RF_F64 : RF_F32;
        for (int f = 0; f < N_FN; f++)
            test_values(dt, (fn)f);
        test_masked_softmax(dt);
        for (int f = 0; f < N_FN; f++)
            test_cost(dt, (fn)f);
    }
    printf("test_math_range: %d checks, %d failed\n", tu_checks, tu_failures);
    return tu_failures ? 1 : 0;
}
