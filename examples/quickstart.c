/* quickstart.c: the guide "Compiling Flux with Reactant", section by section, in C.
 *
 * Chain(Dense(4 => 8, tanh), Dense(8 => 2)) on the compute device: its
 * forward pass compiled once and run (then the same with rf_jit_model); a
 * training step written by hand (withgradient + update) compiled once and
 * run for 100 epochs; the same with rf_trainstep, its gradient-returning
 * form and an auxiliary output; and rf_train over a device-wrapped loader,
 * with the compile cache's statistics showing that it is keyed on the batch
 * shape; then rf_train with an on_step callback (a learning-rate schedule,
 * a log line every few steps with the gradient norm, early stopping). The
 * guide's tips are the comments marked "Tip".
 *
 * Every call is checked: on failure the example prints rf_errmsg() and exits
 * 1 after freeing what it made.
 */
#include <stdio.h>
#include <stdlib.h>

#include "reflux.h"

static void report(const char *what)
{
    fprintf(stderr, "quickstart: %s failed: %s\n", what, rf_errmsg());
}
/* TRY(call): a call returning rf_status; TRY_NEW(var, call): one returning an owned pointer. */
#define TRY(call)                                  \
    do {                                           \
        if ((call) != RF_OK) {                     \
            report(#call);                         \
            goto done;                             \
        }                                          \
    } while (0)
#define TRY_NEW(var, call)                         \
    do {                                           \
        if (((var) = (call)) == NULL) {            \
            report(#call);                         \
            goto done;                             \
        }                                          \
    } while (0)

/* loss(m, x, y) = Flux.mse(m(x), y). The batch is spliced in: batch[0] = x, batch[1] = y. */
static rf_tensor *loss(rf_model *m, rf_tensor *const *batch, int n, rf_aux *aux, void *ctx)
{
    (void)n, (void)aux, (void)ctx;
    return rf_mse(rf_apply(m, batch[0]), batch[1]);
}

/* The same loss with an auxiliary output computed in the same forward pass, on the device:
 * Flux.mse(ŷ, y), (; acc = mean(onecold(ŷ) .== onecold(y))). Only the loss is differentiated. */
static rf_tensor *loss_with_acc(rf_model *m, rf_tensor *const *batch, int n, rf_aux *aux, void *ctx)
{
    (void)n, (void)ctx;
    rf_tensor *yhat = rf_apply(m, batch[0]);
    rf_aux_set(aux, "acc", rf_accuracy(yhat, batch[1]));
    return rf_mse(yhat, batch[1]);
}

/* my_step!(loss, model, x, y, opt_state): a plain C function describing one optimisation step.
 * It differentiates the loss, records the in-place update of the model and the optimiser state,
 * and returns the loss. Model and optimiser are captured; x and y are the step's arguments. */
struct step { rf_model *model; rf_opt *opt; };
static void my_step(rf_trace *t, void *ctx)
{
    struct step *s = ctx;
    rf_tensor *batch[2] = {rf_arg(t, 0), rf_arg(t, 1)};
    rf_grads *grads = NULL;
    rf_tensor *l = rf_withgradient(t, loss, NULL, s->model, batch, 2, NULL, &grads);
    rf_update(t, s->opt, s->model, grads); /* Optimisers.update!(opt_state, model, grads) */
    rf_return(t, l);
}

/* Acting between steps: rf_train calls this after every step, when the model and optimiser
 * are updated and free to use. A warm-up then 1/t decay of the learning rate (rf_adjust sets a
 * device scalar: no recompilation), a log line every `every` steps, and a budget of
 * `max_steps` steps that may end a pass early (Lightning's max_steps; an early stop on a
 * validation metric is the same return): RF_TRAIN_STOP ends the pass and is not an error. An
 * error status returned here (a failed rf_checkpoint_save's, say) would be rf_train's. */
struct schedule { double peak; int64_t warmup, every, max_steps, seen; };
static int on_step(const rf_step_info *s, void *user)
{
    struct schedule *c = user;
    int64_t t = ++c->seen;
    double lr = t <= c->warmup ? c->peak * (double)t / (double)c->warmup
                               : c->peak * (double)c->warmup / (double)t;
    rf_status st = rf_adjust(s->opt, lr); /* the next step's rate */
    if (st != RF_OK)
        return st;
    if (t % c->every == 0)
        printf("on_step   step %3lld (batch %lld/%lld) loss=%.5f grad_norm=%.4f next lr=%.5f\n",
               (long long)s->step, (long long)s->batch, (long long)s->n_batches, s->loss,
               rf_stats_get(&s->stats, RF_STATS_GRAD_NORM), lr);
    return t >= c->max_steps ? RF_TRAIN_STOP : RF_TRAIN_CONTINUE;
}

static void print_cache(const char *when, rf_model *m)
{
    rf_cache_stats cs = rf_model_cache_stats(m);
    printf("%s: %d cached steps, %llu compiles, %llu hits\n", when, cs.entries,
           (unsigned long long)cs.compiles, (unsigned long long)cs.hits);
}

int main(void)
{
    int rc = 1;
    rf_model *host_model = NULL, *model = NULL;
    rf_array *x_host = NULL, *y_host = NULL, *x = NULL, *y = NULL, *yhat = NULL, *yhat_host = NULL;
    rf_array *y2 = NULL, *X = NULL, *Y = NULL, *X120 = NULL, *Y120 = NULL, **grads = NULL;
    int ngrads = 0;
    rf_exec *forward = NULL, *step = NULL;
    rf_opt *opt = NULL;
    rf_loader *loader = NULL, *ragged = NULL;
    double l = 0;

    /* ---- "Moving data and models to the device" ------------------------------------------ */
    rf_device *dev = rf_device_default(); /* CUDA if usable, else the CPU; call once and reuse */
    rf_nn_seed(1);                        /* reproducible initial weights */
    TRY_NEW(host_model, rf_chain(rf_dense(4, 8, RF_ACT_TANH), rf_dense(8, 2, RF_ACT_IDENTITY)));
    TRY_NEW(x_host, rf_randn(RF_F32, RF_SHAPE(16, 4), 1)); /* batch first: 16 samples of 4 */
    TRY_NEW(y_host, rf_randn(RF_F32, RF_SHAPE(16, 2), 2));
    TRY_NEW(model, rf_model_to(host_model, dev)); /* model |> dev: a copy, f32 by default */
    TRY_NEW(x, rf_array_to(x_host, dev));         /* Tip: everything a compiled function is */
    TRY_NEW(y, rf_array_to(y_host, dev));         /* fed must already live on the device.   */

    /* ---- "1. A manually compiled example": "Compiling the forward pass (inference)" ------ */
    /* The model is the callee: its parameters are captured by reference, so the executable takes
     * only x and sees every later training update. It is specialised to x's shape. */
    TRY(rf_compile_model(model, x, &forward)); /* compile once... */
    TRY(rf_exec_run(forward, &x, 1, &yhat, 1)); /* ...then call it: forward(x) */
    TRY_NEW(yhat_host, rf_array_to(yhat, rf_device_host())); /* Tip: read results back */
    float out[16 * 2];
    TRY(rf_array_read(yhat_host, out, sizeof out));
    printf("forward: y[0] = (%.4f, %.4f)\n", out[0], out[1]);
    TRY(rf_jit_model(model, x, &y2)); /* compile and run in one go, for a one-off evaluation */

    /* ---- "Compiling a training step manually" -------------------------------------------- */
    /* Tip: setup after moving to the device, so the optimiser state (Adam's moments and beta^t,
     * the hyperparameters too) is made of device arrays. */
    TRY_NEW(opt, rf_setup(rf_adam(1e-2), model));
    rf_trainmode(model);
    struct step s = {model, opt};
    rf_array *batch[2] = {x, y};
    TRY(rf_compile(my_step, &s, batch, 2, &step)); /* compile once */
    for (int epoch = 1; epoch <= 100; epoch++) {
        rf_array *lv = NULL;
        TRY(rf_exec_run(step, batch, 2, &lv, 1)); /* reuse the executable each epoch */
        l = rf_to_number(lv);                      /* Tip: Reactant.to_number for a scalar */
        rf_array_free(lv);
        if (epoch % 10 == 0)
            printf("manual step     epoch %3d loss=%.5f\n", epoch, l);
    }

    /* ---- "2. The trainstep! API" --------------------------------------------------------- */
    /* The same fused step, compiled on the first call and cached on the model; it returns the
     * loss as a host number. */
    for (int epoch = 1; epoch <= 100; epoch++) {
        TRY(rf_trainstep(loss, NULL, model, batch, 2, opt, &l, NULL));
        if (epoch % 10 == 0)
            printf("rf_trainstep    epoch %3d loss=%.5f\n", epoch, l);
    }
    /* trainstep_withgradient!: the gradients come back too, left on the device (one array per
     * parameter). They are outputs of the compiled step, so prefer rf_trainstep without them. */
    TRY(rf_trainstep_withgradient(loss, NULL, model, batch, 2, opt, &l, NULL, &grads, &ngrads));
    printf("rf_trainstep_withgradient: loss=%.5f, %d gradients, the first %lldx%lld\n", l, ngrads,
           (long long)rf_array_dims(grads[0])[0], (long long)rf_array_dims(grads[0])[1]);

    /* ---- "Auxiliary loss outputs" -------------------------------------------------------- */
    rf_stats stats;
    TRY(rf_trainstep(loss_with_acc, NULL, model, batch, 2, opt, &l, &stats));
    printf("aux: loss=%.5f acc=%.4f\n", l, rf_stats_get(&stats, "acc"));

    /* ---- "3. The train! API" ------------------------------------------------------------- */
    /* One trainstep per batch, with a progress bar; a non-finite loss stops it with RF_E_DOMAIN.
     * Tip: device-resident data. A loader wrapped with the device moves each batch lazily,
     * prepares the next one in the background and frees the previous one. */
    TRY_NEW(X, rf_randn(RF_F32, RF_SHAPE(128, 4), 3));
    TRY_NEW(Y, rf_randn(RF_F32, RF_SHAPE(128, 2), 4));
    TRY_NEW(loader, rf_loader_new((rf_array *[]){X, Y}, 2, &(rf_loader_opts){.batchsize = 16}));
    TRY(rf_loader_to(loader, dev));
    for (int epoch = 1; epoch <= 5; epoch++) {
        char label[16];
        snprintf(label, sizeof label, "epoch %d", epoch);
        /* progress: 1 always, 0 never, -1 only when stderr is a terminal */
        TRY(rf_train(loss, NULL, model, loader, opt,
                     &(rf_train_opts){.label = label, .mean_loss = &l}));
        printf("rf_train        epoch %3d mean loss=%.5f\n", epoch, l);
    }

    /* ---- "Tips and gotchas": compilation is keyed on shape; watch the compile cache ------ */
    /* One executable per distinct (model, optimiser, loss, batch shape): trainstep, the
     * gradient-returning step and the aux loss made three; rf_train's batches of 16 reused the
     * first. 120 observations end with a batch of 8: exactly one more compile, then reused. */
    print_cache("after rf_train", model);
    TRY_NEW(X120, rf_array_from(RF_F32, RF_SHAPE(120, 4), rf_array_data(X)));
    TRY_NEW(Y120, rf_array_from(RF_F32, RF_SHAPE(120, 2), rf_array_data(Y)));
    TRY_NEW(ragged,
            rf_loader_new((rf_array *[]){X120, Y120}, 2, &(rf_loader_opts){.batchsize = 16}));
    TRY(rf_loader_to(ragged, dev));
    for (int epoch = 1; epoch <= 2; epoch++)
        TRY(rf_train(loss, NULL, model, ragged, opt,
                     &(rf_train_opts){.progress = RF_PROGRESS_OFF}));
    print_cache("with a final batch of 8", model);
    /* Rebuilding the model or the optimiser every iteration would compile every time: past 8
     * entries the cache warns. Its entries are freed with the model (rf_model_free). */

    /* ---- Acting between steps: a schedule, logging and early stopping (on_step) ----------- */
    /* The optimiser also reports the global gradient norm ("grad_norm" in the step's stats):
     * computed in the fused step only when asked, so one more compile, then none per rate. */
    TRY(rf_opt_track_grad_norm(opt, true));
    struct schedule sched = {.peak = 1e-2, .warmup = 8, .every = 4, .max_steps = 20};
    for (int epoch = 1; epoch <= 4; epoch++) {
        int64_t done = 0;
        bool stopped = false;
        TRY(rf_train(loss, NULL, model, loader, opt,
                     &(rf_train_opts){.progress = RF_PROGRESS_OFF, .mean_loss = &l,
                                      .on_step = on_step, .user = &sched,
                                      .batches_done = &done, .stopped = &stopped}));
        printf("rf_train        epoch %3d mean loss=%.5f over %lld batches%s\n", epoch, l,
               (long long)done, stopped ? ", stopped early" : "");
        if (stopped)
            break;
    }
    print_cache("after the schedule", model);

    /* forward captured the parameters by reference: it sees the trained model. */
    rf_array_free(yhat);
    yhat = NULL;
    TRY(rf_exec_run(forward, &x, 1, &yhat, 1));
    TRY(rf_array_read(yhat, out, sizeof out));
    printf("forward after training: y[0] = (%.4f, %.4f)\n", out[0], out[1]);
    rc = 0;

done:
    for (int i = 0; i < ngrads; i++)
        rf_array_free(grads[i]);
    free(grads);
    rf_loader_free(ragged);
    rf_loader_free(loader);
    rf_exec_free(step);
    rf_exec_free(forward);
    rf_opt_free(opt);
    rf_model_free(model); /* frees its cached steps too */
    rf_model_free(host_model);
    rf_array_free(X120), rf_array_free(Y120), rf_array_free(X), rf_array_free(Y);
    rf_array_free(y2), rf_array_free(yhat_host), rf_array_free(yhat);
    rf_array_free(x), rf_array_free(y), rf_array_free(x_host), rf_array_free(y_host);
    return rc;
}
