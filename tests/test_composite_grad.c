/* test_composite_grad.c: gradients of whole small models with respect to
 * their captured parameters, against central finite differences in float64.
 *
 *   1. logit cross-entropy of linear(flatten(tanh(conv(x) + bias))): gradient
 *      w.r.t. the conv weight and bias and the dense weight and bias, all
 *      captured CPU arrays (perturbed in place with rf_array_write between
 *      runs of a loss-only executable, which reads them by reference).
 *   2. a two-layer tanh MLP with mean squared error: gradient w.r.t. the four
 *      captured parameters and the input argument; then one SGD step program
 *      (rf_assign) whose updates must equal old - lr * gradient and whose
 *      returned loss must be computed from the old values.
 *
 * It deliberately uses the public API only.
 */
#include "test_prog.h"

#define DIMS(...) ((const int64_t[]){__VA_ARGS__})

static const double FD_EPS = 1e-6;
static const double FD_ATOL = 1e-8, FD_RTOL = 1e-5;

#define MAX_PARAMS 4

typedef struct model {
    const char *name;
    rf_array *p[MAX_PARAMS]; /* captured parameters (CPU, f64) */
    const char *pname[MAX_PARAMS];
    int np;
    rf_tensor *(*loss)(rf_trace *t, rf_tensor *const *args, struct model *m);
    bool grad_wrt_arg0; /* also differentiate w.r.t. argument 0 */
    int mode;           /* 0: loss; 1: loss + gradients; 2: loss + SGD updates */
    double lr;
} model;

/* ---- Model 1: conv -> tanh -> flatten -> dense -> logit cross-entropy ------------------- */

static rf_tensor *cnn_loss(rf_trace *t, rf_tensor *const *a, model *m)
{
    rf_tensor *wc = rf_capture(t, m->p[0]), *bc = rf_capture(t, m->p[1]);
    rf_tensor *wd = rf_capture(t, m->p[2]), *bd = rf_capture(t, m->p[3]);
    rf_conv_params cp = rf_conv_params_default(2);
    cp.pad_lo[0] = cp.pad_lo[1] = 1;
    cp.pad_hi[0] = cp.pad_hi[1] = 1;
    rf_tensor *z = rf_conv(a[0], wc, &cp);                        /* [2,3,5,5] */
    z = rf_add(z, rf_reshape(bc, RF_SHAPE(1, 3, 1, 1)));
    rf_tensor *logits = rf_linear(rf_flatten(rf_tanh(z)), wd, bd); /* [2,4] */
    rf_tensor *y = rf_onehot(a[1], 4, RF_F64);
    rf_tensor *nll = rf_neg(rf_sum(rf_mul(y, rf_logsoftmax(logits, 1)), DIMS(1), 1, false));
    return rf_mean_all(nll);
}

/* ---- Model 2: two-layer MLP with mse ------------------------------------------------- */

static rf_tensor *mlp_loss(rf_trace *t, rf_tensor *const *a, model *m)
{
    rf_tensor *w1 = rf_capture(t, m->p[0]), *b1 = rf_capture(t, m->p[1]);
    rf_tensor *w2 = rf_capture(t, m->p[2]), *b2 = rf_capture(t, m->p[3]);
    rf_tensor *h = rf_tanh(rf_linear(a[0], w1, b1));
    rf_tensor *d = rf_sub(rf_linear(h, w2, b2), a[1]);
    return rf_mean_all(rf_mul(d, d));
}

static void build_model(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n;
    model *m = u;
    rf_tensor *loss = m->loss(t, a, m);
    rf_return(t, loss);
    if (m->mode == 0)
        return;
    rf_tensor *wrt[MAX_PARAMS + 1], *g[MAX_PARAMS + 1] = {0};
    for (int i = 0; i < m->np; i++)
        wrt[i] = rf_capture(t, m->p[i]);
    int nw = m->np;
    if (m->grad_wrt_arg0)
        wrt[nw++] = a[0];
    rf_grad(t, loss, wrt, nw, g);
    if (m->mode == 1) {
        for (int i = 0; i < nw; i++)
            rf_return(t, g[i]);
        return;
    }
    for (int i = 0; i < m->np; i++)
        rf_assign(t, m->p[i], rf_sub(wrt[i], rf_mul_s(g[i], m->lr)));
}

static rf_array *rand_param(const int64_t *dims, int rank, double scale, uint64_t *rng)
{
    double v[512];
    int64_t n = tp_numel(dims, rank);
    for (int64_t i = 0; i < n; i++)
        v[i] = tp_rand(rng, -scale, scale);
    return tp_dev(RF_F64, dims, rank, v);
}

static double run_loss(rf_exec *e, rf_array *const *args, int nargs)
{
    rf_array *o = NULL;
    rf_status st = rf_exec_run(e, args, nargs, &o, 1);
    double l = st == RF_OK ? tp_scalar(o) : NAN;
    rf_array_free(o);
    return l;
}

/* FD of the loss w.r.t. every element of array `a` (a parameter or argument),
 * perturbed in place; compared with `ad`. Prints and counts one check. */
static void fd_compare(const char *model_name, const char *what, rf_array *a, rf_exec *eloss,
                       rf_array *const *args, int nargs, const rf_array *ad_arr)
{
    int64_t n = 0, nad = 0;
    double *x = tp_read(a, &n), *ad = tp_read(ad_arr, &nad);
    double max_err = 0, worst_ad = 0, worst_fd = 0;
    int64_t worst = -1;
    tu_checks++;
    if (!x || !ad || n != nad || rf_array_dtype(ad_arr) != RF_F64) {
        tu_failures++;
        fprintf(stderr, "%s: gradient of %s missing or of the wrong type/size\n", model_name,
                what);
        free(x);
        free(ad);
        return;
    }
    double *buf = malloc(sizeof(double) * (size_t)n);
    size_t nb = sizeof(double) * (size_t)n;
    for (int64_t i = 0; buf && i < n; i++) {
        memcpy(buf, x, nb);
        buf[i] = x[i] + FD_EPS;
        rf_array_write(a, buf, nb);
        double lp = run_loss(eloss, args, nargs);
        buf[i] = x[i] - FD_EPS;
        rf_array_write(a, buf, nb);
        double lm = run_loss(eloss, args, nargs);
        double fd = (lp - lm) / (2 * FD_EPS);
        double err = fabs(ad[i] - fd) / (FD_ATOL + FD_RTOL * fabs(fd));
        if (isnan(err))
            err = INFINITY; /* a NaN stays the worst instead of being replaced by the next */
        if (err > max_err) {
            max_err = err, worst = i, worst_ad = ad[i], worst_fd = fd;
        }
    }
    rf_array_write(a, x, nb);
    bool pass = max_err <= 1.0;
    printf("%s: d loss / d %-12s %4lld elements, worst element %lld: AD %.10g FD %.10g %s\n",
           model_name, what, (long long)n, (long long)worst, worst_ad, worst_fd,
           pass ? "ok" : "FAIL");
    if (!pass) {
        tu_failures++;
        fprintf(stderr, "%s: d loss / d %s element %lld: AD %.10g, FD %.10g\n", model_name, what,
                (long long)worst, worst_ad, worst_fd);
    }
    free(buf);
    free(x);
    free(ad);
}

/* Compiles the loss and loss+gradient programs, checks every gradient by FD. */
static void check_model(model *m, rf_array **args, int nargs)
{
    rf_exec *el = NULL, *eg = NULL;
    rf_array *outs[MAX_PARAMS + 2] = {0};
    int ngrad = m->np + (m->grad_wrt_arg0 ? 1 : 0);
    m->mode = 0;
    CHECK_OK(tp_compile(build_model, m, args, nargs, &el));
    m->mode = 1;
    CHECK_OK(tp_compile(build_model, m, args, nargs, &eg));
    if (el && eg) {
        CHECK(rf_exec_n_outputs(eg) == 1 + ngrad);
        CHECK_OK(rf_exec_run(eg, args, nargs, outs, 1 + ngrad));
        double l0 = tp_scalar(outs[0]);
        double l1 = run_loss(el, args, nargs);
        CHECK_NEAR(l0, l1, 0, 1e-14);
        CHECK(isfinite(l0));
        printf("%s: loss %.10g\n", m->name, l0);
        for (int i = 0; i < m->np; i++)
            if (outs[1 + i])
                fd_compare(m->name, m->pname[i], m->p[i], el, args, nargs, outs[1 + i]);
        if (m->grad_wrt_arg0 && outs[1 + m->np])
            fd_compare(m->name, "argument 0", args[0], el, args, nargs, outs[1 + m->np]);
    }
    tp_free_all(outs, MAX_PARAMS + 2);
    rf_exec_free(el);
    rf_exec_free(eg);
}

static void test_cnn(void)
{
    uint64_t rng = 4242;
    model m = {.name = "cnn", .np = 4, .loss = cnn_loss,
               .pname = {"conv weight", "conv bias", "dense weight", "dense bias"}};
    m.p[0] = rand_param(DIMS(3, 2, 3, 3), 4, 0.5, &rng);
    m.p[1] = rand_param(DIMS(3), 1, 0.5, &rng);
    m.p[2] = rand_param(DIMS(4, 75), 2, 0.3, &rng);
    m.p[3] = rand_param(DIMS(4), 1, 0.5, &rng);
    rf_array *args[2] = {rand_param(DIMS(2, 2, 5, 5), 4, 1.0, &rng),
                         tp_dev(RF_I32, DIMS(2), 1, (const double[]){3, 1})};
    check_model(&m, args, 2);
    tp_free_all(args, 2);
    tp_free_all(m.p, 4);
}

static void test_mlp(void)
{
    uint64_t rng = 777;
    model m = {.name = "mlp", .np = 4, .loss = mlp_loss, .grad_wrt_arg0 = true, .lr = 0.1,
               .pname = {"w1", "b1", "w2", "b2"}};
    m.p[0] = rand_param(DIMS(4, 3), 2, 0.8, &rng);
    m.p[1] = rand_param(DIMS(4), 1, 0.5, &rng);
    m.p[2] = rand_param(DIMS(2, 4), 2, 0.8, &rng);
    m.p[3] = rand_param(DIMS(2), 1, 0.5, &rng);
    rf_array *args[2] = {rand_param(DIMS(5, 3), 2, 1.0, &rng),
                         rand_param(DIMS(5, 2), 2, 1.0, &rng)};
    check_model(&m, args, 2);

    /* One SGD step: updates = old - lr * grad, returned loss from the old values. */
    rf_exec *eg = NULL, *es = NULL;
    rf_array *g[5] = {0}, *ls = NULL;
    double *old[4] = {0}, *grad[4] = {0};
    m.mode = 1;
    CHECK_OK(tp_compile(build_model, &m, args, 2, &eg));
    m.mode = 2;
    CHECK_OK(tp_compile(build_model, &m, args, 2, &es));
    if (eg && es) {
        CHECK(rf_exec_n_updates(es) == 4);
        CHECK_OK(rf_exec_run(eg, args, 2, g, 5));
        for (int i = 0; i < 4; i++) {
            old[i] = tp_read(m.p[i], NULL);
            grad[i] = tp_read(g[1 + i], NULL);
        }
        CHECK_OK(rf_exec_run(es, args, 2, &ls, 1));
        CHECK_NEAR(tp_scalar(ls), tp_scalar(g[0]), 0, 1e-14);
        for (int i = 0; i < 4; i++) {
            int64_t n = rf_array_numel(m.p[i]);
            double want[64];
            for (int64_t k = 0; k < n && old[i] && grad[i]; k++)
                want[k] = old[i][k] - m.lr * grad[i][k];
            char label[64];
            snprintf(label, sizeof label, "mlp SGD update of %s", m.pname[i]);
            tp_expect(label, m.p[i], RF_F64, rf_array_dims(m.p[i]), rf_array_rank(m.p[i]), want,
                      1e-14, 1e-12);
        }
        /* the step lowered the loss */
        rf_array *l2 = NULL;
        CHECK_OK(rf_exec_run(es, args, 2, &l2, 1));
        CHECK(tp_scalar(l2) < tp_scalar(ls));
        printf("mlp: SGD step loss %.10g -> %.10g\n", tp_scalar(ls), tp_scalar(l2));
        rf_array_free(l2);
    }
    for (int i = 0; i < 4; i++) {
        free(old[i]);
        free(grad[i]);
    }
    tp_free_all(g, 5);
    rf_array_free(ls);
    rf_exec_free(eg);
    rf_exec_free(es);
    tp_free_all(args, 2);
    tp_free_all(m.p, 4);
}

int main(void)
{
    test_cnn();
    test_mlp();
    return tu_finish("test_composite_grad");
}
