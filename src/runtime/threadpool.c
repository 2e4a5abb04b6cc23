/* threadpool.c: the runtime's process-wide thread pool (see threadpool.h).
 *
 * A job is published by writing its fields and then one atomic word, `claim`
 * = generation << 32 | chunks not yet claimed. Threads (workers and the
 * caller) claim chunks by compare-and-swap on that word, so a thread that
 * wakes late for an old generation can never take a chunk of a newer job; a
 * successful claim also proves the job is still live (its submitter waits
 * for every chunk), so its fields are stable while the chunk runs. The
 * submitter counts finished chunks in `done` and returns when all are done.
 *
 * Idle workers spin briefly (so back-to-back loops of one step do not pay a
 * futex wake-up) and then sleep on a condition variable; the generation is
 * changed under the mutex, so no wake-up is lost. These workers serve only
 * while no OpenMP runtime is adopted (below).
 *
 * When an OpenMP runtime has been adopted (the CPU backend's oneDNN brings
 * libgomp), parallel_for opens a GOMP_parallel region of at most `size`
 * threads instead and deals it the chunks (chunk_deal below); the pool's
 * workers are then never started (or, started earlier, sleep for good).
 * OpenMP's idle threads spin briefly between regions (the loader sets
 * GOMP_SPINCOUNT), which plays the role of the spin above. While other
 * processes keep OpenMP's threads off the cores, loops run on their caller
 * alone for a while ("Late teams" below). Through a stretch of library calls
 * the caller runs alone, with work for the team later in the same run, the
 * team is kept spinning ("Keeping the team warm" below).
 *
 * A range is cut into up to CHUNKS_PER_THREAD chunks per thread, so that on
 * a machine shared with other jobs a thread that is descheduled, or slowed
 * by a busy neighbour, runs fewer chunks instead of holding up the whole
 * loop with a fixed share (with a busy-loop process beside it, a ResNet step
 * ran 8% faster than with one chunk per thread; as fast without one). Where
 * the chunks fall depends only on n, grain and the pool's size, never on
 * which thread runs them, so results do not change from run to run.
 *
 * A child forked after threads started has none of them (pthread_atfork
 * counts the forks): its loops run inline and OpenMP gets one thread. At exit
 * the workers are told to stop, but the pool is kept: another thread may
 * still be in a parallel_for.
 *
 * Deliberately no priorities, per-call allocation, or nested parallelism: a
 * call made while the pool is busy, or from inside an OpenMP region, runs
 * inline.
 */
#include "threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define MAX_THREADS 256
#define SPIN_NS 50000 /* how long an idle worker spins before sleeping */
#define CHUNKS_PER_THREAD 4
#define MAX_DEAL_BLOCKS 64 /* threads that own a block of an OpenMP job's chunks */

typedef struct pool {
    int size;      /* threads a job may use, the caller included */
    int n_workers; /* workers actually started (size - 1 unless creation failed) */
    pthread_t workers[MAX_THREADS];

    pthread_mutex_t submit; /* held by the one running parallel_for (trylock) */
    pthread_mutex_t lock;   /* guards sleepers, stop and generation changes */
    pthread_cond_t wake;
    int sleepers;
    atomic_bool stop;

    _Atomic uint64_t claim; /* generation << 32 | chunks left to claim */
    atomic_llong done;      /* chunks finished in the current job */
    uint32_t generation;    /* of the current job (submitter only) */

    /* The current job: written before `claim` is published. */
    rfi_range_fn body;
    void *ctx;
    int64_t n, chunks;
    bool backwards; /* chunks claimed from the last */
} pool;

static pool *the_pool;
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;
static int configured_size; /* RF_NUM_THREADS or the CPU count, read once */
static pthread_once_t size_once = PTHREAD_ONCE_INIT;
static _Atomic(const rfi_openmp_api *) openmp; /* adopted OpenMP runtime, or NULL */
static atomic_uint forked; /* forks since threads started (0: the original process) */
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

/* In a forked child only the forking thread exists: the pool's workers and
 * OpenMP's are gone (waiting for them would hang), so everything runs on it. */
static void after_fork_in_child(void)
{
    atomic_fetch_add(&forked, 1);
    const rfi_openmp_api *api = atomic_load_explicit(&openmp, memory_order_acquire);
    if (api && api->set_num_threads)
        api->set_num_threads(1);
}

static void watch_forks(void) { pthread_atfork(NULL, NULL, after_fork_in_child); }

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static uint32_t generation_of(uint64_t claim) { return (uint32_t)(claim >> 32); }

/* Chunk idx of n iterations split into `chunks` nearly equal ranges. */
static void chunk_range(int64_t n, int64_t chunks, int64_t idx, int64_t *lo, int64_t *hi)
{
    int64_t base = n / chunks, extra = n % chunks;
    *lo = idx * base + (idx < extra ? idx : extra);
    *hi = *lo + base + (idx < extra ? 1 : 0);
}

/* Claims and runs chunks of generation gen until none is left. */
static void run_chunks(pool *p, uint32_t gen)
{
    uint64_t c = atomic_load_explicit(&p->claim, memory_order_acquire);
    while (generation_of(c) == gen && (uint32_t)c != 0) {
        if (!atomic_compare_exchange_weak_explicit(&p->claim, &c, c - 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue; /* c was reloaded */
        int64_t left = (int64_t)(uint32_t)c, lo, hi;
        chunk_range(p->n, p->chunks, p->backwards ? left - 1 : p->chunks - left, &lo, &hi);
        p->body(p->ctx, lo, hi);
        atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
        c = atomic_load_explicit(&p->claim, memory_order_acquire);
    }
}

/* Waits until the generation differs from seen (or stop); returns it. */
static uint32_t wait_for_job(pool *p, uint32_t seen)
{
    int64_t start = now_ns();
    for (int spins = 0;; spins++) {
        uint64_t c = atomic_load_explicit(&p->claim, memory_order_acquire);
        if (generation_of(c) != seen || atomic_load(&p->stop))
            return generation_of(c);
        cpu_relax();
        if ((spins & 63) == 63 && now_ns() - start > SPIN_NS)
            break;
    }
    pthread_mutex_lock(&p->lock);
    uint32_t gen;
    while ((gen = generation_of(atomic_load(&p->claim))) == seen && !atomic_load(&p->stop)) {
        p->sleepers++;
        pthread_cond_wait(&p->wake, &p->lock);
        p->sleepers--;
    }
    pthread_mutex_unlock(&p->lock);
    return gen;
}

static void *worker_main(void *arg)
{
    pool *p = arg;
    uint32_t seen = 0;
    for (;;) {
        seen = wait_for_job(p, seen);
        if (atomic_load(&p->stop))
            return NULL;
        run_chunks(p, seen);
    }
}

static int size_from_env(void)
{
    const char *env = getenv("RF_NUM_THREADS");
    if (env && *env) {
        char *end;
        long v = strtol(env, &end, 10);
        if (*end == '\0' && v > 0)
            return v > MAX_THREADS ? MAX_THREADS : (int)v;
    }
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    if (cpus < 1)
        return 1;
    return cpus > MAX_THREADS ? MAX_THREADS : (int)cpus;
}

static void read_size(void) { configured_size = size_from_env(); }

/* At exit: the workers stop waiting. The pool is neither freed nor its locks
 * destroyed, and no worker is joined: another thread may still be inside
 * parallel_for while exit runs (the process ends with it anyway). */
static void pool_shutdown(void)
{
    pool *p = the_pool;
    if (!p || atomic_load(&forked))
        return;
    pthread_mutex_lock(&p->lock);
    atomic_store(&p->stop, true);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
}

/* Creates the pool; on any failure the pool has fewer workers (or is NULL:
 * every call then runs inline). */
static void pool_init(void)
{
    pool *p = rfi_calloc(1, sizeof *p);
    if (!p)
        return;
    p->size = rfi_threadpool_size();
    atomic_init(&p->claim, 0);
    atomic_init(&p->done, 0);
    atomic_init(&p->stop, false);
    pthread_mutex_init(&p->submit, NULL);
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->wake, NULL);
    for (int i = 0; i < p->size - 1; i++) {
        if (pthread_create(&p->workers[i], NULL, worker_main, p) != 0)
            break;
        p->n_workers++;
    }
    p->size = p->n_workers + 1;
    the_pool = p;
    atexit(pool_shutdown);
}

static pool *get_pool(void)
{
    pthread_once(&atfork_once, watch_forks);
    pthread_once(&pool_once, pool_init);
    return the_pool;
}

int rfi_threadpool_size(void)
{
    pthread_once(&size_once, read_size);
    return atomic_load(&forked) ? 1 : configured_size;
}

unsigned rfi_threadpool_fork_generation(void) { return atomic_load(&forked); }

void rfi_threadpool_use_openmp(const rfi_openmp_api *api)
{
    pthread_once(&atfork_once, watch_forks);
    atomic_store_explicit(&openmp, api, memory_order_release);
}

/* A job's chunks, dealt out in blocks of consecutive chunks, one block per
 * thread: block b holds chunks [front, back) of its `span` word (front << 32
 * | back). Its owner takes chunks from the front (the back when the job runs
 * backwards); a thread whose own block is empty takes them from the other
 * end of the others'. Threads of equal speed then
 * run the same chunks in every loop of a step and find what they wrote a loop
 * earlier in their own core's caches (with every chunk claimed in order by
 * whichever thread came first, a ResNet step ran ~10% slower), and a slow one
 * is relieved of its last chunks. Each span word has a cache line of its own:
 * side by side, every claim by one thread took the line from the other
 * (batch-1 inference of the mlp, three short loops, spent 7% of its time in
 * those claims). */
typedef struct deal_span {
    _Alignas(64) _Atomic uint64_t word;
} deal_span;

typedef struct chunk_deal {
    int64_t n, chunks;
    int blocks;
    bool backwards;
    deal_span span[MAX_DEAL_BLOCKS];
} chunk_deal;

static void deal_init(chunk_deal *d, int64_t n, int64_t chunks, int blocks, bool backwards)
{
    d->n = n;
    d->chunks = chunks;
    d->blocks = blocks;
    d->backwards = backwards;
    for (int b = 0; b < blocks; b++) {
        uint64_t front = (uint64_t)(chunks * b / blocks);
        uint64_t back = (uint64_t)(chunks * (b + 1) / blocks);
        atomic_init(&d->span[b].word, front << 32 | back);
    }
}

int64_t rfi_span_take(_Atomic uint64_t *span, bool from_front)
{
    uint64_t w = atomic_load_explicit(span, memory_order_acquire);
    for (;;) {
        uint64_t front = w >> 32, back = w & 0xffffffffu;
        if (front >= back)
            return -1;
        uint64_t next = from_front ? (front + 1) << 32 | back : front << 32 | (back - 1);
        if (atomic_compare_exchange_weak_explicit(span, &w, next, memory_order_acq_rel,
                                                  memory_order_acquire))
            return (int64_t)(from_front ? front : back - 1);
    }
}

/* Takes one chunk of block b, from its front or its back; -1 when it is empty. */
static int64_t deal_take(chunk_deal *d, int b, bool from_front)
{
    return rfi_span_take(&d->span[b].word, from_front);
}

/* Runs chunks of d as thread `self` until none is left anywhere. */
static void deal_run(chunk_deal *d, int self, rfi_range_fn body, void *ctx)
{
    for (int k = 0; k < d->blocks; k++) {
        int b = (self + k) % d->blocks;
        bool from_front = (k == 0) != d->backwards;
        for (int64_t idx; (idx = deal_take(d, b, from_front)) >= 0;) {
            int64_t lo, hi;
            chunk_range(d->n, d->chunks, idx, &lo, &hi);
            body(ctx, lo, hi);
        }
    }
}

typedef struct openmp_job {
    const rfi_openmp_api *api;
    rfi_range_fn body;
    void *ctx;
    int64_t caller_done_ns; /* when thread 0 found no chunk left */
    chunk_deal deal;
} openmp_job;

static void openmp_body(void *arg)
{
    openmp_job *job = arg;
    int self = job->api->thread_num();
    deal_run(&job->deal, self % job->deal.blocks, job->body, job->ctx);
    if (self == 0)
        job->caller_done_ns = now_ns();
}

/* ---- Threads started apart ------------------------------------------------ */

typedef struct apart_start {
    void *(*fn)(void *);
    void *arg;
    cpu_set_t allowed; /* the creator's affinity, given back before fn runs */
} apart_start;

static void *run_apart(void *p)
{
    apart_start a = *(apart_start *)p;
    rfi_free(p);
    pthread_setaffinity_np(pthread_self(), sizeof a.allowed, &a.allowed);
    return a.fn(a.arg);
}

int rfi_thread_start_apart(pthread_t *tid, void *(*fn)(void *), void *arg)
{
    apart_start *a = rfi_malloc(sizeof *a);
    pthread_attr_t attr;
    int self = sched_getcpu();
    if (!a || self < 0 || self >= CPU_SETSIZE || pthread_attr_init(&attr) != 0) {
        rfi_free(a);
        return pthread_create(tid, NULL, fn, arg);
    }
    a->fn = fn;
    a->arg = arg;
    cpu_set_t others;
    int rc = -1;
    if (sched_getaffinity(0, sizeof a->allowed, &a->allowed) == 0) {
        others = a->allowed;
        CPU_CLR(self, &others);
        if (CPU_COUNT(&others) > 0 &&
            pthread_attr_setaffinity_np(&attr, sizeof others, &others) == 0)
            rc = pthread_create(tid, &attr, run_apart, a);
    }
    pthread_attr_destroy(&attr);
    if (rc == 0)
        return 0;
    rfi_free(a); /* not started apart (one CPU, or refused): started as it is */
    return pthread_create(tid, NULL, fn, arg);
}

/* ---- Late teams ------------------------------------------------------------
 * An OpenMP region returns only when every thread of its team has arrived, so
 * while other processes keep the team's threads off the cores, each loop waits
 * for them a scheduler time slice after the caller has run every chunk itself
 * (with two busy processes beside it, batch-1 inference of the mlp took 690 us
 * instead of 21 in most runs; PyTorch's 95). Two regions in a row that kept
 * their caller waiting past LATE_TEAM_NS after the work was done send the
 * loops of the next SOLO_NS to the caller alone, the same chunks one after the
 * other (so the same results); then the team is tried again. One late region
 * is not enough: a team woken from sleep can be that late once on a quiet
 * machine (a virtual CPU's wake-up, 100-900 us, a few times a second here),
 * and going alone then would only let it fall asleep again. */
#define LATE_TEAM_NS 100000
#define SOLO_NS 5000000
static _Atomic int64_t solo_until_ns; /* loops run on their caller until then */
static atomic_int late_in_a_row;      /* regions that kept their caller waiting */
static _Atomic int64_t team_seen_ns;  /* when OpenMP's team last ended a region */

/* After a region: whether its team kept the caller waiting past LATE_TEAM_NS
 * once the work was done, and what follows from that. */
static void note_team_lateness(int64_t caller_done_ns)
{
    int64_t end = now_ns();
    atomic_store_explicit(&team_seen_ns, end, memory_order_relaxed);
    if (end - caller_done_ns <= LATE_TEAM_NS)
        atomic_store_explicit(&late_in_a_row, 0, memory_order_relaxed);
    else if (atomic_fetch_add_explicit(&late_in_a_row, 1, memory_order_relaxed) >= 1) {
        atomic_store_explicit(&late_in_a_row, 0, memory_order_relaxed);
        atomic_store_explicit(&solo_until_ns, end + SOLO_NS, memory_order_relaxed);
    }
}

void rfi_threadpool_forget_late_teams(void)
{
    atomic_store(&late_in_a_row, 0);
    atomic_store(&solo_until_ns, 0);
}

static _Thread_local bool running_alone; /* in run_chunks_alone: a call is nested */

static void run_chunks_alone(int64_t n, int64_t chunks, rfi_range_fn body, void *ctx,
                             bool backwards)
{
    running_alone = true;
    for (int64_t k = 0; k < chunks; k++) {
        int64_t lo, hi;
        chunk_range(n, chunks, backwards ? chunks - 1 - k : k, &lo, &hi);
        body(ctx, lo, hi);
    }
    running_alone = false;
}

/* ---- Keeping the team warm -------------------------------------------------
 * An idle OpenMP thread spins spin_count pauses and then sleeps. How long a
 * pause takes differs between processors (about 10 ns here, 40 on some
 * Skylakes), so the pool times a thousand of them once, on the first call
 * that needs the figure. */
static _Atomic int64_t team_spin_ns; /* 0: not measured yet */
static _Atomic int64_t warmings;     /* empty regions opened (a counter for tests) */

static int64_t measure_spin_ns(long spin_count)
{
    int64_t start = now_ns();
    for (int i = 0; i < 1000; i++)
        cpu_relax();
    int64_t per_1000 = now_ns() - start;
    return per_1000 * spin_count / 1000;
}

static void nothing(void *arg) { (void)arg; }

void rfi_threadpool_team_ran(void)
{
    atomic_store_explicit(&team_seen_ns, now_ns(), memory_order_relaxed);
}

void rfi_threadpool_keep_team_warm(void)
{
    const rfi_openmp_api *api = atomic_load_explicit(&openmp, memory_order_acquire);
    int threads = rfi_threadpool_size();
    if (!api || api->spin_count <= 0 || threads <= 1 || running_alone || api->num_threads() > 1)
        return;
    int64_t now = now_ns();
    if (now < atomic_load_explicit(&solo_until_ns, memory_order_relaxed))
        return;
    int64_t spin = atomic_load_explicit(&team_spin_ns, memory_order_relaxed);
    if (spin == 0) {
        spin = measure_spin_ns(api->spin_count);
        atomic_store_explicit(&team_spin_ns, spin > 0 ? spin : 1, memory_order_relaxed);
    }
    if (now - atomic_load_explicit(&team_seen_ns, memory_order_relaxed) < spin / 2)
        return;
    int team = threads < MAX_DEAL_BLOCKS ? threads : MAX_DEAL_BLOCKS;
    api->parallel(nothing, NULL, (unsigned)team, 0);
    atomic_fetch_add_explicit(&warmings, 1, memory_order_relaxed);
    note_team_lateness(now);
}

int64_t rfi_threadpool_team_warmings(void) { return atomic_load(&warmings); }

void rfi_parallel_for(int64_t n, int64_t grain, rfi_range_fn body, void *ctx)
{
    rfi_parallel_for_ordered(n, grain, body, ctx, false);
}

void rfi_parallel_for_ordered(int64_t n, int64_t grain, rfi_range_fn body, void *ctx,
                              bool backwards)
{
    if (n <= 0)
        return;
    if (grain < 1)
        grain = 1;
    int threads = rfi_threadpool_size();
    int64_t chunks = n / grain;
    if (chunks > (int64_t)threads * CHUNKS_PER_THREAD)
        chunks = (int64_t)threads * CHUNKS_PER_THREAD;
    if (threads <= 1 || chunks <= 1) {
        body(ctx, 0, n);
        return;
    }
    const rfi_openmp_api *api = atomic_load_explicit(&openmp, memory_order_acquire);
    if ((api && api->num_threads() > 1) || running_alone) { /* nested, so inline */
        body(ctx, 0, n);
        return;
    }
    if (api) {
        int team = chunks < threads ? (int)chunks : threads;
        if (team > MAX_DEAL_BLOCKS)
            team = MAX_DEAL_BLOCKS;
        if (now_ns() < atomic_load_explicit(&solo_until_ns, memory_order_relaxed)) {
            run_chunks_alone(n, chunks, body, ctx, backwards);
            return;
        }
        openmp_job job = {.api = api, .body = body, .ctx = ctx};
        deal_init(&job.deal, n, chunks, team, backwards);
        api->parallel(openmp_body, &job, (unsigned)team, 0);
        note_team_lateness(job.caller_done_ns);
        return;
    }
    pool *p = get_pool();
    if (p && chunks > (int64_t)p->size * CHUNKS_PER_THREAD)
        chunks = (int64_t)p->size * CHUNKS_PER_THREAD;
    if (!p || p->size <= 1 || chunks <= 1 || pthread_mutex_trylock(&p->submit) != 0) {
        body(ctx, 0, n);
        return;
    }
    p->body = body;
    p->ctx = ctx;
    p->n = n;
    p->chunks = chunks;
    p->backwards = backwards;
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    uint32_t gen = ++p->generation;
    if (gen == 0) /* workers start having seen generation 0 */
        gen = ++p->generation;
    pthread_mutex_lock(&p->lock);
    atomic_store_explicit(&p->claim, (uint64_t)gen << 32 | (uint64_t)chunks,
                          memory_order_release);
    if (p->sleepers > 0)
        pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);

    run_chunks(p, gen);
    for (int spins = 0; atomic_load_explicit(&p->done, memory_order_acquire) < chunks; spins++) {
        cpu_relax();
        if (spins > 4096)
            sched_yield();
    }
    pthread_mutex_unlock(&p->submit);
}
