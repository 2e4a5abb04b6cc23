/* model.h: the internal layout of rf_model, shared by nn/, optim/, train/
 * and data/ (checkpoints). Users see rf_model as opaque.
 */
#ifndef RF_NN_MODEL_H
#define RF_NN_MODEL_H

#include "../runtime/runtime.h"
#include "reflux/train.h"

#include <stdatomic.h>

typedef struct rfi_step_cache rfi_step_cache; /* train/step_cache.c */

typedef struct rfi_named_array {
    char *name;    /* rfi_malloc */
    rf_array *a;   /* one reference held */
} rfi_named_array;

struct rf_model {
    const rf_layer_type *type;
    void *config;             /* rfi_malloc'd copy of plain bytes */
    size_t config_size;

    rfi_named_array *params;  /* trainable */
    int n_params, cap_params;
    rfi_named_array *state;   /* non-trainable (running stats, RNG keys) */
    int n_state, cap_state;
    rf_model **children;      /* owned */
    int n_children, cap_children;
    rf_model *parent;         /* the model that owns this one, NULL for a root */

    rfi_flag *mode;           /* train (true) or test mode, shared with the executables
                                 traced while a layer read it (rf_model_training) */
    rf_trace *applying;       /* the trace rf_apply is running this layer's forward in */
    bool sets_precision;      /* rf_apply builds the layer's products with: */
    rf_precision matmul_precision; /* (else with the trace's) */
    uint64_t uid;             /* unique per model object (never reused in a process) */
    rfi_step_cache *cache;    /* compiled training steps of this model (of the
                                 root, or of a layer stepped on its own); freed
                                 with the model */
    struct rf_opt **opts;     /* optimisers set up on this model (borrowed), so
                                 either side can be freed first */
    int n_opts, cap_opts;
    atomic_bool in_step;      /* root only: a training step of a model of this tree
                                 is running (trainstep.c) */
};

/* Implemented by train/step_cache.c: frees every cached executable (NULL ok),
 * and drops the entries compiled for one optimiser (called by rf_opt_free). */
RFI_FUNC void rfi_step_cache_free(rfi_step_cache *c);
RFI_FUNC void rfi_step_cache_drop_opt(rf_model *m, uint64_t opt_uid);

/* A fresh unique id for models, optimisers and other cache-key parts. */
RFI_FUNC uint64_t rfi_next_uid(void);
/* Visits the trainable parameters of the tree in rf_model_visit order. */
/* *out: an rfi_malloc'd array; returns its length, or -1 on out of memory. */
RFI_FUNC int rfi_model_collect_params(rf_model *m, rf_array ***out);
/* rf_model_visit with every path "" (none is formatted): for per-step checks. */
RFI_FUNC void rfi_model_each_array(rf_model *m, rf_array_visitor fn, void *ud);
/* Structural hash of the tree: layer types, config bytes, array names,
 * dtypes and shapes, training flags, matmul precisions. */
RFI_FUNC uint64_t rfi_model_structure_hash(const rf_model *m);
/* Registers / unregisters an optimiser on a model (see `opts`). */
RFI_FUNC rf_status rfi_model_attach_opt(rf_model *m, struct rf_opt *opt);
RFI_FUNC void rfi_model_detach_opt(rf_model *m, struct rf_opt *opt);
/* Whether opt was set up for m (rf_setup(rule, m)). */
RFI_FUNC bool rfi_model_has_opt(const rf_model *m, const struct rf_opt *opt);

/* The seed a layer constructor initialises with (nn/init.c): `seed` itself
 * when non-zero, else the next value of the process-wide initialisation
 * counter mixed with the seed set by rf_nn_seed (atomic). */
RFI_FUNC uint64_t rfi_nn_next_seed(uint64_t seed);
/* One line naming a layer and its configuration, children included
 * ("Chain(Dense(4 => 8, tanh), Dense(8 => 2))"), for error messages. Always
 * NUL-terminated. */
RFI_FUNC void rfi_model_describe(const rf_model *m, char *buf, size_t n);
/* Whether x has the dtype of m's parameters (true for a layer without any);
 * else records a trace error naming the layer and both dtypes. */
RFI_FUNC bool rfi_layer_check_dtype(rf_model *m, rf_tensor *x);
/* For a layer's forward: records "<Layer(config)>: input <type> <why>" on x's
 * trace (printf-style why) and returns NULL. */
RFI_FUNC rf_tensor *rfi_layer_input_error(rf_model *m, rf_tensor *x, rf_status st,
                                          const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#endif
