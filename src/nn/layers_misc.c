/* layers_misc.c: Dropout and Embedding.
 *
 * Dropout keeps an RNG key (rf_rng_key_new, state array "key") that moves
 * with the model; in train mode each run draws a fresh uniform mask from it
 * (rf_rng_key advances the key's counter once per run) and keeps an element
 * where u >= p, scaling it by 1/(1-p). In test mode it is the identity and
 * the key does not advance.
 *
 * Embedding looks rows of its weight [vocab, dim] up by integer ids. Ids are
 * not range-checked at run time (that would need the data): out-of-range ids
 * are clamped, as rf_gather (StableHLO) does, where Flux would throw.
 *
 * Layers only build IR through the public op API and never touch array data
 * except for host-side initialisation.
 */
#include "model.h"

#include <stdio.h>
#include <string.h>


/* ---- Dropout ---------------------------------------------------------------------------- */

typedef struct dropout_config {
    double p;
} dropout_config;

static void dropout_describe(const rf_model *m, char *buf, size_t n)
{
    const dropout_config *c = rf_model_config(m);
    snprintf(buf, n, "%g", c->p);
}

static rf_tensor *dropout_forward(rf_model *m, rf_tensor *x)
{
    const dropout_config *c = rf_model_config(m);
    if (c->p == 0.0 || !rf_model_training(m)) /* p 0: the same program in both modes */
        return x;
    rf_dtype dt = rf_tensor_dtype(x);
    if (dt != RF_F32 && dt != RF_F64)
        return rfi_layer_input_error(m, x, RF_E_DTYPE, "must be floating point");
    rf_trace *t = rf_tensor_trace(x);
    rf_array *key_array = rf_model_state_array(m, 0);
    if (!rf_model_state(m, t, 0)) /* names the layer if the key is on the wrong device */
        return NULL;
    rf_tensor *u = rf_rng_uniform(rf_rng_key(t, key_array), dt, rf_tensor_dims(x),
                                  rf_tensor_rank(x));
    rf_tensor *keep = rf_compare(u, rf_scalar_typed(t, dt, c->p), RF_GE);
    return rf_select(keep, rf_mul_s(x, 1.0 / (1.0 - c->p)), rf_scalar_typed(t, dt, 0.0));
}

static const rf_layer_type dropout_type = {"Dropout", dropout_forward, dropout_describe};

rf_model *rf_dropout(double p, uint64_t seed)
{
    if (!(p >= 0.0 && p < 1.0)) {
        rfi_error(RF_E_INVALID, "Dropout(%g): p must be in [0, 1)", p);
        return NULL;
    }
    dropout_config c;
    memset(&c, 0, sizeof c);
    c.p = p;
    rf_model *m = rf_model_new(&dropout_type, &c, sizeof c);
    if (!m)
        return NULL;
    rf_array *key = rf_rng_key_new(rfi_nn_next_seed(seed), rf_device_host());
    if (rf_model_add_state(m, "key", key) != RF_OK) {
        rf_model_free(m);
        return NULL;
    }
    return m;
}

/* ---- Embedding ---------------------------------------------------------------------------- */

typedef struct embedding_config {
    int64_t vocab, dim;
} embedding_config;

static void embedding_describe(const rf_model *m, char *buf, size_t n)
{
    const embedding_config *c = rf_model_config(m);
    snprintf(buf, n, "%lld => %lld", (long long)c->vocab, (long long)c->dim);
}

/* ids [...] -> [..., dim] */
static rf_tensor *embedding_forward(rf_model *m, rf_tensor *ids)
{
    rf_dtype dt = rf_tensor_dtype(ids);
    if (dt != RF_I32 && dt != RF_I64 && dt != RF_U8)
        return rfi_layer_input_error(m, ids, RF_E_DTYPE,
                                     "must be integer ids (i32, i64 or u8)");
    if (dt == RF_U8) /* bytes as tokens; gather indexes with i32 or i64 */
        ids = rf_convert(ids, RF_I32);
    return rf_gather(rf_model_param(m, rf_tensor_trace(ids), 0), ids, 0);
}

static const rf_layer_type embedding_type = {"Embedding", embedding_forward,
                                             embedding_describe};

rf_model *rf_embedding(int64_t vocab, int64_t dim, uint64_t seed)
{
    if (vocab < 1 || dim < 1) {
        rfi_error(RF_E_INVALID, "Embedding(%lld => %lld): sizes must be positive",
                  (long long)vocab, (long long)dim);
        return NULL;
    }
    embedding_config c = {vocab, dim};
    rf_model *m = rf_model_new(&embedding_type, &c, sizeof c);
    if (!m)
        return NULL;
    const int64_t dims[2] = {vocab, dim};
    if (rf_model_add_param(m, "weight", rf_randn(RF_F32, dims, 2, rfi_nn_next_seed(seed))) !=
        RF_OK) {
        rf_model_free(m);
        return NULL;
    }
    return m;
}
