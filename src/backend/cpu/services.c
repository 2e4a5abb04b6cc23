/* services.c: the runtime services of a compiled CPU module (services.h):
 * per-executable state for every CALL step of a plan, made once at load
 * time, and the `call` / `parallel_for` entries the module calls per step.
 *
 * For each CALL step prepare records where the node's operands and result
 * live (buffer index + byte offset, from the plan) and how it runs:
 *   MATMUL (f32)   oneDNN matmul (dnnl_matmul.c)
 *   CONV (f32)     oneDNN's forward, backward-data and backward-weights
 *                  convolutions, reflux's Winograd kernels, or im2col + a
 *                  oneDNN matmul (conv.c says which when)
 *   FALLBACK       SELECT_AND_SCATTER, ARGMAX/ARGMIN, GATHER and SCATTER_ADD
 *                  on f32/f64: native kernels (pool.c, index_native.c);
 *                  anything else:
 *                  the reference kernel (rfi_interp_eval_node) writing straight
 *                  into the result buffer: exact (double accumulation), slow,
 *                  and it may allocate its own scratch (contractions pack
 *                  operands); used for FALLBACK steps and for MATMUL / CONV
 *                  steps the library path does not take (f64, integers,
 *                  G > 1 with B > 1, no spatial dims).
 * A CONV operand the plan left as a transposed view (plan.h) is read from the
 * transpose's operand: by oneDNN's backward-weights directly (the weight
 * gradient's form, described by strides), else transposed back into the
 * workspace before the call.
 * A step with an epilogue (plan.h) computes its core node and then the
 * epilogue ops into the root's buffer: as oneDNN post-ops when the library
 * path takes them, else here, after the call, element by element with the
 * interpreter's arithmetic (each op in double, rounded to the dtype once).
 * One oneDNN engine and stream per executable; one workspace (the largest any
 * step needs: oneDNN scratchpads, packed operands, im2col columns) shared by
 * the steps, which run one at a time, but for the pairs of matmuls or
 * Winograd convolutions that run side by side (plan.h runs_with_next,
 * pair_all_beside): those have a second stream and the workspace after the
 * first's part.
 * Convolutions a step or two apart that read one value in one blocked
 * layout share its copy (share_conv_inputs): a training step reorders each
 * cotangent once for its input and weight gradients. The copies live in
 * blocks of their own, reused by groups that do not overlap in time
 * (RF_CONV_SHARE=0 turns this off).
 *
 * Laid-out values (plan.h, layout.c: channel-blocked or channels last): a
 * convolution or a max-pool gradient that takes the layout reads and writes
 * it directly (rfi_cpu_conv_laid_out, rfi_cpu_native_take_layouts); for
 * any other call such an operand is reordered into a row-major copy in the
 * workspace before the call and such a result out of one after it
 * (take_layouts), so every implementation sees the layouts it was written
 * for.
 *
 * Deliberately not here: choosing which nodes become CALL steps (the plan),
 * which values are blocked (the plan's layout pass), generated code.
 */
#include "services.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../runtime/threadpool.h"
#include "../interp/interp.h"
#include "../kir.h"

/* A value in a layout (plan.h) that a call's implementation does not take
 * as it is: reordered into a copy in the workspace, in the layout the call
 * reads, before the call (an operand), or out of one after it (the result). */
typedef struct relayout {
    rfi_dnnl_copy copy; /* prim NULL: the value is read or written where it lives */
    size_t at;          /* workspace offset of the plain copy */
    size_t bytes;
} relayout;

/* Where one value lives: buffers[buffer] + offset. */
typedef struct value_ref {
    int buffer;
    size_t offset;
} value_ref;

typedef struct call_state {
    rfi_call_kind kind; /* how the step runs; NONE: not a CALL step, or direct (plan.h) */
    const rfi_node *node;
    int n_in;
    value_ref *in;      /* per operand */
    value_ref out;
    const void **operands; /* scratch for the operand pointers of one call */
    rfi_cpu_matmul *matmul;
    rfi_cpu_conv *conv;
    rfi_cpu_native *native; /* a FALLBACK step with a native kernel (pool.c) */
    const rfi_epi_op *epi;  /* the step's epilogue (n_epi == 0: none) */
    int n_epi;
    value_ref epi_in[RFI_EPI_MAX];  /* operand of each epilogue op */
    const void *epi_src[RFI_EPI_MAX]; /* its pointer during one call (NULL: none) */
    int64_t epi_inner[RFI_EPI_MAX];   /* BIAS: elements per step along its dim */
    int epi_applied;        /* leading epilogue ops the library applies */
    int lib_threads;        /* OpenMP threads the library call runs on */
    /* CONV operands read as views (plan.h, conv_transposed_views): in[k] is
     * the transpose's operand. Unless the convolution takes views itself,
     * each is transposed back into the workspace at view_at[k] per call. */
    bool view[2];
    size_t view_at[2];
    const rfi_node **value; /* per operand: the node whose buffer in[j] is (a view's operand) */
    relayout *in_plain;     /* per operand */
    relayout epi_plain[RFI_EPI_MAX];
    relayout out_plain;
    /* The plan's runs_with_next: the step called with this one, else -1.
     * paired: this call runs beside its pair's other (a thread each, the
     * library on one thread); the two use disjoint parts of the workspace,
     * from ws_at on. */
    int partner;
    bool paired;
    size_t ws_at;
    /* Runs on the calling thread alone while a later step of the run has work
     * for the team: the team is kept warm before it (keep_team_warm). */
    bool warm_team;
} call_state;

struct rfi_cpu_services {
    const rfi_plan *plan;
    dnnl_engine_t engine;
    dnnl_stream_t stream;
    dnnl_stream_t stream2; /* a side-by-side pair's second call's (NULL: none) */
    call_state *steps; /* plan->n_steps */
    int n_steps;
    void *workspace_block; /* allocation; workspace is it aligned to 64 */
    void *workspace;
    size_t workspace_bytes;
    bool have_library; /* oneDNN loaded: engine and stream exist */
    int threads;
    unsigned fork_generation; /* rfi_threadpool_fork_generation() when prepared */
    rf_status failure;        /* of the last call that failed */
    void **shared;        /* the blocked copies convolutions share (owned) */
    int n_shared;
    size_t shared_bytes;
    rfi_arena mem; /* the per-step arrays */
    /* The generated loops of this run go over their chunks last first
     * (rfi_parallel_for_ordered): flipped at each run unless
     * RF_ALTERNATE_ORDER=0, so that a step that streams more than the cores'
     * caches hold (a batch-1 forward reading its weights) finds the part the
     * last run read latest still cached. */
    bool backwards;
    bool alternate;
};

void rfi_cpu_services_parallel_for(void *rt, int64_t n, int64_t grain,
                                   void (*body)(void *ctx, int64_t lo, int64_t hi), void *ctx)
{
    const rfi_cpu_services *s = rt;
    rfi_parallel_for_ordered(n, grain, body, ctx, s && s->backwards);
}

void rfi_cpu_services_start_run(rfi_cpu_services *s)
{
    if (s && s->alternate)
        s->backwards = !s->backwards;
}

/* Gives OpenMP (oneDNN's threads) `threads` on the calling thread: the
 * setting is per thread in libgomp, so it is repeated before each library call
 * and before each primitive is created (oneDNN's matmul fixes its split over
 * threads then). */
static void set_library_threads(const rfi_cpu_services *s, int threads)
{
    int most = rfi_threadpool_size(); /* 1 in a forked child (threadpool.h) */
    if (s->have_library && rfi_dnnl.omp_set_num_threads)
        rfi_dnnl.omp_set_num_threads(threads < most ? threads : most);
}

/* Products smaller than this many multiply-adds run on the calling thread
 * alone: waking OpenMP's sleeping workers costs more than they save there
 * (measured with bench/bench_services.c: 128x256 @ 256x10 took 52 us on two
 * threads). */
#define SMALL_MATMUL_MACS 2000000

static int matmul_threads(const rfi_cpu_services *s, const rfi_node *n)
{
    return rfi_dot_macs(n) < SMALL_MATMUL_MACS ? 1 : s->threads;
}

static rf_status locate(const rfi_plan *p, const rfi_node *x, value_ref *ref, int step)
{
    if (p->loc[x->id].kind == RFI_LOC_INLINE)
        return rfi_error(RF_E_INTERNAL,
                         "cpu: call step %d reads %s node %%%d, which has no buffer", step,
                         rfi_op_table[x->op].name, (int)x->id);
    rfi_plan_buffer(p, x->id, &ref->buffer, &ref->offset);
    if (ref->buffer < 0 || ref->buffer >= rfi_plan_n_buffers(p))
        return rfi_error(RF_E_INTERNAL, "cpu: call step %d: %s node %%%d maps to buffer %d of %d",
                         step, rfi_op_table[x->op].name, (int)x->id, ref->buffer,
                         rfi_plan_n_buffers(p));
    return RF_OK;
}

/* Records the operand and result locations of CALL step k. */
static rf_status prepare_locations(rfi_cpu_services *s, int k)
{
    const rfi_plan *p = s->plan;
    const rfi_step *step = &p->steps[k];
    call_state *cs = &s->steps[k];
    if (step->n_roots != 1 || step->roots[0] < 0 || step->roots[0] >= p->g->n_nodes)
        return rfi_error(RF_E_INTERNAL, "cpu: call step %d has %d roots (expected 1)", k,
                         step->n_roots);
    const rfi_node *root = p->g->nodes[step->roots[0]];
    const rfi_node *n = root;
    if (step->n_epilogue > 0) {
        if (step->n_epilogue > RFI_EPI_MAX || step->core < 0 || step->core >= p->g->n_nodes)
            return rfi_error(RF_E_INTERNAL, "cpu: call step %d has a bad epilogue (%d ops, core "
                             "%%%d)", k, step->n_epilogue, step->core);
        n = p->g->nodes[step->core];
        cs->epi = step->epilogue;
        cs->n_epi = step->n_epilogue;
    }
    cs->node = n;
    cs->n_in = n->n_in;
    cs->in = rfi_arena_alloc(&s->mem, ((size_t)n->n_in + 1) * sizeof *cs->in);
    cs->operands = rfi_arena_alloc(&s->mem, ((size_t)n->n_in + 1) * sizeof *cs->operands);
    cs->value = rfi_arena_alloc(&s->mem, ((size_t)n->n_in + 1) * sizeof *cs->value);
    cs->in_plain = rfi_arena_alloc(&s->mem, ((size_t)n->n_in + 1) * sizeof *cs->in_plain);
    if (!cs->in || !cs->operands || !cs->value || !cs->in_plain)
        return rfi_error(RF_E_NOMEM, "cpu: out of memory preparing call step %d", k);
    memset(cs->in_plain, 0, ((size_t)n->n_in + 1) * sizeof *cs->in_plain);
    for (int j = 0; j < n->n_in; j++) {
        const rfi_node *x = n->in[j];
        if (p->loc[x->id].kind == RFI_LOC_INLINE && x->op == RFI_OP_TRANSPOSE &&
            n->op == RFI_OP_CONVOLUTION && j < 2) {
            cs->view[j] = true; /* the plan checked it swaps dims 0 and 1 */
            x = x->in[0];
        }
        cs->value[j] = x;
        rf_status st = locate(p, x, &cs->in[j], k);
        if (st != RF_OK)
            return st;
    }
    for (int e = 0; e < cs->n_epi; e++) {
        const rfi_epi_op *op = &cs->epi[e];
        cs->epi_in[e].buffer = -1;
        if (op->operand < 0)
            continue;
        if (op->operand >= p->g->n_nodes)
            return rfi_error(RF_E_INTERNAL, "cpu: call step %d: epilogue operand %%%d", k,
                             op->operand);
        rf_status st = locate(p, p->g->nodes[op->operand], &cs->epi_in[e], k);
        if (st != RF_OK)
            return st;
        if (op->kind == RFI_EPI_BIAS) {
            if (op->axis < 0 || op->axis >= root->rank ||
                root->dims[op->axis] != rfi_node_numel(p->g->nodes[op->operand]))
                return rfi_error(RF_E_INTERNAL, "cpu: call step %d: bias %%%d does not run "
                                 "along dim %d", k, op->operand, op->axis);
            cs->epi_inner[e] = rfi_numel(root->dims + op->axis + 1, root->rank - op->axis - 1);
        }
    }
    return locate(p, root, &cs->out, k);
}

static bool is_leaf(const rfi_node *n)
{
    return n->op == RFI_OP_ARGUMENT || n->op == RFI_OP_CAPTURE || n->op == RFI_OP_GRAD;
}

/* Views the call does not take (or the reference kernel, when oneDNN is
 * missing) are transposed back into the workspace, after the call's own part. */
static void reserve_view_copies(call_state *cs, size_t *workspace)
{
    for (int j = 0; j < 2; j++) {
        if (!cs->view[j])
            continue;
        *workspace = rfi_ws_align(*workspace);
        cs->view_at[j] = *workspace;
        *workspace += rfi_node_nbytes(cs->node->in[j]);
    }
}

typedef struct swap_job {
    const char *src; /* [b, a, row] */
    char *dst;       /* [a, b, row] */
    int64_t a, b;
    size_t row;      /* bytes of one [inner dims] block */
} swap_job;

static void swap_rows(void *ctx, int64_t lo, int64_t hi)
{
    const swap_job *j = ctx;
    for (int64_t i = lo; i < hi; i++)
        for (int64_t k = 0; k < j->b; k++)
            memcpy(j->dst + (size_t)(i * j->b + k) * j->row,
                   j->src + (size_t)(k * j->a + i) * j->row, j->row);
}

/* Operand `node` (dims [a, b, ...]) from a buffer holding it as [b, a, ...]. */
static void copy_view(const rfi_node *node, const void *src, void *dst)
{
    swap_job job = {src, dst, node->dims[0], node->dims[1],
                    (size_t)rfi_numel(node->dims + 2, node->rank - 2) *
                        rf_dtype_size(node->dtype)};
    int64_t per_row = (int64_t)(job.row / 4) * job.b + 1;
    rfi_parallel_for(job.a, 1 + 16384 / per_row, swap_rows, &job);
}

/* ---- Laid-out values the implementation does not take ------------------------------ */

/* x's buffer from layout `from` to a copy in layout `to` (plan.h). */
static rf_status make_relayout(rfi_cpu_services *s, relayout *r, const rfi_node *x,
                               rfi_layout from_layout, rfi_layout to_layout)
{
    if (x->dtype != RF_F32 || x->rank != 4) /* the layout pass gives calls no others */
        return rfi_error(RF_E_INTERNAL, "cpu: %%%d (%s, rank %d) is laid out around a call",
                         (int)x->id, rf_dtype_name(x->dtype), x->rank);
    dnnl_memory_desc_t from, to;
    dnnl_dims_t dims = {x->dims[0], x->dims[1], x->dims[2], x->dims[3]};
    dnnl_status_t st = rfi_dnnl.memory_desc_init_by_tag(
        &from, 4, dims, dnnl_f32, rfi_dnnl_layout_tag(from_layout, false));
    if (st == dnnl_success)
        st = rfi_dnnl.memory_desc_init_by_tag(&to, 4, dims, dnnl_f32,
                                              rfi_dnnl_layout_tag(to_layout, false));
    if (st == dnnl_success)
        st = rfi_dnnl_copy_make(&r->copy, &from, &to, s->engine);
    r->bytes = rfi_node_nbytes(x);
    return st == dnnl_success ? RF_OK : rfi_dnnl_error(st, "layout copy", "reorder");
}

dnnl_status_t rfi_dnnl_copy_make(rfi_dnnl_copy *c, const dnnl_memory_desc_t *from,
                                 const dnnl_memory_desc_t *to, dnnl_engine_t eng)
{
    dnnl_status_t st = rfi_dnnl.memory_create(&c->from, from, eng, DNNL_MEMORY_NONE);
    if (st == dnnl_success)
        st = rfi_dnnl.memory_create(&c->to, to, eng, DNNL_MEMORY_NONE);
    if (st == dnnl_success)
        st = rfi_dnnl_reorder_create(from, to, eng, &c->prim);
    return st;
}

rf_status rfi_dnnl_copy_run(const rfi_dnnl_copy *c, dnnl_stream_t s, const void *from, void *to,
                            const char *what)
{
    dnnl_status_t st = rfi_dnnl.memory_set_data_handle(c->from, (void *)from);
    if (st == dnnl_success)
        st = rfi_dnnl.memory_set_data_handle(c->to, to);
    dnnl_exec_arg_t args[2] = {{DNNL_ARG_FROM, c->from}, {DNNL_ARG_TO, c->to}};
    if (st == dnnl_success)
        st = rfi_dnnl.primitive_execute(c->prim, s, 2, args);
    if (st == dnnl_success)
        st = rfi_dnnl.stream_wait(s);
    return st == dnnl_success ? RF_OK : rfi_dnnl_error(st, what, "execute");
}

void rfi_dnnl_copy_free(rfi_dnnl_copy *c)
{
    if (c->prim)
        rfi_dnnl.primitive_destroy(c->prim);
    if (c->from)
        rfi_dnnl.memory_destroy(c->from);
    if (c->to)
        rfi_dnnl.memory_destroy(c->to);
    memset(c, 0, sizeof *c);
}

static void free_relayout(relayout *r)
{
    rfi_dnnl_copy_free(&r->copy);
    memset(r, 0, sizeof *r);
}

static rf_status run_relayout(dnnl_stream_t stream, relayout *r, const void *from, void *to)
{
    return rfi_dnnl_copy_run(&r->copy, stream, from, to, "layout copy");
}

static rfi_layout layout_of(const rfi_plan *p, const rfi_node *x)
{
    return rfi_plan_layout(p, x->id);
}

/* x's buffer is not row-major (plan.h). */
static bool laid_out(const rfi_plan *p, const rfi_node *x)
{
    return layout_of(p, x) != RFI_LAYOUT_PLAIN;
}

/* Which laid-out values of step k its implementation takes as they are; the
 * others get a relayout (workspace placed later: reserve_relayouts). */
static rf_status take_layouts(rfi_cpu_services *s, int k)
{
    const rfi_plan *p = s->plan;
    call_state *cs = &s->steps[k];
    const rfi_node *root = p->g->nodes[p->steps[k].roots[0]];
    bool any = laid_out(p, root);
    for (int j = 0; j < cs->n_in; j++)
        any |= laid_out(p, cs->value[j]);
    for (int e = 0; e < cs->n_epi; e++)
        any |= cs->epi[e].operand >= 0 && laid_out(p, p->g->nodes[cs->epi[e].operand]);
    if (!any)
        return RF_OK;
    if (!s->have_library)
        return rfi_error(RF_E_INTERNAL, "cpu: call step %d reads or writes a value not in "
                         "row-major order, and oneDNN (which reorders it) is not loaded", k);
    bool in_taken[2] = {false, false}, out_taken = false;
    if (cs->kind == RFI_CALL_CONV) {
        for (int j = 0; j < 2; j++)
            in_taken[j] = laid_out(p, cs->value[j]) && rfi_cpu_conv_laid_out(cs->conv, j);
        out_taken = laid_out(p, root) && rfi_cpu_conv_laid_out(cs->conv, 2);
    } else if (cs->native && cs->n_in == 2) {
        rfi_layout lay[3] = {layout_of(p, cs->value[0]), layout_of(p, cs->value[1]),
                             layout_of(p, root)};
        in_taken[0] = in_taken[1] = out_taken = rfi_cpu_native_take_layouts(cs->native, lay);
    }
    rf_status st = RF_OK;
    for (int j = 0; j < cs->n_in && st == RF_OK; j++)
        if (laid_out(p, cs->value[j]) && !(j < 2 && in_taken[j]))
            st = make_relayout(s, &cs->in_plain[j], cs->value[j], layout_of(p, cs->value[j]),
                               RFI_LAYOUT_PLAIN);
    /* Epilogue operands: the library's post-ops read them row-major; the ops
     * the services apply after the call read them in the layout the result
     * is written in (the root's if the call takes it, else row-major). */
    rfi_layout written = out_taken ? layout_of(p, root) : RFI_LAYOUT_PLAIN;
    for (int e = 0; e < cs->n_epi && st == RF_OK; e++) {
        const rfi_node *v = cs->epi[e].operand >= 0 ? p->g->nodes[cs->epi[e].operand] : NULL;
        rfi_layout want = e < cs->epi_applied ? RFI_LAYOUT_PLAIN : written;
        if (v && cs->epi[e].kind == RFI_EPI_ADD && layout_of(p, v) != want)
            st = make_relayout(s, &cs->epi_plain[e], v, layout_of(p, v), want);
    }
    if (st == RF_OK && laid_out(p, root) && !out_taken)
        st = make_relayout(s, &cs->out_plain, root, RFI_LAYOUT_PLAIN, layout_of(p, root));
    return st;
}

/* Workspace for step k's plain copies, after everything else it uses. */
static void reserve_relayout(relayout *r, size_t *workspace)
{
    if (!r->copy.prim)
        return;
    *workspace = rfi_ws_align(*workspace);
    r->at = *workspace;
    *workspace += r->bytes;
}

static void reserve_relayouts(call_state *cs, size_t *workspace)
{
    for (int j = 0; cs->in_plain && j < cs->n_in; j++)
        reserve_relayout(&cs->in_plain[j], workspace);
    for (int e = 0; e < cs->n_epi; e++)
        reserve_relayout(&cs->epi_plain[e], workspace);
    reserve_relayout(&cs->out_plain, workspace);
}

/* Whether a step is a call these services make (not one the module computes
 * itself: a direct one). */
static bool prepared_here(const rfi_step *step)
{
    return step->kind == RFI_STEP_CALL && !step->direct;
}

/* Prepares the library path of call step k, its locations recorded
 * (prepare_locations), or settles on the reference kernel. Touches only step
 * k's state and the library, so steps can be made on several threads. */
static rf_status prepare_library(rfi_cpu_services *s, int k, size_t *workspace)
{
    const rfi_step *step = &s->plan->steps[k];
    call_state *cs = &s->steps[k];
    *workspace = 0;
    rf_status st = RF_OK;
    const rfi_node *n = cs->node;
    if (is_leaf(n))
        return rfi_error(RF_E_INTERNAL, "cpu: call step %d computes %s node %%%d", k,
                         rfi_op_table[n->op].name, (int)n->id);
    cs->kind = RFI_CALL_FALLBACK;
    if ((step->call == RFI_CALL_MATMUL || step->call == RFI_CALL_CONV) && !s->have_library)
        return take_layouts(s, k); /* no oneDNN: the reference kernel */
    cs->lib_threads = s->threads;
    if (step->call == RFI_CALL_MATMUL && n->op == RFI_OP_DOT_GENERAL) {
        cs->lib_threads = cs->paired ? 1 : matmul_threads(s, n);
        set_library_threads(s, cs->lib_threads);
        st = rfi_cpu_matmul_prepare(n, cs->epi, cs->n_epi, s->engine, &cs->matmul, workspace);
        set_library_threads(s, s->threads);
        if (st == RF_OK)
            cs->kind = RFI_CALL_MATMUL;
        cs->epi_applied = st == RF_OK ? rfi_cpu_matmul_epilogue_ops(cs->matmul) : 0;
    } else if (step->call == RFI_CALL_CONV && n->op == RFI_OP_CONVOLUTION) {
        const rfi_plan *p = s->plan;
        rfi_layout layouts[3] = {layout_of(p, cs->value[0]), layout_of(p, cs->value[1]),
                                 layout_of(p, p->g->nodes[p->steps[k].roots[0]])};
        /* one of a pair runs on one thread: made for one (oneDNN fixes its
         * split then; a 2-thread kernel on one ran about as slowly as both) */
        cs->lib_threads = cs->paired ? 1 : s->threads;
        set_library_threads(s, cs->lib_threads);
        st = rfi_cpu_conv_prepare(n, cs->epi, cs->n_epi, cs->view, layouts, s->engine,
                                  &cs->conv, workspace);
        set_library_threads(s, s->threads);
        if (st == RF_OK)
            cs->kind = RFI_CALL_CONV;
        cs->epi_applied = st == RF_OK ? rfi_cpu_conv_epilogue_ops(cs->conv) : 0;
        if (st == RF_OK && rfi_cpu_conv_takes_views(cs->conv))
            cs->view[0] = cs->view[1] = false;
    } else if (cs->n_epi > 0) {
        return rfi_error(RF_E_INTERNAL, "cpu: call step %d has an epilogue on a %s node", k,
                         rfi_op_table[n->op].name);
    } else if (step->call == RFI_CALL_FALLBACK) {
        st = rfi_cpu_native_prepare(n, &cs->native, workspace);
    } else {
        return rfi_error(RF_E_INTERNAL, "cpu: call step %d asks for call kind %d on a %s node",
                         k, (int)step->call, rfi_op_table[n->op].name);
    }
    if (st == RF_E_UNSUPPORTED)
        st = RF_OK;
    return st == RF_OK ? take_layouts(s, k) : st;
}

/* The library part of call step k with its workspace copies reserved after
 * its own need. Where an allocation failed on the way, the step is out of
 * memory even if another path was taken instead (a convolution's paths are
 * tried in turn, and any failure reads as "not taken"): such an executable
 * would be slower, and round differently from the one made with memory
 * (test_oom's convolutions found it). */
static rf_status prepare_library_call(rfi_cpu_services *s, int k, size_t *need)
{
    *need = 0;
    uint64_t failures = rfi_alloc_failures_here(); /* this thread's: the step is made here */
    rf_status st = prepare_library(s, k, need);
    if (st == RF_OK && rfi_alloc_failures_here() != failures)
        st = rfi_error(RF_E_NOMEM, "cpu: out of memory preparing call step %d", k);
    reserve_view_copies(&s->steps[k], need);
    reserve_relayouts(&s->steps[k], need);
    return st;
}

/* ---- Making the calls on two threads ---------------------------------------------------
 * Creating oneDNN's primitives (generating their kernels) is most of a warm
 * compile: 4.0 of 7.5 ms for the ResNet's step. oneDNN creates primitives
 * on any thread, so the calls' library parts are made on the caller, from
 * the first step on, and one helper thread, from the last step back (a
 * step's twin, a later convolution of the same shapes, then comes from
 * oneDNN's primitive cache instead of being made on both threads at once).
 * The helper is a thread of its own, started off the caller's CPU
 * (rfi_thread_start_apart), not one of OpenMP's team: oneDNN fixes a
 * primitive's split over threads from the creating thread's OpenMP setting,
 * which a region's member would see as one thread. Every step is made even
 * after one fails, and the failure reported is the first failing step's,
 * whichever thread made it. Warm compiles of the ResNet's training step
 * (bench/rf_bench compile_resnet_warm, 2 cores, 20 interleaved pairs):
 * 7.9 -> 6.95 ms median, faster in all 20. Measured earlier without the
 * start off the caller's CPU, the helper began 2.4 ms late and gained 0.3. */
typedef struct library_job {
    rfi_cpu_services *s;
    const int *steps; /* the call steps, in step order */
    size_t *need;
    _Atomic uint64_t span; /* indices not taken yet (rfi_span_take) */
} library_job;

typedef struct library_worker {
    library_job *job;
    bool from_front;
    int failed_at; /* the lowest index into job->steps this thread failed at, or -1 */
    rf_status status;
    char message[RFI_ERRMSG_MAX];
} library_worker;

static void *make_libraries(void *arg)
{
    library_worker *w = arg;
    library_job *job = w->job;
    for (int i; (i = (int)rfi_span_take(&job->span, w->from_front)) >= 0;) {
        int k = job->steps[i];
        rf_status st = prepare_library_call(job->s, k, &job->need[k]);
        if (st != RF_OK && (w->failed_at < 0 || i < w->failed_at)) {
            w->failed_at = i;
            w->status = st;
            snprintf(w->message, sizeof w->message, "%s", rf_errmsg());
        }
    }
    return NULL;
}

/* Lists with fewer convolutions than this are made on the caller alone. A
 * helper's start and its first primitive cost 0.3-0.6 ms, and two threads
 * making primitives at once each took 1.2-1.8x as long as one alone (on 2
 * cores): a product's primitive, 0.1-0.2 ms, did not pay for it (the mlp's
 * eight products 1.19 -> 1.29 ms, an RNN's 129 1.22 ms either way), and the
 * cnn's three convolutions and three products gained within noise (1.99 ->
 * 1.91 ms, faster in 6 of 10 alternating runs); the ResNet's 20 did. */
#define BESIDE_MIN_CONVS 4

static int convolutions_in(const rfi_cpu_services *s, const int *steps, int n)
{
    int convs = 0;
    for (int i = 0; i < n; i++)
        convs += s->plan->steps[steps[i]].call == RFI_CALL_CONV;
    return convs;
}

static atomic_llong helpers_started; /* a counter for tests */

int64_t rfi_cpu_services_helpers_started(void) { return atomic_load(&helpers_started); }

/* The library parts of the call steps listed (their locations recorded), on
 * the caller and, where there are enough of them, a helper thread. */
static rf_status prepare_libraries(rfi_cpu_services *s, const int *steps, int n, size_t *need)
{
    library_job job = {.s = s, .steps = steps, .need = need};
    atomic_init(&job.span, (uint64_t)n);
    library_worker w[2] = {{&job, true, -1, RF_OK, ""}, {&job, false, -1, RF_OK, ""}};
    pthread_t helper;
    bool beside = s->threads > 1 && s->have_library &&
                  convolutions_in(s, steps, n) >= BESIDE_MIN_CONVS &&
                  rfi_thread_start_apart(&helper, make_libraries, &w[1]) == 0;
    if (beside)
        atomic_fetch_add(&helpers_started, 1);
    make_libraries(&w[0]);
    if (beside)
        pthread_join(helper, NULL);
    const library_worker *first = NULL;
    for (int t = 0; t < 2; t++)
        if (w[t].failed_at >= 0 && (!first || w[t].failed_at < first->failed_at))
            first = &w[t];
    return first ? rfi_error(first->status, "%s", first->message) : RF_OK;
}

/* Every call step: the locations one after the other (they take arena
 * memory), then the library parts. steps: room for n_steps indices. */
static rf_status prepare_calls(rfi_cpu_services *s, int *steps, size_t *need)
{
    int n = 0;
    rf_status st = RF_OK;
    for (int k = 0; k < s->n_steps && st == RF_OK; k++)
        if (prepared_here(&s->plan->steps[k])) {
            steps[n++] = k;
            st = prepare_locations(s, k);
        }
    return st == RF_OK ? prepare_libraries(s, steps, n, need) : st;
}

/* Frees what preparing call step k made (its arena arrays stay). */
static void release_step(call_state *cs)
{
    rfi_cpu_matmul_free(cs->matmul);
    rfi_cpu_conv_free(cs->conv);
    rfi_cpu_native_free(cs->native);
    for (int j = 0; cs->in_plain && j < cs->n_in; j++)
        free_relayout(&cs->in_plain[j]);
    for (int e = 0; e < RFI_EPI_MAX; e++)
        free_relayout(&cs->epi_plain[e]);
    free_relayout(&cs->out_plain);
}

/* Whether call cs gains from running beside another on one thread each:
 * oneDNN's matmuls and Winograd convolutions, whose second thread adds
 * little; not its direct convolutions, which split well over threads, nor
 * winograd.c's, whose transforms stream their tiles through memory: the
 * cnn's second layer's pair side by side made its step 6.6-6.7 ms against
 * 5.4-5.5 one after the other, each on both threads (an early winograd.c). */
static bool runs_well_beside(const call_state *cs)
{
    return cs->kind == RFI_CALL_MATMUL ||
           (cs->kind == RFI_CALL_CONV && rfi_cpu_conv_is_winograd(cs->conv));
}

/* A pair (plan.h runs_with_next) of matmuls or Winograd convolutions (a
 * layer's input and weight gradients) runs beside each other, each on one
 * thread, made again for one thread (oneDNN fixes its split over threads
 * when it makes a primitive; a 2-thread primitive run on one gained 5%, not
 * 20%). Measured on two cores, one after the other on both threads against
 * side by side (medians of 200 in a standalone program): the cnn's second
 * layer's Winograd gradients 3.4-3.9 against 2.7-3.0 ms, its dense layer's
 * gradients 309-348 against 276-306 us, the mlp's second layer's 421-509
 * against 394-447 us. The ResNet's direct convolutions took 4-14% longer
 * side by side: other pairs run one after the other (a matmul made for one
 * thread then stays so). The second's part of the workspace follows the
 * first's (need: per step). The calls made again are made together
 * (prepare_libraries); remake: room for n_steps indices. */
static rf_status pair_all_beside(rfi_cpu_services *s, int *remake, size_t *need)
{
    int n = 0;
    rf_status st = RF_OK;
    for (int k = 0; k < s->n_steps && st == RF_OK; k++) {
        int pair[2] = {k, s->steps[k].partner};
        if (pair[1] < 0)
            continue;
        bool both = true, made = s->steps[k].paired; /* made: for one thread already */
        for (int i = 0; i < 2; i++)
            both = both && s->threads > 1 && runs_well_beside(&s->steps[pair[i]]);
        s->steps[pair[0]].paired = s->steps[pair[1]].paired = both;
        for (int i = 0; i < 2 && both && !made && st == RF_OK; i++) {
            call_state *cs = &s->steps[pair[i]];
            int partner = cs->partner;
            release_step(cs);
            memset(cs, 0, sizeof *cs);
            cs->partner = partner;
            cs->paired = true;
            remake[n++] = pair[i];
            st = prepare_locations(s, pair[i]);
        }
    }
    if (st == RF_OK)
        st = prepare_libraries(s, remake, n, need);
    for (int k = 0; k < s->n_steps && st == RF_OK; k++)
        if (s->steps[k].partner >= 0 && s->steps[k].paired)
            s->steps[s->steps[k].partner].ws_at = rfi_ws_align(need[k]);
    return st;
}

/* Loads oneDNN and makes the engine and stream; without the library (the
 * loader's error stays set for whoever wants to know why) steps fall back. */
static rf_status create_library(rfi_cpu_services *s)
{
    if (rfi_dnnl_load() != RF_OK)
        return RF_OK;
    s->have_library = true;
    dnnl_status_t st = rfi_dnnl.engine_create(&s->engine, dnnl_cpu, 0);
    if (st != dnnl_success)
        return rfi_dnnl_error(st, "services", "engine_create");
    st = rfi_dnnl.stream_create(&s->stream, s->engine, dnnl_stream_default_flags);
    if (st != dnnl_success)
        return rfi_dnnl_error(st, "services", "stream_create");
    return RF_OK;
}

/* The pairs of calls the module makes as one (plan.h runs_with_next): the
 * second runs when the first is called, after it, or beside it (paired, see
 * pair_all_beside). Two matmuls are paired before they are prepared, so their
 * primitives are made once, for one thread. */
static void pair_steps(rfi_cpu_services *s)
{
    const rfi_step *steps = s->plan->steps;
    for (int k = 0; k < s->n_steps; k++) {
        bool with_next = steps[k].runs_with_next && k + 1 < s->n_steps;
        s->steps[k].partner = with_next ? k + 1 : -1;
        bool matmuls = with_next && steps[k].call == RFI_CALL_MATMUL &&
                       steps[k + 1].call == RFI_CALL_MATMUL;
        if (matmuls && s->threads > 1 && s->have_library)
            s->steps[k].paired = s->steps[k + 1].paired = true;
    }
}

/* One convolution input that is reordered from the IR's buffer. */
typedef struct conv_copy {
    int step, k;
    const rfi_node *value; /* the node whose buffer the reorder reads */
    const dnnl_memory_desc_t *user, *inner;
    size_t bytes;
    bool grouped;
} conv_copy;

/* Lists the reordered inputs of the prepared convolutions in step order;
 * returns how many (at most 2 per step). */
static int list_conv_copies(rfi_cpu_services *s, conv_copy *list)
{
    int n = 0;
    for (int k = 0; k < s->n_steps; k++) {
        call_state *cs = &s->steps[k];
        for (int j = 0; cs->kind == RFI_CALL_CONV && !cs->paired && j < 2; j++) {
            conv_copy c = {k, j, cs->node->in[j], NULL, NULL, 0, false};
            /* a view the call does not take is a transposed copy, not the value */
            if (cs->view[j] || !rfi_cpu_conv_input_copy(cs->conv, j, &c.user, &c.inner, &c.bytes))
                continue;
            if (c.value->op == RFI_OP_TRANSPOSE &&
                s->plan->loc[c.value->id].kind == RFI_LOC_INLINE)
                c.value = c.value->in[0]; /* a view the call takes: its buffer's node */
            list[n++] = c;
        }
    }
    return n;
}

/* Calls at most this many plan steps after the one that fills a copy share
 * it. Further apart, the copy has left the caches by the time it is read
 * again: sharing an activation's copy between its forward convolution and
 * its weight gradient made the ResNet's convolution calls slower than
 * reordering it again (hot) and cost 7 MB more memory. */
#define SHARE_MAX_STEPS 2

static bool same_copy(const conv_copy *a, const conv_copy *b)
{
    return a->value == b->value && b->step - a->step <= SHARE_MAX_STEPS &&
           rfi_dnnl.memory_desc_equal(a->user, b->user) &&
           rfi_dnnl.memory_desc_equal(a->inner, b->inner);
}

/* A block of memory the groups of copies take in turn: free for a group
 * that starts after step free_after. */
typedef struct copy_slot {
    void *block, *at; /* allocation; at is it aligned to 64 */
    size_t bytes;
    int free_after;
} copy_slot;

/* A slot of at least `bytes` that is free at step `first`, else a new one;
 * NULL when out of memory. */
static copy_slot *take_slot(rfi_cpu_services *s, copy_slot *slots, size_t bytes, int first)
{
    for (int i = 0; i < s->n_shared; i++)
        if (slots[i].free_after < first && slots[i].bytes >= bytes)
            return &slots[i];
    void *block = rfi_malloc(bytes + 64);
    if (!block)
        return NULL;
    copy_slot *slot = &slots[s->n_shared];
    s->shared[s->n_shared++] = block;
    s->shared_bytes += bytes;
    slot->block = block;
    slot->at = (void *)(((uintptr_t)block + 63) & ~(uintptr_t)63);
    slot->bytes = bytes;
    return slot;
}

/* Groups the reordered inputs that read one value into one layout within
 * SHARE_MAX_STEPS steps (the cotangent that an input gradient and a weight
 * gradient, computed one after the other, both read); each group of two or
 * more gets a copy that its first call fills and the others read. The value
 * is an IR node, so its buffer holds it unchanged from the first call to the
 * last (the plan frees no buffer before its last reader). Groups whose calls
 * do not overlap in time take turns in one block. */
static rf_status share_conv_inputs(rfi_cpu_services *s)
{
    const char *env = getenv("RF_CONV_SHARE");
    if ((env && *env == '0') || !s->have_library)
        return RF_OK;
    size_t cap = (size_t)s->n_steps * 2 + 1;
    conv_copy *list = rfi_calloc(cap, sizeof *list);
    copy_slot *slots = rfi_calloc(cap, sizeof *slots);
    s->shared = rfi_calloc(cap, sizeof *s->shared);
    rf_status st = RF_OK;
    if (!list || !slots || !s->shared)
        st = rfi_error(RF_E_NOMEM, "cpu: out of memory sharing convolution inputs");
    int n = st == RF_OK ? list_conv_copies(s, list) : 0;
    for (int i = 0; i < n && st == RF_OK; i++) {
        if (list[i].grouped)
            continue;
        int last = -1;
        for (int j = i + 1; j < n; j++)
            if (!list[j].grouped && same_copy(&list[i], &list[j]))
                last = list[j].step;
        if (last < 0)
            continue;
        copy_slot *slot = take_slot(s, slots, list[i].bytes, list[i].step);
        if (!slot) {
            st = rfi_error(RF_E_NOMEM, "cpu: out of memory for a %zu-byte convolution input",
                           list[i].bytes);
            break;
        }
        slot->free_after = last;
        rfi_cpu_conv_share_input(s->steps[list[i].step].conv, list[i].k, slot->at, true);
        for (int j = i + 1; j < n; j++)
            if (!list[j].grouped && same_copy(&list[i], &list[j])) {
                list[j].grouped = true;
                rfi_cpu_conv_share_input(s->steps[list[j].step].conv, list[j].k, slot->at,
                                         false);
            }
    }
    rfi_free(list);
    rfi_free(slots);
    return st;
}

/* Roughly how many points step k computes: the multiply-adds of a product,
 * the elements a reduction reads, else its roots' elements. */
static int64_t step_points(const rfi_plan *p, int k)
{
    const rfi_step *step = &p->steps[k];
    int64_t most = 0;
    for (int r = 0; r < step->n_roots; r++) {
        int64_t points = rfi_node_numel(p->g->nodes[step->roots[r]]);
        most = points > most ? points : most;
    }
    if (step->core >= 0) {
        const rfi_node *core = p->g->nodes[step->core];
        int64_t points = core->op == RFI_OP_DOT_GENERAL ? rfi_dot_macs(core)
                         : core->n_in > 0               ? rfi_node_numel(core->in[0])
                                                        : 0;
        most = points > most ? points : most;
    }
    return most;
}

/* Whether step k runs on several threads: a library call made for them, a
 * pair side by side, or a generated loop large enough that the module splits
 * it (render_c.c's rule, without the cost of its points: a loop of heavy
 * math it splits sooner may be missed, which costs one wake-up). */
static bool step_uses_team(const rfi_cpu_services *s, int k)
{
    const call_state *cs = &s->steps[k];
    const rfi_step *step = &s->plan->steps[k];
    if (s->threads <= 1 || step->left_out || step->kind == RFI_STEP_COPY)
        return false;
    if (cs->kind == RFI_CALL_MATMUL || cs->kind == RFI_CALL_CONV)
        return cs->paired || cs->lib_threads > 1;
    return step_points(s->plan, k) > RFI_PARALLEL_MIN;
}

/* Marks the calls that run alone with work for the team after them in the
 * same run (call_state.warm_team). */
static void mark_warm_team(rfi_cpu_services *s)
{
    bool team_later = false;
    for (int k = s->n_steps - 1; k >= 0; k--) {
        call_state *cs = &s->steps[k];
        bool team_here = step_uses_team(s, k);
        cs->warm_team = cs->kind != RFI_CALL_NONE && !team_here && team_later;
        team_later = team_later || team_here;
    }
}

rf_status rfi_cpu_services_prepare(const rfi_plan *p, rfi_cpu_services **out)
{
    *out = NULL;
    rfi_cpu_services *s = rfi_calloc(1, sizeof *s);
    if (!s)
        return rfi_error(RF_E_NOMEM, "cpu: out of memory preparing services");
    s->plan = p;
    s->n_steps = p->n_steps;
    s->threads = rfi_threadpool_size();
    s->fork_generation = rfi_threadpool_fork_generation();
    const char *alternate = getenv("RF_ALTERNATE_ORDER");
    s->alternate = !(alternate && strcmp(alternate, "0") == 0);
    s->steps = rfi_arena_alloc(&s->mem, ((size_t)p->n_steps + 1) * sizeof *s->steps);
    rf_status st = s->steps ? create_library(s)
                            : rfi_error(RF_E_NOMEM, "cpu: out of memory preparing services");
    set_library_threads(s, s->threads);
    size_t *need = rfi_calloc((size_t)p->n_steps + 1, sizeof *need);
    int *list = rfi_malloc(((size_t)p->n_steps + 1) * sizeof *list); /* steps to make */
    if (st == RF_OK && (!need || !list))
        st = rfi_error(RF_E_NOMEM, "cpu: out of memory preparing services");
    if (st == RF_OK)
        pair_steps(s);
    if (st == RF_OK)
        st = prepare_calls(s, list, need);
    if (st == RF_OK)
        st = pair_all_beside(s, list, need);
    rfi_free(list);
    for (int k = 0; k < p->n_steps && st == RF_OK && !s->stream2; k++)
        if (s->steps[k].paired && rfi_dnnl.stream_create(&s->stream2, s->engine,
                                                         dnnl_stream_default_flags) != dnnl_success)
            st = rfi_error(RF_E_INTERNAL, "cpu: services: oneDNN stream_create failed");
    size_t most = 0;
    for (int k = 0; st == RF_OK && k < p->n_steps; k++)
        most = s->steps[k].ws_at + need[k] > most ? s->steps[k].ws_at + need[k] : most;
    rfi_free(need);
    if (st == RF_OK)
        st = share_conv_inputs(s);
    if (st == RF_OK)
        mark_warm_team(s);
    if (st == RF_OK && most > 0) {
        s->workspace_block = rfi_malloc(most + 64);
        if (!s->workspace_block)
            st = rfi_error(RF_E_NOMEM, "cpu: out of memory for a %zu-byte call workspace", most);
        else
            s->workspace = (void *)(((uintptr_t)s->workspace_block + 63) & ~(uintptr_t)63);
        s->workspace_bytes = most;
    }
    if (st != RF_OK) {
        rfi_cpu_services_free(s);
        return st;
    }
    *out = s;
    return RF_OK;
}

/* NULL for an empty value whose buffer is NULL (an empty argument or
 * output): an offset, even 0, from a null pointer is undefined in C (the
 * op fuzzer's clang build found one). */
static void *buffer_at(void *const *buffers, value_ref r)
{
    char *base = buffers[r.buffer];
    return base ? base + r.offset : NULL;
}

/* ---- Epilogues applied here ----------------------------------------------------------- */

typedef struct epilogue_job {
    const call_state *cs;
    void *out;
    int64_t len[RFI_EPI_MAX]; /* BIAS: the vector's length */
} epilogue_job;

static double load_as_double(const void *p, rf_dtype dt, int64_t i)
{
    return dt == RF_F32 ? (double)((const float *)p)[i] : ((const double *)p)[i];
}

/* Op e on value v of element i, in double (the interpreter's formulas). */
static double epilogue_op(const epilogue_job *j, int e, double v, int64_t i, rf_dtype dt)
{
    const call_state *cs = j->cs;
    switch (cs->epi[e].kind) {
    case RFI_EPI_BIAS:
        return v + load_as_double(cs->epi_src[e], dt, (i / cs->epi_inner[e]) % j->len[e]);
    case RFI_EPI_ADD: return v + load_as_double(cs->epi_src[e], dt, i);
    case RFI_EPI_RELU: return rfi_fmax_nan(v, 0.0);
    case RFI_EPI_TANH: return tanh(v);
    case RFI_EPI_LOGISTIC: {
        if (v >= 0)
            return 1.0 / (1.0 + exp(-v));
        double e2 = exp(v);
        return e2 / (1.0 + e2);
    }
    default: return v;
    }
}

/* f32: op by op over blocks of out[lo, hi) (a float add of two floats is the
 * interpreter's double add rounded once, so adds and relu stay in float and
 * vectorise; tanh and logistic go through double). */
#define EPILOGUE_BLOCK 4096

static void bias_f32(float *restrict out, const float *restrict b, int64_t lo, int64_t hi,
                     int64_t inner, int64_t len)
{
    if (inner == 1) {
        int64_t c = lo % len;
        for (int64_t i = lo; i < hi; i++) {
            out[i] += b[c];
            c = c + 1 == len ? 0 : c + 1;
        }
        return;
    }
    for (int64_t i = lo; i < hi;) {
        int64_t end = (i / inner + 1) * inner;
        end = end < hi ? end : hi;
        float v = b[(i / inner) % len];
        for (int64_t k = i; k < end; k++)
            out[k] += v;
        i = end;
    }
}

/* Compiled for x86-64-v4 (AVX-512), x86-64-v3 (AVX2) and the baseline, chosen once at load
 * time (as pool.c's and winograd.c's jobs): at the baseline's SSE width, the relu oneDNN
 * does not apply after the cnn's Winograd convolution (2 MB) took ~150 us of its step,
 * ~40 at AVX-512 (the cnn step 3.88 -> 3.78 ms, medians of three alternating runs). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define EPILOGUE_JOB __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define EPILOGUE_JOB
#endif

EPILOGUE_JOB
static void epilogue_block_f32(const epilogue_job *j, float *restrict out, int64_t lo, int64_t hi)
{
    const call_state *cs = j->cs;
    for (int e = cs->epi_applied; e < cs->n_epi; e++) {
        const float *src = cs->epi_src[e];
        switch (cs->epi[e].kind) {
        case RFI_EPI_BIAS: bias_f32(out, src, lo, hi, cs->epi_inner[e], j->len[e]); break;
        case RFI_EPI_ADD:
            for (int64_t i = lo; i < hi; i++)
                out[i] += src[i];
            break;
        case RFI_EPI_RELU:
            for (int64_t i = lo; i < hi; i++)
                out[i] = out[i] != out[i] ? NAN : out[i] > 0.0f ? out[i] : 0.0f;
            break;
        default:
            for (int64_t i = lo; i < hi; i++)
                out[i] = (float)epilogue_op(j, e, (double)out[i], i, RF_F32);
            break;
        }
    }
}

static void epilogue_range(void *ctx, int64_t lo, int64_t hi)
{
    const epilogue_job *j = ctx;
    rf_dtype dt = j->cs->node->dtype;
    if (dt == RF_F32) {
        for (int64_t b = lo; b < hi; b += EPILOGUE_BLOCK)
            epilogue_block_f32(j, j->out, b, hi - b < EPILOGUE_BLOCK ? hi : b + EPILOGUE_BLOCK);
        return;
    }
    for (int64_t i = lo; i < hi; i++) {
        double v = load_as_double(j->out, dt, i);
        for (int e = j->cs->epi_applied; e < j->cs->n_epi; e++) {
            v = epilogue_op(j, e, v, i, dt);
            if (dt == RF_F32)
                v = (double)(float)v; /* each op rounds once, as the interpreter's */
        }
        if (dt == RF_F32)
            ((float *)j->out)[i] = (float)v;
        else
            ((double *)j->out)[i] = v;
    }
}

/* Applies the epilogue to the core's result in out (f32 / f64 only). */
static rf_status apply_epilogue(const call_state *cs, void *out)
{
    rf_dtype dt = cs->node->dtype;
    if (dt != RF_F32 && dt != RF_F64)
        return rfi_error(RF_E_INTERNAL, "cpu: epilogue on a %s %s", rf_dtype_name(dt),
                         rfi_op_table[cs->node->op].name);
    epilogue_job job = {cs, out, {0}};
    for (int e = 0; e < cs->n_epi; e++)
        if (cs->epi[e].kind == RFI_EPI_BIAS)
            job.len[e] = rfi_node_numel(cs->node) > 0 ? cs->node->dims[cs->epi[e].axis] : 1;
    rfi_parallel_for(rfi_node_numel(cs->node), 16384, epilogue_range, &job);
    return RF_OK;
}

/* Runs call step `step` with its part of the workspace, ws, on `stream`. */
static rf_status run_call(const rfi_cpu_services *s, int step, void *const *buffers,
                          dnnl_stream_t stream)
{
    call_state *cs = &s->steps[step];
    char *ws = s->workspace ? (char *)s->workspace + cs->ws_at : NULL; /* NULL: none needed */
    rf_status st = RF_OK;
    for (int j = 0; j < cs->n_in; j++)
        cs->operands[j] = buffer_at(buffers, cs->in[j]);
    for (int j = 0; j < cs->n_in && st == RF_OK; j++) {
        relayout *r = &cs->in_plain[j];
        if (!r->copy.prim)
            continue;
        void *copy = ws + r->at;
        st = run_relayout(stream, r, cs->operands[j], copy);
        cs->operands[j] = copy;
    }
    for (int j = 0; j < 2; j++) {
        if (!cs->view[j])
            continue;
        void *copy = ws + cs->view_at[j];
        copy_view(cs->node->in[j], cs->operands[j], copy);
        cs->operands[j] = copy;
    }
    for (int e = 0; e < cs->n_epi; e++) {
        cs->epi_src[e] = cs->epi_in[e].buffer >= 0 ? buffer_at(buffers, cs->epi_in[e]) : NULL;
        relayout *r = &cs->epi_plain[e];
        if (r->copy.prim && st == RF_OK) {
            void *copy = ws + r->at;
            st = run_relayout(stream, r, cs->epi_src[e], copy);
            cs->epi_src[e] = copy;
        }
    }
    void *result = buffer_at(buffers, cs->out);
    void *out = cs->out_plain.copy.prim ? ws + cs->out_plain.at : result;
    if (st != RF_OK)
        return st;
    switch (cs->kind) {
    case RFI_CALL_MATMUL:
        set_library_threads(s, cs->lib_threads);
        st = rfi_cpu_matmul_run(cs->matmul, stream, cs->operands[0], cs->operands[1], out,
                                cs->epi_src, ws);
        break;
    case RFI_CALL_CONV:
        set_library_threads(s, cs->lib_threads);
        st = rfi_cpu_conv_run(cs->conv, stream, cs->operands[0], cs->operands[1], out,
                              cs->epi_src, ws);
        break;
    default:
        st = cs->native ? rfi_cpu_native_run(cs->native, cs->operands, out, ws)
                        : rfi_interp_eval_node(cs->node, cs->operands, out);
        break;
    }
    if ((cs->kind == RFI_CALL_MATMUL || cs->kind == RFI_CALL_CONV) && cs->lib_threads > 1)
        rfi_threadpool_team_ran();
    if (st == RF_OK && cs->epi_applied < cs->n_epi)
        st = apply_epilogue(cs, out);
    if (st == RF_OK && cs->out_plain.copy.prim)
        st = run_relayout(stream, &cs->out_plain, out, result);
    return st;
}

/* A pair of calls beside each other, one per chunk of a parallel loop (so
 * each thread's library call runs on that thread alone). */
typedef struct pair_job {
    const rfi_cpu_services *s;
    int steps[2];
    void *const *buffers;
    rf_status st[2];
    char msg[2][256]; /* a failed call's message (it is set on its own thread) */
} pair_job;

static void pair_calls(void *ctx, int64_t lo, int64_t hi)
{
    pair_job *j = ctx;
    for (int64_t i = lo; i < hi; i++) {
        j->st[i] = run_call(j->s, j->steps[i], j->buffers, i ? j->s->stream2 : j->s->stream);
        if (j->st[i] != RF_OK)
            snprintf(j->msg[i], sizeof j->msg[i], "%s", rf_errmsg());
    }
}

/* Step and its partner: beside each other when paired (they share nothing
 * but the buffers they read), else one after the other. */
static rf_status run_pair(const rfi_cpu_services *s, int step, void *const *buffers)
{
    int partner = s->steps[step].partner;
    if (!s->steps[step].paired) {
        rf_status st = run_call(s, step, buffers, s->stream);
        return st == RF_OK ? run_call(s, partner, buffers, s->stream) : st;
    }
    pair_job job = {s, {step, partner}, buffers, {RF_OK, RF_OK}, {"", ""}};
    rfi_parallel_for(2, 1, pair_calls, &job);
    for (int i = 0; i < 2; i++)
        if (job.st[i] != RF_OK)
            return rfi_error(job.st[i], "%s", job.msg[i]);
    return RF_OK;
}

int rfi_cpu_services_call(void *rt, int step, void *const *buffers)
{
    rfi_cpu_services *s = rt;
    if (!s || step < 0 || step >= s->n_steps || s->steps[step].kind == RFI_CALL_NONE) {
        rfi_error(RF_E_INTERNAL, "cpu: call of step %d, which is not a call step", step);
        return 1;
    }
    if (s->have_library && s->fork_generation != rfi_threadpool_fork_generation()) {
        /* its primitives would wait for threads that were not forked */
        s->failure = rfi_error(RF_E_INVALID, "this executable was compiled before the "
                               "process forked, and its library calls cannot run in the child: "
                               "compile it again there (rf_model_cache_clear for cached steps)");
        return 1;
    }
    if (s->steps[step].warm_team)
        rfi_threadpool_keep_team_warm();
    rf_status st = s->steps[step].partner >= 0 ? run_pair(s, step, buffers)
                                              : run_call(s, step, buffers, s->stream);
    if (st != RF_OK)
        s->failure = st;
    return st == RF_OK ? 0 : 1;
}

rf_status rfi_cpu_services_failure(const rfi_cpu_services *s)
{
    return s && s->failure != RF_OK ? s->failure : RF_E_INTERNAL;
}

void rfi_cpu_services_table(rfi_cpu_services *s, rf_module_services *table)
{
    table->abi = RF_MODULE_ABI;
    table->rt = s;
    table->parallel_for = rfi_cpu_services_parallel_for;
    table->call = rfi_cpu_services_call;
    table->mark = NULL; /* set by the backend when profiling */
    table->prof = NULL;
}

rfi_call_kind rfi_cpu_services_step_kind(const rfi_cpu_services *s, int step)
{
    return s && step >= 0 && step < s->n_steps ? s->steps[step].kind : RFI_CALL_NONE;
}

const char *rfi_cpu_services_step_path(const rfi_cpu_services *s, int step)
{
    if (s && step >= 0 && step < s->n_steps && s->plan->steps[step].direct)
        return rfi_conv_bf16(s->plan->g->nodes[s->plan->steps[step].core]) ? "direct bf16"
                                                                            : "direct";
    if (!s || step < 0 || step >= s->n_steps || s->steps[step].kind == RFI_CALL_NONE)
        return "none";
    const call_state *cs = &s->steps[step];
    switch (cs->kind) {
    case RFI_CALL_MATMUL: return cs->matmul ? rfi_cpu_matmul_path(cs->matmul) : "reference";
    case RFI_CALL_CONV: return rfi_cpu_conv_path(cs->conv);
    default: return cs->native ? rfi_cpu_native_path(cs->native) : "reference";
    }
}

int rfi_cpu_services_step_lib_ops(const rfi_cpu_services *s, int step)
{
    return s && step >= 0 && step < s->n_steps ? s->steps[step].epi_applied : 0;
}

bool rfi_cpu_services_step_bias_input(const rfi_cpu_services *s, int step)
{
    if (!s || step < 0 || step >= s->n_steps)
        return false;
    const call_state *cs = &s->steps[step];
    return rfi_cpu_matmul_bias_input(cs->matmul) || rfi_cpu_conv_bias_input(cs->conv);
}

bool rfi_cpu_services_step_warm_team(const rfi_cpu_services *s, int step)
{
    return s && step >= 0 && step < s->n_steps && s->steps[step].warm_team;
}

bool rfi_cpu_services_step_beside(const rfi_cpu_services *s, int step)
{
    return s && step >= 0 && step < s->n_steps && s->steps[step].paired;
}

size_t rfi_cpu_services_workspace(const rfi_cpu_services *s)
{
    return s ? s->workspace_bytes + s->shared_bytes : 0;
}

int rfi_cpu_services_shared_inputs(const rfi_cpu_services *s) { return s ? s->n_shared : 0; }

void rfi_cpu_services_free(rfi_cpu_services *s)
{
    if (!s)
        return;
    for (int k = 0; s->steps && k < s->n_steps; k++)
        release_step(&s->steps[k]);
    for (int k = 0; k < s->n_shared; k++)
        rfi_free(s->shared[k]);
    rfi_free(s->shared);
    if (s->stream)
        rfi_dnnl.stream_destroy(s->stream);
    if (s->stream2)
        rfi_dnnl.stream_destroy(s->stream2);
    if (s->engine)
        rfi_dnnl.engine_destroy(s->engine);
    rfi_free(s->workspace_block);
    rfi_arena_free(&s->mem);
    rfi_free(s);
}
