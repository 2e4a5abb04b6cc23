/* optim.h: the internal layout of rules and optimiser state, shared by
 * optim/ and train/ (the trainstep cache keys on it).
 */
#ifndef RF_OPTIM_INTERNAL_H
#define RF_OPTIM_INTERNAL_H

#include "../nn/model.h"

typedef enum rfi_rule_kind {
    RFI_RULE_DESCENT, RFI_RULE_MOMENTUM, RFI_RULE_NESTEROV, RFI_RULE_RMSPROP, RFI_RULE_ADAM,
    RFI_RULE_ADAMW, RFI_RULE_RADAM, RFI_RULE_ADAMAX, RFI_RULE_OADAM, RFI_RULE_ADAGRAD,
    RFI_RULE_ADADELTA, RFI_RULE_AMSGRAD, RFI_RULE_NADAM, RFI_RULE_ADABELIEF, RFI_RULE_LION,
    RFI_RULE_WEIGHTDECAY, RFI_RULE_SIGNDECAY, RFI_RULE_CLIPGRAD, RFI_RULE_CLIPNORM,
    RFI_RULE_CHAIN, RFI_RULE_ACCUMGRAD, RFI_RULE_CLIPNORM_GLOBAL, RFI_RULE_KIND_COUNT
} rfi_rule_kind;

#define RFI_RULE_MAX_HP 6
struct rf_rule {
    rfi_rule_kind kind;
    double hp[RFI_RULE_MAX_HP];   /* hyperparameters in the constructor's order */
    int n_hp;
    bool flag;                    /* RMSProp centred */
    rf_rule **children;           /* chain members (owned) */
    int n_children;
    bool owned;                   /* taken by a chain or an optimiser, which frees it */
};

/* Frees r and its members whoever owns them: for the owners (a chain, rf_opt_free). */
RFI_FUNC void rfi_rule_destroy(rf_rule *r);

/* Structural hash of a rule: kinds and flags, not hyperparameter values
 * (those are runtime state), so rf_adjust never changes it. */
RFI_FUNC uint64_t rfi_rule_hash(const rf_rule *r);

/* Records (rf_assign) the update of every trainable parameter of m, given
 * its gradient in rf_model_visit order, and of opt's state, in trace t.
 * Guarding the whole step on a finite loss is the trainstep's job: it
 * rewrites every recorded update afterwards. */
RFI_FUNC rf_status rfi_opt_emit_update(rf_trace *t, rf_opt *opt, rf_model *m,
                                       rf_tensor *const *grads, int n_grads);
RFI_FUNC uint64_t rfi_opt_uid(const rf_opt *opt);
/* For the message of a step given an optimiser set up for another model:
 * writes into buf (capacity n, always NUL-terminated) how m relates to the
 * optimiser's model when one contains the other ("; it was set up for layer
 * \"2\" of this model, ..."), else "". */
RFI_FUNC void rfi_opt_relation(const rf_opt *opt, const rf_model *m, char *buf, size_t n);
/* rf_opt_visit with every path "" (none is formatted): for per-step checks. */
RFI_FUNC void rfi_opt_each_array(rf_opt *opt, rf_array_visitor fn, void *ud);
/* Called by rf_model_free: the optimiser forgets its model. */
RFI_FUNC void rfi_opt_model_gone(rf_opt *opt);

/* ---- Rule tables (rules.c) ------------------------------------------------------------------
 * A state role is one array of optimiser state per parameter dtype: flat (one
 * element per parameter element, like Adam's m) or a scalar (like Adam's
 * beta1^t), in the group's float dtype or an i32 counter. */
typedef struct rfi_state_role {
    const char *name; /* "m", "beta1t": the last part of its rf_opt_visit path */
    bool flat;        /* one element per parameter element; else a scalar */
    bool counter;     /* an i32 counter; else the group's float dtype */
    int init_hp;      /* >= 0: starts at the rule's hp[init_hp]; -1: at `init` */
    double init;
} rfi_state_role;
#define RFI_OPT_MAX_ROLES 5
/* The roles of a leaf rule (not a chain); returns their count (0..RFI_OPT_MAX_ROLES). */
RFI_FUNC int rfi_rule_state_roles(const rf_rule *r, const rfi_state_role **roles);
/* The name of hyperparameter i ("eta", "beta1"), or NULL for a structural one
 * (ClipNorm's p, AccumGrad's n: part of the hash, no runtime array). */
RFI_FUNC const char *rfi_rule_hp_name(const rf_rule *r, int i);
/* Whether hp[0] is a learning rate (what rf_adjust sets). */
RFI_FUNC bool rfi_rule_has_lr(const rf_rule *r);
/* The leaf rules of a (possibly nested) chain in order, depth first; writes
 * at most cap of them and returns how many there are. */
RFI_FUNC int rfi_rule_leaves(rf_rule *r, rf_rule **out, int cap);

/* ---- Optimiser state (setup.c) ----------------------------------------------------------------
 * Parameters are grouped by dtype; each group's update is one flat program
 * over the concatenation of its members (update.c). */
typedef struct rfi_opt_leaf {
    rf_rule *rule;                 /* borrowed from the opt's rule tree */
    rf_array *hp[RFI_RULE_MAX_HP]; /* device scalars, f32 or f64 (setup.c's hp_dtype);
                                      NULL for structural ones */
} rfi_opt_leaf;

typedef struct rfi_opt_group {
    rf_dtype dtype;
    int n_members;
    int *members;     /* indices into the parameter list (visit order) */
    int64_t numel;    /* sum of the members' element counts */
    rf_array **state; /* [leaf * RFI_OPT_MAX_ROLES + role]; NULL where unused */
} rfi_opt_group;

struct rf_opt {
    rf_rule *rule;      /* owned */
    rf_model *model;    /* borrowed; NULL once the model is freed */
    uint64_t uid;
    rf_device *device;
    int n_params;       /* what rf_setup saw, to detect a model that changed since */
    rf_dtype *param_dtype;
    int64_t *param_numel;
    rfi_opt_leaf *leaves;
    int n_leaves;
    rfi_opt_group groups[RF_DTYPE_COUNT];
    int n_groups;
    rf_array *steps;    /* i64 scalar: updates applied */
    /* Per parameter, whether it is frozen (rf_opt_freeze): the update a trace emits
     * depends on it, so every trace watches each flag (core.h) and a program traced
     * with other values is not run. */
    rfi_flag **frozen;
    bool grad_norm;     /* rf_opt_track_grad_norm: steps return the gradients' norm */
};

#endif
