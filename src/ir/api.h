/* api.h: helpers shared by the public op layer (api_elementwise.c,
 * api_shape.c, api_nn.c): argument checks that record "rf_<name>: ..."
 * messages on the operand's graph, and weak-scalar resolution.
 *
 * Deliberately not here: shape inference (rfi_infer in the IR) and anything
 * that builds composite ops (those go through the public functions).
 */
#ifndef RF_IR_API_H
#define RF_IR_API_H

#include "ir.h"

/* Room for "f32[...]" of rank RF_MAX_RANK with 20-digit dims. */
#define RFI_TYPE_STR_MAX 200

/* "f32[16,8]" of node x, in a buffer that lives until the end of the full
 * expression's enclosing block (a compound literal). */
#define RFI_TSTR(x) \
    rfi_type_str((char[RFI_TYPE_STR_MAX]){0}, RFI_TYPE_STR_MAX, (x)->dtype, (x)->dims, (x)->rank)
/* Same for a bare shape of dtype dt. */
#define RFI_SSTR(dt, dims, rank) \
    rfi_type_str((char[RFI_TYPE_STR_MAX]){0}, RFI_TYPE_STR_MAX, (dt), (dims), (rank))

/* Normalises a possibly negative axis of a rank-`rank` tensor into *out;
 * on failure records RF_E_INVALID "<fn>: axis A out of range for <type of x>"
 * on x's graph and returns false. */
RFI_FUNC bool rfi_api_axis(const char *fn, const rfi_node *x, int64_t axis, int rank, int *out);

/* Normalises, checks and sorts naxes axes of x into out (naxes <= RF_MAX_RANK,
 * no duplicates). Records RF_E_INVALID on failure and returns false. */
RFI_FUNC bool rfi_api_axes(const char *fn, const rfi_node *x, const int64_t *axes, int naxes,
                           int64_t *out);

/* Checks that a and b (non-NULL) belong to one graph; records RF_E_INVALID
 * on a's graph otherwise. */
RFI_FUNC bool rfi_api_same_graph(const char *fn, const rfi_node *a, const rfi_node *b);

/* A weak scalar (rf_scalar) re-typed as a rank-0 CONSTANT of dt (x itself
 * when it is not weak or already dt). NULL on failure (graph error set, named
 * fn): also when dt is integer or bool and the value is not one of dt's. */
RFI_FUNC rfi_node *rfi_api_weak_as(const char *fn, rfi_node *x, rf_dtype dt);

/* Writes v converted to dt (saturating for integers, != 0 for bool) at dst. */
RFI_FUNC void rfi_api_store(rf_dtype dt, double v, void *dst);

#endif
