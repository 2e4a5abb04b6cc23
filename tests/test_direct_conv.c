/* test_direct_conv.c: the convolutions the compiled backend generates as
 * loops (src/backend/kir_conv.c, src/backend/cpu/render_conv.c) give the
 * interpreter's results, in every form the loops take: forwards and weight
 * gradients from 1, 3 and 8 input channels to 8 (one 8-lane vector) and 16
 * (one 16-lane vector; with 8-channel blocks, forwards in two 8-lane ones)
 * output channels, weight gradients to 24 and 32 in 8-channel blocks; 3x3,
 * 3x5 and 1x1 kernels; strides of 1 and 2 in either dim; padding in either
 * dim; rows that split into equal and unequal register blocks (29 outputs
 * as 10 + 10 + 9 and as 6 + 6 + 6 + 6 + 5, 15 as 5 + 5 + 5); inputs
 * row-major, channels last or read whole;
 * results and output gradients channels last, channel-blocked and
 * row-major (RF_BLOCKED=0); epilogues of bias, relu and a residual add;
 * the input gradient of a stride-1 layer (a convolution with the flipped
 * kernel) and of strided layers (the output gradient dilated by the stride:
 * in rows only, columns only, both; with the residual's add), weight
 * gradients reading an output gradient spread by a max pool's codes (2x2
 * and 3x3 windows), the input gradient of a strided 1x1 projection (32 and
 * 64 channels dilated, to 8, 16, and in vectors of 16 to 32, 48 and 64; in
 * models, summed with the other branch's), next to
 * convolutions that stay library calls (3 output channels, 16 input
 * channels).
 *
 * Each variant compiles a fresh copy of one model (same seed) and takes
 * three Adam steps on one batch; the suite runs this file with RF_CHECK=1,
 * which compares every step against the interpreter, and the variants must
 * agree with the library's convolutions (RF_DIRECT_CONV=0) up to summation
 * order. Then a sweep of single convolutions over drawn shapes (1-16
 * input channels, 1x1 to 5x5 kernels, strides and dilations up to 3,
 * padding up to 2 on either side) in each form, against the interpreter and
 * the library. test_plan checks which steps become loops.
 */
#include "test_util.h"

#define STEPS 3

static rf_device *dev;

static rf_tensor *loss(rf_model *m, rf_tensor *const *batch, int n, rf_aux *aux, void *ctx)
{
    (void)n, (void)aux, (void)ctx;
    return rf_logitcrossentropy(rf_apply(m, batch[0]), batch[1]);
}

static rf_conv_opts conv_opts(int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w)
{
    rf_conv_opts o;
    memset(&o, 0, sizeof o);
    o.stride[0] = stride_h, o.stride[1] = stride_w;
    o.pad[0] = pad_h, o.pad[1] = pad_w;
    return o;
}

/* 13x29 images: 1 -> 3 (a call: 3 output channels), 3 -> 16 with a 3x5
 * kernel (rows of 29 outputs), 16 -> 8 (a call: 16 input channels), 8 -> 8
 * (its input gradient is a loop too), 8 -> 16 1x1 at stride (1, 2). */
static rf_model *odd_shapes(void)
{
    rf_nn_seed(21);
    rf_conv_opts p1 = conv_opts(1, 1, 1, 1), p12 = conv_opts(1, 1, 1, 2),
                 s21 = conv_opts(2, 1, 0, 1), s12 = conv_opts(1, 2, 0, 0);
    return rf_chain(rf_conv2d(3, 3, 1, 3, RF_ACT_RELU, &p1),
                    rf_conv2d(3, 5, 3, 16, RF_ACT_RELU, &p12),
                    rf_conv2d(3, 3, 16, 8, RF_ACT_RELU, &s21),
                    rf_conv2d(3, 3, 8, 8, RF_ACT_RELU, &p1),
                    rf_conv2d(1, 1, 8, 16, RF_ACT_RELU, &s12), rf_flatten_layer(),
                    rf_dense(16 * 6 * 15, 10, RF_ACT_IDENTITY));
}

/* 12x12 images: 1 -> 8 with bias and relu, a residual 8 -> 8 layer (its
 * add is the convolution's epilogue, forward and backward), 8 -> 16 at
 * stride 2. */
static rf_model *residual(void)
{
    rf_nn_seed(22);
    rf_conv_opts p1 = conv_opts(1, 1, 1, 1), s2 = conv_opts(2, 2, 1, 1);
    return rf_chain(rf_conv2d(3, 3, 1, 8, RF_ACT_RELU, &p1),
                    rf_skip(rf_conv2d(3, 3, 8, 8, RF_ACT_IDENTITY, &p1), RF_COMBINE_ADD),
                    rf_conv2d(3, 3, 8, 16, RF_ACT_RELU, &s2), rf_flatten_layer(),
                    rf_dense(16 * 6 * 6, 10, RF_ACT_IDENTITY));
}

/* 12x12 images: 1 -> 32 and 4 -> 24 (then 24 -> 16), whose weight
 * gradients are loops over 8-channel blocks where activations are in
 * 8-channel blocks (AVX2; the suite also runs this file with
 * RF_LAYOUT_BLOCK=8 and 16), calls else. */
static rf_model *wide_outputs(void)
{
    rf_nn_seed(23);
    rf_conv_opts p1 = conv_opts(1, 1, 1, 1);
    return rf_chain(rf_conv2d(3, 3, 1, 32, RF_ACT_RELU, &p1),
                    rf_conv2d(3, 3, 32, 4, RF_ACT_RELU, &p1),
                    rf_conv2d(3, 3, 4, 24, RF_ACT_RELU, &p1),
                    rf_conv2d(3, 3, 24, 16, RF_ACT_RELU, &p1), rf_flatten_layer(),
                    rf_dense(16 * 12 * 12, 10, RF_ACT_IDENTITY));
}

/* 12x12 images: 1 -> 32, a 2x2 max pool, 32 -> 4, 4 -> 16, a 3x3 max pool.
 * The first layer's weight gradient reads its output gradient spread by the
 * pool's codes (kir.h, spread; no step materialises it) where it is a loop
 * (channel-blocked); the second pool's spread gradient also feeds the
 * 4 -> 16 layer's input gradient, so that layer's weight gradient reads it
 * materialised. */
static rf_model *pooled(void)
{
    rf_nn_seed(24);
    rf_conv_opts p1 = conv_opts(1, 1, 1, 1);
    return rf_chain(rf_conv2d(3, 3, 1, 32, RF_ACT_RELU, &p1), rf_maxpool(2, 2, 0, 0),
                    rf_conv2d(3, 3, 32, 4, RF_ACT_RELU, &p1),
                    rf_conv2d(3, 3, 4, 16, RF_ACT_RELU, &p1), rf_maxpool(3, 3, 0, 0),
                    rf_flatten_layer(), rf_dense(16 * 2 * 2, 10, RF_ACT_IDENTITY));
}

/* 12x12 images: 1 -> 16 and a 3x3 max pool, whose spread gradient the
 * weight gradient reads in 16-channel blocks, in 8-channel ones (two
 * vectors) and row-major (where a vector holds 16 floats). */
static rf_model *pooled_3x3(void)
{
    rf_nn_seed(25);
    rf_conv_opts p1 = conv_opts(1, 1, 1, 1);
    return rf_chain(rf_conv2d(3, 3, 1, 16, RF_ACT_RELU, &p1), rf_maxpool(3, 3, 0, 0),
                    rf_flatten_layer(), rf_dense(16 * 4 * 4, 10, RF_ACT_IDENTITY));
}

/* 12x12 images: 1 -> 16, then a strided 16 -> 32 block whose shortcut is a
 * 1x1 projection at stride 2: the projection's input gradient (the output
 * gradient dilated by 2, 32 channels, a 1x1 kernel) is a loop, summed with
 * the other branch's (the add is one of the two steps' epilogue). */
static rf_model *projection(void)
{
    rf_nn_seed(26);
    rf_conv_opts p1 = conv_opts(1, 1, 1, 1), s2 = conv_opts(2, 2, 0, 0),
                 s2p1 = conv_opts(2, 2, 1, 1);
    return rf_chain(rf_conv2d(3, 3, 1, 16, RF_ACT_RELU, &p1),
                    rf_parallel(RF_COMBINE_ADD, rf_conv2d(1, 1, 16, 32, RF_ACT_IDENTITY, &s2),
                                rf_conv2d(3, 3, 16, 32, RF_ACT_IDENTITY, &s2p1)),
                    rf_flatten_layer(), rf_dense(32 * 6 * 6, 10, RF_ACT_IDENTITY));
}

/* The same at the ResNet example's third block's widths: 1 -> 32, then a
 * strided 32 -> 64 block with a 1x1 projection, whose input gradient (64
 * channels dilated, to 32 outputs) is a loop of two vectors of 16. */
static rf_model *wide_projection(void)
{
    rf_nn_seed(27);
    rf_conv_opts p1 = conv_opts(1, 1, 1, 1), s2 = conv_opts(2, 2, 0, 0),
                 s2p1 = conv_opts(2, 2, 1, 1);
    return rf_chain(rf_conv2d(3, 3, 1, 32, RF_ACT_RELU, &p1),
                    rf_parallel(RF_COMBINE_ADD, rf_conv2d(1, 1, 32, 64, RF_ACT_IDENTITY, &s2),
                                rf_conv2d(3, 3, 32, 64, RF_ACT_IDENTITY, &s2p1)),
                    rf_flatten_layer(), rf_dense(64 * 5 * 5, 10, RF_ACT_IDENTITY));
}

typedef rf_model *(*model_fn)(void);

/* Three steps of a fresh model under the given settings; the losses in out. */
static void run_variant(model_fn model, int64_t h, int64_t w, const char *label,
                        const char *blocked, const char *direct, double *out)
{
    tu_set_env("RF_BLOCKED", blocked);
    tu_set_env("RF_DIRECT_CONV", direct);
    tu_train_steps(dev, model(), h, w, 23, loss, label, STEPS, out);
    tu_set_env("RF_BLOCKED", NULL);
    tu_set_env("RF_DIRECT_CONV", NULL);
}

static void compare_variants(model_fn model, int64_t h, int64_t w, const char *name)
{
    double laid_out[STEPS], plain[STEPS], library[STEPS];
    char label[96];
    snprintf(label, sizeof label, "%s: loops, layouts", name);
    run_variant(model, h, w, label, NULL, NULL, laid_out);
    snprintf(label, sizeof label, "%s: loops, row-major", name);
    run_variant(model, h, w, label, "0", NULL, plain);
    snprintf(label, sizeof label, "%s: library", name);
    run_variant(model, h, w, label, NULL, "0", library);
    for (int s = 0; s < STEPS; s++) {
        CHECK_NEAR(laid_out[s], library[s], 0, 1e-5);
        CHECK_NEAR(plain[s], library[s], 0, 1e-5);
    }
}

/* ---- A sweep of single convolutions ---------------------------------------------------- *
 * y = conv(x, w) over arguments (row-major, so every direct form takes
 * them), in the three forms, for shapes drawn from a fixed generator: the
 * compiled run is checked against the interpreter (RF_CHECK) and, here,
 * against the library (RF_DIRECT_CONV=0). */

typedef enum { SWEEP_FORWARD, SWEEP_DILATED, SWEEP_WEIGHT_GRAD } sweep_kind;

typedef struct sweep_case {
    sweep_kind kind;
    int64_t n, c, o, h, w, kh, kw;
    int64_t stride[2], pad_lo[2], pad_hi[2], dilation[2];
    int64_t grad[2]; /* WEIGHT_GRAD: the output gradient's spatial dims */
} sweep_case;

static const int64_t swap01[4] = {1, 0, 2, 3};

static void sweep_fn(rf_trace *t, void *ctx)
{
    const sweep_case *k = ctx;
    rf_conv_params p = rf_conv_params_default(2);
    for (int d = 0; d < 2; d++) {
        p.pad_lo[d] = k->pad_lo[d];
        p.pad_hi[d] = k->pad_hi[d];
        if (k->kind == SWEEP_WEIGHT_GRAD)
            p.rhs_dilation[d] = k->stride[d];
        else
            p.stride[d] = k->stride[d], p.lhs_dilation[d] = k->dilation[d];
    }
    rf_tensor *x = rf_arg(t, 0), *w = rf_arg(t, 1);
    if (k->kind == SWEEP_WEIGHT_GRAD) /* as the autodiff writes it */
        rf_return(t, rf_conv(rf_transpose(x, swap01), rf_transpose(w, swap01), &p));
    else
        rf_return(t, rf_conv(x, w, &p));
}

static uint64_t sweep_state = 88172645463325252ull;

static int64_t draw(int64_t lo, int64_t hi) /* uniform in [lo, hi] */
{
    sweep_state ^= sweep_state << 13;
    sweep_state ^= sweep_state >> 7;
    sweep_state ^= sweep_state << 17;
    return lo + (int64_t)(sweep_state % (uint64_t)(hi - lo + 1));
}

/* The output extent of a convolution along one dim (<= 0: none). */
static int64_t out_extent(int64_t in, int64_t k, int64_t stride, int64_t lo, int64_t hi,
                          int64_t dil)
{
    int64_t dilated = (in - 1) * dil + 1 + lo + hi;
    return dilated < k ? 0 : (dilated - k) / stride + 1;
}

static sweep_case draw_case(sweep_kind kind)
{
    sweep_case k;
    memset(&k, 0, sizeof k);
    k.kind = kind;
    k.n = draw(1, 3);
    k.c = draw(1, kind == SWEEP_DILATED ? 16 : 15);
    k.o = draw(0, 1) ? 16 : 8;
    k.kh = draw(1, 5), k.kw = draw(1, 5);
    k.h = draw(k.kh, 17), k.w = draw(k.kw, 17);
    for (int d = 0; d < 2; d++) {
        k.stride[d] = kind == SWEEP_DILATED ? 1 : draw(1, 3);
        k.dilation[d] = kind == SWEEP_DILATED ? draw(1, 3) : 1;
        k.pad_lo[d] = draw(0, 2);
        k.pad_hi[d] = draw(0, 2);
    }
    return k;
}

/* Runs case k with direct convolutions on or off; the output in *out. */
static bool sweep_run(const sweep_case *k, const char *direct, rf_array **out)
{
    int64_t xd[4] = {k->n, k->c, k->h, k->w}, wd[4] = {k->o, k->c, k->kh, k->kw};
    if (k->kind == SWEEP_WEIGHT_GRAD) /* w is the output gradient */
        wd[0] = k->n, wd[1] = k->o, wd[2] = k->grad[0], wd[3] = k->grad[1];
    rf_array *xh = rf_rand(RF_F32, xd, 4, 31), *wh = rf_rand(RF_F32, wd, 4, 32);
    rf_array *args[2] = {xh ? rf_array_to(xh, dev) : NULL, wh ? rf_array_to(wh, dev) : NULL};
    tu_set_env("RF_DIRECT_CONV", direct);
    *out = NULL;
    bool ok = args[0] && args[1];
    if (ok)
        CHECK_OK(rf_jit(sweep_fn, (void *)k, args, 2, out, 1));
    tu_set_env("RF_DIRECT_CONV", NULL);
    rf_array_free(args[0]);
    rf_array_free(args[1]);
    rf_array_free(xh);
    rf_array_free(wh);
    return ok && *out;
}

/* Case k's direct convolution against the library's. */
static void sweep_one(const sweep_case *k)
{
    rf_array *direct = NULL, *library = NULL;
    if (sweep_run(k, NULL, &direct) && sweep_run(k, "0", &library)) {
        int64_t n = rf_array_numel(direct);
        float *a = malloc((size_t)n * sizeof(float)), *b = malloc((size_t)n * sizeof(float));
        CHECK(a && b && n == rf_array_numel(library));
        if (a && b && n == rf_array_numel(library)) {
            CHECK_OK(rf_array_read(direct, a, (size_t)n * sizeof(float)));
            CHECK_OK(rf_array_read(library, b, (size_t)n * sizeof(float)));
            int64_t bad = 0;
            for (int64_t i = 0; i < n; i++)
                bad += !(fabsf(a[i] - b[i]) <= 1e-5f * (1 + fabsf(b[i])) * (float)k->c * 9);
            if (bad)
                printf("sweep kind %d: c %lld o %lld %lldx%lld on %lldx%lld stride %lldx%lld "
                       "dilation %lldx%lld: %lld of %lld differ\n", (int)k->kind, (long long)k->c,
                       (long long)k->o, (long long)k->kh, (long long)k->kw, (long long)k->h,
                       (long long)k->w, (long long)k->stride[0], (long long)k->stride[1],
                       (long long)k->dilation[0], (long long)k->dilation[1], (long long)bad,
                       (long long)n);
            CHECK(bad == 0);
        }
        free(a);
        free(b);
    }
    rf_array_free(direct);
    rf_array_free(library);
}

static void sweep(sweep_kind kind, int cases)
{
    for (int done = 0; done < cases;) {
        sweep_case k = draw_case(kind);
        int64_t oh = out_extent(k.h, k.kh, k.stride[0], k.pad_lo[0], k.pad_hi[0], k.dilation[0]);
        int64_t ow = out_extent(k.w, k.kw, k.stride[1], k.pad_lo[1], k.pad_hi[1], k.dilation[1]);
        /* outputs, and kir_conv.c's limit on the kernel's (gradient's) table */
        int64_t table_max = kind == SWEEP_WEIGHT_GRAD ? 1536 : 4096;
        if (oh <= 0 || ow <= 0 || k.c * k.kh * k.kw * k.o > table_max)
            continue;
        /* WEIGHT_GRAD: the forward's outputs, padded so the result is kh x kw */
        if (k.kind == SWEEP_WEIGHT_GRAD)
            for (int d = 0; d < 2; d++) {
                int64_t in = d ? k.w : k.h, kk = d ? k.kw : k.kh;
                k.grad[d] = d ? ow : oh;
                k.pad_hi[d] = kk - in - k.pad_lo[d] + (k.grad[d] - 1) * k.stride[d];
            }
        done++;
        sweep_one(&k);
    }
}

int main(void)
{
    dev = rf_device_cpu();
    compare_variants(odd_shapes, 13, 29, "odd shapes");
    compare_variants(residual, 12, 12, "residual");
    compare_variants(wide_outputs, 12, 12, "wide outputs");
    compare_variants(pooled, 12, 12, "pooled");
    compare_variants(pooled_3x3, 12, 12, "pooled 3x3");
    compare_variants(projection, 12, 12, "projection");
    compare_variants(wide_projection, 10, 10, "wide projection");
    sweep(SWEEP_FORWARD, 10);
    sweep(SWEEP_DILATED, 8);
    sweep(SWEEP_WEIGHT_GRAD, 8);
    /* 1x1 kernels over inputs dilated by the stride, up to 64 channels (the input gradients
     * of strided 1x1 projections) */
    sweep_one(&(sweep_case){.kind = SWEEP_DILATED, .n = 2, .c = 32, .o = 16, .kh = 1, .kw = 1,
                            .h = 7, .w = 7, .stride = {1, 1}, .dilation = {2, 2},
                            .pad_hi = {1, 1}});
    sweep_one(&(sweep_case){.kind = SWEEP_DILATED, .n = 3, .c = 64, .o = 8, .kh = 1, .kw = 1,
                            .h = 5, .w = 9, .stride = {1, 1}, .dilation = {2, 3},
                            .pad_hi = {1, 2}});
    /* and to several vectors of 16 outputs */
    sweep_one(&(sweep_case){.kind = SWEEP_DILATED, .n = 2, .c = 64, .o = 32, .kh = 1, .kw = 1,
                            .h = 7, .w = 7, .stride = {1, 1}, .dilation = {2, 2},
                            .pad_hi = {1, 1}});
    sweep_one(&(sweep_case){.kind = SWEEP_DILATED, .n = 3, .c = 40, .o = 48, .kh = 1, .kw = 1,
                            .h = 4, .w = 6, .stride = {1, 1}, .dilation = {3, 2},
                            .pad_lo = {0, 1}, .pad_hi = {2, 1}});
    sweep_one(&(sweep_case){.kind = SWEEP_DILATED, .n = 2, .c = 16, .o = 64, .kh = 1, .kw = 1,
                            .h = 5, .w = 6, .stride = {1, 1}, .dilation = {2, 1},
                            .pad_hi = {1, 0}});
    /* no input channels: the results are zeros (the generator divided by 0 planning its
     * prefetches) */
    sweep_one(&(sweep_case){.kind = SWEEP_FORWARD, .n = 2, .c = 0, .o = 8, .kh = 3, .kw = 3,
                            .h = 9, .w = 9, .stride = {1, 1}, .dilation = {1, 1},
                            .pad_lo = {1, 1}, .pad_hi = {1, 1}});
    return tu_finish("test_direct_conv");
}
