/* cli.h: the training examples' command-line values. A value must be a
 * number as a whole, so "--epochs 5x" or "--lr fast" is an error rather
 * than 5 or 0 (atoi's reading).
 */
#ifndef RF_EXAMPLES_CLI_H
#define RF_EXAMPLES_CLI_H

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Whether k is one of the n option names (each takes a value): an unknown
 * flag is reported as unknown, not as one missing its value. */
static inline int cli_known(const char *k, const char *const *names, int n)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(k, names[i]))
            return 1;
    return 0;
}

/* An integer in [lo, hi] into *out: 0, or -1 when v is not one. */
static inline int cli_int(const char *v, long long lo, long long hi, long long *out)
{
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi)
        return -1;
    *out = x;
    return 0;
}

/* A finite number > 0 into *out: 0, or -1 when v is not one. */
static inline int cli_positive(const char *v, double *out)
{
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (errno || end == v || *end || !(x > 0) || !isfinite(x))
        return -1;
    *out = x;
    return 0;
}

#endif
