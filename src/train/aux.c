/* aux.c: auxiliary loss outputs: named scalars a loss records with
 * rf_aux_set (accuracy, a regulariser's value), kept in the trace's arena, and
 * their host-side values (rf_stats).
 *
 * It does not run anything or read values back: trainstep.c returns the aux
 * tensors as outputs of the compiled step and fills rf_stats.
 */
#include "train_internal.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

rf_aux *rfi_aux_new(rf_trace *t)
{
    rf_aux *aux = rfi_arena_alloc(&t->arena, sizeof *aux);
    if (!aux) {
        rfi_graph_fail(t, RF_E_NOMEM, "rf_withgradient: out of memory");
        return NULL;
    }
    aux->t = t;
    return aux;
}

/* The slot of `name` in aux, or -1. */
static int find_name(const rf_aux *aux, const char *name)
{
    for (int i = 0; i < aux->n; i++)
        if (strcmp(aux->names[i], name) == 0)
            return i;
    return -1;
}

/* Checks the name and value given to rf_aux_set; records a trace error. */
static bool valid_aux(rf_aux *aux, const char *name, const rf_tensor *value)
{
    rf_trace *t = aux->t;
    if (!value) {
        if (t->status == RF_OK) /* NULL from a failed op is already reported */
            rfi_graph_fail(t, RF_E_INVALID, "rf_aux_set: value of \"%s\" is NULL",
                           name ? name : "(null)");
        return false;
    }
    if (value->g != t) {
        rfi_graph_fail(t, RF_E_INVALID, "rf_aux_set: value of \"%s\" belongs to another trace",
                       name ? name : "(null)");
        return false;
    }
    if (!name || !*name || strlen(name) > 31) {
        rfi_graph_fail(t, RF_E_INVALID, "rf_aux_set: the name must have 1 to 31 characters%s%s",
                       name ? ", got " : "", name ? name : "");
        return false;
    }
    if (value->rank != 0) {
        char ty[128];
        rfi_graph_fail(t, RF_E_SHAPE, "rf_aux_set: \"%s\" must be a scalar, got %s (reduce it, "
                       "e.g. with rf_mean_all)", name,
                       rfi_type_str(ty, sizeof ty, value->dtype, value->dims, value->rank));
        return false;
    }
    if (find_name(aux, name) < 0 && aux->n >= RF_MAX_AUX) {
        rfi_graph_fail(t, RF_E_INVALID, "rf_aux_set: \"%s\" would be aux value %d; at most %d "
                       "are allowed", name, aux->n + 1, RF_MAX_AUX);
        return false;
    }
    return true;
}

void rf_aux_set(rf_aux *aux, const char *name, rf_tensor *value)
{
    if (!aux || !valid_aux(aux, name, value))
        return;
    /* Aux values are reported, never differentiated: cut them off the gradient. */
    rf_tensor *v = rf_stop_gradient(value);
    if (!v)
        return;
    int slot = find_name(aux, name);
    if (slot < 0) { /* a repeated name keeps the last value, like rf_assign */
        slot = aux->n++;
        snprintf(aux->names[slot], sizeof aux->names[slot], "%s", name);
    }
    aux->values[slot] = v;
}

int rf_aux_count(const rf_aux *aux) { return aux ? aux->n : 0; }

rf_tensor *rf_aux_get(const rf_aux *aux, int i, const char **name)
{
    if (name)
        *name = NULL;
    if (!aux || i < 0 || i >= aux->n)
        return NULL;
    if (name)
        *name = aux->names[i];
    return aux->values[i];
}

double rf_stats_get(const rf_stats *s, const char *name)
{
    if (!s || !name)
        return NAN;
    for (int i = 0; i < s->n && i < RF_MAX_AUX; i++)
        if (strcmp(s->names[i], name) == 0)
            return s->values[i];
    return NAN;
}
