/* test_threads.c: the library used from several threads at once (the rules
 * in reflux.h's header comment).
 *
 * - Two threads train models of their own (a CNN and an MLP: convolutions,
 *   matmuls, generated loops) with rf_trainstep at the same time, compiling
 *   their steps concurrently: every loss and every final parameter is
 *   bitwise what the same training gives on one thread.
 * - Two threads run one compiled forward pass on different inputs, 200 runs
 *   each: runs of one executable take turns, so every output is bitwise the
 *   output that input gives alone.
 * - A training step of a model that another thread is stepping is refused
 *   with a message and changes nothing.
 * - A failing call on one thread leaves another thread's message alone.
 * - A child forked after the threads started does not wait for them, nor for
 *   a thread that was working out the compiler's identity at the fork.
 *
 * Checks are made on the main thread from what the threads recorded (the
 * CHECK counters are not atomic). Runs on both backends, like every test of
 * public behaviour.
 */
#include <math.h>
#include <pthread.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "test_util.h"

enum { STEPS = 12, BATCH = 16, RUNS = 200, INPUTS = 4 };

/* Runs fn(a) and fn(b) on two threads and waits for both; false if a thread
 * could not be started (the other is still joined). */
static bool run_two(void *(*fn)(void *), void *a, void *b)
{
    pthread_t th[2];
    void *arg[2] = {a, b};
    bool started[2];
    for (int i = 0; i < 2; i++)
        started[i] = pthread_create(&th[i], NULL, fn, arg[i]) == 0;
    for (int i = 0; i < 2; i++)
        if (started[i])
            pthread_join(th[i], NULL);
    return started[0] && started[1];
}

/* ---- Two models trained at once --------------------------------------------------- */

typedef struct trainer {
    tu_trainer t;
    double losses[STEPS];
    rf_status status; /* the first failure, RF_OK if none */
    char message[256];
} trainer;

/* A host model: a small CNN or MLP over [BATCH, 1, 12, 12] images, 10 classes. */
static rf_model *host_model(bool cnn)
{
    if (cnn)
        return rf_chain(rf_conv2d(3, 3, 1, 8, RF_ACT_RELU, NULL), rf_maxpool(2, 2, 0, 0),
                        rf_flatten_layer(), rf_dense(8 * 5 * 5, 10, RF_ACT_IDENTITY));
    return rf_chain(rf_flatten_layer(), rf_dense(144, 64, RF_ACT_RELU),
                    rf_dense(64, 10, RF_ACT_IDENTITY));
}

/* The MLP from `seed`, on the CPU device. */
static rf_model *device_mlp(uint64_t seed)
{
    rf_nn_seed(seed);
    rf_model *host = host_model(false);
    rf_model *m = host ? rf_model_to(host, rf_device_cpu()) : NULL;
    rf_model_free(host);
    return m;
}

/* The model from a fixed seed (made on the main thread, one after the other:
 * rf_nn_seed's counter is process-wide), its optimiser and a batch. */
static bool trainer_init(trainer *tr, bool cnn, uint64_t seed)
{
    memset(tr, 0, sizeof *tr);
    int32_t labels[BATCH];
    for (int i = 0; i < BATCH; i++)
        labels[i] = (int32_t)((i * 7 + (int)seed) % 10);
    rf_nn_seed(seed);
    return tu_trainer_make(&tr->t, rf_device_cpu(), host_model(cnn), BATCH, 12, 12, seed, labels,
                           1e-2);
}

static void *train_steps(void *arg)
{
    trainer *tr = arg;
    rf_array *batch[2] = {tr->t.x, tr->t.y};
    tr->status = RF_OK;
    for (int s = 0; s < STEPS && tr->status == RF_OK; s++) {
        tr->status = rf_trainstep(tu_ce_loss, NULL, tr->t.m, batch, 2, tr->t.opt,
                                  &tr->losses[s], NULL);
        if (tr->status != RF_OK)
            snprintf(tr->message, sizeof tr->message, "%s", rf_errmsg());
    }
    return NULL;
}

/* Whether a's and b's models hold bitwise the same parameters. */
static bool same_params(const trainer *a, const trainer *b)
{
    int n = rf_model_n_params(a->t.m);
    if (n != rf_model_n_params(b->t.m))
        return false;
    for (int i = 0; i < n; i++) {
        rf_array *x = rf_model_param_array(a->t.m, i);
        rf_array *y = rf_model_param_array(b->t.m, i);
        if (!x || !y || rf_array_nbytes(x) != rf_array_nbytes(y) ||
            memcmp(rf_array_data(x), rf_array_data(y), rf_array_nbytes(x)) != 0)
            return false;
    }
    return true;
}

static void test_two_trainers(void)
{
    trainer together[2], alone[2];
    bool ok = true;
    for (int i = 0; i < 2; i++) {
        ok &= trainer_init(&together[i], i == 0, 11 + (uint64_t)i);
        ok &= trainer_init(&alone[i], i == 0, 11 + (uint64_t)i);
    }
    CHECK(ok);
    if (ok) {
        /* first at the same time (both steps compile concurrently), then alone */
        CHECK(run_two(train_steps, &together[0], &together[1]));
        for (int i = 0; i < 2; i++) {
            train_steps(&alone[i]);
            if (together[i].status != RF_OK)
                fprintf(stderr, "trainer %d on a thread: %s\n", i, together[i].message);
            CHECK(together[i].status == RF_OK && alone[i].status == RF_OK);
            CHECK(memcmp(together[i].losses, alone[i].losses, sizeof alone[i].losses) == 0);
            CHECK(same_params(&together[i], &alone[i]));
            CHECK(alone[i].losses[STEPS - 1] < alone[i].losses[0]); /* it trained */
        }
    }
    for (int i = 0; i < 2; i++) {
        tu_trainer_free(&together[i].t);
        tu_trainer_free(&alone[i].t);
    }
}

/* ---- One model, two threads -------------------------------------------------------- */

/* A loss that, while traced, says so and waits for the main thread: the step
 * of the thread that traces it is then certainly running. */
typedef struct gate {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    bool inside, go;
} gate;

static rf_tensor *gated_loss(rf_model *m, rf_tensor *const *b, int n, rf_aux *aux, void *ctx)
{
    gate *g = ctx;
    pthread_mutex_lock(&g->lock);
    g->inside = true;
    pthread_cond_broadcast(&g->cond);
    while (!g->go)
        pthread_cond_wait(&g->cond, &g->lock);
    pthread_mutex_unlock(&g->lock);
    return tu_ce_loss(m, b, n, aux, NULL);
}

typedef struct gated_step {
    trainer *tr;
    gate *g;
    double loss;
    rf_status status;
} gated_step;

static void *step_through_gate(void *arg)
{
    gated_step *s = arg;
    rf_array *batch[2] = {s->tr->t.x, s->tr->t.y};
    s->status = rf_trainstep(gated_loss, s->g, s->tr->t.m, batch, 2, s->tr->t.opt, &s->loss,
                             NULL);
    return NULL;
}

static rf_tensor *sum_loss(rf_model *m, rf_tensor *const *b, int n, rf_aux *aux, void *ctx)
{
    (void)n, (void)aux, (void)ctx;
    return rf_sum_all(rf_apply(m, b[0]));
}

/* A step of a model that another thread is stepping, or of one of its layers,
 * is refused with a message, and changes nothing; the other step completes. */
static void test_overlapping_steps(void)
{
    trainer tr;
    CHECK(trainer_init(&tr, false, 41));
    gate g = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, false, false};
    gated_step s = {&tr, &g, 0, RF_E_INTERNAL};
    /* a layer's own optimiser, set up before the other thread's step (rf_setup
     * uses the model too) */
    rf_model *layer = tr.t.m ? rf_model_child(tr.t.m, 1) : NULL; /* Dense(144 => 64) */
    rf_opt *layer_opt = layer ? rf_setup(rf_descent(0.1), layer) : NULL;
    pthread_t th;
    bool started = tr.t.m && pthread_create(&th, NULL, step_through_gate, &s) == 0;
    CHECK(started);
    if (started) {
        pthread_mutex_lock(&g.lock);
        while (!g.inside)
            pthread_cond_wait(&g.cond, &g.lock);
        pthread_mutex_unlock(&g.lock);
        rf_array *batch[2] = {tr.t.x, tr.t.y};
        double l = 0;
        CHECK_STATUS(rf_trainstep(tu_ce_loss, NULL, tr.t.m, batch, 2, tr.t.opt, &l, NULL),
                     RF_E_INVALID);
        CHECK_MSG("rf_trainstep: the model is already in a training step");
        CHECK(isnan(l));
        CHECK(rf_opt_steps(tr.t.opt) == 0);
        /* nor a step of one of its layers, whose arrays that step updates */
        rf_array *xh = rf_zeros(RF_F32, RF_SHAPE(BATCH, 144));
        rf_array *x = xh ? rf_array_to(xh, rf_device_cpu()) : NULL;
        CHECK(layer_opt && x);
        if (layer_opt && x) {
            CHECK_STATUS(rf_trainstep(sum_loss, NULL, layer, &x, 1, layer_opt, &l, NULL),
                         RF_E_INVALID);
            CHECK_MSG("the model that owns this one is already in a training step");
            CHECK(rf_opt_steps(layer_opt) == 0);
        }
        rf_array_free(x);
        rf_array_free(xh);
        pthread_mutex_lock(&g.lock);
        g.go = true;
        pthread_cond_broadcast(&g.cond);
        pthread_mutex_unlock(&g.lock);
        pthread_join(th, NULL);
        CHECK(s.status == RF_OK && isfinite(s.loss));
        CHECK(rf_opt_steps(tr.t.opt) == 1);
        /* and once it is done, the model trains on this thread */
        CHECK_OK(rf_trainstep(tu_ce_loss, NULL, tr.t.m, batch, 2, tr.t.opt, &l, NULL));
    }
    rf_opt_free(layer_opt);
    tu_trainer_free(&tr.t);
}

/* ---- One executable run from two threads ------------------------------------------ */

typedef struct runner {
    rf_exec *forward;
    rf_array *const *inputs; /* INPUTS device arrays */
    const float *expected;   /* INPUTS x 10 outputs each, computed alone */
    int first;               /* which input this thread starts with */
    int mismatches, failures;
} runner;

static void *run_forward(void *arg)
{
    runner *r = arg;
    for (int k = 0; k < RUNS; k++) {
        int which = (r->first + k) % INPUTS;
        rf_array *y = NULL;
        if (rf_exec_run(r->forward, &r->inputs[which], 1, &y, 1) != RF_OK) {
            r->failures++;
            continue;
        }
        rf_array *host = rf_array_to(y, rf_device_host());
        if (!host || memcmp(rf_array_data(host), r->expected + which * BATCH * 10,
                            BATCH * 10 * sizeof(float)) != 0)
            r->mismatches++;
        rf_array_free(host);
        rf_array_free(y);
    }
    return NULL;
}

static void test_shared_executable(void)
{
    rf_model *m = device_mlp(21);
    rf_array *inputs[INPUTS] = {0};
    static float expected[INPUTS * BATCH * 10];
    bool ok = m != NULL;
    for (int i = 0; i < INPUTS && ok; i++) {
        rf_array *x = rf_randn(RF_F32, RF_SHAPE(BATCH, 1, 12, 12), 200 + (uint64_t)i);
        inputs[i] = x ? rf_array_to(x, rf_device_cpu()) : NULL;
        rf_array_free(x);
        ok = inputs[i] != NULL;
    }
    rf_exec *forward = NULL;
    if (ok)
        CHECK_OK(rf_compile_model(m, inputs[0], &forward));
    for (int i = 0; i < INPUTS && forward; i++) { /* each input's output, alone */
        rf_array *y = NULL, *host = NULL;
        CHECK_OK(rf_exec_run(forward, &inputs[i], 1, &y, 1));
        host = y ? rf_array_to(y, rf_device_host()) : NULL;
        CHECK(host && rf_array_nbytes(host) == sizeof expected / INPUTS);
        if (host)
            memcpy(expected + i * BATCH * 10, rf_array_data(host), sizeof expected / INPUTS);
        rf_array_free(host);
        rf_array_free(y);
    }
    if (forward) {
        runner r[2] = {{forward, inputs, expected, 0, 0, 0}, {forward, inputs, expected, 1, 0, 0}};
        CHECK(run_two(run_forward, &r[0], &r[1]));
        for (int i = 0; i < 2; i++) {
            if (r[i].mismatches || r[i].failures)
                fprintf(stderr, "thread %d: %d of %d outputs differ, %d runs failed\n", i,
                        r[i].mismatches, RUNS, r[i].failures);
            CHECK(r[i].mismatches == 0 && r[i].failures == 0);
        }
    }
    rf_exec_free(forward);
    for (int i = 0; i < INPUTS; i++)
        rf_array_free(inputs[i]);
    rf_model_free(m);
}

/* ---- A forked child ----------------------------------------------------------------- */

/* In the child: an executable made before the fork runs, or (its library
 * primitives wait for threads the child does not have) fails with a message;
 * one compiled in the child runs, its outputs those of the parent's. Returns
 * the exit status: 0 when all holds. */
static int forked_child(rf_model *m, rf_array *x, const float *want, size_t n, rf_exec *old)
{
    alarm(120); /* a hang ends the child, and the parent sees it */
    rf_array *y = NULL;
    rf_status st = rf_exec_run(old, &x, 1, &y, 1);
    rf_array_free(y);
    if (st != RF_OK && !strstr(rf_errmsg(), "compiled before the process forked"))
        return 2;
    rf_exec *fresh = NULL;
    if (rf_compile_model(m, x, &fresh) != RF_OK || rf_exec_run(fresh, &x, 1, &y, 1) != RF_OK)
        return 3;
    rf_array *host = rf_array_to(y, rf_device_host());
    const float *got = host ? rf_array_data(host) : NULL;
    int bad = !got || rf_array_nbytes(host) != n * sizeof *want;
    for (size_t i = 0; !bad && i < n; i++)
        bad = fabsf(got[i] - want[i]) > 1e-5f * (1 + fabsf(want[i]));
    rf_array_free(host);
    rf_array_free(y);
    rf_exec_free(fresh);
    return bad ? 4 : 0;
}

/* A process forked after the library's threads started (its pool's and
 * OpenMP's) runs on one thread: its loops inline, its library calls with one
 * thread; nothing waits for a thread that was not forked. */
static void test_fork(void)
{
    rf_model *m = device_mlp(33);
    rf_array *xh = rf_randn(RF_F32, RF_SHAPE(BATCH, 1, 12, 12), 300);
    rf_array *x = xh ? rf_array_to(xh, rf_device_cpu()) : NULL;
    rf_exec *forward = NULL;
    rf_array *y = NULL, *host = NULL;
    CHECK(m && x);
    if (m && x)
        CHECK_OK(rf_compile_model(m, x, &forward));
    if (forward)
        CHECK_OK(rf_exec_run(forward, &x, 1, &y, 1));
    host = y ? rf_array_to(y, rf_device_host()) : NULL;
    if (host) {
        fflush(NULL);
        pid_t pid = fork();
        if (pid == 0)
            _exit(forked_child(m, x, rf_array_data(host), (size_t)rf_array_numel(host), forward));
        int ws = 0;
        CHECK(pid > 0 && waitpid(pid, &ws, 0) == pid);
        CHECK(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
        if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0)
            fprintf(stderr, "forked child: %s %d\n", WIFEXITED(ws) ? "exit status" : "signal",
                    WIFEXITED(ws) ? WEXITSTATUS(ws) : WTERMSIG(ws));
    }
    rf_array_free(host);
    rf_array_free(y);
    rf_exec_free(forward);
    rf_array_free(x);
    rf_array_free(xh);
    rf_model_free(m);
}

/* ---- Messages stay on their thread ------------------------------------------------ */

typedef struct failing_call {
    rf_exec *forward;
    rf_array *wrong; /* an input of the wrong shape */
    rf_status status;
    char message[256];
} failing_call;

static void *fail_once(void *arg)
{
    failing_call *f = arg;
    rf_array *y = NULL;
    f->status = rf_exec_run(f->forward, &f->wrong, 1, &y, 1);
    snprintf(f->message, sizeof f->message, "%s", rf_errmsg());
    return NULL;
}

static void test_messages_per_thread(void)
{
    rf_model *m = device_mlp(31);
    rf_array *x = rf_zeros(RF_F32, RF_SHAPE(BATCH, 1, 12, 12));
    rf_array *wrong = rf_zeros(RF_F32, RF_SHAPE(BATCH + 1, 1, 12, 12));
    rf_array *xd = x ? rf_array_to(x, rf_device_cpu()) : NULL;
    rf_array *wd = wrong ? rf_array_to(wrong, rf_device_cpu()) : NULL;
    rf_exec *forward = NULL;
    CHECK(m && xd && wd);
    if (m && xd && wd)
        CHECK_OK(rf_compile_model(m, xd, &forward));
    if (forward) {
        rf_clear_error();
        failing_call f = {forward, wd, RF_OK, ""};
        pthread_t th;
        CHECK(pthread_create(&th, NULL, fail_once, &f) == 0 && pthread_join(th, NULL) == 0);
        CHECK(f.status == RF_E_SHAPE);
        CHECK(strstr(f.message, "rf_exec_run") && strstr(f.message, "f32[17,1,12,12]"));
        CHECK(strcmp(rf_errmsg(), "") == 0); /* this thread's message is untouched */
    }
    rf_exec_free(forward);
    rf_array_free(x);
    rf_array_free(wrong);
    rf_array_free(xd);
    rf_array_free(wd);
    rf_model_free(m);
}

/* ---- A child forked while another thread asks the compiler ------------------------ */

static void square_tanh(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_return(t, rf_tanh(rf_mul(x, x)));
}

typedef struct compile_job {
    rf_array *x;
    rf_status status;
} compile_job;

static void *compile_square_tanh(void *arg)
{
    compile_job *job = arg;
    rf_exec *e = NULL;
    job->status = rf_compile(square_tanh, NULL, &job->x, 1, &e);
    rf_exec_free(e);
    return NULL;
}

/* In the child: the same program compiles (a hang is ended by the alarm) and runs. */
static int compile_in_child(rf_array *x)
{
    alarm(20);
    rf_exec *e = NULL;
    rf_array *y = NULL;
    int bad = rf_compile(square_tanh, NULL, &x, 1, &e) != RF_OK ? 2
              : rf_exec_run(e, &x, 1, &y, 1) != RF_OK ? 3 : 0;
    rf_array_free(y);
    rf_exec_free(e);
    return bad;
}

/* A child forked while another thread is working out the compiler's identity
 * (running $CC --version, the first compile under a new $CC) compiles on its
 * own: it does not wait for that thread, which it does not have. $CC is a
 * wrapper of the compiler whose first --version makes the directory `started`
 * and sleeps, so the fork lands inside it; the cache directory is fresh, so the
 * version line is not memoised. */
static void test_fork_while_identity_built(void)
{
    const char *backend = getenv("RF_BACKEND");
    if (backend && strcmp(backend, "interp") == 0)
        return; /* the interpreter runs no compiler */
    const char *tmp = getenv("TMPDIR");
    char dir[256], script[300], started[300], text[1024];
    snprintf(dir, sizeof dir, "%s/rf-threads-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    CHECK(mkdtemp(dir) != NULL);
    snprintf(script, sizeof script, "%s/cc", dir);
    snprintf(started, sizeof started, "%s/started", dir);
    const char *cc = getenv("CC");
    char *saved_cc = cc ? strdup(cc) : NULL, *saved_cache = NULL;
    if (getenv("RF_CACHE_DIR"))
        saved_cache = strdup(getenv("RF_CACHE_DIR"));
    snprintf(text, sizeof text,
             "#!/bin/sh\n"
             "if [ \"$1\" = --version ] && mkdir '%s' 2>/dev/null; then sleep 1; fi\n"
             "exec %s \"$@\"\n",
             started, cc && *cc ? cc : "cc");
    tu_write_script(script, text);
    setenv("CC", script, 1);
    setenv("RF_CACHE_DIR", dir, 1);
    rf_array *xh = rf_randn(RF_F32, RF_SHAPE(8, 8), 5);
    compile_job job = {xh ? rf_array_to(xh, rf_device_cpu()) : NULL, RF_E_INVALID};
    pthread_t th;
    bool running = job.x && pthread_create(&th, NULL, compile_square_tanh, &job) == 0;
    CHECK(running);
    struct stat st;
    struct timespec ms = {0, 1000 * 1000};
    for (int waited = 0; running && stat(started, &st) != 0 && waited < 20000; waited++)
        nanosleep(&ms, NULL);
    bool asked = running && stat(started, &st) == 0;
    CHECK(asked);
    if (asked) {
        fflush(NULL);
        pid_t pid = fork();
        if (pid == 0)
            _exit(compile_in_child(job.x));
        int ws = 0;
        CHECK(pid > 0 && waitpid(pid, &ws, 0) == pid);
        CHECK(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
        if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0)
            fprintf(stderr, "child forked during the identity's build: %s %d\n",
                    WIFEXITED(ws) ? "exit status" : "signal",
                    WIFEXITED(ws) ? WEXITSTATUS(ws) : WTERMSIG(ws));
    }
    if (running)
        pthread_join(th, NULL);
    CHECK_OK(job.status);
    if (saved_cc)
        setenv("CC", saved_cc, 1);
    else
        unsetenv("CC");
    if (saved_cache)
        setenv("RF_CACHE_DIR", saved_cache, 1);
    else
        unsetenv("RF_CACHE_DIR");
    free(saved_cc);
    free(saved_cache);
    rf_array_free(job.x);
    rf_array_free(xh);
    tu_remove_tree(dir);
}

int main(void)
{
    test_two_trainers();
    test_overlapping_steps();
    test_shared_executable();
    test_messages_per_thread();
    test_fork();
    test_fork_while_identity_built();
    return tu_finish("test_threads");
}
