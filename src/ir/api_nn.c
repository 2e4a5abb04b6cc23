/* api_nn.c: the public neural-network ops: convolution, reduce_window and
 * pooling, select_and_scatter, gather/scatter_add/take_along/onehot, the
 * counter-based RNG ops and the activation / softmax composites.
 *
 * Primitives are checked here with messages naming the public op and the
 * shapes; composites lower to other public ops. Deliberately not here: the
 * primitives' result types (rfi_infer), their kernels and their gradients.
 */
#include <math.h>
#include <string.h>

#include "../runtime/runtime.h"
#include "api.h"

static bool need_float(const char *fn, const rfi_node *x)
{
    if (rfi_dtype_is_float(x->dtype))
        return true;
    rfi_graph_fail(x->g, RF_E_DTYPE, "%s: needs a float tensor, got %s", fn, RFI_TSTR(x));
    return false;
}

static bool need_same_dtype(const char *fn, const rfi_node *a, const rfi_node *b)
{
    if (!rfi_api_same_graph(fn, a, b))
        return false;
    if (a->dtype == b->dtype)
        return true;
    rfi_graph_fail(a->g, RF_E_DTYPE, "%s: dtypes of %s and %s differ", fn, RFI_TSTR(a),
                   RFI_TSTR(b));
    return false;
}

/* ---- Convolution -------------------------------------------------------------------- */

rf_conv_params rf_conv_params_default(int nspatial)
{
    rf_conv_params p;
    memset(&p, 0, sizeof p);
    p.nspatial = nspatial;
    for (int i = 0; i < 3; i++)
        p.stride[i] = p.lhs_dilation[i] = p.rhs_dilation[i] = 1;
    p.feature_group_count = p.batch_group_count = 1;
    return p;
}

/* A zero stride, dilation or group count means the default 1, so that
 * designated initialisers that name only the padding work. */
static int64_t or_one(int64_t v) { return v == 0 ? 1 : v; }

/* Checks the group counts of a convolution; the message names both shapes. */
static bool conv_groups_fit(const rfi_node *x, const rfi_node *w, int64_t fg, int64_t bg)
{
    int64_t n = x->dims[0], c = x->dims[1], o = w->dims[0], i = w->dims[1];
    const char *why = NULL;
    if (fg < 1 || bg < 1)
        why = "group counts must be >= 1";
    else if (fg > 1 && bg > 1)
        why = "feature and batch groups cannot both be > 1";
    else if (c % fg || o % fg || i != c / fg)
        why = "channels do not fit the feature groups (C % G == 0, O % G == 0, w dim 1 == C/G)";
    else if (n % bg || o % bg)
        why = "batch does not fit the batch groups (N % B == 0, O % B == 0)";
    if (!why)
        return true;
    rfi_graph_fail(x->g, RF_E_SHAPE, "rf_conv: x %s and w %s (feature groups %lld, batch "
                   "groups %lld): %s", RFI_TSTR(x), RFI_TSTR(w), (long long)fg, (long long)bg,
                   why);
    return false;
}

rf_tensor *rf_conv(rf_tensor *x, rf_tensor *w, const rf_conv_params *p)
{
    static const char fn[] = "rf_conv";
    if (!x || !w || !need_same_dtype(fn, x, w))
        return NULL;
    rf_conv_params def;
    if (!p) {
        def = rf_conv_params_default(x->rank - 2);
        p = &def;
    }
    int ns = p->nspatial;
    if (ns < 1 || ns > 3 || x->rank != ns + 2 || w->rank != ns + 2) {
        rfi_graph_fail(x->g, RF_E_SHAPE, "%s: x %s and w %s must both have rank nspatial + 2 "
                       "(nspatial %d, 1..3)", fn, RFI_TSTR(x), RFI_TSTR(w), ns);
        return NULL;
    }
    rfi_attrs attr = {0};
    for (int i = 0; i < ns; i++) {
        int64_t s = or_one(p->stride[i]), ld = or_one(p->lhs_dilation[i]);
        int64_t rd = or_one(p->rhs_dilation[i]);
        int64_t in_d, k_d, padded;
        int64_t lo = p->pad_lo[i], hi = p->pad_hi[i];
        if (s < 1 || ld < 1 || rd < 1 || !rfi_dilate_ok(x->dims[2 + i], ld, &in_d) ||
            !rfi_dilate_ok(w->dims[2 + i], rd, &k_d) || !rfi_clip_crop(in_d, &lo, &hi) ||
            !rfi_pad_ok(in_d, lo, hi, &padded) || padded < k_d) {
            rfi_graph_fail(x->g, RF_E_SHAPE, "%s: x %s and w %s do not fit along spatial axis "
                           "%d (stride %lld, padding %lld/%lld, dilation %lld/%lld)", fn,
                           RFI_TSTR(x), RFI_TSTR(w), i, (long long)s, (long long)p->pad_lo[i],
                           (long long)p->pad_hi[i], (long long)ld, (long long)rd);
            return NULL;
        }
        attr.l[0][i] = s;
        attr.l[1][i] = lo;
        attr.l[2][i] = hi;
        attr.l[3][i] = ld;
        attr.l[4][i] = rd;
    }
    for (int k = 0; k < 5; k++)
        attr.nl[k] = ns;
    int64_t fg = or_one(p->feature_group_count), bg = or_one(p->batch_group_count);
    if (!conv_groups_fit(x, w, fg, bg))
        return NULL;
    attr.i[0] = fg;
    attr.i[1] = bg;
    if (x->dtype == RF_F32) /* the others are exact whatever the setting */
        attr.i[2] = x->g->matmul_precision;
    rfi_node *in[2] = {x, w};
    return rfi_node_new(x->g, RFI_OP_CONVOLUTION, in, 2, &attr, x->dtype, NULL, 0);
}

/* ---- Windows ------------------------------------------------------------------------ */

/* Fills REDUCE_WINDOW-style attributes (l[0..3]) from the arguments
 * (strides NULL: 1; pads NULL: 0) and checks them; out gets the window
 * output shape. */
static bool window_attrs(const char *fn, const rfi_node *x, const int64_t *window,
                         const int64_t *strides, const int64_t *pad_lo, const int64_t *pad_hi,
                         rfi_attrs *attr, int64_t *out)
{
    if (x->rank > 0 && !window) {
        rfi_graph_fail(x->g, RF_E_INVALID, "%s: window is NULL for %s", fn, RFI_TSTR(x));
        return false;
    }
    for (int i = 0; i < x->rank; i++) {
        int64_t k = window[i], s = strides ? strides[i] : 1;
        int64_t lo = pad_lo ? pad_lo[i] : 0, hi = pad_hi ? pad_hi[i] : 0;
        int64_t padded;
        /* an empty axis that the window does not cover stays empty (XLA's
         * bound; a batch of 0 through a pooling layer), a non-empty one must
         * hold a window */
        if (k < 1 || s < 1 || lo < 0 || hi < 0 || !rfi_pad_ok(x->dims[i], lo, hi, &padded) ||
            (padded < k && x->dims[i] > 0)) {
            rfi_graph_fail(x->g, RF_E_SHAPE, "%s: window %lld (stride %lld, padding %lld/%lld) "
                           "does not fit axis %d of %s", fn, (long long)k, (long long)s,
                           (long long)lo, (long long)hi, i, RFI_TSTR(x));
            return false;
        }
        attr->l[0][i] = k;
        attr->l[1][i] = s;
        attr->l[2][i] = lo;
        attr->l[3][i] = hi;
        out[i] = padded < k ? 0 : (padded - k) / s + 1;
    }
    for (int k = 0; k < 4; k++)
        attr->nl[k] = x->rank;
    return true;
}

rf_tensor *rf_reduce_window(rf_tensor *x, rf_reduce_kind kind, const int64_t *window,
                            const int64_t *strides, const int64_t *pad_lo, const int64_t *pad_hi)
{
    static const char fn[] = "rf_reduce_window";
    if (!x)
        return NULL;
    if (kind != RF_REDUCE_SUM && kind != RF_REDUCE_MAX && kind != RF_REDUCE_MIN) {
        rfi_graph_fail(x->g, RF_E_INVALID, "%s: kind %d is not sum, max or min (for %s)", fn,
                       (int)kind, RFI_TSTR(x));
        return NULL;
    }
    rfi_attrs attr = {0};
    int64_t out[RF_MAX_RANK];
    if (!window_attrs(fn, x, window, strides, pad_lo, pad_hi, &attr, out))
        return NULL;
    attr.i[0] = kind;
    return rfi_node_new(x->g, RFI_OP_REDUCE_WINDOW, &x, 1, &attr, x->dtype, NULL, 0);
}

/* Pooling over the spatial dims of NCHW x with window k (stride NULL: k). */
static rfi_node *pool2d(const char *fn, rfi_node *x, rf_reduce_kind kind, const int64_t k[2],
                        const int64_t stride[2], const int64_t pad[2])
{
    if (!x)
        return NULL;
    if (x->rank != 4 || !k) {
        rfi_graph_fail(x->g, x->rank != 4 ? RF_E_SHAPE : RF_E_INVALID,
                       "%s: needs x [N, C, H, W] and a window, got %s", fn, RFI_TSTR(x));
        return NULL;
    }
    const int64_t *s = stride ? stride : k;
    int64_t window[4] = {1, 1, k[0], k[1]}, strides[4] = {1, 1, s[0], s[1]};
    int64_t pads[4] = {0, 0, pad ? pad[0] : 0, pad ? pad[1] : 0};
    /* checked under the pooling name, so the message says which call failed */
    rfi_attrs attr = {0};
    int64_t out[RF_MAX_RANK];
    if (!window_attrs(fn, x, window, strides, pads, pads, &attr, out))
        return NULL;
    return rf_reduce_window(x, kind, window, strides, pads, pads);
}

rf_tensor *rf_maxpool2d(rf_tensor *x, const int64_t k[2], const int64_t stride[2],
                        const int64_t pad[2])
{
    return pool2d("rf_maxpool2d", x, RF_REDUCE_MAX, k, stride, pad);
}

rf_tensor *rf_meanpool2d(rf_tensor *x, const int64_t k[2], const int64_t stride[2],
                         const int64_t pad[2])
{
    if (!x || !need_float("rf_meanpool2d", x))
        return NULL;
    rfi_node *sum = pool2d("rf_meanpool2d", x, RF_REDUCE_SUM, k, stride, pad);
    /* divides by the full window, padding included (Flux's MeanPool) */
    return sum ? rf_div_s(sum, (double)(k[0] * k[1])) : NULL;
}

rf_tensor *rf_select_and_scatter(rf_tensor *x, rf_tensor *source, const int64_t *window,
                                 const int64_t *strides, const int64_t *pad_lo,
                                 const int64_t *pad_hi)
{
    static const char fn[] = "rf_select_and_scatter";
    if (!x || !source || !rfi_api_same_graph(fn, x, source))
        return NULL;
    rfi_attrs attr = {0};
    int64_t out[RF_MAX_RANK];
    if (!window_attrs(fn, x, window, strides, pad_lo, pad_hi, &attr, out))
        return NULL;
    if (source->rank != x->rank ||
        (x->rank && memcmp(source->dims, out, (size_t)x->rank * sizeof *out) != 0)) {
        rfi_graph_fail(x->g, RF_E_SHAPE, "%s: source %s does not match the window output %s "
                       "of %s", fn, RFI_TSTR(source), RFI_SSTR(source->dtype, out, x->rank),
                       RFI_TSTR(x));
        return NULL;
    }
    rfi_node *in[2] = {x, source};
    return rfi_node_new(x->g, RFI_OP_SELECT_AND_SCATTER, in, 2, &attr, source->dtype, NULL, 0);
}

/* ---- Indexing ------------------------------------------------------------------------- */

static bool need_indices(const char *fn, const rfi_node *x, const rfi_node *idx)
{
    if (!rfi_api_same_graph(fn, x, idx))
        return false;
    if (idx->dtype != RF_I32 && idx->dtype != RF_I64) {
        rfi_graph_fail(x->g, RF_E_DTYPE, "%s: indices must be i32 or i64, got %s", fn,
                       RFI_TSTR(idx));
        return false;
    }
    return true;
}

/* The shape rf_gather(x, idx, a) has; false (with a message) if its rank is too big. */
static bool gather_shape(const char *fn, const rfi_node *x, const rfi_node *idx, int a,
                         int64_t *dims, int *rank)
{
    int r = x->rank - 1 + idx->rank;
    if (r > RF_MAX_RANK) {
        rfi_graph_fail(x->g, RF_E_SHAPE, "%s: result of %s indexed by %s exceeds rank %d", fn,
                       RFI_TSTR(x), RFI_TSTR(idx), RF_MAX_RANK);
        return false;
    }
    int j = 0;
    for (int i = 0; i < a; i++)
        dims[j++] = x->dims[i];
    for (int i = 0; i < idx->rank; i++)
        dims[j++] = idx->dims[i];
    for (int i = a + 1; i < x->rank; i++)
        dims[j++] = x->dims[i];
    *rank = r;
    return true;
}

rf_tensor *rf_gather(rf_tensor *x, rf_tensor *indices, int axis)
{
    static const char fn[] = "rf_gather";
    int a;
    int64_t dims[RF_MAX_RANK];
    int rank;
    if (!x || !indices || !need_indices(fn, x, indices) ||
        !rfi_api_axis(fn, x, axis, x->rank, &a) || !gather_shape(fn, x, indices, a, dims, &rank))
        return NULL;
    rfi_attrs attr = {0};
    attr.i[0] = a;
    rfi_node *in[2] = {x, indices};
    return rfi_node_new(x->g, RFI_OP_GATHER, in, 2, &attr, x->dtype, NULL, 0);
}

rf_tensor *rf_scatter_add(rf_tensor *x, rf_tensor *indices, rf_tensor *updates, int axis)
{
    static const char fn[] = "rf_scatter_add";
    int a;
    int64_t dims[RF_MAX_RANK];
    int rank;
    if (!x || !indices || !updates || !need_indices(fn, x, indices) ||
        !need_same_dtype(fn, x, updates) || !rfi_api_axis(fn, x, axis, x->rank, &a) ||
        !gather_shape(fn, x, indices, a, dims, &rank))
        return NULL;
    if (updates->rank != rank ||
        (rank && memcmp(updates->dims, dims, (size_t)rank * sizeof *dims) != 0)) {
        rfi_graph_fail(x->g, RF_E_SHAPE, "%s: updates %s do not match %s for x %s indexed by %s "
                       "along axis %d", fn, RFI_TSTR(updates), RFI_SSTR(x->dtype, dims, rank),
                       RFI_TSTR(x), RFI_TSTR(indices), a);
        return NULL;
    }
    rfi_attrs attr = {0};
    attr.i[0] = a;
    rfi_node *in[3] = {x, indices, updates};
    return rfi_node_new(x->g, RFI_OP_SCATTER_ADD, in, 3, &attr, x->dtype, NULL, 0);
}

rf_tensor *rf_take_along(rf_tensor *x, rf_tensor *idx)
{
    static const char fn[] = "rf_take_along";
    if (!x || !idx || !need_indices(fn, x, idx))
        return NULL;
    if (x->rank != 2 || idx->rank != 1 || idx->dims[0] != x->dims[0] || x->dims[1] < 1) {
        rfi_graph_fail(x->g, RF_E_SHAPE, "%s: needs x [N, C] (C >= 1) and idx [N], got %s and "
                       "%s", fn, RFI_TSTR(x), RFI_TSTR(idx));
        return NULL;
    }
    /* One gather from the flattened x at row * C + clamp(idx): O(N) and its
     * gradient is a scatter_add, not an N x C mask. */
    int64_t n = x->dims[0], c = x->dims[1], flat_dims[1] = {n * c};
    rfi_node *col = rf_convert(rf_clamp_s(idx, 0, (double)(c - 1)), RF_I64);
    rfi_node *row = rf_iota(x->g, RF_I64, &n, 1, 0);
    rfi_node *flat_idx = rf_add(rf_mul_s(row, (double)c), col);
    return rf_gather(rf_reshape(x, flat_dims, 1), flat_idx, 0);
}

rf_tensor *rf_onehot(rf_tensor *labels, int64_t nclasses, rf_dtype dt)
{
    static const char fn[] = "rf_onehot";
    if (!labels)
        return NULL;
    if (!rfi_dtype_is_int(labels->dtype) || !rfi_dtype_valid((int)dt)) {
        rfi_graph_fail(labels->g, RF_E_DTYPE, "%s: needs integer labels and a valid dtype, got "
                       "%s and dtype %d", fn, RFI_TSTR(labels), (int)dt);
        return NULL;
    }
    if (nclasses < 1 || labels->rank >= RF_MAX_RANK) {
        rfi_graph_fail(labels->g, RF_E_SHAPE, "%s: invalid class count %lld for labels %s", fn,
                       (long long)nclasses, RFI_TSTR(labels));
        return NULL;
    }
    /* u8 labels would wrap in a u8 iota past 255 classes */
    rfi_node *l = labels->dtype == RF_U8 ? rf_convert(labels, RF_I32) : labels;
    int64_t dims[RF_MAX_RANK];
    memcpy(dims, labels->dims, (size_t)labels->rank * sizeof *dims);
    dims[labels->rank] = nclasses;
    rfi_node *classes = rf_iota(labels->g, l ? l->dtype : RF_I32, dims, labels->rank + 1,
                                labels->rank);
    rfi_node *hot = rf_compare(rf_unsqueeze(l, -1), classes, RF_EQ);
    return rf_convert(hot, dt);
}

/* ---- Random numbers --------------------------------------------------------------------- */

rf_array *rf_rng_key_new(uint64_t seed, rf_device *dev)
{
    int64_t key[2] = {0, 0};
    memcpy(&key[0], &seed, sizeof seed); /* the seed's bits, whatever its sign as i64 */
    int64_t dims[1] = {2};
    return rf_array_new(dev ? dev : rf_device_default(), RF_I64, dims, 1, key);
}

rf_tensor *rf_rng_key(rf_trace *t, rf_array *key)
{
    static const char fn[] = "rf_rng_key";
    if (!t)
        return NULL;
    if (!key || key->dtype != RF_I64 || key->rank != 1 || key->dims[0] != 2) {
        rfi_graph_fail(t, RF_E_INVALID, "%s: key must be an i64[2] array (rf_rng_key_new), got "
                       "%s", fn, key ? RFI_SSTR(key->dtype, key->dims, key->rank) : "NULL");
        return NULL;
    }
    rfi_node *k = rf_capture(t, key);
    if (!k)
        return NULL;
    int capture = (int)k->attr.i[0];
    for (int i = 0; i < t->n_updates; i++)
        if (t->updates[i].capture == capture)
            return k; /* this trace already advances the key */
    static const int64_t step[2] = {0, 1}, dims[1] = {2};
    rf_assign(t, key, rf_add(k, rf_constant(t, RF_I64, dims, 1, step)));
    return t->status == RF_OK ? k : NULL;
}

static rfi_node *rng(const char *fn, int dist, rfi_node *key, rf_dtype dt, const int64_t *dims,
                     int rank)
{
    if (!key)
        return NULL;
    rfi_graph *g = key->g;
    if (key->dtype != RF_I64 || key->rank != 1 || key->dims[0] != 2) {
        rfi_graph_fail(g, RF_E_INVALID, "%s: key must be i64[2] (rf_rng_key), got %s", fn,
                       RFI_TSTR(key));
        return NULL;
    }
    if (dt != RF_F32 && dt != RF_F64) {
        rfi_graph_fail(g, RF_E_DTYPE, "%s: dtype must be f32 or f64, got %s", fn,
                       rf_dtype_name(dt));
        return NULL;
    }
    if (rank < 0 || rank > RF_MAX_RANK || (rank > 0 && !dims)) {
        rfi_graph_fail(g, RF_E_INVALID, "%s: invalid rank %d (0..%d, dims given)", fn, rank,
                       RF_MAX_RANK);
        return NULL;
    }
    for (int i = 0; i < rank; i++) {
        if (dims[i] < 0) {
            rfi_graph_fail(g, RF_E_INVALID, "%s: invalid shape %s", fn, RFI_SSTR(dt, dims, rank));
            return NULL;
        }
    }
    rfi_attrs attr = {0};
    attr.i[0] = dist;
    attr.i[1] = g->n_rng_streams;
    rfi_node *y = rfi_node_new(g, RFI_OP_RNG, &key, 1, &attr, dt, dims, rank);
    if (y)
        g->n_rng_streams++; /* each call draws from its own stream */
    return y;
}

rf_tensor *rf_rng_uniform(rf_tensor *key, rf_dtype dt, const int64_t *dims, int rank)
{
    return rng("rf_rng_uniform", 0, key, dt, dims, rank);
}

rf_tensor *rf_rng_normal(rf_tensor *key, rf_dtype dt, const int64_t *dims, int rank)
{
    return rng("rf_rng_normal", 1, key, dt, dims, rank);
}

/* ---- Activations ------------------------------------------------------------------------- */

rf_tensor *rf_relu(rf_tensor *x) { return x ? rf_max(x, rf_scalar(x->g, 0.0)) : NULL; }

rf_tensor *rf_leakyrelu(rf_tensor *x, double slope)
{
    if (!x || !need_float("rf_leakyrelu", x))
        return NULL;
    /* select, not max(x, a x), so slopes above 1 also mean "a x for x <= 0" */
    rfi_node *pos = rf_compare(x, rf_scalar(x->g, 0.0), RF_GT);
    return rf_select(pos, x, rf_mul_s(x, slope));
}

rf_tensor *rf_elu(rf_tensor *x, double alpha)
{
    if (!x || !need_float("rf_elu", x))
        return NULL;
    rfi_node *zero = rf_scalar(x->g, 0.0);
    rfi_node *pos = rf_compare(x, zero, RF_GT);
    /* expm1 of min(x, 0): the unused branch stays finite, so its gradient
     * (multiplied by zero in select) cannot become inf * 0 = NaN */
    rfi_node *neg = rf_mul_s(rf_expm1(rf_min(x, zero)), alpha);
    return rf_select(pos, x, neg);
}

rf_tensor *rf_gelu(rf_tensor *x)
{
    if (!x || !need_float("rf_gelu", x))
        return NULL;
    /* 0.5 x (1 + tanh(z)) = x logistic(2 z): the same function (NNlib's and PyTorch's
     * tanh approximation) without 1 + tanh(z) cancelling for x < -2, which lost every
     * digit from x = -5 on (f32) */
    const double c = sqrt(2.0 / 3.14159265358979323846);
    rfi_node *x3 = rf_mul(rf_mul(x, x), x);
    rfi_node *inner = rf_mul_s(rf_add(x, rf_mul_s(x3, 0.044715)), 2 * c);
    return rf_mul(x, rf_sigmoid(inner));
}

rf_tensor *rf_sigmoid(rf_tensor *x)
{
    if (!x || !need_float("rf_sigmoid", x))
        return NULL;
    return rf_logistic(x);
}

rf_tensor *rf_swish(rf_tensor *x)
{
    if (!x || !need_float("rf_swish", x))
        return NULL;
    return rf_mul(x, rf_logistic(x));
}

rf_tensor *rf_softplus(rf_tensor *x)
{
    if (!x || !need_float("rf_softplus", x))
        return NULL;
    /* max(x, 0) + log1p(exp(-|x|)): never overflows. -|x| is written
     * min(x, -x): at 0 abs's derivative is 0 (and relu's), but min's tie
     * goes to its first operand, so the gradient there is sigmoid(0) = 0.5. */
    rf_tensor *tail = rf_log1p(rf_exp(rf_min(x, rf_neg(x))));
    return rf_add(rf_relu(x), tail);
}

/* Checks a softmax-family call and returns max(x, axis) (keepdims) as a
 * stop_gradient; *axis_out receives the normalised axis. The shift cancels
 * mathematically, so its gradient is zero: differentiated, the max's VJP
 * cost two row sums (the cotangent's, and a count of ties at the max), a
 * loop, and kept the shifted scores alive for the backward pass, to add
 * what is only rounding noise (as rf_var's mean, and JAX's softmax). */
static rfi_node *row_max(const char *fn, rfi_node *x, int axis, int64_t *axis_out)
{
    int a;
    if (!x || !need_float(fn, x) || !rfi_api_axis(fn, x, axis, x->rank, &a))
        return NULL;
    *axis_out = a;
    return rf_stop_gradient(rf_reduce_max(x, axis_out, 1, true));
}

/* x - max(x, axis) (keepdims). */
static rfi_node *shifted(const char *fn, rfi_node *x, int axis, int64_t *axis_out)
{
    rfi_node *m = row_max(fn, x, axis, axis_out);
    return m ? rf_sub(x, m) : NULL;
}

rf_tensor *rf_softmax(rf_tensor *x, int axis)
{
    int64_t a;
    rfi_node *e = rf_exp(shifted("rf_softmax", x, axis, &a));
    return e ? rf_div(e, rf_sum(e, &a, 1, true)) : NULL;
}

rf_tensor *rf_logsoftmax(rf_tensor *x, int axis)
{
    int64_t a;
    rfi_node *z = shifted("rf_logsoftmax", x, axis, &a);
    return z ? rf_sub(z, rf_log(rf_sum(rf_exp(z), &a, 1, true))) : NULL;
}

rf_tensor *rf_logsumexp(rf_tensor *x, int axis, bool keepdims)
{
    int64_t a;
    rfi_node *m = row_max("rf_logsumexp", x, axis, &a);
    if (!m)
        return NULL;
    /* A row whose max is infinite (all -inf, or a +inf) is shifted by 0
     * instead: x - max would be NaN there, the sum is -inf or +inf (as JAX). */
    rfi_node *shift = rf_select(rf_is_finite(m), m, rf_zeros_like(m));
    rfi_node *r = rf_add(rf_log(rf_sum(rf_exp(rf_sub(x, shift)), &a, 1, true)), shift);
    return keepdims ? r : rf_squeeze(r, (int)a);
}
