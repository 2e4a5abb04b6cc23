/* test_pool_native.c: the native select_and_scatter fast paths (windows
 * that do not overlap, no padding; and the gather path for windows that
 * overlap or are padded; src/backend/cpu/pool.c) against the reference
 * interpreter, bitwise. Most cases are 2x2 windows over the last
 * two dims, which run by bands in vectorised groups of windows: bands of 1 to
 * 3 windows (no full group), of exactly one group, of a group and a few
 * (the last group overlaps), wide bands; an uncovered row and column; one
 * plane, many planes, planes split between parallel chunks (with a pool of
 * two threads or more); rank 2 and 3 operands. The others (3x3, 1x2, 2x1,
 * 3x2, 5x5, 20x20, 1x1, 1-D) run window by window. All in f32 and f64, on
 * random data and on data that stresses the selection: ties, -0 next to +0,
 * NaNs of either sign and payload (the first NaN wins), infinities; the
 * source holds -0 (the result must be +0) and
 * NaNs (where two windows add NaNs into one element, any NaN matches: see
 * same_or_nans). The gather path's forms: windows 2 to 5, strides 1 to 3,
 * padding on either side, windows of padding only, 1-D windows, and the
 * channel-blocked forms with every mix of blocked and plain tensors, 8 and
 * 16 lanes. The result buffer starts as garbage, so every element must be
 * written; a run allocates nothing.
 *
 * The kernels are driven directly (rfi_cpu_native_prepare / run), not
 * through a compiled program: bitwise equality is the contract here, and
 * the services' dispatch to them is covered by test_services.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/services.h"
#include "backend/interp/interp.h"
#include "test_util.h"

/* ---- Data ---------------------------------------------------------------------------- */

static uint64_t rng_state = 0x2545f4914f6cdd1dull;

static uint64_t next_random(void)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return rng_state >> 11;
}

typedef enum data_kind {
    DATA_RANDOM,  /* uniform in [-1, 1) */
    DATA_SPECIAL, /* ties, signed zeros, NaNs, infinities */
    DATA_TIES,    /* few distinct values: many equal maxima per window */
    DATA_ZEROS,   /* -0 and +0 only: every window ties */
    DATA_NANS,    /* mostly NaN */
    DATA_KINDS
} data_kind;

static const char *data_name[DATA_KINDS] = {"random", "special", "ties", "zeros", "nans"};

/* A NaN with a sign and payload, as bits, so that the kernels see several. */
static double nan_value(uint64_t r, bool f64)
{
    if (f64) {
        uint64_t bits = 0x7ff0000000000000ull | (r & 0x000fffffffffffffull) | 1u;
        bits |= (r >> 40 & 1) << 63;
        double v;
        memcpy(&v, &bits, sizeof v);
        return v;
    }
    uint32_t bits = 0x7f800000u | (uint32_t)(r & 0x007fffffu) | 1u;
    bits |= (uint32_t)(r >> 40 & 1) << 31;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static double draw(data_kind kind, bool f64)
{
    static const double special[] = {-1.0, -0.0, 0.0, 0.5, 1.0, 1.0, INFINITY, -INFINITY};
    uint64_t r = next_random();
    switch (kind) {
    case DATA_RANDOM: return (double)r / (double)(1ull << 53) * 2.0 - 1.0;
    case DATA_SPECIAL: return r % 10 < 8 ? special[r % 10] : nan_value(r, f64);
    case DATA_TIES: return (double)(r % 3);
    case DATA_ZEROS: return r % 2 ? 0.0 : -0.0;
    default: return r % 4 ? nan_value(r, f64) : (double)(r % 5);
    }
}

static void fill(void *p, bool f64, int64_t n, data_kind kind)
{
    for (int64_t i = 0; i < n; i++) {
        double v = draw(kind, f64);
        if (f64)
            ((double *)p)[i] = v;
        else
            ((float *)p)[i] = (float)v;
    }
}

/* ---- Cases ---------------------------------------------------------------------------- */

typedef struct pool_case {
    const char *name;
    int rank;
    int64_t x[RF_MAX_RANK], win[RF_MAX_RANK];
} pool_case;

/* A case with strides (0: the window) and padding: the gather path's. */
typedef struct gather_form {
    const char *name;
    int rank;
    int64_t x[RF_MAX_RANK], win[RF_MAX_RANK], stride[RF_MAX_RANK], lo[RF_MAX_RANK],
        hi[RF_MAX_RANK];
} gather_form;

static const int64_t no_pads[RF_MAX_RANK] = {0};

/* select_and_scatter(x, source) with strides f->stride and padding f->lo,
 * f->hi (f NULL: stride == window, no padding) and the source shape the
 * window rule gives. */
static rfi_graph *scatter_graph(const pool_case *c, const gather_form *f, rf_dtype dt,
                                rfi_node **y)
{
    const int64_t *strides = f ? f->stride : no_pads, *lo = f ? f->lo : no_pads;
    const int64_t *hi = f ? f->hi : no_pads;
    int64_t dims[2][RF_MAX_RANK] = {{0}};
    rfi_attrs at = {0};
    for (int k = 0; k < 4; k++)
        at.nl[k] = c->rank;
    for (int d = 0; d < c->rank; d++) {
        int64_t stride = strides[d] ? strides[d] : c->win[d];
        dims[0][d] = c->x[d];
        dims[1][d] = (c->x[d] + lo[d] + hi[d] - c->win[d]) / stride + 1;
        at.l[0][d] = c->win[d];
        at.l[1][d] = stride;
        at.l[2][d] = lo[d];
        at.l[3][d] = hi[d];
    }
    rfi_graph *g = rfi_graph_new(rf_device_cpu(), "test_pool_native");
    rf_dtype dts[2] = {dt, dt};
    int ranks[2] = {c->rank, c->rank};
    CHECK_OK(rfi_graph_set_args(g, 2, dts, ranks, (const int64_t(*)[RF_MAX_RANK])dims));
    rfi_node *in[2];
    for (int k = 0; k < 2; k++) {
        rfi_attrs ai = {0};
        ai.i[0] = k;
        in[k] = rfi_node_new(g, RFI_OP_ARGUMENT, NULL, 0, &ai, dt, dims[k], c->rank);
    }
    *y = rfi_node_new(g, RFI_OP_SELECT_AND_SCATTER, in, 2, &at, dt, NULL, 0);
    if (!*y)
        fprintf(stderr, "  %s: %s\n", c->name, g->errmsg ? g->errmsg : rf_errmsg());
    CHECK(*y != NULL);
    return g;
}

/* Bitwise equal, but for NaNs, which match any NaN: where the source holds
 * NaNs of several payloads and signs, and two windows choose one element,
 * which payload a sum of two NaNs keeps follows the order in which the
 * compiler puts the operands of an addition (the first, on x86), which C
 * leaves open, for the reference's sums as for the kernel's. */
static bool same_or_nans(const void *got, const void *ref, int64_t n, bool f64)
{
    for (int64_t i = 0; i < n; i++) {
        double a = f64 ? ((const double *)got)[i] : ((const float *)got)[i];
        double b = f64 ? ((const double *)ref)[i] : ((const float *)ref)[i];
        size_t size = f64 ? 8 : 4;
        if (memcmp((const char *)got + i * (int64_t)size, (const char *)ref + i * (int64_t)size,
                   size) != 0 &&
            !(a != a && b != b))
            return false;
    }
    return true;
}

/* [N, C, H, W] f32 data to (to_blocked) or from [N, C/B, H, W, B]. */
static void reblock(const float *from, float *to, const int64_t *d, int64_t b, bool to_blocked)
{
    int64_t plane = d[2] * d[3];
    for (int64_t n = 0; n < d[0]; n++)
        for (int64_t c = 0; c < d[1]; c++)
            for (int64_t i = 0; i < plane; i++) {
                int64_t plain = (n * d[1] + c) * plane + i;
                int64_t blocked = ((n * (d[1] / b) + c / b) * plane + i) * b + c % b;
                if (to_blocked)
                    to[blocked] = from[plain];
                else
                    to[plain] = from[blocked];
            }
}

/* One case, one dtype, one kind of data: the kernel's result against the
 * reference's, bitwise; returns whether they matched. With block (8 or 16;
 * f32 [N, C, H, W]) the tensors whose bit is set in `blocked` (1: x, 2: the
 * source, 4: the result) are channel-blocked. */
static bool run_case_in(const pool_case *c, const gather_form *f, rf_dtype dt, data_kind kind,
                        int block, int blocked)
{
    rfi_node *y = NULL;
    rfi_graph *g = scatter_graph(c, f, dt, &y);
    bool same = false;
    if (!y) {
        rfi_graph_free(g);
        return false;
    }
    bool f64 = dt == RF_F64;
    int64_t nx = rfi_node_numel(y->in[0]), ns = rfi_node_numel(y->in[1]);
    size_t nbytes = rfi_node_nbytes(y);
    void *in[2] = {malloc((size_t)nx * rf_dtype_size(dt) + 1),
                   malloc((size_t)(ns > 0 ? ns : 1) * rf_dtype_size(dt))};
    fill(in[0], f64, nx, kind);
    fill(in[1], f64, ns, kind == DATA_RANDOM ? DATA_RANDOM : DATA_SPECIAL);
    void *ref = malloc(nbytes + 1), *got = malloc(nbytes + 1);
    CHECK_OK(rfi_interp_eval_node(y, (const void *const *)in, ref));

    rfi_cpu_native *k = NULL;
    size_t ws_bytes = 0;
    CHECK_OK(rfi_cpu_native_prepare(y, &k, &ws_bytes));
    rfi_layout lay[3] = {RFI_LAYOUT_PLAIN, RFI_LAYOUT_PLAIN, RFI_LAYOUT_PLAIN};
    for (int t = 0; t < 3 && block; t++)
        if (blocked >> t & 1)
            lay[t] = block == 8 ? RFI_LAYOUT_C8 : RFI_LAYOUT_C16;
    if (k && block)
        CHECK(rfi_cpu_native_take_layouts(k, lay));
    const char *path = f ? "native-scatter-gather" : "native-scatter-fast";
    if (k && block)
        path = f ? "native-scatter-gather-blocked" : "native-scatter-blocked";
    void *args[2] = {in[0], in[1]}, *staged[3] = {NULL, NULL, NULL};
    for (int t = 0; t < 3 && block; t++)
        if (lay[t] != RFI_LAYOUT_PLAIN) {
            staged[t] = malloc(t == 1 ? (size_t)ns * 4 : nbytes + 1);
            if (t < 2) {
                reblock(in[t], staged[t], y->in[t]->dims, block, true);
                args[t] = staged[t];
            }
        }
    if (k) {
        CHECK(!strcmp(rfi_cpu_native_path(k), path));
        void *ws = ws_bytes ? malloc(ws_bytes) : NULL;
        void *dst = staged[2] ? staged[2] : got;
        for (int run = 0; run < 2; run++) { /* the second from other garbage */
            memset(dst, run ? 0xcd : 0x7f, nbytes + 1);
            uint64_t allocs = rfi_alloc_count();
            CHECK_OK(rfi_cpu_native_run(k, (const void *const *)args, dst, ws));
            if (run) /* the first may start the thread pool */
                CHECK(rfi_alloc_count() == allocs);
            CHECK(((unsigned char *)dst)[nbytes] == (run ? 0xcd : 0x7f));
            if (staged[2])
                reblock(staged[2], got, y->dims, block, false);
            same = f ? same_or_nans(got, ref, nx, f64) : memcmp(got, ref, nbytes) == 0;
            CHECK(same);
        }
        if (!same)
            fprintf(stderr, "  case %s (%s, %s data, block %d of %d): not bitwise equal to "
                    "the reference\n", c->name, f64 ? "f64" : "f32", data_name[kind], block,
                    blocked);
        free(ws);
    }
    for (int t = 0; t < 3; t++)
        free(staged[t]);
    rfi_cpu_native_free(k);
    free(in[0]);
    free(in[1]);
    free(ref);
    free(got);
    rfi_graph_free(g);
    return same;
}

static bool run_case(const pool_case *c, rf_dtype dt, data_kind kind)
{
    return run_case_in(c, NULL, dt, kind, 0, 0);
}

static void test_band_forms(void)
{
    static const pool_case cases[] = {
        /* 2x2: by bands */
        {"2x2 exact", 4, {2, 3, 8, 6}, {1, 1, 2, 2}},
        {"2x2 uncovered row and column", 4, {3, 2, 7, 5}, {1, 1, 2, 2}},
        {"2x2 one window per band", 4, {2, 3, 6, 3}, {1, 1, 2, 2}},
        {"2x2 three windows per band", 4, {2, 2, 4, 7}, {1, 1, 2, 2}},
        {"2x2 one group per band", 4, {1, 3, 5, 9}, {1, 1, 2, 2}},
        {"2x2 a group and one", 4, {2, 2, 6, 10}, {1, 1, 2, 2}},
        {"2x2 two groups and three", 4, {2, 1, 4, 23}, {1, 1, 2, 2}},
        {"2x2 one plane", 4, {1, 1, 6, 8}, {1, 1, 2, 2}},
        {"2x2 wide rows", 4, {1, 2, 5, 301}, {1, 1, 2, 2}},
        {"2x2 cnn pool2 shape", 4, {2, 5, 11, 11}, {1, 1, 2, 2}},
        {"2x2 rank 2, one plane", 2, {9, 14}, {2, 2}},
        {"2x2 rank 3", 3, {3, 6, 4}, {1, 2, 2}},
        {"2x2 planes split between chunks", 4, {3, 37, 26, 26}, {1, 1, 2, 2}},
        {"2x2 odd planes split between chunks", 4, {7, 29, 13, 17}, {1, 1, 2, 2}},
        /* other sizes: window by window */
        {"3x3 exact, one plane", 4, {1, 1, 9, 9}, {1, 1, 3, 3}},
        {"3x3 uncovered 1 row 2 columns", 4, {2, 2, 10, 11}, {1, 1, 3, 3}},
        {"1x2 (one window dim)", 4, {2, 3, 5, 9}, {1, 1, 1, 2}},
        {"2x1", 4, {2, 2, 7, 5}, {1, 1, 2, 1}},
        {"3x2 uncovered", 4, {2, 2, 11, 7}, {1, 1, 3, 2}},
        {"whole plane window", 4, {4, 3, 5, 5}, {1, 1, 5, 5}},
        {"20x20 window", 4, {1, 2, 41, 43}, {1, 1, 20, 20}},
        {"window 1x1", 4, {2, 3, 4, 5}, {1, 1, 1, 1}},
        {"rank 1", 1, {10}, {3}},
    };
    int n = (int)(sizeof cases / sizeof cases[0]), runs = 0, matched = 0;
    for (int k = 0; k < n; k++)
        for (int kind = 0; kind < DATA_KINDS; kind++)
            for (int f64 = 0; f64 < 2; f64++) {
                runs++;
                matched += run_case(&cases[k], f64 ? RF_F64 : RF_F32, (data_kind)kind);
            }
    printf("bands: %d forms x %d kinds of data x f32/f64: %d of %d bitwise\n", n, DATA_KINDS,
           matched, runs);
}

/* Overlapping and padded windows (the gather path): windows 2 to 5, strides
 * 1 to 3, padding low, high or both (wider than a stride, and windows of
 * padding only), odd sizes, 1-D windows, planes split between chunks; then
 * the f32 [N, C, H, W] forms with every tensor channel-blocked (8 and 16
 * lanes) and with only some. */
static bool run_form(const gather_form *f, rf_dtype dt, data_kind kind, int block, int blocked)
{
    pool_case c = {f->name, f->rank, {0}, {0}};
    memcpy(c.x, f->x, sizeof c.x);
    memcpy(c.win, f->win, sizeof c.win);
    return run_case_in(&c, f, dt, kind, block, blocked);
}

static void test_gather_forms(void)
{
    static const gather_form cases[] = {
        {"3x3 stride 2 pad 1 (ImageNet stem)", 4, {2, 3, 12, 12}, {1, 1, 3, 3}, {1, 1, 2, 2},
         {0, 0, 1, 1}, {0, 0, 1, 1}},
        {"3x3 stride 2 pad 1 odd sizes", 4, {2, 2, 11, 13}, {1, 1, 3, 3}, {1, 1, 2, 2},
         {0, 0, 1, 1}, {0, 0, 1, 1}},
        {"3x3 stride 1 pad 1", 4, {2, 3, 7, 9}, {1, 1, 3, 3}, {1, 1, 1, 1}, {0, 0, 1, 1},
         {0, 0, 1, 1}},
        {"3x3 stride 1 no padding", 4, {1, 2, 8, 7}, {1, 1, 3, 3}, {1, 1, 1, 1}, {0}, {0}},
        {"2x2 stride 1", 4, {2, 2, 5, 6}, {1, 1, 2, 2}, {1, 1, 1, 1}, {0}, {0}},
        {"4x4 stride 3 pad 2", 4, {2, 2, 13, 10}, {1, 1, 4, 4}, {1, 1, 3, 3}, {0, 0, 2, 2},
         {0, 0, 2, 1}},
        {"5x5 stride 2 pad 2", 4, {1, 3, 9, 12}, {1, 1, 5, 5}, {1, 1, 2, 2}, {0, 0, 2, 2},
         {0, 0, 2, 2}},
        {"5x3 stride 3x1", 4, {2, 1, 14, 9}, {1, 1, 5, 3}, {1, 1, 3, 1}, {0}, {0}},
        {"2x2 stride 2 pad 1 (no overlap, padded)", 4, {2, 2, 7, 8}, {1, 1, 2, 2},
         {1, 1, 2, 2}, {0, 0, 1, 1}, {0, 0, 1, 1}},
        {"3x3 stride 3 pad hi only", 4, {2, 2, 7, 8}, {1, 1, 3, 3}, {1, 1, 3, 3}, {0},
         {0, 0, 2, 1}},
        {"padding only windows", 4, {1, 2, 3, 4}, {1, 1, 2, 2}, {1, 1, 2, 2}, {0, 0, 3, 2},
         {0, 0, 2, 3}},
        {"window wider than the plane", 4, {2, 2, 3, 2}, {1, 1, 5, 4}, {1, 1, 1, 1},
         {0, 0, 2, 1}, {0, 0, 2, 1}},
        {"stride 3 wider than the padded window", 4, {1, 2, 10, 11}, {1, 1, 2, 2},
         {1, 1, 3, 3}, {0, 0, 1, 1}, {0, 0, 1, 1}},
        {"1-D windows 3 stride 2 pad 1", 3, {2, 3, 17}, {1, 1, 3}, {1, 1, 2}, {0, 0, 1},
         {0, 0, 1}},
        {"rank 2, one plane", 2, {9, 10}, {3, 3}, {2, 2}, {1, 1}, {1, 1}},
        {"wide rows (vector groups and a tail)", 4, {1, 2, 5, 83}, {1, 1, 3, 3}, {1, 1, 2, 2},
         {0, 0, 1, 1}, {0, 0, 1, 1}},
        {"planes split between chunks", 4, {3, 37, 20, 20}, {1, 1, 3, 3}, {1, 1, 2, 2},
         {0, 0, 1, 1}, {0, 0, 1, 1}},
    };
    int n = (int)(sizeof cases / sizeof cases[0]), runs = 0, matched = 0;
    for (int k = 0; k < n; k++)
        for (int kind = 0; kind < DATA_KINDS; kind++)
            for (int f64 = 0; f64 < 2; f64++) {
                runs++;
                matched += run_form(&cases[k], f64 ? RF_F64 : RF_F32, (data_kind)kind, 0, 0);
            }
    static const gather_form blocked[] = {
        {"blocked 3x3 stride 2 pad 1", 4, {2, 16, 12, 11}, {1, 1, 3, 3}, {1, 1, 2, 2},
         {0, 0, 1, 1}, {0, 0, 1, 1}},
        {"blocked 3x3 stride 1 pad 1", 4, {1, 32, 6, 7}, {1, 1, 3, 3}, {1, 1, 1, 1},
         {0, 0, 1, 1}, {0, 0, 1, 1}},
        {"blocked 4x4 stride 3 pad 2", 4, {3, 16, 9, 10}, {1, 1, 4, 4}, {1, 1, 3, 3},
         {0, 0, 2, 2}, {0, 0, 2, 1}},
        {"blocked, windows of padding only", 4, {1, 16, 3, 4}, {1, 1, 2, 2}, {1, 1, 2, 2},
         {0, 0, 3, 2}, {0, 0, 2, 3}},
    };
    int nb = (int)(sizeof blocked / sizeof blocked[0]);
    for (int k = 0; k < nb; k++)
        for (int kind = 0; kind < DATA_KINDS; kind++)
            for (int block = 8; block <= 16; block += 8)
                for (int which = 1; which < 8; which++) { /* x, source, result: any blocked */
                    runs++;
                    matched += run_form(&blocked[k], RF_F32, (data_kind)kind, block, which);
                }
    printf("gather: %d forms x %d kinds of data x f32/f64, %d blocked forms x 8/16 lanes x 7 "
           "layout mixes: %d of %d bitwise (NaNs: any NaN)\n",
           n, DATA_KINDS, nb, matched, runs);
}

/* The cases the selection order decides, written out: the expected result
 * by hand, not only the reference's. */
static void test_selection_rules(void)
{
    static const pool_case c = {"2x2 rules", 2, {2, 8}, {2, 2}};
    rfi_node *y = NULL;
    rfi_graph *g = scatter_graph(&c, NULL, RF_F32, &y);
    if (y) {
        float nan = (float)NAN;
        /* windows (row-major): ties -> first; NaN beats inf; first NaN of two;
         * -0 ties +0 -> first */
        float x[16] = {1, 1, 3, -INFINITY, nan, 3, -0.0f, 0.0f,   /* row 0 */
                       1, 0, INFINITY, 3,  2, nan, 0.0f, -0.0f}; /* row 1 */
        float src[4] = {-0.0f, 5, 7, -2};
        float want[16] = {0, 0, 0, 0, 7, 0, -2, 0, /* window 0 selects (0,0): -0 -> +0 */
                          0, 0, 5, 0, 0, 0, 0,  0};
        const void *in[2] = {x, src};
        float got[16];
        rfi_cpu_native *k = NULL;
        size_t ws = 0;
        CHECK_OK(rfi_cpu_native_prepare(y, &k, &ws));
        if (k) {
            CHECK_OK(rfi_cpu_native_run(k, in, got, NULL));
            CHECK(memcmp(got, want, sizeof got) == 0);
            CHECK(!signbit(got[0]));
        }
        rfi_cpu_native_free(k);
    }
    rfi_graph_free(g);
    printf("rules: first maximum, NaN above inf, first NaN, -0 ties +0, -0 source -> +0\n");
}

int main(void)
{
    test_selection_rules();
    test_band_forms();
    test_gather_forms();
    return tu_finish("test_pool_native");
}
