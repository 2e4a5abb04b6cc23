/* threadpool.h: the runtime's thread pool, used by compiled modules (through
 * rf_module_services.parallel_for) and by the CPU backend's own packing loops.
 *
 * There is ONE pool per process, created lazily on first use (pthread_once)
 * and joined at exit: it is the runtime's documented process-wide cache of
 * worker threads, shared by every executable. Its size is RF_NUM_THREADS if
 * set to a positive integer, else the number of online CPUs; the calling
 * thread counts as one of them, so size - 1 workers are started, on the first
 * parallel_for that needs them. Once an OpenMP runtime is adopted
 * (rfi_threadpool_use_openmp), parallel_for runs on its threads instead,
 * with the same size and the same chunks.
 *
 * Calls never allocate. One parallel_for runs at a time: a call made while
 * the pool is busy (a nested call from inside a body, or another thread's
 * concurrent call) runs its whole range inline on the calling thread.
 */
#ifndef RF_RUNTIME_THREADPOOL_H
#define RF_RUNTIME_THREADPOOL_H

#include "../core/core.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

typedef void (*rfi_range_fn)(void *ctx, int64_t lo, int64_t hi);

/* OpenMP's entry points (libgomp's ABI), from the OpenMP runtime a math
 * library brought into the process. */
typedef struct rfi_openmp_api {
    void (*parallel)(void (*fn)(void *), void *data, unsigned num_threads,
                     unsigned flags); /* GOMP_parallel */
    int (*thread_num)(void);          /* omp_get_thread_num */
    int (*num_threads)(void);         /* omp_get_num_threads */
    void (*set_num_threads)(int);     /* omp_set_num_threads (may be NULL) */
    /* GOMP_SPINCOUNT as the loader set it: how many pauses an idle thread
     * spins before it sleeps; 0 when the user chose the wait policy (the
     * team is then never kept warm: rfi_threadpool_keep_team_warm) */
    long spin_count;
} rfi_openmp_api;

/* From now on, parallel_for runs on that OpenMP runtime's threads instead of
 * the pool's own workers (which are then never started, or go to sleep): one
 * set of threads serves both the generated loops and the library's calls, so
 * neither waits for the other's threads to wake or to go idle. Called once,
 * by the CPU backend's library loader; `api` must stay valid for the process. */
RFI_FUNC void rfi_threadpool_use_openmp(const rfi_openmp_api *api);

/* The number of threads a parallel_for may use (>= 1, the caller included;
 * 1 in a child process forked after the pool or OpenMP started threads: they
 * do not exist there, so its loops run inline and the OpenMP runtime is told
 * to use one thread). */
RFI_FUNC int rfi_threadpool_size(void);
/* How many forks this process descends through since threads started: 0 in
 * the process that started them. Library state made before a fork (oneDNN's
 * primitives, which fix their thread count) must not be used after one. */
RFI_FUNC unsigned rfi_threadpool_fork_generation(void);

/* A span of indices [front, back) (below 2^32) that threads take one at a
 * time, some from the front and some from the back, held in one word as
 * front << 32 | back: the next index taken from that end, or -1 when none is
 * left. The pool's chunks are dealt so (threadpool.c), and so are the CPU
 * backend's library calls at prepare (services.c). */
RFI_FUNC int64_t rfi_span_take(_Atomic uint64_t *span, bool from_front);

/* Starts fn(arg) on a new thread (pthread_create's result: 0 or an error
 * number) that begins on a CPU other than the caller's where the process may
 * use another, and runs fn with the affinity the caller had. A new thread
 * often starts on its creator's CPU and waits there for the scheduler to move
 * it: on 2 cores a helper started to work beside its creator began 2.4 ms
 * late, after the work was half done. fn starts with the affinity already
 * lifted (libgomp, when a thread loads it, counts the CPUs from that thread's
 * affinity), and stays on the CPU it began on: the scheduler keeps a running
 * thread where it is allowed to be. The caller's own affinity, or an
 * allocation failing, just starts the thread as pthread_create would. */
RFI_FUNC int rfi_thread_start_apart(pthread_t *tid, void *(*fn)(void *), void *arg);

/* While other processes keep OpenMP's threads off the cores, loops run on
 * their caller alone for a few milliseconds at a time (threadpool.c, "Late
 * teams"); this sends them to the team again at once (for tests of the team). */
RFI_FUNC void rfi_threadpool_forget_late_teams(void);

/* Keeps OpenMP's idle threads spinning through a stretch of work the caller
 * runs alone, so that the next parallel step finds them awake: a thread that
 * has slept (after GOMP_SPINCOUNT pauses, ~60 us here) takes 40-130 us to wake,
 * and an RNN's backward pass, 64 one-thread products in a row, paid that
 * before each of the weight gradients that followed. When the team last ran
 * more than half its spin ago, opens an empty region (~1 us), which restarts
 * its spin. Does nothing without an adopted OpenMP runtime whose spin the
 * loader set, with one thread, inside a region, or while loops run alone
 * ("Late teams" in threadpool.c). Callers call it only where the team has
 * work later in the same run (services.c). */
RFI_FUNC void rfi_threadpool_keep_team_warm(void);
/* How many empty regions keep_team_warm has opened in this process. */
RFI_FUNC int64_t rfi_threadpool_team_warmings(void);
/* Tells the pool that OpenMP's team just ran a region of someone else's (a
 * library call on several threads): its spin starts again. */
RFI_FUNC void rfi_threadpool_team_ran(void);

/* Runs body(ctx, lo, hi) over disjoint ranges covering [0, n) and returns when
 * all are done. The range is cut into at most 4 * size() chunks of at least
 * `grain` iterations (grain < 1 counts as 1), as equal as possible, which the
 * threads (the calling one too) run as they become free (threadpool.c says in
 * which order); where the chunks fall depends only on n, grain and size().
 * With one chunk (n < 2 * grain, a pool of one, or a busy pool) body(ctx, 0,
 * n) runs inline. n <= 0 does nothing. */
RFI_FUNC void rfi_parallel_for(int64_t n, int64_t grain, rfi_range_fn body, void *ctx);
/* The same, with each thread running its share of the chunks last first when
 * `backwards`. The chunks are the same either way. A caller that streams more
 * data than a core's cache holds, call after call, alternates the direction:
 * the lines the last call read are then the first read again, while they are
 * still in the cache. */
RFI_FUNC void rfi_parallel_for_ordered(int64_t n, int64_t grain, rfi_range_fn body, void *ctx,
                                       bool backwards);

#endif
