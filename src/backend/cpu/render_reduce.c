/* render_reduce.c: the loop schedules of REDUCE kernels, as C, for
 * render_c.c (which renders everything else: expressions, loop kernels, the
 * entry point; render_c.h holds what the two share).
 *
 * The kernel IR fixes what a REDUCE kernel folds and, per kept point, in which
 * order; the loop order and the split across threads are chosen here:
 *   plain         the kept loops outside (the outermost split across
 *                 threads), the reduced loops inside, the innermost
 *                 vectorised for float sums;
 *   interchanged  per block of the last kept axis, accumulators in an array,
 *                 the reduced loops outside and the kept axis innermost,
 *                 vectorised: reductions over leading axes (a bias gradient,
 *                 whose reduced loops walk memory by rows) and windows up to
 *                 64 points (pooling; kir_lower_reduce.c unrolls those up to 16),
 *                 whose reduced loops are too short to vectorise;
 *   tiled         an interchanged one that sums products of a row by a
 *                 value per output feature: in register tiles
 *                 (render_tiles.c);
 *   split         the outermost reduced loop cut into a fixed number of
 *                 contiguous chunks, each folded from the identity into its
 *                 own partial accumulators of every kept point (the chunks run
 *                 across threads), then each point's partials folded in chunk
 *                 order: reductions whose outermost reduced loop is also the
 *                 outermost in memory (BatchNorm statistics over N, H and W;
 *                 sums to a scalar), which the plain form splits into strided
 *                 runs per thread (8-20 GB/s measured on [128,8,28,28]) or
 *                 runs on one thread. Each chunk streams one contiguous slab.
 * Every form folds each point's values in the same order, but the split one
 * groups them: that is exact for max and min as folded here (the first NaN,
 * else the last of the equal extremes: associative), for and, or and integer
 * sums and products (wrapping), and reassociates float sums only as their
 * vectorised loops already do, but that a split sum of f32 values adds blocks
 * of PRESUM of them in f32 before its double fold (below); float products
 * (whose over- and underflow depend on the grouping) are never split. The
 * chunk count does not depend on the number of threads, so neither do the
 * results. A kernel with sibling folds (kir.h) runs plain or split, each fold
 * with its own accumulator (acc, acc1, ...) or its own row of partials per
 * chunk (accs, accs1, ...).
 *
 * A plain float sum over one contiguous reduced loop (a matrix-vector or
 * a matrix product) takes four outputs per iteration, one accumulator each
 * ("Unrolled reductions"). Deliberately nothing here decides which steps are reductions
 * or what they compute (kir_lower_reduce.c does); only their loops. */
#include <stdio.h>
#include <string.h>

#include "render_c.h"

/* Kept points per accumulator block of an interchanged reduction. */
#define ROW_BLOCK 64
/* A reduction over at most this many points whose loads step along the last
 * kept axis by at most WINDOW_STRIDE elements is a window: interchanged. */
#define WINDOW_POINTS 64
#define WINDOW_STRIDE 4
/* Or more points, whose innermost reduced loop has at most this many and
 * whose last kept axis at least 8 points (a 3x3 convolution computed as
 * loops: passes/pad_convs.c): interchanged as well. */
#define SHORT_ROW 4
/* Split reductions: chunks, and at most this many partial accumulators (they
 * live on the entry point's stack: 16 KB of doubles). */
#define SPLIT_CHUNKS 16
#define SPLIT_ACCS 2048
/* Sibling folds have no interchanged form, and plain they stride through
 * memory once per kept point: they split from this many points on, below
 * the parallel size (LayerNorm's scale and shift gradients over [128,256]:
 * 14-17 us split against 55-67 plain). */
#define SIBLING_SPLIT_MIN 4096

static int64_t loop_extent(const rfi_kir_kernel *k, int var)
{
    return var < k->rank ? k->dims[var] : k->red_dims[var - k->rank];
}

/* How a REDUCE kernel's live loads walk memory along its last kept axis and
 * its innermost reduced loop. */
typedef struct load_walk {
    bool kept_unit;      /* one is contiguous along the kept axis */
    bool inner_unit;     /* one is contiguous along the reduced loop */
    bool kept_strided;   /* every one steps along the kept axis by 0..WINDOW_STRIDE */
    bool column;         /* one is contiguous along the kept axis and strides along
                            the reduced loop */
    bool rows_invariant; /* those contiguous along the reduced loop do not vary with
                            the kept axis */
} load_walk;

static load_walk walk_loads(const rfi_kir_kernel *k, const bool *live)
{
    int kept = k->rank - 1, inner = k->rank + k->red_rank - 1;
    load_walk w = {false, false, true, false, true};
    for (int id = 0; id < k->n_ins; id++) {
        const rfi_kir_ins *x = &k->ins[id];
        if (!live[id] || x->op != RFI_KIR_LOAD)
            continue;
        int64_t ci, ck;
        bool affine_i = rfi_kir_var_coef(k, x->a, inner, &ci);
        bool affine_k = rfi_kir_var_coef(k, x->a, kept, &ck);
        w.inner_unit = w.inner_unit || (affine_i && ci == 1);
        w.kept_unit = w.kept_unit || (affine_k && ck == 1);
        w.kept_strided = w.kept_strided && affine_k && ck >= 0 && ck <= WINDOW_STRIDE;
        w.column = w.column || (affine_k && ck == 1 && affine_i && (ci < 0 ? -ci : ci) > 1);
        if (affine_i && ci == 1 && !(affine_k && ck == 0))
            w.rows_invariant = false;
    }
    return w;
}

/* Whether a REDUCE kernel runs interchanged: its loads are contiguous along
 * the last kept axis but none along the innermost reduced one, or its
 * reduction is a small window and every load steps along the last kept axis
 * by a small constant stride (vectorised loads with a shuffle). */
static bool interchange_reduction(const rfi_kir_kernel *k, const bool *live)
{
    if (!k->is_reduce || k->rank < 1 || k->red_rank < 1)
        return false;
    int kept = k->rank - 1;
    load_walk w = walk_loads(k, live);
    if (!w.inner_unit)
        return w.kept_unit;
    /* a window, or a convolution's terms whose innermost loop (a kernel row) is too short
     * to vectorise: then along the result's rows */
    return w.kept_strided && k->dims[kept] >= 4 &&
           (rfi_numel(k->red_dims, k->red_rank) <= WINDOW_POINTS ||
            (k->dims[kept] >= 8 && k->red_dims[k->red_rank - 1] <= SHORT_ROW));
}

/* Whether a REDUCE kernel reads a column: a load contiguous along the last
 * kept axis strides along the innermost reduced loop, and the loads
 * contiguous along that loop do not vary with the kept axis (a product x w
 * with w stored [in, out]). Run plain, each point gathers the column a row
 * apart per term (an f64 [64,784] x [784,256] took 88 ms); interchanged and
 * tiled (render_tiles.c), each term loads a vector of w's row and one x per
 * row of the tile (0.59 ms). */
static bool reads_column(const rfi_kir_kernel *k, const bool *live)
{
    if (!k->is_reduce || k->rank < 1 || k->red_rank < 1)
        return false;
    load_walk w = walk_loads(k, live);
    return w.column && w.rows_invariant;
}

/* Whether every load that depends on loop `var` walks memory with it
 * outermost: its stride spans another loop's whole extent. */
static bool outermost_in_memory(const rfi_kir_kernel *k, const bool *live, int var)
{
    bool any = false;
    for (int id = 0; id < k->n_ins; id++) {
        const rfi_kir_ins *x = &k->ins[id];
        int64_t stride, other;
        if (!live[id] || x->op != RFI_KIR_LOAD)
            continue;
        if (!rfi_kir_var_coef(k, x->a, var, &stride) || stride < 0)
            return false;
        if (stride == 0)
            continue;
        any = true;
        for (int v = 0; v < k->rank + k->red_rank; v++)
            if (v != var && (!rfi_kir_var_coef(k, x->a, v, &other) ||
                             (other < 0 ? -other : other) * loop_extent(k, v) > stride))
                return false;
    }
    return any;
}

/* The chunks a split reduction cuts its outermost reduced loop into, or 0
 * when it is not split (see above). */
static int64_t split_chunks(const rfi_kir_kernel *k, const bool *live)
{
    if (!k->is_reduce || k->red_rank < 1 || k->red_dims[0] < 2 ||
        (k->red_kind == RF_REDUCE_PROD && rfi_dtype_is_float(k->acc_dtype)))
        return 0;
    int64_t kept = rfi_numel(k->dims, k->rank);
    int64_t min_points = k->n_folds > 1 ? SIBLING_SPLIT_MIN : RFI_PARALLEL_MIN;
    if (kept * rfi_numel(k->red_dims, k->red_rank) <= min_points ||
        !outermost_in_memory(k, live, k->rank))
        return 0;
    int64_t chunks = SPLIT_ACCS / (kept * k->n_folds);
    if (chunks > SPLIT_CHUNKS)
        chunks = SPLIT_CHUNKS;
    if (chunks > k->red_dims[0])
        chunks = k->red_dims[0];
    return chunks >= 2 ? chunks : 0;
}

rfi_schedule rfi_render_schedule(const rfi_kir_kernel *k, const bool *live)
{
    rfi_schedule sc = {RFI_SCHED_PLAIN, 0, 0};
    if ((sc.chunks = split_chunks(k, live)) > 0) {
        sc.form = RFI_SCHED_SPLIT;
        sc.kept = rfi_numel(k->dims, k->rank);
    } else if (k->n_folds == 1 && interchange_reduction(k, live)) {
        sc.form = rfi_render_tiles(k) ? RFI_SCHED_TILED : RFI_SCHED_INTERCHANGED;
    } else if (k->n_folds == 1 && reads_column(k, live) && rfi_render_tiles(k)) {
        sc.form = RFI_SCHED_TILED;
    }
    return sc;
}

/* ---- Folds ------------------------------------------------------------------------ */
/* The accumulator update of a REDUCE kernel with the interpreter's arithmetic:
 * the lvalue `acc` folds the C expression `value`. */
static void fold_text(rfi_render *R, int depth, const char *acc, const char *value)
{
    const rfi_kir_kernel *k = R->k;
    bool f = rfi_dtype_is_float(k->acc_dtype);
    const char *fmt = "@ = $;\n"; /* @: the accumulator, $: the value */
    switch (k->red_kind) {
    case RF_REDUCE_SUM:
        fmt = f ? "@ += $;\n" : "@ = (int64_t)((uint64_t)@ + (uint64_t)$);\n";
        break;
    case RF_REDUCE_PROD:
        fmt = f ? "@ *= $;\n" : "@ = (int64_t)((uint64_t)@ * (uint64_t)$);\n";
        break;
    case RF_REDUCE_MAX:
        fmt = !f ? "@ = $ > @ ? $ : @;\n"
              : k->acc_dtype == RF_F64 ? "@ = rf_max_f64(@, $);\n" : "@ = rf_max_f32(@, $);\n";
        break;
    case RF_REDUCE_MIN:
        fmt = !f ? "@ = $ < @ ? $ : @;\n"
              : k->acc_dtype == RF_F64 ? "@ = rf_min_f64(@, $);\n" : "@ = rf_min_f32(@, $);\n";
        break;
    case RF_REDUCE_AND: fmt = f ? "@ = (double)((@ != 0) && ($ != 0));\n" : "@ &= $;\n"; break;
    case RF_REDUCE_OR: fmt = f ? "@ = (double)((@ != 0) || ($ != 0));\n" : "@ |= $;\n"; break;
    default: break;
    }
    if (f && (k->red_kind == RF_REDUCE_MAX || k->red_kind == RF_REDUCE_MIN))
        R->need |= k->acc_dtype == RF_F64 ? RFI_NEED_MAXMIN_F64 : RFI_NEED_MAXMIN_F32;
    rfi_render_indent(R, depth);
    for (const char *c = fmt; *c; c++) {
        if (*c == '@')
            put(R->sb, acc);
        else if (*c == '$')
            put(R->sb, value);
        else
            put_char(R->sb, *c);
    }
}

/* The fold of fold j's value into the lvalue `acc`, where the guard holds. */
static void fold_value_into(rfi_render *R, int depth, const char *acc, int j)
{
    const rfi_kir_kernel *k = R->k;
    if (k->red_guard >= 0) {
        rfi_render_indent(R, depth);
        put(R->sb, "if (");
        rfi_render_operand(R, k->red_guard);
        put(R->sb, ")\n");
        depth++;
    }
    char value[64];
    rfi_render_operand_text(R, rfi_kir_fold_value(k, j), value, sizeof value);
    fold_text(R, depth, acc, value);
}

/* The fold of the kernel's (one) value into the lvalue `acc`. */
static void fold_into(rfi_render *R, int depth, const char *acc)
{
    fold_value_into(R, depth, acc, 0);
}

/* Every fold into its accumulator (acc, acc1, ...). */
static void fold(rfi_render *R, int depth)
{
    for (int j = 0; j < R->k->n_folds; j++) {
        char acc[32];
        rfi_render_acc_name(acc, j);
        fold_value_into(R, depth, acc, j);
    }
}

/* The reduction's identity as a literal of the accumulator type. */
static void identity_literal(rfi_render *R)
{
    const rfi_kir_kernel *k = R->k;
    if (rfi_dtype_is_float(k->acc_dtype))
        rfi_render_float_literal(R->sb, k->red_identity_f, k->acc_dtype);
    else
        rfi_render_int_literal(R->sb, k->red_identity_i, RF_I64);
}

/* Declares every fold's accumulator at its identity. */
static void declare_accs(rfi_render *R, int depth)
{
    for (int j = 0; j < R->k->n_folds; j++) {
        char acc[32];
        rfi_render_acc_name(acc, j);
        rfi_render_indent(R, depth);
        putf(R->sb, "%s %s = ", rfi_render_ctype(R->k->acc_dtype), acc);
        identity_literal(R);
        put(R->sb, ";\n");
    }
}

/* ---- Loops ------------------------------------------------------------------------ */
static bool simd_sum(const rfi_kir_kernel *k)
{
    return k->red_kind == RF_REDUCE_SUM && rfi_dtype_is_float(k->acc_dtype);
}

/* Opens r0 of a split reduction over chunk q's range at depth. */
static void open_chunk_loop(rfi_render *R, int depth, const rfi_schedule *sc)
{
    long long n = (long long)R->k->red_dims[0], chunks = (long long)sc->chunks;
    rfi_render_indent(R, depth);
    if (n % chunks == 0)
        putf(R->sb, "for (int64_t r0 = q * %lld; r0 < q * %lld + %lld; r0++) {\n", n / chunks,
                      n / chunks, n / chunks);
    else
        putf(R->sb, "for (int64_t r0 = q * %lld / %lld; r0 < (q + 1) * %lld / %lld; r0++) {\n",
                      n, chunks, n, chunks);
}

/* Opens the reduced loops r<first>.. at depth, the innermost vectorised for
 * float sums; r0 of a split reduction runs over chunk q only. */
static void open_reduced_loops_to(rfi_render *R, int first, int end, int depth,
                                  const rfi_schedule *sc)
{
    const rfi_kir_kernel *k = R->k;
    for (int d = first; d < end; d++) {
        int at = depth + d - first;
        if (d == k->red_rank - 1 && simd_sum(k)) {
            rfi_render_indent(R, at);
            put(R->sb, "#pragma omp simd reduction(+:acc");
            for (int j = 1; j < k->n_folds; j++)
                putf(R->sb, ", acc%d", j);
            put(R->sb, ")\n");
        }
        if (d == 0 && sc->form == RFI_SCHED_SPLIT) {
            open_chunk_loop(R, at, sc);
            continue;
        }
        rfi_render_indent(R, at);
        putf(R->sb, "for (int64_t r%d = 0; r%d < %lld; r%d++) {\n", d, d,
                      (long long)k->red_dims[d], d);
    }
}

static void open_reduced_loops(rfi_render *R, int first, int depth, const rfi_schedule *sc)
{
    open_reduced_loops_to(R, first, R->k->red_rank, depth, sc);
}

/* Opens the reduced loops from r<first> at depth and renders the statements
 * of each reduced point inside them, those that do not vary along the
 * innermost loop before it: gcc sinks a load that one arm of a select alone
 * reads into that arm, and a conditional load at a fixed address keeps the
 * loop scalar (a GroupNorm's gradient sums, select(y > 0, g, 0) with g one
 * value per group, took 1.4 ms over [32,64,16,16]). The split schedule's
 * chunk loop (r0) hoists nothing. */
static void open_reduced_loops_with_statements(rfi_render *R, const bool *live, int first,
                                               int depth, const rfi_schedule *sc)
{
    const rfi_kir_kernel *k = R->k;
    int last = k->red_rank - 1;
    bool *inner = last >= first && !(last == 0 && sc->form == RFI_SCHED_SPLIT)
                      ? rfi_calloc((size_t)k->n_ins, sizeof *inner)
                      : NULL;
    if (!inner) {
        open_reduced_loops(R, first, depth, sc);
        rfi_render_statements(R, live, 2, depth + last - first + 1);
        return;
    }
    rfi_render_output_dependent(k, k->rank + last, inner);
    open_reduced_loops_to(R, first, last, depth, sc);
    rfi_render_statements_where(R, live, 2, depth + last - first, inner, false);
    open_reduced_loops_to(R, last, last + 1, depth + last - first, sc);
    rfi_render_statements_where(R, live, 2, depth + last - first + 1, inner, true);
    rfi_free(inner);
}

/* Opens the reduced loops r1 .. r<end - 1> at depth, plain (a split body's
 * loops inside the chunk loop r0). */
static void open_inner_reduced_loops(rfi_render *R, int end, int depth)
{
    for (int d = 1; d < end; d++) {
        rfi_render_indent(R, depth + d - 1);
        putf(R->sb, "for (int64_t r%d = 0; r%d < %lld; r%d++) {\n", d, d,
                      (long long)R->k->red_dims[d], d);
    }
}

static bool plain_bf16_dot(rfi_render *R, const bool *live, int depth);

/* ---- Lane extremes ------------------------------------------------------------------- *
 * A float max or min folds each point into the accumulator through
 * rf_max/rf_min (the first NaN, else the last of the equal extremes), one
 * dependent compare and select per point that gcc leaves scalar: a
 * softmax's row max over [32, 4, 64, 64] took 709 us where the row sum took
 * 43. Only a NaN or a zero extreme depends on which point the fold keeps:
 * equal values other than zeros have the same bits. So over one reduced loop
 * the plain schedule folds the first multiple of LANE_FOLDS points into
 * LANE_FOLDS lanes (point r into lane r % LANE_FOLDS, vectorised), each a
 * plain compare and select that also notes a NaN, and takes the lanes'
 * extreme unless a point was a NaN or that extreme is a zero: then it folds
 * those points again one by one, as before. The rest of the points fold into
 * it one by one. */
#define LANE_FOLDS 8
#define LANE_MIN_POINTS 32

static bool lane_extremes(const rfi_kir_kernel *k)
{
    return (k->red_kind == RF_REDUCE_MAX || k->red_kind == RF_REDUCE_MIN) &&
           rfi_dtype_is_float(k->acc_dtype) && k->n_folds == 1 && k->red_rank == 1 &&
           k->red_guard < 0 && k->red_dims[0] >= LANE_MIN_POINTS;
}

/* A line of C at depth. */
static void line(rfi_render *R, int depth, const char *text)
{
    rfi_render_indent(R, depth);
    put(R->sb, text);
    put(R->sb, "\n");
}

/* The fold of the first n - n % LANE_FOLDS points into acc (declared). */
static void lane_extreme_loops(rfi_render *R, const bool *live, int depth)
{
    const rfi_kir_kernel *k = R->k;
    const char *beats = k->red_kind == RF_REDUCE_MAX ? ">" : "<";
    int64_t whole = k->red_dims[0] - k->red_dims[0] % LANE_FOLDS;
    char value[64];
    rfi_render_operand_text(R, rfi_kir_fold_value(k, 0), value, sizeof value);
    line(R, depth, "{");
    rfi_render_indent(R, depth + 1);
    putf(R->sb, "%s lane_acc[%d];\n", rfi_render_ctype(k->acc_dtype), LANE_FOLDS);
    rfi_render_indent(R, depth + 1);
    putf(R->sb, "int lane_nan[%d];\n", LANE_FOLDS);
    rfi_render_indent(R, depth + 1);
    putf(R->sb, "for (int l = 0; l < %d; l++) {\n", LANE_FOLDS);
    line(R, depth + 2, "lane_acc[l] = acc;");
    line(R, depth + 2, "lane_nan[l] = 0;");
    line(R, depth + 1, "}");
    rfi_render_indent(R, depth + 1);
    putf(R->sb, "for (int64_t r0_lanes = 0; r0_lanes < %lld; r0_lanes += %d) {\n",
         (long long)whole, LANE_FOLDS);
    line(R, depth + 2, "#pragma omp simd");
    rfi_render_indent(R, depth + 2);
    putf(R->sb, "for (int64_t l = 0; l < %d; l++) {\n", LANE_FOLDS);
    line(R, depth + 3, "const int64_t r0 = r0_lanes + l;");
    rfi_render_statements(R, live, 2, depth + 3);
    rfi_render_indent(R, depth + 3);
    putf(R->sb, "lane_nan[l] |= %s != %s;\n", value, value);
    rfi_render_indent(R, depth + 3);
    putf(R->sb, "lane_acc[l] = %s %s lane_acc[l] ? %s : lane_acc[l];\n", value, beats, value);
    line(R, depth + 2, "}");
    line(R, depth + 1, "}");
    line(R, depth + 1, "int any_nan = lane_nan[0];");
    rfi_render_indent(R, depth + 1);
    putf(R->sb, "%s extreme = lane_acc[0];\n", rfi_render_ctype(k->acc_dtype));
    rfi_render_indent(R, depth + 1);
    putf(R->sb, "for (int l = 1; l < %d; l++) {\n", LANE_FOLDS);
    line(R, depth + 2, "any_nan |= lane_nan[l];");
    rfi_render_indent(R, depth + 2);
    putf(R->sb, "extreme = lane_acc[l] %s extreme ? lane_acc[l] : extreme;\n", beats);
    line(R, depth + 1, "}");
    line(R, depth + 1, "if (!any_nan && extreme != 0) {");
    line(R, depth + 2, "acc = extreme;");
    line(R, depth + 1, "} else {");
    rfi_render_indent(R, depth + 2);
    putf(R->sb, "for (int64_t r0 = 0; r0 < %lld; r0++) {\n", (long long)whole);
    rfi_render_statements(R, live, 2, depth + 3);
    fold_into(R, depth + 3, "acc");
    line(R, depth + 2, "}");
    line(R, depth + 1, "}");
    line(R, depth, "}");
}

/* ---- Row sums ----------------------------------------------------------------------- *
 * A float sum over several reduced loops whose innermost is short (a
 * convolution's rows of 16, computed as loops: passes/pad_convs.c) would
 * close its vectorised loop into the accumulator once per row, a
 * horizontal sum and a dependent add each. Its plain schedule keeps one
 * partial sum per point of the innermost loop across all the outer reduced
 * loops instead, and adds the partials into the accumulator in order at the
 * end: the terms grouped by column, as a vectorised loop groups them by
 * lane. The weight gradient of a 7x7 depthwise convolution (64 channels,
 * 64 16x16 images) took 15.8 ms the other way. */
#define ROW_SUM_MAX 64

static bool row_sums(const rfi_kir_kernel *k)
{
    int64_t n = k->red_rank > 0 ? k->red_dims[k->red_rank - 1] : 0;
    return simd_sum(k) && k->n_folds == 1 && k->red_rank >= 2 && n >= 4 && n <= ROW_SUM_MAX;
}

/* The reduced loops of a row_sums kernel folding into column partials, then
 * into acc (declared). */
static void row_sum_loops(rfi_render *R, const bool *live, int depth)
{
    const rfi_kir_kernel *k = R->k;
    int last = k->red_rank - 1;
    long long n = (long long)k->red_dims[last];
    const char *t = rfi_render_ctype(k->acc_dtype);
    rfi_render_indent(R, depth);
    putf(R->sb, "%s column_sums[%lld];\n", t, n);
    rfi_render_indent(R, depth);
    putf(R->sb, "for (int64_t col = 0; col < %lld; col++)\n", n);
    rfi_render_indent(R, depth + 1);
    put(R->sb, "column_sums[col] = ");
    identity_literal(R);
    put(R->sb, ";\n");
    for (int d = 0; d < last; d++) {
        rfi_render_indent(R, depth + d);
        putf(R->sb, "for (int64_t r%d = 0; r%d < %lld; r%d++) {\n", d, d,
             (long long)k->red_dims[d], d);
    }
    int in = depth + last;
    rfi_render_indent(R, in);
    put(R->sb, "#pragma omp simd\n");
    rfi_render_indent(R, in);
    putf(R->sb, "for (int64_t r%d = 0; r%d < %lld; r%d++) {\n", last, last, n, last);
    rfi_render_statements(R, live, 2, in + 1);
    char column[32];
    snprintf(column, sizeof column, "column_sums[r%d]", last);
    fold_into(R, in + 1, column);
    rfi_render_indent(R, in);
    put(R->sb, "}\n");
    rfi_render_close_loops(R, depth, last);
    rfi_render_indent(R, depth);
    putf(R->sb, "for (int64_t col = 0; col < %lld; col++)\n", n);
    fold_text(R, depth + 1, "acc", "column_sums[col]");
}

void rfi_render_reduction_loops(rfi_render *R, const bool *live, int depth)
{
    const rfi_kir_kernel *k = R->k;
    rfi_schedule plain = {RFI_SCHED_PLAIN, 0, 0};
    declare_accs(R, depth);
    if (row_sums(k)) { /* never a bf16 dot, whose one reduced loop is contiguous */
        row_sum_loops(R, live, depth);
        rfi_render_statements(R, live, 3, depth);
        return;
    }
    if (lane_extremes(k)) {
        lane_extreme_loops(R, live, depth);
        int64_t n = k->red_dims[0];
        rfi_render_indent(R, depth);
        putf(R->sb, "for (int64_t r0 = %lld; r0 < %lld; r0++) {\n",
             (long long)(n - n % LANE_FOLDS), (long long)n);
        rfi_render_statements(R, live, 2, depth + k->red_rank);
    } else if (!plain_bf16_dot(R, live, depth)) {
        open_reduced_loops_with_statements(R, live, 0, depth, &plain);
    } else {
        rfi_render_statements(R, live, 2, depth + k->red_rank);
    }
    fold(R, depth + k->red_rank);
    rfi_render_close_loops(R, depth, k->red_rank);
    rfi_render_statements(R, live, 3, depth);
}

/* Opens the kept loops over their whole extents at depth (the innermost
 * vectorised when simd). */
static void open_kept_loops(rfi_render *R, int depth, bool simd)
{
    const rfi_kir_kernel *k = R->k;
    for (int d = 0; d < k->rank; d++) {
        if (simd && d == k->rank - 1) {
            rfi_render_indent(R, depth + d);
            put(R->sb, "#pragma omp simd\n");
        }
        rfi_render_indent(R, depth + d);
        putf(R->sb, "for (int64_t i%d = 0; i%d < %lld; i%d++) {\n", d, d,
                      (long long)k->dims[d], d);
    }
}

/* The kept point's row-major index over the kept loops, as C text. */
static void kept_index(const rfi_kir_kernel *k, char *buf, size_t n)
{
    size_t len = 0;
    snprintf(buf, n, "0");
    for (int d = 0; d < k->rank && len < n; d++) {
        int64_t stride = rfi_numel(k->dims + d + 1, k->rank - d - 1);
        int w = stride == 1 ? snprintf(buf + len, n - len, "%si%d", d ? " + " : "", d)
                            : snprintf(buf + len, n - len, "%si%d * %lld", d ? " + " : "", d,
                                       (long long)stride);
        len += w > 0 ? (size_t)w : 0;
    }
}

/* ---- Interchanged reductions ------------------------------------------------------------ */
/* for (i<kept> = lo; i<kept> < hi; ...) {, vectorised when simd */
static void range_loop(rfi_render *R, int kept, const char *lo, const char *hi, int depth,
                       bool simd)
{
    if (simd) {
        rfi_render_indent(R, depth);
        put(R->sb, "#pragma omp simd\n");
    }
    rfi_render_indent(R, depth);
    putf(R->sb, "for (int64_t i%d = %s; i%d < %s; i%d++) {\n", kept, lo, kept, hi, kept);
}

/* Before the interchanged loop over a block of kept points (i<kept> over lo..hi,
 * slot the block's index), the loads it would gather (rfi_render_gathered_load)
 * when it calls a math function, copied one point at a time into arrays of
 * n points on the stack: the loop then reads them contiguously and runs
 * vectorised, math included (the gradient of a nearest upsampling followed by
 * tanh, a sum over each 2x2 block, gathered every other point). Returns the
 * copied loads (owned), or NULL when there are none. */
static bool *gathered_copies(rfi_render *R, const bool *live, const char *lo, const char *hi,
                             const char *slot, int64_t n, int depth)
{
    const rfi_kir_kernel *k = R->k;
    int kept = k->rank - 1;
    if (!rfi_render_calls_math(k, live))
        return NULL;
    bool *copied = rfi_calloc((size_t)k->n_ins, sizeof *copied);
    bool *index = rfi_calloc((size_t)k->n_ins, sizeof *index);
    bool any = false;
    for (int id = 0; copied && index && id < k->n_ins; id++) {
        copied[id] = live[id] && rfi_render_gathered_load(k, &k->ins[id]);
        if (copied[id])
            rfi_render_mark_operands(k, k->ins[id].a, NULL, index);
        any = any || copied[id];
    }
    if (!copied || !index || !any) {
        R->sb->failed |= !copied || !index;
        rfi_free(copied);
        rfi_free(index);
        return NULL;
    }
    char shape[32], at[64];
    snprintf(shape, sizeof shape, "[%lld]", (long long)n);
    snprintf(at, sizeof at, "[%s]", slot);
    rfi_render_copy_arrays(R, copied, shape, depth);
    rfi_render_indent(R, depth);
    putf(R->sb, "for (int64_t i%d = %s; i%d < %s; i%d++) {\n", kept, lo, kept, hi, kept);
    rfi_render_statements_where(R, live, 1, depth + 1, index, true);
    rfi_render_statements_where(R, live, 2, depth + 1, index, true);
    rfi_render_copy_fill(R, copied, at, depth + 1);
    rfi_render_indent(R, depth);
    put(R->sb, "}\n");
    rfi_free(index);
    return copied;
}

/* The statements of an interchanged point at depth, the copied loads read
 * from their arrays. */
static void statements_over_copies(rfi_render *R, const bool *live, const bool *copied,
                                   const char *slot, int depth)
{
    const rfi_kir_kernel *k = R->k;
    bool *need = rfi_calloc((size_t)k->n_ins, sizeof *need);
    if (!need) {
        R->sb->failed = true;
        return;
    }
    for (int j = 0; j < k->n_folds; j++)
        rfi_render_mark_operands(k, rfi_kir_fold_value(k, j), copied, need);
    rfi_render_mark_operands(k, k->red_guard, copied, need);
    for (int id = 0; id < k->n_ins; id++)
        need[id] = need[id] && !copied[id];
    char at[64];
    snprintf(at, sizeof at, "[%s]", slot);
    rfi_render_copy_read(R, copied, at, depth);
    rfi_render_statements_where(R, live, 1, depth, need, true);
    rfi_render_statements_where(R, live, 2, depth, need, true);
    rfi_free(need);
}

void rfi_render_fold_out_liveness(const rfi_kir_kernel *k, bool *fold_live, bool *out_live)
{
    for (int j = 0; j < k->n_folds; j++)
        rfi_render_mark_operands(k, rfi_kir_fold_value(k, j), NULL, fold_live);
    rfi_render_mark_operands(k, k->red_guard, NULL, fold_live);
    for (int st = 0; st < k->n_stores; st++) {
        rfi_render_mark_operands(k, k->stores[st].index, NULL, out_live);
        rfi_render_mark_operands(k, k->stores[st].value, NULL, out_live);
    }
}

/* The interchanged form: per block of the last kept axis (the whole axis when
 * it is short), accumulators in an array, the reduced loops outside, the kept
 * axis innermost (vectorised). Each of the two inner bodies declares only the
 * per-point values it uses (live: the fold's, out: the stores'). */
static void interchanged_body(rfi_render *R, const bool *live, const bool *out)
{
    const rfi_kir_kernel *k = R->k;
    int kept = k->rank - 1, depth = 1 + kept;
    rfi_render_open_outer_loops(R, kept, false);
    bool blocked = kept == 0 || k->dims[kept] > ROW_BLOCK;
    char lo[32], hi[32], slot[48];
    int64_t n_accs = blocked ? ROW_BLOCK : k->dims[kept];
    if (blocked) {
        rfi_render_indent(R, depth);
        if (kept == 0)
            putf(R->sb, "for (int64_t b0 = lo; b0 < hi; b0 += %d) {\n", ROW_BLOCK);
        else
            putf(R->sb, "for (int64_t b%d = 0; b%d < %lld; b%d += %d) {\n", kept, kept,
                          (long long)k->dims[kept], kept, ROW_BLOCK);
        snprintf(hi, sizeof hi, kept == 0 ? "hi" : "%lld", (long long)k->dims[kept]);
        depth++;
        rfi_render_indent(R, depth);
        putf(R->sb, "const int64_t e%d = b%d + %d < %s ? b%d + %d : %s;\n", kept, kept,
                      ROW_BLOCK, hi, kept, ROW_BLOCK, hi);
        snprintf(lo, sizeof lo, "b%d", kept);
        snprintf(hi, sizeof hi, "e%d", kept);
        snprintf(slot, sizeof slot, "i%d - b%d", kept, kept);
    } else {
        snprintf(lo, sizeof lo, "0");
        snprintf(hi, sizeof hi, "%lld", (long long)k->dims[kept]);
        snprintf(slot, sizeof slot, "i%d", kept);
    }
    rfi_render_indent(R, depth);
    putf(R->sb, "%s accs[%lld];\n", rfi_render_ctype(k->acc_dtype), (long long)n_accs);
    range_loop(R, kept, lo, hi, depth, false);
    rfi_render_indent(R, depth + 1);
    putf(R->sb, "accs[%s] = ", slot);
    identity_literal(R);
    put(R->sb, ";\n");
    rfi_render_indent(R, depth);
    put(R->sb, "}\n");
    for (int d = 0; d < k->red_rank; d++) {
        rfi_render_indent(R, depth + d);
        putf(R->sb, "for (int64_t r%d = 0; r%d < %lld; r%d++) {\n", d, d,
                      (long long)k->red_dims[d], d);
    }
    int in = depth + k->red_rank;
    bool *copied = gathered_copies(R, live, lo, hi, slot, n_accs, in);
    range_loop(R, kept, lo, hi, in, true);
    rfi_render_indent(R, in + 1);
    putf(R->sb, "%s acc = accs[%s];\n", rfi_render_ctype(k->acc_dtype), slot);
    if (copied) {
        statements_over_copies(R, live, copied, slot, in + 1);
        rfi_free(copied);
    } else {
        rfi_render_statements(R, live, 1, in + 1);
        rfi_render_statements(R, live, 2, in + 1);
    }
    fold(R, in + 1);
    rfi_render_indent(R, in + 1);
    putf(R->sb, "accs[%s] = acc;\n", slot);
    rfi_render_indent(R, in);
    put(R->sb, "}\n");
    rfi_render_close_loops(R, depth, k->red_rank);
    range_loop(R, kept, lo, hi, depth, true); /* vectorises an epilogue (plan.h) */
    rfi_render_indent(R, depth + 1);
    putf(R->sb, "const %s acc = accs[%s];\n", rfi_render_ctype(k->acc_dtype), slot);
    rfi_render_statements(R, out, 1, depth + 1);
    rfi_render_statements(R, out, 3, depth + 1);
    rfi_render_stores(R, depth + 1);
    rfi_render_indent(R, depth);
    put(R->sb, "}\n");
    if (blocked) {
        rfi_render_indent(R, depth - 1);
        put(R->sb, "}\n");
    }
    rfi_render_close_loops(R, 1, kept);
}

void rfi_render_interchanged_body(rfi_render *R, bool *fold_live, bool *out_live)
{
    rfi_render_fold_out_liveness(R->k, fold_live, out_live);
    interchanged_body(R, fold_live, out_live);
}

/* ---- Split reductions ------------------------------------------------------------------- */
/* Each fold's accumulator from (load) or back into its row of partials in
 * the chunk (accs, accs1, ...) at kept index kl (C text). */
static void copy_partials(rfi_render *R, int depth, const char *kl, bool load)
{
    for (int j = 0; j < R->k->n_folds; j++) {
        char acc[32], row[32];
        rfi_render_acc_name(acc, j);
        rfi_render_fold_name(row, "accs", j);
        rfi_render_indent(R, depth);
        if (load)
            putf(R->sb, "%s %s = %s[%s];\n", rfi_render_ctype(R->k->acc_dtype), acc, row, kl);
        else
            putf(R->sb, "%s[%s] = %s;\n", row, kl, acc);
    }
}

/* Split float sums fold f32 values converted to double (kir.h), and on AVX2
 * the conversions cost more than the rest of a BatchNorm gradient's four
 * sums: ~15 cycles per 8 points, where the loads and products take ~5. So
 * each point first adds PRESUM consecutive values of its innermost reduced
 * loop in f32 and converts and folds only their sum. That adds at most
 * 3 * 2^-24 of the block's sum of magnitudes per block (the values are f32
 * roundings already; a math library sums f32 data in f32 throughout), and
 * the ResNet's four sums of 8 channels ran 2-2.8x faster alone (400 ->
 * 300 us in the step; all its reductions 3.5 -> 2.9 ms). A kernel with a
 * fold of f64 values (f64 data, or f32 data converted and then computed on
 * in f64, such as squares: presum_in_double) adds the blocks of every fold
 * in double instead: exact to the double rounding, and each
 * point's partials then wait on memory once per block rather than once per
 * value (a sum and a sum of squares of f32 data converted to f64, over
 * [128,16,28,28] channels last: a ResNet step with its BatchNorm statistics
 * written that way took 245-250 us for each, then 145). The block's loop
 * carries `#pragma GCC unroll`: gcc unrolls a loop of a constant count by
 * itself only while its body is small, and a block it left rolled kept the
 * kept loop around it from vectorising; a ResNet's last BatchNorm gradients
 * (two layers' sums of a spread pool gradient, with its relu mask, read from
 * three values) ran scalar, branching on each mask, 1.42-1.47 ms in the step
 * against 0.14-0.17 unrolled (1234 against 96 us alone, on random signs). */
#define PRESUM 4

/* Whether fold j's value is an f32 value converted to the f64 accumulator. */
static bool converted_f32(const rfi_kir_kernel *k, int j)
{
    const rfi_kir_ins *v = &k->ins[rfi_kir_fold_value(k, j)];
    return v->op == RFI_KIR_CONVERT && v->a >= 0 && k->ins[v->a].dtype == RF_F32;
}

/* Whether a presum kernel adds its blocks in double: some fold's value is not
 * an f32 one converted. */
static bool presum_in_double(const rfi_kir_kernel *k)
{
    for (int j = 0; j < k->n_folds; j++)
        if (!converted_f32(k, j))
            return true;
    return false;
}

/* The extent of the innermost reduced loop a split body runs (r0 over one
 * chunk: its shortest). */
static int64_t innermost_reduced(const rfi_kir_kernel *k, const rfi_schedule *sc)
{
    int last = k->red_rank - 1;
    return last == 0 ? k->red_dims[0] / sc->chunks : k->red_dims[last];
}

static bool presum_wanted(const rfi_kir_kernel *k, const bool *live, const rfi_schedule *sc)
{
    if (k->rank < 1 || !simd_sum(k) || k->acc_dtype != RF_F64 || k->red_guard >= 0 ||
        innermost_reduced(k, sc) < PRESUM ||
        !(k->red_rank == 1 || interchange_reduction(k, live)))
        return false;
    for (int j = 0; j < k->n_folds; j++)
        if (!converted_f32(k, j) && k->ins[rfi_kir_fold_value(k, j)].dtype != RF_F64)
            return false;
    return true;
}

/* The kept loops of a split body at depth around the rest: the values, the
 * partials loaded, folded and stored back (inside the reduced loops). */
static void fold_kept_points(rfi_render *R, const bool *live, const char *kl, int depth)
{
    int in = depth + R->k->rank;
    open_kept_loops(R, depth, true);
    rfi_render_statements(R, live, 1, in);
    rfi_render_statements(R, live, 2, in);
    copy_partials(R, in, kl, true);
    fold(R, in);
    copy_partials(R, in, kl, false);
    rfi_render_close_loops(R, depth, R->k->rank);
}

/* live without the conversions to double the folds read (unless something
 * else reads them too), in `out`. */
static void without_fold_conversions(const rfi_kir_kernel *k, const bool *live, bool *out)
{
    memcpy(out, live, (size_t)k->n_ins * sizeof *out);
    for (int j = 0; j < k->n_folds; j++)
        out[rfi_kir_fold_value(k, j)] = false;
    for (int id = 0; id < k->n_ins; id++) {
        const rfi_kir_ins *x = &k->ins[id];
        for (int j = 0; j < k->n_folds && out[id]; j++) {
            int v = rfi_kir_fold_value(k, j);
            if (x->a == v || x->b == v || x->c == v)
                out[v] = true;
        }
    }
}

/* The kept loops at depth around one block of PRESUM values of the innermost
 * reduced loop r<last> from rb: each point sums them in f32, then folds. */
static void presum_block(rfi_render *R, const bool *block_live, const char *kl, int depth)
{
    const rfi_kir_kernel *k = R->k;
    int last = k->red_rank - 1, in = depth + k->rank;
    bool in_double = presum_in_double(k);
    open_kept_loops(R, depth, true);
    rfi_render_statements(R, block_live, 1, in);
    for (int j = 0; j < k->n_folds; j++) {
        rfi_render_indent(R, in);
        putf(R->sb, in_double ? "double ps%d = 0.0;\n" : "float ps%d = 0.0f;\n", j);
    }
    rfi_render_indent(R, in); /* unrolled, so that the kept loop around it vectorises */
    putf(R->sb, "#pragma GCC unroll %d\n", PRESUM);
    rfi_render_indent(R, in);
    putf(R->sb, "for (int64_t u = 0; u < %d; u++) {\n", PRESUM);
    rfi_render_indent(R, in + 1);
    putf(R->sb, "const int64_t r%d = rb + u;\n", last);
    rfi_render_statements(R, block_live, 2, in + 1);
    for (int j = 0; j < k->n_folds; j++) {
        char value[64];
        int v = rfi_kir_fold_value(k, j);
        rfi_render_operand_text(R, in_double ? v : k->ins[v].a, value, sizeof value);
        rfi_render_indent(R, in + 1);
        putf(R->sb, "ps%d += %s;\n", j, value);
    }
    rfi_render_indent(R, in);
    put(R->sb, "}\n");
    copy_partials(R, in, kl, true);
    for (int j = 0; j < k->n_folds; j++) {
        char acc[32], value[32];
        rfi_render_acc_name(acc, j);
        snprintf(value, sizeof value, in_double ? "ps%d" : "(double)ps%d", j);
        fold_text(R, in, acc, value);
    }
    copy_partials(R, in, kl, false);
    rfi_render_close_loops(R, depth, k->rank);
}

/* The split body of presum_wanted kernels (at depth 2, in chunk q): the outer
 * reduced loops (r0 over the chunk), then the innermost one in blocks of
 * PRESUM values, and its last values one at a time. */
static void presum_body(rfi_render *R, const bool *live, const rfi_schedule *sc, const char *kl)
{
    const rfi_kir_kernel *k = R->k;
    bool *block_live = rfi_calloc((size_t)k->n_ins, sizeof *block_live);
    if (!block_live) {
        R->sb->failed = true;
        return;
    }
    if (presum_in_double(k))
        memcpy(block_live, live, (size_t)k->n_ins * sizeof *block_live);
    else
        without_fold_conversions(k, live, block_live);
    int last = k->red_rank - 1, depth = 2;
    if (last > 0) {
        open_chunk_loop(R, depth++, sc);
        open_inner_reduced_loops(R, last, depth);
        depth += last - 1;
    }
    char lo[64], hi[64];
    if (last == 0) {
        long long n = (long long)k->red_dims[0], chunks = (long long)sc->chunks;
        snprintf(lo, sizeof lo, "q * %lld / %lld", n, chunks);
        snprintf(hi, sizeof hi, "(q + 1) * %lld / %lld", n, chunks);
    } else {
        snprintf(lo, sizeof lo, "0");
        snprintf(hi, sizeof hi, "%lld", (long long)k->red_dims[last]);
    }
    rfi_render_indent(R, depth);
    putf(R->sb, "const int64_t r_hi = %s;\n", hi);
    rfi_render_indent(R, depth);
    putf(R->sb, "int64_t rb = %s;\n", lo);
    rfi_render_indent(R, depth);
    putf(R->sb, "for (; rb + %d <= r_hi; rb += %d) {\n", PRESUM, PRESUM);
    presum_block(R, block_live, kl, depth + 1);
    rfi_render_indent(R, depth);
    put(R->sb, "}\n");
    rfi_render_indent(R, depth);
    putf(R->sb, "for (int64_t r%d = rb; r%d < r_hi; r%d++) {\n", last, last, last);
    fold_kept_points(R, live, kl, depth + 1);
    rfi_render_indent(R, depth);
    put(R->sb, "}\n");
    rfi_render_close_loops(R, 2, depth - 2);
    rfi_free(block_live);
}

/* The chunk function: chunks [lo, hi), each folding its range of r0 into its
 * row of partial accumulators. Reductions over r0 alone, and those whose
 * loads walk memory along the last kept axis but not along the innermost
 * reduced one (a bias gradient over channel-blocked data), run with the kept
 * axis innermost (vectorised, like the interchanged form); the others with
 * the kept loops around the remaining reduced loops. Each point folds its
 * values in the same order either way. */
static void split_body(rfi_render *R, const bool *live, const rfi_schedule *sc)
{
    const rfi_kir_kernel *k = R->k;
    char kl[320];
    kept_index(k, kl, sizeof kl);
    const char *acc_t = rfi_render_ctype(k->acc_dtype);
    rfi_render_statements(R, live, 0, 1);
    put(R->sb, "    for (int64_t q = lo; q < hi; q++) {\n");
    int folds = k->n_folds;
    if (k->rank == 0) { /* one point: its partials in scalars */
        declare_accs(R, 2);
        open_reduced_loops_with_statements(R, live, 0, 2, sc);
        fold(R, 2 + k->red_rank);
        rfi_render_close_loops(R, 2, k->red_rank);
        if (folds == 1)
            put(R->sb, "        c->part[q] = acc;\n");
        for (int j = 0; j < folds && folds > 1; j++) {
            char acc[32];
            rfi_render_acc_name(acc, j);
            putf(R->sb, "        c->part[q * %d + %d] = %s;\n", folds, j, acc);
        }
        put(R->sb, "    }\n");
        return;
    }
    putf(R->sb, "        %s *restrict accs = c->part + q * %lld;\n", acc_t,
                  (long long)(folds * sc->kept));
    for (int j = 1; j < folds; j++)
        putf(R->sb, "        %s *restrict accs%d = accs + %lld;\n", acc_t, j,
                      (long long)(j * sc->kept));
    putf(R->sb, "        for (int64_t a = 0; a < %lld; a++)\n            accs[a] = ",
                  (long long)(folds * sc->kept));
    identity_literal(R);
    put(R->sb, ";\n");
    if (presum_wanted(k, live, sc)) {
        presum_body(R, live, sc, kl);
    } else if (k->red_rank == 1 || interchange_reduction(k, live)) {
        open_chunk_loop(R, 2, sc);
        open_inner_reduced_loops(R, k->red_rank, 3);
        fold_kept_points(R, live, kl, 2 + k->red_rank);
        rfi_render_close_loops(R, 2, k->red_rank);
    } else {
        open_chunk_loop(R, 2, sc);
        open_kept_loops(R, 3, false);
        int in = 3 + k->rank;
        rfi_render_statements(R, live, 1, in);
        copy_partials(R, in, kl, true);
        open_reduced_loops_with_statements(R, live, 1, in, sc);
        fold(R, in + k->red_rank - 1);
        rfi_render_close_loops(R, in, k->red_rank - 1);
        copy_partials(R, in, kl, false);
        rfi_render_close_loops(R, 2, 1 + k->rank);
    }
    put(R->sb, "    }\n");
}

/* The combine function: each point's partials folded in chunk order, then
 * the values after the reduction computed and stored. */
static void combine_function(rfi_render *R, const char *kname, const bool *live, const bool *used,
                             const rfi_schedule *sc)
{
    const rfi_kir_kernel *k = R->k;
    char kl[320], part[400];
    kept_index(k, kl, sizeof kl);
    int folds = k->n_folds;
    putf(R->sb, "/* Folds each point's %lld partials in chunk order, then stores. */\n",
                  (long long)sc->chunks);
    putf(R->sb, "RF_KERNEL void %s_combine(const struct %s_ctx *c)\n{\n", kname, kname);
    rfi_render_declare_bases(R, used);
    rfi_render_statements(R, live, 0, 1);
    open_kept_loops(R, 1, false);
    int in = 1 + k->rank;
    declare_accs(R, in);
    for (int j = 0; j < folds; j++) {
        char acc[32], row[64] = "";
        rfi_render_acc_name(acc, j);
        if (j > 0)
            snprintf(row, sizeof row, " + %lld", (long long)(j * sc->kept));
        if (sc->kept == 1 && folds == 1)
            snprintf(part, sizeof part, "c->part[q]");
        else if (sc->kept == 1)
            snprintf(part, sizeof part, "c->part[q * %d%s]", folds, row);
        else
            snprintf(part, sizeof part, "c->part[q * %lld%s + %s]",
                     (long long)(folds * sc->kept), row, kl);
        rfi_render_indent(R, in);
        putf(R->sb, "for (int64_t q = 0; q < %lld; q++)\n", (long long)sc->chunks);
        fold_text(R, in + 1, acc, part);
    }
    rfi_render_statements(R, live, 1, in);
    rfi_render_statements(R, live, 3, in);
    rfi_render_stores(R, in);
    rfi_render_close_loops(R, 1, k->rank);
    put(R->sb, "}\n\n");
}

/* A split reduction's two functions; fold_live and out_live are scratch. */
void rfi_render_split_functions(rfi_render *R, const char *kname, const rfi_schedule *sc,
                                bool *fold_live, bool *out_live, bool *used)
{
    rfi_render_fold_out_liveness(R->k, fold_live, out_live);
    rfi_render_function_head(R, kname);
    rfi_render_bases_used(R->k, fold_live, false, used);
    rfi_render_declare_bases(R, used);
    split_body(R, fold_live, sc);
    put(R->sb, "}\n\n");
    rfi_render_bases_used(R->k, out_live, true, used);
    combine_function(R, kname, out_live, used, sc);
}

/* ---- Unrolled reductions -------------------------------------------------------------- *
 * A float sum over one contiguous reduced loop per output (a matrix-vector
 * product: the batch-1 dense layer) is bound by the latency of its one
 * vector accumulator. Its plain schedule gets UNROLL_OUTPUTS outputs per
 * iteration of the kept loop, each with its own accumulator in one
 * vectorised reduced loop, which also loads the values they share (the
 * vector) once. A kernel with two kept loops (a matrix product that stays a
 * loop, as every f64 one does) does so along its second, inside the first:
 * an f64 [64,784] x [256,784] product took 0.92 ms against 1.65 plain.
 * Each output still folds its points in the same order, so results are
 * bitwise those of the plain schedule. */
#define UNROLL_OUTPUTS 4
#define UNROLL_MIN_POINTS 32

bool rfi_render_unrolls(const rfi_kir_kernel *k)
{
    return k->is_reduce && k->n_folds == 1 && (k->rank == 1 || k->rank == 2) &&
           k->red_rank == 1 && simd_sum(k) && k->dims[k->rank - 1] >= 2 * UNROLL_OUTPUTS &&
           k->red_dims[0] >= UNROLL_MIN_POINTS;
}

void rfi_render_output_dependent(const rfi_kir_kernel *k, int var, bool *dep)
{
    for (int id = 0; id < k->n_ins; id++) {
        const rfi_kir_ins *x = &k->ins[id];
        dep[id] = (x->op == RFI_KIR_VAR && x->var == var) || x->op == RFI_KIR_ACC ||
                  (x->a >= 0 && x->a < id && dep[x->a]) ||
                  (x->b >= 0 && x->b < id && dep[x->b]) || (x->c >= 0 && x->c < id && dep[x->c]);
    }
}

/* Renames the per-output values for output u of a block: x_12 becomes x_12u2
 * and i0 i0u2 for u = 2 (u = 0 keeps the plain names); the accumulator is
 * acc_<u>. False when a name would not fit. */
static bool name_output(rfi_render *R, const bool *dep, char (*saved)[32], int u)
{
    const rfi_kir_kernel *k = R->k;
    for (int id = 0; id < k->n_ins; id++) {
        if (!dep[id])
            continue;
        const rfi_kir_ins *x = &k->ins[id];
        /* "u<u>" after a name's digits: no plain name has letters there */
        int n = x->op == RFI_KIR_ACC ? snprintf(R->names[id], 32, "acc_%d", u)
                : u == 0             ? snprintf(R->names[id], 32, "%s", saved[id])
                                     : snprintf(R->names[id], 32, "%su%d", saved[id], u);
        if (n < 0 || n >= 32)
            return false;
    }
    return true;
}

/* ---- bf16 dot products ----------------------------------------------------------------- *
 * At RF_PRECISION_BF16 each operand value of a dot product is rounded to
 * bfloat16 before the product (kir_lower_reduce.c), and in portable C that
 * rounding costs about ten vector operations per value against the one
 * multiply-add: a batch-1 dense layer at bf16 ran 2.7x slower than at f32.
 * On a CPU with AVX512-BF16 one instruction rounds 32 values exactly as
 * rf_round_bf16 does (nearest even, subnormals to a zero of their sign, NaN
 * quiet) and another multiplies bf16 pairs into f32 sums (products of two
 * bfloat16 values are exact in f32), so a dot whose operands are contiguous
 * along its one reduced loop runs on them in steps of 32, its last points as
 * before: an unrolled block's four outputs sharing one operand's conversion,
 * or a plain reduction's one output. Only the summation order changes, as
 * vectorising a float sum already does. */

bool rfi_render_index_op(rfi_kir_op op) { return op >= RFI_KIR_VAR && op <= RFI_KIR_IMAX; }

/* Whether the folded value is round_bf16(a) * round_bf16(b) of two f32 loads
 * contiguous along the one reduced loop, with nothing else in that loop but
 * their index arithmetic; then loads[] are the two loads. */
static bool bf16_dot_loads(const rfi_kir_kernel *k, const bool *live, int *loads)
{
    const rfi_kir_ins *v = &k->ins[k->red_value];
    if (k->red_rank != 1 || k->n_folds != 1 || k->red_guard >= 0 || k->acc_dtype != RF_F32 ||
        k->red_kind != RF_REDUCE_SUM || v->op != RFI_KIR_BINARY || v->ir_op != RFI_OP_MUL)
        return false;
    for (int j = 0; j < 2; j++) {
        int r = j ? v->b : v->a, l = r >= 0 ? k->ins[r].a : -1;
        int64_t coef;
        if (r < 0 || k->ins[r].op != RFI_KIR_ROUND_BF16 || l < 0 ||
            k->ins[l].op != RFI_KIR_LOAD || k->ins[l].dtype != RF_F32 ||
            !rfi_kir_var_coef(k, k->ins[l].a, k->rank, &coef) || coef != 1)
            return false;
        loads[j] = l;
    }
    for (int id = 0; id < k->n_ins; id++) {
        const rfi_kir_ins *x = &k->ins[id];
        bool part = id == k->red_value || id == v->a || id == v->b || id == loads[0] ||
                    id == loads[1];
        if (live[id] && x->level == 2 && !part && !rfi_render_index_op(x->op))
            return false;
    }
    return true;
}

/* The same for an unrolled block, with one load shared by every output
 * (*vec) and one per output (*row). */
static bool bf16_dot(const rfi_kir_kernel *k, const bool *live, const bool *dep, int *vec,
                     int *row)
{
    int loads[2];
    if (!bf16_dot_loads(k, live, loads) || dep[loads[0]] == dep[loads[1]])
        return false;
    *vec = dep[loads[0]] ? loads[1] : loads[0];
    *row = dep[loads[0]] ? loads[0] : loads[1];
    return true;
}

/* The live index arithmetic of k (NULL when out of memory). */
static bool *index_mask(const rfi_kir_kernel *k, const bool *live)
{
    bool *index = rfi_calloc((size_t)(k->n_ins > 0 ? k->n_ins : 1), sizeof *index);
    for (int id = 0; index && id < k->n_ins; id++)
        index[id] = live[id] && rfi_render_index_op(k->ins[id].op);
    return index;
}

/* The AVX512-BF16 loop over the first `whole` (a multiple of 32) reduced
 * points of an unrolled block (whose loop is at depth `at`) into acc_0..
 * (see above), under RF_BF16_DOT; index marks the live index arithmetic.
 * False when names do not fit. */
static bool bf16_dot_loop(rfi_render *R, const bool *index, const bool *dep, char (*saved)[32],
                          int vec, int row, int64_t whole, int at)
{
    const rfi_kir_kernel *k = R->k;
    char where[64];
    R->need |= RFI_NEED_BF16_DOT;
    put(R->sb, "#if RF_BF16_DOT\n");
    rfi_render_indent(R, at + 1);
    put(R->sb, "{\n");
    for (int u = 0; u < UNROLL_OUTPUTS; u++) {
        rfi_render_indent(R, at + 2);
        putf(R->sb, "rf_dot_f32x16 dot_%d = {0};\n", u);
    }
    rfi_render_indent(R, at + 2);
    putf(R->sb, "for (int64_t r0 = 0; r0 < %lld; r0 += 32) {\n", (long long)whole);
    rfi_render_statements_where(R, index, 2, at + 3, dep, false);
    rfi_render_operand_text(R, k->ins[vec].a, where, sizeof where);
    rfi_render_indent(R, at + 3);
    putf(R->sb, "const rf_dot_bf16x32 vec = rf_bf16x32(&%s[%s]);\n",
         R->base_names[k->ins[vec].base], where);
    for (int u = 0; u < UNROLL_OUTPUTS; u++) {
        if (!name_output(R, dep, saved, u))
            return false;
        rfi_render_statements_where(R, index, 2, at + 3, dep, true);
        rfi_render_operand_text(R, k->ins[row].a, where, sizeof where);
        rfi_render_indent(R, at + 3);
        putf(R->sb, "dot_%d = rf_dpbf16(dot_%d, vec, rf_bf16x32(&%s[%s]));\n", u, u,
             R->base_names[k->ins[row].base], where);
    }
    rfi_render_indent(R, at + 2);
    put(R->sb, "}\n");
    for (int u = 0; u < UNROLL_OUTPUTS; u++) {
        rfi_render_indent(R, at + 2);
        putf(R->sb, "acc_%d = rf_sum16(dot_%d);\n", u, u);
    }
    rfi_render_indent(R, at + 1);
    put(R->sb, "}\n");
    return name_output(R, dep, saved, 0);
}

/* The head of the one reduced loop r0 over [first, n) at depth, vectorised
 * into `accs` accumulators acc_0.. (an unrolled block's), or into acc when
 * accs is 0 (a plain reduction's). */
static void reduced_loop_head(rfi_render *R, int depth, int accs, int64_t first, int64_t n)
{
    rfi_render_indent(R, depth);
    put(R->sb, accs ? "#pragma omp simd reduction(+:acc_0" : "#pragma omp simd reduction(+:acc");
    for (int u = 1; u < accs; u++)
        putf(R->sb, ", acc_%d", u);
    put(R->sb, ")\n");
    rfi_render_indent(R, depth);
    putf(R->sb, "for (int64_t r0 = %lld; r0 < %lld; r0++) {\n", (long long)first, (long long)n);
}

/* After a bf16 dot's vectorised loop over its first `whole` points: the head
 * of the loop over the rest, or, without RF_BF16_DOT, over all n. */
static void bf16_rest_head(rfi_render *R, int depth, int accs, int64_t whole, int64_t n)
{
    reduced_loop_head(R, depth, accs, whole, n);
    put(R->sb, "#else\n");
    reduced_loop_head(R, depth, accs, 0, n);
    put(R->sb, "#endif\n");
}

/* A plain reduction's reduced loop where it is a bf16 dot product
 * (bf16_dot_loads): its first multiple of 32 points with AVX512-BF16 under
 * RF_BF16_DOT, then the head of the loop over the rest; false (nothing
 * written) where it is not one. */
static bool plain_bf16_dot(rfi_render *R, const bool *live, int depth)
{
    const rfi_kir_kernel *k = R->k;
    int loads[2];
    int64_t n = k->red_dims[0], whole = n - n % 32;
    if (whole == 0 || !bf16_dot_loads(k, live, loads)) /* which asks for one reduced loop */
        return false;
    bool *index = index_mask(k, live);
    if (!index) {
        R->sb->failed = true;
        return false;
    }
    char at[2][64];
    for (int j = 0; j < 2; j++)
        rfi_render_operand_text(R, k->ins[loads[j]].a, at[j], sizeof at[j]);
    R->need |= RFI_NEED_BF16_DOT;
    put(R->sb, "#if RF_BF16_DOT\n");
    rfi_render_indent(R, depth);
    put(R->sb, "{\n");
    rfi_render_indent(R, depth + 1);
    put(R->sb, "rf_dot_f32x16 dot_0 = {0};\n");
    rfi_render_indent(R, depth + 1);
    putf(R->sb, "for (int64_t r0 = 0; r0 < %lld; r0 += 32) {\n", (long long)whole);
    rfi_render_statements_where(R, index, 2, depth + 2, NULL, false);
    rfi_render_indent(R, depth + 2);
    putf(R->sb, "dot_0 = rf_dpbf16(dot_0, rf_bf16x32(&%s[%s]), rf_bf16x32(&%s[%s]));\n",
         R->base_names[k->ins[loads[0]].base], at[0], R->base_names[k->ins[loads[1]].base],
         at[1]);
    rfi_render_indent(R, depth + 1);
    put(R->sb, "}\n");
    rfi_render_indent(R, depth + 1);
    put(R->sb, "acc = rf_sum16(dot_0);\n");
    rfi_render_indent(R, depth);
    put(R->sb, "}\n");
    bf16_rest_head(R, depth, 0, whole, n);
    rfi_free(index);
    return true;
}

/* The reduced loop's head of an unrolled block whose loop is at depth `at`,
 * after its vectorised bf16 loop where it is a bf16 dot product (false when
 * names do not fit). */
static bool unrolled_loop(rfi_render *R, const bool *live, const bool *dep, char (*saved)[32],
                          int at)
{
    const rfi_kir_kernel *k = R->k;
    int64_t n = k->red_dims[0], whole = n - n % 32;
    int vec, row;
    if (!bf16_dot(k, live, dep, &vec, &row)) {
        reduced_loop_head(R, at + 1, UNROLL_OUTPUTS, 0, n);
        return true;
    }
    bool *index = index_mask(k, live);
    if (!index) {
        R->sb->failed = true;
        return false;
    }
    bool ok = bf16_dot_loop(R, index, dep, saved, vec, row, whole, at);
    rfi_free(index);
    bf16_rest_head(R, at + 1, UNROLL_OUTPUTS, whole, n);
    return ok;
}

/* The loop of blocks of UNROLL_OUTPUTS outputs along the last kept loop, at
 * depth `at` (see above), with the rows i0 of a rank-2 kernel inside each
 * block; `end` is that loop's bound. False (nothing written) when the names
 * do not fit. */
static bool unrolled_block(rfi_render *R, const bool *live, const bool *dep, char (*saved)[32],
                           int at, const char *end)
{
    const rfi_kir_kernel *k = R->k;
    const int var = k->rank - 1;
    rfi_strbuf text = {0}, *out = R->sb;
    R->sb = &text;
    bool ok = true;
    rfi_render_indent(R, at);
    putf(R->sb, "for (; i%d + %d <= %s; i%d += %d) {\n", var, UNROLL_OUTPUTS, end, var,
         UNROLL_OUTPUTS);
    for (int u = 1; u < UNROLL_OUTPUTS; u++) {
        rfi_render_indent(R, at + 1);
        putf(R->sb, "const int64_t i%du%d = i%d + %d;\n", var, u, var, u);
    }
    if (var > 0) {
        rfi_render_indent(R, at + 1);
        put(R->sb, "for (int64_t i0 = lo; i0 < hi; i0++) {\n");
        at++;
    }
    rfi_render_statements_where(R, live, 1, at + 1, dep, false);
    for (int u = 0; u < UNROLL_OUTPUTS && ok; u++)
        if ((ok = name_output(R, dep, saved, u)))
            rfi_render_statements_where(R, live, 1, at + 1, dep, true);
    for (int u = 0; u < UNROLL_OUTPUTS; u++) {
        rfi_render_indent(R, at + 1);
        putf(R->sb, "%s acc_%d = ", rfi_render_ctype(k->acc_dtype), u);
        identity_literal(R);
        put(R->sb, ";\n");
    }
    ok = unrolled_loop(R, live, dep, saved, at) && ok;
    rfi_render_statements_where(R, live, 2, at + 2, dep, false);
    for (int u = 0; u < UNROLL_OUTPUTS && ok; u++) {
        char acc[16];
        snprintf(acc, sizeof acc, "acc_%d", u);
        if ((ok = name_output(R, dep, saved, u))) {
            rfi_render_statements_where(R, live, 2, at + 2, dep, true);
            fold_into(R, at + 2, acc);
        }
    }
    rfi_render_indent(R, at + 1);
    put(R->sb, "}\n");
    for (int u = 0; u < UNROLL_OUTPUTS && ok; u++)
        if ((ok = name_output(R, dep, saved, u))) {
            rfi_render_statements_where(R, live, 3, at + 1, dep, true);
            rfi_render_stores(R, at + 1);
        }
    rfi_render_close_loops(R, at - (var > 0), 1 + (var > 0));
    R->sb = out;
    for (int id = 0; id < k->n_ins; id++) /* the plain names back */
        memcpy(R->names[id], saved[id], 32);
    out->failed |= text.failed;
    ok = ok && !text.failed;
    if (ok)
        put_n(R->sb, text.data, text.len);
    rfi_sb_free(&text);
    return ok;
}

/* Blocks of UNROLL_OUTPUTS outputs along the last kept loop, then the plain
 * schedule for the rest. A rank-2 kernel (a matrix product's rows of lhs by
 * rows of rhs) runs the rows of its thread's range (the first kept loop)
 * inside each block: the block's rows of rhs stay in L1 while the lhs rows
 * stream, where rows outside read all of rhs per row (an f64 [64,784] x
 * [256,784] product: 680-710 us against 800). */
void rfi_render_unrolled_body(rfi_render *R, const bool *live)
{
    const rfi_kir_kernel *k = R->k;
    size_t n = (size_t)(k->n_ins > 0 ? k->n_ins : 1);
    bool *dep = rfi_calloc(n, sizeof *dep);
    char (*saved)[32] = rfi_malloc(n * sizeof *saved);
    if (dep && saved) {
        const int var = k->rank - 1, at = k->rank;
        char end[32];
        if (var == 0)
            snprintf(end, sizeof end, "hi");
        else
            snprintf(end, sizeof end, "%lld", (long long)k->dims[var]);
        memcpy(saved, R->names, (size_t)k->n_ins * sizeof *saved);
        rfi_render_output_dependent(k, var, dep);
        rfi_render_indent(R, 1);
        putf(R->sb, "int64_t i%d = %s;\n", var, var == 0 ? "lo" : "0");
        bool unrolled = unrolled_block(R, live, dep, saved, 1, end);
        rfi_render_indent(R, 1);
        if (unrolled)
            /* fewer than UNROLL_OUTPUTS outputs are left; saying so keeps gcc,
             * once the kernel is inlined with constant bounds, from warning
             * that a later iteration of this loop would overflow an index */
            putf(R->sb, "for (const int64_t tail_end = i%d + (%s - i%d) %% %d; i%d < tail_end; "
                        "i%d++) {\n", var, end, var, UNROLL_OUTPUTS, var, var);
        else
            putf(R->sb, "for (; i%d < %s; i%d++) { /* (not unrolled: names too long) */\n",
                 var, end, var);
        if (var > 0)
            put(R->sb, "        for (int64_t i0 = lo; i0 < hi; i0++) {\n");
        rfi_render_statements(R, live, 1, 1 + at);
        rfi_render_reduction_loops(R, live, 1 + at);
        rfi_render_stores(R, 1 + at);
        rfi_render_close_loops(R, 1, at);
    } else {
        R->sb->failed = true;
    }
    rfi_free(dep);
    rfi_free(saved);
}

