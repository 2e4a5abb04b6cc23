/* interp.c: the reference interpreter backend (rfi_interp_backend): runs a
 * verified program node by node in SSA order, one freshly allocated buffer
 * per computed node, freed right after its last use.
 *
 * prepare() computes each node's last use once; run() keeps no state between
 * calls, so one prepared program may run on several threads at once.
 * ARGUMENT and CAPTURE nodes read the caller's memory in place and CONSTANT
 * nodes read their payload in place (never written). Outputs and staged update
 * values are copied into the io buffers at the end. GRAD nodes must have been
 * removed by autodiff: seeing one is an internal error.
 * Deliberately no fusion, in-place reuse or threading: this is the oracle
 * compiled backends are checked against. Kernels live in the sibling files.
 */
#include "interp.h"

#include "../../runtime/runtime.h"

/* Per-program plan made by prepare. */
typedef struct interp_plan {
    int n_nodes;
    int max_operands;  /* the most operands of any node */
    int32_t *last_use; /* id of the last node reading each node; n_nodes: kept to the end */
} interp_plan;

static void interp_release(void *state)
{
    interp_plan *plan = state;
    if (!plan)
        return;
    rfi_free(plan->last_use);
    rfi_free(plan);
}

/* Checks what run relies on: known ops, no GRAD, leaf indices in range. */
static rf_status check_node(const rfi_graph *g, const rfi_node *n)
{
    if ((int)n->op < 0 || n->op >= RFI_OP_COUNT)
        return rfi_error(RF_E_INTERNAL, "interp: node %%%d has unknown op %d", (int)n->id,
                         (int)n->op);
    if (n->op == RFI_OP_GRAD)
        return rfi_error(RF_E_INTERNAL,
                         "interp: grad node %%%d reached the backend (autodiff must remove it)",
                         (int)n->id);
    if (n->op == RFI_OP_ARGUMENT && (n->attr.i[0] < 0 || n->attr.i[0] >= g->n_args))
        return rfi_error(RF_E_INTERNAL, "interp: argument %%%d has index %lld of %d", (int)n->id,
                         (long long)n->attr.i[0], g->n_args);
    if (n->op == RFI_OP_CAPTURE && (n->attr.i[0] < 0 || n->attr.i[0] >= g->n_captures))
        return rfi_error(RF_E_INTERNAL, "interp: capture %%%d has index %lld of %d", (int)n->id,
                         (long long)n->attr.i[0], g->n_captures);
    if (n->op == RFI_OP_CONSTANT &&
        (n->attr.nbytes != rfi_interp_nbytes(n) || (n->attr.nbytes > 0 && !n->attr.data)))
        return rfi_error(RF_E_INTERNAL, "interp: constant %%%d holds %zu bytes, expected %zu",
                         (int)n->id, n->attr.nbytes, rfi_interp_nbytes(n));
    return RF_OK;
}

static const char *program_name(const rfi_graph *g) { return g->name ? g->name : "program"; }

static rf_status interp_prepare(const rfi_graph *g, void **state)
{
    *state = NULL;
    for (int k = 0; k < g->n_nodes; k++) {
        rf_status st = check_node(g, g->nodes[k]);
        if (st != RF_OK)
            return st;
    }
    interp_plan *plan = rfi_calloc(1, sizeof *plan);
    if (!plan)
        return rfi_error(RF_E_NOMEM, "interp: out of memory preparing %s", program_name(g));
    plan->n_nodes = g->n_nodes;
    plan->last_use = rfi_malloc(((size_t)g->n_nodes + 1) * sizeof(int32_t));
    if (!plan->last_use) {
        interp_release(plan);
        return rfi_error(RF_E_NOMEM, "interp: out of memory preparing %s", program_name(g));
    }
    for (int k = 0; k < g->n_nodes; k++) {
        const rfi_node *n = g->nodes[k];
        plan->last_use[k] = k; /* unused: freed as soon as it is made */
        for (int j = 0; j < n->n_in; j++)
            plan->last_use[n->in[j]->id] = k; /* k only grows: this ends as the last reader */
        if (n->n_in > plan->max_operands)
            plan->max_operands = n->n_in;
    }
    for (int j = 0; j < g->n_outputs; j++)
        plan->last_use[g->outputs[j]->id] = g->n_nodes;
    for (int j = 0; j < g->n_updates; j++)
        plan->last_use[g->updates[j].value->id] = g->n_nodes;
    *state = plan;
    return RF_OK;
}

/* Computes node n from its operand buffers into out. */
static rf_status eval_node(const rfi_node *n, const void *const *in, void *out)
{
    unsigned flags = rfi_op_table[n->op].flags;
    if (flags & (RFI_UNARY | RFI_BINARY))
        return rfi_interp_elementwise(n, in, out);
    switch (n->op) {
    case RFI_OP_COMPARE:
    case RFI_OP_SELECT:
    case RFI_OP_CLAMP:
    case RFI_OP_CONVERT: return rfi_interp_elementwise(n, in, out);
    case RFI_OP_BROADCAST_IN_DIM:
    case RFI_OP_RESHAPE:
    case RFI_OP_TRANSPOSE:
    case RFI_OP_SLICE:
    case RFI_OP_CONCATENATE:
    case RFI_OP_PAD:
    case RFI_OP_REVERSE: return rfi_interp_shape(n, in, out);
    case RFI_OP_REDUCE:
    case RFI_OP_ARGMAX:
    case RFI_OP_ARGMIN:
    case RFI_OP_REDUCE_WINDOW:
    case RFI_OP_SELECT_AND_SCATTER: return rfi_interp_reduce(n, in, out);
    case RFI_OP_DOT_GENERAL:
    case RFI_OP_CONVOLUTION: return rfi_interp_linalg(n, in, out);
    case RFI_OP_GATHER:
    case RFI_OP_SCATTER_ADD:
    case RFI_OP_RNG:
    case RFI_OP_IOTA:
    case RFI_OP_CONSTANT: return rfi_interp_index(n, in, out);
    default:
        return rfi_error(RF_E_INTERNAL, "interp: cannot evaluate %s node %%%d",
                         rfi_op_table[n->op].name, (int)n->id);
    }
}

/* Exported for passes that evaluate one node on constant operands (folding). */
rf_status rfi_interp_eval_node(const rfi_node *n, const void *const *inputs, void *out)
{
    return eval_node(n, inputs, out);
}

/* Buffers of one run: val[k] is node k's data (borrowed or owned), owned[k] the
 * allocation to free (NULL when val[k] is borrowed or already freed). */
typedef struct run_buffers {
    const void **val;
    void **owned;
    const void **operands; /* scratch: one node's operand buffers */
    int n;
} run_buffers;

static void free_buffers(run_buffers *rb)
{
    if (rb->owned)
        for (int k = 0; k < rb->n; k++)
            rfi_free(rb->owned[k]);
    rfi_free(rb->owned);
    rfi_free(rb->val);
    rfi_free(rb->operands);
}

static void drop(run_buffers *rb, int k)
{
    rfi_free(rb->owned[k]);
    rb->owned[k] = NULL;
    rb->val[k] = NULL;
}

/* Makes node n's buffer: borrowed for leaves that name memory, computed otherwise. */
static rf_status produce(const rfi_graph *g, const rfi_node *n, const rfi_run_io *io,
                         run_buffers *rb)
{
    switch (n->op) {
    case RFI_OP_GRAD: return check_node(g, n);
    case RFI_OP_ARGUMENT: rb->val[n->id] = io->args[n->attr.i[0]]; return RF_OK;
    case RFI_OP_CAPTURE: rb->val[n->id] = io->captures[n->attr.i[0]]; return RF_OK;
    case RFI_OP_CONSTANT: rb->val[n->id] = n->attr.data; return RF_OK;
    default: break;
    }
    size_t nbytes = rfi_interp_nbytes(n);
    void *out = rfi_malloc(nbytes > 0 ? nbytes : 1);
    if (!out)
        return rfi_error(RF_E_NOMEM, "interp: out of memory for %zu bytes (%s node %%%d)", nbytes,
                         rfi_op_table[n->op].name, (int)n->id);
    rb->owned[n->id] = out;
    rb->val[n->id] = out;
    for (int j = 0; j < n->n_in; j++)
        rb->operands[j] = rb->val[n->in[j]->id];
    return eval_node(n, rb->operands, out);
}

rf_status rfi_interp_run_visited(void *state, const rfi_graph *g, const rfi_run_io *io,
                                 rfi_interp_visit_fn visit, void *ctx)
{
    const interp_plan *plan = state;
    if (!plan || plan->n_nodes != g->n_nodes)
        return rfi_error(RF_E_INTERNAL, "interp: program does not match its prepared plan");
    run_buffers rb = {NULL, NULL, NULL, g->n_nodes};
    size_t n_slots = (size_t)g->n_nodes + 1;
    rb.val = rfi_calloc(n_slots, sizeof *rb.val);
    rb.owned = rfi_calloc(n_slots, sizeof *rb.owned);
    rb.operands = rfi_calloc((size_t)plan->max_operands + 1, sizeof *rb.operands);
    rf_status st = RF_OK;
    if (!rb.val || !rb.owned || !rb.operands)
        st = rfi_error(RF_E_NOMEM, "interp: out of memory for the buffer table");

    for (int k = 0; k < g->n_nodes && st == RF_OK; k++) {
        const rfi_node *n = g->nodes[k];
        st = produce(g, n, io, &rb);
        if (st == RF_OK && visit)
            st = visit(ctx, n, &rb.val[k], rb.owned[k], rb.operands);
        for (int j = 0; j < n->n_in; j++)
            if (plan->last_use[n->in[j]->id] == k)
                drop(&rb, n->in[j]->id);
        if (plan->last_use[k] == k)
            drop(&rb, k);
    }
    for (int j = 0; j < g->n_outputs && st == RF_OK; j++) {
        const rfi_node *x = g->outputs[j];
        if (io->outputs[j] != rb.val[x->id])
            rfi_interp_copy(io->outputs[j], rb.val[x->id], rfi_interp_nbytes(x));
    }
    for (int j = 0; j < g->n_updates && st == RF_OK; j++) {
        const rfi_node *x = g->updates[j].value;
        if (io->updates[j] != rb.val[x->id])
            rfi_interp_copy(io->updates[j], rb.val[x->id], rfi_interp_nbytes(x));
    }
    free_buffers(&rb);
    return st;
}

static rf_status interp_run(void *state, const rfi_graph *g, const rfi_run_io *io)
{
    return rfi_interp_run_visited(state, g, io, NULL, NULL);
}

const rfi_backend rfi_interp_backend = {
    .name = "interp",
    .prepare = interp_prepare,
    .run = interp_run,
    .release = interp_release,
    .writes_updates = false, /* updates are staged by the executable */
    .memory = NULL,          /* buffers are allocated per node at run time */
};
