/* test_seed.c: the product document's first example (a manually compiled
 * Chain(Dense(4=>8, tanh), Dense(8=>2)) forward pass and training step),
 * written with raw ops through the public API only, on the CPU device.
 *
 * Checked against a plain-C forward pass and a hand-written gradient step:
 * capture by reference (in-place writes and rf_assign updates are seen by
 * the next run), rf_jit, the shape check on run, and 50 steps of gradient
 * descent lowering the loss. Does not test layers or optimisers (later
 * milestones) nor any backend other than the default one.
 */
#include "test_util.h"

#define N 16
#define IN 4
#define HID 8
#define OUT 2

/* The network's parameters as CPU device arrays (what rf_capture takes). */
struct net {
    rf_array *w1, *b1, *w2, *b2; /* [8,4], [8], [2,8], [2] */
};

/* Host copies of the parameters for the C oracle. */
struct host_net {
    float w1[HID * IN], b1[HID], w2[OUT * HID], b2[OUT];
};

/* ---- The plain-C oracle ------------------------------------------------------------ */

/* y[n, o] = sum_i x[n, i] * w[o, i] + b[o] (PyTorch/Flux layout: y = x W^T + b). */
static void c_linear(const double *x, const float *w, const float *b, int n, int in, int out,
                     double *y)
{
    for (int r = 0; r < n; r++)
        for (int o = 0; o < out; o++) {
            double acc = b[o];
            for (int i = 0; i < in; i++)
                acc += x[r * in + i] * (double)w[o * in + i];
            y[r * out + o] = acc;
        }
}

/* Forward pass in double: h = tanh(x w1^T + b1), y = h w2^T + b2. */
static void c_forward(const struct host_net *p, const float *xf, double *h, double *y)
{
    double x[N * IN];
    for (int i = 0; i < N * IN; i++)
        x[i] = xf[i];
    c_linear(x, p->w1, p->b1, N, IN, HID, h);
    for (int i = 0; i < N * HID; i++)
        h[i] = tanh(h[i]);
    c_linear(h, p->w2, p->b2, N, HID, OUT, y);
}

/* One gradient-descent step on mse = mean((y - t)^2) over all N*OUT elements.
 * Returns the loss before the step; updates p (in double, then rounded). */
static double c_train_step(struct host_net *p, const float *x, const float *target, double lr)
{
    double h[N * HID], y[N * OUT], dy[N * OUT], dz[N * HID];
    double gw1[HID * IN] = {0}, gb1[HID] = {0}, gw2[OUT * HID] = {0}, gb2[OUT] = {0};
    c_forward(p, x, h, y);
    double loss = 0;
    for (int i = 0; i < N * OUT; i++) {
        double d = y[i] - target[i];
        loss += d * d;
        dy[i] = 2.0 * d / (N * OUT);
    }
    loss /= N * OUT;
    for (int r = 0; r < N; r++) {
        for (int o = 0; o < OUT; o++) {
            gb2[o] += dy[r * OUT + o];
            for (int j = 0; j < HID; j++)
                gw2[o * HID + j] += dy[r * OUT + o] * h[r * HID + j];
        }
        for (int j = 0; j < HID; j++) {
            double dh = 0;
            for (int o = 0; o < OUT; o++)
                dh += dy[r * OUT + o] * (double)p->w2[o * HID + j];
            dz[r * HID + j] = dh * (1.0 - h[r * HID + j] * h[r * HID + j]);
        }
        for (int j = 0; j < HID; j++) {
            gb1[j] += dz[r * HID + j];
            for (int i = 0; i < IN; i++)
                gw1[j * IN + i] += dz[r * HID + j] * (double)x[r * IN + i];
        }
    }
    for (int i = 0; i < HID * IN; i++)
        p->w1[i] = (float)(p->w1[i] - lr * gw1[i]);
    for (int i = 0; i < HID; i++)
        p->b1[i] = (float)(p->b1[i] - lr * gb1[i]);
    for (int i = 0; i < OUT * HID; i++)
        p->w2[i] = (float)(p->w2[i] - lr * gw2[i]);
    for (int i = 0; i < OUT; i++)
        p->b2[i] = (float)(p->b2[i] - lr * gb2[i]);
    return loss;
}

/* ---- Traced functions ------------------------------------------------------------------ */

/* x W^T + b with raw ops: dot_general contracting x's dim 1 with w's dim 1,
 * then a broadcasting add of the bias. */
static rf_tensor *raw_linear(rf_tensor *x, rf_tensor *w, rf_tensor *b)
{
    const int64_t lc[1] = {1}, rc[1] = {1};
    return rf_add(rf_dot_general(x, w, NULL, NULL, 0, lc, rc, 1), b);
}

static rf_tensor *traced_forward(rf_trace *t, struct net *n, rf_tensor *x)
{
    rf_tensor *h = rf_tanh(raw_linear(x, rf_capture(t, n->w1), rf_capture(t, n->b1)));
    return raw_linear(h, rf_capture(t, n->w2), rf_capture(t, n->b2));
}

/* The model is the callee: its weights are captured, x is the only argument. */
static void forward_fn(rf_trace *t, void *ctx)
{
    rf_return(t, traced_forward(t, ctx, rf_arg(t, 0)));
}

/* The same forward pass written with rf_linear, for comparison. */
static void forward_linear_fn(rf_trace *t, void *ctx)
{
    struct net *n = ctx;
    rf_tensor *h = rf_tanh(rf_linear(rf_arg(t, 0), rf_capture(t, n->w1), rf_capture(t, n->b1)));
    rf_return(t, rf_linear(h, rf_capture(t, n->w2), rf_capture(t, n->b2)));
}

/* w1 <- w1 * 0.5: a program with an update and no outputs. */
static void halve_w1_fn(rf_trace *t, void *ctx)
{
    struct net *n = ctx;
    rf_assign(t, n->w1, rf_mul(rf_capture(t, n->w1), rf_scalar(t, 0.5)));
}

#define LR 0.1

/* One training step: loss = mse(model(x), y); every parameter p <- p - lr * dloss/dp;
 * returns the loss (computed from the old parameters). */
static void train_step_fn(rf_trace *t, void *ctx)
{
    struct net *n = ctx;
    rf_array *params[4] = {n->w1, n->b1, n->w2, n->b2};
    rf_tensor *wrt[4], *grads[4] = {NULL, NULL, NULL, NULL};
    for (int i = 0; i < 4; i++)
        wrt[i] = rf_capture(t, params[i]);
    rf_tensor *yhat = traced_forward(t, n, rf_arg(t, 0));
    rf_tensor *d = rf_sub(yhat, rf_arg(t, 1));
    rf_tensor *loss = rf_mean_all(rf_mul(d, d));
    if (rf_grad(t, loss, wrt, 4, grads) != RF_OK)
        return; /* the trace holds the error; rf_compile reports it */
    for (int i = 0; i < 4; i++)
        rf_assign(t, params[i], rf_sub(wrt[i], rf_mul_s(grads[i], LR)));
    rf_return(t, loss);
}

/* ---- Helpers ------------------------------------------------------------------------------ */

static void fill_normal(float *p, int n, unsigned seed, double scale)
{
    /* A small deterministic generator (LCG + Box-Muller) independent of reflux. */
    uint64_t s = 0x9E3779B97F4A7C15ull * (seed + 1);
    for (int i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        double u1 = ((double)(s >> 11) + 1.0) / 9007199254740993.0;
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        double u2 = (double)(s >> 11) / 9007199254740992.0;
        p[i] = (float)(scale * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
    }
}

static rf_array *cpu_array(const float *data, const int64_t *dims, int rank)
{
    rf_array *a = rf_array_new(rf_device_cpu(), RF_F32, dims, rank, data);
    CHECK(a != NULL);
    if (!a)
        fprintf(stderr, "rf_array_new: %s\n", rf_errmsg());
    return a;
}

static void read_f32(const rf_array *a, float *dst, size_t n)
{
    CHECK(a != NULL);
    if (a)
        CHECK_OK(rf_array_read(a, dst, n * sizeof(float)));
}

/* Checks out (an f32 [N, OUT] array) against ref within a float tolerance. */
static void check_output(const rf_array *y, const double *ref)
{
    float got[N * OUT];
    CHECK(y != NULL);
    if (!y)
        return;
    CHECK(rf_array_dtype(y) == RF_F32);
    CHECK(rf_array_rank(y) == 2);
    CHECK(rf_array_dims(y)[0] == N && rf_array_dims(y)[1] == OUT);
    CHECK(rf_array_device(y) == rf_device_cpu());
    read_f32(y, got, N * OUT);
    for (int i = 0; i < N * OUT; i++)
        CHECK_NEAR(got[i], ref[i], 1e-5, 1e-5);
}

static void make_net(struct net *n, const struct host_net *p)
{
    n->w1 = cpu_array(p->w1, RF_SHAPE(HID, IN));
    n->b1 = cpu_array(p->b1, RF_SHAPE(HID));
    n->w2 = cpu_array(p->w2, RF_SHAPE(OUT, HID));
    n->b2 = cpu_array(p->b2, RF_SHAPE(OUT));
}

static void free_net(struct net *n)
{
    rf_array_free(n->w1);
    rf_array_free(n->b1);
    rf_array_free(n->w2);
    rf_array_free(n->b2);
}

static void init_host_net(struct host_net *p)
{
    fill_normal(p->w1, HID * IN, 1, 0.5);
    fill_normal(p->b1, HID, 2, 0.1);
    fill_normal(p->w2, OUT * HID, 3, 0.5);
    fill_normal(p->b2, OUT, 4, 0.1);
}

/* ---- Tests ------------------------------------------------------------------------------- */

/* Compile once, run, compare; mutate weights in place and via rf_assign; jit; bad batch. */
static void test_forward(void)
{
    struct host_net p;
    struct net n;
    float x[N * IN];
    double h[N * HID], ref[N * OUT];
    init_host_net(&p);
    make_net(&n, &p);
    fill_normal(x, N * IN, 5, 1.0);
    rf_array *xd = cpu_array(x, RF_SHAPE(N, IN));

    rf_exec *fwd = NULL;
    CHECK_OK(rf_compile(forward_fn, &n, &xd, 1, &fwd));
    CHECK(fwd != NULL);
    if (!fwd) {
        free_net(&n);
        rf_array_free(xd);
        return;
    }
    CHECK(rf_exec_n_args(fwd) == 1);
    CHECK(rf_exec_n_outputs(fwd) == 1);
    CHECK(rf_exec_n_updates(fwd) == 0);
    CHECK(rf_exec_output_dtype(fwd, 0) == RF_F32);
    CHECK(rf_exec_output_rank(fwd, 0) == 2);
    CHECK(rf_exec_device(fwd) == rf_device_cpu());

    /* First call: the oracle. */
    rf_array *y = NULL;
    c_forward(&p, x, h, ref);
    CHECK_OK(rf_exec_run(fwd, &xd, 1, &y, 1));
    check_output(y, ref);
    rf_array_free(y);
    y = NULL;

    /* Change one weight in place on the device: the next call sees it. */
    p.w2[3] += 1.0f;
    p.b1[0] -= 0.25f;
    CHECK_OK(rf_array_write(n.w2, p.w2, sizeof p.w2));
    CHECK_OK(rf_array_write(n.b1, p.b1, sizeof p.b1));
    c_forward(&p, x, h, ref);
    CHECK_OK(rf_exec_run(fwd, &xd, 1, &y, 1));
    check_output(y, ref);
    rf_array_free(y);
    y = NULL;

    /* Another executable updates w1 <- w1 * 0.5: the forward sees the update. */
    rf_exec *halve = NULL;
    rf_compile_opts opts = {.device = rf_device_cpu(), .name = "halve_w1"};
    CHECK_OK(rf_compile_with(halve_w1_fn, &n, NULL, 0, &opts, &halve));
    CHECK(halve != NULL);
    if (halve) {
        CHECK(rf_exec_n_outputs(halve) == 0);
        CHECK(rf_exec_n_updates(halve) == 1);
        CHECK_OK(rf_exec_run(halve, NULL, 0, NULL, 0));
        for (int i = 0; i < HID * IN; i++)
            p.w1[i] *= 0.5f;
        float w1_now[HID * IN];
        read_f32(n.w1, w1_now, HID * IN);
        for (int i = 0; i < HID * IN; i++)
            CHECK_NEAR(w1_now[i], p.w1[i], 0, 1e-7);
        c_forward(&p, x, h, ref);
        CHECK_OK(rf_exec_run(fwd, &xd, 1, &y, 1));
        check_output(y, ref);
        rf_array_free(y);
        y = NULL;
        rf_exec_free(halve);
    }

    /* rf_jit of the same function gives the same result; so does rf_linear. */
    CHECK_OK(rf_jit(forward_fn, &n, &xd, 1, &y, 1));
    check_output(y, ref);
    rf_array_free(y);
    y = NULL;
    CHECK_OK(rf_jit(forward_linear_fn, &n, &xd, 1, &y, 1));
    check_output(y, ref);
    rf_array_free(y);
    y = NULL;

    /* A batch of another size: the executable is specialised to [16,4]. */
    float x8[8 * IN];
    fill_normal(x8, 8 * IN, 6, 1.0);
    rf_array *x8d = cpu_array(x8, RF_SHAPE(8, IN));
    rf_clear_error();
    CHECK_STATUS(rf_exec_run(fwd, &x8d, 1, &y, 1), RF_E_SHAPE);
    CHECK_MSG("f32[16,4]");
    CHECK_MSG("f32[8,4]");
    CHECK(y == NULL);
    rf_array_free(y);
    rf_array_free(x8d);

    rf_exec_free(fwd);
    rf_array_free(xd);
    free_net(&n);
}

/* A compiled train step: gradient descent on mse, matching the C oracle. */
static void test_train_step(void)
{
    struct host_net p, ref_p;
    struct net n;
    float x[N * IN], target[N * OUT];
    init_host_net(&p);
    ref_p = p;
    make_net(&n, &p);
    fill_normal(x, N * IN, 7, 1.0);
    fill_normal(target, N * OUT, 8, 1.0);
    rf_array *args[2] = {cpu_array(x, RF_SHAPE(N, IN)), cpu_array(target, RF_SHAPE(N, OUT))};

    rf_exec *step = NULL;
    CHECK_OK(rf_compile(train_step_fn, &n, args, 2, &step));
    CHECK(step != NULL);
    if (!step) {
        free_net(&n);
        rf_array_free(args[0]);
        rf_array_free(args[1]);
        return;
    }
    CHECK(rf_exec_n_args(step) == 2);
    CHECK(rf_exec_n_outputs(step) == 1);
    CHECK(rf_exec_n_updates(step) == 4);
    CHECK(rf_exec_output_rank(step, 0) == 0);

    double first = NAN, last = NAN;
    for (int it = 0; it < 50; it++) {
        rf_array *l = NULL;
        rf_status st = rf_exec_run(step, args, 2, &l, 1);
        CHECK_OK(st);
        if (st != RF_OK)
            break;
        double v = rf_to_number(l);
        rf_array_free(l);
        CHECK(isfinite(v));
        if (it == 0) {
            first = v;
            /* The first step against the hand-written gradient descent. */
            double ref_loss = c_train_step(&ref_p, x, target, LR);
            CHECK_NEAR(v, ref_loss, 1e-7, 1e-5);
            float got[HID * IN];
            read_f32(n.w1, got, HID * IN);
            for (int i = 0; i < HID * IN; i++)
                CHECK_NEAR(got[i], ref_p.w1[i], 1e-7, 1e-5);
            read_f32(n.b1, got, HID);
            for (int i = 0; i < HID; i++)
                CHECK_NEAR(got[i], ref_p.b1[i], 1e-7, 1e-5);
            read_f32(n.w2, got, OUT * HID);
            for (int i = 0; i < OUT * HID; i++)
                CHECK_NEAR(got[i], ref_p.w2[i], 1e-7, 1e-5);
            read_f32(n.b2, got, OUT);
            for (int i = 0; i < OUT; i++)
                CHECK_NEAR(got[i], ref_p.b2[i], 1e-7, 1e-5);
            /* The step really changed the weights. */
            CHECK(memcmp(got, p.b2, sizeof p.b2) != 0);
        }
        last = v;
    }
    printf("train step: loss %g -> %g after 50 steps\n", first, last);
    CHECK(last < first);
    CHECK(last < 0.9 * first);

    rf_exec_free(step);
    rf_array_free(args[0]);
    rf_array_free(args[1]);
    free_net(&n);
}

int main(void)
{
    test_forward();
    test_train_step();
    return tu_finish("test_seed");
}
