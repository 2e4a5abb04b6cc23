/* loader.c: rf_loader, mini-batches over host arrays that share their first
 * dimension (Flux's DataLoader), optionally wrapped with a device.
 *
 * Every epoch visits each observation exactly once. Shuffling is a
 * Fisher-Yates permutation drawn from a splitmix64 stream seeded from
 * (seed, epoch), so epoch e gives the same order on every run and platform
 * whatever happened before it. A batch is gathered row by row into fresh
 * arrays owned by the loader until the next call.
 *
 * A device-wrapped loader (rf_loader_to) keeps one background thread that
 * prepares the NEXT batch (gather + move to the device) while the caller
 * runs its step on the current one; at most one batch is in flight. The
 * thread only reads the loader's source arrays and permutation, which the
 * caller's thread changes only after waiting for the thread to go idle.
 * Errors in the thread travel back as a status plus its message.
 *
 * Deliberately not here: parallel gathering with several workers, sampling
 * with replacement, collating non-array observations.
 */
#include "../runtime/runtime.h"

#include <errno.h>
#include <stdint.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* The background preparation of one batch (device-wrapped loaders only). */
typedef struct prefetcher {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t wake;   /* caller -> worker: a job or quit */
    pthread_cond_t done;   /* worker -> caller: a result is ready */
    bool started, quit;
    pid_t owner;           /* the process that started the thread: a child forked
                              since has no such thread (it was not forked) */
    int64_t job;           /* batch index waiting to be picked up, -1 none */
    int64_t ready_batch;   /* batch index whose result sits in `ready`, -1 none */
    rf_array **ready;      /* n arrays of the finished batch (NULL on error) */
    rf_status ready_st;
    char ready_msg[RFI_ERRMSG_MAX];
    /* Caller's side only: the batch requested and not yet taken, -1 none. */
    int64_t pending;
} prefetcher;

struct rf_loader {
    rf_array **arrays;     /* n source arrays, one reference each */
    int n;
    int64_t n_obs;
    rf_loader_opts opts;
    uint64_t epoch;        /* 0 for the first, +1 per rf_loader_reset */
    int64_t *perm;         /* n_obs indices when shuffling, else NULL (identity) */
    int64_t cursor;        /* next batch index of this epoch */
    rf_array **current;    /* n arrays of the batch handed out last (or NULL each) */
    rf_device *dev;        /* NULL: batches stay on the source arrays' device */
    prefetcher pf;
};

/* ---- Shuffling ------------------------------------------------------------------------ */

static uint64_t splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in [0, bound) without modulo bias (rejection below 2^64 mod bound). */
static uint64_t uniform_below(uint64_t *state, uint64_t bound)
{
    uint64_t threshold = (0 - bound) % bound;
    for (;;) {
        uint64_t r = splitmix64(state);
        if (r >= threshold)
            return r % bound;
    }
}

/* The permutation of epoch `epoch`: a function of (seed, epoch) only. The
 * seed and epoch are hashed (rather than added) so that nearby seeds and
 * epochs give unrelated streams. */
static void shuffle_epoch(int64_t *perm, int64_t n, uint64_t seed, uint64_t epoch)
{
    uint64_t state = rfi_hash_u64(rfi_hash_u64(RFI_HASH_INIT, seed), epoch);
    for (int64_t i = 0; i < n; i++)
        perm[i] = i;
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)uniform_below(&state, (uint64_t)i + 1);
        int64_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
}

/* ---- Gathering a batch ------------------------------------------------------------------ */

static int64_t batch_size_of(const rf_loader *l, int64_t k)
{
    int64_t start = k * l->opts.batchsize;
    int64_t left = l->n_obs - start;
    return left < l->opts.batchsize ? left : l->opts.batchsize;
}

static void release_all(rf_array **arrays, int n)
{
    if (!arrays)
        return;
    for (int j = 0; j < n; j++) {
        rfi_array_release(arrays[j]);
        arrays[j] = NULL;
    }
}

/* Gathers rows [start, start+b) of the epoch's order from src into a new
 * array on `dev` of the same dtype. */
static rf_array *gather_rows(const rf_loader *l, const rf_array *src, int64_t start, int64_t b,
                             rf_device *dev)
{
    int64_t dims[RF_MAX_RANK];
    for (int d = 0; d < src->rank; d++)
        dims[d] = src->dims[d];
    dims[0] = b;
    rf_array *dst = rfi_array_alloc_recycled("rf_loader_next", dev, src->dtype, dims, src->rank);
    if (!dst)
        return NULL;
    size_t row = l->n_obs ? src->nbytes / (size_t)l->n_obs : 0;
    const char *from = src->data;
    char *to = dst->data;
    if (!l->perm) {
        if (dst->nbytes)
            memcpy(to, from + (size_t)start * row, dst->nbytes);
        return dst;
    }
    for (int64_t i = 0; i < b; i++)
        memcpy(to + (size_t)i * row, from + (size_t)l->perm[start + i] * row, row);
    return dst;
}

/* Whether rows can be gathered straight into an array on dev: dev addresses
 * ordinary memory and the batch keeps the dtype: always on the sources' own
 * device (an unwrapped loader), else unless moving there changes it (f64
 * becomes f32 on a compute device, which rf_array_to does). */
static bool gathers_directly(const rf_array *src, rf_device *dev, bool unwrapped)
{
    if (dev->kind != RF_DEVICE_HOST && dev->kind != RF_DEVICE_CPU)
        return false;
    return unwrapped || !(src->dtype == RF_F64 && rfi_device_is_compute(dev));
}

/* The status of a failed array allocation or move (they return NULL). */
static rf_status failed_array_status(void)
{
    rf_status st = rf_errstatus();
    return st != RF_OK ? st : RF_E_DEVICE;
}

/* Builds batch k into out[0..n) (new arrays on dev, or on the sources'
 * devices when dev is NULL). On failure out holds NULLs and the message is set. */
static rf_status make_batch(const rf_loader *l, int64_t k, rf_device *dev, rf_array **out)
{
    int64_t start = k * l->opts.batchsize;
    int64_t b = batch_size_of(l, k);
    for (int j = 0; j < l->n; j++) {
        const rf_array *src = l->arrays[j];
        rf_device *target = dev ? dev : src->device;
        rf_array *a;
        if (gathers_directly(src, target, dev == NULL)) {
            a = gather_rows(l, src, start, b, target);
        } else {
            rf_array *staged = gather_rows(l, src, start, b, src->device);
            a = staged ? rf_array_to(staged, target) : NULL;
            rfi_array_release(staged);
        }
        if (!a) {
            release_all(out, j);
            return failed_array_status();
        }
        out[j] = a;
    }
    return RF_OK;
}

/* ---- The background thread ------------------------------------------------------------- */

static void *prefetch_main(void *arg)
{
    rf_loader *l = arg;
    prefetcher *pf = &l->pf;
    pthread_mutex_lock(&pf->mu);
    for (;;) {
        while (!pf->quit && pf->job < 0)
            pthread_cond_wait(&pf->wake, &pf->mu);
        if (pf->quit)
            break;
        int64_t k = pf->job;
        pf->job = -1;
        pthread_mutex_unlock(&pf->mu);

        /* The caller does not touch perm, arrays, dev or ready while a job
         * is in flight (it waits for `done` first). */
        rf_status st = make_batch(l, k, l->dev, pf->ready);

        pthread_mutex_lock(&pf->mu);
        pf->ready_st = st;
        if (st != RF_OK)
            snprintf(pf->ready_msg, sizeof pf->ready_msg, "%s", rf_errmsg());
        pf->ready_batch = k;
        pthread_cond_broadcast(&pf->done);
    }
    pthread_mutex_unlock(&pf->mu);
    return NULL;
}

static rf_status prefetch_start(rf_loader *l)
{
    prefetcher *pf = &l->pf;
    if (pf->started)
        return RF_OK;
    int rc = pthread_create(&pf->thread, NULL, prefetch_main, l);
    if (rc != 0)
        return rfi_error(rc == EAGAIN ? RF_E_NOMEM : RF_E_INTERNAL,
                         "rf_loader_to: cannot start the prefetch thread: %s", strerror(rc));
    pf->started = true;
    pf->owner = getpid();
    return RF_OK;
}

/* In a child forked after rf_loader_to, the thread the loader waits for does not
 * exist (and its lock may be held forever): the loader can only be freed there. */
static bool forked_away(const rf_loader *l)
{
    return l->pf.started && l->pf.owner != getpid();
}

static rf_status check_not_forked(const rf_loader *l, const char *op)
{
    if (!forked_away(l))
        return RF_OK;
    return rfi_error(RF_E_INVALID, "%s: the loader was wrapped with a device (rf_loader_to) "
                     "before this process was forked, and its prefetch thread is the "
                     "parent's; make a new loader in the child (rf_loader_free works)", op);
}

/* Asks the thread for batch k (nothing else may be pending). */
static void prefetch_request(rf_loader *l, int64_t k)
{
    prefetcher *pf = &l->pf;
    pthread_mutex_lock(&pf->mu);
    pf->job = k;
    pthread_cond_signal(&pf->wake);
    pthread_mutex_unlock(&pf->mu);
    pf->pending = k;
}

/* Waits for the pending batch (the lock is held); returns with it in `ready`. */
static void wait_ready_locked(prefetcher *pf)
{
    while (pf->ready_batch != pf->pending)
        pthread_cond_wait(&pf->done, &pf->mu);
}

/* Drops the pending batch, if any: cancels it when the thread has not picked
 * it up yet, else waits for it and frees the result. Afterwards the thread is
 * idle, so the caller may change what it reads. */
static void prefetch_discard(rf_loader *l)
{
    prefetcher *pf = &l->pf;
    if (pf->pending < 0)
        return;
    pthread_mutex_lock(&pf->mu);
    if (pf->job == pf->pending) {
        pf->job = -1;
    } else {
        wait_ready_locked(pf);
        release_all(pf->ready, l->n);
        pf->ready_batch = -1;
    }
    pthread_mutex_unlock(&pf->mu);
    pf->pending = -1;
}

/* Takes batch k from the thread into l->current (requesting it first when it
 * is not the pending one). */
static rf_status prefetch_take(rf_loader *l, int64_t k)
{
    prefetcher *pf = &l->pf;
    if (pf->pending != k) {
        prefetch_discard(l);
        prefetch_request(l, k);
    }
    pthread_mutex_lock(&pf->mu);
    wait_ready_locked(pf);
    rf_status st = pf->ready_st;
    for (int j = 0; j < l->n; j++) {
        l->current[j] = pf->ready[j];
        pf->ready[j] = NULL;
    }
    pf->ready_batch = -1;
    pthread_mutex_unlock(&pf->mu);
    pf->pending = -1;
    if (st != RF_OK)
        return rfi_error(st, "rf_loader_next: batch %lld: %s", (long long)k, pf->ready_msg);
    return RF_OK;
}

static void prefetch_stop(rf_loader *l)
{
    prefetcher *pf = &l->pf;
    prefetch_discard(l);
    if (pf->started) {
        pthread_mutex_lock(&pf->mu);
        pf->quit = true;
        pthread_cond_signal(&pf->wake);
        pthread_mutex_unlock(&pf->mu);
        pthread_join(pf->thread, NULL);
        pf->started = false;
    }
}

/* ---- Public API ------------------------------------------------------------------------ */

static rf_status check_arrays(rf_array *const *arrays, int n, int64_t *n_obs)
{
    if (!arrays || n <= 0)
        return rfi_error(RF_E_INVALID, "rf_loader_new: %s", !arrays ? "arrays is NULL"
                                                                   : "no arrays (n <= 0)");
    for (int j = 0; j < n; j++) {
        const rf_array *a = arrays[j];
        if (!a)
            return rfi_error(RF_E_INVALID, "rf_loader_new: array %d is NULL", j);
        if (a->device->kind != RF_DEVICE_HOST && a->device->kind != RF_DEVICE_CPU)
            return rfi_error(RF_E_DEVICE, "rf_loader_new: array %d lives on %s; a loader "
                             "reads host arrays", j, a->device->name);
        if (a->rank < 1)
            return rfi_error(RF_E_SHAPE, "rf_loader_new: array %d is a scalar; observations "
                             "run along dim 0", j);
    }
    char t0[128], tj[128];
    for (int j = 1; j < n; j++)
        if (arrays[j]->dims[0] != arrays[0]->dims[0])
            return rfi_error(RF_E_SHAPE,
                             "rf_loader_new: arrays must share dim 0 (observations): array 0 "
                             "is %s, array %d is %s", rfi_type_str(t0, sizeof t0,
                             arrays[0]->dtype, arrays[0]->dims, arrays[0]->rank), j,
                             rfi_type_str(tj, sizeof tj, arrays[j]->dtype, arrays[j]->dims,
                                          arrays[j]->rank));
    *n_obs = arrays[0]->dims[0];
    return RF_OK;
}

static bool prefetcher_init(prefetcher *pf)
{
    pf->job = pf->ready_batch = pf->pending = -1;
    if (pthread_mutex_init(&pf->mu, NULL) != 0)
        return false;
    if (pthread_cond_init(&pf->wake, NULL) != 0) {
        pthread_mutex_destroy(&pf->mu);
        return false;
    }
    if (pthread_cond_init(&pf->done, NULL) != 0) {
        pthread_cond_destroy(&pf->wake);
        pthread_mutex_destroy(&pf->mu);
        return false;
    }
    return true;
}

rf_loader *rf_loader_new(rf_array *const *arrays, int n, const rf_loader_opts *opts)
{
    int64_t n_obs = 0;
    if (check_arrays(arrays, n, &n_obs) != RF_OK)
        return NULL;
    rf_loader_opts o = {.batchsize = 1, .shuffle = false, .seed = 0, .drop_last = false};
    if (opts)
        o = *opts;
    if (o.batchsize < 1) {
        rfi_error(RF_E_INVALID, "rf_loader_new: batchsize must be at least 1, got %lld",
                  (long long)o.batchsize);
        return NULL;
    }
    rf_loader *l = rfi_calloc(1, sizeof *l);
    if (!l || !prefetcher_init(&l->pf)) {
        rfi_free(l);
        rfi_error(RF_E_NOMEM, "rf_loader_new: out of memory");
        return NULL;
    }
    l->n = n;
    l->n_obs = n_obs;
    l->opts = o;
    l->arrays = rfi_calloc((size_t)n, sizeof *l->arrays);
    l->current = rfi_calloc((size_t)n, sizeof *l->current);
    l->pf.ready = rfi_calloc((size_t)n, sizeof *l->pf.ready);
    /* a permutation of every observation (empty ones too: 2^61 of them fit in
     * no byte count) */
    if (o.shuffle && (uint64_t)n_obs <= SIZE_MAX / sizeof *l->perm)
        l->perm = rfi_malloc((size_t)(n_obs ? n_obs : 1) * sizeof *l->perm);
    if (!l->arrays || !l->current || !l->pf.ready || (o.shuffle && !l->perm)) {
        rf_loader_free(l);
        rfi_error(RF_E_NOMEM, "rf_loader_new: out of memory (%lld observations)",
                  (long long)n_obs);
        return NULL;
    }
    for (int j = 0; j < n; j++)
        l->arrays[j] = rfi_array_retain(arrays[j]);
    if (l->perm)
        shuffle_epoch(l->perm, n_obs, o.seed, 0);
    return l;
}

rf_status rf_loader_to(rf_loader *l, rf_device *dev)
{
    if (!l || !dev)
        return rfi_error(RF_E_INVALID, "rf_loader_to: %s is NULL", l ? "device" : "loader");
    rf_status forked = check_not_forked(l, "rf_loader_to");
    if (forked != RF_OK)
        return forked;
    prefetch_discard(l); /* the thread may be preparing for the old device */
    l->dev = dev;
    rf_status st = prefetch_start(l);
    if (st != RF_OK) {
        l->dev = NULL;
        return st;
    }
    if (l->cursor < rf_loader_n_batches(l))
        prefetch_request(l, l->cursor);
    return RF_OK;
}

int64_t rf_loader_n_batches(const rf_loader *l)
{
    if (!l)
        return 0;
    int64_t bs = l->opts.batchsize;
    return l->n_obs / bs + (!l->opts.drop_last && l->n_obs % bs != 0);
}

int64_t rf_loader_n_obs(const rf_loader *l) { return l ? l->n_obs : 0; }
int rf_loader_n_arrays(const rf_loader *l) { return l ? l->n : 0; }

/* Makes batch `cursor` of epoch `epoch` the next one. */
static void go_to(rf_loader *l, uint64_t epoch, int64_t cursor)
{
    prefetch_discard(l); /* before touching perm, which the thread reads */
    release_all(l->current, l->n);
    if (l->perm && epoch != l->epoch)
        shuffle_epoch(l->perm, l->n_obs, l->opts.seed, epoch);
    l->epoch = epoch;
    l->cursor = cursor;
    if (l->dev && cursor < rf_loader_n_batches(l))
        prefetch_request(l, cursor);
}

rf_status rf_loader_reset(rf_loader *l)
{
    if (!l)
        return rfi_error(RF_E_INVALID, "rf_loader_reset: loader is NULL");
    rf_status st = check_not_forked(l, "rf_loader_reset");
    if (st != RF_OK)
        return st;
    go_to(l, l->epoch + 1, 0);
    return RF_OK;
}

void rf_loader_position(const rf_loader *l, uint64_t *epoch, int64_t *batches)
{
    if (epoch)
        *epoch = l ? l->epoch : 0;
    if (batches)
        *batches = l ? l->cursor : 0;
}

rf_status rf_loader_seek(rf_loader *l, uint64_t epoch, int64_t batches)
{
    if (!l)
        return rfi_error(RF_E_INVALID, "rf_loader_seek: loader is NULL");
    rf_status st = check_not_forked(l, "rf_loader_seek");
    if (st != RF_OK)
        return st;
    int64_t n = rf_loader_n_batches(l);
    if (batches < 0 || batches > n)
        return rfi_error(RF_E_INVALID, "rf_loader_seek: batch %lld is out of range (the "
                         "loader has %lld batches an epoch)", (long long)batches, (long long)n);
    go_to(l, epoch, batches);
    return RF_OK;
}

rf_status rf_loader_next(rf_loader *l, rf_array *const **batch)
{
    if (batch)
        *batch = NULL;
    if (!l || !batch)
        return rfi_error(RF_E_INVALID, "rf_loader_next: %s is NULL", l ? "batch" : "loader");
    rf_status forked = check_not_forked(l, "rf_loader_next");
    if (forked != RF_OK)
        return forked;
    release_all(l->current, l->n);
    int64_t k = l->cursor;
    if (k >= rf_loader_n_batches(l))
        return RF_OK; /* end of the epoch */
    rf_status st;
    if (l->dev) {
        st = prefetch_take(l, k);
    } else {
        st = make_batch(l, k, NULL, l->current);
        if (st != RF_OK)
            st = rfi_error(st, "rf_loader_next: batch %lld: %s", (long long)k, rf_errmsg());
    }
    if (st != RF_OK) {
        release_all(l->current, l->n);
        return st;
    }
    l->cursor = k + 1;
    if (l->dev && l->cursor < rf_loader_n_batches(l))
        prefetch_request(l, l->cursor); /* overlaps with the caller's step */
    *batch = l->current;
    return RF_OK;
}

void rf_loader_free(rf_loader *l)
{
    if (!l)
        return;
    bool forked = forked_away(l);
    if (forked) { /* no thread to stop, and its lock and conditions are left alone */
        release_all(l->pf.ready, l->n);
    } else {
        prefetch_stop(l);
    }
    release_all(l->current, l->n);
    if (l->arrays)
        release_all(l->arrays, l->n);
    if (!forked) {
        pthread_cond_destroy(&l->pf.done);
        pthread_cond_destroy(&l->pf.wake);
        pthread_mutex_destroy(&l->pf.mu);
    }
    rfi_free(l->pf.ready);
    rfi_free(l->current);
    rfi_free(l->arrays);
    rfi_free(l->perm);
    rfi_free(l);
}
