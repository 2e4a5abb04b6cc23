/* bench_patterns.c: microseconds per run of small programs written the way a
 * user writes them, each a pattern that once fell off the compiled backend's
 * fast paths (docs/ARCHITECTURE.md names the fix of each). One line per
 * pattern, the median of the timed runs:
 *   pattern=NAME us=MEDIAN
 * bench/peers/torch_patterns.py prints the same lines for PyTorch (eager).
 * An argument runs only the patterns whose name contains it.
 *
 *   matmul_f64      f64 x [64,784] @ w [784,256], tanh, sum of squares, and its
 *                   gradient with respect to x and w (w stored [in, out])
 *   transpose_exp   exp(x^T) of an f32 [2048,2048]
 *   upsample_tanh   tanh of a nearest 2x upsampling of [8,64,32,32] written as a
 *                   broadcast through reshapes, sum of squares, gradient
 *   attention       softmax(q k^T * 0.17) v over [8,4,128,32], gradient wrt q, k, v
 *   groupnorm_cnn   an Adam training step: two 3x3 convolutions of 64 channels with
 *                   GroupNorm(8) and relu, mean pool, dense; 32 images of 16x16
 *   clipnorm_mlp    the mlp workload's Adam step with a global gradient-norm clip
 *   dropout_mlp     the mlp workload's Adam step with Dropout(0.5) after each hidden layer
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "reflux.h"

enum { TIMED_RUNS = 60, WARM_RUNS = 3 };

/* ---- Traced programs ----------------------------------------------------------------- */

/* sum(y * y) and its gradient with respect to every argument, returned after it. */
static void return_loss_and_grads(rf_trace *t, rf_tensor *y, rf_tensor **args, int n)
{
    rf_tensor *grads[3] = {NULL, NULL, NULL};
    rf_tensor *loss = rf_sum_all(rf_mul(y, y));
    if (rf_grad(t, loss, args, n, grads) != RF_OK)
        return;
    rf_return(t, loss);
    for (int i = 0; i < n; i++)
        rf_return(t, grads[i]);
}

static void matmul_f64_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *a[2] = {rf_arg(t, 0), rf_arg(t, 1)};
    return_loss_and_grads(t, rf_tanh(rf_matmul(a[0], a[1])), a, 2);
}

static void transpose_exp_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_return(t, rf_exp(rf_transpose(rf_arg(t, 0), (const int64_t[]){1, 0})));
}

static void upsample_tanh_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_tensor *r = rf_reshape(x, (const int64_t[]){8, 64, 32, 1, 32, 1}, 6);
    rf_tensor *b = rf_broadcast_to(r, (const int64_t[]){8, 64, 32, 2, 32, 2}, 6);
    rf_tensor *up = rf_reshape(b, (const int64_t[]){8, 64, 64, 64}, 4);
    return_loss_and_grads(t, rf_tanh(up), &x, 1);
}

static void attention_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *a[3] = {rf_arg(t, 0), rf_arg(t, 1), rf_arg(t, 2)};
    rf_tensor *kt = rf_transpose(a[1], (const int64_t[]){0, 1, 3, 2});
    rf_tensor *scores = rf_mul_s(rf_matmul(a[0], kt), 0.17);
    return_loss_and_grads(t, rf_matmul(rf_softmax(scores, 3), a[2]), a, 3);
}

/* Median microseconds of e's runs on args (0 on an error, printed). */
static double time_exec(rf_exec *e, rf_array *const *args, int nargs)
{
    double ts[TIMED_RUNS];
    int nouts = rf_exec_n_outputs(e);
    for (int i = 0; i < WARM_RUNS + TIMED_RUNS; i++) {
        rf_array *outs[4] = {NULL, NULL, NULL, NULL};
        double t0 = now_s();
        rf_status st = rf_exec_run(e, args, nargs, outs, nouts);
        if (i >= WARM_RUNS)
            ts[i - WARM_RUNS] = now_s() - t0;
        for (int k = 0; k < nouts; k++)
            rf_array_free(outs[k]);
        if (st != RF_OK) {
            fprintf(stderr, "bench_patterns: %s\n", rf_errmsg());
            return 0;
        }
    }
    qsort(ts, TIMED_RUNS, sizeof ts[0], cmp_double);
    return 1e6 * ts[TIMED_RUNS / 2];
}

/* A compute-device array of normal values (f64 kept as f64). */
static rf_array *normal_array(rf_dtype dt, const int64_t *dims, int rank, uint64_t seed)
{
    rf_to_opts keep = {.keep_f64 = true};
    rf_array *host = rf_randn(dt, dims, rank, seed);
    rf_array *a = host ? rf_array_to_opts(host, rf_device_default(), &keep) : NULL;
    rf_array_free(host);
    return a;
}

typedef struct program_case {
    const char *name;
    rf_trace_fn fn;
    rf_dtype dtype;
    int nargs, rank;
    int64_t dims[3][4];
} program_case;

static const program_case PROGRAMS[] = {
    {"matmul_f64", matmul_f64_fn, RF_F64, 2, 2, {{64, 784}, {784, 256}}},
    {"transpose_exp", transpose_exp_fn, RF_F32, 1, 2, {{2048, 2048}}},
    {"upsample_tanh", upsample_tanh_fn, RF_F32, 1, 4, {{8, 64, 32, 32}}},
    {"attention", attention_fn, RF_F32, 3, 4, {{8, 4, 128, 32}, {8, 4, 128, 32}, {8, 4, 128, 32}}},
};

static double run_program(const program_case *c)
{
    rf_array *args[3] = {NULL, NULL, NULL};
    rf_exec *e = NULL;
    double us = 0;
    bool ok = true;
    for (int i = 0; i < c->nargs; i++)
        ok = ok && (args[i] = normal_array(c->dtype, c->dims[i], c->rank, (uint64_t)i + 1)) != NULL;
    if (ok && rf_compile(c->fn, NULL, args, c->nargs, &e) == RF_OK)
        us = time_exec(e, args, c->nargs);
    else
        fprintf(stderr, "bench_patterns: %s: %s\n", c->name, rf_errmsg());
    rf_exec_free(e);
    for (int i = 0; i < c->nargs; i++)
        rf_array_free(args[i]);
    return us;
}

/* ---- Training steps ------------------------------------------------------------------ */

static rf_tensor *class_loss(rf_model *m, rf_tensor *const *batch, int n, rf_aux *aux, void *ctx)
{
    (void)n, (void)aux, (void)ctx;
    return rf_logitcrossentropy(rf_apply(m, batch[0]), batch[1]);
}

static rf_model *groupnorm_cnn(void)
{
    static const rf_conv_opts same = {.pad = {1, 1}};
    return rf_chain(rf_conv2d(3, 3, 64, 64, RF_ACT_IDENTITY, &same), rf_groupnorm(64, 8),
                    rf_activation_layer(RF_ACT_RELU),
                    rf_conv2d(3, 3, 64, 64, RF_ACT_IDENTITY, &same), rf_groupnorm(64, 8),
                    rf_activation_layer(RF_ACT_RELU), rf_global_meanpool(), rf_flatten_layer(),
                    rf_dense(64, 10, RF_ACT_IDENTITY));
}

static rf_model *mlp(void)
{
    return rf_chain(rf_dense(784, 512, RF_ACT_RELU), rf_dense(512, 256, RF_ACT_RELU),
                    rf_dense(256, 10, RF_ACT_IDENTITY));
}

static rf_model *dropout_mlp(void)
{
    return rf_chain(rf_dense(784, 512, RF_ACT_RELU), rf_dropout(0.5, 7),
                    rf_dense(512, 256, RF_ACT_RELU), rf_dropout(0.5, 8),
                    rf_dense(256, 10, RF_ACT_IDENTITY));
}

static rf_rule *adam(void) { return rf_adam(1e-3); }
static rf_rule *clipped_adam(void) { return rf_chain_rules(rf_clipnorm_global(1.0, 2), rf_adam(1e-3)); }

typedef struct step_case {
    const char *name;
    rf_model *(*model)(void);
    rf_rule *(*rule)(void);
    int rank;
    int64_t input[4];
} step_case;

static const step_case STEPS[] = {
    {"groupnorm_cnn", groupnorm_cnn, adam, 4, {32, 64, 16, 16}},
    {"clipnorm_mlp", mlp, clipped_adam, 2, {128, 784}},
    {"dropout_mlp", dropout_mlp, adam, 2, {128, 784}},
};

static double run_step(const step_case *c)
{
    rf_nn_seed(1);
    rf_model *host = c->model();
    rf_model *m = host ? rf_model_to(host, rf_device_default()) : NULL;
    rf_model_free(host);
    rf_opt *opt = m ? rf_setup(c->rule(), m) : NULL;
    int32_t ids[128];
    for (int i = 0; i < c->input[0]; i++)
        ids[i] = i % 10;
    rf_array *labels = rf_array_from(RF_I32, c->input, 1, ids);
    rf_array *batch[2] = {normal_array(RF_F32, c->input, c->rank, 3),
                          labels ? rf_array_to(labels, rf_device_default()) : NULL};
    rf_array_free(labels);
    double ts[TIMED_RUNS], loss, us = 0;
    bool ok = opt && batch[0] && batch[1];
    if (ok)
        rf_trainmode(m);
    for (int i = 0; ok && i < WARM_RUNS + TIMED_RUNS; i++) {
        double t0 = now_s();
        ok = rf_trainstep(class_loss, NULL, m, batch, 2, opt, &loss, NULL) == RF_OK;
        if (i >= WARM_RUNS)
            ts[i - WARM_RUNS] = now_s() - t0;
    }
    if (ok) {
        qsort(ts, TIMED_RUNS, sizeof ts[0], cmp_double);
        us = 1e6 * ts[TIMED_RUNS / 2];
    } else {
        fprintf(stderr, "bench_patterns: %s: %s\n", c->name, rf_errmsg());
    }
    rf_array_free(batch[0]);
    rf_array_free(batch[1]);
    rf_opt_free(opt);
    rf_model_free(m);
    return us;
}

int main(int argc, char **argv)
{
    const char *only = argc > 1 ? argv[1] : NULL;
    for (size_t i = 0; i < sizeof PROGRAMS / sizeof PROGRAMS[0]; i++)
        if (!only || strstr(PROGRAMS[i].name, only))
            printf("pattern=%s us=%.1f\n", PROGRAMS[i].name, run_program(&PROGRAMS[i]));
    for (size_t i = 0; i < sizeof STEPS / sizeof STEPS[0]; i++)
        if (!only || strstr(STEPS[i].name, only))
            printf("pattern=%s us=%.1f\n", STEPS[i].name, run_step(&STEPS[i]));
    return 0;
}
