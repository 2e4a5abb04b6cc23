/* quickstart.c: a small network compiled and trained with raw reflux ops.
 *
 * The C version of the "manually compiled example" of the Flux + Reactant
 * guide: Chain(Dense(4 => 8, tanh), Dense(8 => 2)) written as four explicit
 * weight arrays (Glorot-uniform weights, zero biases) on the compute device;
 * a forward pass compiled once with the weights captured by reference and
 * run; the same thing with rf_jit; then a training step (mse loss, gradient
 * by rf_grad, plain gradient descent by rf_assign) compiled once and run for
 * 100 epochs.
 *
 * Deliberately not shown: layers, optimisers and trainstep (later versions of
 * reflux provide them); this file uses only the core API.
 *
 * Every call is checked; on failure the example prints rf_errmsg() and
 * exits 1 after freeing what it made.
 */
#include <math.h>
#include <stdio.h>

#include "reflux.h"

/* ---- Error checks ----------------------------------------------------------- */
static void report(const char *what) { fprintf(stderr, "quickstart: %s failed: %s\n", what, rf_errmsg()); }

/* A call returning rf_status. */
#define TRY(call)                      \
    do {                               \
        if ((call) != RF_OK) {         \
            report(#call);             \
            goto done;                 \
        }                              \
    } while (0)
/* A call returning an owned pointer (NULL on failure). */
#define TRY_NEW(var, call)             \
    do {                               \
        if (((var) = (call)) == NULL) { \
            report(#call);             \
            goto done;                 \
        }                              \
    } while (0)

/* ---- The model: Dense(4 => 8, tanh) then Dense(8 => 2) -------------------------- */
struct net {
    rf_array *w1, *b1; /* [8, 4], [8] (weights are [out, in], as in Flux and PyTorch) */
    rf_array *w2, *b2; /* [2, 8], [2] */
};

/* Glorot (Xavier) uniform: U(-a, a) with a = sqrt(6 / (fan_in + fan_out)), Flux's
 * default for Dense. Drawn on the host, then moved to `dev`. Owned; NULL on failure. */
static rf_array *glorot_uniform(int64_t fan_out, int64_t fan_in, uint64_t seed, rf_device *dev) {
    rf_array *u = rf_rand(RF_F32, RF_SHAPE(fan_out, fan_in), seed); /* [0, 1) */
    if (u == NULL) return NULL;
    float *v = rf_array_data(u);
    float a = sqrtf(6.0f / (float)(fan_in + fan_out));
    for (int64_t i = 0; i < rf_array_numel(u); i++) v[i] = (2.0f * v[i] - 1.0f) * a;
    rf_array *d = rf_array_to(u, dev);
    rf_array_free(u);
    return d;
}

static rf_array *zeros_on(int64_t n, rf_device *dev) {
    rf_array *z = rf_zeros(RF_F32, RF_SHAPE(n));
    rf_array *d = z ? rf_array_to(z, dev) : NULL;
    rf_array_free(z);
    return d;
}

/* The model applied to x [N, 4] inside a trace. Capturing an array twice gives the
 * same tensor, so calling this in several places of one trace is fine. */
static rf_tensor *net_apply(rf_trace *t, const struct net *n, rf_tensor *x) {
    rf_tensor *h = rf_tanh(rf_linear(x, rf_capture(t, n->w1), rf_capture(t, n->b1)));
    return rf_linear(h, rf_capture(t, n->w2), rf_capture(t, n->b2));
}

/* forward(x) = model(x). The model is the callee: captured, not an argument. */
static void forward(rf_trace *t, void *ctx) { rf_return(t, net_apply(t, ctx, rf_arg(t, 0))); }

/* ---- The training step ------------------------------------------------------------ */
struct step {
    struct net *net;
    rf_array *lr; /* the learning rate, a captured scalar: changing it needs no recompile */
};

/* mse(yhat, y) = mean((yhat - y)^2), as Flux.mse. */
static rf_tensor *mse(rf_tensor *yhat, rf_tensor *y) {
    rf_tensor *d = rf_sub(yhat, y);
    return rf_mean_all(rf_mul(d, d));
}

/* step(x, y): loss = mse(model(x), y); every parameter p <- p - lr * dloss/dp; returns
 * the loss. The updates are applied in place when a run succeeds. */
static void train_step(rf_trace *t, void *ctx) {
    struct step *s = ctx;
    rf_array *params[4] = {s->net->w1, s->net->b1, s->net->w2, s->net->b2};
    rf_tensor *p[4], *grads[4];
    for (int i = 0; i < 4; i++) p[i] = rf_capture(t, params[i]);

    rf_tensor *loss = mse(net_apply(t, s->net, rf_arg(t, 0)), rf_arg(t, 1));
    if (rf_grad(t, loss, p, 4, grads) != RF_OK) return; /* the trace keeps the error */

    rf_tensor *lr = rf_capture(t, s->lr);
    for (int i = 0; i < 4; i++) rf_assign(t, params[i], rf_sub(p[i], rf_mul(lr, grads[i])));
    rf_return(t, loss);
}

/* Prints the first rows of a [N, 2] host array. */
static void print_rows(const char *label, rf_array *y_host, int rows) {
    const float *v = rf_array_data(y_host);
    printf("%s", label);
    for (int i = 0; i < rows; i++) printf(" [%+.4f %+.4f]", v[2 * i], v[2 * i + 1]);
    printf(" ...\n");
}

int main(void) {
    int rc = 1;
    rf_device *dev = rf_device_default(); /* CUDA if usable, else the CPU */
    struct net net = {0};
    rf_array *x_host = NULL, *yt_host = NULL, *x = NULL, *yt = NULL, *lr_host = NULL, *lr = NULL;
    rf_array *y = NULL, *y_host = NULL, *y2 = NULL, *y2_host = NULL, *loss = NULL;
    rf_exec *fwd = NULL, *step = NULL;
    struct step s = {&net, NULL};
    rf_array *args[2] = {NULL, NULL};
    double first = NAN, last = NAN;

    printf("reflux %s on %s\n", rf_version(), rf_device_name(dev));

    /* ---- Moving data and the model to the device ---- */
    TRY_NEW(net.w1, glorot_uniform(8, 4, 11, dev));
    TRY_NEW(net.b1, zeros_on(8, dev));
    TRY_NEW(net.w2, glorot_uniform(2, 8, 12, dev));
    TRY_NEW(net.b2, zeros_on(2, dev));
    TRY_NEW(x_host, rf_randn(RF_F32, RF_SHAPE(16, 4), 1));  /* a batch of 16, batch first */
    TRY_NEW(yt_host, rf_randn(RF_F32, RF_SHAPE(16, 2), 2)); /* targets */
    TRY_NEW(x, rf_array_to(x_host, dev));
    TRY_NEW(yt, rf_array_to(yt_host, dev));

    /* ---- 1. Compile the forward pass once, then call it ---- */
    TRY(rf_compile(forward, &net, &x, 1, &fwd)); /* weights captured by reference */
    TRY(rf_exec_run(fwd, &x, 1, &y, 1));         /* only x is passed */
    TRY_NEW(y_host, rf_array_to(y, rf_device_host()));
    print_rows("forward(x):    ", y_host, 2);

    /* rf_jit compiles, runs and frees in one go: handy for one-off calls. */
    TRY(rf_jit(forward, &net, &x, 1, &y2, 1));
    TRY_NEW(y2_host, rf_array_to(y2, rf_device_host()));
    print_rows("rf_jit(x):     ", y2_host, 2);

    /* ---- 1. A manually compiled training step ---- */
    TRY_NEW(lr_host, rf_fill(RF_F32, RF_SCALAR_SHAPE, 0.1));
    TRY_NEW(lr, rf_array_to(lr_host, dev));
    s.lr = lr;
    args[0] = x;
    args[1] = yt;
    TRY(rf_compile(train_step, &s, args, 2, &step)); /* compile once */

    for (int epoch = 1; epoch <= 100; epoch++) {
        TRY(rf_exec_run(step, args, 2, &loss, 1)); /* reuse the executable */
        last = rf_to_number(loss);
        rf_array_free(loss);
        loss = NULL;
        if (isnan(last)) {
            report("rf_to_number(loss)");
            goto done;
        }
        if (epoch == 1) first = last;
        if (epoch % 10 == 0) printf("epoch %3d  loss = %.6f\n", epoch, last);
    }

    /* The forward executable captured the weights by reference: it sees the training. */
    rf_array_free(y);
    rf_array_free(y_host);
    y = y_host = NULL;
    TRY(rf_exec_run(fwd, &x, 1, &y, 1));
    TRY_NEW(y_host, rf_array_to(y, rf_device_host()));
    print_rows("trained model: ", y_host, 2);

    if (!(last < first)) {
        fprintf(stderr, "quickstart: the loss did not go down (%g -> %g)\n", first, last);
        goto done;
    }
    printf("loss %.6f -> %.6f\n", first, last);
    rc = 0;

done:
    rf_exec_free(step);
    rf_exec_free(fwd);
    rf_array_free(loss);
    rf_array_free(y2_host);
    rf_array_free(y2);
    rf_array_free(y_host);
    rf_array_free(y);
    rf_array_free(lr);
    rf_array_free(lr_host);
    rf_array_free(yt);
    rf_array_free(x);
    rf_array_free(yt_host);
    rf_array_free(x_host);
    rf_array_free(net.b2);
    rf_array_free(net.w2);
    rf_array_free(net.b1);
    rf_array_free(net.w1);
    return rc;
}
