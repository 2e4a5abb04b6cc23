/* test_layouts.c: training steps whose activations the compiled backend
 * keeps in a convolution's layout (src/backend/layout.c) give the interpreter's
 * results, on every path that touches the layout: the convolutions reading
 * and writing it directly, the services' reorders around a convolution that
 * does not take it (RF_CONV_PATH=im2col), winograd.c's convolutions reading
 * and writing every layout, views of blocked buffers and the result in its
 * layout with the bias and relu applied (RF_CONV_PATH=winograd: every 3x3
 * stride-1 convolution and 3x3 weight gradient), the max-pool gradients unrolled
 * (src/passes/pools.c) and, with RF_UNROLL_POOLS=0, the native kernel's 2x2
 * and general (3x3 windows) blocked paths, a pool whose result is row-major (it
 * feeds the dense layer), and windows that leave a row and a column
 * uncovered (5x5 pooled by 2); overlapping, padded pools (3x3 stride 2
 * pad 1 and stride 1 pad 1: the native kernel's gather path, blocked and
 * row-major); a GroupNorm between convolutions, whose input gradient is
 * computed from row-major values and written blocked; and a narrow ResNet, whose blocked,
 * channels-last and row-major values meet at BatchNorm, strided
 * convolutions and residual adds.
 *
 * Each variant compiles a fresh copy of one model (same seed) and takes
 * three Adam steps on one batch; the suite runs this file with RF_CHECK=1,
 * which compares every step against the interpreter, and the variants must
 * agree with each other: blocked or not, the steps compute the same values
 * up to summation order. Adam's epsilon is 1e-4 for the reason
 * test_examples.c gives.
 */
#include "test_util.h"

#include "../examples/resnet_model.h"

#define STEPS 3

static rf_device *dev;

static rf_tensor *loss(rf_model *m, rf_tensor *const *batch, int n, rf_aux *aux, void *ctx)
{
    (void)n, (void)aux, (void)ctx;
    return rf_logitcrossentropy(rf_apply(m, batch[0]), batch[1]);
}

/* 24x24 -> conv 22x22 (16) -> pool 3x3 -> 7x7 -> conv 5x5 (16) -> pool 2x2
 * -> 2x2 (row 4 and column 4 uncovered) -> dense. */
static rf_model *pooled_cnn(void)
{
    rf_nn_seed(9);
    return rf_chain(rf_conv2d(3, 3, 1, 16, RF_ACT_RELU, NULL), rf_maxpool(3, 3, 0, 0),
                    rf_conv2d(3, 3, 16, 16, RF_ACT_RELU, NULL), rf_maxpool(2, 2, 0, 0),
                    rf_flatten_layer(), rf_dense(16 * 2 * 2, 10, RF_ACT_IDENTITY));
}

/* 24x24 -> conv 22x22 (16) -> pool 3x3 stride 2 pad 1 (ImageNet's stem
 * pool) -> 11x11 -> conv 9x9 (16) -> pool 3x3 stride 1 pad 1 -> 9x9 -> pool
 * 3x3 -> 3x3 -> dense: overlapping, padded windows (the native kernel's
 * gather path, blocked where the convolutions' values are). */
static rf_model *overlapping_cnn(void)
{
    rf_nn_seed(11);
    return rf_chain(rf_conv2d(3, 3, 1, 16, RF_ACT_RELU, NULL), rf_maxpool(3, 3, 2, 1),
                    rf_conv2d(3, 3, 16, 16, RF_ACT_RELU, NULL), rf_maxpool(3, 3, 1, 1),
                    rf_maxpool(3, 3, 0, 0), rf_flatten_layer(),
                    rf_dense(16 * 3 * 3, 10, RF_ACT_IDENTITY));
}

/* The ResNet at width 8 on 24x24 images: its 16- and 32-channel activations
 * are blocked and its 8-channel ones channels last, with BatchNorm's
 * reductions, strided and 1x1 convolutions and residual adds between them. */
static rf_model *narrow_resnet(void)
{
    rf_nn_seed(10);
    return resnet_model(8);
}

/* 24x24 -> conv 22x22 (16) -> GroupNorm(16, 4) -> conv 1x1 (16) -> pool 2x2
 * -> dense: the GroupNorm computes over [N, 4, 4, H, W] reshapes of a
 * row-major value, and its input gradient, read by the 1x1 convolution's
 * weight gradient, is blocked: its loop walks it row-major (kir_lower.c,
 * walks_plain_input), reading each group's statistics once per row. */
static rf_model *grouped_cnn(void)
{
    rf_nn_seed(12);
    return rf_chain(rf_conv2d(3, 3, 1, 16, RF_ACT_RELU, NULL), rf_groupnorm(16, 4),
                    rf_conv2d(1, 1, 16, 16, RF_ACT_RELU, NULL), rf_maxpool(2, 2, 0, 0),
                    rf_flatten_layer(), rf_dense(16 * 11 * 11, 10, RF_ACT_IDENTITY));
}

typedef rf_model *(*model_fn)(void);

/* Three steps of a fresh model under the given settings; the losses in out. */
static void run_variant(model_fn model, const char *label, const char *blocked,
                        const char *conv_path, const char *unroll_pools, double *out)
{
    tu_set_env("RF_BLOCKED", blocked);
    tu_set_env("RF_CONV_PATH", conv_path);
    tu_set_env("RF_UNROLL_POOLS", unroll_pools);
    tu_train_steps(dev, model(), 24, 24, 17, loss, label, STEPS, out);
    tu_set_env("RF_BLOCKED", NULL);
    tu_set_env("RF_CONV_PATH", NULL);
    tu_set_env("RF_UNROLL_POOLS", NULL);
}

static void forward_fn(rf_trace *t, void *ctx) { rf_return(t, rf_apply(ctx, rf_arg(t, 0))); }

/* The logits of a fresh pooled_cnn on 8 seeded images, from a forward
 * program (the evaluation's: its flattened pool is computed from the blocked
 * activation in the blocked order and stored row-major), into out[80]. */
static void forward_variant(const char *label, const char *blocked, float *out)
{
    tu_set_env("RF_BLOCKED", blocked);
    rf_model *host = pooled_cnn(), *m = host ? rf_model_to(host, dev) : NULL;
    rf_array *xh = rf_rand(RF_F32, RF_SHAPE(8, 1, 24, 24), 17);
    rf_array *x = xh ? rf_array_to(xh, dev) : NULL, *y = NULL;
    CHECK(m && x);
    if (m && x) {
        CHECK_OK(rf_jit(forward_fn, m, &x, 1, &y, 1));
        CHECK(y && rf_array_numel(y) == 80);
        if (y && rf_array_numel(y) == 80)
            CHECK_OK(rf_array_read(y, out, 80 * sizeof(float)));
    }
    printf("%s: logit[0] %.7f\n", label, (double)out[0]);
    rf_array_free(y);
    rf_array_free(x);
    rf_array_free(xh);
    rf_model_free(m);
    rf_model_free(host);
    tu_set_env("RF_BLOCKED", NULL);
}

int main(void)
{
    dev = rf_device_cpu();
    double blocked[STEPS], reordered[STEPS], native[STEPS], plain[STEPS], wino[STEPS];
    run_variant(pooled_cnn, "cnn: blocked", NULL, NULL, NULL, blocked);
    run_variant(pooled_cnn, "cnn: blocked, im2col convolutions", NULL, "im2col", NULL,
                reordered);
    run_variant(pooled_cnn, "cnn: blocked, winograd.c's convolutions", NULL, "winograd", NULL,
                wino);
    run_variant(pooled_cnn, "cnn: blocked, native max-pool gradients", NULL, NULL, "0", native);
    run_variant(pooled_cnn, "cnn: row-major", "0", NULL, NULL, plain);
    for (int s = 0; s < STEPS; s++) {
        CHECK_NEAR(blocked[s], plain[s], 0, 1e-5);
        CHECK_NEAR(reordered[s], plain[s], 0, 1e-5);
        CHECK_NEAR(native[s], plain[s], 0, 1e-5);
        CHECK_NEAR(wino[s], plain[s], 0, 1e-5);
    }
    double overlap_blocked[STEPS], overlap_plain[STEPS];
    run_variant(overlapping_cnn, "overlapping pools: blocked", NULL, NULL, NULL, overlap_blocked);
    run_variant(overlapping_cnn, "overlapping pools: row-major", "0", NULL, NULL, overlap_plain);
    for (int s = 0; s < STEPS; s++)
        CHECK_NEAR(overlap_blocked[s], overlap_plain[s], 0, 1e-5);
    double grouped_blocked[STEPS], grouped_plain[STEPS];
    run_variant(grouped_cnn, "group norm: blocked", NULL, NULL, NULL, grouped_blocked);
    run_variant(grouped_cnn, "group norm: row-major", "0", NULL, NULL, grouped_plain);
    for (int s = 0; s < STEPS; s++)
        CHECK_NEAR(grouped_blocked[s], grouped_plain[s], 0, 1e-5);
    float logits_blocked[80] = {0}, logits_plain[80] = {0};
    forward_variant("cnn forward: row-major", "0", logits_plain);
    forward_variant("cnn forward: blocked", NULL, logits_blocked);
    for (int i = 0; i < 80; i++)
        CHECK_NEAR(logits_blocked[i], logits_plain[i], 1e-6, 1e-5);
    double laid_out[STEPS], resnet_reordered[STEPS], resnet_plain[STEPS], resnet_wino[STEPS];
    run_variant(narrow_resnet, "resnet: blocked", NULL, NULL, NULL, laid_out);
    run_variant(narrow_resnet, "resnet: blocked, im2col convolutions", NULL, "im2col", NULL,
                resnet_reordered);
    run_variant(narrow_resnet, "resnet: blocked, winograd.c's convolutions", NULL, "winograd",
                NULL, resnet_wino);
    run_variant(narrow_resnet, "resnet: row-major", "0", NULL, NULL, resnet_plain);
    for (int s = 0; s < STEPS; s++) {
        CHECK_NEAR(laid_out[s], resnet_plain[s], 0, 1e-5);
        CHECK_NEAR(resnet_reordered[s], resnet_plain[s], 0, 1e-5);
        CHECK_NEAR(resnet_wino[s], resnet_plain[s], 0, 1e-5);
    }
    return tu_finish("test_layouts");
}
