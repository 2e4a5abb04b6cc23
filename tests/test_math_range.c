/* test_math_range.c: exp and the functions built on it (expm1, sigmoid, softplus, elu,
 * softmax) over their whole range, f32 and f64: results that overflow, that are
 * subnormal or round to zero, infinities and NaN. (What they cost there is measured by
 * bench/bench_math.c.)
 *
 * Oracle: the C library's scalar functions in long double (expl, expm1l), rounded to
 * the dtype; the values must agree to a few ulp, subnormal results to a few of the
 * smallest subnormal.
 */
#define _POSIX_C_SOURCE 200809L
#include <float.h>
#include <stdint.h>
#include <stdlib.h>

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

int main(void)
{
    for (int d = 0; d < 2; d++) {
        rf_dtype dt = d ? RF_F64 : RF_F32;
        for (int f = 0; f < N_FN; f++)
            test_values(dt, (fn)f);
        test_masked_softmax(dt);
    }
    printf("test_math_range: %d checks, %d failed\n", tu_checks, tu_failures);
    return tu_failures ? 1 : 0;
}
