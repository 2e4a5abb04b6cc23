/* conv.c: f32 CONVOLUTION (every form of the IR's op: strides, low/high
 * padding including negative, lhs and rhs dilation, feature_group_count G or
 * batch_group_count B, any number >= 1 of spatial dims) as im2col packing
 * plus one oneDNN matmul per chunk of images, all created at prepare time.
 *
 * Semantics are those of the reference kernel (src/backend/interp/conv.c):
 * x [N, C, in...], w [O, C/G, k...], result [N/B, O, out...]; result
 * (n, o, p) = sum over ci, q of x[bg*(N/B) + n, fg*(C/G) + ci, i] * w[o, ci, q]
 * with i = p*stride + q*rhs_dil - pad_lo in the lhs-dilated, padded input.
 *
 * With S = max(G, B) groups of M = O/S output features, group s reading
 * channel block s (G > 1) or image block s (B > 1), a chunk of I output
 * images is packed as col [I, S, C/G*K, P] (rows (ci, q), one column per
 * output position p; zero where the source is padding or a dilation hole),
 * and the product w [1, S, M, C/G*K] x col = [I, S, M, P] is exactly the
 * result rows of those images, contiguous: no scatter. Packing runs on the
 * runtime's thread pool, row by row, with the last spatial dim as a
 * contiguous run (a memcpy at stride 1, padding skipped by bounds computed
 * once per row). Chunks are sized so col fits the workspace budget.
 *
 * When oneDNN's own convolution takes the form and the kernel is small (the
 * rule at direct_eligible), that primitive runs instead, on plain layouts
 * (setting RF_CONV_IM2COL in the environment before prepare forces im2col:
 * for tests and benchmarks).
 *
 * Deliberately not here: G > 1 together with B > 1 (no gradient produces it;
 * the services run the reference kernel), non-f32 dtypes, zero spatial dims.
 */
#include <stdlib.h>
#include <string.h>

#include "../../runtime/threadpool.h"
#include "services.h"

#define COL_BUDGET_BYTES ((size_t)32 << 20) /* the most col memory one chunk uses */

struct rfi_cpu_conv {
    const rfi_node *node;
    int nsp;
    int64_t groups, fgc, bgc;       /* S, G, B */
    int64_t cin, k_count, p_count;  /* C/G, K, P */
    int64_t rows, m, out_batch, out_feat;
    int64_t x_image, x_chan;        /* x's strides of dims 0 and 1 */
    int64_t in_sp[RF_MAX_RANK], in_step[RF_MAX_RANK], k_sp[RF_MAX_RANK], out_sp[RF_MAX_RANK];
    int64_t stride[RF_MAX_RANK], pad_lo[RF_MAX_RANK], lhs_dil[RF_MAX_RANK], rhs_dil[RF_MAX_RANK];
    int64_t chunk, tail;            /* images per full chunk, in the last chunk */
    bool empty;                     /* nothing to compute (zeros or no elements) */
    rfi_dnnl_mm full, last;         /* products for a full chunk and the last one */
    bool direct;                    /* oneDNN's convolution primitive instead (in `full`) */
    size_t col_at;                  /* workspace offset of col (after the scratchpad) */
};

const char *rfi_cpu_conv_path(const rfi_cpu_conv *c) { return c->direct ? "direct" : "im2col"; }

/* ---- im2col -------------------------------------------------------------------------- */

/* Source index of output position p with kernel offset qoff = q*rhs_dil - pad_lo
 * in spatial dim d, or -1 (padding or dilation hole). */
static inline int64_t source_index(const rfi_cpu_conv *c, int d, int64_t p, int64_t qoff)
{
    int64_t pos = p * c->stride[d] + qoff;
    if (pos < 0)
        return -1;
    int64_t ld = c->lhs_dil[d];
    if (ld != 1) {
        if (pos % ld != 0)
            return -1;
        pos /= ld;
    }
    return pos < c->in_sp[d] ? pos : -1;
}

/* One run of the last spatial dim: dst[p] = src[index(p)] or 0. */
static void fill_run(const rfi_cpu_conv *c, float *restrict dst, const float *restrict src,
                     int64_t qoff)
{
    int d = c->nsp - 1;
    int64_t len = c->out_sp[d], st = c->stride[d], in = c->in_sp[d];
    if (c->lhs_dil[d] != 1) {
        for (int64_t p = 0; p < len; p++) {
            int64_t i = source_index(c, d, p, qoff);
            dst[p] = i < 0 ? 0.0f : src[i];
        }
        return;
    }
    /* valid p: 0 <= p*st + qoff < in */
    int64_t lo = qoff >= 0 ? 0 : (-qoff + st - 1) / st;
    int64_t hi = in - 1 - qoff >= 0 ? (in - 1 - qoff) / st + 1 : 0;
    if (hi > len)
        hi = len;
    if (lo > hi)
        lo = hi;
    for (int64_t p = 0; p < lo; p++)
        dst[p] = 0.0f;
    if (st == 1 && hi - lo >= 32) {
        memcpy(dst + lo, src + lo + qoff, (size_t)(hi - lo) * sizeof(float));
    } else if (st == 1) { /* short runs: a call to memcpy costs more than the copy */
        for (int64_t p = lo; p < hi; p++)
            dst[p] = src[p + qoff];
    } else {
        for (int64_t p = lo; p < hi; p++)
            dst[p] = src[p * st + qoff];
    }
    for (int64_t p = hi; p < len; p++)
        dst[p] = 0.0f;
}

/* Row (ci, kernel position qi) of col for one image and channel: P values. */
static void fill_row(const rfi_cpu_conv *c, float *restrict dst, const float *restrict chan,
                     int64_t qi)
{
    int nsp = c->nsp, last = nsp - 1;
    int64_t qoff[RF_MAX_RANK];
    for (int d = nsp - 1; d >= 0; d--) {
        int64_t q = qi % c->k_sp[d];
        qi /= c->k_sp[d];
        qoff[d] = q * c->rhs_dil[d] - c->pad_lo[d];
    }
    int64_t run = c->out_sp[last];
    int64_t outer = c->p_count / (run > 0 ? run : 1);
    int64_t p[RF_MAX_RANK] = {0};
    for (int64_t o = 0; o < outer; o++, dst += run) {
        int64_t offset = 0;
        bool valid = true;
        for (int d = 0; d < last && valid; d++) {
            int64_t i = source_index(c, d, p[d], qoff[d]);
            valid = i >= 0;
            offset += i * c->in_step[d];
        }
        if (valid)
            fill_run(c, dst, chan + offset, qoff[last]);
        else
            memset(dst, 0, (size_t)run * sizeof(float));
        for (int d = last - 1; d >= 0; d--) {
            if (++p[d] < c->out_sp[d])
                break;
            p[d] = 0;
        }
    }
}

typedef struct im2col_job {
    const rfi_cpu_conv *c;
    const float *x;
    float *col;
    int64_t first_image; /* output image of col's first block */
} im2col_job;

/* Rows [lo, hi) of col, numbered (image, group, ci, q) row-major. */
static void im2col_rows(void *ctx, int64_t lo, int64_t hi)
{
    const im2col_job *job = ctx;
    const rfi_cpu_conv *c = job->c;
    for (int64_t r = lo; r < hi; r++) {
        int64_t qi = r % c->k_count, t = r / c->k_count;
        int64_t ci = t % c->cin;
        t /= c->cin;
        int64_t s = t % c->groups, img = t / c->groups;
        int64_t bg = c->bgc > 1 ? s : 0, fg = c->fgc > 1 ? s : 0;
        int64_t image = bg * c->out_batch + job->first_image + img;
        const float *chan = job->x + image * c->x_image + (fg * c->cin + ci) * c->x_chan;
        fill_row(c, job->col + r * c->p_count, chan, qi);
    }
}

/* ---- prepare / run ----------------------------------------------------------------- */

static bool read_shape(rfi_cpu_conv *c, const rfi_node *n)
{
    const rfi_node *x = n->in[0], *w = n->in[1];
    const rfi_attrs *at = &n->attr;
    c->nsp = x->rank - 2;
    c->fgc = at->i[0] > 0 ? at->i[0] : 1;
    c->bgc = at->i[1] > 0 ? at->i[1] : 1;
    if (c->nsp < 1 || (c->fgc > 1 && c->bgc > 1))
        return false;
    c->groups = c->fgc > 1 ? c->fgc : c->bgc;
    c->cin = w->dims[1];
    c->out_batch = n->dims[0];
    c->out_feat = n->dims[1];
    c->m = c->out_feat / c->groups;
    int64_t step = 1;
    for (int d = c->nsp - 1; d >= 0; d--) {
        c->in_sp[d] = x->dims[2 + d];
        c->in_step[d] = step;
        step *= x->dims[2 + d];
        c->k_sp[d] = w->dims[2 + d];
        c->out_sp[d] = n->dims[2 + d];
        c->stride[d] = at->l[0][d];
        c->pad_lo[d] = at->l[1][d];
        c->lhs_dil[d] = at->l[3][d] > 0 ? at->l[3][d] : 1;
        c->rhs_dil[d] = at->l[4][d];
    }
    c->x_chan = step;
    c->x_image = step * x->dims[1];
    c->k_count = rfi_numel(c->k_sp, c->nsp);
    c->p_count = rfi_numel(c->out_sp, c->nsp);
    c->rows = c->cin * c->k_count;
    c->empty = rfi_node_numel(n) == 0 || c->rows == 0;
    return true;
}

/* The product for a chunk of `images` output images. */
static rf_status make_product(const rfi_cpu_conv *c, rfi_dnnl_mm *mm, dnnl_engine_t eng,
                              int64_t images)
{
    int64_t S = c->groups, M = c->m, R = c->rows, P = c->p_count;
    rfi_dnnl_tensor src = {4, {1, S, M, R}, {S * M * R, M * R, R, 1}};
    rfi_dnnl_tensor wei = {4, {images, S, R, P}, {S * R * P, R * P, P, 1}};
    rfi_dnnl_tensor dst = {4, {images, S, M, P}, {S * M * P, M * P, P, 1}};
    return rfi_dnnl_mm_init(mm, eng, &src, &wei, &dst, "convolution");
}

/* ---- oneDNN's convolution primitive ------------------------------------------------ */

/* The rule for the direct path: oneDNN's convolution takes the form (no lhs
 * dilation, no batch groups, no negative padding, at most 3 spatial dims), and
 * the kernel is small: the backward-weights convolutions the autodiff emits
 * have image-sized kernels, where oneDNN's direct kernels are slower than
 * im2col (measured with bench/bench_services.c). */
#define DIRECT_MAX_KERNEL 49

static bool direct_eligible(const rfi_cpu_conv *c)
{
    if (c->bgc > 1 || c->nsp > 3 || c->k_count > DIRECT_MAX_KERNEL)
        return false;
    const rfi_attrs *at = &c->node->attr;
    for (int d = 0; d < c->nsp; d++)
        if (c->lhs_dil[d] != 1 || at->l[1][d] < 0 || at->l[2][d] < 0)
            return false;
    return true;
}

static void plain_md(dnnl_memory_desc_t *md, int ndims, const int64_t *dims, dnnl_status_t *st)
{
    dnnl_dims_t d = {0}, strides = {0};
    int64_t step = 1;
    for (int k = ndims - 1; k >= 0; k--) {
        d[k] = dims[k];
        strides[k] = step;
        step *= dims[k];
    }
    if (*st == dnnl_success)
        *st = dnnl_memory_desc_init_by_strides(md, ndims, d, dnnl_f32, strides);
}

/* Creates the convolution primitive with plain layouts (NC<sp>, [G]OI<sp>);
 * false (and nothing kept) if oneDNN refuses it or only has its reference. */
static bool make_direct(rfi_cpu_conv *c, dnnl_engine_t eng)
{
    const rfi_node *n = c->node, *x = n->in[0], *w = n->in[1];
    const rfi_attrs *at = &n->attr;
    dnnl_memory_desc_t s_md, w_md, d_md;
    dnnl_status_t st = dnnl_success;
    plain_md(&s_md, x->rank, x->dims, &st);
    plain_md(&d_md, n->rank, n->dims, &st);
    int64_t wd[RF_MAX_RANK + 1];
    int wr = w->rank;
    if (c->fgc > 1) {
        wd[0] = c->fgc;
        wd[1] = w->dims[0] / c->fgc;
        for (int k = 1; k < w->rank; k++)
            wd[k + 1] = w->dims[k];
        wr++;
    } else {
        memcpy(wd, w->dims, (size_t)w->rank * sizeof(int64_t));
    }
    plain_md(&w_md, wr, wd, &st);
    dnnl_dims_t strides = {0}, dilates = {0}, lo = {0}, hi = {0};
    for (int d = 0; d < c->nsp; d++) {
        strides[d] = c->stride[d];
        dilates[d] = c->rhs_dil[d] - 1;
        lo[d] = at->l[1][d];
        hi[d] = at->l[2][d];
    }
    dnnl_convolution_desc_t desc;
    if (st == dnnl_success)
        st = dnnl_dilated_convolution_forward_desc_init(&desc, dnnl_forward_inference,
                                                        dnnl_convolution_direct, &s_md, &w_md,
                                                        NULL, &d_md, strides, dilates, lo, hi);
    dnnl_primitive_attr_t attr = NULL;
    dnnl_primitive_desc_t pd = NULL;
    if (st == dnnl_success)
        st = dnnl_primitive_attr_create(&attr);
    if (st == dnnl_success)
        st = dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user);
    if (st == dnnl_success)
        st = dnnl_primitive_desc_create(&pd, &desc, attr, eng, NULL);
    if (attr)
        dnnl_primitive_attr_destroy(attr);
    if (st != dnnl_success)
        return false;
    rfi_dnnl_mm *mm = &c->full;
    const char *impl = NULL;
    bool ref = dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl) == dnnl_success &&
               impl && strncmp(impl, "ref", 3) == 0;
    const dnnl_memory_desc_t *sp_md = dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    mm->scratch_bytes = sp_md ? dnnl_memory_desc_get_size(sp_md) : 0;
    st = ref ? dnnl_unimplemented : dnnl_primitive_create(&mm->prim, pd);
    if (st == dnnl_success)
        st = dnnl_memory_create(&mm->src, &s_md, eng, DNNL_MEMORY_NONE);
    if (st == dnnl_success)
        st = dnnl_memory_create(&mm->wei, &w_md, eng, DNNL_MEMORY_NONE);
    if (st == dnnl_success)
        st = dnnl_memory_create(&mm->dst, &d_md, eng, DNNL_MEMORY_NONE);
    if (st == dnnl_success && mm->scratch_bytes > 0)
        st = dnnl_memory_create(&mm->scratch, sp_md, eng, DNNL_MEMORY_NONE);
    dnnl_primitive_desc_destroy(pd);
    if (st != dnnl_success) {
        rfi_dnnl_mm_destroy(mm);
        return false;
    }
    return true;
}

rf_status rfi_cpu_conv_prepare(const rfi_node *n, dnnl_engine_t eng, rfi_cpu_conv **out,
                               size_t *workspace_bytes)
{
    *out = NULL;
    *workspace_bytes = 0;
    if (n->op != RFI_OP_CONVOLUTION || n->n_in != 2 || n->dtype != RF_F32 ||
        n->in[0]->dtype != RF_F32 || n->in[1]->dtype != RF_F32)
        return RF_E_UNSUPPORTED;
    rfi_cpu_conv *c = rfi_calloc(1, sizeof *c);
    if (!c)
        return rfi_error(RF_E_NOMEM, "cpu: convolution: out of memory");
    c->node = n;
    if (!read_shape(c, n)) {
        rfi_free(c);
        return RF_E_UNSUPPORTED;
    }
    if (c->empty) {
        *out = c;
        return RF_OK;
    }
    if (direct_eligible(c) && !getenv("RF_CONV_IM2COL") && make_direct(c, eng)) {
        c->direct = true;
        *workspace_bytes = c->full.scratch_bytes;
        *out = c;
        return RF_OK;
    }
    size_t image_bytes = (size_t)(c->groups * c->rows * c->p_count) * sizeof(float);
    int64_t chunk = (int64_t)(COL_BUDGET_BYTES / image_bytes);
    c->chunk = chunk < 1 ? 1 : chunk > c->out_batch ? c->out_batch : chunk;
    c->tail = c->out_batch % c->chunk;
    rf_status st = make_product(c, &c->full, eng, c->chunk);
    if (st == RF_OK && c->tail > 0)
        st = make_product(c, &c->last, eng, c->tail);
    if (st != RF_OK) {
        rfi_cpu_conv_free(c);
        return st;
    }
    size_t scratch = c->full.scratch_bytes > c->last.scratch_bytes ? c->full.scratch_bytes
                                                                   : c->last.scratch_bytes;
    c->col_at = rfi_ws_align(scratch);
    *workspace_bytes = c->col_at + rfi_ws_align(image_bytes * (size_t)c->chunk);
    *out = c;
    return RF_OK;
}

rf_status rfi_cpu_conv_run(rfi_cpu_conv *c, dnnl_stream_t s, const void *x, const void *w,
                           void *out, void *workspace)
{
    if (c->empty) {
        size_t bytes = rfi_node_nbytes(c->node);
        if (bytes > 0)
            memset(out, 0, bytes);
        return RF_OK;
    }
    if (c->direct)
        return rfi_dnnl_mm_run(&c->full, s, x, w, out, workspace, "convolution");
    float *col = (float *)((char *)workspace + c->col_at);
    int64_t row_grain = 16384 / (c->p_count > 0 ? c->p_count : 1) + 1;
    for (int64_t first = 0; first < c->out_batch; first += c->chunk) {
        int64_t images = c->out_batch - first < c->chunk ? c->out_batch - first : c->chunk;
        im2col_job job = {c, x, col, first};
        rfi_parallel_for(images * c->groups * c->rows, row_grain, im2col_rows, &job);
        rfi_dnnl_mm *mm = images == c->chunk ? &c->full : &c->last;
        float *dst = (float *)out + first * c->out_feat * c->p_count;
        rf_status st = rfi_dnnl_mm_run(mm, s, w, col, dst, workspace, "convolution");
        if (st != RF_OK)
            return st;
    }
    return RF_OK;
}

void rfi_cpu_conv_free(rfi_cpu_conv *c)
{
    if (!c)
        return;
    rfi_dnnl_mm_destroy(&c->full);
    rfi_dnnl_mm_destroy(&c->last);
    rfi_free(c);
}
