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
 * REDUCE kernels get one of three loop schedules from render_reduce.c,
 * chosen from the memory strides of their loads: plain (kept loops outside);
 * interchanged (the kept axis innermost over a block of accumulators: bias
 * gradients, pooling windows too large to unroll); split (the outermost
 * reduced loop cut into a fixed number of chunks folded in parallel into
 * partial accumulators that live on the entry point's stack, then combined
 * in chunk order by a second function, k<step>_<name>_combine: BatchNorm
 * statistics, sums to a scalar). Each point's values are folded in the same
 * order in all of them.
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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kir.h"
#include "module_abi.h"
#include "render_c.h"
#include "render_conv.h"
#include "services.h" /* rfi_bf16_kernels_allowed */

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
    "    /* When profiling or checking (NULL otherwise): called with each plan\n"
    "     * step's index just before the step runs, and with -1 when the program is\n"
    "     * done. */\n"
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

/* libm functions with vector variants in libmvec, declared `omp declare simd`. */
static const char *const simd_funcs[] = {"expm1", "log", "log1p", "tanh", "sin", "cos",
                                         "pow"};
#define N_SIMD_FUNCS ((int)(sizeof simd_funcs / sizeof simd_funcs[0]))
_Static_assert(N_SIMD_FUNCS == RFI_RENDER_SIMD_FUNCS, "render_c.h counts simd_funcs");

const char *rfi_render_ctype(rf_dtype dt)
{
    switch (dt) {
    case RF_F32: return "float";
    case RF_F64: return "double";
    case RF_I32: return "int32_t";
    case RF_I64: return "int64_t";
    default: return "uint8_t";
    }
}

static void use_math(rfi_render *R, const char *func, rf_dtype dt)
{
    for (int f = 0; f < N_SIMD_FUNCS; f++)
        if (strcmp(simd_funcs[f], func) == 0)
            R->simd_used[f][dt == RF_F64] = true;
}

/* ---- Literals ------------------------------------------------------------------------ */
/* The shortest %g form that reads back as v, as a C literal of dt. */
void rfi_render_float_literal(rfi_strbuf *sb, double v, rf_dtype dt)
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

void rfi_render_int_literal(rfi_strbuf *sb, int64_t v, rf_dtype dt)
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
void rfi_render_fold_name(char name[32], const char *prefix, int j)
{
    if (j == 0)
        snprintf(name, 32, "%s", prefix);
    else
        make_name(name, prefix, j, false, 0);
}

/* Fold j's accumulator: acc, acc1, acc2, ... */
void rfi_render_acc_name(char name[32], int j) { rfi_render_fold_name(name, "acc", j); }

/* Names the values and bases: from their IR nodes, or in neutral form
 * (shared functions, below) by their order among the live values and the
 * bases used. */
static void name_values(rfi_render *R, const bool *live, const bool *base_used)
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
            rfi_render_acc_name(name, (int)x->i);
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
void rfi_render_operand(rfi_render *R, int id)
{
    const rfi_kir_ins *x = &R->k->ins[id];
    if (x->op != RFI_KIR_CONST)
        put(R->sb, R->names[id]);
    else if (rfi_dtype_is_float(x->dtype))
        rfi_render_float_literal(R->sb, x->f, x->dtype);
    else
        rfi_render_int_literal(R->sb, x->i, x->dtype);
}

/* ---- Expressions ------------------------------------------------------------------ *
 * A tiny format language: %a %b %c are operands, %T the result's C type, %f the
 * float suffix of operand a's type ("f" for f32), %% a percent sign. */
static void emit_fmt(rfi_render *R, const rfi_kir_ins *x, const char *fmt)
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
        case 'a': rfi_render_operand(R, x->a); break;
        case 'b': rfi_render_operand(R, x->b); break;
        case 'c': rfi_render_operand(R, x->c); break;
        case 'T': put(R->sb, rfi_render_ctype(x->dtype)); break;
        case 'f': put(R->sb, at == RF_F32 ? "f" : ""); break;
        default: put_char(R->sb, *c); break;
        }
    }
}

/* The integer value `expr` (computed in uint64) wrapped into dt (bool: != 0). */
static void narrow(rfi_render *R, const rfi_kir_ins *x, rf_dtype dt, const char *expr)
{
    const char *open = dt == RF_I32 ? "(int32_t)(uint32_t)(" : dt == RF_I64 ? "(int64_t)("
                       : dt == RF_U8 ? "(uint8_t)(" : "(uint8_t)((";
    put(R->sb, open);
    emit_fmt(R, x, expr);
    put(R->sb, dt == RF_BOOL ? ") != 0)" : ")");
}

/* a one-argument libm function of a float dtype (simd_funcs) */
static void emit_math(rfi_render *R, const rfi_kir_ins *x, const char *func)
{
    rf_dtype at = R->k->ins[x->a].dtype;
    use_math(R, func, at);
    putf(R->sb, "%s%s(", func, at == RF_F32 ? "f" : "");
    rfi_render_operand(R, x->a);
    put(R->sb, ")");
}

static void unary_float(rfi_render *R, const rfi_kir_ins *x)
{
    rf_dtype at = R->k->ins[x->a].dtype;
    switch (x->ir_op) {
    case RFI_OP_NEG: emit_fmt(R, x, "-%a"); return;
    case RFI_OP_ABS: emit_fmt(R, x, "fabs%f(%a)"); return;
    case RFI_OP_SIGN: /* -0 gives +0, NaN stays */
        emit_fmt(R, x, "(%a > 0 ? (%T)1 : %a < 0 ? (%T)-1 : %a == %a ? (%T)0 : %a)");
        return;
    case RFI_OP_EXP: /* not libmvec's: a cliff where results overflow or underflow */
        R->need |= at == RF_F32 ? RFI_NEED_EXP_F32 : RFI_NEED_EXP_F64;
        emit_fmt(R, x, at == RF_F32 ? "rf_exp_f32(%a)" : "rf_exp_f64(%a)");
        return;
    case RFI_OP_EXPM1:
        use_math(R, "expm1", at);
        R->need |= at == RF_F32 ? RFI_NEED_EXPM1_F32 : RFI_NEED_EXPM1_F64;
        emit_fmt(R, x, at == RF_F32 ? "rf_expm1_f32(%a)" : "rf_expm1_f64(%a)");
        return;
    case RFI_OP_LOG: /* glibc's vector logf is up to 4 ulp off: in double, rounded once */
        if (at == RF_F32) {
            use_math(R, "log", RF_F64);
            emit_fmt(R, x, "(float)log((double)%a)");
        } else {
            emit_math(R, x, "log");
        }
        return;
    case RFI_OP_LOG1P: emit_math(R, x, "log1p"); return;
    case RFI_OP_SQRT: emit_fmt(R, x, "sqrt%f(%a)"); return;
    case RFI_OP_RSQRT: /* in double, rounded once: the interpreter's value exactly */
        emit_fmt(R, x, at == RF_F32 ? "(float)(1.0 / sqrt((double)%a))" : "1.0 / sqrt(%a)");
        return;
    case RFI_OP_TANH: emit_math(R, x, "tanh"); return;
    case RFI_OP_LOGISTIC:
        R->need |= at == RF_F32 ? RFI_NEED_LOGISTIC_F32 : RFI_NEED_LOGISTIC_F64;
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

static void unary_int(rfi_render *R, const rfi_kir_ins *x)
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

static void binary_float(rfi_render *R, const rfi_kir_ins *x)
{
    bool f32 = x->dtype == RF_F32;
    switch (x->ir_op) {
    case RFI_OP_ADD: emit_fmt(R, x, "%a + %b"); return;
    case RFI_OP_SUB: emit_fmt(R, x, "%a - %b"); return;
    case RFI_OP_MUL: emit_fmt(R, x, "%a * %b"); return;
    case RFI_OP_DIV: emit_fmt(R, x, "%a / %b"); return;
    case RFI_OP_POW:
        use_math(R, "pow", x->dtype);
        R->need |= f32 ? RFI_NEED_POW_F32 : RFI_NEED_POW_F64;
        emit_fmt(R, x, f32 ? "rf_pow_f32(%a, %b)" : "rf_pow_f64(%a, %b)");
        return;
    case RFI_OP_MAX:
    case RFI_OP_MIN:
        R->need |= f32 ? RFI_NEED_MAXMIN_F32 : RFI_NEED_MAXMIN_F64;
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

static void binary_int(rfi_render *R, const rfi_kir_ins *x)
{
    switch (x->ir_op) {
    case RFI_OP_ADD: narrow(R, x, x->dtype, "(uint64_t)%a + (uint64_t)%b"); return;
    case RFI_OP_SUB: narrow(R, x, x->dtype, "(uint64_t)%a - (uint64_t)%b"); return;
    case RFI_OP_MUL: narrow(R, x, x->dtype, "(uint64_t)%a * (uint64_t)%b"); return;
    case RFI_OP_DIV:
        R->need |= RFI_NEED_DIV;
        narrow(R, x, x->dtype, "(uint64_t)rf_div_i64(%a, %b)");
        return;
    case RFI_OP_REM:
        R->need |= RFI_NEED_REM;
        narrow(R, x, x->dtype, "(uint64_t)rf_rem_i64(%a, %b)");
        return;
    case RFI_OP_POW:
        R->need |= RFI_NEED_POW;
        narrow(R, x, x->dtype, "(uint64_t)rf_pow_i64(%a, %b)");
        return;
    case RFI_OP_MAX: emit_fmt(R, x, "(%a > %b ? %a : %b)"); return;
    case RFI_OP_MIN: emit_fmt(R, x, "(%a < %b ? %a : %b)"); return;
    case RFI_OP_AND: emit_fmt(R, x, "(%T)(%a & %b)"); return;
    case RFI_OP_OR: emit_fmt(R, x, "(%T)(%a | %b)"); return;
    default: emit_fmt(R, x, "%a"); return;
    }
}

/* A float converted to an integer and back: gcc folds the pair into a truncation,
 * which gives -0 on (-1, -0] where the integer 0 gives +0; so the pair is written as
 * the saturated truncation in double, plus 0 (which gcc cannot drop from a value that
 * may be -0). Equal to the pair's value: every saturated truncation is an integer the
 * integer type holds, converted exactly or rounded alike. */
static int int_bits(rf_dtype dt)
{
    return dt == RF_U8 ? 8 : dt == RF_I32 ? 32 : dt == RF_I64 ? 64 : 0;
}

/* Integer conversions that keep every value (u8 -> i32, i32 -> i64, ...) may stand
 * between the two: the integer is still the saturated truncation. */
static bool float_int_float(rfi_render *R, const rfi_kir_ins *x)
{
    const rfi_kir_ins *i = &R->k->ins[x->a];
    while (i->op == RFI_KIR_CONVERT && int_bits(i->dtype) > 0 &&
           int_bits(R->k->ins[i->a].dtype) > 0 &&
           int_bits(R->k->ins[i->a].dtype) < int_bits(i->dtype))
        i = &R->k->ins[i->a];
    if (i->op != RFI_KIR_CONVERT || !rfi_dtype_is_float(R->k->ins[i->a].dtype) ||
        int_bits(i->dtype) == 0)
        return false;
    R->need |= RFI_NEED_SAT;
    putf(R->sb, "((%s)rf_ftrunc_%s((double)", rfi_render_ctype(x->dtype),
         i->dtype == RF_I32 ? "i32" : i->dtype == RF_I64 ? "i64" : "u8");
    rfi_render_operand(R, i->a);
    put(R->sb, ") + 0)");
    return true;
}

static void convert(rfi_render *R, const rfi_kir_ins *x)
{
    rf_dtype from = R->k->ins[x->a].dtype, to = x->dtype;
    if (to == RF_BOOL) {
        emit_fmt(R, x, "(uint8_t)(%a != 0)");
    } else if (rfi_dtype_is_float(to) || !rfi_dtype_is_float(from)) {
        if (rfi_dtype_is_float(to) && !rfi_dtype_is_float(from) && float_int_float(R, x))
            return;
        if (rfi_dtype_is_float(to))
            emit_fmt(R, x, "(%T)%a");
        else
            narrow(R, x, to, "(uint64_t)%a");
    } else { /* float -> integer: truncate, saturate, NaN -> 0 */
        R->need |= RFI_NEED_SAT;
        emit_fmt(R, x, to == RF_I32   ? "rf_f2i32(%a)"
                       : to == RF_I64 ? "rf_f2i64(%a)"
                                      : "rf_f2u8(%a)");
    }
}

static const char *const c_cmp[] = {"==", "!=", "<", "<=", ">", ">="};

static void expression(rfi_render *R, const rfi_kir_ins *x)
{
    bool is_float_a = x->a >= 0 && rfi_dtype_is_float(R->k->ins[x->a].dtype);
    switch (x->op) {
    case RFI_KIR_IADD:
        if (R->k->ins[x->b].op == RFI_KIR_CONST && R->k->ins[x->b].i < 0 &&
            R->k->ins[x->b].i > INT32_MIN) {
            rfi_render_operand(R, x->a);
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
        rfi_render_operand(R, x->a);
        put_char(R->sb, ' ');
        put(R->sb, c_cmp[x->cmp]);
        put_char(R->sb, ' ');
        rfi_render_operand(R, x->b);
        return;
    case RFI_KIR_LAND: emit_fmt(R, x, "%a && %b"); return;
    case RFI_KIR_LOAD:
        if (x->dtype == RF_BOOL)
            put(R->sb, "(uint8_t)(");
        put(R->sb, R->base_names[x->base]);
        put_char(R->sb, '[');
        rfi_render_operand(R, x->a);
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
        rfi_render_operand(R, x->a);
        put_char(R->sb, ' ');
        put(R->sb, c_cmp[x->cmp]);
        put_char(R->sb, ' ');
        rfi_render_operand(R, x->b);
        put(R->sb, ")");
        return;
    case RFI_KIR_SELECT: emit_fmt(R, x, "%a ? %b : %c"); return;
    case RFI_KIR_CONVERT: convert(R, x); return;
    case RFI_KIR_ROUND_BF16:
        R->need |= RFI_NEED_BF16;
        emit_fmt(R, x, "rf_round_bf16(%a)");
        return;
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

void rfi_render_indent(rfi_render *R, int depth) { indent_to(R->sb, depth); }

/* The C type a statement's value is held in: its dtype's, but an int for
 * bool and u8 values (0/1 and 0..255: every expression making one narrows
 * it). gcc 12 vectorises no loop that converts a uint8_t temporary to float:
 * a cross-entropy over class ids, whose one-hot is (float)(id == class),
 * ran its gradient loop over [256,10000] scalar, 5.9 ms against 1.2 with
 * one-hot labels. */
static const char *value_ctype(const rfi_kir_ins *x)
{
    bool pred = x->op == RFI_KIR_ICMP || x->op == RFI_KIR_LAND;
    return pred || x->dtype == RF_BOOL || x->dtype == RF_U8 ? "int" : rfi_render_ctype(x->dtype);
}

/* The live statements of one loop level; with `only`, just those whose only[id]
 * equals `want`. */
void rfi_render_statements_where(rfi_render *R, const bool *live, int level, int depth,
                                 const bool *only, bool want)
{
    const rfi_kir_kernel *k = R->k;
    for (int id = 0; id < k->n_ins; id++) {
        const rfi_kir_ins *x = &k->ins[id];
        if (!live[id] || x->level != level || x->op == RFI_KIR_VAR || x->op == RFI_KIR_CONST ||
            x->op == RFI_KIR_ACC || (only && only[id] != want))
            continue;
        rfi_render_indent(R, depth);
        put(R->sb, "const ");
        put(R->sb, value_ctype(x));
        put_char(R->sb, ' ');
        put(R->sb, R->names[id]);
        put(R->sb, " = ");
        expression(R, x);
        put(R->sb, ";\n");
    }
}

void rfi_render_statements(rfi_render *R, const bool *live, int level, int depth)
{
    rfi_render_statements_where(R, live, level, depth, NULL, false);
}

void rfi_render_stores(rfi_render *R, int depth)
{
    const rfi_kir_kernel *k = R->k;
    for (int s = 0; s < k->n_stores; s++) {
        rfi_render_indent(R, depth);
        put(R->sb, R->base_names[k->stores[s].base]);
        put_char(R->sb, '[');
        rfi_render_operand(R, k->stores[s].index);
        put(R->sb, "] = ");
        rfi_render_operand(R, k->stores[s].value);
        put(R->sb, ";\n");
    }
}

/* The text of an operand (a name or a literal) in buf. */
void rfi_render_operand_text(rfi_render *R, int id, char *buf, size_t n)
{
    rfi_strbuf tmp = {0}, *out = R->sb;
    R->sb = &tmp;
    rfi_render_operand(R, id);
    R->sb = out;
    snprintf(buf, n, "%s", tmp.data && !tmp.failed ? tmp.data : "0");
    out->failed |= tmp.failed;
    rfi_sb_free(&tmp);
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

static void comment(rfi_render *R, const char *text, int depth)
{
    rfi_render_c_comment(R->sb, text, depth);
}

static void kernel_name(const rfi_kir_kernel *k, char *buf, size_t n)
{
    snprintf(buf, n, "k%d_%s", k->step, k->name);
}

/* The name of the functions R renders for R->k ("K" in neutral form). */
static void rendered_name(const rfi_render *R, char *buf, size_t n)
{
    if (R->neutral)
        snprintf(buf, n, "K");
    else
        kernel_name(R->k, buf, n);
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
static void parameters(rfi_render *R, const rfi_kir_kernel *k)
{
    int t = tile_base(k);
    putf(R->sb, "(void *ctx, int64_t lo, int64_t hi%s%s%s)", t >= 0 ? ", const " : "",
         t >= 0 ? rfi_render_ctype(k->bases[t].dtype) : "", t >= 0 ? " *tile" : "");
}

static void ctx_struct(rfi_render *R, const bool *base_used, const char *kname,
                       const rfi_schedule *sc)
{
    const rfi_kir_kernel *k = R->k;
    putf(R->sb, "struct %s_ctx {\n", kname);
    for (int b = 0; b < k->n_bases; b++)
        if (base_used[b] && !in_tile(k, b))
            putf(R->sb, "    %s%s *%s%s;\n", k->bases[b].written ? "" : "const ",
                 rfi_render_ctype(k->bases[b].dtype), k->bases[b].noalias ? "restrict " : "",
                 R->base_names[b]);
    if (sc->form == RFI_SCHED_SPLIT)
        putf(R->sb,
             "    %s *restrict part; /* [%lld chunks][%d folds][%lld points] partial folds */\n",
             rfi_render_ctype(k->acc_dtype), (long long)sc->chunks, k->n_folds,
             (long long)sc->kept);
    put(R->sb, "};\n\n");
}

/* The local copies of the bases a function uses. */
void rfi_render_declare_bases(rfi_render *R, const bool *used)
{
    const rfi_kir_kernel *k = R->k;
    for (int b = 0; b < k->n_bases; b++) {
        if (!used[b])
            continue;
        const rfi_kir_base *x = &k->bases[b];
        putf(R->sb, "    %s%s *%s%s = ", x->written ? "" : "const ", rfi_render_ctype(x->dtype),
             x->noalias ? "restrict " : "", R->base_names[b]);
        if (!in_tile(k, b))
            putf(R->sb, "c->%s;\n", R->base_names[b]);
        else
            putf(R->sb, "tile + %zu;\n", x->offset / rf_dtype_size(x->dtype));
    }
}

/* used[b]: base b is loaded by a live instruction (or, with `stored`, stored to). */
void rfi_render_bases_used(const rfi_kir_kernel *k, const bool *live, bool stored, bool *used)
{
    memset(used, 0, (size_t)(k->n_bases > 0 ? k->n_bases : 1) * sizeof *used);
    for (int id = 0; id < k->n_ins; id++)
        if (live[id] && k->ins[id].op == RFI_KIR_LOAD)
            used[k->ins[id].base] = true;
    for (int s = 0; stored && s < k->n_stores; s++)
        used[k->stores[s].base] = true;
}

void rfi_render_open_outer_loops(rfi_render *R, int n, bool simd)
{
    const rfi_kir_kernel *k = R->k;
    for (int d = 0; d < n; d++) {
        if (simd && d == n - 1) {
            rfi_render_indent(R, 1 + d);
            put(R->sb, "#pragma omp simd\n");
        }
        rfi_render_indent(R, 1 + d);
        if (d == 0)
            put(R->sb, "for (int64_t i0 = lo; i0 < hi; i0++) {\n");
        else
            putf(R->sb, "for (int64_t i%d = 0; i%d < %lld; i%d++) {\n", d, d,
                 (long long)k->dims[d], d);
    }
}

void rfi_render_close_loops(rfi_render *R, int depth, int n)
{
    for (int d = n - 1; d >= 0; d--) {
        rfi_render_indent(R, depth + d);
        put(R->sb, "}\n");
    }
}

/* Whether kernel k computes transcendental math (rfi_op_calls_math: a libm
 * function's vector variant, or the renderer's own exp and logistic), whose
 * cost grows with the lanes' count, not with the data: libmvec's tanhf took
 * 1.29 us per 4096 floats at 512 bits on the Intel machine with AVX-512,
 * 2.73 at 256. */
static bool calls_vector_math(const rfi_kir_kernel *k)
{
    for (int i = 0; i < k->n_ins; i++)
        if ((k->ins[i].op == RFI_KIR_UNARY || k->ins[i].op == RFI_KIR_BINARY) &&
            rfi_op_calls_math(k->ins[i].ir_op))
            return true;
    return false;
}

/* Whether k runs 512-bit vectors (RF_LANES16): an elementwise kernel whose
 * innermost loop is the 16 lanes of a channel block or that computes vector
 * math (calls_vector_math), or a reduction folding rows of at least
 * MIN_WIDE_FOLD points (a batch-1 matrix-vector product read its 0.8 MB of
 * weights per thread from L2 16% faster: docs/ARCHITECTURE.md). */
#define MIN_WIDE_FOLD 64
static bool lanes16(const rfi_kir_kernel *k)
{
    if (k->red_rank > 0)
        return k->red_dims[k->red_rank - 1] >= MIN_WIDE_FOLD;
    return (k->rank >= 1 && k->dims[k->rank - 1] == 16) || calls_vector_math(k);
}

void rfi_render_function_head(rfi_render *R, const char *kname)
{
    bool wide = lanes16(R->k);
    R->need |= wide ? RFI_NEED_LANES16 : 0;
    putf(R->sb, "RF_KERNEL%s void %s", wide ? " RF_LANES16" : "", kname);
    parameters(R, R->k);
    putf(R->sb, "\n{\n    const struct %s_ctx *c = ctx;\n", kname);
}

/* An elementwise kernel's loops with what does not vary along the innermost
 * one computed before it. gcc hoists most such loads itself, but a load that
 * only one arm of a select reads it sinks into that arm, and a conditional
 * load at a fixed address keeps the loop scalar: a GroupNorm's relu gradient,
 * select(y > 0, g, 0) with g one value per group, took 1.4 ms over
 * [32,64,16,16]. */
static bool hoisted_body(rfi_render *R, const bool *live)
{
    const rfi_kir_kernel *k = R->k;
    int n = k->rank - 1;
    if (k->is_reduce || k->rank < 2)
        return false;
    bool *inner = rfi_calloc((size_t)k->n_ins, sizeof *inner);
    if (!inner) {
        R->sb->failed = true;
        return true;
    }
    rfi_render_output_dependent(k, n, inner);
    rfi_render_open_outer_loops(R, n, false);
    rfi_render_statements_where(R, live, 1, 1 + n, inner, false);
    if (!k->no_simd) {
        rfi_render_indent(R, 1 + n);
        put(R->sb, "#pragma omp simd\n");
    }
    rfi_render_indent(R, 1 + n);
    putf(R->sb, "for (int64_t i%d = 0; i%d < %lld; i%d++) {\n", n, n, (long long)k->dims[n], n);
    rfi_render_statements_where(R, live, 1, 2 + n, inner, true);
    rfi_render_stores(R, 2 + n);
    rfi_render_close_loops(R, 1, k->rank);
    rfi_free(inner);
    return true;
}

static void plain_body(rfi_render *R, const bool *live)
{
    const rfi_kir_kernel *k = R->k;
    if (hoisted_body(R, live))
        return;
    if (k->rank == 0)
        put(R->sb, "    (void)lo;\n    (void)hi;\n");
    rfi_render_open_outer_loops(R, k->rank, !k->is_reduce && !k->no_simd);
    int depth = 1 + k->rank;
    rfi_render_statements(R, live, 1, depth);
    if (k->is_reduce)
        rfi_render_reduction_loops(R, live, depth);
    rfi_render_stores(R, depth);
    rfi_render_close_loops(R, 1, k->rank);
}

/* ---- Transposed and gathered reads ----------------------------------------------------
 * An elementwise kernel that reads a value transposed (a load contiguous along
 * its second innermost loop and a row or more apart along the innermost one)
 * walks one cache line per point, plain, down a whole column, and gcc
 * vectorises none of it (its tuning turns gathers off): exp of a transposed
 * [2048,2048] took 33 ms (f64: 52), a transposed copy 9.9 ms (f64: 18.9).
 * Blocked, a tile of TRANSPOSED_LINES points of the innermost loop by two
 * cache lines of points of the next reads its few lines for all their points,
 * and the arithmetic runs vectorised from a copy of the tile on the stack: 2.7-
 * 3.4 ms (f64: 12), and 2.8 (f64: 9.7) for the copy, on two AVX-512 cores
 * (PyTorch: 6.0 and 5.3 ms; f64 27.8 and 28). A loop with any load gcc would
 * gather (rfi_render_gathered_load) and a math function runs in the same
 * tiles, so the math vectorises. The points are independent (no load reads a
 * buffer the kernel stores to), so their order changes no value. */
#define TRANSPOSED_LINES 8
#define TRANSPOSED_ROW_BYTES 128 /* points of the second innermost loop: two lines */
#define TRANSPOSED_MIN_STRIDE 16

/* Whether live load x reads transposed: contiguous along the kernel's second
 * innermost loop, far apart along the innermost. */
static bool transposed_load(const rfi_kir_kernel *k, const rfi_kir_ins *x)
{
    int n = k->rank - 1;
    int64_t cn, cd;
    return x->op == RFI_KIR_LOAD && rfi_kir_var_coef(k, x->a, n, &cn) &&
           rfi_kir_var_coef(k, x->a, n - 1, &cd) && cd == 1 &&
           (cn < 0 ? -cn : cn) >= TRANSPOSED_MIN_STRIDE;
}

bool rfi_render_gathered_load(const rfi_kir_kernel *k, const rfi_kir_ins *x)
{
    int64_t cn;
    return x->op == RFI_KIR_LOAD &&
           (!rfi_kir_var_coef(k, x->a, k->rank - 1, &cn) || (cn < 0 ? -cn : cn) >= 2);
}

/* A kernel that reads a value transposed, or gathers one and calls a math
 * function per point (which then runs scalar with the loop: tanh of a
 * nearest-upsampled [8,64,32,32] took 18.7 ms), runs in tiles. */
static bool reads_gathered(const rfi_kir_kernel *k, const bool *live)
{
    if (k->is_reduce || k->no_simd || k->rank < 2 || k->dims[k->rank - 1] < 2 * TRANSPOSED_LINES)
        return false;
    bool transposed = false, gathered = false;
    for (int id = 0; id < k->n_ins; id++) {
        const rfi_kir_ins *x = &k->ins[id];
        if (!live[id] || x->op != RFI_KIR_LOAD)
            continue;
        const rfi_kir_base *b = &k->bases[x->base];
        if (b->buffer == RFI_KIR_TILE_BUFFER)
            return false;
        for (int s = 0; s < k->n_stores; s++)
            if (k->bases[k->stores[s].base].buffer == b->buffer)
                return false;
        transposed = transposed || transposed_load(k, x);
        gathered = gathered || rfi_render_gathered_load(k, x);
    }
    return transposed || (gathered && rfi_render_calls_math(k, live));
}

void rfi_render_mark_operands(const rfi_kir_kernel *k, int id, const bool *stop, bool *out)
{
    if (id < 0 || out[id])
        return;
    out[id] = true;
    const rfi_kir_ins *x = &k->ins[id];
    if (stop && stop[id])
        return;
    rfi_render_mark_operands(k, x->a, stop, out);
    rfi_render_mark_operands(k, x->b, stop, out);
    rfi_render_mark_operands(k, x->c, stop, out);
}

bool rfi_render_wide_vectors(void)
{
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
    return __builtin_cpu_supports("avx512f");
#else
    return false;
#endif
}

bool rfi_render_calls_math(const rfi_kir_kernel *k, const bool *live)
{
    for (int id = 0; id < k->n_ins; id++) {
        const rfi_kir_ins *x = &k->ins[id];
        if (live[id] && (x->op == RFI_KIR_UNARY || x->op == RFI_KIR_BINARY) &&
            rfi_op_calls_math(x->ir_op))
            return true;
    }
    return false;
}

void rfi_render_copy_arrays(rfi_render *R, const bool *copied, const char *shape, int depth)
{
    const rfi_kir_kernel *k = R->k;
    for (int id = 0; id < k->n_ins; id++) {
        if (!copied[id])
            continue;
        rfi_render_indent(R, depth);
        putf(R->sb, "%s tr_%s%s;\n", value_ctype(&k->ins[id]), R->names[id], shape);
    }
}

void rfi_render_copy_fill(rfi_render *R, const bool *copied, const char *at, int depth)
{
    const rfi_kir_kernel *k = R->k;
    for (int id = 0; id < k->n_ins; id++) {
        if (!copied[id])
            continue;
        rfi_render_indent(R, depth);
        putf(R->sb, "tr_%s%s = ", R->names[id], at);
        expression(R, &k->ins[id]);
        put(R->sb, ";\n");
    }
}

void rfi_render_copy_read(rfi_render *R, const bool *copied, const char *at, int depth)
{
    const rfi_kir_kernel *k = R->k;
    for (int id = 0; id < k->n_ins; id++) {
        if (!copied[id])
            continue;
        rfi_render_indent(R, depth);
        putf(R->sb, "const %s %s = tr_%s%s;\n", value_ctype(&k->ins[id]), R->names[id],
             R->names[id], at);
    }
}

/* One tile at depth (i<d> over tb<d>..te<d>, i<n> over tb<n>..end): the
 * transposed loads one point at a time into arrays on the stack (gcc
 * vectorises no strided load here: gathers are off in its tuning), then the
 * rest of the statements vectorised over them. All loads come first: a vector
 * read of values stored just before waits for the stores to retire. */
static void transposed_tile(rfi_render *R, const bool *live, const bool *tr, long long rows,
                            const char *end, int depth)
{
    const rfi_kir_kernel *k = R->k;
    int n = k->rank - 1, d = n - 1;
    char shape[48], at[64];
    snprintf(shape, sizeof shape, "[%lld][%d]", rows, TRANSPOSED_LINES);
    snprintf(at, sizeof at, "[i%d - tb%d][i%d - tb%d]", d, d, n, n);
    rfi_render_copy_arrays(R, tr, shape, depth);
    /* gather: what the transposed loads' indices need; compute: what the
     * stores need, the transposed loads' values read from the copies */
    bool *gather = rfi_calloc((size_t)k->n_ins, sizeof *gather);
    bool *compute = rfi_calloc((size_t)k->n_ins, sizeof *compute);
    if (!gather || !compute) {
        rfi_free(gather);
        rfi_free(compute);
        R->sb->failed = true;
        return;
    }
    for (int id = 0; id < k->n_ins; id++)
        if (tr[id])
            rfi_render_mark_operands(k, k->ins[id].a, NULL, gather);
    for (int s = 0; s < k->n_stores; s++) {
        rfi_render_mark_operands(k, k->stores[s].index, tr, compute);
        rfi_render_mark_operands(k, k->stores[s].value, tr, compute);
    }
    for (int id = 0; id < k->n_ins; id++)
        compute[id] = compute[id] && !tr[id];
    for (int pass = 0; pass < 2; pass++) {
        rfi_render_indent(R, depth);
        putf(R->sb, "for (int64_t i%d = tb%d; i%d < te%d; i%d++) {\n", d, d, d, d, d);
        if (pass == 1) {
            rfi_render_indent(R, depth + 1);
            put(R->sb, "#pragma omp simd\n");
        }
        rfi_render_indent(R, depth + 1);
        putf(R->sb, "for (int64_t i%d = tb%d; i%d < %s; i%d++) {\n", n, n, n, end, n);
        if (pass == 0) {
            rfi_render_statements_where(R, live, 1, depth + 2, gather, true);
            rfi_render_copy_fill(R, tr, at, depth + 2);
        } else {
            rfi_render_copy_read(R, tr, at, depth + 2);
            rfi_render_statements_where(R, live, 1, depth + 2, compute, true);
            rfi_render_stores(R, depth + 2);
        }
        rfi_render_close_loops(R, depth, 2);
    }
    rfi_free(gather);
    rfi_free(compute);
}

/* The loops of reads_gathered kernels: the outer ones, then blocks of a
 * cache line's points of the second innermost loop (d: its share of lo..hi
 * when it is the first) by blocks of TRANSPOSED_LINES of the innermost (n). */
static void transposed_body(rfi_render *R, const bool *live)
{
    const rfi_kir_kernel *k = R->k;
    int n = k->rank - 1, d = n - 1;
    long long line = TRANSPOSED_ROW_BYTES / 4, dn = (long long)k->dims[n];
    for (int id = 0; id < k->n_ins; id++)
        if (live[id] && k->ins[id].op == RFI_KIR_LOAD && rf_dtype_size(k->ins[id].dtype) == 8)
            line = TRANSPOSED_ROW_BYTES / 8;
    rfi_render_open_outer_loops(R, d, false);
    int depth = 1 + d;
    char lo[32], hi[32];
    snprintf(lo, sizeof lo, "%s", d == 0 ? "lo" : "0");
    if (d == 0)
        snprintf(hi, sizeof hi, "hi");
    else
        snprintf(hi, sizeof hi, "%lld", (long long)k->dims[d]);
    rfi_render_indent(R, depth);
    putf(R->sb, "for (int64_t tb%d = %s; tb%d < %s; tb%d += %lld) {\n", d, lo, d, hi, d, line);
    rfi_render_indent(R, depth + 1);
    putf(R->sb, "const int64_t te%d = tb%d + %lld < %s ? tb%d + %lld : %s;\n", d, d, line, hi, d,
         line, hi);
    bool *tr = rfi_calloc((size_t)k->n_ins, sizeof *tr);
    if (!tr) {
        R->sb->failed = true;
        return;
    }
    for (int id = 0; id < k->n_ins; id++)
        tr[id] = live[id] && rfi_render_gathered_load(k, &k->ins[id]);
    /* whole blocks of n with a constant count (gcc's vector loop then has no
     * masked remainder), then the last part block */
    long long whole = dn - dn % TRANSPOSED_LINES;
    char end[48];
    for (int part = 0; part < 2; part++) {
        if (part == 1 && whole == dn)
            break;
        rfi_render_indent(R, depth + 1);
        if (part == 0) {
            putf(R->sb, "for (int64_t tb%d = 0; tb%d < %lld; tb%d += %d) {\n", n, n, whole, n,
                 TRANSPOSED_LINES);
            snprintf(end, sizeof end, "tb%d + %d", n, TRANSPOSED_LINES);
        } else {
            putf(R->sb, "{\n");
            rfi_render_indent(R, depth + 2);
            putf(R->sb, "const int64_t tb%d = %lld;\n", n, whole);
            snprintf(end, sizeof end, "%lld", dn);
        }
        transposed_tile(R, live, tr, line, end, depth + 2);
        rfi_render_close_loops(R, depth + 1, 1);
    }
    rfi_free(tr);
    rfi_render_close_loops(R, depth, 1);
    rfi_render_close_loops(R, 1, d);
}

static void one_function(rfi_render *R, const char *kname, const rfi_schedule *sc, const bool *live,
                         bool *fold_live, bool *out_live, bool *base_used);

/* The kernel's comment, ctx struct and declarations into R->sb, its
 * functions into R->def; fold_live and out_live are scratch. */
static void kernel_functions(rfi_render *R, const bool *live, bool *fold_live, bool *out_live,
                             bool *base_used)
{
    const rfi_kir_kernel *k = R->k;
    rfi_schedule sc = rfi_render_schedule(k, live);
    char kname[64];
    rendered_name(R, kname, sizeof kname);
    if (!R->neutral)
        comment(R, k->comment ? k->comment : kname, 0);
    ctx_struct(R, base_used, kname, &sc);
    /* declared before any part's code: the entry point's part calls it */
    putf(R->sb, "RF_KERNEL void %s", kname);
    parameters(R, k);
    put(R->sb, ";\n");
    if (sc.form == RFI_SCHED_SPLIT)
        putf(R->sb, "RF_KERNEL void %s_combine(const struct %s_ctx *c);\n", kname, kname);
    put(R->sb, "\n");
    rfi_strbuf *decl = R->sb;
    R->sb = R->def;
    if (sc.form == RFI_SCHED_SPLIT)
        rfi_render_split_functions(R, kname, &sc, fold_live, out_live, base_used);
    else
        one_function(R, kname, &sc, live, fold_live, out_live, base_used);
    R->sb = decl;
}

/* The function of a kernel that is not a split reduction. */
static void one_function(rfi_render *R, const char *kname, const rfi_schedule *sc, const bool *live,
                         bool *fold_live, bool *out_live, bool *base_used)
{
    const rfi_kir_kernel *k = R->k;
    rfi_render_function_head(R, kname);
    rfi_render_declare_bases(R, base_used);
    rfi_render_statements(R, live, 0, 1);
    if (sc->form == RFI_SCHED_INTERCHANGED) {
        rfi_render_interchanged_body(R, fold_live, out_live);
    } else if (sc->form == RFI_SCHED_TILED) {
        rfi_render_tiled_body(R, fold_live, out_live);
    } else if (rfi_render_unrolls(k)) {
        rfi_render_unrolled_body(R, live);
    } else if (reads_gathered(k, live)) {
        transposed_body(R, live);
    } else {
        plain_body(R, live);
    }
    put(R->sb, "}\n\n");
}

static rf_status render_kernel(rfi_render *R, const rfi_kir_kernel *k)
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
        rfi_render_bases_used(k, live, true, base_used);
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

static rf_status neutral_text(rfi_render *R, const rfi_kir_kernel *k, kernel_text *out)
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
static rf_status kernel_piece(rfi_render *R, const rfi_kir_module *m, kernel_text *texts,
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

static void pointer(rfi_render *R, const char *type, int buffer, size_t offset)
{
    rfi_render_c_pointer(R->sb, type, buffer, offset);
}

/* "struct <kname>_ctx <var> = {" and kernel k's bases that base_used marks,
 * without the closing brace; returns whether there were none. */
static bool kernel_ctx(rfi_render *R, const rfi_kir_kernel *k, const bool *base_used,
                       const char *kname, const char *var)
{
    putf(R->sb, "        struct %s_ctx %s = {", kname, var);
    bool none = true;
    for (int b = 0; b < k->n_bases; b++) {
        if (!base_used[b] || in_tile(k, b))
            continue;
        const rfi_kir_base *x = &k->bases[b];
        put(R->sb, none ? "" : ", ");
        pointer(R, rfi_render_ctype(x->dtype), x->buffer, x->offset);
        none = false;
    }
    return none;
}

/* The bases kernel k's live instructions load or store (an array the caller
 * frees) and its schedule; NULL (R's text failed) when out of memory. */
static bool *bases_of_call(rfi_render *R, const rfi_kir_kernel *k, rfi_schedule *sc)
{
    bool *base_used = rfi_calloc((size_t)(k->n_bases > 0 ? k->n_bases : 1), sizeof(bool));
    bool *live = rfi_calloc((size_t)(k->n_ins > 0 ? k->n_ins : 1), sizeof(bool));
    if (base_used && live) {
        rfi_kir_liveness(k, live);
        rfi_render_bases_used(k, live, true, base_used);
        *sc = rfi_render_schedule(k, live);
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
static void call_pooled_conv(rfi_render *R, const rfi_kir_module *m, int i)
{
    const rfi_kir_step *st = &m->steps[i];
    const rfi_kir_kernel *k = m->steps[st->conv.pool_kernel].kernel;
    char kname[64];
    kernel_name(m->steps[R->function_of[st->conv.pool_kernel]].kernel, kname, sizeof kname);
    rfi_schedule sc;
    bool *base_used = bases_of_call(R, k, &sc);
    if (!base_used)
        return;
    R->sb->failed |= sc.form == RFI_SCHED_SPLIT; /* a LOOP kernel: no partials */
    put(R->sb, "    {\n");
    kernel_ctx(R, k, base_used, kname, "pool");
    put(R->sb, "};\n");
    rfi_render_conv_call(st, st->step, "pool", R->sb); /* shares no kernel */
    put(R->sb, "    }\n");
    rfi_free(base_used);
}

/* What computing one point of k costs, in units of a plain elementwise op
 * (at least 1): a math function's vector variant (libmvec), a division or an
 * rsqrt (computed in double) costs about as much as a dozen adds; a load or
 * a store one, so that a loop storing many roots (an RNN's input cut into
 * its 64 time steps) counts as the memory it moves. */
static int64_t point_cost(const rfi_kir_kernel *k)
{
    int64_t cost = k->n_stores;
    for (int i = 0; i < k->n_ins; i++) {
        const rfi_kir_ins *x = &k->ins[i];
        if (x->op == RFI_KIR_LOAD)
            cost++;
        if (x->op != RFI_KIR_UNARY && x->op != RFI_KIR_BINARY)
            continue;
        bool heavy = rfi_op_calls_math(x->ir_op) || x->ir_op == RFI_OP_DIV ||
                     x->ir_op == RFI_OP_RSQRT;
        cost += heavy ? 12 : 1;
    }
    return cost > 0 ? cost : 1;
}

/* A kernel's block in the entry point: its ctx, then the kernel, through
 * parallel_for when large; a split reduction's partials live in the block.
 * "Large" counts the points times their cost over REFERENCE_COST, so that a
 * small loop of heavy points (a GELU's gradient: a tanh and two dozen
 * products) is shared by the threads too. */
#define REFERENCE_COST 4
static void call_kernel(rfi_render *R, const rfi_kir_kernel *k, const rfi_kir_kernel *fn)
{
    char kname[64];
    kernel_name(fn, kname, sizeof kname);
    rfi_schedule sc;
    bool *base_used = bases_of_call(R, k, &sc);
    if (!base_used)
        return;
    put(R->sb, "    {\n");
    if (sc.form == RFI_SCHED_SPLIT)
        putf(R->sb, "        %s part[%lld];\n", rfi_render_ctype(k->acc_dtype),
                      (long long)(sc.chunks * k->n_folds * sc.kept));
    bool first = kernel_ctx(R, k, base_used, kname, "c");
    if (sc.form == RFI_SCHED_SPLIT)
        put(R->sb, first ? "part" : ", part");
    put(R->sb, "};\n");
    int64_t outer = k->rank ? k->dims[0] : 1;
    int64_t total = rfi_numel(k->dims, k->rank) * rfi_numel(k->red_dims, k->red_rank);
    int64_t cost = point_cost(k);
    if (cost > REFERENCE_COST && total <= INT64_MAX / cost)
        total = total * cost / REFERENCE_COST;
    if (sc.form == RFI_SCHED_SPLIT) {
        putf(R->sb, "        s->parallel_for(s->rt, %lld, 1, %s, &c);\n",
                      (long long)sc.chunks, kname);
        putf(R->sb, "        %s_combine(&c);\n", kname);
    } else if (total > RFI_PARALLEL_MIN && outer > 1) {
        int64_t per_row = total / outer > 0 ? total / outer : 1;
        int64_t grain = (RFI_PARALLEL_CHUNK + per_row - 1) / per_row;
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

static void entry(rfi_render *R, const rfi_kir_module *m)
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
/* The prelude's bfloat16 rounding: the portable function, and the AVX512-BF16
 * instructions of matrix-vector products. */
static void bf16_prelude(rfi_strbuf *sb, unsigned need)
{
    if (need & RFI_NEED_BF16)
        put(sb, "/* x rounded to bfloat16 and back (rfi_round_bf16: nearest even, a subnormal\n"
                " * to a zero of its sign, NaN quiet), with selects for branches so that gcc\n"
                " * vectorises it */\n"
                "static inline float rf_round_bf16(float x)\n{\n"
                "    union { float f; uint32_t u; } v = {x};\n"
                "    uint32_t u = v.u, r = u + 0x7fffu + ((u >> 16) & 1u);\n"
                "    r = (u & 0x7fffffffu) > 0x7f800000u ? u | 0x00400000u : r;\n"
                "    r = (u & 0x7f800000u) == 0 ? u & 0x80000000u : r;\n"
                "    v.u = r & 0xffff0000u;\n"
                "    return v.f;\n}\n\n");
    if (need & RFI_NEED_BF16_DOT)
        putf(sb, "/* AVX512-BF16 (render_reduce.c), in assembly (immintrin.h alone adds 140 ms\n"
                 " * to a compile): rf_bf16x32 rounds 32 floats from p to bfloat16 as\n"
                 " * rf_round_bf16 does, rf_dpbf16 adds the products of their pairs to 16\n"
                 " * f32 sums */\n"
                 "#if defined(__AVX512BF16__) && defined(__GNUC__) && %d\n"
                 "#define RF_BF16_DOT 1\n"
                 "typedef float rf_dot_f32x16 __attribute__((vector_size(64)));\n"
                 "typedef short rf_dot_bf16x32 __attribute__((vector_size(64)));\n"
                 "static inline rf_dot_bf16x32 rf_bf16x32(const float *p)\n{\n"
                 "    rf_dot_f32x16 lo, hi;\n"
                 "    rf_dot_bf16x32 r;\n"
                 "    memcpy(&lo, p, sizeof lo);\n"
                 "    memcpy(&hi, p + 16, sizeof hi);\n"
                 "    __asm__(\"vcvtne2ps2bf16 %%2, %%1, %%0\"\n"
                 "            : \"=v\"(r) : \"v\"(hi), \"v\"(lo));\n"
                 "    return r;\n}\n\n"
                 "static inline rf_dot_f32x16 rf_dpbf16(rf_dot_f32x16 acc, rf_dot_bf16x32 a,\n"
                 "                                      rf_dot_bf16x32 b)\n{\n"
                 "    __asm__(\"vdpbf16ps %%2, %%1, %%0\" : \"+v\"(acc) : \"v\"(a), \"v\"(b));\n"
                 "    return acc;\n}\n\n"
                 "static inline float rf_sum16(rf_dot_f32x16 v)\n{\n"
                 "    float s = 0;\n"
                 "    for (int i = 0; i < 16; i++)\n"
                 "        s += v[i];\n"
                 "    return s;\n}\n"
                 "#else\n#define RF_BF16_DOT 0\n#endif\n\n",
             rfi_bf16_kernels_allowed() ? 1 : 0);
}

/* exp over the whole range, vectorisable: x = n ln 2 + r with |r| <= ln 2 / 2 (ln 2 in
 * two parts, n ln 2 exact), exp(r) by a polynomial (degree 6 in float, 11 in double:
 * exp interpolated at Chebyshev nodes, within 2.5e-9 and 4.2e-18 of it, a Taylor
 * polynomial needing one and two degrees more; its high terms by Estrin's scheme, the
 * low ones by Horner's, so that the chain of dependent operations is short: with
 * libmvec's log1p in the same loop, a softplus, the loop then takes 12% less), 2^n
 * built from bits in two halves so that a subnormal result is rounded once. Overflow
 * gives +inf (x is clamped to 89, 710 in double, whose exp overflows), NaN stays NaN,
 * -inf and every x whose exp rounds to 0 give +0 through a zero scale rather than an
 * underflowing product, subnormal results are kept. glibc's vector exp (libmvec) takes
 * a scalar path for every lane whose result overflows or is subnormal or zero (x < -87.3
 * or > 88.7 in float, beyond -708 or 709 in double): on an AVX2 core (compute-bound
 * loops) 6-15 ns per float where its fast path takes 0.46, against 0.61 for this one at
 * every x (1.2-1.5 where the result is subnormal); in double 14-27 ns against 1.70
 * (libmvec's fast path 1.14). Within 1.10 ulp (float, every input) and 0.96 ulp
 * (double, a dense sweep) of the exact value; test_kir's sweeps hold both to the 3 ulp
 * of all compiled math. */
static const char exp_f32[] =
    "static inline float rf_pow2i_f32(int32_t n) /* 2^n for n in [-126, 127] */\n{\n"
    "    int32_t bits = (n + 127) << 23;\n"
    "    float f;\n"
    "    memcpy(&f, &bits, sizeof f);\n"
    "    return f;\n}\n\n"
    "/* exp(y) for y <= 89 (NaN: a number) */\n"
    "RF_INLINE float rf_exp_core_f32(float y)\n{\n"
    "    y = y > -150.0f ? y : -150.0f; /* NaN -> -150 */\n"
    "    float n = rintf(y * 1.44269504088896341f);\n"
    "    float r = fmaf(n, -0.693145751953125f, y); /* ln 2 in two parts: exact */\n"
    "    r = fmaf(n, -1.428606765330187045e-06f, r);\n"
    "    float r2 = r * r; /* the high terms by Estrin's scheme: a short chain */\n"
    "    float a0 = fmaf(1.666641551e-1f, r, 5.000000047e-1f);\n"
    "    float a1 = fmaf(8.375126640e-3f, r, 4.166635289e-2f);\n"
    "    float q = fmaf(fmaf(1.394110874e-3f, r2, a1), r2, a0);\n"
    "    float p = fmaf(fmaf(q, r, 1.000000038f), r, 1.0f);\n"
    "    int32_t k = (int32_t)n, half = k >> 1;\n"
    "    float lo = k < -150 ? 0.0f : rf_pow2i_f32(half); /* below 2^-150.5: 0 */\n"
    "    return p * lo * rf_pow2i_f32(k - half);\n}\n\n"
    "RF_INLINE float rf_exp_f32(float x)\n{\n"
    "    float e = rf_exp_core_f32(x < 89.0f ? x : 89.0f);\n"
    "    return x != x ? x : e;\n}\n\n";

/* The double one takes n's bits from n + 1.5 2^52 rather than converting: AVX2 has no
 * vector double -> int64 conversion, and gcc would not vectorise one. */
static const char exp_f64[] =
    "/* 2^n for n in [-1022, 1023], from t = n + 0x1.8p52 */\n"
    "static inline double rf_pow2i_f64(double t)\n{\n"
    "    double m = 0x1.8p52, f;\n"
    "    uint64_t bits, magic;\n"
    "    memcpy(&bits, &t, sizeof bits);\n"
    "    memcpy(&magic, &m, sizeof magic);\n"
    "    bits = (bits - magic + 1023) << 52;\n"
    "    memcpy(&f, &bits, sizeof f);\n"
    "    return f;\n}\n\n"
    "RF_INLINE double rf_exp_f64(double x)\n{\n"
    "    double y = x > -800.0 ? x : -800.0; /* NaN -> -800 */\n"
    "    y = y < 710.0 ? y : 710.0;\n"
    "    double n = rint(y * 1.4426950408889634074);\n"
    "    double r = fma(n, -0.693147180369123816490, y); /* ln 2 in two parts: exact */\n"
    "    r = fma(n, -1.90821492927058770002e-10, r);\n"
    "    double r2 = r * r, r4 = r2 * r2; /* the high terms by Estrin's scheme */\n"
    "    double a0 = fma(4.1666666666488091e-2, r, 1.6666666666666681e-1);\n"
    "    double a1 = fma(1.3888888952315873e-3, r, 8.3333333333196003e-3);\n"
    "    double a2 = fma(2.4801485481152372e-5, r, 1.9841269890047959e-4);\n"
    "    double a3 = fma(2.7632640074237224e-7, r, 2.7557240917674558e-6);\n"
    "    double b0 = fma(a1, r2, a0), b1 = fma(a3, r2, a2);\n"
    "    double q = fma(fma(2.5110037940619666e-8, r4, b1), r4, b0);\n"
    "    double p = fma(fma(fma(q, r, 5.0000000000000184e-1), r, 1.0), r, 1.0);\n"
    "    double half = rint(n * 0.5);\n"
    "    double lo = n < -1075.0 ? 0.0 : rf_pow2i_f64(half + 0x1.8p52); /* 0 below */\n"
    "    double e = p * lo * rf_pow2i_f64((n - half) + 0x1.8p52);\n"
    "    return x != x ? x : e;\n}\n\n";

/* f32 logistic in float arithmetic (GELU's and swish's hot point): exp(-|x|) by
 * rf_exp_core_f32 (rf_exp_f32 without its clamp and NaN select), then a / (1 + e)
 * with the rounding of 1 + e and of the quotient corrected by multiply-adds (NaN
 * kept). 1.6x faster than the same in double through libmvec's exp; test_kir's
 * sweeps find it within 1 ulp of the interpreter and hold it to the 3 ulp of all
 * compiled math. */
static const char logistic_f32[] =
    "RF_INLINE float rf_logistic_f32(float x)\n{\n"
    "    float e = rf_exp_core_f32(-fabsf(x)); /* NaN: kept below */\n"
    "    float b = 1.0f + e, b_low = (1.0f - b) + e; /* 1 + e = b + b_low exactly */\n"
    "    float a = x >= 0 ? 1.0f : e;\n"
    "    float inv = 1.0f / b, q = a * inv;\n"
    "    float rest = fmaf(-q, b, a); /* a - q b, exact */\n"
    "    q = fmaf(fmaf(-q, b_low, rest), inv, q);\n"
    "    return x != x ? x : q;\n}\n\n";

static void prelude(rfi_strbuf *sb, const rfi_render *R)
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
    if (need & (RFI_NEED_VECTORS | RFI_NEED_LANES16))
        put(sb, "/* a loop over the 16 lanes of a channel block, or over 16-float vectors:\n"
                " * gcc's tuning for AVX-512 machines prefers 256-bit vectors, which takes\n"
                " * two halves and a loop per block */\n"
                "#if defined(__GNUC__) && !defined(__clang__) && defined(__AVX512F__)\n"
                "#define RF_LANES16 __attribute__((target(\"prefer-vector-width=512\")))\n"
                "#else\n"
                "#define RF_LANES16\n"
                "#endif\n");
    if (need & RFI_NEED_TILES)
        put(sb, "/* GNU C vectors: a register of a register tile's accumulators, and\n"
                " * its loads and stores anywhere in memory */\n"
                "typedef double rf_tile_f64 __attribute__((vector_size(32)));\n"
                "typedef float rf_tile_f32 __attribute__((vector_size(32)));\n"
                "typedef double rf_tile_f64_mem\n"
                "    __attribute__((vector_size(32), aligned(8), may_alias));\n"
                "typedef float rf_tile_f32_mem\n"
                "    __attribute__((vector_size(32), aligned(4), may_alias));\n"
                "typedef double rf_wtile_f64 __attribute__((vector_size(64)));\n"
                "typedef float rf_wtile_f32 __attribute__((vector_size(64)));\n"
                "typedef double rf_wtile_f64_mem\n"
                "    __attribute__((vector_size(64), aligned(8), may_alias));\n"
                "typedef float rf_wtile_f32_mem\n"
                "    __attribute__((vector_size(64), aligned(4), may_alias));\n");
    if (need & RFI_NEED_VECTORS)
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
    if (need & RFI_NEED_SAT)
        putf(sb,
            "/* float -> integer: truncate toward zero, saturate, NaN -> 0 */\n"
            "static inline int32_t rf_f2i32(double v)\n{\n"
            "    return v != v ? 0 : v <= -2147483648.0 ? INT32_MIN\n"
            "         : v >= 2147483647.0 ? INT32_MAX : (int32_t)v;\n}\n\n"
            "static inline int64_t rf_f2i64(double v)\n{\n"
            "    return v != v ? 0 : v <= -9223372036854775808.0 ? INT64_MIN\n"
            "         : v >= 9223372036854775807.0 ? INT64_MAX : (int64_t)v;\n}\n\n"
            "static inline uint8_t rf_f2u8(double v)\n{\n"
            "    return v != v ? 0 : v <= 0.0 ? 0 : v >= 255.0 ? 255 : "
            "(uint8_t)(int32_t)v;\n}\n\n"
            "/* the same, as the integer's value in double (float -> int -> float) */\n"
            "static inline double rf_ftrunc_i32(double v)\n{\n"
            "    return v != v ? 0.0 : v <= -2147483648.0 ? -2147483648.0\n"
            "         : v >= 2147483647.0 ? 2147483647.0 : trunc(v);\n}\n\n"
            "static inline double rf_ftrunc_i64(double v)\n{\n"
            "    return v != v ? 0.0 : v <= -9223372036854775808.0 ? -9223372036854775808.0\n"
            "         : v >= 9223372036854775807.0 ? 9223372036854775807.0 : trunc(v);\n}\n\n"
            "static inline double rf_ftrunc_u8(double v)\n{\n"
            "    return v != v ? 0.0 : v <= 0.0 ? 0.0 : v >= 255.0 ? 255.0 : trunc(v);\n}\n\n");
    bf16_prelude(sb, need);
    if (need & RFI_NEED_DIV)
        putf(sb,
            "/* integer division: x / 0 = 0, INT_MIN / -1 wraps */\n"
            "static inline int64_t rf_div_i64(int64_t a, int64_t b)\n{\n"
            "    if (b == 0)\n        return 0;\n"
            "    if (b == -1)\n        return (int64_t)(0 - (uint64_t)a);\n"
            "    return a / b;\n}\n\n");
    if (need & RFI_NEED_REM)
        putf(sb,
            "/* integer remainder: x %% 0 = 0, x %% -1 = 0 */\n"
            "static inline int64_t rf_rem_i64(int64_t a, int64_t b)\n{\n"
            "    return (b == 0 || b == -1) ? 0 : a %% b;\n}\n\n");
    if (need & RFI_NEED_POW)
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
        if (need & (d ? RFI_NEED_MAXMIN_F64 : RFI_NEED_MAXMIN_F32))
            putf(sb,
                "/* max/min propagating NaN (either operand's); written as two selects so\n"
                " * gcc vectorises them */\n"
                "static inline %s rf_max_%s(%s a, %s b)\n{\n"
                "    %s m = a > b ? a : b;\n    return a != a ? a : m;\n}\n\n"
                "static inline %s rf_min_%s(%s a, %s b)\n{\n"
                "    %s m = a < b ? a : b;\n    return a != a ? a : m;\n}\n\n",
                t, n, t, t, t, t, n, t, t, t);
        if (need & (d ? RFI_NEED_POW_F64 : RFI_NEED_POW_F32))
            putf(sb,
                "/* pow; gcc's vectoriser computes pow(a, 0.5) as sqrt(a), which gives -0\n"
                " * for -0 and NaN for -inf where pow gives +0 and +inf, so that case is\n"
                " * spelled out (as a select: a conditional call would not vectorise) */\n"
                "static inline %s rf_pow_%s(%s a, %s b)\n{\n"
                "    %s root = a == -(%s)INFINITY ? (%s)INFINITY : sqrt%s(a) + 0;\n"
                "    %s p = pow%s(a, b);\n"
                "    return b == (%s)0.5 ? root : p;\n}\n\n",
                t, n, t, t, t, t, t, d ? "" : "f", t, d ? "" : "f", t);
    }
    if (need & (RFI_NEED_EXP_F32 | RFI_NEED_EXP_F64 | RFI_NEED_LOGISTIC_F32 |
                RFI_NEED_LOGISTIC_F64))
        put(sb, "/* always inlined: gcc stops inlining a function of this size once a file\n"
                " * calls it in a few places, and the loops calling it then run scalar */\n"
                "#if defined(__GNUC__)\n"
                "#define RF_INLINE static inline __attribute__((always_inline))\n"
                "#else\n"
                "#define RF_INLINE static inline\n"
                "#endif\n");
    if (need & (RFI_NEED_EXP_F32 | RFI_NEED_LOGISTIC_F32))
        put(sb, exp_f32);
    if (need & (RFI_NEED_EXP_F64 | RFI_NEED_LOGISTIC_F64))
        put(sb, exp_f64);
    for (int d = 0; d < 2; d++)
        if (need & (d ? RFI_NEED_EXPM1_F64 : RFI_NEED_EXPM1_F32))
            putf(sb,
                "/* expm1: libmvec's takes its scalar path below -88 (-708 in double), so\n"
                " * x is clamped to -%s, where expm1 rounds to -1, as an unsigned minimum\n"
                " * of bits: a negative number's grow with its magnitude and lie above\n"
                " * every positive number's, so x below -%s (-inf, a NaN with its sign bit\n"
                " * too) becomes -%s and the rest stays. A select (`x < c ? c : x`) would\n"
                " * not do: gcc moves the call into the select's arms, where it gets x\n"
                " * itself again. The last select keeps a NaN. */\n"
                "static inline %s rf_expm1_%s(%s x)\n{\n"
                "    %s u, c = %s; /* the bits of -%s */\n"
                "    %s y;\n"
                "    memcpy(&u, &x, sizeof u);\n"
                "    u = u < c ? u : c;\n"
                "    memcpy(&y, &u, sizeof y);\n"
                "    %s e = expm1%s(y);\n"
                "    return x != x ? x : e;\n}\n\n",
                d ? "40" : "20", d ? "40" : "20", d ? "40" : "20", d ? "double" : "float",
                d ? "f64" : "f32", d ? "double" : "float", d ? "uint64_t" : "uint32_t",
                d ? "0xc044000000000000u" : "0xc1a00000u", d ? "40" : "20",
                d ? "double" : "float", d ? "double" : "float", d ? "" : "f");
    if (need & RFI_NEED_LOGISTIC_F64)
        put(sb, "/* logistic, never exp of a large positive number */\n"
                "RF_INLINE double rf_logistic_f64(double x)\n{\n"
                "    double e = rf_exp_f64(-fabs(x));\n"
                "    return (x >= 0 ? 1 : e) / (1 + e);\n}\n\n");
    if (need & RFI_NEED_LOGISTIC_F32)
        put(sb, logistic_f32);
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
 * parts, not one: the mlp's training step (two parts then) compiled cold in
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
    rfi_render R;
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
            R.need |= RFI_NEED_VECTORS | RFI_NEED_MAXMIN_F32;
            R.need |= m->steps[i].conv.bf16 ? RFI_NEED_BF16 : 0;
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
                   "-funswitch-loops -march=native -ffp-contract=fast, on x86-64 "
                   "-mno-red-zone and the compiler's flag against gathers (cc.c), link "
                   "with -lm. */\n",
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
