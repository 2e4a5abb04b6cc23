/* activation.c: the rf_act enum applied to traced tensors, and its names.
 *
 * Each activation is one of the ops.h composites (Flux's definitions: gelu
 * with the tanh approximation, leakyrelu slope 0.01, elu alpha 1, softmax and
 * logsoftmax over the feature axis 1). Nothing here computes: it only picks
 * the op.
 */
#include "reflux.h"

#include <stddef.h>

rf_tensor *rf_activate(rf_tensor *x, rf_act act)
{
    if (!x)
        return NULL;
    switch (act) {
    case RF_ACT_IDENTITY: return x;
    case RF_ACT_RELU: return rf_relu(x);
    case RF_ACT_LEAKYRELU: return rf_leakyrelu(x, 0.01);
    case RF_ACT_ELU: return rf_elu(x, 1.0);
    case RF_ACT_GELU: return rf_gelu(x);
    case RF_ACT_SWISH: return rf_swish(x);
    case RF_ACT_SIGMOID: return rf_sigmoid(x);
    case RF_ACT_TANH: return rf_tanh(x);
    case RF_ACT_SOFTPLUS: return rf_softplus(x);
    case RF_ACT_SOFTMAX: return rf_softmax(x, 1);
    case RF_ACT_LOGSOFTMAX: return rf_logsoftmax(x, 1);
    case RF_ACT_COUNT: break;
    }
    rf_trace_fail(rf_tensor_trace(x), RF_E_INVALID, "rf_activate: unknown activation %d",
                  (int)act);
    return NULL;
}

/* Flux's names (sigmoid is σ there; we keep to ASCII). */
const char *rf_act_name(rf_act act)
{
    static const char *const names[RF_ACT_COUNT] = {
        "identity", "relu", "leakyrelu", "elu", "gelu", "swish",
        "sigmoid", "tanh", "softplus", "softmax", "logsoftmax",
    };
    if ((unsigned)act >= RF_ACT_COUNT)
        return "unknown";
    return names[act];
}
