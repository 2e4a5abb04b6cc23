/* layout.c: the plan's layout pass (plan.h): which activations live in a
 * convolution's layout, channel-blocked (RFI_LAYOUT_C8 or C16) or channels last
 * (RFI_LAYOUT_NHWC), instead of row-major.
 *
 * Why: oneDNN's convolutions run on channel-blocked layouts (channels last
 * with few channels), so a row-major activation between two of them costs
 * a reorder on every write and read (on the cnn benchmark, seven reorders
 * of activations and about a fifth of the step). The generated kernels
 * address a laid-out value as easily as a row-major one, and a kernel whose
 * roots are laid out loops in their order (kir_lower.c), so the pools,
 * masks and reductions between convolutions read and write the library's
 * layout directly.
 *
 * A value is laid out (channel-blocked when C is a multiple of the plan's
 * block, else NHWC) when
 *   - it can be: an [N, C, H, W] arena value with C >= 2 whose bytes no
 *     other node aliases (a reshape would read them row-major); calls take
 *     f32 values only (generated steps any dtype: the i32 codes of a max
 *     pool, pools.c, follow its pooled values);
 *   - every step touching it takes the layout: generated LOOP (unless
 *     segmented) and REDUCE steps (but for the operands of a convolution
 *     computed as loops, whose terms read them along their rows); a
 *     convolution reading it through a transposed view, or (unless it is a weight gradient) reading it as its
 *     input (operand 0) or writing it, and a blocked one adding it as a
 *     residual (services.c reorders a residual whose layout is not the
 *     result's; see residual_takes for channels last);
 *     a select_and_scatter (the max-pool gradient, blocked only) reading or
 *     writing it; never a matmul, another call or a copy;
 *   - and it pays: a convolution writes or reads it, or a generated or
 *     scatter step computes it from, or into, a laid-out value of the same
 *     images and channels (repeated until nothing changes: the relu mask
 *     between an input gradient and a pool gradient, a pool's codes and the
 *     cotangent its gradient spreads).
 * The services take any layout on any call (services.c reorders where an
 * implementation does not), so these rules decide speed, never correctness.
 */
#include <string.h>

#include "plan_internal.h"

typedef struct layout_pass {
    rfi_plan *p;
    const rfi_graph *g;
    unsigned char *ok;      /* per node: every touch so far takes the layout */
    unsigned char *by_conv; /* per node: a convolution reads or writes it */
    rfi_intlist touched;    /* the touches of the step being walked */
    bool failed;
} layout_pass;

/* The layout an [N, C, H, W] value takes when it leaves row-major order:
 * the plan's channel blocks when C is a multiple of their size, else
 * channels last (what oneDNN's convolutions use for few channels). */
static rfi_layout layout_for(const rfi_plan *p, const rfi_node *x)
{
    if (x->rank != 4 || x->dims[1] < 2)
        return RFI_LAYOUT_PLAIN;
    return x->dims[1] % rfi_layout_block(p->channel_blocks) == 0 ? p->channel_blocks
                                                                   : RFI_LAYOUT_NHWC;
}

static bool blockable(const rfi_plan *p, const rfi_node *x)
{
    return p->loc[x->id].kind == RFI_LOC_ARENA && layout_for(p, x) != RFI_LAYOUT_PLAIN &&
           rfi_node_numel(x) > 0;
}

/* Step q reads or writes x; `takes`: in a role that takes the blocked layout. */
static void touch(layout_pass *L, const rfi_node *x, bool takes, bool conv)
{
    if (!takes)
        L->ok[x->id] = 0;
    if (conv)
        L->by_conv[x->id] = 1;
    if (!rfi_intlist_push(&L->touched, x->id))
        L->failed = true;
}

static bool is_segmented(const rfi_plan *p, int q)
{
    return p->seg_extent && p->seg_extent[q] > 0;
}

/* The materialised operands read by the nodes a generated step computes. */
static void touch_kernel_reads(layout_pass *L, const int *ids, int n, bool takes)
{
    for (int i = 0; i < n; i++) {
        const rfi_node *v = L->g->nodes[ids[i]];
        for (int j = 0; j < v->n_in; j++)
            if (L->p->loc[v->in[j]->id].kind != RFI_LOC_INLINE)
                touch(L, v->in[j], takes, false);
    }
}

static bool has_residual(const rfi_step *s)
{
    for (int e = 0; e < s->n_epilogue; e++)
        if (s->epilogue[e].kind == RFI_EPI_ADD)
            return true;
    return false;
}

/* A convolution's result with a residual add, or the residual, in layout l:
 * blocked ones are the convolutions' own layout, but an 8-channel result
 * channels last would be reordered from oneDNN's padded 16-channel blocks
 * (its backward-data kernels' choice), which measured 3x slower than
 * reordering it row-major. */
static bool residual_takes(rfi_layout l)
{
    return rfi_layout_blocked(l);
}

/* A convolution whose kernel has more positions than its result: the
 * weight-gradient form, whose plain operands and result are [C, N, ...] and
 * [C, O, ...] (channels in dim 0); only its views hold activations. */
static bool weight_gradient_form(const rfi_node *conv)
{
    const rfi_node *w = conv->in[1];
    return rfi_numel(w->dims + 2, w->rank - 2) > rfi_numel(conv->dims + 2, conv->rank - 2);
}

static void touch_call(layout_pass *L, const rfi_step *s)
{
    const rfi_node *core = L->g->nodes[s->n_epilogue > 0 ? s->core : s->roots[0]];
    bool conv = s->call == RFI_CALL_CONV && core->op == RFI_OP_CONVOLUTION;
    bool activations = conv && !weight_gradient_form(core);
    bool scatter = s->call == RFI_CALL_FALLBACK && core->op == RFI_OP_SELECT_AND_SCATTER;
    for (int j = 0; j < core->n_in; j++) {
        const rfi_node *x = core->in[j];
        bool view = conv && j < 2 && x->op == RFI_OP_TRANSPOSE &&
                    L->p->loc[x->id].kind == RFI_LOC_INLINE;
        if (view)
            x = x->in[0];
        bool takes = (activations && j == 0) || view ||
                     (scatter && j < 2 && rfi_layout_blocked(layout_for(L->p, x)));
        touch(L, x, takes && x->dtype == RF_F32, conv);
    }
    for (int e = 0; e < s->n_epilogue; e++)
        if (s->epilogue[e].operand >= 0) { /* the services reorder a residual to the result's */
            const rfi_node *y = L->g->nodes[s->epilogue[e].operand];
            touch(L, y, conv && s->epilogue[e].kind == RFI_EPI_ADD && y->dtype == RF_F32 &&
                            residual_takes(layout_for(L->p, y)), false);
        }
    const rfi_node *root = L->g->nodes[s->roots[0]];
    bool takes = (activations && (!has_residual(s) || residual_takes(layout_for(L->p, root)))) ||
                 (scatter && rfi_layout_blocked(layout_for(L->p, root)));
    touch(L, root, takes && root->dtype == RF_F32, conv);
}

/* Records in L->touched every node step q reads or writes (ok and by_conv updated). */
static void walk_step(layout_pass *L, int q)
{
    const rfi_step *s = &L->p->steps[q];
    L->touched.n = 0;
    switch (s->kind) {
    case RFI_STEP_LOOP:
    case RFI_STEP_REDUCE: {
        bool takes = !is_segmented(L->p, q);
        /* a convolution's loops read along its operands' rows (conv_value) */
        const rfi_node *core = L->g->nodes[s->core >= 0 ? s->core : s->roots[0]];
        bool reads_take = takes && core->op != RFI_OP_CONVOLUTION;
        touch_kernel_reads(L, s->roots, s->n_roots, reads_take);
        touch_kernel_reads(L, s->fused, s->n_fused, reads_take);
        for (int r = 0; r < s->n_roots; r++)
            touch(L, L->g->nodes[s->roots[r]], takes, false);
        break;
    }
    case RFI_STEP_CALL: touch_call(L, s); break;
    default:
        for (int r = 0; r < s->n_roots; r++)
            touch(L, L->g->nodes[s->roots[r]], false, false);
        break;
    }
}

/* Both [N, C, ...] with the same N and C: a kernel walking one in blocked
 * order reads or writes the other's lanes contiguously too when it is
 * blocked (a pool's result and codes beside its operand, a cotangent beside
 * the gradient scattered from it). */
static bool same_images(const rfi_node *a, const rfi_node *b)
{
    return a->rank == 4 && b->rank == 4 && a->dims[0] == b->dims[0] && a->dims[1] == b->dims[1];
}

/* One round of "computed from or into a blocked value of the same images". */
static bool spread(layout_pass *L)
{
    bool changed = false;
    for (int q = 0; q < L->p->n_steps && !L->failed; q++) {
        const rfi_step *s = &L->p->steps[q];
        if (s->kind == RFI_STEP_COPY || (s->kind == RFI_STEP_CALL && s->call != RFI_CALL_FALLBACK))
            continue;
        walk_step(L, q);
        for (int i = 0; i < L->touched.n; i++) {
            const rfi_node *y = L->g->nodes[L->touched.v[i]];
            if (L->p->layout[y->id] == RFI_LAYOUT_PLAIN)
                continue;
            for (int j = 0; j < L->touched.n; j++) {
                const rfi_node *x = L->g->nodes[L->touched.v[j]];
                if (L->ok[x->id] && L->p->layout[x->id] == RFI_LAYOUT_PLAIN &&
                    same_images(x, y)) {
                    L->p->layout[x->id] = (unsigned char)layout_for(L->p, x);
                    changed = true;
                }
            }
        }
    }
    return changed;
}

rf_status rfi_plan_choose_layouts(rfi_plan *p)
{
    const rfi_graph *g = p->g;
    size_t n = (size_t)g->n_nodes + 1;
    layout_pass L = {p, g, rfi_calloc(n, 1), rfi_calloc(n, 1), {0}, false};
    p->layout = rfi_arena_alloc(&p->mem, n);
    if (!L.ok || !L.by_conv || !p->layout) {
        rfi_free(L.ok);
        rfi_free(L.by_conv);
        return rfi_error(RF_E_NOMEM, "rfi_plan_build: out of memory choosing layouts");
    }
    memset(p->layout, RFI_LAYOUT_PLAIN, n);
    for (int x = 0; x < g->n_nodes; x++)
        L.ok[x] = blockable(p, g->nodes[x]);
    for (int x = 0; x < g->n_nodes; x++)
        if (p->loc[x].kind == RFI_LOC_ALIAS && p->loc[x].alias >= 0)
            L.ok[p->loc[x].alias] = 0;
    for (int q = 0; q < p->n_steps && !L.failed; q++)
        walk_step(&L, q);
    for (int x = 0; x < g->n_nodes; x++)
        if (L.ok[x] && L.by_conv[x])
            p->layout[x] = (unsigned char)layout_for(p, g->nodes[x]);
    while (!L.failed && spread(&L)) {
    }
    rfi_free(L.ok);
    rfi_free(L.by_conv);
    rfi_intlist_free(&L.touched);
    if (L.failed) {
        memset(p->layout, RFI_LAYOUT_PLAIN, n);
        return rfi_error(RF_E_NOMEM, "rfi_plan_build: out of memory choosing layouts");
    }
    return RF_OK;
}

int rfi_plan_count_layout(const rfi_plan *p, rfi_layout l)
{
    int count = 0;
    for (int x = 0; p && x < p->g->n_nodes; x++)
        count += p->loc[x].kind != RFI_LOC_INLINE && rfi_plan_layout(p, x) == l;
    return count;
}
