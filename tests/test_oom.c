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
#include <sys/stat.h>

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

/* world_make where nothing fails: a failure is the test's. */
static bool world_made(world *w)
{
    bool ok = world_make(w);
    CHECK(ok);
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

/* An attempt: sets up, runs the action with allocation k failing (from k on
 * when persistent), checks; returns whether any allocation failed (the sweep
 * goes on while attempts meet failures). */
typedef bool (*attempt_fn)(void *ctx, int64_t k, bool persistent);

static void sweep(const char *name, attempt_fn attempt, void *ctx)
{
    for (int persistent = 0; persistent <= 1; persistent++) {
        int attempts = 0;
        for (int64_t k = first_k; attempt(ctx, k, persistent); k = next_k(k))
            attempts++;
        printf("%s (%s): %d attempts met a failure\n", name,
               persistent ? "that allocation and every later one" : "one allocation", attempts);
    }
}

/* Reports an unacceptable failure with the allocation that caused it. */
static void check_failure(rf_status st, int64_t k, bool failed)
{
    CHECK(failed);
    if (!acceptable_failure(st))
        fprintf(stderr, "allocation %lld failing: %s: \"%s\"\n", (long long)k, rf_status_str(st),
                rf_errmsg());
    CHECK(acceptable_failure(st));
}

/* Building a model and its optimiser: each attempt gets either everything or
 * an error, and frees what it got. */
static bool attempt_build(void *ctx, int64_t k, bool persistent)
{
    (void)ctx;
    rf_clear_error();
    fail_from(k, persistent);
    world w;
    bool ok = world_make(&w);
    bool failed = disarm();
    if (ok)
        world_free(&w);
    else
        check_failure(RF_E_NOMEM, k, failed);
    return failed;
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

static void restore(world *w, snapshot s)
{
    snapshot back = s;
    back.len = 0;
    rf_model_visit(w->m, restore_array, &back);
    rf_opt_visit(w->opt, restore_array, &back);
    CHECK(back.len == s.len);
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
 * with the reference's loss, statistics and updated state. */
typedef struct step_ctx {
    world w;
    bool with_grads;
    bool grad_norm; /* the optimiser tracks the gradient norm */
    snapshot start, after;
    double loss;
    double accuracy, norm;
} step_ctx;

static bool attempt_first_step(void *ctx, int64_t k, bool persistent)
{
    step_ctx *c = ctx;
    /* back to the start, with an empty step cache so that the step compiles */
    rf_model_cache_clear(c->w.m);
    restore(&c->w, c->start);
    double loss = NAN;
    rf_stats stats;
    rf_clear_error();
    fail_from(k, persistent);
    rf_status st = step(&c->w, c->with_grads, &loss, &stats);
    bool failed = disarm();
    if (st != RF_OK) {
        check_failure(st, k, failed);
        snapshot got = take_snapshot(c->w.m, c->w.opt);
        CHECK(same_snapshot(got, c->start));
        free(got.bytes);
        CHECK_OK(step(&c->w, c->with_grads, &loss, &stats)); /* again, with memory */
    }
    snapshot got = take_snapshot(c->w.m, c->w.opt);
    CHECK(loss == c->loss);
    CHECK(rf_stats_get(&stats, "accuracy") == c->accuracy);
    CHECK(c->grad_norm ? rf_stats_get(&stats, RF_STATS_GRAD_NORM) == c->norm
                       : stats.n == 1);
    CHECK(same_snapshot(got, c->after));
    free(got.bytes);
    return failed;
}

static void scenario_first_step(bool with_grads, bool grad_norm)
{
    step_ctx c = {.with_grads = with_grads, .grad_norm = grad_norm};
    if (!world_made(&c.w))
        return;
    CHECK_OK(rf_opt_track_grad_norm(c.w.opt, grad_norm));
    c.start = take_snapshot(c.w.m, c.w.opt);
    rf_stats stats;
    CHECK_OK(step(&c.w, with_grads, &c.loss, &stats)); /* the reference, which never fails */
    c.accuracy = rf_stats_get(&stats, "accuracy");
    c.norm = rf_stats_get(&stats, RF_STATS_GRAD_NORM);
    CHECK(grad_norm ? c.norm > 0 : isnan(c.norm));
    c.after = take_snapshot(c.w.m, c.w.opt);
    sweep(grad_norm    ? "first step with the gradient norm"
          : with_grads ? "first step with gradients"
                       : "first step",
          attempt_first_step, &c);
    free(c.start.bytes);
    free(c.after.bytes);
    world_free(&c.w);
}

/* The model's forward pass compiled and run (inference), and a jitted
 * function called at a second batch size: outputs as without failures, and a
 * failed compile is not kept. */
typedef struct infer_ctx {
    world w;
    rf_array *x5;        /* a batch of 5 */
    float ref[BATCH * CLASSES], ref5[5 * CLASSES];
    rf_jitted *jitted;
} infer_ctx;

static void forward(rf_trace *t, void *ctx)
{
    rf_return(t, rf_apply(ctx, rf_arg(t, 0)));
}

enum { CONV_OUT = 2 * 16 * 4 * 4 }; /* scenario_convolutions' output, the largest */

static bool same_output(rf_array *y, const float *ref, int64_t n)
{
    float got[CONV_OUT];
    return y && n <= CONV_OUT && rf_array_numel(y) == n &&
           rf_array_read(y, got, (size_t)n * sizeof *got) == RF_OK &&
           memcmp(got, ref, (size_t)n * sizeof *got) == 0;
}

/* m's forward pass on x compiled and run with allocation k failing (from k
 * on when persistent): a failure is acceptable and made good by a retry with
 * memory, and the outputs are the n of ref. Returns whether any failed. */
static bool compile_and_run(rf_model *m, rf_array *x, const float *ref, int64_t n, int64_t k,
                            bool persistent)
{
    rf_exec *e = NULL;
    rf_array *y = NULL;
    rf_clear_error();
    fail_from(k, persistent);
    rf_status st = rf_compile_model(m, x, &e);
    if (st == RF_OK)
        st = rf_exec_run(e, &x, 1, &y, 1);
    bool failed = disarm();
    if (st != RF_OK) {
        check_failure(st, k, failed);
        CHECK(y == NULL);
        if (!e)
            CHECK_OK(rf_compile_model(m, x, &e));
        if (e)
            CHECK_OK(rf_exec_run(e, &x, 1, &y, 1));
    }
    CHECK(same_output(y, ref, n));
    rf_array_free(y);
    rf_exec_free(e);
    return failed;
}

static bool attempt_compile_model(void *ctx, int64_t k, bool persistent)
{
    infer_ctx *c = ctx;
    return compile_and_run(c->w.m, c->w.x, c->ref, BATCH * CLASSES, k, persistent);
}

static bool attempt_jitted(void *ctx, int64_t k, bool persistent)
{
    infer_ctx *c = ctx;
    rf_jitted *f = rf_jitted_new(forward, c->w.m);
    rf_array *y = NULL, *y5 = NULL;
    CHECK_OK(f ? rf_jitted_run(f, &c->w.x, 1, &y, 1) : RF_E_NOMEM);
    rf_clear_error();
    fail_from(k, persistent);
    rf_status st = rf_jitted_run(f, &c->x5, 1, &y5, 1);
    bool failed = disarm();
    if (st != RF_OK) {
        check_failure(st, k, failed);
        CHECK(y5 == NULL); /* the executable stays when only the run failed */
        CHECK_OK(rf_jitted_run(f, &c->x5, 1, &y5, 1));
    }
    CHECK(rf_jitted_n_compiled(f) == 2);
    CHECK(same_output(y, c->ref, BATCH * CLASSES));
    CHECK(same_output(y5, c->ref5, 5 * CLASSES));
    rf_array_free(y);
    rf_array_free(y5);
    rf_jitted_free(f);
    return failed;
}

static void scenario_inference(void)
{
    infer_ctx c = {0};
    if (!world_made(&c.w))
        return;
    rf_testmode(c.w.m);
    c.x5 = rf_array_rows(c.w.x, 0, 5);
    rf_array *y = NULL, *y5 = NULL;
    CHECK_OK(rf_jit_model(c.w.m, c.w.x, &y));
    CHECK_OK(rf_jit_model(c.w.m, c.x5, &y5));
    CHECK_OK(y ? rf_array_read(y, c.ref, sizeof c.ref) : RF_E_INVALID);
    CHECK_OK(y5 ? rf_array_read(y5, c.ref5, sizeof c.ref5) : RF_E_INVALID);
    rf_array_free(y);
    rf_array_free(y5);
    sweep("compiled forward pass", attempt_compile_model, &c);
    sweep("jitted function, second shape", attempt_jitted, &c);
    rf_array_free(c.x5);
    world_free(&c.w);
}

/* A forward pass of five convolutions: a compile whose library calls are
 * made on two threads (the CPU backend's services make oneDNN's primitives
 * on the caller and a helper), so the allocation that fails may be either
 * thread's. Outputs as without failures. */
typedef struct conv_ctx {
    rf_model *m;
    rf_array *x;
    float ref[CONV_OUT];
} conv_ctx;

static bool attempt_compile_convs(void *ctx, int64_t k, bool persistent)
{
    conv_ctx *c = ctx;
    return compile_and_run(c->m, c->x, c->ref, CONV_OUT, k, persistent);
}

static void scenario_convolutions(void)
{
    conv_ctx c = {0};
    rf_nn_seed(5);
    rf_model *host = rf_chain(rf_conv2d(3, 3, 8, 16, RF_ACT_RELU, NULL),
                              rf_conv2d(3, 3, 16, 16, RF_ACT_RELU, NULL),
                              rf_conv2d(3, 3, 16, 16, RF_ACT_RELU, NULL),
                              rf_conv2d(3, 3, 16, 16, RF_ACT_RELU, NULL),
                              rf_conv2d(3, 3, 16, 16, RF_ACT_IDENTITY, NULL));
    rf_array *xh = rf_randn(RF_F32, RF_SHAPE(2, 8, 14, 14), 17);
    c.m = host ? rf_model_to(host, rf_device_cpu()) : NULL;
    c.x = xh ? rf_array_to(xh, rf_device_cpu()) : NULL;
    rf_model_free(host);
    rf_array_free(xh);
    CHECK(c.m && c.x);
    rf_array *y = NULL;
    if (c.m) {
        rf_testmode(c.m);
        CHECK_OK(rf_jit_model(c.m, c.x, &y));
    }
    CHECK(y && rf_array_numel(y) == CONV_OUT);
    if (y && rf_array_numel(y) == CONV_OUT)
        CHECK_OK(rf_array_read(y, c.ref, sizeof c.ref));
    rf_array_free(y);
    if (c.m && c.x)
        sweep("compiled convolutions", attempt_compile_convs, &c);
    rf_array_free(c.x);
    rf_model_free(c.m);
}

/* A run that fails part-way changes no captured array. The f64 product
 * runs on the reference kernel, which allocates while the run is under way,
 * and the loop that computes the capture's update (w + 1, beside the output
 * w * 2) may come before it in the compiled program. */
typedef struct update_ctx {
    rf_array *w, *x;
    rf_exec *e;
} update_ctx;

static void update_and_product(rf_trace *t, void *ctx)
{
    update_ctx *c = ctx;
    rf_tensor *x = rf_arg(t, 0), *w = rf_capture(t, c->w);
    rf_return(t, rf_mul_s(w, 2.0));
    rf_return(t, rf_matmul(x, x));
    rf_assign(t, c->w, rf_add_s(w, 1.0));
}

static bool attempt_update_run(void *ctx, int64_t k, bool persistent)
{
    update_ctx *c = ctx;
    float before[4] = {0}, after[4] = {0};
    CHECK_OK(rf_array_read(c->w, before, sizeof before));
    rf_array *outs[2] = {NULL, NULL};
    rf_clear_error();
    fail_from(k, persistent);
    rf_status st = rf_exec_run(c->e, &c->x, 1, outs, 2);
    bool failed = disarm();
    CHECK_OK(rf_array_read(c->w, after, sizeof after));
    if (st != RF_OK) {
        check_failure(st, k, failed);
        CHECK(outs[0] == NULL && outs[1] == NULL);
        if (memcmp(before, after, sizeof before) != 0)
            fprintf(stderr, "allocation %lld failing: the run failed (%s) and w went from %g "
                    "to %g\n", (long long)k, rf_errmsg(), before[0], after[0]);
        CHECK(memcmp(before, after, sizeof before) == 0);
    } else {
        CHECK(after[0] == before[0] + 1);
    }
    rf_array_free(outs[0]);
    rf_array_free(outs[1]);
    return failed;
}

static void scenario_failed_run(void)
{
    rf_to_opts keep_f64 = {.keep_f64 = true};
    rf_array *xh = rf_rand(RF_F64, RF_SHAPE(64, 64), 5), *wh = rf_zeros(RF_F32, RF_SHAPE(4));
    update_ctx c = {NULL, NULL, NULL};
    c.x = xh ? rf_array_to_opts(xh, rf_device_cpu(), &keep_f64) : NULL;
    c.w = wh ? rf_array_to(wh, rf_device_cpu()) : NULL;
    CHECK(c.x && c.w);
    if (c.x && c.w)
        CHECK_OK(rf_compile(update_and_product, &c, &c.x, 1, &c.e));
    if (c.e)
        sweep("run with an update and a product that allocates", attempt_update_run, &c);
    rf_exec_free(c.e);
    rf_array_free(c.x);
    rf_array_free(c.w);
    rf_array_free(xh);
    rf_array_free(wh);
}

/* Checkpoints: a save that fails leaves the previous file whole and no
 * temporary behind; a load that fails changes nothing. */
typedef struct checkpoint_ctx {
    world w;
    char dir[64], path[96];
    snapshot saved;   /* what the file holds */
    snapshot current; /* what the model and optimiser hold, different */
} checkpoint_ctx;

static int files_in(const char *dir)
{
    char cmd[160];
    snprintf(cmd, sizeof cmd, "ls -A %s | wc -l", dir);
    FILE *p = popen(cmd, "r");
    int n = -1;
    if (p) {
        if (fscanf(p, "%d", &n) != 1)
            n = -1;
        pclose(p);
    }
    return n;
}

/* Loads the file into the world and compares with `want`; leaves the world
 * at c->current again. */
static void check_file_holds(checkpoint_ctx *c, snapshot want)
{
    CHECK_OK(rf_checkpoint_load(c->path, c->w.m, c->w.opt));
    snapshot got = take_snapshot(c->w.m, c->w.opt);
    CHECK(same_snapshot(got, want));
    free(got.bytes);
    restore(&c->w, c->current);
}

static bool attempt_save(void *ctx, int64_t k, bool persistent)
{
    checkpoint_ctx *c = ctx;
    CHECK_OK(rf_checkpoint_save(c->path, c->w.m, NULL)); /* the file as it was */
    rf_clear_error();
    fail_from(k, persistent);
    rf_status st = rf_checkpoint_save(c->path, c->w.m, c->w.opt);
    bool failed = disarm();
    CHECK(files_in(c->dir) == 1);
    if (st != RF_OK) {
        check_failure(st, k, failed);
        /* the old file: the model alone, so loading with the optimiser fails */
        CHECK_STATUS(rf_checkpoint_load(c->path, c->w.m, c->w.opt), RF_E_CORRUPT);
        CHECK_OK(rf_checkpoint_load(c->path, c->w.m, NULL));
    } else {
        check_file_holds(c, c->current);
    }
    return failed;
}

static bool attempt_load(void *ctx, int64_t k, bool persistent)
{
    checkpoint_ctx *c = ctx;
    rf_clear_error();
    fail_from(k, persistent);
    rf_status st = rf_checkpoint_load(c->path, c->w.m, c->w.opt);
    bool failed = disarm();
    snapshot got = take_snapshot(c->w.m, c->w.opt);
    if (st != RF_OK) {
        check_failure(st, k, failed);
        CHECK(same_snapshot(got, c->current));
    } else {
        CHECK(same_snapshot(got, c->saved));
    }
    free(got.bytes);
    restore(&c->w, c->current);
    return failed;
}

static void scenario_checkpoint(void)
{
    checkpoint_ctx c = {0};
    snprintf(c.dir, sizeof c.dir, "/tmp/rf-test-oom-%d", (int)getpid());
    snprintf(c.path, sizeof c.path, "%s/model.safetensors", c.dir);
    tu_remove_tree(c.dir);
    if (mkdir(c.dir, 0700) != 0 || !world_make(&c.w)) {
        CHECK(!"checkpoint set-up");
        return;
    }
    rf_array *batch[2] = {c.w.x, c.w.y};
    CHECK_OK(rf_trainstep(ce_loss, NULL, c.w.m, batch, 2, c.w.opt, NULL, NULL));
    c.saved = take_snapshot(c.w.m, c.w.opt);
    CHECK_OK(rf_trainstep(ce_loss, NULL, c.w.m, batch, 2, c.w.opt, NULL, NULL));
    c.current = take_snapshot(c.w.m, c.w.opt);
    sweep("checkpoint save", attempt_save, &c);
    restore(&c.w, c.saved);
    CHECK_OK(rf_checkpoint_save(c.path, c.w.m, c.w.opt));
    restore(&c.w, c.current);
    sweep("checkpoint load", attempt_load, &c);
    free(c.saved.bytes);
    free(c.current.bytes);
    world_free(&c.w);
    tu_remove_tree(c.dir);
}

/* A shuffling loader moved to the device (its batches made on a background
 * thread) and rf_train over it: failures are errors, and the next epoch runs. */
typedef struct loader_ctx {
    world w;
    rf_array *xs, *ys; /* host data: 20 observations */
    double sum_ref;    /* of every batch's first elements over one epoch */
} loader_ctx;

static rf_loader *make_loader(loader_ctx *c, bool to_device)
{
    rf_array *arrays[2] = {c->xs, c->ys};
    rf_loader_opts o = {.batchsize = 8, .shuffle = true, .seed = 5};
    rf_loader *l = rf_loader_new(arrays, 2, &o);
    if (l && to_device && rf_loader_to(l, rf_device_cpu()) != RF_OK) {
        rf_loader_free(l);
        return NULL;
    }
    return l;
}

/* One epoch's checksum, or NaN with the status in *st. */
static double epoch_sum(rf_loader *l, rf_status *st)
{
    double sum = 0;
    rf_array *const *b = NULL;
    while ((*st = rf_loader_next(l, &b)) == RF_OK && b) {
        const float *x = rf_array_data(b[0]);
        const int32_t *y = rf_array_data(b[1]);
        if (!x || !y)
            return NAN;
        sum = sum * 3 + x[0] + y[0];
    }
    return *st == RF_OK ? sum : NAN;
}

static bool attempt_loader(void *ctx, int64_t k, bool persistent)
{
    loader_ctx *c = ctx;
    rf_clear_error();
    fail_from(k, persistent);
    rf_loader *l = make_loader(c, true);
    rf_status st = l ? RF_OK : RF_E_NOMEM;
    double sum = l ? epoch_sum(l, &st) : NAN;
    bool failed = disarm();
    if (!l || st != RF_OK) {
        check_failure(st, k, failed);
        if (l) { /* the next epoch, with memory */
            CHECK_OK(rf_loader_reset(l));
            CHECK(epoch_sum(l, &st) != 0 && st == RF_OK);
        }
    } else {
        CHECK(sum == c->sum_ref);
    }
    rf_loader_free(l);
    return failed;
}

static bool attempt_train(void *ctx, int64_t k, bool persistent)
{
    loader_ctx *c = ctx;
    rf_loader *l = make_loader(c, true);
    rf_model_cache_clear(c->w.m);
    rf_train_opts o = {.progress = RF_PROGRESS_OFF};
    rf_clear_error();
    fail_from(k, persistent);
    rf_status st = l ? rf_train(ce_loss, NULL, c->w.m, l, c->w.opt, &o) : RF_E_NOMEM;
    bool failed = disarm();
    if (st != RF_OK) {
        check_failure(st, k, failed);
        CHECK_OK(l ? rf_loader_reset(l) : RF_E_NOMEM);
        CHECK_OK(l ? rf_train(ce_loss, NULL, c->w.m, l, c->w.opt, &o) : RF_E_NOMEM);
    }
    rf_loader_free(l);
    return failed;
}

static void scenario_loader(void)
{
    loader_ctx c = {0};
    if (!world_made(&c.w))
        return;
    int32_t labels[20];
    for (int i = 0; i < 20; i++)
        labels[i] = i % CLASSES;
    c.xs = rf_randn(RF_F32, RF_SHAPE(20, IN), 11);
    c.ys = rf_array_from(RF_I32, RF_SHAPE(20), labels);
    rf_loader *l = c.xs && c.ys ? make_loader(&c, true) : NULL;
    rf_status st = RF_E_NOMEM;
    c.sum_ref = l ? epoch_sum(l, &st) : NAN;
    CHECK_OK(st);
    CHECK(isfinite(c.sum_ref));
    rf_loader_free(l);
    sweep("device loader epoch", attempt_loader, &c);
    sweep("rf_train epoch", attempt_train, &c);
    rf_array_free(c.xs);
    rf_array_free(c.ys);
    world_free(&c.w);
}

/* A compile that calls the C compiler (a program the disk cache has not
 * seen: each attempt compiles the forward pass at a new batch size, in a
 * cache directory of the test's own): lowering, rendering, the compiler
 * driver and the cache's writes. Each attempt runs the compiler, so only 24
 * allocations spread over the compile are tried unless RF_OOM_FULL is set. */
typedef struct cold_ctx {
    rf_model *m;
    rf_array *xs;             /* ROWS rows; each attempt takes the first 9 + compiles */
    float ref[CLASSES];       /* the first row's outputs */
    int64_t n_allocs, stride; /* of one cold compile and run, and between tries */
    int64_t tries, compiles;
} cold_ctx;

enum { ROWS = 8192 };

static bool compile_rows(cold_ctx *c, int64_t rows, int64_t k, bool persistent, bool *failed)
{
    rf_array *x = rf_array_rows(c->xs, 0, rows);
    rf_exec *e = NULL;
    rf_array *y = NULL;
    rf_clear_error();
    if (k >= 0)
        fail_from(k, persistent);
    rf_status st = x ? rf_compile_model(c->m, x, &e) : RF_E_NOMEM;
    if (st == RF_OK)
        st = rf_exec_run(e, &x, 1, &y, 1);
    *failed = disarm();
    if (st != RF_OK) {
        check_failure(st, k, *failed);
        CHECK(y == NULL);
        if (!e)
            CHECK_OK(rf_compile_model(c->m, x, &e));
        if (e)
            CHECK_OK(rf_exec_run(e, &x, 1, &y, 1));
    }
    /* the first row as at batch 8 (the products' kernels may differ by size) */
    const float *got = y ? rf_array_data(y) : NULL;
    CHECK(got != NULL);
    for (int i = 0; got && i < CLASSES; i++)
        CHECK_NEAR(got[i], c->ref[i], 1e-6, 1e-5);
    rf_array_free(y);
    rf_exec_free(e);
    rf_array_free(x);
    return st == RF_OK;
}

static bool attempt_cold_compile(void *ctx, int64_t k, bool persistent)
{
    cold_ctx *c = ctx;
    bool failed = false;
    int64_t at = full_sweep ? k : first_k + c->tries * c->stride;
    if (!full_sweep && at > c->n_allocs) {
        c->tries = 0; /* the next sweep starts again */
        return false;
    }
    c->tries++;
    compile_rows(c, 9 + c->compiles++, at, persistent, &failed);
    return failed || !full_sweep;
}

static void scenario_cold_compile(void)
{
    const char *backend = getenv("RF_BACKEND");
    if (backend && strcmp(backend, "interp") == 0)
        return; /* the interpreter compiles nothing */
    char dir[64];
    snprintf(dir, sizeof dir, "/tmp/rf-test-oom-cache-%d", (int)getpid());
    char *old = getenv("RF_CACHE_DIR") ? strdup(getenv("RF_CACHE_DIR")) : NULL;
    setenv("RF_CACHE_DIR", dir, 1);
    world w;
    cold_ctx c = {0};
    if (!world_made(&w))
        return;
    rf_testmode(w.m);
    c.m = w.m;
    rf_array *xh = rf_randn(RF_F32, RF_SHAPE(ROWS, IN), 13);
    c.xs = xh ? rf_array_to(xh, rf_device_cpu()) : NULL;
    rf_array_free(xh);
    rf_array *x8 = c.xs ? rf_array_rows(c.xs, 0, 8) : NULL, *y = NULL;
    CHECK_OK(rf_jit_model(w.m, x8, &y)); /* the reference; also the compiler's memos */
    const float *ref = y ? rf_array_data(y) : NULL;
    CHECK(ref != NULL);
    if (ref)
        memcpy(c.ref, ref, sizeof c.ref);
    rf_array_free(y);
    rf_array_free(x8);
    uint64_t before = rfi_alloc_count();
    bool failed;
    compile_rows(&c, ROWS, -1, false, &failed);
    c.n_allocs = (int64_t)(rfi_alloc_count() - before);
    c.stride = c.n_allocs / 24 + 1;
    printf("a compile that runs the compiler: %lld allocations\n", (long long)c.n_allocs);
    sweep("compile that runs the compiler", attempt_cold_compile, &c);
    rf_array_free(c.xs);
    world_free(&w);
    tu_remove_tree(dir);
    if (old)
        setenv("RF_CACHE_DIR", old, 1);
    else
        unsetenv("RF_CACHE_DIR");
    free(old);
}

int main(void)
{
    const char *full = getenv("RF_OOM_FULL");
    full_sweep = full && strcmp(full, "1") == 0;
    const char *from = getenv("RF_OOM_FROM");
    first_k = from ? atoll(from) : 0;
    sweep("model and optimiser", attempt_build, NULL);
    scenario_first_step(false, false);
    scenario_first_step(true, false);
    scenario_first_step(false, true);
    scenario_inference();
    scenario_convolutions();
    scenario_failed_run();
    scenario_checkpoint();
    scenario_loader();
    scenario_cold_compile();
    return tu_finish("test_oom");
}
