/* merge_dots.c: a sum of matrix products of one form becomes one product of
 * their operands concatenated along the contracted dim (rfi_merge_dots).
 *
 * Why: a weight used at several places of a program (a recurrent cell over
 * time steps, a layer applied twice, tied embeddings) gets one gradient
 * product per use, summed: sum_t dot(x_t, dz_t) over a batch of 32 is 64
 * products of K = 32 for an RNN of 64 steps, each a library call that runs
 * at a fraction of the machine's speed, and the sum then reads 64 results in
 * one loop (the optimiser's update of such an RNN: 3.9 ms of an 11 ms step,
 * gathering 64 transposed results per element). One product of
 * dot(concat_t x_t, concat_t dz_t), K = 2048, is the same sum of the same
 * multiply-adds.
 *
 * The rule: an add tree (adds of one float type whose inner adds are used
 * only by the tree) whose terms include products of one form (dot_generals
 * with no batch dims, one contracted dim per operand, the same precision,
 * the same operand dtypes and the same dims but the contracted one, each used
 * only by the tree, each bare or under one transpose with the same
 * permutation) sums each such group as one product:
 *   dot(a_1, b_1) + ... + dot(a_n, b_n) -> dot(concat(a_i), concat(b_i))
 * (the products ordered by their operands' ids: group_members) and under a
 * transpose the transposed product. The other terms are added
 * after, in the tree's order. A group is merged only when its concatenated
 * operands hold no more elements than its n results do (which the plan
 * keeps alive for the sum): a forward pass's x W + h U at a small batch
 * would copy both weights every step to save one add. A group merges at
 * most MAX_MERGED products (a longer sum makes several).
 *
 * Exact in real arithmetic only: the products' terms are summed in another
 * order (as a library's blocking already sums them). Run by the compiling
 * backends only (the interpreter keeps the ops the program defines).
 *
 * Deliberately not here: batched products (attention heads), products with
 * several contracted dims, and sums through other ops (a sub, a convert).
 */
#include <stdlib.h>
#include <string.h>

#include "passes/passes.h"
#include "runtime/runtime.h"

/* The most products merged into one: a longer sum merges in groups of this
 * many. The compiled loops copy a concatenation of up to as many operands a
 * loop per operand (kir_lower.h MAX_CONCAT_PIECES); past that, each element
 * would pick its operand among all of them. */
#define MAX_MERGED 1024

/* A term of an add tree that is a product, perhaps under a transpose. */
typedef struct dot_term {
    const rfi_node *dot;       /* the DOT_GENERAL (in g) */
    const rfi_node *transpose; /* the TRANSPOSE over it, or NULL */
    int group;                 /* the term it merges with first (its own index: first) */
} dot_term;

/* A product of a merged group, with what orders it (group_members). */
typedef struct member_key {
    int later, other; /* its operands' ids, the larger first */
    int dot;          /* its index in dots[] */
} member_key;

typedef struct merger {
    const rfi_graph *g;
    rfi_graph *c;          /* the copy */
    rfi_node *const *map;  /* g's node id -> c's node (rfi_rewrite_graph's) */
    int *uses;             /* rfi_use_counts(g) */
    int *user;             /* the node using a node once, or -1 */
    const rfi_node **terms; /* scratch: a tree's terms (n_nodes) */
    const rfi_node **stack; /* scratch: collect_terms's (n_nodes + 1) */
    bool *expand;           /* scratch: whether a stacked node is an add of the tree */
    dot_term *dots;        /* scratch: its product terms (n_nodes) */
    int *members;          /* scratch: the terms of the group each first term leads */
    rfi_node **operands;   /* scratch: concatenation operands (n_nodes) */
    member_key *keys;      /* scratch: a group's products in concatenation order (n_nodes) */
} merger;

/* Whether x is an add used only by the add `tree_add`: part of its tree. */
static bool inner_add(const merger *m, const rfi_node *x, const rfi_node *tree_add)
{
    return x->op == RFI_OP_ADD && tree_add->op == RFI_OP_ADD && m->uses[x->id] == 1 &&
           m->user[x->id] == tree_add->id;
}

/* The terms of the add tree under `root` (g's nodes) into m->terms, left to
 * right; returns their count. Iterative (a sum of many terms is one long
 * chain of adds): an add's operands go on the stack right first, so the left
 * one comes off first, each marked whether it is an add of the tree. */
static int collect_terms(merger *m, const rfi_node *root)
{
    int n = 0, depth = 0;
    m->stack[depth] = root;
    m->expand[depth++] = true;
    while (depth > 0) {
        const rfi_node *x = m->stack[--depth];
        if (!m->expand[depth]) {
            m->terms[n++] = x;
            continue;
        }
        for (int k = 1; k >= 0; k--) {
            m->stack[depth] = x->in[k];
            m->expand[depth++] = inner_add(m, x->in[k], x);
        }
    }
    return n;
}

/* The product a term is, if it may merge: one contracted dim a side, no batch dims. */
static bool as_dot_term(const merger *m, const rfi_node *x, dot_term *t)
{
    t->transpose = NULL;
    if (x->op == RFI_OP_TRANSPOSE && m->uses[x->id] == 1) {
        t->transpose = x;
        x = x->in[0];
    }
    t->dot = x;
    const rfi_attrs *a = &x->attr;
    return x->op == RFI_OP_DOT_GENERAL && m->uses[x->id] == 1 && a->nl[0] == 0 &&
           a->nl[1] == 0 && a->nl[2] == 1 && a->nl[3] == 1;
}

/* Whether x and y have one rank, dtype and dims but dim `skip`. */
static bool same_but(const rfi_node *x, const rfi_node *y, int64_t skip)
{
    if (x->rank != y->rank || x->dtype != y->dtype)
        return false;
    for (int d = 0; d < x->rank; d++)
        if (d != skip && x->dims[d] != y->dims[d])
            return false;
    return true;
}

/* Whether two product terms have one form (they then concatenate). */
static bool same_form(const dot_term *s, const dot_term *t)
{
    const rfi_attrs *a = &s->dot->attr, *b = &t->dot->attr;
    if (a->i[0] != b->i[0] || a->l[2][0] != b->l[2][0] || a->l[3][0] != b->l[3][0] ||
        !same_but(s->dot->in[0], t->dot->in[0], a->l[2][0]) ||
        !same_but(s->dot->in[1], t->dot->in[1], a->l[3][0]) ||
        (s->transpose == NULL) != (t->transpose == NULL))
        return false;
    return !s->transpose || memcmp(s->transpose->attr.l[0], t->transpose->attr.l[0],
                                   sizeof(int64_t) * (size_t)s->transpose->rank) == 0;
}

/* Orders a group's products by their operand computed last (the larger
 * id), then by the other. */
static int later_operand_first(const void *a, const void *b)
{
    const member_key *x = a, *y = b;
    if (x->later != y->later)
        return x->later < y->later ? -1 : 1;
    return x->other < y->other ? -1 : x->other > y->other;
}

/* The products of group `first`, in the order their operands concatenate:
 * by the operand computed last, then the other (not the sum's order). Two
 * sums over a run of the same operands then concatenate it alike: an RNN's
 * input and hidden weight gradients both read its steps' output gradients,
 * all 64 and the last 63, and the plan stores the second concatenation in
 * the first's rows (memplan.c) instead of copying 1 MB. Returns the count. */
static int group_members(merger *m, int n_dots, int first)
{
    int n = 0;
    for (int i = first; i < n_dots; i++)
        if (m->dots[i].group == first) {
            int a = m->dots[i].dot->in[0]->id, b = m->dots[i].dot->in[1]->id;
            m->keys[n++] = (member_key){a > b ? a : b, a > b ? b : a, i};
        }
    qsort(m->keys, (size_t)n, sizeof *m->keys, later_operand_first);
    return n;
}

/* Operand k (0: lhs, 1: rhs) of the n products in m->keys concatenated
 * along their contracted dim, in c. */
static rfi_node *concatenation(merger *m, int n, int k)
{
    for (int i = 0; i < n; i++)
        m->operands[i] = m->map[m->dots[m->keys[i].dot].dot->in[k]->id];
    rfi_attrs at;
    memset(&at, 0, sizeof at);
    at.i[0] = m->dots[m->keys[0].dot].dot->attr.l[2 + k][0];
    return rfi_node_new(m->c, RFI_OP_CONCATENATE, m->operands, n, &at, RF_F32, NULL, 0);
}

/* The merged product of group `first`, in c (transposed as its terms were). */
static rfi_node *merged_product(merger *m, int n_dots, int first)
{
    const dot_term *t = &m->dots[first];
    int n = group_members(m, n_dots, first);
    rfi_node *in[2] = {concatenation(m, n, 0), concatenation(m, n, 1)};
    rfi_node *p = rfi_node_new(m->c, RFI_OP_DOT_GENERAL, in, 2, &t->dot->attr, RF_F32, NULL, 0);
    if (!p || !t->transpose)
        return p;
    return rfi_node_new(m->c, RFI_OP_TRANSPOSE, &p, 1, &t->transpose->attr, RF_F32, NULL, 0);
}

/* Whether group `first` is worth merging: two products at least, and their
 * concatenated operands no larger than their results. */
static bool worth_merging(const merger *m, int n_dots, int first)
{
    int64_t count = 0, operands = 0;
    for (int i = first; i < n_dots; i++)
        if (m->dots[i].group == first) {
            count++;
            operands += rfi_node_numel(m->dots[i].dot->in[0]) +
                        rfi_node_numel(m->dots[i].dot->in[1]);
        }
    return count >= 2 && operands <= count * rfi_node_numel(m->dots[first].dot);
}

/* sum + term in c (term alone when sum is NULL); NULL on error (c's status). */
static rfi_node *add(merger *m, rfi_node *sum, rfi_node *term)
{
    if (!sum || !term)
        return term;
    rfi_node *in[2] = {sum, term};
    return rfi_node_new(m->c, RFI_OP_ADD, in, 2, NULL, term->dtype, NULL, 0);
}

/* The tree rooted at `root` (an add no inner add of a larger tree), rewritten
 * in c; NULL when no group merges (the caller clones the add) or on error. */
static rfi_node *merge_tree(merger *m, const rfi_node *root)
{
    int n_terms = collect_terms(m, root), n_dots = 0;
    for (int i = 0; i < n_terms; i++) {
        dot_term t;
        if (!as_dot_term(m, m->terms[i], &t))
            continue;
        t.group = n_dots;
        m->members[n_dots] = 0;
        for (int j = 0; j < n_dots; j++)
            if (m->dots[j].group == j && m->members[j] < MAX_MERGED &&
                same_form(&m->dots[j], &t)) {
                t.group = j;
                break;
            }
        m->members[t.group]++;
        m->dots[n_dots++] = t;
    }
    bool any = false;
    for (int i = 0; i < n_dots; i++) {
        if (m->dots[i].group != i)
            continue;
        if (worth_merging(m, n_dots, i)) {
            any = true;
            continue;
        }
        for (int j = i; j < n_dots; j++) /* its terms stay as they are */
            if (m->dots[j].group == i)
                m->dots[j].group = -1;
    }
    if (!any)
        return NULL;
    rfi_node *sum = NULL;
    for (int i = 0; i < n_dots; i++)
        if (m->dots[i].group == i)
            sum = add(m, sum, merged_product(m, n_dots, i));
    /* the other terms in the tree's order (dots[] lists the product terms in it) */
    for (int i = 0, d = 0; i < n_terms; i++) {
        const dot_term *t = d < n_dots ? &m->dots[d] : NULL;
        bool is_dot = t && m->terms[i] == (t->transpose ? t->transpose : t->dot);
        if (!is_dot || t->group < 0)
            sum = add(m, sum, m->map[m->terms[i]->id]);
        d += is_dot;
    }
    return m->c->status == RF_OK ? sum : NULL;
}

bool rfi_merge_dots_enabled(void)
{
    const char *v = getenv("RF_MERGE_DOTS");
    return !(v && strcmp(v, "0") == 0);
}

/* user[id]: the node that uses node id as its only use, else -1. */
static void find_single_users(const rfi_graph *g, const int *uses, int *user)
{
    for (int id = 0; id < g->n_nodes; id++)
        user[id] = -1;
    for (int id = 0; id < g->n_nodes; id++) {
        const rfi_node *n = g->nodes[id];
        for (int k = 0; k < n->n_in; k++)
            if (uses[n->in[k]->id] == 1)
                user[n->in[k]->id] = id;
    }
}

/* rfi_rewrite_fn: a root of an add tree (an add that is no inner add of a
 * larger tree) through merge_tree; other nodes are copied. */
static rfi_node *merge_node(void *ctx, rfi_graph *c, const rfi_node *x, rfi_node *const *in,
                            rfi_node *const *map)
{
    (void)in;
    merger *m = ctx;
    m->c = c;
    m->map = map;
    int user = m->user[x->id];
    bool root = x->op == RFI_OP_ADD && rfi_dtype_is_float(x->dtype) &&
                !(user >= 0 && inner_add(m, x, m->g->nodes[user]));
    return root ? merge_tree(m, x) : NULL;
}

rf_status rfi_merge_dots(const rfi_graph *g, rfi_graph **out)
{
    if (!out || !g)
        return rfi_error(RF_E_INVALID, "merge_dots: NULL %s", g ? "output pointer" : "graph");
    *out = NULL;
    size_t n = g->n_nodes > 0 ? (size_t)g->n_nodes : 1;
    merger m = {g,
                NULL,
                NULL,
                rfi_use_counts(g),
                rfi_calloc(n, sizeof *m.user),
                rfi_calloc(n, sizeof *m.terms),
                rfi_calloc(n + 1, sizeof *m.stack),
                rfi_calloc(n + 1, sizeof *m.expand),
                rfi_calloc(n, sizeof *m.dots),
                rfi_calloc(n, sizeof *m.members),
                rfi_calloc(n, sizeof *m.operands),
                rfi_calloc(n, sizeof *m.keys)};
    rf_status st = m.uses && m.user && m.terms && m.stack && m.expand && m.dots && m.members &&
                           m.operands && m.keys
                       ? RF_OK
                       : rfi_error(RF_E_NOMEM, "merge_dots: out of memory");
    if (st == RF_OK) {
        find_single_users(g, m.uses, m.user);
        st = rfi_rewrite_graph(g, "merge_dots", rfi_merge_dots_enabled() ? merge_node : NULL, &m,
                               out);
    }
    rfi_free(m.uses);
    rfi_free(m.user);
    rfi_free(m.terms);
    rfi_free(m.stack);
    rfi_free(m.expand);
    rfi_free(m.dots);
    rfi_free(m.members);
    rfi_free(m.operands);
    rfi_free(m.keys);
    return st;
}
