/* test_model.c: the model tree (nn/model.c), the initialisers (nn/init.c), the
 * activations' names and the basic layers (Dense, Flatten, Chain,
 * SkipConnection, Parallel).
 *
 * Oracles: the forward pass is checked against a plain C implementation of
 * Dense written here from the host weights; initialisers against Flux's
 * formulas (bounds and moments of the distributions); paths, counts and
 * summaries against hand-written expectations.
 */
#include <stdint.h>

#include "nn/model.h"
#include "test_util.h"

/* ---- Helpers ------------------------------------------------------------------------ */

/* A host copy of any array (owned). */
static rf_array *to_host(const rf_array *a) { return rf_array_to(a, rf_device_host()); }

/* y = act(x W^T + b) in double, x [n, in], W [out, in], b [out] (NULL: none). */
static void dense_ref(const float *x, int64_t n, int64_t in, const float *w, const float *b,
                      int64_t out, bool tanh_act, double *y)
{
    for (int64_t r = 0; r < n; r++)
        for (int64_t o = 0; o < out; o++) {
            double s = b ? b[o] : 0.0;
            for (int64_t i = 0; i < in; i++)
                s += (double)x[r * in + i] * (double)w[o * in + i];
            y[r * out + o] = tanh_act ? tanh(s) : s;
        }
}

/* Host data of parameter i of layer m (a host or cpu array). */
static const float *pdata(rf_model *m, int i) { return rf_array_data(rf_model_param_array(m, i)); }

/* Chain(Dense(4 => 8, tanh), Dense(8 => 2)) forward in double from the host model. */
static void chain_ref(rf_model *host, const float *x, int64_t n, double *y)
{
    rf_model *d1 = rf_model_child(host, 0), *d2 = rf_model_child(host, 1);
    double h[64 * 8];
    float hf[64 * 8];
    dense_ref(x, n, 4, pdata(d1, 0), pdata(d1, 1), 8, true, h);
    for (int64_t i = 0; i < n * 8; i++)
        hf[i] = (float)h[i];
    dense_ref(hf, n, 8, pdata(d2, 0), pdata(d2, 1), 2, false, y);
}

static void check_close_f32(const float *got, const double *want, int64_t n, double rtol,
                            const char *what)
{
    int bad = 0;
    for (int64_t i = 0; i < n; i++)
        if (!(fabs(got[i] - want[i]) <= 1e-6 + rtol * fabs(want[i])))
            bad++;
    CHECK(bad == 0);
    if (bad)
        fprintf(stderr, "  %s: %d of %lld values differ (first: %g vs %g)\n", what, bad,
                (long long)n, (double)got[0], want[0]);
}

/* ---- A user-defined layer: Scale(n), y = x .* s, with a state counter ------------------ */

typedef struct scale_cfg {
    int64_t n;
} scale_cfg;

static rf_tensor *scale_forward(rf_model *m, rf_tensor *x)
{
    return rf_mul(x, rf_model_param(m, rf_tensor_trace(x), 0));
}

static void scale_describe(const rf_model *m, char *buf, size_t n)
{
    const scale_cfg *c = rf_model_config(m);
    snprintf(buf, n, "%lld", (long long)c->n);
}

static const rf_layer_type scale_type = {"Scale", scale_forward, scale_describe};

static rf_model *scale_layer(int64_t n, bool with_state)
{
    scale_cfg c = {n};
    rf_model *m = rf_model_new(&scale_type, &c, sizeof c);
    if (!m)
        return NULL;
    rf_status st = rf_model_add_param(m, "scale", rf_fill(RF_F32, RF_SHAPE(n), 2.0));
    if (st == RF_OK && with_state)
        st = rf_model_add_state(m, "count", rf_zeros(RF_F32, RF_SCALAR_SHAPE));
    if (st != RF_OK) {
        rf_model_free(m);
        return NULL;
    }
    return m;
}

/* A forward that returns NULL without recording an error (a buggy user layer). */
static rf_tensor *null_forward(rf_model *m, rf_tensor *x)
{
    (void)m;
    (void)x;
    return NULL;
}
static const rf_layer_type null_type = {"Broken", null_forward, NULL};

/* A forward that returns its input and also calls rf_return with it. */
static rf_tensor *returning_forward(rf_model *m, rf_tensor *x)
{
    (void)m;
    rf_return(rf_tensor_trace(x), x);
    return x;
}
static const rf_layer_type returning_type = {"Returning", returning_forward, NULL};

/* ---- Visit order, paths, counts ------------------------------------------------------- */

typedef struct seen {
    char paths[16][64];
    bool trainable[16];
    int n;
} seen;

static void record(const char *path, rf_array *a, bool trainable, void *ud)
{
    (void)a;
    seen *s = ud;
    if (s->n < 16) {
        snprintf(s->paths[s->n], sizeof s->paths[0], "%s", path);
        s->trainable[s->n] = trainable;
    }
    s->n++;
}

static void test_visit(void)
{
    rf_model *m = rf_chain(rf_dense(4, 8, RF_ACT_TANH), rf_chain(rf_dense(8, 2, RF_ACT_IDENTITY)),
                           scale_layer(2, true));
    CHECK(m != NULL);
    if (!m)
        return;
    seen s = {0};
    rf_model_visit(m, record, &s);
    const char *want[] = {"0.weight", "0.bias", "1.0.weight", "1.0.bias", "2.scale", "2.count"};
    const bool want_tr[] = {true, true, true, true, true, false};
    CHECK(s.n == 6);
    for (int i = 0; i < 6 && i < s.n; i++) {
        CHECK(strcmp(s.paths[i], want[i]) == 0);
        CHECK(s.trainable[i] == want_tr[i]);
    }
    CHECK(rf_model_n_parameters(m) == 4 * 8 + 8 + 8 * 2 + 2 + 2);

    rf_array **params = NULL;
    int np = rfi_model_collect_params(m, &params);
    CHECK(np == 5);
    if (np == 5) {
        CHECK(params[0] == rf_model_param_array(rf_model_child(m, 0), 0));
        CHECK(params[3] == rf_model_param_array(rf_model_child(rf_model_child(m, 1), 0), 1));
        CHECK(params[4] == rf_model_param_array(rf_model_child(m, 2), 0));
    }
    rfi_free(params);

    /* Accessors. */
    CHECK(rf_model_n_children(m) == 3);
    CHECK(strcmp(rf_model_type_name(m), "Chain") == 0);
    CHECK(rf_model_n_params(rf_model_child(m, 2)) == 1);
    CHECK(rf_model_n_state(rf_model_child(m, 2)) == 1);
    CHECK(rf_model_child(m, 3) == NULL);
    CHECK(rf_model_param_array(m, 0) == NULL);
    const int64_t *wd = rf_array_dims(rf_model_param_array(rf_model_child(m, 0), 0));
    CHECK(wd[0] == 8 && wd[1] == 4); /* [out, in] */

    /* Names are path components: no duplicates, no dots (the array is taken over). */
    rf_model *sc = rf_model_child(m, 2);
    CHECK_STATUS(rf_model_add_param(sc, "scale", rf_zeros(RF_F32, RF_SHAPE(2))), RF_E_INVALID);
    CHECK_STATUS(rf_model_add_state(sc, "a.b", rf_zeros(RF_F32, RF_SHAPE(2))), RF_E_INVALID);
    CHECK_STATUS(rf_model_add_child(m, NULL), RF_E_INVALID);
    CHECK(rf_model_n_params(sc) == 1 && rf_model_n_children(m) == 3);
    rf_model_free(m);
}

static void test_describe_and_summary(void)
{
    rf_model *m = rf_chain(rf_dense(4, 8, RF_ACT_TANH), rf_dense(8, 2, RF_ACT_IDENTITY));
    CHECK(m != NULL);
    if (!m)
        return;
    char buf[1024];
    rfi_model_describe(m, buf, sizeof buf);
    CHECK(strcmp(buf, "Chain(Dense(4 => 8, tanh), Dense(8 => 2))") == 0);
    rf_model_summary(m, buf, sizeof buf);
    CHECK(strncmp(buf, "Chain(\n  Dense(4 => 8, tanh),", 29) == 0);
    CHECK(strstr(buf, "# 40 parameters\n") != NULL);
    CHECK(strstr(buf, "  Dense(8 => 2),") != NULL);
    CHECK(strstr(buf, "# 18 parameters\n") != NULL);
    CHECK(strstr(buf, "\n)\n") != NULL);
    CHECK(strstr(buf, "Total: 4 trainable arrays, 58 parameters, 4 arrays, 232 bytes") != NULL);
    /* A tiny buffer is truncated, still terminated. */
    char small[8];
    rf_model_summary(m, small, sizeof small);
    CHECK(strlen(small) == 7);
    rf_model_free(m);

    m = rf_chain(rf_skip(rf_dense(3, 3, RF_ACT_RELU), RF_COMBINE_ADD), rf_flatten_layer(),
                 scale_layer(3, false));
    CHECK(m != NULL);
    if (m) {
        rfi_model_describe(m, buf, sizeof buf);
        CHECK(strcmp(buf, "Chain(SkipConnection(+, Dense(3 => 3, relu)), Flatten(), "
                          "Scale(3))") == 0);
        rf_model_summary(m, buf, sizeof buf);
        CHECK(strstr(buf, "  SkipConnection(\n    +,\n    Dense(3 => 3, relu),") != NULL);
        CHECK(strstr(buf, "  Flatten(),\n") != NULL);
        CHECK(strstr(buf, "  Scale(3),") != NULL);
    }
    rf_model_free(m);
    /* a container with a parameter of its own says so on its opening line */
    m = rf_chain(rf_dense(2, 2, RF_ACT_IDENTITY));
    CHECK(m && rf_model_add_param(m, "alpha", rf_zeros(RF_F32, RF_SHAPE(3))) == RF_OK);
    if (m) {
        rf_model_summary(m, buf, sizeof buf);
        CHECK(strncmp(buf, "Chain(", 6) == 0 && strstr(buf, "# 3 parameters of its own\n"));
        CHECK(strstr(buf, "Total: 3 trainable arrays, 9 parameters") != NULL);
    }
    rf_model_free(m);
    CHECK(strcmp(rf_act_name(RF_ACT_SWISH), "swish") == 0);
    CHECK(strcmp(rf_act_name(RF_ACT_COUNT), "unknown") == 0);
}

/* ---- Copies to a device ------------------------------------------------------------------- */

static bool arrays_equal(rf_array *a, rf_array *b)
{
    if (rf_array_numel(a) != rf_array_numel(b) || rf_array_dtype(a) != rf_array_dtype(b))
        return false;
    rf_array *ha = to_host(a), *hb = to_host(b);
    bool eq = ha && hb && memcmp(rf_array_data(ha), rf_array_data(hb), rf_array_nbytes(ha)) == 0;
    rf_array_free(ha);
    rf_array_free(hb);
    return eq;
}

static void test_model_to(void)
{
    rf_device *cpu = rf_device_cpu();
    rf_model *host = rf_chain(rf_dense(4, 8, RF_ACT_TANH), scale_layer(8, true));
    CHECK(host != NULL);
    if (!host)
        return;
    /* One f64 parameter, to see the f32 default and keep_f64. */
    double d64[3] = {1.5, -2.25, 3.0};
    CHECK_OK(rf_model_add_param(host, "extra", rf_array_from(RF_F64, RF_SHAPE(3), d64)));
    rf_trainmode(rf_model_child(host, 1));

    rf_model *dev = rf_model_to(host, cpu);
    CHECK(dev != NULL);
    rf_to_opts keep = {.keep_f64 = true};
    rf_model *dev64 = rf_model_to_opts(host, cpu, &keep);
    CHECK(dev64 != NULL);
    if (!dev || !dev64)
        goto done;
    CHECK(rfi_model_structure_hash(dev) != rfi_model_structure_hash(host)); /* devices differ */
    CHECK(rf_model_n_children(dev) == 2 &&
          rf_model_n_parameters(dev) == rf_model_n_parameters(host));
    CHECK(rf_model_training(rf_model_child(dev, 1)) && !rf_model_training(dev));
    CHECK(dev->uid != host->uid && dev->cache == NULL && dev->n_opts == 0);
    for (int c = 0; c < 2; c++) {
        rf_model *hs = rf_model_child(host, c), *ds = rf_model_child(dev, c);
        CHECK(ds->config != hs->config && memcmp(ds->config, hs->config, hs->config_size) == 0);
        for (int i = 0; i < rf_model_n_params(hs); i++) {
            rf_array *a = rf_model_param_array(ds, i);
            CHECK(rf_array_device(a) == cpu && rf_array_dtype(a) == RF_F32);
            CHECK(a != rf_model_param_array(hs, i));
            CHECK(arrays_equal(a, rf_model_param_array(hs, i)));
        }
    }
    CHECK(rf_array_device(rf_model_state_array(rf_model_child(dev, 1), 0)) == cpu);
    rf_array *e32 = rf_model_param_array(dev, 0), *e64 = rf_model_param_array(dev64, 0);
    CHECK(rf_array_dtype(e32) == RF_F32 && rf_array_dtype(e64) == RF_F64);
    CHECK(((float *)rf_array_data(e32))[1] == -2.25f && ((double *)rf_array_data(e64))[2] == 3.0);

    /* Freeing the source keeps the copy usable. */
    rf_array *w_dev = rf_model_param_array(rf_model_child(dev, 0), 0);
    rf_array *w_copy = rf_array_to(w_dev, rf_device_host());
    rf_model_free(host);
    host = NULL;
    CHECK(arrays_equal(rf_model_param_array(rf_model_child(dev, 0), 0), w_copy));
    rf_array_free(w_copy);
    rf_model *dense_only = rf_model_to(rf_model_child(dev, 0), cpu);
    rf_array *x = rf_array_new(cpu, RF_F32, RF_SHAPE(2, 4), NULL), *y = NULL;
    CHECK_OK(rf_jit_model(dense_only, x, &y));
    CHECK(y != NULL && rf_array_dims(y)[1] == 8);
    rf_array_free(x);
    rf_array_free(y);
    rf_model_free(dense_only);

    CHECK(rf_model_to(NULL, cpu) == NULL);
done:
    rf_model_free(dev64);
    rf_model_free(dev);
    rf_model_free(host);
}

static rf_tensor *mse_of(rf_model *m, rf_tensor *const *b, int n, rf_aux *aux, void *ctx)
{
    (void)n;
    (void)aux;
    (void)ctx;
    return rf_mse(rf_apply(m, b[0]), b[1]);
}

/* The mse of m's output on x against t, computed on the host from a jitted forward. */
static double f64_loss(rf_model *m, rf_array *x, const double *t, int n)
{
    rf_array *y = NULL;
    CHECK_OK(rf_jit_model(m, x, &y));
    double s = 0;
    const double *v = y ? rf_array_data(y) : NULL;
    for (int i = 0; v && i < n; i++)
        s += (v[i] - t[i]) * (v[i] - t[i]);
    rf_array_free(y);
    return s / n;
}

/* rf_to_opts.to_f64 (Flux's f64(m)): every float array of a model (BatchNorm's
 * statistics too) becomes f64, Dropout's key keeps its dtype, the forward matches the
 * f32 model's, and a training step's gradients pass a float64 finite-difference check. */
static void test_model_to_f64(void)
{
    rf_device *cpu = rf_device_cpu();
    rf_nn_seed(11);
    rf_model *host = rf_chain(rf_conv2d(3, 3, 1, 2, RF_ACT_IDENTITY, NULL),
                              rf_batchnorm(2, RF_ACT_RELU), rf_dropout(0.5, 4),
                              rf_flatten_layer(), rf_dense(18, 3, RF_ACT_TANH));
    rf_model *m32 = host ? rf_model_to(host, cpu) : NULL;
    rf_model *m64 = host ? rf_model_to_opts(host, cpu, &(rf_to_opts){.to_f64 = true}) : NULL;
    rf_array *xh = rf_randn(RF_F32, RF_SHAPE(2, 1, 5, 5), 12);
    rf_array *x32 = xh ? rf_array_to(xh, cpu) : NULL;
    rf_array *x64 = xh ? rf_array_to_opts(xh, cpu, &(rf_to_opts){.to_f64 = true}) : NULL;
    rf_array *y32 = NULL, *y64 = NULL, *th = NULL, *t = NULL;
    rf_opt *opt = NULL;
    CHECK(m32 && m64 && x32 && x64 && rf_array_dtype(x64) == RF_F64);
    if (!m32 || !m64 || !x32 || !x64)
        goto done;
    rf_array *key32 = rf_model_state_array(rf_model_child(m32, 2), 0);
    rf_array *key64 = rf_model_state_array(rf_model_child(m64, 2), 0);
    CHECK(rf_array_dtype(key64) == rf_array_dtype(key32)); /* not a float: kept */
    for (int c = 0; c < 5; c++) {
        rf_model *l = rf_model_child(m64, c);
        for (int i = 0; i < rf_model_n_params(l); i++)
            CHECK(rf_array_dtype(rf_model_param_array(l, i)) == RF_F64);
    }
    CHECK(rf_array_dtype(rf_model_state_array(rf_model_child(m64, 1), 0)) == RF_F64);

    CHECK_OK(rf_jit_model(m32, x32, &y32));
    CHECK_OK(rf_jit_model(m64, x64, &y64));
    CHECK(y64 && rf_array_dtype(y64) == RF_F64);
    for (int i = 0; y32 && y64 && i < 6; i++)
        CHECK_NEAR(((double *)rf_array_data(y64))[i], ((float *)rf_array_data(y32))[i], 1e-5,
                   1e-5);

    double tv[6] = {0.1, -0.4, 0.3, 0.7, -0.2, 0.05};
    th = rf_array_from(RF_F64, RF_SHAPE(2, 3), tv);
    t = rf_array_to_opts(th, cpu, &(rf_to_opts){.keep_f64 = true});
    opt = rf_setup(rf_descent(0.0), m64);
    double l = 0;
    rf_array **grads = NULL;
    int ngrads = 0;
    CHECK_OK(rf_trainstep_withgradient(mse_of, NULL, m64, (rf_array *[]){x64, t}, 2, opt, &l,
                                       NULL, &grads, &ngrads));
    CHECK(ngrads == 6 && rf_array_dtype(grads[0]) == RF_F64); /* conv w, b; bn scale, bias; .. */
    rf_array *w = rf_model_param_array(rf_model_child(m64, 0), 0); /* conv weight [2,1,3,3] */
    double *wv = rf_array_data(w);
    for (int k = 0; ngrads == 6 && k < 18; k += 5) {
        double keep = wv[k], h = 1e-6;
        wv[k] = keep + h;
        double up = f64_loss(m64, x64, tv, 6);
        wv[k] = keep - h;
        double down = f64_loss(m64, x64, tv, 6);
        wv[k] = keep;
        CHECK_NEAR(((double *)rf_array_data(grads[0]))[k], (up - down) / (2 * h), 1e-9, 1e-6);
    }
    for (int i = 0; i < ngrads; i++)
        rf_array_free(grads[i]);
    free(grads);
done:
    rf_opt_free(opt);
    rf_array_free(t);
    rf_array_free(th);
    rf_array_free(y32);
    rf_array_free(y64);
    rf_array_free(x32);
    rf_array_free(x64);
    rf_array_free(xh);
    rf_model_free(m32);
    rf_model_free(m64);
    rf_model_free(host);
}

static void test_modes_and_hash(void)
{
    rf_model *a = rf_chain(rf_dense(4, 8, RF_ACT_TANH), rf_chain(rf_dense(8, 2, RF_ACT_IDENTITY)));
    rf_model *b = rf_chain(rf_dense(4, 8, RF_ACT_TANH), rf_chain(rf_dense(8, 2, RF_ACT_IDENTITY)));
    CHECK(a && b);
    if (a && b) {
        CHECK(!rf_model_training(a));
        uint64_t h = rfi_model_structure_hash(a);
        CHECK(h == rfi_model_structure_hash(b)); /* weights' values are not structure */
        rf_trainmode(a);
        CHECK(rf_model_training(a) && rf_model_training(rf_model_child(rf_model_child(a, 1), 0)));
        CHECK(rfi_model_structure_hash(a) != h);
        rf_testmode(a);
        CHECK(!rf_model_training(rf_model_child(rf_model_child(a, 1), 0)));
        CHECK(rfi_model_structure_hash(a) == h);
        CHECK(a->uid != b->uid && rfi_next_uid() > b->uid);

        /* Optimiser links: attach is idempotent, detach removes. */
        struct rf_opt *fake = (struct rf_opt *)(void *)&h;
        CHECK_OK(rfi_model_attach_opt(a, fake));
        CHECK_OK(rfi_model_attach_opt(a, fake));
        CHECK(a->n_opts == 1);
        rfi_model_detach_opt(a, fake);
        CHECK(a->n_opts == 0);
    }
    rf_model_free(a);
    rf_model_free(b);
    rf_model_free(NULL);
    rf_trainmode(NULL);
}

/* ---- Compiling the forward pass -------------------------------------------------------------- */

static const float x_data[6 * 4] = {
    0.5f, -1.0f, 0.25f, 2.0f,  -0.75f, 0.1f, 1.5f, -0.3f, 0.9f, 0.8f, -1.2f, 0.05f,
    -0.4f, 0.6f, 0.7f, -1.9f, 1.1f, -0.2f, 0.3f, 0.45f, 0.0f, 1.0f, -0.6f, -0.35f,
};

static void test_compile_model(void)
{
    rf_device *cpu = rf_device_cpu();
    rf_nn_seed(3);
    rf_model *host = rf_chain(rf_dense(4, 8, RF_ACT_TANH), rf_dense(8, 2, RF_ACT_IDENTITY));
    rf_model *m = host ? rf_model_to(host, cpu) : NULL;
    rf_array *xh = rf_array_from(RF_F32, RF_SHAPE(6, 4), x_data);
    rf_array *x = xh ? rf_array_to(xh, cpu) : NULL;
    rf_exec *fwd = NULL;
    rf_array *y = NULL, *y2 = NULL;
    double want[6 * 2];
    CHECK(host && m && x);
    if (!host || !m || !x)
        goto done;
    /* Give the second bias non-zero values so it is exercised. */
    float b2[2] = {0.5f, -0.25f};
    CHECK_OK(rf_array_write(rf_model_param_array(rf_model_child(host, 1), 1), b2, sizeof b2));
    CHECK_OK(rf_array_write(rf_model_param_array(rf_model_child(m, 1), 1), b2, sizeof b2));

    CHECK_OK(rf_compile_model(m, x, &fwd));
    if (!fwd)
        goto done;
    CHECK(rf_exec_n_args(fwd) == 1 && rf_exec_n_outputs(fwd) == 1);
    CHECK_OK(rf_exec_run(fwd, &x, 1, &y, 1));
    chain_ref(host, x_data, 6, want);
    if (y)
        check_close_f32(rf_array_data(y), want, 12, 1e-5, "compiled chain");

    /* The parameters are captured by reference: a write is seen by the next run. */
    rf_array *w1 = rf_model_param_array(rf_model_child(m, 0), 0);
    rf_array *w1h = rf_model_param_array(rf_model_child(host, 0), 0);
    float *wv = rf_array_data(w1h);
    for (int i = 0; i < 32; i++)
        wv[i] = 0.1f * (float)(i % 7) - 0.3f;
    CHECK_OK(rf_array_write(w1, wv, 32 * sizeof(float)));
    CHECK_OK(rf_exec_run(fwd, &x, 1, &y2, 1));
    chain_ref(host, x_data, 6, want);
    if (y2)
        check_close_f32(rf_array_data(y2), want, 12, 1e-5, "after rf_array_write");
    rf_array_free(y2);
    y2 = NULL;

    /* rf_jit_model gives the same. */
    CHECK_OK(rf_jit_model(m, x, &y2));
    if (y2)
        check_close_f32(rf_array_data(y2), want, 12, 1e-5, "rf_jit_model");

    /* A host model cannot be compiled: the message names the layer and the array. */
    rf_exec *bad = NULL;
    CHECK_STATUS(rf_compile_model(host, x, &bad), RF_E_DEVICE);
    CHECK_MSG("Dense parameter \"0.weight\"");
    CHECK_MSG("lives on host");
    CHECK(bad == NULL);
    /* A host x is refused too. */
    CHECK_STATUS(rf_compile_model(m, xh, &bad), RF_E_DEVICE);
    CHECK_STATUS(rf_compile_model(NULL, x, &bad), RF_E_INVALID);
done:
    rf_exec_free(fwd);
    rf_array_free(y);
    rf_array_free(y2);
    rf_array_free(x);
    rf_array_free(xh);
    rf_model_free(m);
    rf_model_free(host);
}

/* A hand-written trace applying `ctx` (a model) to argument 0. */
static void apply_fn(rf_trace *t, void *ctx)
{
    rf_tensor *y = rf_apply(ctx, rf_arg(t, 0));
    if (y)
        rf_return(t, y);
}

/* Fraction of the n floats of `a` that are exactly zero. */
static double zero_fraction(rf_array *a, int n)
{
    const float *v = a ? rf_array_data(a) : NULL;
    int zeros = 0;
    for (int i = 0; v && i < n; i++)
        zeros += v[i] == 0.0f;
    return (double)zeros / n;
}

/* An executable keeps the train/test mode it was traced in: compiled with
 * Dropout dropping, a run after rf_testmode is refused (not run with the old
 * mode), and accepted again after rf_trainmode; a model no layer of which
 * reads its mode runs in either. rf_jitted compiles one executable per mode. */
static void test_compiled_modes(void)
{
    rf_device *cpu = rf_device_cpu();
    rf_model *host = rf_chain(rf_dense(4, 64, RF_ACT_RELU), rf_dropout(0.5, 7));
    rf_model *m = host ? rf_model_to(host, cpu) : NULL;
    rf_model *plain = rf_chain(rf_dense(4, 8, RF_ACT_TANH));
    rf_model *pm = plain ? rf_model_to(plain, cpu) : NULL;
    rf_array *xh = rf_array_from(RF_F32, RF_SHAPE(6, 4), x_data);
    rf_array *x = xh ? rf_array_to(xh, cpu) : NULL;
    rf_exec *fwd = NULL, *pfwd = NULL;
    rf_jitted *jit = NULL;
    rf_array *y = NULL;
    CHECK(m && pm && x);
    if (!m || !pm || !x)
        goto done;

    rf_trainmode(m);
    CHECK_OK(rf_compile_model(m, x, &fwd));
    CHECK_OK(rf_exec_run(fwd, &x, 1, &y, 1));
    double dropped = zero_fraction(y, 6 * 64);
    rf_array_free(y);
    y = NULL;
    rf_testmode(m);
    CHECK_STATUS(rf_exec_run(fwd, &x, 1, &y, 1), RF_E_INVALID);
    CHECK_MSG("Dropout(0.5) (layer \"1\") was in train mode when this executable was traced");
    CHECK(y == NULL);
    rf_trainmode(m);
    CHECK_OK(rf_exec_run(fwd, &x, 1, &y, 1));
    rf_array_free(y);
    y = NULL;

    rf_trainmode(pm); /* Dense and Chain do not read the mode */
    CHECK_OK(rf_compile_model(pm, x, &pfwd));
    rf_testmode(pm);
    CHECK_OK(rf_exec_run(pfwd, &x, 1, &y, 1));
    rf_array_free(y);
    y = NULL;

    /* rf_jitted: one executable per mode, each found again */
    jit = rf_jitted_new(apply_fn, m);
    rf_testmode(m);
    CHECK_OK(rf_jitted_run(jit, &x, 1, &y, 1));
    double kept = zero_fraction(y, 6 * 64);
    rf_array_free(y);
    y = NULL;
    rf_trainmode(m);
    CHECK_OK(rf_jitted_run(jit, &x, 1, &y, 1));
    CHECK(rf_jitted_n_compiled(jit) == 2);
    CHECK(zero_fraction(y, 6 * 64) > kept + 0.2); /* Dropout drops about half */
    CHECK(dropped > kept + 0.2);
    rf_array_free(y);
    y = NULL;
    rf_testmode(m);
    CHECK_OK(rf_jitted_run(jit, &x, 1, &y, 1));
    CHECK(rf_jitted_n_compiled(jit) == 2 && zero_fraction(y, 6 * 64) == kept);

    /* the executable outlives the model: nobody can change its mode any more, so it
     * runs as traced (the model was freed in test mode, traced in train mode) */
    rf_model_free(m);
    m = NULL;
    rf_array *y2 = NULL;
    CHECK_OK(rf_exec_run(fwd, &x, 1, &y2, 1));
    CHECK(zero_fraction(y2, 6 * 64) > kept + 0.2);
    rf_array_free(y2);
done:
    rf_jitted_free(jit);
    rf_exec_free(fwd);
    rf_exec_free(pfwd);
    rf_array_free(y);
    rf_array_free(x);
    rf_array_free(xh);
    rf_model_free(m);
    rf_model_free(host);
    rf_model_free(pm);
    rf_model_free(plain);
}

/* A layer whose description shows its mode: naming its watch must not recurse. */
static rf_tensor *noise_forward(rf_model *m, rf_tensor *x)
{
    return rf_model_training(m) ? rf_mul(x, rf_scalar(rf_tensor_trace(x), 2.0)) : x;
}

static void noise_describe(const rf_model *m, char *buf, size_t n)
{
    snprintf(buf, n, "%s", rf_model_training(m) ? "train" : "test");
}

static const rf_layer_type noise_layer = {"Noise", noise_forward, noise_describe};

/* A layer branching on its first child's mode instead of applying the child. */
static rf_tensor *peek_forward(rf_model *m, rf_tensor *x)
{
    return rf_model_training(rf_model_child(m, 0)) ? rf_mul(x, rf_scalar(rf_tensor_trace(x), 3.0))
                                                   : x;
}

static const rf_layer_type peek_layer = {"Peek", peek_forward, NULL};

/* Monte Carlo dropout: the function sets train mode around the apply itself. */
static void mc_fn(rf_trace *t, void *ctx)
{
    rf_trainmode(ctx);
    rf_tensor *y = rf_apply(ctx, rf_arg(t, 0));
    rf_testmode(ctx);
    if (y)
        rf_return(t, y);
}

/* Applies in the caller's mode, then leaves the model in test mode: the program
 * depends on the caller's mode, which stays watched. */
static void apply_then_test_fn(rf_trace *t, void *ctx)
{
    rf_tensor *y = rf_apply(ctx, rf_arg(t, 0));
    rf_testmode(ctx);
    if (y)
        rf_return(t, y);
}

/* An evaluation function that puts the model in test mode itself. */
static void eval_fn(rf_trace *t, void *ctx)
{
    rf_testmode(ctx);
    rf_tensor *y = rf_apply(ctx, rf_arg(t, 0));
    if (y)
        rf_return(t, y);
}

/* Modes the traced function sets are its own choice, not watched; a layer whose
 * describe reads its mode is named without recursing; Dropout(0) reads no mode. */
static void test_modes_set_inside(void)
{
    rf_device *cpu = rf_device_cpu();
    rf_model *host = rf_chain(rf_dense(4, 64, RF_ACT_RELU), rf_dropout(0.5, 7));
    rf_model *m = host ? rf_model_to(host, cpu) : NULL;
    rf_model *noisy = rf_chain(rf_model_new(&noise_layer, NULL, 0));
    rf_model *peek = rf_model_new(&peek_layer, NULL, 0);
    if (peek && rf_model_add_child(peek, rf_model_new(&noise_layer, NULL, 0)) != RF_OK) {
        rf_model_free(peek);
        peek = NULL;
    }
    rf_model *peeking = rf_chain(peek);
    rf_model *still_host = rf_chain(rf_dense(4, 8, RF_ACT_RELU), rf_dropout(0.0, 7));
    rf_model *still = still_host ? rf_model_to(still_host, cpu) : NULL;
    rf_array *xh = rf_array_from(RF_F32, RF_SHAPE(6, 4), x_data);
    rf_array *x = xh ? rf_array_to(xh, cpu) : NULL;
    rf_jitted *mc = NULL, *eval = NULL;
    rf_exec *e = NULL;
    rf_array *y = NULL;
    CHECK(m && noisy && peeking && still && x);
    if (!m || !noisy || !peeking || !still || !x)
        goto done;
    mc = rf_jitted_new(mc_fn, m);
    eval = rf_jitted_new(eval_fn, m);
    for (int i = 0; i < 4; i++) {
        if (i % 2)
            rf_trainmode(m);
        else
            rf_testmode(m);
        CHECK_OK(rf_jitted_run(mc, &x, 1, &y, 1));
        CHECK(zero_fraction(y, 6 * 64) > 0.3); /* dropping, whatever the caller's mode */
        rf_array_free(y);
        y = NULL;
        rf_trainmode(m); /* the evaluation function sets test mode itself */
        CHECK_OK(rf_jitted_run(eval, &x, 1, &y, 1));
        rf_array_free(y);
        y = NULL;
    }
    CHECK(rf_jitted_n_compiled(mc) == 1 && rf_jitted_n_compiled(eval) == 1);
    rf_trainmode(m);
    CHECK_OK(rf_compile(apply_then_test_fn, m, &x, 1, &e)); /* traced dropping */
    CHECK(!rf_model_training(m));
    CHECK_STATUS(rf_exec_run(e, &x, 1, &y, 1), RF_E_INVALID);
    rf_trainmode(m);
    CHECK_OK(rf_exec_run(e, &x, 1, &y, 1));
    rf_array_free(y);
    y = NULL;
    rf_exec_free(e);
    e = NULL;

    rf_trainmode(noisy);
    CHECK_OK(rf_compile_model(noisy, x, &e));
    rf_testmode(noisy);
    CHECK_STATUS(rf_exec_run(e, &x, 1, &y, 1), RF_E_INVALID);
    CHECK_MSG("Noise(train) (layer \"0\") was in train mode");
    rf_exec_free(e);
    e = NULL;

    rf_trainmode(peeking); /* a child's mode read in its parent's forward is watched */
    CHECK_OK(rf_compile_model(peeking, x, &e));
    rf_testmode(peeking);
    CHECK_STATUS(rf_exec_run(e, &x, 1, &y, 1), RF_E_INVALID);
    CHECK_MSG("Noise(train) (layer \"0.0\") was in train mode");
    rf_exec_free(e);
    e = NULL;

    rf_trainmode(still); /* Dropout(0) is the identity in both modes */
    CHECK_OK(rf_compile_model(still, x, &e));
    rf_testmode(still);
    CHECK_OK(rf_exec_run(e, &x, 1, &y, 1));
done:
    rf_exec_free(e);
    rf_array_free(y);
    rf_jitted_free(mc);
    rf_jitted_free(eval);
    rf_array_free(x);
    rf_array_free(xh);
    rf_model_free(m);
    rf_model_free(host);
    rf_model_free(noisy);
    rf_model_free(peeking);
    rf_model_free(still);
    rf_model_free(still_host);
}

static void test_errors(void)
{
    rf_device *cpu = rf_device_cpu();
    rf_model *host = rf_dense(4, 8, RF_ACT_IDENTITY);
    rf_model *m = host ? rf_model_to(host, cpu) : NULL;
    rf_array *x5 = rf_array_new(cpu, RF_F32, RF_SHAPE(16, 5), NULL);
    rf_array *x4 = rf_array_new(cpu, RF_F32, RF_SHAPE(16, 4), NULL);
    rf_exec *e = NULL;
    CHECK(host && m && x5 && x4);

    /* Wrong input width: Flux-style message. */
    CHECK_STATUS(rf_compile_model(m, x5, &e), RF_E_SHAPE);
    CHECK_MSG("Dense(4 => 8): input f32[16,5] has 5 features, expected 4");
    /* Inside a user trace, a host parameter is a trace error naming layer, array and device. */
    CHECK_STATUS(rf_compile(apply_fn, host, &x4, 1, &e), RF_E_DEVICE);
    CHECK_MSG("Dense array \"weight\" (f32[8,4]) lives on host");
    /* NULL model / forward returning NULL without an error. */
    CHECK_STATUS(rf_compile(apply_fn, NULL, &x4, 1, &e), RF_E_INVALID);
    CHECK_MSG("rf_apply: model is NULL");
    rf_model *broken = rf_model_new(&null_type, NULL, 0);
    CHECK_STATUS(rf_compile(apply_fn, broken, &x4, 1, &e), RF_E_INVALID);
    CHECK_MSG("Broken()");
    rf_model_free(broken);
    /* an input of another dtype than the layer's parameters, named with the layer */
    rf_array *h64 = rf_array_new(rf_device_host(), RF_F64, RF_SHAPE(16, 4), NULL);
    rf_array *x64 = rf_array_to_opts(h64, cpu, &(rf_to_opts){.keep_f64 = true});
    rf_array_free(h64);
    CHECK_STATUS(rf_compile_model(m, x64, &e), RF_E_DTYPE);
    CHECK_MSG("Dense(4 => 8): input f64[16,4] has dtype f64, but the layer's parameters are f32");
    rf_model *bn_host = rf_batchnorm(4, RF_ACT_IDENTITY), *bn = rf_model_to(bn_host, cpu);
    CHECK_STATUS(rf_compile_model(bn, x64, &e), RF_E_DTYPE);
    CHECK_MSG("BatchNorm(4");
    rf_model_free(bn);
    rf_model_free(bn_host);
    /* an adaptive pool's output larger than its input */
    rf_model *ap = rf_adaptive_meanpool(2, 2);
    rf_array *x0 = rf_array_new(cpu, RF_F32, RF_SHAPE(1, 1, 0, 4), NULL);
    CHECK_STATUS(rf_compile_model(ap, x0, &e), RF_E_SHAPE);
    CHECK_MSG("spatial size 0x4, smaller than the output size 2x2");
    rf_array_free(x0);
    rf_model_free(ap);
    /* rf_compile_model's output 0 is the model's: a layer's own rf_return is refused */
    rf_model *returning = rf_model_new(&returning_type, NULL, 0);
    CHECK_STATUS(rf_compile_model(returning, x4, &e), RF_E_INVALID);
    CHECK_MSG("rf_compile_model: a layer's forward called rf_return 1 time");
    CHECK(e == NULL);
    rf_model_free(returning);
    rf_array_free(x64);
    CHECK(rf_apply(m, NULL) == NULL);

    /* Constructors. */
    CHECK(rf_dense(0, 3, RF_ACT_RELU) == NULL);
    CHECK_MSG("rf_dense(0 => 3)");
    CHECK(rf_model_new(NULL, NULL, 0) == NULL);
    CHECK(rf_model_new(&null_type, NULL, 4) == NULL);
    /* Containers take ownership also on failure (the sanitizer run checks the frees). */
    rf_model *layers[3] = {rf_dense(2, 2, RF_ACT_IDENTITY), NULL, rf_dense(2, 2, RF_ACT_RELU)};
    CHECK(rf_chain_n(layers, 3) == NULL);
    CHECK_MSG("layer 1 is NULL");
    /* A failing constructor inside the list: an error that keeps its message, never a
     * shorter chain; the layers around it are freed (the sanitizer run checks). */
    rf_clear_error();
    CHECK(rf_chain(rf_dense(2, 2, RF_ACT_IDENTITY), rf_dense(0, 3, RF_ACT_RELU),
                   rf_dense(3, 2, RF_ACT_RELU)) == NULL);
    CHECK_MSG("rf_chain: layer 1 is NULL (a layer constructor failed; the last error before this call: ");
    CHECK_MSG("rf_dense(0 => 3)");
    rf_clear_error();
    CHECK(rf_chain(rf_chain(rf_dense(-1, 2, RF_ACT_IDENTITY)), rf_flatten_layer()) == NULL);
    CHECK_MSG("rf_chain: layer 0 is NULL (a layer constructor failed; the last error before this call: rf_chain: layer 0 is NULL");
    rf_clear_error();
    rf_model *empty = rf_chain_n(NULL, 0); /* the identity */
    CHECK(empty && rf_model_n_children(empty) == 0);
    rf_model_free(empty);
    CHECK(rf_chain_n(NULL, 2) == NULL);
    CHECK(rf_skip(NULL, RF_COMBINE_ADD) == NULL);
    CHECK(rf_skip(rf_dense(2, 2, RF_ACT_IDENTITY), (rf_combine)9) == NULL);
    CHECK(rf_parallel_n(RF_COMBINE_ADD, NULL, 0) == NULL);
    CHECK_MSG("needs at least one layer");
    CHECK(rf_parallel(RF_COMBINE_ADD, rf_dense(2, 2, RF_ACT_IDENTITY), NULL) == NULL);
    CHECK_MSG("rf_parallel: layer 1 is NULL");
    CHECK(rf_parallel((rf_combine)9, rf_dense(2, 2, RF_ACT_IDENTITY)) == NULL);
    CHECK_MSG("unknown combine");
    rf_model *one = rf_chain(rf_dense(2, 2, RF_ACT_IDENTITY));
    CHECK(one && rf_model_n_children(one) == 1);
    rf_model_free(one);

    rf_array_free(x4);
    rf_array_free(x5);
    rf_model_free(m);
    rf_model_free(host);
}

/* ---- Containers and a custom layer -------------------------------------------------------- */

/* Models form a tree: one owner each, no cycles, no double frees. */
static void test_tree_ownership(void)
{
    rf_model *d = rf_dense(4, 4, RF_ACT_IDENTITY);
    rf_clear_error();
    CHECK(rf_chain(d, d) == NULL); /* d is freed once, with the failed chain */
    CHECK_MSG("already belongs to Chain(");
    CHECK_MSG("sharing a layer");
    d = rf_dense(4, 4, RF_ACT_IDENTITY);
    CHECK(rf_chain(d, d, d) == NULL);

    rf_model *q = rf_dense(4, 4, RF_ACT_IDENTITY);
    rf_model *p = rf_chain(q);
    CHECK(p != NULL);
    CHECK_STATUS(rf_model_add_child(q, p), RF_E_INVALID); /* a cycle: p stays as it was */
    CHECK_MSG("is, or contains,");
    CHECK_STATUS(rf_model_add_child(p, p), RF_E_INVALID);
    rf_model *other = rf_chain_n(NULL, 0);
    CHECK_STATUS(rf_model_add_child(other, q), RF_E_INVALID); /* q stays p's */
    CHECK(rf_model_n_children(other) == 0 && rf_model_child(p, 0) == q);
    rf_clear_error();
    rf_model_free(q); /* not its owner: nothing happens */
    CHECK_MSG("rf_model_free: Dense(4 => 4) belongs to another model");
    CHECK(rf_model_n_parameters(p) == 20);
    rf_model_free(other);
    rf_model_free(p);
    /* names a checkpoint could not hold: the safetensors header's own, and not UTF-8 */
    rf_model *named = rf_model_new(&null_type, NULL, 0);
    CHECK_STATUS(rf_model_add_param(named, "__metadata__", rf_zeros(RF_F32, RF_SHAPE(1))),
                 RF_E_INVALID);
    CHECK_MSG("\"__metadata__\" is reserved");
    CHECK_STATUS(rf_model_add_state(named, "bad\xff\xfe", rf_zeros(RF_F32, RF_SHAPE(1))),
                 RF_E_INVALID);
    CHECK_MSG("is not valid UTF-8");
    const char *accented = "\xc3\xa9t\xc3\xa9 \xe2\x9c\x93"; /* "été ✓" */
    CHECK_OK(rf_model_add_state(named, accented, rf_zeros(RF_F32, RF_SHAPE(1))));
    rf_model_free(named);
    /* an array whose constructor failed: its message is kept */
    rf_model *m = rf_model_new(&null_type, NULL, 0);
    rf_clear_error();
    CHECK_STATUS(rf_model_add_param(m, "w", rf_zeros(RF_F32, RF_SHAPE(-2))), RF_E_INVALID);
    CHECK_MSG("rf_model_add_param(Broken): array \"w\" is NULL (its constructor failed: "
              "rf_zeros");
    rf_model_free(m);
}

/* Skip and Parallel add or multiply equal shapes (Flux's + and * do not
 * broadcast), and refuse the wrong number of layers added after construction. */
static void test_combine_errors(void)
{
    rf_device *cpu = rf_device_cpu();
    rf_array *x = rf_array_new(cpu, RF_F32, RF_SHAPE(2, 4), NULL), *y = NULL;
    rf_model *hosts[4] = {
        rf_skip(rf_dense(4, 1, RF_ACT_IDENTITY), RF_COMBINE_ADD),
        rf_parallel(RF_COMBINE_MUL, rf_dense(4, 1, RF_ACT_IDENTITY),
                    rf_dense(4, 3, RF_ACT_IDENTITY)),
        rf_skip(rf_dense(4, 4, RF_ACT_IDENTITY), RF_COMBINE_ADD),
        rf_parallel(RF_COMBINE_ADD, rf_dense(4, 4, RF_ACT_IDENTITY)),
    };
    CHECK_OK(rf_model_add_child(hosts[2], rf_dense(4, 4, RF_ACT_IDENTITY)));
    for (int i = 0; i < 64; i++)
        CHECK_OK(rf_model_add_child(hosts[3], rf_dense(4, 4, RF_ACT_IDENTITY)));
    const char *want[4] = {"gives results of different shapes to add: f32[2,1] (0) and "
                           "f32[2,4] (1)",
                           "gives results of different shapes to multiply: f32[2,1] (0) and "
                           "f32[2,3] (1)",
                           "a SkipConnection holds one layer, this one 2",
                           "a Parallel holds 1 to 64 layers, this one 65"};
    for (int i = 0; i < 4; i++) {
        rf_model *m = hosts[i] ? rf_model_to(hosts[i], cpu) : NULL;
        CHECK(m != NULL);
        CHECK(rf_jit_model(m, x, &y) == (i < 2 ? RF_E_SHAPE : RF_E_INVALID));
        CHECK_MSG(want[i]);
        CHECK(y == NULL);
        rf_model_free(m);
        rf_model_free(hosts[i]);
    }
    rf_array_free(x);
}

static void test_containers_and_custom(void)
{
    rf_device *cpu = rf_device_cpu();
    rf_nn_seed(11);
    rf_model *host = rf_chain(
        rf_parallel(RF_COMBINE_CONCAT_CHANNELS, rf_dense(4, 3, RF_ACT_IDENTITY),
                    rf_skip(rf_dense(4, 4, RF_ACT_IDENTITY), RF_COMBINE_ADD)),
        scale_layer(7, false));
    rf_model *m = host ? rf_model_to(host, cpu) : NULL;
    rf_array *x = rf_array_new(cpu, RF_F32, RF_SHAPE(6, 4), x_data), *y = NULL;
    CHECK(host && m && x);
    if (!host || !m || !x)
        goto done;
    CHECK_OK(rf_jit_model(m, x, &y));
    if (!y)
        goto done;
    CHECK(rf_array_rank(y) == 2 && rf_array_dims(y)[0] == 6 && rf_array_dims(y)[1] == 7);
    /* Oracle: [dense_a(x), dense_b(x) + x] .* 2 (Scale starts at 2). */
    rf_model *par = rf_model_child(host, 0);
    rf_model *da = rf_model_child(par, 0), *db = rf_model_child(rf_model_child(par, 1), 0);
    double ya[6 * 3], yb[6 * 4], want[6 * 7];
    dense_ref(x_data, 6, 4, pdata(da, 0), pdata(da, 1), 3, false, ya);
    dense_ref(x_data, 6, 4, pdata(db, 0), pdata(db, 1), 4, false, yb);
    for (int r = 0; r < 6; r++) {
        for (int j = 0; j < 3; j++)
            want[r * 7 + j] = 2.0 * ya[r * 3 + j];
        for (int j = 0; j < 4; j++)
            want[r * 7 + 3 + j] = 2.0 * (yb[r * 4 + j] + x_data[r * 4 + j]);
    }
    check_close_f32(rf_array_data(y), want, 42, 1e-5, "parallel/skip/scale");
    rf_array_free(y);
    y = NULL;

    /* Writing the custom layer's parameter is seen (captured by reference). */
    float s[7] = {1, 1, 1, 1, 1, 1, -1};
    CHECK_OK(rf_array_write(rf_model_param_array(rf_model_child(m, 1), 0), s, sizeof s));
    CHECK_OK(rf_jit_model(m, x, &y));
    if (y)
        CHECK_NEAR(((float *)rf_array_data(y))[6], -want[6] / 2.0, 1e-6, 1e-5);
    rf_array_free(y);
    y = NULL;

    /* Dense on rank-3 input and softmax over the features. */
    rf_model *d3h = rf_dense(4, 3, RF_ACT_SOFTMAX);
    rf_model *d3 = d3h ? rf_model_to(d3h, cpu) : NULL;
    rf_array *x3 = rf_array_new(cpu, RF_F32, RF_SHAPE(2, 3, 4), x_data);
    CHECK(d3 && x3);
    if (d3 && x3) {
        CHECK_OK(rf_jit_model(d3, x3, &y));
        if (y) {
            CHECK(rf_array_rank(y) == 3 && rf_array_dims(y)[2] == 3);
            double z[6 * 3];
            dense_ref(x_data, 6, 4, pdata(d3h, 0), pdata(d3h, 1), 3, false, z);
            const float *v = rf_array_data(y);
            for (int r = 0; r < 6; r++) {
                double mx = fmax(z[r * 3], fmax(z[r * 3 + 1], z[r * 3 + 2])), den = 0;
                for (int j = 0; j < 3; j++)
                    den += exp(z[r * 3 + j] - mx);
                for (int j = 0; j < 3; j++)
                    CHECK_NEAR(v[r * 3 + j], exp(z[r * 3 + j] - mx) / den, 1e-6, 1e-5);
            }
        }
    }
    rf_array_free(x3);
    rf_model_free(d3);
    rf_model_free(d3h);

    /* Flatten: [N, 2, 2] -> [N, 4], then Dense. */
    rf_model *fh = rf_chain(rf_flatten_layer(), rf_dense(4, 2, RF_ACT_IDENTITY));
    rf_model *f = fh ? rf_model_to(fh, cpu) : NULL;
    rf_array *x22 = rf_array_new(cpu, RF_F32, RF_SHAPE(6, 2, 2), x_data), *yf = NULL;
    CHECK(f && x22);
    if (f && x22) {
        CHECK_OK(rf_jit_model(f, x22, &yf));
        double wf[12];
        rf_model *fd = rf_model_child(fh, 1);
        dense_ref(x_data, 6, 4, pdata(fd, 0), pdata(fd, 1), 2, false, wf);
        if (yf)
            check_close_f32(rf_array_data(yf), wf, 12, 1e-5, "flatten + dense");
    }
    rf_array_free(yf);
    rf_array_free(x22);
    rf_model_free(f);
    rf_model_free(fh);
done:
    rf_array_free(y);
    rf_array_free(x);
    rf_model_free(m);
    rf_model_free(host);
}

/* ---- Initialisers -------------------------------------------------------------------------- */

/* Min, max, mean and (population) variance of an f32 array. */
static void moments(rf_array *a, double *lo, double *hi, double *mean, double *var)
{
    const float *v = rf_array_data(a);
    int64_t n = rf_array_numel(a);
    double s = 0, s2 = 0;
    *lo = INFINITY;
    *hi = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        s += v[i];
        *lo = fmin(*lo, v[i]);
        *hi = fmax(*hi, v[i]);
    }
    *mean = s / (double)n;
    for (int64_t i = 0; i < n; i++)
        s2 += (v[i] - *mean) * (v[i] - *mean);
    *var = s2 / (double)n;
}

/* Draws [out=64, in=32] (or a conv kernel) and checks bounds and moments.
 * For n = 2048 draws the standard error of the variance is < 1% of it for
 * the uniform and ~3% for the normal: the tolerances are about 4-5 of them. */
static void check_init(rf_init init, const int64_t *dims, int rank, bool uniform, double scale)
{
    rf_array *a = rf_init_array(init, dims, rank, 99);
    CHECK(a != NULL);
    if (!a)
        return;
    CHECK(rf_array_dtype(a) == RF_F32 && rf_array_device(a) == rf_device_host());
    double lo, hi, mean, var;
    moments(a, &lo, &hi, &mean, &var);
    double want_var = uniform ? scale * scale / 3.0 : scale * scale;
    double sd = sqrt(want_var);
    if (uniform) {
        CHECK(lo >= -scale && hi <= scale);
        CHECK(lo < -0.95 * scale && hi > 0.95 * scale); /* the whole range is used */
        CHECK_NEAR(var, want_var, 0.0, 0.05);
    } else {
        CHECK(lo < -2.5 * sd && hi > 2.5 * sd);
        CHECK_NEAR(var, want_var, 0.0, 0.15);
    }
    CHECK_NEAR(mean, 0.0, 5.0 * sd / sqrt((double)rf_array_numel(a)), 0.0);
    rf_array_free(a);
}

static void test_init(void)
{
    const int64_t w[2] = {64, 32}; /* [out, in]: fan_in 32, fan_out 64 */
    check_init(RF_INIT_GLOROT_UNIFORM, w, 2, true, sqrt(6.0 / 96.0));
    check_init(RF_INIT_GLOROT_NORMAL, w, 2, false, sqrt(2.0 / 96.0));
    check_init(RF_INIT_KAIMING_UNIFORM, w, 2, true, sqrt(3.0) * sqrt(2.0) / sqrt(32.0));
    check_init(RF_INIT_KAIMING_NORMAL, w, 2, false, sqrt(2.0) / sqrt(32.0));
    check_init(RF_INIT_NORMAL, w, 2, false, 0.01);
    /* Conv kernel [out 8, in 4, 8, 8]: fan_in = 4 * 64, fan_out = 8 * 64. */
    const int64_t k[4] = {8, 4, 8, 8};
    check_init(RF_INIT_GLOROT_UNIFORM, k, 4, true, sqrt(6.0 / (256.0 + 512.0)));
    /* Vectors, as Flux's nfan(n) = (1, n): an n x 1 matrix. */
    const int64_t v[1] = {2048};
    check_init(RF_INIT_GLOROT_UNIFORM, v, 1, true, sqrt(6.0 / 2049.0));
    check_init(RF_INIT_KAIMING_NORMAL, v, 1, false, sqrt(2.0));

    rf_array *z = rf_init_array(RF_INIT_ZEROS, RF_SHAPE(3, 2), 1);
    rf_array *o = rf_init_array(RF_INIT_ONES, RF_SHAPE(3, 2), 1);
    CHECK(z && o);
    if (z && o) {
        double lo, hi, mean, var;
        moments(z, &lo, &hi, &mean, &var);
        CHECK(lo == 0 && hi == 0);
        moments(o, &lo, &hi, &mean, &var);
        CHECK(lo == 1 && hi == 1);
    }
    rf_array_free(z);
    rf_array_free(o);
    CHECK(rf_init_array(RF_INIT_COUNT, RF_SHAPE(2), 1) == NULL);
    CHECK(rf_init_array(RF_INIT_ZEROS, RF_SHAPE(-2), 1) == NULL);

    /* Same seed, same bits; different seeds differ. */
    rf_array *a = rf_init_array(RF_INIT_GLOROT_UNIFORM, RF_SHAPE(8, 4), 5);
    rf_array *b = rf_init_array(RF_INIT_GLOROT_UNIFORM, RF_SHAPE(8, 4), 5);
    rf_array *c = rf_init_array(RF_INIT_GLOROT_UNIFORM, RF_SHAPE(8, 4), 6);
    CHECK(a && b && c && arrays_equal(a, b) && !arrays_equal(a, c));

    /* rf_nn_seed makes constructors reproducible; an explicit seed does not use
     * the counter and gives rf_init_array's weights. */
    rf_nn_seed(7);
    rf_model *d1 = rf_dense(4, 8, RF_ACT_IDENTITY), *d2 = rf_dense(4, 8, RF_ACT_IDENTITY);
    rf_nn_seed(7);
    rf_model *e = rf_dense_ex(4, 8, RF_ACT_IDENTITY, &(rf_dense_opts){.seed = 5});
    rf_model *d1b = rf_dense(4, 8, RF_ACT_IDENTITY);
    rf_nn_seed(8);
    rf_model *d1c = rf_dense(4, 8, RF_ACT_IDENTITY);
    rf_model *nb = rf_dense_ex(4, 8, RF_ACT_IDENTITY,
                               &(rf_dense_opts){.no_bias = true, .init = RF_INIT_ZEROS});
    CHECK(d1 && d2 && e && d1b && d1c && nb);
    if (d1 && d2 && e && d1b && d1c && nb) {
        rf_array *w1 = rf_model_param_array(d1, 0);
        CHECK(arrays_equal(w1, rf_model_param_array(d1b, 0)));
        CHECK(!arrays_equal(w1, rf_model_param_array(d2, 0)));
        CHECK(!arrays_equal(w1, rf_model_param_array(d1c, 0)));
        CHECK(arrays_equal(rf_model_param_array(e, 0), a));
        double lo, hi, mean, var;
        moments(w1, &lo, &hi, &mean, &var);
        CHECK(lo >= -sqrt(0.5) && hi <= sqrt(0.5)); /* sqrt(6 / (4 + 8)) */
        moments(rf_model_param_array(d1, 1), &lo, &hi, &mean, &var);
        CHECK(lo == 0 && hi == 0); /* zero bias */
        CHECK(rf_model_n_params(nb) == 1 && rf_model_n_parameters(nb) == 32);
        char buf[64];
        rfi_model_describe(nb, buf, sizeof buf);
        CHECK(strcmp(buf, "Dense(4 => 8; bias=false)") == 0);
    }
    rf_model_free(d1);
    rf_model_free(d2);
    rf_model_free(e);
    rf_model_free(d1b);
    rf_model_free(d1c);
    rf_model_free(nb);
    rf_array_free(a);
    rf_array_free(b);
    rf_array_free(c);
}

int main(void)
{
    test_visit();
    test_describe_and_summary();
    test_model_to();
    test_modes_and_hash();
    test_compile_model();
    test_compiled_modes();
    test_modes_set_inside();
    test_model_to_f64();
    test_errors();
    test_containers_and_custom();
    test_tree_ownership();
    test_combine_errors();
    test_init();
    return tu_finish("test_model");
}
