/* kir_conv.c: which CALL CONV steps a backend generates as direct
 * convolutions (kir.h RFI_KIR_STEP_CONV), and their description.
 *
 * The form: an f32 convolution with two spatial dims, no feature or batch
 * groups, no lhs or rhs dilation and padding >= 0, whose operands are
 * materialised (not a transposed view), whose kernel is row-major, and
 * whose epilogue is a per-channel bias, relu and residual adds in the
 * result's layout. The forward convolutions of a network and the input
 * gradients of its stride-1 layers (a convolution with the flipped kernel)
 * have it; weight gradients (image-sized kernels over transposed views) and
 * the input gradients of strided layers (lhs dilation) do not.
 *
 * The choice: fewer than 16 input channels and a multiple of 8 output
 * channels, up to 64, with kernels up to 7x7. There the library is at its
 * slowest: oneDNN ran the ResNet's 8 -> 8 channel 3x3 convolutions at ~95
 * GFLOP/s and its 1 -> 8 first layer at ~30, where the generated loop (one
 * vector of output channels times a row of outputs per register block;
 * render_conv.c) ran at 140-175 on this 2-core machine. With 16 or more
 * input channels oneDNN's blocked kernels reached 200+ GFLOP/s, so those
 * stay calls. The limits keep the renderer's stack tables small: the
 * kernel reordered for the loop (c*kh*kw*o floats) and the padded input
 * rows (kh rows of the width the outputs read).
 */
#include <string.h>

#include "kir.h"

#define DIRECT_MAX_IN_CHANNELS 15
#define DIRECT_MAX_OUT_CHANNELS 64
#define DIRECT_MAX_KERNEL 7
#define DIRECT_MAX_STRIDE 4
#define DIRECT_MAX_WEIGHTS 4096 /* c * kh * kw * o floats */
#define DIRECT_MAX_ROWS 8192    /* kh * padded width * c floats */

/* Materialised node x's buffer and offset; false when x has none (inline). */
static bool buffer_of(const rfi_plan *p, const rfi_node *x, int *buffer, size_t *offset)
{
    if (p->loc[x->id].kind == RFI_LOC_INLINE)
        return false;
    rfi_plan_buffer(p, x->id, buffer, offset);
    return true;
}

static bool is_f32(const rfi_node *x) { return x->dtype == RF_F32; }

/* The convolution's own attributes in d; false when it is not of the form. */
static bool describe_conv(const rfi_plan *p, const rfi_node *n, rfi_kir_conv *d)
{
    const rfi_node *x = n->in[0], *w = n->in[1];
    const rfi_attrs *at = &n->attr;
    if (n->rank != 4 || !is_f32(n) || !is_f32(x) || !is_f32(w) || at->i[0] != 1 ||
        at->i[1] != 1)
        return false;
    for (int s = 0; s < 2; s++)
        if (at->l[3][s] != 1 || at->l[4][s] != 1 || at->l[1][s] < 0 || at->l[2][s] < 0 ||
            at->l[0][s] < 1 || at->l[0][s] > DIRECT_MAX_STRIDE)
            return false;
    if (!buffer_of(p, x, &d->x_buffer, &d->x_offset) ||
        !buffer_of(p, w, &d->w_buffer, &d->w_offset) ||
        rfi_plan_layout(p, w->id) != RFI_LAYOUT_PLAIN)
        return false;
    d->n = x->dims[0], d->c = x->dims[1], d->h = x->dims[2], d->w = x->dims[3];
    d->o = w->dims[0], d->kh = w->dims[2], d->kw = w->dims[3];
    d->oh = n->dims[2], d->ow = n->dims[3];
    for (int s = 0; s < 2; s++) {
        d->stride[s] = at->l[0][s];
        d->pad[s] = at->l[1][s];
    }
    d->x_layout = rfi_plan_layout(p, x->id);
    return true;
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

/* The channel counts and sizes the generated loop is chosen for. */
static bool wanted(const rfi_kir_conv *d)
{
    int64_t padded_width = (d->ow - 1) * d->stride[1] + d->kw;
    return d->c <= DIRECT_MAX_IN_CHANNELS && d->o % 8 == 0 &&
           d->o <= DIRECT_MAX_OUT_CHANNELS && d->kh <= DIRECT_MAX_KERNEL &&
           d->kw <= DIRECT_MAX_KERNEL && d->c * d->kh * d->kw * d->o <= DIRECT_MAX_WEIGHTS &&
           d->kh * padded_width * d->c <= DIRECT_MAX_ROWS && d->n * d->oh * d->ow > 0;
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
    if (!describe_conv(p, n, &d) || !buffer_of(p, y, &d.y_buffer, &d.y_offset))
        return false;
    d.y_layout = rfi_plan_layout(p, y->id);
    if (!describe_epilogue(p, st, &d) || !wanted(&d))
        return false;
    if (out)
        *out = d;
    return true;
}
