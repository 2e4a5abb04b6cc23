/* train.c: rf_train, one pass over a loader with one rf_trainstep per batch,
 * a progress bar on stderr, and the mean loss / aux values of the pass.
 *
 * It is deliberately thin: compiling, caching and the non-finite guard are
 * the trainstep's; batching and moving data are the loader's. It only adds
 * the loop, the host-array check, the stop on a non-finite loss (naming the
 * batch), the bar, and the on_step callback after each step (when the step's
 * run is over and the model is free to use: its answer continues, stops or
 * fails the pass).
 */
#include "train_internal.h"

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define BAR_WIDTH 30
#define REDRAW_SECONDS 0.1

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- Progress bar ------------------------------------------------------------------------ */

typedef struct progress {
    bool on;
    const char *label;
    int64_t total;     /* batches in the pass (<= 0: unknown) */
    double start, last_draw;
    int64_t samples;
    double first_end;  /* when batch 1 (whose time includes compiling) ended */
    int64_t first_samples;
    int64_t done;      /* batches stepped so far, and the pass's mean loss */
    double loss;
} progress;

static void format_eta(char *buf, size_t n, double seconds)
{
    long s = seconds > 0 && seconds < 1e8 ? (long)(seconds + 0.5) : 0;
    if (s >= 3600)
        snprintf(buf, n, "%ld:%02ld:%02ld", s / 3600, s / 60 % 60, s % 60);
    else
        snprintf(buf, n, "%ld:%02ld", s / 60, s % 60);
}

/* "\r<label> [=====>    ] 17/469 loss=0.4123 1234 samples/s ETA 0:12", the loss the mean
 * of the pass so far (as Keras shows it), the speed and ETA from the batches after the
 * first, whose time includes compiling the step. */
static void draw(progress *p, int64_t done, double mean_loss, bool force)
{
    double t = now_seconds();
    if (done == 1) {
        p->first_end = t;
        p->first_samples = p->samples;
    }
    p->done = done;
    p->loss = mean_loss;
    if (!p->on || (!force && t - p->last_draw < REDRAW_SECONDS))
        return;
    p->last_draw = t;
    bool steady = done > 1 && t > p->first_end;
    double elapsed = steady ? t - p->first_end : t - p->start;
    int64_t counted = steady ? p->samples - p->first_samples : p->samples;
    int64_t batches = steady ? done - 1 : done;
    double rate = elapsed > 0 ? (double)counted / elapsed : 0;
    fprintf(stderr, "\r%s%s", p->label ? p->label : "", p->label ? " " : "");
    if (p->total > 0) {
        int filled = (int)(done * BAR_WIDTH / p->total);
        char bar[BAR_WIDTH + 1];
        for (int i = 0; i < BAR_WIDTH; i++)
            bar[i] = i < filled - 1 || (i == filled - 1 && done == p->total) ? '='
                     : i == filled - 1                                  ? '>'
                                                                        : ' ';
        bar[BAR_WIDTH] = '\0';
        char eta[32];
        format_eta(eta, sizeof eta,
                   batches > 0 ? elapsed / (double)batches * (double)(p->total - done) : 0);
        fprintf(stderr, "[%s] %lld/%lld loss=%.4f %.0f samples/s ETA %s", bar, (long long)done,
                (long long)p->total, mean_loss, rate, eta);
    } else {
        fprintf(stderr, "%lld loss=%.4f %.0f samples/s", (long long)done, mean_loss, rate);
    }
    fflush(stderr);
}

/* Shows the final state (a throttled last batch included) and ends the line. */
static void finish(progress *p, bool stopped)
{
    if (p->on && p->done > 0) {
        draw(p, p->done, p->loss, true);
        if (stopped)
            fputs(" (stopped)", stderr);
        fputc('\n', stderr);
        fflush(stderr);
    }
}

/* ---- Means --------------------------------------------------------------------------- */

/* Means over the pass with each batch weighted by its size, so that a smaller last
 * batch counts for its samples only: a batch-mean loss becomes the mean over every
 * sample of the pass, as one batch of all of them would give. Each aux value has its
 * own weight, the samples of the batches that reported it: the callback may switch the
 * gradient norm's tracking on or off mid-pass, and then its mean is over the batches
 * that had it (not NaN, nor missing). Names are kept in the order first seen. */
typedef struct means {
    double loss;
    rf_stats stats;                /* weighted sums */
    double stat_weight[RF_MAX_AUX]; /* samples of the batches that reported each */
    double weight;                 /* samples so far */
} means;

static void accumulate(means *a, double loss, const rf_stats *s, double samples)
{
    for (int j = 0; j < s->n; j++) {
        int i = 0;
        while (i < a->stats.n && strcmp(a->stats.names[i], s->names[j]) != 0)
            i++;
        if (i == a->stats.n) {
            if (i == RF_MAX_AUX)
                continue;
            memcpy(a->stats.names[i], s->names[j], sizeof a->stats.names[i]);
            a->stats.values[i] = 0;
            a->stat_weight[i] = 0;
            a->stats.n++;
        }
        a->stats.values[i] += samples * s->values[j];
        a->stat_weight[i] += samples;
    }
    a->loss += samples * loss;
    a->weight += samples;
}

static void report_means(const means *a, const rf_train_opts *o)
{
    if (o->mean_loss)
        *o->mean_loss = a->weight > 0 ? a->loss / a->weight : NAN;
    if (o->mean_stats) {
        *o->mean_stats = a->stats;
        for (int i = 0; i < a->stats.n; i++)
            o->mean_stats->values[i] = a->stats.values[i] / a->stat_weight[i];
    }
}

/* ---- The loop --------------------------------------------------------------------------- */

static rf_status check_host(rf_array *const *batch, int n, int64_t number)
{
    for (int i = 0; i < n; i++) {
        if (batch[i] && batch[i]->device->kind == RF_DEVICE_HOST) {
            char ty[128];
            return rfi_error(RF_E_DEVICE, "rf_train: batch %lld holds host arrays (array %d is "
                             "%s); wrap the loader with rf_loader_to(loader, device) first",
                             (long long)number, i,
                             rfi_type_str(ty, sizeof ty, batch[i]->dtype, batch[i]->dims,
                                          batch[i]->rank));
        }
    }
    return RF_OK;
}

/* One step on batch number `number` (1-based); a non-finite loss becomes the
 * pass's stop message. */
static rf_status train_batch(rf_loss_fn loss, void *ctx, rf_model *m, rf_array *const *batch,
                             int n, rf_opt *opt, int64_t number, double *l, rf_stats *s)
{
    rf_status st = check_host(batch, n, number);
    if (st != RF_OK)
        return st;
    st = rf_trainstep(loss, ctx, m, batch, n, opt, l, s);
    if (st == RF_E_DOMAIN && !isfinite(*l))
        return rfi_error(RF_E_DOMAIN, "rf_train: loss is %s on batch %lld, stopping training",
                         isnan(*l) ? "NaN" : *l > 0 ? "Inf" : "-Inf", (long long)number);
    double norm = rf_stats_get(s, RF_STATS_GRAD_NORM);
    if (st == RF_E_DOMAIN && rf_opt_tracks_grad_norm(opt) && !isfinite(norm))
        return rfi_error(RF_E_DOMAIN, "rf_train: the gradient norm is %s on batch %lld (the "
                         "loss %g is finite), stopping training",
                         isnan(norm) ? "NaN" : "Inf", (long long)number, *l);
    return st;
}

/* ---- The callback ------------------------------------------------------------------- */

/* Calls o->on_step after batch `number`; RF_OK to go on, *stopped set when
 * it asked to stop. Its other answers become rf_train's error. */
static rf_status call_on_step(const rf_train_opts *o, const rf_step_info *info,
                              rf_loader *data, bool *stopped)
{
    uint64_t epoch0, epoch1;
    int64_t pos0, pos1;
    rf_loader_position(data, &epoch0, &pos0);
    uint64_t errors = rfi_error_count();
    int r = o->on_step(info, o->user);
    rf_loader_position(data, &epoch1, &pos1);
    long long number = (long long)info->batch;
    if (r != RF_TRAIN_CONTINUE && r != RF_TRAIN_STOP && (r <= RF_OK || r >= RF_STATUS_COUNT))
        return rfi_error(RF_E_INVALID, "rf_train: on_step returned %d after batch %lld; it "
                         "returns RF_TRAIN_CONTINUE (0), RF_TRAIN_STOP (-1) or an error status",
                         r, number);
    if (epoch1 != epoch0 || pos1 != pos0)
        return rfi_error(RF_E_INVALID, "rf_train: on_step moved the loader after batch %lld "
                         "(from batch %lld of epoch %llu to batch %lld of epoch %llu); the "
                         "loader is rf_train's during the pass", number, (long long)pos0,
                         (unsigned long long)epoch0, (long long)pos1,
                         (unsigned long long)epoch1);
    if (r == RF_TRAIN_STOP)
        *stopped = true;
    if (r == RF_TRAIN_CONTINUE || r == RF_TRAIN_STOP)
        return RF_OK;
    if (rfi_error_count() != errors && rf_errmsg()[0]) { /* not one it cleared */
        char msg[RFI_ERRMSG_MAX];
        snprintf(msg, sizeof msg, "%s", rf_errmsg());
        return rfi_error((rf_status)r, "rf_train: on_step returned %s after batch %lld: %s",
                         rf_status_str((rf_status)r), number, msg);
    }
    return rfi_error((rf_status)r, "rf_train: on_step returned %s after batch %lld (with no "
                     "message: rf_set_error records one)", rf_status_str((rf_status)r), number);
}

rf_status rf_train(rf_loss_fn loss, void *ctx, rf_model *m, rf_loader *data, rf_opt *opt,
                   const rf_train_opts *o)
{
    rf_train_opts defaults;
    memset(&defaults, 0, sizeof defaults);
    if (!o)
        o = &defaults;
    if (o->batches_done)
        *o->batches_done = 0;
    if (o->stopped)
        *o->stopped = false;
    if ((unsigned)o->progress > RF_PROGRESS_ON)
        return rfi_error(RF_E_INVALID, "rf_train: progress is %d, not an rf_progress",
                         (int)o->progress);
    if (!loss || !m || !data || !opt)
        return rfi_error(RF_E_INVALID, "rf_train: %s is NULL",
                         !loss ? "loss" : !m ? "model" : !data ? "data" : "opt");
    rf_status st = rf_loader_reset(data);
    if (st != RF_OK)
        return st;
    int n = rf_loader_n_arrays(data);
    bool bar = o->progress == RF_PROGRESS_ON ||
               (o->progress == RF_PROGRESS_AUTO && isatty(fileno(stderr)));
    progress p = {bar, o->label,
                  rf_loader_n_batches(data), now_seconds(), 0, 0, 0, 0, 0, NAN};
    means acc;
    memset(&acc, 0, sizeof acc);
    bool stopped = false;
    int64_t done = 0;
    for (int64_t number = 1; !stopped; number++) {
        rf_array *const *batch = NULL;
        st = rf_loader_next(data, &batch);
        if (st != RF_OK || !batch)
            break;
        double l = NAN;
        rf_stats s;
        st = train_batch(loss, ctx, m, batch, n, opt, number, &l, &s);
        if (st != RF_OK)
            break;
        done = number;
        int64_t samples = batch[0] && batch[0]->rank > 0 ? batch[0]->dims[0] : 1;
        p.samples += samples;
        accumulate(&acc, l, &s, (double)samples);
        draw(&p, number, acc.loss / acc.weight, false);
        if (o->on_step) {
            rf_step_info info = {
                .batch = number,
                .n_batches = p.total,
                .step = rf_opt_steps(opt),
                .batch_size = samples,
                .samples = p.samples,
                .loss = l,
                .mean_loss = acc.loss / acc.weight,
                .stats = s,
                .elapsed = now_seconds() - p.start,
                .model = m,
                .opt = opt,
            };
            st = call_on_step(o, &info, data, &stopped);
            if (st != RF_OK)
                break;
        }
    }
    finish(&p, stopped);
    report_means(&acc, o);
    if (o->batches_done)
        *o->batches_done = done;
    if (o->stopped)
        *o->stopped = stopped;
    return st;
}
