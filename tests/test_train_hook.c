/* test_train_hook.c: rf_train's on_step callback: what it is told, stopping a
 * pass early (not an error: status, batches_done, stopped, the bar and the
 * means), a per-step learning-rate schedule with rf_adjust (no recompile),
 * rf_opt_freeze and rf_checkpoint_save called from it, the errors it reports
 * (rf_set_error, a failed reflux call's message, no message), and bad
 * answers (a value that is neither, a moved loader); and the global gradient
 * norm an optimiser may track (rf_opt_track_grad_norm) in the step's stats; on
 * the seed's model Chain(Dense(4 => 8, tanh), Dense(8 => 2)) over 8 batches of 8.
 *
 * Oracle: the same steps taken by hand with rf_trainstep on a second copy of
 * the model, over the same batches, with the same rf_adjust / rf_opt_freeze
 * calls between them; their losses, parameters and optimiser state must be
 * bitwise those of the hooked pass. The gradient norm's: the norm of the
 * gradients of an f64 copy of the model, summed in double on the host.
 */
#include "test_util.h"

#define ROWS 64
#define BATCH 8
#define NB (ROWS / BATCH)

static rf_device *cpu;
static float xs[ROWS * 4], ys[ROWS * 2];

static rf_model *host_model(void)
{
    rf_nn_seed(42);
    return rf_chain(rf_dense(4, 8, RF_ACT_TANH), rf_dense(8, 2, RF_ACT_IDENTITY));
}

static rf_tensor *aux_loss(rf_model *m, rf_tensor *const *b, int n, rf_aux *aux, void *ctx)
{
    (void)n;
    (void)ctx;
    rf_tensor *yhat = rf_apply(m, b[0]);
    rf_aux_set(aux, "acc", rf_accuracy(yhat, b[1]));
    return rf_mse(yhat, b[1]);
}

static rf_loader *make_loader(void)
{
    rf_array *X = rf_array_from(RF_F32, RF_SHAPE(ROWS, 4), xs);
    rf_array *Y = rf_array_from(RF_F32, RF_SHAPE(ROWS, 2), ys);
    rf_loader *l = rf_loader_new((rf_array *[]){X, Y}, 2, &(rf_loader_opts){.batchsize = BATCH});
    rf_array_free(X);
    rf_array_free(Y);
    if (l && rf_loader_to(l, cpu) != RF_OK) {
        rf_loader_free(l);
        return NULL;
    }
    return l;
}

/* Batch b (0-based) of the loader above, as device arrays (x, y), made f64 if asked. */
static void batch_of(int b, rf_array *out[2], bool f64)
{
    rf_array *hx = rf_array_from(RF_F32, RF_SHAPE(BATCH, 4), xs + b * BATCH * 4);
    rf_array *hy = rf_array_from(RF_F32, RF_SHAPE(BATCH, 2), ys + b * BATCH * 2);
    rf_to_opts to = {.to_f64 = f64};
    out[0] = rf_array_to_opts(hx, cpu, &to);
    out[1] = rf_array_to_opts(hy, cpu, &to);
    rf_array_free(hx);
    rf_array_free(hy);
}

/* A model on the CPU with its optimiser, from the seed's host model. */
typedef struct run {
    rf_model *m;
    rf_opt *opt;
    bool f64; /* the model's (and so its batches') floats are f64 */
} run;

static run run_new(rf_rule *rule)
{
    rf_model *host = host_model();
    run r = {rf_model_to(host, cpu), NULL, false};
    rf_model_free(host);
    r.opt = rf_setup(rule, r.m);
    return r;
}

static void run_free(run *r)
{
    rf_opt_free(r->opt);
    rf_model_free(r->m);
}

/* Every byte of a model's and an optimiser's arrays, in visit order. */
typedef struct image {
    unsigned char *bytes;
    size_t n;
} image;

static void image_one(const char *path, rf_array *a, bool trainable, void *ud)
{
    (void)path;
    (void)trainable;
    image *im = ud;
    size_t nb = rf_array_nbytes(a);
    im->bytes = realloc(im->bytes, im->n + nb);
    rf_array_read(a, im->bytes + im->n, nb);
    im->n += nb;
}

static image image_of(rf_model *m, rf_opt *opt)
{
    image im = {NULL, 0};
    rf_model_visit(m, image_one, &im);
    if (opt)
        rf_opt_visit(opt, image_one, &im);
    return im;
}

static bool same_state(rf_model *m1, rf_opt *o1, rf_model *m2, rf_opt *o2)
{
    image a = image_of(m1, o1), b = image_of(m2, o2);
    bool same = a.n == b.n && a.n > 0 && memcmp(a.bytes, b.bytes, a.n) == 0;
    free(a.bytes);
    free(b.bytes);
    return same;
}

/* The bytes of one parameter (by path). */
typedef struct find {
    const char *path;
    float v[64];
} find;

static void find_one(const char *path, rf_array *a, bool trainable, void *ud)
{
    (void)trainable;
    find *f = ud;
    if (strcmp(path, f->path) == 0 && rf_array_nbytes(a) <= sizeof f->v)
        rf_array_read(a, f->v, rf_array_nbytes(a));
}

static find param_of(rf_model *m, const char *path)
{
    find f;
    memset(&f, 0, sizeof f);
    f.path = path;
    rf_model_visit(m, find_one, &f);
    return f;
}

/* One hand step on batch b (0-based) of the pass. */
static double hand_step(run *r, int b, rf_stats *s)
{
    rf_array *batch[2];
    batch_of(b, batch, r->f64);
    double l = NAN;
    CHECK_OK(rf_trainstep(aux_loss, NULL, r->m, batch, 2, r->opt, &l, s));
    rf_array_free(batch[0]);
    rf_array_free(batch[1]);
    return l;
}

/* ---- What the callback records and does ----------------------------------------------------------- */

typedef struct hooklog {
    int calls;
    rf_step_info info[4 * NB];
    int stop_after; /* RF_TRAIN_STOP after this batch (0: never) */
    /* what the callback does */
    double lr0;         /* > 0: rf_adjust(opt, lr0 / step) */
    int freeze_after;   /* > 0: rf_opt_freeze(opt, "0") after this batch */
    int switch_after;   /* > 0: switch the gradient norm's tracking after this batch */
    find frozen_at;     /* layer 0's weight when it was frozen */
    int save_every;     /* > 0: a checkpoint every this many steps */
    const char *dir;
    rf_status saved;
    int answer_after;   /* > 0: return `answer` after this batch */
    int answer;
    const char *how;    /* "set": rf_set_error, "fail": a failed reflux call, else nothing */
    rf_loader *loader;  /* set: rf_loader_next on it (not allowed) */
    rf_loader *where;   /* set: its position read at each save (allowed) */
    int64_t saved_at[NB];
} hooklog;

static int on_step(const rf_step_info *info, void *user)
{
    hooklog *g = user;
    if (g->calls < 4 * NB)
        g->info[g->calls] = *info;
    g->calls++;
    if (g->lr0 > 0)
        CHECK_OK(rf_adjust(info->opt, g->lr0 / (double)(info->step + 1)));
    if (g->switch_after == info->batch)
        CHECK_OK(rf_opt_track_grad_norm(info->opt, !rf_opt_tracks_grad_norm(info->opt)));
    if (g->freeze_after == info->batch) {
        CHECK_OK(rf_opt_freeze(info->opt, "0"));
        g->frozen_at = param_of(info->model, "0.weight");
    }
    if (g->save_every > 0 && info->step % g->save_every == 0) {
        char path[512];
        snprintf(path, sizeof path, "%s/step-%lld.safetensors", g->dir, (long long)info->step);
        g->saved = rf_checkpoint_save(path, info->model, info->opt);
        CHECK_OK(g->saved);
        if (g->where && info->step < NB) { /* what a resumed run seeks to */
            uint64_t epoch = 99;
            rf_loader_position(g->where, &epoch, &g->saved_at[info->step]);
            CHECK(epoch == 1); /* rf_train reset it once */
        }
    }
    if (g->loader && info->batch == 2) {
        rf_array *const *b;
        CHECK_OK(rf_loader_next(g->loader, &b));
    }
    if (g->answer_after == info->batch) {
        if (g->how && strcmp(g->how, "set") == 0)
            return rf_set_error((rf_status)g->answer, "validation loss %.1f diverged", 12.5);
        if (g->how && strcmp(g->how, "fail") == 0) /* a directory is not a checkpoint file */
            CHECK_STATUS(rf_checkpoint_save(g->dir, info->model, info->opt), RF_E_IO);
        if (g->how && strcmp(g->how, "cleared") == 0) { /* a failure handled, then cleared */
            CHECK_STATUS(rf_checkpoint_save(g->dir, info->model, info->opt), RF_E_IO);
            rf_clear_error();
        }
        return g->answer;
    }
    return g->stop_after == info->batch ? RF_TRAIN_STOP : RF_TRAIN_CONTINUE;
}

/* ---- Stopping early, and what the callback is told ------------------------------------- */

static void test_stop_and_info(void)
{
    run r = run_new(rf_adam(1e-2)), hand = run_new(rf_adam(1e-2));
    rf_loader *data = make_loader();
    CHECK(r.m && r.opt && hand.m && hand.opt && data);
    hooklog g;
    memset(&g, 0, sizeof g);
    g.stop_after = 3;
    double mean = NAN;
    rf_stats ms;
    int64_t done = -1;
    bool stopped = false;
    captured c;
    capture_start(&c);
    rf_status st = rf_train(aux_loss, NULL, r.m, data, r.opt,
                            &(rf_train_opts){.progress = RF_PROGRESS_ON, .label = "e1",
                                             .mean_loss = &mean, .mean_stats = &ms,
                                             .on_step = on_step, .user = &g,
                                             .batches_done = &done, .stopped = &stopped});
    char *err = capture_end(&c);
    CHECK_OK(st);
    CHECK(g.calls == 3 && done == 3 && stopped);
    CHECK(rf_opt_steps(r.opt) == 3);
    /* the bar ends at the last batch stepped and says why */
    CHECK(err && strstr(err, "3/8 loss=") != NULL && strstr(err, " (stopped)\n") != NULL);
    CHECK(err && strstr(err, "4/8") == NULL);
    fprintf(stderr, "stopped bar: %s", err ? err : "");
    free(err);

    /* the hand loop's losses, stats and state are the hooked pass's, bitwise */
    double sum = 0, acc = 0;
    for (int b = 0; b < 3; b++) {
        rf_stats s;
        double l = hand_step(&hand, b, &s);
        const rf_step_info *in = &g.info[b];
        CHECK(in->batch == b + 1 && in->n_batches == NB && in->step == b + 1);
        CHECK(in->batch_size == BATCH && in->samples == (int64_t)(b + 1) * BATCH);
        CHECK(in->model == r.m && in->opt == r.opt);
        CHECK(in->loss == l);
        CHECK(in->stats.n == 1 && rf_stats_get(&in->stats, "acc") == rf_stats_get(&s, "acc"));
        sum += l;
        acc += rf_stats_get(&s, "acc");
        CHECK_NEAR(in->mean_loss, sum / (b + 1), 1e-15, 1e-12);
        CHECK(in->elapsed > 0 && (b == 0 || in->elapsed >= g.info[b - 1].elapsed));
    }
    CHECK(same_state(r.m, r.opt, hand.m, hand.opt));
    /* the means are over the batches stepped, the stopping one included */
    CHECK_NEAR(mean, sum / 3, 1e-15, 1e-12);
    CHECK(ms.n == 1);
    CHECK_NEAR(rf_stats_get(&ms, "acc"), acc / 3, 1e-15, 1e-12);

    /* the next pass starts over at batch 1; the global step goes on */
    memset(&g, 0, sizeof g);
    CHECK_OK(rf_train(aux_loss, NULL, r.m, data, r.opt,
                      &(rf_train_opts){.on_step = on_step, .user = &g, .batches_done = &done,
                                       .stopped = &stopped}));
    CHECK(g.calls == NB && done == NB && !stopped);
    CHECK(g.info[0].batch == 1 && g.info[0].step == 4);
    CHECK(g.info[NB - 1].batch == NB && g.info[NB - 1].step == 3 + NB);
    CHECK(g.info[NB - 1].samples == ROWS);
    for (int b = 0; b < NB; b++)
        CHECK(g.info[b].loss == hand_step(&hand, b, NULL));
    CHECK(same_state(r.m, r.opt, hand.m, hand.opt));

    /* stopping after the first batch: the pass's means are that batch's */
    memset(&g, 0, sizeof g);
    g.stop_after = 1;
    CHECK_OK(rf_train(aux_loss, NULL, r.m, data, r.opt,
                      &(rf_train_opts){.mean_loss = &mean, .on_step = on_step, .user = &g,
                                       .batches_done = &done, .stopped = &stopped}));
    CHECK(g.calls == 1 && done == 1 && stopped && mean == g.info[0].loss);
    CHECK(rf_opt_steps(r.opt) == 4 + NB);
    rf_loader_free(data);
    run_free(&r);
    run_free(&hand);
}

/* ---- A learning-rate schedule, freezing, checkpoints --------------------------------- */

static void test_schedule(void)
{
    run r = run_new(rf_adam(1e-2)), hand = run_new(rf_adam(1e-2)), flat = run_new(rf_adam(1e-2));
    rf_loader *data = make_loader();
    hooklog g;
    memset(&g, 0, sizeof g);
    g.lr0 = 0.05;
    for (int pass = 0; pass < 2; pass++)
        CHECK_OK(rf_train(aux_loss, NULL, r.m, data, r.opt,
                          &(rf_train_opts){.on_step = on_step, .user = &g}));
    CHECK(g.calls == 2 * NB);
    /* one compiled step for every rate */
    rf_cache_stats cs = rf_model_cache_stats(r.m);
    CHECK(cs.compiles == 1 && cs.entries == 1 && cs.hits == 2 * NB - 1);
    CHECK_NEAR(rf_opt_lr(r.opt), 0.05 / (2 * NB + 1), 1e-9, 1e-6);
    /* the hand loop sets each rate between the same steps */
    for (int pass = 0; pass < 2; pass++) {
        for (int b = 0; b < NB; b++) {
            hand_step(&hand, b, NULL);
            hand_step(&flat, b, NULL);
            CHECK_OK(rf_adjust(hand.opt, 0.05 / (double)(rf_opt_steps(hand.opt) + 1)));
        }
    }
    CHECK(same_state(r.m, r.opt, hand.m, hand.opt));
    CHECK(!same_state(r.m, NULL, flat.m, NULL)); /* the schedule changed the steps */
    rf_loader_free(data);
    run_free(&r);
    run_free(&hand);
    run_free(&flat);
}

static void test_freeze(void)
{
    run r = run_new(rf_adam(1e-2)), hand = run_new(rf_adam(1e-2));
    rf_loader *data = make_loader();
    hooklog g;
    memset(&g, 0, sizeof g);
    g.freeze_after = 2;
    CHECK_OK(rf_train(aux_loss, NULL, r.m, data, r.opt,
                      &(rf_train_opts){.on_step = on_step, .user = &g}));
    CHECK(g.calls == NB && rf_opt_n_frozen(r.opt) == 2);
    /* layer 0 kept the values it had when frozen; one more compile, for the frozen set */
    find now = param_of(r.m, "0.weight");
    CHECK(memcmp(now.v, g.frozen_at.v, sizeof now.v) == 0);
    CHECK(rf_model_cache_stats(r.m).compiles == 2);
    for (int b = 0; b < NB; b++) {
        hand_step(&hand, b, NULL);
        if (b == 1)
            CHECK_OK(rf_opt_freeze(hand.opt, "0"));
    }
    CHECK(same_state(r.m, r.opt, hand.m, hand.opt));
    rf_loader_free(data);
    run_free(&r);
    run_free(&hand);
}

static void test_checkpoints(void)
{
    char dir[] = "/tmp/rf_hook_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    run r = run_new(rf_adam(1e-2)), hand = run_new(rf_adam(1e-2)), back = run_new(rf_adam(1e-2));
    rf_loader *data = make_loader();
    hooklog g;
    memset(&g, 0, sizeof g);
    g.save_every = 3;
    g.dir = dir;
    g.where = data;
    CHECK_OK(rf_train(aux_loss, NULL, r.m, data, r.opt,
                      &(rf_train_opts){.on_step = on_step, .user = &g}));
    CHECK(g.calls == NB && g.saved == RF_OK);
    CHECK(g.saved_at[3] == 3 && g.saved_at[6] == 6);
    /* the file of step 3 holds what 3 hand steps make, optimiser state included */
    for (int b = 0; b < 3; b++)
        hand_step(&hand, b, NULL);
    char path[512];
    snprintf(path, sizeof path, "%s/step-3.safetensors", dir);
    CHECK_OK(rf_checkpoint_load(path, back.m, back.opt));
    CHECK(rf_opt_steps(back.opt) == 3);
    CHECK(same_state(back.m, back.opt, hand.m, hand.opt));
    /* step 6's holds 3 more; the pass went on after both saves */
    for (int b = 3; b < 6; b++)
        hand_step(&hand, b, NULL);
    snprintf(path, sizeof path, "%s/step-6.safetensors", dir);
    CHECK_OK(rf_checkpoint_load(path, back.m, back.opt));
    CHECK(same_state(back.m, back.opt, hand.m, hand.opt));
    for (int b = 6; b < NB; b++)
        hand_step(&hand, b, NULL);
    CHECK(same_state(r.m, r.opt, hand.m, hand.opt));
    rf_loader_free(data);
    run_free(&r);
    run_free(&hand);
    run_free(&back);
    tu_remove_tree(dir);
}

/* The model is free to use in the callback: the step's run is over and the model's in-step
 * flag released, so an evaluation and even another step of it run there. */
typedef struct busy {
    int calls;
    int64_t steps[2];
    float yhat[BATCH * 2];
} busy;

static int busy_step(const rf_step_info *info, void *user)
{
    busy *b = user;
    if (b->calls < 2)
        b->steps[b->calls] = info->step;
    if (b->calls++ == 0) {
        rf_array *batch[2], *y = NULL;
        batch_of(0, batch, false);
        CHECK_OK(rf_jit_model(info->model, batch[0], &y));
        CHECK(y && rf_array_read(y, b->yhat, sizeof b->yhat) == RF_OK);
        double l;
        CHECK_OK(rf_trainstep(aux_loss, NULL, info->model, batch, 2, info->opt, &l, NULL));
        rf_array_free(y);
        rf_array_free(batch[0]);
        rf_array_free(batch[1]);
    }
    return b->calls == 2 ? RF_TRAIN_STOP : RF_TRAIN_CONTINUE;
}

static void test_model_in_callback(void)
{
    run r = run_new(rf_adam(1e-2)), hand = run_new(rf_adam(1e-2));
    rf_loader *data = make_loader();
    busy b;
    memset(&b, 0, sizeof b);
    CHECK_OK(rf_train(aux_loss, NULL, r.m, data, r.opt,
                      &(rf_train_opts){.on_step = busy_step, .user = &b}));
    CHECK(b.calls == 2 && b.steps[0] == 1 && b.steps[1] == 3);
    /* by hand: batch 0, the forward pass, batch 0 again, batch 1 */
    hand_step(&hand, 0, NULL);
    rf_array *batch[2], *y = NULL;
    batch_of(0, batch, false);
    CHECK_OK(rf_jit_model(hand.m, batch[0], &y));
    float want[BATCH * 2];
    CHECK(y && rf_array_read(y, want, sizeof want) == RF_OK);
    CHECK(memcmp(want, b.yhat, sizeof want) == 0);
    rf_array_free(y);
    rf_array_free(batch[0]);
    rf_array_free(batch[1]);
    hand_step(&hand, 0, NULL);
    hand_step(&hand, 1, NULL);
    CHECK(same_state(r.m, r.opt, hand.m, hand.opt));
    rf_loader_free(data);
    run_free(&r);
    run_free(&hand);
}

/* ---- Errors ----------------------------------------------------------------------------- */

/* A pass whose callback answers `answer` after batch `after`, `how` as in hooklog. */
static rf_status answering(run *r, rf_loader *data, int after, int answer, const char *how,
                           int64_t *done)
{
    hooklog g;
    memset(&g, 0, sizeof g);
    g.answer_after = after;
    g.answer = answer;
    g.how = how;
    g.dir = "/tmp";
    bool stopped = true;
    rf_status st = rf_train(aux_loss, NULL, r->m, data, r->opt,
                            &(rf_train_opts){.on_step = on_step, .user = &g,
                                             .batches_done = done, .stopped = &stopped});
    CHECK(!stopped);
    CHECK(g.calls == (after > 0 ? after : NB));
    return st;
}

static void test_errors(void)
{
    run r = run_new(rf_adam(1e-2));
    rf_loader *data = make_loader();
    int64_t done = -1;
    int64_t steps = 0;

    /* an error of a reflux call in the callback, passed on with its message */
    CHECK_STATUS(answering(&r, data, 2, RF_E_IO, "fail", &done), RF_E_IO);
    CHECK_MSG("rf_train: on_step returned RF_E_IO after batch 2: rf_checkpoint_save");
    CHECK(done == 2 && rf_opt_steps(r.opt) == (steps += 2));
    /* the callback's own, with rf_set_error */
    CHECK_STATUS(answering(&r, data, 1, RF_E_DOMAIN, "set", &done), RF_E_DOMAIN);
    CHECK_MSG("rf_train: on_step returned RF_E_DOMAIN after batch 1: validation loss 12.5 "
              "diverged");
    CHECK(rf_errstatus() == RF_E_DOMAIN);
    CHECK(done == 1 && rf_opt_steps(r.opt) == (steps += 1));
    /* none: an older message is not quoted as the callback's */
    rf_set_error(RF_E_CORRUPT, "an older failure");
    CHECK_STATUS(answering(&r, data, 3, RF_E_INTERNAL, NULL, &done), RF_E_INTERNAL);
    CHECK_MSG("rf_train: on_step returned RF_E_INTERNAL after batch 3 (with no message");
    CHECK(strstr(rf_errmsg(), "older") == NULL);
    CHECK(done == 3 && rf_opt_steps(r.opt) == (steps += 3));
    /* a failure the callback cleared is no message either */
    CHECK_STATUS(answering(&r, data, 1, RF_E_IO, "cleared", &done), RF_E_IO);
    CHECK_MSG("rf_train: on_step returned RF_E_IO after batch 1 (with no message");
    CHECK(done == 1 && rf_opt_steps(r.opt) == (steps += 1));
    /* neither an answer nor a status */
    int bad[] = {42, -2, RF_STATUS_COUNT, -1000000};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        CHECK_STATUS(answering(&r, data, 1, bad[i], NULL, &done), RF_E_INVALID);
        char want[64];
        snprintf(want, sizeof want, "on_step returned %d after batch 1;", bad[i]);
        CHECK_MSG(want);
        CHECK(done == 1 && rf_opt_steps(r.opt) == (steps += 1));
    }
    /* RF_TRAIN_CONTINUE by its value is a whole pass */
    CHECK_OK(answering(&r, data, 0, 0, NULL, &done));
    CHECK(done == NB && rf_opt_steps(r.opt) == (steps += NB));

    /* moving rf_train's loader */
    hooklog g;
    memset(&g, 0, sizeof g);
    g.loader = data;
    CHECK_STATUS(rf_train(aux_loss, NULL, r.m, data, r.opt,
                          &(rf_train_opts){.on_step = on_step, .user = &g,
                                           .batches_done = &done}), RF_E_INVALID);
    CHECK_MSG("rf_train: on_step moved the loader after batch 2");
    CHECK(g.calls == 2 && done == 2 && rf_opt_steps(r.opt) == (steps += 2));

    /* a NaN batch stops the pass before the callback hears of it */
    float saved = xs[3 * BATCH * 4];
    xs[3 * BATCH * 4] = NAN; /* batch 4 */
    rf_loader *nan_data = make_loader();
    xs[3 * BATCH * 4] = saved;
    memset(&g, 0, sizeof g);
    double mean = NAN;
    bool stopped = true;
    CHECK_STATUS(rf_train(aux_loss, NULL, r.m, nan_data, r.opt,
                          &(rf_train_opts){.on_step = on_step, .user = &g, .mean_loss = &mean,
                                           .batches_done = &done, .stopped = &stopped}),
                 RF_E_DOMAIN);
    CHECK_MSG("loss is NaN on batch 4");
    CHECK(g.calls == 3 && done == 3 && !stopped && rf_opt_steps(r.opt) == (steps += 3));
    CHECK_NEAR(mean, (g.info[0].loss + g.info[1].loss + g.info[2].loss) / 3, 1e-15, 1e-12);
    rf_loader_free(nan_data);

    /* bad arguments still set the out fields */
    done = -1;
    stopped = true;
    CHECK_STATUS(rf_train(NULL, NULL, r.m, data, r.opt,
                          &(rf_train_opts){.batches_done = &done, .stopped = &stopped}),
                 RF_E_INVALID);
    CHECK(done == 0 && !stopped);
    CHECK(rf_opt_steps(r.opt) == steps);

    /* rf_set_error: only error statuses */
    CHECK(rf_set_error(RF_E_IO, "disk %s", "full") == RF_E_IO);
    CHECK(rf_errstatus() == RF_E_IO && strcmp(rf_errmsg(), "disk full") == 0);
    /* quoting the failure it wraps: the arguments may be the message itself */
    CHECK(rf_set_error(RF_E_IO, "checkpoint at step %d: %s", 17, rf_errmsg()) == RF_E_IO);
    CHECK(strcmp(rf_errmsg(), "checkpoint at step 17: disk full") == 0);
    CHECK(rf_set_error(RF_OK, "fine") == RF_E_INVALID);
    CHECK_MSG("rf_set_error: status 0 is not an error status");
    CHECK(rf_set_error((rf_status)99, "x") == RF_E_INVALID);
    CHECK_MSG("status 99");
    rf_status (*set)(rf_status, const char *, ...) = rf_set_error; /* a NULL format */
    CHECK(set(RF_E_SHAPE, NULL) == RF_E_SHAPE);
    CHECK(strcmp(rf_errmsg(), "RF_E_SHAPE") == 0);
    rf_clear_error();
    rf_loader_free(data);
    run_free(&r);
}

/* ---- The global gradient norm --------------------------------------------------------- */

/* A finite loss (that of aux_loss) whose gradients are NaN: sqrt's at 0 is Inf, times 0. */
static rf_tensor *nan_grad_loss(rf_model *m, rf_tensor *const *b, int n, rf_aux *aux,
                                void *ctx)
{
    (void)n;
    (void)ctx;
    (void)aux;
    rf_tensor *yhat = rf_apply(m, b[0]);
    return rf_add(rf_mse(yhat, b[1]), rf_sum_all(rf_sqrt(rf_sub(yhat, yhat))));
}

/* aux_loss's loss times 1e20: finite in f32, as its gradients are, whose squares are not */
static rf_tensor *huge_loss(rf_model *m, rf_tensor *const *b, int n, rf_aux *aux, void *ctx)
{
    return rf_mul(aux_loss(m, b, n, aux, ctx), rf_scalar(rf_tensor_trace(b[0]), 1e20));
}

static rf_tensor *named_norm_loss(rf_model *m, rf_tensor *const *b, int n, rf_aux *aux,
                                  void *ctx)
{
    (void)n;
    (void)ctx;
    rf_tensor *yhat = rf_apply(m, b[0]);
    rf_aux_set(aux, "grad_norm", rf_mean_all(yhat));
    return rf_mse(yhat, b[1]);
}

static rf_tensor *eight_aux_loss(rf_model *m, rf_tensor *const *b, int n, rf_aux *aux,
                                 void *ctx)
{
    (void)n;
    (void)ctx;
    rf_tensor *yhat = rf_apply(m, b[0]);
    for (int i = 0; i < RF_MAX_AUX; i++) {
        char name[8];
        snprintf(name, sizeof name, "a%d", i);
        rf_aux_set(aux, name, rf_mean_all(yhat));
    }
    return rf_mse(yhat, b[1]);
}

/* sqrt(sum of squares) over grads[from..n), in double on the host. */
static double host_norm(rf_array **g, int from, int n)
{
    double sum = 0;
    for (int i = from; i < n; i++) {
        rf_array *h = rf_array_to(g[i], rf_device_host());
        int64_t k = rf_array_numel(h);
        for (int64_t j = 0; j < k; j++) {
            double v = rf_array_dtype(h) == RF_F64 ? ((const double *)rf_array_data(h))[j]
                                                   : ((const float *)rf_array_data(h))[j];
            sum += v * v;
        }
        rf_array_free(h);
    }
    return sqrt(sum);
}

static void free_grads(rf_array **g, int n)
{
    for (int i = 0; i < n; i++)
        rf_array_free(g[i]);
    free(g);
}

/* One step with gradients on batch b: *ng gradients (owned), *s the step's stats. */
static rf_array **step_grads(run *r, int b, rf_loss_fn loss, int *ng, rf_stats *s)
{
    rf_array *batch[2];
    batch_of(b, batch, r->f64);
    rf_array **g = NULL;
    double l;
    *ng = 0;
    CHECK_OK(rf_trainstep_withgradient(loss, NULL, r->m, batch, 2, r->opt, &l, s, &g, ng));
    rf_array_free(batch[0]);
    rf_array_free(batch[1]);
    return g;
}

static void test_grad_norm(void)
{
    CHECK_STATUS(rf_opt_track_grad_norm(NULL, true), RF_E_INVALID);
    CHECK_MSG("rf_opt_track_grad_norm: opt is NULL");
    CHECK(!rf_opt_tracks_grad_norm(NULL));

    /* f32 and f64 copies of one model, stepped with lr 0 so both stay where they are */
    rf_model *host = host_model();
    run r = run_new(rf_descent(0.0));
    run r64 = {rf_model_to_opts(host, cpu, &(rf_to_opts){.to_f64 = true}), NULL, true};
    r64.opt = rf_setup(rf_descent(0.0), r64.m);
    rf_model_free(host);
    CHECK(r.m && r.opt && r64.m && r64.opt);

    /* off by default: no norm in the stats */
    rf_stats s;
    CHECK(!rf_opt_tracks_grad_norm(r.opt));
    hand_step(&r, 0, &s);
    CHECK(s.n == 1 && isnan(rf_stats_get(&s, RF_STATS_GRAD_NORM)));
    CHECK(rf_model_cache_stats(r.m).compiles == 1);

    CHECK_OK(rf_opt_track_grad_norm(r.opt, true));
    CHECK_OK(rf_opt_track_grad_norm(r64.opt, true));
    CHECK(rf_opt_tracks_grad_norm(r.opt));
    for (int b = 0; b < 3; b++) {
        int n32, n64;
        rf_stats s32, s64;
        rf_array **g32 = step_grads(&r, b, aux_loss, &n32, &s32);
        rf_array **g64 = step_grads(&r64, b, aux_loss, &n64, &s64);
        CHECK(n32 == 4 && n64 == 4);
        double norm32 = rf_stats_get(&s32, RF_STATS_GRAD_NORM);
        double norm64 = rf_stats_get(&s64, RF_STATS_GRAD_NORM);
        double ref = host_norm(g64, 0, n64); /* the float64 reference */
        CHECK(s32.n == 2 && strcmp(s32.names[1], RF_STATS_GRAD_NORM) == 0);
        CHECK(ref > 0);
        CHECK_NEAR(norm64, ref, 0, 1e-12);
        CHECK_NEAR(norm32, ref, 0, 2e-6);
        CHECK_NEAR(norm32, host_norm(g32, 0, n32), 0, 1e-6);
        /* the step without gradient outputs reports it too */
        hand_step(&r, b, &s);
        CHECK_NEAR(rf_stats_get(&s, RF_STATS_GRAD_NORM), ref, 0, 2e-6);
        if (b == 0)
            fprintf(stderr, "grad norm: %.9g (f32), %.17g (f64 reference)\n", norm32, ref);
        free_grads(g32, n32);
        free_grads(g64, n64);
    }
    /* a frozen layer's gradient does not count */
    CHECK_OK(rf_opt_freeze(r.opt, "0"));
    CHECK_OK(rf_opt_freeze(r64.opt, "0"));
    {
        int n32, n64;
        rf_stats s32, s64;
        rf_array **g32 = step_grads(&r, 0, aux_loss, &n32, &s32);
        rf_array **g64 = step_grads(&r64, 0, aux_loss, &n64, &s64);
        double ref = host_norm(g64, 2, n64); /* 1.weight, 1.bias */
        CHECK(ref > 0 && ref < host_norm(g64, 0, n64));
        CHECK_NEAR(rf_stats_get(&s32, RF_STATS_GRAD_NORM), ref, 0, 2e-6);
        CHECK_NEAR(rf_stats_get(&s64, RF_STATS_GRAD_NORM), ref, 0, 1e-12);
        free_grads(g32, n32);
        free_grads(g64, n64);
    }
    CHECK_OK(rf_opt_thaw(r.opt, "0"));
    /* one compiled step per setting: switching back compiles nothing */
    uint64_t compiles = rf_model_cache_stats(r.m).compiles;
    CHECK_OK(rf_opt_track_grad_norm(r.opt, false));
    hand_step(&r, 0, &s);
    CHECK(s.n == 1 && isnan(rf_stats_get(&s, RF_STATS_GRAD_NORM)));
    CHECK_OK(rf_opt_track_grad_norm(r.opt, true));
    hand_step(&r, 0, &s);
    CHECK(s.n == 2 && rf_stats_get(&s, RF_STATS_GRAD_NORM) > 0);
    CHECK(rf_model_cache_stats(r.m).compiles == compiles);

    /* the name is reserved, and takes one of the RF_MAX_AUX places */
    rf_array *batch[2];
    batch_of(0, batch, false);
    double l;
    CHECK_STATUS(rf_trainstep(named_norm_loss, NULL, r.m, batch, 2, r.opt, &l, &s),
                 RF_E_INVALID);
    CHECK_MSG("named \"grad_norm\"");
    CHECK_STATUS(rf_trainstep(eight_aux_loss, NULL, r.m, batch, 2, r.opt, &l, &s),
                 RF_E_INVALID);
    CHECK_MSG("it may record at most 7");
    CHECK_OK(rf_opt_track_grad_norm(r.opt, false));
    CHECK_OK(rf_trainstep(named_norm_loss, NULL, r.m, batch, 2, r.opt, &l, &s));
    CHECK_OK(rf_trainstep(eight_aux_loss, NULL, r.m, batch, 2, r.opt, &l, &s));
    CHECK(s.n == RF_MAX_AUX);
    rf_array_free(batch[0]);
    rf_array_free(batch[1]);

    /* rf_train: each step's norm reaches on_step, and their mean mean_stats */
    CHECK_OK(rf_opt_track_grad_norm(r.opt, true));
    rf_loader *data = make_loader();
    hooklog g;
    memset(&g, 0, sizeof g);
    rf_stats ms;
    CHECK_OK(rf_train(aux_loss, NULL, r.m, data, r.opt,
                      &(rf_train_opts){.on_step = on_step, .user = &g, .mean_stats = &ms}));
    double sum = 0;
    for (int b = 0; b < NB; b++) {
        double v = rf_stats_get(&g.info[b].stats, RF_STATS_GRAD_NORM);
        CHECK(isfinite(v) && v > 0);
        sum += v;
    }
    CHECK_NEAR(rf_stats_get(&ms, RF_STATS_GRAD_NORM), sum / NB, 1e-15, 1e-12);

    /* a non-finite gradient under a finite loss: with the norm tracked, no update */
    {
        image before = image_of(r.m, r.opt);
        int64_t steps = rf_opt_steps(r.opt);
        rf_array *nb[2];
        batch_of(0, nb, false);
        rf_array **ng = NULL;
        int nng = -1;
        CHECK_STATUS(rf_trainstep_withgradient(nan_grad_loss, NULL, r.m, nb, 2, r.opt, &l, &s,
                                               &ng, &nng),
                     RF_E_DOMAIN);
        CHECK_MSG("the gradient norm is NaN");
        CHECK(isfinite(l) && isnan(rf_stats_get(&s, RF_STATS_GRAD_NORM)));
        CHECK(ng == NULL && nng == 0);
        CHECK_STATUS(rf_trainstep(nan_grad_loss, NULL, r.m, nb, 2, r.opt, &l, &s), RF_E_DOMAIN);
        CHECK(rf_opt_steps(r.opt) == steps);
        image after = image_of(r.m, r.opt);
        CHECK(before.n == after.n && memcmp(before.bytes, after.bytes, before.n) == 0);
        free(before.bytes);
        free(after.bytes);
        int64_t done = -1;
        CHECK_STATUS(rf_train(nan_grad_loss, NULL, r.m, data, r.opt,
                              &(rf_train_opts){.batches_done = &done}),
                     RF_E_DOMAIN);
        CHECK_MSG("rf_train: the gradient norm is NaN on batch 1");
        CHECK(done == 0 && rf_opt_steps(r.opt) == steps);
        rf_array_free(nb[0]);
        rf_array_free(nb[1]);
    }

    /* switched off, then on, by the callback mid-pass: each aux value's mean is over the
     * batches that reported it (the norm's not NaN, nor missing) */
    for (int on = 0; on < 2; on++) {
        CHECK_OK(rf_opt_track_grad_norm(r.opt, !on));
        memset(&g, 0, sizeof g);
        g.switch_after = 3;
        CHECK_OK(rf_train(aux_loss, NULL, r.m, data, r.opt,
                          &(rf_train_opts){.on_step = on_step, .user = &g,
                                           .mean_stats = &ms}));
        double norms = 0, accs = 0;
        int tracked = 0;
        for (int b = 0; b < NB; b++) {
            double v = rf_stats_get(&g.info[b].stats, RF_STATS_GRAD_NORM);
            CHECK(isnan(v) == (on ? b < 3 : b >= 3));
            if (!isnan(v)) {
                norms += v;
                tracked++;
            }
            accs += rf_stats_get(&g.info[b].stats, "acc");
        }
        CHECK(tracked == (on ? NB - 3 : 3));
        CHECK(ms.n == 2 && strcmp(ms.names[0], "acc") == 0);
        CHECK_NEAR(rf_stats_get(&ms, RF_STATS_GRAD_NORM), norms / tracked, 1e-15, 1e-12);
        CHECK_NEAR(rf_stats_get(&ms, "acc"), accs / NB, 1e-15, 1e-12);
    }
    /* f32 gradients near 1e20 have squares beyond f32's range: the norm is still finite
     * and the step applied */
    {
        CHECK_OK(rf_opt_track_grad_norm(r.opt, true));
        int n32;
        rf_stats s32;
        rf_array **g32 = step_grads(&r, 0, huge_loss, &n32, &s32);
        double ref = host_norm(g32, 0, n32);
        CHECK(ref > 1e19 && isfinite(ref));
        CHECK_NEAR(rf_stats_get(&s32, RF_STATS_GRAD_NORM), ref, 0, 1e-6);
        free_grads(g32, n32);
    }
    rf_loader_free(data);
    run_free(&r);
    run_free(&r64);
}

int main(void)
{
    cpu = rf_device_cpu();
    rf_array *hx = rf_randn(RF_F32, RF_SHAPE(ROWS, 4), 31);
    rf_array *hy = rf_randn(RF_F32, RF_SHAPE(ROWS, 2), 32);
    rf_array_read(hx, xs, sizeof xs);
    rf_array_read(hy, ys, sizeof ys);
    rf_array_free(hx);
    rf_array_free(hy);
    test_stop_and_info();
    test_schedule();
    test_freeze();
    test_checkpoints();
    test_model_in_callback();
    test_errors();
    test_grad_norm();
    return tu_finish("test_train_hook");
}
