/* linalg.c: the interpreter's DOT_GENERAL with any batch and contracting dims
 * (CONVOLUTION lives in conv.c and is dispatched from here).
 *
 * The operands are packed into canonical layouts, lhs as [batch, M, K] and
 * rhs as [batch, K, N] (M, N: the free dims flattened, K: the contracting
 * dims flattened in the attribute's order), then one plain matrix product per
 * batch (contract.c) gives the result, whose layout [batch, lhs free, rhs
 * free] is exactly [batch, M, N]. Every result element is its dot product in
 * increasing contraction index, in double (float operands) or wrapping int64
 * (integer operands), rounded once; a product of RF_PRECISION_BF16 first
 * rounds its operands to bfloat16. Deliberately no BLAS or blocking.
 */
#include "interp.h"


/* Operand x visited with its dims in a chosen order: the layout pack() makes. */
typedef struct view {
    const rfi_node *x;
    int64_t xs[RF_MAX_RANK]; /* x's row-major strides */
    int rank;
    int64_t dims[RF_MAX_RANK], step[RF_MAX_RANK];
} view;

static view view_of(const rfi_node *x)
{
    view v = {.x = x};
    rfi_interp_strides(x->dims, x->rank, v.xs);
    return v;
}

/* Appends x's dims list[0..count) to the visiting order. */
static void view_add(view *v, const int64_t *list, int count)
{
    for (int k = 0; k < count; k++) {
        v->dims[v->rank] = v->x->dims[list[k]];
        v->step[v->rank] = v->xs[list[k]];
        v->rank++;
    }
}


/* Packs data (operand v->x) into d in v's row-major visiting order. */
static rf_status pack(rfi_dense *d, const view *v, const void *data)
{
    int64_t count = rfi_numel(v->dims, v->rank);
    int64_t *offsets = rfi_malloc((size_t)(count > 0 ? count : 1) * sizeof(int64_t));
    rf_status st = rfi_dense_alloc(d, rfi_dtype_is_float(v->x->dtype), count, "dot_general");
    if (!offsets && st == RF_OK)
        st = rfi_error(RF_E_NOMEM, "interp: dot_general: out of memory packing an operand");
    if (st == RF_OK) {
        rfi_interp_offsets(v->dims, v->step, v->rank, offsets);
        rfi_dense_gather(d, data, v->x->dtype, 0, offsets, count);
    }
    rfi_free(offsets);
    return st;
}

/* attr l[0] lhs batch, l[1] rhs batch, l[2] lhs contract, l[3] rhs contract. */
static rf_status dot_general(const rfi_node *n, const void *a_data, const void *b_data, void *out)
{
    const rfi_node *a = n->in[0], *b = n->in[1];
    const rfi_attrs *at = &n->attr;
    int nbatch = at->nl[0], ncontract = at->nl[2];
    int64_t a_free[RF_MAX_RANK], b_free[RF_MAX_RANK];
    int na_free = rfi_dot_free_dims(a->rank, at->l[0], nbatch, at->l[2], ncontract, a_free);
    int nb_free = rfi_dot_free_dims(b->rank, at->l[1], nbatch, at->l[3], ncontract, b_free);
    int64_t batch = rfi_numel(n->dims, nbatch);
    int64_t m = rfi_numel(n->dims + nbatch, na_free);
    int64_t nn = rfi_numel(n->dims + nbatch + na_free, nb_free);
    int64_t k = 1;
    for (int j = 0; j < ncontract; j++)
        k *= a->dims[at->l[2][j]];

    view lhs_view = view_of(a), rhs_view = view_of(b);
    view_add(&lhs_view, at->l[0], nbatch); /* lhs: [batch, M, K] */
    view_add(&lhs_view, a_free, na_free);
    view_add(&lhs_view, at->l[2], ncontract);
    view_add(&rhs_view, at->l[1], nbatch); /* rhs: [batch, K, N] */
    view_add(&rhs_view, at->l[3], ncontract);
    view_add(&rhs_view, b_free, nb_free);

    rfi_dense lhs = {0}, rhs = {0}, res = {0};
    rf_status st = pack(&lhs, &lhs_view, a_data);
    if (st == RF_OK)
        st = pack(&rhs, &rhs_view, b_data);
    if (st == RF_OK && rfi_dot_bf16(n)) {
        rfi_dense_round_bf16(&lhs, batch * m * k);
        rfi_dense_round_bf16(&rhs, batch * k * nn);
    }
    if (st == RF_OK)
        st = rfi_dense_alloc(&res, lhs.is_float, batch * m * nn, "dot_general");
    if (st == RF_OK) {
        for (int64_t q = 0; q < batch; q++)
            rfi_dense_matmul(&lhs, q * m * k, &rhs, q * k * nn, &res, q * m * nn, m, k, nn);
        rfi_dense_store(&res, 0, out, n->dtype, 0, batch * m * nn);
    }
    rfi_dense_free(&lhs);
    rfi_dense_free(&rhs);
    rfi_dense_free(&res);
    return st;
}

rf_status rfi_interp_linalg(const rfi_node *n, const void *const *in, void *out)
{
    switch (n->op) {
    case RFI_OP_DOT_GENERAL: return dot_general(n, in[0], in[1], out);
    case RFI_OP_CONVOLUTION: return rfi_interp_conv(n, in, out);
    default:
        return rfi_error(RF_E_INTERNAL, "interp: %s is not a contraction",
                         rfi_op_table[n->op].name);
    }
}
