/* fuzz_backend.h: for the fuzz targets that run programs: which backend runs
 * them, and RF_CHECK's reports of a compiled run that disagrees with the
 * interpreter. */
#ifndef RF_FUZZ_BACKEND_H
#define RF_FUZZ_BACKEND_H

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "reflux.h"

/* The interpreter; with RF_FUZZ_COMPILED=1 in the environment the compiled
 * CPU backend, each run checked against the interpreter with RF_CHECK set to
 * check (its tolerance scale). Returns whether the backend is the compiled one. */
static bool fuzz_use_backend(const char *check)
{
    const char *v = getenv("RF_FUZZ_COMPILED");
    bool compiled = v && strcmp(v, "0") != 0;
    setenv("RF_BACKEND", compiled ? "cpu" : "interp", 1);
    if (compiled)
        setenv("RF_CHECK", check, 1);
    return compiled;
}

/* The message of a run that failed as RF_CHECK's disagreement, else NULL. */
static const char *fuzz_disagreement(rf_status st)
{
    const char *msg = rf_errmsg();
    return st == RF_E_INTERNAL && strncmp(msg, "RF_CHECK:", 9) == 0 ? msg : NULL;
}

/* Whether st is an RF_CHECK disagreement where a value of the interpreter's
 * it names (a result, or a compare's operands) is NaN or infinite: a
 * convolution with a non-finite weight near padding, whose result depends
 * on the algorithm (a padding position skipped, or multiplied as 0 * NaN),
 * in oneDNN as in other libraries; or where a library convolution's step
 * computed NaN or infinity: a Winograd convolution spreads a NaN of its input
 * over its whole tile, to outputs whose window does not hold it. Printed as
 * not fatal, prefixed by who. */
static bool fuzz_non_finite_disagreement(rf_status st, const char *who)
{
    static const char theirs[] = "the interpreter's ";
    const char *msg = fuzz_disagreement(st);
    bool non_finite = false;
    for (const char *at = msg; at && (at = strstr(at, theirs)) != NULL; at++)
        non_finite = non_finite || !isfinite(strtod(at + sizeof theirs - 1, NULL));
    const char *call = msg ? strstr(msg, "(CALL CONV) computes ") : NULL;
    const char *as = call ? strstr(call, " as ") : NULL;
    non_finite = non_finite || (as && !isfinite(strtod(as + 4, NULL)));
    if (non_finite)
        fprintf(stderr, "%s: not fatal: %s\n", who, msg);
    return non_finite;
}

#endif
