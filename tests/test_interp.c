/* test_interp.c: the reference interpreter against hand-computed values and
 * against naive formulas written independently of the interpreter (the
 * convolution oracle materialises the padded, dilated input and kernel and
 * slides a window; the interpreter maps output to input positions instead).
 *
 * Graphs are built with the internal API (rfi_graph_new, rfi_node_new), so
 * shape inference is exercised too: every node's inferred type is checked
 * against the type the test expects.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "ir/ir.h"
#include "runtime/runtime.h"
#include "test_util.h"

/* ---- Building graphs ------------------------------------------------------------ */

static rfi_graph *new_graph(void)
{
    rfi_graph *g = rfi_graph_new(rf_device_cpu(), "test_interp");
    CHECK(g != NULL);
    return g;
}

static rfi_node *constant(rfi_graph *g, rf_dtype dt, const int64_t *dims, int rank,
                          const void *data)
{
    rfi_attrs a = {0};
    a.data = data;
    a.nbytes = (size_t)rfi_numel(dims, rank) * rf_dtype_size(dt);
    rfi_node *x = rfi_node_new(g, RFI_OP_CONSTANT, NULL, 0, &a, dt, dims, rank);
    CHECK(x != NULL);
    return x;
}

/* A node whose result type the test states; checks that inference agrees. */
static rfi_node *node(rfi_graph *g, rfi_op op, rfi_node *const *in, int n_in, const rfi_attrs *a,
                      rf_dtype dt, const int64_t *dims, int rank)
{
    rfi_node *x = rfi_node_new(g, op, in, n_in, a, dt, dims, rank);
    CHECK(x != NULL);
    if (!x) {
        fprintf(stderr, "  %s: %s\n", rfi_op_table[op].name, rf_errmsg());
        return NULL;
    }
    CHECK(x->dtype == dt && x->rank == rank);
    for (int i = 0; i < rank && i < x->rank; i++)
        CHECK(x->dims[i] == dims[i]);
    return x;
}

static void set_list(rfi_attrs *a, int k, const int64_t *v, int n)
{
    a->nl[k] = n;
    for (int i = 0; i < n; i++)
        a->l[k][i] = v[i];
}

/* ---- Running ----------------------------------------------------------------------- */

static rf_status run_graph(rfi_graph *g, void *const *args, void *const *caps, void *const *outs,
                           void *const *upds)
{
    rf_status st = rfi_verify(g);
    if (st != RF_OK)
        return st;
    void *state = NULL;
    st = rfi_interp_backend.prepare(g, &state);
    if (st != RF_OK)
        return st;
    rfi_run_io io = {args, caps, outs, upds};
    st = rfi_interp_backend.run(state, g, &io);
    rfi_interp_backend.release(state);
    return st;
}

/* Makes y the graph's only output, runs g and frees it; out receives y's elements. */
static void eval1(rfi_graph *g, rfi_node *y, void *out)
{
    if (!y) {
        CHECK(y != NULL);
        rfi_graph_free(g);
        return;
    }
    CHECK_OK(rfi_graph_add_output(g, y));
    void *outs[1] = {out};
    CHECK_OK(run_graph(g, NULL, NULL, outs, NULL));
    rfi_graph_free(g);
}

static void check_f32(const float *got, const float *want, int n, const char *what)
{
    for (int i = 0; i < n; i++) {
        tu_checks++;
        bool same = (isnan(want[i]) && isnan(got[i])) ||
                    fabs((double)got[i] - (double)want[i]) <= 1e-5 + 1e-5 * fabs((double)want[i]);
        if (!same) {
            tu_failures++;
            fprintf(stderr, "%s[%d] = %.8g, expected %.8g\n", what, i, got[i], want[i]);
        }
    }
}

static void check_i64(const int64_t *got, const int64_t *want, int n, const char *what)
{
    for (int i = 0; i < n; i++) {
        tu_checks++;
        if (got[i] != want[i]) {
            tu_failures++;
            fprintf(stderr, "%s[%d] = %lld, expected %lld\n", what, i, (long long)got[i],
                    (long long)want[i]);
        }
    }
}

/* Deterministic small test values. */
static float test_value(int k) { return (float)((k * 37 + 11) % 17) / 4.0f - 2.0f; }

/* ---- Shape ops --------------------------------------------------------------------- */

static void test_transpose(void)
{
    rfi_graph *g = new_graph();
    const float x[6] = {1, 2, 3, 4, 5, 6};
    rfi_node *xn = constant(g, RF_F32, RF_SHAPE(2, 3), x);
    rfi_attrs a = {0};
    set_list(&a, 0, (const int64_t[]){1, 0}, 2);
    rfi_node *y = node(g, RFI_OP_TRANSPOSE, &xn, 1, &a, RF_F32, RF_SHAPE(3, 2));
    float out[6];
    eval1(g, y, out);
    check_f32(out, (const float[]){1, 4, 2, 5, 3, 6}, 6, "transpose");
}

static void test_pad(void)
{
    rfi_graph *g = new_graph();
    const float x[6] = {1, 2, 3, 4, 5, 6}, nine = 9;
    rfi_node *in[2] = {constant(g, RF_F32, RF_SHAPE(2, 3), x),
                       constant(g, RF_F32, RF_SCALAR_SHAPE, &nine)};
    rfi_attrs a = {0};
    set_list(&a, 0, (const int64_t[]){-1, 1}, 2); /* low */
    set_list(&a, 1, (const int64_t[]){1, -1}, 2); /* high */
    set_list(&a, 2, (const int64_t[]){1, 1}, 2);  /* interior */
    rfi_node *y = node(g, RFI_OP_PAD, in, 2, &a, RF_F32, RF_SHAPE(3, 5));
    float out[15];
    eval1(g, y, out);
    /* interior padding gives rows r0 . r1 and columns c0 . c1 . c2; low -1 drops r0,
     * high 1 adds a row; low 1 adds a column, high -1 drops c2 */
    const float want[15] = {9, 9, 9, 9, 9,
                            9, 4, 9, 5, 9,
                            9, 9, 9, 9, 9};
    check_f32(out, want, 15, "pad");
}

static void test_shape_misc(void)
{
    /* broadcast [3] -> [2,3] along dim 1, then slice with stride, reverse, concatenate */
    rfi_graph *g = new_graph();
    const float x[3] = {1, 2, 3};
    rfi_node *xn = constant(g, RF_F32, RF_SHAPE(3), x);
    rfi_attrs a = {0};
    set_list(&a, 0, (const int64_t[]){1}, 1);
    rfi_node *b = node(g, RFI_OP_BROADCAST_IN_DIM, &xn, 1, &a, RF_F32, RF_SHAPE(2, 3));
    rfi_attrs r = {0};
    set_list(&r, 0, (const int64_t[]){0, 1}, 2);
    rfi_node *rev = node(g, RFI_OP_REVERSE, &b, 1, &r, RF_F32, RF_SHAPE(2, 3));
    rfi_attrs s = {0};
    set_list(&s, 0, (const int64_t[]){0, 0}, 2);
    set_list(&s, 1, (const int64_t[]){2, 3}, 2);
    set_list(&s, 2, (const int64_t[]){1, 2}, 2);
    rfi_node *sl = node(g, RFI_OP_SLICE, &rev, 1, &s, RF_F32, RF_SHAPE(2, 2));
    rfi_attrs c = {0};
    c.i[0] = 1;
    rfi_node *cat_in[3] = {sl, b, sl};
    rfi_node *cat = node(g, RFI_OP_CONCATENATE, cat_in, 3, &c, RF_F32, RF_SHAPE(2, 7));
    float out[14];
    eval1(g, cat, out);
    /* rev = [[3,2,1],[3,2,1]]; slice cols 0,2 = [[3,1],[3,1]] */
    check_f32(out, (const float[]){3, 1, 1, 2, 3, 3, 1, 3, 1, 1, 2, 3, 3, 1}, 14, "shape misc");
}

/* ---- Linear algebra ---------------------------------------------------------------- */

static void test_dot_batched(void)
{
    rfi_graph *g = new_graph();
    const float a[12] = {1, 2, 3, 4, 5, 6, /* batch 1 */ 1, 1, 1, 2, 0, -1};
    const float b[12] = {1, 0, 0, 1, 1, 1, /* batch 1 */ 1, 2, 3, 4, 5, 6};
    rfi_node *in[2] = {constant(g, RF_F32, RF_SHAPE(2, 2, 3), a),
                       constant(g, RF_F32, RF_SHAPE(2, 3, 2), b)};
    rfi_attrs at = {0};
    set_list(&at, 0, (const int64_t[]){0}, 1);
    set_list(&at, 1, (const int64_t[]){0}, 1);
    set_list(&at, 2, (const int64_t[]){2}, 1);
    set_list(&at, 3, (const int64_t[]){1}, 1);
    rfi_node *y = node(g, RFI_OP_DOT_GENERAL, in, 2, &at, RF_F32, RF_SHAPE(2, 2, 2));
    float out[8];
    eval1(g, y, out);
    check_f32(out, (const float[]){4, 5, 10, 11, 9, 12, -3, -2}, 8, "dot batched");

    /* batch dims not leading: lhs [3(k), 2(b)], rhs [2(b), 3(k)] -> [2] */
    g = new_graph();
    const float l[6] = {1, 2, 3, 4, 5, 6}, r[6] = {1, 1, 1, 2, 2, 2};
    rfi_node *in2[2] = {constant(g, RF_F32, RF_SHAPE(3, 2), l),
                        constant(g, RF_F32, RF_SHAPE(2, 3), r)};
    rfi_attrs at2 = {0};
    set_list(&at2, 0, (const int64_t[]){1}, 1);
    set_list(&at2, 1, (const int64_t[]){0}, 1);
    set_list(&at2, 2, (const int64_t[]){0}, 1);
    set_list(&at2, 3, (const int64_t[]){1}, 1);
    y = node(g, RFI_OP_DOT_GENERAL, in2, 2, &at2, RF_F32, RF_SHAPE(2));
    eval1(g, y, out);
    check_f32(out, (const float[]){9, 24}, 2, "dot batch last");

    /* plain matmul with free dims on both sides, i32 */
    g = new_graph();
    const int32_t li[4] = {1, 2, 3, 4}, ri[6] = {1, 0, -1, 2, 1, 0};
    rfi_node *in3[2] = {constant(g, RF_I32, RF_SHAPE(2, 2), li),
                        constant(g, RF_I32, RF_SHAPE(2, 3), ri)};
    rfi_attrs at3 = {0};
    set_list(&at3, 2, (const int64_t[]){1}, 1);
    set_list(&at3, 3, (const int64_t[]){0}, 1);
    y = node(g, RFI_OP_DOT_GENERAL, in3, 2, &at3, RF_I32, RF_SHAPE(2, 3));
    int32_t oi[6];
    eval1(g, y, oi);
    const int32_t wi[6] = {5, 2, -1, 11, 4, -3};
    for (int i = 0; i < 6; i++)
        CHECK(oi[i] == wi[i]);
}

/* The convolution oracle: materialise the padded, lhs-dilated input P and the
 * rhs-dilated kernel K, then slide K over P with the stride. 2 spatial dims. */
typedef struct conv_case {
    int64_t n, c, h, w, o, kh, kw;
    int64_t stride[2], lo[2], hi[2], ldil[2], rdil[2], groups, batch_groups;
} conv_case;

static void naive_conv(const conv_case *cc, const float *x, const float *wt, float *out,
                       int64_t *oh_out, int64_t *ow_out)
{
    int64_t ph = (cc->h - 1) * cc->ldil[0] + 1 + cc->lo[0] + cc->hi[0];
    int64_t pw = (cc->w - 1) * cc->ldil[1] + 1 + cc->lo[1] + cc->hi[1];
    int64_t kdh = (cc->kh - 1) * cc->rdil[0] + 1, kdw = (cc->kw - 1) * cc->rdil[1] + 1;
    int64_t ci_per = cc->c / cc->groups;
    float *P = calloc((size_t)(cc->n * cc->c * ph * pw), sizeof(float));
    float *K = calloc((size_t)(cc->o * ci_per * kdh * kdw), sizeof(float));
    for (int64_t n = 0; n < cc->n; n++)
        for (int64_t c = 0; c < cc->c; c++)
            for (int64_t i = 0; i < cc->h; i++)
                for (int64_t j = 0; j < cc->w; j++)
                    P[((n * cc->c + c) * ph + cc->lo[0] + i * cc->ldil[0]) * pw + cc->lo[1] +
                      j * cc->ldil[1]] = x[((n * cc->c + c) * cc->h + i) * cc->w + j];
    for (int64_t o = 0; o < cc->o; o++)
        for (int64_t c = 0; c < ci_per; c++)
            for (int64_t i = 0; i < cc->kh; i++)
                for (int64_t j = 0; j < cc->kw; j++)
                    K[((o * ci_per + c) * kdh + i * cc->rdil[0]) * kdw + j * cc->rdil[1]] =
                        wt[((o * ci_per + c) * cc->kh + i) * cc->kw + j];
    int64_t oh = (ph - kdh) / cc->stride[0] + 1, ow = (pw - kdw) / cc->stride[1] + 1;
    int64_t nb = cc->n / cc->batch_groups;
    for (int64_t b = 0; b < nb; b++)
        for (int64_t o = 0; o < cc->o; o++) {
            int64_t fgroup = o / (cc->o / cc->groups);
            int64_t bgroup = o / (cc->o / cc->batch_groups);
            int64_t n = bgroup * nb + b;
            for (int64_t i = 0; i < oh; i++)
                for (int64_t j = 0; j < ow; j++) {
                    double s = 0;
                    for (int64_t c = 0; c < ci_per; c++)
                        for (int64_t u = 0; u < kdh; u++)
                            for (int64_t v = 0; v < kdw; v++)
                                s += (double)P[((n * cc->c + fgroup * ci_per + c) * ph +
                                                i * cc->stride[0] + u) * pw +
                                               j * cc->stride[1] + v] *
                                     K[((o * ci_per + c) * kdh + u) * kdw + v];
                    out[((b * cc->o + o) * oh + i) * ow + j] = (float)s;
                }
        }
    *oh_out = oh;
    *ow_out = ow;
    free(P);
    free(K);
}

static void run_conv_case(const conv_case *cc, const char *what)
{
    int64_t xn = cc->n * cc->c * cc->h * cc->w;
    int64_t wn = cc->o * (cc->c / cc->groups) * cc->kh * cc->kw;
    float *x = malloc((size_t)xn * sizeof(float)), *w = malloc((size_t)wn * sizeof(float));
    for (int64_t k = 0; k < xn; k++)
        x[k] = test_value((int)k);
    for (int64_t k = 0; k < wn; k++)
        w[k] = test_value((int)k + 5) * 0.5f;
    float *want = calloc(4096, sizeof(float)), *got = calloc(4096, sizeof(float));
    int64_t oh, ow;
    naive_conv(cc, x, w, want, &oh, &ow);

    rfi_graph *g = new_graph();
    rfi_node *in[2] = {constant(g, RF_F32, RF_SHAPE(cc->n, cc->c, cc->h, cc->w), x),
                       constant(g, RF_F32, RF_SHAPE(cc->o, cc->c / cc->groups, cc->kh, cc->kw), w)};
    rfi_attrs a = {0};
    set_list(&a, 0, cc->stride, 2);
    set_list(&a, 1, cc->lo, 2);
    set_list(&a, 2, cc->hi, 2);
    set_list(&a, 3, cc->ldil, 2);
    set_list(&a, 4, cc->rdil, 2);
    a.i[0] = cc->groups;
    a.i[1] = cc->batch_groups;
    int64_t nb = cc->n / cc->batch_groups;
    rfi_node *y = node(g, RFI_OP_CONVOLUTION, in, 2, &a, RF_F32, RF_SHAPE(nb, cc->o, oh, ow));
    CHECK(nb * cc->o * oh * ow <= 4096);
    eval1(g, y, got);
    check_f32(got, want, (int)(nb * cc->o * oh * ow), what);
    free(x);
    free(w);
    free(want);
    free(got);
}

static void test_convolution(void)
{
    /* stride 2, asymmetric padding, lhs and rhs dilation, 2 feature groups */
    const conv_case grouped = {.n = 2, .c = 4, .h = 5, .w = 6, .o = 4, .kh = 3, .kw = 2,
                               .stride = {2, 1}, .lo = {1, 0}, .hi = {2, 1}, .ldil = {1, 2},
                               .rdil = {2, 1}, .groups = 2, .batch_groups = 1};
    run_conv_case(&grouped, "conv grouped");
    const conv_case plain = {.n = 1, .c = 3, .h = 4, .w = 4, .o = 2, .kh = 3, .kw = 3,
                             .stride = {1, 2}, .lo = {1, 1}, .hi = {1, 1}, .ldil = {1, 1},
                             .rdil = {1, 1}, .groups = 1, .batch_groups = 1};
    run_conv_case(&plain, "conv plain");
    /* batch groups, as in the weight gradient of a convolution */
    const conv_case batch_grouped = {.n = 4, .c = 2, .h = 3, .w = 4, .o = 4, .kh = 2, .kw = 1,
                                     .stride = {1, 1}, .lo = {0, 1}, .hi = {1, 0}, .ldil = {2, 1},
                                     .rdil = {1, 1}, .groups = 1, .batch_groups = 2};
    run_conv_case(&batch_grouped, "conv batch groups");

    /* 1 spatial dim by hand: x = 1..5, w = [1, 10], stride 2, pad lo 1 */
    rfi_graph *g = new_graph();
    const float x[5] = {1, 2, 3, 4, 5}, w[2] = {1, 10};
    rfi_node *in[2] = {constant(g, RF_F32, RF_SHAPE(1, 1, 5), x),
                       constant(g, RF_F32, RF_SHAPE(1, 1, 2), w)};
    rfi_attrs a = {0};
    set_list(&a, 0, (const int64_t[]){2}, 1);
    set_list(&a, 1, (const int64_t[]){1}, 1);
    set_list(&a, 2, (const int64_t[]){0}, 1);
    set_list(&a, 3, (const int64_t[]){1}, 1);
    set_list(&a, 4, (const int64_t[]){1}, 1);
    a.i[0] = a.i[1] = 1;
    rfi_node *y = node(g, RFI_OP_CONVOLUTION, in, 2, &a, RF_F32, RF_SHAPE(1, 1, 3));
    float out[3];
    eval1(g, y, out);
    check_f32(out, (const float[]){10, 32, 54}, 3, "conv 1d");
}

/* ---- Reductions --------------------------------------------------------------------- */

static void window_attrs(rfi_attrs *a, int rank, const int64_t *win, const int64_t *stride,
                         const int64_t *lo, const int64_t *hi)
{
    set_list(a, 0, win, rank);
    set_list(a, 1, stride, rank);
    set_list(a, 2, lo, rank);
    set_list(a, 3, hi, rank);
}

static void test_reduce_window(void)
{
    const float x[9] = {-1, -2, -3, -4, -5, -6, -7, -8, -9};
    for (int kind = 0; kind < 2; kind++) {
        rfi_graph *g = new_graph();
        rfi_node *xn = constant(g, RF_F32, RF_SHAPE(3, 3), x);
        rfi_attrs a = {0};
        a.i[0] = kind ? RF_REDUCE_SUM : RF_REDUCE_MAX;
        window_attrs(&a, 2, (const int64_t[]){2, 2}, (const int64_t[]){2, 2},
                     (const int64_t[]){1, 1}, (const int64_t[]){0, 0});
        rfi_node *y = node(g, RFI_OP_REDUCE_WINDOW, &xn, 1, &a, RF_F32, RF_SHAPE(2, 2));
        float out[4];
        eval1(g, y, out);
        if (kind == 0) /* padding is -inf, so never wins over the negative values */
            check_f32(out, (const float[]){-1, -2, -4, -5}, 4, "reduce_window max");
        else
            check_f32(out, (const float[]){-1, -5, -11, -28}, 4, "reduce_window sum");
    }
}

static void test_select_and_scatter(void)
{
    rfi_graph *g = new_graph();
    const float x[4] = {1, 3, 3, 2}, src[3] = {10, 20, 30};
    rfi_node *in[2] = {constant(g, RF_F32, RF_SHAPE(4), x),
                       constant(g, RF_F32, RF_SHAPE(3), src)};
    rfi_attrs a = {0};
    window_attrs(&a, 1, (const int64_t[]){2}, (const int64_t[]){1}, (const int64_t[]){0},
                 (const int64_t[]){0});
    rfi_node *y = node(g, RFI_OP_SELECT_AND_SCATTER, in, 2, &a, RF_F32, RF_SHAPE(4));
    float out[4];
    eval1(g, y, out);
    /* windows [1,3] [3,3] [3,2]: the first max is index 1, 1, 2 */
    check_f32(out, (const float[]){0, 30, 30, 0}, 4, "select_and_scatter");

    /* padding is never selected, even over negative values */
    g = new_graph();
    const float x2[3] = {-5, -1, -4}, src2[2] = {7, 8};
    rfi_node *in2[2] = {constant(g, RF_F32, RF_SHAPE(3), x2),
                        constant(g, RF_F32, RF_SHAPE(2), src2)};
    rfi_attrs a2 = {0};
    window_attrs(&a2, 1, (const int64_t[]){2}, (const int64_t[]){2}, (const int64_t[]){1},
                 (const int64_t[]){0});
    y = node(g, RFI_OP_SELECT_AND_SCATTER, in2, 2, &a2, RF_F32, RF_SHAPE(3));
    eval1(g, y, out);
    check_f32(out, (const float[]){7, 8, 0}, 3, "select_and_scatter padded");
}

static void test_reduce(void)
{
    const float x[6] = {1, 5, 2, -4, NAN, 0};
    for (int kind = 0; kind < 3; kind++) {
        rfi_graph *g = new_graph();
        rfi_node *xn = constant(g, RF_F32, RF_SHAPE(2, 3), x);
        rfi_attrs a = {0};
        a.i[0] = kind == 0 ? RF_REDUCE_SUM : kind == 1 ? RF_REDUCE_MAX : RF_REDUCE_PROD;
        set_list(&a, 0, (const int64_t[]){1}, 1);
        rfi_node *y = node(g, RFI_OP_REDUCE, &xn, 1, &a, RF_F32, RF_SHAPE(2));
        float out[2];
        eval1(g, y, out);
        const float want[3][2] = {{8, NAN}, {5, NAN}, {10, NAN}};
        check_f32(out, want[kind], 2, "reduce");
    }
    /* integer max over an empty axis gives the dtype's minimum */
    rfi_graph *g = new_graph();
    rfi_node *e = constant(g, RF_I32, RF_SHAPE(2, 0), NULL);
    rfi_attrs a = {0};
    a.i[0] = RF_REDUCE_MAX;
    set_list(&a, 0, (const int64_t[]){1}, 1);
    rfi_node *y = node(g, RFI_OP_REDUCE, &e, 1, &a, RF_I32, RF_SHAPE(2));
    int32_t oi[2];
    eval1(g, y, oi);
    CHECK(oi[0] == INT32_MIN && oi[1] == INT32_MIN);

    /* argmax/argmin: first extreme; the first NaN for both (NumPy, JAX) */
    const float v[8] = {3, 1, 3, 1, /* row 2 */ 2, NAN, 7, NAN};
    for (int which = 0; which < 2; which++) {
        g = new_graph();
        rfi_node *vn = constant(g, RF_F32, RF_SHAPE(2, 4), v);
        rfi_attrs aa = {0};
        aa.i[0] = 1;
        y = node(g, which ? RFI_OP_ARGMIN : RFI_OP_ARGMAX, &vn, 1, &aa, RF_I64, RF_SHAPE(2));
        int64_t out[2];
        eval1(g, y, out);
        const int64_t want[2][2] = {{0, 1}, {1, 1}};
        check_i64(out, want[which], 2, which ? "argmin" : "argmax");
    }
}

/* ---- Larger cases against independent formulas ------------------------------------ *
 * Sizes above the interpreter's chunk length and operands of several dtypes, so
 * its bulk (chunked, packed, row-by-row) paths meet element-by-element oracles. */

/* dot_general with batch and two contracting dims in scrambled positions:
 * lhs [2(k1), 3(b), 4(m), 5(k0)], rhs [5(k0), 3(b), 2(k1), 6(n)], f64. */
static void test_dot_scrambled(void)
{
    enum { K1 = 2, B = 3, M = 4, K0 = 5, N = 6 };
    static double a[K1 * B * M * K0], b[K0 * B * K1 * N], got[B * M * N];
    for (int k = 0; k < K1 * B * M * K0; k++)
        a[k] = test_value(k) + 0.125 * (k % 7);
    for (int k = 0; k < K0 * B * K1 * N; k++)
        b[k] = test_value(k + 3) - 0.25 * (k % 5);
    rfi_graph *g = new_graph();
    rfi_node *in[2] = {constant(g, RF_F64, RF_SHAPE(K1, B, M, K0), a),
                       constant(g, RF_F64, RF_SHAPE(K0, B, K1, N), b)};
    rfi_attrs at = {0};
    set_list(&at, 0, (const int64_t[]){1}, 1);
    set_list(&at, 1, (const int64_t[]){1}, 1);
    set_list(&at, 2, (const int64_t[]){3, 0}, 2); /* k0 then k1 */
    set_list(&at, 3, (const int64_t[]){0, 2}, 2);
    rfi_node *y = node(g, RFI_OP_DOT_GENERAL, in, 2, &at, RF_F64, RF_SHAPE(B, M, N));
    eval1(g, y, got);
    for (int bi = 0; bi < B; bi++)
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) {
                double want = 0;
                for (int k0 = 0; k0 < K0; k0++)
                    for (int k1 = 0; k1 < K1; k1++)
                        want += a[((k1 * B + bi) * M + m) * K0 + k0] *
                                b[((k0 * B + bi) * K1 + k1) * N + n];
                CHECK(got[(bi * M + m) * N + n] == want); /* same order: bit-identical */
            }
}

/* An i32 convolution (integer arithmetic path) and a grouped f32 one with several
 * images, channels and features per group. */
static void test_conv_more(void)
{
    rfi_graph *g = new_graph();
    const int32_t x[5] = {1, 2, 3, 4, 5}, w[2] = {1, 10};
    rfi_node *in[2] = {constant(g, RF_I32, RF_SHAPE(1, 1, 5), x),
                       constant(g, RF_I32, RF_SHAPE(1, 1, 2), w)};
    rfi_attrs a = {0};
    set_list(&a, 0, (const int64_t[]){2}, 1);
    set_list(&a, 1, (const int64_t[]){1}, 1);
    set_list(&a, 2, (const int64_t[]){0}, 1);
    set_list(&a, 3, (const int64_t[]){1}, 1);
    set_list(&a, 4, (const int64_t[]){1}, 1);
    a.i[0] = a.i[1] = 1;
    rfi_node *y = node(g, RFI_OP_CONVOLUTION, in, 2, &a, RF_I32, RF_SHAPE(1, 1, 3));
    int32_t out[3];
    eval1(g, y, out);
    CHECK(out[0] == 10 && out[1] == 32 && out[2] == 54);

    const conv_case wide = {.n = 3, .c = 6, .h = 6, .w = 5, .o = 6, .kh = 3, .kw = 3,
                            .stride = {1, 2}, .lo = {2, 1}, .hi = {0, 1}, .ldil = {1, 1},
                            .rdil = {1, 2}, .groups = 3, .batch_groups = 1};
    run_conv_case(&wide, "conv wide");
}

/* Elementwise ops over 1300 elements (chunk boundaries) in f32, f64 and i32. */
static void test_elementwise_long(void)
{
    enum { L = 1300 };
    static float fa[L], fb[L], fo[L];
    static double da[L], db[L], dout[L];
    static int32_t ia[L], ib[L], iout[L];
    for (int k = 0; k < L; k++) {
        fa[k] = test_value(k);
        fb[k] = test_value(k + 1) + 3.0f;
        da[k] = fa[k] * 1.5;
        db[k] = fb[k];
        ia[k] = (int32_t)(k * 2654435761u);
        ib[k] = k - 650;
    }
    const rfi_op ops[4] = {RFI_OP_ADD, RFI_OP_MUL, RFI_OP_DIV, RFI_OP_MAX};
    for (int t = 0; t < 4; t++) {
        rfi_graph *g = new_graph();
        rfi_node *in[2] = {constant(g, RF_F32, RF_SHAPE(L), fa),
                           constant(g, RF_F32, RF_SHAPE(L), fb)};
        eval1(g, node(g, ops[t], in, 2, NULL, RF_F32, RF_SHAPE(L)), fo);
        for (int k = 0; k < L; k++) {
            double x = fa[k], z = fb[k];
            double want = t == 0 ? x + z : t == 1 ? x * z : t == 2 ? x / z : (x > z ? x : z);
            CHECK(fo[k] == (float)want);
        }
    }
    rfi_graph *g = new_graph();
    rfi_node *in[2] = {constant(g, RF_F64, RF_SHAPE(L), da),
                       constant(g, RF_F64, RF_SHAPE(L), db)};
    eval1(g, node(g, RFI_OP_SUB, in, 2, NULL, RF_F64, RF_SHAPE(L)), dout);
    for (int k = 0; k < L; k++)
        CHECK(dout[k] == da[k] - db[k]);
    g = new_graph();
    rfi_node *xe = constant(g, RF_F64, RF_SHAPE(L), da);
    eval1(g, node(g, RFI_OP_EXP, &xe, 1, NULL, RF_F64, RF_SHAPE(L)), dout);
    for (int k = 0; k < L; k++)
        CHECK(dout[k] == exp(da[k]));
    g = new_graph();
    rfi_node *ii[2] = {constant(g, RF_I32, RF_SHAPE(L), ia),
                       constant(g, RF_I32, RF_SHAPE(L), ib)};
    eval1(g, node(g, RFI_OP_MUL, ii, 2, NULL, RF_I32, RF_SHAPE(L)), iout);
    for (int k = 0; k < L; k++)
        CHECK(iout[k] == (int32_t)(uint32_t)((uint64_t)(int64_t)ia[k] * (uint64_t)(int64_t)ib[k]));
    g = new_graph();
    rfi_node *ci[2] = {constant(g, RF_F32, RF_SHAPE(L), fa),
                       constant(g, RF_F32, RF_SHAPE(L), fb)};
    rfi_attrs ca = {0};
    ca.i[0] = RF_LT;
    static uint8_t lt[L];
    eval1(g, node(g, RFI_OP_COMPARE, ci, 2, &ca, RF_BOOL, RF_SHAPE(L)), lt);
    for (int k = 0; k < L; k++)
        CHECK(lt[k] == (fa[k] < fb[k]));
}

/* Broadcast and transpose of rank 4/3 in three element sizes, against index formulas. */
static void test_strided_long(void)
{
    static uint8_t u[4 * 3], uo[2 * 4 * 5 * 3];
    static int64_t q[3 * 4 * 50], qo[50 * 3 * 4];
    static float f[3 * 4 * 50], fo[50 * 3 * 4];
    for (int k = 0; k < 12; k++)
        u[k] = (uint8_t)(k * 7);
    rfi_graph *g = new_graph();
    rfi_node *un = constant(g, RF_U8, RF_SHAPE(4, 1, 3), u);
    rfi_attrs a = {0};
    set_list(&a, 0, (const int64_t[]){1, 2, 3}, 3);
    eval1(g, node(g, RFI_OP_BROADCAST_IN_DIM, &un, 1, &a, RF_U8, RF_SHAPE(2, 4, 5, 3)), uo);
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++)
            for (int k = 0; k < 5; k++)
                for (int l = 0; l < 3; l++)
                    CHECK(uo[((i * 4 + j) * 5 + k) * 3 + l] == u[j * 3 + l]);
    for (int k = 0; k < 600; k++) {
        q[k] = (int64_t)k * 1000003;
        f[k] = test_value(k);
    }
    for (int t = 0; t < 2; t++) {
        g = new_graph();
        rfi_node *xn = t ? constant(g, RF_I64, RF_SHAPE(3, 4, 50), q)
                         : constant(g, RF_F32, RF_SHAPE(3, 4, 50), f);
        rfi_attrs p = {0};
        set_list(&p, 0, (const int64_t[]){2, 0, 1}, 3);
        eval1(g, node(g, RFI_OP_TRANSPOSE, &xn, 1, &p, t ? RF_I64 : RF_F32, RF_SHAPE(50, 3, 4)),
              t ? (void *)qo : (void *)fo);
        for (int i = 0; i < 50; i++)
            for (int j = 0; j < 3; j++)
                for (int k = 0; k < 4; k++) {
                    int src = (j * 4 + k) * 50 + i, dst = (i * 3 + j) * 4 + k;
                    CHECK(t ? qo[dst] == q[src] : fo[dst] == f[src]);
                }
    }
}

/* Reductions over leading, middle and trailing axes, rows longer than a chunk. */
static void test_reduce_long(void)
{
    enum { A = 3, Bd = 4, C = 700 };
    static float x[A * Bd * C];
    static int32_t xi[A * Bd * C];
    for (int k = 0; k < A * Bd * C; k++) {
        x[k] = test_value(k) * 0.37f;
        xi[k] = k % 13 - 6;
    }
    /* sum over axes {0, 2}: result [Bd] */
    rfi_graph *g = new_graph();
    rfi_node *xn = constant(g, RF_F32, RF_SHAPE(A, Bd, C), x);
    rfi_attrs a = {0};
    a.i[0] = RF_REDUCE_SUM;
    set_list(&a, 0, (const int64_t[]){0, 2}, 2);
    float s[Bd];
    eval1(g, node(g, RFI_OP_REDUCE, &xn, 1, &a, RF_F32, RF_SHAPE(Bd)), s);
    for (int j = 0; j < Bd; j++) {
        double want = 0;
        for (int i = 0; i < A; i++)
            for (int k = 0; k < C; k++)
                want += x[(i * Bd + j) * C + k];
        CHECK(s[j] == (float)want);
    }
    /* max over axis 1: result [A, C] */
    g = new_graph();
    xn = constant(g, RF_F32, RF_SHAPE(A, Bd, C), x);
    rfi_attrs m = {0};
    m.i[0] = RF_REDUCE_MAX;
    set_list(&m, 0, (const int64_t[]){1}, 1);
    static float mx[A * C];
    eval1(g, node(g, RFI_OP_REDUCE, &xn, 1, &m, RF_F32, RF_SHAPE(A, C)), mx);
    for (int i = 0; i < A; i++)
        for (int k = 0; k < C; k++) {
            float want = -INFINITY;
            for (int j = 0; j < Bd; j++)
                want = fmaxf(want, x[(i * Bd + j) * C + k]);
            CHECK(mx[i * C + k] == want);
        }
    /* i32 sum over axis 0: result [Bd, C] */
    g = new_graph();
    xn = constant(g, RF_I32, RF_SHAPE(A, Bd, C), xi);
    rfi_attrs si = {0};
    si.i[0] = RF_REDUCE_SUM;
    set_list(&si, 0, (const int64_t[]){0}, 1);
    static int32_t so[Bd * C];
    eval1(g, node(g, RFI_OP_REDUCE, &xn, 1, &si, RF_I32, RF_SHAPE(Bd, C)), so);
    for (int k = 0; k < Bd * C; k++)
        CHECK(so[k] == xi[k] + xi[Bd * C + k] + xi[2 * Bd * C + k]);
}

/* ---- Indexing ------------------------------------------------------------------------ */

static void test_gather_scatter(void)
{
    rfi_graph *g = new_graph();
    const float x[8] = {0, 1, 10, 11, 20, 21, 30, 31};
    const int64_t idx[4] = {3, -1, 1, 7};
    rfi_node *in[2] = {constant(g, RF_F32, RF_SHAPE(4, 2), x),
                       constant(g, RF_I64, RF_SHAPE(2, 2), idx)};
    rfi_attrs a = {0};
    rfi_node *y = node(g, RFI_OP_GATHER, in, 2, &a, RF_F32, RF_SHAPE(2, 2, 2));
    float out[8];
    eval1(g, y, out);
    /* clamped rows 3, 0, 1, 3 */
    check_f32(out, (const float[]){30, 31, 0, 1, 10, 11, 30, 31}, 8, "gather clamp");

    g = new_graph();
    const float x2[6] = {0, 1, 2, 3, 4, 5};
    const int32_t idx2[2] = {2, 2};
    rfi_node *in2[2] = {constant(g, RF_F32, RF_SHAPE(2, 3), x2),
                        constant(g, RF_I32, RF_SHAPE(2), idx2)};
    rfi_attrs a2 = {0};
    a2.i[0] = 1;
    y = node(g, RFI_OP_GATHER, in2, 2, &a2, RF_F32, RF_SHAPE(2, 2));
    eval1(g, y, out);
    check_f32(out, (const float[]){2, 2, 5, 5}, 4, "gather axis 1");

    /* duplicates accumulate; -1 and 4 are out of range and dropped */
    g = new_graph();
    const float base[4] = {1, 1, 1, 1}, upd[5] = {10, 20, 30, 40, 50};
    const int32_t idx3[5] = {0, 2, 2, -1, 4};
    rfi_node *in3[3] = {constant(g, RF_F32, RF_SHAPE(4), base),
                        constant(g, RF_I32, RF_SHAPE(5), idx3),
                        constant(g, RF_F32, RF_SHAPE(5), upd)};
    rfi_attrs a3 = {0};
    y = node(g, RFI_OP_SCATTER_ADD, in3, 3, &a3, RF_F32, RF_SHAPE(4));
    eval1(g, y, out);
    check_f32(out, (const float[]){11, 1, 51, 1}, 4, "scatter_add");

    g = new_graph();
    const float zero6[6] = {0};
    const int32_t idx4[2] = {1, 1};
    const float upd4[4] = {1, 2, 3, 4};
    rfi_node *in4[3] = {constant(g, RF_F32, RF_SHAPE(2, 3), zero6),
                        constant(g, RF_I32, RF_SHAPE(2), idx4),
                        constant(g, RF_F32, RF_SHAPE(2, 2), upd4)};
    rfi_attrs a4 = {0};
    a4.i[0] = 1;
    y = node(g, RFI_OP_SCATTER_ADD, in4, 3, &a4, RF_F32, RF_SHAPE(2, 3));
    eval1(g, y, out);
    check_f32(out, (const float[]){0, 3, 0, 0, 7, 0}, 6, "scatter_add axis 1");
}

static void run_rng(const int64_t key[2], int dist, int stream, int64_t n, float *out)
{
    rfi_graph *g = new_graph();
    rfi_node *k = constant(g, RF_I64, RF_SHAPE(2), key);
    rfi_attrs a = {0};
    a.i[0] = dist;
    a.i[1] = stream;
    rfi_node *y = node(g, RFI_OP_RNG, &k, 1, &a, RF_F32, RF_SHAPE(n));
    eval1(g, y, out);
}

static void test_rng(void)
{
    enum { N = 10000 };
    static float a[N], b[N], c[N], d[N], ref[N];
    const int64_t key[2] = {42, 7}, key2[2] = {42, 8};
    run_rng(key, 1, 0, N, a);
    run_rng(key, 1, 0, N, b);
    run_rng(key, 1, 1, N, c);
    run_rng(key2, 1, 0, N, d);
    CHECK(memcmp(a, b, sizeof a) == 0);
    rfi_random_fill(42, 7, 0, 1, RF_F32, ref, N);
    CHECK(memcmp(a, ref, sizeof a) == 0);
    int same_stream = 0, same_counter = 0;
    double sum = 0, sq = 0;
    for (int i = 0; i < N; i++) {
        same_stream += a[i] == c[i];
        same_counter += a[i] == d[i];
        sum += a[i];
        sq += (double)a[i] * a[i];
    }
    CHECK(same_stream < 10);
    CHECK(same_counter < 10);
    double mean = sum / N, var = sq / N - mean * mean;
    CHECK_NEAR(mean, 0.0, 0.05, 0);
    CHECK_NEAR(var, 1.0, 0.06, 0);

    run_rng(key, 0, 0, N, a);
    double lo = 1, hi = 0;
    sum = 0;
    for (int i = 0; i < N; i++) {
        sum += a[i];
        lo = a[i] < lo ? a[i] : lo;
        hi = a[i] > hi ? a[i] : hi;
    }
    CHECK(lo >= 0 && hi < 1);
    CHECK_NEAR(sum / N, 0.5, 0.02, 0);
}

static void test_iota(void)
{
    rfi_graph *g = new_graph();
    rfi_attrs a = {0};
    a.i[0] = 1;
    rfi_node *y = node(g, RFI_OP_IOTA, NULL, 0, &a, RF_I64, RF_SHAPE(2, 3));
    int64_t out[6];
    eval1(g, y, out);
    check_i64(out, (const int64_t[]){0, 1, 2, 0, 1, 2}, 6, "iota");
}

/* ---- Elementwise semantics ------------------------------------------------------------ */

static void unary_f32(rfi_op op, const float *x, int n, float *out)
{
    rfi_graph *g = new_graph();
    rfi_node *xn = constant(g, RF_F32, RF_SHAPE(n), x);
    eval1(g, node(g, op, &xn, 1, NULL, RF_F32, RF_SHAPE(n)), out);
}

static void test_elementwise(void)
{
    const float x[5] = {-2.5f, 2.5f, 0.0f, NAN, -0.4f};
    float out[5];
    unary_f32(RFI_OP_ROUND, x, 5, out);
    check_f32(out, (const float[]){-3, 3, 0, NAN, -0.0f}, 5, "round");
    unary_f32(RFI_OP_SIGN, x, 5, out);
    check_f32(out, (const float[]){-1, 1, 0, NAN, -1}, 5, "sign");
    const float big[3] = {-1000, 0, 1000};
    unary_f32(RFI_OP_LOGISTIC, big, 3, out);
    check_f32(out, (const float[]){0, 0.5f, 1}, 3, "logistic");

    /* max/min propagate NaN */
    rfi_graph *g = new_graph();
    const float a[2] = {1, NAN}, b[2] = {NAN, 2};
    rfi_node *ab[2] = {constant(g, RF_F32, RF_SHAPE(2), a), constant(g, RF_F32, RF_SHAPE(2), b)};
    eval1(g, node(g, RFI_OP_MAX, ab, 2, NULL, RF_F32, RF_SHAPE(2)), out);
    CHECK(isnan(out[0]) && isnan(out[1]));

    /* integer division and remainder: by zero gives 0; INT_MIN / -1 wraps */
    const int32_t p[4] = {7, -7, INT32_MIN, 5}, q[4] = {2, 2, -1, 0};
    const int32_t want_div[4] = {3, -3, INT32_MIN, 0}, want_rem[4] = {1, -1, 0, 0};
    for (int which = 0; which < 2; which++) {
        g = new_graph();
        rfi_node *pq[2] = {constant(g, RF_I32, RF_SHAPE(4), p),
                           constant(g, RF_I32, RF_SHAPE(4), q)};
        int32_t oi[4];
        eval1(g, node(g, which ? RFI_OP_REM : RFI_OP_DIV, pq, 2, NULL, RF_I32, RF_SHAPE(4)), oi);
        for (int i = 0; i < 4; i++)
            CHECK(oi[i] == (which ? want_rem : want_div)[i]);
    }
    /* i64 INT64_MIN / -1 without UB */
    g = new_graph();
    const int64_t m[1] = {INT64_MIN}, neg1[1] = {-1};
    rfi_node *mn[2] = {constant(g, RF_I64, RF_SHAPE(1), m), constant(g, RF_I64, RF_SHAPE(1), neg1)};
    int64_t o64[1];
    eval1(g, node(g, RFI_OP_DIV, mn, 2, NULL, RF_I64, RF_SHAPE(1)), o64);
    CHECK(o64[0] == INT64_MIN);

    /* float -> int truncates toward zero and saturates; NaN -> 0; to bool is != 0 */
    const float f[5] = {-3.7f, 3.7f, 1e10f, -1e10f, NAN};
    g = new_graph();
    rfi_node *fn = constant(g, RF_F32, RF_SHAPE(5), f);
    int32_t oi[5];
    eval1(g, node(g, RFI_OP_CONVERT, &fn, 1, NULL, RF_I32, RF_SHAPE(5)), oi);
    const int32_t want_conv[5] = {-3, 3, INT32_MAX, INT32_MIN, 0};
    for (int i = 0; i < 5; i++)
        CHECK(oi[i] == want_conv[i]);
    g = new_graph();
    fn = constant(g, RF_F32, RF_SHAPE(5), f);
    uint8_t ob[5];
    eval1(g, node(g, RFI_OP_CONVERT, &fn, 1, NULL, RF_BOOL, RF_SHAPE(5)), ob);
    CHECK(ob[0] == 1 && ob[1] == 1 && ob[2] == 1 && ob[3] == 1 && ob[4] == 1);

    /* compare, select, clamp with scalar bounds */
    g = new_graph();
    const float c1[3] = {1, 5, NAN}, c2[3] = {2, 5, 1}, lo = 1.5f, hi = 4;
    rfi_node *cn[2] = {constant(g, RF_F32, RF_SHAPE(3), c1), constant(g, RF_F32, RF_SHAPE(3), c2)};
    rfi_attrs ca = {0};
    ca.i[0] = RF_LE;
    rfi_node *le = node(g, RFI_OP_COMPARE, cn, 2, &ca, RF_BOOL, RF_SHAPE(3));
    rfi_node *sel_in[3] = {le, cn[0], cn[1]};
    rfi_node *sel = node(g, RFI_OP_SELECT, sel_in, 3, NULL, RF_F32, RF_SHAPE(3));
    rfi_node *cl_in[3] = {constant(g, RF_F32, RF_SCALAR_SHAPE, &lo), sel,
                          constant(g, RF_F32, RF_SCALAR_SHAPE, &hi)};
    eval1(g, node(g, RFI_OP_CLAMP, cl_in, 3, NULL, RF_F32, RF_SHAPE(3)), out);
    /* le = [1, 1, 0] -> sel = [1, 5, 1] -> clamp = [1.5, 4, 1.5] */
    check_f32(out, (const float[]){1.5f, 4, 1.5f}, 3, "compare/select/clamp");
}

/* ---- Arguments, captures, outputs, updates, liveness ----------------------------------- */

static void test_io(void)
{
    rfi_graph *g = new_graph();
    const rf_dtype dt = RF_F32;
    const int rank = 1;
    const int64_t dims[1][RF_MAX_RANK] = {{3}};
    CHECK_OK(rfi_graph_set_args(g, 1, &dt, &rank, dims));
    rf_array *state = rfi_array_alloc("test", rf_device_cpu(), RF_F32, RF_SHAPE(3));
    CHECK(state != NULL);
    if (!state) {
        rfi_graph_free(g);
        return;
    }
    float *sv = state->data;
    sv[0] = 1;
    sv[1] = 2;
    sv[2] = 3;
    int cap = rfi_graph_capture_index(g, state);
    CHECK(cap == 0);
    rfi_attrs ai = {0};
    rfi_node *x = node(g, RFI_OP_ARGUMENT, NULL, 0, &ai, RF_F32, RF_SHAPE(3));
    rfi_attrs ac = {0};
    ac.i[0] = cap;
    rfi_node *s = node(g, RFI_OP_CAPTURE, NULL, 0, &ac, RF_F32, RF_SHAPE(3));
    /* t is read by three later nodes: it must live until the last one */
    rfi_node *xs[2] = {x, s};
    rfi_node *t = node(g, RFI_OP_ADD, xs, 2, NULL, RF_F32, RF_SHAPE(3));
    rfi_node *tt[2] = {t, t};
    rfi_node *u = node(g, RFI_OP_MUL, tt, 2, NULL, RF_F32, RF_SHAPE(3));
    rfi_node *e = node(g, RFI_OP_NEG, &x, 1, NULL, RF_F32, RF_SHAPE(3)); /* unused */
    (void)e;
    rfi_node *ut[2] = {u, t};
    rfi_node *v = node(g, RFI_OP_SUB, ut, 2, NULL, RF_F32, RF_SHAPE(3));
    CHECK_OK(rfi_graph_add_output(g, v));
    CHECK_OK(rfi_graph_add_output(g, v));
    CHECK_OK(rfi_graph_add_output(g, x));
    CHECK_OK(rfi_graph_add_update(g, cap, v));

    float xin[3] = {1, 0, -1}, o0[3], o1[3], o2[3], up[3];
    void *args[1] = {xin}, *caps[1] = {state->data}, *outs[3] = {o0, o1, o2}, *upds[1] = {up};
    CHECK_OK(run_graph(g, args, caps, outs, upds));
    /* t = [2, 2, 2]; v = t*t - t = [2, 2, 2] */
    check_f32(o0, (const float[]){2, 2, 2}, 3, "io out0");
    check_f32(o1, (const float[]){2, 2, 2}, 3, "io out1");
    check_f32(o2, xin, 3, "io out2 (argument)");
    check_f32(up, (const float[]){2, 2, 2}, 3, "io update");
    check_f32(sv, (const float[]){1, 2, 3}, 3, "capture untouched");
    rfi_graph_free(g);
    rfi_array_release(state);
}

static void test_grad_rejected(void)
{
    rfi_graph *g = new_graph();
    const float one = 1;
    rfi_node *x = constant(g, RF_F32, RF_SCALAR_SHAPE, &one);
    rfi_node *in[2] = {x, x};
    rfi_node *gr = node(g, RFI_OP_GRAD, in, 2, NULL, RF_F32, RF_SCALAR_SHAPE);
    CHECK_OK(rfi_graph_add_output(g, gr));
    void *state = NULL;
    CHECK_STATUS(rfi_interp_backend.prepare(g, &state), RF_E_INTERNAL);
    CHECK_MSG("grad");
    CHECK(state == NULL);
    rfi_graph_free(g);
}

int main(void)
{
    test_transpose();
    test_pad();
    test_shape_misc();
    test_dot_batched();
    test_convolution();
    test_reduce_window();
    test_select_and_scatter();
    test_reduce();
    test_dot_scrambled();
    test_conv_more();
    test_elementwise_long();
    test_strided_long();
    test_reduce_long();
    test_gather_scatter();
    test_rng();
    test_iota();
    test_elementwise();
    test_io();
    test_grad_rejected();
    return tu_finish("test_interp");
}
