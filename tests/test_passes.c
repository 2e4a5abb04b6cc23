/* test_passes.c: the optimisation passes rfi_simplify, rfi_cse,
 * rfi_merge_dots, rfi_stack_dots, rfi_one_pass_moments, rfi_relu_masks and rfi_unroll_pools.
 *
 * Each rewrite is checked on the printed IR (rfi_print) of a small graph
 * built with the internal API, and semantically: the original and the
 * optimised graph run on the reference interpreter with inputs full of
 * corner values (-0.0, NaN, infinities, integer extremes) and must give
 * bitwise equal outputs and updates. Rules that would not be exact (x + 0.0,
 * float x * 0, float operand reordering in CSE) are checked to stay put.
 * Randomised: chains of ops drawn from the rewrite menu, gradient programs
 * from rf_grad, and an MLP training step (forward, backward, Adam update)
 * compiled through the public API, each run through simplify, cse and dce:
 * bitwise equal results and no more nodes (the training step's counts are
 * printed; TP_SHOW=1 also prints its program before and after).
 */
#include "backend/interp/interp.h"
#include "backend/plan.h"
#include "ir/ir.h"
#include "passes/passes.h"
#include "runtime/runtime.h"
#include "test_util.h"

/* ---- Building graphs ---------------------------------------------------------------- */

static rfi_attrs attrs0(void)
{
    rfi_attrs a;
    memset(&a, 0, sizeof a);
    return a;
}

static rfi_attrs list_attr(const int64_t *v, int n)
{
    rfi_attrs a = attrs0();
    a.nl[0] = n;
    for (int i = 0; i < n; i++)
        a.l[0][i] = v[i];
    return a;
}

/* A graph with one argument of each given type (all of rank `rank`, dims `dims`). */
static rfi_graph *graph_with_args(int n, const rf_dtype *dts, const int64_t *dims, int rank)
{
    rfi_graph *g = rfi_graph_new(rf_device_cpu(), "t");
    int ranks[8];
    int64_t d[8][RF_MAX_RANK];
    for (int i = 0; i < n; i++) {
        ranks[i] = rank;
        for (int k = 0; k < rank; k++)
            d[i][k] = dims[k];
    }
    CHECK_OK(rfi_graph_set_args(g, n, dts, ranks, (const int64_t(*)[RF_MAX_RANK])d));
    return g;
}

static rfi_node *node(rfi_graph *g, rfi_op op, rfi_node *const *in, int n_in, const rfi_attrs *a,
                      rf_dtype dt, const int64_t *dims, int rank)
{
    rfi_node *x = rfi_node_new(g, op, in, n_in, a, dt, dims, rank);
    if (!x)
        fprintf(stderr, "  building %s: %s\n", rfi_op_table[op].name, rf_errmsg());
    CHECK(x != NULL);
    return x;
}

static rfi_node *arg(rfi_graph *g, int i)
{
    rfi_attrs a = attrs0();
    a.i[0] = i;
    return node(g, RFI_OP_ARGUMENT, NULL, 0, &a, g->arg_dtypes[i], g->arg_dims[i],
                g->arg_ranks[i]);
}

static rfi_node *un(rfi_graph *g, rfi_op op, rfi_node *x)
{
    return node(g, op, &x, 1, NULL, x->dtype, NULL, 0);
}

static rfi_node *bin(rfi_graph *g, rfi_op op, rfi_node *x, rfi_node *y)
{
    rfi_node *in[2] = {x, y};
    return node(g, op, in, 2, NULL, x->dtype, NULL, 0);
}

static rfi_node *konst(rfi_graph *g, rf_dtype dt, const int64_t *dims, int rank,
                       const void *data)
{
    rfi_attrs a = attrs0();
    a.data = data;
    a.nbytes = (size_t)rfi_numel(dims, rank) * rf_dtype_size(dt);
    return node(g, RFI_OP_CONSTANT, NULL, 0, &a, dt, dims, rank);
}

/* A constant of x's type whose every element is v (a full constant: the pass
 * turns it into its splat form). */
static rfi_node *filled_like(rfi_graph *g, const rfi_node *x, double v)
{
    int64_t n = rfi_node_numel(x);
    unsigned char *buf = calloc((size_t)(n > 0 ? n : 1), 8);
    for (int64_t i = 0; i < n; i++)
        rfi_st_f(buf, x->dtype, i, v);
    rfi_node *c = konst(g, x->dtype, x->dims, x->rank, buf);
    free(buf);
    return c;
}

/* The same, as broadcast_in_dim of a rank-0 constant (already in splat form). */
static rfi_node *splat_like(rfi_graph *g, const rfi_node *x, double v)
{
    unsigned char buf[8] = {0};
    rfi_st_f(buf, x->dtype, 0, v);
    rfi_node *s = konst(g, x->dtype, NULL, 0, buf);
    if (x->rank == 0)
        return s;
    rfi_attrs a = attrs0();
    return node(g, RFI_OP_BROADCAST_IN_DIM, &s, 1, &a, x->dtype, x->dims, x->rank);
}

static rfi_node *reshape(rfi_graph *g, rfi_node *x, const int64_t *dims, int rank)
{
    return node(g, RFI_OP_RESHAPE, &x, 1, NULL, x->dtype, dims, rank);
}

static rfi_node *transpose(rfi_graph *g, rfi_node *x, const int64_t *perm)
{
    rfi_attrs a = list_attr(perm, x->rank);
    return node(g, RFI_OP_TRANSPOSE, &x, 1, &a, x->dtype, NULL, 0);
}

static rfi_node *broadcast(rfi_graph *g, rfi_node *x, const int64_t *map, const int64_t *dims,
                           int rank)
{
    rfi_attrs a = list_attr(map, x->rank);
    return node(g, RFI_OP_BROADCAST_IN_DIM, &x, 1, &a, x->dtype, dims, rank);
}

static rfi_node *convert(rfi_graph *g, rfi_node *x, rf_dtype dt)
{
    return node(g, RFI_OP_CONVERT, &x, 1, NULL, dt, NULL, 0);
}

static rfi_node *select3(rfi_graph *g, rfi_node *p, rfi_node *a, rfi_node *b)
{
    rfi_node *in[3] = {p, a, b};
    return node(g, RFI_OP_SELECT, in, 3, NULL, a->dtype, NULL, 0);
}

/* ---- Running on the interpreter ---------------------------------------------------- */

typedef struct results {
    int n;
    void **buf;
    size_t *nbytes;
} results;

static void results_free(results *r)
{
    for (int i = 0; i < r->n; i++)
        free(r->buf[i]);
    free(r->buf);
    free(r->nbytes);
    memset(r, 0, sizeof *r);
}

/* Runs g (captures read from their arrays) and returns its outputs then updates. */
static rf_status run_graph(const rfi_graph *g, void *const *args, results *r)
{
    r->n = g->n_outputs + g->n_updates;
    r->buf = calloc((size_t)r->n + 1, sizeof *r->buf);
    r->nbytes = calloc((size_t)r->n + 1, sizeof *r->nbytes);
    for (int i = 0; i < r->n; i++) {
        const rfi_node *x = i < g->n_outputs ? g->outputs[i] : g->updates[i - g->n_outputs].value;
        r->nbytes[i] = rfi_node_nbytes(x);
        r->buf[i] = calloc(r->nbytes[i] + 1, 1);
    }
    void *caps[64] = {0};
    for (int i = 0; i < g->n_captures && i < 64; i++)
        caps[i] = g->captures[i]->data;
    void *state = NULL;
    rf_status st = rfi_verify(g);
    if (st == RF_OK)
        st = rfi_interp_backend.prepare(g, &state);
    if (st == RF_OK) {
        rfi_run_io io = {args, caps, r->buf, r->buf + g->n_outputs};
        st = rfi_interp_backend.run(state, g, &io);
        rfi_interp_backend.release(state);
    }
    return st;
}

/* a and b give bitwise equal outputs and updates on args. */
static bool same_results(const rfi_graph *a, const rfi_graph *b, void *const *args)
{
    results ra = {0}, rb = {0};
    rf_status sa = run_graph(a, args, &ra), sb = run_graph(b, args, &rb);
    CHECK_OK(sa);
    CHECK_OK(sb);
    bool same = sa == RF_OK && sb == RF_OK && ra.n == rb.n;
    for (int i = 0; same && i < ra.n; i++) {
        same = ra.nbytes[i] == rb.nbytes[i] && memcmp(ra.buf[i], rb.buf[i], ra.nbytes[i]) == 0;
        if (!same)
            fprintf(stderr, "  result %d differs\n", i);
    }
    results_free(&ra);
    results_free(&rb);
    return same;
}

/* ---- Running the passes ------------------------------------------------------------ */

typedef rf_status (*pass_fn)(const rfi_graph *, rfi_graph **);

/* pass(g), verified (NULL on failure, reported). */
static rfi_graph *apply(pass_fn pass, const rfi_graph *g)
{
    rfi_graph *out = NULL;
    rf_status st = pass(g, &out);
    CHECK_OK(st);
    if (st != RF_OK)
        return NULL;
    CHECK_OK(rfi_verify(out));
    return out;
}

/* simplify, cse, dce in the pipeline's order. */
static rfi_graph *optimise(const rfi_graph *g)
{
    rfi_graph *s = apply(rfi_simplify, g);
    rfi_graph *c = s ? apply(rfi_cse, s) : NULL;
    rfi_graph *d = c ? apply(rfi_dce, c) : NULL;
    rfi_graph_free(s);
    rfi_graph_free(c);
    return d;
}

/* The printed nodes, outputs and updates of g, without the header lines. */
static char *body(const rfi_graph *g)
{
    char *text = rfi_print(g);
    char *start = text ? strstr(text, "\n%") : NULL;
    char *copy = strdup(start ? start + 1 : "");
    rfi_free(text);
    return copy;
}

/* Runs pass over g (whose outputs are set), checks the printed body of the
 * result against want and the results bitwise on args; frees g. */
static void expect(const char *what, pass_fn pass, rfi_graph *g, const char *want,
                   void *const *args)
{
    CHECK_OK(rfi_verify(g));
    rfi_graph *out = apply(pass, g);
    if (out) {
        char *got = body(out);
        tu_checks++;
        if (strcmp(got, want) != 0) {
            tu_failures++;
            fprintf(stderr, "%s: printed IR differs.\n--- got:\n%s--- want:\n%s", what, got, want);
        }
        free(got);
        if (!same_results(g, out, args)) {
            tu_failures++;
            fprintf(stderr, "%s: results differ\n", what);
        }
    }
    rfi_graph_free(out);
    rfi_graph_free(g);
}

/* ---- Inputs ------------------------------------------------------------------------ */

static float f32_in[6];
static double f64_in[6];
static int32_t i32_in[6] = {0, 1, -1, INT32_MAX, INT32_MIN, 7};
static void *const f32_args[] = {f32_in, f32_in, f32_in};
static void *const f64_args[] = {f64_in, f64_in};
static void *const i32_args[] = {i32_in, i32_in};

static void init_inputs(void)
{
    const double v[6] = {-0.0, 0.0, NAN, INFINITY, -1.5, 3.25};
    for (int i = 0; i < 6; i++) {
        f32_in[i] = (float)v[i];
        f64_in[i] = v[i];
    }
    f32_in[2] = -NAN; /* a NaN with the sign bit set: its bits must survive */
}

static const int64_t D23[2] = {2, 3};
static const rf_dtype F32x3[3] = {RF_F32, RF_F32, RF_F32};

/* A graph with f32[2,3] arguments, x = argument 0. */
static rfi_graph *g_f32(int nargs, rfi_node **x)
{
    rfi_graph *g = graph_with_args(nargs, F32x3, D23, 2);
    *x = arg(g, 0);
    return g;
}

/* ---- Identities -------------------------------------------------------------------- */

static void test_add_sub_zero_floats(void)
{
    rfi_node *x;
    rfi_graph *g = g_f32(1, &x);
    rfi_graph_add_output(g, bin(g, RFI_OP_ADD, x, filled_like(g, x, 0.0)));   /* kept */
    rfi_graph_add_output(g, bin(g, RFI_OP_ADD, x, filled_like(g, x, -0.0)));  /* x */
    rfi_graph_add_output(g, bin(g, RFI_OP_ADD, splat_like(g, x, -0.0), x));   /* x */
    rfi_graph_add_output(g, bin(g, RFI_OP_SUB, x, splat_like(g, x, 0.0)));    /* x */
    rfi_graph_add_output(g, bin(g, RFI_OP_SUB, x, splat_like(g, x, -0.0)));   /* kept */
    rfi_graph_add_output(g, bin(g, RFI_OP_ADD, splat_like(g, x, 0.0), x));    /* kept */
    expect("add/sub zero (f32)", rfi_simplify, g,
           "%0 = argument {index=0} : f32[2,3]\n"
           "%1 = constant {value=0} : f32[]\n"
           "%2 = broadcast_in_dim(%1) {map=[]} : f32[2,3]\n"
           "%3 = add(%0, %2) : f32[2,3]\n"
           "%4 = constant {value=-0} : f32[]\n"
           "%5 = broadcast_in_dim(%4) {map=[]} : f32[2,3]\n"
           "%6 = sub(%0, %5) : f32[2,3]\n"
           "%7 = constant {value=0} : f32[]\n"
           "%8 = broadcast_in_dim(%7) {map=[]} : f32[2,3]\n"
           "%9 = add(%8, %0) : f32[2,3]\n"
           "outputs: %3, %0, %0, %0, %6, %9\n",
           f32_args);
}

static void test_int_identities(void)
{
    rfi_graph *g = graph_with_args(1, (const rf_dtype[]){RF_I32}, D23, 2);
    rfi_node *x = arg(g, 0);
    rfi_graph_add_output(g, bin(g, RFI_OP_ADD, x, filled_like(g, x, 0)));
    rfi_graph_add_output(g, bin(g, RFI_OP_ADD, splat_like(g, x, 0), x));
    rfi_graph_add_output(g, bin(g, RFI_OP_SUB, x, splat_like(g, x, 0)));
    rfi_graph_add_output(g, bin(g, RFI_OP_MUL, x, splat_like(g, x, 1)));
    rfi_graph_add_output(g, bin(g, RFI_OP_MUL, splat_like(g, x, 1), x));
    rfi_graph_add_output(g, bin(g, RFI_OP_DIV, x, splat_like(g, x, 1)));
    rfi_graph_add_output(g, bin(g, RFI_OP_MUL, x, filled_like(g, x, 0))); /* int: 0 */
    rfi_graph_add_output(g, bin(g, RFI_OP_SUB, splat_like(g, x, 0), x));  /* kept */
    expect("integer identities", rfi_simplify, g,
           "%0 = argument {index=0} : i32[2,3]\n"
           "%1 = constant {value=0} : i32[]\n"
           "%2 = broadcast_in_dim(%1) {map=[]} : i32[2,3]\n"
           "%3 = constant {value=0} : i32[]\n"
           "%4 = broadcast_in_dim(%3) {map=[]} : i32[2,3]\n"
           "%5 = sub(%4, %0) : i32[2,3]\n"
           "outputs: %0, %0, %0, %0, %0, %0, %2, %5\n",
           i32_args);
}

static void test_mul_div_floats(void)
{
    rfi_node *x;
    rfi_graph *g = g_f32(1, &x);
    rfi_graph_add_output(g, bin(g, RFI_OP_MUL, x, splat_like(g, x, 1)));  /* x */
    rfi_graph_add_output(g, bin(g, RFI_OP_MUL, filled_like(g, x, 1), x)); /* x */
    rfi_graph_add_output(g, bin(g, RFI_OP_DIV, x, splat_like(g, x, 1)));  /* x */
    rfi_graph_add_output(g, bin(g, RFI_OP_MUL, x, splat_like(g, x, 0)));  /* kept: NaN, -0 */
    rfi_graph_add_output(g, bin(g, RFI_OP_DIV, splat_like(g, x, 1), x));  /* kept */
    expect("mul/div (f32)", rfi_simplify, g,
           "%0 = argument {index=0} : f32[2,3]\n"
           "%1 = constant {value=0} : f32[]\n"
           "%2 = broadcast_in_dim(%1) {map=[]} : f32[2,3]\n"
           "%3 = mul(%0, %2) : f32[2,3]\n"
           "%4 = constant {value=1} : f32[]\n"
           "%5 = broadcast_in_dim(%4) {map=[]} : f32[2,3]\n"
           "%6 = div(%5, %0) : f32[2,3]\n"
           "outputs: %0, %0, %0, %3, %6\n",
           f32_args);
}

static void test_unary_identities(void)
{
    rfi_node *x;
    rfi_graph *g = g_f32(1, &x);
    rfi_graph_add_output(g, un(g, RFI_OP_NEG, un(g, RFI_OP_NEG, x)));                 /* x */
    rfi_graph_add_output(g, un(g, RFI_OP_EXP, un(g, RFI_OP_STOP_GRADIENT, x)));       /* exp x */
    rfi_graph_add_output(g, convert(g, x, RF_F32));                                   /* x */
    rfi_graph_add_output(g, convert(g, convert(g, x, RF_F64), RF_F32));               /* x */
    rfi_graph_add_output(g, un(g, RFI_OP_NEG, x));                                    /* kept */
    expect("neg neg, stop_gradient, convert", rfi_simplify, g,
           "%0 = argument {index=0} : f32[2,3]\n"
           "%1 = exp(%0) : f32[2,3]\n"
           "%2 = neg(%0) : f32[2,3]\n"
           "outputs: %0, %1, %0, %0, %2\n",
           f32_args);

    /* f64 -> f32 -> f64 loses bits: kept */
    rfi_graph *h = graph_with_args(1, (const rf_dtype[]){RF_F64}, D23, 2);
    rfi_node *y = arg(h, 0);
    rfi_graph_add_output(h, convert(h, convert(h, y, RF_F32), RF_F64));
    expect("lossy convert chain", rfi_simplify, h,
           "%0 = argument {index=0} : f64[2,3]\n"
           "%1 = convert(%0) : f32[2,3]\n"
           "%2 = convert(%1) : f64[2,3]\n"
           "outputs: %2\n",
           f64_args);

    /* i32 -> f64 -> i32 and i32 -> i64 -> i32 are lossless; i32 -> f32 -> i32 is not */
    rfi_graph *k = graph_with_args(1, (const rf_dtype[]){RF_I32}, D23, 2);
    rfi_node *z = arg(k, 0);
    rfi_graph_add_output(k, convert(k, convert(k, z, RF_F64), RF_I32));
    rfi_graph_add_output(k, convert(k, convert(k, z, RF_I64), RF_I32));
    rfi_graph_add_output(k, convert(k, convert(k, z, RF_F32), RF_I32));
    expect("integer convert chains", rfi_simplify, k,
           "%0 = argument {index=0} : i32[2,3]\n"
           "%1 = convert(%0) : f32[2,3]\n"
           "%2 = convert(%1) : i32[2,3]\n"
           "outputs: %0, %0, %2\n",
           i32_args);
}

static void test_select_constant_predicate(void)
{
    rfi_node *x;
    rfi_graph *g = g_f32(2, &x);
    rfi_node *y = arg(g, 1);
    uint8_t t = 1, f[6] = {0, 0, 0, 0, 0, 0}, mixed[6] = {1, 0, 1, 0, 1, 0};
    rfi_node *pt = konst(g, RF_BOOL, NULL, 0, &t);
    rfi_graph_add_output(g, select3(g, pt, x, y));                                /* x */
    rfi_graph_add_output(g, select3(g, konst(g, RF_BOOL, D23, 2, f), x, y));      /* y */
    rfi_graph_add_output(g, select3(g, konst(g, RF_BOOL, D23, 2, mixed), x, y));  /* kept */
    expect("select with a constant predicate", rfi_simplify, g,
           "%0 = argument {index=0} : f32[2,3]\n"
           "%1 = argument {index=1} : f32[2,3]\n"
           "%2 = constant {values=[true, false, true, false, true, false]} : bool[2,3]\n"
           "%3 = select(%2, %0, %1) : f32[2,3]\n"
           "outputs: %0, %1, %3\n",
           f32_args);
}

/* ---- Shape chains -------------------------------------------------------------------- */

static void test_shape_chains(void)
{
    rfi_node *x;
    rfi_graph *g = g_f32(1, &x);
    /* reshape chains */
    rfi_node *r = reshape(g, reshape(g, x, (const int64_t[]){6}, 1), (const int64_t[]){3, 2}, 2);
    rfi_graph_add_output(g, r);
    rfi_graph_add_output(g, reshape(g, reshape(g, x, (const int64_t[]){6}, 1), D23, 2));
    rfi_graph_add_output(g, reshape(g, x, D23, 2));
    /* transposes: [2,3] -> perm [1,0] twice is the identity */
    rfi_graph_add_output(g, transpose(g, transpose(g, x, (const int64_t[]){1, 0}),
                                      (const int64_t[]){1, 0}));
    rfi_graph_add_output(g, transpose(g, x, (const int64_t[]){0, 1}));
    /* broadcasts: [2,3] -> [2,1,3] (map [0,2]) -> [4,2,5,3] (map [1,2,3]) = map [1,3] */
    rfi_node *b1 = broadcast(g, x, (const int64_t[]){0, 2}, (const int64_t[]){2, 1, 3}, 3);
    rfi_graph_add_output(g, broadcast(g, b1, (const int64_t[]){1, 2, 3},
                                      (const int64_t[]){4, 2, 5, 3}, 4));
    rfi_graph_add_output(g, broadcast(g, x, (const int64_t[]){0, 1}, D23, 2));
    expect("reshape/transpose/broadcast chains", rfi_simplify, g,
           "%0 = argument {index=0} : f32[2,3]\n"
           "%1 = reshape(%0) : f32[3,2]\n"
           "%2 = broadcast_in_dim(%0) {map=[1, 3]} : f32[4,2,5,3]\n"
           "outputs: %1, %0, %0, %0, %0, %2, %0\n",
           f32_args);

    /* rank-3 transposes compose: perm [1,2,0] then [2,0,1]... */
    rfi_graph *h = graph_with_args(1, F32x3, (const int64_t[]){1, 2, 3}, 3);
    rfi_node *y = arg(h, 0);
    rfi_node *t1 = transpose(h, y, (const int64_t[]){1, 2, 0}); /* [2,3,1] */
    rfi_node *t2 = transpose(h, t1, (const int64_t[]){0, 2, 1}); /* [2,1,3] */
    rfi_graph_add_output(h, t2);
    rfi_graph_add_output(h, transpose(h, t1, (const int64_t[]){2, 0, 1})); /* identity */
    expect("transpose composition", rfi_simplify, h,
           "%0 = argument {index=0} : f32[1,2,3]\n"
           "%1 = transpose(%0) {perm=[1, 0, 2]} : f32[2,1,3]\n"
           "outputs: %1, %0\n",
           f32_args);
}

/* dot_general(lhs, rhs) with the given contracting dims (no batch dims). */
static rfi_node *dot(rfi_graph *g, rfi_node *l, rfi_node *r, int64_t lc, int64_t rc)
{
    rfi_attrs a = attrs0();
    a.nl[2] = a.nl[3] = 1;
    a.l[2][0] = lc;
    a.l[3][0] = rc;
    rfi_node *in[2] = {l, r};
    return node(g, RFI_OP_DOT_GENERAL, in, 2, &a, l->dtype, NULL, 0);
}

static void test_transposed_dot_operands(void)
{
    rfi_node *x;
    rfi_graph *g = g_f32(2, &x);
    rfi_node *y = arg(g, 1);
    /* x @ y^T and x^T @ y: the transposes fold into the contracting dims */
    rfi_graph_add_output(g, dot(g, x, transpose(g, y, (const int64_t[]){1, 0}), 1, 0));
    rfi_graph_add_output(g, dot(g, transpose(g, x, (const int64_t[]){1, 0}), y, 1, 0));
    expect("transposed dot operands", rfi_simplify, g,
           "%0 = argument {index=0} : f32[2,3]\n"
           "%1 = argument {index=1} : f32[2,3]\n"
           "%2 = dot_general(%0, %1) {lhs_batch=[], rhs_batch=[], lhs_contract=[1], "
           "rhs_contract=[1]} : f32[2,2]\n"
           "%3 = dot_general(%0, %1) {lhs_batch=[], rhs_batch=[], lhs_contract=[0], "
           "rhs_contract=[0]} : f32[3,3]\n"
           "outputs: %2, %3\n",
           f32_args);

    /* a transpose that reorders the free dims stays: [1,2,3] -> perm [2,1,0]
     * contracting its dim 1 leaves free dims 3, 1 (reversed in the source) */
    rfi_graph *h = graph_with_args(2, F32x3, (const int64_t[]){1, 2, 3}, 3);
    rfi_node *t = transpose(h, arg(h, 0), (const int64_t[]){2, 1, 0}); /* [3,2,1] */
    rfi_node *w = reshape(h, arg(h, 1), (const int64_t[]){2, 3}, 2);
    rfi_graph_add_output(h, dot(h, t, w, 1, 0)); /* [3,1,3] */
    expect("transposed dot operand that reorders free dims", rfi_simplify, h,
           "%0 = argument {index=0} : f32[1,2,3]\n"
           "%1 = transpose(%0) {perm=[2, 1, 0]} : f32[3,2,1]\n"
           "%2 = argument {index=1} : f32[1,2,3]\n"
           "%3 = reshape(%2) : f32[2,3]\n"
           "%4 = dot_general(%1, %3) {lhs_batch=[], rhs_batch=[], lhs_contract=[1], "
           "rhs_contract=[0]} : f32[3,1,3]\n"
           "outputs: %4\n",
           f32_args);
}

/* transpose(x @ y^T) is y @ x^T: the product with its operands swapped; not
 * when the product has another user (it would be computed twice). */
static void test_transposed_product(void)
{
    rfi_node *x;
    rfi_graph *g = g_f32(2, &x);
    rfi_graph_add_output(g, transpose(g, dot(g, x, arg(g, 1), 1, 1), (const int64_t[]){1, 0}));
    expect("transposed product", rfi_simplify, g,
           "%0 = argument {index=0} : f32[2,3]\n"
           "%1 = argument {index=1} : f32[2,3]\n"
           "%2 = dot_general(%1, %0) {lhs_batch=[], rhs_batch=[], lhs_contract=[1], "
           "rhs_contract=[1]} : f32[2,2]\n"
           "outputs: %2\n",
           f32_args);

    rfi_graph *h = g_f32(2, &x);
    rfi_node *d = dot(h, x, arg(h, 1), 1, 1);
    rfi_graph_add_output(h, d);
    rfi_graph_add_output(h, transpose(h, d, (const int64_t[]){1, 0}));
    expect("transposed product with another user", rfi_simplify, h,
           "%0 = argument {index=0} : f32[2,3]\n"
           "%1 = argument {index=1} : f32[2,3]\n"
           "%2 = dot_general(%0, %1) {lhs_batch=[], rhs_batch=[], lhs_contract=[1], "
           "rhs_contract=[1]} : f32[2,2]\n"
           "%3 = transpose(%2) {perm=[1, 0]} : f32[2,2]\n"
           "outputs: %2, %3\n",
           f32_args);
}

static rfi_node *slice1(rfi_graph *g, rfi_node *x, int64_t start, int64_t limit, int64_t stride)
{
    rfi_attrs a = attrs0();
    a.nl[0] = a.nl[1] = a.nl[2] = 1;
    a.l[0][0] = start;
    a.l[1][0] = limit;
    a.l[2][0] = stride;
    return node(g, RFI_OP_SLICE, &x, 1, &a, x->dtype, NULL, 0);
}

/* Slices of concatenate([a, b, c]) (6 points each, flattened [2,3]s): one that
 * is a whole piece is that piece, one within a piece a slice of it, one across
 * two pieces stays. */
static void test_slice_of_concatenation(void)
{
    rfi_graph *g = graph_with_args(3, F32x3, D23, 2);
    rfi_node *flat[3];
    for (int k = 0; k < 3; k++)
        flat[k] = reshape(g, arg(g, k), (const int64_t[]){6}, 1);
    rfi_attrs ca = attrs0();
    ca.i[0] = 0;
    rfi_node *cat = node(g, RFI_OP_CONCATENATE, flat, 3, &ca, RF_F32, NULL, 0);
    rfi_graph_add_output(g, slice1(g, cat, 6, 12, 1));
    rfi_graph_add_output(g, slice1(g, cat, 13, 18, 2));
    rfi_graph_add_output(g, slice1(g, cat, 4, 8, 1));
    expect("slices of a concatenation", rfi_simplify, g,
           "%0 = argument {index=0} : f32[2,3]\n"
           "%1 = reshape(%0) : f32[6]\n"
           "%2 = argument {index=1} : f32[2,3]\n"
           "%3 = reshape(%2) : f32[6]\n"
           "%4 = argument {index=2} : f32[2,3]\n"
           "%5 = reshape(%4) : f32[6]\n"
           "%6 = concatenate(%1, %3, %5) {axis=0} : f32[18]\n"
           "%7 = slice(%5) {start=[1], limit=[6], stride=[2]} : f32[3]\n"
           "%8 = slice(%6) {start=[4], limit=[8], stride=[1]} : f32[4]\n"
           "outputs: %3, %7, %8\n",
           f32_args);
}

/* A graph of x [xd] of x_dt and a pool cotangent src of dt (the windows' result
 * shape, written to sd), with window attributes `win`, strides `st` and
 * padding `pad` on the last two dims in *a. */
static rfi_graph *pool_graph(const int64_t *xd, const int64_t *win, const int64_t *st,
                             int64_t pad, rf_dtype x_dt, rf_dtype dt, int64_t *sd, rfi_node **x,
                             rfi_node **src, rfi_attrs *a)
{
    for (int d = 0; d < 4; d++)
        sd[d] = (xd[d] + (d >= 2 ? 2 * pad : 0) - win[d]) / st[d] + 1;
    rfi_graph *g = rfi_graph_new(rf_device_cpu(), "t");
    const rf_dtype dts[2] = {x_dt, dt};
    const int ranks[2] = {4, 4};
    int64_t dims[2][RF_MAX_RANK] = {{xd[0], xd[1], xd[2], xd[3]}, {sd[0], sd[1], sd[2], sd[3]}};
    CHECK_OK(rfi_graph_set_args(g, 2, dts, ranks, (const int64_t(*)[RF_MAX_RANK])dims));
    *x = arg(g, 0);
    *src = arg(g, 1);
    *a = attrs0();
    for (int k = 0; k < 4; k++)
        a->nl[k] = 4;
    for (int d = 0; d < 4; d++) {
        a->l[0][d] = win[d];
        a->l[1][d] = st[d];
        a->l[2][d] = a->l[3][d] = d >= 2 ? pad : 0;
    }
    return g;
}

/* select(x > 0, select_and_scatter(x, s), +0) with windows `win`, strides
 * `st` and padding `pad` over x [2,1,4,6] of x_dt (s is f32); returns whether
 * simplify moved the mask onto s (no select of x's shape is left), after
 * checking the results bitwise on x full of ties, signed zeros, NaNs and
 * negatives. */
static bool pooled_mask_moved(const int64_t *win, const int64_t *st, int64_t pad, rf_dtype x_dt)
{
    const int64_t xd[4] = {2, 1, 4, 6};
    int64_t sd[4];
    rfi_node *x, *src;
    rfi_attrs a;
    rfi_graph *g = pool_graph(xd, win, st, pad, x_dt, RF_F32, sd, &x, &src, &a);
    rfi_node *sas_in[2] = {x, src};
    rfi_node *sas = node(g, RFI_OP_SELECT_AND_SCATTER, sas_in, 2, &a, RF_F32, NULL, 0);
    rfi_attrs gt = attrs0();
    gt.i[0] = RF_GT;
    rfi_node *cmp_in[2] = {x, splat_like(g, x, 0.0)};
    rfi_node *p = node(g, RFI_OP_COMPARE, cmp_in, 2, &gt, RF_BOOL, NULL, 0);
    rfi_node *sel_in[3] = {p, sas, splat_like(g, sas, 0.0)};
    rfi_graph_add_output(g, node(g, RFI_OP_SELECT, sel_in, 3, NULL, RF_F32, NULL, 0));
    float xv[48], sv[48];
    double xv64[48];
    const float pattern[8] = {0.0f, -0.0f, 1.0f, 1.0f, NAN, -2.0f, 3.0f, -0.0f};
    for (int i = 0; i < 48; i++) {
        xv[i] = i % 11 == 3 ? 1.0f : pattern[(i * 5) % 8];
        xv64[i] = xv[i];
        sv[i] = (float)(i % 7) - 2.5f;
    }
    void *args[2] = {x_dt == RF_F64 ? (void *)xv64 : (void *)xv, sv};
    rfi_graph *out = apply(rfi_simplify, g);
    bool moved = false;
    if (out) {
        CHECK(same_results(g, out, args));
        moved = true;
        for (int i = 0; i < out->n_nodes; i++)
            if (out->nodes[i]->op == RFI_OP_SELECT && out->nodes[i]->rank == 4 &&
                out->nodes[i]->dims[3] == 6)
                moved = false;
    }
    rfi_graph_free(out);
    rfi_graph_free(g);
    return moved;
}

static void test_pooled_gradient_mask(void)
{
    const int64_t w22[4] = {1, 1, 2, 2}, w23[4] = {1, 1, 2, 3}, s11[4] = {1, 1, 1, 1};
    CHECK(pooled_mask_moved(w22, w22, 0, RF_F32)); /* the usual 2x2 pooling */
    CHECK(pooled_mask_moved(w23, w23, 0, RF_F32));
    CHECK(pooled_mask_moved(w22, s11, 0, RF_F32));  /* overlapping windows */
    CHECK(!pooled_mask_moved(w22, w22, 1, RF_F32)); /* padded: left alone */
    CHECK(pooled_mask_moved(w22, w22, 0, RF_F64));  /* x f64, the cotangent f32 */
}

/* ---- Merged products (merge_dots.c) ------------------------------------------------ */

/* Small integers: every product and sum is exact, so the merged program's
 * other summation order gives bitwise the same results. */
static float merge_in[4][8];
static void *const merge_args[4] = {merge_in[0], merge_in[1], merge_in[2], merge_in[3]};

/* A graph of four f32[2,4] arguments. */
static rfi_graph *merge_graph(rfi_node **x)
{
    static const rf_dtype f32x4[4] = {RF_F32, RF_F32, RF_F32, RF_F32};
    static const int64_t d24[2] = {2, 4};
    rfi_graph *g = graph_with_args(4, f32x4, d24, 2);
    for (int i = 0; i < 4; i++)
        x[i] = arg(g, i);
    return g;
}

static void test_merged_dots(void)
{
    for (int i = 0; i < 4; i++)
        for (int k = 0; k < 8; k++)
            merge_in[i][k] = (float)((i * 8 + k) % 7) - 3.0f;
    const int64_t swap[2] = {1, 0};
    rfi_node *x[4];
    /* a weight's gradient over three steps, transposed, plus other terms (t0
     * is used twice): the tree's terms are t1, t2, t0 * t0 and t0, and the
     * first two become one product of the concatenated operands (K 2 -> 4),
     * t2 first: its later operand (x2) was computed before t1's (x3) */
    rfi_graph *g = merge_graph(x);
    rfi_node *t0 = transpose(g, dot(g, x[0], x[1], 0, 0), swap);
    rfi_node *t1 = transpose(g, dot(g, x[2], x[3], 0, 0), swap);
    rfi_node *t2 = transpose(g, dot(g, x[1], x[2], 0, 0), swap);
    rfi_node *other = bin(g, RFI_OP_MUL, t0, t0);
    rfi_graph_add_output(g, bin(g, RFI_OP_ADD, bin(g, RFI_OP_ADD, t1, t2),
                                bin(g, RFI_OP_ADD, other, t0)));
    expect("merge: a sum of three transposed products", rfi_merge_dots, g,
           "%0 = argument {index=0} : f32[2,4]\n"
           "%1 = argument {index=1} : f32[2,4]\n"
           "%2 = argument {index=2} : f32[2,4]\n"
           "%3 = argument {index=3} : f32[2,4]\n"
           "%4 = dot_general(%0, %1) {lhs_batch=[], rhs_batch=[], lhs_contract=[0], "
           "rhs_contract=[0]} : f32[4,4]\n"
           "%5 = transpose(%4) {perm=[1, 0]} : f32[4,4]\n"
           "%6 = mul(%5, %5) : f32[4,4]\n"
           "%7 = concatenate(%1, %2) {axis=0} : f32[4,4]\n"
           "%8 = concatenate(%2, %3) {axis=0} : f32[4,4]\n"
           "%9 = dot_general(%7, %8) {lhs_batch=[], rhs_batch=[], lhs_contract=[0], "
           "rhs_contract=[0]} : f32[4,4]\n"
           "%10 = transpose(%9) {perm=[1, 0]} : f32[4,4]\n"
           "%11 = add(%10, %6) : f32[4,4]\n"
           "%12 = add(%11, %5) : f32[4,4]\n"
           "outputs: %12\n",
           merge_args);
    /* a sum of 1030 products merges in groups of at most 1024: two products */
    {
        static const rf_dtype f32x2[2] = {RF_F32, RF_F32};
        static const int64_t d12[2] = {1, 2};
        g = graph_with_args(2, f32x2, d12, 2);
        rfi_node *a = arg(g, 0), *b = arg(g, 1), *sum = NULL;
        for (int i = 0; i < 1030; i++) {
            rfi_node *p = dot(g, i % 2 ? a : b, i % 3 ? b : a, 0, 0);
            sum = sum ? bin(g, RFI_OP_ADD, sum, p) : p;
        }
        rfi_graph_add_output(g, sum);
        rfi_graph *out = apply(rfi_merge_dots, g);
        int dots = 0, cats = 0;
        for (int i = 0; out && i < out->n_nodes; i++) {
            dots += out->nodes[i]->op == RFI_OP_DOT_GENERAL;
            cats += out->nodes[i]->op == RFI_OP_CONCATENATE && out->nodes[i]->n_in <= 1024;
        }
        CHECK(out && dots == 2 && cats == 4);
        CHECK(out && same_results(g, out, merge_args));
        rfi_graph_free(out);
        rfi_graph_free(g);
    }
    /* products of another form (contracting dim 1: operands 16 elements, results
     * 4) are left alone, as are a bare and a transposed product, and all with
     * RF_MERGE_DOTS=0 */
    const struct {
        const char *what;
        int form;
        const char *env;
    } kept[] = {{"merge: operands larger than the results", 1, NULL},
                {"merge: a bare and a transposed product", 2, NULL},
                {"merge: RF_MERGE_DOTS=0", 0, "0"}};
    for (int c = 0; c < 3; c++) {
        g = merge_graph(x);
        int ca = kept[c].form == 1;
        rfi_node *d0 = dot(g, x[0], x[1], ca, ca), *d1 = dot(g, x[2], x[3], ca, ca);
        if (kept[c].form == 2)
            d1 = transpose(g, d1, swap);
        rfi_graph_add_output(g, bin(g, RFI_OP_ADD, d0, d1));
        char *want = body(g);
        if (kept[c].env)
            setenv("RF_MERGE_DOTS", kept[c].env, 1);
        expect(kept[c].what, rfi_merge_dots, g, want, merge_args);
        unsetenv("RF_MERGE_DOTS");
        free(want);
    }
}

static int count_ops(const rfi_graph *g, rfi_op op)
{
    int n = 0;
    for (int i = 0; g && i < g->n_nodes; i++)
        n += g->nodes[i]->op == op;
    return n;
}

/* ---- Stacked products (stack_dots.c) ----------------------------------------------- */

/* Rows [r0, r1) and columns [c0, c1) of a rank-2 x. */
static rfi_node *block(rfi_graph *g, rfi_node *x, int64_t r0, int64_t r1, int64_t c0, int64_t c1)
{
    rfi_attrs a = attrs0();
    a.nl[0] = a.nl[1] = a.nl[2] = 2;
    a.l[0][0] = r0;
    a.l[0][1] = c0;
    a.l[1][0] = r1;
    a.l[1][1] = c1;
    a.l[2][0] = a.l[2][1] = 1;
    return node(g, RFI_OP_SLICE, &x, 1, &a, x->dtype, NULL, 0);
}

#define STACK_DG "{lhs_batch=[], rhs_batch=[], lhs_contract=[1], rhs_contract=[0]}"
static float stack_x[12], stack_w[6];
static void *const stack_args[2] = {stack_x, stack_w};

/* x f32[2,6] and w f32[2,3]: x's three column blocks times w (with `tiles`;
 * else the second is columns 1-2), a fourth product of the first's result
 * (the chain of a recurrence), and the four summed. */
/* A graph of n f32 arguments of rank 2 and dims dims[i]. */
static rfi_graph *graph_of_matrices(int n, const int64_t (*dims)[2])
{
    rfi_graph *g = rfi_graph_new(rf_device_cpu(), "t");
    rf_dtype dts[4];
    int rk[4];
    int64_t d[4][RF_MAX_RANK];
    for (int i = 0; i < n && i < 4; i++) {
        dts[i] = RF_F32;
        rk[i] = 2;
        d[i][0] = dims[i][0];
        d[i][1] = dims[i][1];
    }
    CHECK_OK(rfi_graph_set_args(g, n, dts, rk, (const int64_t(*)[RF_MAX_RANK])d));
    return g;
}

static rfi_graph *stack_graph(bool tiles)
{
    rfi_graph *g = graph_of_matrices(2, (const int64_t[][2]){{2, 6}, {2, 3}});
    rfi_node *x = arg(g, 0), *w = arg(g, 1);
    rfi_node *d0 = dot(g, block(g, x, 0, 2, 0, 2), w, 1, 0);
    rfi_node *d1 = dot(g, block(g, x, 0, 2, tiles ? 2 : 1, tiles ? 4 : 3), w, 1, 0);
    rfi_node *chained = dot(g, block(g, d0, 0, 2, 0, 2), w, 1, 0);
    rfi_node *d2 = dot(g, block(g, x, 0, 2, 4, 6), w, 1, 0);
    rfi_graph_add_output(g, bin(g, RFI_OP_ADD, bin(g, RFI_OP_ADD, d0, d1),
                                bin(g, RFI_OP_ADD, chained, d2)));
    return g;
}

static void test_stacked_dots(void)
{
    for (int k = 0; k < 12; k++)
        stack_x[k] = (float)(k % 5) - 2.0f;
    for (int k = 0; k < 6; k++)
        stack_w[k] = (float)(k % 4) - 1.0f;
    /* the three products of x's column blocks become one of x reshaped, each
     * result its columns of the product reshaped back; the chained one, whose
     * operand depends on the first, stays */
    expect("stack: x's three column blocks", rfi_stack_dots, stack_graph(true),
           "%0 = argument {index=0} : f32[2,6]\n"
           "%1 = argument {index=1} : f32[2,3]\n"
           "%2 = reshape(%0) : f32[6,2]\n"
           "%3 = dot_general(%2, %1) " STACK_DG " : f32[6,3]\n"
           "%4 = reshape(%3) : f32[2,9]\n"
           "%5 = slice(%4) {start=[0, 0], limit=[2, 3], stride=[1, 1]} : f32[2,3]\n"
           "%6 = slice(%4) {start=[0, 3], limit=[2, 6], stride=[1, 1]} : f32[2,3]\n"
           "%7 = slice(%5) {start=[0, 0], limit=[2, 2], stride=[1, 1]} : f32[2,2]\n"
           "%8 = dot_general(%7, %1) " STACK_DG " : f32[2,3]\n"
           "%9 = slice(%4) {start=[0, 6], limit=[2, 9], stride=[1, 1]} : f32[2,3]\n"
           "%10 = add(%8, %9) : f32[2,3]\n"
           "%11 = add(%5, %6) : f32[2,3]\n"
           "%12 = add(%11, %10) : f32[2,3]\n"
           "outputs: %12\n",
           stack_args);
    /* blocks that do not tile x: stacked by a concatenation (the later two
     * built again where the first product stood), each result its rows */
    expect("stack: three slices of x", rfi_stack_dots, stack_graph(false),
           "%0 = argument {index=0} : f32[2,6]\n"
           "%1 = argument {index=1} : f32[2,3]\n"
           "%2 = slice(%0) {start=[0, 0], limit=[2, 2], stride=[1, 1]} : f32[2,2]\n"
           "%3 = slice(%0) {start=[0, 1], limit=[2, 3], stride=[1, 1]} : f32[2,2]\n"
           "%4 = slice(%0) {start=[0, 4], limit=[2, 6], stride=[1, 1]} : f32[2,2]\n"
           "%5 = concatenate(%2, %3, %4) {axis=0} : f32[6,2]\n"
           "%6 = dot_general(%5, %1) " STACK_DG " : f32[6,3]\n"
           "%7 = slice(%6) {start=[0, 0], limit=[2, 3], stride=[1, 1]} : f32[2,3]\n"
           "%8 = slice(%6) {start=[2, 0], limit=[4, 3], stride=[1, 1]} : f32[2,3]\n"
           "%9 = slice(%7) {start=[0, 0], limit=[2, 2], stride=[1, 1]} : f32[2,2]\n"
           "%10 = dot_general(%9, %1) " STACK_DG " : f32[2,3]\n"
           "%11 = slice(%6) {start=[4, 0], limit=[6, 3], stride=[1, 1]} : f32[2,3]\n"
           "%12 = add(%10, %11) : f32[2,3]\n"
           "%13 = add(%7, %8) : f32[2,3]\n"
           "%14 = add(%13, %12) : f32[2,3]\n"
           "outputs: %14\n",
           stack_args);
    /* RF_STACK_DOTS=0: a plain copy */
    rfi_graph *g = stack_graph(true);
    char *want = body(g);
    setenv("RF_STACK_DOTS", "0", 1);
    expect("stack: RF_STACK_DOTS=0", rfi_stack_dots, g, want, stack_args);
    unsetenv("RF_STACK_DOTS");
    free(want);
    /* 1030 products of one weight stack in groups of at most 1024: two */
    {
        g = graph_of_matrices(2, (const int64_t[][2]){{1, 2}, {2, 3}});
        rfi_node *x = arg(g, 0), *w = arg(g, 1), *sum = NULL;
        for (int i = 0; i < 1030; i++) {
            rfi_node *p = dot(g, x, w, 1, 0);
            sum = sum ? bin(g, RFI_OP_ADD, sum, p) : p;
        }
        rfi_graph_add_output(g, sum);
        rfi_graph *out = apply(rfi_stack_dots, g);
        CHECK(out && count_ops(out, RFI_OP_DOT_GENERAL) == 2 &&
              count_ops(out, RFI_OP_CONCATENATE) == 2);
        CHECK(out && same_results(g, out, stack_args));
        rfi_graph_free(out);
        rfi_graph_free(g);
    }
    /* products of 2M multiply-adds or more, or of different right operands,
     * stay apart */
    {
        g = graph_of_matrices(3, (const int64_t[][2]){{1000, 4000}, {2000, 1}, {2000, 1}});
        rfi_node *x = arg(g, 0), *w = arg(g, 1), *v = arg(g, 2);
        rfi_node *big0 = dot(g, block(g, x, 0, 1000, 0, 2000), w, 1, 0);
        rfi_node *big1 = dot(g, block(g, x, 0, 1000, 2000, 4000), w, 1, 0);
        rfi_node *small0 = dot(g, block(g, x, 0, 10, 0, 2000), w, 1, 0);
        rfi_node *small1 = dot(g, block(g, x, 10, 20, 0, 2000), v, 1, 0);
        rfi_graph_add_output(g, bin(g, RFI_OP_ADD, big0, big1));
        rfi_graph_add_output(g, bin(g, RFI_OP_ADD, small0, small1));
        rfi_graph *out = apply(rfi_stack_dots, g);
        CHECK(out && count_ops(out, RFI_OP_DOT_GENERAL) == 4 &&
              count_ops(out, RFI_OP_CONCATENATE) == 0);
        rfi_graph_free(out);
        rfi_graph_free(g);
    }
}

/* ---- One-pass moments (moments.c) ------------------------------------------------- */

enum { MOM_N = 4, MOM_C = 3, MOM_H = 5, MOM_W = 6, MOM_POINTS = MOM_N * MOM_C * MOM_H * MOM_W };
static float mom_x[MOM_POINTS];
static void *const mom_args[1] = {mom_x};

/* mean(x) and var(x) over `axes` (BatchNorm's [0, 2, 3] or LayerNorm's last
 * axis) of x f32[4,3,5,6], keepdims as given, simplified and CSE'd as the
 * pipeline does before the pass. */
static rfi_graph *moments_graph(const int64_t *axes, int naxes, bool keepdims)
{
    static const int64_t dims[4] = {MOM_N, MOM_C, MOM_H, MOM_W};
    rfi_graph *g = graph_with_args(1, (const rf_dtype[]){RF_F32}, dims, 4);
    rfi_node *x = arg(g, 0);
    rfi_graph_add_output(g, rf_mean(x, axes, naxes, keepdims));
    rfi_graph_add_output(g, rf_var(x, axes, naxes, keepdims));
    CHECK_OK(rfi_verify(g));
    rfi_graph *opt = optimise(g);
    rfi_graph_free(g);
    return opt;
}


/* The largest error of out's mean and var (outputs 0 and 1, per kept point)
 * against f64 two-pass sums of mom_x over the BatchNorm axes, relative to the
 * variance (a mean's error matters against the spread). */
static double moments_error(const rfi_graph *g)
{
    results r = {0};
    CHECK_OK(run_graph(g, mom_args, &r));
    double worst = 0;
    for (int c = 0; r.n == 2 && c < MOM_C; c++) {
        double sum = 0, dev = 0;
        int n = 0;
        for (int i = 0; i < MOM_POINTS; i++)
            if (i / (MOM_H * MOM_W) % MOM_C == c) {
                sum += mom_x[i];
                n++;
            }
        double mean = sum / n;
        for (int i = 0; i < MOM_POINTS; i++)
            if (i / (MOM_H * MOM_W) % MOM_C == c)
                dev += (mom_x[i] - mean) * (mom_x[i] - mean);
        double var = dev / n;
        double got_mean = ((float *)r.buf[0])[c], got_var = ((float *)r.buf[1])[c];
        worst = fmax(worst, fabs(got_mean - mean) / var);
        worst = fmax(worst, fabs(got_var - var) / var);
    }
    results_free(&r);
    return worst;
}

/* ---- Factors taken out of sums ------------------------------------------------------- */

enum { SF_N = 2, SF_C = 3, SF_H = 2, SF_W = 2, SF_POINTS = SF_N * SF_C * SF_H * SF_W };

static float sf_g[SF_POINTS], sf_xc[SF_POINTS], sf_r[SF_C], sf_gamma[SF_C];
static void *const sf_args[4] = {sf_g, sf_xc, sf_r, sf_gamma};

/* A graph over g and xc f32[2,3,2,2] and per-channel r and gamma f32[1,3,1,1]
 * (as dt), with R and G their broadcasts over g's shape. */
static rfi_graph *sf_graph(rf_dtype dt, rfi_node **g, rfi_node **xc, rfi_node **R, rfi_node **G)
{
    rfi_graph *gr = rfi_graph_new(rf_device_cpu(), "t");
    const rf_dtype dts[4] = {dt, dt, dt, dt};
    const int ranks[4] = {4, 4, 4, 4};
    const int64_t dims[4][RF_MAX_RANK] = {
        {SF_N, SF_C, SF_H, SF_W}, {SF_N, SF_C, SF_H, SF_W}, {1, SF_C, 1, 1}, {1, SF_C, 1, 1}};
    CHECK_OK(rfi_graph_set_args(gr, 4, dts, ranks, dims));
    *g = arg(gr, 0);
    *xc = arg(gr, 1);
    const int64_t map[4] = {0, 1, 2, 3};
    *R = broadcast(gr, arg(gr, 2), map, dims[0], 4);
    *G = broadcast(gr, arg(gr, 3), map, dims[0], 4);
    return gr;
}

static rfi_node *sum_over(rfi_graph *g, rfi_node *x, rf_reduce_kind kind, const int64_t *axes,
                          int naxes)
{
    rfi_attrs a = list_attr(axes, naxes);
    a.i[0] = kind;
    return node(g, RFI_OP_REDUCE, &x, 1, &a, x->dtype, NULL, 0);
}

/* BatchNorm's backward sums as autodiff writes them, over the channel axes:
 * sum(g (xc R)), sum((g G) xc), sum(-((g G) R)) and sum(g). */
static rfi_graph *bn_sums_graph(rf_dtype dt)
{
    rfi_node *g, *xc, *R, *G;
    rfi_graph *gr = sf_graph(dt, &g, &xc, &R, &G);
    const int64_t axes[3] = {0, 2, 3};
    rfi_node *gG = bin(gr, RFI_OP_MUL, g, G);
    rfi_graph_add_output(gr, sum_over(gr, bin(gr, RFI_OP_MUL, g, bin(gr, RFI_OP_MUL, xc, R)),
                                      RF_REDUCE_SUM, axes, 3));
    rfi_graph_add_output(gr, sum_over(gr, bin(gr, RFI_OP_MUL, gG, xc), RF_REDUCE_SUM, axes, 3));
    rfi_node *gGR = bin(gr, RFI_OP_MUL, gG, R);
    rfi_graph_add_output(gr, sum_over(gr, un(gr, RFI_OP_NEG, gGR), RF_REDUCE_SUM, axes, 3));
    rfi_graph_add_output(gr, sum_over(gr, g, RF_REDUCE_SUM, axes, 3));
    return gr;
}

/* Whether a and b (same outputs) agree within rel of each output's largest
 * magnitude (f32 results). */
static bool sf_close(const rfi_graph *a, const rfi_graph *b, double rel)
{
    results ra = {0}, rb = {0};
    bool ok = run_graph(a, sf_args, &ra) == RF_OK && run_graph(b, sf_args, &rb) == RF_OK &&
              ra.n == rb.n;
    for (int i = 0; ok && i < ra.n; i++) {
        const float *x = ra.buf[i], *y = rb.buf[i];
        size_t n = ra.nbytes[i] / sizeof(float);
        double big = 0;
        for (size_t k = 0; k < n; k++)
            big = fmax(big, fabs(x[k]));
        for (size_t k = 0; k < n; k++)
            if (!(fabs(x[k] - y[k]) <= rel * (big + 1e-30))) {
                fprintf(stderr, "  sum factors: output %d [%zu]: %g against %g\n", i, k,
                        (double)y[k], (double)x[k]);
                ok = false;
            }
    }
    results_free(&ra);
    results_free(&rb);
    return ok;
}

static void test_sum_factors(void)
{
    for (int i = 0; i < SF_POINTS; i++) {
        sf_g[i] = (float)((i * 7 % 11) - 5) / 4.0f;
        sf_xc[i] = (float)((i * 5 % 13) - 6) / 3.0f;
    }
    for (int c = 0; c < SF_C; c++) {
        sf_r[c] = 0.5f + (float)c;
        sf_gamma[c] = 1.5f - (float)c;
    }
    /* one factor out: the per-channel R, reshaped to the sum's [3], from the sum
     * of g (xc R) that then merges with the sum of xc g; alone, it stays */
    for (int alone = 0; alone < 2; alone++) {
        rfi_node *g, *xc, *R, *G;
        rfi_graph *gr = sf_graph(RF_F32, &g, &xc, &R, &G);
        const int64_t axes[3] = {0, 2, 3};
        rfi_graph_add_output(gr, sum_over(gr, bin(gr, RFI_OP_MUL, g, bin(gr, RFI_OP_MUL, xc, R)),
                                          RF_REDUCE_SUM, axes, 3));
        if (!alone)
            rfi_graph_add_output(gr, sum_over(gr, bin(gr, RFI_OP_MUL, xc, g), RF_REDUCE_SUM,
                                              axes, 3));
        rfi_graph *fac = apply(rfi_sum_factors, gr), *out = fac ? apply(rfi_cse, fac) : NULL;
        rfi_graph *ref = apply(rfi_dce, gr); /* G unused */
        char *got = out ? body(out) : NULL, *before = ref ? body(ref) : NULL;
        const char *want = alone ? before
                                 : "%0 = argument {index=0} : f32[2,3,2,2]\n"
                                   "%1 = argument {index=1} : f32[2,3,2,2]\n"
                                   "%2 = argument {index=2} : f32[1,3,1,1]\n"
                                   "%3 = mul(%0, %1) : f32[2,3,2,2]\n"
                                   "%4 = reduce(%3) {kind=sum, axes=[0, 2, 3]} : f32[3]\n"
                                   "%5 = reshape(%2) : f32[3]\n"
                                   "%6 = mul(%5, %4) : f32[3]\n"
                                   "outputs: %6, %4\n";
        tu_checks++;
        if (!got || !want || strcmp(got, want) != 0) {
            tu_failures++;
            fprintf(stderr, "sum factors: printed IR differs.\n--- got:\n%s--- want:\n%s",
                    got ? got : "(none)", want ? want : "(none)");
        }
        CHECK(out && sf_close(gr, out, 1e-6));
        free(got);
        free(before);
        rfi_graph_free(ref);
        rfi_graph_free(out);
        rfi_graph_free(fac);
        rfi_graph_free(gr);
    }
    /* BatchNorm's four sums: two left after CSE, in f32 and f64 */
    for (int f64 = 0; f64 < 2; f64++) {
        rfi_graph *gr = bn_sums_graph(f64 ? RF_F64 : RF_F32);
        rfi_graph *fac = apply(rfi_sum_factors, gr);
        rfi_graph *out = fac ? apply(rfi_cse, fac) : NULL;
        CHECK(count_ops(gr, RFI_OP_REDUCE) == 4);
        CHECK(out && count_ops(out, RFI_OP_REDUCE) == 2);
        if (!f64)
            CHECK(out && sf_close(gr, out, 1e-6));
        rfi_graph_free(out);
        rfi_graph_free(fac);
        rfi_graph_free(gr);
    }
    /* RF_SUM_FACTORS=0: a plain copy */
    {
        rfi_graph *gr = bn_sums_graph(RF_F32);
        setenv("RF_SUM_FACTORS", "0", 1);
        rfi_graph *out = apply(rfi_sum_factors, gr);
        unsetenv("RF_SUM_FACTORS");
        char *a = body(gr), *b = out ? body(out) : NULL;
        CHECK(b && strcmp(a, b) == 0);
        free(a);
        free(b);
        rfi_graph_free(out);
        rfi_graph_free(gr);
    }
    /* left alone: a max (c * max x is not max c x for c < 0), a sum over the
     * axis a factor varies along (R varies along 1), a product of varying
     * factors only, and a sum of integers */
    {
        rfi_node *g, *xc, *R, *G;
        rfi_graph *gr = sf_graph(RF_F32, &g, &xc, &R, &G);
        const int64_t axes[3] = {0, 2, 3}, channels[1] = {1};
        rfi_graph_add_output(gr, sum_over(gr, bin(gr, RFI_OP_MUL, g, R), RF_REDUCE_MAX, axes, 3));
        rfi_graph_add_output(gr, sum_over(gr, bin(gr, RFI_OP_MUL, g, R), RF_REDUCE_SUM, channels,
                                          1));
        rfi_graph_add_output(gr, sum_over(gr, bin(gr, RFI_OP_MUL, g, xc), RF_REDUCE_SUM, axes, 3));
        rfi_graph_add_output(gr, sum_over(gr, bin(gr, RFI_OP_MUL, convert(gr, g, RF_I32),
                                                  convert(gr, R, RF_I32)),
                                          RF_REDUCE_SUM, axes, 3));
        rfi_graph *out = apply(rfi_sum_factors, gr), *ref = apply(rfi_dce, gr); /* G unused */
        char *a = ref ? body(ref) : NULL, *b = out ? body(out) : NULL;
        CHECK(a && b && strcmp(a, b) == 0);
        free(a);
        free(b);
        rfi_graph_free(ref);
        rfi_graph_free(out);
        rfi_graph_free(gr);
    }
}

static void test_one_pass_moments(void)
{
    const int64_t bn_axes[3] = {0, 2, 3}, last[1] = {3};
    /* BatchNorm's statistics: one sum of f64 deviations from the first point
     * and one of their squares, no second pass over x */
    rfi_graph *g = moments_graph(bn_axes, 3, true);
    rfi_graph *out = g ? apply(rfi_one_pass_moments, g) : NULL;
    CHECK(g && count_ops(g, RFI_OP_REDUCE) == 2);
    CHECK(out && count_ops(out, RFI_OP_REDUCE) == 2 && count_ops(out, RFI_OP_SLICE) == 1);
    for (int i = 0; out && i < out->n_nodes; i++) {
        const rfi_node *n = out->nodes[i];
        if (n->op == RFI_OP_REDUCE)
            CHECK(n->dtype == RF_F64 && n->in[0]->dtype == RF_F64 &&
                  n->in[0]->dims[0] == MOM_N);
    }
    /* as exact as two f32 passes, about a mean far from zero (|mean| / std
     * = 1e4), and when the first point is far from the rest */
    const struct {
        const char *what;
        double offset, spread, first;
    } data[] = {{"moments: centred data", 0, 1, 0},
                {"moments: a mean 1e4 spreads away", 1e4, 1, 0},
                {"moments: a first point 1e3 from the rest", 0, 1, 1e3},
                {"moments: a constant channel", 7, 0, 0}};
    for (size_t d = 0; out && d < sizeof data / sizeof data[0]; d++) {
        for (int i = 0; i < MOM_POINTS; i++)
            mom_x[i] = (float)(data[d].offset + data[d].spread * ((i * 37 % 101) / 50.0 - 1.0));
        for (int c = 0; c < MOM_C; c++)
            mom_x[c * MOM_H * MOM_W] += (float)data[d].first;
        if (data[d].spread == 0) {
            results r = {0};
            CHECK_OK(run_graph(out, mom_args, &r));
            for (int c = 0; r.n == 2 && c < MOM_C; c++)
                CHECK(((float *)r.buf[0])[c] == 7.0f && ((float *)r.buf[1])[c] == 0.0f);
            results_free(&r);
            continue;
        }
        double two_pass = moments_error(g), one_pass = moments_error(out);
        tu_checks++;
        if (!(one_pass <= fmax(two_pass, 1e-7))) {
            tu_failures++;
            fprintf(stderr, "%s: error %.3g against the two passes' %.3g\n", data[d].what,
                    one_pass, two_pass);
        }
    }
    rfi_graph_free(out);
    rfi_graph_free(g);
    /* without keepdims, and over the last axis (LayerNorm): rewritten too */
    const struct {
        const int64_t *axes;
        int n;
        bool keep;
    } forms[] = {{bn_axes, 3, false}, {last, 1, true}, {last, 1, false}};
    for (size_t f = 0; f < sizeof forms / sizeof forms[0]; f++) {
        g = moments_graph(forms[f].axes, forms[f].n, forms[f].keep);
        out = g ? apply(rfi_one_pass_moments, g) : NULL;
        CHECK(out && count_ops(out, RFI_OP_SLICE) == 1 && count_ops(out, RFI_OP_REDUCE) == 2);
        rfi_graph_free(out);
        rfi_graph_free(g);
    }
    /* left alone: f64 data, a sum of squares about another value, a variance
     * over an empty axis (NaN as written), and all with RF_ONE_PASS_MOMENTS=0 */
    for (int empty = 0; empty < 2; empty++) {
        const int64_t dims[2] = {empty ? 0 : 4, 6};
        g = graph_with_args(2, (const rf_dtype[]){RF_F64, RF_F32}, dims, 2);
        rfi_node *x64 = arg(g, 0), *x = arg(g, 1);
        const int64_t axis0[1] = {0};
        if (empty) {
            rfi_graph_add_output(g, rf_var(x, axis0, 1, false));
        } else {
            rfi_graph_add_output(g, rf_var(x64, axis0, 1, false));
            rfi_node *d = rf_sub(x, rf_mean(rf_mul(x, x), axis0, 1, true));
            rfi_graph_add_output(g, rf_sum(rf_mul(d, d), axis0, 1, false));
        }
        rfi_graph *opt = optimise(g);
        out = opt ? apply(rfi_one_pass_moments, opt) : NULL;
        CHECK(out && count_ops(out, RFI_OP_SLICE) == 0 && count_ops(out, RFI_OP_CONVERT) == 0);
        if (out && empty) {
            void *const empty_args[2] = {mom_x, mom_x}; /* (no elements read) */
            results r = {0};
            CHECK_OK(run_graph(out, empty_args, &r));
            for (int c = 0; r.n == 1 && c < 6; c++)
                CHECK(isnan(((float *)r.buf[0])[c]));
            results_free(&r);
        }
        rfi_graph_free(out);
        rfi_graph_free(opt);
        rfi_graph_free(g);
    }
    tu_set_env("RF_ONE_PASS_MOMENTS", "0");
    g = moments_graph(bn_axes, 3, true);
    out = g ? apply(rfi_one_pass_moments, g) : NULL;
    CHECK(out && count_ops(out, RFI_OP_SLICE) == 0 && out->n_nodes == g->n_nodes);
    rfi_graph_free(out);
    rfi_graph_free(g);
    tu_set_env("RF_ONE_PASS_MOMENTS", NULL);
}

/* ---- Unrolled pools (pools.c) ------------------------------------------------------ */

/* A max pool of x [xd] and its gradient select_and_scatter(x, s) (windows
 * `win`, strides `st`, padding `pad` on the last two dims) through
 * rfi_unroll_pools, with a bias gradient's sum of the gradient over dims 0, 2
 * and 3: returns whether both were rewritten (no reduce_window or
 * select_and_scatter left), after checking the results bitwise, on x full of
 * ties, signed zeros, NaNs (first NaN wins), infinities and negatives (the
 * sum too: its terms, halves and small integers, add exactly in any order). */
static bool summed_source; /* set by pool_unrolled: the gradient's sum reads the cotangent */

static bool pool_unrolled(const int64_t *xd, const int64_t *win, const int64_t *st, int64_t pad,
                          rf_dtype dt)
{
    summed_source = false;
    int64_t sd[4];
    rfi_node *x, *src;
    rfi_attrs a;
    rfi_graph *g = pool_graph(xd, win, st, pad, dt, dt, sd, &x, &src, &a);
    a.i[0] = RF_REDUCE_MAX;
    rfi_graph_add_output(g, node(g, RFI_OP_REDUCE_WINDOW, &x, 1, &a, dt, NULL, 0));
    rfi_node *sas_in[2] = {x, src};
    rfi_node *sas = node(g, RFI_OP_SELECT_AND_SCATTER, sas_in, 2, &a, dt, NULL, 0);
    rfi_graph_add_output(g, sas);
    const int64_t bias_axes[3] = {0, 2, 3}; /* a bias gradient's sum */
    rfi_attrs sum = list_attr(bias_axes, 3);
    sum.i[0] = RF_REDUCE_SUM;
    rfi_graph_add_output(g, node(g, RFI_OP_REDUCE, &sas, 1, &sum, dt, NULL, 0));
    int64_t nx = rfi_numel(xd, 4), ns = rfi_numel(sd, 4);
    double *xv = calloc((size_t)nx, 8), *sv = calloc((size_t)ns, 8);
    const double pattern[11] = {0.0, -0.0, 1.0, 1.0, NAN, -2.0, 3.0, -0.0, INFINITY, -INFINITY,
                                3.0};
    for (int64_t i = 0; i < nx; i++)
        rfi_st_f(xv, dt, i, i % 13 == 5 ? 7.0 : pattern[(i * 7) % 11]);
    for (int64_t i = 0; i < ns; i++)
        rfi_st_f(sv, dt, i, i % 9 == 4 ? -0.0 : (double)(i % 7) - 2.5);
    void *args[2] = {xv, sv};
    rfi_graph *out = apply(rfi_unroll_pools, g);
    bool unrolled = false;
    if (out) {
        CHECK(same_results(g, out, args));
        unrolled = true;
        for (int i = 0; i < out->n_nodes; i++) {
            const rfi_node *v = out->nodes[i];
            unrolled &= v->op != RFI_OP_REDUCE_WINDOW && v->op != RFI_OP_SELECT_AND_SCATTER;
            /* the sum reads the cotangent itself when the axes cover the window */
            if (v->op == RFI_OP_REDUCE)
                summed_source = v->in[0]->rank == 4 && v->in[0]->dims[2] == sd[2] &&
                                v->in[0]->dims[3] == sd[3] && v->in[0]->dims[1] == sd[1];
        }
        if (getenv("TP_SHOW")) {
            char *text = rfi_print(out);
            printf("%s", text ? text : "");
            rfi_free(text);
        }
    }
    rfi_graph_free(out);
    rfi_graph_free(g);
    free(xv);
    free(sv);
    return unrolled;
}

/* ---- Relu masks (relu_masks.c) ------------------------------------------------------ */

/* The compare nodes of g reading a max (the relu's result), and all of them. */
static void count_masks(const rfi_graph *g, int *from_relu, int *all)
{
    *from_relu = *all = 0;
    for (int i = 0; g && i < g->n_nodes; i++)
        if (g->nodes[i]->op == RFI_OP_COMPARE) {
            (*all)++;
            *from_relu += g->nodes[i]->in[0]->op == RFI_OP_MAX;
        }
}

typedef enum relu_form {
    RELU_NORMALISED,    /* z = (X - a) * b + c, X read elsewhere: rewritten */
    RELU_SOLE_READER,   /* the same, z X's only reader (a product's bias): kept */
    RELU_TWO_STREAMS,   /* z = X + x (a residual): kept */
    RELU_GE,            /* the mask y >= 0: kept (z >= 0 differs) */
    RELU_FORMS
} relu_form;

/* select(y > 0, x1, 0) for y = relu(z) over z of the given form, X = exp(x0),
 * and y and (but for RELU_SOLE_READER) -X as outputs. */
static rfi_graph *relu_graph(relu_form form)
{
    rfi_node *x;
    rfi_graph *g = g_f32(2, &x);
    rfi_node *x1 = arg(g, 1), *big = un(g, RFI_OP_EXP, x);
    rfi_node *z;
    if (form == RELU_TWO_STREAMS) {
        z = bin(g, RFI_OP_ADD, big, x1);
    } else {
        rfi_node *centred = bin(g, RFI_OP_SUB, big, splat_like(g, big, 1.5));
        z = bin(g, RFI_OP_ADD, bin(g, RFI_OP_MUL, centred, splat_like(g, big, -2.0)),
                splat_like(g, big, 0.25));
    }
    rfi_node *max_in[2] = {z, splat_like(g, z, 0.0)};
    rfi_node *y = node(g, RFI_OP_MAX, max_in, 2, NULL, RF_F32, NULL, 0);
    rfi_attrs dir = attrs0();
    dir.i[0] = form == RELU_GE ? RF_GE : RF_GT;
    rfi_node *cmp_in[2] = {y, splat_like(g, y, form == RELU_GE ? 0.0 : -0.0)};
    rfi_node *mask = node(g, RFI_OP_COMPARE, cmp_in, 2, &dir, RF_BOOL, NULL, 0);
    rfi_graph_add_output(g, select3(g, mask, x1, splat_like(g, x1, 0.0)));
    rfi_graph_add_output(g, y);
    if (form != RELU_SOLE_READER)
        rfi_graph_add_output(g, un(g, RFI_OP_NEG, big));
    return g;
}

static void test_relu_masks(void)
{
    /* rewritten only in the first form; every result bitwise the same on -0,
     * NaN and infinities (exp(inf) normalised, a -0 relu, a NaN z) */
    for (int form = 0; form < RELU_FORMS; form++) {
        rfi_graph *g = relu_graph((relu_form)form);
        rfi_graph *out = apply(rfi_relu_masks, g);
        int from_relu = 0, all = 0;
        count_masks(out, &from_relu, &all);
        CHECK(all == 1 && from_relu == (form == RELU_NORMALISED ? 0 : 1));
        CHECK(out && same_results(g, out, f32_args));
        /* the mask's own copy of z: the normalisation's nodes keep their readers */
        if (out && form == RELU_NORMALISED) {
            int subs = 0;
            for (int i = 0; i < out->n_nodes; i++)
                subs += out->nodes[i]->op == RFI_OP_SUB;
            CHECK(subs == 2);
        }
        rfi_graph_free(out);
        rfi_graph_free(g);
    }
    tu_set_env("RF_RELU_MASKS", "0");
    rfi_graph *g = relu_graph(RELU_NORMALISED);
    rfi_graph *out = apply(rfi_relu_masks, g);
    int from_relu = 0, all = 0;
    count_masks(out, &from_relu, &all);
    CHECK(all == 1 && from_relu == 1);
    rfi_graph_free(out);
    rfi_graph_free(g);
    tu_set_env("RF_RELU_MASKS", NULL);
}

static void test_unrolled_pools(void)
{
    const int64_t x8[4] = {2, 3, 8, 6}, x_odd[4] = {2, 2, 7, 5}, x_row[4] = {1, 2, 3, 9};
    const int64_t w22[4] = {1, 1, 2, 2}, w33[4] = {1, 1, 3, 3}, w13[4] = {1, 1, 1, 3};
    const int64_t w2c[4] = {1, 2, 2, 1}, w55[4] = {1, 1, 5, 5}, s11[4] = {1, 1, 1, 1};
    CHECK(pool_unrolled(x8, w22, w22, 0, RF_F32));    /* the usual 2x2 pooling */
    CHECK(summed_source);
    CHECK(pool_unrolled(x8, w22, w22, 0, RF_F64));
    CHECK(pool_unrolled(x_odd, w22, w22, 0, RF_F32)); /* an uncovered row and column */
    CHECK(pool_unrolled(x_odd, w33, w33, 0, RF_F32)); /* 9 points, two rows uncovered */
    CHECK(pool_unrolled(x_row, w13, w13, 0, RF_F32)); /* a window along one dim */
    CHECK(pool_unrolled(x8, w2c, w2c, 0, RF_F32));    /* across channels too */
    CHECK(!summed_source); /* the sum keeps the channels the window spans */
    CHECK(!pool_unrolled(x_odd, w55, w55, 0, RF_F32)); /* 25 points: kept */
    CHECK(!pool_unrolled(x8, w22, s11, 0, RF_F32));   /* overlapping: kept */
    CHECK(!pool_unrolled(x8, w22, w22, 1, RF_F32));   /* padded: kept */
    setenv("RF_UNROLL_POOLS", "0", 1);
    CHECK(!pool_unrolled(x8, w22, w22, 0, RF_F32));   /* turned off */
    unsetenv("RF_UNROLL_POOLS");
}

/* A graph of arguments x [xd] and s (x pooled by 2x2 windows), and in *sas
 * select_and_scatter(x, s): a pool's gradient, which unroll_pools spreads. */
static rfi_graph *spread_graph(const int64_t *xd, rfi_node **sas)
{
    const int64_t win[4] = {1, 1, 2, 2};
    int64_t sd[4];
    rfi_node *x, *src;
    rfi_attrs a;
    rfi_graph *g = pool_graph(xd, win, win, 0, RF_F32, RF_F32, sd, &x, &src, &a);
    rfi_node *in[2] = {x, src};
    *sas = node(g, RFI_OP_SELECT_AND_SCATTER, in, 2, &a, RF_F32, NULL, 0);
    return g;
}

/* A 2-D convolution's attributes: stride 1, padding `pad` on both sides of
 * both spatial dims, lhs and rhs dilations, no groups. */
static rfi_attrs conv2d_attrs(int64_t pad, int64_t lhs_dilation, int64_t rhs_dilation)
{
    rfi_attrs c = attrs0();
    for (int k = 0; k < 5; k++)
        c.nl[k] = 2;
    for (int d = 0; d < 2; d++) {
        c.l[0][d] = 1;
        c.l[1][d] = c.l[2][d] = pad;
        c.l[3][d] = lhs_dilation;
        c.l[4][d] = rhs_dilation;
    }
    c.i[0] = c.i[1] = 1;
    return c;
}

/* conv(select_and_scatter(x, s), w) with x [2, 3, 7, 5] pooled by 2x2 windows
 * (a row and a column uncovered), w [4, 3, 3, 3], padding `pad` on both
 * sides and lhs dilation `dil`, through rfi_unroll_pools: returns whether the
 * convolution reads the unpadded spread gradient, with its outputs that read
 * only padding put back by a pad after it when `cut`, after checking the
 * results bitwise (finite kernel). */
static bool conv_took_border(int64_t pad, int64_t dil, bool *cut)
{
    const int64_t xd[4] = {2, 3, 7, 5};
    rfi_node *sas;
    rfi_graph *g = spread_graph(xd, &sas);
    const int64_t wd[4] = {4, 3, 3, 3};
    float wv[108];
    for (int i = 0; i < 108; i++)
        wv[i] = (float)(i % 5) - 1.5f;
    rfi_attrs c = conv2d_attrs(pad, dil, 1);
    rfi_node *conv_in[2] = {sas, konst(g, RF_F32, wd, 4, wv)};
    rfi_graph_add_output(g, node(g, RFI_OP_CONVOLUTION, conv_in, 2, &c, RF_F32, NULL, 0));
    float xv[210], sv[48];
    for (int i = 0; i < 210; i++)
        xv[i] = (float)((i * 7) % 11) - 4.0f;
    for (int i = 0; i < 48; i++)
        sv[i] = i % 9 == 4 ? -0.0f : (float)(i % 7) - 2.5f;
    void *args[2] = {xv, sv};
    rfi_graph *out = apply(rfi_unroll_pools, g);
    bool took = false;
    *cut = false;
    for (int i = 0; out && i < out->n_nodes; i++) {
        const rfi_node *v = out->nodes[i];
        if (v->op == RFI_OP_CONVOLUTION)
            took = v->in[0]->op != RFI_OP_PAD && v->in[0]->dims[2] == 6;
        if (v->op == RFI_OP_PAD && v->in[0]->op == RFI_OP_CONVOLUTION)
            *cut = v->attr.l[1][2] == 1 && v->attr.l[1][3] == 1 && v->attr.l[0][2] == 0;
    }
    if (out)
        CHECK(same_results(g, out, args));
    rfi_graph_free(out);
    rfi_graph_free(g);
    return took;
}

/* The weight gradient conv(transpose(a), transpose(sas)) of a 3x3-ish layer
 * whose output [2, 4, 7, 5] a 2x2 pool covers but for a row and a column
 * (sas = select_and_scatter, so the spread has a +0 border), with the
 * layer's padding `pad` (low and high), rhs dilation `dil` and a [2, 3, H,
 * W] input sized for a 3x3 result, through rfi_unroll_pools: returns
 * whether the convolution's kernel is the unpadded 6x4 spread, with in
 * *cut_x how many rows of a it reads fewer (0: not sliced) and in *pad_hi
 * its high padding, after checking the results bitwise. With `one` the
 * border is an explicit pad of 1, not +0. */
static bool kernel_took_border(int64_t pad, int64_t dil, bool one, int64_t *cut_x,
                               int64_t *pad_hi)
{
    const int64_t xd[4] = {2, 4, 7, 5};
    const int64_t ad[4] = {2, 3, 2 + 6 * dil + 1 - 2 * pad, 2 + 4 * dil + 1 - 2 * pad};
    rfi_node *dy;
    rfi_graph *g = spread_graph(xd, &dy);
    if (one) {
        float v = 1.0f;
        rfi_attrs p = attrs0();
        p.nl[0] = p.nl[1] = p.nl[2] = 4;
        p.l[1][2] = p.l[1][3] = 1;
        rfi_node *inner = node(g, RFI_OP_SLICE, &dy, 1,
                               &(rfi_attrs){.nl = {4, 4, 4},
                                            .l = {{0, 0, 0, 0}, {2, 4, 6, 4}, {1, 1, 1, 1}}},
                               RF_F32, NULL, 0);
        rfi_node *pad_in[2] = {inner, konst(g, RF_F32, NULL, 0, &v)};
        dy = node(g, RFI_OP_PAD, pad_in, 2, &p, RF_F32, NULL, 0);
    }
    float av[2 * 3 * 15 * 11];
    for (int i = 0; i < 2 * 3 * 15 * 11; i++)
        av[i] = (float)((i * 5) % 13) * 0.25f - 1.375f;
    rfi_node *act = konst(g, RF_F32, ad, 4, av);
    rfi_attrs c = conv2d_attrs(pad, 1, dil);
    const int64_t swap[4] = {1, 0, 2, 3};
    rfi_node *conv_in[2] = {transpose(g, act, swap), transpose(g, dy, swap)};
    rfi_graph_add_output(g, node(g, RFI_OP_CONVOLUTION, conv_in, 2, &c, RF_F32, NULL, 0));
    float xv[280], sv[48];
    for (int i = 0; i < 280; i++)
        xv[i] = (float)((i * 7) % 11) - 4.0f;
    for (int i = 0; i < 48; i++)
        sv[i] = (float)(i % 7) - 2.5f;
    void *args[2] = {xv, sv};
    rfi_graph *out = apply(rfi_unroll_pools, g);
    bool took = false;
    *cut_x = *pad_hi = -1;
    for (int i = 0; out && i < out->n_nodes; i++) {
        const rfi_node *v = out->nodes[i];
        if (v->op != RFI_OP_CONVOLUTION)
            continue;
        took = v->in[1]->dims[2] == 6 && v->in[1]->dims[3] == 4;
        *cut_x = ad[2] - v->in[0]->dims[2];
        *pad_hi = v->attr.l[2][0];
    }
    if (out)
        CHECK(same_results(g, out, args));
    rfi_graph_free(out);
    rfi_graph_free(g);
    return took;
}

static void test_kernel_over_pool_border(void)
{
    int64_t cut, hi;
    CHECK(kernel_took_border(0, 1, false, &cut, &hi)); /* the cnn's: a is read as 8x6 */
    CHECK(cut == 1 && hi == 0);
    CHECK(kernel_took_border(1, 1, false, &cut, &hi)); /* a padded layer: less padding */
    CHECK(cut == 0 && hi == 0);
    CHECK(kernel_took_border(0, 2, false, &cut, &hi)); /* a strided layer's */
    CHECK(cut == 2 && hi == 0);
    CHECK(kernel_took_border(1, 2, false, &cut, &hi)); /* both */
    CHECK(cut == 1 && hi == 0);
    CHECK(!kernel_took_border(0, 1, true, &cut, &hi)); /* a border of ones: kept */
    CHECK(cut == 0);
}

static void test_conv_over_pool_border(void)
{
    bool cut;
    CHECK(conv_took_border(2, 1, &cut)); /* the input gradient of a 3x3 layer */
    CHECK(cut);
    CHECK(conv_took_border(1, 1, &cut)); /* the last outputs still read the input */
    CHECK(!cut);
    CHECK(!conv_took_border(2, 2, &cut)); /* lhs dilation: the pad stays */
}

/* ---- Constants ------------------------------------------------------------------------ */

static void test_constants(void)
{
    rfi_node *x;
    rfi_graph *g = g_f32(1, &x);
    float a[6] = {1, 2, 3, 4, 5, 6}, mixed_zero[6] = {0, 0, 0, -0.0f, 0, 0};
    rfi_node *ca = konst(g, RF_F32, D23, 2, a);
    /* folded: ca + ca, exp(ca), and a sum over ca */
    rfi_graph_add_output(g, bin(g, RFI_OP_ADD, ca, ca));
    rfi_node *s = node(g, RFI_OP_REDUCE, &ca, 1, &(rfi_attrs){.nl = {1}, .l = {{1}}}, RF_F32,
                       NULL, 0);
    rfi_graph_add_output(g, s);
    /* a splat constant becomes its splat form; +0/-0 mixed is no splat */
    rfi_graph_add_output(g, bin(g, RFI_OP_MUL, x, filled_like(g, x, 2.5)));
    rfi_graph_add_output(g, bin(g, RFI_OP_MUL, x, konst(g, RF_F32, D23, 2, mixed_zero)));
    /* elementwise over splats folds to a splat */
    rfi_node *e = un(g, RFI_OP_EXP, filled_like(g, x, 0.0));
    rfi_graph_add_output(g, bin(g, RFI_OP_ADD, x, bin(g, RFI_OP_SUB, e, splat_like(g, x, 1))));
    expect("folding and splats", rfi_simplify, g,
           "%0 = argument {index=0} : f32[2,3]\n"
           "%1 = constant {values=[2, 4, 6, 8, 10, 12]} : f32[2,3]\n"
           "%2 = constant {values=[6, 15]} : f32[2]\n"
           "%3 = constant {value=2.5} : f32[]\n"
           "%4 = broadcast_in_dim(%3) {map=[]} : f32[2,3]\n"
           "%5 = mul(%0, %4) : f32[2,3]\n"
           "%6 = constant {values=[0, 0, 0, -0, 0, 0]} : f32[2,3]\n"
           "%7 = mul(%0, %6) : f32[2,3]\n"
           "%8 = constant {value=0} : f32[]\n"
           "%9 = broadcast_in_dim(%8) {map=[]} : f32[2,3]\n"
           "%10 = add(%0, %9) : f32[2,3]\n"
           "outputs: %1, %2, %5, %7, %10\n",
           f32_args);
}

/* Large splats stay splats through elementwise ops and shape ops; large
 * non-splat constants are not folded. */
static void test_large_constants(void)
{
    rfi_graph *g = graph_with_args(0, NULL, NULL, 0);
    const int64_t big[2] = {1000, 1000};
    unsigned char one[4];
    rfi_st_f(one, RF_F32, 0, 1.0);
    rfi_node *s = konst(g, RF_F32, NULL, 0, one);
    rfi_node *b = node(g, RFI_OP_BROADCAST_IN_DIM, &s, 1, NULL, RF_F32, big, 2);
    rfi_node *e = un(g, RFI_OP_EXP, b);
    rfi_node *t = transpose(g, e, (const int64_t[]){1, 0});
    rfi_graph_add_output(g, reshape(g, t, (const int64_t[]){1000000}, 1));
    rfi_node *io = node(g, RFI_OP_IOTA, NULL, 0, NULL, RF_F32, (const int64_t[]){5000}, 1);
    rfi_graph_add_output(g, un(g, RFI_OP_NEG, io));
    float *ramp = malloc(5000 * sizeof *ramp);
    for (int i = 0; i < 5000; i++)
        ramp[i] = (float)i;
    rfi_graph_add_output(g, un(g, RFI_OP_NEG, konst(g, RF_F32, (const int64_t[]){5000}, 1, ramp)));
    free(ramp);
    rfi_graph *out = apply(rfi_simplify, g);
    if (out) {
        char *got = body(out);
        CHECK(strstr(got, "%0 = constant {value=2.71828175} : f32[]\n"
                          "%1 = broadcast_in_dim(%0) {map=[]} : f32[1000000]\n") != NULL);
        CHECK(strstr(got, "neg(") != NULL); /* neither 5000-element neg is folded */
        CHECK(out->n_nodes == 6);
        if (out->n_nodes != 6 || !strstr(got, "broadcast_in_dim(%0) {map=[]} : f32[1000000]"))
            fprintf(stderr, "%s", got);
        free(got);
        CHECK(same_results(g, out, NULL));
    }
    rfi_graph_free(out);
    rfi_graph_free(g);
}

/* Folding reaches values with no elements, whose constants hold no bytes (a
 * NULL pointer): a product with a scalar folds like any other. */
static void test_empty_constants(void)
{
    rfi_graph *g = graph_with_args(0, NULL, NULL, 0);
    unsigned char two[4], half[4];
    rfi_st_f(two, RF_F32, 0, -2.0);
    rfi_st_f(half, RF_F32, 0, 0.5);
    rfi_node *s = konst(g, RF_F32, NULL, 0, two);
    rfi_node *b = node(g, RFI_OP_BROADCAST_IN_DIM, &s, 1, NULL, RF_F32, (const int64_t[]){0, 3}, 2);
    rfi_node *in[2] = {b, konst(g, RF_F32, NULL, 0, half)};
    in[0] = node(g, RFI_OP_DOT_GENERAL, in, 2, NULL, RF_F32, NULL, 0); /* folds to no bytes */
    rfi_graph_add_output(g, node(g, RFI_OP_DOT_GENERAL, in, 2, NULL, RF_F32, NULL, 0));
    rfi_graph *out = apply(rfi_simplify, g);
    if (out) {
        CHECK(out->n_outputs == 1 && rfi_node_numel(out->outputs[0]) == 0);
        CHECK(same_results(g, out, NULL));
    }
    rfi_graph_free(out);
    rfi_graph_free(g);
}

/* ---- CSE -------------------------------------------------------------------------------- */

static void test_cse(void)
{
    rfi_node *x;
    rfi_graph *g = g_f32(2, &x);
    rfi_node *y = arg(g, 1);
    rfi_node *x2 = arg(g, 0); /* a second node of argument 0: merged */
    rfi_graph_add_output(g, bin(g, RFI_OP_ADD, un(g, RFI_OP_EXP, x), un(g, RFI_OP_EXP, x2)));
    rfi_graph_add_output(g, bin(g, RFI_OP_ADD, x, y));
    rfi_graph_add_output(g, bin(g, RFI_OP_ADD, y, x)); /* float: operand order kept */
    rfi_graph_add_output(g, un(g, RFI_OP_NEG, y));      /* argument 1 is not argument 0 */
    rfi_graph_add_output(g, un(g, RFI_OP_NEG, x));
    rfi_graph_add_output(g, bin(g, RFI_OP_MUL, filled_like(g, x, 2), filled_like(g, x, 2)));
    expect("cse (f32)", rfi_cse, g,
           "%0 = argument {index=0} : f32[2,3]\n"
           "%1 = argument {index=1} : f32[2,3]\n"
           "%2 = exp(%0) : f32[2,3]\n"
           "%3 = add(%2, %2) : f32[2,3]\n"
           "%4 = add(%0, %1) : f32[2,3]\n"
           "%5 = add(%1, %0) : f32[2,3]\n"
           "%6 = neg(%1) : f32[2,3]\n"
           "%7 = neg(%0) : f32[2,3]\n"
           "%8 = constant {values=[2, 2, 2, 2, 2, 2]} : f32[2,3]\n"
           "%9 = mul(%8, %8) : f32[2,3]\n"
           "outputs: %3, %4, %5, %6, %7, %9\n",
           f32_args);

    /* integers: commutative ops merge across operand order */
    rfi_graph *h = graph_with_args(2, (const rf_dtype[]){RF_I32, RF_I32}, D23, 2);
    rfi_node *a = arg(h, 0), *b = arg(h, 1);
    rfi_graph_add_output(h, bin(h, RFI_OP_ADD, a, b));
    rfi_graph_add_output(h, bin(h, RFI_OP_ADD, b, a));
    rfi_graph_add_output(h, bin(h, RFI_OP_SUB, a, b));
    rfi_graph_add_output(h, bin(h, RFI_OP_SUB, b, a));
    rfi_graph_add_output(h, bin(h, RFI_OP_MAX, b, a));
    rfi_graph_add_output(h, bin(h, RFI_OP_MAX, a, b));
    expect("cse (i32)", rfi_cse, h,
           "%0 = argument {index=0} : i32[2,3]\n"
           "%1 = argument {index=1} : i32[2,3]\n"
           "%2 = add(%0, %1) : i32[2,3]\n"
           "%3 = sub(%0, %1) : i32[2,3]\n"
           "%4 = sub(%1, %0) : i32[2,3]\n"
           "%5 = max(%1, %0) : i32[2,3]\n"
           "outputs: %2, %2, %3, %4, %5, %5\n",
           i32_args);

    /* constants merge on their bytes, weak (traced rf_scalar) or not */
    rfi_graph *w = graph_with_args(0, NULL, NULL, 0);
    float one = 1.0f;
    rfi_node *c1 = konst(w, RF_F32, NULL, 0, &one), *c2 = konst(w, RF_F32, NULL, 0, &one);
    c2->weak = true;
    c2->attr.i[0] = 42;
    rfi_graph_add_output(w, bin(w, RFI_OP_SUB, c1, c2));
    expect("cse (weak constants)", rfi_cse, w,
           "%0 = constant {value=1} : f32[]\n"
           "%1 = sub(%0, %0) : f32[]\n"
           "outputs: %1\n",
           NULL);

    /* RNG: same key and stream merge, different streams do not */
    rfi_graph *k = graph_with_args(0, NULL, NULL, 0);
    int64_t key[2] = {1, 2};
    rfi_node *kn = konst(k, RF_I64, (const int64_t[]){2}, 1, key);
    rfi_attrs s0 = attrs0(), s1 = attrs0();
    s1.i[1] = 1;
    rfi_node *r0 = node(k, RFI_OP_RNG, &kn, 1, &s0, RF_F32, D23, 2);
    rfi_node *r0b = node(k, RFI_OP_RNG, &kn, 1, &s0, RF_F32, D23, 2);
    rfi_node *r1 = node(k, RFI_OP_RNG, &kn, 1, &s1, RF_F32, D23, 2);
    rfi_graph_add_output(k, bin(k, RFI_OP_SUB, r0, r0b));
    rfi_graph_add_output(k, bin(k, RFI_OP_SUB, r0, r1));
    expect("cse (rng)", rfi_cse, k,
           "%0 = constant {values=[1, 2]} : i64[2]\n"
           "%1 = rng(%0) {dist=uniform, stream=0} : f32[2,3]\n"
           "%2 = rng(%0) {dist=uniform, stream=1} : f32[2,3]\n"
           "%3 = sub(%1, %1) : f32[2,3]\n"
           "%4 = sub(%1, %2) : f32[2,3]\n"
           "outputs: %3, %4\n",
           NULL);
}

/* Captures, updates and unused arguments keep their indices and order. */
static void test_captures_and_updates(void)
{
    rf_array *w = rf_array_from(RF_F32, D23, 2, f32_in);
    rf_array *v = rf_array_from(RF_F32, D23, 2, f32_in);
    rfi_graph *g = graph_with_args(2, F32x3, D23, 2);
    int cw = rfi_graph_capture_index(g, w), cv = rfi_graph_capture_index(g, v);
    rfi_attrs a = attrs0();
    a.i[0] = cv;
    rfi_node *vn = node(g, RFI_OP_CAPTURE, NULL, 0, &a, RF_F32, D23, 2);
    a.i[0] = cw;
    rfi_node *wn = node(g, RFI_OP_CAPTURE, NULL, 0, &a, RF_F32, D23, 2);
    rfi_node *x = arg(g, 1);
    rfi_node *sum = bin(g, RFI_OP_ADD, wn, bin(g, RFI_OP_MUL, x, splat_like(g, x, 1)));
    rfi_graph_add_output(g, un(g, RFI_OP_STOP_GRADIENT, sum));
    rfi_graph_add_update(g, cv, bin(g, RFI_OP_ADD, vn, splat_like(g, x, -0.0))); /* = v */
    rfi_graph_add_update(g, cw, sum);
    rfi_graph_add_output(g, x);
    rfi_graph *out = optimise(g);
    if (out) {
        CHECK(out->n_args == 2 && out->n_captures == 2);
        CHECK(out->captures[0] == w && out->captures[1] == v);
        CHECK(out->n_outputs == 2 && out->n_updates == 2);
        CHECK(out->updates[0].capture == cv && out->updates[1].capture == cw);
        char *got = body(out);
        const char *want = "%0 = capture {index=1} : f32[2,3]\n"
                           "%1 = capture {index=0} : f32[2,3]\n"
                           "%2 = argument {index=1} : f32[2,3]\n"
                           "%3 = add(%1, %2) : f32[2,3]\n"
                           "outputs: %3, %2\n"
                           "update capture1 <- %0\n"
                           "update capture0 <- %3\n";
        CHECK(strcmp(got, want) == 0);
        if (strcmp(got, want) != 0)
            fprintf(stderr, "--- got:\n%s--- want:\n%s", got, want);
        free(got);
        CHECK(same_results(g, out, f32_args));
    }
    rfi_graph_free(out);
    rfi_graph_free(g);
    rf_array_free(w);
    rf_array_free(v);
}

static void test_bad_input(void)
{
    rfi_graph *out = (rfi_graph *)1;
    CHECK_STATUS(rfi_simplify(NULL, &out), RF_E_INVALID);
    CHECK(out == NULL);
    CHECK_STATUS(rfi_cse(NULL, &out), RF_E_INVALID);
    CHECK_STATUS(rfi_simplify(NULL, NULL), RF_E_INVALID);
    CHECK_STATUS(rfi_cse(NULL, NULL), RF_E_INVALID);
}

/* ---- Randomised chains -------------------------------------------------------------- */

static uint64_t rng_state;
static unsigned rnd(unsigned n)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (unsigned)(rng_state % n);
}

/* Reshape targets of six elements. */
static const int64_t shapes6[][3] = {{6}, {2, 3}, {3, 2}, {1, 6}, {6, 1}, {2, 3, 1}, {1, 2, 3}};
static const int ranks6[] = {1, 2, 2, 2, 2, 3, 3};

static bool same_shape(const rfi_node *a, const rfi_node *b)
{
    return a->rank == b->rank && memcmp(a->dims, b->dims, (size_t)a->rank * sizeof a->dims[0]) == 0;
}

/* One random step on cur (f32 or f64 with six elements), from the rewrite menu. */
static rfi_node *random_step(rfi_graph *g, rfi_node *cur, rfi_node *other)
{
    static const double consts[] = {0.0, -0.0, 1.0, 2.5, NAN, -1.0};
    double c = consts[rnd(6)];
    rfi_node *k = rnd(2) ? splat_like(g, cur, c) : filled_like(g, cur, c);
    switch (rnd(16)) {
    case 0: return bin(g, RFI_OP_ADD, cur, k);
    case 1: return bin(g, RFI_OP_ADD, k, cur);
    case 2: return bin(g, RFI_OP_SUB, cur, k);
    case 3: return bin(g, RFI_OP_MUL, cur, k);
    case 4: return bin(g, RFI_OP_MUL, k, cur);
    case 5: return bin(g, RFI_OP_DIV, cur, k);
    case 6: return un(g, RFI_OP_NEG, cur);
    case 7: {
        int s = (int)rnd(7);
        return reshape(g, cur, shapes6[s], ranks6[s]);
    }
    case 8: {
        int64_t perm[3] = {0, 1, 2};
        for (int i = cur->rank - 1; i > 0; i--) {
            int j = (int)rnd((unsigned)i + 1);
            int64_t t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
        return transpose(g, cur, perm);
    }
    case 9: { /* a leading dim of 1 keeps six elements */
        if (cur->rank >= 3)
            return un(g, RFI_OP_STOP_GRADIENT, cur);
        int64_t map[3], dims[4] = {1};
        for (int i = 0; i < cur->rank; i++) {
            map[i] = i + 1;
            dims[i + 1] = cur->dims[i];
        }
        return broadcast(g, cur, map, dims, cur->rank + 1);
    }
    case 10:
        return cur->dtype == RF_F32 ? convert(g, convert(g, cur, RF_F64), RF_F32)
                                    : convert(g, cur, RF_F32);
    case 11: return convert(g, cur, RF_F64);
    case 12: {
        uint8_t p = (uint8_t)rnd(2);
        rfi_node *pn = konst(g, RF_BOOL, NULL, 0, &p);
        return select3(g, pn, cur, un(g, RFI_OP_NEG, cur));
    }
    case 13: return bin(g, RFI_OP_ADD, un(g, RFI_OP_TANH, cur), un(g, RFI_OP_TANH, cur));
    case 14: { /* mix in another value of the same type */
        if (other->dtype != cur->dtype || !same_shape(other, cur))
            return un(g, RFI_OP_EXP, cur);
        return bin(g, RFI_OP_MAX, cur, other);
    }
    default: return bin(g, RFI_OP_MUL, un(g, RFI_OP_NEG, k), cur);
    }
}

/* Nodes that cost anything: all but rank-0 constants (scalars the fusion
 * stage folds into kernels; the splat form adds one per distinct value). */
static int cost(const rfi_graph *g)
{
    int n = 0;
    for (int i = 0; i < g->n_nodes; i++)
        n += !(g->nodes[i]->op == RFI_OP_CONSTANT && g->nodes[i]->rank == 0);
    return n;
}

/* Random chains over two f32[2,3] arguments: same bits, no more costly nodes. */
static void test_random_chains(void)
{
    int worse = 0, total_before = 0, total_after = 0;
    for (int trial = 0; trial < 300; trial++) {
        rng_state = 0x9e3779b97f4a7c15ull + (uint64_t)trial * 7919u;
        rfi_node *x;
        rfi_graph *g = g_f32(2, &x);
        rfi_node *other = arg(g, 1), *cur = x;
        int steps = 1 + (int)rnd(12);
        for (int i = 0; i < steps && cur; i++) {
            rfi_node *next = random_step(g, cur, other);
            if (rnd(3) == 0)
                other = cur;
            cur = next;
        }
        if (!cur) {
            rfi_graph_free(g);
            continue;
        }
        rfi_graph_add_output(g, cur);
        if (rnd(2))
            rfi_graph_add_output(g, other);
        rfi_graph *before = apply(rfi_dce, g);
        rfi_graph *after = optimise(g);
        if (before && after) {
            total_before += before->n_nodes;
            total_after += after->n_nodes;
            if (cost(after) > cost(before)) {
                worse++;
                char *a = rfi_print(before), *b = rfi_print(after);
                fprintf(stderr, "random chain %d grew:\n%s---\n%s", trial, a, b);
                rfi_free(a);
                rfi_free(b);
            }
            if (!same_results(g, after, f32_args)) {
                tu_failures++;
                char *a = rfi_print(g), *b = rfi_print(after);
                fprintf(stderr, "random chain %d differs:\n%s---\n%s", trial, a, b);
                rfi_free(a);
                rfi_free(b);
            }
        }
        rfi_graph_free(before);
        rfi_graph_free(after);
        rfi_graph_free(g);
    }
    CHECK(worse == 0);
    CHECK(total_after < total_before);
    printf("random chains: %d nodes -> %d after simplify+cse+dce\n", total_before, total_after);
}

/* ---- Compiled programs: gradients and a training step --------------------------------- */

/* Fills n floats: mostly normal values from the seed, some corner values. */
static void fill_random(float *p, int64_t n, uint64_t seed, bool corners)
{
    rng_state = seed * 2654435761u + 1;
    static const float special[] = {0.0f, -0.0f, 1.0f, -1.0f};
    for (int64_t i = 0; i < n; i++) {
        unsigned r = rnd(1000);
        p[i] = corners && r < 40 ? special[r % 4] : ((float)r - 500.0f) / 250.0f;
    }
}

/* Optimises e's program and runs both on random arguments (several seeds):
 * bitwise equal, no more nodes. *before / *after receive the node counts. */
static void check_program(const char *what, const rfi_graph *prog, int *before, int *after)
{
    rfi_graph *opt = optimise(prog);
    if (!opt)
        return;
    *before = prog->n_nodes;
    *after = opt->n_nodes;
    if (getenv("TP_SHOW")) {
        char *a = rfi_print(prog), *b = rfi_print(opt);
        fprintf(stderr, "%s\n--- optimised:\n%s", a, b);
        rfi_free(a);
        rfi_free(b);
    }
    CHECK(opt->n_nodes <= prog->n_nodes);
    for (uint64_t seed = 1; seed <= 4; seed++) {
        void *args[8] = {0};
        for (int i = 0; i < prog->n_args && i < 8; i++) {
            int64_t n = rfi_numel(prog->arg_dims[i], prog->arg_ranks[i]);
            args[i] = calloc((size_t)(n > 0 ? n : 1), sizeof(float));
            fill_random(args[i], n, seed * 31 + (uint64_t)i, seed > 2);
        }
        if (!same_results(prog, opt, args)) {
            tu_failures++;
            fprintf(stderr, "%s: optimised program differs (seed %d)\n", what, (int)seed);
        }
        for (int i = 0; i < 8; i++)
            free(args[i]);
    }
    rfi_graph_free(opt);
}

/* x f32[4,3], w f32[3,5], b f32[5]; a loss of variant v and its gradients. */
static void grad_program(rf_trace *t, void *ctx)
{
    int v = *(const int *)ctx;
    rf_tensor *x = rf_arg(t, 0), *w = rf_arg(t, 1), *b = rf_arg(t, 2);
    rf_tensor *h = rf_add(rf_matmul(x, w), b);
    rf_tensor *act = v == 0   ? rf_tanh(h)
                     : v == 1 ? rf_logistic(h)
                     : v == 2 ? rf_relu(h)
                     : v == 3 ? rf_softmax(h, 1)
                              : rf_mul(rf_exp(rf_neg(h)), rf_stop_gradient(rf_sqrt(rf_abs(h))));
    rf_tensor *loss = rf_mean_all(rf_mul(act, act));
    rf_tensor *wrt[3] = {x, w, b}, *grads[3] = {0};
    rf_grad(t, loss, wrt, 3, grads);
    rf_return(t, loss);
    for (int i = 0; i < 3; i++)
        rf_return(t, grads[i]);
}

static rf_array *cpu_array(const int64_t *dims, int rank, uint64_t seed)
{
    rf_array *h = rf_randn(RF_F32, dims, rank, seed);
    rf_array *d = rf_array_to(h, rf_device_cpu());
    rf_array_free(h);
    return d;
}

static void test_gradient_programs(void)
{
    rf_array *args[3] = {cpu_array((const int64_t[]){4, 3}, 2, 1),
                         cpu_array((const int64_t[]){3, 5}, 2, 2),
                         cpu_array((const int64_t[]){5}, 1, 3)};
    for (int v = 0; v < 5; v++) {
        rf_compile_opts o = {.device = rf_device_cpu(), .name = "grad"};
        rf_exec *e = NULL;
        CHECK_OK(rf_compile_with(grad_program, &v, args, 3, &o, &e));
        if (!e)
            continue;
        int before = 0, after = 0;
        check_program("gradient program", e->prog, &before, &after);
        printf("gradient program %d: %d nodes -> %d\n", v, before, after);
        rf_exec_free(e);
    }
    for (int i = 0; i < 3; i++)
        rf_array_free(args[i]);
}

/* ---- A recurrence's weight gradients, merged ------------------------------------------- */

enum { MERGE_STEPS = 12, MERGE_BATCH = 4, MERGE_IN = 8, MERGE_HIDDEN = 32 };

/* h_t = tanh(x_t W + h_(t-1) U) over MERGE_STEPS steps, x_t the t-th MERGE_IN columns
 * of x; returns the gradients of sum(h_T) with respect to W and U, each a sum of one
 * product per step. */
static void recurrence_program(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = rf_arg(t, 0), *w = rf_arg(t, 1), *u = rf_arg(t, 2), *h = NULL;
    for (int s = 0; s < MERGE_STEPS; s++) {
        const int64_t lo[2] = {0, MERGE_IN * s}, hi[2] = {MERGE_BATCH, MERGE_IN * (s + 1)};
        rf_tensor *z = rf_matmul(rf_slice(x, lo, hi, NULL), w);
        h = rf_tanh(h ? rf_add(z, rf_matmul(h, u)) : z);
    }
    rf_tensor *wrt[2] = {w, u}, *grads[2] = {0};
    CHECK_OK(rf_grad(t, rf_sum_all(h), wrt, 2, grads));
    rf_return(t, grads[0]);
    rf_return(t, grads[1]);
}

/* A CPU f32 matrix of normal values times `scale`. */
static rf_array *scaled_cpu_array(const int64_t *dims, uint64_t seed, double scale)
{
    rf_array *h = rf_randn(RF_F32, dims, 2, seed);
    float *v = h ? rf_array_data(h) : NULL;
    for (int64_t i = 0; v && i < dims[0] * dims[1]; i++)
        v[i] = (float)(v[i] * scale);
    rf_array *d = rf_array_to(h, rf_device_cpu());
    rf_array_free(h);
    return d;
}

static int count_dots(const rfi_graph *g)
{
    int n = 0;
    for (int i = 0; i < g->n_nodes; i++)
        n += g->nodes[i]->op == RFI_OP_DOT_GENERAL;
    return n;
}

/* The largest |a - b| over |b|'s largest element, of two f32 results. */
static double relative_gap(const float *a, const float *b, int64_t n)
{
    double gap = 0, scale = 0;
    for (int64_t i = 0; i < n; i++) {
        gap = fmax(gap, fabs((double)a[i] - (double)b[i]));
        scale = fmax(scale, fabs((double)b[i]));
    }
    return scale > 0 ? gap / scale : gap;
}

/* Whether every concatenation of g whose operands all occur in a longer one
 * lists them as one run of the longer one's, in its order (merge_dots.c
 * concatenates the shared output gradients of a recurrence alike); *pairs
 * counts such pairs. */
static bool shared_runs_align(const rfi_graph *g, int *pairs)
{
    *pairs = 0;
    for (int i = 0; i < g->n_nodes; i++) {
        const rfi_node *c = g->nodes[i];
        for (int j = 0; c->op == RFI_OP_CONCATENATE && j < g->n_nodes; j++) {
            const rfi_node *d = g->nodes[j];
            if (d->op != RFI_OP_CONCATENATE || d->n_in >= c->n_in)
                continue;
            int at = -1;
            for (int k = 0; k < c->n_in && at < 0; k++)
                at = c->in[k] == d->in[0] ? k : -1;
            if (at < 0)
                continue;
            (*pairs)++;
            for (int k = 0; k < d->n_in; k++)
                if (at + k >= c->n_in || c->in[at + k] != d->in[k])
                    return false;
        }
    }
    return true;
}

/* merge_dots on a traced recurrence: each weight's gradient becomes one product
 * (2 * MERGE_STEPS - 3 products fewer), the merged program agrees with the traced one
 * on the interpreter, and the compiled executable (the cpu backend runs the pass)
 * with the interpreter, to rounding (1e-5 of the gradient's largest element). */
static void test_merged_recurrence(void)
{
    /* weights of a usual initialisation's scale: tanh stays off saturation, whose
     * gradients magnify rounding through the steps */
    rf_array *args[3] = {cpu_array((const int64_t[]){MERGE_BATCH, MERGE_IN * MERGE_STEPS}, 2, 7),
                         scaled_cpu_array((const int64_t[]){MERGE_IN, MERGE_HIDDEN}, 8, 0.3),
                         scaled_cpu_array((const int64_t[]){MERGE_HIDDEN, MERGE_HIDDEN}, 9, 0.15)};
    rf_compile_opts o = {.device = rf_device_cpu(), .name = "recurrence"};
    rf_exec *e = NULL;
    CHECK_OK(rf_compile_with(recurrence_program, NULL, args, 3, &o, &e));
    rfi_graph *opt = e ? optimise(e->prog) : NULL;
    rfi_graph *merged = opt ? apply(rfi_merge_dots, opt) : NULL;
    if (merged) {
        int before = count_dots(opt), after = count_dots(merged);
        printf("recurrence of %d steps: %d products -> %d merged\n", MERGE_STEPS, before, after);
        CHECK(after == before - (2 * MERGE_STEPS - 3));
        /* the input weights' gradient concatenates all steps' output gradients,
         * the hidden weights' all but the first step's: in one order */
        int pairs = 0;
        CHECK(shared_runs_align(merged, &pairs));
        CHECK(pairs >= 1);
        void *in[3] = {rf_array_data(args[0]), rf_array_data(args[1]), rf_array_data(args[2])};
        results want = {0}, got = {0};
        CHECK_OK(run_graph(opt, in, &want));
        CHECK_OK(run_graph(merged, in, &got));
        rf_array *out[2] = {NULL, NULL};
        CHECK_OK(rf_exec_run(e, args, 3, out, 2));
        for (int i = 0; i < 2 && want.n == 2 && got.n == 2; i++) {
            int64_t n = (int64_t)(want.nbytes[i] / sizeof(float));
            double merged_gap = relative_gap(got.buf[i], want.buf[i], n);
            double compiled_gap = out[i] ? relative_gap(rf_array_data(out[i]), want.buf[i], n) : 1;
            if (merged_gap > 1e-5 || compiled_gap > 1e-5)
                fprintf(stderr, "  gradient %d: merged %.3g, compiled %.3g off\n", i, merged_gap,
                        compiled_gap);
            CHECK(merged_gap <= 1e-5 && compiled_gap <= 1e-5);
        }
        results_free(&want);
        results_free(&got);
        rf_array_free(out[0]);
        rf_array_free(out[1]);
    }
    rfi_graph_free(merged);
    rfi_graph_free(opt);
    rf_exec_free(e);
    for (int i = 0; i < 3; i++)
        rf_array_free(args[i]);
}

/* ---- Padded convolutions (pad_convs.c) ------------------------------------------------ */

static int count_op(const rfi_graph *g, rfi_op op)
{
    int n = 0;
    for (int i = 0; i < g->n_nodes; i++)
        n += g->nodes[i]->op == op;
    return n;
}

/* A convolution of x [2,3,6,6] by w [4,3,3,3] with padding lo/hi and lhs dilation ldil. */
static rfi_node *conv_node(rfi_graph *g, rfi_node *x, rfi_node *w, int64_t lo, int64_t hi,
                           int64_t ldil)
{
    rfi_attrs a = attrs0();
    a.i[0] = a.i[1] = 1; /* one feature group, one batch group */
    for (int k = 0; k < 5; k++)
        a.nl[k] = 2;
    for (int d = 0; d < 2; d++) {
        a.l[0][d] = 1;
        a.l[1][d] = lo;
        a.l[2][d] = hi;
        a.l[3][d] = ldil;
        a.l[4][d] = 1;
    }
    rfi_node *in[2] = {x, w};
    return node(g, RFI_OP_CONVOLUTION, in, 2, &a, x->dtype, NULL, 0);
}

/* rfi_pad_convs with the cpu plan's predicate: the f64 convolutions (loops)
 * padded by 1 and lhs-dilated by 2 (with padding 2/1) read PADs of zeros,
 * unpadded themselves (the dilated one's pad has interior 1); the one
 * cropped by negative padding and the f32 one (8 features: a library call) keep their
 * padding. Bitwise the same results, with an infinity in x and a NaN in w
 * (which padding times NaN turns into NaNs in both). */
static void test_padded_convs(void)
{
    rf_dtype dts[4] = {RF_F64, RF_F64, RF_F32, RF_F32};
    int ranks[4] = {4, 4, 4, 4};
    int64_t dims[4][RF_MAX_RANK] = {{2, 3, 6, 6}, {4, 3, 3, 3}, {2, 3, 6, 6}, {8, 3, 3, 3}};
    rfi_graph *g = rfi_graph_new(rf_device_cpu(), "t");
    CHECK_OK(rfi_graph_set_args(g, 4, dts, ranks, (const int64_t(*)[RF_MAX_RANK])dims));
    rfi_node *x = arg(g, 0), *w = arg(g, 1), *x32 = arg(g, 2), *w32 = arg(g, 3);
    rfi_node *ys[4] = {conv_node(g, x, w, 1, 1, 1), conv_node(g, x, w, 2, 1, 2),
                       conv_node(g, x, w, -1, 0, 1), conv_node(g, x32, w32, 1, 1, 1)};
    for (int i = 0; i < 4; i++)
        CHECK_OK(rfi_graph_add_output(g, ys[i]));
    double xd[216], wd[108];
    float x32d[216], w32d[216];
    for (int i = 0; i < 216; i++)
        x32d[i] = (float)(xd[i] = (double)((i * 37) % 19 - 9) * 0.25);
    for (int i = 0; i < 216; i++)
        w32d[i] = (float)((i * 11) % 7 - 3) * 0.5f;
    for (int i = 0; i < 108; i++)
        wd[i] = w32d[i];
    xd[50] = INFINITY;
    wd[13] = NAN;
    void *args[4] = {xd, wd, x32d, w32d};
    rfi_graph *out = NULL;
    CHECK_OK(rfi_pad_convs(g, rfi_plan_conv_as_loops, &out));
    if (out) {
        CHECK_OK(rfi_verify(out));
        CHECK(count_op(out, RFI_OP_PAD) == 2);
        int padded_convs = 0, interior = 0;
        for (int i = 0; i < out->n_nodes; i++) {
            const rfi_node *n = out->nodes[i];
            if (n->op == RFI_OP_CONVOLUTION)
                padded_convs += n->attr.l[1][0] != 0 || n->attr.l[3][0] > 1;
            if (n->op == RFI_OP_PAD)
                interior += n->attr.l[2][2] == 1 && n->attr.l[2][3] == 1 && n->attr.l[0][2] == 2;
        }
        CHECK(padded_convs == 2 && interior == 1);
        CHECK(same_results(g, out, args));
    }
    rfi_graph_free(out);
    rfi_graph_free(g);
    printf("padded convolutions: 2 of 4 read PADs of zeros, bitwise the same\n");
}

typedef struct depthwise_ctx {
    int64_t k;
} depthwise_ctx;

/* The gradient of sum(y * y) for a depthwise k x k convolution y of x by w. */
static void depthwise_grad_program(rf_trace *t, void *ctx)
{
    const depthwise_ctx *c = ctx;
    rf_tensor *x = rf_arg(t, 0), *w = rf_arg(t, 1);
    rf_conv_params p = rf_conv_params_default(2);
    p.pad_lo[0] = p.pad_hi[0] = p.pad_lo[1] = p.pad_hi[1] = c->k / 2;
    p.feature_group_count = 8;
    rf_tensor *y = rf_conv(x, w, &p);
    rf_tensor *wrt[2] = {x, w}, *g[2];
    rf_grad(t, rf_sum_all(rf_mul(y, y)), wrt, 2, g);
    rf_return(t, g[0]);
    rf_return(t, g[1]);
}

/* The weight gradient of a depthwise 5x5 convolution is a REDUCE step of the
 * cpu plan (rfi_plan_conv_as_loops), read from a PAD; a 3x3 one stays a
 * call. Both programs' gradients, compiled, agree with the interpreter to
 * rounding (1e-5 of the largest element). */
static void test_depthwise_gradients(void)
{
    for (int64_t k = 3; k <= 5; k += 2) {
        depthwise_ctx c = {k};
        rf_array *args[2] = {cpu_array((const int64_t[]){4, 8, 10, 10}, 4, 21),
                             cpu_array((const int64_t[]){8, 1, k, k}, 4, 22)};
        rf_compile_opts o = {.device = rf_device_cpu(), .name = "depthwise"};
        rf_exec *e = NULL;
        CHECK_OK(rf_compile_with(depthwise_grad_program, &c, args, 2, &o, &e));
        if (!e)
            continue;
        int loops = 0;
        for (int i = 0; i < e->prog->n_nodes; i++)
            loops += e->prog->nodes[i]->op == RFI_OP_CONVOLUTION &&
                     rfi_plan_conv_as_loops(e->prog->nodes[i]);
        CHECK(loops == (k == 5));
        void *in[2] = {rf_array_data(args[0]), rf_array_data(args[1])};
        results want = {0};
        CHECK_OK(run_graph(e->prog, in, &want));
        rf_array *out[2] = {NULL, NULL};
        CHECK_OK(rf_exec_run(e, args, 2, out, 2));
        for (int i = 0; i < 2 && want.n == 2; i++) {
            int64_t n = (int64_t)(want.nbytes[i] / sizeof(float));
            double gap = out[i] ? relative_gap(rf_array_data(out[i]), want.buf[i], n) : 1;
            if (gap > 1e-5)
                fprintf(stderr, "  depthwise %lldx%lld gradient %d: %.3g off\n", (long long)k,
                        (long long)k, i, gap);
            CHECK(gap <= 1e-5);
        }
        printf("depthwise %lldx%lld: %d convolution(s) as loops, gradients as interpreted\n",
               (long long)k, (long long)k, loops);
        results_free(&want);
        rf_array_free(out[0]);
        rf_array_free(out[1]);
        rf_exec_free(e);
        rf_array_free(args[0]);
        rf_array_free(args[1]);
    }
}

static rf_tensor *ce_loss(rf_model *m, rf_tensor *const *b, int n, rf_aux *aux, void *ctx)
{
    (void)n;
    (void)aux;
    (void)ctx;
    return rf_logitcrossentropy(rf_apply(m, b[0]), b[1]);
}

typedef struct step_ctx {
    rf_model *m;
    rf_opt *opt;
} step_ctx;

static void train_step(rf_trace *t, void *ctx)
{
    step_ctx *s = ctx;
    rf_tensor *batch[2] = {rf_arg(t, 0), rf_arg(t, 1)};
    rf_grads *g = NULL;
    rf_tensor *l = rf_withgradient(t, ce_loss, NULL, s->m, batch, 2, NULL, &g);
    rf_update(t, s->opt, s->m, g);
    rf_return(t, l);
}

/* An MLP training step (forward, backward, Adam update): node counts and bits. */
static void test_training_step(void)
{
    rf_nn_seed(3);
    rf_model *host = rf_chain(rf_dense(8, 32, RF_ACT_TANH), rf_dense(32, 16, RF_ACT_RELU),
                              rf_dense(16, 4, RF_ACT_IDENTITY));
    rf_model *m = rf_model_to(host, rf_device_cpu());
    rf_opt *opt = rf_setup(rf_adam(1e-3), m);
    rf_array *args[2] = {cpu_array((const int64_t[]){16, 8}, 2, 5),
                         cpu_array((const int64_t[]){16, 4}, 2, 6)};
    step_ctx s = {m, opt};
    rf_exec *e = NULL;
    CHECK_OK(rf_compile(train_step, &s, args, 2, &e));
    if (e) {
        int before = 0, after = 0;
        check_program("training step", e->prog, &before, &after);
        CHECK(after < before);
        printf("MLP training step (3 dense layers, Adam): %d nodes -> %d after "
               "simplify+cse+dce\n", before, after);
        rf_exec_free(e);
    }
    for (int i = 0; i < 2; i++)
        rf_array_free(args[i]);
    rf_opt_free(opt);
    rf_model_free(m);
    rf_model_free(host);
}

int main(void)
{
    init_inputs();
    test_add_sub_zero_floats();
    test_int_identities();
    test_mul_div_floats();
    test_unary_identities();
    test_select_constant_predicate();
    test_shape_chains();
    test_transposed_dot_operands();
    test_transposed_product();
    test_slice_of_concatenation();
    test_pooled_gradient_mask();
    test_merged_dots();
    test_stacked_dots();
    test_sum_factors();
    test_one_pass_moments();
    test_relu_masks();
    test_unrolled_pools();
    test_conv_over_pool_border();
    test_kernel_over_pool_border();
    test_constants();
    test_large_constants();
    test_empty_constants();
    test_cse();
    test_captures_and_updates();
    test_bad_input();
    test_random_chains();
    test_gradient_programs();
    test_merged_recurrence();
    test_padded_convs();
    test_depthwise_gradients();
    test_training_step();
    return tu_finish("test_passes");
}
