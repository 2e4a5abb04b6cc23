/* moments.c: a variance and the mean it is taken about, both from one pass
 * over the data (rfi_one_pass_moments).
 *
 * Why: rf_var computes sum((x - m)^2) with m = sum(x) / n, so a batch
 * normalisation reads its input twice before it can normalise it: once for
 * the sum, once for the squared deviations from the mean that sum gives.
 * Each read of a ResNet's [128,16,28,28] activations costs ~170 us of a
 * ~36 ms training step, and the second read is not needed: the first and
 * second moments about any shift K fold side by side in one pass,
 *   s1 = sum(x - K),   s2 = sum((x - K)^2),
 *   sum(x) = s1 + n K,   sum((x - m)^2) = s2 - s1^2 / n,
 * and the plan makes s1 and s2 one REDUCE step (sibling folds).
 *
 * Numerics: the textbook one-pass formula cancels catastrophically when the
 * mean is large against the spread. Two things keep this rewrite at least
 * as accurate as the two-pass f32 program it replaces: the sums are taken
 * in f64 on the data converted exactly, and K is the first element of each
 * reduced slice (x at index 0 along every reduced axis), so s1 and s2 are
 * moments about a point of the data itself: the cancellation loses about
 * (m - K)^2 / var of f64's 2^-53, where a spread of f32 data can be resolved
 * at all only while (m - K)^2 / var stays far below 2^48. The difference is
 * clamped at zero (a variance is never negative; rsqrt(var + eps) must not
 * see a rounding below zero).
 *
 * The rule: a float sum V = reduce(mul(d, d)) with d = sub(x, b), x f32, b a
 * broadcast of div(S, n) (S perhaps reshaped, the div perhaps under a
 * stop_gradient) where S = reduce(x) is a sum over V's axes, n is a splat of
 * the number of points each sum folds, and b puts S's element of each kept
 * point at that point. Then S becomes f32(s1 + n K) and V f32(max(s2 -
 * s1^2 / n, 0)); d, b and the mean keep their other users (the normalised
 * values, the gradient). Exact in real arithmetic only. Run by the compiling
 * backend only (the interpreter keeps the ops the program defines).
 *
 * Deliberately not here: f64 data (the two-pass sums are the precise ones
 * there, and no wider type holds the one-pass sums), sums over no points
 * (no first point; 0 / 0 stays NaN as written), and means taken with other
 * ops (a mul by 1/n, a sum divided later).
 */
#include <stdlib.h>
#include <string.h>

#include "passes/passes.h"
#include "runtime/runtime.h"

typedef struct moments {
    const rfi_graph *g;
    int *variance_of; /* by S's id: the id of the V taken about its mean, else -1 */
    int *sum_of;      /* by V's id: the id of its S, else -1 */
    rfi_node **s1;    /* by S's id, in the copy: sum(x - K), f64 */
    rfi_node **s2;    /* by S's id, in the copy: sum((x - K)^2), f64 */
} moments;

static const rfi_node *skip_stop_gradient(const rfi_node *x)
{
    return x->op == RFI_OP_STOP_GRADIENT ? x->in[0] : x;
}

/* Whether x is a splat (a rank-0 constant or its broadcast) of count in x's dtype. */
static bool splat_of_count(const rfi_node *x, int64_t count)
{
    x = rfi_splat_scalar(x);
    if (!x || !x->attr.data || (x->dtype != RF_F32 && x->dtype != RF_F64))
        return false;
    double v = rfi_element_as_double(x->dtype, x->attr.data, 0);
    double want = x->dtype == RF_F32 ? (double)(float)count : (double)count;
    return v == want;
}

static bool is_float_sum(const rfi_node *x)
{
    return x->op == RFI_OP_REDUCE && x->attr.i[0] == RF_REDUCE_SUM && x->dtype == RF_F32;
}

/* Whether s's reduced axes are a's. */
static bool same_axes(const rfi_node *s, const rfi_node *a)
{
    return s->attr.nl[0] == a->attr.nl[0] &&
           memcmp(s->attr.l[0], a->attr.l[0], sizeof(int64_t) * (size_t)s->attr.nl[0]) == 0;
}

static bool is_reduced(const rfi_node *s, int axis)
{
    for (int k = 0; k < s->attr.nl[0]; k++)
        if (s->attr.l[0][k] == axis)
            return true;
    return false;
}

/* The points each of s's sums folds. */
static int64_t points_per_sum(const rfi_node *s)
{
    int64_t count = 1;
    for (int k = 0; k < s->attr.nl[0]; k++)
        count *= s->in[0]->dims[s->attr.l[0][k]];
    return count;
}

/* Whether broadcast b of m (S's elements, perhaps reshaped) gives every point
 * of x the element of S at its kept coordinates: m's dims other than 1 are
 * S's in order (a reshape that only adds or drops dims of 1 keeps the order of
 * the elements), and b maps them to x's kept axes of size > 1 in order. */
static bool broadcasts_kept_points(const rfi_node *b, const rfi_node *m, const rfi_node *s)
{
    const rfi_node *x = s->in[0];
    int j = 0;
    for (int axis = 0; axis < x->rank; axis++) {
        if (is_reduced(s, axis) || x->dims[axis] == 1)
            continue;
        while (j < m->rank && m->dims[j] == 1)
            j++;
        if (j == m->rank || b->attr.l[0][j] != axis || m->dims[j] != x->dims[axis])
            return false;
        j++;
    }
    while (j < m->rank && m->dims[j] == 1)
        j++;
    return j == m->rank;
}

/* The sum S whose mean b broadcasts over x (see the rule), or NULL. */
static const rfi_node *mean_sum(const rfi_node *b, const rfi_node *x)
{
    if (b->op != RFI_OP_BROADCAST_IN_DIM || !rfi_node_same_dims(b, x))
        return NULL;
    const rfi_node *m = skip_stop_gradient(b->in[0]);
    if (m->op != RFI_OP_DIV || m->dtype != RF_F32)
        return NULL;
    const rfi_node *s = m->in[0]->op == RFI_OP_RESHAPE ? m->in[0]->in[0] : m->in[0];
    /* (an empty sum has no first point to shift by: its mean stays 0 / 0) */
    if (!is_float_sum(s) || s->in[0] != x || points_per_sum(s) == 0 ||
        !splat_of_count(m->in[1], points_per_sum(s)) ||
        !broadcasts_kept_points(b, m, s))
        return NULL;
    return s;
}

/* The sum S whose mean v's squared deviations are taken about, or NULL. */
static const rfi_node *variance_sum(const rfi_node *v)
{
    if (!is_float_sum(v))
        return NULL;
    const rfi_node *p = v->in[0];
    if (p->op != RFI_OP_MUL || p->in[0] != p->in[1] || p->in[0]->op != RFI_OP_SUB)
        return NULL;
    const rfi_node *d = p->in[0], *x = d->in[0];
    const rfi_node *s = mean_sum(d->in[1], x);
    return s && same_axes(s, v) ? s : NULL;
}

static rfi_node *unary(rfi_graph *c, rfi_op op, rfi_node *x, rf_dtype dt)
{
    return rfi_node_new(c, op, &x, 1, NULL, dt, NULL, 0);
}

static rfi_node *binary(rfi_graph *c, rfi_op op, rfi_node *a, rfi_node *b)
{
    rfi_node *in[2] = {a, b};
    return a && b ? rfi_node_new(c, op, in, 2, NULL, a->dtype, NULL, 0) : NULL;
}

/* An f64 splat of v over like's dims, in c. */
static rfi_node *splat_f64(rfi_graph *c, double v, const rfi_node *like)
{
    rfi_attrs a;
    memset(&a, 0, sizeof a);
    a.data = &v;
    a.nbytes = sizeof v;
    rfi_node *scalar = rfi_node_new(c, RFI_OP_CONSTANT, NULL, 0, &a, RF_F64, NULL, 0);
    if (!scalar || !like || like->rank == 0)
        return scalar;
    memset(&a, 0, sizeof a); /* empty map: a rank-0 operand */
    return rfi_node_new(c, RFI_OP_BROADCAST_IN_DIM, &scalar, 1, &a, RF_F64, like->dims,
                        like->rank);
}

/* The shift K of sum s over x (c's copy of s's operand): x at index 0 along
 * every reduced axis, in f64, with x's rank (reduced dims 1). */
static rfi_node *shift(rfi_graph *c, const rfi_node *s, rfi_node *x)
{
    rfi_attrs a;
    memset(&a, 0, sizeof a);
    for (int k = 0; k < 3; k++)
        a.nl[k] = x->rank;
    for (int axis = 0; axis < x->rank; axis++) {
        a.l[1][axis] = is_reduced(s, axis) ? 1 : x->dims[axis];
        a.l[2][axis] = 1;
    }
    rfi_node *first = rfi_node_new(c, RFI_OP_SLICE, &x, 1, &a, x->dtype, NULL, 0);
    return first ? unary(c, RFI_OP_CONVERT, first, RF_F64) : NULL;
}

/* S (s, whose operand's copy is x) as f32(s1 + n K), recording s1 and s2. */
static rfi_node *rewrite_sum(moments *mo, rfi_graph *c, const rfi_node *s, rfi_node *x)
{
    rfi_node *k = shift(c, s, x);
    if (!k)
        return NULL;
    rfi_attrs a;
    memset(&a, 0, sizeof a);
    a.nl[0] = x->rank;
    for (int axis = 0; axis < x->rank; axis++)
        a.l[0][axis] = axis;
    rfi_node *spread = rfi_node_new(c, RFI_OP_BROADCAST_IN_DIM, &k, 1, &a, RF_F64, x->dims,
                                    x->rank);
    rfi_node *d = binary(c, RFI_OP_SUB, unary(c, RFI_OP_CONVERT, x, RF_F64), spread);
    rfi_node *s1 = d ? rfi_node_new(c, RFI_OP_REDUCE, &d, 1, &s->attr, RF_F64, NULL, 0) : NULL;
    rfi_node *sq = binary(c, RFI_OP_MUL, d, d);
    rfi_node *s2 = sq ? rfi_node_new(c, RFI_OP_REDUCE, &sq, 1, &s->attr, RF_F64, NULL, 0)
                      : NULL;
    if (!s1 || !s2)
        return NULL;
    mo->s1[s->id] = s1;
    mo->s2[s->id] = s2;
    rfi_node *k_kept = rfi_node_new(c, RFI_OP_RESHAPE, &k, 1, NULL, RF_F64, s->dims, s->rank);
    rfi_node *n = splat_f64(c, (double)points_per_sum(s), s1);
    rfi_node *sum = binary(c, RFI_OP_ADD, s1, binary(c, RFI_OP_MUL, k_kept, n));
    return sum ? unary(c, RFI_OP_CONVERT, sum, RF_F32) : NULL;
}

/* V (whose sum S was rewritten first) as f32(max(s2 - s1^2 / n, 0)). */
static rfi_node *rewrite_variance(moments *mo, rfi_graph *c, const rfi_node *s)
{
    rfi_node *s1 = mo->s1[s->id], *s2 = mo->s2[s->id];
    if (!s1 || !s2)
        return NULL;
    rfi_node *n = splat_f64(c, (double)points_per_sum(s), s1);
    rfi_node *ss = binary(c, RFI_OP_SUB, s2, binary(c, RFI_OP_DIV, binary(c, RFI_OP_MUL, s1, s1),
                                                    n));
    rfi_node *clamped = binary(c, RFI_OP_MAX, ss, splat_f64(c, 0.0, s1));
    return clamped ? unary(c, RFI_OP_CONVERT, clamped, RF_F32) : NULL;
}

/* rfi_rewrite_fn: a mean's sum and the variance taken about it (variance_of,
 * sum_of); other nodes are copied. */
static rfi_node *rewrite_moment(void *ctx, rfi_graph *c, const rfi_node *x, rfi_node *const *in,
                                rfi_node *const *map)
{
    (void)map;
    moments *mo = ctx;
    if (mo->variance_of[x->id] >= 0)
        return rewrite_sum(mo, c, x, in[0]);
    if (mo->sum_of[x->id] >= 0)
        return rewrite_variance(mo, c, mo->g->nodes[mo->sum_of[x->id]]);
    return NULL;
}

bool rfi_one_pass_moments_enabled(void)
{
    const char *v = getenv("RF_ONE_PASS_MOMENTS");
    return !(v && strcmp(v, "0") == 0);
}

/* Pairs every variance sum that matches the rule with its mean's sum (the
 * first variance, when several are taken about one mean). */
static void find_pairs(moments *mo)
{
    const rfi_graph *g = mo->g;
    for (int id = 0; id < g->n_nodes; id++)
        mo->variance_of[id] = mo->sum_of[id] = -1;
    for (int id = 0; id < g->n_nodes; id++) {
        const rfi_node *s = variance_sum(g->nodes[id]);
        if (s && mo->variance_of[s->id] < 0) {
            mo->variance_of[s->id] = id;
            mo->sum_of[id] = s->id;
        }
    }
}

rf_status rfi_one_pass_moments(const rfi_graph *g, rfi_graph **out)
{
    if (!out || !g)
        return rfi_error(RF_E_INVALID, "one_pass_moments: NULL %s",
                         g ? "output pointer" : "graph");
    *out = NULL;
    size_t n = g->n_nodes > 0 ? (size_t)g->n_nodes : 1;
    moments mo = {g, rfi_calloc(n, sizeof(int)), rfi_calloc(n, sizeof(int)),
                  rfi_calloc(n, sizeof(rfi_node *)), rfi_calloc(n, sizeof(rfi_node *))};
    rf_status st = mo.variance_of && mo.sum_of && mo.s1 && mo.s2
                       ? RF_OK
                       : rfi_error(RF_E_NOMEM, "one_pass_moments: out of memory");
    if (st == RF_OK) {
        find_pairs(&mo);
        st = rfi_rewrite_graph(g, "one_pass_moments",
                               rfi_one_pass_moments_enabled() ? rewrite_moment : NULL, &mo, out);
    }
    rfi_free(mo.variance_of);
    rfi_free(mo.sum_of);
    rfi_free(mo.s1);
    rfi_free(mo.s2);
    return st;
}
