/* plan_internal.h: the working state shared by the three files that build an
 * execution plan: plan.c (entry points, final assembly, printing), fuse.c
 * (which nodes are materialised, the ordered steps, outputs and updates) and
 * memplan.c (liveness and arena offsets).
 *
 * Nothing here is part of the plan contract (plan.h); the builder lives only
 * during rfi_plan_build.
 */
#ifndef RF_BACKEND_PLAN_INTERNAL_H
#define RF_BACKEND_PLAN_INTERNAL_H

#include "plan.h"

/* A growable list of node ids (rfi_realloc). */
typedef struct rfi_intlist {
    int *v;
    int n, cap;
} rfi_intlist;
RFI_FUNC bool rfi_intlist_push(rfi_intlist *l, int x);
RFI_FUNC bool rfi_intlist_has(const rfi_intlist *l, int x);
RFI_FUNC void rfi_intlist_free(rfi_intlist *l);

/* A step while the plan is being built. */
typedef struct rfi_bstep {
    rfi_step_kind kind;
    rfi_call_kind call;
    rfi_intlist roots;   /* in the order they joined */
    rfi_intlist inputs;  /* materialised nodes read (aliases resolved), leaves included */
    int copy_to_output;
    int copy_to_capture;
    rfi_copy_scratch copy_scratch;
    int epi;             /* CALL with an epilogue: index into builder->epis, else -1 */
} rfi_bstep;

/* A CALL epilogue found by fuse.c: core node -> ops (last op's node = root). */
typedef struct rfi_epi_chain {
    int core;
    int n;
    rfi_epi_op ops[RFI_EPI_MAX];
} rfi_epi_chain;

typedef struct rfi_plan_builder {
    const rfi_graph *g;
    rfi_plan_opts opts;
    rfi_plan *p;          /* p->loc is filled as decisions are made */
    int n;                /* g->n_nodes */
    int *user_start;      /* users of node x: users[user_start[x] .. user_start[x+1]) (distinct) */
    int *users;
    bool *is_output;
    bool *is_update_value;
    bool *mat;            /* has a location (materialised, leaf buffer or alias) */
    bool *placed;         /* non-leaf root whose location is decided (output/in place/arena) */
    int *step_of;         /* step id computing node x as a root, or -1 */
    rfi_bstep *steps;     /* by step id */
    int n_steps, cap_steps;
    int *order;           /* step ids in execution order (n_steps of them) */
    int *pos_of;          /* position of each step id in `order` */
    int *stamp;           /* scratch marks for graph walks, per node */
    int stamp_gen;
    /* Segment roots (fuse.c): seg_flat[x] is the rank-1 node F that root x is a
     * stride-1 slice of (x = f(reshape(slice(F))), read at x's linear index), or
     * -1; seg_off[x] is the slice's start in F. x's step loops over F's shape. */
    int *seg_flat;
    int64_t *seg_off;
    /* Epilogues (fuse.c): epi_of[x] indexes epis for the last node x of a
     * chain (the CALL step's root), else -1; epi_inline[x]: a core or an
     * intermediate op of a chain (computed inside the call). */
    int *epi_of;
    bool *epi_inline;
    rfi_epi_chain *epis;
    int n_epis, cap_epis;
} rfi_plan_builder;

/* The materialised node whose bytes x uses (follows aliases). */
RFI_FUNC int rfi_plan_resolve(const rfi_plan_builder *b, int x);
/* Position of step id s in execution order. */
RFI_FUNC int rfi_plan_step_pos(const rfi_plan_builder *b, int s);

/* fuse.c: decides every node's materialisation and leaf/alias locations, then
 * forms the steps in order, then places outputs and updates (in place or
 * COPY) and gives every other root an arena location (offset not yet set). */
RFI_FUNC rf_status rfi_fuse_decide(rfi_plan_builder *b);
RFI_FUNC rf_status rfi_fuse_schedule(rfi_plan_builder *b);
RFI_FUNC rf_status rfi_fuse_place_results(rfi_plan_builder *b);
/* Inline nodes computed inside step s (appended to out, ascending ids). */
RFI_FUNC bool rfi_fuse_step_fused(rfi_plan_builder *b, int s, rfi_intlist *out);

/* memplan.c: arena offsets of every RFI_LOC_ARENA node and p->arena_bytes. */
RFI_FUNC rf_status rfi_memplan(rfi_plan_builder *b);

#define RFI_PLAN_ALIGN 64

#endif
