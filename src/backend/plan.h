/* plan.h: the execution plan a compiling backend (cpu now, cuda next) builds
 * from an optimised program: which nodes are materialised and where their
 * bytes live (memory planning), and the ordered steps that compute them
 * (fusion). Backend-independent: the plan says nothing about C or CUDA.
 *
 * Fusion model. A node is either materialised (it has a buffer) or INLINE:
 * recomputed inside every step that uses it, at the indices that step needs.
 * A LOOP step computes one or more materialised roots of identical shape in
 * one loop nest (or, segmented, roots that are contiguous pieces of one flat
 * loop: see rfi_plan.seg_extent); every inline producer of a root (elementwise ops,
 * broadcast_in_dim, transpose, slice, reverse, reshape, iota, pad,
 * concatenate, convert, select, compare, scalar constants) is fused into that
 * loop. A REDUCE step computes one REDUCE / REDUCE_WINDOW / small DOT_GENERAL
 * root with its inline producers fused into the accumulation (or several
 * sibling reductions folded side by side, or an elementwise root computed
 * from an inline reduction after its fold: a REDUCE epilogue). CALL steps are
 * runtime calls (matmul and convolution through the math library, and any op
 * the lowering has no loop form for, evaluated by the reference kernels).
 *
 * Buffers. Every materialised node has a location: an argument, a capture, a
 * constant's payload, an output buffer, the arena (offset fixed at plan time,
 * reused across non-overlapping lifetimes), an alias of another materialised
 * node (reshape/stop_gradient of a materialised value), or IN PLACE: the
 * value of an update written straight into its captured array, when no later
 * step reads the old value and the step that writes it reads the capture only
 * at the index it writes. Updates not planned in place are computed into the
 * arena and copied into their capture by the last steps of the program, after
 * every other read of the old value.
 *
 * Layouts. A buffer holds its node row-major, except the activations the
 * layout pass (layout.c) keeps in a convolution's layout, the same bytes
 * reordered: channel-blocked, an [N, C, H, W] arena value with C a multiple
 * of the block B stored as [N, C/B, H, W, B] (oneDNN's nChw8c or nChw16c:
 * RFI_LAYOUT_C8 or RFI_LAYOUT_C16, whichever the CPU's vectors hold), or,
 * with other channel counts, RFI_LAYOUT_NHWC (channels last). Every step
 * addresses such a buffer through rfi_layout_offset's mapping.
 */
#ifndef RF_BACKEND_PLAN_H
#define RF_BACKEND_PLAN_H

#include "../runtime/runtime.h"

typedef enum rfi_layout {
    RFI_LAYOUT_PLAIN = 0, /* row-major */
    RFI_LAYOUT_NHWC,      /* [N, C, H, W] stored as [N, H, W, C] (channels last) */
    RFI_LAYOUT_C8,        /* [N, C, H, W] stored as [N, C/8, H, W, 8] */
    RFI_LAYOUT_C16,       /* [N, C, H, W] stored as [N, C/16, H, W, 16] */
} rfi_layout;

/* Channels per block of a channel-blocked layout; 0 for the others. */
static inline int rfi_layout_block(rfi_layout l)
{
    return l == RFI_LAYOUT_C8 ? 8 : l == RFI_LAYOUT_C16 ? 16 : 0;
}
static inline bool rfi_layout_blocked(rfi_layout l) { return rfi_layout_block(l) > 0; }

typedef enum rfi_step_kind {
    RFI_STEP_LOOP,   /* fused elementwise loop nest over the roots' shape */
    RFI_STEP_REDUCE, /* a reduction (REDUCE, REDUCE_WINDOW, small DOT_GENERAL): rfi_step.core */
    RFI_STEP_CALL,   /* runtime call: MATMUL, CONVOLUTION, or FALLBACK (reference kernel) */
    RFI_STEP_COPY,   /* copy a materialised value to an output or a capture (updates) */
    RFI_STEP_KIND_COUNT
} rfi_step_kind;

typedef enum rfi_call_kind {
    RFI_CALL_NONE = 0,
    RFI_CALL_MATMUL,   /* DOT_GENERAL through the math library */
    RFI_CALL_CONV,     /* CONVOLUTION (any form) through the math library */
    RFI_CALL_FALLBACK, /* any single node, evaluated by the reference kernels */
} rfi_call_kind;

/* Epilogue of a CALL step (MATMUL, CONV): elementwise ops applied to the
 * library's result before it is stored, in order. The step's root is the last
 * op's node; the library node (rfi_step.core) and every op's node but the last
 * are inline (computed inside the call, no buffer). */
typedef enum rfi_epi_kind {
    RFI_EPI_BIAS,     /* + operand (rank 1) broadcast along result dim `axis` */
    RFI_EPI_ADD,      /* + operand of the result's own shape (a residual) */
    RFI_EPI_RELU,     /* max(v, 0), NaN propagating */
    RFI_EPI_TANH,
    RFI_EPI_LOGISTIC,
    RFI_EPI_KIND_COUNT
} rfi_epi_kind;

#define RFI_EPI_MAX 4 /* the most ops one epilogue holds */
#define RFI_MAX_SIBLINGS 4 /* the most reductions one REDUCE step folds side by side */

typedef struct rfi_epi_op {
    rfi_epi_kind kind;
    int node;    /* the IR node this op computes */
    int operand; /* BIAS / ADD: the materialised node added; else -1 */
    int axis;    /* BIAS: the result dim the vector runs along; else -1 */
} rfi_epi_op;

typedef enum rfi_copy_scratch {
    RFI_COPY_DIRECT,       /* roots[0] -> the output or capture */
    RFI_COPY_TO_SCRATCH,   /* roots[0] -> the copy scratch */
    RFI_COPY_FROM_SCRATCH, /* the copy scratch (roots[0]'s type) -> the capture */
} rfi_copy_scratch;

typedef struct rfi_step {
    rfi_step_kind kind;
    rfi_call_kind call;  /* for RFI_STEP_CALL */
    int *roots;          /* node ids materialised by this step (plan arena) */
    int n_roots;
    int *fused;          /* inline node ids computed inside this step (for comments, tests) */
    int n_fused;
    /* RFI_STEP_COPY: copy node roots[0] to the output or capture below; or,
     * to break a cycle of captures copied from each other (a swap), roots[0]'s
     * bytes into the plan's copy scratch, then the scratch into the capture. */
    int copy_to_output;  /* output index, or -1 */
    int copy_to_capture; /* capture index, or -1 */
    rfi_copy_scratch copy_scratch;
    /* RFI_STEP_CALL: the node the call computes (roots[0] unless an epilogue
     * follows it) and the epilogue (n_epilogue == 0: none). RFI_STEP_REDUCE:
     * the reduction folded: roots[0], or an inline reduction whose one root
     * roots[0] is computed from after the fold (plan opts reduce_epilogues;
     * n_epilogue 0). Other steps: -1. */
    int core;
    rfi_epi_op *epilogue;
    int n_epilogue;
    /* A LOOP step whose one root a direct convolution computes itself as it
     * reads it (the spread output gradient of kir.h): the step is not run and
     * its root is RFI_LOC_UNSTORED. */
    bool left_out;
    /* A CALL CONV step the backend computes in its own generated loops (a
     * direct convolution: kir.h rfi_kir_direct_conv), decided once before
     * memory planning; the plan's later passes, the lowering and the
     * services read this instead of asking again. */
    bool direct;
    /* A CALL CONV step whose direct convolution runs the next step, a pool
     * over its result, row by row (kir.h pool_step): the convolution's
     * operands live until that step, so the pool's results never share
     * their bytes, and its result is RFI_LOC_TILE when one image's window
     * rows fit the convolution's tile (rfi_kir_conv tile_floats). */
    bool runs_pool;
    /* A library CALL step that may run at the same time as the next step,
     * another that does not read its result (a layer's input and weight
     * gradients), each on one thread (cpu/services.c): the two live as one
     * step for memory planning, and the module calls only this one. */
    bool runs_with_next;
} rfi_step;

typedef enum rfi_loc_kind {
    RFI_LOC_INLINE = 0, /* not materialised */
    RFI_LOC_ARG,        /* index = argument */
    RFI_LOC_CAPTURE,    /* index = capture (read-only unless written IN_PLACE) */
    RFI_LOC_CONST,      /* index = constant slot (plan->consts) */
    RFI_LOC_ARENA,      /* offset in the arena */
    RFI_LOC_OUTPUT,     /* index = output buffer, written directly */
    RFI_LOC_IN_PLACE,   /* index = capture: an update value written into its capture */
    RFI_LOC_ALIAS,      /* same bytes as node `alias` (a materialised node) */
    RFI_LOC_UNSTORED,   /* the root of a left-out step (rfi_step): no bytes */
    RFI_LOC_TILE,       /* the result of a convolution that runs its pool: no arena
                         * bytes, the rows the pool reads are in the convolution's tile */
    RFI_LOC_KIND_COUNT
} rfi_loc_kind;

typedef struct rfi_loc {
    rfi_loc_kind kind;
    int index;
    size_t offset;
    int alias;
} rfi_loc;

/* The buffer table every step addresses: buffer b is
 *   [0, n_args)                          arguments
 *   [n_args, +n_captures)                captures
 *   [.., +n_outputs)                     outputs
 *   next                                 the arena
 *   [.., +n_consts)                      constant payloads (plan->consts[i] is a node id)
 * rfi_plan_buffer() maps a location to (buffer index, byte offset). */
typedef struct rfi_plan {
    const rfi_graph *g;  /* borrowed: the program the plan was built from */
    rfi_loc *loc;        /* per node id */
    rfi_step *steps;
    int n_steps;
    int *consts;         /* node ids of materialised CONSTANT nodes */
    int n_consts;
    size_t arena_bytes;  /* the arena's size: the planned peak of intermediates */
    size_t copy_scratch_bytes, copy_scratch_offset; /* in the arena, above every buffer */
    /* Segmented LOOP steps (NULL arrays: none). seg_extent[q] > 0: step q's loop
     * runs over a flat [seg_extent[q]] vector; its root x with seg_offset[x] >= 0
     * is a SEGMENT root: x's elements, in row-major order, are the flat elements
     * [seg_offset[x], + numel(x)), computed and stored there (the parameter
     * updates of a flat optimiser vector); the other roots have shape
     * [seg_extent[q]]. A step whose roots all have that shape is segmented
     * too when it fuses a concatenation into it (each piece then reads one
     * operand). seg_offset is per node (-1: no segment root). */
    int64_t *seg_extent;
    int64_t *seg_offset;
    /* Per node: its buffer's rfi_layout (NULL: every buffer is plain). */
    unsigned char *layout;
    bool direct_convs;   /* opts.direct_convs */
    rfi_layout channel_blocks; /* opts.channel_blocks */
    rfi_arena mem;       /* owns the arrays above */
} rfi_plan;

typedef struct rfi_plan_opts {
    /* DOT_GENERAL with fewer multiply-adds than this becomes a REDUCE step
     * (generated loops); larger ones become MATMUL calls. Default 131072:
     * measured in the training steps' profiles, the generated loops were
     * faster at 41k and 82k multiply-adds (the ResNet's and the cnn's dense
     * layers: 2.5-8 us against oneDNN's 6-18 us) and about even at 327k (the
     * mlp's last layer), and a fresh process spends 150-530 us creating each
     * oneDNN matmul primitive. */
    int64_t matmul_call_min_flops;
    /* ... except a DOT_GENERAL whose lhs has at most this many rows (batch
     * elements times lhs free elements: a matrix-vector product, inference at
     * batch 1), which is always a REDUCE step: a library call's fixed cost
     * dominates there, and the generated loop reads each weight once,
     * contiguously. 0: no exception. */
    int64_t dot_loop_max_rows;
    bool in_place_updates; /* plan update values into their captures when safe */
    bool call_epilogues;   /* fuse bias/residual/activation users into CALL steps
                            * (default on; RF_CALL_EPILOGUES=0 in the environment: off) */
    bool matmul_epilogues; /* ... into MATMUL calls too (default on; the cpu backend
                            * chooses by its library's kernels) */
    /* CONV calls may read an operand that is a TRANSPOSE swapping dims 0 and 1
     * (what the autodiff's weight-gradient convolution reads) straight from
     * the transpose's operand: the transpose stays inline, its operand is
     * materialised, and the CALL step reads that buffer (the backend's call
     * sees the operand node's location INLINE and reads operand->in[0]).
     * Default off: a backend turns it on when its calls handle such views. */
    bool conv_transposed_views;
    /* Keep the activations around convolutions channel-blocked (layout.c).
     * Default off: a backend turns it on when its calls and kernels take the
     * layout (the cpu backend, with oneDNN loaded; RF_BLOCKED=0 in the
     * environment: off). */
    bool blocked_activations;
    /* The channel-blocked layout those activations take: RFI_LAYOUT_C8 or
     * RFI_LAYOUT_C16, the block the library's convolutions run on with the
     * machine's vectors (default C16; cpu_backend.c chooses: oneDNN's block,
     * guessed from the CPU's features until oneDNN has loaded, then checked). */
    rfi_layout channel_blocks;
    /* The backend writes the CALL CONV steps of the form kir_conv.c takes
     * (few channels, where the library is slowest) as generated loops
     * (kir.h RFI_KIR_STEP_CONV) instead of calling the library. The plan
     * changes only where such a loop computes an operand itself (a spread
     * output gradient): that operand's step is left out and its bytes are
     * not planned (rfi_step left_out). Default off: a backend that renders
     * such steps turns it on (the cpu backend; RF_DIRECT_CONV=0 in the
     * environment: off). */
    bool direct_convs;
    /* Sibling reductions (the same kind over the same operand shape and
     * axes, sharing an input: BatchNorm's backward sums) join one REDUCE
     * step, which folds them side by side in one pass (kir.h). Default on;
     * RF_SIBLING_REDUCTIONS=0 in the environment: off. */
    bool sibling_reductions;
    /* A reduction (REDUCE or a loop DOT_GENERAL, results of rank <= 2) whose
     * value only one LOOP root reads, through elementwise ops of its shape
     * (a bias and activation after a matrix-vector product, a mean's
     * division), computes that root in its own REDUCE step after the
     * inner loops: the reduction stays inline (rfi_step.core). Default on;
     * RF_REDUCE_EPILOGUES=0 in the environment: off. */
    bool reduce_epilogues;
    /* A fusible node without math functions whose users are elementwise ops
     * of its shape and REDUCEs of it stays inline, recomputed by each (fuse.c
     * decide_fusible): a softmax's scores are not stored for its row max.
     * Default on; RF_INLINE_REDUCE_OPERANDS=0 in the environment: off. */
    bool inline_reduce_operands;
    /* Two library calls (matmuls, convolutions) that do not depend on each
     * other, a few steps apart (a layer's input and weight gradients),
     * become neighbours that may run at the same time (rfi_step
     * runs_with_next). Default off: a backend that runs them so turns it on
     * (the cpu backend; RF_CONCURRENT_CALLS=0 in the environment: off). */
    bool concurrent_calls;
} rfi_plan_opts;

/* Whether renderers compute op by calling a math library function (fuse.c):
 * the planner keeps such ops out of kernel forms that compute a point at a
 * time, and the C renderer counts them as heavy points (render_c.c). */
RFI_FUNC bool rfi_op_calls_math(rfi_op op);
RFI_FUNC rfi_plan_opts rfi_plan_opts_default(void);
/* Whether the plan computes convolution x as generated loops (a REDUCE step)
 * rather than a library call: one not entirely f32 (the library's type),
 * the weight gradient of a depthwise convolution (a batch group per
 * feature, one image each) whose kernel is not 3x3, or one with at most 3
 * output features and no groups (fuse.c). */
RFI_FUNC bool rfi_plan_conv_as_loops(const rfi_node *x);
/* Builds the plan (fusion + memory planning) for a verified program. */
RFI_FUNC rf_status rfi_plan_build(const rfi_graph *g, const rfi_plan_opts *opts, rfi_plan **out);
RFI_FUNC void rfi_plan_free(rfi_plan *p);
/* Buffer index and byte offset of a materialised node (follows aliases). */
RFI_FUNC void rfi_plan_buffer(const rfi_plan *p, int node, int *buffer, size_t *offset);
RFI_FUNC int rfi_plan_n_buffers(const rfi_plan *p);
RFI_FUNC int rfi_plan_arena_buffer(const rfi_plan *p);
/* Counts of steps by kind (for fusion tests) and a readable dump for RF_DUMP
 * ("plan" stage): one line per step with its roots and fused nodes. Owned. */
RFI_FUNC int rfi_plan_count(const rfi_plan *p, rfi_step_kind kind);
/* "LOOP", "REDUCE", "COPY", "CALL MATMUL", "CALL CONV" or "CALL FALLBACK"
 * (profiles and RF_CHECK's messages). */
RFI_FUNC const char *rfi_step_kind_name(const rfi_step *s);
/* Element (n, c, h, w) of an [N, C, H, W] value in layout l: its offset in
 * elements. */
static inline int64_t rfi_layout_offset(rfi_layout l, const int64_t *dims, int64_t n, int64_t c,
                                        int64_t h, int64_t w)
{
    if (l == RFI_LAYOUT_PLAIN)
        return ((n * dims[1] + c) * dims[2] + h) * dims[3] + w;
    if (l == RFI_LAYOUT_NHWC)
        return ((n * dims[2] + h) * dims[3] + w) * dims[1] + c;
    int64_t block = rfi_layout_block(l), blocks = dims[1] / block;
    return (((n * blocks + c / block) * dims[2] + h) * dims[3] + w) * block + c % block;
}
/* The layout of node x's buffer. */
static inline rfi_layout rfi_plan_layout(const rfi_plan *p, int x)
{
    return p->layout ? (rfi_layout)p->layout[x] : RFI_LAYOUT_PLAIN;
}
/* memplan.c: whether operand k of the concatenation c sits where its rows go
 * in c's buffer (a slab), so that c's step has nothing to copy for it; and
 * how many operands of step st's concatenation do (0 unless st stores one
 * concatenation alone). */
RFI_FUNC bool rfi_plan_slab_in_place(const rfi_plan *p, const rfi_node *c, int k);
RFI_FUNC int rfi_plan_step_slabs(const rfi_plan *p, const rfi_step *st);
/* layout.c: chooses p->layout (called by rfi_plan_build when
 * opts->blocked_activations). */
RFI_FUNC rf_status rfi_plan_choose_layouts(rfi_plan *p);
/* How many nodes have layout `l` (for tests and dumps). */
RFI_FUNC int rfi_plan_count_layout(const rfi_plan *p, rfi_layout l);
RFI_FUNC char *rfi_plan_print(const rfi_plan *p);

#endif
