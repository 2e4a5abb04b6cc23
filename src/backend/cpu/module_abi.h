/* module_abi.h: the interface between the runtime and a generated module.
 *
 * The C renderer copies the block between the BEGIN/END markers verbatim into
 * every generated source file, so the module needs no reflux header. Runtime
 * services are passed in at each call, never linked: a module's only
 * undefined symbols are libm's. Bump RF_MODULE_ABI on any change.
 */
#ifndef RF_MODULE_ABI_H
#define RF_MODULE_ABI_H

/* BEGIN MODULE ABI */
#include <stdint.h>
#define RF_MODULE_ABI 2
typedef struct rf_module_services {
    int abi;  /* RF_MODULE_ABI */
    void *rt; /* the runtime's state for this executable */
    /* Runs body(ctx, lo, hi) over [0, n) split across the runtime's thread
     * pool, in chunks of at least `grain` iterations; returns when all are done. */
    void (*parallel_for)(void *rt, int64_t n, int64_t grain,
                         void (*body)(void *ctx, int64_t lo, int64_t hi), void *ctx);
    /* Executes plan step `step` (a CALL step: matmul, convolution or a
     * reference kernel) on the buffer table. Returns 0 on success. */
    int (*call)(void *rt, int step, void *const *buffers);
    /* When profiling or checking (NULL otherwise): called with each plan
     * step's index just before the step runs, and with -1 when the program is
     * done. */
    void (*mark)(void *prof, int step);
    void *prof;
} rf_module_services;
/* The module's one entry point: runs the whole program on the buffer table
 * (see plan.h for its layout). Returns 0 on success, else the failing step + 1. */
typedef int (*rf_module_entry)(const rf_module_services *s, void *const *buffers);
#define RF_MODULE_ENTRY_NAME "rf_module_run_v1"
/* END MODULE ABI */

/* Generated kernels with more elements than this run through parallel_for,
 * in chunks of at least RFI_PARALLEL_CHUNK elements; an element whose
 * computation costs more than a few plain ops counts as several (render_c.c,
 * point_cost). The services predict from it which steps use the team. */
#define RFI_PARALLEL_MIN 32768
#define RFI_PARALLEL_CHUNK 16384

#endif
