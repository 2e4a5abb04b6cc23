/* render_c.c: the kernel IR module (kir.h) as one readable C source file.
 *
 * The file holds the module ABI block (copied verbatim from module_abi.h),
 * `#pragma omp declare simd` declarations of the libm functions it uses (so
 * gcc -fopenmp-simd vectorises them through libmvec; link with -lm), small
 * static inline helpers with the interpreter's integer and NaN semantics, one
 * function per kernel over a range of its outermost loop
 * (`RF_KERNEL void k<step>_<name>(void *ctx, int64_t lo, int64_t hi)`, static
 * unless the module is compiled in parts, its base pointers in a ctx struct),
 * and the entry point rf_module_run_v1, which runs
 * the steps in order: kernels directly or through the runtime's parallel_for
 * when they are large, calls through the runtime's `call`, copies by memcpy.
 * Direct convolution steps get their kernels and blocks from render_conv.c
 * (one kernel for steps with the same loop).
 *
 * REDUCE kernels get one of three loop schedules (see "Reduction schedules"),
 * chosen from the memory strides of their loads: plain (kept loops outside);
 * interchanged (the kept axis innermost over a block of accumulators: bias
 * gradients, pooling windows too large to unroll); split (the outermost reduced loop cut into a
 * fixed number of chunks folded in parallel into partial accumulators that
 * live on the entry point's stack, then combined in chunk order by a second
 * function, k<step>_<name>_combine: BatchNorm statistics, sums to a scalar).
 * A plain float sum over one contiguous reduced loop (a matrix-vector
 * product) takes four outputs per iteration, one accumulator each ("Unrolled
 * reductions"). Each point's values are folded in the same order in all of
 * them.
 *
 * Values are SSA constants named after their IR node (x_12 for %12), index
 * temporaries j<k>, predicates ok<k>. Float ops stay in the value's type (one
 * rounding per op, as the interpreter); reductions accumulate in the
 * kernel's accumulator type (kir.h: double, f32 for f32 dots and max/min,
 * wrapping int64). Deliberately no compiling or loading here (the compiler
 * driver does that) and no fast-math assumptions: NaN and signed zeros follow
 * the interpreter.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kir.h"
#include "module_abi.h"
#include "render_conv.h"

/* ---- Output ------------------------------------------------------------------------- *
 * Short names for core.h's rfi_strbuf appenders. The generated file is large
 * (hundreds of KB for a ResNet step), so plain text is copied without a
 * printf (put), and putf formats once in place, a second time only when the
 * text does not fit. */
static void put_n(rfi_strbuf *sb, const char *s, size_t n) { rfi_sb_put(sb, s, n); }

static void put(rfi_strbuf *sb, const char *s) { rfi_sb_put(sb, s, strlen(s)); }

static void put_char(rfi_strbuf *sb, char c) { rfi_sb_put(sb, &c, 1); }

static void putf(rfi_strbuf *sb, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void putf(rfi_strbuf *sb, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    rfi_sb_vprintf(sb, fmt, ap);
    va_end(ap);
}

static const char abi_block[] =
    "/* BEGIN MODULE ABI */\n"
    "#include <stdint.h>\n"
    "#define RF_MODULE_ABI 2\n"
    "typedef struct rf_module_services {\n"
    "    int abi;  /* RF_MODULE_ABI */\n"
    "    void *rt; /* the runtime's state for this executable */\n"
    "    /* Runs body(ctx, lo, hi) over [0, n) split across the runtime's thread\n"
    "     * pool, in chunks of at least `grain` iterations; returns when all are done. */\n"
    "    void (*parallel_for)(void *rt, int64_t n, int64_t grain,\n"
    "                         void (*body)(void *ctx, int64_t lo, int64_t hi), void *ctx);\n"
    "    /* Executes plan step `step` (a CALL step: matmul, convolution or a\n"
    "     * reference kernel) on the buffer table. Returns 0 on success. */\n"
    "    int (*call)(void *rt, int step, void *const *buffers);\n"
    "    /* When profiling (NULL otherwise): called with each plan step's index just\n"
    "     * before the step runs, and with -1 when the program is done. */\n"
    "    void (*mark)(void *prof, int step);\n"
    "    void *prof;\n"
    "} rf_module_services;\n"
    "/* The module's one entry point: runs the whole program on the buffer table\n"
    " * (see plan.h for its layout). Returns 0 on success, else the failing step + 1. */\n"
    "typedef int (*rf_module_entry)(const rf_module_services *s, void *const *buffers);\n"
    "#define RF_MODULE_ENTRY_NAME \"rf_module_run_v1\"\n"
    "/* END MODULE ABI */\n";

const char *rfi_render_c_abi_block(void)
{
    return abi_block;
}

/* Kernels with more elements than this run through parallel_for, in chunks of at
 * least PARALLEL_CHUNK elements. */
#define PARALLEL_MIN 32768
#define PARALLEL_CHUNK 16384

/* ---- What the file needs ------------------------------------------------------------ */
enum {
    NEED_SAT = 1u << 0,
    NEED_DIV = 1u << 1,
    NEED_REM = 1u << 2,
    NEED_POW = 1u << 3,
    NEED_MAXMIN_F32 = 1u << 4,
    NEED_MAXMIN_F64 = 1u << 5,
    NEED_LOGISTIC_F32 = 1u << 6,
    NEED_LOGISTIC_F64 = 1u << 7,
    NEED_VECTORS = 1u << 8, /* the GNU vector types of direct convolutions */
    NEED_LANES16 = 1u << 9, /* RF_LANES16 */
};

/* libm functions with vector variants in libmvec, declared `omp declare simd`. */
static const char *const simd_funcs[] = {"exp", "expm1", "log", "log1p", "tanh",
                                         "sin", "cos", "pow"};
#define N_SIMD_FUNCS ((int)(sizeof simd_funcs / sizeof simd_funcs[0]))

typedef struct render {
    rfi_strbuf *sb;
    unsigned need;
    bool simd_used[N_SIMD_FUNCS][2]; /* [func][0 f32, 1 f64] */
    const rfi_kir_kernel *k;
    char (*names)[32];               /* per instruction */
    char (*base_names)[32];          /* per base */
    rfi_strbuf *def;                 /* where a kernel's functions go (sb: the rest) */
    bool neutral;                    /* names from positions, not nodes (shared functions) */
    const int *function_of;          /* per module step: the step whose functions it calls */
    bool share;                      /* kernels may call others' functions (shares_functions) */
} render;

static const char *ctype(rf_dtype dt)
{
    switch (dt) {
    case RF_F32: return "float";
    case RF_F64: return "double";
    case RF_I32: return "int32_t";
    case RF_I64: return "int64_t";
    default: return "uint8_t";
    }
}

static void use_math(render *R, const char *func, rf_dtype dt)
{
    for (int f = 0; f < N_SIMD_FUNCS; f++)
        if (strcmp(simd_funcs[f], func) == 0)
            R->simd_used[f][dt == RF_F64] = true;
}

/* ---- Literals ------------------------------------------------------------------------ */
/* The shortest %g form that reads back as v, as a C literal of dt. */
static void float_literal(rfi_strbuf *sb, double v, rf_dtype dt)
{
    if (v != v) {
        put(sb, dt == RF_F32 ? "NAN" : "(double)NAN");
        return;
    }
    if (isinf(v)) {
        putf(sb, "%s%s", v < 0 ? "-" : "", dt == RF_F32 ? "INFINITY" : "(double)INFINITY");
        return;
    }
    char buf[64];
    for (int digits = 1; digits <= 17; digits++) {
        snprintf(buf, sizeof buf, "%.*g", digits, v);
        bool same = dt == RF_F32 ? strtof(buf, NULL) == (float)v : strtod(buf, NULL) == v;
        if (same && (signbit(strtod(buf, NULL)) != 0) == (signbit(v) != 0))
            break;
    }
    bool has_point = strpbrk(buf, ".en") != NULL;
    putf(sb, "%s%s%s%s%s", v < 0 || signbit(v) ? "(" : "", buf, has_point ? "" : ".0",
                  dt == RF_F32 ? "f" : "", v < 0 || signbit(v) ? ")" : "");
}

static void int_literal(rfi_strbuf *sb, int64_t v, rf_dtype dt)
{
    switch (dt) {
    case RF_I32:
        if (v == INT32_MIN)
            put(sb, "INT32_MIN");
        else
            putf(sb, v < 0 ? "(%lld)" : "%lld", (long long)v);
        return;
    case RF_I64:
        if (v == INT64_MIN)
            put(sb, "INT64_MIN");
        else if (v >= INT32_MIN && v <= INT32_MAX)
            putf(sb, v < 0 ? "(%lld)" : "%lld", (long long)v);
        else
            putf(sb, "INT64_C(%lld)", (long long)v);
        return;
    default: putf(sb, "(uint8_t)%lld", (long long)v); return;
    }
}

/* ---- Names ---------------------------------------------------------------------- */
/* Writes v in decimal at out; returns the end. */
static char *decimal(char *out, long long v)
{
    char digits[24];
    int n = 0;
    unsigned long long u = v < 0 ? 0ull - (unsigned long long)v : (unsigned long long)v;
    do
        digits[n++] = (char)('0' + u % 10);
    while ((u /= 10) != 0);
    if (v < 0)
        *out++ = '-';
    while (n > 0)
        *out++ = digits[--n];
    return out;
}

/* name = prefix a, or prefix a "_" b when b is given (the names are at most
 * 2 + 2 * 21 characters, within the 32-byte slots for the int values used). */
static void make_name(char name[32], const char *prefix, int a, bool with_b, int b)
{
    size_t n = strlen(prefix);
    memcpy(name, prefix, n);
    char *end = decimal(name + n, a);
    if (with_b) {
        *end++ = '_';
        end = decimal(end, b);
    }
    *end = '\0';
}

/* prefix for fold 0, then prefix1, prefix2, ... (the prefix is short) */
static void fold_name(char name[32], const char *prefix, int j)
{
    if (j == 0)
        snprintf(name, 32, "%s", prefix);
    else
        make_name(name, prefix, j, false, 0);
}

/* Fold j's accumulator: acc, acc1, acc2, ... */
static void acc_name(char name[32], int j) { fold_name(name, "acc", j); }

/* Names the values and bases: from their IR nodes, or in neutral form
 * (shared functions, below) by their order among the live values and the
 * bases used. */
static void name_values(render *R, const bool *live, const bool *base_used)
{
    const rfi_kir_kernel *k = R->k;
    int ordinal = 0;
    for (int id = 0; id < k->n_ins; id++) {
        const rfi_kir_ins *x = &k->ins[id];
        char *name = R->names[id];
        if (R->neutral && x->op != RFI_KIR_VAR && x->op != RFI_KIR_ACC) {
            /* (a dead value's name is never printed; by id, it would not match) */
            make_name(name, live[id] ? "v" : "dead", live[id] ? ordinal++ : id, false, 0);
        } else if (x->op == RFI_KIR_VAR) {
            if (x->var < k->rank)
                make_name(name, "i", x->var, false, 0);
            else
                make_name(name, "r", x->var - k->rank, false, 0);
        } else if (x->op == RFI_KIR_ACC) {
            acc_name(name, (int)x->i);
        } else if (x->op == RFI_KIR_ICMP || x->op == RFI_KIR_LAND) {
            make_name(name, "ok", id, false, 0);
        } else if (x->op >= RFI_KIR_IADD && x->op <= RFI_KIR_IMAX) {
            make_name(name, "j", id, false, 0);
        } else if (x->node >= 0 && live[id]) {
            int seen = 0; /* earlier live values of the same node (at other indices) */
            for (int p = 0; p < id; p++)
                seen += live[p] && k->ins[p].node == x->node && k->ins[p].op != RFI_KIR_CONST &&
                        k->ins[p].op >= RFI_KIR_LOAD;
            make_name(name, "x_", x->node, seen != 0, seen + 1);
        } else {
            make_name(name, "t", id, false, 0);
        }
    }
    ordinal = 0;
    for (int b = 0; b < k->n_bases; b++) {
        int same = 0;
        for (int p = 0; p < b; p++)
            same += k->bases[p].node == k->bases[b].node;
        if (R->neutral)
            make_name(R->base_names[b], base_used[b] ? "p" : "unused", base_used[b] ? ordinal++ : b,
                      false, 0);
        else if (same)
            make_name(R->base_names[b], "p", b, true, k->bases[b].node);
        else
            make_name(R->base_names[b], "p_", k->bases[b].node, false, 0);
    }
}

/* An operand: its name, or the literal of a constant. */
static void operand(render *R, int id)
{
    const rfi_kir_ins *x = &R->k->ins[id];
    if (x->op != RFI_KIR_CONST)
        put(R->sb, R->names[id]);
    else if (rfi_dtype_is_float(x->dtype))
        float_literal(R->sb, x->f, x->dtype);
    else
        int_literal(R->sb, x->i, x->dtype);
}

/* ---- Expressions ------------------------------------------------------------------ *
 * A tiny format language: %a %b %c are operands, %T the result's C type, %f the
 * float suffix of operand a's type ("f" for f32), %% a percent sign. */
static void emit_fmt(render *R, const rfi_kir_ins *x, const char *fmt)
{
    rf_dtype at = x->a >= 0 ? R->k->ins[x->a].dtype : x->dtype;
    for (const char *c = fmt; *c; c++) {
        if (*c != '%' || !c[1]) {
            size_t run = strcspn(c + 1, "%") + 1; /* this character and the text up to a % */
            put_n(R->sb, c, run);
            c += run - 1;
            continue;
        }
        c++;
        switch (*c) {
        case 'a': operand(R, x->a); break;
        case 'b': operand(R, x->b); break;
        case 'c': operand(R, x->c); break;
        case 'T': put(R->sb, ctype(x->dtype)); break;
        case 'f': put(R->sb, at == RF_F32 ? "f" : ""); break;
        default: put_char(R->sb, *c); break;
        }
    }
}

/* The integer value `expr` (computed in uint64) wrapped into dt (bool: != 0). */
static void narrow(render *R, const rfi_kir_ins *x, rf_dtype dt, const char *expr)
{
    const char *open = dt == RF_I32 ? "(int32_t)(uint32_t)(" : dt == RF_I64 ? "(int64_t)("
                       : dt == RF_U8 ? "(uint8_t)(" : "(uint8_t)((";
    put(R->sb, open);
    emit_fmt(R, x, expr);
    put(R->sb, dt == RF_BOOL ? ") != 0)" : ")");
}

static void emit_math(render *R, const rfi_kir_ins *x, const char *func)
{
    rf_dtype at = R->k->ins[x->a].dtype;
    use_math(R, func, at);
    putf(R->sb, "%s%s(", func, at == RF_F32 ? "f" : "");
    operand(R, x->a);
    if (x->b >= 0) {
        put(R->sb, ", ");
        operand(R, x->b);
    }
    put(R->sb, ")");
}

static void unary_float(render *R, const rfi_kir_ins *x)
{
    rf_dtype at = R->k->ins[x->a].dtype;
    switch (x->ir_op) {
    case RFI_OP_NEG: emit_fmt(R, x, "-%a"); return;
    case RFI_OP_ABS: emit_fmt(R, x, "fabs%f(%a)"); return;
    case RFI_OP_SIGN: /* -0 gives +0, NaN stays */
        emit_fmt(R, x, "(%a > 0 ? (%T)1 : %a < 0 ? (%T)-1 : %a == %a ? (%T)0 : %a)");
        return;
    case RFI_OP_EXP: emit_math(R, x, "exp"); return;
    case RFI_OP_EXPM1: emit_math(R, x, "expm1"); return;
    case RFI_OP_LOG: emit_math(R, x, "log"); return;
    case RFI_OP_LOG1P: emit_math(R, x, "log1p"); return;
    case RFI_OP_SQRT: emit_fmt(R, x, "sqrt%f(%a)"); return;
    case RFI_OP_RSQRT: /* in double, rounded once: the interpreter's value exactly */
        emit_fmt(R, x, at == RF_F32 ? "(float)(1.0 / sqrt((double)%a))" : "1.0 / sqrt(%a)");
        return;
    case RFI_OP_TANH: emit_math(R, x, "tanh"); return;
    case RFI_OP_LOGISTIC:
        R->need |= at == RF_F32 ? NEED_LOGISTIC_F32 : NEED_LOGISTIC_F64;
        use_math(R, "exp", at);
        emit_fmt(R, x, at == RF_F32 ? "rf_logistic_f32(%a)" : "rf_logistic_f64(%a)");
        return;
    case RFI_OP_SIN: emit_math(R, x, "sin"); return;
    case RFI_OP_COS: emit_math(R, x, "cos"); return;
    case RFI_OP_FLOOR: emit_fmt(R, x, "floor%f(%a)"); return;
    case RFI_OP_CEIL: emit_fmt(R, x, "ceil%f(%a)"); return;
    case RFI_OP_ROUND: emit_fmt(R, x, "round%f(%a)"); return; /* half away from zero */
    case RFI_OP_IS_FINITE:
        emit_fmt(R, x, at == RF_F32 ? "(uint8_t)(fabsf(%a) <= FLT_MAX)"
                                    : "(uint8_t)(fabs(%a) <= DBL_MAX)");
        return;
    case RFI_OP_NOT: emit_fmt(R, x, "(%T)(%a == 0)"); return;
    default: emit_fmt(R, x, "%a"); return;
    }
}

static void unary_int(render *R, const rfi_kir_ins *x)
{
    bool is_unsigned = x->dtype == RF_U8 || x->dtype == RF_BOOL;
    switch (x->ir_op) {
    case RFI_OP_NEG: narrow(R, x, x->dtype, "0 - (uint64_t)%a"); return;
    case RFI_OP_ABS:
        if (is_unsigned) {
            emit_fmt(R, x, "%a");
            return;
        }
        emit_fmt(R, x, "(%a < 0 ? ");
        narrow(R, x, x->dtype, "0 - (uint64_t)%a");
        emit_fmt(R, x, " : %a)");
        return;
    case RFI_OP_SIGN:
        emit_fmt(R, x, is_unsigned ? "(%T)(%a > 0)" : "(%T)((%a > 0) - (%a < 0))");
        return;
    case RFI_OP_NOT:
        if (x->dtype == RF_BOOL)
            emit_fmt(R, x, "(uint8_t)!%a");
        else
            narrow(R, x, x->dtype, "~(uint64_t)%a");
        return;
    case RFI_OP_IS_FINITE: emit_fmt(R, x, "(uint8_t)1"); return;
    default: emit_fmt(R, x, "%a"); return;
    }
}

static void binary_float(render *R, const rfi_kir_ins *x)
{
    bool f32 = x->dtype == RF_F32;
    switch (x->ir_op) {
    case RFI_OP_ADD: emit_fmt(R, x, "%a + %b"); return;
    case RFI_OP_SUB: emit_fmt(R, x, "%a - %b"); return;
    case RFI_OP_MUL: emit_fmt(R, x, "%a * %b"); return;
    case RFI_OP_DIV: emit_fmt(R, x, "%a / %b"); return;
    case RFI_OP_POW: emit_math(R, x, "pow"); return;
    case RFI_OP_MAX:
    case RFI_OP_MIN:
        R->need |= f32 ? NEED_MAXMIN_F32 : NEED_MAXMIN_F64;
        putf(R->sb, "rf_%s_%s(", x->ir_op == RFI_OP_MAX ? "max" : "min",
                      f32 ? "f32" : "f64");
        emit_fmt(R, x, "%a, %b)");
        return;
    case RFI_OP_REM: emit_fmt(R, x, "fmod%f(%a, %b)"); return; /* sign of the dividend */
    case RFI_OP_AND: emit_fmt(R, x, "(%T)((%a != 0) && (%b != 0))"); return;
    case RFI_OP_OR: emit_fmt(R, x, "(%T)((%a != 0) || (%b != 0))"); return;
    default: emit_fmt(R, x, "%a"); return;
    }
}

static void binary_int(render *R, const rfi_kir_ins *x)
{
    switch (x->ir_op) {
    case RFI_OP_ADD: narrow(R, x, x->dtype, "(uint64_t)%a + (uint64_t)%b"); return;
    case RFI_OP_SUB: narrow(R, x, x->dtype, "(uint64_t)%a - (uint64_t)%b"); return;
    case RFI_OP_MUL: narrow(R, x, x->dtype, "(uint64_t)%a * (uint64_t)%b"); return;
    case RFI_OP_DIV:
        R->need |= NEED_DIV;
        narrow(R, x, x->dtype, "(uint64_t)rf_div_i64(%a, %b)");
        return;
    case RFI_OP_REM:
        R->need |= NEED_REM;
        narrow(R, x, x->dtype, "(uint64_t)rf_rem_i64(%a, %b)");
        return;
    case RFI_OP_POW:
        R->need |= NEED_POW;
        narrow(R, x, x->dtype, "(uint64_t)rf_pow_i64(%a, %b)");
        return;
    case RFI_OP_MAX: emit_fmt(R, x, "(%a > %b ? %a : %b)"); return;
    case RFI_OP_MIN: emit_fmt(R, x, "(%a < %b ? %a : %b)"); return;
    case RFI_OP_AND: emit_fmt(R, x, "(%T)(%a & %b)"); return;
    case RFI_OP_OR: emit_fmt(R, x, "(%T)(%a | %b)"); return;
    default: emit_fmt(R, x, "%a"); return;
    }
}

static void convert(render *R, const rfi_kir_ins *x)
{
    rf_dtype from = R->k->ins[x->a].dtype, to = x->dtype;
    if (to == RF_BOOL) {
        emit_fmt(R, x, "(uint8_t)(%a != 0)");
    } else if (rfi_dtype_is_float(to) || !rfi_dtype_is_float(from)) {
        if (rfi_dtype_is_float(to))
            emit_fmt(R, x, "(%T)%a");
        else
            narrow(R, x, to, "(uint64_t)%a");
    } else { /* float -> integer: truncate, saturate, NaN -> 0 */
        R->need |= NEED_SAT;
        emit_fmt(R, x, to == RF_I32 ? "rf_f2i32(%a)" : to == RF_I64 ? "rf_f2i64(%a)" : "rf_f2u8(%a)");
    }
}

static const char *const c_cmp[] = {"==", "!=", "<", "<=", ">", ">="};

static void expression(render *R, const rfi_kir_ins *x)
{
    bool is_float_a = x->a >= 0 && rfi_dtype_is_float(R->k->ins[x->a].dtype);
    switch (x->op) {
    case RFI_KIR_IADD:
        if (R->k->ins[x->b].op == RFI_KIR_CONST && R->k->ins[x->b].i < 0 &&
            R->k->ins[x->b].i > INT32_MIN) {
            operand(R, x->a);
            putf(R->sb, " - %lld", -(long long)R->k->ins[x->b].i);
            return;
        }
        emit_fmt(R, x, "%a + %b");
        return;
    case RFI_KIR_IMUL:
        emit_fmt(R, x, R->k->ins[x->b].op == RFI_KIR_CONST && R->k->ins[x->b].i == -1 ? "-%a"
                                                                                      : "%a * %b");
        return;
    case RFI_KIR_IDIV: emit_fmt(R, x, "%a / %b"); return;
    case RFI_KIR_IREM: emit_fmt(R, x, "%a %% %b"); return;
    case RFI_KIR_IMIN: emit_fmt(R, x, "(%a < %b ? %a : %b)"); return;
    case RFI_KIR_IMAX: emit_fmt(R, x, "(%a > %b ? %a : %b)"); return;
    case RFI_KIR_ICMP:
        operand(R, x->a);
        put_char(R->sb, ' ');
        put(R->sb, c_cmp[x->cmp]);
        put_char(R->sb, ' ');
        operand(R, x->b);
        return;
    case RFI_KIR_LAND: emit_fmt(R, x, "%a && %b"); return;
    case RFI_KIR_LOAD:
        if (x->dtype == RF_BOOL)
            put(R->sb, "(uint8_t)(");
        put(R->sb, R->base_names[x->base]);
        put_char(R->sb, '[');
        operand(R, x->a);
        put(R->sb, x->dtype == RF_BOOL ? "] != 0)" : "]");
        return;
    case RFI_KIR_UNARY:
        if (is_float_a)
            unary_float(R, x);
        else
            unary_int(R, x);
        return;
    case RFI_KIR_BINARY:
        if (is_float_a)
            binary_float(R, x);
        else
            binary_int(R, x);
        return;
    case RFI_KIR_COMPARE:
        put(R->sb, "(uint8_t)(");
        operand(R, x->a);
        put_char(R->sb, ' ');
        put(R->sb, c_cmp[x->cmp]);
        put_char(R->sb, ' ');
        operand(R, x->b);
        put(R->sb, ")");
        return;
    case RFI_KIR_SELECT: emit_fmt(R, x, "%a ? %b : %c"); return;
    case RFI_KIR_CONVERT: convert(R, x); return;
    case RFI_KIR_ACC: put(R->sb, "acc"); return;
    default: put(R->sb, "0"); return;
    }
}

/* ---- Kernels ------------------------------------------------------------------------ */
static void indent_to(rfi_strbuf *sb, int depth)
{
    static const char spaces[] = "                                                  "
                                 "                                                  ";
    size_t n = 4 * (size_t)(depth > 0 ? depth : 0);
    for (; n > sizeof spaces - 1; n -= sizeof spaces - 1)
        put_n(sb, spaces, sizeof spaces - 1);
    put_n(sb, spaces, n);
}

static void indent(render *R, int depth) { indent_to(R->sb, depth); }

/* The live statements of one loop level; with `only`, just those whose only[id]
 * equals `want`. */
static void statements_where(render *R, const bool *live, int level, int depth, const bool *only,
                             bool want)
{
    const rfi_kir_kernel *k = R->k;
    for (int id = 0; id < k->n_ins; id++) {
        const rfi_kir_ins *x = &k->ins[id];
        if (!live[id] || x->level != level || x->op == RFI_KIR_VAR || x->op == RFI_KIR_CONST ||
            x->op == RFI_KIR_ACC || (only && only[id] != want))
            continue;
        indent(R, depth);
        bool pred = x->op == RFI_KIR_ICMP || x->op == RFI_KIR_LAND;
        put(R->sb, "const ");
        put(R->sb, pred ? "int" : ctype(x->dtype));
        put_char(R->sb, ' ');
        put(R->sb, R->names[id]);
        put(R->sb, " = ");
        expression(R, x);
        put(R->sb, ";\n");
    }
}

static void statements(render *R, const bool *live, int level, int depth)
{
    statements_where(R, live, level, depth, NULL, false);
}

static void stores(render *R, int depth)
{
    const rfi_kir_kernel *k = R->k;
    for (int s = 0; s < k->n_stores; s++) {
        indent(R, depth);
        put(R->sb, R->base_names[k->stores[s].base]);
        put_char(R->sb, '[');
        operand(R, k->stores[s].index);
        put(R->sb, "] = ");
        operand(R, k->stores[s].value);
        put(R->sb, ";\n");
    }
}

/* The text of an operand (a name or a literal) in buf. */
static void operand_text(render *R, int id, char *buf, size_t n)
{
    rfi_strbuf tmp = {0}, *out = R->sb;
    R->sb = &tmp;
    operand(R, id);
    R->sb = out;
    snprintf(buf, n, "%s", tmp.data && !tmp.failed ? tmp.data : "0");
    out->failed |= tmp.failed;
    rfi_sb_free(&tmp);
}

/* The accumulator update of a REDUCE kernel with the interpreter's arithmetic:
 * the lvalue `acc` folds the C expression `value`. */
static void fold_text(render *R, int depth, const char *acc, const char *value)
{
    const rfi_kir_kernel *k = R->k;
    bool f = rfi_dtype_is_float(k->acc_dtype);
    const char *fmt = "@ = $;\n"; /* @: the accumulator, $: the value */
    switch (k->red_kind) {
    case RF_REDUCE_SUM:
        fmt = f ? "@ += $;\n" : "@ = (int64_t)((uint64_t)@ + (uint64_t)$);\n";
        break;
    case RF_REDUCE_PROD:
        fmt = f ? "@ *= $;\n" : "@ = (int64_t)((uint64_t)@ * (uint64_t)$);\n";
        break;
    case RF_REDUCE_MAX:
        fmt = !f ? "@ = $ > @ ? $ : @;\n"
              : k->acc_dtype == RF_F64 ? "@ = rf_max_f64(@, $);\n" : "@ = rf_max_f32(@, $);\n";
        break;
    case RF_REDUCE_MIN:
        fmt = !f ? "@ = $ < @ ? $ : @;\n"
              : k->acc_dtype == RF_F64 ? "@ = rf_min_f64(@, $);\n" : "@ = rf_min_f32(@, $);\n";
        break;
    case RF_REDUCE_AND: fmt = f ? "@ = (double)((@ != 0) && ($ != 0));\n" : "@ &= $;\n"; break;
    case RF_REDUCE_OR: fmt = f ? "@ = (double)((@ != 0) || ($ != 0));\n" : "@ |= $;\n"; break;
    default: break;
    }
    if (f && (k->red_kind == RF_REDUCE_MAX || k->red_kind == RF_REDUCE_MIN))
        R->need |= k->acc_dtype == RF_F64 ? NEED_MAXMIN_F64 : NEED_MAXMIN_F32;
    indent(R, depth);
    for (const char *c = fmt; *c; c++) {
        if (*c == '@')
            put(R->sb, acc);
        else if (*c == '$')
            put(R->sb, value);
        else
            put_char(R->sb, *c);
    }
}

/* The fold of fold j's value into the lvalue `acc`, where the guard holds. */
static void fold_value_into(render *R, int depth, const char *acc, int j)
{
    const rfi_kir_kernel *k = R->k;
    if (k->red_guard >= 0) {
        indent(R, depth);
        put(R->sb, "if (");
        operand(R, k->red_guard);
        put(R->sb, ")\n");
        depth++;
    }
    char value[64];
    operand_text(R, rfi_kir_fold_value(k, j), value, sizeof value);
    fold_text(R, depth, acc, value);
}

/* The fold of the kernel's (one) value into the lvalue `acc`. */
static void fold_into(render *R, int depth, const char *acc)
{
    fold_value_into(R, depth, acc, 0);
}

/* Every fold into its accumulator (acc, acc1, ...). */
static void fold(render *R, int depth)
{
    for (int j = 0; j < R->k->n_folds; j++) {
        char acc[32];
        acc_name(acc, j);
        fold_value_into(R, depth, acc, j);
    }
}

/* The reduction's identity as a literal of the accumulator type. */
static void identity_literal(render *R)
{
    const rfi_kir_kernel *k = R->k;
    if (rfi_dtype_is_float(k->acc_dtype))
        float_literal(R->sb, k->red_identity_f, k->acc_dtype);
    else
        int_literal(R->sb, k->red_identity_i, RF_I64);
}

/* Declares every fold's accumulator at its identity. */
static void declare_accs(render *R, int depth)
{
    for (int j = 0; j < R->k->n_folds; j++) {
        char acc[32];
        acc_name(acc, j);
        indent(R, depth);
        putf(R->sb, "%s %s = ", ctype(R->k->acc_dtype), acc);
        identity_literal(R);
        put(R->sb, ";\n");
    }
}

/* text as a block comment at the given depth, one line per line. */
void rfi_render_c_comment(rfi_strbuf *sb, const char *text, int depth)
{
    indent_to(sb, depth);
    put(sb, "/* ");
    for (const char *c = text; c && *c;) {
        size_t run = strcspn(c, "\n*"); /* plain text up to the next line or star */
        put_n(sb, c, run);
        c += run;
        if (*c == '\n') {
            put_char(sb, '\n');
            indent_to(sb, depth);
            put(sb, " * ");
            c++;
        } else if (*c == '*') {
            put(sb, c[1] == '/' ? "* " : "*"); /* never close the comment early */
            c++;
        }
    }
    put(sb, " */\n");
}

static void comment(render *R, const char *text, int depth)
{
    rfi_render_c_comment(R->sb, text, depth);
}

static void kernel_name(const rfi_kir_kernel *k, char *buf, size_t n)
{
    snprintf(buf, n, "k%d_%s", k->step, k->name);
}

/* The name of the functions R renders for R->k ("K" in neutral form). */
static void rendered_name(const render *R, char *buf, size_t n)
{
    if (R->neutral)
        snprintf(buf, n, "K");
    else
        kernel_name(R->k, buf, n);
}

/* ---- Reduction schedules ------------------------------------------------------------- *
 * The kernel IR fixes what a REDUCE kernel folds and, per kept point, in which
 * order; the loop order and the split across threads are chosen here:
 *   plain         the kept loops outside (the outermost split across
 *                 threads), the reduced loops inside, the innermost
 *                 vectorised for float sums;
 *   interchanged  per block of the last kept axis, accumulators in an array,
 *                 the reduced loops outside and the kept axis innermost,
 *                 vectorised: reductions over leading axes (a bias gradient,
 *                 whose reduced loops walk memory by rows) and windows up to
 *                 64 points (pooling; kir_lower.c unrolls those up to 16),
 *                 whose reduced loops are too short to vectorise;
 *   split         the outermost reduced loop cut into a fixed number of
 *                 contiguous chunks, each folded from the identity into its
 *                 own partial accumulators of every kept point (the chunks run
 *                 across threads), then each point's partials folded in chunk
 *                 order: reductions whose outermost reduced loop is also the
 *                 outermost in memory (BatchNorm statistics over N, H and W;
 *                 sums to a scalar), which the plain form splits into strided
 *                 runs per thread (8-20 GB/s measured on [128,8,28,28]) or
 *                 runs on one thread. Each chunk streams one contiguous slab.
 * Every form folds each point's values in the same order, but the split one
 * groups them: that is exact for max and min as folded here (the first NaN,
 * else the last of the equal extremes: associative), for and, or and integer
 * sums and products (wrapping), and reassociates float sums only as their
 * vectorised loops already do, but that a split sum of f32 values adds blocks
 * of PRESUM of them in f32 before its double fold (below); float products
 * (whose over- and underflow depend on the grouping) are never split. The
 * chunk count does not depend on the number of threads, so neither do the
 * results. A kernel with sibling folds (kir.h) runs plain or split, each fold
 * with its own accumulator (acc, acc1, ...) or its own row of partials per
 * chunk (accs, accs1, ...). */
typedef enum sched_form { SCHED_PLAIN, SCHED_INTERCHANGED, SCHED_SPLIT } sched_form;

typedef struct schedule {
    sched_form form;
    int64_t chunks; /* SCHED_SPLIT: partial folds of the outermost reduced loop */
    int64_t kept;   /* SCHED_SPLIT: kept points, partial accumulators per chunk */
} schedule;

/* Kept points per accumulator block of an interchanged reduction. */
#define ROW_BLOCK 64
/* A reduction over at most this many points whose loads step along the last
 * kept axis by at most WINDOW_STRIDE elements is a window: interchanged. */
#define WINDOW_POINTS 64
#define WINDOW_STRIDE 4
/* Split reductions: chunks, and at most this many partial accumulators (they
 * live on the entry point's stack: 16 KB of doubles). */
#define SPLIT_CHUNKS 16
#define SPLIT_ACCS 2048

static int64_t loop_extent(const rfi_kir_kernel *k, int var)
{
    return var < k->rank ? k->dims[var] : k->red_dims[var - k->rank];
}

/* Whether a REDUCE kernel runs interchanged: its loads are contiguous along
 * the last kept axis but none along the innermost reduced one, or its
 * reduction is a small window and every load steps along the last kept axis
 * by a small constant stride (vectorised loads with a shuffle). */
static bool interchange_reduction(const rfi_kir_kernel *k, const bool *live)
{
    if (!k->is_reduce || k->rank < 1 || k->red_rank < 1)
        return false;
    int kept = k->rank - 1, inner = k->rank + k->red_rank - 1;
    bool kept_unit = false, inner_unit = false, kept_strided = true;
    for (int id = 0; id < k->n_ins; id++) {
        const rfi_kir_ins *x = &k->ins[id];
        if (!live[id] || x->op != RFI_KIR_LOAD)
            continue;
        int64_t ci, ck;
        bool affine_i = rfi_kir_var_coef(k, x->a, inner, &ci);
        bool affine_k = rfi_kir_var_coef(k, x->a, kept, &ck);
        inner_unit = inner_unit || (affine_i && ci == 1);
        kept_unit = kept_unit || (affine_k && ck == 1);
        kept_strided = kept_strided && affine_k && ck >= 0 && ck <= WINDOW_STRIDE;
    }
    if (!inner_unit)
        return kept_unit;
    return kept_strided && k->dims[kept] >= 4 &&
           rfi_numel(k->red_dims, k->red_rank) <= WINDOW_POINTS;
}

/* Whether every load that depends on loop `var` walks memory with it
 * outermost: its stride spans another loop's whole extent. */
static bool outermost_in_memory(const rfi_kir_kernel *k, const bool *live, int var)
{
    bool any = false;
    for (int id = 0; id < k->n_ins; id++) {
        const rfi_kir_ins *x = &k->ins[id];
        int64_t stride, other;
        if (!live[id] || x->op != RFI_KIR_LOAD)
            continue;
        if (!rfi_kir_var_coef(k, x->a, var, &stride) || stride < 0)
            return false;
        if (stride == 0)
            continue;
        any = true;
        for (int v = 0; v < k->rank + k->red_rank; v++)
            if (v != var && (!rfi_kir_var_coef(k, x->a, v, &other) ||
                             (other < 0 ? -other : other) * loop_extent(k, v) > stride))
                return false;
    }
    return any;
}

/* The chunks a split reduction cuts its outermost reduced loop into, or 0
 * when it is not split (see above). */
static int64_t split_chunks(const rfi_kir_kernel *k, const bool *live)
{
    if (!k->is_reduce || k->red_rank < 1 || k->red_dims[0] < 2 ||
        (k->red_kind == RF_REDUCE_PROD && rfi_dtype_is_float(k->acc_dtype)))
        return 0;
    int64_t kept = rfi_numel(k->dims, k->rank);
    if (kept * rfi_numel(k->red_dims, k->red_rank) <= PARALLEL_MIN ||
        !outermost_in_memory(k, live, k->rank))
        return 0;
    int64_t chunks = SPLIT_ACCS / (kept * k->n_folds);
    if (chunks > SPLIT_CHUNKS)
        chunks = SPLIT_CHUNKS;
    if (chunks > k->red_dims[0])
        chunks = k->red_dims[0];
    return chunks >= 2 ? chunks : 0;
}

static schedule choose_schedule(const rfi_kir_kernel *k, const bool *live)
{
    schedule sc = {SCHED_PLAIN, 0, 0};
    if ((sc.chunks = split_chunks(k, live)) > 0) {
        sc.form = SCHED_SPLIT;
        sc.kept = rfi_numel(k->dims, k->rank);
    } else if (k->n_folds == 1 && interchange_reduction(k, live)) {
        sc.form = SCHED_INTERCHANGED;
    }
    return sc;
}

/* Base b is in the tile of the convolution that runs the kernel (kir.h):
 * the kernel's argument `tile`, not a member of its ctx. */
static bool in_tile(const rfi_kir_kernel *k, int b)
{
    return k->bases[b].buffer == RFI_KIR_TILE_BUFFER;
}

/* The base in a tile, or -1 (a pool reads one convolution's result). */
static int tile_base(const rfi_kir_kernel *k)
{
    for (int b = 0; b < k->n_bases; b++)
        if (in_tile(k, b))
            return b;
    return -1;
}

/* A kernel's parameters: a pool's kernel that its convolution runs on a
 * tile takes the tile too. */
static void parameters(render *R, const rfi_kir_kernel *k)
{
    int t = tile_base(k);
    putf(R->sb, "(void *ctx, int64_t lo, int64_t hi%s%s%s)", t >= 0 ? ", const " : "",
         t >= 0 ? ctype(k->bases[t].dtype) : "", t >= 0 ? " *tile" : "");
}

static void ctx_struct(render *R, const bool *base_used, const char *kname, const schedule *sc)
{
    const rfi_kir_kernel *k = R->k;
    putf(R->sb, "struct %s_ctx {\n", kname);
    for (int b = 0; b < k->n_bases; b++)
        if (base_used[b] && !in_tile(k, b))
            putf(R->sb, "    %s%s *%s%s;\n", k->bases[b].written ? "" : "const ",
                          ctype(k->bases[b].dtype), k->bases[b].noalias ? "restrict " : "",
                          R->base_names[b]);
    if (sc->form == SCHED_SPLIT)
        putf(R->sb,
             "    %s *restrict part; /* [%lld chunks][%d folds][%lld points] partial folds */\n",
             ctype(k->acc_dtype), (long long)sc->chunks, k->n_folds, (long long)sc->kept);
    put(R->sb, "};\n\n");
}

/* The local copies of the bases a function uses. */
static void declare_bases(render *R, const bool *used)
{
    const rfi_kir_kernel *k = R->k;
    for (int b = 0; b < k->n_bases; b++) {
        if (!used[b])
            continue;
        const rfi_kir_base *x = &k->bases[b];
        putf(R->sb, "    %s%s *%s%s = ", x->written ? "" : "const ", ctype(x->dtype),
             x->noalias ? "restrict " : "", R->base_names[b]);
        if (!in_tile(k, b))
            putf(R->sb, "c->%s;\n", R->base_names[b]);
        else
            putf(R->sb, "tile + %zu;\n", x->offset / rf_dtype_size(x->dtype));
    }
}

/* used[b]: base b is loaded by a live instruction (or, with `stored`, stored to). */
static void bases_used(const rfi_kir_kernel *k, const bool *live, bool stored, bool *used)
{
    memset(used, 0, (size_t)(k->n_bases > 0 ? k->n_bases : 1) * sizeof *used);
    for (int id = 0; id < k->n_ins; id++)
        if (live[id] && k->ins[id].op == RFI_KIR_LOAD)
            used[k->ins[id].base] = true;
    for (int s = 0; stored && s < k->n_stores; s++)
        used[k->stores[s].base] = true;
}

static void close_loops(render *R, int depth, int n)
{
    for (int d = n - 1; d >= 0; d--) {
        indent(R, depth + d);
        put(R->sb, "}\n");
    }
}

static bool simd_sum(const rfi_kir_kernel *k)
{
    return k->red_kind == RF_REDUCE_SUM && rfi_dtype_is_float(k->acc_dtype);
}

/* Opens r0 of a split reduction over chunk q's range at depth. */
static void open_chunk_loop(render *R, int depth, const schedule *sc)
{
    long long n = (long long)R->k->red_dims[0], chunks = (long long)sc->chunks;
    indent(R, depth);
    if (n % chunks == 0)
        putf(R->sb, "for (int64_t r0 = q * %lld; r0 < q * %lld + %lld; r0++) {\n", n / chunks,
                      n / chunks, n / chunks);
    else
        putf(R->sb, "for (int64_t r0 = q * %lld / %lld; r0 < (q + 1) * %lld / %lld; r0++) {\n",
                      n, chunks, n, chunks);
}

/* Opens the reduced loops r<first>.. at depth, the innermost vectorised for
 * float sums; r0 of a split reduction runs over chunk q only. */
static void open_reduced_loops(render *R, int first, int depth, const schedule *sc)
{
    const rfi_kir_kernel *k = R->k;
    for (int d = first; d < k->red_rank; d++) {
        int at = depth + d - first;
        if (d == k->red_rank - 1 && simd_sum(k)) {
            indent(R, at);
            put(R->sb, "#pragma omp simd reduction(+:acc");
            for (int j = 1; j < k->n_folds; j++)
                putf(R->sb, ", acc%d", j);
            put(R->sb, ")\n");
        }
        if (d == 0 && sc->form == SCHED_SPLIT) {
            open_chunk_loop(R, at, sc);
            continue;
        }
        indent(R, at);
        putf(R->sb, "for (int64_t r%d = 0; r%d < %lld; r%d++) {\n", d, d,
                      (long long)k->red_dims[d], d);
    }
}

/* Opens the reduced loops r1 .. r<end - 1> at depth, plain (a split body's
 * loops inside the chunk loop r0). */
static void open_inner_reduced_loops(render *R, int end, int depth)
{
    for (int d = 1; d < end; d++) {
        indent(R, depth + d - 1);
        putf(R->sb, "for (int64_t r%d = 0; r%d < %lld; r%d++) {\n", d, d,
                      (long long)R->k->red_dims[d], d);
    }
}

static void reduction_loops(render *R, const bool *live, int depth)
{
    const rfi_kir_kernel *k = R->k;
    schedule plain = {SCHED_PLAIN, 0, 0};
    declare_accs(R, depth);
    open_reduced_loops(R, 0, depth, &plain);
    statements(R, live, 2, depth + k->red_rank);
    fold(R, depth + k->red_rank);
    close_loops(R, depth, k->red_rank);
    statements(R, live, 3, depth);
}

/* Opens the kept loops over their whole extents at depth (the innermost
 * vectorised when simd). */
static void open_kept_loops(render *R, int depth, bool simd)
{
    const rfi_kir_kernel *k = R->k;
    for (int d = 0; d < k->rank; d++) {
        if (simd && d == k->rank - 1) {
            indent(R, depth + d);
            put(R->sb, "#pragma omp simd\n");
        }
        indent(R, depth + d);
        putf(R->sb, "for (int64_t i%d = 0; i%d < %lld; i%d++) {\n", d, d,
                      (long long)k->dims[d], d);
    }
}

/* The kept point's row-major index over the kept loops, as C text. */
static void kept_index(const rfi_kir_kernel *k, char *buf, size_t n)
{
    size_t len = 0;
    snprintf(buf, n, "0");
    for (int d = 0; d < k->rank && len < n; d++) {
        int64_t stride = rfi_numel(k->dims + d + 1, k->rank - d - 1);
        int w = stride == 1 ? snprintf(buf + len, n - len, "%si%d", d ? " + " : "", d)
                            : snprintf(buf + len, n - len, "%si%d * %lld", d ? " + " : "", d,
                                       (long long)stride);
        len += w > 0 ? (size_t)w : 0;
    }
}

/* ---- Interchanged reductions ------------------------------------------------------------ */
/* for (i<kept> = lo; i<kept> < hi; ...) {, vectorised when simd */
static void range_loop(render *R, int kept, const char *lo, const char *hi, int depth, bool simd)
{
    if (simd) {
        indent(R, depth);
        put(R->sb, "#pragma omp simd\n");
    }
    indent(R, depth);
    putf(R->sb, "for (int64_t i%d = %s; i%d < %s; i%d++) {\n", kept, lo, kept, hi, kept);
}

/* Marks instruction id and everything it reads in m. */
static void reach(const rfi_kir_kernel *k, int id, bool *m)
{
    if (id < 0 || m[id])
        return;
    m[id] = true;
    reach(k, k->ins[id].a, m);
    reach(k, k->ins[id].b, m);
    reach(k, k->ins[id].c, m);
}

/* fold[i]: instruction i is needed by the fold or its guard; out[i]: by a store. */
static void fold_out_liveness(const rfi_kir_kernel *k, bool *fold_live, bool *out_live)
{
    for (int j = 0; j < k->n_folds; j++)
        reach(k, rfi_kir_fold_value(k, j), fold_live);
    reach(k, k->red_guard, fold_live);
    for (int st = 0; st < k->n_stores; st++) {
        reach(k, k->stores[st].index, out_live);
        reach(k, k->stores[st].value, out_live);
    }
}

/* The interchanged form: per block of the last kept axis (the whole axis when
 * it is short), accumulators in an array, the reduced loops outside, the kept
 * axis innermost (vectorised). Each of the two inner bodies declares only the
 * per-point values it uses (live: the fold's, out: the stores'). */
static void interchanged_body(render *R, const bool *live, const bool *out)
{
    const rfi_kir_kernel *k = R->k;
    int kept = k->rank - 1, depth = 1 + kept;
    for (int d = 0; d < kept; d++) {
        indent(R, 1 + d);
        if (d == 0)
            put(R->sb, "for (int64_t i0 = lo; i0 < hi; i0++) {\n");
        else
            putf(R->sb, "for (int64_t i%d = 0; i%d < %lld; i%d++) {\n", d, d,
                          (long long)k->dims[d], d);
    }
    bool blocked = kept == 0 || k->dims[kept] > ROW_BLOCK;
    char lo[32], hi[32], slot[48];
    int64_t n_accs = blocked ? ROW_BLOCK : k->dims[kept];
    if (blocked) {
        indent(R, depth);
        if (kept == 0)
            putf(R->sb, "for (int64_t b0 = lo; b0 < hi; b0 += %d) {\n", ROW_BLOCK);
        else
            putf(R->sb, "for (int64_t b%d = 0; b%d < %lld; b%d += %d) {\n", kept, kept,
                          (long long)k->dims[kept], kept, ROW_BLOCK);
        snprintf(hi, sizeof hi, kept == 0 ? "hi" : "%lld", (long long)k->dims[kept]);
        depth++;
        indent(R, depth);
        putf(R->sb, "const int64_t e%d = b%d + %d < %s ? b%d + %d : %s;\n", kept, kept,
                      ROW_BLOCK, hi, kept, ROW_BLOCK, hi);
        snprintf(lo, sizeof lo, "b%d", kept);
        snprintf(hi, sizeof hi, "e%d", kept);
        snprintf(slot, sizeof slot, "i%d - b%d", kept, kept);
    } else {
        snprintf(lo, sizeof lo, "0");
        snprintf(hi, sizeof hi, "%lld", (long long)k->dims[kept]);
        snprintf(slot, sizeof slot, "i%d", kept);
    }
    indent(R, depth);
    putf(R->sb, "%s accs[%lld];\n", ctype(k->acc_dtype), (long long)n_accs);
    range_loop(R, kept, lo, hi, depth, false);
    indent(R, depth + 1);
    putf(R->sb, "accs[%s] = ", slot);
    identity_literal(R);
    put(R->sb, ";\n");
    indent(R, depth);
    put(R->sb, "}\n");
    for (int d = 0; d < k->red_rank; d++) {
        indent(R, depth + d);
        putf(R->sb, "for (int64_t r%d = 0; r%d < %lld; r%d++) {\n", d, d,
                      (long long)k->red_dims[d], d);
    }
    int in = depth + k->red_rank;
    range_loop(R, kept, lo, hi, in, true);
    indent(R, in + 1);
    putf(R->sb, "%s acc = accs[%s];\n", ctype(k->acc_dtype), slot);
    statements(R, live, 1, in + 1);
    statements(R, live, 2, in + 1);
    fold(R, in + 1);
    indent(R, in + 1);
    putf(R->sb, "accs[%s] = acc;\n", slot);
    indent(R, in);
    put(R->sb, "}\n");
    close_loops(R, depth, k->red_rank);
    range_loop(R, kept, lo, hi, depth, false);
    indent(R, depth + 1);
    putf(R->sb, "const %s acc = accs[%s];\n", ctype(k->acc_dtype), slot);
    statements(R, out, 1, depth + 1);
    statements(R, out, 3, depth + 1);
    stores(R, depth + 1);
    indent(R, depth);
    put(R->sb, "}\n");
    if (blocked) {
        indent(R, depth - 1);
        put(R->sb, "}\n");
    }
    close_loops(R, 1, kept);
}

/* ---- Split reductions ------------------------------------------------------------------- */
/* Each fold's accumulator from (load) or back into its row of partials in
 * the chunk (accs, accs1, ...) at kept index kl (C text). */
static void copy_partials(render *R, int depth, const char *kl, bool load)
{
    for (int j = 0; j < R->k->n_folds; j++) {
        char acc[32], row[32];
        acc_name(acc, j);
        fold_name(row, "accs", j);
        indent(R, depth);
        if (load)
            putf(R->sb, "%s %s = %s[%s];\n", ctype(R->k->acc_dtype), acc, row, kl);
        else
            putf(R->sb, "%s[%s] = %s;\n", row, kl, acc);
    }
}

/* Split float sums fold f32 values converted to double (kir.h), and on AVX2
 * the conversions cost more than the rest of a BatchNorm gradient's four
 * sums: ~15 cycles per 8 points, where the loads and products take ~5. So
 * each point first adds PRESUM consecutive values of its innermost reduced
 * loop in f32 and converts and folds only their sum. That adds at most
 * 3 * 2^-24 of the block's sum of magnitudes per block (the values are f32
 * roundings already; a math library sums f32 data in f32 throughout), and
 * the ResNet's four sums of 8 channels ran 2-2.8x faster alone (400 ->
 * 300 us in the step; all its reductions 3.5 -> 2.9 ms). */
#define PRESUM 4

/* The extent of the innermost reduced loop a split body runs (r0 over one
 * chunk: its shortest). */
static int64_t innermost_reduced(const rfi_kir_kernel *k, const schedule *sc)
{
    int last = k->red_rank - 1;
    return last == 0 ? k->red_dims[0] / sc->chunks : k->red_dims[last];
}

static bool presum_wanted(const rfi_kir_kernel *k, const bool *live, const schedule *sc)
{
    if (k->rank < 1 || !simd_sum(k) || k->acc_dtype != RF_F64 || k->red_guard >= 0 ||
        innermost_reduced(k, sc) < PRESUM ||
        !(k->red_rank == 1 || interchange_reduction(k, live)))
        return false;
    for (int j = 0; j < k->n_folds; j++) {
        const rfi_kir_ins *v = &k->ins[rfi_kir_fold_value(k, j)];
        if (v->op != RFI_KIR_CONVERT || v->a < 0 || k->ins[v->a].dtype != RF_F32)
            return false;
    }
    return true;
}

/* The kept loops of a split body at depth around the rest: the values, the
 * partials loaded, folded and stored back (inside the reduced loops). */
static void fold_kept_points(render *R, const bool *live, const char *kl, int depth)
{
    int in = depth + R->k->rank;
    open_kept_loops(R, depth, true);
    statements(R, live, 1, in);
    statements(R, live, 2, in);
    copy_partials(R, in, kl, true);
    fold(R, in);
    copy_partials(R, in, kl, false);
    close_loops(R, depth, R->k->rank);
}

/* live without the conversions to double the folds read (unless something
 * else reads them too), in `out`. */
static void without_fold_conversions(const rfi_kir_kernel *k, const bool *live, bool *out)
{
    memcpy(out, live, (size_t)k->n_ins * sizeof *out);
    for (int j = 0; j < k->n_folds; j++)
        out[rfi_kir_fold_value(k, j)] = false;
    for (int id = 0; id < k->n_ins; id++) {
        const rfi_kir_ins *x = &k->ins[id];
        for (int j = 0; j < k->n_folds && out[id]; j++) {
            int v = rfi_kir_fold_value(k, j);
            if (x->a == v || x->b == v || x->c == v)
                out[v] = true;
        }
    }
}

/* The kept loops at depth around one block of PRESUM values of the innermost
 * reduced loop r<last> from rb: each point sums them in f32, then folds. */
static void presum_block(render *R, const bool *block_live, const char *kl, int depth)
{
    const rfi_kir_kernel *k = R->k;
    int last = k->red_rank - 1, in = depth + k->rank;
    open_kept_loops(R, depth, true);
    statements(R, block_live, 1, in);
    for (int j = 0; j < k->n_folds; j++) {
        indent(R, in);
        putf(R->sb, "float ps%d = 0.0f;\n", j);
    }
    indent(R, in); /* a constant count: gcc unrolls it and vectorises the kept loop */
    putf(R->sb, "for (int64_t u = 0; u < %d; u++) {\n", PRESUM);
    indent(R, in + 1);
    putf(R->sb, "const int64_t r%d = rb + u;\n", last);
    statements(R, block_live, 2, in + 1);
    for (int j = 0; j < k->n_folds; j++) {
        char value[64];
        operand_text(R, k->ins[rfi_kir_fold_value(k, j)].a, value, sizeof value);
        indent(R, in + 1);
        putf(R->sb, "ps%d += %s;\n", j, value);
    }
    indent(R, in);
    put(R->sb, "}\n");
    copy_partials(R, in, kl, true);
    for (int j = 0; j < k->n_folds; j++) {
        char acc[32], value[32];
        acc_name(acc, j);
        snprintf(value, sizeof value, "(double)ps%d", j);
        fold_text(R, in, acc, value);
    }
    copy_partials(R, in, kl, false);
    close_loops(R, depth, k->rank);
}

/* The split body of presum_wanted kernels (at depth 2, in chunk q): the outer
 * reduced loops (r0 over the chunk), then the innermost one in blocks of
 * PRESUM values, and its last values one at a time. */
static void presum_body(render *R, const bool *live, const schedule *sc, const char *kl)
{
    const rfi_kir_kernel *k = R->k;
    bool *block_live = rfi_calloc((size_t)k->n_ins, sizeof *block_live);
    if (!block_live) {
        R->sb->failed = true;
        return;
    }
    without_fold_conversions(k, live, block_live);
    int last = k->red_rank - 1, depth = 2;
    if (last > 0) {
        open_chunk_loop(R, depth++, sc);
        open_inner_reduced_loops(R, last, depth);
        depth += last - 1;
    }
    char lo[64], hi[64];
    if (last == 0) {
        long long n = (long long)k->red_dims[0], chunks = (long long)sc->chunks;
        snprintf(lo, sizeof lo, "q * %lld / %lld", n, chunks);
        snprintf(hi, sizeof hi, "(q + 1) * %lld / %lld", n, chunks);
    } else {
        snprintf(lo, sizeof lo, "0");
        snprintf(hi, sizeof hi, "%lld", (long long)k->red_dims[last]);
    }
    indent(R, depth);
    putf(R->sb, "const int64_t r_hi = %s;\n", hi);
    indent(R, depth);
    putf(R->sb, "int64_t rb = %s;\n", lo);
    indent(R, depth);
    putf(R->sb, "for (; rb + %d <= r_hi; rb += %d) {\n", PRESUM, PRESUM);
    presum_block(R, block_live, kl, depth + 1);
    indent(R, depth);
    put(R->sb, "}\n");
    indent(R, depth);
    putf(R->sb, "for (int64_t r%d = rb; r%d < r_hi; r%d++) {\n", last, last, last);
    fold_kept_points(R, live, kl, depth + 1);
    indent(R, depth);
    put(R->sb, "}\n");
    close_loops(R, 2, depth - 2);
    rfi_free(block_live);
}

/* The chunk function: chunks [lo, hi), each folding its range of r0 into its
 * row of partial accumulators. Reductions over r0 alone, and those whose
 * loads walk memory along the last kept axis but not along the innermost
 * reduced one (a bias gradient over channel-blocked data), run with the kept
 * axis innermost (vectorised, like the interchanged form); the others with
 * the kept loops around the remaining reduced loops. Each point folds its
 * values in the same order either way. */
static void split_body(render *R, const bool *live, const schedule *sc)
{
    const rfi_kir_kernel *k = R->k;
    char kl[320];
    kept_index(k, kl, sizeof kl);
    const char *acc_t = ctype(k->acc_dtype);
    statements(R, live, 0, 1);
    put(R->sb, "    for (int64_t q = lo; q < hi; q++) {\n");
    int folds = k->n_folds;
    if (k->rank == 0) { /* one point: its partials in scalars */
        declare_accs(R, 2);
        open_reduced_loops(R, 0, 2, sc);
        statements(R, live, 2, 2 + k->red_rank);
        fold(R, 2 + k->red_rank);
        close_loops(R, 2, k->red_rank);
        if (folds == 1)
            put(R->sb, "        c->part[q] = acc;\n");
        for (int j = 0; j < folds && folds > 1; j++) {
            char acc[32];
            acc_name(acc, j);
            putf(R->sb, "        c->part[q * %d + %d] = %s;\n", folds, j, acc);
        }
        put(R->sb, "    }\n");
        return;
    }
    putf(R->sb, "        %s *restrict accs = c->part + q * %lld;\n", acc_t,
                  (long long)(folds * sc->kept));
    for (int j = 1; j < folds; j++)
        putf(R->sb, "        %s *restrict accs%d = accs + %lld;\n", acc_t, j,
                      (long long)(j * sc->kept));
    putf(R->sb, "        for (int64_t a = 0; a < %lld; a++)\n            accs[a] = ",
                  (long long)(folds * sc->kept));
    identity_literal(R);
    put(R->sb, ";\n");
    if (presum_wanted(k, live, sc)) {
        presum_body(R, live, sc, kl);
    } else if (k->red_rank == 1 || interchange_reduction(k, live)) {
        open_chunk_loop(R, 2, sc);
        open_inner_reduced_loops(R, k->red_rank, 3);
        fold_kept_points(R, live, kl, 2 + k->red_rank);
        close_loops(R, 2, k->red_rank);
    } else {
        open_chunk_loop(R, 2, sc);
        open_kept_loops(R, 3, false);
        int in = 3 + k->rank;
        statements(R, live, 1, in);
        copy_partials(R, in, kl, true);
        open_reduced_loops(R, 1, in, sc);
        statements(R, live, 2, in + k->red_rank - 1);
        fold(R, in + k->red_rank - 1);
        close_loops(R, in, k->red_rank - 1);
        copy_partials(R, in, kl, false);
        close_loops(R, 2, 1 + k->rank);
    }
    put(R->sb, "    }\n");
}

/* The combine function: each point's partials folded in chunk order, then
 * the values after the reduction computed and stored. */
static void combine_function(render *R, const char *kname, const bool *live, const bool *used,
                             const schedule *sc)
{
    const rfi_kir_kernel *k = R->k;
    char kl[320], part[400];
    kept_index(k, kl, sizeof kl);
    int folds = k->n_folds;
    putf(R->sb, "/* Folds each point's %lld partials in chunk order, then stores. */\n",
                  (long long)sc->chunks);
    putf(R->sb, "RF_KERNEL void %s_combine(const struct %s_ctx *c)\n{\n", kname, kname);
    declare_bases(R, used);
    statements(R, live, 0, 1);
    open_kept_loops(R, 1, false);
    int in = 1 + k->rank;
    declare_accs(R, in);
    for (int j = 0; j < folds; j++) {
        char acc[32], row[64] = "";
        acc_name(acc, j);
        if (j > 0)
            snprintf(row, sizeof row, " + %lld", (long long)(j * sc->kept));
        if (sc->kept == 1 && folds == 1)
            snprintf(part, sizeof part, "c->part[q]");
        else if (sc->kept == 1)
            snprintf(part, sizeof part, "c->part[q * %d%s]", folds, row);
        else
            snprintf(part, sizeof part, "c->part[q * %lld%s + %s]",
                     (long long)(folds * sc->kept), row, kl);
        indent(R, in);
        putf(R->sb, "for (int64_t q = 0; q < %lld; q++)\n", (long long)sc->chunks);
        fold_text(R, in + 1, acc, part);
    }
    statements(R, live, 1, in);
    statements(R, live, 3, in);
    stores(R, in);
    close_loops(R, 1, k->rank);
    put(R->sb, "}\n\n");
}

/* Whether k runs 512-bit vectors (RF_LANES16): an elementwise kernel whose
 * innermost loop is the 16 lanes of a channel block, or a reduction folding
 * rows of at least MIN_WIDE_FOLD points (a batch-1 matrix-vector product read
 * its 0.8 MB of weights per thread from L2 16% faster: docs/ARCHITECTURE.md). */
#define MIN_WIDE_FOLD 64
static bool lanes16(const rfi_kir_kernel *k)
{
    if (k->red_rank > 0)
        return k->red_dims[k->red_rank - 1] >= MIN_WIDE_FOLD;
    return k->rank >= 1 && k->dims[k->rank - 1] == 16;
}

static void function_head(render *R, const char *kname)
{
    bool wide = lanes16(R->k);
    R->need |= wide ? NEED_LANES16 : 0;
    putf(R->sb, "RF_KERNEL%s void %s", wide ? " RF_LANES16" : "", kname);
    parameters(R, R->k);
    putf(R->sb, "\n{\n    const struct %s_ctx *c = ctx;\n", kname);
}

/* A split reduction's two functions; fold_live and out_live are scratch. */
static void split_functions(render *R, const char *kname, const schedule *sc, bool *fold_live,
                            bool *out_live, bool *used)
{
    fold_out_liveness(R->k, fold_live, out_live);
    function_head(R, kname);
    bases_used(R->k, fold_live, false, used);
    declare_bases(R, used);
    split_body(R, fold_live, sc);
    put(R->sb, "}\n\n");
    bases_used(R->k, out_live, true, used);
    combine_function(R, kname, out_live, used, sc);
}

static void plain_body(render *R, const bool *live)
{
    const rfi_kir_kernel *k = R->k;
    if (k->rank == 0)
        put(R->sb, "    (void)lo;\n    (void)hi;\n");
    for (int d = 0; d < k->rank; d++) {
        if (d == k->rank - 1 && !k->is_reduce) {
            indent(R, 1 + d);
            put(R->sb, "#pragma omp simd\n");
        }
        indent(R, 1 + d);
        if (d == 0)
            put(R->sb, "for (int64_t i0 = lo; i0 < hi; i0++) {\n");
        else
            putf(R->sb, "for (int64_t i%d = 0; i%d < %lld; i%d++) {\n", d, d,
                          (long long)k->dims[d], d);
    }
    int depth = 1 + k->rank;
    statements(R, live, 1, depth);
    if (k->is_reduce)
        reduction_loops(R, live, depth);
    stores(R, depth);
    close_loops(R, 1, k->rank);
}

/* ---- Unrolled reductions -------------------------------------------------------------- *
 * A float sum over one contiguous reduced loop per output (a matrix-vector
 * product: the batch-1 dense layer) is bound by the latency of its one
 * vector accumulator. Its plain schedule gets UNROLL_OUTPUTS outputs per
 * iteration of the kept loop, each with its own accumulator in one
 * vectorised reduced loop, which also loads the values they share (the
 * vector) once. Each output still folds its points in the same order, so
 * results are bitwise those of the plain schedule. */
#define UNROLL_OUTPUTS 4
#define UNROLL_MIN_POINTS 32

static bool unroll_reduction(const rfi_kir_kernel *k)
{
    return k->is_reduce && k->n_folds == 1 && k->rank == 1 && k->red_rank == 1 && simd_sum(k) &&
           k->dims[0] >= 2 * UNROLL_OUTPUTS && k->red_dims[0] >= UNROLL_MIN_POINTS;
}

/* dep[id]: instruction id varies with the kept loop (its value is per output). */
static void output_dependent(const rfi_kir_kernel *k, bool *dep)
{
    for (int id = 0; id < k->n_ins; id++) {
        const rfi_kir_ins *x = &k->ins[id];
        dep[id] = (x->op == RFI_KIR_VAR && x->var == 0) || x->op == RFI_KIR_ACC ||
                  (x->a >= 0 && x->a < id && dep[x->a]) ||
                  (x->b >= 0 && x->b < id && dep[x->b]) || (x->c >= 0 && x->c < id && dep[x->c]);
    }
}

/* Renames the per-output values for output u of a block: x_12 becomes x_12u2
 * and i0 i0u2 for u = 2 (u = 0 keeps the plain names); the accumulator is
 * acc_<u>. False when a name would not fit. */
static bool name_output(render *R, const bool *dep, char (*saved)[32], int u)
{
    const rfi_kir_kernel *k = R->k;
    for (int id = 0; id < k->n_ins; id++) {
        if (!dep[id])
            continue;
        const rfi_kir_ins *x = &k->ins[id];
        /* "u<u>" after a name's digits: no plain name has letters there */
        int n = x->op == RFI_KIR_ACC ? snprintf(R->names[id], 32, "acc_%d", u)
                : u == 0             ? snprintf(R->names[id], 32, "%s", saved[id])
                                     : snprintf(R->names[id], 32, "%su%d", saved[id], u);
        if (n < 0 || n >= 32)
            return false;
    }
    return true;
}

/* The block of UNROLL_OUTPUTS outputs at i0 (see above); false (nothing
 * written) when the names do not fit. */
static bool unrolled_block(render *R, const bool *live, const bool *dep, char (*saved)[32])
{
    const rfi_kir_kernel *k = R->k;
    rfi_strbuf text = {0}, *out = R->sb;
    R->sb = &text;
    bool ok = true;
    putf(R->sb, "    for (; i0 + %d <= hi; i0 += %d) {\n", UNROLL_OUTPUTS, UNROLL_OUTPUTS);
    for (int u = 1; u < UNROLL_OUTPUTS; u++)
        putf(R->sb, "        const int64_t i0u%d = i0 + %d;\n", u, u);
    statements_where(R, live, 1, 2, dep, false);
    for (int u = 0; u < UNROLL_OUTPUTS && ok; u++)
        if ((ok = name_output(R, dep, saved, u)))
            statements_where(R, live, 1, 2, dep, true);
    for (int u = 0; u < UNROLL_OUTPUTS; u++) {
        putf(R->sb, "        %s acc_%d = ", ctype(k->acc_dtype), u);
        identity_literal(R);
        put(R->sb, ";\n");
    }
    put(R->sb, "        #pragma omp simd reduction(+:acc_0");
    for (int u = 1; u < UNROLL_OUTPUTS; u++)
        putf(R->sb, ", acc_%d", u);
    putf(R->sb, ")\n        for (int64_t r0 = 0; r0 < %lld; r0++) {\n",
                  (long long)k->red_dims[0]);
    statements_where(R, live, 2, 3, dep, false);
    for (int u = 0; u < UNROLL_OUTPUTS && ok; u++) {
        char acc[16];
        snprintf(acc, sizeof acc, "acc_%d", u);
        if ((ok = name_output(R, dep, saved, u))) {
            statements_where(R, live, 2, 3, dep, true);
            fold_into(R, 3, acc);
        }
    }
    put(R->sb, "        }\n");
    for (int u = 0; u < UNROLL_OUTPUTS && ok; u++)
        if ((ok = name_output(R, dep, saved, u))) {
            statements_where(R, live, 3, 2, dep, true);
            stores(R, 2);
        }
    put(R->sb, "    }\n");
    R->sb = out;
    for (int id = 0; id < k->n_ins; id++) /* the plain names back */
        memcpy(R->names[id], saved[id], 32);
    out->failed |= text.failed;
    ok = ok && !text.failed;
    if (ok)
        put_n(R->sb, text.data, text.len);
    rfi_sb_free(&text);
    return ok;
}

/* Blocks of UNROLL_OUTPUTS outputs, then the plain schedule for the rest. */
static void unrolled_body(render *R, const bool *live)
{
    const rfi_kir_kernel *k = R->k;
    size_t n = (size_t)(k->n_ins > 0 ? k->n_ins : 1);
    bool *dep = rfi_calloc(n, sizeof *dep);
    char (*saved)[32] = rfi_malloc(n * sizeof *saved);
    if (dep && saved) {
        memcpy(saved, R->names, (size_t)k->n_ins * sizeof *saved);
        output_dependent(k, dep);
        put(R->sb, "    int64_t i0 = lo;\n");
        if (unrolled_block(R, live, dep, saved))
            /* fewer than UNROLL_OUTPUTS outputs are left; saying so keeps gcc,
             * once the kernel is inlined with constant bounds, from warning
             * that a later iteration of this loop would overflow an index */
            putf(R->sb, "    for (const int64_t tail_end = i0 + (hi - i0) %% %d; i0 < tail_end; "
                        "i0++) {\n", UNROLL_OUTPUTS);
        else
            put(R->sb, "    /* (not unrolled: names too long) */\n    for (; i0 < hi; i0++) {\n");
        statements(R, live, 1, 2);
        reduction_loops(R, live, 2);
        stores(R, 2);
        put(R->sb, "    }\n");
    } else {
        R->sb->failed = true;
    }
    rfi_free(dep);
    rfi_free(saved);
}

static void one_function(render *R, const char *kname, const schedule *sc, const bool *live,
                         bool *fold_live, bool *out_live, bool *base_used);

/* The kernel's comment, ctx struct and declarations into R->sb, its
 * functions into R->def; fold_live and out_live are scratch. */
static void kernel_functions(render *R, const bool *live, bool *fold_live, bool *out_live,
                             bool *base_used)
{
    const rfi_kir_kernel *k = R->k;
    schedule sc = choose_schedule(k, live);
    char kname[64];
    rendered_name(R, kname, sizeof kname);
    if (!R->neutral)
        comment(R, k->comment ? k->comment : kname, 0);
    ctx_struct(R, base_used, kname, &sc);
    /* declared before any part's code: the entry point's part calls it */
    putf(R->sb, "RF_KERNEL void %s", kname);
    parameters(R, k);
    put(R->sb, ";\n");
    if (sc.form == SCHED_SPLIT)
        putf(R->sb, "RF_KERNEL void %s_combine(const struct %s_ctx *c);\n", kname, kname);
    put(R->sb, "\n");
    rfi_strbuf *decl = R->sb;
    R->sb = R->def;
    if (sc.form == SCHED_SPLIT)
        split_functions(R, kname, &sc, fold_live, out_live, base_used);
    else
        one_function(R, kname, &sc, live, fold_live, out_live, base_used);
    R->sb = decl;
}

/* The function of a kernel that is not a split reduction. */
static void one_function(render *R, const char *kname, const schedule *sc, const bool *live,
                         bool *fold_live, bool *out_live, bool *base_used)
{
    const rfi_kir_kernel *k = R->k;
    function_head(R, kname);
    declare_bases(R, base_used);
    statements(R, live, 0, 1);
    if (sc->form == SCHED_INTERCHANGED) {
        fold_out_liveness(k, fold_live, out_live);
        interchanged_body(R, fold_live, out_live);
    } else if (unroll_reduction(k)) {
        unrolled_body(R, live);
    } else {
        plain_body(R, live);
    }
    put(R->sb, "}\n\n");
}

static rf_status render_kernel(render *R, const rfi_kir_kernel *k)
{
    size_t n_ins = (size_t)(k->n_ins > 0 ? k->n_ins : 1);
    bool *live = rfi_calloc(n_ins, sizeof(bool));
    bool *fold_live = rfi_calloc(n_ins, sizeof(bool));
    bool *out_live = rfi_calloc(n_ins, sizeof(bool));
    bool *base_used = rfi_calloc((size_t)(k->n_bases > 0 ? k->n_bases : 1), sizeof(bool));
    R->names = rfi_calloc(n_ins, sizeof *R->names);
    R->base_names = rfi_calloc((size_t)(k->n_bases > 0 ? k->n_bases : 1), sizeof *R->base_names);
    bool ok = live && fold_live && out_live && base_used && R->names && R->base_names;
    if (ok) {
        R->k = k;
        rfi_kir_liveness(k, live);
        bases_used(k, live, true, base_used);
        name_values(R, live, base_used);
        kernel_functions(R, live, fold_live, out_live, base_used);
    }
    rfi_free(live);
    rfi_free(fold_live);
    rfi_free(out_live);
    rfi_free(base_used);
    rfi_free(R->names);
    rfi_free(R->base_names);
    R->names = NULL;
    R->base_names = NULL;
    return ok ? RF_OK : rfi_error(RF_E_NOMEM, "render_c: out of memory");
}

/* ---- Kernels that share functions ------------------------------------------------------ *
 * Two kernels whose functions read the same in neutral names (values and
 * bases named by position, the function "K"), ctx struct included, differ
 * only in the pointers their ctx holds (rfi_kir_rebase has moved constant
 * offsets into those): the later one's step calls the earlier one's
 * functions with a ctx of its own. The pieces of a segmented optimiser
 * update and the kernels of a network's repeated blocks come out alike, and
 * gcc compiles each such function once. */
#define SHARE_MIN_POINTS (1 << 16)

/* Whether m's kernels together iterate over enough points for shared
 * functions to cost nothing that shows: a kernel that calls another's
 * function cannot be inlined into the entry point with its constant bounds,
 * a few ns per call. The tiny training step (about 1000 points, 2.14 us)
 * took 2.17 us with its optimiser pieces, 2 to 32 elements long, sharing. */
static bool shares_functions(const rfi_kir_module *m)
{
    int64_t points = 0;
    for (int i = 0; i < m->n_steps && points < SHARE_MIN_POINTS; i++)
        if (m->steps[i].kind == RFI_KIR_STEP_KERNEL) {
            const rfi_kir_kernel *k = m->steps[i].kernel;
            points += rfi_numel(k->dims, k->rank) * rfi_numel(k->red_dims, k->red_rank);
        }
    return points >= SHARE_MIN_POINTS;
}

typedef struct kernel_text {
    rfi_strbuf text; /* the neutral form */
    uint64_t hash;
} kernel_text;

static rf_status neutral_text(render *R, const rfi_kir_kernel *k, kernel_text *out)
{
    rfi_strbuf *sb = R->sb, *def = R->def;
    R->sb = R->def = &out->text;
    R->neutral = true;
    rf_status st = render_kernel(R, k);
    R->sb = sb, R->def = def;
    R->neutral = false;
    if (st == RF_OK && out->text.failed)
        st = rfi_error(RF_E_NOMEM, "render_c: out of memory");
    out->hash = rfi_hash_bytes(RFI_HASH_INIT, out->text.data, out->text.len);
    return st;
}

/* The earlier kernel step of m whose functions step i can call (i itself
 * when none), from the neutral texts of the steps before it. */
static int same_functions(const rfi_kir_module *m, const kernel_text *texts,
                          const int *function_of, int i)
{
    const kernel_text *t = &texts[i];
    for (int j = 0; j < i; j++) {
        const kernel_text *u = &texts[j];
        if (m->steps[j].kind == RFI_KIR_STEP_KERNEL && function_of[j] == j &&
            u->hash == t->hash && u->text.len == t->text.len &&
            memcmp(u->text.data, t->text.data, t->text.len) == 0)
            return j;
    }
    return i;
}

/* Renders kernel step i into R->sb (declarations) and R->def (functions), or
 * when an earlier step's functions do its work, only its comment. */
static rf_status kernel_piece(render *R, const rfi_kir_module *m, kernel_text *texts,
                              int *function_of, int i)
{
    const rfi_kir_kernel *k = m->steps[i].kernel;
    if (!R->share) {
        function_of[i] = i;
        return render_kernel(R, k);
    }
    rf_status st = neutral_text(R, k, &texts[i]);
    function_of[i] = st == RF_OK ? same_functions(m, texts, function_of, i) : i;
    if (st != RF_OK || function_of[i] == i)
        return st == RF_OK ? render_kernel(R, k) : st;
    char kname[64], shared[64];
    kernel_name(k, kname, sizeof kname);
    kernel_name(m->steps[function_of[i]].kernel, shared, sizeof shared);
    comment(R, k->comment ? k->comment : kname, 0);
    putf(R->sb, "/* (%s: the functions of %s, on its own buffers) */\n\n", kname, shared);
    return RF_OK;
}

/* ---- The entry point ---------------------------------------------------------------- */
/* (type *)(bufs[buffer] + offset bytes) */
void rfi_render_c_pointer(rfi_strbuf *sb, const char *type, int buffer, size_t offset)
{
    if (offset)
        putf(sb, "(%s *)(void *)((char *)bufs[%d] + %zu)", type, buffer, offset);
    else
        putf(sb, "(%s *)bufs[%d]", type, buffer);
}

static void pointer(render *R, const char *type, int buffer, size_t offset)
{
    rfi_render_c_pointer(R->sb, type, buffer, offset);
}

/* "struct <kname>_ctx <var> = {" and kernel k's bases that base_used marks,
 * without the closing brace; returns whether there were none. */
static bool kernel_ctx(render *R, const rfi_kir_kernel *k, const bool *base_used,
                       const char *kname, const char *var)
{
    putf(R->sb, "        struct %s_ctx %s = {", kname, var);
    bool none = true;
    for (int b = 0; b < k->n_bases; b++) {
        if (!base_used[b] || in_tile(k, b))
            continue;
        const rfi_kir_base *x = &k->bases[b];
        put(R->sb, none ? "" : ", ");
        pointer(R, ctype(x->dtype), x->buffer, x->offset);
        none = false;
    }
    return none;
}

/* The bases kernel k's live instructions load or store (an array the caller
 * frees) and its schedule; NULL (R's text failed) when out of memory. */
static bool *bases_of_call(render *R, const rfi_kir_kernel *k, schedule *sc)
{
    bool *base_used = rfi_calloc((size_t)(k->n_bases > 0 ? k->n_bases : 1), sizeof(bool));
    bool *live = rfi_calloc((size_t)(k->n_ins > 0 ? k->n_ins : 1), sizeof(bool));
    if (base_used && live) {
        rfi_kir_liveness(k, live);
        bases_used(k, live, true, base_used);
        *sc = choose_schedule(k, live);
    } else {
        rfi_free(base_used);
        base_used = NULL;
        R->sb->failed = true;
    }
    rfi_free(live);
    return base_used;
}

/* A direct convolution's block in the entry point when it runs its pool's
 * kernel itself: that kernel's ctx, `pool`, then the convolution's ctx and
 * call in the same block. */
static void call_pooled_conv(render *R, const rfi_kir_module *m, int i)
{
    const rfi_kir_step *st = &m->steps[i];
    const rfi_kir_kernel *k = m->steps[st->conv.pool_kernel].kernel;
    char kname[64];
    kernel_name(m->steps[R->function_of[st->conv.pool_kernel]].kernel, kname, sizeof kname);
    schedule sc;
    bool *base_used = bases_of_call(R, k, &sc);
    if (!base_used)
        return;
    R->sb->failed |= sc.form == SCHED_SPLIT; /* a LOOP kernel: no partials */
    put(R->sb, "    {\n");
    kernel_ctx(R, k, base_used, kname, "pool");
    put(R->sb, "};\n");
    rfi_render_conv_call(st, st->step, "pool", R->sb); /* shares no kernel */
    put(R->sb, "    }\n");
    rfi_free(base_used);
}

/* A kernel's block in the entry point: its ctx, then the kernel, through
 * parallel_for when large; a split reduction's partials live in the block. */
static void call_kernel(render *R, const rfi_kir_kernel *k, const rfi_kir_kernel *fn)
{
    char kname[64];
    kernel_name(fn, kname, sizeof kname);
    schedule sc;
    bool *base_used = bases_of_call(R, k, &sc);
    if (!base_used)
        return;
    put(R->sb, "    {\n");
    if (sc.form == SCHED_SPLIT)
        putf(R->sb, "        %s part[%lld];\n", ctype(k->acc_dtype),
                      (long long)(sc.chunks * k->n_folds * sc.kept));
    bool first = kernel_ctx(R, k, base_used, kname, "c");
    if (sc.form == SCHED_SPLIT)
        put(R->sb, first ? "part" : ", part");
    put(R->sb, "};\n");
    int64_t outer = k->rank ? k->dims[0] : 1;
    int64_t total = rfi_numel(k->dims, k->rank) * rfi_numel(k->red_dims, k->red_rank);
    if (sc.form == SCHED_SPLIT) {
        putf(R->sb, "        s->parallel_for(s->rt, %lld, 1, %s, &c);\n",
                      (long long)sc.chunks, kname);
        putf(R->sb, "        %s_combine(&c);\n", kname);
    } else if (total > PARALLEL_MIN && outer > 1) {
        int64_t per_row = total / outer > 0 ? total / outer : 1;
        int64_t grain = (PARALLEL_CHUNK + per_row - 1) / per_row;
        putf(R->sb, "        s->parallel_for(s->rt, %lld, %lld, %s, &c);\n",
                      (long long)outer, (long long)(grain > 0 ? grain : 1), kname);
    } else {
        putf(R->sb, "        %s(&c, 0, %lld);\n", kname, (long long)outer);
    }
    put(R->sb, "    }\n");
    rfi_free(base_used);
}

/* The module step whose kernel direct convolution step i calls: the first
 * one with the same loop. */
static int conv_kernel_of(const rfi_kir_module *m, int i)
{
    for (int j = 0; j < i; j++)
        if (m->steps[j].kind == RFI_KIR_STEP_CONV &&
            rfi_render_conv_same(&m->steps[j].conv, &m->steps[i].conv))
            return j;
    return i;
}

static void entry(render *R, const rfi_kir_module *m)
{
    putf(R->sb, "/* Runs the %d steps on the buffer table (%d buffers). */\n", m->n_steps,
                  m->n_buffers);
    put(R->sb, "RF_ENTRY\n");
    put(R->sb, "int rf_module_run_v1(const rf_module_services *s, void *const *bufs)\n{\n");
    put(R->sb, "    (void)s;\n    (void)bufs;\n");
    put(R->sb, "    void (*const mark)(void *, int) = s->mark;\n");
    for (int i = 0; i < m->n_steps; i++) {
        const rfi_kir_step *st = &m->steps[i];
        putf(R->sb, "    if (mark)\n        mark(s->prof, %d);\n", st->step);
        switch (st->kind) {
        case RFI_KIR_STEP_KERNEL:
            if (st->pooled_by < 0) /* else the convolution before it ran it */
                call_kernel(R, st->kernel, m->steps[R->function_of[i]].kernel);
            break;
        case RFI_KIR_STEP_CALL:
            comment(R, st->comment, 1);
            if (st->with_previous) /* services.c runs it beside the call before */
                putf(R->sb, "    /* (run with step %d's call) */\n", st->step - 1);
            else
                putf(R->sb, "    if (s->call(s->rt, %d, bufs))\n        return %d;\n",
                     st->step, st->step + 1);
            break;
        case RFI_KIR_STEP_CONV:
            if (st->conv.pool_kernel >= 0)
                call_pooled_conv(R, m, i);
            else
                rfi_render_conv_call(st, m->steps[conv_kernel_of(m, i)].step, NULL, R->sb);
            break;
        case RFI_KIR_STEP_COPY:
            comment(R, st->comment, 1);
            put(R->sb, "    memcpy(");
            pointer(R, "char", st->dst_buffer, st->dst_offset);
            put(R->sb, ", ");
            pointer(R, "char", st->src_buffer, st->src_offset);
            putf(R->sb, ", %zu);\n", st->nbytes);
            break;
        }
    }
    put(R->sb, "    if (mark)\n        mark(s->prof, -1);\n    return 0;\n}\n");
}

/* ---- Prelude -------------------------------------------------------------------------- */
static void prelude(rfi_strbuf *sb, const render *R)
{
    for (int f = 0; f < N_SIMD_FUNCS; f++)
        for (int d = 0; d < 2; d++) {
            if (!R->simd_used[f][d])
                continue;
            const char *t = d ? "double" : "float";
            bool two = strcmp(simd_funcs[f], "pow") == 0;
            putf(sb, "#pragma omp declare simd notinbranch\n%s %s%s(%s%s%s);\n", t,
                          simd_funcs[f], d ? "" : "f", t, two ? ", " : "", two ? t : "");
        }
    put(sb, "\n");
    unsigned need = R->need;
    if (need & (NEED_VECTORS | NEED_LANES16))
        put(sb, "/* a loop over the 16 lanes of a channel block, or over 16-float vectors:\n"
                " * gcc's tuning for AVX-512 machines prefers 256-bit vectors, which takes\n"
                " * two halves and a loop per block */\n"
                "#if defined(__GNUC__) && !defined(__clang__) && defined(__AVX512F__)\n"
                "#define RF_LANES16 __attribute__((target(\"prefer-vector-width=512\")))\n"
                "#else\n"
                "#define RF_LANES16\n"
                "#endif\n");
    if (need & NEED_VECTORS)
        put(sb, "/* GNU C vectors: one register (or two) of output channels */\n"
                "typedef float rf_f32x8 __attribute__((vector_size(32)));\n"
                "typedef float rf_f32x16 __attribute__((vector_size(64)));\n"
                "/* gcc's predictive commoning (on at -O2) keeps the input values one tap\n"
                " * shares with the next in registers, which spills the accumulators */\n"
                "#if defined(__GNUC__) && !defined(__clang__)\n"
                "#define RF_CONV_LOOP __attribute__((optimize(\"no-predictive-commoning\")))\n"
                "#else\n"
                "#define RF_CONV_LOOP\n"
                "#endif\n"
                "/* asks for the cache lines of n floats from p (a row a later output\n"
                " * row reads), so that they arrive while this row is computed */\n"
                "static inline void rf_prefetch_floats(const float *p, int64_t n)\n{\n"
                "#if defined(__GNUC__)\n"
                "    for (int64_t k = 0; k < n; k += 16)\n"
                "        __builtin_prefetch(p + k);\n"
                "    if (n > 0) /* the last line, when p is not at a line's start */\n"
                "        __builtin_prefetch(p + n - 1);\n"
                "#else\n"
                "    (void)p, (void)n;\n"
                "#endif\n"
                "}\n\n");
    if (need & NEED_SAT)
        putf(sb,
            "/* float -> integer: truncate toward zero, saturate, NaN -> 0 */\n"
            "static inline int32_t rf_f2i32(double v)\n{\n"
            "    return v != v ? 0 : v <= -2147483648.0 ? INT32_MIN\n"
            "         : v >= 2147483647.0 ? INT32_MAX : (int32_t)v;\n}\n\n"
            "static inline int64_t rf_f2i64(double v)\n{\n"
            "    return v != v ? 0 : v <= -9223372036854775808.0 ? INT64_MIN\n"
            "         : v >= 9223372036854775807.0 ? INT64_MAX : (int64_t)v;\n}\n\n"
            "static inline uint8_t rf_f2u8(double v)\n{\n"
            "    return v != v ? 0 : v <= 0.0 ? 0 : v >= 255.0 ? 255 : (uint8_t)(int32_t)v;\n}\n\n");
    if (need & NEED_DIV)
        putf(sb,
            "/* integer division: x / 0 = 0, INT_MIN / -1 wraps */\n"
            "static inline int64_t rf_div_i64(int64_t a, int64_t b)\n{\n"
            "    if (b == 0)\n        return 0;\n"
            "    if (b == -1)\n        return (int64_t)(0 - (uint64_t)a);\n"
            "    return a / b;\n}\n\n");
    if (need & NEED_REM)
        putf(sb,
            "/* integer remainder: x %% 0 = 0, x %% -1 = 0 */\n"
            "static inline int64_t rf_rem_i64(int64_t a, int64_t b)\n{\n"
            "    return (b == 0 || b == -1) ? 0 : a %% b;\n}\n\n");
    if (need & NEED_POW)
        putf(sb,
            "/* integer power by squaring (wrapping); negative exponents give 0 but for +-1 */\n"
            "static inline int64_t rf_pow_i64(int64_t a, int64_t b)\n{\n"
            "    if (b < 0)\n        return a == 1 ? 1 : a == -1 ? ((b & 1) ? -1 : 1) : 0;\n"
            "    uint64_t r = 1, x = (uint64_t)a;\n"
            "    while (b > 0) {\n        if (b & 1)\n            r *= x;\n"
            "        x *= x;\n        b >>= 1;\n    }\n"
            "    return (int64_t)r;\n}\n\n");
    for (int d = 0; d < 2; d++) {
        const char *t = d ? "double" : "float", *n = d ? "f64" : "f32";
        if (need & (d ? NEED_MAXMIN_F64 : NEED_MAXMIN_F32))
            putf(sb,
                "/* max/min propagating NaN (either operand's); written as two selects so\n"
                " * gcc vectorises them */\n"
                "static inline %s rf_max_%s(%s a, %s b)\n{\n"
                "    %s m = a > b ? a : b;\n    return a != a ? a : m;\n}\n\n"
                "static inline %s rf_min_%s(%s a, %s b)\n{\n"
                "    %s m = a < b ? a : b;\n    return a != a ? a : m;\n}\n\n",
                t, n, t, t, t, t, n, t, t, t);
        if (need & (d ? NEED_LOGISTIC_F64 : NEED_LOGISTIC_F32))
            putf(sb,
                "/* logistic, never exp of a large positive number */\n"
                "static inline %s rf_logistic_%s(%s x)\n{\n"
                "    %s e = exp%s(-fabs%s(x));\n"
                "    return (x >= 0 ? 1 : e) / (1 + e);\n}\n\n",
                t, n, t, t, d ? "" : "f", d ? "" : "f");
    }
}

/* ---- Parts ------------------------------------------------------------------------------ *
 * gcc takes about 5 ms per KB of this C at -O2 (2.9 s for a ResNet step's
 * 517 KB), in one process. A large module is therefore cut into parts that
 * the driver compiles in parallel and links (cc.c): each kernel's functions
 * and the entry point are compiled in one part (RF_IN_PART), the prelude, the
 * ctx structs and the kernels' declarations in all. Compiled as one file,
 * the same source is the whole module. Parts hold about the same share of
 * gcc's time (piece_cost: the bytes of a kernel's functions plus PIECE_COST
 * per kernel, in step order, the entry point last): by bytes alone, the
 * mlp's step put its 16 small kernels in one part (0.44-0.49 s of gcc) and
 * 3 large ones in the other (0.10-0.11 s); with the per-kernel cost its two
 * parts took 0.30-0.32 and 0.30 s, and its cold compile 397-404 against
 * 547-789 ms (3 alternating runs of `rf_bench --workload compile_mlp_cold`;
 * the cnn's and the ResNet's steps the same within the noise). gcc's time
 * per byte still varies from kernel to kernel, so there are more parts than
 * cores: the driver starts them all and the cores even out the differences.
 * Their count comes from the bytes of functions, one per PART_BYTES. Parts of
 * 20 KB rather than 40: the cnn's training step (104 KB of C) then compiles
 * in 4 parts in 320-345 ms instead of whole in 413-438 ms (3 runs each of
 * `rf_bench --workload cnn`); the ResNet's did not move (at most MAX_PARTS).
 * The count is rounded up, so a module of 20 to 40 KB of functions is two
 * parts, not one: the mlp's training step (two parts now) compiled cold in
 * 481-498 ms against 547-648 whole (4 interleaved pairs of
 * `rf_bench --workload compile_mlp_cold`).
 * In a module of parts the entry point calls kernels of other parts, which
 * it cannot inline: it is glue (a ctx per kernel, a call), compiled by gcc
 * without optimisation (RF_ENTRY). The ResNet step's entry point, 64 KB of
 * C in a part of its own, took 0.37 s of gcc's time at -O2, 0.34 at -O1 and
 * 0.13 at -O0, while its extra cost at run time is a few ns per kernel call. */
#define PART_BYTES (20 * 1024)
#define MAX_PARTS 8
#define PIECE_COST 2048

static const char parts_block[] =
    "#ifndef RF_PART /* compiled whole: every part, kernels static */\n"
    "#define RF_KERNEL static\n"
    "#define RF_IN_PART(p) 1\n"
    "#else /* one part of several, compiled apart and linked into one module */\n"
    "#define RF_KERNEL __attribute__((visibility(\"hidden\")))\n"
    "#define RF_IN_PART(p) ((p) == RF_PART)\n"
    "#endif\n"
    "#if defined(RF_PART) && defined(__GNUC__) && !defined(__clang__)\n"
    "#define RF_ENTRY __attribute__((visibility(\"default\"), optimize(\"O0\")))\n"
    "#else\n"
    "#define RF_ENTRY __attribute__((visibility(\"default\")))\n"
    "#endif\n\n";

/* The pieces into out (kernels in step order, then the entry point): each
 * one's declarations, then its functions, inside its part's guard when the
 * module has several parts. */
/* A piece's share of gcc's time, in bytes: its functions' bytes plus
 * PIECE_COST for the passes every function goes through, however small. */
static size_t piece_cost(const rfi_strbuf *def) { return def->len ? def->len + PIECE_COST : 0; }

static void put_pieces(rfi_strbuf *out, const rfi_strbuf *decl, const rfi_strbuf *def,
                       int n, int parts)
{
    size_t total = 0, done = 0;
    for (int i = 0; i < n; i++)
        total += piece_cost(&def[i]);
    for (int i = 0; i < n; i++) {
        if (decl[i].len == 0 && def[i].len == 0)
            continue; /* a step that is no kernel */
        if (decl[i].data)
            put_n(out, decl[i].data, decl[i].len);
        if (def[i].len == 0)
            continue; /* a kernel that calls another's functions */
        if (parts > 1) { /* the part the middle of its cost falls in */
            size_t part = (done + piece_cost(&def[i]) / 2) * (size_t)parts / (total ? total : 1);
            if (part >= (size_t)parts)
                part = (size_t)parts - 1;
            putf(out, "#if RF_IN_PART(%d)\n\n", (int)part);
        }
        if (def[i].data)
            put_n(out, def[i].data, def[i].len);
        if (parts > 1)
            put(out, "#endif\n\n");
        done += piece_cost(&def[i]);
    }
}

rf_status rfi_render_c(const rfi_kir_module *m, char **source)
{
    *source = NULL;
    rfi_strbuf out = {0};
    render R;
    memset(&R, 0, sizeof R);
    int n = m->n_steps + 1; /* pieces: one per step (most empty), then the entry point */
    rfi_strbuf *decl = rfi_calloc((size_t)n, sizeof *decl);
    rfi_strbuf *def = rfi_calloc((size_t)n, sizeof *def);
    kernel_text *texts = rfi_calloc((size_t)n, sizeof *texts);
    int *function_of = rfi_calloc((size_t)n, sizeof *function_of);
    R.function_of = function_of;
    R.share = shares_functions(m);
    rf_status st = decl && def && texts && function_of
                       ? RF_OK : rfi_error(RF_E_NOMEM, "render_c: out of memory");
    for (int i = 0; i < m->n_steps && st == RF_OK; i++)
        if (m->steps[i].kind == RFI_KIR_STEP_KERNEL) {
            R.sb = &decl[i];
            R.def = &def[i];
            st = kernel_piece(&R, m, texts, function_of, i);
        }
    for (int i = 0; i < m->n_steps && st == RF_OK; i++) /* after: they may call kernels */
        if (m->steps[i].kind == RFI_KIR_STEP_CONV && conv_kernel_of(m, i) == i) {
            char pool_name[64] = "";
            int pk = m->steps[i].conv.pool_kernel;
            if (pk >= 0)
                kernel_name(m->steps[function_of[pk]].kernel, pool_name, sizeof pool_name);
            rfi_render_conv_kernel(&m->steps[i], pool_name, &decl[i], &def[i]);
            R.need |= NEED_VECTORS | NEED_MAXMIN_F32;
        }
    size_t total = 0, body = 0;
    bool failed = false;
    if (st == RF_OK) {
        R.sb = &def[n - 1];
        entry(&R, m);
        for (int i = 0; i < n; i++) {
            total += def[i].len;
            body += def[i].len + decl[i].len;
            failed |= def[i].failed || decl[i].failed;
        }
    }
    int parts = (int)((total + PART_BYTES - 1) / PART_BYTES);
    parts = parts < 1 ? 1 : parts > MAX_PARTS ? MAX_PARTS : parts;
    if (st == RF_OK && !failed && rfi_sb_reserve(&out, body + sizeof abi_block + 8192)) {
        putf(&out, "/* Generated by reflux: %d steps. Compile with -O2 -std=c11 -fPIC "
                            "-shared -fopenmp-simd -fno-math-errno -fno-trapping-math "
                            "-funswitch-loops -ffp-contract=fast, link with -lm. */\n",
                      m->n_steps);
        put_n(&out, abi_block, sizeof abi_block - 1);
        put(&out, "#include <float.h>\n#include <math.h>\n#include <string.h>\n\n");
        if (parts > 1)
            putf(&out, "#define RF_PARTS %d /* compile with -DRF_PART=0..%d and link */\n",
                          parts, parts - 1);
        put_n(&out, parts_block, sizeof parts_block - 1);
        prelude(&out, &R);
        put_pieces(&out, decl, def, n, parts);
    }
    failed |= out.failed;
    for (int i = 0; i < n; i++) {
        if (decl)
            rfi_sb_free(&decl[i]);
        if (def)
            rfi_sb_free(&def[i]);
        if (texts)
            rfi_sb_free(&texts[i].text);
    }
    rfi_free(decl);
    rfi_free(def);
    rfi_free(texts);
    rfi_free(function_of);
    if (st != RF_OK || failed) {
        rfi_sb_free(&out);
        return st != RF_OK ? st : rfi_error(RF_E_NOMEM, "render_c: out of memory");
    }
    *source = out.data;
    return RF_OK;
}
