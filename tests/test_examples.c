/* test_examples.c: the first training steps of the examples' models, the
 * demo's CNN (examples/fashion_mnist.c) and the ResNet (examples/resnet_model.h)
 * at its example width, on synthetic images: logit cross-entropy with the
 * accuracy as aux output, Adam, trainmode.
 *
 * The test suite runs this file on both backends; on the compiled one with
 * RF_CHECK=1 every step is also run by the reference interpreter and compared
 * (outputs and every updated parameter, moment and running statistic), which
 * covers the convolution paths only these sizes reach (Winograd needs 3x3
 * convolutions with >= 32 channels, as the demo's second one has). Oracle of
 * its own: repeated steps on one batch must lower its loss.
 *
 * The gradients come back as outputs (rf_trainstep_withgradient), so RF_CHECK
 * compares them at full sensitivity. Adam runs with its default epsilon,
 * 1e-8: its first step maps a gradient g to lr*g/(|g| + eps), which near
 * g = 0 multiplies the last-bit difference of any two summation orders by
 * lr/eps, so both models' steps differ from the interpreter's end to end
 * (parameters 1e-5 apart, from gradients that agree to 1e-10) and RF_CHECK
 * judges them step by step, each step on the values it read (check.c;
 * RF_CHECK_STEPS=0 shows the end-to-end mismatch).
 */
#include "test_util.h"

#include "../examples/resnet_model.h"

#define STEPS 4

static rf_device *dev;

static rf_tensor *loss(rf_model *m, rf_tensor *const *batch, int n, rf_aux *aux, void *ctx)
{
    (void)n, (void)ctx;
    rf_tensor *logits = rf_apply(m, batch[0]);
    rf_aux_set(aux, "acc", rf_accuracy(logits, batch[1]));
    return rf_logitcrossentropy(logits, batch[1]);
}

/* The demo's model, as examples/fashion_mnist.c builds it. */
static rf_model *demo_cnn(void)
{
    return rf_chain(rf_conv2d(3, 3, 1, 32, RF_ACT_RELU, NULL), rf_maxpool(2, 2, 0, 0),
                    rf_conv2d(3, 3, 32, 64, RF_ACT_RELU, NULL), rf_maxpool(2, 2, 0, 0),
                    rf_flatten_layer(), rf_dense(1600, 128, RF_ACT_RELU),
                    rf_dense(128, 10, RF_ACT_IDENTITY));
}

/* Takes STEPS steps of Adam on one batch of n synthetic 28x28 images;
 * consumes host. */
static void first_steps(const char *name, rf_model *host, int64_t n, double lr)
{
    CHECK(host != NULL);
    int32_t labels[64];
    for (int64_t i = 0; i < n && i < 64; i++)
        labels[i] = (int32_t)((i * 7) % 10);
    tu_trainer t;
    if (tu_trainer_make(&t, dev, host, n, 28, 28, 11, labels, lr)) {
        rf_model *m = t.m;
        rf_opt *opt = t.opt;
        rf_array *batch[2] = {t.x, t.y};
        double first = 0, last = 0;
        for (int s = 0; s < STEPS; s++) {
            double l = NAN;
            rf_array **grads = NULL;
            int ngrads = 0;
            CHECK_OK(rf_trainstep_withgradient(loss, NULL, m, batch, 2, opt, &l, NULL, &grads,
                                               &ngrads));
            CHECK(isfinite(l) && ngrads > 0);
            for (int k = 0; k < ngrads; k++)
                rf_array_free(grads[k]);
            free(grads);
            if (s == 0)
                first = l;
            last = l;
        }
        printf("%s: loss %.5f -> %.5f over %d steps of %lld images\n", name, first, last, STEPS,
               (long long)n);
        CHECK(last < first);
    }
    tu_trainer_free(&t);
}

int main(void)
{
    dev = rf_device_cpu();
    rf_nn_seed(3);
    first_steps("demo cnn", demo_cnn(), 16, 1e-3);
    rf_nn_seed(4);
    first_steps("resnet", resnet_model(16), 8, 1e-3);
    return tu_finish("test_examples");
}
