/* test_program_codec.c: programs as bytes (runtime/program_codec.h).
 *
 * Programs come from rf_compile on the interpreter (its executable keeps the
 * lowered program) and from the compiling backend's optimise stage run on
 * that: a small MLP's training step (withgradient, Adam's update, on
 * test_util.h's tu_trainer), and a program with a constant larger than a
 * description inlines, a weak scalar, random numbers, two outputs and an
 * assignment. Checks:
 *   - encode then decode gives the same program: the same printed text, the
 *     same description, the same rfi_hash, the same captured arrays and
 *     random streams, every byte used;
 *   - descriptions digest large constants (a changed byte changes the
 *     description) and encodings carry them whole;
 *   - a program capturing an array outside the list is not encoded;
 *   - every truncation of an encoding, and every byte replaced by 0x00, 0xff,
 *     0x80 or itself + 1, decodes to RF_E_CORRUPT or to a program that
 *     verifies: never a crash (the sanitizer build runs this too);
 *   - a count larger than the bytes left could hold is refused before
 *     anything is allocated for it.
 */
#include "backend/cpu/cc.h"
#include "runtime/program_codec.h"
#include "test_util.h"

/* ---- Programs ------------------------------------------------------------------------- */

/* The training step of a tu_trainer (test_util.h): withgradient and Adam's update. */
static void step_trace(rf_trace *t, void *ctx)
{
    tu_trainer *c = ctx;
    tu_train_step(t, c->m, c->opt);
}

typedef struct misc_case {
    rf_array *x, *state, *key;
    float table[100]; /* 400 bytes: more than a description inlines */
} misc_case;

static void misc_trace(rf_trace *t, void *ctx)
{
    misc_case *c = ctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_tensor *table = rf_constant(t, RF_F32, RF_SHAPE(100), c->table);
    rf_tensor *noise = rf_rng_uniform(rf_rng_key(t, c->key), RF_F32, RF_SHAPE(100));
    rf_tensor *y = rf_add(rf_mul(x, table), rf_mul(noise, rf_scalar(t, 0.5)));
    rf_tensor *s = rf_capture(t, c->state);
    rf_assign(t, c->state, rf_add(s, rf_mul(y, rf_sum_all(y))));
    rf_return(t, y);
    rf_return(t, rf_tanh(y));
}

/* The lowered program of fn (compiled on the interpreter), or NULL. */
static rf_exec *lowered(rf_trace_fn fn, void *ctx, rf_array *const *args, int nargs)
{
    rf_exec *e = NULL;
    CHECK_OK(rf_compile(fn, ctx, args, nargs, &e));
    return e;
}

/* A small MLP's step on a batch of 16 images of 2x2: 4 => 8 tanh => 10. */
static bool mlp_trainer(tu_trainer *t)
{
    const int32_t labels[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5};
    rf_nn_seed(3);
    rf_model *host = rf_chain(rf_flatten_layer(), rf_dense(4, 8, RF_ACT_TANH),
                              rf_dense(8, 10, RF_ACT_IDENTITY));
    return tu_trainer_make(t, rf_device_cpu(), host, 16, 2, 2, 1, labels, 1e-2);
}

static bool misc_case_new(misc_case *c)
{
    memset(c, 0, sizeof *c);
    for (int i = 0; i < 100; i++)
        c->table[i] = (float)i * 0.25f - 3.0f;
    rf_array *x = rf_randn(RF_F32, RF_SHAPE(100), 5);
    rf_array *st = rf_randn(RF_F32, RF_SHAPE(100), 6);
    c->x = x ? rf_array_to(x, rf_device_cpu()) : NULL;
    c->state = st ? rf_array_to(st, rf_device_cpu()) : NULL;
    c->key = rf_rng_key_new(9, rf_device_cpu());
    rf_array_free(x);
    rf_array_free(st);
    return c->x && c->state && c->key;
}

static void misc_case_free(misc_case *c)
{
    rf_array_free(c->x);
    rf_array_free(c->state);
    rf_array_free(c->key);
}

/* ---- Checks --------------------------------------------------------------------------- */

static void describe(const rfi_graph *g, rfi_strbuf *b)
{
    rfi_program_describe(b, g);
    CHECK(!b->failed);
}

/* Encodes g (captures from its own list), decodes, compares. */
static void check_round_trip(const rfi_graph *g, const char *what)
{
    rfi_strbuf enc = {0};
    CHECK(rfi_program_encode(&enc, g, g->captures, g->n_captures));
    rfi_graph *back = NULL;
    size_t used = 0;
    CHECK_OK(rfi_program_decode(enc.data, enc.len, g->device, g->captures, g->n_captures, &back,
                                &used));
    CHECK(used == enc.len);
    if (back) {
        char *a = rfi_print(g), *b = rfi_print(back);
        CHECK(a && b && strcmp(a, b) == 0);
        if (a && b && strcmp(a, b) != 0)
            fprintf(stderr, "  %s: the decoded program prints differently\n", what);
        rfi_free(a);
        rfi_free(b);
        rfi_strbuf da = {0}, db = {0};
        describe(g, &da);
        describe(back, &db);
        CHECK(da.len == db.len && memcmp(da.data, db.data, da.len) == 0);
        rfi_sb_free(&da);
        rfi_sb_free(&db);
        CHECK(rfi_hash(back) == rfi_hash(g));
        CHECK(back->n_captures == g->n_captures && back->n_rng_streams == g->n_rng_streams);
        for (int i = 0; i < g->n_captures && i < back->n_captures; i++)
            CHECK(back->captures[i] == g->captures[i]);
        CHECK_OK(rfi_verify(back));
    }
    rfi_graph_free(back);
    rfi_sb_free(&enc);
}

/* The lowered program and its optimised form both round-trip. */
static void check_program(const rf_exec *e, const char *what)
{
    if (!e)
        return;
    check_round_trip(e->prog, what);
    rfi_graph *opt = NULL;
    CHECK_OK(rfi_cpu_backend.optimise(e->prog, &opt));
    if (opt)
        check_round_trip(opt, what);
    rfi_graph_free(opt);
}

static void test_round_trips(void)
{
    tu_trainer s;
    rf_exec *e = mlp_trainer(&s) ? lowered(step_trace, &s, (rf_array *[]){s.x, s.y}, 2) : NULL;
    check_program(e, "mlp step");
    rf_exec_free(e);
    tu_trainer_free(&s);

    misc_case m;
    CHECK(misc_case_new(&m));
    e = lowered(misc_trace, &m, &m.x, 1);
    check_program(e, "misc");
    if (e) { /* the weak scalar survives */
        bool weak = false;
        for (int i = 0; i < e->prog->n_nodes; i++)
            weak |= e->prog->nodes[i]->weak;
        CHECK(weak);
    }
    rf_exec_free(e);
    misc_case_free(&m);
}

static void test_large_constants(void)
{
    misc_case m;
    CHECK(misc_case_new(&m));
    rf_exec *a = lowered(misc_trace, &m, &m.x, 1);
    m.table[57] += 1.0f;
    rf_exec *b = lowered(misc_trace, &m, &m.x, 1);
    if (a && b) {
        rfi_strbuf da = {0}, db = {0}, ea = {0};
        describe(a->prog, &da);
        describe(b->prog, &db);
        CHECK(da.len == db.len && memcmp(da.data, db.data, da.len) != 0); /* digest differs */
        CHECK(rfi_program_encode(&ea, a->prog, a->prog->captures, a->prog->n_captures));
        CHECK(ea.len > da.len + 300); /* the 400 bytes, whole */
        rfi_sb_free(&da);
        rfi_sb_free(&db);
        rfi_sb_free(&ea);
    }
    rf_exec_free(a);
    rf_exec_free(b);
    misc_case_free(&m);
}

static void test_capture_outside_the_list(void)
{
    misc_case m;
    CHECK(misc_case_new(&m));
    rf_exec *e = lowered(misc_trace, &m, &m.x, 1);
    if (e) {
        CHECK(e->prog->n_captures >= 2);
        rfi_strbuf b = {0};
        CHECK(!rfi_program_encode(&b, e->prog, e->prog->captures, e->prog->n_captures - 1));
        rfi_sb_free(&b);
        rfi_graph *g = NULL;
        size_t used;
        rfi_strbuf ok = {0};
        CHECK(rfi_program_encode(&ok, e->prog, e->prog->captures, e->prog->n_captures));
        /* decoding against a shorter list refuses the last capture */
        CHECK_STATUS(rfi_program_decode(ok.data, ok.len, e->prog->device, e->prog->captures,
                                        e->prog->n_captures - 1, &g, &used),
                     RF_E_CORRUPT);
        CHECK(g == NULL);
        rfi_sb_free(&ok);
    }
    rf_exec_free(e);
    misc_case_free(&m);
}

/* Decodes bytes that may be anything: a refusal or a program that verifies. */
static void decode_any(const rfi_graph *g, const void *bytes, size_t len, int *refused)
{
    rfi_graph *back = NULL;
    size_t used = 0;
    rf_status st = rfi_program_decode(bytes, len, g->device, g->captures, g->n_captures, &back,
                                      &used);
    if (st == RF_OK) {
        CHECK(back != NULL && used <= len);
        if (back)
            CHECK_OK(rfi_verify(back));
        rfi_graph_free(back);
    } else {
        CHECK(st == RF_E_CORRUPT && back == NULL);
        CHECK(strstr(rf_errmsg(), "decoding a program") != NULL);
        ++*refused;
    }
}

static void test_corrupted_encodings(void)
{
    tu_trainer s;
    rf_exec *e = mlp_trainer(&s) ? lowered(step_trace, &s, (rf_array *[]){s.x, s.y}, 2) : NULL;
    rfi_strbuf enc = {0};
    if (e)
        CHECK(rfi_program_encode(&enc, e->prog, e->prog->captures, e->prog->n_captures));
    unsigned char *copy = malloc(enc.len ? enc.len : 1);
    int refused = 0, tried = 0;
    for (size_t n = 0; e && copy && n < enc.len; n++) { /* every truncation */
        memcpy(copy, enc.data, n);
        decode_any(e->prog, copy, n, &refused);
        tried++;
    }
    CHECK(refused == tried); /* a cut-short encoding is never a program */
    const int replace[] = {0x00, 0xff, 0x80, -1};
    for (size_t at = 0; e && copy && at < enc.len; at++) {
        for (int r = 0; r < 4; r++) {
            memcpy(copy, enc.data, enc.len);
            copy[at] = (unsigned char)(replace[r] < 0 ? copy[at] + 1 : replace[r]);
            if (copy[at] == (unsigned char)enc.data[at])
                continue;
            decode_any(e->prog, copy, enc.len, &refused);
            tried++;
        }
    }
    CHECK(refused > tried / 2); /* most damage is caught by the decoder itself */
    printf("  %zu-byte encoding: %d damaged copies, %d refused\n", enc.len, tried, refused);
    free(copy);
    rfi_sb_free(&enc);
    rf_exec_free(e);
    tu_trainer_free(&s);
}

/* A count is not trusted beyond the bytes that could hold its items: four
 * bytes claiming 2^24 arguments once made the decoder allocate 1.2 GB for
 * their types before it found the bytes ended. */
static void test_counts_beyond_the_bytes(void)
{
    rfi_graph *g = NULL;
    size_t used = 0;
    /* name "", then 2^24 arguments (zigzag varint) and nothing after */
    static const unsigned char args[] = {0x00, 0x80, 0x80, 0x80, 0x10};
    CHECK_STATUS(rfi_program_decode(args, sizeof args, rf_device_cpu(), NULL, 0, &g, &used),
                 RF_E_CORRUPT);
    CHECK_MSG("decoding a program: 16777216 arguments, more than the 0 bytes left can hold");
    CHECK(g == NULL);
    /* a negative count is out of range, whatever bytes follow */
    static const unsigned char negative[] = {0x00, 0x03, 0x00, 0x00, 0x00, 0x00};
    CHECK_STATUS(rfi_program_decode(negative, sizeof negative, rf_device_cpu(), NULL, 0, &g,
                                    &used),
                 RF_E_CORRUPT);
    CHECK_MSG("decoding a program: -2 arguments, outside [0, ");
    CHECK(g == NULL);
    /* one f32 argument, no captures, no streams, one node: ARGUMENT with
     * 2^24 operands claimed where two bytes remain */
    rfi_strbuf b = {0};
    rfi_codec_put_int(&b, 0);                /* name */
    rfi_codec_put_int(&b, 1);                /* one argument: f32[] */
    rfi_codec_put_int(&b, RF_F32);
    rfi_codec_put_int(&b, 0);
    rfi_codec_put_int(&b, 0);                /* captures */
    rfi_codec_put_int(&b, 0);                /* random streams */
    rfi_codec_put_int(&b, 1);                /* nodes */
    rfi_codec_put_int(&b, RFI_OP_ARGUMENT);  /* op, type, weak */
    rfi_codec_put_int(&b, RF_F32);
    rfi_codec_put_int(&b, 0);
    rfi_codec_put_int(&b, 0);
    for (int k = 0; k < RFI_N_INTS; k++)
        rfi_codec_put_int(&b, 0);
    for (int k = 0; k < RFI_N_LISTS; k++)
        rfi_codec_put_int(&b, 0);
    rfi_codec_put_int(&b, 1 << 24);          /* operands */
    rfi_codec_put_int(&b, 0);
    rfi_codec_put_int(&b, 0);
    CHECK(!b.failed);
    CHECK_STATUS(rfi_program_decode(b.data, b.len, rf_device_cpu(), NULL, 0, &g, &used),
                 RF_E_CORRUPT);
    CHECK_MSG("16777216 operands, more than the 2 bytes left can hold");
    CHECK(g == NULL);
    rfi_sb_free(&b);
}

int main(void)
{
    setenv("RF_BACKEND", "interp", 1); /* rf_compile only to get lowered programs */
    test_round_trips();
    test_large_constants();
    test_capture_outside_the_list();
    test_corrupted_encodings();
    test_counts_beyond_the_bytes();
    return tu_finish("test_program_codec");
}
