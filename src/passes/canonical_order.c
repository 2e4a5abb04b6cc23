/* canonical_order.c: puts a traced program into an order that depends on
 * what it computes, not on the order in which C evaluated the calls that
 * built it.
 *
 * C leaves the evaluation order of a call's arguments unspecified, so
 * `rf_add(rf_mul(a, b), rf_exp(c))` creates its two operands in one order
 * under gcc and in the other under clang. Four things of a traced program
 * follow creation order: the node order (which the passes, the fusion planner
 * and the kernel renderer walk), the capture numbers (first use), the random
 * streams (one per rf_rng_* call, numbered as called) and the order of the
 * updates that library calls record as they run (a BatchNorm's running
 * statistics, a random key's advance). This pass rebuilds the program with
 * all four derived from its structure:
 *
 *   nodes     depth-first from the outputs in order, then the update values in
 *             order, each node after its operands taken first to last
 *             (post-order); nodes that reach neither are dropped;
 *   updates   by the earliest node, in the outputs' part of that order, that
 *             their value reads directly or through nodes outside that part
 *             (a BatchNorm's update reads its batch statistics, so BatchNorms
 *             update in the order the outputs reach them); updates reading
 *             no such node, or the same earliest one, keep the order of their
 *             rf_assign calls, which is then the program's own;
 *   captures  numbered as their nodes appear in that order, then the captures
 *             only assigned to, in update order; captures neither read nor
 *             assigned are dropped;
 *   streams   numbered as their RNG nodes appear (one stream read twice stays
 *             one stream).
 *
 * Outputs keep their order: each is recorded by a statement (rf_return), so
 * its order is the program's own. The pass runs once, on the traced program,
 * before autodiff; everything after it is a function of the canonical
 * program.
 */
#include <limits.h>
#include <stdlib.h>

#include "passes/passes.h"
#include "runtime/runtime.h"

/* The pass's arrays: the orders it works out and its scratch. */
typedef struct work {
    bool *seen;       /* per node: visited */
    int *order;       /* node ids in canonical order */
    int n_order;
    int *stack_node;  /* per node: the walk's stack (and order_updates' scratch) */
    int *stack_next;
    struct update_key *keys; /* per update */
    int *update_order;       /* g's update indices in canonical order */
    int *new_capture; /* per capture: its canonical number, -1 when dropped */
    int *old_capture; /* the inverse, for the n_kept kept ones */
    int n_kept;
    int *new_stream;  /* per stream: its canonical number, -1 when unread */
    rfi_node **map;   /* per node: its copy */
    rfi_node **ins;   /* the operands of one copy */
} work;

/* Appends to w->order the ids of the nodes root reaches that are not yet
 * seen, in post-order. The walk keeps its own stack (deep chains would
 * overflow the C stack); frame i is a node and the index of its next operand
 * to visit. */
static void visit_from(const rfi_graph *g, const rfi_node *root, work *w)
{
    if (w->seen[root->id])
        return;
    w->seen[root->id] = true;
    int depth = 0;
    w->stack_node[0] = root->id;
    w->stack_next[0] = 0;
    while (depth >= 0) {
        const rfi_node *x = g->nodes[w->stack_node[depth]];
        if (w->stack_next[depth] == x->n_in) {
            w->order[w->n_order++] = x->id;
            depth--;
            continue;
        }
        const rfi_node *operand = x->in[w->stack_next[depth]++];
        if (w->seen[operand->id])
            continue;
        w->seen[operand->id] = true;
        depth++;
        w->stack_node[depth] = operand->id;
        w->stack_next[depth] = 0;
    }
}

typedef struct update_key {
    int earliest; /* position of the earliest outputs' node the value reads */
    int index;    /* in g->updates: keeps equal keys in rf_assign order */
} update_key;

static int compare_update_keys(const void *pa, const void *pb)
{
    const update_key *a = pa, *b = pb;
    if (a->earliest != b->earliest)
        return a->earliest < b->earliest ? -1 : 1;
    return (a->index > b->index) - (a->index < b->index);
}

/* Sorts the updates (w->update_order) by the earliest node of the outputs'
 * part of the order (w->order so far, w->seen set for exactly its nodes) that
 * each value reads, without looking past such nodes. An operand's id is
 * below its user's, so one pass in id order finds every node's earliest. */
static void order_updates(const rfi_graph *g, work *w)
{
    int *earliest = w->stack_node; /* free between walks */
    for (int k = 0; k < w->n_order; k++)
        earliest[w->order[k]] = k;
    for (int id = 0; id < g->n_nodes; id++) {
        if (w->seen[id])
            continue;
        const rfi_node *x = g->nodes[id];
        int e = INT_MAX;
        for (int k = 0; k < x->n_in; k++)
            if (earliest[x->in[k]->id] < e)
                e = earliest[x->in[k]->id];
        earliest[id] = e;
    }
    for (int i = 0; i < g->n_updates; i++)
        w->keys[i] = (update_key){.earliest = earliest[g->updates[i].value->id], .index = i};
    if (g->n_updates > 1)
        qsort(w->keys, (size_t)g->n_updates, sizeof *w->keys, compare_update_keys);
    for (int i = 0; i < g->n_updates; i++)
        w->update_order[i] = w->keys[i].index;
}

/* The canonical order of g's nodes and updates. */
static void visit_order(const rfi_graph *g, work *w)
{
    for (int i = 0; i < g->n_outputs; i++)
        visit_from(g, g->outputs[i], w);
    order_updates(g, w);
    for (int i = 0; i < g->n_updates; i++)
        visit_from(g, g->updates[w->update_order[i]].value, w);
}

/* Gives capture `old` the next canonical number unless it has one. */
static void number_capture(work *w, int old)
{
    if (w->new_capture[old] >= 0)
        return;
    w->old_capture[w->n_kept] = old;
    w->new_capture[old] = w->n_kept++;
}

/* Numbers the captures read in node order, then those only assigned to. */
static void number_captures(const rfi_graph *g, work *w)
{
    for (int i = 0; i < g->n_captures; i++)
        w->new_capture[i] = -1;
    for (int k = 0; k < w->n_order; k++) {
        const rfi_node *x = g->nodes[w->order[k]];
        if (x->op == RFI_OP_CAPTURE)
            number_capture(w, (int)x->attr.i[0]);
    }
    for (int i = 0; i < g->n_updates; i++)
        number_capture(w, g->updates[w->update_order[i]].capture);
}

/* Numbers the random streams as their nodes appear; returns how many are read. */
static int number_streams(const rfi_graph *g, work *w)
{
    for (int i = 0; i < g->n_rng_streams; i++)
        w->new_stream[i] = -1;
    int n = 0;
    for (int k = 0; k < w->n_order; k++) {
        const rfi_node *x = g->nodes[w->order[k]];
        if (x->op == RFI_OP_RNG && w->new_stream[x->attr.i[1]] < 0)
            w->new_stream[x->attr.i[1]] = n++;
    }
    return n;
}

/* The node copy of x in c: operands through map, the capture number and the
 * stream renumbered. */
static rfi_node *copy_node(rfi_graph *c, const rfi_node *x, work *w)
{
    for (int k = 0; k < x->n_in; k++)
        w->ins[k] = w->map[x->in[k]->id];
    rfi_attrs attr;
    rfi_attrs_copy(&attr, &x->attr);
    if (x->op == RFI_OP_CAPTURE)
        attr.i[0] = w->new_capture[attr.i[0]];
    else if (x->op == RFI_OP_RNG)
        attr.i[1] = w->new_stream[attr.i[1]];
    rfi_node *y = rfi_node_new(c, x->op, w->ins, x->n_in, &attr, x->dtype, x->dims, x->rank);
    if (y)
        y->weak = x->weak;
    return y;
}

/* Fills c (arguments declared, no captures yet) with g's program in w's order. */
static rf_status rebuild(const rfi_graph *g, rfi_graph *c, work *w)
{
    for (int i = 0; i < w->n_kept; i++)
        if (rfi_graph_capture_index(c, g->captures[w->old_capture[i]]) != i)
            return c->status != RF_OK ? c->status : RF_E_INTERNAL;
    for (int k = 0; k < w->n_order; k++) {
        const rfi_node *x = g->nodes[w->order[k]];
        w->map[x->id] = copy_node(c, x, w);
        if (!w->map[x->id])
            return c->status != RF_OK ? c->status : RF_E_NOMEM;
    }
    return rfi_graph_copy_results(g, c, w->map, w->new_capture, w->update_order);
}

static bool work_alloc(const rfi_graph *g, work *w)
{
    size_t n = g->n_nodes > 0 ? (size_t)g->n_nodes : 1;
    size_t n_updates = g->n_updates > 0 ? (size_t)g->n_updates : 1;
    size_t n_caps = g->n_captures > 0 ? (size_t)g->n_captures : 1;
    size_t n_streams = g->n_rng_streams > 0 ? (size_t)g->n_rng_streams : 1;
    *w = (work){0};
    w->seen = rfi_calloc(n, sizeof *w->seen);
    w->order = rfi_calloc(n, sizeof *w->order);
    w->stack_node = rfi_calloc(n, sizeof *w->stack_node);
    w->stack_next = rfi_calloc(n, sizeof *w->stack_next);
    w->keys = rfi_calloc(n_updates, sizeof *w->keys);
    w->update_order = rfi_calloc(n_updates, sizeof *w->update_order);
    w->new_capture = rfi_calloc(n_caps, sizeof *w->new_capture);
    w->old_capture = rfi_calloc(n_caps, sizeof *w->old_capture);
    w->new_stream = rfi_calloc(n_streams, sizeof *w->new_stream);
    w->map = rfi_calloc(n, sizeof *w->map);
    w->ins = rfi_calloc((size_t)rfi_max_operands(g), sizeof *w->ins);
    return w->seen && w->order && w->stack_node && w->stack_next && w->keys &&
           w->update_order && w->new_capture && w->old_capture && w->new_stream && w->map &&
           w->ins;
}

static void work_free(work *w)
{
    rfi_free(w->seen);
    rfi_free(w->order);
    rfi_free(w->stack_node);
    rfi_free(w->stack_next);
    rfi_free(w->keys);
    rfi_free(w->update_order);
    rfi_free(w->new_capture);
    rfi_free(w->old_capture);
    rfi_free(w->new_stream);
    rfi_free(w->map);
    rfi_free(w->ins);
}

rf_status rfi_canonical_order(const rfi_graph *g, rfi_graph **out)
{
    if (!out)
        return rfi_error(RF_E_INVALID, "canonical order: NULL output pointer");
    *out = NULL;
    if (!g)
        return rfi_error(RF_E_INVALID, "canonical order: NULL graph");
    work w;
    rfi_graph *c = NULL;
    rf_status st =
        work_alloc(g, &w) ? RF_OK : rfi_error(RF_E_NOMEM, "canonical order: out of memory");
    if (st == RF_OK) {
        c = rfi_graph_new(g->device, g->name);
        st = c ? rfi_graph_set_args(c, g->n_args, g->arg_dtypes, g->arg_ranks,
                                    (const int64_t(*)[RF_MAX_RANK])g->arg_dims)
               : RF_E_NOMEM;
    }
    if (st == RF_OK) {
        visit_order(g, &w);
        number_captures(g, &w);
        c->n_rng_streams = number_streams(g, &w);
        st = rebuild(g, c, &w);
    }
    work_free(&w);
    if (st != RF_OK) {
        rfi_graph_free(c);
        return st;
    }
    *out = c;
    return RF_OK;
}
