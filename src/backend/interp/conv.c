/* conv.c: the interpreter's CONVOLUTION (NC<spatial> input, OI<spatial>
 * kernel) with strides, low/high padding, lhs (input) and rhs (kernel)
 * dilation, feature_group_count and batch_group_count, any number of spatial
 * dims, computed as explicit im2col packing followed by a matrix product.
 *
 * attr l[0] stride, l[1] pad_lo, l[2] pad_hi, l[3] lhs_dilation, l[4]
 * rhs_dilation (one entry per spatial dim), i[0] feature_group_count G,
 * i[1] batch_group_count B, i[2] precision (RF_PRECISION_BF16: the operands
 * rounded to bfloat16 first). x [N, C, in...], w [O, C/G, k...], result
 * [N/B, O, out...]. Result (n, o, p...) = sum over ci < C/G and kernel
 * positions q... of x[bg*(N/B) + n, fg*(C/G) + ci, i...] * w[o, ci, q...]
 * where bg = o / (O/B), fg = o / (O/G), and in each spatial dim i is the
 * position p*stride + q*rhs_dil - pad_lo of the zero-padded, lhs-dilated
 * input (a padding position or dilation hole contributes 0 * w).
 *
 * For one input image and channel group the patches form a matrix
 * col[(ci, q), p] (C/G * kernel rows, one column per output position); the
 * result rows of the output features o sharing that image and group are then
 * w[o, (ci, q)] x col, i.e. [O', C/G*K] x [C/G*K, P], contiguous in the
 * result. Sums run over (ci, q) in row-major order in double (float) or
 * wrapping int64 (integer), rounded once. Deliberately no BLAS or blocking.
 */
#include "interp.h"

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

/* The sizes of the im2col product. */
typedef struct conv_shape {
    int64_t cin;       /* C/G: input channels per group */
    int64_t k_count;   /* kernel positions K */
    int64_t p_count;   /* output positions P */
    int64_t rows;      /* C/G * K: the contraction length */
    int64_t groups;    /* G */
    int64_t b_groups;  /* B */
    int64_t xs[RF_MAX_RANK];
} conv_shape;

static conv_shape shape_of(const rfi_node *n)
{
    const rfi_node *x = n->in[0], *w = n->in[1];
    int nsp = x->rank - 2;
    conv_shape s;
    s.cin = w->dims[1];
    s.k_count = rfi_numel(w->dims + 2, nsp);
    s.p_count = rfi_numel(n->dims + 2, nsp);
    s.rows = s.cin * s.k_count;
    s.groups = n->attr.i[0] > 0 ? n->attr.i[0] : 1;
    s.b_groups = n->attr.i[1] > 0 ? n->attr.i[1] : 1;
    rfi_interp_strides(x->dims, x->rank, s.xs);
    return s;
}

/* offsets[(ci*K + q)*P + p]: where col[(ci, q), p] is read from, relative to the
 * first channel of the image and group, or -1 for padding. The same for every
 * image and group, so it is computed once. */
static void col_offsets(const rfi_node *n, const conv_shape *s, int64_t *offsets)
{
    int nsp = n->in[0]->rank - 2;
    const int64_t *k_sp = n->in[1]->dims + 2, *out_sp = n->dims + 2;
    int64_t q[RF_MAX_RANK] = {0};
    for (int64_t qi = 0; qi < s->k_count; qi++) {
        int64_t p[RF_MAX_RANK] = {0};
        for (int64_t pi = 0; pi < s->p_count; pi++) {
            int64_t src = conv_source(n, s->xs, p, q);
            for (int64_t ci = 0; ci < s->cin; ci++)
                offsets[(ci * s->k_count + qi) * s->p_count + pi] =
                    src < 0 ? -1 : ci * s->xs[1] + src;
            rfi_interp_next(p, out_sp, nsp);
        }
        rfi_interp_next(q, k_sp, nsp);
    }
}

/* Working memory of one convolution. */
typedef struct conv_work {
    int64_t *offsets; /* col_offsets */
    rfi_dense w;      /* the kernel as [O, C/G*K] */
    rfi_dense col;    /* patches of one image and group: [C/G*K, P] */
    rfi_dense res;    /* result rows of one image and group: [O/G, P] at most */
} conv_work;

static void work_free(conv_work *cw)
{
    rfi_free(cw->offsets);
    rfi_dense_free(&cw->w);
    rfi_dense_free(&cw->col);
    rfi_dense_free(&cw->res);
}

static rf_status work_alloc(conv_work *cw, const rfi_node *n, const conv_shape *s,
                            const void *w_data)
{
    const rfi_node *w = n->in[1];
    bool is_float = rfi_dtype_is_float(n->in[0]->dtype);
    int64_t out_feat = n->dims[1], col_count = s->rows * s->p_count;
    int64_t max_block = out_feat / s->groups; /* the longest run of features per group */
    cw->offsets = rfi_malloc((size_t)(col_count > 0 ? col_count : 1) * sizeof(int64_t));
    if (!cw->offsets)
        return rfi_error(RF_E_NOMEM, "interp: convolution: out of memory for %lld offsets",
                         (long long)col_count);
    rf_status st = rfi_dense_alloc(&cw->w, is_float, out_feat * s->rows, "convolution");
    if (st == RF_OK)
        st = rfi_dense_alloc(&cw->col, is_float, col_count, "convolution");
    if (st == RF_OK)
        st = rfi_dense_alloc(&cw->res, is_float, max_block * s->p_count, "convolution");
    if (st != RF_OK)
        return st;
    col_offsets(n, s, cw->offsets);
    if (is_float) {
        rfi_interp_load_f(w_data, w->dtype, 0, out_feat * s->rows, cw->w.f);
        if (rfi_conv_bf16(n))
            rfi_dense_round_bf16(&cw->w, out_feat * s->rows);
    } else
        rfi_interp_load_i(w_data, w->dtype, 0, out_feat * s->rows, cw->w.i);
    return RF_OK;
}

rf_status rfi_interp_conv(const rfi_node *n, const void *const *in, void *out)
{
    const rfi_node *x = n->in[0];
    conv_shape s = shape_of(n);
    int64_t out_batch = n->dims[0], out_feat = n->dims[1];
    int64_t per_bgroup = out_feat / s.b_groups, per_group = out_feat / s.groups;
    conv_work cw = {0};
    rf_status st = work_alloc(&cw, n, &s, in[1]);
    int64_t packed_image = -1, packed_group = -1;
    for (int64_t b = 0; b < out_batch && st == RF_OK; b++) {
        /* runs of output features [o0, o1) reading the same image and channel group */
        for (int64_t o0 = 0, o1; o0 < out_feat; o0 = o1) {
            int64_t bg = o0 / per_bgroup, fg = o0 / per_group;
            int64_t run_end_b = (bg + 1) * per_bgroup, run_end_f = (fg + 1) * per_group;
            o1 = run_end_b < run_end_f ? run_end_b : run_end_f;
            int64_t image = bg * out_batch + b;
            if (image != packed_image || fg != packed_group) {
                int64_t base = image * s.xs[0] + fg * s.cin * s.xs[1];
                rfi_dense_gather(&cw.col, in[0], x->dtype, base, cw.offsets, s.rows * s.p_count);
                if (rfi_conv_bf16(n))
                    rfi_dense_round_bf16(&cw.col, s.rows * s.p_count);
                packed_image = image;
                packed_group = fg;
            }
            rfi_dense_matmul(&cw.w, o0 * s.rows, &cw.col, 0, &cw.res, 0, o1 - o0, s.rows,
                             s.p_count);
            rfi_dense_store(&cw.res, 0, out, n->dtype, (b * out_feat + o0) * s.p_count,
                            (o1 - o0) * s.p_count);
        }
    }
    work_free(&cw);
    return st;
}
