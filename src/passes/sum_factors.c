/* sum_factors.c: factors that do not vary along a sum's reduced axes taken
 * out of the sum (rfi_sum_factors).
 *
 * Why: BatchNorm's backward pass sums, per channel, the output gradient g
 * and g times the normalised input, but autodiff writes those sums with the
 * per-channel scale, inverse deviation and their product inside:
 *   sum(g * (xc * r)),  sum((g * gamma) * xc),  sum(-((g * gamma) * r)),  sum(g)
 * (xc = x - mean, r = 1 / sqrt(var + eps), both per channel but xc). Those
 * are two sums, sum(g * xc) and sum(g), times per-channel values. Taken out,
 * the sums that remain are equal and CSE makes them one, so the step that
 * folds a ResNet layer's [128,16,28,28] gradient folds two values a point
 * instead of four, each with a product fewer.
 *
 * The rule: a float sum s = reduce(p) over axes A, where p is a product (mul
 * and neg, of s's operand's shape) whose factors include at least one that
 * is constant along A (a broadcast_in_dim whose operand's dims of extent
 * above 1 map to no axis of A: a per-channel vector, a scalar) and at least
 * one that is not, and where another float sum over A has the same varying
 * factors (so that the two merge), becomes
 *   kept * reduce(varying)      (negated when p had an odd count of negs)
 * with the varying factors multiplied in the order of their ids (so that
 * equal sums are built alike and CSE merges them; the other sum, kept
 * factors or not, is rebuilt so too) and the kept ones, each
 * reshaped and broadcast to s's shape, multiplied in that order too. Exact
 * in real arithmetic only: each term's products are rounded in another order,
 * and the kept factors multiply the sum once instead of each term (which
 * also differs where a kept factor is infinite and a term zero). Run by the
 * compiling backend only (the interpreter keeps the ops the program
 * defines), followed by CSE.
 *
 * Deliberately not here: sums of integers (the products would wrap at
 * other points), other reductions (max of c * x is not c * max x for c < 0),
 * factors under other ops (a sum of (a + b) * c would need distributing),
 * sums whose product has only varying factors (nothing to take out), and
 * sums that would merge with no other (a loss's mean scale taken out of its
 * gradient's sum only moves a multiply into a step of its own).
 */
#include <stdlib.h>
#include <string.h>

#include "passes/passes.h"
#include "runtime/runtime.h"

enum { MOST_FACTORS = 16, MOST_DEPTH = 8 };

typedef struct product {
    const rfi_node *factor[MOST_FACTORS]; /* of the old graph */
    bool kept[MOST_FACTORS];              /* constant along the sum's axes */
    int n;
    bool negated;
} product;

static bool is_reduced(const rfi_node *s, int axis)
{
    for (int k = 0; k < s->attr.nl[0]; k++)
        if (s->attr.l[0][k] == axis)
            return true;
    return false;
}

/* Whether factor f of sum s's operand is constant along s's axes: a
 * broadcast whose operand's dims above 1 map to kept axes. */
static bool constant_along(const rfi_node *s, const rfi_node *f)
{
    if (f->op != RFI_OP_BROADCAST_IN_DIM)
        return false;
    const rfi_node *c = f->in[0];
    for (int i = 0; i < c->rank; i++)
        if (c->dims[i] > 1 && is_reduced(s, (int)f->attr.l[0][i]))
            return false;
    return true;
}

/* Collects the factors of x (mul and neg of x's type, at most MOST_DEPTH
 * deep); false when there are more than MOST_FACTORS. */
static bool gather(const rfi_node *s, const rfi_node *x, product *p, int depth)
{
    const rfi_node *top = s->in[0];
    bool same = x->dtype == top->dtype && rfi_node_same_dims(x, top);
    if (same && depth < MOST_DEPTH && x->op == RFI_OP_MUL)
        return gather(s, x->in[0], p, depth + 1) && gather(s, x->in[1], p, depth + 1);
    if (same && depth < MOST_DEPTH && x->op == RFI_OP_NEG) {
        p->negated = !p->negated;
        return gather(s, x->in[0], p, depth + 1);
    }
    if (p->n == MOST_FACTORS)
        return false;
    p->kept[p->n] = constant_along(s, x);
    p->factor[p->n++] = x;
    return true;
}

/* The factors of float sum s's product, or false (not such a sum, or too
 * many factors). */
static bool sum_product(const rfi_node *s, product *p)
{
    memset(p, 0, sizeof *p);
    return s->op == RFI_OP_REDUCE && s->attr.i[0] == RF_REDUCE_SUM && s->n_in == 1 &&
           rfi_dtype_is_float(s->dtype) && gather(s, s->in[0], p, 0);
}

static int count_kept(const product *p)
{
    int kept = 0;
    for (int k = 0; k < p->n; k++)
        kept += p->kept[k];
    return kept;
}

/* Orders nodes by id (qsort over node pointers). */
static int compare_ids(const void *a, const void *b)
{
    int x = (*(const rfi_node *const *)a)->id, y = (*(const rfi_node *const *)b)->id;
    return (x > y) - (x < y);
}

/* A sum's varying factors (ids, sorted) and axes: sums with equal
 * signatures merge once their kept factors are out. */
typedef struct signature {
    const rfi_node *sum;
    bool has_kept; /* the sum also has factors constant along its axes */
    int n, ids[MOST_FACTORS];
} signature;

static bool same_signature(const signature *a, const signature *b)
{
    const rfi_attrs *x = &a->sum->attr, *y = &b->sum->attr;
    if (a->n != b->n || a->sum->dtype != b->sum->dtype || x->nl[0] != y->nl[0] ||
        !rfi_node_same_dims(a->sum->in[0], b->sum->in[0]))
        return false;
    for (int k = 0; k < x->nl[0]; k++)
        if (x->l[0][k] != y->l[0][k])
            return false;
    return memcmp(a->ids, b->ids, (size_t)a->n * sizeof a->ids[0]) == 0;
}

static void sign(const rfi_node *s, const product *p, signature *out)
{
    const rfi_node *varying[MOST_FACTORS];
    out->sum = s;
    out->has_kept = count_kept(p) > 0;
    out->n = 0;
    for (int k = 0; k < p->n; k++)
        if (!p->kept[k])
            varying[out->n++] = p->factor[k];
    qsort(varying, (size_t)out->n, sizeof *varying, compare_ids);
    for (int k = 0; k < out->n; k++)
        out->ids[k] = varying[k]->id;
}

typedef struct factoring {
    signature *sigs; /* of every float sum with a varying factor */
    int n_sigs;
    bool *merges; /* by node id: a sum whose signature matches another's, one with kept factors */
} factoring;

/* Finds the sums the rule rewrites (factoring.merges). */
static bool find_merging_sums(const rfi_graph *g, factoring *f)
{
    f->sigs = rfi_calloc((size_t)g->n_nodes + 1, sizeof *f->sigs);
    f->merges = rfi_calloc((size_t)g->n_nodes + 1, sizeof *f->merges);
    if (!f->sigs || !f->merges)
        return false;
    for (int id = 0; id < g->n_nodes; id++) {
        product p;
        if (sum_product(g->nodes[id], &p) && count_kept(&p) < p.n)
            sign(g->nodes[id], &p, &f->sigs[f->n_sigs++]);
    }
    for (int i = 0; i < f->n_sigs; i++) {
        if (!f->sigs[i].has_kept)
            continue;
        for (int j = 0; j < f->n_sigs; j++)
            if (j != i && same_signature(&f->sigs[i], &f->sigs[j]))
                f->merges[f->sigs[i].sum->id] = f->merges[f->sigs[j].sum->id] = true;
    }
    return true;
}

/* a * b in c, or b when a is NULL (a product's first factor); NULL on failure. */
static rfi_node *mul(rfi_graph *c, rfi_node *a, rfi_node *b)
{
    if (!a)
        return b;
    rfi_node *in[2] = {a, b};
    return b ? rfi_node_new(c, RFI_OP_MUL, in, 2, NULL, b->dtype, NULL, 0) : NULL;
}

/* Kept factor f (a broadcast of v; map: the copies) as a value of s's shape:
 * v without its dims that map to reduced axes (all of extent 1), broadcast
 * to s's dims. */
static rfi_node *at_sum_shape(rfi_graph *c, const rfi_node *s, const rfi_node *f,
                              rfi_node *const *map)
{
    const rfi_node *v = f->in[0];
    int64_t dims[RF_MAX_RANK];
    rfi_attrs a;
    memset(&a, 0, sizeof a);
    int rank = 0;
    for (int i = 0; i < v->rank; i++) {
        int axis = (int)f->attr.l[0][i], before = 0;
        if (is_reduced(s, axis))
            continue;
        for (int r = 0; r < axis; r++)
            before += is_reduced(s, r);
        dims[rank] = v->dims[i];
        a.l[0][rank++] = axis - before;
    }
    a.nl[0] = rank;
    rfi_node *kept = map[v->id];
    if (rank != v->rank)
        kept = rfi_node_new(c, RFI_OP_RESHAPE, &kept, 1, NULL, v->dtype, dims, rank);
    if (!kept || rfi_node_same_dims(kept, s))
        return kept;
    return rfi_node_new(c, RFI_OP_BROADCAST_IN_DIM, &kept, 1, &a, v->dtype, s->dims, s->rank);
}

/* rfi_rewrite_fn: such a sum as kept * reduce(varying); other nodes copied. */
static rfi_node *rewrite_sum(void *ctx, rfi_graph *c, const rfi_node *s, rfi_node *const *in,
                             rfi_node *const *map)
{
    (void)in;
    const factoring *f = ctx;
    product p;
    if (!f->merges[s->id] || !sum_product(s, &p))
        return NULL;
    const rfi_node *varying[MOST_FACTORS], *kept[MOST_FACTORS];
    int n_varying = 0, n_kept = 0;
    for (int k = 0; k < p.n; k++) {
        if (p.kept[k])
            kept[n_kept++] = p.factor[k];
        else
            varying[n_varying++] = p.factor[k];
    }
    qsort(varying, (size_t)n_varying, sizeof *varying, compare_ids);
    qsort(kept, (size_t)n_kept, sizeof *kept, compare_ids);
    rfi_node *terms = NULL, *scale = NULL;
    for (int k = 0; k < n_varying; k++)
        if (!(terms = mul(c, terms, map[varying[k]->id])))
            return NULL;
    rfi_node *sum = rfi_node_new(c, RFI_OP_REDUCE, &terms, 1, &s->attr, s->dtype, NULL, 0);
    for (int k = 0; k < n_kept && sum; k++)
        if (!(scale = mul(c, scale, at_sum_shape(c, s, kept[k], map))))
            return NULL;
    rfi_node *r = sum && scale ? mul(c, scale, sum) : sum;
    return r && p.negated ? rfi_node_new(c, RFI_OP_NEG, &r, 1, NULL, r->dtype, NULL, 0) : r;
}

bool rfi_sum_factors_enabled(void)
{
    const char *v = getenv("RF_SUM_FACTORS");
    return !(v && strcmp(v, "0") == 0);
}

rf_status rfi_sum_factors(const rfi_graph *g, rfi_graph **out)
{
    if (!out || !g)
        return rfi_error(RF_E_INVALID, "sum_factors: NULL %s", g ? "output pointer" : "graph");
    *out = NULL;
    factoring f = {NULL, 0, NULL};
    rf_status st = RF_OK;
    bool on = rfi_sum_factors_enabled();
    if (on && !find_merging_sums(g, &f))
        st = rfi_error(RF_E_NOMEM, "sum_factors: out of memory");
    if (st == RF_OK)
        st = rfi_rewrite_graph(g, "sum_factors", on ? rewrite_sum : NULL, &f, out);
    rfi_free(f.sigs);
    rfi_free(f.merges);
    return st;
}
