/* rules.c: optimiser rules as plain descriptions: the constructors, chains,
 * names, the structural hash, and the tables that say which hyperparameters
 * and which state arrays each rule has.
 *
 * A rule here holds numbers only; it never touches a device and never builds
 * IR. Creating state (setup.c) and emitting the update math (update.c) read
 * the tables below, so adding a rule means one constructor, one table row and
 * one emitter. Defaults are Optimisers.jl 0.4's; the header lists them.
 */
#include "optim.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core/core.h"

/* ---- Tables ---------------------------------------------------------------------------------- */

static const char *const rule_names[RFI_RULE_KIND_COUNT] = {
    [RFI_RULE_DESCENT] = "descent",     [RFI_RULE_MOMENTUM] = "momentum",
    [RFI_RULE_NESTEROV] = "nesterov",   [RFI_RULE_RMSPROP] = "rmsprop",
    [RFI_RULE_ADAM] = "adam",           [RFI_RULE_ADAMW] = "adamw",
    [RFI_RULE_RADAM] = "radam",         [RFI_RULE_ADAMAX] = "adamax",
    [RFI_RULE_OADAM] = "oadam",         [RFI_RULE_ADAGRAD] = "adagrad",
    [RFI_RULE_ADADELTA] = "adadelta",   [RFI_RULE_AMSGRAD] = "amsgrad",
    [RFI_RULE_NADAM] = "nadam",         [RFI_RULE_ADABELIEF] = "adabelief",
    [RFI_RULE_LION] = "lion",           [RFI_RULE_WEIGHTDECAY] = "weightdecay",
    [RFI_RULE_SIGNDECAY] = "signdecay", [RFI_RULE_CLIPGRAD] = "clipgrad",
    [RFI_RULE_CLIPNORM] = "clipnorm",   [RFI_RULE_CHAIN] = "chain",
    [RFI_RULE_ACCUMGRAD] = "accumgrad", [RFI_RULE_CLIPNORM_GLOBAL] = "clipnorm_global",
};

/* Hyperparameter names in constructor order. A NULL entry is structural (it
 * changes the emitted program, so it is part of the rule hash and gets no
 * runtime array): ClipNorm's p picks the reduction, AccumGrad's n the counter. */
#define ADAM_HPS {"eta", "beta1", "beta2", "epsilon"}
static const char *const hp_names[RFI_RULE_KIND_COUNT][RFI_RULE_MAX_HP] = {
    [RFI_RULE_DESCENT] = {"eta"},
    [RFI_RULE_MOMENTUM] = {"eta", "rho"},
    [RFI_RULE_NESTEROV] = {"eta", "rho"},
    [RFI_RULE_RMSPROP] = {"eta", "rho", "epsilon"},
    [RFI_RULE_ADAM] = ADAM_HPS,
    [RFI_RULE_ADAMW] = {"eta", "beta1", "beta2", "lambda", "epsilon"},
    [RFI_RULE_RADAM] = ADAM_HPS,
    [RFI_RULE_ADAMAX] = ADAM_HPS,
    [RFI_RULE_OADAM] = ADAM_HPS,
    [RFI_RULE_ADAGRAD] = {"eta", "epsilon"},
    [RFI_RULE_ADADELTA] = {"rho", "epsilon"},
    [RFI_RULE_AMSGRAD] = ADAM_HPS,
    [RFI_RULE_NADAM] = ADAM_HPS,
    [RFI_RULE_ADABELIEF] = ADAM_HPS,
    [RFI_RULE_LION] = {"eta", "beta1", "beta2"},
    [RFI_RULE_WEIGHTDECAY] = {"lambda"},
    [RFI_RULE_SIGNDECAY] = {"lambda"},
    [RFI_RULE_CLIPGRAD] = {"delta"},
    [RFI_RULE_CLIPNORM] = {"omega", NULL},
    [RFI_RULE_ACCUMGRAD] = {NULL},
    [RFI_RULE_CLIPNORM_GLOBAL] = {"omega", NULL},
};

/* State roles (see rfi_state_role). Adam-like rules keep beta^t as scalars,
 * initialised to beta (Optimisers.jl's init gives T.(o.beta)): every element
 * of a parameter shares them, so a flat vector would only repeat one value. */
#define FLAT0(n) {n, true, false, -1, 0.0}
#define FLAT_HP(n, k) {n, true, false, k, 0.0}
#define SCALAR_HP(n, k) {n, false, false, k, 0.0}
static const rfi_state_role roles_momentum[] = {FLAT0("v")};
static const rfi_state_role roles_rmsprop[] = {FLAT0("quad"), FLAT0("lin")};
static const rfi_state_role roles_adam[] = {FLAT0("m"), FLAT0("v"), SCALAR_HP("beta1t", 1),
                                            SCALAR_HP("beta2t", 2)};
static const rfi_state_role roles_radam[] = {FLAT0("m"), FLAT0("v"), SCALAR_HP("beta1t", 1),
                                             SCALAR_HP("beta2t", 2),
                                             {"t", false, false, -1, 1.0}};
static const rfi_state_role roles_adamax[] = {FLAT0("m"), FLAT0("u"), SCALAR_HP("beta1t", 1)};
static const rfi_state_role roles_oadam[] = {FLAT0("m"), FLAT0("v"), SCALAR_HP("beta1t", 1),
                                             SCALAR_HP("beta2t", 2), FLAT0("term")};
static const rfi_state_role roles_adagrad[] = {FLAT_HP("acc", 1)}; /* starts at epsilon */
static const rfi_state_role roles_adadelta[] = {FLAT0("acc"), FLAT0("dacc")};
static const rfi_state_role roles_amsgrad[] = {FLAT_HP("m", 3), FLAT_HP("v", 3),
                                               FLAT_HP("vhat", 3)}; /* all start at epsilon */
static const rfi_state_role roles_adabelief[] = {FLAT0("m"), FLAT0("s"), SCALAR_HP("beta1t", 1),
                                                 SCALAR_HP("beta2t", 2)};
static const rfi_state_role roles_lion[] = {FLAT0("m")};
static const rfi_state_role roles_accumgrad[] = {FLAT0("acc"), {"count", false, true, -1, 1.0}};

#define ROLES(a) a, (int)(sizeof a / sizeof a[0])
int rfi_rule_state_roles(const rf_rule *r, const rfi_state_role **roles)
{
    static const struct {
        const rfi_state_role *roles;
        int n;
    } table[RFI_RULE_KIND_COUNT] = {
        [RFI_RULE_MOMENTUM] = {ROLES(roles_momentum)},
        [RFI_RULE_NESTEROV] = {ROLES(roles_momentum)},
        [RFI_RULE_RMSPROP] = {ROLES(roles_rmsprop)},
        [RFI_RULE_ADAM] = {ROLES(roles_adam)},
        [RFI_RULE_ADAMW] = {ROLES(roles_adam)},
        [RFI_RULE_RADAM] = {ROLES(roles_radam)},
        [RFI_RULE_ADAMAX] = {ROLES(roles_adamax)},
        [RFI_RULE_OADAM] = {ROLES(roles_oadam)},
        [RFI_RULE_ADAGRAD] = {ROLES(roles_adagrad)},
        [RFI_RULE_ADADELTA] = {ROLES(roles_adadelta)},
        [RFI_RULE_AMSGRAD] = {ROLES(roles_amsgrad)},
        [RFI_RULE_NADAM] = {ROLES(roles_adam)},
        [RFI_RULE_ADABELIEF] = {ROLES(roles_adabelief)},
        [RFI_RULE_LION] = {ROLES(roles_lion)},
        [RFI_RULE_ACCUMGRAD] = {ROLES(roles_accumgrad)},
    };
    *roles = table[r->kind].roles;
    int n = table[r->kind].n;
    if (r->kind == RFI_RULE_RMSPROP && !r->flag)
        n = 1; /* only the centred variant keeps the mean gradient */
    return n;
}

const char *rfi_rule_hp_name(const rf_rule *r, int i)
{
    return i >= 0 && i < r->n_hp ? hp_names[r->kind][i] : NULL;
}

bool rfi_rule_has_lr(const rf_rule *r)
{
    const char *n = rfi_rule_hp_name(r, 0);
    return n && n[0] == 'e' && n[1] == 't'; /* "eta" */
}

/* ---- Construction ---------------------------------------------------------------------------- */

/* Whether the rule keeps <hp>^t for hyperparameter `hp` (beta1, beta2) to
 * correct its moments' bias, dividing by 1 - <hp>^t: then <hp> must be below 1. */
static bool has_bias_correction(rfi_rule_kind kind, const char *hp)
{
    const rfi_state_role *roles;
    rf_rule probe = {.kind = kind, .flag = true};
    int n = rfi_rule_state_roles(&probe, &roles);
    size_t len = strlen(hp);
    for (int k = 0; k < n; k++)
        if (!strncmp(roles[k].name, hp, len) && !strcmp(roles[k].name + len, "t"))
            return true;
    return false;
}

static rf_rule *make(rfi_rule_kind kind, int n, const double *hp)
{
    const char *name = rule_names[kind];
    for (int i = 0; i < n; i++) {
        const char *hn = hp_names[kind][i];
        bool structural = hn == NULL;
        /* Clip thresholds and ClipNorm's p may be infinite (no clipping, max-norm). */
        bool clipnorm = kind == RFI_RULE_CLIPNORM || kind == RFI_RULE_CLIPNORM_GLOBAL;
        bool may_be_inf = structural || kind == RFI_RULE_CLIPGRAD || clipnorm;
        if (isnan(hp[i]) || (!may_be_inf && isinf(hp[i]))) {
            rfi_error(RF_E_INVALID, "rf_%s: %s must be finite, got %g", name,
                      hn ? hn : "p", hp[i]);
            return NULL;
        }
        if (hn && hp[i] < 0 && !clipnorm) {
            rfi_error(RF_E_INVALID, "rf_%s: %s cannot be negative, got %g", name, hn, hp[i]);
            return NULL;
        }
        /* f32 parameters see the hyperparameters as f32 (setup.c): a finite
         * value beyond its range would become infinite there. */
        if (hn && isfinite(hp[i]) && fabs(hp[i]) > FLT_MAX) {
            rfi_error(RF_E_INVALID, "rf_%s: %s %g is beyond the f32 range (%g)", name, hn,
                      hp[i], (double)FLT_MAX);
            return NULL;
        }
        if (hn && !(hp[i] < 1) && has_bias_correction(kind, hn)) {
            rfi_error(RF_E_INVALID, "rf_%s: %s must be below 1 (the update divides by 1 - "
                      "%s^t), got %g", name, hn, hn, hp[i]);
            return NULL;
        }
    }
    rf_rule *r = rfi_calloc(1, sizeof *r);
    if (!r) {
        rfi_error(RF_E_NOMEM, "rf_%s: out of memory", name);
        return NULL;
    }
    r->kind = kind;
    r->n_hp = n;
    for (int i = 0; i < n; i++)
        r->hp[i] = hp[i];
    return r;
}

#define MAKE(kind, ...) \
    make(kind, (int)(sizeof((double[]){__VA_ARGS__}) / sizeof(double)), (double[]){__VA_ARGS__})

rf_rule *rf_descent(double lr) { return MAKE(RFI_RULE_DESCENT, lr); }
rf_rule *rf_momentum(double lr, double rho) { return MAKE(RFI_RULE_MOMENTUM, lr, rho); }
rf_rule *rf_nesterov(double lr, double rho) { return MAKE(RFI_RULE_NESTEROV, lr, rho); }

rf_rule *rf_rmsprop(double lr, double rho, double eps, bool centred)
{
    rf_rule *r = MAKE(RFI_RULE_RMSPROP, lr, rho, eps);
    if (r)
        r->flag = centred;
    return r;
}

rf_rule *rf_adam(double lr) { return rf_adam_ex(lr, 0.9, 0.999, 1e-8); }
rf_rule *rf_adam_ex(double lr, double beta1, double beta2, double eps)
{
    return MAKE(RFI_RULE_ADAM, lr, beta1, beta2, eps);
}
rf_rule *rf_adamw(double lr, double beta1, double beta2, double lambda, double eps)
{
    return MAKE(RFI_RULE_ADAMW, lr, beta1, beta2, lambda, eps);
}
rf_rule *rf_radam(double lr, double beta1, double beta2, double eps)
{
    return MAKE(RFI_RULE_RADAM, lr, beta1, beta2, eps);
}
rf_rule *rf_adamax(double lr, double beta1, double beta2, double eps)
{
    return MAKE(RFI_RULE_ADAMAX, lr, beta1, beta2, eps);
}
rf_rule *rf_oadam(double lr, double beta1, double beta2, double eps)
{
    return MAKE(RFI_RULE_OADAM, lr, beta1, beta2, eps);
}
rf_rule *rf_adagrad(double lr, double eps) { return MAKE(RFI_RULE_ADAGRAD, lr, eps); }
rf_rule *rf_adadelta(double rho, double eps) { return MAKE(RFI_RULE_ADADELTA, rho, eps); }
rf_rule *rf_amsgrad(double lr, double beta1, double beta2, double eps)
{
    return MAKE(RFI_RULE_AMSGRAD, lr, beta1, beta2, eps);
}
rf_rule *rf_nadam(double lr, double beta1, double beta2, double eps)
{
    return MAKE(RFI_RULE_NADAM, lr, beta1, beta2, eps);
}
rf_rule *rf_adabelief(double lr, double beta1, double beta2, double eps)
{
    return MAKE(RFI_RULE_ADABELIEF, lr, beta1, beta2, eps);
}
rf_rule *rf_lion(double lr, double beta1, double beta2)
{
    return MAKE(RFI_RULE_LION, lr, beta1, beta2);
}
rf_rule *rf_weightdecay(double lambda) { return MAKE(RFI_RULE_WEIGHTDECAY, lambda); }
rf_rule *rf_signdecay(double lambda) { return MAKE(RFI_RULE_SIGNDECAY, lambda); }
rf_rule *rf_clipgrad(double delta) { return MAKE(RFI_RULE_CLIPGRAD, delta); }

rf_rule *rf_clipnorm(double omega, double p)
{
    if (!(omega >= 0)) {
        rfi_error(RF_E_INVALID, "rf_clipnorm: omega must be >= 0, got %g", omega);
        return NULL;
    }
    return MAKE(RFI_RULE_CLIPNORM, omega, p);
}

rf_rule *rf_clipnorm_global(double omega, double p)
{
    if (!(omega >= 0)) {
        rfi_error(RF_E_INVALID, "rf_clipnorm_global: omega must be >= 0, got %g", omega);
        return NULL;
    }
    return MAKE(RFI_RULE_CLIPNORM_GLOBAL, omega, p);
}

rf_rule *rf_accumgrad(int n)
{
    if (n < 1) {
        rfi_error(RF_E_INVALID, "rf_accumgrad: must accumulate at least one gradient, got n = %d",
                  n);
        return NULL;
    }
    return MAKE(RFI_RULE_ACCUMGRAD, (double)n);
}

/* Frees the entries of rules[0..n) that the caller still owned (a chain takes its list
 * also on failure): not NULL, not another owner's, each once. */
static void free_rules(rf_rule *const *rules, int n)
{
    for (int i = 0; i < n; i++) {
        bool seen = false;
        for (int j = 0; j < i && !seen; j++)
            seen = rules[j] == rules[i];
        if (!seen && rules[i] && !rules[i]->owned)
            rfi_rule_destroy(rules[i]);
    }
}

/* Reports a NULL entry of a rule list. It almost always comes from a rule constructor
 * that failed as an argument, so the message of the last error before this call (which
 * may be another argument's, when several failed) is kept: it says why. */
static void null_rule_error(int i)
{
    char why[RFI_ERRMSG_MAX];
    snprintf(why, sizeof why, "%s", rf_errmsg());
    if (why[0])
        rfi_error(RF_E_INVALID, "rf_chain_rules: rule %d is NULL (a rule constructor failed; "
                  "the last error before this call: %s)", i, why);
    else
        rfi_error(RF_E_INVALID, "rf_chain_rules: rule %d is NULL (its constructor failed)", i);
}

/* Checks a rule list: no NULL, no rule that belongs elsewhere or appears twice. */
static bool rule_list_ok(rf_rule *const *rules, int n)
{
    for (int i = 0; i < n; i++) {
        if (!rules[i]) {
            null_rule_error(i);
            return false;
        }
        if (rules[i]->owned) {
            rfi_error(RF_E_INVALID, "rf_chain_rules: rule %d (%s) already belongs to a chain "
                      "or an optimiser: give each place a rule of its own", i,
                      rf_rule_name(rules[i]));
            return false;
        }
        for (int j = 0; j < i; j++) {
            if (rules[j] == rules[i]) {
                rfi_error(RF_E_INVALID, "rf_chain_rules: rule %d (%s) is rule %d again: give "
                          "each place a rule of its own", i, rf_rule_name(rules[i]), j);
                return false;
            }
        }
    }
    return true;
}

rf_rule *rf_chain_rules_n(rf_rule *const *rules, int n)
{
    if (n < 0 || (n > 0 && !rules)) {
        rfi_error(RF_E_INVALID, "rf_chain_rules: invalid rule list (n = %d)", n);
        return NULL;
    }
    if (!rule_list_ok(rules, n)) {
        char why[RFI_ERRMSG_MAX];
        snprintf(why, sizeof why, "%s", rf_errmsg());
        free_rules(rules, n);
        rfi_error(RF_E_INVALID, "%s", why);
        return NULL;
    }
    rf_rule *r = make(RFI_RULE_CHAIN, 0, NULL);
    rf_rule **children = n > 0 ? rfi_malloc((size_t)n * sizeof *children) : NULL;
    if (!r || (n > 0 && !children)) {
        rfi_free(children);
        rfi_rule_destroy(r);
        free_rules(rules, n);
        rfi_error(RF_E_NOMEM, "rf_chain_rules: out of memory");
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        children[i] = rules[i];
        children[i]->owned = true;
    }
    r->children = children;
    r->n_children = n;
    return r;
}

const char *rf_rule_name(const rf_rule *r)
{
    return r && r->kind < RFI_RULE_KIND_COUNT ? rule_names[r->kind] : "(null)";
}

void rfi_rule_destroy(rf_rule *r)
{
    if (!r)
        return;
    for (int i = 0; i < r->n_children; i++)
        rfi_rule_destroy(r->children[i]);
    rfi_free(r->children);
    rfi_free(r);
}

void rf_rule_free(rf_rule *r)
{
    if (r && r->owned) {
        rfi_error(RF_E_INVALID, "rf_rule_free: the rule (%s) belongs to a chain or an "
                  "optimiser, which frees it", rf_rule_name(r));
        return;
    }
    rfi_rule_destroy(r);
}

/* ---- Structure ------------------------------------------------------------------------------- */

uint64_t rfi_rule_hash(const rf_rule *r)
{
    uint64_t h = RFI_HASH_INIT;
    if (!r)
        return h;
    h = rfi_hash_u64(h, (uint64_t)r->kind);
    h = rfi_hash_u64(h, (uint64_t)r->flag);
    for (int i = 0; i < r->n_hp; i++) /* structural hyperparameters only */
        if (!hp_names[r->kind][i])
            h = rfi_hash_bytes(h, &r->hp[i], sizeof r->hp[i]);
    h = rfi_hash_u64(h, (uint64_t)r->n_children);
    for (int i = 0; i < r->n_children; i++)
        h = rfi_hash_u64(h, rfi_rule_hash(r->children[i]));
    return h;
}

static void collect_leaves(rf_rule *r, rf_rule **out, int cap, int *n)
{
    if (r->kind == RFI_RULE_CHAIN) {
        for (int i = 0; i < r->n_children; i++)
            collect_leaves(r->children[i], out, cap, n);
        return;
    }
    if (*n < cap)
        out[*n] = r;
    (*n)++;
}

int rfi_rule_leaves(rf_rule *r, rf_rule **out, int cap)
{
    int n = 0;
    collect_leaves(r, out, cap, &n);
    return n;
}
