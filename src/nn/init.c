/* init.c: weight initialisers (Flux's formulas) and the initialisation seed
 * counter.
 *
 * Initialisers fill new host f32 arrays from the library's counter-based
 * generator (rf_rand / rf_randn, Philox), so a seed gives the same weights on
 * every platform. Fans follow Flux's nfan for matrices and kernels
 * ([out, in, k...]: fan_in = in * prod(k), fan_out = out * prod(k)) and
 * vectors (an n-vector is an n x 1 matrix: fan_in 1, fan_out n).
 *
 * The seed counter is the one piece of process-wide state in nn (atomics, like
 * torch.manual_seed): rf_nn_seed resets it. This file does not build IR.
 */
#include "model.h"

#include <math.h>
#include <stdatomic.h>

/* ---- Seeds ---------------------------------------------------------------------------- */

static _Atomic uint64_t seed_base = 0x5eed;
static _Atomic uint64_t seed_counter = 0;

void rf_nn_seed(uint64_t seed)
{
    atomic_store(&seed_base, seed);
    atomic_store(&seed_counter, 0);
}

/* SplitMix64's finaliser: neighbouring counters give unrelated seeds. */
static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint64_t rfi_nn_next_seed(uint64_t seed)
{
    if (seed != 0)
        return seed;
    uint64_t k = atomic_fetch_add(&seed_counter, 1) + 1;
    uint64_t s = mix64(atomic_load(&seed_base) + k * 0x9e3779b97f4a7c15ull);
    return s ? s : 1; /* 0 means "no seed" to the constructors */
}

/* ---- Fans ------------------------------------------------------------------------------- */

/* fan_in and fan_out of a weight of the given shape (see the file comment). */
static void fans(const int64_t *dims, int rank, double *fan_in, double *fan_out)
{
    if (rank == 0) {
        *fan_in = *fan_out = 1;
    } else if (rank == 1) {
        *fan_in = 1;
        *fan_out = (double)dims[0];
    } else {
        double receptive = 1;
        for (int i = 2; i < rank; i++)
            receptive *= (double)dims[i];
        *fan_out = (double)dims[0] * receptive;
        *fan_in = (double)dims[1] * receptive;
    }
}

/* ---- Initialisers ------------------------------------------------------------------------- */

/* v <- (2u - 1) * bound for u uniform in [0, 1): U(-bound, bound). */
static void scale_uniform(float *v, int64_t n, double bound)
{
    for (int64_t i = 0; i < n; i++)
        v[i] = (float)((2.0 * (double)v[i] - 1.0) * bound);
}

static void scale(float *v, int64_t n, double s)
{
    for (int64_t i = 0; i < n; i++)
        v[i] = (float)((double)v[i] * s);
}

static bool shape_ok(const int64_t *dims, int rank)
{
    if (rank < 0 || rank > RF_MAX_RANK || (rank > 0 && !dims))
        return false;
    for (int i = 0; i < rank; i++)
        if (dims[i] < 0)
            return false;
    return true;
}

static bool is_uniform(rf_init init)
{
    return init == RF_INIT_GLOROT_UNIFORM || init == RF_INIT_KAIMING_UNIFORM;
}

rf_array *rf_init_array(rf_init init, const int64_t *dims, int rank, uint64_t seed)
{
    if ((unsigned)init >= RF_INIT_COUNT) {
        rfi_error(RF_E_INVALID, "rf_init_array: unknown initialiser %d", (int)init);
        return NULL;
    }
    if (!shape_ok(dims, rank)) {
        rfi_error(RF_E_INVALID, "rf_init_array: invalid shape (rank %d)", rank);
        return NULL;
    }
    if (init == RF_INIT_ZEROS)
        return rf_zeros(RF_F32, dims, rank);
    if (init == RF_INIT_ONES)
        return rf_ones(RF_F32, dims, rank);

    rf_array *a = is_uniform(init) ? rf_rand(RF_F32, dims, rank, seed)
                                   : rf_randn(RF_F32, dims, rank, seed);
    if (!a)
        return NULL;
    int64_t n = rf_array_numel(a);
    if (n == 0)
        return a;
    float *v = rf_array_data(a);
    double fan_in, fan_out;
    fans(dims, rank, &fan_in, &fan_out);
    const double gain = sqrt(2.0); /* Flux's default for the Kaiming family (ReLU) */
    switch (init) {
    case RF_INIT_GLOROT_UNIFORM:
        scale_uniform(v, n, sqrt(6.0 / (fan_in + fan_out)));
        break;
    case RF_INIT_GLOROT_NORMAL:
        scale(v, n, sqrt(2.0 / (fan_in + fan_out)));
        break;
    case RF_INIT_KAIMING_UNIFORM:
        scale_uniform(v, n, sqrt(3.0) * gain / sqrt(fan_in));
        break;
    case RF_INIT_KAIMING_NORMAL:
        scale(v, n, gain / sqrt(fan_in));
        break;
    case RF_INIT_NORMAL:
        scale(v, n, 0.01);
        break;
    default: /* zeros/ones returned above */
        break;
    }
    return a;
}
