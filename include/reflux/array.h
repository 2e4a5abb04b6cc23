/* reflux/array.h: arrays (dense, row-major tensors living on one device).
 *
 * Ownership: every function that returns an rf_array * hands the caller one
 * reference, released with rf_array_free(). Executables and traces that
 * capture an array take their own reference, so an array freed by the user
 * while captured stays alive (and keeps receiving in-place updates) until the
 * last executable capturing it is freed. rf_array_free(NULL) is a no-op.
 */
#ifndef REFLUX_ARRAY_H
#define REFLUX_ARRAY_H

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rf_array rf_array;

/* A new array on `dev` holding a copy of `data` (the product of dims elements
 * of `dtype`, row-major); `data` == NULL gives zeros. Owned. Errors:
 * RF_E_INVALID (bad rank/dims/dtype), RF_E_NOMEM. */
RF_API rf_array *rf_array_new(rf_device *dev, rf_dtype dtype, const int64_t *dims, int rank,
                              const void *data);
/* Host arrays from host data: the common case. Owned. */
RF_API rf_array *rf_array_from(rf_dtype dtype, const int64_t *dims, int rank, const void *data);
RF_API rf_array *rf_zeros(rf_dtype dtype, const int64_t *dims, int rank); /* on the host; owned */
RF_API rf_array *rf_ones(rf_dtype dtype, const int64_t *dims, int rank);  /* on the host; owned */
RF_API rf_array *rf_fill(rf_dtype dtype, const int64_t *dims, int rank, double value); /* host */
/* Standard normal / uniform [0,1) values on the host from a counter-based
 * generator (Philox4x32-10): the same seed gives the same bits on every
 * platform. Float dtypes only (RF_E_DTYPE otherwise). Owned. */
RF_API rf_array *rf_randn(rf_dtype dtype, const int64_t *dims, int rank, uint64_t seed);
RF_API rf_array *rf_rand(rf_dtype dtype, const int64_t *dims, int rank, uint64_t seed);

/* Options for moving arrays between devices. */
typedef struct rf_to_opts {
    bool keep_f64; /* false (default): f64 becomes f32 on a compute device, as Flux does */
    bool to_f64;   /* f32 becomes f64 (and f64 stays): Flux's f64(m), PyTorch's .double(),
                      for float64 gradient checks */
} rf_to_opts;

/* A copy of `a` on `dev` (f64 becomes f32 when `dev` is a compute device).
 * Moving to the host never converts. Owned. Errors: RF_E_INVALID, RF_E_NOMEM,
 * RF_E_DEVICE. */
RF_API rf_array *rf_array_to(const rf_array *a, rf_device *dev);
RF_API rf_array *rf_array_to_opts(const rf_array *a, rf_device *dev, const rf_to_opts *opts);

/* A copy of rows [lo, hi) of `a` along its first dim, on a's device (a subset of
 * a dataset: rf_array_rows(images, 0, 10000)). 0 <= lo <= hi <= dims[0], rank >= 1.
 * Owned. Errors: RF_E_INVALID (NULL, rank 0), RF_E_SHAPE (the range), RF_E_NOMEM. */
RF_API rf_array *rf_array_rows(const rf_array *a, int64_t lo, int64_t hi);

RF_API rf_device *rf_array_device(const rf_array *a);
RF_API rf_dtype rf_array_dtype(const rf_array *a);
RF_API int rf_array_rank(const rf_array *a);
/* Borrowed pointer to rank dims, valid while the array lives. */
RF_API const int64_t *rf_array_dims(const rf_array *a);
RF_API int64_t rf_array_numel(const rf_array *a);
RF_API size_t rf_array_nbytes(const rf_array *a);

/* Copies the array's elements into `dst` (capacity `nbytes`), whatever device
 * it lives on. Errors: RF_E_INVALID (NULL, nbytes too small). */
RF_API rf_status rf_array_read(const rf_array *a, void *dst, size_t nbytes);
/* Overwrites the array's elements in place from host memory `src` (exactly
 * rf_array_nbytes(a) bytes). Executables that capture `a` see the new values
 * on their next run. Errors: RF_E_INVALID. */
RF_API rf_status rf_array_write(rf_array *a, const void *src, size_t nbytes);
/* Borrowed pointer to the elements of a host or CPU array (NULL for device
 * memory the host cannot address), 64-byte aligned. Valid while the array
 * lives. */
RF_API void *rf_array_data(rf_array *a);
/* The single element of an array with one element, as a double (the seed's
 * to_number). Returns NaN and sets RF_E_SHAPE if the array has more. */
RF_API double rf_to_number(const rf_array *a);

/* Releases the caller's reference. */
RF_API void rf_array_free(rf_array *a);

/* The memory of the arrays that loops make anew at every pass (the outputs of
 * rf_exec_run and rf_jitted_run, a loader's batches, rf_array_to and
 * rf_array_rows copies), 64 KiB or more, is kept when they are freed and their
 * size recurs, for the next array of that size: such a loop reuses pages the
 * kernel has already mapped instead of taking a page fault on each. Arrays
 * made once (rf_zeros, rf_array_new, ...) are never kept. At most 64 MiB is
 * kept (the oldest blocks go first), or RF_ARRAY_CACHE_MB from the environment
 * (0: nothing). rf_array_cache_clear() frees what is kept and returns its byte
 * count; rf_array_cache_bytes() tells how much is kept. Thread-safe. */
RF_API size_t rf_array_cache_clear(void);
RF_API size_t rf_array_cache_bytes(void);

#ifdef __cplusplus
}
#endif
#endif
