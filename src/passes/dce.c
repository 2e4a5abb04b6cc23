/* dce.c: dead-code elimination (a copy of a graph without the nodes that
 * reach no output or update), and the graph-copy helpers of passes.h that
 * every copying pass shares (rfi_rewrite_graph: the node-by-node copy of the
 * rewriting passes, merge_dots and unroll_pools).
 *
 * Arguments and captures keep their indices even when unused (the executable
 * binds them by index); only their nodes may go. Deliberately not here:
 * common-subexpression elimination or folding (separate passes).
 */
#include <string.h>

#include "passes/passes.h"

rf_status rfi_graph_new_like(const rfi_graph *g, rfi_graph **out)
{
    *out = NULL;
    rfi_graph *c = rfi_graph_new(g->device, g->name);
    if (!c)
        return RF_E_NOMEM;
    rf_status st = rfi_graph_set_args(c, g->n_args, g->arg_dtypes, g->arg_ranks,
                                      (const int64_t(*)[RF_MAX_RANK])g->arg_dims);
    for (int i = 0; st == RF_OK && i < g->n_captures; i++) {
        int idx = rfi_graph_capture_index(c, g->captures[i]);
        if (idx != i)
            st = idx < 0 ? RF_E_NOMEM
                         : rfi_error(RF_E_INTERNAL, "%s: capture %d is repeated", g->name, i);
    }
    if (st != RF_OK) {
        rfi_graph_free(c);
        return st;
    }
    c->n_rng_streams = g->n_rng_streams;
    *out = c;
    return RF_OK;
}

rf_status rfi_graph_copy_results(const rfi_graph *g, rfi_graph *copy, rfi_node *const *map,
                                 const int *new_capture, const int *update_order)
{
    for (int i = 0; i < g->n_outputs; i++) {
        rf_status st = rfi_graph_add_output(copy, map[g->outputs[i]->id]);
        if (st != RF_OK)
            return st;
    }
    for (int i = 0; i < g->n_updates; i++) {
        const rfi_update *u = &g->updates[update_order ? update_order[i] : i];
        int capture = new_capture ? new_capture[u->capture] : u->capture;
        rf_status st = rfi_graph_add_update(copy, capture, map[u->value->id]);
        if (st != RF_OK)
            return st;
    }
    return RF_OK;
}

/* live[i]: node i reaches an output or an update. */
static void mark_live(const rfi_graph *g, bool *live)
{
    for (int i = 0; i < g->n_outputs; i++)
        live[g->outputs[i]->id] = true;
    for (int i = 0; i < g->n_updates; i++)
        live[g->updates[i].value->id] = true;
    for (int id = g->n_nodes - 1; id >= 0; id--) {
        if (!live[id])
            continue;
        const rfi_node *x = g->nodes[id];
        for (int k = 0; k < x->n_in; k++)
            live[x->in[k]->id] = true;
    }
}

/* Copies the live nodes in order; map[i] receives node i's copy (NULL if dead). */
static rf_status copy_live(const rfi_graph *g, rfi_graph *c, const bool *live, rfi_node **map,
                           rfi_node **ins)
{
    for (int id = 0; id < g->n_nodes; id++) {
        if (!live[id])
            continue;
        const rfi_node *x = g->nodes[id];
        for (int k = 0; k < x->n_in; k++)
            ins[k] = map[x->in[k]->id];
        map[id] = rfi_node_clone(c, x, ins);
        if (!map[id])
            return c->status != RF_OK ? c->status : RF_E_NOMEM;
    }
    return RF_OK;
}

rf_status rfi_dce(const rfi_graph *g, rfi_graph **out)
{
    if (!out)
        return rfi_error(RF_E_INVALID, "dce: NULL output pointer");
    *out = NULL;
    if (!g)
        return rfi_error(RF_E_INVALID, "dce: NULL graph");
    size_t n = g->n_nodes > 0 ? (size_t)g->n_nodes : 1;
    int max_in = rfi_max_operands(g);
    bool *live = rfi_calloc(n, sizeof *live);
    rfi_node **map = rfi_calloc(n, sizeof *map);
    rfi_node **ins = rfi_calloc((size_t)max_in, sizeof *ins);
    rfi_graph *c = NULL;
    rf_status st = live && map && ins ? RF_OK : rfi_error(RF_E_NOMEM, "dce: out of memory");
    if (st == RF_OK)
        st = rfi_graph_new_like(g, &c);
    if (st == RF_OK) {
        mark_live(g, live);
        st = copy_live(g, c, live, map, ins);
    }
    if (st == RF_OK)
        st = rfi_graph_copy_results(g, c, map, NULL, NULL);
    rfi_free(live);
    rfi_free(map);
    rfi_free(ins);
    if (st != RF_OK) {
        rfi_graph_free(c);
        return st;
    }
    *out = c;
    return RF_OK;
}

rf_status rfi_rewrite_graph(const rfi_graph *g, const char *what, rfi_rewrite_fn rewrite,
                            void *ctx, rfi_graph **out)
{
    if (!out || !g)
        return rfi_error(RF_E_INVALID, "%s: NULL %s", what, g ? "output pointer" : "graph");
    *out = NULL;
    rfi_node **map = rfi_calloc(g->n_nodes > 0 ? (size_t)g->n_nodes : 1, sizeof *map);
    rfi_node **ins = rfi_calloc((size_t)rfi_max_operands(g), sizeof *ins);
    rfi_graph *c = NULL;
    rf_status st = map && ins ? rfi_graph_new_like(g, &c)
                              : rfi_error(RF_E_NOMEM, "%s: out of memory", what);
    for (int id = 0; st == RF_OK && id < g->n_nodes; id++) {
        const rfi_node *n = g->nodes[id];
        for (int k = 0; k < n->n_in; k++)
            ins[k] = map[n->in[k]->id];
        rfi_node *r = rewrite ? rewrite(ctx, c, n, ins, map) : NULL;
        if (!r && c->status == RF_OK) /* not rewritten: kept as it is */
            r = rfi_node_clone(c, n, ins);
        if (!r) {
            st = c->status != RF_OK ? c->status
                                    : rfi_error(RF_E_NOMEM, "%s: out of memory", what);
            break;
        }
        if (r->dtype != n->dtype || r->rank != n->rank ||
            memcmp(r->dims, n->dims, sizeof(int64_t) * (size_t)n->rank) != 0) {
            st = rfi_error(RF_E_INTERNAL, "%s: rewriting %s node %%%d changed its type", what,
                           rfi_op_table[n->op].name, id);
            break;
        }
        map[id] = r;
    }
    if (st == RF_OK)
        st = rfi_graph_copy_results(g, c, map, NULL, NULL);
    if (st == RF_OK)
        st = rfi_dce(c, out);
    rfi_free(map);
    rfi_free(ins);
    rfi_graph_free(c);
    return st;
}
