/* resnet.c: a small ResNet (basic blocks with BatchNorm and SkipConnection) on
 * Fashion-MNIST: the seed's resnet_tinyimagenet example scaled to this
 * machine. It trains with rf_train and evaluates with one compiled evaluation
 * executable per batch shape (the test set's last batch is smaller, so there
 * are two), reporting time per epoch and test accuracy:
 *
 *     epoch=5 train_loss=0.1761 test_acc=0.9171 seconds=20.4 eval_executables=2
 *
 * Defaults: width 16 (77754 parameters), batch 128, Adam(2e-3) cut to 0.3x for
 * the fourth of 5 epochs and 0.1x for the last (20-27 s per epoch on 2
 * cores shared with other jobs, 0.917 at the end).
 *
 * --matmul-precision bf16 runs the model's convolutions and matrix products
 * on bfloat16 operands (f32 sums), its evaluation executables included.
 *
 * Usage: resnet [--epochs N] [--batch N] [--width C] [--limit N] [--test-limit N]
 *               [--lr X] [--matmul-precision f32|bf16]
 * (--help prints it; an unknown option or a value that does not parse exits
 * with status 2 before anything is loaded).
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <reflux.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "resnet_model.h"

static rf_tensor *loss(rf_model *m, rf_tensor *const *batch, int n, rf_aux *aux, void *ctx)
{
    (void)n, (void)ctx;
    rf_tensor *logits = rf_apply(m, batch[0]);
    rf_aux_set(aux, "acc", rf_accuracy(logits, batch[1]));
    return rf_logitcrossentropy(logits, batch[1]);
}

static void count_correct(rf_trace *t, void *ctx)
{
    rf_tensor *logits = rf_apply(ctx, rf_arg(t, 0));
    rf_tensor *hits = rf_compare(rf_onecold(logits), rf_convert(rf_arg(t, 1), RF_I64), RF_EQ);
    rf_return(t, rf_sum_all(rf_convert(hits, RF_F32)));
}

/* Test accuracy over a loader. count_correct is jitted: one executable per batch shape
 * (the full batches and a smaller last one), compiled on first use and kept for the later
 * epochs; the model is captured by reference, so they see its new weights (it is always
 * called in test mode, the mode it was traced in). */
static rf_status evaluate(rf_jitted *count, rf_loader *test, double *acc)
{
    double correct = 0, total = 0;
    rf_array *const *b;
    rf_status st = rf_loader_reset(test);
    while (st == RF_OK && (st = rf_loader_next(test, &b)) == RF_OK && b) {
        rf_array *out = NULL;
        st = rf_jitted_run(count, b, 2, &out, 1);
        if (st == RF_OK)
            correct += rf_to_number(out), total += (double)rf_array_dims(b[0])[0];
        rf_array_free(out);
    }
    *acc = total > 0 ? correct / total : 0;
    return st;
}

static rf_status take(rf_array **a, int64_t limit)
{
    if (limit <= 0 || limit >= rf_array_dims(*a)[0])
        return RF_OK;
    rf_array *sub = rf_array_rows(*a, 0, limit);
    if (!sub)
        return RF_E_NOMEM;
    rf_array_free(*a);
    *a = sub;
    return RF_OK;
}

static int fail(const char *what)
{
    fprintf(stderr, "resnet: %s: %s\n", what, rf_errmsg());
    return 1;
}

static const char usage[] =
    "usage: resnet [--epochs N] [--batch N] [--width C] [--limit N] [--test-limit N]\n"
    "              [--lr X] [--matmul-precision f32|bf16]\n";

int main(int argc, char **argv)
{
    int epochs = 5;
    int64_t batch = 128, width = 16, limit = 0, test_limit = 0;
    double lr = 2e-3;
    rf_precision precision = RF_PRECISION_F32;
    for (int i = 1; i < argc; i++) {
        const char *k = argv[i];
        if (!strcmp(k, "--help") || !strcmp(k, "-h")) {
            fputs(usage, stdout);
            return 0;
        }
        static const char *const options[] = {"--epochs", "--batch", "--width", "--limit",
                                              "--test-limit", "--lr", "--matmul-precision"};
        if (!cli_known(k, options, (int)(sizeof options / sizeof *options))) {
            fprintf(stderr, "resnet: unknown option %s\n%s", k, usage);
            return 2;
        }
        if (i + 1 == argc) {
            fprintf(stderr, "resnet: %s needs a value\n%s", k, usage);
            return 2;
        }
        const char *v = argv[++i];
        long long n = 0;
        int bad;
        if (!strcmp(k, "--epochs")) {
            bad = cli_int(v, 1, 1000, &n);
            epochs = (int)n;
        } else if (!strcmp(k, "--batch")) {
            bad = cli_int(v, 1, 1 << 20, &n);
            batch = n;
        } else if (!strcmp(k, "--width")) {
            bad = cli_int(v, 1, 4096, &n);
            width = n;
        } else if (!strcmp(k, "--limit")) {
            bad = cli_int(v, 0, INT64_MAX, &n);
            limit = n;
        } else if (!strcmp(k, "--test-limit")) {
            bad = cli_int(v, 0, INT64_MAX, &n);
            test_limit = n;
        } else if (!strcmp(k, "--lr")) {
            bad = cli_positive(v, &lr);
        } else { /* --matmul-precision */
            bad = strcmp(v, "f32") && strcmp(v, "bf16");
            precision = strcmp(v, "bf16") ? RF_PRECISION_F32 : RF_PRECISION_BF16;
        }
        if (bad) {
            fprintf(stderr, "resnet: bad value for %s: '%s'\n%s", k, v, usage);
            return 2;
        }
    }
    rf_device *dev = rf_device_default();
    rf_array *xtrain, *ytrain, *xtest, *ytest;
    if (rf_fashion_mnist(NULL, true, &xtrain, &ytrain) ||
        rf_fashion_mnist(NULL, false, &xtest, &ytest))
        return fail("loading data (install the Debian package dataset-fashion-mnist)");
    if (take(&xtrain, limit) || take(&ytrain, limit) || take(&xtest, test_limit) ||
        take(&ytest, test_limit))
        return fail("subset");

    rf_nn_seed(7);
    rf_model *host = resnet_model(width);
    rf_model *model = host ? rf_model_to(host, dev) : NULL;
    rf_model_free(host);
    if (model && rf_model_set_matmul_precision(model, precision) != RF_OK)
        return fail("setting the matmul precision");
    rf_opt *opt = model ? rf_setup(rf_adam(lr), model) : NULL;
    if (!opt)
        return fail("building the model");
    printf("resnet: %lld parameters\n", (long long)rf_model_n_parameters(model));

    rf_loader_opts train_opts = {.batchsize = batch, .shuffle = true, .seed = 3};
    rf_loader *train = rf_loader_new((rf_array *[]){xtrain, ytrain}, 2, &train_opts);
    /* 768 does not divide 10000: the last test batch has another shape. */
    rf_loader_opts test_opts = {.batchsize = 768};
    rf_loader *test = rf_loader_new((rf_array *[]){xtest, ytest}, 2, &test_opts);
    if (!train || !test || rf_loader_to(train, dev) || rf_loader_to(test, dev))
        return fail("making the loaders");

    rf_jitted *count = rf_jitted_new(count_correct, model);
    if (!count)
        return fail("making the evaluation function");
    for (int e = 1; e <= epochs; e++) {
        /* Step decay over the last two epochs (0.3x, then 0.1x): runtime state,
         * no recompilation. */
        double scale = e == epochs ? 0.1 : 0.3;
        if (epochs > 2 && e >= epochs - 1 && rf_adjust(opt, lr * scale) != RF_OK)
            return fail("adjusting the learning rate");
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        double train_loss = 0, acc = 0;
        rf_trainmode(model);
        if (rf_train(loss, NULL, model, train, opt,
                     &(rf_train_opts){.label = "train", .mean_loss = &train_loss}))
            return fail("training");
        rf_testmode(model);
        if (evaluate(count, test, &acc))
            return fail("evaluating");
        clock_gettime(CLOCK_MONOTONIC, &t1);
        printf("epoch=%d train_loss=%.4f test_acc=%.4f seconds=%.1f eval_executables=%d\n", e,
               train_loss, acc,
               (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec),
               rf_jitted_n_compiled(count));
        fflush(stdout);
    }
    rf_jitted_free(count);
    rf_loader_free(train);
    rf_loader_free(test);
    rf_opt_free(opt);
    rf_model_free(model);
    rf_array_free(xtrain), rf_array_free(ytrain), rf_array_free(xtest), rf_array_free(ytest);
    return 0;
}
