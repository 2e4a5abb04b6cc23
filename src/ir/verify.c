/* verify.c: rfi_verify, the whole-graph consistency check run between passes:
 * SSA order and ownership, every node's stored type against rfi_infer, the
 * argument/capture slots, outputs and updates.
 *
 * It reports the first inconsistency as RF_E_INTERNAL (a bug in the pass that
 * built the graph, not a user error). It changes nothing and does not check
 * what ops compute.
 */
#include "ir.h"

#include <stdio.h>
#include <string.h>

#include "runtime/runtime.h"

#define TYPE_STR_MAX 200

static bool same_type(rf_dtype dt, const int64_t *dims, int rank, const rfi_node *x)
{
    return x->dtype == dt && x->rank == rank &&
           memcmp(x->dims, dims, (size_t)rank * sizeof *dims) == 0;
}

/* True if x is a node of g (not just any node claiming to be). */
static bool owns(const rfi_graph *g, const rfi_node *x)
{
    return x && x->g == g && x->id >= 0 && x->id < g->n_nodes && g->nodes[x->id] == x;
}

static rf_status bad_node(const rfi_graph *g, const rfi_node *x, const char *what)
{
    char t[TYPE_STR_MAX];
    return rfi_error(RF_E_INTERNAL, "verify %s: node %%%d = %s : %s: %s", g->name, (int)x->id,
                     rfi_op_table[x->op].name,
                     rfi_type_str(t, sizeof t, x->dtype, x->dims, x->rank), what);
}

/* ARGUMENT and CAPTURE nodes must name a slot of the graph with their type. */
static rf_status verify_leaf_slot(const rfi_graph *g, const rfi_node *x)
{
    int64_t idx = x->attr.i[0];
    if (x->op == RFI_OP_ARGUMENT) {
        if (idx < 0 || idx >= g->n_args)
            return bad_node(g, x, "argument index out of range");
        if (!same_type(g->arg_dtypes[idx], g->arg_dims[idx], g->arg_ranks[idx], x))
            return bad_node(g, x, "type differs from the declared argument type");
    } else if (x->op == RFI_OP_CAPTURE) {
        if (idx < 0 || idx >= g->n_captures)
            return bad_node(g, x, "capture index out of range");
        const rf_array *a = g->captures[idx];
        if (!a)
            return bad_node(g, x, "captured array is NULL");
        if (!same_type(a->dtype, a->dims, a->rank, x))
            return bad_node(g, x, "type differs from the captured array's type");
    }
    return RF_OK;
}

static rf_status verify_node(const rfi_graph *g, int i)
{
    const rfi_node *x = g->nodes[i];
    if (!x)
        return rfi_error(RF_E_INTERNAL, "verify %s: node %d is NULL", g->name, i);
    if (x->g != g || x->id != i)
        return bad_node(g, x, "wrong graph or id does not match its position");
    if ((unsigned)x->op >= RFI_OP_COUNT)
        return rfi_error(RF_E_INTERNAL, "verify %s: node %d has invalid op %d", g->name, i,
                         (int)x->op);
    for (int k = 0; k < x->n_in; k++) {
        const rfi_node *in = x->in[k];
        if (!owns(g, in) || in->id >= i) {
            char what[96];
            snprintf(what, sizeof what, "operand %d is not an earlier node of this graph", k);
            return bad_node(g, x, what);
        }
    }
    if (x->op == RFI_OP_CONSTANT && x->attr.nbytes != rfi_node_nbytes(x))
        return bad_node(g, x, "constant payload size does not match its type");
    rf_dtype dt = x->dtype;
    int rank = x->rank;
    int64_t dims[RF_MAX_RANK];
    memcpy(dims, x->dims, sizeof dims);
    char msg[RFI_ERRMSG_MAX];
    if (rfi_infer(x->op, x->in, x->n_in, &x->attr, &dt, dims, &rank, msg, sizeof msg) != RF_OK)
        return bad_node(g, x, msg);
    if (!same_type(dt, dims, rank, x)) {
        char t[TYPE_STR_MAX], what[TYPE_STR_MAX + 48];
        snprintf(what, sizeof what, "stored type differs from the inferred %s",
                 rfi_type_str(t, sizeof t, dt, dims, rank));
        return bad_node(g, x, what);
    }
    return verify_leaf_slot(g, x);
}

/* The per-slot node tables must point at matching nodes of g. */
static rf_status verify_slots(const rfi_graph *g)
{
    for (int k = 0; k < g->n_args; k++) {
        const rfi_node *x = g->args[k];
        if (x && (!owns(g, x) || x->op != RFI_OP_ARGUMENT || x->attr.i[0] != k))
            return rfi_error(RF_E_INTERNAL, "verify %s: argument %d's node is not its "
                             "ARGUMENT node in this graph", g->name, k);
    }
    for (int k = 0; k < g->n_captures; k++) {
        const rfi_node *x = g->capture_nodes[k];
        if (!g->captures[k])
            return rfi_error(RF_E_INTERNAL, "verify %s: capture %d is NULL", g->name, k);
        if (x && (!owns(g, x) || x->op != RFI_OP_CAPTURE || x->attr.i[0] != k))
            return rfi_error(RF_E_INTERNAL, "verify %s: capture %d's node is not its "
                             "CAPTURE node in this graph", g->name, k);
    }
    return RF_OK;
}

static rf_status verify_results(const rfi_graph *g)
{
    for (int k = 0; k < g->n_outputs; k++)
        if (!owns(g, g->outputs[k]))
            return rfi_error(RF_E_INTERNAL, "verify %s: output %d is not a node of this graph",
                             g->name, k);
    for (int k = 0; k < g->n_updates; k++) {
        const rfi_update *u = &g->updates[k];
        if (u->capture < 0 || u->capture >= g->n_captures)
            return rfi_error(RF_E_INTERNAL, "verify %s: update %d names capture %d of %d",
                             g->name, k, u->capture, g->n_captures);
        if (!owns(g, u->value))
            return rfi_error(RF_E_INTERNAL, "verify %s: update %d's value is not a node of "
                             "this graph", g->name, k);
        for (int j = 0; j < k; j++)
            if (g->updates[j].capture == u->capture)
                return rfi_error(RF_E_INTERNAL, "verify %s: capture %d is updated twice",
                                 g->name, u->capture);
        const rf_array *a = g->captures[u->capture];
        if (!same_type(a->dtype, a->dims, a->rank, u->value)) {
            char ta[TYPE_STR_MAX], tv[TYPE_STR_MAX];
            const rfi_node *v = u->value;
            return rfi_error(RF_E_INTERNAL, "verify %s: update of capture %d: value %%%d %s "
                             "does not match the array %s", g->name, u->capture, (int)v->id,
                             rfi_type_str(tv, sizeof tv, v->dtype, v->dims, v->rank),
                             rfi_type_str(ta, sizeof ta, a->dtype, a->dims, a->rank));
        }
    }
    return RF_OK;
}

rf_status rfi_verify(const rfi_graph *g)
{
    if (!g)
        return rfi_error(RF_E_INTERNAL, "verify: NULL graph");
    rf_status st = verify_slots(g);
    for (int i = 0; st == RF_OK && i < g->n_nodes; i++)
        st = verify_node(g, i);
    if (st == RF_OK)
        st = verify_results(g);
    return st;
}
