/* philox.c: the counter-based generator behind every random number in
 * reflux (host arrays, initialisers, the RNG op in every backend).
 *
 * Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
 * SC'11). Counter-based means element i of a draw is a pure function of
 * (seed, counter, stream, i): backends can generate in any order or in
 * parallel and still agree bit for bit.
 */
#include "core.h"

#include <math.h>

void rfi_philox4x32(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4])
{
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    uint32_t k0 = key[0], k1 = key[1];
    for (int round = 0; round < 10; round++) {
        uint64_t p0 = (uint64_t)RFI_PHILOX_M0 * c0;
        uint64_t p1 = (uint64_t)RFI_PHILOX_M1 * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)p1;
        c3 = (uint32_t)p0;
        c0 = n0;
        c2 = n2;
        k0 += RFI_PHILOX_W0;
        k1 += RFI_PHILOX_W1;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

void rfi_random_fill(uint64_t seed, uint64_t counter, uint32_t stream, int dist, rf_dtype dt,
                     void *out, int64_t n)
{
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    for (int64_t i = 0; i < n; i++) {
        const uint32_t ctr[4] = {(uint32_t)i, (uint32_t)((uint64_t)i >> 32),
                                 (uint32_t)counter, (uint32_t)(counter >> 32) ^ (stream << 16)};
        uint32_t w[4];
        rfi_philox4x32(ctr, key, w);
        double u1, u2;
        if (dt == RF_F64) {
            u1 = rfi_random_unit_f64(w[0], w[1]);
            u2 = rfi_random_unit_f64(w[2], w[3]);
        } else {
            u1 = rfi_random_unit_f32(w[0]);
            u2 = rfi_random_unit_f32(w[1]);
        }
        double v = dist == 1 ? rfi_random_normal(u1, u2) : u1;
        if (dt == RF_F64)
            ((double *)out)[i] = v;
        else
            ((float *)out)[i] = (float)v;
    }
}
