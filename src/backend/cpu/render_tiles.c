/* render_tiles.c: the register-tiled schedule of REDUCE kernels that sum
 * products along a row, as C, for render_c.c (render_reduce.c holds the
 * other schedules and says when each runs).
 *
 * Matrix products and convolutions computed as loops (every f64 one: plan.h)
 * fold a * b per point, where a is a load contiguous along the last kept axis
 * L (a row of inputs) and b does not vary along L but along another kept
 * axis T (a weight per output feature). Interchanged, such a kernel keeps one
 * row of accumulators in memory and reloads a for every point of T: each
 * multiply-add loads and stores an accumulator, and the store port bounds
 * it (an f64 weight gradient [256,784] over 64 rows: 20 GFLOP/s on two
 * cores, a 3x3 convolution 16 -> 32 features: 8.5). Tiled, TILE_ROWS points
 * of T (WIDE_TILE_ROWS with 64-byte vectors) by TILE_VECTORS vectors of L
 * keep their accumulators in registers (GNU C vectors): per reduced point
 * two vector loads of a, one load of b per row, two multiply-adds per row.
 *
 * Rows of T left over run tiles of TILE_ROWS after wide ones, then tiles of
 * one row; points of L left over, a tile of
 * one vector, then the row's last vector again (overlapping the one before:
 * its shared points are computed twice) or, where the kernel reads what it
 * stores, tiles of single points. Each output still folds its
 * points in the kernel's order, so its sum is the interchanged schedule's.
 * The stores and whatever follows the fold run per point after the tile's
 * loops, from the accumulators put in an array.
 */
#include <stdio.h>
#include <string.h>

#include "render_c.h"

#define TILE_ROWS 4
/* With 64-byte vectors (AVX-512's 32 registers), tiles of eight rows first:
 * the f64 [64,784] x [784,256] forward 446 -> 377-397 us, its weight
 * gradient 317 -> 277-284 (two Intel cores), half the reloads of a's
 * strided rows per multiply-add. */
#define WIDE_TILE_ROWS 8
#define TILE_VECTORS 2
#define VECTOR_BYTES 32
/* With AVX-512, rows of at least two such vectors use 64-byte ones: an f64
 * [64,784] x [784,256] took 0.34-0.41 ms against 0.77-0.82, its weight
 * gradient 0.24-0.26 against 0.67 (two Intel cores). Shorter rows keep 32. */
#define WIDE_VECTOR_BYTES 64
/* Shorter sums (the tiny model's products over 2 points) gain nothing from
 * registers and pay for the tile's epilogue. */
#define TILE_MIN_POINTS 8

/* What a tiled kernel's loops need: its two axes, the fold's two operands,
 * and the fold's statements by what they vary with. */
typedef struct tiling {
    int t, l;           /* the tiled kept axis T, the last kept axis L */
    int a, b;           /* the load along L, the value per point of T */
    int lanes;          /* of a vector */
    bool *shared;       /* varies with neither T nor L */
    bool *per_row;      /* with T only */
    bool *per_col;      /* with L only, but a */
} tiling;

/* The fold's operands (t->a, t->b) when it sums a product of a load
 * contiguous along L and a value that does not vary with L. */
static bool find_operands(const rfi_kir_kernel *k, const bool *dep_l, tiling *t)
{
    const rfi_kir_ins *v = &k->ins[rfi_kir_fold_value(k, 0)];
    if (v->op != RFI_KIR_BINARY || v->ir_op != RFI_OP_MUL || v->dtype != k->acc_dtype)
        return false;
    for (int j = 0; j < 2; j++) {
        int a = j ? v->b : v->a, b = j ? v->a : v->b;
        const rfi_kir_ins *x = &k->ins[a];
        int64_t coef;
        if (x->op == RFI_KIR_LOAD && x->dtype == k->acc_dtype && !dep_l[b] &&
            rfi_kir_var_coef(k, x->a, t->l, &coef) && coef == 1) {
            t->a = a;
            t->b = b;
            return true;
        }
    }
    return false;
}

/* Whether axis T = t->t suits: b varies with it and a does not, and besides
 * the product nothing the fold needs varies with both T and L, nor with L
 * but the index arithmetic of a. */
static bool axis_suits(const rfi_kir_kernel *k, const bool *fold_live, const bool *dep_t,
                       const bool *dep_l, const tiling *t)
{
    if (!dep_t[t->b] || dep_t[t->a])
        return false;
    int product = rfi_kir_fold_value(k, 0);
    for (int id = 0; id < k->n_ins; id++) {
        if (!fold_live[id] || id == product || !dep_l[id])
            continue;
        if (dep_t[id] || (id != t->a && !rfi_render_index_op(k->ins[id].op)))
            return false;
    }
    return true;
}

static void tiling_free(tiling *t)
{
    rfi_free(t->shared);
    rfi_free(t->per_row);
    rfi_free(t->per_col);
}

/* Plans the tiles of a kernel whose fold needs the instructions fold_live;
 * false when it does not sum such products (or out of memory). */
static bool plan_tiles(const rfi_kir_kernel *k, const bool *fold_live, tiling *t)
{
    memset(t, 0, sizeof *t);
    if (!k->is_reduce || k->n_folds != 1 || k->rank < 2 || k->red_rank < 1 ||
        rfi_numel(k->red_dims, k->red_rank) < TILE_MIN_POINTS || k->red_guard >= 0 ||
        k->red_kind != RF_REDUCE_SUM ||
        (k->acc_dtype != RF_F32 && k->acc_dtype != RF_F64))
        return false;
    t->l = k->rank - 1;
    int size = (int)rf_dtype_size(k->acc_dtype);
    bool wide = rfi_render_wide_vectors() &&
                k->dims[t->l] >= TILE_VECTORS * (WIDE_VECTOR_BYTES / size);
    t->lanes = (wide ? WIDE_VECTOR_BYTES : VECTOR_BYTES) / size;
    if (k->dims[t->l] < t->lanes)
        return false;
    size_t n = (size_t)k->n_ins;
    bool *dep_l = rfi_calloc(n, sizeof *dep_l), *dep_t = rfi_calloc(n, sizeof *dep_t);
    t->shared = rfi_calloc(n, sizeof *t->shared);
    t->per_row = rfi_calloc(n, sizeof *t->per_row);
    t->per_col = rfi_calloc(n, sizeof *t->per_col);
    bool found = false;
    if (dep_l && dep_t && t->shared && t->per_row && t->per_col) {
        rfi_render_output_dependent(k, t->l, dep_l);
        if (find_operands(k, dep_l, t))
            for (int axis = t->l - 1; axis >= 0 && !found; axis--) {
                t->t = axis;
                rfi_render_output_dependent(k, axis, dep_t);
                found = axis_suits(k, fold_live, dep_t, dep_l, t);
            }
    }
    for (int id = 0; found && id < k->n_ins; id++) {
        t->shared[id] = fold_live[id] && !dep_t[id] && !dep_l[id];
        t->per_row[id] = fold_live[id] && dep_t[id] && !dep_l[id];
        t->per_col[id] = fold_live[id] && dep_l[id] && !dep_t[id] && id != t->a;
    }
    rfi_free(dep_l);
    rfi_free(dep_t);
    if (!found)
        tiling_free(t);
    return found;
}

bool rfi_render_tiles(const rfi_kir_kernel *k)
{
    size_t n = (size_t)(k->n_ins > 0 ? k->n_ins : 1);
    bool *fold_live = rfi_calloc(n, sizeof *fold_live), *out_live = rfi_calloc(n, sizeof *out_live);
    tiling t;
    bool tiles = false;
    if (fold_live && out_live && k->is_reduce && k->n_folds == 1) {
        rfi_render_fold_out_liveness(k, fold_live, out_live);
        if ((tiles = plan_tiles(k, fold_live, &t)))
            tiling_free(&t);
    }
    rfi_free(fold_live);
    rfi_free(out_live);
    return tiles;
}

/* ---- Rendering ---------------------------------------------------------------------- */
/* The C type of a tile's values: a vector of `width` lanes, or a scalar. */
static const char *value_type(const rfi_kir_kernel *k, int width, bool in_memory)
{
    if (width == 1)
        return rfi_render_ctype(k->acc_dtype);
    bool wide = width * (int)rf_dtype_size(k->acc_dtype) == WIDE_VECTOR_BYTES;
    if (k->acc_dtype == RF_F64)
        return wide ? (in_memory ? "rf_wtile_f64_mem" : "rf_wtile_f64")
                    : (in_memory ? "rf_tile_f64_mem" : "rf_tile_f64");
    return wide ? (in_memory ? "rf_wtile_f32_mem" : "rf_wtile_f32")
                : (in_memory ? "rf_tile_f32_mem" : "rf_tile_f32");
}

/* The statements of levels 1 and 2 in `which`, inside a block where loop
 * variable i<var> is <base> + offset (none when var < 0). */
static void statements_at(rfi_render *R, const bool *which, int depth, int var,
                          const char *base, int64_t offset)
{
    rfi_render_indent(R, depth);
    put(R->sb, "{\n");
    if (var >= 0) {
        rfi_render_indent(R, depth + 1);
        if (offset)
            putf(R->sb, "const int64_t i%d = %s + %lld;\n", var, base, (long long)offset);
        else
            putf(R->sb, "const int64_t i%d = %s;\n", var, base);
    }
    rfi_render_statements(R, which, 1, depth + 1);
    rfi_render_statements(R, which, 2, depth + 1);
}

/* The reduced loops of one tile: `rows` rows from row<T>, `vectors`
 * values of `width` lanes from col<L>, accumulators acc_<row>_<vector>. */
static void tile_folds(rfi_render *R, const tiling *t, int rows, int vectors, int width,
                       int depth)
{
    const rfi_kir_kernel *k = R->k;
    const char *type = value_type(k, width, false), *scalar = rfi_render_ctype(k->acc_dtype);
    char base[16], where[64];
    for (int u = 0; u < rows; u++)
        for (int v = 0; v < vectors; v++) {
            rfi_render_indent(R, depth);
            putf(R->sb, "%s acc_%d_%d = %s", type, u, v, width > 1 ? "{" : "");
            for (int w = 0; w < width; w++) {
                put(R->sb, w ? ", " : "");
                rfi_render_float_literal(R->sb, k->red_identity_f, k->acc_dtype);
            }
            put(R->sb, width > 1 ? "};\n" : ";\n");
        }
    for (int d = 0; d < k->red_rank; d++) {
        rfi_render_indent(R, depth + d);
        putf(R->sb, "for (int64_t r%d = 0; r%d < %lld; r%d++) {\n", d, d,
             (long long)k->red_dims[d], d);
    }
    int in = depth + k->red_rank;
    rfi_render_statements(R, t->shared, 1, in);
    rfi_render_statements(R, t->shared, 2, in);
    snprintf(base, sizeof base, "row%d", t->t);
    for (int u = 0; u < rows; u++) {
        rfi_render_indent(R, in);
        putf(R->sb, "%s b_%d;\n", scalar, u);
        statements_at(R, t->per_row, in, t->t, base, u);
        rfi_render_operand_text(R, t->b, where, sizeof where);
        rfi_render_indent(R, in + 1);
        putf(R->sb, "b_%d = %s;\n", u, where);
        rfi_render_indent(R, in);
        put(R->sb, "}\n");
    }
    snprintf(base, sizeof base, "col%d", t->l);
    for (int v = 0; v < vectors; v++) {
        rfi_render_indent(R, in);
        putf(R->sb, "%s a_%d;\n", type, v);
        statements_at(R, t->per_col, in, t->l, base, (int64_t)v * width);
        rfi_render_operand_text(R, k->ins[t->a].a, where, sizeof where);
        rfi_render_indent(R, in + 1);
        if (width > 1)
            putf(R->sb, "a_%d = *(const %s *)&%s[%s];\n", v, value_type(k, width, true),
                 R->base_names[k->ins[t->a].base], where);
        else
            putf(R->sb, "a_%d = %s[%s];\n", v, R->base_names[k->ins[t->a].base], where);
        rfi_render_indent(R, in);
        put(R->sb, "}\n");
    }
    for (int u = 0; u < rows; u++)
        for (int v = 0; v < vectors; v++) {
            rfi_render_indent(R, in);
            putf(R->sb, "acc_%d_%d += b_%d * a_%d;\n", u, v, u, v);
        }
    rfi_render_close_loops(R, depth, k->red_rank);
}

/* One tile at row<T>, col<L> (see tile_folds), then its outputs point by
 * point; out marks what the stores need. */
static void tile(rfi_render *R, const tiling *t, const bool *out, int rows, int vectors,
                 int width, int depth)
{
    const rfi_kir_kernel *k = R->k;
    const char *scalar = rfi_render_ctype(k->acc_dtype);
    int points = vectors * width;
    rfi_render_indent(R, depth);
    put(R->sb, "{\n");
    tile_folds(R, t, rows, vectors, width, depth + 1);
    rfi_render_indent(R, depth + 1);
    putf(R->sb, "%s sums[%d][%d];\n", scalar, rows, points);
    for (int u = 0; u < rows; u++)
        for (int v = 0; v < vectors; v++) {
            rfi_render_indent(R, depth + 1);
            if (width > 1)
                putf(R->sb, "*(%s *)&sums[%d][%d] = acc_%d_%d;\n", value_type(k, width, true),
                     u, v * width, u, v);
            else
                putf(R->sb, "sums[%d][%d] = acc_%d_%d;\n", u, v, u, v);
        }
    rfi_render_indent(R, depth + 1);
    putf(R->sb, "for (int64_t u = 0; u < %d; u++) {\n", rows);
    rfi_render_indent(R, depth + 2);
    putf(R->sb, "const int64_t i%d = row%d + u;\n", t->t, t->t);
    rfi_render_indent(R, depth + 2);
    put(R->sb, "#pragma omp simd\n");
    rfi_render_indent(R, depth + 2);
    putf(R->sb, "for (int64_t i%d = col%d; i%d < col%d + %d; i%d++) {\n", t->l, t->l, t->l,
         t->l, points, t->l);
    rfi_render_indent(R, depth + 3);
    putf(R->sb, "const %s acc = sums[u][i%d - col%d];\n", scalar, t->l, t->l);
    rfi_render_statements(R, out, 1, depth + 3);
    rfi_render_statements(R, out, 3, depth + 3);
    rfi_render_stores(R, depth + 3);
    rfi_render_close_loops(R, depth + 1, 2);
    rfi_render_indent(R, depth);
    put(R->sb, "}\n");
}

/* Whether the kernel loads from a buffer it stores to (an in-place root:
 * then no point may be computed twice). */
static bool reads_stored(const rfi_kir_kernel *k)
{
    for (int s = 0; s < k->n_stores; s++) {
        if (!k->bases[k->stores[s].base].noalias)
            return true;
        for (int id = 0; id < k->n_ins; id++)
            if (k->ins[id].op == RFI_KIR_LOAD && k->ins[id].base == k->stores[s].base)
                return true;
    }
    return false;
}

static void row_loops(rfi_render *R, const tiling *t, const bool *out, int vectors, int width,
                      int depth);

/* The kept loops between T and L, then the tiles of `rows` rows along L:
 * blocks of TILE_VECTORS vectors, one vector, the last vector again or
 * single points. With rows 0 each column block runs the row loops inside,
 * over T's rows (see rfi_render_tiled_body). */
static void col_loops(rfi_render *R, const tiling *t, const bool *out, int rows, int depth)
{
    const rfi_kir_kernel *k = R->k;
    int between = rows ? t->l - t->t - 1 : 0;
    for (int d = t->l - between; d < t->l; d++) {
        rfi_render_indent(R, depth++);
        putf(R->sb, "for (int64_t i%d = 0; i%d < %lld; i%d++) {\n", d, d,
             (long long)k->dims[d], d);
    }
    int64_t n = k->dims[t->l], block = (int64_t)TILE_VECTORS * t->lanes;
    int64_t rest = n % block;
    rfi_render_indent(R, depth);
    putf(R->sb, "int64_t col%d = 0;\n", t->l);
    if (n >= block) {
        rfi_render_indent(R, depth);
        putf(R->sb, "for (; col%d + %lld <= %lld; col%d += %lld) {\n", t->l, (long long)block,
             (long long)n, t->l, (long long)block);
        if (rows)
            tile(R, t, out, rows, TILE_VECTORS, t->lanes, depth + 1);
        else
            row_loops(R, t, out, TILE_VECTORS, t->lanes, depth + 1);
        rfi_render_indent(R, depth);
        put(R->sb, "}\n");
    }
    bool again = rest % t->lanes && !reads_stored(k);
    for (int part = 0; part < 2; part++) {
        if (part == 0 ? rest < t->lanes : !again)
            continue;
        if (part == 1) {
            /* the last vector again, ending at the row's end: the points it
             * shares with the one before are computed twice, the same */
            rfi_render_indent(R, depth);
            putf(R->sb, "col%d = %lld;\n", t->l, (long long)(n - t->lanes));
        }
        if (rows)
            tile(R, t, out, rows, 1, t->lanes, depth);
        else
            row_loops(R, t, out, 1, t->lanes, depth);
        if (part == 0) {
            rfi_render_indent(R, depth);
            putf(R->sb, "col%d += %d;\n", t->l, t->lanes);
        }
    }
    if (rest % t->lanes && !again) {
        rfi_render_indent(R, depth);
        putf(R->sb, "for (; col%d < %lld; col%d++) {\n", t->l, (long long)n, t->l);
        if (rows)
            tile(R, t, out, rows, 1, 1, depth + 1);
        else
            row_loops(R, t, out, 1, 1, depth + 1);
        rfi_render_indent(R, depth);
        put(R->sb, "}\n");
    }
    rfi_render_close_loops(R, depth - between, between);
}

/* T's rows, TILE_ROWS at a time, then one at a time: each the column loops
 * of its rows (vectors 0), or one tile of `vectors` vectors of `width` at
 * col<L> (inside a column block). */
static void row_loops(rfi_render *R, const tiling *t, const bool *out, int vectors, int width,
                      int depth)
{
    const rfi_kir_kernel *k = R->k;
    char end[32];
    snprintf(end, sizeof end, t->t == 0 ? "hi" : "%lld", (long long)k->dims[t->t]);
    rfi_render_indent(R, depth++);
    put(R->sb, "{\n");
    rfi_render_indent(R, depth);
    putf(R->sb, "int64_t row%d = %s;\n", t->t, t->t == 0 ? "lo" : "0");
    int tiers[] = {WIDE_TILE_ROWS, TILE_ROWS, 1};
    bool wide = t->lanes * (int)rf_dtype_size(k->acc_dtype) == WIDE_VECTOR_BYTES;
    for (int tier = wide ? 0 : 1; tier < 3; tier++) {
        int rows = tiers[tier];
        rfi_render_indent(R, depth);
        if (rows > 1)
            putf(R->sb, "for (; row%d + %d <= %s; row%d += %d) {\n", t->t, rows, end, t->t,
                 rows);
        else
            putf(R->sb, "for (; row%d < %s; row%d++) {\n", t->t, end, t->t);
        if (vectors)
            tile(R, t, out, rows, vectors, width, depth + 1);
        else
            col_loops(R, t, out, rows, depth + 1);
        rfi_render_indent(R, depth);
        put(R->sb, "}\n");
    }
    rfi_render_indent(R, depth - 1);
    put(R->sb, "}\n");
}

/* The rows outside the columns, as a convolution's features outside its
 * image rows; but where L follows T (a weight gradient's product), the
 * columns outside: a block of a's columns then stays in L1 for all rows (an
 * f64 [256,784] gradient over 64 rows: 560-610 us, 910 with rows outside). */
void rfi_render_tiled_body(rfi_render *R, bool *fold_live, bool *out_live)
{
    const rfi_kir_kernel *k = R->k;
    tiling t;
    rfi_render_fold_out_liveness(k, fold_live, out_live);
    if (!plan_tiles(k, fold_live, &t)) { /* the schedule asked rfi_render_tiles */
        R->sb->failed = true;
        return;
    }
    R->need |= RFI_NEED_TILES;
    rfi_render_open_outer_loops(R, t.t, false);
    if (t.t == t.l - 1)
        col_loops(R, &t, out_live, 0, 1 + t.t);
    else
        row_loops(R, &t, out_live, 0, 0, 1 + t.t);
    rfi_render_close_loops(R, 1, t.t);
    tiling_free(&t);
}
