/* test_ops_forward.c: forward results of every op of the IR through the public
 * op API, compiled and run on the CPU device. Expected values are written by
 * hand or computed here with plain, independent C loops in double precision
 * (naive broadcasting, dot, convolution, windows, gather/scatter).
 *
 * It deliberately does not test gradients (test_grad_fd.c), error messages
 * or the IR text; only values, dtypes and shapes.
 */
#include <float.h>

#include "test_prog.h"

#define N_OF(a) ((int)(sizeof(a) / sizeof((a)[0])))
#define DIMS(...) ((const int64_t[]){__VA_ARGS__})

static const double F32_TOL = 2e-6;
static const double F64_TOL = 1e-12;

static double tol_of(rf_dtype dt)
{
    return dt == RF_F32 ? F32_TOL : dt == RF_F64 ? F64_TOL : 0.0;
}

static bool is_float(rf_dtype dt)
{
    return dt == RF_F32 || dt == RF_F64;
}

/* The value a double takes once stored in dtype dt. */
static double as_dtype(rf_dtype dt, double v)
{
    unsigned char buf[8];
    tp_store(dt, buf, 0, v);
    return tp_load(dt, buf, 0);
}

/* Runs build on host inputs; a failure counts and prints `label`. */
static bool run_prog(const char *label, tp_build_fn build, void *user, rf_array *const *in, int nin,
                     rf_array **outs, int nouts)
{
    rf_status st = tp_run(build, user, in, nin, outs, nouts);
    tu_checks++;
    if (st != RF_OK) {
        tu_failures++;
        fprintf(stderr, "%s: run failed: %s (%s)\n", label, rf_status_str(st), rf_errmsg());
        return false;
    }
    return true;
}

/* ---- Constants, iota, weak scalars ---------------------------------------------- */

static void build_constants(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)a, (void)n, (void)u;
    const float f[6] = {1.5f, -2, 3, 0, 5.25f, -6};
    const int64_t l[3] = {-5, 0, 1LL << 40};
    const uint8_t b[4] = {0, 1, 1, 0};
    const uint8_t c[3] = {0, 200, 255};
    rf_return(t, rf_constant(t, RF_F32, RF_SHAPE(2, 3), f));
    rf_return(t, rf_constant(t, RF_I64, RF_SHAPE(3), l));
    rf_return(t, rf_constant(t, RF_BOOL, RF_SHAPE(2, 2), b));
    rf_return(t, rf_constant(t, RF_U8, RF_SHAPE(3), c));
    rf_return(t, rf_scalar_typed(t, RF_F64, 0.1));
    rf_return(t, rf_full(t, RF_I32, RF_SHAPE(2, 2), 7));
    rf_return(t, rf_scalar(t, 2.5));
    rf_return(t, rf_iota(t, RF_I32, RF_SHAPE(2, 3), 0));
    rf_return(t, rf_iota(t, RF_F32, RF_SHAPE(2, 3), 1));
    rf_return(t, rf_iota(t, RF_I64, RF_SHAPE(4), 0));
}

static void test_constants(void)
{
    rf_array *o[10] = {0};
    if (run_prog("constants", build_constants, NULL, NULL, 0, o, 10)) {
        tp_expect("constant f32", o[0], RF_F32, DIMS(2, 3), 2,
                  (const double[]){1.5, -2, 3, 0, 5.25, -6}, 0, 0);
        tp_expect("constant i64", o[1], RF_I64, DIMS(3), 1,
                  (const double[]){-5, 0, (double)(1LL << 40)}, 0, 0);
        tp_expect("constant bool", o[2], RF_BOOL, DIMS(2, 2), 2, (const double[]){0, 1, 1, 0}, 0,
                  0);
        tp_expect("constant u8", o[3], RF_U8, DIMS(3), 1, (const double[]){0, 200, 255}, 0, 0);
        tp_expect("scalar_typed f64", o[4], RF_F64, NULL, 0, (const double[]){0.1}, 0, 0);
        tp_expect("full i32", o[5], RF_I32, DIMS(2, 2), 2, (const double[]){7, 7, 7, 7}, 0, 0);
        tp_expect("weak scalar alone is f32", o[6], RF_F32, NULL, 0, (const double[]){2.5}, 0, 0);
        tp_expect("iota i32 axis 0", o[7], RF_I32, DIMS(2, 3), 2,
                  (const double[]){0, 0, 0, 1, 1, 1}, 0, 0);
        tp_expect("iota f32 axis 1", o[8], RF_F32, DIMS(2, 3), 2,
                  (const double[]){0, 1, 2, 0, 1, 2}, 0, 0);
        tp_expect("iota i64", o[9], RF_I64, DIMS(4), 1, (const double[]){0, 1, 2, 3}, 0, 0);
    }
    tp_free_all(o, 10);
}

static void build_weak(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    rf_return(t, rf_add(a[0], rf_scalar(t, 0.1)));  /* f64 + weak: exact 0.1 in f64 */
    rf_return(t, rf_mul(rf_scalar(t, 3), a[1]));    /* weak * i32 -> i32 */
    rf_return(t, rf_sub_s(a[0], 0.25));
    rf_return(t, rf_div_s(a[1], 2));                /* integer division truncates */
    rf_return(t, rf_pow_s(a[0], 2));
    rf_return(t, rf_mul_s(a[2], 0.5));              /* f32 */
    rf_return(t, rf_add_s(a[2], 1e-3));
    rf_return(t, rf_zeros_like(a[1]));
    rf_return(t, rf_ones_like(a[0]));
}

static void test_weak_scalars(void)
{
    rf_array *in[3] = {tp_host(RF_F64, DIMS(3), 1, (const double[]){1, 2, 3}),
                       tp_host(RF_I32, DIMS(3), 1, (const double[]){-7, 4, 9}),
                       tp_host(RF_F32, DIMS(2), 1, (const double[]){1, -3})};
    rf_array *o[9] = {0};
    if (run_prog("weak scalars", build_weak, NULL, in, 3, o, 9)) {
        tp_expect("f64 + weak 0.1", o[0], RF_F64, DIMS(3), 1,
                  (const double[]){1 + 0.1, 2 + 0.1, 3 + 0.1}, 0, 0);
        tp_expect("weak 3 * i32", o[1], RF_I32, DIMS(3), 1, (const double[]){-21, 12, 27}, 0, 0);
        tp_expect("sub_s", o[2], RF_F64, DIMS(3), 1, (const double[]){0.75, 1.75, 2.75}, 0, 0);
        tp_expect("i32 div_s 2", o[3], RF_I32, DIMS(3), 1, (const double[]){-3, 2, 4}, 0, 0);
        tp_expect("pow_s 2", o[4], RF_F64, DIMS(3), 1, (const double[]){1, 4, 9}, 0, 1e-15);
        tp_expect("f32 mul_s", o[5], RF_F32, DIMS(2), 1, (const double[]){0.5, -1.5}, 0, 0);
        tp_expect("f32 add_s 1e-3", o[6], RF_F32, DIMS(2), 1,
                  (const double[]){(float)(1.0f + (float)1e-3), (float)(-3.0f + (float)1e-3)}, 0,
                  0);
        tp_expect("zeros_like", o[7], RF_I32, DIMS(3), 1, (const double[]){0, 0, 0}, 0, 0);
        tp_expect("ones_like", o[8], RF_F64, DIMS(3), 1, (const double[]){1, 1, 1}, 0, 0);
    }
    tp_free_all(o, 9);
    tp_free_all(in, 3);
}

/* ---- Unary elementwise ------------------------------------------------------------ */

typedef rf_tensor *(*unary_fn)(rf_tensor *);
typedef struct unary_box {
    unary_fn fn;
} unary_box;

static void build_unary(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n;
    rf_return(t, ((unary_box *)u)->fn(a[0]));
}

static double ref_neg(double x) { return -x; }
static double ref_sign(double x) { return x > 0 ? 1 : x < 0 ? -1 : 0; }
static double ref_rsqrt(double x) { return 1 / sqrt(x); }
static double ref_logistic(double x) { return 1 / (1 + exp(-x)); }

typedef struct unary_case {
    const char *name;
    unary_fn fn;
    double (*ref)(double);
    double x[6];
} unary_case;

static const unary_case UNARY_CASES[] = {
    {"neg", rf_neg, ref_neg, {-2.3, -0.7, 0, 0.4, 1.1, 3.5}},
    {"abs", rf_abs, fabs, {-2.3, -0.7, 0, 0.4, 1.1, -3.5}},
    {"sign", rf_sign, ref_sign, {-2.3, -0.7, 0, 0.4, 1.1, -3.5}},
    {"exp", rf_exp, exp, {-2.3, -0.7, 0, 0.4, 1.1, 3.5}},
    {"expm1", rf_expm1, expm1, {-2.3, -1e-5, 0, 1e-7, 1.1, 3.5}},
    {"log", rf_log, log, {0.2, 0.5, 1, 2.5, 7, 100}},
    {"log1p", rf_log1p, log1p, {-0.5, -1e-6, 0, 1e-8, 2.5, 7}},
    {"sqrt", rf_sqrt, sqrt, {0, 0.25, 1, 2, 9, 100}},
    {"rsqrt", rf_rsqrt, ref_rsqrt, {0.25, 0.5, 1, 2, 9, 100}},
    {"tanh", rf_tanh, tanh, {-20, -0.7, 0, 0.4, 1.1, 3.5}},
    {"logistic", rf_logistic, ref_logistic, {-20, -0.7, 0, 0.4, 1.1, 3.5}},
    {"sin", rf_sin, sin, {-2.3, -0.7, 0, 0.4, 1.1, 3.5}},
    {"cos", rf_cos, cos, {-2.3, -0.7, 0, 0.4, 1.1, 3.5}},
    {"floor", rf_floor, floor, {-2.5, -0.7, 0, 0.4, 1.0, 3.5}},
    {"ceil", rf_ceil, ceil, {-2.5, -0.7, 0, 0.4, 1.0, 3.5}},
    {"round", rf_round, round, {-2.5, -0.5, 0.5, 1.5, 2.5, -1.4}},
};

static void test_unary_float(void)
{
    const rf_dtype dts[2] = {RF_F32, RF_F64};
    for (int c = 0; c < N_OF(UNARY_CASES); c++) {
        const unary_case *uc = &UNARY_CASES[c];
        for (int d = 0; d < 2; d++) {
            rf_dtype dt = dts[d];
            double want[6];
            for (int i = 0; i < 6; i++)
                want[i] = as_dtype(dt, uc->ref(as_dtype(dt, uc->x[i])));
            rf_array *in = tp_host(dt, DIMS(2, 3), 2, uc->x);
            rf_array *o = NULL;
            unary_box box = {uc->fn};
            char label[64];
            snprintf(label, sizeof label, "%s %s", uc->name, rf_dtype_name(dt));
            if (run_prog(label, build_unary, &box, &in, 1, &o, 1))
                tp_expect(label, o, dt, DIMS(2, 3), 2, want, tol_of(dt), tol_of(dt));
            rf_array_free(o);
            rf_array_free(in);
        }
    }
}

static void check_unary(const char *label, unary_fn fn, rf_dtype in_dt, const double *x, int n,
                        rf_dtype out_dt, const double *want)
{
    rf_array *in = tp_host(in_dt, DIMS(n), 1, x);
    rf_array *o = NULL;
    unary_box box = {fn};
    if (run_prog(label, build_unary, &box, &in, 1, &o, 1))
        tp_expect(label, o, out_dt, DIMS(n), 1, want, tol_of(out_dt), tol_of(out_dt));
    rf_array_free(o);
    rf_array_free(in);
}

static void test_unary_other(void)
{
    const double inf = INFINITY;
    const double x[6] = {1, inf, -inf, NAN, 0, -3};
    check_unary("is_finite f32", rf_is_finite, RF_F32, x, 6, RF_BOOL,
                (const double[]){1, 0, 0, 0, 1, 1});
    check_unary("is_finite f64", rf_is_finite, RF_F64, x, 6, RF_BOOL,
                (const double[]){1, 0, 0, 0, 1, 1});
    check_unary("not bool", rf_not, RF_BOOL, (const double[]){0, 1, 1, 0}, 4, RF_BOOL,
                (const double[]){1, 0, 0, 1});
    check_unary("not i32", rf_not, RF_I32, (const double[]){0, 5, -1}, 3, RF_I32,
                (const double[]){-1, -6, 0});
    check_unary("not i64", rf_not, RF_I64, (const double[]){0, 5, -1}, 3, RF_I64,
                (const double[]){-1, -6, 0});
    check_unary("not u8", rf_not, RF_U8, (const double[]){0, 5, 255}, 3, RF_U8,
                (const double[]){255, 250, 0});
    check_unary("neg i32", rf_neg, RF_I32, (const double[]){3, -4, 0}, 3, RF_I32,
                (const double[]){-3, 4, 0});
    check_unary("neg i64", rf_neg, RF_I64, (const double[]){3, -4, 0}, 3, RF_I64,
                (const double[]){-3, 4, 0});
    check_unary("abs i32", rf_abs, RF_I32, (const double[]){3, -4, 0}, 3, RF_I32,
                (const double[]){3, 4, 0});
    check_unary("abs i64", rf_abs, RF_I64, (const double[]){3, -4, 0}, 3, RF_I64,
                (const double[]){3, 4, 0});
    check_unary("sign i32", rf_sign, RF_I32, (const double[]){-5, 0, 7}, 3, RF_I32,
                (const double[]){-1, 0, 1});
    check_unary("sign i64", rf_sign, RF_I64, (const double[]){-5, 0, 7}, 3, RF_I64,
                (const double[]){-1, 0, 1});
    check_unary("stop_gradient f32 (identity)", rf_stop_gradient, RF_F32,
                (const double[]){-1.5, 2, 0}, 3, RF_F32, (const double[]){-1.5, 2, 0});
}

/* ---- Binary elementwise (broadcasting) --------------------------------------------- */

typedef rf_tensor *(*binary_fn)(rf_tensor *, rf_tensor *);
enum bin_op { B_ADD, B_SUB, B_MUL, B_DIV, B_POW, B_MAX, B_MIN, B_REM, B_AND, B_OR, B_COUNT };
static const char *const BIN_NAMES[B_COUNT] = {"add", "sub", "mul", "div", "pow",
                                                "max", "min", "rem", "and", "or"};
static const binary_fn BIN_FNS[B_COUNT] = {rf_add, rf_sub, rf_mul, rf_div, rf_pow,
                                           rf_max, rf_min, rf_rem, rf_and, rf_or};

typedef struct binary_box {
    binary_fn fn;
} binary_box;

static void build_binary(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n;
    rf_return(t, ((binary_box *)u)->fn(a[0], a[1]));
}

static double bin_ref(enum bin_op op, rf_dtype dt, double a, double b)
{
    bool fl = is_float(dt);
    int64_t ia = (int64_t)a, ib = (int64_t)b;
    double r;
    switch (op) {
    case B_ADD: r = a + b; break;
    case B_SUB: r = a - b; break;
    case B_MUL: r = a * b; break;
    case B_DIV: r = fl ? a / b : (double)(ia / ib); break;
    case B_POW: r = pow(a, b); break;
    case B_MAX: r = a > b ? a : b; break;
    case B_MIN: r = a < b ? a : b; break;
    case B_REM: r = fl ? fmod(a, b) : (double)(ia % ib); break;
    case B_AND: r = dt == RF_BOOL ? (double)(ia && ib) : (double)(ia & ib); break;
    case B_OR: r = dt == RF_BOOL ? (double)(ia || ib) : (double)(ia | ib); break;
    default: r = NAN;
    }
    return as_dtype(dt, r);
}

/* Index into an operand of shape (dims, rank) for flat output index o of
 * shape (od, orank), NumPy broadcasting (right-aligned, size 1 stretches). */
static int64_t bcast_index(int64_t o, const int64_t *od, int orank, const int64_t *dims, int rank)
{
    int64_t idx = 0, stride = 1;
    for (int k = orank - 1; k >= 0; k--) {
        int64_t c = o % od[k];
        o /= od[k];
        int j = k - (orank - rank);
        if (j < 0)
            continue;
        if (dims[j] != 1)
            idx += c * stride;
        stride *= dims[j];
    }
    return idx;
}

typedef struct shape {
    int rank;
    int64_t d[4];
} shape;

static void gen_vals(enum bin_op op, rf_dtype dt, bool rhs, int64_t n, uint64_t *rng, double *v)
{
    for (int64_t i = 0; i < n; i++) {
        double x;
        if (dt == RF_BOOL) {
            x = tp_rand(rng, 0, 1) < 0.5 ? 0 : 1;
        } else if (dt == RF_U8) {
            x = rhs ? floor(tp_rand(rng, 1, 9)) : floor(tp_rand(rng, 10, 28)); /* products fit u8 */
        } else if (!is_float(dt)) {
            if (rhs && (op == B_DIV || op == B_REM))
                x = floor(tp_rand(rng, 1, 8)) * (tp_rand(rng, 0, 1) < 0.5 ? -1 : 1);
            else
                x = floor(tp_rand(rng, -20, 21));
        } else if (op == B_POW) {
            x = rhs ? tp_rand(rng, -2, 2) : tp_rand(rng, 0.5, 3);
        } else if (rhs && (op == B_DIV || op == B_REM)) {
            x = tp_rand(rng, 0.6, 2.5) * (tp_rand(rng, 0, 1) < 0.5 ? -1 : 1);
        } else {
            x = tp_rand(rng, -5, 5);
        }
        v[i] = as_dtype(dt, x);
    }
}

static void check_binary(enum bin_op op, rf_dtype dt, shape sa, shape sb, uint64_t *rng)
{
    shape so = {sa.rank > sb.rank ? sa.rank : sb.rank, {0}};
    for (int k = 0; k < so.rank; k++) {
        int ja = k - (so.rank - sa.rank), jb = k - (so.rank - sb.rank);
        int64_t da = ja >= 0 ? sa.d[ja] : 1, db = jb >= 0 ? sb.d[jb] : 1;
        so.d[k] = da == 1 ? db : da;
    }
    int64_t na = tp_numel(sa.d, sa.rank), nb = tp_numel(sb.d, sb.rank);
    int64_t no = tp_numel(so.d, so.rank);
    double va[64], vb[64], want[64];
    gen_vals(op, dt, false, na, rng, va);
    gen_vals(op, dt, true, nb, rng, vb);
    for (int64_t i = 0; i < no; i++)
        want[i] = bin_ref(op, dt, va[bcast_index(i, so.d, so.rank, sa.d, sa.rank)],
                          vb[bcast_index(i, so.d, so.rank, sb.d, sb.rank)]);
    rf_array *in[2] = {tp_host(dt, sa.d, sa.rank, va), tp_host(dt, sb.d, sb.rank, vb)};
    rf_array *o = NULL;
    binary_box box = {BIN_FNS[op]};
    char label[96];
    snprintf(label, sizeof label, "%s %s rank %d x rank %d (%lldx.. vs %lldx..)", BIN_NAMES[op],
             rf_dtype_name(dt), sa.rank, sb.rank, (long long)(sa.rank ? sa.d[0] : 0),
             (long long)(sb.rank ? sb.d[0] : 0));
    if (run_prog(label, build_binary, &box, in, 2, &o, 1))
        tp_expect(label, o, dt, so.d, so.rank, want, tol_of(dt), 2 * tol_of(dt));
    rf_array_free(o);
    tp_free_all(in, 2);
}

static void test_binary(void)
{
    const shape pairs[][2] = {
        {{2, {2, 3}}, {2, {2, 3}}}, {{2, {2, 3}}, {1, {3}}},      {{2, {2, 1}}, {2, {1, 3}}},
        {{3, {4, 1, 3}}, {2, {2, 1}}}, {{0, {0}}, {2, {2, 3}}},   {{1, {5}}, {0, {0}}},
        {{2, {1, 1}}, {3, {2, 1, 3}}},
    };
    const rf_dtype float_dts[2] = {RF_F32, RF_F64};
    const rf_dtype int_dts[3] = {RF_I32, RF_I64, RF_U8};
    uint64_t rng = 12345;
    for (int op = 0; op < B_COUNT; op++) {
        for (int p = 0; p < N_OF(pairs); p++) {
            if (op != B_AND && op != B_OR)
                for (int d = 0; d < 2; d++)
                    check_binary((enum bin_op)op, float_dts[d], pairs[p][0], pairs[p][1], &rng);
            if (op == B_POW)
                continue;
            for (int d = 0; d < 3; d++)
                check_binary((enum bin_op)op, int_dts[d], pairs[p][0], pairs[p][1], &rng);
            if (op == B_AND || op == B_OR)
                check_binary((enum bin_op)op, RF_BOOL, pairs[p][0], pairs[p][1], &rng);
        }
    }
}

/* Hand-written spot checks of the integer and float corner cases. */
static void test_binary_spots(void)
{
    struct {
        enum bin_op op;
        rf_dtype dt;
        double a[4], b[4], want[4];
    } cases[] = {
        {B_DIV, RF_I32, {-7, 7, -7, 7}, {2, 2, -2, -2}, {-3, 3, 3, -3}},
        {B_REM, RF_I32, {-7, 7, -7, 7}, {2, 2, -2, -2}, {-1, 1, -1, 1}},
        {B_REM, RF_I64, {-7, 7, -7, 7}, {3, 3, -3, -3}, {-1, 1, -1, 1}},
        {B_REM, RF_F32, {-7.5, 7.5, 5, -0.5}, {2, 2, -3, 2}, {-1.5, 1.5, 2, -0.5}},
        {B_DIV, RF_F64, {1, -1, 0, 3}, {0, 0, 1, 4}, {INFINITY, -INFINITY, 0, 0.75}},
        {B_POW, RF_F64, {2, 4, 9, 2}, {10, 0.5, -0.5, 0}, {1024, 2, 1.0 / 3.0, 1}},
        {B_AND, RF_U8, {0xF0, 0xFF, 3, 0}, {0x3C, 0x0F, 5, 9}, {0x30, 0x0F, 1, 0}},
        {B_OR, RF_I32, {-16, 1, 3, 0}, {3, 2, 5, 0}, {-13, 3, 7, 0}},
        {B_MAX, RF_U8, {0, 255, 7, 8}, {200, 1, 7, 9}, {200, 255, 7, 9}},
        {B_MIN, RF_I64, {-5, 5, 0, 1}, {4, -4, 0, 2}, {-5, -4, 0, 1}},
        {B_SUB, RF_U8, {200, 9, 255, 1}, {100, 9, 0, 0}, {100, 0, 255, 1}},
    };
    for (int c = 0; c < N_OF(cases); c++) {
        rf_array *in[2] = {tp_host(cases[c].dt, DIMS(4), 1, cases[c].a),
                           tp_host(cases[c].dt, DIMS(4), 1, cases[c].b)};
        rf_array *o = NULL;
        binary_box box = {BIN_FNS[cases[c].op]};
        char label[64];
        snprintf(label, sizeof label, "spot %s %s", BIN_NAMES[cases[c].op],
                 rf_dtype_name(cases[c].dt));
        if (run_prog(label, build_binary, &box, in, 2, &o, 1))
            tp_expect(label, o, cases[c].dt, DIMS(4), 1, cases[c].want, 1e-15, 1e-6);
        rf_array_free(o);
        tp_free_all(in, 2);
    }
}

/* Integer division and remainder by zero and INT_MIN / -1 are undefined in C:
 * the run must neither crash nor trip UBSan. The values are unspecified. */
static void test_int_div_edge(void)
{
    const rf_dtype dts[3] = {RF_I32, RF_I64, RF_U8};
    for (int d = 0; d < 3; d++)
        for (int op = 0; op < 2; op++) {
            double lo = dts[d] == RF_I32 ? -2147483648.0 : dts[d] == RF_I64 ? -9.2e18 : 0;
            rf_array *in[2] = {tp_host(dts[d], DIMS(3), 1, (const double[]){7, lo, 0}),
                               tp_host(dts[d], DIMS(3), 1, (const double[]){0, -1, 0})};
            rf_array *o = NULL;
            binary_box box = {op ? rf_rem : rf_div};
            char label[64];
            snprintf(label, sizeof label, "%s %s by zero", op ? "rem" : "div",
                     rf_dtype_name(dts[d]));
            run_prog(label, build_binary, &box, in, 2, &o, 1);
            rf_array_free(o);
            tp_free_all(in, 2);
        }
}

/* ---- Compare, select, clamp, convert -------------------------------------------------- */

typedef struct cmp_box {
    rf_cmp dir;
} cmp_box;

static void build_compare(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n;
    rf_return(t, rf_compare(a[0], a[1], ((cmp_box *)u)->dir));
}

static double cmp_ref(rf_cmp dir, double a, double b)
{
    switch (dir) {
    case RF_EQ: return a == b;
    case RF_NE: return a != b;
    case RF_LT: return a < b;
    case RF_LE: return a <= b;
    case RF_GT: return a > b;
    case RF_GE: return a >= b;
    default: return NAN;
    }
}

static void test_compare(void)
{
    static const char *const names[RF_CMP_COUNT] = {"eq", "ne", "lt", "le", "gt", "ge"};
    const rf_dtype dts[6] = {RF_F32, RF_F64, RF_I32, RF_I64, RF_U8, RF_BOOL};
    /* a [2,3] vs b [3]: ties, both orders; floats also see NaN and -0 == 0. */
    const double af[6] = {-1, 0, 2, NAN, 1, -0.0};
    const double bf[3] = {-1, 1, 0};
    const double ai[6] = {-1, 0, 2, 5, 1, 0};
    const double au[6] = {1, 0, 2, 5, 1, 0};
    const double bu[3] = {1, 1, 0};
    const double ab[6] = {1, 0, 1, 0, 1, 0};
    const double bb[3] = {1, 1, 0};
    for (int d = 0; d < 6; d++) {
        rf_dtype dt = dts[d];
        const double *a = is_float(dt) ? af : dt == RF_U8 ? au : dt == RF_BOOL ? ab : ai;
        const double *b = is_float(dt) ? bf : dt == RF_U8 || dt == RF_BOOL ? bu : bf;
        if (dt == RF_BOOL)
            b = bb;
        for (int dir = 0; dir < RF_CMP_COUNT; dir++) {
            double want[6];
            for (int i = 0; i < 6; i++)
                want[i] = cmp_ref((rf_cmp)dir, a[i], b[i % 3]);
            rf_array *in[2] = {tp_host(dt, DIMS(2, 3), 2, a), tp_host(dt, DIMS(3), 1, b)};
            rf_array *o = NULL;
            cmp_box box = {(rf_cmp)dir};
            char label[64];
            snprintf(label, sizeof label, "compare %s %s", names[dir], rf_dtype_name(dt));
            if (run_prog(label, build_compare, &box, in, 2, &o, 1))
                tp_expect(label, o, RF_BOOL, DIMS(2, 3), 2, want, 0, 0);
            rf_array_free(o);
            tp_free_all(in, 2);
        }
    }
}

static void build_select(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    rf_return(t, rf_select(a[0], a[1], a[2])); /* pred [2,3], a [2,3], b [] */
    rf_return(t, rf_select(a[3], a[4], a[5])); /* pred [3], a [2,1], b [2,3] (i32) */
}

static void test_select(void)
{
    const double p[6] = {1, 0, 0, 1, 1, 0};
    const double x[6] = {1, 2, 3, 4, 5, 6};
    const double p2[3] = {0, 1, 0};
    rf_array *in[6] = {
        tp_host(RF_BOOL, DIMS(2, 3), 2, p),  tp_host(RF_F32, DIMS(2, 3), 2, x),
        tp_host(RF_F32, NULL, 0, (const double[]){-9}), tp_host(RF_BOOL, DIMS(3), 1, p2),
        tp_host(RF_I32, DIMS(2, 1), 2, (const double[]){7, 8}),
        tp_host(RF_I32, DIMS(2, 3), 2, (const double[]){-1, -2, -3, -4, -5, -6})};
    rf_array *o[2] = {0};
    if (run_prog("select", build_select, NULL, in, 6, o, 2)) {
        tp_expect("select f32 scalar b", o[0], RF_F32, DIMS(2, 3), 2,
                  (const double[]){1, -9, -9, 4, 5, -9}, 0, 0);
        tp_expect("select i32 broadcast pred", o[1], RF_I32, DIMS(2, 3), 2,
                  (const double[]){-1, 7, -3, -4, 8, -6}, 0, 0);
    }
    tp_free_all(o, 2);
    tp_free_all(in, 6);
}

static void build_clamp(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    rf_return(t, rf_clamp(a[0], a[1], a[2]));    /* scalar bounds */
    rf_return(t, rf_clamp_s(a[0], -0.5, 1.5));
    rf_return(t, rf_clamp(a[0], a[3], a[2]));    /* per-element lo */
    rf_return(t, rf_clamp(a[4], a[5], a[6]));    /* i32 */
}

static void test_clamp(void)
{
    const double x[6] = {-3, -1, 0, 0.5, 2, 5};
    rf_array *in[7] = {tp_host(RF_F32, DIMS(6), 1, x),
                       tp_host(RF_F32, NULL, 0, (const double[]){-1}),
                       tp_host(RF_F32, NULL, 0, (const double[]){2}),
                       tp_host(RF_F32, DIMS(6), 1, (const double[]){-4, 0, -1, 1, 1, 1}),
                       tp_host(RF_I32, DIMS(2, 2), 2, (const double[]){-5, 0, 3, 10}),
                       tp_host(RF_I32, DIMS(2, 1), 2, (const double[]){-1, 4}),
                       tp_host(RF_I32, NULL, 0, (const double[]){6})};
    rf_array *o[4] = {0};
    if (run_prog("clamp", build_clamp, NULL, in, 7, o, 4)) {
        tp_expect("clamp scalar bounds", o[0], RF_F32, DIMS(6), 1,
                  (const double[]){-1, -1, 0, 0.5, 2, 2}, 0, 0);
        tp_expect("clamp_s", o[1], RF_F32, DIMS(6), 1,
                  (const double[]){-0.5, -0.5, 0, 0.5, 1.5, 1.5}, 0, 0);
        tp_expect("clamp per-element lo", o[2], RF_F32, DIMS(6), 1,
                  (const double[]){-3, 0, 0, 1, 2, 2}, 0, 0);
        tp_expect("clamp i32 broadcast", o[3], RF_I32, DIMS(2, 2), 2,
                  (const double[]){-1, 0, 4, 6}, 0, 0);
    }
    tp_free_all(o, 4);
    tp_free_all(in, 7);
}

typedef struct convert_box {
    rf_dtype to;
} convert_box;

static void build_convert(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n;
    rf_return(t, rf_convert(a[0], ((convert_box *)u)->to));
}

static void test_convert(void)
{
    struct {
        rf_dtype from, to;
        double x[5], want[5];
    } cases[] = {
        {RF_F32, RF_I32, {-2.7, 2.7, -0.5, 0, 100.9}, {-2, 2, 0, 0, 100}},
        {RF_F64, RF_I64, {-2.7, 2.7, -0.5, 1e12 + 0.5, 100.9}, {-2, 2, 0, 1e12, 100}},
        {RF_F32, RF_U8, {3.9, 0.2, 255, 17.5, 1}, {3, 0, 255, 17, 1}},
        {RF_F32, RF_BOOL, {0, -0.5, 2, -0.0, 1e-30}, {0, 1, 1, 0, 1}},
        {RF_I32, RF_BOOL, {0, -3, 1, 0, 7}, {0, 1, 1, 0, 1}},
        {RF_F64, RF_F32, {0.1, -1e10, 1.0 / 3.0, 0, 2},
         {(float)0.1, -1e10, (float)(1.0 / 3.0), 0, 2}},
        {RF_F32, RF_F64, {0.1, -2.5, 0, 1, 3}, {(float)0.1, -2.5, 0, 1, 3}},
        {RF_I32, RF_F32, {-7, 0, 16777217, 3, 1}, {-7, 0, 16777216, 3, 1}},
        {RF_BOOL, RF_F32, {1, 0, 1, 1, 0}, {1, 0, 1, 1, 0}},
        {RF_BOOL, RF_I32, {1, 0, 1, 1, 0}, {1, 0, 1, 1, 0}},
        {RF_U8, RF_I32, {200, 0, 255, 1, 7}, {200, 0, 255, 1, 7}},
        {RF_I64, RF_I32, {-5, 5, 0, 123456, -123456}, {-5, 5, 0, 123456, -123456}},
        {RF_I32, RF_F64, {-5, 5, 0, 2147483647, -2147483647}, {-5, 5, 0, 2147483647, -2147483647}},
        {RF_U8, RF_BOOL, {0, 1, 2, 0, 255}, {0, 1, 1, 0, 1}},
    };
    for (int c = 0; c < N_OF(cases); c++) {
        rf_array *in = tp_host(cases[c].from, DIMS(5), 1, cases[c].x);
        rf_array *o = NULL;
        convert_box box = {cases[c].to};
        char label[64];
        snprintf(label, sizeof label, "convert %s -> %s", rf_dtype_name(cases[c].from),
                 rf_dtype_name(cases[c].to));
        if (run_prog(label, build_convert, &box, &in, 1, &o, 1))
            tp_expect(label, o, cases[c].to, DIMS(5), 1, cases[c].want, 0, 0);
        rf_array_free(o);
        rf_array_free(in);
    }
}

/* ---- Shape ops ------------------------------------------------------------------------ */

static void build_shapes(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    rf_tensor *v3 = a[0];   /* f32 [3] = 1 2 3 */
    rf_tensor *m23 = a[1];  /* i32 [2,3] = 0..5 */
    rf_tensor *r1 = a[2];   /* f64 [1,3] = 10 20 30 */
    rf_return(t, rf_broadcast_in_dim(v3, RF_SHAPE(2, 3), DIMS(1)));
    rf_return(t, rf_broadcast_in_dim(v3, RF_SHAPE(3, 2), DIMS(0)));
    rf_return(t, rf_broadcast_in_dim(r1, RF_SHAPE(2, 2, 3), DIMS(1, 2)));
    rf_return(t, rf_broadcast_to(v3, RF_SHAPE(2, 3)));
    rf_return(t, rf_reshape(m23, RF_SHAPE(3, 2)));
    rf_return(t, rf_reshape(m23, RF_SHAPE(-1)));
    rf_return(t, rf_reshape(rf_reshape(v3, RF_SHAPE(1, 3)), RF_SHAPE(3, -1)));
    rf_return(t, rf_squeeze(r1, 0));
    rf_return(t, rf_unsqueeze(v3, 1));
    rf_return(t, rf_unsqueeze(v3, -1));
    rf_return(t, rf_flatten(rf_reshape(m23, RF_SHAPE(2, 3, 1))));
    rf_return(t, rf_reshape(rf_slice(v3, DIMS(1), DIMS(2), NULL), NULL, 0));
}

/* float -> integer -> float: an integer 0 converts to +0, also from (-1, -0] (compiled
 * code that folded the pair into a truncation kept -0). */
static void build_round_trip(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    rf_return(t, rf_convert(rf_convert(a[0], RF_I64), RF_F64));
    rf_return(t, rf_convert(rf_convert(a[0], RF_I32), RF_F64));
    rf_return(t, rf_convert(rf_convert(a[1], RF_I64), RF_F32));
    rf_return(t, rf_convert(rf_convert(rf_convert(a[1], RF_I32), RF_I64), RF_F32));
    rf_return(t, rf_convert(rf_convert(rf_convert(a[0], RF_U8), RF_I32), RF_F64));
}

static void test_convert_round_trip(void)
{
    double x[19];
    for (int i = 0; i < 19; i++) /* -0 and -0.1 .. -0.9 (and 0.1 .. 0.3), body and tail */
        x[i] = i % 10 == 0 ? -0.0 : i % 7 == 3 ? (i % 3 + 1) * 0.1 : -(i % 10) * 0.1;
    rf_array *in[2] = {tp_dev(RF_F64, DIMS(19), 1, x), tp_dev(RF_F32, DIMS(19), 1, x)};
    rf_array *o[5] = {0};
    if (run_prog("float -> int -> float", build_round_trip, NULL, in, 2, o, 5)) {
        for (int k = 0; k < 5; k++) {
            double *v = tp_read(o[k], NULL);
            for (int i = 0; v && i < 19; i++)
                CHECK(v[i] == 0 && !signbit(v[i]));
            free(v);
        }
    }
    tp_free_all(o, 5);
    tp_free_all(in, 2);
}

static void test_shapes(void)
{
    rf_array *in[3] = {tp_host(RF_F32, DIMS(3), 1, (const double[]){1, 2, 3}),
                       tp_host(RF_I32, DIMS(2, 3), 2, (const double[]){0, 1, 2, 3, 4, 5}),
                       tp_host(RF_F64, DIMS(1, 3), 2, (const double[]){10, 20, 30})};
    rf_array *o[12] = {0};
    if (run_prog("shapes", build_shapes, NULL, in, 3, o, 12)) {
        tp_expect("broadcast_in_dim [3]->[2,3]", o[0], RF_F32, DIMS(2, 3), 2,
                  (const double[]){1, 2, 3, 1, 2, 3}, 0, 0);
        tp_expect("broadcast_in_dim [3]->[3,2] map 0", o[1], RF_F32, DIMS(3, 2), 2,
                  (const double[]){1, 1, 2, 2, 3, 3}, 0, 0);
        tp_expect("broadcast_in_dim [1,3]->[2,2,3]", o[2], RF_F64, DIMS(2, 2, 3), 3,
                  (const double[]){10, 20, 30, 10, 20, 30, 10, 20, 30, 10, 20, 30}, 0, 0);
        tp_expect("broadcast_to", o[3], RF_F32, DIMS(2, 3), 2,
                  (const double[]){1, 2, 3, 1, 2, 3}, 0, 0);
        tp_expect("reshape [2,3]->[3,2]", o[4], RF_I32, DIMS(3, 2), 2,
                  (const double[]){0, 1, 2, 3, 4, 5}, 0, 0);
        tp_expect("reshape -1", o[5], RF_I32, DIMS(6), 1, (const double[]){0, 1, 2, 3, 4, 5}, 0,
                  0);
        tp_expect("reshape [3,-1]", o[6], RF_F32, DIMS(3, 1), 2, (const double[]){1, 2, 3}, 0,
                  0);
        tp_expect("squeeze", o[7], RF_F64, DIMS(3), 1, (const double[]){10, 20, 30}, 0, 0);
        tp_expect("unsqueeze 1", o[8], RF_F32, DIMS(3, 1), 2, (const double[]){1, 2, 3}, 0, 0);
        tp_expect("unsqueeze -1", o[9], RF_F32, DIMS(3, 1), 2, (const double[]){1, 2, 3}, 0, 0);
        tp_expect("flatten", o[10], RF_I32, DIMS(2, 3), 2, (const double[]){0, 1, 2, 3, 4, 5}, 0,
                  0);
        tp_expect("reshape to rank 0", o[11], RF_F32, NULL, 0, (const double[]){2}, 0, 0);
    }
    tp_free_all(o, 12);
    tp_free_all(in, 3);
}

static void build_transpose(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    rf_return(t, rf_transpose(a[0], DIMS(2, 0, 1)));
    rf_return(t, rf_transpose(a[0], DIMS(1, 0, 2)));
}

static void test_transpose(void)
{
    double x[24], w1[24], w2[24];
    for (int i = 0; i < 24; i++)
        x[i] = i;
    /* x [2,3,4]; perm (2,0,1) -> [4,2,3]; perm (1,0,2) -> [3,2,4] */
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 3; j++)
            for (int k = 0; k < 4; k++) {
                w1[(k * 2 + i) * 3 + j] = x[(i * 3 + j) * 4 + k];
                w2[(j * 2 + i) * 4 + k] = x[(i * 3 + j) * 4 + k];
            }
    const rf_dtype dts[3] = {RF_F32, RF_I64, RF_U8};
    for (int d = 0; d < 3; d++) {
        rf_array *in = tp_host(dts[d], DIMS(2, 3, 4), 3, x);
        rf_array *o[2] = {0};
        if (run_prog("transpose", build_transpose, NULL, &in, 1, o, 2)) {
            tp_expect("transpose (2,0,1)", o[0], dts[d], DIMS(4, 2, 3), 3, w1, 0, 0);
            tp_expect("transpose (1,0,2)", o[1], dts[d], DIMS(3, 2, 4), 3, w2, 0, 0);
        }
        tp_free_all(o, 2);
        rf_array_free(in);
    }
}

static void build_slice_etc(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    rf_tensor *x = a[0]; /* f32 [4,5] = 0..19 */
    rf_return(t, rf_slice(x, DIMS(1, 0), DIMS(4, 5), DIMS(2, 2)));
    rf_return(t, rf_slice(x, DIMS(0, 1), DIMS(2, 4), NULL));
    rf_return(t, rf_slice(x, DIMS(0, 4), DIMS(4, 5), DIMS(3, 1)));
    rf_tensor *parts[3] = {rf_slice(x, DIMS(0, 0), DIMS(2, 1), NULL),
                           rf_slice(x, DIMS(0, 1), DIMS(2, 4), NULL),
                           rf_slice(x, DIMS(2, 0), DIMS(4, 2), NULL)};
    rf_return(t, rf_concatenate(parts, 3, 1));
    rf_return(t, rf_concatenate(parts, 3, -1));
    rf_tensor *rows[2] = {rf_slice(x, DIMS(0, 0), DIMS(1, 5), NULL),
                          rf_slice(x, DIMS(3, 0), DIMS(4, 5), NULL)};
    rf_return(t, rf_concatenate(rows, 2, 0));
    rf_return(t, rf_reverse(x, DIMS(1), 1));
    rf_return(t, rf_reverse(x, DIMS(0, 1), 2));
    rf_return(t, rf_reverse(x, DIMS(-2), 1));
    /* a flat concatenation of vectors in an elementwise loop (an optimiser's
     * gradient vector): the compiled loop runs one piece per operand */
    rf_tensor *flat = rf_reshape(x, DIMS(20), 1);
    rf_tensor *pieces[4] = {rf_slice(flat, DIMS(15), DIMS(20), NULL),
                            rf_slice(flat, DIMS(0), DIMS(7), NULL),
                            rf_slice(flat, DIMS(7), DIMS(8), NULL),
                            rf_slice(flat, DIMS(8), DIMS(15), NULL)};
    rf_tensor *joined = rf_concatenate(pieces, 4, 0);
    rf_return(t, rf_add(rf_mul(joined, joined), flat));
}

static void test_slice_concat_reverse(void)
{
    double x[20];
    for (int i = 0; i < 20; i++)
        x[i] = i;
    rf_array *in = tp_host(RF_F32, DIMS(4, 5), 2, x);
    rf_array *o[10] = {0};
    double rev1[20], rev01[20], rev0[20], joined[20];
    for (int i = 0; i < 20; i++) {
        double v = i < 5 ? x[15 + i] : x[i - 5];
        joined[i] = v * v + x[i];
    }
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 5; j++) {
            rev1[i * 5 + j] = x[i * 5 + (4 - j)];
            rev01[i * 5 + j] = x[(3 - i) * 5 + (4 - j)];
            rev0[i * 5 + j] = x[(3 - i) * 5 + j];
        }
    if (run_prog("slice/concat/reverse", build_slice_etc, NULL, &in, 1, o, 10)) {
        tp_expect("slice strided", o[0], RF_F32, DIMS(2, 3), 2,
                  (const double[]){5, 7, 9, 15, 17, 19}, 0, 0);
        tp_expect("slice", o[1], RF_F32, DIMS(2, 3), 2, (const double[]){1, 2, 3, 6, 7, 8}, 0, 0);
        tp_expect("slice stride 3 odd", o[2], RF_F32, DIMS(2, 1), 2, (const double[]){4, 19}, 0,
                  0);
        const double cat[12] = {0, 1, 2, 3, 10, 11, 5, 6, 7, 8, 15, 16};
        tp_expect("concatenate axis 1", o[3], RF_F32, DIMS(2, 6), 2, cat, 0, 0);
        tp_expect("concatenate axis -1", o[4], RF_F32, DIMS(2, 6), 2, cat, 0, 0);
        tp_expect("concatenate axis 0", o[5], RF_F32, DIMS(2, 5), 2,
                  (const double[]){0, 1, 2, 3, 4, 15, 16, 17, 18, 19}, 0, 0);
        tp_expect("reverse axis 1", o[6], RF_F32, DIMS(4, 5), 2, rev1, 0, 0);
        tp_expect("reverse axes 0,1", o[7], RF_F32, DIMS(4, 5), 2, rev01, 0, 0);
        tp_expect("reverse axis -2", o[8], RF_F32, DIMS(4, 5), 2, rev0, 0, 0);
        tp_expect("flat concatenate", o[9], RF_F32, DIMS(20), 1, joined, 0, 0);
    }
    tp_free_all(o, 10);
    rf_array_free(in);
}

typedef struct pad_case {
    int64_t lo[2], hi[2], in[2];
} pad_case;

static void build_pad(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n;
    pad_case *p = u;
    rf_return(t, rf_pad(a[0], a[1], p->lo, p->hi, p->in));
}

/* Naive pad of a [r,c] matrix: output position o maps to input (o-lo)/(in+1)
 * when that is an exact, in-range multiple; otherwise it is padding. */
static void naive_pad(const double *x, const int64_t xd[2], double pv, const pad_case *p,
                      double *out, int64_t od[2])
{
    for (int k = 0; k < 2; k++)
        od[k] = p->lo[k] + p->hi[k] + xd[k] + (xd[k] - 1) * p->in[k];
    for (int64_t i = 0; i < od[0]; i++)
        for (int64_t j = 0; j < od[1]; j++) {
            int64_t pi = i - p->lo[0], pj = j - p->lo[1];
            double v = pv;
            if (pi >= 0 && pj >= 0 && pi % (p->in[0] + 1) == 0 && pj % (p->in[1] + 1) == 0 &&
                pi / (p->in[0] + 1) < xd[0] && pj / (p->in[1] + 1) < xd[1])
                v = x[pi / (p->in[0] + 1) * xd[1] + pj / (p->in[1] + 1)];
            out[i * od[1] + j] = v;
        }
}

static void test_pad(void)
{
    const pad_case cases[] = {
        {{1, 2}, {0, 1}, {0, 0}},
        {{1, -1}, {0, 2}, {1, 0}},
        {{-1, 0}, {-1, -2}, {0, 2}},
        {{0, 3}, {2, -3}, {2, 1}},
    };
    const double x[6] = {1, 2, 3, 4, 5, 6};
    const rf_dtype dts[3] = {RF_F32, RF_F64, RF_I32};
    for (int d = 0; d < 3; d++)
        for (int c = 0; c < N_OF(cases); c++) {
            double want[128];
            int64_t od[2];
            naive_pad(x, DIMS(2, 3), 9, &cases[c], want, od);
            rf_array *in[2] = {tp_host(dts[d], DIMS(2, 3), 2, x),
                               tp_host(dts[d], NULL, 0, (const double[]){9})};
            rf_array *o = NULL;
            char label[64];
            snprintf(label, sizeof label, "pad case %d %s", c, rf_dtype_name(dts[d]));
            if (run_prog(label, build_pad, (void *)&cases[c], in, 2, &o, 1))
                tp_expect(label, o, dts[d], od, 2, want, 0, 0);
            rf_array_free(o);
            tp_free_all(in, 2);
        }
}

/* ---- Reductions ---------------------------------------------------------------------- */

typedef struct reduce_box {
    rf_reduce_kind kind;
    int64_t axes[3];
    int naxes;
    bool keepdims;
} reduce_box;

static void build_reduce(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n;
    reduce_box *r = u;
    rf_return(t, rf_reduce(a[0], r->kind, r->naxes ? r->axes : NULL, r->naxes, r->keepdims));
}

/* Naive reduction of x [2,3,4] over the axes in mask (bit k = axis k). */
static void naive_reduce(const double *x, rf_reduce_kind kind, unsigned mask, rf_dtype dt,
                         double *out, int64_t *od, int *orank, bool keepdims)
{
    const int64_t xd[3] = {2, 3, 4};
    int r = 0;
    for (int k = 0; k < 3; k++) {
        if (!(mask >> k & 1u))
            od[r++] = xd[k];
        else if (keepdims)
            od[r++] = 1;
    }
    *orank = r;
    double init = kind == RF_REDUCE_SUM ? 0 : kind == RF_REDUCE_PROD ? 1
                : kind == RF_REDUCE_MAX ? -INFINITY : kind == RF_REDUCE_MIN ? INFINITY
                : kind == RF_REDUCE_AND ? 1 : 0;
    int64_t on = 1;
    for (int k = 0; k < 3; k++)
        on *= mask >> k & 1u ? 1 : xd[k];
    for (int64_t i = 0; i < on; i++)
        out[i] = init;
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 3; j++)
            for (int k = 0; k < 4; k++) {
                int64_t c[3] = {i, j, k}, o = 0;
                for (int q = 0; q < 3; q++)
                    if (!(mask >> q & 1u))
                        o = o * xd[q] + c[q];
                double v = x[(i * 3 + j) * 4 + k], *acc = &out[o];
                switch (kind) {
                case RF_REDUCE_SUM: *acc += v; break;
                case RF_REDUCE_PROD: *acc *= v; break;
                case RF_REDUCE_MAX: *acc = v > *acc ? v : *acc; break;
                case RF_REDUCE_MIN: *acc = v < *acc ? v : *acc; break;
                case RF_REDUCE_AND: *acc = *acc && v; break;
                case RF_REDUCE_OR: *acc = *acc || v; break;
                default: break;
                }
            }
    for (int64_t i = 0; i < on; i++)
        out[i] = as_dtype(dt, out[i]);
}

static void test_reduce(void)
{
    static const char *const kn[] = {"sum", "max", "min", "prod", "and", "or"};
    const struct {
        int64_t axes[3];
        int naxes;
        unsigned mask;
        bool keepdims;
    } ax[] = {
        {{1}, 1, 2u, false},  {{0, 2}, 2, 5u, false}, {{0}, 0, 7u, false},
        {{-1}, 1, 4u, true},  {{0, 1, 2}, 3, 7u, true}, {{2, 0}, 2, 5u, true},
    };
    uint64_t rng = 99;
    double xf[24], xi[24], xb[24];
    for (int i = 0; i < 24; i++) {
        xf[i] = tp_rand(&rng, 0.5, 1.5) * (i % 3 == 0 ? -1 : 1);
        xi[i] = floor(tp_rand(&rng, -2, 3)); /* products fit i32 */
        xb[i] = tp_rand(&rng, 0, 1) < 0.7;
    }
    for (int kind = 0; kind < RF_REDUCE_KIND_COUNT; kind++) {
        const rf_dtype float_set[4] = {RF_F32, RF_F64, RF_I32, RF_I64};
        const rf_dtype logic_set[3] = {RF_BOOL, RF_BOOL, RF_BOOL};
        bool logic = kind == RF_REDUCE_AND || kind == RF_REDUCE_OR;
        const rf_dtype *dts = logic ? logic_set : float_set;
        int ndt = logic ? 1 : 4;
        for (int d = 0; d < ndt; d++)
            for (int a = 0; a < N_OF(ax); a++) {
                rf_dtype dt = dts[d];
                const double *x = logic ? xb : is_float(dt) ? xf : xi;
                double want[24];
                int64_t od[3];
                int orank;
                naive_reduce(x, (rf_reduce_kind)kind, ax[a].mask, dt, want, od, &orank,
                             ax[a].keepdims);
                reduce_box box = {(rf_reduce_kind)kind, {ax[a].axes[0], ax[a].axes[1],
                                  ax[a].axes[2]}, ax[a].naxes, ax[a].keepdims};
                rf_array *in = tp_host(dt, DIMS(2, 3, 4), 3, x);
                rf_array *o = NULL;
                char label[80];
                snprintf(label, sizeof label, "reduce %s %s axes case %d%s", kn[kind],
                         rf_dtype_name(dt), a, ax[a].keepdims ? " keepdims" : "");
                if (run_prog(label, build_reduce, &box, &in, 1, &o, 1))
                    tp_expect(label, o, dt, od, orank, want, 4 * tol_of(dt), 4 * tol_of(dt));
                rf_array_free(o);
                rf_array_free(in);
            }
    }
}

static void build_stats(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    rf_return(t, rf_sum(a[0], DIMS(0), 1, false));
    rf_return(t, rf_reduce_max(a[0], DIMS(1), 1, true));
    rf_return(t, rf_mean(a[0], DIMS(1), 1, false));
    rf_return(t, rf_var(a[0], DIMS(1), 1, false));
    rf_return(t, rf_sum_all(a[0]));
    rf_return(t, rf_mean_all(a[0]));
    rf_return(t, rf_reduce(a[1], RF_REDUCE_MAX, DIMS(0), 1, false)); /* i32: identity INT_MIN */
    rf_return(t, rf_mean(a[0], DIMS(0, 1), 2, true));
}

static void test_reduce_stats(void)
{
    const double x[6] = {1, 2, 6, -1, 0, 4};
    rf_array *in[2] = {tp_host(RF_F64, DIMS(2, 3), 2, x),
                       tp_host(RF_I32, DIMS(2, 2), 2, (const double[]){-2000000000, -5, -3, -7})};
    rf_array *o[8] = {0};
    if (run_prog("stats", build_stats, NULL, in, 2, o, 8)) {
        tp_expect("sum axis 0", o[0], RF_F64, DIMS(3), 1, (const double[]){0, 2, 10}, 0, 1e-15);
        tp_expect("reduce_max keepdims", o[1], RF_F64, DIMS(2, 1), 2, (const double[]){6, 4}, 0,
                  0);
        tp_expect("mean", o[2], RF_F64, DIMS(2), 1, (const double[]){3, 1}, 0, 1e-15);
        /* biased variance: row 0 (1,2,6) mean 3 -> (4+1+9)/3; row 1 (-1,0,4) mean 1 -> (4+1+9)/3 */
        tp_expect("var", o[3], RF_F64, DIMS(2), 1, (const double[]){14.0 / 3, 14.0 / 3}, 0,
                  1e-14);
        tp_expect("sum_all", o[4], RF_F64, NULL, 0, (const double[]){12}, 0, 1e-15);
        tp_expect("mean_all", o[5], RF_F64, NULL, 0, (const double[]){2}, 0, 1e-15);
        tp_expect("reduce max i32 negative", o[6], RF_I32, DIMS(2), 1, (const double[]){-3, -5},
                  0, 0);
        tp_expect("mean over both, keepdims", o[7], RF_F64, DIMS(1, 1), 2, (const double[]){2}, 0,
                  1e-15);
    }
    tp_free_all(o, 8);
    tp_free_all(in, 2);
}

static void build_arg(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    rf_return(t, rf_argmax(a[0], 1));
    rf_return(t, rf_argmin(a[0], 1));
    rf_return(t, rf_argmax(a[0], 0));
    rf_return(t, rf_argmin(a[0], -2));
    rf_return(t, rf_argmax(a[1], 0));
    rf_return(t, rf_argmax(a[2], -1));
    rf_return(t, rf_argmin(a[2], 0));
    rf_return(t, rf_argmin(a[1], 0));
}

static void test_argmax(void)
{
    const rf_dtype dts[4] = {RF_F32, RF_F64, RF_I32, RF_U8};
    for (int d = 0; d < 4; d++) {
        /* ties: row 0 max at 1 and 2, min 0 at 3; row 1 max 2 at 0,1, min at 2,3 */
        const double x[8] = {1, 3, 3, 0, 2, 2, 1, 1};
        rf_array *in[3] = {tp_host(dts[d], DIMS(2, 4), 2, x),
                           tp_host(RF_F32, DIMS(4), 1, (const double[]){1, NAN, 5, NAN}),
                           tp_host(RF_I64, DIMS(3, 2), 2, (const double[]){4, -4, 4, 9, 4, 9})};
        rf_array *o[8] = {0};
        char label[64];
        snprintf(label, sizeof label, "argmax/argmin %s", rf_dtype_name(dts[d]));
        if (run_prog(label, build_arg, NULL, in, 3, o, 8)) {
            tp_expect("argmax axis 1 (ties: first)", o[0], RF_I64, DIMS(2), 1,
                      (const double[]){1, 0}, 0, 0);
            tp_expect("argmin axis 1 (ties: first)", o[1], RF_I64, DIMS(2), 1,
                      (const double[]){3, 2}, 0, 0);
            tp_expect("argmax axis 0", o[2], RF_I64, DIMS(4), 1, (const double[]){1, 0, 0, 1}, 0,
                      0);
            tp_expect("argmin axis -2", o[3], RF_I64, DIMS(4), 1, (const double[]){0, 1, 1, 0}, 0,
                      0);
            tp_expect("argmax NaN counts as max (first NaN)", o[4], RF_I64, NULL, 0,
                      (const double[]){1}, 0, 0);
            tp_expect("argmax i64 [3,2] axis -1", o[5], RF_I64, DIMS(3), 1,
                      (const double[]){0, 1, 1}, 0, 0);
            tp_expect("argmin i64 axis 0 all tied", o[6], RF_I64, DIMS(2), 1,
                      (const double[]){0, 0}, 0, 0);
            tp_expect("argmin NaN counts as min too (first NaN, NumPy)", o[7], RF_I64, NULL, 0,
                      (const double[]){1}, 0, 0);
        }
        tp_free_all(o, 8);
        tp_free_all(in, 3);
    }
}

/* ---- Linear algebra -------------------------------------------------------------------- */

static void build_dots(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    /* a [2,3,4], b [2,4,5]: batch 0/0, contract 2/1 -> [2,3,5] */
    rf_return(t, rf_dot_general(a[0], a[1], DIMS(0), DIMS(0), 1, DIMS(2), DIMS(1), 1));
    /* c [4,3], d [4,2]: contract 0/0 -> [3,2] */
    rf_return(t, rf_dot_general(a[2], a[3], NULL, NULL, 0, DIMS(0), DIMS(0), 1));
    /* a [2,3,4] with c^T: contract a dim 2 with c dim 0 -> [2,3,3] (free dims only) */
    rf_return(t, rf_dot_general(a[0], a[2], NULL, NULL, 0, DIMS(2), DIMS(0), 1));
    /* b [2,4,5] with a [2,3,4]: batch 0/0, contract 1/2 -> [2,5,3] */
    rf_return(t, rf_dot_general(a[1], a[0], DIMS(0), DIMS(0), 1, DIMS(1), DIMS(2), 1));
    /* outer product: no contraction: c [4,3] x d[4,2] batch 0/0 -> [4,3,2] */
    rf_return(t, rf_dot_general(a[2], a[3], DIMS(0), DIMS(0), 1, NULL, NULL, 0));
}

static void test_dot_general(void)
{
    uint64_t rng = 7;
    double a[24], b[40], c[12], d[8];
    for (int i = 0; i < 24; i++) a[i] = tp_rand(&rng, -2, 2);
    for (int i = 0; i < 40; i++) b[i] = tp_rand(&rng, -2, 2);
    for (int i = 0; i < 12; i++) c[i] = tp_rand(&rng, -2, 2);
    for (int i = 0; i < 8; i++) d[i] = tp_rand(&rng, -2, 2);
    const rf_dtype dts[3] = {RF_F32, RF_F64, RF_I32};
    for (int q = 0; q < 3; q++) {
        rf_dtype dt = dts[q];
        double A[24], B[40], C[12], D[8];
        for (int i = 0; i < 24; i++) A[i] = as_dtype(dt, is_float(dt) ? a[i] : round(a[i] * 3));
        for (int i = 0; i < 40; i++) B[i] = as_dtype(dt, is_float(dt) ? b[i] : round(b[i] * 3));
        for (int i = 0; i < 12; i++) C[i] = as_dtype(dt, is_float(dt) ? c[i] : round(c[i] * 3));
        for (int i = 0; i < 8; i++) D[i] = as_dtype(dt, is_float(dt) ? d[i] : round(d[i] * 3));
        double w0[30] = {0}, w1[6] = {0}, w2[18] = {0}, w3[30] = {0}, w4[24] = {0};
        for (int bb = 0; bb < 2; bb++)
            for (int i = 0; i < 3; i++)
                for (int j = 0; j < 5; j++)
                    for (int k = 0; k < 4; k++) {
                        double ab = A[(bb * 3 + i) * 4 + k] * B[(bb * 4 + k) * 5 + j];
                        w0[(bb * 3 + i) * 5 + j] += ab;
                        w3[(bb * 5 + j) * 3 + i] += ab;
                    }
        for (int i = 0; i < 3; i++)
            for (int j = 0; j < 2; j++)
                for (int k = 0; k < 4; k++)
                    w1[i * 2 + j] += C[k * 3 + i] * D[k * 2 + j];
        for (int bb = 0; bb < 2; bb++)
            for (int i = 0; i < 3; i++)
                for (int j = 0; j < 3; j++)
                    for (int k = 0; k < 4; k++)
                        w2[(bb * 3 + i) * 3 + j] += A[(bb * 3 + i) * 4 + k] * C[k * 3 + j];
        for (int k = 0; k < 4; k++)
            for (int i = 0; i < 3; i++)
                for (int j = 0; j < 2; j++)
                    w4[(k * 3 + i) * 2 + j] = C[k * 3 + i] * D[k * 2 + j];
        rf_array *in[4] = {tp_host(dt, DIMS(2, 3, 4), 3, A), tp_host(dt, DIMS(2, 4, 5), 3, B),
                           tp_host(dt, DIMS(4, 3), 2, C), tp_host(dt, DIMS(4, 2), 2, D)};
        rf_array *o[5] = {0};
        double tol = 4 * tol_of(dt);
        char label[64];
        snprintf(label, sizeof label, "dot_general %s", rf_dtype_name(dt));
        if (run_prog(label, build_dots, NULL, in, 4, o, 5)) {
            tp_expect("dot_general batch+contract", o[0], dt, DIMS(2, 3, 5), 3, w0, tol, tol);
            tp_expect("dot_general contract dim 0", o[1], dt, DIMS(3, 2), 2, w1, tol, tol);
            tp_expect("dot_general rank3 x rank2", o[2], dt, DIMS(2, 3, 3), 3, w2, tol, tol);
            tp_expect("dot_general swapped", o[3], dt, DIMS(2, 5, 3), 3, w3, tol, tol);
            tp_expect("dot_general batch only", o[4], dt, DIMS(4, 3, 2), 3, w4, tol, tol);
        }
        tp_free_all(o, 5);
        tp_free_all(in, 4);
    }
}

static void build_matmul(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    rf_return(t, rf_matmul(a[0], a[1]));  /* [2,3] @ [3,4] */
    rf_return(t, rf_matmul(a[2], a[1]));  /* [3] @ [3,4] -> [4] */
    rf_return(t, rf_matmul(a[0], a[2]));  /* [2,3] @ [3] -> [2] */
    rf_return(t, rf_matmul(a[2], a[2]));  /* [3] @ [3] -> [] */
    rf_return(t, rf_matmul(a[3], a[4]));  /* [2,1,2,3] @ [3,3,2] -> [2,3,2,2] */
    rf_return(t, rf_linear(a[0], a[5], a[6]));  /* [2,3] w [4,3] b [4] */
    rf_return(t, rf_linear(a[0], a[5], NULL));
}

static void test_matmul(void)
{
    uint64_t rng = 3;
    double A[6], B[12], v[3], P[12], Q[18], W[12], bias[4];
    for (int i = 0; i < 6; i++) A[i] = tp_rand(&rng, -2, 2);
    for (int i = 0; i < 12; i++) B[i] = tp_rand(&rng, -2, 2);
    for (int i = 0; i < 3; i++) v[i] = tp_rand(&rng, -2, 2);
    for (int i = 0; i < 12; i++) P[i] = tp_rand(&rng, -2, 2);
    for (int i = 0; i < 18; i++) Q[i] = tp_rand(&rng, -2, 2);
    for (int i = 0; i < 12; i++) W[i] = tp_rand(&rng, -2, 2);
    for (int i = 0; i < 4; i++) bias[i] = tp_rand(&rng, -2, 2);
    double w0[8] = {0}, w1[4] = {0}, w2[2] = {0}, w3 = 0, w4[24] = {0}, w5[8], w6[8] = {0};
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++)
            for (int k = 0; k < 3; k++)
                w0[i * 4 + j] += A[i * 3 + k] * B[k * 4 + j];
    for (int j = 0; j < 4; j++)
        for (int k = 0; k < 3; k++)
            w1[j] += v[k] * B[k * 4 + j];
    for (int i = 0; i < 2; i++)
        for (int k = 0; k < 3; k++)
            w2[i] += A[i * 3 + k] * v[k];
    for (int k = 0; k < 3; k++)
        w3 += v[k] * v[k];
    /* P [2,1,2,3] (batch p), Q [3,3,2] (batch q): out [p, q, 2, 2] */
    for (int p = 0; p < 2; p++)
        for (int q = 0; q < 3; q++)
            for (int i = 0; i < 2; i++)
                for (int j = 0; j < 2; j++)
                    for (int k = 0; k < 3; k++)
                        w4[((p * 3 + q) * 2 + i) * 2 + j] +=
                            P[(p * 2 + i) * 3 + k] * Q[(q * 3 + k) * 2 + j];
    for (int i = 0; i < 2; i++)
        for (int o = 0; o < 4; o++)
            for (int k = 0; k < 3; k++)
                w6[i * 4 + o] += A[i * 3 + k] * W[o * 3 + k];
    for (int i = 0; i < 8; i++)
        w5[i] = w6[i] + bias[i % 4];
    rf_array *in[7] = {tp_host(RF_F64, DIMS(2, 3), 2, A),
                       tp_host(RF_F64, DIMS(3, 4), 2, B),
                       tp_host(RF_F64, DIMS(3), 1, v),
                       tp_host(RF_F64, DIMS(2, 1, 2, 3), 4, P),
                       tp_host(RF_F64, DIMS(3, 3, 2), 3, Q),
                       tp_host(RF_F64, DIMS(4, 3), 2, W),
                       tp_host(RF_F64, DIMS(4), 1, bias)};
    rf_array *o[7] = {0};
    if (run_prog("matmul", build_matmul, NULL, in, 7, o, 7)) {
        tp_expect("matmul 2-D", o[0], RF_F64, DIMS(2, 4), 2, w0, 1e-12, 1e-12);
        tp_expect("matmul 1-D @ 2-D", o[1], RF_F64, DIMS(4), 1, w1, 1e-12, 1e-12);
        tp_expect("matmul 2-D @ 1-D", o[2], RF_F64, DIMS(2), 1, w2, 1e-12, 1e-12);
        tp_expect("matmul 1-D @ 1-D", o[3], RF_F64, NULL, 0, &w3, 1e-12, 1e-12);
        tp_expect("matmul batch broadcast", o[4], RF_F64, DIMS(2, 3, 2, 2), 4, w4, 1e-12, 1e-12);
        tp_expect("linear with bias", o[5], RF_F64, DIMS(2, 4), 2, w5, 1e-12, 1e-12);
        tp_expect("linear without bias", o[6], RF_F64, DIMS(2, 4), 2, w6, 1e-12, 1e-12);
    }
    tp_free_all(o, 7);
    tp_free_all(in, 7);
}

/* ---- Convolution ----------------------------------------------------------------------- */

/* Naive convolution on x [N,C,H,W], w [O,C/fg,KH,KW] with per-dimension
 * stride, padding and dilations, feature groups and batch groups. */
typedef struct conv_ref {
    int64_t stride[2], lo[2], hi[2], ld[2], rd[2], fg, bg;
} conv_ref;

static void naive_conv(const double *x, const int64_t xd[4], const double *w, const int64_t wd[4],
                       const conv_ref *p, double *out, int64_t od[4])
{
    int64_t N = xd[0], C = xd[1], O = wd[0], Cg = wd[1];
    int64_t fg = p->fg, bg = p->bg;
    od[0] = N / bg;
    od[1] = O;
    for (int k = 0; k < 2; k++) {
        int64_t in_dil = (xd[2 + k] - 1) * p->ld[k] + 1;
        int64_t k_dil = (wd[2 + k] - 1) * p->rd[k] + 1;
        od[2 + k] = (in_dil + p->lo[k] + p->hi[k] - k_dil) / p->stride[k] + 1;
    }
    (void)C;
    for (int64_t n = 0; n < od[0]; n++)
        for (int64_t o = 0; o < O; o++)
            for (int64_t oy = 0; oy < od[2]; oy++)
                for (int64_t ox = 0; ox < od[3]; ox++) {
                    int64_t g = o / (O / fg), b = o / (O / bg), nb = b * (N / bg) + n;
                    double s = 0;
                    for (int64_t c = 0; c < Cg; c++)
                        for (int64_t ky = 0; ky < wd[2]; ky++)
                            for (int64_t kx = 0; kx < wd[3]; kx++) {
                                int64_t py = oy * p->stride[0] + ky * p->rd[0] - p->lo[0];
                                int64_t px = ox * p->stride[1] + kx * p->rd[1] - p->lo[1];
                                if (py < 0 || px < 0 || py % p->ld[0] || px % p->ld[1])
                                    continue;
                                int64_t iy = py / p->ld[0], ix = px / p->ld[1];
                                if (iy >= xd[2] || ix >= xd[3])
                                    continue;
                                s += x[((nb * C + g * Cg + c) * xd[2] + iy) * xd[3] + ix] *
                                     w[((o * Cg + c) * wd[2] + ky) * wd[3] + kx];
                            }
                    out[((n * O + o) * od[2] + oy) * od[3] + ox] = s;
                }
}

typedef struct conv_case {
    const char *name;
    int nsp;
    int64_t xd[4], wd[4];
    rf_conv_params p;
} conv_case;

static void build_conv(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n;
    rf_return(t, rf_conv(a[0], a[1], &((conv_case *)u)->p));
}

static conv_case make_conv(const char *name, int nsp, const int64_t *xd, const int64_t *wd,
                           const int64_t *stride, const int64_t *lo, const int64_t *hi,
                           const int64_t *ld, const int64_t *rd, int64_t fg, int64_t bg)
{
    conv_case c;
    memset(&c, 0, sizeof c);
    c.name = name;
    c.nsp = nsp;
    memcpy(c.xd, xd, sizeof(int64_t) * (size_t)(2 + nsp));
    memcpy(c.wd, wd, sizeof(int64_t) * (size_t)(2 + nsp));
    c.p = rf_conv_params_default(nsp);
    for (int k = 0; k < nsp; k++) {
        if (stride) c.p.stride[k] = stride[k];
        if (lo) c.p.pad_lo[k] = lo[k];
        if (hi) c.p.pad_hi[k] = hi[k];
        if (ld) c.p.lhs_dilation[k] = ld[k];
        if (rd) c.p.rhs_dilation[k] = rd[k];
    }
    c.p.feature_group_count = fg;
    c.p.batch_group_count = bg;
    return c;
}

/* The naive reference for a case (1-D runs as 2-D with a unit leading spatial dim). */
static void conv_case_ref(const conv_case *c, const double *x, const double *w, double *out,
                          int64_t *od_out, int *orank)
{
    int64_t xd[4], wd[4], od[4];
    conv_ref r = {{1, 1}, {0, 0}, {0, 0}, {1, 1}, {1, 1}, 1, 1};
    int off = 2 - c->nsp; /* 1-D: spatial dim 0 is the dummy */
    xd[0] = c->xd[0], xd[1] = c->xd[1], wd[0] = c->wd[0], wd[1] = c->wd[1];
    xd[2] = wd[2] = 1;
    for (int k = 0; k < c->nsp; k++) {
        xd[2 + off + k] = c->xd[2 + k];
        wd[2 + off + k] = c->wd[2 + k];
        r.stride[off + k] = c->p.stride[k];
        r.lo[off + k] = c->p.pad_lo[k];
        r.hi[off + k] = c->p.pad_hi[k];
        r.ld[off + k] = c->p.lhs_dilation[k];
        r.rd[off + k] = c->p.rhs_dilation[k];
    }
    r.fg = c->p.feature_group_count > 1 ? c->p.feature_group_count : 1;
    r.bg = c->p.batch_group_count > 1 ? c->p.batch_group_count : 1;
    naive_conv(x, xd, w, wd, &r, out, od);
    od_out[0] = od[0], od_out[1] = od[1];
    for (int k = 0; k < c->nsp; k++)
        od_out[2 + k] = od[2 + off + k];
    *orank = 2 + c->nsp;
}

static void test_conv(void)
{
    conv_case cases[] = {
        make_conv("2-D plain", 2, DIMS(1, 1, 4, 4), DIMS(1, 1, 3, 3), NULL, NULL, NULL, NULL,
                  NULL, 1, 1),
        make_conv("2-D stride 2 asym pad, non-divisible", 2, DIMS(2, 3, 5, 6), DIMS(4, 3, 3, 2),
                  DIMS(2, 2), DIMS(1, 0), DIMS(1, 1), NULL, NULL, 1, 1),
        make_conv("2-D rhs dilation", 2, DIMS(1, 2, 5, 5), DIMS(3, 2, 2, 2), NULL, DIMS(1, 1),
                  DIMS(1, 1), NULL, DIMS(2, 2), 1, 1),
        make_conv("2-D lhs dilation (transposed)", 2, DIMS(1, 2, 3, 4), DIMS(2, 2, 3, 3), NULL,
                  DIMS(2, 2), DIMS(2, 1), DIMS(2, 2), NULL, 0, 0),
        make_conv("2-D feature groups 2", 2, DIMS(2, 4, 4, 4), DIMS(6, 2, 3, 3), NULL, DIMS(1, 1),
                  DIMS(1, 1), NULL, NULL, 2, 1),
        make_conv("2-D batch groups 2", 2, DIMS(4, 2, 3, 3), DIMS(4, 2, 2, 2), NULL, NULL, NULL,
                  NULL, NULL, 1, 2),
        make_conv("2-D depthwise (groups = C)", 2, DIMS(1, 3, 4, 3), DIMS(3, 1, 2, 2),
                  DIMS(1, 2), DIMS(0, 1), DIMS(1, 0), NULL, NULL, 3, 1),
        make_conv("1-D stride 2 pad rhs dil 2", 1, DIMS(2, 3, 7), DIMS(2, 3, 3), DIMS(2),
                  DIMS(2), DIMS(1), NULL, DIMS(2), 1, 1),
        make_conv("1-D groups 2 lhs dil 2", 1, DIMS(1, 2, 5), DIMS(2, 1, 2), NULL, DIMS(1),
                  DIMS(1), DIMS(2), NULL, 2, 1),
        make_conv("1-D negative pad", 1, DIMS(1, 1, 6), DIMS(1, 1, 2), DIMS(1), DIMS(-1),
                  DIMS(-1), NULL, NULL, 1, 1),
    };
    uint64_t rng = 2024;
    for (int c = 0; c < N_OF(cases); c++) {
        for (int d = 0; d < 2; d++) {
            rf_dtype dt = d ? RF_F64 : RF_F32;
            conv_case *cc = &cases[c];
            int64_t nx = tp_numel(cc->xd, 2 + cc->nsp), nw = tp_numel(cc->wd, 2 + cc->nsp);
            double x[512], w[256], want[1024];
            for (int64_t i = 0; i < nx; i++) x[i] = as_dtype(dt, tp_rand(&rng, -1, 1));
            for (int64_t i = 0; i < nw; i++) w[i] = as_dtype(dt, tp_rand(&rng, -1, 1));
            int64_t od[4];
            int orank;
            conv_case_ref(cc, x, w, want, od, &orank);
            rf_array *in[2] = {tp_host(dt, cc->xd, 2 + cc->nsp, x),
                               tp_host(dt, cc->wd, 2 + cc->nsp, w)};
            rf_array *o = NULL;
            char label[96];
            snprintf(label, sizeof label, "conv %s %s", cc->name, rf_dtype_name(dt));
            if (run_prog(label, build_conv, cc, in, 2, &o, 1))
                tp_expect(label, o, dt, od, orank, want, 8 * tol_of(dt), 8 * tol_of(dt));
            rf_array_free(o);
            tp_free_all(in, 2);
        }
    }
    /* A hand-computed case: x = 1..9 as [1,1,3,3], w = all ones [1,1,2,2]. */
    conv_case h = make_conv("hand", 2, DIMS(1, 1, 3, 3), DIMS(1, 1, 2, 2), NULL, NULL, NULL, NULL,
                            NULL, 1, 1);
    rf_array *in[2] = {tp_host(RF_F32, DIMS(1, 1, 3, 3), 4,
                               (const double[]){1, 2, 3, 4, 5, 6, 7, 8, 9}),
                       tp_host(RF_F32, DIMS(1, 1, 2, 2), 4, (const double[]){1, 1, 1, 1})};
    rf_array *o = NULL;
    if (run_prog("conv hand", build_conv, &h, in, 2, &o, 1))
        tp_expect("conv hand", o, RF_F32, DIMS(1, 1, 2, 2), 4, (const double[]){12, 16, 24, 28},
                  0, 0);
    rf_array_free(o);
    tp_free_all(in, 2);
}

/* ---- Windows and pooling --------------------------------------------------------------- */

typedef struct window_case {
    int rank;
    int64_t xd[4], win[4], str[4], lo[4], hi[4];
} window_case;

static void unravel(int64_t f, const int64_t *d, int rank, int64_t *idx)
{
    for (int k = rank - 1; k >= 0; k--) {
        idx[k] = f % d[k];
        f /= d[k];
    }
}

static void window_out_dims(const window_case *w, int64_t *od)
{
    for (int k = 0; k < w->rank; k++)
        od[k] = (w->xd[k] + w->lo[k] + w->hi[k] - w->win[k]) / w->str[k] + 1;
}

/* Naive reduce_window; kind SUM, PROD, MAX or MIN; padding is the identity. */
static void naive_reduce_window(const window_case *w, rf_reduce_kind kind, const double *x,
                                double *out)
{
    int64_t od[4], no, nw, oi[4], wi[4];
    window_out_dims(w, od);
    no = tp_numel(od, w->rank);
    nw = tp_numel(w->win, w->rank);
    for (int64_t o = 0; o < no; o++) {
        unravel(o, od, w->rank, oi);
        double acc = kind == RF_REDUCE_SUM ? 0 : kind == RF_REDUCE_PROD ? 1
                   : kind == RF_REDUCE_MAX ? -INFINITY : INFINITY;
        for (int64_t q = 0; q < nw; q++) {
            unravel(q, w->win, w->rank, wi);
            int64_t flat = 0;
            bool inside = true;
            for (int k = 0; k < w->rank; k++) {
                int64_t p = oi[k] * w->str[k] + wi[k] - w->lo[k];
                if (p < 0 || p >= w->xd[k])
                    inside = false;
                flat = flat * w->xd[k] + p;
            }
            if (!inside)
                continue;
            double v = x[flat];
            if (kind == RF_REDUCE_SUM) acc += v;
            else if (kind == RF_REDUCE_PROD) acc *= v;
            else if (isnan(v) || isnan(acc)) acc = NAN; /* max and min propagate NaN */
            else if (kind == RF_REDUCE_MAX) acc = v > acc ? v : acc;
            else acc = v < acc ? v : acc;
        }
        out[o] = acc;
    }
}

/* Whether a ranks above b in select_and_scatter's choice: NaN above every number. */
static bool ranks_above(double a, double b)
{
    return isnan(a) ? !isnan(b) : !isnan(b) && a > b;
}

/* Naive select_and_scatter: first max in window order (NaN the largest), padding never
 * selected. */
static void naive_select_scatter(const window_case *w, const double *x, const double *src,
                                 double *out)
{
    int64_t od[4], oi[4], wi[4];
    window_out_dims(w, od);
    int64_t no = tp_numel(od, w->rank), nw = tp_numel(w->win, w->rank);
    for (int64_t i = 0; i < tp_numel(w->xd, w->rank); i++)
        out[i] = 0;
    for (int64_t o = 0; o < no; o++) {
        unravel(o, od, w->rank, oi);
        int64_t best = -1;
        for (int64_t q = 0; q < nw; q++) {
            unravel(q, w->win, w->rank, wi);
            int64_t flat = 0;
            bool inside = true;
            for (int k = 0; k < w->rank; k++) {
                int64_t p = oi[k] * w->str[k] + wi[k] - w->lo[k];
                if (p < 0 || p >= w->xd[k])
                    inside = false;
                flat = flat * w->xd[k] + p;
            }
            if (inside && (best < 0 || ranks_above(x[flat], x[best])))
                best = flat;
        }
        if (best >= 0)
            out[best] += src[o];
    }
}

typedef struct window_box {
    const window_case *w;
    rf_reduce_kind kind;
} window_box;

static void build_reduce_window(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n;
    window_box *b = u;
    rf_return(t, rf_reduce_window(a[0], b->kind, b->w->win, b->w->str, b->w->lo, b->w->hi));
}

static void build_select_scatter(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n;
    window_box *b = u;
    rf_return(t, rf_select_and_scatter(a[0], a[1], b->w->win, b->w->str, b->w->lo, b->w->hi));
}

static const window_case WINDOW_CASES[] = {
    {4, {1, 1, 4, 5}, {1, 1, 2, 3}, {1, 1, 2, 2}, {0, 0, 1, 0}, {0, 0, 0, 1}},
    {4, {2, 2, 5, 5}, {1, 1, 3, 3}, {1, 1, 2, 2}, {0, 0, 1, 1}, {0, 0, 1, 1}},
    {2, {3, 7}, {2, 2}, {1, 3}, {0, 0}, {0, 0}},
    {1, {7}, {3}, {2}, {2, 0}, {1, 0}},
    {4, {1, 2, 4, 4}, {1, 1, 2, 2}, {1, 1, 1, 1}, {0, 0, 0, 0}, {0, 0, 0, 0}},
    /* padded more than a window on every dim: edge pieces on each side of every
     * dim, whose clamped loads gcc 12 miscompiled as AVX2 gathers (cc.c: no gathers) */
    {3, {2, 3, 4}, {2, 2, 3}, {1, 1, 1}, {2, 0, 2}, {5, 5, 5}},
};

/* max(v, -0) of a convolution's or a product's result keeps -0 where v <= 0 (of equal
 * operands max gives the second); only max(v, +0) is the library calls' relu, which
 * writes +0 there. */
static void build_relu_signs(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n;
    rf_conv_params p = rf_conv_params_default(2);
    double zero = *(const double *)u;
    rf_return(t, rf_max(rf_conv(a[0], a[1], &p), rf_scalar(t, zero)));
    rf_return(t, rf_max(rf_matmul(a[2], a[3]), rf_scalar(t, zero)));
}

static void test_relu_zero_signs(void)
{
    const double x[4] = {-1, 2, -0.5, 3}, one[1] = {1};
    const double eye[16] = {1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1};
    rf_array *in[4] = {tp_dev(RF_F32, DIMS(1, 1, 1, 4), 4, x),
                       tp_dev(RF_F32, DIMS(1, 1, 1, 1), 4, one), tp_dev(RF_F32, DIMS(1, 4), 2, x),
                       tp_dev(RF_F32, DIMS(4, 4), 2, eye)};
    for (int minus = 0; minus < 2; minus++) {
        double zero = minus ? -0.0 : 0.0;
        rf_array *o[2] = {0};
        if (run_prog("max of conv/matmul with a signed zero", build_relu_signs, &zero, in, 4, o,
                     2)) {
            for (int k = 0; k < 2; k++) {
                double *v = tp_read(o[k], NULL);
                for (int i = 0; v && i < 4; i++)
                    CHECK(x[i] > 0 ? v[i] == x[i]
                                   : v[i] == 0 && (bool)signbit(v[i]) == (bool)minus);
                free(v);
            }
        }
        tp_free_all(o, 2);
    }
    tp_free_all(in, 4);
}

/* logistic of a product's result, large enough to be a library call: values down to
 * -87.3 have normal-float results (a library post-op flushed those below -86.99 to 0). */
static void build_logistic_product(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    rf_return(t, rf_sigmoid(rf_matmul(a[0], a[1])));
}

static void test_logistic_product_tail(void)
{
    enum { M = 128, K = 256, N = 64 };
    static double x[M * K], w[K * N];
    for (int i = 0; i < M * K; i++)
        x[i] = -80.0 - 7.3 * (double)(i % 997) / 996.0; /* -80 .. -87.3 */
    for (int i = 0; i < K * N; i++)
        w[i] = i / N == i % N; /* the first N columns of x */
    rf_array *in[2] = {tp_dev(RF_F32, DIMS(M, K), 2, x), tp_dev(RF_F32, DIMS(K, N), 2, w)};
    rf_array *o = NULL;
    if (run_prog("logistic of a product", build_logistic_product, NULL, in, 2, &o, 1)) {
        double *v = tp_read(o, NULL), worst = 0;
        for (int r = 0; v && r < M; r++) {
            for (int c = 0; c < N; c++) {
                double xv = (double)(float)x[r * K + c], e = exp(xv);
                double want = (double)(float)(e / (1 + e));
                double err = fabs(v[r * N + c] - want) / want;
                worst = err > worst || isnan(err) ? (isnan(err) ? INFINITY : err) : worst;
            }
        }
        CHECK(v && worst <= 4e-7); /* 3 ulp or so, never a flush to 0 */
        if (worst > 4e-7)
            fprintf(stderr, "logistic of a product: worst relative error %g\n", worst);
        free(v);
    }
    rf_array_free(o);
    tp_free_all(in, 2);
}

static void test_reduce_window(void)
{
    uint64_t rng = 55;
    const rf_reduce_kind kinds[3] = {RF_REDUCE_SUM, RF_REDUCE_MAX, RF_REDUCE_MIN};
    const char *kn[3] = {"sum", "max", "min"};
    for (int c = 0; c < N_OF(WINDOW_CASES); c++)
        for (int k = 0; k < 3; k++)
            for (int d = 0; d < 3; d++) {
                rf_dtype dt = d == 0 ? RF_F32 : d == 1 ? RF_F64 : RF_I32;
                const window_case *w = &WINDOW_CASES[c];
                int64_t nx = tp_numel(w->xd, w->rank), od[4];
                double x[128], want[512];
                for (int64_t i = 0; i < nx; i++)
                    x[i] = is_float(dt) ? as_dtype(dt, tp_rand(&rng, -3, 3))
                                        : floor(tp_rand(&rng, -9, 10));
                naive_reduce_window(w, kinds[k], x, want);
                window_out_dims(w, od);
                for (int64_t i = 0; i < tp_numel(od, w->rank) && dt == RF_I32; i++)
                    if (isinf(want[i])) /* a window wholly in the padding: the identity */
                        want[i] = want[i] < 0 ? INT32_MIN : INT32_MAX;
                rf_array *in = tp_host(dt, w->xd, w->rank, x);
                rf_array *o = NULL;
                window_box box = {w, kinds[k]};
                char label[80];
                snprintf(label, sizeof label, "reduce_window %s case %d %s", kn[k], c,
                         rf_dtype_name(dt));
                if (run_prog(label, build_reduce_window, &box, &in, 1, &o, 1))
                    tp_expect(label, o, dt, od, w->rank, want, 4 * tol_of(dt), 4 * tol_of(dt));
                rf_array_free(o);
                rf_array_free(in);
            }
}

/* select_and_scatter of x (f32) under window w, with integer sources drawn from rng,
 * against the naive one (exact: each sum adds a few small integers). */
static void check_select_scatter(const char *label, const window_case *w, const double *x,
                                 uint64_t *rng)
{
    int64_t od[4];
    window_out_dims(w, od);
    int64_t ns = tp_numel(od, w->rank);
    double *src = malloc((size_t)ns * sizeof *src);
    double *want = malloc((size_t)tp_numel(w->xd, w->rank) * sizeof *want);
    for (int64_t i = 0; i < ns; i++)
        src[i] = floor(tp_rand(rng, 1, 10));
    naive_select_scatter(w, x, src, want);
    rf_array *in[2] = {tp_host(RF_F32, w->xd, w->rank, x), tp_host(RF_F32, od, w->rank, src)};
    rf_array *o = NULL;
    window_box box = {w, RF_REDUCE_MAX};
    if (run_prog(label, build_select_scatter, &box, in, 2, &o, 1))
        tp_expect(label, o, RF_F32, w->xd, w->rank, want, 0, 0);
    rf_array_free(o);
    tp_free_all(in, 2);
    free(src);
    free(want);
}

static void test_select_and_scatter(void)
{
    uint64_t rng = 77;
    for (int c = 0; c < N_OF(WINDOW_CASES); c++)
        for (int ties = 0; ties < 2; ties++) {
            const window_case *w = &WINDOW_CASES[c];
            double x[128];
            for (int64_t i = 0; i < tp_numel(w->xd, w->rank); i++)
                x[i] = ties ? floor(tp_rand(&rng, 0, 3)) : as_dtype(RF_F32, tp_rand(&rng, -3, 3));
            char label[80];
            snprintf(label, sizeof label, "select_and_scatter case %d%s", c,
                     ties ? " with ties" : "");
            check_select_scatter(label, w, x, &rng);
        }
}

/* A value for the non-finite tests: NaN, +-inf or a signed zero about one time in six,
 * else a small number (sums and products of which are exact in f32). */
static double non_finite_mix(uint64_t *rng)
{
    static const double special[] = {NAN, INFINITY, -INFINITY, -0.0, 0.0};
    static const double plain[] = {1.5, -2, 3, -0.5, 0.75, -1.25, 2, 1};
    double r = tp_rand(rng, 0, 1);
    return r < 1.0 / 6 ? special[(int)(r * 6 * 5)] : plain[(int)(tp_rand(rng, 0, 8)) % 8];
}

/* Reductions, windows and max-pool gradients over NaN, infinities and signed zeros:
 * the compiled loops (vectorised, split into chunks, padded windows guarded) must
 * propagate them as the interpreter does. A reduction over axes is the window of
 * those whole axes. */
static void test_non_finite_windows(void)
{
    static const window_case cases[] = {
        {4, {2, 3, 9, 11}, {1, 1, 3, 3}, {1, 1, 2, 2}, {0, 0, 1, 1}, {0, 0, 1, 1}},
        {4, {2, 3, 8, 8}, {1, 1, 2, 2}, {1, 1, 2, 2}, {0, 0, 0, 0}, {0, 0, 0, 0}},
        {3, {3, 5, 37}, {1, 1, 37}, {1, 1, 1}, {0, 0, 0}, {0, 0, 0}},   /* reduce axis 2 */
        {3, {3, 5, 37}, {3, 1, 37}, {1, 1, 1}, {0, 0, 0}, {0, 0, 0}},   /* axes 0 and 2 */
        {3, {3, 5, 37}, {1, 5, 1}, {1, 1, 1}, {0, 0, 0}, {0, 0, 0}},    /* axis 1 */
        {3, {3, 5, 37}, {3, 5, 37}, {1, 1, 1}, {0, 0, 0}, {0, 0, 0}},   /* all */
        {1, {700}, {700}, {1}, {0}, {0}},                                /* a long sum */
    };
    const rf_reduce_kind kinds[4] = {RF_REDUCE_SUM, RF_REDUCE_MAX, RF_REDUCE_MIN,
                                     RF_REDUCE_PROD};
    const char *kn[4] = {"sum", "max", "min", "prod"};
    uint64_t rng = 4242;
    double *x = malloc(700 * sizeof *x), *want = malloc(700 * sizeof *want);
    for (int c = 0; c < N_OF(cases); c++) {
        const window_case *w = &cases[c];
        int64_t nx = tp_numel(w->xd, w->rank), od[4];
        window_out_dims(w, od);
        bool whole = c >= 2; /* windows of whole axes: rf_reduce over them too */
        for (int d = 0; d < 2; d++) {
            rf_dtype dt = d ? RF_F64 : RF_F32;
            for (int64_t i = 0; i < nx; i++)
                x[i] = non_finite_mix(&rng);
            rf_array *in = tp_host(dt, w->xd, w->rank, x);
            for (int k = 0; k < 4; k++) {
                if (kinds[k] == RF_REDUCE_PROD && !whole)
                    continue; /* reduce_window has no product */
                naive_reduce_window(w, kinds[k], x, want);
                for (int64_t i = 0; i < tp_numel(od, w->rank); i++)
                    want[i] = as_dtype(dt, want[i]);
                window_box box = {w, kinds[k]};
                rf_array *o = NULL;
                char label[96];
                snprintf(label, sizeof label, "non-finite reduce_window %s case %d %s", kn[k], c,
                         rf_dtype_name(dt));
                if (kinds[k] != RF_REDUCE_PROD &&
                    run_prog(label, build_reduce_window, &box, &in, 1, &o, 1))
                    tp_expect(label, o, dt, od, w->rank, want, 0, 4 * tol_of(dt));
                rf_array_free(o);
                o = NULL;
                if (!whole)
                    continue;
                reduce_box rb = {kinds[k], {0}, 0, true};
                for (int a = 0; a < w->rank; a++)
                    if (w->win[a] > 1)
                        rb.axes[rb.naxes++] = a;
                snprintf(label, sizeof label, "non-finite reduce %s case %d %s", kn[k], c,
                         rf_dtype_name(dt));
                if (run_prog(label, build_reduce, &rb, &in, 1, &o, 1))
                    tp_expect(label, o, dt, od, w->rank, want, 0, 4 * tol_of(dt));
                rf_array_free(o);
            }
            rf_array_free(in);
        }
        if (w->rank != 4)
            continue;
        for (int64_t i = 0; i < nx; i++)
            x[i] = as_dtype(RF_F32, non_finite_mix(&rng));
        char label[96];
        snprintf(label, sizeof label, "non-finite select_and_scatter case %d", c);
        check_select_scatter(label, w, x, &rng);
    }
    free(x);
    free(want);
}

static void build_pools(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    rf_return(t, rf_maxpool2d(a[0], DIMS(2, 2), DIMS(2, 2), NULL));
    rf_return(t, rf_maxpool2d(a[0], DIMS(3, 3), DIMS(2, 2), DIMS(1, 1)));
    rf_return(t, rf_meanpool2d(a[0], DIMS(2, 2), DIMS(2, 2), NULL));
    rf_return(t, rf_meanpool2d(a[0], DIMS(2, 3), DIMS(1, 2), NULL));
}

static void test_pools(void)
{
    uint64_t rng = 11;
    double x[2 * 2 * 5 * 5];
    for (int i = 0; i < 100; i++)
        x[i] = tp_rand(&rng, -3, 3);
    window_case m1 = {4, {2, 2, 5, 5}, {1, 1, 2, 2}, {1, 1, 2, 2}, {0, 0, 0, 0}, {0, 0, 0, 0}};
    window_case m2 = {4, {2, 2, 5, 5}, {1, 1, 3, 3}, {1, 1, 2, 2}, {0, 0, 1, 1}, {0, 0, 1, 1}};
    window_case a2 = {4, {2, 2, 5, 5}, {1, 1, 2, 3}, {1, 1, 1, 2}, {0, 0, 0, 0}, {0, 0, 0, 0}};
    double w1[100], w2[100], w3[100], w4[100];
    int64_t d1[4], d2[4], d4[4];
    naive_reduce_window(&m1, RF_REDUCE_MAX, x, w1);
    naive_reduce_window(&m2, RF_REDUCE_MAX, x, w2);
    naive_reduce_window(&m1, RF_REDUCE_SUM, x, w3);
    naive_reduce_window(&a2, RF_REDUCE_SUM, x, w4);
    window_out_dims(&m1, d1);
    window_out_dims(&m2, d2);
    window_out_dims(&a2, d4);
    for (int i = 0; i < tp_numel(d1, 4); i++)
        w3[i] /= 4;
    for (int i = 0; i < tp_numel(d4, 4); i++)
        w4[i] /= 6;
    rf_array *in = tp_host(RF_F64, DIMS(2, 2, 5, 5), 4, x);
    rf_array *o[4] = {0};
    if (run_prog("pools", build_pools, NULL, &in, 1, o, 4)) {
        tp_expect("maxpool2d 2x2/2", o[0], RF_F64, d1, 4, w1, 0, 0);
        tp_expect("maxpool2d 3x3/2 pad 1", o[1], RF_F64, d2, 4, w2, 0, 0);
        tp_expect("meanpool2d 2x2/2", o[2], RF_F64, d1, 4, w3, 1e-14, 1e-14);
        tp_expect("meanpool2d 2x3 stride (1,2)", o[3], RF_F64, d4, 4, w4, 1e-14, 1e-14);
    }
    tp_free_all(o, 4);
    rf_array_free(in);
}

/* ---- Indexing ------------------------------------------------------------------------ */

static void build_gather(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    rf_return(t, rf_gather(a[0], a[1], 0));  /* [3,4] idx i32 [4] -> [4,4] */
    rf_return(t, rf_gather(a[0], a[2], 1));  /* [3,4] idx i64 [2,2] -> [3,2,2] */
    rf_return(t, rf_gather(a[0], a[2], -1));
    rf_return(t, rf_scatter_add(a[0], a[1], a[3], 0));  /* updates [4,4] */
    rf_return(t, rf_scatter_add(a[0], a[2], a[4], 1));  /* updates [3,2,2] */
    rf_return(t, rf_take_along(a[0], a[5]));
    rf_return(t, rf_gather(a[6], a[1], 0));  /* i32 table */
}

static void test_gather_scatter(void)
{
    double x[12];
    for (int i = 0; i < 12; i++)
        x[i] = 10 * (i / 4) + i % 4; /* x[r][c] = 10 r + c */
    const double idx0[4] = {2, 0, 2, -1};      /* duplicate, clamp -1 -> 0 */
    const double idx1[4] = {3, 5, 1, 1};       /* clamp 5 -> 3, duplicate */
    double up0[16], up1[12];
    for (int i = 0; i < 16; i++) up0[i] = i + 1;
    for (int i = 0; i < 12; i++) up1[i] = 100 * (i + 1);
    /* gather axis 0 */
    double g0[16], g1[12], s0[12], s1[12], ta[3];
    const int64_t ci0[4] = {2, 0, 2, 0}, ci1[4] = {3, 3, 1, 1};
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < 4; c++)
            g0[i * 4 + c] = x[ci0[i] * 4 + c];
    for (int r = 0; r < 3; r++)
        for (int j = 0; j < 4; j++)
            g1[r * 4 + j] = x[r * 4 + ci1[j]];
    /* scatter_add: out-of-range indices (-1, 5) are dropped */
    memcpy(s0, x, sizeof s0);
    for (int i = 0; i < 4; i++)
        if (idx0[i] >= 0 && idx0[i] < 3)
            for (int c = 0; c < 4; c++)
                s0[(int)idx0[i] * 4 + c] += up0[i * 4 + c];
    memcpy(s1, x, sizeof s1);
    for (int r = 0; r < 3; r++)
        for (int j = 0; j < 4; j++)
            if (idx1[j] >= 0 && idx1[j] < 4)
                s1[r * 4 + (int)idx1[j]] += up1[r * 4 + j];
    const double tidx[3] = {1, 3, 0};
    for (int r = 0; r < 3; r++)
        ta[r] = x[r * 4 + (int)tidx[r]];
    rf_array *in[7] = {tp_host(RF_F32, DIMS(3, 4), 2, x),      tp_host(RF_I32, DIMS(4), 1, idx0),
                       tp_host(RF_I64, DIMS(2, 2), 2, idx1),   tp_host(RF_F32, DIMS(4, 4), 2, up0),
                       tp_host(RF_F32, DIMS(3, 2, 2), 3, up1), tp_host(RF_I32, DIMS(3), 1, tidx),
                       tp_host(RF_I32, DIMS(3, 4), 2, x)};
    rf_array *o[7] = {0};
    if (run_prog("gather/scatter", build_gather, NULL, in, 7, o, 7)) {
        tp_expect("gather axis 0 (dup, clamp)", o[0], RF_F32, DIMS(4, 4), 2, g0, 0, 0);
        tp_expect("gather axis 1 2-D indices (clamp)", o[1], RF_F32, DIMS(3, 2, 2), 3, g1, 0, 0);
        tp_expect("gather axis -1", o[2], RF_F32, DIMS(3, 2, 2), 3, g1, 0, 0);
        tp_expect("scatter_add axis 0 (dup, dropped)", o[3], RF_F32, DIMS(3, 4), 2, s0, 0, 0);
        tp_expect("scatter_add axis 1 (dropped, dup)", o[4], RF_F32, DIMS(3, 4), 2, s1, 0, 0);
        tp_expect("take_along", o[5], RF_F32, DIMS(3), 1, ta, 0, 0);
        tp_expect("gather i32 table", o[6], RF_I32, DIMS(4, 4), 2, g0, 0, 0);
    }
    tp_free_all(o, 7);
    tp_free_all(in, 7);
}

static void build_onehot(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    rf_return(t, rf_onehot(a[0], 3, RF_F32));
    rf_return(t, rf_onehot(a[1], 4, RF_I32));
}

static void test_onehot(void)
{
    rf_array *in[2] = {tp_host(RF_I32, DIMS(3), 1, (const double[]){0, 2, 1}),
                       tp_host(RF_I64, DIMS(2, 2), 2, (const double[]){3, 5, 0, -1})};
    rf_array *o[2] = {0};
    if (run_prog("onehot", build_onehot, NULL, in, 2, o, 2)) {
        tp_expect("onehot [3] -> [3,3] f32", o[0], RF_F32, DIMS(3, 3), 2,
                  (const double[]){1, 0, 0, 0, 0, 1, 0, 1, 0}, 0, 0);
        tp_expect("onehot [2,2] -> [2,2,4] i32 (out of range: zeros)", o[1], RF_I32,
                  DIMS(2, 2, 4), 3,
                  (const double[]){0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0}, 0, 0);
    }
    tp_free_all(o, 2);
    tp_free_all(in, 2);
}

/* ---- Random numbers ---------------------------------------------------------------------- */

typedef struct rng_box {
    rf_array *key;
    rf_dtype dt;
} rng_box;

static void build_rng(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)a, (void)n;
    rng_box *b = u;
    rf_tensor *k = rf_rng_key(t, b->key);
    rf_return(t, rf_rng_uniform(k, b->dt, RF_SHAPE(40, 50)));
    rf_return(t, rf_rng_normal(k, b->dt, RF_SHAPE(40, 50)));
    rf_return(t, rf_rng_uniform(k, b->dt, RF_SHAPE(40, 50)));
}

static void moments(const double *v, int64_t n, double *mean, double *sd, double *lo, double *hi)
{
    double s = 0, s2 = 0;
    *lo = INFINITY, *hi = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        s += v[i];
        *lo = v[i] < *lo ? v[i] : *lo;
        *hi = v[i] > *hi ? v[i] : *hi;
    }
    *mean = s / (double)n;
    for (int64_t i = 0; i < n; i++)
        s2 += (v[i] - *mean) * (v[i] - *mean);
    *sd = sqrt(s2 / (double)n);
}

static bool same_values(const rf_array *a, const rf_array *b)
{
    int64_t na = 0, nb = 0;
    double *x = tp_read(a, &na), *y = tp_read(b, &nb);
    bool same = x && y && na == nb;
    for (int64_t i = 0; same && i < na; i++)
        same = x[i] == y[i];
    free(x);
    free(y);
    return same;
}

static void test_rng(void)
{
    for (int d = 0; d < 2; d++) {
        rf_dtype dt = d ? RF_F64 : RF_F32;
        rng_box b1 = {rf_rng_key_new(42, rf_device_cpu()), dt};
        rng_box b2 = {rf_rng_key_new(42, rf_device_cpu()), dt};
        rf_exec *e1 = NULL, *e2 = NULL;
        CHECK_OK(tp_compile(build_rng, &b1, NULL, 0, &e1));
        CHECK_OK(tp_compile(build_rng, &b2, NULL, 0, &e2));
        if (!e1 || !e2) {
            rf_exec_free(e1);
            rf_exec_free(e2);
            rf_array_free(b1.key);
            rf_array_free(b2.key);
            continue;
        }
        rf_array *r1[3] = {0}, *r1b[3] = {0}, *r2[3] = {0};
        CHECK_OK(rf_exec_run(e1, NULL, 0, r1, 3));
        CHECK_OK(rf_exec_run(e1, NULL, 0, r1b, 3));
        CHECK_OK(rf_exec_run(e2, NULL, 0, r2, 3));
        if (r1[0] && r1b[0] && r2[0]) {
            CHECK(rf_array_dtype(r1[0]) == dt && rf_array_dtype(r1[1]) == dt);
            CHECK(!same_values(r1[0], r1b[0])); /* the key advanced */
            CHECK(!same_values(r1[1], r1b[1]));
            CHECK(same_values(r1[0], r2[0]));   /* same seed, same first draw */
            CHECK(same_values(r1[1], r2[1]));
            CHECK(!same_values(r1[0], r1[2]));  /* two calls in one program: own streams */
            int64_t n = 0;
            double mean, sd, lo, hi;
            double *u = tp_read(r1[0], &n);
            moments(u, n, &mean, &sd, &lo, &hi);
            CHECK(n == 2000);
            CHECK(lo >= 0 && hi < 1);
            CHECK_NEAR(mean, 0.5, 0.03, 0);
            CHECK_NEAR(sd, sqrt(1.0 / 12), 0.02, 0);
            free(u);
            double *g = tp_read(r1b[1], &n);
            moments(g, n, &mean, &sd, &lo, &hi);
            CHECK_NEAR(mean, 0, 0.08, 0);
            CHECK_NEAR(sd, 1, 0.06, 0);
            CHECK(lo < -2 && hi > 2);
            free(g);
            double key[2];
            double *kv = tp_read(b1.key, NULL);
            if (kv) {
                key[0] = kv[0], key[1] = kv[1];
                CHECK(key[0] == 42 && key[1] == 2); /* two runs: counter + 2 */
            }
            free(kv);
        }
        tp_free_all(r1, 3);
        tp_free_all(r1b, 3);
        tp_free_all(r2, 3);
        rf_exec_free(e1);
        rf_exec_free(e2);
        rf_array_free(b1.key);
        rf_array_free(b2.key);
    }
}

/* ---- Neural-network composites ------------------------------------------------------------ */

static void build_nn(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    rf_tensor *x = a[0];
    rf_return(t, rf_softmax(x, 1));
    rf_return(t, rf_logsoftmax(x, 1));
    rf_return(t, rf_logsumexp(x, 1, false));
    rf_return(t, rf_logsumexp(x, -1, true));
    rf_return(t, rf_softmax(x, 0));
    rf_return(t, rf_relu(x));
    rf_return(t, rf_leakyrelu(x, 0.1));
    rf_return(t, rf_elu(x, 0.7));
    rf_return(t, rf_gelu(x));
    rf_return(t, rf_swish(x));
    rf_return(t, rf_sigmoid(x));
    rf_return(t, rf_softplus(x));
}

/* gelu's left tail in f32 and f64, densely: relative error against x / (1 + exp(-2 z))
 * in long double within what computing z costs (four roundings, each moving the result
 * by up to |2 z| ulps); the written form 0.5 x (1 + tanh z) lost every digit from x = -5
 * in f32. */
static void build_gelu(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    rf_return(t, rf_gelu(a[0]));
}

static void test_gelu_tail(void)
{
    enum { N = 401 };
    double x[N];
    for (int i = 0; i < N; i++) /* -2 .. -10 (f32 results stay normal) */
        x[i] = -2 - 8.0 * i / (N - 1);
    for (int d = 0; d < 2; d++) {
        rf_dtype dt = d ? RF_F64 : RF_F32;
        rf_array *in = tp_dev(dt, DIMS(N), 1, x), *o = NULL;
        if (run_prog("gelu tail", build_gelu, NULL, &in, 1, &o, 1)) {
            double *v = tp_read(o, NULL);
            for (int i = 0; v && i < N; i++) {
                long double c = sqrtl(2.0L / 3.14159265358979323846264L);
                long double xv = d ? x[i] : (float)x[i];
                long double z = c * (xv + 0.044715L * xv * xv * xv);
                double want = (double)(xv / (1 + expl(-2 * z)));
                double bound = (double)(4 * fabsl(2 * z) + 8) * (d ? DBL_EPSILON : FLT_EPSILON);
                double err = fabs(v[i] - want) / fabs(want);
                CHECK(err <= bound);
                if (!(err <= bound))
                    fprintf(stderr, "gelu %s (%g): %g, want %g\n", rf_dtype_name(dt), x[i],
                            v[i], want);
            }
            free(v);
        }
        rf_array_free(o);
        rf_array_free(in);
    }
}

static void test_nn(void)
{
    /* row 2 has huge values: softmax must be computed stably */
    const double x[12] = {-1, 0.5, 2, -3, 0.1, 0.2, 0.3, 0.4, 1000, 1001, 999, 1000.5};
    double sm1[12], lsm1[12], lse[3], sm0[12], relu[12], lrelu[12], elu[12], gelu[12],
        swish[12], sig[12], sp[12];
    for (int r = 0; r < 3; r++) {
        double m = -INFINITY, s = 0;
        for (int c = 0; c < 4; c++) m = fmax(m, x[r * 4 + c]);
        for (int c = 0; c < 4; c++) s += exp(x[r * 4 + c] - m);
        lse[r] = m + log(s);
        for (int c = 0; c < 4; c++) {
            sm1[r * 4 + c] = exp(x[r * 4 + c] - m) / s;
            lsm1[r * 4 + c] = x[r * 4 + c] - lse[r];
        }
    }
    for (int c = 0; c < 4; c++) {
        double m = -INFINITY, s = 0;
        for (int r = 0; r < 3; r++) m = fmax(m, x[r * 4 + c]);
        for (int r = 0; r < 3; r++) s += exp(x[r * 4 + c] - m);
        for (int r = 0; r < 3; r++) sm0[r * 4 + c] = exp(x[r * 4 + c] - m) / s;
    }
    for (int i = 0; i < 12; i++) {
        double v = x[i];
        relu[i] = v > 0 ? v : 0;
        lrelu[i] = v > 0 ? v : 0.1 * v;
        elu[i] = v > 0 ? v : 0.7 * expm1(v);
        const double k = sqrt(2 / 3.14159265358979323846);
        gelu[i] = 0.5 * v * (1 + tanh(k * (v + 0.044715 * v * v * v)));
        sig[i] = 1 / (1 + exp(-v));
        swish[i] = v * sig[i];
        sp[i] = v > 30 ? v : log1p(exp(v));
    }
    for (int d = 0; d < 2; d++) {
        rf_dtype dt = d ? RF_F64 : RF_F32;
        double tol = d ? 1e-12 : 3e-6;
        rf_array *in = tp_host(dt, DIMS(3, 4), 2, x);
        rf_array *o[12] = {0};
        if (run_prog(d ? "nn f64" : "nn f32", build_nn, NULL, &in, 1, o, 12)) {
            tp_expect("softmax axis 1", o[0], dt, DIMS(3, 4), 2, sm1, tol, tol);
            /* f32: x - logsumexp near 1000 may round the sum (ulp 6e-5) */
            tp_expect("logsoftmax axis 1", o[1], dt, DIMS(3, 4), 2, lsm1, d ? tol : 1e-4, tol);
            tp_expect("logsumexp axis 1", o[2], dt, DIMS(3), 1, lse, tol, tol);
            tp_expect("logsumexp keepdims", o[3], dt, DIMS(3, 1), 2, lse, tol, tol);
            tp_expect("softmax axis 0", o[4], dt, DIMS(3, 4), 2, sm0, tol, tol);
            tp_expect("relu", o[5], dt, DIMS(3, 4), 2, relu, tol, tol);
            tp_expect("leakyrelu", o[6], dt, DIMS(3, 4), 2, lrelu, tol, tol);
            tp_expect("elu", o[7], dt, DIMS(3, 4), 2, elu, tol, tol);
            tp_expect("gelu (tanh)", o[8], dt, DIMS(3, 4), 2, gelu, tol, tol);
            tp_expect("swish", o[9], dt, DIMS(3, 4), 2, swish, tol, tol);
            tp_expect("sigmoid", o[10], dt, DIMS(3, 4), 2, sig, tol, tol);
            tp_expect("softplus", o[11], dt, DIMS(3, 4), 2, sp, tol, tol);
        }
        tp_free_all(o, 12);
        rf_array_free(in);
    }
    /* logsumexp of a row with an infinite max: -inf for a fully masked row,
     * +inf with a +inf entry (not NaN from inf - inf), as JAX */
    const double xi[6] = {-INFINITY, -INFINITY, -INFINITY, 1, INFINITY, 2};
    const double lsei[2] = {-INFINITY, INFINITY};
    for (int d = 0; d < 2; d++) {
        rf_dtype dt = d ? RF_F64 : RF_F32;
        rf_array *in = tp_host(dt, DIMS(2, 3), 2, xi);
        rf_array *o[12] = {0};
        if (run_prog(d ? "nn inf f64" : "nn inf f32", build_nn, NULL, &in, 1, o, 12))
            tp_expect("logsumexp infinite rows", o[2], dt, DIMS(2), 1, lsei, 0, 0);
        tp_free_all(o, 12);
        rf_array_free(in);
    }
}

int main(void)
{
    test_constants();
    test_weak_scalars();
    test_unary_float();
    test_unary_other();
    test_binary();
    test_binary_spots();
    test_int_div_edge();
    test_compare();
    test_select();
    test_clamp();
    test_convert();
    test_convert_round_trip();
    test_shapes();
    test_transpose();
    test_slice_concat_reverse();
    test_pad();
    test_reduce();
    test_reduce_stats();
    test_argmax();
    test_dot_general();
    test_matmul();
    test_conv();
    test_relu_zero_signs();
    test_logistic_product_tail();
    test_reduce_window();
    test_select_and_scatter();
    test_non_finite_windows();
    test_pools();
    test_gather_scatter();
    test_onehot();
    test_rng();
    test_nn();
    test_gelu_tail();
    return tu_finish("test_ops_forward");
}
