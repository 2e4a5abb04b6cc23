/* setup.c: optimiser state (Optimisers.setup) and the functions that read or
 * change it from the host: rf_setup, rf_adjust, rf_opt_lr, rf_opt_steps,
 * rf_opt_freeze, rf_opt_thaw, rf_opt_track_grad_norm, rf_opt_visit, rf_opt_free.
 *
 * Everything the update reads lives on the model's device: the flat state
 * arrays (one per role per parameter dtype), the hyperparameters as f32
 * scalars (so rf_adjust is an rf_array_write, not a recompile) and the step
 * counter. This file allocates and initialises them; it builds no IR (the
 * update math is update.c).
 */
#include "optim.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core/core.h"

/* ---- Allocation helpers ---------------------------------------------------------------------- */

/* A device array of n elements (a scalar when flat is false) filled with v. */
static rf_array *filled(rf_device *dev, rf_dtype dt, bool flat, int64_t n, double v)
{
    const int64_t dims[1] = {n};
    int rank = flat ? 1 : 0;
    if (v == 0.0)
        return rf_array_new(dev, dt, dims, rank, NULL);
    int64_t count = flat ? n : 1;
    void *buf = rfi_malloc((size_t)count * rf_dtype_size(dt));
    if (!buf) {
        rfi_error(RF_E_NOMEM, "rf_setup: out of memory for %lld state elements", (long long)count);
        return NULL;
    }
    for (int64_t i = 0; i < count; i++) {
        switch (dt) {
        case RF_F32: ((float *)buf)[i] = (float)v; break;
        case RF_F64: ((double *)buf)[i] = v; break;
        case RF_I32: ((int32_t *)buf)[i] = (int32_t)v; break;
        default: ((int64_t *)buf)[i] = (int64_t)v; break;
        }
    }
    rf_array *a = rf_array_new(dev, dt, dims, rank, buf);
    rfi_free(buf);
    return a;
}

/* ---- Parameters ------------------------------------------------------------------------------ */

/* Checks the trainable parameters of m (all on one compute device, float) and
 * records their dtypes and sizes; groups them by dtype in first-seen order. */
static rf_status read_params(rf_opt *o, rf_model *m)
{
    rf_array **ps = NULL;
    int n = rfi_model_collect_params(m, &ps);
    if (n < 0)
        return rfi_error(RF_E_NOMEM, "rf_setup: out of memory collecting parameters");
    rf_status st = RF_OK;
    o->n_params = n;
    o->param_dtype = rfi_calloc(n ? (size_t)n : 1, sizeof *o->param_dtype);
    o->param_numel = rfi_calloc(n ? (size_t)n : 1, sizeof *o->param_numel);
    if (!o->param_dtype || !o->param_numel) {
        st = rfi_error(RF_E_NOMEM, "rf_setup: out of memory");
        goto done;
    }
    for (int i = 0; i < n; i++) {
        rf_device *dev = rf_array_device(ps[i]);
        rf_dtype dt = rf_array_dtype(ps[i]);
        if (!rfi_device_is_compute(dev)) {
            st = rfi_error(RF_E_DEVICE,
                           "rf_setup: the model's parameter %d lives on the %s device; move the "
                           "model to a compute device first (rf_model_to(m, "
                           "rf_device_default())), optimiser state is created beside it",
                           i, rf_device_name(dev));
            goto done;
        }
        if (o->device && dev != o->device) {
            st = rfi_error(RF_E_DEVICE, "rf_setup: parameters live on %s and on %s; move the "
                           "whole model to one device", rf_device_name(o->device),
                           rf_device_name(dev));
            goto done;
        }
        if (!rfi_dtype_is_float(dt)) {
            st = rfi_error(RF_E_DTYPE, "rf_setup: trainable parameter %d is %s; only float "
                           "parameters can be optimised", i, rf_dtype_name(dt));
            goto done;
        }
        o->device = dev;
        o->param_dtype[i] = dt;
        o->param_numel[i] = rf_array_numel(ps[i]);
        rfi_opt_group *g = NULL;
        for (int k = 0; k < o->n_groups && !g; k++)
            if (o->groups[k].dtype == dt)
                g = &o->groups[k];
        if (!g) {
            g = &o->groups[o->n_groups++];
            g->dtype = dt;
        }
        int *nm = rfi_realloc(g->members, (size_t)(g->n_members + 1) * sizeof *nm);
        if (!nm) {
            st = rfi_error(RF_E_NOMEM, "rf_setup: out of memory");
            goto done;
        }
        g->members = nm;
        g->members[g->n_members++] = i;
        g->numel += o->param_numel[i];
    }
done:
    rfi_free(ps);
    return st;
}

/* The device of a model without trainable parameters: that of its state, if
 * any, else the default device (the optimiser then only counts steps). */
static void device_without_params(rf_opt *o, rf_model *m)
{
    for (int i = 0; i < m->n_state && !o->device; i++)
        o->device = rf_array_device(m->state[i].a);
    if (!o->device)
        o->device = rf_device_default();
}

/* ---- State ----------------------------------------------------------------------------------- */

/* The dtype of the hyperparameter scalars: f64 when any parameter is f64, so
 * that f64 parameters see the values given (as Optimisers.jl's T(o.eta) does,
 * and consistent with their state, initialised from the exact values), else
 * f32 (the update converts them to each group's dtype). */
static rf_dtype hp_dtype(const rf_opt *o)
{
    for (int k = 0; k < o->n_groups; k++)
        if (o->groups[k].dtype == RF_F64)
            return RF_F64;
    return RF_F32;
}

static rf_status make_leaves(rf_opt *o)
{
    o->n_leaves = rfi_rule_leaves(o->rule, NULL, 0);
    rf_rule **rules = rfi_calloc(o->n_leaves ? (size_t)o->n_leaves : 1, sizeof *rules);
    o->leaves = rfi_calloc(o->n_leaves ? (size_t)o->n_leaves : 1, sizeof *o->leaves);
    if (!rules || !o->leaves) {
        rfi_free(rules);
        return rfi_error(RF_E_NOMEM, "rf_setup: out of memory");
    }
    rfi_rule_leaves(o->rule, rules, o->n_leaves);
    rf_dtype dt = hp_dtype(o);
    for (int l = 0; l < o->n_leaves; l++) {
        rfi_opt_leaf *lf = &o->leaves[l];
        lf->rule = rules[l];
        for (int k = 0; k < lf->rule->n_hp; k++) {
            if (!rfi_rule_hp_name(lf->rule, k))
                continue;
            if (!(lf->hp[k] = filled(o->device, dt, false, 1, lf->rule->hp[k]))) {
                rfi_free(rules);
                return RF_E_NOMEM; /* filled() said why */
            }
        }
    }
    rfi_free(rules);
    return RF_OK;
}

static rf_status make_group_state(rf_opt *o, rfi_opt_group *g)
{
    g->state = rfi_calloc(o->n_leaves ? (size_t)o->n_leaves * RFI_OPT_MAX_ROLES : 1,
                          sizeof *g->state);
    if (!g->state)
        return rfi_error(RF_E_NOMEM, "rf_setup: out of memory");
    for (int l = 0; l < o->n_leaves; l++) {
        const rf_rule *r = o->leaves[l].rule;
        const rfi_state_role *roles;
        int nr = rfi_rule_state_roles(r, &roles);
        for (int k = 0; k < nr; k++) {
            const rfi_state_role *ro = &roles[k];
            double v = ro->init_hp >= 0 ? r->hp[ro->init_hp] : ro->init;
            rf_dtype dt = ro->counter ? RF_I32 : g->dtype;
            /* Initial values are rounded to the state's dtype once, here, as
             * Optimisers.jl's T.(o.beta) and onevalue(o.epsilon, x) do. */
            rf_array *a = filled(o->device, dt, ro->flat, g->numel, v);
            if (!a)
                return RF_E_NOMEM;
            g->state[l * RFI_OPT_MAX_ROLES + k] = a;
        }
    }
    return RF_OK;
}

static rf_status make_frozen_flags(rf_opt *o)
{
    o->frozen = rfi_calloc(o->n_params ? (size_t)o->n_params : 1, sizeof *o->frozen);
    for (int i = 0; o->frozen && i < o->n_params; i++)
        if (!(o->frozen[i] = rfi_flag_new(false)))
            return rfi_error(RF_E_NOMEM, "rf_setup: out of memory");
    return o->frozen ? RF_OK : rfi_error(RF_E_NOMEM, "rf_setup: out of memory");
}

static void opt_release(rf_opt *o)
{
    for (int k = 0; k < o->n_groups; k++) {
        rfi_opt_group *g = &o->groups[k];
        for (int i = 0; g->state && i < o->n_leaves * RFI_OPT_MAX_ROLES; i++)
            rf_array_free(g->state[i]);
        rfi_free(g->state);
        rfi_free(g->members);
    }
    for (int l = 0; o->leaves && l < o->n_leaves; l++)
        for (int k = 0; k < RFI_RULE_MAX_HP; k++)
            rf_array_free(o->leaves[l].hp[k]);
    rfi_free(o->leaves);
    rfi_free(o->param_dtype);
    rfi_free(o->param_numel);
    rf_array_free(o->steps);
    for (int i = 0; o->frozen && i < o->n_params; i++)
        rfi_flag_orphan(o->frozen[i]); /* executables watching them keep running */
    rfi_free(o->frozen);
    rfi_rule_destroy(o->rule);
    rfi_free(o);
}

rf_opt *rf_setup(rf_rule *rule, rf_model *model)
{
    if (rule && rule->owned) { /* not ours to take, nor to free */
        rfi_error(RF_E_INVALID, "rf_setup: the rule (%s) already belongs to a chain or an "
                  "optimiser: give each optimiser a rule of its own", rf_rule_name(rule));
        return NULL;
    }
    if (!rule || !model) {
        rf_rule_free(rule);
        rfi_error(RF_E_INVALID, "rf_setup: %s is NULL", rule ? "model" : "rule");
        return NULL;
    }
    rf_opt *o = rfi_calloc(1, sizeof *o);
    if (!o) {
        rf_rule_free(rule);
        rfi_error(RF_E_NOMEM, "rf_setup: out of memory");
        return NULL;
    }
    o->rule = rule;
    rule->owned = true;
    o->uid = rfi_next_uid();
    rf_status st = read_params(o, model);
    if (st == RF_OK && o->n_params == 0)
        device_without_params(o, model);
    if (st == RF_OK)
        st = make_leaves(o);
    for (int k = 0; st == RF_OK && k < o->n_groups; k++)
        st = make_group_state(o, &o->groups[k]);
    if (st == RF_OK) {
        const int64_t dims[1] = {1};
        if (!(o->steps = rf_array_new(o->device, RF_I64, dims, 0, NULL)))
            st = RF_E_NOMEM;
    }
    if (st == RF_OK)
        st = make_frozen_flags(o);
    if (st == RF_OK)
        st = rfi_model_attach_opt(model, o);
    if (st != RF_OK) {
        opt_release(o);
        return NULL;
    }
    o->model = model;
    return o;
}

void rf_opt_free(rf_opt *opt)
{
    if (!opt)
        return;
    if (opt->model) {
        rfi_step_cache_drop_opt(opt->model, opt->uid);
        rfi_model_detach_opt(opt->model, opt);
        opt->model = NULL;
    }
    opt_release(opt);
}

void rfi_opt_model_gone(rf_opt *opt)
{
    if (opt)
        opt->model = NULL;
}

uint64_t rfi_opt_uid(const rf_opt *opt) { return opt ? opt->uid : 0; }

const rf_rule *rf_opt_rule(const rf_opt *opt) { return opt ? opt->rule : NULL; }

/* ---- Host-side reads and writes -------------------------------------------------------------- */

/* ---- Frozen parameters ----------------------------------------------------------------------- */

typedef struct freeze_walk {
    const char *at; /* the path asked for */
    size_t len;
    bool *hit;      /* per parameter: at or below `at` */
    int index, n, n_hit;
    char first[64]; /* the first trainable path, for the message of a miss */
} freeze_walk;

/* Whether `path` is `at` or below it: "1" holds "1.weight" and "1.0.bias", not
 * "10.weight"; "" holds every path. */
static bool path_at(const char *path, const char *at, size_t len)
{
    return len == 0 || (!strncmp(path, at, len) && (path[len] == '\0' || path[len] == '.'));
}

static void mark_at(const char *path, rf_array *a, bool trainable, void *ud)
{
    (void)a;
    freeze_walk *w = ud;
    if (!trainable)
        return;
    if (w->index == 0)
        snprintf(w->first, sizeof w->first, "%s", path);
    if (w->index < w->n && path_at(path, w->at, w->len)) {
        w->hit[w->index] = true;
        w->n_hit++;
    }
    w->index++;
}

static rf_status set_frozen(const char *op, rf_opt *opt, const char *path, bool value)
{
    if (!opt || !path)
        return rfi_error(RF_E_INVALID, "%s: %s is NULL", op, opt ? "path" : "opt");
    if (!opt->model)
        return rfi_error(RF_E_INVALID, "%s: the optimiser's model was freed", op);
    freeze_walk w = {.at = path, .len = strlen(path), .n = opt->n_params};
    w.hit = rfi_calloc(opt->n_params ? (size_t)opt->n_params : 1, sizeof *w.hit);
    if (!w.hit)
        return rfi_error(RF_E_NOMEM, "%s: out of memory", op);
    rf_array **ps = NULL;
    int n_ps = rfi_model_collect_params(opt->model, &ps);
    rfi_free(ps);
    rf_status st = RF_OK;
    if (n_ps < 0)
        st = rfi_error(RF_E_NOMEM, "%s: out of memory", op);
    else if (n_ps != opt->n_params)
        st = rfi_error(RF_E_SHAPE, "%s: the model has %d trainable parameters, but the "
                       "optimiser was set up for %d (set it up again after changing the "
                       "model)", op, n_ps, opt->n_params);
    if (st == RF_OK)
        rf_model_visit(opt->model, mark_at, &w);
    if (st == RF_OK && w.index != n_ps) /* the walk could not build a path */
        st = rfi_error(RF_E_NOMEM, "%s: out of memory", op);
    else if (st == RF_OK && w.n_hit == 0)
        st = rfi_error(RF_E_INVALID, "%s: the model has no trainable parameter at \"%s\" "
                       "(paths are rf_model_visit's: \"%s\" names one array, its layer's "
                       "path all of that layer's, \"\" every one)", op, path,
                       w.first[0] ? w.first : "0.weight");
    for (int i = 0; st == RF_OK && i < opt->n_params; i++)
        if (w.hit[i] && atomic_load(&opt->frozen[i]->value) != value)
            rfi_flag_set(opt->frozen[i], value);
    rfi_free(w.hit);
    return st;
}

rf_status rf_opt_freeze(rf_opt *opt, const char *path)
{
    return set_frozen("rf_opt_freeze", opt, path, true);
}

rf_status rf_opt_thaw(rf_opt *opt, const char *path)
{
    return set_frozen("rf_opt_thaw", opt, path, false);
}

int rf_opt_n_frozen(const rf_opt *opt)
{
    int n = 0;
    for (int i = 0; opt && i < opt->n_params; i++)
        n += atomic_load(&opt->frozen[i]->value);
    return n;
}

rf_status rf_adjust(rf_opt *opt, double lr)
{
    if (!opt)
        return rfi_error(RF_E_INVALID, "rf_adjust: opt is NULL");
    if (!(lr >= 0) || isinf(lr) || lr > FLT_MAX)
        return rfi_error(RF_E_INVALID, "rf_adjust: the learning rate must be finite, >= 0 "
                         "and within the f32 range, got %g", lr);
    int n = 0;
    for (int l = 0; l < opt->n_leaves; l++)
        if (rfi_rule_has_lr(opt->leaves[l].rule))
            n++;
    if (n == 0)
        return rfi_error(RF_E_INVALID, "rf_adjust: no rule of %s has a learning rate",
                         rf_rule_name(opt->rule));
    for (int l = 0; l < opt->n_leaves; l++) {
        rfi_opt_leaf *lf = &opt->leaves[l];
        if (!rfi_rule_has_lr(lf->rule))
            continue;
        float v32 = (float)lr;
        bool f64 = rf_array_dtype(lf->hp[0]) == RF_F64;
        rf_status st = f64 ? rf_array_write(lf->hp[0], &lr, sizeof lr)
                           : rf_array_write(lf->hp[0], &v32, sizeof v32);
        if (st != RF_OK)
            return st;
        lf->rule->hp[0] = lr; /* so rf_opt_rule describes what runs */
    }
    return RF_OK;
}

double rf_opt_lr(const rf_opt *opt)
{
    for (int l = 0; opt && l < opt->n_leaves; l++)
        if (rfi_rule_has_lr(opt->leaves[l].rule))
            return rf_to_number(opt->leaves[l].hp[0]); /* the device value is the truth
                                                          (a checkpoint may have set it) */
    if (!opt)
        rfi_error(RF_E_INVALID, "rf_opt_lr: opt is NULL");
    else
        rfi_error(RF_E_INVALID, "rf_opt_lr: no rule of %s has a learning rate",
                  rf_rule_name(opt->rule));
    return NAN;
}

rf_status rf_opt_track_grad_norm(rf_opt *opt, bool on)
{
    if (!opt)
        return rfi_error(RF_E_INVALID, "rf_opt_track_grad_norm: opt is NULL");
    opt->grad_norm = on;
    return RF_OK;
}

bool rf_opt_tracks_grad_norm(const rf_opt *opt) { return opt && opt->grad_norm; }

int64_t rf_opt_steps(const rf_opt *opt)
{
    int64_t v = 0;
    if (!opt) {
        rfi_error(RF_E_INVALID, "rf_opt_steps: opt is NULL");
        return -1;
    }
    if (rf_array_read(opt->steps, &v, sizeof v) != RF_OK)
        return -1;
    return v;
}

/* Paths: "<leaf>.<rule>.<hp>" for hyperparameters, "<leaf>.<rule>.<role>.<dtype>"
 * for state, and "t" for the step counter; with `paths` false every path is
 * "" (the per-step checks: formatting an Adam optimiser's paths, with the
 * model's, took about half of the tiny benchmark's step). */
static void walk_opt(rf_opt *opt, rf_array_visitor fn, void *ud, bool paths)
{
    char path[128] = "";
    for (int l = 0; l < opt->n_leaves; l++) {
        const rfi_opt_leaf *lf = &opt->leaves[l];
        const char *rn = rf_rule_name(lf->rule);
        for (int k = 0; k < lf->rule->n_hp; k++) {
            if (!lf->hp[k])
                continue;
            if (paths)
                snprintf(path, sizeof path, "%d.%s.%s", l, rn, rfi_rule_hp_name(lf->rule, k));
            fn(path, lf->hp[k], false, ud);
        }
        const rfi_state_role *roles;
        int nr = rfi_rule_state_roles(lf->rule, &roles);
        for (int g = 0; g < opt->n_groups; g++)
            for (int k = 0; k < nr; k++) {
                if (paths)
                    snprintf(path, sizeof path, "%d.%s.%s.%s", l, rn, roles[k].name,
                             rf_dtype_name(opt->groups[g].dtype));
                fn(path, opt->groups[g].state[l * RFI_OPT_MAX_ROLES + k], false, ud);
            }
    }
    fn(paths ? "t" : "", opt->steps, false, ud);
}

void rf_opt_visit(rf_opt *opt, rf_array_visitor fn, void *ud)
{
    if (opt && fn)
        walk_opt(opt, fn, ud, true);
}

void rfi_opt_each_array(rf_opt *opt, rf_array_visitor fn, void *ud)
{
    walk_opt(opt, fn, ud, false);
}
