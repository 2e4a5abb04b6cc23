/* plan.c: the execution plan's entry points: default options, building
 * (fusion in fuse.c, memory planning in memplan.c, then the final arrays in
 * the plan's arena, CALL epilogues included), the buffer table, counts and
 * the readable dump.
 *
 * It does not decide fusion or offsets itself. Of how a backend turns steps
 * into code it knows one thing: which steps a direct convolution computes
 * itself (kir_conv.c), so that memory is not planned for them.
 */
#include <stdlib.h>
#include <string.h>

#include "kir.h"
#include "plan_internal.h"

/* ---- Small shared helpers ------------------------------------------------------------- */

bool rfi_intlist_push(rfi_intlist *l, int x)
{
    void *v = l->v;
    if (!rfi_grow(&v, l->n, &l->cap, sizeof *l->v))
        return false;
    l->v = v;
    l->v[l->n++] = x;
    return true;
}

bool rfi_intlist_has(const rfi_intlist *l, int x)
{
    for (int i = 0; i < l->n; i++)
        if (l->v[i] == x)
            return true;
    return false;
}

void rfi_intlist_free(rfi_intlist *l)
{
    rfi_free(l->v);
    memset(l, 0, sizeof *l);
}

int rfi_plan_resolve(const rfi_plan_builder *b, int x)
{
    while (b->p->loc[x].kind == RFI_LOC_ALIAS)
        x = b->p->loc[x].alias;
    return x;
}

int rfi_plan_step_pos(const rfi_plan_builder *b, int s) { return b->pos_of[s]; }

rfi_plan_opts rfi_plan_opts_default(void)
{
    rfi_plan_opts o;
    o.matmul_call_min_flops = 131072;
    o.dot_loop_max_rows = 4;
    o.in_place_updates = true;
    /* RF_CALL_EPILOGUES=0 in the environment turns epilogues off (benches). */
    const char *epi = getenv("RF_CALL_EPILOGUES");
    o.call_epilogues = !(epi && strcmp(epi, "0") == 0);
    o.matmul_epilogues = true;
    o.conv_transposed_views = false;
    o.blocked_activations = false;
    o.channel_blocks = RFI_LAYOUT_C16;
    o.direct_convs = false;
    o.concurrent_calls = false;
    const char *sib = getenv("RF_SIBLING_REDUCTIONS");
    o.sibling_reductions = !(sib && strcmp(sib, "0") == 0);
    const char *red = getenv("RF_REDUCE_EPILOGUES");
    o.reduce_epilogues = !(red && strcmp(red, "0") == 0);
    const char *iro = getenv("RF_INLINE_REDUCE_OPERANDS");
    o.inline_reduce_operands = !(iro && strcmp(iro, "0") == 0);
    return o;
}

/* ---- Building --------------------------------------------------------------------------- */

/* Distinct users of every node (CSR) and the output/update-value flags. */
static bool index_users(rfi_plan_builder *b)
{
    const rfi_graph *g = b->g;
    int n = b->n, total = 0;
    for (int i = 0; i < n; i++)
        total += g->nodes[i]->n_in;
    b->user_start = rfi_calloc((size_t)n + 2, sizeof *b->user_start);
    b->users = rfi_malloc(((size_t)total + 1) * sizeof *b->users);
    int *fill = rfi_calloc((size_t)n + 1, sizeof *fill);
    bool ok = b->user_start && b->users && fill;
    for (int i = 0; ok && i < n; i++) {
        const rfi_node *x = g->nodes[i];
        for (int k = 0; k < x->n_in; k++) {
            bool repeat = false;
            for (int j = 0; j < k; j++)
                repeat = repeat || x->in[j] == x->in[k];
            if (!repeat)
                b->user_start[x->in[k]->id + 1]++;
        }
    }
    for (int i = 0; ok && i < n; i++)
        b->user_start[i + 1] += b->user_start[i];
    for (int i = 0; ok && i < n; i++) {
        const rfi_node *x = g->nodes[i];
        for (int k = 0; k < x->n_in; k++) {
            bool repeat = false;
            for (int j = 0; j < k; j++)
                repeat = repeat || x->in[j] == x->in[k];
            int y = x->in[k]->id;
            if (!repeat)
                b->users[b->user_start[y] + fill[y]++] = i;
        }
    }
    rfi_free(fill);
    for (int i = 0; ok && i < g->n_outputs; i++)
        b->is_output[g->outputs[i]->id] = true;
    for (int i = 0; ok && i < g->n_updates; i++)
        b->is_update_value[g->updates[i].value->id] = true;
    return ok;
}

static bool builder_init(rfi_plan_builder *b, const rfi_graph *g, const rfi_plan_opts *opts,
                         rfi_plan *p)
{
    memset(b, 0, sizeof *b);
    b->g = g;
    b->opts = opts ? *opts : rfi_plan_opts_default();
    b->p = p;
    b->n = g->n_nodes;
    size_t n = (size_t)g->n_nodes + 1;
    b->is_output = rfi_calloc(n, sizeof *b->is_output);
    b->is_update_value = rfi_calloc(n, sizeof *b->is_update_value);
    b->mat = rfi_calloc(n, sizeof *b->mat);
    b->placed = rfi_calloc(n, sizeof *b->placed);
    b->step_of = rfi_malloc(n * sizeof *b->step_of);
    b->stamp = rfi_calloc(n, sizeof *b->stamp);
    b->seg_flat = rfi_malloc(n * sizeof *b->seg_flat);
    b->seg_off = rfi_calloc(n, sizeof *b->seg_off);
    b->epi_of = rfi_malloc(n * sizeof *b->epi_of);
    b->epi_inline = rfi_calloc(n, sizeof *b->epi_inline);
    if (!b->is_output || !b->is_update_value || !b->mat || !b->placed || !b->step_of ||
        !b->stamp || !b->seg_flat || !b->seg_off || !b->epi_of || !b->epi_inline)
        return false;
    for (int i = 0; i < g->n_nodes; i++)
        b->step_of[i] = b->seg_flat[i] = b->epi_of[i] = -1;
    return index_users(b);
}

static void builder_free(rfi_plan_builder *b)
{
    for (int s = 0; s < b->n_steps; s++) {
        rfi_intlist_free(&b->steps[s].roots);
        rfi_intlist_free(&b->steps[s].inputs);
    }
    rfi_free(b->steps);
    rfi_free(b->order);
    rfi_free(b->pos_of);
    rfi_free(b->user_start);
    rfi_free(b->users);
    rfi_free(b->is_output);
    rfi_free(b->is_update_value);
    rfi_free(b->mat);
    rfi_free(b->placed);
    rfi_free(b->step_of);
    rfi_free(b->stamp);
    rfi_free(b->seg_flat);
    rfi_free(b->seg_off);
    rfi_free(b->epi_of);
    rfi_free(b->epi_inline);
    rfi_free(b->epis);
}

/* A copy of list l in the plan's arena (NULL only on OOM; empty lists get a
 * valid pointer). */
static int *arena_ints(rfi_plan *p, const rfi_intlist *l)
{
    int *v = rfi_arena_alloc(&p->mem, (size_t)(l->n > 0 ? l->n : 1) * sizeof *v);
    if (v && l->n > 0)
        memcpy(v, l->v, (size_t)l->n * sizeof *v);
    return v;
}

static int cmp_int(const void *a, const void *c)
{
    int x = *(const int *)a, y = *(const int *)c;
    return (x > y) - (x < y);
}

/* The flat extent a LOOP step without segment roots is segmented over, or 0:
 * all its roots are vectors of one length and it fuses a concatenation into a
 * vector of that length (the flat gradient of every parameter an optimiser
 * update reads when nothing guards it). Unsegmented, such a loop picks each
 * element's operand through a chain of selects over all the operands: with
 * 400 parameter arrays that was 90% of a deep MLP's step. */
static int64_t concat_extent(const rfi_plan *p, const rfi_step *s)
{
    if (s->kind != RFI_STEP_LOOP)
        return 0;
    const rfi_node *r0 = p->g->nodes[s->roots[0]];
    if (r0->rank != 1)
        return 0;
    for (int r = 1; r < s->n_roots; r++) {
        const rfi_node *x = p->g->nodes[s->roots[r]];
        if (x->rank != 1 || x->dims[0] != r0->dims[0])
            return 0;
    }
    for (int f = 0; f < s->n_fused; f++) {
        const rfi_node *x = p->g->nodes[s->fused[f]];
        if (x->op == RFI_OP_CONCATENATE && x->rank == 1 && x->dims[0] == r0->dims[0] &&
            x->n_in >= 2)
            return r0->dims[0];
    }
    return 0;
}

/* p->seg_extent and p->seg_offset when some LOOP step has segment roots or
 * fuses a flat concatenation (concat_extent). */
static rf_status segment_arrays(rfi_plan_builder *b)
{
    rfi_plan *p = b->p;
    bool any = false;
    for (int x = 0; x < b->n; x++)
        any = any || b->seg_flat[x] >= 0;
    for (int q = 0; q < p->n_steps && !any; q++)
        any = concat_extent(p, &p->steps[q]) > 0;
    if (!any)
        return RF_OK;
    p->seg_extent = rfi_arena_alloc(&p->mem, (size_t)(p->n_steps > 0 ? p->n_steps : 1) *
                                                 sizeof *p->seg_extent);
    p->seg_offset = rfi_arena_alloc(&p->mem, (size_t)(b->n > 0 ? b->n : 1) * sizeof *p->seg_offset);
    if (!p->seg_extent || !p->seg_offset)
        return rfi_error(RF_E_NOMEM, "plan: out of memory");
    for (int x = 0; x < b->n; x++)
        p->seg_offset[x] = b->seg_flat[x] >= 0 ? b->seg_off[x] : -1;
    for (int q = 0; q < p->n_steps; q++) {
        const rfi_step *s = &p->steps[q];
        p->seg_extent[q] = 0;
        for (int r = 0; s->kind == RFI_STEP_LOOP && r < s->n_roots; r++)
            if (b->seg_flat[s->roots[r]] >= 0)
                p->seg_extent[q] = b->g->nodes[b->seg_flat[s->roots[r]]]->dims[0];
        if (p->seg_extent[q] == 0)
            p->seg_extent[q] = concat_extent(p, s);
    }
    return RF_OK;
}

/* A CALL or REDUCE step's core node and epilogue (others: core -1, none). */
static bool finish_epilogue(rfi_plan_builder *b, const rfi_bstep *bs, rfi_step *s)
{
    s->core = -1;
    s->epilogue = NULL;
    s->n_epilogue = 0;
    if ((bs->kind != RFI_STEP_CALL && bs->kind != RFI_STEP_REDUCE) || bs->roots.n < 1)
        return true;
    s->core = bs->roots.v[0];
    if (bs->epi < 0)
        return true;
    const rfi_epi_chain *ch = &b->epis[bs->epi];
    s->core = ch->core;
    s->epilogue = rfi_arena_alloc(&b->p->mem, (size_t)ch->n * sizeof *s->epilogue);
    if (!s->epilogue)
        return false;
    memcpy(s->epilogue, ch->ops, (size_t)ch->n * sizeof *s->epilogue);
    s->n_epilogue = ch->n;
    return true;
}

/* The builder's steps, in execution order, as the plan's arrays. */
static rf_status finish_steps(rfi_plan_builder *b)
{
    rfi_plan *p = b->p;
    p->steps = rfi_arena_alloc(&p->mem, (size_t)(b->n_steps > 0 ? b->n_steps : 1) *
                                            sizeof *p->steps);
    if (!p->steps)
        return rfi_error(RF_E_NOMEM, "plan: out of memory");
    for (int q = 0; q < b->n_steps; q++) {
        const rfi_bstep *bs = &b->steps[b->order[q]];
        rfi_step *s = &p->steps[q];
        rfi_intlist fused = {0};
        bool ok = rfi_fuse_step_fused(b, b->order[q], &fused);
        if (ok && fused.n > 1)
            qsort(fused.v, (size_t)fused.n, sizeof *fused.v, cmp_int);
        s->kind = bs->kind;
        s->call = bs->call;
        s->roots = arena_ints(p, &bs->roots);
        s->n_roots = bs->roots.n;
        s->fused = ok ? arena_ints(p, &fused) : NULL;
        s->n_fused = fused.n;
        s->copy_to_output = bs->copy_to_output;
        s->copy_to_capture = bs->copy_to_capture;
        s->copy_scratch = bs->copy_scratch;
        s->left_out = false;
        s->runs_pool = false;
        s->runs_with_next = false;
        rfi_intlist_free(&fused);
        if (!s->roots || !s->fused || !finish_epilogue(b, bs, s))
            return rfi_error(RF_E_NOMEM, "plan: out of memory");
    }
    p->n_steps = b->n_steps;
    return segment_arrays(b);
}

/* Which convolution steps are direct (rfi_step direct), decided once, before
 * memory planning, from the steps, the locations' kinds and the layouts,
 * never offsets: the lowering, describing a direct step again after memory
 * planning, gets the same answer. Two decisions go with it:
 * - each step is offered the pool over its result (runs_pool) and keeps the
 *   offer where the convolution takes it. Memory planning then keeps its
 *   operands live until the pool's step, whose results are written while the
 *   convolution still reads them, and a result whose window rows fit the
 *   convolution's tile takes no bytes at all (RFI_LOC_TILE): on the cnn,
 *   5.5 MB of its first layer's 64 images;
 * - the step whose root a direct convolution computes itself (kir_conv.c: a
 *   spread output gradient) is left out, its root unstored, so the arena
 *   holds no bytes that nothing writes. */
static void decide_direct_convs(rfi_plan *p)
{
    for (int s = 0; s < p->n_steps; s++) {
        rfi_step *st = &p->steps[s];
        if (st->kind != RFI_STEP_CALL || st->call != RFI_CALL_CONV)
            continue;
        rfi_kir_conv conv;
        st->runs_pool = true;
        st->direct = rfi_kir_direct_conv(p, s, &conv);
        st->runs_pool = st->direct && conv.pool_step >= 0;
        rfi_loc *y = &p->loc[st->roots[0]];
        if (st->runs_pool && conv.tile_floats > 0 && y->kind == RFI_LOC_ARENA)
            y->kind = RFI_LOC_TILE;
        if (!st->direct || !conv.spread)
            continue;
        rfi_step *spread = &p->steps[conv.spread_step];
        rfi_loc *root = &p->loc[spread->roots[0]];
        if (root->kind == RFI_LOC_ARENA) {
            spread->left_out = true;
            root->kind = RFI_LOC_UNSTORED;
        }
    }
}

/* How far past a library call (in steps) its partner may be. */
#define PAIR_WINDOW 4
/* The most times the larger of two matrix products may outweigh the smaller
 * for them to pair: side by side, the larger runs on one thread while the
 * smaller ends early. A recurrent cell's weight gradient over 64 steps (one
 * product, merge_dots.c) beside one step's input gradient, 66 times smaller,
 * took 1.07 ms, where alone on both threads it takes about half. */
#define PAIR_MAX_IMBALANCE 4

static bool roots_in_arena(const rfi_plan *p, int q)
{
    for (int r = 0; r < p->steps[q].n_roots; r++)
        if (p->loc[p->steps[q].roots[r]].kind != RFI_LOC_ARENA)
            return false;
    return true;
}

/* Step q is an f32 matmul or convolution the library runs (not a direct
 * convolution) whose roots live in the arena: moving steps around it
 * changes no in-place update's order. */
static bool library_call(const rfi_plan *p, int q)
{
    const rfi_step *st = &p->steps[q];
    return st->kind == RFI_STEP_CALL &&
           (st->call == RFI_CALL_MATMUL || st->call == RFI_CALL_CONV) &&
           p->g->nodes[st->core]->dtype == RF_F32 && !st->direct &&
           roots_in_arena(p, q);
}

/* Whether library calls a and b are of like size, where both are matrix
 * products (PAIR_MAX_IMBALANCE); convolutions pair as they come. */
static bool balanced_pair(const rfi_plan *p, int a, int b)
{
    const rfi_node *x = p->g->nodes[p->steps[a].core], *y = p->g->nodes[p->steps[b].core];
    if (x->op != RFI_OP_DOT_GENERAL || y->op != RFI_OP_DOT_GENERAL)
        return true;
    int64_t mx = rfi_dot_macs(x), my = rfi_dot_macs(y);
    int64_t big = mx > my ? mx : my, small = mx > my ? my : mx;
    return small >= big / PAIR_MAX_IMBALANCE;
}

/* Whether the step at position q reads a node marked in `mark`. */
static bool reads_marked(const rfi_plan_builder *b, int q, const bool *mark)
{
    const rfi_intlist *in = &b->steps[b->order[q]].inputs;
    for (int i = 0; i < in->n; i++)
        if (mark[in->v[i]])
            return true;
    return false;
}

static void mark_roots(const rfi_plan *p, int q, bool *mark, bool on)
{
    for (int r = 0; r < p->steps[q].n_roots; r++)
        mark[p->steps[q].roots[r]] = on;
}

/* Positions a .. c of the plan (steps, builder order, segments) in the new
 * order `pos` lists. */
static void reorder_steps(rfi_plan_builder *b, int a, int c, const int *pos)
{
    rfi_plan *p = b->p;
    rfi_step steps[PAIR_WINDOW + 1];
    int order[PAIR_WINDOW + 1];
    int64_t extent[PAIR_WINDOW + 1];
    for (int i = 0; i <= c - a; i++) {
        steps[i] = p->steps[pos[i]];
        order[i] = b->order[pos[i]];
        extent[i] = p->seg_extent ? p->seg_extent[pos[i]] : 0;
    }
    for (int i = 0; i <= c - a; i++) {
        p->steps[a + i] = steps[i];
        b->order[a + i] = order[i];
        b->pos_of[order[i]] = a + i;
        if (p->seg_extent)
            p->seg_extent[a + i] = extent[i];
    }
}

/* Whether the steps at positions a and q read a node in common (a layer's
 * input and weight gradients both read its output gradient). */
static bool share_input(const rfi_plan_builder *b, int a, int q)
{
    const rfi_intlist *x = &b->steps[b->order[a]].inputs, *y = &b->steps[b->order[q]].inputs;
    for (int i = 0; i < x->n; i++)
        if (rfi_intlist_has(y, x->v[i]))
            return true;
    return false;
}

/* Whether the step at position q already runs with a neighbour. */
static bool paired(const rfi_plan *p, int q)
{
    return p->steps[q].runs_with_next || (q > 0 && p->steps[q - 1].runs_with_next);
}

/* One pass of pair_library_calls: calls that pair only when they read a
 * node in common (sharing), or any (else); steps paired before stay so (a
 * window reaching one ends there). */
static void pair_pass(rfi_plan_builder *b, bool *mark, bool sharing)
{
    rfi_plan *p = b->p;
    for (int a = 0; a + 1 < p->n_steps; a++) {
        if (!library_call(p, a) || paired(p, a))
            continue;
        mark_roots(p, a, mark, true);
        int before[PAIR_WINDOW], after[PAIR_WINDOW], n_before = 0, n_after = 0, partner = -1;
        bool movable = true;
        for (int q = a + 1; q < p->n_steps && q <= a + PAIR_WINDOW && movable; q++) {
            if (paired(p, q)) {
                movable = false;
                break;
            }
            bool depends = reads_marked(b, q, mark);
            if (!depends && library_call(p, q) && (!sharing || share_input(b, a, q))) {
                partner = q;
                break;
            }
            movable = roots_in_arena(p, q) && p->steps[q].kind != RFI_STEP_COPY &&
                      !p->steps[q].runs_pool && !p->steps[q].left_out;
            if (depends) {
                mark_roots(p, q, mark, true);
                after[n_after++] = q;
            } else {
                before[n_before++] = q;
            }
        }
        for (int q = a; q < p->n_steps && q <= a + PAIR_WINDOW; q++)
            mark_roots(p, q, mark, false);
        if (partner < 0 || !movable || !balanced_pair(p, a, partner))
            continue;
        int pos[PAIR_WINDOW + 1], n = 0;
        for (int i = 0; i < n_before; i++)
            pos[n++] = before[i];
        pos[n++] = a;
        pos[n++] = partner;
        for (int i = 0; i < n_after; i++)
            pos[n++] = after[i];
        reorder_steps(b, a, partner, pos);
        p->steps[a + n_before].runs_with_next = true;
        a = a + n_before + 1; /* B pairs with nothing else */
    }
}

/* A library call A and the next one B within PAIR_WINDOW steps that reads
 * nothing A's result reaches become neighbours that may run at the same
 * time (runs_with_next): the steps between that do not depend on A move
 * before it, those that do after B (in their order; all keep their roots in
 * the arena). A layer's input and weight gradients pair so; whether they
 * then run side by side is the backend's choice (cpu/services.c). Calls that
 * read a node in common pair first, the rest after: in the ResNet step a
 * projection's weight gradient, scheduled just before the next layer's two
 * gradients, took the first of them, and the pair of Winograd convolutions
 * that had run side by side ran one after the other (the step ~1 ms
 * longer). */
static rf_status pair_library_calls(rfi_plan_builder *b)
{
    bool *mark = rfi_calloc((size_t)b->n + 1, sizeof *mark);
    if (!mark)
        return rfi_error(RF_E_NOMEM, "plan: out of memory");
    pair_pass(b, mark, true);
    pair_pass(b, mark, false);
    rfi_free(mark);
    return RF_OK;
}

rf_status rfi_plan_build(const rfi_graph *g, const rfi_plan_opts *opts, rfi_plan **out)
{
    if (!out)
        return rfi_error(RF_E_INVALID, "rfi_plan_build: out is NULL");
    *out = NULL;
    if (!g)
        return rfi_error(RF_E_INVALID, "rfi_plan_build: the program is NULL");
    if (g->status != RF_OK)
        return rfi_error(RF_E_INVALID, "rfi_plan_build: the program %s failed to trace",
                         g->name ? g->name : "program");
    uint64_t failures = rfi_alloc_failures_here();
    rfi_plan *p = rfi_calloc(1, sizeof *p);
    if (!p)
        return rfi_error(RF_E_NOMEM, "rfi_plan_build: out of memory");
    p->g = g;
    p->loc = rfi_arena_alloc(&p->mem, ((size_t)g->n_nodes + 1) * sizeof *p->loc);
    rfi_plan_builder b = {0}; /* freeable even when builder_init is not reached */
    rf_status st = RF_OK;
    if (!p->loc || !builder_init(&b, g, opts, p))
        st = rfi_error(RF_E_NOMEM, "rfi_plan_build: out of memory");
    if (p->loc)
        for (int i = 0; i < g->n_nodes; i++)
            p->loc[i].alias = -1;
    if (st == RF_OK)
        st = rfi_fuse_decide(&b);
    if (st == RF_OK)
        st = rfi_fuse_schedule(&b);
    if (st == RF_OK)
        st = rfi_fuse_place_results(&b);
    if (st == RF_OK)
        st = finish_steps(&b);
    p->channel_blocks =
        rfi_layout_blocked(b.opts.channel_blocks) ? b.opts.channel_blocks : RFI_LAYOUT_C16;
    if (st == RF_OK && b.opts.blocked_activations)
        st = rfi_plan_choose_layouts(p);
    p->direct_convs = b.opts.direct_convs;
    if (st == RF_OK) {
        decide_direct_convs(p);
        if (b.opts.concurrent_calls)
            st = pair_library_calls(&b);
    }
    if (st == RF_OK)
        st = rfi_memplan(&b);
    builder_free(&b);
    /* A decision that could not allocate was taken as "no" (no fusion, no
     * layout): a plan must be a function of its program and options alone,
     * as modules are found by those in the disk cache's index. */
    if (st == RF_OK && rfi_alloc_failures_here() != failures)
        st = rfi_error(RF_E_NOMEM, "rfi_plan_build: out of memory");
    if (st != RF_OK) {
        rfi_plan_free(p);
        return st;
    }
    *out = p;
    return RF_OK;
}

void rfi_plan_free(rfi_plan *p)
{
    if (!p)
        return;
    rfi_arena_free(&p->mem);
    rfi_free(p);
}

/* ---- Buffer table ------------------------------------------------------------------------- */

int rfi_plan_arena_buffer(const rfi_plan *p)
{
    return p->g->n_args + p->g->n_captures + p->g->n_outputs;
}

int rfi_plan_n_buffers(const rfi_plan *p) { return rfi_plan_arena_buffer(p) + 1 + p->n_consts; }

void rfi_plan_buffer(const rfi_plan *p, int node, int *buffer, size_t *offset)
{
    *buffer = -1;
    *offset = 0;
    if (!p || node < 0 || node >= p->g->n_nodes)
        return;
    while (p->loc[node].kind == RFI_LOC_ALIAS)
        node = p->loc[node].alias;
    const rfi_loc *l = &p->loc[node];
    const rfi_graph *g = p->g;
    switch (l->kind) {
    case RFI_LOC_ARG: *buffer = l->index; break;
    case RFI_LOC_CAPTURE:
    case RFI_LOC_IN_PLACE: *buffer = g->n_args + l->index; break;
    case RFI_LOC_OUTPUT: *buffer = g->n_args + g->n_captures + l->index; break;
    case RFI_LOC_ARENA:
        *buffer = rfi_plan_arena_buffer(p);
        *offset = l->offset;
        break;
    case RFI_LOC_CONST: *buffer = rfi_plan_arena_buffer(p) + 1 + l->index; break;
    default: break;
    }
}

const char *rfi_step_kind_name(const rfi_step *s)
{
    if (s->kind != RFI_STEP_CALL)
        return s->kind == RFI_STEP_LOOP ? "LOOP" : s->kind == RFI_STEP_REDUCE ? "REDUCE" : "COPY";
    return s->call == RFI_CALL_MATMUL ? "CALL MATMUL"
           : s->call == RFI_CALL_CONV ? "CALL CONV"
                                      : "CALL FALLBACK";
}

int rfi_plan_count(const rfi_plan *p, rfi_step_kind kind)
{
    int n = 0;
    for (int i = 0; p && i < p->n_steps; i++)
        n += p->steps[i].kind == kind;
    return n;
}

/* ---- Printing ------------------------------------------------------------------------------ */

static const char *const step_names[RFI_STEP_KIND_COUNT] = {"LOOP", "REDUCE", "CALL", "COPY"};
static const char *const call_names[] = {"", "MATMUL", "CONV", "FALLBACK"};
static const char *const epi_names[RFI_EPI_KIND_COUNT] = {"bias", "add", "relu", "tanh",
                                                           "logistic"};

static void print_ids(rfi_strbuf *sb, const char *label, const int *ids, int n)
{
    rfi_sb_printf(sb, " %s=[", label);
    for (int i = 0; i < n; i++)
        rfi_sb_printf(sb, "%s%%%d", i ? "," : "", ids[i]);
    rfi_sb_printf(sb, "]");
}

static void print_step(rfi_strbuf *sb, const rfi_plan *p, int q)
{
    const rfi_step *s = &p->steps[q];
    rfi_sb_printf(sb, "step %d %s", q, step_names[s->kind]);
    if (s->kind == RFI_STEP_CALL)
        rfi_sb_printf(sb, " %s", call_names[s->call]);
    if (s->kind == RFI_STEP_REDUCE && s->n_roots > 0 && s->core != s->roots[0])
        rfi_sb_printf(sb, " core=%%%d", s->core);
    if (s->n_epilogue > 0) {
        rfi_sb_printf(sb, " core=%%%d epilogue=[", s->core);
        for (int k = 0; k < s->n_epilogue; k++) {
            const rfi_epi_op *e = &s->epilogue[k];
            rfi_sb_printf(sb, "%s%s", k ? "," : "", epi_names[e->kind]);
            if (e->operand >= 0)
                rfi_sb_printf(sb, " %%%d", e->operand);
            if (e->kind == RFI_EPI_BIAS)
                rfi_sb_printf(sb, " dim %d", e->axis);
        }
        rfi_sb_printf(sb, "]");
    }
    if (s->kind == RFI_STEP_COPY) {
        if (s->copy_scratch == RFI_COPY_FROM_SCRATCH)
            rfi_sb_printf(sb, " scratch (%%%d) -> ", s->roots[0]);
        else
            rfi_sb_printf(sb, " %%%d -> ", s->roots[0]);
        if (s->copy_scratch == RFI_COPY_TO_SCRATCH)
            rfi_sb_printf(sb, "scratch\n");
        else if (s->copy_to_output >= 0)
            rfi_sb_printf(sb, "output %d\n", s->copy_to_output);
        else
            rfi_sb_printf(sb, "capture %d\n", s->copy_to_capture);
        return;
    }
    print_ids(sb, "roots", s->roots, s->n_roots);
    if (s->left_out)
        rfi_sb_printf(sb, " left_out");
    if (s->direct)
        rfi_sb_printf(sb, " direct");
    if (s->runs_pool)
        rfi_sb_printf(sb, " runs_pool");
    if (s->runs_with_next)
        rfi_sb_printf(sb, " runs_with_next");
    if (s->n_fused > 0)
        print_ids(sb, "fused", s->fused, s->n_fused);
    const rfi_node *r = p->g->nodes[s->roots[0]];
    int in_place = 0;
    for (int k = 0; s->n_roots == 1 && r->op == RFI_OP_CONCATENATE && k < r->n_in; k++)
        if (rfi_plan_slab_in_place(p, r, k))
            rfi_sb_printf(sb, "%s%%%d", in_place++ ? "," : " in_place=[", r->in[k]->id);
    if (in_place > 0)
        rfi_sb_printf(sb, "]");
    rfi_sb_printf(sb, " shape=");
    rfi_sb_type(sb, r->dtype, r->dims, r->rank);
    if (p->seg_extent && p->seg_extent[q] > 0) {
        rfi_sb_printf(sb, " segmented over [%lld] at", (long long)p->seg_extent[q]);
        for (int i = 0; i < s->n_roots; i++)
            rfi_sb_printf(sb, " %lld", (long long)p->seg_offset[s->roots[i]]);
    }
    rfi_sb_printf(sb, "\n");
}

static void print_loc(rfi_strbuf *sb, const rfi_plan *p, int x)
{
    const rfi_loc *l = &p->loc[x];
    size_t bytes = rfi_node_nbytes(p->g->nodes[x]);
    rfi_sb_printf(sb, "%%%d ", x);
    switch (l->kind) {
    case RFI_LOC_ARG: rfi_sb_printf(sb, "arg %d", l->index); break;
    case RFI_LOC_CAPTURE: rfi_sb_printf(sb, "capture %d", l->index); break;
    case RFI_LOC_CONST: rfi_sb_printf(sb, "const %d", l->index); break;
    case RFI_LOC_ARENA: rfi_sb_printf(sb, "arena+%zu", l->offset); break;
    case RFI_LOC_OUTPUT: rfi_sb_printf(sb, "output %d", l->index); break;
    case RFI_LOC_IN_PLACE: rfi_sb_printf(sb, "in_place capture %d", l->index); break;
    case RFI_LOC_ALIAS: rfi_sb_printf(sb, "alias %%%d", l->alias); break;
    case RFI_LOC_UNSTORED: rfi_sb_printf(sb, "unstored"); break;
    case RFI_LOC_TILE: rfi_sb_printf(sb, "tile"); break;
    default: break;
    }
    static const char *const layout_names[] = {"", " nhwc", " c8", " c16"};
    rfi_sb_printf(sb, " (%zu bytes)%s\n", bytes, layout_names[rfi_plan_layout(p, x)]);
}

char *rfi_plan_print(const rfi_plan *p)
{
    if (!p)
        return NULL;
    rfi_strbuf sb = {0};
    rfi_sb_printf(&sb, "plan %s: %d steps (%d LOOP, %d REDUCE, %d CALL, %d COPY), arena %zu "
                  "bytes\n", p->g->name ? p->g->name : "program", p->n_steps,
                  rfi_plan_count(p, RFI_STEP_LOOP), rfi_plan_count(p, RFI_STEP_REDUCE),
                  rfi_plan_count(p, RFI_STEP_CALL), rfi_plan_count(p, RFI_STEP_COPY),
                  p->arena_bytes);
    for (int q = 0; q < p->n_steps; q++)
        print_step(&sb, p, q);
    rfi_sb_printf(&sb, "locations:\n");
    for (int x = 0; x < p->g->n_nodes; x++)
        if (p->loc[x].kind != RFI_LOC_INLINE)
            print_loc(&sb, p, x);
    if (sb.failed) {
        rfi_sb_free(&sb);
        rfi_error(RF_E_NOMEM, "rfi_plan_print: out of memory");
        return NULL;
    }
    return sb.data;
}
