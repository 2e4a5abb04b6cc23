/* test_autodiff.c: reverse-mode autodiff and dead-code elimination.
 *
 * Part 1 checks gradients through the public API (rf_compile, rf_grad,
 * rf_exec_run) against hand-derived values: squares, tanh of a matmul with a
 * captured weight, broadcasting, independent and stop_gradient'ed inputs,
 * two rf_grad calls on one y, aux outputs, an SGD update, nested gradients.
 * Part 2 checks the more intricate VJP rules (convolution with strides,
 * dilations and groups, windows, pad with crops, strided slices, batched
 * dot_general, broadcasts, indexing, prod with zeros) against central finite
 * differences in f64. Part 3 checks internals: every op has a rule or is
 * documented as gradient-free, and rfi_dce keeps argument/capture slots.
 */
#include <math.h>
#include "test_prog.h"

#include "ad/vjp.h"
#include "runtime/runtime.h"

/* ---- Part 1: hand-derived gradients --------------------------------------------------- */

static const double X6[6] = {0.5, -1.0, 2.0, 1.5, -0.25, 0.75};

static void build_square(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n;
    (void)u;
    rf_tensor *y = rf_sum_all(rf_mul(a[0], a[0]));
    rf_tensor *g = NULL;
    rf_grad(t, y, &a[0], 1, &g);
    rf_return(t, y);
    rf_return(t, g);
}

static void test_square(void)
{
    rf_array *x = tp_host(RF_F32, RF_SHAPE(2, 3), X6);
    rf_array *out[2];
    CHECK_OK(tp_run(build_square, NULL, &x, 1, out, 2));
    double want[6], sum = 0;
    for (int i = 0; i < 6; i++) {
        want[i] = 2 * X6[i];
        sum += X6[i] * X6[i];
    }
    CHECK_NEAR(tp_scalar(out[0]), sum, 1e-5, 1e-6);
    tp_expect("d sum(x*x)/dx", out[1], RF_F32, RF_SHAPE(2, 3), want, 1e-6, 1e-6);
    tp_free_all(out, 2);
    rf_array_free(x);
}

/* y = sum(tanh(x @ W)) with W captured: dW = x^T (1 - tanh(xW)^2). */
static const double W12[12] = {0.1, -0.2, 0.3, 0.05, -0.4, 0.25, 0.15, -0.1, 0.2, 0.35, -0.3, 0.45};

static void build_tanh_matmul(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n;
    rf_tensor *w = rf_capture(t, u);
    rf_tensor *y = rf_sum_all(rf_tanh(rf_matmul(a[0], w)));
    rf_tensor *wrt[2] = {w, a[0]}, *g[2] = {NULL, NULL};
    rf_grad(t, y, wrt, 2, g);
    rf_return(t, g[0]);
    rf_return(t, g[1]);
}

static void tanh_matmul_expected(double dw[12], double dx[6])
{
    memset(dw, 0, 12 * sizeof *dw);
    memset(dx, 0, 6 * sizeof *dx);
    for (int i = 0; i < 2; i++) {
        for (int j = 0; j < 4; j++) {
            double z = 0;
            for (int k = 0; k < 3; k++)
                z += X6[i * 3 + k] * W12[k * 4 + j];
            double d = 1 - tanh(z) * tanh(z);
            for (int k = 0; k < 3; k++) {
                dw[k * 4 + j] += X6[i * 3 + k] * d;
                dx[i * 3 + k] += W12[k * 4 + j] * d;
            }
        }
    }
}

static void test_tanh_matmul_capture(void)
{
    rf_array *wh = tp_host(RF_F32, RF_SHAPE(3, 4), W12);
    rf_array *w = tp_cpu(wh);
    rf_array *x = tp_host(RF_F32, RF_SHAPE(2, 3), X6);
    rf_array *out[2];
    CHECK_OK(tp_run(build_tanh_matmul, w, &x, 1, out, 2));
    double dw[12], dx[6];
    tanh_matmul_expected(dw, dx);
    tp_expect("d/dW sum(tanh(xW))", out[0], RF_F32, RF_SHAPE(3, 4), dw, 1e-5, 1e-5);
    tp_expect("d/dx sum(tanh(xW))", out[1], RF_F32, RF_SHAPE(2, 3), dx, 1e-5, 1e-5);
    tp_free_all(out, 2);
    rf_array_free(x);
    rf_array_free(w);
    rf_array_free(wh);
}

/* y = sum(3 * (x + b)) with b [3] broadcast over x [2, 3], plus an unused z. */
static void build_broadcast(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n;
    (void)u;
    rf_tensor *y = rf_sum_all(rf_mul_s(rf_add(a[0], a[1]), 3.0));
    rf_tensor *g[3];
    rf_grad(t, y, a, 3, g);
    for (int i = 0; i < 3; i++)
        rf_return(t, g[i]);
}

static void test_broadcast_and_independent(void)
{
    rf_array *in[3] = {
        tp_host(RF_F32, RF_SHAPE(2, 3), X6),
        tp_host(RF_F32, RF_SHAPE(3), (const double[]){1, 2, 3}),
        tp_host(RF_F32, RF_SHAPE(4), (const double[]){1, 1, 1, 1}),
    };
    rf_array *out[3];
    CHECK_OK(tp_run(build_broadcast, NULL, in, 3, out, 3));
    tp_expect("broadcast dx", out[0], RF_F32, RF_SHAPE(2, 3), (const double[]){3, 3, 3, 3, 3, 3},
              1e-6, 0);
    tp_expect("broadcast db", out[1], RF_F32, RF_SHAPE(3), (const double[]){6, 6, 6}, 1e-6, 0);
    tp_expect("independent dz", out[2], RF_F32, RF_SHAPE(4), (const double[]){0, 0, 0, 0}, 0, 0);
    tp_free_all(out, 3);
    tp_free_all(in, 3);
}

/* sum(x * stop_gradient(x)) -> x; sum(stop_gradient(x)) -> 0. */
static void build_stop_gradient(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n;
    (void)u;
    rf_tensor *y1 = rf_sum_all(rf_mul(a[0], rf_stop_gradient(a[0])));
    rf_tensor *y2 = rf_sum_all(rf_stop_gradient(a[0]));
    rf_tensor *g1 = NULL, *g2 = NULL;
    rf_grad(t, y1, &a[0], 1, &g1);
    rf_grad(t, y2, &a[0], 1, &g2);
    rf_return(t, g1);
    rf_return(t, g2);
}

/* d/dx sum(relu(x)) and d/dx sum(max(x, 0.5)): relu's gradient is y > 0
 * (zero at +-0 and NaN), a general max still sends ties to its first operand. */
static void build_relu_and_max(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n;
    (void)u;
    rf_tensor *g[1];
    rf_grad(t, rf_sum_all(rf_relu(a[0])), a, 1, g);
    rf_return(t, g[0]);
    rf_grad(t, rf_sum_all(rf_max(a[0], rf_scalar(t, 0.5))), a, 1, g);
    rf_return(t, g[0]);
    rf_grad(t, rf_sum_all(rf_max(rf_scalar(t, 0.0), a[0])), a, 1, g);
    rf_return(t, g[0]);
}

static void test_relu_gradient(void)
{
    rf_array *x = tp_host(RF_F32, RF_SHAPE(6), (const double[]){-1, -0.0, 0, 0.5, 2, NAN});
    rf_array *out[3];
    CHECK_OK(tp_run(build_relu_and_max, NULL, &x, 1, out, 3));
    tp_expect("relu grad", out[0], RF_F32, RF_SHAPE(6), (const double[]){0, 0, 0, 1, 1, 0}, 0, 0);
    tp_expect("max(x, 0.5) grad", out[1], RF_F32, RF_SHAPE(6),
              (const double[]){0, 0, 0, 1, 1, 0}, 0, 0);
    tp_expect("max(0, x) grad", out[2], RF_F32, RF_SHAPE(6), (const double[]){0, 0, 0, 1, 1, 0},
              0, 0);
    tp_free_all(out, 3);
    rf_array_free(x);
}

static void test_stop_gradient(void)
{
    rf_array *x = tp_host(RF_F32, RF_SHAPE(6), X6);
    rf_array *out[2];
    CHECK_OK(tp_run(build_stop_gradient, NULL, &x, 1, out, 2));
    tp_expect("stop_gradient partial", out[0], RF_F32, RF_SHAPE(6), X6, 1e-6, 0);
    tp_expect("stop_gradient total", out[1], RF_F32, RF_SHAPE(6),
              (const double[]){0, 0, 0, 0, 0, 0}, 0, 0);
    tp_free_all(out, 2);
    rf_array_free(x);
}

/* Windows over a value with no elements (a pad that crops everything) hold
 * only padding: a window sum and a convolution of one still have gradients,
 * zeros. */
static void build_empty_windows(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    rf_tensor *half = rf_scalar(t, 0.5);
    rf_tensor *e = rf_pad(a[0], half, (const int64_t[]){0, 3, -2}, (const int64_t[]){-2, -2, -2},
                          NULL); /* f32[0,4,0] */
    rf_tensor *s = rf_reduce_window(e, RF_REDUCE_SUM, (const int64_t[]){3, 3, 3},
                                    (const int64_t[]){2, 2, 2}, (const int64_t[]){2, 2, 5},
                                    (const int64_t[]){4, 5, 4}); /* f32[2,5,4] */
    rf_tensor *flat = rf_pad(a[0], half, (const int64_t[]){0, 0, -2},
                             (const int64_t[]){0, -1, -2}, NULL); /* f32[2,2,0] */
    rf_conv_params p = rf_conv_params_default(1);
    p.pad_lo[0] = p.pad_hi[0] = 1;
    rf_tensor *c = rf_conv(flat, rf_full(t, RF_F32, RF_SHAPE(3, 2, 1), 1.0), &p); /* [2,3,2] */
    rf_tensor *y = rf_add(rf_sum_all(s), rf_sum_all(c)), *g = NULL;
    rf_grad(t, y, &a[0], 1, &g);
    rf_return(t, y);
    rf_return(t, g);
}

/* Runs build on the ramp -2, -1.75, ... as f32[2,3,4] into out[0..2). */
static void run_on_ramp(tp_build_fn build, rf_array **out)
{
    double x[24];
    for (int i = 0; i < 24; i++)
        x[i] = 0.25 * i - 2;
    rf_array *h = tp_host(RF_F32, RF_SHAPE(2, 3, 4), x);
    CHECK_OK(tp_run(build, NULL, &h, 1, out, 2));
    rf_array_free(h);
}

static void test_empty_windows(void)
{
    rf_array *out[2];
    run_on_ramp(build_empty_windows, out);
    tp_expect("sum over padding only", out[0], RF_F32, RF_SCALAR_SHAPE, (const double[]){0}, 0, 0);
    double zeros[24] = {0};
    tp_expect("gradient through an empty value", out[1], RF_F32, RF_SHAPE(2, 3, 4), zeros, 0, 0);
    tp_free_all(out, 2);
}

/* A concatenation whose operands are all empty along its axis (the fuzzer's
 * leaky-relu of an empty embedding, joined to itself): an empty value, a
 * reduction over it, and its gradient. The compiled backend once failed to
 * lower it (RF_E_INTERNAL). */
static void build_empty_concatenate(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    rf_tensor *x = rf_pad(a[0], rf_scalar(t, 0), (const int64_t[]){0, 0, 0},
                          (const int64_t[]){0, -3, 0}, NULL); /* f32[2,0,4] */
    rf_tensor *leaky = rf_activate(x, RF_ACT_LEAKYRELU);
    rf_tensor *c = rf_concatenate((rf_tensor *[]){leaky, x}, 2, 1); /* f32[2,0,4] */
    rf_tensor *r = rf_reduce(rf_log(rf_add(c, rf_scalar(t, 1))), RF_REDUCE_SUM,
                             (const int64_t[]){1}, 1, false); /* f32[2,4], zeros */
    rf_tensor *g = NULL;
    rf_grad(t, rf_sum_all(r), &a[0], 1, &g);
    rf_return(t, r);
    rf_return(t, g);
}

static void test_empty_concatenate(void)
{
    rf_array *out[2];
    run_on_ramp(build_empty_concatenate, out);
    double zeros[24] = {0};
    tp_expect("sum over an empty concatenation", out[0], RF_F32, RF_SHAPE(2, 4), zeros, 0, 0);
    tp_expect("gradient through it", out[1], RF_F32, RF_SHAPE(2, 3, 4), zeros, 0, 0);
    tp_free_all(out, 2);
}

/* Pooling a batch of 0 images (and the gradient through it): the batch axis,
 * which the window does not cover, stays empty, as in PyTorch and XLA. Both
 * were once refused ("window 1 ... does not fit axis 0"). */
static void build_empty_batch_pooling(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    rf_tensor *x = rf_reshape(a[0], RF_SHAPE(2, 3, 2, 2));
    x = rf_pad(x, rf_scalar(t, 0), (const int64_t[]){0, 0, 0, 0}, (const int64_t[]){-2, 0, 0, 0},
               NULL); /* f32[0,3,2,2] */
    const int64_t k[2] = {2, 2};
    rf_tensor *pooled = rf_add(rf_maxpool2d(x, k, NULL, NULL), rf_meanpool2d(x, k, NULL, NULL));
    rf_tensor *g = NULL;
    rf_grad(t, rf_sum_all(pooled), &a[0], 1, &g);
    rf_return(t, pooled);
    rf_return(t, g);
}

static void test_empty_batch_pooling(void)
{
    rf_array *out[2];
    run_on_ramp(build_empty_batch_pooling, out);
    double zeros[24] = {0};
    tp_expect("pooled empty batch", out[0], RF_F32, RF_SHAPE(0, 3, 1, 1), zeros, 0, 0);
    tp_expect("gradient through it", out[1], RF_F32, RF_SHAPE(2, 3, 4), zeros, 0, 0);
    tp_free_all(out, 2);
}

/* Extreme amounts that still give small results: a crop of INT64_MIN beside
 * a padding of INT64_MAX (all padding, one row), a slice stride of
 * INT64_MAX (one element), the same crop and padding around a convolution's
 * input (all zeros). Each overflowed the backends' index arithmetic (UBSan);
 * now a crop past an axis is the crop of exactly the axis. */
static void build_extreme_amounts(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    rf_tensor *x = a[0]; /* f32[2,3,4] */
    rf_tensor *padded = rf_pad(x, rf_scalar(t, 9), (const int64_t[]){INT64_MIN, 0, 0},
                               (const int64_t[]){INT64_MAX, 0, 0}, NULL); /* [1,3,4] of 9 */
    rf_tensor *sliced = rf_slice(x, (const int64_t[]){0, 1, 0}, (const int64_t[]){2, 3, 4},
                                 (const int64_t[]){1, INT64_MAX, 1}); /* x[:, 1:2, :] */
    rf_conv_params p = rf_conv_params_default(2);
    p.pad_lo[0] = INT64_MIN;
    p.pad_hi[0] = INT64_MAX;
    rf_tensor *w = rf_full(t, RF_F32, RF_SHAPE(1, 2, 1, 1), 1);
    rf_tensor *conv = rf_conv(rf_reshape(x, RF_SHAPE(1, 2, 3, 4)), w, &p); /* [1,1,2,4] zeros */
    rf_tensor *y = rf_add(rf_add(rf_sum_all(padded), rf_sum_all(sliced)), rf_sum_all(conv));
    rf_tensor *g = NULL;
    rf_grad(t, y, &a[0], 1, &g);
    rf_return(t, y);
    rf_return(t, g);
}

static void test_extreme_amounts(void)
{
    rf_array *out[2];
    run_on_ramp(build_extreme_amounts, out);
    /* 12 nines, x[0,1,:] = -1 .. -0.25 and x[1,1,:] = 2 .. 2.75 */
    tp_expect("sum of the three", out[0], RF_F32, RF_SCALAR_SHAPE, (const double[]){115}, 0, 0);
    double g[24] = {0};
    for (int b = 0; b < 2; b++)
        for (int k = 0; k < 4; k++)
            g[b * 12 + 4 + k] = 1;
    tp_expect("gradient: the sliced row", out[1], RF_F32, RF_SHAPE(2, 3, 4), g, 0, 0);
    tp_free_all(out, 2);
}

/* One rf_grad with two wrt vs two rf_grad calls on the same y: same values
 * and the same program (the backward sweep is emitted once). */
static void build_tanh_two_calls(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n;
    rf_tensor *w = rf_capture(t, u);
    rf_tensor *y = rf_sum_all(rf_tanh(rf_matmul(a[0], w)));
    rf_tensor *gw = NULL, *gx = NULL;
    rf_grad(t, y, &w, 1, &gw);
    rf_grad(t, y, &a[0], 1, &gx);
    rf_return(t, gw);
    rf_return(t, gx);
}

static void test_two_grad_calls(void)
{
    rf_array *wh = tp_host(RF_F32, RF_SHAPE(3, 4), W12);
    rf_array *w = tp_cpu(wh);
    rf_array *x = tp_dev(RF_F32, RF_SHAPE(2, 3), X6);
    rf_exec *one = NULL, *two = NULL;
    CHECK_OK(tp_compile(build_tanh_matmul, w, &x, 1, &one));
    CHECK_OK(tp_compile(build_tanh_two_calls, w, &x, 1, &two));
    if (one && two) {
        CHECK(rf_exec_hash(one) == rf_exec_hash(two));
        rf_array *out[2] = {NULL, NULL};
        CHECK_OK(rf_exec_run(two, &x, 1, out, 2));
        double dw[12], dx[6];
        tanh_matmul_expected(dw, dx);
        tp_expect("two calls dW", out[0], RF_F32, RF_SHAPE(3, 4), dw, 1e-5, 1e-5);
        tp_expect("two calls dx", out[1], RF_F32, RF_SHAPE(2, 3), dx, 1e-5, 1e-5);
        tp_free_all(out, 2);
    }
    rf_exec_free(one);
    rf_exec_free(two);
    rf_array_free(x);
    rf_array_free(w);
    rf_array_free(wh);
}

/* Loss, an aux output (not differentiated) and the gradient w.r.t. an
 * intermediate h = 2x: d sum(h*h)/dh = 2h. */
static void build_aux(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n;
    (void)u;
    rf_tensor *h = rf_mul_s(a[0], 2.0);
    rf_tensor *y = rf_sum_all(rf_mul(h, h));
    rf_tensor *aux = rf_mean_all(rf_exp(a[0]));
    rf_tensor *g = NULL;
    rf_grad(t, y, &h, 1, &g);
    rf_return(t, y);
    rf_return(t, aux);
    rf_return(t, g);
}

static void test_aux_and_intermediate(void)
{
    rf_array *x = tp_host(RF_F32, RF_SHAPE(6), X6);
    rf_array *out[3];
    CHECK_OK(tp_run(build_aux, NULL, &x, 1, out, 3));
    double y = 0, aux = 0, g[6];
    for (int i = 0; i < 6; i++) {
        y += 4 * X6[i] * X6[i];
        aux += exp(X6[i]) / 6;
        g[i] = 4 * X6[i];
    }
    CHECK_NEAR(tp_scalar(out[0]), y, 1e-5, 1e-6);
    CHECK_NEAR(tp_scalar(out[1]), aux, 1e-5, 1e-6);
    tp_expect("d/dh", out[2], RF_F32, RF_SHAPE(6), g, 1e-5, 1e-6);
    tp_free_all(out, 3);
    rf_array_free(x);
}

/* One SGD step as an update: W <- W - 0.5 * dW of sum(tanh(xW)). */
static void build_sgd(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n;
    rf_tensor *w = rf_capture(t, u);
    rf_tensor *y = rf_sum_all(rf_tanh(rf_matmul(a[0], w)));
    rf_tensor *g = NULL;
    rf_grad(t, y, &w, 1, &g);
    rf_assign(t, u, rf_sub(w, rf_mul_s(g, 0.5)));
    rf_return(t, y);
}

static void test_sgd_update(void)
{
    rf_array *wh = tp_host(RF_F32, RF_SHAPE(3, 4), W12);
    rf_array *w = tp_cpu(wh);
    rf_array *x = tp_host(RF_F32, RF_SHAPE(2, 3), X6);
    rf_array *out[1];
    CHECK_OK(tp_run(build_sgd, w, &x, 1, out, 1));
    double dw[12], dx[6], want[12];
    tanh_matmul_expected(dw, dx);
    for (int i = 0; i < 12; i++)
        want[i] = W12[i] - 0.5 * dw[i];
    tp_expect("sgd updated W", w, RF_F32, RF_SHAPE(3, 4), want, 1e-5, 1e-5);
    tp_free_all(out, 1);
    rf_array_free(x);
    rf_array_free(w);
    rf_array_free(wh);
}

static void build_nested(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n;
    (void)u;
    rf_tensor *g1 = NULL, *g2 = NULL;
    rf_grad(t, rf_sum_all(rf_mul(a[0], a[0])), &a[0], 1, &g1);
    rf_grad(t, rf_sum_all(rf_mul(g1, a[0])), &a[0], 1, &g2);
    rf_return(t, g2);
}

static void test_nested_is_rejected(void)
{
    rf_array *x = tp_dev(RF_F32, RF_SHAPE(6), X6);
    rf_exec *e = NULL;
    CHECK_STATUS(tp_compile(build_nested, NULL, &x, 1, &e), RF_E_UNSUPPORTED);
    CHECK_MSG("nested gradients are not supported");
    CHECK(e == NULL);
    rf_exec_free(e);
    rf_array_free(x);
}

/* A gradient taken w.r.t. an earlier gradient (g1 = 2x, y2 = sum(g1 * g1): d y2 / d g1 =
 * 2 g1 = 4x) needs nothing nested: g1 is a leaf of the second sweep. */
static void build_wrt_grad(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n;
    (void)u;
    rf_tensor *g1 = NULL, *g2 = NULL;
    rf_grad(t, rf_sum_all(rf_mul(a[0], a[0])), &a[0], 1, &g1);
    rf_grad(t, rf_sum_all(rf_mul(g1, g1)), &g1, 1, &g2);
    rf_return(t, g2);
}

static void test_wrt_a_gradient(void)
{
    rf_array *x = tp_dev(RF_F32, RF_SHAPE(6), X6), *out[1] = {0};
    CHECK_OK(tp_run(build_wrt_grad, NULL, &x, 1, out, 1));
    double want[6];
    for (int i = 0; i < 6; i++)
        want[i] = 4 * X6[i];
    tp_expect("d sum(g1^2) / d g1 with g1 = grad(sum(x^2))", out[0], RF_F32, RF_SHAPE(6), want,
              1e-6, 1e-6);
    tp_free_all(out, 1);
    rf_array_free(x);
}

/* A softmax over the rows of a [2,3] x written by hand, as rf_softmax builds it: its
 * result's VJP goes straight to x (vjp_softmax.c), unless a node inside is itself a wrt,
 * as e here: d sum(p * w) / de = (w - sum(p * w)) / sum(e) by row, which the result's
 * contribution must reach. With u set, only x is a wrt. */
static const double W6[6] = {0.3, -0.7, 1.1, 0.4, 0.9, -0.2};

static void build_softmax_parts(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n;
    int64_t axis = 1;
    rf_tensor *m = rf_stop_gradient(rf_reduce_max(a[0], &axis, 1, true));
    rf_tensor *e = rf_exp(rf_sub(a[0], m));
    rf_tensor *p = rf_div(e, rf_sum(e, &axis, 1, true));
    rf_tensor *y = rf_sum_all(rf_mul(p, a[1]));
    rf_tensor *wrt[2] = {a[0], e}, *g[2] = {NULL, NULL};
    rf_grad(t, y, wrt, u ? 1 : 2, g);
    rf_return(t, g[0]);
    if (!u)
        rf_return(t, g[1]);
}

static void test_softmax_inner_wrt(void)
{
    rf_array *in[2] = {tp_host(RF_F64, RF_SHAPE(2, 3), X6), tp_host(RF_F64, RF_SHAPE(2, 3), W6)};
    double dx[6], de[6];
    for (int r = 0; r < 2; r++) {
        const double *x = X6 + 3 * r, *w = W6 + 3 * r;
        double mx = fmax(x[0], fmax(x[1], x[2])), s = 0, pw = 0;
        for (int i = 0; i < 3; i++)
            s += exp(x[i] - mx);
        for (int i = 0; i < 3; i++)
            pw += exp(x[i] - mx) / s * w[i];
        for (int i = 0; i < 3; i++) {
            dx[3 * r + i] = exp(x[i] - mx) / s * (w[i] - pw);
            de[3 * r + i] = (w[i] - pw) / s;
        }
    }
    for (int both = 0; both < 2; both++) {
        rf_array *out[2] = {0};
        int nout = both ? 2 : 1;
        CHECK_OK(tp_run(build_softmax_parts, both ? NULL : &nout, in, 2, out, nout));
        tp_expect("d/dx of a softmax written by hand", out[0], RF_F64, RF_SHAPE(2, 3), dx,
                  1e-12, 1e-12);
        if (both)
            tp_expect("d/de inside it", out[1], RF_F64, RF_SHAPE(2, 3), de, 1e-12, 1e-12);
        tp_free_all(out, nout);
    }
    rf_array_free(in[0]);
    rf_array_free(in[1]);
}

/* ---- Part 2: finite differences for the intricate rules ------------------------------ */

typedef rf_tensor *(*fd_fn)(rf_trace *t, rf_tensor *const *a);

typedef struct fd_arg {
    rf_dtype dt;
    int rank;
    int64_t dims[4];
    const double *vals; /* NULL: pseudo-random in [lo, hi) */
    double lo, hi;
    bool wrt;
} fd_arg;

typedef struct fd_case {
    const char *name;
    fd_fn f;
    int nargs;
    fd_arg a[4];
} fd_case;

/* loss = sum(f(args) * R) for a fixed R, then its gradient w.r.t. the wrt args. */
static void fd_build(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    const fd_case *c = u;
    (void)n;
    rf_tensor *y = c->f(t, a);
    if (!y)
        return;
    int64_t m = rf_tensor_numel(y);
    double *r = malloc(sizeof(double) * (size_t)(m > 0 ? m : 1));
    for (int64_t i = 0; r && i < m; i++)
        r[i] = 0.5 + 0.4 * sin(1.7 * (double)i + 0.3);
    rf_tensor *rt = rf_constant(t, rf_tensor_dtype(y), rf_tensor_dims(y), rf_tensor_rank(y), r);
    free(r);
    rf_tensor *loss = rf_sum_all(rf_mul(y, rt));
    rf_return(t, loss);
    rf_tensor *wrt[4], *g[4];
    int nw = 0;
    for (int i = 0; i < c->nargs; i++)
        if (c->a[i].wrt)
            wrt[nw++] = a[i];
    rf_grad(t, loss, wrt, nw, g);
    for (int i = 0; i < nw; i++)
        rf_return(t, g[i]);
}

static double fd_loss(rf_exec *e, rf_array **dev, int nargs)
{
    rf_array *out = NULL;
    double v = NAN;
    if (rf_exec_run(e, dev, nargs, &out, 1) == RF_OK)
        v = tp_scalar(out);
    rf_array_free(out);
    return v;
}

static void fd_check(const fd_case *c)
{
    uint64_t seed = 12345;
    double *vals[4] = {0};
    rf_array *dev[4] = {0};
    for (int i = 0; i < c->nargs; i++) {
        const fd_arg *a = &c->a[i];
        int64_t n = tp_numel(a->dims, a->rank);
        vals[i] = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
        for (int64_t k = 0; k < n; k++)
            vals[i][k] = a->vals ? a->vals[k] : tp_rand(&seed, a->lo, a->hi);
        dev[i] = tp_dev(a->dt, a->dims, a->rank, vals[i]);
    }
    rf_exec *e = NULL;
    rf_status st = tp_compile(fd_build, (void *)c, dev, c->nargs, &e);
    tu_checks++;
    if (st != RF_OK) {
        tu_failures++;
        fprintf(stderr, "fd %s: compile failed: %s: %s\n", c->name, rf_status_str(st),
                rf_errmsg());
    }
    rf_array *outs[5] = {0};
    int nw = 0;
    for (int i = 0; i < c->nargs; i++)
        nw += c->a[i].wrt;
    if (e && rf_exec_run(e, dev, c->nargs, outs, 1 + nw) == RF_OK) {
        int w = 0;
        for (int i = 0; i < c->nargs; i++) {
            const fd_arg *a = &c->a[i];
            if (!a->wrt)
                continue;
            int64_t n = tp_numel(a->dims, a->rank);
            double *want = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
            for (int64_t k = 0; k < n; k++) {
                const double h = 1e-5, old = vals[i][k];
                double lp, lm;
                vals[i][k] = old + h;
                rf_array_free(dev[i]);
                dev[i] = tp_dev(a->dt, a->dims, a->rank, vals[i]);
                lp = fd_loss(e, dev, c->nargs);
                vals[i][k] = old - h;
                rf_array_free(dev[i]);
                dev[i] = tp_dev(a->dt, a->dims, a->rank, vals[i]);
                lm = fd_loss(e, dev, c->nargs);
                vals[i][k] = old;
                want[k] = (lp - lm) / (2 * h);
            }
            rf_array_free(dev[i]);
            dev[i] = tp_dev(a->dt, a->dims, a->rank, vals[i]);
            char label[160];
            snprintf(label, sizeof label, "fd %s: d/darg%d", c->name, i);
            tp_expect(label, outs[1 + w], a->dt, a->dims, a->rank, want, 1e-6, 1e-5);
            free(want);
            w++;
        }
    } else if (e) {
        tu_checks++;
        tu_failures++;
        fprintf(stderr, "fd %s: run failed: %s\n", c->name, rf_errmsg());
    }
    tp_free_all(outs, 5);
    rf_exec_free(e);
    for (int i = 0; i < c->nargs; i++) {
        rf_array_free(dev[i]);
        free(vals[i]);
    }
}

static rf_tensor *f_conv_groups(rf_trace *t, rf_tensor *const *a)
{
    (void)t;
    rf_conv_params p = rf_conv_params_default(2);
    p.stride[0] = 2;
    p.pad_lo[0] = 1;
    p.pad_hi[1] = 1;
    p.rhs_dilation[1] = 2;
    p.feature_group_count = 2;
    return rf_conv(a[0], a[1], &p);
}

static rf_tensor *f_conv_lhs_dilated(rf_trace *t, rf_tensor *const *a)
{
    (void)t;
    rf_conv_params p = rf_conv_params_default(1);
    p.stride[0] = 3; /* (9 + 0 - 2) is not a multiple of 3: trailing inputs unused */
    p.lhs_dilation[0] = 2;
    p.pad_lo[0] = -1; /* a crop */
    p.pad_hi[0] = 2;
    return rf_conv(a[0], a[1], &p);
}

static rf_tensor *f_conv_batch_groups(rf_trace *t, rf_tensor *const *a)
{
    (void)t;
    rf_conv_params p = rf_conv_params_default(1);
    p.batch_group_count = 2;
    p.stride[0] = 2;
    return rf_conv(a[0], a[1], &p);
}

static rf_tensor *f_window_sum(rf_trace *t, rf_tensor *const *a)
{
    (void)t;
    return rf_reduce_window(a[0], RF_REDUCE_SUM, (const int64_t[]){2, 3}, (const int64_t[]){1, 2},
                            (const int64_t[]){1, 0}, (const int64_t[]){0, 2});
}

static rf_tensor *f_window_max(rf_trace *t, rf_tensor *const *a)
{
    (void)t;
    rf_tensor *mx = rf_reduce_window(a[0], RF_REDUCE_MAX, (const int64_t[]){2, 2},
                                     (const int64_t[]){2, 1}, (const int64_t[]){1, 0},
                                     (const int64_t[]){0, 1});
    rf_tensor *mn = rf_reduce_window(a[0], RF_REDUCE_MIN, (const int64_t[]){2, 2},
                                     (const int64_t[]){2, 1}, (const int64_t[]){1, 0},
                                     (const int64_t[]){0, 1});
    return rf_add(mx, rf_mul_s(mn, 0.7));
}

static rf_tensor *f_select_and_scatter(rf_trace *t, rf_tensor *const *a)
{
    (void)t;
    return rf_select_and_scatter(a[0], a[1], (const int64_t[]){2, 3}, (const int64_t[]){2, 2},
                                 (const int64_t[]){1, 0}, (const int64_t[]){0, 1});
}

static rf_tensor *f_pad_slice(rf_trace *t, rf_tensor *const *a)
{
    (void)t;
    rf_tensor *p = rf_pad(a[0], a[1], (const int64_t[]){-1, 2}, (const int64_t[]){1, -2},
                          (const int64_t[]){1, 0});
    rf_tensor *s = rf_slice(p, (const int64_t[]){1, 0}, (const int64_t[]){7, 5},
                            (const int64_t[]){2, 3});
    return rf_mul(s, s);
}

static rf_tensor *f_dot_batched(rf_trace *t, rf_tensor *const *a)
{
    (void)t;
    /* a [2,3,4], b [4,2,5]: batch a0~b1, contract a2~b0 -> [2,3,5] */
    return rf_dot_general(a[0], a[1], (const int64_t[]){0}, (const int64_t[]){1}, 1,
                          (const int64_t[]){2}, (const int64_t[]){0}, 1);
}

static rf_tensor *f_broadcasts(rf_trace *t, rf_tensor *const *a)
{
    (void)t;
    /* a0 [4] -> [3,2,4] (new dims); a1 [3,1] -> [3,2,4] stretching dim 1 */
    rf_tensor *b0 = rf_broadcast_in_dim(a[0], RF_SHAPE(3, 2, 4), (const int64_t[]){2});
    rf_tensor *b1 = rf_broadcast_in_dim(a[1], RF_SHAPE(3, 2, 4), (const int64_t[]){0, 2});
    rf_tensor *c = rf_concatenate((rf_tensor *const[]){b0, b1}, 2, 1);
    rf_tensor *r = rf_reverse(rf_transpose(c, (const int64_t[]){2, 0, 1}), (const int64_t[]){0}, 1);
    return rf_tanh(rf_reshape(r, RF_SHAPE(12, 4)));
}

static rf_tensor *f_indexing(rf_trace *t, rf_tensor *const *a)
{
    (void)t;
    /* gather with clamped indices, scatter_add with repeats and dropped ones */
    rf_tensor *g = rf_gather(a[0], a[2], 0);       /* [5,3] at [4] -> [4,3] */
    rf_tensor *s = rf_scatter_add(a[0], a[2], a[1], 0);
    return rf_add(rf_sum(rf_mul(g, g), (const int64_t[]){0}, 1, false),
                  rf_sum(rf_mul(s, s), (const int64_t[]){0}, 1, false));
}

static rf_tensor *f_reductions(rf_trace *t, rf_tensor *const *a)
{
    (void)t;
    rf_tensor *p = rf_reduce(a[0], RF_REDUCE_PROD, (const int64_t[]){1}, 1, false);
    rf_tensor *m = rf_reduce(a[0], RF_REDUCE_MAX, (const int64_t[]){0}, 1, false);
    rf_tensor *n = rf_reduce(a[0], RF_REDUCE_MIN, (const int64_t[]){1}, 1, false);
    return rf_add(rf_add(rf_sum_all(p), rf_sum_all(m)), rf_sum_all(n));
}

static rf_tensor *f_elementwise(rf_trace *t, rf_tensor *const *a)
{
    (void)t;
    rf_tensor *x = a[0], *y = a[1];
    rf_tensor *e = rf_add(rf_pow(x, y), rf_div(rf_log1p(x), rf_rsqrt(y)));
    e = rf_add(e, rf_mul(rf_max(x, y), rf_min(rf_logistic(x), rf_expm1(y))));
    e = rf_add(e, rf_rem(rf_mul_s(x, 3.0), y));
    e = rf_add(e, rf_clamp_s(rf_sin(rf_mul_s(x, 4.0)), -0.5, 0.6));
    return rf_add(e, rf_mul(rf_abs(rf_sub(x, y)), rf_cos(y)));
}

static void test_finite_differences(void)
{
    static const double zeros_row[12] = {0.5, 0.0, 1.5, -0.7, 1.1, 0.9, 0.0, 0.0, 1.3,
                                         -1.2, 0.8, 2.0};
    static const double idx[4] = {4, -1, 4, 7};
    static const fd_case cases[] = {
        {"conv groups/stride/dilation", f_conv_groups, 2,
         {{RF_F64, 4, {2, 4, 6, 5}, NULL, -1, 1, true},
          {RF_F64, 4, {6, 2, 3, 2}, NULL, -1, 1, true}}},
        {"conv lhs dilation/crop", f_conv_lhs_dilated, 2,
         {{RF_F64, 3, {2, 2, 5}, NULL, -1, 1, true}, {RF_F64, 3, {3, 2, 2}, NULL, -1, 1, true}}},
        {"conv batch groups", f_conv_batch_groups, 2,
         {{RF_F64, 3, {4, 3, 5}, NULL, -1, 1, true}, {RF_F64, 3, {4, 3, 2}, NULL, -1, 1, true}}},
        {"reduce_window sum", f_window_sum, 1, {{RF_F64, 2, {3, 7}, NULL, -1, 1, true}}},
        {"reduce_window max/min", f_window_max, 1, {{RF_F64, 2, {5, 4}, NULL, -1, 1, true}}},
        {"select_and_scatter", f_select_and_scatter, 2,
         {{RF_F64, 2, {5, 6}, NULL, -1, 1, true}, {RF_F64, 2, {3, 3}, NULL, -1, 1, true}}},
        {"pad/slice", f_pad_slice, 2,
         {{RF_F64, 2, {4, 5}, NULL, -1, 1, true}, {RF_F64, 0, {0}, NULL, -1, 1, true}}},
        {"dot_general batched", f_dot_batched, 2,
         {{RF_F64, 3, {2, 3, 4}, NULL, -1, 1, true}, {RF_F64, 3, {4, 2, 5}, NULL, -1, 1, true}}},
        {"broadcast/concat/transpose/reverse/reshape", f_broadcasts, 2,
         {{RF_F64, 1, {4}, NULL, -1, 1, true}, {RF_F64, 2, {3, 1}, NULL, -1, 1, true}}},
        {"gather/scatter_add", f_indexing, 3,
         {{RF_F64, 2, {5, 3}, NULL, -1, 1, true}, {RF_F64, 2, {4, 3}, NULL, -1, 1, true},
          {RF_I32, 1, {4}, idx, 0, 0, false}}},
        {"reduce prod (zeros)/max/min", f_reductions, 1,
         {{RF_F64, 2, {4, 3}, zeros_row, 0, 0, true}}},
        {"elementwise", f_elementwise, 2,
         {{RF_F64, 1, {7}, NULL, 0.2, 2, true}, {RF_F64, 1, {7}, NULL, 0.3, 1.7, true}}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        fd_check(&cases[i]);
}

/* ---- Part 3: internals ---------------------------------------------------------------- */

static void test_every_op_has_a_rule(void)
{
    for (int op = 0; op < RFI_OP_COUNT; op++) {
        unsigned fl = rfi_op_table[op].flags;
        bool covered = (fl & (RFI_NOGRAD | RFI_LEAF)) || rfi_vjp_rule((rfi_op)op) ||
                       rfi_vjp_has_zero_rule((rfi_op)op);
        if (!covered)
            fprintf(stderr, "op %s has no VJP rule\n", rfi_op_table[op].name);
        CHECK(covered);
    }
}

static void test_dce(void)
{
    rf_device *dev = rf_device_cpu();
    rfi_graph *g = rfi_graph_new(dev, "dce");
    rf_array *cap = rf_array_new(dev, RF_F32, RF_SHAPE(3), NULL);
    rf_dtype dt[2] = {RF_F32, RF_F32};
    int ranks[2] = {1, 1};
    int64_t dims[2][RF_MAX_RANK] = {{3}, {3}};
    CHECK_OK(rfi_graph_set_args(g, 2, dt, ranks, (const int64_t(*)[RF_MAX_RANK])dims));
    CHECK(rfi_graph_capture_index(g, cap) == 0);
    rfi_attrs a0 = {.i = {0}}, a1 = {.i = {1}}, c0 = {.i = {0}};
    rfi_node *x0 = rfi_node_new(g, RFI_OP_ARGUMENT, NULL, 0, &a0, RF_F32, (int64_t[]){3}, 1);
    rfi_node *x1 = rfi_node_new(g, RFI_OP_ARGUMENT, NULL, 0, &a1, RF_F32, (int64_t[]){3}, 1);
    rfi_node *c = rfi_node_new(g, RFI_OP_CAPTURE, NULL, 0, &c0, RF_F32, (int64_t[]){3}, 1);
    rfi_node *dead = rfi_ad_unary(g, RFI_OP_EXP, rfi_ad_binary(g, RFI_OP_ADD, x0, c));
    rfi_node *live = rfi_ad_unary(g, RFI_OP_NEG, x1);
    CHECK(dead && live);
    CHECK_OK(rfi_graph_add_output(g, live));
    rfi_graph *d = NULL;
    CHECK_OK(rfi_dce(g, &d));
    if (d) {
        CHECK(d->n_nodes == 2);
        CHECK(d->n_args == 2 && d->n_captures == 1 && d->captures[0] == cap);
        CHECK(d->args[0] == NULL && d->args[1] != NULL && d->args[1]->attr.i[0] == 1);
        CHECK(d->n_outputs == 1 && d->outputs[0]->op == RFI_OP_NEG);
        CHECK_OK(rfi_verify(d));
    }
    rfi_graph *ad = NULL; /* no GRAD: a plain copy */
    CHECK_OK(rfi_autodiff(g, &ad));
    if (ad)
        CHECK(ad->n_nodes == g->n_nodes && rfi_hash(ad) == rfi_hash(g));
    rfi_graph_free(ad);
    rfi_graph_free(d);
    rfi_graph_free(g);
    rf_array_free(cap);
}

/* The gradient of x [2, L] through slices of columns cols[i][0]..cols[i][1]
 * (stride cols[i][2]), each used: y = sum of sum(tanh(piece)). Returns the
 * printed program after autodiff (free it), or NULL. */
static char *sliced_gradient_ir(int64_t len, const int64_t (*cols)[3], int n)
{
    rfi_graph *g = rfi_graph_new(rf_device_cpu(), "pieces");
    rf_dtype dt = RF_F32;
    int rank = 2;
    int64_t dims[1][RF_MAX_RANK] = {{2, len}};
    CHECK_OK(rfi_graph_set_args(g, 1, &dt, &rank, (const int64_t(*)[RF_MAX_RANK])dims));
    rfi_attrs a0 = {.i = {0}};
    rfi_node *x = rfi_node_new(g, RFI_OP_ARGUMENT, NULL, 0, &a0, RF_F32, dims[0], 2);
    rfi_node *y = NULL;
    for (int i = 0; i < n; i++) {
        rfi_node *piece = rfi_ad_slice(g, x, (int64_t[]){0, cols[i][0]},
                                       (int64_t[]){2, cols[i][1]}, (int64_t[]){1, cols[i][2]});
        rfi_node *term = rfi_ad_sum_all(g, rfi_ad_unary(g, RFI_OP_TANH, piece));
        y = y ? rfi_ad_binary(g, RFI_OP_ADD, y, term) : term;
    }
    rfi_node *in[2] = {y, x};
    rfi_node *gr = rfi_node_new(g, RFI_OP_GRAD, in, 2, NULL, RF_F32, dims[0], 2);
    CHECK(gr != NULL);
    char *text = NULL;
    rfi_graph *ad = NULL;
    if (gr && rfi_graph_add_output(g, gr) == RF_OK && rfi_autodiff(g, &ad) == RF_OK) {
        rfi_graph *d = NULL;
        CHECK_OK(rfi_dce(ad, &d));
        text = d ? rfi_print(d) : NULL;
        rfi_graph_free(d);
    }
    CHECK(text != NULL);
    rfi_graph_free(ad);
    rfi_graph_free(g);
    return text;
}

static int count_of(const char *text, const char *what)
{
    int n = 0;
    for (const char *p = text; p && (p = strstr(p, what)) != NULL; p++)
        n++;
    return n;
}

/* Disjoint slices along one axis (a GRU's gates cut from one matrix product)
 * get one concatenation of their cotangents, with zeros only where no slice
 * reads; overlapping and strided slices keep a sum of pads. */
static void test_slice_pieces_concatenate(void)
{
    static const int64_t tiles[3][3] = {{6, 9, 1}, {0, 3, 1}, {3, 6, 1}};
    char *t = sliced_gradient_ir(9, tiles, 3);
    CHECK(t && count_of(t, "concatenate(") == 1 && count_of(t, "pad(") == 0);
    CHECK(t && count_of(t, " add(") == 0);
    if (t && (count_of(t, "concatenate(") != 1 || count_of(t, "pad(") != 0))
        fprintf(stderr, "%s\n", t);
    free(t);
    static const int64_t gaps[2][3] = {{5, 7, 1}, {1, 3, 1}};
    t = sliced_gradient_ir(8, gaps, 2);
    /* [0,1) [1,3) [3,5) [5,7) [7,8): three zero fillers between the two pieces */
    CHECK(t && count_of(t, "concatenate(") == 1 && count_of(t, "pad(") == 0);
    CHECK(t && strstr(t, "} : f32[2,8]") != NULL);
    free(t);
    static const int64_t overlap[2][3] = {{0, 4, 1}, {3, 6, 1}};
    t = sliced_gradient_ir(6, overlap, 2);
    CHECK(t && count_of(t, "concatenate(") == 0 && count_of(t, "pad(") == 2);
    free(t);
    static const int64_t strided[2][3] = {{0, 6, 2}, {1, 6, 2}};
    t = sliced_gradient_ir(6, strided, 2);
    CHECK(t && count_of(t, "concatenate(") == 0 && count_of(t, "pad(") == 2);
    free(t);
}

int main(void)
{
    test_square();
    test_tanh_matmul_capture();
    test_broadcast_and_independent();
    test_relu_gradient();
    test_stop_gradient();
    test_empty_windows();
    test_empty_concatenate();
    test_empty_batch_pooling();
    test_extreme_amounts();
    test_two_grad_calls();
    test_aux_and_intermediate();
    test_sgd_update();
    test_nested_is_rejected();
    test_wrt_a_gradient();
    test_softmax_inner_wrt();
    test_finite_differences();
    test_every_op_has_a_rule();
    test_dce();
    test_slice_pieces_concatenate();
    return tu_finish("test_autodiff");
}
