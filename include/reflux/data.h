/* reflux/data.h: data loaders, dataset readers and checkpoints.
 *
 * Ownership: rf_loader is owned (rf_loader_free) and holds references to the
 * arrays it was built from. Batches returned by rf_loader_next are borrowed:
 * valid until the next call (a device-wrapped loader frees the previous
 * batch then). Readers return owned arrays.
 */
#ifndef REFLUX_DATA_H
#define REFLUX_DATA_H

#include "train.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rf_loader_opts {
    int64_t batchsize; /* default 1 (opts NULL); must be >= 1 */
    bool shuffle;      /* reshuffle every epoch (rf_loader_reset) */
    uint64_t seed;     /* shuffling seed */
    bool drop_last;    /* false (default): a smaller last batch; true: drop it */
} rf_loader_opts;

/* A loader over n host arrays that share their first dimension (the
 * observations), e.g. {X [60000,1,28,28], Y [60000]}. opts may be NULL. Owned. */
RF_API rf_loader *rf_loader_new(rf_array *const *arrays, int n, const rf_loader_opts *opts);
/* Wraps the loader with a device: each batch is moved to `dev` lazily, the
 * previous one is released, and the next one is prepared on a background
 * thread while the current step runs. */
RF_API rf_status rf_loader_to(rf_loader *l, rf_device *dev);
RF_API int64_t rf_loader_n_batches(const rf_loader *l);
RF_API int64_t rf_loader_n_obs(const rf_loader *l);
RF_API int rf_loader_n_arrays(const rf_loader *l);
/* Starts a new epoch (reshuffling when asked), also in the middle of one. The
 * epoch at creation is 0 and each reset adds 1; epoch e's order depends only
 * on (seed, e), so it is the same on every run and platform. */
RF_API rf_status rf_loader_reset(rf_loader *l);
/* The next batch: *batch points at rf_loader_n_arrays() borrowed arrays, or
 * NULL at the end of the epoch (status RF_OK; it stays NULL until
 * rf_loader_reset starts the next epoch). The arrays stay valid until the
 * next rf_loader_next, rf_loader_reset, rf_loader_seek or rf_loader_free. */
RF_API rf_status rf_loader_next(rf_loader *l, rf_array *const **batch);
/* Where the loader is, for a checkpoint: its epoch (0 at creation, +1 per
 * reset) and how many of that epoch's batches rf_loader_next has handed out.
 * Either pointer may be NULL. */
RF_API void rf_loader_position(const rf_loader *l, uint64_t *epoch, int64_t *batches);
/* Puts a loader built with the same arrays and options where
 * rf_loader_position said one was, so a resumed run sees the batches an
 * uninterrupted one would: the next rf_loader_next gives batch `batches` of
 * epoch `epoch` (batches from 0 to rf_loader_n_batches). rf_train resets before
 * each pass, so a run resumed after E whole rf_train epochs seeks to
 * (E, rf_loader_n_batches(l)). RF_E_INVALID for a batch index out of range. */
RF_API rf_status rf_loader_seek(rf_loader *l, uint64_t epoch, int64_t batches);
RF_API void rf_loader_free(rf_loader *l);

/* ---- Readers ------------------------------------------------------------------------------ */
/* Reads an IDX file (raw or gzip-compressed) into a host array of its
 * element type (u8, i32, f32, f64; i8/i16 become i32). Errors: RF_E_IO,
 * RF_E_CORRUPT naming the file and what was expected. */
RF_API rf_status rf_idx_load(const char *path, rf_array **out);
/* Fashion-MNIST from `dir` (default /usr/share/datasets/fashion-mnist when
 * NULL): images [N, 1, 28, 28] f32 scaled to [0, 1] and labels [N] i32, the
 * training (60000) or test (10000) split. */
RF_API rf_status rf_fashion_mnist(const char *dir, bool train, rf_array **images,
                                  rf_array **labels);

/* ---- Checkpoints (safetensors) ----------------------------------------------------------- */
/* Saves every array of the model (parameters and state, by path name) and,
 * when opt is not NULL, of the optimiser ("opt." prefix) to `path` in the
 * safetensors format, atomically (temporary file, fsync, rename). Through a
 * symbolic link it replaces the file the link leads to; a replaced file's
 * permissions are kept; a path that is not a regular file (a directory, FIFO
 * or device) is refused (RF_E_IO). */
RF_API rf_status rf_checkpoint_save(const char *path, rf_model *m, rf_opt *opt);
/* Loads a checkpoint into an existing model (and optimiser) of the same
 * structure, in place. Nothing is changed unless the whole file is valid:
 * a truncated or corrupted file, a missing tensor or a shape mismatch gives
 * RF_E_CORRUPT / RF_E_SHAPE naming the tensor (RF_E_DTYPE for an element
 * type mismatch, RF_E_IO when the file cannot be read). With opt NULL the
 * file's "opt." tensors are ignored. So that PyTorch's files load, its
 * BatchNorm "num_batches_tracked" entries are ignored, and a Dropout layer
 * whose RNG "key" the file lacks keeps its own. */
RF_API rf_status rf_checkpoint_load(const char *path, rf_model *m, rf_opt *opt);
/* Options for loading part of a file or into part of a model (fine-tuning). */
typedef struct rf_load_opts {
    /* The model's arrays are the file's under this prefix ("0." loads a whole
     * model's file into its first layer, a trunk); the file's other model
     * tensors are passed over. NULL or "": the file's names as they are. */
    const char *prefix;
    /* PyTorch's strict=False: load the tensors whose names both have (their
     * dtypes and shapes must still match); the model's others keep their
     * values and the file's others are passed over. At least one of the
     * model's arrays must load, if it has any (RF_E_INVALID: a wrong prefix
     * or model loads nothing; the optimiser's arrays do not count). */
    bool partial;
    int *loaded; /* if set, receives the number of tensors loaded */
} rf_load_opts;
/* rf_checkpoint_load with options (NULL: the same). */
RF_API rf_status rf_checkpoint_load_opts(const char *path, rf_model *m, rf_opt *opt,
                                         const rf_load_opts *o);

#ifdef __cplusplus
}
#endif
#endif
