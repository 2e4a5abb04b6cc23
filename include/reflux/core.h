/* reflux/core.h: status codes, error messages, dtypes, shapes and devices.
 *
 * Everything here is plain values; no function in this header allocates.
 * C99-compatible, usable from C++.
 */
#ifndef REFLUX_CORE_H
#define REFLUX_CORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define RF_API __declspec(dllexport)
#else
#define RF_API __attribute__((visibility("default")))
#endif

#define RF_VERSION_MAJOR 0
#define RF_VERSION_MINOR 1
#define RF_VERSION_PATCH 0

/* The library's version as "MAJOR.MINOR.PATCH"; compare with RF_VERSION_* to
 * check that header and library match. Static string. */
RF_API const char *rf_version(void);

/* ---- Errors --------------------------------------------------------------
 * Every fallible call returns an rf_status (or NULL, or NaN) and leaves a
 * message that names the operation and the offending shapes/values in a
 * thread-local buffer read with rf_errmsg(), and its status, read with
 * rf_errstatus() (what a call that returns NULL or NaN failed with). No call
 * aborts or exits on user error. */
typedef enum rf_status {
    RF_OK = 0,
    RF_E_INVALID,     /* bad argument: NULL, out of range, wrong count        */
    RF_E_SHAPE,       /* shapes do not fit                                     */
    RF_E_DTYPE,       /* element types do not fit                              */
    RF_E_DEVICE,      /* array on the wrong device (e.g. host where device)    */
    RF_E_NOMEM,       /* an allocation failed                                  */
    RF_E_DOMAIN,      /* a value is out of its domain (non-finite loss, ...)   */
    RF_E_IO,          /* a file could not be read or written                   */
    RF_E_CORRUPT,     /* a file or buffer is malformed                         */
    RF_E_COMPILE,     /* tracing or compiling failed                           */
    RF_E_UNSUPPORTED, /* valid, but not implemented by this backend/device     */
    RF_E_INTERNAL,    /* a bug in reflux: please report it                     */
    RF_STATUS_COUNT
} rf_status;

/* The message of the last failure on this thread ("" if none). Borrowed: valid
 * until the next reflux call on this thread. */
RF_API const char *rf_errmsg(void);
/* The status of the last failure on this thread (RF_OK if none since
 * rf_clear_error). A successful call leaves it as it was, like the message:
 * read it right after a call that returned NULL or NaN. */
RF_API rf_status rf_errstatus(void);
/* A short name for a status ("RF_E_SHAPE"). Static string. */
RF_API const char *rf_status_str(rf_status st);
/* Clears this thread's message and status. */
RF_API void rf_clear_error(void);
/* Records a failure of your own as this thread's message and status (the
 * message printf-style, cut at 2047 bytes) and returns st, for code that
 * reflux calls back (rf_train's on_step) to report why it failed; its
 * arguments may quote rf_errmsg(), the failure it wraps; a NULL fmt records
 * rf_status_str(st). st must be an error status: RF_OK or a value outside
 * rf_status records RF_E_INVALID saying so, and is what is returned. */
RF_API rf_status rf_set_error(rf_status st, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* ---- Element types ------------------------------------------------------- */
typedef enum rf_dtype {
    RF_F32 = 0,
    RF_F64,
    RF_I32,
    RF_I64,
    RF_U8,
    RF_BOOL, /* one byte per element, 0 or 1 */
    RF_DTYPE_COUNT
} rf_dtype;

RF_API const char *rf_dtype_name(rf_dtype dt); /* "f32", ...; static string */
RF_API size_t rf_dtype_size(rf_dtype dt);      /* bytes per element; 0 if invalid */

/* ---- Shapes ----------------------------------------------------------------
 * Row-major, batch first: a batch of 16 vectors of 4 features is {16, 4}; an
 * image batch is NCHW. Dims are int64_t; rank 0 is a scalar. */
#define RF_MAX_RANK 8

/* RF_SHAPE(16, 4) expands to the two arguments `dims, rank` that every
 * shape-taking function accepts. */
#define RF_SHAPE(...) \
    ((const int64_t[]){__VA_ARGS__}), \
    ((int)(sizeof((const int64_t[]){__VA_ARGS__}) / sizeof(int64_t)))
/* The shape of a scalar. */
#define RF_SCALAR_SHAPE NULL, 0

/* ---- Devices -------------------------------------------------------------
 * Devices are static objects owned by the library: never freed by the user.
 *   host: ordinary memory the user reads and writes; compiled code never takes
 *         host arrays (the seed's "everything must already live on the device").
 *   cpu:  the CPU as a compute device.
 *   cuda: an NVIDIA GPU, once reflux has a CUDA backend; this version has none,
 *         so rf_device_cuda() returns NULL and says why. */
typedef struct rf_device rf_device;

typedef enum rf_device_kind {
    RF_DEVICE_HOST = 0,
    RF_DEVICE_CPU,
    RF_DEVICE_CUDA,
    RF_DEVICE_KIND_COUNT
} rf_device_kind;

/* The best compute device: CUDA when usable, else the CPU. The environment
 * variable RF_DEVICE=cpu|cuda|cuda:N forces a choice (an unusable choice falls
 * back to the CPU with a warning on stderr). Never NULL. */
RF_API rf_device *rf_device_default(void);
RF_API rf_device *rf_device_cpu(void);  /* never NULL */
RF_API rf_device *rf_device_host(void); /* never NULL */
/* CUDA device `index`, or NULL with RF_E_DEVICE when it is not usable (always,
 * in this version: the message says whether a driver was found). */
RF_API rf_device *rf_device_cuda(int index);
RF_API rf_device_kind rf_device_kind_of(const rf_device *dev);
RF_API const char *rf_device_name(const rf_device *dev); /* "cpu", "host", "cuda:0" */

#ifdef __cplusplus
}
#endif
#endif
