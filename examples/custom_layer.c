/* custom_layer.c: writing your own layer.
 *
 * A layer is an rf_layer_type (a name, a forward function, optionally a
 * describe function) plus named arrays. This example defines Scale(n), a
 * learnable per-feature scale y = x .* s with s [n] starting at ones (Flux's
 * Scale without its bias), puts it in a Chain after a Dense layer, moves the
 * model to the compute device, compiles its forward pass with
 * rf_compile_model and runs it.
 *
 * Because the library walks a model generically (rf_model_to, rf_model_visit,
 * optimisers, checkpoints, summaries), a user layer only writes its forward
 * function: the rest works for it unchanged.
 *
 * Every call is checked; on failure the example prints rf_errmsg() and exits 1.
 */
#include <stdio.h>

#include "reflux.h"

/* ---- The layer ---------------------------------------------------------------------- */

/* Plain configuration bytes: copied when the model moves between devices. */
struct scale_config {
    int64_t n;
};

/* y = x .* s: x [N, n], s [n] broadcast over the batch. rf_model_param
 * captures s in x's trace, so the compiled program reads its current value. */
static rf_tensor *scale_forward(rf_model *m, rf_tensor *x)
{
    const struct scale_config *c = rf_model_config(m);
    if (rf_tensor_dim(x, -1) != c->n) {
        rf_trace_fail(rf_tensor_trace(x), RF_E_SHAPE, "Scale(%lld): input has %lld features",
                      (long long)c->n, (long long)rf_tensor_dim(x, -1));
        return NULL;
    }
    return rf_mul(x, rf_model_param(m, rf_tensor_trace(x), 0));
}

/* What summaries print inside "Scale(...)". */
static void scale_describe(const rf_model *m, char *buf, size_t n)
{
    const struct scale_config *c = rf_model_config(m);
    snprintf(buf, n, "%lld", (long long)c->n);
}

static const rf_layer_type scale_type = {"Scale", scale_forward, scale_describe};

/* Scale(n): a new layer on the host with s = ones(n). Owned; NULL on failure. */
static rf_model *scale_layer(int64_t n)
{
    struct scale_config c = {n};
    rf_model *m = rf_model_new(&scale_type, &c, sizeof c);
    if (!m)
        return NULL;
    /* The model takes over the array, also on failure. */
    if (rf_model_add_param(m, "scale", rf_ones(RF_F32, RF_SHAPE(n))) != RF_OK) {
        rf_model_free(m);
        return NULL;
    }
    return m;
}

/* ---- Using it --------------------------------------------------------------------------- */

static int fail(const char *what)
{
    fprintf(stderr, "custom_layer: %s failed: %s\n", what, rf_errmsg());
    return 1;
}

int main(void)
{
    int rc = 1;
    rf_device *dev = rf_device_default();
    rf_model *model = NULL, *model_d = NULL;
    rf_array *x = NULL, *x_d = NULL, *y_d = NULL, *y = NULL;
    rf_exec *forward = NULL;
    char summary[1024];

    rf_nn_seed(42); /* reproducible weights */
    /* rf_chain takes ownership of both layers, also when it fails. */
    model = rf_chain(rf_dense(4, 3, RF_ACT_TANH), scale_layer(3));
    if (!model) {
        rc = fail("building the model");
        goto done;
    }
    rf_model_summary(model, summary, sizeof summary);
    printf("%s", summary);

    if (!(model_d = rf_model_to(model, dev))) {
        rc = fail("rf_model_to");
        goto done;
    }
    if (!(x = rf_randn(RF_F32, RF_SHAPE(2, 4), 1)) || !(x_d = rf_array_to(x, dev))) {
        rc = fail("making x");
        goto done;
    }
    /* The model is the callee: the executable takes only x. */
    if (rf_compile_model(model_d, x_d, &forward) != RF_OK) {
        rc = fail("rf_compile_model");
        goto done;
    }
    if (rf_exec_run(forward, &x_d, 1, &y_d, 1) != RF_OK) {
        rc = fail("rf_exec_run");
        goto done;
    }
    if (!(y = rf_array_to(y_d, rf_device_host()))) {
        rc = fail("rf_array_to(host)");
        goto done;
    }
    const float *v = rf_array_data(y);
    printf("model(x) on %s:\n", rf_device_name(dev));
    for (int i = 0; i < 2; i++)
        printf("  [%+.4f %+.4f %+.4f]\n", v[3 * i], v[3 * i + 1], v[3 * i + 2]);
    rc = 0;

done:
    rf_exec_free(forward);
    rf_array_free(y);
    rf_array_free(y_d);
    rf_array_free(x_d);
    rf_array_free(x);
    rf_model_free(model_d);
    rf_model_free(model);
    return rc;
}
