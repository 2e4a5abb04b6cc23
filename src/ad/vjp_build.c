/* vjp_build.c: small IR builders for the VJP rules: constants, elementwise
 * nodes, broadcasts and reductions, slicing and padding, written directly
 * over rfi_node_new so the emitted IR is exactly what the rule means (the
 * public op layer would broadcast, re-type weak scalars and normalise axes).
 *
 * Deliberately not here: any differentiation logic (vjp*.c, autodiff.c).
 * Builders never inspect a NULL operand: they return NULL and let the graph's
 * sticky error (or the earlier failure) tell the caller.
 */
#include <string.h>

#include "ad/vjp.h"
#include "ir/api.h"

static rfi_node *node(rfi_graph *g, rfi_op op, rfi_node *const *in, int n_in,
                      const rfi_attrs *attr)
{
    return rfi_node_new(g, op, in, n_in, attr, RF_F32, NULL, 0);
}

static bool any_null(rfi_node *const *in, int n)
{
    for (int i = 0; i < n; i++)
        if (!in[i])
            return true;
    return false;
}

static void set_list(rfi_attrs *at, int k, const int64_t *v, int n)
{
    at->nl[k] = n;
    for (int i = 0; i < n; i++)
        at->l[k][i] = v[i];
}

rfi_node *rfi_ad_scalar(rfi_graph *g, rf_dtype dt, double v)
{
    return rfi_node_scalar(g, dt, v);
}

rfi_node *rfi_ad_full(rfi_graph *g, rf_dtype dt, const int64_t *dims, int rank, double v)
{
    rfi_node *s = rfi_ad_scalar(g, dt, v);
    if (rank == 0)
        return s;
    return rfi_ad_broadcast(g, s, dims, rank, NULL);
}

rfi_node *rfi_ad_full_like(rfi_graph *g, const rfi_node *x, double v)
{
    if (!x)
        return NULL;
    return rfi_ad_full(g, x->dtype, x->dims, x->rank, v);
}

rfi_node *rfi_ad_unary(rfi_graph *g, rfi_op op, rfi_node *x)
{
    return node(g, op, &x, 1, NULL);
}

rfi_node *rfi_ad_binary(rfi_graph *g, rfi_op op, rfi_node *a, rfi_node *b)
{
    rfi_node *in[2] = {a, b};
    return node(g, op, in, 2, NULL);
}

rfi_node *rfi_ad_scale(rfi_graph *g, rfi_node *x, double v)
{
    if (!x)
        return NULL;
    return rfi_ad_binary(g, RFI_OP_MUL, x, rfi_ad_full_like(g, x, v));
}

rfi_node *rfi_ad_compare(rfi_graph *g, rfi_node *a, rfi_node *b, int cmp)
{
    rfi_attrs at;
    memset(&at, 0, sizeof at);
    at.i[0] = cmp;
    rfi_node *in[2] = {a, b};
    return node(g, RFI_OP_COMPARE, in, 2, &at);
}

rfi_node *rfi_ad_select(rfi_graph *g, rfi_node *pred, rfi_node *a, rfi_node *b)
{
    rfi_node *in[3] = {pred, a, b};
    return node(g, RFI_OP_SELECT, in, 3, NULL);
}

rfi_node *rfi_ad_mask(rfi_graph *g, rfi_node *pred, rfi_node *x)
{
    if (!x)
        return NULL;
    return rfi_ad_select(g, pred, x, rfi_ad_full_like(g, x, 0.0));
}

rfi_node *rfi_ad_convert(rfi_graph *g, rfi_node *x, rf_dtype dt)
{
    if (!x)
        return NULL;
    if (x->dtype == dt)
        return x;
    return rfi_node_new(g, RFI_OP_CONVERT, &x, 1, NULL, dt, NULL, 0);
}

rfi_node *rfi_ad_broadcast(rfi_graph *g, rfi_node *x, const int64_t *dims, int rank,
                           const int64_t *map)
{
    if (!x)
        return NULL;
    rfi_attrs at;
    memset(&at, 0, sizeof at);
    set_list(&at, 0, map, map ? x->rank : 0);
    return rfi_node_new(g, RFI_OP_BROADCAST_IN_DIM, &x, 1, &at, x->dtype, dims, rank);
}

rfi_node *rfi_ad_unreduce(rfi_graph *g, rfi_node *x, const int64_t *dims, int rank,
                          const int64_t *axes, int naxes)
{
    if (!x)
        return NULL;
    if (naxes == 0)
        return x;
    int64_t map[RF_MAX_RANK];
    int k = 0, j = 0;
    for (int d = 0; d < rank; d++) {
        if (j < naxes && axes[j] == d) {
            j++;
            continue;
        }
        map[k++] = d;
    }
    return rfi_ad_broadcast(g, x, dims, rank, k ? map : NULL);
}

rfi_node *rfi_ad_reshape(rfi_graph *g, rfi_node *x, const int64_t *dims, int rank)
{
    if (!x)
        return NULL;
    if (x->rank == rank && memcmp(x->dims, dims, (size_t)rank * sizeof *dims) == 0)
        return x;
    return rfi_node_new(g, RFI_OP_RESHAPE, &x, 1, NULL, x->dtype, dims, rank);
}

rfi_node *rfi_ad_transpose(rfi_graph *g, rfi_node *x, const int64_t *perm)
{
    if (!x)
        return NULL;
    bool identity = true;
    for (int i = 0; i < x->rank; i++)
        identity = identity && perm[i] == i;
    if (identity)
        return x;
    rfi_attrs at;
    memset(&at, 0, sizeof at);
    set_list(&at, 0, perm, x->rank);
    return node(g, RFI_OP_TRANSPOSE, &x, 1, &at);
}

rfi_node *rfi_ad_reduce(rfi_graph *g, rfi_node *x, int kind, const int64_t *axes, int naxes)
{
    if (!x)
        return NULL;
    if (naxes == 0)
        return x;
    rfi_attrs at;
    memset(&at, 0, sizeof at);
    at.i[0] = kind;
    set_list(&at, 0, axes, naxes);
    return node(g, RFI_OP_REDUCE, &x, 1, &at);
}

rfi_node *rfi_ad_sum_all(rfi_graph *g, rfi_node *x)
{
    if (!x)
        return NULL;
    int64_t axes[RF_MAX_RANK];
    for (int i = 0; i < x->rank; i++)
        axes[i] = i;
    return rfi_ad_reduce(g, x, RF_REDUCE_SUM, axes, x->rank);
}

rfi_node *rfi_ad_slice(rfi_graph *g, rfi_node *x, const int64_t *start, const int64_t *limit,
                       const int64_t *stride)
{
    if (!x)
        return NULL;
    int64_t ones[RF_MAX_RANK];
    bool whole = true;
    for (int i = 0; i < x->rank; i++) {
        ones[i] = 1;
        int64_t s = stride ? stride[i] : 1;
        whole = whole && start[i] == 0 && limit[i] == x->dims[i] && s == 1;
    }
    if (whole)
        return x;
    rfi_attrs at;
    memset(&at, 0, sizeof at);
    set_list(&at, 0, start, x->rank);
    set_list(&at, 1, limit, x->rank);
    set_list(&at, 2, stride ? stride : ones, x->rank);
    return node(g, RFI_OP_SLICE, &x, 1, &at);
}

rfi_node *rfi_ad_pad(rfi_graph *g, rfi_node *x, rfi_node *v, const int64_t *lo,
                     const int64_t *hi, const int64_t *interior)
{
    rfi_node *in[2] = {x, v};
    if (any_null(in, 2))
        return NULL;
    int64_t zeros[RF_MAX_RANK] = {0};
    bool none = true;
    for (int i = 0; i < x->rank; i++)
        none = none && lo[i] == 0 && hi[i] == 0 && (!interior || interior[i] == 0);
    if (none)
        return x;
    rfi_attrs at;
    memset(&at, 0, sizeof at);
    set_list(&at, 0, lo, x->rank);
    set_list(&at, 1, hi, x->rank);
    set_list(&at, 2, interior ? interior : zeros, x->rank);
    return node(g, RFI_OP_PAD, in, 2, &at);
}

rfi_node *rfi_ad_concat(rfi_graph *g, rfi_node *const *xs, int n, int axis)
{
    if (any_null(xs, n))
        return NULL;
    rfi_attrs at;
    memset(&at, 0, sizeof at);
    at.i[0] = axis;
    return rfi_node_new(g, RFI_OP_CONCATENATE, xs, n, &at, xs[0]->dtype, NULL, 0);
}

rfi_node *rfi_ad_reverse(rfi_graph *g, rfi_node *x, const int64_t *axes, int naxes)
{
    if (!x)
        return NULL;
    if (naxes == 0)
        return x;
    rfi_attrs at;
    memset(&at, 0, sizeof at);
    set_list(&at, 0, axes, naxes);
    return node(g, RFI_OP_REVERSE, &x, 1, &at);
}

rfi_node *rfi_ad_dot(rfi_graph *g, rfi_node *a, rfi_node *b, const int64_t *lb,
                     const int64_t *rb, int nb, const int64_t *lc, const int64_t *rc, int nc,
                     int64_t precision)
{
    rfi_attrs at;
    memset(&at, 0, sizeof at);
    at.i[0] = precision;
    set_list(&at, 0, lb, nb);
    set_list(&at, 1, rb, nb);
    set_list(&at, 2, lc, nc);
    set_list(&at, 3, rc, nc);
    rfi_node *in[2] = {a, b};
    return node(g, RFI_OP_DOT_GENERAL, in, 2, &at);
}

rfi_node *rfi_ad_gather(rfi_graph *g, rfi_node *x, rfi_node *idx, int64_t axis)
{
    rfi_attrs at;
    memset(&at, 0, sizeof at);
    at.i[0] = axis;
    rfi_node *in[2] = {x, idx};
    return node(g, RFI_OP_GATHER, in, 2, &at);
}

rfi_node *rfi_ad_scatter_add(rfi_graph *g, rfi_node *x, rfi_node *idx, rfi_node *upd,
                             int64_t axis)
{
    rfi_attrs at;
    memset(&at, 0, sizeof at);
    at.i[0] = axis;
    rfi_node *in[3] = {x, idx, upd};
    return node(g, RFI_OP_SCATTER_ADD, in, 3, &at);
}

rfi_node *rfi_ad_window_op(rfi_graph *g, rfi_op op, rfi_node *const *in, int n_in, int kind,
                           const int64_t *window, const int64_t *strides, const int64_t *lo,
                           const int64_t *hi, int rank)
{
    rfi_attrs at;
    memset(&at, 0, sizeof at);
    at.i[0] = kind;
    set_list(&at, 0, window, rank);
    set_list(&at, 1, strides, rank);
    set_list(&at, 2, lo, rank);
    set_list(&at, 3, hi, rank);
    return node(g, op, in, n_in, &at);
}

bool rfi_ad_same_type(const rfi_node *x, const rfi_node *y)
{
    return x->dtype == y->dtype && x->rank == y->rank &&
           memcmp(x->dims, y->dims, (size_t)x->rank * sizeof x->dims[0]) == 0;
}
