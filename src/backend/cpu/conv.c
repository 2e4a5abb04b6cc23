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
 * When one of oneDNN's convolutions computes the form exactly, it runs
 * instead (choose_dnnl_path): its backward-weights for the weight-gradient
 * form the autodiff emits (image-sized kernel; with B batch groups, the
 * weight gradient of a grouped or depthwise convolution, its grouped
 * backward-weights; with lhs dilation, that of a transposed convolution, the
 * operands' roles swapped and the result reversed after the call), its
 * forward for small kernels (grouped too), its
 * backward-data for lhs-dilated forms (the input gradient of a strided
 * convolution, grouped too), each in its preferred blocked layouts with
 * reorders from and to the plain buffers. (im2col ran the depthwise weight
 * gradient of 64 channels, 32 images of 32x32, as one product per group with
 * a 1024-position kernel: 100-190 ms; oneDNN's depthwise kernel 1.2-1.7 ms.)
 * 3x3 forms with enough channels (and, for backward-data, whole 4x4 tiles)
 * use oneDNN's Winograd algorithm instead of its direct one (winograd_wanted:
 * measured faster there, and its rounding error stays within the tests' 1e-5
 * bound relative to sum |x||w|). Where
 * oneDNN has no Winograd kernels (below AVX-512), 3x3 stride-1 forms and 3x3
 * weight gradients with enough channels run winograd.c's own instead
 * (own_winograd_wanted). RF_CONV_PATH (im2col, forward, bwd-weights,
 * bwd-data, winograd) in the environment before prepare forces a path (if
 * the form allows it; else im2col): for tests and benchmarks.
 *
 * A buffer the plan keeps channel-blocked (plan.h) is described to oneDNN
 * as such (rfi_cpu_conv_laid_out): no reorder at all when that is the
 * primitive's own layout.
 *
 * A CALL step's epilogue (plan.h) runs inside oneDNN's forward convolution
 * when that path is taken and accepts it: a leading per-channel bias as the
 * primitive's bias input, the rest as post-ops (a residual as a binary add of
 * a dst-shaped tensor, tanh as eltwise; failing that, the bias too as a
 * binary add of a [1, O, 1...] tensor; failing that, the bias input alone),
 * but never a relu or a logistic or what follows them (rfi_dnnl_post_faithful). The
 * services apply the ops the primitive does not (rfi_cpu_conv_epilogue_ops)
 * after the call.
 *
 * A convolution of RF_PRECISION_BF16 (the IR's attribute) runs one of
 * oneDNN's bf16 convolutions where oneDNN has one with bf16 instructions
 * for the form: the reorders of both inputs into its layouts convert them
 * to bf16, rounding as rfi_round_bf16 does, and the result stays f32 (oneDNN
 * has Winograd in f32 only). Elsewhere (or with RF_BF16_KERNELS=0) both
 * inputs are rounded into f32 copies in the workspace and the path is
 * chosen among the f32 ones as for an f32 convolution (`rounds`): the same
 * numbers at f32 speed, plus a pass over the inputs.
 *
 * Deliberately not here: G > 1 together with B > 1 (no gradient produces it;
 * the services run the reference kernel), non-f32 dtypes, zero spatial dims.
 */
#include <stdlib.h>
#include <string.h>

#include "../../runtime/threadpool.h"
#include "services.h"
#include "table_reorder.h"
#include "winograd.h"

#define COL_BUDGET_BYTES ((size_t)32 << 20) /* the most col memory one chunk uses */
/* Forward convolutions with larger kernels go to im2col: oneDNN's direct
 * kernels are slower there (measured with bench/bench_services.c). */
#define DIRECT_MAX_KERNEL 49
/* Fewer channels than this: oneDNN convolutions run on the plain layouts. */
#define BLOCKED_MIN_CHANNELS 8
/* A forward from fewer than BLOCKED_MIN_CHANNELS to at least this many is a
 * first layer: blocked output (try_path). */
#define FIRST_LAYER_MIN_OUT 16
/* A forward with at least this many channels on both sides runs as oneDNN's
 * training kind (try_path). */
#define TRAINING_KIND_MIN_CHANNELS 16
/* Fewer channels than this: no Winograd (winograd_wanted). */
#define WINOGRAD_MIN_CHANNELS 32
/* ... nor fewer 4x4 tiles over the batch than these (forward and input
 * gradient, weight gradient): a small batch of small images (a ResNet's last
 * stage in an evaluation's last batch) runs faster direct. */
#define WINOGRAD_MIN_TILES 64
#define WINOGRAD_MIN_TILES_BWD_WEIGHTS 32
/* winograd.c's forward and input-gradient form takes fewer (own_winograd_wanted). */
#define OWN_WINOGRAD_MIN_CHANNELS 16
/* ... where its result has enough 4x4 tiles (over the batch), mostly filled
 * (rfi_winograd_rule: a ResNet's last stages at batch 1 are one tile an image). */
#define OWN_WINOGRAD_MIN_TILES 32
#define OWN_WINOGRAD_MIN_FILL 0.5

enum { PATH_IM2COL, PATH_FORWARD, PATH_BWD_WEIGHTS, PATH_BWD_DATA, PATH_OWN_WINOGRAD };

/* One tensor argument of a oneDNN convolution: the user memory over the IR
 * buffer and, when the primitive wants another layout, its memory in the
 * workspace and the reorder (user -> inner for inputs, inner -> user for the
 * output). */
typedef struct conv_arg {
    int arg; /* DNNL_ARG_* */
    dnnl_memory_t user, inner;
    dnnl_primitive_t reorder;
    rfi_table_reorder table; /* instead of reorder, for a kernel (table_reorder.h) */
    size_t at; /* workspace offset of inner */
    dnnl_memory_desc_t user_md, inner_md;
    /* Inputs only, set by rfi_cpu_conv_share_input: inner lives in `shared`
     * (not the workspace), and this call fills it (fills) or finds it
     * filled by an earlier call of the step. */
    void *shared;
    bool fills;
    bool swapped; /* the IR buffer holds this tensor with dims 0 and 1 swapped */
} conv_arg;

typedef struct dnnl_conv {
    dnnl_primitive_t prim;
    conv_arg args[3]; /* IR operands 0 and 1, then the result */
    dnnl_memory_t scratch;
    rfi_dnnl_post post;               /* post-ops (forward only; post.n == 0: none) */
    dnnl_memory_t post_mem[RFI_EPI_MAX];
    /* Forward only: the epilogue's first op, a per-channel BIAS, is the
     * primitive's own bias input (bias_mem) and post covers the ops after it. */
    dnnl_memory_t bias_mem;
} dnnl_conv;

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
    size_t col_at;                  /* workspace offset of col (after the scratchpad) */
    int path;                       /* PATH_*: im2col or one of oneDNN's convolutions */
    bool winograd;                  /* that convolution is oneDNN's Winograd */
    dnnl_conv dc;                   /* the oneDNN convolution (PATH_FORWARD.. PATH_BWD_DATA) */
    rfi_winograd *own;              /* winograd.c's (PATH_OWN_WINOGRAD) */
    const rfi_epi_op *epi;          /* the step's epilogue (prepare time only) */
    int n_epi;
    bool views[2];                  /* operand k's buffer holds it with dims 0, 1 swapped */
    size_t pack_at, dnnl_workspace; /* packed kernel (bwd-data); workspace of dc */
    bool flipped;                   /* dc writes the result spatially reversed (flip_kernel) */
    size_t flip_at;                 /* flipped: where dc writes it in the workspace */
    rfi_layout layouts[3];          /* the buffers' layouts (plan.h): operands 0, 1, result */
    bool laid_out[3];               /* dc reads or writes that buffer in its layout */
    bool bf16;                      /* RF_PRECISION_BF16 (see the header comment) */
    bool rounds;                    /* bf16 on an f32 path: inputs rounded into the workspace */
    size_t round_at[2];             /* rounds: where the rounded copies of x and w go */
};

const char *rfi_cpu_conv_path(const rfi_cpu_conv *c)
{
    /* [f32, bf16, bf16 rounded][winograd][path]: static, as callers keep them */
    static const char *const names[3][2][4] = {
        {{"im2col", "forward", "bwd-weights", "bwd-data"},
         {"im2col", "forward-winograd", "bwd-weights-winograd", "bwd-data-winograd"}},
        {{"im2col bf16", "forward bf16", "bwd-weights bf16", "bwd-data bf16"},
         {"im2col bf16", "forward bf16", "bwd-weights bf16", "bwd-data bf16"}},
        {{"im2col bf16-rounded", "forward bf16-rounded", "bwd-weights bf16-rounded",
          "bwd-data bf16-rounded"},
         {"im2col bf16-rounded", "forward-winograd bf16-rounded",
          "bwd-weights-winograd bf16-rounded", "bwd-data-winograd bf16-rounded"}},
    };
    if (!c->empty && c->path == PATH_OWN_WINOGRAD)
        return rfi_winograd_path(c->own, c->rounds);
    return names[!c->bf16 || c->empty ? 0 : c->rounds ? 2 : 1][c->winograd][c->path];
}

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
    return rfi_dnnl_mm_init(mm, eng, &src, &wei, &dst, NULL, "convolution");
}

/* ---- oneDNN's convolution primitives --------------------------------------------- *
 * Three exact mappings of the IR's convolution onto oneDNN (derivations in
 * the comments of each spec_* function), each created with the primitive's
 * preferred (blocked) layouts and reorders from and to the IR's plain
 * buffers, which are described as strided tensors so that a transposed view
 * (the weight-gradient form reads x and the cotangent with N and C swapped)
 * costs nothing beyond the reorder the blocked layout needs anyway. */

/* One tensor of a oneDNN convolution as the IR's buffer holds it. */
typedef struct tensor_spec {
    int ndims;
    dnnl_dims_t dims, strides;
    bool swapped; /* the buffer holds [dims[1], dims[0], rest...] */
} tensor_spec;

typedef struct dnnl_conv_spec {
    int kind;            /* PATH_FORWARD, PATH_BWD_WEIGHTS, PATH_BWD_DATA */
    tensor_spec t[3];    /* inputs 0, 1 (IR operand order), output */
    int arg[3];          /* DNNL_ARG_* of each */
    /* The forward convolution's src, weights, dst among t (hint and desc order). */
    int src, wei, dst;
    dnnl_dims_t strides, dilates, pad_l, pad_r;
    bool any[3]; /* the primitive picks this tensor's layout (else the buffer's) */
    dnnl_alg_kind_t alg; /* dnnl_convolution_direct or _winograd */
    bool training;       /* a forward path as oneDNN's training kind (else inference) */
    bool bf16;           /* inputs t[0], t[1] as bf16 (the output stays f32) */
    bool flipped;        /* the output is the result with its spatial dims reversed */
} dnnl_conv_spec;

/* Plain row-major strides for dims, optionally with dims 0 and 1 of the
 * buffer swapped (swap01: the buffer holds [dims[1], dims[0], rest...]). */
static tensor_spec make_tensor(int ndims, const int64_t *dims, bool swap01)
{
    tensor_spec t;
    memset(&t, 0, sizeof t);
    t.ndims = ndims;
    int64_t buf[RF_MAX_RANK + 1], bstride[RF_MAX_RANK + 1];
    for (int k = 0; k < ndims; k++) {
        t.dims[k] = dims[k];
        buf[k] = dims[k];
    }
    if (swap01) {
        buf[0] = dims[1];
        buf[1] = dims[0];
    }
    int64_t step = 1;
    for (int k = ndims - 1; k >= 0; k--) {
        bstride[k] = step;
        step *= buf[k];
    }
    for (int k = 0; k < ndims; k++)
        t.strides[k] = bstride[k];
    if (swap01) {
        t.strides[0] = bstride[1];
        t.strides[1] = bstride[0];
    }
    t.swapped = swap01;
    return t;
}

static bool all_nonnegative(const int64_t *v, int n)
{
    for (int d = 0; d < n; d++)
        if (v[d] < 0)
            return false;
    return true;
}

/* Forward: the IR op itself (no lhs dilation, no batch groups, padding >= 0):
 * src x, weights w ([G, O/G, C/G, k...] when G > 1), dst the result. */
static bool spec_forward(const rfi_cpu_conv *c, dnnl_conv_spec *sp)
{
    const rfi_node *n = c->node, *x = n->in[0], *w = n->in[1];
    const rfi_attrs *at = &n->attr;
    if (c->bgc > 1 || !all_nonnegative(at->l[1], c->nsp) || !all_nonnegative(at->l[2], c->nsp))
        return false;
    for (int d = 0; d < c->nsp; d++)
        if (c->lhs_dil[d] != 1)
            return false;
    sp->kind = PATH_FORWARD;
    sp->t[0] = make_tensor(x->rank, x->dims, false);
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
    sp->t[1] = make_tensor(wr, wd, false);
    sp->t[2] = make_tensor(n->rank, n->dims, false);
    sp->arg[0] = DNNL_ARG_SRC;
    sp->arg[1] = DNNL_ARG_WEIGHTS;
    sp->arg[2] = DNNL_ARG_DST;
    sp->src = 0, sp->wei = 1, sp->dst = 2;
    for (int d = 0; d < c->nsp; d++) {
        sp->strides[d] = c->stride[d];
        sp->dilates[d] = c->rhs_dil[d] - 1;
        sp->pad_l[d] = at->l[1][d];
        sp->pad_r[d] = at->l[2][d];
    }
    return true;
}

/* Weight gradient: the IR conv(lhs [C, N, in...], rhs [O, N, out...]) =
 * [C, O, k...] (G = B = 1, no lhs dilation, pad_lo >= 0) is
 *   res[c, o, q] = sum_{n, p} lhs[c, n, q*s + p*r - lo] * rhs[o, n, p]
 * (s its stride, r its rhs dilation, zero outside the input), which is
 * oneDNN's backward-weights of a forward convolution with src x = lhs with
 * dims 0, 1 swapped, diff_dst = rhs swapped, diff_weights = res swapped,
 * stride r, dilation s, pad_l lo, and pad_r just wide enough for the
 * positions the sum reads (all of them inside the IR's padded extent).
 *
 * The weight gradient of a grouped convolution (G groups) is the same form
 * with B = G batch groups (StableHLO's): lhs [C, N, in...], rhs [O, N,
 * out...], res [C/B, O, k...] with
 *   res[c, o, q] = sum_{n, p} lhs[b*(C/B) + c, n, q*s + p*r - lo] * rhs[o, n, p]
 * for o in output block b = o / (O/B). That is oneDNN's grouped
 * backward-weights with B groups over the same src and diff_dst (group b
 * reads src channels b*(C/B).. and diff_dst channels b*(O/B)..), whose
 * diff_weights [B, O/B, C/B, k...] is res seen through strides: element
 * (b, o', c, q) at res[c, b*(O/B) + o', q] (grouped_result). */
static tensor_spec grouped_result(const rfi_cpu_conv *c, bool swapped_roles)
{
    const rfi_node *n = c->node;
    int64_t b = c->bgc, o = n->dims[1], k = c->p_count; /* the result's spatial positions */
    tensor_spec t;
    memset(&t, 0, sizeof t);
    t.ndims = n->rank + 1;
    t.dims[0] = b;
    t.strides[0] = o / b * k;
    /* [B, O/B, C/B, k...], or with the roles swapped (spec_bwd_weights_swapped)
     * [B, C/B, O/B, k...] */
    int at_o = swapped_roles ? 2 : 1, at_c = swapped_roles ? 1 : 2;
    t.dims[at_o] = o / b;
    t.strides[at_o] = k;
    t.dims[at_c] = n->dims[0];
    t.strides[at_c] = o * k;
    int64_t step = 1;
    for (int d = c->nsp - 1; d >= 0; d--) {
        t.dims[3 + d] = n->dims[2 + d];
        t.strides[3 + d] = step;
        step *= n->dims[2 + d];
    }
    return t; /* (a dim more than the result's buffer: arg_tag leaves it row-major) */
}

/* Both operands of a weight-gradient form ([C, N, ...] in the IR) as oneDNN's
 * [N, C, ...] tensors, transposed views of their buffers (a view holds [N, C, ...]
 * itself). */
static void batch_major_operands(const rfi_cpu_conv *c, dnnl_conv_spec *sp)
{
    const rfi_node *x = c->node->in[0], *w = c->node->in[1];
    int64_t xd[RF_MAX_RANK], wd[RF_MAX_RANK];
    memcpy(xd, x->dims, sizeof xd);
    memcpy(wd, w->dims, sizeof wd);
    xd[0] = x->dims[1], xd[1] = x->dims[0];
    wd[0] = w->dims[1], wd[1] = w->dims[0];
    sp->t[0] = make_tensor(x->rank, xd, !c->views[0]);
    sp->t[1] = make_tensor(w->rank, wd, !c->views[1]);
}

/* Weight gradient of a transposed convolution: the IR conv(lhs [C, N,
 * in...], rhs [O, N, out...]) = [C, O, k...] with lhs dilation S > 1 in
 * some dim (G = 1, rhs dilation 1, stride s) is
 *   res[c, o, q] = sum_{n, i, p} lhs[c, n, i] * rhs[o, n, p] over i*S = q*s + p - lo
 * (the autodiff's form for a ConvTranspose layer: S is the layer's stride,
 * s its dilation). The form above would make the dilated lhs oneDNN's src,
 * holes included, which it cannot describe; with the roles swapped nothing
 * is dilated. With q' = K-1-q (K the result's size) the sum runs over
 * p = i*S + q'*s - ((K-1)*s - lo): oneDNN's backward-weights of a forward
 * convolution with src = rhs with dims 0, 1 swapped, diff_dst = lhs
 * swapped, stride S, dilation s, pad_l (K-1)*s - lo, pad_r what gives
 * diff_dst's size, and diff_weights [C, O, k...] the result with every
 * spatial dim reversed, which flip_kernel puts back after the call. (That
 * is how PyTorch computes ConvTranspose's weight gradient, its kernel not
 * being reversed.) The rule takes it where it takes the form above: the
 * autoencoder of bench_services (64 images of 32x32, ConvTranspose 4x4
 * stride 2 from 16 channels to 1) had run its weight gradient as
 * backward-data with a 32x32 kernel in 13.5-16 ms, im2col 49 ms; this 1.3-2.1.
 *
 * With B batch groups (the weight gradient of a grouped ConvTranspose),
 * group b pairs lhs channels b*(C/B).. with rhs channels b*(O/B)..: oneDNN's
 * grouped backward-weights, diff_weights [B, C/B, O/B, k...] being the
 * reversed result seen through strides: element (b, c, o', q') at
 * [c, b*(O/B) + o', q'] (grouped_result). */
static bool spec_bwd_weights_swapped(const rfi_cpu_conv *c, dnnl_conv_spec *sp)
{
    const rfi_node *n = c->node, *x = n->in[0], *w = n->in[1];
    const rfi_attrs *at = &n->attr;
    if (c->fgc > 1 || n->rank + 1 > DNNL_MAX_NDIMS)
        return false;
    for (int d = 0; d < c->nsp; d++)
        if (c->rhs_dil[d] != 1)
            return false;
    sp->kind = PATH_BWD_WEIGHTS;
    sp->flipped = true;
    batch_major_operands(c, sp);
    sp->t[2] = c->bgc > 1 ? grouped_result(c, true) : make_tensor(n->rank, n->dims, false);
    sp->arg[0] = DNNL_ARG_DIFF_DST;
    sp->arg[1] = DNNL_ARG_SRC;
    sp->arg[2] = DNNL_ARG_DIFF_WEIGHTS;
    sp->dst = 0, sp->src = 1, sp->wei = 2;
    for (int d = 0; d < c->nsp; d++) {
        int64_t out = w->dims[2 + d], k = n->dims[2 + d], in = x->dims[2 + d];
        int64_t s = c->stride[d], ld = c->lhs_dil[d];
        sp->strides[d] = ld;
        sp->dilates[d] = s - 1;
        sp->pad_l[d] = (k - 1) * s - at->l[1][d];
        sp->pad_r[d] = (in - 1) * ld + (k - 1) * s + 1 - out - sp->pad_l[d];
        /* (trailing rhs positions that meet only padding: as in spec_bwd_weights) */
        if (sp->pad_r[d] < 0 && sp->pad_r[d] + ld - 1 >= 0)
            sp->pad_r[d] = 0;
        if (sp->pad_l[d] < 0 || sp->pad_r[d] < 0 || out < 1 || k < 1)
            return false;
    }
    return true;
}

static bool spec_bwd_weights(const rfi_cpu_conv *c, dnnl_conv_spec *sp)
{
    const rfi_node *n = c->node, *x = n->in[0], *w = n->in[1];
    const rfi_attrs *at = &n->attr;
    /* (with feature groups, lhs channels would be split among groups: the
     * weight gradient of a batch-grouped convolution, which oneDNN's
     * grouped convolutions do not compute) */
    for (int d = 0; d < c->nsp; d++)
        if (c->lhs_dil[d] != 1)
            return spec_bwd_weights_swapped(c, sp);
    if (c->fgc > 1 || !all_nonnegative(at->l[1], c->nsp) || n->rank + 1 > DNNL_MAX_NDIMS)
        return false;
    sp->kind = PATH_BWD_WEIGHTS;
    int64_t rd[RF_MAX_RANK];
    memcpy(rd, n->dims, sizeof rd);
    rd[0] = n->dims[1], rd[1] = n->dims[0];
    batch_major_operands(c, sp);
    sp->t[2] = c->bgc > 1 ? grouped_result(c, false) : make_tensor(n->rank, rd, true);
    sp->arg[0] = DNNL_ARG_SRC;
    sp->arg[1] = DNNL_ARG_DIFF_DST;
    sp->arg[2] = DNNL_ARG_DIFF_WEIGHTS;
    sp->src = 0, sp->dst = 1, sp->wei = 2;
    for (int d = 0; d < c->nsp; d++) {
        int64_t out = w->dims[2 + d], k = n->dims[2 + d], in = x->dims[2 + d];
        sp->strides[d] = c->rhs_dil[d];
        sp->dilates[d] = c->stride[d] - 1;
        sp->pad_l[d] = at->l[1][d];
        sp->pad_r[d] = (out - 1) * c->rhs_dil[d] + (k - 1) * c->stride[d] + 1 - in - at->l[1][d];
        /* Trailing inputs no output reads (the forward convolution's stride
         * skipped them, e.g. 1x1 stride 2 on an even size) make the exact
         * right padding negative; oneDNN wants it >= 0, and any value up to
         * stride - 1 above it describes the same convolution. */
        if (sp->pad_r[d] < 0 && sp->pad_r[d] + c->rhs_dil[d] - 1 >= 0)
            sp->pad_r[d] = 0;
        if (sp->pad_r[d] < 0 || out < 1 || k < 1)
            return false;
    }
    return true;
}

/* Every spatial dim padded by more than half the kernel's span on both
 * sides: the input-gradient form of a stride-1 convolution with less than
 * "same" padding (a 3x3 without padding gives padding 2). oneDNN's forward
 * kernels spend that padding on zeros; its backward-data computes the form
 * as the gradient it is (1.2x faster on the cnn's 64 -> 32 channels, 11x11
 * -> 13x13, counting the reorders). */
static bool wide_padding(const rfi_cpu_conv *c)
{
    const rfi_attrs *at = &c->node->attr;
    for (int d = 0; d < c->nsp; d++) {
        int64_t span = (c->k_sp[d] - 1) * c->rhs_dil[d];
        if (2 * at->l[1][d] <= span || 2 * at->l[2][d] <= span)
            return false;
    }
    return true;
}

/* Input gradient of a strided convolution, or of a stride-1 one with
 * wide_padding (S = 1): the IR conv(lhs [N, O, out...], rhs [C, O, k...]) =
 * [N, C, in...] with lhs dilation S (stride 1, G = B = 1, padding >= 0) is
 *   res[n, c, i] = sum_{o, q} lhs[n, o, (i + q*r - lo) / S] * rhs[c, o, q]
 * over the terms where S divides i + q*r - lo. With w[o, c, q'] =
 * rhs[c, o, K-1-q'] (packed per call) that is oneDNN's backward-data of a
 * forward convolution with diff_dst = lhs, weights w, diff_src = res, stride
 * S, dilation r, pad_l = (K-1)*r - lo, pad_r = (K-1)*r - hi.
 *
 * The input gradient of a grouped convolution is this form with G feature
 * groups: rhs [C, O/G, k...], and result channel block g (C/G channels)
 * sums over lhs channel block g (O/G channels). That is oneDNN's grouped
 * backward-data, weights [G, O/G, C/G, k...] packed as w[g, o, c, q'] =
 * rhs[g*(C/G) + c, o, K-1-q'] (pack_flipped_kernel). */
static bool spec_bwd_data(const rfi_cpu_conv *c, dnnl_conv_spec *sp)
{
    const rfi_node *n = c->node, *x = n->in[0], *w = n->in[1];
    const rfi_attrs *at = &n->attr;
    if (c->bgc > 1 || w->rank + 1 > DNNL_MAX_NDIMS)
        return false;
    bool dilated = false;
    for (int d = 0; d < c->nsp; d++) {
        dilated |= c->lhs_dil[d] > 1;
        if (c->stride[d] != 1)
            return false;
    }
    if (!dilated && !wide_padding(c))
        return false;
    sp->kind = PATH_BWD_DATA;
    int64_t wd[RF_MAX_RANK + 1], g = c->fgc;
    int wr = w->rank, at_sp = 2;
    if (g > 1) {
        wd[0] = g;
        at_sp = 3;
        wr++;
    }
    wd[at_sp - 2] = w->dims[1];
    wd[at_sp - 1] = w->dims[0] / g;
    for (int d = 0; d < c->nsp; d++)
        wd[at_sp + d] = w->dims[2 + d];
    sp->t[0] = make_tensor(x->rank, x->dims, false);
    sp->t[1] = make_tensor(wr, wd, false); /* the packed, flipped kernel */
    sp->t[2] = make_tensor(n->rank, n->dims, false);
    sp->arg[0] = DNNL_ARG_DIFF_DST;
    sp->arg[1] = DNNL_ARG_WEIGHTS;
    sp->arg[2] = DNNL_ARG_DIFF_SRC;
    sp->dst = 0, sp->wei = 1, sp->src = 2;
    for (int d = 0; d < c->nsp; d++) {
        int64_t span = (w->dims[2 + d] - 1) * c->rhs_dil[d];
        sp->strides[d] = c->lhs_dil[d];
        sp->dilates[d] = c->rhs_dil[d] - 1;
        sp->pad_l[d] = span - at->l[1][d];
        sp->pad_r[d] = span - at->l[2][d];
        /* The gradient of inputs the forward stride skipped (negative exact
         * padding, as in spec_bwd_weights) is zero: oneDNN writes it so with
         * padding 0, which the shape check below confirms. */
        if (sp->pad_r[d] < 0 && sp->pad_r[d] + c->lhs_dil[d] - 1 >= 0)
            sp->pad_r[d] = 0;
        int64_t in = n->dims[2 + d], out = x->dims[2 + d];
        /* oneDNN's shape rule must give back the IR's shapes exactly */
        if (sp->pad_l[d] < 0 || sp->pad_r[d] < 0 ||
            (in + sp->pad_l[d] + sp->pad_r[d] - span - 1) / sp->strides[d] + 1 != out)
            return false;
    }
    return true;
}

static void destroy_dnnl_conv(dnnl_conv *dc)
{
    if (dc->prim)
        rfi_dnnl.primitive_destroy(dc->prim);
    if (dc->scratch)
        rfi_dnnl.memory_destroy(dc->scratch);
    for (int k = 0; k < 3; k++) {
        conv_arg *a = &dc->args[k];
        if (a->user)
            rfi_dnnl.memory_destroy(a->user);
        if (a->inner)
            rfi_dnnl.memory_destroy(a->inner);
        if (a->reorder)
            rfi_dnnl.primitive_destroy(a->reorder);
        rfi_table_reorder_free(&a->table);
    }
    for (int k = 0; k < RFI_EPI_MAX; k++)
        if (dc->post_mem[k])
            rfi_dnnl.memory_destroy(dc->post_mem[k]);
    if (dc->bias_mem)
        rfi_dnnl.memory_destroy(dc->bias_mem);
    memset(dc, 0, sizeof *dc);
}

/* The three tensors' descriptions: types by sp->bf16, the output's bf16 too
 * if all_bf16 (a backward kind's forward hint, which oneDNN only has with
 * one type throughout). */
static dnnl_status_t tensor_descs(const dnnl_conv_spec *sp, bool all_bf16, dnnl_memory_desc_t *md)
{
    dnnl_status_t st = dnnl_success;
    for (int k = 0; k < 3 && st == dnnl_success; k++) {
        dnnl_data_type_t type = sp->bf16 && (k < 2 || all_bf16) ? dnnl_bf16 : dnnl_f32;
        st = sp->any[k] ? rfi_dnnl.memory_desc_init_by_tag(&md[k], sp->t[k].ndims, sp->t[k].dims,
                                                           type, dnnl_format_tag_any)
                        : rfi_dnnl.memory_desc_init_by_strides(&md[k], sp->t[k].ndims,
                                                               sp->t[k].dims, type,
                                                               sp->t[k].strides);
    }
    return st;
}

/* The forward convolution over md (in IR order); bias: its bias input (NULL: none). */
static dnnl_status_t forward_desc(const dnnl_conv_spec *sp, const dnnl_memory_desc_t *md,
                                  const dnnl_memory_desc_t *bias, dnnl_convolution_desc_t *fwd)
{
    dnnl_prop_kind_t prop =
        sp->kind == PATH_FORWARD && !sp->training ? dnnl_forward_inference : dnnl_forward_training;
    return rfi_dnnl.dilated_convolution_forward_desc_init(fwd, prop, sp->alg, &md[sp->src],
                                                          &md[sp->wei], bias, &md[sp->dst],
                                                          sp->strides, sp->dilates, sp->pad_l,
                                                          sp->pad_r);
}

/* desc: the operation; fwd: the forward hint of a backward kind. bias: the
 * forward convolution's bias input (NULL: none). */
static dnnl_status_t init_descs(const dnnl_conv_spec *sp, const dnnl_memory_desc_t *bias,
                                dnnl_memory_desc_t *any, dnnl_convolution_desc_t *fwd,
                                dnnl_convolution_desc_t *desc)
{
    dnnl_status_t st = tensor_descs(sp, false, any);
    if (st == dnnl_success)
        st = forward_desc(sp, any, bias, desc);
    if (st != dnnl_success || sp->kind == PATH_FORWARD)
        return st;
    dnnl_memory_desc_t hint[3];
    st = tensor_descs(sp, true, hint);
    if (st == dnnl_success)
        st = forward_desc(sp, hint, NULL, fwd);
    if (st != dnnl_success)
        return st;
    const dnnl_memory_desc_t *s = &any[sp->src], *w = &any[sp->wei], *d = &any[sp->dst];
    if (sp->kind == PATH_BWD_WEIGHTS)
        return rfi_dnnl.dilated_convolution_backward_weights_desc_init(
            desc, sp->alg, s, w, NULL, d, sp->strides, sp->dilates, sp->pad_l, sp->pad_r);
    return rfi_dnnl.dilated_convolution_backward_data_desc_init(
        desc, sp->alg, s, w, d, sp->strides, sp->dilates, sp->pad_l, sp->pad_r);
}

/* A weight gradient of a grouped convolution (its weights have a groups dim). */
static bool grouped_bwd_weights(const dnnl_conv_spec *sp)
{
    return sp->kind == PATH_BWD_WEIGHTS && sp->t[sp->wei].ndims > sp->t[sp->src].ndims;
}

/* The primitive descriptor (user scratchpad, with its forward hint for the
 * backward kinds); dnnl_unimplemented if oneDNN only has its reference, or
 * (bf16) no kernel with bf16 instructions (oneDNN 2.6 emulates them on plain
 * AVX-512, slower than f32), or
 * post-ops on its gemm-based convolution (measured on a 1-channel 3x3
 * forward of 64 images: 0.55 ms plain, 42 ms with a per-channel binary add,
 * 4.5 ms with a relu; the ops then run after the call instead. Its bias
 * input costs next to nothing there), or its gemm-based grouped
 * backward-weights (the depthwise forms its jit kernel does not take: 5x5,
 * dilated, a channel multiplier; groups of other than 8k channels): faster
 * than im2col on one thread, 3-8x slower on two (a 48 -> 96 depthwise 3x3 on
 * 8 images of 28x28: 44-117 ms against im2col's 14-22), so im2col runs them. */
static dnnl_status_t create_pd(const dnnl_conv_spec *sp, const dnnl_memory_desc_t *bias,
                               const rfi_dnnl_post *post, dnnl_engine_t eng,
                               dnnl_primitive_desc_t *pd)
{
    dnnl_memory_desc_t any[3];
    dnnl_convolution_desc_t fwd, desc;
    dnnl_primitive_desc_t hint = NULL;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_status_t st = init_descs(sp, bias, any, &fwd, &desc);
    if (st == dnnl_success && sp->kind != PATH_FORWARD)
        st = rfi_dnnl.primitive_desc_create(&hint, &fwd, NULL, eng, NULL);
    if (st == dnnl_success)
        st = rfi_dnnl.primitive_attr_create(&attr);
    if (st == dnnl_success)
        st = rfi_dnnl.primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user);
    if (st == dnnl_success)
        st = rfi_dnnl_post_attr(attr, post);
    if (st == dnnl_success)
        st = rfi_dnnl.primitive_desc_create(pd, &desc, attr, eng, hint);
    if (attr)
        rfi_dnnl.primitive_attr_destroy(attr);
    if (hint)
        rfi_dnnl.primitive_desc_destroy(hint);
    const char *impl = NULL;
    if (st == dnnl_success &&
        rfi_dnnl.primitive_desc_query(*pd, dnnl_query_impl_info_str, 0, &impl) == dnnl_success &&
        impl && (strncmp(impl, "ref", 3) == 0 ||
                 (post && post->n > 0 && strstr(impl, "gemm")) ||
                 (grouped_bwd_weights(sp) && strstr(impl, "gemm")) ||
                 (sp->bf16 && !strstr(impl, "bf16") && !strstr(impl, "amx")))) {
        rfi_dnnl.primitive_desc_destroy(*pd);
        *pd = NULL;
        st = dnnl_unimplemented;
    }
    return st;
}

dnnl_status_t rfi_dnnl_reorder_create(const dnnl_memory_desc_t *from,
                                      const dnnl_memory_desc_t *to, dnnl_engine_t eng,
                                      dnnl_primitive_t *reorder)
{
    dnnl_primitive_desc_t rpd = NULL;
    dnnl_status_t st = rfi_dnnl.reorder_primitive_desc_create(&rpd, from, eng, to, eng, NULL);
    if (st == dnnl_success)
        st = rfi_dnnl.primitive_create(reorder, rpd);
    if (rpd)
        rfi_dnnl.primitive_desc_destroy(rpd);
    return st;
}

dnnl_format_tag_t rfi_dnnl_layout_tag(rfi_layout layout, bool swapped)
{
    switch (layout) {
    case RFI_LAYOUT_PLAIN: return swapped ? dnnl_bacd : dnnl_abcd;
    case RFI_LAYOUT_C8: return swapped ? dnnl_Abcd8a : dnnl_aBcd8b;
    case RFI_LAYOUT_C16: return swapped ? dnnl_Abcd16a : dnnl_aBcd16b;
    case RFI_LAYOUT_NHWC: return swapped ? dnnl_format_tag_undef : dnnl_acdb;
    default: return dnnl_format_tag_undef;
    }
}

/* Whether an epilogue op from the first-th on is a BIAS (which the services
 * can add to a row-major result only). */
static bool bias_from(const rfi_cpu_conv *c, int first)
{
    for (int e = first; e < c->n_epi; e++)
        if (c->epi[e].kind == RFI_EPI_BIAS)
            return true;
    return false;
}

/* How tensor k of spec sp describes its buffer when that is laid out
 * (c->layouts[k]): its tag, or dnnl_format_tag_undef where this path reads
 * or writes it row-major (the services then reorder around the call): the
 * kernel bwd-data packs per call, views the services copy, and a result to
 * which the services still add a bias (epi_ops: the epilogue ops the
 * primitive applies; the others are elementwise in any layout) or one
 * flip_kernel reverses after the call. The
 * buffer's layout is of its node, whose dim 1 is the tensor's dim 1, or
 * dim 0 if swapped. */
static dnnl_format_tag_t arg_tag(const rfi_cpu_conv *c, const dnnl_conv_spec *sp, int k,
                                 int epi_ops)
{
    const tensor_spec *t = &sp->t[k];
    rfi_layout layout = c->layouts[k];
    const rfi_node *buf = k < 2 ? c->node->in[k] : c->node;
    /* (a tensor with a dim more than its buffer's node, a grouped kernel, is
     * that buffer seen through strides: only row-major buffers are) */
    if (layout == RFI_LAYOUT_PLAIN || t->ndims != 4 || t->ndims != buf->rank ||
        (sp->kind == PATH_BWD_DATA && k == 1) ||
        (k < 2 && c->views[k] && sp->kind != PATH_BWD_WEIGHTS) ||
        (k == 2 && (bias_from(c, epi_ops) || sp->flipped)) ||
        (rfi_layout_blocked(layout) && t->dims[t->swapped ? 0 : 1] % rfi_layout_block(layout)))
        return dnnl_format_tag_undef;
    return rfi_dnnl_layout_tag(layout, t->swapped);
}

/* Argument k: the user memory over the IR buffer and, if the primitive wants
 * another layout, a memory in the workspace at *ws plus the reorder. tag:
 * the buffer's layout (arg_tag), or dnnl_format_tag_undef for the tensor's
 * row-major strides. */
static dnnl_status_t make_arg(conv_arg *a, const tensor_spec *t, int arg, bool output,
                              dnnl_format_tag_t tag, const_dnnl_primitive_desc_t pd,
                              dnnl_engine_t eng, size_t *ws)
{
    dnnl_memory_desc_t user;
    a->arg = arg;
    a->swapped = t->swapped;
    dnnl_status_t st =
        tag != dnnl_format_tag_undef
            ? rfi_dnnl.memory_desc_init_by_tag(&user, t->ndims, t->dims, dnnl_f32, tag)
            : rfi_dnnl.memory_desc_init_by_strides(&user, t->ndims, t->dims, dnnl_f32, t->strides);
    if (st == dnnl_success)
        st = rfi_dnnl.memory_create(&a->user, &user, eng, DNNL_MEMORY_NONE);
    const dnnl_memory_desc_t *want =
        rfi_dnnl.primitive_desc_query_md(pd, dnnl_query_exec_arg_md, arg);
    if (st != dnnl_success || !want)
        return st == dnnl_success ? dnnl_runtime_error : st;
    a->user_md = user;
    a->inner_md = *want;
    if (rfi_dnnl.memory_desc_equal(&user, want))
        return dnnl_success;
    a->at = *ws;
    *ws += rfi_ws_align(rfi_dnnl.memory_desc_get_size(want));
    st = rfi_dnnl.memory_create(&a->inner, want, eng, DNNL_MEMORY_NONE);
    const dnnl_memory_desc_t *from = output ? want : &user, *to = output ? &user : want;
    bool kernel = arg == DNNL_ARG_WEIGHTS || arg == DNNL_ARG_DIFF_WEIGHTS;
    if (st == dnnl_success && kernel && rfi_table_reorder_fits(from, to))
        return rfi_table_reorder_make(from, to, !output, &a->table) == RF_OK ? dnnl_success
                                                                            : dnnl_out_of_memory;
    if (st == dnnl_success)
        st = rfi_dnnl_reorder_create(from, to, eng, &a->reorder);
    return st;
}

/* Whether argument a is copied between the IR's buffer and the primitive's
 * layout around the call (by a oneDNN reorder or a table). */
static bool arg_copied(const conv_arg *a)
{
    return a->reorder || a->table.from;
}

/* A forward primitive applying as much of c's epilogue as oneDNN runs well
 * and as the interpreter computes it (rfi_dnnl_post_faithful), or NULL (then
 * the services apply all of it after the call). First choice:
 * a leading per-channel BIAS as the convolution's own bias input and the ops
 * after it as post-ops; second: every op as a post-op; third (oneDNN's
 * gemm-based convolution takes a bias input at no cost but no post-op: see
 * create_pd): the bias input alone, the services applying the rest. Sets
 * c->dc.post and, when the bias input is used, *bias and *with_bias. */
static dnnl_primitive_desc_t create_fused_pd(rfi_cpu_conv *c, const dnnl_conv_spec *sp,
                                             dnnl_memory_desc_t *bias, bool *with_bias,
                                             dnnl_engine_t eng)
{
    dnnl_conv *dc = &c->dc;
    dnnl_primitive_desc_t pd = NULL;
    rfi_dnnl_tensor dst = {sp->t[sp->dst].ndims, {0}, {0}};
    memcpy(dst.dims, sp->t[sp->dst].dims, sizeof dst.dims);
    memcpy(dst.strides, sp->t[sp->dst].strides, sizeof dst.strides);
    int take = rfi_dnnl_post_faithful(c->epi, c->n_epi);
    if (take == 0)
        return NULL;
    if (c->epi[0].kind == RFI_EPI_BIAS && c->epi[0].axis == 1) {
        dnnl_dims_t bias_dims = {dst.dims[1]};
        if (rfi_dnnl.memory_desc_init_by_tag(bias, 1, bias_dims, dnnl_f32, dnnl_a) ==
                dnnl_success &&
            rfi_dnnl_post_make(&dc->post, c->epi + 1, take - 1, &dst, 1) &&
            create_pd(sp, bias, &dc->post, eng, &pd) == dnnl_success) {
            *with_bias = true;
            return pd;
        }
    }
    if (rfi_dnnl_post_make(&dc->post, c->epi, take, &dst, 1) &&
        create_pd(sp, NULL, &dc->post, eng, &pd) == dnnl_success)
        return pd;
    memset(&dc->post, 0, sizeof dc->post);
    if (c->epi[0].kind == RFI_EPI_BIAS && c->epi[0].axis == 1 &&
        create_pd(sp, bias, NULL, eng, &pd) == dnnl_success) {
        *with_bias = true;
        return pd;
    }
    return NULL;
}

/* Creates the oneDNN path of spec sp; false (nothing kept) if oneDNN does not
 * take it well. The workspace holds the scratchpad, then the blocked copies,
 * then (backward data) the packed kernel or (flipped) the reversed result. */
static bool make_dnnl_conv(rfi_cpu_conv *c, const dnnl_conv_spec *sp, dnnl_engine_t eng)
{
    dnnl_primitive_desc_t pd = NULL;
    dnnl_conv *dc = &c->dc;
    memset(&dc->post, 0, sizeof dc->post);
    dnnl_memory_desc_t bias;
    bool with_bias = false;
    if (sp->kind == PATH_FORWARD && c->n_epi > 0)
        pd = create_fused_pd(c, sp, &bias, &with_bias, eng);
    if (!pd && create_pd(sp, NULL, NULL, eng, &pd) != dnnl_success)
        return false;
    const dnnl_memory_desc_t *sp_md =
        rfi_dnnl.primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    size_t ws = rfi_ws_align(sp_md ? rfi_dnnl.memory_desc_get_size(sp_md) : 0);
    dnnl_status_t st = rfi_dnnl.primitive_create(&dc->prim, pd);
    if (st == dnnl_success && ws > 0)
        st = rfi_dnnl.memory_create(&dc->scratch, sp_md, eng, DNNL_MEMORY_NONE);
    int epi_ops = sp->kind == PATH_FORWARD ? dc->post.n + (with_bias ? 1 : 0) : 0;
    for (int k = 0; k < 3 && st == dnnl_success; k++) {
        dnnl_format_tag_t tag = arg_tag(c, sp, k, epi_ops);
        st = make_arg(&dc->args[k], &sp->t[k], sp->arg[k], k == 2, tag, pd, eng, &ws);
        c->laid_out[k] = tag != dnnl_format_tag_undef;
    }
    if (st == dnnl_success)
        st = rfi_dnnl_post_memories(&dc->post, eng, dc->post_mem);
    if (st == dnnl_success && with_bias)
        st = rfi_dnnl.memory_create(&dc->bias_mem, &bias, eng, DNNL_MEMORY_NONE);
    rfi_dnnl.primitive_desc_destroy(pd);
    if (st != dnnl_success) {
        destroy_dnnl_conv(dc);
        return false;
    }
    if (sp->kind == PATH_BWD_DATA) {
        c->pack_at = ws;
        ws += rfi_ws_align((size_t)rfi_node_numel(c->node->in[1]) * sizeof(float));
    }
    c->flipped = sp->flipped;
    if (sp->flipped) {
        c->flip_at = ws;
        ws += rfi_ws_align((size_t)rfi_node_numel(c->node) * sizeof(float));
    }
    c->path = sp->kind;
    c->winograd = sp->alg == dnnl_convolution_winograd;
    c->dnnl_workspace = ws;
    return true;
}

/* rhs [C, O, k...] -> [O, C, k...] with every spatial dim reversed; with G
 * feature groups, rhs [C, O/G, k...] -> [G, O/G, C/G, k...] (spec_bwd_data). */
static void pack_flipped_kernel(const rfi_cpu_conv *c, const float *rhs, float *dst)
{
    const rfi_node *w = c->node->in[1];
    int64_t g = c->fgc, cn = w->dims[0] / g, on = w->dims[1], kc = c->k_count;
    for (int64_t gi = 0; gi < g; gi++)
        for (int64_t o = 0; o < on; o++)
            for (int64_t ci = 0; ci < cn; ci++) {
                const float *s = rhs + ((gi * cn + ci) * on + o) * kc;
                float *d = dst + ((gi * on + o) * cn + ci) * kc;
                for (int64_t q = 0; q < kc; q++)
                    d[q] = s[kc - 1 - q]; /* reversing every dim = reversing the flat kernel */
            }
}

/* The result from the spatially reversed one (spec_bwd_weights_swapped):
 * each of its kernels' positions in reverse order, which reverses every
 * spatial dim. */
static void flip_kernel(const rfi_cpu_conv *c, const float *restrict from, float *restrict to)
{
    int64_t kc = c->p_count, kernels = c->out_batch * c->out_feat;
    for (int64_t r = 0; r < kernels; r++, from += kc, to += kc)
        for (int64_t q = 0; q < kc; q++)
            to[q] = from[kc - 1 - q];
}

static rf_status run_dnnl_conv(rfi_cpu_conv *c, dnnl_stream_t s, const void *in0,
                               const void *in1, void *out, const void *const *epi_src,
                               void *workspace)
{
    dnnl_conv *dc = &c->dc;
    char *ws = workspace;
    if (c->path == PATH_BWD_DATA) {
        pack_flipped_kernel(c, in1, (float *)(ws + c->pack_at));
        in1 = ws + c->pack_at;
    }
    void *user[3] = {(void *)in0, (void *)in1, c->flipped ? ws + c->flip_at : out};
    dnnl_status_t st = dnnl_success;
    dnnl_exec_arg_t args[5 + RFI_EPI_MAX];
    int nargs = 0;
    for (int k = 0; k < 3 && st == dnnl_success; k++) {
        conv_arg *a = &dc->args[k];
        st = rfi_dnnl.memory_set_data_handle(a->user, user[k]);
        if (a->inner && st == dnnl_success)
            st = rfi_dnnl.memory_set_data_handle(a->inner, a->shared ? a->shared : ws + a->at);
        args[nargs++] = (dnnl_exec_arg_t){a->arg, a->inner ? a->inner : a->user};
    }
    if (dc->scratch && st == dnnl_success) {
        st = rfi_dnnl.memory_set_data_handle(dc->scratch, ws);
        args[nargs++] = (dnnl_exec_arg_t){DNNL_ARG_SCRATCHPAD, dc->scratch};
    }
    if (dc->bias_mem && st == dnnl_success) {
        st = rfi_dnnl.memory_set_data_handle(dc->bias_mem, (void *)epi_src[0]);
        args[nargs++] = (dnnl_exec_arg_t){DNNL_ARG_BIAS, dc->bias_mem};
        epi_src++; /* the post-ops are the epilogue's ops after the bias */
    }
    if (st == dnnl_success) {
        nargs = rfi_dnnl_post_args(&dc->post, dc->post_mem, epi_src, args, nargs);
        if (nargs < 0)
            return rfi_error(RF_E_INTERNAL, "cpu: convolution: a post-op has no operand");
    }
    for (int k = 0; k < 2 && st == dnnl_success; k++) {
        conv_arg *a = &dc->args[k];
        if (!arg_copied(a) || (a->shared && !a->fills))
            continue;
        if (a->table.from) {
            rfi_table_reorder_run(&a->table, user[k], a->shared ? a->shared : ws + a->at);
            continue;
        }
        dnnl_exec_arg_t r[2] = {{DNNL_ARG_FROM, a->user}, {DNNL_ARG_TO, a->inner}};
        st = rfi_dnnl.primitive_execute(a->reorder, s, 2, r);
    }
    if (st == dnnl_success)
        st = rfi_dnnl.primitive_execute(dc->prim, s, nargs, args);
    if (st == dnnl_success && dc->args[2].reorder) {
        conv_arg *a = &dc->args[2];
        dnnl_exec_arg_t r[2] = {{DNNL_ARG_FROM, a->inner}, {DNNL_ARG_TO, a->user}};
        st = rfi_dnnl.primitive_execute(a->reorder, s, 2, r);
    }
    if (st == dnnl_success)
        st = rfi_dnnl.stream_wait(s);
    if (st == dnnl_success && dc->args[2].table.from)
        rfi_table_reorder_run(&dc->args[2].table, (const float *)(ws + dc->args[2].at), user[2]);
    if (st == dnnl_success && c->flipped)
        flip_kernel(c, user[2], out);
    return st == dnnl_success ? RF_OK : rfi_dnnl_error(st, "convolution", "execute");
}

/* The fewer of the forward convolution's input and output channels. */
static int64_t narrowest_channels(const dnnl_conv_spec *sp)
{
    int64_t in = sp->t[sp->src].dims[1], out = sp->t[sp->dst].dims[1];
    return in < out ? in : out;
}

/* The 4x4 tiles of oneDNN's Winograd over the batch: of the forward's result,
 * which its weight gradient reads, or of the input gradient's. */
static int64_t winograd_tiles(const dnnl_conv_spec *sp)
{
    const tensor_spec *t = &sp->t[sp->kind == PATH_BWD_DATA ? sp->src : sp->dst];
    return t->dims[0] * ((t->dims[2] + 3) / 4) * ((t->dims[3] + 3) / 4);
}

/* Whether to try oneDNN's Winograd F(4x4, 3x3) for this forward or
 * backward-weights convolution. RF_CONV_WINOGRAD=0 in the environment before
 * prepare never does, =1 tries it on every form oneDNN accepts (tests);
 * otherwise the measured rule: 2-D, 3x3, stride 1, no dilation, no groups, at
 * least WINOGRAD_MIN_CHANNELS channels on both sides and enough tiles. On
 * two AVX-512 cores, 64 -> 64 channels at 4x4: forward 2x slower than direct
 * with 8 images (8 tiles), 1.2x with 32, even with 64, 1.3x faster with 128;
 * weight gradient 1.2x slower with 8 images, 1.2x faster with 32. Measured with 128
 * images against oneDNN's direct kernels, both on blocked layouts: 32 -> 64
 * channels at 13x13 1.9x faster forward and 1.7x backward-weights, 64 -> 64
 * at 7x7 1.35x and 1.8x, 32 -> 32 at 14x14 1.1x; but 16 -> 16 at 14x14 2.6x
 * slower forward and 8 -> 8 at 28x28 1.3x slower. Backward-data, which
 * tiles its result (the forward's input) in 4x4, only where that splits into
 * whole tiles: the cnn's 64 -> 32 input gradient (64 images, two threads)
 * took 0.77-0.81 ms against 1.10-1.11 direct at 12x12, but 1.34-1.47
 * against 1.35-1.37 at 13x13 (16 tiles for 169 points). */
static bool winograd_wanted(const dnnl_conv_spec *sp)
{
    const char *env = getenv("RF_CONV_WINOGRAD");
    if (env && *env == '0')
        return false;
    if (env && *env == '1')
        return true;
    const tensor_spec *w = &sp->t[sp->wei], *x = &sp->t[sp->src];
    /* (grouped weights have a dim more than x: oneDNN has no grouped Winograd) */
    if (w->ndims != 4 || x->ndims != 4 || w->dims[2] != 3 || w->dims[3] != 3)
        return false;
    for (int d = 0; d < 2; d++)
        if (sp->strides[d] != 1 || sp->dilates[d] != 0 ||
            (sp->kind == PATH_BWD_DATA && x->dims[2 + d] % 4 != 0))
            return false;
    int64_t min_tiles =
        sp->kind == PATH_BWD_WEIGHTS ? WINOGRAD_MIN_TILES_BWD_WEIGHTS : WINOGRAD_MIN_TILES;
    return narrowest_channels(sp) >= WINOGRAD_MIN_CHANNELS && winograd_tiles(sp) >= min_tiles;
}

static bool try_path(rfi_cpu_conv *c, int path, dnnl_engine_t eng)
{
    dnnl_conv_spec sp;
    memset(&sp, 0, sizeof sp);
    bool ok = path == PATH_FORWARD       ? spec_forward(c, &sp)
              : path == PATH_BWD_WEIGHTS ? spec_bwd_weights(c, &sp)
              : path == PATH_BWD_DATA    ? spec_bwd_data(c, &sp)
                                         : false;
    if (!ok || c->nsp > 3)
        return false;
    sp.bf16 = c->bf16 && !c->rounds;
    if (!sp.bf16 && winograd_wanted(&sp)) { /* oneDNN's Winograd is f32 only */
        /* Winograd wants its own blocked layouts, and its inference kind wants
         * the weights pre-transformed: a reorder of 0.37 ms per call on a
         * 64x32x3x3 kernel, which its training kind does inside the kernel. */
        dnnl_conv_spec wino = sp;
        wino.alg = dnnl_convolution_winograd;
        wino.training = true;
        for (int k = 0; k < 3; k++)
            wino.any[k] = true;
        if (make_dnnl_conv(c, &wino, eng))
            return true;
    }
    sp.alg = dnnl_convolution_direct;
    /* Blocked activations pay for their reorders only with enough channels
     * (measured: a 1-channel forward to 8 channels runs 3x faster on plain
     * layouts). Two exceptions. A first layer (a few input channels, at least
     * a vector's FIRST_LAYER_MIN_OUT output channels) reads its plain input
     * and writes blocked output: 1 -> 32 channels on 64 28x28 images took 0.77 ms
     * on plain layouts (oneDNN's gemm convolution, relu after the call) and
     * 0.40 ms so, the output reorder included. The weight gradient always
     * takes them: even with one input channel it runs 2.6x faster than
     * im2col, and on plain layouts oneDNN's version took 50x longer (cnn
     * conv1's weight gradient, 64 images). */
    bool first_layer = path == PATH_FORWARD && sp.t[sp.src].dims[1] < BLOCKED_MIN_CHANNELS &&
                       sp.t[sp.dst].dims[1] >= FIRST_LAYER_MIN_OUT;
    bool blocked = narrowest_channels(&sp) >= BLOCKED_MIN_CHANNELS || first_layer ||
                   path == PATH_BWD_WEIGHTS;
    /* With a vector's worth of channels on both sides a forward runs as
     * oneDNN's training kind: its direct kernel on channel-blocked layouts
     * beats the inference kind's channels-last one (128 images, 3x3: 2.0-2.2
     * against 2.5-2.7 ms at 16 channels and 28x28, 1.66-1.69 against
     * 1.71-1.77 ms at 64 channels and 7x7; the ResNet example's forward-path
     * convolutions 15.6-16.1 ms per step against 18-21). With 8 channels its
     * output is padded to 16 and reordering that back costs more than its
     * kernel gains; first layers read their plain input and gain. */
    sp.training = first_layer || (path == PATH_FORWARD &&
                                  narrowest_channels(&sp) >= TRAINING_KIND_MIN_CHANNELS);
    for (int k = 0; k < 3; k++)
        sp.any[k] = blocked || sp.arg[k] == DNNL_ARG_WEIGHTS || sp.arg[k] == DNNL_ARG_DIFF_WEIGHTS;
    if (make_dnnl_conv(c, &sp, eng))
        return true;
    if (blocked)
        return false;
    for (int k = 0; k < 3; k++) /* oneDNN may only take it with blocked layouts */
        sp.any[k] = true;
    return make_dnnl_conv(c, &sp, eng);
}

/* The path for this form: RF_CONV_PATH (im2col, forward, bwd-weights,
 * bwd-data) when set, for tests and benches; else bwd-weights for image-sized
 * kernels (more kernel positions than output positions: the weight-gradient
 * form, lhs-dilated too, a transposed convolution's, which bwd-data below had
 * run 2-10x slower) and for batch groups (the weight gradient of a grouped
 * convolution, whatever its sizes: no other oneDNN path computes that form),
 * forward for small kernels, bwd-data for lhs-dilated forms, and im2col for
 * the rest and whatever oneDNN refuses. */
static void choose_dnnl_path(rfi_cpu_conv *c, dnnl_engine_t eng)
{
    const char *forced = getenv("RF_CONV_PATH");
    if (forced && *forced) {
        int path = !strcmp(forced, "forward")       ? PATH_FORWARD
                   : !strcmp(forced, "bwd-weights") ? PATH_BWD_WEIGHTS
                   : !strcmp(forced, "bwd-data")    ? PATH_BWD_DATA
                                                    : PATH_IM2COL;
        if (path != PATH_IM2COL)
            try_path(c, path, eng);
        return;
    }
    if ((c->k_count > c->p_count || c->bgc > 1) && try_path(c, PATH_BWD_WEIGHTS, eng))
        return;
    if (wide_padding(c) && try_path(c, PATH_BWD_DATA, eng))
        return;
    if (c->k_count <= DIRECT_MAX_KERNEL && try_path(c, PATH_FORWARD, eng))
        return;
    try_path(c, PATH_BWD_DATA, eng);
}

/* Whether to try winograd.c's convolution, and on how few channels in each
 * of its forms (its min_channels: a 3x3 kernel, a 3x3 result).
 * RF_CONV_PATH=winograd forces it where the form fits (any channels);
 * another RF_CONV_PATH, or RF_CONV_WINOGRAD=0, never; else only where oneDNN
 * has no Winograd kernels (below AVX-512, where its channel block is 8), with
 * OWN_WINOGRAD_MIN_CHANNELS in both forms, or any channels with
 * RF_CONV_WINOGRAD=1. Measured on two AVX2 cores: the cnn's 32 -> 64
 * channels (64 images, 13x13) forward 1.0 against 1.92 ms direct, its
 * gradients 2.0-2.1 against 3.4 ms. The ResNet example's 16 channels at
 * 14x14 (128 images): forward 0.84-0.89 against 0.94 ms. Its 16-channel
 * weight gradients at 28x28 (build/bench_services 16ch, fastest of 6
 * interleaved runs): 2.6-3.2 against 4.0-4.2 ms oneDNN's direct kernel,
 * and at 14x14 0.83-0.89 against 0.99-1.03 ms. */
static bool own_winograd_wanted(rfi_winograd_rule *rule)
{
    const char *forced = getenv("RF_CONV_PATH"), *env = getenv("RF_CONV_WINOGRAD");
    *rule = (rfi_winograd_rule){{1, 1}, 0, 0.0};
    if (forced && *forced)
        return !strcmp(forced, "winograd");
    if (env && *env == '0')
        return false;
    if (!env || *env != '1') {
        rule->min_channels[0] = OWN_WINOGRAD_MIN_CHANNELS;
        rule->min_channels[1] = OWN_WINOGRAD_MIN_CHANNELS;
        rule->min_rows = OWN_WINOGRAD_MIN_TILES;
        rule->min_fill = OWN_WINOGRAD_MIN_FILL;
    }
    return rfi_dnnl_channel_block() == 8;
}

/* The path as choose_dnnl_path says; at bf16 first among oneDNN's bf16
 * convolutions (where allowed), then (rounds) winograd.c's where wanted,
 * then among the f32 paths. Returns the workspace the path needs. */
static size_t choose_path(rfi_cpu_conv *c, dnnl_engine_t eng)
{
    if (c->bf16 && rfi_bf16_kernels_allowed()) {
        choose_dnnl_path(c, eng);
        if (c->path != PATH_IM2COL)
            return c->dnnl_workspace;
    }
    c->rounds = c->bf16;
    rfi_winograd_rule rule;
    size_t bytes = 0;
    if (own_winograd_wanted(&rule) &&
        rfi_winograd_prepare(c->node, c->views, c->layouts, c->epi, c->n_epi, &rule, eng,
                             &c->own, &bytes) == RF_OK) {
        c->path = PATH_OWN_WINOGRAD;
        return bytes;
    }
    choose_dnnl_path(c, eng);
    return c->dnnl_workspace;
}

/* Reserves the rounded copies of x and w (rounds) after `used` workspace bytes. */
static size_t reserve_rounded(rfi_cpu_conv *c, size_t used)
{
    for (int k = 0; k < 2 && c->rounds; k++) {
        c->round_at[k] = used;
        used += rfi_ws_align((size_t)rfi_node_numel(c->node->in[k]) * sizeof(float));
    }
    return used;
}

rf_status rfi_cpu_conv_prepare(const rfi_node *n, const rfi_epi_op *epi, int n_epi,
                               const bool views[2], const rfi_layout layouts[3],
                               dnnl_engine_t eng, rfi_cpu_conv **out, size_t *workspace_bytes)
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
    c->bf16 = rfi_conv_bf16(n);
    c->epi = epi;
    c->n_epi = n_epi;
    c->views[0] = views && views[0];
    c->views[1] = views && views[1];
    for (int k = 0; k < 3; k++)
        c->layouts[k] = layouts ? layouts[k] : RFI_LAYOUT_PLAIN;
    if (!read_shape(c, n)) {
        rfi_free(c);
        return RF_E_UNSUPPORTED;
    }
    if (c->empty) {
        *out = c;
        return RF_OK;
    }
    size_t path_bytes = choose_path(c, eng);
    if (c->path != PATH_IM2COL) {
        *workspace_bytes = reserve_rounded(c, path_bytes);
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
    size_t col_end = c->col_at + rfi_ws_align(image_bytes * (size_t)c->chunk);
    *workspace_bytes = reserve_rounded(c, col_end);
    *out = c;
    return RF_OK;
}

rf_status rfi_cpu_conv_run(rfi_cpu_conv *c, dnnl_stream_t s, const void *x, const void *w,
                           void *out, const void *const *epi_src, void *workspace)
{
    if (c->empty) {
        size_t bytes = rfi_node_nbytes(c->node);
        if (bytes > 0)
            memset(out, 0, bytes);
        return RF_OK;
    }
    if (c->rounds) { /* the f32 path over rounded copies */
        float *xr = (float *)((char *)workspace + c->round_at[0]);
        float *wr = (float *)((char *)workspace + c->round_at[1]);
        rfi_cpu_round_bf16(xr, x, rfi_node_numel(c->node->in[0]));
        rfi_cpu_round_bf16(wr, w, rfi_node_numel(c->node->in[1]));
        x = xr;
        w = wr;
    }
    if (c->path == PATH_OWN_WINOGRAD)
        return rfi_winograd_run(c->own, s, x, w, out, epi_src, workspace);
    if (c->path != PATH_IM2COL)
        return run_dnnl_conv(c, s, x, w, out, epi_src, workspace);
    float *col = (float *)((char *)workspace + c->col_at);
    int64_t row_grain = 16384 / (c->p_count > 0 ? c->p_count : 1) + 1;
    for (int64_t first = 0; first < c->out_batch; first += c->chunk) {
        int64_t images = c->out_batch - first < c->chunk ? c->out_batch - first : c->chunk;
        im2col_job job = {c, x, col, first};
        rfi_parallel_for(images * c->groups * c->rows, row_grain, im2col_rows, &job);
        rfi_dnnl_mm *mm = images == c->chunk ? &c->full : &c->last;
        float *dst = (float *)out + first * c->out_feat * c->p_count;
        rf_status st = rfi_dnnl_mm_run(mm, s, w, col, dst, workspace, NULL, "convolution");
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
    destroy_dnnl_conv(&c->dc);
    rfi_winograd_free(c->own);
    rfi_free(c);
}

bool rfi_cpu_conv_is_winograd(const rfi_cpu_conv *c)
{
    return c && !c->empty && c->path != PATH_IM2COL && c->winograd;
}

bool rfi_cpu_conv_takes_views(const rfi_cpu_conv *c)
{
    return c && !c->empty && (c->path == PATH_BWD_WEIGHTS || c->path == PATH_OWN_WINOGRAD);
}

bool rfi_cpu_conv_bias_input(const rfi_cpu_conv *c)
{
    return c && !c->empty && c->path == PATH_FORWARD && c->dc.bias_mem;
}

int rfi_cpu_conv_epilogue_ops(const rfi_cpu_conv *c)
{
    if (c && !c->empty && c->path == PATH_OWN_WINOGRAD)
        return rfi_winograd_epilogue_ops(c->own);
    if (!c || c->empty || c->path != PATH_FORWARD)
        return 0;
    return c->dc.post.n + (c->dc.bias_mem ? 1 : 0);
}

bool rfi_cpu_conv_input_copy(const rfi_cpu_conv *c, int k, const dnnl_memory_desc_t **user,
                             const dnnl_memory_desc_t **inner, size_t *bytes)
{
    if (!c || c->empty || c->path == PATH_IM2COL || c->path == PATH_OWN_WINOGRAD || k < 0 ||
        k > 1 || c->rounds ||
        (c->path == PATH_BWD_DATA && k == 1)) /* that input is the kernel packed per call */
        return false;
    const conv_arg *a = &c->dc.args[k];
    if (!arg_copied(a))
        return false;
    *user = &a->user_md;
    *inner = &a->inner_md;
    *bytes = rfi_dnnl.memory_desc_get_size(&a->inner_md);
    return true;
}

void rfi_cpu_conv_share_input(rfi_cpu_conv *c, int k, void *storage, bool fills)
{
    conv_arg *a = &c->dc.args[k];
    a->shared = storage;
    a->fills = fills;
}

bool rfi_cpu_conv_laid_out(const rfi_cpu_conv *c, int k)
{
    if (c && !c->empty && c->path == PATH_OWN_WINOGRAD)
        return rfi_winograd_laid_out(c->own, k);
    return c && !c->empty && c->path != PATH_IM2COL && k >= 0 && k < 3 && c->laid_out[k];
}
