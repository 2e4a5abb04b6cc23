/* bench_services.c: GFLOP/s of the CPU backend's library calls (services.c)
 * on the shapes of the mlp and cnn workloads: the mlp's matmuls (forward,
 * weight and input gradients at batch 128), the cnn's convolutions
 * (forward, and the backward-data and backward-weights convolutions the
 * autodiff emits, at batch 64) and its max-pool gradients, the ResNet
 * example's 3x3 weight gradients at batch 128, and ResNet-18's
 * stem pool gradient (3x3 stride 2 pad 1 at 112x112 inputs, batch 8): the
 * select_and_scatter FALLBACK calls, native in pool.c; these report GB/s of
 * x and source read plus the result written. An embedding's lookup (gather of
 * 128x32 i32 ids from a 20000x64 f32 table) and its gradient (scatter_add of
 * those rows into the table), native in index_native.c, report GB/s of rows
 * read and written. Draws of an RNG node (128x512 f32, uniform as a
 * Dropout layer's mask and normal), native in rng_native.c, report GB/s of
 * values written. One line per shape:
 *   name path us_per_call=MEDIAN gflops=G   (or gbytes=G)
 * Each shape is one hand-built plan with one CALL step; inputs are random.
 * An argument runs only the shapes whose name contains it ("pool", "conv2").
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "backend/cpu/services.h"
#include "runtime/threadpool.h"

static const char *only; /* name filter from the command line, or NULL */
/* The next bench_node holds every value channel-blocked (plan.h). */
static bool all_blocked;

/* The CALL kind the planner gives y's op. */
static rfi_call_kind call_kind(const rfi_node *y)
{
    switch (y->op) {
    case RFI_OP_DOT_GENERAL: return RFI_CALL_MATMUL;
    case RFI_OP_CONVOLUTION: return RFI_CALL_CONV;
    default: return RFI_CALL_FALLBACK;
    }
}

/* Integer arguments hold indices in [0, index_bound). */
static int64_t index_bound = 1;

/* Times step 0 of a one-node plan computing y from its arguments (f32, or
 * i32 indices); work is in flops (unit "gflops") or bytes moved (unit
 * "gbytes"), per call. */
static void bench_node(const char *name, rfi_graph *g, rfi_node *y, double work,
                       const char *unit)
{
    if (only && !strstr(name, only))
        return;
    if (!y) {
        printf("%s: graph failed: %s\n", name, g->errmsg ? g->errmsg : rf_errmsg());
        return;
    }
    rfi_loc *loc = calloc((size_t)g->n_nodes, sizeof *loc);
    for (int k = 0; k < g->n_nodes; k++)
        if (g->nodes[k]->op == RFI_OP_ARGUMENT) {
            loc[k].kind = RFI_LOC_ARG;
            loc[k].index = (int)g->nodes[k]->attr.i[0];
        }
    loc[y->id].kind = RFI_LOC_OUTPUT;
    int root = y->id;
    rfi_step step = {.kind = RFI_STEP_CALL, .call = call_kind(y), .roots = &root, .n_roots = 1,
                     .copy_to_output = -1, .copy_to_capture = -1, .core = root};
    rfi_plan plan = {0};
    plan.g = g;
    plan.loc = loc;
    plan.steps = &step;
    plan.n_steps = 1;
    unsigned char *layout = calloc((size_t)g->n_nodes, 1);
    for (int k = 0; all_blocked && k < g->n_nodes; k++)
        layout[k] = RFI_LAYOUT_C16;
    plan.layout = layout;
    void *buffers[5];
    int n_in = y->n_in;
    uint64_t state = 0x9e3779b97f4a7c15ull; /* values in [-0.5, 0.5) from an LCG: no
                                               * pattern that a branch predictor learns */
    for (int k = 0; k < n_in; k++) {
        int64_t n = rfi_node_numel(y->in[k]);
        rf_dtype dt = y->in[k]->dtype;
        float *p = malloc((size_t)(n > 0 ? n : 1) * rf_dtype_size(dt));
        for (int64_t i = 0; i < n; i++) {
            state = state * 6364136223846793005ull + 1442695040888963407ull;
            if (dt == RF_I32)
                ((int32_t *)p)[i] = (int32_t)((state >> 33) % (uint64_t)index_bound);
            else if (dt == RF_I64) /* an RNG's key */
                ((int64_t *)p)[i] = (int64_t)(state >> 1);
            else
                p[i] = (float)(state >> 40) / (float)(1 << 24) - 0.5f;
        }
        buffers[k] = p;
    }
    buffers[n_in] = malloc(rfi_node_nbytes(y) + 1);
    buffers[n_in + 1] = NULL;
    rfi_cpu_services *s = NULL;
    if (rfi_cpu_services_prepare(&plan, &s) != RF_OK) {
        printf("%s: prepare failed: %s\n", name, rf_errmsg());
    } else {
        enum { TRIALS = 31 };
        double t[TRIALS];
        for (int w = 0; w < 3; w++)
            rfi_cpu_services_call(s, 0, buffers);
        double t0 = now_s();
        rfi_cpu_services_call(s, 0, buffers);
        double once = now_s() - t0;
        int inner = once > 0.002 ? 1 : (int)(0.002 / (once > 1e-7 ? once : 1e-7)) + 1;
        for (int k = 0; k < TRIALS; k++) {
            t0 = now_s();
            for (int r = 0; r < inner; r++)
                rfi_cpu_services_call(s, 0, buffers);
            t[k] = (now_s() - t0) / inner;
        }
        qsort(t, TRIALS, sizeof t[0], cmp_double);
        double med = t[TRIALS / 2];
        printf("%-28s %-19s us_per_call=%9.1f %s=%6.1f\n", name,
               rfi_cpu_services_step_path(s, 0), med * 1e6, unit, work / med * 1e-9);
    }
    rfi_cpu_services_free(s);
    for (int k = 0; k <= n_in; k++)
        free(buffers[k]);
    free(loc);
    free(layout);
}

/* A graph of two f32 arguments a, b. */
static rfi_graph *two_args(const int64_t *ad, int ar, const int64_t *bd, int br, rfi_node **a,
                           rfi_node **b)
{
    rfi_graph *g = rfi_graph_new(rf_device_cpu(), "bench_services");
    rf_dtype dts[2] = {RF_F32, RF_F32};
    int ranks[2] = {ar, br};
    int64_t dims[2][RF_MAX_RANK] = {{0}};
    memcpy(dims[0], ad, (size_t)ar * sizeof(int64_t));
    memcpy(dims[1], bd, (size_t)br * sizeof(int64_t));
    rfi_graph_set_args(g, 2, dts, ranks, (const int64_t(*)[RF_MAX_RANK])dims);
    rfi_attrs a0 = {0}, a1 = {0};
    a1.i[0] = 1;
    *a = rfi_node_new(g, RFI_OP_ARGUMENT, NULL, 0, &a0, RF_F32, ad, ar);
    *b = rfi_node_new(g, RFI_OP_ARGUMENT, NULL, 0, &a1, RF_F32, bd, br);
    return g;
}

/* a [.., .] x b contracting a's dim ca with b's dim cb. */
static void bench_matmul(const char *name, int64_t a0, int64_t a1, int64_t b0, int64_t b1,
                         int ca, int cb)
{
    rfi_node *a, *b;
    rfi_graph *g = two_args((int64_t[]){a0, a1}, 2, (int64_t[]){b0, b1}, 2, &a, &b);
    rfi_attrs at = {0};
    at.nl[2] = at.nl[3] = 1;
    at.l[2][0] = ca;
    at.l[3][0] = cb;
    rfi_node *in[2] = {a, b};
    rfi_node *y = rfi_node_new(g, RFI_OP_DOT_GENERAL, in, 2, &at, RF_F32, NULL, 0);
    int64_t k = ca == 0 ? a0 : a1;
    double flops = y ? 2.0 * (double)rfi_node_numel(y) * (double)k : 0;
    bench_node(name, g, y, flops, "gflops");
    rfi_graph_free(g);
}

/* 2-D convolution x [N,C,H,W] * w [O,I,kh,kw], stride 1, padding p, x
 * dilated by lhs_dil (flops: the products of x's elements, not of its holes). */
static void bench_conv(const char *name, const int64_t *x, const int64_t *w, int64_t pad,
                       int64_t lhs_dil)
{
    rfi_node *a, *b;
    rfi_graph *g = two_args(x, 4, w, 4, &a, &b);
    rfi_attrs at = {0};
    for (int k = 0; k < 5; k++)
        at.nl[k] = 2;
    for (int d = 0; d < 2; d++) {
        at.l[0][d] = at.l[4][d] = 1;
        at.l[1][d] = at.l[2][d] = pad;
        at.l[3][d] = lhs_dil;
    }
    at.i[0] = at.i[1] = 1;
    rfi_node *in[2] = {a, b};
    rfi_node *y = rfi_node_new(g, RFI_OP_CONVOLUTION, in, 2, &at, RF_F32, NULL, 0);
    double flops = y ? 2.0 * (double)rfi_node_numel(y) * (double)(w[1] * w[2] * w[3]) /
                           (double)(lhs_dil * lhs_dil)
                     : 0;
    bench_node(name, g, y, flops, "gflops");
    rfi_graph_free(g);
}

/* The max-pool gradient of x [N,C,H,W] under k x k windows with stride s and
 * padding pad on both sides: select_and_scatter(x, source) as the autodiff
 * emits it; with `blocked`, every tensor channel-blocked. */
static void bench_maxpool_grad(const char *name, const int64_t *x, int64_t k, int64_t s,
                               int64_t pad, bool blocked)
{
    int64_t src[4] = {x[0], x[1], (x[2] + 2 * pad - k) / s + 1, (x[3] + 2 * pad - k) / s + 1};
    rfi_node *a, *b;
    rfi_graph *g = two_args(x, 4, src, 4, &a, &b);
    rfi_attrs at = {0};
    for (int d = 0; d < 4; d++) {
        at.nl[d] = 4;
        at.l[0][d] = d < 2 ? 1 : k;
        at.l[1][d] = d < 2 ? 1 : s;
        at.l[2][d] = at.l[3][d] = d < 2 ? 0 : pad;
    }
    rfi_node *in[2] = {a, b};
    rfi_node *y = rfi_node_new(g, RFI_OP_SELECT_AND_SCATTER, in, 2, &at, RF_F32, NULL, 0);
    double bytes = y ? 4.0 * (double)(2 * rfi_node_numel(y) + rfi_node_numel(b)) : 0;
    all_blocked = blocked;
    bench_node(name, g, y, bytes, "gbytes");
    all_blocked = false;
    rfi_graph_free(g);
}

/* An embedding of a [rows, width] f32 table looked up by [batch, len] i32
 * ids: gather(table, ids) along axis 0, or (grad) its gradient,
 * scatter_add(zeros-like table, ids, rows) as the autodiff emits it. */
static void bench_embedding(const char *name, int64_t rows, int64_t width, int64_t batch,
                            int64_t len, bool grad)
{
    int64_t table[2] = {rows, width}, ids[2] = {batch, len}, upd[3] = {batch, len, width};
    rfi_graph *g = rfi_graph_new(rf_device_cpu(), "bench_services");
    rf_dtype dts[3] = {RF_F32, RF_I32, RF_F32};
    int ranks[3] = {2, 2, 3};
    int64_t dims[3][RF_MAX_RANK] = {{rows, width}, {batch, len}, {batch, len, width}};
    int n_in = grad ? 3 : 2;
    rfi_graph_set_args(g, n_in, dts, ranks, (const int64_t(*)[RF_MAX_RANK])dims);
    rfi_node *in[3];
    const int64_t *shape[3] = {table, ids, upd};
    for (int k = 0; k < n_in; k++) {
        rfi_attrs a = {0};
        a.i[0] = k;
        in[k] = rfi_node_new(g, RFI_OP_ARGUMENT, NULL, 0, &a, dts[k], shape[k], ranks[k]);
    }
    rfi_attrs at = {0}; /* axis 0 */
    rfi_node *y = rfi_node_new(g, grad ? RFI_OP_SCATTER_ADD : RFI_OP_GATHER, in, n_in, &at,
                               RF_F32, NULL, 0);
    double moved = 4.0 * (double)(batch * len * width); /* the rows looked up or added */
    double bytes = grad ? 2.0 * 4.0 * (double)(rows * width) + moved : 2.0 * moved;
    index_bound = rows;
    bench_node(name, g, y, bytes, "gbytes");
    index_bound = 1;
    rfi_graph_free(g);
}

/* A draw of [rows, cols] f32 values from an RNG node (uniform: a Dropout
 * layer's mask; normal: noise), reporting GB/s of the values written. */
static void bench_rng(const char *name, int64_t rows, int64_t cols, int dist)
{
    rfi_graph *g = rfi_graph_new(rf_device_cpu(), "bench_services");
    rf_dtype dts[1] = {RF_I64};
    int ranks[1] = {1};
    int64_t dims[1][RF_MAX_RANK] = {{2}};
    rfi_graph_set_args(g, 1, dts, ranks, (const int64_t(*)[RF_MAX_RANK])dims);
    rfi_attrs ka = {0};
    rfi_node *key = rfi_node_new(g, RFI_OP_ARGUMENT, NULL, 0, &ka, RF_I64, dims[0], 1);
    rfi_attrs at = {0};
    at.i[0] = dist;
    rfi_node *y = rfi_node_new(g, RFI_OP_RNG, &key, 1, &at, RF_F32, (int64_t[]){rows, cols}, 2);
    bench_node(name, g, y, 4.0 * (double)(rows * cols), "gbytes");
    rfi_graph_free(g);
}

int main(int argc, char **argv)
{
    only = argc > 1 ? argv[1] : NULL;
    printf("threads=%d\n", rfi_threadpool_size());
    /* mlp 784-512-256-10, batch 128 */
    bench_matmul("mlp fwd 128x784 @ 784x512", 128, 784, 784, 512, 1, 0);
    bench_matmul("mlp fwd 128x512 @ 512x256", 128, 512, 512, 256, 1, 0);
    bench_matmul("mlp fwd 128x256 @ 256x10", 128, 256, 256, 10, 1, 0);
    bench_matmul("mlp dW1 784x128 @ 128x512", 128, 784, 128, 512, 0, 0);
    bench_matmul("mlp dW2 512x128 @ 128x256", 128, 512, 128, 256, 0, 0);
    bench_matmul("mlp dx2 128x256 @ 256x512", 128, 256, 512, 256, 1, 1);
    bench_matmul("mlp dx1 128x512 @ 512x784", 128, 512, 784, 512, 1, 1);
    /* ffn's blocks 256-1024-256, batch 128: the gradients of Dense(256 => 1024) */
    bench_matmul("ffn dx 128x1024 @ 1024x256", 128, 1024, 1024, 256, 1, 0);
    bench_matmul("ffn dW 1024x128 @ 128x256", 128, 1024, 128, 256, 0, 0);
    bench_matmul("ffn dx' 128x256 @ 256x1024", 128, 256, 1024, 256, 1, 1);
    bench_matmul("ffn dW' 256x128 @ 128x1024", 128, 256, 128, 1024, 0, 0);
    /* cnn, batch 64 */
    bench_conv("cnn conv1 fwd", (int64_t[]){64, 1, 28, 28}, (int64_t[]){32, 1, 3, 3}, 0, 1);
    bench_conv("cnn conv2 fwd", (int64_t[]){64, 32, 13, 13}, (int64_t[]){64, 32, 3, 3}, 0, 1);
    bench_conv("cnn conv2 bwd-data", (int64_t[]){64, 64, 11, 11}, (int64_t[]){32, 64, 3, 3}, 2,
               1);
    bench_conv("cnn conv1 bwd-weights", (int64_t[]){1, 64, 28, 28}, (int64_t[]){32, 64, 26, 26},
               0, 1);
    bench_conv("cnn conv2 bwd-weights", (int64_t[]){32, 64, 13, 13},
               (int64_t[]){64, 64, 11, 11}, 0, 1);
    /* the ResNet example's 3x3 weight gradients (batch 128, padding 1) at
     * 16 channels (28x28 and, for the threshold, 14x14) and 32 (14x14) */
    bench_conv("resnet 16ch 28x28 bwd-weights", (int64_t[]){16, 128, 28, 28},
               (int64_t[]){16, 128, 28, 28}, 1, 1);
    bench_conv("resnet 16ch 14x14 bwd-weights", (int64_t[]){16, 128, 14, 14},
               (int64_t[]){16, 128, 14, 14}, 1, 1);
    bench_conv("resnet 32ch 14x14 bwd-weights", (int64_t[]){32, 128, 14, 14},
               (int64_t[]){32, 128, 14, 14}, 1, 1);
    /* a conv autoencoder's ConvTranspose(4x4, stride 2, pad 1) weight
     * gradients, batch 64: 32 -> 16 channels at 8x8 and 16 -> 1 at 16x16 */
    bench_conv("ae convT1 bwd-weights", (int64_t[]){32, 64, 8, 8}, (int64_t[]){16, 64, 16, 16},
               2, 2);
    bench_conv("ae convT2 bwd-weights", (int64_t[]){16, 64, 16, 16}, (int64_t[]){1, 64, 32, 32},
               2, 2);
    bench_maxpool_grad("cnn pool1 grad 2x2", (int64_t[]){64, 32, 26, 26}, 2, 2, 0, false);
    bench_maxpool_grad("cnn pool1 grad 2x2 blocked", (int64_t[]){64, 32, 26, 26}, 2, 2, 0, true);
    bench_maxpool_grad("cnn pool2 grad 2x2", (int64_t[]){64, 64, 11, 11}, 2, 2, 0, false);
    bench_maxpool_grad("cnn pool2 grad 2x2 blocked", (int64_t[]){64, 64, 11, 11}, 2, 2, 0, true);
    /* ResNet-18's stem pool at 112x112 inputs, batch 8: 3x3 windows, stride 2, pad 1 */
    bench_maxpool_grad("stem pool grad 3x3/2 pad 1", (int64_t[]){8, 64, 56, 56}, 3, 2, 1, false);
    bench_maxpool_grad("stem pool grad 3x3/2 pad 1 blocked", (int64_t[]){8, 64, 56, 56}, 3, 2, 1,
                       true);
    /* an embedding's lookup and its gradient: 128x32 ids into a 20000x64 table */
    bench_embedding("embedding gather 20000x64", 20000, 64, 128, 32, false);
    bench_embedding("embedding scatter_add grad", 20000, 64, 128, 32, true);
    /* Dropout's mask after the mlp's first layer, and normal noise of that size */
    bench_rng("rng uniform 128x512", 128, 512, 0);
    bench_rng("rng normal 128x512", 128, 512, 1);
    return 0;
}
