/* test_ir.c: the IR core through its internal API: the op table, shape
 * inference of representative ops (convolution, dot_general, windows,
 * gather/scatter, ...), attribute validation with its statuses and messages,
 * sticky errors, mixing traces, the verifier, the printer, the structural
 * hash, cloning and use counts.
 *
 * Graphs are built with rfi_node_new directly; the public op API has its own
 * tests. Expected shapes are worked out by hand from the StableHLO rules.
 */
#include "ir/ir.h"
#include "runtime/runtime.h"
#include "test_util.h"

/* ---- Helpers ---------------------------------------------------------------------- */

static rfi_attrs attrs0(void)
{
    rfi_attrs a;
    memset(&a, 0, sizeof a);
    return a;
}

static void set_list(rfi_attrs *a, int k, const int64_t *v, int n)
{
    a->nl[k] = n;
    for (int i = 0; i < n; i++)
        a->l[k][i] = v[i];
}
#define LIST(a, k, ...)                          \
    set_list(a, k, (const int64_t[]){__VA_ARGS__}, \
             (int)(sizeof((const int64_t[]){__VA_ARGS__}) / sizeof(int64_t)))

/* A zero-filled constant of any type (payload copied by rfi_node_new). */
static rfi_node *leaf(rfi_graph *g, rf_dtype dt, const int64_t *dims, int rank)
{
    size_t n = (size_t)rfi_numel(dims, rank) * rf_dtype_size(dt);
    void *zeros = calloc(n ? n : 1, 1);
    rfi_attrs a = attrs0();
    a.data = zeros;
    a.nbytes = n;
    rfi_node *x = rfi_node_new(g, RFI_OP_CONSTANT, NULL, 0, &a, dt, dims, rank);
    free(zeros);
    return x;
}
#define LEAF(g, dt, ...) leaf(g, dt, RF_SHAPE(__VA_ARGS__))

static rfi_node *scalar_f32(rfi_graph *g, float v, bool weak)
{
    rfi_attrs a = attrs0();
    a.data = &v;
    a.nbytes = sizeof v;
    rfi_node *x = rfi_node_new(g, RFI_OP_CONSTANT, NULL, 0, &a, RF_F32, NULL, 0);
    if (x)
        x->weak = weak;
    return x;
}

static rfi_node *op1(rfi_graph *g, rfi_op op, rfi_node *x, const rfi_attrs *a)
{
    return rfi_node_new(g, op, &x, 1, a, x ? x->dtype : RF_F32, NULL, 0);
}

static rfi_node *op2(rfi_graph *g, rfi_op op, rfi_node *x, rfi_node *y, const rfi_attrs *a)
{
    rfi_node *in[2] = {x, y};
    return rfi_node_new(g, op, in, 2, a, RF_F32, NULL, 0);
}

static rfi_node *op3(rfi_graph *g, rfi_op op, rfi_node *x, rfi_node *y, rfi_node *z)
{
    rfi_node *in[3] = {x, y, z};
    return rfi_node_new(g, op, in, 3, NULL, RF_F32, NULL, 0);
}

/* Checks a node's type against a dtype and dims. */
static bool has_type(const rfi_node *x, rf_dtype dt, const int64_t *dims, int rank)
{
    if (!x || x->dtype != dt || x->rank != rank)
        return false;
    for (int i = 0; i < rank; i++)
        if (x->dims[i] != dims[i])
            return false;
    return true;
}
#define TYPE_IS(x, dt, ...) has_type(x, dt, RF_SHAPE(__VA_ARGS__))

/* Expects op construction on a fresh graph to fail with st and message parts. */
#define EXPECT_FAIL(g, expr, st, needle1, needle2)   \
    do {                                             \
        rf_clear_error();                            \
        CHECK((expr) == NULL);                       \
        CHECK_STATUS((g)->status, st);               \
        CHECK_MSG(needle1);                          \
        CHECK_MSG(needle2);                          \
    } while (0)

static rfi_graph *fresh(void)
{
    rfi_graph *g = rfi_graph_new(NULL, "t");
    CHECK(g != NULL);
    return g;
}

/* ---- Op table -------------------------------------------------------------------- */

static void test_op_table(void)
{
    for (int op = 0; op < RFI_OP_COUNT; op++)
        CHECK(rfi_op_table[op].name != NULL && rfi_op_table[op].name[0] != '\0');
    CHECK(strcmp(rfi_op_table[RFI_OP_ADD].name, "add") == 0);
    CHECK(rfi_op_table[RFI_OP_ADD].n_operands == 2);
    CHECK(rfi_op_table[RFI_OP_CONCATENATE].n_operands == -1);
    CHECK(rfi_op_table[RFI_OP_EXP].flags & RFI_FLOAT);
    CHECK(strcmp(rfi_op_table[RFI_OP_GRAD].name, "grad") == 0);
}

/* ---- Inference: convolution ----------------------------------------------------------- */

static rfi_attrs conv2d_attrs(int64_t stride, int64_t pad, int64_t ldil, int64_t rdil, int64_t fg,
                              int64_t bg)
{
    rfi_attrs a = attrs0();
    LIST(&a, 0, stride, stride);
    LIST(&a, 1, pad, pad);
    LIST(&a, 2, pad, pad);
    LIST(&a, 3, ldil, ldil);
    LIST(&a, 4, rdil, rdil);
    a.i[0] = fg;
    a.i[1] = bg;
    return a;
}

static void test_infer_convolution(void)
{
    rfi_graph *g = fresh();
    rfi_node *x = LEAF(g, RF_F32, 2, 4, 9, 9);
    rfi_node *w = LEAF(g, RF_F32, 6, 4, 3, 3);
    rfi_attrs a = conv2d_attrs(1, 0, 1, 1, 1, 1);
    CHECK(TYPE_IS(op2(g, RFI_OP_CONVOLUTION, x, w, &a), RF_F32, 2, 6, 7, 7));
    a = conv2d_attrs(2, 1, 1, 1, 1, 1); /* (9 + 2 - 3) / 2 + 1 = 5 */
    CHECK(TYPE_IS(op2(g, RFI_OP_CONVOLUTION, x, w, &a), RF_F32, 2, 6, 5, 5));
    a = conv2d_attrs(1, 0, 1, 2, 1, 1); /* kernel dilated to 5: 9 - 5 + 1 = 5 */
    CHECK(TYPE_IS(op2(g, RFI_OP_CONVOLUTION, x, w, &a), RF_F32, 2, 6, 5, 5));
    a = conv2d_attrs(1, 0, 2, 1, 1, 1); /* input dilated to 17: 17 - 3 + 1 = 15 */
    CHECK(TYPE_IS(op2(g, RFI_OP_CONVOLUTION, x, w, &a), RF_F32, 2, 6, 15, 15));
    a = conv2d_attrs(3, 2, 1, 1, 1, 1); /* (9 + 4 - 3) / 3 + 1 = 4 (floor) */
    CHECK(TYPE_IS(op2(g, RFI_OP_CONVOLUTION, x, w, &a), RF_F32, 2, 6, 4, 4));

    /* feature groups: C = 4, G = 2, w dim1 = 2 */
    rfi_node *wg = LEAF(g, RF_F32, 6, 2, 3, 3);
    a = conv2d_attrs(1, 1, 1, 1, 2, 1);
    CHECK(TYPE_IS(op2(g, RFI_OP_CONVOLUTION, x, wg, &a), RF_F32, 2, 6, 9, 9));
    /* depthwise: G = C = 4, O = 8 */
    rfi_node *wd = LEAF(g, RF_F32, 8, 1, 3, 3);
    a = conv2d_attrs(1, 0, 1, 1, 4, 1);
    CHECK(TYPE_IS(op2(g, RFI_OP_CONVOLUTION, x, wd, &a), RF_F32, 2, 8, 7, 7));
    /* batch groups: N = 4, B = 2 -> out batch 2; O = 6 divisible by 2 */
    rfi_node *xb = LEAF(g, RF_F32, 4, 3, 5, 5);
    rfi_node *wb = LEAF(g, RF_F32, 6, 3, 2, 2);
    a = conv2d_attrs(1, 0, 1, 1, 1, 2);
    CHECK(TYPE_IS(op2(g, RFI_OP_CONVOLUTION, xb, wb, &a), RF_F32, 2, 6, 4, 4));

    /* 1-D and 3-D */
    rfi_node *x1 = LEAF(g, RF_F64, 3, 2, 10);
    rfi_node *w1 = LEAF(g, RF_F64, 5, 2, 4);
    rfi_attrs a1 = attrs0();
    LIST(&a1, 0, 2);
    LIST(&a1, 1, 0);
    LIST(&a1, 2, 1);
    LIST(&a1, 3, 1);
    LIST(&a1, 4, 1);
    a1.i[0] = a1.i[1] = 1; /* (10 + 1 - 4) / 2 + 1 = 4 */
    CHECK(TYPE_IS(op2(g, RFI_OP_CONVOLUTION, x1, w1, &a1), RF_F64, 3, 5, 4));
    rfi_node *x3 = LEAF(g, RF_F32, 1, 2, 4, 5, 6);
    rfi_node *w3 = LEAF(g, RF_F32, 3, 2, 2, 2, 2);
    rfi_attrs a3 = attrs0();
    LIST(&a3, 0, 1, 1, 1);
    LIST(&a3, 1, 0, 0, 0);
    LIST(&a3, 2, 0, 0, 0);
    LIST(&a3, 3, 1, 1, 1);
    LIST(&a3, 4, 1, 1, 1);
    a3.i[0] = a3.i[1] = 1;
    CHECK(TYPE_IS(op2(g, RFI_OP_CONVOLUTION, x3, w3, &a3), RF_F32, 1, 3, 3, 4, 5));
    CHECK_OK(g->status);
    CHECK_OK(rfi_verify(g));
    rfi_graph_free(g);

    /* invalid: each on a fresh graph so the sticky error is this one */
    g = fresh();
    x = LEAF(g, RF_F32, 2, 4, 9, 9);
    rfi_node *wbad = LEAF(g, RF_F32, 6, 3, 3, 3);
    a = conv2d_attrs(1, 0, 1, 1, 1, 1);
    EXPECT_FAIL(g, op2(g, RFI_OP_CONVOLUTION, x, wbad, &a), RF_E_SHAPE, "convolution:",
                "f32[6,3,3,3]");
    rfi_graph_free(g);

    g = fresh();
    x = LEAF(g, RF_F32, 2, 4, 2, 2);
    w = LEAF(g, RF_F32, 6, 4, 3, 3);
    EXPECT_FAIL(g, op2(g, RFI_OP_CONVOLUTION, x, w, &a), RF_E_SHAPE, "convolution: empty output",
                "f32[2,4,2,2]");
    rfi_graph_free(g);

    static const struct {
        int64_t stride, ldil, rdil, fg, bg;
        const char *needle;
    } bad[] = {
        {0, 1, 1, 1, 1, "stride"},        {1, 0, 1, 1, 1, "lhs_dilation"},
        {1, 1, 0, 1, 1, "rhs_dilation"},  {1, 1, 1, 0, 1, "feature_group_count 0"},
        {1, 1, 1, 1, 0, "batch_group_count 0"}, {1, 1, 1, 2, 2, "cannot both"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        g = fresh();
        x = LEAF(g, RF_F32, 2, 4, 9, 9);
        w = LEAF(g, RF_F32, 6, 4, 3, 3);
        a = conv2d_attrs(bad[k].stride, 0, bad[k].ldil, bad[k].rdil, bad[k].fg, bad[k].bg);
        EXPECT_FAIL(g, op2(g, RFI_OP_CONVOLUTION, x, w, &a), RF_E_INVALID, "convolution:",
                    bad[k].needle);
        rfi_graph_free(g);
    }

    /* groups that do not divide */
    g = fresh();
    x = LEAF(g, RF_F32, 2, 4, 9, 9);
    w = LEAF(g, RF_F32, 6, 1, 3, 3);
    a = conv2d_attrs(1, 0, 1, 1, 3, 1);
    EXPECT_FAIL(g, op2(g, RFI_OP_CONVOLUTION, x, w, &a), RF_E_SHAPE, "convolution:",
                "feature_group_count 3");
    rfi_graph_free(g);
    g = fresh();
    x = LEAF(g, RF_F32, 3, 4, 9, 9);
    w = LEAF(g, RF_F32, 6, 4, 3, 3);
    a = conv2d_attrs(1, 0, 1, 1, 1, 2);
    EXPECT_FAIL(g, op2(g, RFI_OP_CONVOLUTION, x, w, &a), RF_E_SHAPE, "f32[3,4,9,9]",
                "batch_group_count 2");
    rfi_graph_free(g);
    /* dtype and list lengths */
    g = fresh();
    x = LEAF(g, RF_F32, 2, 4, 9, 9);
    w = LEAF(g, RF_F64, 6, 4, 3, 3);
    a = conv2d_attrs(1, 0, 1, 1, 1, 1);
    EXPECT_FAIL(g, op2(g, RFI_OP_CONVOLUTION, x, w, &a), RF_E_DTYPE, "convolution:",
                "f64[6,4,3,3]");
    rfi_graph_free(g);
    g = fresh();
    x = LEAF(g, RF_F32, 2, 4, 9, 9);
    w = LEAF(g, RF_F32, 6, 4, 3, 3);
    a = conv2d_attrs(1, 0, 1, 1, 1, 1);
    a.nl[0] = 1;
    EXPECT_FAIL(g, op2(g, RFI_OP_CONVOLUTION, x, w, &a), RF_E_INVALID, "convolution: stride",
                "expected 2");
    rfi_graph_free(g);
}

/* ---- Inference: linear algebra, windows, indexing ----------------------------------- */

static void test_infer_dot_general(void)
{
    rfi_graph *g = fresh();
    rfi_node *x = LEAF(g, RF_F32, 3, 4, 5);
    rfi_node *y = LEAF(g, RF_F32, 3, 5, 6);
    rfi_attrs a = attrs0();
    LIST(&a, 0, 0);
    LIST(&a, 1, 0);
    LIST(&a, 2, 2);
    LIST(&a, 3, 1);
    CHECK(TYPE_IS(op2(g, RFI_OP_DOT_GENERAL, x, y, &a), RF_F32, 3, 4, 6));
    /* x @ w^T: contract dim 1 with dim 1, no batch */
    rfi_node *m = LEAF(g, RF_F32, 16, 4);
    rfi_node *wt = LEAF(g, RF_F32, 8, 4);
    rfi_attrs b = attrs0();
    LIST(&b, 2, 1);
    LIST(&b, 3, 1);
    CHECK(TYPE_IS(op2(g, RFI_OP_DOT_GENERAL, m, wt, &b), RF_F32, 16, 8));
    /* outer product: nothing contracted */
    rfi_node *u = LEAF(g, RF_F32, 3);
    rfi_node *v = LEAF(g, RF_F32, 7);
    rfi_attrs c = attrs0();
    CHECK(TYPE_IS(op2(g, RFI_OP_DOT_GENERAL, u, v, &c), RF_F32, 3, 7));
    /* batch dims in lhs order, then lhs free, then rhs free */
    rfi_node *p = LEAF(g, RF_F32, 2, 9, 3);
    rfi_node *q = LEAF(g, RF_F32, 3, 2, 9, 5);
    rfi_attrs d = attrs0();
    LIST(&d, 0, 2, 0);
    LIST(&d, 1, 0, 1);
    LIST(&d, 2, 1);
    LIST(&d, 3, 2);
    CHECK(TYPE_IS(op2(g, RFI_OP_DOT_GENERAL, p, q, &d), RF_F32, 3, 2, 5));
    CHECK_OK(g->status);
    rfi_graph_free(g);

    g = fresh();
    x = LEAF(g, RF_F32, 16, 8);
    y = LEAF(g, RF_F32, 9, 4);
    EXPECT_FAIL(g, op2(g, RFI_OP_DOT_GENERAL, x, y, &b), RF_E_SHAPE, "dot_general:",
                "f32[16,8]");
    CHECK_MSG("f32[9,4]");
    rfi_graph_free(g);

    g = fresh();
    x = LEAF(g, RF_F32, 4, 4);
    y = LEAF(g, RF_F32, 4, 4);
    rfi_attrs dup = attrs0();
    LIST(&dup, 0, 1);
    LIST(&dup, 1, 0);
    LIST(&dup, 2, 1);
    LIST(&dup, 3, 1);
    EXPECT_FAIL(g, op2(g, RFI_OP_DOT_GENERAL, x, y, &dup), RF_E_INVALID, "dot_general:",
                "repeated");
    rfi_graph_free(g);

    g = fresh();
    x = LEAF(g, RF_F32, 4, 4);
    y = LEAF(g, RF_F32, 4, 4);
    rfi_attrs uneven = attrs0();
    LIST(&uneven, 2, 1);
    EXPECT_FAIL(g, op2(g, RFI_OP_DOT_GENERAL, x, y, &uneven), RF_E_INVALID, "dot_general:",
                "differ in number");
    rfi_graph_free(g);
}

static rfi_attrs window_attrs(int64_t k, int64_t s, int64_t pad, int64_t kind)
{
    rfi_attrs a = attrs0();
    LIST(&a, 0, 1, 1, k, k);
    LIST(&a, 1, 1, 1, s, s);
    LIST(&a, 2, 0, 0, pad, pad);
    LIST(&a, 3, 0, 0, pad, pad);
    a.i[0] = kind;
    return a;
}

static void test_infer_windows(void)
{
    rfi_graph *g = fresh();
    rfi_node *x = LEAF(g, RF_F32, 2, 3, 7, 7);
    rfi_attrs a = window_attrs(3, 2, 0, RF_REDUCE_MAX);
    CHECK(TYPE_IS(op1(g, RFI_OP_REDUCE_WINDOW, x, &a), RF_F32, 2, 3, 3, 3));
    a = window_attrs(3, 2, 1, RF_REDUCE_SUM); /* (7 + 2 - 3) / 2 + 1 = 4 */
    CHECK(TYPE_IS(op1(g, RFI_OP_REDUCE_WINDOW, x, &a), RF_F32, 2, 3, 4, 4));
    a = window_attrs(2, 2, 0, RF_REDUCE_MIN); /* floor((7 - 2) / 2) + 1 = 3 */
    CHECK(TYPE_IS(op1(g, RFI_OP_REDUCE_WINDOW, x, &a), RF_F32, 2, 3, 3, 3));
    rfi_node *src = LEAF(g, RF_F32, 2, 3, 3, 3);
    a = window_attrs(3, 2, 0, RF_REDUCE_MAX);
    CHECK(TYPE_IS(op2(g, RFI_OP_SELECT_AND_SCATTER, x, src, &a), RF_F32, 2, 3, 7, 7));
    CHECK_OK(g->status);
    rfi_graph_free(g);

    g = fresh();
    x = LEAF(g, RF_F32, 2, 3, 7, 7);
    src = LEAF(g, RF_F32, 2, 3, 4, 4);
    EXPECT_FAIL(g, op2(g, RFI_OP_SELECT_AND_SCATTER, x, src, &a), RF_E_SHAPE,
                "select_and_scatter: source f32[2,3,4,4]", "f32[2,3,3,3]");
    rfi_graph_free(g);

    g = fresh();
    x = LEAF(g, RF_F32, 2, 3, 2, 2);
    a = window_attrs(3, 1, 0, RF_REDUCE_MAX);
    EXPECT_FAIL(g, op1(g, RFI_OP_REDUCE_WINDOW, x, &a), RF_E_SHAPE, "reduce_window:",
                "f32[2,3,2,2]");
    rfi_graph_free(g);

    g = fresh();
    x = LEAF(g, RF_F32, 2, 3, 7, 7);
    a = window_attrs(3, 0, 0, RF_REDUCE_MAX);
    EXPECT_FAIL(g, op1(g, RFI_OP_REDUCE_WINDOW, x, &a), RF_E_INVALID, "reduce_window:",
                "strides [1,1,0,0]");
    rfi_graph_free(g);

    g = fresh();
    x = LEAF(g, RF_F32, 2, 3, 7, 7);
    a = window_attrs(3, 1, 0, RF_REDUCE_PROD);
    EXPECT_FAIL(g, op1(g, RFI_OP_REDUCE_WINDOW, x, &a), RF_E_INVALID, "reduce_window:", "kind");
    rfi_graph_free(g);
}

static void test_infer_indexing(void)
{
    rfi_graph *g = fresh();
    rfi_node *x = LEAF(g, RF_F32, 10, 4);
    rfi_node *idx = LEAF(g, RF_I32, 2, 3);
    rfi_attrs a = attrs0();
    CHECK(TYPE_IS(op2(g, RFI_OP_GATHER, x, idx, &a), RF_F32, 2, 3, 4));
    rfi_node *idx1 = LEAF(g, RF_I64, 5);
    a.i[0] = 1;
    CHECK(TYPE_IS(op2(g, RFI_OP_GATHER, x, idx1, &a), RF_F32, 10, 5));
    rfi_node *upd = LEAF(g, RF_F32, 10, 5);
    rfi_node *in[3] = {x, idx1, upd};
    CHECK(TYPE_IS(rfi_node_new(g, RFI_OP_SCATTER_ADD, in, 3, &a, RF_F32, NULL, 0), RF_F32, 10,
                  4));
    CHECK_OK(g->status);
    rfi_graph_free(g);

    g = fresh();
    x = LEAF(g, RF_F32, 10, 4);
    rfi_node *fidx = LEAF(g, RF_F32, 3);
    a = attrs0();
    EXPECT_FAIL(g, op2(g, RFI_OP_GATHER, x, fidx, &a), RF_E_DTYPE, "gather: indices f32[3]",
                "i32 or i64");
    rfi_graph_free(g);

    g = fresh();
    x = LEAF(g, RF_F32, 10, 4);
    idx = LEAF(g, RF_I32, 3);
    upd = LEAF(g, RF_F32, 3, 5);
    rfi_node *in2[3] = {x, idx, upd};
    EXPECT_FAIL(g, rfi_node_new(g, RFI_OP_SCATTER_ADD, in2, 3, &a, RF_F32, NULL, 0), RF_E_SHAPE,
                "scatter_add: updates f32[3,5]", "f32[3,4]");
    rfi_graph_free(g);

    g = fresh();
    x = LEAF(g, RF_F32, 10, 4);
    idx = LEAF(g, RF_I32, 3);
    a.i[0] = 2;
    EXPECT_FAIL(g, op2(g, RFI_OP_GATHER, x, idx, &a), RF_E_INVALID, "gather: axis 2",
                "f32[10,4]");
    rfi_graph_free(g);
}

/* ---- Inference: elementwise, shape ops, reductions, misc --------------------------- */

static void test_infer_elementwise(void)
{
    rfi_graph *g = fresh();
    rfi_node *x = LEAF(g, RF_F32, 16, 8);
    rfi_node *y = LEAF(g, RF_F32, 16, 8);
    rfi_node *b = LEAF(g, RF_BOOL, 16, 8);
    rfi_node *i = LEAF(g, RF_I32, 16, 8);
    rfi_attrs a = attrs0();
    CHECK(TYPE_IS(op2(g, RFI_OP_ADD, x, y, NULL), RF_F32, 16, 8));
    CHECK(TYPE_IS(op1(g, RFI_OP_EXP, x, NULL), RF_F32, 16, 8));
    CHECK(TYPE_IS(op1(g, RFI_OP_IS_FINITE, x, NULL), RF_BOOL, 16, 8));
    CHECK(TYPE_IS(op1(g, RFI_OP_NOT, b, NULL), RF_BOOL, 16, 8));
    CHECK(TYPE_IS(op2(g, RFI_OP_AND, i, i, NULL), RF_I32, 16, 8));
    a.i[0] = RF_LT;
    CHECK(TYPE_IS(op2(g, RFI_OP_COMPARE, x, y, &a), RF_BOOL, 16, 8));
    CHECK(TYPE_IS(op3(g, RFI_OP_SELECT, b, x, y), RF_F32, 16, 8));
    rfi_node *lo = leaf(g, RF_F32, NULL, 0);
    CHECK(TYPE_IS(op3(g, RFI_OP_CLAMP, lo, x, lo), RF_F32, 16, 8));
    CHECK(TYPE_IS(op3(g, RFI_OP_CLAMP, x, x, y), RF_F32, 16, 8));
    CHECK(TYPE_IS(rfi_node_new(g, RFI_OP_CONVERT, &x, 1, NULL, RF_I64, NULL, 0), RF_I64, 16, 8));
    CHECK(TYPE_IS(rfi_node_new(g, RFI_OP_CONVERT, &b, 1, NULL, RF_F64, NULL, 0), RF_F64, 16, 8));
    CHECK_OK(g->status);
    rfi_graph_free(g);

    g = fresh();
    x = LEAF(g, RF_F32, 16, 8);
    y = LEAF(g, RF_F32, 16, 9);
    EXPECT_FAIL(g, op2(g, RFI_OP_ADD, x, y, NULL), RF_E_SHAPE, "add: shapes f32[16,8]",
                "f32[16,9]");
    rfi_graph_free(g);

    g = fresh();
    x = LEAF(g, RF_F32, 4);
    y = LEAF(g, RF_F64, 4);
    EXPECT_FAIL(g, op2(g, RFI_OP_MUL, x, y, NULL), RF_E_DTYPE, "mul:", "f64[4]");
    rfi_graph_free(g);

    g = fresh();
    i = LEAF(g, RF_I32, 4);
    EXPECT_FAIL(g, op1(g, RFI_OP_EXP, i, NULL), RF_E_DTYPE, "exp: operand i32[4]", "float");
    rfi_graph_free(g);

    g = fresh();
    x = LEAF(g, RF_F32, 4);
    EXPECT_FAIL(g, op2(g, RFI_OP_OR, x, x, NULL), RF_E_DTYPE, "or: operand f32[4]",
                "bool or integer");
    rfi_graph_free(g);

    g = fresh();
    x = LEAF(g, RF_F32, 4);
    y = LEAF(g, RF_F32, 4);
    EXPECT_FAIL(g, op3(g, RFI_OP_SELECT, x, x, y), RF_E_DTYPE, "select: predicate f32[4]",
                "bool");
    rfi_graph_free(g);

    g = fresh();
    x = LEAF(g, RF_F32, 4);
    lo = LEAF(g, RF_F32, 3);
    EXPECT_FAIL(g, op3(g, RFI_OP_CLAMP, lo, x, lo), RF_E_SHAPE, "clamp:", "f32[3]");
    rfi_graph_free(g);

    g = fresh();
    x = LEAF(g, RF_F32, 4);
    lo = leaf(g, RF_F64, NULL, 0);
    EXPECT_FAIL(g, op3(g, RFI_OP_CLAMP, lo, x, lo), RF_E_DTYPE, "clamp:", "f64[]");
    rfi_graph_free(g);

    g = fresh();
    x = LEAF(g, RF_F32, 4);
    EXPECT_FAIL(g, rfi_node_new(g, RFI_OP_ADD, &x, 1, NULL, RF_F32, NULL, 0), RF_E_INVALID,
                "add: expects 2 operands", "got 1");
    rfi_graph_free(g);
}

static void test_infer_shape_ops(void)
{
    rfi_graph *g = fresh();
    rfi_node *x = LEAF(g, RF_F32, 2, 3, 4);
    rfi_attrs a = attrs0();
    LIST(&a, 0, 2, 0, 1);
    CHECK(TYPE_IS(op1(g, RFI_OP_TRANSPOSE, x, &a), RF_F32, 4, 2, 3));
    a = attrs0();
    LIST(&a, 0, 0, 1, 1);
    LIST(&a, 1, 2, 3, 4);
    LIST(&a, 2, 1, 2, 2);
    CHECK(TYPE_IS(op1(g, RFI_OP_SLICE, x, &a), RF_F32, 2, 1, 2));
    a = attrs0();
    LIST(&a, 0, 1, 0, 0);
    LIST(&a, 1, 0, 2, -1);
    LIST(&a, 2, 0, 1, 0);
    rfi_node *zero = leaf(g, RF_F32, NULL, 0);
    CHECK(TYPE_IS(op2(g, RFI_OP_PAD, x, zero, &a), RF_F32, 3, 7, 3));
    a = attrs0();
    LIST(&a, 0, 1, 2);
    CHECK(TYPE_IS(rfi_node_new(g, RFI_OP_BROADCAST_IN_DIM, &(rfi_node *){LEAF(g, RF_F32, 3, 1)},
                               1, &a, RF_F32, RF_SHAPE(5, 3, 4)),
                  RF_F32, 5, 3, 4));
    CHECK(TYPE_IS(rfi_node_new(g, RFI_OP_RESHAPE, &x, 1, NULL, RF_F32, RF_SHAPE(6, 4)), RF_F32,
                  6, 4));
    a = attrs0();
    a.i[0] = 1;
    rfi_node *cat[3] = {x, LEAF(g, RF_F32, 2, 5, 4), x};
    CHECK(TYPE_IS(rfi_node_new(g, RFI_OP_CONCATENATE, cat, 3, &a, RF_F32, NULL, 0), RF_F32, 2, 11,
                  4));
    a = attrs0();
    a.i[0] = RF_REDUCE_SUM;
    LIST(&a, 0, 0, 2);
    CHECK(TYPE_IS(op1(g, RFI_OP_REDUCE, x, &a), RF_F32, 3));
    a = attrs0();
    a.i[0] = 2;
    CHECK(TYPE_IS(op1(g, RFI_OP_ARGMAX, x, &a), RF_I64, 2, 3));
    a = attrs0();
    LIST(&a, 0, 2, 0);
    CHECK(TYPE_IS(op1(g, RFI_OP_REVERSE, x, &a), RF_F32, 2, 3, 4));
    a = attrs0();
    a.i[0] = 1;
    CHECK(TYPE_IS(rfi_node_new(g, RFI_OP_IOTA, NULL, 0, &a, RF_I32, RF_SHAPE(3, 5)), RF_I32, 3,
                  5));
    CHECK_OK(g->status);
    rfi_graph_free(g);

    struct {
        rfi_op op;
        int list, n;
        int64_t v[3];
        rf_status st;
        const char *needle;
    } bad[] = {
        {RFI_OP_TRANSPOSE, 0, 3, {0, 0, 1}, RF_E_INVALID, "transpose: perm [0,0,1]"},
        {RFI_OP_TRANSPOSE, 0, 2, {0, 1, 0}, RF_E_INVALID, "transpose: perm has 2 entries"},
        {RFI_OP_REVERSE, 0, 1, {3, 0, 0}, RF_E_INVALID, "reverse: axes [3]"},
        {RFI_OP_REDUCE, 0, 2, {2, 0, 0}, RF_E_INVALID, "reduce: axes [2,0] must be sorted"},
        {RFI_OP_REDUCE, 0, 2, {1, 1, 0}, RF_E_INVALID, "reduce: axes [1,1]: axis 1 repeated"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        g = fresh();
        x = LEAF(g, RF_F32, 2, 3, 4);
        a = attrs0();
        set_list(&a, bad[k].list, bad[k].v, bad[k].n);
        EXPECT_FAIL(g, op1(g, bad[k].op, x, &a), bad[k].st, bad[k].needle, "");
        rfi_graph_free(g);
    }

    g = fresh();
    x = LEAF(g, RF_F32, 2, 3, 4);
    a = attrs0();
    LIST(&a, 0, 0, 0, 0);
    LIST(&a, 1, 2, 4, 4);
    LIST(&a, 2, 1, 1, 1);
    EXPECT_FAIL(g, op1(g, RFI_OP_SLICE, x, &a), RF_E_INVALID, "slice: start [0,0,0], limit [2,4,4]",
                "f32[2,3,4]");
    rfi_graph_free(g);

    g = fresh();
    x = LEAF(g, RF_F32, 2, 3, 4);
    zero = leaf(g, RF_F32, NULL, 0);
    a = attrs0();
    LIST(&a, 0, 0, 0, 0);
    LIST(&a, 1, 0, 0, 0);
    LIST(&a, 2, 0, -1, 0);
    EXPECT_FAIL(g, op2(g, RFI_OP_PAD, x, zero, &a), RF_E_INVALID, "pad: negative interior",
                "f32[2,3,4]");
    rfi_graph_free(g);

    g = fresh();
    x = LEAF(g, RF_F32, 2, 3, 4);
    EXPECT_FAIL(g, rfi_node_new(g, RFI_OP_RESHAPE, &x, 1, NULL, RF_F32, RF_SHAPE(5, 5)),
                RF_E_SHAPE, "reshape: cannot reshape f32[2,3,4] (24 elements)", "f32[5,5]");
    rfi_graph_free(g);

    g = fresh();
    x = LEAF(g, RF_F32, 3, 2);
    a = attrs0();
    LIST(&a, 0, 0, 1);
    EXPECT_FAIL(g, rfi_node_new(g, RFI_OP_BROADCAST_IN_DIM, &x, 1, &a, RF_F32, RF_SHAPE(3, 4)),
                RF_E_SHAPE, "broadcast_in_dim: cannot broadcast f32[3,2] to f32[3,4]", "");
    rfi_graph_free(g);

    g = fresh();
    rfi_node *cat2[2] = {LEAF(g, RF_F32, 2, 3), LEAF(g, RF_F32, 3, 3)};
    a = attrs0();
    a.i[0] = 1;
    EXPECT_FAIL(g, rfi_node_new(g, RFI_OP_CONCATENATE, cat2, 2, &a, RF_F32, NULL, 0), RF_E_SHAPE,
                "concatenate: operand 1 f32[3,3]", "f32[2,3]");
    rfi_graph_free(g);

    g = fresh();
    rfi_attrs c = attrs0();
    float one = 1;
    c.data = &one;
    c.nbytes = 3;
    EXPECT_FAIL(g, rfi_node_new(g, RFI_OP_CONSTANT, NULL, 0, &c, RF_F32, NULL, 0), RF_E_INVALID,
                "constant: payload of 3 bytes", "f32[]");
    rfi_graph_free(g);
}

static void test_infer_rng_grad(void)
{
    rfi_graph *g = fresh();
    rfi_node *key = LEAF(g, RF_I64, 2);
    rfi_attrs a = attrs0();
    a.i[0] = 1;
    a.i[1] = 3;
    CHECK(TYPE_IS(rfi_node_new(g, RFI_OP_RNG, &key, 1, &a, RF_F64, RF_SHAPE(4, 5)), RF_F64, 4,
                  5));
    rfi_node *w = LEAF(g, RF_F32, 3, 2);
    rfi_node *y = leaf(g, RF_F32, NULL, 0);
    CHECK(TYPE_IS(op2(g, RFI_OP_GRAD, y, w, NULL), RF_F32, 3, 2));
    CHECK_OK(g->status);
    rfi_graph_free(g);

    g = fresh();
    key = LEAF(g, RF_I64, 2);
    EXPECT_FAIL(g, rfi_node_new(g, RFI_OP_RNG, &key, 1, &a, RF_I32, RF_SHAPE(4)), RF_E_DTYPE,
                "rng: result i32[4]", "float");
    rfi_graph_free(g);

    g = fresh();
    key = LEAF(g, RF_I32, 2);
    EXPECT_FAIL(g, rfi_node_new(g, RFI_OP_RNG, &key, 1, &a, RF_F32, RF_SHAPE(4)), RF_E_SHAPE,
                "rng: key i32[2]", "i64[2]");
    rfi_graph_free(g);

    g = fresh();
    w = LEAF(g, RF_F32, 3, 2);
    EXPECT_FAIL(g, op2(g, RFI_OP_GRAD, w, w, NULL), RF_E_SHAPE, "grad: y f32[3,2]",
                "float scalar");
    rfi_graph_free(g);
}

/* ---- Graph-level errors ------------------------------------------------------------ */

static void test_sticky_and_mixing(void)
{
    rfi_graph *g = fresh();
    rfi_node *x = LEAF(g, RF_F32, 16, 8);
    rfi_node *y = LEAF(g, RF_F32, 16, 9);
    /* NULL operands propagate silently */
    rf_clear_error();
    CHECK(op2(g, RFI_OP_ADD, x, NULL, NULL) == NULL);
    CHECK_OK(g->status);
    CHECK(rf_errmsg()[0] == '\0');

    CHECK(op2(g, RFI_OP_ADD, x, y, NULL) == NULL);
    CHECK_STATUS(g->status, RF_E_SHAPE);
    CHECK(g->errmsg && strstr(g->errmsg, "add: shapes f32[16,8] and f32[16,9]"));
    rfi_node *i = LEAF(g, RF_I32, 4);
    CHECK(op1(g, RFI_OP_LOG, i, NULL) == NULL); /* a second error */
    CHECK_STATUS(g->status, RF_E_SHAPE);
    CHECK(g->errmsg && strstr(g->errmsg, "add:") && !strstr(g->errmsg, "log:"));
    CHECK_MSG("add: shapes f32[16,8]");
    /* valid ops still build after a failure */
    CHECK(op1(g, RFI_OP_NEG, x, NULL) != NULL);
    rfi_graph_fail(g, RF_E_IO, "later %d", 1);
    CHECK_STATUS(g->status, RF_E_SHAPE);
    rfi_graph_free(g);

    g = fresh();
    rfi_graph *h = fresh();
    x = LEAF(g, RF_F32, 4);
    rfi_node *other = LEAF(h, RF_F32, 4);
    EXPECT_FAIL(g, op2(g, RFI_OP_ADD, x, other, NULL), RF_E_INVALID,
                "add: operand 1 belongs to another trace", "mixing traces");
    CHECK_OK(h->status);
    CHECK_STATUS(rfi_graph_add_output(g, other), RF_E_INVALID); /* sticky error stays */
    CHECK(strstr(g->errmsg, "add: operand 1") != NULL);
    rfi_graph_free(h);
    rfi_graph_free(g);

    g = fresh();
    rfi_graph_fail(g, RF_E_DOMAIN, "loss is %s", "nan");
    CHECK_STATUS(g->status, RF_E_DOMAIN);
    CHECK_MSG("loss is nan");
    rfi_graph_free(g);
}

/* ---- Printer, verifier, clone, use counts ------------------------------------------------ */

/* f(x, y) = (sum(exp(x) + y * 2, axis 1), x < y) over f32[16,8]. */
static rfi_graph *small_program(void)
{
    rfi_graph *g = rfi_graph_new(NULL, "small");
    rf_dtype dts[2] = {RF_F32, RF_F32};
    int ranks[2] = {2, 2};
    int64_t dims[2][RF_MAX_RANK] = {{16, 8}, {16, 8}};
    CHECK_OK(rfi_graph_set_args(g, 2, dts, ranks, (const int64_t(*)[RF_MAX_RANK])dims));
    rfi_attrs a0 = attrs0(), a1 = attrs0();
    a1.i[0] = 1;
    rfi_node *x = rfi_node_new(g, RFI_OP_ARGUMENT, NULL, 0, &a0, RF_F32, RF_SHAPE(16, 8));
    rfi_node *y = rfi_node_new(g, RFI_OP_ARGUMENT, NULL, 0, &a1, RF_F32, RF_SHAPE(16, 8));
    rfi_node *e = op1(g, RFI_OP_EXP, x, NULL);
    rfi_node *two = scalar_f32(g, 2.0f, true);
    rfi_attrs bc = attrs0();
    bc.nl[0] = 0;
    rfi_node *twob =
        rfi_node_new(g, RFI_OP_BROADCAST_IN_DIM, &two, 1, &bc, RF_F32, RF_SHAPE(16, 8));
    rfi_node *m = op2(g, RFI_OP_MUL, y, twob, NULL);
    rfi_node *s = op2(g, RFI_OP_ADD, e, m, NULL);
    rfi_attrs r = attrs0();
    r.i[0] = RF_REDUCE_SUM;
    LIST(&r, 0, 1);
    rfi_node *red = op1(g, RFI_OP_REDUCE, s, &r);
    rfi_attrs c = attrs0();
    c.i[0] = RF_LT;
    rfi_node *lt = op2(g, RFI_OP_COMPARE, x, y, &c);
    CHECK_OK(rfi_graph_add_output(g, red));
    CHECK_OK(rfi_graph_add_output(g, lt));
    CHECK_OK(g->status);
    return g;
}

static void test_print_verify(void)
{
    rfi_graph *g = small_program();
    CHECK(g->args[0] && g->args[0]->op == RFI_OP_ARGUMENT && g->args[1]->attr.i[0] == 1);
    CHECK_OK(rfi_verify(g));
    char *text = rfi_print(g);
    CHECK(text != NULL);
    if (text) {
        static const char *const lines[] = {
            "program small (2 args, 0 captures)\n",
            "  arg0: f32[16,8]\n",
            "  arg1: f32[16,8]\n",
            "%0 = argument {index=0} : f32[16,8]\n",
            "%1 = argument {index=1} : f32[16,8]\n",
            "%2 = exp(%0) : f32[16,8]\n",
            "%3 = constant {value=2, weak} : f32[]\n",
            "%4 = broadcast_in_dim(%3) {map=[]} : f32[16,8]\n",
            "%5 = mul(%1, %4) : f32[16,8]\n",
            "%6 = add(%2, %5) : f32[16,8]\n",
            "%7 = reduce(%6) {kind=sum, axes=[1]} : f32[16]\n",
            "%8 = compare(%0, %1) {dir=lt} : bool[16,8]\n",
            "outputs: %7, %8\n",
        };
        for (size_t k = 0; k < sizeof lines / sizeof lines[0]; k++) {
            tu_checks++;
            if (!strstr(text, lines[k])) {
                tu_failures++;
                fprintf(stderr, "printer output lacks \"%s\":\n%s", lines[k], text);
            }
        }
    }
    rfi_free(text);

    int *uses = rfi_use_counts(g);
    CHECK(uses && uses[0] == 2 && uses[1] == 2 && uses[7] == 1 && uses[8] == 1 && uses[3] == 1);
    rfi_free(uses);
    CHECK(rfi_node_numel(g->nodes[6]) == 128 && rfi_node_nbytes(g->nodes[6]) == 512);
    CHECK(rfi_node_nbytes(g->nodes[8]) == 128);

    /* a corrupted stored type is caught */
    g->nodes[6]->dims[1] = 9;
    rf_clear_error();
    CHECK_STATUS(rfi_verify(g), RF_E_INTERNAL);
    CHECK_MSG("%6 = add");
    g->nodes[6]->dims[1] = 8;
    CHECK_OK(rfi_verify(g));
    /* an operand out of SSA order is caught */
    rfi_node *saved = g->nodes[5]->in[0];
    g->nodes[5]->in[0] = g->nodes[6];
    CHECK_STATUS(rfi_verify(g), RF_E_INTERNAL);
    CHECK_MSG("operand 0");
    g->nodes[5]->in[0] = saved;
    rfi_graph_free(g);

    /* constants: small show values, big show a hash; ints and bools print as such */
    g = fresh();
    int32_t iv[3] = {1, -2, 3};
    rfi_attrs a = attrs0();
    a.data = iv;
    a.nbytes = sizeof iv;
    CHECK(rfi_node_new(g, RFI_OP_CONSTANT, NULL, 0, &a, RF_I32, RF_SHAPE(3)) != NULL);
    float big[12] = {0};
    a.data = big;
    a.nbytes = sizeof big;
    CHECK(rfi_node_new(g, RFI_OP_CONSTANT, NULL, 0, &a, RF_F32, RF_SHAPE(3, 4)) != NULL);
    rfi_node *key = LEAF(g, RF_I64, 2);
    rfi_attrs ra = attrs0();
    ra.i[0] = 1;
    ra.i[1] = 2;
    CHECK(rfi_node_new(g, RFI_OP_RNG, &key, 1, &ra, RF_F32, RF_SHAPE(2)) != NULL);
    text = rfi_print(g);
    CHECK(text && strstr(text, "program t (0 args, 0 captures)\n"));
    CHECK(text && strstr(text, "%0 = constant {values=[1, -2, 3]} : i32[3]\n"));
    CHECK(text && strstr(text, "%1 = constant {bytes=48, hash="));
    CHECK(text && strstr(text, "%2 = constant {values=[0, 0]} : i64[2]\n"));
    CHECK(text && strstr(text, "%3 = rng(%2) {dist=normal, stream=2} : f32[2]\n"));
    rfi_free(text);
    CHECK_OK(rfi_verify(g));
    rfi_graph_free(g);
}

static void test_clone(void)
{
    rfi_graph *g = fresh();
    rfi_node *s = scalar_f32(g, 1.5f, true);
    rfi_node *v = LEAF(g, RF_F32, 3);
    rfi_graph *h = fresh();
    rfi_node *s2 = rfi_node_clone(h, s, NULL);
    rfi_node *v2 = rfi_node_clone(h, v, NULL);
    CHECK(s2 && s2->weak && s2->g == h && s2->attr.data != s->attr.data);
    CHECK(s2 && memcmp(s2->attr.data, s->attr.data, 4) == 0);
    rfi_node *in[2] = {v, v};
    rfi_node *sum = op2(g, RFI_OP_ADD, in[0], in[1], NULL);
    rfi_node *in2[2] = {v2, v2};
    rfi_node *sum2 = rfi_node_clone(h, sum, in2);
    CHECK(sum2 && sum2->op == RFI_OP_ADD && sum2->in[0] == v2 && TYPE_IS(sum2, RF_F32, 3));
    CHECK_OK(rfi_graph_add_output(g, sum));
    CHECK_OK(rfi_graph_add_output(h, sum2));
    CHECK(rfi_hash(g) == rfi_hash(h));
    CHECK_OK(rfi_verify(h));
    rfi_graph_free(g);
    rfi_graph_free(h);
}

/* ---- Hash ------------------------------------------------------------------------- */

/* Variants of one program; `variant` 0 and 1 build the same program with
 * independent nodes in different orders, the others change one thing. */
static uint64_t hash_variant(int variant)
{
    rfi_graph *g = rfi_graph_new(NULL, variant == 1 ? "other-name" : "p");
    rf_dtype dts[2] = {variant == 6 ? RF_F64 : RF_F32, RF_F32};
    int ranks[2] = {2, 1};
    int64_t dims[2][RF_MAX_RANK] = {{4, 3}, {3}};
    CHECK_OK(rfi_graph_set_args(g, 2, dts, ranks, (const int64_t(*)[RF_MAX_RANK])dims));
    rfi_attrs a0 = attrs0(), a1 = attrs0();
    a1.i[0] = 1;
    float cdata[3] = {1, 2, variant == 4 ? 3.5f : 3};
    rfi_attrs ca = attrs0();
    ca.data = cdata;
    ca.nbytes = sizeof cdata;
    rfi_node *x, *b, *c, *ex;
    if (variant == 1) { /* independent nodes in another order */
        c = rfi_node_new(g, RFI_OP_CONSTANT, NULL, 0, &ca, RF_F32, RF_SHAPE(3));
        b = rfi_node_new(g, RFI_OP_ARGUMENT, NULL, 0, &a1, RF_F32, RF_SHAPE(3));
        x = rfi_node_new(g, RFI_OP_ARGUMENT, NULL, 0, &a0, dts[0], RF_SHAPE(4, 3));
        LEAF(g, RF_F32, 7); /* dead code */
        ex = op1(g, RFI_OP_EXP, x, NULL);
    } else {
        x = rfi_node_new(g, RFI_OP_ARGUMENT, NULL, 0, &a0, dts[0], RF_SHAPE(4, 3));
        ex = op1(g, RFI_OP_EXP, x, NULL);
        b = rfi_node_new(g, RFI_OP_ARGUMENT, NULL, 0, &a1, RF_F32, RF_SHAPE(3));
        c = rfi_node_new(g, RFI_OP_CONSTANT, NULL, 0, &ca, RF_F32, RF_SHAPE(3));
    }
    if (variant == 6)
        ex = rfi_node_new(g, RFI_OP_CONVERT, &ex, 1, NULL, RF_F32, NULL, 0);
    rfi_node *bc = op2(g, RFI_OP_MUL, b, c, NULL);
    rfi_attrs m = attrs0();
    LIST(&m, 0, 1);
    rfi_node *bb = rfi_node_new(g, RFI_OP_BROADCAST_IN_DIM, &bc, 1, &m, RF_F32, RF_SHAPE(4, 3));
    rfi_node *sum = op2(g, variant == 2 ? RFI_OP_SUB : RFI_OP_ADD, ex, bb, NULL);
    rfi_attrs r = attrs0();
    r.i[0] = variant == 5 ? RF_REDUCE_MAX : RF_REDUCE_SUM;
    LIST(&r, 0, variant == 3 ? 1 : 0);
    rfi_node *red = op1(g, RFI_OP_REDUCE, sum, &r);
    if (variant == 7) {
        CHECK_OK(rfi_graph_add_output(g, sum));
        CHECK_OK(rfi_graph_add_output(g, red));
    } else {
        CHECK_OK(rfi_graph_add_output(g, red));
        CHECK_OK(rfi_graph_add_output(g, sum));
    }
    CHECK_OK(g->status);
    CHECK_OK(rfi_verify(g));
    uint64_t h = rfi_hash(g);
    rfi_graph_free(g);
    return h;
}

static void test_hash(void)
{
    uint64_t base = hash_variant(0);
    CHECK(base == hash_variant(0));
    CHECK(base == hash_variant(1));
    for (int v = 2; v <= 7; v++) {
        uint64_t h = hash_variant(v);
        tu_checks++;
        if (h == base) {
            tu_failures++;
            fprintf(stderr, "hash variant %d equals the base program's hash\n", v);
        }
    }
    /* weak flag and a single attribute list entry matter */
    rfi_graph *g = fresh(), *h = fresh();
    CHECK_OK(rfi_graph_add_output(g, scalar_f32(g, 1.0f, true)));
    CHECK_OK(rfi_graph_add_output(h, scalar_f32(h, 1.0f, false)));
    CHECK(rfi_hash(g) != rfi_hash(h));
    rfi_graph_free(g);
    rfi_graph_free(h);
}

/* ---- Captures and updates (needs runtime arrays) --------------------------------------- */

static void test_captures(void)
{
    rf_array *w = rfi_array_alloc("test", rf_device_cpu(), RF_F32, RF_SHAPE(3, 2));
    rf_array *v = rfi_array_alloc("test", rf_device_cpu(), RF_F32, RF_SHAPE(5));
    CHECK(w && v);
    if (!w || !v) {
        rfi_array_release(w);
        rfi_array_release(v);
        return;
    }
    rfi_graph *g = fresh();
    CHECK(rfi_graph_capture_index(g, w) == 0);
    CHECK(rfi_graph_capture_index(g, v) == 1);
    CHECK(rfi_graph_capture_index(g, w) == 0);
    CHECK(g->n_captures == 2 && w->refs == 2);
    rfi_attrs a = attrs0();
    rfi_node *cw = rfi_node_new(g, RFI_OP_CAPTURE, NULL, 0, &a, RF_F32, RF_SHAPE(3, 2));
    CHECK(cw && g->capture_nodes[0] == cw);
    rfi_node *nw = op1(g, RFI_OP_NEG, cw, NULL);
    CHECK_OK(rfi_graph_add_update(g, 0, nw));
    CHECK_OK(rfi_graph_add_update(g, 0, cw)); /* last assignment wins */
    CHECK(g->n_updates == 1 && g->updates[0].value == cw);
    CHECK_OK(rfi_graph_add_update(g, 0, nw));
    CHECK_OK(rfi_verify(g));
    char *text = rfi_print(g);
    CHECK(text && strstr(text, "program t (0 args, 2 captures)\n  capture0: f32[3,2]\n"
                               "  capture1: f32[5]\n"));
    CHECK(text && strstr(text, "%0 = capture {index=0} : f32[3,2]\n"));
    CHECK(text && strstr(text, "update capture0 <- %1\n"));
    rfi_free(text);
    uint64_t h1 = rfi_hash(g);
    rfi_graph_free(g);
    CHECK(w->refs == 1);

    /* wrong capture node type and update type mismatch */
    g = fresh();
    CHECK(rfi_graph_capture_index(g, w) == 0);
    EXPECT_FAIL(g, rfi_node_new(g, RFI_OP_CAPTURE, NULL, 0, &a, RF_F32, RF_SHAPE(2, 3)),
                RF_E_INVALID, "capture: node type f32[2,3]", "f32[3,2]");
    rfi_graph_free(g);
    g = fresh();
    CHECK(rfi_graph_capture_index(g, w) == 0);
    CHECK(rfi_graph_capture_index(g, v) == 1);
    cw = rfi_node_new(g, RFI_OP_CAPTURE, NULL, 0, &a, RF_F32, RF_SHAPE(3, 2));
    rf_clear_error();
    CHECK_STATUS(rfi_graph_add_update(g, 1, cw), RF_E_SHAPE);
    CHECK_MSG("rf_assign: value f32[3,2] does not match the array f32[5]");
    rfi_graph_free(g);

    /* the capture's type enters the hash */
    rf_array *w64 = rfi_array_alloc("test", rf_device_cpu(), RF_F64, RF_SHAPE(3, 2));
    g = fresh();
    CHECK(rfi_graph_capture_index(g, w64) == 0);
    CHECK(rfi_graph_capture_index(g, v) == 1);
    cw = rfi_node_new(g, RFI_OP_CAPTURE, NULL, 0, &a, RF_F64, RF_SHAPE(3, 2));
    CHECK_OK(rfi_graph_add_update(g, 0, op1(g, RFI_OP_NEG, cw, NULL)));
    CHECK(rfi_hash(g) != h1);
    rfi_graph_free(g);
    rfi_array_release(w64);
    rfi_array_release(w);
    rfi_array_release(v);
}

int main(void)
{
    test_op_table();
    test_infer_convolution();
    test_infer_dot_general();
    test_infer_windows();
    test_infer_indexing();
    test_infer_elementwise();
    test_infer_shape_ops();
    test_infer_rng_grad();
    test_sticky_and_mixing();
    test_print_verify();
    test_clone();
    test_hash();
    test_captures();
    return tu_finish("test_ir");
}
