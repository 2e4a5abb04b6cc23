/* bulk.c: loads and stores of runs of elements for the interpreter's kernels.
 *
 * Each function converts exactly like the per-element rfi_ld_f / rfi_ld_i /
 * rfi_st_f / rfi_st_i in interp.h (it calls them for the less common dtypes),
 * but switches on the dtype once per run instead of once per element, so the
 * common f32/f64/i32/i64 loops are plain typed loops the compiler vectorises.
 * Deliberately no other change of arithmetic: same values, same rounding.
 */
#include "interp.h"

void rfi_interp_load_f(const void *p, rf_dtype dt, int64_t start, int64_t count, double *dst)
{
    if (count <= 0)
        return; /* an empty value's buffer may be NULL: no pointer arithmetic on it */
    switch (dt) {
    case RF_F32: {
        const float *src = (const float *)p + start;
        for (int64_t k = 0; k < count; k++)
            dst[k] = src[k];
        break;
    }
    case RF_F64:
        rfi_interp_copy(dst, (const double *)p + start, (size_t)count * sizeof(double));
        break;
    default:
        for (int64_t k = 0; k < count; k++)
            dst[k] = rfi_ld_f(p, dt, start + k);
        break;
    }
}

void rfi_interp_load_i(const void *p, rf_dtype dt, int64_t start, int64_t count, int64_t *dst)
{
    if (count <= 0)
        return; /* an empty value's buffer may be NULL: no pointer arithmetic on it */
    switch (dt) {
    case RF_I32: {
        const int32_t *src = (const int32_t *)p + start;
        for (int64_t k = 0; k < count; k++)
            dst[k] = src[k];
        break;
    }
    case RF_I64:
        rfi_interp_copy(dst, (const int64_t *)p + start, (size_t)count * sizeof(int64_t));
        break;
    default:
        for (int64_t k = 0; k < count; k++)
            dst[k] = rfi_ld_i(p, dt, start + k);
        break;
    }
}

void rfi_interp_store_f(void *p, rf_dtype dt, int64_t start, int64_t count, const double *src)
{
    if (count <= 0)
        return; /* an empty value's buffer may be NULL: no pointer arithmetic on it */
    switch (dt) {
    case RF_F32: {
        float *dst = (float *)p + start;
        for (int64_t k = 0; k < count; k++)
            dst[k] = (float)src[k];
        break;
    }
    case RF_F64: rfi_interp_copy((double *)p + start, src, (size_t)count * sizeof(double)); break;
    default:
        for (int64_t k = 0; k < count; k++)
            rfi_st_f(p, dt, start + k, src[k]);
        break;
    }
}

void rfi_interp_store_i(void *p, rf_dtype dt, int64_t start, int64_t count, const int64_t *src)
{
    if (count <= 0)
        return; /* an empty value's buffer may be NULL: no pointer arithmetic on it */
    switch (dt) {
    case RF_I64: rfi_interp_copy((int64_t *)p + start, src, (size_t)count * sizeof(int64_t)); break;
    case RF_BOOL: {
        uint8_t *dst = (uint8_t *)p + start;
        for (int64_t k = 0; k < count; k++)
            dst[k] = src[k] != 0;
        break;
    }
    default:
        for (int64_t k = 0; k < count; k++)
            rfi_st_i(p, dt, start + k, src[k]);
        break;
    }
}
