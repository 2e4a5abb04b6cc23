/* kir_conv.c: which CALL CONV steps a backend generates as direct
 * convolutions (kir.h RFI_KIR_STEP_CONV), and their description.
 *
 * The forms: an f32 convolution with two spatial dims and no feature or
 * batch groups, either
 *   FORWARD: no rhs dilation, lhs dilation only at stride 1, padding >= 0,
 *     materialised operands, a row-major kernel, and an epilogue of a
 *     per-channel bias, relu and residual adds in the result's layout: the
 *     forward convolutions of a network, the input gradients of its
 *     stride-1 layers (a convolution with the flipped kernel) and those of
 *     its strided layers (the same over the output gradient dilated by the
 *     stride); or
 *   WEIGHT_GRAD: the weight gradient as the autodiff writes it,
 *     conv(transpose(x), transpose(dy)) with both transposes swapping dims 0
 *     and 1 and read as views of x and dy (plan.h conv_transposed_views),
 *     stride 1, no lhs dilation, the forward's stride as rhs dilation, low
 *     padding >= 0, no epilogue.
 *
 * The choice: fewer than 16 input channels (16 for a dilated input) and 8 or 16
 * output channels (one vector of them; 16 only where the machine's vectors hold
 * 16 floats), with kernels up to 7x7; and, where the machine's vectors hold 8
 * floats or the output gradient is a spread pool gradient, weight gradients of
 * few input channels to more outputs (gradient_vectors below); and forwards to
 * 32 outputs whose result only a pool's loop reads, in vectors of the plan's
 * channel block (pooled_vectors), which the loop then runs row by row (kir.h
 * pool_step). There the library is at its slowest: on a 2-core AVX-512 machine,
 * oneDNN ran the ResNet's 8 -> 8 channel 3x3 convolutions at ~95 GFLOP/s and
 * its 1 -> 8 first layer at ~30, where the generated loop (one vector of output
 * channels times a row of outputs per register block; render_conv.c) ran at
 * 140-175; its weight gradients of the 1 -> 8 and the 1x1 8 -> 16 layers took
 * 0.7-0.8 ms for 6-15 MFLOP, with reorders to its blocked layouts, the loops
 * 0.16-0.21 ms; its backward-data of the 16 -> 8 strided layers 1.0-1.1 and
 * 0.7-0.9 ms, the loops 0.75 and 0.53. With 16 or more input channels
 * (undilated) oneDNN's blocked kernels reached 200+ GFLOP/s, and with 32 output
 * channels they were as fast as the loops or faster there (the cnn's 1 -> 32
 * first layer: forward 0.26 against 0.30-0.33 ms, weight gradient 0.21 against
 * 0.25-0.31), so those stay calls, but for the AVX2 weight gradients and the
 * pooled forwards. The input gradient of a strided 1x1 projection (a 1x1
 * kernel over the output gradient dilated by the stride) takes up to 64
 * input channels, and up to 64 outputs in vectors of 16 (spread_1x1_vectors).
 * For the ResNet example's 32 -> 16 one (128 images, 28x28
 * result, 26 MFLOP) oneDNN's backward-data took 0.53 ms, and the services
 * then added the residual in a pass of their own (backward-data takes no
 * post-ops): 0.59-1.0 ms in all (RF_PROFILE); the loop writes each point
 * once with the residual added: 0.33 ms. The limits keep the renderer's
 * stack tables small: the kernel reordered for the loop or one chunk's
 * partial weight gradient (c*kh*kw*o floats) and the padded input rows (kh
 * rows of the width the outputs read).
 */
#include <math.h>
#include <string.h>

#include "kir.h"

#define DIRECT_MAX_IN_CHANNELS 15
#define SPREAD_1X1_MAX_IN_CHANNELS 64
#define SPREAD_1X1_MAX_OUT 64 /* in vectors of 16: spread_1x1_vectors */
#define DIRECT_MAX_KERNEL 7
#define DIRECT_MAX_STRIDE 4
#define DIRECT_MAX_WEIGHTS 4096 /* c * kh * kw * o floats: the forward's kernel table */
#define DIRECT_MAX_GRADIENT 1536 /* the same for a weight gradient's partials (per chunk) */
#define DIRECT_MAX_ROWS 8192    /* kh * padded width * c floats */
#define DIRECT_MAX_VECTORS 8    /* a weight gradient's outputs: 8 vectors of 8 at most */
#define POOLED_MAX_OUT 32       /* a pooled forward's outputs: 2 vectors of 16 or 4 of 8 */
#define TILE_MAX_FLOATS 20480   /* a pooled forward's tile: 80 KB of its stack */

/* Materialised node x's buffer and offset; false when x has none (inline). */
static bool buffer_of(const rfi_plan *p, const rfi_node *x, int *buffer, size_t *offset)
{
    if (p->loc[x->id].kind == RFI_LOC_INLINE)
        return false;
    rfi_plan_buffer(p, x->id, buffer, offset);
    return true;
}

static bool is_f32(const rfi_node *x) { return x->dtype == RF_F32; }

/* Whether n is an f32 convolution with two spatial dims, no groups and low
 * padding >= 0, whose stride, rhs dilation and lhs dilation are 1 where
 * asked and at most DIRECT_MAX_STRIDE otherwise. */
static bool plain_conv(const rfi_node *n, bool unit_stride, bool unit_rhs, bool unit_lhs)
{
    const rfi_attrs *at = &n->attr;
    if (n->rank != 4 || !is_f32(n) || !is_f32(n->in[0]) || !is_f32(n->in[1]) ||
        at->i[0] != 1 || at->i[1] != 1)
        return false;
    for (int s = 0; s < 2; s++) {
        const int64_t v[3] = {at->l[0][s], at->l[4][s], at->l[3][s]};
        const bool unit[3] = {unit_stride, unit_rhs, unit_lhs};
        for (int k = 0; k < 3; k++)
            if (v[k] < 1 || v[k] > (unit[k] ? 1 : DIRECT_MAX_STRIDE))
                return false;
        if (at->l[1][s] < 0)
            return false;
    }
    return true;
}

/* FORWARD: the convolution's attributes in d; false when n is not of the form. */
static bool describe_forward(const rfi_plan *p, const rfi_node *n, rfi_kir_conv *d)
{
    const rfi_node *x = n->in[0], *w = n->in[1];
    const rfi_attrs *at = &n->attr;
    bool dilated = at->l[3][0] > 1 || at->l[3][1] > 1;
    bool strided = at->l[0][0] > 1 || at->l[0][1] > 1;
    if (!plain_conv(n, false, true, false) || (dilated && strided))
        return false;
    for (int s = 0; s < 2; s++)
        if (at->l[2][s] < 0)
            return false;
    if (!buffer_of(p, x, &d->x_buffer, &d->x_offset) ||
        !buffer_of(p, w, &d->w_buffer, &d->w_offset) ||
        rfi_plan_layout(p, w->id) != RFI_LAYOUT_PLAIN)
        return false;
    d->kind = RFI_KIR_CONV_FORWARD;
    d->n = x->dims[0], d->c = x->dims[1], d->h = x->dims[2], d->w = x->dims[3];
    d->o = w->dims[0], d->kh = w->dims[2], d->kw = w->dims[3];
    d->oh = n->dims[2], d->ow = n->dims[3];
    for (int s = 0; s < 2; s++) {
        d->stride[s] = at->l[0][s];
        d->pad[s] = at->l[1][s];
        d->dilation[s] = at->l[3][s];
    }
    d->x_layout = rfi_plan_layout(p, x->id);
    return true;
}

/* The materialised value operand k of n reads through a transpose that the
 * plan left inline (a view swapping dims 0 and 1, plan.h), or NULL. */
static const rfi_node *viewed(const rfi_plan *p, const rfi_node *n, int k)
{
    const rfi_node *t = n->in[k];
    if (t->op != RFI_OP_TRANSPOSE || p->loc[t->id].kind != RFI_LOC_INLINE ||
        p->loc[t->in[0]->id].kind == RFI_LOC_INLINE)
        return NULL;
    return t->in[0];
}

/* ---- An output gradient spread by a max pool's codes ----------------------------------- */

/* The operand of x when x is broadcast_in_dim mapping its dims to `map` (n
 * entries), else NULL. */
static const rfi_node *broadcast_operand(const rfi_node *x, const int64_t *map, int n)
{
    if (x->op != RFI_OP_BROADCAST_IN_DIM || x->attr.nl[0] != n ||
        memcmp(x->attr.l[0], map, sizeof(int64_t) * (size_t)n) != 0)
        return NULL;
    return x->in[0];
}

/* x is a splat of f32 +0 (a broadcast of a rank-0 constant with zero bytes). */
static bool is_plus_zero_splat(const rfi_node *x)
{
    return x->dtype == RF_F32 && rfi_node_is_plus_zero(x);
}

/* k is an i32 constant [wh, ww] numbering its points 0, 1, ... row-major. */
static bool is_point_numbers(const rfi_node *k, int64_t wh, int64_t ww)
{
    if (k->op != RFI_OP_CONSTANT || k->dtype != RF_I32 || k->rank != 2 || k->dims[0] != wh ||
        k->dims[1] != ww || !k->attr.data)
        return false;
    for (int64_t p = 0; p < wh * ww; p++) {
        int32_t v;
        memcpy(&v, (const char *)k->attr.data + p * (int64_t)sizeof v, sizeof v);
        if (v != p)
            return false;
    }
    return true;
}

/* The one step that materialises dy and nothing else, when dy's one user is
 * the transpose t (which reads it) and t's is the convolution (which reads
 * t), outputs and updates counted as users; else -1. */
static int sole_step_of(const rfi_plan *p, const rfi_node *dy, const rfi_node *t)
{
    int *uses = rfi_use_counts(p->g);
    bool sole = uses && uses[dy->id] == 1 && uses[t->id] == 1;
    rfi_free(uses);
    for (int s = 0; sole && s < p->n_steps; s++)
        if (p->steps[s].kind == RFI_STEP_LOOP && p->steps[s].n_roots == 1 &&
            p->steps[s].roots[0] == dy->id)
            return s;
    return -1;
}

/* dy [N, O, OH, OW], read by a weight-gradient convolution through transpose
 * t, is exactly the spread of passes/pools.c's scatter_by_codes with 2-D
 * windows that cover it,
 *   reshape(select(codes_b == points_b, +0 + g_b, +0)) over [N, O, PH, WH, PW, WW],
 * from materialised codes and g in one layout, and only that convolution
 * reads it: d gets the spread's description. */
static bool describe_spread(const rfi_plan *p, const rfi_node *dy, const rfi_node *t,
                            rfi_kir_conv *d)
{
    static const int64_t over_windows[4] = {0, 1, 2, 4}, window_points[2] = {3, 5};
    const rfi_node *sel = dy->op == RFI_OP_RESHAPE ? dy->in[0] : NULL;
    if (!sel || sel->op != RFI_OP_SELECT || sel->rank != 6 || dy->rank != 4 ||
        sel->dims[0] != dy->dims[0] || sel->dims[1] != dy->dims[1] ||
        sel->dims[2] * sel->dims[3] != dy->dims[2] || sel->dims[4] * sel->dims[5] != dy->dims[3])
        return false;
    const rfi_node *eq = sel->in[0], *value = sel->in[1];
    if (eq->op != RFI_OP_COMPARE || eq->attr.i[0] != RF_EQ || !is_plus_zero_splat(sel->in[2]) ||
        value->op != RFI_OP_ADD || !is_plus_zero_splat(value->in[0]))
        return false;
    const rfi_node *codes = broadcast_operand(eq->in[0], over_windows, 4);
    const rfi_node *points = broadcast_operand(eq->in[1], window_points, 2);
    const rfi_node *g = broadcast_operand(value->in[1], over_windows, 4);
    if (!codes || codes->dtype != RF_I32 || !points ||
        !is_point_numbers(points, sel->dims[3], sel->dims[5]) || !g || g->dtype != RF_F32)
        return false;
    int step = sole_step_of(p, dy, t);
    if (step < 0 || rfi_plan_layout(p, codes->id) != rfi_plan_layout(p, g->id) ||
        !buffer_of(p, codes, &d->codes_buffer, &d->codes_offset) ||
        !buffer_of(p, g, &d->w_buffer, &d->w_offset))
        return false;
    d->spread = true;
    d->spread_step = step;
    d->win[0] = sel->dims[3];
    d->win[1] = sel->dims[5];
    d->w_layout = rfi_plan_layout(p, g->id);
    return true;
}

/* WEIGHT_GRAD: conv(lhs = x^T [c, n, h, w], rhs = dy^T [o, n, oh, ow]) =
 * [c, o, kh, kw], res[c, o, q] = sum over n, p of lhs[c, n, q + p*r - lo] *
 * rhs[o, n, p] (r its rhs dilation: the forward's stride; lo its low
 * padding); false when n is not of the form. */
static bool describe_weight_grad(const rfi_plan *p, const rfi_node *n, rfi_kir_conv *d)
{
    const rfi_node *x = viewed(p, n, 0), *dy = viewed(p, n, 1);
    if (!x || !dy || !plain_conv(n, true, false, true))
        return false;
    buffer_of(p, x, &d->x_buffer, &d->x_offset);
    if (!describe_spread(p, dy, n->in[1], d)) {
        buffer_of(p, dy, &d->w_buffer, &d->w_offset);
        d->w_layout = rfi_plan_layout(p, dy->id);
    }
    d->kind = RFI_KIR_CONV_WEIGHT_GRAD;
    d->n = x->dims[0], d->c = x->dims[1], d->h = x->dims[2], d->w = x->dims[3];
    d->o = dy->dims[1], d->kh = n->dims[2], d->kw = n->dims[3];
    d->oh = dy->dims[2], d->ow = dy->dims[3];
    for (int s = 0; s < 2; s++) {
        d->stride[s] = n->attr.l[4][s];
        d->pad[s] = n->attr.l[1][s];
        d->dilation[s] = 1;
    }
    d->x_layout = rfi_plan_layout(p, x->id);
    return dy->dims[0] == d->n;
}

/* ---- A pool over the result ---------------------------------------------------------- */

/* x is a slice of y [N, C, OH, OW] that a pool over windows of `rows` rows
 * reads: dims 0 and 1 whole, every rows-th row from a row < rows, covering
 * them (OH = rows * x's rows), any columns. rows 0: any (set here). */
static bool is_window_slice(const rfi_node *x, const rfi_node *y, int64_t *rows)
{
    const rfi_attrs *a = &x->attr;
    if (x->op != RFI_OP_SLICE || x->in[0] != y || x->rank != 4)
        return false;
    for (int d = 0; d < 2; d++)
        if (a->l[0][d] != 0 || a->l[2][d] != 1 || x->dims[d] != y->dims[d])
            return false;
    if (*rows == 0)
        *rows = a->l[2][2];
    return a->l[2][2] == *rows && a->l[0][2] < *rows && x->dims[2] * *rows == y->dims[2];
}

/* Whether step s's results may be written while convolution step `conv`
 * still runs: s comes right after it (no step between reads what they
 * overwrite, and s reads nothing computed after the convolution), and the
 * plan keeps the convolution's operands live until s (rfi_step runs_pool),
 * so none of s's results shares bytes with them. */
static bool runs_early(const rfi_plan *p, int conv, int s)
{
    return s == conv + 1 && p->steps[conv].runs_pool;
}

/* The step that is the only reader of the result y of forward convolution
 * step `conv`, when it is a LOOP step over [N, C, OH / rows, ...] in y's
 * layout that reads y only through window slices (is_window_slice) and may
 * run during the convolution (runs_early), and y is laid out in channel
 * blocks of d->lanes; else -1. The decision reads no offsets: the plan asks
 * before memory planning (plan.c) and the lowering after. */
static int pool_step_of(const rfi_plan *p, int conv, const rfi_node *y, const rfi_kir_conv *d,
                        int64_t *rows)
{
    rfi_layout layout = rfi_plan_layout(p, y->id);
    if (!rfi_layout_blocked(layout) || rfi_layout_block(layout) != d->lanes)
        return -1;
    int *uses = rfi_use_counts(p->g);
    int readers = 0, step = -1;
    *rows = 0;
    bool ok = uses != NULL;
    for (int id = 0; ok && id < p->g->n_nodes; id++) {
        const rfi_node *x = p->g->nodes[id];
        for (int k = 0; ok && k < x->n_in; k++)
            if (x->in[k] == y) {
                readers++;
                ok = is_window_slice(x, y, rows) && p->loc[x->id].kind == RFI_LOC_INLINE;
            }
    }
    ok = ok && readers > 0 && uses[y->id] == readers;
    rfi_free(uses);
    /* the steps computing those slices: exactly one LOOP step */
    for (int s = 0; ok && s < p->n_steps; s++) {
        const rfi_step *st = &p->steps[s];
        bool reads = false;
        for (int f = 0; f < st->n_fused && !reads; f++) {
            const rfi_node *x = p->g->nodes[st->fused[f]];
            reads = x->op == RFI_OP_SLICE && x->in[0] == y;
        }
        if (reads) {
            ok = step < 0 && st->kind == RFI_STEP_LOOP;
            step = s;
        }
    }
    if (!ok || step < 0 || !runs_early(p, conv, step))
        return -1;
    const rfi_step *st = &p->steps[step];
    for (int r = 0; r < st->n_roots; r++) {
        const rfi_node *x = p->g->nodes[st->roots[r]];
        if (x->rank != 4 || x->dims[0] != y->dims[0] || x->dims[1] != y->dims[1] ||
            x->dims[2] * *rows != y->dims[2] || rfi_plan_layout(p, x->id) != layout)
            return -1;
    }
    return step;
}

/* The step's epilogue in d; false when an op is not one the loop applies. */
static bool describe_epilogue(const rfi_plan *p, const rfi_step *st, rfi_kir_conv *d)
{
    d->n_epi = st->n_epilogue;
    for (int e = 0; e < st->n_epilogue; e++) {
        const rfi_epi_op *op = &st->epilogue[e];
        d->epi[e] = op->kind;
        d->epi_buffer[e] = -1;
        d->epi_offset[e] = 0;
        if (op->kind == RFI_EPI_RELU)
            continue;
        if (op->kind != RFI_EPI_BIAS && op->kind != RFI_EPI_ADD)
            return false;
        const rfi_node *v = p->g->nodes[op->operand];
        if (!is_f32(v) || !buffer_of(p, v, &d->epi_buffer[e], &d->epi_offset[e]))
            return false;
        if (op->kind == RFI_EPI_BIAS && (op->axis != 1 || v->rank != 1 || v->dims[0] != d->o))
            return false;
        if (op->kind == RFI_EPI_ADD && rfi_plan_layout(p, v->id) != d->y_layout)
            return false;
    }
    return true;
}

/* A weight gradient of few input channels to more outputs than a vector
 * holds, whose output gradient is channel-blocked: one loop over the blocks,
 * a vector each, when
 *   - the blocks hold 8 (where the machine's vectors hold 8 floats: AVX2).
 *     oneDNN's AVX2 weight-gradient kernel pads the input channels to a
 *     block of 8, where its AVX-512 one has a first-layer form: the cnn's
 *     1 -> 32 layer (64 images) took 3.0-3.3 ms in oneDNN against 0.58 in
 *     the loops on a 2-core AVX2 machine (the step 16.5-16.9 ms against
 *     11.8-12.4);
 *   - or the output gradient is a spread pool gradient (describe_spread),
 *     any block: the loop reads the pooled cotangent and the codes, 1/4 of
 *     the spread (1.4 + 1.4 MB against 5.5 MB for the cnn's first layer),
 *     and the step that wrote the spread goes. On a 2-core AVX-512 machine
 *     that loop alone took as long as oneDNN's kernel (0.18-0.21 against
 *     0.18-0.22 ms in the step), and the spread's loop took 0.19-0.26 ms. */
static bool gradient_vectors(const rfi_kir_conv *d)
{
    if (d->kind != RFI_KIR_CONV_WEIGHT_GRAD || !rfi_layout_blocked(d->w_layout) ||
        (d->w_layout != RFI_LAYOUT_C8 && !d->spread))
        return false;
    int64_t block = rfi_layout_block(d->w_layout);
    return d->o % block == 0 && d->o <= DIRECT_MAX_VECTORS * 8;
}

/* A forward convolution to 16 output channels where the machine's vectors
 * hold 8 floats: two vectors of 8 (render_conv.c keeps both in each register
 * block). On a 2-core AVX2 machine the ResNet's 3x3 8 -> 16 strided layer
 * took 0.42-0.43 ms as such a loop against oneDNN's 0.49-0.50, its 1x1
 * projection about the same either way. With 32 output channels oneDNN is
 * faster: the cnn's 1 -> 32 first layer took 0.46 ms there and 0.54 ms as
 * a loop of 4 vectors (one thread). */
static bool forward_vectors_of_8(const rfi_plan *p, const rfi_kir_conv *d)
{
    return d->kind == RFI_KIR_CONV_FORWARD && p->channel_blocks == RFI_LAYOUT_C8 && d->o == 16;
}

/* A forward convolution to at most 32 output channels in vectors of the
 * plan's channel block (16, or 8 where the machine's vectors hold 8) with a
 * pool over its result (pool_step): a loop that writes the 5.5 MB result of
 * the cnn's 1 -> 32 first layer row by row and pools each pair of rows
 * while they are in the cache, where oneDNN's kernel and the pool's loop
 * each went through the whole of it (and the services' relu, which
 * oneDNN's kernel never applies: rfi_dnnl_post_faithful).
 * On a 2-core AVX2 machine, in four vectors of 8 and with the rows in a
 * tile, the layer and its pool took 0.38-0.39 ms in the cnn step against
 * 0.39-0.42 ms for oneDNN's kernel and 0.12-0.13 for the pool's loop. */
static bool pooled_vectors(const rfi_plan *p, const rfi_kir_conv *d)
{
    int64_t block = rfi_layout_block(p->channel_blocks);
    return d->kind == RFI_KIR_CONV_FORWARD && d->pool_step >= 0 &&
           rfi_layout_blocked(p->channel_blocks) && d->o % block == 0 &&
           d->o <= POOLED_MAX_OUT;
}

/* The input gradient of a strided 1x1 projection (spread_1x1) to
 * more output channels than one vector, in vectors of 16 (the plan's
 * channel block where the machine's vectors hold 16 floats; not measured
 * with 8). In the ResNet example's step, the 64 -> 32 one (128 images, 14x14
 * result, 13 MFLOP, with the other branch's gradient added) took 400-410 us
 * as such a loop of two vectors against 590-660 for oneDNN's backward-data
 * and the services' add (RF_PROFILE, four runs each; the whole step the
 * same within noise). The strided 1x1 forwards stay calls: as loops the
 * 16 -> 32 one took 414 us against oneDNN's ~224, the 32 -> 64 one 217
 * against ~160. */
/* Whether d is a 1x1 kernel over a dilated input (the input gradient of a
 * strided 1x1 projection) of at most SPREAD_1X1_MAX_IN_CHANNELS channels. */
static bool spread_1x1(const rfi_kir_conv *d)
{
    bool dilated = d->dilation[0] > 1 || d->dilation[1] > 1;
    return dilated && d->kh == 1 && d->kw == 1 && d->c <= SPREAD_1X1_MAX_IN_CHANNELS;
}

static bool spread_1x1_vectors(const rfi_plan *p, const rfi_kir_conv *d)
{
    return d->kind == RFI_KIR_CONV_FORWARD && spread_1x1(d) &&
           p->channel_blocks == RFI_LAYOUT_C16 && d->o % 16 == 0 && d->o <= SPREAD_1X1_MAX_OUT;
}

/* The channel counts and sizes the generated loops are chosen for. Sixteen
 * output channels are one vector only where the machine's vectors hold 16
 * floats (the plan's channel blocks say which): gcc lowers a 16-lane vector
 * on AVX2 to pairs of 8-lane operations with spills, and an 8 -> 16
 * strided forward took 5.6 ms as such a loop against oneDNN's 0.9; there
 * the loops take 8 at a time (gradient_vectors, forward_vectors_of_8). */
static bool wanted(const rfi_plan *p, const rfi_kir_conv *d)
{
    int64_t padded_width = (d->ow - 1) * d->stride[1] + d->kw;
    int64_t table = d->c * d->kh * d->kw * d->o;
    int64_t most = d->kind == RFI_KIR_CONV_FORWARD ? DIRECT_MAX_WEIGHTS : DIRECT_MAX_GRADIENT;
    bool dilated = d->dilation[0] > 1 || d->dilation[1] > 1;
    bool one_vector = d->o == 8 || (d->o == 16 && p->channel_blocks == RFI_LAYOUT_C16);
    bool vectors = gradient_vectors(d) || forward_vectors_of_8(p, d) || pooled_vectors(p, d) ||
                   spread_1x1_vectors(p, d);
    return (d->c <= DIRECT_MAX_IN_CHANNELS + dilated || spread_1x1(d)) && (one_vector || vectors) &&
           d->kh <= DIRECT_MAX_KERNEL && d->kw <= DIRECT_MAX_KERNEL && table <= most &&
           d->kh * padded_width * d->c <= DIRECT_MAX_ROWS && d->n * d->oh * d->ow > 0;
}

/* The output channels in one vector of the loops: o, or 8 for the forms
 * above that take 8 at a time (a weight gradient: its output gradient's
 * channel block). */
static int64_t lanes_of(const rfi_plan *p, const rfi_kir_conv *d)
{
    if (d->kind == RFI_KIR_CONV_FORWARD) {
        if (forward_vectors_of_8(p, d))
            return 8;
        if (pooled_vectors(p, d) || spread_1x1_vectors(p, d))
            return rfi_layout_block(p->channel_blocks);
        return d->o;
    }
    return rfi_layout_blocked(d->w_layout) ? rfi_layout_block(d->w_layout) : d->o;
}

/* A vector's channels are stored (or, for a weight gradient, loaded) at
 * consecutive addresses: a channel-blocked result or output gradient must
 * have blocks of exactly that many, and o must be a whole number of
 * vectors. */
static bool one_block_of_lanes(const rfi_kir_conv *d)
{
    rfi_layout l = d->kind == RFI_KIR_CONV_FORWARD ? d->y_layout : d->w_layout;
    return d->o % d->lanes == 0 && (!rfi_layout_blocked(l) || rfi_layout_block(l) == d->lanes);
}

bool rfi_kir_direct_conv(const rfi_plan *p, int step, rfi_kir_conv *out)
{
    const rfi_step *st = &p->steps[step];
    if (!p->direct_convs || st->kind != RFI_STEP_CALL || st->call != RFI_CALL_CONV ||
        st->n_roots != 1)
        return false;
    const rfi_node *n = p->g->nodes[st->core], *y = p->g->nodes[st->roots[0]];
    if (n->op != RFI_OP_CONVOLUTION)
        return false;
    rfi_kir_conv d;
    memset(&d, 0, sizeof d);
    d.pool_step = d.pool_kernel = -1;
    d.bf16 = rfi_conv_bf16(n);
    bool forward = describe_forward(p, n, &d);
    if (!forward && (st->n_epilogue > 0 || !describe_weight_grad(p, n, &d)))
        return false;
    if (!buffer_of(p, y, &d.y_buffer, &d.y_offset))
        return false;
    d.y_layout = rfi_plan_layout(p, y->id);
    if (!forward && d.y_layout != RFI_LAYOUT_PLAIN)
        return false;
    if (forward && rfi_layout_blocked(p->channel_blocks) && d.y_layout == p->channel_blocks) {
        d.lanes = rfi_layout_block(p->channel_blocks); /* what pooled_vectors takes */
        d.pool_step = pool_step_of(p, step, y, &d, &d.pool_rows);
        d.pool_groups = d.o / d.lanes;
        /* [N, O / L, OH, OW, L]: rows i .. i + pool_rows - 1 of one image */
        int64_t span = ((d.pool_groups - 1) * d.oh + d.pool_rows) * d.ow * d.lanes;
        d.tile_floats = d.pool_step >= 0 && span <= TILE_MAX_FLOATS ? span : 0;
        d.tiled = d.pool_step >= 0 && p->loc[y->id].kind == RFI_LOC_TILE;
    }
    if (!describe_epilogue(p, st, &d) || !wanted(p, &d))
        return false;
    d.lanes = lanes_of(p, &d);
    if (!one_block_of_lanes(&d))
        return false;
    if (out)
        *out = d;
    return true;
}
