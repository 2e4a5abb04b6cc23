/* stack_dots.c: small matrix products of one right operand, whose left
 * operands do not depend on one another's results, become one product of
 * the left operands stacked along their rows; each result is a block of its
 * rows (rfi_stack_dots).
 *
 * Why: an RNN's input projection x_t W over 64 time steps is 64 products of
 * [32,64] x [64,128], each a library call on one thread at half its speed
 * and the library's per-call overhead (6.9 us each on the 2-core Intel
 * machine); stacked, it is one [2048,64] x [64,128] product on every
 * thread, and each step reads its 32 rows of the result.
 *
 * The rule: products (dot_generals with no batch dims, one contracted dim a
 * side, a rank-2 left operand contracted along its dim 1, so that its rows
 * are the result's) of fewer than STACK_MAX_MACS multiply-adds with the same
 * right operand node, contracted dim, precision and dtypes form a group led
 * by the first in SSA order. A later one joins the first group whose leader
 * it can stand beside: its left operand comes before the leader, or is a
 * layout op (slice, reshape, transpose, broadcast, convert) of a value that
 * does, built once more there (the copy where it stood dies).
 * Either way it cannot depend on a product of the group. A group of two or
 * more becomes
 *   s = dot(concatenate(a_1, .., a_n, axis 0), b),  product i = rows r_i.. of s
 * the products in SSA order; or, where the left operands are all the column
 * blocks of one matrix X [M, T K], each once (an RNN's input [batch, steps *
 * features] cut into its steps), with no copy:
 *   s = reshape(dot(reshape(X, [M T, K]), b), [M, T N]),
 *   the product of block j = columns [j N, (j + 1) N) of s.
 *
 * Exact: each result element is the same sum of the same products (a
 * library may block the sum another way for another row count).
 * Run by the compiling backends only (the interpreter keeps the ops the
 * program defines).
 *
 * Deliberately not here: products whose left operands depend on the group
 * (a recurrence's hidden projection: a chain), larger products (on every
 * thread already, and the stacked result would keep every result alive until
 * the last is read), batched products.
 */
#include <stdlib.h>
#include <string.h>

#include "passes/passes.h"
#include "runtime/runtime.h"

/* Products below this many multiply-adds gain from stacking: a library runs
 * them on one thread (cpu/services.c SMALL_MATMUL_MACS), where the call's
 * own overhead is a good part of the time. */
#define STACK_MAX_MACS 2000000
/* The most products stacked into one: a concatenation of more operands would
 * pick its operand per element (merge_dots.c's MAX_MERGED). */
#define MAX_STACKED 1024

typedef struct stacker {
    const rfi_graph *g;
    int *leader;         /* per node: the leader of its group, or -1 (not a product) */
    int *next;           /* per product: the next of its group, or -1 */
    int *tail;           /* per leader: the last of its group so far */
    int *count;          /* per leader: the products of its group */
    int64_t *row;        /* per product: its first row in the stacked operand */
    int *first_leader;   /* per right operand: the first leader using it, or -1 */
    int *next_leader;    /* per leader: the next leader of the same right operand, or -1 */
    rfi_node **stacked;  /* per leader: the stacked product in the copy */
    bool *tiled;         /* per leader: built from a matrix's column blocks (build_stack) */
    rfi_node **operands; /* scratch: a group's left operands in the copy */
} stacker;

/* Whether x is a product that may stack. */
static bool stackable(const rfi_node *x)
{
    if (x->op != RFI_OP_DOT_GENERAL)
        return false;
    const rfi_attrs *a = &x->attr;
    return a->nl[0] == 0 && a->nl[1] == 0 && a->nl[2] == 1 && a->nl[3] == 1 &&
           x->in[0]->rank == 2 && a->l[2][0] == 1 && x->in[1]->rank == 2 &&
           rfi_dot_macs(x) < STACK_MAX_MACS;
}

/* Whether stackable products x and y share their right operand and form. */
static bool same_form(const rfi_node *x, const rfi_node *y)
{
    return x->in[1] == y->in[1] && x->attr.l[3][0] == y->attr.l[3][0] &&
           x->attr.i[0] == y->attr.i[0] && x->dtype == y->dtype &&
           x->in[0]->dtype == y->in[0]->dtype;
}

static bool layout_op(rfi_op op)
{
    return op == RFI_OP_SLICE || op == RFI_OP_RESHAPE || op == RFI_OP_TRANSPOSE ||
           op == RFI_OP_BROADCAST_IN_DIM || op == RFI_OP_CONVERT;
}

/* Whether left operand a can be had where the product `leader` stands. */
static bool ready_at(const rfi_node *a, int leader)
{
    return a->id < leader || (layout_op(a->op) && a->n_in == 1 && a->in[0]->id < leader);
}

/* Assigns the products of g to groups (s->leader, next, tail, count, row). */
static void find_groups(stacker *s)
{
    const rfi_graph *g = s->g;
    for (int id = 0; id < g->n_nodes; id++)
        s->leader[id] = s->next[id] = s->first_leader[id] = s->next_leader[id] = -1;
    for (int id = 0; id < g->n_nodes; id++) {
        const rfi_node *x = g->nodes[id];
        if (!stackable(x))
            continue;
        int lead = -1, *link = &s->first_leader[x->in[1]->id];
        for (; *link >= 0 && lead < 0; link = &s->next_leader[*link])
            if (s->count[*link] < MAX_STACKED && same_form(g->nodes[*link], x) &&
                ready_at(x->in[0], *link))
                lead = *link;
        if (lead < 0) { /* leads a group of its own: *link ends the list of its weight */
            *link = lead = s->tail[id] = id;
            s->row[id] = 0;
        } else {
            int last = s->tail[lead];
            s->row[id] = s->row[last] + g->nodes[last]->dims[0];
            s->next[last] = id;
            s->tail[lead] = id;
        }
        s->leader[id] = lead;
        s->count[lead]++;
    }
}

/* j when left operand a is all the rows and columns [j K, (j + 1) K) of a
 * matrix of T K columns (K: a's columns); else -1. */
static int64_t column_block(const rfi_node *a)
{
    if (a->op != RFI_OP_SLICE)
        return -1;
    const rfi_node *m = a->in[0];
    const rfi_attrs *at = &a->attr;
    int64_t k = a->dims[1];
    if (m->rank != 2 || k == 0 || at->l[0][0] != 0 || at->l[1][0] != m->dims[0] ||
        at->l[2][0] != 1 || at->l[2][1] != 1 || at->l[0][1] % k != 0 || m->dims[1] % k != 0)
        return -1;
    return at->l[0][1] / k;
}

/* The matrix whose column blocks the group led by x takes, each once and all
 * of them (an RNN's input [batch, steps * features] cut into its steps), or
 * NULL. Its rows of T blocks are then the group's left operands stacked,
 * each row's blocks one after the other: a reshape, no copy. */
static const rfi_node *tiled_matrix(const stacker *s, const rfi_node *x)
{
    if (column_block(x->in[0]) < 0)
        return NULL;
    const rfi_node *m = x->in[0]->in[0];
    if (m->dims[1] / x->in[0]->dims[1] != s->count[x->id])
        return NULL;
    uint64_t seen[MAX_STACKED / 64] = {0}; /* the blocks taken, by bits */
    for (int id = x->id; id >= 0; id = s->next[id]) {
        const rfi_node *a = s->g->nodes[id]->in[0];
        int64_t j = column_block(a);
        if (j < 0 || a->in[0] != m || a->dims[1] != x->in[0]->dims[1] ||
            seen[j / 64] >> (j % 64) & 1)
            return NULL;
        seen[j / 64] |= (uint64_t)1 << (j % 64);
    }
    return m;
}

/* The left operands of the group led by x stacked along their rows, in c. */
static rfi_node *stacked_rows(stacker *s, rfi_graph *c, const rfi_node *x, rfi_node *const *map)
{
    int n = 0;
    for (int id = x->id; id >= 0; id = s->next[id]) {
        const rfi_node *a = s->g->nodes[id]->in[0];
        if (a->id < x->id) {
            s->operands[n++] = map[a->id];
            continue;
        }
        rfi_node *operand = map[a->in[0]->id]; /* ready_at: a layout op of one operand */
        s->operands[n++] = rfi_node_clone(c, a, &operand);
    }
    rfi_attrs at;
    memset(&at, 0, sizeof at); /* axis 0 */
    return rfi_node_new(c, RFI_OP_CONCATENATE, s->operands, n, &at, x->in[0]->dtype, NULL, 0);
}

static rfi_node *reshaped(rfi_graph *c, rfi_node *v, int64_t rows, int64_t cols)
{
    int64_t dims[2] = {rows, cols};
    return rfi_node_new(c, RFI_OP_RESHAPE, &v, 1, NULL, v ? v->dtype : RF_F32, dims, 2);
}

/* Builds the stacked product of the group led by x in c, at x's place: rows
 * of its results one after the other, or, where the group tiles a matrix's
 * columns (tiled_matrix), that matrix's shape with the results' columns one
 * after the other (s->tiled). */
static rfi_node *build_stack(stacker *s, rfi_graph *c, const rfi_node *x, rfi_node *const *map)
{
    const rfi_node *m = tiled_matrix(s, x);
    int64_t k = x->in[0]->dims[1], n = x->dims[1];
    rfi_node *rows = m ? reshaped(c, map[m->id], m->dims[0] * (m->dims[1] / k), k)
                       : stacked_rows(s, c, x, map);
    rfi_node *in[2] = {rows, map[x->in[1]->id]};
    rfi_node *p = rfi_node_new(c, RFI_OP_DOT_GENERAL, in, 2, &x->attr, x->dtype, NULL, 0);
    s->tiled[x->id] = m != NULL;
    return m ? reshaped(c, p, m->dims[0], m->dims[1] / k * n) : p;
}

/* Rows [r0, r0 + x's rows) and columns [c0, c0 + x's columns) of the stacked
 * product: x's result. */
static rfi_node *result_of(rfi_graph *c, rfi_node *stacked, int64_t r0, int64_t c0,
                           const rfi_node *x)
{
    rfi_attrs a;
    memset(&a, 0, sizeof a);
    a.nl[0] = a.nl[1] = a.nl[2] = 2;
    a.l[0][0] = r0;
    a.l[0][1] = c0;
    a.l[1][0] = r0 + x->dims[0];
    a.l[1][1] = c0 + x->dims[1];
    a.l[2][0] = a.l[2][1] = 1;
    return rfi_node_new(c, RFI_OP_SLICE, &stacked, 1, &a, x->dtype, NULL, 0);
}

/* rfi_rewrite_fn: a product of a group of two or more becomes its rows of the
 * group's stacked product (built at its leader); other nodes are copied. */
static rfi_node *stack_node(void *ctx, rfi_graph *c, const rfi_node *x, rfi_node *const *in,
                            rfi_node *const *map)
{
    (void)in;
    stacker *s = ctx;
    int lead = s->leader[x->id];
    if (lead < 0 || s->count[lead] < 2)
        return NULL;
    if (lead == x->id)
        s->stacked[lead] = build_stack(s, c, x, map);
    if (!s->stacked[lead])
        return NULL; /* c's status says why */
    if (s->tiled[lead])
        return result_of(c, s->stacked[lead], 0, column_block(x->in[0]) * x->dims[1], x);
    return result_of(c, s->stacked[lead], s->row[x->id], 0, x);
}

bool rfi_stack_dots_enabled(void)
{
    const char *v = getenv("RF_STACK_DOTS");
    return !(v && strcmp(v, "0") == 0);
}

rf_status rfi_stack_dots(const rfi_graph *g, rfi_graph **out)
{
    if (!out || !g)
        return rfi_error(RF_E_INVALID, "stack_dots: NULL %s", g ? "output pointer" : "graph");
    *out = NULL;
    size_t n = g->n_nodes > 0 ? (size_t)g->n_nodes : 1;
    stacker s = {g,
                 rfi_calloc(n, sizeof *s.leader),
                 rfi_calloc(n, sizeof *s.next),
                 rfi_calloc(n, sizeof *s.tail),
                 rfi_calloc(n, sizeof *s.count),
                 rfi_calloc(n, sizeof *s.row),
                 rfi_calloc(n, sizeof *s.first_leader),
                 rfi_calloc(n, sizeof *s.next_leader),
                 rfi_calloc(n, sizeof *s.stacked),
                 rfi_calloc(n, sizeof *s.tiled),
                 rfi_calloc(n, sizeof *s.operands)};
    rf_status st = s.leader && s.next && s.tail && s.count && s.row && s.first_leader &&
                           s.next_leader && s.stacked && s.tiled && s.operands
                       ? RF_OK
                       : rfi_error(RF_E_NOMEM, "stack_dots: out of memory");
    if (st == RF_OK) {
        find_groups(&s);
        st = rfi_rewrite_graph(g, "stack_dots", rfi_stack_dots_enabled() ? stack_node : NULL, &s,
                               out);
    }
    rfi_free(s.leader);
    rfi_free(s.next);
    rfi_free(s.tail);
    rfi_free(s.count);
    rfi_free(s.row);
    rfi_free(s.first_leader);
    rfi_free(s.next_leader);
    rfi_free(s.stacked);
    rfi_free(s.tiled);
    rfi_free(s.operands);
    return st;
}
