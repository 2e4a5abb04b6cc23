/* reduce.c: the interpreter's reductions: REDUCE (sum, prod, max, min, and,
 * or over a set of axes), ARGMAX/ARGMIN along one axis, REDUCE_WINDOW (sum,
 * max, min over padded strided windows) and SELECT_AND_SCATTER (first max of
 * each window receives the source value, added).
 *
 * Accumulation is in double for float operands and in wrapping int64
 * otherwise, in row-major order of the operand, rounded once at the end.
 * Identities: sum 0, prod 1, max -inf (integers: the dtype's minimum), min
 * +inf (integers: the dtype's maximum), and all-ones (true), or 0 (false);
 * and/or are bitwise on integers, which is logical on bool. max/min
 * propagate NaN. ARGMAX/ARGMIN return the first NaN when there is one (as NumPy
 * and JAX), else the first index of the largest / smallest value.
 * REDUCE walks the operand a row (last dim) at a time with an odometer, so
 * no index arithmetic per element. Deliberately no reassociation or pairwise
 * summation: plain loops.
 */
#include "interp.h"

/* ---- Accumulators ------------------------------------------------------------------ */
typedef struct accum {
    rf_reduce_kind kind;
    bool is_float;
    double *f;  /* float accumulators (is_float) */
    int64_t *i; /* integer accumulators */
} accum;

static double identity_f(rf_reduce_kind kind)
{
    switch (kind) {
    case RF_REDUCE_PROD: return 1;
    case RF_REDUCE_MAX: return -INFINITY;
    case RF_REDUCE_MIN: return INFINITY;
    case RF_REDUCE_AND: return 1;
    default: return 0;
    }
}

static int64_t identity_i(rf_reduce_kind kind, rf_dtype dt)
{
    switch (kind) {
    case RF_REDUCE_PROD: return 1;
    case RF_REDUCE_MAX: return rfi_int_min(dt);
    case RF_REDUCE_MIN: return rfi_int_max(dt);
    case RF_REDUCE_AND: return dt == RF_BOOL ? 1 : -1;
    default: return 0;
    }
}

/* count accumulators set to the identity; RF_E_NOMEM if the allocation fails. */
static rf_status accum_init(accum *acc, rf_reduce_kind kind, rf_dtype dt, int64_t count)
{
    acc->kind = kind;
    acc->is_float = rfi_dtype_is_float(dt);
    acc->f = NULL;
    acc->i = NULL;
    size_t n = count > 0 ? (size_t)count : 1;
    if (acc->is_float)
        acc->f = rfi_malloc(n * sizeof(double));
    else
        acc->i = rfi_malloc(n * sizeof(int64_t));
    if (!acc->f && !acc->i)
        return rfi_error(RF_E_NOMEM, "interp: out of memory for %lld accumulators",
                         (long long)count);
    for (int64_t k = 0; k < count; k++) {
        if (acc->is_float)
            acc->f[k] = identity_f(kind);
        else
            acc->i[k] = identity_i(kind, dt);
    }
    return RF_OK;
}

/* Folds value v into accumulator k. */
static void accum_add_f(accum *acc, int64_t k, double v)
{
    double a = acc->f[k];
    switch (acc->kind) {
    case RF_REDUCE_SUM: a += v; break;
    case RF_REDUCE_PROD: a *= v; break;
    case RF_REDUCE_MAX: a = rfi_fmax_nan(a, v); break;
    case RF_REDUCE_MIN: a = rfi_fmin_nan(a, v); break;
    case RF_REDUCE_AND: a = (a != 0) && (v != 0); break;
    case RF_REDUCE_OR: a = (a != 0) || (v != 0); break;
    default: break;
    }
    acc->f[k] = a;
}

static void accum_add_i(accum *acc, int64_t k, int64_t v)
{
    int64_t a = acc->i[k];
    switch (acc->kind) {
    case RF_REDUCE_SUM: a = rfi_wadd(a, v); break;
    case RF_REDUCE_PROD: a = rfi_wmul(a, v); break;
    case RF_REDUCE_MAX: a = v > a ? v : a; break;
    case RF_REDUCE_MIN: a = v < a ? v : a; break;
    case RF_REDUCE_AND: a = (int64_t)((uint64_t)a & (uint64_t)v); break;
    case RF_REDUCE_OR: a = (int64_t)((uint64_t)a | (uint64_t)v); break;
    default: break;
    }
    acc->i[k] = a;
}

/* Folds element xi of x into accumulator k. */
static void accum_add(accum *acc, int64_t k, const void *x, rf_dtype dt, int64_t xi)
{
    if (acc->is_float)
        accum_add_f(acc, k, rfi_ld_f(x, dt, xi));
    else
        accum_add_i(acc, k, rfi_ld_i(x, dt, xi));
}

/* Folds elements [start, start + len) of x (len <= RFI_INTERP_CHUNK) into the
 * accumulators k, k + k_step, k + 2 k_step, ... (k_step 0: all into k, in order).
 * Float sums, the common case, get a loop of their own. */
static void accum_add_run(accum *acc, int64_t k, int64_t k_step, const void *x, rf_dtype dt,
                          int64_t start, int64_t len)
{
    if (acc->is_float) {
        double v[RFI_INTERP_CHUNK];
        rfi_interp_load_f(x, dt, start, len, v);
        double *a = acc->f + k;
        if (acc->kind == RF_REDUCE_SUM)
            for (int64_t j = 0; j < len; j++)
                a[j * k_step] += v[j];
        else
            for (int64_t j = 0; j < len; j++)
                accum_add_f(acc, k + j * k_step, v[j]);
    } else {
        int64_t v[RFI_INTERP_CHUNK];
        rfi_interp_load_i(x, dt, start, len, v);
        for (int64_t j = 0; j < len; j++)
            accum_add_i(acc, k + j * k_step, v[j]);
    }
}

/* Rounds the accumulators into out (dtype dt) and frees them. */
static void accum_finish(accum *acc, void *out, rf_dtype dt, int64_t count)
{
    for (int64_t k = 0; k < count; k++) {
        if (acc->is_float)
            rfi_st_f(out, dt, k, acc->f[k]);
        else
            rfi_st_i(out, dt, k, acc->i[k]);
    }
    rfi_free(acc->f);
    rfi_free(acc->i);
}

/* ---- REDUCE -------------------------------------------------------------------------- */
static rf_status reduce(const rfi_node *n, const void *x_data, void *out)
{
    const rfi_node *x = n->in[0];
    bool reduced[RF_MAX_RANK] = {false};
    for (int k = 0; k < n->attr.nl[0]; k++)
        reduced[n->attr.l[0][k]] = true;

    /* out_step[d]: how far one step along operand dim d moves in the result */
    int64_t os[RF_MAX_RANK], out_step[RF_MAX_RANK] = {0};
    rfi_interp_strides(n->dims, n->rank, os);
    for (int d = 0, r = 0; d < x->rank; d++)
        if (!reduced[d])
            out_step[d] = os[r++];

    int64_t out_count = rfi_interp_numel(n);
    accum acc;
    rf_status st = accum_init(&acc, (rf_reduce_kind)n->attr.i[0], x->dtype, out_count);
    if (st != RF_OK)
        return st;
    /* x row by row along its last dim; an odometer over the leading dims keeps o,
     * the accumulator of the row's first element */
    int64_t x_count = rfi_interp_numel(x);
    int lead = x->rank > 0 ? x->rank - 1 : 0;
    int64_t row_len = x->rank > 0 ? x->dims[x->rank - 1] : 1;
    int64_t row_step = x->rank > 0 ? out_step[x->rank - 1] : 0;
    int64_t idx[RF_MAX_RANK] = {0}, o = 0;
    for (int64_t i = 0; i < x_count; i += row_len) {
        for (int64_t j = 0; j < row_len; j += RFI_INTERP_CHUNK) {
            int64_t len = row_len - j < RFI_INTERP_CHUNK ? row_len - j : RFI_INTERP_CHUNK;
            accum_add_run(&acc, o + j * row_step, row_step, x_data, x->dtype, i + j, len);
        }
        rfi_interp_next_offset(idx, x->dims, out_step, lead, &o);
    }
    accum_finish(&acc, out, n->dtype, out_count);
    return RF_OK;
}

/* ---- ARGMAX / ARGMIN -------------------------------------------------------------------- */
/* Element a is a better extreme than b: NaN beats every number (for argmax and argmin
 * alike, as NumPy and JAX), then the larger (want_max) or smaller number; integers are
 * compared exactly. Negating floats turns "smaller" into "larger" and keeps NaN a NaN. */
static bool more_extreme(const void *x, rf_dtype dt, bool want_max, int64_t a, int64_t b)
{
    if (rfi_dtype_is_float(dt)) {
        double va = rfi_ld_f(x, dt, a), vb = rfi_ld_f(x, dt, b);
        return want_max ? rfi_gt_nan_max(va, vb) : rfi_gt_nan_max(-va, -vb);
    }
    int64_t ia = rfi_ld_i(x, dt, a), ib = rfi_ld_i(x, dt, b);
    return want_max ? ia > ib : ia < ib;
}

static void arg_extreme(const rfi_node *n, const void *x_data, void *out)
{
    const rfi_node *x = n->in[0];
    int axis = (int)n->attr.i[0];
    int64_t outer = rfi_numel(x->dims, axis);
    int64_t len = x->dims[axis];
    int64_t inner = rfi_numel(x->dims + axis + 1, x->rank - axis - 1);
    bool want_max = n->op == RFI_OP_ARGMAX;
    for (int64_t o = 0; o < outer; o++) {
        for (int64_t in = 0; in < inner; in++) {
            int64_t base = o * len * inner + in, best = 0;
            for (int64_t k = 1; k < len; k++) {
                int64_t cur = base + k * inner, top = base + best * inner;
                if (more_extreme(x_data, x->dtype, want_max, cur, top))
                    best = k;
            }
            rfi_st_i(out, n->dtype, o * inner + in, best);
        }
    }
}

/* ---- Windows ------------------------------------------------------------------------ *
 * attr l[0] window, l[1] strides, l[2] pad_lo, l[3] pad_hi, one entry per dim of x.
 * Window element w of output element o covers operand index o*stride + w - pad_lo
 * in each dim; positions outside the operand are padding. */

/* The operand offset of window element w of output element o, or -1 for padding. */
static int64_t window_source(const rfi_node *x, const rfi_attrs *at, const int64_t *xs,
                             const int64_t *o, const int64_t *w)
{
    int64_t offset = 0;
    for (int d = 0; d < x->rank; d++) {
        int64_t p = o[d] * at->l[1][d] + w[d] - at->l[2][d];
        if (p < 0 || p >= x->dims[d])
            return -1;
        offset += p * xs[d];
    }
    return offset;
}

static rf_status reduce_window(const rfi_node *n, const void *x_data, void *out)
{
    const rfi_node *x = n->in[0];
    const rfi_attrs *at = &n->attr;
    int64_t xs[RF_MAX_RANK];
    rfi_interp_strides(x->dims, x->rank, xs);
    int64_t out_count = rfi_interp_numel(n);
    int64_t window_count = rfi_numel(at->l[0], x->rank);
    accum acc;
    rf_status st = accum_init(&acc, (rf_reduce_kind)at->i[0], x->dtype, out_count);
    if (st != RF_OK)
        return st;
    int64_t o[RF_MAX_RANK] = {0};
    for (int64_t k = 0; k < out_count; k++) {
        int64_t w[RF_MAX_RANK] = {0};
        for (int64_t j = 0; j < window_count; j++) {
            int64_t src = window_source(x, at, xs, o, w);
            if (src >= 0) /* padding holds the identity: skipping it is the same */
                accum_add(&acc, k, x_data, x->dtype, src);
            rfi_interp_next(w, at->l[0], x->rank);
        }
        rfi_interp_next(o, n->dims, n->rank);
    }
    accum_finish(&acc, out, n->dtype, out_count);
    return RF_OK;
}

static rf_status select_and_scatter(const rfi_node *n, const void *const *in, void *out)
{
    const rfi_node *x = n->in[0], *source = n->in[1];
    const rfi_attrs *at = &n->attr;
    int64_t xs[RF_MAX_RANK];
    rfi_interp_strides(x->dims, x->rank, xs);
    int64_t x_count = rfi_interp_numel(x);
    int64_t src_count = rfi_interp_numel(source);
    int64_t window_count = rfi_numel(at->l[0], x->rank);
    accum acc;
    rf_status st = accum_init(&acc, RF_REDUCE_SUM, source->dtype, x_count);
    if (st != RF_OK)
        return st;
    int64_t o[RF_MAX_RANK] = {0};
    for (int64_t k = 0; k < src_count; k++) {
        int64_t w[RF_MAX_RANK] = {0}, selected = -1;
        for (int64_t j = 0; j < window_count; j++) {
            int64_t cand = window_source(x, at, xs, o, w);
            if (cand >= 0 && (selected < 0 || more_extreme(in[0], x->dtype, true, cand, selected)))
                selected = cand; /* strictly above: the first max stays */
            rfi_interp_next(w, at->l[0], x->rank);
        }
        if (selected >= 0)
            accum_add(&acc, selected, in[1], source->dtype, k);
        rfi_interp_next(o, source->dims, source->rank);
    }
    accum_finish(&acc, out, n->dtype, x_count);
    return RF_OK;
}

rf_status rfi_interp_reduce(const rfi_node *n, const void *const *in, void *out)
{
    switch (n->op) {
    case RFI_OP_REDUCE: return reduce(n, in[0], out);
    case RFI_OP_ARGMAX:
    case RFI_OP_ARGMIN: arg_extreme(n, in[0], out); return RF_OK;
    case RFI_OP_REDUCE_WINDOW: return reduce_window(n, in[0], out);
    case RFI_OP_SELECT_AND_SCATTER: return select_and_scatter(n, in, out);
    default:
        return rfi_error(RF_E_INTERNAL, "interp: %s is not a reduction",
                         rfi_op_table[n->op].name);
    }
}
