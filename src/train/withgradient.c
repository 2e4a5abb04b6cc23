/* withgradient.c: Flux's withgradient inside a trace: evaluates a loss on a
 * batch and records the gradient of that loss with respect to every trainable
 * parameter of the model (rf_grads, trace-owned, in rf_model_visit order).
 *
 * Parameters are differentiated through their capture nodes: rf_model_param
 * is rf_capture, and capturing an array twice gives the same node, so the
 * node we differentiate by is the one the layers read. It does not update
 * anything: rf_update (optim/) and the trainstep (trainstep.c) do.
 */
#include "train_internal.h"

int rf_grads_count(const rf_grads *g) { return g ? g->n : 0; }

rf_tensor *rf_grads_get(const rf_grads *g, int i)
{
    if (!g || i < 0 || i >= g->n)
        return NULL;
    return g->g[i];
}

/* Checks the inputs of rf_withgradient, recording a trace error. */
static bool valid_call(rf_trace *t, rf_loss_fn loss, rf_model *m, rf_tensor *const *batch,
                       int n)
{
    if (!loss || !m) {
        rfi_graph_fail(t, RF_E_INVALID, "rf_withgradient: %s is NULL", !loss ? "loss" : "model");
        return false;
    }
    if (n < 0 || (n > 0 && !batch)) {
        rfi_graph_fail(t, RF_E_INVALID, "rf_withgradient: batch is %s with n = %d",
                       batch ? "given" : "NULL", n);
        return false;
    }
    for (int i = 0; i < n; i++) {
        if (!batch[i]) {
            rfi_graph_fail(t, RF_E_INVALID, "rf_withgradient: batch[%d] is NULL", i);
            return false;
        }
        if (batch[i]->g != t) {
            rfi_graph_fail(t, RF_E_INVALID, "rf_withgradient: batch[%d] belongs to another "
                           "trace", i);
            return false;
        }
    }
    return true;
}

/* Checks that the loss function returned a float scalar of trace t. */
static bool valid_loss(rf_trace *t, const rf_tensor *y)
{
    if (!y) {
        if (t->status == RF_OK)
            rfi_graph_fail(t, RF_E_INVALID, "rf_withgradient: the loss function returned NULL");
        return false;
    }
    if (t->status != RF_OK)
        return false;
    if (y->g != t) {
        rfi_graph_fail(t, RF_E_INVALID, "rf_withgradient: the loss belongs to another trace");
        return false;
    }
    if (y->rank != 0 || !rfi_dtype_is_float(y->dtype)) {
        char ty[128];
        rfi_graph_fail(t, y->rank != 0 ? RF_E_SHAPE : RF_E_DTYPE,
                       "rf_withgradient: the loss must be a float scalar, got %s (reduce it, "
                       "e.g. with rf_mean_all)",
                       rfi_type_str(ty, sizeof ty, y->dtype, y->dims, y->rank));
        return false;
    }
    return true;
}

/* The capture nodes of the n trainable parameters (arena), or NULL with a
 * trace error. */
static rf_tensor **capture_params(rf_trace *t, rf_array **params, int n)
{
    rf_tensor **wrt = rfi_arena_alloc(&t->arena, (size_t)(n > 0 ? n : 1) * sizeof *wrt);
    if (!wrt) {
        rfi_graph_fail(t, RF_E_NOMEM, "rf_withgradient: out of memory");
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        if (params[i]->device->kind == RF_DEVICE_HOST) {
            char ty[128];
            rfi_graph_fail(t, RF_E_DEVICE, "rf_withgradient: parameter %d (%s) lives on the "
                           "host; move the model to %s with rf_model_to", i,
                           rfi_type_str(ty, sizeof ty, params[i]->dtype, params[i]->dims,
                                        params[i]->rank),
                           rf_device_name(t->device));
            return NULL;
        }
        wrt[i] = rf_capture(t, params[i]);
        if (!wrt[i])
            return NULL;
    }
    return wrt;
}

/* d y / d p for every trainable parameter p of m (trace-owned), or NULL. */
static rf_grads *param_grads(rf_trace *t, rf_model *m, rf_tensor *y)
{
    rf_array **params = NULL;
    int n = rfi_model_collect_params(m, &params);
    if (n < 0) {
        rfi_graph_fail(t, RF_E_NOMEM, "rf_withgradient: out of memory collecting parameters");
        return NULL;
    }
    rf_grads *g = rfi_arena_alloc(&t->arena, sizeof *g);
    rf_tensor **out = rfi_arena_alloc(&t->arena, (size_t)(n > 0 ? n : 1) * sizeof *out);
    rf_tensor **wrt = g && out ? capture_params(t, params, n) : NULL;
    rfi_free(params);
    if (!g || !out) {
        rfi_graph_fail(t, RF_E_NOMEM, "rf_withgradient: out of memory");
        return NULL;
    }
    if (!wrt)
        return NULL;
    if (n > 0 && rf_grad(t, y, wrt, n, out) != RF_OK)
        return NULL;
    g->n = n;
    g->g = out;
    return g;
}

rf_tensor *rf_withgradient(rf_trace *t, rf_loss_fn loss, void *ctx, rf_model *m,
                           rf_tensor *const *batch, int n, rf_aux **aux, rf_grads **g)
{
    if (aux)
        *aux = NULL;
    if (g)
        *g = NULL;
    if (!t) {
        rfi_error(RF_E_INVALID, "rf_withgradient: trace is NULL");
        return NULL;
    }
    if (t->status != RF_OK || !valid_call(t, loss, m, batch, n))
        return NULL;
    /* The loss always gets an aux record, so it may call rf_aux_set even when
     * the caller does not want the values. */
    rf_aux *a = rfi_aux_new(t);
    if (!a)
        return NULL;
    rf_tensor *y = loss(m, batch, n, a, ctx);
    if (!valid_loss(t, y))
        return NULL;
    rf_grads *grads = param_grads(t, m, y);
    if (!grads)
        return NULL;
    if (aux)
        *aux = a;
    if (g)
        *g = grads;
    return y;
}
