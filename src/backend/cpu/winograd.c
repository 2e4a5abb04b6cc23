/* winograd.c: 2-D stride-1 convolutions by Winograd's minimal filtering
 * (winograd.h gives the two forms), for CPUs where oneDNN has none.
 *
 * F(4x4, 3x3): a 4x4 tile of the result is A^T [(G g G^T) . (B^T d B)] A
 * for its 6x6 input patch d and the 3x3 kernel g, summed over channels
 * (B^T 6x6, G 6x3, A^T 4x6). F(3x3, 4x4), from the same points (G 6x4, A^T
 * 3x6): a 3x3 result from a 4x4 piece of a large kernel and its 6x6 patch,
 * summed over channels and over the kernel's pieces. The points are 0, 1,
 * -1, 2, -1/2 and infinity, not Lavin and Gray's 0, +-1, +-2: the rounding
 * error of a result next to padding, relative to its own sum |x||w|, grows
 * with the whole patch's magnitude, and was 2.5-3.5x smaller with these
 * (float32 simulation of 12x12 input gradients, 40 channels, 6 seeds: the
 * worst 3.1e-6 against 7.8e-6, the median 2.1e-6 against 7.5e-6; the tests'
 * bound is 1e-5).
 *
 * A call reorders the input and the kernel (oneDNN) into blocks of LANES
 * channels, channel innermost, unless their buffers are laid out so (the
 * plan's 8-channel blocks); transforms the kernel into U and the input into
 * V (the workspace); multiplies them position by position (one batched
 * oneDNN matmul: 36 products of M x K by K x O); transforms each product
 * row back into the result's blocks, applying a leading bias and relu of
 * the step's epilogue; and reorders those into the result's layout, unless
 * they are it.
 * K counts channels (and, in the second form, the kernel's pieces); M counts
 * result tiles (first form) or the result's batch (second form). The
 * transforms run on LANES channels at once: every tile element is one
 * vector load and every transformed element one vector store. U, V and the
 * products keep a row's 36 positions together ([row][36][channels]), which
 * the matmul reads through strides: a transformed tile is stored in 1 KB
 * instead of 36 lines megabytes apart. Measured on the cnn's weight
 * gradient (two threads): the kernel transform 0.58 ms with positions
 * outermost against 0.24 ms, the input transform 0.31 against 0.15 ms,
 * where the products lost 0.04-0.09 ms through the strides.
 *
 * The first form with at most FUSED_MAX_K input channels (rounded up to
 * LANES) runs fused instead (fused_items): six tiles at a time, their
 * transformed patches in a table on the stack, the products of that table
 * and U (positions outermost there) by a register-blocked loop of its own,
 * and the output transform straight from those products, so V and the
 * products never go through memory. oneDNN's batched matmul ran these
 * products (K of 16-64) at 100-150 GFLOP/s on two AVX2 cores, 55-85% of
 * their peak; the loop runs at about 80% of it. The cnn's second layer
 * (32 -> 64 channels, 64 images) forward took 0.82-0.88 ms in the step
 * against 0.95-1.02 (its products alone at the peak would take 0.47), its
 * input gradient (64 -> 32) about 0.05 ms less, the step 4.35-4.50 ->
 * 4.15-4.29 ms (5 alternating pairs of RF_PROFILE=40 rf_bench --workload
 * cnn); the ResNet's 16- and 32-channel layers about as before, with 1.7
 * MB less memory.
 *
 * Otherwise the first form runs on chunks of images whose transformed input
 * and products fit CHUNK_BYTES; the second on chunks of the channels it sums
 * over (the forward's images), whose transformed kernel and input fit
 * K_CHUNK_BYTES, each chunk's product added to the last's by the matmul (a
 * sum post-op). A NaN or infinity in a patch spreads over its whole tile, as
 * in oneDNN's Winograd kernels.
 */
#include <math.h>
#include <string.h>

#include "../../runtime/threadpool.h"
#include "winograd.h"

#define LANES 8 /* channels per vector: one AVX2 register of f32 */
#define ALPHA 6 /* transformed tile side */
#define POSITIONS (ALPHA * ALPHA)
/* The first form's images per batched product: their transformed input and
 * products within this many bytes. */
#define CHUNK_BYTES ((size_t)4 << 20)
/* The second form's channels per product (whose products add up): their
 * transformed kernel and input within this many bytes, the L2 of two cores
 * (the transforms split over them). Measured on the cnn's step (two AVX2
 * cores, 1 MB of L2 each, two alternating rounds): 4.53 ms with 2 MB, 4.54-4.58
 * with 4 MB, 4.74-4.76 with 1 MB, 4.62-4.81 with no chunks (5.3 MB of U). */
#define K_CHUNK_BYTES ((size_t)2 << 20)
/* Transformed operands beyond this many bytes: not taken (the direct kernels
 * need no workspace). */
#define MAX_BYTES ((size_t)128 << 20)

enum { RESULT_TILES, KERNEL_TILES }; /* F(4x4, 3x3), F(3x3, 4x4) */

typedef float v8f __attribute__((vector_size(LANES * sizeof(float))));
/* A v8f in memory: every V, U and M row and every block of the staged
 * operands starts on a multiple of LANES floats of the 64-byte aligned
 * workspace, so whole-vector loads and stores are aligned. */
typedef float v8f_mem __attribute__((vector_size(LANES * sizeof(float)), may_alias));
typedef int32_t v8i __attribute__((vector_size(LANES * sizeof(int32_t))));
#define LOAD8(p) (*(const v8f_mem *)(p))
#define STORE8(p, v) (*(v8f_mem *)(p) = (v))

/* An operand in blocks of LANES channels, channel innermost: reordered by
 * oneDNN into the workspace at `at`, or its own buffer when that is laid
 * out so. Blocks run along one of the buffer's two leading dims (aBcd8b or
 * Abcd8a); the block of lanes `blk` at index i of the operand's other
 * leading dim starts (i * outer + blk * block) planes in. oneDNN fills a
 * block's padding channels with zeros (setting the memory's handle pads
 * it), which the products rely on: a padding channel of the input meets a
 * zero row of the kernel, and must not be a NaN another step left in the
 * workspace. */
typedef struct blocking {
    rfi_dnnl_copy copy; /* prim NULL: the buffer is in those blocks already */
    size_t at;
    int64_t outer, block;
    bool laid_out; /* the buffer is read or written in its own layout */
} blocking;

struct rfi_winograd {
    int form;
    int64_t n0, n1, o0;     /* x's dims 0 and 1, w's dim 0 */
    int64_t n1_pad, o0_pad; /* rounded up to LANES */
    int64_t ih, iw, kh, kw, oh, ow;
    int64_t top, left;      /* input row and column of tile (0, 0)'s patch */
    int64_t tiles_h, tiles_w, tiles;
    int64_t rows_per_image; /* product rows per image of dim 0: tiles or 1 */
    int64_t k_tiles;        /* kernel pieces: 1 or tiles */
    int64_t k_lanes;        /* channels of dim 1 per product: n1_pad, or fewer (second form) */
    int64_t k_dim;          /* a product's K = k_tiles * k_lanes */
    int64_t chunk;          /* images of dim 0 per product */
    /* The products of a full and of the last chunk of images (first form), or
     * of the first chunk of channels and of the others, added (second form). */
    rfi_dnnl_mm full, last;
    blocking xb, kb, rb;    /* x in blocks of dim 1, the kernel of dim 0, the result of dim 1 */
    size_t u_at, v_at, m_at;
    bool fused;             /* the first form by fused_items: no products through oneDNN */
    size_t u_row, u_pos;    /* U's strides (floats): a K row, a position */
    int n_epi;              /* leading epilogue ops the result transform applies */
    rfi_epi_kind epi[RFI_EPI_MAX];
};

/* ---- The transforms, on LANES channels at once --------------------------------------- */

#define INLINE static inline __attribute__((always_inline))

/* z[k*zs] = (B^T d)[k] for d[r*s], r < 6. */
INLINE void data_1d(const v8f *d, int s, v8f *z, int zs)
{
    v8f d0 = d[0], d1 = d[s], d2 = d[2 * s], d3 = d[3 * s], d4 = d[4 * s], d5 = d[5 * s];
    /* rows 1 and 2 are p -+ q, rows 3 and 4 a -+ multiples of e: 20 ops, not 32 */
    v8f a = d4 - d2, e = d1 - d3;
    v8f p = a - 1.5f * d3, q = e + 1.5f * d2;
    z[0] = (d0 - d2) + a + 1.5f * e;
    z[zs] = p - q;
    z[2 * zs] = p + q;
    z[3 * zs] = a - 0.5f * e;
    z[4 * zs] = a + 2.0f * e;
    z[5 * zs] = e + (d5 - d3) - 1.5f * a;
}

/* u[k*us] = (G g)[k] for a 3-tap g[r*s]. */
INLINE void kernel3_1d(const v8f *g, int s, v8f *u, int us)
{
    v8f g0 = g[0], g1 = g[s], g2 = g[2 * s];
    u[0] = g0;
    u[us] = (g0 + g1 + g2) * (-1.0f / 3);
    u[2 * us] = (g0 - g1 + g2) * (1.0f / 3);
    u[3 * us] = (g0 + 2.0f * g1 + 4.0f * g2) * (1.0f / 15);
    u[4 * us] = (8.0f * g1 - 16.0f * g0 - 4.0f * g2) * (1.0f / 15);
    u[5 * us] = g2;
}

/* u[k*us] = (G g)[k] for a 4-tap g[r*s] (the second form's G). */
INLINE void kernel4_1d(const v8f *g, int s, v8f *u, int us)
{
    v8f g0 = g[0], g1 = g[s], g2 = g[2 * s], g3 = g[3 * s];
    u[0] = g0;
    u[us] = (g0 + g1 + g2 + g3) * (-1.0f / 3);
    u[2 * us] = (g0 - g1 + g2 - g3) * (1.0f / 3);
    u[3 * us] = (g0 + 2.0f * g1 + 4.0f * g2 + 8.0f * g3) * (1.0f / 15);
    u[4 * us] = (8.0f * g1 - 16.0f * g0 - 4.0f * g2 + 2.0f * g3) * (1.0f / 15);
    u[5 * us] = g3;
}

/* y[i*ys] = (A^T m)[i] for m[r*s], r < 6: 4 outputs, or 3 (the second form). */
INLINE void result_1d(const v8f *m, int s, v8f *y, int ys, int outputs)
{
    v8f m0 = m[0], m1 = m[s], m2 = m[2 * s], m3 = m[3 * s], m4 = m[4 * s], m5 = m[5 * s];
    v8f a = m1 + m2, b = m1 - m2;
    y[0] = m0 + a + m3 + m4;
    y[ys] = b + 2.0f * m3 - 0.5f * m4;
    if (outputs == 4) {
        y[2 * ys] = a + 4.0f * m3 + 0.25f * m4;
        y[3 * ys] = b + 8.0f * m3 - 0.125f * m4 + m5;
    } else {
        y[2 * ys] = a + 4.0f * m3 + 0.25f * m4 + m5;
    }
}

/* ---- Channel blocks ----------------------------------------------------------------- */

/* Operand v's buffer (holding v with dims 0 and 1 swapped when `swapped`,
 * in `layout`) into blocks along v's dim lane_dim, or (`back`) those blocks
 * into the buffer; nothing where they are the buffer's own layout. Both are
 * described in the buffer's dims. A layout oneDNN cannot describe is read
 * (written) row-major, the services reordering it. */
static dnnl_status_t make_blocking(blocking *b, const rfi_node *v, bool swapped, rfi_layout layout,
                                   int lane_dim, bool back, dnnl_engine_t eng, size_t *ws)
{
    int s0 = swapped ? 1 : 0, s1 = 1 - s0;
    dnnl_dims_t dims = {v->dims[s0], v->dims[s1], v->dims[2], v->dims[3]};
    int lanes_at = swapped ? 1 - lane_dim : lane_dim; /* in the buffer's dims */
    b->outer = lanes_at == 1 ? (dims[1] + LANES - 1) / LANES : 1;
    b->block = lanes_at == 1 ? 1 : dims[1];
    int block = rfi_layout_block(layout);
    dnnl_format_tag_t tag = rfi_dnnl_layout_tag(layout, false);
    b->laid_out = layout != RFI_LAYOUT_PLAIN && tag != dnnl_format_tag_undef &&
                  (block == 0 || dims[1] % block == 0);
    dnnl_memory_desc_t buffer, blocks;
    dnnl_status_t st = rfi_dnnl.memory_desc_init_by_tag(&buffer, 4, dims, dnnl_f32,
                                                        b->laid_out ? tag : dnnl_abcd);
    if (st == dnnl_success)
        st = rfi_dnnl.memory_desc_init_by_tag(&blocks, 4, dims, dnnl_f32,
                                              lanes_at == 1 ? dnnl_aBcd8b : dnnl_Abcd8a);
    if (st != dnnl_success || rfi_dnnl.memory_desc_equal(&buffer, &blocks))
        return st;
    st = back ? rfi_dnnl_copy_make(&b->copy, &blocks, &buffer, eng)
              : rfi_dnnl_copy_make(&b->copy, &buffer, &blocks, eng);
    b->at = *ws;
    *ws += rfi_ws_align(rfi_dnnl.memory_desc_get_size(&blocks));
    return st;
}

/* The blocks of an operand's buffer: at ws + at, reordered from it, or the
 * buffer itself. */
static rf_status run_blocking(const blocking *b, dnnl_stream_t s, const float *buffer, char *ws,
                              const float **blocks_out)
{
    *blocks_out = b->copy.prim ? (const float *)(ws + b->at) : buffer;
    return b->copy.prim ? rfi_dnnl_copy_run(&b->copy, s, buffer, ws + b->at,
                                            "winograd convolution")
                        : RF_OK;
}

/* out[r * cols + c] = the LANES channels of element (row0 + r, col0 + c) of
 * a block's h x w plane (zero outside it, or everywhere when plane is NULL). */
INLINE void stage(const float *plane, int64_t h, int64_t w, int64_t row0, int64_t col0, int rows,
                  int cols, v8f *out)
{
    const v8f zero = {0};
    int64_t c_lo = col0 < 0 ? -col0 : 0, c_hi = w - col0 < cols ? w - col0 : cols;
    if (!plane)
        c_hi = c_lo = 0;
    for (int r = 0; r < rows; r++) {
        int64_t row = row0 + r;
        v8f *dst = out + r * cols;
        if (row < 0 || row >= h || c_lo >= c_hi) {
            for (int c = 0; c < cols; c++)
                dst[c] = zero;
            continue;
        }
        const float *src = plane + (row * w + col0) * LANES;
        for (int64_t c = 0; c < c_lo; c++)
            dst[c] = zero;
        for (int64_t c = c_lo; c < c_hi; c++)
            dst[c] = LOAD8(src + c * LANES);
        for (int64_t c = c_hi; c < cols; c++)
            dst[c] = zero;
    }
}

/* ---- The three jobs of a call (rfi_parallel_for bodies) ----------------------------- */

typedef struct job {
    const rfi_winograd *w;
    const float *src;
    float *dst;
    int64_t first, images;       /* the chunk (images of dim 0) */
    int64_t c0;                  /* the first channel of dim 1 in the product */
    const void *const *epi_src;  /* result_items: the epilogue's operands */
    const float *u;              /* fused_items: the transformed kernel */
} job;

/* Each job is compiled for x86-64-v3 (AVX2 and FMA: one vector a register,
 * and a * b + c one fused multiply-add, CMakeLists.txt giving this file
 * -ffp-contract=fast as cc.c gives the generated code) and for the
 * baseline (two halves), chosen once at load time. On two AVX2 cores the
 * cnn's second layer forward took 1.01-1.04 ms with fused multiply-adds
 * against 1.04-1.06 without, its input gradient 1.68-1.73 against
 * 1.70-1.82 (bench_services, 5 alternating runs); its weight gradient, whose
 * products are most of its time, as before. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define VECTOR_JOB __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define VECTOR_JOB
#endif

/* U from the blocked kernel: item (channel c, block of output lanes), each
 * of the kernel's pieces. */
VECTOR_JOB static void kernel_items(void *ctx, int64_t lo, int64_t hi)
{
    const job *jb = ctx;
    const rfi_winograd *w = jb->w;
    int64_t blocks = w->o0_pad / LANES, kplane = w->kh * w->kw * LANES;
    size_t pos_stride = w->u_pos;
    int64_t row_stride = w->u_row;
    for (int64_t i = lo; i < hi; i++) {
        int64_t c = jb->c0 + i / blocks, ob = i % blocks;
        const float *plane =
            c < w->n1 ? jb->src + (c * w->kb.outer + ob * w->kb.block) * kplane : NULL;
        for (int64_t t = 0; t < w->k_tiles; t++) {
            v8f g[16], z[ALPHA * 4], u[POSITIONS];
            if (w->form == RESULT_TILES) {
                stage(plane, 3, 3, 0, 0, 3, 3, g);
                for (int s = 0; s < 3; s++)
                    kernel3_1d(g + s, 3, z + s, 3);
                for (int k = 0; k < ALPHA; k++)
                    kernel3_1d(z + 3 * k, 1, u + ALPHA * k, 1);
            } else {
                int64_t row0 = t / w->tiles_w * 4, col0 = t % w->tiles_w * 4;
                stage(plane, w->kh, w->kw, row0, col0, 4, 4, g);
                for (int s = 0; s < 4; s++)
                    kernel4_1d(g + s, 4, z + s, 4);
                for (int k = 0; k < ALPHA; k++)
                    kernel4_1d(z + 4 * k, 1, u + ALPHA * k, 1);
            }
            float *dst = jb->dst + (t * w->k_lanes + c - jb->c0) * row_stride + ob * LANES;
            for (int p = 0; p < POSITIONS; p++)
                STORE8(dst + p * pos_stride, u[p]);
        }
    }
}

/* B^T d B of the 6x6 patch at patch[r * stride + c], stored at dst + p *
 * pos_stride for each of its 36 positions p. */
INLINE void data_tile(const v8f *patch, int stride, float *dst, size_t pos_stride)
{
    v8f z[POSITIONS], v[POSITIONS];
    for (int s = 0; s < ALPHA; s++)
        data_1d(patch + s, stride, z + s, ALPHA);
    for (int k = 0; k < ALPHA; k++)
        data_1d(z + ALPHA * k, 1, v + ALPHA * k, 1);
    for (int p = 0; p < POSITIONS; p++)
        STORE8(dst + p * pos_stride, v[p]);
}

/* Tiles of a row whose patches a data item stages at once. */
#define BAND_TILES 15

/* V from the blocked input: item (image of the chunk, block of input
 * lanes), a row of tiles at a time. */
VECTOR_JOB static void data_items(void *ctx, int64_t lo, int64_t hi)
{
    const job *jb = ctx;
    const rfi_winograd *w = jb->w;
    int64_t blocks = w->k_lanes / LANES, plane_size = w->ih * w->iw * LANES;
    size_t pos_stride = (size_t)w->k_dim;
    int64_t row_stride = POSITIONS * w->k_dim;
    bool tile_rows = w->form == RESULT_TILES; /* a tile per product row, or per K column block */
    v8f band[ALPHA * (4 * BAND_TILES + 2)];
    for (int64_t i = lo; i < hi; i++) {
        int64_t n = jb->first + i / blocks, cb = jb->c0 / LANES + i % blocks;
        const float *plane = jb->src + (n * w->xb.outer + cb * w->xb.block) * plane_size;
        float *base = jb->dst + (i / blocks) * w->rows_per_image * row_stride + i % blocks * LANES;
        for (int64_t ty = 0; ty < w->tiles_h; ty++) {
            for (int64_t tx0 = 0; tx0 < w->tiles_w; tx0 += BAND_TILES) {
                int64_t txs = w->tiles_w - tx0 < BAND_TILES ? w->tiles_w - tx0 : BAND_TILES;
                int bc = (int)(4 * txs + 2);
                stage(plane, w->ih, w->iw, w->top + 4 * ty, w->left + 4 * tx0, ALPHA, bc, band);
                for (int64_t tx = 0; tx < txs; tx++) {
                    int64_t t = ty * w->tiles_w + tx0 + tx;
                    float *dst = base + (tile_rows ? t * row_stride : t * w->k_lanes);
                    data_tile(band + 4 * tx, bc, dst, pos_stride);
                }
            }
        }
    }
}

/* y = relu(y) as the interpreter computes it: NaN stays NaN (the canonical
 * one), -0 and below become +0. */
INLINE void relu8(v8f *y)
{
    const v8f nan = {NAN, NAN, NAN, NAN, NAN, NAN, NAN, NAN};
    v8i keep = *y > 0.0f, is_nan = *y != *y;
    *y = (v8f)(((v8i)*y & keep) | ((v8i)nan & is_nan));
}

/* The epilogue's BIAS vectors on the LANES channels from o (one per op;
 * zero in padding lanes), made once per item of result_items. */
INLINE void bias8(const job *jb, int64_t o, v8f *bias)
{
    const rfi_winograd *w = jb->w;
    for (int e = 0; e < w->n_epi; e++) {
        const v8f zero = {0};
        bias[e] = zero;
        const float *src = jb->epi_src[e];
        for (int l = 0; w->epi[e] == RFI_EPI_BIAS && l < LANES && o + l < w->o0; l++)
            bias[e][l] = src[o + l];
    }
}

/* The epilogue's leading ops the call applies, on a result tile's `count`
 * vectors (bias: bias8's). */
INLINE void epilogue8(const rfi_winograd *w, const v8f *bias, v8f *y, int count)
{
    for (int e = 0; e < w->n_epi; e++)
        for (int i = 0; i < count; i++) {
            if (w->epi[e] == RFI_EPI_RELU)
                relu8(&y[i]);
            else
                y[i] += bias[e];
        }
}

/* The outs x outs result tile at row y0, column x0 (4x4 in the first form,
 * the whole 3x3 result in the second) on LANES channels from the 36
 * products at m + p * pos_stride, with the epilogue's leading ops (bias:
 * bias8's), into the channel block's plane `out`. */
INLINE void result_tile(const rfi_winograd *w, const float *m, size_t pos_stride,
                        const v8f *bias, int outs, int64_t y0, int64_t x0, float *out)
{
    v8f in[POSITIONS], z[ALPHA * 4], y[16];
    for (int p = 0; p < POSITIONS; p++)
        in[p] = LOAD8(m + p * pos_stride);
    for (int s = 0; s < ALPHA; s++)
        result_1d(in + s, ALPHA, z + s, ALPHA, outs);
    for (int k = 0; k < outs; k++)
        result_1d(z + ALPHA * k, 1, y + outs * k, 1, outs);
    epilogue8(w, bias, y, outs * outs);
    int rows = (int)(w->oh - y0 < outs ? w->oh - y0 : outs);
    int cols = (int)(w->ow - x0 < outs ? w->ow - x0 : outs);
    for (int a = 0; a < rows; a++)
        for (int b = 0; b < cols; b++)
            STORE8(out + ((y0 + a) * w->ow + x0 + b) * LANES, y[a * outs + b]);
}

/* The result's plane of image n's block of LANES channels from o, in the
 * result's blocks at r_blocks. */
INLINE float *result_plane(const rfi_winograd *w, float *r_blocks, int64_t n, int64_t o)
{
    return r_blocks + (n * (w->o0_pad / LANES) + o / LANES) * w->oh * w->ow * LANES;
}

/* The result, in blocks of LANES channels, from the products: item (image
 * of the chunk, block of output lanes). */
VECTOR_JOB static void result_items(void *ctx, int64_t lo, int64_t hi)
{
    const job *jb = ctx;
    const rfi_winograd *w = jb->w;
    int64_t blocks = w->o0_pad / LANES;
    size_t pos_stride = (size_t)w->o0_pad;
    int64_t row_stride = POSITIONS * w->o0_pad;
    for (int64_t i = lo; i < hi; i++) {
        int64_t n = i / blocks, o = i % blocks * LANES;
        float *out = result_plane(w, jb->dst, jb->first + n, o);
        v8f bias[RFI_EPI_MAX];
        bias8(jb, o, bias);
        for (int64_t t = 0; t < w->rows_per_image; t++) {
            const float *m = jb->src + (n * w->rows_per_image + t) * row_stride + o;
            if (w->form == RESULT_TILES)
                result_tile(w, m, pos_stride, bias, 4, t / w->tiles_w * 4, t % w->tiles_w * 4,
                            out);
            else
                result_tile(w, m, pos_stride, bias, 3, 0, 0, out);
        }
    }
}

/* ---- The first form fused: transforms and products on a few tiles at once ------------ */

/* Tiles a fused item takes: the rows of the products' register blocks. */
#define FUSED_TILES 6
/* Output channels a register block holds: two vectors. */
#define FUSED_COLS (2 * LANES)
/* The most K (input channels, rounded up to LANES) a fused item's stack
 * holds the transformed tiles of. */
#define FUSED_MAX_K 64

/* The FUSED_TILES x 16 block of the product of V (rows at v + r * v_row, K
 * of them contiguous) and U (row c at u + c * u_row), stored at m + r *
 * m_row: twelve accumulators, the two kernel vectors and a broadcast, 15 of
 * AVX2's 16 registers. Named, and the column count fixed: a first version
 * with an array of accumulators and the column count tested in the loop
 * kept three of them on the stack (render_conv.c found arrays so too). */
INLINE void product16(const float *v, size_t v_row, const float *u, size_t u_row, int64_t k,
                      float *m, size_t m_row)
{
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0};
    v8f b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0}, b4 = {0}, b5 = {0};
    for (int64_t c = 0; c < k; c++) {
        v8f lo = LOAD8(u + c * u_row), hi = LOAD8(u + c * u_row + LANES);
        float x0 = v[c], x1 = v[v_row + c], x2 = v[2 * v_row + c];
        float x3 = v[3 * v_row + c], x4 = v[4 * v_row + c], x5 = v[5 * v_row + c];
        a0 += x0 * lo, b0 += x0 * hi, a1 += x1 * lo, b1 += x1 * hi;
        a2 += x2 * lo, b2 += x2 * hi, a3 += x3 * lo, b3 += x3 * hi;
        a4 += x4 * lo, b4 += x4 * hi, a5 += x5 * lo, b5 += x5 * hi;
    }
    STORE8(m, a0), STORE8(m + LANES, b0), STORE8(m + m_row, a1), STORE8(m + m_row + LANES, b1);
    STORE8(m + 2 * m_row, a2), STORE8(m + 2 * m_row + LANES, b2);
    STORE8(m + 3 * m_row, a3), STORE8(m + 3 * m_row + LANES, b3);
    STORE8(m + 4 * m_row, a4), STORE8(m + 4 * m_row + LANES, b4);
    STORE8(m + 5 * m_row, a5), STORE8(m + 5 * m_row + LANES, b5);
}

/* The same for the last 8 output channels, where O is an odd multiple of
 * LANES. */
INLINE void product8(const float *v, size_t v_row, const float *u, size_t u_row, int64_t k,
                     float *m, size_t m_row)
{
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0};
    for (int64_t c = 0; c < k; c++) {
        v8f lo = LOAD8(u + c * u_row);
        a0 += v[c] * lo, a1 += v[v_row + c] * lo, a2 += v[2 * v_row + c] * lo;
        a3 += v[3 * v_row + c] * lo, a4 += v[4 * v_row + c] * lo, a5 += v[5 * v_row + c] * lo;
    }
    STORE8(m, a0), STORE8(m + m_row, a1), STORE8(m + 2 * m_row, a2);
    STORE8(m + 3 * m_row, a3), STORE8(m + 4 * m_row, a4), STORE8(m + 5 * m_row, a5);
}

/* The input transform of tile t (of the batch's tiles, image by image) on
 * every block of input lanes, into vt [36][k_dim]. */
INLINE void fused_data(const rfi_winograd *w, const float *x, int64_t t, float *vt)
{
    int64_t n = t / w->tiles, ty = t % w->tiles / w->tiles_w, tx = t % w->tiles_w;
    int64_t plane_size = w->ih * w->iw * LANES;
    for (int64_t cb = 0; cb < w->k_dim / LANES; cb++) {
        const float *plane = x + (n * w->xb.outer + cb * w->xb.block) * plane_size;
        v8f patch[POSITIONS];
        stage(plane, w->ih, w->iw, w->top + 4 * ty, w->left + 4 * tx, ALPHA, ALPHA, patch);
        data_tile(patch, ALPHA, vt + cb * LANES, (size_t)w->k_dim);
    }
}

/* The first form on FUSED_TILES tiles of the whole batch at once: item i
 * (tiles i * FUSED_TILES on, images and tiles in order) transforms its
 * tiles' patches into a table on the stack, multiplies them by U position
 * by position a block of FUSED_COLS output channels at a time, and
 * transforms those products back into the result, so the transformed tiles
 * and products stay in a core's first caches. */
VECTOR_JOB static void fused_items(void *ctx, int64_t lo, int64_t hi)
{
    const job *jb = ctx;
    const rfi_winograd *w = jb->w;
    _Alignas(64) float vt[FUSED_TILES * POSITIONS * FUSED_MAX_K];
    _Alignas(64) float mt[FUSED_TILES * POSITIONS * FUSED_COLS];
    int64_t all = w->n0 * w->tiles;
    size_t v_row = (size_t)POSITIONS * w->k_dim;
    for (int64_t i = lo; i < hi; i++) {
        int64_t t0 = i * FUSED_TILES;
        int count = (int)(all - t0 < FUSED_TILES ? all - t0 : FUSED_TILES);
        for (int r = 0; r < FUSED_TILES; r++) {
            if (r < count)
                fused_data(w, jb->src, t0 + r, vt + r * v_row);
            else /* rows past the last tile: zeros, whose products are not stored */
                memset(vt + r * v_row, 0, v_row * sizeof(float));
        }
        for (int64_t o = 0; o < w->o0_pad; o += FUSED_COLS) {
            int cols = (int)(w->o0_pad - o < FUSED_COLS ? w->o0_pad - o : FUSED_COLS);
            for (int p = 0; p < POSITIONS; p++) {
                const float *vp = vt + p * w->k_dim, *up = jb->u + p * w->u_pos + o;
                float *mp = mt + p * FUSED_COLS;
                if (cols == FUSED_COLS)
                    product16(vp, v_row, up, w->u_row, w->k_dim, mp, POSITIONS * FUSED_COLS);
                else
                    product8(vp, v_row, up, w->u_row, w->k_dim, mp, POSITIONS * FUSED_COLS);
            }
            for (int h = 0; h < cols; h += LANES) {
                v8f bias[RFI_EPI_MAX];
                bias8(jb, o + h, bias);
                for (int r = 0; r < count; r++) {
                    int64_t t = t0 + r;
                    int64_t y0 = t % w->tiles / w->tiles_w * 4, x0 = t % w->tiles_w * 4;
                    result_tile(w, mt + r * POSITIONS * FUSED_COLS + h, FUSED_COLS, bias, 4, y0,
                                x0, result_plane(w, jb->dst, t / w->tiles, o + h));
                }
            }
        }
    }
}

/* ---- Prepare and run ------------------------------------------------------------------ */

static int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

/* The form and geometry of n, or false where neither form computes it. */
static bool read_form(rfi_winograd *w, const rfi_node *n)
{
    const rfi_node *x = n->in[0], *k = n->in[1];
    const rfi_attrs *at = &n->attr;
    if (x->rank != 4 || at->i[0] > 1 || at->i[1] > 1)
        return false;
    for (int d = 0; d < 2; d++)
        if (at->l[0][d] != 1 || at->l[3][d] > 1 || at->l[4][d] != 1)
            return false;
    w->n0 = x->dims[0], w->n1 = x->dims[1], w->o0 = k->dims[0];
    w->ih = x->dims[2], w->iw = x->dims[3];
    w->kh = k->dims[2], w->kw = k->dims[3];
    w->oh = n->dims[2], w->ow = n->dims[3];
    w->top = -at->l[1][0], w->left = -at->l[1][1];
    if (w->kh == 3 && w->kw == 3) {
        w->form = RESULT_TILES;
        w->tiles_h = (w->oh + 3) / 4, w->tiles_w = (w->ow + 3) / 4;
    } else if (w->oh == 3 && w->ow == 3) {
        w->form = KERNEL_TILES;
        w->tiles_h = (w->kh + 3) / 4, w->tiles_w = (w->kw + 3) / 4;
    } else {
        return false;
    }
    w->tiles = w->tiles_h * w->tiles_w;
    w->n1_pad = round_up(w->n1, LANES);
    w->o0_pad = round_up(w->o0, LANES);
    w->rows_per_image = w->form == RESULT_TILES ? w->tiles : 1;
    w->k_tiles = w->form == RESULT_TILES ? 1 : w->tiles;
    w->k_lanes = w->n1_pad;
    w->k_dim = w->k_tiles * w->n1_pad;
    return w->n0 > 0 && w->n1 > 0 && w->o0 > 0 && w->oh > 0 && w->ow > 0;
}

/* The batched product of a chunk of `images`: V [36][M][K] x U [36][K][O],
 * added to what the result holds when `accumulate`. */
static rf_status make_product(const rfi_winograd *w, rfi_dnnl_mm *mm, dnnl_engine_t eng,
                              int64_t images, bool accumulate)
{
    int64_t m = images * w->rows_per_image, k = w->k_dim, o = w->o0_pad;
    rfi_dnnl_tensor src = {3, {POSITIONS, m, k}, {k, POSITIONS * k, 1}};
    rfi_dnnl_tensor wei = {3, {POSITIONS, k, o}, {o, POSITIONS * o, 1}};
    rfi_dnnl_tensor dst = {3, {POSITIONS, m, o}, {o, POSITIONS * o, 1}};
    rfi_dnnl_post post = {0};
    post.accumulate = accumulate;
    return rfi_dnnl_mm_init(mm, eng, &src, &wei, &dst, &post, "winograd convolution");
}

/* The second form's channels per product: the most whole blocks of LANES,
 * dividing them evenly, whose transformed kernel and input fit
 * K_CHUNK_BYTES (at least one block). The products then add up in the
 * result, and each block's transforms are written to, and read from, a
 * core's cache rather than memory. */
static void choose_k_lanes(rfi_winograd *w)
{
    int64_t blocks = w->n1_pad / LANES;
    size_t per_block = (size_t)(POSITIONS * w->k_tiles * LANES * (w->o0_pad + w->n0)) *
                       sizeof(float);
    int64_t fit = 1;
    for (int64_t d = 1; d <= blocks; d++)
        if (blocks % d == 0 && (size_t)d * per_block <= K_CHUNK_BYTES)
            fit = d;
    w->k_lanes = fit * LANES;
    w->k_dim = w->k_tiles * w->k_lanes;
}

/* The epilogue's leading ops the result transform applies: per-channel
 * BIAS (along the result's dim 1) and RELU, in order. */
static void take_epilogue(rfi_winograd *w, const rfi_epi_op *epi, int n_epi)
{
    for (w->n_epi = 0; w->n_epi < n_epi && w->n_epi < RFI_EPI_MAX; w->n_epi++) {
        const rfi_epi_op *op = &epi[w->n_epi];
        if (op->kind != RFI_EPI_RELU && !(op->kind == RFI_EPI_BIAS && op->axis == 1))
            break;
        w->epi[w->n_epi] = op->kind;
    }
}

/* A BIAS among the epilogue ops the services apply after the call: those
 * index a row-major result (services.c), so the result stays row-major. */
static bool bias_left(const rfi_epi_op *epi, int n_epi, int taken)
{
    for (int e = taken; e < n_epi; e++)
        if (epi[e].kind == RFI_EPI_BIAS)
            return true;
    return false;
}

rf_status rfi_winograd_prepare(const rfi_node *n, const bool views[2],
                               const rfi_layout layouts[3], const rfi_epi_op *epi, int n_epi,
                               const rfi_winograd_rule *rule, dnnl_engine_t eng,
                               rfi_winograd **out, size_t *workspace_bytes)
{
    *out = NULL;
    *workspace_bytes = 0;
    rfi_winograd probe = {0};
    if (n->op != RFI_OP_CONVOLUTION || n->n_in != 2 || !read_form(&probe, n))
        return RF_E_UNSUPPORTED;
    int64_t in_channels = probe.form == RESULT_TILES ? probe.n1 : probe.n0;
    int64_t fewest = rule->min_channels[probe.form == RESULT_TILES ? 0 : 1];
    if (in_channels < fewest || probe.o0 < fewest)
        return RF_E_UNSUPPORTED;
    if (probe.form == RESULT_TILES &&
        (probe.n0 * probe.tiles < rule->min_rows ||
         (double)(probe.oh * probe.ow) < rule->min_fill * (double)(16 * probe.tiles)))
        return RF_E_UNSUPPORTED;
    if (probe.form == KERNEL_TILES)
        choose_k_lanes(&probe);
    size_t u_bytes = (size_t)(POSITIONS * probe.k_dim * probe.o0_pad) * sizeof(float);
    size_t image_bytes = (size_t)(POSITIONS * probe.rows_per_image *
                                  (probe.k_dim + probe.o0_pad)) * sizeof(float);
    int64_t chunk = probe.n0;
    if (probe.form == RESULT_TILES) {
        chunk = (int64_t)(CHUNK_BYTES / image_bytes);
        chunk = chunk < 1 ? 1 : chunk > probe.n0 ? probe.n0 : chunk;
    }
    if (u_bytes + image_bytes * (size_t)chunk > MAX_BYTES)
        return RF_E_UNSUPPORTED;
    rfi_winograd *w = rfi_calloc(1, sizeof *w);
    if (!w)
        return rfi_error(RF_E_NOMEM, "cpu: winograd convolution: out of memory");
    *w = probe;
    w->chunk = chunk;
    w->fused = w->form == RESULT_TILES && w->k_dim <= FUSED_MAX_K;
    /* positions outermost for fused_items (a position's K rows together),
     * else a row's positions together, as the matmul reads them */
    w->u_row = (size_t)(w->fused ? 1 : POSITIONS) * (size_t)w->o0_pad;
    w->u_pos = (size_t)(w->fused ? w->k_dim : 1) * (size_t)w->o0_pad;
    take_epilogue(w, epi, n_epi);
    rf_status st = w->fused ? RF_OK : make_product(w, &w->full, eng, chunk, false);
    if (st == RF_OK && !w->fused && w->n0 % chunk != 0)
        st = make_product(w, &w->last, eng, w->n0 % chunk, false);
    if (st == RF_OK && w->k_lanes < w->n1_pad)
        st = make_product(w, &w->last, eng, chunk, true);
    if (st != RF_OK) {
        rfi_winograd_free(w);
        return st;
    }
    size_t scratch = w->full.scratch_bytes > w->last.scratch_bytes ? w->full.scratch_bytes
                                                                   : w->last.scratch_bytes;
    size_t v_bytes = (size_t)(POSITIONS * chunk * w->rows_per_image * w->k_dim) * sizeof(float);
    size_t m_bytes = image_bytes * (size_t)chunk - v_bytes;
    if (w->fused)
        v_bytes = m_bytes = 0;
    w->u_at = rfi_ws_align(scratch);
    w->v_at = w->u_at + rfi_ws_align(u_bytes);
    w->m_at = w->v_at + rfi_ws_align(v_bytes);
    size_t end = w->m_at + rfi_ws_align(m_bytes);
    rfi_layout result_layout = bias_left(epi, n_epi, w->n_epi) ? RFI_LAYOUT_PLAIN : layouts[2];
    dnnl_status_t ds = make_blocking(&w->xb, n->in[0], views[0], layouts[0], 1, false, eng, &end);
    if (ds == dnnl_success)
        ds = make_blocking(&w->kb, n->in[1], views[1], layouts[1], 0, false, eng, &end);
    if (ds == dnnl_success)
        ds = make_blocking(&w->rb, n, false, result_layout, 1, true, eng, &end);
    if (ds != dnnl_success) {
        rfi_winograd_free(w);
        return rfi_dnnl_error(ds, "winograd convolution", "reorder");
    }
    *workspace_bytes = end;
    *out = w;
    return RF_OK;
}

/* The first form unfused: for each chunk of images V, the batched product
 * (oneDNN) and the result transform. */
static rf_status run_chunks(rfi_winograd *w, dnnl_stream_t s, const float *x_blocks,
                            const float *u, float *v, float *m, float *r_blocks,
                            const void *const *epi_src, char *ws)
{
    for (int64_t first = 0; first < w->n0; first += w->chunk) {
        int64_t images = w->n0 - first < w->chunk ? w->n0 - first : w->chunk;
        job dj = {w, x_blocks, v, first, images, 0, NULL, NULL};
        rfi_parallel_for(images * (w->n1_pad / LANES), 1, data_items, &dj);
        rfi_dnnl_mm *mm = images == w->chunk ? &w->full : &w->last;
        rf_status rs = rfi_dnnl_mm_run(mm, s, v, u, m, ws, NULL, "winograd convolution");
        if (rs != RF_OK)
            return rs;
        job rj = {w, m, r_blocks, first, images, 0, epi_src, NULL};
        rfi_parallel_for(images * (w->o0_pad / LANES), 1, result_items, &rj);
    }
    return RF_OK;
}

rf_status rfi_winograd_run(rfi_winograd *w, dnnl_stream_t s, const float *x, const float *k,
                           float *out, const void *const *epi_src, void *workspace)
{
    char *ws = workspace;
    float *u = (float *)(ws + w->u_at), *v = (float *)(ws + w->v_at), *m = (float *)(ws + w->m_at);
    const float *x_blocks, *k_blocks;
    rf_status rs = run_blocking(&w->kb, s, k, ws, &k_blocks);
    if (rs == RF_OK)
        rs = run_blocking(&w->xb, s, x, ws, &x_blocks);
    if (rs != RF_OK)
        return rs;
    float *r_blocks = w->rb.copy.prim ? (float *)(ws + w->rb.at) : out;
    if (w->form == KERNEL_TILES) { /* chunks of channels, their products added up */
        for (int64_t c0 = 0; c0 < w->n1_pad; c0 += w->k_lanes) {
            job kj = {w, k_blocks, u, 0, 0, c0, NULL, NULL};
            rfi_parallel_for(w->k_lanes * (w->o0_pad / LANES), 8, kernel_items, &kj);
            job dj = {w, x_blocks, v, 0, w->n0, c0, NULL, NULL};
            rfi_parallel_for(w->n0 * (w->k_lanes / LANES), 1, data_items, &dj);
            rs = rfi_dnnl_mm_run(c0 == 0 ? &w->full : &w->last, s, v, u, m, ws, NULL,
                                 "winograd convolution");
            if (rs != RF_OK)
                return rs;
        }
        job rj = {w, m, r_blocks, 0, w->n0, 0, epi_src, NULL};
        rfi_parallel_for(w->n0 * (w->o0_pad / LANES), 1, result_items, &rj);
    } else { /* the kernel once, then the tiles fused or chunks of images */
        job kj = {w, k_blocks, u, 0, 0, 0, NULL, NULL};
        rfi_parallel_for(w->n1_pad * (w->o0_pad / LANES), 8, kernel_items, &kj);
        if (w->fused) {
            job fj = {w, x_blocks, r_blocks, 0, w->n0, 0, epi_src, u};
            int64_t items = (w->n0 * w->tiles + FUSED_TILES - 1) / FUSED_TILES;
            rfi_parallel_for(items, 1, fused_items, &fj);
        } else {
            rs = run_chunks(w, s, x_blocks, u, v, m, r_blocks, epi_src, ws);
            if (rs != RF_OK)
                return rs;
        }
    }
    return w->rb.copy.prim ? rfi_dnnl_copy_run(&w->rb.copy, s, r_blocks, out,
                                               "winograd convolution")
                           : RF_OK;
}

int rfi_winograd_epilogue_ops(const rfi_winograd *w) { return w->n_epi; }

bool rfi_winograd_laid_out(const rfi_winograd *w, int k)
{
    const blocking *b = k == 0 ? &w->xb : k == 1 ? &w->kb : &w->rb;
    return k >= 0 && k < 3 && b->laid_out;
}

const char *rfi_winograd_path(const rfi_winograd *w, bool rounded)
{
    static const char *const names[2][2] = {{"winograd 4x4", "winograd 3x3"},
                                            {"winograd 4x4 bf16-rounded",
                                             "winograd 3x3 bf16-rounded"}};
    return names[rounded][w->form == RESULT_TILES ? 0 : 1];
}

void rfi_winograd_free(rfi_winograd *w)
{
    if (!w)
        return;
    rfi_dnnl_mm_destroy(&w->full);
    rfi_dnnl_mm_destroy(&w->last);
    rfi_dnnl_copy_free(&w->xb.copy);
    rfi_dnnl_copy_free(&w->kb.copy);
    rfi_dnnl_copy_free(&w->rb.copy);
    rfi_free(w);
}
