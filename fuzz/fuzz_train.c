/* fuzz_train.c: libFuzzer target for the layer, loss, optimiser and training
 * API: a random model (a chain of up to four layers of sixteen kinds, with
 * sizes, strides, groups and the like sometimes invalid), a random input and
 * target, a loss, and a chain of up to three optimiser rules with
 * hyperparameters drawn from a table that holds invalid ones too (negative,
 * NaN, infinite), and for a quarter of the models bf16 matrix products and
 * convolutions. The model is set up, trained for two steps with rf_trainstep
 * and one with rf_trainstep_withgradient, its learning rate adjusted, and
 * run in test mode with rf_jit_model.
 *
 * Every call must succeed or return an error status: never crash, never
 * leak, never fail inside (RF_E_INTERNAL, RF_E_COMPILE). A step that fails
 * must leave every parameter, state array and optimiser array
 * bit-identical. The programs run on the interpreter.
 *
 * With RF_FUZZ_COMPILED=1 in the environment they run on the compiled CPU
 * backend instead (a few inputs a second), each run checked against the
 * interpreter (RF_CHECK=1). Random optimisers with a tiny eps, the gradients
 * of normalisations of constant groups and losses taken at their poles
 * magnify rounding beyond any fixed tolerance end to end; RF_CHECK judges
 * such a run step by step, each step on the values it read, where rounding
 * does not pile up. A disagreement is fatal, unless a value of the
 * interpreter's it names is NaN or infinite (once a weight is infinite a
 * convolution's result depends on its algorithm: a padding position
 * skipped, or multiplied as 0 * inf = NaN): that is printed and ends the
 * input's training (its updates are already applied). */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_backend.h"
#include "fuzz_bytes.h"
#include "reflux.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* A size in [-1, 4]: mostly valid, sometimes zero or negative. */
static int64_t size_of(bytes *b) { return (int64_t)(next(b) % 6) - 1; }
static rf_act act_of(bytes *b) { return (rf_act)(next(b) % (RF_ACT_COUNT + 1)); }

static const double hyper[] = {1e-3, 0.1, 0.5, 0.9, 0.999, 1e-8, 0, 1, 2, -0.5, NAN, INFINITY};
static double hyper_of(bytes *b) { return hyper[next(b) % (sizeof hyper / sizeof *hyper)]; }

/* ---- The model -------------------------------------------------------------------------- */

static rf_conv_opts conv_opts(bytes *b)
{
    rf_conv_opts o = {0};
    unsigned f = next(b);
    if (f & 1)
        o.stride[0] = o.stride[1] = size_of(b);
    if (f & 2)
        o.pad[0] = size_of(b), o.pad[1] = size_of(b);
    o.pad_same = f & 4;
    if (f & 8)
        o.dilation[0] = o.dilation[1] = size_of(b);
    if (f & 16)
        o.groups = size_of(b);
    o.no_bias = f & 32;
    o.init = (rf_init)(next(b) % (RF_INIT_COUNT + 1));
    return o;
}

static rf_model *layer(bytes *b, int depth)
{
    rf_conv_opts o;
    int64_t k = size_of(b), in = size_of(b), out = size_of(b), h, w;
    double p;
    rf_model *first;
    switch (next(b) % 16) {
    case 0: return rf_dense(in, out, act_of(b));
    case 1: o = conv_opts(b); return rf_conv2d(k, k, in, out, act_of(b), &o);
    case 2: o = conv_opts(b); return rf_conv_transpose2d(k, k, in, out, act_of(b), &o);
    case 3: h = size_of(b), w = size_of(b); return rf_maxpool(k, k, h, w);
    case 4: h = size_of(b), w = size_of(b); return rf_meanpool(k, k, h, w);
    case 5: return rf_global_meanpool();
    case 6: return rf_adaptive_meanpool(in, out);
    case 7: return rf_flatten_layer();
    case 8: return rf_activation_layer(act_of(b));
    case 9: return rf_batchnorm(in, act_of(b));
    case 10: return rf_layernorm(in);
    case 11: return rf_groupnorm(in, out);
    case 12: p = hyper_of(b); return rf_dropout(p, next(b));
    case 13: return rf_embedding(in, out, next(b));
    case 14:
        if (depth > 0)
            return NULL;
        first = layer(b, depth + 1);
        return rf_skip(first, (rf_combine)(next(b) % 4));
    default: {
        if (depth > 0)
            return NULL;
        rf_combine how = (rf_combine)(next(b) % 4);
        first = layer(b, depth + 1);
        return rf_parallel(how, first, layer(b, depth + 1));
    }
    }
}

static rf_model *model(bytes *b)
{
    rf_model *layers[4];
    int n = 1 + (int)(next(b) % 4);
    for (int i = 0; i < n; i++)
        layers[i] = layer(b, 0);
    return rf_chain_n(layers, n);
}

/* ---- The optimiser ---------------------------------------------------------------------- */

static rf_rule *rule(bytes *b)
{
    double a = hyper_of(b), c = hyper_of(b), d = hyper_of(b), e = hyper_of(b);
    switch (next(b) % 21) {
    case 0: return rf_descent(a);
    case 1: return rf_momentum(a, c);
    case 2: return rf_nesterov(a, c);
    case 3: return rf_rmsprop(a, c, d, next(b) & 1);
    case 4: return rf_adam_ex(a, c, d, e);
    case 5: return rf_adamw(a, c, d, e, hyper_of(b));
    case 6: return rf_radam(a, c, d, e);
    case 7: return rf_adamax(a, c, d, e);
    case 8: return rf_oadam(a, c, d, e);
    case 9: return rf_adagrad(a, c);
    case 10: return rf_adadelta(a, c);
    case 11: return rf_amsgrad(a, c, d, e);
    case 12: return rf_nadam(a, c, d, e);
    case 13: return rf_adabelief(a, c, d, e);
    case 14: return rf_lion(a, c, d);
    case 15: return rf_weightdecay(a);
    case 16: return rf_signdecay(a);
    case 17: return rf_clipgrad(a);
    case 18: return rf_clipnorm(a, c);
    case 19: return rf_clipnorm_global(a, c);
    default: return rf_accumgrad((int)size_of(b));
    }
}

static rf_rule *rules(bytes *b)
{
    rf_rule *r[3];
    int n = 1 + (int)(next(b) % 3);
    for (int i = 0; i < n; i++)
        r[i] = rule(b);
    return n == 1 ? r[0] : rf_chain_rules_n(r, n);
}

/* ---- The data and the loss -------------------------------------------------------------- */

/* An input of rank 2 or 4 with dims 0-4: floats with an occasional NaN, or
 * class ids (some out of range) for an embedding. */
static rf_array *input(bytes *b)
{
    int64_t dims[4];
    int rank = next(b) & 1 ? 4 : 2;
    int64_t numel = 1;
    for (int i = 0; i < rank; i++)
        numel *= dims[i] = next(b) % 5;
    unsigned kind = next(b) % 8;
    rf_dtype dtype = kind == 0 ? RF_I32 : RF_F32;
    float v[256];
    int32_t ids[256];
    for (int64_t i = 0; i < numel; i++) {
        v[i] = (float)((int)(i * 37 % 11) - 5) * 0.25f;
        ids[i] = (int32_t)(i % 5) - 1;
    }
    if (kind == 1 && numel > 0)
        v[numel / 2] = NAN;
    return rf_array_new(rf_device_cpu(), dtype, dims, rank,
                        dtype == RF_I32 ? (void *)ids : (void *)v);
}

/* Class ids [n] for the cross-entropies (some out of range). */
static rf_array *labels(bytes *b)
{
    int64_t n = next(b) % 5;
    int32_t ids[4];
    for (int64_t i = 0; i < n; i++)
        ids[i] = (int32_t)(next(b) % 6) - 1;
    return rf_array_new(rf_device_cpu(), RF_I32, (int64_t[]){n}, 1, ids);
}

/* The loss: one of ten, against ones, zeros, or the labels (batch[1]). */
static rf_tensor *loss(rf_model *m, rf_tensor *const *batch, int n, rf_aux *aux, void *ctx)
{
    (void)n;
    unsigned pick = *(const unsigned *)ctx;
    rf_tensor *yhat = rf_apply(m, batch[0]);
    rf_tensor *target = pick / 10 % 3 == 0   ? rf_ones_like(yhat)
                        : pick / 10 % 3 == 1 ? rf_zeros_like(yhat)
                                             : batch[1];
    if (pick / 30 % 2)
        rf_aux_set(aux, "acc", rf_accuracy(yhat, batch[1]));
    switch (pick % 10) {
    case 0: return rf_mse(yhat, target);
    case 1: return rf_mae(yhat, target);
    case 2: return rf_msle(yhat, target);
    case 3: return rf_huber(yhat, target, 1.0);
    case 4: return rf_crossentropy(yhat, target);
    case 5: return rf_logitcrossentropy(yhat, target);
    case 6: return rf_binarycrossentropy(yhat, target);
    case 7: return rf_logitbinarycrossentropy(yhat, target);
    case 8: return rf_kldivergence(yhat, target);
    default: return rf_focal(yhat, target, 2.0);
    }
}

/* ---- What a failed step must leave alone ------------------------------------------------ */

typedef struct snapshot {
    unsigned char *bytes;
    size_t len;
    bool failed;
} snapshot;

static void take(const char *path, rf_array *a, bool trainable, void *ud)
{
    (void)path, (void)trainable;
    snapshot *s = ud;
    size_t n = rf_array_nbytes(a);
    unsigned char *grown = realloc(s->bytes, s->len + n + 1);
    if (!grown || rf_array_read(a, grown + s->len, n) != RF_OK) {
        s->failed = true;
        s->bytes = grown ? grown : s->bytes;
        return;
    }
    s->bytes = grown;
    s->len += n;
}

static snapshot take_all(rf_model *m, rf_opt *opt)
{
    snapshot s = {NULL, 0, false};
    rf_model_visit(m, take, &s);
    rf_opt_visit(opt, take, &s);
    return s;
}

/* Aborts on an internal failure, or on a failed step that changed state.
 * false: stop (a non-finite disagreement, see the top). */
static bool check(rf_status st, const char *what, rf_model *m, rf_opt *opt, const snapshot *before)
{
    if (fuzz_non_finite_disagreement(st, "fuzz_train"))
        return false; /* not fatal (see the top) */
    if (st == RF_E_INTERNAL || st == RF_E_COMPILE) {
        fprintf(stderr, "fuzz_train: %s: %s: %s\n", what, rf_status_str(st), rf_errmsg());
        abort();
    }
    if (st == RF_OK || before->failed)
        return true;
    snapshot after = take_all(m, opt);
    bool same = !after.failed && after.len == before->len &&
                memcmp(after.bytes, before->bytes, after.len) == 0;
    free(after.bytes);
    if (!same) {
        fprintf(stderr, "fuzz_train: %s failed (%s) and changed the model or optimiser\n", what,
                rf_errmsg());
        abort();
    }
    return true;
}

/* false: stop (a non-finite disagreement). */
static bool train(rf_model *m, rf_opt *opt, rf_array *const *batch, unsigned pick, bytes *b)
{
    double l;
    rf_stats stats;
    for (int step = 0; step < 2; step++) {
        snapshot s = take_all(m, opt);
        bool go_on = check(rf_trainstep(loss, &pick, m, batch, 2, opt, &l, &stats),
                           "rf_trainstep", m, opt, &s);
        free(s.bytes);
        if (!go_on)
            return false;
    }
    rf_array **grads = NULL;
    int n_grads = 0;
    snapshot s = take_all(m, opt);
    rf_status st =
        rf_trainstep_withgradient(loss, &pick, m, batch, 2, opt, &l, NULL, &grads, &n_grads);
    bool go_on = check(st, "rf_trainstep_withgradient", m, opt, &s);
    free(s.bytes);
    for (int i = 0; st == RF_OK && i < n_grads; i++)
        rf_array_free(grads[i]);
    free(grads);
    (void)rf_adjust(opt, hyper_of(b));
    return go_on;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static bool started;
    if (!started) {
        fuzz_use_backend("1");
        started = true;
    }
    /* The same weights for the same input, whatever ran before it in this process,
     * so that an input printed or saved by one run replays alike on its own. */
    rf_nn_seed(1);
    bytes b = {data, size, 0};
    rf_model *host = model(&b);
    rf_model *m = host ? rf_model_to(host, rf_device_cpu()) : NULL;
    rf_model_free(host);
    rf_rule *r = rules(&b);
    rf_opt *opt = m && r ? rf_setup(r, m) : (rf_rule_free(r), NULL);
    rf_array *batch[2] = {input(&b), labels(&b)};
    unsigned pick = next(&b), precision = next(&b);
    if (m && precision % 4 == 3) /* a quarter of the models at bf16 */
        (void)rf_model_set_matmul_precision(m, RF_PRECISION_BF16);
    if (m && precision % 16 == 7 &&
        rf_model_set_matmul_precision(m, (rf_precision)9) != RF_E_INVALID) {
        fprintf(stderr, "fuzz_train: rf_model_set_matmul_precision took precision 9\n");
        abort();
    }
    bool go_on = !(opt && batch[0] && batch[1]) || train(m, opt, batch, pick, &b);
    if (go_on && m && batch[0]) {
        rf_testmode(m);
        rf_array *y = NULL;
        rf_status st = rf_jit_model(m, batch[0], &y);
        bool internal = st == RF_E_INTERNAL && !fuzz_non_finite_disagreement(st, "fuzz_train");
        if (internal || st == RF_E_COMPILE) {
            fprintf(stderr, "fuzz_train: rf_jit_model: %s: %s\n", rf_status_str(st), rf_errmsg());
            abort();
        }
        rf_array_free(y);
    }
    rf_array_free(batch[0]);
    rf_array_free(batch[1]);
    rf_opt_free(opt);
    rf_model_free(m);
    return 0;
}
