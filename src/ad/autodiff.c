/* autodiff.c: reverse-mode automatic differentiation as a graph-to-graph
 * pass. The program is copied node by node; at the first GRAD node of each
 * differentiated scalar y, the backward sweep for y is emitted: the nodes on
 * a path from any of y's wrt tensors to y are walked in reverse order and
 * each one's VJP rule (vjp.h) turns its cotangent into its operands'
 * cotangents, summed when an operand has several users. Every GRAD node of y
 * then becomes the cotangent of its wrt (zeros when none reaches it).
 *
 * The cotangent of a slice is the slice's cotangent padded with zeros, so a
 * tensor split into pieces that are each used (the gates of a GRU cell cut
 * from one matrix product, attention heads, a chunk) would get a sum of pads
 * that each hold one piece, and a fused loop evaluates every pad at every
 * element. Such contributions (zero padding along one axis only) are held
 * back until the node's cotangent is read; when several of them along one
 * axis are disjoint, they become one concatenation of their pieces with
 * zeros between, which the backends lower piece by piece.
 *
 * A softmax or logsoftmax, recognised from its primitives, is differentiated
 * as one node: its cotangent goes straight to the normalised operand by a
 * rule that reads only the result (vjp_softmax.c).
 *
 * Deliberately not here: the rules themselves (vjp*.c), removing what the
 * gradient does not need (dce.c), and nested gradients (a GRAD inside a
 * differentiated region is rejected with RF_E_UNSUPPORTED).
 */
#include <stdlib.h>
#include <string.h>

#include "ad/vjp.h"
#include "passes/passes.h"

/* The zero-padded contributions to one node's cotangent not yet summed. */
typedef struct pad_list {
    rfi_node **v;
    int n, cap;
} pad_list;

typedef struct ad_ctx {
    const rfi_graph *g;  /* the program */
    rfi_graph *ng;       /* its copy being built */
    rfi_node **map;      /* g node id -> copy in ng */
    rfi_node **grad_of;  /* GRAD node id -> its gradient in ng, once y is swept */
    /* per-sweep scratch, sized g->n_nodes */
    bool *from_wrt, *to_y, *is_wrt;
    rfi_node **adj;      /* g node id -> cotangent in ng */
    pad_list *pads;      /* g node id -> contributions held back (pad_axis) */
    /* per-node scratch, sized max_in */
    rfi_node **ins, **grads;
    bool *want;
} ad_ctx;

/* The status to report after node construction in ng failed. */
static rf_status build_failure(const ad_ctx *c, const rfi_node *x, const char *what)
{
    rf_status st = c->ng->status != RF_OK ? c->ng->status : RF_E_INTERNAL;
    if (st == RF_E_NOMEM)
        return rfi_error(st, "grad: out of memory");
    return rfi_error(RF_E_INTERNAL, "grad: %s %%%d (%s) failed: %s", what, x->id,
                     rfi_op_table[x->op].name, c->ng->errmsg ? c->ng->errmsg : "unknown error");
}

/* Marks the nodes that depend on one of y's wrt (from_wrt) and those y
 * depends on (to_y); nodes with both lie on a path wrt -> y. */
static void mark_region(const ad_ctx *c, const rfi_node *y)
{
    const rfi_graph *g = c->g;
    memset(c->from_wrt, 0, (size_t)g->n_nodes * sizeof *c->from_wrt);
    memset(c->to_y, 0, (size_t)g->n_nodes * sizeof *c->to_y);
    memset(c->is_wrt, 0, (size_t)g->n_nodes * sizeof *c->is_wrt);
    for (int id = 0; id < g->n_nodes; id++) {
        const rfi_node *x = g->nodes[id];
        if (x->op == RFI_OP_GRAD && x->in[0] == y)
            c->from_wrt[x->in[1]->id] = c->is_wrt[x->in[1]->id] = true;
    }
    for (int id = 0; id <= y->id; id++) {
        const rfi_node *x = g->nodes[id];
        for (int k = 0; k < x->n_in && !c->from_wrt[id]; k++)
            c->from_wrt[id] = c->from_wrt[x->in[k]->id];
    }
    c->to_y[y->id] = true;
    for (int id = y->id; id >= 0; id--) {
        if (!c->to_y[id])
            continue;
        const rfi_node *x = g->nodes[id];
        for (int k = 0; k < x->n_in; k++)
            c->to_y[x->in[k]->id] = true;
    }
}

static bool needed(const ad_ctx *c, int id)
{
    return c->from_wrt[id] && c->to_y[id];
}

/* The gradient must flow back through GRAD node x: one of its operands depends on a
 * wrt. (A GRAD node that is itself a wrt, on operands free of wrts, is an ordinary
 * leaf of this sweep: y's gradient w.r.t. an earlier gradient.) */
static bool through_grad(const ad_ctx *c, const rfi_node *x)
{
    for (int k = 0; k < x->n_in; k++)
        if (c->from_wrt[x->in[k]->id])
            return true;
    return false;
}

/* The one axis along which d, a pad with zeros and no interior padding, pads;
 * -1 when d is anything else. */
static int pad_axis(const rfi_node *d)
{
    if (d->op != RFI_OP_PAD || d->in[1]->op != RFI_OP_CONSTANT || !d->in[1]->attr.data)
        return -1;
    const unsigned char *v = d->in[1]->attr.data;
    for (size_t i = 0; i < d->in[1]->attr.nbytes; i++)
        if (v[i] != 0) /* not +0 (a -0 pad would change the sign of a zero sum) */
            return -1;
    int axis = -1;
    for (int i = 0; i < d->rank; i++) {
        const int64_t lo = d->attr.l[0][i], hi = d->attr.l[1][i];
        if (d->attr.l[2][i] != 0 || lo < 0 || hi < 0)
            return -1;
        if (lo == 0 && hi == 0)
            continue;
        if (axis >= 0)
            return -1;
        axis = i;
    }
    return axis;
}

/* By axis, then by where the piece starts, then by node (deterministic). */
static int cmp_pad(const void *pa, const void *pb)
{
    const rfi_node *a = *(rfi_node *const *)pa, *b = *(rfi_node *const *)pb;
    int xa = pad_axis(a), xb = pad_axis(b);
    if (xa != xb)
        return (xa > xb) - (xa < xb);
    int64_t la = a->attr.l[0][xa], lb = b->attr.l[0][xb];
    if (la != lb)
        return (la > lb) - (la < lb);
    return (a->id > b->id) - (a->id < b->id);
}

static rf_status add_to(ad_ctx *c, const rfi_node *x, rfi_node *d)
{
    rfi_node **slot = &c->adj[x->id];
    *slot = *slot ? rfi_ad_binary(c->ng, RFI_OP_ADD, *slot, d) : d;
    return *slot ? RF_OK : build_failure(c, x, "accumulating the gradient of");
}

/* The pads p[0..n) along one axis as one concatenation of their pieces with
 * zeros in the ranges none covers, or NULL when two of them overlap. */
static rfi_node *join_pads(ad_ctx *c, rfi_node *const *p, int n, rfi_node **ops)
{
    const rfi_node *p0 = p[0];
    int axis = pad_axis(p0), k = 0;
    int64_t at = 0, dims[RF_MAX_RANK];
    memcpy(dims, p0->dims, sizeof(int64_t) * (size_t)p0->rank);
    for (int i = 0; i < n; i++) {
        const int64_t lo = p[i]->attr.l[0][axis];
        if (lo < at)
            return NULL;
        if (lo > at) {
            dims[axis] = lo - at;
            ops[k++] = rfi_ad_full(c->ng, p0->dtype, dims, p0->rank, 0.0);
        }
        ops[k++] = p[i]->in[0];
        at = lo + p[i]->in[0]->dims[axis];
    }
    if (at < p0->dims[axis]) {
        dims[axis] = p0->dims[axis] - at;
        ops[k++] = rfi_ad_full(c->ng, p0->dtype, dims, p0->rank, 0.0);
    }
    return rfi_ad_concat(c->ng, ops, k, axis);
}

/* Sums the contributions to node x's cotangent held back by accumulate. */
static rf_status settle(ad_ctx *c, const rfi_node *x)
{
    pad_list *l = &c->pads[x->id];
    int n = l->n;
    l->n = 0;
    if (n > 1)
        qsort(l->v, (size_t)n, sizeof *l->v, cmp_pad);
    rfi_node **ops = n > 1 ? rfi_malloc((size_t)(2 * n + 1) * sizeof *ops) : NULL;
    if (n > 1 && !ops)
        return rfi_error(RF_E_NOMEM, "grad: out of memory");
    rf_status st = RF_OK;
    for (int i = 0, j; st == RF_OK && i < n; i = j) {
        for (j = i + 1; j < n && pad_axis(l->v[j]) == pad_axis(l->v[i]);)
            j++;
        rfi_node *joined = j - i >= 2 ? join_pads(c, l->v + i, j - i, ops) : NULL;
        if (j - i >= 2 && !joined && c->ng->status != RF_OK)
            st = build_failure(c, x, "joining the gradient pieces of");
        else if (joined)
            st = add_to(c, x, joined);
        for (int q = i; st == RF_OK && !joined && q < j; q++)
            st = add_to(c, x, l->v[q]);
    }
    rfi_free(ops);
    return st;
}

/* Adds cotangent contribution `d` to node x's cotangent. */
static rf_status accumulate(ad_ctx *c, const rfi_node *user, int k, rfi_node *d)
{
    const rfi_node *x = user->in[k];
    if (!rfi_ad_same_type(d, x)) {
        char want[200], got[200];
        return rfi_error(RF_E_INTERNAL,
                         "grad: rule of %s (%%%d) gave operand %d a cotangent %s, expected %s",
                         rfi_op_table[user->op].name, user->id, k,
                         rfi_type_str(got, sizeof got, d->dtype, d->dims, d->rank),
                         rfi_type_str(want, sizeof want, x->dtype, x->dims, x->rank));
    }
    if (pad_axis(d) < 0)
        return add_to(c, x, d);
    pad_list *l = &c->pads[x->id];
    if (l->n == l->cap) {
        int ncap = l->cap ? 2 * l->cap : 4;
        rfi_node **v = rfi_realloc(l->v, (size_t)ncap * sizeof *v);
        if (!v)
            return rfi_error(RF_E_NOMEM, "grad: out of memory");
        l->v = v;
        l->cap = ncap;
    }
    l->v[l->n++] = d;
    return RF_OK;
}

/* When x is the result of a softmax or a logsoftmax (vjp_softmax.c), sends
 * its cotangent straight to the normalised operand, read from x alone, and
 * returns true with *st set. False when x is none, or when a node inside it
 * is a wrt of this sweep (its gradient must include x's contribution): then
 * the op-by-op rules apply. */
static bool propagate_softmax(ad_ctx *c, const rfi_node *x, rf_status *st)
{
    rfi_softmax_match m;
    if (!rfi_vjp_match_softmax(x, &m))
        return false;
    for (int i = 0; i < m.n_inner; i++)
        if (c->is_wrt[m.inner[i]->id])
            return false;
    *st = RF_OK;
    if (!needed(c, m.z->id))
        return true; /* nothing inside depends on a wrt but through z */
    rfi_node *d = rfi_vjp_softmax(c->ng, &m, c->map[x->id], c->adj[x->id]);
    *st = d ? add_to(c, m.z, d) : build_failure(c, x, "building the gradient of");
    return true;
}

/* Applies the rule of node x to its cotangent. */
static rf_status propagate(ad_ctx *c, const rfi_node *x)
{
    rf_status st;
    if (propagate_softmax(c, x, &st))
        return st;
    bool any = false;
    for (int k = 0; k < x->n_in; k++) {
        const rfi_node *in = x->in[k];
        c->want[k] = needed(c, in->id) && rfi_dtype_is_float(in->dtype);
        c->ins[k] = c->map[in->id];
        c->grads[k] = NULL;
        any = any || c->want[k];
    }
    if (!any)
        return RF_OK;
    rfi_vjp_fn rule = rfi_vjp_rule(x->op);
    if (!rule) {
        if (rfi_vjp_has_zero_rule(x->op))
            return RF_OK;
        return rfi_error(RF_E_UNSUPPORTED, "grad: %s (%%%d) has no gradient rule",
                         rfi_op_table[x->op].name, x->id);
    }
    rfi_vjp_args args = {
        .g = c->ng, .node = x, .in = c->ins, .out = c->map[x->id], .ct = c->adj[x->id],
        .want = c->want,
    };
    st = rule(&args, c->grads);
    if (st != RF_OK)
        return st;
    if (c->ng->status != RF_OK)
        return build_failure(c, x, "building the gradient of");
    for (int k = 0; k < x->n_in; k++) {
        if (!c->want[k] || !c->grads[k])
            continue;
        st = accumulate(c, x, k, c->grads[k]);
        if (st != RF_OK)
            return st;
    }
    return RF_OK;
}

/* Emits the backward sweep of y into ng and records the gradient of every
 * GRAD node of y in grad_of. */
static rf_status sweep(ad_ctx *c, const rfi_node *y)
{
    const rfi_graph *g = c->g;
    if (y->rank != 0 || !rfi_dtype_is_float(y->dtype)) {
        char t[200];
        return rfi_error(RF_E_INVALID, "grad: y must be a float scalar, got %s",
                         rfi_type_str(t, sizeof t, y->dtype, y->dims, y->rank));
    }
    mark_region(c, y);
    for (int id = 0; id <= y->id; id++) {
        if (g->nodes[id]->op == RFI_OP_GRAD && needed(c, id) && through_grad(c, g->nodes[id]))
            return rfi_error(RF_E_UNSUPPORTED,
                             "grad: nested gradients are not supported (%%%d is a grad inside "
                             "the region differentiated for %%%d)",
                             id, y->id);
    }
    memset(c->adj, 0, (size_t)g->n_nodes * sizeof *c->adj);
    for (int id = 0; id < g->n_nodes; id++)
        c->pads[id].n = 0;
    c->adj[y->id] = rfi_ad_scalar(c->ng, y->dtype, 1.0);
    if (!c->adj[y->id])
        return build_failure(c, y, "seeding the gradient of");
    for (int id = y->id; id >= 0; id--) {
        const rfi_node *x = g->nodes[id];
        rf_status st = c->pads[id].n > 0 ? settle(c, x) : RF_OK;
        if (st != RF_OK)
            return st;
        if (!c->adj[id] || !needed(c, id) || !rfi_dtype_is_float(x->dtype) ||
            (rfi_op_table[x->op].flags & (RFI_NOGRAD | RFI_LEAF)))
            continue;
        st = propagate(c, x);
        if (st != RF_OK)
            return st;
    }
    for (int id = 0; id < g->n_nodes; id++) {
        const rfi_node *x = g->nodes[id];
        if (x->op != RFI_OP_GRAD || x->in[0] != y)
            continue;
        const rfi_node *wrt = x->in[1];
        rfi_node *d = wrt->id <= y->id && rfi_dtype_is_float(wrt->dtype) ? c->adj[wrt->id] : NULL;
        if (!d)
            d = rfi_ad_full(c->ng, wrt->dtype, wrt->dims, wrt->rank, 0.0);
        if (!d)
            return build_failure(c, x, "making the zero gradient of");
        c->grad_of[id] = d;
    }
    return RF_OK;
}

static rf_status copy_node(ad_ctx *c, const rfi_node *x)
{
    if (x->op == RFI_OP_GRAD) {
        if (!c->grad_of[x->id]) {
            rf_status st = sweep(c, x->in[0]);
            if (st != RF_OK)
                return st;
        }
        c->map[x->id] = c->grad_of[x->id];
        return RF_OK;
    }
    for (int k = 0; k < x->n_in; k++)
        c->ins[k] = c->map[x->in[k]->id];
    c->map[x->id] = rfi_node_clone(c->ng, x, c->ins);
    return c->map[x->id] ? RF_OK : build_failure(c, x, "copying");
}

static rf_status run(ad_ctx *c)
{
    rf_status st = rfi_graph_new_like(c->g, &c->ng);
    for (int id = 0; st == RF_OK && id < c->g->n_nodes; id++)
        st = copy_node(c, c->g->nodes[id]);
    if (st == RF_OK)
        st = rfi_graph_copy_results(c->g, c->ng, c->map, NULL, NULL);
    return st;
}

rf_status rfi_autodiff(const rfi_graph *g, rfi_graph **out)
{
    if (!out)
        return rfi_error(RF_E_INVALID, "autodiff: NULL output pointer");
    *out = NULL;
    if (!g)
        return rfi_error(RF_E_INVALID, "autodiff: NULL graph");
    size_t n = g->n_nodes > 0 ? (size_t)g->n_nodes : 1;
    size_t max_in = (size_t)rfi_max_operands(g);
    ad_ctx c = {
        .g = g,
        .map = rfi_calloc(n, sizeof(rfi_node *)),
        .grad_of = rfi_calloc(n, sizeof(rfi_node *)),
        .from_wrt = rfi_calloc(n, sizeof(bool)),
        .to_y = rfi_calloc(n, sizeof(bool)),
        .is_wrt = rfi_calloc(n, sizeof(bool)),
        .adj = rfi_calloc(n, sizeof(rfi_node *)),
        .pads = rfi_calloc(n, sizeof(pad_list)),
        .ins = rfi_calloc(max_in, sizeof(rfi_node *)),
        .grads = rfi_calloc(max_in, sizeof(rfi_node *)),
        .want = rfi_calloc(max_in, sizeof(bool)),
    };
    rf_status st;
    if (!c.map || !c.grad_of || !c.from_wrt || !c.to_y || !c.is_wrt || !c.adj || !c.pads ||
        !c.ins || !c.grads || !c.want)
        st = rfi_error(RF_E_NOMEM, "autodiff: out of memory");
    else
        st = run(&c);
    rfi_free(c.map);
    rfi_free(c.grad_of);
    rfi_free(c.from_wrt);
    rfi_free(c.to_y);
    rfi_free(c.is_wrt);
    rfi_free(c.adj);
    for (int id = 0; c.pads && id < g->n_nodes; id++)
        rfi_free(c.pads[id].v);
    rfi_free(c.pads);
    rfi_free(c.ins);
    rfi_free(c.grads);
    rfi_free(c.want);
    if (st != RF_OK) {
        rfi_graph_free(c.ng);
        return st;
    }
    *out = c.ng;
    return RF_OK;
}
