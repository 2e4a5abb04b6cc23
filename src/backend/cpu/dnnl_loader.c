/* dnnl_loader.c: loads oneDNN with dlopen on first use and resolves the
 * backend's table of its entry points (dnnl_loader.h says why at run time).
 *
 * Before the dlopen, GOMP_SPINCOUNT is set to 5000 unless the user set it or
 * OMP_WAIT_POLICY: libgomp, which oneDNN pulls in, reads it once when it
 * initialises (during this dlopen). After the load the runtime's thread pool
 * runs its loops on libgomp's threads (rfi_threadpool_use_openmp), so idle
 * threads should wait a little for the next region, not 300000 spins (the
 * default) nor none (passive: a futex wake-up per region). Measured on 2
 * cores against the pool's own threads with passive OpenMP: mlp, cnn and
 * resnet steps 10-25% faster; with a busy process on one core 1.5x slower,
 * where OMP_WAIT_POLICY=passive is the better choice. The setenv happens
 * once, inside pthread_once, on the thread that first asks for the library;
 * like any setenv it is not safe against another thread reading the
 * environment at that very moment, which is why it happens before any of the
 * backend's threads exist (the preload thread included).
 *
 * rfi_dnnl_preload starts the dlopen (3-4 ms: libdnnl, libgomp and
 * libstdc++, mostly the kernel faulting in relocated pages) on a background
 * thread, so that it overlaps a compile's tracing, memo, plan and module,
 * which need no library; the first rfi_dnnl_load then waits for it inside
 * pthread_once. It starts off the caller's CPU (rfi_thread_start_apart), so
 * the two overlap on 2 cores, and runs with the process's CPUs again before
 * the dlopen (preload_thread says why). The same thread then creates a few small primitives
 * (warm_up_primitives), whose one-time set-up inside oneDNN the compile's
 * own primitives would otherwise pay. rf_compile joins the thread before it
 * returns (rfi_dnnl_settle), so none of this runs while a program that just
 * failed to compile exits and oneDNN's statics are torn down. Starting it
 * earlier (at the first copy to the CPU device) was tried and taken out: a
 * program may exit while it runs, and oneDNN's destructors registered during
 * the load run before any exit handler registered ahead of them, so no
 * handler of ours can make exit wait for the thread.
 *
 * Deliberately not here: unloading (the handle is kept for the process's
 * life), other threading runtimes' settings.
 */
#include "dnnl_loader.h"

#include "../../runtime/threadpool.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

rfi_dnnl_api rfi_dnnl;

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static rfi_openmp_api openmp_api; /* filled once, handed to the thread pool */
static rf_status load_status = RF_E_UNSUPPORTED;
static char load_failure[256]; /* why loading failed, for every later caller */

/* POSIX: a dlsym result converts to a function pointer by copying it. */
static bool resolve(void *lib, const char *symbol, void *fn_slot, size_t size)
{
    void *p = dlsym(lib, symbol);
    if (!p)
        return false;
    memcpy(fn_slot, &p, size);
    return true;
}

static pthread_once_t env_once = PTHREAD_ONCE_INIT;

#define SPIN_COUNT "5000"
static long spin_count_set; /* SPIN_COUNT once set_spin_default set it, else 0 */

static void set_spin_default(void)
{
    if (!getenv("OMP_WAIT_POLICY") && !getenv("GOMP_SPINCOUNT") &&
        setenv("GOMP_SPINCOUNT", SPIN_COUNT, 0) == 0)
        spin_count_set = strtol(SPIN_COUNT, NULL, 10);
}

static void load_library(void)
{
    void *lib = dlopen(RFI_DNNL_LIBRARY, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *why = dlerror();
        snprintf(load_failure, sizeof load_failure, "cannot load %s (%s)", RFI_DNNL_LIBRARY,
                 why ? why : "unknown reason");
        return;
    }
    rfi_dnnl_api api;
    memset(&api, 0, sizeof api);
#define RFI_DNNL_RESOLVE(name)                                                              \
    if (!resolve(lib, "dnnl_" #name, &api.name, sizeof api.name)) {                         \
        snprintf(load_failure, sizeof load_failure, "%s has no symbol dnnl_" #name,        \
                 RFI_DNNL_LIBRARY);                                                         \
        dlclose(lib);                                                                       \
        return;                                                                             \
    }
    RFI_DNNL_FUNCTIONS(RFI_DNNL_RESOLVE)
#undef RFI_DNNL_RESOLVE
    /* dlsym on the handle searches oneDNN's dependencies too: its OpenMP. */
    resolve(lib, "omp_set_num_threads", &api.omp_set_num_threads, sizeof api.omp_set_num_threads);
    rfi_dnnl = api;
    openmp_api.set_num_threads = api.omp_set_num_threads;
    openmp_api.spin_count = spin_count_set;
    if (resolve(lib, "GOMP_parallel", &openmp_api.parallel, sizeof openmp_api.parallel) &&
        resolve(lib, "omp_get_thread_num", &openmp_api.thread_num,
                sizeof openmp_api.thread_num) &&
        resolve(lib, "omp_get_num_threads", &openmp_api.num_threads,
                sizeof openmp_api.num_threads))
        rfi_threadpool_use_openmp(&openmp_api);
    load_status = RF_OK;
}

int rfi_dnnl_isa_channel_block(unsigned isa)
{
    /* An ISA's value is a mask of feature bits that includes its
     * predecessors'. The AVX-512 ones (mic 0xf, core 0x27 and core's vnni,
     * bf16 and amx extensions) have mic's or core's own bit; AVX2, AVX, SSE
     * and avx2_vnni (0x407) have neither. */
    unsigned avx512_bits = (dnnl_cpu_isa_avx512_mic | dnnl_cpu_isa_avx512_core) &
                           ~(unsigned)dnnl_cpu_isa_avx2;
    return isa & avx512_bits ? 16 : 8;
}

int rfi_dnnl_channel_block(void)
{
    return rfi_dnnl_isa_channel_block((unsigned)rfi_dnnl.get_effective_cpu_isa());
}

/* oneDNN's AVX-512 ISAs: avx512_core (F, BW, VL, DQ) and avx512_mic (F, CD, ER,
 * PF); gcc's checks include the OS's support for the vector state. */
int rfi_dnnl_channel_block_guess(void)
{
#if defined(__x86_64__) || defined(__i386__)
    if (getenv("ONEDNN_MAX_CPU_ISA") || getenv("DNNL_MAX_CPU_ISA"))
        return 0;
    __builtin_cpu_init();
    bool core = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                __builtin_cpu_supports("avx512dq");
    bool mic = __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512er") &&
               __builtin_cpu_supports("avx512pf");
    return __builtin_cpu_supports("avx512f") && (core || mic) ? 16 : 8;
#else
    return 0;
#endif
}

/* Creates primitive pd describes and drops both (warm_up_primitives). */
static void create_and_drop(dnnl_primitive_desc_t pd)
{
    dnnl_primitive_t p;
    if (rfi_dnnl.primitive_create(&p, pd) == dnnl_success)
        rfi_dnnl.primitive_destroy(p);
    rfi_dnnl.primitive_desc_destroy(pd);
}

/* Creates and drops one small convolution, product and reorder: oneDNN's
 * first primitive of each kind pays for set-up of its own (0.2-0.8 ms in
 * all, measured in a fresh process), which this moves off the compile's
 * critical path onto the preload thread. */
static void warm_up_primitives(void)
{
    dnnl_engine_t engine;
    if (rfi_dnnl.engine_create(&engine, dnnl_cpu, 0) != dnnl_success)
        return;
    dnnl_memory_desc_t src, wei, dst, blocked;
    dnnl_dims_t image = {2, 16, 8, 8}, kernel = {16, 16, 3, 3}, ones = {1, 1}, none = {0, 0};
    dnnl_convolution_desc_t conv;
    dnnl_primitive_desc_t pd;
    if (rfi_dnnl.memory_desc_init_by_tag(&src, 4, image, dnnl_f32, dnnl_format_tag_any) ==
            dnnl_success &&
        rfi_dnnl.memory_desc_init_by_tag(&wei, 4, kernel, dnnl_f32, dnnl_format_tag_any) ==
            dnnl_success &&
        rfi_dnnl.dilated_convolution_forward_desc_init(
            &conv, dnnl_forward_training, dnnl_convolution_direct, &src, &wei, NULL, &src, ones,
            none, ones, ones) == dnnl_success &&
        rfi_dnnl.primitive_desc_create(&pd, &conv, NULL, engine, NULL) == dnnl_success)
        create_and_drop(pd);
    dnnl_dims_t a = {16, 32}, b = {32, 8}, c = {16, 8};
    dnnl_matmul_desc_t matmul;
    if (rfi_dnnl.memory_desc_init_by_tag(&src, 2, a, dnnl_f32, dnnl_ab) == dnnl_success &&
        rfi_dnnl.memory_desc_init_by_tag(&wei, 2, b, dnnl_f32, dnnl_ab) == dnnl_success &&
        rfi_dnnl.memory_desc_init_by_tag(&dst, 2, c, dnnl_f32, dnnl_ab) == dnnl_success &&
        rfi_dnnl.matmul_desc_init(&matmul, &src, &wei, NULL, &dst) == dnnl_success &&
        rfi_dnnl.primitive_desc_create(&pd, &matmul, NULL, engine, NULL) == dnnl_success)
        create_and_drop(pd);
    if (rfi_dnnl.memory_desc_init_by_tag(&src, 4, image, dnnl_f32, dnnl_nchw) == dnnl_success &&
        rfi_dnnl.memory_desc_init_by_tag(&blocked, 4, image, dnnl_f32,
                                         rfi_dnnl_channel_block() == 16 ? dnnl_nChw16c
                                                                        : dnnl_nChw8c) ==
            dnnl_success &&
        rfi_dnnl.reorder_primitive_desc_create(&pd, &src, engine, &blocked, engine, NULL) ==
            dnnl_success)
        create_and_drop(pd);
    rfi_dnnl.engine_destroy(engine);
}

/* The preload thread, until someone has joined it. rfi_dnnl_settle holds the
 * lock while it joins the thread (milliseconds), so the lock is taken around
 * every fork (watch_forks): a child forked meanwhile would otherwise inherit
 * it held by a thread it does not have and wait for ever at its first
 * compile. The child has no preload thread either (only the forking thread
 * is forked): joining the parent's would never return, so there is none to
 * join. The joining thread takes no other lock of ours while it holds this
 * one, and the preload thread none at all, so a fork waits at most for the
 * join. */
static pthread_mutex_t preload_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_t preload_tid;
static bool preload_joinable;
static pthread_once_t preload_fork_once = PTHREAD_ONCE_INIT;

static void preload_before_fork(void) { pthread_mutex_lock(&preload_lock); }
static void preload_after_fork_in_parent(void) { pthread_mutex_unlock(&preload_lock); }

static void preload_after_fork_in_child(void)
{
    preload_joinable = false;
    pthread_mutex_unlock(&preload_lock);
}

static void watch_forks(void)
{
    pthread_atfork(preload_before_fork, preload_after_fork_in_parent,
                   preload_after_fork_in_child);
}
/* The loader thread. It starts off the caller's CPU (rfi_thread_start_apart):
 * a new thread often starts on its creator's CPU, and on 2 cores about one
 * warm ResNet compile in three then ran its own 8 ms of work and the 4 ms
 * load on one core (11-13 ms) while the other was idle (8-9 ms when they ran
 * apart: sched_getcpu() in both threads). It runs with the process's CPUs
 * again before it loads anything: libgomp, loaded with oneDNN, counts the
 * CPUs it may use from the loading thread's affinity. Counted 1 of 2, it
 * took its two threads for oversubscription and slept after 100 spins at
 * every wait (one epoch of the Fashion-MNIST CNN: 35000-36600 context
 * switches and 5.3-5.4 s, against 4000-4700 and 4.9-5.3 s once it counts
 * both). */
static void *preload_thread(void *arg)
{
    (void)arg;
    pthread_once(&load_once, load_library);
    if (load_status == RF_OK)
        warm_up_primitives();
    return NULL;
}

/* The loader thread; when none can start, the first rfi_dnnl_load loads the
 * library itself. */
static void start_preload(void)
{
    pthread_mutex_lock(&preload_lock);
    preload_joinable = rfi_thread_start_apart(&preload_tid, preload_thread, NULL) == 0;
    pthread_mutex_unlock(&preload_lock);
}

/* Joins the thread, not just waits for its work: until it has exited, its
 * own teardown (thread-local destructors, libgomp's) still runs, and a
 * caller's exit must not overtake that either (a sanitizer build crashed in
 * exit when the thread only signalled that it was done). The thread takes no
 * lock of ours, so joining under the lock is safe. */
void rfi_dnnl_settle(void)
{
    pthread_once(&preload_fork_once, watch_forks);
    pthread_mutex_lock(&preload_lock);
    if (preload_joinable) {
        pthread_join(preload_tid, NULL);
        preload_joinable = false;
    }
    pthread_mutex_unlock(&preload_lock);
}

void rfi_dnnl_preload(void)
{
    static pthread_once_t started = PTHREAD_ONCE_INIT;
    pthread_once(&env_once, set_spin_default); /* before the thread exists */
    pthread_once(&preload_fork_once, watch_forks);
    pthread_once(&started, start_preload);
}

rf_status rfi_dnnl_load(void)
{
    pthread_once(&env_once, set_spin_default);
    pthread_once(&load_once, load_library);
    if (load_status != RF_OK)
        return rfi_error(RF_E_UNSUPPORTED,
                         "cpu: oneDNN unavailable: %s; matmul and convolution run on the "
                         "reference kernels (install libdnnl2)",
                         load_failure);
    return RF_OK;
}
