/* test_util.h: the tiny harness every test uses: checks that count failures
 * and print where they happened, and a main-side summary. A test binary exits
 * non-zero if any check failed. */
#ifndef RF_TEST_UTIL_H
#define RF_TEST_UTIL_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "reflux.h"

static int tu_failures;
static int tu_checks;

#define CHECK(cond)                                                                 \
    do {                                                                            \
        tu_checks++;                                                                \
        if (!(cond)) {                                                              \
            tu_failures++;                                                          \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
        }                                                                           \
    } while (0)

/* Checks a status and prints rf_errmsg() when it is not the expected one. */
#define CHECK_STATUS(expr, expected)                                                  \
    do {                                                                              \
        rf_status tu_st = (expr);                                                     \
        tu_checks++;                                                                  \
        if (tu_st != (expected)) {                                                    \
            tu_failures++;                                                            \
            fprintf(stderr, "%s:%d: %s returned %s, expected %s (%s)\n", __FILE__,     \
                    __LINE__, #expr, rf_status_str(tu_st), rf_status_str(expected),   \
                    rf_errmsg());                                                     \
        }                                                                             \
    } while (0)
#define CHECK_OK(expr) CHECK_STATUS(expr, RF_OK)

/* |a - b| <= atol + rtol * |b| */
#define CHECK_NEAR(a, b, atol, rtol)                                                  \
    do {                                                                              \
        double tu_a = (double)(a), tu_b = (double)(b);                                \
        tu_checks++;                                                                  \
        if (!(fabs(tu_a - tu_b) <= (atol) + (rtol) * fabs(tu_b))) {                   \
            tu_failures++;                                                            \
            fprintf(stderr, "%s:%d: %s = %.10g, expected %s = %.10g\n", __FILE__,      \
                    __LINE__, #a, tu_a, #b, tu_b);                                    \
        }                                                                             \
    } while (0)

/* Checks that the last error message contains `needle`. */
#define CHECK_MSG(needle)                                                             \
    do {                                                                              \
        tu_checks++;                                                                  \
        if (!strstr(rf_errmsg(), (needle))) {                                         \
            tu_failures++;                                                            \
            fprintf(stderr, "%s:%d: message \"%s\" lacks \"%s\"\n", __FILE__, __LINE__, \
                    rf_errmsg(), (needle));                                           \
        }                                                                             \
    } while (0)

/* Removes a temporary directory tree (rm -rf, run without a shell). */
static inline void tu_remove_tree(const char *path)
{
    char *argv[] = {"rm", "-rf", (char *)path, NULL};
    pid_t pid = fork();
    if (pid == 0) {
        execvp("rm", argv);
        _exit(127);
    }
    int ws;
    if (pid > 0)
        waitpid(pid, &ws, 0);
}

/* A model on a device, Adam with its defaults (epsilon 1e-8: test_examples.c) and
 * one batch of n seeded random images [n, 1, h, w] with the given labels,
 * for tests that take training steps. */
typedef struct tu_trainer {
    rf_model *m;
    rf_opt *opt;
    rf_array *x, *y, *xh, *yh;
} tu_trainer;

/* Consumes host; false (checked) when something could not be made. */
static inline bool tu_trainer_make(tu_trainer *t, rf_device *dev, rf_model *host, int64_t n,
                                   int64_t h, int64_t w, uint64_t seed, const int32_t *labels,
                                   double lr)
{
    memset(t, 0, sizeof *t);
    t->m = host ? rf_model_to(host, dev) : NULL;
    rf_model_free(host);
    t->xh = rf_rand(RF_F32, RF_SHAPE(n, 1, h, w), seed);
    t->yh = rf_array_from(RF_I32, RF_SHAPE(n), labels);
    t->x = t->xh ? rf_array_to(t->xh, dev) : NULL;
    t->y = t->yh ? rf_array_to(t->yh, dev) : NULL;
    t->opt = t->m ? rf_setup(rf_adam(lr), t->m) : NULL;
    CHECK(t->m && t->x && t->y && t->opt);
    if (t->m && t->x && t->y && t->opt)
        rf_trainmode(t->m);
    return t->m && t->x && t->y && t->opt;
}

static inline void tu_trainer_free(tu_trainer *t)
{
    rf_opt_free(t->opt);
    rf_model_free(t->m);
    rf_array_free(t->x);
    rf_array_free(t->y);
    rf_array_free(t->xh);
    rf_array_free(t->yh);
}

/* Cross-entropy of the model's logits on the batch (images, labels). */
static inline rf_tensor *tu_ce_loss(rf_model *m, rf_tensor *const *b, int n, rf_aux *aux,
                                    void *ctx)
{
    (void)n, (void)aux, (void)ctx;
    return rf_logitcrossentropy(rf_apply(m, b[0]), b[1]);
}

/* Inside a trace whose arguments 0 and 1 are a batch: one training step of
 * m with opt (tu_ce_loss's gradient, the optimiser's update), the loss
 * returned. */
static inline void tu_train_step(rf_trace *t, rf_model *m, rf_opt *opt)
{
    rf_tensor *batch[2] = {rf_arg(t, 0), rf_arg(t, 1)};
    rf_grads *g = NULL;
    rf_tensor *loss = rf_withgradient(t, tu_ce_loss, NULL, m, batch, 2, NULL, &g);
    if (!loss)
        return;
    rf_update(t, opt, m, g);
    rf_return(t, loss);
}

/* Sets (or with value NULL clears) one environment variable, for the
 * variables a compile reads (RF_BLOCKED and the like). */
static inline void tu_set_env(const char *name, const char *value)
{
    if (value)
        setenv(name, value, 1);
    else
        unsetenv(name);
}

/* Writes an executable script (a fake or wrapping compiler) to path. */
static inline void tu_write_script(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (f) {
        fputs(text, f);
        fclose(f);
    }
    chmod(path, 0700);
}

/* `steps` trainsteps (at most 8) of a fresh model (host, consumed) on one
 * batch of 8 seeded h x w images labelled 0..7 with Adam(1e-3): the losses
 * into out, each checked finite and the last below the first; label heads
 * the printed line. */
static inline void tu_train_steps(rf_device *dev, rf_model *host, int64_t h, int64_t w,
                                  uint64_t seed, rf_loss_fn loss, const char *label, int steps,
                                  double *out)
{
    const int32_t labels[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    tu_trainer t;
    if (tu_trainer_make(&t, dev, host, 8, h, w, seed, labels, 1e-3)) {
        rf_array *batch[2] = {t.x, t.y};
        for (int s = 0; s < steps; s++) {
            out[s] = NAN;
            CHECK_OK(rf_trainstep(loss, NULL, t.m, batch, 2, t.opt, &out[s], NULL));
            CHECK(isfinite(out[s]));
        }
        printf("%s: loss %.7f -> %.7f\n", label, out[0], out[steps - 1]);
        CHECK(out[steps - 1] < out[0]);
    }
    tu_trainer_free(&t);
}

/* Prints a summary and returns the exit code for main. */
static inline int tu_finish(const char *name)
{
    printf("%s: %d checks, %d failed\n", name, tu_checks, tu_failures);
    return tu_failures ? 1 : 0;
}

/* ---- Capturing stderr ------------------------------------------------------------------- */

typedef struct captured {
    int saved;
    FILE *f;
} captured;

static inline void capture_start(captured *c)
{
    fflush(stderr);
    c->f = tmpfile();
    c->saved = dup(fileno(stderr));
    dup2(fileno(c->f), fileno(stderr));
}

/* Restores stderr; returns what was written (malloc'd). */
static inline char *capture_end(captured *c)
{
    fflush(stderr);
    dup2(c->saved, fileno(stderr));
    close(c->saved);
    long n = ftell(c->f);
    if (n < 0)
        n = 0;
    rewind(c->f);
    char *text = calloc((size_t)n + 1, 1);
    if (fread(text, 1, (size_t)n, c->f) != (size_t)n)
        text[0] = '\0';
    fclose(c->f);
    return text;
}

#endif
