/* layers_conv.c: convolution and pooling layers on NCHW input: Conv,
 * ConvTranspose, MaxPool, MeanPool, GlobalMeanPool, AdaptiveMeanPool.
 *
 * Layouts follow PyTorch so checkpoints load there: Conv weight
 * [out, in/groups, kh, kw], ConvTranspose weight [in, out/groups, kh, kw],
 * bias [out]. Convolution is cross-correlation like PyTorch and StableHLO
 * (Flux flips the kernel; a Flux kernel loads here reversed on its spatial
 * axes). SamePad is Flux's: (k-1)*dilation padding per spatial dim, the odd
 * unit on the low side, so the output size is ceil(in / stride).
 *
 * ConvTranspose is the gradient of Conv with respect to its input, built as
 * one rf_conv: the input spaced by the stride (lhs dilation), padded by
 * (k-1)*dilation - pad, with the kernel reversed spatially and its channel
 * axes swapped per group. Output size (in-1)*stride - 2*pad +
 * dilation*(k-1) + 1, PyTorch's with output_padding 0 (no output_padding).
 *
 * AdaptiveMeanPool only handles input sizes divisible by the output size (a
 * MeanPool with k = stride = in/out); other sizes fail with RF_E_UNSUPPORTED
 * rather than silently using PyTorch's overlapping windows.
 *
 * Layers only build IR through the public op API and never touch array data
 * except for host-side initialisation.
 */
#include "model.h"

#include <stdio.h>
#include <string.h>

/* ---- Shared helpers --------------------------------------------------------------------- */


/* Checks that x is a floating-point NCHW tensor (channels < 0: any count). */
static bool check_nchw(rf_model *m, rf_tensor *x, int64_t channels)
{
    if (rf_tensor_rank(x) != 4) {
        rfi_layer_input_error(m, x, RF_E_SHAPE, "must be [N, C, H, W]");
        return false;
    }
    rf_dtype dt = rf_tensor_dtype(x);
    if (dt != RF_F32 && dt != RF_F64) {
        rfi_layer_input_error(m, x, RF_E_DTYPE, "must be floating point");
        return false;
    }
    if (!rfi_layer_check_dtype(m, x))
        return false;
    if (channels >= 0 && rf_tensor_dim(x, 1) != channels) {
        rfi_layer_input_error(m, x, RF_E_SHAPE, "has %lld channels, expected %lld",
                              (long long)rf_tensor_dim(x, 1), (long long)channels);
        return false;
    }
    return true;
}

/* Adds the bias [C] along axis 1 of an NCHW tensor. */
static rf_tensor *add_channel_bias(rf_tensor *y, rf_tensor *b)
{
    const int64_t dims[4] = {1, rf_tensor_dim(b, 0), 1, 1};
    return rf_add(y, rf_reshape(b, dims, 4));
}

/* Takes over the new model unless `st` failed, in which case it frees it. */
static rf_model *finish(rf_model *m, rf_status st)
{
    if (st == RF_OK)
        return m;
    rf_model_free(m);
    return NULL;
}

/* ---- Conv and ConvTranspose ----------------------------------------------------------------- */

typedef struct conv_config {
    int64_t k[2];
    int64_t in, out;
    int64_t stride[2];
    int64_t pad[2]; /* symmetric; ignored when pad_same */
    int64_t dilation[2];
    int64_t groups;
    int32_t act;
    uint8_t pad_same, has_bias, transpose;
} conv_config;

static int64_t effective_kernel(const conv_config *c, int i)
{
    return (c->k[i] - 1) * c->dilation[i] + 1;
}

/* a / 2 rounded towards -infinity (Julia's fld(a, 2)) */
static int64_t floor_half(int64_t a) { return a >= 0 ? a / 2 : -((1 - a) / 2); }

/* The padding of spatial dim i: symmetric, or Flux's SamePad: (k - 1) *
 * dilation in all, the odd unit low (cld and fld in Flux's calc_padding),
 * and for ConvTranspose the same with k - stride + 1 for k (negative when
 * the stride exceeds the kernel: a crop), so that the output is in * stride. */
static void conv_padding(const conv_config *c, int i, int64_t *lo, int64_t *hi)
{
    if (c->pad_same) {
        int64_t k = c->transpose ? c->k[i] - c->stride[i] + 1 : c->k[i];
        int64_t total = (k - 1) * c->dilation[i];
        *lo = -floor_half(-total);
        *hi = floor_half(total);
    } else {
        *lo = *hi = c->pad[i];
    }
}

/* Appends to buf (capacity n, text length *len so far), never overrunning. */
static void append(char *buf, size_t n, int *len, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void append(char *buf, size_t n, int *len, const char *fmt, ...)
{
    if (*len < 0 || (size_t)*len >= n)
        return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(buf + *len, n - (size_t)*len, fmt, ap);
    va_end(ap);
    *len = k < 0 ? -1 : *len + k;
}

/* ", stride=2" or ", stride=(2, 1)": a pair shown once when both are equal, as Flux does */
static void append_pair(char *buf, size_t n, int *len, const char *key, const int64_t v[2])
{
    if (v[0] == v[1])
        append(buf, n, len, ", %s=%lld", key, (long long)v[0]);
    else
        append(buf, n, len, ", %s=(%lld, %lld)", key, (long long)v[0], (long long)v[1]);
}

/* "(3, 3), 1 => 32, relu, stride=2, pad=1": Flux's Conv printing */
static void conv_describe(const rf_model *m, char *buf, size_t n)
{
    const conv_config *c = rf_model_config(m);
    int len = 0;
    append(buf, n, &len, "(%lld, %lld), %lld => %lld", (long long)c->k[0], (long long)c->k[1],
           (long long)c->in, (long long)c->out);
    if (c->act != RF_ACT_IDENTITY)
        append(buf, n, &len, ", %s", rf_act_name((rf_act)c->act));
    if (c->stride[0] != 1 || c->stride[1] != 1)
        append_pair(buf, n, &len, "stride", c->stride);
    if (c->pad_same)
        append(buf, n, &len, ", pad=SamePad()");
    else if (c->pad[0] != 0 || c->pad[1] != 0)
        append_pair(buf, n, &len, "pad", c->pad);
    if (c->dilation[0] != 1 || c->dilation[1] != 1)
        append_pair(buf, n, &len, "dilation", c->dilation);
    if (c->groups != 1)
        append(buf, n, &len, ", groups=%lld", (long long)c->groups);
    if (!c->has_bias)
        append(buf, n, &len, ", bias=false");
}

/* The ConvTranspose weight [in, out/g, kh, kw] as the kernel of the
 * equivalent convolution: [out, in/g, kh, kw], spatially reversed. */
static rf_tensor *transposed_kernel(rf_tensor *w, const conv_config *c)
{
    int64_t g = c->groups;
    const int64_t split[5] = {g, c->in / g, c->out / g, c->k[0], c->k[1]};
    const int64_t perm[5] = {0, 2, 1, 3, 4};
    const int64_t merged[4] = {c->out, c->in / g, c->k[0], c->k[1]};
    const int64_t spatial[2] = {2, 3};
    rf_tensor *swapped = rf_transpose(rf_reshape(w, split, 5), perm);
    return rf_reverse(rf_reshape(swapped, merged, 4), spatial, 2);
}

static rf_tensor *conv_forward(rf_model *m, rf_tensor *x)
{
    const conv_config *c = rf_model_config(m);
    rf_trace *t = rf_tensor_trace(x);
    if (!check_nchw(m, x, c->in))
        return NULL;
    rf_conv_params p = rf_conv_params_default(2);
    p.feature_group_count = c->groups;
    for (int i = 0; i < 2; i++) {
        int64_t lo, hi, size = rf_tensor_dim(x, 2 + i), keff = effective_kernel(c, i);
        conv_padding(c, i, &lo, &hi);
        p.rhs_dilation[i] = c->dilation[i];
        if (c->transpose) {
            /* gradient of a strided conv w.r.t. its input: space the input by the stride */
            p.lhs_dilation[i] = c->stride[i];
            p.pad_lo[i] = keff - 1 - lo;
            p.pad_hi[i] = keff - 1 - hi;
            if ((size - 1) * c->stride[i] + keff - lo - hi < 1)
                return rfi_layer_input_error(m, x, RF_E_SHAPE,
                                             "gives an empty output along axis %d", 2 + i);
        } else {
            p.stride[i] = c->stride[i];
            p.pad_lo[i] = lo;
            p.pad_hi[i] = hi;
            if (size + lo + hi < keff)
                return rfi_layer_input_error(m, x, RF_E_SHAPE,
                                             "is smaller along axis %d (%lld, padded %lld) "
                                             "than the dilated kernel (%lld)", 2 + i,
                                             (long long)size, (long long)(size + lo + hi),
                                             (long long)keff);
        }
    }
    rf_tensor *w = rf_model_param(m, t, 0);
    if (c->transpose)
        w = transposed_kernel(w, c);
    rf_tensor *y = rf_conv(x, w, &p);
    if (c->has_bias)
        y = add_channel_bias(y, rf_model_param(m, t, 1));
    return rf_activate(y, (rf_act)c->act);
}

static const rf_layer_type conv_type = {"Conv", conv_forward, conv_describe};
static const rf_layer_type conv_transpose_type = {"ConvTranspose", conv_forward, conv_describe};

/* Fills and checks the configuration from the arguments and opts (NULL: defaults). */
static rf_status conv_config_make(const char *name, int64_t kh, int64_t kw, int64_t in,
                                  int64_t out, rf_act act, const rf_conv_opts *o,
                                  bool transpose, conv_config *c)
{
    static const rf_conv_opts defaults = {{0, 0}, {0, 0}, false, {0, 0}, 0, false,
                                          RF_INIT_GLOROT_UNIFORM, 0};
    if (!o)
        o = &defaults;
    memset(c, 0, sizeof *c); /* config bytes are hashed: no stray padding */
    c->k[0] = kh;
    c->k[1] = kw;
    c->in = in;
    c->out = out;
    c->groups = o->groups ? o->groups : 1;
    c->act = (int32_t)act;
    c->pad_same = o->pad_same;
    c->has_bias = !o->no_bias;
    c->transpose = transpose;
    for (int i = 0; i < 2; i++) {
        c->stride[i] = o->stride[i] ? o->stride[i] : 1;
        c->dilation[i] = o->dilation[i] ? o->dilation[i] : 1;
        c->pad[i] = o->pad[i];
    }
    if (kh < 1 || kw < 1 || in < 1 || out < 1)
        return rfi_error(RF_E_INVALID, "%s((%lld, %lld), %lld => %lld): kernel sizes and "
                         "channel counts must be positive", name, (long long)kh, (long long)kw,
                         (long long)in, (long long)out);
    if ((unsigned)act >= RF_ACT_COUNT)
        return rfi_error(RF_E_INVALID, "%s: unknown activation %d", name, (int)act);
    if ((unsigned)o->init >= RF_INIT_COUNT)
        return rfi_error(RF_E_INVALID, "%s: unknown initialiser %d", name, (int)o->init);
    for (int i = 0; i < 2; i++) {
        if (c->stride[i] < 1 || c->dilation[i] < 1 || c->pad[i] < 0)
            return rfi_error(RF_E_INVALID, "%s((%lld, %lld), %lld => %lld): stride (%lld) and "
                             "dilation (%lld) must be positive and pad (%lld) non-negative",
                             name, (long long)kh, (long long)kw, (long long)in,
                             (long long)out, (long long)c->stride[i],
                             (long long)c->dilation[i], (long long)c->pad[i]);
    }
    if (o->pad_same && (o->pad[0] || o->pad[1]))
        return rfi_error(RF_E_INVALID, "%s: pad and pad_same are exclusive", name);
    if (c->groups < 1 || in % c->groups || out % c->groups)
        return rfi_error(RF_E_INVALID, "%s((%lld, %lld), %lld => %lld): groups = %lld must be "
                         "positive and divide both channel counts", name, (long long)kh,
                         (long long)kw, (long long)in, (long long)out, (long long)c->groups);
    return RF_OK;
}

static rf_model *conv_new(const rf_layer_type *type, int64_t kh, int64_t kw, int64_t in,
                          int64_t out, rf_act act, const rf_conv_opts *o, bool transpose)
{
    conv_config c;
    if (conv_config_make(type->name, kh, kw, in, out, act, o, transpose, &c) != RF_OK)
        return NULL;
    rf_model *m = rf_model_new(type, &c, sizeof c);
    if (!m)
        return NULL;
    /* Conv [out, in/g, kh, kw]; ConvTranspose [in, out/g, kh, kw]: the fans
     * rf_init_array reads from that layout match Flux's for both */
    const int64_t wdims[4] = {transpose ? in : out, (transpose ? out : in) / c.groups, kh, kw};
    const int64_t bdims[1] = {out};
    rf_array *weight = rf_init_array(o ? o->init : RF_INIT_GLOROT_UNIFORM, wdims, 4,
                                     rfi_nn_next_seed(o ? o->seed : 0));
    rf_status st = rf_model_add_param(m, "weight", weight);
    if (st == RF_OK && c.has_bias)
        st = rf_model_add_param(m, "bias", rf_zeros(RF_F32, bdims, 1));
    return finish(m, st);
}

rf_model *rf_conv2d(int64_t kh, int64_t kw, int64_t in, int64_t out, rf_act act,
                    const rf_conv_opts *o)
{
    return conv_new(&conv_type, kh, kw, in, out, act, o, false);
}

rf_model *rf_conv_transpose2d(int64_t kh, int64_t kw, int64_t in, int64_t out, rf_act act,
                              const rf_conv_opts *o)
{
    return conv_new(&conv_transpose_type, kh, kw, in, out, act, o, true);
}

/* ---- MaxPool and MeanPool ------------------------------------------------------------------- */

typedef struct pool_config {
    int64_t k[2], stride[2], pad[2];
} pool_config;

/* "(3, 3), pad=1, stride=2": Flux's MaxPool/MeanPool printing */
static void pool_describe(const rf_model *m, char *buf, size_t n)
{
    const pool_config *c = rf_model_config(m);
    int len = 0;
    append(buf, n, &len, "(%lld, %lld)", (long long)c->k[0], (long long)c->k[1]);
    if (c->pad[0])
        append(buf, n, &len, ", pad=%lld", (long long)c->pad[0]);
    if (c->stride[0] != c->k[0] || c->stride[1] != c->k[1])
        append(buf, n, &len, ", stride=%lld", (long long)c->stride[0]);
}

/* Checks that the (padded) window fits x's spatial dims. */
static bool check_window(rf_model *m, rf_tensor *x, const int64_t k[2], const int64_t pad[2])
{
    for (int i = 0; i < 2; i++) {
        int64_t size = rf_tensor_dim(x, 2 + i);
        if (size + 2 * pad[i] < k[i]) {
            rfi_layer_input_error(m, x, RF_E_SHAPE,
                                  "is smaller along axis %d (%lld, padded %lld) than the window "
                                  "(%lld)", 2 + i, (long long)size,
                                  (long long)(size + 2 * pad[i]), (long long)k[i]);
            return false;
        }
    }
    return true;
}

static rf_tensor *maxpool_forward(rf_model *m, rf_tensor *x)
{
    const pool_config *c = rf_model_config(m);
    if (!check_nchw(m, x, -1) || !check_window(m, x, c->k, c->pad))
        return NULL;
    return rf_maxpool2d(x, c->k, c->stride, c->pad);
}

/* Divides by the whole window, padding included (Flux's MeanPool; PyTorch's
 * count_include_pad=True). */
static rf_tensor *meanpool_forward(rf_model *m, rf_tensor *x)
{
    const pool_config *c = rf_model_config(m);
    if (!check_nchw(m, x, -1) || !check_window(m, x, c->k, c->pad))
        return NULL;
    return rf_meanpool2d(x, c->k, c->stride, c->pad);
}

static const rf_layer_type maxpool_type = {"MaxPool", maxpool_forward, pool_describe};
static const rf_layer_type meanpool_type = {"MeanPool", meanpool_forward, pool_describe};

static rf_model *pool_new(const rf_layer_type *type, int64_t kh, int64_t kw, int64_t stride,
                          int64_t pad)
{
    if (kh < 1 || kw < 1 || stride < 0 || pad < 0) {
        rfi_error(RF_E_INVALID, "%s((%lld, %lld)): window sizes must be positive, stride "
                  "(%lld) and pad (%lld) non-negative", type->name, (long long)kh,
                  (long long)kw, (long long)stride, (long long)pad);
        return NULL;
    }
    pool_config c;
    memset(&c, 0, sizeof c);
    c.k[0] = kh;
    c.k[1] = kw;
    c.stride[0] = stride ? stride : kh; /* Flux: stride defaults to the window */
    c.stride[1] = stride ? stride : kw;
    c.pad[0] = c.pad[1] = pad;
    return rf_model_new(type, &c, sizeof c);
}

rf_model *rf_maxpool(int64_t kh, int64_t kw, int64_t stride, int64_t pad)
{
    return pool_new(&maxpool_type, kh, kw, stride, pad);
}

rf_model *rf_meanpool(int64_t kh, int64_t kw, int64_t stride, int64_t pad)
{
    return pool_new(&meanpool_type, kh, kw, stride, pad);
}

/* ---- GlobalMeanPool and AdaptiveMeanPool ------------------------------------------------- */

/* Mean over every spatial axis, kept as size 1: [N, C, ...] -> [N, C, 1, ...]. */
static rf_tensor *global_meanpool_forward(rf_model *m, rf_tensor *x)
{
    int rank = rf_tensor_rank(x);
    rf_dtype dt = rf_tensor_dtype(x);
    if (rank < 3)
        return rfi_layer_input_error(m, x, RF_E_SHAPE, "must be [N, C, spatial...]");
    if (dt != RF_F32 && dt != RF_F64)
        return rfi_layer_input_error(m, x, RF_E_DTYPE, "must be floating point");
    int64_t axes[RF_MAX_RANK];
    for (int i = 2; i < rank; i++)
        axes[i - 2] = i;
    return rf_mean(x, axes, rank - 2, true);
}

static const rf_layer_type global_meanpool_type = {"GlobalMeanPool", global_meanpool_forward,
                                                   NULL};

rf_model *rf_global_meanpool(void)
{
    return rf_model_new(&global_meanpool_type, NULL, 0);
}

typedef struct adaptive_config {
    int64_t out[2];
} adaptive_config;

static void adaptive_describe(const rf_model *m, char *buf, size_t n)
{
    const adaptive_config *c = rf_model_config(m);
    snprintf(buf, n, "(%lld, %lld)", (long long)c->out[0], (long long)c->out[1]);
}

static rf_tensor *adaptive_meanpool_forward(rf_model *m, rf_tensor *x)
{
    const adaptive_config *c = rf_model_config(m);
    if (!check_nchw(m, x, -1))
        return NULL;
    int64_t h = rf_tensor_dim(x, 2), w = rf_tensor_dim(x, 3);
    if (h < c->out[0] || w < c->out[1])
        return rfi_layer_input_error(m, x, RF_E_SHAPE, "has spatial size %lldx%lld, smaller "
                                     "than the output size %lldx%lld", (long long)h,
                                     (long long)w, (long long)c->out[0], (long long)c->out[1]);
    if (h % c->out[0] != 0 || w % c->out[1] != 0)
        return rfi_layer_input_error(m, x, RF_E_UNSUPPORTED,
                                     "has spatial size %lldx%lld, not divisible by the output "
                                     "size %lldx%lld (only equal, non-overlapping windows are "
                                     "supported)",
                                     (long long)h, (long long)w, (long long)c->out[0],
                                     (long long)c->out[1]);
    const int64_t k[2] = {h / c->out[0], w / c->out[1]};
    return rf_meanpool2d(x, k, k, NULL);
}

static const rf_layer_type adaptive_meanpool_type = {"AdaptiveMeanPool",
                                                     adaptive_meanpool_forward,
                                                     adaptive_describe};

rf_model *rf_adaptive_meanpool(int64_t oh, int64_t ow)
{
    if (oh < 1 || ow < 1) {
        rfi_error(RF_E_INVALID, "AdaptiveMeanPool((%lld, %lld)): output sizes must be positive",
                  (long long)oh, (long long)ow);
        return NULL;
    }
    adaptive_config c;
    memset(&c, 0, sizeof c);
    c.out[0] = oh;
    c.out[1] = ow;
    return rf_model_new(&adaptive_meanpool_type, &c, sizeof c);
}
