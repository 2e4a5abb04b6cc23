/* peak_flops.c: the machine's fp32 multiply-add peak, measured: independent
 * fused multiply-add chains on every core, in the widest vectors the CPU
 * has (AVX-512, else AVX2). The yardstick for the benchmarks' GFLOP/s (an
 * issue's "510 GFLOP/s on 2 cores" assumed two 512-bit FMA pipes per core;
 * a CPU that runs AVX-512 on 256-bit pipes gets half of that per clock). One line:
 *   peak_flops isa=ISA threads=T gflops_1thread=G gflops_all=G
 * Threads: $RF_NUM_THREADS, else the online cores.
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "bench_util.h"

#define CHAINS 12             /* enough to cover the FMA latency on any pipe count */
#define ITERATIONS 20000000L  /* per thread; about 0.1 s at 100 GFLOP/s */

/* chains_512 and chains_256: CHAINS independent multiply-add chains of
 * `lanes`-wide vectors, n steps each; each returns the sum of its chains so
 * the compiler keeps them. The multiply-adds are the FMA intrinsics, not
 * `a * b + c`: under -std=c11 gcc does not contract that into an FMA, and a
 * separate multiply and add measure about 15% less here. One body, compiled
 * for each instruction set. */
#define DEFINE_CHAINS(name, vec, set1, fmadd, store, lanes, isa)                             \
    __attribute__((target(isa))) static float name(long n)                                   \
    {                                                                                        \
        vec acc[CHAINS];                                                                     \
        for (int c = 0; c < CHAINS; c++)                                                     \
            acc[c] = set1((float)c);                                                         \
        const vec mul = set1(0.999999f), add = set1(1e-6f);                                  \
        for (long i = 0; i < n; i++)                                                         \
            for (int c = 0; c < CHAINS; c++)                                                 \
                acc[c] = fmadd(acc[c], mul, add);                                            \
        float s = 0, out[lanes];                                                             \
        for (int c = 0; c < CHAINS; c++) {                                                   \
            store(out, acc[c]);                                                              \
            for (int l = 0; l < (lanes); l++)                                                \
                s += out[l];                                                                 \
        }                                                                                    \
        return s;                                                                            \
    }

DEFINE_CHAINS(chains_512, __m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_storeu_ps, 16,
              "avx512f,fma")
DEFINE_CHAINS(chains_256, __m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_storeu_ps, 8,
              "avx2,fma")

static int lanes; /* 16 or 8: the vector width in use */

static void *run_chains(void *out)
{
    *(float *)out = lanes == 16 ? chains_512(ITERATIONS) : chains_256(ITERATIONS);
    return NULL;
}

/* GFLOP/s of `threads` threads running the chains at once (best of 3). */
static double measure(int threads, float *sink)
{
    double best = 0;
    for (int round = 0; round < 3; round++) {
        pthread_t t[64];
        float out[64];
        double t0 = now_s();
        int started = 0;
        for (; started < threads; started++)
            if (pthread_create(&t[started], NULL, run_chains, &out[started]) != 0)
                break;
        for (int k = 0; k < started; k++) {
            pthread_join(t[k], NULL);
            *sink += out[k];
        }
        double flops = 2.0 * lanes * CHAINS * (double)ITERATIONS * started;
        double rate = flops / (now_s() - t0) / 1e9;
        best = rate > best ? rate : best;
    }
    return best;
}

int main(void)
{
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        lanes = 16;
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        lanes = 8;
    else {
        fprintf(stderr, "peak_flops: needs AVX2 and FMA\n");
        return 1;
    }
    const char *env = getenv("RF_NUM_THREADS");
    long threads = env && atoi(env) > 0 ? atoi(env) : sysconf(_SC_NPROCESSORS_ONLN);
    threads = threads < 1 ? 1 : threads > 64 ? 64 : threads;
    float sink = 0;
    double one = measure(1, &sink), all = measure((int)threads, &sink);
    printf("peak_flops isa=%s threads=%ld gflops_1thread=%.1f gflops_all=%.1f\n",
           lanes == 16 ? "avx512" : "avx2", threads, one, all);
    return sink == 12345.0f; /* never: keeps the chains' results alive */
}
