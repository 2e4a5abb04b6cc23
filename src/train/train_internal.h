/* train_internal.h: what the files of train/ share: the trace-owned aux and
 * gradient records, and the step cache's lookup/insert interface used by
 * trainstep.c.
 *
 * Nothing here is visible to users; rf_aux and rf_grads stay opaque.
 */
#ifndef RF_TRAIN_INTERNAL_H
#define RF_TRAIN_INTERNAL_H

#include "../optim/optim.h"

/* Named scalars of one loss evaluation (trace arena). */
struct rf_aux {
    rf_trace *t;
    int n;
    char names[RF_MAX_AUX][32];
    rf_tensor *values[RF_MAX_AUX]; /* already wrapped in rf_stop_gradient */
};

/* Gradients of one rf_withgradient call (trace arena), in rf_model_visit order. */
struct rf_grads {
    int n;
    rf_tensor **g;
};

/* A new empty aux record in t's arena (NULL with a trace error on OOM). */
RFI_FUNC rf_aux *rfi_aux_new(rf_trace *t);

/* ---- The step cache (step_cache.c) ---------------------------------------------------- */

/* What identifies a compiled step; `batch` points at the caller's arrays
 * during a lookup (only their dtypes and shapes count). */
typedef struct rfi_step_probe {
    uint64_t model_hash;   /* rfi_model_structure_hash: includes train flags */
    bool training;         /* the root's flag, only to explain a miss */
    uint64_t rule_hash;
    uint64_t opt_uid;
    const char *rule_name; /* only to explain a miss */
    rf_loss_fn loss;
    void *ctx;
    bool with_grads;
    bool grad_norm;        /* the gradients' norm is an output (rf_opt_track_grad_norm) */
    rf_device *device;
    int n_batch;
    rf_array *const *batch;
} rfi_step_probe;

/* What a compiled step returns besides the loss. */
typedef struct rfi_step_outputs {
    int n_aux; /* the loss's aux values, then the gradient norm if it is tracked */
    char aux_names[RF_MAX_AUX][32];
    int n_grads; /* gradient outputs (0 unless with_grads) */
    bool grad_norm; /* the last aux value is the gradients' norm */
} rfi_step_outputs;

/* A cached step: owned by the cache; valid until the cache changes. */
typedef struct rfi_step_entry rfi_step_entry;
RFI_FUNC rf_exec *rfi_step_entry_exec(const rfi_step_entry *e);
RFI_FUNC const rfi_step_outputs *rfi_step_entry_outputs(const rfi_step_entry *e);

/* The entry of m's cache matching p, or NULL; counts a hit or a miss. */
RFI_FUNC rfi_step_entry *rfi_step_cache_find(rf_model *m, const rfi_step_probe *p);
/* Adds a freshly compiled step (takes ownership of exec, also on failure) and
 * counts a compile; warns on stderr past 8 entries. NULL on OOM (message set). */
RFI_FUNC rfi_step_entry *rfi_step_cache_insert(rf_model *m, const rfi_step_probe *p,
                                               rf_exec *exec, const rfi_step_outputs *outs);

#endif
