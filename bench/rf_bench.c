/* rf_bench.c: the reflux benchmark. Runs the workloads of bench/README.md (training steps
 * through rf_trainstep, inference through rf_compile_model, cold and warm compiles through
 * the disk cache) and prints one line per workload on stdout:
 *
 *     workload=mlp us_per_step=812.40 compile_ms=95.1 peak_rss_mb=61.3
 *
 * us_per_step is the median wall time of one step (or one forward call) after a warm-up,
 * measured for about --time seconds; compile_ms is the wall time of the first
 * rf_trainstep call (trace + compile + first run) or of rf_compile_model. For the compile_*
 * workloads it is rf_compile of the same training step alone (cold: an empty RF_CACHE_DIR;
 * warm: a second process with the same one), nothing run. peak_rss_mb is the child
 * process's getrusage() peak: every workload runs in its own forked process, so peaks do not
 * accumulate. Every workload compiles into a fresh scratch RF_CACHE_DIR (removed afterwards),
 * so compile_ms never depends on earlier runs; a run that was killed leaves its directories,
 * named after its pid, and the next run removes them. Diagnostics go to stderr only.
 *
 * It deliberately does not set threads (RF_NUM_THREADS is the library's) and does not judge
 * results: bench/compare.sh puts them side by side with PyTorch and JAX.
 *
 * Usage: rf_bench [--workload NAME[,NAME...]] [--steps N] [--time SECONDS]
 *                 [--backend interp|cpu] [--matmul-precision f32|bf16] [--list]
 *
 * --matmul-precision bf16 sets RF_PRECISION_BF16 on every workload's model
 * (rf_model_set_matmul_precision): the products of its layers round their
 * operands to bfloat16. The default, f32, is what the peers compute.
 */
#include <reflux.h>

#include <errno.h>
#include <dirent.h>
#include <ftw.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../examples/resnet_model.h"
#include "bench_util.h"

/* ---- Options ------------------------------------------------------------------------ */

typedef struct bench_opts {
    const char *only;  /* comma-separated workload names, or NULL for all */
    long steps;        /* > 0: exactly this many timed steps */
    double seconds;    /* otherwise: time budget of the timed loop */
    const char *backend;
    rf_precision precision; /* of the models' matrix products */
} bench_opts;

enum { MIN_TIMED_STEPS = 3, COMPILE_SETTLE_STEPS = 3 };

/* What one workload measured. */
typedef struct bench_result {
    double us_per_step;
    double compile_ms;
} bench_result;

static double median(double *v, long n)
{
    if (n <= 0)
        return 0;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* ---- The timed loop ------------------------------------------------------------------ */

/* One step of a workload: 0 on success. */
typedef int (*step_fn)(void *ctx);

/* Warm-up (at least one step, about a tenth of the budget), then timed steps until both
 * MIN_TIMED_STEPS and the budget are reached, or exactly o->steps. *us: the median. */
static int time_steps(step_fn step, void *ctx, const bench_opts *o, double *us)
{
    double warm_end = now_s() + (o->steps > 0 ? 0 : 0.1 * o->seconds);
    do {
        if (step(ctx))
            return -1;
    } while (now_s() < warm_end);

    long cap = o->steps > 0 ? o->steps : 1024, n = 0;
    double *samples = malloc((size_t)cap * sizeof *samples);
    if (!samples)
        return -1;
    double start = now_s();
    for (;;) {
        if (o->steps > 0 ? n >= o->steps
                         : n >= MIN_TIMED_STEPS && now_s() - start >= o->seconds)
            break;
        if (n == cap) {
            double *grown = realloc(samples, (size_t)(cap *= 2) * sizeof *samples);
            if (!grown)
                break;
            samples = grown;
        }
        double t0 = now_s();
        if (step(ctx)) {
            free(samples);
            return -1;
        }
        samples[n++] = now_s() - t0;
    }
    *us = 1e6 * median(samples, n);
    free(samples);
    return 0;
}

/* ---- Data --------------------------------------------------------------------------- */

/* A device copy of a host array (the host one is freed). */
static rf_array *on_device(rf_array *host)
{
    rf_array *d = host ? rf_array_to(host, rf_device_default()) : NULL;
    rf_array_free(host);
    return d;
}

static rf_array *random_input(const int64_t *dims, int rank, uint64_t seed)
{
    return on_device(rf_randn(RF_F32, dims, rank, seed));
}

/* Class ids in [0, 10) from a fixed xorshift sequence, as i32 on the device. */
static rf_array *random_labels(int64_t n, uint64_t seed)
{
    int32_t *ids = malloc((size_t)n * sizeof *ids);
    if (!ids)
        return NULL;
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int64_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        ids[i] = (int32_t)(s % 10);
    }
    rf_array *a = on_device(rf_array_from(RF_I32, (int64_t[]){n}, 1, ids));
    free(ids);
    return a;
}

/* ---- Models ------------------------------------------------------------------------- */

static rf_model *tiny_model(void)
{
    return rf_chain(rf_dense(4, 8, RF_ACT_TANH), rf_dense(8, 2, RF_ACT_IDENTITY));
}

static rf_model *mlp_model(void)
{
    return rf_chain(rf_dense(784, 512, RF_ACT_RELU), rf_dense(512, 256, RF_ACT_RELU),
                    rf_dense(256, 10, RF_ACT_IDENTITY));
}

/* examples/fashion_mnist.c's CNN. */
static rf_model *cnn_model(void)
{
    return rf_chain(rf_conv2d(3, 3, 1, 32, RF_ACT_RELU, NULL), rf_maxpool(2, 2, 0, 0),
                    rf_conv2d(3, 3, 32, 64, RF_ACT_RELU, NULL), rf_maxpool(2, 2, 0, 0),
                    rf_flatten_layer(), rf_dense(1600, 128, RF_ACT_RELU),
                    rf_dense(128, 10, RF_ACT_IDENTITY));
}

/* A transformer's feed-forward half: pre-norm residual blocks of LayerNorm, Dense 256 =>
 * 1024 gelu, Dense 1024 => 256, between an input and an output layer. */
enum { FFN_WIDTH = 256, FFN_BLOCKS = 4 };

static rf_model *ffn_model(void)
{
    rf_model *layers[FFN_BLOCKS + 2];
    layers[0] = rf_dense(784, FFN_WIDTH, RF_ACT_RELU);
    for (int i = 1; i <= FFN_BLOCKS; i++) {
        rf_model *norm = rf_layernorm(FFN_WIDTH);
        rf_model *up = rf_dense(FFN_WIDTH, 4 * FFN_WIDTH, RF_ACT_GELU);
        rf_model *down = rf_dense(4 * FFN_WIDTH, FFN_WIDTH, RF_ACT_IDENTITY);
        layers[i] = rf_skip(rf_chain(norm, up, down), RF_COMBINE_ADD);
    }
    layers[FFN_BLOCKS + 1] = rf_dense(FFN_WIDTH, 10, RF_ACT_IDENTITY);
    return rf_chain_n(layers, FFN_BLOCKS + 2);
}

enum { RESNET_WIDTH = 16 }; /* examples/resnet.c's default --width (issue 4: "the example's model") */

static rf_model *resnet_bench_model(void) { return resnet_model(RESNET_WIDTH); }

/* A plain tanh RNN over RNN_STEPS time steps of RNN_IN features, as a user's layer: x is
 * [N, RNN_STEPS * RNN_IN], step t reads columns [t * RNN_IN, (t + 1) * RNN_IN); h = tanh(x_t W
 * + b), plus h U from the second step on; the layer returns the last h. W and U are shared by
 * every step, so each one's gradient is a sum of RNN_STEPS products. */
enum { RNN_BATCH = 32, RNN_STEPS = 64, RNN_IN = 64, RNN_HIDDEN = 128 };

struct rnn_config {
    int64_t steps, in, hidden;
};

static rf_tensor *rnn_forward(rf_model *m, rf_tensor *x)
{
    const struct rnn_config *c = rf_model_config(m);
    rf_trace *t = rf_tensor_trace(x);
    if (rf_tensor_rank(x) != 2 || rf_tensor_dim(x, 1) != c->steps * c->in) {
        rf_trace_fail(t, RF_E_SHAPE, "RNN: input is not [N, %lld]",
                      (long long)(c->steps * c->in));
        return NULL;
    }
    rf_tensor *w = rf_model_param(m, t, 0), *u = rf_model_param(m, t, 1);
    rf_tensor *b = rf_model_param(m, t, 2), *h = NULL;
    int64_t n = rf_tensor_dim(x, 0);
    for (int64_t s = 0; s < c->steps; s++) {
        rf_tensor *xs = rf_slice(x, (int64_t[]){0, s * c->in}, (int64_t[]){n, (s + 1) * c->in},
                                 NULL);
        rf_tensor *z = rf_add(rf_matmul(xs, w), b);
        h = rf_tanh(h ? rf_add(z, rf_matmul(h, u)) : z);
    }
    return h;
}

static void rnn_describe(const rf_model *m, char *buf, size_t n)
{
    const struct rnn_config *c = rf_model_config(m);
    snprintf(buf, n, "%lld => %lld, %lld steps, tanh", (long long)c->in, (long long)c->hidden,
             (long long)c->steps);
}

static const rf_layer_type rnn_type = {"RNN", rnn_forward, rnn_describe};

/* W [in, hidden] and U [hidden, hidden] Glorot-uniform, b [hidden] zeros. */
static rf_model *rnn_layer(int64_t steps, int64_t in, int64_t hidden)
{
    struct rnn_config c = {steps, in, hidden};
    rf_model *m = rf_model_new(&rnn_type, &c, sizeof c);
    if (!m)
        return NULL;
    if (rf_model_add_param(m, "W", rf_init_array(RF_INIT_GLOROT_UNIFORM,
                                                 (int64_t[]){in, hidden}, 2, 61)) != RF_OK ||
        rf_model_add_param(m, "U", rf_init_array(RF_INIT_GLOROT_UNIFORM,
                                                 (int64_t[]){hidden, hidden}, 2, 62)) != RF_OK ||
        rf_model_add_param(m, "b", rf_zeros(RF_F32, (int64_t[]){hidden}, 1)) != RF_OK) {
        rf_model_free(m);
        return NULL;
    }
    return m;
}

static rf_model *rnn_model(void)
{
    return rf_chain(rnn_layer(RNN_STEPS, RNN_IN, RNN_HIDDEN),
                    rf_dense(RNN_HIDDEN, 10, RF_ACT_IDENTITY));
}

/* A host-built model moved to the device, seeded so every run has the same weights. */
static rf_model *device_model(rf_model *(*build)(void))
{
    rf_nn_seed(1);
    rf_model *host = build();
    rf_model *m = host ? rf_model_to(host, rf_device_default()) : NULL;
    rf_model_free(host);
    return m;
}

/* ---- Training workloads ------------------------------------------------------------- */

static rf_tensor *mse_loss(rf_model *m, rf_tensor *const *batch, int n, rf_aux *aux, void *ctx)
{
    (void)n, (void)aux, (void)ctx;
    return rf_mse(rf_apply(m, batch[0]), batch[1]);
}

static rf_tensor *class_loss(rf_model *m, rf_tensor *const *batch, int n, rf_aux *aux,
                             void *ctx)
{
    (void)n, (void)aux, (void)ctx;
    return rf_logitcrossentropy(rf_apply(m, batch[0]), batch[1]);
}

/* A model, its optimiser, one fixed batch and the loss. */
typedef struct train_case {
    rf_model *model;
    rf_opt *opt;
    rf_array *batch[2];
    rf_loss_fn loss;
} train_case;

static void train_case_free(train_case *c)
{
    rf_opt_free(c->opt);
    rf_model_free(c->model);
    rf_array_free(c->batch[0]);
    rf_array_free(c->batch[1]);
}

/* Builds the training case `name` (tiny, mlp, cnn, ffn, resnet, rnn) with the products at
 * `precision`: 0 on success. */
static int train_case_new(const char *name, rf_precision precision, train_case *c)
{
    memset(c, 0, sizeof *c);
    c->loss = class_loss;
    double lr = 1e-3;
    if (!strcmp(name, "tiny")) {
        c->model = device_model(tiny_model);
        c->batch[0] = random_input((int64_t[]){16, 4}, 2, 11);
        c->batch[1] = random_input((int64_t[]){16, 2}, 2, 12);
        c->loss = mse_loss;
        lr = 1e-2;
    } else if (!strcmp(name, "mlp")) {
        c->model = device_model(mlp_model);
        c->batch[0] = random_input((int64_t[]){128, 784}, 2, 21);
        c->batch[1] = random_labels(128, 22);
    } else if (!strcmp(name, "cnn")) {
        c->model = device_model(cnn_model);
        c->batch[0] = random_input((int64_t[]){64, 1, 28, 28}, 4, 31);
        c->batch[1] = random_labels(64, 32);
    } else if (!strcmp(name, "ffn")) {
        c->model = device_model(ffn_model);
        c->batch[0] = random_input((int64_t[]){128, 784}, 2, 51);
        c->batch[1] = random_labels(128, 52);
    } else if (!strcmp(name, "resnet")) {
        c->model = device_model(resnet_bench_model);
        c->batch[0] = random_input((int64_t[]){128, 1, 28, 28}, 4, 41);
        c->batch[1] = random_labels(128, 42);
        if (c->model)
            rf_trainmode(c->model); /* BatchNorm on batch statistics, as in training */
    } else if (!strcmp(name, "rnn")) {
        c->model = device_model(rnn_model);
        c->batch[0] = random_input((int64_t[]){RNN_BATCH, RNN_STEPS * RNN_IN}, 2, 61);
        c->batch[1] = random_labels(RNN_BATCH, 62);
    }
    if (c->model && rf_model_set_matmul_precision(c->model, precision) == RF_OK)
        c->opt = rf_setup(rf_adam(lr), c->model);
    if (!c->opt || !c->batch[0] || !c->batch[1]) {
        train_case_free(c);
        return -1;
    }
    return 0;
}

static int train_step(void *ctx)
{
    train_case *c = ctx;
    double loss;
    return rf_trainstep(c->loss, NULL, c->model, c->batch, 2, c->opt, &loss, NULL) != RF_OK;
}

/* Times the first call (the compile), then the steady state. */
static int run_training(const char *name, const bench_opts *o, bench_result *r)
{
    train_case c;
    if (train_case_new(name, o->precision, &c))
        return -1;
    double t0 = now_s();
    int rc = train_step(&c);
    r->compile_ms = 1e3 * (now_s() - t0);
    if (!rc)
        rc = time_steps(train_step, &c, o, &r->us_per_step);
    train_case_free(&c);
    return rc;
}

/* The step rf_trainstep traces (withgradient + optimiser update, returning the loss), less
 * its NaN guard: compiled with rf_compile so that compiling can be timed without running. */
static void manual_step_trace(rf_trace *t, void *ctx)
{
    train_case *c = ctx;
    rf_tensor *batch[2] = {rf_arg(t, 0), rf_arg(t, 1)};
    rf_grads *g = NULL;
    rf_tensor *loss = rf_withgradient(t, c->loss, NULL, c->model, batch, 2, NULL, &g);
    if (!loss)
        return;
    rf_update(t, c->opt, c->model, g);
    rf_return(t, loss);
}

typedef struct compiled_step {
    train_case *c;
    rf_exec *exec;
} compiled_step;

static int compiled_step_run(void *ctx)
{
    compiled_step *s = ctx;
    rf_array *loss = NULL;
    rf_status st = rf_exec_run(s->exec, s->c->batch, 2, &loss, 1);
    rf_array_free(loss);
    return st != RF_OK;
}

/* compile_*: rf_compile of the training step alone (trace, autodiff, passes, code
 * generation and the C compiler when cold, the disk cache when warm, loading); then a few
 * runs of it for us_per_step. */
static int run_compile(const char *model, const bench_opts *o, bench_result *r)
{
    train_case c;
    if (train_case_new(model, o->precision, &c))
        return -1;
    compiled_step s = {&c, NULL};
    double t0 = now_s();
    int rc = rf_compile(manual_step_trace, &c, c.batch, 2, &s.exec) != RF_OK;
    r->compile_ms = 1e3 * (now_s() - t0);
    bench_opts settle = {.steps = COMPILE_SETTLE_STEPS};
    if (!rc)
        rc = time_steps(compiled_step_run, &s, &settle, &r->us_per_step);
    rf_exec_free(s.exec);
    train_case_free(&c);
    return rc;
}

/* ---- Inference workloads ------------------------------------------------------------ */

typedef struct infer_case {
    rf_exec *exec;
    rf_array *x;
} infer_case;

static int infer_step(void *ctx)
{
    infer_case *c = ctx;
    rf_array *y = NULL;
    rf_status st = rf_exec_run(c->exec, &c->x, 1, &y, 1);
    rf_array_free(y);
    return st != RF_OK;
}

/* The mlp's forward pass (test mode) at batch n, compiled with rf_compile_model;
 * compile_ms is the compile and the first run, as the peers time their first call. */
static int run_inference(int64_t n, const bench_opts *o, bench_result *r)
{
    rf_model *m = device_model(mlp_model);
    infer_case c = {NULL, random_input((int64_t[]){n, 784}, 2, 51)};
    int rc = -1;
    if (m && c.x && rf_model_set_matmul_precision(m, o->precision) == RF_OK) {
        double t0 = now_s();
        rf_status st = rf_compile_model(m, c.x, &c.exec);
        if (st == RF_OK && infer_step(&c) != 0)
            st = RF_E_INTERNAL;
        r->compile_ms = 1e3 * (now_s() - t0);
        rc = st == RF_OK ? time_steps(infer_step, &c, o, &r->us_per_step) : -1;
    }
    rf_exec_free(c.exec);
    rf_array_free(c.x);
    rf_model_free(m);
    return rc;
}

/* ---- Workloads and processes -------------------------------------------------------- */

typedef enum workload_kind { WL_TRAIN, WL_INFER, WL_COMPILE_COLD, WL_COMPILE_WARM } workload_kind;

typedef struct workload {
    const char *name;
    workload_kind kind;
    const char *model; /* training case, for WL_TRAIN and the compile workloads */
    int64_t batch;     /* for WL_INFER */
} workload;

static const workload WORKLOADS[] = {
    {"tiny", WL_TRAIN, "tiny", 0},
    {"mlp", WL_TRAIN, "mlp", 0},
    {"cnn", WL_TRAIN, "cnn", 0},
    {"ffn", WL_TRAIN, "ffn", 0},
    {"resnet", WL_TRAIN, "resnet", 0},
    {"rnn", WL_TRAIN, "rnn", 0},
    {"infer1", WL_INFER, NULL, 1},
    {"infer1024", WL_INFER, NULL, 1024},
    {"compile_mlp_cold", WL_COMPILE_COLD, "mlp", 0},
    {"compile_mlp_warm", WL_COMPILE_WARM, "mlp", 0},
    {"compile_resnet_cold", WL_COMPILE_COLD, "resnet", 0},
    {"compile_resnet_warm", WL_COMPILE_WARM, "resnet", 0},
};
enum { N_WORKLOADS = sizeof WORKLOADS / sizeof WORKLOADS[0] };

static int run_workload(const workload *w, const bench_opts *o, bench_result *r)
{
    switch (w->kind) {
    case WL_TRAIN: return run_training(w->model, o, r);
    case WL_INFER: return run_inference(w->batch, o, r);
    case WL_COMPILE_COLD:
    case WL_COMPILE_WARM: return run_compile(w->model, o, r);
    }
    return -1;
}

static double peak_rss_mb(void)
{
    struct rusage ru;
    return getrusage(RUSAGE_SELF, &ru) == 0 ? (double)ru.ru_maxrss / 1024.0 : 0;
}

/* Runs w in a forked child; the child prints its line unless `quiet` (a cache-priming
 * run). Returns 0 if the child succeeded. */
static int run_in_child(const workload *w, const bench_opts *o, int quiet)
{
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) {
        fprintf(stderr, "rf_bench: %s: fork: %s\n", w->name, strerror(errno));
        return -1;
    }
    if (pid == 0) {
        bench_result r = {0, 0};
        if (run_workload(w, o, &r)) {
            fprintf(stderr, "rf_bench: %s: %s\n", w->name, rf_errmsg());
            _exit(1);
        }
        if (!quiet)
            printf("workload=%s us_per_step=%.2f compile_ms=%.1f peak_rss_mb=%.1f\n", w->name,
                   r.us_per_step, r.compile_ms, peak_rss_mb());
        fflush(stdout);
        _exit(0);
    }
    int status;
    while (waitpid(pid, &status, 0) < 0)
        if (errno != EINTR)
            return -1;
    if (WIFSIGNALED(status))
        fprintf(stderr, "rf_bench: %s: killed by signal %d\n", w->name, WTERMSIG(status));
    return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : -1;
}

/* ---- Disk-cache directories for the compile workloads -------------------------------- */

/* Scratch cache directories are /tmp/rf_bench_cache.PID.XXXXXX, PID the creating
 * rf_bench's, so that a later run can tell those of a run that was killed. */
#define SCRATCH_DIR "/tmp"
#define SCRATCH_PREFIX "rf_bench_cache."

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

static void remove_tree(const char *path) { nftw(path, remove_entry, 16, FTW_DEPTH | FTW_PHYS); }

/* Makes a new scratch directory in buf (n >= 64 bytes); 0 after saying why. */
static int make_scratch_dir(char *buf, size_t n)
{
    snprintf(buf, n, SCRATCH_DIR "/" SCRATCH_PREFIX "%ld.XXXXXX", (long)getpid());
    if (mkdtemp(buf))
        return 1;
    fprintf(stderr, "rf_bench: mkdtemp: %s\n", strerror(errno));
    buf[0] = 0;
    return 0;
}

/* Removes the scratch directories of rf_bench processes that no longer exist. */
static void remove_stale_scratch_dirs(void)
{
    DIR *d = opendir(SCRATCH_DIR);
    if (!d)
        return;
    size_t plen = strlen(SCRATCH_PREFIX);
    for (struct dirent *e; (e = readdir(d));) {
        char *end;
        if (strncmp(e->d_name, SCRATCH_PREFIX, plen) != 0)
            continue;
        long pid = strtol(e->d_name + plen, &end, 10);
        if (end == e->d_name + plen || *end != '.' || pid <= 0 ||
            !(kill((pid_t)pid, 0) < 0 && errno == ESRCH))
            continue;
        char path[512];
        snprintf(path, sizeof path, SCRATCH_DIR "/%s", e->d_name);
        remove_tree(path);
    }
    closedir(d);
}

/* A fresh cache directory per model, kept from the cold run for the warm one. */
typedef struct cache_dirs {
    char path[2][64]; /* [0] mlp, [1] resnet; "" until created */
} cache_dirs;

static char *cache_dir_for(cache_dirs *d, const char *model, int fresh, int *created)
{
    char *p = d->path[strcmp(model, "mlp") != 0];
    *created = 0;
    if (!p[0] || fresh) {
        if (!make_scratch_dir(p, sizeof d->path[0]))
            return NULL;
        *created = 1;
    }
    return p;
}

static void cache_dirs_remove(cache_dirs *d)
{
    for (int i = 0; i < 2; i++)
        if (d->path[i][0])
            remove_tree(d->path[i]);
}

/* Cold: a new empty RF_CACHE_DIR. Warm: the cold run's directory, primed first by a silent
 * child when the cold workload did not run before it. */
static int run_compile_workload(const workload *w, const bench_opts *o, cache_dirs *dirs)
{
    int created;
    char *dir = cache_dir_for(dirs, w->model, w->kind == WL_COMPILE_COLD, &created);
    if (!dir)
        return -1;
    setenv("RF_CACHE_DIR", dir, 1);
    int rc = 0;
    if (w->kind == WL_COMPILE_WARM && created)
        rc = run_in_child(w, o, 1);
    if (!rc)
        rc = run_in_child(w, o, 0);
    unsetenv("RF_CACHE_DIR");
    return rc;
}

/* Training and inference workloads compile cold too, in a scratch RF_CACHE_DIR removed
 * afterwards: compile_ms does not depend on what earlier runs left in the user's cache. */
static int run_plain_workload(const workload *w, const bench_opts *o)
{
    char dir[64];
    if (!make_scratch_dir(dir, sizeof dir))
        return -1;
    setenv("RF_CACHE_DIR", dir, 1);
    int rc = run_in_child(w, o, 0);
    unsetenv("RF_CACHE_DIR");
    remove_tree(dir);
    return rc;
}

/* ---- Main --------------------------------------------------------------------------- */

static int selected(const char *only, const char *name)
{
    if (!only)
        return 1;
    size_t len = strlen(name);
    for (const char *p = only; *p;) {
        const char *end = strchr(p, ',');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n == len && !strncmp(p, name, n))
            return 1;
        p += n + (end != NULL);
    }
    return 0;
}

static int usage(void)
{
    fprintf(stderr, "usage: rf_bench [--workload NAME[,NAME...]] [--steps N] [--time SECONDS]\n"
                    "                [--backend interp|cpu] [--matmul-precision f32|bf16] "
                    "[--list]\nworkloads:");
    for (int i = 0; i < N_WORKLOADS; i++)
        fprintf(stderr, " %s", WORKLOADS[i].name);
    fprintf(stderr, "\n");
    return 2;
}

static int parse(int argc, char **argv, bench_opts *o)
{
    for (int i = 1; i < argc; i += 2) { /* option, value */
        const char *k = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(k, "--list")) {
            for (int j = 0; j < N_WORKLOADS; j++)
                printf("%s\n", WORKLOADS[j].name);
            exit(0);
        }
        if (!v)
            return -1;
        if (!strcmp(k, "--workload")) o->only = v;
        else if (!strcmp(k, "--steps")) o->steps = atol(v);
        else if (!strcmp(k, "--time")) o->seconds = atof(v);
        else if (!strcmp(k, "--backend")) o->backend = v;
        else if (!strcmp(k, "--matmul-precision") && !strcmp(v, "f32"))
            o->precision = RF_PRECISION_F32;
        else if (!strcmp(k, "--matmul-precision") && !strcmp(v, "bf16"))
            o->precision = RF_PRECISION_BF16;
        else return -1;
    }
    return o->seconds > 0 || o->steps > 0 ? 0 : -1;
}

static int known_names(const char *only)
{
    if (!only)
        return 1;
    int found = 0;
    for (int i = 0; i < N_WORKLOADS; i++)
        found += selected(only, WORKLOADS[i].name);
    return found > 0;
}

int main(int argc, char **argv)
{
    bench_opts o = {NULL, 0, 1.5, NULL, RF_PRECISION_F32};
    if (parse(argc, argv, &o) || !known_names(o.only))
        return usage();
    if (o.backend)
        setenv("RF_BACKEND", o.backend, 1);
    const char *backend = getenv("RF_BACKEND"), *threads = getenv("RF_NUM_THREADS");
    fprintf(stderr, "# rf_bench: backend=%s threads=%s cores=%ld matmul_precision=%s\n",
            backend && *backend ? backend : "default", threads ? threads : "default",
            sysconf(_SC_NPROCESSORS_ONLN), rf_precision_name(o.precision));

    remove_stale_scratch_dirs();
    cache_dirs dirs = {{"", ""}};
    int failures = 0;
    for (int i = 0; i < N_WORKLOADS; i++) {
        const workload *w = &WORKLOADS[i];
        if (!selected(o.only, w->name))
            continue;
        int rc = w->kind == WL_COMPILE_COLD || w->kind == WL_COMPILE_WARM
                     ? run_compile_workload(w, &o, &dirs)
                     : run_plain_workload(w, &o);
        failures += rc != 0;
    }
    cache_dirs_remove(&dirs);
    return failures ? 1 : 0;
}
