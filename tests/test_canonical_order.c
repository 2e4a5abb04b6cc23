/* test_canonical_order.c: a traced program does not depend on the order in
 * which C evaluated the calls that built it (canonical_order.c).
 *
 * Each pair of trace functions below builds one program with its nodes,
 * captures and random draws created in opposite orders, the way gcc and clang
 * evaluate `rf_add(f(..), g(..))` differently. Both must print the same
 * program text, have the same structural hash, compile to the same executable
 * hash and compute the same bits. Also: dead nodes and captures neither read
 * nor assigned leave no trace, captures only assigned are numbered after the
 * ones read, updates that layers record while they run (BatchNorm's running
 * statistics, Dropout's key) follow the program rather than the calls,
 * updates of no output keep their order, and a chain far deeper than any C
 * stack could recurse through is put in order.
 */
#include "test_util.h"

typedef struct two_params {
    rf_array *scale, *shift, *key, *extra;
    rf_model *norm_a, *norm_b, *drop; /* in train mode: they record updates */
} two_params;

/* y = tanh(x) * scale + exp(x) * shift, reading scale first. */
static void scale_first(rf_trace *t, void *vctx)
{
    two_params *p = vctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_tensor *scale = rf_capture(t, p->scale);
    rf_tensor *a = rf_mul(rf_tanh(x), scale);
    rf_tensor *shift = rf_capture(t, p->shift);
    rf_tensor *e = rf_exp(x);
    rf_tensor *b = rf_mul(e, shift);
    rf_return(t, rf_add(a, b));
}

/* The same program with the right-hand operand, and shift, built first. */
static void shift_first(rf_trace *t, void *vctx)
{
    two_params *p = vctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_tensor *e = rf_exp(x);
    rf_tensor *shift = rf_capture(t, p->shift);
    rf_tensor *b = rf_mul(e, shift);
    rf_tensor *th = rf_tanh(x);
    rf_tensor *scale = rf_capture(t, p->scale);
    rf_tensor *a = rf_mul(th, scale);
    rf_return(t, rf_add(a, b));
}

/* uniform noise scaled by scale plus normal noise: two random streams. */
static void uniform_first(rf_trace *t, void *vctx)
{
    two_params *p = vctx;
    rf_tensor *key = rf_rng_key(t, p->key);
    rf_tensor *u = rf_rng_uniform(key, RF_F32, RF_SHAPE(3, 5));
    rf_tensor *n = rf_rng_normal(key, RF_F32, RF_SHAPE(3, 5));
    rf_return(t, rf_add(rf_mul(u, rf_capture(t, p->scale)), n));
}

static void normal_first(rf_trace *t, void *vctx)
{
    two_params *p = vctx;
    rf_tensor *key = rf_rng_key(t, p->key);
    rf_tensor *n = rf_rng_normal(key, RF_F32, RF_SHAPE(3, 5));
    rf_tensor *u = rf_rng_uniform(key, RF_F32, RF_SHAPE(3, 5));
    rf_tensor *scale = rf_capture(t, p->scale);
    rf_return(t, rf_add(rf_mul(u, scale), n));
}

/* scale_first after a capture that feeds only dead nodes, and with a dead
 * node after it. */
static void with_dead_code(rf_trace *t, void *vctx)
{
    two_params *p = vctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_tensor *unused = rf_capture(t, p->extra);
    rf_tensor *dead = rf_neg(unused);
    (void)rf_exp(dead);
    scale_first(t, vctx);
    (void)rf_tanh(x);
}

/* norm_a(x) + norm_b(x) with norm_a applied first, then second: each
 * BatchNorm records its running statistics as it runs. */
static void norm_a_first(rf_trace *t, void *vctx)
{
    two_params *p = vctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_tensor *a = rf_apply(p->norm_a, x);
    rf_tensor *b = rf_apply(p->norm_b, x);
    rf_return(t, rf_add(a, b));
}

static void norm_b_first(rf_trace *t, void *vctx)
{
    two_params *p = vctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_tensor *b = rf_apply(p->norm_b, x);
    rf_tensor *a = rf_apply(p->norm_a, x);
    rf_return(t, rf_add(a, b));
}

/* dropout(x) * norm_a(x): Dropout advances its key, BatchNorm its statistics. */
static void dropout_first(rf_trace *t, void *vctx)
{
    two_params *p = vctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_tensor *d = rf_apply(p->drop, x);
    rf_tensor *n = rf_apply(p->norm_a, x);
    rf_return(t, rf_mul(d, n));
}

static void norm_first(rf_trace *t, void *vctx)
{
    two_params *p = vctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_tensor *n = rf_apply(p->norm_a, x);
    rf_tensor *d = rf_apply(p->drop, x);
    rf_return(t, rf_mul(d, n));
}

/* Traces fn over x and returns its text (caller frees) and hash. */
static char *traced_text(rf_trace_fn fn, two_params *p, rf_array *x, uint64_t *hash)
{
    char *text = NULL;
    CHECK_OK(rf_trace_text(fn, p, &x, x ? 1 : 0, &text, hash));
    return text;
}

/* Compiles and runs fn once; returns the output (owned) and the exec hash. */
static rf_array *compile_and_run(rf_trace_fn fn, two_params *p, rf_array *x, uint64_t *hash)
{
    rf_exec *e = NULL;
    rf_array *out = NULL;
    *hash = 0;
    CHECK_OK(rf_compile(fn, p, &x, x ? 1 : 0, &e));
    if (!e)
        return NULL;
    *hash = rf_exec_hash(e);
    CHECK_OK(rf_exec_run(e, &x, x ? 1 : 0, &out, 1));
    rf_exec_free(e);
    return out;
}

static bool same_bits(const rf_array *a, const rf_array *b)
{
    if (!a || !b || rf_array_nbytes(a) != rf_array_nbytes(b))
        return false;
    size_t n = rf_array_nbytes(a);
    char *da = malloc(n), *db = malloc(n);
    bool same = da && db && rf_array_read(a, da, n) == RF_OK && rf_array_read(b, db, n) == RF_OK &&
                memcmp(da, db, n) == 0;
    free(da);
    free(db);
    return same;
}

static rf_array *cpu_randn(const int64_t *dims, int rank, uint64_t seed)
{
    rf_array *h = rf_randn(RF_F32, dims, rank, seed);
    rf_array *a = h ? rf_array_to(h, rf_device_cpu()) : NULL;
    rf_array_free(h);
    CHECK(a != NULL);
    return a;
}

/* m moved to the CPU device (m is freed). */
static rf_model *cpu_model(rf_model *m)
{
    rf_model *c = m ? rf_model_to(m, rf_device_cpu()) : NULL;
    rf_model_free(m);
    return c;
}

/* Traces both functions; they must print the same program, of one hash. */
static void check_same_trace(rf_trace_fn f, rf_trace_fn g, two_params *p, rf_array *x,
                             const char *what)
{
    uint64_t hf, hg;
    char *tf = traced_text(f, p, x, &hf);
    char *tg = traced_text(g, p, x, &hg);
    CHECK(tf && tg && strcmp(tf, tg) == 0);
    CHECK(hf == hg);
    if (tf && tg && strcmp(tf, tg) != 0)
        fprintf(stderr, "%s: one order traced\n%s\nthe other\n%s\n", what, tf, tg);
    free(tf);
    free(tg);
}

/* Traces and compiles both functions; they must be one program. */
static void check_one_program(rf_trace_fn f, rf_trace_fn g, two_params *p, rf_array *x,
                              const char *what)
{
    check_same_trace(f, g, p, x, what);
    uint64_t hf, hg;
    /* Random programs advance their key: reset it before each run. */
    static const int64_t seed_key[2] = {7, 0};
    if (p->key)
        CHECK_OK(rf_array_write(p->key, seed_key, sizeof seed_key));
    rf_array *of = compile_and_run(f, p, x, &hf);
    if (p->key)
        CHECK_OK(rf_array_write(p->key, seed_key, sizeof seed_key));
    rf_array *og = compile_and_run(g, p, x, &hg);
    CHECK(hf == hg);
    CHECK(same_bits(of, og));
    rf_array_free(of);
    rf_array_free(og);
}

static void test_operand_and_capture_order(two_params *p, rf_array *x)
{
    check_one_program(scale_first, shift_first, p, x, "operand order");
}

static void test_random_stream_order(two_params *p)
{
    check_one_program(uniform_first, normal_first, p, NULL, "random streams");
}

static void test_dead_code_and_unused_captures(two_params *p, rf_array *x)
{
    uint64_t ha, hb;
    char *a = traced_text(with_dead_code, p, x, &ha);
    char *b = traced_text(scale_first, p, x, &hb);
    CHECK(a && b && strcmp(a, b) == 0);
    CHECK(ha == hb);
    /* scale and shift are captures 0 and 1; `extra` is gone, and so are the dead nodes. */
    CHECK(a && strstr(a, "(1 args, 2 captures)") && !strstr(a, "neg"));
    free(a);
    free(b);
}

/* Updates recorded while the layers run must not follow the calls' order:
 * both orders trace one program and compile to one executable. (Their runs
 * are not compared: each changes the layers' state.) */
static void check_one_traced_program(rf_trace_fn f, rf_trace_fn g, two_params *p, rf_array *x,
                                     const char *what)
{
    check_same_trace(f, g, p, x, what);
    rf_exec *ef = NULL, *eg = NULL;
    CHECK_OK(rf_compile(f, p, &x, 1, &ef));
    CHECK_OK(rf_compile(g, p, &x, 1, &eg));
    CHECK(ef && eg && rf_exec_hash(ef) == rf_exec_hash(eg));
    rf_exec_free(ef);
    rf_exec_free(eg);
}

static void test_layer_update_order(two_params *p, rf_array *x)
{
    check_one_traced_program(norm_a_first, norm_b_first, p, x, "two BatchNorms");
    check_one_traced_program(dropout_first, norm_first, p, x, "Dropout and BatchNorm");
}

/* An update of a capture the program never reads, recorded between two that
 * it reads: read captures are numbered first; with no output to order them
 * by, updates keep their order. */
static void assign_only(rf_trace *t, void *vctx)
{
    two_params *p = vctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_tensor *scale = rf_capture(t, p->scale);
    rf_assign(t, p->scale, rf_mul(scale, x));
    rf_assign(t, p->extra, rf_add(x, x));
    rf_tensor *shift = rf_capture(t, p->shift);
    rf_assign(t, p->shift, rf_add(shift, x));
}

static void test_assign_only_capture(two_params *p, rf_array *x)
{
    char *text = traced_text(assign_only, p, x, NULL);
    CHECK(text != NULL);
    if (!text)
        return;
    /* scale and shift are read: 0 and 1; extra, only assigned, is 2. */
    const char *u0 = strstr(text, "update capture0 ");
    const char *u2 = strstr(text, "update capture2 ");
    const char *u1 = strstr(text, "update capture1 ");
    CHECK(u0 && u1 && u2 && u0 < u2 && u2 < u1);
    if (!(u0 && u1 && u2 && u0 < u2 && u2 < u1))
        fprintf(stderr, "assign-only capture:\n%s\n", text);
    free(text);
}

enum { DEEP_CHAIN = 200000 };

static void deep_chain(rf_trace *t, void *vctx)
{
    (void)vctx;
    rf_tensor *y = rf_arg(t, 0);
    for (int i = 0; i < DEEP_CHAIN; i++)
        y = rf_neg(y);
    rf_return(t, y);
}

static void test_deep_chain(rf_array *x)
{
    char *text = traced_text(deep_chain, NULL, x, NULL);
    CHECK(text != NULL);
    free(text);
}

int main(void)
{
    two_params p = {0};
    p.scale = cpu_randn(RF_SHAPE(3, 5), 1);
    p.shift = cpu_randn(RF_SHAPE(3, 5), 2);
    p.extra = cpu_randn(RF_SHAPE(3, 5), 3);
    p.key = rf_rng_key_new(7, rf_device_cpu());
    p.norm_a = cpu_model(rf_batchnorm(5, RF_ACT_IDENTITY));
    p.norm_b = cpu_model(rf_batchnorm(5, RF_ACT_RELU));
    p.drop = cpu_model(rf_dropout(0.5, 11));
    CHECK(p.norm_a && p.norm_b && p.drop);
    rf_trainmode(p.norm_a);
    rf_trainmode(p.norm_b);
    rf_trainmode(p.drop);
    rf_array *x = cpu_randn(RF_SHAPE(3, 5), 4);
    CHECK(p.key != NULL);

    test_operand_and_capture_order(&p, x);
    test_random_stream_order(&p);
    test_dead_code_and_unused_captures(&p, x);
    test_layer_update_order(&p, x);
    test_assign_only_capture(&p, x);
    test_deep_chain(x);

    rf_array_free(x);
    rf_array_free(p.scale);
    rf_array_free(p.shift);
    rf_model_free(p.norm_a);
    rf_model_free(p.norm_b);
    rf_model_free(p.drop);
    rf_array_free(p.extra);
    rf_array_free(p.key);
    return tu_finish("test_canonical_order");
}
