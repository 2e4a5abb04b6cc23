/* dnnl_loader.h: oneDNN, loaded at run time (dlopen of libdnnl.so.2) on the
 * first use, so that libreflux links neither oneDNN nor its OpenMP runtime.
 *
 * Why at run time: Debian's oneDNN runs on OpenMP (libgomp), whose idle
 * workers spin for a long time by default. libgomp reads its settings once,
 * when it initialises, which for a linked library is at program start,
 * before any code of ours runs. Loading oneDNN ourselves lets the loader
 * choose a short spin first (GOMP_SPINCOUNT, only if the user has set
 * neither it nor OMP_WAIT_POLICY) and hand libgomp's threads to the
 * runtime's thread pool, so that one set of threads runs both the generated
 * loops and the library calls (dnnl_loader.c has the measurements).
 *
 * The table of entry points is filled once (pthread_once) and never changes
 * afterwards: the backend's documented process-wide cache of the library.
 * Only the functions the CPU backend calls are resolved. Code calls them as
 * rfi_dnnl.<name without the dnnl_ prefix> after rfi_dnnl_load() returned
 * RF_OK (an engine can only exist then).
 *
 * Deliberately not here: choosing a oneDNN version other than 2.x (the ABI of
 * the header at build time), unloading the library.
 */
#ifndef RF_BACKEND_CPU_DNNL_LOADER_H
#define RF_BACKEND_CPU_DNNL_LOADER_H

#include <oneapi/dnnl/dnnl.h>

#include "../../core/core.h"

#ifndef RFI_DNNL_LIBRARY /* overridable at build time, e.g. to test a missing library */
#define RFI_DNNL_LIBRARY "libdnnl.so.2"
#endif

/* The oneDNN functions the backend calls. Each entry's type is the header's
 * own declaration (__typeof__), so the table cannot drift from the ABI. */
#define RFI_DNNL_FUNCTIONS(X)                                                              \
    X(engine_create)                                                                       \
    X(engine_destroy)                                                                      \
    X(stream_create)                                                                       \
    X(stream_destroy)                                                                      \
    X(stream_wait)                                                                         \
    X(memory_desc_init_by_strides)                                                         \
    X(memory_desc_get_size)                                                                \
    X(memory_desc_init_by_tag)                                                             \
    X(memory_desc_equal)                                                                   \
    X(memory_create)                                                                       \
    X(memory_destroy)                                                                      \
    X(memory_set_data_handle)                                                              \
    X(matmul_desc_init)                                                                    \
    X(dilated_convolution_forward_desc_init)                                               \
    X(dilated_convolution_backward_data_desc_init)                                         \
    X(dilated_convolution_backward_weights_desc_init)                                      \
    X(primitive_attr_create)                                                               \
    X(primitive_attr_destroy)                                                              \
    X(primitive_attr_set_scratchpad_mode)                                                  \
    X(primitive_attr_set_post_ops)                                                         \
    X(post_ops_create)                                                                     \
    X(post_ops_destroy)                                                                    \
    X(post_ops_append_eltwise)                                                             \
    X(post_ops_append_binary)                                                              \
    X(post_ops_append_sum)                                                                 \
    X(primitive_desc_create)                                                               \
    X(reorder_primitive_desc_create)                                                       \
    X(primitive_desc_destroy)                                                              \
    X(primitive_desc_query)                                                                \
    X(primitive_desc_query_md)                                                             \
    X(primitive_create)                                                                    \
    X(primitive_destroy)                                                                   \
    X(primitive_execute)                                                                   \
    X(get_effective_cpu_isa)

#define RFI_DNNL_MEMBER(name) __typeof__(dnnl_##name) *name;
typedef struct rfi_dnnl_api {
    RFI_DNNL_FUNCTIONS(RFI_DNNL_MEMBER)
    /* OpenMP's, from the runtime oneDNN loaded; NULL if it has none. */
    void (*omp_set_num_threads)(int);
} rfi_dnnl_api;

/* The entry points; valid once rfi_dnnl_load() returned RF_OK. */
extern rfi_dnnl_api rfi_dnnl;

/* Loads oneDNN once per process (later calls return the first result). On
 * failure returns RF_E_UNSUPPORTED with rfi_error naming the library and the
 * reason (missing file, missing symbol); the backend then runs matmul and
 * convolution on the reference kernels. */
RFI_FUNC rf_status rfi_dnnl_load(void);
/* Starts loading oneDNN on a background thread, once per process (nothing
 * when it is loaded or loading); rfi_dnnl_load waits for the load. The
 * thread then creates a few small primitives to warm oneDNN up. */
RFI_FUNC void rfi_dnnl_preload(void);
/* The channels per block of the blocked activation layouts oneDNN's
 * convolution kernels run on (nChw8c or nChw16c): 16 where its ISA has
 * AVX-512's 16-float vectors, else 8. Valid once rfi_dnnl_load() returned
 * RF_OK. */
RFI_FUNC int rfi_dnnl_channel_block(void);
/* The same told from a dnnl_cpu_isa_t value (rfi_dnnl_channel_block's rule). */
RFI_FUNC int rfi_dnnl_isa_channel_block(unsigned isa);
/* What rfi_dnnl_channel_block will say, told from the CPU's features without
 * loading the library; 0 when they cannot tell (ONEDNN_MAX_CPU_ISA or
 * DNNL_MAX_CPU_ISA in the environment may hold oneDNN below the CPU). */
RFI_FUNC int rfi_dnnl_channel_block_guess(void);
/* Joins the background thread rfi_dnnl_preload started, if any and not yet
 * joined (returns at once otherwise). */
RFI_FUNC void rfi_dnnl_settle(void);

#endif
