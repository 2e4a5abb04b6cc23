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
    RFI_RULE_CHAIN, RFI_RULE_ACCUMGRAD, RFI_RULE_KIND_COUNT
} rfi_rule_kind;

#define RFI_RULE_MAX_HP 6
struct rf_rule {
    rfi_rule_kind kind;
    double hp[RFI_RULE_MAX_HP];   /* hyperparameters in the constructor's order */
    int n_hp;
    bool flag;                    /* RMSProp centred */
    rf_rule **children;           /* chain members (owned) */
    int n_children;
};

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
/* Called by rf_model_free: the optimiser forgets its model. */
RFI_FUNC void rfi_opt_model_gone(rf_opt *opt);

#endif
