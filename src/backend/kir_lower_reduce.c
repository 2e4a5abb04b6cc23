/* kir_lower_reduce.c: REDUCE steps lowered to kernels (kir.h) for
 * kir_lower.c, which lowers the rest and holds the shared state
 * (kir_lower.h).
 *
 * A REDUCE kernel's outer loops run over the result, its inner loops over
 * the reduced axes, the window or the contracting dims; sibling reductions
 * of one step fold side by side over the same inner loops. In a step with a
 * REDUCE epilogue (plan.h) the kernel stores the step's root instead of the
 * reduction, computed at each point from the fold's result. A reduce_window
 * over a small window (a pooling) is unrolled: its points are folded one
 * after the other by explicit instructions with the fold's arithmetic, so
 * the kernel has no reduced loops and vectorises along its last axis like an
 * elementwise loop (about 4x faster than the looped window on the cnn's
 * first 2x2 max-pool). A padded one becomes kernels over boxes of its
 * result: the edges, and an interior where the value ranges fold every
 * padding guard and index clamp away. Deliberately no loop order or
 * thread split (the renderers choose those).
 */
#include <math.h>
#include <stdio.h>

#include "kir_lower.h"

/* Identity of a reduction in the accumulator (interpreter: reduce.c). */
static void set_identity(rfi_kir_kernel *k, rf_reduce_kind kind, rf_dtype xt)
{
    k->red_kind = kind;
    k->acc_dtype = rfi_dtype_is_float(xt) ? RF_F64 : RF_I64;
    if (rfi_dtype_is_float(xt) && (kind == RF_REDUCE_MAX || kind == RF_REDUCE_MIN))
        k->acc_dtype = xt; /* exact in the data's type: no conversions */
    switch (kind) {
    case RF_REDUCE_PROD: k->red_identity_f = 1; k->red_identity_i = 1; break;
    case RF_REDUCE_MAX:
        k->red_identity_f = -INFINITY;
        k->red_identity_i = xt == RF_I32 ? INT32_MIN : xt == RF_I64 ? INT64_MIN : 0;
        break;
    case RF_REDUCE_MIN:
        k->red_identity_f = INFINITY;
        k->red_identity_i = xt == RF_I32 ? INT32_MAX : xt == RF_I64 ? INT64_MAX
                            : xt == RF_U8  ? 255 : 1;
        break;
    case RF_REDUCE_AND: k->red_identity_f = 1; k->red_identity_i = xt == RF_BOOL ? 1 : -1; break;
    default: k->red_identity_f = 0; k->red_identity_i = 0; break;
    }
}

/* The value reduce n folds at kept point m. inner[q] is the index of n's
 * q-th reduced dim: made here when -1 (a new inner loop), else reused (a
 * sibling reduction of the same step reduces the same dims). */
static rf_status reduce_value(lower *L, const rfi_node *n, const int *m, int *inner, int *value)
{
    const rfi_node *x = n->in[0];
    rfi_kir_kernel *k = L->k;
    bool reduced[RF_MAX_RANK] = {false};
    for (int a = 0; a < n->attr.nl[0]; a++)
        reduced[n->attr.l[0][a]] = true;
    int xm[RF_MAX_RANK];
    for (int d = 0, r = 0, q = 0; d < x->rank; d++) {
        if (!reduced[d]) {
            xm[d] = m[r++];
            continue;
        }
        if (inner[q] < 0)
            inner[q] = rfi_lower_loop_var(L, x->dims[d], true);
        xm[d] = inner[q++];
    }
    set_identity(k, (rf_reduce_kind)n->attr.i[0], x->dtype);
    return rfi_lower_operand_at(L, x, xm, value);
}

/* Makes v (at kept point m) the value fold j folds, and stores root, which
 * is n (the fold's result in n's type) or, in a step with a REDUCE epilogue
 * (plan.h), the root computed from that result at m. */
static rf_status fold_root(lower *L, const rfi_node *n, const rfi_node *root, const int *m,
                           int j, int v)
{
    rfi_kir_kernel *k = L->k;
    int folded = rfi_kir_convert(k, k->acc_dtype, v, -1);
    if (j == 0)
        k->red_value = folded;
    else
        k->sibling_values[j - 1] = folded;
    if (j >= k->n_folds)
        k->n_folds = j + 1;
    int result = rfi_kir_convert(k, n->dtype, rfi_kir_acc_of(k, j), n->id);
    kidx ix = root->rank ? idx_multi_of(root, m) : idx_scalar(L);
    if (root == n)
        return rfi_lower_store_root(L, n, &ix, result);
    L->fold_node = n->id;
    L->fold_value = result;
    rf_status st = rfi_lower_operand_at(L, root, m, &result);
    L->fold_node = -1;
    return st == RF_OK ? rfi_lower_store_root(L, root, &ix, result) : st;
}

/* Folds 1.. of a REDUCE step: its other roots, sibling reductions of root 0
 * over the same dims (fuse.c), folded in the same pass over the inner loops. */
static rf_status sibling_folds(lower *L, const rfi_step *st, const int *m, int *inner)
{
    for (int r = 1; r < st->n_roots; r++) {
        const rfi_node *n = L->g->nodes[st->roots[r]];
        if (n->op != RFI_OP_REDUCE || r >= RFI_KIR_MAX_FOLDS)
            return rfi_lower_unsupported(L, n, "is not a reduction that can fold beside another");
        int v = -1;
        rf_status s = reduce_value(L, n, m, inner, &v);
        if (s == RF_OK)
            s = fold_root(L, n, n, m, r, v);
        if (s != RF_OK)
            return s;
    }
    return RF_OK;
}

/* 0 <= p < n as a KIR bool: a window point inside its operand, not in the padding. */
static int index_in_range(lower *L, int p, int64_t n)
{
    int below = rfi_kir_icmp(L->k, RF_LT, p, cst(L, n));
    return rfi_kir_land(L->k, rfi_kir_icmp(L->k, RF_GE, p, cst(L, 0)), below);
}

static rf_status window_value(lower *L, const rfi_node *n, const int *m, int *value)
{
    const rfi_node *x = n->in[0];
    const rfi_attrs *at = &n->attr;
    rfi_kir_kernel *k = L->k;
    set_identity(k, (rf_reduce_kind)at->i[0], x->dtype);
    if (rfi_node_numel(x) == 0) { /* all padding: the identity everywhere */
        *value = rfi_kir_const_i(k, x->dtype, 0);
        k->red_guard = rfi_kir_const_i(k, RF_BOOL, 0);
        return RF_OK;
    }
    int xm[RF_MAX_RANK], w[RF_MAX_RANK], inside = rfi_kir_const_i(k, RF_BOOL, 1);
    for (int d = 0; d < x->rank; d++)
        w[d] = rfi_lower_loop_var(L, at->l[0][d], true);
    for (int d = 0; d < x->rank; d++) {
        int64_t stride = at->l[1][d], lo = at->l[2][d];
        int shifted = iop(L, RFI_KIR_IADD, w[d], cst(L, -lo));
        int p = iop(L, RFI_KIR_IADD, iop(L, RFI_KIR_IMUL, m[d], cst(L, stride)), shifted);
        int64_t pmin = -lo, pmax = (n->dims[d] - 1) * stride + at->l[0][d] - 1 - lo;
        if (pmin >= 0 && pmax < x->dims[d]) {
            xm[d] = p;
            continue;
        }
        inside = rfi_kir_land(k, inside, index_in_range(L, p, x->dims[d]));
        xm[d] = rfi_lower_clamp_index(L, p, x->dims[d] - 1);
    }
    int64_t c;
    k->red_guard = rfi_kir_is_const(k, inside, &c) && c ? -1 : inside;
    return rfi_lower_operand_at(L, x, xm, value);
}

/* Whether reduce_window n is unrolled (window_unrolled): a sum, max or min
 * over a non-empty operand with at most WINDOW_UNROLL points per window. */
#define WINDOW_UNROLL 16

static bool window_unrolls(const rfi_node *n)
{
    rf_reduce_kind kind = (rf_reduce_kind)n->attr.i[0];
    return (kind == RF_REDUCE_SUM || kind == RF_REDUCE_MAX || kind == RF_REDUCE_MIN) &&
           rfi_node_numel(n->in[0]) > 0 && rfi_numel(n->attr.l[0], n->rank) <= WINDOW_UNROLL;
}

/* A small window unrolled: its points folded in row-major order (the order
 * of the window loops) by explicit instructions with the fold's arithmetic
 * (max and min in the data's type, sums from the identity in the
 * accumulator's), a padding point keeping the accumulator. The kernel then
 * has no reduced loops and vectorises along its last axis like an
 * elementwise loop; the result is the looped form's, bit for bit. */
static rf_status window_unrolled(lower *L, const rfi_node *n, const int *m, int *value)
{
    const rfi_node *x = n->in[0];
    const rfi_attrs *at = &n->attr;
    rfi_kir_kernel *k = L->k;
    rf_reduce_kind kind = (rf_reduce_kind)at->i[0];
    set_identity(k, kind, x->dtype);
    rf_dtype acc_t = k->acc_dtype;
    rfi_op op = kind == RF_REDUCE_SUM   ? RFI_OP_ADD
                : kind == RF_REDUCE_MAX ? RFI_OP_MAX
                                        : RFI_OP_MIN;
    int acc = rfi_dtype_is_float(acc_t) ? rfi_kir_const_f(k, acc_t, k->red_identity_f)
                                        : rfi_kir_const_i(k, acc_t, k->red_identity_i);
    int64_t points = rfi_numel(at->l[0], x->rank);
    for (int64_t pt = 0; pt < points; pt++) {
        int xm[RF_MAX_RANK], inside = rfi_kir_const_i(k, RF_BOOL, 1);
        int64_t rest = pt; /* the point's window offsets, last dim fastest */
        for (int d = x->rank - 1; d >= 0; d--) {
            int64_t w = rest % at->l[0][d], stride = at->l[1][d], lo = at->l[2][d];
            rest /= at->l[0][d];
            int offset = cst(L, w - lo);
            int p = iop(L, RFI_KIR_IADD, iop(L, RFI_KIR_IMUL, m[d], cst(L, stride)), offset);
            inside = rfi_kir_land(k, inside, index_in_range(L, p, x->dims[d]));
            xm[d] = rfi_lower_clamp_index(L, p, x->dims[d] - 1);
        }
        int v = -1;
        rf_status st = rfi_lower_operand_at(L, x, xm, &v);
        if (st != RF_OK)
            return st;
        int folded = rfi_kir_binary(k, op, acc_t, acc, rfi_kir_convert(k, acc_t, v, -1), -1);
        acc = rfi_kir_select(k, inside, folded, acc, -1);
    }
    *value = acc;
    return rfi_kir_failed(k) ? RF_E_NOMEM : RF_OK;
}

/* The term a * b of a dot product or convolution whose operands va and vb were
 * loaded (see dot_value for the arithmetic): `bf16` rounds them first. */
static int product_term(rfi_kir_kernel *k, bool bf16, rf_dtype at, rf_dtype bt, int va, int vb)
{
    if (bf16) { /* then the product is exact in f32 */
        va = rfi_kir_round_bf16(k, va, -1);
        vb = rfi_kir_round_bf16(k, vb, -1);
    }
    if (at == RF_F32 && bt == RF_F32) {
        k->acc_dtype = RF_F32;
        return rfi_kir_binary(k, RFI_OP_MUL, RF_F32, va, vb, -1);
    }
    if (rfi_dtype_is_float(at))
        return rfi_kir_convert(k, k->acc_dtype, rfi_kir_binary(k, RFI_OP_MUL, at, va, vb, -1),
                               -1);
    /* integers: the product wraps in the accumulator, as the interpreter's */
    int wide_b = rfi_kir_convert(k, k->acc_dtype, vb, -1);
    return rfi_kir_binary(k, RFI_OP_MUL, k->acc_dtype, rfi_kir_convert(k, k->acc_dtype, va, -1),
                          wide_b, -1);
}

/* sum over the contracting dims of a[...] * b[...]. An f32 dot multiplies and
 * accumulates in f32, as the math library's matmul does (the interpreter works
 * in double: the difference stays inside the equivalence tolerance), which a
 * vectorised loop runs without conversions (measured on a 512x784 matrix-vector
 * product: 2.5x faster than double); other float dots round each product once
 * and accumulate in double; integer products wrap in the int64 accumulator. */
static rf_status dot_value(lower *L, const rfi_node *n, const int *m, int *value)
{
    const rfi_node *a = n->in[0], *b = n->in[1];
    const rfi_attrs *at = &n->attr;
    rfi_kir_kernel *k = L->k;
    set_identity(k, RF_REDUCE_SUM, a->dtype);
    int nb = at->nl[0], nc = at->nl[2];
    int am[RF_MAX_RANK], bm[RF_MAX_RANK];
    for (int d = 0; d < RF_MAX_RANK; d++)
        am[d] = bm[d] = -2;
    for (int i = 0; i < nb; i++) {
        am[at->l[0][i]] = m[i];
        bm[at->l[1][i]] = m[i];
    }
    for (int i = 0; i < nc; i++) {
        int v = rfi_lower_loop_var(L, a->dims[at->l[2][i]], true);
        am[at->l[2][i]] = v;
        bm[at->l[3][i]] = v;
    }
    int r = nb;
    for (int d = 0; d < a->rank; d++)
        if (am[d] == -2)
            am[d] = m[r++];
    for (int d = 0; d < b->rank; d++)
        if (bm[d] == -2)
            bm[d] = m[r++];
    int va = -1, vb = -1;
    rf_status st = rfi_lower_operand_at(L, a, am, &va);
    if (st == RF_OK)
        st = rfi_lower_operand_at(L, b, bm, &vb);
    *value = product_term(k, rfi_dot_bf16(n), a->dtype, b->dtype, va, vb);
    return st;
}

/* Convolution n (the interpreter's semantics, interp/conv.c) at result point
 * m = (image, feature, position...): the sum over ci < C/G and kernel
 * positions q... of x[image block + m0, channel block + ci, source...] *
 * w[m1, ci, q...], each source the position m*stride + q*rhs_dil - pad_lo of
 * the padded, lhs-dilated input, zero at a padding point or dilation hole
 * (which still multiplies w, as in the interpreter: a NaN weight gives NaN).
 * Products and sums as dot_value's: f32 in f32, other floats rounded once
 * and summed in double, integers wrapping in int64. Convolutions of the
 * compiling backends reach here unpadded (passes/pad_convs.c) but for
 * negative padding. */
static rf_status conv_value(lower *L, const rfi_node *n, const int *m, int *value)
{
    const rfi_node *x = n->in[0], *w = n->in[1];
    const rfi_attrs *at = &n->attr;
    rfi_kir_kernel *k = L->k;
    set_identity(k, RF_REDUCE_SUM, x->dtype);
    int nsp = x->rank - 2;
    int64_t groups = at->i[0] > 0 ? at->i[0] : 1, b_groups = at->i[1] > 0 ? at->i[1] : 1;
    int64_t features = n->dims[1], cin = w->dims[1];
    int xm[RF_MAX_RANK], wm[RF_MAX_RANK];
    int ci = rfi_lower_loop_var(L, cin, true);
    wm[0] = m[1];
    wm[1] = ci;
    for (int d = 0; d < nsp; d++)
        wm[2 + d] = rfi_lower_loop_var(L, w->dims[2 + d], true);
    xm[0] = m[0];
    /* each instruction made in its own statement: the same numbering whatever
     * order a compiler evaluates a call's arguments in */
    if (b_groups > 1) { /* the feature's block of images */
        int block = iop(L, RFI_KIR_IDIV, m[1], cst(L, features / b_groups));
        int first = iop(L, RFI_KIR_IMUL, block, cst(L, n->dims[0]));
        xm[0] = iop(L, RFI_KIR_IADD, first, m[0]);
    }
    xm[1] = ci;
    if (groups > 1) { /* the feature's block of channels */
        int block = iop(L, RFI_KIR_IDIV, m[1], cst(L, features / groups));
        int first = iop(L, RFI_KIR_IMUL, block, cst(L, cin));
        xm[1] = iop(L, RFI_KIR_IADD, first, ci);
    }
    int inside = rfi_kir_const_i(k, RF_BOOL, 1);
    for (int d = 0; d < nsp; d++) {
        int64_t stride = at->l[0][d], lo = at->l[1][d], rdil = at->l[4][d];
        int64_t ldil = at->l[3][d] > 0 ? at->l[3][d] : 1, in = x->dims[2 + d];
        int out_at = iop(L, RFI_KIR_IMUL, m[2 + d], cst(L, stride));
        int tap_at = iop(L, RFI_KIR_IMUL, wm[2 + d], cst(L, rdil));
        int sum = iop(L, RFI_KIR_IADD, out_at, tap_at);
        int pos = iop(L, RFI_KIR_IADD, sum, cst(L, -lo));
        if (ldil > 1) {
            int off_grid = iop(L, RFI_KIR_IREM, pos, cst(L, ldil));
            int on_grid = rfi_kir_icmp(k, RF_EQ, off_grid, cst(L, 0));
            inside = rfi_kir_land(k, inside, rfi_kir_icmp(k, RF_GE, pos, cst(L, 0)));
            inside = rfi_kir_land(k, inside, on_grid);
            pos = iop(L, RFI_KIR_IDIV, pos, cst(L, ldil));
            inside = rfi_kir_land(k, inside, rfi_kir_icmp(k, RF_LT, pos, cst(L, in)));
        } else {
            inside = rfi_kir_land(k, inside, index_in_range(L, pos, in));
        }
        xm[2 + d] = rfi_lower_clamp_index(L, pos, in - 1);
    }
    int vx = -1, vw = -1;
    rf_status st = rfi_lower_operand_at(L, x, xm, &vx);
    if (st == RF_OK)
        st = rfi_lower_operand_at(L, w, wm, &vw);
    int64_t c;
    if (!(rfi_kir_is_const(k, inside, &c) && c)) /* padding is zero, times w (NaN * 0 too) */
        vx = rfi_kir_select(k, inside, vx, rfi_kir_const_i(k, x->dtype, 0), -1);
    *value = product_term(k, rfi_conv_bf16(n), x->dtype, w->dtype, vx, vw);
    return st;
}

/* One REDUCE kernel over the result's box `part` (the whole result but for
 * the pieces of a padded window: window_pieces). */
rf_status rfi_lower_reduce(lower *L, const rfi_step *st, const box *part)
{
    const rfi_node *n = L->g->nodes[st->core >= 0 ? st->core : st->roots[0]];
    rfi_kir_kernel *k = L->k;
    rfi_lower_kernel_name(k, n);
    k->is_reduce = true;
    int m[RF_MAX_RANK];
    bool whole = true;
    for (int d = 0; d < n->rank; d++)
        whole = whole && part->lo[d] == 0 && part->hi[d] == n->dims[d];
    if (whole)
        rfi_lower_reduce_loops(L, st, n, m);
    for (int d = 0; d < n->rank && !whole; d++) {
        if (part->lo[d] == 0 && part->hi[d] == n->dims[d]) {
            m[d] = rfi_lower_loop_var(L, n->dims[d], false);
            continue;
        }
        int offset = cst(L, part->lo[d]);
        m[d] = iop(L, RFI_KIR_IADD, rfi_lower_loop_var(L, part->hi[d] - part->lo[d], false),
                   offset);
    }
    int v = -1, inner[RF_MAX_RANK];
    for (int q = 0; q < RF_MAX_RANK; q++)
        inner[q] = -1;
    rf_status s;
    if (n->op == RFI_OP_REDUCE_WINDOW && window_unrolls(n)) {
        k->is_reduce = false;
        /* An edge piece one column wide (the left or right column of a padded
         * max-pool) has no loop over the last dim: its innermost loop walks
         * rows, whole rows apart. Forced vectorisation (omp simd) turns that
         * into strided loads with 64-bit index vectors that gcc 12 -O2 took
         * 3-12 s to compile for one kernel (a 3x3 stride-2 max-pool padded by
         * 1 to 16x16 or 32x32 on blocked channels), a part's whole compile;
         * left to gcc's cost model it compiles in 0.1 s. */
        int last = n->rank - 1;
        k->no_simd = !whole && last >= 0 && n->dims[last] > 1 &&
                     part->hi[last] - part->lo[last] == 1;
        s = window_unrolled(L, n, m, &v);
        kidx ix = n->rank ? idx_multi_of(n, m) : idx_scalar(L);
        if (s != RF_OK)
            return s;
        return rfi_lower_store_root(L, n, &ix, rfi_kir_convert(k, n->dtype, v, n->id));
    }
    if (n->op == RFI_OP_REDUCE)
        s = reduce_value(L, n, m, inner, &v);
    else if (n->op == RFI_OP_REDUCE_WINDOW)
        s = window_value(L, n, m, &v);
    else if (n->op == RFI_OP_DOT_GENERAL)
        s = dot_value(L, n, m, &v);
    else if (n->op == RFI_OP_CONVOLUTION)
        s = conv_value(L, n, m, &v);
    else
        return rfi_lower_unsupported(L, n, "is no reduction (a REDUCE step needs reduce, "
                                           "reduce_window, dot_general or convolution)");
    if (s != RF_OK)
        return s;
    s = fold_root(L, n, L->g->nodes[st->roots[0]], m, 0, v);
    return s == RF_OK ? sibling_folds(L, st, m, inner) : s;
}

/* The interior [*a, *b) of reduce_window n along dim d: the results whose
 * windows lie inside the operand along it (padding only outside). */
static void window_interior(const rfi_node *n, int d, int64_t *a, int64_t *b)
{
    int64_t win = n->attr.l[0][d], stride = n->attr.l[1][d], lo = n->attr.l[2][d];
    int64_t room = n->in[0]->dims[d] - win + lo; /* the last window start inside */
    *a = lo > 0 ? (lo + stride - 1) / stride : 0;
    *b = room < 0 ? 0 : room / stride + 1;
    *a = *a < n->dims[d] ? *a : n->dims[d];
    *b = *b < *a ? *a : *b < n->dims[d] ? *b : n->dims[d];
}

/* A padded reduce_window runs as pieces: per padded dim, outermost first,
 * its two edges (the dims before it restricted to their interiors), then the
 * interior of every dim, where each guard and clamp folds away (kir.h: value
 * ranges), so its loads step by the strides and it vectorises without
 * per-lane guards (a 3x3 stride-2 max-pool padded by 1 on [64,32,56,56]:
 * 1.5x over one guarded unrolled kernel). boxes[0..*count) and their names;
 * false when the window is not padded or has no interior. */
bool rfi_lower_window_pieces(const rfi_node *n, box *boxes, char (*names)[24], int *count)
{
    if (n->op != RFI_OP_REDUCE_WINDOW || rfi_node_numel(n->in[0]) == 0)
        return false;
    box inner;
    int c = 0;
    for (int d = 0; d < n->rank; d++) {
        inner.lo[d] = 0;
        inner.hi[d] = n->dims[d];
    }
    for (int d = 0; d < n->rank; d++) {
        int64_t a, b;
        window_interior(n, d, &a, &b);
        if (b <= a)
            return false;
        for (int side = 0; side < 2; side++) {
            box edge = inner;
            edge.lo[d] = side ? b : 0;
            edge.hi[d] = side ? n->dims[d] : a;
            if (edge.hi[d] > edge.lo[d]) {
                boxes[c] = edge;
                snprintf(names[c++], sizeof names[0], "edge%d_%s", d, side ? "hi" : "lo");
            }
        }
        inner.lo[d] = a;
        inner.hi[d] = b;
    }
    if (c == 0)
        return false;
    boxes[c] = inner;
    snprintf(names[c++], sizeof names[0], "interior");
    *count = c;
    return true;
}
