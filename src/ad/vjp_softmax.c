/* vjp_softmax.c: the VJP of a softmax or a logsoftmax as one rule, read from
 * its result. rf_softmax and rf_logsoftmax are composites of primitives,
 *
 *   softmax     p = e / B(sum_A(e)),            e = exp(z)
 *   logsoftmax  y = z - B(log(sum_A(exp(z)))),
 *
 * (B broadcasts back along the reduced axes A; z is x shifted by its row
 * max, a stop_gradient), and op by op their backward pass would keep e and p
 * (softmax) or exp(z) and the row sum (logsoftmax) alive from the forward
 * pass. Written in terms of the result, as PyTorch does,
 *
 *   softmax     dz = p * (ct - B(sum_A(ct * p)))
 *   logsoftmax  dz = ct - exp(y) * B(sum_A(ct))
 *
 * the backward pass reads only the result and its cotangent. The autodiff
 * pass asks rfi_vjp_match_softmax about every node it differentiates; when
 * the node is the result of such a subgraph, the cotangent goes straight to
 * z and the nodes in between receive nothing from it. Other users of those
 * nodes still propagate through them by their own rules (the chain rule is
 * linear), so the match needs only the exact structure, not that the nodes
 * are private; the pass falls back to the op-by-op rules when one of them is
 * itself a tensor the gradient is taken with respect to.
 *
 * The structure is recognised, not recorded by the op API, so a softmax
 * written by hand from the same primitives gets the same backward pass, and
 * the traced program, its hash and the disk cache's codec see only
 * primitives.
 *
 * Deliberately not here: deciding what to differentiate and where the
 * cotangent goes (autodiff.c).
 */
#include <string.h>

#include "ad/vjp.h"

/* Records x among the nodes between z and the result; false when full. */
static bool note(rfi_softmax_match *m, const rfi_node *x)
{
    if (m->n_inner == RFI_SOFTMAX_INNER)
        return false;
    m->inner[m->n_inner++] = x;
    return true;
}

/* The first node under x that is not a RESHAPE (x itself when it is not),
 * noting the reshapes; NULL when there are too many to note. */
static const rfi_node *under_reshapes(rfi_softmax_match *m, const rfi_node *x)
{
    for (; x->op == RFI_OP_RESHAPE; x = x->in[0])
        if (!note(m, x))
            return NULL;
    return x;
}

/* Whether b (of z's dims) is a row quantity broadcast back along the axes
 * `reduced`: at most one BROADCAST_IN_DIM, of a value whose dims are z's
 * with those axes removed or set to 1 (so the value holds the row quantity
 * in row-major order, whatever reshapes lead to it). */
static bool is_unreduced(const rfi_node *b, const rfi_node *z, const bool *reduced)
{
    if (b->rank != z->rank || memcmp(b->dims, z->dims, sizeof(int64_t) * (size_t)z->rank) != 0)
        return false;
    if (b->op != RFI_OP_BROADCAST_IN_DIM) {
        for (int j = 0; j < z->rank; j++)
            if (reduced[j] && z->dims[j] != 1)
                return false;
        return true;
    }
    const rfi_node *x = b->in[0];
    const int64_t *map = b->attr.l[0];
    bool covered[RF_MAX_RANK] = {false};
    int64_t prev = -1;
    for (int k = 0; k < x->rank; k++) {
        const int64_t j = map[k];
        if (j <= prev || j >= z->rank)
            return false;
        prev = j;
        covered[j] = true;
        if (x->dims[k] != (reduced[j] ? 1 : z->dims[j]))
            return false;
    }
    for (int j = 0; j < z->rank; j++)
        if (!covered[j] && !reduced[j])
            return false;
    return true;
}

bool rfi_vjp_match_softmax(const rfi_node *y, rfi_softmax_match *m)
{
    memset(m, 0, sizeof *m);
    if (!rfi_dtype_is_float(y->dtype) || y->n_in != 2)
        return false;
    if (y->op == RFI_OP_DIV && y->in[0]->op == RFI_OP_EXP)
        m->log = false;
    else if (y->op == RFI_OP_SUB)
        m->log = true;
    else
        return false;
    const rfi_node *b = y->in[1];
    if (!note(m, b))
        return false;
    /* softmax: b = B(sum(e)), e = exp(z); logsoftmax: b = B(log(sum(exp(z)))) */
    const rfi_node *r = under_reshapes(m, b->op == RFI_OP_BROADCAST_IN_DIM ? b->in[0] : b);
    if (r && m->log)
        r = r->op == RFI_OP_LOG && note(m, r) ? under_reshapes(m, r->in[0]) : NULL;
    if (!r || r->op != RFI_OP_REDUCE || r->attr.i[0] != RF_REDUCE_SUM || r->attr.nl[0] == 0)
        return false;
    const rfi_node *e = r->in[0];
    if (e->op != RFI_OP_EXP || (m->log ? e->in[0] != y->in[0] : e != y->in[0]))
        return false;
    m->z = e->in[0];
    m->axes = r->attr.l[0];
    m->naxes = r->attr.nl[0];
    for (int k = 0; k < m->naxes; k++)
        m->reduced[m->axes[k]] = true;
    /* the reshapes between b's operand and r (or its log) keep the row-major order */
    if (!is_unreduced(b, m->z, m->reduced))
        return false;
    return note(m, r) && note(m, e);
}

rfi_node *rfi_vjp_softmax(rfi_graph *g, const rfi_softmax_match *m, rfi_node *y, rfi_node *ct)
{
    rfi_node *s;
    if (!m->log) {
        /* dz = p * (ct - B(sum(ct * p))) */
        s = rfi_ad_reduce(g, rfi_ad_binary(g, RFI_OP_MUL, ct, y), RF_REDUCE_SUM, m->axes,
                          m->naxes);
        s = rfi_ad_unreduce(g, s, y->dims, y->rank, m->axes, m->naxes);
        return rfi_ad_binary(g, RFI_OP_MUL, y, rfi_ad_binary(g, RFI_OP_SUB, ct, s));
    }
    /* dz = ct - exp(y) * B(sum(ct)) */
    s = rfi_ad_reduce(g, ct, RF_REDUCE_SUM, m->axes, m->naxes);
    s = rfi_ad_unreduce(g, s, y->dims, y->rank, m->axes, m->naxes);
    rfi_node *p = rfi_ad_unary(g, RFI_OP_EXP, y);
    return rfi_ad_binary(g, RFI_OP_SUB, ct, rfi_ad_binary(g, RFI_OP_MUL, p, s));
}
