/* relu_masks.c: a relu's gradient mask taken from its pre-activation where
 * computing that reads nothing the mask's readers do not read anyway
 * (rfi_relu_masks).
 *
 * Why: the gradient of y = max(z, 0) is select(y > 0, dy, 0). It reads the
 * result y so that z need not be stored for the backward pass, which is right
 * after a dense layer (z is the matrix product plus a bias, computed inside
 * the product's call). After a batch normalisation it is a stream too many: z
 * is x normalised by per-channel vectors, and BatchNorm's backward pass reads
 * x anyway (for the normalised values), so the mask computed from x costs
 * nothing, while the mask from y made both of its passes (the sums and the
 * input gradient) read a third [128,16,28,28] value in the ResNet step.
 *
 * The rule: compare(max(z, 0), 0, gt) with zeros of either sign becomes
 * compare(z, 0, gt) (exact: the two agree on every z, NaN and -0 included)
 * when z is an arithmetic expression (add, sub, mul, div, neg) over values of
 * its own shape and broadcasts of smaller ones that reads exactly one value X
 * of its shape, and X has other users than z's expression: a value read
 * elsewhere (a convolution's output that BatchNorm's statistics and gradient
 * read), not the product whose bias and relu its call computes.
 *
 * Deliberately not here: a z that reads two values of its size (a residual
 * add before the relu: the mask from y reads one), and math functions in z
 * (recomputing them costs more than a read).
 */
#include <stdlib.h>
#include <string.h>

#include "passes/passes.h"
#include "runtime/runtime.h"

enum { MAX_DEPTH = 8 };

typedef struct masks {
    int *uses; /* rfi_use_counts of the graph */
} masks;

/* Whether x is a zero of either sign as a splat (a rank-0 constant or its broadcast). */
static bool zero_splat(const rfi_node *x)
{
    x = rfi_splat_scalar(x);
    if (!x || !x->attr.data || (x->dtype != RF_F32 && x->dtype != RF_F64))
        return false;
    return rfi_element_as_double(x->dtype, x->attr.data, 0) == 0.0;
}

static bool arithmetic(rfi_op op)
{
    return op == RFI_OP_ADD || op == RFI_OP_SUB || op == RFI_OP_MUL || op == RFI_OP_DIV ||
           op == RFI_OP_NEG;
}

/* Whether operand y of an expression of x's shape is free to read: a scalar,
 * or a broadcast of a smaller value (a per-channel vector stays in cache). */
static bool small_operand(const rfi_node *x, const rfi_node *y)
{
    return y->rank == 0 || (y->op == RFI_OP_BROADCAST_IN_DIM &&
                            rfi_node_numel(y->in[0]) < rfi_node_numel(y)) ||
           rfi_node_numel(y) < rfi_node_numel(x);
}

/* Walks expression z (see the rule): every value of z's shape it reads that
 * is not arithmetic itself must be *stream (set at the first). false when it
 * reads another one, or the expression is deeper than MAX_DEPTH. */
static bool one_stream(const rfi_node *z, const rfi_node *x, const rfi_node **stream, int depth)
{
    if (small_operand(z, x))
        return true;
    if (!rfi_node_same_dims(x, z))
        return false;
    if (!arithmetic(x->op)) {
        if (*stream && *stream != x)
            return false;
        *stream = x;
        return true;
    }
    if (depth == MAX_DEPTH)
        return false;
    for (int k = 0; k < x->n_in; k++)
        if (!one_stream(z, x->in[k], stream, depth + 1))
            return false;
    return true;
}

/* The pre-activation z whose mask n can be computed from instead of y (see
 * the rule), or NULL. */
static const rfi_node *masked_preactivation(const masks *m, const rfi_node *n)
{
    if (n->op != RFI_OP_COMPARE || n->attr.i[0] != RF_GT || !zero_splat(n->in[1]))
        return NULL;
    const rfi_node *y = n->in[0];
    if (y->op != RFI_OP_MAX || !zero_splat(y->in[1]) || !rfi_dtype_is_float(y->dtype))
        return NULL;
    const rfi_node *z = y->in[0], *stream = NULL;
    if (!arithmetic(z->op) || !one_stream(z, z, &stream, 0) || !stream)
        return NULL;
    return m->uses[stream->id] >= 2 ? z : NULL;
}

/* A copy in c of z's arithmetic over the copies (map) of the values it
 * reads. The mask reads its own copy: sharing z's nodes would give the
 * normalisation's x - mean more readers than the plan evaluates inline, and
 * it would be stored (a write of the whole activation), where the copy is
 * evaluated inside the steps that read the mask, from X. */
static rfi_node *copy_expression(rfi_graph *c, const rfi_node *z, const rfi_node *x,
                                 rfi_node *const *map)
{
    if (small_operand(z, x) || !arithmetic(x->op))
        return map[x->id];
    rfi_node *in[2] = {NULL, NULL};
    for (int k = 0; k < x->n_in; k++)
        if (!(in[k] = copy_expression(c, z, x->in[k], map)))
            return NULL;
    return rfi_node_new(c, x->op, in, x->n_in, &x->attr, x->dtype, NULL, 0);
}

/* rfi_rewrite_fn: such a compare reads a copy of z; other nodes are copied. */
static rfi_node *rewrite_mask(void *ctx, rfi_graph *c, const rfi_node *n, rfi_node *const *in,
                              rfi_node *const *map)
{
    const rfi_node *z = masked_preactivation(ctx, n);
    if (!z)
        return NULL;
    rfi_node *operands[2] = {copy_expression(c, z, z, map), in[1]};
    if (!operands[0])
        return NULL;
    return rfi_node_new(c, RFI_OP_COMPARE, operands, 2, &n->attr, RF_BOOL, NULL, 0);
}

bool rfi_relu_masks_enabled(void)
{
    const char *v = getenv("RF_RELU_MASKS");
    return !(v && strcmp(v, "0") == 0);
}

rf_status rfi_relu_masks(const rfi_graph *g, rfi_graph **out)
{
    if (!out || !g)
        return rfi_error(RF_E_INVALID, "relu_masks: NULL %s", g ? "output pointer" : "graph");
    *out = NULL;
    masks m = {rfi_use_counts(g)};
    if (!m.uses)
        return rfi_error(RF_E_NOMEM, "relu_masks: out of memory");
    rfi_rewrite_fn rewrite = rfi_relu_masks_enabled() ? rewrite_mask : NULL;
    rf_status st = rfi_rewrite_graph(g, "relu_masks", rewrite, &m, out);
    rfi_free(m.uses);
    return st;
}
