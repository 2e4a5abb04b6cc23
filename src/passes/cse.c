/* cse.c: common-subexpression elimination (rfi_cse) by structural hashing.
 *
 * Nodes are copied in SSA order; a node equal to one already copied (same op,
 * dtype, dims, attributes, constant bytes and the same copied operands) is
 * not copied again: its users take the earlier copy. ARGUMENT and CAPTURE
 * nodes merge only with the same index (the index is an attribute), RNG nodes
 * only with the same key and stream; constants merge on equal bytes, weak or
 * not (the weak flag only steers typing while tracing). Operand order counts, except for the
 * commutative integer/bool ops (add, mul, max, min, and, or), whose results
 * do not depend on it; float add/mul are not reordered (with two NaN operands
 * the interpreter returns the first one's payload) nor float max/min
 * (max(-0.0, +0.0) returns its second operand).
 *
 * Deliberately not here: algebraic rewrites (simplify.c), removing dead nodes
 * (dce.c; CSE creates none), GRAD nodes (never merged).
 */
#include <string.h>

#include "passes/passes.h"
#include "runtime/runtime.h"

typedef struct cse_table {
    rfi_node **slots; /* open addressing, NULL = empty */
    uint64_t *hashes;
    size_t mask;
} cse_table;

static bool is_commutative(const rfi_node *n)
{
    if (rfi_dtype_is_float(n->dtype))
        return false;
    switch (n->op) {
    case RFI_OP_ADD:
    case RFI_OP_MUL:
    case RFI_OP_MAX:
    case RFI_OP_MIN:
    case RFI_OP_AND:
    case RFI_OP_OR: return true;
    default: return false;
    }
}

/* The operands in the order that identifies the node (sorted by id when commutative). */
static void key_operands(const rfi_node *n, rfi_node *const *in, rfi_node **key)
{
    for (int k = 0; k < n->n_in; k++)
        key[k] = in[k];
    if (is_commutative(n) && n->n_in == 2 && key[0]->id > key[1]->id) {
        rfi_node *t = key[0];
        key[0] = key[1];
        key[1] = t;
    }
}

static uint64_t hash_operands(uint64_t h, const rfi_node *n, rfi_node *const *key)
{
    h = rfi_hash_u64(h, (uint64_t)n->n_in);
    for (int k = 0; k < n->n_in; k++)
        h = rfi_hash_u64(h, (uint64_t)key[k]->id);
    return h;
}

static uint64_t hash_key(const rfi_node *n, rfi_node *const *key)
{
    uint64_t h = rfi_hash_u64(RFI_HASH_INIT, (uint64_t)n->op);
    h = rfi_hash_u64(h, (uint64_t)n->dtype);
    h = rfi_hash_u64(h, (uint64_t)n->rank);
    for (int d = 0; d < n->rank; d++)
        h = rfi_hash_u64(h, (uint64_t)n->dims[d]);
    if (n->op == RFI_OP_CONSTANT) /* only the bytes count (see same_attrs) */
        return hash_operands(rfi_hash_bytes(h, n->attr.data, n->attr.nbytes), n, key);
    for (int k = 0; k < RFI_N_INTS; k++)
        h = rfi_hash_u64(h, (uint64_t)n->attr.i[k]);
    for (int k = 0; k < RFI_N_LISTS; k++) {
        h = rfi_hash_u64(h, (uint64_t)n->attr.nl[k]);
        for (int j = 0; j < n->attr.nl[k] && j < RF_MAX_RANK; j++)
            h = rfi_hash_u64(h, (uint64_t)n->attr.l[k][j]);
    }
    return hash_operands(h, n, key);
}

/* Equal attributes; constants compare by payload only (a weak scalar keeps its
 * traced double in i[0], which computes nothing). */
static bool same_attrs(rfi_op op, const rfi_attrs *a, const rfi_attrs *b)
{
    if (op == RFI_OP_CONSTANT)
        return a->nbytes == b->nbytes &&
               (a->nbytes == 0 || memcmp(a->data, b->data, a->nbytes) == 0);
    if (memcmp(a->i, b->i, sizeof a->i) != 0 || memcmp(a->nl, b->nl, sizeof a->nl) != 0)
        return false;
    for (int k = 0; k < RFI_N_LISTS; k++) {
        int n = a->nl[k] >= 0 && a->nl[k] <= RF_MAX_RANK ? a->nl[k] : 0;
        if (memcmp(a->l[k], b->l[k], (size_t)n * sizeof a->l[k][0]) != 0)
            return false;
    }
    if (a->nbytes != b->nbytes)
        return false;
    return a->nbytes == 0 || memcmp(a->data, b->data, a->nbytes) == 0;
}

/* `have` (a copied node) computes what n over operands `key` computes. */
static bool same_node(const rfi_node *have, const rfi_node *n, rfi_node *const *key)
{
    if (have->op != n->op || have->dtype != n->dtype || have->rank != n->rank ||
        have->n_in != n->n_in ||
        memcmp(have->dims, n->dims, (size_t)n->rank * sizeof n->dims[0]) != 0 ||
        !same_attrs(n->op, &have->attr, &n->attr))
        return false;
    rfi_node *have_key[2];
    if (is_commutative(have) && have->n_in == 2) {
        key_operands(have, have->in, have_key);
        return have_key[0] == key[0] && have_key[1] == key[1];
    }
    for (int k = 0; k < n->n_in; k++)
        if (have->in[k] != key[k])
            return false;
    return true;
}

/* The slot holding a node equal to n, or the empty slot where it belongs. */
static size_t find_slot(const cse_table *t, const rfi_node *n, rfi_node *const *key, uint64_t h)
{
    size_t i = (size_t)h & t->mask;
    while (t->slots[i] && !(t->hashes[i] == h && same_node(t->slots[i], n, key)))
        i = (i + 1) & t->mask;
    return i;
}

static rf_status cse_copy(const rfi_graph *g, rfi_graph *c, cse_table *t, rfi_node **map,
                          rfi_node **ins, rfi_node **key)
{
    for (int id = 0; id < g->n_nodes; id++) {
        const rfi_node *n = g->nodes[id];
        for (int k = 0; k < n->n_in; k++)
            ins[k] = map[n->in[k]->id];
        bool mergeable = n->op != RFI_OP_GRAD;
        size_t slot = 0;
        uint64_t h = 0;
        if (mergeable) {
            key_operands(n, ins, key);
            h = hash_key(n, key);
            slot = find_slot(t, n, key, h);
            if (t->slots[slot]) {
                map[id] = t->slots[slot];
                continue;
            }
        }
        map[id] = rfi_node_clone(c, n, ins);
        if (!map[id])
            return c->status != RF_OK ? c->status : RF_E_NOMEM;
        if (mergeable) {
            t->slots[slot] = map[id];
            t->hashes[slot] = h;
        }
    }
    return RF_OK;
}

rf_status rfi_cse(const rfi_graph *g, rfi_graph **out)
{
    if (!out)
        return rfi_error(RF_E_INVALID, "cse: NULL output pointer");
    *out = NULL;
    if (!g)
        return rfi_error(RF_E_INVALID, "cse: NULL graph");
    int max_in = rfi_max_operands(g);
    if (max_in < 2)
        max_in = 2; /* the commutative key swaps two entries */
    size_t cap = 16;
    while (cap < 2 * (size_t)g->n_nodes)
        cap *= 2;
    cse_table t = {rfi_calloc(cap, sizeof *t.slots), rfi_calloc(cap, sizeof *t.hashes), cap - 1};
    rfi_node **map = rfi_calloc(g->n_nodes > 0 ? (size_t)g->n_nodes : 1, sizeof *map);
    rfi_node **ins = rfi_calloc((size_t)max_in, sizeof *ins);
    rfi_node **key = rfi_calloc((size_t)max_in, sizeof *key);
    rfi_graph *c = NULL;
    rf_status st = t.slots && t.hashes && map && ins && key
                       ? RF_OK
                       : rfi_error(RF_E_NOMEM, "cse: out of memory");
    if (st == RF_OK)
        st = rfi_graph_new_like(g, &c);
    if (st == RF_OK)
        st = cse_copy(g, c, &t, map, ins, key);
    if (st == RF_OK)
        st = rfi_graph_copy_results(g, c, map, NULL, NULL);
    rfi_free(t.slots);
    rfi_free(t.hashes);
    rfi_free(map);
    rfi_free(ins);
    rfi_free(key);
    if (st != RF_OK) {
        rfi_graph_free(c);
        return st;
    }
    *out = c;
    return RF_OK;
}
