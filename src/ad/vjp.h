/* vjp.h: the vector-Jacobian-product rules of the autodiff pass and the
 * small IR builders they share.
 *
 * A rule receives one node of the original program (for its attributes and
 * types), its operands and result as already copied into the graph being
 * built, and the cotangent of the result; it emits ordinary IR nodes into
 * that graph computing the cotangent of each operand it is asked for.
 * The rules live in vjp.c (elementwise), vjp_shape.c (shape, reduction,
 * indexing) and vjp_linalg.c (dot_general, convolution, windows); the
 * builders in vjp_build.c.
 *
 * Deliberately not here: which nodes get differentiated, accumulation of
 * several cotangents, and GRAD replacement (all in autodiff.c).
 */
#ifndef RF_AD_VJP_H
#define RF_AD_VJP_H

#include "ir/ir.h"

typedef struct rfi_vjp_args {
    rfi_graph *g;          /* the graph being built */
    const rfi_node *node;  /* the original node: op, attributes, types */
    rfi_node *const *in;   /* its operands, in g */
    rfi_node *out;         /* its result, in g */
    rfi_node *ct;          /* cotangent of the result (result's type), in g */
    const bool *want;      /* want[i]: the cotangent of operand i is needed */
} rfi_vjp_args;

/* Writes into grads[i] (pre-set to NULL) the cotangent of operand i for each
 * wanted operand that receives one; leaving it NULL means zero. Node
 * construction failures show as NULL results with the graph's sticky error
 * set (the caller checks it). Returns RF_OK or a status with a message for
 * differentiation the rule cannot do (RF_E_UNSUPPORTED). */
typedef rf_status (*rfi_vjp_fn)(const rfi_vjp_args *a, rfi_node **grads);

/* The rule of op; NULL for ops without gradient (RFI_NOGRAD, leaves) and for
 * ops whose derivative is zero everywhere it exists (floor, sign, ...), see
 * rfi_vjp_has_zero_rule. */
RFI_FUNC rfi_vjp_fn rfi_vjp_rule(rfi_op op);
/* True for differentiable-looking ops whose gradient is zero by definition. */
RFI_FUNC bool rfi_vjp_has_zero_rule(rfi_op op);

/* Rules by file (the table in vjp.c points at them). */
RFI_FUNC rf_status rfi_vjp_broadcast_in_dim(const rfi_vjp_args *a, rfi_node **grads);
RFI_FUNC rf_status rfi_vjp_reshape(const rfi_vjp_args *a, rfi_node **grads);
RFI_FUNC rf_status rfi_vjp_transpose(const rfi_vjp_args *a, rfi_node **grads);
RFI_FUNC rf_status rfi_vjp_slice(const rfi_vjp_args *a, rfi_node **grads);
RFI_FUNC rf_status rfi_vjp_concatenate(const rfi_vjp_args *a, rfi_node **grads);
RFI_FUNC rf_status rfi_vjp_pad(const rfi_vjp_args *a, rfi_node **grads);
RFI_FUNC rf_status rfi_vjp_reverse(const rfi_vjp_args *a, rfi_node **grads);
RFI_FUNC rf_status rfi_vjp_reduce(const rfi_vjp_args *a, rfi_node **grads);
RFI_FUNC rf_status rfi_vjp_gather(const rfi_vjp_args *a, rfi_node **grads);
RFI_FUNC rf_status rfi_vjp_scatter_add(const rfi_vjp_args *a, rfi_node **grads);
RFI_FUNC rf_status rfi_vjp_dot_general(const rfi_vjp_args *a, rfi_node **grads);
RFI_FUNC rf_status rfi_vjp_convolution(const rfi_vjp_args *a, rfi_node **grads);
RFI_FUNC rf_status rfi_vjp_reduce_window(const rfi_vjp_args *a, rfi_node **grads);
RFI_FUNC rf_status rfi_vjp_select_and_scatter(const rfi_vjp_args *a, rfi_node **grads);

/* ---- Composite rules (vjp_softmax.c) -------------------------------------------------- */

#define RFI_SOFTMAX_INNER 16

/* A softmax or logsoftmax found in the program: its operand z, the nodes
 * between z and the result, and the axes it normalises over. */
typedef struct rfi_softmax_match {
    bool log;                                     /* logsoftmax */
    const rfi_node *z;
    const rfi_node *inner[RFI_SOFTMAX_INNER];     /* strictly between z and the result */
    int n_inner;
    bool reduced[RF_MAX_RANK];                    /* reduced[d]: d is normalised over */
    const int64_t *axes;                          /* the same, sorted (the sum's list) */
    int naxes;
} rfi_softmax_match;

/* Whether y (a node of the program being differentiated) is the result of
 * exp(z) / B(sum(exp(z))) or z - B(log(sum(exp(z)))), B the broadcast back
 * along the summed axes, as rf_softmax and rf_logsoftmax build them; fills
 * *m when it is. */
RFI_FUNC bool rfi_vjp_match_softmax(const rfi_node *y, rfi_softmax_match *m);
/* The cotangent of m->z, from the result y and its cotangent ct (both in g):
 * y * (ct - B(sum(ct * y))), or ct - exp(y) * B(sum(ct)) for a logsoftmax.
 * NULL with g's error set when a node cannot be built. */
RFI_FUNC rfi_node *rfi_vjp_softmax(rfi_graph *g, const rfi_softmax_match *m, rfi_node *y,
                                   rfi_node *ct);

/* ---- IR builders (vjp_build.c) -------------------------------------------------------
 * Thin wrappers over rfi_node_new with exact IR semantics (no broadcasting,
 * no weak scalars, axes already normalised). Every builder returns NULL when
 * an operand is NULL or the node is rejected (graph error set). */
RFI_FUNC rfi_node *rfi_ad_scalar(rfi_graph *g, rf_dtype dt, double v);
RFI_FUNC rfi_node *rfi_ad_full(rfi_graph *g, rf_dtype dt, const int64_t *dims, int rank,
                               double v);
/* v in the type of x. */
RFI_FUNC rfi_node *rfi_ad_full_like(rfi_graph *g, const rfi_node *x, double v);
RFI_FUNC rfi_node *rfi_ad_unary(rfi_graph *g, rfi_op op, rfi_node *x);
RFI_FUNC rfi_node *rfi_ad_binary(rfi_graph *g, rfi_op op, rfi_node *a, rfi_node *b);
/* x * v (v a constant of x's type). */
RFI_FUNC rfi_node *rfi_ad_scale(rfi_graph *g, rfi_node *x, double v);
RFI_FUNC rfi_node *rfi_ad_compare(rfi_graph *g, rfi_node *a, rfi_node *b, int cmp);
RFI_FUNC rfi_node *rfi_ad_select(rfi_graph *g, rfi_node *pred, rfi_node *a, rfi_node *b);
/* pred ? x : 0 */
RFI_FUNC rfi_node *rfi_ad_mask(rfi_graph *g, rfi_node *pred, rfi_node *x);
RFI_FUNC rfi_node *rfi_ad_convert(rfi_graph *g, rfi_node *x, rf_dtype dt);
RFI_FUNC rfi_node *rfi_ad_broadcast(rfi_graph *g, rfi_node *x, const int64_t *dims, int rank,
                                    const int64_t *map);
/* Broadcasts x, whose dims are those of a `dims` tensor with `axes` removed
 * (the result of reducing over axes), back to dims. */
RFI_FUNC rfi_node *rfi_ad_unreduce(rfi_graph *g, rfi_node *x, const int64_t *dims, int rank,
                                   const int64_t *axes, int naxes);
RFI_FUNC rfi_node *rfi_ad_reshape(rfi_graph *g, rfi_node *x, const int64_t *dims, int rank);
/* Identity permutations return x itself. */
RFI_FUNC rfi_node *rfi_ad_transpose(rfi_graph *g, rfi_node *x, const int64_t *perm);
/* axes sorted and unique; naxes 0 returns x itself. */
RFI_FUNC rfi_node *rfi_ad_reduce(rfi_graph *g, rfi_node *x, int kind, const int64_t *axes,
                                 int naxes);
RFI_FUNC rfi_node *rfi_ad_sum_all(rfi_graph *g, rfi_node *x);
/* stride NULL: all 1. */
RFI_FUNC rfi_node *rfi_ad_slice(rfi_graph *g, rfi_node *x, const int64_t *start,
                                const int64_t *limit, const int64_t *stride);
/* Pads with the scalar node v; interior NULL: none. */
RFI_FUNC rfi_node *rfi_ad_pad(rfi_graph *g, rfi_node *x, rfi_node *v, const int64_t *lo,
                              const int64_t *hi, const int64_t *interior);
RFI_FUNC rfi_node *rfi_ad_reverse(rfi_graph *g, rfi_node *x, const int64_t *axes, int naxes);
/* The n >= 2 nodes xs, of one dtype and rank, joined along axis. */
RFI_FUNC rfi_node *rfi_ad_concat(rfi_graph *g, rfi_node *const *xs, int n, int axis);
/* A dot_general of the given precision (attr i[0], rf_precision). */
RFI_FUNC rfi_node *rfi_ad_dot(rfi_graph *g, rfi_node *a, rfi_node *b, const int64_t *lb,
                              const int64_t *rb, int nb, const int64_t *lc, const int64_t *rc,
                              int nc, int64_t precision);
RFI_FUNC rfi_node *rfi_ad_gather(rfi_graph *g, rfi_node *x, rfi_node *idx, int64_t axis);
RFI_FUNC rfi_node *rfi_ad_scatter_add(rfi_graph *g, rfi_node *x, rfi_node *idx, rfi_node *upd,
                                      int64_t axis);
/* A REDUCE_WINDOW or SELECT_AND_SCATTER node with these window attributes
 * (kind is ignored by SELECT_AND_SCATTER). */
RFI_FUNC rfi_node *rfi_ad_window_op(rfi_graph *g, rfi_op op, rfi_node *const *in, int n_in,
                                    int kind, const int64_t *window, const int64_t *strides,
                                    const int64_t *lo, const int64_t *hi, int rank);
/* True if x has the dtype and dims of y. */
RFI_FUNC bool rfi_ad_same_type(const rfi_node *x, const rfi_node *y);

#endif
