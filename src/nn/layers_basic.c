/* layers_basic.c: Dense, Flatten and the containers Chain, SkipConnection and
 * Parallel.
 *
 * Each layer is an rf_layer_type (forward + describe) over the generic model
 * tree of model.c, exactly as a user-written layer would be: forward
 * functions only build IR through the public op API. Weights are made on the
 * host by the initialisers of init.c; rf_model_to moves them.
 *
 * Not here: convolutions, pooling, normalisation, dropout, embeddings (their
 * own files), losses.
 */
#include "model.h"

#include <stdio.h>
#include <string.h>

/* ---- Dense ------------------------------------------------------------------------------- */

typedef struct dense_config {
    int64_t in, out;
    int32_t act;  /* rf_act */
    int32_t bias; /* 1: has a bias (parameter 1) */
} dense_config;

static void dense_describe(const rf_model *m, char *buf, size_t n)
{
    const dense_config *c = rf_model_config(m);
    snprintf(buf, n, "%lld => %lld%s%s%s", (long long)c->in, (long long)c->out,
             c->act != RF_ACT_IDENTITY ? ", " : "",
             c->act != RF_ACT_IDENTITY ? rf_act_name((rf_act)c->act) : "",
             c->bias ? "" : "; bias=false");
}

/* x [..., in] -> act(x W^T + b) [..., out]. Leading dims are folded into one
 * batch dim for the matrix product and restored afterwards; the activation is
 * applied on the [M, out] form so softmax runs over the features. */
static rf_tensor *dense_forward(rf_model *m, rf_tensor *x)
{
    const dense_config *c = rf_model_config(m);
    rf_trace *t = rf_tensor_trace(x);
    int rank = rf_tensor_rank(x);
    if (rank < 1 || rf_tensor_dim(x, -1) != c->in) {
        char desc[128], ty[128];
        rfi_model_describe(m, desc, sizeof desc);
        rfi_type_str(ty, sizeof ty, rf_tensor_dtype(x), rf_tensor_dims(x), rank);
        if (rank < 1)
            rf_trace_fail(t, RF_E_SHAPE, "%s: input %s is a scalar, expected [N, %lld]", desc, ty,
                          (long long)c->in);
        else
            rf_trace_fail(t, RF_E_SHAPE, "%s: input %s has %lld features, expected %lld", desc,
                          ty, (long long)rf_tensor_dim(x, -1), (long long)c->in);
        return NULL;
    }
    if (!rfi_layer_check_dtype(m, x))
        return NULL;
    rf_tensor *w = rf_model_param(m, t, 0);
    rf_tensor *b = c->bias ? rf_model_param(m, t, 1) : NULL;
    if (rank == 2)
        return rf_activate(rf_linear(x, w, b), (rf_act)c->act);

    int64_t flat[2] = {-1, c->in};
    rf_tensor *y = rf_activate(rf_linear(rf_reshape(x, flat, 2), w, b), (rf_act)c->act);
    int64_t dims[RF_MAX_RANK];
    memcpy(dims, rf_tensor_dims(x), (size_t)rank * sizeof *dims);
    dims[rank - 1] = c->out;
    return rf_reshape(y, dims, rank);
}

static const rf_layer_type dense_type = {"Dense", dense_forward, dense_describe};

rf_model *rf_dense_ex(int64_t in, int64_t out, rf_act act, const rf_dense_opts *o)
{
    rf_dense_opts d = {0};
    if (!o)
        o = &d;
    if (in <= 0 || out <= 0 || (unsigned)act >= RF_ACT_COUNT ||
        (unsigned)o->init >= RF_INIT_COUNT) {
        rfi_error(RF_E_INVALID, "rf_dense(%lld => %lld): %s", (long long)in, (long long)out,
                  in <= 0 || out <= 0 ? "sizes must be positive"
                  : (unsigned)act >= RF_ACT_COUNT ? "unknown activation"
                                                  : "unknown initialiser");
        return NULL;
    }
    dense_config c = {in, out, (int32_t)act, o->no_bias ? 0 : 1};
    rf_model *m = rf_model_new(&dense_type, &c, sizeof c);
    if (!m)
        return NULL;
    uint64_t seed = rfi_nn_next_seed(o->seed);
    rf_status st = rf_model_add_param(m, "weight", rf_init_array(o->init, RF_SHAPE(out, in), seed));
    if (st == RF_OK && c.bias)
        st = rf_model_add_param(m, "bias", rf_zeros(RF_F32, RF_SHAPE(out)));
    if (st != RF_OK) {
        rf_model_free(m);
        return NULL;
    }
    return m;
}

rf_model *rf_dense(int64_t in, int64_t out, rf_act act)
{
    return rf_dense_ex(in, out, act, NULL);
}

/* ---- Flatten ------------------------------------------------------------------------------ */

static rf_tensor *flatten_forward(rf_model *m, rf_tensor *x)
{
    (void)m;
    return rf_flatten(x);
}

static const rf_layer_type flatten_type = {"Flatten", flatten_forward, NULL};

rf_model *rf_flatten_layer(void) { return rf_model_new(&flatten_type, NULL, 0); }

/* ---- Building containers ----------------------------------------------------------------- */

/* Frees layers[0..n) (NULL entries skipped). */
/* Frees each entry once (a list may name a layer twice), but not one that
 * belongs to a model: its owner frees it. */
static void free_layers(rf_model *const *layers, int n)
{
    for (int i = 0; i < n; i++) {
        bool seen = layers[i] && layers[i]->parent;
        for (int j = 0; j < i && !seen; j++)
            seen = layers[j] == layers[i];
        if (!seen)
            rf_model_free(layers[i]);
    }
}

/* Reports a NULL entry of a layer list. A NULL there almost always comes from
 * a constructor that failed as an argument, so the last error before this call
 * (still in the buffer; another argument's when several failed) is kept: it
 * says why, where "layer 1 is NULL" alone would not. */
static void null_layer_error(const char *op, int i)
{
    char why[RFI_ERRMSG_MAX];
    snprintf(why, sizeof why, "%s", rf_errmsg());
    if (why[0])
        rfi_error(RF_E_INVALID, "%s: layer %d is NULL (a layer constructor failed; the last "
                  "error before this call: %s)", op, i, why);
    else
        rfi_error(RF_E_INVALID, "%s: layer %d is NULL (its constructor failed)", op, i);
}

/* A container of `type` owning layers[0..n) (taken over also on failure). */
static rf_model *container(const char *op, const rf_layer_type *type, const void *config,
                           size_t config_size, rf_model *const *layers, int n)
{
    if (n < 0 || (n > 0 && !layers)) {
        rfi_error(RF_E_INVALID, "%s: invalid layer list (n = %d)", op, n);
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        if (!layers[i]) {
            free_layers(layers, n);
            null_layer_error(op, i);
            return NULL;
        }
    }
    rf_model *m = rf_model_new(type, config, config_size);
    if (!m) {
        free_layers(layers, n);
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        if (rf_model_add_child(m, layers[i]) != RF_OK) {
            free_layers(layers + i + 1, n - i - 1);
            rf_model_free(m);
            return NULL;
        }
    }
    return m;
}

/* ---- Chain ------------------------------------------------------------------------------- */

static rf_tensor *chain_forward(rf_model *m, rf_tensor *x)
{
    for (int i = 0; i < rf_model_n_children(m) && x; i++)
        x = rf_apply(rf_model_child(m, i), x);
    return x;
}

static const rf_layer_type chain_type = {"Chain", chain_forward, NULL};

rf_model *rf_chain_n(rf_model *const *layers, int n)
{
    return container("rf_chain", &chain_type, NULL, 0, layers, n);
}

/* ---- Combining several results ----------------------------------------------------------- */

typedef struct combine_config {
    int32_t combine; /* rf_combine */
} combine_config;

static const char *combine_name(rf_combine c)
{
    switch (c) {
    case RF_COMBINE_ADD: return "+";
    case RF_COMBINE_MUL: return "*";
    case RF_COMBINE_CONCAT_CHANNELS: return "cat(channels)";
    }
    return "?";
}

static void combine_describe(const rf_model *m, char *buf, size_t n)
{
    const combine_config *c = rf_model_config(m);
    snprintf(buf, n, "%s", combine_name((rf_combine)c->combine));
}

static bool same_shape(const rf_tensor *a, const rf_tensor *b)
{
    int rank = rf_tensor_rank(a);
    if (rank != rf_tensor_rank(b))
        return false;
    for (int d = 0; d < rank; d++)
        if (rf_tensor_dim(a, d) != rf_tensor_dim(b, d))
            return false;
    return true;
}

/* combine(ys[0], ..., ys[n-1]) for layer m on input x: sums, products (of
 * equal shapes: Flux's + and * do not broadcast), or a concatenation along
 * the channel axis 1 (NCHW channels, [N, F] features). */
static rf_tensor *combine(rf_model *m, rf_tensor *x, rf_combine how, rf_tensor *const *ys,
                          int n)
{
    for (int i = 0; i < n; i++)
        if (!ys[i])
            return NULL;
    if (how == RF_COMBINE_CONCAT_CHANNELS)
        return rf_concatenate(ys, n, 1);
    for (int i = 1; i < n; i++) {
        if (!same_shape(ys[0], ys[i])) {
            char a[128], b[128];
            rfi_type_str(a, sizeof a, rf_tensor_dtype(ys[0]), rf_tensor_dims(ys[0]),
                         rf_tensor_rank(ys[0]));
            rfi_type_str(b, sizeof b, rf_tensor_dtype(ys[i]), rf_tensor_dims(ys[i]),
                         rf_tensor_rank(ys[i]));
            return rfi_layer_input_error(m, x, RF_E_SHAPE, "gives results of different "
                                         "shapes to %s: %s (0) and %s (%d)",
                                         how == RF_COMBINE_ADD ? "add" : "multiply", a, b, i);
        }
    }
    rf_tensor *acc = ys[0];
    for (int i = 1; i < n; i++)
        acc = how == RF_COMBINE_ADD ? rf_add(acc, ys[i]) : rf_mul(acc, ys[i]);
    return acc;
}

static bool combine_valid(rf_combine c)
{
    return c == RF_COMBINE_ADD || c == RF_COMBINE_MUL || c == RF_COMBINE_CONCAT_CHANNELS;
}

/* ---- SkipConnection ---------------------------------------------------------------------- */

static rf_tensor *skip_forward(rf_model *m, rf_tensor *x)
{
    const combine_config *c = rf_model_config(m);
    if (rf_model_n_children(m) != 1)
        return rfi_layer_input_error(m, x, RF_E_INVALID, "cannot be combined: a "
                                     "SkipConnection holds one layer, this one %d",
                                     rf_model_n_children(m));
    rf_tensor *ys[2] = {rf_apply(rf_model_child(m, 0), x), x};
    return combine(m, x, (rf_combine)c->combine, ys, 2);
}

static const rf_layer_type skip_type = {"SkipConnection", skip_forward, combine_describe};

rf_model *rf_skip(rf_model *layer, rf_combine how)
{
    if (!combine_valid(how)) {
        rf_model_free(layer);
        rfi_error(RF_E_INVALID, "rf_skip: unknown combine %d", (int)how);
        return NULL;
    }
    combine_config c = {(int32_t)how};
    return container("rf_skip", &skip_type, &c, sizeof c, &layer, 1);
}

/* ---- Parallel ---------------------------------------------------------------------------- */

/* Parallel layers are few; this bounds the stack array of their results. */
#define PARALLEL_MAX 64

static rf_tensor *parallel_forward(rf_model *m, rf_tensor *x)
{
    const combine_config *c = rf_model_config(m);
    int n = rf_model_n_children(m);
    if (n < 1 || n > PARALLEL_MAX) /* rf_model_add_child may have changed the count */
        return rfi_layer_input_error(m, x, RF_E_INVALID, "cannot be combined: a Parallel "
                                     "holds 1 to %d layers, this one %d", PARALLEL_MAX, n);
    rf_tensor *ys[PARALLEL_MAX];
    for (int i = 0; i < n; i++)
        ys[i] = rf_apply(rf_model_child(m, i), x);
    return combine(m, x, (rf_combine)c->combine, ys, n);
}

static const rf_layer_type parallel_type = {"Parallel", parallel_forward, combine_describe};

rf_model *rf_parallel_n(rf_combine how, rf_model *const *layers, int n)
{
    if (!combine_valid(how) || n < 1 || n > PARALLEL_MAX) {
        if (layers && n > 0)
            free_layers(layers, n);
        rfi_error(RF_E_INVALID, "rf_parallel: %s",
                  !combine_valid(how) ? "unknown combine"
                  : n < 1             ? "needs at least one layer"
                                      : "too many layers (at most 64)");
        return NULL;
    }
    combine_config c = {(int32_t)how};
    return container("rf_parallel", &parallel_type, &c, sizeof c, layers, n);
}
