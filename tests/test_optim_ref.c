/* test_optim_ref.c: every optimiser rule against tests/ref/optim.txt (PyTorch
 * and explicit Optimisers.jl formulas in float64, see gen_optim.py), plus the
 * properties of the flat "foreach" update: rf_adjust without recompiling,
 * step counting, chain order, per-array ClipNorm, one copy of the rule's math
 * for many parameters, parameters of two dtypes, state paths, and errors.
 *
 * The update program takes the gradients as arguments, so the test controls
 * them exactly: the trace reads rf_arg tensors and calls rfi_opt_emit_update.
 */
#include "optim/optim.h"

#include "fixture.h"
#include "test_util.h"

#define NP 4
static const char *const pnames[NP] = {"a", "b", "c", "d"};
static fx_file fx;

static rf_tensor *identity_forward(rf_model *m, rf_tensor *x)
{
    (void)m;
    return x;
}
static const rf_layer_type root_type = {"optroot", identity_forward, NULL};
static const rf_layer_type leaf_type = {"optleaf", identity_forward, NULL};

/* The fixture's four parameters in a two-level model on the CPU: root holds
 * a and b, its child c and d. */
typedef struct fmodel {
    rf_model *m;
    rf_array *p[NP];     /* by fixture index (borrowed from the model) */
    int fidx[NP];        /* fixture index of the i-th parameter in visit order */
    rf_array *g[3][NP];  /* gradients, in visit order */
} fmodel;

static rf_array *host_from_fixture(const char *name, rf_dtype dt)
{
    const fx_entry *e = fx_get(&fx, name);
    if (!e)
        return NULL;
    if (dt == RF_F64)
        return rf_array_from(RF_F64, e->dims, e->rank, e->v);
    float *f = fx_f32(e);
    rf_array *a = rf_array_from(RF_F32, e->dims, e->rank, f);
    free(f);
    return a;
}

/* Writes fixture values into an array of either float dtype. */
static void write_values(rf_array *a, const fx_entry *e)
{
    if (rf_array_dtype(a) == RF_F64) {
        CHECK_OK(rf_array_write(a, e->v, (size_t)e->n * sizeof(double)));
    } else {
        float *f = fx_f32(e);
        CHECK_OK(rf_array_write(a, f, (size_t)e->n * sizeof(float)));
        free(f);
    }
}

/* c and d are f64 when mixed (kept so on the device): two dtype groups. */
static int fmodel_make(fmodel *fm, bool mixed)
{
    memset(fm, 0, sizeof *fm);
    rf_model *root = rf_model_new(&root_type, NULL, 0);
    rf_model *child = rf_model_new(&leaf_type, NULL, 0);
    char name[64];
    for (int i = 0; i < NP; i++) {
        snprintf(name, sizeof name, "optim.%s", pnames[i]);
        rf_dtype dt = mixed && i >= 2 ? RF_F64 : RF_F32;
        CHECK_OK(rf_model_add_param(i < 2 ? root : child, pnames[i], host_from_fixture(name, dt)));
    }
    CHECK_OK(rf_model_add_child(root, child));
    rf_to_opts o = {.keep_f64 = true};
    fm->m = rf_model_to_opts(root, rf_device_cpu(), &o);
    rf_model_free(root);
    if (!fm->m)
        return -1;
    for (int i = 0; i < NP; i++)
        fm->p[i] = rf_model_param_array(i < 2 ? fm->m : rf_model_child(fm->m, 0), i % 2);
    rf_array **ps = NULL;
    int n = rfi_model_collect_params(fm->m, &ps);
    CHECK(n == NP);
    for (int i = 0; i < n && i < NP; i++)
        for (int j = 0; j < NP; j++)
            if (ps[i] == fm->p[j])
                fm->fidx[i] = j;
    rfi_free(ps);
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < NP; i++) {
            rf_array *p = fm->p[fm->fidx[i]];
            snprintf(name, sizeof name, "g%d.%s", k, pnames[fm->fidx[i]]);
            fm->g[k][i] = rf_array_new(rf_device_cpu(), rf_array_dtype(p), rf_array_dims(p),
                                       rf_array_rank(p), NULL);
            write_values(fm->g[k][i], fx_get(&fx, name));
        }
    return 0;
}

static void fmodel_reset(fmodel *fm)
{
    char name[64];
    for (int j = 0; j < NP; j++) {
        snprintf(name, sizeof name, "optim.%s", pnames[j]);
        write_values(fm->p[j], fx_get(&fx, name));
    }
}

static void fmodel_free(fmodel *fm)
{
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < NP; i++)
            rf_array_free(fm->g[k][i]);
    rf_model_free(fm->m);
}

/* ---- The update program ---------------------------------------------------------------------- */

typedef struct upd_ctx {
    rf_opt *opt;
    rf_model *m;
} upd_ctx;

static void update_fn(rf_trace *t, void *ctx)
{
    upd_ctx *c = ctx;
    int n = rf_n_args(t);
    rf_tensor *g[16];
    for (int i = 0; i < n && i < 16; i++)
        g[i] = rf_arg(t, i);
    rfi_opt_emit_update(t, c->opt, c->m, g, n);
}

static rf_status compile_update(rf_opt *opt, rf_model *m, rf_array *const *grads, int n,
                                rf_exec **e)
{
    upd_ctx c = {opt, m};
    return rf_compile(update_fn, &c, grads, n, e);
}

/* Reads a parameter as doubles. */
static void read_param(rf_array *a, double *out)
{
    int64_t n = rf_array_numel(a);
    if (rf_array_dtype(a) == RF_F64) {
        CHECK_OK(rf_array_read(a, out, (size_t)n * sizeof(double)));
        return;
    }
    float f[64];
    CHECK(n <= 64);
    CHECK_OK(rf_array_read(a, f, (size_t)n * sizeof(float)));
    for (int64_t i = 0; i < n; i++)
        out[i] = f[i];
}

#define RTOL 1e-5
#define ATOL 1e-6
static double worst_rel; /* over all cases, for the summary */

/* Compares every parameter with <case>.s<step>.<p>; returns the number of mismatches. */
static int compare_step(fmodel *fm, const char *cname, int step)
{
    int bad = 0;
    char name[96];
    for (int j = 0; j < NP; j++) {
        snprintf(name, sizeof name, "%s.s%d.%s", cname, step, pnames[j]);
        const fx_entry *e = fx_get(&fx, name);
        if (!e) {
            bad++;
            continue;
        }
        double got[64];
        read_param(fm->p[j], got);
        for (int64_t i = 0; i < e->n; i++) {
            double err = fabs(got[i] - e->v[i]);
            double rel = err / (fabs(e->v[i]) + 1e-30);
            if (err > ATOL && rel > worst_rel)
                worst_rel = rel;
            if (!(err <= ATOL + RTOL * fabs(e->v[i]))) {
                if (bad < 4)
                    fprintf(stderr, "%s[%lld] = %.9g, expected %.9g\n", name, (long long)i,
                            got[i], e->v[i]);
                bad++;
            }
        }
    }
    tu_checks++;
    if (bad)
        tu_failures++;
    return bad;
}

/* Runs `steps` steps of `rule` from the fixture's parameters; at step
 * adjust_at (1-based, 0 never) the learning rate becomes adjust_lr first. */
static void run_case(fmodel *fm, const char *cname, rf_rule *rule, int steps, int adjust_at,
                     double adjust_lr)
{
    fmodel_reset(fm);
    rf_opt *opt = rf_setup(rule, fm->m);
    CHECK(opt != NULL);
    if (!opt) {
        fprintf(stderr, "%s: rf_setup: %s\n", cname, rf_errmsg());
        return;
    }
    rf_exec *e = NULL;
    CHECK_OK(compile_update(opt, fm->m, fm->g[0], NP, &e));
    if (!e) {
        rf_opt_free(opt);
        return;
    }
    uint64_t hash = rf_exec_hash(e);
    int bad = 0;
    for (int k = 1; k <= steps; k++) {
        if (k == adjust_at)
            CHECK_OK(rf_adjust(opt, adjust_lr));
        CHECK_OK(rf_exec_run(e, fm->g[(k - 1) % 3], NP, NULL, 0));
        bad += compare_step(fm, cname, k);
    }
    CHECK(rf_opt_steps(opt) == steps);
    CHECK(rf_exec_hash(e) == hash);
    if (bad)
        fprintf(stderr, "case %s: %d mismatches\n", cname, bad);
    rf_exec_free(e);
    rf_opt_free(opt);
}

static void test_rules(fmodel *fm)
{
    run_case(fm, "descent", rf_descent(0.1), 3, 0, 0);
    run_case(fm, "momentum", rf_momentum(0.05, 0.9), 3, 0, 0);
    run_case(fm, "nesterov", rf_nesterov(0.05, 0.8), 3, 0, 0);
    run_case(fm, "rmsprop", rf_rmsprop(0.01, 0.9, 1e-8, false), 3, 0, 0);
    run_case(fm, "rmsprop_centred", rf_rmsprop(0.01, 0.9, 1e-8, true), 3, 0, 0);
    run_case(fm, "adam", rf_adam(0.1), 3, 0, 0);
    run_case(fm, "adam_b", rf_adam_ex(0.05, 0.8, 0.95, 1e-2), 3, 0, 0);
    run_case(fm, "adamw", rf_adamw(0.1, 0.9, 0.999, 0.1, 1e-8), 3, 0, 0);
    run_case(fm, "radam", rf_radam(0.1, 0.9, 0.999, 1e-8), 3, 0, 0);
    run_case(fm, "radam_b", rf_radam(0.1, 0.8, 0.9, 1e-8), 6, 0, 0);
    run_case(fm, "adamax", rf_adamax(0.1, 0.9, 0.999, 1e-8), 3, 0, 0);
    run_case(fm, "oadam", rf_oadam(0.1, 0.5, 0.9, 1e-8), 3, 0, 0);
    run_case(fm, "adagrad", rf_adagrad(0.1, 1e-8), 3, 0, 0);
    run_case(fm, "adadelta", rf_adadelta(0.9, 1e-2), 3, 0, 0);
    run_case(fm, "amsgrad", rf_amsgrad(0.1, 0.9, 0.999, 1e-8), 3, 0, 0);
    run_case(fm, "nadam", rf_nadam(0.1, 0.9, 0.999, 1e-8), 3, 0, 0);
    run_case(fm, "adabelief", rf_adabelief(0.1, 0.9, 0.999, 1e-16), 3, 0, 0);
    run_case(fm, "lion", rf_lion(0.1, 0.9, 0.99), 3, 0, 0);
    run_case(fm, "wd_descent", rf_chain_rules(rf_weightdecay(0.1), rf_descent(0.1)), 3, 0,
             0);
    run_case(fm, "wd_adam", rf_chain_rules(rf_weightdecay(0.1), rf_adam(0.1)), 3, 0, 0);
    run_case(fm, "signdecay_descent",
             rf_chain_rules(rf_signdecay(0.05), rf_descent(0.1)), 3, 0, 0);
    /* chain order matters: the fixture's two orders differ (gen_optim.py checks) */
    run_case(fm, "clipgrad_descent", rf_chain_rules(rf_clipgrad(0.5), rf_descent(0.1)), 3,
             0, 0);
    run_case(fm, "descent_clipgrad", rf_chain_rules(rf_descent(0.1), rf_clipgrad(0.03)), 3,
             0, 0);
    /* per-array norms: some arrays are clipped, others not */
    run_case(fm, "clipnorm2", rf_chain_rules(rf_clipnorm(1.0, 2), rf_descent(0.1)), 3, 0, 0);
    run_case(fm, "clipnorm1", rf_chain_rules(rf_clipnorm(2.0, 1), rf_descent(0.1)), 3, 0, 0);
    run_case(fm, "clipnormglobal2",
             rf_chain_rules(rf_clipnorm_global(1.0, 2), rf_descent(0.1)), 3, 0, 0);
    run_case(fm, "clipnormglobal1",
             rf_chain_rules(rf_clipnorm_global(2.0, 1), rf_descent(0.1)), 3, 0, 0);
    run_case(fm, "clipnormglobalinf",
             rf_chain_rules(rf_clipnorm_global(0.5, INFINITY), rf_descent(0.1)), 3, 0, 0);
    run_case(fm, "clipnorminf", rf_chain_rules(rf_clipnorm(0.5, INFINITY), rf_descent(0.1)),
             3, 0, 0);
    run_case(fm, "accum_wd_descent",
             rf_chain_rules(rf_accumgrad(2), rf_weightdecay(0.01), rf_descent(0.1)), 3, 0, 0);
    run_case(fm, "accum_adam", rf_chain_rules(rf_accumgrad(2), rf_adam(0.1)), 4, 0, 0);
    /* rf_adjust before step 2: the same executable, no recompile */
    run_case(fm, "adam_adjust", rf_adam(0.1), 3, 2, 0.02);
}

/* ---- Properties ------------------------------------------------------------------------------ */

static void test_adjust_and_lr(fmodel *fm)
{
    rf_opt *opt = rf_setup(rf_chain_rules(rf_clipgrad(1.0), rf_adam(0.1), rf_descent(0.5)),
                           fm->m);
    CHECK(opt != NULL);
    if (!opt)
        return;
    CHECK_NEAR(rf_opt_lr(opt), 0.1, 1e-7, 0);
    CHECK_OK(rf_adjust(opt, 0.25));
    CHECK_NEAR(rf_opt_lr(opt), 0.25, 0, 0); /* exact in f32 */
    CHECK(rf_opt_rule(opt)->children[2]->hp[0] == 0.25); /* every rule with an lr */
    CHECK_STATUS(rf_adjust(opt, -1.0), RF_E_INVALID);
    CHECK_STATUS(rf_adjust(opt, NAN), RF_E_INVALID);
    CHECK(rf_opt_steps(opt) == 0);
    rf_opt_free(opt);

    opt = rf_setup(rf_adadelta(0.9, 1e-8), fm->m);
    CHECK_STATUS(rf_adjust(opt, 0.1), RF_E_INVALID); /* no learning rate to set */
    CHECK_MSG("learning rate");
    CHECK(isnan(rf_opt_lr(opt)));
    rf_opt_free(opt);
}

/* The rule's math appears once however many parameters: the foreach form. */
static int count(const char *text, const char *needle)
{
    int n = 0;
    for (const char *p = strstr(text, needle); p; p = strstr(p + 1, needle))
        n++;
    return n;
}

static void test_foreach_program(void)
{
    rf_model *host = rf_model_new(&root_type, NULL, 0);
    for (int i = 0; i < 10; i++) {
        char name[16];
        snprintf(name, sizeof name, "p%d", i);
        CHECK_OK(rf_model_add_param(host, name, rf_zeros(RF_F32, RF_SHAPE(i + 1, 3))));
    }
    rf_model *m = rf_model_to(host, rf_device_cpu());
    rf_model_free(host);
    rf_array *g[10];
    for (int i = 0; i < 10; i++)
        g[i] = rf_array_new(rf_device_cpu(), RF_F32, RF_SHAPE(i + 1, 3), NULL);

    rf_opt *opt = rf_setup(rf_adam(1e-3), m);
    rf_exec *e = NULL;
    CHECK_OK(compile_update(opt, m, g, 10, &e));
    if (e) {
        const char *text = rf_exec_program_text(e);
        CHECK(count(text, " = sqrt(") == 1);
        CHECK(count(text, " = concatenate(") == 2); /* params and grads, once each */
        /* 10 parameters, m and v, beta1^t and beta2^t, the step counter */
        CHECK(rf_exec_n_updates(e) == 15);
        if (count(text, " = sqrt(") != 1)
            fprintf(stderr, "%s\n", text);
        rf_exec_free(e);
    }
    rf_opt_free(opt);

    /* ClipNorm adds one sqrt for all ten per-array norms */
    opt = rf_setup(rf_chain_rules(rf_clipnorm(1.0, 2), rf_adam(1e-3)), m);
    e = NULL;
    CHECK_OK(compile_update(opt, m, g, 10, &e));
    if (e) {
        CHECK(count(rf_exec_program_text(e), " = sqrt(") == 2);
        rf_exec_free(e);
    }
    rf_opt_free(opt);

    /* the global norm sums each parameter's gradient (ten sums added up, one
     * sqrt), not the concatenated vector, whose every point a sum would read
     * through all ten pieces */
    opt = rf_setup(rf_chain_rules(rf_clipnorm_global(1.0, 2), rf_adam(1e-3)), m);
    e = NULL;
    CHECK_OK(compile_update(opt, m, g, 10, &e));
    if (e) {
        const char *text = rf_exec_program_text(e);
        CHECK(count(text, " = sqrt(") == 2);
        CHECK(count(text, " = reduce(") == 10);
        rf_exec_free(e);
    }
    rf_opt_free(opt);
    for (int i = 0; i < 10; i++)
        rf_array_free(g[i]);
    rf_model_free(m);
}

/* Centred RMSProp divides by sqrt(quad - lin^2), which is >= 0 exactly (lin^2 <=
 * quad by Cauchy-Schwarz on the moving averages' weights) but a cancellation:
 * with rho = 0 its first step is fl(g^2) - fl(g)^2, zero when each product is
 * rounded, and fl(g^2) - g^2 when a fused multiply-add keeps the second exact,
 * as the compiled backend's flags allow. Gradients picked so that fl(g^2) < g^2
 * make that negative; the clamp at zero keeps the square root real, so the
 * step is dx eta / eps on both backends (a NaN on the compiled one without it). */
static void test_centred_rmsprop_cancellation(void)
{
    enum { N = 48 };
    float gv[N], pv[N];
    int n = 0;
    for (int i = 0; n < N && i < 100000; i++) {
        float g = 0.1f + 0.0007f * (float)i;
        if ((double)(g * g) < (double)g * (double)g) /* fl(g^2) < g^2 */
            gv[n] = g, pv[n] = 1.0f, n++;
    }
    CHECK(n == N);
    rf_model *host = rf_model_new(&leaf_type, NULL, 0);
    CHECK_OK(rf_model_add_param(host, "w", rf_array_from(RF_F32, RF_SHAPE(N), pv)));
    rf_model *m = rf_model_to(host, rf_device_cpu());
    rf_model_free(host);
    rf_opt *opt = rf_setup(rf_rmsprop(1e-10, 0.0, 1e-8, true), m);
    rf_array *g = rf_array_new(rf_device_cpu(), RF_F32, RF_SHAPE(N), NULL);
    CHECK(m && opt && g);
    if (!m || !opt || !g)
        return;
    CHECK_OK(rf_array_write(g, gv, sizeof gv));
    rf_exec *e = NULL;
    CHECK_OK(compile_update(opt, m, &g, 1, &e));
    CHECK_OK(rf_exec_run(e, &g, 1, NULL, 0));
    float after[N];
    CHECK_OK(rf_array_read(rf_model_param_array(m, 0), after, sizeof after));
    int bad = 0;
    for (int i = 0; i < N; i++) {
        double want = 1.0 - 1e-10 * (double)gv[i] / 1e-8; /* sqrt(0) + eps */
        bad += !(fabs(after[i] - want) <= 1e-6);
    }
    if (bad)
        fprintf(stderr, "centred rmsprop, rho 0: %d of %d parameters off (first %g)\n", bad, N,
                (double)after[0]);
    CHECK(bad == 0);
    rf_exec_free(e);
    rf_array_free(g);
    rf_opt_free(opt);
    rf_model_free(m);
}

/* f64 parameters see their hyperparameters at f64 precision, as
 * Optimisers.jl's T(o.eta) does and as their state starts (beta^t from the
 * exact beta): one Adam(0.1) step of w = 1 with g = 0.5 (bias-corrected
 * moments 0.5 and 0.25) is 1 - 0.1 * 0.5 / (0.5 + 1e-8) within an ulp or
 * two, and rf_adjust writes
 * an f64 rate (f32-rounded hyperparameters miss by 7e-6 relative). */
static void test_f64_hyperparameters(void)
{
    double w0 = 1.0, g0 = 0.5;
    rf_model *host = rf_model_new(&leaf_type, NULL, 0);
    CHECK_OK(rf_model_add_param(host, "w", rf_array_from(RF_F64, RF_SHAPE(1), &w0)));
    rf_to_opts to = {.keep_f64 = true};
    rf_model *m = rf_model_to_opts(host, rf_device_cpu(), &to);
    rf_model_free(host);
    rf_opt *opt = m ? rf_setup(rf_adam(0.1), m) : NULL;
    rf_array *g = rf_array_new(rf_device_cpu(), RF_F64, RF_SHAPE(1), NULL);
    CHECK(m && opt && g);
    if (!m || !opt || !g)
        return;
    CHECK_OK(rf_array_write(g, &g0, sizeof g0));
    rf_exec *e = NULL;
    CHECK_OK(compile_update(opt, m, &g, 1, &e));
    CHECK_OK(rf_exec_run(e, &g, 1, NULL, 0));
    double w1 = 0, want = 1.0 - 0.1 * 0.5 / (0.5 + 1e-8);
    CHECK_OK(rf_array_read(rf_model_param_array(m, 0), &w1, sizeof w1));
    CHECK(fabs(w1 - want) <= 4e-16);
    if (!(fabs(w1 - want) <= 4e-16))
        fprintf(stderr, "f64 adam: %.17g, want %.17g\n", w1, want);
    CHECK_OK(rf_adjust(opt, 0.3));
    CHECK(rf_opt_lr(opt) == 0.3); /* exactly: the scalar is f64 */
    rf_exec_free(e);
    rf_array_free(g);
    rf_opt_free(opt);
    rf_model_free(m);
}

/* Two dtype groups (f32 a, b; f64 c, d) run the same rules. */
static void test_mixed_dtypes(void)
{
    fmodel fm;
    if (fmodel_make(&fm, true) != 0) {
        CHECK(0);
        return;
    }
    CHECK(rf_array_dtype(fm.p[2]) == RF_F64);
    run_case(&fm, "adam", rf_adam(0.1), 3, 0, 0);
    run_case(&fm, "clipnorm2", rf_chain_rules(rf_clipnorm(1.0, 2), rf_descent(0.1)), 3, 0, 0);
    run_case(&fm, "accum_adam", rf_chain_rules(rf_accumgrad(2), rf_adam(0.1)), 4, 0, 0);
    fmodel_free(&fm);
}

typedef struct paths {
    char text[2048];
    int n;
} paths;

static void collect_path(const char *path, rf_array *a, bool trainable, void *ud)
{
    paths *p = ud;
    CHECK(a != NULL && !trainable);
    size_t len = strlen(p->text);
    snprintf(p->text + len, sizeof p->text - len, "%s ", path);
    p->n++;
}

static void test_visit(void)
{
    fmodel fm;
    if (fmodel_make(&fm, true) != 0) {
        CHECK(0);
        return;
    }
    rf_opt *opt = rf_setup(rf_chain_rules(rf_clipgrad(1.0), rf_adam(0.1)), fm.m);
    paths p = {{0}, 0};
    rf_opt_visit(opt, collect_path, &p);
    CHECK(strstr(p.text, "0.clipgrad.delta ") != NULL);
    CHECK(strstr(p.text, "1.adam.eta ") != NULL);
    CHECK(strstr(p.text, "1.adam.m.f32 ") != NULL);
    CHECK(strstr(p.text, "1.adam.v.f64 ") != NULL);
    CHECK(strstr(p.text, "1.adam.beta2t.f32 ") != NULL);
    CHECK(strstr(p.text, " t ") != NULL);
    /* 1 + 4 hyperparameters, 4 roles x 2 dtypes, t */
    CHECK(p.n == 14);
    if (p.n != 14)
        fprintf(stderr, "paths: %s\n", p.text);
    /* flat state: one element per parameter element of the dtype */
    rf_rule *leaves[2];
    CHECK(rfi_rule_leaves(opt->rule, leaves, 2) == 2);
    CHECK(rf_array_numel(opt->groups[0].state[1 * RFI_OPT_MAX_ROLES + 0]) == 12 + 4);
    CHECK(rf_to_number(opt->groups[1].state[1 * RFI_OPT_MAX_ROLES + 2]) == 0.9); /* beta1t */
    rf_opt_free(opt);
    fmodel_free(&fm);
}

static void test_errors(fmodel *fm)
{
    /* a model on the host */
    rf_model *host = rf_model_new(&root_type, NULL, 0);
    CHECK_OK(rf_model_add_param(host, "w", rf_zeros(RF_F32, RF_SHAPE(2, 2))));
    rf_clear_error();
    CHECK(rf_setup(rf_adam(0.1), host) == NULL); /* the rule is freed (no leak) */
    CHECK_MSG("host");
    CHECK_MSG("rf_model_to");
    rf_model_free(host);
    CHECK(rf_setup(NULL, fm->m) == NULL);
    CHECK(rf_accumgrad(0) == NULL);
    /* a failed rule inside a chain: an error keeping its message; the others are freed */
    rf_clear_error();
    CHECK(rf_chain_rules(rf_clipgrad(1.0), rf_accumgrad(0), rf_descent(0.1)) == NULL);
    CHECK_MSG("rf_chain_rules: rule 1 is NULL (a rule constructor failed; the last error "
              "before this call: rf_accumgrad");
    /* a rule belongs to one place: refused (and left to its owner) anywhere else */
    rf_rule *a = rf_adam(0.1);
    CHECK(rf_chain_rules(a, a) == NULL); /* a is freed once (ASan would see a second) */
    CHECK_MSG("rf_chain_rules: rule 1 (adam) is rule 0 again");
    rf_rule *d = rf_descent(0.1), *chain = rf_chain_rules(d, rf_momentum(0.01, 0.9));
    CHECK(chain != NULL);
    CHECK(rf_chain_rules(rf_clipgrad(1.0), d) == NULL); /* the clipgrad is freed */
    CHECK_MSG("rf_chain_rules: rule 1 (descent) already belongs to a chain or an optimiser");
    CHECK(rf_setup(d, fm->m) == NULL);
    CHECK_MSG("rf_setup: the rule (descent) already belongs to a chain or an optimiser");
    rf_rule_free(d);
    CHECK_MSG("rf_rule_free: the rule (descent) belongs to a chain or an optimiser");
    rf_rule *shared = rf_adam(0.1);
    rf_opt *first = rf_setup(shared, fm->m);
    CHECK(first != NULL);
    CHECK(rf_setup(shared, fm->m) == NULL);
    CHECK_MSG("rf_setup: the rule (adam) already belongs to a chain or an optimiser");
    rf_opt_free(first);  /* frees shared */
    rf_rule_free(chain); /* frees d and the momentum */
    CHECK(rf_chain_rules_n(NULL, 1) == NULL);
    rf_rule *empty = rf_chain_rules_n(NULL, 0);
    CHECK(empty && !strcmp(rf_rule_name(empty), "chain"));
    rf_rule_free(empty);
    CHECK(rf_adam(NAN) == NULL);
    CHECK(rf_descent(-1) == NULL);
    /* finite but beyond f32 (it would become infinite for f32 parameters) */
    rf_clear_error();
    CHECK(rf_descent(1e39) == NULL);
    CHECK_MSG("rf_descent: eta 1e+39 is beyond the f32 range");
    CHECK(rf_adam_ex(1e-3, 0.9, 0.999, -1e39) == NULL);
    /* a bias-corrected beta of 1 divides by zero; Lion, AMSGrad and Momentum take it */
    rf_clear_error();
    CHECK(rf_adam_ex(1e-3, 1.0, 0.999, 1e-8) == NULL);
    CHECK_MSG("rf_adam: beta1 must be below 1");
    CHECK(rf_nadam(1e-3, 0.9, 1.5, 1e-8) == NULL);
    CHECK(rf_radam(1e-3, 0.9, 1.0, 1e-8) == NULL);
    CHECK(rf_adamw(1e-3, 1.0, 0.999, 0.0, 1e-8) == NULL);
    rf_rule *take[3] = {rf_lion(1e-3, 1.0, 1.0), rf_amsgrad(1e-3, 1.0, 1.0, 1e-8),
                        rf_adamax(1e-3, 0.9, 1.0, 1e-8)}; /* AdaMax corrects beta1 only */
    for (int i = 0; i < 3; i++) {
        CHECK(take[i] != NULL);
        rf_rule_free(take[i]);
    }
    CHECK(rfi_rule_hash(rf_opt_rule(NULL)) == rfi_rule_hash(NULL));

    rf_opt *opt = rf_setup(rf_adam(0.1), fm->m);
    rf_clear_error();
    CHECK_STATUS(rf_adjust(opt, 1e39), RF_E_INVALID);
    CHECK_MSG("within the f32 range, got 1e+39");
    CHECK(fabs(rf_opt_lr(opt) - 0.1) < 1e-8);
    rf_exec *e = NULL;
    /* too few gradients */
    CHECK_STATUS(compile_update(opt, fm->m, fm->g[0], 3, &e), RF_E_INVALID);
    CHECK_MSG("3 gradients for 4");
    /* a gradient of the wrong shape */
    rf_array *gs[NP] = {fm->g[0][1], fm->g[0][1], fm->g[0][2], fm->g[0][3]};
    CHECK_STATUS(compile_update(opt, fm->m, gs, NP, &e), RF_E_SHAPE);
    CHECK_MSG("gradient 0");
    /* another model */
    rf_model *other = rf_model_new(&root_type, NULL, 0);
    CHECK_STATUS(compile_update(opt, other, fm->g[0], NP, &e), RF_E_INVALID);
    CHECK_MSG("another model");
    rf_model_free(other);
    CHECK(e == NULL);
    CHECK(rf_opt_steps(opt) == 0);
    rf_opt_free(opt);
    rf_opt_free(NULL);

    /* structural hash: kinds and flags, not values */
    rf_rule *r1 = rf_adam(0.1), *r2 = rf_adam(0.5), *r3 = rf_nadam(0.1, 0.9, 0.999, 1e-8);
    rf_rule *c1 = rf_chain_rules(rf_clipnorm(1, 2), rf_descent(0.1));
    rf_rule *c2 = rf_chain_rules(rf_clipnorm(5, 1), rf_descent(0.1));
    CHECK(rfi_rule_hash(r1) == rfi_rule_hash(r2));
    CHECK(rfi_rule_hash(r1) != rfi_rule_hash(r3));
    CHECK(rfi_rule_hash(c1) != rfi_rule_hash(c2)); /* p is structural */
    CHECK(!strcmp(rf_rule_name(r3), "nadam") && !strcmp(rf_rule_name(c1), "chain"));
    rf_rule_free(r1);
    rf_rule_free(r2);
    rf_rule_free(r3);
    rf_rule_free(c1);
    rf_rule_free(c2);
}

/* Either side may be freed first. */
static void test_lifetimes(void)
{
    fmodel fm;
    if (fmodel_make(&fm, false) != 0) {
        CHECK(0);
        return;
    }
    rf_opt *o1 = rf_setup(rf_adam(0.1), fm.m);
    rf_opt *o2 = rf_setup(rf_descent(0.1), fm.m);
    rf_opt_free(o1);
    rf_model_free(fm.m); /* o2 forgets its model */
    fm.m = NULL;
    CHECK(o2->model == NULL);
    rf_model *stand_in = rf_model_new(&root_type, NULL, 0);
    rf_exec *e = NULL;
    CHECK_STATUS(compile_update(o2, stand_in, fm.g[0], NP, &e), RF_E_INVALID);
    CHECK_MSG("freed");
    rf_model_free(stand_in);
    rf_opt_free(o2);
    fmodel_free(&fm);
}

/* The public rf_update with rf_withgradient's gradients: loss = sum(p^2)/2 over
 * every parameter, so the gradient is p and Descent(0.1) scales p by 0.9. */
static rf_tensor *half_sq_loss(rf_model *m, rf_tensor *const *batch, int n, rf_aux *aux,
                               void *ctx)
{
    (void)n, (void)aux, (void)ctx;
    rf_trace *t = rf_tensor_trace(batch[0]);
    rf_tensor *sum = rf_mul_s(rf_sum_all(batch[0]), 0.0);
    rf_model *ms[2] = {m, rf_model_child(m, 0)};
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < rf_model_n_params(ms[k]); i++) {
            rf_tensor *p = rf_model_param(ms[k], t, i);
            sum = rf_add(sum, rf_mul_s(rf_sum_all(rf_mul(p, p)), 0.5));
        }
    return sum;
}

typedef struct pub_ctx {
    rf_model *m;
    rf_opt *opt;
} pub_ctx;

static void public_step(rf_trace *t, void *ctx)
{
    pub_ctx *c = ctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_grads *g = NULL;
    rf_tensor *l = rf_withgradient(t, half_sq_loss, NULL, c->m, &x, 1, NULL, &g);
    rf_update(t, c->opt, c->m, g);
    rf_return(t, l);
}

static void test_public_update(fmodel *fm)
{
    fmodel_reset(fm);
    double before[NP][64], after[64];
    for (int j = 0; j < NP; j++)
        read_param(fm->p[j], before[j]);
    pub_ctx c = {fm->m, rf_setup(rf_descent(0.1), fm->m)};
    rf_array *x = rf_array_new(rf_device_cpu(), RF_F32, RF_SHAPE(2), NULL);
    rf_array *loss = NULL;
    CHECK_OK(rf_jit(public_step, &c, &x, 1, &loss, 1));
    for (int j = 0; j < NP; j++) {
        read_param(fm->p[j], after);
        for (int64_t i = 0; i < rf_array_numel(fm->p[j]); i++)
            CHECK_NEAR(after[i], 0.9 * before[j][i], 1e-7, 1e-6);
    }
    CHECK(rf_opt_steps(c.opt) == 1);
    rf_array_free(loss);
    rf_array_free(x);
    rf_opt_free(c.opt);
}

int main(void)
{
    if (fx_load(&fx, "optim.txt") != 0)
        return 1;
    fmodel fm;
    if (fmodel_make(&fm, false) != 0) {
        fprintf(stderr, "cannot build the model: %s\n", rf_errmsg());
        return 1;
    }
    test_rules(&fm);
    test_adjust_and_lr(&fm);
    test_errors(&fm);
    test_public_update(&fm);
    fmodel_free(&fm);
    test_foreach_program();
    test_mixed_dtypes();
    test_f64_hyperparameters();
    test_centred_rmsprop_cancellation();
    test_visit();
    test_lifetimes();
    printf("largest relative error above atol %.0e: %.3g\n", ATOL, worst_rel);
    fx_free(&fx);
    return tu_finish("test_optim_ref");
}
