/* table_reorder.h: reorders of small tensors (convolution kernels and their
 * gradients) between two oneDNN memory layouts as a table of source offsets,
 * instead of a oneDNN reorder primitive.
 *
 * Why: a oneDNN reorder is a JIT-compiled kernel, 40-110 us to create on
 * first use in a process, and a ResNet training step needs about a dozen
 * (one per kernel layout pair), about 1 ms of a warm compile that otherwise
 * takes ~10 ms. A kernel has at most a few thousand elements: walking a
 * table of int32 offsets over it costs microseconds per call, about what
 * calling the library costs, and building the table costs less than the
 * JIT. Activations keep oneDNN's reorders (conv.c uses tables for kernels
 * only): they are megabytes at training batch sizes, and oneDNN's reorders
 * run on every core.
 *
 * A table is owned by whoever made it (rfi_table_reorder_free).
 */
#ifndef RF_BACKEND_CPU_TABLE_REORDER_H
#define RF_BACKEND_CPU_TABLE_REORDER_H

#include <stdbool.h>
#include <stdint.h>

#include <oneapi/dnnl/dnnl.h>

#include "../../core/core.h"

/* Most elements (of the destination's span) a table reorder takes. */
#define RFI_TABLE_REORDER_MAX 65536

typedef struct rfi_table_reorder {
    int32_t *from;      /* per destination element: the source element's offset, or -1 */
    int64_t n;          /* destination elements (its span, padding included) */
    bool zero_unmapped; /* store 0 where from is -1 (padding), else leave those alone */
} rfi_table_reorder;

/* Whether a table can copy f32 tensors from `from`'s layout to `to`'s: both
 * plain or blocked (strides and inner blocks), same dims, and small. */
RFI_FUNC bool rfi_table_reorder_fits(const dnnl_memory_desc_t *from, const dnnl_memory_desc_t *to);

/* The table for from -> to (rfi_table_reorder_fits must hold). zero_unmapped:
 * the destination is scratch whose padding must read as zeros (an input
 * reordered for a primitive), rather than a buffer of the program (an
 * output, whose elements outside the tensor are not ours). */
RFI_FUNC rf_status rfi_table_reorder_make(const dnnl_memory_desc_t *from,
                                          const dnnl_memory_desc_t *to, bool zero_unmapped,
                                          rfi_table_reorder *t);

RFI_FUNC void rfi_table_reorder_run(const rfi_table_reorder *t, const float *from, float *to);

RFI_FUNC void rfi_table_reorder_free(rfi_table_reorder *t);

#endif
