/* layers_norm.c: normalisation layers: BatchNorm, LayerNorm, GroupNorm.
 *
 * All three normalise with the biased variance and eps 1e-5 and apply a
 * learned affine map (parameters "weight", ones, and "bias", zeros: Flux's
 * scale and bias under PyTorch's names, as checkpoints use them), as Flux
 * and PyTorch do. BatchNorm keeps running statistics as state arrays
 * ("running_mean", zeros; "running_var", ones): in train mode it normalises
 * with the batch statistics and records rf_assign updates
 * running = (1 - 0.1) * running + 0.1 * batch, the variance there being the
 * unbiased one (PyTorch and Flux agree); in test mode it uses the running
 * statistics and records nothing.
 *
 * Deliberately not here: LayerNorm over several trailing axes, affine-free
 * variants, BatchNorm without tracked statistics, instance norm.
 *
 * Layers only build IR through the public op API and never touch array data.
 */
#include "model.h"

#include <stdio.h>
#include <string.h>

#define NORM_EPS 1e-5
#define BN_MOMENTUM 0.1

/* ---- Shared helpers ------------------------------------------------------------------------ */


/* Checks that x is floating point, of rank >= min_rank, with `features`
 * entries along `axis`. */
static bool check_input(rf_model *m, rf_tensor *x, int min_rank, const char *layout, int axis,
                        int64_t features, const char *what)
{
    int rank = rf_tensor_rank(x);
    rf_dtype dt = rf_tensor_dtype(x);
    if (rank < min_rank) {
        rfi_layer_input_error(m, x, RF_E_SHAPE, "must be %s", layout);
        return false;
    }
    if (dt != RF_F32 && dt != RF_F64) {
        rfi_layer_input_error(m, x, RF_E_DTYPE, "must be floating point");
        return false;
    }
    if (!rfi_layer_check_dtype(m, x))
        return false;
    if (rf_tensor_dim(x, axis) != features) {
        rfi_layer_input_error(m, x, RF_E_SHAPE, "has %lld %s, expected %lld",
                              (long long)rf_tensor_dim(x, axis), what, (long long)features);
        return false;
    }
    return true;
}

/* v [C] reshaped to broadcast along axis 1 of a rank-`rank` tensor: [1, C, 1, ...]. */
static rf_tensor *per_channel(rf_tensor *v, int rank)
{
    int64_t dims[RF_MAX_RANK];
    for (int i = 0; i < rank; i++)
        dims[i] = 1;
    dims[1] = rf_tensor_dim(v, 0);
    return rf_reshape(v, dims, rank);
}

/* (x - mean) / sqrt(var + eps) */
static rf_tensor *standardise(rf_tensor *x, rf_tensor *mean, rf_tensor *var)
{
    return rf_mul(rf_sub(x, mean), rf_rsqrt(rf_add_s(var, NORM_EPS)));
}

/* A layer with ones "weight" (Flux's scale) and zeros "bias" parameters of size n. */
static rf_model *affine_layer(const rf_layer_type *type, const void *config, size_t size,
                              int64_t n)
{
    rf_model *m = rf_model_new(type, config, size);
    if (!m)
        return NULL;
    const int64_t dims[1] = {n};
    rf_status st = rf_model_add_param(m, "weight", rf_ones(RF_F32, dims, 1));
    if (st == RF_OK)
        st = rf_model_add_param(m, "bias", rf_zeros(RF_F32, dims, 1));
    if (st != RF_OK) {
        rf_model_free(m);
        return NULL;
    }
    return m;
}

/* ---- BatchNorm ---------------------------------------------------------------------------- */

typedef struct batchnorm_config {
    int64_t channels;
    int32_t act;
    int32_t reserved; /* zero: config bytes are hashed */
} batchnorm_config;

static void batchnorm_describe(const rf_model *m, char *buf, size_t n)
{
    const batchnorm_config *c = rf_model_config(m);
    if (c->act == RF_ACT_IDENTITY)
        snprintf(buf, n, "%lld", (long long)c->channels);
    else
        snprintf(buf, n, "%lld, %s", (long long)c->channels, rf_act_name((rf_act)c->act));
}

/* Records running <- (1 - momentum) * running + momentum * batch for state i. */
static void update_running(rf_model *m, rf_trace *t, int i, rf_tensor *batch)
{
    rf_tensor *running = rf_model_state(m, t, i);
    rf_tensor *next = rf_add(rf_mul_s(running, 1.0 - BN_MOMENTUM), rf_mul_s(batch, BN_MOMENTUM));
    if (next)
        rf_assign(t, rf_model_state_array(m, i), rf_stop_gradient(next));
}

static rf_tensor *batchnorm_forward(rf_model *m, rf_tensor *x)
{
    const batchnorm_config *c = rf_model_config(m);
    rf_trace *t = rf_tensor_trace(x);
    if (!check_input(m, x, 2, "[N, C, ...]", 1, c->channels, "channels"))
        return NULL;
    int rank = rf_tensor_rank(x);
    rf_tensor *mean, *var;
    if (rf_model_training(m)) {
        int64_t axes[RF_MAX_RANK], count = rf_tensor_numel(x) / c->channels;
        axes[0] = 0;
        for (int i = 2; i < rank; i++)
            axes[i - 1] = i;
        if (count < 2)
            return rfi_layer_input_error(m, x, RF_E_SHAPE,
                                         "has %lld value per channel; train mode needs more than "
                                         "one for the batch variance", (long long)count);
        mean = rf_mean(x, axes, rank - 1, true);
        var = rf_var(x, axes, rank - 1, true);
        const int64_t flat[1] = {c->channels};
        update_running(m, t, 0, rf_reshape(mean, flat, 1));
        /* the running variance is the unbiased one */
        update_running(m, t, 1, rf_mul_s(rf_reshape(var, flat, 1),
                                         (double)count / (double)(count - 1)));
    } else {
        mean = per_channel(rf_model_state(m, t, 0), rank);
        var = per_channel(rf_model_state(m, t, 1), rank);
    }
    rf_tensor *scale = per_channel(rf_model_param(m, t, 0), rank);
    rf_tensor *bias = per_channel(rf_model_param(m, t, 1), rank);
    rf_tensor *y = rf_add(rf_mul(standardise(x, mean, var), scale), bias);
    return rf_activate(y, (rf_act)c->act);
}

static const rf_layer_type batchnorm_type = {"BatchNorm", batchnorm_forward,
                                             batchnorm_describe};

rf_model *rf_batchnorm(int64_t channels, rf_act act)
{
    if (channels < 1 || (unsigned)act >= RF_ACT_COUNT) {
        rfi_error(RF_E_INVALID, "BatchNorm(%lld): %s", (long long)channels,
                  channels < 1 ? "the channel count must be positive" : "unknown activation");
        return NULL;
    }
    batchnorm_config c;
    memset(&c, 0, sizeof c);
    c.channels = channels;
    c.act = (int32_t)act;
    rf_model *m = affine_layer(&batchnorm_type, &c, sizeof c, channels);
    if (!m)
        return NULL;
    const int64_t dims[1] = {channels};
    rf_status st = rf_model_add_state(m, "running_mean", rf_zeros(RF_F32, dims, 1));
    if (st == RF_OK)
        st = rf_model_add_state(m, "running_var", rf_ones(RF_F32, dims, 1));
    if (st != RF_OK) {
        rf_model_free(m);
        return NULL;
    }
    return m;
}

/* ---- LayerNorm ---------------------------------------------------------------------------- */

typedef struct layernorm_config {
    int64_t features;
} layernorm_config;

static void layernorm_describe(const rf_model *m, char *buf, size_t n)
{
    const layernorm_config *c = rf_model_config(m);
    snprintf(buf, n, "%lld", (long long)c->features);
}

static rf_tensor *layernorm_forward(rf_model *m, rf_tensor *x)
{
    const layernorm_config *c = rf_model_config(m);
    rf_trace *t = rf_tensor_trace(x);
    if (!check_input(m, x, 1, "[..., features]", -1, c->features, "features"))
        return NULL;
    const int64_t last[1] = {rf_tensor_rank(x) - 1};
    rf_tensor *y = standardise(x, rf_mean(x, last, 1, true), rf_var(x, last, 1, true));
    /* scale and bias [features] broadcast along the last axis as they are */
    return rf_add(rf_mul(y, rf_model_param(m, t, 0)), rf_model_param(m, t, 1));
}

static const rf_layer_type layernorm_type = {"LayerNorm", layernorm_forward,
                                             layernorm_describe};

rf_model *rf_layernorm(int64_t features)
{
    if (features < 1) {
        rfi_error(RF_E_INVALID, "LayerNorm(%lld): the feature count must be positive",
                  (long long)features);
        return NULL;
    }
    layernorm_config c = {features};
    return affine_layer(&layernorm_type, &c, sizeof c, features);
}

/* ---- GroupNorm ---------------------------------------------------------------------------- */

typedef struct groupnorm_config {
    int64_t channels, groups;
} groupnorm_config;

static void groupnorm_describe(const rf_model *m, char *buf, size_t n)
{
    const groupnorm_config *c = rf_model_config(m);
    snprintf(buf, n, "%lld, %lld", (long long)c->channels, (long long)c->groups);
}

/* x [N, C, ...] seen as [N, G, C/G, ...], normalised over all axes but N and G. */
static rf_tensor *groupnorm_forward(rf_model *m, rf_tensor *x)
{
    const groupnorm_config *c = rf_model_config(m);
    rf_trace *t = rf_tensor_trace(x);
    if (!check_input(m, x, 2, "[N, C, ...]", 1, c->channels, "channels"))
        return NULL;
    int rank = rf_tensor_rank(x);
    if (rank + 1 > RF_MAX_RANK)
        return rfi_layer_input_error(m, x, RF_E_UNSUPPORTED,
                                     "has rank %d; at most %d is supported", rank,
                                     RF_MAX_RANK - 1);
    const int64_t *dims = rf_tensor_dims(x);
    int64_t grouped[RF_MAX_RANK], axes[RF_MAX_RANK];
    grouped[0] = dims[0];
    grouped[1] = c->groups;
    grouped[2] = c->channels / c->groups;
    for (int i = 2; i < rank; i++)
        grouped[i + 1] = dims[i];
    for (int i = 2; i <= rank; i++)
        axes[i - 2] = i;
    rf_tensor *g = rf_reshape(x, grouped, rank + 1);
    g = standardise(g, rf_mean(g, axes, rank - 1, true), rf_var(g, axes, rank - 1, true));
    rf_tensor *y = rf_reshape(g, dims, rank);
    rf_tensor *scale = per_channel(rf_model_param(m, t, 0), rank);
    rf_tensor *bias = per_channel(rf_model_param(m, t, 1), rank);
    return rf_add(rf_mul(y, scale), bias);
}

static const rf_layer_type groupnorm_type = {"GroupNorm", groupnorm_forward,
                                             groupnorm_describe};

rf_model *rf_groupnorm(int64_t channels, int64_t groups)
{
    if (channels < 1 || groups < 1 || channels % groups) {
        rfi_error(RF_E_INVALID, "GroupNorm(%lld, %lld): the group count must be positive and "
                  "divide the channel count", (long long)channels, (long long)groups);
        return NULL;
    }
    groupnorm_config c = {channels, groups};
    return affine_layer(&groupnorm_type, &c, sizeof c, channels);
}
