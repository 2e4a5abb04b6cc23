/* services.h: the runtime services a compiled CPU module calls (module_abi.h):
 * parallel_for over the runtime's thread pool, and `call` for the plan's CALL
 * steps (matmul and convolution through oneDNN, anything else through the
 * reference kernels). Also the internal interfaces of the two library-call
 * implementations (dnnl_matmul.c, conv.c) that services.c drives.
 *
 * Everything a CALL step needs (oneDNN engine and stream, primitives, memory
 * objects, operand locations, one workspace shared by all steps) is created
 * once by rfi_cpu_services_prepare; a call allocates nothing through the
 * runtime's allocator. Steps of one executable run one at a time (the
 * executable's arena and workspace are shared), so an executable must not be
 * run on two threads at once.
 *
 * oneDNN is loaded at run time on the first prepare (dnnl_loader.h); if it
 * cannot be loaded, matmul and convolution steps run the reference kernels.
 *
 * Threads: oneDNN (Debian's build) runs on OpenMP, and once it is loaded the
 * runtime's pool runs its loops on the same OpenMP threads
 * (rfi_threadpool_use_openmp). Library calls run from the calling thread
 * with OpenMP's thread count set to the pool's size (omp_set_num_threads),
 * or to one for small products, so nothing oversubscribes the cores.
 *
 * Precision: f32 matmul and convolution accumulate in f32 in oneDNN's order;
 * the reference kernels (and so the FALLBACK path) accumulate in double.
 */
#ifndef RF_BACKEND_CPU_SERVICES_H
#define RF_BACKEND_CPU_SERVICES_H

#include "dnnl_loader.h"

#include "../plan.h"
#include "module_abi.h"

typedef struct rfi_cpu_services rfi_cpu_services;

/* Creates the state for every CALL step of p (p must outlive it). */
RFI_FUNC rf_status rfi_cpu_services_prepare(const rfi_plan *p, rfi_cpu_services **out);
/* module_abi.h's `call`: runs CALL step `step` on the buffer table (rt is the
 * rfi_cpu_services). 0 on success; otherwise non-zero with rfi_error set. */
RFI_FUNC int rfi_cpu_services_call(void *rt, int step, void *const *buffers);
/* The status of the last call that failed (its message is the thread's
 * error), RF_E_INTERNAL if none did. */
RFI_FUNC rf_status rfi_cpu_services_failure(const rfi_cpu_services *s);
/* module_abi.h's `parallel_for` (rt: the rfi_cpu_services, or NULL), over the
 * process-wide pool, in the direction of the current run. */
RFI_FUNC void rfi_cpu_services_parallel_for(void *rt, int64_t n, int64_t grain,
                                            void (*body)(void *ctx, int64_t lo, int64_t hi),
                                            void *ctx);
/* Called before each run of the module: alternates the direction in which
 * parallel_for's threads take their chunks, run to run (services.c). */
RFI_FUNC void rfi_cpu_services_start_run(rfi_cpu_services *s);
/* Fills the table a module's entry point receives. */
RFI_FUNC void rfi_cpu_services_table(rfi_cpu_services *s, rf_module_services *table);
RFI_FUNC void rfi_cpu_services_free(rfi_cpu_services *s);
/* How CALL step `step` actually runs (FALLBACK for a MATMUL/CONV the library
 * path does not take: non-f32 dtypes, unsupported forms), NONE if not a CALL
 * step. For tests and dumps. */
RFI_FUNC rfi_call_kind rfi_cpu_services_step_kind(const rfi_cpu_services *s, int step);
/* Which implementation CALL step `step` runs, for tests and benches: a matmul
 * path (rfi_cpu_matmul_path), a convolution path (rfi_cpu_conv_path), a
 * native kernel (rfi_cpu_native_path), "reference", or "none" (not a CALL
 * step). Static strings. */
RFI_FUNC const char *rfi_cpu_services_step_path(const rfi_cpu_services *s, int step);
/* How many leading ops of CALL step `step`'s epilogue the library applies
 * (as post-ops or a convolution's bias input); the services apply the rest
 * after the call. For tests. */
RFI_FUNC int rfi_cpu_services_step_lib_ops(const rfi_cpu_services *s, int step);
/* Whether CALL step `step`'s primitive takes its epilogue's leading bias as its
 * own bias input (a matmul's or a forward convolution's). For tests. */
RFI_FUNC bool rfi_cpu_services_step_bias_input(const rfi_cpu_services *s, int step);
/* Whether CALL step `step` runs beside its pair's other call (the plan's
 * runs_with_next), a thread each; false: unpaired, or paired one after the other. */
RFI_FUNC bool rfi_cpu_services_step_beside(const rfi_cpu_services *s, int step);
/* Whether CALL step `step` runs on its caller alone with work for the team
 * later in the run, and so keeps the team warm before it
 * (rfi_threadpool_keep_team_warm). For tests. */
RFI_FUNC bool rfi_cpu_services_step_warm_team(const rfi_cpu_services *s, int step);
/* The bytes allocated at prepare: the shared workspace and the blocked
 * copies convolutions share. */
RFI_FUNC size_t rfi_cpu_services_workspace(const rfi_cpu_services *s);
/* How many helper threads prepare has started in this process to make the
 * library calls of a plan beside the caller (services.c, "Making the calls on
 * two threads"). For tests. */
RFI_FUNC int64_t rfi_cpu_services_helpers_started(void);
/* How many blocked input copies convolutions share (for tests). */
RFI_FUNC int rfi_cpu_services_shared_inputs(const rfi_cpu_services *s);

/* ---- Library calls (internal to services.c and its siblings) ------------------------ */

/* Bytes rounded up to the workspace alignment (64). */
static inline size_t rfi_ws_align(size_t n) { return (n + 63) & ~(size_t)63; }

/* One oneDNN matmul primitive over strided f32 tensors (dims and strides in
 * elements, ndims <= 4), src x weights = dst with the batch dims in front;
 * its scratchpad lives in the caller's workspace (user scratchpad mode). */
typedef struct rfi_dnnl_mm {
    dnnl_primitive_t prim;
    dnnl_memory_t src, wei, dst, scratch;
    dnnl_memory_t bias;              /* the bias input (rfi_dnnl_post.bias_input), or NULL */
    dnnl_memory_t post[RFI_EPI_MAX]; /* binary post-op operands (NULL: eltwise op) */
    int n_post;                      /* post-ops of the primitive */
    size_t scratch_bytes;
    bool is_ref; /* oneDNN picked its slow reference implementation */
    bool bf16_isa; /* its kernel has bf16 instructions (avx512_core_bf16, amx) */
} rfi_dnnl_mm;
typedef struct rfi_dnnl_tensor {
    int ndims;
    dnnl_dims_t dims, strides; /* ndims <= 4 used */
} rfi_dnnl_tensor;

/* A plan epilogue (plan.h) as oneDNN post-ops: eltwise tanh/logistic and
 * binary adds whose second operand (src1) is a plain strided tensor in the
 * dst's dims (a BIAS: ones except along the bias dim; an ADD: dst's shape).
 * Never a relu (rfi_dnnl_post_faithful). `accumulate`: the product is added
 * to what dst holds (a sum post-op ahead of the n ops; winograd.c).
 * `bias_input` (matmuls only): the epilogue's first op, a BIAS along the
 * result's last dim, is the primitive's bias input, described by `bias`, and
 * the n post-ops are the ops after it; the operands of a run are then the
 * bias's first and the post-ops' after it. */
typedef struct rfi_dnnl_post {
    int n;
    rfi_epi_kind kind[RFI_EPI_MAX];
    rfi_dnnl_tensor src1[RFI_EPI_MAX];
    bool accumulate;
    bool bias_input;
    rfi_dnnl_tensor bias;
} rfi_dnnl_post;
/* How many leading ops of an epilogue oneDNN's post-ops compute as the
 * interpreter does: those before the first RELU. oneDNN's jit kernels take
 * relu as max(x, 0) with x first, which is 0 where x is NaN (the
 * interpreter's relu keeps the NaN), so a NaN in the data would vanish
 * before the loss; the relu and what follows it run after the call. */
RFI_FUNC int rfi_dnnl_post_faithful(const rfi_epi_op *ops, int n);
/* Describes ops over a plain row-major dst whose bias dim is bias_dim (-1: no
 * BIAS op can be taken). false: some op has no post-op form here. */
RFI_FUNC bool rfi_dnnl_post_make(rfi_dnnl_post *post, const rfi_epi_op *ops, int n,
                                 const rfi_dnnl_tensor *dst, int bias_dim);
/* Sets post's ops on attr (n == 0: nothing). */
RFI_FUNC dnnl_status_t rfi_dnnl_post_attr(dnnl_primitive_attr_t attr, const rfi_dnnl_post *post);
/* Creates the memory objects (no data) of post's binary operands in mem[]. */
RFI_FUNC dnnl_status_t rfi_dnnl_post_memories(const rfi_dnnl_post *post, dnnl_engine_t eng,
                                              dnnl_memory_t *mem);
/* Appends the execution arguments of post's binary operands, pointing them at
 * src[k] (per epilogue op); returns the new argument count (or -1 on error). */
RFI_FUNC int rfi_dnnl_post_args(const rfi_dnnl_post *post, dnnl_memory_t *mem,
                                const void *const *src, dnnl_exec_arg_t *args, int nargs);

/* Whether RF_PRECISION_BF16 products may run on kernels with the CPU's bf16
 * instructions (RF_BF16_KERNELS unset or not "0"; else the same numbers
 * come from f32 kernels over rounded operands). Read at prepare time. */
RFI_FUNC bool rfi_bf16_kernels_allowed(void);
/* dst[j] = rfi_round_bf16(src[j]) for j < n, vectorised where the CPU allows,
 * on the pool's threads when n is large; dst may be src. */
RFI_FUNC void rfi_cpu_round_bf16(float *dst, const float *src, int64_t n);
/* post may be NULL (no post-ops). */
RFI_FUNC rf_status rfi_dnnl_mm_init(rfi_dnnl_mm *mm, dnnl_engine_t eng, const rfi_dnnl_tensor *src,
                                    const rfi_dnnl_tensor *wei, const rfi_dnnl_tensor *dst,
                                    const rfi_dnnl_post *post, const char *what);
/* post_src: the binary post-op operands, per epilogue op (NULL if none). */
RFI_FUNC rf_status rfi_dnnl_mm_run(rfi_dnnl_mm *mm, dnnl_stream_t s, const float *src,
                                   const float *wei, float *dst, void *scratch,
                                   const void *const *post_src, const char *what);
RFI_FUNC void rfi_dnnl_mm_destroy(rfi_dnnl_mm *mm);
/* The oneDNN tag of a 4-D buffer in `layout` (plan.h), described with its
 * node's dims or with dims 0 and 1 swapped; dnnl_format_tag_undef where
 * there is none (conv.c). */
RFI_FUNC dnnl_format_tag_t rfi_dnnl_layout_tag(rfi_layout layout, bool swapped);
/* A reorder between two layouts of one tensor, made once and run on any
 * pair of buffers: the primitive and its two memories (no data). prim NULL:
 * nothing made (zeroed, or after rfi_dnnl_copy_free). services.c. */
typedef struct rfi_dnnl_copy {
    dnnl_primitive_t prim;
    dnnl_memory_t from, to;
} rfi_dnnl_copy;
RFI_FUNC dnnl_status_t rfi_dnnl_copy_make(rfi_dnnl_copy *c, const dnnl_memory_desc_t *from,
                                          const dnnl_memory_desc_t *to, dnnl_engine_t eng);
/* Reorders `from` into `to` and waits; errors name `what`. */
RFI_FUNC rf_status rfi_dnnl_copy_run(const rfi_dnnl_copy *c, dnnl_stream_t s, const void *from,
                                     void *to, const char *what);
RFI_FUNC void rfi_dnnl_copy_free(rfi_dnnl_copy *c);
/* A reorder primitive from one memory layout to another (conv.c). */
RFI_FUNC dnnl_status_t rfi_dnnl_reorder_create(const dnnl_memory_desc_t *from,
                                               const dnnl_memory_desc_t *to, dnnl_engine_t eng,
                                               dnnl_primitive_t *reorder);
/* An error message for a failed oneDNN call. */
RFI_FUNC rf_status rfi_dnnl_error(dnnl_status_t st, const char *what, const char *call);

/* DOT_GENERAL on f32 (dnnl_matmul.c). prepare returns RF_E_UNSUPPORTED for
 * forms it does not take (the caller then uses the reference kernel). The
 * epilogue ops (n_epi may be 0) run as oneDNN post-ops, as many leading ones
 * as the primitive takes (rfi_cpu_matmul_epilogue_ops); the caller applies
 * the rest.
 * epi_src: the operand of each epilogue op (NULL where none). */
typedef struct rfi_cpu_matmul rfi_cpu_matmul;
RFI_FUNC rf_status rfi_cpu_matmul_prepare(const rfi_node *n, const rfi_epi_op *epi, int n_epi,
                                          dnnl_engine_t eng, rfi_cpu_matmul **out,
                                          size_t *workspace_bytes);
RFI_FUNC rf_status rfi_cpu_matmul_run(rfi_cpu_matmul *m, dnnl_stream_t s, const void *lhs,
                                      const void *rhs, void *out, const void *const *epi_src,
                                      void *workspace);
RFI_FUNC int rfi_cpu_matmul_epilogue_ops(const rfi_cpu_matmul *m);
/* Whether the first of those is the primitive's bias input. */
RFI_FUNC bool rfi_cpu_matmul_bias_input(const rfi_cpu_matmul *m);
/* "matmul" (operands read in place), "matmul packed" (both copied per call)
 * or "matmul padded rhs" (the rhs copied into padded rows per call). */
RFI_FUNC const char *rfi_cpu_matmul_path(const rfi_cpu_matmul *m);
RFI_FUNC void rfi_cpu_matmul_free(rfi_cpu_matmul *m);

/* CONVOLUTION on f32 (conv.c), same conventions (the epilogue runs inside
 * oneDNN's forward convolution only). views[k]: operand k is a view
 * (plan.h, conv_transposed_views): its buffer holds the operand with dims 0
 * and 1 swapped. Only the backward-weights path reads views as they are
 * (rfi_cpu_conv_takes_views); on the others the caller passes the operand
 * itself, transposed back. */
typedef struct rfi_cpu_conv rfi_cpu_conv;
RFI_FUNC rf_status rfi_cpu_conv_prepare(const rfi_node *n, const rfi_epi_op *epi, int n_epi,
                                        const bool views[2], const rfi_layout layouts[3],
                                        dnnl_engine_t eng, rfi_cpu_conv **out,
                                        size_t *workspace_bytes);
RFI_FUNC bool rfi_cpu_conv_takes_views(const rfi_cpu_conv *c);
RFI_FUNC rf_status rfi_cpu_conv_run(rfi_cpu_conv *c, dnnl_stream_t s, const void *x,
                                    const void *w, void *out, const void *const *epi_src,
                                    void *workspace);
/* How many leading ops of the epilogue the convolution applies (the caller
 * applies the rest). */
RFI_FUNC int rfi_cpu_conv_epilogue_ops(const rfi_cpu_conv *c);
/* Whether the first of those is oneDNN's bias input. */
RFI_FUNC bool rfi_cpu_conv_bias_input(const rfi_cpu_conv *c);
RFI_FUNC void rfi_cpu_conv_free(rfi_cpu_conv *c);
/* Input k (0 or 1) of a prepared convolution is reordered from the IR's
 * buffer into *inner's layout (*bytes of it) before each call: true, with
 * both layouts. Several calls of a step reading one value into one layout
 * can share that copy: the first fills `storage`, the later ones
 * (fills = false) read it and skip their reorder (services.c). */
RFI_FUNC bool rfi_cpu_conv_input_copy(const rfi_cpu_conv *c, int k,
                                      const dnnl_memory_desc_t **user,
                                      const dnnl_memory_desc_t **inner, size_t *bytes);
RFI_FUNC void rfi_cpu_conv_share_input(rfi_cpu_conv *c, int k, void *storage, bool fills);
/* Whether the prepared convolution reads or writes tensor k (0, 1: the IR
 * operands; 2: the result) in the layout prepare was given for its buffer
 * (layouts[k], plan.h; a view's buffer: its operand's), with no reorder when
 * that is the primitive's own layout. false: it reads or writes it
 * row-major (its path cannot take the layout), and the services reorder
 * around the call. */
RFI_FUNC bool rfi_cpu_conv_laid_out(const rfi_cpu_conv *c, int k);
/* Which path a prepared convolution takes: "im2col", or oneDNN's "forward",
 * "bwd-weights" or "bwd-data", with "-winograd" for its Winograd kernels (for
 * profiles, tests and benches). */
RFI_FUNC const char *rfi_cpu_conv_path(const rfi_cpu_conv *c);
/* Whether c runs oneDNN's Winograd convolution (not winograd.c's, whose
 * transforms want both threads: services.c, runs_well_beside). */
RFI_FUNC bool rfi_cpu_conv_is_winograd(const rfi_cpu_conv *c);

/* Native kernels for FALLBACK steps (pool.c): SELECT_AND_SCATTER and
 * ARGMAX/ARGMIN on f32/f64, GATHER / SCATTER_ADD through index_native.c and
 * RNG through rng_native.c, same conventions (RF_E_UNSUPPORTED: not taken). */
typedef struct rfi_cpu_native rfi_cpu_native;
RFI_FUNC rf_status rfi_cpu_native_prepare(const rfi_node *n, rfi_cpu_native **out,
                                          size_t *workspace_bytes);
RFI_FUNC rf_status rfi_cpu_native_run(rfi_cpu_native *k, const void *const *in, void *out,
                                      void *workspace);
RFI_FUNC void rfi_cpu_native_free(rfi_cpu_native *k);
/* A select_and_scatter's operand, source and result live in layouts lay[0],
 * lay[1] and lay[2] (plan.h): true if the kernel takes them (then it reads
 * and writes them directly), false (nothing changed) if not. */
RFI_FUNC bool rfi_cpu_native_take_layouts(rfi_cpu_native *k, const rfi_layout lay[3]);
/* "native-scatter-fast", "native-scatter-blocked", "native-scatter-gather",
 * "native-scatter-gather-blocked", "native-scatter", "native-arg", or
 * rfi_cpu_index_path's or rfi_cpu_rng_path's. */
RFI_FUNC const char *rfi_cpu_native_path(const rfi_cpu_native *k);

/* GATHER and SCATTER_ADD on f32/f64 with i32/i64 indices (index_native.c),
 * bitwise as the reference kernels; prepared and run by pool.c's
 * rfi_cpu_native_* (RF_E_UNSUPPORTED: not taken). */
typedef struct rfi_cpu_index rfi_cpu_index;
RFI_FUNC rf_status rfi_cpu_index_prepare(const rfi_node *n, rfi_cpu_index **out,
                                         size_t *workspace_bytes);
RFI_FUNC rf_status rfi_cpu_index_run(const rfi_cpu_index *k, const void *const *in, void *out,
                                     void *workspace);
/* "native-gather" or "native-scatter-add". */
RFI_FUNC const char *rfi_cpu_index_path(const rfi_cpu_index *k);
RFI_FUNC void rfi_cpu_index_free(rfi_cpu_index *k);

/* RNG (Philox, uniform or normal, f32/f64) in parallel, bitwise as the
 * reference kernel (rng_native.c); prepared and run by pool.c's
 * rfi_cpu_native_* (RF_E_UNSUPPORTED: not taken). `key` is the node's
 * operand: {seed, counter}. */
typedef struct rfi_cpu_rng rfi_cpu_rng;
RFI_FUNC rf_status rfi_cpu_rng_prepare(const rfi_node *n, rfi_cpu_rng **out);
RFI_FUNC rf_status rfi_cpu_rng_run(const rfi_cpu_rng *k, const void *key, void *out);
/* Elements [first, first + count) of k's draw under {seed, counter} into
 * out[0 .. count), on the calling thread (the run's chunks; tests reach
 * element indices past 2^32 with it). */
RFI_FUNC void rfi_cpu_rng_fill(const rfi_cpu_rng *k, uint64_t seed, uint64_t counter,
                               int64_t first, int64_t count, void *out);
/* "native-rng". */
RFI_FUNC const char *rfi_cpu_rng_path(const rfi_cpu_rng *k);
RFI_FUNC void rfi_cpu_rng_free(rfi_cpu_rng *k);

#endif
