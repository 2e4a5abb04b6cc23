/* array.c: dense arrays: creation, validation, reference counting, moving
 * between devices (with the f64 -> f32 rule), element access.
 *
 * Host and CPU arrays keep their elements in ordinary memory. This file does
 * not know device memory (CUDA arrays come with the CUDA backend) and never
 * computes on elements beyond copies and dtype conversions.
 */
#include "runtime.h"

#include <assert.h>
#include <math.h>
#include <stdatomic.h>
#include <string.h>

/* ---- Element conversion ---------------------------------------------------------- */

double rfi_element_as_double(rf_dtype dt, const void *p, int64_t i)
{
    switch (dt) {
    case RF_F32: return ((const float *)p)[i];
    case RF_F64: return ((const double *)p)[i];
    case RF_I32: return ((const int32_t *)p)[i];
    case RF_I64: return (double)((const int64_t *)p)[i];
    case RF_U8: return ((const uint8_t *)p)[i];
    case RF_BOOL: return ((const uint8_t *)p)[i] ? 1.0 : 0.0;
    default: return NAN;
    }
}

/* Converts v to an integer in [lo, hi] without undefined behaviour: NaN gives
 * 0, values out of range saturate. */
static int64_t saturate(double v, double lo, double hi)
{
    if (isnan(v))
        return 0;
    if (v <= lo)
        return (int64_t)lo;
    if (v >= hi)
        return hi >= 9.2e18 ? INT64_MAX : (int64_t)hi;
    return (int64_t)v;
}

static void store_double(rf_dtype dt, void *p, int64_t i, double v)
{
    switch (dt) {
    case RF_F32: ((float *)p)[i] = (float)v; break;
    case RF_F64: ((double *)p)[i] = v; break;
    case RF_I32: ((int32_t *)p)[i] = (int32_t)saturate(v, INT32_MIN, INT32_MAX); break;
    case RF_I64:
        ((int64_t *)p)[i] = saturate(v, -9223372036854775808.0, 9223372036854775807.0);
        break;
    case RF_U8: ((uint8_t *)p)[i] = (uint8_t)saturate(v, 0, 255); break;
    case RF_BOOL: ((uint8_t *)p)[i] = v != 0.0; break;
    default: break;
    }
}

/* ---- Allocation and reference counting ---------------------------------------------- */

/* Checks a shape and computes its element and byte counts, or sets a message. */
static rf_status check_shape(const char *op, rf_dtype dt, const int64_t *dims, int rank,
                             int64_t *numel, size_t *nbytes)
{
    if (!rfi_dtype_valid((int)dt))
        return rfi_error(RF_E_INVALID, "%s: invalid dtype %d", op, (int)dt);
    if (rank < 0 || rank > RF_MAX_RANK)
        return rfi_error(RF_E_INVALID, "%s: rank %d is outside 0..%d", op, rank, RF_MAX_RANK);
    if (rank > 0 && !dims)
        return rfi_error(RF_E_INVALID, "%s: dims is NULL for rank %d", op, rank);
    size_t esize = rf_dtype_size(dt);
    /* The product of the nonzero dims must fit in bytes, also for an empty
     * array: then no product of some of the dims, in any order, overflows
     * (code computes row sizes and strides from them). */
    uint64_t n = 1;
    bool overflow = false, empty = false;
    for (int i = 0; i < rank; i++) {
        if (dims[i] < 0)
            return rfi_error(RF_E_INVALID, "%s: dim %d is negative (%lld)", op, i,
                             (long long)dims[i]);
        if (dims[i] == 0)
            empty = true;
        else if (n > (uint64_t)INT64_MAX / (uint64_t)dims[i])
            overflow = true;
        else
            n *= (uint64_t)dims[i];
    }
    if (overflow || n > SIZE_MAX / esize || n > (uint64_t)INT64_MAX / esize) {
        char ty[128];
        return rfi_error(RF_E_INVALID, "%s: %s is too large (its byte size overflows)", op,
                         rfi_type_str(ty, sizeof ty, dt, dims, rank));
    }
    if (empty)
        n = 0;
    *numel = (int64_t)n;
    *nbytes = (size_t)n * esize;
    return RF_OK;
}

static rf_array *alloc_checked(const char *op, rf_device *dev, rf_dtype dt,
                               const int64_t *dims, int rank)
{
    if (!dev) {
        rfi_error(RF_E_INVALID, "%s: device is NULL", op);
        return NULL;
    }
    if (dev->kind == RF_DEVICE_CUDA) {
        rfi_error(RF_E_DEVICE, "%s: arrays on %s are not supported by this build", op,
                  dev->name);
        return NULL;
    }
    int64_t numel = 0;
    size_t nbytes = 0;
    if (check_shape(op, dt, dims, rank, &numel, &nbytes) != RF_OK)
        return NULL;
    rf_array *a = rfi_calloc(1, sizeof *a);
    void *data = rfi_block_alloc(nbytes);
    if (!a || !data) {
        rfi_free(a);
        rfi_block_free(data, nbytes, false);
        char ty[128];
        rfi_error(RF_E_NOMEM, "%s: out of memory allocating %s (%zu bytes)", op,
                  rfi_type_str(ty, sizeof ty, dt, dims, rank), nbytes);
        return NULL;
    }
    atomic_init(&a->refs, 1);
    a->device = dev;
    a->dtype = dt;
    a->rank = rank;
    for (int i = 0; i < rank; i++)
        a->dims[i] = dims[i];
    a->numel = numel;
    a->nbytes = nbytes;
    a->data = data;
    return a;
}

rf_array *rfi_array_alloc(const char *op, rf_device *dev, rf_dtype dt, const int64_t *dims,
                          int rank)
{
    return alloc_checked(op, dev, dt, dims, rank);
}

rf_array *rfi_array_alloc_recycled(const char *op, rf_device *dev, rf_dtype dt,
                                   const int64_t *dims, int rank)
{
    rf_array *a = alloc_checked(op, dev, dt, dims, rank);
    if (a)
        a->recycle = true;
    return a;
}

rf_array *rfi_array_retain(rf_array *a)
{
    if (a)
        atomic_fetch_add_explicit(&a->refs, 1, memory_order_relaxed);
    return a;
}

void rfi_array_release(rf_array *a)
{
    if (!a)
        return;
    /* acq_rel: every write made through other references happens before the free. */
    int before = atomic_fetch_sub_explicit(&a->refs, 1, memory_order_acq_rel);
    assert(before >= 1);
    if (before > 1)
        return;
    rfi_block_free(a->data, a->nbytes, a->recycle);
    rfi_free(a);
}

void rf_array_free(rf_array *a) { rfi_array_release(a); }

/* ---- Creation ------------------------------------------------------------------------ */

static rf_array *new_with_data(const char *op, rf_device *dev, rf_dtype dt,
                               const int64_t *dims, int rank, const void *data)
{
    rf_array *a = alloc_checked(op, dev, dt, dims, rank);
    if (!a)
        return NULL;
    if (data)
        memcpy(a->data, data, a->nbytes);
    else
        memset(a->data, 0, a->nbytes);
    return a;
}

rf_array *rf_array_new(rf_device *dev, rf_dtype dtype, const int64_t *dims, int rank,
                       const void *data)
{
    return new_with_data("rf_array_new", dev, dtype, dims, rank, data);
}

rf_array *rf_array_from(rf_dtype dtype, const int64_t *dims, int rank, const void *data)
{
    return new_with_data("rf_array_from", rf_device_host(), dtype, dims, rank, data);
}

rf_array *rf_zeros(rf_dtype dtype, const int64_t *dims, int rank)
{
    return new_with_data("rf_zeros", rf_device_host(), dtype, dims, rank, NULL);
}

static rf_array *filled(const char *op, rf_dtype dtype, const int64_t *dims, int rank,
                        double value)
{
    rf_array *a = alloc_checked(op, rf_device_host(), dtype, dims, rank);
    if (!a)
        return NULL;
    for (int64_t i = 0; i < a->numel; i++)
        store_double(dtype, a->data, i, value);
    return a;
}

rf_array *rf_ones(rf_dtype dtype, const int64_t *dims, int rank)
{
    return filled("rf_ones", dtype, dims, rank, 1.0);
}

rf_array *rf_fill(rf_dtype dtype, const int64_t *dims, int rank, double value)
{
    return filled("rf_fill", dtype, dims, rank, value);
}

/* dist 0: uniform [0,1); 1: standard normal (as rfi_random_fill). */
static rf_array *random_array(const char *op, int dist, rf_dtype dtype, const int64_t *dims,
                              int rank, uint64_t seed)
{
    if (rfi_dtype_valid((int)dtype) && !rfi_dtype_is_float(dtype)) {
        rfi_error(RF_E_DTYPE, "%s: dtype %s is not a float type (use f32 or f64)", op,
                  rf_dtype_name(dtype));
        return NULL;
    }
    rf_array *a = alloc_checked(op, rf_device_host(), dtype, dims, rank);
    if (!a)
        return NULL;
    rfi_random_fill(seed, 0, 0, dist, dtype, a->data, a->numel);
    return a;
}

rf_array *rf_randn(rf_dtype dtype, const int64_t *dims, int rank, uint64_t seed)
{
    return random_array("rf_randn", 1, dtype, dims, rank, seed);
}

rf_array *rf_rand(rf_dtype dtype, const int64_t *dims, int rank, uint64_t seed)
{
    return random_array("rf_rand", 0, dtype, dims, rank, seed);
}

/* ---- Moving between devices --------------------------------------------------------- */

/* The copy for rf_array_to and rf_array_to_opts; `op` names the caller in errors. */
static rf_array *array_to(const char *op, const rf_array *a, rf_device *dev,
                          const rf_to_opts *opts)
{
    if (!a || !dev) {
        rfi_error(RF_E_INVALID, "%s: %s is NULL", op, a ? "device" : "array");
        return NULL;
    }
    bool to_f64 = opts && opts->to_f64, keep_f64 = to_f64 || (opts && opts->keep_f64);
    rf_dtype dt = a->dtype;
    if (dt == RF_F64 && !keep_f64 && rfi_device_is_compute(dev))
        dt = RF_F32; /* Flux's rule: compute devices work in f32 */
    else if (dt == RF_F32 && to_f64)
        dt = RF_F64;
    rf_array *b = rfi_array_alloc_recycled(op, dev, dt, a->dims, a->rank); /* a batch's copy */
    if (!b)
        return NULL;
    if (dt == a->dtype) {
        memcpy(b->data, a->data, a->nbytes);
    } else if (dt == RF_F32) {
        const double *src = a->data;
        float *dst = b->data;
        for (int64_t i = 0; i < a->numel; i++)
            dst[i] = (float)src[i];
    } else {
        const float *src = a->data;
        double *dst = b->data;
        for (int64_t i = 0; i < a->numel; i++)
            dst[i] = src[i];
    }
    return b;
}

rf_array *rf_array_to(const rf_array *a, rf_device *dev)
{
    return array_to("rf_array_to", a, dev, NULL);
}

rf_array *rf_array_to_opts(const rf_array *a, rf_device *dev, const rf_to_opts *opts)
{
    return array_to("rf_array_to_opts", a, dev, opts);
}

rf_array *rf_array_rows(const rf_array *a, int64_t lo, int64_t hi)
{
    static const char op[] = "rf_array_rows";
    if (!a || a->rank < 1) {
        rfi_error(RF_E_INVALID, "%s: %s", op, a ? "the array has no rows (rank 0)"
                                               : "array is NULL");
        return NULL;
    }
    if (lo < 0 || lo > hi || hi > a->dims[0]) {
        char ty[128];
        rfi_type_str(ty, sizeof ty, a->dtype, a->dims, a->rank);
        rfi_error(RF_E_SHAPE, "%s: rows [%lld, %lld) are not within the %lld of %s", op,
                  (long long)lo, (long long)hi, (long long)a->dims[0], ty);
        return NULL;
    }
    int64_t dims[RF_MAX_RANK];
    memcpy(dims, a->dims, (size_t)a->rank * sizeof dims[0]);
    dims[0] = hi - lo;
    rf_array *b = rfi_array_alloc_recycled(op, a->device, a->dtype, dims, a->rank); /* a batch */
    if (!b)
        return NULL;
    size_t row = a->dims[0] > 0 ? a->nbytes / (size_t)a->dims[0] : 0;
    if (b->nbytes > 0)
        memcpy(b->data, (const char *)a->data + (size_t)lo * row, b->nbytes);
    return b;
}

/* ---- Accessors ------------------------------------------------------------------------- */

rf_device *rf_array_device(const rf_array *a) { return a ? a->device : NULL; }
rf_dtype rf_array_dtype(const rf_array *a) { return a ? a->dtype : RF_DTYPE_COUNT; }
int rf_array_rank(const rf_array *a) { return a ? a->rank : -1; }
const int64_t *rf_array_dims(const rf_array *a) { return a ? a->dims : NULL; }
int64_t rf_array_numel(const rf_array *a) { return a ? a->numel : 0; }
size_t rf_array_nbytes(const rf_array *a) { return a ? a->nbytes : 0; }

void *rf_array_data(rf_array *a)
{
    if (!a || !(a->device->kind == RF_DEVICE_HOST || a->device->kind == RF_DEVICE_CPU))
        return NULL;
    return a->data;
}

rf_status rf_array_read(const rf_array *a, void *dst, size_t nbytes)
{
    if (!a)
        return rfi_error(RF_E_INVALID, "rf_array_read: array is NULL");
    char ty[128];
    rfi_type_str(ty, sizeof ty, a->dtype, a->dims, a->rank);
    if (!dst && a->nbytes > 0)
        return rfi_error(RF_E_INVALID, "rf_array_read: destination for %s is NULL", ty);
    if (nbytes < a->nbytes)
        return rfi_error(RF_E_INVALID,
                         "rf_array_read: %s needs %zu bytes but the destination holds %zu",
                         ty, a->nbytes, nbytes);
    if (a->nbytes)
        memcpy(dst, a->data, a->nbytes);
    return RF_OK;
}

rf_status rf_array_write(rf_array *a, const void *src, size_t nbytes)
{
    if (!a)
        return rfi_error(RF_E_INVALID, "rf_array_write: array is NULL");
    char ty[128];
    rfi_type_str(ty, sizeof ty, a->dtype, a->dims, a->rank);
    if (!src && a->nbytes > 0)
        return rfi_error(RF_E_INVALID, "rf_array_write: source for %s is NULL", ty);
    if (nbytes != a->nbytes)
        return rfi_error(RF_E_INVALID,
                         "rf_array_write: %s needs exactly %zu bytes, got %zu", ty,
                         a->nbytes, nbytes);
    if (a->nbytes)
        memcpy(a->data, src, a->nbytes);
    return RF_OK;
}

double rf_to_number(const rf_array *a)
{
    if (!a) {
        rfi_error(RF_E_INVALID, "rf_to_number: array is NULL");
        return NAN;
    }
    if (a->numel != 1) {
        char ty[128];
        rfi_error(RF_E_SHAPE, "rf_to_number: %s has %lld elements, expected exactly 1",
                  rfi_type_str(ty, sizeof ty, a->dtype, a->dims, a->rank),
                  (long long)a->numel);
        return NAN;
    }
    return rfi_element_as_double(a->dtype, a->data, 0);
}
