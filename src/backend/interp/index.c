/* index.c: the interpreter's indexing and generator kernels: GATHER (NumPy
 * take along an axis, indices clamped to [0, dim-1]), SCATTER_ADD (x plus
 * updates added at indices along an axis; out-of-range indices dropped,
 * duplicates accumulate), RNG (Philox via rfi_random_fill), IOTA, CONSTANT.
 *
 * GATHER result dims are x[:axis] + indices + x[axis+1:]; SCATTER_ADD's
 * updates have that shape. Scatter sums in double (float) or wrapping int64
 * and rounds once. Deliberately no sorting or atomics: plain loops.
 */
#include "interp.h"

/* x viewed as [outer, len, inner] around `axis`. */
typedef struct axis_view {
    int64_t outer, len, inner;
} axis_view;

static axis_view view_around(const rfi_node *x, int axis)
{
    axis_view v = {rfi_numel(x->dims, axis), x->dims[axis],
                   rfi_numel(x->dims + axis + 1, x->rank - axis - 1)};
    return v;
}

static void gather(const rfi_node *n, const void *const *in, void *out)
{
    const rfi_node *x = n->in[0], *indices = n->in[1];
    axis_view v = view_around(x, (int)n->attr.i[0]);
    int64_t m_count = rfi_interp_numel(indices);
    size_t esz = rf_dtype_size(n->dtype);
    if (rfi_interp_nbytes(n) == 0) /* an empty result: buffers may be NULL, no offsets */
        return;
    if (v.len == 0) { /* nothing to take from: the result is all zero */
        memset(out, 0, rfi_interp_nbytes(n));
        return;
    }
    for (int64_t o = 0; o < v.outer; o++) {
        for (int64_t m = 0; m < m_count; m++) {
            int64_t j = rfi_ld_i(in[1], indices->dtype, m);
            j = j < 0 ? 0 : j >= v.len ? v.len - 1 : j;
            rfi_interp_copy((char *)out + (size_t)((o * m_count + m) * v.inner) * esz,
                            (const char *)in[0] + (size_t)((o * v.len + j) * v.inner) * esz,
                            (size_t)v.inner * esz);
        }
    }
}

static rf_status scatter_add(const rfi_node *n, const void *const *in, void *out)
{
    const rfi_node *x = n->in[0], *indices = n->in[1], *updates = n->in[2];
    axis_view v = view_around(x, (int)n->attr.i[0]);
    int64_t m_count = rfi_interp_numel(indices);
    int64_t count = rfi_interp_numel(x);
    bool is_float = rfi_dtype_is_float(x->dtype);
    size_t n_acc = count > 0 ? (size_t)count : 1;
    double *accf = is_float ? rfi_malloc(n_acc * sizeof(double)) : NULL;
    int64_t *acci = is_float ? NULL : rfi_malloc(n_acc * sizeof(int64_t));
    if (!accf && !acci)
        return rfi_error(RF_E_NOMEM, "interp: scatter_add: out of memory");

    for (int64_t k = 0; k < count; k++) {
        if (is_float)
            accf[k] = rfi_ld_f(in[0], x->dtype, k);
        else
            acci[k] = rfi_ld_i(in[0], x->dtype, k);
    }
    for (int64_t o = 0; o < v.outer; o++) {
        for (int64_t m = 0; m < m_count; m++) {
            int64_t j = rfi_ld_i(in[1], indices->dtype, m);
            if (j < 0 || j >= v.len)
                continue; /* dropped */
            for (int64_t i = 0; i < v.inner; i++) {
                int64_t dst = (o * v.len + j) * v.inner + i;
                int64_t src = (o * m_count + m) * v.inner + i;
                if (is_float)
                    accf[dst] += rfi_ld_f(in[2], updates->dtype, src);
                else
                    acci[dst] = rfi_wadd(acci[dst], rfi_ld_i(in[2], updates->dtype, src));
            }
        }
    }
    for (int64_t k = 0; k < count; k++) {
        if (is_float)
            rfi_st_f(out, n->dtype, k, accf[k]);
        else
            rfi_st_i(out, n->dtype, k, acci[k]);
    }
    rfi_free(accf);
    rfi_free(acci);
    return RF_OK;
}

/* key = {seed, counter}; attr i[0] distribution (0 uniform, 1 normal), i[1] stream. */
static rf_status rng(const rfi_node *n, const void *key, void *out)
{
    if (!rfi_dtype_is_float(n->dtype))
        return rfi_error(RF_E_INTERNAL, "interp: rng: result dtype %s is not a float type",
                         rf_dtype_name(n->dtype));
    rf_dtype kt = n->in[0]->dtype;
    uint64_t seed = (uint64_t)rfi_ld_i(key, kt, 0);
    uint64_t counter = (uint64_t)rfi_ld_i(key, kt, 1);
    rfi_random_fill(seed, counter, (uint32_t)n->attr.i[1], (int)n->attr.i[0], n->dtype, out,
                    rfi_interp_numel(n));
    return RF_OK;
}

/* Each element holds its index along attr i[0]. */
static void iota(const rfi_node *n, void *out)
{
    int axis = (int)n->attr.i[0];
    int64_t count = rfi_interp_numel(n);
    int64_t inner = rfi_numel(n->dims + axis + 1, n->rank - axis - 1);
    for (int64_t k = 0; k < count; k++)
        rfi_st_i(out, n->dtype, k, (k / inner) % n->dims[axis]);
}

static rf_status constant(const rfi_node *n, void *out)
{
    size_t nbytes = rfi_interp_nbytes(n);
    if (n->attr.nbytes != nbytes || (nbytes > 0 && !n->attr.data))
        return rfi_error(RF_E_INTERNAL, "interp: constant %%%d holds %zu bytes, expected %zu",
                         (int)n->id, n->attr.nbytes, nbytes);
    rfi_interp_copy(out, n->attr.data, nbytes);
    return RF_OK;
}

rf_status rfi_interp_index(const rfi_node *n, const void *const *in, void *out)
{
    switch (n->op) {
    case RFI_OP_GATHER: gather(n, in, out); return RF_OK;
    case RFI_OP_SCATTER_ADD: return scatter_add(n, in, out);
    case RFI_OP_RNG: return rng(n, in[0], out);
    case RFI_OP_IOTA: iota(n, out); return RF_OK;
    case RFI_OP_CONSTANT: return constant(n, out);
    default:
        return rfi_error(RF_E_INTERNAL, "interp: %s is not an indexing op",
                         rfi_op_table[n->op].name);
    }
}
