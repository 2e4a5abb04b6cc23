/* vjp.c: the table of VJP rules (one per op of the op table) and the rules
 * of the elementwise ops. ct is the cotangent of the result y = op(in...).
 *
 *   op                  rule (cotangent of each operand)
 *   constant, iota,
 *   argument, capture   leaves: nothing to propagate
 *   neg                 -ct
 *   abs                 ct * sign(x)
 *   sign, floor, ceil,
 *   round, stop_gradient zero (no rule: nothing propagates)
 *   exp                 ct * y
 *   expm1               ct * (y + 1)
 *   log                 ct / x
 *   log1p               ct / (1 + x)
 *   sqrt                ct * 0.5 / y
 *   rsqrt               ct * -0.5 * y^3
 *   tanh                ct * (1 - y^2)
 *   logistic            ct * y * (1 - y)
 *   sin / cos           ct * cos(x) / -ct * sin(x)
 *   add / sub           ct, ct / ct, -ct
 *   mul                 ct * b, ct * a
 *   div                 ct / b, -ct * y / b
 *   pow                 ct * b * a^(b-1), 0 where b == 0;  ct * y * log(a), 0 where
 *                       a == 0 (JAX's choice; negative a gives NaN: no real derivative)
 *   max / min           ct to the selected operand; ties go to a (a >= b / a <= b);
 *                       except relu, max(x, 0) with a constant zero: ct where y > 0
 *                       (NNlib's and PyTorch's rule: 0 at x == 0), read from the
 *                       result so the pre-activation need not be kept
 *   rem                 ct;  -ct * trunc(a / b)
 *   select              pred: none; a: ct where pred; b: ct where !pred
 *   clamp               x: ct where lo <= x <= hi; lo / hi: ct where they were chosen
 *                       (summed when lo or hi is a scalar for a larger x)
 *   convert             float -> float: ct converted back; otherwise zero
 *   broadcast_in_dim    sum over new and stretched dims, then reshape     (vjp_shape.c)
 *   reshape             reshape back                                       (vjp_shape.c)
 *   transpose           inverse permutation                                (vjp_shape.c)
 *   slice               pad with zeros (low = start, interior = stride-1)  (vjp_shape.c)
 *   concatenate         slices                                             (vjp_shape.c)
 *   pad                 x: strided slice of ct; value: sum of ct over the
 *                       padded positions                                   (vjp_shape.c)
 *   reverse             reverse                                            (vjp_shape.c)
 *   reduce              sum: broadcast back; max/min: ct split equally among
 *                       the positions equal to the result (JAX's rule); prod:
 *                       product of the others (exact with zeros)           (vjp_shape.c)
 *   gather              scatter_add of ct into zeros at the clamped indices (vjp_shape.c)
 *   scatter_add         x: ct; updates: ct gathered at in-range indices    (vjp_shape.c)
 *   dot_general         dot_general with ct + transpose, both operands     (vjp_linalg.c)
 *   convolution         input: convolution of ct with the flipped kernel;
 *                       kernel: convolution of x with ct (XLA's forms, any
 *                       stride, padding, dilation, feature/batch groups)   (vjp_linalg.c)
 *   reduce_window       sum: pad + window sum of ct; max: select_and_scatter;
 *                       min: select_and_scatter on -x                      (vjp_linalg.c)
 *   select_and_scatter  x: zero (piecewise constant); source: ct picked at
 *                       each window's first max (one slice per window
 *                       offset, so windows of at most 256 elements)        (vjp_linalg.c)
 *   compare, is_finite,
 *   not, and, or,
 *   argmax, argmin, rng no gradient (RFI_NOGRAD: bool/int results or random)
 *   grad                replaced by the pass; nested use is an error
 *   softmax, logsoftmax recognised as a whole from their primitives: one rule
 *                       on the result (not an op)                          (vjp_softmax.c)
 *
 * Non-float operands never receive a cotangent (the pass does not ask).
 * Deliberately not here: deciding what to differentiate (autodiff.c).
 */
#include "ad/vjp.h"

#include <string.h>

#define G (a->g)

/* ---- Unary ------------------------------------------------------------------------ */

static rf_status vjp_neg(const rfi_vjp_args *a, rfi_node **gr)
{
    gr[0] = rfi_ad_unary(G, RFI_OP_NEG, a->ct);
    return RF_OK;
}

static rf_status vjp_abs(const rfi_vjp_args *a, rfi_node **gr)
{
    gr[0] = rfi_ad_binary(G, RFI_OP_MUL, a->ct, rfi_ad_unary(G, RFI_OP_SIGN, a->in[0]));
    return RF_OK;
}

static rf_status vjp_exp(const rfi_vjp_args *a, rfi_node **gr)
{
    gr[0] = rfi_ad_binary(G, RFI_OP_MUL, a->ct, a->out);
    return RF_OK;
}

static rf_status vjp_expm1(const rfi_vjp_args *a, rfi_node **gr)
{
    rfi_node *d = rfi_ad_binary(G, RFI_OP_ADD, a->out, rfi_ad_full_like(G, a->out, 1.0));
    gr[0] = rfi_ad_binary(G, RFI_OP_MUL, a->ct, d);
    return RF_OK;
}

static rf_status vjp_log(const rfi_vjp_args *a, rfi_node **gr)
{
    gr[0] = rfi_ad_binary(G, RFI_OP_DIV, a->ct, a->in[0]);
    return RF_OK;
}

static rf_status vjp_log1p(const rfi_vjp_args *a, rfi_node **gr)
{
    rfi_node *d = rfi_ad_binary(G, RFI_OP_ADD, a->in[0], rfi_ad_full_like(G, a->in[0], 1.0));
    gr[0] = rfi_ad_binary(G, RFI_OP_DIV, a->ct, d);
    return RF_OK;
}

static rf_status vjp_sqrt(const rfi_vjp_args *a, rfi_node **gr)
{
    gr[0] = rfi_ad_binary(G, RFI_OP_DIV, rfi_ad_scale(G, a->ct, 0.5), a->out);
    return RF_OK;
}

static rf_status vjp_rsqrt(const rfi_vjp_args *a, rfi_node **gr)
{
    /* d/dx x^-1/2 = -1/2 x^-3/2 = -1/2 y^3 */
    rfi_node *y = a->out;
    rfi_node *y3 = rfi_ad_binary(G, RFI_OP_MUL, y, rfi_ad_binary(G, RFI_OP_MUL, y, y));
    gr[0] = rfi_ad_binary(G, RFI_OP_MUL, rfi_ad_scale(G, a->ct, -0.5), y3);
    return RF_OK;
}

static rf_status vjp_tanh(const rfi_vjp_args *a, rfi_node **gr)
{
    rfi_node *y = a->out;
    rfi_node *y2 = rfi_ad_binary(G, RFI_OP_MUL, y, y);
    rfi_node *d = rfi_ad_binary(G, RFI_OP_SUB, rfi_ad_full_like(G, y, 1.0), y2);
    gr[0] = rfi_ad_binary(G, RFI_OP_MUL, a->ct, d);
    return RF_OK;
}

static rf_status vjp_logistic(const rfi_vjp_args *a, rfi_node **gr)
{
    rfi_node *y = a->out;
    rfi_node *d = rfi_ad_binary(G, RFI_OP_MUL, y,
                                rfi_ad_binary(G, RFI_OP_SUB, rfi_ad_full_like(G, y, 1.0), y));
    gr[0] = rfi_ad_binary(G, RFI_OP_MUL, a->ct, d);
    return RF_OK;
}

static rf_status vjp_sin(const rfi_vjp_args *a, rfi_node **gr)
{
    gr[0] = rfi_ad_binary(G, RFI_OP_MUL, a->ct, rfi_ad_unary(G, RFI_OP_COS, a->in[0]));
    return RF_OK;
}

static rf_status vjp_cos(const rfi_vjp_args *a, rfi_node **gr)
{
    rfi_node *s = rfi_ad_unary(G, RFI_OP_SIN, a->in[0]);
    gr[0] = rfi_ad_unary(G, RFI_OP_NEG, rfi_ad_binary(G, RFI_OP_MUL, a->ct, s));
    return RF_OK;
}

/* ---- Binary ------------------------------------------------------------------------ */

static rf_status vjp_add(const rfi_vjp_args *a, rfi_node **gr)
{
    gr[0] = a->ct;
    gr[1] = a->ct;
    return RF_OK;
}

static rf_status vjp_sub(const rfi_vjp_args *a, rfi_node **gr)
{
    gr[0] = a->ct;
    if (a->want[1])
        gr[1] = rfi_ad_unary(G, RFI_OP_NEG, a->ct);
    return RF_OK;
}

static rf_status vjp_mul(const rfi_vjp_args *a, rfi_node **gr)
{
    if (a->want[0])
        gr[0] = rfi_ad_binary(G, RFI_OP_MUL, a->ct, a->in[1]);
    if (a->want[1])
        gr[1] = rfi_ad_binary(G, RFI_OP_MUL, a->ct, a->in[0]);
    return RF_OK;
}

static rf_status vjp_div(const rfi_vjp_args *a, rfi_node **gr)
{
    rfi_node *b = a->in[1];
    if (a->want[0])
        gr[0] = rfi_ad_binary(G, RFI_OP_DIV, a->ct, b);
    if (a->want[1]) {
        /* d(a/b)/db = -a/b^2 = -y/b */
        rfi_node *t = rfi_ad_binary(G, RFI_OP_DIV, rfi_ad_binary(G, RFI_OP_MUL, a->ct, a->out), b);
        gr[1] = rfi_ad_unary(G, RFI_OP_NEG, t);
    }
    return RF_OK;
}

static rf_status vjp_pow(const rfi_vjp_args *a, rfi_node **gr)
{
    rfi_node *x = a->in[0], *p = a->in[1];
    if (a->want[0]) {
        /* x^0 is 1 everywhere, so p = 0 gives 0, where p * x^(p-1) would be 0 * inf at
         * x = 0 (PyTorch's rule; JAX's float pow gives NaN there). */
        rfi_node *pm1 = rfi_ad_binary(G, RFI_OP_SUB, p, rfi_ad_full_like(G, p, 1.0));
        rfi_node *d = rfi_ad_binary(G, RFI_OP_MUL, p, rfi_ad_binary(G, RFI_OP_POW, x, pm1));
        rfi_node *p_zero = rfi_ad_full_like(G, p, 0.0);
        d = rfi_ad_select(G, rfi_ad_compare(G, p, p_zero, RF_EQ), p_zero, d);
        gr[0] = rfi_ad_binary(G, RFI_OP_MUL, a->ct, d);
    }
    if (a->want[1]) {
        /* log(0) would make 0 * inf = NaN where the true derivative is 0 (y = 0). */
        rfi_node *zero = rfi_ad_full_like(G, x, 0.0);
        rfi_node *is0 = rfi_ad_compare(G, x, zero, RF_EQ);
        rfi_node *safe = rfi_ad_select(G, is0, rfi_ad_full_like(G, x, 1.0), x);
        rfi_node *d = rfi_ad_binary(G, RFI_OP_MUL, a->out, rfi_ad_unary(G, RFI_OP_LOG, safe));
        gr[1] = rfi_ad_select(G, is0, zero, rfi_ad_binary(G, RFI_OP_MUL, a->ct, d));
    }
    return RF_OK;
}

/* max/min: the cotangent goes to the operand that was chosen; ties to a. */
static rf_status route_chooser(const rfi_vjp_args *a, rfi_node **gr, int cmp)
{
    rfi_node *pick_a = rfi_ad_compare(G, a->in[0], a->in[1], cmp);
    rfi_node *zero = rfi_ad_full_like(G, a->ct, 0.0);
    if (a->want[0])
        gr[0] = rfi_ad_select(G, pick_a, a->ct, zero);
    if (a->want[1])
        gr[1] = rfi_ad_select(G, pick_a, zero, a->ct);
    return RF_OK;
}

/* x is a constant zero, or a broadcast of one (either sign of zero). */
static bool is_zero_constant(const rfi_node *x)
{
    if (x->op == RFI_OP_BROADCAST_IN_DIM)
        x = x->in[0];
    if (x->op != RFI_OP_CONSTANT || x->rank != 0 || !x->attr.data)
        return false;
    if (x->dtype == RF_F32) {
        float v;
        memcpy(&v, x->attr.data, sizeof v);
        return v == 0.0f;
    }
    if (x->dtype == RF_F64) {
        double v;
        memcpy(&v, x->attr.data, sizeof v);
        return v == 0.0;
    }
    return false;
}

static rf_status vjp_max(const rfi_vjp_args *a, rfi_node **gr)
{
    for (int k = 0; k < 2; k++) {
        if (!is_zero_constant(a->in[1 - k]) || is_zero_constant(a->in[k]))
            continue;
        /* relu: y > 0 exactly where x > 0 (a NaN x gives a NaN y: no cotangent) */
        rfi_node *zero = rfi_ad_full_like(G, a->ct, 0.0);
        if (a->want[k])
            gr[k] = rfi_ad_select(G, rfi_ad_compare(G, a->out, zero, RF_GT), a->ct, zero);
        return RF_OK;
    }
    return route_chooser(a, gr, RF_GE);
}

static rf_status vjp_min(const rfi_vjp_args *a, rfi_node **gr)
{
    return route_chooser(a, gr, RF_LE);
}

static rf_status vjp_rem(const rfi_vjp_args *a, rfi_node **gr)
{
    gr[0] = a->ct;
    if (a->want[1]) {
        /* rem(a, b) = a - b * trunc(a / b) */
        rfi_node *q = rfi_ad_binary(G, RFI_OP_DIV, a->in[0], a->in[1]);
        rfi_node *whole = rfi_ad_unary(G, RFI_OP_FLOOR, rfi_ad_unary(G, RFI_OP_ABS, q));
        rfi_node *trunc = rfi_ad_binary(G, RFI_OP_MUL, rfi_ad_unary(G, RFI_OP_SIGN, q), whole);
        gr[1] = rfi_ad_unary(G, RFI_OP_NEG, rfi_ad_binary(G, RFI_OP_MUL, a->ct, trunc));
    }
    return RF_OK;
}

/* ---- Select, clamp, convert ------------------------------------------------------------ */

static rf_status vjp_select(const rfi_vjp_args *a, rfi_node **gr)
{
    rfi_node *zero = rfi_ad_full_like(G, a->ct, 0.0);
    if (a->want[1])
        gr[1] = rfi_ad_select(G, a->in[0], a->ct, zero);
    if (a->want[2])
        gr[2] = rfi_ad_select(G, a->in[0], zero, a->ct);
    return RF_OK;
}

/* A clamp bound of rank 0 against a larger x: broadcast for elementwise use. */
static rfi_node *bound_like(rfi_graph *g, rfi_node *bound, const rfi_node *x)
{
    if (!bound || bound->rank == x->rank)
        return bound;
    return rfi_ad_broadcast(g, bound, x->dims, x->rank, NULL);
}

/* The cotangent of a bound, summed when the bound was a broadcast scalar. */
static rfi_node *bound_grad(rfi_graph *g, rfi_node *grad, const rfi_node *bound)
{
    if (!grad || bound->rank == grad->rank)
        return grad;
    return rfi_ad_sum_all(g, grad);
}

static rf_status vjp_clamp(const rfi_vjp_args *a, rfi_node **gr)
{
    /* y = min(max(x, lo), hi): hi wins when max(x, lo) > hi, then lo when x < lo. */
    rfi_node *x = a->in[1];
    rfi_node *lo = bound_like(G, a->in[0], x), *hi = bound_like(G, a->in[2], x);
    rfi_node *zero = rfi_ad_full_like(G, a->ct, 0.0);
    rfi_node *m = rfi_ad_binary(G, RFI_OP_MAX, x, lo);
    rfi_node *took_hi = rfi_ad_compare(G, m, hi, RF_GT);
    rfi_node *rest = rfi_ad_select(G, took_hi, zero, a->ct);
    rfi_node *x_ge_lo = rfi_ad_compare(G, x, lo, RF_GE);
    if (a->want[0])
        gr[0] = bound_grad(G, rfi_ad_select(G, x_ge_lo, zero, rest), a->in[0]);
    if (a->want[1])
        gr[1] = rfi_ad_select(G, x_ge_lo, rest, zero);
    if (a->want[2])
        gr[2] = bound_grad(G, rfi_ad_select(G, took_hi, a->ct, zero), a->in[2]);
    return RF_OK;
}

static rf_status vjp_convert(const rfi_vjp_args *a, rfi_node **gr)
{
    /* Only float -> float carries a gradient; the pass never asks for int operands
     * and never differentiates int results. */
    gr[0] = rfi_ad_convert(G, a->ct, a->in[0]->dtype);
    return RF_OK;
}

#undef G

/* ---- The table ------------------------------------------------------------------------ */

static const rfi_vjp_fn rules[RFI_OP_COUNT] = {
    [RFI_OP_NEG] = vjp_neg,
    [RFI_OP_ABS] = vjp_abs,
    [RFI_OP_EXP] = vjp_exp,
    [RFI_OP_EXPM1] = vjp_expm1,
    [RFI_OP_LOG] = vjp_log,
    [RFI_OP_LOG1P] = vjp_log1p,
    [RFI_OP_SQRT] = vjp_sqrt,
    [RFI_OP_RSQRT] = vjp_rsqrt,
    [RFI_OP_TANH] = vjp_tanh,
    [RFI_OP_LOGISTIC] = vjp_logistic,
    [RFI_OP_SIN] = vjp_sin,
    [RFI_OP_COS] = vjp_cos,
    [RFI_OP_ADD] = vjp_add,
    [RFI_OP_SUB] = vjp_sub,
    [RFI_OP_MUL] = vjp_mul,
    [RFI_OP_DIV] = vjp_div,
    [RFI_OP_POW] = vjp_pow,
    [RFI_OP_MAX] = vjp_max,
    [RFI_OP_MIN] = vjp_min,
    [RFI_OP_REM] = vjp_rem,
    [RFI_OP_SELECT] = vjp_select,
    [RFI_OP_CLAMP] = vjp_clamp,
    [RFI_OP_CONVERT] = vjp_convert,
    [RFI_OP_BROADCAST_IN_DIM] = rfi_vjp_broadcast_in_dim,
    [RFI_OP_RESHAPE] = rfi_vjp_reshape,
    [RFI_OP_TRANSPOSE] = rfi_vjp_transpose,
    [RFI_OP_SLICE] = rfi_vjp_slice,
    [RFI_OP_CONCATENATE] = rfi_vjp_concatenate,
    [RFI_OP_PAD] = rfi_vjp_pad,
    [RFI_OP_REVERSE] = rfi_vjp_reverse,
    [RFI_OP_REDUCE] = rfi_vjp_reduce,
    [RFI_OP_DOT_GENERAL] = rfi_vjp_dot_general,
    [RFI_OP_CONVOLUTION] = rfi_vjp_convolution,
    [RFI_OP_REDUCE_WINDOW] = rfi_vjp_reduce_window,
    [RFI_OP_SELECT_AND_SCATTER] = rfi_vjp_select_and_scatter,
    [RFI_OP_GATHER] = rfi_vjp_gather,
    [RFI_OP_SCATTER_ADD] = rfi_vjp_scatter_add,
};

rfi_vjp_fn rfi_vjp_rule(rfi_op op)
{
    return (unsigned)op < RFI_OP_COUNT ? rules[op] : NULL;
}

bool rfi_vjp_has_zero_rule(rfi_op op)
{
    switch (op) {
    case RFI_OP_SIGN:
    case RFI_OP_FLOOR:
    case RFI_OP_CEIL:
    case RFI_OP_ROUND:
    case RFI_OP_STOP_GRADIENT:
        return true;
    default:
        return false;
    }
}
