/* render_conv.c: a direct convolution step (kir.h RFI_KIR_STEP_CONV) as C:
 * one kernel function over a range of output rows and its block in the
 * entry point. render_c.c places both and emits what they use from its
 * prelude (the vector types rf_f32x8 and rf_f32x16, rf_max_f32).
 *
 * The loop. Output channels are the vector lanes: L = 16 when their count
 * is a multiple of 16, else 8, in O/L lane blocks. For each output row
 * (image n, row i) the kernel copies the kh input rows it reads into a
 * zero-padded table `rows` [kh][padded width][c] (channels innermost,
 * whatever x's layout), so the inner loop has no bounds tests. A register
 * block holds `cnt` outputs of the row, one vector accumulator each; for
 * every (ky, kx, ci) it loads one vector of the kernel (reordered once per
 * call into `wt` [kh][kw][c][o]) and adds input scalar times that vector
 * to every accumulator: cnt independent chains, each input element loaded
 * once per block and broadcast. Blocks are at most 14 outputs wide for 8
 * lanes and 7 for 16 (that many accumulators and the kernel vector fit the
 * 16 vector registers of AVX2; gcc keeps GNU vectors in registers at -O2,
 * where it did not keep an array of accumulators: 56 against 145 GFLOP/s).
 * The block's sums go through a small `tile`, where the epilogue is applied
 * per element with the interpreter's semantics and stored in y's layout.
 *
 * Sums run in f32 in (ky, kx, ci) order, as a library convolution's do; the
 * tests compare them with the interpreter within the usual tolerance.
 */
#include <stdio.h>
#include <string.h>

#include "render_conv.h"

#define BLOCK_MAX_8 14
#define BLOCK_MAX_16 7
/* Rows per parallel chunk: at least this many multiply-adds. */
#define CHUNK_MACS 65536

typedef struct conv_form {
    const rfi_kir_conv *d;
    int64_t lanes, lane_blocks; /* L and O / L */
    int64_t width;              /* padded input row: (ow - 1) * stride + kw */
    int64_t block, full_blocks; /* outputs per register block; blocks of that width */
    int64_t last;               /* outputs of the last block (1..block) */
    const char *vec;            /* rf_f32x8 or rf_f32x16 */
} conv_form;

static conv_form form_of(const rfi_kir_conv *d)
{
    conv_form f;
    f.d = d;
    f.lanes = d->o % 16 == 0 ? 16 : 8;
    f.lane_blocks = d->o / f.lanes;
    f.width = (d->ow - 1) * d->stride[1] + d->kw;
    int64_t most = f.lanes == 16 ? BLOCK_MAX_16 : BLOCK_MAX_8;
    int64_t blocks = (d->ow + most - 1) / most;
    f.block = (d->ow + blocks - 1) / blocks;
    f.full_blocks = blocks - 1;
    f.last = d->ow - f.full_blocks * f.block;
    f.vec = f.lanes == 16 ? "rf_f32x16" : "rf_f32x8";
    return f;
}

static void kernel_name(const rfi_kir_step *st, char *buf, size_t n)
{
    snprintf(buf, n, "k%d_conv", st->step);
}

/* Element (n, ci, y, ix) of x in its layout (not channels last: those rows
 * are copied whole), as a C expression. */
static void x_index(const rfi_kir_conv *d, char *buf, size_t n)
{
    long long C = (long long)d->c, H = (long long)d->h, W = (long long)d->w;
    if (d->x_layout == RFI_LAYOUT_C16)
        snprintf(buf, n, "(((n * %lld + ci / 16) * %lld + y) * %lld + ix) * 16 + ci %% 16",
                 C / 16, H, W);
    else
        snprintf(buf, n, "((n * %lld + ci) * %lld + y) * %lld + ix", C, H, W);
}

/* Output (n, ob * L + l, i, j0 + b) of y: `at` is its offset for l = 0 and
 * *lane_step the distance between lanes. */
static void y_index(const conv_form *f, char *at, size_t n, int64_t *lane_step)
{
    const rfi_kir_conv *d = f->d;
    long long O = (long long)d->o, OH = (long long)d->oh, OW = (long long)d->ow;
    long long L = (long long)f->lanes;
    *lane_step = 1;
    if (d->y_layout == RFI_LAYOUT_NHWC)
        snprintf(at, n, "((n * %lld + i) * %lld + j0 + b) * %lld + ob * %lld", OH, OW, O, L);
    else if (d->y_layout == RFI_LAYOUT_C16) /* L = 16: lane block ob is channel block ob */
        snprintf(at, n, "(((n * %lld + ob) * %lld + i) * %lld + j0 + b) * 16", O / 16, OH, OW);
    else {
        snprintf(at, n, "((n * %lld + ob * %lld) * %lld + i) * %lld + j0 + b", O, L, OH, OW);
        *lane_step = d->oh * d->ow;
    }
}

/* Fills rows[ky] for output row (n, i): the input row it reads, zero where
 * that row or column is padding. */
static void fill_rows(rfi_strbuf *sb, const conv_form *f)
{
    const rfi_kir_conv *d = f->d;
    long long C = (long long)d->c, W = (long long)d->w, width = (long long)f->width;
    long long left = (long long)d->pad[1];
    long long copied = width - left < W ? width - left : W; /* input columns read */
    rfi_sb_printf(sb,
                  "        for (int64_t ky = 0; ky < %lld; ky++) {\n"
                  "            float *restrict row = rows + ky * %lld;\n"
                  "            const int64_t y = i * %lld + ky - %lld;\n"
                  "            memset(row, 0, sizeof(float) * %lld);\n"
                  "            if (y < 0 || y >= %lld)\n                continue;\n",
                  (long long)d->kh, width * C, (long long)d->stride[0], (long long)d->pad[0],
                  width * C, (long long)d->h);
    if (copied > 0 && (d->x_layout == RFI_LAYOUT_NHWC || d->c == 1)) {
        /* the row is contiguous: [w][c] */
        rfi_sb_printf(sb, "            memcpy(row + %lld, x + (n * %lld + y) * %lld, "
                          "sizeof(float) * %lld);\n",
                      left * C, (long long)d->h, W * C, copied * C);
    } else if (copied > 0) {
        char xi[160];
        x_index(d, xi, sizeof xi);
        rfi_sb_printf(sb,
                      "            for (int64_t ix = 0; ix < %lld; ix++)\n"
                      "                for (int64_t ci = 0; ci < %lld; ci++)\n"
                      "                    row[(ix + %lld) * %lld + ci] = x[%s];\n",
                      copied, C, left, C, xi);
    }
    rfi_sb_printf(sb, "        }\n");
}

/* The epilogue's ops on v, in order (kir.h rfi_kir_conv). */
static void epilogue(rfi_strbuf *sb, const rfi_kir_conv *d, int64_t lanes, int64_t lane_step)
{
    for (int e = 0; e < d->n_epi; e++) {
        const char *ind = "                        ";
        if (d->epi[e] == RFI_EPI_BIAS)
            rfi_sb_printf(sb, "%sv = v + c->e%d[ob * %lld + l];\n", ind, e, (long long)lanes);
        else if (d->epi[e] == RFI_EPI_RELU)
            rfi_sb_printf(sb, "%sv = rf_max_f32(v, 0.0f);\n", ind);
        else /* RFI_EPI_ADD, in y's layout */
            rfi_sb_printf(sb, "%sv = v + c->e%d[at + l * %lld];\n", ind, e,
                          (long long)lane_step);
    }
}

/* One register block of `cnt` outputs starting at column j0, inside the
 * loop over lane blocks and the block's own braces (opened by `open`). */
static void block(rfi_strbuf *sb, const conv_form *f, int64_t cnt, const char *open)
{
    const rfi_kir_conv *d = f->d;
    long long C = (long long)d->c, O = (long long)d->o, L = (long long)f->lanes;
    long long step = (long long)(d->stride[1] * d->c);
    rfi_sb_printf(sb, "%s", open);
    for (int64_t b = 0; b < cnt; b++)
        rfi_sb_printf(sb, "                %s acc%lld = {0};\n", f->vec, (long long)b);
    rfi_sb_printf(sb,
                  "                for (int64_t ky = 0; ky < %lld; ky++)\n"
                  "                    for (int64_t kx = 0; kx < %lld; kx++)\n"
                  "                        for (int64_t ci = 0; ci < %lld; ci++) {\n"
                  "                            %s wv;\n"
                  "                            memcpy(&wv, wo + ((ky * %lld + kx) * %lld + ci) * "
                  "%lld, sizeof wv);\n"
                  "                            const float *restrict p =\n"
                  "                                rows + ky * %lld + (j0 * %lld + kx) * %lld + "
                  "ci;\n",
                  (long long)d->kh, (long long)d->kw, C, f->vec, (long long)d->kw, C, O,
                  (long long)(f->width * d->c), (long long)d->stride[1], C);
    for (int64_t b = 0; b < cnt; b++)
        rfi_sb_printf(sb, "                            acc%lld += p[%lld] * wv;\n", (long long)b,
                      (long long)b * step);
    rfi_sb_printf(sb, "                        }\n");
    for (int64_t b = 0; b < cnt; b++)
        rfi_sb_printf(sb, "                memcpy(tile + %lld, &acc%lld, sizeof acc%lld);\n",
                      (long long)b * L, (long long)b, (long long)b);
    char at[200];
    int64_t lane_step;
    y_index(f, at, sizeof at, &lane_step);
    rfi_sb_printf(sb,
                  "                for (int64_t b = 0; b < %lld; b++) {\n"
                  "                    const int64_t at = %s;\n"
                  "                    #pragma omp simd\n"
                  "                    for (int64_t l = 0; l < %lld; l++) {\n"
                  "                        float v = tile[b * %lld + l];\n",
                  (long long)cnt, at, L, L);
    epilogue(sb, d, f->lanes, lane_step);
    rfi_sb_printf(sb,
                  "                        c->y[at + l * %lld] = v;\n"
                  "                    }\n                }\n            }\n",
                  (long long)lane_step);
}

static void ctx_struct(rfi_strbuf *sb, const rfi_kir_step *st, const char *kname)
{
    const rfi_kir_conv *d = &st->conv;
    rfi_sb_printf(sb,
                  "struct %s_ctx {\n"
                  "    const float *restrict x;\n"
                  "    const float *restrict w;\n"
                  "    float *restrict y;\n",
                  kname);
    for (int e = 0; e < d->n_epi; e++)
        if (d->epi_buffer[e] >= 0)
            rfi_sb_printf(sb, "    const float *restrict e%d;\n", e);
    rfi_sb_printf(sb, "};\n\n");
}

static void comment(rfi_strbuf *sb, const rfi_kir_step *st, const conv_form *f)
{
    const rfi_kir_conv *d = &st->conv;
    rfi_sb_printf(sb,
                  "/* step %d: direct convolution, %lld -> %lld channels, %lldx%lld kernel, "
                  "stride %lldx%lld, %lldx%lld -> %lldx%lld;\n"
                  " * %lld-lane vectors of output channels, blocks of %lld outputs",
                  st->step, (long long)d->c, (long long)d->o, (long long)d->kh, (long long)d->kw,
                  (long long)d->stride[0], (long long)d->stride[1], (long long)d->h,
                  (long long)d->w, (long long)d->oh, (long long)d->ow, (long long)f->lanes,
                  (long long)f->block);
    const char *text = st->comment ? strchr(st->comment, '\n') : NULL;
    for (; text && *text; ) { /* the step's IR nodes, after its first line */
        const char *eol = strchr(text + 1, '\n');
        size_t len = eol ? (size_t)(eol - text - 1) : strlen(text + 1);
        rfi_sb_printf(sb, "\n *%.*s", (int)len, text + 1);
        text = eol;
    }
    rfi_sb_printf(sb, " */\n");
}

void rfi_render_conv_kernel(const rfi_kir_step *st, rfi_strbuf *decl, rfi_strbuf *def)
{
    const rfi_kir_conv *d = &st->conv;
    conv_form f = form_of(d);
    char kname[32];
    kernel_name(st, kname, sizeof kname);
    comment(decl, st, &f);
    ctx_struct(decl, st, kname);
    rfi_sb_printf(decl, "RF_KERNEL void %s(void *ctx, int64_t lo, int64_t hi);\n\n", kname);

    long long C = (long long)d->c, O = (long long)d->o, KH = (long long)d->kh,
              KW = (long long)d->kw, L = (long long)f.lanes;
    rfi_sb_printf(def,
                  "RF_KERNEL void %s(void *ctx, int64_t lo, int64_t hi)\n{\n"
                  "    const struct %s_ctx *c = ctx;\n"
                  "    const float *restrict x = c->x;\n"
                  "    float wt[%lld]; /* [kh][kw][c][o] */\n"
                  "    for (int64_t o = 0; o < %lld; o++)\n"
                  "        for (int64_t ci = 0; ci < %lld; ci++)\n"
                  "            for (int64_t ky = 0; ky < %lld; ky++)\n"
                  "                for (int64_t kx = 0; kx < %lld; kx++)\n"
                  "                    wt[((ky * %lld + kx) * %lld + ci) * %lld + o] =\n"
                  "                        c->w[((o * %lld + ci) * %lld + ky) * %lld + kx];\n"
                  "    float rows[%lld]; /* [kh][padded width][c] */\n"
                  "    float tile[%lld];\n"
                  "    for (int64_t r = lo; r < hi; r++) {\n"
                  "        const int64_t n = r / %lld, i = r %% %lld;\n",
                  kname, kname, C * KH * KW * O, O, C, KH, KW, KW, C, O, C, KH, KW,
                  (long long)(KH * f.width * C), (long long)f.block * L, (long long)d->oh,
                  (long long)d->oh);
    fill_rows(def, &f);
    rfi_sb_printf(def, "        for (int64_t ob = 0; ob < %lld; ob++) {\n"
                       "            const float *restrict wo = wt + ob * %lld;\n",
                  (long long)f.lane_blocks, L);
    if (f.full_blocks > 0) {
        char open[128];
        snprintf(open, sizeof open,
                 "            for (int64_t j0 = 0; j0 < %lld; j0 += %lld) {\n",
                 (long long)(f.full_blocks * f.block), (long long)f.block);
        block(def, &f, f.block, open);
    }
    char open[128];
    snprintf(open, sizeof open, "            {\n                const int64_t j0 = %lld;\n",
             (long long)(f.full_blocks * f.block));
    block(def, &f, f.last, open);
    rfi_sb_printf(def, "        }\n    }\n}\n\n");
}

/* (const float *)(bufs[buffer] + offset bytes) */
static void pointer(rfi_strbuf *sb, const char *type, int buffer, size_t offset)
{
    if (offset)
        rfi_sb_printf(sb, "(%s *)(void *)((char *)bufs[%d] + %zu)", type, buffer, offset);
    else
        rfi_sb_printf(sb, "(%s *)bufs[%d]", type, buffer);
}

void rfi_render_conv_call(const rfi_kir_step *st, rfi_strbuf *sb)
{
    const rfi_kir_conv *d = &st->conv;
    char kname[32];
    kernel_name(st, kname, sizeof kname);
    rfi_sb_printf(sb, "    {\n        struct %s_ctx c = {", kname);
    pointer(sb, "float", d->x_buffer, d->x_offset);
    rfi_sb_printf(sb, ", ");
    pointer(sb, "float", d->w_buffer, d->w_offset);
    rfi_sb_printf(sb, ", ");
    pointer(sb, "float", d->y_buffer, d->y_offset);
    for (int e = 0; e < d->n_epi; e++)
        if (d->epi_buffer[e] >= 0) {
            rfi_sb_printf(sb, ", ");
            pointer(sb, "float", d->epi_buffer[e], d->epi_offset[e]);
        }
    rfi_sb_printf(sb, "};\n");
    int64_t rows = d->n * d->oh;
    int64_t row_macs = d->ow * d->o * d->c * d->kh * d->kw;
    int64_t grain = (CHUNK_MACS + row_macs - 1) / (row_macs > 0 ? row_macs : 1);
    if (rows > grain)
        rfi_sb_printf(sb, "        s->parallel_for(s->rt, %lld, %lld, %s, &c);\n",
                      (long long)rows, (long long)grain, kname);
    else
        rfi_sb_printf(sb, "        %s(&c, 0, %lld);\n", kname, (long long)rows);
    rfi_sb_printf(sb, "    }\n");
}
