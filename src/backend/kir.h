/* kir.h: the kernel IR: the loop-nest form of an execution plan (plan.h) that
 * the C renderer (cpu/render_c.c) prints, and that a CUDA renderer can print
 * too: nothing here is C- or CPU-specific.
 *
 * A module is the plan's buffer table size plus an ordered list of steps:
 * kernels (the plan's LOOP and REDUCE steps), calls (CALL steps, executed by
 * the runtime) and copies (COPY steps: bytes from one buffer to another).
 *
 * A kernel is an iteration space (outer loops over `dims`; for reductions
 * also inner loops over `red_dims`) and a list of scalar SSA instructions
 * evaluated once per iteration point: loop variables, constants, integer
 * index arithmetic, typed loads base[index], every elementwise op of the IR
 * with the reference interpreter's exact semantics (interp.h: float ops round
 * once per op to the dtype, integer ops wrap, x / 0 = 0, max/min propagate
 * NaN, float->int converts truncate and saturate with NaN -> 0), selects, and
 * stores. Instructions are hash-consed (an equal instruction is created once:
 * CSE), index arithmetic is constant-folded, and each records its `level`:
 *   0  loop-invariant (constants, loads at constant indices),
 *   1  per outer iteration point,
 *   2  per inner (reduction) iteration point,
 *   3  after the inner loops (depends on the accumulator).
 * A REDUCE kernel folds `red_value` (in the accumulator dtype: f64 for float
 * sums and products, but f32 for an f32 dot_general, as a math library's
 * matmul; the data's own type for float max and min, which are exact; i64 for
 * integer data) into one accumulator per outer point, only
 * where `red_guard` holds, starting from the identity; RFI_KIR_ACC reads the
 * result after the inner loops. A REDUCE kernel may fold up to
 * RFI_KIR_MAX_FOLDS values side by side (sibling reductions of one plan
 * step over one iteration space, fuse.c): fold j folds rfi_kir_fold_value(k,
 * j) into an accumulator of its own, with the kind, accumulator type,
 * identity and guard they share, and RFI_KIR_ACC's `i` names the fold whose
 * result it reads; one pass over the data then feeds them all. Renderers
 * choose the loop order and may
 * split the fold into partial folds combined in order where that keeps the
 * result within the rules (cpu/render_c.c). A REDUCE step may also lower to
 * a kernel without inner loops: a small reduce_window folds its points by
 * explicit instructions. Loads see the values before the kernel's stores
 * (renderers emit every store after the values it needs, and an in-place
 * root reads its capture only at the index it writes: plan.h).
 *
 * Index instructions carry a value range (loop variables: [0, extent - 1],
 * derived through the index arithmetic), and comparisons, min and max that
 * the ranges decide fold away: a kernel over a known part of a concatenation
 * reads its operand directly.
 *
 * Deliberately no control flow besides the loop nest and the guard: guarded
 * values (pad, concatenate, windows) are computed at clamped, in-bounds
 * indices and chosen by select, so every kernel is straight-line code.
 */
#ifndef RF_BACKEND_KIR_H
#define RF_BACKEND_KIR_H

#include "plan.h"

typedef enum rfi_kir_op {
    RFI_KIR_VAR,     /* loop variable `var` (i64): < rank outer, else inner */
    RFI_KIR_CONST,   /* literal of dtype: f (float dtypes) or i (the others) */
    /* index arithmetic on i64 (plain C: operands never overflow, divisors > 0) */
    RFI_KIR_IADD,
    RFI_KIR_IMUL,
    RFI_KIR_IDIV,
    RFI_KIR_IREM,
    RFI_KIR_IMIN,
    RFI_KIR_IMAX,
    RFI_KIR_ICMP,    /* a cmp b on i64 -> bool */
    RFI_KIR_LAND,    /* bool a && b */
    /* values */
    RFI_KIR_LOAD,    /* bases[base][a] (bool loads normalise to 0/1) */
    RFI_KIR_UNARY,   /* ir_op(a): the IR's unary elementwise op, interpreter semantics */
    RFI_KIR_BINARY,  /* ir_op(a, b): the IR's binary elementwise op */
    RFI_KIR_COMPARE, /* a cmp b on values of one dtype -> bool (NaN: false but NE) */
    RFI_KIR_SELECT,  /* a (bool) ? b : c */
    RFI_KIR_CONVERT, /* a into dtype (the IR's CONVERT) */
    RFI_KIR_ROUND_BF16, /* f32 a rounded to bfloat16, as f32 (rfi_round_bf16): the
                           operands of a dot_general of RF_PRECISION_BF16 */
    RFI_KIR_ACC,     /* fold i's accumulator after the inner loops (dtype acc_dtype) */
    RFI_KIR_OP_COUNT
} rfi_kir_op;

typedef struct rfi_kir_ins {
    rfi_kir_op op;
    rf_dtype dtype; /* result type (index values: RF_I64, predicates: RF_BOOL) */
    rfi_op ir_op;   /* UNARY, BINARY */
    rf_cmp cmp;     /* ICMP, COMPARE */
    int a, b, c;    /* operand instructions (-1: none) */
    int var;        /* VAR */
    int base;       /* LOAD */
    double f;       /* CONST of a float dtype */
    int64_t i;      /* CONST of the other dtypes; ACC: the fold */
    int node;       /* the IR node whose value this is, or -1 */
    int level;      /* see above */
    int64_t lo, hi; /* index values (i64, bool): every value lies in [lo, hi] */
} rfi_kir_ins;

/* The buffer of a base in the tile of the convolution that runs the kernel
 * (rfi_kir_conv tiled): the kernel's fourth argument, which points where
 * the element at the result's index 0 would be. */
#define RFI_KIR_TILE_BUFFER (-2)

/* A typed pointer a kernel addresses: buffer `buffer` of the table plus `offset`
 * bytes, `nbytes` bytes from there. `noalias`: no other base of the kernel
 * overlaps these bytes (a renderer may then mark it restrict). */
typedef struct rfi_kir_base {
    int buffer;
    size_t offset;
    size_t nbytes;
    rf_dtype dtype;
    bool written;
    bool noalias;
    int node; /* the first node read or written through it (for names) */
} rfi_kir_base;

#define RFI_KIR_MAX_FOLDS RFI_MAX_SIBLINGS

typedef struct rfi_kir_store {
    int base, index, value; /* instructions index and value */
    int node;               /* the root stored */
} rfi_kir_store;

typedef struct rfi_kir_kernel {
    int step;          /* plan step index */
    char name[40];     /* a C identifier naming what it computes, e.g. "add" */
    char *comment;     /* the IR nodes it implements, one line each (owned) */
    int rank;          /* outer loops: variables 0..rank-1 over dims (extents > 1) */
    int64_t dims[RF_MAX_RANK];
    int red_rank;      /* inner loops: variables rank..rank+red_rank-1 over red_dims */
    int64_t red_dims[RF_MAX_RANK];
    bool is_reduce;
    /* LOOP: no `omp simd` on the innermost loop, whose index strides through memory
     * (a padded window's edge piece one column wide: kir_lower_reduce.c) */
    bool no_simd;
    rf_reduce_kind red_kind;
    rf_dtype acc_dtype; /* RF_F64, RF_I64, or RF_F32 (f32 dots, f32 max/min) */
    double red_identity_f;
    int64_t red_identity_i;
    int red_value;     /* instruction folded per inner point (fold 0) */
    int red_guard;     /* bool instruction, or -1: always fold */
    int n_folds;       /* REDUCE: 1 + the sibling folds */
    int sibling_values[RFI_KIR_MAX_FOLDS - 1]; /* what folds 1.. fold */
    rfi_kir_base *bases;
    int n_bases, cap_bases;
    rfi_kir_ins *ins;
    int n_ins, cap_ins;
    rfi_kir_store *stores;
    int n_stores, cap_stores;
    /* hash-consing table: instruction ids + 1, 0 = empty */
    int *table;
    int table_cap;
} rfi_kir_kernel;

typedef enum rfi_kir_step_kind {
    RFI_KIR_STEP_KERNEL,
    RFI_KIR_STEP_CALL,
    RFI_KIR_STEP_COPY,
    RFI_KIR_STEP_CONV, /* a CALL CONV step the backend generates as a direct convolution */
} rfi_kir_step_kind;

/* A direct convolution (RFI_KIR_STEP_CONV): a plan's CALL CONV step in one
 * of the two forms a renderer writes as loops (kir_conv.c): f32, two
 * spatial dims, no groups, no rhs dilation, padding >= 0, x [n, c, h, w] in
 * x_layout, and
 *   FORWARD: w the kernel [o, c, kh, kw] row-major, y [n, o, oh, ow] in
 *     y_layout with
 *     y[n, o, i, j] = epilogue(sum over ci, a, b of
 *       xd[n, ci, i*stride[0] + a - pad[0], j*stride[1] + b - pad[1]] * w[o, ci, a, b])
 *     where xd is x dilated by `dilation` (xd[.., u, v] = x[.., u/d0, v/d1]
 *     where d0 divides u and d1 divides v, else 0: the input gradient of a
 *     strided convolution; dilation > 1 only with stride 1), then the
 *     epilogue ops in order: BIAS (+ a vector over o), RELU, ADD (+ a
 *     tensor in y's shape and layout);
 *   WEIGHT_GRAD: w the output gradient [n, o, oh, ow] in w_layout, y the
 *     kernel's gradient [c, o, kh, kw] row-major (as the autodiff's
 *     convolution computes it, before its transpose) with
 *     y[ci, o, a, b] = sum over n, i, j of
 *       x[n, ci, i*stride[0] + a - pad[0], j*stride[1] + b - pad[1]] * w[n, o, i, j]
 *     and no epilogue. With `spread` the output gradient is a max pool's
 *     gradient (passes/pools.c) that no step materialises: w[n, o, i, j] =
 *     codes[n, o, i / win[0], j / win[1]] == i % win[0] * win[1] + j % win[1]
 *     ? +0 + g[n, o, i / win[0], j / win[1]] : +0, with g (the pooled
 *     cotangent [n, o, oh / win[0], ow / win[1]]) at w_buffer and the i32
 *     codes at codes_buffer, both in w_layout; plan step spread_step, which
 *     would have materialised it, is left out of the module.
 * x (xd) is zero outside its extent. A FORWARD convolution whose result only
 * the next plan step, pool_step, reads, through slices of whole windows of
 * pool_rows rows (a pool over it, passes/pools.c), when the plan lets it
 * (rfi_step runs_pool: the convolution's operands outlive that step), runs
 * that step's kernel (module step pool_kernel) itself: after each pool_rows
 * output rows of an image, for the iterations of that kernel's outermost
 * loop that read them (its outermost loop runs over [n][pool_groups][oh /
 * pool_rows]), so the pool reads the rows from the cache they were just
 * written to. pool_step < 0: none; pool_kernel < 0: not (yet) lowered, the
 * step runs on its own. tile_floats > 0: the span of the result's layout
 * that one image's pool_rows rows cover, in every channel block, is small
 * enough for a tile on the convolution's stack; with `tiled` (the result is
 * RFI_LOC_TILE) the rows go there instead of memory, and the pool's kernel
 * reads them through its tile argument (RFI_KIR_TILE_BUFFER). */
typedef enum rfi_kir_conv_kind {
    RFI_KIR_CONV_FORWARD,
    RFI_KIR_CONV_WEIGHT_GRAD,
} rfi_kir_conv_kind;

typedef struct rfi_kir_conv {
    rfi_kir_conv_kind kind;
    int64_t n, c, h, w;     /* x's dims */
    int64_t o, kh, kw;      /* the kernel's */
    int64_t lanes;          /* output channels per vector: o, or 8 (o / 8 vectors) */
    int64_t oh, ow;         /* the output's spatial dims */
    int64_t stride[2], pad[2];
    int64_t dilation[2];    /* FORWARD: x's (lhs) dilation; else 1 */
    int x_buffer, w_buffer, y_buffer;
    size_t x_offset, w_offset, y_offset;
    rfi_layout x_layout, w_layout, y_layout;
    int n_epi;
    rfi_epi_kind epi[RFI_EPI_MAX];
    int epi_buffer[RFI_EPI_MAX]; /* BIAS, ADD: the operand's buffer; else -1 */
    size_t epi_offset[RFI_EPI_MAX];
    bool spread;            /* WEIGHT_GRAD: w is a pool gradient spread from g by codes */
    int64_t win[2];         /* spread: the pool's windows */
    int codes_buffer, spread_step;
    size_t codes_offset;
    int pool_step, pool_kernel;
    int64_t pool_rows, pool_groups;
    int64_t tile_floats;
    bool tiled;
    /* RF_PRECISION_BF16: each operand value rounded (rf_round_bf16) where the
     * kernel first copies it: the input rows' table, the reordered kernel,
     * the output gradient's row */
    bool bf16;
} rfi_kir_conv;

typedef struct rfi_kir_step {
    rfi_kir_step_kind kind;
    int step;               /* plan step index */
    char *comment;          /* CALL/COPY: what it does (owned) */
    rfi_kir_kernel *kernel; /* KERNEL (owned) */
    /* COPY: nbytes from src to dst */
    int dst_buffer, src_buffer;
    size_t dst_offset, src_offset, nbytes;
    rfi_kir_conv conv; /* CONV */
    int pooled_by;     /* KERNEL: the CONV step that runs it (its pool_kernel), or -1 */
    /* CALL: the services run it with the call before (plan.h runs_with_next),
     * so the module does not call it. */
    bool with_previous;
} rfi_kir_step;

typedef struct rfi_kir_module {
    int n_buffers; /* the plan's buffer table size */
    rfi_kir_step *steps;
    int n_steps, cap_steps;
} rfi_kir_module;

/* ---- Building (kir.c) ------------------------------------------------------------- *
 * Every emitter returns the instruction id, or -1 once an allocation failed (then
 * rfi_kir_failed is true and the message is set); operands may be -1 (the
 * failure propagates). Index emitters fold constants (x + 0, x * 1, 3 * 4, ...). */
RFI_FUNC rfi_kir_kernel *rfi_kir_kernel_new(int step);
RFI_FUNC void rfi_kir_kernel_free(rfi_kir_kernel *k);
RFI_FUNC bool rfi_kir_failed(const rfi_kir_kernel *k);
RFI_FUNC int rfi_kir_var(rfi_kir_kernel *k, int var);
RFI_FUNC int rfi_kir_const_i(rfi_kir_kernel *k, rf_dtype dt, int64_t v);
RFI_FUNC int rfi_kir_const_f(rfi_kir_kernel *k, rf_dtype dt, double v);
RFI_FUNC int rfi_kir_index(rfi_kir_kernel *k, rfi_kir_op op, int a, int b); /* IADD..IMAX */
RFI_FUNC int rfi_kir_icmp(rfi_kir_kernel *k, rf_cmp cmp, int a, int b);
RFI_FUNC int rfi_kir_land(rfi_kir_kernel *k, int a, int b);
RFI_FUNC int rfi_kir_load(rfi_kir_kernel *k, int base, int index, int node);
RFI_FUNC int rfi_kir_unary(rfi_kir_kernel *k, rfi_op op, rf_dtype dt, int a, int node);
RFI_FUNC int rfi_kir_binary(rfi_kir_kernel *k, rfi_op op, rf_dtype dt, int a, int b, int node);
RFI_FUNC int rfi_kir_compare(rfi_kir_kernel *k, rf_cmp cmp, int a, int b, int node);
RFI_FUNC int rfi_kir_select(rfi_kir_kernel *k, int pred, int a, int b, int node);
RFI_FUNC int rfi_kir_convert(rfi_kir_kernel *k, rf_dtype dt, int a, int node);
RFI_FUNC int rfi_kir_round_bf16(rfi_kir_kernel *k, int a, int node);
RFI_FUNC int rfi_kir_acc_of(rfi_kir_kernel *k, int fold);
/* The value fold j of a REDUCE kernel folds (j < k->n_folds). */
static inline int rfi_kir_fold_value(const rfi_kir_kernel *k, int j)
{
    return j == 0 ? k->red_value : k->sibling_values[j - 1];
}
/* The base for (buffer, offset, dtype), added if new; nbytes grows to cover. */
RFI_FUNC int rfi_kir_base_get(rfi_kir_kernel *k, int buffer, size_t offset, rf_dtype dt,
                              size_t nbytes, bool written, int node);
RFI_FUNC rf_status rfi_kir_add_store(rfi_kir_kernel *k, int base, int index, int value, int node);
/* Merges adjacent loops (both outer or both reduced) that every stored, folded
 * or guarding value reads only through their combined row-major index: a loop
 * over [.., 28, 28] of an elementwise or per-channel expression becomes one
 * over [.., 784]. The points and the fold order stay the same. *k may be
 * replaced (the old kernel is freed). */
RFI_FUNC rf_status rfi_kir_coalesce(rfi_kir_kernel **k);
/* Moves each base that every live access indexes as x + c (one constant
 * c > 0) up by c elements, its accesses then indexed by x: the same
 * addresses, and kernels that differ in such offsets only read alike. For a
 * finished kernel (it edits instructions in place), before
 * rfi_kir_mark_aliasing. */
RFI_FUNC rf_status rfi_kir_rebase(rfi_kir_kernel *k);
/* Sets every base's noalias flag from the byte ranges (call once, when complete). */
RFI_FUNC void rfi_kir_mark_aliasing(rfi_kir_kernel *k);
/* Whether index instruction `id` is affine in loop variable `var`: true with
 * *coef its coefficient (0: it does not depend on var) when it is built from
 * var by additions and constant products, added to values that do not depend
 * on var; false when var reaches it otherwise (a division, a clamp, a load).
 * Renderers read memory strides from it (which loop walks memory
 * contiguously). */
RFI_FUNC bool rfi_kir_var_coef(const rfi_kir_kernel *k, int id, int var, int64_t *coef);
/* Whether instruction `id` is an integer or bool constant, and its value. */
RFI_FUNC bool rfi_kir_is_const(const rfi_kir_kernel *k, int id, int64_t *value);
/* live[i] = instruction i is needed by a store, the fold or the guard (n_ins bools). */
RFI_FUNC void rfi_kir_liveness(const rfi_kir_kernel *k, bool *live);

/* ---- The API the backends use ------------------------------------------------------- */
/* Whether plan step `step` is a CALL CONV step that the plan's backend
 * generates as a direct convolution (p->direct_convs, and the form and the
 * channel counts kir_conv.c takes); *out (may be NULL) gets its description. */
RFI_FUNC bool rfi_kir_direct_conv(const rfi_plan *p, int step, rfi_kir_conv *out);
/* Lowers every step of p (kir_lower.c). *out is NULL on failure. */
RFI_FUNC rf_status rfi_kir_lower(const rfi_plan *p, rfi_kir_module **out);
RFI_FUNC void rfi_kir_free(rfi_kir_module *m);
/* The module as text (for tests and debugging), owned (rfi_free); NULL on OOM. */
RFI_FUNC char *rfi_kir_print(const rfi_kir_module *m);
/* The module as one C source file (cpu/render_c.c): the module ABI block of
 * cpu/module_abi.h, one function per kernel and the entry point
 * RF_MODULE_ENTRY_NAME. *source is owned (rfi_free). */
RFI_FUNC rf_status rfi_render_c(const rfi_kir_module *m, char **source);
/* The text the renderer copies from cpu/module_abi.h (for a test that the copy is exact). */
RFI_FUNC const char *rfi_render_c_abi_block(void);

#endif
