/* kir_lower.h: the lowering's state and the helpers kir_lower.c (loops,
 * values, the module) shares with kir_lower_reduce.c (REDUCE kernels and the
 * pieces of padded windows). Internal to those two files. */
#ifndef RF_BACKEND_KIR_LOWER_H
#define RF_BACKEND_KIR_LOWER_H

#include <string.h>

#include "kir.h"

/* ---- Index vectors ------------------------------------------------------------- */
typedef struct kidx {
    int rank;
    int64_t dims[RF_MAX_RANK];
    int lin;              /* instruction of the row-major linear index, or -1 */
    bool has_m;
    int m[RF_MAX_RANK];   /* instructions of the multi-index (when has_m) */
} kidx;

typedef struct memo_entry {
    int node, nkey, value;
    int key[RF_MAX_RANK + 1];
} memo_entry;

/* The state of lowering one plan: the kernel being built and its memo. */
typedef struct lower {
    const rfi_plan *p;
    const rfi_graph *g;
    rfi_kir_kernel *k;
    const bool *is_root;   /* per node: a root of the step being lowered */
    bool flat;             /* the root index is a flat loop over all elements */
    bool wants_multi;      /* a multi-index was derived from a flat index */
    memo_entry *memo;
    int memo_cap, memo_n;
    /* While a REDUCE epilogue is lowered: the inline reduction it reads and
     * the instruction holding the reduction's value at the point (-1: none). */
    int fold_node, fold_value;
    rf_status status; /* first error not reported through a return value */
} lower;

static inline kidx idx_scalar(lower *L)
{
    kidx ix;
    memset(&ix, 0, sizeof ix);
    ix.lin = rfi_kir_const_i(L->k, RF_I64, 0);
    ix.has_m = true;
    return ix;
}

static inline kidx idx_multi_of(const rfi_node *n, const int *m)
{
    kidx ix;
    memset(&ix, 0, sizeof ix);
    ix.rank = n->rank;
    memcpy(ix.dims, n->dims, sizeof(int64_t) * (size_t)n->rank);
    ix.lin = n->rank == 1 ? m[0] : -1;
    ix.has_m = true;
    memcpy(ix.m, m, sizeof(int) * (size_t)n->rank);
    return ix;
}

static inline int cst(lower *L, int64_t v)
{
    return rfi_kir_const_i(L->k, RF_I64, v);
}

static inline int iop(lower *L, rfi_kir_op op, int a, int b)
{
    return rfi_kir_index(L->k, op, a, b);
}

/* A box of a result: [lo[d], hi[d]) along each dim. */
typedef struct box {
    int64_t lo[RF_MAX_RANK], hi[RF_MAX_RANK];
} box;

/* The most pieces a padded window runs as: two edges per dim and an interior. */
#define MAX_PIECES (2 * RF_MAX_RANK + 1)
/* The most operands of a concatenation a LOOP step is split along, a kernel each
 * (kir_lower.c splitting_concat); one with more selects among them per element. */
#define MAX_CONCAT_PIECES 1024

/* ---- kir_lower.c ------------------------------------------------------------------ */
/* RF_E_INTERNAL naming step, node and op: n has no form the lowering knows. */
RFI_FUNC rf_status rfi_lower_unsupported(lower *L, const rfi_node *n, const char *why);
/* The value of x at multi-index m (x's rank), or at the scalar index. */
RFI_FUNC rf_status rfi_lower_operand_at(lower *L, const rfi_node *x, const int *m, int *out);
/* min(max(q, 0), hi): an index clamped into [0, hi]. */
RFI_FUNC int rfi_lower_clamp_index(lower *L, int q, int64_t hi);
/* The index along a dim of the given extent: constant 0 for extent 1 (no
 * loop), else a new outer or inner loop variable. */
RFI_FUNC int rfi_lower_loop_var(lower *L, int64_t extent, bool inner);
RFI_FUNC void rfi_lower_kernel_name(rfi_kir_kernel *k, const rfi_node *root);
/* Stores value as root r at index ix. */
RFI_FUNC rf_status rfi_lower_store_root(lower *L, const rfi_node *r, kidx *ix, int value);
/* The outer loops of a REDUCE step's result n, in m. */
RFI_FUNC void rfi_lower_reduce_loops(lower *L, const rfi_step *st, const rfi_node *n, int *m);

/* ---- kir_lower_reduce.c ------------------------------------------------------------ */
/* One REDUCE kernel over the result's box `part` (the whole result but for
 * the pieces of a padded window). */
RFI_FUNC rf_status rfi_lower_reduce(lower *L, const rfi_step *st, const box *part);
/* A padded reduce_window's pieces: boxes[0..*count) and their names; false
 * when the window is not padded or has no interior. */
RFI_FUNC bool rfi_lower_window_pieces(const rfi_node *n, box *boxes, char (*names)[24],
                                      int *count);

#endif
