/* test_services.c: the CPU backend's runtime services against the reference
 * interpreter: every MATMUL form (batch dims, transposed operands, several
 * free/contracting dims, vectors, empty, an rhs copied into padded rows) and
 * every CONV form (stride, padding incl. negative, lhs and rhs dilation,
 * feature and batch groups, 1-D, 2-D, 3-D, chunked batches) through oneDNN,
 * with relative error <= 1e-5 of the sum of |terms| (the same op evaluated on
 * |operands|); FALLBACK steps and non-f32 contractions bitwise; no
 * allocation per call; and the thread pool (coverage, chunking, inline runs,
 * nesting, repeated and concurrent calls); the native FALLBACK kernels
 * (select_and_scatter, argmax/argmin, gather, scatter_add) bitwise; a plan's
 * convolutions made on the caller and a helper thread.
 * CALL epilogues (bias, residual, relu, tanh, logistic after a matmul or a
 * convolution) through plans built by rfi_plan_build, against the interpreter
 * evaluating the whole program, within RF_CHECK's tolerance
 * (|a - b| <= 1e-6 + 1e-4 |b|) plus 1e-5 of the pre-activation's sum of
 * |terms| (the product's f32 accumulation), both as oneDNN post-ops and
 * applied after the call (a forced im2col path).
 *
 * The channel block guessed from the CPU's features matches oneDNN's.
 *
 * Plans are built by hand: one graph per case whose ARGUMENT operands feed
 * one node computed by a single CALL step into the arena (at an offset) or an
 * output buffer.
 */
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "backend/cpu/dnnl_loader.h"
#include "backend/cpu/services.h"
#include "backend/interp/interp.h"
#include "runtime/threadpool.h"
#include "test_prog.h"
#include "test_util.h"

/* ---- Random data ------------------------------------------------------------------- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static double uniform(void) /* [-1, 1) */
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(rng_state >> 11) / (double)(1ull << 53) * 2.0 - 1.0;
}

/* When set, float data is drawn from {-1, -0, 0, 0.5, 1, NaN}: ties, signed
 * zeros and NaNs for the selection kernels; with special_inf also from
 * {inf, -inf} (sums that overflow or meet NaN for the scatter kernels). */
static bool special_values, special_inf;

static double special(void)
{
    static const double values[] = {-1.0, -0.0, 0.0, 0.5, 1.0, 1.0, NAN, 0.5};
    static const double with_inf[] = {-1.0, -0.0, 0.0, INFINITY, 1.0, -INFINITY, NAN, 0.5};
    int k = (int)((uniform() + 1.0) * 4.0);
    return (special_inf ? with_inf : values)[k < 0 ? 0 : k > 7 ? 7 : k];
}

/* When index_hi > index_lo, integer data is drawn from [index_lo, index_hi)
 * (the index operands of gather and scatter_add). */
static int64_t index_lo, index_hi;
/* The key of an RNG case. */
static int64_t rng_key[2] = {42, 7};

static void fill(void *p, rf_dtype dt, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        double v = special_values && (dt == RF_F32 || dt == RF_F64) ? special() : uniform();
        if (index_hi > index_lo && (dt == RF_I32 || dt == RF_I64)) {
            int64_t at = index_lo + (int64_t)((v + 1.0) / 2.0 * (double)(index_hi - index_lo));
            at = at < index_hi ? at : index_hi - 1;
            if (dt == RF_I32)
                ((int32_t *)p)[i] = (int32_t)at;
            else
                ((int64_t *)p)[i] = at;
            continue;
        }
        switch (dt) {
        case RF_F32: ((float *)p)[i] = (float)v; break;
        case RF_F64: ((double *)p)[i] = v; break;
        case RF_I32: ((int32_t *)p)[i] = (int32_t)(v * 50); break;
        case RF_I64: ((int64_t *)p)[i] = (int64_t)(v * 50); break;
        default: ((uint8_t *)p)[i] = (uint8_t)(v * 100 + 100); break;
        }
    }
}

/* ---- One-op programs ------------------------------------------------------------------ */

#define MAX_IN 3

typedef struct operand_spec {
    rf_dtype dt;
    int rank;
    int64_t dims[RF_MAX_RANK];
} operand_spec;

/* A graph of n_in arguments (types in spec) and one node of op over them. */
static rfi_graph *one_op_graph(rfi_op op, const operand_spec *spec, int n_in, const rfi_attrs *a,
                               rf_dtype dt, const int64_t *dims, int rank, rfi_node **y)
{
    rfi_graph *g = rfi_graph_new(rf_device_cpu(), "test_services");
    rf_dtype dts[MAX_IN];
    int ranks[MAX_IN];
    int64_t ds[MAX_IN][RF_MAX_RANK];
    for (int k = 0; k < n_in; k++) {
        dts[k] = spec[k].dt;
        ranks[k] = spec[k].rank;
        memcpy(ds[k], spec[k].dims, sizeof ds[k]);
    }
    CHECK_OK(rfi_graph_set_args(g, n_in, dts, ranks, (const int64_t(*)[RF_MAX_RANK])ds));
    rfi_node *in[MAX_IN];
    for (int k = 0; k < n_in; k++) {
        rfi_attrs ai = {0};
        ai.i[0] = k;
        in[k] = rfi_node_new(g, RFI_OP_ARGUMENT, NULL, 0, &ai, dts[k], ds[k], ranks[k]);
    }
    *y = rfi_node_new(g, op, in, n_in, a, dt, dims, rank);
    if (!*y)
        fprintf(stderr, "  %s: %s\n", rfi_op_table[op].name, g->errmsg ? g->errmsg : rf_errmsg());
    CHECK(*y != NULL);
    if (*y)
        CHECK_OK(rfi_graph_add_output(g, *y));
    return g;
}

/* A hand-built plan: arguments in place, y computed by one CALL step into the
 * arena at offset 128 (in_arena) or into output 0. */
typedef struct hand_plan {
    rfi_plan plan;
    rfi_loc *loc;
    rfi_step step;
    int root;
} hand_plan;

static void hand_plan_init(hand_plan *h, const rfi_graph *g, const rfi_node *y, bool in_arena)
{
    memset(h, 0, sizeof *h);
    h->loc = calloc((size_t)g->n_nodes, sizeof *h->loc);
    for (int k = 0; k < g->n_nodes; k++)
        if (g->nodes[k]->op == RFI_OP_ARGUMENT) {
            h->loc[k].kind = RFI_LOC_ARG;
            h->loc[k].index = (int)g->nodes[k]->attr.i[0];
        }
    h->loc[y->id].kind = in_arena ? RFI_LOC_ARENA : RFI_LOC_OUTPUT;
    h->loc[y->id].offset = in_arena ? 128 : 0;
    h->root = y->id;
    h->step.kind = RFI_STEP_CALL;
    h->step.call = y->op == RFI_OP_DOT_GENERAL   ? RFI_CALL_MATMUL
                   : y->op == RFI_OP_CONVOLUTION ? RFI_CALL_CONV
                                                 : RFI_CALL_FALLBACK;
    h->step.roots = &h->root;
    h->step.n_roots = 1;
    h->step.copy_to_output = -1;
    h->step.copy_to_capture = -1;
    h->plan.g = g;
    h->plan.loc = h->loc;
    h->plan.steps = &h->step;
    h->plan.n_steps = 1;
    h->plan.arena_bytes = in_arena ? 128 + rfi_node_nbytes(y) : 0;
}

/* |x| of a float buffer (for the sum-of-|terms| bound). */
static void *abs_copy(const void *p, rf_dtype dt, int64_t n)
{
    void *q = malloc((size_t)(n > 0 ? n : 1) * rf_dtype_size(dt));
    for (int64_t i = 0; i < n; i++) {
        if (dt == RF_F32)
            ((float *)q)[i] = fabsf(((const float *)p)[i]);
        else
            ((double *)q)[i] = fabs(((const double *)p)[i]);
    }
    return q;
}

typedef struct case_result {
    rfi_call_kind kind;
    const char *path; /* rfi_cpu_services_step_path */
    double worst; /* max |got - ref| / sum|terms| */
    bool bitwise;
} case_result;

static int cases_run;

/* A sum of two NaNs is one of them, which one IEEE 754 leaves open: x86
 * keeps its first operand's, and which operand of an addition comes first
 * is the compiler's choice (the reference scatter_add's differs between its
 * f32 and f64 loops). So where scatter_add meets infinities of both signs
 * (their sum is a NaN of its own sign) and NaNs, a NaN result may differ in
 * sign from the reference; every other bit must match. */
static bool same_but_nans(const rfi_node *y, const void *got, const void *ref)
{
    if (!special_inf || y->op != RFI_OP_SCATTER_ADD || (y->dtype != RF_F32 && y->dtype != RF_F64))
        return false;
    int64_t count = rfi_node_numel(y);
    for (int64_t i = 0; i < count; i++) {
        bool f32 = y->dtype == RF_F32;
        double a = f32 ? ((const float *)got)[i] : ((const double *)got)[i];
        double b = f32 ? ((const float *)ref)[i] : ((const double *)ref)[i];
        size_t w = f32 ? 4 : 8;
        if (memcmp((const char *)got + i * w, (const char *)ref + i * w, w) != 0 &&
            !(a != a && b != b))
            return false;
    }
    return true;
}

/* Runs y through the services (step 0) and through the reference kernel;
 * compares as described at the top. */
static case_result run_case(const rfi_graph *g, const rfi_node *y, bool in_arena, const char *name)
{
    case_result res = {RFI_CALL_NONE, "none", 0, true};
    int n_in = y->n_in;
    void *in[MAX_IN] = {0};
    for (int k = 0; k < n_in; k++) {
        int64_t cnt = rfi_node_numel(y->in[k]);
        in[k] = malloc((size_t)(cnt > 0 ? cnt : 1) * rf_dtype_size(y->in[k]->dtype));
        fill(in[k], y->in[k]->dtype, cnt);
    }
    if (y->op == RFI_OP_RNG) { /* the key: {seed, counter} */
        ((int64_t *)in[0])[0] = rng_key[0];
        ((int64_t *)in[0])[1] = rng_key[1];
    }
    size_t nbytes = rfi_node_nbytes(y);
    void *ref = malloc(nbytes + 1), *scale = malloc(nbytes + 1);
    void *arena = malloc(128 + nbytes + 1), *outbuf = malloc(nbytes + 1);
    memset(arena, 0xcd, 128 + nbytes + 1);
    memset(outbuf, 0xcd, nbytes + 1);
    CHECK_OK(rfi_interp_eval_node(y, (const void *const *)in, ref));

    hand_plan h;
    hand_plan_init(&h, g, y, in_arena);
    rfi_cpu_services *s = NULL;
    CHECK_OK(rfi_cpu_services_prepare(&h.plan, &s));
    if (!s) {
        fprintf(stderr, "  case %s: prepare failed\n", name);
        goto done;
    }
    rf_module_services table;
    rfi_cpu_services_table(s, &table);
    CHECK(table.abi == RF_MODULE_ABI);
    res.kind = rfi_cpu_services_step_kind(s, 0);
    res.path = rfi_cpu_services_step_path(s, 0);
    bool native = strncmp(res.path, "native", 6) == 0;
    /* buffers: args, (no captures), output 0, arena, (no consts) */
    void *buffers[MAX_IN + 2];
    for (int k = 0; k < n_in; k++)
        buffers[k] = in[k];
    buffers[n_in] = outbuf;
    buffers[n_in + 1] = arena;
    void *got = in_arena ? (char *)arena + 128 : outbuf;
    CHECK(table.call(table.rt, 0, buffers) == 0); /* first call: OpenMP threads start */
    memset(got, 0xcd, nbytes);
    uint64_t allocs = rfi_alloc_count();
    int rc = table.call(table.rt, 0, buffers);
    if (res.kind != RFI_CALL_FALLBACK || native)
        CHECK(rfi_alloc_count() == allocs); /* library and native paths allocate nothing per call */
    CHECK(rc == 0);
    if (rc != 0)
        fprintf(stderr, "  case %s: %s\n", name, rf_errmsg());
    CHECK(((unsigned char *)got)[nbytes] == 0xcd); /* nothing written past the result */

    bool is_float = y->dtype == RF_F32 || y->dtype == RF_F64;
    bool contraction = y->op == RFI_OP_DOT_GENERAL || y->op == RFI_OP_CONVOLUTION;
    if (res.kind == RFI_CALL_FALLBACK || !is_float || !contraction) {
        res.bitwise = memcmp(got, ref, nbytes) == 0 || same_but_nans(y, got, ref);
        CHECK(res.bitwise);
        if (!res.bitwise)
            fprintf(stderr, "  case %s: not bitwise equal to the reference\n", name);
    } else {
        void *absin[2] = {abs_copy(in[0], y->in[0]->dtype, rfi_node_numel(y->in[0])),
                          abs_copy(in[1], y->in[1]->dtype, rfi_node_numel(y->in[1]))};
        CHECK_OK(rfi_interp_eval_node(y, (const void *const *)absin, scale));
        int64_t count = rfi_node_numel(y);
        for (int64_t i = 0; i < count; i++) {
            double a = y->dtype == RF_F32 ? ((float *)got)[i] : ((double *)got)[i];
            double b = y->dtype == RF_F32 ? ((float *)ref)[i] : ((double *)ref)[i];
            double sc = y->dtype == RF_F32 ? ((float *)scale)[i] : ((double *)scale)[i];
            double err = fabs(a - b) / (sc > 1e-30 ? sc : 1e-30);
            if (!(err <= res.worst)) /* NaN-safe */
                res.worst = err == err ? err : INFINITY;
        }
        CHECK(res.worst <= 1e-5);
        if (!(res.worst <= 1e-5))
            fprintf(stderr, "  case %s: relative error %.3g\n", name, res.worst);
        free(absin[0]);
        free(absin[1]);
    }
    cases_run++;
done:
    rfi_cpu_services_free(s);
    free(h.loc);
    for (int k = 0; k < n_in; k++)
        free(in[k]);
    free(ref);
    free(scale);
    free(arena);
    free(outbuf);
    return res;
}

/* ---- MATMUL ---------------------------------------------------------------------------- */

typedef struct dot_case {
    const char *name;
    int ra, rb;
    int64_t a[RF_MAX_RANK], b[RF_MAX_RANK];
    int nbatch, ncontract;
    int64_t lb[RF_MAX_RANK], rbat[RF_MAX_RANK], lc[RF_MAX_RANK], rc[RF_MAX_RANK];
} dot_case;

static case_result run_dot_at(const dot_case *c, rf_dtype dt, bool in_arena,
                              rf_precision precision)
{
    operand_spec spec[2] = {{dt, c->ra, {0}}, {dt, c->rb, {0}}};
    memcpy(spec[0].dims, c->a, sizeof c->a);
    memcpy(spec[1].dims, c->b, sizeof c->b);
    rfi_attrs at = {0};
    at.i[0] = precision;
    at.nl[0] = at.nl[1] = c->nbatch;
    at.nl[2] = at.nl[3] = c->ncontract;
    for (int k = 0; k < c->nbatch; k++) {
        at.l[0][k] = c->lb[k];
        at.l[1][k] = c->rbat[k];
    }
    for (int k = 0; k < c->ncontract; k++) {
        at.l[2][k] = c->lc[k];
        at.l[3][k] = c->rc[k];
    }
    rfi_node *y = NULL;
    rfi_graph *g = one_op_graph(RFI_OP_DOT_GENERAL, spec, 2, &at, dt, NULL, 0, &y);
    case_result r = {RFI_CALL_NONE, "none", 0, false};
    if (y)
        r = run_case(g, y, in_arena, c->name);
    rfi_graph_free(g);
    return r;
}

static case_result run_dot(const dot_case *c, rf_dtype dt, bool in_arena)
{
    return run_dot_at(c, dt, in_arena, RF_PRECISION_F32);
}

static const dot_case matmul_cases[] = {
        {"plain", 2, 2, {5, 7}, {7, 3}, 0, 1, {0}, {0}, {1}, {0}},
        {"lhs transposed", 2, 2, {7, 5}, {7, 3}, 0, 1, {0}, {0}, {0}, {0}},
        {"rhs transposed", 2, 2, {5, 7}, {3, 7}, 0, 1, {0}, {0}, {1}, {1}},
        {"both transposed", 2, 2, {7, 5}, {3, 7}, 0, 1, {0}, {0}, {0}, {1}},
        {"batch", 3, 3, {4, 5, 7}, {4, 7, 3}, 1, 1, {0}, {0}, {2}, {1}},
        {"batch transposed", 3, 3, {4, 7, 5}, {4, 3, 7}, 1, 1, {0}, {0}, {1}, {2}},
        {"batch in the middle", 3, 3, {5, 4, 7}, {7, 4, 3}, 1, 1, {1}, {1}, {2}, {0}},
        {"batch last", 3, 3, {5, 7, 4}, {7, 3, 4}, 1, 1, {2}, {2}, {1}, {0}},
        {"two batch dims", 4, 4, {2, 3, 5, 6}, {2, 3, 6, 4}, 2, 1, {0, 1}, {0, 1}, {3}, {2}},
        {"swapped batch dims", 4, 4, {2, 3, 5, 6}, {3, 2, 6, 4}, 2, 1, {0, 1}, {1, 0}, {3}, {2}},
        {"vector-matrix", 1, 2, {7}, {7, 3}, 0, 1, {0}, {0}, {0}, {0}},
        {"matrix-vector", 2, 1, {5, 7}, {7}, 0, 1, {0}, {0}, {1}, {0}},
        {"transposed matrix-vector", 2, 1, {7, 5}, {7}, 0, 1, {0}, {0}, {0}, {0}},
        {"dot", 1, 1, {9}, {9}, 0, 1, {0}, {0}, {0}, {0}},
        {"outer", 1, 1, {5}, {3}, 0, 0, {0}, {0}, {0}, {0}},
        {"batched dot", 2, 2, {4, 9}, {4, 9}, 1, 1, {0}, {0}, {1}, {1}},
        {"two contract dims", 3, 3, {5, 3, 4}, {3, 4, 6}, 0, 2, {0}, {0}, {1, 2}, {0, 1}},
        {"contract dims reordered", 3, 3, {5, 3, 4}, {4, 3, 6}, 0, 2, {0}, {0}, {1, 2}, {1, 0}},
        {"two free dims", 3, 3, {2, 5, 7}, {7, 3, 2}, 0, 1, {0}, {0}, {2}, {0}},
        {"interleaved free dims", 3, 3, {2, 7, 5}, {3, 7, 2}, 0, 1, {0}, {0}, {1}, {1}},
        {"unit dims", 3, 3, {1, 5, 7}, {7, 1, 3}, 0, 1, {0}, {0}, {2}, {0}},
        {"mlp forward", 2, 2, {128, 784}, {784, 64}, 0, 1, {0}, {0}, {1}, {0}},
        {"mlp weight grad", 2, 2, {128, 96}, {128, 64}, 0, 1, {0}, {0}, {0}, {0}},
        {"mlp input grad", 2, 2, {128, 64}, {96, 64}, 0, 1, {0}, {0}, {1}, {1}},
        {"empty M", 2, 2, {0, 7}, {7, 3}, 0, 1, {0}, {0}, {1}, {0}},
        {"empty K", 2, 2, {5, 0}, {0, 3}, 0, 1, {0}, {0}, {1}, {0}},
};
enum { N_MATMUL_CASES = sizeof matmul_cases / sizeof matmul_cases[0] };

/* An operand read down its columns (an rhs with N contiguous, a transposed
 * lhs) whose rows lie 2 KB apart, read for 64 or more rows or columns of
 * the other, is copied into padded rows per call where the CPU wants it
 * (dnnl_matmul.c; RF_PAD_ALIASED_ROWS=1 here): plain,
 * batched (rows 4 KB apart), with the other operand transposed (a weight
 * gradient) and both at once; with 8 rows or columns of the other it is
 * read in place. */
static const struct {
    dot_case c;
    const char *path;
} aliased[] = {
    {{"aliased rhs rows", 2, 2, {64, 9}, {9, 512}, 0, 1, {0}, {0}, {1}, {0}},
     "matmul padded rhs"},
    {{"aliased rhs rows, batch", 3, 3, {2, 64, 5}, {2, 5, 1024}, 1, 1, {0}, {0}, {2}, {1}},
     "matmul padded rhs"},
    {{"aliased rhs rows, lhs transposed", 2, 2, {9, 64}, {9, 512}, 0, 1, {0}, {0}, {0}, {0}},
     "matmul padded rhs"},
    {{"aliased rhs rows, few lhs rows", 2, 2, {8, 9}, {9, 512}, 0, 1, {0}, {0}, {1}, {0}},
     "matmul"},
    {{"aliased lhs rows", 2, 2, {9, 512}, {9, 64}, 0, 1, {0}, {0}, {0}, {0}},
     "matmul padded lhs"},
    {{"aliased lhs rows, batch", 3, 3, {2, 5, 1024}, {2, 5, 64}, 1, 1, {0}, {0}, {1}, {1}},
     "matmul padded lhs"},
    {{"aliased lhs rows, rhs transposed", 2, 2, {9, 512}, {64, 9}, 0, 1, {0}, {0}, {0}, {1}},
     "matmul padded lhs"},
    {{"aliased lhs and rhs rows", 2, 2, {9, 512}, {9, 512}, 0, 1, {0}, {0}, {0}, {0}},
     "matmul padded lhs and rhs"},
    {{"aliased lhs rows, few rhs columns", 2, 2, {9, 512}, {9, 8}, 0, 1, {0}, {0}, {0}, {0}},
     "matmul"},
};
enum { N_ALIASED = sizeof aliased / sizeof aliased[0] };

static void test_matmul(void)
{
    const dot_case *cases = matmul_cases;
    int n = N_MATMUL_CASES;
    double worst = 0;
    for (int k = 0; k < n; k++) {
        case_result r = run_dot(&cases[k], RF_F32, k % 2 == 0);
        CHECK(r.kind == RFI_CALL_MATMUL);
        worst = r.worst > worst ? r.worst : worst;
    }
    printf("matmul: %d f32 forms, worst relative error %.3g\n", n, worst);
    /* padded where asked (RF_PAD_ALIASED_ROWS=1), in place where not (=0), and by
     * default only on an AMD CPU (dnnl_matmul.c cpu_pads_aliased_rows) */
#if defined(__x86_64__) && defined(__GNUC__)
    bool pads_here = __builtin_cpu_is("amd");
#else
    bool pads_here = false;
#endif
    for (int mode = 0; mode < 3; mode++) {
        tu_set_env("RF_PAD_ALIASED_ROWS", mode == 0 ? "1" : mode == 1 ? "0" : NULL);
        bool pads = mode == 0 || (mode == 2 && pads_here);
        for (int k = 0; k < N_ALIASED; k++) {
            case_result a = run_dot(&aliased[k].c, RF_F32, k % 2 == 0);
            const char *want = pads ? aliased[k].path : "matmul";
            CHECK(a.kind == RFI_CALL_MATMUL && strcmp(a.path, want) == 0);
            if (strcmp(a.path, want) != 0)
                fprintf(stderr, "  case %s (mode %d): path %s, expected %s\n",
                        aliased[k].c.name, mode, a.path, want);
        }
    }
    tu_set_env("RF_PAD_ALIASED_ROWS", NULL);
    /* Other dtypes run the reference kernel: bitwise. */
    case_result r = run_dot(&cases[4], RF_F64, true);
    CHECK(r.kind == RFI_CALL_FALLBACK && r.bitwise);
    r = run_dot(&cases[1], RF_I32, false);
    CHECK(r.kind == RFI_CALL_FALLBACK && r.bitwise);
}

static bool ends_with(const char *s, const char *end)
{
    size_t n = strlen(s), e = strlen(end);
    return n >= e && strcmp(s + n - e, end) == 0;
}

/* The aliased forms under RF_PRECISION_BF16: an operand converted in its own
 * layout goes into padded rows as an f32 one is copied (a packed form has no
 * rows to pad); returns how many were padded. */
static int check_aliased_bf16(void)
{
    int padded = 0;
    for (int k = 0; k < N_ALIASED; k++) {
        case_result r = run_dot_at(&aliased[k].c, RF_F32, k % 2 == 0, RF_PRECISION_BF16);
        const char *pad = strstr(aliased[k].path, " padded");
        bool packed = strstr(r.path, "packed") != NULL;
        bool ok = packed || (pad ? ends_with(r.path, pad) : !strstr(r.path, "padded"));
        CHECK(r.kind == RFI_CALL_MATMUL && ok);
        if (!ok)
            fprintf(stderr, "  case %s (bf16): path %s\n", aliased[k].c.name, r.path);
        padded += pad && !packed;
    }
    return padded;
}

/* RF_PRECISION_BF16 in every form, against the reference kernel, which rounds
 * the operands too: a call that skipped the rounding would be some 2^-9
 * apart, far above the 1e-5 of run_case. Each form runs with the bf16
 * kernels where this CPU has them, and with RF_BF16_KERNELS=0 (f32 kernels
 * over rounded operands) everywhere; strided views are converted in place,
 * others packed. */
static void test_matmul_bf16(void)
{
    int with_isa = 0, in_place = 0, padded = 0;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1)
            setenv("RF_BF16_KERNELS", "0", 1);
        tu_set_env("RF_PAD_ALIASED_ROWS", "1");
        padded += check_aliased_bf16();
        tu_set_env("RF_PAD_ALIASED_ROWS", NULL);
        for (int k = 0; k < N_MATMUL_CASES; k++) {
            case_result r = run_dot_at(&matmul_cases[k], RF_F32, k % 2 == 0, RF_PRECISION_BF16);
            CHECK(r.kind == RFI_CALL_MATMUL);
            bool empty = strncmp(matmul_cases[k].name, "empty", 5) == 0;
            bool isa = strncmp(r.path, "matmul bf16", 11) == 0 && !strstr(r.path, "rounded");
            bool rounded = strncmp(r.path, "matmul bf16-rounded", 19) == 0;
            CHECK(empty || isa || rounded);
            CHECK(pass == 0 || !isa);
            with_isa += isa;
            in_place += (isa || rounded) && !strstr(r.path, "packed");
            if (!empty && !isa && !rounded)
                fprintf(stderr, "  case %s (bf16): path %s\n", matmul_cases[k].name, r.path);
        }
    }
    unsetenv("RF_BF16_KERNELS");
    CHECK(in_place > 0 && padded > 0);
    printf("matmul bf16: %d forms twice, %d with bf16 instructions, %d converted in place, "
           "%d of the aliased ones into padded rows\n",
           N_MATMUL_CASES, with_isa, in_place, padded);
}

/* ---- CONV ------------------------------------------------------------------------------- */

typedef struct conv_case {
    const char *name;
    int rank;
    int64_t x[RF_MAX_RANK], w[RF_MAX_RANK];
    int64_t stride[3], lo[3], hi[3], lhs_dil[3], rhs_dil[3];
    int64_t fgc, bgc;
} conv_case;

static case_result run_conv_at(const conv_case *c, rf_dtype dt, bool in_arena,
                               rf_precision precision)
{
    operand_spec spec[2] = {{dt, c->rank, {0}}, {dt, c->rank, {0}}};
    memcpy(spec[0].dims, c->x, sizeof c->x);
    memcpy(spec[1].dims, c->w, sizeof c->w);
    int nsp = c->rank - 2;
    rfi_attrs at = {0};
    for (int k = 0; k < 5; k++)
        at.nl[k] = nsp;
    for (int d = 0; d < nsp; d++) {
        at.l[0][d] = c->stride[d] ? c->stride[d] : 1;
        at.l[1][d] = c->lo[d];
        at.l[2][d] = c->hi[d];
        at.l[3][d] = c->lhs_dil[d] ? c->lhs_dil[d] : 1;
        at.l[4][d] = c->rhs_dil[d] ? c->rhs_dil[d] : 1;
    }
    at.i[0] = c->fgc ? c->fgc : 1;
    at.i[1] = c->bgc ? c->bgc : 1;
    at.i[2] = precision;
    rfi_node *y = NULL;
    rfi_graph *g = one_op_graph(RFI_OP_CONVOLUTION, spec, 2, &at, dt, NULL, 0, &y);
    case_result r = {RFI_CALL_NONE, "none", 0, false};
    if (y)
        r = run_case(g, y, in_arena, c->name);
    rfi_graph_free(g);
    return r;
}

static case_result run_conv(const conv_case *c, rf_dtype dt, bool in_arena)
{
    return run_conv_at(c, dt, in_arena, RF_PRECISION_F32);
}

/* The forms every conv test runs. */
static const conv_case conv_cases[] = {
    {"3x3 pad 1", 4, {2, 3, 8, 8}, {4, 3, 3, 3}, {1, 1}, {1, 1}, {1, 1}, {0}, {0}, 1, 1},
    {"no padding", 4, {2, 3, 8, 7}, {4, 3, 3, 2}, {0}, {0}, {0}, {0}, {0}, 1, 1},
    {"stride 2", 4, {2, 3, 9, 9}, {4, 3, 3, 3}, {2, 2}, {1, 1}, {1, 1}, {0}, {0}, 1, 1},
    {"stride 3x2 asymmetric pad", 4, {2, 2, 10, 9}, {3, 2, 3, 2}, {3, 2}, {2, 0}, {0, 3},
     {0}, {0}, 1, 1},
    {"negative pad", 4, {2, 3, 9, 8}, {4, 3, 3, 3}, {1, 1}, {-1, 0}, {0, -2}, {0}, {0}, 1, 1},
    {"lhs dilation 2", 4, {2, 3, 5, 5}, {4, 3, 3, 3}, {1, 1}, {2, 2}, {2, 2}, {2, 2}, {0}, 1,
     1},
    {"lhs dilation + stride", 4, {2, 2, 5, 6}, {3, 2, 3, 2}, {2, 3}, {1, 2}, {0, 1}, {2, 3},
     {0}, 1, 1},
    {"rhs dilation 2", 4, {2, 3, 9, 9}, {4, 3, 3, 3}, {1, 1}, {1, 2}, {1, 0}, {0}, {2, 2}, 1,
     1},
    {"groups 2", 4, {2, 4, 6, 6}, {6, 2, 3, 3}, {1, 1}, {1, 1}, {1, 1}, {0}, {0}, 2, 1},
    {"depthwise", 4, {2, 4, 6, 6}, {8, 1, 3, 3}, {2, 1}, {1, 1}, {1, 1}, {0}, {0}, 4, 1},
    {"batch groups 2", 4, {4, 3, 6, 6}, {6, 3, 3, 3}, {1, 1}, {1, 1}, {1, 1}, {0}, {0}, 1, 2},
    {"1-D", 3, {3, 2, 10}, {4, 2, 3}, {2}, {1}, {2}, {0}, {2}, 1, 1},
    {"1-D lhs dilation", 3, {2, 2, 7}, {3, 2, 3}, {2}, {3}, {-1}, {3}, {2}, 1, 1},
    {"3-D", 5, {1, 2, 4, 5, 6}, {3, 2, 2, 3, 2}, {1, 2, 1}, {0, 1, 1}, {1, 0, -1}, {0}, {0},
     1, 1},
    {"1x1", 4, {3, 5, 4, 4}, {7, 5, 1, 1}, {1, 1}, {0}, {0}, {0}, {0}, 1, 1},
    {"kernel grad form", 4, {1, 8, 28, 28}, {32, 8, 26, 26}, {1, 1}, {0}, {0}, {0}, {0}, 1,
     1},
    {"input grad form", 4, {8, 32, 26, 26}, {1, 32, 3, 3}, {1, 1}, {2, 2}, {2, 2}, {0}, {0},
     1, 1},
    {"all padding", 4, {1, 2, 2, 2}, {2, 2, 2, 2}, {1, 1}, {3, 3}, {3, 3}, {0}, {0}, 1, 1},
    {"chunked batch", 4, {3, 64, 74, 74}, {4, 64, 3, 3}, {1, 1}, {0}, {0}, {0}, {0}, 1, 1},
    {"empty batch", 4, {0, 3, 5, 5}, {4, 3, 3, 3}, {1, 1}, {0}, {0}, {0}, {0}, 1, 1},
    {"empty channels", 4, {2, 0, 5, 5}, {4, 0, 3, 3}, {1, 1}, {0}, {0}, {0}, {0}, 1, 1},
    /* the autodiff's weight-gradient form of a stride-2 conv (rhs dilation 2),
     * of a dilation-2 conv (stride 2), and with enough channels for blocked layouts */
    {"kernel grad of stride 2", 4, {4, 3, 9, 9}, {5, 3, 4, 4}, {1, 1}, {1, 1}, {0, 1}, {0},
     {2, 2}, 1, 1},
    {"kernel grad of dilation 2", 4, {4, 3, 10, 10}, {5, 3, 6, 6}, {2, 2}, {0}, {0}, {0}, {0},
     1, 1},
    {"wide kernel grad", 4, {16, 4, 9, 9}, {8, 4, 7, 7}, {1, 1}, {0}, {0}, {0}, {0}, 1, 1},
    {"wide 3x3", 4, {2, 16, 7, 7}, {8, 16, 3, 3}, {1, 1}, {1, 1}, {1, 1}, {0}, {0}, 1, 1},
    /* the input-gradient form of strided convs: lhs dilation, stride 1 */
    {"input grad of stride 2", 4, {2, 4, 5, 5}, {3, 4, 3, 3}, {1, 1}, {2, 2}, {2, 1}, {2, 2},
     {0}, 1, 1},
    {"input grad of stride 2 dil 2", 4, {2, 4, 5, 5}, {3, 4, 3, 3}, {1, 1}, {4, 4}, {3, 4},
     {2, 2}, {2, 2}, 1, 1},
    {"wide input grad of stride 2", 4, {2, 8, 4, 4}, {16, 8, 3, 3}, {1, 1}, {2, 1}, {2, 1},
     {2, 2}, {0}, 1, 1},
    {"1-D input grad of stride 3", 3, {2, 3, 5}, {2, 3, 4}, {1}, {3}, {3}, {3}, {0}, 1, 1},
    /* both gradients of a 1x1 stride-2 projection on an even size, whose
     * last input row and column the forward never reads */
    {"input grad of 1x1 stride 2", 4, {2, 16, 4, 4}, {8, 16, 1, 1}, {1, 1}, {0, 0}, {1, 1},
     {2, 2}, {0}, 1, 1},
    {"kernel grad of 1x1 stride 2", 4, {8, 2, 8, 8}, {16, 2, 4, 4}, {1, 1}, {0, 0},
     {-1, -1}, {0}, {2, 2}, 1, 1},
    /* the weight-gradient form of grouped convolutions (batch groups): a
     * depthwise 3x3 over 16 channels, 2 groups of 8 -> 16 channels with
     * padding 1, and a depthwise 3x3 of stride 2 (rhs dilation 2) */
    {"depthwise kernel grad", 4, {16, 4, 10, 10}, {16, 4, 8, 8}, {1, 1}, {0}, {0}, {0}, {0},
     1, 16},
    {"grouped kernel grad", 4, {16, 3, 9, 9}, {32, 3, 7, 7}, {1, 1}, {1, 1}, {1, 1}, {0},
     {0}, 1, 2},
    {"depthwise kernel grad of stride 2", 4, {8, 4, 9, 9}, {8, 4, 4, 4}, {1, 1}, {1, 1},
     {0, 0}, {0}, {2, 2}, 1, 8},
    /* the input-gradient form of grouped convolutions (feature groups):
     * stride 2 with 2 groups and depthwise, and the widely padded one of an
     * unpadded depthwise 3x3 */
    {"grouped input grad of stride 2", 4, {2, 8, 5, 5}, {16, 4, 3, 3}, {1, 1}, {2, 2},
     {2, 1}, {2, 2}, {0}, 2, 1},
    {"depthwise input grad of stride 2", 4, {2, 16, 5, 5}, {16, 1, 3, 3}, {1, 1}, {2, 2},
     {2, 1}, {2, 2}, {0}, 16, 1},
    {"depthwise input grad", 4, {2, 16, 6, 6}, {16, 1, 3, 3}, {1, 1}, {2, 2}, {2, 2}, {0},
     {0}, 16, 1},
    /* the weight-gradient form of ConvTranspose layers (lhs dilation: the
     * layer's stride; stride: its dilation; padding k - 1 - the layer's):
     * 4x4 stride 2 pad 1 with few channels and with 16 -> 8, the conv
     * autoencoder's 16 -> 1 at 16x16, 5x5 stride 3 with asymmetric padding
     * (1, 2) and (2, 1), 4x4 stride (2, 1), 3x3 stride 2 dilation 2, 2
     * groups of 16 channels, 1x1 stride 2 whose high padding of -1 (SamePad)
     * leaves the cotangent's last row unread, 1-D stride 3, 3-D stride 2 */
    {"convT kernel grad of stride 2", 4, {3, 2, 5, 5}, {4, 2, 10, 10}, {1, 1}, {2, 2}, {2, 2},
     {2, 2}, {0}, 1, 1},
    {"wide convT kernel grad of stride 2", 4, {16, 4, 6, 6}, {8, 4, 12, 12}, {1, 1}, {2, 2},
     {2, 2}, {2, 2}, {0}, 1, 1},
    {"convT kernel grad to 1 channel", 4, {16, 8, 16, 16}, {1, 8, 32, 32}, {1, 1}, {2, 2},
     {2, 2}, {2, 2}, {0}, 1, 1},
    {"convT kernel grad of stride 3 asymmetric pad", 4, {3, 2, 4, 4}, {2, 2, 11, 11}, {1, 1},
     {3, 2}, {2, 3}, {3, 3}, {0}, 1, 1},
    {"convT kernel grad of stride 2x1", 4, {4, 2, 5, 6}, {3, 2, 10, 8}, {1, 1}, {2, 2}, {2, 2},
     {2, 1}, {0}, 1, 1},
    {"convT kernel grad of dilation 2", 4, {3, 2, 4, 4}, {4, 2, 9, 9}, {2, 2}, {3, 3}, {3, 3},
     {2, 2}, {0}, 1, 1},
    {"grouped convT kernel grad", 4, {32, 2, 5, 5}, {32, 2, 10, 10}, {1, 1}, {2, 2}, {2, 2},
     {2, 2}, {0}, 1, 2},
    {"convT kernel grad of 1x1 stride 2", 4, {3, 2, 4, 4}, {4, 2, 8, 8}, {1, 1}, {0, 0},
     {1, 1}, {2, 2}, {0}, 1, 1},
    {"1-D convT kernel grad of stride 3", 3, {3, 2, 6}, {2, 2, 18}, {1}, {2}, {2}, {3}, {0}, 1,
     1},
    {"3-D convT kernel grad", 5, {2, 2, 3, 3, 3}, {3, 2, 6, 6, 6}, {1, 1, 1}, {2, 2, 2},
     {2, 2, 2}, {2, 2, 2}, {0}, 1, 1},
};
#define N_CONV_CASES ((int)(sizeof conv_cases / sizeof conv_cases[0]))

/* Every form under the path rule (path NULL), then with each path forced
 * through the environment (read at prepare; a form the path cannot compute
 * exactly runs im2col); counts the forms that took the forced path. */
static void test_conv(const char *path)
{
    if (path)
        setenv("RF_CONV_PATH", path, 1);
    const conv_case *cases = conv_cases;
    int n = N_CONV_CASES;
    double worst = 0;
    int took = 0, dnnl = 0;
    for (int k = 0; k < n; k++) {
        case_result r = run_conv(&cases[k], RF_F32, k % 2 == 1);
        CHECK(r.kind == RFI_CALL_CONV);
        if (r.kind != RFI_CALL_CONV)
            fprintf(stderr, "  conv case %s runs as %d\n", cases[k].name, (int)r.kind);
        worst = r.worst > worst ? r.worst : worst;
        took += path && (!strcmp(r.path, path) ||
                         (!strcmp(path, "winograd") && !strncmp(r.path, "winograd ", 9)));
        if (path && strcmp(r.path, path) != 0 && getenv("RF_TEST_VERBOSE"))
            printf("  %s: %s\n", cases[k].name, r.path);
        dnnl += strcmp(r.path, "im2col") != 0;
    }
    printf("conv (%s): %d f32 forms (%d took that path, %d a oneDNN convolution), worst "
           "relative error %.3g\n",
           path ? path : "rule", n, took, dnnl, worst);
    if (path && strcmp(path, "im2col") != 0)
        CHECK(took >= 3); /* each oneDNN path covers several forms */
    if (path && !strcmp(path, "im2col"))
        CHECK(took == n);
    case_result r = run_conv(&cases[2], RF_F64, false);
    CHECK(r.kind == RFI_CALL_FALLBACK && r.bitwise);
    unsetenv("RF_CONV_PATH");
}

/* Every form at RF_PRECISION_BF16, against the reference kernel (which
 * rounds the operands too): with the bf16 kernels allowed ("... bf16": one
 * of oneDNN's bf16 convolutions; "... bf16-rounded": the f32 paths over
 * rounded copies), then with RF_BF16_KERNELS=0 (only the latter). Where the
 * CPU has AVX512-BF16, oneDNN must take some of them. */
static void test_conv_bf16(void)
{
    int with_isa = 0, rounded = 0;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1)
            setenv("RF_BF16_KERNELS", "0", 1);
        for (int k = 0; k < N_CONV_CASES; k++) {
            const conv_case *c = &conv_cases[k];
            case_result r = run_conv_at(c, RF_F32, k % 2 == 1, RF_PRECISION_BF16);
            bool empty = strncmp(c->name, "empty", 5) == 0;
            bool isa = strstr(r.path, " bf16") && !strstr(r.path, "rounded");
            bool round = strstr(r.path, " bf16-rounded") != NULL;
            CHECK(r.kind == RFI_CALL_CONV && (empty || isa || round));
            CHECK(pass == 0 || !isa);
            if (r.kind != RFI_CALL_CONV || !(empty || isa || round))
                fprintf(stderr, "  conv case %s (bf16): path %s\n", c->name, r.path);
            with_isa += isa;
            rounded += round;
        }
    }
    unsetenv("RF_BF16_KERNELS");
    if (__builtin_cpu_supports("avx512bf16"))
        CHECK(with_isa > 0);
    printf("conv bf16: %d forms twice, %d on oneDNN's bf16 convolutions, %d over rounded "
           "copies\n",
           N_CONV_CASES, with_isa, rounded);
}

/* The CPU has what oneDNN's Winograd kernels need (its avx512_core). */
static bool has_avx512_core(void)
{
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

/* The rule's choices that depend on the form: where oneDNN has Winograd
 * kernels (AVX-512 CPUs), its Winograd for 3x3 stride-1 forward and
 * weight-gradient forms with >= 32 channels, backward-data for the widely
 * padded input gradient of an unpadded 3x3, Winograd's where that gradient
 * is whole 4x4 tiles (12x12), each where it has 64 tiles over the batch (32
 * for the weight gradient); elsewhere winograd.c's for all four, at 16
 * channels too (but not at 8); the direct kernels once RF_CONV_WINOGRAD=0.
 * Each result is within the contraction bound of run_case (1e-5 of sum |x||w|). */
static void test_conv_rule_paths(void)
{
    static const conv_case forward = {"wide 3x3 forward", 4, {8, 32, 9, 9}, {48, 32, 3, 3},
                                      {1, 1}, {1, 1}, {1, 1}, {0}, {0}, 1, 1};
    static const conv_case kernel_grad = {"wide 3x3 kernel grad", 4, {32, 4, 11, 11},
                                          {40, 4, 9, 9}, {1, 1}, {0}, {0}, {0}, {0}, 1, 1};
    static const conv_case input_grad = {"unpadded 3x3 input grad", 4, {4, 40, 9, 9},
                                         {32, 40, 3, 3}, {1, 1}, {2, 2}, {2, 2}, {0}, {0}, 1, 1};
    static const conv_case tiled_grad = {"unpadded 3x3 input grad, 12x12", 4, {8, 40, 10, 10},
                                         {32, 40, 3, 3}, {1, 1}, {2, 2}, {2, 2}, {0}, {0}, 1, 1};
    bool avx512 = has_avx512_core();
    case_result t = run_conv(&tiled_grad, RF_F32, false);
    printf("conv rule: %s -> %s (%.3g)\n", tiled_grad.name, t.path, t.worst);
    CHECK(!strcmp(t.path, avx512 ? "bwd-data-winograd" : "winograd 4x4"));
    case_result f = run_conv(&forward, RF_F32, false);
    case_result k = run_conv(&kernel_grad, RF_F32, true);
    case_result d = run_conv(&input_grad, RF_F32, false);
    printf("conv rule: %s -> %s (%.3g), %s -> %s (%.3g), %s -> %s (%.3g)\n", forward.name, f.path,
           f.worst, kernel_grad.name, k.path, k.worst, input_grad.name, d.path, d.worst);
    CHECK(!strcmp(f.path, avx512 ? "forward-winograd" : "winograd 4x4"));
    CHECK(!strcmp(k.path, avx512 ? "bwd-weights-winograd" : "winograd 3x3"));
    CHECK(!strcmp(d.path, avx512 ? "bwd-data" : "winograd 4x4"));
    /* 16 channels: winograd.c's below AVX-512 (oneDNN's Winograd wants 32); 8: direct */
    static const conv_case narrow[2][2] = {
        {{"16 channels 3x3", 4, {4, 16, 9, 9}, {16, 16, 3, 3}, {1, 1}, {1, 1}, {1, 1}, {0}, {0},
          1, 1},
         {"16 channels kernel grad", 4, {16, 4, 11, 11}, {16, 4, 9, 9}, {1, 1}, {0}, {0}, {0},
          {0}, 1, 1}},
        {{"8 channels 3x3", 4, {4, 8, 9, 9}, {8, 8, 3, 3}, {1, 1}, {1, 1}, {1, 1}, {0}, {0}, 1,
          1},
         {"8 channels kernel grad", 4, {8, 4, 11, 11}, {8, 4, 9, 9}, {1, 1}, {0}, {0}, {0}, {0},
          1, 1}}};
    for (int c = 0; c < 2; c++) {
        bool own = c == 0 && !avx512;
        f = run_conv(&narrow[c][0], RF_F32, false);
        k = run_conv(&narrow[c][1], RF_F32, true);
        printf("conv rule: %s -> %s (%.3g), %s -> %s (%.3g)\n", narrow[c][0].name, f.path,
               f.worst, narrow[c][1].name, k.path, k.worst);
        CHECK(own ? !strcmp(f.path, "winograd 4x4") : !strstr(f.path, "winograd"));
        CHECK(own ? !strcmp(k.path, "winograd 3x3") : !strcmp(k.path, "bwd-weights"));
    }
    /* winograd.c's first form only where its tiles fill, oneDNN's only where there are
     * enough: a ResNet's last stage at batch 1 (a 2x2 result, one tile), or batch 8 of 4x4
     * (8 tiles in all), runs direct; batch 8 of 9x9 (72 tiles, 56% filled) above stays on
     * Winograd */
    static const conv_case tiny = {"batch 1 of 2x2, 64 channels", 4, {1, 64, 2, 2},
                                   {64, 64, 3, 3}, {1, 1}, {1, 1}, {1, 1}, {0}, {0}, 1, 1};
    static const conv_case few = {"batch 8 of 4x4, 64 channels", 4, {8, 64, 4, 4},
                                  {64, 64, 3, 3}, {1, 1}, {1, 1}, {1, 1}, {0}, {0}, 1, 1};
    case_result ty = run_conv(&tiny, RF_F32, false), fw = run_conv(&few, RF_F32, false);
    printf("conv rule: %s -> %s, %s -> %s\n", tiny.name, ty.path, few.name, fw.path);
    CHECK(!strstr(ty.path, "winograd") && !strstr(fw.path, "winograd"));
    setenv("RF_CONV_WINOGRAD", "1", 1); /* the forced rule takes any */
    ty = run_conv(&tiny, RF_F32, false);
    CHECK(avx512 || !strcmp(ty.path, "winograd 4x4"));
    setenv("RF_CONV_WINOGRAD", "0", 1);
    f = run_conv(&forward, RF_F32, false);
    k = run_conv(&kernel_grad, RF_F32, false);
    t = run_conv(&tiled_grad, RF_F32, false);
    unsetenv("RF_CONV_WINOGRAD");
    CHECK(!strcmp(f.path, "forward"));
    CHECK(!strcmp(k.path, "bwd-weights"));
    CHECK(!strcmp(t.path, "bwd-data"));
}

/* Grouped convolutions' gradients under the rule: the weight gradient (the
 * batch-grouped form the autodiff emits) runs oneDNN's grouped
 * backward-weights where oneDNN has a jit kernel for it (im2col where only
 * its gemm one: the stride-2 depthwise form here, see conv.c's create_pd),
 * and a strided or widely padded input gradient (feature groups, lhs
 * dilation) its grouped backward-data, not im2col; each within run_case's
 * contraction bound. */
static void test_conv_grouped_paths(void)
{
    static const char *const want[][2] = {
        {"depthwise kernel grad", "bwd-weights"},
        {"grouped kernel grad", "bwd-weights"},
        {"depthwise kernel grad of stride 2", "im2col"},
        {"grouped input grad of stride 2", "bwd-data"},
        {"depthwise input grad of stride 2", "bwd-data"},
        {"depthwise input grad", "bwd-data"},
    };
    int n = (int)(sizeof want / sizeof want[0]), found = 0;
    for (int k = 0; k < N_CONV_CASES; k++)
        for (int i = 0; i < n; i++) {
            if (strcmp(conv_cases[k].name, want[i][0]) != 0)
                continue;
            case_result r = run_conv(&conv_cases[k], RF_F32, k % 2 == 1);
            printf("conv grouped: %s -> %s (%.3g)\n", want[i][0], r.path, r.worst);
            CHECK(r.kind == RFI_CALL_CONV && !strcmp(r.path, want[i][1]));
            found++;
        }
    CHECK(found == n);
}

/* ConvTranspose layers' weight gradients (an lhs-dilated form with an
 * image-sized kernel, the cotangent) under the rule: oneDNN's
 * backward-weights with the roles of the operands swapped and the result
 * reversed after the call (conv.c's spec_bwd_weights_swapped), grouped too,
 * at bf16 as well (over rounded copies; where the CPU has bf16 instructions,
 * oneDNN's bf16 kernel or, failing that, whichever of its bf16 convolutions
 * the rule reaches next), each within run_case's contraction bound.
 * Backward-data had taken them, as the input gradient the form resembles,
 * at up to 15 ms for the autoencoder's. */
static void test_conv_transposed_paths(void)
{
    int found = 0;
    for (int k = 0; k < N_CONV_CASES; k++) {
        const conv_case *c = &conv_cases[k];
        if (!strstr(c->name, "convT kernel grad"))
            continue;
        case_result r = run_conv(c, RF_F32, k % 2 == 1);
        case_result b = run_conv_at(c, RF_F32, k % 2 == 0, RF_PRECISION_BF16);
        printf("conv transposed: %s -> %s (%.3g), bf16 %s (%.3g)\n", c->name, r.path, r.worst,
               b.path, b.worst);
        CHECK(r.kind == RFI_CALL_CONV && !strcmp(r.path, "bwd-weights"));
        CHECK(b.kind == RFI_CALL_CONV &&
              (!strncmp(b.path, "bwd-weights bf16", 16) ||
               (__builtin_cpu_supports("avx512bf16") && strstr(b.path, " bf16"))));
        found++;
    }
    CHECK(found == 10);
}

/* RF_CONV_WINOGRAD=1: Winograd wherever oneDNN takes it (AVX-512), else
 * winograd.c's wherever its forms fit, below the channel threshold too (the
 * 16-channel forms here, and winograd.c's the 3-channel one); every form
 * stays exact to the contraction bound (run_case) whichever kernel runs it. */
static void test_conv_winograd_everywhere(void)
{
    static const conv_case cases[] = {
        {"16 channels 3x3", 4, {2, 16, 8, 8}, {16, 16, 3, 3}, {1, 1}, {1, 1}, {1, 1}, {0}, {0}, 1,
         1},
        {"16 channels kernel grad", 4, {16, 2, 10, 10}, {16, 2, 8, 8}, {1, 1}, {0}, {0}, {0}, {0},
         1, 1},
        {"3 channels 3x3", 4, {2, 3, 8, 8}, {4, 3, 3, 3}, {1, 1}, {1, 1}, {1, 1}, {0}, {0}, 1, 1},
        {"5x5", 4, {2, 16, 9, 9}, {16, 16, 5, 5}, {1, 1}, {2, 2}, {2, 2}, {0}, {0}, 1, 1},
    };
    setenv("RF_CONV_WINOGRAD", "1", 1);
    int wino = 0, n = (int)(sizeof cases / sizeof cases[0]);
    double worst = 0;
    for (int i = 0; i < n; i++) {
        case_result r = run_conv(&cases[i], RF_F32, false);
        wino += strstr(r.path, "winograd") != NULL;
        worst = r.worst > worst ? r.worst : worst;
    }
    unsetenv("RF_CONV_WINOGRAD");
    printf("conv RF_CONV_WINOGRAD=1: %d of %d forms on Winograd, worst relative error %.3g\n",
           wino, n, worst);
    if (has_avx512_core())
        CHECK(wino >= 2); /* the two 16-channel forms */
    else
        CHECK(wino == 3); /* the 3x3 kernels and the kernel gradient, not the 5x5 */
}

/* RF_CONV_PATH=winograd: winograd.c's convolution on any channel counts,
 * both forms (the result or the kernel in tiles), each against the
 * reference kernel within run_case's contraction bound: channel counts that
 * are not a multiple of the vector's 8, asymmetric and negative padding,
 * partial tiles, a row of more tiles than a band holds, chunks of images
 * with a shorter last one, a result smaller than a tile, a weight gradient
 * whose channels go to several products added up; then at bf16 over
 * rounded copies. */
static void test_conv_own_winograd(void)
{
    static const conv_case cases[] = {
        {"3x3 odd channels", 4, {3, 13, 7, 10}, {11, 13, 3, 3}, {1, 1}, {1, 0}, {0, 2}, {0},
         {0}, 1, 1},
        {"3x3 input grad", 4, {2, 40, 10, 10}, {24, 40, 3, 3}, {1, 1}, {2, 2}, {2, 2}, {0}, {0},
         1, 1},
        /* 27 tiles: the fused form's last six-tile item holds 3 */
        {"3x3 trimmed", 4, {3, 16, 13, 13}, {16, 16, 3, 3}, {1, 1}, {0, -1}, {-1, 0}, {0}, {0},
         1, 1},
        {"3x3 wide rows", 4, {1, 8, 5, 70}, {8, 8, 3, 3}, {1, 1}, {1, 1}, {1, 1}, {0}, {0}, 1, 1},
        {"3x3 many tiles", 4, {5, 32, 48, 48}, {32, 32, 3, 3}, {1, 1}, {1, 1}, {1, 1}, {0}, {0},
         1, 1},
        {"3x3 to 1x1", 4, {1, 8, 3, 3}, {9, 8, 3, 3}, {1, 1}, {0}, {0}, {0}, {0}, 1, 1},
        {"kernel grad padded", 4, {12, 6, 8, 8}, {20, 6, 8, 8}, {1, 1}, {1, 1}, {1, 1}, {0},
         {0}, 1, 1},
        {"kernel grad odd", 4, {5, 3, 17, 14}, {7, 3, 15, 12}, {1, 1}, {0}, {0}, {0}, {0}, 1,
         1},
        /* 20 images in three blocks of 8, each its own product, added up */
        {"kernel grad chunked", 4, {64, 20, 12, 12}, {64, 20, 10, 10}, {1, 1}, {0}, {0}, {0},
         {0}, 1, 1},
        /* beyond the fused form's 64 input channels: V and the products in the
         * workspace, 16 images in chunks of 13 and 3 */
        {"3x3 unfused", 4, {16, 72, 20, 20}, {16, 72, 3, 3}, {1, 1}, {1, 1}, {1, 1}, {0}, {0},
         1, 1},
    };
    int n = (int)(sizeof cases / sizeof cases[0]), took = 0;
    double worst = 0;
    setenv("RF_CONV_PATH", "winograd", 1);
    for (int i = 0; i < n; i++) {
        case_result r = run_conv(&cases[i], RF_F32, i % 2 == 1);
        bool tiles3 = cases[i].w[2] != 3;
        CHECK(!strcmp(r.path, tiles3 ? "winograd 3x3" : "winograd 4x4"));
        if (strncmp(r.path, "winograd", 8) != 0)
            fprintf(stderr, "  conv case %s: path %s\n", cases[i].name, r.path);
        took += strncmp(r.path, "winograd", 8) == 0;
        worst = r.worst > worst ? r.worst : worst;
    }
    setenv("RF_BF16_KERNELS", "0", 1);
    case_result b = run_conv_at(&cases[0], RF_F32, false, RF_PRECISION_BF16);
    case_result k = run_conv_at(&cases[6], RF_F32, false, RF_PRECISION_BF16);
    CHECK(!strcmp(b.path, "winograd 4x4 bf16-rounded"));
    CHECK(!strcmp(k.path, "winograd 3x3 bf16-rounded"));
    unsetenv("RF_BF16_KERNELS");
    /* a form neither tiling computes (stride 2) takes the default path */
    case_result other = run_conv(&conv_cases[2], RF_F32, false);
    CHECK(strncmp(other.path, "winograd", 8) != 0);
    unsetenv("RF_CONV_PATH");
    printf("conv winograd.c: %d of %d forms, worst relative error %.3g (bf16: %.3g, %.3g)\n",
           took, n, worst, b.worst, k.worst);
}

/* ---- Native FALLBACK kernels (pool.c) ------------------------------------------------------ */

typedef struct window_case {
    const char *name;
    int rank;
    int64_t x[RF_MAX_RANK], win[RF_MAX_RANK], stride[RF_MAX_RANK], lo[RF_MAX_RANK],
        hi[RF_MAX_RANK];
    const char *path;
} window_case;

/* select_and_scatter(x, source) with the source shape the window rule gives. */
static void run_scatter(const window_case *c, rf_dtype dt)
{
    operand_spec spec[2] = {{dt, c->rank, {0}}, {dt, c->rank, {0}}};
    memcpy(spec[0].dims, c->x, sizeof c->x);
    rfi_attrs at = {0};
    for (int k = 0; k < 4; k++)
        at.nl[k] = c->rank;
    for (int d = 0; d < c->rank; d++) {
        at.l[0][d] = c->win[d];
        at.l[1][d] = c->stride[d];
        at.l[2][d] = c->lo[d];
        at.l[3][d] = c->hi[d];
        int64_t span = c->x[d] + c->lo[d] + c->hi[d] - c->win[d];
        spec[1].dims[d] = span < 0 ? 0 : span / c->stride[d] + 1;
    }
    rfi_node *y = NULL;
    rfi_graph *g = one_op_graph(RFI_OP_SELECT_AND_SCATTER, spec, 2, &at, dt, c->x, c->rank, &y);
    if (y) {
        case_result r = run_case(g, y, dt == RF_F64, c->name);
        CHECK(r.kind == RFI_CALL_FALLBACK && r.bitwise && !strcmp(r.path, c->path));
        if (strcmp(r.path, c->path) != 0)
            fprintf(stderr, "  case %s runs %s, expected %s\n", c->name, r.path, c->path);
    }
    rfi_graph_free(g);
}

static void run_arg(rfi_op op, rf_dtype dt, rf_dtype out, int rank, const int64_t *dims,
                    int axis, const char *name)
{
    operand_spec spec[1] = {{dt, rank, {0}}};
    memcpy(spec[0].dims, dims, (size_t)rank * sizeof(int64_t));
    rfi_attrs at = {0};
    at.i[0] = axis;
    rfi_node *y = NULL;
    rfi_graph *g = one_op_graph(op, spec, 1, &at, out, NULL, 0, &y);
    if (y) {
        case_result r = run_case(g, y, axis % 2 == 0, name);
        CHECK(r.kind == RFI_CALL_FALLBACK && r.bitwise && !strcmp(r.path, "native-arg"));
    }
    rfi_graph_free(g);
}

/* Native kernels against the reference bitwise, on random data and on data
 * full of ties, signed zeros and NaNs (first max, NaN ranks highest). */
static void test_native(void)
{
    static const window_case cases[] = {
        {"pool 2x2", 4, {3, 4, 8, 6}, {1, 1, 2, 2}, {1, 1, 2, 2}, {0}, {0},
         "native-scatter-fast"},
        {"pool 2x2 odd sizes", 4, {2, 3, 7, 5}, {1, 1, 2, 2}, {1, 1, 2, 2}, {0}, {0},
         "native-scatter-fast"},
        {"pool 3x2 stride 3x2", 4, {2, 2, 9, 8}, {1, 1, 3, 2}, {1, 1, 3, 2}, {0}, {0},
         "native-scatter-fast"},
        {"1-D pool", 3, {2, 3, 11}, {1, 1, 3}, {1, 1, 3}, {0}, {0}, "native-scatter-fast"},
        {"overlapping 3x3 stride 2 pad 1", 4, {2, 3, 9, 8}, {1, 1, 3, 3}, {1, 1, 2, 2},
         {0, 0, 1, 1}, {0, 0, 1, 0}, "native-scatter-gather"},
        {"stride 1 windows", 4, {2, 2, 6, 6}, {1, 1, 2, 3}, {1, 1, 1, 1}, {0}, {0},
         "native-scatter-gather"},
        {"window over the batch", 4, {4, 2, 5, 5}, {2, 1, 2, 2}, {2, 1, 2, 2}, {0}, {0},
         "native-scatter-fast"},
        {"padding only windows", 3, {2, 2, 3}, {1, 1, 2}, {1, 1, 2}, {0, 0, 3}, {0, 0, 2},
         "native-scatter-gather"},
        {"pad hi pooling", 4, {2, 3, 7, 7}, {1, 1, 2, 2}, {1, 1, 2, 2}, {0}, {0, 0, 1, 1},
         "native-scatter-gather"},
        {"3-D overlapping windows", 5, {2, 2, 4, 5, 5}, {1, 1, 2, 3, 3}, {1, 1, 1, 2, 2},
         {0, 0, 0, 1, 1}, {0, 0, 0, 1, 1}, "native-scatter"},
        {"big planes", 4, {8, 16, 26, 26}, {1, 1, 2, 2}, {1, 1, 2, 2}, {0}, {0},
         "native-scatter-fast"},
    };
    int n = (int)(sizeof cases / sizeof cases[0]);
    for (int pass = 0; pass < 2; pass++) {
        special_values = pass == 1;
        for (int k = 0; k < n; k++) {
            run_scatter(&cases[k], RF_F32);
            run_scatter(&cases[k], RF_F64);
        }
        run_arg(RFI_OP_ARGMAX, RF_F32, RF_I64, 2, (int64_t[]){64, 10}, 1, "argmax rows");
        run_arg(RFI_OP_ARGMAX, RF_F32, RF_I32, 3, (int64_t[]){7, 4, 3}, 0, "argmax axis 0");
        run_arg(RFI_OP_ARGMIN, RF_F32, RF_I64, 3, (int64_t[]){5, 6, 4}, 1, "argmin middle");
        run_arg(RFI_OP_ARGMAX, RF_F64, RF_I64, 2, (int64_t[]){9, 2}, 1, "argmax f64 pairs");
        run_arg(RFI_OP_ARGMIN, RF_F64, RF_I32, 2, (int64_t[]){2, 3}, 1, "argmin f64");
        run_arg(RFI_OP_ARGMAX, RF_F32, RF_I64, 2, (int64_t[]){3, 0}, 0, "argmax empty rows");
        run_arg(RFI_OP_ARGMAX, RF_F32, RF_I64, 2, (int64_t[]){3000, 40}, 1, "argmax parallel");
    }
    special_values = false;
    printf("native: select_and_scatter %d forms and argmax/argmin 7 forms x f32/f64 x random/"
           "special values, bitwise\n",
           n);
}

/* ---- Native GATHER / SCATTER_ADD (index_native.c) ------------------------------------------ */

typedef struct index_case {
    const char *name;
    int rank, idx_rank, axis;
    int64_t x[RF_MAX_RANK], idx[RF_MAX_RANK];
    int64_t lo, hi; /* indices drawn from [lo, hi) */
} index_case;

/* gather(x, indices) or scatter_add(x, indices, updates) of case c. */
static void run_index(const index_case *c, rfi_op op, rf_dtype dt, rf_dtype idx_dt)
{
    operand_spec spec[3] = {{dt, c->rank, {0}}, {idx_dt, c->idx_rank, {0}}, {dt, 0, {0}}};
    memcpy(spec[0].dims, c->x, sizeof c->x);
    memcpy(spec[1].dims, c->idx, sizeof c->idx);
    for (int d = 0; d < c->rank; d++) /* updates: x[:axis] + indices + x[axis+1:] */
        if (d != c->axis)
            spec[2].dims[spec[2].rank++] = c->x[d];
        else
            for (int e = 0; e < c->idx_rank; e++)
                spec[2].dims[spec[2].rank++] = c->idx[e];
    rfi_attrs at = {0};
    at.i[0] = c->axis;
    bool scatter = op == RFI_OP_SCATTER_ADD;
    rfi_node *y = NULL;
    rfi_graph *g = one_op_graph(op, spec, scatter ? 3 : 2, &at, dt,
                                scatter ? c->x : spec[2].dims, scatter ? c->rank : spec[2].rank,
                                &y);
    index_lo = c->lo;
    index_hi = c->hi;
    if (y) {
        const char *want = scatter ? "native-scatter-add" : "native-gather";
        case_result r = run_case(g, y, dt == RF_F64, c->name);
        CHECK(r.kind == RFI_CALL_FALLBACK && r.bitwise && !strcmp(r.path, want));
        if (strcmp(r.path, want) != 0)
            fprintf(stderr, "  case %s runs %s, expected %s\n", c->name, r.path, want);
    }
    index_lo = index_hi = 0;
    rfi_graph_free(g);
}

/* Gather and scatter_add against the reference bitwise: f32/f64 values,
 * i32/i64 indices, on random data and on data full of signed zeros, NaNs
 * and infinities; duplicate and out-of-range indices, empty index lists and
 * axes, rows longer than a kernel's piece, and sizes that run in parallel. */
static void test_native_index(void)
{
    static const index_case cases[] = {
        {"rows", 2, 2, 0, {50, 8}, {3, 7}, 0, 50},
        {"middle axis", 3, 1, 1, {3, 10, 5}, {12}, 0, 10},
        {"last axis", 2, 1, 1, {4, 7}, {5}, 0, 7},
        {"duplicates", 2, 1, 0, {6, 9}, {200}, 2, 4},
        {"out of range", 3, 2, 1, {5, 3, 4}, {4, 5}, -4, 8},
        {"scalar index", 2, 0, 0, {5, 3}, {0}, 0, 5},
        {"empty index list", 2, 1, 0, {4, 6}, {0}, 0, 4},
        {"empty axis", 2, 1, 0, {0, 5}, {0}, 0, 1},
        {"empty rows", 3, 1, 1, {3, 4, 0}, {6}, 0, 4},
        {"long rows", 2, 1, 0, {6, 600}, {10}, 0, 6},
        {"embedding parallel", 2, 2, 0, {4000, 32}, {64, 32}, 0, 4000},
        {"many duplicates parallel", 2, 1, 0, {300, 64}, {4096}, 0, 300},
        {"middle axis parallel", 3, 1, 1, {40, 50, 24}, {300}, -2, 52},
    };
    int n = (int)(sizeof cases / sizeof cases[0]);
    for (int pass = 0; pass < 3; pass++) {
        special_values = pass > 0;
        special_inf = pass == 2;
        for (int k = 0; k < n; k++)
            for (int t = 0; t < 4; t++) {
                rf_dtype dt = t % 2 ? RF_F64 : RF_F32, idx_dt = t / 2 ? RF_I64 : RF_I32;
                run_index(&cases[k], RFI_OP_GATHER, dt, idx_dt);
                run_index(&cases[k], RFI_OP_SCATTER_ADD, dt, idx_dt);
            }
    }
    special_values = special_inf = false;
    printf("native: gather and scatter_add %d forms x f32/f64 x i32/i64 x random/special/"
           "infinite values, bitwise\n",
           n);
}

/* ---- Native RNG (rng_native.c) ------------------------------------------------------------ */

/* Element i of a uniform f32 or normal f64 draw, as the reference defines it
 * (core/philox.c), for element indices the reference cannot reach in a test. */
static double rng_element(bool f64, bool normal, uint64_t seed, uint64_t counter, uint32_t stream,
                          uint64_t i)
{
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    const uint32_t ctr[4] = {(uint32_t)i, (uint32_t)(i >> 32), (uint32_t)counter,
                             (uint32_t)(counter >> 32) ^ (stream << 16)};
    uint32_t w[4];
    rfi_philox4x32(ctr, key, w);
    if (!f64)
        return (double)(w[0] >> 8) * (1.0 / 16777216.0);
    double u1 = (double)(((uint64_t)w[0] << 32 | w[1]) >> 11) * (1.0 / 9007199254740992.0);
    double u2 = (double)(((uint64_t)w[2] << 32 | w[3]) >> 11) * (1.0 / 9007199254740992.0);
    return normal ? sqrt(-2.0 * log(1.0 - u1)) * cos(6.283185307179586476925 * u2) : u1;
}

/* The draws of RNG nodes against the reference bitwise: f32/f64, uniform and
 * normal, lengths around the kernel's 8-element vectors and 64-element
 * batches and ones split over the pool, keys with high bits set, streams;
 * then elements whose index crosses 2^32 (the vectors carry into the
 * counter's second word) against the definition. */
static void test_native_rng(void)
{
    static const int64_t lengths[] = {1, 7, 8, 9, 63, 64, 65, 1000, 100003};
    static const int64_t keys[][2] = {
        {42, 7}, {-1, INT64_MIN + 12345}, {0x123456789abcLL, 1LL << 40}};
    static const int64_t streams[] = {0, 3, 0xffff};
    int n_len = (int)(sizeof lengths / sizeof lengths[0]), cases = 0;
    for (int kk = 0; kk < 3; kk++)
        for (int li = 0; li < n_len; li++)
            for (int t = 0; t < 4; t++) {
                rf_dtype dt = t % 2 ? RF_F64 : RF_F32;
                operand_spec spec[1] = {{RF_I64, 1, {2}}};
                rfi_attrs at = {0};
                at.i[0] = t / 2;                     /* uniform, normal */
                at.i[1] = streams[(li + kk + t) % 3];
                rng_key[0] = keys[kk][0];
                rng_key[1] = keys[kk][1];
                rfi_node *y = NULL;
                rfi_graph *g =
                    one_op_graph(RFI_OP_RNG, spec, 1, &at, dt, RF_SHAPE(lengths[li]), &y);
                if (y) {
                    case_result r = run_case(g, y, li % 2 == 0, "rng");
                    CHECK(r.kind == RFI_CALL_FALLBACK && r.bitwise &&
                          !strcmp(r.path, "native-rng"));
                    cases++;
                }
                rfi_graph_free(g);
            }
    rng_key[0] = 42;
    rng_key[1] = 7;

    /* indices 2^32 - 37 .. 2^32 + 36: vectors whose lanes wrap, through rfi_cpu_rng_fill */
    int wraps = 0;
    for (int t = 0; t < 2; t++) {
        bool f64 = t == 1;
        operand_spec spec[1] = {{RF_I64, 1, {2}}};
        rfi_attrs at = {0};
        at.i[0] = f64; /* uniform f32, normal f64 */
        at.i[1] = 5;
        rfi_node *y = NULL;
        rfi_graph *g = one_op_graph(RFI_OP_RNG, spec, 1, &at, f64 ? RF_F64 : RF_F32, RF_SHAPE(4),
                                    &y);
        rfi_cpu_rng *k = NULL;
        CHECK(y && rfi_cpu_rng_prepare(y, &k) == RF_OK && k);
        if (k) {
            enum { SPAN = 73 };
            const int64_t first = (1LL << 32) - 37;
            double got[SPAN];
            float got_f[SPAN];
            rfi_cpu_rng_fill(k, 99, 1234, first, SPAN, f64 ? (void *)got : (void *)got_f);
            for (int j = 0; j < SPAN; j++) {
                double want = rng_element(f64, f64, 99, 1234, 5, (uint64_t)(first + j));
                double have = f64 ? got[j] : (double)got_f[j];
                wraps += have == (f64 ? want : (double)(float)want);
            }
        }
        rfi_cpu_rng_free(k);
        rfi_graph_free(g);
    }
    CHECK(wraps == 2 * 73);
    printf("native: rng %d draws (f32/f64 x uniform/normal x %d lengths x 3 keys) bitwise, "
           "%d elements across index 2^32 as defined\n",
           cases, n_len, wraps);
}

/* ---- FALLBACK ---------------------------------------------------------------------------- */

static void test_fallback(void)
{
    rfi_node *y = NULL;
    /* gather rows of a matrix */
    operand_spec gs[2] = {{RF_F32, 2, {6, 4}}, {RF_I32, 1, {5}}};
    rfi_attrs ga = {0};
    rfi_graph *g = one_op_graph(RFI_OP_GATHER, gs, 2, &ga, RF_F32, NULL, 0, &y);
    if (y)
        CHECK(run_case(g, y, true, "gather").kind == RFI_CALL_FALLBACK);
    rfi_graph_free(g);
    /* argmax over axis 1 */
    operand_spec as[1] = {{RF_F32, 2, {5, 9}}};
    rfi_attrs aa = {0};
    aa.i[0] = 1;
    g = one_op_graph(RFI_OP_ARGMAX, as, 1, &aa, RF_I64, NULL, 0, &y);
    if (y)
        CHECK(run_case(g, y, false, "argmax").kind == RFI_CALL_FALLBACK);
    rfi_graph_free(g);
    /* rng normal */
    operand_spec rs[1] = {{RF_I64, 1, {2}}};
    rfi_attrs ra = {0};
    ra.i[0] = 1;
    g = one_op_graph(RFI_OP_RNG, rs, 1, &ra, RF_F32, RF_SHAPE(1000), &y);
    if (y)
        CHECK(run_case(g, y, true, "rng").kind == RFI_CALL_FALLBACK);
    rfi_graph_free(g);
    /* a reduce */
    rfi_attrs sa = {0};
    sa.i[0] = RF_REDUCE_SUM;
    sa.nl[0] = 1;
    sa.l[0][0] = 0;
    g = one_op_graph(RFI_OP_REDUCE, as, 1, &sa, RF_F32, NULL, 0, &y);
    if (y)
        CHECK(run_case(g, y, false, "reduce").kind == RFI_CALL_FALLBACK);
    rfi_graph_free(g);
    printf("fallback: gather, argmax, rng, reduce bitwise\n");
}

/* A step that is not a CALL step and a call out of range fail with a message. */
static void test_bad_calls(void)
{
    rfi_node *y = NULL;
    operand_spec as[1] = {{RF_F32, 2, {5, 9}}};
    rfi_attrs aa = {0};
    aa.i[0] = 1;
    rfi_graph *g = one_op_graph(RFI_OP_ARGMAX, as, 1, &aa, RF_I64, NULL, 0, &y);
    if (!y) {
        rfi_graph_free(g);
        return;
    }
    hand_plan h;
    hand_plan_init(&h, g, y, false);
    h.step.kind = RFI_STEP_LOOP;
    rfi_cpu_services *s = NULL;
    CHECK_OK(rfi_cpu_services_prepare(&h.plan, &s));
    void *buffers[3] = {NULL, NULL, NULL};
    CHECK(rfi_cpu_services_call(s, 0, buffers) != 0);
    CHECK_MSG("not a call step");
    CHECK(rfi_cpu_services_call(s, 5, buffers) != 0);
    rfi_cpu_services_free(s);
    /* an operand without a buffer */
    h.step.kind = RFI_STEP_CALL;
    h.loc[y->in[0]->id].kind = RFI_LOC_INLINE;
    CHECK_STATUS(rfi_cpu_services_prepare(&h.plan, &s), RF_E_INTERNAL);
    CHECK_MSG("has no buffer");
    CHECK(s == NULL);
    free(h.loc);
    rfi_graph_free(g);
}

/* ---- Thread pool ---------------------------------------------------------------------- */

typedef struct sum_job {
    const int32_t *data;
    uint8_t *visits;
    atomic_llong sum;
    atomic_int chunks;
    atomic_llong min_chunk;
} sum_job;

static void sum_body(void *ctx, int64_t lo, int64_t hi)
{
    sum_job *j = ctx;
    int64_t s = 0;
    for (int64_t i = lo; i < hi; i++) {
        s += j->data[i];
        j->visits[i]++;
    }
    atomic_fetch_add(&j->sum, s);
    atomic_fetch_add(&j->chunks, 1);
    long long len = hi - lo, cur = atomic_load(&j->min_chunk);
    while (len < cur && !atomic_compare_exchange_weak(&j->min_chunk, &cur, len)) {
    }
}

static void test_pool_sum(void)
{
    enum { N = 10 * 1000 * 1000 };
    int32_t *data = malloc(N * sizeof *data);
    uint8_t *visits = calloc(N, 1);
    int64_t serial = 0;
    for (int64_t i = 0; i < N; i++) {
        data[i] = (int32_t)((i * 2654435761u) % 2001) - 1000;
        serial += data[i];
    }
    sum_job j = {data, visits, 0, 0, INT64_MAX};
    rfi_parallel_for(N, 1000, sum_body, &j);
    CHECK(atomic_load(&j.sum) == serial);
    CHECK(atomic_load(&j.chunks) >= 1 && atomic_load(&j.chunks) <= 4 * rfi_threadpool_size());
    CHECK(atomic_load(&j.min_chunk) >= 1000);
    int64_t bad = 0;
    for (int64_t i = 0; i < N; i++)
        bad += visits[i] != 1;
    CHECK(bad == 0);
    printf("pool: %d threads, 10M-element sum in %d chunks matches\n", rfi_threadpool_size(),
           atomic_load(&j.chunks));
    free(data);
    free(visits);
}

typedef struct inline_job {
    pthread_t caller;
    int calls;
    bool on_caller;
    int64_t lo, hi;
    int inner_calls;
} inline_job;

static void inline_body(void *ctx, int64_t lo, int64_t hi)
{
    inline_job *j = ctx;
    j->calls++;
    j->on_caller = pthread_equal(pthread_self(), j->caller);
    j->lo = lo;
    j->hi = hi;
}

static void nested_outer(void *ctx, int64_t lo, int64_t hi)
{
    sum_job *j = ctx;
    (void)lo;
    (void)hi;
    /* a nested call runs inline: its one chunk covers everything */
    inline_job inner = {pthread_self(), 0, false, -1, -1, 0};
    rfi_parallel_for(100000, 1, inline_body, &inner);
    if (inner.calls == 1 && inner.on_caller && inner.lo == 0 && inner.hi == 100000)
        atomic_fetch_add(&j->chunks, 1);
    atomic_fetch_add(&j->sum, 1);
}

static void *many_calls(void *arg)
{
    int *failures = arg;
    int32_t ones[256];
    uint8_t visits[256];
    for (int k = 0; k < 256; k++)
        ones[k] = 1;
    for (int k = 0; k < 3000; k++) {
        memset(visits, 0, sizeof visits);
        sum_job j = {ones, visits, 0, 0, INT64_MAX};
        int64_t n = 1 + k % 256;
        rfi_parallel_for(n, 1 + k % 7, sum_body, &j);
        if (atomic_load(&j.sum) != n)
            (*failures)++;
    }
    return NULL;
}

static void test_pool_inline_and_nested(void)
{
    inline_job j = {pthread_self(), 0, false, -1, -1, 0};
    rfi_parallel_for(10, 100, inline_body, &j); /* n < grain: inline */
    CHECK(j.calls == 1 && j.on_caller && j.lo == 0 && j.hi == 10);
    j.calls = 0;
    rfi_parallel_for(0, 1, inline_body, &j); /* nothing */
    CHECK(j.calls == 0);

    sum_job nest = {NULL, NULL, 0, 0, INT64_MAX};
    rfi_parallel_for(rfi_threadpool_size(), 1, nested_outer, &nest);
    CHECK(atomic_load(&nest.sum) >= 1);
    CHECK(atomic_load(&nest.chunks) == atomic_load(&nest.sum));

    /* many calls in a row, and two threads calling at once (one runs inline) */
    int fail_a = 0, fail_b = 0;
    pthread_t t;
    CHECK(pthread_create(&t, NULL, many_calls, &fail_b) == 0);
    many_calls(&fail_a);
    pthread_join(t, NULL);
    CHECK(fail_a == 0 && fail_b == 0);
}

/* Waits (up to 10 s, in 1 ms naps) until *count reaches target; false if it
 * never did. */
static bool wait_for_count(atomic_int *count, int target)
{
    for (int waited_ms = 0; atomic_load(count) < target; waited_ms++) {
        if (waited_ms == 10000)
            return false;
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, NULL);
    }
    return true;
}

typedef struct claim_job {
    atomic_int done;      /* chunks finished, the first one not counted */
    atomic_int chunks;    /* chunks run */
    atomic_bool gave_up;  /* the first chunk stopped waiting for the others */
} claim_job;

/* The first chunk waits (up to 10 s) until every other chunk is done: with a
 * fixed share per thread its own later chunks could never run meanwhile. */
static void claim_body(void *ctx, int64_t lo, int64_t hi)
{
    claim_job *j = ctx;
    (void)hi;
    int64_t chunks = 4 * (int64_t)rfi_threadpool_size();
    atomic_fetch_add(&j->chunks, 1);
    if (lo != 0) {
        atomic_fetch_add(&j->done, 1);
        return;
    }
    if (!wait_for_count(&j->done, (int)chunks - 1))
        atomic_store(&j->gave_up, true);
}

/* A thread held up in one chunk does not hold up the rest of the range: the
 * other threads claim the chunks it would have run. */
static void test_pool_free_threads_claim_the_rest(void)
{
    if (rfi_threadpool_size() < 2)
        return;
    claim_job j = {0, 0, false};
    rfi_threadpool_forget_late_teams(); /* a chunk here waits for the team */
    rfi_parallel_for(4 * (int64_t)rfi_threadpool_size(), 1, claim_body, &j);
    CHECK(!atomic_load(&j.gave_up));
    CHECK(atomic_load(&j.chunks) == 4 * rfi_threadpool_size());
}

/* Records the order in which chunks start; each thread's first chunk waits
 * (up to 10 s) until every thread has started one, so the first `threads`
 * starts are the threads' first picks. */
typedef struct order_job {
    int job;     /* this job's number, so a thread knows its first chunk */
    int threads;
    atomic_int arrived;
    atomic_int started;
    atomic_bool gave_up;
    int64_t lo[64]; /* by start */
    int64_t len[64];
} order_job;

static _Thread_local int last_order_job;

static void order_body(void *ctx, int64_t lo, int64_t hi)
{
    order_job *j = ctx;
    int k = atomic_fetch_add(&j->started, 1);
    if (k < 64) {
        j->lo[k] = lo;
        j->len[k] = hi - lo;
    }
    if (last_order_job == j->job)
        return;
    last_order_job = j->job;
    atomic_fetch_add(&j->arrived, 1);
    if (!wait_for_count(&j->arrived, j->threads))
        atomic_store(&j->gave_up, true);
}

/* A backwards run cuts the same chunks and each thread starts from the end
 * of its share: the last chunk is among the threads' first picks and the
 * first is not; forwards, the other way round. */
static void test_pool_order(void)
{
    static int jobs;
    int threads = rfi_threadpool_size();
    int64_t n = 4 * (int64_t)threads;
    if (threads < 2 || n > 64)
        return;
    for (int backwards = 0; backwards < 2; backwards++) {
        order_job j = {.job = ++jobs, .threads = threads};
        rfi_threadpool_forget_late_teams();
        rfi_parallel_for_ordered(n, 1, order_body, &j, backwards);
        if (atomic_load(&j.gave_up)) { /* a thread never came: nothing to compare */
            printf("pool order: not every thread took part; skipped\n");
            continue;
        }
        CHECK(atomic_load(&j.started) == n);
        bool seen[64] = {false}, first_in_picks = false, last_in_picks = false;
        for (int k = 0; k < n; k++) {
            CHECK(j.len[k] == 1 && j.lo[k] >= 0 && j.lo[k] < n && !seen[j.lo[k]]);
            if (j.lo[k] >= 0 && j.lo[k] < n)
                seen[j.lo[k]] = true;
            first_in_picks |= k < threads && j.lo[k] == 0;
            last_in_picks |= k < threads && j.lo[k] == n - 1;
        }
        CHECK(first_in_picks == !backwards);
        CHECK(last_in_picks == (bool)backwards);
    }
}

/* ---- A late team --------------------------------------------------------------------- */

typedef struct late_job {
    pthread_t caller;
    bool late;           /* chunks on other threads than the caller's nap 2 ms */
    atomic_int chunks;   /* chunks run */
    atomic_int elsewhere; /* of which on other threads */
    int64_t lo[64], hi[64];
} late_job;

/* The caller's first chunk waits (up to 20 ms, in 0.1 ms naps) for another
 * thread to run one, so a team always shares the work: a late job's other
 * thread then naps in its chunk, and the caller is kept waiting every time
 * (without the wait, a caller that ran every chunk before its team woke was
 * not kept waiting, and a quarter of the runs never saw two late teams in a
 * row in five tries). */
static void late_body(void *ctx, int64_t lo, int64_t hi)
{
    late_job *j = ctx;
    int k = atomic_fetch_add(&j->chunks, 1);
    if (k < 64) {
        j->lo[k] = lo;
        j->hi[k] = hi;
    }
    struct timespec nap = {0, j->late ? 2000000 : 100000};
    if (!pthread_equal(pthread_self(), j->caller)) {
        atomic_fetch_add(&j->elsewhere, 1);
        if (j->late)
            nanosleep(&nap, NULL);
        return;
    }
    struct timespec wait = {0, 100000};
    for (int waited = 0; k == 0 && waited < 200 && !atomic_load(&j->elsewhere); waited++)
        nanosleep(&wait, NULL);
}

/* Runs a late_job over [0, 1000); false if it ran more than 64 chunks. */
static bool run_late_job(late_job *j, bool late)
{
    *j = (late_job){.caller = pthread_self(), .late = late};
    rfi_parallel_for(1000, 1, late_body, j);
    return atomic_load(&j->chunks) <= 64;
}

/* Whether a and b ran the same chunks (in any order). */
static bool same_chunks(const late_job *a, const late_job *b)
{
    int n = atomic_load(&a->chunks);
    if (n != atomic_load(&b->chunks))
        return false;
    for (int k = 0; k < n; k++) {
        bool found = false;
        for (int i = 0; i < n && !found; i++)
            found = a->lo[k] == b->lo[i] && a->hi[k] == b->hi[i];
        if (!found)
            return false;
    }
    return true;
}

/* On OpenMP's threads: two loops in a row whose team kept the caller waiting
 * (its other thread napping in a chunk) send the next loops to the caller
 * alone, with the same chunks, and a call from inside one of them runs inline
 * as a nested call does. A few tries, in case this process is itself kept off
 * the cores for the 5 ms the caller stays alone. */
static void test_pool_late_team_goes_alone(void)
{
    if (rfi_threadpool_size() < 2 || rfi_dnnl_load() != RF_OK)
        return;
    late_job reference, late, probe;
    rfi_threadpool_forget_late_teams();
    CHECK(run_late_job(&reference, false));
    if (atomic_load(&reference.elsewhere) == 0) { /* the team never came */
        printf("pool: no team to be late; skipped\n");
        return;
    }
    bool alone = false;
    for (int attempt = 0; attempt < 5 && !alone; attempt++) {
        CHECK(run_late_job(&late, true) && run_late_job(&late, true));
        /* a call from a chunk run alone is nested: inline, one chunk */
        sum_job nest = {NULL, NULL, 0, 0, INT64_MAX};
        rfi_parallel_for(rfi_threadpool_size(), 1, nested_outer, &nest);
        CHECK(atomic_load(&nest.sum) >= 1);
        CHECK(atomic_load(&nest.chunks) == atomic_load(&nest.sum));
        CHECK(run_late_job(&probe, false));
        CHECK(same_chunks(&probe, &reference));
        alone = atomic_load(&probe.elsewhere) == 0;
    }
    CHECK(alone);
    if (alone)
        printf("pool: after two late teams the caller ran %d chunks alone\n",
               atomic_load(&probe.chunks));
}

/* ---- Keeping the team warm -------------------------------------------------------- */

/* A [64,128] x [128,128] product (1M multiply-adds: a call on its caller
 * alone) and, with `big`, its result times a [128,512] weight (4M: the team's).
 */
static void chained_products_fn(rf_trace *t, void *ctx)
{
    bool big = *(const bool *)ctx;
    rf_tensor *h = rf_matmul(rf_arg(t, 0), rf_arg(t, 1));
    rf_return(t, big ? rf_matmul(h, rf_arg(t, 2)) : h);
}

/* The plan of chained_products_fn, with its services prepared. */
static bool chained_products(bool big, rfi_graph **g, rfi_plan **plan, rfi_cpu_services **s)
{
    *g = NULL;
    *plan = NULL;
    *s = NULL;
    rfi_graph *traced = rfi_graph_new(rf_device_cpu(), "chained products");
    rf_dtype dt[3] = {RF_F32, RF_F32, RF_F32};
    int rk[3] = {2, 2, 2};
    int64_t dims[3][RF_MAX_RANK] = {{64, 128}, {128, 128}, {128, 512}};
    CHECK_OK(rfi_graph_set_args(traced, 3, dt, rk, (const int64_t(*)[RF_MAX_RANK])dims));
    chained_products_fn(traced, &big);
    CHECK_OK(traced->status);
    CHECK_OK(rfi_dce(traced, g));
    rfi_graph_free(traced);
    if (*g)
        CHECK_OK(rfi_plan_build(*g, NULL, plan));
    if (*plan)
        CHECK_OK(rfi_cpu_services_prepare(*plan, s));
    return *s != NULL;
}

/* Calls every step of the plan once on fresh buffers. */
static void run_chained_products(const rfi_graph *g, const rfi_plan *plan, rfi_cpu_services *s)
{
    int nb = rfi_plan_n_buffers(plan);
    void **bufs = calloc((size_t)nb, sizeof *bufs);
    for (int k = 0; k < g->n_args; k++) {
        int64_t n = g->args[k] ? rfi_node_numel(g->args[k]) : 0;
        bufs[k] = malloc((size_t)n * sizeof(float) + 8);
        fill(bufs[k], RF_F32, n);
    }
    bufs[g->n_args + g->n_captures] = calloc(1, rfi_node_nbytes(g->outputs[0]));
    bufs[rfi_plan_arena_buffer(plan)] = calloc(1, plan->arena_bytes + 64);
    for (int k = 0; k < plan->n_steps; k++)
        CHECK(plan->steps[k].kind != RFI_STEP_CALL || rfi_cpu_services_call(s, k, bufs) == 0);
    for (int k = 0; k < g->n_args; k++)
        free(bufs[k]);
    free(bufs[g->n_args + g->n_captures]);
    free(bufs[rfi_plan_arena_buffer(plan)]);
    free(bufs);
}

static void warm_inside(void *ctx, int64_t lo, int64_t hi)
{
    (void)lo;
    (void)hi;
    int64_t before = rfi_threadpool_team_warmings();
    rfi_threadpool_keep_team_warm(); /* nested: never a region */
    if (rfi_threadpool_team_warmings() != before)
        atomic_store((atomic_bool *)ctx, true);
}

/* The small product keeps the team warm when the big one follows it, and
 * only then; after the team has idled it opens one empty region, and none
 * from inside a region. */
static void test_keep_team_warm(void)
{
    for (int big = 0; big < 2; big++) {
        rfi_graph *g;
        rfi_plan *plan;
        rfi_cpu_services *s;
        if (chained_products(big, &g, &plan, &s)) {
            int calls = 0;
            for (int k = 0; k < plan->n_steps; k++)
                calls += plan->steps[k].kind == RFI_STEP_CALL;
            CHECK(calls == 1 + big);
            bool team = rfi_threadpool_size() > 1 && rfi_dnnl_load() == RF_OK;
            CHECK(rfi_cpu_services_step_warm_team(s, 0) == (big && team));
            CHECK(!rfi_cpu_services_step_warm_team(s, plan->n_steps - 1));
            bool spins = !getenv("OMP_WAIT_POLICY") && getenv("GOMP_SPINCOUNT") &&
                         strcmp(getenv("GOMP_SPINCOUNT"), "5000") == 0;
            if (big && team && spins) {
                rfi_threadpool_forget_late_teams();
                struct timespec idle = {0, 20000000}; /* past any team's spin */
                nanosleep(&idle, NULL);
                int64_t before = rfi_threadpool_team_warmings();
                run_chained_products(g, plan, s);
                CHECK(rfi_threadpool_team_warmings() == before + 1);
                atomic_bool opened = false;
                rfi_parallel_for(2, 1, warm_inside, &opened);
                CHECK(!atomic_load(&opened));
                printf("team kept warm: one empty region after 20 ms idle\n");
            } else if (!big) {
                int64_t before = rfi_threadpool_team_warmings();
                run_chained_products(g, plan, s);
                CHECK(rfi_threadpool_team_warmings() == before);
            }
        }
        rfi_cpu_services_free(s);
        rfi_plan_free(plan);
        rfi_graph_free(g);
    }
}

/* ---- Loading oneDNN in the background ---------------------------------------------- */

typedef struct affinity_job {
    cpu_set_t allowed;
    atomic_int bad;
} affinity_job;

static void check_affinity(void *ctx, int64_t lo, int64_t hi)
{
    affinity_job *j = ctx;
    (void)lo;
    (void)hi;
    cpu_set_t mine;
    if (sched_getaffinity(0, sizeof mine, &mine) != 0 || !CPU_EQUAL(&mine, &j->allowed))
        atomic_fetch_add(&j->bad, 1);
}

/* A process confined to one CPU, where the loader thread cannot start off
 * the caller's CPU (dnnl_loader.c), loads oneDNN as well: in a child, forked
 * before this process has threads (its own loader runs once). Returns the
 * child's status: 0 loaded, 1 unavailable, else a failure. */
static int preload_confined_child(void)
{
    pid_t pid = fork();
    if (pid == 0) {
        int cpu = sched_getcpu();
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpu >= 0 ? cpu : 0, &one);
        bool confined = sched_setaffinity(0, sizeof one, &one) == 0;
        rfi_dnnl_preload();
        rfi_dnnl_settle();
        _exit(!confined ? 3 : rfi_dnnl_load() == RF_OK ? 0 : 1);
    }
    int status = -1;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status));
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* Starting the loader off the caller's CPU must not confine anyone: the
 * caller keeps its CPUs, the threads that run loops afterwards (OpenMP's,
 * once oneDNN is loaded) may use them all, and OpenMP counts them all. Runs
 * before anything else loads the library. */
static void test_preload_affinity(int confined_child)
{
    affinity_job j;
    atomic_init(&j.bad, 0);
    CHECK(sched_getaffinity(0, sizeof j.allowed, &j.allowed) == 0);
    rfi_dnnl_preload();
    rfi_dnnl_settle();
    bool lib = rfi_dnnl_load() == RF_OK;
    CHECK(confined_child == (lib ? 0 : 1));
    cpu_set_t now;
    CHECK(sched_getaffinity(0, sizeof now, &now) == 0 && CPU_EQUAL(&now, &j.allowed));
    rfi_parallel_for(4 * (int64_t)rfi_threadpool_size(), 1, check_affinity, &j);
    CHECK(atomic_load(&j.bad) == 0);
    /* OpenMP, loaded on the loader thread, counted every CPU of the process:
     * its default thread count is that count (read at its load). */
    int (*omp_max_threads)(void) = NULL;
    void *dnnl = lib ? dlopen(RFI_DNNL_LIBRARY, RTLD_LAZY | RTLD_NOLOAD) : NULL;
    if (dnnl) {
        *(void **)&omp_max_threads = dlsym(dnnl, "omp_get_max_threads");
        if (omp_max_threads && !getenv("OMP_NUM_THREADS"))
            CHECK(omp_max_threads() == CPU_COUNT(&j.allowed));
        dlclose(dnnl);
    }
    printf("preload: oneDNN %s (also on one CPU), the caller's and the loop threads' CPUs "
           "unchanged, OpenMP counts them all\n", lib ? "loaded" : "unavailable");
}

/* ---- CALL epilogues ---------------------------------------------------------------- */

typedef struct epi_prog {
    const char *name;
    bool conv;     /* else matmul: x [64, 96], w [80, 96], bias [80], r [64, 80] */
    int64_t cin;   /* conv: x [8, cin, 12, 12], w [16, cin, 3, 3], bias [16] */
    bool bias, residual;
    int act;       /* 0 none, 1 relu, 2 tanh, 3 logistic */
    double scale;  /* of x: large pre-activations test the activations' tails */
    int n_epi;     /* the epilogue's expected length */
    int lib_ops;   /* its leading ops oneDNN applies (when loaded; default path) */
} epi_prog;

static void epi_fn(rf_trace *t, void *ctx)
{
    const epi_prog *e = ctx;
    rf_tensor *y;
    if (e->conv) {
        rf_conv_params cp = rf_conv_params_default(2);
        cp.pad_lo[0] = cp.pad_lo[1] = cp.pad_hi[0] = cp.pad_hi[1] = 1;
        y = rf_conv(rf_arg(t, 0), rf_arg(t, 1), &cp);
        if (e->bias)
            y = rf_add(y, rf_reshape(rf_arg(t, 2), RF_SHAPE(1, 16, 1, 1)));
    } else {
        y = rf_linear(rf_arg(t, 0), rf_arg(t, 1), e->bias ? rf_arg(t, 2) : NULL);
    }
    if (e->residual)
        y = rf_add(y, rf_arg(t, 3));
    y = e->act == 1 ? rf_relu(y) : e->act == 2 ? rf_tanh(y) : e->act == 3 ? rf_logistic(y) : y;
    rf_return(t, y);
}

/* Every node of g on the reference kernels, in id order; returns the value of
 * node `want` (owned by vals[want]). */
static void **interp_all(const rfi_graph *g, void *const *args)
{
    void **val = calloc((size_t)g->n_nodes, sizeof *val);
    for (int i = 0; i < g->n_nodes; i++) {
        const rfi_node *n = g->nodes[i];
        if (n->op == RFI_OP_ARGUMENT) {
            val[i] = args[n->attr.i[0]];
            continue;
        }
        const void *in[8];
        for (int k = 0; k < n->n_in && k < 8; k++)
            in[k] = val[n->in[k]->id];
        val[i] = calloc(1, rfi_node_nbytes(n) + 8);
        CHECK_OK(rfi_interp_eval_node(n, in, val[i]));
    }
    return val;
}

/* The program of e (its four arguments' types in dims/rk), after DCE. */
static rfi_graph *epi_graph(const epi_prog *e, int64_t dims[4][RF_MAX_RANK], int *rk)
{
    rfi_graph *g = rfi_graph_new(rf_device_cpu(), "epilogue");
    rf_dtype dt[4] = {RF_F32, RF_F32, RF_F32, RF_F32};
    int64_t cd[4][4] = {{8, e->cin, 12, 12}, {16, e->cin, 3, 3}, {16}, {8, 16, 12, 12}};
    int64_t md[4][4] = {{64, 96}, {80, 96}, {80}, {64, 80}};
    int crk[4] = {4, 4, 1, 4}, mrk[4] = {2, 2, 1, 2};
    for (int k = 0; k < 4; k++) {
        rk[k] = e->conv ? crk[k] : mrk[k];
        memset(dims[k], 0, sizeof dims[k]);
        memcpy(dims[k], e->conv ? cd[k] : md[k], sizeof cd[k]);
    }
    CHECK_OK(rfi_graph_set_args(g, 4, dt, rk, (const int64_t(*)[RF_MAX_RANK])dims));
    epi_fn(g, (void *)e);
    CHECK_OK(g->status);
    rfi_graph *clean = NULL;
    CHECK_OK(rfi_dce(g, &clean));
    rfi_graph_free(g);
    return clean;
}

static void free_vals(const rfi_graph *g, void **val)
{
    for (int i = 0; i < g->n_nodes; i++)
        if (g->nodes[i]->op != RFI_OP_ARGUMENT)
            free(val[i]);
    free(val);
}

/* The error bound of each output element: RF_CHECK's 1e-6 + 1e-4 |b| plus
 * 1e-5 of the pre-activation's sum of |terms| (the f32 accumulation of the
 * product; the activations do not magnify errors), computed by the
 * interpreter on |arguments| with the activation left out. */
static float *epi_bounds(const epi_prog *e, void *const *args, const int64_t (*dims)[RF_MAX_RANK],
                         const int *rk)
{
    epi_prog pre = *e;
    pre.act = 0;
    int64_t d2[4][RF_MAX_RANK];
    int r2[4];
    rfi_graph *g = epi_graph(&pre, d2, r2);
    void *abs_args[4];
    for (int k = 0; k < 4; k++)
        abs_args[k] = abs_copy(args[k], RF_F32, rfi_numel(dims[k], rk[k]));
    void **val = interp_all(g, abs_args);
    int64_t n = rfi_node_numel(g->outputs[0]);
    float *bound = malloc((size_t)n * sizeof(float) + 8);
    memcpy(bound, val[g->outputs[0]->id], (size_t)n * sizeof(float));
    free_vals(g, val);
    for (int k = 0; k < 4; k++)
        free(abs_args[k]);
    rfi_graph_free(g);
    return bound;
}

/* x holds a NaN (element NAN_AT), whose outputs must be NaN as in the
 * interpreter: a relu must not turn it into 0. */
#define NAN_AT 7

static void run_epi_prog(const epi_prog *e, const char *conv_path, int expect_lib_ops)
{
    int64_t dims[4][RF_MAX_RANK];
    int rk[4];
    rfi_graph *g = epi_graph(e, dims, rk);
    if (!g)
        return;
    /* rfi_dce keeps every argument: all four are in the buffer table */
    void *args[4];
    for (int k = 0; k < 4; k++) {
        int64_t n = rfi_numel(dims[k], rk[k]);
        float *p = malloc((size_t)n * sizeof(float) + 8);
        for (int64_t i = 0; i < n; i++)
            p[i] = (float)(uniform() * (k == 0 ? e->scale : 1.0));
        if (k == 0)
            p[NAN_AT] = NAN;
        args[k] = p;
    }
    rfi_plan *plan = NULL;
    CHECK_OK(rfi_plan_build(g, NULL, &plan));
    const rfi_node *out = g->outputs[0];
    if (plan) {
        CHECK(plan->n_steps == 1 && plan->steps[0].kind == RFI_STEP_CALL);
        CHECK(plan->steps[0].n_epilogue == e->n_epi);
        if (conv_path)
            setenv("RF_CONV_PATH", conv_path, 1);
        rfi_cpu_services *s = NULL;
        CHECK_OK(rfi_cpu_services_prepare(plan, &s));
        if (conv_path)
            unsetenv("RF_CONV_PATH");
        if (s) {
            int nb = rfi_plan_n_buffers(plan);
            void **bufs = calloc((size_t)nb, sizeof *bufs);
            for (int k = 0; k < 4 && k < g->n_args; k++)
                bufs[k] = args[k];
            bufs[g->n_args + g->n_captures] = calloc(1, rfi_node_nbytes(out));
            bufs[rfi_plan_arena_buffer(plan)] = calloc(1, plan->arena_bytes + 64);
            for (int c = 0; c < plan->n_consts; c++)
                bufs[rfi_plan_arena_buffer(plan) + 1 + c] =
                    (void *)g->nodes[plan->consts[c]]->attr.data;
            CHECK(rfi_cpu_services_call(s, 0, bufs) == 0);
            if (expect_lib_ops >= 0)
                CHECK(rfi_cpu_services_step_lib_ops(s, 0) == expect_lib_ops);
            /* where the library takes the ops, a leading bias is the primitive's own
             * bias input, not a binary post-op (faster in oneDNN's matmul kernels) */
            if (expect_lib_ops > 0)
                CHECK(rfi_cpu_services_step_bias_input(s, 0) == e->bias);
            void **val = interp_all(g, args);
            float *terms = epi_bounds(e, args, (const int64_t(*)[RF_MAX_RANK])dims, rk);
            const float *got = bufs[g->n_args + g->n_captures], *want = val[out->id];
            double worst = 0;
            int64_t bad = 0, nans = 0, n = rfi_node_numel(out);
            for (int64_t i = 0; i < n; i++) {
                if (isnan(want[i])) {
                    nans++;
                    bad += !isnan(got[i]);
                    continue;
                }
                double d = fabs((double)got[i] - want[i]);
                double rel = d / (1e-6 + 1e-4 * fabs(want[i]) + 1e-5 * terms[i]);
                worst = rel > worst ? rel : worst;
                bad += !(rel <= 1.0);
            }
            CHECK(bad == 0 && nans > 0);
            printf("epilogue %-28s %-8s %d of %d ops in the library: worst error %.3f of the "
                   "bound, %lld NaN kept\n",
                   e->name, conv_path ? conv_path : "default",
                   rfi_cpu_services_step_lib_ops(s, 0), e->n_epi, worst, (long long)nans);
            free_vals(g, val);
            free(terms);
            free(bufs[g->n_args + g->n_captures]);
            free(bufs[rfi_plan_arena_buffer(plan)]);
            free(bufs);
            cases_run++;
        }
        rfi_cpu_services_free(s);
    }
    rfi_plan_free(plan);
    for (int k = 0; k < 4; k++)
        free(args[k]);
    rfi_graph_free(g);
}

/* Two convolutions in a row reading one activation ([2,16,8,8], 3x3, 16
 * outputs each): the second reads the first one's blocked copy instead of
 * reordering again (one shared input; none with RF_CONV_SHARE=0), and both
 * results are bitwise those of the unshared run and within the contraction
 * bound of the interpreter. */
static void two_convs_fn(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_conv_params cp = rf_conv_params_default(2);
    cp.pad_lo[0] = cp.pad_lo[1] = cp.pad_hi[0] = cp.pad_hi[1] = 1;
    rf_return(t, rf_conv(rf_arg(t, 0), rf_arg(t, 1), &cp));
    rf_return(t, rf_conv(rf_arg(t, 0), rf_arg(t, 2), &cp));
}

/* Runs the program's plan once; returns the two outputs (malloc'ed) or
 * NULLs, and how many inputs the services shared. */
static int run_two_convs(const rfi_graph *g, void *const *args, float **out)
{
    rfi_plan *plan = NULL;
    rfi_cpu_services *s = NULL;
    int shared = -1;
    out[0] = out[1] = NULL;
    CHECK_OK(rfi_plan_build(g, NULL, &plan));
    if (plan)
        CHECK_OK(rfi_cpu_services_prepare(plan, &s));
    if (s) {
        shared = rfi_cpu_services_shared_inputs(s);
        void **bufs = calloc((size_t)rfi_plan_n_buffers(plan), sizeof *bufs);
        for (int k = 0; k < g->n_args; k++)
            bufs[k] = args[k];
        for (int o = 0; o < 2; o++) {
            out[o] = calloc(1, rfi_node_nbytes(g->outputs[o]));
            bufs[g->n_args + g->n_captures + o] = out[o];
        }
        bufs[rfi_plan_arena_buffer(plan)] = calloc(1, plan->arena_bytes + 64);
        for (int k = 0; k < plan->n_steps; k++)
            CHECK(rfi_cpu_services_call(s, k, bufs) == 0);
        free(bufs[rfi_plan_arena_buffer(plan)]);
        free(bufs);
    }
    rfi_cpu_services_free(s);
    rfi_plan_free(plan);
    return shared;
}

static void test_conv_shared_inputs(void)
{
    rfi_graph *traced = rfi_graph_new(rf_device_cpu(), "two convolutions");
    rf_dtype dt[3] = {RF_F32, RF_F32, RF_F32};
    int rk[3] = {4, 4, 4};
    int64_t dims[3][RF_MAX_RANK] = {{2, 16, 8, 8}, {16, 16, 3, 3}, {16, 16, 3, 3}};
    CHECK_OK(rfi_graph_set_args(traced, 3, dt, rk, (const int64_t(*)[RF_MAX_RANK])dims));
    two_convs_fn(traced, NULL);
    CHECK_OK(traced->status);
    rfi_graph *g = NULL;
    CHECK_OK(rfi_dce(traced, &g));
    rfi_graph_free(traced);
    if (!g)
        return;
    void *args[3], *abs_args[3];
    for (int k = 0; k < 3; k++) {
        int64_t n = rfi_numel(dims[k], 4);
        args[k] = malloc((size_t)n * sizeof(float));
        fill(args[k], RF_F32, n);
        abs_args[k] = abs_copy(args[k], RF_F32, n);
    }
    float *shared_out[2], *plain_out[2];
    setenv("RF_CONV_WINOGRAD", "0", 1); /* oneDNN's kernels, whose inputs are reordered */
    int shared = run_two_convs(g, args, shared_out);
    setenv("RF_CONV_SHARE", "0", 1);
    int unshared = run_two_convs(g, args, plain_out);
    unsetenv("RF_CONV_SHARE");
    unsetenv("RF_CONV_WINOGRAD");
    CHECK(shared == 1 && unshared == 0);
    void **want = interp_all(g, args), **scale = interp_all(g, abs_args);
    double worst = 0;
    for (int o = 0; o < 2 && shared_out[o] && plain_out[o]; o++) {
        int64_t n = rfi_node_numel(g->outputs[o]);
        CHECK(memcmp(shared_out[o], plain_out[o], (size_t)n * sizeof(float)) == 0);
        const float *w = want[g->outputs[o]->id], *sc = scale[g->outputs[o]->id];
        for (int64_t i = 0; i < n; i++) {
            double err = fabs((double)shared_out[o][i] - w[i]) / (sc[i] > 1e-30 ? sc[i] : 1e-30);
            worst = err > worst || isnan(err) ? (isnan(err) ? INFINITY : err) : worst;
        }
    }
    CHECK(worst <= 1e-5);
    printf("conv shared inputs: %d shared (%d with RF_CONV_SHARE=0), bitwise equal, worst "
           "relative error %.3g\n", shared, unshared, worst);
    free_vals(g, want);
    free_vals(g, scale);
    for (int k = 0; k < 3; k++) {
        free(args[k]);
        free(abs_args[k]);
    }
    for (int o = 0; o < 2; o++) {
        free(shared_out[o]);
        free(plain_out[o]);
    }
    rfi_graph_free(g);
}

static void test_epilogues(void)
{
    static const epi_prog progs[] = {
        /* a relu or a logistic, and the ops after them, always run after the call */
        {"matmul+bias", false, 0, true, false, 0, 1.0, 1, 1},
        {"matmul+bias+relu", false, 0, true, false, 1, 1.0, 2, 1},
        {"matmul+bias+tanh", false, 0, true, false, 2, 1.0, 2, 2},
        {"matmul+bias+logistic", false, 0, true, false, 3, 1.0, 2, 1},
        {"matmul+bias+tanh (wide)", false, 0, true, false, 2, 4.0, 2, 2},
        {"matmul+bias+logistic (wide)", false, 0, true, false, 3, 4.0, 2, 1},
        {"matmul+residual+relu", false, 0, false, true, 1, 1.0, 2, 1},
        {"matmul+bias+residual+tanh", false, 0, true, true, 2, 1.0, 3, 3},
        {"conv+bias+relu", true, 8, true, false, 1, 1.0, 2, 1},
        {"conv+bias (1 channel)", true, 1, true, false, 0, 1.0, 1, 1}, /* bias input alone */
        {"conv+bias+relu (1 channel)", true, 1, true, false, 1, 1.0, 2, 1},
        {"conv+bias+logistic", true, 8, true, false, 3, 2.0, 2, 1},
        {"conv+bias+residual+relu", true, 8, true, true, 1, 1.0, 3, -1},
    };
    bool lib = rfi_dnnl_load() == RF_OK;
    for (size_t i = 0; i < sizeof progs / sizeof progs[0]; i++) {
        run_epi_prog(&progs[i], NULL, lib ? progs[i].lib_ops : 0);
        if (progs[i].conv)
            run_epi_prog(&progs[i], "im2col", 0);
    }
}

/* ---- Transposed operand views (plan.h conv_transposed_views) ------------------------- */

/* d/dx and d/dw of sum(conv(x, w) * c): the weight gradient's convolution
 * reads x and the output cotangent through swap01 transposes. *u: the
 * stride, or 0 for a ConvTranspose's convolution (4x4 stride 2 pad 1: x
 * dilated by 2, padded by 2), whose weight gradient backward-weights reads
 * with the operands' roles swapped. */
static void conv_grads_fn(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n;
    const int64_t *stride = u;
    rf_conv_params cp = rf_conv_params_default(2);
    for (int d = 0; d < 2; d++) {
        cp.stride[d] = *stride ? *stride : 1;
        cp.lhs_dilation[d] = *stride ? 1 : 2;
        cp.pad_lo[d] = cp.pad_hi[d] = *stride == 1 ? 1 : *stride ? 0 : 2;
    }
    rf_tensor *y = rf_mul(rf_conv(a[0], a[1], &cp), a[2]);
    rf_tensor *g[2];
    rf_grad(t, rf_sum_all(y), a, 2, g);
    rf_return(t, g[0]);
    rf_return(t, g[1]);
}

/* Compiled with RF_CHECK=1 (each run is compared with the interpreter), on
 * the default path (backward-weights reads the views), with im2col forced
 * (the services transpose them back first) and with winograd.c's forced
 * (which reads them; the stride-2 and transposed forms fall back to the
 * default). */
static void test_conv_views(void)
{
    static const int64_t strides[3] = {1, 2, 0};
    uint64_t seed = 7;
    setenv("RF_CHECK", "1", 1);
    for (int forced = 0; forced < 3; forced++) {
        if (forced)
            setenv("RF_CONV_PATH", forced == 1 ? "im2col" : "winograd", 1);
        for (int k = 0; k < 3; k++) {
            int64_t x = strides[k] ? 8 : 4, o = strides[k] == 1 ? 8 : strides[k] ? 4 : 8;
            double xv[4 * 16 * 8 * 8], wv[16 * 16 * 16], cv[4 * 16 * 8 * 8];
            /* positive data: each gradient element sums 64-256 products,
             * and with mixed signs their cancellation leaves f32 rounding
             * above the check's relative tolerance */
            for (size_t i = 0; i < sizeof xv / sizeof xv[0]; i++)
                xv[i] = tp_rand(&seed, 0, 1), cv[i] = tp_rand(&seed, 0.5, 1);
            for (size_t i = 0; i < sizeof wv / sizeof wv[0]; i++)
                wv[i] = tp_rand(&seed, 0, 1);
            int64_t kw = strides[k] == 1 ? 3 : strides[k] ? 1 : 4;
            rf_array *in[3] = {tp_host(RF_F32, RF_SHAPE(4, 16, x, x), xv),
                               tp_host(RF_F32, RF_SHAPE(16, 16, kw, kw), wv),
                               tp_host(RF_F32, RF_SHAPE(4, 16, o, o), cv)};
            rf_array *out[2] = {NULL, NULL};
            CHECK_OK(tp_run(conv_grads_fn, (void *)&strides[k], in, 3, out, 2));
            tp_free_all(out, 2);
            tp_free_all(in, 3);
        }
    }
    unsetenv("RF_CONV_PATH");
    unsetenv("RF_CHECK");
    printf("conv views: weight gradients checked against the interpreter\n");
}

/* Five convolutions in a row: five library calls, which prepare makes on
 * the caller and a helper thread where the pool has two threads; checked
 * step by step against the interpreter (RF_CHECK=1). */
static void five_convs_fn(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    rf_conv_params cp = rf_conv_params_default(2);
    rf_tensor *h = a[0];
    for (int l = 0; l < 5; l++)
        h = rf_conv(h, a[1], &cp);
    rf_return(t, h);
}

static void test_calls_made_beside(void)
{
    uint64_t seed = 11;
    double xv[2 * 16 * 14 * 14], wv[16 * 16 * 3 * 3];
    for (size_t i = 0; i < sizeof xv / sizeof xv[0]; i++)
        xv[i] = tp_rand(&seed, 0, 1);
    for (size_t i = 0; i < sizeof wv / sizeof wv[0]; i++)
        wv[i] = tp_rand(&seed, 0, 0.05);
    rf_array *in[2] = {tp_host(RF_F32, RF_SHAPE(2, 16, 14, 14), xv),
                       tp_host(RF_F32, RF_SHAPE(16, 16, 3, 3), wv)};
    rf_array *out = NULL;
    int64_t before = rfi_cpu_services_helpers_started();
    setenv("RF_CHECK", "1", 1);
    CHECK_OK(tp_run(five_convs_fn, NULL, in, 2, &out, 1));
    unsetenv("RF_CHECK");
    const char *backend = getenv("RF_BACKEND");
    if (rfi_threadpool_size() > 1 && rfi_dnnl_load() == RF_OK &&
        !(backend && strcmp(backend, "interp") == 0))
        CHECK(rfi_cpu_services_helpers_started() > before);
    CHECK(out && rf_array_numel(out) == 2 * 16 * 4 * 4);
    tp_free_all(&out, 1);
    tp_free_all(in, 2);
    printf("five convolutions: calls made beside the caller, checked against the interpreter\n");
}

/* Every oneDNN ISA maps to its vectors' channel block; the block the CPU
 * backend plans with before oneDNN has loaded (cpu_backend.c's
 * plan_on_guess) is the one oneDNN reports once loaded; with
 * oneDNN held to a lower ISA by the environment there is no guess. */
static void test_channel_block_guess(void)
{
    unsigned narrow[] = {dnnl_cpu_isa_all, dnnl_cpu_isa_sse41, dnnl_cpu_isa_avx,
                         dnnl_cpu_isa_avx2, dnnl_cpu_isa_avx2_vnni};
    unsigned wide[] = {dnnl_cpu_isa_avx512_mic,       dnnl_cpu_isa_avx512_mic_4ops,
                       dnnl_cpu_isa_avx512_core,      dnnl_cpu_isa_avx512_core_vnni,
                       dnnl_cpu_isa_avx512_core_bf16, dnnl_cpu_isa_avx512_core_amx};
    for (size_t i = 0; i < sizeof narrow / sizeof narrow[0]; i++)
        CHECK(rfi_dnnl_isa_channel_block(narrow[i]) == 8);
    for (size_t i = 0; i < sizeof wide / sizeof wide[0]; i++)
        CHECK(rfi_dnnl_isa_channel_block(wide[i]) == 16);
    int guess = rfi_dnnl_channel_block_guess();
    CHECK(guess == 8 || guess == 16);
    if (rfi_dnnl_load() == RF_OK)
        CHECK(guess == rfi_dnnl_channel_block());
    setenv("ONEDNN_MAX_CPU_ISA", "AVX2", 1); /* read by oneDNN once, already */
    CHECK(rfi_dnnl_channel_block_guess() == 0);
    unsetenv("ONEDNN_MAX_CPU_ISA");
    setenv("DNNL_MAX_CPU_ISA", "AVX2", 1);
    CHECK(rfi_dnnl_channel_block_guess() == 0);
    unsetenv("DNNL_MAX_CPU_ISA");
}

int main(void)
{
    int confined_child = preload_confined_child(); /* before any thread exists */
    test_pool_sum();
    test_pool_inline_and_nested();
    test_pool_free_threads_claim_the_rest();
    test_pool_order();
    test_preload_affinity(confined_child); /* loads oneDNN: the pool moves to OpenMP */
    test_matmul();
    test_matmul_bf16();
    test_conv(NULL);
    test_conv("im2col");
    test_conv("forward");
    test_conv("bwd-weights");
    test_conv("bwd-data");
    test_conv("winograd");
    test_conv_own_winograd();
    test_conv_bf16();
    test_conv_rule_paths();
    test_conv_grouped_paths();
    test_conv_transposed_paths();
    test_conv_winograd_everywhere();
    test_conv_shared_inputs();
    test_conv_views();
    test_calls_made_beside();
    test_native();
    test_native_index();
    test_native_rng();
    test_fallback();
    test_bad_calls();
    test_epilogues();
    test_channel_block_guess();
    test_pool_inline_and_nested(); /* again, on OpenMP's threads now that oneDNN is loaded */
    test_pool_free_threads_claim_the_rest();
    test_pool_order();
    test_pool_late_team_goes_alone();
    test_keep_team_warm();
    printf("%d cases against the reference\n", cases_run);
    return tu_finish("test_services");
}
