/* loss.c: Flux's loss functions (mse, mae, msle, huber, the cross-entropies,
 * kldivergence, focal) and the classification helpers onecold and accuracy,
 * as composites of public ops, so every loss is differentiable by rf_grad and
 * runs on every backend.
 *
 * Conventions (Flux's, with batch-first shapes): elementwise losses are the
 * mean over all elements; class losses sum over the class axis (1) and take
 * the mean over every other axis (the batch, and spatial positions for
 * [N, C, H, W]). eps is Flux's epseltype: the machine epsilon of yhat's dtype.
 * Class targets are one-hot (yhat's shape and dtype) or integer class ids
 * (yhat's shape without axis 1), which are turned into one-hot with rf_onehot.
 *
 * Ids are unknown while tracing, so an id outside [0, C) cannot be refused;
 * its row of the target is NaN instead (poison_bad_ids), so the loss is NaN
 * and a training step says so, rather than the row silently adding nothing.
 *
 * Deliberately not here: agg= choices other than mean, label smoothing.
 */
#include <float.h>
#include <math.h>
#include <stdio.h>

#include "reflux.h"

#define CLASS_AXIS 1

/* ---- Messages ------------------------------------------------------------------------ */

/* Room for "f32[...]" of the largest rank with 20-digit dims. */
#define TYPE_STR_MAX 256

/* "f32[16,2]" for x into buf. */
static const char *type_str(const rf_tensor *x, char *buf, size_t n)
{
    int len = snprintf(buf, n, "%s[", rf_dtype_name(rf_tensor_dtype(x)));
    for (int i = 0; i < rf_tensor_rank(x) && len > 0 && (size_t)len < n; i++)
        len += snprintf(buf + len, n - (size_t)len, "%s%lld", i ? "," : "",
                        (long long)rf_tensor_dim(x, i));
    if (len > 0 && (size_t)len < n)
        snprintf(buf + len, n - (size_t)len, "]");
    return buf;
}

#define TSTR(x) type_str((x), (char[TYPE_STR_MAX]){0}, TYPE_STR_MAX)

static bool is_float(rf_dtype dt) { return dt == RF_F32 || dt == RF_F64; }

static bool is_int(rf_dtype dt) { return dt == RF_I32 || dt == RF_I64 || dt == RF_U8; }

/* Flux's epseltype: eps(Float32) = 1.19e-7, eps(Float64) = 2.2e-16. */
static double eps_of(const rf_tensor *x)
{
    return rf_tensor_dtype(x) == RF_F64 ? DBL_EPSILON : FLT_EPSILON;
}

static bool same_shape(const rf_tensor *a, const rf_tensor *b)
{
    if (rf_tensor_rank(a) != rf_tensor_rank(b))
        return false;
    for (int i = 0; i < rf_tensor_rank(a); i++)
        if (rf_tensor_dim(a, i) != rf_tensor_dim(b, i))
            return false;
    return true;
}

/* Both present and in one trace (a NULL operand is an earlier failure: no new
 * message, like the ops). */
static bool check_operands(const char *fn, rf_tensor *yhat, rf_tensor *y)
{
    if (!yhat || !y)
        return false;
    if (rf_tensor_trace(yhat) != rf_tensor_trace(y)) {
        rf_trace_fail(rf_tensor_trace(yhat), RF_E_INVALID,
                      "%s: yhat %s and y %s belong to different traces", fn, TSTR(yhat), TSTR(y));
        return false;
    }
    if (!is_float(rf_tensor_dtype(yhat))) {
        rf_trace_fail(rf_tensor_trace(yhat), RF_E_DTYPE,
                      "%s: yhat %s must be floating point (f32 or f64)", fn, TSTR(yhat));
        return false;
    }
    return true;
}

/* yhat and y of one float dtype and one shape. */
static bool check_pair(const char *fn, rf_tensor *yhat, rf_tensor *y)
{
    if (!check_operands(fn, yhat, y))
        return false;
    if (rf_tensor_dtype(yhat) != rf_tensor_dtype(y)) {
        rf_trace_fail(rf_tensor_trace(yhat), RF_E_DTYPE, "%s: yhat %s and y %s differ in dtype",
                      fn, TSTR(yhat), TSTR(y));
        return false;
    }
    if (!same_shape(yhat, y)) {
        rf_trace_fail(rf_tensor_trace(yhat), RF_E_SHAPE, "%s: yhat %s and y %s differ", fn,
                      TSTR(yhat), TSTR(y));
        return false;
    }
    return true;
}

/* x has a class axis: rank >= 2, [N, C, ...]. */
static bool check_class_axis(const char *fn, const char *what, rf_tensor *x)
{
    if (rf_tensor_rank(x) >= 2)
        return true;
    rf_trace_fail(rf_tensor_trace(x), RF_E_SHAPE,
                  "%s: %s %s needs a class axis (axis 1): [N, C]", fn, what, TSTR(x));
    return false;
}

/* ids has x's shape without the class axis. */
static bool ids_match(const rf_tensor *x, const rf_tensor *ids)
{
    if (rf_tensor_rank(ids) != rf_tensor_rank(x) - 1)
        return false;
    for (int i = 0, j = 0; i < rf_tensor_rank(x); i++) {
        if (i == CLASS_AXIS)
            continue;
        if (rf_tensor_dim(ids, j++) != rf_tensor_dim(x, i))
            return false;
    }
    return true;
}

/* ---- Class targets --------------------------------------------------------------------- */

/* One-hot of integer ids [N, ...] as yhat's dtype with the classes on axis 1:
 * [N, C, ...]. rf_onehot puts the classes last, so move them for rank > 2. */
static rf_tensor *onehot_on_axis1(rf_tensor *ids, int64_t nclasses, rf_dtype dt)
{
    rf_tensor *hot = rf_onehot(ids, nclasses, dt);
    int rank = rf_tensor_rank(ids) + 1;
    if (!hot || rank == 2)
        return hot;
    int64_t perm[RF_MAX_RANK];
    perm[0] = 0;
    perm[1] = rank - 1;
    for (int i = 2; i < rank; i++)
        perm[i] = i - 1;
    return rf_transpose(hot, perm);
}

/* The one-hot target `hot` [N, C, ...] of ids [N, ...] with the rows of ids
 * outside [0, C) NaN: their one-hot rows are zero, which would silently
 * leave them out of the loss (PyTorch raises for them), so the loss is NaN
 * instead, and a training step applies no update and says so (RF_E_DOMAIN). */
static rf_tensor *poison_bad_ids(rf_tensor *hot, rf_tensor *ids)
{
    if (!hot)
        return NULL;
    rf_trace *t = rf_tensor_trace(ids);
    rf_dtype dt = rf_tensor_dtype(hot);
    if (rf_tensor_dtype(ids) == RF_U8) /* C may be past 255: compare in i32, as rf_onehot */
        ids = rf_convert(ids, RF_I32);
    rf_tensor *valid = rf_and(rf_compare(ids, rf_scalar(t, 0), RF_GE),
                              rf_compare(ids, rf_scalar(t, (double)rf_tensor_dim(hot, CLASS_AXIS)),
                                         RF_LT));
    rf_tensor *poison = rf_select(valid, rf_scalar_typed(t, dt, 0), rf_scalar_typed(t, dt, NAN));
    return rf_add(hot, rf_unsqueeze(poison, CLASS_AXIS));
}

/* The float target for a class loss: y itself when it is one-hot (checked
 * like check_pair), else the one-hot of integer class ids. NULL on error. */
static rf_tensor *class_target(const char *fn, rf_tensor *yhat, rf_tensor *y)
{
    if (!check_operands(fn, yhat, y) || !check_class_axis(fn, "yhat", yhat))
        return NULL;
    if (!is_int(rf_tensor_dtype(y)))
        return check_pair(fn, yhat, y) ? y : NULL;
    if (!ids_match(yhat, y)) {
        rf_trace_fail(rf_tensor_trace(yhat), RF_E_SHAPE,
                      "%s: class ids y %s do not match yhat %s (ids take yhat's shape without "
                      "the class axis 1)", fn, TSTR(y), TSTR(yhat));
        return NULL;
    }
    return poison_bad_ids(onehot_on_axis1(y, rf_tensor_dim(yhat, CLASS_AXIS),
                                          rf_tensor_dtype(yhat)), y);
}

/* mean over all non-class axes of sum over the class axis: Flux's
 * agg(sum(z; dims = 1)) with agg = mean. */
static rf_tensor *mean_of_class_sums(rf_tensor *z)
{
    const int64_t axis = CLASS_AXIS;
    return rf_mean_all(rf_sum(z, &axis, 1, false));
}

/* -mean(sum(y .* log(yhat .+ eps); dims = 1)): Flux's crossentropy. */
static rf_tensor *crossentropy_of(rf_tensor *yhat, rf_tensor *target)
{
    if (!target)
        return NULL;
    rf_tensor *logp = rf_log(rf_add_s(yhat, eps_of(yhat)));
    return rf_neg(mean_of_class_sums(rf_mul(target, logp)));
}

/* ---- Regression losses ------------------------------------------------------------------ */

rf_tensor *rf_mse(rf_tensor *yhat, rf_tensor *y)
{
    if (!check_pair("rf_mse", yhat, y))
        return NULL;
    rf_tensor *d = rf_sub(yhat, y);
    return rf_mean_all(rf_mul(d, d));
}

rf_tensor *rf_mae(rf_tensor *yhat, rf_tensor *y)
{
    if (!check_pair("rf_mae", yhat, y))
        return NULL;
    return rf_mean_all(rf_abs(rf_sub(yhat, y)));
}

rf_tensor *rf_msle(rf_tensor *yhat, rf_tensor *y)
{
    if (!check_pair("rf_msle", yhat, y))
        return NULL;
    double eps = eps_of(yhat);
    rf_tensor *d = rf_sub(rf_log(rf_add_s(yhat, eps)), rf_log(rf_add_s(y, eps)));
    return rf_mean_all(rf_mul(d, d));
}

rf_tensor *rf_huber(rf_tensor *yhat, rf_tensor *y, double delta)
{
    static const char fn[] = "rf_huber";
    if (!check_pair(fn, yhat, y))
        return NULL;
    if (!(delta > 0) || !isfinite(delta)) {
        rf_trace_fail(rf_tensor_trace(yhat), RF_E_INVALID,
                      "%s: delta must be positive and finite, got %g", fn, delta);
        return NULL;
    }
    /* Flux: 0.5 err^2 where err < delta, delta (err - delta/2) elsewhere; the
     * mask carries no gradient (a select routes the cotangent to one branch). */
    rf_tensor *err = rf_abs(rf_sub(yhat, y));
    rf_tensor *small = rf_compare(err, rf_scalar(rf_tensor_trace(yhat), delta), RF_LT);
    rf_tensor *quadratic = rf_mul_s(rf_mul(err, err), 0.5);
    rf_tensor *linear = rf_mul_s(rf_sub_s(err, 0.5 * delta), delta);
    return rf_mean_all(rf_select(small, quadratic, linear));
}

/* ---- Classification losses ------------------------------------------------------------------ */

rf_tensor *rf_crossentropy(rf_tensor *yhat, rf_tensor *y)
{
    return crossentropy_of(yhat, class_target("rf_crossentropy", yhat, y));
}

rf_tensor *rf_logitcrossentropy(rf_tensor *logits, rf_tensor *y)
{
    rf_tensor *target = class_target("rf_logitcrossentropy", logits, y);
    if (!target)
        return NULL;
    rf_tensor *logp = rf_logsoftmax(logits, CLASS_AXIS);
    return rf_neg(mean_of_class_sums(rf_mul(target, logp)));
}

rf_tensor *rf_binarycrossentropy(rf_tensor *yhat, rf_tensor *y)
{
    if (!check_pair("rf_binarycrossentropy", yhat, y))
        return NULL;
    /* Flux: mean(-y log(yhat + eps) - (1 - y) log(1 - yhat + eps)) */
    double eps = eps_of(yhat);
    rf_tensor *one = rf_scalar(rf_tensor_trace(yhat), 1.0);
    rf_tensor *pos = rf_mul(y, rf_log(rf_add_s(yhat, eps)));
    rf_tensor *neg = rf_mul(rf_sub(one, y), rf_log(rf_add_s(rf_sub(one, yhat), eps)));
    return rf_neg(rf_mean_all(rf_add(pos, neg)));
}

rf_tensor *rf_logitbinarycrossentropy(rf_tensor *logits, rf_tensor *y)
{
    if (!check_pair("rf_logitbinarycrossentropy", logits, y))
        return NULL;
    /* Flux: mean((1 - y) x - logsigmoid(x)), with -logsigmoid(x) = softplus(-x),
     * which rf_softplus evaluates without overflow for any x. */
    rf_tensor *one = rf_scalar(rf_tensor_trace(logits), 1.0);
    rf_tensor *z = rf_add(rf_mul(rf_sub(one, y), logits), rf_softplus(rf_neg(logits)));
    return rf_mean_all(z);
}

rf_tensor *rf_kldivergence(rf_tensor *yhat, rf_tensor *y)
{
    static const char fn[] = "rf_kldivergence";
    if (!check_pair(fn, yhat, y) || !check_class_axis(fn, "yhat", yhat))
        return NULL;
    /* Flux: mean(sum(xlogx(y); dims = 1)) + crossentropy(yhat, y), xlogx(0) = 0.
     * log(1) = 0 stands in for log(0), so neither value nor gradient sees
     * 0 * -inf. */
    rf_tensor *zero = rf_scalar(rf_tensor_trace(y), 0.0);
    rf_tensor *is0 = rf_compare(y, zero, RF_EQ);
    rf_tensor *safe_y = rf_select(is0, rf_ones_like(y), y);
    rf_tensor *entropy = mean_of_class_sums(rf_mul(y, rf_log(safe_y)));
    return rf_add(entropy, crossentropy_of(yhat, y));
}

rf_tensor *rf_focal(rf_tensor *yhat, rf_tensor *y, double gamma)
{
    static const char fn[] = "rf_focal";
    rf_tensor *target = class_target(fn, yhat, y);
    if (!target)
        return NULL;
    if (!(gamma >= 0) || !isfinite(gamma)) {
        rf_trace_fail(rf_tensor_trace(yhat), RF_E_INVALID,
                      "%s: gamma must be finite and >= 0, got %g", fn, gamma);
        return NULL;
    }
    /* Flux focal_loss: yhat_e = yhat + eps; mean(sum(-y (1 - yhat_e)^gamma
     * log(yhat_e); dims = 1)). */
    rf_tensor *p = rf_add_s(yhat, eps_of(yhat));
    rf_tensor *weight = rf_pow_s(rf_sub(rf_scalar(rf_tensor_trace(yhat), 1.0), p), gamma);
    return rf_neg(mean_of_class_sums(rf_mul(rf_mul(target, weight), rf_log(p))));
}

/* ---- onecold and accuracy ------------------------------------------------------------------- */

rf_tensor *rf_onecold(rf_tensor *scores)
{
    if (!scores || !check_class_axis("rf_onecold", "scores", scores))
        return NULL;
    return rf_argmax(scores, CLASS_AXIS);
}

/* The true class of every row as i64: onecold of a one-hot y, or the ids. */
static rf_tensor *true_classes(const char *fn, rf_tensor *scores, rf_tensor *y)
{
    if (same_shape(scores, y)) {
        /* one-hot of any dtype: argmax needs an ordered numeric type */
        rf_tensor *hot = rf_tensor_dtype(y) == RF_BOOL ? rf_convert(y, RF_U8) : y;
        return rf_argmax(hot, CLASS_AXIS);
    }
    if (is_int(rf_tensor_dtype(y)) && ids_match(scores, y))
        return rf_convert(y, RF_I64);
    rf_trace_fail(rf_tensor_trace(scores), RF_E_SHAPE,
                  "%s: y %s is neither one-hot like scores %s nor integer class ids of "
                  "scores' shape without axis 1", fn, TSTR(y), TSTR(scores));
    return NULL;
}

rf_tensor *rf_accuracy(rf_tensor *scores, rf_tensor *y)
{
    static const char fn[] = "rf_accuracy";
    if (!scores || !y)
        return NULL;
    if (rf_tensor_trace(scores) != rf_tensor_trace(y)) {
        rf_trace_fail(rf_tensor_trace(scores), RF_E_INVALID,
                      "%s: scores %s and y %s belong to different traces", fn, TSTR(scores),
                      TSTR(y));
        return NULL;
    }
    if (!check_class_axis(fn, "scores", scores))
        return NULL;
    rf_tensor *truth = true_classes(fn, scores, y);
    if (!truth)
        return NULL;
    rf_tensor *hit = rf_compare(rf_argmax(scores, CLASS_AXIS), truth, RF_EQ);
    return rf_mean_all(rf_convert(hit, RF_F32));
}
