/* reflux/trace.h: tracing a C function into a program, compiling it, running it.
 *
 * rf_compile() calls the user's function once with an rf_trace. Inside, the
 * function reads its arguments with rf_arg(), references device arrays by
 * reference with rf_capture(), builds the computation with the ops of
 * reflux/ops.h, records in-place updates of captured arrays with rf_assign()
 * and declares outputs with rf_return(). Nothing is computed while tracing.
 *
 * Ownership: rf_trace and every rf_tensor belong to the compile call and are
 * freed when it returns: never keep them. rf_exec is owned by the caller
 * (rf_exec_free); it holds references to every array it captures.
 *
 * Sticky errors: the first invalid op records a message naming the op and the
 * shapes on the trace and returns NULL; ops given a NULL operand return NULL
 * without a new message; rf_compile then fails with that first message.
 */
#ifndef REFLUX_TRACE_H
#define REFLUX_TRACE_H

#include "array.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct rf_trace rf_trace;
typedef struct rf_tensor rf_tensor; /* a value in a trace; freed with the trace */
typedef struct rf_exec rf_exec;

/* A function to trace. `ctx` is the pointer given to rf_compile. */
typedef void (*rf_trace_fn)(rf_trace *t, void *ctx);

/* ---- Inside a traced function ---------------------------------------------- */

/* Argument i of the call, with the shape, dtype and device of the array given
 * to rf_compile. NULL (and a trace error) if i is out of range. */
RF_API rf_tensor *rf_arg(rf_trace *t, int i);
/* Number of arguments of the call being traced. */
RF_API int rf_n_args(const rf_trace *t);
/* References `a` by reference: every run reads its current contents, nothing
 * is copied at compile time. Capturing the same array twice gives the same
 * tensor. `a` must live on the compile device (RF_E_DEVICE otherwise). */
RF_API rf_tensor *rf_capture(rf_trace *t, rf_array *a);
/* Records `a <- value` (same shape and dtype as `a`; `a` is captured if it was
 * not). All updates are applied together when a run ends successfully, after
 * every output has been computed from the old values: values that read other
 * captured arrays see them as they were before the run, so `a <- b, b <- a`
 * swaps. Assigning one array twice keeps the last value. */
RF_API void rf_assign(rf_trace *t, rf_array *a, rf_tensor *value);
/* Appends `x` to the outputs (in call order). */
RF_API void rf_return(rf_trace *t, rf_tensor *x);
/* Records an error on the trace (if none is recorded yet), for user code that
 * finds its own inputs invalid. printf-style message. */
RF_API void rf_trace_fail(rf_trace *t, rf_status st, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
/* The trace's current error status (RF_OK if none). */
RF_API rf_status rf_trace_status(const rf_trace *t);
/* The trace a tensor belongs to (NULL for NULL). */
RF_API rf_trace *rf_tensor_trace(const rf_tensor *x);

/* ---- Matmul precision -----------------------------------------------------------
 * How the f32 matrix products and convolutions a trace builds (rf_matmul,
 * rf_dot_general, rf_conv, and so Dense, Conv and the other layers built on
 * them) treat their operands. RF_PRECISION_F32, the default: as they are.
 * RF_PRECISION_BF16: every operand element is first rounded to bfloat16 (8
 * significant bits; to nearest even, subnormals to a zero of their sign, NaN
 * kept), and the products are summed as f32 ones are -- JAX's "bfloat16"
 * matmul precision, the products and convolutions of PyTorch's bf16
 * autocast. On a CPU with AVX512-BF16 such matrix products run about twice
 * as fast; elsewhere they give the same results a little slower than f32.
 * An op keeps its precision in the gradient (both backward products or
 * convolutions use it). f64 and integer ops are exact whatever the setting.
 * Models carry their own (rf_model_set_matmul_precision). */
typedef enum rf_precision {
    RF_PRECISION_F32 = 0,
    RF_PRECISION_BF16 = 1,
} rf_precision;
/* Sets the precision of the products t builds from now on and returns the
 * one before, so a scope can restore it. An invalid p records RF_E_INVALID on
 * the trace and changes nothing. */
RF_API rf_precision rf_trace_set_matmul_precision(rf_trace *t, rf_precision p);
RF_API const char *rf_precision_name(rf_precision p); /* "f32", "bf16"; NULL if invalid */

/* Shape and dtype of a traced tensor (static: known while tracing). */
RF_API rf_dtype rf_tensor_dtype(const rf_tensor *x);
RF_API int rf_tensor_rank(const rf_tensor *x);
RF_API int64_t rf_tensor_dim(const rf_tensor *x, int axis); /* negative axis counts from the end */
RF_API const int64_t *rf_tensor_dims(const rf_tensor *x);    /* borrowed; freed with the trace */
RF_API int64_t rf_tensor_numel(const rf_tensor *x);

/* ---- Gradients ----------------------------------------------------------------
 * rf_grad(t, y, wrt, n, out) sets out[i] to d y / d wrt[i] (same shape and
 * dtype as wrt[i]) for a scalar float `y` built from wrt[i] (arguments,
 * captures or any intermediate tensor; not a weak rf_scalar, whose uses each
 * take their own dtype: use rf_scalar_typed). Reverse mode: the trace records one
 * "grad" node per output and the autodiff pass replaces them by ordinary ops
 * at compile time. Tensors that only reach `y` through rf_stop_gradient, or
 * not at all, get zeros. Returns the status (out[i] NULL on failure). */
RF_API rf_status rf_grad(rf_trace *t, rf_tensor *y, rf_tensor *const *wrt, int n, rf_tensor **out);

/* ---- Compile and run ----------------------------------------------------------- */

typedef struct rf_compile_opts {
    rf_device *device; /* NULL: the device of the first argument, else the default */
    const char *name;  /* a name for dumps and messages; NULL: "program" */
    rf_precision matmul_precision; /* the trace's at the start (zero: F32) */
} rf_compile_opts;

/* Traces fn(t, ctx) once with arguments shaped like args[0..nargs) (which
 * must live on one compute device) and compiles the program for that device.
 * On success *out is the executable (owned). On failure *out is NULL and the
 * status and rf_errmsg() say why; for a trace error, that is the first op
 * that failed. RF_DUMP=<dir> writes the traced, differentiated and final
 * program text of every compile into <dir>. */
RF_API rf_status rf_compile(rf_trace_fn fn, void *ctx, rf_array *const *args, int nargs,
                            rf_exec **out);
RF_API rf_status rf_compile_with(rf_trace_fn fn, void *ctx, rf_array *const *args, int nargs,
                                  const rf_compile_opts *opts, rf_exec **out);

/* Runs the executable: args must match the compile-time arguments in count,
 * shape, dtype and device (RF_E_INVALID / RF_E_SHAPE / RF_E_DTYPE /
 * RF_E_DEVICE with expected vs actual otherwise). outs[0..nouts) receive new
 * arrays (owned) for the outputs; nouts may be less than the number of
 * outputs (the rest are dropped) but not more. Updates of captured arrays are
 * applied only when the whole run succeeded; an argument may be one of those
 * arrays (the run reads its old contents, from a copy the run makes). A layer
 * whose forward read its train/test mode while tracing (rf_model_training) must
 * be in that mode still, or the run returns RF_E_INVALID naming it. Runs of
 * one executable from several threads take turns. */
RF_API rf_status rf_exec_run(rf_exec *e, rf_array *const *args, int nargs, rf_array **outs,
                             int nouts);
/* Compile, run once, free. outs as for rf_exec_run. */
RF_API rf_status rf_jit(rf_trace_fn fn, void *ctx, rf_array *const *args, int nargs,
                        rf_array **outs, int nouts);

/* ---- Jitted functions: compiled per argument types, cached ---------------------
 * rf_jitted_new(fn, ctx) wraps a traced function as JAX's jax.jit does: the first
 * rf_jitted_run with arguments of a new count, dtype, shape or device traces and
 * compiles fn (as rf_compile), later runs with those types run the executable
 * compiled then. So an evaluation function called on a test set's full batches and
 * its smaller last one compiles twice, whatever the number of calls. fn must trace
 * the same program for the same argument types, but for the train/test modes of the
 * models it applies: an executable is kept per mode of the layers that read theirs
 * (rf_model_training), and switching back finds it again; arrays it captures are read at run
 * time (a model's training updates are seen). Past 8 executables each new one
 * prints a warning (arguments whose shapes keep changing). Lookups and compiles from
 * several threads are safe; runs of one executable take turns. Owned:
 * rf_jitted_free frees it and its executables. */
typedef struct rf_jitted rf_jitted;
RF_API rf_jitted *rf_jitted_new(rf_trace_fn fn, void *ctx);
/* As rf_exec_run (outs owned by the caller), compiling first when the argument
 * types are new; a failed compile is not cached (the next run tries again). */
RF_API rf_status rf_jitted_run(rf_jitted *f, rf_array *const *args, int nargs, rf_array **outs,
                               int nouts);
/* The executables compiled so far (one per distinct argument types). */
RF_API int rf_jitted_n_compiled(rf_jitted *f);
RF_API void rf_jitted_free(rf_jitted *f);

RF_API int rf_exec_n_args(const rf_exec *e);
RF_API int rf_exec_n_outputs(const rf_exec *e);
RF_API int rf_exec_n_updates(const rf_exec *e);
/* Shape/dtype of output i (dims borrowed, valid while e lives). */
RF_API rf_dtype rf_exec_output_dtype(const rf_exec *e, int i);
RF_API int rf_exec_output_rank(const rf_exec *e, int i);
RF_API const int64_t *rf_exec_output_dims(const rf_exec *e, int i);
/* Structural hash of the program the backend received: equal for the same
 * program however it was traced. */
RF_API uint64_t rf_exec_hash(const rf_exec *e);
/* The program as text, one line per node (borrowed, valid while e lives). */
RF_API const char *rf_exec_program_text(const rf_exec *e);
RF_API const char *rf_exec_backend_name(const rf_exec *e);
RF_API rf_device *rf_exec_device(const rf_exec *e);
/* Bytes the executable holds for intermediates and workspaces, planned at
 * compile time (known before the first run; 0 when the backend cannot say). */
RF_API size_t rf_exec_memory(const rf_exec *e);
RF_API void rf_exec_free(rf_exec *e);

/* Traces fn without compiling and returns the traced program as text (owned:
 * free with free()) and its structural hash. For tests and debugging. The text
 * is the program rf_compile starts from: nodes and updates in an order that
 * follows from what they compute, not from the order the calls ran in, and
 * without nodes that reach no output or update. */
RF_API rf_status rf_trace_text(rf_trace_fn fn, void *ctx, rf_array *const *args, int nargs,
                               char **text, uint64_t *hash);

#ifdef __cplusplus
}
#endif
#endif
