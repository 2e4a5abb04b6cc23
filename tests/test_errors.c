/* test_errors.c: the error catalogue through the public API.
 *
 * Every bad input must come back as a status plus a message naming the
 * operation and the offending shapes/values, without a crash, a leak or an
 * abort (this test also runs under ASan/UBSan/LSan): bad shapes, dtypes,
 * NULLs, argument counts, host arrays where device arrays are needed, tensors
 * of one trace used in another, arrays freed while captured, the sticky
 * first error, bad dims/ranks, an unknown backend, and failed runs leaving
 * captured state untouched. Does not test the numerics of valid programs
 * (other tests do).
 */
#include <stdarg.h>

#include "test_util.h"

/* ---- Helpers ---------------------------------------------------------------------- */

static rf_array *cpu_zeros(rf_dtype dt, const int64_t *dims, int rank)
{
    rf_array *a = rf_array_new(rf_device_cpu(), dt, dims, rank, NULL);
    CHECK(a != NULL);
    return a;
}

static rf_array *cpu_f32(const float *data, const int64_t *dims, int rank)
{
    rf_array *a = rf_array_new(rf_device_cpu(), RF_F32, dims, rank, data);
    CHECK(a != NULL);
    return a;
}

/* Checks that the current message contains every needle of the NULL-terminated list. */
static void check_msg_all(int line, va_list ap)
{
    const char *needle;
    while ((needle = va_arg(ap, const char *)) != NULL) {
        tu_checks++;
        if (!strstr(rf_errmsg(), needle)) {
            tu_failures++;
            fprintf(stderr, "%s:%d: message \"%s\" lacks \"%s\"\n", __FILE__, line, rf_errmsg(),
                    needle);
        }
    }
}

/* A traced function that builds one (failing) op from its arguments. */
typedef rf_tensor *(*build_fn)(rf_trace *t);

struct op_case {
    build_fn build;
    bool called;
    rf_tensor *got;          /* what the op returned */
    rf_status trace_status;  /* rf_trace_status right after it */
};

static void op_case_fn(rf_trace *t, void *ctx)
{
    struct op_case *c = ctx;
    c->called = true;
    c->got = c->build(t);
    c->trace_status = rf_trace_status(t);
    rf_return(t, c->got);
}

/* Compiles `build` with `args`, expects status `want` (or `alt` if it is not
 * RF_OK) and a message holding every needle (NULL-terminated). */
static void expect_op_error_at(int line, build_fn build, rf_array **args, int nargs, rf_status want,
                               rf_status alt, ...)
{
    struct op_case c = {build, false, NULL, RF_OK};
    rf_exec *e = NULL;
    rf_clear_error();
    rf_status st = rf_compile(op_case_fn, &c, args, nargs, &e);
    tu_checks++;
    if (st != want && (alt == RF_OK || st != alt)) {
        tu_failures++;
        fprintf(stderr, "%s:%d: rf_compile returned %s, expected %s (%s)\n", __FILE__, line,
                rf_status_str(st), rf_status_str(want), rf_errmsg());
    }
    tu_checks++;
    if (!c.called || c.got != NULL || c.trace_status == RF_OK || e != NULL) {
        tu_failures++;
        fprintf(stderr, "%s:%d: op case: called %d, op result %p, trace status %s, exec %p\n",
                __FILE__, line, c.called, (void *)c.got, rf_status_str(c.trace_status), (void *)e);
    }
    va_list ap;
    va_start(ap, alt);
    check_msg_all(line, ap);
    va_end(ap);
    rf_exec_free(e);
}
#define EXPECT_OP_ERROR(build, args, nargs, want, ...) \
    expect_op_error_at(__LINE__, build, args, nargs, want, RF_OK, __VA_ARGS__, (const char *)NULL)
#define EXPECT_OP_ERROR2(build, args, nargs, want, alt, ...) \
    expect_op_error_at(__LINE__, build, args, nargs, want, alt, __VA_ARGS__, (const char *)NULL)

/* ---- Shapes ------------------------------------------------------------------------ */

static rf_tensor *build_add(rf_trace *t) { return rf_add(rf_arg(t, 0), rf_arg(t, 1)); }

static rf_tensor *build_dot_contract(rf_trace *t)
{
    const int64_t lc[1] = {1}, rc[1] = {0};
    return rf_dot_general(rf_arg(t, 0), rf_arg(t, 1), NULL, NULL, 0, lc, rc, 1);
}

static rf_tensor *build_matmul(rf_trace *t) { return rf_matmul(rf_arg(t, 0), rf_arg(t, 1)); }

static rf_tensor *build_conv(rf_trace *t)
{
    rf_conv_params p = rf_conv_params_default(2);
    return rf_conv(rf_arg(t, 0), rf_arg(t, 1), &p);
}

static rf_tensor *build_reshape(rf_trace *t) { return rf_reshape(rf_arg(t, 0), RF_SHAPE(4, 2)); }

static rf_tensor *build_transpose_dup(rf_trace *t)
{
    const int64_t perm[2] = {0, 0};
    return rf_transpose(rf_arg(t, 0), perm);
}

static rf_tensor *build_transpose_range(rf_trace *t)
{
    const int64_t perm[2] = {0, 2};
    return rf_transpose(rf_arg(t, 0), perm);
}

static rf_tensor *build_slice_range(rf_trace *t)
{
    const int64_t start[2] = {0, 0}, limit[2] = {5, 5};
    return rf_slice(rf_arg(t, 0), start, limit, NULL);
}

static rf_tensor *build_slice_stride0(rf_trace *t)
{
    const int64_t start[2] = {0, 0}, limit[2] = {4, 5}, stride[2] = {1, 0};
    return rf_slice(rf_arg(t, 0), start, limit, stride);
}

static rf_tensor *build_slice_reversed(rf_trace *t)
{
    const int64_t start[2] = {3, 0}, limit[2] = {1, 5};
    return rf_slice(rf_arg(t, 0), start, limit, NULL);
}

/* Empty results whose other dims overflow a byte size: refused while
 * tracing, as arrays of that shape are (they once failed at run time). */
static rf_tensor *build_reshape_empty_huge(rf_trace *t)
{
    return rf_reshape(rf_arg(t, 0), RF_SHAPE(0, (int64_t)1 << 62, (int64_t)1 << 62));
}

static rf_tensor *build_full_empty_huge(rf_trace *t)
{
    return rf_full(t, RF_F32, RF_SHAPE(0, INT64_MAX / 2, 16), 1.0);
}

static void return_null(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_return(t, NULL);
}

/* No tensors: the call cannot name the trace, so rf_return quotes it. */
static void concatenate_none(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *xs[1] = {rf_arg(t, 0)};
    rf_return(t, rf_concatenate(xs, 0, 0));
}

static void test_shapes(void)
{
    rf_array *a = cpu_zeros(RF_F32, RF_SHAPE(16, 8));
    rf_array *b = cpu_zeros(RF_F32, RF_SHAPE(16, 9));
    rf_array *args[2] = {a, b};
    EXPECT_OP_ERROR(build_add, args, 2, RF_E_SHAPE, "rf_add", "f32[16,8]", "f32[16,9]");
    rf_array_free(a);
    rf_array_free(b);

    a = cpu_zeros(RF_F32, RF_SHAPE(3, 4));
    b = cpu_zeros(RF_F32, RF_SHAPE(5, 2));
    args[0] = a;
    args[1] = b;
    EXPECT_OP_ERROR(build_dot_contract, args, 2, RF_E_SHAPE, "dot_general", "f32[3,4]",
                    "f32[5,2]");
    EXPECT_OP_ERROR(build_matmul, args, 2, RF_E_SHAPE, "f32[3,4]", "f32[5,2]");
    rf_array_free(a);
    rf_array_free(b);

    a = cpu_zeros(RF_F32, RF_SHAPE(1, 3, 8, 8));
    b = cpu_zeros(RF_F32, RF_SHAPE(4, 2, 3, 3));
    args[0] = a;
    args[1] = b;
    EXPECT_OP_ERROR(build_conv, args, 2, RF_E_SHAPE, "conv", "f32[1,3,8,8]", "f32[4,2,3,3]");
    rf_array_free(a);
    rf_array_free(b);

    a = cpu_zeros(RF_F32, RF_SHAPE(2, 3));
    EXPECT_OP_ERROR(build_reshape, &a, 1, RF_E_SHAPE, "reshape", "f32[2,3]", "[4,2]");
    rf_exec *e = NULL;
    CHECK_STATUS(rf_array_read(NULL, NULL, 0), RF_E_INVALID); /* an earlier, handled error */
    CHECK_STATUS(rf_compile(concatenate_none, NULL, &a, 1, &e), RF_E_INVALID);
    CHECK_MSG("rf_return: tensor is NULL (the last error before this call: rf_concatenate: "
              "no tensors");
    CHECK(e == NULL);
    /* a NULL of the function's own making quotes nothing from before the trace */
    CHECK_STATUS(rf_array_read(NULL, NULL, 0), RF_E_INVALID);
    CHECK_STATUS(rf_compile(return_null, NULL, &a, 1, &e), RF_E_INVALID);
    CHECK(strcmp(rf_errmsg(), "rf_return: tensor is NULL") == 0);
    CHECK(e == NULL);
    rf_array_free(a);

    a = cpu_zeros(RF_F32, RF_SHAPE(0, 4));
    EXPECT_OP_ERROR(build_reshape_empty_huge, &a, 1, RF_E_SHAPE, "reshape",
                    "f32[0,4611686018427387904,4611686018427387904]", "too many elements");
    EXPECT_OP_ERROR(build_full_empty_huge, &a, 1, RF_E_INVALID, "rf_full", "invalid shape");
    rf_array_free(a);

    a = cpu_zeros(RF_F32, RF_SHAPE(2, 3));
    EXPECT_OP_ERROR2(build_transpose_dup, &a, 1, RF_E_INVALID, RF_E_SHAPE, "transpose",
                     "f32[2,3]", "[0,0]");
    EXPECT_OP_ERROR2(build_transpose_range, &a, 1, RF_E_INVALID, RF_E_SHAPE, "transpose",
                     "f32[2,3]", "[0,2]");
    rf_array_free(a);

    a = cpu_zeros(RF_F32, RF_SHAPE(4, 5));
    EXPECT_OP_ERROR2(build_slice_range, &a, 1, RF_E_INVALID, RF_E_SHAPE, "slice", "f32[4,5]");
    EXPECT_OP_ERROR2(build_slice_stride0, &a, 1, RF_E_INVALID, RF_E_SHAPE, "slice", "f32[4,5]");
    EXPECT_OP_ERROR2(build_slice_reversed, &a, 1, RF_E_INVALID, RF_E_SHAPE, "slice", "f32[4,5]");
    rf_array_free(a);
}

/* ---- Dtypes ------------------------------------------------------------------------ */

static rf_tensor *build_log(rf_trace *t) { return rf_log(rf_arg(t, 0)); }
static rf_tensor *build_and(rf_trace *t) { return rf_and(rf_arg(t, 0), rf_arg(t, 0)); }

/* A weak scalar that is not a value of the integer tensor it meets (it was
 * truncated: x * 0.5 gave 0) */
static rf_tensor *build_int_times_half(rf_trace *t)
{
    return rf_mul(rf_arg(t, 0), rf_scalar(t, 0.5));
}

static rf_tensor *build_int_plus_huge(rf_trace *t)
{
    return rf_add(rf_arg(t, 0), rf_scalar(t, 1e10));
}

static rf_tensor *build_u8_pad_256(rf_trace *t)
{
    return rf_pad(rf_arg(t, 0), rf_scalar(t, 256), (const int64_t[]){1}, NULL, NULL);
}

/* and ones that are: exact */
static void int_scalars_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_return(t, rf_add(rf_mul(x, rf_scalar(t, 3)), rf_scalar(t, -2147483648.0)));
}

static void test_dtypes(void)
{
    rf_array *f = cpu_zeros(RF_F32, RF_SHAPE(2, 3));
    rf_array *i = cpu_zeros(RF_I32, RF_SHAPE(2, 3));
    rf_array *args[2] = {f, i};
    EXPECT_OP_ERROR(build_add, args, 2, RF_E_DTYPE, "rf_add", "f32[2,3]", "i32[2,3]");
    EXPECT_OP_ERROR(build_log, &i, 1, RF_E_DTYPE, "log", "i32");
    EXPECT_OP_ERROR(build_and, &f, 1, RF_E_DTYPE, "and", "f32");
    EXPECT_OP_ERROR(build_int_times_half, &i, 1, RF_E_DTYPE,
                    "rf_mul: the scalar 0.5 is not a value of i32", "rf_convert");
    EXPECT_OP_ERROR(build_int_plus_huge, &i, 1, RF_E_DTYPE,
                    "rf_add: the scalar 10000000000 is not a value of i32");
    rf_array *u = cpu_zeros(RF_U8, RF_SHAPE(3));
    EXPECT_OP_ERROR(build_u8_pad_256, &u, 1, RF_E_DTYPE, "rf_pad: the scalar 256", "u8");
    rf_array *y = NULL;
    CHECK_OK(rf_jit(int_scalars_fn, NULL, &i, 1, &y, 1));
    int32_t got[6] = {0};
    CHECK_OK(y ? rf_array_read(y, got, sizeof got) : RF_E_INVALID);
    CHECK(got[0] == INT32_MIN && got[5] == INT32_MIN);
    rf_array_free(y);
    rf_array_free(u);
    rf_array_free(f);
    rf_array_free(i);
}

/* ---- NULLs -------------------------------------------------------------------------- */

static void identity_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_return(t, rf_arg(t, 0));
}

static void add2_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_return(t, rf_add(rf_arg(t, 0), rf_arg(t, 1)));
}

struct null_ctx {
    rf_tensor *got;
    rf_status status_after;
};

static void add_null_fn(rf_trace *t, void *ctx)
{
    struct null_ctx *c = ctx;
    c->got = rf_add(NULL, rf_arg(t, 0));
    c->status_after = rf_trace_status(t); /* NULL operands propagate silently */
    rf_return(t, c->got);
}

static void test_nulls(void)
{
    rf_array *x = cpu_zeros(RF_F32, RF_SHAPE(2, 3));
    rf_exec *e = (rf_exec *)&e; /* garbage that a failing compile must overwrite */

    CHECK_STATUS(rf_compile(NULL, NULL, &x, 1, &e), RF_E_INVALID);
    CHECK(e == NULL);
    CHECK_MSG("rf_compile");
    e = NULL;
    CHECK_STATUS(rf_compile(identity_fn, NULL, NULL, 1, &e), RF_E_INVALID);
    CHECK(e == NULL);
    rf_array *null_arg = NULL;
    CHECK_STATUS(rf_compile(identity_fn, NULL, &null_arg, 1, &e), RF_E_INVALID);
    CHECK(e == NULL);
    CHECK_STATUS(rf_compile(identity_fn, NULL, &x, -1, &e), RF_E_INVALID);
    CHECK(e == NULL);
    CHECK_STATUS(rf_compile(identity_fn, NULL, &x, 1, NULL), RF_E_INVALID);

    struct null_ctx c = {(rf_tensor *)&c, RF_E_INTERNAL};
    rf_clear_error();
    rf_status st = rf_compile(add_null_fn, &c, &x, 1, &e);
    CHECK(st != RF_OK);
    CHECK(e == NULL);
    CHECK(c.got == NULL);
    CHECK(c.status_after == RF_OK);
    CHECK(rf_errmsg()[0] != '\0');
    rf_exec_free(e);
    e = NULL;

    /* A valid executable for the run checks. */
    CHECK_OK(rf_compile(identity_fn, NULL, &x, 1, &e));
    rf_array *out = NULL;
    CHECK_STATUS(rf_exec_run(NULL, &x, 1, &out, 1), RF_E_INVALID);
    CHECK_MSG("rf_exec_run");
    CHECK(out == NULL);
    if (e) {
        CHECK_STATUS(rf_exec_run(e, NULL, 1, &out, 1), RF_E_INVALID);
        CHECK(out == NULL);
        CHECK_STATUS(rf_exec_run(e, &null_arg, 1, &out, 1), RF_E_INVALID);
        CHECK(out == NULL);
        CHECK_STATUS(rf_exec_run(e, &x, 1, NULL, 1), RF_E_INVALID);
        CHECK_STATUS(rf_exec_run(e, &x, 1, &out, -1), RF_E_INVALID);
        /* nouts 0 is allowed: outputs are dropped. */
        CHECK_OK(rf_exec_run(e, &x, 1, NULL, 0));
    }
    rf_exec_free(e);

    /* Arrays. */
    float buf[6];
    rf_clear_error();
    rf_array *bad = rf_array_from(RF_F32, NULL, 2, buf);
    CHECK(bad == NULL);
    CHECK(rf_errmsg()[0] != '\0');
    rf_array_free(bad);
    rf_array *scalar = rf_array_from(RF_F32, RF_SCALAR_SHAPE, buf); /* rank 0: dims may be NULL */
    CHECK(scalar != NULL);
    rf_array_free(scalar);
    CHECK_STATUS(rf_array_read(x, NULL, sizeof buf), RF_E_INVALID);
    CHECK_MSG("rf_array_read");
    CHECK_STATUS(rf_array_read(NULL, buf, sizeof buf), RF_E_INVALID);
    CHECK_STATUS(rf_array_read(x, buf, sizeof buf - 1), RF_E_INVALID);
    CHECK_STATUS(rf_array_write(x, NULL, sizeof buf), RF_E_INVALID);
    CHECK_STATUS(rf_array_write(x, buf, sizeof buf + 4), RF_E_INVALID);
    CHECK_STATUS(rf_array_write(NULL, buf, sizeof buf), RF_E_INVALID);
    CHECK(rf_array_to(NULL, rf_device_cpu()) == NULL);
    CHECK_MSG("rf_array_to: array is NULL");
    CHECK(rf_array_to_opts(x, NULL, &(rf_to_opts){.keep_f64 = true}) == NULL);
    CHECK_MSG("rf_array_to_opts: device is NULL");
    CHECK(isnan(rf_to_number(NULL)));
    rf_array_free(NULL);
    rf_exec_free(NULL);
    rf_array_free(x);
}

/* ---- Argument counts ---------------------------------------------------------------------- */

static rf_tensor *build_arg5(rf_trace *t) { return rf_arg(t, 5); }
static rf_tensor *build_arg_neg(rf_trace *t) { return rf_arg(t, -1); }

static void test_arg_counts(void)
{
    rf_array *a = cpu_zeros(RF_F32, RF_SHAPE(2, 3));
    rf_array *b = cpu_zeros(RF_F32, RF_SHAPE(2, 3));
    rf_array *args[3] = {a, b, a};
    rf_exec *e = NULL;
    CHECK_OK(rf_compile(add2_fn, NULL, args, 2, &e));
    if (e) {
        rf_array *out = NULL;
        CHECK_STATUS(rf_exec_run(e, args, 1, &out, 1), RF_E_INVALID);
        CHECK_MSG("rf_exec_run");
        CHECK_MSG("2");
        CHECK_MSG("1");
        CHECK(out == NULL);
        CHECK_STATUS(rf_exec_run(e, args, 3, &out, 1), RF_E_INVALID);
        CHECK(out == NULL);
        CHECK_OK(rf_exec_run(e, args, 2, &out, 1));
        rf_array_free(out);
    }
    rf_exec_free(e);

    EXPECT_OP_ERROR(build_arg5, args, 2, RF_E_INVALID, "rf_arg", "5");
    EXPECT_OP_ERROR(build_arg_neg, args, 2, RF_E_INVALID, "rf_arg", "-1");
    rf_array_free(a);
    rf_array_free(b);
}

/* ---- Host arrays where device arrays are needed ------------------------------------------ */

static void capture_fn(rf_trace *t, void *ctx)
{
    rf_tensor *w = rf_capture(t, ctx);
    rf_return(t, rf_add(rf_arg(t, 0), w));
}

static void assign_fn(rf_trace *t, void *ctx)
{
    rf_assign(t, ctx, rf_arg(t, 0));
    rf_return(t, rf_arg(t, 0));
}

static void test_host_arrays(void)
{
    float v[3] = {1, 2, 3};
    rf_array *host = rf_array_from(RF_F32, RF_SHAPE(3), v);
    rf_array *dev = cpu_f32(v, RF_SHAPE(3));
    CHECK(host != NULL);
    CHECK(rf_array_device(host) == rf_device_host());
    rf_exec *e = NULL;

    CHECK_STATUS(rf_compile(identity_fn, NULL, &host, 1, &e), RF_E_DEVICE);
    CHECK_MSG("host");
    CHECK(e == NULL);

    CHECK_OK(rf_compile(identity_fn, NULL, &dev, 1, &e));
    if (e) {
        rf_array *out = NULL;
        CHECK_STATUS(rf_exec_run(e, &host, 1, &out, 1), RF_E_DEVICE);
        CHECK_MSG("host");
        CHECK(out == NULL);
        rf_exec_free(e);
        e = NULL;
    }

    CHECK_STATUS(rf_compile(capture_fn, host, &dev, 1, &e), RF_E_DEVICE);
    CHECK_MSG("rf_capture");
    CHECK_MSG("host");
    CHECK(e == NULL);
    CHECK_STATUS(rf_compile(assign_fn, host, &dev, 1, &e), RF_E_DEVICE);
    CHECK_MSG("host");
    CHECK(e == NULL);

    rf_array_free(host);
    rf_array_free(dev);
}

/* ---- Mixing traces ----------------------------------------------------------------------- */

struct mix_ctx {
    rf_array *x;
    rf_tensor *outer;
    rf_tensor *inner_result;
    rf_status nested_status;
    rf_exec *nested_exec;
    char nested_msg[512];
};

/* Traced inside the outer trace: uses the outer trace's tensor with its own. */
static void mix_inner_fn(rf_trace *t, void *ctx)
{
    struct mix_ctx *m = ctx;
    m->inner_result = rf_add(rf_arg(t, 0), m->outer);
    rf_return(t, m->inner_result);
}

static void mix_outer_fn(rf_trace *t, void *ctx)
{
    struct mix_ctx *m = ctx;
    m->outer = rf_arg(t, 0);
    m->nested_status = rf_compile(mix_inner_fn, m, &m->x, 1, &m->nested_exec);
    snprintf(m->nested_msg, sizeof m->nested_msg, "%s", rf_errmsg());
    rf_return(t, rf_neg(m->outer));
}

static void test_mixing_traces(void)
{
    struct mix_ctx m = {0};
    m.x = cpu_zeros(RF_F32, RF_SHAPE(2, 3));
    m.inner_result = (rf_tensor *)&m;
    m.nested_status = RF_OK;
    rf_exec *e = NULL;
    rf_status st = rf_compile(mix_outer_fn, &m, &m.x, 1, &e);
    CHECK(m.inner_result == NULL);
    CHECK(m.nested_status != RF_OK);
    CHECK(m.nested_exec == NULL);
    tu_checks++;
    if (!strstr(m.nested_msg, "mixing traces")) {
        tu_failures++;
        fprintf(stderr, "%s:%d: nested compile message \"%s\" lacks \"mixing traces\"\n",
                __FILE__, __LINE__, m.nested_msg);
    }
    /* The outer trace may or may not be marked; either way nothing crashes. */
    if (st == RF_OK) {
        rf_array *out = NULL;
        CHECK_OK(rf_exec_run(e, &m.x, 1, &out, 1));
        rf_array_free(out);
    }
    rf_exec_free(e);
    rf_exec_free(m.nested_exec);
    rf_array_free(m.x);
}

/* ---- Arrays freed by the user while captured --------------------------------------------- */

/* Returns w + x. */
static void read_capture_fn(rf_trace *t, void *ctx) { capture_fn(t, ctx); }

/* Returns w (old value) and records w <- w * 2. */
static void double_fn(rf_trace *t, void *ctx)
{
    rf_tensor *w = rf_capture(t, ctx);
    rf_assign(t, ctx, rf_mul_s(w, 2.0));
    rf_return(t, rf_add(w, rf_mul_s(rf_arg(t, 0), 0.0)));
}

static void check_f32_values(int line, rf_array *a, const float *want, int n)
{
    float got[16];
    tu_checks++;
    if (!a || rf_array_numel(a) != n || rf_array_read(a, got, (size_t)n * sizeof(float)) != RF_OK) {
        tu_failures++;
        fprintf(stderr, "%s:%d: cannot read %d floats (%s)\n", __FILE__, line, n, rf_errmsg());
        return;
    }
    for (int i = 0; i < n; i++) {
        tu_checks++;
        if (got[i] != want[i]) {
            tu_failures++;
            fprintf(stderr, "%s:%d: element %d = %g, expected %g\n", __FILE__, line, i, got[i],
                    want[i]);
        }
    }
}
#define CHECK_VALUES(a, ...)                                                           \
    check_f32_values(__LINE__, a, (const float[]){__VA_ARGS__},                         \
                     (int)(sizeof((const float[]){__VA_ARGS__}) / sizeof(float)))

static void test_freed_while_captured(void)
{
    float wv[3] = {1, 2, 3}, xv[3] = {10, 20, 30};
    rf_array *w = cpu_f32(wv, RF_SHAPE(3));
    rf_array *x = cpu_f32(xv, RF_SHAPE(3));
    rf_exec *e = NULL;
    CHECK_OK(rf_compile(read_capture_fn, w, &x, 1, &e));
    rf_array_free(w); /* the executable keeps its own reference */
    if (e) {
        rf_array *out = NULL;
        CHECK_OK(rf_exec_run(e, &x, 1, &out, 1));
        CHECK_VALUES(out, 11, 22, 33);
        rf_array_free(out);
        out = NULL;
        CHECK_OK(rf_exec_run(e, &x, 1, &out, 1));
        CHECK_VALUES(out, 11, 22, 33);
        rf_array_free(out);
    }
    rf_exec_free(e); /* frees w */

    /* A freed array keeps receiving in-place updates. */
    w = cpu_f32(wv, RF_SHAPE(3));
    e = NULL;
    CHECK_OK(rf_compile(double_fn, w, &x, 1, &e));
    rf_array_free(w);
    if (e) {
        rf_array *out = NULL;
        CHECK_OK(rf_exec_run(e, &x, 1, &out, 1));
        CHECK_VALUES(out, 1, 2, 3);
        rf_array_free(out);
        out = NULL;
        CHECK_OK(rf_exec_run(e, &x, 1, &out, 1));
        CHECK_VALUES(out, 2, 4, 6);
        rf_array_free(out);
        out = NULL;
        CHECK_OK(rf_exec_run(e, &x, 1, &out, 1));
        CHECK_VALUES(out, 4, 8, 12);
        rf_array_free(out);
    }
    rf_exec_free(e);

    /* Two executables share a freed array: it lives until the last one goes. */
    w = cpu_f32(wv, RF_SHAPE(3));
    rf_exec *e1 = NULL, *e2 = NULL;
    CHECK_OK(rf_compile(double_fn, w, &x, 1, &e1));
    CHECK_OK(rf_compile(read_capture_fn, w, &x, 1, &e2));
    rf_array_free(w);
    if (e1 && e2) {
        rf_array *out = NULL;
        CHECK_OK(rf_exec_run(e1, &x, 1, NULL, 0));
        rf_exec_free(e1);
        e1 = NULL;
        CHECK_OK(rf_exec_run(e2, &x, 1, &out, 1));
        CHECK_VALUES(out, 12, 24, 36);
        rf_array_free(out);
    }
    rf_exec_free(e1);
    rf_exec_free(e2);
    rf_array_free(x);
}

/* ---- The first error sticks -------------------------------------------------------------- */

struct sticky_ctx {
    rf_status after_first, after_second;
    rf_tensor *second;
};

static void sticky_fn(rf_trace *t, void *ctx)
{
    struct sticky_ctx *s = ctx;
    rf_tensor *bad1 = rf_add(rf_arg(t, 0), rf_arg(t, 1)); /* f32[16,8] + f32[16,9] */
    s->after_first = rf_trace_status(t);
    s->second = rf_log(rf_arg(t, 2));                     /* log of i32: also bad */
    s->after_second = rf_trace_status(t);
    rf_tensor *bad3 = rf_matmul(rf_arg(t, 0), rf_arg(t, 0)); /* [16,8] @ [16,8] */
    rf_trace_fail(t, RF_E_DOMAIN, "user check failed");
    rf_return(t, bad1);
    rf_return(t, bad3);
}

struct fail_ctx {
    rf_status after;
};

static void user_fail_fn(rf_trace *t, void *ctx)
{
    struct fail_ctx *f = ctx;
    rf_trace_fail(t, RF_E_DOMAIN, "my_layer: width %d is not positive", -3);
    f->after = rf_trace_status(t);
    rf_return(t, rf_arg(t, 0));
}

static void test_sticky(void)
{
    rf_array *args[3] = {cpu_zeros(RF_F32, RF_SHAPE(16, 8)), cpu_zeros(RF_F32, RF_SHAPE(16, 9)),
                         cpu_zeros(RF_I32, RF_SHAPE(4))};
    struct sticky_ctx s = {RF_OK, RF_OK, NULL};
    rf_exec *e = NULL;
    CHECK_STATUS(rf_compile(sticky_fn, &s, args, 3, &e), RF_E_SHAPE);
    CHECK_MSG("rf_add");
    CHECK_MSG("f32[16,8]");
    CHECK_MSG("f32[16,9]");
    CHECK(strstr(rf_errmsg(), "log") == NULL);
    CHECK(strstr(rf_errmsg(), "user check") == NULL);
    CHECK(e == NULL);
    CHECK(s.after_first == RF_E_SHAPE);
    CHECK(s.after_second == RF_E_SHAPE);
    CHECK(s.second == NULL);

    /* rf_trace_fail on its own is reported as given. */
    struct fail_ctx f = {RF_OK};
    CHECK_STATUS(rf_compile(user_fail_fn, &f, args, 1, &e), RF_E_DOMAIN);
    CHECK_MSG("my_layer: width -3 is not positive");
    CHECK(f.after == RF_E_DOMAIN);
    CHECK(e == NULL);
    for (int i = 0; i < 3; i++)
        rf_array_free(args[i]);
}

/* ---- Outputs ----------------------------------------------------------------------------- */

static void nothing_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    (void)rf_arg(t, 0);
}

static void test_outputs(void)
{
    rf_array *x = cpu_zeros(RF_F32, RF_SHAPE(2));
    rf_exec *e = NULL;
    CHECK_STATUS(rf_compile(nothing_fn, NULL, &x, 1, &e), RF_E_INVALID);
    CHECK(e == NULL);
    CHECK(rf_errmsg()[0] != '\0');
    rf_array *outs[2] = {NULL, NULL};
    CHECK_STATUS(rf_jit(nothing_fn, NULL, &x, 1, outs, 1), RF_E_INVALID);
    CHECK(outs[0] == NULL);

    CHECK_OK(rf_compile(identity_fn, NULL, &x, 1, &e));
    if (e) {
        CHECK_STATUS(rf_exec_run(e, &x, 1, outs, 2), RF_E_INVALID);
        CHECK_MSG("2");
        CHECK(outs[0] == NULL && outs[1] == NULL);
        rf_array_free(outs[0]);
        rf_array_free(outs[1]);
        outs[0] = outs[1] = NULL;
    }
    rf_exec_free(e);
    CHECK_STATUS(rf_jit(identity_fn, NULL, &x, 1, outs, 2), RF_E_INVALID);
    CHECK(outs[0] == NULL && outs[1] == NULL);
    rf_array_free(outs[0]);
    rf_array_free(outs[1]);
    rf_array_free(x);
}

/* ---- Numbers, dims, ranks ---------------------------------------------------------------- */

static rf_tensor *build_full_negative(rf_trace *t)
{
    (void)rf_arg(t, 0);
    return rf_full(t, RF_F32, RF_SHAPE(2, -3), 1.0);
}

static rf_tensor *build_reshape_rank9(rf_trace *t)
{
    return rf_reshape(rf_arg(t, 0), RF_SHAPE(1, 1, 1, 1, 1, 1, 1, 1, 1));
}

static rf_tensor *build_reshape_two_minus1(rf_trace *t)
{
    return rf_reshape(rf_arg(t, 0), RF_SHAPE(-1, -1));
}

static void test_numbers_and_dims(void)
{
    float two[2] = {1, 2};
    rf_array *a = rf_array_from(RF_F32, RF_SHAPE(2), two);
    CHECK(a != NULL);
    rf_clear_error();
    CHECK(rf_errstatus() == RF_OK);
    CHECK(isnan(rf_to_number(a)));
    CHECK(rf_errstatus() == RF_E_SHAPE); /* what the NaN failed with */
    CHECK_MSG("rf_to_number");
    CHECK_MSG("f32[2]");
    rf_array *rows = rf_array_rows(a, 1, 3);
    CHECK(!rows && rf_errstatus() == RF_E_SHAPE);
    rf_array_free(a);
    a = rf_array_from(RF_F32, RF_SHAPE(1, 1), two);
    CHECK(rf_to_number(a) == 1.0);
    CHECK(rf_errstatus() == RF_E_SHAPE); /* a success leaves it, like the message */
    rf_clear_error();
    CHECK(rf_errstatus() == RF_OK && rf_errmsg()[0] == '\0');
    rf_array_free(a);
    CHECK(!rf_device_cuda(0) && rf_errstatus() == RF_E_DEVICE);
    a = rf_randn(RF_I32, RF_SHAPE(2), 1);
    CHECK(!a && rf_errstatus() == RF_E_DTYPE);

    rf_clear_error();
    a = rf_array_from(RF_F32, RF_SHAPE(2, -1), NULL);
    CHECK(a == NULL);
    CHECK_MSG("-1");
    rf_array_free(a);
    a = rf_zeros(RF_F32, RF_SHAPE(-5));
    CHECK(a == NULL);
    rf_array_free(a);
    a = rf_array_new(rf_device_cpu(), RF_F32, RF_SHAPE(3, -2), NULL);
    CHECK(a == NULL);
    rf_array_free(a);

    rf_clear_error();
    a = rf_array_from(RF_F32, RF_SHAPE(1, 1, 1, 1, 1, 1, 1, 1, 1), two);
    CHECK(a == NULL);
    CHECK_MSG("9");
    rf_array_free(a);
    a = rf_array_from(RF_F32, RF_SHAPE(1), two);
    rf_array *b = rf_array_from(RF_F32, (const int64_t[]){1}, -1, two);
    CHECK(b == NULL);
    rf_array_free(b);
    b = rf_array_from((rf_dtype)99, RF_SHAPE(1), two);
    CHECK(b == NULL);
    rf_array_free(b);
    b = rf_randn(RF_I32, RF_SHAPE(2), 1);
    CHECK(b == NULL);
    rf_array_free(b);
    rf_array_free(a);

    rf_array *x = cpu_zeros(RF_F32, RF_SHAPE(2, 3));
    EXPECT_OP_ERROR(build_full_negative, &x, 1, RF_E_INVALID, "-3");
    EXPECT_OP_ERROR(build_reshape_rank9, &x, 1, RF_E_INVALID, "reshape");
    EXPECT_OP_ERROR2(build_reshape_two_minus1, &x, 1, RF_E_INVALID, RF_E_SHAPE, "reshape");
    rf_array_free(x);
}

/* ---- Backend selection ------------------------------------------------------------------- */

static void test_backend_env(void)
{
    rf_array *x = cpu_zeros(RF_F32, RF_SHAPE(2));
    rf_exec *e = NULL;
    setenv("RF_BACKEND", "bogus", 1);
    CHECK_STATUS(rf_compile(identity_fn, NULL, &x, 1, &e), RF_E_UNSUPPORTED);
    CHECK_MSG("bogus");
    CHECK(e == NULL);
    setenv("RF_BACKEND", "interp", 1);
    CHECK_OK(rf_compile(identity_fn, NULL, &x, 1, &e));
    if (e)
        CHECK(strcmp(rf_exec_backend_name(e), "interp") == 0);
    rf_exec_free(e);
    e = NULL;
    unsetenv("RF_BACKEND");
    CHECK_OK(rf_compile(identity_fn, NULL, &x, 1, &e));
    rf_exec_free(e);
    rf_array_free(x);
}

/* ---- RF_CHECK's report and its tolerance ----------------------------------------------------- */

static void mul_add_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_return(t, rf_add(rf_mul(rf_arg(t, 0), rf_arg(t, 0)), rf_arg(t, 1)));
}

typedef struct compare_case {
    rf_cmp dir;
    double than;
} compare_case;

/* x * x + z compared with a constant. */
static void mul_add_compare_fn(rf_trace *t, void *ctx)
{
    const compare_case *c = ctx;
    rf_tensor *v = rf_add(rf_mul(rf_arg(t, 0), rf_arg(t, 0)), rf_arg(t, 1));
    rf_return(t, rf_compare(v, rf_scalar(t, c->than), c->dir));
}

/* With the inputs below, where the compiled x * x + z is 0.0625 and the
 * interpreter's 0: `== 0` flips between them, and RF_CHECK=1 accepts it end
 * to end, as the interpreter's operands are equal (a flip within rounding);
 * `> 0.03` flips too, with operands 0.03 apart, 3750 tolerances: end to end
 * (RF_CHECK_STEPS=0) reported at 1 and accepted at RF_CHECK=1e6; step by
 * step accepted, as x * x rounded one unit in the last place up makes the
 * interpreter's compare true as well. */
static void check_compare_tolerance(rf_array *const *in)
{
    compare_case eq0 = {RF_EQ, 0}, gt = {RF_GT, 0.03};
    rf_array *y = NULL;
    setenv("RF_CHECK", "1", 1);
    setenv("RF_CHECK_STEPS", "0", 1);
    CHECK_OK(rf_jit(mul_add_compare_fn, &eq0, in, 2, &y, 1));
    bool flag = true;
    CHECK_OK(rf_array_read(y, &flag, sizeof flag));
    CHECK(!flag); /* the compiled result, 0.0625 == 0 */
    rf_array_free(y);
    y = NULL;
    CHECK_STATUS(rf_jit(mul_add_compare_fn, &gt, in, 2, &y, 1), RF_E_INTERNAL);
    CHECK_MSG("element 0 is 1, the interpreter's 0, comparing the interpreter's 0 with the "
              "interpreter's 0.0299999993: 3.75e+03 tolerances apart");
    CHECK(y == NULL);
    setenv("RF_CHECK", "1e6", 1);
    CHECK_OK(rf_jit(mul_add_compare_fn, &gt, in, 2, &y, 1));
    rf_array_free(y);
    y = NULL;
    setenv("RF_CHECK", "1", 1);
    unsetenv("RF_CHECK_STEPS");
    CHECK_OK(rf_jit(mul_add_compare_fn, &gt, in, 2, &y, 1));
    rf_array_free(y);
}

/* exp(x), and (exp(x) - c) * 1e7 where c is the interpreter's exp(x) (exp in
 * double, rounded to f32): the second output is 0 in the interpreter and 1e7
 * times the last-bit differences of the vectorised exp in the compiled
 * run, rounding magnified by a later step. */
static void magnified_exp_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *g = rf_exp(rf_arg(t, 0));
    rf_return(t, g);
    rf_return(t, rf_mul_s(rf_sub(g, rf_arg(t, 1)), 1e7));
}

static void dot_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_return(t, rf_matmul(rf_arg(t, 0), rf_arg(t, 1)));
}

/* The program's run is an RF_CHECK mismatch end to end (RF_CHECK_STEPS=0,
 * naming `mismatch`) and passes step by step, leaving no message of a failure. */
static void check_steps_accept(rf_trace_fn fn, rf_array **in, int n_out, const char *mismatch)
{
    rf_array *y[2] = {NULL, NULL};
    setenv("RF_CHECK", "1", 1);
    setenv("RF_CHECK_STEPS", "0", 1);
    CHECK_STATUS(rf_jit(fn, NULL, in, 2, y, n_out), RF_E_INTERNAL);
    CHECK_MSG(mismatch);
    CHECK(y[0] == NULL);
    unsetenv("RF_CHECK_STEPS");
    rf_clear_error();
    CHECK_OK(rf_jit(fn, NULL, in, 2, y, n_out));
    CHECK(strcmp(rf_errmsg(), "") == 0);
    rf_array_free(y[0]);
    rf_array_free(y[1]);
}

/* Rounding a later step magnifies, and a long sum's rounding, which scales
 * with its terms rather than its result: end to end those are mismatches,
 * step by step (each step on the values it read, a sum within the rounding
 * of its terms' magnitudes) they are not. */
static void test_check_steps(void)
{
    enum { N = 1024, DOT = 4096 };
    float *x = malloc(N * sizeof *x), *c = malloc(N * sizeof *c), *e = malloc(N * sizeof *e);
    float *terms = malloc(DOT * sizeof *terms), *ones = malloc(DOT * sizeof *ones);
    CHECK(x && c && e && terms && ones);
    if (!x || !c || !e || !terms || !ones)
        return;
    for (int i = 0; i < N; i++) {
        x[i] = -10.0f + 20.0f * (float)i / N;
        c[i] = (float)exp((double)x[i]);
    }
    rf_array *in[2] = {cpu_f32(x, RF_SHAPE(N)), cpu_f32(c, RF_SHAPE(N))};
    unsetenv("RF_CHECK");
    rf_array *y[2] = {NULL, NULL};
    CHECK_OK(rf_jit(magnified_exp_fn, NULL, in, 2, y, 1));
    CHECK_OK(rf_array_read(y[0], e, N * sizeof *e));
    rf_array_free(y[0]);
    bool differs = false;
    for (int i = 0; i < N; i++)
        differs = differs || e[i] != c[i];
    if (differs)
        check_steps_accept(magnified_exp_fn, in, 2, "RF_CHECK: output 1 (%");
    else
        printf("RF_CHECK steps: the compiled exp rounds as the interpreter's, not made\n");
    rf_array_free(in[0]);
    rf_array_free(in[1]);

    /* terms of +-1e4 whose exact sum is 0.5 plus the last one's rounding */
    double sum = 0;
    uint32_t r = 12345;
    for (int i = 0; i < DOT - 1; i++) {
        r = r * 1664525u + 1013904223u;
        terms[i] = (float)(((double)(r >> 8) / (1 << 24) - 0.5) * 2e4);
        sum += terms[i];
        ones[i] = 1;
    }
    terms[DOT - 1] = (float)(0.5 - sum);
    ones[DOT - 1] = 1;
    double exact = sum + terms[DOT - 1];
    rf_array *dot_in[2] = {cpu_f32(terms, RF_SHAPE(1, DOT)), cpu_f32(ones, RF_SHAPE(DOT, 1))};
    float got = 0;
    CHECK_OK(rf_jit(dot_fn, NULL, dot_in, 2, y, 1));
    CHECK_OK(rf_array_read(y[0], &got, sizeof got));
    rf_array_free(y[0]);
    if (fabs(got - exact) > 1e-6 + 1e-4 * fabs(exact))
        check_steps_accept(dot_fn, dot_in, 1, "RF_CHECK: output 0 (%");
    else
        printf("RF_CHECK steps: the compiled sum is exact, not made\n");
    rf_array_free(dot_in[0]);
    rf_array_free(dot_in[1]);
    free(x);
    free(c);
    free(e);
    free(terms);
    free(ones);
}

/* x * x + z with x = 1024.25, z = -1049088: the product rounded to f32 is
 * 1049088 (a tie, to even), so the interpreter's result is 0; fused into one
 * multiply-add, as the compiled loops are where the CPU has one, it is
 * 0.0625, 62500 tolerances from 0. End to end (RF_CHECK_STEPS=0) RF_CHECK=1
 * reports that and RF_CHECK=1e6 accepts it; step by step RF_CHECK=1 accepts
 * it, as the product rounded one unit in the last place either way moves
 * the interpreter's result by 0.125. A compare of it is judged by its
 * operands (above). */
static void test_check_tolerance(void)
{
    const char *backend = getenv("RF_BACKEND"), *check = getenv("RF_CHECK");
    char *saved_backend = backend ? strdup(backend) : NULL;
    char *saved_check = check ? strdup(check) : NULL;
    rf_array *in[2] = {cpu_f32((const float[]){1024.25f}, RF_SHAPE(1)),
                       cpu_f32((const float[]){-1049088.0f}, RF_SHAPE(1))};
    setenv("RF_BACKEND", "cpu", 1);
    unsetenv("RF_CHECK");
    rf_array *y = NULL;
    CHECK_OK(rf_jit(mul_add_fn, NULL, in, 2, &y, 1));
    float fused = 0;
    CHECK_OK(rf_array_read(y, &fused, sizeof fused));
    rf_array_free(y);
    if (fused == 0.0f) {
        printf("RF_CHECK tolerance: no fused multiply-add on this CPU, the mismatch is not made\n");
    } else {
        CHECK(fused == 0.0625f);
        setenv("RF_CHECK", "1", 1);
        setenv("RF_CHECK_STEPS", "0", 1);
        y = NULL;
        CHECK_STATUS(rf_jit(mul_add_fn, NULL, in, 2, &y, 1), RF_E_INTERNAL);
        CHECK_MSG("RF_CHECK: output 0 (%");
        CHECK_MSG(" add) element 0 is 0.0625, the interpreter's 0: 6.25e+04 tolerances apart");
        CHECK(y == NULL);
        setenv("RF_CHECK", "1e6", 1);
        CHECK_OK(rf_jit(mul_add_fn, NULL, in, 2, &y, 1));
        rf_array_free(y);
        y = NULL;
        setenv("RF_CHECK", "1", 1);
        unsetenv("RF_CHECK_STEPS");
        CHECK_OK(rf_jit(mul_add_fn, NULL, in, 2, &y, 1)); /* x * x rounded another way */
        rf_array_free(y);
        check_compare_tolerance(in);
    }
    test_check_steps();
    rf_array_free(in[0]);
    rf_array_free(in[1]);
    saved_backend ? setenv("RF_BACKEND", saved_backend, 1) : unsetenv("RF_BACKEND");
    saved_check ? setenv("RF_CHECK", saved_check, 1) : unsetenv("RF_CHECK");
    free(saved_backend);
    free(saved_check);
}

/* ---- A failed run leaves captured state unchanged ---------------------------------------- */

/* w <- w + x; returns sum(x). */
static void accumulate_fn(rf_trace *t, void *ctx)
{
    rf_tensor *x = rf_arg(t, 0);
    rf_assign(t, ctx, rf_add(rf_capture(t, ctx), x));
    rf_return(t, rf_sum_all(x));
}

static void assign_shape_fn(rf_trace *t, void *ctx)
{
    rf_assign(t, ctx, rf_arg(t, 0)); /* w is f32[2,3], the value f32[3] */
    rf_return(t, rf_arg(t, 0));
}

static void test_failed_run_keeps_state(void)
{
    float wv[3] = {1, 2, 3}, xv[3] = {1, 1, 1};
    rf_array *w = cpu_f32(wv, RF_SHAPE(3));
    rf_array *x = cpu_f32(xv, RF_SHAPE(3));
    rf_array *x4 = cpu_zeros(RF_F32, RF_SHAPE(4));
    rf_array *xi = cpu_zeros(RF_I32, RF_SHAPE(3));
    rf_array *xh = rf_array_from(RF_F32, RF_SHAPE(3), xv);
    rf_exec *e = NULL;
    CHECK_OK(rf_compile(accumulate_fn, w, &x, 1, &e));
    if (e) {
        rf_array *outs[2] = {NULL, NULL};
        CHECK_STATUS(rf_exec_run(e, &x4, 1, outs, 1), RF_E_SHAPE);
        CHECK_MSG("f32[3]");
        CHECK_MSG("f32[4]");
        CHECK_STATUS(rf_exec_run(e, &xi, 1, outs, 1), RF_E_DTYPE);
        CHECK_MSG("f32[3]");
        CHECK_MSG("i32[3]");
        CHECK_STATUS(rf_exec_run(e, &xh, 1, outs, 1), RF_E_DEVICE);
        CHECK_STATUS(rf_exec_run(e, &x, 1, outs, 2), RF_E_INVALID);
        CHECK_STATUS(rf_exec_run(e, &x, 2, outs, 1), RF_E_INVALID);
        CHECK(outs[0] == NULL && outs[1] == NULL);
        CHECK_VALUES(w, 1, 2, 3);
        CHECK_OK(rf_exec_run(e, &x, 1, outs, 1));
        CHECK_VALUES(w, 2, 3, 4);
        CHECK_VALUES(outs[0], 3);
        rf_array_free(outs[0]);
    }
    rf_exec_free(e);

    rf_array *w23 = cpu_zeros(RF_F32, RF_SHAPE(2, 3));
    e = NULL;
    CHECK_STATUS(rf_compile(assign_shape_fn, w23, &x, 1, &e), RF_E_SHAPE);
    CHECK_MSG("rf_assign");
    CHECK_MSG("f32[2,3]");
    CHECK_MSG("f32[3]");
    CHECK(e == NULL);
    CHECK(rf_compile(assign_shape_fn, w23, &xi, 1, &e) != RF_OK); /* shape and dtype differ */
    CHECK_MSG("rf_assign");
    CHECK(e == NULL);

    rf_array_free(w23);
    rf_array_free(w);
    rf_array_free(x);
    rf_array_free(x4);
    rf_array_free(xi);
    rf_array_free(xh);
}

/* An output that is a captured array updated by the same program: the output
 * holds the old value and is an array of its own (not an alias of w). */
static void return_capture_fn(rf_trace *t, void *ctx)
{
    rf_tensor *w = rf_capture(t, ctx);
    rf_assign(t, ctx, rf_add(w, rf_arg(t, 0)));
    rf_return(t, w);
}

static void test_output_not_aliased(void)
{
    float wv[3] = {1, 2, 3}, xv[3] = {1, 1, 1};
    rf_array *w = cpu_f32(wv, RF_SHAPE(3));
    rf_array *x = cpu_f32(xv, RF_SHAPE(3));
    rf_exec *e = NULL;
    CHECK_OK(rf_compile(return_capture_fn, w, &x, 1, &e));
    if (e) {
        rf_array *o1 = NULL, *o2 = NULL;
        CHECK_OK(rf_exec_run(e, &x, 1, &o1, 1));
        CHECK_VALUES(o1, 1, 2, 3);
        CHECK_VALUES(w, 2, 3, 4);
        CHECK(o1 != w);
        CHECK_OK(rf_exec_run(e, &x, 1, &o2, 1));
        CHECK_VALUES(o2, 2, 3, 4);
        CHECK_VALUES(o1, 1, 2, 3);
        CHECK_VALUES(w, 3, 4, 5);
        rf_array_free(o1);
        rf_array_free(o2);
    }
    rf_exec_free(e);
    rf_array_free(w);
    rf_array_free(x);
}

/* ---- Gradients of bad things ------------------------------------------------------------- */

struct grad_ctx {
    rf_status st;
    rf_tensor *out;
};

static void grad_nonscalar_fn(rf_trace *t, void *ctx)
{
    struct grad_ctx *g = ctx;
    rf_tensor *x = rf_arg(t, 0);
    g->st = rf_grad(t, rf_mul(x, x), &x, 1, &g->out); /* y is f32[2,3], not a scalar */
    rf_return(t, g->out);
}

/* A weak scalar's uses each take their own dtype (here f64), so it has no gradient. */
static void grad_weak_fn(rf_trace *t, void *ctx)
{
    struct grad_ctx *g = ctx;
    rf_tensor *x = rf_arg(t, 0), *s = rf_scalar(t, 2);
    g->st = rf_grad(t, rf_sum_all(rf_mul(x, s)), &s, 1, &g->out);
    rf_return(t, g->out);
}

static void test_grad_errors(void)
{
    rf_array *x = cpu_zeros(RF_F32, RF_SHAPE(2, 3));
    struct grad_ctx g = {RF_OK, (rf_tensor *)&g};
    rf_exec *e = NULL;
    rf_status st = rf_compile(grad_nonscalar_fn, &g, &x, 1, &e);
    CHECK(st != RF_OK);
    CHECK(g.st != RF_OK);
    CHECK(g.out == NULL);
    CHECK_MSG("rf_grad");
    CHECK_MSG("f32[2,3]");
    CHECK(e == NULL);
    rf_array_free(x);

    for (int k = 0; k < 2; k++) { /* f64 made a typed copy (the gradient was 0); f32 did not */
        x = cpu_zeros(k ? RF_F32 : RF_F64, RF_SHAPE(3));
        g = (struct grad_ctx){RF_OK, (rf_tensor *)&g};
        CHECK(rf_compile(grad_weak_fn, &g, &x, 1, &e) == RF_E_INVALID);
        CHECK(g.st == RF_E_INVALID && g.out == NULL && e == NULL);
        CHECK_MSG("rf_grad: wrt[0] is a weak scalar (rf_scalar)");
        rf_array_free(x);
    }
}

int main(void)
{
    test_shapes();
    test_dtypes();
    test_nulls();
    test_arg_counts();
    test_host_arrays();
    test_mixing_traces();
    test_freed_while_captured();
    test_sticky();
    test_outputs();
    test_numbers_and_dims();
    test_backend_env();
    test_check_tolerance();
    test_failed_run_keeps_state();
    test_output_not_aliased();
    test_grad_errors();
    return tu_finish("test_errors");
}
