/* canonical_order.c: puts a traced program into an order that depends on
 * what it computes, not on the order in which C evaluated the calls that
 * built it.
 *
 * C leaves the evaluation order of a call's arguments unspecified, so
 * `rf_add(rf_mul(a, b), rf_exp(c))` creates its two operands in one order
 * under gcc and in the other under clang. Three things of a traced program
 * follow creation order: the node order (which the passes, the fusion planner
 * and the kernel renderer walk), the capture numbers (first use), and the
 * random streams (one per rf_rng_* call, numbered as called). This pass
 * rebuilds the program with all three derived from its structure alone:
 *
 *   nodes     depth-first from the outputs in order, then the update values in
 *             order, each node after its operands taken first to last
 *             (post-order); nodes that reach neither are dropped;
 *   captures  numbered as their nodes appear in that order, then the captures
 *             only assigned to, in update order; captures neither read nor
 *             assigned are dropped;
 *   streams   numbered as their RNG nodes appear (one stream read twice stays
 *             one stream).
 *
 * Outputs and updates keep their order: each is recorded by a statement
 * (rf_return, rf_assign), so its order is the program's own. The pass runs
 * once, on the traced program, before autodiff; everything after it is a
 * function of the canonical program.
 */
#include <string.h>

#include "passes/passes.h"
#include "runtime/runtime.h"

/* Ids of the nodes that reach an output or update, in canonical order. The
 * walk keeps its own stack (deep chains would overflow the C stack); frame i
 * is a node and the index of its next operand to visit. Returns the count. */
static int visit_order(const rfi_graph *g, bool *seen, int *order, int *stack_node,
                       int *stack_next)
{
    int n_order = 0;
    int n_roots = g->n_outputs + g->n_updates;
    for (int r = 0; r < n_roots; r++) {
        const rfi_node *root =
            r < g->n_outputs ? g->outputs[r] : g->updates[r - g->n_outputs].value;
        if (seen[root->id])
            continue;
        seen[root->id] = true;
        int depth = 0;
        stack_node[0] = root->id;
        stack_next[0] = 0;
        while (depth >= 0) {
            const rfi_node *x = g->nodes[stack_node[depth]];
            if (stack_next[depth] == x->n_in) {
                order[n_order++] = x->id;
                depth--;
                continue;
            }
            const rfi_node *operand = x->in[stack_next[depth]++];
            if (seen[operand->id])
                continue;
            seen[operand->id] = true;
            depth++;
            stack_node[depth] = operand->id;
            stack_next[depth] = 0;
        }
    }
    return n_order;
}

/* Gives capture `old` the next canonical number unless it has one. */
static void number_capture(int old, int *new_capture, int *old_capture, int *n)
{
    if (new_capture[old] >= 0)
        return;
    old_capture[*n] = old;
    new_capture[old] = (*n)++;
}

/* new_capture[old number] = its canonical number, or -1 when it is dropped;
 * old_capture is the inverse. Returns the number of captures kept. */
static int number_captures(const rfi_graph *g, const int *order, int n_order, int *new_capture,
                           int *old_capture)
{
    for (int i = 0; i < g->n_captures; i++)
        new_capture[i] = -1;
    int n = 0;
    for (int k = 0; k < n_order; k++) {
        const rfi_node *x = g->nodes[order[k]];
        if (x->op == RFI_OP_CAPTURE)
            number_capture((int)x->attr.i[0], new_capture, old_capture, &n);
    }
    for (int i = 0; i < g->n_updates; i++)
        number_capture(g->updates[i].capture, new_capture, old_capture, &n);
    return n;
}

/* new_stream[old stream] = its canonical number (entries of unread streams
 * stay -1). Returns the number of streams read. */
static int number_streams(const rfi_graph *g, const int *order, int n_order, int *new_stream)
{
    for (int i = 0; i < g->n_rng_streams; i++)
        new_stream[i] = -1;
    int n = 0;
    for (int k = 0; k < n_order; k++) {
        const rfi_node *x = g->nodes[order[k]];
        if (x->op == RFI_OP_RNG && new_stream[x->attr.i[1]] < 0)
            new_stream[x->attr.i[1]] = n++;
    }
    return n;
}

/* The node copy of x in c: operands through map, the capture number and the
 * stream renumbered. */
static rfi_node *copy_node(rfi_graph *c, const rfi_node *x, rfi_node *const *map,
                           const int *new_capture, const int *new_stream, rfi_node **ins)
{
    for (int k = 0; k < x->n_in; k++)
        ins[k] = map[x->in[k]->id];
    rfi_attrs attr;
    rfi_attrs_copy(&attr, &x->attr);
    if (x->op == RFI_OP_CAPTURE)
        attr.i[0] = new_capture[attr.i[0]];
    else if (x->op == RFI_OP_RNG)
        attr.i[1] = new_stream[attr.i[1]];
    rfi_node *y = rfi_node_new(c, x->op, ins, x->n_in, &attr, x->dtype, x->dims, x->rank);
    if (y)
        y->weak = x->weak;
    return y;
}

/* Fills c (arguments declared, no captures yet) with g's program in the
 * order worked out by the callers. */
static rf_status rebuild(const rfi_graph *g, rfi_graph *c, const int *order, int n_order,
                         const int *new_capture, const int *old_capture, int n_kept,
                         const int *new_stream, rfi_node **map, rfi_node **ins)
{
    for (int i = 0; i < n_kept; i++)
        if (rfi_graph_capture_index(c, g->captures[old_capture[i]]) != i)
            return c->status != RF_OK ? c->status : RF_E_INTERNAL;
    for (int k = 0; k < n_order; k++) {
        const rfi_node *x = g->nodes[order[k]];
        map[x->id] = copy_node(c, x, map, new_capture, new_stream, ins);
        if (!map[x->id])
            return c->status != RF_OK ? c->status : RF_E_NOMEM;
    }
    return rfi_graph_copy_results(g, c, map, new_capture);
}

rf_status rfi_canonical_order(const rfi_graph *g, rfi_graph **out)
{
    if (!out)
        return rfi_error(RF_E_INVALID, "canonical order: NULL output pointer");
    *out = NULL;
    if (!g)
        return rfi_error(RF_E_INVALID, "canonical order: NULL graph");
    size_t n = g->n_nodes > 0 ? (size_t)g->n_nodes : 1;
    size_t n_caps = g->n_captures > 0 ? (size_t)g->n_captures : 1;
    size_t n_streams = g->n_rng_streams > 0 ? (size_t)g->n_rng_streams : 1;
    int max_in = rfi_max_operands(g);
    bool *seen = rfi_calloc(n, sizeof *seen);
    int *order = rfi_calloc(n, sizeof *order);
    int *stack_node = rfi_calloc(n, sizeof *stack_node);
    int *stack_next = rfi_calloc(n, sizeof *stack_next);
    int *new_capture = rfi_calloc(n_caps, sizeof *new_capture);
    int *old_capture = rfi_calloc(n_caps, sizeof *old_capture);
    int *new_stream = rfi_calloc(n_streams, sizeof *new_stream);
    rfi_node **map = rfi_calloc(n, sizeof *map);
    rfi_node **ins = rfi_calloc((size_t)max_in, sizeof *ins);
    rfi_graph *c = NULL;
    rf_status st = seen && order && stack_node && stack_next && new_capture && old_capture &&
                           new_stream &&
                           map && ins
                       ? RF_OK
                       : rfi_error(RF_E_NOMEM, "canonical order: out of memory");
    if (st == RF_OK) {
        c = rfi_graph_new(g->device, g->name);
        st = c ? rfi_graph_set_args(c, g->n_args, g->arg_dtypes, g->arg_ranks,
                                    (const int64_t(*)[RF_MAX_RANK])g->arg_dims)
               : RF_E_NOMEM;
    }
    if (st == RF_OK) {
        int n_order = visit_order(g, seen, order, stack_node, stack_next);
        int n_kept = number_captures(g, order, n_order, new_capture, old_capture);
        c->n_rng_streams = number_streams(g, order, n_order, new_stream);
        st = rebuild(g, c, order, n_order, new_capture, old_capture, n_kept, new_stream, map,
                     ins);
    }
    rfi_free(seen);
    rfi_free(order);
    rfi_free(stack_node);
    rfi_free(stack_next);
    rfi_free(new_capture);
    rfi_free(old_capture);
    rfi_free(new_stream);
    rfi_free(map);
    rfi_free(ins);
    if (st != RF_OK) {
        rfi_graph_free(c);
        return st;
    }
    *out = c;
    return RF_OK;
}
