/* check.c: RF_CHECK, the differential mode the test suite uses to check that
 * the compiled backend agrees with the reference interpreter. Before each
 * compiled run the interpreter runs the same program on the same inputs into
 * the checker's buffers; after it, outputs and updated captures are compared
 * element by element.
 *
 * Floats agree when |a - b| <= atol + rtol * |a| (times RF_CHECK's scale),
 * integers and bools when equal, with one exception: a bool output that is a
 * compare of floats. Each of its operands may differ from the interpreter's
 * by rounding (a vectorised exp or log, another summation order), and where
 * the two operands are that close to each other the compare may go either
 * way: `eq` between a log-sum-exp computed twice and the value it should
 * equal is true in one backend and false in the other, both right within
 * their error bounds. So the interpreter's values of those operands are kept
 * too (a probed run), and a flipped element counts as a disagreement only
 * where the operands were further apart than their two tolerances together.
 * A compare that only feeds other ops (a select, a convert) is judged by what
 * those ops output, as any other node.
 */
#include "check.h"

#include "../interp/interp.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct rfi_cpu_check {
    void *interp;  /* the interpreter's prepared state for the program */
    double scale;  /* the tolerances widened this many times */
    void **values; /* the interpreter's outputs, then its updates */
    int n_values;
    /* The operands of compare outputs, two per such output (nodes of the
     * program, which outlives the checker), and their interpreter values. */
    int n_probes;
    const rfi_node **probe_nodes;
    void **probe_values;
    int *first_probe; /* per output: its first operand's probe, or -1 */
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

static bool float_dtype(rf_dtype dt) { return dt == RF_F32 || dt == RF_F64; }

static bool compare_of_floats(const rfi_node *x)
{
    return x->op == RFI_OP_COMPARE && float_dtype(x->in[0]->dtype);
}

void rfi_cpu_check_free(rfi_cpu_check *c)
{
    if (!c)
        return;
    if (c->interp)
        rfi_interp_backend.release(c->interp);
    for (int i = 0; c->values && i < c->n_values; i++)
        rfi_free(c->values[i]);
    for (int i = 0; c->probe_values && i < c->n_probes; i++)
        rfi_free(c->probe_values[i]);
    rfi_free(c->values);
    rfi_free(c->probe_nodes);
    rfi_free(c->probe_values);
    rfi_free(c->first_probe);
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

rf_status rfi_cpu_check_new(const rfi_graph *g, double scale, rfi_cpu_check **out)
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
    if (!ok) {
        rfi_cpu_check_free(c);
        return rfi_error(RF_E_NOMEM, "RF_CHECK: out of memory");
    }
    rf_status st = rfi_interp_backend.prepare(g, &c->interp);
    if (st != RF_OK) {
        rfi_cpu_check_free(c);
        return st;
    }
    *out = c;
    return RF_OK;
}

rf_status rfi_cpu_check_before(rfi_cpu_check *c, const rfi_graph *g, const rfi_run_io *io)
{
    rfi_run_io ref = {io->args, io->captures, c->values, c->values + g->n_outputs};
    return rfi_interp_run_probed(c->interp, g, &ref, c->probe_nodes, c->n_probes,
                                 c->probe_values);
}

/* How far two buffers of one dtype are apart, in units of the tolerance
 * |a - b| <= atol + rtol * |a| (> 1 means out of tolerance). Integers and
 * bools must match exactly. The absolute term keeps values that are pure
 * rounding noise around zero (a gradient that is mathematically 0) from
 * failing the comparison. */
static const double rtol = 1e-4;
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

static rf_status check_compare(const rfi_cpu_check *c, int i, const rfi_node *x,
                               const void *ours)
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
                     "interpreter's %.9g: %.3g tolerances apart", i, x->id, (long long)at,
                     rfi_element_as_double(RF_BOOL, ours, at),
                     rfi_element_as_double(RF_BOOL, theirs, at),
                     rfi_element_as_double(dt, a, at), rfi_element_as_double(dt, b, at), d);
}

static rf_status check_output(const rfi_cpu_check *c, int i, const rfi_node *x, const void *ours)
{
    if (c->first_probe[i] >= 0)
        return check_compare(c, i, x, ours);
    int64_t at = 0;
    double d = distance(x->dtype, c->values[i], ours, rfi_node_numel(x), &at);
    if (d <= c->scale)
        return RF_OK;
    return rfi_error(RF_E_INTERNAL, "RF_CHECK: output %d (%%%d %s) element %lld is %.9g, "
                     "the interpreter's %.9g: %.3g tolerances apart", i, x->id,
                     rfi_op_table[x->op].name, (long long)at,
                     rfi_element_as_double(x->dtype, ours, at),
                     rfi_element_as_double(x->dtype, c->values[i], at), d);
}

rf_status rfi_cpu_check_after(const rfi_cpu_check *c, const rfi_graph *g, const rfi_run_io *io)
{
    for (int i = 0; i < g->n_outputs; i++) {
        rf_status st = check_output(c, i, g->outputs[i], io->outputs[i]);
        if (st != RF_OK)
            return st;
    }
    for (int i = 0; i < g->n_updates; i++) {
        const rf_array *a = g->captures[g->updates[i].capture];
        const void *theirs = c->values[g->n_outputs + i];
        int64_t at = 0;
        double d = distance(a->dtype, theirs, a->data, a->numel, &at);
        if (d > c->scale)
            return rfi_error(RF_E_INTERNAL, "RF_CHECK: update %d (capture %d) element %lld is "
                             "%.9g, the interpreter's %.9g: %.3g tolerances apart", i,
                             g->updates[i].capture, (long long)at,
                             rfi_element_as_double(a->dtype, a->data, at),
                             rfi_element_as_double(a->dtype, theirs, at), d);
    }
    return RF_OK;
}
