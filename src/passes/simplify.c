/* simplify.c: algebraic simplification, constant folding and canonicalisation
 * of broadcast / reshape / transpose / convert chains (rfi_simplify).
 *
 * One pass in SSA order builds a new graph: each node is rewritten over its
 * already simplified operands (so chains collapse as they are met), and the
 * result is cleaned with rfi_dce. Every rewrite is exact on the reference
 * interpreter: the optimised program gives bitwise the same outputs and
 * updates. That excludes several textbook rules, on purpose:
 *   - x + 0.0 -> x is wrong for x = -0.0 (-0.0 + 0.0 = +0.0); only
 *     x + (-0.0), (-0.0) + x and x - (+0.0) are identities on floats;
 *     integers also get x + 0, 0 + x, x - 0;
 *   - x * 0 -> 0 only for integers (floats: NaN * 0 = NaN, Inf * 0 = NaN,
 *     -1 * 0 = -0.0);
 *   - x * 1, 1 * x, x / 1, neg(neg(x)), select(constant p, a, b), convert
 *     to the same dtype, identity reshape/transpose/broadcast are exact for
 *     every value; reshape(reshape), transpose(transpose) (composed perm) and
 *     broadcast(broadcast) (composed map) collapse to one op;
 *   - convert(convert(x: A) -> B) -> A folds to x only when A -> B is lossless
 *     (bool -> any, u8 -> i32/i64/f32/f64, i32 -> i64/f64, f32 -> f64);
 *   - a transposed dot_general operand folds into the dot's dimension lists
 *     when that keeps the result's dim order (simplify_dot);
 *   - relu's mask on a max-pool gradient moves onto the pooled cotangent
 *     (mask_pooled_gradient);
 *   - a product's transpose that swaps its two sides' free dims is the
 *     product of the operands swapped (transposed_dot);
 *   - a slice of a concatenation within one piece is a slice of that piece.
 * Values outside the claim: signalling NaNs (every float kernel of the
 * interpreter quiets them, so removing an operation may keep one
 * signalling) and bool buffers holding bytes other than 0 and 1.
 *
 * Constants: a constant of rank > 0 whose elements are all bytewise equal
 * becomes broadcast_in_dim of a rank-0 constant (the "splat" form the fusion
 * stage reads as a scalar); elementwise ops whose operands are all splats
 * fold to a splat of any size (evaluated once, on scalars); other ops over
 * constants fold by running the interpreter's kernel when every operand and
 * the result have at most FOLD_MAX_ELEMENTS elements. Splats are never
 * materialised beyond that bound. stop_gradient becomes its operand.
 *
 * Deliberately not here: common subexpressions (cse.c), reassociation or
 * anything that changes rounding, and rewrites of RNG, IOTA or GRAD nodes.
 */
#include <string.h>

#include "backend/interp/interp.h"
#include "passes/passes.h"
#include "runtime/runtime.h"

#define FOLD_MAX_ELEMENTS 4096

typedef struct simp {
    rfi_graph *c;       /* the graph being built */
    rfi_node **ins;     /* scratch: one node's mapped operands */
    const int *n_users; /* users of each node of the source graph */
} simp;

/* ---- Splats ---------------------------------------------------------------------- */

/* x is a splat whose element has exactly the bytes of v in x's dtype (so
 * -0.0 and +0.0 differ). Only numeric dtypes; bool never matches. */
static bool splat_is(const rfi_node *x, double v)
{
    const rfi_node *s = rfi_splat_scalar(x);
    if (!s || !s->attr.data || x->dtype == RF_BOOL)
        return false;
    unsigned char want[8] = {0};
    if (rfi_dtype_is_float(x->dtype))
        rfi_st_f(want, x->dtype, 0, v);
    else
        rfi_st_i(want, x->dtype, 0, (int64_t)v);
    return memcmp(want, s->attr.data, rf_dtype_size(x->dtype)) == 0;
}

static bool all_elements_equal(const void *data, int64_t n, size_t elem)
{
    const unsigned char *p = data;
    for (int64_t i = 1; i < n; i++)
        if (memcmp(p, p + (size_t)i * elem, elem) != 0)
            return false;
    return true;
}

static rfi_node *new_scalar(rfi_graph *c, rf_dtype dt, const void *bytes)
{
    rfi_attrs a;
    memset(&a, 0, sizeof a);
    a.data = bytes;
    a.nbytes = rf_dtype_size(dt);
    return rfi_node_new(c, RFI_OP_CONSTANT, NULL, 0, &a, dt, NULL, 0);
}

/* The splat form of `scalar` (a rank-0 node) over dims: the scalar itself at rank 0. */
static rfi_node *new_splat(rfi_graph *c, rfi_node *scalar, const int64_t *dims, int rank)
{
    if (!scalar || rank == 0)
        return scalar;
    rfi_attrs a;
    memset(&a, 0, sizeof a); /* empty map: a rank-0 operand */
    return rfi_node_new(c, RFI_OP_BROADCAST_IN_DIM, &scalar, 1, &a, scalar->dtype, dims, rank);
}

/* A constant of n's type holding data: in splat form when all its elements are equal. */
static rfi_node *new_constant_like(rfi_graph *c, const rfi_node *n, const void *data)
{
    int64_t count = rfi_node_numel(n);
    size_t elem = rf_dtype_size(n->dtype);
    if (n->rank > 0 && count >= 1 && all_elements_equal(data, count, elem))
        return new_splat(c, new_scalar(c, n->dtype, data), n->dims, n->rank);
    rfi_attrs a;
    memset(&a, 0, sizeof a);
    a.data = data;
    a.nbytes = (size_t)count * elem;
    return rfi_node_new(c, RFI_OP_CONSTANT, NULL, 0, &a, n->dtype, n->dims, n->rank);
}

/* ---- Folding ---------------------------------------------------------------------- */

static bool is_elementwise(rfi_op op)
{
    if (rfi_op_table[op].flags & (RFI_UNARY | RFI_BINARY))
        return true;
    return op == RFI_OP_COMPARE || op == RFI_OP_SELECT || op == RFI_OP_CLAMP ||
           op == RFI_OP_CONVERT;
}

/* Ops folded over constant operands. Broadcasts stay (they are the splat form
 * or cheap views of small constants); RNG, IOTA and GRAD are left alone. */
static bool is_foldable(rfi_op op)
{
    if (rfi_op_table[op].flags & RFI_LEAF)
        return false;
    return op != RFI_OP_BROADCAST_IN_DIM && op != RFI_OP_RNG && op != RFI_OP_GRAD;
}

/* An elementwise op whose operands are all splats: evaluated once on rank-0
 * copies of the node and its operands, the result a splat of n's shape. */
static rfi_node *fold_splats(simp *s, const rfi_node *n, rfi_node *const *in)
{
    if (!is_elementwise(n->op) || n->n_in < 1 || n->n_in > 3)
        return NULL;
    rfi_node scalar_in[3], *scalar_ptrs[3];
    const void *values[3];
    for (int k = 0; k < n->n_in; k++) {
        const rfi_node *sc = rfi_splat_scalar(in[k]);
        if (!sc)
            return NULL;
        rfi_node_copy(&scalar_in[k], n->in[k]);
        scalar_in[k].rank = 0;
        scalar_ptrs[k] = &scalar_in[k];
        values[k] = sc->attr.data;
    }
    rfi_node scalar_node;
    rfi_node_copy(&scalar_node, n);
    scalar_node.rank = 0;
    scalar_node.in = scalar_ptrs;
    unsigned char out[16] = {0};
    rf_status st = rfi_interp_eval_node(&scalar_node, values, out);
    if (st != RF_OK) {
        rfi_graph_fail(s->c, st, "simplify: folding %s failed", rfi_op_table[n->op].name);
        return NULL;
    }
    return new_splat(s->c, new_scalar(s->c, n->dtype, out), n->dims, n->rank);
}

/* The elements of a constant or a (small) splat: borrowed for constants,
 * allocated into *owned for splats. NULL with the graph failed on OOM. */
static const void *constant_elements(simp *s, const rfi_node *x, void **owned)
{
    *owned = NULL;
    if (x->op == RFI_OP_CONSTANT)
        return x->attr.data;
    const rfi_node *sc = rfi_splat_scalar(x);
    size_t elem = rf_dtype_size(x->dtype);
    int64_t count = rfi_node_numel(x);
    unsigned char *buf = rfi_malloc(count > 0 ? (size_t)count * elem : 1);
    if (!buf) {
        rfi_graph_fail(s->c, RF_E_NOMEM, "simplify: out of memory folding constants");
        return NULL;
    }
    for (int64_t i = 0; i < count; i++)
        memcpy(buf + (size_t)i * elem, sc->attr.data, elem);
    *owned = buf;
    return buf;
}

static bool is_small_constant(const rfi_node *x)
{
    return (x->op == RFI_OP_CONSTANT || rfi_splat_scalar(x)) &&
           rfi_node_numel(x) <= FOLD_MAX_ELEMENTS;
}

/* Runs n's interpreter kernel over mapped operands that are all small
 * constants; the result (if small too) becomes a constant. */
static rfi_node *fold_constants(simp *s, const rfi_node *n, rfi_node *const *in)
{
    if (!is_foldable(n->op) || rfi_node_numel(n) > FOLD_MAX_ELEMENTS)
        return NULL;
    for (int k = 0; k < n->n_in; k++)
        if (!is_small_constant(in[k]))
            return NULL;
    size_t nin = (size_t)n->n_in;
    const void **values = rfi_calloc(nin, sizeof *values);
    void **owned = rfi_calloc(nin, sizeof *owned);
    size_t nbytes = rfi_node_nbytes(n);
    void *out = rfi_malloc(nbytes ? nbytes : 1);
    rfi_node *res = NULL;
    bool ok = values && owned && out;
    if (!ok)
        rfi_graph_fail(s->c, RF_E_NOMEM, "simplify: out of memory folding %s",
                       rfi_op_table[n->op].name);
    for (int k = 0; ok && k < n->n_in; k++) {
        values[k] = constant_elements(s, in[k], &owned[k]);
        ok = values[k] || in[k]->op == RFI_OP_CONSTANT; /* empty constants may be NULL */
    }
    if (ok) {
        rf_status st = rfi_interp_eval_node(n, values, out);
        if (st != RF_OK)
            rfi_graph_fail(s->c, st, "simplify: folding %s node %%%d failed",
                           rfi_op_table[n->op].name, (int)n->id);
        else
            res = new_constant_like(s->c, n, out);
    }
    for (size_t k = 0; owned && k < nin; k++)
        rfi_free(owned[k]);
    rfi_free(owned);
    rfi_free(values);
    rfi_free(out);
    return res;
}

/* Shape ops that only move elements keep a splat a splat (of the result's shape). */
static rfi_node *fold_splat_shape_op(simp *s, const rfi_node *n, rfi_node *const *in)
{
    switch (n->op) {
    case RFI_OP_BROADCAST_IN_DIM:
    case RFI_OP_RESHAPE:
    case RFI_OP_TRANSPOSE:
    case RFI_OP_SLICE:
    case RFI_OP_REVERSE: break;
    default: return NULL;
    }
    const rfi_node *sc = rfi_splat_scalar(in[0]);
    if (!sc)
        return NULL;
    return new_splat(s->c, (rfi_node *)sc, n->dims, n->rank);
}

/* ---- Algebraic identities ---------------------------------------------------------- */

static bool is_float(const rfi_node *n) { return rfi_dtype_is_float(n->dtype); }
static bool is_int(const rfi_node *n) { return rfi_dtype_is_int(n->dtype); }

/* The additive identity that is exact on the left and right: -0.0 for floats, 0 for ints. */
static bool is_exact_add_identity(const rfi_node *x)
{
    return is_float(x) ? splat_is(x, -0.0) : is_int(x) && splat_is(x, 0);
}

static rfi_node *simplify_add(const rfi_node *n, rfi_node *const *in)
{
    (void)n;
    if (is_exact_add_identity(in[1]))
        return in[0];
    if (is_exact_add_identity(in[0]))
        return in[1];
    return NULL;
}

static rfi_node *simplify_sub(const rfi_node *n, rfi_node *const *in)
{
    (void)n;
    if (splat_is(in[1], 0.0)) /* +0.0 exactly for floats (x - (-0.0) is not x) */
        return in[0];
    return NULL;
}

static rfi_node *simplify_mul(simp *s, const rfi_node *n, rfi_node *const *in)
{
    if (splat_is(in[1], 1.0))
        return in[0];
    if (splat_is(in[0], 1.0))
        return in[1];
    if (is_int(n) && (splat_is(in[0], 0) || splat_is(in[1], 0))) {
        static const unsigned char zero[8];
        return new_splat(s->c, new_scalar(s->c, n->dtype, zero), n->dims, n->rank);
    }
    return NULL;
}

/* A -> B keeps every value of A (and B -> A gives it back). */
static bool is_lossless_convert(rf_dtype from, rf_dtype to)
{
    switch (from) {
    case RF_BOOL: return true;
    case RF_U8: return to == RF_I32 || to == RF_I64 || to == RF_F32 || to == RF_F64;
    case RF_I32: return to == RF_I64 || to == RF_F64;
    case RF_F32: return to == RF_F64;
    default: return false;
    }
}

static rfi_node *simplify_convert(const rfi_node *n, rfi_node *const *in)
{
    rfi_node *x = in[0];
    if (x->dtype == n->dtype)
        return x;
    if (x->op == RFI_OP_CONVERT && x->in[0]->dtype == n->dtype &&
        is_lossless_convert(n->dtype, x->dtype))
        return x->in[0];
    return NULL;
}

static bool same_dims(const rfi_node *a, const int64_t *dims, int rank)
{
    return a->rank == rank && memcmp(a->dims, dims, (size_t)rank * sizeof *dims) == 0;
}

static rfi_node *simplify_reshape(simp *s, const rfi_node *n, rfi_node *const *in)
{
    rfi_node *x = in[0]->op == RFI_OP_RESHAPE ? in[0]->in[0] : in[0];
    if (same_dims(x, n->dims, n->rank))
        return x;
    if (x == in[0])
        return NULL;
    return rfi_node_new(s->c, RFI_OP_RESHAPE, &x, 1, NULL, n->dtype, n->dims, n->rank);
}

static bool is_identity_list(const int64_t *v, int n)
{
    for (int i = 0; i < n; i++)
        if (v[i] != i)
            return false;
    return true;
}

/* transpose(dot_general(a, b)) that swaps the product's lhs and rhs free dims
 * (keeping its batch dims first) is dot_general(b, a): the same products,
 * summed in the same order, computed in the transposed order directly (an
 * attention's value gradient, (dY^T P) transposed back to V's layout, was a
 * loop of its own). Only when the transpose is the product's one user
 * (source node n). */
static rfi_node *transposed_dot(simp *s, const rfi_node *n, rfi_node *const *in)
{
    const rfi_node *d = in[0];
    if (d->op != RFI_OP_DOT_GENERAL || s->n_users[n->in[0]->id] != 1)
        return NULL;
    int nb = (int)d->attr.nl[0]; /* lists: batch dims of each side, then contracted */
    int64_t free_dims[RF_MAX_RANK];
    int nl = rfi_dot_free_dims(d->in[0]->rank, d->attr.l[0], d->attr.nl[0], d->attr.l[2],
                               d->attr.nl[2], free_dims);
    int nr = d->rank - nb - nl;
    if (nl < 1 || nr < 1)
        return NULL;
    const int64_t *perm = n->attr.l[0];
    for (int i = 0; i < n->rank; i++) {
        int64_t want = i < nb ? i : i < nb + nr ? nb + nl + (i - nb) : nb + (i - nb - nr);
        if (perm[i] != want)
            return NULL;
    }
    rfi_attrs a;
    rfi_attrs_copy(&a, &d->attr);
    for (int k = 0; k < 2; k++) {
        a.nl[k] = d->attr.nl[1 - k];
        a.nl[2 + k] = d->attr.nl[3 - k];
        for (int j = 0; j < a.nl[k]; j++)
            a.l[k][j] = d->attr.l[1 - k][j];
        for (int j = 0; j < a.nl[2 + k]; j++)
            a.l[2 + k][j] = d->attr.l[3 - k][j];
    }
    rfi_node *ops[2] = {d->in[1], d->in[0]};
    return rfi_node_new(s->c, RFI_OP_DOT_GENERAL, ops, 2, &a, n->dtype, n->dims, n->rank);
}

/* transpose(transpose(x, p1), p2) = transpose(x, p1[p2[i]]). */
static rfi_node *simplify_transpose(simp *s, const rfi_node *n, rfi_node *const *in)
{
    rfi_node *x = in[0];
    rfi_node *dot = transposed_dot(s, n, in);
    if (dot || s->c->status != RF_OK)
        return dot;
    rfi_attrs a;
    rfi_attrs_copy(&a, &n->attr);
    if (x->op == RFI_OP_TRANSPOSE) {
        for (int i = 0; i < n->rank; i++)
            a.l[0][i] = x->attr.l[0][n->attr.l[0][i]];
        x = x->in[0];
    }
    if (is_identity_list(a.l[0], n->rank))
        return x;
    if (x == in[0])
        return NULL;
    return rfi_node_new(s->c, RFI_OP_TRANSPOSE, &x, 1, &a, n->dtype, n->dims, n->rank);
}

/* A slice of a concatenation that lies within one of its pieces is that
 * slice of the piece (the piece itself when it takes all of it): the
 * optimiser's per-parameter sums over its flat concatenated gradient then
 * read each gradient directly. */
static rfi_node *simplify_slice(simp *s, const rfi_node *n, rfi_node *const *in)
{
    const rfi_node *c = in[0];
    if (c->op != RFI_OP_CONCATENATE)
        return NULL;
    int a = (int)c->attr.i[0];
    int64_t off = 0, start = n->attr.l[0][a], limit = n->attr.l[1][a];
    for (int k = 0; k < c->n_in; k++) {
        rfi_node *piece = c->in[k];
        int64_t size = piece->dims[a];
        if (start >= off && limit <= off + size && limit > start) {
            rfi_attrs at;
            rfi_attrs_copy(&at, &n->attr);
            at.l[0][a] = start - off;
            at.l[1][a] = limit - off;
            bool whole = true;
            for (int d = 0; d < n->rank; d++)
                whole = whole && at.l[0][d] == 0 && at.l[1][d] == piece->dims[d] &&
                        at.l[2][d] == 1;
            if (whole)
                return piece;
            return rfi_node_new(s->c, RFI_OP_SLICE, &piece, 1, &at, n->dtype, n->dims, n->rank);
        }
        off += size;
    }
    return NULL;
}

/* broadcast(broadcast(x, m1), m2) = broadcast(x, m2[m1[k]]), when inference accepts it. */
static rfi_node *simplify_broadcast(simp *s, const rfi_node *n, rfi_node *const *in)
{
    rfi_node *x = in[0];
    rfi_attrs a;
    rfi_attrs_copy(&a, &n->attr);
    if (x->op == RFI_OP_BROADCAST_IN_DIM) {
        rfi_node *inner = x->in[0];
        rfi_attrs composed;
        rfi_attrs_copy(&composed, &n->attr);
        composed.nl[0] = inner->rank;
        for (int k = 0; k < inner->rank; k++)
            composed.l[0][k] = n->attr.l[0][x->attr.l[0][k]];
        rf_dtype dt = n->dtype;
        int rank = n->rank;
        int64_t dims[RF_MAX_RANK];
        memcpy(dims, n->dims, sizeof dims);
        char msg[RFI_ERRMSG_MAX];
        if (rfi_infer(RFI_OP_BROADCAST_IN_DIM, &inner, 1, &composed, &dt, dims, &rank, msg,
                      sizeof msg) == RF_OK) {
            x = inner;
            a = composed;
        }
    }
    if (x->rank == n->rank && same_dims(x, n->dims, n->rank) &&
        is_identity_list(a.l[0], x->rank))
        return x;
    if (x == in[0])
        return NULL;
    return rfi_node_new(s->c, RFI_OP_BROADCAST_IN_DIM, &x, 1, &a, n->dtype, n->dims, n->rank);
}

/* dot_general(transpose(a, p), b) = dot_general(a, b) with the transposed
 * operand's batch and contracting dims renamed through p, when a's free dims
 * come in the same order as the transpose's (so the result's dim order does
 * not change); likewise for the rhs. Exact: the lists keep their order, so
 * the interpreter visits the same products in the same order. */
static bool fold_transposed_operand(const rfi_node *n, rfi_node **in, rfi_attrs *a, int k)
{
    const rfi_node *t = in[k];
    if (t->op != RFI_OP_TRANSPOSE)
        return false;
    const int64_t *perm = t->attr.l[0];
    int64_t free_dims[RF_MAX_RANK];
    int n_free = rfi_dot_free_dims(t->rank, n->attr.l[k], n->attr.nl[k], n->attr.l[2 + k],
                                   n->attr.nl[2 + k], free_dims);
    for (int j = 1; j < n_free; j++)
        if (perm[free_dims[j]] < perm[free_dims[j - 1]])
            return false; /* the free dims would come out in another order */
    for (int j = 0; j < n->attr.nl[k]; j++)
        a->l[k][j] = perm[n->attr.l[k][j]];
    for (int j = 0; j < n->attr.nl[2 + k]; j++)
        a->l[2 + k][j] = perm[n->attr.l[2 + k][j]];
    in[k] = t->in[0];
    return true;
}

static rfi_node *simplify_dot(simp *s, const rfi_node *n, rfi_node *const *in)
{
    rfi_node *ops[2] = {in[0], in[1]};
    rfi_attrs a;
    rfi_attrs_copy(&a, &n->attr);
    bool changed = fold_transposed_operand(n, ops, &a, 0);
    changed |= fold_transposed_operand(n, ops, &a, 1);
    if (!changed)
        return NULL;
    return rfi_node_new(s->c, RFI_OP_DOT_GENERAL, ops, 2, &a, n->dtype, n->dims, n->rank);
}

/* x > 0 for a float x: compare(x, zero splat, gt) (either sign of zero). */
static bool is_positive_test(const rfi_node *p, const rfi_node *x)
{
    return p->op == RFI_OP_COMPARE && p->attr.i[0] == RF_GT && p->in[0] == x &&
           (splat_is(p->in[1], 0.0) || splat_is(p->in[1], -0.0));
}

/* The relu gradient of a max-pool gradient,
 *   select(x > 0, select_and_scatter(x, s), +0)
 * with non-overlapping or overlapping windows and no padding, is
 *   select_and_scatter(x, select(reduce_window_max(x) > 0, s, +0)):
 * every position a window selects holds that window's maximum, so testing the
 * pooled maximum (the forward pass already computed it: CSE merges the two)
 * masks the same terms, in the same order, on the 1/window-size smaller
 * cotangent; unselected positions are +0 either way, and a NaN maximum fails
 * both tests. The full-size masking pass disappears. */
static rfi_node *mask_pooled_gradient(simp *s, const rfi_node *n, rfi_node *const *in)
{
    const rfi_node *sas = in[1];
    if (sas->op != RFI_OP_SELECT_AND_SCATTER || !rfi_dtype_is_float(n->dtype) ||
        !splat_is(in[2], 0.0) || !is_positive_test(in[0], sas->in[0]))
        return NULL;
    rfi_node *x = sas->in[0], *src = sas->in[1];
    for (int d = 0; d < x->rank; d++)
        if (sas->attr.l[2][d] != 0 || sas->attr.l[3][d] != 0)
            return NULL;
    rfi_attrs pool;
    rfi_attrs_copy(&pool, &sas->attr);
    pool.i[0] = RF_REDUCE_MAX;
    rf_dtype dt = x->dtype;
    int rank = 0;
    int64_t dims[RF_MAX_RANK];
    char msg[RFI_ERRMSG_MAX];
    if (rfi_infer(RFI_OP_REDUCE_WINDOW, &x, 1, &pool, &dt, dims, &rank, msg, sizeof msg) !=
            RF_OK ||
        rank != src->rank || !same_dims(src, dims, rank))
        return NULL; /* checked first: a failed node would fail the whole pass */
    rfi_node *pooled = rfi_node_new(s->c, RFI_OP_REDUCE_WINDOW, &x, 1, &pool, dt, NULL, 0);
    /* x and the cotangent may differ in dtype: each zero comes from its own side */
    rfi_node *zero = (rfi_node *)rfi_splat_scalar(in[2]);
    rfi_node *x_zero = (rfi_node *)rfi_splat_scalar(in[0]->in[1]);
    rfi_attrs gt;
    memset(&gt, 0, sizeof gt);
    gt.i[0] = RF_GT;
    rfi_node *cmp_in[2] = {pooled, new_splat(s->c, x_zero, pooled->dims, pooled->rank)};
    rfi_node *keep = rfi_node_new(s->c, RFI_OP_COMPARE, cmp_in, 2, &gt, RF_BOOL, NULL, 0);
    rfi_node *sel_in[3] = {keep, src, new_splat(s->c, zero, src->dims, src->rank)};
    rfi_node *masked = rfi_node_new(s->c, RFI_OP_SELECT, sel_in, 3, NULL, src->dtype, NULL, 0);
    rfi_node *sas_in[2] = {x, masked};
    return rfi_node_new(s->c, RFI_OP_SELECT_AND_SCATTER, sas_in, 2, &sas->attr, n->dtype, NULL,
                        0);
}

/* select with a constant predicate (a splat: any shape) is one of its operands. */
static rfi_node *simplify_select(simp *s, const rfi_node *n, rfi_node *const *in)
{
    const rfi_node *p = rfi_splat_scalar(in[0]);
    if (!p || !p->attr.data)
        return mask_pooled_gradient(s, n, in);
    return *(const unsigned char *)p->attr.data ? in[1] : in[2];
}

static rfi_node *simplify_identity(simp *s, const rfi_node *n, rfi_node *const *in)
{
    switch (n->op) {
    case RFI_OP_ADD: return simplify_add(n, in);
    case RFI_OP_SUB: return simplify_sub(n, in);
    case RFI_OP_MUL: return simplify_mul(s, n, in);
    case RFI_OP_DIV: return splat_is(in[1], 1.0) ? in[0] : NULL;
    case RFI_OP_NEG: return in[0]->op == RFI_OP_NEG ? in[0]->in[0] : NULL;
    case RFI_OP_STOP_GRADIENT: return in[0];
    case RFI_OP_CONVERT: return simplify_convert(n, in);
    case RFI_OP_RESHAPE: return simplify_reshape(s, n, in);
    case RFI_OP_TRANSPOSE: return simplify_transpose(s, n, in);
    case RFI_OP_SLICE: return simplify_slice(s, n, in);
    case RFI_OP_BROADCAST_IN_DIM: return simplify_broadcast(s, n, in);
    case RFI_OP_SELECT: return simplify_select(s, n, in);
    case RFI_OP_DOT_GENERAL: return simplify_dot(s, n, in);
    default: return NULL;
    }
}

/* ---- Driver ------------------------------------------------------------------------ */

/* The simplified copy of n over its mapped operands in (NULL with c failed on error). */
static rfi_node *simplify_node(simp *s, const rfi_node *n, rfi_node *const *in)
{
    if (n->op == RFI_OP_CONSTANT && n->rank > 0 && rfi_node_numel(n) >= 1 &&
        all_elements_equal(n->attr.data, rfi_node_numel(n), rf_dtype_size(n->dtype)))
        return new_constant_like(s->c, n, n->attr.data);
    if (rfi_op_table[n->op].flags & RFI_LEAF || n->op == RFI_OP_GRAD || n->op == RFI_OP_RNG)
        return rfi_node_clone(s->c, n, in);
    rfi_node *(*const rules[])(simp *, const rfi_node *, rfi_node *const *) = {
        fold_splats, fold_constants, fold_splat_shape_op, simplify_identity};
    for (size_t r = 0; r < sizeof rules / sizeof rules[0]; r++) {
        rfi_node *res = rules[r](s, n, in);
        if (res || s->c->status != RF_OK)
            return res;
    }
    return rfi_node_clone(s->c, n, in);
}

static rf_status graph_status(const rfi_graph *c)
{
    return c->status != RF_OK ? c->status : RF_E_NOMEM;
}

static rf_status simplify_all(const rfi_graph *g, simp *s, rfi_node **map)
{
    for (int id = 0; id < g->n_nodes; id++) {
        const rfi_node *n = g->nodes[id];
        for (int k = 0; k < n->n_in; k++)
            s->ins[k] = map[n->in[k]->id];
        rfi_node *r = simplify_node(s, n, s->ins);
        if (!r)
            return graph_status(s->c);
        if (r->dtype != n->dtype || !same_dims(r, n->dims, n->rank))
            return rfi_error(RF_E_INTERNAL, "simplify: rewriting %s node %%%d changed its type",
                             rfi_op_table[n->op].name, (int)id);
        map[id] = r;
    }
    return RF_OK;
}

rf_status rfi_simplify(const rfi_graph *g, rfi_graph **out)
{
    if (!out)
        return rfi_error(RF_E_INVALID, "simplify: NULL output pointer");
    *out = NULL;
    if (!g)
        return rfi_error(RF_E_INVALID, "simplify: NULL graph");
    int max_in = rfi_max_operands(g);
    rfi_node **map = rfi_calloc(g->n_nodes > 0 ? (size_t)g->n_nodes : 1, sizeof *map);
    int *n_users = rfi_use_counts(g);
    simp s = {NULL, rfi_calloc((size_t)max_in, sizeof *s.ins), n_users};
    rf_status st =
        map && s.ins && n_users ? RF_OK : rfi_error(RF_E_NOMEM, "simplify: out of memory");
    if (st == RF_OK)
        st = rfi_graph_new_like(g, &s.c);
    if (st == RF_OK)
        st = simplify_all(g, &s, map);
    if (st == RF_OK)
        st = rfi_graph_copy_results(g, s.c, map, NULL, NULL);
    if (st == RF_OK)
        st = rfi_dce(s.c, out); /* rewrites leave the nodes they bypassed behind */
    rfi_free(map);
    rfi_free(n_users);
    rfi_free(s.ins);
    rfi_graph_free(s.c);
    return st;
}
