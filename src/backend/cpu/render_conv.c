/* render_conv.c: a direct convolution step (kir.h RFI_KIR_STEP_CONV) as C:
 * its kernel function(s) and its block in the entry point. render_c.c
 * places both and emits what they use from its prelude (the vector types
 * rf_f32x8 and rf_f32x16, rf_max_f32).
 *
 * The output channels (8 or 16: kir_conv.c) are the lanes of one GNU C
 * vector, or, where the machine's vectors hold 8 floats, of one vector per
 * block of 8 in a loop over the blocks (a forward's 16, a weight
 * gradient's up to 64; rfi_kir_conv.lanes). For each output row (image
 * n, row i) a kernel finds the kh input rows that row reads in a
 * zero-padded table `rows` [kh slots][padded width][c] (channels innermost,
 * whatever x's layout), copying only those the previous output row did not
 * read (input row u lives in slot u mod kh: copies and zeroing of the table
 * were ~5% of a ResNet step when every row copied all kh), so the inner
 * loops have no bounds tests, and multiplies input scalars (broadcast) by
 * vectors over the output channels. Having copied a row, it asks for the
 * cache lines of the row it will copy two output rows on (rf_prefetch_floats,
 * PREFETCH_AHEAD; a weight gradient also for that row of the output
 * gradient): a row is read in a burst and then computed on for about a
 * thousand cycles, and without the hint the burst waited for memory (perf
 * put ~6% of a ResNet run in those copies; the direct convolutions ran
 * 11-14% faster with a hint one row ahead, ~5% more with two):
 *
 *   FORWARD: a register block holds up to 14 outputs of the row (7 for 16
 *   lanes), one accumulator each; for every (ky, kx, ci) it loads one
 *   vector of the kernel (reordered once per call into `wt` [kh][kw][c][o])
 *   and adds input times kernel to every accumulator: that many
 *   independent chains, each input element loaded once per block. With
 *   several vectors of output channels a block holds up to 4 of them
 *   (7 outputs times 2 vectors, ...), so each input element loaded feeds
 *   that many accumulators (the ResNet's 1x1 8 -> 16 strided layer ~10%
 *   faster than one vector at a time, its 3x3 one ~2%, on one thread).
 *   gcc -O2 keeps such named vectors in registers, where it did not keep
 *   an array of accumulators (56 against 145 GFLOP/s on the ResNet's
 *   8-channel layer), once its predictive commoning is off (RF_CONV_LOOP:
 *   with one input channel it carried a tap's inputs to the next in
 *   registers and spilled the accumulators; the 1 -> 8 layer 0.26 -> 0.17
 *   ms). The block's sums go through a small `tile`, where the epilogue is
 *   applied per element with the interpreter's semantics and stored in y's
 *   layout. A dilated input (the input gradient of a strided layer) is
 *   never expanded: rows between input rows are skipped (valid[ky]), and
 *   the outputs of a row split into phases j mod d, each of which meets
 *   every d-th tap at consecutive input columns (conv_phase), so no
 *   multiply-add touches a zero of the dilation.
 *
 *   WEIGHT_GRAD: the rows are cut into GRAD_CHUNKS chunks run in parallel,
 *   each folding its rows into its own partial gradient [kh][kw][c][o] on
 *   the entry point's stack. A register group holds up to 12 points of
 *   (ky, kx, ci), one accumulator each (the c points of one (ky, kx) in a
 *   loop over them when there are 4 to 12 input channels: one copy of the
 *   code), and for every output of the row loads one vector of the output
 *   gradient and adds input times gradient to every accumulator (a spread
 *   pool gradient, kir.h, is first written row by row into a small table
 *   from the pooled cotangent and the codes: spread_row). _combine
 *   then adds the chunks' partials in chunk order into y [c, o, kh, kw], so
 *   the result does not depend on the thread count.
 *
 * The forward's blocks fit AVX2's 16 vector registers; a weight gradient's
 * groups of 12 sixteen-lane accumulators want AVX-512's 32 (gcc spills some
 * on a machine with 16, which stays correct). Steps whose loops are the same
 * (the ResNet's four 8 -> 8 convolutions) share one kernel
 * (rfi_render_conv_same): each costs gcc 40-140 ms.
 *
 * At RF_PRECISION_BF16 each operand value is rounded where the kernel
 * first copies it (rfi_kir_conv.bf16), so the inner loops stay as they are:
 * an input row as it enters the table, the kernel as it is reordered, the
 * output gradient's row as it is gathered into `drow` (a gather that f32
 * does without for blocked and channels-last gradients).
 *
 * Sums run in f32 in (ky, kx, ci) or row order, as a library convolution's
 * do; the tests compare them with the interpreter within the usual
 * tolerance.
 */
#include <assert.h>
#include <stdio.h>
#include <string.h>

#include "render_conv.h"

#define BLOCK_MAX_8 14
#define BLOCK_MAX_16 7
#define VECS_MAX 4 /* forward: 4 vectors of 3 outputs, 12 accumulators */
/* Forward: rows per parallel chunk hold at least this many multiply-adds. */
#define CHUNK_MACS 65536
#define GRAD_CHUNKS 8
#define GROUP_MAX 12 /* weight gradient: accumulators per register group */
#define GROUP_MIN_LOOPED 4
/* Output rows ahead that a kernel asks for the rows it will read: 2 ran the
 * ResNet step's direct convolutions ~5% faster than 1 on one thread (twice
 * 4 alternating runs), 3 and 4 about as 2. */
#define PREFETCH_AHEAD 2

/* The outputs j = first + step * jj (jj < count) of a row that read the
 * same taps b = tap0 + tap_step * m (m < taps) of the kernel, at table
 * column col0 + jj * col_step + m: with lhs dilation d > 1 the outputs of
 * one phase j mod d (only every d-th tap meets an input column), else all
 * of them. */
typedef struct conv_phase {
    int64_t first, step, count;
    int64_t tap0, tap_step, taps;
    int64_t col0, col_step;
    int64_t block, full_blocks; /* outputs per register block; blocks of that width */
    int64_t last;               /* outputs of a last, narrower block (0: none) */
} conv_phase;

#define MAX_PHASES 4 /* kir_conv.c's largest dilation (DIRECT_MAX_STRIDE) */

typedef struct conv_form {
    const rfi_kir_conv *d;
    int64_t lanes;   /* output channels per vector: o (8 or 16), or the block
                      * of a weight gradient's blocked output gradient */
    int64_t left;    /* table column of input column 0 */
    int64_t width;   /* table columns: (ow - 1) * stride + kw without dilation */
    int n_phases;
    conv_phase phases[MAX_PHASES];
    int64_t block_max; /* forward: the widest register block */
    int64_t vecs;      /* forward: vectors of output channels per block (VECS_MAX at most) */
    int64_t chunks;    /* weight gradient: chunks of rows folded into partials apart
                        * (combined in chunk order: the result does not depend on
                        * the thread count) */
    const char *vec;   /* rf_f32x8 or rf_f32x16 */
} conv_form;

static void split_blocks(conv_phase *ph, int64_t most)
{
    int64_t blocks = ph->count > 0 ? (ph->count + most - 1) / most : 1;
    ph->block = ph->count > 0 ? (ph->count + blocks - 1) / blocks : 1;
    ph->full_blocks = ph->count % ph->block == 0 ? ph->count / ph->block : blocks - 1;
    ph->last = ph->count - ph->full_blocks * ph->block;
}

/* Phases of the columns and the table's geometry. Without dilation: one
 * phase, output j reads table columns j * stride + b, the input's column 0
 * at table column pad. With dilation d: phase p's first tap b0 is the one
 * that meets an input column at output p, (p + b0 - pad) / d that column. */
static void column_phases(conv_form *f)
{
    const rfi_kir_conv *d = f->d;
    int64_t dil = d->dilation[1], pad = d->pad[1];
    int64_t most = (f->lanes == 16 ? BLOCK_MAX_16 : BLOCK_MAX_8) / f->vecs;
    assert(dil >= 1 && dil <= MAX_PHASES);
    f->n_phases = 0;
    int64_t low = 0, high = 0; /* table columns read, before shifting by `left` */
    for (int64_t p = 0; p < dil && p < d->ow; p++) {
        conv_phase *ph = &f->phases[f->n_phases++];
        ph->first = p;
        ph->step = dil;
        ph->count = (d->ow - p + dil - 1) / dil;
        ph->tap0 = ((pad - p) % dil + dil) % dil;
        ph->tap_step = dil;
        ph->taps = ph->tap0 < d->kw ? (d->kw - ph->tap0 + dil - 1) / dil : 0;
        ph->col0 = (p + ph->tap0 - pad) / dil; /* exact */
        ph->col_step = dil > 1 ? 1 : d->stride[1];
        split_blocks(ph, most);
        if (ph->taps == 0)
            continue;
        int64_t last_col = ph->col0 + (ph->count - 1) * ph->col_step + ph->taps - 1;
        low = ph->col0 < low ? ph->col0 : low;
        high = last_col > high ? last_col : high;
    }
    f->left = low < 0 ? -low : 0;
    f->width = f->left + high + 1;
    f->block_max = 1;
    for (int k = 0; k < f->n_phases; k++) {
        f->phases[k].col0 += f->left;
        if (f->phases[k].block > f->block_max)
            f->block_max = f->phases[k].block;
    }
}

static conv_form form_of(const rfi_kir_conv *d)
{
    conv_form f;
    memset(&f, 0, sizeof f);
    f.d = d;
    f.lanes = d->lanes;
    f.vecs = 1;
    for (int64_t v = VECS_MAX; d->kind == RFI_KIR_CONV_FORWARD && v > 1 && f.vecs == 1; v--)
        if (d->o / d->lanes % v == 0)
            f.vecs = v;
    column_phases(&f);
    int64_t rows = d->n * d->oh;
    f.chunks = rows < GRAD_CHUNKS ? rows : GRAD_CHUNKS;
    f.vec = f.lanes == 16 ? "rf_f32x16" : "rf_f32x8";
    return f;
}

/* Indentation of `depth` levels of four spaces (at most 8). */
static const char *indent(int depth)
{
    static const char spaces[] = "                                ";
    return spaces + sizeof spaces - 1 - 4 * depth;
}

/* What an operand value is wrapped in as the kernel first copies it: the
 * rounding at bf16, else nothing. */
static const char *round_open(const rfi_kir_conv *d)
{
    return d->bf16 ? "rf_round_bf16(" : "";
}

static const char *round_close(const rfi_kir_conv *d)
{
    return d->bf16 ? ")" : "";
}

static void kernel_name(int step, char *buf, size_t n)
{
    snprintf(buf, n, "k%d_conv", step);
}

/* ---- Shared pieces ------------------------------------------------------------------ */

/* The row table's declarations: kh slots of the padded width, zero once
 * (padding columns are never written again), none holding a row yet. */
static void rows_table(rfi_strbuf *sb, const conv_form *f)
{
    long long KH = (long long)f->d->kh, size = KH * (long long)(f->width * f->d->c);
    rfi_sb_printf(sb,
                  "    float rows[%lld]; /* [kh slots][padded width][c] */\n"
                  "    const float *rowp[%lld]; /* the slot of each ky */\n"
                  "    int64_t held[%lld]; /* each slot's row: n * h + y; -1 zeros; -2 none */\n"
                  "    memset(rows, 0, sizeof rows);\n"
                  "    for (int64_t k = 0; k < %lld; k++)\n"
                  "        held[k] = -2;\n",
                  size, KH, KH, KH);
}

/* Asks for the first `used` floats of each plane of row r2 = `next` (image
 * r2 / h, row r2 % h) of `array`, laid out as [images][planes][h][floats]
 * (one plane: [images * h][floats]), unless r2 is past the array's `rows`. */
static void prefetch_row(rfi_strbuf *sb, const char *array, const char *next, long long rows,
                         long long h, long long planes, long long floats, long long used,
                         int depth)
{
    const char *in = indent(depth), *in1 = indent(depth + 1), *in2 = indent(depth + 2);
    rfi_sb_printf(sb, "%s{\n%sconst int64_t r2 = %s;\n%sif (r2 < %lld)\n", in, in1, next, in1,
                  rows);
    if (planes == 1)
        rfi_sb_printf(sb, "%srf_prefetch_floats(%s + r2 * %lld, %lld);\n", in2, array, floats,
                      used);
    else
        rfi_sb_printf(sb,
                      "%sfor (int64_t b = 0; b < %lld; b++)\n"
                      "%s    rf_prefetch_floats(%s + ((r2 / %lld * %lld + b) * %lld + r2 %% %lld) "
                      "* %lld, %lld);\n",
                      in2, planes, in2, array, h, planes, h, h, floats, used);
    rfi_sb_printf(sb, "%s}\n", in);
}

/* Points rowp[ky] at the input row output row (n, i) reads with tap row ky:
 * input row u goes to slot u mod kh, where the next output rows, which read
 * kh - 1 of the same rows, find it again, so each input row is copied about
 * once per image rather than kh times. A row that is padding (or, dilated,
 * between input rows) is zeros; with `valid`, valid[ky] says whether it is
 * an input row at all and such rows are not zeroed (the caller skips them). */
static void fill_rows(rfi_strbuf *sb, const conv_form *f, int depth, bool valid)
{
    const rfi_kir_conv *d = f->d;
    const char *in = indent(depth), *in1 = indent(depth + 1), *in2 = indent(depth + 2);
    long long C = (long long)d->c, H = (long long)d->h, W = (long long)d->w, KH = (long long)d->kh;
    long long width = (long long)f->width, left = (long long)f->left;
    long long dil = (long long)d->dilation[0];
    long long copied = width - left < W ? width - left : W; /* input columns read */
    rfi_sb_printf(sb,
                  "%sfor (int64_t ky = 0; ky < %lld; ky++) {\n"
                  "%sconst int64_t u = i * %lld + ky - %lld, y = u / %lld;\n"
                  "%sconst int64_t slot = (u %% %lld + %lld) %% %lld;\n"
                  "%sfloat *restrict row = rows + slot * %lld;\n"
                  "%srowp[ky] = row;\n",
                  in, KH, in1, (long long)d->stride[0], (long long)d->pad[0], dil, in1, KH, KH,
                  KH, in1, width * C, in1);
    if (dil > 1)
        rfi_sb_printf(sb, "%sconst int ok = u >= 0 && u %% %lld == 0 && y < %lld;\n", in1, dil, H);
    else
        rfi_sb_printf(sb, "%sconst int ok = u >= 0 && y < %lld;\n", in1, H);
    if (valid)
        rfi_sb_printf(sb, "%svalid[ky] = (unsigned char)ok;\n%sif (!ok)\n%scontinue;\n", in1,
                      in1, in2);
    else
        rfi_sb_printf(sb,
                      "%sif (!ok) {\n"
                      "%sif (held[slot] != -1)\n"
                      "%s    memset(row, 0, sizeof(float) * %lld);\n"
                      "%sheld[slot] = -1;\n"
                      "%scontinue;\n"
                      "%s}\n",
                      in1, in2, in2, width * C, in2, in2, in1);
    rfi_sb_printf(sb,
                  "%sif (held[slot] == n * %lld + y)\n%scontinue;\n"
                  "%sheld[slot] = n * %lld + y;\n",
                  in1, H, in2, in1, H);
    long long B = rfi_layout_block(d->x_layout);
    bool contiguous = d->x_layout == RFI_LAYOUT_NHWC || d->c == 1 || d->c == B; /* [w][c] */
    if (copied > 0 && contiguous) {
        rfi_sb_printf(sb,
                      "%smemcpy(row + %lld, x + (n * %lld + y) * %lld, sizeof(float) * %lld);\n",
                      in1, left * C, H, W * C, copied * C);
    } else if (copied > 0 && B > 0 && C % B == 0) {
        /* per block of B channels, B contiguous floats per column (indexing x
         * by ci / B and ci % B instead made gcc gather them) */
        rfi_sb_printf(sb,
                      "%sfor (int64_t cb = 0; cb < %lld; cb++) {\n"
                      "%sconst float *restrict src = x + ((n * %lld + cb) * %lld + y) * %lld;\n"
                      "%sfor (int64_t ix = 0; ix < %lld; ix++)\n"
                      "%s    for (int64_t j = 0; j < %lld; j++)\n"
                      "%s        row[(ix + %lld) * %lld + cb * %lld + j] = src[ix * %lld + j];\n"
                      "%s}\n",
                      in1, C / B, in2, C / B, H, W * B, in2, copied, in2, B, in2, left, C, B, B,
                      in1);
    } else if (copied > 0) {
        char at[160];
        if (B > 0)
            snprintf(at, sizeof at,
                     "(((n * %lld + ci / %lld) * %lld + y) * %lld + ix) * %lld + ci %% %lld", C / B,
                     B, H, W, B, B);
        else
            snprintf(at, sizeof at, "((n * %lld + ci) * %lld + y) * %lld + ix", C, H, W);
        rfi_sb_printf(sb,
                      "%sfor (int64_t ix = 0; ix < %lld; ix++)\n"
                      "%sfor (int64_t ci = 0; ci < %lld; ci++)\n"
                      "%s    row[(ix + %lld) * %lld + ci] = x[%s];\n",
                      in1, copied, in2, C, in2, left, C, at);
    }
    if (copied > 0 && d->bf16)
        rfi_sb_printf(sb,
                      "%s#pragma omp simd\n"
                      "%sfor (int64_t q = %lld; q < %lld; q++)\n"
                      "%s    row[q] = rf_round_bf16(row[q]);\n",
                      in1, in1, left * C, (left + copied) * C, in1);
    if (copied > 0) {
        char next[96];
        snprintf(next, sizeof next, "n * %lld + y + %lld", H,
                 (long long)(d->stride[0] * PREFETCH_AHEAD));
        /* channels side by side in a row (at least 1: a convolution may have none) */
        long long per = contiguous && C > 0 ? C : B > 0 ? B : 1;
        prefetch_row(sb, "x", next, (long long)d->n * H, H, C / per, W * per, copied * per,
                     depth + 1);
    }
    rfi_sb_printf(sb, "%s}\n", in);
}

static void ctx_struct(rfi_strbuf *sb, const rfi_kir_conv *d, const char *kname)
{
    rfi_sb_printf(sb,
                  "struct %s_ctx {\n"
                  "    const float *restrict x;\n"
                  "    const float *restrict w;\n"
                  "    float *restrict y;\n",
                  kname);
    for (int e = 0; e < d->n_epi; e++)
        if (d->epi_buffer[e] >= 0)
            rfi_sb_printf(sb, "    const float *restrict e%d;\n", e);
    if (d->kind == RFI_KIR_CONV_WEIGHT_GRAD)
        rfi_sb_printf(sb, "    float *restrict part; /* [chunks][kh][kw][c][o] */\n");
    if (d->spread)
        rfi_sb_printf(sb, "    const int32_t *restrict codes; /* w: the pooled cotangent */\n");
    if (d->pool_kernel >= 0)
        rfi_sb_printf(sb, "    void *pool; /* the pool's kernel's ctx */\n");
    rfi_sb_printf(sb, "};\n\n");
}

/* The kernel's comment: what it computes, then the step's IR nodes (the
 * lines after the first of the lowering's comment). */
static void comment(rfi_strbuf *sb, const rfi_kir_step *st, const conv_form *f)
{
    const rfi_kir_conv *d = &st->conv;
    bool forward = d->kind == RFI_KIR_CONV_FORWARD;
    rfi_strbuf text = {0};
    rfi_sb_printf(&text,
                  "step %d: direct convolution%s, %lld -> %lld channels, %lldx%lld kernel, "
                  "stride %lldx%lld, %lldx%lld -> %lldx%lld%s;\n",
                  st->step, forward ? "" : " (weight gradient)", (long long)d->c,
                  (long long)d->o, (long long)d->kh, (long long)d->kw, (long long)d->stride[0],
                  (long long)d->stride[1], (long long)d->h, (long long)d->w, (long long)d->oh,
                  (long long)d->ow, d->bf16 ? ", operands rounded to bf16" : "");
    if (forward)
        rfi_sb_printf(&text, "%d phase%s, blocks of up to %lld outputs", f->n_phases,
                      f->n_phases > 1 ? "s" : "", (long long)f->block_max);
    else
        rfi_sb_printf(&text, "%lld chunks of rows", (long long)f->chunks);
    if (d->pool_kernel >= 0)
        rfi_sb_printf(&text, ";\nafter each %lld rows of an image, step %d's pool over them%s",
                      (long long)d->pool_rows, d->pool_step,
                      d->tiled ? ",\nthe rows held in a tile, not memory" : "");
    if (d->spread)
        rfi_sb_printf(&text, ";\nthe output gradient spread here from a %lldx%lld pool's "
                      "codes (step %d left out)", (long long)d->win[0], (long long)d->win[1],
                      d->spread_step);
    const char *nodes = st->comment ? strchr(st->comment, '\n') : NULL;
    if (nodes)
        rfi_sb_printf(&text, "%s", nodes);
    sb->failed |= text.failed;
    rfi_render_c_comment(sb, text.data ? text.data : "", 0);
    rfi_sb_free(&text);
}

/* ---- Forward ----------------------------------------------------------------------- */

/* Output (n, (ob + q) * lanes + l, i, first + step * (j0 + b)) of y: `at`
 * is its offset for lane 0 and *lane_step the distance between lanes. */
static void y_index(const conv_form *f, const conv_phase *ph, char *at, size_t n,
                    int64_t *lane_step)
{
    const rfi_kir_conv *d = f->d;
    long long O = (long long)d->o, OH = (long long)d->oh, OW = (long long)d->ow;
    long long L = (long long)f->lanes;
    char j[64];
    if (ph->step == 1)
        snprintf(j, sizeof j, "%lld + j0 + b", (long long)ph->first);
    else
        snprintf(j, sizeof j, "%lld + %lld * (j0 + b)", (long long)ph->first, (long long)ph->step);
    *lane_step = 1;
    if (rfi_layout_blocked(d->y_layout)) /* [N, O/L, OH, OW, L]: blocks of the lanes */
        snprintf(at, n, "(((n * %lld + ob + q) * %lld + i) * %lld + %s) * %lld", O / L, OH, OW, j,
                 L);
    else if (d->y_layout == RFI_LAYOUT_NHWC)
        snprintf(at, n, "((n * %lld + i) * %lld + %s) * %lld + (ob + q) * %lld", OH, OW, j, O, L);
    else {
        snprintf(at, n, "((n * %lld + (ob + q) * %lld) * %lld + i) * %lld + %s", O, L, OH, OW, j);
        *lane_step = d->oh * d->ow;
    }
}

/* The epilogue's ops on v, in order (kir.h rfi_kir_conv). */
static void epilogue(rfi_strbuf *sb, const rfi_kir_conv *d, int64_t lane_step, int depth)
{
    const char *in = indent(depth);
    for (int e = 0; e < d->n_epi; e++) {
        if (d->epi[e] == RFI_EPI_BIAS)
            rfi_sb_printf(sb, "%sv = v + c->e%d[(ob + q) * %lld + l];\n", in, e,
                          (long long)d->lanes);
        else if (d->epi[e] == RFI_EPI_RELU)
            rfi_sb_printf(sb, "%sv = rf_max_f32(v, 0.0f);\n", in);
        else /* RFI_EPI_ADD, in y's layout */
            rfi_sb_printf(sb, "%sv = v + c->e%d[at + l * %lld];\n", in, e, (long long)lane_step);
    }
}

/* One register block of `cnt` outputs of phase ph from its output j0, for
 * the vectors ob .. ob + vecs - 1 of output channels (one accumulator per
 * output and vector: each input element loaded feeds vecs of them), inside
 * the braces `open` begins (at `depth`). */
static void forward_block(rfi_strbuf *sb, const conv_form *f, const conv_phase *ph, int64_t cnt,
                          const char *open, int depth)
{
    const rfi_kir_conv *d = f->d;
    long long C = (long long)d->c, O = (long long)d->o, L = (long long)f->lanes;
    long long V = (long long)f->vecs, step = (long long)(ph->col_step * d->c);
    const char *in = indent(depth), *in1 = indent(depth + 1), *in2 = indent(depth + 2),
               *in3 = indent(depth + 3), *in4 = indent(depth + 4);
    rfi_sb_printf(sb, "%s%s", in, open);
    for (long long b = 0; b < cnt; b++)
        for (long long q = 0; q < V; q++)
            rfi_sb_printf(sb, "%s%s acc%lld_%lld = {0};\n", in1, f->vec, b, q);
    rfi_sb_printf(sb,
                  "%sfor (int64_t ky = 0; ky < %lld; ky++) {\n"
                  "%sif (!valid[ky])\n%scontinue;\n"
                  "%sfor (int64_t m = 0; m < %lld; m++)\n"
                  "%sfor (int64_t ci = 0; ci < %lld; ci++) {\n"
                  "%sconst float *restrict w =\n"
                  "%s    wt + ((ky * %lld + %lld + %lld * m) * %lld + ci) * %lld + ob * %lld;\n"
                  "%sconst float *restrict p =\n"
                  "%s    rowp[ky] + (%lld + j0 * %lld + m) * %lld + ci;\n",
                  in1, (long long)d->kh, in2, in3, in2, (long long)ph->taps, in3, C, in4, in4,
                  (long long)d->kw, (long long)ph->tap0, (long long)ph->tap_step, C, O, L, in4,
                  in4, (long long)ph->col0, (long long)ph->col_step, C);
    for (long long q = 0; q < V; q++)
        rfi_sb_printf(sb, "%s%s wv%lld;\n%smemcpy(&wv%lld, w + %lld, sizeof wv%lld);\n", in4,
                      f->vec, q, in4, q, q * L, q);
    for (long long b = 0; b < cnt; b++)
        for (long long q = 0; q < V; q++)
            rfi_sb_printf(sb, "%sacc%lld_%lld += p[%lld] * wv%lld;\n", in4, b, q, b * step, q);
    rfi_sb_printf(sb, "%s}\n%s}\n", in3, in1);
    for (long long b = 0; b < cnt; b++)
        for (long long q = 0; q < V; q++)
            rfi_sb_printf(sb, "%smemcpy(tile + %lld, &acc%lld_%lld, sizeof acc%lld_%lld);\n", in1,
                          (b * V + q) * L, b, q, b, q);
    char at[200];
    int64_t lane_step;
    y_index(f, ph, at, sizeof at, &lane_step);
    rfi_sb_printf(sb,
                  "%sfor (int64_t b = 0; b < %lld; b++)\n"
                  "%sfor (int64_t q = 0; q < %lld; q++) {\n"
                  "%sconst int64_t at = %s;\n"
                  "%s#pragma omp simd\n"
                  "%sfor (int64_t l = 0; l < %lld; l++) {\n"
                  "%sfloat v = tile[(b * %lld + q) * %lld + l];\n",
                  in1, (long long)cnt, in2, V, in3, at, in3, in3, L, in4, V, L);
    epilogue(sb, d, lane_step, depth + 4);
    rfi_sb_printf(sb, "%s%s[at + l * %lld] = v;\n%s}\n%s}\n%s}\n", in4,
                  d->tiled ? "yt" : "c->y", (long long)lane_step, in3, in2, in);
}

/* The row loop's head: row r of the parallel range is output row (n, i),
 * or with a pool over the result the pool_rows rows of (n, window row pr). */
static void forward_rows_head(rfi_strbuf *def, const rfi_kir_conv *d)
{
    long long OH = (long long)d->oh;
    if (d->pool_kernel < 0) {
        rfi_sb_printf(def,
                      "    for (int64_t r = lo; r < hi; r++) {\n"
                      "        const int64_t n = r / %lld, i = r %% %lld;\n", OH, OH);
        return;
    }
    long long R = (long long)d->pool_rows, PH = OH / R;
    rfi_sb_printf(def,
                  "    for (int64_t r = lo; r < hi; r++) {\n"
                  "        const int64_t n = r / %lld, pr = r %% %lld;\n",
                  PH, PH);
    if (d->tiled) /* the bytes y's index `first` would have, moved to the tile */
        rfi_sb_printf(def,
                      "        const int64_t first = (n * %lld * %lld + pr * %lld) * %lld;\n"
                      "        float *const yt = (float *)((uintptr_t)ytile - "
                      "(uintptr_t)first * sizeof(float));\n",
                      (long long)d->pool_groups, OH, R, (long long)(d->ow * d->lanes));
    rfi_sb_printf(def, "        for (int64_t i = pr * %lld; i < pr * %lld + %lld; i++) {\n", R, R,
                  R);
}

/* The row loop's tail: with a pool, its kernel over the window rows just
 * written, one outermost iteration per channel group. */
static void forward_rows_tail(rfi_strbuf *def, const rfi_kir_conv *d, const char *pool_name)
{
    if (d->pool_kernel < 0) {
        rfi_sb_printf(def, "    }\n");
        return;
    }
    long long G = (long long)d->pool_groups, PH = (long long)(d->oh / d->pool_rows);
    rfi_sb_printf(def,
                  "        }\n"
                  "        for (int64_t g = 0; g < %lld; g++) {\n"
                  "            const int64_t q = (n * %lld + g) * %lld + pr;\n"
                  "            %s(c->pool, q, q + 1%s);\n"
                  "        }\n"
                  "    }\n",
                  G, G, PH, pool_name, d->tiled ? ", yt" : "");
}

/* " RF_LANES16" (render_c.c) for a loop whose vectors are 16 floats. */
static const char *lanes16(const conv_form *f) { return f->lanes == 16 ? " RF_LANES16" : ""; }

static void forward_kernel(const conv_form *f, const char *kname, const char *pool_name,
                           rfi_strbuf *def)
{
    const rfi_kir_conv *d = f->d;
    long long C = (long long)d->c, O = (long long)d->o, KH = (long long)d->kh,
              KW = (long long)d->kw;
    rfi_sb_printf(def,
                  "RF_KERNEL RF_CONV_LOOP%s void %s(void *ctx, int64_t lo, int64_t hi)\n{\n"
                  "    const struct %s_ctx *c = ctx;\n"
                  "    const float *restrict x = c->x;\n"
                  "    float wt[%lld]; /* [kh][kw][c][o] */\n"
                  "    for (int64_t o = 0; o < %lld; o++)\n"
                  "        for (int64_t ci = 0; ci < %lld; ci++)\n"
                  "            for (int64_t ky = 0; ky < %lld; ky++)\n"
                  "                for (int64_t kx = 0; kx < %lld; kx++)\n"
                  "                    wt[((ky * %lld + kx) * %lld + ci) * %lld + o] =\n"
                  "                        %sc->w[((o * %lld + ci) * %lld + ky) * %lld + kx]%s;\n"
                  "    unsigned char valid[%lld];\n"
                  "    float tile[%lld];\n",
                  lanes16(f), kname, kname, C * KH * KW * O, O, C, KH, KW, KW, C, O,
                  round_open(d), C, KH, KW, round_close(d), KH,
                  (long long)(f->block_max * f->vecs * f->lanes));
    if (d->tiled) /* one image's window rows of y, in every channel block */
        rfi_sb_printf(def, "    _Alignas(64) float ytile[%lld];\n", (long long)d->tile_floats);
    rows_table(def, f);
    forward_rows_head(def, d);
    int depth = d->pool_kernel >= 0 ? 3 : 2; /* a row's code, inside the loop over rows */
    fill_rows(def, f, depth, true);
    rfi_sb_printf(def, "%sfor (int64_t ob = 0; ob < %lld; ob += %lld) { /* vectors of o */\n",
                  indent(depth), O / (long long)f->lanes, (long long)f->vecs);
    for (int k = 0; k < f->n_phases; k++) {
        const conv_phase *ph = &f->phases[k];
        char open[128];
        if (ph->full_blocks > 0) {
            snprintf(open, sizeof open, "for (int64_t j0 = 0; j0 < %lld; j0 += %lld) {\n",
                     (long long)(ph->full_blocks * ph->block), (long long)ph->block);
            forward_block(def, f, ph, ph->block, open, depth + 1);
        }
        if (ph->last > 0) {
            snprintf(open, sizeof open, "{\n%sconst int64_t j0 = %lld;\n", indent(depth + 2),
                     (long long)(ph->full_blocks * ph->block));
            forward_block(def, f, ph, ph->last, open, depth + 1);
        }
    }
    rfi_sb_printf(def, "%s}\n", indent(depth));
    forward_rows_tail(def, d, pool_name);
    rfi_sb_printf(def, "}\n\n");
}

/* ---- Weight gradient ------------------------------------------------------------------ */

/* Row (n, i) of a spread output gradient (kir.h), written into `drow`
 * [ow][o]: each element the pooled cotangent's where its window's code
 * names its point, else +0, computed as the interpreter computes the spread
 * (+0 + g). The cotangent is loaded whatever the code (a conditional load
 * kept gcc from vectorising the loop), and a blocked one a block of
 * channels at a time, contiguous. */
static void spread_row(rfi_strbuf *sb, const conv_form *f)
{
    const rfi_kir_conv *d = f->d;
    long long O = (long long)d->o, OW = (long long)d->ow, L = (long long)f->lanes;
    long long WH = (long long)d->win[0], WW = (long long)d->win[1];
    long long PH = (long long)(d->oh / d->win[0]), PW = (long long)(d->ow / d->win[1]);
    bool blocked = rfi_layout_blocked(d->w_layout);
    long long per = blocked ? L : O; /* channels of one inner loop */
    char at[160];
    if (blocked) /* [N, O/L, PH, PW, L] */
        snprintf(at, sizeof at,
                 "(((n * %lld + ob) * %lld + i / %lld) * %lld + j / %lld) * %lld + o", O / L, PH,
                 WH, PW, WW, L);
    else if (d->w_layout == RFI_LAYOUT_NHWC) /* [N, PH, PW, O] */
        snprintf(at, sizeof at, "((n * %lld + i / %lld) * %lld + j / %lld) * %lld + o", PH, WH,
                 PW, WW, O);
    else /* [N, O, PH, PW] */
        snprintf(at, sizeof at, "((n * %lld + o) * %lld + i / %lld) * %lld + j / %lld", O, PH, WH,
                 PW, WW);
    rfi_sb_printf(sb,
                  "            for (int64_t ob = 0; ob < %lld; ob++) /* spread from c->w */\n"
                  "                for (int64_t j = 0; j < %lld; j++) {\n"
                  "                    const int32_t point =\n"
                  "                        (int32_t)(i %% %lld * %lld + j %% %lld);\n"
                  "                    float *restrict to = drow + j * %lld + ob * %lld;\n"
                  "                    #pragma omp simd\n"
                  "                    for (int64_t o = 0; o < %lld; o++) {\n"
                  "                        const int64_t at = %s;\n"
                  "                        const float v = 0.0f + %sc->w[at]%s;\n"
                  "                        to[o] = c->codes[at] == point ? v : 0.0f;\n"
                  "                    }\n"
                  "                }\n",
                  O / per, OW, WH, WW, WW, O, per, per, at, round_open(d), round_close(d));
}

/* Row (n, i) of the output gradient: the vector of output channels ob * L
 * .. ob * L + L - 1 (L lanes) at column j is at `base` + j * *step. A
 * row-major or spread gradient (at bf16 any: rounded) is gathered into
 * `drow` [ow][o] first. */
static void gradient_row(rfi_strbuf *sb, const conv_form *f, char *base, size_t n, int64_t *step)
{
    const rfi_kir_conv *d = f->d;
    long long O = (long long)d->o, OH = (long long)d->oh, OW = (long long)d->ow;
    long long L = (long long)f->lanes;
    *step = d->o;
    if (d->spread) {
        spread_row(sb, f);
        snprintf(base, n, "drow + ob * %lld", L);
        return;
    }
    bool blocked = rfi_layout_blocked(d->w_layout);
    if (blocked && !d->bf16) { /* [N, O/L, OH, OW, L] */
        snprintf(base, n, "c->w + ((n * %lld + ob) * %lld + i) * %lld", O / L, OH, OW * L);
        *step = L;
        return;
    }
    if (d->w_layout == RFI_LAYOUT_NHWC && !d->bf16) {
        snprintf(base, n, "c->w + (n * %lld + i) * %lld + ob * %lld", OH, OW * O, L);
        return;
    }
    char at[160];
    if (blocked)
        snprintf(at, sizeof at, "((n * %lld + o / %lld) * %lld + i) * %lld + j * %lld + o %% %lld",
                 O / L, L, OH, OW * L, L, L);
    else if (d->w_layout == RFI_LAYOUT_NHWC)
        snprintf(at, sizeof at, "(n * %lld + i) * %lld + j * %lld + o", OH, OW * O, O);
    else
        snprintf(at, sizeof at, "((n * %lld + o) * %lld + i) * %lld + j", O, OH, OW);
    rfi_sb_printf(sb,
                  "            for (int64_t o = 0; o < %lld; o++)\n"
                  "                for (int64_t j = 0; j < %lld; j++)\n"
                  "                    drow[j * %lld + o] = %sc->w[%s]%s;\n",
                  O, OW, O, round_open(d), at, round_close(d));
    snprintf(base, n, "drow + ob * %lld", L);
}

/* Asks for the output gradient's row PREFETCH_AHEAD rows on ([N, O/L, OH,
 * OW, L], [N, OH, OW, O] or [N, O, OH, OW]) while this one is folded. */
static void prefetch_gradient_row(rfi_strbuf *sb, const conv_form *f)
{
    const rfi_kir_conv *d = f->d;
    long long O = (long long)d->o, OH = (long long)d->oh, OW = (long long)d->ow;
    long long L = (long long)f->lanes;
    bool blocked = rfi_layout_blocked(d->w_layout), nhwc = d->w_layout == RFI_LAYOUT_NHWC;
    long long per = blocked ? L : nhwc ? O : 1; /* channels side by side in a row */
    char next[32];
    snprintf(next, sizeof next, "r + %d", PREFETCH_AHEAD);
    prefetch_row(sb, "c->w", next, (long long)d->n * OH, OH, O / per, OW * per, OW * per, 3);
}

/* One register group: the partial sums of `count` points of (ky, kx, ci)
 * over the row's outputs. Point u of the group is accumulated at acc +
 * u_acc(u) and reads its tap row at u_row(u) from column j's start: with
 * `first` >= 0 the points are first .. first + count - 1 of t = (ky * kw +
 * kx) * c + ci (literal offsets from p<ky>, one pointer per tap row the
 * group reads), else ci = u at `ak` and `xk` (a loop over (ky, kx) around). */
static void gradient_group(rfi_strbuf *sb, const conv_form *f, int64_t first, int64_t count,
                           const char *base, int64_t step, int depth)
{
    const rfi_kir_conv *d = f->d;
    const char *in = indent(depth), *in1 = indent(depth + 1), *in2 = indent(depth + 2);
    const char *acc = first >= 0 ? "acc" : "ak";
    int64_t acc_at[GROUP_MAX], row_at[GROUP_MAX], row_of[GROUP_MAX];
    for (int64_t u = 0; u < count; u++) {
        int64_t t = first >= 0 ? first + u : u;
        int64_t ci = t % d->c, kx = t / d->c % d->kw, ky = t / d->c / d->kw;
        acc_at[u] = t * d->o;
        row_at[u] = first >= 0 ? kx * d->c + ci : u;
        row_of[u] = first >= 0 ? ky : 0;
    }
    rfi_sb_printf(sb, "%s{\n", in);
    for (int64_t u = 0; u < count; u++)
        rfi_sb_printf(sb, "%s%s a%lld;\n%smemcpy(&a%lld, %s + %lld, sizeof a%lld);\n", in1,
                      f->vec, (long long)u, in1, (long long)u, acc, (long long)acc_at[u],
                      (long long)u);
    rfi_sb_printf(sb,
                  "%sfor (int64_t j = 0; j < %lld; j++) {\n"
                  "%s%s dv;\n"
                  "%smemcpy(&dv, %s + j * %lld, sizeof dv);\n",
                  in1, (long long)d->ow, in2, f->vec, in2, base, (long long)step);
    long long column = (long long)(d->stride[1] * d->c);
    for (int64_t u = 0; u < count; u++)
        if (u == 0 || row_of[u] != row_of[u - 1]) {
            if (first >= 0)
                rfi_sb_printf(sb, "%sconst float *restrict p%lld = rowp[%lld] + j * %lld;\n",
                              in2, (long long)row_of[u], (long long)row_of[u], column);
            else
                rfi_sb_printf(sb, "%sconst float *restrict p0 = xk + j * %lld;\n", in2, column);
        }
    for (int64_t u = 0; u < count; u++)
        rfi_sb_printf(sb, "%sa%lld += p%lld[%lld] * dv;\n", in2, (long long)u,
                      (long long)row_of[u], (long long)row_at[u]);
    rfi_sb_printf(sb, "%s}\n", in1);
    for (int64_t u = 0; u < count; u++)
        rfi_sb_printf(sb, "%smemcpy(%s + %lld, &a%lld, sizeof a%lld);\n", in1, acc,
                      (long long)acc_at[u], (long long)u, (long long)u);
    rfi_sb_printf(sb, "%s}\n", in);
}

/* The groups of one row: with at least GROUP_MIN_LOOPED input channels
 * (and at most a group's worth), one group of c points in a loop over
 * (ky, kx); else every point spelled out, in groups of GROUP_MAX (less
 * code for many channels, enough independent sums for few). */
static void gradient_groups(rfi_strbuf *sb, const conv_form *f, const char *base, int64_t step,
                            int depth)
{
    const rfi_kir_conv *d = f->d;
    const char *in = indent(depth), *in1 = indent(depth + 1);
    if (d->c >= GROUP_MIN_LOOPED && d->c <= GROUP_MAX) {
        rfi_sb_printf(sb,
                      "%sfor (int64_t k = 0; k < %lld; k++) {\n"
                      "%sfloat *restrict ak = acc + k * %lld;\n"
                      "%sconst float *restrict xk = rowp[k / %lld] + k %% %lld * %lld;\n",
                      in, (long long)(d->kh * d->kw), in1, (long long)(d->c * d->o), in1,
                      (long long)d->kw, (long long)d->kw, (long long)d->c);
        gradient_group(sb, f, -1, d->c, base, step, depth + 1);
        rfi_sb_printf(sb, "%s}\n", in);
        return;
    }
    int64_t points = d->c * d->kh * d->kw;
    for (int64_t t0 = 0; t0 < points; t0 += GROUP_MAX)
        gradient_group(sb, f, t0, t0 + GROUP_MAX < points ? GROUP_MAX : points - t0, base, step,
                       depth);
}

static void weight_grad_kernel(const conv_form *f, const char *kname, rfi_strbuf *def)
{
    const rfi_kir_conv *d = f->d;
    long long C = (long long)d->c, O = (long long)d->o, KH = (long long)d->kh,
              KW = (long long)d->kw;
    long long table = C * KH * KW * O, rows = (long long)(d->n * d->oh);
    long long chunks = (long long)f->chunks;
    rfi_sb_printf(def,
                  "RF_KERNEL RF_CONV_LOOP%s void %s(void *ctx, int64_t lo, int64_t hi)\n{\n"
                  "    const struct %s_ctx *c = ctx;\n"
                  "    const float *restrict x = c->x;\n",
                  lanes16(f), kname, kname);
    rows_table(def, f);
    if (d->spread || d->bf16 ||
        (d->w_layout != RFI_LAYOUT_NHWC && !rfi_layout_blocked(d->w_layout)))
        rfi_sb_printf(def, "    float drow[%lld]; /* [ow][o] */\n", (long long)(d->ow * O));
    rfi_sb_printf(def,
                  "    for (int64_t q = lo; q < hi; q++) {\n"
                  "        float *restrict part = c->part + q * %lld;\n"
                  "        memset(part, 0, sizeof(float) * %lld);\n"
                  "        for (int64_t r = q * %lld / %lld; r < (q + 1) * %lld / %lld; r++) {\n"
                  "            const int64_t n = r / %lld, i = r %% %lld;\n",
                  table, table, rows, chunks, rows, chunks, (long long)d->oh, (long long)d->oh);
    fill_rows(def, f, 3, false);
    char base[200];
    int64_t step;
    gradient_row(def, f, base, sizeof base, &step);
    if (!d->spread) /* a spread row reads 1/win of a row of the (small) cotangent */
        prefetch_gradient_row(def, f);
    rfi_sb_printf(def,
                  "            for (int64_t ob = 0; ob < %lld; ob++) { /* vectors of o */\n"
                  "                float *restrict acc = part + ob * %lld;\n",
                  O / (long long)f->lanes, (long long)f->lanes);
    gradient_groups(def, f, base, step, 4);
    rfi_sb_printf(def, "            }\n        }\n    }\n}\n\n");
    rfi_sb_printf(def,
                  "RF_KERNEL void %s_combine(const struct %s_ctx *c)\n{\n"
                  "    for (int64_t ci = 0; ci < %lld; ci++)\n"
                  "        for (int64_t o = 0; o < %lld; o++)\n"
                  "            for (int64_t ky = 0; ky < %lld; ky++)\n"
                  "                for (int64_t kx = 0; kx < %lld; kx++) {\n"
                  "                    const int64_t t =\n"
                  "                        ((ky * %lld + kx) * %lld + ci) * %lld + o;\n"
                  "                    float v = 0.0f;\n"
                  "                    for (int64_t q = 0; q < %lld; q++)\n"
                  "                        v += c->part[q * %lld + t];\n"
                  "                    c->y[((ci * %lld + o) * %lld + ky) * %lld + kx] = v;\n"
                  "                }\n}\n\n",
                  kname, kname, C, O, KH, KW, KW, C, O, chunks, table, O, KH, KW);
}

/* ---- The step ------------------------------------------------------------------------- */

void rfi_render_conv_kernel(const rfi_kir_step *st, const char *pool_name, rfi_strbuf *decl,
                            rfi_strbuf *def)
{
    conv_form f = form_of(&st->conv);
    char kname[32];
    kernel_name(st->step, kname, sizeof kname);
    comment(decl, st, &f);
    ctx_struct(decl, &st->conv, kname);
    rfi_sb_printf(decl, "RF_KERNEL void %s(void *ctx, int64_t lo, int64_t hi);\n", kname);
    if (st->conv.kind == RFI_KIR_CONV_WEIGHT_GRAD) {
        rfi_sb_printf(decl, "RF_KERNEL void %s_combine(const struct %s_ctx *c);\n", kname,
                      kname);
        weight_grad_kernel(&f, kname, def);
    } else {
        if (st->conv.pool_kernel >= 0) /* defined with its step, maybe after this one */
            rfi_sb_printf(def, "RF_KERNEL void %s(void *ctx, int64_t lo, int64_t hi%s);\n\n",
                          pool_name, st->conv.tiled ? ", const float *tile" : "");
        forward_kernel(&f, kname, pool_name, def);
    }
    rfi_sb_printf(decl, "\n");
}

bool rfi_render_conv_same(const rfi_kir_conv *a, const rfi_kir_conv *b)
{
    if (a->pool_kernel >= 0 || b->pool_kernel >= 0) /* each runs its own pool's kernel */
        return false;
    if (a->kind != b->kind || a->n != b->n || a->c != b->c || a->h != b->h || a->w != b->w ||
        a->o != b->o || a->lanes != b->lanes || a->kh != b->kh || a->kw != b->kw ||
        a->oh != b->oh || a->ow != b->ow ||
        a->x_layout != b->x_layout || a->w_layout != b->w_layout ||
        a->y_layout != b->y_layout || a->n_epi != b->n_epi || a->spread != b->spread ||
        a->bf16 != b->bf16 ||
        (a->spread && (a->win[0] != b->win[0] || a->win[1] != b->win[1])))
        return false;
    for (int s = 0; s < 2; s++)
        if (a->stride[s] != b->stride[s] || a->pad[s] != b->pad[s] ||
            a->dilation[s] != b->dilation[s])
            return false;
    for (int e = 0; e < a->n_epi; e++)
        if (a->epi[e] != b->epi[e])
            return false;
    return true;
}

void rfi_render_conv_call(const rfi_kir_step *st, int kernel_step, const char *pool_ctx,
                          rfi_strbuf *sb)
{
    const rfi_kir_conv *d = &st->conv;
    conv_form f = form_of(d);
    bool grad = d->kind == RFI_KIR_CONV_WEIGHT_GRAD;
    char kname[32];
    kernel_name(kernel_step, kname, sizeof kname);
    rfi_sb_printf(sb, "    {\n");
    if (grad)
        rfi_sb_printf(sb, "        float part[%lld];\n",
                      (long long)(f.chunks * d->c * d->kh * d->kw * d->o));
    rfi_sb_printf(sb, "        struct %s_ctx c = {", kname);
    rfi_render_c_pointer(sb, "float", d->x_buffer, d->x_offset);
    rfi_sb_printf(sb, ", ");
    rfi_render_c_pointer(sb, "float", d->w_buffer, d->w_offset);
    rfi_sb_printf(sb, ", ");
    if (d->tiled)
        rfi_sb_printf(sb, "NULL /* y: the tile */");
    else
        rfi_render_c_pointer(sb, "float", d->y_buffer, d->y_offset);
    for (int e = 0; e < d->n_epi; e++)
        if (d->epi_buffer[e] >= 0) {
            rfi_sb_printf(sb, ", ");
            rfi_render_c_pointer(sb, "float", d->epi_buffer[e], d->epi_offset[e]);
        }
    rfi_sb_printf(sb, grad ? ", part" : "");
    if (d->spread) {
        rfi_sb_printf(sb, ", ");
        rfi_render_c_pointer(sb, "int32_t", d->codes_buffer, d->codes_offset);
    }
    if (d->pool_kernel >= 0)
        rfi_sb_printf(sb, ", &%s", pool_ctx);
    rfi_sb_printf(sb, "};\n");
    if (grad) {
        rfi_sb_printf(sb, "        s->parallel_for(s->rt, %lld, 1, %s, &c);\n"
                          "        %s_combine(&c);\n    }\n",
                      (long long)f.chunks, kname, kname);
        return;
    }
    int64_t per_range_row = d->pool_kernel >= 0 ? d->pool_rows : 1; /* output rows */
    int64_t rows = d->n * d->oh / per_range_row;
    int64_t row_macs = d->ow * d->o * d->c * d->kh * d->kw * per_range_row;
    int64_t grain = (CHUNK_MACS + row_macs - 1) / (row_macs > 0 ? row_macs : 1);
    if (rows > grain)
        rfi_sb_printf(sb, "        s->parallel_for(s->rt, %lld, %lld, %s, &c);\n",
                      (long long)rows, (long long)grain, kname);
    else
        rfi_sb_printf(sb, "        %s(&c, 0, %lld);\n", kname, (long long)rows);
    rfi_sb_printf(sb, "    }\n");
}
