/* passes.h: helpers shared by the graph-to-graph passes (autodiff, DCE, ...):
 * starting a copy of a graph that keeps its arguments and captures in place,
 * and the optimisation passes of the compiling backends (simplify, CSE,
 * merge_dots, unroll_pools).
 *
 * Deliberately not here: the pipeline passes autodiff and DCE (declared in
 * runtime.h).
 */
#ifndef RF_PASSES_H
#define RF_PASSES_H

#include "ir/ir.h"

/* A new empty graph with g's device, name and argument types, and g's
 * captures re-added in order (so capture indices are equal) and its RNG
 * stream count. On failure returns the status (message set), *out NULL. */
RFI_FUNC rf_status rfi_graph_new_like(const rfi_graph *g, rfi_graph **out);

/* Re-adds g's outputs in order and its updates into copy, mapping each node
 * through map (indexed by g's node ids; every one must be non-NULL) and each
 * updated capture through new_capture (g's index -> copy's; NULL: the same).
 * The updates go in the order of update_order (a permutation of g's update
 * indices; NULL: g's order). */
RFI_FUNC rf_status rfi_graph_copy_results(const rfi_graph *g, rfi_graph *copy,
                                          rfi_node *const *map, const int *new_capture,
                                          const int *update_order);

/* A rewrite of node n of the graph being copied into c, its operands already
 * copied (in; map: every node copied so far, by the old graph's ids): the
 * node that stands for n, or NULL to copy n as it is (or on an error, with
 * c's status set). */
typedef rfi_node *(*rfi_rewrite_fn)(void *ctx, rfi_graph *c, const rfi_node *n,
                                    rfi_node *const *in, rfi_node *const *map);
/* A copy of g made node by node in SSA order through rewrite (NULL: none),
 * which must keep each node's type (RF_E_INTERNAL naming the node
 * otherwise), with g's outputs and updates, then DCE. `what` names the pass
 * in messages. */
RFI_FUNC rf_status rfi_rewrite_graph(const rfi_graph *g, const char *what,
                                     rfi_rewrite_fn rewrite, void *ctx, rfi_graph **out);

/* Algebraic simplification, constant folding (operands and result of at most
 * 4096 elements; elementwise ops over splats of any size) and canonical
 * broadcast/reshape/transpose/convert chains; constants whose elements are all
 * equal become broadcast_in_dim of a rank-0 constant. Exact: the result
 * computes bitwise the same outputs and updates on the interpreter (see
 * simplify.c for the rules left out on purpose). Keeps argument and capture
 * indices, outputs in order and updates; leaves no dead nodes. */
RFI_FUNC rf_status rfi_simplify(const rfi_graph *g, rfi_graph **out);

/* Common-subexpression elimination by structural hashing: a copy of g in
 * which equal nodes (op, type, attributes, constant bytes, operands) are one
 * node. Keeps argument and capture indices, outputs in order and updates. */
RFI_FUNC rf_status rfi_cse(const rfi_graph *g, rfi_graph **out);

/* Max pools over non-overlapping, unpadded float windows of at most 16
 * points, and their gradients (select_and_scatter), as elementwise ops over
 * the windows' strided slices, the gradient reading a code per window
 * that records where its maximum was (pools.c). Exact, like rfi_simplify,
 * except that a sum of such a gradient over its window becomes the same sum
 * of its cotangent (reordered terms), and that a convolution over the zero
 * border of such a gradient takes it as padding and gives +0 where it read
 * only padding (NaN there for an infinite kernel).
 * RF_UNROLL_POOLS=0 in the environment: a plain copy. */
RFI_FUNC rf_status rfi_unroll_pools(const rfi_graph *g, rfi_graph **out);
/* Whether rfi_unroll_pools unrolls (RF_UNROLL_POOLS is not "0"). */
RFI_FUNC bool rfi_unroll_pools_enabled(void);

/* A sum of matrix products of one form (no batch dims, one contracted dim,
 * the same dims but that one, each used only by the sum, bare or under one
 * transpose) becomes one product of the operands concatenated along the
 * contracted dim, where those hold no more elements than the products'
 * results (merge_dots.c): a weight's gradient over the time steps of a
 * recurrent cell is one product instead of one per step. Exact in real
 * arithmetic only (the products' terms are summed in another order).
 * RF_MERGE_DOTS=0 in the environment: a plain copy (then DCE). */
RFI_FUNC rf_status rfi_merge_dots(const rfi_graph *g, rfi_graph **out);
/* Whether rfi_merge_dots merges (RF_MERGE_DOTS is not "0"). */
RFI_FUNC bool rfi_merge_dots_enabled(void);
/* Small matrix products of one right operand (no batch dims, one contracted
 * dim, a rank-2 left operand contracted along dim 1) whose left operands do
 * not depend on the group's results become one product of the left operands
 * concatenated along their rows, each result a slice of its rows
 * (stack_dots.c): an RNN's input projection over its time steps is one
 * product instead of one per step. Exact. RF_STACK_DOTS=0 in the
 * environment: a plain copy (then DCE). */
RFI_FUNC rf_status rfi_stack_dots(const rfi_graph *g, rfi_graph **out);
/* Whether rfi_stack_dots stacks (RF_STACK_DOTS is not "0"). */
RFI_FUNC bool rfi_stack_dots_enabled(void);
/* A float variance's sum of squared deviations from a mean taken in the same
 * program, sum((x - sum(x) / n)^2) over the axes of that sum with x f32,
 * and the mean's sum become one pass of f64 sums about a shift (moments.c):
 * BatchNorm's statistics read their input once, not twice. Exact in real
 * arithmetic only. RF_ONE_PASS_MOMENTS=0 in the environment: a plain copy
 * (then DCE). */
RFI_FUNC rf_status rfi_one_pass_moments(const rfi_graph *g, rfi_graph **out);
/* Whether rfi_one_pass_moments rewrites (RF_ONE_PASS_MOMENTS is not "0"). */
RFI_FUNC bool rfi_one_pass_moments_enabled(void);
/* A relu's gradient mask compare(max(z, 0), 0, gt) becomes compare(z, 0, gt)
 * (exact) where z is arithmetic over one value of its shape that has other
 * users, and broadcasts (relu_masks.c): after a BatchNorm, whose backward
 * pass reads its input anyway, the mask no longer reads the stored relu.
 * RF_RELU_MASKS=0 in the environment: a plain copy (then DCE). */
RFI_FUNC rf_status rfi_relu_masks(const rfi_graph *g, rfi_graph **out);
/* Whether rfi_relu_masks rewrites (RF_RELU_MASKS is not "0"). */
RFI_FUNC bool rfi_relu_masks_enabled(void);
/* A float sum of a product (mul and neg) some of whose factors are constant
 * along the sum's axes (broadcasts of per-kept-point values) becomes those
 * factors times the sum of the others, where another sum over those axes has
 * the same other factors (sum_factors.c): BatchNorm's backward pass sums two
 * values a point instead of four once CSE merges the equal sums left. Exact
 * in real arithmetic only. RF_SUM_FACTORS=0 in the environment: a plain copy
 * (then DCE). */
RFI_FUNC rf_status rfi_sum_factors(const rfi_graph *g, rfi_graph **out);
/* Whether rfi_sum_factors rewrites (RF_SUM_FACTORS is not "0"). */
RFI_FUNC bool rfi_sum_factors_enabled(void);
/* Each convolution with non-negative padding or lhs dilation for which
 * as_loops holds (the backend computes it as generated loops) becomes the
 * same convolution, unpadded and undilated, of its input padded (and
 * dilated) by a PAD of zeros: exact (pad_convs.c says why). Ends with DCE. */
RFI_FUNC rf_status rfi_pad_convs(const rfi_graph *g, bool (*as_loops)(const rfi_node *conv),
                                 rfi_graph **out);

#endif
