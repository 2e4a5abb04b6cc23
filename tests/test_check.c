/* test_check.c: RF_CHECK's step-by-step judgement (src/backend/cpu/check.c)
 * against compiled runs with known faults.
 *
 * A real compiled run agrees with the interpreter, so the faults are made
 * here: the test plays the module's part for a small program (a plan built
 * from it, an arena, the `mark` calls before each step), storing into each
 * step's buffers the interpreter's values, except where a fault is wanted:
 * one step's value off by a relative 1e-3 (far more than rounding the
 * step's own arithmetic another way explains; also in a step that sums
 * inside itself, whose perturbed runs move the sum by units of its terms'
 * magnitudes), or an output overwritten after its step. RF_CHECK_STEPS=2
 * makes the checker judge every run step by step; it must accept the
 * faultless run and name the faulty step, or the overwritten output,
 * otherwise. A second program takes the log of a difference that cancels to
 * one unit in the last place: -inf there is rounding (the difference
 * rounded to 0) and must be accepted, -inf where nothing cancels must not. A
 * third takes the square root of a difference that the interpreter cancels
 * to exactly 0, computed as a multiply-add would: to be accepted in every
 * element, while a value 0.05 apart is still reported. A fourth convolves
 * an image whose corner is zero: a result whose window holds only zeros,
 * 2e-6 instead of 0 (a Winograd tile's rounding) is accepted, 0.05 is not.
 * A fifth checks the passes before the plan (the checker's second opinion on
 * a run): a pass that sums in another order, whose rounding the program
 * magnifies (g / (|g| + eps) of sums that cancel to about 0, as Adam's first
 * step), must be accepted; one that moves a sum that does not cancel by a
 * relative 1e-3 must be reported.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/check.h"
#include "backend/interp/interp.h"
#include "backend/plan.h"
#include "passes/passes.h"
#include "test_util.h"

enum { N = 6, M = 5, K = 4 };

/* e = exp(x) read twice (materialised), sum over rows of e, e * 2 + 1, and
 * relu(x @ w) (the product summed inside the step that stores its relu). */
static void program_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *e = rf_exp(rf_arg(t, 0));
    int64_t axis = 1;
    rf_return(t, rf_sum(e, &axis, 1, false));
    rf_return(t, rf_add_s(rf_mul_s(e, 2), 1));
    float w[M * K];
    for (int i = 0; i < M * K; i++)
        w[i] = 0.1f * (float)(i % 5) - 0.15f;
    rf_return(t, rf_relu(rf_matmul(rf_arg(t, 0), rf_constant(t, RF_F32, RF_SHAPE(M, K), w))));
}

/* The constants of log(exp(x) - c): c is exp(x) rounded to f32 and one unit
 * less, so the difference is one unit (about 6e-8 at x near 0), except at
 * element FAR, where it is 0.5. */
enum { CANCEL = 7, FAR = 12 };
static float cancel_c[N * M];

static void cancel_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *c = rf_constant(t, RF_F32, RF_SHAPE(N, M), cancel_c);
    rf_return(t, rf_log(rf_sub(rf_exp(rf_arg(t, 0)), c)));
}

/* sqrt(relu(a - x * x)) with a the product x * x as the interpreter rounds it
 * (centred RMSProp's first step takes the square root of v - m * m, v and
 * m * m the same square rounded; found by the training fuzzer). A compiled
 * loop that contracts the product into a multiply-add computes a - x * x
 * exactly: in about half the elements a few units of x * x above 0, where
 * the interpreter's 0 gives a square root of 0. Over this many elements some
 * would stay at or below 0 in every one of eight runs that move each
 * rounding at random; the runs that move the cancellations alone must
 * accept them all. */
enum { SQ_ROWS = 64, SQ_COLS = 32, SQ_FAR = 100 };
static float square_x[SQ_ROWS * SQ_COLS], square_a[SQ_ROWS * SQ_COLS];

static void square_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_tensor *a = rf_constant(t, RF_F32, RF_SHAPE(SQ_ROWS, SQ_COLS), square_a);
    rf_return(t, rf_sqrt(rf_relu(rf_sub(a, rf_mul(x, x)))));
}

/* relu(conv(x, k)), 3x3, padding 1, over an 8x8 image whose top-left 3x3
 * corner is zero: the result at (1, 1) sums only zeros, while the 4x4 tile
 * of results it belongs to reaches (3, 3), whose window holds the image's
 * values. A Winograd convolution computes the tile from one transformed
 * patch, and its rounding there scales with the patch (the training
 * fuzzer found 1.9e-6 where the interpreter's window gives 0): the
 * perturbed runs move that result by units of its tile's largest window,
 * which makes 2e-6 rounding and leaves 0.05 a fault. */
enum { TILE_SIDE = 8, TILE_AT = 1 * TILE_SIDE + 1 };

static void tile_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    float k[8 * 9]; /* 8 output features: a library call (one or two are loops) */
    for (int i = 0; i < 8 * 9; i++)
        k[i] = 0.25f * (float)(i % 9 % 4) + 0.1f;
    rf_conv_params cp = rf_conv_params_default(2);
    cp.pad_lo[0] = cp.pad_lo[1] = cp.pad_hi[0] = cp.pad_hi[1] = 1;
    rf_tensor *x = rf_reshape(rf_arg(t, 0), RF_SHAPE(1, 1, TILE_SIDE, TILE_SIDE));
    rf_tensor *w = rf_constant(t, RF_F32, RF_SHAPE(8, 1, 3, 3), k);
    rf_return(t, rf_relu(rf_conv(x, w, &cp)));
}

/* out0 = s / (|s| + 1e-8) with s the sum of each row, which cancels to about
 * 0 (Adam's first step on a gradient that is nearly zero), and out1 the sum
 * of each row's squares. */
enum { PR = 32, PC = 8 };

static void pass_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = rf_arg(t, 0);
    int64_t axis = 1;
    rf_tensor *s = rf_sum(x, &axis, 1, false);
    rf_return(t, rf_div(s, rf_add_s(rf_abs(s), 1e-8)));
    rf_return(t, rf_sum(rf_mul(x, x), &axis, 1, false));
}

/* The passes the fifth program's plan is built after: each row's sum as the
 * sum of its two halves' sums (rounded apart: an inexact pass that is
 * right), or out1's sums times 1.001 (a wrong pass). */
typedef enum pass_kind { PASS_SPLIT_SUMS, PASS_WRONG_SUMS } pass_kind;

static rfi_node *halves_sum(rfi_graph *c, rfi_node *x, const rfi_node *n)
{
    rfi_node *half[2];
    for (int h = 0; h < 2; h++) {
        rfi_attrs a;
        memset(&a, 0, sizeof a);
        a.nl[0] = a.nl[1] = a.nl[2] = 2;
        a.l[0][1] = h * PC / 2;
        a.l[1][0] = PR;
        a.l[1][1] = (h + 1) * PC / 2;
        a.l[2][0] = a.l[2][1] = 1;
        rfi_node *slice = rfi_node_new(c, RFI_OP_SLICE, &x, 1, &a, RF_F32, NULL, 0);
        half[h] = rfi_node_new(c, RFI_OP_REDUCE, &slice, 1, &n->attr, RF_F32, NULL, 0);
    }
    return rfi_node_new(c, RFI_OP_ADD, half, 2, NULL, RF_F32, NULL, 0);
}

static rfi_node *scaled_sum(rfi_graph *c, rfi_node *x, const rfi_node *n)
{
    float k = 1.001f;
    rfi_attrs a;
    memset(&a, 0, sizeof a);
    a.data = &k;
    a.nbytes = sizeof k;
    rfi_node *sum = rfi_node_new(c, RFI_OP_REDUCE, &x, 1, &n->attr, RF_F32, NULL, 0);
    rfi_node *scalar = rfi_node_new(c, RFI_OP_CONSTANT, NULL, 0, &a, RF_F32, NULL, 0);
    memset(&a, 0, sizeof a);
    rfi_node *splat = rfi_node_new(c, RFI_OP_BROADCAST_IN_DIM, &scalar, 1, &a, RF_F32, sum->dims,
                                   sum->rank);
    rfi_node *in[2] = {sum, splat};
    return rfi_node_new(c, RFI_OP_MUL, in, 2, NULL, RF_F32, NULL, 0);
}

static rfi_node *pass_rewrite(void *ctx, rfi_graph *c, const rfi_node *n, rfi_node *const *in,
                              rfi_node *const *map)
{
    (void)map;
    pass_kind kind = *(const pass_kind *)ctx;
    if (n->op != RFI_OP_REDUCE)
        return NULL;
    bool of_x = n->in[0]->op == RFI_OP_ARGUMENT;
    if (kind == PASS_SPLIT_SUMS && of_x)
        return halves_sum(c, in[0], n);
    if (kind == PASS_WRONG_SUMS && !of_x)
        return scaled_sum(c, in[0], n);
    return NULL;
}

static rfi_graph *trace(rf_trace_fn fn, int64_t rows, int64_t cols)
{
    rfi_graph *g = rfi_graph_new(rf_device_cpu(), "test_check");
    rf_dtype dt = RF_F32;
    int rank = 2;
    int64_t dims[1][RF_MAX_RANK] = {{rows, cols}};
    CHECK_OK(rfi_graph_set_args(g, 1, &dt, &rank, (const int64_t(*)[RF_MAX_RANK])dims));
    fn(g, NULL);
    CHECK_OK(g->status);
    return g;
}

/* Every node's value in the interpreter (owned copies). */
typedef struct values {
    void **of;
    int n;
} values;

static rf_status keep_value(void *ctx, const rfi_node *n, const void **value, void *own,
                            const void *const *operands)
{
    values *v = ctx;
    (void)own, (void)operands;
    size_t bytes = rfi_node_nbytes(n);
    v->of[n->id] = malloc(bytes ? bytes : 1);
    if (v->of[n->id] && bytes)
        memcpy(v->of[n->id], *value, bytes);
    return RF_OK;
}

typedef enum fault {
    FAULT_NONE,
    FAULT_STEP,      /* the first float value stored, its largest element * 1.001 */
    FAULT_SUM_STEP,  /* the same in output 2, the relu of a product */
    FAULT_OVERWRITE, /* output 0 changed after the run */
    FAULT_CANCEL,    /* the log at element CANCEL -inf (rounding: accepted) */
    FAULT_FAR,       /* the log at element FAR -inf (reported) */
    FAULT_CONTRACT,  /* the square root of a - x * x as a multiply-add gives it */
    FAULT_SQRT_FAR,  /* the same, element SQ_FAR 0.05 more (reported) */
    FAULT_TILE,      /* the convolution's result at TILE_AT 2e-6, not 0 (accepted) */
    FAULT_TILE_FAR,  /* the same, 0.05 (reported) */
    FAULT_PASS,      /* the plan's program from an inexact pass (accepted) */
    FAULT_PASS_FAR,  /* from a wrong pass (reported) */
} fault;

/* Whether root x of a step is the one fault f changes. */
static bool faults(const rfi_graph *g, int x, fault f, int faulty)
{
    if (faulty >= 0 || g->nodes[x]->dtype != RF_F32)
        return false;
    switch (f) {
    case FAULT_STEP: return true;
    case FAULT_SUM_STEP: return x == (int)g->outputs[2]->id;
    case FAULT_CANCEL:
    case FAULT_FAR:
    case FAULT_CONTRACT:
    case FAULT_SQRT_FAR:
    case FAULT_TILE:
    case FAULT_TILE_FAR: return x == (int)g->outputs[0]->id;
    default: return false;
    }
}

/* Changes root value dst (numel elements) as fault f says. */
static void make_fault(float *dst, int64_t numel, fault f)
{
    if (f == FAULT_CANCEL || f == FAULT_FAR) {
        dst[f == FAULT_CANCEL ? CANCEL : FAR] = -INFINITY;
        return;
    }
    if (f == FAULT_TILE || f == FAULT_TILE_FAR) {
        dst[TILE_AT] = f == FAULT_TILE ? 2e-6f : 0.05f;
        return;
    }
    if (f == FAULT_CONTRACT || f == FAULT_SQRT_FAR) {
        for (int64_t i = 0; i < numel; i++)
            dst[i] = sqrtf(fmaxf(fmaf(-square_x[i], square_x[i], square_a[i]), 0));
        if (f == FAULT_SQRT_FAR)
            dst[SQ_FAR] += 0.05f;
        return;
    }
    int64_t top = 0;
    for (int64_t i = 1; i < numel; i++)
        top = dst[i] > dst[top] ? i : top;
    dst[top] *= 1.001f; /* the largest: a relu has not made it 0 */
}

/* The run a module would make, with fault f (see above). Returns the step
 * made faulty (or -1). */
static int play_module(const rfi_plan *p, rfi_cpu_check *c, void *const *buffers,
                       const values *v, fault f)
{
    const rfi_graph *g = p->g;
    int faulty = -1;
    for (int q = 0; q < p->n_steps; q++) {
        rfi_cpu_check_mark(c, q);
        const rfi_step *st = &p->steps[q];
        for (int r = 0; r < st->n_roots; r++) {
            int x = st->roots[r];
            rfi_loc_kind k = p->loc[x].kind;
            if (st->kind == RFI_STEP_COPY) {
                int out = st->copy_to_output;
                if (out >= 0)
                    memcpy(buffers[g->n_args + g->n_captures + out], v->of[x],
                           rfi_node_nbytes(g->nodes[x]));
                continue;
            }
            if (k != RFI_LOC_ARENA && k != RFI_LOC_OUTPUT)
                continue;
            int b;
            size_t off;
            rfi_plan_buffer(p, x, &b, &off);
            float *dst = (float *)((char *)buffers[b] + off);
            memcpy(dst, v->of[x], rfi_node_nbytes(g->nodes[x]));
            if (faults(g, x, f, faulty)) {
                make_fault(dst, rfi_node_numel(g->nodes[x]), f);
                faulty = q;
            }
        }
    }
    rfi_cpu_check_mark(c, -1);
    if (f == FAULT_OVERWRITE)
        ((float *)buffers[g->n_args + g->n_captures])[0] += 1;
    return faulty;
}

/* Plays fault f on the plan of opt, g's program after the passes (g itself
 * but for the FAULT_PASS cases). */
static void run_case_on(rfi_graph *g, const rfi_graph *opt, rf_array *x, fault f)
{
    rfi_plan_opts opts = rfi_plan_opts_default();
    rfi_plan *p = NULL;
    CHECK_OK(rfi_plan_build(opt, &opts, &p));
    if (!p)
        return;
    int nb = rfi_plan_n_buffers(p);
    void **buffers = calloc((size_t)nb, sizeof *buffers);
    void *arena = malloc(p->arena_bytes + 64);
    int n_out = g->n_outputs;
    void *outs[3], *wants[3];
    for (int i = 0; i < n_out; i++) {
        outs[i] = malloc(rfi_node_nbytes(g->outputs[i]));
        wants[i] = malloc(rfi_node_nbytes(g->outputs[i]));
    }
    void *args[1] = {x->data};
    buffers[0] = x->data;
    for (int i = 0; i < n_out; i++)
        buffers[g->n_args + g->n_captures + i] = outs[i];
    buffers[rfi_plan_arena_buffer(p)] = arena;
    for (int i = 0; i < p->n_consts; i++)
        buffers[rfi_plan_arena_buffer(p) + 1 + i] = (void *)g->nodes[p->consts[i]]->attr.data;

    values v = {calloc((size_t)opt->n_nodes, sizeof(void *)), opt->n_nodes};
    void *state = NULL;
    CHECK_OK(rfi_interp_backend.prepare(opt, &state));
    rfi_run_io ref = {args, NULL, wants, NULL};
    CHECK_OK(rfi_interp_run_visited(state, opt, &ref, keep_value, &v));
    rfi_interp_backend.release(state);

    rfi_cpu_check *c = NULL;
    CHECK_OK(rfi_cpu_check_new(g, p, buffers, 1, &c));
    CHECK(rfi_cpu_check_records(c));
    rfi_run_io io = {args, NULL, outs, NULL};
    CHECK_OK(rfi_cpu_check_before(c, g, &io));
    int faulty = play_module(p, c, buffers, &v, f);
    rf_status st = rfi_cpu_check_after(c, g, &io);
    if (st != RF_OK)
        printf("fault %d: %s\n", (int)f, rf_errmsg());
    if (f == FAULT_NONE || f == FAULT_CANCEL || f == FAULT_CONTRACT || f == FAULT_TILE ||
        f == FAULT_PASS) {
        CHECK_OK(st);
    } else if (f == FAULT_PASS_FAR) {
        CHECK_STATUS(st, RF_E_INTERNAL);
        CHECK_MSG("RF_CHECK: output 1 (");
        CHECK_MSG("the passes before the plan changed the result");
    } else if (f == FAULT_STEP || f == FAULT_SUM_STEP || f == FAULT_FAR ||
               f == FAULT_SQRT_FAR || f == FAULT_TILE_FAR) {
        char want[64];
        snprintf(want, sizeof want, "RF_CHECK: step %d (", faulty);
        CHECK(faulty >= 0);
        CHECK_STATUS(st, RF_E_INTERNAL);
        CHECK_MSG(want);
        CHECK_MSG("from the values the step read");
        if (f == FAULT_SUM_STEP)
            CHECK_MSG(" max element ");
        if (f == FAULT_FAR)
            CHECK_MSG(" log element 12 as -inf");
        if (f == FAULT_SQRT_FAR)
            CHECK_MSG(" element 100 as ");
        if (f == FAULT_TILE_FAR)
            CHECK_MSG(" element 9 as 0.05");
    } else {
        CHECK_STATUS(st, RF_E_INTERNAL);
        CHECK_MSG("RF_CHECK: output 0 element 0 is ");
        CHECK_MSG(" after the run, ");
        CHECK_MSG(" as its step left it");
    }
    rfi_cpu_check_free(c);
    for (int i = 0; i < n_out; i++) {
        free(outs[i]);
        free(wants[i]);
    }
    for (int i = 0; i < v.n; i++)
        free(v.of[i]);
    free(v.of);
    free(arena);
    free(buffers);
    rfi_plan_free(p);
}

static void run_case(rfi_graph *g, rf_array *x, fault f)
{
    run_case_on(g, g, x, f);
}

/* Whether out0 of g and opt differ by more than the checker's tolerance
 * somewhere on x (so the inexact pass's case needs the second opinion). */
static bool passes_differ(const rfi_graph *g, const rfi_graph *opt, rf_array *x)
{
    float out[2][PR], sums[2][PR];
    const rfi_graph *progs[2] = {g, opt};
    void *args[1] = {x->data};
    for (int k = 0; k < 2; k++) {
        void *outs[2] = {out[k], sums[k]};
        void *state = NULL;
        CHECK_OK(rfi_interp_backend.prepare(progs[k], &state));
        rfi_run_io io = {args, NULL, outs, NULL};
        CHECK_OK(rfi_interp_run_visited(state, progs[k], &io, NULL, NULL));
        rfi_interp_backend.release(state);
    }
    bool differ = false;
    for (int i = 0; i < PR; i++)
        differ |= fabsf(out[0][i] - out[1][i]) > 1e-6f + 1e-4f * fabsf(out[0][i]);
    return differ;
}

/* The fifth program: rows whose sums cancel to about 0, under an inexact
 * pass (accepted) and a wrong one (reported). */
static void run_passes(void)
{
    float xv[PR * PC];
    uint64_t state = 777;
    for (int r = 0; r < PR; r++) {
        float sum = 0;
        for (int c = 0; c + 1 < PC; c++) {
            state = state * 6364136223846793005ull + 1442695040888963407ull;
            xv[r * PC + c] = (float)(state >> 40) / (float)(1 << 23) - 1.0f;
            sum += xv[r * PC + c];
        }
        xv[r * PC + PC - 1] = -sum;
    }
    rf_array *x = rf_array_new(rf_device_cpu(), RF_F32, RF_SHAPE(PR, PC), xv);
    CHECK(x != NULL);
    rfi_graph *g = x ? trace(pass_fn, PR, PC) : NULL;
    for (int k = 0; g && k < 2; k++) {
        pass_kind kind = k == 0 ? PASS_SPLIT_SUMS : PASS_WRONG_SUMS;
        rfi_graph *opt = NULL;
        CHECK_OK(rfi_rewrite_graph(g, "test pass", pass_rewrite, &kind, &opt));
        if (!opt)
            continue;
        if (kind == PASS_SPLIT_SUMS)
            CHECK(passes_differ(g, opt, x));
        run_case_on(g, opt, x, kind == PASS_SPLIT_SUMS ? FAULT_PASS : FAULT_PASS_FAR);
        rfi_graph_free(opt);
    }
    rfi_graph_free(g);
    rf_array_free(x);
}

/* Traces fn over a rows x cols argument and plays the faults on it with x. */
static void run_program(rf_trace_fn fn, rf_array *x, int64_t rows, int64_t cols,
                        const fault *list, int n)
{
    CHECK(x != NULL);
    rfi_graph *g = x ? trace(fn, rows, cols) : NULL;
    if (g) {
        CHECK_OK(rfi_verify(g));
        for (int k = 0; k < n; k++)
            run_case(g, x, list[k]);
    }
    rfi_graph_free(g);
    rf_array_free(x);
}

int main(void)
{
    setenv("RF_CHECK_STEPS", "2", 1);
    float xv[N * M];
    for (int i = 0; i < N * M; i++)
        xv[i] = 0.1f * (float)(i % 7) - 0.3f;
    run_program(program_fn, rf_array_new(rf_device_cpu(), RF_F32, RF_SHAPE(N, M), xv), N, M,
                (const fault[]){FAULT_NONE, FAULT_STEP, FAULT_SUM_STEP, FAULT_OVERWRITE}, 4);
    for (int i = 0; i < N * M; i++) { /* exp as the interpreter computes it */
        float e = (float)exp((double)xv[i]);
        cancel_c[i] = i == FAR ? e - 0.5f : nextafterf(e, 0);
    }
    run_program(cancel_fn, rf_array_new(rf_device_cpu(), RF_F32, RF_SHAPE(N, M), xv), N, M,
                (const fault[]){FAULT_NONE, FAULT_CANCEL, FAULT_FAR}, 3);

    int contracted = 0; /* elements whose multiply-add leaves a square root above 0 */
    uint64_t state = 12345;
    for (int i = 0; i < SQ_ROWS * SQ_COLS; i++) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        square_x[i] = 0.1f + 0.9f * (float)(state >> 40) / (float)(1 << 24);
        square_a[i] = square_x[i] * square_x[i]; /* rounded, as the interpreter's mul */
        contracted += fmaf(-square_x[i], square_x[i], square_a[i]) > 0;
    }
    CHECK(contracted > SQ_ROWS * SQ_COLS / 4);
    run_program(square_fn,
                rf_array_new(rf_device_cpu(), RF_F32, RF_SHAPE(SQ_ROWS, SQ_COLS), square_x),
                SQ_ROWS, SQ_COLS,
                (const fault[]){FAULT_NONE, FAULT_CONTRACT, FAULT_SQRT_FAR}, 3);

    float image[TILE_SIDE * TILE_SIDE];
    for (int i = 0; i < TILE_SIDE * TILE_SIDE; i++) {
        int r = i / TILE_SIDE, c = i % TILE_SIDE;
        image[i] = r < 3 && c < 3 ? 0.0f : 0.5f + 0.125f * (float)((r + 2 * c) % 5);
    }
    run_program(tile_fn,
                rf_array_new(rf_device_cpu(), RF_F32, RF_SHAPE(TILE_SIDE, TILE_SIDE), image),
                TILE_SIDE, TILE_SIDE, (const fault[]){FAULT_NONE, FAULT_TILE, FAULT_TILE_FAR}, 3);
    run_passes();
    return tu_finish("test_check");
}
