/* check.h: RF_CHECK, the differential mode of the CPU backend: every run of
 * a compiled executable also runs the reference interpreter on the same
 * inputs and compares the two (check.c says how). */
#ifndef RF_BACKEND_CPU_CHECK_H
#define RF_BACKEND_CPU_CHECK_H

#include "../plan.h"

typedef struct rfi_cpu_check rfi_cpu_check;

/* RF_CHECK's scale, read when a program is compiled: 0 when unset, empty or
 * "0" (no check); N for a number N above 1 (the tolerances N times wider, for
 * programs whose arithmetic magnifies rounding); 1 for anything else. */
RFI_FUNC double rfi_cpu_check_scale(void);
/* A checker for program g (the program as traced, which the interpreter
 * runs; g must outlive it) at the given scale (> 0). With a plan (the
 * compiled program's; it and the buffer table, which the backend fills for
 * each run, must outlive the checker too) and RF_CHECK_STEPS not "0", the
 * checker also records the steps' values, through rfi_cpu_check_mark, and
 * checks them when the end-to-end comparison fails. */
RFI_FUNC rf_status rfi_cpu_check_new(const rfi_graph *g, const rfi_plan *plan,
                                     void *const *buffers, double scale, rfi_cpu_check **out);
/* Whether the module must call rfi_cpu_check_mark (the module services'
 * `mark`, with the checker as its context) in every run. */
RFI_FUNC bool rfi_cpu_check_records(const rfi_cpu_check *c);
RFI_FUNC void rfi_cpu_check_mark(void *ctx, int step);
/* Before the compiled run: runs the interpreter on io's arguments and
 * captures into the checker's own buffers (and keeps the captures as they
 * are). */
RFI_FUNC rf_status rfi_cpu_check_before(rfi_cpu_check *c, const rfi_graph *g,
                                        const rfi_run_io *io);
/* After it: compares io's outputs and g's updated captures with the
 * interpreter's, then, where they differ, the steps (check.c); RF_E_INTERNAL
 * naming the first element too far apart. */
RFI_FUNC rf_status rfi_cpu_check_after(rfi_cpu_check *c, const rfi_graph *g,
                                       const rfi_run_io *io);
RFI_FUNC void rfi_cpu_check_free(rfi_cpu_check *c);

#endif
