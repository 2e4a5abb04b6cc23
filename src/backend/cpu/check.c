/* check.c: RF_CHECK, the differential mode the test suite uses to check that
 * the compiled backend agrees with the reference interpreter.
 *
 * End to end. Before each compiled run the interpreter runs the program as
 * traced on the same inputs into the checker's buffers; after it, outputs
 * and updated captures are compared element by element. Floats agree when
 * |a - b| <= atol + rtol * |a| (times RF_CHECK's scale), integers and bools
 * when equal, with one exception: a bool output that is a compare of floats.
 * Each of its operands may differ from the interpreter's by rounding (a
 * vectorised exp or log, another summation order), and where the two
 * operands are that close to each other the compare may go either way: `eq`
 * between a log-sum-exp computed twice and the value it should equal is true
 * in one backend and false in the other, both right within their error
 * bounds. So the interpreter's values of those operands are kept too, and a
 * flipped element counts as a disagreement only where the operands were
 * further apart than their two tolerances together. A compare that only
 * feeds other ops (a select, a convert) is judged by what those ops output,
 * as any other node.
 *
 * Step by step. The end-to-end comparison cannot tell a wrong result from
 * rounding that the program magnifies: Adam's first steps map a gradient g
 * to about lr g / (|g| + eps), so two summation orders of a gradient that is
 * nearly zero move a parameter by visibly different amounts, both right. So
 * every compiled run also records each value a step of the plan
 * materialises, as that step left it (the module calls `mark` before each
 * step, when the values of the steps before are final and not yet
 * overwritten), and the captures as they were before the run. When the
 * end-to-end comparison fails, two more interpreter runs decide:
 *   1. the optimised program the plan was built from, each recorded node
 *      compared with the interpreter's computation of it from its operands'
 *      recorded values and then replaced by its recorded value: every step
 *      is checked on the very inputs the compiled step read, so no rounding
 *      is carried from step to step, and a step that read an operand another
 *      step had overwritten (a memory-planning error) computed something else
 *      than the interpreter does from the value as recorded. The outputs and
 *      updated captures after the run must equal where this run ends.
 *   2. the optimised program alone, against the program as traced: the
 *      passes before the plan (simplify, CSE, unroll_pools) must not change
 *      the results beyond rounding.
 * A failure of either is reported (naming the step, or the pass stage);
 * when both hold, the compiled run is the optimised program computed step by
 * step within rounding, and the end-to-end mismatch is rounding magnified by
 * the program: the run passes. Recording costs a copy of every materialised
 * value per run and memory for all of them at once (the arena's values
 * without its reuse). RF_CHECK_STEPS=0: the end-to-end comparison alone;
 * RF_CHECK_STEPS=2: both checks after every run, whatever the end-to-end
 * comparison says (to test the checker, or to find the first step that goes
 * wrong when the results still agree).
 *
 * What a step computes inside itself is still compared at the plain
 * tolerance: rounding magnified within one fused loop (a cancellation whose
 * product the compiled loop fuses into a multiply-add, x * x + z, or a
 * compare of two nearly equal values computed in the loop flipping a select)
 * is reported as a mismatch of that step, as it was end to end. Of the 3676
 * programs of fuzz_ops's corpus, RF_CHECK_STEPS=2 reports two so (their
 * end-to-end results agree). */
#include "check.h"

#include "../interp/interp.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct rfi_cpu_check {
    void *interp;  /* the interpreter's prepared state for the program as traced */
    double scale;  /* the tolerances widened this many times */
    void **values; /* the interpreter's outputs, then its updates */
    int n_values;
    /* The operands of compare outputs, two per such output (nodes of the
     * program, which outlives the checker), and their interpreter values. */
    int n_probes;
    const rfi_node **probe_nodes;
    void **probe_values;
    int *first_probe; /* per output: its first operand's probe, or -1 */

    /* Step by step (NULL plan: RF_CHECK_STEPS=0). */
    bool always;           /* RF_CHECK_STEPS=2 */
    const rfi_plan *plan;  /* its g is the optimised program */
    void *opt_interp;      /* the interpreter's prepared state for it */
    void *const *buffers;  /* the backend's buffer table, filled per run */
    void **recorded;       /* per node of plan->g: its value as its step left it, or NULL */
    int *step_of;          /* per node of plan->g: the step that records it, or -1 */
    int next_step;         /* the steps before it are recorded in this run */
    void **snapshots;      /* per capture: its value before the run */
    void **scratch;        /* outputs, then updates, of interpreter runs of plan->g */
};

double rfi_cpu_check_scale(void)
{
    const char *v = getenv("RF_CHECK");
    if (!v || !*v || strcmp(v, "0") == 0)
        return 0;
    char *end;
    double n = strtod(v, &end);
    return *end == '\0' && n > 1 && isfinite(n) ? n : 1;
}

typedef enum steps_mode {
    STEPS_NEVER,      /* RF_CHECK_STEPS=0 */
    STEPS_ON_MISMATCH, /* the default */
    STEPS_ALWAYS,     /* RF_CHECK_STEPS=2 */
} steps_mode;

static steps_mode steps_wanted(void)
{
    const char *v = getenv("RF_CHECK_STEPS");
    return !v ? STEPS_ON_MISMATCH
           : strcmp(v, "0") == 0 ? STEPS_NEVER
           : strcmp(v, "2") == 0 ? STEPS_ALWAYS
                                 : STEPS_ON_MISMATCH;
}

static bool float_dtype(rf_dtype dt) { return dt == RF_F32 || dt == RF_F64; }

static bool compare_of_floats(const rfi_node *x)
{
    return x->op == RFI_OP_COMPARE && float_dtype(x->in[0]->dtype);
}

static void free_all(void **v, int n)
{
    for (int i = 0; v && i < n; i++)
        rfi_free(v[i]);
    rfi_free(v);
}

void rfi_cpu_check_free(rfi_cpu_check *c)
{
    if (!c)
        return;
    if (c->interp)
        rfi_interp_backend.release(c->interp);
    if (c->opt_interp)
        rfi_interp_backend.release(c->opt_interp);
    free_all(c->values, c->n_values);
    free_all(c->probe_values, c->n_probes);
    rfi_free(c->probe_nodes);
    rfi_free(c->first_probe);
    if (c->plan) {
        const rfi_graph *opt = c->plan->g;
        free_all(c->recorded, opt->n_nodes);
        free_all(c->snapshots, opt->n_captures);
        free_all(c->scratch, opt->n_outputs + opt->n_updates);
    }
    rfi_free(c->step_of);
    rfi_free(c);
}

/* A buffer of n bytes, never a NULL for an empty value. */
static void *buffer(size_t n) { return rfi_malloc(n ? n : 1); }

/* Lists the operands of g's compare outputs as probes. */
static bool plan_probes(rfi_cpu_check *c, const rfi_graph *g)
{
    int n = g->n_outputs;
    c->first_probe = rfi_malloc((size_t)(n ? n : 1) * sizeof *c->first_probe);
    c->probe_nodes = rfi_calloc((size_t)(2 * n + 1), sizeof *c->probe_nodes);
    c->probe_values = rfi_calloc((size_t)(2 * n + 1), sizeof *c->probe_values);
    if (!c->first_probe || !c->probe_nodes || !c->probe_values)
        return false;
    for (int i = 0; i < n; i++) {
        const rfi_node *x = g->outputs[i];
        c->first_probe[i] = -1;
        if (!compare_of_floats(x))
            continue;
        c->first_probe[i] = c->n_probes;
        for (int j = 0; j < 2; j++) {
            c->probe_values[c->n_probes] = buffer(rfi_node_nbytes(x->in[j]));
            if (!c->probe_values[c->n_probes])
                return false;
            c->probe_nodes[c->n_probes++] = x->in[j];
        }
    }
    return true;
}

/* Whether the step that computes node x leaves its value in a buffer of its
 * own that the checker can read after the step (an alias is read through its
 * source, a tile or a left-out step's root has no bytes). */
static bool recordable(const rfi_plan *p, int x)
{
    rfi_loc_kind k = p->loc[x].kind;
    return k == RFI_LOC_ARENA || k == RFI_LOC_OUTPUT || k == RFI_LOC_IN_PLACE;
}

/* Buffers for the step-by-step check: the recorded value of every root a
 * step materialises, the captures' snapshots and the interpreter's results. */
static bool plan_steps(rfi_cpu_check *c)
{
    const rfi_graph *opt = c->plan->g;
    int n_results = opt->n_outputs + opt->n_updates;
    c->recorded = rfi_calloc((size_t)opt->n_nodes + 1, sizeof *c->recorded);
    c->step_of = rfi_malloc(((size_t)opt->n_nodes + 1) * sizeof *c->step_of);
    c->snapshots = rfi_calloc((size_t)opt->n_captures + 1, sizeof *c->snapshots);
    c->scratch = rfi_calloc((size_t)n_results + 1, sizeof *c->scratch);
    if (!c->recorded || !c->step_of || !c->snapshots || !c->scratch)
        return false;
    for (int x = 0; x < opt->n_nodes; x++)
        c->step_of[x] = -1;
    for (int q = 0; q < c->plan->n_steps; q++) {
        const rfi_step *st = &c->plan->steps[q];
        for (int r = 0; st->kind != RFI_STEP_COPY && r < st->n_roots; r++) {
            int x = st->roots[r];
            if (!recordable(c->plan, x) || c->recorded[x])
                continue;
            c->step_of[x] = q;
            if (!(c->recorded[x] = buffer(rfi_node_nbytes(opt->nodes[x]))))
                return false;
        }
    }
    for (int k = 0; k < opt->n_captures; k++)
        if (!(c->snapshots[k] = buffer(opt->captures[k]->nbytes)))
            return false;
    for (int i = 0; i < opt->n_outputs; i++)
        if (!(c->scratch[i] = buffer(rfi_node_nbytes(opt->outputs[i]))))
            return false;
    for (int i = 0; i < opt->n_updates; i++) {
        size_t bytes = opt->captures[opt->updates[i].capture]->nbytes;
        if (!(c->scratch[opt->n_outputs + i] = buffer(bytes)))
            return false;
    }
    return true;
}

/* Whether the optimised program's results line up with the traced
 * program's, index by index (the passes keep them so). */
static bool same_results(const rfi_graph *g, const rfi_graph *opt)
{
    if (g->n_outputs != opt->n_outputs || g->n_updates != opt->n_updates ||
        g->n_args != opt->n_args || g->n_captures != opt->n_captures)
        return false;
    for (int i = 0; i < g->n_updates; i++)
        if (g->updates[i].capture != opt->updates[i].capture)
            return false;
    for (int k = 0; k < g->n_captures; k++)
        if (g->captures[k] != opt->captures[k])
            return false;
    return true;
}

rf_status rfi_cpu_check_new(const rfi_graph *g, const rfi_plan *plan, void *const *buffers,
                            double scale, rfi_cpu_check **out)
{
    *out = NULL;
    rfi_cpu_check *c = rfi_calloc(1, sizeof *c);
    if (!c)
        return rfi_error(RF_E_NOMEM, "RF_CHECK: out of memory");
    c->scale = scale;
    c->n_values = g->n_outputs + g->n_updates;
    c->values = rfi_calloc((size_t)(c->n_values ? c->n_values : 1), sizeof *c->values);
    bool ok = c->values && plan_probes(c, g);
    for (int i = 0; ok && i < g->n_outputs; i++)
        ok = (c->values[i] = buffer(rfi_node_nbytes(g->outputs[i]))) != NULL;
    for (int i = 0; ok && i < g->n_updates; i++) {
        size_t bytes = g->captures[g->updates[i].capture]->nbytes;
        ok = (c->values[g->n_outputs + i] = buffer(bytes)) != NULL;
    }
    steps_mode steps = steps_wanted();
    if (ok && plan && steps != STEPS_NEVER) {
        if (!same_results(g, plan->g)) {
            rfi_cpu_check_free(c);
            return rfi_error(RF_E_INTERNAL, "RF_CHECK: the optimised program's arguments, "
                             "captures, outputs or updates do not match the traced program's");
        }
        c->plan = plan;
        c->always = steps == STEPS_ALWAYS;
        c->buffers = buffers;
        ok = plan_steps(c);
    }
    if (!ok) {
        rfi_cpu_check_free(c);
        return rfi_error(RF_E_NOMEM, "RF_CHECK: out of memory");
    }
    rf_status st = rfi_interp_backend.prepare(g, &c->interp);
    if (st == RF_OK && c->plan)
        st = rfi_interp_backend.prepare(plan->g, &c->opt_interp);
    if (st != RF_OK) {
        rfi_cpu_check_free(c);
        return st;
    }
    *out = c;
    return RF_OK;
}

bool rfi_cpu_check_records(const rfi_cpu_check *c) { return c && c->plan; }

/* ---- Recording ----------------------------------------------------------------- */

/* Copies node x's buffer into its record, row-major whatever its layout. */
static void record(rfi_cpu_check *c, int x)
{
    const rfi_plan *p = c->plan;
    const rfi_node *n = p->g->nodes[x];
    int buf;
    size_t offset;
    rfi_plan_buffer(p, x, &buf, &offset);
    const char *src = (const char *)c->buffers[buf] + offset;
    char *dst = c->recorded[x];
    rfi_layout l = rfi_plan_layout(p, x);
    if (l == RFI_LAYOUT_PLAIN || n->rank != 4) {
        rfi_interp_copy(dst, src, rfi_node_nbytes(n));
        return;
    }
    size_t esize = rf_dtype_size(n->dtype);
    const int64_t *d = n->dims;
    for (int64_t i = 0, at = 0; i < d[0]; i++)
        for (int64_t ch = 0; ch < d[1]; ch++)
            for (int64_t h = 0; h < d[2]; h++)
                for (int64_t w = 0; w < d[3]; w++, at++)
                    memcpy(dst + (size_t)at * esize,
                           src + (size_t)rfi_layout_offset(l, d, i, ch, h, w) * esize, esize);
}

void rfi_cpu_check_mark(void *ctx, int step)
{
    rfi_cpu_check *c = ctx;
    int upto = step < 0 || step > c->plan->n_steps ? c->plan->n_steps : step;
    for (; c->next_step < upto; c->next_step++) {
        const rfi_step *st = &c->plan->steps[c->next_step];
        for (int r = 0; r < st->n_roots; r++)
            if (c->step_of[st->roots[r]] == c->next_step)
                record(c, st->roots[r]);
    }
}

/* The end-to-end run's visitor: copies the values of the compare outputs'
 * operands as they are made. */
static rf_status keep_probes(void *ctx, const rfi_node *n, const void **value,
                             const void *const *operands)
{
    const rfi_cpu_check *c = ctx;
    (void)operands;
    for (int j = 0; j < c->n_probes; j++)
        if (c->probe_nodes[j] == n)
            rfi_interp_copy(c->probe_values[j], *value, rfi_node_nbytes(n));
    return RF_OK;
}

rf_status rfi_cpu_check_before(rfi_cpu_check *c, const rfi_graph *g, const rfi_run_io *io)
{
    if (c->plan) {
        c->next_step = 0;
        for (int k = 0; k < g->n_captures; k++)
            rfi_interp_copy(c->snapshots[k], io->captures[k], g->captures[k]->nbytes);
    }
    rfi_run_io ref = {io->args, io->captures, c->values, c->values + g->n_outputs};
    return rfi_interp_run_visited(c->interp, g, &ref, keep_probes, c);
}
/* How far two buffers of one dtype are apart, in units of the tolerance
 * |a - b| <= atol + rtol * |a| (> 1 means out of tolerance). Integers and
 * bools must match exactly. The absolute term keeps values that are pure
 * rounding noise around zero (a gradient that is mathematically 0) from
 * failing the comparison. */
static const double rtol = 1e-4;
#define RFI_MAX_OPERANDS_CHECKED 8 /* the most operands of an accumulating op */
static double atol_of(rf_dtype dt) { return dt == RF_F64 ? 1e-12 : 1e-6; }

static double distance(rf_dtype dt, const void *a, const void *b, int64_t n, int64_t *where)
{
    double worst = 0;
    for (int64_t i = 0; i < n; i++) {
        double x = rfi_element_as_double(dt, a, i), y = rfi_element_as_double(dt, b, i);
        if (x == y || (isnan(x) && isnan(y)))
            continue;
        double d = !float_dtype(dt) ? INFINITY : fabs(x - y) / (atol_of(dt) + rtol * fabs(x));
        if (isnan(d) || d > worst) {
            worst = isnan(d) ? INFINITY : d;
            *where = i;
        }
    }
    return worst;
}

/* For a compare output: where the two results differ, how far the
 * interpreter's operands a and b were apart in units of both their
 * tolerances, 2 * (atol + rtol * max(|a|, |b|)); a flip within that is
 * rounding. Operands that are NaN or infinite never excuse a flip. */
static double compare_distance(rf_dtype operand_dt, const void *ours, const void *theirs,
                               const void *a, const void *b, int64_t n, int64_t *where)
{
    double worst = 0;
    bool flipped = false;
    for (int64_t i = 0; i < n; i++) {
        if (rfi_element_as_double(RF_BOOL, ours, i) == rfi_element_as_double(RF_BOOL, theirs, i))
            continue;
        double x = rfi_element_as_double(operand_dt, a, i);
        double y = rfi_element_as_double(operand_dt, b, i);
        double tol = 2 * (atol_of(operand_dt) + rtol * fmax(fabs(x), fabs(y)));
        double d = isfinite(x) && isfinite(y) ? fabs(x - y) / tol : INFINITY;
        if (!flipped || d > worst) {
            worst = d;
            *where = i;
            flipped = true;
        }
    }
    return worst;
}

/* `what` ends each message: which two results disagree when it is not the
 * compiled run and the interpreter's run of the program as traced. */
static rf_status check_compare(const rfi_cpu_check *c, int i, const rfi_node *x,
                               const void *ours, const char *what)
{
    int64_t at = 0;
    const void *a = c->probe_values[c->first_probe[i]];
    const void *b = c->probe_values[c->first_probe[i] + 1];
    const void *theirs = c->values[i];
    rf_dtype dt = x->in[0]->dtype;
    double d = compare_distance(dt, ours, theirs, a, b, rfi_node_numel(x), &at);
    if (d <= c->scale)
        return RF_OK;
    return rfi_error(RF_E_INTERNAL, "RF_CHECK: output %d (%%%d compare) element %lld is %g, "
                     "the interpreter's %g, comparing the interpreter's %.9g with the "
                     "interpreter's %.9g: %.3g tolerances apart%s", i, x->id, (long long)at,
                     rfi_element_as_double(RF_BOOL, ours, at),
                     rfi_element_as_double(RF_BOOL, theirs, at),
                     rfi_element_as_double(dt, a, at), rfi_element_as_double(dt, b, at), d, what);
}

static rf_status check_output(const rfi_cpu_check *c, int i, const rfi_node *x, const void *ours,
                              const char *what)
{
    if (c->first_probe[i] >= 0)
        return check_compare(c, i, x, ours, what);
    int64_t at = 0;
    double d = distance(x->dtype, c->values[i], ours, rfi_node_numel(x), &at);
    if (d <= c->scale)
        return RF_OK;
    return rfi_error(RF_E_INTERNAL, "RF_CHECK: output %d (%%%d %s) element %lld is %.9g, "
                     "the interpreter's %.9g: %.3g tolerances apart%s", i, x->id,
                     rfi_op_table[x->op].name, (long long)at,
                     rfi_element_as_double(x->dtype, ours, at),
                     rfi_element_as_double(x->dtype, c->values[i], at), d, what);
}

/* Update i's new value: updates[i], or (updates NULL) its capture's data. */
static const void *update_of(const rfi_graph *g, int i, void *const *updates)
{
    return updates ? updates[i] : g->captures[g->updates[i].capture]->data;
}

/* Compares outputs and updates (NULL: the captures as they are now) with the
 * interpreter's run of the program as traced. */
static rf_status check_results(const rfi_cpu_check *c, const rfi_graph *g, void *const *outputs,
                               void *const *updates, const char *what)
{
    for (int i = 0; i < g->n_outputs; i++) {
        rf_status st = check_output(c, i, g->outputs[i], outputs[i], what);
        if (st != RF_OK)
            return st;
    }
    for (int i = 0; i < g->n_updates; i++) {
        const rf_array *a = g->captures[g->updates[i].capture];
        const void *ours = update_of(g, i, updates);
        const void *theirs = c->values[g->n_outputs + i];
        int64_t at = 0;
        double d = distance(a->dtype, theirs, ours, a->numel, &at);
        if (d > c->scale)
            return rfi_error(RF_E_INTERNAL, "RF_CHECK: update %d (capture %d) element %lld is "
                             "%.9g, the interpreter's %.9g: %.3g tolerances apart%s", i,
                             g->updates[i].capture, (long long)at,
                             rfi_element_as_double(a->dtype, ours, at),
                             rfi_element_as_double(a->dtype, theirs, at), d, what);
    }
    return RF_OK;
}

/* ---- Step by step --------------------------------------------------------------- */

/* Whether node n adds terms in an order a compiled step may choose (a sum
 * of products, a sum reduction), so that its rounding error scales with the
 * terms' magnitudes rather than with its result's. */
static bool accumulates(const rfi_node *n)
{
    if (!float_dtype(n->dtype))
        return false;
    switch (n->op) {
    case RFI_OP_DOT_GENERAL:
    case RFI_OP_CONVOLUTION:
    case RFI_OP_SCATTER_ADD: return true;
    case RFI_OP_REDUCE:
    case RFI_OP_REDUCE_WINDOW: return n->attr.i[0] == RF_REDUCE_SUM;
    default: return false;
    }
}

/* For an accumulating node: the sum of the magnitudes of its terms, n
 * evaluated on the absolute values of its float operands (owned; NULL when
 * memory ran out). */
static void *magnitudes(const rfi_node *n, const void *const *operands)
{
    void *abs_in[RFI_MAX_OPERANDS_CHECKED] = {0};
    const void *in[RFI_MAX_OPERANDS_CHECKED];
    void *out = buffer(rfi_node_nbytes(n));
    bool ok = out && n->n_in <= RFI_MAX_OPERANDS_CHECKED;
    for (int k = 0; ok && k < n->n_in; k++) {
        const rfi_node *x = n->in[k];
        in[k] = operands[k];
        if (!float_dtype(x->dtype))
            continue;
        int64_t numel = rfi_node_numel(x);
        ok = (abs_in[k] = buffer(rfi_node_nbytes(x))) != NULL;
        for (int64_t i = 0; ok && i < numel; i++) {
            if (x->dtype == RF_F32)
                ((float *)abs_in[k])[i] = fabsf(((const float *)operands[k])[i]);
            else
                ((double *)abs_in[k])[i] = fabs(((const double *)operands[k])[i]);
        }
        in[k] = abs_in[k];
    }
    if (ok)
        ok = rfi_interp_eval_node(n, in, out) == RF_OK;
    for (int k = 0; k < n->n_in && k < RFI_MAX_OPERANDS_CHECKED; k++)
        rfi_free(abs_in[k]);
    if (!ok) {
        rfi_free(out);
        return NULL;
    }
    return out;
}

/* distance() with each element's tolerance relative to the larger of its
 * value and its terms' magnitude mag. */
static double distance_of_sum(rf_dtype dt, const void *a, const void *b, const void *mag,
                              int64_t n, int64_t *where)
{
    double worst = 0;
    for (int64_t i = 0; i < n; i++) {
        double x = rfi_element_as_double(dt, a, i), y = rfi_element_as_double(dt, b, i);
        if (x == y || (isnan(x) && isnan(y)))
            continue;
        double m = fmax(fabs(x), rfi_element_as_double(dt, mag, i));
        double d = fabs(x - y) / (atol_of(dt) + rtol * m);
        if (isnan(d) || d > worst) {
            worst = isnan(d) ? INFINITY : d;
            *where = i;
        }
    }
    return worst;
}

/* The step-by-step run's visitor: a recorded node must be what the
 * interpreter computes from its operands (recorded values where they are
 * recorded); the nodes after then read the recorded value. */
static rf_status check_recorded(void *ctx, const rfi_node *n, const void **value,
                                const void *const *operands)
{
    const rfi_cpu_check *c = ctx;
    int q = c->step_of[n->id];
    if (q < 0)
        return RF_OK;
    const void *ours = c->recorded[n->id];
    int64_t at = 0, numel = rfi_node_numel(n);
    double d = compare_of_floats(n)
                   ? compare_distance(n->in[0]->dtype, ours, *value, operands[0], operands[1],
                                      numel, &at)
                   : distance(n->dtype, *value, ours, numel, &at);
    if (d > c->scale && accumulates(n)) {
        void *mag = magnitudes(n, operands);
        if (!mag)
            return rfi_error(RF_E_NOMEM, "RF_CHECK: out of memory");
        d = distance_of_sum(n->dtype, *value, ours, mag, numel, &at);
        rfi_free(mag);
    }
    if (d <= c->scale) {
        *value = ours;
        return RF_OK;
    }
    const char *op = rfi_op_table[n->op].name, *kind = rfi_step_kind_name(&c->plan->steps[q]);
    if (compare_of_floats(n)) {
        rf_dtype dt = n->in[0]->dtype;
        return rfi_error(RF_E_INTERNAL, "RF_CHECK: step %d (%s) computes %%%d %s element %lld "
                         "as %g, the interpreter's %g from the values the step read, comparing "
                         "the interpreter's %.9g with the interpreter's %.9g: %.3g tolerances "
                         "apart", q, kind, n->id, op, (long long)at,
                         rfi_element_as_double(RF_BOOL, ours, at),
                         rfi_element_as_double(RF_BOOL, *value, at),
                         rfi_element_as_double(dt, operands[0], at),
                         rfi_element_as_double(dt, operands[1], at), d);
    }
    return rfi_error(RF_E_INTERNAL, "RF_CHECK: step %d (%s) computes %%%d %s element %lld as "
                     "%.9g, the interpreter's %.9g from the values the step read: %.3g "
                     "tolerances apart", q, kind, n->id, op, (long long)at,
                     rfi_element_as_double(n->dtype, ours, at),
                     rfi_element_as_double(n->dtype, *value, at), d);
}

/* Check 1 of the header: every step on the values it read, then the
 * results after the run against where the steps left them. */
static rf_status check_steps(const rfi_cpu_check *c, const rfi_graph *g, const rfi_run_io *io)
{
    const rfi_graph *opt = c->plan->g;
    if (c->next_step != c->plan->n_steps)
        return rfi_error(RF_E_INTERNAL, "RF_CHECK: the compiled run marked %d of its %d steps",
                         c->next_step, c->plan->n_steps);
    rfi_run_io steps = {io->args, c->snapshots, c->scratch, c->scratch + opt->n_outputs};
    rf_status st = rfi_interp_run_visited(c->opt_interp, opt, &steps, check_recorded,
                                          (void *)c);
    for (int i = 0; st == RF_OK && i < opt->n_outputs; i++) {
        const rfi_node *x = opt->outputs[i];
        int64_t at = 0;
        double d = distance(x->dtype, c->scratch[i], io->outputs[i], rfi_node_numel(x), &at);
        if (d > c->scale)
            st = rfi_error(RF_E_INTERNAL, "RF_CHECK: output %d element %lld is %.9g after the "
                           "run, %.9g as its step left it: %.3g tolerances apart", i,
                           (long long)at, rfi_element_as_double(x->dtype, io->outputs[i], at),
                           rfi_element_as_double(x->dtype, c->scratch[i], at), d);
    }
    for (int i = 0; st == RF_OK && i < opt->n_updates; i++) {
        const rf_array *a = g->captures[g->updates[i].capture];
        const void *theirs = c->scratch[opt->n_outputs + i];
        int64_t at = 0;
        double d = distance(a->dtype, theirs, a->data, a->numel, &at);
        if (d > c->scale)
            st = rfi_error(RF_E_INTERNAL, "RF_CHECK: update %d (capture %d) element %lld is "
                           "%.9g after the run, %.9g as its step left it: %.3g tolerances "
                           "apart", i, g->updates[i].capture, (long long)at,
                           rfi_element_as_double(a->dtype, a->data, at),
                           rfi_element_as_double(a->dtype, theirs, at), d);
    }
    return st;
}

/* Check 2 of the header: the optimised program against the traced one, both
 * in the interpreter. */
static rf_status check_passes(const rfi_cpu_check *c, const rfi_graph *g, const rfi_run_io *io)
{
    const rfi_graph *opt = c->plan->g;
    rfi_run_io plain = {io->args, c->snapshots, c->scratch, c->scratch + opt->n_outputs};
    rf_status st = rfi_interp_run_visited(c->opt_interp, opt, &plain, NULL, NULL);
    if (st != RF_OK)
        return st;
    return check_results(c, g, c->scratch, c->scratch + opt->n_outputs,
                         " (that is the optimised program's value in the interpreter, which "
                         "the compiled run follows step by step: the passes before the plan "
                         "changed the result)");
}

rf_status rfi_cpu_check_after(const rfi_cpu_check *c, const rfi_graph *g, const rfi_run_io *io)
{
    rf_status st = check_results(c, g, io->outputs, NULL, "");
    if ((st == RF_OK && !c->always) || !c->plan)
        return st;
    st = check_steps(c, g, io);
    return st == RF_OK ? check_passes(c, g, io) : st;
}
