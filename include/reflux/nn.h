/* reflux/nn.h: models (trees of layers), activations, initialisers, losses.
 *
 * A model is a tree of layers. Every layer, built-in or user-written, is an
 * rf_model with a type (its forward function), its own trainable parameters,
 * its non-trainable state (BatchNorm running statistics, an RNG key), its
 * children and a small block of plain configuration bytes. The library walks
 * that structure generically to move models between devices, set up
 * optimisers, save checkpoints and key the compile cache, so a user layer only
 * writes a forward function (examples/custom_layer.c shows one).
 *
 * Layers only build IR through the public op API; they never compute, so the
 * same model runs on every backend.
 *
 * Ownership: constructors return an owned model (rf_model_free). Container
 * constructors (rf_chain, rf_skip, rf_parallel and their _n forms) take
 * ownership of the models passed to them (also on failure). Models form a
 * tree: each has at most one owner, so one layer cannot sit in two places
 * (see rf_model_add_child). rf_model_free frees the whole tree, its arrays
 * (each model holds one reference per array) and every compiled executable
 * cached for it; on a model that belongs to another it does nothing (the
 * owner frees it) and sets the error.
 */
#ifndef REFLUX_NN_H
#define REFLUX_NN_H

#include "ops.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rf_model rf_model;

/* ---- Activations ------------------------------------------------------------- */
typedef enum rf_act {
    RF_ACT_IDENTITY = 0,
    RF_ACT_RELU,
    RF_ACT_LEAKYRELU, /* slope 0.01 */
    RF_ACT_ELU,       /* alpha 1 */
    RF_ACT_GELU,
    RF_ACT_SWISH,     /* = silu */
    RF_ACT_SIGMOID,
    RF_ACT_TANH,
    RF_ACT_SOFTPLUS,
    RF_ACT_SOFTMAX,    /* over axis 1 (the losses' class axis); Dense's: its out features */
    RF_ACT_LOGSOFTMAX, /* over the same axis as softmax */
    RF_ACT_COUNT
} rf_act;
#define RF_ACT_SILU RF_ACT_SWISH
/* Applies an activation to a traced tensor. */
RF_API rf_tensor *rf_activate(rf_tensor *x, rf_act act);
RF_API const char *rf_act_name(rf_act act);

/* ---- Initialisers ------------------------------------------------------------------
 * Fill host arrays reproducibly from a seed. fan_in/fan_out follow Flux: for a
 * weight [out, in, k...], fan_in = in * prod(k), fan_out = out * prod(k). */
typedef enum rf_init {
    RF_INIT_GLOROT_UNIFORM = 0, /* Flux's default for weights */
    RF_INIT_GLOROT_NORMAL,
    RF_INIT_KAIMING_UNIFORM,
    RF_INIT_KAIMING_NORMAL,
    RF_INIT_ZEROS,
    RF_INIT_ONES,
    RF_INIT_NORMAL, /* N(0, 0.01^2), like Flux's randn32 * 0.01 */
    RF_INIT_COUNT
} rf_init;
/* A new host f32 array of the given shape initialised by `init`. Owned. */
RF_API rf_array *rf_init_array(rf_init init, const int64_t *dims, int rank, uint64_t seed);

/* ---- Models ------------------------------------------------------------------------- */

/* The type of a layer: what rf_apply calls. `forward` builds the layer's
 * output from x with ops, reading its arrays with rf_model_param() and
 * rf_model_state() (which capture them in x's trace). It may record state
 * updates (rf_assign) when rf_model_training(m) is true. */
typedef struct rf_layer_type {
    const char *name;
    rf_tensor *(*forward)(rf_model *m, rf_tensor *x);
    /* Optional: writes the configuration ("4 => 8, tanh") into buf (capacity
     * n), for printing: summaries show it as "Dense(4 => 8, tanh)". Without
     * it a layer prints as its bare name ("Flatten()"). */
    void (*describe)(const rf_model *m, char *buf, size_t n);
} rf_layer_type;

/* A new layer of `type` with a copy of `config` (plain bytes: no pointers, it
 * is copied when the model moves between devices). Add arrays and children
 * with the functions below. Owned. */
RF_API rf_model *rf_model_new(const rf_layer_type *type, const void *config, size_t config_size);
/* Adds a named trainable parameter / non-trainable state array (a UTF-8 name
 * without '.', unique in the layer, not "__metadata__"; PyTorch's names make
 * checkpoints PyTorch reads as its own). The model takes over the caller's
 * reference to `a` (also on failure). */
RF_API rf_status rf_model_add_param(rf_model *m, const char *name, rf_array *a);
RF_API rf_status rf_model_add_state(rf_model *m, const char *name, rf_array *a);
/* Adds a child; the model takes ownership of `child` (also on failure),
 * except that a child that already belongs to a model (a layer shared twice:
 * weight tying is not supported) or that is m or one of m's ancestors is
 * refused (RF_E_INVALID) and stays with its owner. */
RF_API rf_status rf_model_add_child(rf_model *m, rf_model *child);

/* Inside a forward function: the i-th parameter/state/child of m, captured in
 * the trace of x (tensors) or borrowed (child). */
RF_API rf_tensor *rf_model_param(rf_model *m, rf_trace *t, int i);
RF_API rf_tensor *rf_model_state(rf_model *m, rf_trace *t, int i);
RF_API rf_model *rf_model_child(const rf_model *m, int i);
RF_API const void *rf_model_config(const rf_model *m); /* borrowed */
RF_API int rf_model_n_params(const rf_model *m);
RF_API int rf_model_n_state(const rf_model *m);
RF_API int rf_model_n_children(const rf_model *m);
/* Borrowed arrays of this layer (not of its children). */
RF_API rf_array *rf_model_param_array(const rf_model *m, int i);
RF_API rf_array *rf_model_state_array(const rf_model *m, int i);
RF_API const char *rf_model_type_name(const rf_model *m);

/* Visits every array of the tree, depth first, in a fixed order (a layer's
 * parameters, then its state, then its children in order), with a dotted
 * path name: a layer's arrays by their names, children by their index, like
 * PyTorch's state_dict keys ("0.weight", "1.0.running_mean"). */
typedef void (*rf_array_visitor)(const char *path, rf_array *a, bool trainable, void *ud);
RF_API void rf_model_visit(rf_model *m, rf_array_visitor fn, void *ud);
/* Number of trainable scalars in the tree. */
RF_API int64_t rf_model_n_parameters(rf_model *m);
/* Writes a one-line-per-layer summary into buf (always NUL-terminated). */
RF_API void rf_model_summary(const rf_model *m, char *buf, size_t n);

/* Applies the model to a traced tensor (Flux's m(x)). */
RF_API rf_tensor *rf_apply(rf_model *m, rf_tensor *x);

/* A copy of the whole tree with every array moved to `dev` (f32 by default,
 * as rf_array_to). The copy has its own identity and compile cache. Owned. */
RF_API rf_model *rf_model_to(rf_model *m, rf_device *dev);
RF_API rf_model *rf_model_to_opts(rf_model *m, rf_device *dev, const rf_to_opts *opts);
/* Train mode (BatchNorm uses batch statistics and updates its running ones,
 * Dropout drops) or test mode, for the whole tree. Models start in test mode
 * like Flux's "auto" outside of training; rf_train/rf_trainstep do not change it. */
RF_API void rf_trainmode(rf_model *m);
RF_API void rf_testmode(rf_model *m);
/* The layer's mode. Called by a layer's forward on itself or on one of its
 * descendants, it also makes the mode part of what the trace depends on (see
 * rf_exec_run, rf_jitted_run). */
RF_API bool rf_model_training(const rf_model *m);
/* The precision of the matrix products and convolutions the layers of the
 * whole tree build (see rf_precision in reflux/trace.h), whatever the
 * trace's: rf_apply sets it around each layer's forward. Until this is called a model uses the
 * trace's (RF_PRECISION_F32 unless the caller set another). Compiled steps
 * and forwards are cached per precision; rf_model_to keeps it. */
RF_API rf_status rf_model_set_matmul_precision(rf_model *m, rf_precision p);
RF_API void rf_model_free(rf_model *m);

/* Compiles the forward pass with the model as the callee: the executable takes
 * only x (shaped like `x`), reads the parameters by reference, and so sees
 * later training updates (the seed's `forward = @compile model(x)`). It keeps
 * the train/test mode it was traced in: after rf_trainmode/rf_testmode changes
 * the mode of a layer that reads it (Dropout, BatchNorm), a run returns
 * RF_E_INVALID naming the layer; compile again for the new mode (rf_jitted
 * keeps one executable per mode). Owned. */
RF_API rf_status rf_compile_model(rf_model *m, rf_array *x, rf_exec **out);
/* Compile, run, free: *y receives the output (owned). */
RF_API rf_status rf_jit_model(rf_model *m, rf_array *x, rf_array **y);

/* ---- Layers --------------------------------------------------------------------------
 * Shapes are batch first: Dense takes [N, in]; convolutions and pooling take
 * NCHW. Defaults follow Flux (Glorot-uniform weights, zero bias).
 *
 * Initialisation is reproducible: a layer whose opts give seed 0 (or that has
 * no opts) draws its seed from the library's initialisation counter, the one
 * documented piece of process-wide state in nn (atomic; like torch.manual_seed
 * or Flux's default RNG). rf_nn_seed(s) resets it, so the same sequence of
 * constructors after the same rf_nn_seed builds the same weights. The layers
 * listed in rf_chain(...) and rf_parallel(...) are built in the order written
 * (gcc and clang evaluate a compound literal's entries in order), but layers
 * passed as the arguments of a function call are built in an order C leaves
 * to the compiler (gcc: the last first; clang: the first first), so their
 * weights differ between compilers: there, build each layer in a statement of
 * its own, or give it a seed. */
RF_API void rf_nn_seed(uint64_t seed);

typedef struct rf_dense_opts {
    bool no_bias;
    rf_init init; /* default RF_INIT_GLOROT_UNIFORM */
    uint64_t seed;
} rf_dense_opts;
/* Dense(in => out, act): y = act(x W^T + b), W [out, in], b [out]. x is [N, in]
 * or [..., in] (the leading axes kept, as PyTorch's Linear); the act applies to
 * the result as [rows, out], so a softmax normalises over the out features (the
 * last axis), where rf_activation_layer and rf_activate normalise over axis 1. */
RF_API rf_model *rf_dense(int64_t in, int64_t out, rf_act act);
RF_API rf_model *rf_dense_ex(int64_t in, int64_t out, rf_act act, const rf_dense_opts *o);

typedef struct rf_conv_opts {
    int64_t stride[2];   /* 0: 1 */
    int64_t pad[2];      /* symmetric padding per spatial dim */
    bool pad_same;       /* Flux's SamePad(): output size ceil(in / stride) for Conv,
                            in * stride for ConvTranspose (dilation 1) */
    int64_t dilation[2]; /* 0: 1 */
    int64_t groups;      /* 0: 1 */
    bool no_bias;
    rf_init init;
    uint64_t seed;
} rf_conv_opts;
/* Conv((k,k), in => out, act) on NCHW: weight [out, in/groups, kh, kw], bias [out]. */
RF_API rf_model *rf_conv2d(int64_t kh, int64_t kw, int64_t in, int64_t out, rf_act act,
                           const rf_conv_opts *o);
/* ConvTranspose((k,k), in => out, act): weight [in, out/groups, kh, kw] (as
 * PyTorch stores it), output size (in-1)*stride - 2*pad + dilation*(k-1) + 1. */
RF_API rf_model *rf_conv_transpose2d(int64_t kh, int64_t kw, int64_t in, int64_t out,
                                     rf_act act, const rf_conv_opts *o);
/* MaxPool((k,k)) / MeanPool((k,k)): stride defaults to k (stride 0), no padding. */
RF_API rf_model *rf_maxpool(int64_t kh, int64_t kw, int64_t stride, int64_t pad);
RF_API rf_model *rf_meanpool(int64_t kh, int64_t kw, int64_t stride, int64_t pad);
RF_API rf_model *rf_global_meanpool(void); /* NCHW -> NC11 */
/* AdaptiveMeanPool((oh, ow)): the input's spatial size must be a multiple of
 * (oh, ow) (equal windows; other sizes are refused with RF_E_UNSUPPORTED). */
RF_API rf_model *rf_adaptive_meanpool(int64_t oh, int64_t ow);
RF_API rf_model *rf_flatten_layer(void);
/* An activation as a layer (Flux's `x -> relu.(x)` inside a Chain). */
RF_API rf_model *rf_activation_layer(rf_act act);
/* BatchNorm(channels, act): per-channel (axis 1) normalisation; in train
 * mode uses batch statistics and updates running mean/var with momentum 0.1
 * (Flux's default), in test mode uses the running ones. eps 1e-5. */
RF_API rf_model *rf_batchnorm(int64_t channels, rf_act act);
/* LayerNorm(features): normalises over the last axis, with affine scale/bias. eps 1e-5. */
RF_API rf_model *rf_layernorm(int64_t features);
/* GroupNorm(channels, groups), affine, eps 1e-5. */
RF_API rf_model *rf_groupnorm(int64_t channels, int64_t groups);
/* Dropout(p): in train mode zeroes each element with probability p and
 * scales the rest by 1/(1-p); the mask comes from the model's RNG key, which
 * advances every step. Identity in test mode. */
RF_API rf_model *rf_dropout(double p, uint64_t seed);
/* Embedding(vocab => dim): integer ids (i32, i64 or u8) [...] -> [..., dim];
 * weight [vocab, dim] ~ N(0,1).
 * Ids count from 0; one outside [0, vocab) is clamped into it (a compiled step
 * cannot stop on data), where Flux throws. */
RF_API rf_model *rf_embedding(int64_t vocab, int64_t dim, uint64_t seed);

/* Containers. They take ownership of their children, also on failure.
 *
 * In C, rf_chain(a, b, c) and rf_parallel(combine, a, b) are macros over the
 * counted forms rf_chain_n / rf_parallel_n: the arguments become a compound
 * literal array and its length is taken with sizeof (which does not evaluate
 * them again). There is no NULL terminator, so a layer constructor that
 * fails inside the list cannot silently shorten it: a NULL entry is an error
 * (RF_E_INVALID "rf_chain: layer 1 is NULL (a layer constructor failed; the
 * last error before this call: ...)", layers counted from 0 like path names,
 * quoting the last error, the failed constructor's when only one failed),
 * and every non-NULL entry is freed (but one that belongs to another model,
 * see rf_model_add_child). An empty chain is rf_chain_n(NULL, 0)
 * (the identity). C++ has no compound literals: C++ code calls the _n forms
 * with an array. */
RF_API rf_model *rf_chain_n(rf_model *const *layers, int n);
typedef enum rf_combine {
    RF_COMBINE_ADD = 0,
    RF_COMBINE_MUL,
    RF_COMBINE_CONCAT_CHANNELS
} rf_combine;
/* SkipConnection(layer, combine): combine(layer(x), x). */
RF_API rf_model *rf_skip(rf_model *layer, rf_combine combine);
/* Parallel(combine, layers...): combine(layer_1(x), ..., layer_n(x)); 1 to 64 layers. */
RF_API rf_model *rf_parallel_n(rf_combine combine, rf_model *const *layers, int n);
#ifndef __cplusplus
/* Number of entries of a pointer list written as macro arguments (not evaluated). */
#define RF_LIST_COUNT_(type, ...) ((int)(sizeof((type[]){__VA_ARGS__}) / sizeof(type)))
/* Chain(layers...), e.g. rf_chain(rf_dense(4, 8, RF_ACT_TANH), rf_dense(8, 2, RF_ACT_IDENTITY)). */
#define rf_chain(...) \
    rf_chain_n((rf_model *[]){__VA_ARGS__}, RF_LIST_COUNT_(rf_model *, __VA_ARGS__))
/* Parallel(combine, layers...). */
#define rf_parallel(combine, ...)                                      \
    rf_parallel_n((combine), (rf_model *[]){__VA_ARGS__},              \
                  RF_LIST_COUNT_(rf_model *, __VA_ARGS__))
#endif

/* ---- Losses (Flux's formulas; mean over all elements unless stated) --------------------
 * yhat and y have equal shapes unless stated; class axis is 1 ([N, C]). */
RF_API rf_tensor *rf_mse(rf_tensor *yhat, rf_tensor *y);
RF_API rf_tensor *rf_mae(rf_tensor *yhat, rf_tensor *y);
RF_API rf_tensor *rf_msle(rf_tensor *yhat, rf_tensor *y);           /* eps = 1.19e-7 (f32) */
RF_API rf_tensor *rf_huber(rf_tensor *yhat, rf_tensor *y, double delta); /* Flux default 1 */
/* Cross-entropies (and rf_focal): y is one-hot [N, C] (yhat's dtype) or class
 * ids [N] (i32, i64 or u8). Sum over classes, mean over the batch. A class id
 * outside [0, C) makes the loss NaN (PyTorch raises), so a training step on
 * such a batch applies no update and returns RF_E_DOMAIN. */
RF_API rf_tensor *rf_crossentropy(rf_tensor *yhat, rf_tensor *y);   /* yhat probabilities */
RF_API rf_tensor *rf_logitcrossentropy(rf_tensor *logits, rf_tensor *y);
/* Binary cross-entropies: y of yhat's shape (targets in [0, 1]); mean over all elements. */
RF_API rf_tensor *rf_binarycrossentropy(rf_tensor *yhat, rf_tensor *y);
RF_API rf_tensor *rf_logitbinarycrossentropy(rf_tensor *logits, rf_tensor *y);
/* y and yhat probabilities of one shape [N, C]: sum over classes, mean over the batch. */
RF_API rf_tensor *rf_kldivergence(rf_tensor *yhat, rf_tensor *y);
/* Flux's focal_loss (its default gamma is 2). */
RF_API rf_tensor *rf_focal(rf_tensor *yhat, rf_tensor *y, double gamma);
/* Index of the max along the class axis (Flux's onecold): [N, C] -> [N] i64. */
RF_API rf_tensor *rf_onecold(rf_tensor *scores);
/* Fraction of rows whose onecold matches y (one-hot [N, C] or ids [N]): f32 scalar. */
RF_API rf_tensor *rf_accuracy(rf_tensor *scores, rf_tensor *y);

#ifdef __cplusplus
}
#endif
#endif
