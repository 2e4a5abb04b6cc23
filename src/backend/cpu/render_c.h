/* render_c.h: the renderer's state and the text helpers that render_c.c
 * (expressions, kernels, the entry point) shares with render_reduce.c (the
 * loop schedules of REDUCE kernels). Internal to those two files. */
#ifndef RF_BACKEND_CPU_RENDER_C_H
#define RF_BACKEND_CPU_RENDER_C_H

#include <stdarg.h>
#include <string.h>

#include "../kir.h"
#include "module_abi.h" /* RFI_PARALLEL_MIN */

/* ---- Output ------------------------------------------------------------------------- *
 * Short names for core.h's rfi_strbuf appenders. The generated file is large
 * (hundreds of KB for a ResNet step), so plain text is copied without a
 * printf (put), and putf formats once in place, a second time only when the
 * text does not fit. */
static inline void put_n(rfi_strbuf *sb, const char *s, size_t n) { rfi_sb_put(sb, s, n); }

static inline void put(rfi_strbuf *sb, const char *s) { rfi_sb_put(sb, s, strlen(s)); }

static inline void put_char(rfi_strbuf *sb, char c) { rfi_sb_put(sb, &c, 1); }

static inline void putf(rfi_strbuf *sb, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static inline void putf(rfi_strbuf *sb, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    rfi_sb_vprintf(sb, fmt, ap);
    va_end(ap);
}

/* What the file needs from the prelude (rfi_render.need). */
enum {
    RFI_NEED_SAT = 1u << 0,
    RFI_NEED_DIV = 1u << 1,
    RFI_NEED_REM = 1u << 2,
    RFI_NEED_POW = 1u << 3,
    RFI_NEED_MAXMIN_F32 = 1u << 4,
    RFI_NEED_MAXMIN_F64 = 1u << 5,
    RFI_NEED_LOGISTIC_F32 = 1u << 6,
    RFI_NEED_LOGISTIC_F64 = 1u << 7,
    RFI_NEED_VECTORS = 1u << 8, /* the GNU vector types of direct convolutions */
    RFI_NEED_LANES16 = 1u << 9, /* RF_LANES16 */
    RFI_NEED_BF16 = 1u << 10,   /* rf_round_bf16 */
    RFI_NEED_BF16_DOT = 1u << 11, /* RF_BF16_DOT and rf_bf16x32 */
    RFI_NEED_POW_F32 = 1u << 12,
    RFI_NEED_POW_F64 = 1u << 13,
    RFI_NEED_EXP_F32 = 1u << 14, /* rf_exp_f32 */
    RFI_NEED_EXP_F64 = 1u << 15,
    RFI_NEED_EXPM1_F32 = 1u << 16, /* rf_expm1_f32 */
    RFI_NEED_EXPM1_F64 = 1u << 17,
    RFI_NEED_TILES = 1u << 18, /* the GNU vector types of register tiles */
};

/* The libm functions with vector variants (render_c.c's simd_funcs). */
#define RFI_RENDER_SIMD_FUNCS 7

/* The state of one rendering: where the text goes, what the prelude must
 * hold, and the kernel being rendered with its names. */
typedef struct rfi_render {
    rfi_strbuf *sb;
    unsigned need;
    bool simd_used[RFI_RENDER_SIMD_FUNCS][2]; /* [func][0 f32, 1 f64] */
    const rfi_kir_kernel *k;
    char (*names)[32];               /* per instruction */
    char (*base_names)[32];          /* per base */
    rfi_strbuf *def;                 /* where a kernel's functions go (sb: the rest) */
    bool neutral;                    /* names from positions, not nodes (shared functions) */
    const int *function_of;          /* per module step: the step whose functions it calls */
    bool share;                      /* kernels may call others' functions (shares_functions) */
} rfi_render;

/* A REDUCE kernel's loop schedule (render_reduce.c says what each form is). */
typedef enum rfi_sched_form {
    RFI_SCHED_PLAIN,
    RFI_SCHED_INTERCHANGED,
    RFI_SCHED_TILED,
    RFI_SCHED_SPLIT
} rfi_sched_form;

typedef struct rfi_schedule {
    rfi_sched_form form;
    int64_t chunks; /* RFI_SCHED_SPLIT: partial folds of the outermost reduced loop */
    int64_t kept;   /* RFI_SCHED_SPLIT: kept points, partial accumulators per chunk */
} rfi_schedule;

/* ---- render_c.c ------------------------------------------------------------------------ */
/* The C type of dt's elements. */
RFI_FUNC const char *rfi_render_ctype(rf_dtype dt);
/* v as a C literal of dt: the shortest %g form that reads back as v. */
RFI_FUNC void rfi_render_float_literal(rfi_strbuf *sb, double v, rf_dtype dt);
RFI_FUNC void rfi_render_int_literal(rfi_strbuf *sb, int64_t v, rf_dtype dt);
/* prefix for fold 0, then prefix1, prefix2, ...; fold j's accumulator: acc, acc1, ... */
RFI_FUNC void rfi_render_fold_name(char name[32], const char *prefix, int j);
RFI_FUNC void rfi_render_acc_name(char name[32], int j);
/* An operand: its name, or the literal of a constant; in buf, its text. */
RFI_FUNC void rfi_render_operand(rfi_render *R, int id);
RFI_FUNC void rfi_render_operand_text(rfi_render *R, int id, char *buf, size_t n);
/* Four spaces per level of depth. */
RFI_FUNC void rfi_render_indent(rfi_render *R, int depth);
/* The live statements of one loop level (with `only`, just those whose only[id]
 * equals `want`), and the kernel's stores. */
RFI_FUNC void rfi_render_statements_where(rfi_render *R, const bool *live, int level, int depth,
                                          const bool *only, bool want);
RFI_FUNC void rfi_render_statements(rfi_render *R, const bool *live, int level, int depth);
RFI_FUNC void rfi_render_stores(rfi_render *R, int depth);
/* Opens the kernel's first n kept loops from depth 1, i0 over the function's
 * range [lo, hi), the others whole; the last vectorised when simd. */
RFI_FUNC void rfi_render_open_outer_loops(rfi_render *R, int n, bool simd);
/* Closes n loops opened at depth, depth + 1, ... */
RFI_FUNC void rfi_render_close_loops(rfi_render *R, int depth, int n);
/* used[b]: base b is loaded by a live instruction (or, with `stored`, stored
 * to); the local copies of the bases a function uses. */
RFI_FUNC void rfi_render_bases_used(const rfi_kir_kernel *k, const bool *live, bool stored,
                                    bool *used);
RFI_FUNC void rfi_render_declare_bases(rfi_render *R, const bool *used);
/* A kernel function's head, up to its ctx. */
RFI_FUNC void rfi_render_function_head(rfi_render *R, const char *kname);

/* ---- render_reduce.c ------------------------------------------------------------------- */
/* The schedule of the kernel whose live instructions are `live`. */
RFI_FUNC rfi_schedule rfi_render_schedule(const rfi_kir_kernel *k, const bool *live);
/* A plain reduction's accumulators, reduced loops and folds at depth, inside
 * the kept loops. */
RFI_FUNC void rfi_render_reduction_loops(rfi_render *R, const bool *live, int depth);
/* An interchanged reduction's body; fold_live and out_live are scratch. */
RFI_FUNC void rfi_render_interchanged_body(rfi_render *R, bool *fold_live, bool *out_live);
/* A split reduction's two functions; fold_live, out_live and used are scratch. */
RFI_FUNC void rfi_render_split_functions(rfi_render *R, const char *kname,
                                         const rfi_schedule *sc, bool *fold_live,
                                         bool *out_live, bool *used);
/* fold[i]: instruction i is needed by a fold or its guard; out[i]: by a store. */
RFI_FUNC void rfi_render_fold_out_liveness(const rfi_kir_kernel *k, bool *fold_live,
                                          bool *out_live);
/* dep[id]: instruction id varies with kept loop `var` (its value is per
 * output; the accumulator counts as varying). */
RFI_FUNC void rfi_render_output_dependent(const rfi_kir_kernel *k, int var, bool *dep);
/* Whether op is index arithmetic (or a loop variable). */
RFI_FUNC bool rfi_render_index_op(rfi_kir_op op);
/* Whether live load x would be a gather in the innermost kept loop: its index
 * strides there, or is not affine in it (divided: a nearest upsampling's
 * broadcast seen through a reshape). gcc vectorises no such load here (the
 * modules have no gathers), and a math function in the same loop then runs
 * scalar with it. */
RFI_FUNC bool rfi_render_gathered_load(const rfi_kir_kernel *k, const rfi_kir_ins *x);
/* Whether the machine the modules are compiled for (-march=native) has 64-byte
 * vector registers (AVX-512): register tiles then use them for long rows. */
RFI_FUNC bool rfi_render_wide_vectors(void);
/* Whether a live instruction calls a math function (exp, tanh, ...). */
RFI_FUNC bool rfi_render_calls_math(const rfi_kir_kernel *k, const bool *live);
/* Copies of the loads in `copied` (those gcc would gather) into arrays on the
 * stack, so that the loop reading them runs vectorised: the arrays, tr_<name>
 * followed by `shape` ("[64]"); filling them, element `at` ("[i0 - b0]") of
 * each from its load; reading them back as the loads' values. */
RFI_FUNC void rfi_render_copy_arrays(rfi_render *R, const bool *copied, const char *shape,
                                     int depth);
RFI_FUNC void rfi_render_copy_fill(rfi_render *R, const bool *copied, const char *at, int depth);
RFI_FUNC void rfi_render_copy_read(rfi_render *R, const bool *copied, const char *at, int depth);
/* Marks instruction id and what it reads in `out`, not reading past the
 * instructions in `stop` (which are marked themselves; stop may be NULL). */
RFI_FUNC void rfi_render_mark_operands(const rfi_kir_kernel *k, int id, const bool *stop,
                                       bool *out);
/* Whether a plain reduction runs blocks of outputs, and its body then. */
RFI_FUNC bool rfi_render_unrolls(const rfi_kir_kernel *k);
RFI_FUNC void rfi_render_unrolled_body(rfi_render *R, const bool *live);

/* ---- render_tiles.c -------------------------------------------------------------------- */
/* Whether a reduction that would run interchanged sums its products in
 * register tiles; the body of one that does (fold_live and out_live are
 * scratch). */
RFI_FUNC bool rfi_render_tiles(const rfi_kir_kernel *k);
RFI_FUNC void rfi_render_tiled_body(rfi_render *R, bool *fold_live, bool *out_live);

#endif
