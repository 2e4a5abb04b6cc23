/* test_program_hash.c: the IR printer and the structural program hash, seen
 * through rf_trace_text (and rf_exec_hash / rf_exec_program_text).
 *
 * The hash must be a function of the program's structure only: the same
 * program traced twice, or built with independent subexpressions in another
 * order, or capturing other arrays of the same type, hashes the same; any
 * change of an attribute (transpose perm, slice stride, reduce axis, conv
 * stride, constant value, dtype, compare direction, output order, update
 * order, argument type) changes it. The printer writes one line per node
 * naming the op. Does not test the compile cache that will key on the hash.
 */
#include "test_util.h"

/* ---- A program with one knob per attribute ------------------------------------------- */

struct cfg {
    int64_t perm[3];    /* transpose of c [3,3,3] */
    int64_t stride;     /* slice of x [4,6] along dim 1: start 0, limit 4 */
    int64_t axis;       /* sum of c over this axis */
    int64_t conv_stride;/* conv of img [1,1,4,4] with k [1,1,3,3]: 2 and 3 give [1,1,1,1] */
    double cval;        /* x + cval */
    rf_dtype cvt;       /* convert(x) to this dtype */
    rf_cmp cmp;         /* compare(x, tanh(x)) */
    bool swap;          /* return (exp, tanh) instead of (tanh, exp) */
};

static const struct cfg base_cfg = {{1, 0, 2}, 2, 0, 2, 1.5, RF_F64, RF_LT, false};

static void program_fn(rf_trace *t, void *ctx)
{
    const struct cfg *c = ctx;
    rf_tensor *x = rf_arg(t, 0), *cube = rf_arg(t, 1), *img = rf_arg(t, 2), *k = rf_arg(t, 3);

    rf_return(t, rf_transpose(cube, c->perm));

    const int64_t start[2] = {0, 0}, limit[2] = {4, 4}, stride[2] = {1, c->stride};
    rf_return(t, rf_slice(x, start, limit, stride));

    rf_return(t, rf_sum(cube, &c->axis, 1, false));

    rf_conv_params p = rf_conv_params_default(2);
    p.stride[0] = p.stride[1] = c->conv_stride;
    rf_return(t, rf_conv(img, k, &p));

    rf_return(t, rf_add(x, rf_scalar(t, c->cval)));
    rf_return(t, rf_convert(x, c->cvt));
    rf_return(t, rf_compare(x, rf_tanh(x), c->cmp));

    rf_tensor *a = rf_tanh(x), *b = rf_exp(x);
    rf_return(t, c->swap ? b : a);
    rf_return(t, c->swap ? a : b);
}

struct args {
    rf_array *a[4];
};

static void make_args(struct args *g)
{
    rf_device *cpu = rf_device_cpu();
    g->a[0] = rf_array_new(cpu, RF_F32, RF_SHAPE(4, 6), NULL);
    g->a[1] = rf_array_new(cpu, RF_F32, RF_SHAPE(3, 3, 3), NULL);
    g->a[2] = rf_array_new(cpu, RF_F32, RF_SHAPE(1, 1, 4, 4), NULL);
    g->a[3] = rf_array_new(cpu, RF_F32, RF_SHAPE(1, 1, 3, 3), NULL);
    for (int i = 0; i < 4; i++)
        CHECK(g->a[i] != NULL);
}

static void free_args(struct args *g)
{
    for (int i = 0; i < 4; i++)
        rf_array_free(g->a[i]);
}

/* Traces fn and returns its hash; *text (if not NULL) receives the text (free()). */
static uint64_t trace_hash_at(int line, rf_trace_fn fn, void *ctx, rf_array **args, int nargs,
                              char **text)
{
    char *txt = NULL;
    uint64_t h = 0;
    rf_status st = rf_trace_text(fn, ctx, args, nargs, &txt, &h);
    tu_checks++;
    if (st != RF_OK || !txt) {
        tu_failures++;
        fprintf(stderr, "%s:%d: rf_trace_text failed: %s (%s)\n", __FILE__, line,
                rf_status_str(st), rf_errmsg());
    }
    if (text)
        *text = txt;
    else
        free(txt);
    return h;
}
#define TRACE_HASH(fn, ctx, args, nargs, text) trace_hash_at(__LINE__, fn, ctx, args, nargs, text)

/* Counts the lines of text that define a node ("%N = ..."). */
static int count_node_lines(const char *text)
{
    int n = 0;
    for (const char *p = text; p && *p;) {
        const char *eol = strchr(p, '\n');
        size_t len = eol ? (size_t)(eol - p) : strlen(p);
        int id, used = 0;
        if (len > 0 && sscanf(p, " %%%d = %n", &id, &used) == 1 && used > 0)
            n++;
        p = eol ? eol + 1 : p + len;
    }
    return n;
}

/* ---- Tests ------------------------------------------------------------------------------- */

static void test_same_program_same_hash(void)
{
    struct args g;
    make_args(&g);
    struct cfg c = base_cfg;
    char *t1 = NULL, *t2 = NULL;
    uint64_t h1 = TRACE_HASH(program_fn, &c, g.a, 4, &t1);
    uint64_t h2 = TRACE_HASH(program_fn, &c, g.a, 4, &t2);
    CHECK(h1 == h2);
    CHECK(h1 != 0);
    CHECK(t1 && t2 && strcmp(t1, t2) == 0);
    free(t1);
    free(t2);

    /* Other arrays of the same types: the hash does not see pointers. */
    struct args g2;
    make_args(&g2);
    CHECK(TRACE_HASH(program_fn, &c, g2.a, 4, NULL) == h1);
    free_args(&g2);

    /* The compiled program's hash is stable across compiles too. */
    rf_exec *e1 = NULL, *e2 = NULL;
    CHECK_OK(rf_compile(program_fn, &c, g.a, 4, &e1));
    CHECK_OK(rf_compile(program_fn, &c, g.a, 4, &e2));
    if (e1 && e2) {
        CHECK(rf_exec_hash(e1) == rf_exec_hash(e2));
        CHECK(strcmp(rf_exec_program_text(e1), rf_exec_program_text(e2)) == 0);
        CHECK(count_node_lines(rf_exec_program_text(e1)) > 0);
    }
    rf_exec_free(e1);
    rf_exec_free(e2);
    free_args(&g);
}

/* Each single attribute change gives a different hash. */
static void test_attribute_changes(void)
{
    struct args g;
    make_args(&g);
    struct cfg c = base_cfg;
    uint64_t base = TRACE_HASH(program_fn, &c, g.a, 4, NULL);

    struct {
        const char *what;
        struct cfg c;
    } variants[9];
    int n = 0;
    for (int i = 0; i < 9; i++)
        variants[i].c = base_cfg;
    variants[n].what = "transpose perm";
    variants[n].c.perm[0] = 2, variants[n].c.perm[1] = 1, variants[n].c.perm[2] = 0, n++;
    variants[n].what = "slice stride";
    variants[n].c.stride = 3, n++;
    variants[n].what = "reduce axis";
    variants[n].c.axis = 1, n++;
    variants[n].what = "conv stride";
    variants[n].c.conv_stride = 3, n++;
    variants[n].what = "constant value";
    variants[n].c.cval = 2.5, n++;
    variants[n].what = "convert dtype";
    variants[n].c.cvt = RF_I32, n++;
    variants[n].what = "compare direction";
    variants[n].c.cmp = RF_GT, n++;
    variants[n].what = "output order";
    variants[n].c.swap = true, n++;
    variants[n].what = "constant value (tiny change)";
    variants[n].c.cval = 1.5000001, n++;

    uint64_t hashes[9];
    for (int i = 0; i < n; i++) {
        hashes[i] = TRACE_HASH(program_fn, &variants[i].c, g.a, 4, NULL);
        tu_checks++;
        if (hashes[i] == base) {
            tu_failures++;
            fprintf(stderr, "%s:%d: changing the %s does not change the hash\n", __FILE__,
                    __LINE__, variants[i].what);
        }
    }
    /* And the variants differ from each other. */
    for (int i = 0; i < n; i++)
        for (int j = i + 1; j < n; j++)
            CHECK(hashes[i] != hashes[j]);
    free_args(&g);
}

/* Independent subexpressions built in another order: same structure, same hash. */
static void order_fn(rf_trace *t, void *ctx)
{
    bool swap = *(const bool *)ctx;
    rf_tensor *x = rf_arg(t, 0), *y = rf_arg(t, 1);
    rf_tensor *p, *q;
    if (!swap) {
        p = rf_tanh(rf_mul(x, x));
        q = rf_exp(rf_sub_s(y, 1.0));
    } else {
        q = rf_exp(rf_sub_s(y, 1.0));
        p = rf_tanh(rf_mul(x, x));
    }
    rf_return(t, rf_add(p, q));
    rf_return(t, q);
}

static void test_build_order(void)
{
    rf_array *args[2] = {rf_array_new(rf_device_cpu(), RF_F32, RF_SHAPE(5), NULL),
                         rf_array_new(rf_device_cpu(), RF_F32, RF_SHAPE(5), NULL)};
    bool no = false, yes = true;
    char *t1 = NULL, *t2 = NULL;
    uint64_t h1 = TRACE_HASH(order_fn, &no, args, 2, &t1);
    uint64_t h2 = TRACE_HASH(order_fn, &yes, args, 2, &t2);
    CHECK(h1 == h2);
    /* The texts differ only in node numbering. */
    CHECK(t1 && t2 && count_node_lines(t1) == count_node_lines(t2));
    free(t1);
    free(t2);
    rf_array_free(args[0]);
    rf_array_free(args[1]);
}

/* Argument and capture types enter the hash; argument identity does not. */
static void sum_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_return(t, rf_sum_all(rf_arg(t, 0)));
}

static void unused_arg_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_return(t, rf_sum_all(rf_arg(t, 0)));
    (void)rf_arg(t, 1);
}

static void test_types_in_hash(void)
{
    rf_to_opts keep = {.keep_f64 = true};
    rf_array *h64 = rf_zeros(RF_F64, RF_SHAPE(3));
    rf_array *a32 = rf_array_new(rf_device_cpu(), RF_F32, RF_SHAPE(3), NULL);
    rf_array *a64 = rf_array_to_opts(h64, rf_device_cpu(), &keep);
    rf_array *a4 = rf_array_new(rf_device_cpu(), RF_F32, RF_SHAPE(4), NULL);
    CHECK(a64 != NULL && rf_array_dtype(a64) == RF_F64);
    uint64_t h_f32 = TRACE_HASH(sum_fn, NULL, &a32, 1, NULL);
    uint64_t h_f64 = TRACE_HASH(sum_fn, NULL, &a64, 1, NULL);
    uint64_t h_4 = TRACE_HASH(sum_fn, NULL, &a4, 1, NULL);
    CHECK(h_f32 != h_f64);
    CHECK(h_f32 != h_4);

    /* An unused extra argument's type still belongs to the program's signature. */
    rf_array *two_a[2] = {a32, a32}, *two_b[2] = {a32, a4};
    uint64_t hu1 = TRACE_HASH(unused_arg_fn, NULL, two_a, 2, NULL);
    uint64_t hu2 = TRACE_HASH(unused_arg_fn, NULL, two_b, 2, NULL);
    CHECK(hu1 != hu2);
    CHECK(hu1 != h_f32);

    rf_array_free(h64);
    rf_array_free(a32);
    rf_array_free(a64);
    rf_array_free(a4);
}

/* Updates: their order and target enter the hash. */
struct upd_ctx {
    rf_array *w1, *w2;
    bool swap;
};

static void update_fn(rf_trace *t, void *ctx)
{
    struct upd_ctx *u = ctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_tensor *c1 = rf_capture(t, u->w1), *c2 = rf_capture(t, u->w2);
    if (!u->swap) {
        rf_assign(t, u->w1, rf_add(c1, x));
        rf_assign(t, u->w2, rf_mul(c2, x));
    } else {
        rf_assign(t, u->w2, rf_mul(c2, x));
        rf_assign(t, u->w1, rf_add(c1, x));
    }
    rf_return(t, rf_sum_all(x));
}

static void test_updates_in_hash(void)
{
    rf_array *x = rf_array_new(rf_device_cpu(), RF_F32, RF_SHAPE(3), NULL);
    rf_array *w1 = rf_array_new(rf_device_cpu(), RF_F32, RF_SHAPE(3), NULL);
    rf_array *w2 = rf_array_new(rf_device_cpu(), RF_F32, RF_SHAPE(3), NULL);
    struct upd_ctx u = {w1, w2, false}, v = {w1, w2, true};
    char *text = NULL;
    uint64_t hu = TRACE_HASH(update_fn, &u, &x, 1, &text);
    uint64_t hv = TRACE_HASH(update_fn, &v, &x, 1, NULL);
    CHECK(hu != hv);
    CHECK(text && strstr(text, "update capture0 <- %") != NULL);
    CHECK(text && strstr(text, "update capture1 <- %") != NULL);
    CHECK(text && strstr(text, "capture") != NULL);
    if (text && !strstr(text, "update capture0 <- %"))
        fprintf(stderr, "update text was:\n%s\n", text);
    free(text);
    rf_array_free(x);
    rf_array_free(w1);
    rf_array_free(w2);
}

/* The printer: one line per node naming the op, types, attributes, outputs. */
static void small_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_tensor *y = rf_exp(rf_tanh(x));
    const int64_t axis = 1;
    rf_return(t, rf_reduce(y, RF_REDUCE_SUM, &axis, 1, false));
    rf_return(t, y);
}

static void test_printer(void)
{
    rf_array *x = rf_array_new(rf_device_cpu(), RF_F32, RF_SHAPE(4, 6), NULL);
    char *text = NULL;
    (void)TRACE_HASH(small_fn, NULL, &x, 1, &text);
    CHECK(text != NULL);
    if (text) {
        CHECK(count_node_lines(text) == 4); /* argument, tanh, exp, reduce */
        CHECK(strstr(text, "argument") != NULL);
        CHECK(strstr(text, "index=0") != NULL);
        CHECK(strstr(text, "tanh(%") != NULL);
        CHECK(strstr(text, "exp(%") != NULL);
        CHECK(strstr(text, "reduce(%") != NULL);
        CHECK(strstr(text, "sum") != NULL);
        CHECK(strstr(text, "axes=[1]") != NULL);
        CHECK(strstr(text, ": f32[4,6]") != NULL);
        CHECK(strstr(text, ": f32[4]") != NULL);
        CHECK(strstr(text, "outputs: %") != NULL);
        /* Each node line names a known op right after "= ". */
        const char *ops[] = {"argument", "tanh", "exp", "reduce"};
        int named = 0;
        for (const char *p = text; *p;) {
            const char *eol = strchr(p, '\n');
            int id, used = 0;
            if (sscanf(p, " %%%d = %n", &id, &used) == 1 && used > 0)
                for (int i = 0; i < 4; i++)
                    if (strncmp(p + used, ops[i], strlen(ops[i])) == 0)
                        named++;
            if (!eol)
                break;
            p = eol + 1;
        }
        CHECK(named == 4);
        if (named != 4 || count_node_lines(text) != 4)
            fprintf(stderr, "printer text was:\n%s\n", text);
    }
    free(text);

    /* Errors come back as statuses. */
    text = (char *)&text;
    uint64_t h = 1;
    CHECK_STATUS(rf_trace_text(NULL, NULL, &x, 1, &text, &h), RF_E_INVALID);
    rf_array_free(x);
}

int main(void)
{
    test_same_program_same_hash();
    test_attribute_changes();
    test_build_order();
    test_types_in_hash();
    test_updates_in_hash();
    test_printer();
    return tu_finish("test_program_hash");
}
