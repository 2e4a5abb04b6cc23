/* reflux/optim.h: optimisers with Optimisers.jl's semantics, defaults and formulas.
 *
 * A rule (rf_rule) describes an update: Adam with its hyperparameters, a
 * chain of rules. rf_setup(rule, model) creates the optimiser state for a
 * model that already lives on its device: moments and step counters as device
 * arrays, and the hyperparameters themselves as device scalars, so
 * rf_adjust() changes the next step without recompiling anything.
 *
 * The update of all parameters is emitted as a "foreach" program: gradients
 * of all parameters (of one dtype) are flattened into one vector and the
 * rule runs once over it, so a deep model costs no more rule IR than a
 * shallow one. Its state arrays are flat, one per role.
 *
 * Ownership: rule constructors return owned rules (rf_rule_free). rf_setup
 * and rf_chain_rules(_n) take ownership of the rules given to them (also on
 * failure). A rule belongs to one place: one that already belongs to a chain
 * or an optimiser, or appears twice in one chain, is refused (RF_E_INVALID;
 * it stays with its owner), and rf_rule_free of such a rule does nothing but
 * say so. rf_opt is owned (rf_opt_free) and holds references to its arrays.
 */
#ifndef REFLUX_OPTIM_H
#define REFLUX_OPTIM_H

#include "nn.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rf_rule rf_rule;
typedef struct rf_opt rf_opt;

/* Optimisers.jl defaults in comments (Lion: the paper's). Hyperparameters
 * must be finite (ClipGrad's delta and ClipNorm's omega may be infinite),
 * within the f32 range otherwise, and >= 0 (ClipNorm's p is the norm's
 * order: any value); the betas of rules that correct their
 * moments' bias by 1 - beta^t (Adam, AdamW, RAdam, AdaMax's beta1, OAdam,
 * NAdam, AdaBelief) below 1. f64 parameters see them at f64 precision, f32
 * ones rounded to f32. A bad value returns NULL with the error set. */
RF_API rf_rule *rf_descent(double lr);                                   /* 0.1 */
RF_API rf_rule *rf_momentum(double lr, double rho);                      /* 0.01, 0.9 */
RF_API rf_rule *rf_nesterov(double lr, double rho);                      /* 0.001, 0.9 */
/* Centred: the mean square minus the squared mean, clamped at 0 (it is >= 0
 * exactly; the clamp removes a rounding's negative sign, not a value). */
RF_API rf_rule *rf_rmsprop(double lr, double rho, double eps, bool centred); /* 0.001, 0.9, 1e-8 */
RF_API rf_rule *rf_adam(double lr);                                      /* 0.001 */
RF_API rf_rule *rf_adam_ex(double lr, double beta1, double beta2, double eps); /* .9 .999 1e-8 */
/* AdamW as Optimisers.jl: Adam then decoupled decay lambda*lr*x (couple = true). */
RF_API rf_rule *rf_adamw(double lr, double beta1, double beta2, double lambda, double eps);
RF_API rf_rule *rf_radam(double lr, double beta1, double beta2, double eps);
RF_API rf_rule *rf_adamax(double lr, double beta1, double beta2, double eps);
RF_API rf_rule *rf_oadam(double lr, double beta1, double beta2, double eps); /* .001 .5 .9 1e-8 */
RF_API rf_rule *rf_adagrad(double lr, double eps);                       /* 0.1, 1e-8 */
RF_API rf_rule *rf_adadelta(double rho, double eps);                     /* 0.9, 1e-8 */
RF_API rf_rule *rf_amsgrad(double lr, double beta1, double beta2, double eps);
RF_API rf_rule *rf_nadam(double lr, double beta1, double beta2, double eps);
RF_API rf_rule *rf_adabelief(double lr, double beta1, double beta2, double eps); /* eps 1e-16 */
/* Lion as published (Chen et al. 2023): m = beta2 m + (1 - beta2) dx, with
 * the paper's defaults; Optimisers.jl 0.4 swaps m and dx in that average and
 * defaults to (0.9, 0.999). */
RF_API rf_rule *rf_lion(double lr, double beta1, double beta2);          /* 0.001, 0.9, 0.99 */
RF_API rf_rule *rf_weightdecay(double lambda);                           /* 5e-4 */
RF_API rf_rule *rf_signdecay(double lambda);                             /* 1e-3 */
RF_API rf_rule *rf_clipgrad(double delta);                               /* 10 */
/* ClipNorm scales each parameter array's gradient whose p-norm exceeds omega
 * down to omega (Optimisers.jl: per array); rf_clipnorm_global scales all the
 * gradients together by min(omega / their joint p-norm, 1) (PyTorch's
 * clip_grad_norm_ without its 1e-6, optax's clip_by_global_norm). A model
 * whose parameters mix dtypes gets one joint norm per dtype. */
RF_API rf_rule *rf_clipnorm(double omega, double p);                     /* 10, 2 */
RF_API rf_rule *rf_clipnorm_global(double omega, double p);              /* 10, 2 */
/* OptimiserChain(rules...): takes ownership of rules[0..n) (also on
 * failure). A NULL entry (a rule constructor that failed) is an error,
 * RF_E_INVALID "rf_chain_rules: rule 1 is NULL (a rule constructor failed;
 * the last error before this call: ...)", and frees the others. In C,
 * rf_chain_rules(a, b, ...) is a macro over rf_chain_rules_n with a
 * compound-literal array (see rf_chain in nn.h); C++ code calls
 * rf_chain_rules_n. */
RF_API rf_rule *rf_chain_rules_n(rf_rule *const *rules, int n);
#ifndef __cplusplus
#define rf_chain_rules(...) \
    rf_chain_rules_n((rf_rule *[]){__VA_ARGS__}, RF_LIST_COUNT_(rf_rule *, __VA_ARGS__))
#endif
/* AccumGrad(n): accumulates gradients and passes their mean on every n-th
 * step; on the other steps the rules after it are skipped (their state
 * keeps its value) and the parameters stay, as Optimisers.jl's chain does
 * after a `nothing`. Put it first in a chain. */
RF_API rf_rule *rf_accumgrad(int n);
RF_API const char *rf_rule_name(const rf_rule *r);
RF_API void rf_rule_free(rf_rule *r);

/* Optimiser state for `model` (which must live on a compute device). Takes
 * ownership of `rule`. NULL on failure (RF_E_DEVICE for a host model). */
RF_API rf_opt *rf_setup(rf_rule *rule, rf_model *model);
/* Sets the learning rate of every rule in the chain that has one; the next
 * step uses it, with no recompilation. */
RF_API rf_status rf_adjust(rf_opt *opt, double lr);
/* Reads the current learning rate (of the first rule that has one). */
RF_API double rf_opt_lr(const rf_opt *opt);
/* Number of steps so far: every rf_update that ran (a trainstep whose loss
 * or tracked gradient norm was not finite is not counted), AccumGrad's
 * accumulating steps included, so with rf_accumgrad(n) first in the chain
 * rf_opt_steps(opt) / n updates changed the parameters. A schedule of the
 * parameter updates counts those. */
RF_API int64_t rf_opt_steps(const rf_opt *opt);
/* Freezes the trainable parameters at `path` (Optimisers.jl's freeze!; PyTorch's
 * requires_grad_(False) for training): steps leave them and their optimiser state
 * exactly as they are, and compute no gradient only they need (rf_trainstep_withgradient
 * still returns, so computes, every gradient). `path` is rf_model_visit's:
 * "0.weight" is one array, "1" every array of layer 1 (not of layer 10), "" all of them.
 * rf_opt_thaw trains them again, with the state they had (Optimisers.jl's thaw!). The
 * scalar state of a rule, such as Adam's bias-correction powers beta^t, is the
 * optimiser's, not an array's: a thawed array goes on from the optimiser's count, where
 * Optimisers.jl's and PyTorch's would go on from its own. A step traced before a change
 * is not run after it: rf_trainstep and rf_jitted compile again (once for each frozen
 * set), rf_exec_run refuses (RF_E_INVALID). Checkpoints do not hold which are frozen.
 * RF_E_INVALID when nothing is at `path`. */
RF_API rf_status rf_opt_freeze(rf_opt *opt, const char *path);
RF_API rf_status rf_opt_thaw(rf_opt *opt, const char *path);
/* How many parameter arrays are frozen now. */
RF_API int rf_opt_n_frozen(const rf_opt *opt);
/* Makes every rf_trainstep (and rf_train) step of opt also report the global
 * L2 norm of the gradients it receives, sqrt of the sum of their squared
 * elements over every trained parameter (frozen ones have none): the norm
 * PyTorch's clip_grad_norm_ returns, before any rule of the chain (ClipNorm,
 * AccumGrad) sees the gradients. It is computed inside the fused step, in f64
 * (an f32 gradient near 1e20 has a finite norm), and
 * returned in the step's rf_stats under the name RF_STATS_GRAD_NORM
 * ("grad_norm"), after the loss's own aux values: a loss then records at most
 * RF_MAX_AUX - 1 of them, none named "grad_norm" (else the step's trace error,
 * RF_E_INVALID). A step whose norm is not finite (a NaN or Inf gradient,
 * the loss finite) applies no update and returns RF_E_DOMAIN, as one with a
 * non-finite loss does; untracked, such a step is applied. Off by default,
 * when a step computes nothing for it; a change compiles the next step once
 * for each setting (both stay cached), as rf_opt_freeze does. Checkpoints do
 * not hold it. RF_E_INVALID for a NULL opt. */
#define RF_STATS_GRAD_NORM "grad_norm"
RF_API rf_status rf_opt_track_grad_norm(rf_opt *opt, bool on);
/* Whether opt's steps report the gradient norm (false for NULL). */
RF_API bool rf_opt_tracks_grad_norm(const rf_opt *opt);
/* Visits every state array with a path name, for checkpoints: per leaf rule
 * (numbered depth first through chains) its hyperparameters ("0.adam.eta")
 * and its state per parameter dtype ("0.adam.m.f32"), then the step counter "t". */
RF_API void rf_opt_visit(rf_opt *opt, rf_array_visitor fn, void *ud);
RF_API const rf_rule *rf_opt_rule(const rf_opt *opt);
RF_API void rf_opt_free(rf_opt *opt);

#ifdef __cplusplus
}
#endif
#endif
