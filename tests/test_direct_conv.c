/* test_direct_conv.c: the convolutions the compiled backend generates as
 * loops (src/backend/kir_conv.c, src/backend/cpu/render_conv.c) give the
 * interpreter's results, in every form the loops take: forwards and weight
 * gradients from 1, 3 and 8 input channels to 8 (one 8-lane vector) and 16
 * (one 16-lane vector) output channels; 3x3, 3x5 and 1x1 kernels; strides of
 * 1 and 2 in either dim; padding in either dim; rows that split into equal
 * and unequal register blocks (29 outputs as 10 + 10 + 9 and as 6 + 6 + 6
 * + 6 + 5, 15 as 5 + 5 + 5); inputs row-major, channels last or read whole;
 * results and output gradients channels last, channel-blocked and
 * row-major (RF_BLOCKED=0); epilogues of bias, relu and a residual add;
 * the input gradient of a stride-1 layer (a convolution with the flipped
 * kernel) and of strided layers (the output gradient dilated by the stride:
 * in rows only, columns only, both; with the residual's add), next to
 * convolutions that stay library calls (3 output channels, 16 input
 * channels).
 *
 * Each variant compiles a fresh copy of one model (same seed) and takes
 * three Adam steps on one batch; the suite runs this file with RF_CHECK=1,
 * which compares every step against the interpreter, and the variants must
 * agree with the library's convolutions (RF_DIRECT_CONV=0) up to summation
 * order. test_plan checks which steps become loops.
 */
#include "test_util.h"

#define STEPS 3

static rf_device *dev;

static rf_tensor *loss(rf_model *m, rf_tensor *const *batch, int n, rf_aux *aux, void *ctx)
{
    (void)n, (void)aux, (void)ctx;
    return rf_logitcrossentropy(rf_apply(m, batch[0]), batch[1]);
}

static rf_conv_opts conv_opts(int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w)
{
    rf_conv_opts o;
    memset(&o, 0, sizeof o);
    o.stride[0] = stride_h, o.stride[1] = stride_w;
    o.pad[0] = pad_h, o.pad[1] = pad_w;
    return o;
}

/* 13x29 images: 1 -> 3 (a call: 3 output channels), 3 -> 16 with a 3x5
 * kernel (rows of 29 outputs), 16 -> 8 (a call: 16 input channels), 8 -> 8
 * (its input gradient is a loop too), 8 -> 16 1x1 at stride (1, 2). */
static rf_model *odd_shapes(void)
{
    rf_nn_seed(21);
    rf_conv_opts p1 = conv_opts(1, 1, 1, 1), p12 = conv_opts(1, 1, 1, 2),
                 s21 = conv_opts(2, 1, 0, 1), s12 = conv_opts(1, 2, 0, 0);
    return rf_chain(rf_conv2d(3, 3, 1, 3, RF_ACT_RELU, &p1),
                    rf_conv2d(3, 5, 3, 16, RF_ACT_RELU, &p12),
                    rf_conv2d(3, 3, 16, 8, RF_ACT_RELU, &s21),
                    rf_conv2d(3, 3, 8, 8, RF_ACT_RELU, &p1),
                    rf_conv2d(1, 1, 8, 16, RF_ACT_RELU, &s12), rf_flatten_layer(),
                    rf_dense(16 * 6 * 15, 10, RF_ACT_IDENTITY));
}

/* 12x12 images: 1 -> 8 with bias and relu, a residual 8 -> 8 layer (its
 * add is the convolution's epilogue, forward and backward), 8 -> 16 at
 * stride 2. */
static rf_model *residual(void)
{
    rf_nn_seed(22);
    rf_conv_opts p1 = conv_opts(1, 1, 1, 1), s2 = conv_opts(2, 2, 1, 1);
    return rf_chain(rf_conv2d(3, 3, 1, 8, RF_ACT_RELU, &p1),
                    rf_skip(rf_conv2d(3, 3, 8, 8, RF_ACT_IDENTITY, &p1), RF_COMBINE_ADD),
                    rf_conv2d(3, 3, 8, 16, RF_ACT_RELU, &s2), rf_flatten_layer(),
                    rf_dense(16 * 6 * 6, 10, RF_ACT_IDENTITY));
}

typedef rf_model *(*model_fn)(void);

/* Three steps of a fresh model under the given settings; the losses in out. */
static void run_variant(model_fn model, int64_t h, int64_t w, const char *label,
                        const char *blocked, const char *direct, double *out)
{
    tu_set_env("RF_BLOCKED", blocked);
    tu_set_env("RF_DIRECT_CONV", direct);
    tu_train_steps(dev, model(), h, w, 23, loss, label, STEPS, out);
    tu_set_env("RF_BLOCKED", NULL);
    tu_set_env("RF_DIRECT_CONV", NULL);
}

static void compare_variants(model_fn model, int64_t h, int64_t w, const char *name)
{
    double laid_out[STEPS], plain[STEPS], library[STEPS];
    char label[96];
    snprintf(label, sizeof label, "%s: loops, layouts", name);
    run_variant(model, h, w, label, NULL, NULL, laid_out);
    snprintf(label, sizeof label, "%s: loops, row-major", name);
    run_variant(model, h, w, label, "0", NULL, plain);
    snprintf(label, sizeof label, "%s: library", name);
    run_variant(model, h, w, label, NULL, "0", library);
    for (int s = 0; s < STEPS; s++) {
        CHECK_NEAR(laid_out[s], library[s], 0, 1e-5);
        CHECK_NEAR(plain[s], library[s], 0, 1e-5);
    }
}

int main(void)
{
    dev = rf_device_cpu();
    compare_variants(odd_shapes, 13, 29, "odd shapes");
    compare_variants(residual, 12, 12, "residual");
    return tu_finish("test_direct_conv");
}
