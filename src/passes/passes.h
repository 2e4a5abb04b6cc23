/* passes.h: helpers shared by the graph-to-graph passes (autodiff, DCE, ...):
 * starting a copy of a graph that keeps its arguments and captures in place.
 *
 * Deliberately not here: the passes themselves (declared in runtime.h).
 */
#ifndef RF_PASSES_H
#define RF_PASSES_H

#include "ir/ir.h"

/* A new empty graph with g's device, name and argument types, and g's
 * captures re-added in order (so capture indices are equal) and its RNG
 * stream count. On failure returns the status (message set), *out NULL. */
RFI_FUNC rf_status rfi_graph_new_like(const rfi_graph *g, rfi_graph **out);

/* Re-adds g's outputs and updates in order into copy, mapping each node
 * through map (indexed by g's node ids; every one must be non-NULL). */
RFI_FUNC rf_status rfi_graph_copy_results(const rfi_graph *g, rfi_graph *copy,
                                          rfi_node *const *map);

#endif
