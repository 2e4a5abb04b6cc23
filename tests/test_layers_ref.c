/* test_layers_ref.c: the nn layers against PyTorch (tests/ref/layers.txt from
 * tests/ref/gen_layers.py): forward outputs, gradients of sum(y * ct) with
 * respect to the input and every parameter, and BatchNorm's running
 * statistics after a train-mode pass. Each layer is built with its rf_*
 * constructor, moved to the compute device, its arrays overwritten from the
 * fixture, and run through rf_compile (x -> rf_apply) and rf_grad.
 *
 * Dropout is random, so it is checked statistically (dropped fraction ~ p,
 * survivors scaled by 1/(1-p), fresh masks per run, equal masks for equal
 * seeds, identity in test mode). Error paths: invalid constructor arguments
 * return NULL with RF_E_INVALID, bad inputs fail the trace with a message
 * naming the layer and the shapes.
 */
#include "fixture.h"
#include "nn/model.h"
#include "test_util.h"

static fx_file fx;
static rf_device *dev;

/* ---- Fixture plumbing ------------------------------------------------------------------- */

static const fx_entry *entry(const char *name, const char *suffix)
{
    char key[160];
    snprintf(key, sizeof key, "%s.%s", name, suffix);
    return fx_get(&fx, key);
}

static bool same_shape(const fx_entry *e, const int64_t *dims, int rank)
{
    if (e->rank != rank)
        return false;
    for (int i = 0; i < rank; i++)
        if (e->dims[i] != dims[i])
            return false;
    return true;
}

/* Overwrites a device f32 array with a fixture entry of the same shape. */
static bool load_into(rf_array *a, const fx_entry *e)
{
    if (!e || !same_shape(e, rf_array_dims(a), rf_array_rank(a))) {
        fprintf(stderr, "fixture entry %s does not match the layer's array\n",
                e ? e->name : "(missing)");
        return false;
    }
    float *v = fx_f32(e);
    rf_status st = rf_array_write(a, v, rf_array_nbytes(a));
    free(v);
    return st == RF_OK;
}

static rf_array *device_array(const fx_entry *e, rf_dtype dt)
{
    if (dt == RF_I64) {
        int64_t *v = malloc((size_t)e->n * sizeof *v);
        for (int64_t i = 0; i < e->n; i++)
            v[i] = (int64_t)e->v[i];
        rf_array *a = rf_array_new(dev, dt, e->dims, e->rank, v);
        free(v);
        return a;
    }
    float *v = fx_f32(e);
    rf_array *a = rf_array_new(dev, dt, e->dims, e->rank, v);
    free(v);
    return a;
}

/* Compares an f32 array with the float64 reference: |a - b| <= atol + 1e-5 |b|,
 * atol = 1e-6 * max(1, max |b|) (cancellation leaves absolute f32 error of
 * that size in sums of products). */
static void compare(const char *what, rf_array *a, const fx_entry *e)
{
    tu_checks++;
    if (!a || !e || !same_shape(e, rf_array_dims(a), rf_array_rank(a))) {
        tu_failures++;
        fprintf(stderr, "%s: missing or wrong shape\n", what);
        return;
    }
    float *got = malloc(rf_array_nbytes(a) ? rf_array_nbytes(a) : 1);
    rf_array_read(a, got, rf_array_nbytes(a));
    double maxabs = 1.0, worst = 0.0;
    for (int64_t i = 0; i < e->n; i++)
        maxabs = fmax(maxabs, fabs(e->v[i]));
    int64_t bad = -1;
    for (int64_t i = 0; i < e->n; i++) {
        double err = fabs((double)got[i] - e->v[i]);
        if (isnan(err))
            err = INFINITY; /* a NaN result fails */
        double tol = 1e-6 * maxabs + 1e-5 * fabs(e->v[i]);
        if (err / tol > worst)
            worst = err / tol;
        if (err > tol && bad < 0)
            bad = i;
    }
    if (bad >= 0) {
        tu_failures++;
        fprintf(stderr, "%s: element %lld = %.9g, expected %.9g (worst err/tol %.3g)\n", what,
                (long long)bad, (double)got[bad], e->v[bad], worst);
    }
    free(got);
}

/* ---- One layer against its fixture case --------------------------------------------------- */

typedef struct slot {
    rf_model *layer;
    int index;
} slot;

#define MAX_SLOTS 16

/* Every parameter (or state array) of the tree in rf_model_visit order. */
static void collect(rf_model *m, bool params, slot *out, int *n)
{
    int count = params ? rf_model_n_params(m) : rf_model_n_state(m);
    for (int i = 0; i < count && *n < MAX_SLOTS; i++)
        out[(*n)++] = (slot){m, i};
    for (int i = 0; i < rf_model_n_children(m); i++)
        collect(rf_model_child(m, i), params, out, n);
}

typedef struct grad_ctx {
    rf_model *m;
    slot params[MAX_SLOTS];
    int n_params;
    bool x_grad;
} grad_ctx;

/* (x, ct) -> y, dx (if x is float), d param... of sum(rf_apply(m, x) * ct) */
static void trace_grads(rf_trace *t, void *ctx)
{
    grad_ctx *c = ctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_tensor *y = rf_apply(c->m, x);
    rf_tensor *loss = rf_sum_all(rf_mul(y, rf_arg(t, 1)));
    rf_tensor *wrt[MAX_SLOTS + 1], *g[MAX_SLOTS + 1];
    int n = 0;
    if (c->x_grad)
        wrt[n++] = x;
    for (int i = 0; i < c->n_params; i++)
        wrt[n++] = rf_model_param(c->params[i].layer, t, c->params[i].index);
    if (!loss || rf_grad(t, loss, wrt, n, g) != RF_OK)
        return;
    rf_return(t, y);
    for (int i = 0; i < n; i++)
        rf_return(t, g[i]);
}

/* Runs case `name` on `host_model` (consumed). param_names / state_names name
 * the fixture entries of the tree's parameters / state arrays in visit order. */
static void run_case(const char *name, rf_model *host_model, bool train,
                     const char *const *param_names, const char *const *state_names,
                     bool ids_input)
{
    CHECK(host_model != NULL);
    if (!host_model) {
        fprintf(stderr, "%s: constructor failed: %s\n", name, rf_errmsg());
        return;
    }
    rf_model *m = rf_model_to(host_model, dev);
    rf_model_free(host_model);
    CHECK(m != NULL);
    if (!m)
        return;
    if (train)
        rf_trainmode(m);

    grad_ctx ctx = {.m = m, .x_grad = !ids_input};
    collect(m, true, ctx.params, &ctx.n_params);
    slot states[MAX_SLOTS];
    int n_states = 0;
    collect(m, false, states, &n_states);
    bool ok = true;
    for (int i = 0; i < ctx.n_params; i++) {
        CHECK(param_names && param_names[i]);
        ok = ok && param_names && param_names[i] &&
             load_into(rf_model_param_array(ctx.params[i].layer, ctx.params[i].index),
                       entry(name, param_names[i]));
    }
    CHECK(!param_names || param_names[ctx.n_params] == NULL); /* as many as the fixture */
    for (int i = 0; i < n_states && state_names; i++)
        ok = ok && load_into(rf_model_state_array(states[i].layer, states[i].index),
                             entry(name, state_names[i]));
    CHECK(ok);
    if (!ok) {
        rf_model_free(m);
        return;
    }

    rf_array *args[2] = {device_array(entry(name, "x"), ids_input ? RF_I64 : RF_F32),
                         device_array(entry(name, "ct"), RF_F32)};
    rf_array *outs[MAX_SLOTS + 2] = {0};
    int nouts = 1 + ctx.x_grad + ctx.n_params;
    rf_exec *e = NULL;
    CHECK_OK(rf_compile(trace_grads, &ctx, args, 2, &e));
    if (e)
        CHECK_OK(rf_exec_run(e, args, 2, outs, nouts));

    char what[160];
    snprintf(what, sizeof what, "%s: y", name);
    compare(what, outs[0], entry(name, "y"));
    int k = 1;
    if (ctx.x_grad) {
        snprintf(what, sizeof what, "%s: dx", name);
        compare(what, outs[k++], entry(name, "dx"));
    }
    for (int i = 0; i < ctx.n_params; i++, k++) {
        char key[96];
        snprintf(key, sizeof key, "d.%s", param_names[i]);
        snprintf(what, sizeof what, "%s: %s", name, key);
        compare(what, outs[k], entry(name, key));
    }
    /* state after the run: BatchNorm's running statistics */
    for (int i = 0; i < n_states && state_names; i++) {
        char key[96];
        snprintf(key, sizeof key, "new_%s", strrchr(state_names[i], '.') ?
                 strrchr(state_names[i], '.') + 1 : state_names[i]);
        snprintf(what, sizeof what, "%s: %s", name, key);
        compare(what, rf_model_state_array(states[i].layer, states[i].index), entry(name, key));
    }
    for (int i = 0; i < nouts; i++)
        rf_array_free(outs[i]);
    rf_exec_free(e);
    rf_array_free(args[0]);
    rf_array_free(args[1]);
    rf_model_free(m);
}

static const char *const WB[] = {"weight", "bias", NULL};
static const char *const W[] = {"weight", NULL};
static const char *const SB[] = {"scale", "bias", NULL};
static const char *const NONE[] = {NULL};
static const char *const RUNNING[] = {"running_mean", "running_var", NULL};

static void test_reference_cases(void)
{
    run_case("dense_relu", rf_dense(3, 4, RF_ACT_RELU), false, WB, NULL, false);
    run_case("dense_tanh", rf_dense(4, 2, RF_ACT_TANH), false, WB, NULL, false);

    run_case("conv_plain", rf_conv2d(3, 2, 3, 4, RF_ACT_RELU, NULL), false, WB, NULL, false);
    run_case("conv_sdg", rf_conv2d(3, 3, 4, 6, RF_ACT_IDENTITY, &(rf_conv_opts){
                 .stride = {2, 2}, .pad = {1, 1}, .dilation = {2, 2}, .groups = 2}),
             false, WB, NULL, false);
    run_case("conv_same", rf_conv2d(4, 2, 2, 3, RF_ACT_IDENTITY, &(rf_conv_opts){
                 .stride = {2, 2}, .pad_same = true, .no_bias = true}),
             false, W, NULL, false);

    run_case("convt_g1", rf_conv_transpose2d(3, 2, 3, 4, RF_ACT_IDENTITY, &(rf_conv_opts){
                 .stride = {2, 2}, .pad = {1, 1}}), false, WB, NULL, false);
    run_case("convt_g2", rf_conv_transpose2d(3, 3, 4, 6, RF_ACT_IDENTITY, &(rf_conv_opts){
                 .stride = {2, 2}, .pad = {1, 1}, .groups = 2}), false, WB, NULL, false);

    run_case("convt_dil", rf_conv_transpose2d(3, 3, 2, 3, RF_ACT_IDENTITY, &(rf_conv_opts){
                 .stride = {2, 2}, .pad = {1, 1}, .dilation = {2, 2}}), false, WB, NULL, false);
    run_case("convt_crop", rf_conv_transpose2d(2, 2, 2, 2, RF_ACT_IDENTITY, &(rf_conv_opts){
                 .stride = {3, 3}, .pad = {2, 2}}), false, WB, NULL, false);
    run_case("convt_same", rf_conv_transpose2d(3, 4, 2, 3, RF_ACT_IDENTITY, &(rf_conv_opts){
                 .stride = {2, 2}, .pad_same = true}), false, WB, NULL, false);

    run_case("maxpool", rf_maxpool(2, 2, 0, 0), false, NONE, NULL, false);
    run_case("maxpool_p", rf_maxpool(3, 3, 2, 1), false, NONE, NULL, false);
    run_case("meanpool", rf_meanpool(2, 2, 0, 0), false, NONE, NULL, false);
    run_case("meanpool_p", rf_meanpool(3, 3, 2, 1), false, NONE, NULL, false);
    run_case("gmeanpool", rf_global_meanpool(), false, NONE, NULL, false);
    run_case("ameanpool", rf_adaptive_meanpool(2, 3), false, NONE, NULL, false);

    run_case("bn2d_train", rf_batchnorm(3, RF_ACT_IDENTITY), true, SB, RUNNING, false);
    run_case("bn2d_eval", rf_batchnorm(3, RF_ACT_IDENTITY), false, SB, RUNNING, false);
    run_case("bn1d_train", rf_batchnorm(4, RF_ACT_RELU), true, SB, RUNNING, false);
    run_case("layernorm", rf_layernorm(5), false, SB, NULL, false);
    run_case("groupnorm", rf_groupnorm(6, 2), false, SB, NULL, false);

    run_case("embedding", rf_embedding(7, 3, 1), false, W, NULL, true);
    run_case("flatten", rf_flatten_layer(), false, NONE, NULL, false);

    static const char *const res_params[] = {"conv.weight", "conv.bias", "bn.scale", "bn.bias",
                                             NULL};
    rf_model *block = rf_skip(rf_chain(rf_conv2d(3, 3, 3, 3, RF_ACT_IDENTITY,
                                                 &(rf_conv_opts){.pad = {1, 1}}),
                                       rf_batchnorm(3, RF_ACT_RELU)),
                              RF_COMBINE_ADD);
    run_case("resblock", block, true, res_params, RUNNING, false);
}

/* BatchNorm in test mode records no updates; in train mode exactly two. */
static void trace_apply(rf_trace *t, void *ctx) { rf_return(t, rf_apply(ctx, rf_arg(t, 0))); }

static void test_batchnorm_updates(void)
{
    rf_model *host = rf_batchnorm(2, RF_ACT_IDENTITY);
    rf_model *m = rf_model_to(host, dev);
    rf_model_free(host);
    rf_array *x = rf_randn(RF_F32, RF_SHAPE(3, 2, 2, 2), 5);
    rf_array *xd = rf_array_to(x, dev);
    rf_exec *e = NULL;
    CHECK_OK(rf_compile(trace_apply, m, &xd, 1, &e));
    CHECK(e && rf_exec_n_updates(e) == 0);
    rf_exec_free(e);
    rf_trainmode(m);
    CHECK_OK(rf_compile(trace_apply, m, &xd, 1, &e));
    CHECK(e && rf_exec_n_updates(e) == 2);
    rf_exec_free(e);
    rf_array_free(x);
    rf_array_free(xd);
    rf_model_free(m);
}

/* ---- Dropout ---------------------------------------------------------------------------- */

/* Runs e on x once and returns the output's values (malloc). */
static float *run_once(rf_exec *e, rf_array *x, int64_t n)
{
    rf_array *y = NULL;
    float *v = calloc((size_t)n, sizeof *v);
    CHECK_OK(rf_exec_run(e, &x, 1, &y, 1));
    if (y)
        rf_array_read(y, v, (size_t)n * sizeof *v);
    rf_array_free(y);
    return v;
}

static void test_dropout(void)
{
    const double p = 0.3;
    const int64_t n = 20000;
    rf_array *ones = rf_ones(RF_F32, RF_SHAPE(100, 200));
    rf_array *x = rf_array_to(ones, dev);
    rf_array_free(ones);

    rf_model *h1 = rf_dropout(p, 42), *h2 = rf_dropout(p, 42);
    rf_model *m1 = rf_model_to(h1, dev), *m2 = rf_model_to(h2, dev);
    rf_model_free(h1);
    rf_model_free(h2);
    rf_trainmode(m1);
    rf_trainmode(m2);
    rf_exec *e1 = NULL, *e2 = NULL;
    CHECK_OK(rf_compile(trace_apply, m1, &x, 1, &e1));
    CHECK_OK(rf_compile(trace_apply, m2, &x, 1, &e2));
    if (!e1 || !e2)
        goto done;
    CHECK(rf_exec_n_updates(e1) == 1); /* the key advances */

    float *a = run_once(e1, x, n), *b = run_once(e1, x, n), *c = run_once(e2, x, n);
    int64_t dropped = 0, scaled = 0, differ = 0, same_seed_equal = 0;
    for (int64_t i = 0; i < n; i++) {
        dropped += a[i] == 0.0f;
        scaled += fabsf(a[i] - (float)(1.0 / (1.0 - p))) < 1e-6f;
        differ += (a[i] == 0.0f) != (b[i] == 0.0f);
        same_seed_equal += a[i] == c[i];
    }
    /* binomial(20000, 0.3): sd ~ 65, so +-0.015 is over 4.5 sd */
    CHECK_NEAR((double)dropped / (double)n, p, 0.015, 0.0);
    CHECK(dropped + scaled == n); /* every survivor is scaled by 1/(1-p) */
    CHECK(differ > n / 5);        /* a second run draws a new mask (~42% differ) */
    CHECK(same_seed_equal == n);  /* same seed, same run index: same mask */
    free(a);
    free(b);
    free(c);

    /* test mode: the identity, and the key does not advance */
    rf_testmode(m1);
    rf_exec *et = NULL;
    CHECK_OK(rf_compile(trace_apply, m1, &x, 1, &et));
    if (et) {
        CHECK(rf_exec_n_updates(et) == 0);
        float *v = run_once(et, x, n);
        int64_t ones_out = 0;
        for (int64_t i = 0; i < n; i++)
            ones_out += v[i] == 1.0f;
        CHECK(ones_out == n);
        free(v);
    }
    rf_exec_free(et);
done:
    rf_exec_free(e1);
    rf_exec_free(e2);
    rf_model_free(m1);
    rf_model_free(m2);
    rf_array_free(x);

    CHECK(rf_dropout(1.0, 1) == NULL);
    CHECK_MSG("Dropout");
    CHECK(rf_dropout(-0.1, 1) == NULL);
    CHECK(rf_dropout(0.0 / 0.0, 1) == NULL);
    rf_model *z = rf_dropout(0.0, 1);
    CHECK(z != NULL);
    rf_model_free(z);
}

/* ---- Embedding ---------------------------------------------------------------------------- */

/* Byte ids (a byte-level model's text) pick the same rows as i32 ids. */
static void test_embedding_byte_ids(void)
{
    const uint8_t bytes[6] = {0, 255, 7, 128, 7, 1};
    int32_t wide[6];
    for (int i = 0; i < 6; i++)
        wide[i] = bytes[i];
    rf_model *host = rf_embedding(256, 5, 3);
    rf_model *m = host ? rf_model_to(host, dev) : NULL;
    rf_array *hb = rf_array_from(RF_U8, RF_SHAPE(2, 3), bytes);
    rf_array *hw = rf_array_from(RF_I32, RF_SHAPE(2, 3), wide);
    rf_array *xb = hb ? rf_array_to(hb, dev) : NULL, *xw = hw ? rf_array_to(hw, dev) : NULL;
    rf_exec *eb = NULL, *ew = NULL;
    CHECK(m && xb && xw);
    if (m && xb && xw) {
        CHECK_OK(rf_compile(trace_apply, m, &xb, 1, &eb));
        CHECK_OK(rf_compile(trace_apply, m, &xw, 1, &ew));
    }
    if (eb && ew) {
        float *yb = run_once(eb, xb, 30), *yw = run_once(ew, xw, 30);
        CHECK(yb && yw && memcmp(yb, yw, 30 * sizeof *yb) == 0);
        CHECK(yb && yb[5] != yb[0]); /* row 255, not row 0 */
        free(yb);
        free(yw);
    }
    rf_exec_free(eb);
    rf_exec_free(ew);
    rf_array_free(xb);
    rf_array_free(xw);
    rf_array_free(hb);
    rf_array_free(hw);
    rf_model_free(m);
    rf_model_free(host);
}

/* ---- Errors and descriptions ---------------------------------------------------------------- */

/* Compiles rf_apply(m, x) for an x of the given shape/dtype and expects `st`
 * with a message containing `needle`. Consumes m. */
static void expect_trace_error(rf_model *host, rf_dtype dt, const int64_t *dims, int rank,
                               rf_status st, const char *needle)
{
    CHECK(host != NULL);
    if (!host)
        return;
    rf_model *m = rf_model_to(host, dev);
    rf_model_free(host);
    rf_array *x = rf_array_new(dev, dt, dims, rank, NULL);
    rf_exec *e = NULL;
    CHECK_STATUS(rf_compile(trace_apply, m, &x, 1, &e), st);
    CHECK_MSG(needle);
    rf_exec_free(e);
    rf_array_free(x);
    rf_model_free(m);
}

static void test_errors(void)
{
    expect_trace_error(rf_conv2d(3, 3, 1, 32, RF_ACT_IDENTITY, NULL), RF_F32,
                       RF_SHAPE(64, 3, 28, 28), RF_E_SHAPE,
                       "Conv((3, 3), 1 => 32): input f32[64,3,28,28] has 3 channels, "
                       "expected 1");
    expect_trace_error(rf_conv2d(5, 5, 1, 2, RF_ACT_IDENTITY, NULL), RF_F32,
                       RF_SHAPE(1, 1, 3, 8), RF_E_SHAPE, "than the dilated kernel");
    expect_trace_error(rf_conv2d(3, 3, 1, 2, RF_ACT_IDENTITY, NULL), RF_F32, RF_SHAPE(4, 8),
                       RF_E_SHAPE, "must be [N, C, H, W]");
    expect_trace_error(rf_conv_transpose2d(3, 3, 4, 2, RF_ACT_RELU, NULL), RF_F32,
                       RF_SHAPE(1, 2, 5, 5), RF_E_SHAPE,
                       "ConvTranspose((3, 3), 4 => 2, relu): input f32[1,2,5,5] has 2 "
                       "channels, expected 4");
    expect_trace_error(rf_maxpool(4, 4, 0, 0), RF_F32, RF_SHAPE(1, 1, 3, 8), RF_E_SHAPE,
                       "MaxPool((4, 4)): input f32[1,1,3,8] is smaller");
    expect_trace_error(rf_adaptive_meanpool(2, 3), RF_F32, RF_SHAPE(1, 1, 5, 6),
                       RF_E_UNSUPPORTED, "AdaptiveMeanPool((2, 3)): input f32[1,1,5,6] has "
                       "spatial size 5x6, not divisible by the output size 2x3");
    expect_trace_error(rf_batchnorm(3, RF_ACT_IDENTITY), RF_F32, RF_SHAPE(2, 4, 5), RF_E_SHAPE,
                       "BatchNorm(3): input f32[2,4,5] has 4 channels, expected 3");
    expect_trace_error(rf_layernorm(5), RF_F32, RF_SHAPE(2, 4), RF_E_SHAPE,
                       "LayerNorm(5): input f32[2,4] has 4 features, expected 5");
    expect_trace_error(rf_groupnorm(6, 3), RF_F32, RF_SHAPE(2, 4, 3), RF_E_SHAPE,
                       "GroupNorm(6, 3): input f32[2,4,3] has 4 channels");
    expect_trace_error(rf_embedding(7, 3, 1), RF_F32, RF_SHAPE(2, 4), RF_E_DTYPE,
                       "Embedding(7 => 3): input f32[2,4] must be integer ids");
    rf_model *bn = rf_batchnorm(2, RF_ACT_IDENTITY);
    if (bn)
        rf_trainmode(bn);
    expect_trace_error(bn, RF_F32, RF_SHAPE(1, 2), RF_E_SHAPE, "more than one");

    /* constructors */
    CHECK(rf_conv2d(3, 3, 4, 6, RF_ACT_IDENTITY, &(rf_conv_opts){.groups = 4}) == NULL);
    CHECK_MSG("groups = 4");
    CHECK(rf_conv2d(0, 3, 4, 6, RF_ACT_IDENTITY, NULL) == NULL);
    CHECK(rf_conv2d(3, 3, 4, 6, RF_ACT_IDENTITY, &(rf_conv_opts){.pad = {-1, 0}}) == NULL);
    CHECK(rf_conv2d(3, 3, 4, 6, RF_ACT_IDENTITY,
                    &(rf_conv_opts){.pad = {1, 1}, .pad_same = true}) == NULL);
    CHECK(rf_maxpool(0, 2, 0, 0) == NULL);
    CHECK(rf_adaptive_meanpool(0, 1) == NULL);
    CHECK(rf_batchnorm(0, RF_ACT_IDENTITY) == NULL);
    CHECK(rf_groupnorm(6, 4) == NULL);
    CHECK_MSG("GroupNorm(6, 4)");
    CHECK(rf_layernorm(0) == NULL);
    CHECK(rf_embedding(0, 3, 1) == NULL);

    /* descriptions, Flux style */
    rf_model *net = rf_chain(
        rf_conv2d(3, 3, 1, 16, RF_ACT_RELU, &(rf_conv_opts){.stride = {2, 2}, .pad_same = true}),
        rf_conv_transpose2d(4, 4, 16, 8, RF_ACT_IDENTITY,
                            &(rf_conv_opts){.groups = 2, .pad = {1, 1}, .no_bias = true}),
        rf_maxpool(3, 3, 2, 1), rf_meanpool(2, 2, 0, 0), rf_batchnorm(8, RF_ACT_RELU),
        rf_groupnorm(8, 4), rf_global_meanpool(), rf_dropout(0.5, 1));
    CHECK(net != NULL);
    char buf[1024];
    rf_model_summary(net, buf, sizeof buf);
    static const char *const expected[] = {
        "Conv((3, 3), 1 => 16, relu, stride=2, pad=SamePad())",
        "ConvTranspose((4, 4), 16 => 8, pad=1, groups=2, bias=false)",
        "MaxPool((3, 3), pad=1, stride=2)", "MeanPool((2, 2))", "BatchNorm(8, relu)",
        "GroupNorm(8, 4)", "GlobalMeanPool()", "Dropout(0.5)"};
    for (size_t i = 0; i < sizeof expected / sizeof *expected; i++) {
        tu_checks++;
        if (!strstr(buf, expected[i])) {
            tu_failures++;
            fprintf(stderr, "summary lacks \"%s\":\n%s\n", expected[i], buf);
        }
    }
    rf_model_free(net);
}

/* The output size of a (k x k, stride s, dilation d) SamePad Conv or
 * ConvTranspose of one channel on an in x in input; -1 if it did not compile
 * or is not square. */
static int64_t same_pad_output(bool transpose, int64_t k, int64_t s, int64_t d, int64_t in)
{
    rf_conv_opts o = {.stride = {s, s}, .dilation = {d, d}, .pad_same = true};
    rf_model *host = transpose ? rf_conv_transpose2d(k, k, 1, 1, RF_ACT_IDENTITY, &o)
                               : rf_conv2d(k, k, 1, 1, RF_ACT_IDENTITY, &o);
    rf_model *m = rf_model_to(host, dev);
    rf_model_free(host);
    rf_array *x = rf_array_new(dev, RF_F32, RF_SHAPE(1, 1, in, in), NULL);
    rf_exec *e = NULL;
    CHECK_OK(rf_compile(trace_apply, m, &x, 1, &e));
    const int64_t *dims = e ? rf_exec_output_dims(e, 0) : NULL;
    int64_t out = dims && dims[2] == dims[3] ? dims[2] : -1;
    rf_exec_free(e);
    rf_array_free(x);
    rf_model_free(m);
    return out;
}

/* SamePad keeps ceil(in / stride) for odd and even kernels and dilations. A
 * ConvTranspose is padded as a Conv of kernel k - stride + 1 (Flux), so its
 * output is (in - 1) * s + (k - 1) * d + 1 - (k - s) * d: in * s for d = 1
 * (also when the stride exceeds the kernel: a crop). */
static void test_same_pad_shapes(void)
{
    static const int64_t cases[][4] = {/* k, stride, dilation, in */
                                       {3, 1, 1, 7}, {4, 1, 1, 7}, {3, 2, 1, 7}, {4, 2, 1, 8},
                                       {3, 3, 2, 10}, {5, 2, 3, 9}, {2, 4, 1, 5}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        int64_t k = cases[i][0], s = cases[i][1], d = cases[i][2], in = cases[i][3];
        CHECK(same_pad_output(false, k, s, d, in) == (in + s - 1) / s);
    }
    static const int64_t tcases[][4] = {/* k, stride, dilation, in */
                                        {3, 1, 1, 7}, {3, 2, 1, 4}, {4, 2, 1, 4}, {5, 3, 1, 3},
                                        {2, 4, 1, 5}, {3, 2, 2, 4}};
    for (size_t i = 0; i < sizeof tcases / sizeof *tcases; i++) {
        int64_t k = tcases[i][0], s = tcases[i][1], d = tcases[i][2], in = tcases[i][3];
        int64_t want = (in - 1) * s + (k - 1) * d + 1 - (k - s) * d;
        CHECK(d != 1 || want == in * s);
        int64_t got = same_pad_output(true, k, s, d, in);
        CHECK(got == want);
        if (got != want)
            fprintf(stderr, "convtranspose same k=%lld s=%lld d=%lld in=%lld: %lld, want %lld\n",
                    (long long)k, (long long)s, (long long)d, (long long)in, (long long)got,
                    (long long)want);
    }
}

int main(void)
{
    dev = rf_device_default();
    if (fx_load(&fx, "layers.txt") != 0)
        return 1;
    test_reference_cases();
    test_batchnorm_updates();
    test_dropout();
    test_embedding_byte_ids();
    test_errors();
    test_same_pad_shapes();
    fx_free(&fx);
    return tu_finish("test_layers_ref");
}
