/* bench_math.c: what the compiled exp and the functions built on it (expm1,
 * sigmoid, softplus, elu) cost per element across their input range, f32 and
 * f64. A vector exp that takes a scalar path for lanes whose result
 * underflows or overflows (glibc's did: 10-30 times its vector cost) makes
 * masked attention scores of -1e9 far slower than ordinary ones; here every
 * input should cost about what -1 costs, but for f32 exp's subnormal results
 * (at -90: 2-2.5 times). One line per function and dtype:
 *   name dtype ns_per_element at -1=T at -90=T ... worst/at-1=R
 * R being the worst ratio to the cost at -1. Times are the best of interleaved
 * runs over 1M elements, so a busy moment slows every input alike.
 * Set RF_NUM_THREADS=1 for per-core numbers.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "bench_util.h"
#include "reflux.h"

typedef enum fn { FN_EXP, FN_EXPM1, FN_SIGMOID, FN_SOFTPLUS, FN_ELU, N_FN } fn;
static const char *const fn_names[N_FN] = {"exp", "expm1", "sigmoid", "softplus", "elu"};

/* Inputs: -1, then results that underflow and (where the function grows) overflow. */
static const double inputs[] = {-1, -90, -200, -1e9, 100, 1e9};
#define N_INPUTS ((int)(sizeof inputs / sizeof inputs[0]))
#define N_ELEMENTS (1 << 20)
#define ROUNDS 15

static void trace_fn(rf_trace *t, void *ctx)
{
    fn f = *(const fn *)ctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_tensor *y = f == FN_EXP        ? rf_exp(x)
                   : f == FN_EXPM1    ? rf_expm1(x)
                   : f == FN_SIGMOID  ? rf_sigmoid(x)
                   : f == FN_SOFTPLUS ? rf_softplus(x)
                                      : rf_elu(x, 1.0);
    rf_return(t, y);
}

/* Seconds of one run of e on in; INFINITY when it fails. */
static double run_time(rf_exec *e, rf_array *in)
{
    rf_array *out = NULL;
    double t0 = now_s();
    rf_status st = rf_exec_run(e, &in, 1, &out, 1);
    double t = now_s() - t0;
    rf_array_free(out);
    return st == RF_OK ? t : INFINITY;
}

/* A CPU array of N_ELEMENTS copies of v. */
static rf_array *filled(rf_dtype dt, double v)
{
    int64_t dims[1] = {N_ELEMENTS};
    rf_array *h = rf_fill(dt, dims, 1, v);
    rf_to_opts keep = {.keep_f64 = true};
    rf_array *d = h ? rf_array_to_opts(h, rf_device_cpu(), &keep) : NULL;
    rf_array_free(h);
    return d;
}

static int bench(rf_dtype dt, fn f)
{
    rf_array *in[N_INPUTS];
    for (int i = 0; i < N_INPUTS; i++)
        in[i] = filled(dt, inputs[i]);
    rf_exec *e = NULL;
    rf_status st = in[0] ? rf_compile(trace_fn, &f, in, 1, &e) : RF_E_NOMEM;
    if (st != RF_OK) {
        fprintf(stderr, "bench_math: %s %s: %s\n", fn_names[f], rf_dtype_name(dt), rf_errmsg());
        for (int i = 0; i < N_INPUTS; i++)
            rf_array_free(in[i]);
        return 1;
    }
    double best[N_INPUTS];
    for (int i = 0; i < N_INPUTS; i++)
        best[i] = INFINITY;
    for (int round = 0; round < ROUNDS; round++)
        for (int i = 0; i < N_INPUTS; i++)
            if (in[i])
                best[i] = fmin(best[i], run_time(e, in[i]));
    double worst = 0;
    printf("%-8s %s ns_per_element", fn_names[f], rf_dtype_name(dt));
    for (int i = 0; i < N_INPUTS; i++) {
        printf(" at %g=%.2f", inputs[i], best[i] / N_ELEMENTS * 1e9);
        worst = fmax(worst, best[i] / best[0]);
    }
    printf(" worst/at-1=%.1f\n", worst);
    rf_exec_free(e);
    for (int i = 0; i < N_INPUTS; i++)
        rf_array_free(in[i]);
    return 0;
}

int main(void)
{
    int failed = 0;
    for (int d = 0; d < 2; d++)
        for (int f = 0; f < N_FN; f++)
            failed |= bench(d ? RF_F64 : RF_F32, (fn)f);
    return failed;
}
