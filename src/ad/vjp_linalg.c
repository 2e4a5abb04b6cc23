/* vjp_linalg.c: VJP rules of dot_general, convolution, reduce_window and
 * select_and_scatter. See the table in vjp.c.
 *
 * The convolution rules are XLA's (as JAX writes them): the input gradient is
 * a convolution of the cotangent, dilated by the stride, with the flipped
 * kernel whose feature dims are swapped group by group; the kernel gradient
 * is a convolution of the input with the cotangent as kernel, with batch and
 * feature roles swapped (feature groups become batch groups and vice versa).
 * Deliberately not here: elementwise and shape rules (vjp.c, vjp_shape.c).
 */
#include <math.h>
#include <string.h>

#include "ad/vjp.h"

#define G (a->g)

/* ---- dot_general ------------------------------------------------------------------------ */

/* Rank of v among the n entries of l. */
static int64_t rank_in(int64_t v, const int64_t *l, int n)
{
    int64_t k = 0;
    for (int i = 0; i < n; i++)
        k += l[i] < v;
    return k;
}

/* Cotangent of one side ("self") of a dot_general given the other side:
 * dot(ct, other) contracting ct's other-free dims with other's free dims
 * gives [batch, self free, self contract (in other's contract order sorted)],
 * then a transpose puts self's dims back in place. */
static rfi_node *dot_side_grad(rfi_graph *g, rfi_node *ct, rfi_node *other, const rfi_node *self,
                               const int64_t *sb, const int64_t *sc, const int64_t *ob,
                               const int64_t *oc, int nb, int nc, bool self_is_lhs,
                               int64_t precision)
{
    int64_t sf[RF_MAX_RANK] = {0}, of[RF_MAX_RANK] = {0};
    int nsf = rfi_dot_free_dims(self->rank, sb, nb, sc, nc, sf);
    int nof = rfi_dot_free_dims(other->rank, ob, nb, oc, nc, of);
    int64_t ct_batch[RF_MAX_RANK] = {0}, ct_contract[RF_MAX_RANK] = {0};
    int64_t other_free_at = self_is_lhs ? nb + nsf : nb; /* ct: [batch, lhs free, rhs free] */
    for (int i = 0; i < nb; i++)
        ct_batch[i] = i;
    for (int i = 0; i < nof; i++)
        ct_contract[i] = other_free_at + i;
    rfi_node *d = rfi_ad_dot(g, ct, other, ct_batch, ob, nb, ct_contract, of, nof, precision);
    int64_t perm[RF_MAX_RANK];
    for (int i = 0; i < nb; i++)
        perm[sb[i]] = i;
    for (int j = 0; j < nsf; j++)
        perm[sf[j]] = nb + j;
    for (int k = 0; k < nc; k++)
        perm[sc[k]] = nb + nsf + rank_in(oc[k], oc, nc);
    return rfi_ad_transpose(g, d, perm);
}

rf_status rfi_vjp_dot_general(const rfi_vjp_args *a, rfi_node **gr)
{
    const rfi_attrs *at = &a->node->attr;
    const int64_t *lb = at->l[0], *rb = at->l[1], *lc = at->l[2], *rc = at->l[3];
    int nb = at->nl[0], nc = at->nl[2];
    /* both backward products round as the forward one did (JAX's transpose rule) */
    if (a->want[0])
        gr[0] = dot_side_grad(G, a->ct, a->in[1], a->in[0], lb, lc, rb, rc, nb, nc, true,
                              at->i[0]);
    if (a->want[1])
        gr[1] = dot_side_grad(G, a->ct, a->in[0], a->in[1], rb, rc, lb, lc, nb, nc, false,
                              at->i[0]);
    return RF_OK;
}

/* ---- Convolution ------------------------------------------------------------------------- */

typedef struct conv_attrs {
    int nsp;
    int64_t stride[3], lo[3], hi[3], lhs_dil[3], rhs_dil[3];
    int64_t fgc, bgc;
    int64_t precision; /* rf_precision */
} conv_attrs;

static conv_attrs conv_attrs_of(const rfi_node *n)
{
    conv_attrs c;
    memset(&c, 0, sizeof c);
    c.nsp = n->attr.nl[0];
    for (int i = 0; i < c.nsp; i++) {
        c.stride[i] = n->attr.l[0][i];
        c.lo[i] = n->attr.l[1][i];
        c.hi[i] = n->attr.l[2][i];
        c.lhs_dil[i] = n->attr.l[3][i];
        c.rhs_dil[i] = n->attr.l[4][i];
    }
    c.fgc = n->attr.i[0] > 1 ? n->attr.i[0] : 1;
    c.bgc = n->attr.i[1] > 1 ? n->attr.i[1] : 1;
    c.precision = n->attr.i[2];
    return c;
}

/* Whether dim i's padding is done by an explicit PAD (conv below). */
static bool padded_apart(const conv_attrs *c, int i)
{
    return c->lo[i] < 0 || (c->hi[i] < 0 && c->lhs_dil[i] > 1);
}

/* A convolution node. Negative low padding, and negative high padding of an
 * lhs-dilated dim, are done by an explicit PAD (which crops), together with
 * the lhs dilation, so the convolution sees only non-negative padding there.
 * Such a dim's other padding joins the PAD too: a crop may reach past the
 * dilated input into the padding on the other side (one element cropped by
 * 2, then padded by 5 is 4 zeros), which only the whole padding at once
 * describes. A negative high padding alone stays in the convolution: it only
 * drops trailing inputs no output reads (the weight gradient of a strided
 * convolution that skipped its last rows), and a copy would cost a pass
 * over x; the backends read such a convolution's operand in place. */
static rfi_node *conv(rfi_graph *g, rfi_node *x, rfi_node *w, conv_attrs c)
{
    if (!x || !w)
        return NULL;
    bool negative = false;
    for (int i = 0; i < c.nsp; i++)
        negative = negative || padded_apart(&c, i);
    if (negative) {
        int64_t lo[RF_MAX_RANK] = {0}, hi[RF_MAX_RANK] = {0}, interior[RF_MAX_RANK] = {0};
        for (int i = 0; i < c.nsp; i++) {
            if (padded_apart(&c, i)) {
                lo[2 + i] = c.lo[i];
                hi[2 + i] = c.hi[i];
                c.lo[i] = c.hi[i] = 0;
            }
            interior[2 + i] = c.lhs_dil[i] - 1;
            c.lhs_dil[i] = 1;
        }
        x = rfi_ad_pad(g, x, rfi_ad_scalar(g, x->dtype, 0.0), lo, hi, interior);
    }
    rfi_attrs at;
    memset(&at, 0, sizeof at);
    for (int k = 0; k < 5; k++)
        at.nl[k] = c.nsp;
    for (int i = 0; i < c.nsp; i++) {
        at.l[0][i] = c.stride[i];
        at.l[1][i] = c.lo[i];
        at.l[2][i] = c.hi[i];
        at.l[3][i] = c.lhs_dil[i];
        at.l[4][i] = c.rhs_dil[i];
    }
    at.i[0] = c.fgc;
    at.i[1] = c.bgc;
    at.i[2] = c.precision;
    rfi_node *in[2] = {x, w};
    return rfi_node_new(g, RFI_OP_CONVOLUTION, in, 2, &at, x ? x->dtype : RF_F32, NULL, 0);
}

static int64_t dilated(int64_t n, int64_t dil)
{
    return n > 0 ? (n - 1) * dil + 1 : 0;
}

/* Swaps dims 0 and 1. */
static rfi_node *swap01(rfi_graph *g, rfi_node *x)
{
    if (!x)
        return NULL;
    int64_t perm[RF_MAX_RANK];
    for (int i = 0; i < x->rank; i++)
        perm[i] = i;
    perm[0] = 1;
    perm[1] = 0;
    return rfi_ad_transpose(g, x, perm);
}

/* [O, I, K...] -> [groups * I, O / groups, K...]: within each of `groups`
 * blocks of O, the in/out feature roles swap (and the blocks line up along
 * the new dim 0). */
static rfi_node *swap_kernel_features(rfi_graph *g, rfi_node *w, int64_t groups)
{
    if (!w)
        return NULL;
    int r = w->rank, nsp = r - 2;
    int64_t o = w->dims[0], i = w->dims[1];
    int64_t split[RF_MAX_RANK + 1] = {groups, o / groups, i}, perm[RF_MAX_RANK + 1] = {0, 2, 1};
    for (int k = 0; k < nsp; k++) {
        split[3 + k] = w->dims[2 + k];
        perm[3 + k] = 3 + k;
    }
    if (r + 1 > RF_MAX_RANK) {
        /* groups == 1 needs no split: a plain swap. */
        return groups == 1 ? swap01(g, w) : NULL;
    }
    rfi_node *t = rfi_ad_transpose(g, rfi_ad_reshape(g, w, split, r + 1), perm);
    int64_t out[RF_MAX_RANK];
    out[0] = groups * i;
    out[1] = o / groups;
    for (int k = 0; k < nsp; k++)
        out[2 + k] = w->dims[2 + k];
    return rfi_ad_reshape(g, t, out, r);
}

static rfi_node *conv_input_grad(rfi_graph *g, rfi_node *ct, rfi_node *x, rfi_node *w,
                                 conv_attrs c)
{
    int nsp = c.nsp;
    int64_t groups = c.bgc > 1 ? c.bgc : c.fgc;
    int64_t axes[3];
    for (int k = 0; k < nsp; k++)
        axes[k] = 2 + k;
    rfi_node *wt = rfi_ad_reverse(g, swap_kernel_features(g, w, groups), axes, nsp);
    conv_attrs t;
    memset(&t, 0, sizeof t);
    t.nsp = nsp;
    t.fgc = groups;
    t.bgc = 1;
    t.precision = c.precision; /* JAX's transpose rule: both gradients keep it */
    for (int k = 0; k < nsp; k++) {
        int64_t in_d = dilated(x->dims[2 + k], c.lhs_dil[k]);
        int64_t k_d = dilated(w->dims[2 + k], c.rhs_dil[k]);
        int64_t out_d = dilated(ct->dims[2 + k], c.stride[k]);
        t.stride[k] = c.lhs_dil[k];
        t.lhs_dil[k] = c.stride[k];
        t.rhs_dil[k] = c.rhs_dil[k];
        t.lo[k] = k_d - c.lo[k] - 1;
        t.hi[k] = in_d + k_d - 1 - out_d - t.lo[k];
    }
    rfi_node *dx = conv(g, ct, wt, t);
    if (c.bgc > 1 && dx) {
        /* [N/B, B*C, S] -> [B, N/B, C, S] -> [N, C, S] */
        int r = x->rank;
        int64_t split[RF_MAX_RANK + 1] = {dx->dims[0], c.bgc, x->dims[1]};
        int64_t perm[RF_MAX_RANK + 1] = {1, 0, 2};
        for (int k = 0; k < nsp; k++) {
            split[3 + k] = x->dims[2 + k];
            perm[3 + k] = 3 + k;
        }
        if (r + 1 > RF_MAX_RANK)
            return NULL;
        dx = rfi_ad_transpose(g, rfi_ad_reshape(g, dx, split, r + 1), perm);
        dx = rfi_ad_reshape(g, dx, x->dims, r);
    }
    return dx;
}

static rfi_node *conv_kernel_grad(rfi_graph *g, rfi_node *ct, rfi_node *x, rfi_node *w,
                                  conv_attrs c)
{
    conv_attrs t;
    memset(&t, 0, sizeof t);
    t.nsp = c.nsp;
    t.fgc = c.bgc > 1 ? c.bgc : 1;
    t.bgc = c.bgc > 1 ? 1 : c.fgc;
    t.precision = c.precision;
    for (int k = 0; k < c.nsp; k++) {
        int64_t in_d = dilated(x->dims[2 + k], c.lhs_dil[k]);
        int64_t k_d = dilated(w->dims[2 + k], c.rhs_dil[k]);
        int64_t out_d = dilated(ct->dims[2 + k], c.stride[k]);
        t.stride[k] = c.rhs_dil[k];
        t.lhs_dil[k] = c.lhs_dil[k];
        t.rhs_dil[k] = c.stride[k];
        t.lo[k] = c.lo[k];
        t.hi[k] = (out_d - in_d) + (k_d - c.lo[k] - 1);
    }
    /* x as [C, N, S] convolved with ct as kernel [O, N/B, Out] gives [C/G, O, K]. */
    rfi_node *ct_swapped = swap01(g, ct);
    return swap01(g, conv(g, swap01(g, x), ct_swapped, t));
}

rf_status rfi_vjp_convolution(const rfi_vjp_args *a, rfi_node **gr)
{
    conv_attrs c = conv_attrs_of(a->node);
    rfi_node *x = a->in[0], *w = a->in[1];
    if (c.bgc > 1 && c.fgc > 1)
        return rfi_error(RF_E_UNSUPPORTED,
                         "grad: convolution with both feature_group_count %lld and "
                         "batch_group_count %lld",
                         (long long)c.fgc, (long long)c.bgc);
    if (x->rank + 1 > RF_MAX_RANK && (c.fgc > 1 || c.bgc > 1))
        return rfi_error(RF_E_UNSUPPORTED,
                         "grad: grouped convolution of rank %d (at most %d)", x->rank,
                         RF_MAX_RANK - 1);
    /* an empty x: every window holds only padding */
    bool empty = rfi_node_numel(a->ct) == 0 || rfi_node_numel(x) == 0;
    if (a->want[0])
        gr[0] = empty ? rfi_ad_full_like(G, x, 0.0) : conv_input_grad(G, a->ct, x, w, c);
    if (a->want[1])
        gr[1] = empty ? rfi_ad_full_like(G, w, 0.0) : conv_kernel_grad(G, a->ct, x, w, c);
    return RF_OK;
}

/* ---- Windows ------------------------------------------------------------------------------ */

rf_status rfi_vjp_reduce_window(const rfi_vjp_args *a, rfi_node **gr)
{
    const rfi_attrs *at = &a->node->attr;
    rfi_node *x = a->in[0];
    int r = x->rank;
    const int64_t *win = at->l[0], *str = at->l[1], *lo = at->l[2], *hi = at->l[3];
    int kind = (int)at->i[0];
    if (rfi_node_numel(a->ct) == 0 || rfi_node_numel(x) == 0) {
        /* (an empty x's windows hold only padding: the rules below would
         * spread ct over fewer positions than one window) */
        gr[0] = rfi_ad_full_like(G, x, 0.0);
        return RF_OK;
    }
    if (kind == RF_REDUCE_SUM) {
        /* Spread ct back to the input positions: the transpose of a strided
         * window sum is a stride-1 window sum of ct dilated by the stride. */
        int64_t plo[RF_MAX_RANK], phi[RF_MAX_RANK], interior[RF_MAX_RANK];
        int64_t ones[RF_MAX_RANK], zeros[RF_MAX_RANK] = {0};
        for (int d = 0; d < r; d++) {
            int64_t out_d = dilated(a->ct->dims[d], str[d]);
            plo[d] = win[d] - lo[d] - 1;
            phi[d] = x->dims[d] + win[d] - 1 - out_d - plo[d];
            interior[d] = str[d] - 1;
            ones[d] = 1;
        }
        rfi_node *p = rfi_ad_pad(G, a->ct, rfi_ad_scalar(G, a->ct->dtype, 0.0), plo, phi,
                                 interior);
        gr[0] = rfi_ad_window_op(G, RFI_OP_REDUCE_WINDOW, &p, 1, RF_REDUCE_SUM, win, ones,
                                 zeros, zeros, r);
        return RF_OK;
    }
    if (kind == RF_REDUCE_MAX || kind == RF_REDUCE_MIN) {
        /* The first extreme of each window gets the window's ct; min is max of -x. */
        rfi_node *sel = kind == RF_REDUCE_MAX ? x : rfi_ad_unary(G, RFI_OP_NEG, x);
        rfi_node *in[2] = {sel, a->ct};
        gr[0] = rfi_ad_window_op(G, RFI_OP_SELECT_AND_SCATTER, in, 2, 0, win, str, lo, hi, r);
        return RF_OK;
    }
    return rfi_error(RF_E_UNSUPPORTED, "grad: reduce_window kind %d has no gradient", kind);
}

/* Largest window (in elements) whose select_and_scatter source gradient we unroll. */
#define MAX_WINDOW_ELEMS 256

rf_status rfi_vjp_select_and_scatter(const rfi_vjp_args *a, rfi_node **gr)
{
    /* x: the selection is piecewise constant, so x gets nothing (zero). */
    if (!a->want[1])
        return RF_OK;
    const rfi_attrs *at = &a->node->attr;
    rfi_node *x = a->in[0], *src = a->in[1];
    int r = x->rank;
    const int64_t *win = at->l[0], *str = at->l[1], *lo = at->l[2], *hi = at->l[3];
    int64_t n_offsets = 1;
    for (int d = 0; d < r; d++)
        n_offsets *= win[d];
    if (rfi_node_numel(src) == 0 || n_offsets == 0) {
        gr[1] = rfi_ad_full_like(G, src, 0.0);
        return RF_OK;
    }
    if (n_offsets > MAX_WINDOW_ELEMS)
        return rfi_error(RF_E_UNSUPPORTED,
                         "grad: select_and_scatter source gradient needs windows of at most %d "
                         "elements, got %lld",
                         MAX_WINDOW_ELEMS, (long long)n_offsets);
    /* source[w] receives ct at the element the forward op selects in window w: the
     * first maximum in row-major window order, a NaN above every number, padding
     * never. Walk the window offsets keeping the best value so far, its ct, and
     * whether a real (unpadded) element has been seen. */
    rfi_node *all = rfi_ad_full(G, RF_BOOL, x->dims, r, 1.0); /* in this order on any compiler */
    rfi_node *real = rfi_ad_pad(G, all, rfi_ad_scalar(G, RF_BOOL, 0.0), lo, hi, NULL);
    rfi_node *xp = rfi_ad_pad(G, x, rfi_ad_scalar(G, x->dtype, 0.0), lo, hi, NULL);
    rfi_node *cp = rfi_ad_pad(G, a->ct, rfi_ad_scalar(G, a->ct->dtype, 0.0), lo, hi, NULL);
    rfi_node *best = NULL, *val = NULL, *have = NULL;
    int64_t off[RF_MAX_RANK] = {0};
    for (int64_t k = 0; k < n_offsets; k++) {
        int64_t start[RF_MAX_RANK], limit[RF_MAX_RANK];
        for (int d = 0; d < r; d++) {
            start[d] = off[d];
            limit[d] = off[d] + (src->dims[d] - 1) * str[d] + 1;
        }
        rfi_node *xs = rfi_ad_slice(G, xp, start, limit, str);
        rfi_node *cs = rfi_ad_slice(G, cp, start, limit, str);
        rfi_node *rs = rfi_ad_slice(G, real, start, limit, str);
        if (k == 0) {
            best = xs, val = cs, have = rs; /* a padded cs is 0, as no selection gives */
        } else {
            rfi_node *xs_nan = rfi_ad_compare(G, xs, xs, RF_NE);
            rfi_node *best_number = rfi_ad_compare(G, best, best, RF_EQ);
            rfi_node *nan_over_number = rfi_ad_binary(G, RFI_OP_AND, xs_nan, best_number);
            rfi_node *better = rfi_ad_binary(G, RFI_OP_OR, rfi_ad_compare(G, xs, best, RF_GT),
                                             nan_over_number);
            rfi_node *take = rfi_ad_binary(
                G, RFI_OP_AND, rs,
                rfi_ad_binary(G, RFI_OP_OR, rfi_ad_unary(G, RFI_OP_NOT, have), better));
            best = rfi_ad_select(G, take, xs, best);
            val = rfi_ad_select(G, take, cs, val);
            have = rfi_ad_binary(G, RFI_OP_OR, have, rs);
        }
        for (int d = r - 1; d >= 0; d--) { /* next offset, row-major */
            if (++off[d] < win[d])
                break;
            off[d] = 0;
        }
    }
    gr[1] = val;
    return RF_OK;
}
