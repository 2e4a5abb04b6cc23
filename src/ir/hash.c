/* hash.c: rfi_hash, the structural (Merkle) hash of a program: it names the
 * RF_DUMP files and is rf_exec_hash (the caches key on program descriptions,
 * program_codec.c, instead).
 *
 * A node's hash covers its op, result type, weak flag, attributes, constant
 * bytes and its operands' hashes in order; ARGUMENT and CAPTURE nodes are
 * named by their index (and a capture also by its array's type). The program
 * hash folds the argument and capture types, the output hashes in order and
 * the updates (capture index, value hash) in order. Node ids, pointers, the
 * creation order of independent nodes, nodes no output or update reaches and
 * the program's name never enter it.
 */
#include "ir.h"

#include "runtime/runtime.h"

static uint64_t hash_type(uint64_t h, rf_dtype dt, const int64_t *dims, int rank)
{
    h = rfi_hash_u64(h, (uint64_t)dt);
    h = rfi_hash_u64(h, (uint64_t)rank);
    for (int i = 0; i < rank; i++)
        h = rfi_hash_u64(h, (uint64_t)dims[i]);
    return h;
}

static uint64_t hash_attrs(uint64_t h, const rfi_attrs *a)
{
    for (int k = 0; k < RFI_N_INTS; k++)
        h = rfi_hash_u64(h, (uint64_t)a->i[k]);
    for (int k = 0; k < RFI_N_LISTS; k++) {
        int n = a->nl[k] >= 0 && a->nl[k] <= RF_MAX_RANK ? a->nl[k] : 0;
        h = rfi_hash_u64(h, (uint64_t)a->nl[k]);
        for (int j = 0; j < n; j++) /* entries past nl[k] are unused: leave them out */
            h = rfi_hash_u64(h, (uint64_t)a->l[k][j]);
    }
    return h;
}

/* The hash of node x given the hashes of all earlier nodes. */
static uint64_t hash_node(const rfi_graph *g, const rfi_node *x, const uint64_t *node_hash)
{
    uint64_t h = rfi_hash_u64(RFI_HASH_INIT, (uint64_t)x->op);
    h = hash_type(h, x->dtype, x->dims, x->rank);
    h = rfi_hash_u64(h, x->weak);
    h = hash_attrs(h, &x->attr);
    if (x->op == RFI_OP_CONSTANT) {
        h = rfi_hash_u64(h, (uint64_t)x->attr.nbytes);
        if (x->attr.data)
            h = rfi_hash_u64(h, rfi_hash_bytes(RFI_HASH_INIT, x->attr.data, x->attr.nbytes));
    }
    if (x->op == RFI_OP_CAPTURE && x->attr.i[0] >= 0 && x->attr.i[0] < g->n_captures) {
        const rf_array *a = g->captures[x->attr.i[0]];
        if (a)
            h = hash_type(h, a->dtype, a->dims, a->rank);
    }
    h = rfi_hash_u64(h, (uint64_t)x->n_in);
    for (int k = 0; k < x->n_in; k++)
        h = rfi_hash_u64(h, node_hash[x->in[k]->id]);
    return h;
}

static uint64_t hash_signature(uint64_t h, const rfi_graph *g)
{
    h = rfi_hash_u64(h, (uint64_t)g->n_args);
    for (int k = 0; k < g->n_args; k++)
        h = hash_type(h, g->arg_dtypes[k], g->arg_dims[k], g->arg_ranks[k]);
    h = rfi_hash_u64(h, (uint64_t)g->n_captures);
    for (int k = 0; k < g->n_captures; k++) {
        const rf_array *a = g->captures[k];
        h = a ? hash_type(h, a->dtype, a->dims, a->rank) : rfi_hash_u64(h, UINT64_MAX);
    }
    return h;
}

uint64_t rfi_hash(const rfi_graph *g)
{
    if (!g)
        return 0;
    uint64_t *node_hash =
        rfi_malloc((g->n_nodes > 0 ? (size_t)g->n_nodes : 1) * sizeof *node_hash);
    if (!node_hash) {
        rfi_error(RF_E_NOMEM, "rfi_hash: out of memory");
        return 0;
    }
    /* Operands precede users, so one pass in SSA order sees every operand hash. */
    for (int i = 0; i < g->n_nodes; i++)
        node_hash[i] = hash_node(g, g->nodes[i], node_hash);

    uint64_t h = hash_signature(RFI_HASH_INIT, g);
    h = rfi_hash_u64(h, (uint64_t)g->n_outputs);
    for (int k = 0; k < g->n_outputs; k++)
        h = rfi_hash_u64(h, node_hash[g->outputs[k]->id]);
    h = rfi_hash_u64(h, (uint64_t)g->n_updates);
    for (int k = 0; k < g->n_updates; k++) {
        h = rfi_hash_u64(h, (uint64_t)g->updates[k].capture);
        h = rfi_hash_u64(h, node_hash[g->updates[k].value->id]);
    }
    rfi_free(node_hash);
    return h;
}
