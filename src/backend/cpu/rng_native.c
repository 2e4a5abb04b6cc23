/* rng_native.c: the native kernel for the CALL FALLBACK step of an RNG node
 * (a Dropout layer's mask, a reparameterisation's noise), replacing the
 * reference kernel (rfi_random_fill, core/philox.c) whose results it
 * reproduces bit for bit.
 *
 * Element i of a draw is a pure function of (seed, counter, stream, i): the
 * Philox4x32-10 block of counter {i, i >> 32, counter, counter >> 32 ^
 * stream << 16} under key seed, turned into a uniform or a normal value as
 * rfi_random_fill does. So the elements split into chunks that run in
 * parallel on the runtime's pool, in any order, with the same result.
 *
 * The reference computes one block at a time in scalar code, about 12 ns an
 * element here; gcc does not vectorise Philox's 32x32->64 bit products well
 * from plain C (it multiplies 64-bit lanes by shifts and adds). On AVX2 the
 * blocks are computed eight at a time with vpmuludq, whose even-lane
 * products give the high and low words of four lanes at once, and on
 * AVX-512 sixteen at a time (a Dropout mask over [128,512]: 144 -> 86-97 us
 * on two cores); elsewhere (and for the tail of a chunk) rfi_philox4x32
 * computes them one by one. Normal values
 * take the words from there and call the same libm functions, in double, as
 * the reference.
 *
 * Deliberately not here: which ops reach this file (pool.c hands RNG nodes
 * over), other dtypes (the op makes only f32 and f64).
 */
#include "../../runtime/threadpool.h"
#include "services.h"

#define GRAIN_ELEMENTS 8192 /* elements a parallel chunk should at least cover */
#define BATCH 64            /* elements whose words a chunk computes at once */

struct rfi_cpu_rng {
    bool f64;       /* values are f64 (else f32) */
    bool normal;    /* Box-Muller normal (else uniform in [0, 1)) */
    uint32_t stream;
    int64_t count;  /* elements */
};

const char *rfi_cpu_rng_path(const rfi_cpu_rng *k)
{
    (void)k;
    return "native-rng";
}

/* Philox's counter words of element i (the reference's, rfi_random_fill). */
static void block_counter(uint64_t counter, uint32_t stream, int64_t i, uint32_t ctr[4])
{
    ctr[0] = (uint32_t)i;
    ctr[1] = (uint32_t)((uint64_t)i >> 32);
    ctr[2] = (uint32_t)counter;
    ctr[3] = (uint32_t)(counter >> 32) ^ (stream << 16);
}

/* words[w][j]: word w of the block of element first + j, for from <= j < n <= BATCH. */
static void words_scalar(uint64_t seed, uint64_t counter, uint32_t stream, int64_t first,
                         int from, int n, uint32_t words[4][BATCH])
{
    const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    for (int j = from; j < n; j++) {
        uint32_t ctr[4], w[4];
        block_counter(counter, stream, first + j, ctr);
        rfi_philox4x32(ctr, key, w);
        for (int k = 0; k < 4; k++)
            words[k][j] = w[k];
    }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define HAVE_AVX2_PATH 1

/* The 64-bit products a * m of eight 32-bit lanes, as their high and low words. */
__attribute__((target("avx2"))) static inline void mul_hilo8(__m256i a, __m256i m, __m256i *hi,
                                                             __m256i *lo)
{
    __m256i even = _mm256_mul_epu32(a, m);                        /* lanes 0, 2, 4, 6 */
    __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m); /* lanes 1, 3, 5, 7 */
    *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
    *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

/* words_scalar from 0 for n a multiple of 8: rfi_philox4x32's rounds on eight
 * blocks at once. */
__attribute__((target("avx2"))) static void words_avx2(uint64_t seed, uint64_t counter,
                                                       uint32_t stream, int64_t first, int n,
                                                       uint32_t words[4][BATCH])
{
    const __m256i m0 = _mm256_set1_epi32((int)RFI_PHILOX_M0);
    const __m256i m1 = _mm256_set1_epi32((int)RFI_PHILOX_M1);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i top = _mm256_set1_epi32(INT32_MIN);
    uint32_t base[4];
    block_counter(counter, stream, 0, base);
    __m256i round_key[10][2];
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int round = 0; round < 10; round++, k0 += RFI_PHILOX_W0, k1 += RFI_PHILOX_W1) {
        round_key[round][0] = _mm256_set1_epi32((int)k0);
        round_key[round][1] = _mm256_set1_epi32((int)k1);
    }
    for (int j = 0; j < n; j += 8) {
        /* element i + lane: the lanes' high words agree unless the low ones wrap */
        int64_t i = first + j;
        const __m256i i_lo = _mm256_set1_epi32((int)(uint32_t)i);
        const __m256i i_hi = _mm256_set1_epi32((int)(uint32_t)((uint64_t)i >> 32));
        __m256i c0 = _mm256_add_epi32(i_lo, lanes);
        /* -1 where the lane's low word wrapped (c0 < i_lo unsigned: signed after
         * flipping the top bits), then its high word is one more */
        __m256i wrapped =
            _mm256_cmpgt_epi32(_mm256_xor_si256(i_lo, top), _mm256_xor_si256(c0, top));
        __m256i c1 = _mm256_sub_epi32(i_hi, wrapped);
        __m256i c2 = _mm256_set1_epi32((int)base[2]);
        __m256i c3 = _mm256_set1_epi32((int)base[3]);
        for (int round = 0; round < 10; round++) {
            __m256i hi0, lo0, hi1, lo1;
            mul_hilo8(c0, m0, &hi0, &lo0);
            mul_hilo8(c2, m1, &hi1, &lo1);
            c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), round_key[round][0]);
            c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), round_key[round][1]);
            c1 = lo1;
            c3 = lo0;
        }
        _mm256_storeu_si256((__m256i *)(words[0] + j), c0);
        _mm256_storeu_si256((__m256i *)(words[1] + j), c1);
        _mm256_storeu_si256((__m256i *)(words[2] + j), c2);
        _mm256_storeu_si256((__m256i *)(words[3] + j), c3);
    }
}

/* mul_hilo8 on sixteen lanes. */
__attribute__((target("avx512f"))) static inline void mul_hilo16(__m512i a, __m512i m,
                                                                __m512i *hi, __m512i *lo)
{
    __m512i even = _mm512_mul_epu32(a, m);
    __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
    *lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
    *hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
}

/* The AVX2 path's rounds on sixteen blocks at once, for n a multiple of 16. */
__attribute__((target("avx512f"))) static void words_avx512(uint64_t seed, uint64_t counter,
                                                           uint32_t stream, int64_t first, int n,
                                                           uint32_t words[4][BATCH])
{
    const __m512i m0 = _mm512_set1_epi32((int)RFI_PHILOX_M0);
    const __m512i m1 = _mm512_set1_epi32((int)RFI_PHILOX_M1);
    const __m512i lanes =
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i one = _mm512_set1_epi32(1);
    uint32_t base[4];
    block_counter(counter, stream, 0, base);
    __m512i round_key[10][2];
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int round = 0; round < 10; round++, k0 += RFI_PHILOX_W0, k1 += RFI_PHILOX_W1) {
        round_key[round][0] = _mm512_set1_epi32((int)k0);
        round_key[round][1] = _mm512_set1_epi32((int)k1);
    }
    for (int j = 0; j < n; j += 16) {
        int64_t i = first + j;
        const __m512i i_lo = _mm512_set1_epi32((int)(uint32_t)i);
        const __m512i i_hi = _mm512_set1_epi32((int)(uint32_t)((uint64_t)i >> 32));
        __m512i c0 = _mm512_add_epi32(i_lo, lanes);
        __mmask16 wrapped = _mm512_cmplt_epu32_mask(c0, i_lo); /* the low word wrapped */
        __m512i c1 = _mm512_mask_add_epi32(i_hi, wrapped, i_hi, one);
        __m512i c2 = _mm512_set1_epi32((int)base[2]);
        __m512i c3 = _mm512_set1_epi32((int)base[3]);
        for (int round = 0; round < 10; round++) {
            __m512i hi0, lo0, hi1, lo1;
            mul_hilo16(c0, m0, &hi0, &lo0);
            mul_hilo16(c2, m1, &hi1, &lo1);
            c0 = _mm512_xor_si512(_mm512_xor_si512(hi1, c1), round_key[round][0]);
            c2 = _mm512_xor_si512(_mm512_xor_si512(hi0, c3), round_key[round][1]);
            c1 = lo1;
            c3 = lo0;
        }
        _mm512_storeu_si512(words[0] + j, c0);
        _mm512_storeu_si512(words[1] + j, c1);
        _mm512_storeu_si512(words[2] + j, c2);
        _mm512_storeu_si512(words[3] + j, c3);
    }
}
#endif

/* Which vector path computes Philox's blocks. */
typedef enum rng_isa { RNG_SCALAR, RNG_AVX2, RNG_AVX512 } rng_isa;

/* The words of elements [first, first + n), n <= BATCH. */
static void block_words(rng_isa isa, uint64_t seed, uint64_t counter, uint32_t stream,
                        int64_t first, int n, uint32_t words[4][BATCH])
{
    int vec = 0;
#ifdef HAVE_AVX2_PATH
    if (isa == RNG_AVX512) {
        vec = n - n % 16;
        words_avx512(seed, counter, stream, first, vec, words);
    } else if (isa == RNG_AVX2) {
        vec = n - n % 8;
        words_avx2(seed, counter, stream, first, vec, words);
    }
#else
    (void)isa;
#endif
    words_scalar(seed, counter, stream, first, vec, n, words);
}

void rfi_cpu_rng_fill(const rfi_cpu_rng *k, uint64_t seed, uint64_t counter, int64_t first,
                      int64_t count, void *out)
{
    rng_isa isa = RNG_SCALAR;
#ifdef HAVE_AVX2_PATH
    isa = __builtin_cpu_supports("avx512f")  ? RNG_AVX512
          : __builtin_cpu_supports("avx2") ? RNG_AVX2
                                           : RNG_SCALAR;
#endif
    uint32_t words[4][BATCH];
    for (int64_t done = 0; done < count; done += BATCH) {
        int n = count - done < BATCH ? (int)(count - done) : BATCH;
        block_words(isa, seed, counter, k->stream, first + done, n, words);
        if (k->f64) {
            double *o = (double *)out + done;
            for (int j = 0; j < n; j++) {
                double u1 = rfi_random_unit_f64(words[0][j], words[1][j]);
                double u2 = rfi_random_unit_f64(words[2][j], words[3][j]);
                o[j] = k->normal ? rfi_random_normal(u1, u2) : u1;
            }
        } else {
            float *o = (float *)out + done;
            if (k->normal)
                for (int j = 0; j < n; j++)
                    o[j] = (float)rfi_random_normal(rfi_random_unit_f32(words[0][j]),
                                                    rfi_random_unit_f32(words[1][j]));
            else
                for (int j = 0; j < n; j++) /* rfi_random_unit_f32, exactly, in float */
                    o[j] = (float)(int32_t)(words[0][j] >> 8) * 0x1p-24f;
        }
    }
}

typedef struct rng_job {
    const rfi_cpu_rng *k;
    uint64_t seed, counter;
    void *out;
} rng_job;

static void rng_range(void *ctx, int64_t lo, int64_t hi)
{
    const rng_job *job = ctx;
    size_t esz = job->k->f64 ? sizeof(double) : sizeof(float);
    rfi_cpu_rng_fill(job->k, job->seed, job->counter, lo, hi - lo,
                     (char *)job->out + (size_t)lo * esz);
}

rf_status rfi_cpu_rng_prepare(const rfi_node *n, rfi_cpu_rng **out)
{
    *out = NULL;
    if (n->op != RFI_OP_RNG || n->n_in != 1 || (n->dtype != RF_F32 && n->dtype != RF_F64))
        return RF_E_UNSUPPORTED;
    const rfi_node *key = n->in[0];
    if (key->dtype != RF_I64 || rfi_node_numel(key) != 2 ||
        (n->attr.i[0] != 0 && n->attr.i[0] != 1))
        return RF_E_UNSUPPORTED;
    rfi_cpu_rng *k = rfi_calloc(1, sizeof *k);
    if (!k)
        return rfi_error(RF_E_NOMEM, "cpu: rng: out of memory");
    k->f64 = n->dtype == RF_F64;
    k->normal = n->attr.i[0] == 1;
    k->stream = (uint32_t)n->attr.i[1];
    k->count = rfi_node_numel(n);
    *out = k;
    return RF_OK;
}

rf_status rfi_cpu_rng_run(const rfi_cpu_rng *k, const void *key, void *out)
{
    const int64_t *seed_counter = key;
    rng_job job = {k, (uint64_t)seed_counter[0], (uint64_t)seed_counter[1], out};
    rfi_parallel_for(k->count, GRAIN_ELEMENTS, rng_range, &job);
    return RF_OK;
}

void rfi_cpu_rng_free(rfi_cpu_rng *k) { rfi_free(k); }
