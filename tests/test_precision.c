/* test_precision.c: matrix products of RF_PRECISION_BF16 (reflux/trace.h): how
 * operands round (ties, subnormals, the extremes, NaN), products of several
 * forms, their gradients, the trace, compile and model settings with their
 * errors, and the compile cache keyed on a model's precision.
 *
 * Oracle: products computed here in double from operands rounded by
 * round_bf16 below, written from the bfloat16 format (8 significant bits,
 * the f32 exponent range) with the C library's rint, independently of the
 * library's bit manipulation. The library's products must match it to f32
 * rounding of the sums; the same products of RF_PRECISION_F32 must match the
 * unrounded computation and differ from the rounded one (the data carries
 * more than 8 significant bits), so a setting that changed nothing fails.
 */
#include <float.h>
#include <stdint.h>

#include "test_prog.h"

/* ---- The oracle --------------------------------------------------------------------- */

/* x rounded to bfloat16: to nearest even at 8 significant bits; a value below
 * the smallest normal float to a zero of its sign; past the largest bfloat16
 * (half a step below 2^128 or more) to infinity. */
static double round_bf16(float x)
{
    if (isnan(x) || isinf(x) || x == 0)
        return x;
    if (fabsf(x) < FLT_MIN)
        return signbit(x) ? -0.0 : 0.0;
    int e;
    double m = frexp(x, &e); /* x = m 2^e, 0.5 <= |m| < 1 */
    double r = ldexp(rint(ldexp(m, 8)), e - 8);
    return fabs(r) >= ldexp(1.0, 128) ? copysign(INFINITY, r) : r;
}

/* c[B, M, N] = a[B, M, K] b[B, K, N] in double, operands rounded if `bf16`;
 * scale: the sums of |terms| (the bound an f32 sum's error is measured in). */
static void product(const double *a, const double *b, int64_t B, int64_t M, int64_t K,
                    int64_t N, bool bf16, double *c, double *scale)
{
    for (int64_t q = 0; q < B; q++)
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) {
                double s = 0, t = 0;
                for (int64_t k = 0; k < K; k++) {
                    double x = a[(q * M + i) * K + k], y = b[(q * K + k) * N + j];
                    if (bf16) {
                        x = round_bf16((float)x);
                        y = round_bf16((float)y);
                    }
                    s += x * y;
                    t += fabs(x * y);
                }
                c[(q * M + i) * N + j] = s;
                if (scale)
                    scale[(q * M + i) * N + j] = t;
            }
}

/* n values in [-2, 2) with all 24 bits of an f32 in play. */
static double *random_values(int64_t n, uint64_t seed)
{
    double *v = malloc((size_t)n * sizeof *v);
    for (int64_t i = 0; i < n; i++)
        v[i] = (float)tp_rand(&seed, -2, 2);
    return v;
}

/* Checks got against want to 1e-5 of each element's sum of |terms|. */
static void expect_sums(const char *label, const rf_array *got, const double *want,
                        const double *scale, int64_t n)
{
    double *g = tp_read(got, NULL);
    int bad = 0;
    for (int64_t i = 0; g && i < n; i++)
        if (!(fabs(g[i] - want[i]) <= 1e-5 * scale[i] + 1e-30) && bad++ < 4)
            fprintf(stderr, "  %s: element %lld = %.9g, expected %.9g\n", label, (long long)i,
                    g[i], want[i]);
    CHECK(g && bad == 0);
    free(g);
}

/* The largest |x - y| / scale over n elements. */
static double worst_gap(const double *x, const double *y, const double *scale, int64_t n)
{
    double w = 0;
    for (int64_t i = 0; i < n; i++)
        w = fmax(w, fabs(x[i] - y[i]) / (scale[i] + 1e-30));
    return w;
}

static int count(const char *text, const char *needle)
{
    int n = 0;
    for (const char *p = text; p && (p = strstr(p, needle)); p += strlen(needle))
        n++;
    return n;
}

/* ---- Rounding ------------------------------------------------------------------------- */

static void build_outer(rf_trace *t, rf_tensor *const *a, int n, void *user)
{
    (void)n, (void)user;
    rf_trace_set_matmul_precision(t, RF_PRECISION_BF16);
    rf_return(t, rf_matmul(a[0], a[1])); /* [n, 1] x [1, 1]: each output one product */
}

/* The rounding cases: ties, flushed subnormals, overflow and NaN. */
static const float rounding_values[] = {
        1.0f + 0x1p-8f,              /* a tie: to 1 (even) */
        1.0f + 0x3p-8f,              /* a tie: to 1 + 2^-6 (even) */
        1.0f + 0x1p-8f + 0x1p-20f,   /* past the tie: up */
        -(1.0f + 0x5p-9f),           /* below the tie: down in magnitude */
        1e-40f, -1e-40f,             /* subnormal: zeros of their sign */
        FLT_MIN, -FLT_MIN * (1.0f + 0x1p-9f),
        FLT_MAX, -FLT_MAX,           /* past the largest bfloat16: infinities */
        0x1.fep127f,                 /* the largest bfloat16 */
        INFINITY, -INFINITY, NAN, 0.0f, -0.0f, 3.14159265f, -2.71828183f, 65504.0f, 1e-30f,
};
enum { N_ROUNDING = sizeof rounding_values / sizeof rounding_values[0] };

/* Checks each output against its value rounded (not the sign of a zero: a
 * sum from +0 loses it). */
static void expect_rounded(const char *label, const rf_array *out)
{
    double *got = tp_read(out, NULL);
    int bad = 0;
    for (int i = 0; got && i < N_ROUNDING; i++) {
        double want = round_bf16(rounding_values[i]);
        bool same = isnan(want) ? isnan(got[i]) : got[i] == want;
        if (!same && bad++ < 6)
            fprintf(stderr, "  %s: %a gave %a, expected %a\n", label,
                    (double)rounding_values[i], got[i], want);
    }
    CHECK(got && bad == 0);
    free(got);
}

/* Each value times 1: the product is exactly the rounded value, so the cases
 * show one by one. */
static void test_rounding(void)
{
    const float *values = rounding_values;
    enum { N = N_ROUNDING };
    double v[N];
    for (int i = 0; i < N; i++)
        v[i] = values[i];
    rf_array *in[2] = {tp_host(RF_F32, RF_SHAPE(N, 1), v), tp_host(RF_F32, RF_SHAPE(1, 1),
                                                                    (double[]){1.0})};
    rf_array *out = NULL;
    CHECK_OK(tp_run(build_outer, NULL, in, 2, &out, 1));
    expect_rounded("rounding", out);
    rf_array_free(out);
    tp_free_all(in, 2);
}

static void build_rows(rf_trace *t, rf_tensor *const *a, int n, void *user)
{
    (void)n, (void)user;
    int64_t contract = 1;
    rf_trace_set_matmul_precision(t, RF_PRECISION_BF16);
    rf_return(t, rf_dot_general(a[0], a[1], NULL, NULL, 0, &contract, &contract, 1));
}

/* The cases again through a batch-1 dense layer's product, x [1, K] times
 * the rows of w [N, K], which the CPU backend computes four rows at a time,
 * 32 points per step with AVX512-BF16 instructions where the CPU has them
 * (rounding in the conversion), then the last points in C: row i holds case
 * i at point i (so every case goes through the instructions but the last
 * ones, past K's multiple of 32) and zeros elsewhere, and x is all ones. */
static void test_rounding_rows(void)
{
    enum { N = N_ROUNDING, K = 34 };
    double x[K], *w = calloc(N * K, sizeof *w);
    for (int k = 0; k < K; k++)
        x[k] = 1;
    for (int i = 0; i < N; i++)
        w[i * K + (i < N - 2 ? i : 32 + i - (N - 2))] = rounding_values[i];
    rf_array *in[2] = {tp_host(RF_F32, RF_SHAPE(1, K), x), tp_host(RF_F32, RF_SHAPE(N, K), w)};
    rf_array *out = NULL;
    CHECK_OK(tp_run(build_rows, NULL, in, 2, &out, 1));
    expect_rounded("rounding rows", out);
    rf_array_free(out);
    tp_free_all(in, 2);
    free(w);
}

/* ---- Products of several forms ---------------------------------------------------------- */

typedef struct form {
    const char *name;
    int64_t batch, m, k, n;
    bool lhs_transposed; /* a given as [K, M] and contracted on its dim 0 */
    rf_precision precision;
    bool rhs_rows; /* b given as [N, K] and contracted on its dim 1 (a dense layer's) */
} form;

static void build_form(rf_trace *t, rf_tensor *const *a, int n, void *user)
{
    (void)n;
    const form *f = user;
    rf_trace_set_matmul_precision(t, f->precision);
    if (f->batch > 1) {
        int64_t batch = 0, lc = 2, rc = 1;
        rf_return(t, rf_dot_general(a[0], a[1], &batch, &batch, 1, &lc, &rc, 1));
    } else if (f->lhs_transposed || f->rhs_rows) {
        int64_t lc = f->lhs_transposed ? 0 : 1, rc = f->rhs_rows ? 1 : 0;
        rf_return(t, rf_dot_general(a[0], a[1], NULL, NULL, 0, &lc, &rc, 1));
    } else {
        rf_return(t, rf_matmul(a[0], a[1]));
    }
}

/* v [rows, cols] as a new [cols, rows] array. */
static double *transposed(const double *v, int64_t rows, int64_t cols)
{
    double *t = malloc((size_t)(rows * cols) * sizeof *t);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            t[c * rows + r] = v[r * cols + c];
    return t;
}

/* One form at both precisions: each matches its own oracle, and the two
 * differ by far more than f32 rounding. */
static void test_form(form f, uint64_t seed)
{
    int64_t na = f.batch * f.m * f.k, nb = f.batch * f.k * f.n, nc = f.batch * f.m * f.n;
    double *a = random_values(na, seed), *b = random_values(nb, seed + 1);
    double *want[2], *scale = malloc((size_t)nc * sizeof *scale);
    for (int p = 0; p < 2; p++) {
        want[p] = malloc((size_t)nc * sizeof **want);
        product(a, b, f.batch, f.m, f.k, f.n, p == 1, want[p], scale);
    }
    double *a_given = f.lhs_transposed ? transposed(a, f.m, f.k) : a; /* stored [K, M] */
    double *b_given = f.rhs_rows ? transposed(b, f.k, f.n) : b;         /* stored [N, K] */
    rf_array *in[2];
    if (f.batch > 1) {
        in[0] = tp_host(RF_F32, RF_SHAPE(f.batch, f.m, f.k), a_given);
        in[1] = tp_host(RF_F32, RF_SHAPE(f.batch, f.k, f.n), b);
    } else {
        in[0] = f.lhs_transposed ? tp_host(RF_F32, RF_SHAPE(f.k, f.m), a_given)
                                 : tp_host(RF_F32, RF_SHAPE(f.m, f.k), a_given);
        in[1] = f.rhs_rows ? tp_host(RF_F32, RF_SHAPE(f.n, f.k), b_given)
                           : tp_host(RF_F32, RF_SHAPE(f.k, f.n), b);
    }
    for (int p = 0; p < 2; p++) {
        f.precision = p ? RF_PRECISION_BF16 : RF_PRECISION_F32;
        rf_array *out = NULL;
        CHECK_OK(tp_run(build_form, &f, in, 2, &out, 1));
        char label[96];
        snprintf(label, sizeof label, "%s (%s)", f.name, rf_precision_name(f.precision));
        expect_sums(label, out, want[p], scale, nc);
        rf_array_free(out);
    }
    double gap = worst_gap(want[0], want[1], scale, nc);
    CHECK(gap > 1e-4); /* the oracles tell the precisions apart */
    if (!(gap > 1e-4))
        fprintf(stderr, "  %s: the precisions differ by only %.3g\n", f.name, gap);
    tp_free_all(in, 2);
    if (a_given != a)
        free(a_given);
    if (b_given != b)
        free(b_given);
    free(a);
    free(b);
    free(want[0]);
    free(want[1]);
    free(scale);
}

/* The first two are large enough for the CPU backend's matmul calls, the
 * others are its generated loops. */
static void test_forms(void)
{
    test_form((form){"plain", 1, 64, 130, 45, false, 0, false}, 11);
    test_form((form){"lhs transposed", 1, 48, 128, 40, true, 0, false}, 21);
    test_form((form){"batched", 3, 20, 40, 10, false, 0, false}, 31);
    test_form((form){"small", 1, 2, 3, 2, false, 0, false}, 41);
    test_form((form){"matrix-vector", 1, 1, 300, 64, false, 0, false}, 51);
    /* a batch-1 dense layer: four rows at a time, bf16 instructions where the
     * CPU has them; 30 rows and 300 points leave both remainders */
    test_form((form){"dense rows", 1, 1, 300, 30, false, 0, true}, 61);
    /* five of them: one output at a time, the same instructions */
    test_form((form){"dense rows, batch 5", 1, 5, 100, 30, false, 0, true}, 71);
}

/* ---- Convolutions ---------------------------------------------------------------------- */

typedef struct conv_form {
    const char *name;
    int64_t n, c, size, o, k; /* x [n, c, size, size], w [o, c / groups, k, k] */
    int64_t stride, pad, groups;
    rf_precision precision;
} conv_form;

static int64_t conv_out(const conv_form *f)
{
    return (f->size + 2 * f->pad - f->k) / f->stride + 1;
}

/* y = conv(x, w) and the gradients of sum(y * ct): dx, dw, in double from
 * operands rounded if `bf16`, with the sums of |terms| of each. */
typedef struct conv_ref {
    double *y, *dx, *dw, *sy, *sdx, *sdw;
} conv_ref;

/* v as the product reads it: rounded if bf16. */
static double operand(double v, bool bf16)
{
    return bf16 ? round_bf16((float)v) : v;
}

static void conv_reference(const conv_form *f, const double *x, const double *w,
                           const double *ct, bool bf16, conv_ref *r)
{
    int64_t oh = conv_out(f), cg = f->c / f->groups, og = f->o / f->groups, sz = f->size;
    int64_t ny = f->n * f->o * oh * oh, nx = f->n * f->c * sz * sz, nw = f->o * cg * f->k * f->k;
    double **all[6] = {&r->y, &r->dx, &r->dw, &r->sy, &r->sdx, &r->sdw};
    const int64_t sizes[6] = {ny, nx, nw, ny, nx, nw};
    for (int k = 0; k < 6; k++)
        *all[k] = calloc((size_t)sizes[k], sizeof(double));
    for (int64_t n = 0; n < f->n; n++)
        for (int64_t o = 0; o < f->o; o++)
            for (int64_t i = 0; i < oh; i++)
                for (int64_t j = 0; j < oh; j++) {
                    int64_t yi = ((n * f->o + o) * oh + i) * oh + j;
                    double c = operand(ct[yi], bf16);
                    for (int64_t ci = 0; ci < cg; ci++)
                        for (int64_t a = 0; a < f->k; a++)
                            for (int64_t b = 0; b < f->k; b++) {
                                int64_t p = i * f->stride - f->pad + a;
                                int64_t q = j * f->stride - f->pad + b;
                                if (p < 0 || q < 0 || p >= sz || q >= sz)
                                    continue;
                                int64_t ch = o / og * cg + ci;
                                int64_t xi = ((n * f->c + ch) * sz + p) * sz + q;
                                int64_t wi = ((o * cg + ci) * f->k + a) * f->k + b;
                                double xv = operand(x[xi], bf16), wv = operand(w[wi], bf16);
                                r->y[yi] += xv * wv;
                                r->sy[yi] += fabs(xv * wv);
                                r->dx[xi] += c * wv;
                                r->sdx[xi] += fabs(c * wv);
                                r->dw[wi] += xv * c;
                                r->sdw[wi] += fabs(xv * c);
                            }
                }
}

static void conv_ref_free(conv_ref *r)
{
    double *all[6] = {r->y, r->dx, r->dw, r->sy, r->sdx, r->sdw};
    for (int k = 0; k < 6; k++)
        free(all[k]);
}

static void build_conv(rf_trace *t, rf_tensor *const *a, int n, void *user)
{
    (void)n;
    const conv_form *f = user;
    rf_trace_set_matmul_precision(t, f->precision);
    rf_conv_params p = rf_conv_params_default(2);
    for (int d = 0; d < 2; d++) {
        p.stride[d] = f->stride;
        p.pad_lo[d] = p.pad_hi[d] = f->pad;
    }
    p.feature_group_count = f->groups;
    rf_tensor *y = rf_conv(a[0], a[1], &p);
    rf_tensor *g[2] = {NULL, NULL};
    rf_grad(t, rf_sum_all(rf_mul(y, a[2])), a, 2, g);
    rf_return(t, y);
    rf_return(t, g[0]);
    rf_return(t, g[1]);
}

/* One convolution and its two gradients at both precisions, each against
 * its own oracle, the two oracles far apart. */
static void test_conv_form(conv_form f, uint64_t seed)
{
    int64_t oh = conv_out(&f), sz = f.size, kw = f.c / f.groups;
    int64_t ny = f.n * f.o * oh * oh, nx = f.n * f.c * sz * sz, nw = f.o * kw * f.k * f.k;
    double *x = random_values(nx, seed), *w = random_values(nw, seed + 1);
    double *ct = random_values(ny, seed + 2);
    /* Scaled by 1/8 (every bit kept): RF_CHECK compares each element to the
     * interpreter's within 1e-4 of it plus 1e-6, and a sum of hundreds of
     * terms of [-2, 2)^2 that cancels to near zero carries f32 rounding
     * beyond that. */
    for (int64_t i = 0; i < nx || i < nw || i < ny; i++) {
        if (i < nx)
            x[i] *= 0.125;
        if (i < nw)
            w[i] *= 0.125;
        if (i < ny)
            ct[i] *= 0.125;
    }
    rf_array *in[3] = {tp_host(RF_F32, RF_SHAPE(f.n, f.c, sz, sz), x),
                       tp_host(RF_F32, RF_SHAPE(f.o, kw, f.k, f.k), w),
                       tp_host(RF_F32, RF_SHAPE(f.n, f.o, oh, oh), ct)};
    conv_ref ref[2];
    for (int p = 0; p < 2; p++) {
        conv_reference(&f, x, w, ct, p == 1, &ref[p]);
        f.precision = p ? RF_PRECISION_BF16 : RF_PRECISION_F32;
        rf_array *out[3] = {NULL, NULL, NULL};
        CHECK_OK(tp_run(build_conv, &f, in, 3, out, 3));
        char label[96];
        snprintf(label, sizeof label, "%s (%s)", f.name, rf_precision_name(f.precision));
        expect_sums(label, out[0], ref[p].y, ref[p].sy, ny);
        snprintf(label, sizeof label, "%s (%s), gradient of x", f.name,
                 rf_precision_name(f.precision));
        expect_sums(label, out[1], ref[p].dx, ref[p].sdx, nx);
        snprintf(label, sizeof label, "%s (%s), gradient of w", f.name,
                 rf_precision_name(f.precision));
        expect_sums(label, out[2], ref[p].dw, ref[p].sdw, nw);
        tp_free_all(out, 3);
    }
    double gap = fmin(worst_gap(ref[0].y, ref[1].y, ref[1].sy, ny),
                      fmin(worst_gap(ref[0].dx, ref[1].dx, ref[1].sdx, nx),
                           worst_gap(ref[0].dw, ref[1].dw, ref[1].sdw, nw)));
    CHECK(gap > 1e-4);
    if (!(gap > 1e-4))
        fprintf(stderr, "  %s: the precisions differ by only %.3g\n", f.name, gap);
    conv_ref_free(&ref[0]);
    conv_ref_free(&ref[1]);
    tp_free_all(in, 3);
    free(x);
    free(w);
    free(ct);
}

/* Forms that take the CPU backend's different convolutions: channel-blocked
 * (16 -> 32), strided (its input gradient lhs-dilated), a first layer (1
 * channel), 8 channels (generated loops, strided too), grouped, and an 8x8
 * kernel (im2col). */
static void test_conv_forms(void)
{
    test_conv_form((conv_form){"conv 16->32", 4, 16, 10, 32, 3, 1, 1, 1, 0}, 101);
    test_conv_form((conv_form){"conv strided", 3, 16, 11, 16, 3, 2, 1, 1, 0}, 111);
    test_conv_form((conv_form){"conv first layer", 4, 1, 12, 16, 3, 1, 0, 1, 0}, 121);
    test_conv_form((conv_form){"conv 8->8", 4, 8, 12, 8, 3, 1, 1, 1, 0}, 151);
    test_conv_form((conv_form){"conv 8->16 strided", 4, 8, 12, 16, 3, 2, 1, 1, 0}, 161);
    test_conv_form((conv_form){"conv grouped", 2, 8, 9, 8, 3, 1, 1, 2, 0}, 131);
    test_conv_form((conv_form){"conv 8x8 kernel", 2, 3, 14, 4, 8, 1, 0, 1, 0}, 141);
}

/* Each value times 1 through a 1x1 convolution, as test_rounding through a
 * product: the conversion the convolutions' reorders do rounds alike. The
 * 32 channels (the values, then ones) make it one of the library's. */
static void build_conv_rounding(rf_trace *t, rf_tensor *const *a, int n, void *user)
{
    (void)n, (void)user;
    rf_trace_set_matmul_precision(t, RF_PRECISION_BF16);
    rf_return(t, rf_conv(a[0], a[1], NULL));
}

static void test_conv_rounding(void)
{
    const float values[] = {
        1.0f + 0x1p-8f, 1.0f + 0x3p-8f, 1.0f + 0x1p-8f + 0x1p-20f, -(1.0f + 0x5p-9f),
        1e-40f, -1e-40f, FLT_MIN, -FLT_MIN * (1.0f + 0x1p-9f), FLT_MAX, -FLT_MAX,
        0x1.fep127f, INFINITY, -INFINITY, NAN, 3.14159265f, -2.71828183f, 65504.0f, 1e-30f,
    };
    enum { N = sizeof values / sizeof values[0], C = 32, P = 16 };
    /* x [1, C, P, N]: channel 0 holds the values at every row, the others zeros; w picks
     * channel 0 for each of 16 outputs */
    static double x[C * P * N], w[16 * C];
    for (int p = 0; p < P; p++)
        for (int i = 0; i < N; i++)
            x[p * N + i] = values[i];
    for (int o = 0; o < 16; o++)
        w[o * C] = 1.0;
    rf_array *in[2] = {tp_host(RF_F32, RF_SHAPE(1, C, P, N), x),
                       tp_host(RF_F32, RF_SHAPE(16, C, 1, 1), w)};
    rf_array *out = NULL;
    CHECK_OK(tp_run(build_conv_rounding, NULL, in, 2, &out, 1));
    double *got = tp_read(out, NULL);
    int bad = 0;
    for (int o = 0; got && o < 16; o++)
        for (int i = 0; i < N; i++) {
            double want = round_bf16(values[i]), g = got[(o * P + 3) * N + i];
            bool same = isnan(want) ? isnan(g) : g == want;
            if (!same && bad++ < 6)
                fprintf(stderr, "  conv rounding %a: got %a, expected %a\n", (double)values[i],
                        g, want);
        }
    CHECK(got && bad == 0);
    free(got);
    rf_array_free(out);
    tp_free_all(in, 2);
}

/* ---- Gradients ------------------------------------------------------------------------- */

static void build_grad(rf_trace *t, rf_tensor *const *a, int n, void *user)
{
    (void)n, (void)user;
    rf_trace_set_matmul_precision(t, RF_PRECISION_BF16);
    rf_tensor *y = rf_sum_all(rf_mul(rf_matmul(a[0], a[1]), a[2]));
    rf_tensor *g[2] = {NULL, NULL};
    rf_grad(t, y, a, 2, g);
    rf_return(t, y);
    rf_return(t, g[0]);
    rf_return(t, g[1]);
}

/* y = sum(matmul(a, b) * c): both backward products round too, the cotangent
 * c included (d a = c b^T, d b = a^T c, each at bf16). */
static void test_gradients(void)
{
    enum { M = 24, K = 40, N = 16 };
    double *a = random_values(M * K, 61), *b = random_values(K * N, 62);
    double *c = random_values(M * N, 63);
    double bt[N * K], at[K * M], ga[M * K], gb[K * N], sa[M * K], sb[K * N];
    for (int k = 0; k < K; k++) {
        for (int j = 0; j < N; j++)
            bt[j * K + k] = b[k * N + j];
        for (int i = 0; i < M; i++)
            at[k * M + i] = a[i * K + k];
    }
    product(c, bt, 1, M, N, K, true, ga, sa);
    product(at, c, 1, K, M, N, true, gb, sb);
    rf_array *in[3] = {tp_host(RF_F32, RF_SHAPE(M, K), a), tp_host(RF_F32, RF_SHAPE(K, N), b),
                       tp_host(RF_F32, RF_SHAPE(M, N), c)};
    rf_array *out[3] = {NULL, NULL, NULL};
    CHECK_OK(tp_run(build_grad, NULL, in, 3, out, 3));
    expect_sums("gradient of a", out[1], ga, sa, M * K);
    expect_sums("gradient of b", out[2], gb, sb, K * N);
    tp_free_all(out, 3);

    /* The compiled program keeps the precision on all three products. */
    rf_array *dev[3] = {tp_cpu(in[0]), tp_cpu(in[1]), tp_cpu(in[2])};
    rf_exec *e = NULL;
    CHECK_OK(tp_compile(build_grad, NULL, dev, 3, &e));
    CHECK(e && count(rf_exec_program_text(e), "precision=bf16") == 3);
    rf_exec_free(e);
    tp_free_all(dev, 3);
    tp_free_all(in, 3);
    free(a);
    free(b);
    free(c);
}

/* ---- Settings and their errors ------------------------------------------------------------ */

typedef struct scoped {
    rf_precision seen[3]; /* what each call returned */
    int bad;              /* a precision to set (0: none) */
} scoped;

/* One product at bf16 between two at the caller's precision. */
static void build_scoped(rf_trace *t, rf_tensor *const *a, int n, void *user)
{
    (void)n;
    scoped *s = user;
    rf_tensor *p0 = rf_matmul(a[0], a[1]);
    s->seen[0] = rf_trace_set_matmul_precision(t, RF_PRECISION_BF16);
    rf_tensor *p1 = rf_matmul(a[0], rf_neg(a[1]));
    s->seen[1] = rf_trace_set_matmul_precision(t, s->seen[0]);
    rf_tensor *p2 = rf_matmul(a[0], rf_exp(a[1]));
    if (s->bad)
        s->seen[2] = rf_trace_set_matmul_precision(t, (rf_precision)s->bad);
    rf_return(t, rf_add(rf_add(p0, p1), p2));
}

static void test_settings(void)
{
    rf_array *dev[2] = {tp_dev(RF_F32, RF_SHAPE(16, 32), NULL),
                        tp_dev(RF_F32, RF_SHAPE(32, 8), NULL)};
    tp_call call = {build_scoped, NULL};
    scoped s = {{9, 9, 9}, 0};
    call.user = &s;
    rf_exec *e = NULL;
    CHECK_OK(rf_compile(tp_trace_fn, &call, dev, 2, &e));
    CHECK(s.seen[0] == RF_PRECISION_F32 && s.seen[1] == RF_PRECISION_BF16);
    CHECK(e && count(rf_exec_program_text(e), "precision=bf16") == 1);
    rf_exec_free(e);

    /* The compile options set the trace's precision at the start. */
    rf_compile_opts o = {.device = rf_device_cpu(), .matmul_precision = RF_PRECISION_BF16};
    s = (scoped){{9, 9, 9}, 0};
    CHECK_OK(rf_compile_with(tp_trace_fn, &call, dev, 2, &o, &e));
    CHECK(s.seen[0] == RF_PRECISION_BF16);
    CHECK(e && count(rf_exec_program_text(e), "precision=bf16") == 3);
    rf_exec_free(e);

    o.matmul_precision = (rf_precision)7;
    e = NULL;
    CHECK_STATUS(rf_compile_with(tp_trace_fn, &call, dev, 2, &o, &e), RF_E_INVALID);
    CHECK_MSG("matmul_precision 7");
    CHECK(e == NULL);

    s = (scoped){{9, 9, 9}, -1};
    CHECK_STATUS(rf_compile(tp_trace_fn, &call, dev, 2, &e), RF_E_INVALID);
    CHECK_MSG("rf_trace_set_matmul_precision: precision -1");
    CHECK(s.seen[2] == RF_PRECISION_F32); /* unchanged, and returned */
    CHECK(rf_trace_set_matmul_precision(NULL, RF_PRECISION_BF16) == RF_PRECISION_F32);
    CHECK(strcmp(rf_precision_name(RF_PRECISION_BF16), "bf16") == 0);
    CHECK(rf_precision_name((rf_precision)2) == NULL);
    tp_free_all(dev, 2);
}

static void build_f64(rf_trace *t, rf_tensor *const *a, int n, void *user)
{
    (void)n, (void)user;
    rf_trace_set_matmul_precision(t, RF_PRECISION_BF16);
    rf_return(t, rf_matmul(a[0], a[1]));
}

/* f64 products are exact whatever the setting. */
static void test_f64_exact(void)
{
    enum { M = 12, K = 30, N = 9 };
    double *a = random_values(M * K, 71), *b = random_values(K * N, 72);
    double want[M * N];
    product(a, b, 1, M, K, N, false, want, NULL);
    rf_array *in[2] = {tp_host(RF_F64, RF_SHAPE(M, K), a), tp_host(RF_F64, RF_SHAPE(K, N), b)};
    rf_array *out = NULL;
    CHECK_OK(tp_run(build_f64, NULL, in, 2, &out, 1));
    tp_expect("f64 at bf16", out, RF_F64, RF_SHAPE(M, N), want, 1e-12, 1e-12);
    rf_array_free(out);
    tp_free_all(in, 2);
    free(a);
    free(b);
}

/* ---- Models ------------------------------------------------------------------------------- */

/* h = tanh(x W1^T + b1), y = h W2^T + b2 in double from the host model, each
 * product's operands rounded if `bf16` (h rounded to f32 first, as stored). */
static void mlp_ref(rf_model *host, const double *x, int64_t n, bool bf16, double *y)
{
    rf_model *d1 = rf_model_child(host, 0), *d2 = rf_model_child(host, 1);
    const float *w1 = rf_array_data(rf_model_param_array(d1, 0));
    const float *b1 = rf_array_data(rf_model_param_array(d1, 1));
    const float *w2 = rf_array_data(rf_model_param_array(d2, 0));
    const float *b2 = rf_array_data(rf_model_param_array(d2, 1));
    double h[8 * 40];
    for (int64_t r = 0; r < n; r++) {
        for (int o = 0; o < 40; o++) {
            double s = 0;
            for (int i = 0; i < 50; i++)
                s += (bf16 ? round_bf16((float)x[r * 50 + i]) : x[r * 50 + i]) *
                     (bf16 ? round_bf16(w1[o * 50 + i]) : w1[o * 50 + i]);
            h[r * 40 + o] = (float)tanh(s + b1[o]);
        }
        for (int o = 0; o < 10; o++) {
            double s = 0;
            for (int i = 0; i < 40; i++)
                s += (bf16 ? round_bf16((float)h[r * 40 + i]) : h[r * 40 + i]) *
                     (bf16 ? round_bf16(w2[o * 40 + i]) : w2[o * 40 + i]);
            y[r * 10 + o] = s + b2[o];
        }
    }
}

static double max_gap(const double *x, const double *y, int64_t n)
{
    double w = 0;
    for (int64_t i = 0; i < n; i++)
        w = fmax(w, fabs(x[i] - y[i]));
    return w;
}

static void test_models(void)
{
    rf_nn_seed(5);
    rf_model *host = rf_chain(rf_dense(50, 40, RF_ACT_TANH), rf_dense(40, 10, RF_ACT_IDENTITY));
    rf_model *m = rf_model_to(host, rf_device_cpu());
    double *xv = random_values(8 * 50, 81);
    rf_array *x = tp_dev(RF_F32, RF_SHAPE(8, 50), xv);
    double want[2][80];
    mlp_ref(host, xv, 8, false, want[0]);
    mlp_ref(host, xv, 8, true, want[1]);
    CHECK(max_gap(want[0], want[1], 80) > 1e-3);

    CHECK_STATUS(rf_model_set_matmul_precision(NULL, RF_PRECISION_BF16), RF_E_INVALID);
    CHECK_STATUS(rf_model_set_matmul_precision(m, (rf_precision)3), RF_E_INVALID);
    CHECK_MSG("precision 3");
    for (int p = 0; p < 2; p++) {
        if (p)
            CHECK_OK(rf_model_set_matmul_precision(m, RF_PRECISION_BF16));
        rf_array *y = NULL;
        CHECK_OK(rf_jit_model(m, x, &y));
        tp_expect(p ? "model at bf16" : "model at f32", y, RF_F32, RF_SHAPE(8, 10), want[p],
                  1e-5, 1e-4);
        rf_array_free(y);
    }
    /* A copy keeps it; a trace's setting does not override it. */
    rf_model *copy = rf_model_to(m, rf_device_cpu());
    rf_exec *e = NULL;
    CHECK_OK(rf_compile_model(copy, x, &e));
    CHECK(e && count(rf_exec_program_text(e), "precision=bf16") == 2);
    rf_exec_free(e);
    rf_model_free(copy);

    /* Compiled steps are cached per precision (f32 set explicitly is the default). */
    rf_model_free(m);
    m = rf_model_to(host, rf_device_cpu());
    rf_opt *opt = rf_setup(rf_descent(0.01), m);
    int32_t labels[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    rf_array *yh = rf_array_from(RF_I32, RF_SHAPE(8), labels);
    rf_array *batch[2] = {x, yh ? rf_array_to(yh, rf_device_cpu()) : NULL};
    const rf_precision order[4] = {RF_PRECISION_F32, RF_PRECISION_BF16, RF_PRECISION_F32,
                                   RF_PRECISION_BF16};
    for (int k = 0; k < 4; k++) {
        if (k > 0)
            CHECK_OK(rf_model_set_matmul_precision(m, order[k]));
        double loss = NAN;
        CHECK_OK(rf_trainstep(tu_ce_loss, NULL, m, batch, 2, opt, &loss, NULL));
        CHECK(isfinite(loss));
    }
    rf_cache_stats cs = rf_model_cache_stats(m);
    CHECK(cs.compiles == 2 && cs.entries == 2 && cs.hits == 2);
    rf_opt_free(opt);

    /* A layer that sets none takes its parent's, and the cache tells that apart from
     * one that sets its own: Chain(Dense) at bf16, then a Dense added unset (its
     * products bf16 too), then that Dense set to f32. */
    rf_model *first = rf_dense(50, 40, RF_ACT_TANH), *second = rf_dense(40, 10, RF_ACT_IDENTITY);
    rf_model *chain = rf_chain(first ? rf_model_to(first, rf_device_cpu()) : NULL);
    rf_model *last = second ? rf_model_to(second, rf_device_cpu()) : NULL;
    rf_model_free(first);
    rf_model_free(second);
    CHECK_OK(rf_model_set_matmul_precision(chain, RF_PRECISION_BF16));
    CHECK_OK(rf_model_add_child(chain, last));
    opt = rf_setup(rf_descent(0.01), chain);
    for (int k = 0; k < 2; k++) {
        if (k == 1)
            CHECK_OK(rf_model_set_matmul_precision(last, RF_PRECISION_F32));
        e = NULL;
        CHECK_OK(rf_compile_model(chain, x, &e));
        CHECK(e && count(rf_exec_program_text(e), "precision=bf16") == 2 - k);
        rf_exec_free(e);
        double loss = NAN;
        CHECK_OK(rf_trainstep(tu_ce_loss, NULL, chain, batch, 2, opt, &loss, NULL));
    }
    CHECK(rf_model_cache_stats(chain).compiles == 2);
    rf_opt_free(opt);
    rf_model_free(chain);
    rf_array_free(batch[1]);
    rf_array_free(yh);
    rf_model_free(m);
    rf_model_free(host);
    rf_array_free(x);
    free(xv);
}

int main(void)
{
    test_rounding();
    test_rounding_rows();
    test_forms();
    test_conv_rounding();
    test_conv_forms();
    test_gradients();
    test_settings();
    test_f64_exact();
    test_models();
    printf("test_precision: %d checks, %d failed\n", tu_checks, tu_failures);
    return tu_failures ? 1 : 0;
}
