/* bench_util.h: the clock and the ordering the benchmark programs share
 * (each bench .c file is a program of its own; this header is their one copy). */
#ifndef RF_BENCH_UTIL_H
#define RF_BENCH_UTIL_H

#include <time.h>

/* Seconds on the monotonic clock. */
static inline double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* qsort's order of doubles, ascending. */
static inline int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#endif
