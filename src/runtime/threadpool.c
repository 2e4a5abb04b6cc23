/* threadpool.c: the runtime's parallel_for, on OpenMP.
 *
 * Why OpenMP and not a pool of our own: Debian's oneDNN runs on OpenMP
 * (libgomp). Two pools on one machine oversubscribe it: after every library
 * call libgomp's workers spin waiting for more work while our workers run the
 * next generated loop, and on a 2-core machine they steal each other's cores
 * (measured: a third of a CNN step spent spinning in libgomp). Running our
 * loops on the same OpenMP team means one set of threads serves both.
 *
 * The team size is RF_NUM_THREADS when set to a positive integer, else the
 * number of online CPUs, read once (pthread_once): the runtime's documented
 * process-wide setting. Calls never allocate. A call from inside a parallel
 * region (a nested call) runs inline on the calling thread.
 */
#include "threadpool.h"

#include <omp.h>
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

static pthread_once_t size_once = PTHREAD_ONCE_INIT;
static int team_size = 1;

static void read_size(void)
{
    const char *env = getenv("RF_NUM_THREADS");
    long n = env ? strtol(env, NULL, 10) : 0;
    if (n <= 0)
        n = sysconf(_SC_NPROCESSORS_ONLN);
    if (n <= 0)
        n = 1;
    team_size = n > 256 ? 256 : (int)n;
}

int rfi_threadpool_size(void)
{
    pthread_once(&size_once, read_size);
    return team_size;
}

void rfi_parallel_for(int64_t n, int64_t grain, rfi_range_fn body, void *ctx)
{
    if (n <= 0)
        return;
    if (grain < 1)
        grain = 1;
    int64_t chunks = n / grain;
    int threads = rfi_threadpool_size();
    if (chunks > threads)
        chunks = threads;
    if (chunks <= 1 || omp_in_parallel()) {
        body(ctx, 0, n);
        return;
    }
    /* Static, equal chunks: chunk c covers [c*n/chunks, (c+1)*n/chunks). */
#pragma omp parallel for num_threads((int)chunks) schedule(static, 1)
    for (int64_t c = 0; c < chunks; c++)
        body(ctx, c * n / chunks, (c + 1) * n / chunks);
}
