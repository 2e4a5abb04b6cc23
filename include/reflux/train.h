/* reflux/train.h: training: withgradient + update inside a traced step,
 * trainstep (compiled and cached per shape), train (a loop with a progress
 * bar), auxiliary loss outputs, and the compile cache's statistics.
 *
 * Ownership: rf_grads and tensors live in the trace. Arrays returned by
 * rf_trainstep_withgradient are owned by the caller. Cached executables are
 * owned by the model they were compiled for and freed with it.
 */
#ifndef REFLUX_TRAIN_H
#define REFLUX_TRAIN_H

#include "optim.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Auxiliary outputs of a loss: named scalars computed in the same forward
 * pass (e.g. accuracy), returned to the host with the loss, never
 * differentiated. */
#define RF_MAX_AUX 8
typedef struct rf_aux rf_aux;
/* Records the scalar `value` under `name` (copied; 1 to 31 characters and at
 * most RF_MAX_AUX names, else a trace error, RF_E_INVALID, not a truncation).
 * A non-scalar value is a trace error (RF_E_SHAPE). */
RF_API void rf_aux_set(rf_aux *aux, const char *name, rf_tensor *value);

/* A loss: the scalar loss of model m on one batch (batch[0..n), e.g. x and y). */
typedef rf_tensor *(*rf_loss_fn)(rf_model *m, rf_tensor *const *batch, int n, rf_aux *aux,
                                 void *ctx);

/* Host-side values of the aux outputs of one step. */
typedef struct rf_stats {
    int n;
    char names[RF_MAX_AUX][32];
    double values[RF_MAX_AUX];
} rf_stats;
/* The value named `name`, or NaN. */
RF_API double rf_stats_get(const rf_stats *s, const char *name);

/* ---- Inside a traced step (the seed's manual path) ---------------------------------- */
typedef struct rf_grads rf_grads; /* trace-owned */
/* Evaluates loss(m, batch, aux, ctx) in trace t and its gradient with respect
 * to every trainable parameter of m (Flux's withgradient). Returns the loss
 * tensor; *g receives the gradients (trace-owned). When aux is not NULL, *aux
 * receives the loss's auxiliary values (trace-owned, read with rf_aux_get). */
RF_API rf_tensor *rf_withgradient(rf_trace *t, rf_loss_fn loss, void *ctx, rf_model *m,
                                  rf_tensor *const *batch, int n, rf_aux **aux, rf_grads **g);
RF_API int rf_grads_count(const rf_grads *g);
RF_API rf_tensor *rf_grads_get(const rf_grads *g, int i); /* in rf_model_visit order */
RF_API int rf_aux_count(const rf_aux *aux);
RF_API rf_tensor *rf_aux_get(const rf_aux *aux, int i, const char **name);
/* Records the optimiser update of every parameter of m and of opt's state
 * (Optimisers.update!): applied in place when the step's run ends. */
RF_API void rf_update(rf_trace *t, rf_opt *opt, rf_model *m, const rf_grads *g);

/* ---- trainstep ------------------------------------------------------------------------
 * One step: differentiate, update m and opt in place, return the loss to the
 * host. The fused step (forward, backward, update) is compiled on the first
 * call for each (model structure, train/test mode and matmul precision,
 * optimiser instance, loss fn and ctx, the train mode of any other layer the
 * loss applies, with or without gradients, device, batch dtypes and shapes)
 * and cached on the model. The loss function
 * returns the loss and must not call rf_return (RF_E_INVALID). A non-finite
 * loss applies no update (model and optimiser state stay bit-identical) and
 * returns RF_E_DOMAIN; so does, when the optimiser tracks the gradient norm
 * (rf_opt_track_grad_norm), a non-finite norm under a finite loss (a NaN or
 * Inf gradient). A step of a model that another thread is stepping
 * returns RF_E_INVALID and changes nothing. stats may be NULL. */
RF_API rf_status rf_trainstep(rf_loss_fn loss, void *ctx, rf_model *m, rf_array *const *batch,
                              int n, rf_opt *opt, double *loss_out, rf_stats *stats);
/* As rf_trainstep, and *grads receives one new device array per trainable
 * parameter (owned: free each and then the array of pointers with free()). */
RF_API rf_status rf_trainstep_withgradient(rf_loss_fn loss, void *ctx, rf_model *m,
                                           rf_array *const *batch, int n, rf_opt *opt,
                                           double *loss_out, rf_stats *stats,
                                           rf_array ***grads, int *ngrads);

/* ---- train --------------------------------------------------------------------------- */
typedef struct rf_loader rf_loader;
/* Whether rf_train draws its progress bar. Zero, the default, is AUTO. */
typedef enum rf_progress {
    RF_PROGRESS_AUTO = 0, /* only when stderr is a terminal */
    RF_PROGRESS_OFF,
    RF_PROGRESS_ON,
} rf_progress;
/* What rf_train tells its on_step callback after each successful step
 * (borrowed: valid during the call only). */
typedef struct rf_step_info {
    int64_t batch;      /* 1-based number of the batch in this pass */
    int64_t n_batches;  /* batches in the pass (rf_loader_n_batches) */
    int64_t step;       /* rf_opt_steps(opt) after this step: the global count, which
                           goes on across passes (and from a loaded checkpoint) */
    int64_t batch_size; /* samples in this batch (its first array's first dim) */
    int64_t samples;    /* samples stepped in this pass so far, this batch's included */
    double loss;        /* this batch's loss (finite: a non-finite one stops the pass
                           before any callback) */
    double mean_loss;   /* the pass's mean loss so far, weighted as mean_loss below */
    rf_stats stats;     /* this batch's aux values (and "grad_norm" when the optimiser
                           tracks it: rf_opt_track_grad_norm) */
    double elapsed;     /* seconds since the pass began (its first step compiles) */
    rf_model *model;    /* rf_train's model and optimiser, for rf_adjust, */
    rf_opt *opt;        /* rf_opt_freeze or rf_checkpoint_save in the callback */
} rf_step_info;
/* What on_step returns: RF_TRAIN_CONTINUE (0) to go on; RF_TRAIN_STOP to end
 * the pass after this step, which is not an error; or an error status
 * (RF_E_INVALID .. RF_E_INTERNAL) to end it with that error. */
#define RF_TRAIN_CONTINUE 0
#define RF_TRAIN_STOP (-1)
/* Options of rf_train; NULL or a zeroed struct gives the defaults. */
typedef struct rf_train_opts {
    rf_progress progress;
    const char *label;   /* shown before the bar, e.g. "epoch 3" */
    double *mean_loss;   /* if set, receives the mean loss over the pass: each
                            batch weighted by its size (its first array's first
                            dim), so a batch-mean loss gives the per-sample mean */
    rf_stats *mean_stats;/* if set, receives the mean of each aux value, weighted alike,
                            over the batches that reported it (grad_norm: those stepped
                            while the optimiser tracked it, which on_step may switch) */
    /* If set, called after each successful step (the model and optimiser are
     * updated, the step's run is over), with `user`: a learning-rate schedule
     * (rf_adjust: no recompilation), logging, checkpoints every N steps,
     * early stopping. It may call rf_adjust, rf_opt_freeze / rf_opt_thaw (the
     * next step compiles once for the new frozen set), rf_checkpoint_save and
     * any other call on the model (a forward pass, an evaluation), but must not
     * free the model, the optimiser or the loader, nor move the loader
     * (rf_loader_next, _reset, _seek: refused with RF_E_INVALID after the
     * callback returns). Its return value: RF_TRAIN_CONTINUE, RF_TRAIN_STOP or
     * an error status, see above; any other value ends the pass with
     * RF_E_INVALID naming it. An error status is rf_train's, with a message
     * "rf_train: on_step returned RF_E_IO after batch 17: <message>", the
     * message that of the last failure recorded during the callback (a reflux
     * call's or rf_set_error's) unless it cleared it (rf_clear_error). */
    int (*on_step)(const rf_step_info *info, void *user);
    void *user;
    int64_t *batches_done; /* if set, receives the number of batches stepped in the
                              pass, also when it ends early or fails */
    bool *stopped;         /* if set, receives whether on_step stopped the pass */
} rf_train_opts;
/* One pass over `data` (a device-wrapped loader), a single trainstep per
 * batch, with a progress bar (batch i/n, the mean loss so far, samples/s and
 * ETA after the first batch, which compiles). Stops with
 * RF_E_DOMAIN ("loss is NaN on batch 17, stopping training") on a non-finite
 * loss (or tracked gradient norm); RF_E_DEVICE if the loader yields host
 * arrays. A pass that on_step stops returns RF_OK; its bar ends at the last
 * batch stepped, with " (stopped)" after it. Once the pass has begun (the
 * arguments are valid and the loader reset), mean_loss and mean_stats
 * receive the means over the batches stepped: the stopping one included,
 * also when the pass fails (NaN and no stats when none was). */
RF_API rf_status rf_train(rf_loss_fn loss, void *ctx, rf_model *m, rf_loader *data, rf_opt *opt,
                          const rf_train_opts *o);

/* ---- The compile cache ------------------------------------------------------------------ */
typedef struct rf_cache_stats {
    uint64_t hits, misses, compiles;
    int entries;
    size_t memory; /* the entries' rf_exec_memory summed: bytes planned for intermediates */
} rf_cache_stats;
RF_API rf_cache_stats rf_model_cache_stats(const rf_model *m);
/* Frees every cached executable of m now. */
RF_API void rf_model_cache_clear(rf_model *m);

#ifdef __cplusplus
}
#endif
#endif
