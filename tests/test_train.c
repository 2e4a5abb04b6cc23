/* test_train.c: withgradient, rf_update, trainstep (compile cache, aux
 * outputs, gradients, the non-finite guard, rf_adjust) and rf_train over a
 * loader, on the seed's model Chain(Dense(4 => 8, tanh), Dense(8 => 2)).
 *
 * Oracles: the manual path (rf_withgradient + rf_update compiled by hand),
 * a separately compiled rf_grad program, forward outputs reduced on the host,
 * BatchNorm's running-statistics formula computed in C, and byte snapshots of
 * every array for the guard.
 */
#include <unistd.h>

#include "test_util.h"
#include "train/train_internal.h"

#define STEPS 100

static rf_device *cpu;

/* ---- Models, data and losses ------------------------------------------------------------ */

static rf_model *seed_model_host(void)
{
    rf_nn_seed(42);
    return rf_chain(rf_dense(4, 8, RF_ACT_TANH), rf_dense(8, 2, RF_ACT_IDENTITY));
}

static rf_model *bn_model_host(void)
{
    rf_nn_seed(7);
    return rf_chain(rf_dense(4, 8, RF_ACT_IDENTITY), rf_batchnorm(8, RF_ACT_TANH),
                    rf_dense(8, 2, RF_ACT_IDENTITY));
}

/* A device array of shape [n, cols] from rf_randn(seed). */
static rf_array *randn_dev(int64_t n, int64_t cols, uint64_t seed)
{
    rf_array *h = rf_randn(RF_F32, RF_SHAPE(n, cols), seed);
    rf_array *d = rf_array_to(h, cpu);
    rf_array_free(h);
    return d;
}

static rf_tensor *mse_loss(rf_model *m, rf_tensor *const *b, int n, rf_aux *aux, void *ctx)
{
    (void)n;
    (void)aux;
    (void)ctx;
    return rf_mse(rf_apply(m, b[0]), b[1]);
}

/* mse plus two aux values: accuracy (onecold match) and the mean prediction. */
static rf_tensor *mse_aux_loss(rf_model *m, rf_tensor *const *b, int n, rf_aux *aux, void *ctx)
{
    (void)n;
    (void)ctx;
    rf_tensor *yhat = rf_apply(m, b[0]);
    rf_aux_set(aux, "acc", rf_accuracy(yhat, b[1]));
    rf_aux_set(aux, "mean_yhat", rf_mean_all(yhat));
    return rf_mse(yhat, b[1]);
}

/* records a non-scalar aux value: a trace error */
static rf_tensor *bad_aux_loss(rf_model *m, rf_tensor *const *b, int n, rf_aux *aux, void *ctx)
{
    (void)n;
    (void)ctx;
    rf_tensor *yhat = rf_apply(m, b[0]);
    rf_aux_set(aux, "rows", rf_mean(yhat, (const int64_t[]){1}, 1, false));
    return rf_mse(yhat, b[1]);
}

/* aux values of every dtype: reported as their values, as doubles */
static rf_tensor *typed_aux_loss(rf_model *m, rf_tensor *const *b, int n, rf_aux *aux,
                                 void *ctx)
{
    (void)n;
    (void)ctx;
    rf_tensor *yhat = rf_apply(m, b[0]);
    rf_trace *t = rf_tensor_trace(yhat);
    rf_aux_set(aux, "i32", rf_scalar_typed(t, RF_I32, 16));
    rf_aux_set(aux, "i64", rf_scalar_typed(t, RF_I64, -5));
    rf_aux_set(aux, "f64", rf_scalar_typed(t, RF_F64, 0.1));
    rf_aux_set(aux, "finite", rf_is_finite(rf_mean_all(yhat)));
    return rf_mse(yhat, b[1]);
}

/* returns a value of its own: the step's outputs would no longer be its own */
static rf_tensor *returning_loss(rf_model *m, rf_tensor *const *b, int n, rf_aux *aux,
                                 void *ctx)
{
    (void)n;
    (void)aux;
    (void)ctx;
    rf_tensor *yhat = rf_apply(m, b[0]);
    rf_return(rf_tensor_trace(yhat), yhat);
    return rf_mse(yhat, b[1]);
}

static rf_tensor *vector_loss(rf_model *m, rf_tensor *const *b, int n, rf_aux *aux, void *ctx)
{
    (void)n;
    (void)aux;
    (void)ctx;
    return rf_sub(rf_apply(m, b[0]), b[1]); /* not reduced: an error */
}

/* ---- Snapshots of every array of a model and optimiser ---------------------------------- */

#define MAX_SNAP 32
typedef struct snapshot {
    int n;
    rf_array *arrays[MAX_SNAP];
    size_t nbytes[MAX_SNAP];
    unsigned char *bytes[MAX_SNAP];
} snapshot;

static void snap_one(const char *path, rf_array *a, bool trainable, void *ud)
{
    (void)path;
    (void)trainable;
    snapshot *s = ud;
    if (s->n >= MAX_SNAP)
        return;
    size_t nb = rf_array_nbytes(a);
    s->arrays[s->n] = a;
    s->nbytes[s->n] = nb;
    s->bytes[s->n] = malloc(nb ? nb : 1);
    rf_array_read(a, s->bytes[s->n], nb);
    s->n++;
}

static void snap_take(snapshot *s, rf_model *m, rf_opt *opt)
{
    memset(s, 0, sizeof *s);
    rf_model_visit(m, snap_one, s);
    if (opt)
        rf_opt_visit(opt, snap_one, s);
}

/* Number of arrays whose bytes differ from the snapshot. */
static int snap_changed(const snapshot *s)
{
    int changed = 0;
    for (int i = 0; i < s->n; i++) {
        unsigned char *now = malloc(s->nbytes[i] ? s->nbytes[i] : 1);
        rf_array_read(s->arrays[i], now, s->nbytes[i]);
        changed += memcmp(now, s->bytes[i], s->nbytes[i]) != 0;
        free(now);
    }
    return changed;
}

static void snap_free(snapshot *s)
{
    for (int i = 0; i < s->n; i++)
        free(s->bytes[i]);
    s->n = 0;
}

/* ---- (1) the manual path and (2) trainstep ----------------------------------------------- */

typedef struct manual_step {
    rf_model *m;
    rf_opt *opt;
} manual_step;

static void manual_step_fn(rf_trace *t, void *ctx)
{
    manual_step *s = ctx;
    rf_tensor *batch[2] = {rf_arg(t, 0), rf_arg(t, 1)};
    rf_grads *g = NULL;
    rf_tensor *l = rf_withgradient(t, mse_loss, NULL, s->m, batch, 2, NULL, &g);
    rf_update(t, s->opt, s->m, g);
    rf_return(t, l);
}

static void test_manual_vs_trainstep(rf_model *host, rf_array *x, rf_array *y)
{
    rf_array *args[2] = {x, y};
    double manual[STEPS], cached[STEPS];

    rf_model *ma = rf_model_to(host, cpu);
    rf_opt *oa = rf_setup(rf_adam(1e-2), ma);
    CHECK(ma && oa);
    manual_step s = {ma, oa};
    rf_exec *step = NULL;
    CHECK_OK(rf_compile(manual_step_fn, &s, args, 2, &step));
    for (int i = 0; step && i < STEPS; i++) {
        rf_array *l = NULL;
        CHECK_OK(rf_exec_run(step, args, 2, &l, 1));
        manual[i] = rf_to_number(l);
        rf_array_free(l);
    }
    CHECK(manual[STEPS - 1] < 0.5 * manual[0]);
    int rises = 0;
    for (int i = 1; i < STEPS; i++)
        rises += manual[i] > manual[i - 1];
    CHECK(rises < 10);
    printf("manual path: loss %.6f -> %.6f (%d rises)\n", manual[0], manual[STEPS - 1], rises);
    rf_exec_free(step);

    rf_model *mb = rf_model_to(host, cpu);
    rf_opt *ob = rf_setup(rf_adam(1e-2), mb);
    for (int i = 0; i < STEPS; i++)
        CHECK_OK(rf_trainstep(mse_loss, NULL, mb, args, 2, ob, &cached[i], NULL));
    int mismatches = 0;
    for (int i = 0; i < STEPS; i++)
        mismatches += !(fabs(cached[i] - manual[i]) <= 1e-6 * fabs(manual[i]));
    CHECK(mismatches == 0);
    CHECK(rf_opt_steps(ob) == STEPS);
    rf_cache_stats cs = rf_model_cache_stats(mb);
    CHECK(cs.compiles == 1 && cs.hits == STEPS - 1 && cs.misses == 1 && cs.entries == 1);
    /* the step's planned memory (the interpreter plans none) */
    const char *backend = getenv("RF_BACKEND");
    CHECK(backend && !strcmp(backend, "interp") ? cs.memory == 0 : cs.memory > 0);

    /* (3) a smaller final batch compiles exactly one more step, then reuses both */
    rf_array *xs = randn_dev(8, 4, 11), *ys = randn_dev(8, 2, 12);
    rf_array *small[2] = {xs, ys};
    double l;
    CHECK_OK(rf_trainstep(mse_loss, NULL, mb, small, 2, ob, &l, NULL));
    CHECK_OK(rf_trainstep(mse_loss, NULL, mb, args, 2, ob, &l, NULL));
    CHECK_OK(rf_trainstep(mse_loss, NULL, mb, small, 2, ob, &l, NULL));
    cs = rf_model_cache_stats(mb);
    CHECK(cs.compiles == 2 && cs.entries == 2 && cs.hits == STEPS + 1);

    /* (10) rf_opt_free before the model drops its entries; the model trains on */
    rf_opt_free(ob);
    CHECK(rf_model_cache_stats(mb).entries == 0);
    rf_opt *ob2 = rf_setup(rf_descent(0.1), mb);
    CHECK_OK(rf_trainstep(mse_loss, NULL, mb, args, 2, ob2, &l, NULL));
    CHECK(rf_model_cache_stats(mb).entries == 1);
    rf_model_free(mb); /* frees the entry compiled for ob2 (ASan: no leak) */
    rf_opt_free(ob2);  /* after its model: must still work */
    rf_array_free(xs);
    rf_array_free(ys);
    rf_opt_free(oa);
    rf_model_free(ma);
}

/* ---- (4) gradients against a separately compiled rf_grad program ------------------------- */

typedef struct grad_prog {
    rf_model *m;
} grad_prog;

static void grad_fn(rf_trace *t, void *ctx)
{
    grad_prog *p = ctx;
    rf_tensor *loss = rf_mse(rf_apply(p->m, rf_arg(t, 0)), rf_arg(t, 1));
    rf_tensor *wrt[4], *out[4];
    int k = 0;
    for (int c = 0; c < 2; c++) {
        rf_model *layer = rf_model_child(p->m, c);
        for (int i = 0; i < rf_model_n_params(layer); i++)
            wrt[k++] = rf_capture(t, rf_model_param_array(layer, i));
    }
    rf_grad(t, loss, wrt, k, out);
    for (int i = 0; i < k; i++)
        rf_return(t, out[i]);
}

static void test_withgradient(rf_model *host, rf_array *x, rf_array *y)
{
    rf_array *args[2] = {x, y};
    rf_model *m = rf_model_to(host, cpu);
    rf_opt *opt = rf_setup(rf_adam(1e-2), m);
    grad_prog p = {m};
    rf_array *want[4] = {0};
    CHECK_OK(rf_jit(grad_fn, &p, args, 2, want, 4));

    double l;
    rf_array **got = NULL;
    int ng = 0;
    CHECK_OK(rf_trainstep_withgradient(mse_loss, NULL, m, args, 2, opt, &l, NULL, &got, &ng));
    CHECK(ng == 4);
    double worst = 0;
    for (int i = 0; got && i < ng && i < 4; i++) {
        CHECK(rf_array_numel(got[i]) == rf_array_numel(want[i]));
        const float *a = rf_array_data(got[i]), *b = rf_array_data(want[i]);
        for (int64_t k = 0; k < rf_array_numel(got[i]); k++) {
            double e = fabs((double)a[k] - (double)b[k]) / (1e-6 + fabs((double)b[k]));
            worst = e > worst || isnan(e) ? (isnan(e) ? INFINITY : e) : worst;
        }
    }
    CHECK(worst <= 1e-5);
    printf("trainstep_withgradient: worst relative gradient error %.3g\n", worst);
    for (int i = 0; i < ng; i++)
        rf_array_free(got[i]);
    free(got);
    for (int i = 0; i < 4; i++)
        rf_array_free(want[i]);

    /* the two step kinds are separate cache entries */
    CHECK_OK(rf_trainstep(mse_loss, NULL, m, args, 2, opt, &l, NULL));
    CHECK(rf_model_cache_stats(m).entries == 2);
    rf_opt_free(opt);
    rf_model_free(m);
}

/* ---- (5) aux outputs --------------------------------------------------------------------- */

static void test_aux(rf_model *host, rf_array *x, rf_array *y)
{
    rf_array *args[2] = {x, y};
    rf_model *m = rf_model_to(host, cpu);
    rf_opt *opt = rf_setup(rf_adam(1e-2), m);
    rf_array *yhat = NULL;
    CHECK_OK(rf_jit_model(m, x, &yhat)); /* before the step: the aux see the old weights */
    const float *ph = rf_array_data(yhat), *py = rf_array_data(y);
    double mean = 0;
    int hits = 0;
    for (int r = 0; ph && r < 16; r++) {
        mean += (double)ph[2 * r] + (double)ph[2 * r + 1];
        hits += (ph[2 * r + 1] > ph[2 * r]) == (py[2 * r + 1] > py[2 * r]);
    }
    mean /= 32;

    double l;
    rf_stats st;
    CHECK_OK(rf_trainstep(mse_aux_loss, NULL, m, args, 2, opt, &l, &st));
    CHECK(st.n == 2);
    CHECK_NEAR(rf_stats_get(&st, "acc"), hits / 16.0, 1e-6, 0);
    CHECK_NEAR(rf_stats_get(&st, "mean_yhat"), mean, 1e-6, 1e-5);
    CHECK(isnan(rf_stats_get(&st, "missing")));
    rf_array_free(yhat);

    /* a loss that is not a scalar is a trace error naming its shape */
    CHECK_STATUS(rf_trainstep(vector_loss, NULL, m, args, 2, opt, &l, NULL), RF_E_SHAPE);
    CHECK_MSG("f32[16,2]");
    CHECK_STATUS(rf_trainstep(bad_aux_loss, NULL, m, args, 2, opt, &l, NULL), RF_E_SHAPE);
    CHECK_MSG("rf_aux_set: \"rows\" must be a scalar, got f32[16]");
    snapshot before;
    snap_take(&before, m, opt);
    CHECK_STATUS(rf_trainstep(returning_loss, NULL, m, args, 2, opt, &l, NULL), RF_E_INVALID);
    CHECK_MSG("the loss function (or a layer) called rf_return 1 time;");
    CHECK(snap_changed(&before) == 0);
    snap_free(&before);
    CHECK(rf_opt_steps(opt) == 1);
    /* integer and bool aux values, with and without gradient outputs */
    for (int with_grads = 0; with_grads < 2; with_grads++) {
        rf_array **grads = NULL;
        int ng = 0;
        memset(&st, 0, sizeof st);
        if (with_grads)
            CHECK_OK(rf_trainstep_withgradient(typed_aux_loss, NULL, m, args, 2, opt, &l, &st,
                                               &grads, &ng));
        else
            CHECK_OK(rf_trainstep(typed_aux_loss, NULL, m, args, 2, opt, &l, &st));
        CHECK(st.n == 4);
        CHECK(rf_stats_get(&st, "i32") == 16 && rf_stats_get(&st, "i64") == -5);
        CHECK(rf_stats_get(&st, "f64") == 0.1 && rf_stats_get(&st, "finite") == 1);
        for (int i = 0; i < ng; i++)
            rf_array_free(grads[i]);
        free(grads);
    }
    CHECK(rf_opt_steps(opt) == 3);
    rf_opt_free(opt);
    rf_model_free(m);
}

/* ---- (6) BatchNorm statistics and (7) the non-finite guard -------------------------------- */

/* The state array of layer m whose path ends in `name`, or NULL. */
typedef struct find_state {
    const char *name;
    rf_array *found;
} find_state;

static void find_one(const char *path, rf_array *a, bool trainable, void *ud)
{
    find_state *f = ud;
    size_t np = strlen(path), nn = strlen(f->name);
    if (!trainable && np >= nn && strcmp(path + np - nn, f->name) == 0)
        f->found = a;
}

static rf_array *state_named(rf_model *m, const char *name)
{
    find_state f = {name, NULL};
    rf_model_visit(m, find_one, &f);
    return f.found;
}

static void test_batchnorm_and_guard(rf_array *x, rf_array *y)
{
    rf_model *host = bn_model_host();
    rf_model *m = rf_model_to(host, cpu);
    rf_model_free(host);
    rf_trainmode(m);
    /* Momentum, not Adam: the Dense bias before BatchNorm has a gradient that
     * is mathematically zero (normalisation removes it), so what reaches the
     * optimiser is rounding noise; Adam scales noise to full +-lr steps, which
     * would make the two backends' parameters differ by whole steps. Momentum
     * keeps noise at noise size, so both backends agree within tolerance. */
    rf_opt *opt = rf_setup(rf_momentum(1e-2, 0.9), m);
    rf_model *dense = rf_model_child(m, 0), *bn = rf_model_child(m, 1);
    const float *W = rf_array_data(rf_model_param_array(dense, 0));
    const float *b = rf_array_data(rf_model_param_array(dense, 1));
    const float *px = rf_array_data(x);

    /* batch statistics of the first layer's output, computed in C before the step */
    double want_mean[8], want_var[8];
    for (int j = 0; j < 8; j++) {
        double h[16], s = 0, ss = 0;
        for (int r = 0; r < 16; r++) {
            h[r] = b[j];
            for (int k = 0; k < 4; k++)
                h[r] += (double)W[j * 4 + k] * px[r * 4 + k];
            s += h[r];
        }
        double mu = s / 16;
        for (int r = 0; r < 16; r++)
            ss += (h[r] - mu) * (h[r] - mu);
        want_mean[j] = 0.1 * mu;                   /* 0.9 * 0 + 0.1 * mean */
        want_var[j] = 0.9 * 1.0 + 0.1 * ss / 15.0; /* unbiased */
    }
    rf_array *args[2] = {x, y};
    double l;
    CHECK_OK(rf_trainstep(mse_loss, NULL, m, args, 2, opt, &l, NULL));
    const float *rm = rf_array_data(state_named(bn, "running_mean"));
    const float *rv = rf_array_data(state_named(bn, "running_var"));
    for (int j = 0; j < 8; j++) {
        CHECK_NEAR(rm[j], want_mean[j], 1e-6, 1e-5);
        CHECK_NEAR(rv[j], want_var[j], 1e-6, 1e-5);
    }

    /* a batch with a NaN changes nothing, bit for bit */
    float xn[64];
    rf_array_read(x, xn, sizeof xn);
    xn[5] = NAN;
    rf_array *xh = rf_array_from(RF_F32, RF_SHAPE(16, 4), xn);
    rf_array *xnan = rf_array_to(xh, cpu);
    rf_array_free(xh);
    snapshot before;
    snap_take(&before, m, opt);
    CHECK(before.n >= 8); /* 6 parameters, 2 statistics, optimiser state */
    int64_t steps = rf_opt_steps(opt);
    rf_array *bad[2] = {xnan, y};
    l = 0;
    CHECK_STATUS(rf_trainstep(mse_loss, NULL, m, bad, 2, opt, &l, NULL), RF_E_DOMAIN);
    CHECK_MSG("rf_trainstep: loss is NaN; no update was applied");
    CHECK(isnan(l));
    CHECK(snap_changed(&before) == 0);
    CHECK(rf_opt_steps(opt) == steps);
    /* and the next good step trains again */
    CHECK_OK(rf_trainstep(mse_loss, NULL, m, args, 2, opt, &l, NULL));
    CHECK(snap_changed(&before) > 0);
    snap_free(&before);

    /* host batches are rejected before anything runs */
    float xs[64];
    rf_array_read(x, xs, sizeof xs);
    rf_array *xhost = rf_array_from(RF_F32, RF_SHAPE(16, 4), xs);
    rf_array *hostb[2] = {xhost, y};
    CHECK_STATUS(rf_trainstep(mse_loss, NULL, m, hostb, 2, opt, &l, NULL), RF_E_DEVICE);
    CHECK_MSG("rf_trainstep: batch[0] f32[16,4] lives on the host; move batches to the device");
    /* and so is a model left on the host (before its optimiser is looked at) */
    rf_model *mhost = rf_chain(rf_dense(4, 2, RF_ACT_IDENTITY));
    CHECK(mhost != NULL);
    CHECK_STATUS(rf_trainstep(mse_loss, NULL, mhost, args, 2, opt, &l, NULL), RF_E_DEVICE);
    CHECK_MSG("rf_trainstep: the model has arrays on the host; move it with rf_model_to");
    rf_model_free(mhost);
    rf_array_free(xhost);
    rf_array_free(xnan);
    rf_opt_free(opt);
    rf_model_free(m);
}

/* A NaN in the data reaches the loss through a relu convolution and relu
 * matmuls large enough for oneDNN's own kernels (whose relu post-op would
 * turn it into 0), so the step is refused as the interpreter refuses it. */
static void test_nan_through_relu(void)
{
    rf_model *host = rf_chain(rf_conv2d(3, 3, 16, 32, RF_ACT_RELU, NULL), rf_flatten_layer(),
                              rf_dense(32 * 6 * 6, 256, RF_ACT_RELU),
                              rf_dense(256, 2, RF_ACT_IDENTITY));
    rf_model *m = host ? rf_model_to(host, cpu) : NULL;
    rf_model_free(host);
    rf_opt *opt = m ? rf_setup(rf_descent(1e-2), m) : NULL;
    rf_array *xh = rf_randn(RF_F32, RF_SHAPE(64, 16, 8, 8), 3);
    CHECK(opt && xh);
    if (!opt || !xh) {
        rf_array_free(xh);
        rf_model_free(m);
        return;
    }
    ((float *)rf_array_data(xh))[5] = NAN;
    rf_array *x = rf_array_to(xh, cpu), *y = randn_dev(64, 2, 4);
    rf_array *batch[2] = {x, y};
    snapshot before;
    snap_take(&before, m, opt);
    double l = 0;
    CHECK_STATUS(rf_trainstep(mse_loss, NULL, m, batch, 2, opt, &l, NULL), RF_E_DOMAIN);
    CHECK(isnan(l));
    CHECK(snap_changed(&before) == 0);
    snap_free(&before);
    rf_array_free(xh);
    rf_array_free(x);
    rf_array_free(y);
    rf_opt_free(opt);
    rf_model_free(m);
}

/* ---- (8) rf_adjust, and an optimiser set up for another model ------------------------------ */

static void test_adjust(rf_model *host, rf_array *x, rf_array *y)
{
    rf_array *args[2] = {x, y};
    rf_model *m1 = rf_model_to(host, cpu), *m2 = rf_model_to(host, cpu);
    rf_opt *o1 = rf_setup(rf_descent(0.01), m1), *o2 = rf_setup(rf_descent(0.01), m2);
    double a[3], b[3];
    CHECK_OK(rf_trainstep(mse_loss, NULL, m1, args, 2, o1, &a[0], NULL));
    CHECK_OK(rf_trainstep(mse_loss, NULL, m2, args, 2, o2, &b[0], NULL));
    CHECK(a[0] == b[0]);
    CHECK_OK(rf_adjust(o2, 0.5));
    CHECK_NEAR(rf_opt_lr(o2), 0.5, 0, 1e-7);
    CHECK_OK(rf_trainstep(mse_loss, NULL, m1, args, 2, o1, &a[1], NULL));
    CHECK_OK(rf_trainstep(mse_loss, NULL, m2, args, 2, o2, &b[1], NULL));
    CHECK(a[1] == b[1]); /* the loss is computed before the update */
    CHECK_OK(rf_trainstep(mse_loss, NULL, m1, args, 2, o1, &a[2], NULL));
    CHECK_OK(rf_trainstep(mse_loss, NULL, m2, args, 2, o2, &b[2], NULL));
    CHECK(a[2] != b[2]); /* the larger step moved m2 further */
    CHECK(rf_model_cache_stats(m2).compiles == 1 && rf_model_cache_stats(m2).hits == 2);

    double l;
    CHECK_STATUS(rf_trainstep(mse_loss, NULL, m1, args, 2, o2, &l, NULL), RF_E_INVALID);
    CHECK_MSG("was not set up for this model");
    rf_opt_free(o1);
    rf_opt_free(o2);
    rf_model_free(m1); /* the model after its optimiser ... */
    rf_model_free(m2);
}

/* An optimiser set up for a part of the model stepped, or for the model a
 * stepped layer belongs to: the message says which layer it was set up for. */
static rf_tensor *whole_loss(rf_model *m, rf_tensor *const *b, int n, rf_aux *aux, void *ctx)
{
    (void)m, (void)n, (void)aux;
    return rf_mse(rf_apply((rf_model *)ctx, b[0]), b[1]);
}

typedef struct part_step {
    rf_model *whole, *m;
    rf_opt *opt;
} part_step;

static void part_step_fn(rf_trace *t, void *ctx)
{
    part_step *s = ctx;
    rf_tensor *batch[2] = {rf_arg(t, 0), rf_arg(t, 1)};
    rf_grads *g = NULL;
    rf_tensor *l = rf_withgradient(t, whole_loss, s->whole, s->m, batch, 2, NULL, &g);
    rf_update(t, s->opt, s->m, g);
    rf_return(t, l);
}

static void test_opt_of_part(rf_model *host, rf_array *x, rf_array *y)
{
    rf_array *args[2] = {x, y};
    rf_model *m = rf_model_to(host, cpu);
    rf_model *head = rf_model_child(m, 1);
    rf_opt *whole = rf_setup(rf_descent(0.01), m), *part = rf_setup(rf_descent(0.01), head);
    CHECK(m && whole && part);
    double l;
    CHECK_STATUS(rf_trainstep(whole_loss, m, m, args, 2, part, &l, NULL), RF_E_INVALID);
    CHECK_MSG("it was set up for layer \"1\" of this model");
    CHECK_STATUS(rf_trainstep(whole_loss, m, head, args, 2, whole, &l, NULL), RF_E_INVALID);
    CHECK_MSG("it was set up for the model this layer is \"1\" of");
    rf_exec *e = NULL;
    part_step s = {m, m, part};
    CHECK_STATUS(rf_compile(part_step_fn, &s, args, 2, &e), RF_E_INVALID);
    CHECK_MSG("rf_update: the optimiser was set up for another model; it was set up for layer "
              "\"1\" of this model");
    s = (part_step){m, head, whole};
    CHECK_STATUS(rf_compile(part_step_fn, &s, args, 2, &e), RF_E_INVALID);
    CHECK_MSG("it was set up for the model this layer is \"1\" of");
    CHECK(e == NULL);
    /* the right pairs step: the head alone, the rest read as constants */
    CHECK_OK(rf_trainstep(whole_loss, m, head, args, 2, part, &l, NULL));
    s = (part_step){m, head, part};
    CHECK_OK(rf_compile(part_step_fn, &s, args, 2, &e));
    rf_exec_free(e);
    rf_opt_free(whole);
    rf_opt_free(part);
    rf_model_free(m);
}

/* rf_opt_steps counts AccumGrad's accumulating steps, and not a step whose
 * loss is not finite. */
static void test_steps_count(rf_model *host, rf_array *x, rf_array *y)
{
    rf_array *args[2] = {x, y};
    rf_model *m = rf_model_to(host, cpu);
    rf_opt *opt = rf_setup(rf_chain_rules(rf_accumgrad(2), rf_descent(0.1)), m);
    rf_array *h = rf_fill(RF_F32, RF_SHAPE(16, 2), NAN), *bad = rf_array_to(h, cpu);
    CHECK(m && opt && bad);
    double l;
    for (int i = 0; i < 4; i++)
        CHECK_OK(rf_trainstep(mse_loss, NULL, m, args, 2, opt, &l, NULL));
    CHECK(rf_opt_steps(opt) == 4);
    CHECK_STATUS(rf_trainstep(mse_loss, NULL, m, (rf_array *[]){x, bad}, 2, opt, &l, NULL),
                 RF_E_DOMAIN);
    CHECK(rf_opt_steps(opt) == 4);
    rf_array_free(h);
    rf_array_free(bad);
    rf_opt_free(opt);
    rf_model_free(m);
}

/* ---- (9) many cache entries ---------------------------------------------------------------- */

static void test_many_entries(rf_model *host)
{
    rf_model *m = rf_model_to(host, cpu);
    rf_opt *opt = rf_setup(rf_descent(0.01), m);
    captured c;
    capture_start(&c);
    for (int n = 1; n <= 10; n++) {
        rf_array *x = randn_dev(n, 4, 100 + (uint64_t)n), *y = randn_dev(n, 2, 200 + (uint64_t)n);
        rf_array *args[2] = {x, y};
        double l;
        CHECK_OK(rf_trainstep(mse_loss, NULL, m, args, 2, opt, &l, NULL));
        rf_array_free(x);
        rf_array_free(y);
    }
    char *err = capture_end(&c);
    rf_cache_stats cs = rf_model_cache_stats(m);
    CHECK(cs.compiles == 10 && cs.misses == 10 && cs.hits == 0 && cs.entries == 10);
    CHECK(strstr(err, "reflux: warning: 9 compiled train steps cached for model Chain(") != NULL);
    CHECK(strstr(err, "reflux: warning: 10 compiled train steps") != NULL);
    CHECK(strstr(err, "differs from the nearest in batch shapes (f32[10,4] f32[10,2] vs "
                      "f32[9,4] f32[9,2]); batches whose shapes keep changing compile a step "
                      "each") != NULL);
    CHECK(strstr(err, "rebuilding the model") == NULL); /* the advice fits the cause */
    CHECK(strstr(err, "8 compiled") == NULL);
    fprintf(stderr, "%s", err);
    free(err);
    rf_model_cache_clear(m);
    cs = rf_model_cache_stats(m);
    CHECK(cs.entries == 0 && cs.compiles == 10);
    rf_model_free(m); /* before its optimiser this time */
    rf_opt_free(opt);
}

/* The warning names the key part in which the newest entry differs from its
 * nearest (fewest differing parts, the newest of equals): 8 entries of batch
 * sizes 1..8, then steps that repeat batch 8 with one part changed, each
 * becoming the 9th, 10th, ... entry. */
static void test_warning_parts(rf_model *host)
{
    rf_model *m = rf_model_to(host, cpu); /* in test mode, as models start */
    rf_opt *opt = rf_setup(rf_descent(0.01), m), *other = rf_setup(rf_descent(0.01), m);
    rf_array *x = NULL, *y = NULL;
    int ctx;
    double l;
    for (int n = 1; n <= 8; n++) {
        rf_array_free(x);
        rf_array_free(y);
        x = randn_dev(n, 4, 300 + (uint64_t)n), y = randn_dev(n, 2, 400 + (uint64_t)n);
        rf_array *args[2] = {x, y};
        CHECK_OK(rf_trainstep(mse_loss, NULL, m, args, 2, opt, &l, NULL));
    }
    rf_array *args[2] = {x, y};
    char *err[4];
    captured c;
    capture_start(&c);
    CHECK_OK(rf_trainstep(mse_loss, &ctx, m, args, 2, opt, &l, NULL));
    err[0] = capture_end(&c);
    capture_start(&c);
    CHECK_OK(rf_trainstep(mse_loss, NULL, m, args, 2, other, &l, NULL));
    err[1] = capture_end(&c);
    rf_array **grads = NULL;
    int ngrads = 0;
    capture_start(&c);
    CHECK_OK(rf_trainstep_withgradient(mse_loss, NULL, m, args, 2, opt, &l, NULL, &grads,
                                       &ngrads));
    err[2] = capture_end(&c);
    for (int i = 0; i < ngrads; i++)
        rf_array_free(grads[i]);
    free(grads);
    rf_trainmode(m);
    capture_start(&c);
    CHECK_OK(rf_trainstep(mse_loss, NULL, m, args, 2, opt, &l, NULL));
    err[3] = capture_end(&c);
    static const char *const want[4] = {
        "9 compiled train steps cached for model Chain(Dense(4 => 8, tanh), Dense(8 => 2)): the "
        "new one differs from the nearest in loss ctx pointer (",
        "10 compiled train steps cached for model Chain(Dense(4 => 8, tanh), Dense(8 => 2)): the "
        "new one differs from the nearest in optimiser instance (another rf_setup);",
        "11 compiled train steps cached for model Chain(Dense(4 => 8, tanh), Dense(8 => 2)): the "
        "new one differs from the nearest in gradient outputs (with vs without);",
        "12 compiled train steps cached for model Chain(Dense(4 => 8, tanh), Dense(8 => 2)): the "
        "new one differs from the nearest in train mode (train vs test);",
    };
    for (int i = 0; i < 4; i++) {
        CHECK(strstr(err[i], want[i]) != NULL);
        CHECK(strstr(err[i], "; rebuilding the model or optimiser every iteration") != NULL);
        fprintf(stderr, "%s", err[i]);
        free(err[i]);
    }
    CHECK(rf_model_cache_stats(m).entries == 12);
    rf_array_free(x);
    rf_array_free(y);
    rf_opt_free(opt);
    rf_opt_free(other);
    rf_model_free(m);
}

/* A head trained on a frozen trunk that the loss applies (ctx). */
static rf_tensor *trunk_head_loss(rf_model *m, rf_tensor *const *b, int n, rf_aux *aux,
                                  void *ctx)
{
    (void)n;
    (void)aux;
    return rf_mse(rf_apply(m, rf_apply(ctx, b[0])), b[1]);
}

/* A loss that puts the trunk in train mode for its apply and back (its own choice). */
static rf_tensor *switching_loss(rf_model *m, rf_tensor *const *b, int n, rf_aux *aux,
                                 void *ctx)
{
    (void)n;
    (void)aux;
    rf_trainmode(ctx);
    rf_tensor *h = rf_apply(ctx, b[0]);
    rf_testmode(ctx);
    return rf_mse(rf_apply(m, h), b[1]);
}

/* The train mode of a layer outside the stepped model, which the loss applies, is part of
 * the step's key: switching it compiles the other mode's step (Dropout then drops), switching
 * back finds the first again, and the too-many-entries warning names the layer. */
static void test_other_model_mode(void)
{
    rf_model *trunk_host = rf_chain(rf_dense(4, 8, RF_ACT_RELU), rf_dropout(0.5, 9));
    rf_model *head_host = rf_dense(8, 2, RF_ACT_IDENTITY);
    rf_model *trunk = trunk_host ? rf_model_to(trunk_host, cpu) : NULL;
    rf_model *head = head_host ? rf_model_to(head_host, cpu) : NULL;
    rf_opt *opt = head ? rf_setup(rf_descent(0.0), head) : NULL; /* lr 0: same loss each step */
    rf_array *x = randn_dev(16, 4, 21), *y = randn_dev(16, 2, 22);
    CHECK(trunk && head && opt && x && y);
    if (!trunk || !head || !opt || !x || !y)
        goto done;
    rf_array *args[2] = {x, y};
    double kept, dropped, again;
    CHECK_OK(rf_trainstep(trunk_head_loss, trunk, head, args, 2, opt, &kept, NULL));
    rf_trainmode(trunk);
    CHECK_OK(rf_trainstep(trunk_head_loss, trunk, head, args, 2, opt, &dropped, NULL));
    CHECK(rf_model_cache_stats(head).entries == 2 && dropped != kept);
    rf_testmode(trunk);
    CHECK_OK(rf_trainstep(trunk_head_loss, trunk, head, args, 2, opt, &again, NULL));
    CHECK(rf_model_cache_stats(head).entries == 2 && again == kept);

    for (int n = 1; n <= 7; n++) { /* 9 entries with the next */
        rf_array *xs = randn_dev(n, 4, 30), *ys = randn_dev(n, 2, 31);
        rf_array *small[2] = {xs, ys};
        CHECK_OK(rf_trainstep(trunk_head_loss, trunk, head, small, 2, opt, &again, NULL));
        rf_array_free(xs);
        rf_array_free(ys);
    }
    rf_trainmode(trunk);
    rf_array *xs = randn_dev(3, 4, 30), *ys = randn_dev(3, 2, 31);
    rf_array *small[2] = {xs, ys};
    captured c;
    capture_start(&c);
    CHECK_OK(rf_trainstep(trunk_head_loss, trunk, head, small, 2, opt, &again, NULL));
    char *err = capture_end(&c);
    CHECK(err && strstr(err, "the new one differs from the nearest in train mode of Dropout(0.5) "
                             "(layer \"1\"), which the loss applies (train vs test)"));
    free(err);
    rf_array_free(xs);
    rf_array_free(ys);

    /* a mode the loss sets itself is not part of the key: one entry, every step runs */
    rf_opt *other = rf_setup(rf_descent(0.0), head);
    for (int i = 0; i < 3; i++)
        CHECK_OK(rf_trainstep(switching_loss, trunk, head, args, 2, other, &again, NULL));
    CHECK(again != kept); /* Dropout dropped: not the test-mode loss */
    CHECK(rf_model_cache_stats(head).entries == 11); /* 10 for opt, 1 for other */
    rf_opt_free(other);
done:
    rf_array_free(x);
    rf_array_free(y);
    rf_opt_free(opt);
    rf_model_free(trunk);
    rf_model_free(head);
    rf_model_free(trunk_host);
    rf_model_free(head_host);
}

/* A model or optimiser rebuilt every iteration, the old one freed, leaves no cache
 * growing; the process-wide count of compiles of one step warns once, at the 9th.
 * (Batch sizes no other test uses, so no earlier compile counts.) */
static void rebuild_steps(rf_model *host, bool new_model, int64_t batch, char **err)
{
    rf_model *m = rf_model_to(host, cpu);
    rf_array *x = randn_dev(batch, 4, 300), *y = randn_dev(batch, 2, 301);
    rf_array *args[2] = {x, y};
    captured c;
    capture_start(&c);
    for (int i = 0; i < 10; i++) {
        if (new_model && i > 0) {
            rf_model_free(m);
            m = rf_model_to(host, cpu);
        }
        rf_opt *opt = rf_setup(rf_momentum(0.01, 0.9), m);
        double l;
        CHECK_OK(rf_trainstep(mse_loss, NULL, m, args, 2, opt, &l, NULL));
        CHECK(rf_model_cache_stats(m).entries == 1);
        rf_opt_free(opt);
    }
    *err = capture_end(&c);
    rf_array_free(x);
    rf_array_free(y);
    rf_model_free(m);
}

/* Recompiles for living objects are no rebuild: ten models of one architecture each
 * compiled once and kept (an ensemble), and one model and optimiser whose cache is cleared
 * before each step. */
static void no_rebuild_steps(rf_model *host, char **err)
{
    rf_array *x = randn_dev(25, 4, 310), *y = randn_dev(25, 2, 311);
    rf_array *args[2] = {x, y};
    rf_model *ms[10];
    rf_opt *os[10];
    captured c;
    capture_start(&c);
    for (int i = 0; i < 10; i++) {
        ms[i] = rf_model_to(host, cpu);
        os[i] = rf_setup(rf_momentum(0.01, 0.9), ms[i]);
        double l;
        CHECK_OK(rf_trainstep(mse_loss, NULL, ms[i], args, 2, os[i], &l, NULL));
    }
    for (int i = 0; i < 10; i++) {
        double l;
        rf_model_cache_clear(ms[0]);
        CHECK_OK(rf_trainstep(mse_loss, NULL, ms[0], args, 2, os[0], &l, NULL));
    }
    *err = capture_end(&c);
    for (int i = 0; i < 10; i++) {
        rf_opt_free(os[i]);
        rf_model_free(ms[i]);
    }
    rf_array_free(x);
    rf_array_free(y);
}

static void test_rebuilt_objects(rf_model *host)
{
    char *quiet = NULL;
    no_rebuild_steps(host, &quiet);
    CHECK(quiet && strstr(quiet, "has been compiled") == NULL);
    free(quiet);
    for (int new_model = 0; new_model < 2; new_model++) {
        char *err = NULL;
        rebuild_steps(host, new_model, new_model ? 23 : 21, &err);
        const char *w = err ? strstr(err, "has been compiled more than 8 times") : NULL;
        CHECK(w != NULL && strstr(w + 1, "has been compiled") == NULL); /* once */
        CHECK(err && strstr(err, "with momentum") != NULL);
        fprintf(stderr, "%s", err ? err : "");
        free(err);
    }
}

/* ---- (11) rf_train over a loader ------------------------------------------------------------ */

static rf_loader *loader_of(const float *xs, const float *ys, bool to_device)
{
    rf_array *X = rf_array_from(RF_F32, RF_SHAPE(64, 4), xs);
    rf_array *Y = rf_array_from(RF_F32, RF_SHAPE(64, 2), ys);
    rf_array *arrays[2] = {X, Y};
    rf_loader_opts o = {.batchsize = 8};
    rf_loader *l = rf_loader_new(arrays, 2, &o);
    rf_array_free(X);
    rf_array_free(Y);
    if (l && to_device && rf_loader_to(l, cpu) != RF_OK) {
        rf_loader_free(l);
        return NULL;
    }
    return l;
}

static void test_train_loop(rf_model *host)
{
    float xs[64 * 4], ys[64 * 2];
    rf_array *hx = rf_randn(RF_F32, RF_SHAPE(64, 4), 31);
    rf_array *hy = rf_randn(RF_F32, RF_SHAPE(64, 2), 32);
    rf_array_read(hx, xs, sizeof xs);
    rf_array_read(hy, ys, sizeof ys);
    rf_array_free(hx);
    rf_array_free(hy);
    rf_model *m = rf_model_to(host, cpu);
    rf_opt *opt = rf_setup(rf_adam(1e-2), m);

    rf_loader *data = loader_of(xs, ys, true);
    CHECK(data != NULL);
    double mean = NAN;
    rf_stats ms;
    rf_train_opts o = {.progress = RF_PROGRESS_ON, .label = "epoch 1", .mean_loss = &mean,
                       .mean_stats = &ms};
    captured c;
    capture_start(&c);
    rf_status st = rf_train(mse_aux_loss, NULL, m, data, opt, &o);
    char *err = capture_end(&c);
    CHECK_OK(st);
    CHECK(rf_opt_steps(opt) == 8);
    CHECK(isfinite(mean) && mean > 0);
    CHECK(ms.n == 2 && rf_stats_get(&ms, "acc") >= 0 && rf_stats_get(&ms, "acc") <= 1);
    CHECK(strstr(err, "\repoch 1 [") != NULL);
    const char *final = strstr(err, "[==============================] 8/8 loss=");
    CHECK(final != NULL);
    if (final) { /* the bar's loss is the pass's mean */
        char want[32];
        snprintf(want, sizeof want, "loss=%.4f ", mean);
        CHECK(strncmp(strstr(final, "loss="), want, strlen(want)) == 0);
    }
    CHECK(strstr(err, "samples/s ETA 0:00") != NULL);
    CHECK(strlen(err) > 0 && err[strlen(err) - 1] == '\n');
    fprintf(stderr, "progress bar: %s", err);
    free(err);
    /* a second epoch reuses the compiled step */
    CHECK_OK(rf_train(mse_aux_loss, NULL, m, data, opt,
                      &(rf_train_opts){.progress = RF_PROGRESS_OFF}));
    CHECK(rf_opt_steps(opt) == 16);
    CHECK(rf_model_cache_stats(m).compiles == 1);
    /* zeroed options are the defaults: AUTO draws no bar on a stderr that is a file */
    capture_start(&c);
    st = rf_train(mse_aux_loss, NULL, m, data, opt, &(rf_train_opts){.mean_loss = &mean});
    err = capture_end(&c);
    CHECK_OK(st);
    CHECK(err && strstr(err, "[==") == NULL && isfinite(mean));
    free(err);
    CHECK_STATUS(rf_train(mse_aux_loss, NULL, m, data, opt,
                          &(rf_train_opts){.progress = (rf_progress)7}), RF_E_INVALID);
    CHECK_MSG("rf_train: progress is 7");
    CHECK(rf_opt_steps(opt) == 24);
    rf_loader_free(data);

    /* a NaN in row 20 (batch 3) stops the pass there, nothing applied for it */
    xs[20 * 4 + 1] = NAN;
    data = loader_of(xs, ys, true);
    CHECK_STATUS(rf_train(mse_loss, NULL, m, data, opt,
                          &(rf_train_opts){.progress = RF_PROGRESS_OFF}), RF_E_DOMAIN);
    CHECK_MSG("rf_train: loss is NaN on batch 3, stopping training");
    CHECK(rf_opt_steps(opt) == 26);
    rf_loader_free(data);

    /* a loader that was never moved to the device */
    data = loader_of(xs, ys, false);
    CHECK_STATUS(rf_train(mse_loss, NULL, m, data, opt, NULL), RF_E_DEVICE);
    CHECK_MSG("rf_loader_to");
    CHECK(rf_opt_steps(opt) == 26);
    rf_loader_free(data);

    /* A smaller last batch counts for its samples only: with nothing learned (lr 0),
     * batches of 20, 20, 20, 4 give the mean over all 64 rows, one batch of 64's loss. */
    xs[20 * 4 + 1] = 0.5f; /* the NaN above gone */
    rf_opt *still = rf_setup(rf_descent(0.0), m);
    rf_array *hx64 = rf_array_from(RF_F32, RF_SHAPE(64, 4), xs);
    rf_array *hy64 = rf_array_from(RF_F32, RF_SHAPE(64, 2), ys);
    rf_array *all_x = rf_array_to(hx64, cpu), *all_y = rf_array_to(hy64, cpu);
    rf_loader *uneven = rf_loader_new((rf_array *[]){hx64, hy64}, 2,
                                      &(rf_loader_opts){.batchsize = 20});
    CHECK_OK(rf_loader_to(uneven, cpu));
    double whole = NAN, weighted = NAN;
    rf_stats whole_stats, weighted_stats;
    CHECK_OK(rf_trainstep(mse_aux_loss, NULL, m, (rf_array *[]){all_x, all_y}, 2, still, &whole,
                          &whole_stats));
    CHECK_OK(rf_train(mse_aux_loss, NULL, m, uneven, still,
                      &(rf_train_opts){.mean_loss = &weighted, .mean_stats = &weighted_stats}));
    CHECK_NEAR(weighted, whole, 1e-6, 1e-5);
    CHECK_NEAR(rf_stats_get(&weighted_stats, "acc"), rf_stats_get(&whole_stats, "acc"), 1e-6,
               1e-5);
    rf_loader_free(uneven);
    rf_array_free(hx64);
    rf_array_free(hy64);
    rf_array_free(all_x);
    rf_array_free(all_y);
    rf_opt_free(still);

    rf_opt_free(opt);
    rf_model_free(m);
}

int main(void)
{
    cpu = rf_device_cpu();
    rf_model *host = seed_model_host();
    rf_array *x = randn_dev(16, 4, 1), *y = randn_dev(16, 2, 2);
    CHECK(host && x && y);
    if (host && x && y) {
        test_manual_vs_trainstep(host, x, y);
        test_withgradient(host, x, y);
        test_aux(host, x, y);
        test_batchnorm_and_guard(x, y);
        test_nan_through_relu();
        test_adjust(host, x, y);
        test_opt_of_part(host, x, y);
        test_steps_count(host, x, y);
        test_many_entries(host);
        test_warning_parts(host);
        test_other_model_mode();
        test_rebuilt_objects(host);
        test_train_loop(host);
    }
    rf_array_free(x);
    rf_array_free(y);
    rf_model_free(host);
    return tu_finish("test_train");
}
