/* block_cache.c: array data blocks kept after their array is freed, for the
 * next array of the same size (the documented cache of array memory).
 *
 * glibc serves a block above its mmap threshold (128 KiB at first) with new
 * pages from the kernel and unmaps them when the block is freed, and a block
 * below it is trimmed from the heap once enough memory is free at its top. So
 * a program that returns new output arrays on every run, or a loader that
 * makes a new batch array every step, took a page fault for each 4 KiB of
 * each such array, every time: the attention pattern of bench_patterns
 * (three 512 KiB gradients a run) ran in 1.9 ms alone and in 1.3 ms after
 * patterns whose larger frees had raised glibc's thresholds.
 *
 * Only the arrays that loops make anew at every pass are kept: a run's outputs,
 * a loader's batches, copies made by rf_array_to and rf_array_rows
 * (rfi_array_alloc_recycled). Arrays made once, such as the host arrays a
 * model is built from, go back to malloc and leave the process's memory (kept,
 * the ffn benchmark's eight 1 MiB host weights raised its peak RSS from 53 to
 * 60 MB). A freed block of BLOCK_CACHE_MIN_BYTES or more of such an array is
 * kept when a block of its size was freed before, among the last RECENT_SIZES
 * such frees (a size that recurs), up to a budget (RF_ARRAY_CACHE_MB in the
 * environment when the first block is freed, else DEFAULT_BUDGET_MB; 0 keeps
 * nothing): the oldest kept blocks are freed to make room. An allocation takes
 * the most recently kept block of its rounded size. rf_array_cache_clear()
 * frees them all. Under AddressSanitizer a kept block is poisoned, so a use
 * after rf_array_free is still reported.
 *
 * Every fork takes the cache's mutex (pthread_atfork), so a child never
 * inherits it held by a thread that the fork left behind.
 */
#include "runtime.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SANITIZE_ADDRESS__)
#define BLOCK_CACHE_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define BLOCK_CACHE_ASAN 1
#endif
#endif
#ifdef BLOCK_CACHE_ASAN
#include <sanitizer/asan_interface.h>
#define POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define POISON(p, n) ((void)(p), (void)(n))
#define UNPOISON(p, n) ((void)(p), (void)(n))
#endif

#define BLOCK_CACHE_MIN_BYTES (64 * 1024)
#define BLOCK_CACHE_SLOTS 64
#define RECENT_SIZES 64
#define DEFAULT_BUDGET_MB 64

typedef struct kept_block {
    void *data;
    size_t bytes;   /* rounded to RFI_DATA_ALIGN, as allocated */
    uint64_t stamp; /* when it was kept: the oldest goes first */
} kept_block;

static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;
static kept_block kept[BLOCK_CACHE_SLOTS]; /* guarded by cache_lock, as all below */
static int n_kept;
static size_t kept_bytes;
static uint64_t clock_now;
static size_t budget_bytes = SIZE_MAX; /* SIZE_MAX: not read from the environment yet */
static size_t recent[RECENT_SIZES];    /* sizes of the last blocks freed, a ring */
static int recent_next;

static pthread_once_t fork_watch_once = PTHREAD_ONCE_INIT;

static void lock_before_fork(void) { pthread_mutex_lock(&cache_lock); }
static void unlock_after_fork(void) { pthread_mutex_unlock(&cache_lock); }
static void watch_forks(void)
{
    pthread_atfork(lock_before_fork, unlock_after_fork, unlock_after_fork);
}

/* Takes the mutex, first making sure forks take it too. */
static void lock_cache(void)
{
    pthread_once(&fork_watch_once, watch_forks);
    pthread_mutex_lock(&cache_lock);
}

static size_t rounded_bytes(size_t n)
{
    return (n + RFI_DATA_ALIGN - 1) / RFI_DATA_ALIGN * RFI_DATA_ALIGN;
}

static size_t budget(void)
{
    if (budget_bytes == SIZE_MAX) {
        uint64_t b = rfi_env_megabytes("RF_ARRAY_CACHE_MB", DEFAULT_BUDGET_MB);
        budget_bytes = b < SIZE_MAX ? (size_t)b : SIZE_MAX - 1;
    }
    return budget_bytes;
}

/* Whether a block of `bytes` was freed among the last RECENT_SIZES; records this one. */
static bool size_recurs(size_t bytes)
{
    bool seen = false;
    for (int i = 0; i < RECENT_SIZES && !seen; i++)
        seen = recent[i] == bytes;
    recent[recent_next] = bytes;
    recent_next = (recent_next + 1) % RECENT_SIZES;
    return seen;
}

/* Removes slot i, returning its block (the caller frees or reuses it). */
static void *take_slot(int i)
{
    void *p = kept[i].data;
    kept_bytes -= kept[i].bytes;
    kept[i] = kept[--n_kept];
    return p;
}

static int oldest_slot(void)
{
    int o = 0;
    for (int i = 1; i < n_kept; i++)
        if (kept[i].stamp < kept[o].stamp)
            o = i;
    return o;
}

void *rfi_block_alloc(size_t n)
{
    if (n < BLOCK_CACHE_MIN_BYTES || n > SIZE_MAX - RFI_DATA_ALIGN)
        return rfi_malloc_aligned(n);
    size_t bytes = rounded_bytes(n);
    void *p = NULL;
    lock_cache();
    int best = -1;
    for (int i = 0; i < n_kept; i++)
        if (kept[i].bytes == bytes && (best < 0 || kept[i].stamp > kept[best].stamp))
            best = i;
    if (best >= 0)
        p = take_slot(best);
    pthread_mutex_unlock(&cache_lock);
    if (!p)
        return rfi_malloc_aligned(n);
    /* a kept block is an allocation like any other for the counting and failure hooks */
    if (rfi_alloc_hook_fails()) {
        rfi_free(p);
        return NULL;
    }
    UNPOISON(p, bytes);
    return p;
}

void rfi_block_free(void *p, size_t n, bool keep)
{
    if (!p)
        return;
    if (!keep || n < BLOCK_CACHE_MIN_BYTES || n > SIZE_MAX - RFI_DATA_ALIGN) {
        rfi_free(p);
        return;
    }
    size_t bytes = rounded_bytes(n);
    kept_block to_free[BLOCK_CACHE_SLOTS + 1]; /* freed after the mutex is released */
    int n_free = 0;
    lock_cache();
    size_t limit = budget();
    if (bytes > limit || !size_recurs(bytes)) {
        to_free[n_free++] = (kept_block){p, 0, 0}; /* not poisoned: nothing to undo */
    } else {
        while (n_kept > 0 && (n_kept == BLOCK_CACHE_SLOTS || kept_bytes + bytes > limit)) {
            int o = oldest_slot();
            to_free[n_free++] = kept[o];
            take_slot(o);
        }
        POISON(p, bytes);
        kept[n_kept++] = (kept_block){p, bytes, ++clock_now};
        kept_bytes += bytes;
    }
    pthread_mutex_unlock(&cache_lock);
    for (int i = 0; i < n_free; i++) {
        UNPOISON(to_free[i].data, to_free[i].bytes);
        rfi_free(to_free[i].data);
    }
}

size_t rf_array_cache_clear(void)
{
    kept_block cleared[BLOCK_CACHE_SLOTS]; /* freed after the mutex is released */
    lock_cache();
    int n = n_kept;
    size_t freed = kept_bytes;
    memcpy(cleared, kept, (size_t)n * sizeof *kept);
    n_kept = 0;
    kept_bytes = 0;
    pthread_mutex_unlock(&cache_lock);
    for (int i = 0; i < n; i++) {
        UNPOISON(cleared[i].data, cleared[i].bytes);
        rfi_free(cleared[i].data);
    }
    return freed;
}

size_t rf_array_cache_bytes(void)
{
    lock_cache();
    size_t b = kept_bytes;
    pthread_mutex_unlock(&cache_lock);
    return b;
}
