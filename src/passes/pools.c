/* pools.c: max pooling over non-overlapping windows, and its gradient, as
 * elementwise ops over the windows' strided slices (rfi_unroll_pools).
 *
 * Why: the gradient of a max pool, select_and_scatter(x, s), finds each
 * window's maximum again, so the backward pass reads the whole pre-pool
 * activation a second time, long after the forward pass wrote it (the cnn's
 * first pool: 5.5 MB from memory per step). Here the forward pass records
 * which point of its window each output took, an i32 code per output (a
 * byte would do, but gcc -O2 did not vectorise that loop with u8 codes), in
 * the same loop that computes the pooled maximum; the gradient then reads
 * those codes and the cotangent only, and the activation dies after its pool.
 *
 * For a float x with windows w_d, strides equal to the windows and no
 * padding, and at most MAX_POINTS points per window (P = prod w_d), with
 * v_p the strided slice of x at window point p (row-major over the window):
 *   reduce_window_max(x)         -> max(...max(v_0, v_1)..., v_{P-1})
 *   select_and_scatter(x, s)     -> pad(reshape(select(codes_b == p_b,
 *                                   +0 + s_b, +0)), +0): codes(x) is the
 *                                   first p whose v_p ranks highest (NaN above
 *                                   every number, the first NaN winning),
 *                                   codes_b and s_b broadcast over each
 *                                   window, p_b its point numbers, and the
 *                                   padding covers the rows and columns no
 *                                   window reaches.
 * Both are bitwise what the interpreter computes (its window fold is the
 * same max from the same first value; its scatter adds each selected source
 * value to +0 once, and leaves everything else +0), and CSE shares the
 * slices between a pool and its gradient. The plan then computes the codes
 * and the pooled maximum in one loop over the pooled shape.
 *
 * One more rewrite is exact in real arithmetic only: a float sum of such a
 * gradient over axes covering the window dims becomes the same sum of its
 * cotangent (sum_of_grad: the same terms in another order, accumulated in
 * double by both backends, as the compiled loops' vectorised sums already
 * reorder).
 *
 * And a convolution over such a gradient's uncovered border (the input
 * gradient of the layer before the pool) takes the border's zeros as its own
 * padding, its outputs that then read only padding cut off and padded back
 * (conv_over_border): exact for a finite kernel. A convolution that takes
 * such a gradient as its kernel (the weight gradient of that layer) runs
 * with the unpadded kernel over the part of its input the remaining taps
 * read (kernel_over_border): exact for a finite input, up to the sign of a
 * zero result.
 *
 * Deliberately not here: overlapping or padded windows, sum pools, integer
 * data (they keep their ops). Run by the compiling backends only (the
 * interpreter keeps the ops it defines them by).
 */
#include <stdlib.h>
#include <string.h>

#include "ad/vjp.h"
#include "passes/passes.h"
#include "runtime/runtime.h"

#define MAX_POINTS 16 /* the most points per window unrolled */
#define CODE_T RF_I32 /* the codes' dtype */

typedef struct window {
    int rank;
    int64_t win[RF_MAX_RANK];
    int64_t out[RF_MAX_RANK]; /* windows along each dim */
    int64_t points;
} window;

/* The window of a pool or pool gradient over x, when this pass takes it. */
static bool window_of(const rfi_node *x, const rfi_attrs *at, window *w)
{
    if (!rfi_dtype_is_float(x->dtype) || x->rank < 1)
        return false;
    int split = 0;
    w->rank = x->rank;
    w->points = 1;
    for (int d = 0; d < x->rank; d++) {
        int64_t win = at->l[0][d];
        if (win < 1 || at->l[1][d] != win || at->l[2][d] != 0 || at->l[3][d] != 0 ||
            x->dims[d] < win)
            return false;
        w->win[d] = win;
        w->out[d] = x->dims[d] / win;
        w->points *= win;
        split += win > 1;
    }
    return w->points >= 2 && w->points <= MAX_POINTS && x->rank + split <= RF_MAX_RANK;
}

static rfi_node *scalar(rfi_graph *c, rf_dtype dt, double v)
{
    unsigned char bytes[8];
    if (dt == RF_F32) {
        float f = (float)v;
        memcpy(bytes, &f, sizeof f);
    } else if (dt == RF_F64) {
        memcpy(bytes, &v, sizeof v);
    } else {
        int32_t i = (int32_t)v; /* CODE_T codes */
        memcpy(bytes, &i, sizeof i);
    }
    rfi_attrs a;
    memset(&a, 0, sizeof a);
    a.data = bytes;
    a.nbytes = rf_dtype_size(dt);
    return rfi_node_new(c, RFI_OP_CONSTANT, NULL, 0, &a, dt, NULL, 0);
}

static rfi_node *splat(rfi_graph *c, rf_dtype dt, double v, const int64_t *dims, int rank)
{
    rfi_node *s = scalar(c, dt, v);
    rfi_attrs a;
    memset(&a, 0, sizeof a);
    return rank == 0 ? s : rfi_node_new(c, RFI_OP_BROADCAST_IN_DIM, &s, 1, &a, dt, dims, rank);
}

static rfi_node *binary(rfi_graph *c, rfi_op op, rfi_node *a, rfi_node *b)
{
    rfi_node *in[2] = {a, b};
    return rfi_node_new(c, op, in, 2, NULL, a ? a->dtype : RF_F32, NULL, 0);
}

static rfi_node *compare(rfi_graph *c, rf_cmp cmp, rfi_node *a, rfi_node *b)
{
    rfi_attrs at;
    memset(&at, 0, sizeof at);
    at.i[0] = cmp;
    rfi_node *in[2] = {a, b};
    return rfi_node_new(c, RFI_OP_COMPARE, in, 2, &at, RF_BOOL, NULL, 0);
}

static rfi_node *select3(rfi_graph *c, rfi_node *p, rfi_node *a, rfi_node *b)
{
    rfi_node *in[3] = {p, a, b};
    return rfi_node_new(c, RFI_OP_SELECT, in, 3, NULL, a ? a->dtype : RF_F32, NULL, 0);
}

/* x's elements at window point p of every window (p row-major over the window). */
static rfi_node *point_slice(rfi_graph *c, rfi_node *x, const window *w, int64_t p)
{
    rfi_attrs a;
    memset(&a, 0, sizeof a);
    for (int d = w->rank - 1; d >= 0; d--) {
        int64_t at = p % w->win[d];
        p /= w->win[d];
        a.l[0][d] = at;
        a.l[1][d] = at + (w->out[d] - 1) * w->win[d] + 1;
        a.l[2][d] = w->win[d];
    }
    a.nl[0] = a.nl[1] = a.nl[2] = w->rank;
    return rfi_node_new(c, RFI_OP_SLICE, &x, 1, &a, x->dtype, NULL, 0);
}

/* The running maxima of the window's points: max(..max(v_0, v_1).., v_p)
 * for p = 0..points-1 in prefix[p] (prefix[points-1] is the pooled value).
 * Folded from the first point, as the interpreter's window fold from its
 * identity -inf: max(-inf, v) is v for every v, NaN included. */
static void running_max(rfi_graph *c, rfi_node *x, const window *w, rfi_node **prefix)
{
    prefix[0] = point_slice(c, x, w, 0);
    for (int64_t p = 1; p < w->points; p++)
        prefix[p] = binary(c, RFI_OP_MAX, prefix[p - 1], point_slice(c, x, w, p));
}

/* Codes: the window point each output's maximum comes from, as
 * select_and_scatter selects it: the last point p that ranks strictly above
 * all before it, where NaN ranks above every number and the first NaN wins.
 * With M the running maximum (NaN once a NaN was met), point p is above its
 * predecessors iff v_p > M_{p-1}, or v_p is NaN and M_{p-1} is not. Float
 * compares and integer selects only, so that the loop vectorises; it reads
 * the running maxima, never the pooled value itself, so the plan computes
 * the codes in the pooling loop. */
static rfi_node *window_codes(rfi_graph *c, rfi_node *x, const window *w)
{
    rfi_node *prefix[MAX_POINTS];
    running_max(c, x, w, prefix);
    rfi_node *m = prefix[0];
    rfi_node *code = m ? splat(c, CODE_T, 0, m->dims, m->rank) : NULL;
    for (int64_t p = 1; p < w->points && code; p++) {
        rfi_node *v = point_slice(c, x, w, p), *before = prefix[p - 1];
        rfi_node *before_is_number = compare(c, RF_EQ, before, before);
        rfi_node *first_nan = binary(c, RFI_OP_AND, compare(c, RF_NE, v, v), before_is_number);
        rfi_node *above = binary(c, RFI_OP_OR, compare(c, RF_GT, v, before), first_nan);
        code = select3(c, above, splat(c, CODE_T, (double)p, m->dims, m->rank), code);
    }
    return code;
}

/* The window-split shape [.., out_d, win_d, ..] (win_d only where > 1):
 * *rank, dims, and per x dim the position of its out axis (at_out) and of its
 * window axis (at_win, -1 when the window is 1). */
static void split_shape(const window *w, int *rank, int64_t *dims, int64_t *at_out,
                        int64_t *at_win)
{
    int r = 0;
    for (int d = 0; d < w->rank; d++) {
        at_out[d] = r;
        dims[r++] = w->out[d];
        at_win[d] = -1;
        if (w->win[d] > 1) {
            at_win[d] = r;
            dims[r++] = w->win[d];
        }
    }
    *rank = r;
}

/* The point numbers of one window, broadcast over the split shape. */
static rfi_node *point_numbers(rfi_graph *c, const window *w, const int64_t *dims, int rank,
                               const int64_t *at_win)
{
    int32_t numbers[MAX_POINTS];
    int64_t wdims[RF_MAX_RANK];
    rfi_attrs b;
    memset(&b, 0, sizeof b);
    int nw = 0;
    for (int d = 0; d < w->rank; d++)
        if (at_win[d] >= 0) {
            wdims[nw] = w->win[d];
            b.l[0][nw++] = at_win[d];
        }
    b.nl[0] = nw;
    for (int64_t p = 0; p < w->points; p++)
        numbers[p] = (int32_t)p;
    rfi_attrs a;
    memset(&a, 0, sizeof a);
    a.data = numbers;
    a.nbytes = (size_t)w->points * sizeof numbers[0];
    rfi_node *k = rfi_node_new(c, RFI_OP_CONSTANT, NULL, 0, &a, CODE_T, wdims, nw);
    return rfi_node_new(c, RFI_OP_BROADCAST_IN_DIM, &k, 1, &b, CODE_T, dims, rank);
}

static rfi_node *over_windows(rfi_graph *c, rfi_node *v, const int64_t *dims, int rank,
                              const int64_t *at_out, int xrank)
{
    rfi_attrs b;
    memset(&b, 0, sizeof b);
    b.nl[0] = xrank;
    memcpy(b.l[0], at_out, (size_t)xrank * sizeof(int64_t));
    return rfi_node_new(c, RFI_OP_BROADCAST_IN_DIM, &v, 1, &b, v ? v->dtype : CODE_T, dims, rank);
}

/* select_and_scatter(x, s) from x's codes (see the file comment). */
static rfi_node *scatter_by_codes(rfi_graph *c, rfi_node *x, rfi_node *s, const window *w,
                                  rfi_node *x_codes)
{
    int rank = 0;
    int64_t dims[RF_MAX_RANK], at_out[RF_MAX_RANK], at_win[RF_MAX_RANK];
    split_shape(w, &rank, dims, at_out, at_win);
    rfi_node *codes = over_windows(c, x_codes, dims, rank, at_out, w->rank);
    rfi_node *chosen = compare(c, RF_EQ, codes, point_numbers(c, w, dims, rank, at_win));
    rfi_node *zero = splat(c, x->dtype, 0.0, dims, rank);
    rfi_node *value = binary(c, RFI_OP_ADD, zero, over_windows(c, s, dims, rank, at_out, w->rank));
    rfi_node *spread = select3(c, chosen, value, zero);
    int64_t covered[RF_MAX_RANK];
    bool short_of_x = false;
    for (int d = 0; d < w->rank; d++) {
        covered[d] = w->out[d] * w->win[d];
        short_of_x |= covered[d] < x->dims[d];
    }
    rfi_node *r = rfi_node_new(c, RFI_OP_RESHAPE, &spread, 1, NULL, x->dtype, covered, w->rank);
    if (!short_of_x)
        return r;
    rfi_attrs p;
    memset(&p, 0, sizeof p);
    p.nl[0] = p.nl[1] = p.nl[2] = w->rank;
    for (int d = 0; d < w->rank; d++)
        p.l[1][d] = x->dims[d] - covered[d];
    rfi_node *in[2] = {r, scalar(c, x->dtype, 0.0)};
    return rfi_node_new(c, RFI_OP_PAD, in, 2, &p, x->dtype, NULL, 0);
}

/* The codes made for one pooled operand and window, so that a pool and its
 * gradient share them. */
typedef struct codes_memo {
    const rfi_node *x;
    rfi_attrs window;
    rfi_node *codes;
} codes_memo;

/* A gradient made here: its result, the cotangent it spreads, its window. */
typedef struct spread_grad {
    const rfi_node *out, *source;
    window w;
} spread_grad;

typedef struct unroller {
    rfi_graph *c;
    codes_memo *memo;
    int n_memo, cap_memo;
    spread_grad *grads;
    int n_grads, cap_grads;
} unroller;

static void remember_grad(unroller *u, const rfi_node *out, const rfi_node *source,
                          const window *w)
{
    if (u->n_grads == u->cap_grads) {
        int cap = u->cap_grads ? 2 * u->cap_grads : 8;
        spread_grad *g = rfi_realloc(u->grads, (size_t)cap * sizeof *g);
        if (!g)
            return; /* forgetting it only skips the sum rewrite */
        u->grads = g;
        u->cap_grads = cap;
    }
    u->grads[u->n_grads++] = (spread_grad){out, source, *w};
}

/* sum over axes of a gradient made here, when the axes cover every window
 * dim: each cotangent element lands in exactly one position of its window
 * and the rest is +0, so the sum is the cotangent's own sum over the same
 * axes (the same terms in another order; both accumulate floats in double
 * before one rounding). The bias gradient of a convolution before a pool
 * then reads the pooled cotangent, not the 4x larger spread one. */
static rfi_node *sum_of_grad(unroller *u, const rfi_node *n, rfi_node *x)
{
    if (n->attr.i[0] != RF_REDUCE_SUM)
        return NULL;
    for (int i = 0; i < u->n_grads; i++) {
        const spread_grad *g = &u->grads[i];
        if (g->out != x)
            continue;
        bool reduced[RF_MAX_RANK] = {false};
        for (int a = 0; a < n->attr.nl[0]; a++)
            reduced[n->attr.l[0][a]] = true;
        for (int d = 0; d < g->w.rank; d++)
            if (g->w.win[d] > 1 && !reduced[d])
                return NULL;
        rfi_node *src = (rfi_node *)g->source;
        return rfi_node_new(u->c, RFI_OP_REDUCE, &src, 1, &n->attr, n->dtype, NULL, 0);
    }
    return NULL;
}

static bool same_window(const rfi_attrs *a, const rfi_attrs *b, int rank)
{
    for (int k = 0; k < 4; k++)
        if (memcmp(a->l[k], b->l[k], sizeof(int64_t) * (size_t)rank) != 0)
            return false;
    return true;
}

/* x's codes under window attrs at: made once, at the first pool or gradient
 * that asks (the pool comes first, so the plan schedules them with it). */
static rfi_node *codes_of(unroller *u, rfi_node *x, const rfi_attrs *at, const window *w)
{
    for (int i = 0; i < u->n_memo; i++)
        if (u->memo[i].x == x && same_window(&u->memo[i].window, at, x->rank))
            return u->memo[i].codes;
    void *memo = u->memo;
    if (!rfi_grow(&memo, u->n_memo, &u->cap_memo, sizeof *u->memo))
        return NULL;
    u->memo = memo;
    rfi_node *codes = window_codes(u->c, x, w);
    codes_memo *m = &u->memo[u->n_memo++];
    m->x = x;
    rfi_attrs_copy(&m->window, at);
    m->codes = codes;
    return codes;
}

/* ---- A convolution over a gradient's border ---------------------------------------- */

/* x is a rank-0 float constant +0 (all bytes zero). */
static bool is_plus_zero(const rfi_node *x)
{
    static const unsigned char zero[8];
    return x->op == RFI_OP_CONSTANT && x->rank == 0 && rfi_dtype_is_float(x->dtype) &&
           x->attr.data && memcmp(x->attr.data, zero, rf_dtype_size(x->dtype)) == 0;
}

/* conv(pad(a, +0), w) with the pad on spatial dims only (>= 0, no interior)
 * and no lhs dilation is conv(a, w) with that pad added to the conv's own:
 * the interpreter defines a padding position as contributing 0 * w, as the
 * pad's zeros do, in the same order. Here it meets the border a pool gradient
 * leaves (scatter_by_codes): the input gradient of the convolution before
 * a pool that did not cover its output (the cnn's 11x11 -> 5x5).
 *
 * Outputs at the end of a spatial dim that then read only padding (their
 * first position past the input) are zero; they are cut from the
 * convolution and put back as a pad of +0 after it, which is exact for a
 * finite kernel (0 * inf would be NaN). The cnn's input gradient then runs
 * as oneDNN's backward-data of 10x10 to 12x12 instead of 11x11 to 13x13:
 * 1.08-1.17 against 1.30-1.38 ms alone on two threads, and 12x12 is whole
 * 4x4 tiles for its Winograd form (cpu/conv.c: 0.77-0.81 ms). */
static rfi_node *conv_over_border(unroller *u, const rfi_node *n, rfi_node *const *in)
{
    const rfi_node *pad = in[0], *w = in[1];
    int nsp = n->rank - 2;
    if (!rfi_dtype_is_float(n->dtype) || pad->op != RFI_OP_PAD || !is_plus_zero(pad->in[1]))
        return NULL;
    for (int d = 0; d < pad->rank; d++) {
        int64_t lo = pad->attr.l[0][d], hi = pad->attr.l[1][d];
        if (lo < 0 || hi < 0 || pad->attr.l[2][d] != 0 || (d < 2 && (lo || hi)))
            return NULL;
    }
    rfi_attrs a;
    rfi_attrs_copy(&a, &n->attr);
    int64_t cut[RF_MAX_RANK] = {0};
    bool cutting = false;
    for (int s = 0; s < nsp; s++) {
        int64_t len = pad->in[0]->dims[2 + s], stride = a.l[0][s];
        if (a.l[3][s] != 1 || len < 1 || a.l[1][s] < 0)
            return NULL;
        a.l[1][s] += pad->attr.l[0][2 + s];
        a.l[2][s] += pad->attr.l[1][2 + s];
        int64_t lo = a.l[1][s], reading = (len - 1 + lo) / stride + 1;
        int64_t hi = (reading - 1) * stride + (w->dims[2 + s] - 1) * a.l[4][s] + 1 - len - lo;
        if (reading < n->dims[2 + s] && hi >= 0) {
            cut[2 + s] = n->dims[2 + s] - reading;
            a.l[2][s] = hi;
            cutting = true;
        }
    }
    rfi_node *ops[2] = {pad->in[0], (rfi_node *)w};
    rfi_node *c = rfi_node_new(u->c, RFI_OP_CONVOLUTION, ops, 2, &a, n->dtype, NULL, 0);
    if (!cutting || !c)
        return c;
    rfi_attrs p;
    memset(&p, 0, sizeof p);
    p.nl[0] = p.nl[1] = p.nl[2] = n->rank;
    memcpy(p.l[1], cut, sizeof(int64_t) * (size_t)n->rank);
    rfi_node *pad_in[2] = {c, scalar(u->c, n->dtype, 0.0)};
    return rfi_node_new(u->c, RFI_OP_PAD, pad_in, 2, &p, n->dtype, NULL, 0);
}

/* x itself, or the operand of a transpose x, with the permutation that maps
 * x's dims to it (x dim d is its dim perm[d]). */
static const rfi_node *under_transpose(const rfi_node *x, int64_t *perm)
{
    bool t = x->op == RFI_OP_TRANSPOSE;
    for (int d = 0; d < x->rank; d++)
        perm[d] = t ? x->attr.l[0][d] : d;
    return t ? x->in[0] : x;
}

/* A convolution whose kernel (rhs, possibly through a transpose) is a pad of
 * +0 at the high end of its spatial dims: the kernel taps in the padding
 * multiply +0 into the sum, so the convolution runs with the unpadded kernel
 * and the input (lhs, possibly through a transpose) cut, first from its own
 * high padding, then from its end, to the positions the remaining taps read.
 * Exact for a finite input, up to the sign of a zero result (a dropped +0
 * term turned -0 into +0). Here it meets the weight gradient of the
 * convolution before a pool that did not cover its output, which the
 * autodiff writes as conv(transpose(x), transpose(dy)) over the padded
 * spread (the cnn's 11x11 -> 5x5 pool): the 10x10 spread is then the
 * kernel, the pad of 2 MB is not written, and x is read as 12x12. */
static rfi_node *kernel_over_border(unroller *u, const rfi_node *n, rfi_node *const *in)
{
    int64_t kperm[RF_MAX_RANK], xperm[RF_MAX_RANK];
    const rfi_node *pad = under_transpose(in[1], kperm), *x = under_transpose(in[0], xperm);
    int nsp = n->rank - 2;
    if (!rfi_dtype_is_float(n->dtype) || pad->op != RFI_OP_PAD || !is_plus_zero(pad->in[1]) ||
        n->attr.i[0] != 1 || n->attr.i[1] != 1)
        return NULL;
    int64_t taps_cut[RF_MAX_RANK] = {0};
    bool cutting = false;
    for (int e = 0; e < n->rank; e++) { /* e: a dim of the kernel, kperm[e] of the pad */
        int64_t lo = pad->attr.l[0][kperm[e]], hi = pad->attr.l[1][kperm[e]];
        if (lo != 0 || hi < 0 || pad->attr.l[2][kperm[e]] != 0 || (e < 2 && hi != 0))
            return NULL;
        if (e >= 2)
            taps_cut[e - 2] = hi;
        cutting = cutting || hi > 0;
    }
    if (!cutting)
        return NULL;
    rfi_attrs a;
    rfi_attrs_copy(&a, &n->attr);
    int64_t x_cut[RF_MAX_RANK] = {0};
    for (int s = 0; s < nsp; s++) {
        int64_t len = in[0]->dims[2 + s], taps = in[1]->dims[2 + s] - taps_cut[s];
        int64_t stride = a.l[0][s], high = a.l[2][s], dilation = a.l[4][s];
        if (a.l[3][s] != 1 || high < 0 || a.l[1][s] < 0 || taps < 1)
            return NULL;
        /* the padded input's extent, and what the remaining taps read of it */
        int64_t extent = len + a.l[1][s] + high;
        int64_t read = (n->dims[2 + s] - 1) * stride + (taps - 1) * dilation + 1;
        int64_t excess = extent - read, from_padding = excess < high ? excess : high;
        if (excess < 0 || excess - from_padding >= len)
            return NULL;
        a.l[2][s] = high - from_padding;
        x_cut[xperm[2 + s]] = excess - from_padding;
    }
    const int64_t zeros[RF_MAX_RANK] = {0};
    int64_t kept[RF_MAX_RANK];
    for (int d = 0; d < x->rank; d++)
        kept[d] = x->dims[d] - x_cut[d];
    /* perms are the identity where there was no transpose (then no node) */
    rfi_node *cut = rfi_ad_slice(u->c, (rfi_node *)x, zeros, kept, NULL); /* x: nothing cut */
    rfi_node *ops[2] = {
        cut == x ? in[0] : rfi_ad_transpose(u->c, cut, xperm),
        rfi_ad_transpose(u->c, pad->in[0], kperm),
    };
    if (!ops[0] || !ops[1])
        return NULL;
    return rfi_node_new(u->c, RFI_OP_CONVOLUTION, ops, 2, &a, n->dtype, NULL, 0);
}

/* The rewrite of n over its mapped operands, or NULL to copy it (u->c's
 * status tells a failure). */
static rfi_node *unroll(unroller *u, const rfi_node *n, rfi_node *const *in)
{
    window w;
    if (n->op == RFI_OP_REDUCE_WINDOW && n->attr.i[0] == RF_REDUCE_MAX &&
        window_of(in[0], &n->attr, &w)) {
        rfi_node *prefix[MAX_POINTS];
        running_max(u->c, in[0], &w, prefix);
        return codes_of(u, in[0], &n->attr, &w) ? prefix[w.points - 1] : NULL;
    }
    if (n->op == RFI_OP_SELECT_AND_SCATTER && in[1]->dtype == n->dtype &&
        in[0]->dtype == n->dtype && window_of(in[0], &n->attr, &w)) {
        rfi_node *codes = codes_of(u, in[0], &n->attr, &w);
        rfi_node *out = codes ? scatter_by_codes(u->c, in[0], in[1], &w, codes) : NULL;
        if (out)
            remember_grad(u, out, in[1], &w);
        return out;
    }
    if (n->op == RFI_OP_REDUCE && rfi_dtype_is_float(n->dtype))
        return sum_of_grad(u, n, in[0]);
    if (n->op == RFI_OP_CONVOLUTION) {
        rfi_node *r = conv_over_border(u, n, in);
        return r || u->c->status != RF_OK ? r : kernel_over_border(u, n, in);
    }
    return NULL;
}

bool rfi_unroll_pools_enabled(void)
{
    const char *v = getenv("RF_UNROLL_POOLS");
    return !(v && strcmp(v, "0") == 0);
}

/* rfi_rewrite_fn over unroll (the copy is the unroller's graph). */
static rfi_node *unroll_node(void *ctx, rfi_graph *c, const rfi_node *n, rfi_node *const *in,
                             rfi_node *const *map)
{
    (void)map;
    unroller *u = ctx;
    u->c = c;
    return unroll(u, n, in);
}

rf_status rfi_unroll_pools(const rfi_graph *g, rfi_graph **out)
{
    unroller u = {NULL, NULL, 0, 0, NULL, 0, 0};
    rf_status st = rfi_rewrite_graph(g, "unroll_pools",
                                     rfi_unroll_pools_enabled() ? unroll_node : NULL, &u, out);
    rfi_free(u.memo);
    rfi_free(u.grads);
    return st;
}
