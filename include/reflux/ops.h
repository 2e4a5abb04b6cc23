/* reflux/ops.h: the operations on traced tensors.
 *
 * Each function records a node in the trace its operands belong to and
 * returns the result (freed with the trace). On invalid input it records the
 * trace's first error (naming the op and the shapes) and returns NULL; a NULL
 * operand gives NULL silently, so a chain of calls needs one check at the end
 * (rf_compile does it). Operands from different traces are an error.
 *
 * Elementwise binaries broadcast NumPy-style (shapes aligned at the right,
 * size-1 dims stretch). Both operands must have the same dtype, except a
 * scalar made by rf_scalar(), which takes the other operand's dtype.
 * Axes may be negative (counted from the end).
 *
 * Primitives follow StableHLO semantics; the functions marked "composite"
 * lower to primitives and have no op of their own.
 */
#ifndef REFLUX_OPS_H
#define REFLUX_OPS_H

#include "trace.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Constants -------------------------------------------------------------- */
/* A weakly typed scalar: it adopts the dtype of the tensor it meets in a
 * binary op; alone it is f32. Meeting an integer or bool tensor it must be one
 * of that dtype's values exactly (else RF_E_DTYPE: x * 0.5 of an integer x is
 * refused, not 0). */
RF_API rf_tensor *rf_scalar(rf_trace *t, double v);
/* A scalar of a given dtype. */
RF_API rf_tensor *rf_scalar_typed(rf_trace *t, rf_dtype dt, double v);
/* A constant tensor with a copy of `data` (row-major). */
RF_API rf_tensor *rf_constant(rf_trace *t, rf_dtype dt, const int64_t *dims, int rank,
                              const void *data);
/* A constant of the given shape filled with v (composite: scalar + broadcast). */
RF_API rf_tensor *rf_full(rf_trace *t, rf_dtype dt, const int64_t *dims, int rank, double v);
RF_API rf_tensor *rf_zeros_like(rf_tensor *x);
RF_API rf_tensor *rf_ones_like(rf_tensor *x);
/* Values 0, 1, ... along `axis` of the given shape. */
RF_API rf_tensor *rf_iota(rf_trace *t, rf_dtype dt, const int64_t *dims, int rank, int axis);

/* ---- Elementwise unary -------------------------------------------------------- */
RF_API rf_tensor *rf_neg(rf_tensor *x);
RF_API rf_tensor *rf_abs(rf_tensor *x);
RF_API rf_tensor *rf_sign(rf_tensor *x); /* -1, 0 or 1; -0 gives +0 (StableHLO: -0) */
RF_API rf_tensor *rf_exp(rf_tensor *x);
RF_API rf_tensor *rf_expm1(rf_tensor *x);
RF_API rf_tensor *rf_log(rf_tensor *x);
RF_API rf_tensor *rf_log1p(rf_tensor *x);
RF_API rf_tensor *rf_sqrt(rf_tensor *x);
RF_API rf_tensor *rf_rsqrt(rf_tensor *x);
RF_API rf_tensor *rf_tanh(rf_tensor *x);
RF_API rf_tensor *rf_logistic(rf_tensor *x); /* 1 / (1 + exp(-x)) */
RF_API rf_tensor *rf_sin(rf_tensor *x);
RF_API rf_tensor *rf_cos(rf_tensor *x);
RF_API rf_tensor *rf_floor(rf_tensor *x);
RF_API rf_tensor *rf_ceil(rf_tensor *x);
RF_API rf_tensor *rf_round(rf_tensor *x);     /* half away from zero */
RF_API rf_tensor *rf_is_finite(rf_tensor *x); /* bool */
RF_API rf_tensor *rf_not(rf_tensor *x);       /* bool or integer (bitwise) */
/* Identity forward, zero gradient. */
RF_API rf_tensor *rf_stop_gradient(rf_tensor *x);

/* ---- Elementwise binary (broadcasting) ---------------------------------------------- */
RF_API rf_tensor *rf_add(rf_tensor *a, rf_tensor *b);
RF_API rf_tensor *rf_sub(rf_tensor *a, rf_tensor *b);
RF_API rf_tensor *rf_mul(rf_tensor *a, rf_tensor *b);
/* Integer division and remainder never trap: x / 0 and x % 0 give 0 (XLA: -1
 * and x), INT_MIN / -1 gives INT_MIN and INT_MIN % -1 gives 0. */
RF_API rf_tensor *rf_div(rf_tensor *a, rf_tensor *b);
RF_API rf_tensor *rf_pow(rf_tensor *a, rf_tensor *b);
/* NaN propagates; of two equal operands (+0 and -0 included) the second is
 * returned, where IEEE 754's maximum orders -0 below +0. The gradient of a tie
 * goes whole to the first operand, a (JAX splits it in halves), except in
 * rf_max(x, 0) against a constant zero (rf_relu), whose gradient is 0 at x = 0
 * as in PyTorch. */
RF_API rf_tensor *rf_max(rf_tensor *a, rf_tensor *b);
RF_API rf_tensor *rf_min(rf_tensor *a, rf_tensor *b);
RF_API rf_tensor *rf_rem(rf_tensor *a, rf_tensor *b); /* C fmod / truncated remainder */
RF_API rf_tensor *rf_and(rf_tensor *a, rf_tensor *b); /* bool or integer */
RF_API rf_tensor *rf_or(rf_tensor *a, rf_tensor *b);
/* Scalar conveniences: rf_add_s(x, 1.0) == rf_add(x, rf_scalar(trace, 1.0)). */
RF_API rf_tensor *rf_add_s(rf_tensor *a, double s);
RF_API rf_tensor *rf_sub_s(rf_tensor *a, double s);
RF_API rf_tensor *rf_mul_s(rf_tensor *a, double s);
RF_API rf_tensor *rf_div_s(rf_tensor *a, double s);
RF_API rf_tensor *rf_pow_s(rf_tensor *a, double s);

typedef enum rf_cmp { RF_EQ = 0, RF_NE, RF_LT, RF_LE, RF_GT, RF_GE, RF_CMP_COUNT } rf_cmp;
/* Elementwise comparison, broadcasting; result is bool. */
RF_API rf_tensor *rf_compare(rf_tensor *a, rf_tensor *b, rf_cmp dir);
/* pred ? a : b elementwise (pred bool), broadcasting all three. */
RF_API rf_tensor *rf_select(rf_tensor *pred, rf_tensor *a, rf_tensor *b);
/* min(max(x, lo), hi), broadcasting lo and hi. */
RF_API rf_tensor *rf_clamp(rf_tensor *x, rf_tensor *lo, rf_tensor *hi);
RF_API rf_tensor *rf_clamp_s(rf_tensor *x, double lo, double hi);
/* Converts to another dtype (float to int truncates toward zero; to bool is != 0). */
RF_API rf_tensor *rf_convert(rf_tensor *x, rf_dtype dt);

/* ---- Shape ---------------------------------------------------------------------- */
/* StableHLO broadcast_in_dim: operand dim i maps to result dim map[i]; the
 * operand dim must be 1 or equal the result dim. */
RF_API rf_tensor *rf_broadcast_in_dim(rf_tensor *x, const int64_t *dims, int rank,
                                      const int64_t *map);
/* NumPy broadcast to a shape (composite). */
RF_API rf_tensor *rf_broadcast_to(rf_tensor *x, const int64_t *dims, int rank);
/* Same elements, new shape; one dim may be -1 (inferred). */
RF_API rf_tensor *rf_reshape(rf_tensor *x, const int64_t *dims, int rank);
/* Result dim i is operand dim perm[i]. */
RF_API rf_tensor *rf_transpose(rf_tensor *x, const int64_t *perm);
/* Elements start[i] <= j < limit[i] with step stride[i] (stride NULL: all 1). */
RF_API rf_tensor *rf_slice(rf_tensor *x, const int64_t *start, const int64_t *limit,
                           const int64_t *stride);
RF_API rf_tensor *rf_concatenate(rf_tensor *const *xs, int n, int axis);
/* Pads with `value` (a scalar tensor): low/high edges (negative crops) and
 * interior (between elements); interior may be NULL. */
RF_API rf_tensor *rf_pad(rf_tensor *x, rf_tensor *value, const int64_t *low, const int64_t *high,
                         const int64_t *interior);
RF_API rf_tensor *rf_reverse(rf_tensor *x, const int64_t *axes, int naxes);
/* Drops / inserts a size-1 axis (composites over reshape). */
RF_API rf_tensor *rf_squeeze(rf_tensor *x, int axis);
RF_API rf_tensor *rf_unsqueeze(rf_tensor *x, int axis);
/* Flattens all but the first axis: N x ... -> N x prod(...) (composite). */
RF_API rf_tensor *rf_flatten(rf_tensor *x);

/* ---- Reductions ------------------------------------------------------------------ */
typedef enum rf_reduce_kind {
    RF_REDUCE_SUM = 0, RF_REDUCE_MAX, RF_REDUCE_MIN, RF_REDUCE_PROD,
    RF_REDUCE_AND, RF_REDUCE_OR, RF_REDUCE_KIND_COUNT
} rf_reduce_kind;
/* Reduces over axes[0..naxes) (naxes 0 with axes NULL: over all axes);
 * keepdims keeps them as size 1. */
RF_API rf_tensor *rf_reduce(rf_tensor *x, rf_reduce_kind kind, const int64_t *axes, int naxes,
                            bool keepdims);
RF_API rf_tensor *rf_sum(rf_tensor *x, const int64_t *axes, int naxes, bool keepdims);
RF_API rf_tensor *rf_reduce_max(rf_tensor *x, const int64_t *axes, int naxes, bool keepdims);
RF_API rf_tensor *rf_mean(rf_tensor *x, const int64_t *axes, int naxes, bool keepdims);
/* Biased variance (divides by the count), as Flux's normalisation layers use.
 * Its gradient is 2 (x - mean) / count: the path through the mean, which is
 * zero, is not traced (the mean is a stop_gradient inside). */
RF_API rf_tensor *rf_var(rf_tensor *x, const int64_t *axes, int naxes, bool keepdims);
RF_API rf_tensor *rf_sum_all(rf_tensor *x);  /* scalar */
RF_API rf_tensor *rf_mean_all(rf_tensor *x); /* scalar */
/* Index of the first max/min along axis (the axis is removed); i64. */
RF_API rf_tensor *rf_argmax(rf_tensor *x, int axis);
RF_API rf_tensor *rf_argmin(rf_tensor *x, int axis);

/* ---- Linear algebra ------------------------------------------------------------- */
/* StableHLO dot_general. Result dims: batch dims, then lhs free dims, then rhs free dims. */
RF_API rf_tensor *rf_dot_general(rf_tensor *a, rf_tensor *b,
                                 const int64_t *lhs_batch, const int64_t *rhs_batch, int nbatch,
                                 const int64_t *lhs_contract, const int64_t *rhs_contract,
                                 int ncontract);
/* NumPy matmul: 1-D and batched operands, leading batch dims broadcast. */
RF_API rf_tensor *rf_matmul(rf_tensor *a, rf_tensor *b);
/* x @ w^T (+ b): x [N, in], w [out, in] (PyTorch/Flux weight layout), b [out] or NULL. */
RF_API rf_tensor *rf_linear(rf_tensor *x, rf_tensor *w, rf_tensor *b);

/* ---- Convolution and pooling ------------------------------------------------------------ */
/* Convolution of x [N, C, spatial...] with w [O, C/groups, kernel...] (cross-
 * correlation, like PyTorch and StableHLO). Arrays have nspatial entries (1..3);
 * a stride, dilation or group count of 0 means 1, so a designated initializer
 * names only what differs from the defaults (rf_conv_params_default spells
 * them out); negative padding crops. lhs_dilation
 * spaces the input (transposed convolution); rhs_dilation spaces the kernel.
 * batch_group_count > 1 is the form the weight gradient of grouped convolution uses. */
typedef struct rf_conv_params {
    int nspatial;
    int64_t stride[3];
    int64_t pad_lo[3], pad_hi[3];
    int64_t lhs_dilation[3];
    int64_t rhs_dilation[3];
    int64_t feature_group_count; /* 0 or 1: ordinary convolution */
    int64_t batch_group_count;   /* 0 or 1: ordinary convolution */
} rf_conv_params;
/* Defaults for n spatial dims: stride 1, no padding, no dilation, one group. */
RF_API rf_conv_params rf_conv_params_default(int nspatial);
RF_API rf_tensor *rf_conv(rf_tensor *x, rf_tensor *w, const rf_conv_params *p);

/* StableHLO reduce_window over every dim of x (window/stride/padding have
 * rank(x) entries; padding counts as the reduction's identity). A window
 * larger than a non-empty padded axis is refused (RF_E_SHAPE, as PyTorch
 * refuses it) where StableHLO gives an empty axis; rf_conv likewise for a
 * dilated kernel larger than its padded, dilated input. An empty axis stays
 * empty. */
RF_API rf_tensor *rf_reduce_window(rf_tensor *x, rf_reduce_kind kind, const int64_t *window,
                                   const int64_t *strides, const int64_t *pad_lo,
                                   const int64_t *pad_hi);
/* 2-D pooling on NCHW (composites over reduce_window); pad NULL: none. */
RF_API rf_tensor *rf_maxpool2d(rf_tensor *x, const int64_t k[2], const int64_t stride[2],
                               const int64_t pad[2]);
RF_API rf_tensor *rf_meanpool2d(rf_tensor *x, const int64_t k[2], const int64_t stride[2],
                                const int64_t pad[2]);
/* StableHLO select_and_scatter with select = first max, scatter = add: the
 * gradient of max-pooling. Result has x's shape. */
RF_API rf_tensor *rf_select_and_scatter(rf_tensor *x, rf_tensor *source, const int64_t *window,
                                        const int64_t *strides, const int64_t *pad_lo,
                                        const int64_t *pad_hi);

/* ---- Indexing ------------------------------------------------------------------- */
/* NumPy take: picks slices of x along `axis` at integer `indices` (i32/i64);
 * result shape x[:axis] + indices.shape + x[axis+1:]. Out-of-range indices
 * are clamped (StableHLO semantics). Embedding lookup is rf_gather(table, ids, 0). */
RF_API rf_tensor *rf_gather(rf_tensor *x, rf_tensor *indices, int axis);
/* Adds `updates` (shaped as rf_gather's result would be) into a copy of x at
 * `indices` along `axis`; duplicate indices accumulate, out-of-range are dropped. */
RF_API rf_tensor *rf_scatter_add(rf_tensor *x, rf_tensor *indices, rf_tensor *updates, int axis);
/* x[i, idx[i]] for x [N, C] and integer idx [N] (composite). */
RF_API rf_tensor *rf_take_along(rf_tensor *x, rf_tensor *idx);
/* One-hot along a new last axis: labels [...] -> [..., nclasses] of dtype dt
 * (composite: compare with iota). */
RF_API rf_tensor *rf_onehot(rf_tensor *labels, int64_t nclasses, rf_dtype dt);

/* ---- Random numbers --------------------------------------------------------------
 * Counter-based (Philox4x32-10). A key is an i64 array of shape {2} (seed,
 * counter) that the program holds as state: rf_rng_key captures it and makes
 * the program advance its counter once per run, so each run draws new numbers
 * and a run is reproducible from the seed. Each rf_rng_* call in one program
 * uses its own stream. */
RF_API rf_array *rf_rng_key_new(uint64_t seed, rf_device *dev); /* owned */
RF_API rf_tensor *rf_rng_key(rf_trace *t, rf_array *key);
RF_API rf_tensor *rf_rng_uniform(rf_tensor *key, rf_dtype dt, const int64_t *dims, int rank);
RF_API rf_tensor *rf_rng_normal(rf_tensor *key, rf_dtype dt, const int64_t *dims, int rank);

/* ---- Neural-network composites --------------------------------------------------- */
RF_API rf_tensor *rf_relu(rf_tensor *x);
RF_API rf_tensor *rf_leakyrelu(rf_tensor *x, double slope);
RF_API rf_tensor *rf_elu(rf_tensor *x, double alpha);
RF_API rf_tensor *rf_gelu(rf_tensor *x);  /* tanh approximation, as Flux's gelu */
RF_API rf_tensor *rf_swish(rf_tensor *x); /* x * sigmoid(x), a.k.a. silu */
RF_API rf_tensor *rf_sigmoid(rf_tensor *x);
RF_API rf_tensor *rf_softplus(rf_tensor *x);
RF_API rf_tensor *rf_softmax(rf_tensor *x, int axis);
RF_API rf_tensor *rf_logsoftmax(rf_tensor *x, int axis);
RF_API rf_tensor *rf_logsumexp(rf_tensor *x, int axis, bool keepdims);

#ifdef __cplusplus
}
#endif
#endif
