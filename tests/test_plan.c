/* test_plan.c: the execution plan (src/backend/plan.h): fusion decisions
 * (step counts by kind, written out per program), locations, in-place
 * updates and memory planning.
 *
 * Programs are traced with the public API into a graph and taken through
 * autodiff and DCE (the program a backend receives, before the backend's own
 * simplification passes), so the counts below do not move when those passes
 * change. Every plan is also checked against invariants recomputed here from
 * the plan alone (an independent liveness analysis): every step reads only
 * values produced before it, no two arena buffers live at once share bytes,
 * every output and update is written, copies to captures come last, and an
 * in-place update is followed by no read of its capture.
 *
 * The index-math test also lowers plans to kernel IR (kir.h), after the
 * pools pass the CPU backend runs.
 *
 * PLAN_SHOW=1 prints every plan, PLAN_SHOW_IR=1 every program (debugging).
 */
#include "backend/kir.h"
#include "backend/plan.h"
#include "backend/plan_internal.h"
#include "passes/passes.h"
#include "test_util.h"

static rf_device *cpu;

/* ---- Tracing a program as the backend sees it ------------------------------------------- */

static rfi_graph *trace_program(rf_trace_fn fn, void *ctx, rf_array *const *args, int nargs)
{
    rfi_graph *g = rfi_graph_new(cpu, "test_plan");
    rf_dtype dt[8];
    int rk[8];
    int64_t dims[8][RF_MAX_RANK];
    for (int i = 0; i < nargs; i++) {
        dt[i] = args[i]->dtype;
        rk[i] = args[i]->rank;
        memcpy(dims[i], args[i]->dims, sizeof dims[i]);
    }
    CHECK_OK(rfi_graph_set_args(g, nargs, dt, rk, (const int64_t(*)[RF_MAX_RANK])dims));
    fn(g, ctx);
    CHECK_OK(g->status);
    rfi_graph *ad = NULL, *out = NULL;
    CHECK_OK(rfi_autodiff(g, &ad));
    rfi_graph_free(g);
    CHECK_OK(rfi_dce(ad, &out));
    rfi_graph_free(ad);
    CHECK_OK(rfi_verify(out));
    if (getenv("PLAN_SHOW_IR")) {
        char *s = rfi_print(out);
        printf("%s", s ? s : "");
        rfi_free(s);
    }
    return out;
}

static rf_array *dev_zeros(const int64_t *dims, int rank)
{
    return rf_array_new(cpu, RF_F32, dims, rank, NULL);
}

/* ---- Invariants recomputed from the plan ------------------------------------------------ */

static int resolve(const rfi_plan *p, int x)
{
    while (p->loc[x].kind == RFI_LOC_ALIAS)
        x = p->loc[x].alias;
    return x;
}

/* Whether x is a root of step s. */
static bool is_root_of(const rfi_step *s, int x)
{
    for (int r = 0; r < s->n_roots; r++)
        if (s->roots[r] == x)
            return true;
    return false;
}

/* Marks read[x] = 1 for every non-inline node step q reads (aliases resolved);
 * a LOOP step computes its own roots where one reads another, not reads them. */
static void step_reads(const rfi_plan *p, int q, char *read, char *seen)
{
    const rfi_graph *g = p->g;
    memset(read, 0, (size_t)g->n_nodes);
    memset(seen, 0, (size_t)g->n_nodes);
    const rfi_step *s = &p->steps[q];
    if (s->kind == RFI_STEP_COPY) {
        read[resolve(p, s->roots[0])] = 1;
        return;
    }
    int *stack = malloc(2 * (size_t)g->n_nodes * sizeof *stack); /* roots twice at most */
    int n = 0;
    for (int r = 0; r < s->n_roots; r++)
        stack[n++] = s->roots[r];
    while (n > 0) {
        const rfi_node *u = g->nodes[stack[--n]];
        for (int k = 0; k < u->n_in; k++) {
            int y = u->in[k]->id;
            if (seen[y])
                continue;
            seen[y] = 1;
            if (p->loc[y].kind == RFI_LOC_INLINE ||
                (s->kind == RFI_STEP_LOOP && is_root_of(s, resolve(p, y))))
                stack[n++] = y;
            else
                read[resolve(p, y)] = 1;
        }
    }
    free(stack);
}

/* Whether x is an operand of the concatenation c sitting at its rows in c's
 * buffer (a slab: memplan.c). */
static bool slab_of(const rfi_plan *p, int x, int c)
{
    const rfi_node *cat = p->g->nodes[c];
    for (int k = 0; cat->op == RFI_OP_CONCATENATE && k < cat->n_in; k++)
        if (cat->in[k]->id == x && rfi_plan_slab_in_place(p, cat, k))
            return true;
    return false;
}

/* Whether x is a concatenation made of slabs of y alone, all in place (one
 * that lies at its operands' rows of a larger one: memplan.c). */
static bool made_of_slabs_of(const rfi_plan *p, int x, int y)
{
    const rfi_node *cat = p->g->nodes[x];
    bool any = false;
    for (int k = 0; cat->op == RFI_OP_CONCATENATE && k < cat->n_in; k++) {
        if (rfi_node_numel(cat->in[k]) == 0)
            continue;
        if (!rfi_plan_slab_in_place(p, cat, k) || !slab_of(p, cat->in[k]->id, y))
            return false;
        any = true;
    }
    return any;
}

/* Whether the bytes of x and y may meet while both live: one is a slab of
 * the other or made of the other's slabs. */
static bool may_share(const rfi_plan *p, int x, int y)
{
    return slab_of(p, x, y) || slab_of(p, y, x) || made_of_slabs_of(p, x, y) ||
           made_of_slabs_of(p, y, x);
}

typedef struct plan_facts {
    int n_arena;
    size_t sum_arena; /* bytes of all arena buffers together (no reuse) */
} plan_facts;

static plan_facts check_invariants(const rfi_plan *p)
{
    const rfi_graph *g = p->g;
    int n = g->n_nodes;
    int *def = malloc((size_t)n * sizeof *def), *last = malloc((size_t)n * sizeof *last);
    char *read = malloc((size_t)n), *seen = malloc((size_t)n);
    plan_facts f = {0, 0};
    for (int x = 0; x < n; x++)
        def[x] = last[x] = -1;
    /* roots have a location; fused nodes are inline; each root is computed once */
    bool roots_ok = true, fused_ok = true, copies_last = true;
    int first_capture_copy = p->n_steps;
    for (int q = 0; q < p->n_steps; q++) {
        const rfi_step *s = &p->steps[q];
        for (int r = 0; r < s->n_roots && s->kind != RFI_STEP_COPY; r++) {
            int x = s->roots[r];
            roots_ok = roots_ok && p->loc[x].kind != RFI_LOC_INLINE &&
                       p->loc[x].kind != RFI_LOC_ALIAS && def[x] < 0;
            def[x] = q;
        }
        for (int i = 0; i < s->n_fused; i++)
            fused_ok = fused_ok && p->loc[s->fused[i]].kind == RFI_LOC_INLINE;
        if (s->kind == RFI_STEP_COPY && s->copy_to_capture >= 0 && q < first_capture_copy)
            first_capture_copy = q;
        if (q > first_capture_copy && s->kind != RFI_STEP_COPY)
            copies_last = false;
        bool segmented = p->seg_extent && p->seg_extent[q] > 0;
        if (s->kind == RFI_STEP_LOOP && !segmented)
            for (int r = 1; r < s->n_roots; r++) {
                const rfi_node *a = g->nodes[s->roots[0]], *b = g->nodes[s->roots[r]];
                roots_ok = roots_ok && a->rank == b->rank &&
                           memcmp(a->dims, b->dims, (size_t)a->rank * sizeof a->dims[0]) == 0;
            }
        /* segmented: segment roots lie inside the flat extent, the others span it */
        for (int r = 0; segmented && r < s->n_roots; r++) {
            const rfi_node *b = g->nodes[s->roots[r]];
            int64_t off = p->seg_offset[s->roots[r]];
            roots_ok = roots_ok && s->kind == RFI_STEP_LOOP &&
                       (off >= 0 ? off + rfi_node_numel(b) <= p->seg_extent[q]
                                 : b->rank == 1 && b->dims[0] == p->seg_extent[q]);
        }
    }
    CHECK(roots_ok);
    CHECK(fused_ok);
    CHECK(copies_last);
    /* every step reads only leaves and values of earlier steps */
    bool topo = true;
    for (int q = 0; q < p->n_steps; q++) {
        step_reads(p, q, read, seen);
        for (int x = 0; x < n; x++) {
            if (!read[x])
                continue;
            rfi_loc_kind k = p->loc[x].kind;
            bool leaf = k == RFI_LOC_ARG || k == RFI_LOC_CAPTURE || k == RFI_LOC_CONST;
            topo = topo && (leaf || (def[x] >= 0 && def[x] < q));
            if (def[x] >= 0 && q > last[x])
                last[x] = q;
        }
    }
    CHECK(topo);
    /* arena buffers: aligned, inside the arena, disjoint while both live */
    bool inside = true, disjoint = true;
    for (int x = 0; x < n; x++) {
        if (p->loc[x].kind != RFI_LOC_ARENA)
            continue;
        size_t bx = rfi_node_nbytes(g->nodes[x]);
        f.n_arena++;
        f.sum_arena += bx;
        int lx = last[x] > def[x] ? last[x] : def[x];
        inside = inside && p->loc[x].offset % 64 == 0 && p->loc[x].offset + bx <= p->arena_bytes;
        for (int y = x + 1; y < n; y++) {
            if (p->loc[y].kind != RFI_LOC_ARENA)
                continue;
            size_t by = rfi_node_nbytes(g->nodes[y]);
            int ly = last[y] > def[y] ? last[y] : def[y];
            bool live_together = def[x] <= ly && def[y] <= lx;
            bool bytes_meet = p->loc[x].offset < p->loc[y].offset + by &&
                              p->loc[y].offset < p->loc[x].offset + bx && bx > 0 && by > 0;
            if (live_together && bytes_meet && !may_share(p, x, y)) {
                disjoint = false;
                fprintf(stderr, "overlap: %%%d [%d,%d] and %%%d [%d,%d]\n", x, def[x], lx, y,
                        def[y], ly);
            }
        }
    }
    CHECK(inside);
    CHECK(disjoint);
    /* every output and update is written */
    for (int i = 0; i < g->n_outputs; i++) {
        int x = g->outputs[i]->id;
        bool written = p->loc[x].kind == RFI_LOC_OUTPUT && p->loc[x].index == i;
        for (int q = 0; q < p->n_steps; q++)
            written = written || (p->steps[q].kind == RFI_STEP_COPY &&
                                  p->steps[q].copy_to_output == i && p->steps[q].roots[0] == x);
        CHECK(written);
    }
    for (int i = 0; i < g->n_updates; i++) {
        int v = g->updates[i].value->id, c = g->updates[i].capture;
        bool in_place = p->loc[v].kind == RFI_LOC_IN_PLACE && p->loc[v].index == c;
        bool written = in_place;
        for (int q = 0; q < p->n_steps; q++)
            written = written || (p->steps[q].kind == RFI_STEP_COPY &&
                                  p->steps[q].copy_to_capture == c && p->steps[q].roots[0] == v);
        CHECK(written);
        const rfi_node *cn = g->capture_nodes[c];
        for (int q = def[v] + 1; in_place && cn && q < p->n_steps; q++) {
            step_reads(p, q, read, seen);
            CHECK(!read[cn->id]); /* nothing reads the old value after it is overwritten */
        }
    }
    /* every located node maps to a buffer of the table (but the unstored
     * and those held in a convolution's tile) */
    bool buffers_ok = true;
    for (int x = 0; x < n; x++) {
        rfi_loc_kind kind = p->loc[x].kind;
        if (kind == RFI_LOC_INLINE || kind == RFI_LOC_UNSTORED || kind == RFI_LOC_TILE)
            continue;
        int b;
        size_t off;
        rfi_plan_buffer(p, x, &b, &off);
        buffers_ok = buffers_ok && b >= 0 && b < rfi_plan_n_buffers(p);
    }
    CHECK(buffers_ok);
    char *text = rfi_plan_print(p);
    CHECK(text && strstr(text, "step 0 ") && strstr(text, "locations:"));
    rfi_free(text);
    free(def);
    free(last);
    free(read);
    free(seen);
    return f;
}

static rfi_plan *plan_of(const rfi_graph *g, bool show)
{
    rfi_plan *p = NULL;
    rfi_plan_opts o = rfi_plan_opts_default();
    CHECK_OK(rfi_plan_build(g, &o, &p));
    if (p && show) {
        char *text = rfi_plan_print(p);
        printf("%s", text ? text : "(no text)\n");
        rfi_free(text);
    }
    return p;
}

/* REDUCE steps that compute a root after their fold (plan.h: core != roots[0]). */
static int reduce_epilogues(const rfi_plan *p)
{
    int n = 0;
    for (int q = 0; q < p->n_steps; q++)
        n += p->steps[q].kind == RFI_STEP_REDUCE && p->steps[q].core != p->steps[q].roots[0];
    return n;
}

static int count_loc(const rfi_plan *p, rfi_loc_kind k)
{
    int n = 0;
    for (int x = 0; x < p->g->n_nodes; x++)
        n += p->loc[x].kind == k;
    return n;
}

/* Exactly one LOOP step runs over the flat parameter vector [total], segmented:
 * it computes both Adam moments in place and stores every one of the n_params
 * new parameters straight into its capture (a segment root, in place), so no
 * value of [total] elements is materialised for the new parameters. */
static void check_flat_update(const rfi_plan *p, int64_t total, int n_params)
{
    int n_flat = 0, moments_in_place = 0, params_in_place = 0;
    for (int q = 0; q < p->n_steps; q++) {
        const rfi_step *s = &p->steps[q];
        if (s->kind != RFI_STEP_LOOP || !p->seg_extent || p->seg_extent[q] != total)
            continue;
        n_flat++;
        for (int i = 0; i < s->n_roots; i++) {
            bool in_place = p->loc[s->roots[i]].kind == RFI_LOC_IN_PLACE;
            if (p->seg_offset[s->roots[i]] >= 0)
                params_in_place += in_place;
            else
                moments_in_place += in_place;
        }
    }
    CHECK(n_flat == 1);
    CHECK(moments_in_place == 2);
    CHECK(params_in_place == n_params);
    int arena_flat = 0;
    for (int x = 0; x < p->g->n_nodes; x++)
        arena_flat += p->loc[x].kind == RFI_LOC_ARENA && rfi_node_numel(p->g->nodes[x]) == total;
    CHECK(arena_flat == 0);
}

/* ---- (a) an elementwise chain: one loop ---------------------------------------------------- */

static void chain_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = rf_arg(t, 0), *y = rf_arg(t, 1);
    rf_tensor *z = rf_tanh(rf_add_s(rf_mul(x, y), 1.0));
    rf_return(t, rf_sub(z, rf_exp(x)));
}

static void test_elementwise_chain(void)
{
    rf_array *x = dev_zeros(RF_SHAPE(16, 32)), *y = dev_zeros(RF_SHAPE(16, 32));
    rf_array *args[2] = {x, y};
    rfi_graph *g = trace_program(chain_fn, NULL, args, 2);
    rfi_plan *p = plan_of(g, getenv("PLAN_SHOW") != NULL);
    if (p) {
        CHECK(p->n_steps == 1);
        CHECK(rfi_plan_count(p, RFI_STEP_LOOP) == 1);
        CHECK(p->steps[0].n_roots == 1 && p->steps[0].n_fused >= 4);
        CHECK(p->loc[g->outputs[0]->id].kind == RFI_LOC_OUTPUT);
        CHECK(p->arena_bytes == 0);
        CHECK(rfi_plan_n_buffers(p) == 2 + 0 + 1 + 1);
        check_invariants(p);
    }
    rfi_plan_free(p);
    rfi_graph_free(g);
    rf_array_free(x);
    rf_array_free(y);
}

/* ---- (b) softmax: two reductions around loops -------------------------------------------- */

static void softmax_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_return(t, rf_softmax(rf_arg(t, 0), 1));
}

static void test_softmax(void)
{
    rf_array *x = dev_zeros(RF_SHAPE(8, 100));
    rfi_graph *g = trace_program(softmax_fn, NULL, &x, 1);
    rfi_plan *p = plan_of(g, getenv("PLAN_SHOW") != NULL);
    if (p) {
        /* REDUCE max; LOOP e = exp(x - max) (read by the sum and the division, so
         * materialised); REDUCE sum; LOOP e / sum written to the output. */
        CHECK(rfi_plan_count(p, RFI_STEP_REDUCE) == 2);
        CHECK(rfi_plan_count(p, RFI_STEP_LOOP) == 2);
        CHECK(p->n_steps == 4);
        CHECK(p->steps[0].kind == RFI_STEP_REDUCE && p->steps[1].kind == RFI_STEP_LOOP &&
              p->steps[2].kind == RFI_STEP_REDUCE && p->steps[3].kind == RFI_STEP_LOOP);
        CHECK(p->loc[g->outputs[0]->id].kind == RFI_LOC_OUTPUT);
        /* the max is dead once e exists: the sum reuses its bytes */
        CHECK(p->loc[p->steps[0].roots[0]].offset == p->loc[p->steps[2].roots[0]].offset);
        check_invariants(p);
    }
    rfi_plan_free(p);
    rfi_graph_free(g);
    rf_array_free(x);
}

/* ---- (b2) a relu-masked gradient read by two steps ----------------------------------------- *
 * m = select(y > 0, g, 0), as BatchNorm's backward after a relu: its per-channel sums
 * (one REDUCE step of two sibling roots) and a loop over its shape read it. Inline, each
 * step reads y and g (four reads), where storing m costs those two reads, a write and a
 * read back in each step (five): no step computes m alone. With ctx set, m also feeds
 * the sum over another axis (a third step: then six reads either way) and is stored. */
static void masked_grad_fn(rf_trace *t, void *ctx)
{
    rf_tensor *y = rf_arg(t, 0), *g = rf_arg(t, 1);
    rf_tensor *m = rf_select(rf_compare(y, rf_zeros_like(y), RF_GT), g, rf_zeros_like(g));
    const int64_t axes[3] = {0, 2, 3};
    rf_tensor *s = rf_sum(m, axes, 3, true), *sy = rf_sum(rf_mul(m, y), axes, 3, true);
    rf_tensor *dx = rf_sub(rf_mul(m, rf_broadcast_to(sy, y->dims, 4)),
                           rf_broadcast_to(s, y->dims, 4));
    if (ctx)
        dx = rf_add(dx, rf_broadcast_to(rf_sum(m, (const int64_t[]){1}, 1, true), y->dims, 4));
    rf_return(t, dx);
}

static void test_masked_grad(void)
{
    rf_array *args[2] = {dev_zeros(RF_SHAPE(8, 16, 6, 6)), dev_zeros(RF_SHAPE(8, 16, 6, 6))};
    for (int third = 0; third < 2; third++) {
        rfi_graph *g = trace_program(masked_grad_fn, third ? args : NULL, args, 2);
        rfi_plan *p = plan_of(g, getenv("PLAN_SHOW") != NULL);
        if (p) {
            int selects = 0; /* steps rooted at the select */
            for (int q = 0; q < p->n_steps; q++)
                for (int r = 0; r < p->steps[q].n_roots; r++)
                    selects += p->g->nodes[p->steps[q].roots[r]]->op == RFI_OP_SELECT;
            CHECK(selects == third);
            CHECK(rfi_plan_count(p, RFI_STEP_LOOP) == 1 + third);
            CHECK(rfi_plan_count(p, RFI_STEP_REDUCE) == 1 + third);
            check_invariants(p);
        }
        rfi_plan_free(p);
        rfi_graph_free(g);
    }
    rf_array_free(args[0]);
    rf_array_free(args[1]);
}

/* ---- (c) attention's softmax over [B, H, T, T] scores, forward and backward ------------- */

enum { ATT_B = 2, ATT_H = 3, ATT_T = 16 };

/* softmax(s / 4 + mask) over the last axis, the mask additive and causal as a
 * transformer's; with ctx set, the gradient of sum(softmax(...) * w) with
 * respect to s instead. */
static void attention_fn(rf_trace *t, void *ctx)
{
    rf_tensor *s = rf_arg(t, 0);
    int64_t n = ATT_T;
    rf_tensor *ri = rf_iota(t, RF_I32, RF_SHAPE(n, n), 0);
    rf_tensor *ci = rf_iota(t, RF_I32, RF_SHAPE(n, n), 1);
    rf_tensor *neg = rf_full(t, RF_F32, RF_SHAPE(n, n), -1e9);
    rf_tensor *mask = rf_select(rf_compare(ci, ri, RF_LE), rf_zeros_like(neg), neg);
    rf_tensor *p = rf_softmax(rf_add(rf_mul_s(s, 0.25), mask), -1);
    if (!ctx) {
        rf_return(t, p);
        return;
    }
    rf_tensor *ds = NULL;
    CHECK_OK(rf_grad(t, rf_sum_all(rf_mul(p, rf_arg(t, 1))), &s, 1, &ds));
    rf_return(t, ds);
}

/* Arena values of the scores' shape. */
static int score_buffers(const rfi_plan *p)
{
    int n = 0;
    for (int x = 0; x < p->g->n_nodes; x++)
        n += p->loc[x].kind == RFI_LOC_ARENA &&
             rfi_node_numel(p->g->nodes[x]) == (int64_t)ATT_B * ATT_H * ATT_T * ATT_T;
    return n;
}

static int steps_over_scores(const rfi_plan *p, rfi_step_kind kind)
{
    int n = 0;
    for (int q = 0; q < p->n_steps; q++)
        n += p->steps[q].kind == kind && p->steps[q].n_roots > 0 &&
             rfi_node_numel(p->g->nodes[p->steps[q].roots[0]]) ==
                 (int64_t)ATT_B * ATT_H * ATT_T * ATT_T;
    return n;
}

static void test_attention_softmax(void)
{
    rf_array *s = dev_zeros(RF_SHAPE(ATT_B, ATT_H, ATT_T, ATT_T));
    rf_array *w = dev_zeros(RF_SHAPE(ATT_B, ATT_H, ATT_T, ATT_T));
    rf_array *args[2] = {s, w};
    rfi_graph *g = trace_program(attention_fn, NULL, args, 1);
    rfi_plan *p = plan_of(g, getenv("PLAN_SHOW") != NULL);
    if (p) {
        /* The scaled and masked scores are recomputed by the row max and by the exp:
         * LOOP mask [T,T]; REDUCE max; LOOP e; REDUCE sum; LOOP e / sum (the output).
         * Only e is stored; the scores used to be too, for the max to read. */
        CHECK(rfi_plan_count(p, RFI_STEP_REDUCE) == 2);
        CHECK(rfi_plan_count(p, RFI_STEP_LOOP) == 3);
        CHECK(steps_over_scores(p, RFI_STEP_LOOP) == 2);
        CHECK(score_buffers(p) == 1);
        CHECK(p->loc[g->outputs[0]->id].kind == RFI_LOC_OUTPUT);
        check_invariants(p);
    }
    rfi_plan_free(p);
    rfi_graph_free(g);
    g = trace_program(attention_fn, &s, args, 2);
    p = plan_of(g, getenv("PLAN_SHOW") != NULL);
    if (p) {
        /* Forward as above, then one row sum and one loop: the max is a stop_gradient,
         * so its VJP (the cotangent's row sum, a count of ties at the max, their
         * quotient) is gone, and the backward pass needs no scores. e / sum is
         * recomputed by the loss's sum and the backward row sum: e alone is stored. */
        CHECK(rfi_plan_count(p, RFI_STEP_REDUCE) == 3);
        CHECK(steps_over_scores(p, RFI_STEP_LOOP) == 2);
        CHECK(score_buffers(p) == 1);
        CHECK(p->loc[g->outputs[0]->id].kind == RFI_LOC_OUTPUT);
        check_invariants(p);
    }
    rfi_plan_free(p);
    rfi_graph_free(g);
    rf_array_free(s);
    rf_array_free(w);
}

/* softmax(s / 4 + mask) @ v as in attention, and the gradients of sum((p @ v) * w) with
 * respect to s and v. p is materialised for the product; the backward pass reads it (for
 * dv = p^T @ do and for the softmax's own VJP) and nothing else of the scores' shape. */
static void attention_pv_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *s = rf_arg(t, 0), *v = rf_arg(t, 1);
    int64_t n = ATT_T;
    rf_tensor *ri = rf_iota(t, RF_I32, RF_SHAPE(n, n), 0);
    rf_tensor *ci = rf_iota(t, RF_I32, RF_SHAPE(n, n), 1);
    rf_tensor *neg = rf_full(t, RF_F32, RF_SHAPE(n, n), -1e9);
    rf_tensor *mask = rf_select(rf_compare(ci, ri, RF_LE), rf_zeros_like(neg), neg);
    rf_tensor *p = rf_softmax(rf_add(rf_mul_s(s, 0.25), mask), -1);
    rf_tensor *o = rf_matmul(p, v);
    rf_tensor *wrt[2] = {s, v}, *d[2] = {NULL, NULL};
    CHECK_OK(rf_grad(t, rf_sum_all(rf_mul(o, rf_arg(t, 2))), wrt, 2, d));
    rf_return(t, d[0]);
    rf_return(t, d[1]);
}

/* Arena values of numel n computed before step q and read by q or a later step. */
static int kept_across(const rfi_plan *p, int64_t n, int q)
{
    const rfi_graph *g = p->g;
    char *read = malloc((size_t)g->n_nodes), *seen = malloc((size_t)g->n_nodes);
    char *kept = calloc((size_t)g->n_nodes, 1);
    for (int r = q; r < p->n_steps; r++) {
        step_reads(p, r, read, seen);
        for (int x = 0; x < g->n_nodes; x++)
            kept[x] |= read[x];
    }
    int count = 0;
    for (int d = 0; d < q; d++)
        for (int r = 0; r < p->steps[d].n_roots; r++) {
            int x = p->steps[d].roots[r];
            count += kept[x] && p->loc[x].kind == RFI_LOC_ARENA &&
                     rfi_node_numel(g->nodes[x]) == n;
        }
    free(read);
    free(seen);
    free(kept);
    return count;
}

/* The first step that reads argument i (n_steps when none does). */
static int first_reader(const rfi_plan *p, int i)
{
    const rfi_graph *g = p->g;
    char *read = malloc((size_t)g->n_nodes), *seen = malloc((size_t)g->n_nodes);
    int q = 0;
    for (; q < p->n_steps; q++) {
        step_reads(p, q, read, seen);
        bool found = false;
        for (int x = 0; x < g->n_nodes && !found; x++)
            found = read[x] && g->nodes[x]->op == RFI_OP_ARGUMENT && g->nodes[x]->attr.i[0] == i;
        if (found)
            break;
    }
    free(read);
    free(seen);
    return q;
}

static void test_attention_pv_backward(void)
{
    enum { D = 8 };
    rf_array *s = dev_zeros(RF_SHAPE(ATT_B, ATT_H, ATT_T, ATT_T));
    rf_array *v = dev_zeros(RF_SHAPE(ATT_B, ATT_H, ATT_T, D));
    rf_array *w = dev_zeros(RF_SHAPE(ATT_B, ATT_H, ATT_T, D));
    rf_array *args[3] = {s, v, w};
    rfi_graph *g = trace_program(attention_pv_fn, NULL, args, 3);
    rfi_plan *p = plan_of(g, getenv("PLAN_SHOW") != NULL);
    if (p) {
        /* The backward pass starts at the first step that reads w, the cotangent of
         * p @ v (the product itself is dead: only the gradients are returned). */
        int bwd = first_reader(p, 2);
        CHECK(bwd < p->n_steps);
        const int64_t scores = (int64_t)ATT_B * ATT_H * ATT_T * ATT_T;
        /* Only p: the softmax's VJP reads its result, not e = exp(...) as well (which
         * op by op the division's and the exp's rules did: e and p, 25984 arena bytes
         * against 19840). */
        CHECK(kept_across(p, scores, bwd) == 1);
        check_invariants(p);
    }
    rfi_plan_free(p);
    rfi_graph_free(g);
    rf_array_free(s);
    rf_array_free(v);
    rf_array_free(w);
}

/* sum(logsoftmax(x) * w) over [8, 100] rows and its gradient with respect to x. */
static void logsoftmax_grad_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = rf_arg(t, 0), *dx = NULL;
    rf_tensor *loss = rf_sum_all(rf_mul(rf_logsoftmax(x, 1), rf_arg(t, 1)));
    CHECK_OK(rf_grad(t, loss, &x, 1, &dx));
    rf_return(t, loss);
    rf_return(t, dx);
}

static void test_logsoftmax_backward(void)
{
    rf_array *x = dev_zeros(RF_SHAPE(8, 100)), *w = dev_zeros(RF_SHAPE(8, 100));
    rf_array *args[2] = {x, w};
    rfi_graph *g = trace_program(logsoftmax_grad_fn, NULL, args, 2);
    rfi_plan *p = plan_of(g, getenv("PLAN_SHOW") != NULL);
    if (p) {
        /* REDUCE max; REDUCE sum(exp(x - max)), the exp inline; LOOP log of the sum
         * [8,1]; REDUCE the loss; REDUCE sum(w), the cotangent's row sum; LOOP
         * dx = w - exp(y) * that sum, y recomputed from x and the two row values. No
         * [8,100] value is stored: op by op the backward pass read exp(x - max)
         * (stored by a LOOP of its own) and took a [8,1] LOOP more. */
        int rows = 0;
        for (int x = 0; x < g->n_nodes; x++)
            rows += p->loc[x].kind == RFI_LOC_ARENA && rfi_node_numel(g->nodes[x]) == 800;
        CHECK(rows == 0);
        CHECK(rfi_plan_count(p, RFI_STEP_REDUCE) == 4);
        CHECK(rfi_plan_count(p, RFI_STEP_LOOP) == 2);
        CHECK(p->n_steps == 6);
        check_invariants(p);
    }
    rfi_plan_free(p);
    rfi_graph_free(g);
    rf_array_free(x);
    rf_array_free(w);
}

/* ---- Outputs, copies, constants, aliases, unsafe updates ------------------------------- */

typedef struct results_ctx {
    rf_array *a, *b;
} results_ctx;

static void results_fn(rf_trace *t, void *vctx)
{
    results_ctx *c = vctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_tensor *a = rf_capture(t, c->a), *b = rf_capture(t, c->b);
    rf_tensor *e = rf_exp(x);
    rf_return(t, x);                     /* 0: an argument: COPY */
    rf_return(t, e);                     /* 1: written by its loop */
    rf_return(t, e);                     /* 2: the same node again: COPY */
    rf_return(t, b);                     /* 3: a capture (its old value): COPY */
    float k[4] = {1, 2, 3, 4};
    rf_tensor *kc = rf_constant(t, RF_F32, RF_SHAPE(4), k);
    rf_return(t, rf_reshape(rf_add(x, kc), RF_SHAPE(2, 2))); /* 4: a loop writes it */
    /* a <- a + reverse(a): reads a at another index: arena + COPY */
    int64_t ax = 0;
    rf_assign(t, c->a, rf_add(a, rf_reverse(a, &ax, 1)));
    /* b <- b * 2: safe by itself, but output 3 copies b's old value at the end */
    rf_assign(t, c->b, rf_mul_s(b, 2.0));
}

static void test_results(void)
{
    rf_array *x = dev_zeros(RF_SHAPE(4));
    results_ctx c = {dev_zeros(RF_SHAPE(4)), dev_zeros(RF_SHAPE(4))};
    rfi_graph *g = trace_program(results_fn, &c, &x, 1);
    rfi_plan *p = plan_of(g, getenv("PLAN_SHOW") != NULL);
    if (p) {
        CHECK(p->loc[g->outputs[1]->id].kind == RFI_LOC_OUTPUT &&
              p->loc[g->outputs[1]->id].index == 1);
        CHECK(p->loc[g->outputs[4]->id].kind == RFI_LOC_OUTPUT);
        CHECK(p->n_consts == 1 && p->loc[p->consts[0]].kind == RFI_LOC_CONST);
        CHECK(count_loc(p, RFI_LOC_IN_PLACE) == 0);
        /* copies: outputs 0, 2, 3 then the two captures, in that order */
        int q = p->n_steps - 5;
        CHECK(q >= 0);
        if (q >= 0) {
            CHECK(p->steps[q].copy_to_output == 0 && p->steps[q + 1].copy_to_output == 2 &&
                  p->steps[q + 2].copy_to_output == 3);
            CHECK(p->steps[q + 3].copy_to_capture >= 0 && p->steps[q + 4].copy_to_capture >= 0);
            for (int i = 0; i < 5; i++)
                CHECK(p->steps[q + i].kind == RFI_STEP_COPY);
        }
        CHECK(rfi_plan_count(p, RFI_STEP_COPY) == 5);
        int buf;
        size_t off;
        rfi_plan_buffer(p, p->consts[0], &buf, &off);
        CHECK(buf == rfi_plan_arena_buffer(p) + 1 && off == 0);
        rfi_plan_buffer(p, g->outputs[1]->id, &buf, &off);
        CHECK(buf == g->n_args + g->n_captures + 1);
        check_invariants(p);
    }
    rfi_plan_free(p);
    rfi_graph_free(g);
    rf_array_free(x);
    rf_array_free(c.a);
    rf_array_free(c.b);
}

/* A reshape of a materialised value is an alias; an update from another
 * capture is a copy; a swap of two captures goes through the copy scratch. */
static void alias_fn(rf_trace *t, void *vctx)
{
    results_ctx *c = vctx;
    rf_tensor *s = rf_sum(rf_arg(t, 0), (const int64_t[]){1}, 1, false); /* [4] */
    rf_tensor *r = rf_reshape(s, RF_SHAPE(2, 2));
    rf_return(t, rf_matmul(r, r));
    rf_assign(t, c->a, rf_capture(t, c->b));
}

static void swap_fn(rf_trace *t, void *vctx)
{
    results_ctx *c = vctx;
    rf_tensor *a = rf_capture(t, c->a), *b = rf_capture(t, c->b);
    rf_assign(t, c->a, b);
    rf_assign(t, c->b, a);
}

static void test_alias_and_swap(void)
{
    rf_array *x = dev_zeros(RF_SHAPE(4, 3));
    results_ctx c = {dev_zeros(RF_SHAPE(4)), dev_zeros(RF_SHAPE(4))};
    rfi_graph *g = trace_program(alias_fn, &c, &x, 1);
    rfi_plan_opts o = rfi_plan_opts_default();
    o.matmul_call_min_flops = 1; /* the 2x2 dot becomes a MATMUL call */
    o.dot_loop_max_rows = 0;
    rfi_plan *p = NULL;
    CHECK_OK(rfi_plan_build(g, &o, &p));
    if (p) {
        CHECK(rfi_plan_count(p, RFI_STEP_CALL) == 1);
        int aliases = count_loc(p, RFI_LOC_ALIAS);
        CHECK(aliases == 1);
        for (int x2 = 0; x2 < g->n_nodes; x2++)
            if (p->loc[x2].kind == RFI_LOC_ALIAS)
                CHECK(p->loc[p->loc[x2].alias].kind == RFI_LOC_ARENA);
        CHECK(rfi_plan_count(p, RFI_STEP_COPY) == 1);
        check_invariants(p);
    }
    rfi_plan_free(p);
    rfi_graph_free(g);

    g = trace_program(swap_fn, &c, &x, 1);
    p = NULL;
    CHECK_OK(rfi_plan_build(g, NULL, &p));
    if (p) { /* b -> scratch, b <- a, a <- scratch */
        CHECK(rfi_plan_count(p, RFI_STEP_COPY) == 3);
        CHECK(p->copy_scratch_bytes == 4 * sizeof(float));
        CHECK(p->arena_bytes >= p->copy_scratch_offset + p->copy_scratch_bytes);
        int order[3] = {-1, -1, -1}, k = 0;
        for (int q = 0; q < p->n_steps; q++)
            if (p->steps[q].kind == RFI_STEP_COPY && k < 3)
                order[k++] = p->steps[q].copy_scratch;
        CHECK(order[0] == RFI_COPY_TO_SCRATCH && order[1] == RFI_COPY_DIRECT &&
              order[2] == RFI_COPY_FROM_SCRATCH);
        check_invariants(p);
    }
    rfi_plan_free(p);
    rfi_graph_free(g);
    CHECK_STATUS(rfi_plan_build(NULL, NULL, &p), RF_E_INVALID);
    rf_array_free(x);
    rf_array_free(c.a);
    rf_array_free(c.b);
}

/* Updates that copy captured arrays into each other, run: v0 <- v1 <- v2 <- v0 (a
 * rotation), v3 <- v4 <- v5 assigned v4's first (a chain whose order is not the
 * assignments'), v6 <- v6 * 1 (itself, after simplification) with v7 <- v6. All read
 * the old values. */
static void copies_fn(rf_trace *t, void *vctx)
{
    rf_array **v = vctx;
    rf_tensor *c[8];
    for (int i = 0; i < 8; i++)
        c[i] = rf_capture(t, v[i]);
    rf_assign(t, v[0], c[1]);
    rf_assign(t, v[1], c[2]);
    rf_assign(t, v[2], c[0]);
    rf_assign(t, v[4], c[5]);
    rf_assign(t, v[3], c[4]);
    rf_assign(t, v[6], rf_mul_s(c[6], 1.0));
    rf_assign(t, v[7], c[6]);
    rf_return(t, rf_sum_all(c[0]));
}

static void test_capture_copies_run(void)
{
    rf_array *v[8];
    float val[8][3];
    for (int i = 0; i < 8; i++) {
        for (int k = 0; k < 3; k++)
            val[i][k] = (float)(10 * i + k);
        v[i] = rf_array_new(cpu, RF_F32, RF_SHAPE(3), val[i]);
    }
    rf_exec *e = NULL;
    CHECK_OK(rf_compile(copies_fn, v, NULL, 0, &e));
    /* the old value each array takes, per run */
    const int from[8] = {1, 2, 0, 4, 5, 5, 6, 6};
    for (int run = 0; e && run < 2; run++) {
        rf_array *out = NULL;
        CHECK_OK(rf_exec_run(e, NULL, 0, &out, 1));
        CHECK(out && rf_to_number(out) == val[0][0] + val[0][1] + val[0][2]);
        rf_array_free(out);
        float now[8][3];
        for (int i = 0; i < 8; i++) {
            for (int k = 0; k < 3; k++)
                now[i][k] = val[from[i]][k];
            float got[3] = {0};
            CHECK_OK(rf_array_read(v[i], got, sizeof got));
            CHECK(memcmp(got, now[i], sizeof got) == 0);
        }
        memcpy(val, now, sizeof val);
    }
    rf_exec_free(e);
    for (int i = 0; i < 8; i++)
        rf_array_free(v[i]);
}

/* ---- Training steps as rf_trainstep traces them -------------------------------------------- */

typedef struct train_ctx {
    rf_model *m;
    rf_opt *opt;
    bool xent;
    bool unguarded; /* the step a user traces: no finite-loss guard */
} train_ctx;

static rf_tensor *mse_loss(rf_model *m, rf_tensor *const *b, int n, rf_aux *aux, void *ctx)
{
    (void)n;
    (void)aux;
    (void)ctx;
    return rf_mse(rf_apply(m, b[0]), b[1]);
}

static rf_tensor *xent_loss(rf_model *m, rf_tensor *const *b, int n, rf_aux *aux, void *ctx)
{
    (void)n;
    (void)aux;
    (void)ctx;
    return rf_logitcrossentropy(rf_apply(m, b[0]), b[1]);
}

/* withgradient + optimiser update + the finite-loss guard + loss output:
 * the program rf_trainstep compiles. */
static void train_fn(rf_trace *t, void *vctx)
{
    train_ctx *c = vctx;
    rf_tensor *batch[2] = {rf_arg(t, 0), rf_arg(t, 1)};
    rf_grads *gr = NULL;
    rf_tensor *loss = rf_withgradient(t, c->xent ? xent_loss : mse_loss, NULL, c->m, batch, 2,
                                      NULL, &gr);
    rf_update(t, c->opt, c->m, gr);
    rf_tensor *ok = rf_is_finite(loss);
    for (int i = 0; i < t->n_updates && !c->unguarded; i++) {
        rfi_update *u = &t->updates[i];
        u->value = rf_select(ok, u->value, t->capture_nodes[u->capture]);
    }
    rf_return(t, loss);
}

static void test_tiny_train_step(void)
{
    rf_nn_seed(42);
    rf_model *host = rf_chain(rf_dense(4, 8, RF_ACT_TANH), rf_dense(8, 2, RF_ACT_IDENTITY));
    rf_model *m = rf_model_to(host, cpu);
    rf_opt *opt = rf_setup(rf_adam(1e-2), m);
    rf_array *x = dev_zeros(RF_SHAPE(16, 4)), *y = dev_zeros(RF_SHAPE(16, 2));
    rf_array *args[2] = {x, y};
    train_ctx c = {m, opt, false, false};
    rfi_graph *g = trace_program(train_fn, &c, args, 2);
    rfi_plan *p = plan_of(g, getenv("PLAN_SHOW") != NULL);
    if (p) {
        /* REDUCE (8): the forward dots x.W1 [16,8] and h.W2 [16,2] (512 and 256
         * multiply-adds: below the matmul threshold), the mse sum, and in the
         * backward pass db2 (sum over the batch), dh = dy.W2', dW2, db1, dW1.
         * Two of them compute the one value that alone reads them after their
         * fold (REDUCE epilogues): the loss = sum / N (output 0) and dz = dh *
         * (1 - h^2) [16,8]; the sum and dh are never stored.
         * LOOP (4): h = tanh(x.W1 + b1) (read by a dot and by the backward
         * pass; a math function, so not an epilogue of x.W1); dy = d mse / d
         * yhat [16,2] (read by three reductions); ONE
         * flat Adam loop over the 58 parameters, segmented: it computes the
         * new moments (in place) and stores the new W1, b1, W2, b2 straight
         * into their captures (in place; no flat new-parameter vector); one
         * scalar loop for the updated beta powers and step counter (in place).
         * CALL 0, COPY 0: every update is in place. */
        CHECK(rfi_plan_count(p, RFI_STEP_REDUCE) == 8);
        CHECK(rfi_plan_count(p, RFI_STEP_LOOP) == 4);
        CHECK(reduce_epilogues(p) == 2);
        CHECK(rfi_plan_count(p, RFI_STEP_CALL) == 0);
        CHECK(rfi_plan_count(p, RFI_STEP_COPY) == 0);
        CHECK(count_loc(p, RFI_LOC_IN_PLACE) == g->n_updates);
        CHECK(g->n_updates == 9);
        CHECK(p->loc[g->outputs[0]->id].kind == RFI_LOC_OUTPUT);
        check_flat_update(p, 58, 4);
        check_invariants(p);
    }
    rfi_plan_free(p);
    /* without in-place updates: the same steps, then one COPY per update */
    rfi_plan_opts o = rfi_plan_opts_default();
    o.in_place_updates = false;
    p = NULL;
    CHECK_OK(rfi_plan_build(g, &o, &p));
    if (p) {
        CHECK(rfi_plan_count(p, RFI_STEP_COPY) == g->n_updates);
        CHECK(count_loc(p, RFI_LOC_IN_PLACE) == 0);
        check_invariants(p);
    }
    rfi_plan_free(p);
    /* every dot as a library call: the 5 dots become CALLs, 3 sums stay REDUCE,
     * and the operands of every call are materialised */
    o = rfi_plan_opts_default();
    o.matmul_call_min_flops = 1;
    o.dot_loop_max_rows = 0;
    p = NULL;
    CHECK_OK(rfi_plan_build(g, &o, &p));
    if (p) {
        CHECK(rfi_plan_count(p, RFI_STEP_CALL) == 5);
        CHECK(rfi_plan_count(p, RFI_STEP_REDUCE) == 3);
        for (int q = 0; q < p->n_steps; q++) {
            const rfi_step *s = &p->steps[q];
            if (s->kind != RFI_STEP_CALL)
                continue;
            const rfi_node *r = g->nodes[s->core];
            CHECK(s->n_epilogue > 0 || s->n_fused == 0);
            for (int k = 0; k < r->n_in; k++)
                CHECK(p->loc[r->in[k]->id].kind != RFI_LOC_INLINE);
        }
        check_invariants(p);
    }
    rfi_plan_free(p);
    rfi_graph_free(g);
    /* The step a user traces (withgradient + update, no guard): the new parameters
     * read the new moments, which are update values, and still join their loop,
     * reading them where that loop computes them: the same one flat segmented loop,
     * every update in place, no COPY (it was a second loop and two copies). */
    c.unguarded = true;
    g = trace_program(train_fn, &c, args, 2);
    p = plan_of(g, getenv("PLAN_SHOW") != NULL);
    if (p) {
        CHECK(rfi_plan_count(p, RFI_STEP_COPY) == 0);
        CHECK(count_loc(p, RFI_LOC_IN_PLACE) == g->n_updates);
        check_flat_update(p, 58, 4);
        check_invariants(p);
    }
    rfi_plan_free(p);
    rfi_graph_free(g);
    rf_array_free(x);
    rf_array_free(y);
    rf_opt_free(opt);
    rf_model_free(m);
    rf_model_free(host);
}

/* A matrix-vector product (inference at batch 1) is a REDUCE step whatever its
 * size: 1x784 . 784x512 has 401408 multiply-adds, over the matmul threshold. */
static void matvec_fn(rf_trace *t, void *ctx)
{
    rf_array *w = ctx;
    rf_return(t, rf_matmul(rf_arg(t, 0), rf_transpose(rf_capture(t, w), (const int64_t[]){1, 0})));
}

static void test_matvec(void)
{
    rf_array *x = dev_zeros(RF_SHAPE(1, 784)), *w = dev_zeros(RF_SHAPE(512, 784));
    rfi_graph *g = trace_program(matvec_fn, w, &x, 1);
    rfi_plan *p = plan_of(g, false);
    if (p) {
        CHECK(rfi_plan_count(p, RFI_STEP_REDUCE) == 1);
        CHECK(rfi_plan_count(p, RFI_STEP_CALL) == 0);
        check_invariants(p);
    }
    rfi_plan_free(p);
    rfi_plan_opts o = rfi_plan_opts_default();
    o.dot_loop_max_rows = 0; /* no exception: the library call */
    p = NULL;
    CHECK_OK(rfi_plan_build(g, &o, &p));
    if (p) {
        CHECK(rfi_plan_count(p, RFI_STEP_CALL) == 1);
        CHECK(rfi_plan_count(p, RFI_STEP_REDUCE) == 0);
        for (int q = 0; q < p->n_steps; q++)
            if (p->steps[q].kind == RFI_STEP_CALL)
                CHECK(p->steps[q].call == RFI_CALL_MATMUL);
        check_invariants(p);
    }
    rfi_plan_free(p);
    rfi_graph_free(g);
    rf_array_free(x);
    rf_array_free(w);
}

/* A module's parts (render_c.c) share gcc's time: with each kernel's
 * functions costing their bytes plus 2048 (PIECE_COST), the cnn step's parts
 * differ by less than its largest piece. (This was the mlp step's check, by
 * bytes alone 16 small kernels in one part and 3 large ones in the other,
 * until its C, 2 kernels fewer, fit in one part.) */
static void check_parts_balanced(const char *source)
{
    enum { MOST = 8, PIECE_COST = 2048 };
    size_t cost[MOST] = {0}, total = 0, largest = 0;
    int parts = 0;
    const char *count = source ? strstr(source, "#define RF_PARTS ") : NULL;
    CHECK(count && sscanf(count, "#define RF_PARTS %d", &parts) == 1);
    for (const char *at = source ? strstr(source, "#if RF_IN_PART(") : NULL; at;
         at = strstr(at + 1, "#if RF_IN_PART(")) {
        int part = atoi(at + strlen("#if RF_IN_PART("));
        const char *end = strstr(at, "#endif");
        CHECK(end && part >= 0 && part < parts && part < MOST);
        if (!end || part < 0 || part >= MOST)
            break;
        size_t piece = (size_t)(end - at) + PIECE_COST;
        cost[part] += piece;
        total += piece;
        largest = piece > largest ? piece : largest;
    }
    size_t most = 0, least = total;
    for (int q = 0; q < parts && q < MOST; q++) {
        most = cost[q] > most ? cost[q] : most;
        least = cost[q] < least ? cost[q] : least;
    }
    CHECK(parts >= 2 && least > 0 && most - least < largest); /* bytes alone: 40 KB and 18 KB */
}

/* An Adam training step of a model (host, consumed) on a batch x of zeros
 * and one-hot targets y, traced: the model (host copy and device copy),
 * optimiser and batch live here until train_case_free. */
typedef struct train_case {
    rf_model *host, *m;
    rf_opt *opt;
    rf_array *x, *y;
    rfi_graph *g;
} train_case;

static train_case train_case_trace(rf_model *host, rf_array *x, int64_t batch)
{
    train_case k = {host, rf_model_to(host, cpu), NULL, x, NULL, NULL};
    k.opt = rf_setup(rf_adam(1e-3), k.m);
    k.y = dev_zeros(RF_SHAPE(batch, 10));
    rf_array *args[2] = {k.x, k.y};
    train_ctx c = {k.m, k.opt, true, false};
    k.g = trace_program(train_fn, &c, args, 2);
    return k;
}

/* The cnn tests' step: 4 images of 1x28x28, 10 classes. */
static train_case cnn_case_trace(rf_model *host)
{
    return train_case_trace(host, rf_array_new(cpu, RF_F32, RF_SHAPE(4, 1, 28, 28), NULL), 4);
}

/* The mlp benchmark's step: 784-512-256-10 relu, 128 images. */
static train_case mlp_case_trace(void)
{
    rf_nn_seed(1);
    rf_model *host = rf_chain(rf_dense(784, 512, RF_ACT_RELU), rf_dense(512, 256, RF_ACT_RELU),
                              rf_dense(256, 10, RF_ACT_IDENTITY));
    return train_case_trace(host, dev_zeros(RF_SHAPE(128, 784)), 128);
}

static void train_case_free(train_case *k)
{
    rfi_graph_free(k->g);
    rf_array_free(k->x);
    rf_array_free(k->y);
    rf_opt_free(k->opt);
    rf_model_free(k->m);
    rf_model_free(k->host);
}

static void test_mlp_train_step(void)
{
    train_case k = mlp_case_trace();
    rfi_graph *g = k.g;
    rfi_plan *p = plan_of(g, getenv("PLAN_SHOW") != NULL);
    if (p) {
        /* CALL MATMUL (8): three forward dots, and in the backward pass dX and
         * dW of the last two layers and dW of the first (its dX is dead). */
        CHECK(rfi_plan_count(p, RFI_STEP_CALL) == 8);
        for (int q = 0; q < p->n_steps; q++)
            if (p->steps[q].kind == RFI_STEP_CALL)
                CHECK(p->steps[q].call == RFI_CALL_MATMUL);
        /* REDUCE (7): the logsoftmax max and sum, the loss's two sums, the
         * backward row sum of the logsoftmax (a sibling of the loss's row sum
         * in one step: one pass over their input) and the bias gradients (3).
         * The max is a stop_gradient: its VJP (a row sum of the cotangent over
         * a count of ties, folded beside those two) is gone. */
        CHECK(rfi_plan_count(p, RFI_STEP_REDUCE) == 7);
        int two_roots = 0;
        for (int q = 0; q < p->n_steps; q++)
            two_roots += p->steps[q].kind == RFI_STEP_REDUCE && p->steps[q].n_roots == 2;
        CHECK(two_roots == 1);
        /* LOOP (6): log(sum) (the sum's REDUCE computes exp(z - max) inline,
         * and the logsoftmax's VJP reads only its result, so exp(z - max) is
         * never stored), dlogits, two relu backward masks; ONE flat Adam loop over
         * all 535818 parameters (segmented: it also stores the six new
         * parameters in place), one scalar loop (beta powers, step counter).
         * The loss (output 0: its sum over the batch divided by 128) is the
         * epilogue of that sum's REDUCE step; the row sum beside it keeps its
         * siblings. The two hidden layers' bias + relu are epilogues of their
         * forward calls: the relu's backward mask reads its result, so the
         * pre-activation is never stored. */
        CHECK(rfi_plan_count(p, RFI_STEP_LOOP) == 6);
        CHECK(reduce_epilogues(p) == 1);
        int bias_relu = 0, bias_only = 0;
        for (int q = 0; q < p->n_steps; q++) {
            const rfi_step *st = &p->steps[q];
            if (st->kind != RFI_STEP_CALL || st->n_epilogue == 0)
                continue;
            CHECK(st->epilogue[0].kind == RFI_EPI_BIAS);
            bias_relu += st->n_epilogue == 2 && st->epilogue[1].kind == RFI_EPI_RELU;
            bias_only += st->n_epilogue == 1;
        }
        CHECK(bias_relu == 2 && bias_only == 1);
        CHECK(rfi_plan_count(p, RFI_STEP_COPY) == 0);
        CHECK(count_loc(p, RFI_LOC_IN_PLACE) == g->n_updates);
        CHECK(g->n_updates == 11);
        check_flat_update(p, 535818, 6);
        plan_facts f = check_invariants(p);
        CHECK(p->arena_bytes < f.sum_arena);
        printf("mlp: %d steps, %d arena buffers, peak %zu bytes (%zu without reuse)\n",
               p->n_steps, f.n_arena, p->arena_bytes, f.sum_arena);
        rfi_kir_module *km = NULL;
        char *source = NULL;
        CHECK_OK(rfi_kir_lower(p, &km));
        if (km)
            CHECK_OK(rfi_render_c(km, &source));
        rfi_free(source);
        rfi_kir_free(km);
    }
    rfi_plan_free(p);
    train_case_free(&k);
}

/* (e) the CNN of the benchmarks at a small batch: convolutions go to CONV
 * calls, max-pool backward to a FALLBACK call, the plan stays consistent and
 * every update is still in place. */
/* LOOP steps whose only root is a transpose. */
static int transpose_loops(const rfi_plan *p)
{
    int n = 0;
    for (int q = 0; q < p->n_steps; q++)
        n += p->steps[q].kind == RFI_STEP_LOOP && p->steps[q].n_roots == 1 &&
             p->g->nodes[p->steps[q].roots[0]]->op == RFI_OP_TRANSPOSE;
    return n;
}

static void test_cnn_train_step(void)
{
    rf_nn_seed(3);
    train_case k = cnn_case_trace(rf_chain(rf_conv2d(3, 3, 1, 8, RF_ACT_RELU, NULL),
                                         rf_maxpool(2, 2, 0, 0), rf_flatten_layer(),
                                         rf_dense(8 * 13 * 13, 10, RF_ACT_IDENTITY)));
    rfi_graph *g = k.g;
    rfi_plan *p = plan_of(g, getenv("PLAN_SHOW") != NULL);
    if (p) {
        int conv = 0, fallback = 0;
        for (int q = 0; q < p->n_steps; q++) {
            conv += p->steps[q].kind == RFI_STEP_CALL && p->steps[q].call == RFI_CALL_CONV;
            fallback += p->steps[q].kind == RFI_STEP_CALL && p->steps[q].call == RFI_CALL_FALLBACK;
        }
        CHECK(conv >= 2);     /* forward and weight gradient (no input gradient needed) */
        CHECK(fallback >= 1); /* select_and_scatter of the max-pool backward */
        CHECK(count_loc(p, RFI_LOC_IN_PLACE) == g->n_updates);
        check_invariants(p);
        printf("cnn: %d steps (%d LOOP, %d REDUCE, %d CALL), arena %zu bytes\n", p->n_steps,
               rfi_plan_count(p, RFI_STEP_LOOP), rfi_plan_count(p, RFI_STEP_REDUCE),
               rfi_plan_count(p, RFI_STEP_CALL), p->arena_bytes);
        CHECK(transpose_loops(p) == 2); /* x and dy transposed for the weight gradient */
        rfi_kir_module *km = NULL;
        char *source = NULL;
        CHECK_OK(rfi_kir_lower(p, &km));
        if (km)
            CHECK_OK(rfi_render_c(km, &source));
        check_parts_balanced(source);
        rfi_free(source);
        rfi_kir_free(km);
    }
    /* With transposed views the weight-gradient conv reads both from their
     * sources: the two transposes are inline and no step computes them. */
    rfi_plan_opts o = rfi_plan_opts_default();
    o.conv_transposed_views = true;
    rfi_plan *pv = NULL;
    CHECK_OK(rfi_plan_build(g, &o, &pv));
    if (p && pv) {
        CHECK(transpose_loops(pv) == 0);
        CHECK(rfi_plan_count(pv, RFI_STEP_LOOP) == rfi_plan_count(p, RFI_STEP_LOOP) - 2);
        int views = 0;
        for (int q = 0; q < pv->n_steps; q++) {
            const rfi_step *st = &pv->steps[q];
            if (st->kind != RFI_STEP_CALL || st->call != RFI_CALL_CONV)
                continue;
            const rfi_node *n = pv->g->nodes[st->core >= 0 ? st->core : st->roots[0]];
            for (int k = 0; k < 2; k++)
                views += n->in[k]->op == RFI_OP_TRANSPOSE &&
                         pv->loc[n->in[k]->id].kind == RFI_LOC_INLINE &&
                         pv->loc[n->in[k]->in[0]->id].kind != RFI_LOC_INLINE;
        }
        CHECK(views == 2);
        check_invariants(pv);
    }
    rfi_plan_free(pv);
    rfi_plan_free(p);
    train_case_free(&k);
}

/* (f) Channel-blocked layouts (layout.c) on a two-convolution CNN with
 * 16 channels: the convolutions' outputs, the first pool's output, the
 * pool gradients and the cotangents between them are blocked; the second
 * pool's output (reshaped for the dense layer: aliased), the input image (an
 * argument), weights and weight gradients stay row-major; without the
 * option nothing is blocked. */
static bool blocked_node(const rfi_plan *p, int x)
{
    return rfi_plan_layout(p, x) == RFI_LAYOUT_C16;
}

static void test_blocked_layouts(void)
{
    rf_nn_seed(5);
    train_case k = cnn_case_trace(
        rf_chain(rf_conv2d(3, 3, 1, 16, RF_ACT_RELU, NULL), rf_maxpool(2, 2, 0, 0),
                 rf_conv2d(3, 3, 16, 32, RF_ACT_RELU, NULL), rf_maxpool(2, 2, 0, 0),
                 rf_flatten_layer(), rf_dense(32 * 5 * 5, 10, RF_ACT_IDENTITY)));
    rfi_graph *g = k.g;
    rfi_plan_opts o = rfi_plan_opts_default();
    o.conv_transposed_views = true;
    rfi_plan *plain = NULL, *p = NULL;
    CHECK_OK(rfi_plan_build(g, &o, &plain));
    o.blocked_activations = true;
    CHECK_OK(rfi_plan_build(g, &o, &p));
    if (plain && p) {
        CHECK(plain->layout == NULL && rfi_plan_count_layout(plain, RFI_LAYOUT_C16) == 0);
        int conv_out = 0, pool_out = 0, scatter_out = 0;
        for (int x_id = 0; x_id < g->n_nodes; x_id++) {
            const rfi_node *n = g->nodes[x_id];
            if (p->loc[x_id].kind == RFI_LOC_INLINE)
                continue;
            bool b = blocked_node(p, x_id);
            if (b) { /* only what the pass may block */
                CHECK(p->loc[x_id].kind == RFI_LOC_ARENA && n->dtype == RF_F32 &&
                      n->rank == 4 && n->dims[1] % 16 == 0);
                for (int y_id = 0; y_id < g->n_nodes; y_id++)
                    CHECK(p->loc[y_id].kind != RFI_LOC_ALIAS || p->loc[y_id].alias != x_id);
            }
            if (n->op == RFI_OP_ARGUMENT || n->op == RFI_OP_CAPTURE)
                CHECK(!b);
            if (n->op == RFI_OP_REDUCE_WINDOW)
                pool_out += b;
            if (n->op == RFI_OP_SELECT_AND_SCATTER)
                scatter_out += b;
        }
        for (int q = 0; q < p->n_steps; q++) {
            const rfi_step *st = &p->steps[q];
            if (st->kind != RFI_STEP_CALL || st->call != RFI_CALL_CONV)
                continue;
            const rfi_node *core = g->nodes[st->n_epilogue > 0 ? st->core : st->roots[0]];
            /* weight gradients ([C, O, 3, 3]) stay plain; the forwards' outputs
             * (relu epilogue) and the input gradient are blocked */
            if (core->dims[2] == 3 && core->dims[3] == 3)
                CHECK(!blocked_node(p, st->roots[0]));
            else
                conv_out += blocked_node(p, st->roots[0]);
        }
        CHECK(conv_out == 3); /* two forwards and the second layer's input gradient */
        CHECK(pool_out == 1); /* the first pool; the second is reshaped (aliased) */
        CHECK(scatter_out == 2);
        CHECK(p->n_steps == plain->n_steps && p->arena_bytes == plain->arena_bytes);
        check_invariants(p);
        CHECK(rfi_plan_count_layout(p, RFI_LAYOUT_NHWC) == 0); /* every C here is 16 or 32 */
        printf("cnn: %d values channel-blocked\n", rfi_plan_count_layout(p, RFI_LAYOUT_C16));
        char *text = rfi_plan_print(p);
        CHECK(text && strstr(text, " c16\n"));
        rfi_free(text);
    }
    rfi_plan_free(p);
    rfi_plan_free(plain);
    train_case_free(&k);
    /* 8 channels: channels last instead, for the same values */
    rf_nn_seed(6);
    train_case e = cnn_case_trace(
        rf_chain(rf_conv2d(3, 3, 1, 8, RF_ACT_RELU, NULL), rf_conv2d(3, 3, 8, 8, RF_ACT_RELU, NULL),
                 rf_flatten_layer(), rf_dense(8 * 24 * 24, 10, RF_ACT_IDENTITY)));
    rfi_plan_opts eo = rfi_plan_opts_default();
    eo.conv_transposed_views = true;
    eo.blocked_activations = true;
    rfi_plan *ep = NULL;
    CHECK_OK(rfi_plan_build(e.g, &eo, &ep));
    if (ep) {
        CHECK(rfi_plan_count_layout(ep, RFI_LAYOUT_C16) == 0);
        CHECK(rfi_plan_count_layout(ep, RFI_LAYOUT_NHWC) >= 1); /* the first conv's output */
        check_invariants(ep);
        char *text = rfi_plan_print(ep);
        CHECK(text && strstr(text, " nhwc\n"));
        rfi_free(text);
    }
    rfi_plan_free(ep);
    /* ... and 8-channel blocks for the same values where the machine's
     * vectors hold 8 floats */
    eo.channel_blocks = RFI_LAYOUT_C8;
    CHECK_OK(rfi_plan_build(e.g, &eo, &ep));
    if (ep) {
        CHECK(rfi_plan_count_layout(ep, RFI_LAYOUT_NHWC) == 0 &&
              rfi_plan_count_layout(ep, RFI_LAYOUT_C16) == 0);
        CHECK(rfi_plan_count_layout(ep, RFI_LAYOUT_C8) >= 1);
        check_invariants(ep);
        char *text = rfi_plan_print(ep);
        CHECK(text && strstr(text, " c8\n"));
        rfi_free(text);
    }
    rfi_plan_free(ep);
    train_case_free(&e);
}

/* ---- CALL epilogues -------------------------------------------------------------------- */

static void forward_fn(rf_trace *t, void *ctx)
{
    rf_return(t, rf_apply(ctx, rf_arg(t, 0)));
}

/* A model's forward traced on a batch of zeros: the host model (owned), its
 * cpu copy in the batch's dtype, the batch and the graph. */
typedef struct traced_forward {
    rf_model *host, *m;
    rf_array *x;
    rfi_graph *g;
} traced_forward;

static traced_forward trace_forward(rf_model *host, rf_dtype dt, const int64_t *dims, int rank)
{
    traced_forward f = {host, NULL, NULL, NULL};
    rf_to_opts to = {.to_f64 = dt == RF_F64};
    f.m = rf_model_to_opts(host, cpu, &to);
    f.x = rf_array_new(cpu, dt, dims, rank, NULL);
    f.g = trace_program(forward_fn, f.m, &f.x, 1);
    return f;
}

static void traced_forward_free(traced_forward *f)
{
    rfi_graph_free(f->g);
    rf_array_free(f->x);
    rf_model_free(f->m);
    rf_model_free(f->host);
}

/* The epilogue kinds of CALL step q match `kinds` (n of them). */
static bool epilogue_is(const rfi_plan *p, int q, const rfi_epi_kind *kinds, int n)
{
    const rfi_step *s = &p->steps[q];
    if (s->kind != RFI_STEP_CALL || s->n_epilogue != n)
        return false;
    for (int k = 0; k < n; k++)
        if (s->epilogue[k].kind != kinds[k])
            return false;
    return s->epilogue[n - 1].node == s->roots[0];
}

/* The MLP forward: each dense layer is ONE matmul call whose epilogue adds the
 * bias and applies the activation; nothing is left for a loop. */
static void test_mlp_forward_epilogues(void)
{
    rf_nn_seed(1);
    traced_forward f = trace_forward(rf_chain(rf_dense(784, 512, RF_ACT_RELU),
                                              rf_dense(512, 256, RF_ACT_TANH),
                                              rf_dense(256, 64, RF_ACT_SIGMOID)),
                                     RF_F32, RF_SHAPE(128, 784));
    rfi_graph *g = f.g;
    rfi_plan *p = plan_of(g, getenv("PLAN_SHOW") != NULL);
    if (p) {
        CHECK(p->n_steps == 3);
        CHECK(rfi_plan_count(p, RFI_STEP_CALL) == 3);
        CHECK(rfi_plan_count(p, RFI_STEP_LOOP) == 0);
        static const rfi_epi_kind relu[] = {RFI_EPI_BIAS, RFI_EPI_RELU};
        static const rfi_epi_kind tanh_[] = {RFI_EPI_BIAS, RFI_EPI_TANH};
        static const rfi_epi_kind sigm[] = {RFI_EPI_BIAS, RFI_EPI_LOGISTIC};
        CHECK(epilogue_is(p, 0, relu, 2));
        CHECK(epilogue_is(p, 1, tanh_, 2));
        CHECK(epilogue_is(p, 2, sigm, 2));
        for (int q = 0; q < p->n_steps; q++) {
            const rfi_step *s = &p->steps[q];
            CHECK(s->call == RFI_CALL_MATMUL);
            CHECK(g->nodes[s->core]->op == RFI_OP_DOT_GENERAL);
            CHECK(p->loc[s->core].kind == RFI_LOC_INLINE);
            CHECK(s->n_epilogue > 0 && s->epilogue[0].axis == 1);
            CHECK(s->n_epilogue > 0 && g->nodes[s->epilogue[0].operand]->op == RFI_OP_CAPTURE);
        }
        CHECK(p->loc[p->steps[2].roots[0]].kind == RFI_LOC_OUTPUT);
        check_invariants(p);
    }
    rfi_plan_free(p);
    /* switched off, for all calls or for matmuls (the cpu backend on AVX2): bias and
     * activation are loops again */
    for (int off = 0; off < 2; off++) {
        rfi_plan_opts o = rfi_plan_opts_default();
        if (off == 0)
            o.call_epilogues = false;
        else
            o.matmul_epilogues = false;
        p = NULL;
        CHECK_OK(rfi_plan_build(g, &o, &p));
        if (p) {
            CHECK(rfi_plan_count(p, RFI_STEP_CALL) == 3);
            CHECK(rfi_plan_count(p, RFI_STEP_LOOP) == 3);
            for (int q = 0; q < p->n_steps; q++)
                CHECK(p->steps[q].n_epilogue == 0);
            check_invariants(p);
        }
        rfi_plan_free(p);
    }
    traced_forward_free(&f);
}

/* The MLP in f64: the math library multiplies f32 only, so its products
 * are REDUCE steps (generated loops; a call would run the reference kernel),
 * each with its bias and activation fused. */
static void test_f64_products_are_loops(void)
{
    rf_nn_seed(1);
    traced_forward f = trace_forward(rf_chain(rf_dense(784, 512, RF_ACT_RELU),
                                              rf_dense(512, 256, RF_ACT_RELU)),
                                     RF_F64, RF_SHAPE(128, 784));
    rfi_graph *g = f.g;
    rfi_plan *p = plan_of(g, getenv("PLAN_SHOW") != NULL);
    if (p) {
        CHECK(p->n_steps == 2);
        CHECK(rfi_plan_count(p, RFI_STEP_REDUCE) == 2);
        CHECK(rfi_plan_count(p, RFI_STEP_CALL) == 0);
        for (int q = 0; q < p->n_steps; q++)
            CHECK(g->nodes[p->steps[q].core]->op == RFI_OP_DOT_GENERAL &&
                  g->nodes[p->steps[q].core]->dtype == RF_F64);
        check_invariants(p);
    }
    rfi_plan_free(p);
    traced_forward_free(&f);
}

/* The CNN forward: relu(conv(x, w) + b) is one CONV call with a per-channel
 * bias (result dim 1) and relu, whether matmuls take epilogues or not. */
static void test_cnn_forward_epilogues(void)
{
    rf_nn_seed(3);
    traced_forward f =
        trace_forward(rf_chain(rf_conv2d(3, 3, 1, 8, RF_ACT_RELU, NULL), rf_maxpool(2, 2, 0, 0),
                               rf_flatten_layer(), rf_dense(8 * 13 * 13, 10, RF_ACT_IDENTITY)),
                      RF_F32, RF_SHAPE(16, 1, 28, 28));
    rfi_graph *g = f.g;
    for (int matmuls = 1; matmuls >= 0; matmuls--) {
        rfi_plan_opts o = rfi_plan_opts_default();
        o.matmul_epilogues = matmuls;
        rfi_plan *p = NULL;
        CHECK_OK(rfi_plan_build(g, &o, &p));
        if (p) {
            static const rfi_epi_kind relu[] = {RFI_EPI_BIAS, RFI_EPI_RELU};
            int conv = 0;
            for (int q = 0; q < p->n_steps; q++) {
                if (p->steps[q].kind != RFI_STEP_CALL || p->steps[q].call != RFI_CALL_CONV)
                    continue;
                conv++;
                CHECK(epilogue_is(p, q, relu, 2));
                CHECK(p->steps[q].epilogue[0].axis == 1);
            }
            CHECK(conv == 1);
            /* the first step is the convolution: no loop computes bias or relu */
            CHECK(p->steps[0].kind == RFI_STEP_CALL && p->steps[0].call == RFI_CALL_CONV);
            check_invariants(p);
        }
        rfi_plan_free(p);
    }
    traced_forward_free(&f);
}

/* relu(x . W + r) with r an argument of the result's shape: a residual ADD and
 * the relu; with r also an output, still fused (r is only read). A result read
 * twice (the dot is also returned) fuses nothing. */
static void residual_fn(rf_trace *t, void *ctx)
{
    rf_tensor *d = rf_matmul(rf_arg(t, 0), rf_capture(t, ctx));
    rf_return(t, rf_relu(rf_add(d, rf_arg(t, 1))));
}

static void shared_fn(rf_trace *t, void *ctx)
{
    rf_tensor *d = rf_matmul(rf_arg(t, 0), rf_capture(t, ctx));
    rf_return(t, rf_relu(d));
    rf_return(t, d);
}

static void test_residual_epilogue(void)
{
    rf_array *w = dev_zeros(RF_SHAPE(256, 128));
    rf_array *args[2] = {dev_zeros(RF_SHAPE(64, 256)), dev_zeros(RF_SHAPE(64, 128))};
    rfi_graph *g = trace_program(residual_fn, w, args, 2);
    rfi_plan *p = plan_of(g, getenv("PLAN_SHOW") != NULL);
    if (p) {
        static const rfi_epi_kind res[] = {RFI_EPI_ADD, RFI_EPI_RELU};
        CHECK(p->n_steps == 1);
        CHECK(epilogue_is(p, 0, res, 2));
        CHECK(g->nodes[p->steps[0].epilogue[0].operand]->op == RFI_OP_ARGUMENT);
        check_invariants(p);
    }
    rfi_plan_free(p);
    rfi_graph_free(g);
    g = trace_program(shared_fn, w, args, 1);
    p = plan_of(g, getenv("PLAN_SHOW") != NULL);
    if (p) {
        CHECK(rfi_plan_count(p, RFI_STEP_CALL) == 1);
        CHECK(rfi_plan_count(p, RFI_STEP_LOOP) == 1);
        for (int q = 0; q < p->n_steps; q++)
            CHECK(p->steps[q].n_epilogue == 0);
        check_invariants(p);
    }
    rfi_plan_free(p);
    rfi_graph_free(g);
    rf_array_free(w);
    rf_array_free(args[0]);
    rf_array_free(args[1]);
}

/* ---- Index math in the kernels ------------------------------------------------------- */

/* Live divisions and remainders of kernel k's index expressions. */
static int divisions(const rfi_kir_kernel *k)
{
    bool *live = rfi_calloc((size_t)k->n_ins + 1, sizeof *live);
    if (!live)
        return -1;
    rfi_kir_liveness(k, live);
    int n = 0;
    for (int i = 0; i < k->n_ins; i++)
        n += live[i] && (k->ins[i].op == RFI_KIR_IDIV || k->ins[i].op == RFI_KIR_IREM);
    rfi_free(live);
    return n;
}

/* g after the pools pass, planned as the CPU backend plans it, in kernel IR. */
static rfi_kir_module *kernels_of_program(const rfi_graph *g, rfi_plan **plan)
{
    rfi_graph *unrolled = NULL;
    rfi_kir_module *km = NULL;
    *plan = NULL;
    CHECK_OK(rfi_unroll_pools(g, &unrolled));
    rfi_plan_opts o = rfi_plan_opts_default();
    o.conv_transposed_views = true;
    o.blocked_activations = true;
    if (unrolled)
        CHECK_OK(rfi_plan_build(unrolled, &o, plan));
    if (*plan)
        CHECK_OK(rfi_kir_lower(*plan, &km));
    return km;
}

static void free_kernels(rfi_kir_module *km, rfi_plan *p)
{
    rfi_graph *g = p ? (rfi_graph *)p->g : NULL;
    rfi_kir_free(km);
    rfi_plan_free(p);
    rfi_graph_free(g);
}

/* (h) Index math: the CNN's Adam update reads the convolution's weight
 * gradient transposed through the flat concatenation of all gradients, and
 * its evaluation flattens a max pool of a 16-channel (blocked) activation for
 * the dense layer. Both kernels loop over shapes where every division and
 * remainder of their indices splits away: the update's pieces loop over
 * their parameter's shape, the pool over its blocked operand's blocks (lanes
 * innermost), storing the pool row-major; the flatten is an alias of it. */
static void test_index_math(void)
{
    rf_nn_seed(5);
    rf_model *host = rf_chain(rf_conv2d(3, 3, 1, 16, RF_ACT_RELU, NULL),
                              rf_conv2d(3, 3, 16, 16, RF_ACT_RELU, NULL), rf_maxpool(2, 2, 0, 0),
                              rf_flatten_layer(), rf_dense(16 * 12 * 12, 10, RF_ACT_IDENTITY));
    train_case k = cnn_case_trace(host);
    rfi_plan *p = NULL;
    rfi_kir_module *km = kernels_of_program(k.g, &p);
    int pieces = 0;
    for (int s = 0; km && s < km->n_steps; s++) {
        const rfi_kir_kernel *kk = km->steps[s].kernel;
        if (!kk || !strstr(kk->name, "_seg"))
            continue;
        pieces++;
        if (divisions(kk) != 0)
            fprintf(stderr, "k%d_%s: %d divisions\n", kk->step, kk->name, divisions(kk));
        CHECK(divisions(kk) == 0);
    }
    CHECK(pieces >= 4); /* two kernels and two biases at least */
    free_kernels(km, p);

    rf_array *x = rf_array_new(cpu, RF_F32, RF_SHAPE(8, 1, 28, 28), NULL);
    rfi_graph *g = trace_program(forward_fn, k.m, &x, 1);
    km = g ? kernels_of_program(g, &p) : NULL;
    int pools = 0, flattens = 0;
    for (int s = 0; km && s < km->n_steps; s++) {
        const rfi_kir_kernel *kk = km->steps[s].kernel;
        if (!kk || kk->n_stores != 1)
            continue;
        const rfi_node *stored = p->g->nodes[kk->stores[0].node];
        CHECK(stored->op != RFI_OP_RESHAPE);
        if (stored->op != RFI_OP_MAX || stored->rank != 4)
            continue;
        pools++;
        CHECK(divisions(kk) == 0);
        CHECK(kk->rank >= 2 && kk->dims[kk->rank - 1] == 16); /* the lanes of a block */
        CHECK(!blocked_node(p, stored->id));
    }
    for (int x = 0; p && x < p->g->n_nodes; x++)
        if (p->g->nodes[x]->op == RFI_OP_RESHAPE && p->g->nodes[x]->in[0]->op == RFI_OP_MAX) {
            flattens++;
            CHECK(p->loc[x].kind == RFI_LOC_ALIAS);
        }
    CHECK(pools == 1 && flattens == 1);
    free_kernels(km, p);
    rfi_graph_free(g);
    rf_array_free(x);
    train_case_free(&k);
}

/* The plan of g under o, its kernel IR and its C (returned, owned; NULL on
 * failure, which the checks report). Each step's direct, decided before
 * memory planning, is checked against the question asked after it. */
static char *plan_and_render(const rfi_graph *g, const rfi_plan_opts *o, rfi_plan **p,
                             rfi_kir_module **km)
{
    char *source = NULL;
    CHECK_OK(rfi_plan_build(g, o, p));
    for (int q = 0; *p && q < (*p)->n_steps; q++)
        CHECK((*p)->steps[q].direct == rfi_kir_direct_conv(*p, q, NULL));
    if (*p)
        CHECK_OK(rfi_kir_lower(*p, km));
    if (*km)
        CHECK_OK(rfi_render_c(*km, &source));
    return source;
}

/* plan_and_render's results checked rendered, then freed with their program. */
static void free_rendered(char *source, rfi_kir_module *km, rfi_plan *p, rfi_graph *g)
{
    CHECK(source != NULL);
    rfi_free(source);
    rfi_kir_free(km);
    rfi_plan_free(p);
    rfi_graph_free(g);
}

/* fn compiled for and run on the interpreter (want) and the CPU backend (got). */
static void run_on_both(rf_trace_fn fn, rf_array *const *args, int nargs, rf_array **want,
                        rf_array **got, int nouts)
{
    for (int pass = 0; pass < 2; pass++) {
        setenv("RF_BACKEND", pass ? "cpu" : "interp", 1);
        rf_exec *e = NULL;
        CHECK_OK(rf_compile(fn, NULL, args, nargs, &e));
        CHECK_OK(e ? rf_exec_run(e, args, nargs, pass ? got : want, nouts) : RF_E_INVALID);
        rf_exec_free(e);
    }
    unsetenv("RF_BACKEND");
}

/* A concatenation along rows of values earlier steps compute (products as
 * loops, below the call size) takes its operands in place (memplan.c): a1,
 * a2 and a3 are written into their rows of c, whose step copies only x,
 * read from the arguments, and a0, which it reads twice; a1 is read again
 * after c's product. The smaller concatenation of a2 and a3, their rows of
 * c in order, lies there too and has nothing to copy. Compiled, the results
 * are those of the interpreter. */
static void concat_slabs_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *w = rf_arg(t, 4), *a[4];
    for (int i = 0; i < 4; i++)
        a[i] = rf_matmul(rf_arg(t, i), w);
    rf_tensor *parts[6] = {a[0], a[1], rf_arg(t, 5), a[0], a[2], a[3]};
    rf_tensor *c = rf_concatenate(parts, 6, 0), *c2 = rf_concatenate(a + 2, 2, 0);
    const int64_t rows[1] = {0};
    rf_return(t, rf_dot_general(c, c, NULL, NULL, 0, rows, rows, 1));
    rf_return(t, rf_dot_general(c2, c2, NULL, NULL, 0, rows, rows, 1));
    rf_return(t, rf_mul_s(a[1], 2.0));
}

/* The concatenation of n operands in g (NULL: none). */
static const rfi_node *concat_of(const rfi_graph *g, int n)
{
    for (int x = 0; g && x < g->n_nodes; x++)
        if (g->nodes[x]->op == RFI_OP_CONCATENATE && g->nodes[x]->n_in == n)
            return g->nodes[x];
    return NULL;
}

static void test_concat_slabs(void)
{
    enum { ARGS = 6, OUTS = 3 };
    rf_array *args[ARGS];
    for (int i = 0; i < ARGS; i++) {
        float v[32 * 64];
        for (int j = 0; j < 32 * 64; j++)
            v[j] = (float)(((j * 7 + i * 13) % 17) - 8) / 16.0f;
        int64_t dims[2] = {i == 4 ? 32 : 16, i >= 4 ? 64 : 32};
        args[i] = rf_array_new(cpu, RF_F32, dims, 2, v);
    }
    rfi_graph *g = trace_program(concat_slabs_fn, NULL, args, ARGS);
    rfi_plan *p = NULL;
    rfi_kir_module *km = NULL;
    rfi_plan_opts o = rfi_plan_opts_default();
    char *source = g ? plan_and_render(g, &o, &p, &km) : NULL;
    const rfi_node *c = concat_of(g, 6), *c2 = concat_of(g, 2);
    CHECK(c != NULL && c2 != NULL);
    if (p && c && c2) {
        const bool want[6] = {false, true, false, false, true, true};
        for (int k = 0; k < 6; k++)
            CHECK(rfi_plan_slab_in_place(p, c, k) == want[k]);
        size_t row = 64 * sizeof(float), at = p->loc[c->id].offset;
        CHECK(p->loc[c->in[1]->id].offset == at + 16 * row);
        CHECK(p->loc[c->in[4]->id].offset == at + 64 * row);
        CHECK(p->loc[c->in[5]->id].offset == at + 80 * row);
        CHECK(p->loc[c2->id].offset == at + 64 * row);
        CHECK(rfi_plan_slab_in_place(p, c2, 0) && rfi_plan_slab_in_place(p, c2, 1));
        int pieces = 0;
        for (int s = 0; km && s < km->n_steps; s++) {
            const rfi_kir_kernel *kk = km->steps[s].kernel;
            if (kk && strstr(kk->name, "concatenate")) {
                pieces++;
                CHECK(strstr(kk->name, "part0") || strstr(kk->name, "part2") ||
                      strstr(kk->name, "part3"));
            }
        }
        CHECK(pieces == 3);
        check_invariants(p);
    }
    free_rendered(source, km, p, g);
    rf_array *want[OUTS] = {NULL}, *got[OUTS] = {NULL};
    run_on_both(concat_slabs_fn, args, ARGS, want, got, OUTS);
    for (int i = 0; i < OUTS; i++) {
        float *a = want[i] ? rf_array_data(want[i]) : NULL;
        float *b = got[i] ? rf_array_data(got[i]) : NULL;
        int64_t n = i < 2 ? 64 * 64 : 16 * 64;
        bool close = a && b;
        for (int64_t j = 0; close && j < n; j++) {
            close = fabsf(a[j] - b[j]) <= 1e-5f * (1.0f + fabsf(a[j]));
            if (!close)
                fprintf(stderr, "concat slabs: output %d [%lld]: %g, interpreted %g\n", i,
                        (long long)j, (double)b[j], (double)a[j]);
        }
        CHECK(close);
        rf_array_free(want[i]);
        rf_array_free(got[i]);
    }
    for (int i = 0; i < ARGS; i++)
        rf_array_free(args[i]);
}

/* An RNN's input projections x_t W_i over its steps, x [batch, steps * features]
 * cut into the steps, become one product of x reshaped (passes/stack_dots.c),
 * each step reading its columns of it; the hidden projections h W_h, a chain,
 * stay one a step. Compiled, the last state and both weight gradients are
 * those of the interpreter. */
enum { STACK_STEPS = 8, STACK_BATCH = 32, STACK_IN = 64, STACK_HIDDEN = 128 };

static void stacked_rnn_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = rf_arg(t, 0), *w[2] = {rf_arg(t, 1), rf_arg(t, 2)}, *h = NULL;
    for (int s = 0; s < STACK_STEPS; s++) {
        const int64_t start[2] = {0, s * STACK_IN}, limit[2] = {STACK_BATCH, (s + 1) * STACK_IN};
        rf_tensor *pre = rf_matmul(rf_slice(x, start, limit, NULL), w[0]);
        h = rf_tanh(h ? rf_add(pre, rf_matmul(h, w[1])) : pre);
    }
    rf_tensor *dw[2] = {NULL, NULL};
    CHECK_OK(rf_grad(t, rf_sum_all(h), w, 2, dw));
    rf_return(t, h);
    rf_return(t, dw[0]);
    rf_return(t, dw[1]);
}

static void test_stacked_products(void)
{
    enum { ARGS = 3, OUTS = 3 };
    const int64_t dims[ARGS][2] = {{STACK_BATCH, STACK_STEPS * STACK_IN},
                                   {STACK_IN, STACK_HIDDEN},
                                   {STACK_HIDDEN, STACK_HIDDEN}};
    rf_array *args[ARGS];
    for (int i = 0; i < ARGS; i++) {
        int64_t n = dims[i][0] * dims[i][1];
        float *v = malloc((size_t)n * sizeof *v);
        for (int64_t j = 0; j < n; j++)
            v[j] = (float)(((j * 7 + i * 13) % 17) - 8) / (i ? 128.0f : 16.0f);
        args[i] = rf_array_new(cpu, RF_F32, dims[i], 2, v);
        free(v);
    }
    rfi_graph *g = trace_program(stacked_rnn_fn, NULL, args, ARGS), *stacked = NULL;
    if (g)
        CHECK_OK(rfi_stack_dots(g, &stacked));
    int wide = 0, by_step = 0;
    for (int x = 0; stacked && x < stacked->n_nodes; x++) {
        const rfi_node *n = stacked->nodes[x];
        if (n->op != RFI_OP_DOT_GENERAL || n->in[0]->op == RFI_OP_TRANSPOSE)
            continue;
        wide += n->dims[0] == STACK_BATCH * STACK_STEPS && n->in[0]->op == RFI_OP_RESHAPE;
        by_step += n->in[1] == stacked->args[2] && n->attr.l[3][0] == 0; /* h W_h, forward */
    }
    CHECK(wide == 1 && by_step == STACK_STEPS - 1); /* the first step has no h W_h */
    rfi_graph_free(stacked);
    rfi_graph_free(g);
    rf_array *want[OUTS] = {NULL}, *got[OUTS] = {NULL};
    run_on_both(stacked_rnn_fn, args, ARGS, want, got, OUTS);
    double worst = 0;
    for (int i = 0; i < OUTS; i++) {
        const float *a = want[i] ? rf_array_data(want[i]) : NULL;
        const float *b = got[i] ? rf_array_data(got[i]) : NULL;
        CHECK(a && b);
        int64_t n = a && b ? rf_array_numel(want[i]) : 0;
        for (int64_t j = 0; j < n; j++) {
            double err = fabs((double)a[j] - b[j]) / (1.0 + fabs((double)a[j]));
            worst = err > worst ? err : worst;
        }
        rf_array_free(want[i]);
        rf_array_free(got[i]);
    }
    CHECK(worst <= 1e-5);
    printf("stacked products: one of [%d,%d] for %d steps; compiled within %.2g of the "
           "interpreter\n", STACK_BATCH * STACK_STEPS, STACK_HIDDEN, STACK_STEPS, worst);
    for (int i = 0; i < ARGS; i++)
        rf_array_free(args[i]);
}

/* A loop over a flat concatenation of vectors (no segment roots: nothing slices
 * it back) is segmented at the operands' ends, so each piece reads one operand
 * directly instead of picking it per element through a chain of selects. */
static void flat_concat_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *parts[3] = {rf_arg(t, 0), rf_arg(t, 1), rf_arg(t, 2)};
    rf_tensor *g = rf_concatenate(parts, 3, 0);
    rf_return(t, rf_mul(rf_arg(t, 3), rf_mul(g, g)));
}

static void test_flat_concat_segmented(void)
{
    rf_array *args[4] = {dev_zeros(RF_SHAPE(100)), dev_zeros(RF_SHAPE(7)),
                         dev_zeros(RF_SHAPE(50)), dev_zeros(RF_SHAPE(157))};
    rfi_graph *g = trace_program(flat_concat_fn, NULL, args, 4);
    rfi_plan *p = NULL;
    rfi_kir_module *km = NULL;
    rfi_plan_opts o = rfi_plan_opts_default();
    char *source = g ? plan_and_render(g, &o, &p, &km) : NULL;
    if (p && km) {
        CHECK(p->n_steps == 1 && p->steps[0].kind == RFI_STEP_LOOP);
        CHECK(p->seg_extent && p->seg_extent[0] == 157);
        CHECK(km->n_steps == 3); /* one piece per operand */
        check_invariants(p);
    }
    free_rendered(source, km, p, g);
    for (int i = 0; i < 4; i++)
        rf_array_free(args[i]);
}

/* A loop computing a concatenation along any axis of a rank-2 result (the
 * gradient of a GRU cell's gates cut from one product) runs one loop per
 * operand, each evaluating its own operand only: no kernel selects, and no
 * kernel evaluates another operand's tanh. mode 0: the concatenation along
 * axis 1 is the root; 1: along axis 0; 2: fused into a product. */
static void concat2d_fn(rf_trace *t, void *ctx)
{
    int mode = *(const int *)ctx;
    rf_tensor *a = rf_arg(t, 0), *b = rf_arg(t, 1);
    if (mode == 1) {
        a = rf_transpose(a, (const int64_t[]){1, 0});
        b = rf_transpose(b, (const int64_t[]){1, 0});
    }
    rf_tensor *parts[3] = {rf_tanh(a), rf_logistic(b), rf_exp(a)};
    rf_tensor *c = rf_concatenate(parts, 3, mode == 1 ? 0 : 1);
    rf_return(t, mode == 2 ? rf_mul(c, c) : c);
}

static int live_ops(const rfi_kir_kernel *k, rfi_kir_op op)
{
    bool *live = rfi_calloc((size_t)k->n_ins + 1, sizeof *live);
    if (!live)
        return -1;
    rfi_kir_liveness(k, live);
    int n = 0;
    for (int i = 0; i < k->n_ins; i++)
        n += live[i] && k->ins[i].op == op;
    rfi_free(live);
    return n;
}

static void test_concat_per_operand(void)
{
    for (int mode = 0; mode < 3; mode++) {
        rf_array *args[2] = {dev_zeros(RF_SHAPE(6, 5)), dev_zeros(RF_SHAPE(6, 5))};
        rfi_graph *g = trace_program(concat2d_fn, &mode, args, 2);
        rfi_plan *p = NULL;
        rfi_kir_module *km = NULL;
        rfi_plan_opts o = rfi_plan_opts_default();
        char *source = g ? plan_and_render(g, &o, &p, &km) : NULL;
        int parts = 0;
        for (int s = 0; km && s < km->n_steps; s++) {
            const rfi_kir_kernel *kk = km->steps[s].kernel;
            if (!kk || !strstr(kk->name, "_part"))
                continue;
            parts++;
            CHECK(live_ops(kk, RFI_KIR_SELECT) == 0);
        }
        if (parts != 3)
            fprintf(stderr, "concat mode %d: %d kernels per operand\n", mode, parts);
        CHECK(parts == 3);
        if (p)
            check_invariants(p);
        free_rendered(source, km, p, g);
        for (int i = 0; i < 2; i++)
            rf_array_free(args[i]);
    }
}

#define MOST_DIRECT 32

/* The direct convolutions of g's plan under o, in step order, into d (at
 * most MOST_DIRECT, checked); returns their count. *source: the plan's C
 * (owned; NULL on failure, which the checks report). */
static int direct_steps(const rfi_graph *g, const rfi_plan_opts *o, rfi_kir_conv *d,
                        char **source)
{
    rfi_plan *p = NULL;
    rfi_kir_module *km = NULL;
    *source = plan_and_render(g, o, &p, &km);
    int n = 0;
    for (int q = 0; p && q < p->n_steps; q++)
        if (rfi_kir_direct_conv(p, q, &d[n < MOST_DIRECT ? n : MOST_DIRECT - 1]))
            n++;
    CHECK(n <= MOST_DIRECT);
    rfi_kir_free(km);
    rfi_plan_free(p);
    return n < MOST_DIRECT ? n : MOST_DIRECT;
}

/* The planner's options with direct convolutions on channel-blocked
 * activations of `blocks`. */
static rfi_plan_opts direct_conv_opts(rfi_layout blocks)
{
    rfi_plan_opts o = rfi_plan_opts_default();
    o.conv_transposed_views = true;
    o.blocked_activations = true;
    o.direct_convs = true;
    o.channel_blocks = blocks;
    return o;
}

/* (i) Direct convolutions: with the option, the CALL CONV steps of a
 * few-channel CNN that kir_conv.c takes become RFI_KIR_STEP_CONV steps and
 * C loops: the forwards from 1 and 8 channels (bias and relu epilogues),
 * the second layer's input gradient (the flipped kernel), the third's (a
 * strided layer: its output gradient dilated by 2, 16 channels) and the
 * weight gradients of the layers with fewer than 16 input channels. The
 * fourth layer (16 -> 16) and its gradients stay calls. Without the option
 * nothing changes. With row-major activations and 8-channel blocks (the
 * vectors of an AVX2 machine) the 8 -> 16 forward holds two vectors of 8
 * channels per register block (a 16-lane vector, which such a machine runs
 * slowly, nowhere) and its weight gradient stays a call. */
static void test_direct_convs(void)
{
    rf_nn_seed(7);
    rf_conv_opts stride2 = {.stride = {2, 2}};
    train_case k = cnn_case_trace(rf_chain(
        rf_conv2d(3, 3, 1, 8, RF_ACT_RELU, NULL), rf_conv2d(3, 3, 8, 8, RF_ACT_RELU, NULL),
        rf_conv2d(3, 3, 8, 16, RF_ACT_RELU, &stride2), rf_conv2d(3, 3, 16, 16, RF_ACT_RELU, NULL),
        rf_flatten_layer(), rf_dense(16 * 9 * 9, 10, RF_ACT_IDENTITY)));
    rfi_plan_opts o = rfi_plan_opts_default();
    o.conv_transposed_views = true;
    o.blocked_activations = true;
    for (int on = 0; on < 2; on++) {
        o.direct_convs = on;
        rfi_plan *p = NULL;
        rfi_kir_module *km = NULL;
        char *source = plan_and_render(k.g, &o, &p, &km);
        int convs = 0, direct = 0, forwards = 0, grads = 0, dilated = 0, lowered = 0;
        for (int q = 0; p && q < p->n_steps; q++) {
            const rfi_step *st = &p->steps[q];
            if (st->kind != RFI_STEP_CALL || st->call != RFI_CALL_CONV)
                continue;
            convs++;
            rfi_kir_conv d;
            if (!rfi_kir_direct_conv(p, q, &d))
                continue;
            direct++;
            CHECK(d.n == 4 && d.c <= 16 && d.o % 8 == 0 && d.kh == 3 && d.kw == 3);
            if (d.dilation[0] > 1) {
                dilated++;
                CHECK(d.dilation[0] == 2 && d.dilation[1] == 2 && d.c == 16 && d.o == 8);
            }
            forwards += d.kind == RFI_KIR_CONV_FORWARD && d.n_epi == 2 &&
                        d.epi[0] == RFI_EPI_BIAS && d.epi[1] == RFI_EPI_RELU;
            if (d.kind == RFI_KIR_CONV_WEIGHT_GRAD) {
                grads++;
                const rfi_node *y = p->g->nodes[st->roots[0]];
                CHECK(y->dims[0] == d.c && y->dims[1] == d.o && d.n_epi == 0);
            }
        }
        for (int s = 0; km && s < km->n_steps; s++)
            lowered += km->steps[s].kind == RFI_KIR_STEP_CONV;
        CHECK(convs >= 9);
        /* three forwards, two input gradients, three weight gradients */
        CHECK(direct == (on ? 8 : 0));
        CHECK(forwards == (on ? 3 : 0));
        CHECK(grads == (on ? 3 : 0));
        CHECK(dilated == (on ? 1 : 0));
        CHECK(lowered == direct);
        CHECK(source && (strstr(source, "direct convolution") != NULL) == on);
        CHECK(source && (strstr(source, "rf_f32x16 acc0") != NULL) == on); /* 8 -> 16 */
        CHECK(source && (strstr(source, "convolution (weight gradient)") != NULL) == on);
        /* without gcc's predictive commoning (render_c.c's prelude says why) */
        CHECK(source && (strstr(source, "RF_KERNEL RF_CONV_LOOP void") != NULL) == on);
        /* the 8 -> 16 loop's vectors are 16 floats: 512-bit ones where there are */
        CHECK(source && (strstr(source, "RF_KERNEL RF_CONV_LOOP RF_LANES16 void") != NULL) == on);
        CHECK(source && strstr(source, "#define RF_LANES16 __attribute__((target(\"prefer-vector"
                               "-width=512\")))") != NULL);
        /* the input rows of a later output row, and (weight gradients) that row of
         * the output gradient, are asked for while this row is computed, never
         * past the array's last row */
        CHECK(source && (strstr(source, "rf_prefetch_floats(x + ") != NULL) == on);
        CHECK(source && (strstr(source, "rf_prefetch_floats(c->w + ") != NULL) == on);
        CHECK(source && (strstr(source, "if (r2 < ") != NULL) == on);
        rfi_free(source);
        rfi_kir_free(km);
        rfi_plan_free(p);
    }
    o.direct_convs = true;
    o.blocked_activations = false;
    for (int c8 = 0; c8 < 2; c8++) {
        o.channel_blocks = c8 ? RFI_LAYOUT_C8 : RFI_LAYOUT_C16;
        rfi_kir_conv d[MOST_DIRECT];
        char *source = NULL;
        int direct = direct_steps(k.g, &o, d, &source), sixteen = 0, in_eights = 0;
        for (int i = 0; i < direct; i++) {
            sixteen += d[i].o == 16;
            in_eights += d[i].o == 16 && d[i].lanes == 8 && d[i].kind == RFI_KIR_CONV_FORWARD;
            CHECK(d[i].lanes == (d[i].o == 16 && c8 ? 8 : d[i].o));
        }
        CHECK(direct == (c8 ? 7 : 8));
        CHECK(sixteen == (c8 ? 1 : 2));
        CHECK(in_eights == (c8 ? 1 : 0));
        CHECK(source && (strstr(source, "rf_f32x16 acc0") != NULL) == !c8);
        CHECK(source && (strstr(source, "ob < 2; ob += 2) { /* vectors of o */") != NULL) == c8);
        rfi_free(source);
    }
    train_case_free(&k);
}

/* (j) With 8-channel blocks (an AVX2 machine's), the weight gradients of
 * few input channels to more than 16 outputs become loops too, one vector
 * per block (kir_conv.c gradient_vectors): 1 -> 32 and 4 -> 24 here; with
 * 16-channel blocks they stay calls. */
static void test_direct_weight_grads_c8(void)
{
    rf_nn_seed(8);
    train_case k = cnn_case_trace(rf_chain(
        rf_conv2d(3, 3, 1, 32, RF_ACT_RELU, NULL), rf_conv2d(3, 3, 32, 4, RF_ACT_RELU, NULL),
        rf_conv2d(3, 3, 4, 24, RF_ACT_RELU, NULL), rf_conv2d(3, 3, 24, 16, RF_ACT_RELU, NULL),
        rf_flatten_layer(), rf_dense(16 * 20 * 20, 10, RF_ACT_IDENTITY)));
    for (int c8 = 0; c8 < 2; c8++) {
        rfi_plan_opts o = direct_conv_opts(c8 ? RFI_LAYOUT_C8 : RFI_LAYOUT_C16);
        rfi_kir_conv d[MOST_DIRECT];
        char *source = NULL;
        int direct = direct_steps(k.g, &o, d, &source), wide_grads = 0;
        for (int i = 0; i < direct; i++) {
            CHECK(d[i].kind == RFI_KIR_CONV_WEIGHT_GRAD || d[i].o == 8);
            if (d[i].o > 16) {
                wide_grads++;
                CHECK(d[i].kind == RFI_KIR_CONV_WEIGHT_GRAD && d[i].w_layout == RFI_LAYOUT_C8 &&
                      (d[i].c == 1 || d[i].c == 4));
            }
        }
        CHECK(wide_grads == (c8 ? 2 : 0));
        CHECK(source && (strstr(source, "/* vectors of o */") != NULL) == c8);
        rfi_free(source);
    }
    train_case_free(&k);
}

/* (j2) The input gradient of a strided 1x1 projection, the output gradient
 * dilated by 2 and read through a 1x1 kernel, is a loop with 32 input
 * channels (more than other dilated forms take), in one vector of 16 outputs
 * or, with 8-channel blocks, two of 8. At twice the widths (64 channels
 * dilated, 32 outputs) it is a loop of two vectors of 16 with 16-channel
 * blocks and stays a library call with 8-channel ones. */
static void test_direct_projection_grad(void)
{
    for (int wide = 0; wide < 2; wide++) {
        int64_t c = wide ? 32 : 16, o = 2 * c;
        rf_nn_seed(9);
        rf_conv_opts s2 = {.stride = {2, 2}}, s2p1 = {.stride = {2, 2}, .pad = {1, 1}};
        train_case k = cnn_case_trace(rf_chain(
            rf_conv2d(3, 3, 1, c, RF_ACT_RELU, NULL),
            rf_parallel(RF_COMBINE_ADD, rf_conv2d(1, 1, c, o, RF_ACT_IDENTITY, &s2),
                        rf_conv2d(3, 3, c, o, RF_ACT_IDENTITY, &s2p1)),
            rf_flatten_layer(), rf_dense(o * 13 * 13, 10, RF_ACT_IDENTITY)));
        for (int c8 = 0; c8 < 2; c8++) {
            rfi_plan_opts opts = direct_conv_opts(c8 ? RFI_LAYOUT_C8 : RFI_LAYOUT_C16);
            rfi_kir_conv d[MOST_DIRECT];
            char *source = NULL;
            int direct = direct_steps(k.g, &opts, d, &source), spread = 0;
            for (int i = 0; i < direct; i++) {
                if (d[i].dilation[0] == 1)
                    continue;
                spread++;
                CHECK(d[i].kind == RFI_KIR_CONV_FORWARD && d[i].kh == 1 && d[i].kw == 1 &&
                      d[i].c == o && d[i].o == c && d[i].dilation[1] == 2);
                CHECK(d[i].lanes == (c8 ? 8 : 16));
            }
            CHECK(spread == (wide && c8 ? 0 : 1));
            rfi_free(source);
        }
        train_case_free(&k);
    }
}

/* traced after simplify, CSE and unroll_pools, as the compiling backend runs
 * them (NULL on failure; the caller frees it). */
static rfi_graph *unrolled_graph(const rfi_graph *traced)
{
    rfi_graph *simple = NULL, *shared = NULL, *g = NULL;
    CHECK_OK(rfi_simplify(traced, &simple));
    if (simple)
        CHECK_OK(rfi_cse(simple, &shared));
    if (shared)
        CHECK_OK(rfi_unroll_pools(shared, &g));
    rfi_graph_free(shared);
    rfi_graph_free(simple);
    return g;
}

/* The planner's options for the pool tests' variant v: 0 no direct
 * convolutions, 1 direct ones with 16-channel blocks, 2 with 8-channel ones. */
static rfi_plan_opts pool_variant(int v)
{
    rfi_plan_opts o = rfi_plan_opts_default();
    o.conv_transposed_views = true;
    o.blocked_activations = true;
    o.direct_convs = v > 0;
    o.channel_blocks = v == 2 ? RFI_LAYOUT_C8 : RFI_LAYOUT_C16;
    return o;
}

/* The module's direct forwards that run their pool's kernel (kir.h
 * pool_kernel), each checked: 32 channels in vectors of `lanes`, 2x2
 * windows, the pool's kernel lowered, run by it alone, its outermost loop
 * over [batch][32 / lanes channel blocks][window_rows], the plan's step
 * running the pool, and with tile_floats > 0 its result in a tile of that
 * size, taking no bytes (else in the arena). */
static int pooled_forwards(const rfi_plan *p, const rfi_kir_module *km, int64_t batch,
                           int64_t window_rows, int64_t tile_floats, int64_t lanes)
{
    int64_t groups = lanes > 0 ? 32 / lanes : 0;
    int pooled = 0;
    for (int s = 0; km && s < km->n_steps; s++) {
        const rfi_kir_conv *d = &km->steps[s].conv;
        if (km->steps[s].kind != RFI_KIR_STEP_CONV || d->pool_kernel < 0)
            continue;
        pooled++;
        const rfi_kir_step *pk = &km->steps[d->pool_kernel];
        CHECK(d->kind == RFI_KIR_CONV_FORWARD && d->o == 32 && d->lanes == lanes);
        CHECK(d->pool_rows == 2 && d->pool_groups == groups && pk->pooled_by == s);
        CHECK(pk->kind == RFI_KIR_STEP_KERNEL && pk->step == d->pool_step);
        CHECK(pk->kernel->dims[0] == batch * groups * window_rows);
        const rfi_step *st = &p->steps[km->steps[s].step];
        CHECK(st->runs_pool && d->tiled == (tile_floats > 0) && d->tile_floats == tile_floats);
        CHECK(p->loc[st->roots[0]].kind == (tile_floats > 0 ? RFI_LOC_TILE : RFI_LOC_ARENA));
        for (int t = 0; t < km->n_steps; t++)
            CHECK(t == s || km->steps[t].conv.pool_kernel != d->pool_kernel ||
                  km->steps[t].kind != RFI_KIR_STEP_CONV);
    }
    return pooled;
}

/* ---- (l) memory planning around a left-out step ------------------------------------------- */

static void five_values_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_tensor *a = rf_neg(x), *g = rf_exp(x), *s = rf_add(a, g), *u = rf_tanh(x);
    rf_return(t, rf_mul(s, u));
}

/* Steps a, g, s(a, g) left out, u, c(s, u), one root each, placed by
 * memplan.c alone: the reader c of the unstored s computes it from a and g
 * (as a spread weight gradient reads the codes and the pooled cotangent),
 * so a and g must keep their bytes until c, though no listed input says so;
 * u may not take them. Without the rule u lands on a's bytes.
 * With `pooled`, s(a, g) instead runs the next step u(s) itself (a
 * convolution running its pool, s in its tile) and c reads u: u is written
 * while s still reads a and g, so u may not take their bytes either, and s
 * takes none. */
static void memplan_around(bool pooled)
{
    rf_array *x = dev_zeros(RF_SHAPE(64));
    rfi_graph *g = rfi_graph_new(cpu, "left_out");
    int64_t dims[1][RF_MAX_RANK] = {{64}};
    rf_dtype dt = RF_F32;
    int rank = 1;
    CHECK_OK(rfi_graph_set_args(g, 1, &dt, &rank, (const int64_t(*)[RF_MAX_RANK])dims));
    five_values_fn(g, NULL);
    CHECK_OK(g->status);
    enum { A, G, S, U, C, STEPS };
    const rfi_node *c = g->outputs[0], *sum = c->in[0], *u = c->in[1];
    const int ids[STEPS] = {sum->in[0]->id, sum->in[1]->id, sum->id, u->id, c->id};
    int reads[STEPS][2] = {{-1, -1}, {-1, -1}, {A, G}, {-1, -1}, {S, U}};
    if (pooled) {
        reads[U][0] = S;
        reads[C][0] = U;
    }
    rfi_plan plan = {0};
    plan.g = g;
    rfi_loc *loc = calloc((size_t)g->n_nodes, sizeof *loc);
    int *step_of = malloc((size_t)g->n_nodes * sizeof *step_of);
    rfi_bstep bsteps[STEPS] = {0};
    rfi_step steps[STEPS] = {0};
    int order[STEPS], pos_of[STEPS];
    for (int x = 0; loc && step_of && x < g->n_nodes; x++) {
        loc[x].alias = -1;
        step_of[x] = -1;
    }
    for (int q = 0; loc && step_of && q < STEPS; q++) {
        loc[ids[q]].kind = q != S ? RFI_LOC_ARENA : pooled ? RFI_LOC_TILE : RFI_LOC_UNSTORED;
        step_of[ids[q]] = q;
        order[q] = pos_of[q] = q;
        steps[q].roots = (int *)&ids[q];
        steps[q].n_roots = 1;
        steps[q].left_out = q == S && !pooled;
        steps[q].runs_pool = q == S && pooled;
        for (int k = 0; k < 2; k++)
            if (reads[q][k] >= 0)
                CHECK(rfi_intlist_push(&bsteps[q].inputs, ids[reads[q][k]]));
    }
    plan.loc = loc;
    plan.steps = steps;
    plan.n_steps = STEPS;
    rfi_plan_builder b = {0};
    b.g = g;
    b.p = &plan;
    b.n = g->n_nodes;
    b.step_of = step_of;
    b.steps = bsteps;
    b.n_steps = STEPS;
    b.order = order;
    b.pos_of = pos_of;
    if (loc && step_of) {
        CHECK_OK(rfi_memplan(&b));
        size_t bytes = 64 * sizeof(float), at_u = loc[ids[U]].offset;
        for (int k = A; k <= G; k++)
            CHECK(at_u + bytes <= loc[ids[k]].offset || loc[ids[k]].offset + bytes <= at_u);
        /* a, g, u, c: nothing for s; pooled, c may take a's bytes */
        CHECK(plan.arena_bytes == (pooled ? 3 : 4) * bytes);
    }
    for (int q = 0; q < STEPS; q++)
        rfi_intlist_free(&bsteps[q].inputs);
    free(step_of);
    free(loc);
    rfi_graph_free(g);
    rf_array_free(x);
}

static void test_memplan_left_out(void)
{
    memplan_around(false);
    memplan_around(true);
}

/* The operands a spread weight gradient d at step `conv` reads in place of
 * its left-out output gradient (the codes and the pooled cotangent) keep
 * their bytes until it runs: no step in between writes over them. */
static void check_spread_operands_live(const rfi_plan *p, const rfi_kir_conv *d, int conv)
{
    size_t bytes = (size_t)(d->n * d->o * (d->oh / d->win[0]) * (d->ow / d->win[1])) * 4;
    const int buffers[2] = {d->codes_buffer, d->w_buffer};
    const size_t offsets[2] = {d->codes_offset, d->w_offset};
    for (int q = d->spread_step + 1; q <= conv; q++)
        for (int r = 0; r < p->steps[q].n_roots; r++) {
            int id = p->steps[q].roots[r], b;
            size_t off, size = rfi_node_nbytes(p->g->nodes[id]);
            rfi_plan_buffer(p, id, &b, &off);
            for (int k = 0; k < 2; k++)
                CHECK(b != buffers[k] || off >= offsets[k] + bytes || offsets[k] >= off + size);
        }
}

/* (k) A first layer's weight gradient over a max pool's spread gradient
 * (kir.h, spread): after the passes the CPU backend runs, the 1 -> 32
 * layer's weight gradient is a loop (16- or 8-channel blocks) that reads the
 * pooled cotangent and the codes, and the LOOP step that spread them to the
 * 26x26 output gradient is left out of the module. Without direct
 * convolutions that step stays. */
static void test_spread_weight_grad(void)
{
    rf_nn_seed(9);
    train_case k = cnn_case_trace(rf_chain(rf_conv2d(3, 3, 1, 32, RF_ACT_RELU, NULL),
                                         rf_maxpool(2, 2, 0, 0), rf_flatten_layer(),
                                         rf_dense(32 * 13 * 13, 10, RF_ACT_IDENTITY)));
    rfi_graph *g = unrolled_graph(k.g);
    size_t arena[3] = {0};
    for (int v = 0; g && v < 3; v++) {
        rfi_plan_opts o = pool_variant(v);
        rfi_plan *p = NULL;
        rfi_kir_module *km = NULL;
        char *source = plan_and_render(g, &o, &p, &km);
        int spread = 0, left_out = -1, lowered_loops = 0, loops = 0;
        size_t spread_bytes = 0;
        for (int q = 0; p && q < p->n_steps; q++) {
            rfi_kir_conv d;
            loops += p->steps[q].kind == RFI_STEP_LOOP;
            if (!rfi_kir_direct_conv(p, q, &d) || !d.spread)
                continue;
            spread++;
            left_out = d.spread_step;
            CHECK(d.kind == RFI_KIR_CONV_WEIGHT_GRAD && d.c == 1 && d.o == 32);
            CHECK(d.win[0] == 2 && d.win[1] == 2 && d.lanes == (v == 2 ? 8 : 16));
            CHECK(d.w_layout == (v == 2 ? RFI_LAYOUT_C8 : RFI_LAYOUT_C16));
            const rfi_step *st = &p->steps[d.spread_step];
            CHECK(st->kind == RFI_STEP_LOOP && st->n_roots == 1 &&
                  p->g->nodes[st->roots[0]]->dims[2] == 26);
            check_spread_operands_live(p, &d, q);
            spread_bytes = rfi_node_nbytes(p->g->nodes[st->roots[0]]);
        }
        for (int q = 0; p && q < p->n_steps; q++) { /* a segmented loop lowers to pieces */
            bool lowered = false;
            for (int s = 0; km && s < km->n_steps; s++)
                lowered |= km->steps[s].step == q;
            lowered_loops += lowered && p->steps[q].kind == RFI_STEP_LOOP;
            CHECK(!lowered || q != left_out);
        }
        CHECK(spread == (v > 0));
        CHECK(lowered_loops == loops - (v > 0));
        CHECK(source && (strstr(source, "spread from c->w") != NULL) == (v > 0));
        for (int q = 0; p && q < p->n_steps; q++) /* the spread's bytes are not planned */
            CHECK(p->steps[q].left_out == (q == left_out) &&
                  (p->loc[p->steps[q].roots[0]].kind == RFI_LOC_UNSTORED) == (q == left_out));
        if (p) /* here the spread was the arena's largest buffer */
            arena[v] = p->arena_bytes;
        CHECK(v == 0 || (spread_bytes > 0 && arena[v] + spread_bytes <= arena[0]));
        /* the pool's result goes row-major to the dense layer, its codes
         * channel-blocked: the forward does not run the pool's loop */
        CHECK(pooled_forwards(p, km, 0, 0, 0, 0) == 0);
        for (int q = 0; p && q < p->n_steps; q++)
            CHECK(!p->steps[q].runs_pool);
        rfi_free(source);
        rfi_kir_free(km);
        rfi_plan_free(p);
    }
    rfi_graph_free(g);
    train_case_free(&k);
}

/* A 1 -> 32 first layer with a 2x2 pool whose result (and codes) stay
 * channel-blocked for the next convolution: with direct convolutions its
 * forward is a loop that runs the pool's kernel after each pair of rows
 * (the entry point does not call that kernel), in two vectors of 16
 * channels with 16-channel blocks, four of 8 with 8-channel blocks (a tile
 * spanning the four blocks' rows); without, they stay a call and a loop. */
static void test_pooled_forward(void)
{
    rf_nn_seed(10);
    train_case k = cnn_case_trace(rf_chain(rf_conv2d(3, 3, 1, 32, RF_ACT_RELU, NULL),
                                         rf_maxpool(2, 2, 0, 0),
                                         rf_conv2d(3, 3, 32, 16, RF_ACT_RELU, NULL),
                                         rf_flatten_layer(),
                                         rf_dense(16 * 11 * 11, 10, RF_ACT_IDENTITY)));
    rfi_graph *g = unrolled_graph(k.g);
    for (int v = 0; g && v < 3; v++) {
        rfi_plan_opts o = pool_variant(v);
        rfi_plan *p = NULL;
        rfi_kir_module *km = NULL;
        char *source = plan_and_render(g, &o, &p, &km);
        int64_t lanes = v == 1 ? 16 : 8, tile = ((32 / lanes - 1) * 26 + 2) * 26 * lanes;
        CHECK(pooled_forwards(p, km, 4, 13, tile, lanes) == (v > 0));
        CHECK(source && (strstr(source, "pool over them") != NULL) == (v > 0));
        /* the pool's kernel (step 1) is called from the forward's loop, on
         * its tile, or by the entry point, not both */
        CHECK(source && (strstr(source, "k1_max(c->pool, q, q + 1, yt);") != NULL) == (v > 0));
        CHECK(source && (strstr(source, "float ytile[") != NULL) == (v > 0));
        bool entry_calls =
            source && (strstr(source, "k1_max(&c, ") || strstr(source, ", k1_max, &c)"));
        CHECK(entry_calls == (v == 0));
        /* the pool's kernel loops over the 16 lanes of a block innermost (with
         * 16-channel blocks: one 512-bit vector, RF_LANES16), over 8 with 8 */
        CHECK(source && (strstr(source, "RF_KERNEL RF_LANES16 void k1_max(") != NULL) == (v != 2));
        rfi_free(source);
        rfi_kir_free(km);
        rfi_plan_free(p);
    }
    rfi_graph_free(g);
    train_case_free(&k);
}

/* The same layers on 2 images of 64x64: one image's two rows of the first
 * layer's result span 62 KB of its blocked layout (its second channel block
 * starts 62 rows later), more than the tile takes, so the result stays in
 * memory while the forward still runs the pool after each pair of rows. */
static void test_pooled_forward_untiled(void)
{
    rf_nn_seed(11);
    rf_model *host = rf_chain(rf_conv2d(3, 3, 1, 32, RF_ACT_RELU, NULL), rf_maxpool(2, 2, 0, 0),
                              rf_conv2d(3, 3, 32, 16, RF_ACT_RELU, NULL), rf_flatten_layer(),
                              rf_dense(16 * 29 * 29, 10, RF_ACT_IDENTITY));
    rf_model *m = rf_model_to(host, cpu);
    rf_array *x = rf_array_new(cpu, RF_F32, RF_SHAPE(2, 1, 64, 64), NULL);
    rfi_graph *traced = trace_program(forward_fn, m, &x, 1);
    rfi_graph *g = traced ? unrolled_graph(traced) : NULL;
    rfi_plan_opts o = pool_variant(1);
    rfi_plan *p = NULL;
    rfi_kir_module *km = NULL;
    char *source = g ? plan_and_render(g, &o, &p, &km) : NULL;
    CHECK(pooled_forwards(p, km, 2, 31, 0, 16) == 1);
    CHECK(source && strstr(source, "k1_max(c->pool, q, q + 1);") && !strstr(source, "ytile"));
    rfi_free(source);
    rfi_kir_free(km);
    rfi_plan_free(p);
    rfi_graph_free(g);
    rfi_graph_free(traced);
    rf_array_free(x);
    rf_model_free(m);
    rf_model_free(host);
}

/* Whether arena nodes a and b share bytes. */
static bool share_bytes(const rfi_plan *p, int a, int b)
{
    a = resolve(p, a), b = resolve(p, b);
    if (p->loc[a].kind != RFI_LOC_ARENA || p->loc[b].kind != RFI_LOC_ARENA)
        return false;
    size_t oa = p->loc[a].offset, ob = p->loc[b].offset;
    return oa < ob + rfi_node_nbytes(p->g->nodes[b]) && ob < oa + rfi_node_nbytes(p->g->nodes[a]);
}

/* The pairs of p (runs_with_next), each checked: two library calls of one
 * kind, the second reading nothing of the first, and neither's operands or
 * result sharing bytes with the other's result. */
static int checked_pairs(const rfi_plan *p, rfi_call_kind kind)
{
    int pairs = 0, n = p ? p->g->n_nodes : 0;
    char *read = calloc((size_t)n + 1, 1), *seen = calloc((size_t)n + 1, 1);
    char *read_b = calloc((size_t)n + 1, 1);
    for (int q = 0; p && read && seen && read_b && q + 1 < p->n_steps; q++) {
        if (!p->steps[q].runs_with_next)
            continue;
        pairs++;
        const rfi_step *a = &p->steps[q], *b = &p->steps[q + 1];
        CHECK(a->kind == RFI_STEP_CALL && a->call == kind);
        CHECK(b->kind == RFI_STEP_CALL && b->call == kind);
        CHECK(!rfi_kir_direct_conv(p, q, NULL) && !rfi_kir_direct_conv(p, q + 1, NULL));
        step_reads(p, q + 1, read_b, seen);
        CHECK(!read_b[resolve(p, a->roots[0])]);
        step_reads(p, q, read, seen);
        for (int x = 0; x < n; x++) {
            if (read[x] || x == a->roots[0])
                CHECK(!share_bytes(p, x, b->roots[0]));
            if (read_b[x])
                CHECK(!share_bytes(p, x, a->roots[0]));
        }
    }
    free(read);
    free(seen);
    free(read_b);
    return pairs;
}

/* The examples' cnn (32 and 64 channels): its second layer's input and
 * weight gradients, library convolutions, become neighbours that may run at
 * the same time (runs_with_next) once the crop of the weight gradient's
 * input, a loop between them that does not read the input gradient, has
 * moved before them; the module calls only the first. The mlp pairs its
 * second and third layers' input and weight gradients, matmuls (the first
 * layer's weight gradient reads the second's input gradient). Without the
 * option no step is paired. */
static void test_concurrent_calls(void)
{
    rf_nn_seed(12);
    train_case k = cnn_case_trace(rf_chain(rf_conv2d(3, 3, 1, 32, RF_ACT_RELU, NULL),
                                         rf_maxpool(2, 2, 0, 0),
                                         rf_conv2d(3, 3, 32, 64, RF_ACT_RELU, NULL),
                                         rf_maxpool(2, 2, 0, 0), rf_flatten_layer(),
                                         rf_dense(64 * 5 * 5, 10, RF_ACT_IDENTITY)));
    rfi_graph *g = unrolled_graph(k.g);
    for (int on = 0; g && on < 2; on++) {
        rfi_plan_opts o = pool_variant(1);
        o.concurrent_calls = on;
        rfi_plan *p = NULL;
        rfi_kir_module *km = NULL;
        char *source = plan_and_render(g, &o, &p, &km);
        CHECK(checked_pairs(p, RFI_CALL_CONV) == on);
        for (int q = 1; p && q < p->n_steps; q++) /* the crop ran before both */
            if (p->steps[q].runs_with_next)
                CHECK(p->steps[q - 1].kind == RFI_STEP_LOOP &&
                      p->g->nodes[p->steps[q - 1].roots[0]]->op == RFI_OP_SLICE);
        if (p)
            check_invariants(p);
        CHECK(source && (strstr(source, "(run with step") != NULL) == (on == 1));
        rfi_free(source);
        rfi_kir_free(km);
        rfi_plan_free(p);
    }
    rfi_graph_free(g);
    train_case_free(&k);

    train_case mk = mlp_case_trace();
    rfi_plan_opts o = rfi_plan_opts_default();
    o.concurrent_calls = true;
    rfi_plan *p = NULL;
    if (mk.g)
        CHECK_OK(rfi_plan_build(mk.g, &o, &p));
    CHECK(checked_pairs(p, RFI_CALL_MATMUL) == 2);
    if (p)
        check_invariants(p);
    rfi_plan_free(p);
    train_case_free(&mk);
}

/* Three independent products, the last two of one operand g (a layer's input
 * and weight gradients both read its output gradient): those two pair, not
 * the first with the second, which is next to it. Paired as they came, a
 * ResNet's projection weight gradient took the input gradient of the layer
 * after it, and that layer's two Winograd gradients no longer ran side by
 * side. */
static void sharing_pair_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = rf_arg(t, 0), *w = rf_arg(t, 1), *g = rf_arg(t, 2), *u = rf_arg(t, 3);
    const int64_t rows[1] = {0}; /* summed and added: every step but the last in the arena */
    rf_tensor *a = rf_sum(rf_matmul(x, w), rows, 1, false);
    rf_tensor *b = rf_sum(rf_matmul(g, u), rows, 1, false);
    rf_tensor *c = rf_sum(rf_matmul(g, rf_transpose(u, (const int64_t[]){1, 0})), rows, 1, false);
    rf_return(t, rf_add(rf_add(a, b), c));
}

static void test_pairs_sharing_input(void)
{
    rf_array *args[4];
    for (int i = 0; i < 4; i++)
        args[i] = dev_zeros(RF_SHAPE(128, 128));
    rfi_graph *g = trace_program(sharing_pair_fn, NULL, args, 4);
    rfi_plan_opts o = rfi_plan_opts_default();
    o.concurrent_calls = true;
    rfi_plan *p = NULL;
    if (g)
        CHECK_OK(rfi_plan_build(g, &o, &p));
    if (p && getenv("PLAN_SHOW")) {
        char *text = rfi_plan_print(p);
        printf("%s", text ? text : "");
        rfi_free(text);
    }
    CHECK(checked_pairs(p, RFI_CALL_MATMUL) == 1);
    for (int q = 0; p && q + 1 < p->n_steps; q++) {
        if (!p->steps[q].runs_with_next)
            continue;
        const rfi_node *a = p->g->nodes[p->steps[q].core], *b = p->g->nodes[p->steps[q + 1].core];
        CHECK(a->in[0]->op == RFI_OP_ARGUMENT && a->in[0]->attr.i[0] == 2);
        CHECK(b->in[0]->op == RFI_OP_ARGUMENT && b->in[0]->attr.i[0] == 2);
    }
    if (p)
        check_invariants(p);
    rfi_plan_free(p);
    rfi_graph_free(g);
    for (int i = 0; i < 4; i++)
        rf_array_free(args[i]);
}

/* ---- A recurrence's backward pass: shared subexpressions stay bounded ------------------ */

enum { RECUR_STEPS = 24 };

/* h_t = 0.5 h_(t-1) + tanh(h_(t-1) W), the gradient of sum(h_T) with respect to W. Its
 * backward pass is dh_(t-1) = 0.5 dh_t + (dh_t (1 - a_t^2)) W^T: each dh_t, an elementwise
 * node of one shape, feeds the next link and the product's operand, as a GRU's or an LSTM's
 * state does. Inlining every such node re-evaluated the whole chain before each link in
 * each step: O(T^2) work and kernel code. */
static void recurrence_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *h = rf_arg(t, 0), *w = rf_arg(t, 1);
    for (int i = 0; i < RECUR_STEPS; i++)
        h = rf_add(rf_mul_s(h, 0.5), rf_tanh(rf_matmul(h, w)));
    rf_tensor *dw = NULL;
    CHECK_OK(rf_grad(t, rf_sum_all(h), &w, 1, &dw));
    rf_return(t, dw);
}

static void test_recurrence_backward(void)
{
    rf_array *h = dev_zeros(RF_SHAPE(32, 64)), *w = dev_zeros(RF_SHAPE(64, 64));
    rf_array *args[2] = {h, w};
    rfi_graph *g = trace_program(recurrence_fn, NULL, args, 2);
    rfi_plan *p = plan_of(g, getenv("PLAN_SHOW") != NULL);
    if (p) {
        /* no inline node is computed in more than a few steps, and the steps' inline
         * expressions together grow linearly with the number of links */
        int *in_steps = calloc((size_t)g->n_nodes, sizeof *in_steps);
        int most = 0;
        long total = 0;
        for (int q = 0; q < p->n_steps; q++) {
            total += p->steps[q].n_fused;
            for (int i = 0; i < p->steps[q].n_fused; i++) {
                int x = p->steps[q].fused[i];
                if (++in_steps[x] > most)
                    most = in_steps[x];
            }
        }
        if (getenv("PLAN_SHOW"))
            printf("recurrence: %d steps, inline nodes in at most %d steps, %ld in all\n", p->n_steps, most, total);
        CHECK(most <= 12);
        CHECK(total <= 32L * RECUR_STEPS);
        free(in_steps);
        check_invariants(p);
    }
    rfi_plan_free(p);
    rfi_graph_free(g);
    rf_array_free(h);
    rf_array_free(w);
}

int main(void)
{
    cpu = rf_device_cpu();
    test_elementwise_chain();
    test_softmax();
    test_masked_grad();
    test_attention_softmax();
    test_attention_pv_backward();
    test_logsoftmax_backward();
    test_results();
    test_alias_and_swap();
    test_capture_copies_run();
    test_tiny_train_step();
    test_matvec();
    test_flat_concat_segmented();
    test_concat_per_operand();
    test_concat_slabs();
    test_stacked_products();
    test_mlp_train_step();
    test_cnn_train_step();
    test_blocked_layouts();
    test_mlp_forward_epilogues();
    test_f64_products_are_loops();
    test_cnn_forward_epilogues();
    test_residual_epilogue();
    test_index_math();
    test_direct_convs();
    test_direct_weight_grads_c8();
    test_direct_projection_grad();
    test_spread_weight_grad();
    test_memplan_left_out();
    test_pooled_forward();
    test_pooled_forward_untiled();
    test_concurrent_calls();
    test_pairs_sharing_input();
    test_recurrence_backward();
    return tu_finish("test_plan");
}
