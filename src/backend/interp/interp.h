/* interp.h: internals shared by the reference interpreter's files: element
 * loads and stores for every dtype (one at a time here, runs of them in
 * bulk.c), index helpers, the packed matrices of the contractions
 * (contract.c), and one kernel entry per file. Not a public or cross-backend
 * interface.
 *
 * Numeric model (the oracle that compiled backends are tested against):
 *   - float ops compute in double and round once to the result dtype;
 *   - integer ops compute in int64 with wraparound done in uint64 (no UB),
 *     stores to narrower integers wrap modulo 2^bits;
 *   - bool results are 0/1 (any nonzero value stores as 1);
 *   - stores from double into integers truncate toward zero and saturate
 *     (NaN stores as 0).
 *
 * Kernel contract: `in[k]` is the buffer of operand k (typed as n->in[k]),
 * `out` is a buffer of rfi_interp_nbytes(n) bytes for the result. A kernel
 * returns RF_OK, RF_E_NOMEM (scratch allocation failed) or RF_E_INTERNAL
 * (an op it does not implement reached it).
 */
#ifndef RF_BACKEND_INTERP_H
#define RF_BACKEND_INTERP_H

#include <math.h>
#include <string.h>

#include "../../ir/ir.h"

/* ---- Kernels, one entry per file --------------------------------------------------- */
/* Unary/binary elementwise, COMPARE, SELECT, CLAMP, CONVERT (elementwise.c). */
RFI_FUNC rf_status rfi_interp_elementwise(const rfi_node *n, const void *const *in, void *out);
/* BROADCAST_IN_DIM, RESHAPE, TRANSPOSE, SLICE, CONCATENATE, PAD, REVERSE (shape_ops.c). */
RFI_FUNC rf_status rfi_interp_shape(const rfi_node *n, const void *const *in, void *out);
/* REDUCE, ARGMAX, ARGMIN, REDUCE_WINDOW, SELECT_AND_SCATTER (reduce.c). */
RFI_FUNC rf_status rfi_interp_reduce(const rfi_node *n, const void *const *in, void *out);
/* DOT_GENERAL (linalg.c), which hands CONVOLUTION to conv.c. */
RFI_FUNC rf_status rfi_interp_linalg(const rfi_node *n, const void *const *in, void *out);
RFI_FUNC rf_status rfi_interp_conv(const rfi_node *n, const void *const *in, void *out);
/* GATHER, SCATTER_ADD, RNG, IOTA, CONSTANT (index.c). */
RFI_FUNC rf_status rfi_interp_index(const rfi_node *n, const void *const *in, void *out);

/* Any op the interpreter runs (not leaves that name memory: ARGUMENT, CAPTURE, GRAD),
 * dispatched to the kernels above; the one entry for passes that fold constants. */
RFI_FUNC rf_status rfi_interp_eval_node(const rfi_node *n, const void *const *inputs, void *out);

/* rfi_interp_backend's run that shows each node to `visit` as soon as it is
 * made (the differential check's view of intermediates: cpu/check.c). state
 * is the interpreter backend's prepared state for g. *value is the node's
 * buffer (borrowed memory for ARGUMENT, CAPTURE and CONSTANT leaves), `own`
 * the same buffer when the interpreter computed it (the visitor may change
 * the value in place; NULL for the leaves) and operands[k] its k-th
 * operand's. The visitor may also point *value at other memory of the node's
 * size, which must outlive the run: the nodes after read that instead, and
 * outputs and updates are copied from it. A status other than RF_OK ends the
 * run with it. */
struct rfi_run_io; /* runtime.h */
typedef rf_status (*rfi_interp_visit_fn)(void *ctx, const rfi_node *n, const void **value,
                                         void *own, const void *const *operands);
RFI_FUNC rf_status rfi_interp_run_visited(void *state, const rfi_graph *g,
                                         const struct rfi_run_io *io, rfi_interp_visit_fn visit,
                                         void *ctx);

/* ---- Sizes -------------------------------------------------------------------------- */
static inline int64_t rfi_interp_numel(const rfi_node *n) { return rfi_numel(n->dims, n->rank); }
static inline size_t rfi_interp_nbytes(const rfi_node *n)
{
    return (size_t)rfi_interp_numel(n) * rf_dtype_size(n->dtype);
}

/* memcpy that accepts empty copies from NULL (buffers of empty arrays may be NULL). */
static inline void rfi_interp_copy(void *dst, const void *src, size_t n)
{
    if (n > 0)
        memcpy(dst, src, n);
}

/* Row-major strides (in elements) of dims[0..rank). */
static inline void rfi_interp_strides(const int64_t *dims, int rank, int64_t *strides)
{
    int64_t s = 1;
    for (int d = rank - 1; d >= 0; d--) {
        strides[d] = s;
        s *= dims[d];
    }
}

/* Advances the row-major multi-index idx over dims; returns false after the last one. */
static inline bool rfi_interp_next(int64_t *idx, const int64_t *dims, int rank)
{
    for (int d = rank - 1; d >= 0; d--) {
        if (++idx[d] < dims[d])
            return true;
        idx[d] = 0;
    }
    return false;
}

/* As rfi_interp_next, also keeping *offset == sum idx[d] * step[d] (an odometer:
 * no division or multiplication per element). */
static inline bool rfi_interp_next_offset(int64_t *idx, const int64_t *dims, const int64_t *step,
                                          int rank, int64_t *offset)
{
    for (int d = rank - 1; d >= 0; d--) {
        *offset += step[d];
        if (++idx[d] < dims[d])
            return true;
        *offset -= step[d] * dims[d];
        idx[d] = 0;
    }
    return false;
}

/* ---- Bulk loads and stores (bulk.c) -------------------------------------------------- *
 * Elements [start, start + count) of a buffer, converted exactly as the per-element
 * rfi_ld_* / rfi_st_* below do, with the dtype switch outside the loop so f32/f64 (and
 * i32/i64) runs vectorise. Kernels work on chunks of RFI_INTERP_CHUNK elements. */
#define RFI_INTERP_CHUNK 512
RFI_FUNC void rfi_interp_load_f(const void *p, rf_dtype dt, int64_t start, int64_t count,
                                double *dst);
RFI_FUNC void rfi_interp_load_i(const void *p, rf_dtype dt, int64_t start, int64_t count,
                                int64_t *dst);
RFI_FUNC void rfi_interp_store_f(void *p, rf_dtype dt, int64_t start, int64_t count,
                                 const double *src);
RFI_FUNC void rfi_interp_store_i(void *p, rf_dtype dt, int64_t start, int64_t count,
                                 const int64_t *src);

/* ---- Dense contraction values (contract.c) ------------------------------------------- *
 * Operands of DOT_GENERAL and CONVOLUTION packed into canonical row-major matrices in
 * the arithmetic of the contraction: double for float operands, wrapping int64 for
 * integer ones (exactly one of f / i is set). */
typedef struct rfi_dense {
    bool is_float;
    double *f;
    int64_t *i;
} rfi_dense;

/* count zeroed values; RF_E_NOMEM (with a message naming `what`) if allocation fails. */
RFI_FUNC rf_status rfi_dense_alloc(rfi_dense *d, bool is_float, int64_t count, const char *what);
RFI_FUNC void rfi_dense_free(rfi_dense *d);
/* d[k] = src[base + offsets[k]] (as a value of the arithmetic) for k < count; 0 where
 * offsets[k] < 0 (padding). */
RFI_FUNC void rfi_dense_gather(rfi_dense *d, const void *src, rf_dtype dt, int64_t base,
                               const int64_t *offsets, int64_t count);
/* RF_PRECISION_BF16: d's first count (float) values rounded to bfloat16
 * (rfi_round_bf16). Products of such values are exact, so only the sums
 * round, as in an f32 product. */
RFI_FUNC void rfi_dense_round_bf16(rfi_dense *d, int64_t count);
/* offsets[k] = sum idx[d] * step[d] for the k-th row-major index idx over dims. */
RFI_FUNC void rfi_interp_offsets(const int64_t *dims, const int64_t *step, int rank,
                                 int64_t *offsets);
/* c[m, n] = sum over k of a[m, k] * b[k, n] (row-major, starting at element offsets
 * a0, b0, c0), each sum taken in increasing k from zero: the order of a plain dot. */
RFI_FUNC void rfi_dense_matmul(const rfi_dense *a, int64_t a0, const rfi_dense *b, int64_t b0,
                               rfi_dense *c, int64_t c0, int64_t m, int64_t k, int64_t n);
/* out[out0 + j] = d[d0 + j] rounded into dt, for j < count. */
RFI_FUNC void rfi_dense_store(const rfi_dense *d, int64_t d0, void *out, rf_dtype dt,
                              int64_t out0, int64_t count);

/* ---- Element loads -------------------------------------------------------------- */
static inline double rfi_ld_f(const void *p, rf_dtype dt, int64_t i)
{
    switch (dt) {
    case RF_F32: return ((const float *)p)[i];
    case RF_F64: return ((const double *)p)[i];
    case RF_I32: return ((const int32_t *)p)[i];
    case RF_I64: return (double)((const int64_t *)p)[i];
    case RF_U8: return ((const uint8_t *)p)[i];
    case RF_BOOL: return ((const uint8_t *)p)[i] != 0;
    default: return 0;
    }
}

/* Saturating truncation of v toward zero into [lo, hi]; NaN gives 0. */
static inline int64_t rfi_sat_trunc(double v, int64_t lo, int64_t hi)
{
    if (!(v == v))
        return 0;
    if (v <= (double)lo)
        return lo;
    if (v >= (double)hi) /* (double)INT64_MAX rounds up to 2^63: still saturates */
        return hi;
    return (int64_t)v;
}

static inline int64_t rfi_ld_i(const void *p, rf_dtype dt, int64_t i)
{
    switch (dt) {
    case RF_I32: return ((const int32_t *)p)[i];
    case RF_I64: return ((const int64_t *)p)[i];
    case RF_U8: return ((const uint8_t *)p)[i];
    case RF_BOOL: return ((const uint8_t *)p)[i] != 0;
    case RF_F32:
    case RF_F64: return rfi_sat_trunc(rfi_ld_f(p, dt, i), INT64_MIN, INT64_MAX);
    default: return 0;
    }
}

/* ---- Element stores ----------------------------------------------------------------- */
/* Integer value into dt: wraps into i32/u8 (two's complement), 0/1 for bool. */
static inline void rfi_st_i(void *p, rf_dtype dt, int64_t i, int64_t v)
{
    switch (dt) {
    case RF_F32: ((float *)p)[i] = (float)v; break;
    case RF_F64: ((double *)p)[i] = (double)v; break;
    case RF_I32: ((int32_t *)p)[i] = (int32_t)(uint32_t)(uint64_t)v; break;
    case RF_I64: ((int64_t *)p)[i] = v; break;
    case RF_U8: ((uint8_t *)p)[i] = (uint8_t)(uint64_t)v; break;
    case RF_BOOL: ((uint8_t *)p)[i] = v != 0; break;
    default: break;
    }
}

/* Double value into dt: rounds to f32, truncates and saturates into integers, != 0 for bool. */
static inline void rfi_st_f(void *p, rf_dtype dt, int64_t i, double v)
{
    switch (dt) {
    case RF_F32: ((float *)p)[i] = (float)v; break;
    case RF_F64: ((double *)p)[i] = v; break;
    case RF_I32: ((int32_t *)p)[i] = (int32_t)rfi_sat_trunc(v, INT32_MIN, INT32_MAX); break;
    case RF_I64: ((int64_t *)p)[i] = rfi_sat_trunc(v, INT64_MIN, INT64_MAX); break;
    case RF_U8: ((uint8_t *)p)[i] = (uint8_t)rfi_sat_trunc(v, 0, 255); break;
    case RF_BOOL: ((uint8_t *)p)[i] = v != 0; break;
    default: break;
    }
}

/* The smallest and largest value of an integer (or bool) dtype. */
static inline int64_t rfi_int_min(rf_dtype dt)
{
    return dt == RF_I32 ? INT32_MIN : dt == RF_I64 ? INT64_MIN : 0;
}
static inline int64_t rfi_int_max(rf_dtype dt)
{
    return dt == RF_I32 ? INT32_MAX : dt == RF_I64 ? INT64_MAX : dt == RF_U8 ? 255 : 1;
}

/* Wrapping int64 arithmetic (done in uint64: no signed overflow). */
static inline int64_t rfi_wadd(int64_t a, int64_t b)
{
    return (int64_t)((uint64_t)a + (uint64_t)b);
}
static inline int64_t rfi_wsub(int64_t a, int64_t b)
{
    return (int64_t)((uint64_t)a - (uint64_t)b);
}
static inline int64_t rfi_wmul(int64_t a, int64_t b)
{
    return (int64_t)((uint64_t)a * (uint64_t)b);
}

/* StableHLO max/min on doubles: NaN propagates. */
static inline double rfi_fmax_nan(double a, double b)
{
    return (a != a || b != b) ? NAN : (a > b ? a : b);
}
static inline double rfi_fmin_nan(double a, double b)
{
    return (a != a || b != b) ? NAN : (a < b ? a : b);
}
/* a > b in the order where NaN is greater than every number (and equal to NaN). */
static inline bool rfi_gt_nan_max(double a, double b)
{
    if (a != a)
        return b == b;
    if (b != b)
        return false;
    return a > b;
}

#endif
