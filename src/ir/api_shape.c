/* api_shape.c: the public shape ops (broadcast, reshape, transpose, slice,
 * concatenate, pad, reverse, squeeze/unsqueeze/flatten), reductions (with
 * keepdims, mean, var, argmax/argmin), linear algebra (dot_general, NumPy
 * matmul, linear) and rf_grad.
 *
 * Each function checks its arguments with messages naming the public op and
 * the shapes, then records primitives; composites (broadcast_to, squeeze,
 * mean, matmul, ...) lower to primitives here. Deliberately not here: result
 * types of the primitives (rfi_infer) and the gradient itself (autodiff).
 */
#include <stdio.h>
#include <string.h>

#include "api.h"

/* "[4,-1]" of a requested shape into buf. */
static const char *dims_str(char *buf, size_t n, const int64_t *dims, int rank)
{
    size_t len = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < rank && len < n; i++)
        len += (size_t)snprintf(buf + len, n - len, i ? ",%lld" : "%lld", (long long)dims[i]);
    if (len < n)
        snprintf(buf + len, n - len, "]");
    return buf;
}
#define DIMS_STR(dims, rank) dims_str((char[RFI_TYPE_STR_MAX]){0}, RFI_TYPE_STR_MAX, (dims), (rank))

/* Checks a requested result shape (rank in range, dims given, none negative
 * unless allow_minus1 lets one be -1). */
static bool check_dims(const char *fn, const rfi_node *x, const int64_t *dims, int rank,
                       bool allow_minus1)
{
    if (rank < 0 || rank > RF_MAX_RANK || (rank > 0 && !dims)) {
        rfi_graph_fail(x->g, RF_E_INVALID, "%s: invalid rank %d for the result (0..%d) of %s",
                       fn, rank, RF_MAX_RANK, RFI_TSTR(x));
        return false;
    }
    for (int i = 0; i < rank; i++) {
        if (dims[i] < 0 && !(allow_minus1 && dims[i] == -1)) {
            rfi_graph_fail(x->g, RF_E_INVALID, "%s: invalid shape %s for %s", fn,
                           DIMS_STR(dims, rank), RFI_TSTR(x));
            return false;
        }
    }
    return true;
}

static bool same_dims(const int64_t *a, int ra, const int64_t *b, int rb)
{
    return ra == rb && (ra == 0 || memcmp(a, b, (size_t)ra * sizeof *a) == 0);
}

/* NumPy broadcast of two dim lists (aligned at the right). */
static bool broadcast_dims(const int64_t *a, int ra, const int64_t *b, int rb, int64_t *out,
                           int *rank)
{
    int r = ra > rb ? ra : rb;
    for (int i = 0; i < r; i++) {
        int ia = i - (r - ra), ib = i - (r - rb);
        int64_t da = ia >= 0 ? a[ia] : 1, db = ib >= 0 ? b[ib] : 1;
        if (da != db && da != 1 && db != 1)
            return false;
        out[i] = da == 1 ? db : da;
    }
    *rank = r;
    return true;
}

/* ---- Shape ------------------------------------------------------------------------ */

rf_tensor *rf_broadcast_in_dim(rf_tensor *x, const int64_t *dims, int rank, const int64_t *map)
{
    static const char fn[] = "rf_broadcast_in_dim";
    if (!x || !check_dims(fn, x, dims, rank, false))
        return NULL;
    if (x->rank > 0 && !map) {
        rfi_graph_fail(x->g, RF_E_INVALID, "%s: map is NULL for %s", fn, RFI_TSTR(x));
        return NULL;
    }
    bool used[RF_MAX_RANK] = {false};
    for (int i = 0; i < x->rank; i++) {
        /* StableHLO: map entries unique (not necessarily increasing: a
         * broadcast may also permute) */
        bool ok = map[i] >= 0 && map[i] < rank && !used[map[i]] &&
                  (x->dims[i] == 1 || x->dims[i] == dims[map[i]]);
        if (ok)
            used[map[i]] = true;
        if (!ok) {
            rfi_graph_fail(x->g, RF_E_SHAPE, "%s: cannot broadcast %s to %s with map %s", fn,
                           RFI_TSTR(x), RFI_SSTR(x->dtype, dims, rank),
                           DIMS_STR(map, x->rank));
            return NULL;
        }
    }
    rfi_attrs attr = {0};
    attr.nl[0] = x->rank;
    if (x->rank)
        memcpy(attr.l[0], map, (size_t)x->rank * sizeof *map);
    return rfi_node_new(x->g, RFI_OP_BROADCAST_IN_DIM, &x, 1, &attr, x->dtype, dims, rank);
}

rf_tensor *rf_broadcast_to(rf_tensor *x, const int64_t *dims, int rank)
{
    static const char fn[] = "rf_broadcast_to";
    if (!x || !check_dims(fn, x, dims, rank, false))
        return NULL;
    if (same_dims(x->dims, x->rank, dims, rank))
        return x;
    int off = rank - x->rank;
    bool ok = off >= 0;
    int64_t map[RF_MAX_RANK];
    for (int i = 0; ok && i < x->rank; i++) {
        map[i] = off + i;
        ok = x->dims[i] == 1 || x->dims[i] == dims[off + i];
    }
    if (!ok) {
        rfi_graph_fail(x->g, RF_E_SHAPE, "%s: cannot broadcast %s to %s", fn, RFI_TSTR(x),
                       RFI_SSTR(x->dtype, dims, rank));
        return NULL;
    }
    return rf_broadcast_in_dim(x, dims, rank, map);
}

rf_tensor *rf_reshape(rf_tensor *x, const int64_t *dims, int rank)
{
    static const char fn[] = "rf_reshape";
    if (!x || !check_dims(fn, x, dims, rank, true))
        return NULL;
    int64_t out[RF_MAX_RANK], known = 1;
    int infer = -1;
    for (int i = 0; i < rank; i++) {
        out[i] = dims[i];
        if (dims[i] != -1) {
            if (!rfi_mul_ok(known, dims[i], &known)) {
                rfi_graph_fail(x->g, RF_E_SHAPE, "%s: the product of %s overflows (for %s)", fn,
                               DIMS_STR(dims, rank), RFI_TSTR(x));
                return NULL;
            }
        } else if (infer < 0)
            infer = i;
        else {
            rfi_graph_fail(x->g, RF_E_SHAPE, "%s: more than one -1 in %s for %s", fn,
                           DIMS_STR(dims, rank), RFI_TSTR(x));
            return NULL;
        }
    }
    int64_t n = rfi_node_numel(x);
    if (infer >= 0 && known > 0 && n % known == 0)
        out[infer] = n / known;
    if ((infer >= 0 && (known == 0 || n % known != 0)) || rfi_numel(out, rank) != n) {
        rfi_graph_fail(x->g, RF_E_SHAPE, "%s: cannot reshape %s (%lld elements) to %s", fn,
                       RFI_TSTR(x), (long long)n, DIMS_STR(dims, rank));
        return NULL;
    }
    if (same_dims(x->dims, x->rank, out, rank))
        return x;
    return rfi_node_new(x->g, RFI_OP_RESHAPE, &x, 1, NULL, x->dtype, out, rank);
}

rf_tensor *rf_transpose(rf_tensor *x, const int64_t *perm)
{
    static const char fn[] = "rf_transpose";
    if (!x)
        return NULL;
    if (x->rank > 0 && !perm) {
        rfi_graph_fail(x->g, RF_E_INVALID, "%s: perm is NULL for %s", fn, RFI_TSTR(x));
        return NULL;
    }
    bool seen[RF_MAX_RANK] = {false}, identity = true;
    for (int i = 0; i < x->rank; i++) {
        if (perm[i] < 0 || perm[i] >= x->rank || seen[perm[i]]) {
            rfi_graph_fail(x->g, RF_E_INVALID, "%s: %s is not a permutation of the axes of %s",
                           fn, DIMS_STR(perm, x->rank), RFI_TSTR(x));
            return NULL;
        }
        seen[perm[i]] = true;
        identity = identity && perm[i] == i;
    }
    if (identity)
        return x;
    rfi_attrs attr = {0};
    attr.nl[0] = x->rank;
    memcpy(attr.l[0], perm, (size_t)x->rank * sizeof *perm);
    return rfi_node_new(x->g, RFI_OP_TRANSPOSE, &x, 1, &attr, x->dtype, NULL, 0);
}

rf_tensor *rf_slice(rf_tensor *x, const int64_t *start, const int64_t *limit,
                    const int64_t *stride)
{
    static const char fn[] = "rf_slice";
    if (!x)
        return NULL;
    if (x->rank == 0)
        return x;
    if (!start || !limit) {
        rfi_graph_fail(x->g, RF_E_INVALID, "%s: start or limit is NULL for %s", fn,
                       RFI_TSTR(x));
        return NULL;
    }
    rfi_attrs attr = {0};
    bool whole = true;
    for (int i = 0; i < x->rank; i++) {
        int64_t s = stride ? stride[i] : 1;
        if (start[i] < 0 || start[i] > limit[i] || limit[i] > x->dims[i] || s < 1) {
            rfi_graph_fail(x->g, RF_E_SHAPE,
                           "%s: invalid slice start %s limit %s stride %s of %s", fn,
                           DIMS_STR(start, x->rank), DIMS_STR(limit, x->rank),
                           stride ? DIMS_STR(stride, x->rank) : "1", RFI_TSTR(x));
            return NULL;
        }
        /* a stride past the slice's one element is stride 1: the same
         * slice, whose index arithmetic cannot overflow */
        if (s > 1 && limit[i] - start[i] <= s) {
            s = 1;
            attr.l[1][i] = start[i] + (limit[i] > start[i]);
        } else {
            attr.l[1][i] = limit[i];
        }
        attr.l[0][i] = start[i];
        attr.l[2][i] = s;
        whole = whole && start[i] == 0 && attr.l[1][i] == x->dims[i] && s == 1;
    }
    if (whole)
        return x;
    attr.nl[0] = attr.nl[1] = attr.nl[2] = x->rank;
    return rfi_node_new(x->g, RFI_OP_SLICE, &x, 1, &attr, x->dtype, NULL, 0);
}

rf_tensor *rf_concatenate(rf_tensor *const *xs, int n, int axis)
{
    static const char fn[] = "rf_concatenate";
    if (!xs || n < 1) {
        rfi_error(RF_E_INVALID, "%s: no tensors to concatenate", fn);
        return NULL;
    }
    for (int k = 0; k < n; k++)
        if (!xs[k])
            return NULL;
    const rfi_node *x0 = xs[0];
    if (x0->rank == 0) {
        rfi_graph_fail(x0->g, RF_E_SHAPE, "%s: cannot concatenate scalars", fn);
        return NULL;
    }
    int a;
    if (!rfi_api_axis(fn, x0, axis, x0->rank, &a))
        return NULL;
    for (int k = 1; k < n; k++) {
        const rfi_node *x = xs[k];
        if (!rfi_api_same_graph(fn, x0, x))
            return NULL;
        bool ok = x->dtype == x0->dtype && x->rank == x0->rank;
        for (int i = 0; ok && i < x->rank; i++)
            ok = i == a || x->dims[i] == x0->dims[i];
        if (!ok) {
            rfi_graph_fail(x0->g, x->dtype != x0->dtype ? RF_E_DTYPE : RF_E_SHAPE,
                           "%s: %s and %s do not fit along axis %d", fn, RFI_TSTR(x0),
                           RFI_TSTR(x), a);
            return NULL;
        }
    }
    if (n == 1)
        return xs[0];
    rfi_attrs attr = {0};
    attr.i[0] = a;
    return rfi_node_new(x0->g, RFI_OP_CONCATENATE, xs, n, &attr, x0->dtype, NULL, 0);
}

rf_tensor *rf_pad(rf_tensor *x, rf_tensor *value, const int64_t *low, const int64_t *high,
                  const int64_t *interior)
{
    static const char fn[] = "rf_pad";
    if (!x || !value || !rfi_api_same_graph(fn, x, value))
        return NULL;
    if (!(value = rfi_api_weak_as(fn, value, x->dtype)))
        return NULL;
    if (value->rank != 0 || value->dtype != x->dtype) {
        rfi_graph_fail(x->g, value->rank ? RF_E_SHAPE : RF_E_DTYPE,
                       "%s: padding value %s must be a scalar of the dtype of %s", fn,
                       RFI_TSTR(value), RFI_TSTR(x));
        return NULL;
    }
    if (x->rank == 0)
        return x;
    rfi_attrs attr = {0};
    bool none = true;
    for (int i = 0; i < x->rank; i++) {
        int64_t lo = low ? low[i] : 0, hi = high ? high[i] : 0, in = interior ? interior[i] : 0;
        int64_t d = x->dims[i], gaps, n;
        if (in < 0 || !rfi_mul_ok(d > 0 ? d - 1 : 0, in, &gaps) || !rfi_add_ok(d, gaps, &n) ||
            !rfi_clip_crop(n, &lo, &hi) || !rfi_pad_ok(n, lo, hi, &n) || n < 0) {
            rfi_graph_fail(x->g, RF_E_SHAPE, "%s: invalid padding of axis %d (low %lld, "
                           "high %lld, interior %lld) of %s", fn, i, (long long)lo,
                           (long long)hi, (long long)in, RFI_TSTR(x));
            return NULL;
        }
        attr.l[0][i] = lo;
        attr.l[1][i] = hi;
        attr.l[2][i] = in;
        none = none && lo == 0 && hi == 0 && in == 0;
    }
    if (none)
        return x;
    attr.nl[0] = attr.nl[1] = attr.nl[2] = x->rank;
    rfi_node *in[2] = {x, value};
    return rfi_node_new(x->g, RFI_OP_PAD, in, 2, &attr, x->dtype, NULL, 0);
}

rf_tensor *rf_reverse(rf_tensor *x, const int64_t *axes, int naxes)
{
    rfi_attrs attr = {0};
    if (!x || !rfi_api_axes("rf_reverse", x, axes, naxes, attr.l[0]))
        return NULL;
    if (naxes == 0)
        return x;
    attr.nl[0] = naxes;
    return rfi_node_new(x->g, RFI_OP_REVERSE, &x, 1, &attr, x->dtype, NULL, 0);
}

rf_tensor *rf_squeeze(rf_tensor *x, int axis)
{
    int a;
    if (!x || !rfi_api_axis("rf_squeeze", x, axis, x->rank, &a))
        return NULL;
    if (x->dims[a] != 1) {
        rfi_graph_fail(x->g, RF_E_SHAPE, "rf_squeeze: axis %d of %s has size %lld, not 1", axis,
                       RFI_TSTR(x), (long long)x->dims[a]);
        return NULL;
    }
    int64_t dims[RF_MAX_RANK];
    for (int i = 0, j = 0; i < x->rank; i++)
        if (i != a)
            dims[j++] = x->dims[i];
    return rf_reshape(x, dims, x->rank - 1);
}

rf_tensor *rf_unsqueeze(rf_tensor *x, int axis)
{
    int a;
    if (!x || !rfi_api_axis("rf_unsqueeze", x, axis, x->rank + 1, &a))
        return NULL;
    if (x->rank == RF_MAX_RANK) {
        rfi_graph_fail(x->g, RF_E_SHAPE, "rf_unsqueeze: %s already has the maximum rank %d",
                       RFI_TSTR(x), RF_MAX_RANK);
        return NULL;
    }
    int64_t dims[RF_MAX_RANK];
    for (int i = 0, j = 0; i <= x->rank; i++)
        dims[i] = i == a ? 1 : x->dims[j++];
    return rf_reshape(x, dims, x->rank + 1);
}

rf_tensor *rf_flatten(rf_tensor *x)
{
    if (!x)
        return NULL;
    if (x->rank == 0) {
        rfi_graph_fail(x->g, RF_E_SHAPE, "rf_flatten: cannot flatten a scalar %s", RFI_TSTR(x));
        return NULL;
    }
    int64_t dims[2] = {x->dims[0], rfi_numel(x->dims + 1, x->rank - 1)};
    return rf_reshape(x, dims, 2);
}

/* ---- Reductions --------------------------------------------------------------------- */

/* The sorted reduction axes (naxes 0: all) into out; returns their count or -1. */
static int reduce_axes(const char *fn, const rfi_node *x, const int64_t *axes, int naxes,
                       int64_t *out)
{
    if (naxes == 0) {
        for (int i = 0; i < x->rank; i++)
            out[i] = i;
        return x->rank;
    }
    return rfi_api_axes(fn, x, axes, naxes, out) ? naxes : -1;
}

/* x's dims with the (sorted) axes set to 1 (keepdims) or removed. */
static int reduced_dims(const rfi_node *x, const int64_t *axes, int n, bool keep, int64_t *out)
{
    int r = 0;
    for (int i = 0, k = 0; i < x->rank; i++) {
        bool reduced = k < n && axes[k] == i;
        k += reduced;
        if (!reduced)
            out[r++] = x->dims[i];
        else if (keep)
            out[r++] = 1;
    }
    return r;
}

static rfi_node *reduce_named(const char *fn, rfi_node *x, rf_reduce_kind kind,
                              const int64_t *axes, int naxes, bool keepdims)
{
    if (!x)
        return NULL;
    if ((unsigned)kind >= RF_REDUCE_KIND_COUNT) {
        rfi_graph_fail(x->g, RF_E_INVALID, "%s: invalid reduction kind %d for %s", fn,
                       (int)kind, RFI_TSTR(x));
        return NULL;
    }
    rfi_attrs attr = {0};
    int n = reduce_axes(fn, x, axes, naxes, attr.l[0]);
    if (n < 0)
        return NULL;
    if (n == 0)
        return x;
    attr.nl[0] = n;
    attr.i[0] = kind;
    rfi_node *y = rfi_node_new(x->g, RFI_OP_REDUCE, &x, 1, &attr, x->dtype, NULL, 0);
    if (!y || !keepdims)
        return y;
    int64_t dims[RF_MAX_RANK];
    int rank = reduced_dims(x, attr.l[0], n, true, dims);
    return rf_reshape(y, dims, rank);
}

rf_tensor *rf_reduce(rf_tensor *x, rf_reduce_kind kind, const int64_t *axes, int naxes,
                     bool keepdims)
{
    return reduce_named("rf_reduce", x, kind, axes, naxes, keepdims);
}

rf_tensor *rf_sum(rf_tensor *x, const int64_t *axes, int naxes, bool keepdims)
{
    return reduce_named("rf_sum", x, RF_REDUCE_SUM, axes, naxes, keepdims);
}

rf_tensor *rf_reduce_max(rf_tensor *x, const int64_t *axes, int naxes, bool keepdims)
{
    return reduce_named("rf_reduce_max", x, RF_REDUCE_MAX, axes, naxes, keepdims);
}

/* sum / count; float only, since an integer mean would silently truncate. */
static rfi_node *mean_named(const char *fn, rfi_node *x, const int64_t *axes, int naxes,
                            bool keepdims)
{
    if (!x)
        return NULL;
    if (!rfi_dtype_is_float(x->dtype)) {
        rfi_graph_fail(x->g, RF_E_DTYPE, "%s: needs a float tensor, got %s", fn, RFI_TSTR(x));
        return NULL;
    }
    int64_t ax[RF_MAX_RANK];
    int n = reduce_axes(fn, x, axes, naxes, ax);
    if (n < 0)
        return NULL;
    int64_t count = 1;
    for (int k = 0; k < n; k++)
        count *= x->dims[ax[k]];
    return rf_div_s(reduce_named(fn, x, RF_REDUCE_SUM, ax, n ? n : 0, keepdims),
                    (double)count);
}

rf_tensor *rf_mean(rf_tensor *x, const int64_t *axes, int naxes, bool keepdims)
{
    return mean_named("rf_mean", x, axes, naxes, keepdims);
}

/* mean((x - m)^2) with m = mean(x). The gradient that reaches x through m is
 * -2 mean(x - m) times the rest: zero, so m is a stop_gradient and the
 * reverse pass is the textbook 2 (x - m) / count. Differentiating through m
 * would cost every batch normalisation's backward a further pass over its
 * input (a sum of rounding noise) and two small loops; the first derivative
 * is the same, but a second derivative through m would not be (reverse mode
 * here is first order only). */
rf_tensor *rf_var(rf_tensor *x, const int64_t *axes, int naxes, bool keepdims)
{
    rfi_node *m = rf_stop_gradient(mean_named("rf_var", x, axes, naxes, true));
    rfi_node *d = rf_sub(x, m);
    return mean_named("rf_var", rf_mul(d, d), axes, naxes, keepdims);
}

rf_tensor *rf_sum_all(rf_tensor *x) { return rf_sum(x, NULL, 0, false); }
rf_tensor *rf_mean_all(rf_tensor *x) { return rf_mean(x, NULL, 0, false); }

static rfi_node *arg_extreme(const char *fn, rfi_op op, rfi_node *x, int axis)
{
    int a;
    if (!x || !rfi_api_axis(fn, x, axis, x->rank, &a))
        return NULL;
    rfi_attrs attr = {0};
    attr.i[0] = a;
    return rfi_node_new(x->g, op, &x, 1, &attr, RF_I64, NULL, 0);
}

rf_tensor *rf_argmax(rf_tensor *x, int axis)
{
    return arg_extreme("rf_argmax", RFI_OP_ARGMAX, x, axis);
}

rf_tensor *rf_argmin(rf_tensor *x, int axis)
{
    return arg_extreme("rf_argmin", RFI_OP_ARGMIN, x, axis);
}

/* ---- Linear algebra ------------------------------------------------------------------ */

/* Copies n axes of a rank-`rank` operand into out, normalising negatives. */
static bool dot_axes(const char *fn, const rfi_node *x, const int64_t *axes, int n, int64_t *out)
{
    for (int i = 0; i < n; i++) {
        int a;
        if (!rfi_api_axis(fn, x, axes[i], x->rank, &a))
            return false;
        out[i] = a;
    }
    return true;
}

/* Weak scalars adopt the other dtype; then the dtypes must agree. */
static bool same_dtype(const char *fn, rfi_node **a, rfi_node **b)
{
    if (!rfi_api_same_graph(fn, *a, *b))
        return false;
    if ((*a)->weak && !(*b)->weak)
        *a = rfi_api_weak_as(fn, *a, (*b)->dtype);
    else if ((*b)->weak && !(*a)->weak)
        *b = rfi_api_weak_as(fn, *b, (*a)->dtype);
    if (!*a || !*b)
        return false;
    if ((*a)->dtype != (*b)->dtype) {
        rfi_graph_fail((*a)->g, RF_E_DTYPE, "%s: dtypes of %s and %s differ", fn, RFI_TSTR(*a),
                       RFI_TSTR(*b));
        return false;
    }
    return true;
}

rf_tensor *rf_dot_general(rf_tensor *a, rf_tensor *b, const int64_t *lhs_batch,
                          const int64_t *rhs_batch, int nbatch, const int64_t *lhs_contract,
                          const int64_t *rhs_contract, int ncontract)
{
    static const char fn[] = "rf_dot_general";
    if (!a || !b || !same_dtype(fn, &a, &b))
        return NULL;
    if (nbatch < 0 || ncontract < 0 || nbatch + ncontract > RF_MAX_RANK ||
        (nbatch && (!lhs_batch || !rhs_batch)) ||
        (ncontract && (!lhs_contract || !rhs_contract))) {
        rfi_graph_fail(a->g, RF_E_INVALID, "%s: invalid dimension lists (%d batch, %d "
                       "contracting) for %s and %s", fn, nbatch, ncontract, RFI_TSTR(a),
                       RFI_TSTR(b));
        return NULL;
    }
    rfi_attrs attr = {0};
    if (!dot_axes(fn, a, lhs_batch, nbatch, attr.l[0]) ||
        !dot_axes(fn, b, rhs_batch, nbatch, attr.l[1]) ||
        !dot_axes(fn, a, lhs_contract, ncontract, attr.l[2]) ||
        !dot_axes(fn, b, rhs_contract, ncontract, attr.l[3]))
        return NULL;
    attr.nl[0] = attr.nl[1] = nbatch;
    attr.nl[2] = attr.nl[3] = ncontract;
    if (a->dtype == RF_F32) /* the others are exact whatever the setting */
        attr.i[0] = a->g->matmul_precision;
    rfi_node *in[2] = {a, b};
    return rfi_node_new(a->g, RFI_OP_DOT_GENERAL, in, 2, &attr, a->dtype, NULL, 0);
}

rf_tensor *rf_matmul(rf_tensor *a, rf_tensor *b)
{
    static const char fn[] = "rf_matmul";
    if (!a || !b || !same_dtype(fn, &a, &b))
        return NULL;
    int ra = a->rank, rb = b->rank;
    if (ra == 0 || rb == 0 || a->dims[ra - 1] != b->dims[rb == 1 ? 0 : rb - 2]) {
        rfi_graph_fail(a->g, RF_E_SHAPE, "rf_matmul: shapes %s and %s do not fit", RFI_TSTR(a),
                       RFI_TSTR(b));
        return NULL;
    }
    int64_t ca = ra - 1, cb = rb == 1 ? 0 : rb - 2;
    /* No batch dims to pair: a's leading dims are free dims and come first
     * ([..., m] @ [k, n] -> [..., m, n]; [k] @ [..., k, n] -> [..., n];
     * [..., m, k] @ [k] -> [..., m]), as NumPy orders them. */
    if (ra == 1 || rb <= 2)
        return rf_dot_general(a, b, NULL, NULL, 0, &ca, &cb, 1);
    /* Both have matrices: broadcast the batch dims and pair them. */
    int64_t dims[RF_MAX_RANK];
    int nb;
    if (!broadcast_dims(a->dims, ra - 2, b->dims, rb - 2, dims, &nb)) {
        rfi_graph_fail(a->g, RF_E_SHAPE, "rf_matmul: batch dims of %s and %s do not broadcast",
                       RFI_TSTR(a), RFI_TSTR(b));
        return NULL;
    }
    dims[nb] = a->dims[ra - 2];
    dims[nb + 1] = a->dims[ra - 1];
    rfi_node *a2 = rf_broadcast_to(a, dims, nb + 2);
    dims[nb] = b->dims[rb - 2];
    dims[nb + 1] = b->dims[rb - 1];
    rfi_node *b2 = rf_broadcast_to(b, dims, nb + 2);
    int64_t batch[RF_MAX_RANK];
    for (int i = 0; i < nb; i++)
        batch[i] = i;
    ca = nb + 1;
    cb = nb;
    return rf_dot_general(a2, b2, batch, batch, nb, &ca, &cb, 1);
}

rf_tensor *rf_linear(rf_tensor *x, rf_tensor *w, rf_tensor *b)
{
    static const char fn[] = "rf_linear";
    if (!x || !w || !same_dtype(fn, &x, &w))
        return NULL;
    if (x->rank < 1 || w->rank != 2 || x->dims[x->rank - 1] != w->dims[1]) {
        rfi_graph_fail(x->g, RF_E_SHAPE, "%s: x %s and w %s do not fit (x [..., in], "
                       "w [out, in])", fn, RFI_TSTR(x), RFI_TSTR(w));
        return NULL;
    }
    int64_t cx = x->rank - 1, cw = 1;
    rfi_node *y = rf_dot_general(x, w, NULL, NULL, 0, &cx, &cw, 1);
    if (!b || !y)
        return y;
    if (!rfi_api_same_graph(fn, x, b))
        return NULL;
    if (b->rank != 1 || b->dims[0] != w->dims[0]) {
        rfi_graph_fail(x->g, RF_E_SHAPE, "%s: bias %s does not fit w %s (b [out])", fn,
                       RFI_TSTR(b), RFI_TSTR(w));
        return NULL;
    }
    return rf_add(y, b);
}

/* ---- Gradients -------------------------------------------------------------------------- */

/* The graph's first error as this thread's message and status. */
static rf_status graph_status(const rfi_graph *g)
{
    return rfi_error(g->status, "%s", g->errmsg ? g->errmsg : "rf_grad: failed");
}

rf_status rf_grad(rf_trace *t, rf_tensor *y, rf_tensor *const *wrt, int n, rf_tensor **out)
{
    static const char fn[] = "rf_grad";
    if (!t)
        return rfi_error(RF_E_INVALID, "%s: trace is NULL", fn);
    if (n < 0 || (n > 0 && (!wrt || !out))) {
        rfi_graph_fail(t, RF_E_INVALID, "%s: invalid wrt list (%d tensors)", fn, n);
        return graph_status(t);
    }
    for (int i = 0; i < n; i++)
        out[i] = NULL;
    if (t->status != RF_OK)
        return graph_status(t);
    bool operands_ok = y != NULL;
    for (int i = 0; i < n; i++)
        operands_ok = operands_ok && wrt[i] != NULL;
    if (!operands_ok) {
        rfi_graph_fail(t, RF_E_INVALID, "%s: y or a wrt tensor is NULL", fn);
        return graph_status(t);
    }
    if (y->g != t) {
        rfi_graph_fail(t, RF_E_INVALID, "%s: y %s belongs to another trace", fn, RFI_TSTR(y));
        return graph_status(t);
    }
    if (y->rank != 0 || !rfi_dtype_is_float(y->dtype)) {
        rfi_graph_fail(t, y->rank ? RF_E_SHAPE : RF_E_DTYPE,
                       "%s: y must be a float scalar, got %s", fn, RFI_TSTR(y));
        return graph_status(t);
    }
    for (int i = 0; i < n; i++) {
        if (wrt[i]->g != t) {
            rfi_graph_fail(t, RF_E_INVALID, "%s: wrt[%d] %s belongs to another trace", fn, i,
                           RFI_TSTR(wrt[i]));
            return graph_status(t);
        }
        if (wrt[i]->weak) { /* each use made its own typed copy, which y depends on */
            rfi_graph_fail(t, RF_E_INVALID,
                           "%s: wrt[%d] is a weak scalar (rf_scalar), which takes each use's "
                           "dtype and has no gradient of its own: make it with rf_scalar_typed",
                           fn, i);
            return graph_status(t);
        }
    }
    for (int i = 0; i < n; i++) {
        rfi_node *in[2] = {y, wrt[i]};
        out[i] = rfi_node_new(t, RFI_OP_GRAD, in, 2, NULL, wrt[i]->dtype, NULL, 0);
        if (!out[i]) {
            for (int k = 0; k < n; k++)
                out[k] = NULL;
            return graph_status(t);
        }
    }
    return RF_OK;
}
