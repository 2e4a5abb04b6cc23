/* services.c: the runtime services of a compiled CPU module (services.h):
 * per-executable state for every CALL step of a plan, made once at load
 * time, and the `call` / `parallel_for` entries the module calls per step.
 *
 * For each CALL step prepare records where the node's operands and result
 * live (buffer index + byte offset, from the plan) and how it runs:
 *   MATMUL (f32)   oneDNN matmul (dnnl_matmul.c)
 *   CONV (f32)     im2col + oneDNN matmul (conv.c)
 *   FALLBACK       SELECT_AND_SCATTER and ARGMAX/ARGMIN on f32/f64: native
 *                  kernels (pool.c); anything else:
 *                  the reference kernel (rfi_interp_eval_node) writing straight
 *                  into the result buffer: exact (double accumulation), slow,
 *                  and it may allocate its own scratch (contractions pack
 *                  operands); used for FALLBACK steps and for MATMUL / CONV
 *                  steps the library path does not take (f64, integers,
 *                  G > 1 with B > 1, no spatial dims).
 * One oneDNN engine and stream per executable; one workspace (the largest any
 * step needs: oneDNN scratchpads, packed operands, im2col columns) shared by
 * the steps, which run one at a time.
 *
 * Deliberately not here: choosing which nodes become CALL steps (the plan),
 * generated code, blocked memory formats between steps.
 */
#include "services.h"

#include <string.h>

#include "../../runtime/threadpool.h"
#include "../interp/interp.h"

/* Where one value lives: buffers[buffer] + offset. */
typedef struct value_ref {
    int buffer;
    size_t offset;
} value_ref;

typedef struct call_state {
    rfi_call_kind kind; /* how the step runs; NONE: not a CALL step */
    const rfi_node *node;
    int n_in;
    value_ref *in;      /* per operand */
    value_ref out;
    const void **operands; /* scratch for the operand pointers of one call */
    rfi_cpu_matmul *matmul;
    rfi_cpu_conv *conv;
    rfi_cpu_native *native; /* a FALLBACK step with a native kernel (pool.c) */
} call_state;

struct rfi_cpu_services {
    const rfi_plan *plan;
    dnnl_engine_t engine;
    dnnl_stream_t stream;
    call_state *steps; /* plan->n_steps */
    int n_steps;
    void *workspace_block; /* allocation; workspace is it aligned to 64 */
    void *workspace;
    size_t workspace_bytes;
    bool have_library; /* oneDNN loaded: engine and stream exist */
    int threads;
    rfi_arena mem; /* the per-step arrays */
};

void rfi_cpu_services_parallel_for(void *rt, int64_t n, int64_t grain,
                                   void (*body)(void *ctx, int64_t lo, int64_t hi), void *ctx)
{
    (void)rt;
    rfi_parallel_for(n, grain, body, ctx);
}

/* Gives OpenMP (oneDNN's threads) the pool's size on the calling thread: the
 * setting is per thread in libgomp, so it is repeated before each library call. */
static void set_library_threads(const rfi_cpu_services *s)
{
    if (s->have_library && rfi_dnnl.omp_set_num_threads)
        rfi_dnnl.omp_set_num_threads(s->threads);
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
    const rfi_node *n = p->g->nodes[step->roots[0]];
    cs->node = n;
    cs->n_in = n->n_in;
    cs->in = rfi_arena_alloc(&s->mem, ((size_t)n->n_in + 1) * sizeof *cs->in);
    cs->operands = rfi_arena_alloc(&s->mem, ((size_t)n->n_in + 1) * sizeof *cs->operands);
    if (!cs->in || !cs->operands)
        return rfi_error(RF_E_NOMEM, "cpu: out of memory preparing call step %d", k);
    for (int j = 0; j < n->n_in; j++) {
        rf_status st = locate(p, n->in[j], &cs->in[j], k);
        if (st != RF_OK)
            return st;
    }
    return locate(p, n, &cs->out, k);
}

static bool is_leaf(const rfi_node *n)
{
    return n->op == RFI_OP_ARGUMENT || n->op == RFI_OP_CAPTURE || n->op == RFI_OP_GRAD;
}

/* Prepares the library path of step k, or settles on the reference kernel. */
static rf_status prepare_step(rfi_cpu_services *s, int k, size_t *workspace)
{
    const rfi_step *step = &s->plan->steps[k];
    call_state *cs = &s->steps[k];
    *workspace = 0;
    if (step->kind != RFI_STEP_CALL)
        return RF_OK;
    rf_status st = prepare_locations(s, k);
    if (st != RF_OK)
        return st;
    const rfi_node *n = cs->node;
    if (is_leaf(n))
        return rfi_error(RF_E_INTERNAL, "cpu: call step %d computes %s node %%%d", k,
                         rfi_op_table[n->op].name, (int)n->id);
    cs->kind = RFI_CALL_FALLBACK;
    if ((step->call == RFI_CALL_MATMUL || step->call == RFI_CALL_CONV) && !s->have_library)
        return RF_OK; /* no oneDNN: the reference kernel */
    if (step->call == RFI_CALL_MATMUL && n->op == RFI_OP_DOT_GENERAL) {
        st = rfi_cpu_matmul_prepare(n, s->engine, &cs->matmul, workspace);
        if (st == RF_OK)
            cs->kind = RFI_CALL_MATMUL;
    } else if (step->call == RFI_CALL_CONV && n->op == RFI_OP_CONVOLUTION) {
        st = rfi_cpu_conv_prepare(n, s->engine, &cs->conv, workspace);
        if (st == RF_OK)
            cs->kind = RFI_CALL_CONV;
    } else if (step->call == RFI_CALL_FALLBACK) {
        st = rfi_cpu_native_prepare(n, &cs->native, workspace);
    } else {
        return rfi_error(RF_E_INTERNAL, "cpu: call step %d asks for call kind %d on a %s node",
                         k, (int)step->call, rfi_op_table[n->op].name);
    }
    return st == RF_E_UNSUPPORTED ? RF_OK : st;
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

rf_status rfi_cpu_services_prepare(const rfi_plan *p, rfi_cpu_services **out)
{
    *out = NULL;
    rfi_cpu_services *s = rfi_calloc(1, sizeof *s);
    if (!s)
        return rfi_error(RF_E_NOMEM, "cpu: out of memory preparing services");
    s->plan = p;
    s->n_steps = p->n_steps;
    s->threads = rfi_threadpool_size();
    s->steps = rfi_arena_alloc(&s->mem, ((size_t)p->n_steps + 1) * sizeof *s->steps);
    rf_status st = s->steps ? create_library(s)
                            : rfi_error(RF_E_NOMEM, "cpu: out of memory preparing services");
    set_library_threads(s);
    size_t most = 0;
    for (int k = 0; k < p->n_steps && st == RF_OK; k++) {
        size_t need = 0;
        st = prepare_step(s, k, &need);
        most = need > most ? need : most;
    }
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

static void *buffer_at(void *const *buffers, value_ref r)
{
    return (char *)buffers[r.buffer] + r.offset;
}

int rfi_cpu_services_call(void *rt, int step, void *const *buffers)
{
    rfi_cpu_services *s = rt;
    if (!s || step < 0 || step >= s->n_steps || s->steps[step].kind == RFI_CALL_NONE) {
        rfi_error(RF_E_INTERNAL, "cpu: call of step %d, which is not a call step", step);
        return 1;
    }
    call_state *cs = &s->steps[step];
    for (int j = 0; j < cs->n_in; j++)
        cs->operands[j] = buffer_at(buffers, cs->in[j]);
    void *out = buffer_at(buffers, cs->out);
    rf_status st;
    switch (cs->kind) {
    case RFI_CALL_MATMUL:
        set_library_threads(s);
        st = rfi_cpu_matmul_run(cs->matmul, s->stream, cs->operands[0], cs->operands[1], out,
                                s->workspace);
        break;
    case RFI_CALL_CONV:
        set_library_threads(s);
        st = rfi_cpu_conv_run(cs->conv, s->stream, cs->operands[0], cs->operands[1], out,
                              s->workspace);
        break;
    default:
        st = cs->native ? rfi_cpu_native_run(cs->native, cs->operands, out, s->workspace)
                        : rfi_interp_eval_node(cs->node, cs->operands, out);
        break;
    }
    return st == RF_OK ? 0 : 1;
}

void rfi_cpu_services_table(rfi_cpu_services *s, rf_module_services *table)
{
    table->abi = RF_MODULE_ABI;
    table->rt = s;
    table->parallel_for = rfi_cpu_services_parallel_for;
    table->call = rfi_cpu_services_call;
}

rfi_call_kind rfi_cpu_services_step_kind(const rfi_cpu_services *s, int step)
{
    return s && step >= 0 && step < s->n_steps ? s->steps[step].kind : RFI_CALL_NONE;
}

const char *rfi_cpu_services_step_path(const rfi_cpu_services *s, int step)
{
    if (!s || step < 0 || step >= s->n_steps || s->steps[step].kind == RFI_CALL_NONE)
        return "none";
    const call_state *cs = &s->steps[step];
    switch (cs->kind) {
    case RFI_CALL_MATMUL: return "matmul";
    case RFI_CALL_CONV: return rfi_cpu_conv_path(cs->conv);
    default: return cs->native ? rfi_cpu_native_path(cs->native) : "reference";
    }
}

size_t rfi_cpu_services_workspace(const rfi_cpu_services *s) { return s ? s->workspace_bytes : 0; }

void rfi_cpu_services_free(rfi_cpu_services *s)
{
    if (!s)
        return;
    for (int k = 0; s->steps && k < s->n_steps; k++) {
        rfi_cpu_matmul_free(s->steps[k].matmul);
        rfi_cpu_conv_free(s->steps[k].conv);
        rfi_cpu_native_free(s->steps[k].native);
    }
    if (s->stream)
        rfi_dnnl.stream_destroy(s->stream);
    if (s->engine)
        rfi_dnnl.engine_destroy(s->engine);
    rfi_free(s->workspace_block);
    rfi_arena_free(&s->mem);
    rfi_free(s);
}
