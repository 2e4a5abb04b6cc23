/* layer_activation.c: an activation function as a parameterless layer, for
 * chains that apply an activation after a combination (e.g. relu after a
 * residual addition). It only wraps rf_activate; it holds no arrays.
 */
#include "model.h"

#include <stdio.h>

typedef struct activation_config {
    rf_act act;
} activation_config;

static rf_tensor *activation_forward(rf_model *m, rf_tensor *x)
{
    const activation_config *c = rf_model_config(m);
    return rf_activate(x, c->act);
}

static void activation_describe(const rf_model *m, char *buf, size_t n)
{
    const activation_config *c = rf_model_config(m);
    snprintf(buf, n, "Activation(%s)", rf_act_name(c->act));
}

static const rf_layer_type activation_type = {"Activation", activation_forward,
                                              activation_describe};

rf_model *rf_activation_layer(rf_act act)
{
    if ((unsigned)act >= RF_ACT_COUNT) {
        rfi_error(RF_E_INVALID, "rf_activation_layer: unknown activation %d", (int)act);
        return NULL;
    }
    activation_config c = {act};
    return rf_model_new(&activation_type, &c, sizeof c);
}
