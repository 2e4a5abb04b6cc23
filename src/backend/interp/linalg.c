/* linalg.c: the interpreter's contractions: DOT_GENERAL with any batch and
 * contracting dims, and CONVOLUTION (NC<spatial> input, OI<spatial> kernel)
 * with strides, low/high padding, lhs (input) and rhs (kernel) dilation,
 * feature_group_count and batch_group_count, for any number of spatial dims.
 *
 * Every result element is one sum computed from scratch in double (float
 * operands) or wrapping int64 (integer operands) and rounded once. Deliberately
 * naive: no blocking, no im2col, no BLAS; this is the oracle.
 */
#include "interp.h"

/* A running sum of products in the operands' arithmetic. */
typedef struct dot_sum {
    bool is_float;
    double f;
    int64_t i;
} dot_sum;

static void dot_add(dot_sum *s, const void *a, rf_dtype at, int64_t ai, const void *b,
                    rf_dtype bt, int64_t bi)
{
    if (s->is_float)
        s->f += rfi_ld_f(a, at, ai) * rfi_ld_f(b, bt, bi);
    else
        s->i = rfi_wadd(s->i, rfi_wmul(rfi_ld_i(a, at, ai), rfi_ld_i(b, bt, bi)));
}

static void dot_store(const dot_sum *s, void *out, rf_dtype dt, int64_t k)
{
    if (s->is_float)
        rfi_st_f(out, dt, k, s->f);
    else
        rfi_st_i(out, dt, k, s->i);
}

/* ---- DOT_GENERAL -------------------------------------------------------------------- *
 * attr l[0] lhs batch, l[1] rhs batch, l[2] lhs contract, l[3] rhs contract.
 * Result dims: batch dims (lhs order), lhs free dims, rhs free dims. */

/* The dims of x in neither list a nor list b, in order. */
static int free_dims(const rfi_node *x, const int64_t *a, int na, const int64_t *b, int nb,
                     int *out)
{
    int n = 0;
    for (int d = 0; d < x->rank; d++) {
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

static void dot_general(const rfi_node *n, const void *a_data, const void *b_data, void *out)
{
    const rfi_node *a = n->in[0], *b = n->in[1];
    const rfi_attrs *at = &n->attr;
    int nbatch = at->nl[0], ncontract = at->nl[2];
    int a_free[RF_MAX_RANK], b_free[RF_MAX_RANK];
    int na_free = free_dims(a, at->l[0], nbatch, at->l[2], ncontract, a_free);
    int nb_free = free_dims(b, at->l[1], nbatch, at->l[3], ncontract, b_free);
    int64_t as[RF_MAX_RANK], bs[RF_MAX_RANK];
    rfi_interp_strides(a->dims, a->rank, as);
    rfi_interp_strides(b->dims, b->rank, bs);

    /* The contraction: its dims and the operand strides along them. */
    int64_t c_dims[RF_MAX_RANK], c_astep[RF_MAX_RANK], c_bstep[RF_MAX_RANK];
    for (int k = 0; k < ncontract; k++) {
        c_dims[k] = a->dims[at->l[2][k]];
        c_astep[k] = as[at->l[2][k]];
        c_bstep[k] = bs[at->l[3][k]];
    }
    int64_t c_count = rfi_numel(c_dims, ncontract);

    int64_t out_count = rfi_interp_numel(n);
    int64_t o[RF_MAX_RANK] = {0};
    for (int64_t k = 0; k < out_count; k++) {
        /* result index = (batch..., a free..., b free...) */
        int64_t a_base = 0, b_base = 0;
        for (int j = 0; j < nbatch; j++) {
            a_base += o[j] * as[at->l[0][j]];
            b_base += o[j] * bs[at->l[1][j]];
        }
        for (int j = 0; j < na_free; j++)
            a_base += o[nbatch + j] * as[a_free[j]];
        for (int j = 0; j < nb_free; j++)
            b_base += o[nbatch + na_free + j] * bs[b_free[j]];

        dot_sum s = {rfi_dtype_is_float(a->dtype), 0, 0};
        int64_t c[RF_MAX_RANK] = {0};
        for (int64_t j = 0; j < c_count; j++) {
            int64_t ai = a_base, bi = b_base;
            for (int d = 0; d < ncontract; d++) {
                ai += c[d] * c_astep[d];
                bi += c[d] * c_bstep[d];
            }
            dot_add(&s, a_data, a->dtype, ai, b_data, b->dtype, bi);
            rfi_interp_next(c, c_dims, ncontract);
        }
        dot_store(&s, out, n->dtype, k);
        rfi_interp_next(o, n->dims, n->rank);
    }
}

/* ---- CONVOLUTION --------------------------------------------------------------------- *
 * attr l[0] stride, l[1] pad_lo, l[2] pad_hi, l[3] lhs_dilation, l[4] rhs_dilation
 * (one entry per spatial dim), i[0] feature_group_count G, i[1] batch_group_count B.
 * x [N, C, in...], w [O, C/G, k...], result [N/B, O, out...].
 * Result (n, o, p...) = sum over ci < C/G and kernel positions q... of
 *   x[bg*(N/B) + n, fg*(C/G) + ci, i...] * w[o, ci, q...]
 * where bg = o / (O/B), fg = o / (O/G), and in each spatial dim the position
 * p*stride + q*rhs_dil - pad_lo of the lhs-dilated input must fall on an input
 * element: i = that / lhs_dil (else it is a hole or padding and adds nothing). */

/* The input offset (spatial part) for result position p and kernel position q,
 * or -1 if it falls on padding or a dilation hole. */
static int64_t conv_source(const rfi_node *n, const int64_t *xs, const int64_t *p,
                           const int64_t *q)
{
    const rfi_node *x = n->in[0];
    const rfi_attrs *at = &n->attr;
    int64_t offset = 0;
    for (int d = 0; d < x->rank - 2; d++) {
        int64_t pos = p[d] * at->l[0][d] + q[d] * at->l[4][d] - at->l[1][d];
        int64_t lhs_dil = at->l[3][d] > 0 ? at->l[3][d] : 1;
        if (pos < 0 || pos % lhs_dil != 0 || pos / lhs_dil >= x->dims[2 + d])
            return -1;
        offset += (pos / lhs_dil) * xs[2 + d];
    }
    return offset;
}

static void convolution(const rfi_node *n, const void *x_data, const void *w_data, void *out)
{
    const rfi_node *x = n->in[0], *w = n->in[1];
    int nsp = x->rank - 2;
    int64_t groups = n->attr.i[0] > 0 ? n->attr.i[0] : 1;
    int64_t batch_groups = n->attr.i[1] > 0 ? n->attr.i[1] : 1;
    int64_t out_batch = n->dims[0], out_feat = n->dims[1];
    int64_t cin_per_group = w->dims[1];
    int64_t xs[RF_MAX_RANK], ws[RF_MAX_RANK], os[RF_MAX_RANK];
    rfi_interp_strides(x->dims, x->rank, xs);
    rfi_interp_strides(w->dims, w->rank, ws);
    rfi_interp_strides(n->dims, n->rank, os);
    const int64_t *out_sp = n->dims + 2, *k_sp = w->dims + 2;
    int64_t out_sp_count = rfi_numel(out_sp, nsp), k_count = rfi_numel(k_sp, nsp);

    for (int64_t b = 0; b < out_batch; b++) {
        for (int64_t o = 0; o < out_feat; o++) {
            int64_t xb = (o / (out_feat / batch_groups)) * out_batch + b;
            int64_t c0 = (o / (out_feat / groups)) * cin_per_group;
            int64_t p[RF_MAX_RANK] = {0};
            for (int64_t pi = 0; pi < out_sp_count; pi++) {
                dot_sum s = {rfi_dtype_is_float(x->dtype), 0, 0};
                for (int64_t ci = 0; ci < cin_per_group; ci++) {
                    int64_t q[RF_MAX_RANK] = {0};
                    for (int64_t qi = 0; qi < k_count; qi++) {
                        int64_t src = conv_source(n, xs, p, q);
                        if (src >= 0)
                            dot_add(&s, x_data, x->dtype, xb * xs[0] + (c0 + ci) * xs[1] + src,
                                    w_data, w->dtype, o * ws[0] + ci * ws[1] + qi);
                        rfi_interp_next(q, k_sp, nsp);
                    }
                }
                dot_store(&s, out, n->dtype, b * os[0] + o * os[1] + pi);
                rfi_interp_next(p, out_sp, nsp);
            }
        }
    }
}

rf_status rfi_interp_linalg(const rfi_node *n, const void *const *in, void *out)
{
    switch (n->op) {
    case RFI_OP_DOT_GENERAL: dot_general(n, in[0], in[1], out); return RF_OK;
    case RFI_OP_CONVOLUTION: convolution(n, in[0], in[1], out); return RF_OK;
    default:
        return rfi_error(RF_E_INTERNAL, "interp: %s is not a contraction",
                         rfi_op_table[n->op].name);
    }
}
