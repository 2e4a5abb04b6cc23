/* profile.c: RF_PROFILE, the per-step profile of a compiled CPU executable.
 *
 * With RF_PROFILE set (to anything but "0") when a program is compiled, the
 * generated module calls `mark` with each plan step's index just before the
 * step runs and with -1 at the end (module_abi.h); the time between two
 * marks is charged to the step that was running (a pair of library calls
 * made by one call, plan.h's runs_with_next, to the first: its line names
 * both). The first run is left out when there are more (it pays one-time
 * costs: page faults, oneDNN's first executions). When the executable is
 * freed, the profile is printed on stderr: time per run, the most expensive
 * steps with what they compute (15, or n with RF_PROFILE=n for n > 1), and
 * the share of each kind of step.
 *
 * Without RF_PROFILE the module's check of `mark` is the whole cost.
 * Deliberately not here: sampling, hardware counters (perf does those),
 * profiles of the interpreter.
 */
#include "profile.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Steps listed by name (RF_PROFILE=<n>, n > 1, lists n); the rest are in the
 * kind summary. */
#define TOP_STEPS 15

struct rfi_cpu_profile {
    const rfi_plan *plan;
    const rfi_cpu_services *services;
    char name[64];
    int64_t *ns;        /* per step: time charged in the counted runs */
    int64_t *first_ns;  /* per step: time charged in the first run */
    int64_t runs;       /* completed runs */
    int current;        /* step running, or -1 */
    int64_t since;      /* when it started (CLOCK_MONOTONIC ns) */
};

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

bool rfi_cpu_profile_wanted(void)
{
    const char *v = getenv("RF_PROFILE");
    return v && *v && strcmp(v, "0") != 0;
}

rfi_cpu_profile *rfi_cpu_profile_new(const rfi_plan *p, const rfi_cpu_services *services,
                                     const char *name)
{
    rfi_cpu_profile *prof = rfi_calloc(1, sizeof *prof);
    if (!prof)
        return NULL;
    prof->ns = rfi_calloc((size_t)p->n_steps + 1, sizeof *prof->ns);
    prof->first_ns = rfi_calloc((size_t)p->n_steps + 1, sizeof *prof->first_ns);
    if (!prof->ns || !prof->first_ns) {
        rfi_cpu_profile_free(prof);
        return NULL;
    }
    prof->plan = p;
    prof->services = services;
    prof->current = -1;
    snprintf(prof->name, sizeof prof->name, "%s", name ? name : "program");
    return prof;
}

void rfi_cpu_profile_mark(void *ctx, int step)
{
    rfi_cpu_profile *prof = ctx;
    int64_t t = now_ns();
    if (prof->current >= 0) {
        int64_t *acc = prof->runs == 0 ? prof->first_ns : prof->ns;
        acc[prof->current] += t - prof->since;
    }
    prof->current = step >= 0 && step < prof->plan->n_steps ? step : -1;
    prof->since = t;
    if (step < 0)
        prof->runs++;
}

/* ---- Report ---------------------------------------------------------------------- */

/* "CALL CONV bwd-weights: convolution f32[32,64,3,3]" and the like. */
static void describe_step(const rfi_cpu_profile *prof, int q, rfi_strbuf *sb)
{
    const rfi_step *s = &prof->plan->steps[q];
    const rfi_node *root = prof->plan->g->nodes[s->roots[0]];
    bool reduce_epilogue = s->kind == RFI_STEP_REDUCE && s->core != s->roots[0];
    const rfi_node *what = (s->kind == RFI_STEP_CALL && s->n_epilogue > 0) || reduce_epilogue
                               ? prof->plan->g->nodes[s->core]
                               : root;
    rfi_sb_printf(sb, "%s", rfi_step_kind_name(s));
    if (s->kind == RFI_STEP_CALL)
        rfi_sb_printf(sb, " %s", rfi_cpu_services_step_path(prof->services, q));
    rfi_sb_printf(sb, ": %s", rfi_op_table[what->op].name);
    if (s->n_roots > 1)
        rfi_sb_printf(sb, " +%d roots", s->n_roots - 1);
    if (s->n_epilogue > 0)
        rfi_sb_printf(sb, " +%d epilogue ops", s->n_epilogue);
    if (reduce_epilogue)
        rfi_sb_printf(sb, " +%s", rfi_op_table[root->op].name);
    rfi_sb_printf(sb, " ");
    rfi_sb_type(sb, root->dtype, root->dims, root->rank);
    int in_place = rfi_plan_step_slabs(prof->plan, s);
    if (in_place > 0)
        rfi_sb_printf(sb, ", %d of %d operands in place", in_place, root->n_in);
}

/* Step q is the second call of a pair: the first's call runs it, and its
 * time is the first's. */
static bool runs_with_previous(const rfi_cpu_profile *prof, int q)
{
    return q > 0 && prof->plan->steps[q - 1].runs_with_next;
}

/* How many steps the report lists: RF_PROFILE's number when it is above 1,
 * else TOP_STEPS. A number past int's range lists them all (atoi's result
 * there is undefined: "4294967298" came out as 2). */
static int steps_listed(void)
{
    const char *v = getenv("RF_PROFILE");
    long n = v ? strtol(v, NULL, 10) : 0;
    return n > INT_MAX ? INT_MAX : n > 1 ? (int)n : TOP_STEPS;
}

/* A step's line; the first call of a pair also names the second and how the
 * two ran. */
static void describe(const rfi_cpu_profile *prof, int q, char *buf, size_t size)
{
    rfi_strbuf sb = {0};
    describe_step(prof, q, &sb);
    if (prof->plan->steps[q].runs_with_next && q + 1 < prof->plan->n_steps) {
        rfi_sb_printf(&sb, "\n                           with #%d ", q + 1);
        describe_step(prof, q + 1, &sb);
        rfi_sb_printf(&sb, ", %s", rfi_cpu_services_step_beside(prof->services, q)
                                       ? "side by side"
                                       : "one after the other");
    }
    snprintf(buf, size, "%s", sb.data ? sb.data : "?");
    rfi_sb_free(&sb);
}

typedef struct step_time {
    int64_t ns;
    int step;
} step_time;

static int by_time(const void *a, const void *b)
{
    int64_t x = ((const step_time *)a)->ns, y = ((const step_time *)b)->ns;
    return x < y ? 1 : x > y ? -1 : 0;
}

static void report(const rfi_cpu_profile *prof)
{
    int n = prof->plan->n_steps;
    const int64_t *ns = prof->runs > 1 ? prof->ns : prof->first_ns;
    int64_t runs = prof->runs > 1 ? prof->runs - 1 : prof->runs;
    int64_t total = 0;
    for (int q = 0; q < n; q++)
        total += ns[q];
    if (runs == 0 || total == 0)
        return;
    step_time *order = rfi_malloc((size_t)n * sizeof *order);
    if (!order)
        return;
    for (int q = 0; q < n; q++)
        order[q] = (step_time){ns[q], q};
    qsort(order, (size_t)n, sizeof *order, by_time);
    fprintf(stderr, "reflux profile: %s, %d steps, %lld runs%s, %.1f us per run\n", prof->name, n,
            (long long)runs, prof->runs > 1 ? " (the first left out)" : "",
            1e-3 * (double)total / (double)runs);
    fprintf(stderr, "   share     us/run  step\n");
    int listed = steps_listed();
    for (int i = 0, shown = 0; i < n && shown < listed; i++) {
        if (runs_with_previous(prof, order[i].step))
            continue;
        shown++;
        char what[320];
        describe(prof, order[i].step, what, sizeof what);
        fprintf(stderr, "  %5.1f%% %10.1f  #%-4d %s\n", 100.0 * (double)order[i].ns / (double)total,
                1e-3 * (double)order[i].ns / (double)runs, order[i].step, what);
    }
    static const char *const kinds[] = {"LOOP", "REDUCE", "CALL MATMUL", "CALL CONV",
                                        "CALL FALLBACK", "COPY"};
    /* Steps per kind, and how many of them run in a pair (timed as one, under
     * the pair's first step). */
    fprintf(stderr, "  by kind:");
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        int64_t sum = 0;
        int count = 0, paired = 0;
        for (int q = 0; q < n; q++)
            if (strcmp(rfi_step_kind_name(&prof->plan->steps[q]), kinds[k]) == 0) {
                sum += ns[q], count++;
                paired += prof->plan->steps[q].runs_with_next || runs_with_previous(prof, q);
            }
        if (count == 0)
            continue;
        fprintf(stderr, " %s %.1f%% (%d", kinds[k], 100.0 * (double)sum / (double)total, count);
        if (paired)
            fprintf(stderr, ", %d paired", paired);
        fprintf(stderr, ")");
    }
    fprintf(stderr, "\n");
    rfi_free(order);
}

void rfi_cpu_profile_free(rfi_cpu_profile *prof)
{
    if (!prof)
        return;
    if (prof->plan)
        report(prof);
    rfi_free(prof->ns);
    rfi_free(prof->first_ns);
    rfi_free(prof);
}
