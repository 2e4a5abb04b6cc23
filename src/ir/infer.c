/* infer.c: rfi_infer, the one definition of every op's result type and of
 * the validity of its operands and attributes (StableHLO rules, narrowed to
 * the operand/attribute conventions at the top of ir.h).
 *
 * Pure: it reads operand types and attributes and writes a result type and,
 * on failure, a message "<op>: ..." naming the offending shapes. It does not
 * touch graphs (graph.c records errors) nor know what ops compute.
 *
 * For the ops whose result is not implied by their operands (CONSTANT, IOTA,
 * ARGUMENT, CAPTURE, CONVERT, RESHAPE, BROADCAST_IN_DIM, RNG) the caller
 * passes the requested type in (dtype, dims, rank) and rfi_infer validates it.
 */
#include "ir.h"

#include <stdio.h>
#include <string.h>

/* The state of one inference: operands, attributes, the result being built. */
typedef struct ictx {
    const char *name;
    rfi_node *const *in;
    int n_in;
    const rfi_attrs *a;
    rf_dtype dt; /* result (on entry: the requested one) */
    int rank;
    int64_t dims[RF_MAX_RANK];
    char *msg;
    size_t msgn;
} ictx;

/* Printable forms for messages. The compound literals live to the end of the
 * enclosing block, which covers the message call they appear in. */
#define TYPE_STR_MAX 200
#define TY(x) rfi_type_str((char[TYPE_STR_MAX]){0}, TYPE_STR_MAX, (x)->dtype, (x)->dims, (x)->rank)
#define TYD(dt, dims, rank) rfi_type_str((char[TYPE_STR_MAX]){0}, TYPE_STR_MAX, dt, dims, rank)
#define LIST(v, n) list_str((char[TYPE_STR_MAX]){0}, TYPE_STR_MAX, v, n)

static const char *list_str(char *buf, size_t n, const int64_t *v, int count)
{
    size_t len = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < count && len < n; i++)
        len += (size_t)snprintf(buf + len, n - len, i ? ",%lld" : "%lld", (long long)v[i]);
    if (len < n)
        snprintf(buf + len, n - len, "]");
    return buf;
}

static rf_status fail(ictx *c, rf_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static rf_status fail(ictx *c, rf_status st, const char *fmt, ...)
{
    int len = snprintf(c->msg, c->msgn, "%s: ", c->name);
    if (len >= 0 && (size_t)len < c->msgn) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->msg + len, c->msgn - (size_t)len, fmt, ap);
        va_end(ap);
    }
    return st;
}

/* ---- Small helpers --------------------------------------------------------------- */

static void set_result(ictx *c, rf_dtype dt, const int64_t *dims, int rank)
{
    c->dt = dt;
    c->rank = rank;
    for (int i = 0; i < rank; i++)
        c->dims[i] = dims[i];
}

static void set_like(ictx *c, const rfi_node *x) { set_result(c, x->dtype, x->dims, x->rank); }

/* Checks that list k of the attributes has exactly n entries. */
static rf_status need_list(ictx *c, int k, int n, const char *what)
{
    if (c->a->nl[k] != n)
        return fail(c, RF_E_INVALID, "%s has %d entries, expected %d", what, c->a->nl[k], n);
    return RF_OK;
}

/* Checks that list k holds n distinct axes of a rank-`rank` operand. */
static rf_status need_axes(ictx *c, const int64_t *axes, int n, int rank, const char *what)
{
    bool seen[RF_MAX_RANK] = {false};
    for (int i = 0; i < n; i++) {
        if (axes[i] < 0 || axes[i] >= rank)
            return fail(c, RF_E_INVALID, "%s %s: axis %lld out of range for rank %d", what,
                        LIST(axes, n), (long long)axes[i], rank);
        if (seen[axes[i]])
            return fail(c, RF_E_INVALID, "%s %s: axis %lld repeated", what, LIST(axes, n),
                        (long long)axes[i]);
        seen[axes[i]] = true;
    }
    return RF_OK;
}

static rf_status need_same_dtype(ictx *c, const rfi_node *x, const rfi_node *y)
{
    if (x->dtype != y->dtype)
        return fail(c, RF_E_DTYPE, "dtypes differ: %s and %s", TY(x), TY(y));
    return RF_OK;
}

static rf_status need_not_bool(ictx *c, const rfi_node *x)
{
    if (x->dtype == RF_BOOL)
        return fail(c, RF_E_DTYPE, "operand %s must be numeric, not bool", TY(x));
    return RF_OK;
}

/* Validates the requested result type of leaves and shape ops. */
static rf_status need_valid_request(ictx *c)
{
    if (!rfi_dtype_valid((int)c->dt))
        return fail(c, RF_E_DTYPE, "invalid dtype %d", (int)c->dt);
    if (c->rank < 0 || c->rank > RF_MAX_RANK)
        return fail(c, RF_E_SHAPE, "rank %d out of range [0, %d]", c->rank, RF_MAX_RANK);
    for (int i = 0; i < c->rank; i++)
        if (c->dims[i] < 0)
            return fail(c, RF_E_SHAPE, "negative dim in %s", TYD(c->dt, c->dims, c->rank));
    return RF_OK;
}

/* The result of every op must have a byte size that fits in size_t and
 * int64_t, counting the nonzero dims only: an empty result's other dims must
 * fit too (code computes row sizes and strides from them), as for arrays
 * (array.c). */
static rf_status need_sane_size(ictx *c)
{
    uint64_t limit = (uint64_t)INT64_MAX / 8;
    uint64_t n = 1;
    for (int i = 0; i < c->rank; i++) {
        if (c->dims[i] < 0)
            return fail(c, RF_E_SHAPE, "negative dim in result %s",
                        TYD(c->dt, c->dims, c->rank));
        if (c->dims[i] == 0)
            continue;
        if (n > limit / (uint64_t)c->dims[i])
            return fail(c, RF_E_SHAPE, "result %s has too many elements",
                        TYD(c->dt, c->dims, c->rank));
        n *= (uint64_t)c->dims[i];
    }
    return RF_OK;
}

/* ---- Leaves ------------------------------------------------------------------------- */

static rf_status infer_constant(ictx *c)
{
    rf_status st = need_valid_request(c);
    if (st != RF_OK || (st = need_sane_size(c)) != RF_OK)
        return st;
    size_t want = (size_t)rfi_numel(c->dims, c->rank) * rf_dtype_size(c->dt);
    if (c->a->nbytes != want)
        return fail(c, RF_E_INVALID, "payload of %zu bytes for %s (%zu bytes expected)",
                    c->a->nbytes, TYD(c->dt, c->dims, c->rank), want);
    if (want && !c->a->data)
        return fail(c, RF_E_INVALID, "NULL payload for %s", TYD(c->dt, c->dims, c->rank));
    return RF_OK;
}

static rf_status infer_iota(ictx *c)
{
    rf_status st = need_valid_request(c);
    if (st != RF_OK)
        return st;
    if (c->dt == RF_BOOL)
        return fail(c, RF_E_DTYPE, "result %s must be numeric", TYD(c->dt, c->dims, c->rank));
    if (c->a->i[0] < 0 || c->a->i[0] >= c->rank)
        return fail(c, RF_E_INVALID, "axis %lld out of range for %s", (long long)c->a->i[0],
                    TYD(c->dt, c->dims, c->rank));
    return RF_OK;
}

static rf_status infer_slot(ictx *c)
{
    rf_status st = need_valid_request(c);
    if (st != RF_OK)
        return st;
    if (c->a->i[0] < 0)
        return fail(c, RF_E_INVALID, "negative index %lld", (long long)c->a->i[0]);
    return RF_OK;
}

static rf_status infer_rng(ictx *c)
{
    const rfi_node *key = c->in[0];
    if (key->dtype != RF_I64 || key->rank != 1 || key->dims[0] != 2)
        return fail(c, RF_E_SHAPE, "key %s must be i64[2]", TY(key));
    rf_status st = need_valid_request(c);
    if (st != RF_OK)
        return st;
    if (!rfi_dtype_is_float(c->dt))
        return fail(c, RF_E_DTYPE, "result %s must be a float type",
                    TYD(c->dt, c->dims, c->rank));
    if (c->a->i[0] != 0 && c->a->i[0] != 1)
        return fail(c, RF_E_INVALID, "distribution %lld is neither 0 (uniform) nor 1 (normal)",
                    (long long)c->a->i[0]);
    if (c->a->i[1] < 0 || c->a->i[1] > 0xffff)
        return fail(c, RF_E_INVALID, "stream %lld out of range [0, 65535]",
                    (long long)c->a->i[1]);
    return RF_OK;
}

/* ---- Elementwise ------------------------------------------------------------------- */

/* Dtype rules shared by unary and binary elementwise ops. */
static rf_status need_elementwise_dtype(ictx *c, rfi_op op, const rfi_node *x)
{
    unsigned fl = rfi_op_table[op].flags;
    if ((fl & RFI_FLOAT) && !rfi_dtype_is_float(x->dtype))
        return fail(c, RF_E_DTYPE, "operand %s must be a float type", TY(x));
    if ((fl & RFI_LOGIC) && rfi_dtype_is_float(x->dtype))
        return fail(c, RF_E_DTYPE, "operand %s must be bool or integer", TY(x));
    switch (op) {
    case RFI_OP_NEG: case RFI_OP_ABS: case RFI_OP_SIGN:
    case RFI_OP_ADD: case RFI_OP_SUB: case RFI_OP_MUL: case RFI_OP_DIV: case RFI_OP_REM:
        return need_not_bool(c, x);
    default:
        return RF_OK;
    }
}

static rf_status infer_unary(ictx *c, rfi_op op)
{
    const rfi_node *x = c->in[0];
    rf_status st = need_elementwise_dtype(c, op, x);
    if (st != RF_OK)
        return st;
    set_like(c, x);
    if (op == RFI_OP_IS_FINITE)
        c->dt = RF_BOOL;
    return RF_OK;
}

static rf_status need_same_type(ictx *c, const rfi_node *x, const rfi_node *y)
{
    if (x->dtype != y->dtype)
        return fail(c, RF_E_DTYPE, "dtypes differ: %s and %s", TY(x), TY(y));
    if (!rfi_node_same_dims(x, y))
        return fail(c, RF_E_SHAPE, "shapes %s and %s differ", TY(x), TY(y));
    return RF_OK;
}

static rf_status infer_binary(ictx *c, rfi_op op)
{
    const rfi_node *x = c->in[0], *y = c->in[1];
    rf_status st = need_same_type(c, x, y);
    if (st != RF_OK || (st = need_elementwise_dtype(c, op, x)) != RF_OK)
        return st;
    set_like(c, x);
    return RF_OK;
}

static rf_status infer_compare(ictx *c)
{
    const rfi_node *x = c->in[0], *y = c->in[1];
    rf_status st = need_same_type(c, x, y);
    if (st != RF_OK)
        return st;
    if (c->a->i[0] < 0 || c->a->i[0] >= RF_CMP_COUNT)
        return fail(c, RF_E_INVALID, "invalid direction %lld", (long long)c->a->i[0]);
    set_like(c, x);
    c->dt = RF_BOOL;
    return RF_OK;
}

static rf_status infer_select(ictx *c)
{
    const rfi_node *p = c->in[0], *x = c->in[1], *y = c->in[2];
    if (p->dtype != RF_BOOL)
        return fail(c, RF_E_DTYPE, "predicate %s must be bool", TY(p));
    rf_status st = need_same_type(c, x, y);
    if (st != RF_OK)
        return st;
    if (p->rank != 0 && !rfi_node_same_dims(p, x))
        return fail(c, RF_E_SHAPE, "predicate %s does not match operands %s", TY(p), TY(x));
    set_like(c, x);
    return RF_OK;
}

static rf_status infer_clamp(ictx *c)
{
    const rfi_node *lo = c->in[0], *x = c->in[1], *hi = c->in[2];
    if (lo->dtype != x->dtype || hi->dtype != x->dtype)
        return fail(c, RF_E_DTYPE, "dtypes differ: lo %s, x %s, hi %s", TY(lo), TY(x), TY(hi));
    if ((lo->rank != 0 && !rfi_node_same_dims(lo, x)) ||
        (hi->rank != 0 && !rfi_node_same_dims(hi, x)))
        return fail(c, RF_E_SHAPE, "bounds lo %s and hi %s must be scalars or match x %s",
                    TY(lo), TY(hi), TY(x));
    set_like(c, x);
    return RF_OK;
}

/* ---- Shape ops ------------------------------------------------------------------- */

static rf_status infer_convert(ictx *c)
{
    if (!rfi_dtype_valid((int)c->dt))
        return fail(c, RF_E_DTYPE, "invalid result dtype %d", (int)c->dt);
    set_result(c, c->dt, c->in[0]->dims, c->in[0]->rank);
    return RF_OK;
}

static rf_status infer_broadcast(ictx *c)
{
    const rfi_node *x = c->in[0];
    rf_status st = need_valid_request(c);
    if (st != RF_OK || (st = need_list(c, 0, x->rank, "map")) != RF_OK)
        return st;
    const int64_t *map = c->a->l[0];
    if ((st = need_axes(c, map, x->rank, c->rank, "map")) != RF_OK)
        return st;
    for (int i = 0; i < x->rank; i++) {
        int64_t want = c->dims[map[i]];
        if (x->dims[i] != 1 && x->dims[i] != want)
            return fail(c, RF_E_SHAPE, "cannot broadcast %s to %s with map %s: dim %d is %lld",
                        TY(x), TYD(x->dtype, c->dims, c->rank), LIST(map, x->rank), i,
                        (long long)x->dims[i]);
    }
    c->dt = x->dtype;
    return RF_OK;
}

static rf_status infer_reshape(ictx *c)
{
    const rfi_node *x = c->in[0];
    c->dt = x->dtype;
    rf_status st = need_valid_request(c);
    if (st != RF_OK || (st = need_sane_size(c)) != RF_OK)
        return st;
    if (rfi_numel(c->dims, c->rank) != rfi_numel(x->dims, x->rank))
        return fail(c, RF_E_SHAPE, "cannot reshape %s (%lld elements) to %s", TY(x),
                    (long long)rfi_numel(x->dims, x->rank), TYD(c->dt, c->dims, c->rank));
    return RF_OK;
}

static rf_status infer_transpose(ictx *c)
{
    const rfi_node *x = c->in[0];
    rf_status st = need_list(c, 0, x->rank, "perm");
    if (st != RF_OK)
        return st;
    const int64_t *perm = c->a->l[0];
    if (need_axes(c, perm, x->rank, x->rank, "perm") != RF_OK)
        return fail(c, RF_E_INVALID, "perm %s is not a permutation of the axes of %s",
                    LIST(perm, x->rank), TY(x));
    c->dt = x->dtype;
    c->rank = x->rank;
    for (int i = 0; i < x->rank; i++)
        c->dims[i] = x->dims[perm[i]];
    return RF_OK;
}

static rf_status infer_slice(ictx *c)
{
    const rfi_node *x = c->in[0];
    rf_status st;
    if ((st = need_list(c, 0, x->rank, "start")) != RF_OK ||
        (st = need_list(c, 1, x->rank, "limit")) != RF_OK ||
        (st = need_list(c, 2, x->rank, "stride")) != RF_OK)
        return st;
    const int64_t *start = c->a->l[0], *limit = c->a->l[1], *stride = c->a->l[2];
    for (int i = 0; i < x->rank; i++) {
        if (start[i] < 0 || start[i] > limit[i] || limit[i] > x->dims[i] || stride[i] < 1)
            return fail(c, RF_E_INVALID,
                        "start %s, limit %s, stride %s out of bounds for %s at axis %d",
                        LIST(start, x->rank), LIST(limit, x->rank), LIST(stride, x->rank),
                        TY(x), i);
        int64_t span = limit[i] - start[i]; /* 0 <= span <= dim: no overflow */
        c->dims[i] = span == 0 ? 0 : (span - 1) / stride[i] + 1;
    }
    c->dt = x->dtype;
    c->rank = x->rank;
    return RF_OK;
}

static rf_status infer_concatenate(ictx *c)
{
    const rfi_node *x = c->in[0];
    int64_t axis = c->a->i[0];
    if (axis < 0 || axis >= x->rank)
        return fail(c, RF_E_INVALID, "axis %lld out of range for %s", (long long)axis, TY(x));
    set_like(c, x);
    for (int k = 1; k < c->n_in; k++) {
        const rfi_node *y = c->in[k];
        rf_status st = need_same_dtype(c, x, y);
        if (st != RF_OK)
            return st;
        bool fits = y->rank == x->rank;
        for (int i = 0; fits && i < x->rank; i++)
            fits = i == axis || y->dims[i] == x->dims[i];
        if (!fits)
            return fail(c, RF_E_SHAPE, "operand %d %s does not match operand 0 %s off axis %lld",
                        k, TY(y), TY(x), (long long)axis);
        if (!rfi_add_ok(c->dims[axis], y->dims[axis], &c->dims[axis]))
            return fail(c, RF_E_SHAPE, "result is too large along axis %lld", (long long)axis);
    }
    return RF_OK;
}

static rf_status infer_pad(ictx *c)
{
    const rfi_node *x = c->in[0], *v = c->in[1];
    rf_status st;
    if (v->rank != 0)
        return fail(c, RF_E_SHAPE, "padding value %s must be a scalar", TY(v));
    if ((st = need_same_dtype(c, x, v)) != RF_OK || (st = need_list(c, 0, x->rank, "low")) ||
        (st = need_list(c, 1, x->rank, "high")) || (st = need_list(c, 2, x->rank, "interior")))
        return st;
    const int64_t *lo = c->a->l[0], *hi = c->a->l[1], *in = c->a->l[2];
    set_like(c, x);
    for (int i = 0; i < x->rank; i++) {
        if (in[i] < 0)
            return fail(c, RF_E_INVALID, "negative interior %s for %s", LIST(in, x->rank),
                        TY(x));
        int64_t d = x->dims[i];
        int64_t n, gaps;
        if (!rfi_mul_ok(d > 0 ? d - 1 : 0, in[i], &gaps) || !rfi_add_ok(d, gaps, &n) ||
            !rfi_pad_ok(n, lo[i], hi[i], &n))
            return fail(c, RF_E_SHAPE, "low %s, high %s, interior %s overflow for %s",
                        LIST(lo, x->rank), LIST(hi, x->rank), LIST(in, x->rank), TY(x));
        if (n < 0)
            return fail(c, RF_E_SHAPE, "low %s, high %s crop %s below zero at axis %d",
                        LIST(lo, x->rank), LIST(hi, x->rank), TY(x), i);
        c->dims[i] = n;
    }
    return RF_OK;
}

static rf_status infer_reverse(ictx *c)
{
    const rfi_node *x = c->in[0];
    int n = c->a->nl[0];
    if (n < 0 || n > x->rank)
        return fail(c, RF_E_INVALID, "%d axes for %s", n, TY(x));
    rf_status st = need_axes(c, c->a->l[0], n, x->rank, "axes");
    if (st != RF_OK)
        return st;
    set_like(c, x);
    return RF_OK;
}

/* ---- Reductions ------------------------------------------------------------------ */

static rf_status need_reduce_kind(ictx *c, const rfi_node *x, int64_t kind)
{
    if (kind < 0 || kind >= RF_REDUCE_KIND_COUNT)
        return fail(c, RF_E_INVALID, "invalid reduction kind %lld", (long long)kind);
    if ((kind == RF_REDUCE_AND || kind == RF_REDUCE_OR) && rfi_dtype_is_float(x->dtype))
        return fail(c, RF_E_DTYPE, "and/or reduction of %s needs bool or integer", TY(x));
    if ((kind == RF_REDUCE_SUM || kind == RF_REDUCE_PROD) && x->dtype == RF_BOOL)
        return fail(c, RF_E_DTYPE, "sum/prod reduction of %s needs a numeric type", TY(x));
    return RF_OK;
}

static rf_status infer_reduce(ictx *c)
{
    const rfi_node *x = c->in[0];
    rf_status st = need_reduce_kind(c, x, c->a->i[0]);
    if (st != RF_OK)
        return st;
    int n = c->a->nl[0];
    if (n < 0 || n > x->rank)
        return fail(c, RF_E_INVALID, "%d axes for %s", n, TY(x));
    const int64_t *axes = c->a->l[0];
    if ((st = need_axes(c, axes, n, x->rank, "axes")) != RF_OK)
        return st;
    for (int i = 1; i < n; i++)
        if (axes[i] <= axes[i - 1])
            return fail(c, RF_E_INVALID, "axes %s must be sorted", LIST(axes, n));
    c->dt = x->dtype;
    c->rank = 0;
    for (int i = 0, k = 0; i < x->rank; i++) {
        if (k < n && axes[k] == i)
            k++;
        else
            c->dims[c->rank++] = x->dims[i];
    }
    return RF_OK;
}

static rf_status infer_arg_extreme(ictx *c)
{
    const rfi_node *x = c->in[0];
    int64_t axis = c->a->i[0];
    if (axis < 0 || axis >= x->rank)
        return fail(c, RF_E_INVALID, "axis %lld out of range for %s", (long long)axis, TY(x));
    if (x->dims[axis] == 0)
        return fail(c, RF_E_SHAPE, "axis %lld of %s is empty", (long long)axis, TY(x));
    c->dt = RF_I64;
    c->rank = 0;
    for (int i = 0; i < x->rank; i++)
        if (i != axis)
            c->dims[c->rank++] = x->dims[i];
    return RF_OK;
}

/* ---- Linear algebra ------------------------------------------------------------- */

/* A product's rf_precision (attribute value p) for operands of dtype dt. */
static rf_status need_precision(ictx *c, int64_t p, rf_dtype dt)
{
    if (p == RF_PRECISION_F32 || (p == RF_PRECISION_BF16 && dt == RF_F32))
        return RF_OK;
    return fail(c, RF_E_INVALID, "precision %lld is not %s for %s operands", (long long)p,
                dt == RF_F32 ? "f32 (0) or bf16 (1)" : "f32 (0)", rf_dtype_name(dt));
}

static rf_status infer_dot_general(ictx *c)
{
    const rfi_node *x = c->in[0], *y = c->in[1];
    rf_status st = need_same_dtype(c, x, y);
    if (st != RF_OK || (st = need_not_bool(c, x)) != RF_OK ||
        (st = need_precision(c, c->a->i[0], x->dtype)) != RF_OK)
        return st;
    int nb = c->a->nl[0], nc = c->a->nl[2];
    if (nb != c->a->nl[1] || nc != c->a->nl[3] || nb < 0 || nc < 0)
        return fail(c, RF_E_INVALID, "batch dims (%d, %d) or contracting dims (%d, %d) differ "
                    "in number", c->a->nl[0], c->a->nl[1], c->a->nl[2], c->a->nl[3]);
    if (nb + nc > x->rank || nb + nc > y->rank)
        return fail(c, RF_E_INVALID, "%d batch + %d contracting dims for %s and %s", nb, nc,
                    TY(x), TY(y));
    /* Batch and contracting dims together must be distinct axes of each side. */
    int64_t lhs[RF_MAX_RANK], rhs[RF_MAX_RANK];
    for (int i = 0; i < nb; i++) {
        lhs[i] = c->a->l[0][i];
        rhs[i] = c->a->l[1][i];
    }
    for (int i = 0; i < nc; i++) {
        lhs[nb + i] = c->a->l[2][i];
        rhs[nb + i] = c->a->l[3][i];
    }
    if ((st = need_axes(c, lhs, nb + nc, x->rank, "lhs batch+contracting dims")) != RF_OK ||
        (st = need_axes(c, rhs, nb + nc, y->rank, "rhs batch+contracting dims")) != RF_OK)
        return st;
    for (int i = 0; i < nb + nc; i++)
        if (x->dims[lhs[i]] != y->dims[rhs[i]])
            return fail(c, RF_E_SHAPE,
                        "%s dim %lld of %s (%lld) differs from dim %lld of %s (%lld)",
                        i < nb ? "batch" : "contracting", (long long)lhs[i], TY(x),
                        (long long)x->dims[lhs[i]], (long long)rhs[i], TY(y),
                        (long long)y->dims[rhs[i]]);
    int rank = nb + (x->rank - nb - nc) + (y->rank - nb - nc);
    if (rank > RF_MAX_RANK)
        return fail(c, RF_E_SHAPE, "result of %s and %s has rank %d > %d", TY(x), TY(y), rank,
                    RF_MAX_RANK);
    c->dt = x->dtype;
    c->rank = 0;
    for (int i = 0; i < nb; i++)
        c->dims[c->rank++] = x->dims[lhs[i]];
    for (int side = 0; side < 2; side++) {
        const rfi_node *s = side ? y : x;
        const int64_t *used = side ? rhs : lhs;
        for (int d = 0; d < s->rank; d++) {
            bool free_dim = true;
            for (int k = 0; k < nb + nc; k++)
                free_dim = free_dim && used[k] != d;
            if (free_dim)
                c->dims[c->rank++] = s->dims[d];
        }
    }
    return RF_OK;
}

/* Rules shared by convolution: attribute lists, groups, then the output size. */
static rf_status infer_convolution(ictx *c)
{
    const rfi_node *x = c->in[0], *w = c->in[1];
    rf_status st = need_same_dtype(c, x, w);
    if (st != RF_OK || (st = need_not_bool(c, x)) != RF_OK ||
        (st = need_precision(c, c->a->i[2], x->dtype)) != RF_OK)
        return st;
    if (x->rank < 3)
        return fail(c, RF_E_SHAPE, "input %s must be [N, C, spatial...]", TY(x));
    if (w->rank != x->rank)
        return fail(c, RF_E_SHAPE, "kernel %s and input %s differ in rank", TY(w), TY(x));
    int ns = x->rank - 2;
    static const char *const names[5] = {"stride", "pad_lo", "pad_hi", "lhs_dilation",
                                         "rhs_dilation"};
    for (int k = 0; k < 5; k++)
        if ((st = need_list(c, k, ns, names[k])) != RF_OK)
            return st;
    const int64_t *stride = c->a->l[0], *lo = c->a->l[1], *hi = c->a->l[2];
    const int64_t *ldil = c->a->l[3], *rdil = c->a->l[4];
    for (int i = 0; i < ns; i++) {
        if (stride[i] < 1 || ldil[i] < 1 || rdil[i] < 1)
            return fail(c, RF_E_INVALID,
                        "stride %s, lhs_dilation %s, rhs_dilation %s must be >= 1",
                        LIST(stride, ns), LIST(ldil, ns), LIST(rdil, ns));
    }
    int64_t fg = c->a->i[0], bg = c->a->i[1];
    if (fg < 1 || bg < 1)
        return fail(c, RF_E_INVALID, "feature_group_count %lld and batch_group_count %lld must "
                    "be >= 1", (long long)fg, (long long)bg);
    if (fg > 1 && bg > 1)
        return fail(c, RF_E_INVALID, "feature_group_count %lld and batch_group_count %lld "
                    "cannot both exceed 1", (long long)fg, (long long)bg);
    int64_t n = x->dims[0], ch = x->dims[1], o = w->dims[0], wi = w->dims[1];
    if (ch % fg != 0 || o % fg != 0)
        return fail(c, RF_E_SHAPE, "input %s channels and kernel %s outputs must divide by "
                    "feature_group_count %lld", TY(x), TY(w), (long long)fg);
    if (wi * fg != ch)
        return fail(c, RF_E_SHAPE, "kernel %s has %lld input channels, expected %lld for input "
                    "%s with feature_group_count %lld", TY(w), (long long)wi,
                    (long long)(ch / fg), TY(x), (long long)fg);
    if (n % bg != 0 || o % bg != 0)
        return fail(c, RF_E_SHAPE, "input %s batch and kernel %s outputs must divide by "
                    "batch_group_count %lld", TY(x), TY(w), (long long)bg);
    c->dt = x->dtype;
    c->rank = x->rank;
    c->dims[0] = n / bg;
    c->dims[1] = o;
    for (int i = 0; i < ns; i++) {
        int64_t in = x->dims[2 + i], k = w->dims[2 + i];
        if (k < 1)
            return fail(c, RF_E_SHAPE, "kernel %s has an empty spatial dim", TY(w));
        int64_t in_dil, k_dil, padded;
        if (!rfi_dilate_ok(in, ldil[i], &in_dil) || !rfi_dilate_ok(k, rdil[i], &k_dil) ||
            !rfi_pad_ok(in_dil, lo[i], hi[i], &padded))
            return fail(c, RF_E_SHAPE, "padding or dilation overflows for input %s, kernel %s",
                        TY(x), TY(w));
        if (padded < k_dil)
            return fail(c, RF_E_SHAPE, "empty output: input %s (padded %lld at spatial dim %d) "
                        "is smaller than kernel %s (dilated %lld)", TY(x), (long long)padded, i,
                        TY(w), (long long)k_dil);
        c->dims[2 + i] = (padded - k_dil) / stride[i] + 1;
    }
    return RF_OK;
}

/* ---- Windows ----------------------------------------------------------------------- */

/* The reduce_window result dims of x under the attribute lists l[0..3]. */
static rf_status window_dims(ictx *c, const rfi_node *x, int64_t *out)
{
    static const char *const names[4] = {"window", "strides", "pad_lo", "pad_hi"};
    rf_status st;
    for (int k = 0; k < 4; k++)
        if ((st = need_list(c, k, x->rank, names[k])) != RF_OK)
            return st;
    const int64_t *win = c->a->l[0], *stride = c->a->l[1], *lo = c->a->l[2], *hi = c->a->l[3];
    for (int i = 0; i < x->rank; i++) {
        if (win[i] < 1 || stride[i] < 1 || lo[i] < 0 || hi[i] < 0)
            return fail(c, RF_E_INVALID, "window %s and strides %s must be >= 1, pad_lo %s and "
                        "pad_hi %s >= 0", LIST(win, x->rank), LIST(stride, x->rank),
                        LIST(lo, x->rank), LIST(hi, x->rank));
        int64_t padded;
        if (!rfi_pad_ok(x->dims[i], lo[i], hi[i], &padded))
            return fail(c, RF_E_SHAPE, "padding %s/%s overflows for %s", LIST(lo, x->rank),
                        LIST(hi, x->rank), TY(x));
        if (padded < win[i] && x->dims[i] > 0) /* an empty axis stays empty (api_nn.c) */
            return fail(c, RF_E_SHAPE, "window %s does not fit in %s padded by %s/%s at dim %d",
                        LIST(win, x->rank), TY(x), LIST(lo, x->rank), LIST(hi, x->rank), i);
        out[i] = padded < win[i] ? 0 : (padded - win[i]) / stride[i] + 1;
    }
    return RF_OK;
}

static rf_status infer_reduce_window(ictx *c)
{
    const rfi_node *x = c->in[0];
    int64_t kind = c->a->i[0];
    if (kind != RF_REDUCE_SUM && kind != RF_REDUCE_MAX && kind != RF_REDUCE_MIN)
        return fail(c, RF_E_INVALID, "kind %lld must be sum, max or min", (long long)kind);
    rf_status st = need_reduce_kind(c, x, kind);
    if (st != RF_OK || (st = window_dims(c, x, c->dims)) != RF_OK)
        return st;
    c->dt = x->dtype;
    c->rank = x->rank;
    return RF_OK;
}

static rf_status infer_select_and_scatter(ictx *c)
{
    const rfi_node *x = c->in[0], *src = c->in[1];
    int64_t want[RF_MAX_RANK];
    rf_status st = need_not_bool(c, x);
    if (st != RF_OK || (st = need_not_bool(c, src)) != RF_OK ||
        (st = window_dims(c, x, want)) != RF_OK)
        return st;
    if (src->rank != x->rank ||
        memcmp(src->dims, want, (size_t)x->rank * sizeof want[0]) != 0)
        return fail(c, RF_E_SHAPE, "source %s must have the window result shape %s of %s",
                    TY(src), TYD(src->dtype, want, x->rank), TY(x));
    set_result(c, src->dtype, x->dims, x->rank);
    return RF_OK;
}

/* ---- Indexing --------------------------------------------------------------------- */

/* x[:axis] + indices.shape + x[axis+1:] into c's result. */
static rf_status gather_type(ictx *c, const rfi_node *x, const rfi_node *idx)
{
    int64_t axis = c->a->i[0];
    if (idx->dtype != RF_I32 && idx->dtype != RF_I64)
        return fail(c, RF_E_DTYPE, "indices %s must be i32 or i64", TY(idx));
    if (axis < 0 || axis >= x->rank)
        return fail(c, RF_E_INVALID, "axis %lld out of range for %s", (long long)axis, TY(x));
    int rank = x->rank - 1 + idx->rank;
    if (rank > RF_MAX_RANK)
        return fail(c, RF_E_SHAPE, "result of %s indexed by %s has rank %d > %d", TY(x),
                    TY(idx), rank, RF_MAX_RANK);
    c->dt = x->dtype;
    c->rank = 0;
    for (int i = 0; i < axis; i++)
        c->dims[c->rank++] = x->dims[i];
    for (int i = 0; i < idx->rank; i++)
        c->dims[c->rank++] = idx->dims[i];
    for (int i = (int)axis + 1; i < x->rank; i++)
        c->dims[c->rank++] = x->dims[i];
    if (x->dims[axis] == 0 && rfi_numel(idx->dims, idx->rank) > 0)
        return fail(c, RF_E_SHAPE, "cannot index empty axis %lld of %s", (long long)axis, TY(x));
    return RF_OK;
}

static rf_status infer_gather(ictx *c) { return gather_type(c, c->in[0], c->in[1]); }

static rf_status infer_scatter_add(ictx *c)
{
    const rfi_node *x = c->in[0], *idx = c->in[1], *upd = c->in[2];
    rf_status st = gather_type(c, x, idx);
    if (st != RF_OK || (st = need_same_dtype(c, x, upd)) != RF_OK)
        return st;
    if (upd->rank != c->rank ||
        memcmp(upd->dims, c->dims, (size_t)c->rank * sizeof c->dims[0]) != 0)
        return fail(c, RF_E_SHAPE, "updates %s must have the gather shape %s (x %s, indices %s)",
                    TY(upd), TYD(x->dtype, c->dims, c->rank), TY(x), TY(idx));
    set_like(c, x);
    return RF_OK;
}

static rf_status infer_grad(ictx *c)
{
    const rfi_node *y = c->in[0], *wrt = c->in[1];
    if (y->rank != 0 || !rfi_dtype_is_float(y->dtype))
        return fail(c, RF_E_SHAPE, "y %s must be a float scalar", TY(y));
    set_like(c, wrt);
    return RF_OK;
}

/* ---- Dispatch ------------------------------------------------------------------------ */

static rf_status infer_op(ictx *c, rfi_op op)
{
    unsigned fl = rfi_op_table[op].flags;
    if (fl & RFI_UNARY)
        return infer_unary(c, op);
    if (fl & RFI_BINARY)
        return infer_binary(c, op);
    switch (op) {
    case RFI_OP_CONSTANT: return infer_constant(c);
    case RFI_OP_IOTA: return infer_iota(c);
    case RFI_OP_ARGUMENT:
    case RFI_OP_CAPTURE: return infer_slot(c);
    case RFI_OP_COMPARE: return infer_compare(c);
    case RFI_OP_SELECT: return infer_select(c);
    case RFI_OP_CLAMP: return infer_clamp(c);
    case RFI_OP_CONVERT: return infer_convert(c);
    case RFI_OP_BROADCAST_IN_DIM: return infer_broadcast(c);
    case RFI_OP_RESHAPE: return infer_reshape(c);
    case RFI_OP_TRANSPOSE: return infer_transpose(c);
    case RFI_OP_SLICE: return infer_slice(c);
    case RFI_OP_CONCATENATE: return infer_concatenate(c);
    case RFI_OP_PAD: return infer_pad(c);
    case RFI_OP_REVERSE: return infer_reverse(c);
    case RFI_OP_REDUCE: return infer_reduce(c);
    case RFI_OP_ARGMAX:
    case RFI_OP_ARGMIN: return infer_arg_extreme(c);
    case RFI_OP_DOT_GENERAL: return infer_dot_general(c);
    case RFI_OP_CONVOLUTION: return infer_convolution(c);
    case RFI_OP_REDUCE_WINDOW: return infer_reduce_window(c);
    case RFI_OP_SELECT_AND_SCATTER: return infer_select_and_scatter(c);
    case RFI_OP_GATHER: return infer_gather(c);
    case RFI_OP_SCATTER_ADD: return infer_scatter_add(c);
    case RFI_OP_RNG: return infer_rng(c);
    case RFI_OP_GRAD: return infer_grad(c);
    default: return fail(c, RF_E_INTERNAL, "no shape rule");
    }
}

/* Operand count, presence and sanity of their stored types. */
static rf_status check_operands(ictx *c, rfi_op op)
{
    int want = rfi_op_table[op].n_operands;
    if (want >= 0 && c->n_in != want)
        return fail(c, RF_E_INVALID, "expects %d operand%s, got %d", want, want == 1 ? "" : "s",
                    c->n_in);
    if (want < 0 && c->n_in < 1)
        return fail(c, RF_E_INVALID, "expects at least one operand, got %d", c->n_in);
    if (c->n_in > 0 && !c->in)
        return fail(c, RF_E_INVALID, "NULL operand list");
    for (int i = 0; i < c->n_in; i++) {
        const rfi_node *x = c->in[i];
        if (!x)
            return fail(c, RF_E_INVALID, "operand %d is NULL", i);
        if (!rfi_dtype_valid((int)x->dtype) || x->rank < 0 || x->rank > RF_MAX_RANK)
            return fail(c, RF_E_INTERNAL, "operand %d has an invalid type", i);
    }
    return RF_OK;
}

rf_status rfi_infer(rfi_op op, rfi_node *const *in, int n_in, const rfi_attrs *attr,
                    rf_dtype *dtype, int64_t *dims, int *rank, char *msg, size_t msgn)
{
    static const rfi_attrs no_attrs;
    char scratch[RFI_ERRMSG_MAX];
    if (!msg || msgn == 0) {
        msg = scratch;
        msgn = sizeof scratch;
    }
    if ((unsigned)op >= RFI_OP_COUNT) {
        snprintf(msg, msgn, "invalid op %d", (int)op);
        return RF_E_INTERNAL;
    }
    /* Field by field: gcc turned the initialiser's zeroing and the copy of
     * dims into rep stos / rep movs, whose start-up cost made this function,
     * called for every node, a tenth of a warm ResNet compile. */
    ictx c;
    c.name = rfi_op_table[op].name;
    c.in = in;
    c.n_in = n_in;
    c.a = attr ? attr : &no_attrs;
    c.dt = *dtype;
    c.rank = *rank;
    c.msg = msg;
    c.msgn = msgn;
    memset(c.dims, 0, sizeof c.dims);
    if (c.rank > 0 && c.rank <= RF_MAX_RANK)
        memcpy(c.dims, dims, (size_t)c.rank * sizeof *dims);
    msg[0] = '\0';
    for (int k = 0; k < RFI_N_LISTS; k++)
        if (c.a->nl[k] < 0 || c.a->nl[k] > RF_MAX_RANK)
            return fail(&c, RF_E_INVALID, "attribute list %d has %d entries (at most %d)", k,
                        c.a->nl[k], RF_MAX_RANK);
    rf_status st = check_operands(&c, op);
    if (st == RF_OK)
        st = infer_op(&c, op);
    if (st == RF_OK)
        st = need_sane_size(&c);
    if (st != RF_OK)
        return st;
    *dtype = c.dt;
    *rank = c.rank;
    for (int i = 0; i < c.rank; i++)
        dims[i] = c.dims[i];
    return RF_OK;
}

int rfi_dot_free_dims(int rank, const int64_t *a, int na, const int64_t *b, int nb,
                      int64_t *out)
{
    int n = 0;
    for (int d = 0; d < rank; d++) {
        bool listed = false;
        for (int k = 0; k < na; k++)
            listed |= a[k] == d;
        for (int k = 0; k < nb; k++)
            listed |= b[k] == d;
        if (!listed)
            out[n++] = d;
    }
    return n;
}

int64_t rfi_dot_macs(const rfi_node *dot)
{
    int64_t k = 1;
    for (int i = 0; i < dot->attr.nl[2]; i++)
        k *= dot->in[0]->dims[dot->attr.l[2][i]];
    return rfi_node_numel(dot) * k;
}

bool rfi_dot_bf16(const rfi_node *dot)
{
    return dot->op == RFI_OP_DOT_GENERAL && dot->attr.i[0] == RF_PRECISION_BF16;
}

bool rfi_conv_bf16(const rfi_node *conv)
{
    return conv->op == RFI_OP_CONVOLUTION && conv->attr.i[2] == RF_PRECISION_BF16;
}
