/* contract.c: the contraction core shared by DOT_GENERAL (linalg.c) and
 * CONVOLUTION (conv.c): operands gathered into canonical row-major matrices
 * (rfi_dense: double for float operands, wrapping int64 for integers), one
 * plain matrix product, and the rounding store into the result dtype.
 *
 * The product runs i-k-j: for each result row, add a[i,k] * (row k of b) for
 * k = 0, 1, ...; the inner loop runs over contiguous memory and vectorises,
 * and each result element is still the sum of its products in increasing k
 * starting from zero, i.e. exactly the plain dot product. Deliberately no
 * blocking, reassociation, BLAS or threads: this is the oracle.
 */
#include "interp.h"

rf_status rfi_dense_alloc(rfi_dense *d, bool is_float, int64_t count, const char *what)
{
    size_t n = count > 0 ? (size_t)count : 1;
    d->is_float = is_float;
    d->f = is_float ? rfi_calloc(n, sizeof(double)) : NULL;
    d->i = is_float ? NULL : rfi_calloc(n, sizeof(int64_t));
    if (!d->f && !d->i)
        return rfi_error(RF_E_NOMEM, "interp: %s: out of memory for %lld values", what,
                         (long long)count);
    return RF_OK;
}

void rfi_dense_free(rfi_dense *d)
{
    rfi_free(d->f);
    rfi_free(d->i);
    d->f = NULL;
    d->i = NULL;
}

/* The typed loops of rfi_dense_gather: f32 and f64 sources, the common case. */
static void gather_f32(double *dst, const float *src, const int64_t *offsets, int64_t count)
{
    for (int64_t k = 0; k < count; k++)
        dst[k] = offsets[k] < 0 ? 0.0 : (double)src[offsets[k]];
}

static void gather_f64(double *dst, const double *src, const int64_t *offsets, int64_t count)
{
    for (int64_t k = 0; k < count; k++)
        dst[k] = offsets[k] < 0 ? 0.0 : src[offsets[k]];
}

void rfi_dense_gather(rfi_dense *d, const void *src, rf_dtype dt, int64_t base,
                      const int64_t *offsets, int64_t count)
{
    if (count == 0) /* src may then be NULL (a constant with no elements) */
        return;
    if (d->is_float && dt == RF_F32)
        gather_f32(d->f, (const float *)src + base, offsets, count);
    else if (d->is_float && dt == RF_F64)
        gather_f64(d->f, (const double *)src + base, offsets, count);
    else if (d->is_float)
        for (int64_t k = 0; k < count; k++)
            d->f[k] = offsets[k] < 0 ? 0.0 : rfi_ld_f(src, dt, base + offsets[k]);
    else
        for (int64_t k = 0; k < count; k++)
            d->i[k] = offsets[k] < 0 ? 0 : rfi_ld_i(src, dt, base + offsets[k]);
}

void rfi_dense_round_bf16(rfi_dense *d, int64_t count)
{
    for (int64_t k = 0; k < count; k++)
        d->f[k] = rfi_round_bf16((float)d->f[k]);
}

void rfi_interp_offsets(const int64_t *dims, const int64_t *step, int rank, int64_t *offsets)
{
    int64_t count = rfi_numel(dims, rank), offset = 0;
    int64_t idx[RF_MAX_RANK] = {0};
    for (int64_t k = 0; k < count; k++) {
        offsets[k] = offset;
        rfi_interp_next_offset(idx, dims, step, rank, &offset);
    }
}

static void matmul_f(const double *restrict a, const double *restrict b, double *restrict c,
                     int64_t m, int64_t k, int64_t n)
{
    for (int64_t i = 0; i < m; i++) {
        double *restrict row = c + i * n;
        for (int64_t j = 0; j < n; j++)
            row[j] = 0.0;
        for (int64_t p = 0; p < k; p++) {
            double a_ip = a[i * k + p];
            const double *restrict b_row = b + p * n;
            for (int64_t j = 0; j < n; j++)
                row[j] += a_ip * b_row[j];
        }
    }
}

static void matmul_i(const int64_t *restrict a, const int64_t *restrict b, int64_t *restrict c,
                     int64_t m, int64_t k, int64_t n)
{
    for (int64_t i = 0; i < m; i++) {
        int64_t *restrict row = c + i * n;
        for (int64_t j = 0; j < n; j++)
            row[j] = 0;
        for (int64_t p = 0; p < k; p++) {
            int64_t a_ip = a[i * k + p];
            const int64_t *restrict b_row = b + p * n;
            for (int64_t j = 0; j < n; j++)
                row[j] = rfi_wadd(row[j], rfi_wmul(a_ip, b_row[j]));
        }
    }
}

void rfi_dense_matmul(const rfi_dense *a, int64_t a0, const rfi_dense *b, int64_t b0,
                      rfi_dense *c, int64_t c0, int64_t m, int64_t k, int64_t n)
{
    if (c->is_float)
        matmul_f(a->f + a0, b->f + b0, c->f + c0, m, k, n);
    else
        matmul_i(a->i + a0, b->i + b0, c->i + c0, m, k, n);
}

void rfi_dense_store(const rfi_dense *d, int64_t d0, void *out, rf_dtype dt, int64_t out0,
                     int64_t count)
{
    if (d->is_float)
        rfi_interp_store_f(out, dt, out0, count, d->f + d0);
    else
        rfi_interp_store_i(out, dt, out0, count, d->i + d0);
}
