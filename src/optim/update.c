/* update.c: the optimiser step as IR (Optimisers.update!): rfi_opt_emit_update
 * and its public form rf_update.
 *
 * "Foreach" form: per parameter dtype, the parameters and their gradients are
 * flattened and concatenated into one vector each, the rule runs ONCE on the
 * flat vectors, and the new values are sliced back and assigned. A model with
 * a hundred arrays costs the same rule IR as one with a single array. State
 * arrays are flat in the same order (setup.c made them).
 *
 * Semantics are Optimisers.jl 0.4.8's apply!: each rule maps
 * (state, x, dx) -> (state', dx'), a chain threads dx through its rules in
 * order, and finally x' = x - dx. Every formula below is written as in
 * Optimisers.jl's src/rules.jl (same association order, epsilon placement and
 * bias corrections), except Lion, which follows the published recurrence (see
 * emit_lion). Rules that act per array in Optimisers.jl (ClipNorm's norm) are
 * computed per parameter segment of the flat vector.
 *
 * Not here: the finite-loss guard of the fused trainstep (train/ rewrites the
 * recorded updates), host-side state (setup.c).
 */
#include "optim.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>

#include "core/core.h"

typedef struct emitter {
    rf_trace *t;
    rf_opt *o;
    rfi_opt_group *g;
    int leaf;           /* index of the next leaf rule, depth first */
    rf_tensor *x;       /* flat parameters before the step */
    rf_tensor *active;  /* NULL: every rule runs; else a bool scalar: false while
                           an AccumGrad is still accumulating (later rules skip) */
    const int64_t *seg; /* element count of each member, for per-array norms */
    int n_seg;
    const bool *frozen; /* per member of g (NULL: none): its flat state keeps its value */
    bool none_trained;  /* every member frozen: only the scalar state is assigned */
} emitter;

/* ---- Small helpers --------------------------------------------------------------------------- */

static rf_status fail(rf_trace *t, rf_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static rf_status fail(rf_trace *t, rf_status st, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    rf_trace_fail(t, st, "%s", msg);
    return rfi_error(st, "%s", msg);
}

static rf_tensor *num(emitter *e, double v) { return rf_scalar(e->t, v); }

/* Hyperparameter k of leaf l: its device scalar, in the group's dtype. */
static rf_tensor *hp(emitter *e, int l, int k)
{
    rf_array *a = e->o->leaves[l].hp[k];
    rf_tensor *h = rf_capture(e->t, a);
    return e->g->dtype == rf_array_dtype(a) ? h : rf_convert(h, e->g->dtype);
}

static rf_array *state_array(emitter *e, int l, int role)
{
    return e->g->state[l * RFI_OPT_MAX_ROLES + role];
}

/* The flat group vector `value` with each frozen member's piece taken from `old`
 * instead: select(mask, old, value), the mask one constant per member concatenated.
 * (Concatenating slices of `value` made the planner materialise it whole first.) */
static rf_tensor *keep_frozen(emitter *e, rf_tensor *old, rf_tensor *value)
{
    if (!e->frozen)
        return value;
    rf_tensor **parts = rfi_calloc((size_t)e->g->n_members, sizeof *parts);
    if (!parts) {
        fail(e->t, RF_E_NOMEM, "rf_update: out of memory");
        return NULL;
    }
    /* true for a frozen member: a segmented loop computes each piece as a constant, and
     * the select reads old and value at the same element, so value stays fused into the
     * loop that writes the state in place */
    for (int i = 0; i < e->g->n_members; i++) {
        int64_t len[1] = {e->o->param_numel[e->g->members[i]]};
        parts[i] = rf_full(e->t, RF_BOOL, len, 1, e->frozen[i] ? 1.0 : 0.0);
    }
    rf_tensor *mask = e->g->n_members == 1 ? parts[0] : rf_concatenate(parts, e->g->n_members, 0);
    rfi_free(parts);
    return rf_select(mask, old, value);
}

/* Flat state (one element per parameter element) is rank 1; a scalar's is rank 0. */
static bool flat_role(emitter *e, int l, int role)
{
    return rf_array_rank(state_array(e, l, role)) == 1;
}

static rf_tensor *state(emitter *e, int l, int role)
{
    return rf_capture(e->t, state_array(e, l, role));
}

/* Records state' for role; while an AccumGrad upstream is accumulating, the
 * state keeps its value (Optimisers.jl's chain skips rules after a `nothing`).
 * A frozen member's piece of a flat state keeps its value too. */
static void put(emitter *e, int l, int role, rf_tensor *value)
{
    rf_array *a = state_array(e, l, role);
    if (e->none_trained && flat_role(e, l, role))
        return; /* all of it keeps its value: no loop over it */
    if (e->active)
        value = rf_select(e->active, value, state(e, l, role));
    if (flat_role(e, l, role))
        value = keep_frozen(e, state(e, l, role), value);
    rf_assign(e->t, a, value);
}

static rf_tensor *one_minus(emitter *e, rf_tensor *b) { return rf_sub(num(e, 1.0), b); }
static rf_tensor *abs2(rf_tensor *x) { return rf_mul(x, x); }

/* beta * old + (1 - beta) * x: every moving average in rules.jl. */
static rf_tensor *ema(emitter *e, rf_tensor *old, rf_tensor *beta, rf_tensor *x)
{
    return rf_add(rf_mul(beta, old), rf_mul(one_minus(e, beta), x));
}

/* ---- Rules ----------------------------------------------------------------------------------- */
/* Each emitter gets the leaf index l and the incoming dx; returns dx'. The
 * hyperparameter and role indices are those of rules.c's tables. */

/* Descent: dx' = dx * eta */
static rf_tensor *emit_descent(emitter *e, int l, rf_tensor *dx)
{
    return rf_mul(dx, hp(e, l, 0));
}

/* Momentum: v = rho v + eta dx; dx' = v */
static rf_tensor *emit_momentum(emitter *e, int l, rf_tensor *dx)
{
    rf_tensor *v = rf_add(rf_mul(hp(e, l, 1), state(e, l, 0)), rf_mul(hp(e, l, 0), dx));
    put(e, l, 0, v);
    return v;
}

/* Nesterov: dx' = -rho^2 v + (1 + rho) eta dx (old v); v = rho v - eta dx */
static rf_tensor *emit_nesterov(emitter *e, int l, rf_tensor *dx)
{
    rf_tensor *eta = hp(e, l, 0), *rho = hp(e, l, 1), *v = state(e, l, 0);
    rf_tensor *out = rf_add(rf_mul(rf_neg(rf_mul(rho, rho)), v),
                            rf_mul(rf_mul(rf_add(num(e, 1.0), rho), eta), dx));
    put(e, l, 0, rf_sub(rf_mul(rho, v), rf_mul(eta, dx)));
    return out;
}

/* RMSProp: quad = ema(quad, rho, dx^2); centred: lin = ema(lin, rho, dx);
 * dx' = dx eta / (sqrt(max(quad - lin^2, 0)) + eps) (lin = 0 when not centred).
 * quad >= lin^2 holds exactly, but the difference cancels (with rho = 0 it is
 * dx^2 - dx^2), and where a fused multiply-add keeps lin^2 unrounded, as
 * compiled code may, it can come out below zero: the clamp keeps the square
 * root real (NaN stays NaN: max propagates it). */
static rf_tensor *emit_rmsprop(emitter *e, int l, rf_tensor *dx, bool centred)
{
    rf_tensor *eta = hp(e, l, 0), *rho = hp(e, l, 1), *eps = hp(e, l, 2);
    rf_tensor *quad = ema(e, state(e, l, 0), rho, abs2(dx));
    put(e, l, 0, quad);
    rf_tensor *ms = quad;
    if (centred) {
        rf_tensor *lin = ema(e, state(e, l, 1), rho, dx);
        put(e, l, 1, lin);
        ms = rf_max(rf_sub(quad, abs2(lin)), num(e, 0.0));
    }
    return rf_div(rf_mul(dx, eta), rf_add(rf_sqrt(ms), eps));
}

/* The moments shared by the Adam family (roles 0 and 1):
 * m = ema(m, beta1, dx); v = ema(v, beta2, dx^2) */
static void adam_moments(emitter *e, int l, rf_tensor *dx, rf_tensor **m, rf_tensor **v)
{
    *m = ema(e, state(e, l, 0), hp(e, l, 1), dx);
    *v = ema(e, state(e, l, 1), hp(e, l, 2), abs2(dx));
    put(e, l, 0, *m);
    put(e, l, 1, *v);
}

/* beta^t for t = this step (roles b1 and b2), advanced to beta^(t+1). */
static void advance_betas(emitter *e, int l, int role1, rf_tensor **b1t, int role2,
                          rf_tensor **b2t)
{
    *b1t = state(e, l, role1);
    put(e, l, role1, rf_mul(*b1t, hp(e, l, 1)));
    if (role2 >= 0) {
        *b2t = state(e, l, role2);
        put(e, l, role2, rf_mul(*b2t, hp(e, l, 2)));
    }
}

/* m / (1 - beta1^t) / (sqrt(v / (1 - beta2^t)) + eps): Adam's direction. The
 * bias corrections multiply by their reciprocals, scalars computed once per
 * step: two divisions fewer per element (the mlp's Adam over 536k parameters
 * took about 210 us, now 170-200 us), and the results differ from dividing
 * by at most an ulp of each factor. */
static rf_tensor *adam_direction(emitter *e, rf_tensor *m, rf_tensor *v, rf_tensor *b1t,
                                 rf_tensor *b2t, rf_tensor *eps)
{
    rf_tensor *inv1 = rf_div(num(e, 1.0), one_minus(e, b1t));
    rf_tensor *inv2 = rf_div(num(e, 1.0), one_minus(e, b2t));
    return rf_div(rf_mul(m, inv1), rf_add(rf_sqrt(rf_mul(v, inv2)), eps));
}

/* Adam: dx' = m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) * eta */
static rf_tensor *emit_adam(emitter *e, int l, rf_tensor *dx)
{
    rf_tensor *m, *v, *b1t, *b2t;
    adam_moments(e, l, dx, &m, &v);
    advance_betas(e, l, 2, &b1t, 3, &b2t);
    return rf_mul(adam_direction(e, m, v, b1t, b2t, hp(e, l, 3)), hp(e, l, 0));
}

/* AdamW (Optimisers.jl 0.4, couple = true, as PyTorch's AdamW):
 * dx' = eta * (adam_direction + lambda * x). Hyperparameters: eta beta1 beta2 lambda eps. */
static rf_tensor *emit_adamw(emitter *e, int l, rf_tensor *dx)
{
    rf_tensor *m, *v, *b1t, *b2t;
    adam_moments(e, l, dx, &m, &v);
    advance_betas(e, l, 2, &b1t, 3, &b2t);
    rf_tensor *dir = adam_direction(e, m, v, b1t, b2t, hp(e, l, 4));
    return rf_mul(hp(e, l, 0), rf_add(dir, rf_mul(hp(e, l, 3), e->x)));
}

/* RAdam: rho_inf = 2/(1 - b2) - 1; rho = rho_inf - 2 t b2^t / (1 - b2^t) with
 * its own t (1 on the first step). If rho > 4:
 *   r = sqrt((rho-4)(rho-2) rho_inf / ((rho_inf-4)(rho_inf-2) rho)),
 *   dx' = m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) * eta * r
 * else dx' = m / (1 - b1^t) * eta. (PyTorch's RAdam uses rho > 5 and eps
 * outside the bias correction; we follow Optimisers.jl.) */
static rf_tensor *emit_radam(emitter *e, int l, rf_tensor *dx)
{
    rf_tensor *eta = hp(e, l, 0), *b2 = hp(e, l, 2), *eps = hp(e, l, 3);
    rf_tensor *m, *v, *b1t, *b2t;
    adam_moments(e, l, dx, &m, &v);
    advance_betas(e, l, 2, &b1t, 3, &b2t);
    rf_tensor *t = state(e, l, 4);
    put(e, l, 4, rf_add(t, num(e, 1.0)));

    rf_tensor *rho_inf = rf_sub(rf_div(num(e, 2.0), one_minus(e, b2)), num(e, 1.0));
    rf_tensor *rho = rf_sub(rho_inf, rf_div(rf_mul(rf_mul(num(e, 2.0), t), b2t),
                                            one_minus(e, b2t)));
    rf_tensor *r2 = rf_div(rf_mul(rf_mul(rf_sub_s(rho, 4.0), rf_sub_s(rho, 2.0)), rho_inf),
                           rf_mul(rf_mul(rf_sub_s(rho_inf, 4.0), rf_sub_s(rho_inf, 2.0)), rho));
    /* r is only used when rho > 4, where r2 > 0; the clamp keeps the unused
     * branch free of NaN. */
    rf_tensor *r = rf_sqrt(rf_max(r2, num(e, 0.0)));
    rf_tensor *mhat = rf_div(m, one_minus(e, b1t));
    rf_tensor *rect = rf_mul(rf_mul(rf_div(mhat, rf_add(rf_sqrt(rf_div(v, one_minus(e, b2t))),
                                                        eps)),
                                    eta),
                             r);
    return rf_select(rf_compare(rho, num(e, 4.0), RF_GT), rect, rf_mul(mhat, eta));
}

/* AdaMax: m = ema(m, b1, dx); u = max(b2 u, |dx|); dx' = (eta / (1 - b1^t)) m / (u + eps) */
static rf_tensor *emit_adamax(emitter *e, int l, rf_tensor *dx)
{
    rf_tensor *m = ema(e, state(e, l, 0), hp(e, l, 1), dx);
    rf_tensor *u = rf_max(rf_mul(hp(e, l, 2), state(e, l, 1)), rf_abs(dx));
    put(e, l, 0, m);
    put(e, l, 1, u);
    rf_tensor *b1t = NULL;
    advance_betas(e, l, 2, &b1t, -1, NULL);
    rf_tensor *step = rf_div(hp(e, l, 0), one_minus(e, b1t));
    return rf_mul(step, rf_div(m, rf_add(u, hp(e, l, 3))));
}

/* OAdam: term = eta m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps);
 * dx' = 2 term - term_previous */
static rf_tensor *emit_oadam(emitter *e, int l, rf_tensor *dx)
{
    rf_tensor *m, *v, *b1t, *b2t;
    adam_moments(e, l, dx, &m, &v);
    advance_betas(e, l, 2, &b1t, 3, &b2t);
    rf_tensor *prev = state(e, l, 4);
    rf_tensor *term = rf_div(rf_div(rf_mul(hp(e, l, 0), m), one_minus(e, b1t)),
                             rf_add(rf_sqrt(rf_div(v, one_minus(e, b2t))), hp(e, l, 3)));
    put(e, l, 4, term);
    return rf_sub(rf_mul(num(e, 2.0), term), prev);
}

/* AdaGrad: acc += dx^2 (acc starts at eps); dx' = dx eta / (sqrt(acc) + eps) */
static rf_tensor *emit_adagrad(emitter *e, int l, rf_tensor *dx)
{
    rf_tensor *acc = rf_add(state(e, l, 0), abs2(dx));
    put(e, l, 0, acc);
    return rf_div(rf_mul(dx, hp(e, l, 0)), rf_add(rf_sqrt(acc), hp(e, l, 1)));
}

/* AdaDelta: acc = ema(acc, rho, dx^2); dx' = dx sqrt(dacc + eps) / sqrt(acc + eps)
 * (old dacc); dacc = ema(dacc, rho, dx'^2). Hyperparameters: rho eps. */
static rf_tensor *emit_adadelta(emitter *e, int l, rf_tensor *dx)
{
    rf_tensor *rho = hp(e, l, 0), *eps = hp(e, l, 1);
    rf_tensor *acc = ema(e, state(e, l, 0), rho, abs2(dx));
    rf_tensor *dacc = state(e, l, 1);
    rf_tensor *out = rf_div(rf_mul(dx, rf_sqrt(rf_add(dacc, eps))), rf_sqrt(rf_add(acc, eps)));
    put(e, l, 0, acc);
    put(e, l, 1, ema(e, dacc, rho, abs2(out)));
    return out;
}

/* AMSGrad (no bias correction; m, v, vhat start at eps):
 * vhat = max(vhat, v); dx' = eta m / (sqrt(vhat) + eps) */
static rf_tensor *emit_amsgrad(emitter *e, int l, rf_tensor *dx)
{
    rf_tensor *m, *v;
    adam_moments(e, l, dx, &m, &v);
    rf_tensor *vhat = rf_max(state(e, l, 2), v);
    put(e, l, 2, vhat);
    return rf_div(rf_mul(hp(e, l, 0), m), rf_add(rf_sqrt(vhat), hp(e, l, 3)));
}

/* NAdam: dx' = (b1 m / (1 - b1 b1^t) + (1 - b1) dx / (1 - b1^t))
 *              / (sqrt(v b2 / (1 - b2^t)) + eps) * eta */
static rf_tensor *emit_nadam(emitter *e, int l, rf_tensor *dx)
{
    rf_tensor *b1 = hp(e, l, 1), *b2 = hp(e, l, 2);
    rf_tensor *m, *v, *b1t, *b2t;
    adam_moments(e, l, dx, &m, &v);
    advance_betas(e, l, 2, &b1t, 3, &b2t);
    rf_tensor *num_ = rf_add(rf_div(rf_mul(b1, m), one_minus(e, rf_mul(b1, b1t))),
                             rf_div(rf_mul(one_minus(e, b1), dx), one_minus(e, b1t)));
    rf_tensor *den = rf_add(rf_sqrt(rf_div(rf_mul(v, b2), one_minus(e, b2t))), hp(e, l, 3));
    return rf_mul(rf_div(num_, den), hp(e, l, 0));
}

/* AdaBelief: m = ema(m, b1, dx); s = b2 s + (1 - b2)(dx - m)^2 + eps;
 * dx' = eta m / (1 - b1^t) / (sqrt(s / (1 - b2^t)) + eps) */
static rf_tensor *emit_adabelief(emitter *e, int l, rf_tensor *dx)
{
    rf_tensor *eps = hp(e, l, 3);
    rf_tensor *m = ema(e, state(e, l, 0), hp(e, l, 1), dx);
    rf_tensor *s = rf_add(ema(e, state(e, l, 1), hp(e, l, 2), abs2(rf_sub(dx, m))), eps);
    put(e, l, 0, m);
    put(e, l, 1, s);
    rf_tensor *b1t, *b2t;
    advance_betas(e, l, 2, &b1t, 3, &b2t);
    return rf_div(rf_div(rf_mul(hp(e, l, 0), m), one_minus(e, b1t)),
                  rf_add(rf_sqrt(rf_div(s, one_minus(e, b2t))), eps));
}

/* Lion, as published (Chen et al. 2023, Algorithm 2):
 *   c = b1 m + (1 - b1) dx;  dx' = eta sign(c);  m = b2 m + (1 - b2) dx.
 * Optimisers.jl 0.4.8 writes the momentum as b2 dx + (1 - b2) m, which is not
 * the paper's recurrence; we follow the paper (and its defaults 0.9, 0.99). */
static rf_tensor *emit_lion(emitter *e, int l, rf_tensor *dx)
{
    rf_tensor *m = state(e, l, 0);
    rf_tensor *c = ema(e, m, hp(e, l, 1), dx);
    put(e, l, 0, ema(e, m, hp(e, l, 2), dx));
    return rf_mul(hp(e, l, 0), rf_sign(c));
}

/* ClipNorm: each parameter's gradient with p-norm above omega is scaled to
 * omega: dx' = dx * min(omega / norm(dx_array, p), 1). Optimisers.jl applies
 * it per array, so on the flat vector the norms are per segment: one small
 * reduction per parameter, the norm math once on the vector of partial
 * results, and the per-segment factors broadcast back. A non-finite norm
 * propagates (Optimisers.jl's throw = false). */
static rf_tensor *norm_part(rf_tensor *x, double p)
{
    rf_tensor *a = rf_abs(x);
    if (p == 2)
        return rf_sum_all(abs2(x));
    if (p == 1)
        return rf_sum_all(a);
    if (isinf(p))
        return rf_reduce(a, p > 0 ? RF_REDUCE_MAX : RF_REDUCE_MIN, NULL, 0, false);
    if (p == 0)
        return rf_sum_all(rf_convert(rf_compare(x, rf_zeros_like(x), RF_NE), rf_tensor_dtype(x)));
    return rf_sum_all(rf_pow_s(a, p));
}

static rf_tensor *norm_finish(rf_tensor *part, double p)
{
    if (p == 2)
        return rf_sqrt(part);
    if (p == 1 || p == 0 || isinf(p))
        return part;
    return rf_pow_s(part, 1.0 / p);
}

/* norm_part of the whole flat vector x, as one partial per parameter segment
 * combined (summed, or the extreme of the extremes for p = +-inf): a sum
 * over the concatenated vector reads each point through all the pieces of
 * the concatenation (a clamped load each, neither vectorised nor split over
 * threads: 0.87 ms for an MLP's 536K gradients), a sum per parameter reads
 * its gradient directly. */
static rf_tensor *joint_norm_part(emitter *e, rf_tensor *x, double p)
{
    if (e->n_seg <= 1)
        return norm_part(x, p);
    rf_tensor *total = NULL;
    int64_t off = 0;
    for (int i = 0; i < e->n_seg; i++) {
        int64_t lo[1] = {off}, hi[1] = {off + e->seg[i]};
        rf_tensor *part = norm_part(rf_slice(x, lo, hi, NULL), p);
        off = hi[0];
        if (!total)
            total = part;
        else if (isinf(p))
            total = p > 0 ? rf_max(total, part) : rf_min(total, part);
        else
            total = rf_add(total, part);
    }
    return total;
}

/* ClipNorm over all parameters at once (PyTorch's clip_grad_norm_, optax's
 * clip_by_global_norm, without their epsilon): the norm of the whole flat vector. */
static rf_tensor *emit_clipnorm_global(emitter *e, int l, rf_tensor *dx)
{
    double p = e->o->leaves[l].rule->hp[1];
    /* a frozen member's dx is zero unless a decay upstream added its parameters: the
     * norm is over what is trained */
    rf_tensor *counted = dx;
    if (e->frozen) {
        const int64_t len[1] = {e->g->numel};
        rf_tensor *zero = rf_convert(num(e, 0.0), e->g->dtype);
        counted = keep_frozen(e, rf_broadcast_to(zero, len, 1), dx);
    }
    rf_tensor *norm = norm_finish(joint_norm_part(e, counted, p), p);
    return rf_mul(dx, rf_min(rf_div(hp(e, l, 0), norm), num(e, 1.0)));
}

static rf_tensor *emit_clipnorm(emitter *e, int l, rf_tensor *dx)
{
    double p = e->o->leaves[l].rule->hp[1];
    rf_tensor *omega = hp(e, l, 0);
    if (e->n_seg <= 1) {
        rf_tensor *lam = rf_min(rf_div(omega, norm_finish(norm_part(dx, p), p)), num(e, 1.0));
        return rf_mul(dx, lam);
    }
    rf_tensor **parts = rfi_calloc((size_t)e->n_seg, sizeof *parts);
    if (!parts) {
        fail(e->t, RF_E_NOMEM, "rf_update: out of memory");
        return NULL;
    }
    const int64_t one[1] = {1};
    int64_t off = 0;
    for (int i = 0; i < e->n_seg; i++) {
        int64_t lo[1] = {off}, hi[1] = {off + e->seg[i]};
        parts[i] = rf_reshape(norm_part(rf_slice(dx, lo, hi, NULL), p), one, 1);
        off = hi[0];
    }
    rf_tensor *norms = norm_finish(rf_concatenate(parts, e->n_seg, 0), p); /* [n_seg] */
    rf_tensor *lam = rf_min(rf_div(omega, norms), num(e, 1.0));
    off = 0;
    for (int i = 0; i < e->n_seg; i++) {
        int64_t lo[1] = {i}, hi[1] = {i + 1}, len[1] = {e->seg[i]};
        parts[i] = rf_broadcast_to(rf_slice(lam, lo, hi, NULL), len, 1);
    }
    rf_tensor *scale = rf_concatenate(parts, e->n_seg, 0);
    rfi_free(parts);
    return rf_mul(dx, scale);
}

/* AccumGrad(n): acc = dx/n on the first of n steps, acc + dx/n after; on the
 * n-th step dx' = acc and the counter restarts, otherwise the rules after it
 * are skipped (their state keeps its value) and the parameters stay. */
static rf_tensor *emit_accumgrad(emitter *e, int l, rf_tensor *dx)
{
    double n = e->o->leaves[l].rule->hp[0];
    rf_tensor *count = state(e, l, 1);
    rf_tensor *share = rf_div_s(dx, n);
    rf_tensor *first = rf_compare(count, num(e, 1.0), RF_EQ);
    rf_tensor *acc = rf_select(first, share, rf_add(state(e, l, 0), share));
    rf_tensor *fire = rf_compare(count, num(e, n), RF_EQ);
    put(e, l, 0, acc);
    put(e, l, 1, rf_select(fire, num(e, 1.0), rf_add(count, num(e, 1.0))));
    e->active = e->active ? rf_and(e->active, fire) : fire;
    return acc;
}

static rf_tensor *apply_rule(emitter *e, const rf_rule *r, rf_tensor *dx)
{
    if (r->kind == RFI_RULE_CHAIN) {
        for (int i = 0; i < r->n_children; i++)
            dx = apply_rule(e, r->children[i], dx);
        return dx;
    }
    int l = e->leaf++;
    switch (r->kind) {
    case RFI_RULE_DESCENT: return emit_descent(e, l, dx);
    case RFI_RULE_MOMENTUM: return emit_momentum(e, l, dx);
    case RFI_RULE_NESTEROV: return emit_nesterov(e, l, dx);
    case RFI_RULE_RMSPROP: return emit_rmsprop(e, l, dx, r->flag);
    case RFI_RULE_ADAM: return emit_adam(e, l, dx);
    case RFI_RULE_ADAMW: return emit_adamw(e, l, dx);
    case RFI_RULE_RADAM: return emit_radam(e, l, dx);
    case RFI_RULE_ADAMAX: return emit_adamax(e, l, dx);
    case RFI_RULE_OADAM: return emit_oadam(e, l, dx);
    case RFI_RULE_ADAGRAD: return emit_adagrad(e, l, dx);
    case RFI_RULE_ADADELTA: return emit_adadelta(e, l, dx);
    case RFI_RULE_AMSGRAD: return emit_amsgrad(e, l, dx);
    case RFI_RULE_NADAM: return emit_nadam(e, l, dx);
    case RFI_RULE_ADABELIEF: return emit_adabelief(e, l, dx);
    case RFI_RULE_LION: return emit_lion(e, l, dx);
    case RFI_RULE_WEIGHTDECAY: return rf_add(dx, rf_mul(hp(e, l, 0), e->x));
    case RFI_RULE_SIGNDECAY: return rf_add(dx, rf_mul(hp(e, l, 0), rf_sign(e->x)));
    case RFI_RULE_CLIPGRAD: {
        rf_tensor *d = hp(e, l, 0);
        return rf_clamp(dx, rf_neg(d), d);
    }
    case RFI_RULE_CLIPNORM: return emit_clipnorm(e, l, dx);
    case RFI_RULE_CLIPNORM_GLOBAL: return emit_clipnorm_global(e, l, dx);
    case RFI_RULE_ACCUMGRAD: return emit_accumgrad(e, l, dx);
    default:
        fail(e->t, RF_E_INTERNAL, "rf_update: unknown rule kind %d", (int)r->kind);
        return NULL;
    }
}

/* ---- One dtype group ------------------------------------------------------------------------- */

/* The flat concatenation of the members' xs (each reshaped to [-1]), zeros for a
 * frozen member's (frozen NULL: none); xs is indexed by parameter, scratch has room for
 * the members. */
static rf_tensor *flatten_all(rf_trace *t, rf_tensor **scratch, const rfi_opt_group *g,
                              rf_tensor *const *xs, const bool *frozen)
{
    const int64_t minus1[1] = {-1};
    for (int i = 0; i < g->n_members; i++) {
        const rf_tensor *x = xs[g->members[i]];
        int64_t len[1] = {rf_tensor_numel(x)};
        scratch[i] = frozen && frozen[i]
                         ? rf_broadcast_to(rf_convert(rf_scalar(t, 0.0), g->dtype), len, 1)
                         : rf_reshape(xs[g->members[i]], minus1, 1);
    }
    return g->n_members == 1 ? scratch[0] : rf_concatenate(scratch, g->n_members, 0);
}

/* x' = x - rule(flat grads), sliced back into every trained member of the group. The
 * rule runs over every member, as without freezing, so the update stays one segmented
 * in-place loop: a frozen member's gradient is zeros (its own is never computed), its
 * pieces of the flat state are its old values (keep_frozen), and it is not assigned. */
static rf_status emit_group(rf_trace *t, rf_opt *o, rfi_opt_group *g, rf_array *const *params,
                            rf_tensor *const *grads, const bool *frozen)
{
    int n = g->n_members;
    rf_tensor **scratch = rfi_calloc((size_t)n, sizeof *scratch);
    rf_tensor **px = rfi_calloc((size_t)o->n_params, sizeof *px); /* by parameter index */
    int64_t *seg = rfi_calloc((size_t)n, sizeof *seg);
    bool *member_frozen = rfi_calloc((size_t)n, sizeof *member_frozen);
    if (!scratch || !px || !seg || !member_frozen) {
        rfi_free(scratch);
        rfi_free(px);
        rfi_free(seg);
        rfi_free(member_frozen);
        return fail(t, RF_E_NOMEM, "rf_update: out of memory");
    }
    int n_trained = 0;
    for (int i = 0; i < n; i++) {
        int p = g->members[i];
        seg[i] = o->param_numel[p];
        px[p] = rf_capture(t, params[p]);
        member_frozen[i] = frozen && frozen[p];
        n_trained += !member_frozen[i];
    }
    const bool *fz = n_trained < n ? member_frozen : NULL;

    /* A group with nothing to train keeps its parameters and flat state, but its
     * scalar state (beta^t, AccumGrad's count) advances with the other groups'. */
    emitter e = {.t = t, .o = o, .g = g, .leaf = 0, .active = NULL, .seg = seg,
                 .n_seg = n, .frozen = fz, .none_trained = n_trained == 0};
    e.x = flatten_all(t, scratch, g, px, NULL);
    rf_tensor *dx = apply_rule(&e, o->rule, flatten_all(t, scratch, g, grads, fz));
    rf_tensor *xn = rf_sub(e.x, dx);
    if (e.active) /* an AccumGrad still accumulating: parameters stay as they are */
        xn = rf_select(e.active, xn, e.x);

    int64_t off = 0;
    for (int i = 0; i < n; i++) {
        rf_array *p = params[g->members[i]];
        rf_tensor *piece = xn;
        if (n > 1) {
            int64_t lo[1] = {off}, hi[1] = {off + seg[i]};
            piece = rf_slice(xn, lo, hi, NULL);
        }
        off += seg[i];
        if (!member_frozen[i])
            rf_assign(t, p, rf_reshape(piece, rf_array_dims(p), rf_array_rank(p)));
    }
    rfi_free(scratch);
    rfi_free(px);
    rfi_free(seg);
    rfi_free(member_frozen);
    return rf_trace_status(t);
}

/* ---- Entry points ---------------------------------------------------------------------------- */

/* Checks that the model's parameters are those opt was set up for and that
 * the gradients match them. */
static rf_status check_inputs(rf_trace *t, rf_opt *o, rf_array *const *ps,
                              int n_ps, rf_tensor *const *grads, int n_grads)
{
    if (n_ps != o->n_params)
        return fail(t, RF_E_SHAPE, "rf_update: the model has %d trainable parameters, but the "
                    "optimiser was set up for %d (set it up again after changing the model)",
                    n_ps, o->n_params);
    for (int i = 0; i < n_ps; i++)
        if (rf_array_dtype(ps[i]) != o->param_dtype[i] ||
            rf_array_numel(ps[i]) != o->param_numel[i])
            return fail(t, RF_E_SHAPE, "rf_update: parameter %d is %s with %lld elements now, "
                        "but was %s with %lld at rf_setup", i, rf_dtype_name(rf_array_dtype(ps[i])),
                        (long long)rf_array_numel(ps[i]), rf_dtype_name(o->param_dtype[i]),
                        (long long)o->param_numel[i]);
    if (n_grads != n_ps)
        return fail(t, RF_E_INVALID, "rf_update: %d gradients for %d trainable parameters",
                    n_grads, n_ps);
    for (int i = 0; i < n_ps; i++) {
        const rf_tensor *gi = grads[i];
        if (!gi) {
            if (rf_trace_status(t) != RF_OK)
                return rf_trace_status(t); /* the NULL came from an earlier failure */
            return fail(t, RF_E_INVALID, "rf_update: gradient %d is NULL", i);
        }
        if (rf_tensor_trace(gi) != t)
            return fail(t, RF_E_INVALID, "rf_update: gradient %d belongs to another trace", i);
        bool same = rf_tensor_dtype(gi) == rf_array_dtype(ps[i]) &&
                    rf_tensor_rank(gi) == rf_array_rank(ps[i]);
        for (int k = 0; same && k < rf_array_rank(ps[i]); k++)
            same = rf_tensor_dims(gi)[k] == rf_array_dims(ps[i])[k];
        if (!same) {
            char tg[96], tp[96];
            rfi_type_str(tg, sizeof tg, rf_tensor_dtype(gi), rf_tensor_dims(gi),
                         rf_tensor_rank(gi));
            rfi_type_str(tp, sizeof tp, rf_array_dtype(ps[i]), rf_array_dims(ps[i]),
                         rf_array_rank(ps[i]));
            return fail(t, rf_tensor_dtype(gi) != rf_array_dtype(ps[i]) ? RF_E_DTYPE : RF_E_SHAPE,
                        "rf_update: gradient %d is %s but parameter %d is %s", i, tg, i, tp);
        }
    }
    return RF_OK;
}

/* ---- Frozen parameters and updates already recorded ---------------------------------------- */

typedef struct path_job {
    int index;      /* of the next trainable array */
    int want;       /* -1: name every watched one */
    char *buf;      /* want >= 0: its path goes here */
    size_t n;
    rf_trace *t;
    const int *watch; /* want < 0: per parameter, its watch index or -1 */
} path_job;

static void name_param(const char *path, rf_array *a, bool trainable, void *ud)
{
    (void)a;
    path_job *j = ud;
    if (!trainable)
        return;
    int i = j->index++;
    if (j->want == i)
        snprintf(j->buf, j->n, "%s", path);
    else if (j->want < 0 && j->watch[i] >= 0)
        snprintf(j->t->watches.v[j->watch[i]].what, sizeof j->t->watches.v[0].what,
                 "parameter \"%s\"", path);
}

/* Reads which parameters are frozen (rf_opt_freeze), watching each flag: a program
 * traced now updates exactly the others and must not run once one changes. *frozen is
 * per parameter (rfi_malloc'd). */
static rf_status read_frozen(rf_trace *t, rf_opt *o, bool **frozen)
{
    bool *v = rfi_calloc(o->n_params ? (size_t)o->n_params : 1, sizeof *v);
    int *watch = rfi_calloc(o->n_params ? (size_t)o->n_params : 1, sizeof *watch);
    if (!v || !watch) {
        rfi_free(v);
        rfi_free(watch);
        return fail(t, RF_E_NOMEM, "rf_update: out of memory");
    }
    bool named = false;
    for (int i = 0; i < o->n_params; i++) {
        v[i] = atomic_load(&o->frozen[i]->value);
        watch[i] = rfi_trace_watch(t, o->frozen[i], v[i]);
        if (watch[i] >= 0) {
            t->watches.v[watch[i]].kind = RFI_WATCH_FROZEN;
            snprintf(t->watches.v[watch[i]].what, sizeof t->watches.v[0].what,
                     "parameter %d", i);
            named = true;
        }
    }
    if (named) { /* the paths, where the model's walk can build them */
        path_job j = {.want = -1, .t = t, .watch = watch};
        rf_model_visit(o->model, name_param, &j);
    }
    rfi_free(watch);
    *frozen = v;
    return rf_trace_status(t);
}

/* The first trained parameter this trace already updates (another rf_update, an
 * rf_assign), or -1: of two updates of one array only the last would count. */
static int updated_already(const rf_trace *t, rf_array *const *ps, int n, const bool *frozen)
{
    for (int k = 0; k < t->n_updates; k++) {
        const rf_array *a = t->captures[t->updates[k].capture];
        for (int i = 0; i < n; i++)
            if (ps[i] == a && !frozen[i])
                return i;
    }
    return -1;
}

static rf_status refuse_updated(rf_trace *t, rf_opt *o, int i)
{
    char path[128];
    snprintf(path, sizeof path, "%d", i);
    path_job j = {.want = i, .buf = path, .n = sizeof path};
    rf_model_visit(o->model, name_param, &j);
    return fail(t, RF_E_INVALID, "rf_update: parameter \"%s\" is already updated in this "
                "trace (by another optimiser's rf_update or an rf_assign), and only the last "
                "update of an array would count; freeze it in one optimiser (rf_opt_freeze) "
                "or set each optimiser up for its own layers", path);
}

/* Writes the path of `inner` below `outer` ("2.0"; "" when they are one)
 * into buf (capacity n); false when `outer` does not contain `inner`. */
static bool path_below(const rf_model *inner, const rf_model *outer, char *buf, size_t n)
{
    if (inner == outer) {
        buf[0] = '\0';
        return true;
    }
    if (!inner->parent || !path_below(inner->parent, outer, buf, n))
        return false;
    int index = 0;
    while (index < inner->parent->n_children && inner->parent->children[index] != inner)
        index++;
    size_t len = strlen(buf);
    if (len + 1 < n)
        snprintf(buf + len, n - len, "%s%d", len ? "." : "", index);
    return true;
}

void rfi_opt_relation(const rf_opt *opt, const rf_model *m, char *buf, size_t n)
{
    char path[128];
    buf[0] = '\0';
    if (!opt->model || !m || opt->model == m)
        return;
    if (path_below(opt->model, m, path, sizeof path))
        snprintf(buf, n, "; it was set up for layer \"%s\" of this model: give that layer, "
                 "or set an optimiser up for this one", path);
    else if (path_below(m, opt->model, path, sizeof path))
        snprintf(buf, n, "; it was set up for the model this layer is \"%s\" of: give that "
                 "model, or set an optimiser up for this layer", path);
}

rf_status rfi_opt_emit_update(rf_trace *t, rf_opt *opt, rf_model *m, rf_tensor *const *grads,
                              int n_grads)
{
    if (!t)
        return rfi_error(RF_E_INVALID, "rf_update: trace is NULL");
    if (!opt || !m)
        return fail(t, RF_E_INVALID, "rf_update: %s is NULL", opt ? "model" : "optimiser");
    if (!opt->model)
        return fail(t, RF_E_INVALID, "rf_update: the optimiser's model was freed");
    if (opt->model != m) {
        char rel[256];
        rfi_opt_relation(opt, m, rel, sizeof rel);
        if (rel[0])
            return fail(t, RF_E_INVALID, "rf_update: the optimiser was set up for another "
                        "model%s", rel);
        return fail(t, RF_E_INVALID, "rf_update: the optimiser was set up for another model "
                    "(rf_model_to makes a new model: set up the optimiser on the moved copy)");
    }
    if (rf_trace_status(t) != RF_OK)
        return rf_trace_status(t);
    if (n_grads > 0 && !grads)
        return fail(t, RF_E_INVALID, "rf_update: grads is NULL");

    rf_array **ps = NULL;
    int n_ps = rfi_model_collect_params(m, &ps);
    if (n_ps < 0)
        return fail(t, RF_E_NOMEM, "rf_update: out of memory");
    rf_status st = check_inputs(t, opt, ps, n_ps, grads, n_grads);
    bool *frozen = NULL;
    if (st == RF_OK)
        st = read_frozen(t, opt, &frozen);
    int twice = st == RF_OK ? updated_already(t, ps, n_ps, frozen) : -1;
    if (twice >= 0)
        st = refuse_updated(t, opt, twice);
    for (int k = 0; st == RF_OK && k < opt->n_groups; k++)
        st = emit_group(t, opt, &opt->groups[k], ps, grads, frozen);
    if (st == RF_OK)
        rf_assign(t, opt->steps, rf_add(rf_capture(t, opt->steps), rf_scalar(t, 1.0)));
    rfi_free(frozen);
    rfi_free(ps);
    st = rf_trace_status(t);
    if (st != RF_OK && rf_errmsg()[0] == '\0')
        rfi_error(st, "rf_update: tracing the update failed");
    return st;
}

void rf_update(rf_trace *t, rf_opt *opt, rf_model *m, const rf_grads *g)
{
    if (!t)
        return;
    if (!g) {
        if (rf_trace_status(t) == RF_OK)
            fail(t, RF_E_INVALID, "rf_update: grads is NULL");
        return;
    }
    int n = rf_grads_count(g);
    rf_tensor **gs = rfi_calloc(n > 0 ? (size_t)n : 1, sizeof *gs);
    if (!gs) {
        fail(t, RF_E_NOMEM, "rf_update: out of memory");
        return;
    }
    for (int i = 0; i < n; i++)
        gs[i] = rf_grads_get(g, i);
    rfi_opt_emit_update(t, opt, m, gs, n);
    rfi_free(gs);
}
