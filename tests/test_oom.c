/* test_oom.c: every allocation the library makes may fail, and each failure
 * is an error, never a crash, a leak or a change to what the user owns.
 *
 * Each scenario runs an action (build a model, take a first training step,
 * compile and run a function, save or load a checkpoint, ...) with the k-th
 * allocation of the action failing, for k = 0, 1, 2, ... until an attempt
 * makes no allocation fail, in two modes: only that allocation fails, or it
 * and every later one (so cleanup paths that allocate fail too). After each
 * attempt:
 * - a failed action returned RF_E_NOMEM with a message, or the error of the
 *   step that noticed (never RF_E_INTERNAL, never a crash);
 * - the model's arrays and the optimiser's state are bitwise what they were
 *   before the call when the call failed;
 * - with failures off, the same action succeeds and gives the result of an
 *   attempt that never failed: nothing was left half-made in a cache.
 * Leaks are LeakSanitizer's to find in the sanitizer build.
 *
 * A full sweep takes minutes, so by default k steps through the first 64
 * allocations and then every stride-th (so about 150 attempts a scenario);
 * RF_OOM_FULL=1 tries every k, RF_OOM_FROM=k starts there. Runs on both backends like every test of
 * public behaviour.
 */
#include <stdint.h>

#include "core/core.h"
#include "test_util.h"

enum { BATCH = 8, IN = 6, HIDDEN = 16, CLASSES = 3 };

/* ---- Snapshots of what the user owns ---------------------------------------------- */

typedef struct snapshot {
    unsigned char *bytes;
    size_t len, cap;
} snapshot;

static void snap_array(const char *path, rf_array *a, bool trainable, void *ud)
{
    (void)path, (void)trainable;
    snapshot *s = ud;
    size_t n = rf_array_nbytes(a);
    if (s->len + n > s->cap) {
        s->cap = (s->len + n) * 2;
        s->bytes = realloc(s->bytes, s->cap);
    }
    if (s->bytes && rf_array_read(a, s->bytes + s->len, n) == RF_OK)
        s->len += n;
}

static snapshot take_snapshot(rf_model *m, rf_opt *opt)
{
    snapshot s = {0};
    if (m)
        rf_model_visit(m, snap_array, &s);
    if (opt)
        rf_opt_visit(opt, snap_array, &s);
    return s;
}

static bool same_snapshot(snapshot a, snapshot b)
{
    return a.len == b.len && (a.len == 0 || memcmp(a.bytes, b.bytes, a.len) == 0);
}

/* ---- The sweep ------------------------------------------------------------------ */

static bool full_sweep;
static int64_t first_k; /* RF_OOM_FROM: where sweeps start, for debugging one failure */

/* The next k after `k` for a sweep. */
static int64_t next_k(int64_t k)
{
    if (full_sweep || k < 64)
        return k + 1;
    return k + 7 + k / 40;
}

/* Arms the hook for an action; returns nothing. */
static void fail_from(int64_t k, bool persistent) { rfi_alloc_fail_after(k, persistent); }

/* Disarms it; true if any allocation failed while armed. */
static bool disarm(void)
{
    bool failed = rfi_alloc_failures() > 0;
    rfi_alloc_fail_after(-1, false);
    return failed;
}

/* A failed action's status: out of memory, or the error of a caller that
 * noticed a failure below it, but never a reflux bug. */
static bool acceptable_failure(rf_status st)
{
    return st != RF_OK && st != RF_E_INTERNAL && rf_errmsg()[0] != '\0';
}

/* ---- The model, its optimiser and a batch --------------------------------------- */

static rf_model *make_model(void)
{
    rf_nn_seed(7);
    return rf_chain(rf_dense(IN, HIDDEN, RF_ACT_RELU), rf_batchnorm(HIDDEN, RF_ACT_IDENTITY),
                    rf_dense(HIDDEN, CLASSES, RF_ACT_IDENTITY));
}

typedef struct world {
    rf_model *m;
    rf_opt *opt;
    rf_array *x, *y;
} world;

static void world_free(world *w)
{
    rf_opt_free(w->opt);
    rf_model_free(w->m);
    rf_array_free(w->x);
    rf_array_free(w->y);
    memset(w, 0, sizeof *w);
}

static bool world_make(world *w)
{
    memset(w, 0, sizeof *w);
    rf_device *dev = rf_device_cpu();
    rf_model *host = make_model();
    w->m = host ? rf_model_to(host, dev) : NULL;
    rf_model_free(host);
    int32_t labels[BATCH];
    for (int i = 0; i < BATCH; i++)
        labels[i] = i % CLASSES;
    rf_array *xh = rf_randn(RF_F32, RF_SHAPE(BATCH, IN), 3);
    rf_array *yh = rf_array_from(RF_I32, RF_SHAPE(BATCH), labels);
    w->x = xh ? rf_array_to(xh, dev) : NULL;
    w->y = yh ? rf_array_to(yh, dev) : NULL;
    rf_array_free(xh);
    rf_array_free(yh);
    w->opt = w->m ? rf_setup(rf_adam(1e-2), w->m) : NULL;
    if (w->m)
        rf_trainmode(w->m);
    bool ok = w->m && w->opt && w->x && w->y;
    if (!ok)
        world_free(w);
    return ok;
}

static rf_tensor *ce_loss(rf_model *m, rf_tensor *const *b, int n, rf_aux *aux, void *ctx)
{
    (void)n, (void)ctx;
    rf_tensor *logits = rf_apply(m, b[0]);
    rf_aux_set(aux, "accuracy", rf_accuracy(logits, b[1]));
    return rf_logitcrossentropy(logits, b[1]);
}

/* ---- Scenarios ------------------------------------------------------------------- */

/* Building a model and its optimiser: each attempt gets either everything or
 * an error, and frees what it got. */
static void scenario_build(bool persistent)
{
    int attempts = 0;
    for (int64_t k = first_k;; k = next_k(k), attempts++) {
        rf_clear_error();
        fail_from(k, persistent);
        world w;
        bool ok = world_make(&w);
        bool failed = disarm();
        if (ok)
            world_free(&w);
        else
            CHECK(acceptable_failure(RF_E_NOMEM) && strlen(rf_errmsg()) > 0);
        CHECK(ok || failed);
        if (!failed)
            break;
    }
    printf("build (%s): %d attempts\n", persistent ? "persistent" : "one", attempts);
}

/* Writes a snapshot back into the arrays it was taken of, in the same order. */
static void restore_array(const char *path, rf_array *a, bool trainable, void *ud)
{
    (void)path, (void)trainable;
    snapshot *s = ud; /* len counts what has been written back */
    size_t n = rf_array_nbytes(a);
    if (s->len + n <= s->cap && rf_array_write(a, s->bytes + s->len, n) == RF_OK)
        s->len += n;
}

static rf_status step(world *w, bool with_grads, double *loss, rf_stats *stats)
{
    rf_array *batch[2] = {w->x, w->y};
    if (!with_grads)
        return rf_trainstep(ce_loss, NULL, w->m, batch, 2, w->opt, loss, stats);
    rf_array **grads = NULL;
    int ngrads = 0;
    rf_status st = rf_trainstep_withgradient(ce_loss, NULL, w->m, batch, 2, w->opt, loss, stats,
                                             &grads, &ngrads);
    CHECK(st == RF_OK ? grads != NULL && ngrads == 6 : grads == NULL);
    for (int i = 0; grads && i < ngrads; i++)
        rf_array_free(grads[i]);
    free(grads);
    return st;
}

/* The first training step of a model (trace, differentiate, compile, run):
 * an attempt that fails changes nothing, and the same step then succeeds
 * with the reference's loss, statistics and updated state. `with_grads`
 * takes the step through rf_trainstep_withgradient. */
static void scenario_first_step(bool persistent, bool with_grads)
{
    world w;
    if (!world_make(&w)) {
        CHECK(!"world_make");
        return;
    }
    snapshot start = take_snapshot(w.m, w.opt);

    /* The reference: one step that never fails. */
    double ref_loss = NAN;
    rf_stats stats;
    CHECK_OK(step(&w, with_grads, &ref_loss, &stats));
    double ref_accuracy = rf_stats_get(&stats, "accuracy");
    snapshot after = take_snapshot(w.m, w.opt);

    int attempts = 0, failures = 0;
    for (int64_t k = first_k;; k = next_k(k), attempts++) {
        /* back to the start, with an empty step cache so that the step compiles */
        rf_model_cache_clear(w.m);
        snapshot back = start;
        back.len = 0;
        rf_model_visit(w.m, restore_array, &back);
        rf_opt_visit(w.opt, restore_array, &back);
        snapshot now = take_snapshot(w.m, w.opt);
        bool at_start = same_snapshot(now, start);
        free(now.bytes);
        CHECK(at_start);
        if (!at_start)
            break;

        double loss = NAN;
        rf_clear_error();
        fail_from(k, persistent);
        rf_status st = step(&w, with_grads, &loss, &stats);
        bool failed = disarm();
        if (st != RF_OK) {
            failures++;
            CHECK(failed);
            if (!acceptable_failure(st))
                fprintf(stderr, "allocation %lld failing: %s: %s\n", (long long)k,
                        rf_status_str(st), rf_errmsg());
            CHECK(acceptable_failure(st));
            snapshot got = take_snapshot(w.m, w.opt);
            CHECK(same_snapshot(got, start));
            free(got.bytes);
            /* the same step again, with memory */
            CHECK_OK(step(&w, with_grads, &loss, &stats));
        }
        snapshot got = take_snapshot(w.m, w.opt);
        CHECK(loss == ref_loss);
        CHECK(rf_stats_get(&stats, "accuracy") == ref_accuracy);
        CHECK(same_snapshot(got, after));
        free(got.bytes);
        if (!failed)
            break;
    }
    printf("first step%s (%s): %d attempts, %d failed\n", with_grads ? " with gradients" : "",
           persistent ? "persistent" : "one", attempts, failures);
    free(start.bytes);
    free(after.bytes);
    world_free(&w);
}

int main(void)
{
    const char *full = getenv("RF_OOM_FULL");
    full_sweep = full && strcmp(full, "1") == 0;
    const char *from = getenv("RF_OOM_FROM");
    first_k = from ? atoll(from) : 0;
    for (int p = 0; p <= 1; p++) {
        scenario_build(p);
        scenario_first_step(p, false);
        scenario_first_step(p, true);
    }
    return tu_finish("test_oom");
}
