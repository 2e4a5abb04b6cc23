/* shape_ops.c: the interpreter's data-movement kernels: BROADCAST_IN_DIM,
 * RESHAPE, TRANSPOSE, SLICE, CONCATENATE, PAD (negative edges and interior
 * padding included) and REVERSE. Elements are moved as bytes; no arithmetic.
 *
 * Broadcast, transpose, slice and reverse are all "output element at index k
 * reads input offset base + sum k[d] * step[d]", so one strided copy serves
 * them, row by row with an odometer (no division per element). Deliberately
 * no blocking or aliasing tricks: plain loops.
 */
#include "interp.h"

/* dst[j] = src[j * step] for j < len, moving elements of esz bytes (typed loops
 * for the common sizes, so the switch runs once per row). */
static void copy_row(char *dst, const char *src, int64_t step, int64_t len, size_t esz)
{
    switch (esz) {
    case 1:
        for (int64_t j = 0; j < len; j++)
            ((uint8_t *)dst)[j] = ((const uint8_t *)src)[j * step];
        break;
    case 4:
        for (int64_t j = 0; j < len; j++)
            ((uint32_t *)dst)[j] = ((const uint32_t *)src)[j * step];
        break;
    case 8:
        for (int64_t j = 0; j < len; j++)
            ((uint64_t *)dst)[j] = ((const uint64_t *)src)[j * step];
        break;
    default:
        for (int64_t j = 0; j < len; j++)
            memcpy(dst + j * (int64_t)esz, src + j * step * (int64_t)esz, esz);
        break;
    }
}

/* out[k] = in[base + sum_d k[d] * step[d]] for every index k over dims: one row
 * along the last dim at a time, the row's start kept by an odometer over the
 * leading dims. */
static void strided_copy(const rfi_node *n, const void *in, void *out, int64_t base,
                         const int64_t *step)
{
    size_t esz = rf_dtype_size(n->dtype);
    int64_t count = rfi_interp_numel(n);
    if (count == 0)
        return;
    int lead = n->rank > 0 ? n->rank - 1 : 0; /* dims walked by the odometer */
    int64_t row_len = n->rank > 0 ? n->dims[n->rank - 1] : 1;
    int64_t row_step = n->rank > 0 ? step[n->rank - 1] : 0;
    int64_t idx[RF_MAX_RANK] = {0}, src = base;
    for (int64_t o = 0; o < count; o += row_len) {
        copy_row((char *)out + (size_t)o * esz, (const char *)in + (size_t)src * esz, row_step,
                 row_len, esz);
        rfi_interp_next_offset(idx, n->dims, step, lead, &src);
    }
}

/* Operand dim i goes to result dim map[i]; a size-1 operand dim repeats. */
static void broadcast_in_dim(const rfi_node *n, const void *in, void *out)
{
    const rfi_node *x = n->in[0];
    int64_t xs[RF_MAX_RANK], step[RF_MAX_RANK] = {0};
    rfi_interp_strides(x->dims, x->rank, xs);
    for (int i = 0; i < x->rank; i++)
        if (x->dims[i] != 1)
            step[n->attr.l[0][i]] = xs[i];
    strided_copy(n, in, out, 0, step);
}

/* Result dim d is operand dim perm[d]. */
static void transpose(const rfi_node *n, const void *in, void *out)
{
    const rfi_node *x = n->in[0];
    int64_t xs[RF_MAX_RANK], step[RF_MAX_RANK];
    rfi_interp_strides(x->dims, x->rank, xs);
    for (int d = 0; d < n->rank; d++)
        step[d] = xs[n->attr.l[0][d]];
    strided_copy(n, in, out, 0, step);
}

/* Result index k reads operand index start + k * stride. */
static void slice(const rfi_node *n, const void *in, void *out)
{
    const rfi_node *x = n->in[0];
    int64_t xs[RF_MAX_RANK], step[RF_MAX_RANK], base = 0;
    rfi_interp_strides(x->dims, x->rank, xs);
    for (int d = 0; d < n->rank; d++) {
        base += n->attr.l[0][d] * xs[d];
        /* a stride past the slice's one element is never taken (and the
         * product might not fit); else stride * xs <= dim * xs fits */
        step[d] = n->dims[d] > 1 ? n->attr.l[2][d] * xs[d] : 0;
    }
    strided_copy(n, in, out, base, step);
}

/* Reversed axes read from the far end backwards. */
static void reverse(const rfi_node *n, const void *in, void *out)
{
    int64_t xs[RF_MAX_RANK], step[RF_MAX_RANK], base = 0;
    rfi_interp_strides(n->dims, n->rank, xs);
    memcpy(step, xs, sizeof(int64_t) * (size_t)n->rank);
    for (int k = 0; k < n->attr.nl[0]; k++) {
        int d = (int)n->attr.l[0][k];
        base += (n->dims[d] - 1) * xs[d];
        step[d] = -xs[d];
    }
    if (rfi_interp_numel(n) > 0)
        strided_copy(n, in, out, base, step);
}

/* Operands laid side by side along `axis`: each is a run of outer blocks. */
static void concatenate(const rfi_node *n, const void *const *in, void *out)
{
    int axis = (int)n->attr.i[0];
    size_t esz = rf_dtype_size(n->dtype);
    int64_t outer = rfi_numel(n->dims, axis);
    int64_t inner = rfi_numel(n->dims + axis + 1, n->rank - axis - 1);
    int64_t out_row = n->dims[axis] * inner; /* elements per outer block of the result */
    int64_t offset = 0;                       /* where this operand starts in a block */
    for (int k = 0; k < n->n_in; k++) {
        int64_t row = n->in[k]->dims[axis] * inner;
        if (row == 0) /* an empty operand: its buffer may be NULL, no offset from it */
            continue;
        for (int64_t o = 0; o < outer; o++)
            rfi_interp_copy((char *)out + (size_t)(o * out_row + offset) * esz,
                   (const char *)in[k] + (size_t)(o * row) * esz, (size_t)row * esz);
        offset += row;
    }
}

/* Fill with the padding value, then place operand element i at
 * low + i * (interior + 1) in every dim when that lands inside the result
 * (negative low/high crop). */
static void pad(const rfi_node *n, const void *const *in, void *out)
{
    const rfi_node *x = n->in[0];
    size_t esz = rf_dtype_size(n->dtype);
    int64_t count = rfi_interp_numel(n);
    for (int64_t o = 0; o < count; o++)
        memcpy((char *)out + (size_t)o * esz, in[1], esz);

    int64_t os[RF_MAX_RANK];
    rfi_interp_strides(n->dims, n->rank, os);
    int64_t xcount = rfi_interp_numel(x);
    int64_t idx[RF_MAX_RANK] = {0};
    for (int64_t i = 0; i < xcount; i++) {
        int64_t dst = 0;
        bool inside = true;
        for (int d = 0; d < x->rank; d++) {
            int64_t p = n->attr.l[0][d] + idx[d] * (n->attr.l[2][d] + 1);
            if (p < 0 || p >= n->dims[d])
                inside = false;
            dst += p * os[d];
        }
        if (inside)
            memcpy((char *)out + (size_t)dst * esz, (const char *)in[0] + (size_t)i * esz, esz);
        rfi_interp_next(idx, x->dims, x->rank);
    }
}

rf_status rfi_interp_shape(const rfi_node *n, const void *const *in, void *out)
{
    switch (n->op) {
    case RFI_OP_BROADCAST_IN_DIM: broadcast_in_dim(n, in[0], out); return RF_OK;
    case RFI_OP_RESHAPE: rfi_interp_copy(out, in[0], rfi_interp_nbytes(n)); return RF_OK;
    case RFI_OP_TRANSPOSE: transpose(n, in[0], out); return RF_OK;
    case RFI_OP_SLICE: slice(n, in[0], out); return RF_OK;
    case RFI_OP_CONCATENATE: concatenate(n, in, out); return RF_OK;
    case RFI_OP_PAD: pad(n, in, out); return RF_OK;
    case RFI_OP_REVERSE: reverse(n, in[0], out); return RF_OK;
    default:
        return rfi_error(RF_E_INTERNAL, "interp: %s is not a shape op", rfi_op_table[n->op].name);
    }
}
