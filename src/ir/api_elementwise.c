/* api_elementwise.c: the public elementwise ops: constants, unary and binary
 * ops with NumPy broadcasting and weak scalars, compare/select/clamp/convert
 * and the scalar conveniences, plus the argument-check helpers of api.h.
 *
 * Broadcasting is done here, by inserting BROADCAST_IN_DIM, so the IR's
 * elementwise ops always see operands of one shape and dtype. A weak scalar
 * (rf_scalar) meeting a typed operand becomes a new CONSTANT of that dtype.
 * Deliberately not here: result-type rules of the primitives (rfi_infer) and
 * any computing (nothing is evaluated while tracing).
 */
#include <math.h>
#include <string.h>

#include "api.h"

/* ---- Helpers shared by the op layer (api.h) ------------------------------------------ */

bool rfi_api_axis(const char *fn, const rfi_node *x, int64_t axis, int rank, int *out)
{
    int64_t a = axis < 0 ? axis + rank : axis;
    if (a < 0 || a >= rank) {
        rfi_graph_fail(x->g, RF_E_INVALID, "%s: axis %lld out of range for %s", fn,
                       (long long)axis, RFI_TSTR(x));
        return false;
    }
    *out = (int)a;
    return true;
}

bool rfi_api_axes(const char *fn, const rfi_node *x, const int64_t *axes, int naxes, int64_t *out)
{
    if (naxes < 0 || naxes > x->rank || (naxes > 0 && !axes)) {
        rfi_graph_fail(x->g, RF_E_INVALID, "%s: invalid axis list (%d axes) for %s", fn, naxes,
                       RFI_TSTR(x));
        return false;
    }
    for (int i = 0; i < naxes; i++) {
        int a;
        if (!rfi_api_axis(fn, x, axes[i], x->rank, &a))
            return false;
        /* insertion sort: at most RF_MAX_RANK entries */
        int j = i;
        while (j > 0 && out[j - 1] > a) {
            out[j] = out[j - 1];
            j--;
        }
        if (j > 0 && out[j - 1] == a) {
            rfi_graph_fail(x->g, RF_E_INVALID, "%s: axis %lld repeated for %s", fn,
                           (long long)axes[i], RFI_TSTR(x));
            return false;
        }
        out[j] = a;
    }
    return true;
}

bool rfi_api_same_graph(const char *fn, const rfi_node *a, const rfi_node *b)
{
    if (a->g == b->g)
        return true;
    /* The inner trace fails, whichever operand it gave: it is the one being
     * built (failing the other would leave it to a confusing "tensor is NULL"). */
    rfi_graph_fail(rfi_graph_inner(a->g, b->g), RF_E_INVALID, "%s: operands %s and %s belong "
                   "to different traces (mixing traces)", fn, RFI_TSTR(a), RFI_TSTR(b));
    return false;
}

void rfi_api_store(rf_dtype dt, double v, void *dst)
{
    /* Integer conversions saturate (and NaN gives 0) so no value is undefined behaviour. */
    switch (dt) {
    case RF_F32: {
        float f = (float)v;
        memcpy(dst, &f, sizeof f);
        break;
    }
    case RF_F64:
        memcpy(dst, &v, sizeof v);
        break;
    case RF_I32: {
        int32_t i = isnan(v) ? 0 : v <= INT32_MIN ? INT32_MIN : v >= INT32_MAX ? INT32_MAX
                                                                                : (int32_t)v;
        memcpy(dst, &i, sizeof i);
        break;
    }
    case RF_I64: {
        int64_t i = isnan(v) ? 0 : v <= -9223372036854775808.0 ? INT64_MIN
                                   : v >= 9223372036854775807.0 ? INT64_MAX
                                                                : (int64_t)v;
        memcpy(dst, &i, sizeof i);
        break;
    }
    case RF_U8: {
        uint8_t u = isnan(v) ? 0 : v <= 0 ? 0 : v >= 255 ? 255 : (uint8_t)v;
        memcpy(dst, &u, sizeof u);
        break;
    }
    case RF_BOOL: {
        uint8_t b = v != 0;
        memcpy(dst, &b, sizeof b);
        break;
    }
    default:
        break;
    }
}

/* Checks a shape given to a constructor; records the error on g. */
static bool valid_shape(rfi_graph *g, const char *fn, rf_dtype dt, const int64_t *dims, int rank)
{
    if (!rfi_dtype_valid((int)dt)) {
        rfi_graph_fail(g, RF_E_DTYPE, "%s: invalid dtype %d", fn, (int)dt);
        return false;
    }
    if (rank < 0 || rank > RF_MAX_RANK || (rank > 0 && !dims)) {
        rfi_graph_fail(g, RF_E_INVALID, "%s: invalid rank %d (0..%d, dims given)", fn, rank,
                       RF_MAX_RANK);
        return false;
    }
    int64_t n = 1; /* of the nonzero dims: an empty shape's others must fit too */
    for (int i = 0; i < rank; i++) {
        if (dims[i] < 0 || (dims[i] > 0 && n > INT64_MAX / 16 / dims[i])) {
            rfi_graph_fail(g, RF_E_INVALID, "%s: invalid shape %s", fn, RFI_SSTR(dt, dims, rank));
            return false;
        }
        n *= dims[i] > 0 ? dims[i] : 1;
    }
    return true;
}

/* A CONSTANT node; rfi_node_new copies the nbytes of data into the graph. */
static rfi_node *constant_node(rfi_graph *g, rf_dtype dt, const int64_t *dims, int rank,
                               const void *data, size_t nbytes)
{
    rfi_attrs attr = {0};
    attr.data = data;
    attr.nbytes = nbytes;
    return rfi_node_new(g, RFI_OP_CONSTANT, NULL, 0, &attr, dt, dims, rank);
}


/* The exact value of a weak scalar (kept in attr.i[0]). */
static double weak_value(const rfi_node *x)
{
    double v;
    memcpy(&v, &x->attr.i[0], sizeof v);
    return v;
}

/* Whether v is a value of integer or bool dtype dt, exactly. */
static bool exact_in(double v, rf_dtype dt)
{
    double lo, hi; /* hi exclusive */
    switch (dt) {
    case RF_BOOL: return v == 0 || v == 1;
    case RF_U8: lo = 0, hi = 256; break;
    case RF_I32: lo = -2147483648.0, hi = 2147483648.0; break;
    default: lo = -9223372036854775808.0, hi = 9223372036854775808.0; break; /* i64 */
    }
    return v == trunc(v) && v >= lo && v < hi;
}

rfi_node *rfi_api_weak_as(const char *fn, rfi_node *x, rf_dtype dt)
{
    if (!x || !x->weak || x->dtype == dt)
        return x;
    double v = weak_value(x);
    if (!rfi_dtype_is_float(dt) && !exact_in(v, dt)) {
        /* it would be truncated or saturated: x * 0.5 of an integer x gave 0 */
        rfi_graph_fail(x->g, RF_E_DTYPE, "%s: the scalar %.17g is not a value of %s, the dtype "
                       "of the tensor it meets (convert that tensor with rf_convert, or give "
                       "the scalar's dtype with rf_scalar_typed)", fn, v, rf_dtype_name(dt));
        return NULL;
    }
    return rfi_node_scalar(x->g, dt, v);
}

/* ---- Constants ----------------------------------------------------------------------- */

rf_tensor *rf_scalar(rf_trace *t, double v)
{
    if (!t)
        return NULL;
    float f = (float)v;
    rfi_node *x = constant_node(t, RF_F32, NULL, 0, &f, sizeof f);
    if (!x)
        return NULL;
    x->weak = true;
    memcpy(&x->attr.i[0], &v, sizeof v);
    return x;
}

rf_tensor *rf_scalar_typed(rf_trace *t, rf_dtype dt, double v)
{
    if (!t || !valid_shape(t, "rf_scalar_typed", dt, NULL, 0))
        return NULL;
    return rfi_node_scalar(t, dt, v);
}

rf_tensor *rf_constant(rf_trace *t, rf_dtype dt, const int64_t *dims, int rank, const void *data)
{
    if (!t || !valid_shape(t, "rf_constant", dt, dims, rank))
        return NULL;
    size_t nbytes = (size_t)rfi_numel(dims, rank) * rf_dtype_size(dt);
    if (!data && nbytes) {
        rfi_graph_fail(t, RF_E_INVALID, "rf_constant: data is NULL for %s",
                       RFI_SSTR(dt, dims, rank));
        return NULL;
    }
    return constant_node(t, dt, dims, rank, data, nbytes);
}

rf_tensor *rf_full(rf_trace *t, rf_dtype dt, const int64_t *dims, int rank, double v)
{
    if (!t || !valid_shape(t, "rf_full", dt, dims, rank))
        return NULL;
    return rf_broadcast_to(rfi_node_scalar(t, dt, v), dims, rank);
}

rf_tensor *rf_zeros_like(rf_tensor *x)
{
    return x ? rf_full(x->g, x->dtype, x->dims, x->rank, 0.0) : NULL;
}

rf_tensor *rf_ones_like(rf_tensor *x)
{
    return x ? rf_full(x->g, x->dtype, x->dims, x->rank, 1.0) : NULL;
}

rf_tensor *rf_iota(rf_trace *t, rf_dtype dt, const int64_t *dims, int rank, int axis)
{
    if (!t || !valid_shape(t, "rf_iota", dt, dims, rank))
        return NULL;
    int64_t a = axis < 0 ? (int64_t)axis + rank : axis;
    if (a < 0 || a >= rank) {
        rfi_graph_fail(t, RF_E_INVALID, "rf_iota: axis %d out of range for %s", axis,
                       RFI_SSTR(dt, dims, rank));
        return NULL;
    }
    rfi_attrs attr = {0};
    attr.i[0] = a;
    return rfi_node_new(t, RFI_OP_IOTA, NULL, 0, &attr, dt, dims, rank);
}

/* ---- Unary ------------------------------------------------------------------------- */

/* Checks the operand dtype against the op's RFI_FLOAT / RFI_LOGIC flag. */
static bool dtype_fits_op(const char *fn, rfi_op op, const rfi_node *x)
{
    unsigned flags = rfi_op_table[op].flags;
    if ((flags & RFI_FLOAT) && !rfi_dtype_is_float(x->dtype)) {
        rfi_graph_fail(x->g, RF_E_DTYPE, "%s: needs a float tensor, got %s", fn, RFI_TSTR(x));
        return false;
    }
    if ((flags & RFI_LOGIC) && rfi_dtype_is_float(x->dtype)) {
        rfi_graph_fail(x->g, RF_E_DTYPE, "%s: needs a bool or integer tensor, got %s", fn,
                       RFI_TSTR(x));
        return false;
    }
    return true;
}

static rfi_node *unary(const char *fn, rfi_op op, rfi_node *x)
{
    if (!x || !dtype_fits_op(fn, op, x))
        return NULL;
    return rfi_node_new(x->g, op, &x, 1, NULL, x->dtype, NULL, 0);
}

rf_tensor *rf_neg(rf_tensor *x)
{
    /* -weak stays weak, so rf_neg(rf_scalar(t, 1)) still adopts the other dtype */
    if (x && x->weak)
        return rf_scalar(x->g, -weak_value(x));
    return unary("rf_neg", RFI_OP_NEG, x);
}
rf_tensor *rf_abs(rf_tensor *x) { return unary("rf_abs", RFI_OP_ABS, x); }
rf_tensor *rf_sign(rf_tensor *x) { return unary("rf_sign", RFI_OP_SIGN, x); }
rf_tensor *rf_exp(rf_tensor *x) { return unary("rf_exp", RFI_OP_EXP, x); }
rf_tensor *rf_expm1(rf_tensor *x) { return unary("rf_expm1", RFI_OP_EXPM1, x); }
rf_tensor *rf_log(rf_tensor *x) { return unary("rf_log", RFI_OP_LOG, x); }
rf_tensor *rf_log1p(rf_tensor *x) { return unary("rf_log1p", RFI_OP_LOG1P, x); }
rf_tensor *rf_sqrt(rf_tensor *x) { return unary("rf_sqrt", RFI_OP_SQRT, x); }
rf_tensor *rf_rsqrt(rf_tensor *x) { return unary("rf_rsqrt", RFI_OP_RSQRT, x); }
rf_tensor *rf_tanh(rf_tensor *x) { return unary("rf_tanh", RFI_OP_TANH, x); }
rf_tensor *rf_logistic(rf_tensor *x) { return unary("rf_logistic", RFI_OP_LOGISTIC, x); }
rf_tensor *rf_sin(rf_tensor *x) { return unary("rf_sin", RFI_OP_SIN, x); }
rf_tensor *rf_cos(rf_tensor *x) { return unary("rf_cos", RFI_OP_COS, x); }
rf_tensor *rf_floor(rf_tensor *x) { return unary("rf_floor", RFI_OP_FLOOR, x); }
rf_tensor *rf_ceil(rf_tensor *x) { return unary("rf_ceil", RFI_OP_CEIL, x); }
rf_tensor *rf_round(rf_tensor *x) { return unary("rf_round", RFI_OP_ROUND, x); }
rf_tensor *rf_is_finite(rf_tensor *x) { return unary("rf_is_finite", RFI_OP_IS_FINITE, x); }
rf_tensor *rf_not(rf_tensor *x) { return unary("rf_not", RFI_OP_NOT, x); }
rf_tensor *rf_stop_gradient(rf_tensor *x)
{
    return unary("rf_stop_gradient", RFI_OP_STOP_GRADIENT, x);
}

/* ---- Broadcasting -------------------------------------------------------------------- */

/* The NumPy broadcast shape of xs[0..n); false if they do not broadcast. */
static bool broadcast_shape(rfi_node *const *xs, int n, int64_t *dims, int *rank)
{
    int r = 0;
    for (int k = 0; k < n; k++)
        if (xs[k]->rank > r)
            r = xs[k]->rank;
    for (int i = 0; i < r; i++)
        dims[i] = 1;
    for (int k = 0; k < n; k++) {
        int off = r - xs[k]->rank;
        for (int i = 0; i < xs[k]->rank; i++) {
            int64_t d = xs[k]->dims[i], *out = &dims[off + i];
            if (d == *out || d == 1)
                continue;
            if (*out != 1)
                return false;
            *out = d;
        }
    }
    *rank = r;
    return true;
}

/* Resolves weak scalars among xs[0..n) (they adopt the first non-weak
 * dtype), checks dtypes agree and broadcasts all to one shape, in place.
 * Messages name all operand types. */
static bool unify(const char *fn, rfi_node **xs, int n)
{
    for (int k = 1; k < n; k++)
        if (!rfi_api_same_graph(fn, xs[0], xs[k]))
            return false;
    const rfi_node *strong = NULL;
    for (int k = 0; k < n && !strong; k++)
        if (!xs[k]->weak)
            strong = xs[k];
    rfi_node *orig[3];
    memcpy(orig, xs, (size_t)n * sizeof *xs);
    if (strong) {
        rf_dtype dt = strong->dtype;
        for (int k = 0; k < n; k++)
            if (!(xs[k] = rfi_api_weak_as(fn, xs[k], dt)))
                return false;
    }
    char types[3 * RFI_TYPE_STR_MAX + 16] = "";
    for (int k = 0; k < n; k++) {
        strcat(types, k == 0 ? "" : k == n - 1 ? " and " : ", ");
        strcat(types, RFI_TSTR(orig[k]));
    }
    for (int k = 1; k < n; k++) {
        if (xs[k]->dtype != xs[0]->dtype) {
            rfi_graph_fail(xs[0]->g, RF_E_DTYPE, "%s: dtypes of %s differ", fn, types);
            return false;
        }
    }
    int64_t dims[RF_MAX_RANK];
    int rank;
    if (!broadcast_shape(xs, n, dims, &rank)) {
        rfi_graph_fail(xs[0]->g, RF_E_SHAPE, "%s: shapes %s do not broadcast", fn, types);
        return false;
    }
    for (int k = 0; k < n; k++)
        if (!(xs[k] = rf_broadcast_to(xs[k], dims, rank)))
            return false;
    return true;
}

/* A binary elementwise op after weak-scalar resolution and broadcasting. */
static rfi_node *binary(const char *fn, rfi_op op, rfi_node *a, rfi_node *b, const rfi_attrs *attr)
{
    if (!a || !b)
        return NULL;
    rfi_node *xs[2] = {a, b};
    if (!unify(fn, xs, 2) || !dtype_fits_op(fn, op, xs[0]))
        return NULL;
    return rfi_node_new(xs[0]->g, op, xs, 2, attr, xs[0]->dtype, NULL, 0);
}

rf_tensor *rf_add(rf_tensor *a, rf_tensor *b) { return binary("rf_add", RFI_OP_ADD, a, b, NULL); }
rf_tensor *rf_sub(rf_tensor *a, rf_tensor *b) { return binary("rf_sub", RFI_OP_SUB, a, b, NULL); }
rf_tensor *rf_mul(rf_tensor *a, rf_tensor *b) { return binary("rf_mul", RFI_OP_MUL, a, b, NULL); }
rf_tensor *rf_div(rf_tensor *a, rf_tensor *b) { return binary("rf_div", RFI_OP_DIV, a, b, NULL); }
rf_tensor *rf_pow(rf_tensor *a, rf_tensor *b) { return binary("rf_pow", RFI_OP_POW, a, b, NULL); }
rf_tensor *rf_max(rf_tensor *a, rf_tensor *b) { return binary("rf_max", RFI_OP_MAX, a, b, NULL); }
rf_tensor *rf_min(rf_tensor *a, rf_tensor *b) { return binary("rf_min", RFI_OP_MIN, a, b, NULL); }
rf_tensor *rf_rem(rf_tensor *a, rf_tensor *b) { return binary("rf_rem", RFI_OP_REM, a, b, NULL); }
rf_tensor *rf_and(rf_tensor *a, rf_tensor *b) { return binary("rf_and", RFI_OP_AND, a, b, NULL); }
rf_tensor *rf_or(rf_tensor *a, rf_tensor *b) { return binary("rf_or", RFI_OP_OR, a, b, NULL); }

rf_tensor *rf_add_s(rf_tensor *a, double s) { return a ? rf_add(a, rf_scalar(a->g, s)) : NULL; }
rf_tensor *rf_sub_s(rf_tensor *a, double s) { return a ? rf_sub(a, rf_scalar(a->g, s)) : NULL; }
rf_tensor *rf_mul_s(rf_tensor *a, double s) { return a ? rf_mul(a, rf_scalar(a->g, s)) : NULL; }
rf_tensor *rf_div_s(rf_tensor *a, double s) { return a ? rf_div(a, rf_scalar(a->g, s)) : NULL; }
rf_tensor *rf_pow_s(rf_tensor *a, double s) { return a ? rf_pow(a, rf_scalar(a->g, s)) : NULL; }

rf_tensor *rf_compare(rf_tensor *a, rf_tensor *b, rf_cmp dir)
{
    if (!a || !b)
        return NULL;
    if ((unsigned)dir >= RF_CMP_COUNT) {
        rfi_graph_fail(a->g, RF_E_INVALID, "rf_compare: invalid direction %d", (int)dir);
        return NULL;
    }
    rfi_attrs attr = {0};
    attr.i[0] = dir;
    return binary("rf_compare", RFI_OP_COMPARE, a, b, &attr);
}

rf_tensor *rf_select(rf_tensor *pred, rf_tensor *a, rf_tensor *b)
{
    if (!pred || !a || !b)
        return NULL;
    if (!rfi_api_same_graph("rf_select", pred, a))
        return NULL;
    if (pred->dtype != RF_BOOL) {
        rfi_graph_fail(pred->g, RF_E_DTYPE, "rf_select: pred must be bool, got %s",
                       RFI_TSTR(pred));
        return NULL;
    }
    rfi_node *ab[2] = {a, b};
    if (!unify("rf_select", ab, 2))
        return NULL;
    /* pred joins the broadcast after a/b agree on a dtype */
    int64_t dims[RF_MAX_RANK];
    int rank;
    rfi_node *all[3] = {pred, ab[0], ab[1]};
    if (!broadcast_shape(all, 3, dims, &rank)) {
        rfi_graph_fail(pred->g, RF_E_SHAPE, "rf_select: shapes %s, %s and %s do not broadcast",
                       RFI_TSTR(pred), RFI_TSTR(a), RFI_TSTR(b));
        return NULL;
    }
    for (int k = 0; k < 3; k++)
        if (!(all[k] = rf_broadcast_to(all[k], dims, rank)))
            return NULL;
    return rfi_node_new(pred->g, RFI_OP_SELECT, all, 3, NULL, all[1]->dtype, NULL, 0);
}

rf_tensor *rf_clamp(rf_tensor *x, rf_tensor *lo, rf_tensor *hi)
{
    if (!x || !lo || !hi)
        return NULL;
    rfi_node *xs[3] = {x, lo, hi}; /* x first: it sets the dtype weak bounds adopt */
    if (!unify("rf_clamp", xs, 3))
        return NULL;
    rfi_node *ordered[3] = {xs[1], xs[0], xs[2]}; /* StableHLO order: lo, x, hi */
    return rfi_node_new(x->g, RFI_OP_CLAMP, ordered, 3, NULL, xs[0]->dtype, NULL, 0);
}

rf_tensor *rf_clamp_s(rf_tensor *x, double lo, double hi)
{
    if (!x)
        return NULL;
    rf_tensor *hi_node = rf_scalar(x->g, hi);
    return rf_clamp(x, rf_scalar(x->g, lo), hi_node);
}

rf_tensor *rf_convert(rf_tensor *x, rf_dtype dt)
{
    if (!x)
        return NULL;
    if (!rfi_dtype_valid((int)dt)) {
        rfi_graph_fail(x->g, RF_E_DTYPE, "rf_convert: invalid dtype %d for %s", (int)dt,
                       RFI_TSTR(x));
        return NULL;
    }
    if (x->weak) /* a typed constant: the value is known exactly */
        return rfi_node_scalar(x->g, dt, weak_value(x));
    if (x->dtype == dt)
        return x;
    return rfi_node_new(x->g, RFI_OP_CONVERT, &x, 1, NULL, dt, NULL, 0);
}
