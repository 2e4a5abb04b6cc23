/* test_losses_ref.c: the losses of reflux/nn.h against independent oracles.
 *
 *   1. PyTorch fixture (tests/ref/gen_losses.py -> losses.txt, Flux's
 *      formulas): every loss value and its gradient w.r.t. yhat, from one
 *      compiled program per loss returning (loss, rf_grad(loss, yhat)), in
 *      f32, relative error <= 1e-5 (gradients: plus an absolute 1e-7 for
 *      entries near zero). Class-id and one-hot targets must agree.
 *   2. f64 central finite differences of every loss w.r.t. yhat.
 *   3. kldivergence's gradient w.r.t. a target with zeros is finite;
 *      onecold / accuracy on a hand example (ties pick the first max).
 *   4. Error messages for mismatched shapes, dtypes and bad parameters.
 *
 * It uses the public API only.
 */
#include <float.h>

/* fixture.h's opening comment names "tests/ref/" "*.py", which -Wcomment flags. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wcomment"
#include "fixture.h"
#pragma GCC diagnostic pop
#include "test_prog.h"

#define DIMS(...) ((const int64_t[]){__VA_ARGS__})

typedef enum loss_kind {
    L_MSE, L_MAE, L_MSLE, L_HUBER, L_CE, L_LOGITCE, L_BCE, L_LOGITBCE, L_KL, L_FOCAL
} loss_kind;

typedef struct loss_case {
    const char *ref;   /* fixture prefix: <ref>_loss, <ref>_grad */
    loss_kind kind;
    double param;      /* huber delta / focal gamma */
    const char *yhat;  /* fixture input names */
    const char *y;
    rf_dtype y_dtype;  /* float targets take yhat's dtype; ids I32/I64 */
} loss_case;

static rf_tensor *apply_loss(const loss_case *c, rf_tensor *yhat, rf_tensor *y)
{
    switch (c->kind) {
    case L_MSE: return rf_mse(yhat, y);
    case L_MAE: return rf_mae(yhat, y);
    case L_MSLE: return rf_msle(yhat, y);
    case L_HUBER: return rf_huber(yhat, y, c->param);
    case L_CE: return rf_crossentropy(yhat, y);
    case L_LOGITCE: return rf_logitcrossentropy(yhat, y);
    case L_BCE: return rf_binarycrossentropy(yhat, y);
    case L_LOGITBCE: return rf_logitbinarycrossentropy(yhat, y);
    case L_KL: return rf_kldivergence(yhat, y);
    case L_FOCAL: return rf_focal(yhat, y, c->param);
    }
    return NULL;
}

/* Program: (loss, d loss / d yhat). */
static void build_loss_and_grad(rf_trace *t, rf_tensor *const *a, int n, void *user)
{
    (void)n;
    const loss_case *c = user;
    rf_tensor *loss = apply_loss(c, a[0], a[1]);
    rf_tensor *g = NULL;
    rf_return(t, loss);
    if (loss)
        rf_grad(t, loss, &a[0], 1, &g);
    rf_return(t, g);
}

static const loss_case CASES[] = {
    {"mse", L_MSE, 0, "reg_yhat", "reg_y", RF_F32},
    {"mae", L_MAE, 0, "reg_yhat", "reg_y", RF_F32},
    {"msle", L_MSLE, 0, "pos_yhat", "pos_y", RF_F32},
    {"huber1", L_HUBER, 1.0, "reg_yhat", "reg_y", RF_F32},
    {"huber05", L_HUBER, 0.5, "reg_yhat", "reg_y", RF_F32},
    {"crossentropy", L_CE, 0, "probs", "onehot", RF_F32},
    {"crossentropy", L_CE, 0, "probs", "ids", RF_I64},
    {"crossentropy", L_CE, 0, "probs", "ids", RF_I32},
    {"crossentropy_soft", L_CE, 0, "probs", "soft", RF_F32},
    {"logitce", L_LOGITCE, 0, "logits", "ids", RF_I64},
    {"logitce", L_LOGITCE, 0, "logits", "onehot", RF_F32},
    {"logitce_soft", L_LOGITCE, 0, "logits", "soft", RF_F32},
    {"logitce_seg", L_LOGITCE, 0, "seg_logits", "seg_ids", RF_I64},
    {"bce", L_BCE, 0, "bprobs", "blabels", RF_F32},
    {"logitbce", L_LOGITBCE, 0, "blogits", "blabels", RF_F32},
    {"kl", L_KL, 0, "probs", "ytarget", RF_F32},
    {"focal2", L_FOCAL, 2.0, "probs", "onehot", RF_F32},
    {"focal2", L_FOCAL, 2.0, "probs", "ids", RF_I64},
    {"focal05", L_FOCAL, 0.5, "probs", "onehot", RF_F32},
};
#define N_CASES ((int)(sizeof CASES / sizeof CASES[0]))

static rf_array *fixture_array(const fx_entry *e, rf_dtype dt)
{
    return tp_dev(dt, e->dims, e->rank, e->v);
}

static const char *label_of(const loss_case *c, char *buf, size_t n)
{
    snprintf(buf, n, "%s(%s, %s %s)", c->ref, c->yhat, c->y, rf_dtype_name(c->y_dtype));
    return buf;
}

/* ---- 1. PyTorch fixture, f32 ---------------------------------------------------------------- */

static void check_fixture_case(const fx_file *fx, const loss_case *c)
{
    char label[160], key[160];
    label_of(c, label, sizeof label);
    const fx_entry *yhat = fx_get(fx, c->yhat), *y = fx_get(fx, c->y);
    snprintf(key, sizeof key, "%s_loss", c->ref);
    const fx_entry *want_loss = fx_get(fx, key);
    snprintf(key, sizeof key, "%s_grad", c->ref);
    const fx_entry *want_grad = fx_get(fx, key);
    CHECK(yhat && y && want_loss && want_grad);
    if (!yhat || !y || !want_loss || !want_grad)
        return;
    rf_array *args[2] = {fixture_array(yhat, RF_F32), fixture_array(y, c->y_dtype)};
    rf_array *out[2] = {0};
    rf_exec *e = NULL;
    CHECK_OK(tp_compile(build_loss_and_grad, (void *)c, args, 2, &e));
    if (e)
        CHECK_OK(rf_exec_run(e, args, 2, out, 2));
    char lab[200];
    snprintf(lab, sizeof lab, "%s loss", label);
    tp_expect(lab, out[0], RF_F32, NULL, 0, want_loss->v, 0, 1e-5);
    snprintf(lab, sizeof lab, "%s grad", label);
    tp_expect(lab, out[1], RF_F32, yhat->dims, yhat->rank, want_grad->v, 1e-7, 1e-5);
    rf_exec_free(e);
    tp_free_all(out, 2);
    tp_free_all(args, 2);
}

/* ---- 2. f64 finite differences ------------------------------------------------------------ */

static double run_scalar(rf_exec *e, rf_array *const *args, rf_array **grad)
{
    rf_array *out[2] = {0};
    double v = NAN;
    if (rf_exec_run(e, args, 2, out, 2) == RF_OK)
        v = tp_scalar(out[0]);
    rf_array_free(out[0]);
    if (grad)
        *grad = out[1];
    else
        rf_array_free(out[1]);
    return v;
}

static void check_fd_case(const fx_file *fx, const loss_case *c)
{
    const double h = 1e-6;
    char label[160];
    label_of(c, label, sizeof label);
    const fx_entry *yhat = fx_get(fx, c->yhat), *y = fx_get(fx, c->y);
    if (!yhat || !y)
        return;
    rf_dtype ydt = c->y_dtype == RF_F32 ? RF_F64 : c->y_dtype;
    rf_array *args[2] = {fixture_array(yhat, RF_F64), fixture_array(y, ydt)};
    rf_exec *e = NULL;
    rf_array *grad = NULL;
    CHECK_OK(tp_compile(build_loss_and_grad, (void *)c, args, 2, &e));
    if (e)
        run_scalar(e, args, &grad);
    int64_t n = 0;
    double *ad = tp_read(grad, &n);
    double *x = malloc(sizeof(double) * (size_t)yhat->n);
    memcpy(x, yhat->v, sizeof(double) * (size_t)yhat->n);
    double worst = 0;
    bool ok = e && ad && n == yhat->n && rf_array_dtype(grad) == RF_F64;
    for (int64_t i = 0; ok && i < n; i++) {
        double fd[2];
        for (int s = 0; s < 2; s++) {
            x[i] = yhat->v[i] + (s ? -h : h);
            rf_array *p = tp_dev(RF_F64, yhat->dims, yhat->rank, x);
            rf_array *pargs[2] = {p, args[1]};
            fd[s] = run_scalar(e, pargs, NULL);
            rf_array_free(p);
        }
        x[i] = yhat->v[i];
        double g = (fd[0] - fd[1]) / (2 * h);
        double err = fabs(g - ad[i]) / (1e-6 + fabs(ad[i]));
        if (isnan(err))
            err = INFINITY; /* a NaN gradient fails */
        worst = err > worst ? err : worst;
    }
    tu_checks++;
    if (!ok || !(worst <= 1e-5)) {
        tu_failures++;
        fprintf(stderr, "%s: f64 finite differences disagree with rf_grad (worst scaled "
                "error %.3g)\n", label, worst);
    }
    free(x);
    free(ad);
    rf_array_free(grad);
    rf_exec_free(e);
    tp_free_all(args, 2);
}

/* The gradient w.r.t. the target y must stay finite where y has zeros
 * (kldivergence's xlogx(0) = 0 must not turn into 0 * -inf). */
static void build_kl_grad_y(rf_trace *t, rf_tensor *const *a, int n, void *user)
{
    (void)n;
    (void)user;
    rf_tensor *g = NULL;
    rf_grad(t, rf_kldivergence(a[0], a[1]), &a[1], 1, &g);
    rf_return(t, rf_reduce(rf_is_finite(g), RF_REDUCE_AND, NULL, 0, false));
}

static void check_kl_target_grad(const fx_file *fx)
{
    const fx_entry *yhat = fx_get(fx, "probs"), *y = fx_get(fx, "ytarget");
    if (!yhat || !y)
        return;
    rf_array *in[2] = {tp_host(RF_F32, yhat->dims, yhat->rank, yhat->v),
                       tp_host(RF_F32, y->dims, y->rank, y->v)};
    rf_array *out = NULL;
    CHECK_OK(tp_run(build_kl_grad_y, NULL, in, 2, &out, 1));
    tp_expect("kldivergence: d/dy finite", out, RF_BOOL, NULL, 0, (const double[]){1}, 0, 0);
    rf_array_free(out);
    tp_free_all(in, 2);
}

/* ---- 3. onecold / accuracy ------------------------------------------------------------------ */

typedef struct acc_ctx {
    int which; /* 0: onecold(scores); 1: accuracy(scores, y) */
} acc_ctx;

static void build_acc(rf_trace *t, rf_tensor *const *a, int n, void *user)
{
    (void)n;
    const acc_ctx *c = user;
    rf_return(t, c->which == 0 ? rf_onecold(a[0]) : rf_accuracy(a[0], a[1]));
}

static void check_onecold_accuracy(void)
{
    /* rows: argmax 2; a tie between 0 and 3 (first max: 0); argmax 1 */
    const double scores[] = {0.1, 0.2, 0.9, 0.3,
                             0.5, 0.1, 0.2, 0.5,
                             -1.0, 3.0, 0.0, 2.0};
    const double ids[] = {2, 3, 1}; /* row 1 is a miss: onecold gives 0 */
    const double hot[] = {0, 0, 1, 0, 0, 0, 0, 1, 0, 1, 0, 0};
    rf_array *h_scores = tp_host(RF_F32, DIMS(3, 4), 2, scores);
    rf_array *out = NULL;

    acc_ctx oc = {0};
    CHECK_OK(tp_run(build_acc, &oc, &h_scores, 1, &out, 1));
    tp_expect("onecold", out, RF_I64, DIMS(3), 1, (const double[]){2, 0, 1}, 0, 0);
    rf_array_free(out);

    acc_ctx ac = {1};
    const rf_dtype id_types[] = {RF_I64, RF_I32};
    for (int k = 0; k < 2; k++) {
        rf_array *in[2] = {h_scores, tp_host(id_types[k], DIMS(3), 1, ids)};
        CHECK_OK(tp_run(build_acc, &ac, in, 2, &out, 1));
        tp_expect("accuracy(ids)", out, RF_F32, NULL, 0, (const double[]){2.0 / 3.0}, 0, 1e-6);
        rf_array_free(out);
        rf_array_free(in[1]);
    }
    rf_array *in[2] = {h_scores, tp_host(RF_F32, DIMS(3, 4), 2, hot)};
    CHECK_OK(tp_run(build_acc, &ac, in, 2, &out, 1));
    tp_expect("accuracy(onehot)", out, RF_F32, NULL, 0, (const double[]){2.0 / 3.0}, 0, 1e-6);
    rf_array_free(out);
    rf_array_free(in[1]);
    rf_array_free(h_scores);
}

/* ---- 4. Errors ------------------------------------------------------------------------------ */

typedef struct err_ctx {
    loss_case c;
    int acc; /* 1: rf_accuracy, 2: rf_onecold instead of the loss */
} err_ctx;

static void build_err(rf_trace *t, rf_tensor *const *a, int n, void *user)
{
    const err_ctx *c = user;
    rf_tensor *r = c->acc == 1   ? rf_accuracy(a[0], a[1])
                   : c->acc == 2 ? rf_onecold(a[0])
                                 : apply_loss(&c->c, a[0], n > 1 ? a[1] : NULL);
    rf_return(t, r);
}

static void expect_error(loss_kind kind, double param, int acc, rf_dtype dt0, const int64_t *d0,
                         int r0, rf_dtype dt1, const int64_t *d1, int r1, rf_status st,
                         const char *msg)
{
    err_ctx c = {{"err", kind, param, NULL, NULL, dt1}, acc};
    rf_array *in[2] = {tp_host(dt0, d0, r0, NULL), tp_host(dt1, d1, r1, NULL)};
    rf_array *out = NULL;
    CHECK_STATUS(tp_run(build_err, &c, in, 2, &out, 1), st);
    CHECK(out == NULL);
    CHECK_MSG(msg);
    rf_array_free(out);
    tp_free_all(in, 2);
}

static void check_errors(void)
{
    expect_error(L_MSE, 0, 0, RF_F32, DIMS(16, 2), 2, RF_F32, DIMS(16, 3), 2, RF_E_SHAPE,
                 "rf_mse: yhat f32[16,2] and y f32[16,3] differ");
    expect_error(L_MAE, 0, 0, RF_F32, DIMS(4), 1, RF_F64, DIMS(4), 1, RF_E_DTYPE,
                 "rf_mae: yhat f32[4] and y f64[4] differ in dtype");
    expect_error(L_HUBER, 0.0, 0, RF_F32, DIMS(4), 1, RF_F32, DIMS(4), 1, RF_E_INVALID,
                 "rf_huber: delta must be positive");
    expect_error(L_MSLE, 0, 0, RF_I32, DIMS(4), 1, RF_I32, DIMS(4), 1, RF_E_DTYPE,
                 "rf_msle: yhat i32[4] must be floating point");
    expect_error(L_CE, 0, 0, RF_F32, DIMS(8, 3), 2, RF_I64, DIMS(16), 1, RF_E_SHAPE,
                 "rf_crossentropy: class ids y i64[16] do not match yhat f32[8,3]");
    expect_error(L_LOGITCE, 0, 0, RF_F32, DIMS(8, 3), 2, RF_F32, DIMS(8, 4), 2, RF_E_SHAPE,
                 "rf_logitcrossentropy: yhat f32[8,3] and y f32[8,4] differ");
    expect_error(L_LOGITCE, 0, 0, RF_F32, DIMS(5), 1, RF_I64, DIMS(5), 1, RF_E_SHAPE,
                 "rf_logitcrossentropy: yhat f32[5] needs a class axis");
    expect_error(L_BCE, 0, 0, RF_F32, DIMS(2, 3), 2, RF_F32, DIMS(3, 2), 2, RF_E_SHAPE,
                 "rf_binarycrossentropy: yhat f32[2,3] and y f32[3,2] differ");
    expect_error(L_LOGITBCE, 0, 0, RF_F32, DIMS(2, 3), 2, RF_F32, DIMS(2), 1, RF_E_SHAPE,
                 "rf_logitbinarycrossentropy: yhat f32[2,3] and y f32[2] differ");
    expect_error(L_KL, 0, 0, RF_F32, DIMS(2, 3), 2, RF_I64, DIMS(2), 1, RF_E_DTYPE,
                 "rf_kldivergence: yhat f32[2,3] and y i64[2] differ in dtype");
    expect_error(L_FOCAL, -1.0, 0, RF_F32, DIMS(2, 3), 2, RF_F32, DIMS(2, 3), 2, RF_E_INVALID,
                 "rf_focal: gamma must be finite and >= 0, got -1");
    expect_error(L_MSE, 0, 1, RF_F32, DIMS(4, 3), 2, RF_I64, DIMS(3), 1, RF_E_SHAPE,
                 "rf_accuracy: y i64[3] is neither one-hot like scores f32[4,3]");
    expect_error(L_MSE, 0, 2, RF_F32, DIMS(4), 1, RF_F32, DIMS(4), 1, RF_E_SHAPE,
                 "rf_onecold: scores f32[4] needs a class axis");
}

/* Class ids outside [0, C) make a class loss NaN (PyTorch raises for them);
 * their one-hot rows were zero, which silently gave loss 0 for them. */
static void check_bad_class_ids(void)
{
    const double probs[] = {0.1, 0.2, 0.3, 0.4, 0.25, 0.25, 0.25, 0.25, 0.7, 0.1, 0.1, 0.1};
    const double good[] = {3, 0, 0}, bad[3][3] = {{3, 4, 0}, {-1, 0, 0}, {3, 0, 200}};
    const loss_kind kinds[] = {L_CE, L_LOGITCE, L_FOCAL};
    const rf_dtype id_types[] = {RF_I32, RF_I64, RF_U8};
    for (int k = 0; k < 3; k++)
        for (int d = 0; d < 3; d++)
            for (int b = 0; b < 4; b++) {
                if (b == 1 && id_types[d] == RF_U8)
                    continue; /* no -1 in u8 */
                err_ctx c = {{"ids", kinds[k], 2.0, NULL, NULL, id_types[d]}, 0};
                rf_array *in[2] = {tp_host(RF_F32, DIMS(3, 4), 2, probs),
                                   tp_host(id_types[d], DIMS(3), 1, b < 3 ? bad[b] : good)};
                rf_array *out = NULL;
                CHECK_OK(tp_run(build_err, &c, in, 2, &out, 1));
                int64_t n = 0;
                double *v = tp_read(out, &n);
                CHECK(v && n == 1 && (b < 3 ? isnan(v[0]) : isfinite(v[0])));
                free(v);
                rf_array_free(out);
                tp_free_all(in, 2);
            }
    /* u8 ids of more than 256 classes: the range check compares in i32 (it
     * once compared with a u8 scalar of 300, which the dtype cannot hold) */
    double wide[3 * 300], wide_ids[3] = {299, 0, 255};
    for (int i = 0; i < 3 * 300; i++)
        wide[i] = 1.0 / 300;
    err_ctx c = {{"ids", L_CE, 0, NULL, NULL, RF_U8}, 0};
    rf_array *in[2] = {tp_host(RF_F32, DIMS(3, 300), 2, wide),
                       tp_host(RF_U8, DIMS(3), 1, wide_ids)};
    rf_array *out = NULL;
    CHECK_OK(tp_run(build_err, &c, in, 2, &out, 1));
    tp_expect("crossentropy of 300 classes, u8 ids", out, RF_F32, NULL, 0,
              (const double[]){log(300.0)}, 0, 1e-5);
    rf_array_free(out);
    tp_free_all(in, 2);
}

int main(void)
{
    fx_file fx;
    if (fx_load(&fx, "losses.txt") != 0)
        return 1;
    for (int i = 0; i < N_CASES; i++)
        check_fixture_case(&fx, &CASES[i]);
    for (int i = 0; i < N_CASES; i++)
        check_fd_case(&fx, &CASES[i]);
    check_kl_target_grad(&fx);
    check_onecold_accuracy();
    check_errors();
    check_bad_class_ids();
    fx_free(&fx);
    return tu_finish("test_losses_ref");
}
