/* pool.c: native f32/f64 kernels for the CALL FALLBACK steps that matter in
 * training: SELECT_AND_SCATTER (the max-pool gradient) and ARGMAX / ARGMIN
 * along one axis (accuracy metrics), replacing the reference kernels
 * (src/backend/interp/reduce.c) whose semantics they reproduce exactly:
 *
 *   SELECT_AND_SCATTER: each window (attr l[0] window, l[1] strides, l[2]
 *     pad_lo, l[3] pad_hi) selects its first maximum in row-major window
 *     order (NaN ranks above every number, so the first NaN wins; padding is
 *     never selected; a window of padding only selects nothing) and adds its
 *     source value there; unselected positions are 0. Sums are formed in
 *     double in source order and rounded once, as the reference does.
 *   ARGMAX / ARGMIN: first index of the extreme along attr i[0]; a NaN is the
 *     extreme of both (the first NaN, as NumPy and JAX).
 *
 * Leading dims that a select_and_scatter window does not span (window 1,
 * stride 1, no padding: batch and channels of a pooling) are collapsed into
 * independent planes that run in parallel on the runtime's pool. Windows that
 * do not overlap and have no padding (stride == window, the usual pooling)
 * take a fast path writing each selected value once (0 + v, so -0 becomes +0
 * as in the reference; one window gets one value, so no sum is formed). For
 * f32 2x2 windows over the last two dims (the usual max pooling) it works by
 * bands (one row of windows of one plane), in parallel over bands: it
 * selects for a group of windows at once, branch-free on integer keys, lanes
 * across windows so that the compiler vectorises, and writes each element
 * of the band itself (the selected value or 0; a row and a column no window
 * covers get 0) instead of zeroing the plane first. Other sizes and f64
 * select window by window into a zeroed plane. Windows over at most two dims
 * that overlap or reach into padding (3x3 stride 2 pad 1, 3x3 stride 1)
 * take the gather path (see its section): each window's choice recorded
 * first, then each element written once with the sum of the windows that
 * chose it. The remaining forms (windows over three dims or more)
 * accumulate window by window in double (f32: in the workspace).
 *
 * The non-overlapping f32 form and the gather path over [N, C, H, W] also
 * run with any of their tensors channel-blocked (plan.h:
 * rfi_cpu_native_take_layouts), window by window for 8 or 16 channels at
 * once.
 *
 * GATHER and SCATTER_ADD have their kernels in index_native.c, RNG in
 * rng_native.c; prepare hands them over and the result is run, named and
 * freed through it.
 *
 * Deliberately not here: integer dtypes, mixed dtypes (the services keep the
 * reference kernel for them), other FALLBACK ops.
 */
#include <string.h>

#include "../../runtime/threadpool.h"
#include "services.h"

#define PLANE_GRAIN_ELEMENTS 16384 /* elements a parallel chunk should at least cover */

typedef enum native_kind {
    NATIVE_SCATTER_FAST,
    NATIVE_SCATTER_GATHER,
    NATIVE_SCATTER_GENERAL,
    NATIVE_ARG,
    NATIVE_INDEX, /* GATHER / SCATTER_ADD: index_native.c's kernel in `index` */
    NATIVE_RNG    /* RNG: rng_native.c's kernel in `rng` */
} native_kind;

struct rfi_cpu_native {
    const rfi_node *node;
    native_kind kind;
    rfi_cpu_index *index; /* NATIVE_INDEX */
    rfi_cpu_rng *rng;     /* NATIVE_RNG */
    bool f64;      /* operands are f64 (else f32) */
    /* select_and_scatter: planes of x (and of the source) in front, then the
     * window dims: rank wr, per dim x extent, source extent, window, stride, pad_lo */
    int64_t planes, x_plane, src_plane;
    int wr;
    int64_t xd[RF_MAX_RANK], sd[RF_MAX_RANK], win[RF_MAX_RANK], stride[RF_MAX_RANK];
    int64_t lo[RF_MAX_RANK], xstep[RF_MAX_RANK];
    int64_t window_count;
    /* fast path by bands (f32, 2x2 windows): the plane's columns, the source
     * plane's rows x columns */
    bool banded;
    int64_t cols, src_rows, src_cols;
    int64_t *woff;  /* fast path: x offset of each window element from the window origin */
    int64_t *wpos;  /* general path: per window element, its index in each window dim */
    /* gather path: two window dims (rows, columns; a 1-D window is one row),
     * and per row and per column of x the first and one past the last window
     * row (column) containing it */
    int64_t g_rows, g_cols, g_src_rows, g_src_cols, g_win[2], g_stride[2], g_lo[2];
    int32_t *g_span; /* [2 * g_rows] then [2 * g_cols] */
    int64_t g_inner[2]; /* the windows of a row inside the columns: [g_inner[0], g_inner[1]) */
    int64_t g_top_at, g_acc_at, g_plane_bytes; /* a plane's scratch: codes, keys, sums */
    /* argmax / argmin */
    int64_t outer, len, inner;
    bool want_max, out_i64;
    /* fast path on [N, C, H, W] with some tensor channel-blocked (plan.h):
     * the operand's, the source's and the result's layouts */
    bool layouts;
    rfi_layout lay[3];
    int lanes; /* with layouts: the channels per block (8 or 16) */
};

const char *rfi_cpu_native_path(const rfi_cpu_native *k)
{
    switch (k->kind) {
    case NATIVE_SCATTER_FAST: return k->layouts ? "native-scatter-blocked" : "native-scatter-fast";
    case NATIVE_SCATTER_GATHER:
        return k->layouts ? "native-scatter-gather-blocked" : "native-scatter-gather";
    case NATIVE_SCATTER_GENERAL: return "native-scatter";
    case NATIVE_INDEX: return rfi_cpu_index_path(k->index);
    case NATIVE_RNG: return rfi_cpu_rng_path(k->rng);
    default: return "native-arg";
    }
}

/* a ranks above b: NaN above every number (the reference's rfi_gt_nan_max). */
static inline bool above_f(float a, float b) { return a != a ? b == b : (b == b && a > b); }
static inline bool above_d(double a, double b) { return a != a ? b == b : (b == b && a > b); }

/* ---- SELECT_AND_SCATTER ------------------------------------------------------------- */

typedef struct scatter_job {
    const rfi_cpu_native *k;
    const void *x, *src;
    void *out;
    double *acc; /* general path, f32: one double per x element */
} scatter_job;

/* Fast path, one plane: non-overlapping in-bounds windows. */
#define SCATTER_FAST(T, ABOVE)                                                               \
    static void scatter_fast_##T(const rfi_cpu_native *k, const T *x, const T *src, T *out) \
    {                                                                                        \
        memset(out, 0, (size_t)k->x_plane * sizeof(T));                                      \
        int64_t o[RF_MAX_RANK] = {0}, origin = 0;                                            \
        const int64_t *woff = k->woff;                                                       \
        for (int64_t s = 0; s < k->src_plane; s++) {                                         \
            int64_t best = origin + woff[0];                                                 \
            T top = x[best];                                                                 \
            for (int64_t j = 1; j < k->window_count; j++) {                                  \
                T v = x[origin + woff[j]];                                                   \
                if (ABOVE(v, top)) {                                                         \
                    top = v;                                                                 \
                    best = origin + woff[j];                                                 \
                }                                                                            \
            }                                                                                \
            out[best] = (T)0 + src[s];                                                       \
            for (int d = k->wr - 1; d >= 0; d--) {                                           \
                origin += k->stride[d] * k->xstep[d];                                        \
                if (++o[d] < k->sd[d])                                                       \
                    break;                                                                   \
                origin -= k->stride[d] * k->xstep[d] * k->sd[d];                             \
                o[d] = 0;                                                                    \
            }                                                                                \
        }                                                                                    \
    }
SCATTER_FAST(float, above_f)
SCATTER_FAST(double, above_d)

/* General path, one plane: padding skipped, sums in double into acc. */
#define SCATTER_GENERAL(T, ABOVE)                                                            \
    static void scatter_general_##T(const rfi_cpu_native *k, const T *x, const T *src,      \
                                    double *acc)                                             \
    {                                                                                        \
        memset(acc, 0, (size_t)k->x_plane * sizeof(double));                                 \
        int64_t o[RF_MAX_RANK] = {0};                                                        \
        for (int64_t s = 0; s < k->src_plane; s++) {                                         \
            int64_t selected = -1;                                                           \
            for (int64_t j = 0; j < k->window_count; j++) {                                  \
                const int64_t *w = k->wpos + j * k->wr;                                      \
                int64_t at = 0;                                                              \
                bool inside = true;                                                          \
                for (int d = 0; d < k->wr && inside; d++) {                                  \
                    int64_t p = o[d] * k->stride[d] + w[d] - k->lo[d];                       \
                    inside = p >= 0 && p < k->xd[d];                                         \
                    at += p * k->xstep[d];                                                   \
                }                                                                            \
                if (inside && (selected < 0 || ABOVE(x[at], x[selected])))                   \
                    selected = at;                                                           \
            }                                                                                \
            if (selected >= 0)                                                               \
                acc[selected] += (double)src[s];                                             \
            for (int d = k->wr - 1; d >= 0; d--) {                                           \
                if (++o[d] < k->sd[d])                                                       \
                    break;                                                                   \
                o[d] = 0;                                                                    \
            }                                                                                \
        }                                                                                    \
    }
SCATTER_GENERAL(float, above_f)
SCATTER_GENERAL(double, above_d)

/* Fast path by bands, for 2x2 windows on f32. A band is two rows of one
 * plane: one row of windows. A loop over its windows (the compiler's vector
 * lanes go across windows) finds each window's selected element: it visits
 * the four in row-major order and replaces its best key only by a greater
 * one, so the first maximum stays; then the window writes each of its
 * elements: the selected one 0 + source, the others 0 (the value's bits
 * under a mask). Keys, indices and bits are 32-bit integers like the values,
 * so that all lanes line up. The loop runs in groups of BAND_GROUP windows
 * with a pointer per row: a loop of known trip count whose stores provably
 * do not overlap, which compilers vectorise even at -O2. A band's last group
 * ends at its last window, redoing a few windows (same values) rather than
 * running a scalar remainder. The result never overlaps x or the source (a
 * step's results never share bytes with its inputs), hence restrict.
 *
 * Other window sizes and f64 stay window by window (SCATTER_FAST): written
 * this way they do not vectorise (strided loads of three or more; 64-bit
 * integer compares) and measured slower than that branch-free scalar code. */
#define BAND_GROUP 4 /* a multiple of the f32 vector lanes */

/* The reference's order as an integer key of the bits, without branches or
 * float compares, so that loops over it vectorise: numbers map monotonically
 * from their sign-magnitude bits (-0 and +0 both to 0, so they tie as in the
 * reference), every NaN to the largest key. */
static inline int32_t rank_key(const float *p)
{
    uint32_t bits;
    memcpy(&bits, p, sizeof bits);
    int32_t magnitude = (int32_t)(bits & 0x7fffffffu);
    int32_t negative = -(int32_t)(bits >> 31); /* all ones or 0 */
    int32_t key = (magnitude ^ negative) - negative;
    return magnitude > 0x7f800000 ? INT32_MAX : key;
}

/* *top, *sel = key, e where key > *top: masks rather than conditionals, which
 * compilers may turn into branches that random data mispredicts. */
static inline void raise_to(int32_t *top, int32_t *sel, int32_t key, int32_t e)
{
    int32_t up = -(int32_t)(key > *top); /* all ones or 0 */
    *top = (key & up) | (*top & ~up);
    *sel = (e & up) | (*sel & ~up);
}

/* *p = bits where element e is the selected one, else 0. */
static inline void put_selected(float *p, uint32_t bits, int32_t sel, int32_t e)
{
    bits &= 0u - (uint32_t)(sel == e); /* all ones or 0 */
    memcpy(p, &bits, sizeof bits);
}

/* n 2x2 windows: rows x0, x1 of x and o0, o1 of the result. */
static inline void windows_2x2(const float *restrict x0, const float *restrict x1,
                               const float *restrict src, float *restrict o0,
                               float *restrict o1, int64_t n)
{
    for (int64_t c = 0; c < n; c++) {
        int32_t top = rank_key(&x0[2 * c]), sel = 0;
        raise_to(&top, &sel, rank_key(&x0[2 * c + 1]), 1);
        raise_to(&top, &sel, rank_key(&x1[2 * c]), 2);
        raise_to(&top, &sel, rank_key(&x1[2 * c + 1]), 3);
        float v = 0.0f + src[c];
        uint32_t bits;
        memcpy(&bits, &v, sizeof bits);
        put_selected(&o0[2 * c], bits, sel, 0);
        put_selected(&o0[2 * c + 1], bits, sel, 1);
        put_selected(&o1[2 * c], bits, sel, 2);
        put_selected(&o1[2 * c + 1], bits, sel, 3);
    }
}

static inline void group_2x2(const float *x, const float *src, float *out, int64_t cols)
{
    windows_2x2(x, x + cols, src, out, out + cols, BAND_GROUP);
}

/* One band: x, src, out at its first row; the column right of its last
 * window, if any, gets 0. */
static void band_2x2(const float *x, const float *src, float *out, int64_t cols, int64_t src_cols)
{
    if (src_cols < BAND_GROUP) {
        windows_2x2(x, x + cols, src, out, out + cols, src_cols);
    } else {
        int64_t c = 0;
        for (; c + BAND_GROUP <= src_cols; c += BAND_GROUP)
            group_2x2(x + 2 * c, src + c, out + 2 * c, cols);
        if (c < src_cols) {
            c = src_cols - BAND_GROUP;
            group_2x2(x + 2 * c, src + c, out + 2 * c, cols);
        }
    }
    if (2 * src_cols < cols) {
        out[cols - 1] = 0.0f;
        out[2 * cols - 1] = 0.0f;
    }
}

/* Bands [lo, hi) of all planes, plane-major; the last band of a plane also
 * zeroes the row below it, if any. */
static void scatter_band_range(void *ctx, int64_t lo, int64_t hi)
{
    const scatter_job *job = ctx;
    const rfi_cpu_native *k = job->k;
    const float *x = job->x, *src = job->src;
    float *out = job->out;
    int64_t band_x = 2 * k->cols, covered = k->src_rows * band_x;
    int64_t p = lo / k->src_rows, r = lo % k->src_rows;
    for (int64_t b = lo; b < hi; b++) {
        int64_t xo = p * k->x_plane + r * band_x;
        band_2x2(x + xo, src + p * k->src_plane + r * k->src_cols, out + xo, k->cols,
                 k->src_cols);
        if (++r == k->src_rows) {
            if (covered < k->x_plane)
                memset(out + p * k->x_plane + covered, 0,
                       (size_t)(k->x_plane - covered) * sizeof(float));
            r = 0;
            p++;
        }
    }
}

static void scatter_planes(void *ctx, int64_t lo, int64_t hi)
{
    const scatter_job *job = ctx;
    const rfi_cpu_native *k = job->k;
    for (int64_t p = lo; p < hi; p++) {
        int64_t xo = p * k->x_plane, so = p * k->src_plane;
        if (k->f64) {
            const double *x = (const double *)job->x + xo, *src = (const double *)job->src + so;
            double *out = (double *)job->out + xo;
            if (k->kind == NATIVE_SCATTER_FAST)
                scatter_fast_double(k, x, src, out);
            else
                scatter_general_double(k, x, src, out);
        } else {
            const float *x = (const float *)job->x + xo, *src = (const float *)job->src + so;
            float *out = (float *)job->out + xo;
            if (k->kind == NATIVE_SCATTER_FAST) {
                scatter_fast_float(k, x, src, out);
            } else {
                double *acc = job->acc + xo;
                scatter_general_float(k, x, src, acc);
                for (int64_t i = 0; i < k->x_plane; i++)
                    out[i] = (float)acc[i];
            }
        }
    }
}

/* The banded path takes f32 2x2 windows over the last two dims, with at
 * most one uncovered row and column (what the shape rule gives for stride 2;
 * anything else keeps the window-by-window path). */
static void band_shape(rfi_cpu_native *k)
{
    k->banded = !k->f64 && k->wr == 2 && k->win[0] == 2 && k->win[1] == 2 &&
                k->xd[0] - 2 * k->sd[0] < 2 && k->xd[1] - 2 * k->sd[1] < 2;
    if (!k->banded)
        return;
    k->cols = k->xd[1];
    k->src_rows = k->sd[0];
    k->src_cols = k->sd[1];
}

/* Splits x's dims into leading planes (dims no window spans) and window dims. */
static bool scatter_shape(rfi_cpu_native *k, const rfi_node *n)
{
    const rfi_node *x = n->in[0], *src = n->in[1];
    const rfi_attrs *at = &n->attr;
    if (src->rank != x->rank || n->rank != x->rank)
        return false;
    int lead = 0;
    while (lead < x->rank && at->l[0][lead] == 1 && at->l[1][lead] == 1 && at->l[2][lead] == 0 &&
           at->l[3][lead] == 0 && src->dims[lead] == x->dims[lead])
        lead++;
    k->planes = rfi_numel(x->dims, lead);
    k->wr = x->rank - lead;
    bool fast = true;
    int64_t step = 1;
    for (int d = k->wr - 1; d >= 0; d--) {
        int xd = lead + d;
        k->xd[d] = x->dims[xd];
        k->sd[d] = src->dims[xd];
        k->win[d] = at->l[0][xd];
        k->stride[d] = at->l[1][xd];
        k->lo[d] = at->l[2][xd];
        k->xstep[d] = step;
        step *= x->dims[xd];
        if (k->win[d] < 1 || k->stride[d] < 1)
            return false;
        fast &= k->stride[d] == k->win[d] && at->l[2][xd] == 0 && at->l[3][xd] == 0 &&
                k->sd[d] * k->stride[d] <= k->xd[d];
    }
    k->x_plane = step;
    k->src_plane = rfi_numel(k->sd, k->wr);
    k->window_count = rfi_numel(k->win, k->wr);
    k->kind = fast && k->window_count > 0 ? NATIVE_SCATTER_FAST : NATIVE_SCATTER_GENERAL;
    if (k->kind == NATIVE_SCATTER_FAST)
        band_shape(k);
    return true;
}

/* The window element tables: offsets (fast) or per-dim indices (general). */
static bool scatter_tables(rfi_cpu_native *k)
{
    int64_t count = k->window_count > 0 ? k->window_count : 1;
    k->woff = rfi_calloc((size_t)count, sizeof(int64_t));
    k->wpos = rfi_calloc((size_t)count * (size_t)(k->wr > 0 ? k->wr : 1), sizeof(int64_t));
    if (!k->woff || !k->wpos)
        return false;
    int64_t w[RF_MAX_RANK] = {0};
    for (int64_t j = 0; j < k->window_count; j++) {
        int64_t off = 0;
        for (int d = 0; d < k->wr; d++) {
            off += w[d] * k->xstep[d];
            k->wpos[j * k->wr + d] = w[d];
        }
        k->woff[j] = off;
        for (int d = k->wr - 1; d >= 0; d--) {
            if (++w[d] < k->win[d])
                break;
            w[d] = 0;
        }
    }
    return true;
}

/* ---- The fast path over channel-blocked tensors -------------------------------------- *
 * Non-overlapping windows over the last two dims of [N, C, H, W] tensors any
 * of which may be channel-blocked (all with the same block of B = 8 or 16
 * channels). Work items are (image, B-channel block) pairs; inside one,
 * every window is selected for B channels at once (the lanes: contiguous in
 * a blocked tensor), and every element of the result's block is written
 * (the selected value, or 0). */

#define MAX_LANES 16 /* the widest channel block */

typedef struct lane_map {
    int64_t item, lane, row, col; /* element strides: per work item, channel, row, column */
} lane_map;

static lane_map lanes_of(rfi_layout l, int64_t block, int64_t rows, int64_t cols)
{
    if (rfi_layout_blocked(l))
        return (lane_map){rows * cols * block, 1, cols * block, block};
    return (lane_map){rows * cols * block, rows * cols, cols, 1};
}

typedef struct blocked_job {
    const rfi_cpu_native *k;
    const float *x, *src;
    float *out;
    lane_map xm, sm, om;
} blocked_job;

static void blocked_window(const blocked_job *j, const float *x, const float *src, float *out)
{
    const rfi_cpu_native *k = j->k;
    const int L = k->lanes;
    float best[MAX_LANES], val[MAX_LANES];
    int32_t sel[MAX_LANES];
    for (int l = 0; l < L; l++) {
        best[l] = x[l * j->xm.lane];
        sel[l] = 0;
    }
    for (int64_t e = 1; e < k->window_count; e++) {
        const float *p = x + (e / k->win[1]) * j->xm.row + (e % k->win[1]) * j->xm.col;
        for (int l = 0; l < L; l++) {
            float v = p[l * j->xm.lane];
            bool up = above_f(v, best[l]);
            best[l] = up ? v : best[l];
            sel[l] = up ? (int32_t)e : sel[l];
        }
    }
    for (int l = 0; l < L; l++)
        val[l] = 0.0f + src[l * j->sm.lane]; /* -0 becomes +0, as the reference's sum */
    for (int64_t e = 0; e < k->window_count; e++) {
        float *p = out + (e / k->win[1]) * j->om.row + (e % k->win[1]) * j->om.col;
        for (int l = 0; l < L; l++)
            p[l * j->om.lane] = sel[l] == e ? val[l] : 0.0f;
    }
}

/* The usual case: 2x2 windows, operand and result blocked (L contiguous
 * lanes per position), branch-free on integer keys as windows_2x2 so that
 * the lanes vectorise (L a constant where it is inlined). */
static inline void blocked_window_2x2(const blocked_job *j, const int L, const float *restrict x,
                                      const float *restrict src, float *restrict out)
{
    const float *restrict x1 = x + j->xm.row;
    float *restrict out1 = out + j->om.row;
    uint32_t val[MAX_LANES];
    if (j->sm.lane == 1)
        for (int l = 0; l < L; l++) {
            float v = 0.0f + src[l]; /* -0 becomes +0, as the reference's sum */
            memcpy(&val[l], &v, sizeof v);
        }
    else
        for (int l = 0; l < L; l++) {
            float v = 0.0f + src[l * j->sm.lane];
            memcpy(&val[l], &v, sizeof v);
        }
    for (int l = 0; l < L; l++) {
        int32_t top = rank_key(&x[l]), sel = 0;
        raise_to(&top, &sel, rank_key(&x[L + l]), 1);
        raise_to(&top, &sel, rank_key(&x1[l]), 2);
        raise_to(&top, &sel, rank_key(&x1[L + l]), 3);
        put_selected(&out[l], val[l], sel, 0);
        put_selected(&out[L + l], val[l], sel, 1);
        put_selected(&out1[l], val[l], sel, 2);
        put_selected(&out1[L + l], val[l], sel, 3);
    }
}

static void zero_lanes(float *p, const lane_map *m, int lanes)
{
    for (int l = 0; l < lanes; l++)
        p[l * m->lane] = 0.0f;
}

/* blocked_window_2x2 with its lane count known to the compiler. */
static void blocked_window_2x2_8(const blocked_job *j, const float *x, const float *src,
                                 float *out)
{
    blocked_window_2x2(j, 8, x, src, out);
}

static void blocked_window_2x2_16(const blocked_job *j, const float *x, const float *src,
                                  float *out)
{
    blocked_window_2x2(j, 16, x, src, out);
}

static void blocked_items(void *ctx, int64_t lo, int64_t hi)
{
    const blocked_job *j = ctx;
    const rfi_cpu_native *k = j->k;
    const int64_t L = k->lanes;
    void (*window_2x2)(const blocked_job *, const float *, const float *, float *) =
        L == 8 ? blocked_window_2x2_8 : blocked_window_2x2_16;
    int64_t wh = k->win[0], ww = k->win[1], rows = k->sd[0] * wh, cols = k->sd[1] * ww;
    bool fast = wh == 2 && ww == 2 && j->xm.lane == 1 && j->om.lane == 1;
    for (int64_t it = lo; it < hi; it++) {
        const float *x = j->x + it * j->xm.item, *src = j->src + it * j->sm.item;
        float *out = j->out + it * j->om.item;
        for (int64_t a = 0; a < k->sd[0]; a++)
            for (int64_t b = 0; b < k->sd[1]; b++)
                if (fast)
                    window_2x2(j, x + a * 2 * j->xm.row + b * 2 * L,
                               src + a * j->sm.row + b * j->sm.col,
                               out + a * 2 * j->om.row + b * 2 * L);
                else
                    blocked_window(j, x + a * wh * j->xm.row + b * ww * j->xm.col,
                                   src + a * j->sm.row + b * j->sm.col,
                                   out + a * wh * j->om.row + b * ww * j->om.col);
        for (int64_t h = 0; h < k->xd[0]; h++) /* what no window covers */
            for (int64_t w = h < rows ? cols : 0; w < k->xd[1]; w++)
                zero_lanes(out + h * j->om.row + w * j->om.col, &j->om, k->lanes);
    }
}

static int64_t grain_for(int64_t per_item);

/* The work item stride of a plain tensor is B channels' planes; that of a
 * blocked one its block: the same count of elements, so one item index
 * addresses all three. */
static void run_blocked(const rfi_cpu_native *k, const float *x, const float *src, float *out)
{
    const rfi_node *n = k->node;
    int64_t c = n->dims[1];
    int64_t b = k->lanes;
    blocked_job job = {k, x, src, out, lanes_of(k->lay[0], b, k->xd[0], k->xd[1]),
                       lanes_of(k->lay[1], b, k->sd[0], k->sd[1]),
                       lanes_of(k->lay[2], b, k->xd[0], k->xd[1])};
    int64_t items = n->dims[0] * (c / b);
    rfi_parallel_for(items, grain_for(k->x_plane * b), blocked_items, &job);
}

bool rfi_cpu_native_take_layouts(rfi_cpu_native *k, const rfi_layout lay[3])
{
    int block = 0;
    for (int t = 0; t < 3; t++) {
        if (lay[t] == RFI_LAYOUT_NHWC)
            return false; /* channels last: the services reorder */
        if (rfi_layout_blocked(lay[t])) {
            if (block && block != rfi_layout_block(lay[t]))
                return false;
            block = rfi_layout_block(lay[t]);
        }
    }
    if (!block)
        return true;
    const rfi_node *n = k->node;
    if ((k->kind != NATIVE_SCATTER_FAST && k->kind != NATIVE_SCATTER_GATHER) || k->f64 ||
        n->rank != 4 || k->wr != 2 || n->dims[1] % block != 0)
        return false;
    k->lanes = block;
    k->layouts = true;
    memcpy(k->lay, lay, sizeof k->lay);
    return true;
}

/* ---- The gather path: overlapping or padded windows ---------------------------------- *
 * Windows over at most two dims (rows and columns; a 1-D window is one row)
 * that overlap or reach into padding (the ImageNet stem's 3x3 stride 2 pad 1
 * max pool), f32 and f64, plain or (f32 [N, C, H, W]) channel-blocked. A
 * work item is a plane (plain) or an (image, channel block) pair (blocked:
 * its L channels are lanes, contiguous), with scratch of its own in the
 * workspace. Per item, two passes:
 *   1. select: each window's selected element, the first maximum of its
 *      in-bounds elements in row-major window order (padding is never
 *      selected; a window of padding only selects nothing, -1), as its index
 *      in the plane: an i32 code. Branch-free on the integer keys of
 *      rank_key, visiting each window's elements in row-major order and
 *      keeping the first of equal keys. Plain planes run a row of windows at
 *      once for each window element (the lanes go across windows, as in the
 *      2x2 bands; the windows that reach into the padding at either end of
 *      the row one by one); blocked items a window at once for L lanes.
 *   2. spread: each element of x gets the sum, in double and from +0, of the
 *      source values of the windows that selected it, in source order, and
 *      is written once, rounded once: a gather over the windows containing
 *      it (at most ceil(window / stride) per dim, from tables made once),
 *      adding +0 for a window that selected another element (which changes
 *      no sum from +0) so that it runs branch-free on vectors. A plain plane
 *      goes by rows of x and, in a row, by column phase (columns p, p + s,
 *      p + 2s, ... for stride s): the window offsets holding such a column
 *      are the same for all of them, so each offset is one pass over
 *      consecutive windows (8 at a time on f32) into a row of double sums.
 *      A blocked item goes element by element, 8 lanes at a time.
 * Those are the reference's sums term for term, so the result is bitwise the
 * reference's; no element is written twice (nothing zeroed first, no
 * atomics, the same result for any split of the items between threads). On
 * ResNet-18's stem pool gradient at 112x112 inputs, batch 8 ([8, 64, 56, 56],
 * 3x3 stride 2 pad 1) on one AVX2 core: 5.2-5.5 ms plain and 2.9-3.0 ms
 * channel-blocked, against 18.7-20.0 ms for the general path (window by
 * window into a zeroed plane of doubles), which took no blocked operands. */

/* rank_key for f64: the same order as a 64-bit integer key. */
static inline int64_t rank_key_d(const double *p)
{
    uint64_t bits;
    memcpy(&bits, p, sizeof bits);
    int64_t magnitude = (int64_t)(bits & 0x7fffffffffffffffu);
    int64_t negative = -(int64_t)(bits >> 63); /* all ones or 0 */
    int64_t key = (magnitude ^ negative) - negative;
    return magnitude > 0x7ff0000000000000 ? INT64_MAX : key;
}

/* raise_to on 64-bit keys. */
static inline void raise_to_d(int64_t *top, int32_t *sel, int64_t key, int32_t e)
{
    int64_t up = -(int64_t)(key > *top); /* all ones or 0 */
    *top = (key & up) | (*top & ~up);
    *sel = (e & (int32_t)up) | (*sel & ~(int32_t)up);
}

/* v where code is e, else +0, without a branch. */
static inline double selected_or_zero(double v, int32_t code, int32_t e)
{
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    bits &= 0u - (uint64_t)(code == e); /* all ones or 0 */
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* floor(a / b) for b > 0. */
static inline int64_t floor_div(int64_t a, int64_t b)
{
    return a >= 0 ? a / b : -((-a + b - 1) / b);
}

/* Below every key (rank_key's least is -inf's): a window's first element
 * always replaces it. */
#define KEY_NONE_F INT32_MIN
#define KEY_NONE_D INT64_MIN

/* 8 lanes as GCC vectors: one AVX2 register of keys or f32 values, two of
 * double sums. */
typedef int32_t v8i __attribute__((vector_size(8 * sizeof(int32_t))));
typedef float v8f __attribute__((vector_size(8 * sizeof(float))));
typedef float v4f __attribute__((vector_size(4 * sizeof(float))));
typedef double v4d __attribute__((vector_size(4 * sizeof(double))));
/* The same in memory at any element alignment. */
typedef int32_t v8i_mem __attribute__((vector_size(8 * sizeof(int32_t)), aligned(4), may_alias));
typedef float v8f_mem __attribute__((vector_size(8 * sizeof(float)), aligned(4), may_alias));
typedef double v4d_mem __attribute__((vector_size(4 * sizeof(double)), aligned(8), may_alias));

/* Vectors pass through macros, not functions (a vector argument's ABI
 * differs between the clones). LOAD8: 8 lanes at p; RANK_KEYS: rank_key
 * of 8 lanes of f32 bits; WIDEN: lanes 4 * half .. 4 * half + 3 of f32
 * bits as doubles. */
#define LOAD8(p) (*(const v8i_mem *)(const void *)(p))
#define RANK_KEYS(key, bits)                                                                 \
    do {                                                                                     \
        v8i magnitude_ = (bits) & 0x7fffffff;                                                \
        v8i negative_ = (bits) >> 31; /* all ones or 0 */                                    \
        v8i nan_ = magnitude_ > 0x7f800000;                                                  \
        (key) = (nan_ & INT32_MAX) | (~nan_ & ((magnitude_ ^ negative_) - negative_));       \
    } while (0)
#define WIDEN(bits, half)                                                                    \
    __builtin_convertvector(__builtin_shufflevector((v8f)(bits), (v8f)(bits), 4 * (half),       \
                                                    4 * (half) + 1, 4 * (half) + 2,           \
                                                    4 * (half) + 3),                          \
                            v4d)

/* Pass 2 of a plain plane, one window offset: acc[m] += v[m] where the
 * window m chose element e + m * s, for m in [m0, m1) (code and v are
 * offset so that index m is window m + t). */
static inline __attribute__((always_inline)) void spread_double(double *restrict acc,
                                                                const int32_t *code,
                                                                const double *v, int64_t m0,
                                                                int64_t m1, int32_t e, int64_t s)
{
    for (int64_t m = m0; m < m1; m++)
        acc[m] += selected_or_zero(v[m], code[m], e + (int32_t)(m * s));
}

/* As spread_double, 8 windows at a time: lanes of f32 bits under the
 * comparison's mask (+0 where another element was chosen), widened. */
static inline __attribute__((always_inline)) void spread_float(double *restrict acc,
                                                               const int32_t *code,
                                                               const float *v, int64_t m0,
                                                               int64_t m1, int32_t e, int64_t s)
{
    int64_t m = m0;
    v8i step = {0, 1, 2, 3, 4, 5, 6, 7};
    step *= (int32_t)s;
    for (; m + 8 <= m1; m += 8) {
        v8i bits = LOAD8(v + m) & (LOAD8(code + m) == (e + (int32_t)(m * s)) + step);
        *(v4d_mem *)(acc + m) += WIDEN(bits, 0);
        *(v4d_mem *)(acc + m + 4) += WIDEN(bits, 1);
    }
    for (; m < m1; m++)
        acc[m] += selected_or_zero((double)v[m], code[m], e + (int32_t)(m * s));
}

/* The passes are compiled for x86-64-v3 and the baseline, chosen once at
 * load time (as winograd.c's jobs). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GATHER_JOB __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define GATHER_JOB
#endif

/* Per plain plane: pass 1 by rows of windows, pass 2 by rows of x. scratch
 * holds the codes, a row of keys and a row of sums by phase (gather_shape). */
#define GATHER_PLANE(T, K, KEY_NONE, KEY, RAISE)                                             \
    static inline void across_##T(const T *restrict p, const int64_t s, int64_t n, int32_t e, \
                                  K *restrict top, int32_t *restrict sel)                    \
    {                                                                                        \
        for (int64_t b = 0; b < n; b++)                                                      \
            RAISE(&top[b], &sel[b], KEY(&p[b * s]), e + (int32_t)(b * s));                   \
    }                                                                                        \
    GATHER_JOB static void gather_plane_##T(const rfi_cpu_native *k, const T *x,             \
                                            const T *src, T *out, unsigned char *scratch)    \
    {                                                                                        \
        const int64_t rows = k->g_rows, cols = k->g_cols, src_cols = k->g_src_cols;          \
        const int64_t s = k->g_stride[1], lo = k->g_lo[1], kw = k->g_win[1];                 \
        const int64_t in0 = k->g_inner[0], in1 = k->g_inner[1];                              \
        int32_t *codes = (int32_t *)scratch;                                                 \
        K *top = (K *)(scratch + k->g_top_at);                                               \
        double *acc = (double *)(scratch + k->g_acc_at);                                     \
        for (int64_t a = 0; a < k->g_src_rows; a++) {                                        \
            int64_t r0 = a * k->g_stride[0] - k->g_lo[0], r1 = r0 + k->g_win[0];             \
            int64_t rlo = r0 > 0 ? r0 : 0, rhi = r1 < rows ? r1 : rows;                      \
            int32_t *sel = codes + a * src_cols;                                             \
            for (int64_t b = 0; b < src_cols; b++) {                                         \
                top[b] = KEY_NONE;                                                           \
                sel[b] = -1;                                                                 \
            }                                                                                \
            for (int64_t h = rlo; h < rhi; h++) {                                            \
                const T *row = x + h * cols;                                                 \
                int32_t e = (int32_t)(h * cols);                                             \
                for (int64_t dw = 0; dw < kw && in0 < in1; dw++) {                           \
                    int64_t c = in0 * s - lo + dw;                                           \
                    if (s == 1)                                                              \
                        across_##T(row + c, 1, in1 - in0, e + (int32_t)c, top + in0,         \
                                   sel + in0);                                               \
                    else if (s == 2)                                                         \
                        across_##T(row + c, 2, in1 - in0, e + (int32_t)c, top + in0,         \
                                   sel + in0);                                               \
                    else                                                                     \
                        across_##T(row + c, s, in1 - in0, e + (int32_t)c, top + in0,         \
                                   sel + in0);                                               \
                }                                                                            \
                for (int64_t b = 0; b < src_cols; b++) {                                     \
                    if (b == in0 && in0 < in1) { /* done above */                            \
                        b = in1 - 1;                                                         \
                        continue;                                                            \
                    }                                                                        \
                    int64_t c0 = b * s - lo, c1 = c0 + kw;                                   \
                    for (int64_t w = c0 > 0 ? c0 : 0; w < (c1 < cols ? c1 : cols); w++)      \
                        RAISE(&top[b], &sel[b], KEY(&row[w]), e + (int32_t)w);               \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        const int32_t *rspan = k->g_span;                                                    \
        const int64_t phase = (cols + s - 1) / s; /* acc: s rows of phase columns */         \
        for (int64_t h = 0; h < rows; h++) {                                                 \
            for (int64_t i = 0; i < s * phase; i++)                                          \
                acc[i] = 0.0;                                                                \
            for (int64_t a = rspan[2 * h]; a < rspan[2 * h + 1]; a++) {                      \
                const int32_t *code = codes + a * src_cols;                                  \
                const T *v = src + a * src_cols;                                             \
                for (int64_t p = 0; p < s && p < cols; p++) {                                \
                    int64_t n = (cols - p + s - 1) / s;                                      \
                    int32_t e = (int32_t)(h * cols + p);                                     \
                    /* window m + t holds column m * s + p at p + lo - t * s */              \
                    for (int64_t t = floor_div(p + lo - kw, s) + 1; t <= (p + lo) / s; t++) { \
                        int64_t m0 = t < 0 ? -t : 0, m1 = src_cols - t < n ? src_cols - t : n; \
                        spread_##T(acc + p * phase, code + t, v + t, m0, m1, e, s);          \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
            T *o = out + h * cols;                                                           \
            for (int64_t p = 0; p < s && p < cols; p++)                                      \
                for (int64_t m = 0; m * s + p < cols; m++)                                   \
                    o[m * s + p] = (T)acc[p * phase + m];                                    \
        }                                                                                    \
    }
GATHER_PLANE(float, int32_t, KEY_NONE_F, rank_key, raise_to)
GATHER_PLANE(double, int64_t, KEY_NONE_D, rank_key_d, raise_to_d)

typedef struct gather_job {
    const rfi_cpu_native *k;
    const void *x, *src;
    void *out;
    unsigned char *scratch;
    lane_map xm, sm, om; /* blocked items */
} gather_job;

/* One f32 item of L lanes whose lane strides in x, the source and the result
 * are xl, sl and ol: some blocked, some plain. */
static inline void gather_lanes(const gather_job *j, const int L, const int64_t xl,
                                const int64_t sl, const int64_t ol, const float *x,
                                const float *src, float *out, int32_t *codes)
{
    const rfi_cpu_native *k = j->k;
    const int64_t rows = k->g_rows, cols = k->g_cols, src_cols = k->g_src_cols;
    int32_t best[MAX_LANES], sel[MAX_LANES];
    for (int64_t a = 0; a < k->g_src_rows; a++) {
        int64_t r0 = a * k->g_stride[0] - k->g_lo[0], r1 = r0 + k->g_win[0];
        int64_t rlo = r0 > 0 ? r0 : 0, rhi = r1 < rows ? r1 : rows;
        for (int64_t b = 0; b < src_cols; b++) {
            int64_t c0 = b * k->g_stride[1] - k->g_lo[1], c1 = c0 + k->g_win[1];
            int64_t clo = c0 > 0 ? c0 : 0, chi = c1 < cols ? c1 : cols;
            for (int l = 0; l < L; l++) {
                best[l] = KEY_NONE_F;
                sel[l] = -1;
            }
            for (int64_t h = rlo; h < rhi; h++)
                for (int64_t w = clo; w < chi; w++) {
                    const float *p = x + h * j->xm.row + w * j->xm.col;
                    int32_t e = (int32_t)(h * cols + w);
                    for (int l = 0; l < L; l++)
                        raise_to(&best[l], &sel[l], rank_key(&p[l * xl]), e);
                }
            int32_t *code = codes + (a * src_cols + b) * L;
            for (int l = 0; l < L; l++)
                code[l] = sel[l];
        }
    }
    const int32_t *rspan = k->g_span, *cspan = k->g_span + 2 * rows;
    double acc[MAX_LANES];
    for (int64_t h = 0; h < rows; h++)
        for (int64_t w = 0; w < cols; w++) {
            int32_t e = (int32_t)(h * cols + w);
            for (int l = 0; l < L; l++)
                acc[l] = 0.0;
            for (int64_t a = rspan[2 * h]; a < rspan[2 * h + 1]; a++)
                for (int64_t b = cspan[2 * w]; b < cspan[2 * w + 1]; b++) {
                    const int32_t *code = codes + (a * src_cols + b) * L;
                    const float *v = src + a * j->sm.row + b * j->sm.col;
                    for (int l = 0; l < L; l++)
                        acc[l] += code[l] == e ? (double)v[l * sl] : 0.0;
                }
            float *o = out + h * j->om.row + w * j->om.col;
            for (int l = 0; l < L; l++)
                o[l * ol] = (float)acc[l];
        }
}

/* One blocked f32 item of L lanes (8 or 16), contiguous in x, the source
 * and the result, 8 at a time. */
GATHER_JOB static void gather_lanes_v8(const gather_job *j, const int64_t L, const float *x,
                                       const float *src, float *out, int32_t *codes)
{
    const rfi_cpu_native *k = j->k;
    const int64_t rows = k->g_rows, cols = k->g_cols, src_cols = k->g_src_cols;
    for (int64_t a = 0; a < k->g_src_rows; a++) {
        int64_t r0 = a * k->g_stride[0] - k->g_lo[0], r1 = r0 + k->g_win[0];
        int64_t rlo = r0 > 0 ? r0 : 0, rhi = r1 < rows ? r1 : rows;
        for (int64_t b = 0; b < src_cols; b++) {
            int64_t c0 = b * k->g_stride[1] - k->g_lo[1], c1 = c0 + k->g_win[1];
            int64_t clo = c0 > 0 ? c0 : 0, chi = c1 < cols ? c1 : cols;
            for (int64_t g = 0; g < L; g += 8) {
                v8i top = {INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN,
                           INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN};
                v8i sel = {-1, -1, -1, -1, -1, -1, -1, -1};
                for (int64_t h = rlo; h < rhi; h++)
                    for (int64_t w = clo; w < chi; w++) {
                        v8i bits = LOAD8(x + h * j->xm.row + w * j->xm.col + g), key;
                        RANK_KEYS(key, bits);
                        v8i up = key > top;
                        top = (key & up) | (top & ~up);
                        sel = ((int32_t)(h * cols + w) & up) | (sel & ~up);
                    }
                *(v8i_mem *)(codes + (a * src_cols + b) * L + g) = sel;
            }
        }
    }
    const int32_t *rspan = k->g_span, *cspan = k->g_span + 2 * rows;
    for (int64_t h = 0; h < rows; h++)
        for (int64_t w = 0; w < cols; w++) {
            int32_t e = (int32_t)(h * cols + w);
            for (int64_t g = 0; g < L; g += 8) {
                v4d lo = {0.0, 0.0, 0.0, 0.0}, hi = lo;
                for (int64_t a = rspan[2 * h]; a < rspan[2 * h + 1]; a++)
                    for (int64_t b = cspan[2 * w]; b < cspan[2 * w + 1]; b++) {
                        v8i code = LOAD8(codes + (a * src_cols + b) * L + g);
                        v8i v = LOAD8(src + a * j->sm.row + b * j->sm.col + g);
                        v &= code == e; /* +0 where another element was selected */
                        lo += WIDEN(v, 0);
                        hi += WIDEN(v, 1);
                    }
                v4f lo_f = __builtin_convertvector(lo, v4f);
                v4f hi_f = __builtin_convertvector(hi, v4f);
                *(v8f_mem *)(out + h * j->om.row + w * j->om.col + g) =
                    __builtin_shufflevector(lo_f, hi_f, 0, 1, 2, 3, 4, 5, 6, 7);
            }
        }
}

static void gather_items(void *ctx, int64_t lo, int64_t hi)
{
    const gather_job *j = ctx;
    const rfi_cpu_native *k = j->k;
    for (int64_t it = lo; it < hi; it++) {
        if (!k->layouts) {
            unsigned char *scratch = j->scratch + it * k->g_plane_bytes;
            if (k->f64)
                gather_plane_double(k, (const double *)j->x + it * k->x_plane,
                                    (const double *)j->src + it * k->src_plane,
                                    (double *)j->out + it * k->x_plane, scratch);
            else
                gather_plane_float(k, (const float *)j->x + it * k->x_plane,
                                   (const float *)j->src + it * k->src_plane,
                                   (float *)j->out + it * k->x_plane, scratch);
            continue;
        }
        int32_t *codes = (int32_t *)(j->scratch + it * k->lanes * k->g_plane_bytes);
        const float *x = (const float *)j->x + it * j->xm.item;
        const float *src = (const float *)j->src + it * j->sm.item;
        float *out = (float *)j->out + it * j->om.item;
        if (j->xm.lane == 1 && j->sm.lane == 1 && j->om.lane == 1)
            gather_lanes_v8(j, k->lanes, x, src, out, codes);
        else
            gather_lanes(j, k->lanes, j->xm.lane, j->sm.lane, j->om.lane, x, src, out, codes);
    }
}

static void run_gather(const rfi_cpu_native *k, const void *x, const void *src, void *out,
                       void *workspace)
{
    gather_job job = {k, x, src, out, workspace, {0}, {0}, {0}};
    int64_t items = k->planes, b = 1;
    if (k->layouts) {
        b = k->lanes;
        items = k->planes / b;
        job.xm = lanes_of(k->lay[0], b, k->g_rows, k->g_cols);
        job.sm = lanes_of(k->lay[1], b, k->g_src_rows, k->g_src_cols);
        job.om = lanes_of(k->lay[2], b, k->g_rows, k->g_cols);
    }
    rfi_parallel_for(items, grain_for(k->x_plane * b), gather_items, &job);
}

/* Sets up the gather path for windows over at most two dims whose plane
 * indices fit an i32: the span of window rows containing each row of x and
 * of window columns containing each column, the windows of a row that lie
 * inside the columns, and the scratch of a plane (its codes, a row of keys
 * and a row of sums, rounded up to whole phases). False: out of memory. */
static bool gather_shape(rfi_cpu_native *k)
{
    if (k->wr < 1 || k->wr > 2 || k->x_plane >= INT32_MAX || k->src_plane == 0)
        return true;
    int off = 2 - k->wr; /* a 1-D window is one row */
    int64_t ext[2] = {1, 1}, src_ext[2] = {1, 1};
    k->g_win[0] = k->g_stride[0] = 1;
    k->g_lo[0] = 0;
    for (int d = 0; d < k->wr; d++) {
        ext[off + d] = k->xd[d];
        src_ext[off + d] = k->sd[d];
        k->g_win[off + d] = k->win[d];
        k->g_stride[off + d] = k->stride[d];
        k->g_lo[off + d] = k->lo[d];
    }
    k->g_rows = ext[0];
    k->g_cols = ext[1];
    k->g_src_rows = src_ext[0];
    k->g_src_cols = src_ext[1];
    k->g_span = rfi_calloc((size_t)(2 * (ext[0] + ext[1])), sizeof(int32_t));
    if (!k->g_span)
        return false;
    int32_t *span = k->g_span;
    for (int d = 0; d < 2; d++)
        for (int64_t i = 0; i < ext[d]; i++, span += 2) {
            int64_t first = -1, last = -1; /* windows containing index i of dim d */
            for (int64_t o = 0; o < src_ext[d]; o++) {
                int64_t start = o * k->g_stride[d] - k->g_lo[d];
                if (start <= i && i < start + k->g_win[d]) {
                    first = first < 0 ? o : first;
                    last = o;
                }
            }
            span[0] = first < 0 ? 0 : (int32_t)first;
            span[1] = first < 0 ? 0 : (int32_t)(last + 1);
        }
    k->g_inner[0] = k->g_inner[1] = 0;
    for (int64_t b = 0, found = 0; b < src_ext[1]; b++) {
        int64_t start = b * k->g_stride[1] - k->g_lo[1];
        if (start >= 0 && start + k->g_win[1] <= ext[1]) {
            k->g_inner[0] = found++ ? k->g_inner[0] : b;
            k->g_inner[1] = b + 1;
        }
    }
    k->g_top_at = (int64_t)rfi_ws_align((size_t)k->src_plane * sizeof(int32_t));
    k->g_acc_at = k->g_top_at + (int64_t)rfi_ws_align((size_t)src_ext[1] * sizeof(int64_t));
    k->g_plane_bytes = k->g_acc_at + (int64_t)rfi_ws_align(
                                         (size_t)(ext[1] + k->g_stride[1]) * sizeof(double));
    k->kind = NATIVE_SCATTER_GATHER;
    return true;
}

/* ---- ARGMAX / ARGMIN ------------------------------------------------------------------ */

typedef struct arg_job {
    const rfi_cpu_native *k;
    const void *x;
    void *out;
} arg_job;

#define ARG_EXTREME(T, ABOVE)                                                                \
    static int64_t arg_##T(const rfi_cpu_native *k, const T *x)                              \
    {                                                                                        \
        int64_t best = 0;                                                                    \
        T top = x[0];                                                                        \
        for (int64_t i = 1; i < k->len; i++) {                                               \
            T v = x[i * k->inner];                                                           \
            if (k->want_max ? ABOVE(v, top) : ABOVE(-v, -top)) {                             \
                top = v;                                                                     \
                best = i;                                                                    \
            }                                                                                \
        }                                                                                    \
        return best;                                                                         \
    }
ARG_EXTREME(float, above_f)
ARG_EXTREME(double, above_d)

/* Results [lo, hi) in (outer, inner) order. */
static void arg_range(void *ctx, int64_t lo, int64_t hi)
{
    const arg_job *job = ctx;
    const rfi_cpu_native *k = job->k;
    for (int64_t r = lo; r < hi; r++) {
        int64_t base = (r / k->inner) * k->len * k->inner + r % k->inner;
        int64_t best = k->f64 ? arg_double(k, (const double *)job->x + base)
                              : arg_float(k, (const float *)job->x + base);
        if (k->out_i64)
            ((int64_t *)job->out)[r] = best;
        else
            ((int32_t *)job->out)[r] = (int32_t)best;
    }
}

/* ---- prepare / run ------------------------------------------------------------------- */

static bool float_dtype(rf_dtype dt) { return dt == RF_F32 || dt == RF_F64; }

rf_status rfi_cpu_native_prepare(const rfi_node *n, rfi_cpu_native **out, size_t *workspace_bytes)
{
    *out = NULL;
    *workspace_bytes = 0;
    if (n->op == RFI_OP_GATHER || n->op == RFI_OP_SCATTER_ADD || n->op == RFI_OP_RNG) {
        rfi_cpu_index *index = NULL;
        rfi_cpu_rng *rng = NULL;
        rf_status st = n->op == RFI_OP_RNG ? rfi_cpu_rng_prepare(n, &rng)
                                           : rfi_cpu_index_prepare(n, &index, workspace_bytes);
        if (st != RF_OK)
            return st;
        rfi_cpu_native *k = rfi_calloc(1, sizeof *k);
        if (!k) {
            rfi_cpu_index_free(index);
            rfi_cpu_rng_free(rng);
            *workspace_bytes = 0;
            return rfi_error(RF_E_NOMEM, "cpu: %s: out of memory", rfi_op_table[n->op].name);
        }
        k->node = n;
        k->kind = rng ? NATIVE_RNG : NATIVE_INDEX;
        k->index = index;
        k->rng = rng;
        *out = k;
        return RF_OK;
    }
    bool scatter = n->op == RFI_OP_SELECT_AND_SCATTER && n->n_in == 2 &&
                   float_dtype(n->dtype) && n->in[0]->dtype == n->dtype &&
                   n->in[1]->dtype == n->dtype;
    bool arg = (n->op == RFI_OP_ARGMAX || n->op == RFI_OP_ARGMIN) && n->n_in == 1 &&
               float_dtype(n->in[0]->dtype) && (n->dtype == RF_I64 || n->dtype == RF_I32);
    if (!scatter && !arg)
        return RF_E_UNSUPPORTED;
    rfi_cpu_native *k = rfi_calloc(1, sizeof *k);
    if (!k)
        return rfi_error(RF_E_NOMEM, "cpu: %s: out of memory", rfi_op_table[n->op].name);
    k->node = n;
    if (arg) {
        const rfi_node *x = n->in[0];
        int axis = (int)n->attr.i[0];
        if (axis < 0 || axis >= x->rank) {
            rfi_free(k);
            return RF_E_UNSUPPORTED;
        }
        k->kind = NATIVE_ARG;
        k->f64 = x->dtype == RF_F64;
        k->outer = rfi_numel(x->dims, axis);
        k->len = x->dims[axis];
        k->inner = rfi_numel(x->dims + axis + 1, x->rank - axis - 1);
        k->want_max = n->op == RFI_OP_ARGMAX;
        k->out_i64 = n->dtype == RF_I64;
        *out = k;
        return RF_OK;
    }
    k->f64 = n->dtype == RF_F64;
    if (!scatter_shape(k, n)) {
        rfi_free(k);
        return RF_E_UNSUPPORTED;
    }
    if (!scatter_tables(k) || (k->kind == NATIVE_SCATTER_GENERAL && !gather_shape(k))) {
        rfi_cpu_native_free(k);
        return rfi_error(RF_E_NOMEM, "cpu: select_and_scatter: out of memory");
    }
    if (k->kind == NATIVE_SCATTER_GATHER)
        *workspace_bytes = (size_t)(k->planes * k->g_plane_bytes);
    else if (k->kind == NATIVE_SCATTER_GENERAL && !k->f64)
        *workspace_bytes = rfi_ws_align((size_t)(k->planes * k->x_plane) * sizeof(double));
    *out = k;
    return RF_OK;
}

static int64_t grain_for(int64_t per_item)
{
    return PLANE_GRAIN_ELEMENTS / (per_item > 0 ? per_item : 1) + 1;
}

rf_status rfi_cpu_native_run(rfi_cpu_native *k, const void *const *in, void *out, void *workspace)
{
    if (k->kind == NATIVE_INDEX)
        return rfi_cpu_index_run(k->index, in, out, workspace);
    if (k->kind == NATIVE_RNG)
        return rfi_cpu_rng_run(k->rng, in[0], out);
    if (k->kind == NATIVE_ARG) {
        arg_job job = {k, in[0], out};
        int64_t results = k->outer * k->inner;
        if (k->len == 0) { /* the reference's index 0 */
            memset(out, 0, (size_t)results * (k->out_i64 ? sizeof(int64_t) : sizeof(int32_t)));
            return RF_OK;
        }
        rfi_parallel_for(results, grain_for(k->len), arg_range, &job);
        return RF_OK;
    }
    if (k->planes * k->x_plane == 0)
        return RF_OK;
    if (k->src_plane == 0 || k->window_count == 0) {
        memset(out, 0, (size_t)(k->planes * k->x_plane) * (k->f64 ? 8 : 4));
        return RF_OK;
    }
    if (k->kind == NATIVE_SCATTER_GATHER) {
        run_gather(k, in[0], in[1], out, workspace);
        return RF_OK;
    }
    if (k->layouts) {
        run_blocked(k, in[0], in[1], out);
        return RF_OK;
    }
    scatter_job job = {k, in[0], in[1], out, workspace};
    if (k->banded) {
        rfi_parallel_for(k->planes * k->src_rows, grain_for(4 * k->cols),
                         scatter_band_range, &job);
        return RF_OK;
    }
    if (k->f64 && k->kind == NATIVE_SCATTER_GENERAL)
        job.acc = NULL; /* f64 accumulates in place */
    rfi_parallel_for(k->planes, grain_for(k->x_plane + k->src_plane * k->window_count),
                     scatter_planes, &job);
    return RF_OK;
}

void rfi_cpu_native_free(rfi_cpu_native *k)
{
    if (!k)
        return;
    rfi_free(k->woff);
    rfi_free(k->wpos);
    rfi_free(k->g_span);
    rfi_cpu_index_free(k->index);
    rfi_cpu_rng_free(k->rng);
    rfi_free(k);
}
