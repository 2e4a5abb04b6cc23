/* trainstep.c: rf_trainstep and rf_trainstep_withgradient: one fused,
 * compiled and cached training step (forward, backward, optimiser update).
 *
 * The step program is: batch arguments -> rf_withgradient -> the optimiser's
 * update (rfi_opt_emit_update) -> every recorded update guarded by the
 * loss being finite -> outputs: the loss, the aux values, the gradients'
 * global norm when the optimiser tracks it, then (with gradients) one
 * gradient per trainable parameter. The guard makes a step
 * with a NaN/Inf loss a no-op for every captured array (parameters,
 * optimiser state, BatchNorm statistics, RNG keys), so the host only has to
 * report it.
 *
 * It does not own the cache (step_cache.c) or the update rules (optim/).
 */
#include "train_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* What the step's trace function needs, and what it reports back. */
typedef struct step_ctx {
    rf_loss_fn loss;
    void *ctx;
    rf_model *m;
    rf_opt *opt;
    int n_batch;
    bool with_grads;
    bool grad_norm;        /* return the gradients' global L2 norm after the aux values */
    rfi_step_outputs outs; /* filled while tracing */
} step_ctx;

/* Rewrites every recorded update of g as select(is_finite(loss), new, old),
 * so that a step whose loss is not finite leaves every captured array as it
 * was; with the gradient norm tracked, also one whose norm is not finite (a
 * NaN or Inf gradient under a finite loss would poison every parameter it
 * reaches, and the norm is at hand). Runs after all updates are recorded. */
static void guard_updates(rfi_graph *g, rfi_node *loss, rfi_node *norm)
{
    rfi_node *ok = rf_is_finite(loss); /* a bool scalar: rf_select broadcasts it */
    if (norm) {
        rfi_node *norm_ok = rf_is_finite(norm);
        ok = rf_select(norm_ok, ok, norm_ok); /* both finite */
    }
    for (int i = 0; ok && i < g->n_updates; i++) {
        rfi_update *u = &g->updates[i];
        rfi_node *old = g->capture_nodes[u->capture];
        rfi_node *guarded = rf_select(ok, u->value, old);
        if (!guarded)
            return; /* the trace error is recorded */
        u->value = guarded;
    }
}

/* The global L2 norm of the gradients of the parameters opt trains (a frozen
 * one's is not computed), in f64: an f32 gradient's elements beyond 1.8e19 have
 * squares no f32 holds, and parameters of several dtypes add up. NULL with
 * the trace's error. */
static rf_tensor *grad_norm(rf_trace *t, const step_ctx *s, const rf_aux *aux,
                            const rf_grads *g)
{
    int n_aux = rf_aux_count(aux);
    for (int i = 0; i < n_aux; i++) {
        const char *name;
        rf_aux_get(aux, i, &name);
        if (strcmp(name, RF_STATS_GRAD_NORM) == 0) {
            rfi_graph_fail(t, RF_E_INVALID, "rf_trainstep: the loss records an aux value "
                           "named \"" RF_STATS_GRAD_NORM "\", the name of the gradient norm "
                           "this optimiser tracks (rf_opt_track_grad_norm); rename it");
            return NULL;
        }
    }
    if (n_aux >= RF_MAX_AUX) {
        rfi_graph_fail(t, RF_E_INVALID, "rf_trainstep: the loss records %d aux values; with "
                       "the gradient norm tracked (rf_opt_track_grad_norm) it may record at "
                       "most %d", n_aux, RF_MAX_AUX - 1);
        return NULL;
    }
    rf_tensor *total = NULL;
    for (int i = 0; i < g->n && i < s->opt->n_params; i++) {
        if (atomic_load(&s->opt->frozen[i]->value)) /* watched by the update already */
            continue;
        rf_tensor *g64 = rf_convert(g->g[i], RF_F64); /* an f32 square may overflow */
        rf_tensor *sq = rf_sum_all(rf_mul(g64, g64));
        total = total ? rf_add(total, sq) : sq;
    }
    if (!total) /* nothing trained */
        total = rf_convert(rf_scalar(t, 0.0), RF_F64);
    return rf_sqrt(total);
}

/* Declares the step's outputs (loss, aux values, the gradient norm when
 * tracked, gradients) and records their layout in s->outs. */
static void return_outputs(rf_trace *t, step_ctx *s, rf_tensor *loss, const rf_aux *aux,
                           rf_tensor *norm, const rf_grads *g)
{
    rf_return(t, loss);
    s->outs.n_aux = rf_aux_count(aux);
    for (int i = 0; i < s->outs.n_aux; i++) {
        const char *name;
        rf_return(t, rf_aux_get(aux, i, &name));
        snprintf(s->outs.aux_names[i], sizeof s->outs.aux_names[i], "%s", name);
    }
    s->outs.grad_norm = norm != NULL;
    if (norm) {
        rf_return(t, norm);
        snprintf(s->outs.aux_names[s->outs.n_aux], sizeof s->outs.aux_names[0], "%s",
                 RF_STATS_GRAD_NORM);
        s->outs.n_aux++;
    }
    s->outs.n_grads = 0;
    if (s->with_grads) {
        s->outs.n_grads = rf_grads_count(g);
        for (int i = 0; i < s->outs.n_grads; i++)
            rf_return(t, rf_grads_get(g, i));
    }
}

/* The trace function of the fused step. */
static void step_trace(rf_trace *t, void *vctx)
{
    step_ctx *s = vctx;
    rf_tensor **batch = rfi_arena_alloc(&t->arena, (size_t)s->n_batch * sizeof *batch);
    if (!batch) {
        rfi_graph_fail(t, RF_E_NOMEM, "rf_trainstep: out of memory");
        return;
    }
    for (int i = 0; i < s->n_batch; i++)
        batch[i] = rf_arg(t, i);
    rf_aux *aux = NULL;
    rf_grads *g = NULL;
    rf_tensor *loss = rf_withgradient(t, s->loss, s->ctx, s->m, batch, s->n_batch, &aux, &g);
    if (!loss)
        return;
    rf_status st = rfi_opt_emit_update(t, s->opt, s->m, g->g, g->n);
    if (st != RF_OK && t->status == RF_OK)
        rfi_graph_fail(t, st, "%s", rf_errmsg());
    if (t->status != RF_OK)
        return;
    if (t->n_outputs != 0) { /* the step's outputs are its own: loss, aux, gradients */
        rfi_graph_fail(t, RF_E_INVALID, "rf_trainstep: the loss function (or a layer) called "
                       "rf_return %d time%s; return the loss, and report other values with "
                       "rf_aux_set", t->n_outputs, t->n_outputs == 1 ? "" : "s");
        return;
    }
    rf_tensor *norm = s->grad_norm ? grad_norm(t, s, aux, g) : NULL;
    if (t->status != RF_OK)
        return;
    guard_updates(t, loss, norm);
    return_outputs(t, s, loss, aux, norm, g);
}

/* ---- Validation ------------------------------------------------------------------------ */

/* Where the model's arrays live: the device of the first one, or NULL for a
 * model without arrays; `host` is set if any lives on the host. */
typedef struct device_scan {
    rf_device *device;
    bool host;
    bool mixed;
} device_scan;

static void scan_array(const char *path, rf_array *a, bool trainable, void *ud)
{
    (void)path;
    (void)trainable;
    device_scan *d = ud;
    if (a->device->kind == RF_DEVICE_HOST)
        d->host = true;
    else if (!d->device)
        d->device = a->device;
    else if (d->device != a->device)
        d->mixed = true;
}

static rf_status check_batch(const char *op, rf_array *const *batch, int n)
{
    if (n < 1 || !batch)
        return rfi_error(RF_E_INVALID, "%s: the batch is %s (n = %d); pass at least one array",
                         op, batch ? "empty" : "NULL", n);
    for (int i = 0; i < n; i++) {
        if (!batch[i])
            return rfi_error(RF_E_INVALID, "%s: batch[%d] is NULL", op, i);
        if (batch[i]->device->kind == RF_DEVICE_HOST) {
            char ty[128];
            return rfi_error(RF_E_DEVICE, "%s: batch[%d] %s lives on the host; move batches to "
                             "the device (rf_array_to or rf_loader_to)", op, i,
                             rfi_type_str(ty, sizeof ty, batch[i]->dtype, batch[i]->dims,
                                          batch[i]->rank));
        }
    }
    return RF_OK;
}

/* Checks model, optimiser and batch; *dev receives the device the step runs on. */
static rf_status check_step(const char *op, rf_loss_fn loss, rf_model *m,
                            rf_array *const *batch, int n, rf_opt *opt, rf_device **dev)
{
    if (!loss || !m || !opt)
        return rfi_error(RF_E_INVALID, "%s: %s is NULL", op,
                         !loss ? "loss" : !m ? "model" : "opt");
    rf_status st = check_batch(op, batch, n);
    if (st != RF_OK)
        return st;
    device_scan md = {0};
    rfi_model_each_array(m, scan_array, &md);
    if (md.host || md.mixed)
        return rfi_error(RF_E_DEVICE, "%s: the model %s; move it with rf_model_to(m, device) "
                         "and set up the optimiser for the moved model", op,
                         md.host ? "has arrays on the host" : "has arrays on several devices");
    *dev = md.device ? md.device : batch[0]->device;
    for (int i = 0; i < n; i++) {
        if (batch[i]->device != *dev)
            return rfi_error(RF_E_DEVICE, "%s: batch[%d] lives on %s but the model lives on %s",
                             op, i, rf_device_name(batch[i]->device), rf_device_name(*dev));
    }
    if (!rfi_model_has_opt(m, opt)) {
        char rel[256];
        rfi_opt_relation(opt, m, rel, sizeof rel);
        if (rel[0])
            return rfi_error(RF_E_INVALID, "%s: the optimiser (%s) was not set up for this "
                             "model%s", op, rf_rule_name(rf_opt_rule(opt)), rel);
        return rfi_error(RF_E_INVALID, "%s: the optimiser (%s) was not set up for this model; "
                         "call rf_setup(rule, model) with the model you train", op,
                         rf_rule_name(rf_opt_rule(opt)));
    }
    device_scan od = {0};
    rfi_opt_each_array(opt, scan_array, &od);
    if (od.host || od.mixed || (od.device && od.device != *dev))
        return rfi_error(RF_E_DEVICE, "%s: the optimiser state lives on %s but the model lives "
                         "on %s; call rf_setup after moving the model", op,
                         od.host ? "the host" : od.mixed ? "several devices"
                                                         : rf_device_name(od.device),
                         rf_device_name(*dev));
    return RF_OK;
}

/* ---- Compile or reuse, then run --------------------------------------------------------- */

static rfi_step_entry *find_or_compile(step_ctx *s, const rfi_step_probe *p,
                                       rf_array *const *batch, rf_status *st)
{
    rfi_step_entry *e = rfi_step_cache_find(s->m, p);
    if (e)
        return e;
    rf_compile_opts co = {.device = p->device, .name = "trainstep"};
    rf_exec *exec = NULL;
    *st = rf_compile_with(step_trace, s, batch, s->n_batch, &co, &exec);
    if (*st != RF_OK)
        return NULL;
    e = rfi_step_cache_insert(s->m, p, exec, &s->outs);
    if (!e)
        *st = RF_E_NOMEM;
    return e;
}

/* Hands the gradient outputs to the caller in g, an array malloc'd before the
 * step ran (so that nothing can fail once it has updated the model; the
 * header says: free each, then the array with free()). */
static void give_grads(rf_array **outs, int n, rf_array **g, rf_array ***grads, int *ngrads)
{
    for (int i = 0; i < n; i++) {
        g[i] = outs[i];
        outs[i] = NULL;
    }
    *grads = g;
    *ngrads = n;
}

/* A scalar output written by rfi_exec_run_into (any dtype), as a double. */
static double scalar_value(const rf_exec *x, int i, const void *slot)
{
    return rfi_element_as_double(rf_exec_output_dtype(x, i), slot, 0);
}

/* Runs a compiled step without gradient outputs: the loss and aux values are
 * scalars written straight into host memory, so a step allocates nothing. */
static rf_status run_scalars(rf_exec *x, rf_array *const *batch, int n, int n_host,
                             double *values)
{
    double slots[1 + RF_MAX_AUX] = {0}; /* 8 bytes: room for any scalar */
    void *out[1 + RF_MAX_AUX];
    for (int i = 0; i < n_host; i++)
        out[i] = &slots[i];
    rf_status st = rfi_exec_run_into(x, batch, n, out);
    for (int i = 0; st == RF_OK && i < n_host; i++)
        values[i] = scalar_value(x, i, &slots[i]);
    return st;
}

/* Runs a compiled step and reads its loss and aux values to the host. */
static rf_status run_step(const char *op, const rfi_step_entry *e, rf_array *const *batch,
                          int n, double *loss_out, rf_stats *stats, rf_array ***grads,
                          int *ngrads)
{
    const rfi_step_outputs *o = rfi_step_entry_outputs(e);
    rf_exec *x = rfi_step_entry_exec(e);
    int n_host = 1 + o->n_aux;
    double values[1 + RF_MAX_AUX];
    rf_array **outs = NULL, **given = NULL;
    int n_out = 0;
    rf_status st;
    if (!grads) {
        st = run_scalars(x, batch, n, n_host, values);
    } else {
        n_out = n_host + o->n_grads;
        outs = rfi_calloc((size_t)n_out, sizeof *outs);
        given = malloc((size_t)(o->n_grads > 0 ? o->n_grads : 1) * sizeof *given);
        if (!outs || !given) {
            rfi_free(outs);
            free(given);
            return rfi_error(RF_E_NOMEM, "%s: out of memory", op);
        }
        st = rf_exec_run(x, batch, n, outs, n_out);
        for (int i = 0; st == RF_OK && i < n_host; i++)
            values[i] = rf_to_number(outs[i]);
    }
    if (st == RF_OK) {
        double loss = values[0];
        if (stats) {
            stats->n = o->n_aux;
            for (int i = 0; i < o->n_aux; i++) {
                memcpy(stats->names[i], o->aux_names[i], sizeof stats->names[i]);
                stats->values[i] = values[1 + i];
            }
        }
        if (loss_out)
            *loss_out = loss;
        double norm = o->grad_norm ? values[o->n_aux] : 0;
        if (!isfinite(loss))
            st = rfi_error(RF_E_DOMAIN, "%s: loss is %s; no update was applied", op,
                           isnan(loss) ? "NaN" : loss > 0 ? "Inf" : "-Inf");
        else if (!isfinite(norm))
            st = rfi_error(RF_E_DOMAIN, "%s: the gradient norm is %s (a gradient is not "
                           "finite, the loss %g is); no update was applied", op,
                           isnan(norm) ? "NaN" : "Inf", loss);
        else if (grads) {
            give_grads(outs + n_host, o->n_grads, given, grads, ngrads);
            given = NULL;
        }
    }
    for (int i = 0; i < n_out; i++)
        rf_array_free(outs[i]);
    rfi_free(outs);
    free(given);
    return st;
}

static rf_status trainstep_owned(const char *op, rf_loss_fn loss, void *ctx, rf_model *m,
                                 rf_array *const *batch, int n, rf_opt *opt, double *loss_out,
                                 rf_stats *stats, rf_array ***grads, int *ngrads)
{
    rf_device *dev = NULL;
    rf_status st = check_step(op, loss, m, batch, n, opt, &dev);
    if (st != RF_OK)
        return st;
    const rf_rule *rule = rf_opt_rule(opt);
    rfi_step_probe p = {
        .model_hash = rfi_model_structure_hash(m),
        .training = rf_model_training(m),
        .rule_hash = rfi_rule_hash(rule),
        .opt_uid = rfi_opt_uid(opt),
        .rule_name = rf_rule_name(rule),
        .loss = loss,
        .ctx = ctx,
        .with_grads = grads != NULL,
        .grad_norm = opt->grad_norm,
        .device = dev,
        .n_batch = n,
        .batch = batch,
    };
    step_ctx s = {loss, ctx, m, opt, n, grads != NULL, opt->grad_norm, {0}};
    rfi_step_entry *e = find_or_compile(&s, &p, batch, &st);
    if (!e)
        return st;
    return run_step(op, e, batch, n, loss_out, stats, grads, ngrads);
}

/* The model that owns m's tree. */
static rf_model *root_of(rf_model *m)
{
    while (m->parent)
        m = m->parent;
    return m;
}

/* One step of m, refused while another thread runs one of any model of m's
 * tree: the step cache and the arrays serve one step at a time (reflux.h's
 * threading rules), overlapping steps would corrupt the cache's list, and a
 * step of a layer updates arrays its whole model's step updates too. */
static rf_status trainstep(const char *op, rf_loss_fn loss, void *ctx, rf_model *m,
                           rf_array *const *batch, int n, rf_opt *opt, double *loss_out,
                           rf_stats *stats, rf_array ***grads, int *ngrads)
{
    if (loss_out)
        *loss_out = NAN;
    if (stats)
        stats->n = 0;
    rf_model *root = m ? root_of(m) : NULL;
    if (root && atomic_exchange(&root->in_step, true))
        return rfi_error(RF_E_INVALID, "%s: the model%s is already in a training step (on "
                         "another thread? a model is trained by one thread at a time)", op,
                         root == m ? "" : " that owns this one");
    rf_status st = trainstep_owned(op, loss, ctx, m, batch, n, opt, loss_out, stats, grads,
                                   ngrads);
    if (root)
        atomic_store(&root->in_step, false);
    return st;
}

rf_status rf_trainstep(rf_loss_fn loss, void *ctx, rf_model *m, rf_array *const *batch, int n,
                       rf_opt *opt, double *loss_out, rf_stats *stats)
{
    return trainstep("rf_trainstep", loss, ctx, m, batch, n, opt, loss_out, stats, NULL, NULL);
}

rf_status rf_trainstep_withgradient(rf_loss_fn loss, void *ctx, rf_model *m,
                                    rf_array *const *batch, int n, rf_opt *opt,
                                    double *loss_out, rf_stats *stats, rf_array ***grads,
                                    int *ngrads)
{
    if (grads)
        *grads = NULL;
    if (ngrads)
        *ngrads = 0;
    if (!grads || !ngrads)
        return rfi_error(RF_E_INVALID, "rf_trainstep_withgradient: %s is NULL",
                         !grads ? "grads" : "ngrads");
    return trainstep("rf_trainstep_withgradient", loss, ctx, m, batch, n, opt, loss_out, stats,
                     grads, ngrads);
}
