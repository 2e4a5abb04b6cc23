/* profile.h: RF_PROFILE, per-step timing of a compiled CPU executable
 * (profile.c says how it is measured and reported). */
#ifndef RF_BACKEND_CPU_PROFILE_H
#define RF_BACKEND_CPU_PROFILE_H

#include "services.h"

typedef struct rfi_cpu_profile rfi_cpu_profile;

/* Whether RF_PROFILE asks for profiles (read when a program is compiled). */
RFI_FUNC bool rfi_cpu_profile_wanted(void);
/* A profile of the steps of plan p (p and services must outlive it; NULL on
 * out of memory: the program then runs unprofiled). */
RFI_FUNC rfi_cpu_profile *rfi_cpu_profile_new(const rfi_plan *p,
                                             const rfi_cpu_services *services,
                                             const char *name);
/* module_abi.h's `mark` (ctx is the profile). */
RFI_FUNC void rfi_cpu_profile_mark(void *ctx, int step);
/* Prints the profile on stderr (if any run completed) and frees it. */
RFI_FUNC void rfi_cpu_profile_free(rfi_cpu_profile *prof);

#endif
