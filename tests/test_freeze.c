/* test_freeze.c: frozen parameters (rf_opt_freeze, rf_opt_thaw): what a step leaves as
 * it was, what it trains, when it compiles again, and two optimisers in one step.
 *
 * Oracles: byte snapshots of the frozen arrays and their optimiser state, an unfrozen
 * run of the same first step (a rule acts per element, so a trained array's update does
 * not depend on which others are frozen), the step cache's counters, and the program
 * text's matrix products (a frozen layer's weight gradient is not computed).
 */
#include "test_util.h"

static rf_device *cpu;

enum { N = 16, IN = 4, HID = 8, OUT = 2 };

static rf_model *mlp_host(void)
{
    rf_nn_seed(5);
    return rf_chain(rf_dense(IN, HID, RF_ACT_TANH), rf_dense(HID, HID, RF_ACT_TANH),
                    rf_dense(HID, OUT, RF_ACT_IDENTITY));
}

static rf_array *randn_dev(int64_t rows, int64_t cols, uint64_t seed)
{
    rf_array *h = rf_randn(RF_F32, RF_SHAPE(rows, cols), seed);
    rf_array *d = rf_array_to(h, cpu);
    rf_array_free(h);
    return d;
}

static rf_tensor *mse_loss(rf_model *m, rf_tensor *const *b, int n, rf_aux *aux, void *ctx)
{
    (void)n, (void)aux, (void)ctx;
    return rf_mse(rf_apply(m, b[0]), b[1]);
}

/* The float contents of an array (malloc'd). */
static float *read_all(rf_array *a)
{
    size_t nb = rf_array_nbytes(a);
    float *v = malloc(nb ? nb : 1);
    rf_array_read(a, v, nb);
    return v;
}

typedef struct named {
    const char *want;
    rf_array *found;
} named;

static void find_named(const char *path, rf_array *a, bool trainable, void *ud)
{
    (void)trainable;
    named *n = ud;
    if (!strcmp(path, n->want))
        n->found = a;
}

static rf_array *param(rf_model *m, const char *path)
{
    named n = {path, NULL};
    rf_model_visit(m, find_named, &n);
    return n.found;
}

static rf_array *opt_state(rf_opt *o, const char *path)
{
    named n = {path, NULL};
    rf_opt_visit(o, find_named, &n);
    return n.found;
}

/* Whether the array at `path` of a and b holds the same values (within rtol). */
static bool same_param(rf_model *a, rf_model *b, const char *path, double rtol)
{
    rf_array *pa = param(a, path), *pb = param(b, path);
    if (!pa || !pb)
        return false;
    float *va = read_all(pa), *vb = read_all(pb);
    bool same = true;
    for (int64_t i = 0; i < rf_array_numel(pa); i++)
        same = same && fabsf(va[i] - vb[i]) <= rtol * fabsf(vb[i]);
    free(va);
    free(vb);
    return same;
}

/* ---- A frozen layer and its state stay; the rest trains as without freezing --------------- */

static void test_frozen_layer(rf_model *host, rf_array **batch)
{
    rf_model *fa = rf_model_to(host, cpu), *ref = rf_model_to(host, cpu);
    rf_opt *oa = rf_setup(rf_adam(1e-2), fa), *oref = rf_setup(rf_adam(1e-2), ref);
    CHECK(fa && ref && oa && oref);
    if (!oa || !oref)
        goto out;
    CHECK(rf_opt_n_frozen(oa) == 0);
    CHECK_OK(rf_opt_freeze(oa, "0"));
    CHECK(rf_opt_n_frozen(oa) == 2);
    CHECK_OK(rf_opt_freeze(oa, "0")); /* again: no change */
    CHECK(rf_opt_n_frozen(oa) == 2);

    double la, lref;
    CHECK_OK(rf_trainstep(mse_loss, NULL, fa, batch, 2, oa, &la, NULL));
    CHECK_OK(rf_trainstep(mse_loss, NULL, ref, batch, 2, oref, &lref, NULL));
    CHECK_NEAR(la, lref, 0, 1e-6); /* the same parameters went in */
    CHECK(same_param(fa, host, "0.weight", 0) && same_param(fa, host, "0.bias", 0));
    CHECK(!same_param(fa, host, "1.weight", 1e-3));
    static const char *trained[] = {"1.weight", "1.bias", "2.weight", "2.bias"};
    for (int i = 0; i < 4; i++)
        CHECK(same_param(fa, ref, trained[i], 1e-5));

    /* the flat moments: layer 0's pieces (weight 32 + bias 8 elements) stay zero, the
     * others are the unfrozen run's */
    rf_array *ma = opt_state(oa, "0.adam.m.f32"), *mref = opt_state(oref, "0.adam.m.f32");
    CHECK(ma && mref);
    if (ma && mref) {
        float *va = read_all(ma), *vr = read_all(mref);
        int64_t n = rf_array_numel(ma), frozen = IN * HID + HID, bad = 0;
        for (int64_t i = 0; i < n; i++)
            bad += i < frozen ? va[i] != 0 : !(fabsf(va[i] - vr[i]) <= 1e-5f * fabsf(vr[i]));
        CHECK(bad == 0);
        free(va);
        free(vr);
    }

    /* more steps: layer 0 still as it was, one compiled step */
    for (int s = 0; s < 5; s++)
        CHECK_OK(rf_trainstep(mse_loss, NULL, fa, batch, 2, oa, &la, NULL));
    CHECK(la < lref);
    CHECK(same_param(fa, host, "0.weight", 0) && same_param(fa, host, "0.bias", 0));
    rf_cache_stats cs = rf_model_cache_stats(fa);
    CHECK(cs.compiles == 1 && cs.hits == 5);

    /* thawed, it trains, in a step compiled for it; frozen again, the first step is reused */
    CHECK_OK(rf_opt_thaw(oa, ""));
    CHECK(rf_opt_n_frozen(oa) == 0);
    CHECK_OK(rf_trainstep(mse_loss, NULL, fa, batch, 2, oa, &la, NULL));
    CHECK(!same_param(fa, host, "0.weight", 1e-4));
    CHECK(rf_model_cache_stats(fa).compiles == 2);
    rf_array *w0 = param(fa, "0.weight");
    float *before = w0 ? read_all(w0) : NULL;
    CHECK_OK(rf_opt_freeze(oa, "0"));
    CHECK_OK(rf_trainstep(mse_loss, NULL, fa, batch, 2, oa, &la, NULL));
    cs = rf_model_cache_stats(fa);
    CHECK(cs.compiles == 2 && cs.entries == 2);
    if (before) {
        float *after = read_all(w0);
        CHECK(memcmp(before, after, rf_array_nbytes(w0)) == 0);
        free(after);
    }
    free(before);
out:
    rf_opt_free(oa);
    rf_opt_free(oref);
    rf_model_free(fa);
    rf_model_free(ref);
}

/* ---- Paths --------------------------------------------------------------------------------- */

static void test_paths(void)
{
    rf_model *layers[11];
    for (int i = 0; i < 11; i++)
        layers[i] = rf_dense(2, 2, RF_ACT_IDENTITY);
    rf_model *host = rf_chain_n(layers, 11);
    rf_model *m = rf_model_to(host, cpu);
    rf_opt *o = rf_setup(rf_descent(0.1), m);
    CHECK(o != NULL);
    CHECK_OK(rf_opt_freeze(o, "1")); /* layer 1, not layer 10 */
    CHECK(rf_opt_n_frozen(o) == 2);
    CHECK_OK(rf_opt_freeze(o, "10.bias"));
    CHECK(rf_opt_n_frozen(o) == 3);
    CHECK_OK(rf_opt_thaw(o, "1.weight"));
    CHECK(rf_opt_n_frozen(o) == 2);
    CHECK_OK(rf_opt_freeze(o, ""));
    CHECK(rf_opt_n_frozen(o) == 22);

    CHECK_STATUS(rf_opt_freeze(o, "11"), RF_E_INVALID);
    CHECK_MSG("rf_opt_freeze: the model has no trainable parameter at \"11\"");
    CHECK_STATUS(rf_opt_thaw(o, "0.weigh"), RF_E_INVALID);
    CHECK_MSG("rf_opt_thaw: the model has no trainable parameter at \"0.weigh\"");
    CHECK_STATUS(rf_opt_freeze(o, "1."), RF_E_INVALID);
    CHECK_STATUS(rf_opt_freeze(o, NULL), RF_E_INVALID);
    CHECK_STATUS(rf_opt_freeze(NULL, "0"), RF_E_INVALID);
    CHECK_STATUS(rf_opt_thaw(NULL, "0"), RF_E_INVALID);
    CHECK(rf_opt_n_frozen(NULL) == 0);
    CHECK(rf_opt_n_frozen(o) == 22); /* a refused call changes nothing */

    rf_model_free(m); /* the optimiser outlives its model */
    CHECK_STATUS(rf_opt_freeze(o, "0"), RF_E_INVALID);
    CHECK_MSG("the optimiser's model was freed");
    rf_opt_free(o);
    rf_model_free(host);
}

/* ---- A step compiled by hand: not run once what it updates changed ------------------------ */

typedef struct two_opts {
    rf_model *m;
    rf_opt *a, *b; /* b NULL: one optimiser */
} two_opts;

static void step_fn(rf_trace *t, void *ctx)
{
    two_opts *s = ctx;
    rf_tensor *batch[2] = {rf_arg(t, 0), rf_arg(t, 1)};
    rf_grads *g = NULL;
    rf_tensor *l = rf_withgradient(t, mse_loss, NULL, s->m, batch, 2, NULL, &g);
    rf_update(t, s->a, s->m, g);
    if (s->b)
        rf_update(t, s->b, s->m, g);
    rf_return(t, l);
}

static int count_of(const char *text, const char *needle)
{
    int n = 0;
    for (const char *p = text; p && (p = strstr(p, needle)) != NULL; p += strlen(needle))
        n++;
    return n;
}

static void test_compiled_step(rf_model *host, rf_array **batch)
{
    rf_model *m = rf_model_to(host, cpu);
    rf_opt *o = rf_setup(rf_adam(1e-2), m);
    two_opts s = {m, o, NULL};
    rf_exec *all = NULL, *head = NULL;
    CHECK_OK(rf_compile(step_fn, &s, batch, 2, &all));
    CHECK_OK(rf_opt_freeze(o, "0"));
    CHECK_OK(rf_compile(step_fn, &s, batch, 2, &head));
    if (!all || !head)
        goto out;
    /* two products the frozen step does not compute: layer 0's weight gradient and the
     * gradient reaching layer 0 from layer 1 (3 forward + 5 backward -> 3 + 3) */
    int products_all = count_of(rf_exec_program_text(all), "dot_general");
    int products_head = count_of(rf_exec_program_text(head), "dot_general");
    CHECK(products_all == 8 && products_head == 6);

    rf_array *l = NULL, *w0 = param(m, "0.weight");
    float *before = read_all(w0);
    CHECK_STATUS(rf_exec_run(all, batch, 2, &l, 1), RF_E_INVALID);
    CHECK_MSG("parameter \"0.weight\" was trained when this executable was traced and is "
              "frozen now");
    CHECK(l == NULL);
    CHECK_OK(rf_exec_run(head, batch, 2, &l, 1));
    rf_array_free(l);
    l = NULL;
    float *after = read_all(w0);
    CHECK(memcmp(before, after, rf_array_nbytes(w0)) == 0);
    free(after);
    CHECK_OK(rf_opt_thaw(o, "0"));
    CHECK_STATUS(rf_exec_run(head, batch, 2, &l, 1), RF_E_INVALID);
    CHECK_MSG("was frozen when this executable was traced and is trained now");
    CHECK_OK(rf_exec_run(all, batch, 2, &l, 1));
    rf_array_free(l);
    after = read_all(w0);
    CHECK(memcmp(before, after, rf_array_nbytes(w0)) != 0);
    free(after);
    free(before);
out:
    rf_exec_free(all);
    rf_exec_free(head);
    rf_opt_free(o);
    rf_model_free(m);
}

/* ---- Two optimisers in one step: each must own what it updates ---------------------------- */

static void test_two_optimisers(rf_model *host, rf_array **batch)
{
    rf_model *m = rf_model_to(host, cpu), *ref_a = rf_model_to(host, cpu),
             *ref_b = rf_model_to(host, cpu);
    rf_opt *a = rf_setup(rf_adam(1e-2), m), *b = rf_setup(rf_descent(0.1), m);
    rf_opt *oa = rf_setup(rf_adam(1e-2), ref_a), *ob = rf_setup(rf_descent(0.1), ref_b);
    two_opts s = {m, a, b};
    rf_exec *step = NULL;
    CHECK_STATUS(rf_compile(step_fn, &s, batch, 2, &step), RF_E_INVALID);
    CHECK_MSG("rf_update: parameter \"0.weight\" is already updated in this trace");
    CHECK(step == NULL);

    /* layer 0 by Adam, the rest by Descent: one backward pass, two rules */
    CHECK_OK(rf_opt_freeze(a, "1"));
    CHECK_OK(rf_opt_freeze(a, "2"));
    CHECK_OK(rf_opt_freeze(b, "0"));
    CHECK_OK(rf_compile(step_fn, &s, batch, 2, &step));
    rf_array *l = NULL;
    if (step)
        CHECK_OK(rf_exec_run(step, batch, 2, &l, 1));
    rf_array_free(l);
    double lr;
    CHECK_OK(rf_trainstep(mse_loss, NULL, ref_a, batch, 2, oa, &lr, NULL));
    CHECK_OK(rf_trainstep(mse_loss, NULL, ref_b, batch, 2, ob, &lr, NULL));
    CHECK(same_param(m, ref_a, "0.weight", 1e-5) && same_param(m, ref_a, "0.bias", 1e-5));
    CHECK(same_param(m, ref_b, "1.weight", 1e-5) && same_param(m, ref_b, "2.bias", 1e-5));
    CHECK(!same_param(m, ref_b, "0.weight", 1e-3));
    rf_exec_free(step);
    rf_opt_free(a);
    rf_opt_free(b);
    rf_opt_free(oa);
    rf_opt_free(ob);
    rf_model_free(m);
    rf_model_free(ref_a);
    rf_model_free(ref_b);
}

/* ---- Rules with state across arrays: per-array norms, accumulation ------------------------ */

static void test_chained_rules(rf_model *host, rf_array **batch)
{
    rf_model *fa = rf_model_to(host, cpu), *ref = rf_model_to(host, cpu);
    rf_opt *oa = rf_setup(rf_chain_rules(rf_accumgrad(2), rf_clipnorm(0.05, 2), rf_adam(1e-2)),
                          fa);
    rf_opt *oref = rf_setup(rf_chain_rules(rf_accumgrad(2), rf_clipnorm(0.05, 2),
                                           rf_adam(1e-2)), ref);
    CHECK(oa && oref);
    CHECK_OK(rf_opt_freeze(oa, "1"));
    double l;
    for (int s = 0; s < 2; s++) { /* one accumulating step, one update */
        CHECK_OK(rf_trainstep(mse_loss, NULL, fa, batch, 2, oa, &l, NULL));
        CHECK_OK(rf_trainstep(mse_loss, NULL, ref, batch, 2, oref, &l, NULL));
    }
    CHECK(same_param(fa, host, "1.weight", 0) && same_param(fa, host, "1.bias", 0));
    static const char *trained[] = {"0.weight", "0.bias", "2.weight", "2.bias"};
    for (int i = 0; i < 4; i++) {
        CHECK(same_param(fa, ref, trained[i], 1e-5));
        CHECK(!same_param(fa, host, trained[i], 1e-4));
    }
    rf_opt_free(oa);
    rf_opt_free(oref);
    rf_model_free(fa);
    rf_model_free(ref);
}

/* A global norm counts only trained arrays, also when a decay upstream gives a frozen
 * one's update a value: one Descent step clipped to omega moves the trained arrays by
 * exactly lr * omega in all (layer 0's weights are made large, so counting its decay
 * would shrink the step). */
static void test_global_norm(rf_model *host, rf_array **batch)
{
    enum { W0 = IN * HID };
    rf_model *m = rf_model_to(host, cpu);
    float big[W0];
    for (int i = 0; i < W0; i++)
        big[i] = 50.0f * (i % 2 ? 1 : -1);
    rf_array *w0 = param(m, "0.weight");
    CHECK(w0 && rf_array_write(w0, big, sizeof big) == RF_OK);
    const double lr = 0.1, omega = 0.01;
    rf_opt *o = rf_setup(rf_chain_rules(rf_weightdecay(0.5), rf_clipnorm_global(omega, 2),
                                        rf_descent(lr)), m);
    CHECK(o && rf_opt_freeze(o, "0") == RF_OK);
    static const char *trained[] = {"1.weight", "1.bias", "2.weight", "2.bias"};
    float *before[4];
    for (int i = 0; i < 4; i++)
        before[i] = read_all(param(m, trained[i]));
    double l;
    CHECK_OK(rf_trainstep(mse_loss, NULL, m, batch, 2, o, &l, NULL));
    double sq = 0;
    for (int i = 0; i < 4; i++) {
        rf_array *a = param(m, trained[i]);
        float *after = read_all(a);
        for (int64_t k = 0; k < rf_array_numel(a); k++)
            sq += ((double)after[k] - before[i][k]) * ((double)after[k] - before[i][k]);
        free(after);
        free(before[i]);
    }
    CHECK_NEAR(sqrt(sq), lr * omega, 0, 1e-3);
    float *w0_after = read_all(w0);
    CHECK(memcmp(w0_after, big, sizeof big) == 0);
    free(w0_after);
    rf_opt_free(o);
    rf_model_free(m);
}

/* A frozen array costs the update no working memory: its state keeps its value in the loop
 * that updates the state in place, so the new moments are not materialised to be sliced
 * (freezing one bias used to plan a step twice as large as the unfrozen one's). */
static void test_frozen_memory(rf_array **batch)
{
    static const char *sets[] = {"2.bias", "0", "1.weight"};
    rf_nn_seed(7); /* wide layers: the flat moments outweigh the activations */
    rf_model *host = rf_chain(rf_dense(IN, 64, RF_ACT_TANH), rf_dense(64, 64, RF_ACT_TANH),
                              rf_dense(64, OUT, RF_ACT_IDENTITY));
    rf_model *ref = rf_model_to(host, cpu);
    rf_opt *oref = rf_setup(rf_adam(1e-2), ref);
    double l;
    CHECK_OK(rf_trainstep(mse_loss, NULL, ref, batch, 2, oref, &l, NULL));
    size_t unfrozen = rf_model_cache_stats(ref).memory;
    for (int i = 0; i < 3; i++) {
        rf_model *m = rf_model_to(host, cpu);
        rf_opt *o = rf_setup(rf_adam(1e-2), m);
        CHECK_OK(rf_opt_freeze(o, sets[i]));
        CHECK_OK(rf_trainstep(mse_loss, NULL, m, batch, 2, o, &l, NULL));
        size_t frozen = rf_model_cache_stats(m).memory;
        if (frozen > unfrozen)
            fprintf(stderr, "  frozen \"%s\": %zu bytes planned, unfrozen %zu\n", sets[i], frozen,
                    unfrozen);
        CHECK(frozen <= unfrozen);
        rf_opt_free(o);
        rf_model_free(m);
    }
    rf_opt_free(oref);
    rf_model_free(ref);
    rf_model_free(host);
}

/* ---- A dtype group with every member frozen keeps the optimiser's scalar state in step ---- */

/* y = x * d, d an f64 vector: the model's only f64 parameter, a dtype group of its own. */
static rf_tensor *scale64_forward(rf_model *m, rf_tensor *x)
{
    return rf_mul(x, rf_convert(rf_model_param(m, rf_tensor_trace(x), 0), RF_F32));
}

static const rf_layer_type scale64_type = {"Scale64", scale64_forward, NULL};

static bool changed(rf_array *a, const void *before)
{
    void *now = read_all(a);
    bool c = memcmp(now, before, rf_array_nbytes(a)) != 0;
    free(now);
    return c;
}

/* With the f64 group all frozen for one step, its AccumGrad count used to stay while the f32
 * group's advanced: thawed, the groups fired on alternate steps for good (and Adam's beta^t of
 * a wholly frozen group stayed behind the optimiser's count, unlike a partly frozen one's). */
static void test_frozen_group(rf_array **batch)
{
    int config = 0;
    rf_model *s = rf_model_new(&scale64_type, &config, sizeof config);
    CHECK(s && rf_model_add_param(s, "d", rf_rand(RF_F64, RF_SHAPE(OUT), 3)) == RF_OK);
    rf_nn_seed(8);
    rf_model *host = rf_chain(rf_dense(IN, OUT, RF_ACT_TANH), s);
    rf_model *m = host ? rf_model_to_opts(host, cpu, &(rf_to_opts){.keep_f64 = true}) : NULL;
    rf_opt *o = m ? rf_setup(rf_chain_rules(rf_accumgrad(2), rf_descent(0.1)), m) : NULL;
    CHECK(o != NULL);
    if (!o)
        goto out;
    rf_array *w = param(m, "0.weight"), *d = param(m, "1.d");
    CHECK(w && d && rf_array_dtype(d) == RF_F64);
    CHECK_OK(rf_opt_freeze(o, "1"));
    double l;
    for (int step = 1; step <= 5; step++) {
        if (step == 2)
            CHECK_OK(rf_opt_thaw(o, "1"));
        void *w0 = read_all(w), *d0 = read_all(d);
        CHECK_OK(rf_trainstep(mse_loss, NULL, m, batch, 2, o, &l, NULL));
        bool fires = step % 2 == 0; /* the optimiser's count: every second step */
        CHECK(changed(w, w0) == fires);
        CHECK(changed(d, d0) == fires);
        free(w0);
        free(d0);
    }
    rf_opt_free(o);

    /* Adam's beta1^t of the wholly frozen group advances with the other group's */
    o = rf_setup(rf_adam(1e-2), m);
    CHECK(o && rf_opt_freeze(o, "1") == RF_OK);
    for (int step = 0; step < 3 && o; step++)
        CHECK_OK(rf_trainstep(mse_loss, NULL, m, batch, 2, o, &l, NULL));
    rf_array *b32 = o ? opt_state(o, "0.adam.beta1t.f32") : NULL;
    rf_array *b64 = o ? opt_state(o, "0.adam.beta1t.f64") : NULL;
    CHECK(b32 && b64);
    if (b32 && b64) {
        float v32;
        double v64;
        rf_array_read(b32, &v32, sizeof v32);
        rf_array_read(b64, &v64, sizeof v64);
        CHECK_NEAR(v64, v32, 0, 1e-6);
        CHECK_NEAR(v64, pow(0.9, 4), 0, 1e-12);
    }
out:
    rf_opt_free(o);
    rf_model_free(m);
    rf_model_free(host);
}

int main(void)
{
    cpu = rf_device_cpu();
    rf_model *host = mlp_host();
    rf_array *x = randn_dev(N, IN, 1), *y = randn_dev(N, OUT, 2);
    rf_array *batch[2] = {x, y};
    CHECK(host && x && y);
    if (host && x && y) {
        test_frozen_layer(host, batch);
        test_paths();
        test_compiled_step(host, batch);
        test_two_optimisers(host, batch);
        test_chained_rules(host, batch);
        test_global_norm(host, batch);
        test_frozen_memory(batch);
        test_frozen_group(batch);
    }
    rf_array_free(x);
    rf_array_free(y);
    rf_model_free(host);
    return tu_finish("test_freeze");
}
