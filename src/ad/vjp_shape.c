/* vjp_shape.c: VJP rules of the data-movement ops (broadcast_in_dim,
 * reshape, transpose, slice, concatenate, pad, reverse), of reduce, and of
 * the indexing ops gather and scatter_add. See the table in vjp.c.
 *
 * Deliberately not here: contractions and windowed ops (vjp_linalg.c).
 */
#include <string.h>

#include "ad/vjp.h"

#define G (a->g)

rf_status rfi_vjp_broadcast_in_dim(const rfi_vjp_args *a, rfi_node **gr)
{
    const rfi_node *x = a->in[0], *y = a->node;
    const int64_t *map = a->node->attr.l[0];
    /* Sum over result dims that x does not map, and over dims stretched from 1. */
    bool reduced[RF_MAX_RANK] = {false};
    for (int d = 0; d < y->rank; d++)
        reduced[d] = true;
    for (int i = 0; i < x->rank; i++)
        reduced[map[i]] = x->dims[i] == 1 && y->dims[map[i]] != 1;
    int64_t axes[RF_MAX_RANK];
    int naxes = 0;
    for (int d = 0; d < y->rank; d++)
        if (reduced[d])
            axes[naxes++] = d;
    rfi_node *s = rfi_ad_reduce(G, a->ct, RF_REDUCE_SUM, axes, naxes);

    /* The surviving dims are in result order; put them back in x's order. */
    int kept[RF_MAX_RANK], nkept = 0; /* x dims that survived, in x order */
    for (int i = 0; i < x->rank; i++)
        if (!reduced[map[i]])
            kept[nkept++] = i;
    int64_t perm[RF_MAX_RANK];
    for (int j = 0; j < nkept; j++) {
        int pos = 0;
        for (int k = 0; k < nkept; k++)
            pos += map[kept[k]] < map[kept[j]];
        perm[j] = pos;
    }
    s = rfi_ad_transpose(G, s, perm);
    gr[0] = rfi_ad_reshape(G, s, x->dims, x->rank);
    return RF_OK;
}

rf_status rfi_vjp_reshape(const rfi_vjp_args *a, rfi_node **gr)
{
    gr[0] = rfi_ad_reshape(G, a->ct, a->in[0]->dims, a->in[0]->rank);
    return RF_OK;
}

rf_status rfi_vjp_transpose(const rfi_vjp_args *a, rfi_node **gr)
{
    const int64_t *perm = a->node->attr.l[0];
    int64_t inv[RF_MAX_RANK];
    for (int i = 0; i < a->node->rank; i++)
        inv[perm[i]] = i;
    gr[0] = rfi_ad_transpose(G, a->ct, inv);
    return RF_OK;
}

rf_status rfi_vjp_slice(const rfi_vjp_args *a, rfi_node **gr)
{
    const rfi_node *x = a->in[0], *y = a->node;
    const int64_t *start = y->attr.l[0], *stride = y->attr.l[2];
    int64_t lo[RF_MAX_RANK], hi[RF_MAX_RANK], interior[RF_MAX_RANK];
    for (int d = 0; d < x->rank; d++) {
        if (y->dims[d] == 0) {
            lo[d] = x->dims[d];
            hi[d] = interior[d] = 0;
            continue;
        }
        lo[d] = start[d];
        interior[d] = stride[d] - 1;
        hi[d] = x->dims[d] - (start[d] + (y->dims[d] - 1) * stride[d] + 1);
    }
    gr[0] = rfi_ad_pad(G, a->ct, rfi_ad_scalar(G, a->ct->dtype, 0.0), lo, hi, interior);
    return RF_OK;
}

rf_status rfi_vjp_concatenate(const rfi_vjp_args *a, rfi_node **gr)
{
    const rfi_node *y = a->node;
    int axis = (int)y->attr.i[0];
    int64_t offset = 0;
    for (int i = 0; i < y->n_in; i++) {
        const rfi_node *x = a->in[i];
        if (a->want[i]) {
            int64_t start[RF_MAX_RANK] = {0}, limit[RF_MAX_RANK];
            memcpy(limit, y->dims, sizeof limit);
            start[axis] = offset;
            limit[axis] = offset + x->dims[axis];
            gr[i] = rfi_ad_slice(G, a->ct, start, limit, NULL);
        }
        offset += x->dims[axis];
    }
    return RF_OK;
}

rf_status rfi_vjp_pad(const rfi_vjp_args *a, rfi_node **gr)
{
    rfi_node *x = a->in[0];
    const rfi_node *y = a->node;
    const int64_t *lo = y->attr.l[0], *hi = y->attr.l[1], *interior = y->attr.l[2];
    rfi_node *zero = rfi_ad_scalar(G, a->ct->dtype, 0.0);
    if (a->want[0]) {
        /* Undo negative edges (crops) first, so every element of x has a slot. */
        int64_t ulo[RF_MAX_RANK], uhi[RF_MAX_RANK];
        int64_t start[RF_MAX_RANK], limit[RF_MAX_RANK], step[RF_MAX_RANK];
        for (int d = 0; d < x->rank; d++) {
            ulo[d] = lo[d] < 0 ? -lo[d] : 0;
            uhi[d] = hi[d] < 0 ? -hi[d] : 0;
            start[d] = lo[d] > 0 ? lo[d] : 0;
            step[d] = interior[d] + 1;
            limit[d] = x->dims[d] ? start[d] + (x->dims[d] - 1) * step[d] + 1 : start[d];
        }
        rfi_node *full = rfi_ad_pad(G, a->ct, zero, ulo, uhi, NULL);
        gr[0] = rfi_ad_slice(G, full, start, limit, step);
    }
    if (a->want[1]) {
        /* The value lands where the pad of zeros-of-x with 1 gives 1. */
        rfi_node *one = rfi_ad_scalar(G, a->ct->dtype, 1.0);
        rfi_node *mask = rfi_ad_pad(G, rfi_ad_full(G, a->ct->dtype, x->dims, x->rank, 0.0), one,
                                    lo, hi, interior);
        gr[1] = rfi_ad_sum_all(G, rfi_ad_binary(G, RFI_OP_MUL, a->ct, mask));
    }
    return RF_OK;
}

rf_status rfi_vjp_reverse(const rfi_vjp_args *a, rfi_node **gr)
{
    gr[0] = rfi_ad_reverse(G, a->ct, a->node->attr.l[0], a->node->attr.nl[0]);
    return RF_OK;
}

/* ---- Reduce ---------------------------------------------------------------------------- */

/* max/min: ct split equally among the positions equal to the result (JAX's rule). */
static rfi_node *reduce_chooser_grad(const rfi_vjp_args *a, const int64_t *axes, int naxes)
{
    rfi_node *x = a->in[0];
    rfi_node *y_b = rfi_ad_unreduce(G, a->out, x->dims, x->rank, axes, naxes);
    rfi_node *hit = rfi_ad_compare(G, x, y_b, RF_EQ);
    rfi_node *count = rfi_ad_reduce(G, rfi_ad_convert(G, hit, x->dtype), RF_REDUCE_SUM, axes,
                                    naxes);
    rfi_node *share = rfi_ad_binary(G, RFI_OP_DIV, a->ct, count);
    return rfi_ad_mask(G, hit, rfi_ad_unreduce(G, share, x->dims, x->rank, axes, naxes));
}

/* prod: d/dx_i = product of the other elements, exact also with zeros:
 * no zero in the group: prod / x_i; one zero: the product of the rest at the
 * zero, 0 elsewhere; more zeros: 0. */
static rfi_node *reduce_prod_grad(const rfi_vjp_args *a, const int64_t *axes, int naxes)
{
    rfi_node *x = a->in[0];
    const int64_t *dims = x->dims;
    int rank = x->rank;
    rfi_node *zero = rfi_ad_full_like(G, x, 0.0), *one = rfi_ad_full_like(G, x, 1.0);
    rfi_node *is0 = rfi_ad_compare(G, x, zero, RF_EQ);
    rfi_node *safe = rfi_ad_select(G, is0, one, x);
    rfi_node *prod_nz = rfi_ad_reduce(G, safe, RF_REDUCE_PROD, axes, naxes);
    rfi_node *n0 = rfi_ad_reduce(G, rfi_ad_convert(G, is0, x->dtype), RF_REDUCE_SUM, axes, naxes);
    rfi_node *prod_nz_b = rfi_ad_unreduce(G, prod_nz, dims, rank, axes, naxes);
    rfi_node *n0_b = rfi_ad_unreduce(G, n0, dims, rank, axes, naxes);
    rfi_node *no_zero = rfi_ad_compare(G, n0_b, zero, RF_EQ);
    rfi_node *one_zero = rfi_ad_compare(G, n0_b, one, RF_EQ);
    rfi_node *at_nonzero = rfi_ad_mask(G, no_zero, rfi_ad_binary(G, RFI_OP_DIV, prod_nz_b, safe));
    rfi_node *at_zero = rfi_ad_mask(G, one_zero, prod_nz_b);
    rfi_node *d = rfi_ad_select(G, is0, at_zero, at_nonzero);
    rfi_node *ct_b = rfi_ad_unreduce(G, a->ct, dims, rank, axes, naxes);
    return rfi_ad_binary(G, RFI_OP_MUL, ct_b, d);
}

rf_status rfi_vjp_reduce(const rfi_vjp_args *a, rfi_node **gr)
{
    const rfi_node *x = a->in[0];
    const int64_t *axes = a->node->attr.l[0];
    int naxes = a->node->attr.nl[0];
    switch ((int)a->node->attr.i[0]) {
    case RF_REDUCE_SUM:
        gr[0] = rfi_ad_unreduce(G, a->ct, x->dims, x->rank, axes, naxes);
        return RF_OK;
    case RF_REDUCE_MAX:
    case RF_REDUCE_MIN:
        gr[0] = reduce_chooser_grad(a, axes, naxes);
        return RF_OK;
    case RF_REDUCE_PROD:
        gr[0] = reduce_prod_grad(a, axes, naxes);
        return RF_OK;
    default:
        return rfi_error(RF_E_UNSUPPORTED, "grad: reduce kind %d has no gradient",
                         (int)a->node->attr.i[0]);
    }
}

/* ---- Indexing -------------------------------------------------------------------------- */

rf_status rfi_vjp_gather(const rfi_vjp_args *a, rfi_node **gr)
{
    rfi_node *x = a->in[0], *idx = a->in[1];
    int64_t axis = a->node->attr.i[0];
    /* gather clamps its indices; scatter_add drops out-of-range ones: clamp first. */
    int64_t top = x->dims[axis] > 0 ? x->dims[axis] - 1 : 0;
    rfi_node *clamped = rfi_ad_binary(G, RFI_OP_MAX, idx, rfi_ad_full_like(G, idx, 0.0));
    clamped = rfi_ad_binary(G, RFI_OP_MIN, clamped, rfi_ad_full_like(G, idx, (double)top));
    rfi_node *zeros = rfi_ad_full_like(G, x, 0.0);
    gr[0] = rfi_ad_scatter_add(G, zeros, clamped, a->ct, axis);
    return RF_OK;
}

rf_status rfi_vjp_scatter_add(const rfi_vjp_args *a, rfi_node **gr)
{
    rfi_node *x = a->in[0], *idx = a->in[1], *upd = a->in[2];
    int64_t axis = a->node->attr.i[0];
    gr[0] = a->ct;
    if (a->want[2]) {
        /* Updates at out-of-range indices were dropped: they get zero. */
        rfi_node *ge0 = rfi_ad_compare(G, idx, rfi_ad_full_like(G, idx, 0.0), RF_GE);
        rfi_node *lt = rfi_ad_compare(G, idx, rfi_ad_full_like(G, idx, (double)x->dims[axis]),
                                      RF_LT);
        rfi_node *valid = rfi_ad_binary(G, RFI_OP_AND, ge0, lt);
        int64_t map[RF_MAX_RANK];
        for (int i = 0; i < idx->rank; i++)
            map[i] = axis + i;
        rfi_node *valid_b = rfi_ad_broadcast(G, valid, upd->dims, upd->rank,
                                             idx->rank ? map : NULL);
        gr[2] = rfi_ad_mask(G, valid_b, rfi_ad_gather(G, a->ct, idx, axis));
    }
    return RF_OK;
}
