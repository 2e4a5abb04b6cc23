/* test_api.c: the public op layer builds the right graphs: result shapes and
 * dtypes of broadcasting, weak scalars, reshape, matmul, squeeze/unsqueeze,
 * flatten, reductions, the softmax family, onehot, take_along, pooling,
 * convolution, indexing, RNG and rf_grad; and invalid inputs give NULL with
 * the trace's status and a message naming the op and the shapes.
 *
 * Values are not computed here (the interpreter's tests do that): every case
 * is traced with rf_trace_text and checked while tracing.
 */
#include "test_util.h"

/* ---- Helpers --------------------------------------------------------------------------- */

static void check_type(const char *file, int line, const rf_tensor *x, rf_dtype dt,
                       const int64_t *dims, int rank)
{
    tu_checks++;
    bool ok = x && rf_tensor_dtype(x) == dt && rf_tensor_rank(x) == rank;
    for (int i = 0; ok && i < rank; i++)
        ok = rf_tensor_dims(x)[i] == dims[i];
    if (ok)
        return;
    tu_failures++;
    fprintf(stderr, "%s:%d: expected %s rank %d [", file, line, rf_dtype_name(dt), rank);
    for (int i = 0; i < rank; i++)
        fprintf(stderr, i ? ",%lld" : "%lld", (long long)dims[i]);
    if (!x) {
        fprintf(stderr, "], got NULL (%s)\n", rf_errmsg());
        return;
    }
    fprintf(stderr, "], got %s rank %d [", rf_dtype_name(rf_tensor_dtype(x)), rf_tensor_rank(x));
    for (int i = 0; i < rf_tensor_rank(x); i++)
        fprintf(stderr, i ? ",%lld" : "%lld", (long long)rf_tensor_dims(x)[i]);
    fprintf(stderr, "]\n");
}
/* CHECK_TYPE(x, RF_F32, 16, 8); CHECK_SCALAR(x, RF_F32) for rank 0. */
#define CHECK_TYPE(x, dt, ...) check_type(__FILE__, __LINE__, (x), (dt), RF_SHAPE(__VA_ARGS__))
#define CHECK_SCALAR(x, dt) check_type(__FILE__, __LINE__, (x), (dt), NULL, 0)

static rf_tensor *zeros(rf_trace *t, rf_dtype dt, const int64_t *dims, int rank)
{
    return rf_full(t, dt, dims, rank, 0.0);
}

/* Traces fn and checks the trace succeeded; returns the text (owned) or NULL.
 * Also compiles it, so the verifier and the autodiff pass see every graph. */
static char *trace_ok(rf_trace_fn fn, void *ctx, const char *what)
{
    char *text = NULL;
    rf_status st = rf_trace_text(fn, ctx, NULL, 0, &text, NULL);
    tu_checks++;
    if (st != RF_OK) {
        tu_failures++;
        fprintf(stderr, "%s: trace failed: %s (%s)\n", what, rf_status_str(st), rf_errmsg());
    }
    rf_exec *e = NULL;
    st = rf_compile(fn, ctx, NULL, 0, &e);
    tu_checks++;
    if (st != RF_OK) {
        tu_failures++;
        fprintf(stderr, "%s: compile failed: %s (%s)\n", what, rf_status_str(st), rf_errmsg());
    }
    rf_exec_free(e);
    return text;
}

/* One invalid call: `op` builds it in a fresh trace; it must return NULL,
 * the trace must fail with `st` and the message must contain `msg`. */
typedef rf_tensor *(*bad_op)(rf_trace *t);
static void trace_bad_op(rf_trace *t, void *ctx)
{
    bad_op op = *(bad_op *)ctx;
    CHECK(op(t) == NULL);
}
static void expect_error_at(const char *file, int line, bad_op op, rf_status st, const char *msg)
{
    char *text = NULL;
    rf_status got = rf_trace_text(trace_bad_op, &op, NULL, 0, &text, NULL);
    tu_checks++;
    if (got != st || !strstr(rf_errmsg(), msg)) {
        tu_failures++;
        fprintf(stderr, "%s:%d: got %s \"%s\", expected %s with \"%s\"\n", file, line,
                rf_status_str(got), rf_errmsg(), rf_status_str(st), msg);
    }
    free(text);
}
#define EXPECT_ERROR(op, st, msg) expect_error_at(__FILE__, __LINE__, (op), (st), (msg))

/* ---- Broadcasting and weak scalars --------------------------------------------------------- */

static void trace_broadcast(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *a = zeros(t, RF_F32, RF_SHAPE(16, 8)), *b = zeros(t, RF_F32, RF_SHAPE(8));
    CHECK_TYPE(rf_add(a, b), RF_F32, 16, 8);
    CHECK_TYPE(rf_sub(b, a), RF_F32, 16, 8);
    /* size-1 dims stretch on both sides, ranks align at the right */
    rf_tensor *c = zeros(t, RF_F32, RF_SHAPE(4, 1, 3)), *d = zeros(t, RF_F32, RF_SHAPE(5, 1));
    CHECK_TYPE(rf_mul(c, d), RF_F32, 4, 5, 3);
    CHECK_TYPE(rf_max(zeros(t, RF_F32, RF_SHAPE(1, 3)), zeros(t, RF_F32, RF_SHAPE(2, 1))), RF_F32,
               2, 3);
    CHECK_TYPE(rf_div(rf_scalar_typed(t, RF_F32, 2), a), RF_F32, 16, 8);
    CHECK_TYPE(rf_compare(a, b, RF_LT), RF_BOOL, 16, 8);
    rf_tensor *p = zeros(t, RF_BOOL, RF_SHAPE(3, 1));
    CHECK_TYPE(rf_select(p, zeros(t, RF_F64, RF_SHAPE(1, 4)), rf_scalar(t, 1)), RF_F64, 3, 4);
    CHECK_TYPE(rf_clamp(a, rf_scalar(t, -1), zeros(t, RF_F32, RF_SHAPE(8))), RF_F32, 16, 8);
    CHECK_TYPE(rf_and(p, zeros(t, RF_BOOL, RF_SHAPE(2))), RF_BOOL, 3, 2);
    CHECK_TYPE(rf_broadcast_to(b, RF_SHAPE(2, 16, 8)), RF_F32, 2, 16, 8);
    CHECK(rf_broadcast_to(a, RF_SHAPE(16, 8)) == a); /* no node for a no-op */
    rf_return(t, rf_add(a, b));
}

static void trace_weak(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = zeros(t, RF_F64, RF_SHAPE(3));
    CHECK_TYPE(rf_add(x, rf_scalar(t, 2)), RF_F64, 3);
    CHECK_TYPE(rf_mul(rf_scalar(t, 2), x), RF_F64, 3);
    CHECK_TYPE(rf_add_s(x, 1), RF_F64, 3);
    CHECK_TYPE(rf_pow_s(x, 2), RF_F64, 3);
    CHECK_TYPE(rf_div_s(x, 3), RF_F64, 3);
    CHECK_TYPE(rf_compare(x, rf_scalar(t, 0), RF_GE), RF_BOOL, 3);
    CHECK_TYPE(rf_clamp_s(x, 0, 1), RF_F64, 3);
    CHECK_SCALAR(rf_neg(rf_scalar(t, 1)), RF_F32);
    CHECK_TYPE(rf_add(x, rf_neg(rf_scalar(t, 1))), RF_F64, 3); /* -weak stays weak */
    CHECK_TYPE(rf_mul_s(zeros(t, RF_I32, RF_SHAPE(2)), 3), RF_I32, 2);
    CHECK_SCALAR(rf_add(rf_scalar(t, 1), rf_scalar(t, 2)), RF_F32); /* alone: f32 */
    CHECK_SCALAR(rf_convert(rf_scalar(t, 7), RF_I64), RF_I64);
    CHECK_TYPE(rf_convert(x, RF_F32), RF_F32, 3);
    CHECK_TYPE(rf_zeros_like(x), RF_F64, 3);
    CHECK_TYPE(rf_ones_like(x), RF_F64, 3);
    CHECK_TYPE(rf_iota(t, RF_I32, RF_SHAPE(2, 5), -1), RF_I32, 2, 5);
    CHECK_TYPE(rf_constant(t, RF_F32, RF_SHAPE(2), (const float[]){1, 2}), RF_F32, 2);
    rf_return(t, rf_add(x, rf_scalar(t, 2)));
}

static rf_tensor *bad_add(rf_trace *t)
{
    return rf_add(zeros(t, RF_F32, RF_SHAPE(16, 8)), zeros(t, RF_F32, RF_SHAPE(16, 9)));
}
static rf_tensor *bad_dtypes(rf_trace *t)
{
    return rf_mul(zeros(t, RF_F32, RF_SHAPE(2)), zeros(t, RF_F64, RF_SHAPE(2)));
}
static rf_tensor *bad_pow_int(rf_trace *t) { return rf_pow_s(zeros(t, RF_I32, RF_SHAPE(2)), 2); }
static rf_tensor *bad_exp_int(rf_trace *t) { return rf_exp(zeros(t, RF_I64, RF_SHAPE(2))); }
static rf_tensor *bad_select(rf_trace *t)
{
    rf_tensor *x = zeros(t, RF_F32, RF_SHAPE(2));
    return rf_select(x, x, x);
}
static rf_tensor *bad_broadcast_to(rf_trace *t)
{
    return rf_broadcast_to(zeros(t, RF_F32, RF_SHAPE(3)), RF_SHAPE(4));
}
static rf_tensor *bad_constant(rf_trace *t) { return rf_constant(t, RF_F32, RF_SHAPE(2), NULL); }
static rf_tensor *bad_compare_dir(rf_trace *t)
{
    rf_tensor *x = zeros(t, RF_F32, RF_SHAPE(2));
    return rf_compare(x, x, RF_CMP_COUNT);
}

static void test_broadcast(void)
{
    char *text = trace_ok(trace_broadcast, NULL, "broadcast");
    CHECK(text && strstr(text, "broadcast_in_dim"));
    free(text);
    text = trace_ok(trace_weak, NULL, "weak");
    /* weak scalars become typed rank-0 constants of the other operand's dtype */
    CHECK(text && strstr(text, ": f64[]"));
    free(text);
    EXPECT_ERROR(bad_add, RF_E_SHAPE, "rf_add: shapes f32[16,8] and f32[16,9] do not broadcast");
    EXPECT_ERROR(bad_dtypes, RF_E_DTYPE, "rf_mul: dtypes of f32[2] and f64[2] differ");
    EXPECT_ERROR(bad_pow_int, RF_E_DTYPE, "rf_pow: needs a float tensor, got i32[2]");
    EXPECT_ERROR(bad_exp_int, RF_E_DTYPE, "rf_exp: needs a float tensor, got i64[2]");
    EXPECT_ERROR(bad_select, RF_E_DTYPE, "rf_select: pred must be bool, got f32[2]");
    EXPECT_ERROR(bad_broadcast_to, RF_E_SHAPE,
                 "rf_broadcast_to: cannot broadcast f32[3] to f32[4]");
    EXPECT_ERROR(bad_constant, RF_E_INVALID, "rf_constant: data is NULL");
    EXPECT_ERROR(bad_compare_dir, RF_E_INVALID, "rf_compare: invalid direction");
}

/* ---- Shape ops ----------------------------------------------------------------------------- */

static void trace_shapes(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = zeros(t, RF_F32, RF_SHAPE(2, 3, 4));
    CHECK_TYPE(rf_reshape(x, RF_SHAPE(-1, 4)), RF_F32, 6, 4);
    CHECK_TYPE(rf_reshape(x, RF_SHAPE(4, -1, 2)), RF_F32, 4, 3, 2);
    CHECK_TYPE(rf_reshape(x, RF_SHAPE(-1)), RF_F32, 24);
    CHECK(rf_reshape(x, RF_SHAPE(2, -1, 4)) == x);
    rf_tensor *y = zeros(t, RF_F32, RF_SHAPE(2, 1, 3));
    CHECK_TYPE(rf_squeeze(y, 1), RF_F32, 2, 3);
    CHECK_TYPE(rf_squeeze(y, -2), RF_F32, 2, 3);
    CHECK_TYPE(rf_unsqueeze(y, 0), RF_F32, 1, 2, 1, 3);
    CHECK_TYPE(rf_unsqueeze(y, -1), RF_F32, 2, 1, 3, 1);
    CHECK_TYPE(rf_unsqueeze(y, 3), RF_F32, 2, 1, 3, 1);
    CHECK_TYPE(rf_flatten(zeros(t, RF_F32, RF_SHAPE(2, 3, 4, 5))), RF_F32, 2, 60);
    CHECK_TYPE(rf_flatten(zeros(t, RF_F32, RF_SHAPE(7))), RF_F32, 7, 1);
    CHECK_TYPE(rf_transpose(x, (const int64_t[]){2, 0, 1}), RF_F32, 4, 2, 3);
    CHECK_TYPE(rf_slice(x, (const int64_t[]){0, 1, 0}, (const int64_t[]){2, 3, 4},
                        (const int64_t[]){1, 1, 2}),
               RF_F32, 2, 2, 2);
    rf_tensor *parts[3] = {x, zeros(t, RF_F32, RF_SHAPE(2, 5, 4)), x};
    CHECK_TYPE(rf_concatenate(parts, 3, 1), RF_F32, 2, 11, 4);
    CHECK_TYPE(rf_concatenate(parts, 1, -1), RF_F32, 2, 3, 4);
    CHECK_TYPE(rf_pad(x, rf_scalar(t, 0), (const int64_t[]){1, 0, 0}, (const int64_t[]){0, 2, -1},
                      (const int64_t[]){0, 1, 0}),
               RF_F32, 3, 7, 3);
    CHECK_TYPE(rf_reverse(x, (const int64_t[]){-1, 0}, 2), RF_F32, 2, 3, 4);
    CHECK_TYPE(rf_broadcast_in_dim(zeros(t, RF_F32, RF_SHAPE(3)), RF_SHAPE(3, 5),
                                   (const int64_t[]){0}),
               RF_F32, 3, 5);
    rf_return(t, rf_reshape(x, RF_SHAPE(-1, 4)));
}

/* Huge attribute values: an error, never a signed overflow in the checks. */
static rf_tensor *huge_reshape(rf_trace *t)
{
    return rf_reshape(zeros(t, RF_F32, RF_SHAPE(2, 3)), RF_SHAPE(-1, 3, 0x5555555555555556));
}
static rf_tensor *huge_pad(rf_trace *t)
{
    rf_tensor *x = zeros(t, RF_F32, RF_SHAPE(4));
    return rf_pad(x, rf_scalar(t, 0), (const int64_t[]){INT64_MAX}, (const int64_t[]){1}, NULL);
}
static rf_tensor *huge_interior(rf_trace *t)
{
    rf_tensor *x = zeros(t, RF_F32, RF_SHAPE(4));
    return rf_pad(x, rf_scalar(t, 0), NULL, NULL, (const int64_t[]){INT64_MAX / 2});
}
static rf_tensor *huge_conv_pad(rf_trace *t)
{
    rf_conv_params p = rf_conv_params_default(1);
    p.pad_lo[0] = INT64_MAX;
    p.pad_hi[0] = 1;
    return rf_conv(zeros(t, RF_F32, RF_SHAPE(1, 1, 4)), zeros(t, RF_F32, RF_SHAPE(1, 1, 2)), &p);
}
static rf_tensor *huge_conv_dilation(rf_trace *t)
{
    rf_conv_params p = rf_conv_params_default(1);
    p.lhs_dilation[0] = INT64_MAX;
    return rf_conv(zeros(t, RF_F32, RF_SHAPE(1, 1, 4)), zeros(t, RF_F32, RF_SHAPE(1, 1, 2)), &p);
}
static rf_tensor *huge_pool_pad(rf_trace *t)
{
    return rf_maxpool2d(zeros(t, RF_F32, RF_SHAPE(1, 1, 4, 4)), (const int64_t[]){2, 2}, NULL,
                        (const int64_t[]){INT64_MAX, 0});
}
/* An empty spatial axis dilated stays empty: JAX gives [1, 1, 1] here. */
static void trace_empty_conv(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_conv_params p = rf_conv_params_default(1);
    p.lhs_dilation[0] = 2;
    p.pad_lo[0] = p.pad_hi[0] = 1;
    rf_tensor *y = rf_conv(zeros(t, RF_F32, RF_SHAPE(1, 1, 0)), zeros(t, RF_F32, RF_SHAPE(1, 1, 2)),
                           &p);
    CHECK_TYPE(y, RF_F32, 1, 1, 1);
    rf_return(t, y);
}

static rf_tensor *bad_reshape(rf_trace *t)
{
    return rf_reshape(zeros(t, RF_F32, RF_SHAPE(2, 3, 4)), RF_SHAPE(5, -1));
}
static rf_tensor *bad_reshape_two(rf_trace *t)
{
    return rf_reshape(zeros(t, RF_F32, RF_SHAPE(2, 3, 4)), RF_SHAPE(-1, -1));
}
static rf_tensor *bad_squeeze(rf_trace *t)
{
    return rf_squeeze(zeros(t, RF_F32, RF_SHAPE(2, 1, 3)), 0);
}
static rf_tensor *bad_unsqueeze(rf_trace *t)
{
    return rf_unsqueeze(zeros(t, RF_F32, RF_SHAPE(2, 3)), 4);
}
static rf_tensor *bad_flatten(rf_trace *t) { return rf_flatten(rf_scalar(t, 1)); }
static rf_tensor *bad_transpose(rf_trace *t)
{
    return rf_transpose(zeros(t, RF_F32, RF_SHAPE(2, 3)), (const int64_t[]){0, 0});
}
static rf_tensor *bad_slice(rf_trace *t)
{
    return rf_slice(zeros(t, RF_F32, RF_SHAPE(2, 3)), (const int64_t[]){0, 0},
                    (const int64_t[]){2, 4}, NULL);
}
static rf_tensor *bad_concat(rf_trace *t)
{
    rf_tensor *xs[2] = {zeros(t, RF_F32, RF_SHAPE(2, 3)), zeros(t, RF_F32, RF_SHAPE(3, 3))};
    return rf_concatenate(xs, 2, 1);
}

static void test_shapes(void)
{
    free(trace_ok(trace_shapes, NULL, "shapes"));
    EXPECT_ERROR(bad_reshape, RF_E_SHAPE,
                 "rf_reshape: cannot reshape f32[2,3,4] (24 elements) to [5,-1]");
    EXPECT_ERROR(bad_reshape_two, RF_E_SHAPE, "rf_reshape: more than one -1");
    EXPECT_ERROR(bad_squeeze, RF_E_SHAPE, "rf_squeeze: axis 0 of f32[2,1,3] has size 2, not 1");
    EXPECT_ERROR(bad_unsqueeze, RF_E_INVALID, "rf_unsqueeze: axis 4 out of range for f32[2,3]");
    EXPECT_ERROR(bad_flatten, RF_E_SHAPE, "rf_flatten: cannot flatten a scalar");
    EXPECT_ERROR(bad_transpose, RF_E_INVALID, "rf_transpose: [0,0] is not a permutation");
    EXPECT_ERROR(bad_slice, RF_E_SHAPE, "rf_slice: invalid slice");
    EXPECT_ERROR(bad_concat, RF_E_SHAPE, "rf_concatenate: f32[2,3] and f32[3,3] do not fit");
    EXPECT_ERROR(huge_reshape, RF_E_SHAPE, "rf_reshape: the product of [-1,3,");
    EXPECT_ERROR(huge_pad, RF_E_SHAPE, "rf_pad: invalid padding of axis 0");
    EXPECT_ERROR(huge_interior, RF_E_SHAPE, "rf_pad: invalid padding of axis 0");
    EXPECT_ERROR(huge_conv_pad, RF_E_SHAPE, "do not fit along spatial axis 0");
    EXPECT_ERROR(huge_conv_dilation, RF_E_SHAPE, "do not fit along spatial axis 0");
    EXPECT_ERROR(huge_pool_pad, RF_E_SHAPE, "does not fit axis 2");
    free(trace_ok(trace_empty_conv, NULL, "empty conv"));
}

/* ---- Reductions ------------------------------------------------------------------------------ */

static void trace_reductions(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = zeros(t, RF_F32, RF_SHAPE(2, 3, 4));
    CHECK_TYPE(rf_sum(x, (const int64_t[]){1}, 1, false), RF_F32, 2, 4);
    CHECK_TYPE(rf_sum(x, (const int64_t[]){1}, 1, true), RF_F32, 2, 1, 4);
    CHECK_TYPE(rf_sum(x, (const int64_t[]){-1, 0}, 2, false), RF_F32, 3);
    CHECK_SCALAR(rf_sum_all(x), RF_F32);
    CHECK_TYPE(rf_sum(x, NULL, 0, true), RF_F32, 1, 1, 1);
    CHECK_SCALAR(rf_mean_all(x), RF_F32);
    CHECK_TYPE(rf_mean(x, (const int64_t[]){2}, 1, true), RF_F32, 2, 3, 1);
    CHECK_TYPE(rf_var(x, (const int64_t[]){0, 2}, 2, false), RF_F32, 3);
    CHECK_TYPE(rf_reduce_max(x, (const int64_t[]){0}, 1, false), RF_F32, 3, 4);
    CHECK_TYPE(rf_reduce(zeros(t, RF_BOOL, RF_SHAPE(5, 2)), RF_REDUCE_AND, (const int64_t[]){1}, 1,
                         false),
               RF_BOOL, 5);
    CHECK_TYPE(rf_argmax(x, 1), RF_I64, 2, 4);
    CHECK_TYPE(rf_argmin(x, -1), RF_I64, 2, 3);
    rf_return(t, rf_mean_all(x));
}

static rf_tensor *bad_axes_repeated(rf_trace *t)
{
    return rf_sum(zeros(t, RF_F32, RF_SHAPE(2, 3)), (const int64_t[]){1, -1}, 2, false);
}
static rf_tensor *bad_axis(rf_trace *t) { return rf_argmax(zeros(t, RF_F32, RF_SHAPE(2, 3)), 2); }
static rf_tensor *bad_mean_int(rf_trace *t) { return rf_mean_all(zeros(t, RF_I32, RF_SHAPE(2))); }

static void test_reductions(void)
{
    free(trace_ok(trace_reductions, NULL, "reductions"));
    EXPECT_ERROR(bad_axes_repeated, RF_E_INVALID, "rf_sum: axis -1 repeated for f32[2,3]");
    EXPECT_ERROR(bad_axis, RF_E_INVALID, "rf_argmax: axis 2 out of range for f32[2,3]");
    EXPECT_ERROR(bad_mean_int, RF_E_DTYPE, "rf_mean: needs a float tensor, got i32[2]");
}

/* ---- Linear algebra ---------------------------------------------------------------------- */

static void trace_matmul(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *v3 = zeros(t, RF_F32, RF_SHAPE(3)), *m23 = zeros(t, RF_F32, RF_SHAPE(2, 3));
    rf_tensor *m34 = zeros(t, RF_F32, RF_SHAPE(3, 4));
    CHECK_SCALAR(rf_matmul(v3, v3), RF_F32);
    CHECK_TYPE(rf_matmul(v3, m34), RF_F32, 4);
    CHECK_TYPE(rf_matmul(m23, v3), RF_F32, 2);
    CHECK_TYPE(rf_matmul(m23, m34), RF_F32, 2, 4);
    CHECK_TYPE(rf_matmul(zeros(t, RF_F32, RF_SHAPE(5, 2, 3)), m34), RF_F32, 5, 2, 4);
    CHECK_TYPE(rf_matmul(m23, zeros(t, RF_F32, RF_SHAPE(7, 3, 4))), RF_F32, 7, 2, 4);
    rf_tensor *b5x1 = zeros(t, RF_F32, RF_SHAPE(5, 1, 2, 3));
    CHECK_TYPE(rf_matmul(b5x1, zeros(t, RF_F32, RF_SHAPE(6, 3, 4))), RF_F32, 5, 6, 2, 4);
    CHECK_TYPE(rf_matmul(v3, zeros(t, RF_F32, RF_SHAPE(7, 3, 4))), RF_F32, 7, 4);
    CHECK_TYPE(rf_matmul(zeros(t, RF_F32, RF_SHAPE(7, 2, 3)), v3), RF_F32, 7, 2);
    /* linear: x [N, in], w [out, in], b [out] */
    rf_tensor *w = zeros(t, RF_F32, RF_SHAPE(4, 3)), *b = zeros(t, RF_F32, RF_SHAPE(4));
    CHECK_TYPE(rf_linear(m23, w, b), RF_F32, 2, 4);
    CHECK_TYPE(rf_linear(m23, w, NULL), RF_F32, 2, 4);
    rf_tensor *b523 = zeros(t, RF_F32, RF_SHAPE(5, 2, 3));
    CHECK_TYPE(rf_dot_general(b523, zeros(t, RF_F32, RF_SHAPE(5, 4, 3)),
                              (const int64_t[]){0}, (const int64_t[]){0}, 1, (const int64_t[]){-1},
                              (const int64_t[]){2}, 1),
               RF_F32, 5, 2, 4);
    rf_return(t, rf_matmul(m23, m34));
}

static rf_tensor *bad_matmul(rf_trace *t)
{
    return rf_matmul(zeros(t, RF_F32, RF_SHAPE(2, 3)), zeros(t, RF_F32, RF_SHAPE(4, 5)));
}
static rf_tensor *bad_matmul_batch(rf_trace *t)
{
    return rf_matmul(zeros(t, RF_F32, RF_SHAPE(2, 2, 3)), zeros(t, RF_F32, RF_SHAPE(3, 3, 4)));
}
static rf_tensor *bad_matmul_scalar(rf_trace *t)
{
    return rf_matmul(rf_scalar_typed(t, RF_F32, 1), zeros(t, RF_F32, RF_SHAPE(3)));
}
static rf_tensor *bad_linear(rf_trace *t)
{
    return rf_linear(zeros(t, RF_F32, RF_SHAPE(2, 3)), zeros(t, RF_F32, RF_SHAPE(3, 4)), NULL);
}
static rf_tensor *bad_linear_bias(rf_trace *t)
{
    return rf_linear(zeros(t, RF_F32, RF_SHAPE(2, 3)), zeros(t, RF_F32, RF_SHAPE(4, 3)),
                     zeros(t, RF_F32, RF_SHAPE(3)));
}

static void test_matmul(void)
{
    free(trace_ok(trace_matmul, NULL, "matmul"));
    EXPECT_ERROR(bad_matmul, RF_E_SHAPE, "rf_matmul: shapes f32[2,3] and f32[4,5] do not fit");
    EXPECT_ERROR(bad_matmul_batch, RF_E_SHAPE,
                 "rf_matmul: batch dims of f32[2,2,3] and f32[3,3,4] do not broadcast");
    EXPECT_ERROR(bad_matmul_scalar, RF_E_SHAPE, "rf_matmul: shapes f32[] and f32[3] do not fit");
    EXPECT_ERROR(bad_linear, RF_E_SHAPE, "rf_linear: x f32[2,3] and w f32[3,4] do not fit");
    EXPECT_ERROR(bad_linear_bias, RF_E_SHAPE, "rf_linear: bias f32[3] does not fit w f32[4,3]");
}

/* ---- Neural-network ops ------------------------------------------------------------------ */

static void trace_nn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = zeros(t, RF_F32, RF_SHAPE(4, 10));
    CHECK_TYPE(rf_softmax(x, -1), RF_F32, 4, 10);
    CHECK_TYPE(rf_softmax(x, 0), RF_F32, 4, 10);
    CHECK_TYPE(rf_logsoftmax(x, 1), RF_F32, 4, 10);
    CHECK_TYPE(rf_logsumexp(x, 1, false), RF_F32, 4);
    CHECK_TYPE(rf_logsumexp(x, 1, true), RF_F32, 4, 1);
    CHECK_TYPE(rf_logsumexp(x, 0, false), RF_F32, 10);
    CHECK_TYPE(rf_relu(x), RF_F32, 4, 10);
    CHECK_TYPE(rf_leakyrelu(x, 0.01), RF_F32, 4, 10);
    CHECK_TYPE(rf_elu(x, 1.0), RF_F32, 4, 10);
    CHECK_TYPE(rf_gelu(x), RF_F32, 4, 10);
    CHECK_TYPE(rf_swish(x), RF_F32, 4, 10);
    CHECK_TYPE(rf_sigmoid(x), RF_F32, 4, 10);
    CHECK_TYPE(rf_softplus(zeros(t, RF_F64, RF_SHAPE(3))), RF_F64, 3);
    CHECK_TYPE(rf_relu(zeros(t, RF_I32, RF_SHAPE(3))), RF_I32, 3);

    rf_tensor *labels = rf_iota(t, RF_I64, RF_SHAPE(5), 0);
    CHECK_TYPE(rf_onehot(labels, 10, RF_F32), RF_F32, 5, 10);
    CHECK_TYPE(rf_onehot(zeros(t, RF_I32, RF_SHAPE(2, 3)), 4, RF_BOOL), RF_BOOL, 2, 3, 4);
    CHECK_TYPE(rf_onehot(zeros(t, RF_U8, RF_SHAPE(2)), 300, RF_F64), RF_F64, 2, 300);

    rf_tensor *scores = zeros(t, RF_F32, RF_SHAPE(4, 5));
    CHECK_TYPE(rf_take_along(scores, rf_iota(t, RF_I64, RF_SHAPE(4), 0)), RF_F32, 4);
    CHECK_TYPE(rf_take_along(scores, zeros(t, RF_I32, RF_SHAPE(4))), RF_F32, 4);

    rf_tensor *img = zeros(t, RF_F32, RF_SHAPE(2, 3, 8, 8));
    CHECK_TYPE(rf_maxpool2d(img, (const int64_t[]){2, 2}, NULL, NULL), RF_F32, 2, 3, 4, 4);
    CHECK_TYPE(rf_maxpool2d(img, (const int64_t[]){3, 3}, (const int64_t[]){1, 1},
                            (const int64_t[]){1, 1}),
               RF_F32, 2, 3, 8, 8);
    CHECK_TYPE(rf_maxpool2d(img, (const int64_t[]){3, 3}, (const int64_t[]){2, 2}, NULL), RF_F32, 2,
               3, 3, 3);
    CHECK_TYPE(rf_maxpool2d(img, (const int64_t[]){2, 4}, NULL, NULL), RF_F32, 2, 3, 4, 2);
    CHECK_TYPE(rf_meanpool2d(img, (const int64_t[]){2, 2}, NULL, NULL), RF_F32, 2, 3, 4, 4);
    CHECK_TYPE(rf_reduce_window(img, RF_REDUCE_SUM, (const int64_t[]){1, 3, 2, 2}, NULL, NULL,
                                NULL),
               RF_F32, 2, 1, 7, 7);
    CHECK_TYPE(rf_select_and_scatter(img, zeros(t, RF_F32, RF_SHAPE(2, 3, 4, 4)),
                                     (const int64_t[]){1, 1, 2, 2}, (const int64_t[]){1, 1, 2, 2},
                                     NULL, NULL),
               RF_F32, 2, 3, 8, 8);

    /* convolution: x [N, C, H, W], w [O, C/G, kh, kw] */
    rf_tensor *xc = zeros(t, RF_F32, RF_SHAPE(2, 3, 9, 9));
    CHECK_TYPE(rf_conv(xc, zeros(t, RF_F32, RF_SHAPE(4, 3, 3, 3)), NULL), RF_F32, 2, 4, 7, 7);
    rf_conv_params p = rf_conv_params_default(2);
    p.stride[0] = p.stride[1] = 2;
    p.pad_lo[0] = p.pad_lo[1] = p.pad_hi[0] = p.pad_hi[1] = 1;
    CHECK_TYPE(rf_conv(xc, zeros(t, RF_F32, RF_SHAPE(4, 3, 3, 3)), &p), RF_F32, 2, 4, 5, 5);
    rf_conv_params g = rf_conv_params_default(2);
    g.feature_group_count = 2;
    rf_tensor *x4 = zeros(t, RF_F32, RF_SHAPE(2, 4, 5, 5));
    CHECK_TYPE(rf_conv(x4, zeros(t, RF_F32, RF_SHAPE(6, 2, 3, 3)), &g), RF_F32, 2, 6, 3, 3);
    rf_conv_params d1 = rf_conv_params_default(1);
    d1.rhs_dilation[0] = 2;
    CHECK_TYPE(rf_conv(zeros(t, RF_F32, RF_SHAPE(1, 1, 10)), zeros(t, RF_F32, RF_SHAPE(1, 1, 3)),
                       &d1),
               RF_F32, 1, 1, 6);

    /* gather / scatter_add: result x[:axis] + indices.shape + x[axis+1:] */
    rf_tensor *table = zeros(t, RF_F32, RF_SHAPE(5, 3));
    rf_tensor *ids = zeros(t, RF_I64, RF_SHAPE(2, 4));
    CHECK_TYPE(rf_gather(table, ids, 0), RF_F32, 2, 4, 3);
    CHECK_TYPE(rf_gather(table, zeros(t, RF_I32, RF_SHAPE(7)), -1), RF_F32, 5, 7);
    CHECK_TYPE(rf_scatter_add(table, ids, zeros(t, RF_F32, RF_SHAPE(2, 4, 3)), 0), RF_F32, 5, 3);
    rf_return(t, rf_softmax(x, -1));
}

static rf_tensor *bad_softmax_int(rf_trace *t)
{
    return rf_softmax(zeros(t, RF_I32, RF_SHAPE(2)), 0);
}
static rf_tensor *bad_softmax_axis(rf_trace *t)
{
    return rf_logsoftmax(zeros(t, RF_F32, RF_SHAPE(2, 3)), 2);
}
static rf_tensor *bad_onehot_float(rf_trace *t)
{
    return rf_onehot(zeros(t, RF_F32, RF_SHAPE(2)), 3, RF_F32);
}
static rf_tensor *bad_onehot_classes(rf_trace *t)
{
    return rf_onehot(zeros(t, RF_I64, RF_SHAPE(2)), 0, RF_F32);
}
static rf_tensor *bad_take_along(rf_trace *t)
{
    return rf_take_along(zeros(t, RF_F32, RF_SHAPE(4, 5)), zeros(t, RF_I64, RF_SHAPE(3)));
}
static rf_tensor *bad_take_along_dtype(rf_trace *t)
{
    return rf_take_along(zeros(t, RF_F32, RF_SHAPE(4, 5)), zeros(t, RF_F32, RF_SHAPE(4)));
}
static rf_tensor *bad_pool_rank(rf_trace *t)
{
    return rf_maxpool2d(zeros(t, RF_F32, RF_SHAPE(3, 8, 8)), (const int64_t[]){2, 2}, NULL, NULL);
}
static rf_tensor *bad_pool_window(rf_trace *t)
{
    return rf_maxpool2d(zeros(t, RF_F32, RF_SHAPE(1, 1, 8, 8)), (const int64_t[]){9, 9}, NULL,
                        NULL);
}
static rf_tensor *bad_conv_channels(rf_trace *t)
{
    return rf_conv(zeros(t, RF_F32, RF_SHAPE(2, 3, 9, 9)), zeros(t, RF_F32, RF_SHAPE(4, 2, 3, 3)),
                   NULL);
}
static rf_tensor *bad_conv_rank(rf_trace *t)
{
    return rf_conv(zeros(t, RF_F32, RF_SHAPE(2, 3, 9)), zeros(t, RF_F32, RF_SHAPE(4, 3, 3, 3)),
                   NULL);
}
static rf_tensor *bad_scatter(rf_trace *t)
{
    return rf_scatter_add(zeros(t, RF_F32, RF_SHAPE(5, 3)), zeros(t, RF_I64, RF_SHAPE(2)),
                          zeros(t, RF_F32, RF_SHAPE(2, 4)), 0);
}
static rf_tensor *bad_gather_dtype(rf_trace *t)
{
    return rf_gather(zeros(t, RF_F32, RF_SHAPE(5, 3)), zeros(t, RF_F32, RF_SHAPE(2)), 0);
}

static void test_nn(void)
{
    free(trace_ok(trace_nn, NULL, "nn"));
    EXPECT_ERROR(bad_softmax_int, RF_E_DTYPE, "rf_softmax: needs a float tensor, got i32[2]");
    EXPECT_ERROR(bad_softmax_axis, RF_E_INVALID, "rf_logsoftmax: axis 2 out of range for f32[2,3]");
    EXPECT_ERROR(bad_onehot_float, RF_E_DTYPE, "rf_onehot: needs integer labels");
    EXPECT_ERROR(bad_onehot_classes, RF_E_SHAPE, "rf_onehot: invalid class count 0");
    EXPECT_ERROR(bad_take_along, RF_E_SHAPE, "rf_take_along: needs x [N, C] (C >= 1) and idx [N], "
                                             "got f32[4,5] and i64[3]");
    EXPECT_ERROR(bad_take_along_dtype, RF_E_DTYPE, "rf_take_along: indices must be i32 or i64");
    EXPECT_ERROR(bad_pool_rank, RF_E_SHAPE, "rf_maxpool2d: needs x [N, C, H, W]");
    EXPECT_ERROR(bad_pool_window, RF_E_SHAPE, "rf_maxpool2d: window 9");
    EXPECT_ERROR(bad_conv_channels, RF_E_SHAPE, "rf_conv: x f32[2,3,9,9] and w f32[4,2,3,3]");
    EXPECT_ERROR(bad_conv_rank, RF_E_SHAPE, "rf_conv: x f32[2,3,9] and w f32[4,3,3,3]");
    EXPECT_ERROR(bad_scatter, RF_E_SHAPE, "rf_scatter_add: updates f32[2,4] do not match f32[2,3]");
    EXPECT_ERROR(bad_gather_dtype, RF_E_DTYPE, "rf_gather: indices must be i32 or i64, got f32[2]");
}

/* ---- NULL propagation and mixing traces -------------------------------------------------- */

static void trace_nulls(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = zeros(t, RF_F32, RF_SHAPE(2));
    CHECK(rf_add(NULL, x) == NULL);
    CHECK(rf_exp(NULL) == NULL);
    CHECK(rf_matmul(x, NULL) == NULL);
    CHECK(rf_softmax(NULL, 0) == NULL);
    CHECK(rf_reshape(NULL, RF_SHAPE(2)) == NULL);
    CHECK(rf_select(NULL, x, x) == NULL);
    CHECK(rf_scalar(NULL, 1) == NULL);
    CHECK(rf_add_s(NULL, 1) == NULL);
    CHECK(rf_onehot(NULL, 3, RF_F32) == NULL);
    CHECK(rf_conv(NULL, x, NULL) == NULL);
    CHECK(rf_rng_key(NULL, NULL) == NULL);
    CHECK(rf_rng_uniform(NULL, RF_F32, RF_SHAPE(2)) == NULL);
    CHECK(rf_trace_status(t) == RF_OK); /* silently: no error recorded */
    rf_return(t, x);
}

static void trace_inner_mix(rf_trace *t, void *ctx)
{
    rf_tensor *outer = ctx;
    CHECK(rf_add(zeros(t, RF_F32, RF_SHAPE(2)), outer) == NULL);
}

/* the outer tensor first: the error still belongs to this (inner) trace */
static void trace_inner_mix_reversed(rf_trace *t, void *ctx)
{
    rf_tensor *outer = ctx;
    CHECK(rf_mul(outer, zeros(t, RF_F32, RF_SHAPE(2))) == NULL);
    CHECK(rf_trace_status(t) == RF_E_INVALID);
}

static void trace_outer_mix(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = zeros(t, RF_F32, RF_SHAPE(2));
    char *text = NULL;
    CHECK_STATUS(rf_trace_text(trace_inner_mix, x, NULL, 0, &text, NULL), RF_E_INVALID);
    CHECK_MSG("rf_add: operands f32[2] and f32[2] belong to different traces");
    free(text);
    text = NULL;
    CHECK_STATUS(rf_trace_text(trace_inner_mix_reversed, x, NULL, 0, &text, NULL),
                 RF_E_INVALID);
    CHECK_MSG("rf_mul: operands f32[2] and f32[2] belong to different traces");
    free(text);
    CHECK(rf_trace_status(t) == RF_OK);
    rf_return(t, x);
}

static void test_nulls(void)
{
    free(trace_ok(trace_nulls, NULL, "nulls"));
    free(trace_ok(trace_outer_mix, NULL, "mixing traces"));
}

/* ---- Gradients and RNG ------------------------------------------------------------------- */

static void trace_grad(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *w = zeros(t, RF_F32, RF_SHAPE(3, 4)), *x = zeros(t, RF_F32, RF_SHAPE(2, 3));
    rf_tensor *y = rf_mean_all(rf_matmul(x, w));
    rf_tensor *wrt[2] = {w, x}, *g[2] = {NULL, NULL};
    CHECK_OK(rf_grad(t, y, wrt, 2, g));
    CHECK_TYPE(g[0], RF_F32, 3, 4);
    CHECK_TYPE(g[1], RF_F32, 2, 3);
    CHECK_OK(rf_grad(t, y, NULL, 0, NULL));
    rf_return(t, g[0]);
}

static void trace_grad_bad(rf_trace *t, void *ctx)
{
    int which = *(int *)ctx;
    rf_tensor *x = zeros(t, RF_F32, RF_SHAPE(2, 3)), *g = x;
    rf_tensor *y = which == 0 ? rf_sum(x, (const int64_t[]){0}, 1, false)
                              : rf_sum_all(rf_convert(x, RF_I32));
    CHECK(rf_grad(t, y, &x, 1, &g) != RF_OK);
    CHECK(g == NULL);
}

static void test_grad(void)
{
    char *text = trace_ok(trace_grad, NULL, "grad");
    CHECK(text && strstr(text, "grad("));
    free(text);
    int which = 0;
    CHECK_STATUS(rf_trace_text(trace_grad_bad, &which, NULL, 0, &text, NULL), RF_E_SHAPE);
    CHECK_MSG("rf_grad: y must be a float scalar, got f32[3]");
    which = 1;
    CHECK_STATUS(rf_trace_text(trace_grad_bad, &which, NULL, 0, &text, NULL), RF_E_DTYPE);
    CHECK_MSG("rf_grad: y must be a float scalar, got i32[]");
    CHECK_STATUS(rf_grad(NULL, NULL, NULL, 0, NULL), RF_E_INVALID);
}

static void trace_rng(rf_trace *t, void *ctx)
{
    rf_array *key = ctx;
    rf_tensor *k1 = rf_rng_key(t, key), *k2 = rf_rng_key(t, key);
    CHECK(k1 && k1 == k2);
    rf_tensor *u = rf_rng_uniform(k1, RF_F32, RF_SHAPE(3, 4));
    rf_tensor *n = rf_rng_normal(k2, RF_F64, RF_SHAPE(5));
    CHECK_TYPE(u, RF_F32, 3, 4);
    CHECK_TYPE(n, RF_F64, 5);
    CHECK_SCALAR(rf_rng_uniform(k1, RF_F32, NULL, 0), RF_F32);
    rf_return(t, u);
    rf_return(t, n);
}

static void trace_rng_bad(rf_trace *t, void *ctx)
{
    rf_tensor *k = rf_rng_key(t, ctx);
    CHECK(rf_rng_uniform(k, RF_I32, RF_SHAPE(2)) == NULL);
}

static void trace_rng_bad_key(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_array *notkey = rf_array_new(rf_device_cpu(), RF_F32, RF_SHAPE(2), NULL);
    CHECK(rf_rng_key(t, notkey) == NULL);
    rf_array_free(notkey);
}

static void test_rng(void)
{
    rf_array *key = rf_rng_key_new(42, rf_device_cpu());
    CHECK(key && rf_array_dtype(key) == RF_I64 && rf_array_numel(key) == 2);
    if (!key)
        return;
    char *text = trace_ok(trace_rng, key, "rng");
    /* the key's counter advances once per run, however often it is used */
    const char *upd = text ? strstr(text, "update capture0 <-") : NULL;
    CHECK(upd && !strstr(upd + 1, "update capture0 <-"));
    CHECK(text && strstr(text, "rng("));
    free(text);
    CHECK_STATUS(rf_trace_text(trace_rng_bad, key, NULL, 0, &text, NULL), RF_E_DTYPE);
    CHECK_MSG("rf_rng_uniform: dtype must be f32 or f64, got i32");
    CHECK_STATUS(rf_trace_text(trace_rng_bad_key, NULL, NULL, 0, &text, NULL), RF_E_INVALID);
    CHECK_MSG("rf_rng_key: key must be an i64[2] array");
    rf_array_free(key);
}

int main(void)
{
    test_broadcast();
    test_shapes();
    test_reductions();
    test_matmul();
    test_nn();
    test_nulls();
    test_grad();
    test_rng();
    return tu_finish("test_api");
}
