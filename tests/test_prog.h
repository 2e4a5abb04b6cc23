/* test_prog.h: helpers for numeric tests that go through the public API only:
 * make host arrays from double literals in any dtype, compile a small traced
 * program on the CPU device (f64 kept as f64), run it on host inputs, read
 * outputs back as doubles and compare them with expected values.
 *
 * It deliberately knows nothing about reflux internals: a test built on it
 * exercises rf_compile / rf_exec_run / rf_grad exactly as a user would.
 */
#ifndef RF_TEST_PROG_H
#define RF_TEST_PROG_H

#include "test_util.h"

#define TP_MAX_ARGS 16

/* Builds the program from its arguments; calls rf_return itself. */
typedef void (*tp_build_fn)(rf_trace *t, rf_tensor *const *args, int nargs, void *user);

typedef struct tp_call {
    tp_build_fn build;
    void *user;
} tp_call;

static inline void tp_trace_fn(rf_trace *t, void *ctx)
{
    tp_call *c = ctx;
    rf_tensor *args[TP_MAX_ARGS] = {0};
    int n = rf_n_args(t);
    for (int i = 0; i < n && i < TP_MAX_ARGS; i++)
        args[i] = rf_arg(t, i);
    c->build(t, args, n, c->user);
}

static inline int64_t tp_numel(const int64_t *dims, int rank)
{
    int64_t n = 1;
    for (int i = 0; i < rank; i++)
        n *= dims[i];
    return n;
}

static inline void tp_store(rf_dtype dt, void *buf, int64_t i, double v)
{
    switch (dt) {
    case RF_F32: ((float *)buf)[i] = (float)v; break;
    case RF_F64: ((double *)buf)[i] = v; break;
    case RF_I32: ((int32_t *)buf)[i] = (int32_t)v; break;
    case RF_I64: ((int64_t *)buf)[i] = (int64_t)v; break;
    case RF_U8: ((uint8_t *)buf)[i] = (uint8_t)(int64_t)v; break; /* -1 -> 255, defined */
    case RF_BOOL: ((uint8_t *)buf)[i] = v != 0.0; break;
    default: break;
    }
}

static inline double tp_load(rf_dtype dt, const void *buf, int64_t i)
{
    switch (dt) {
    case RF_F32: return ((const float *)buf)[i];
    case RF_F64: return ((const double *)buf)[i];
    case RF_I32: return ((const int32_t *)buf)[i];
    case RF_I64: return (double)((const int64_t *)buf)[i];
    case RF_U8: return ((const uint8_t *)buf)[i];
    case RF_BOOL: return ((const uint8_t *)buf)[i];
    default: return NAN;
    }
}

/* A host array of dtype dt holding vals (numel doubles, converted; NULL: zeros). */
static inline rf_array *tp_host(rf_dtype dt, const int64_t *dims, int rank,
                                const double *vals)
{
    int64_t n = tp_numel(dims, rank);
    size_t sz = rf_dtype_size(dt);
    void *buf = calloc((size_t)(n > 0 ? n : 1), sz ? sz : 1);
    if (!buf)
        return NULL;
    for (int64_t i = 0; vals && i < n; i++)
        tp_store(dt, buf, i, vals[i]);
    rf_array *a = rf_array_from(dt, dims, rank, buf);
    free(buf);
    return a;
}

/* A copy of a host array on the CPU device, f64 kept (owned). */
static inline rf_array *tp_cpu(const rf_array *h)
{
    rf_to_opts o = {.keep_f64 = true};
    return rf_array_to_opts(h, rf_device_cpu(), &o);
}

/* A CPU array of dtype dt holding vals. */
static inline rf_array *tp_dev(rf_dtype dt, const int64_t *dims, int rank,
                               const double *vals)
{
    rf_array *h = tp_host(dt, dims, rank, vals);
    rf_array *d = h ? tp_cpu(h) : NULL;
    rf_array_free(h);
    return d;
}

/* Compiles build(args) for the CPU device with CPU arguments dev_args. */
static inline rf_status tp_compile(tp_build_fn build, void *user, rf_array *const *dev_args,
                                   int nargs, rf_exec **e)
{
    tp_call c = {build, user};
    rf_compile_opts o = {.device = rf_device_cpu(), .name = "test"};
    return rf_compile_with(tp_trace_fn, &c, dev_args, nargs, &o, e);
}

/* Copies host_in to the CPU, compiles build, runs it once and stores nouts
 * outputs (owned, CPU arrays) in outs. */
static inline rf_status tp_run(tp_build_fn build, void *user, rf_array *const *host_in,
                               int nin, rf_array **outs, int nouts)
{
    rf_array *dev[TP_MAX_ARGS] = {0};
    rf_status st = RF_OK;
    for (int i = 0; i < nouts; i++)
        outs[i] = NULL;
    if (nin > TP_MAX_ARGS)
        return RF_E_INVALID;
    for (int i = 0; i < nin; i++) {
        dev[i] = tp_cpu(host_in[i]);
        if (!dev[i])
            st = RF_E_NOMEM;
    }
    rf_exec *e = NULL;
    if (st == RF_OK)
        st = tp_compile(build, user, dev, nin, &e);
    if (st == RF_OK)
        st = rf_exec_run(e, dev, nin, outs, nouts);
    rf_exec_free(e);
    for (int i = 0; i < nin; i++)
        rf_array_free(dev[i]);
    return st;
}

/* The elements of a (any device, any dtype) as doubles (malloc'd; NULL on error). */
static inline double *tp_read(const rf_array *a, int64_t *n_out)
{
    if (!a)
        return NULL;
    int64_t n = rf_array_numel(a);
    size_t nb = rf_array_nbytes(a);
    void *buf = malloc(nb ? nb : 1);
    double *v = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
    if (!buf || !v || rf_array_read(a, buf, nb) != RF_OK) {
        free(buf);
        free(v);
        return NULL;
    }
    for (int64_t i = 0; i < n; i++)
        v[i] = tp_load(rf_array_dtype(a), buf, i);
    free(buf);
    if (n_out)
        *n_out = n;
    return v;
}

/* The single element of a as a double. */
static inline double tp_scalar(const rf_array *a)
{
    double *v = tp_read(a, NULL);
    double r = v ? v[0] : NAN;
    free(v);
    return r;
}

static inline bool tp_close(double got, double want, double atol, double rtol)
{
    if (isnan(want))
        return isnan(got);
    if (isinf(want))
        return got == want;
    return fabs(got - want) <= atol + rtol * fabs(want);
}

/* Checks dtype, shape and values of `a` (one check); prints the first
 * mismatches with `label`. */
static inline void tp_expect(const char *label, const rf_array *a, rf_dtype dt,
                             const int64_t *dims, int rank, const double *want, double atol,
                             double rtol)
{
    tu_checks++;
    if (!a) {
        tu_failures++;
        fprintf(stderr, "%s: no output array (%s)\n", label, rf_errmsg());
        return;
    }
    bool ok = true;
    if (rf_array_dtype(a) != dt) {
        fprintf(stderr, "%s: dtype %s, expected %s\n", label, rf_dtype_name(rf_array_dtype(a)),
                rf_dtype_name(dt));
        ok = false;
    }
    bool shape_ok = rf_array_rank(a) == rank;
    for (int i = 0; shape_ok && i < rank; i++)
        shape_ok = rf_array_dims(a)[i] == dims[i];
    if (!shape_ok) {
        fprintf(stderr, "%s: shape [", label);
        for (int i = 0; i < rf_array_rank(a); i++)
            fprintf(stderr, "%s%lld", i ? "," : "", (long long)rf_array_dims(a)[i]);
        fprintf(stderr, "], expected [");
        for (int i = 0; i < rank; i++)
            fprintf(stderr, "%s%lld", i ? "," : "", (long long)dims[i]);
        fprintf(stderr, "]\n");
        ok = false;
    }
    if (shape_ok && want) {
        int64_t n = 0;
        double *got = tp_read(a, &n);
        int shown = 0;
        for (int64_t i = 0; got && i < n; i++) {
            if (!tp_close(got[i], want[i], atol, rtol)) {
                if (shown++ < 6)
                    fprintf(stderr, "%s: element %lld = %.10g, expected %.10g\n", label,
                            (long long)i, got[i], want[i]);
                ok = false;
            }
        }
        if (!got) {
            fprintf(stderr, "%s: could not read output\n", label);
            ok = false;
        }
        if (shown > 6)
            fprintf(stderr, "%s: ... %d mismatching elements\n", label, shown);
        free(got);
    }
    if (!ok)
        tu_failures++;
}

/* Frees n arrays. */
static inline void tp_free_all(rf_array **a, int n)
{
    for (int i = 0; i < n; i++) {
        rf_array_free(a[i]);
        a[i] = NULL;
    }
}

/* Deterministic pseudo-random doubles in [lo, hi) (independent of reflux). */
static inline double tp_rand(uint64_t *state, double lo, double hi)
{
    *state = *state * 6364136223846793005ULL + 1442695040888963407ULL;
    double u = (double)(*state >> 11) * (1.0 / 9007199254740992.0);
    return lo + (hi - lo) * u;
}

#endif
