/* elementwise.c: the interpreter's elementwise kernels: unary and binary
 * math, logic, COMPARE, SELECT, CLAMP and CONVERT.
 *
 * Float operands compute in double and round once to the result dtype;
 * integer and bool operands compute in int64 with wraparound (see interp.h).
 * Integer corner cases are defined, not UB: x / 0 = 0, x % 0 = 0,
 * INT_MIN / -1 wraps to INT_MIN and INT_MIN % -1 = 0; integer pow is repeated
 * multiplication (wrapping) and a negative exponent gives 0 except for bases
 * 1 and -1. Elements go through in chunks (load, compute, store) so the
 * dtype switches run once per chunk and the cheap ops vectorise; the
 * arithmetic is the same as one element at a time. Deliberately no fusion or
 * fast-math: this is the oracle.
 */
#include "interp.h"

/* ---- Unary ----------------------------------------------------------------------- */
static double unary_f(rfi_op op, double x)
{
    switch (op) {
    case RFI_OP_NEG: return -x;
    case RFI_OP_ABS: return fabs(x);
    case RFI_OP_SIGN: return x != x ? x : (x > 0) - (x < 0);
    case RFI_OP_EXP: return exp(x);
    case RFI_OP_EXPM1: return expm1(x);
    case RFI_OP_LOG: return log(x);
    case RFI_OP_LOG1P: return log1p(x);
    case RFI_OP_SQRT: return sqrt(x);
    case RFI_OP_RSQRT: return 1.0 / sqrt(x);
    case RFI_OP_TANH: return tanh(x);
    case RFI_OP_LOGISTIC: /* never exp of a large positive number */
        if (x >= 0)
            return 1.0 / (1.0 + exp(-x));
        else {
            double e = exp(x);
            return e / (1.0 + e);
        }
    case RFI_OP_SIN: return sin(x);
    case RFI_OP_COS: return cos(x);
    case RFI_OP_FLOOR: return floor(x);
    case RFI_OP_CEIL: return ceil(x);
    case RFI_OP_ROUND: return round(x); /* half away from zero */
    case RFI_OP_IS_FINITE: return isfinite(x) ? 1 : 0;
    case RFI_OP_NOT: return x == 0;
    case RFI_OP_STOP_GRADIENT: return x;
    default: return x;
    }
}

static int64_t unary_i(rfi_op op, rf_dtype dt, int64_t x)
{
    switch (op) {
    case RFI_OP_NEG: return rfi_wsub(0, x);
    case RFI_OP_ABS: return x < 0 ? rfi_wsub(0, x) : x;
    case RFI_OP_SIGN: return (x > 0) - (x < 0);
    case RFI_OP_NOT: return dt == RF_BOOL ? !x : (int64_t)~(uint64_t)x; /* bitwise on ints */
    case RFI_OP_IS_FINITE: return 1;
    case RFI_OP_STOP_GRADIENT: return x;
    default: return x; /* float-only ops never reach here on a verified graph */
    }
}

/* ---- Binary ---------------------------------------------------------------------- */
static double binary_f(rfi_op op, double a, double b)
{
    switch (op) {
    case RFI_OP_ADD: return a + b;
    case RFI_OP_SUB: return a - b;
    case RFI_OP_MUL: return a * b;
    case RFI_OP_DIV: return a / b;
    case RFI_OP_POW: return pow(a, b);
    case RFI_OP_MAX: return rfi_fmax_nan(a, b);
    case RFI_OP_MIN: return rfi_fmin_nan(a, b);
    case RFI_OP_REM: return fmod(a, b); /* sign of the dividend, as StableHLO */
    case RFI_OP_AND: return (a != 0) && (b != 0);
    case RFI_OP_OR: return (a != 0) || (b != 0);
    default: return 0;
    }
}

/* a ** b by repeated (wrapping) multiplication, done by squaring. */
static int64_t pow_i(int64_t a, int64_t b)
{
    if (b < 0) {
        if (a == 1)
            return 1;
        if (a == -1)
            return (b & 1) ? -1 : 1;
        return 0;
    }
    int64_t result = 1;
    while (b > 0) {
        if (b & 1)
            result = rfi_wmul(result, a);
        a = rfi_wmul(a, a);
        b >>= 1;
    }
    return result;
}

static int64_t binary_i(rfi_op op, int64_t a, int64_t b)
{
    switch (op) {
    case RFI_OP_ADD: return rfi_wadd(a, b);
    case RFI_OP_SUB: return rfi_wsub(a, b);
    case RFI_OP_MUL: return rfi_wmul(a, b);
    case RFI_OP_DIV:
        if (b == 0)
            return 0;
        if (b == -1)
            return rfi_wsub(0, a); /* INT64_MIN / -1 wraps */
        return a / b;
    case RFI_OP_REM:
        if (b == 0 || b == -1)
            return 0;
        return a % b;
    case RFI_OP_POW: return pow_i(a, b);
    case RFI_OP_MAX: return a > b ? a : b;
    case RFI_OP_MIN: return a < b ? a : b;
    case RFI_OP_AND: return (int64_t)((uint64_t)a & (uint64_t)b); /* bool: logical */
    case RFI_OP_OR: return (int64_t)((uint64_t)a | (uint64_t)b);
    default: return 0;
    }
}

static bool compare_f(rf_cmp dir, double a, double b)
{
    switch (dir) { /* NaN: every comparison false except NE */
    case RF_EQ: return a == b;
    case RF_NE: return a != b;
    case RF_LT: return a < b;
    case RF_LE: return a <= b;
    case RF_GT: return a > b;
    case RF_GE: return a >= b;
    default: return false;
    }
}

static bool compare_i(rf_cmp dir, int64_t a, int64_t b)
{
    switch (dir) {
    case RF_EQ: return a == b;
    case RF_NE: return a != b;
    case RF_LT: return a < b;
    case RF_LE: return a <= b;
    case RF_GT: return a > b;
    case RF_GE: return a >= b;
    default: return false;
    }
}

/* ---- Chunk kernels: the op applied to a chunk, the switch outside the loop ------------ *
 * The cheap ops get a loop of their own so they vectorise; the rest (libm calls,
 * integer division, ...) cost far more than the per-element switch they keep. */
static void unary_f_chunk(rfi_op op, double *v, int64_t count)
{
    switch (op) {
    case RFI_OP_NEG:
        for (int64_t k = 0; k < count; k++)
            v[k] = -v[k];
        return;
    case RFI_OP_ABS:
        for (int64_t k = 0; k < count; k++)
            v[k] = fabs(v[k]);
        return;
    case RFI_OP_STOP_GRADIENT: return;
    default:
        for (int64_t k = 0; k < count; k++)
            v[k] = unary_f(op, v[k]);
        return;
    }
}

static void unary_i_chunk(rfi_op op, rf_dtype dt, int64_t *v, int64_t count)
{
    for (int64_t k = 0; k < count; k++)
        v[k] = unary_i(op, dt, v[k]);
}

/* a[k] = a[k] op b[k] */
static void binary_f_chunk(rfi_op op, double *a, const double *b, int64_t count)
{
    switch (op) {
    case RFI_OP_ADD:
        for (int64_t k = 0; k < count; k++)
            a[k] += b[k];
        return;
    case RFI_OP_SUB:
        for (int64_t k = 0; k < count; k++)
            a[k] -= b[k];
        return;
    case RFI_OP_MUL:
        for (int64_t k = 0; k < count; k++)
            a[k] *= b[k];
        return;
    case RFI_OP_DIV:
        for (int64_t k = 0; k < count; k++)
            a[k] /= b[k];
        return;
    default:
        for (int64_t k = 0; k < count; k++)
            a[k] = binary_f(op, a[k], b[k]);
        return;
    }
}

static void binary_i_chunk(rfi_op op, int64_t *a, const int64_t *b, int64_t count)
{
    switch (op) {
    case RFI_OP_ADD:
        for (int64_t k = 0; k < count; k++)
            a[k] = rfi_wadd(a[k], b[k]);
        return;
    case RFI_OP_MUL:
        for (int64_t k = 0; k < count; k++)
            a[k] = rfi_wmul(a[k], b[k]);
        return;
    default:
        for (int64_t k = 0; k < count; k++)
            a[k] = binary_i(op, a[k], b[k]);
        return;
    }
}

/* ---- Loops over chunks --------------------------------------------------------------- *
 * Each kernel loads a chunk of its operands into double (float operands) or int64
 * (integer operands), computes it and stores it rounded into the result: the same
 * arithmetic as element by element, with the dtype switches once per chunk. */
#define CHUNK RFI_INTERP_CHUNK

static void run_unary(const rfi_node *n, const void *x, void *out)
{
    rf_dtype xt = n->in[0]->dtype;
    int64_t count = rfi_interp_numel(n);
    double f[CHUNK];
    int64_t v[CHUNK];
    for (int64_t s = 0; s < count; s += CHUNK) {
        int64_t len = count - s < CHUNK ? count - s : CHUNK;
        if (rfi_dtype_is_float(xt)) {
            rfi_interp_load_f(x, xt, s, len, f);
            unary_f_chunk(n->op, f, len);
            rfi_interp_store_f(out, n->dtype, s, len, f);
        } else {
            rfi_interp_load_i(x, xt, s, len, v);
            unary_i_chunk(n->op, xt, v, len);
            rfi_interp_store_i(out, n->dtype, s, len, v);
        }
    }
}

static void run_binary(const rfi_node *n, const void *a, const void *b, void *out)
{
    rf_dtype at = n->in[0]->dtype, bt = n->in[1]->dtype;
    int64_t count = rfi_interp_numel(n);
    double fa[CHUNK], fb[CHUNK];
    int64_t ia[CHUNK], ib[CHUNK];
    for (int64_t s = 0; s < count; s += CHUNK) {
        int64_t len = count - s < CHUNK ? count - s : CHUNK;
        if (rfi_dtype_is_float(at)) {
            rfi_interp_load_f(a, at, s, len, fa);
            rfi_interp_load_f(b, bt, s, len, fb);
            binary_f_chunk(n->op, fa, fb, len);
            rfi_interp_store_f(out, n->dtype, s, len, fa);
        } else {
            rfi_interp_load_i(a, at, s, len, ia);
            rfi_interp_load_i(b, bt, s, len, ib);
            binary_i_chunk(n->op, ia, ib, len);
            rfi_interp_store_i(out, n->dtype, s, len, ia);
        }
    }
}

static void run_compare(const rfi_node *n, const void *a, const void *b, void *out)
{
    rf_dtype at = n->in[0]->dtype, bt = n->in[1]->dtype;
    rf_cmp dir = (rf_cmp)n->attr.i[0];
    int64_t count = rfi_interp_numel(n);
    double fa[CHUNK], fb[CHUNK];
    int64_t ia[CHUNK], ib[CHUNK], r[CHUNK];
    for (int64_t s = 0; s < count; s += CHUNK) {
        int64_t len = count - s < CHUNK ? count - s : CHUNK;
        if (rfi_dtype_is_float(at)) {
            rfi_interp_load_f(a, at, s, len, fa);
            rfi_interp_load_f(b, bt, s, len, fb);
            for (int64_t k = 0; k < len; k++)
                r[k] = compare_f(dir, fa[k], fb[k]);
        } else {
            rfi_interp_load_i(a, at, s, len, ia);
            rfi_interp_load_i(b, bt, s, len, ib);
            for (int64_t k = 0; k < len; k++)
                r[k] = compare_i(dir, ia[k], ib[k]);
        }
        rfi_interp_store_i(out, n->dtype, s, len, r);
    }
}

/* Index of element i in an operand that is either full-size or a scalar (StableHLO
 * allows a scalar predicate for SELECT and scalar bounds for CLAMP). */
static int64_t elem(const rfi_node *operand, int64_t i)
{
    return rfi_interp_numel(operand) == 1 ? 0 : i;
}

/* out[i] = pred[i] ? a[i] : b[i], moving elements as words of their size. */
static void run_select(const rfi_node *n, const void *const *in, void *out)
{
    const rfi_node *pred = n->in[0];
    size_t esz = rf_dtype_size(n->dtype);
    int64_t count = rfi_interp_numel(n);
    bool full_bool_pred = pred->dtype == RF_BOOL && rfi_interp_numel(pred) == count;
    if (full_bool_pred && esz == 4) {
        const uint8_t *p = in[0];
        const uint32_t *a = in[1], *b = in[2];
        for (int64_t i = 0; i < count; i++)
            ((uint32_t *)out)[i] = p[i] ? a[i] : b[i];
        return;
    }
    for (int64_t i = 0; i < count; i++) {
        bool take_a = rfi_ld_i(in[0], pred->dtype, elem(pred, i)) != 0;
        const char *src = take_a ? in[1] : in[2];
        memcpy((char *)out + (size_t)i * esz, src + (size_t)i * esz, esz);
    }
}

/* clamp(lo, x, hi) = min(max(x, lo), hi) with NaN propagating. */
static void run_clamp(const rfi_node *n, const void *const *in, void *out)
{
    const rfi_node *lo = n->in[0], *x = n->in[1], *hi = n->in[2];
    int64_t count = rfi_interp_numel(n);
    bool is_float = rfi_dtype_is_float(x->dtype);
    for (int64_t i = 0; i < count; i++) {
        if (is_float) {
            double v = rfi_fmax_nan(rfi_ld_f(in[1], x->dtype, i),
                                    rfi_ld_f(in[0], lo->dtype, elem(lo, i)));
            v = rfi_fmin_nan(v, rfi_ld_f(in[2], hi->dtype, elem(hi, i)));
            rfi_st_f(out, n->dtype, i, v);
        } else {
            int64_t v = rfi_ld_i(in[1], x->dtype, i);
            int64_t l = rfi_ld_i(in[0], lo->dtype, elem(lo, i));
            int64_t h = rfi_ld_i(in[2], hi->dtype, elem(hi, i));
            v = v < l ? l : v;
            v = v > h ? h : v;
            rfi_st_i(out, n->dtype, i, v);
        }
    }
}

/* Float to integer truncates toward zero and saturates (NaN -> 0); to bool is != 0;
 * integer to narrower integer wraps: exactly the bulk stores. */
static void run_convert(const rfi_node *n, const void *x, void *out)
{
    rf_dtype xt = n->in[0]->dtype;
    int64_t count = rfi_interp_numel(n);
    double f[CHUNK];
    int64_t v[CHUNK];
    for (int64_t s = 0; s < count; s += CHUNK) {
        int64_t len = count - s < CHUNK ? count - s : CHUNK;
        if (rfi_dtype_is_float(xt)) {
            rfi_interp_load_f(x, xt, s, len, f);
            rfi_interp_store_f(out, n->dtype, s, len, f);
        } else {
            rfi_interp_load_i(x, xt, s, len, v);
            rfi_interp_store_i(out, n->dtype, s, len, v);
        }
    }
}

rf_status rfi_interp_elementwise(const rfi_node *n, const void *const *in, void *out)
{
    unsigned flags = rfi_op_table[n->op].flags;
    if (flags & RFI_UNARY) {
        run_unary(n, in[0], out);
        return RF_OK;
    }
    if (flags & RFI_BINARY) {
        run_binary(n, in[0], in[1], out);
        return RF_OK;
    }
    switch (n->op) {
    case RFI_OP_COMPARE: run_compare(n, in[0], in[1], out); return RF_OK;
    case RFI_OP_SELECT: run_select(n, in, out); return RF_OK;
    case RFI_OP_CLAMP: run_clamp(n, in, out); return RF_OK;
    case RFI_OP_CONVERT: run_convert(n, in[0], out); return RF_OK;
    default:
        return rfi_error(RF_E_INTERNAL, "interp: %s is not an elementwise op",
                         rfi_op_table[n->op].name);
    }
}
