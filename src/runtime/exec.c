/* exec.c: running an executable (argument checks, output and update
 * buffers, applying updates after a successful run) and the executable's
 * accessors.
 *
 * It does not compile (trace.c) or compute anything itself: the backend's run
 * function does. Updates are applied here, never by the backend, so that a
 * failed run leaves every captured array untouched.
 */
#include "runtime.h"

#include <string.h>

/* Checks argument i against the compile-time type. */
static rf_status check_arg(const rf_exec *e, int i, const rf_array *a)
{
    const rfi_graph *g = e->prog;
    if (!a)
        return rfi_error(RF_E_INVALID, "rf_exec_run: argument %d is NULL", i);
    char want[128], got[128];
    rfi_type_str(want, sizeof want, g->arg_dtypes[i], g->arg_dims[i], g->arg_ranks[i]);
    rfi_type_str(got, sizeof got, a->dtype, a->dims, a->rank);
    if (a->device->kind == RF_DEVICE_HOST)
        return rfi_error(RF_E_DEVICE, "rf_exec_run: argument %d (%s) lives on the host; move "
                         "it to %s with rf_array_to", i, got, rf_device_name(e->device));
    if (a->device != e->device)
        return rfi_error(RF_E_DEVICE, "rf_exec_run: argument %d (%s) lives on %s but the "
                         "executable runs on %s", i, got, rf_device_name(a->device),
                         rf_device_name(e->device));
    if (a->dtype != g->arg_dtypes[i])
        return rfi_error(RF_E_DTYPE, "rf_exec_run: argument %d: expected %s, got %s", i, want,
                         got);
    bool same = a->rank == g->arg_ranks[i];
    for (int d = 0; same && d < a->rank; d++)
        same = a->dims[d] == g->arg_dims[i][d];
    if (!same) {
        if (g->arg_ranks[i] > 0)
            return rfi_error(RF_E_SHAPE, "rf_exec_run: argument %d: expected %s, got %s "
                             "(compiled for batch %lld; compile again for other shapes)",
                             i, want, got, (long long)g->arg_dims[i][0]);
        return rfi_error(RF_E_SHAPE, "rf_exec_run: argument %d: expected %s, got %s "
                         "(compile again for other shapes)", i, want, got);
    }
    return RF_OK;
}

static rf_status check_run(const rf_exec *e, rf_array *const *args, int nargs,
                           rf_array **outs, int nouts)
{
    const rfi_graph *g = e->prog;
    if (nouts < 0)
        return rfi_error(RF_E_INVALID, "rf_exec_run: nouts is negative (%d)", nouts);
    if (nouts > 0 && !outs)
        return rfi_error(RF_E_INVALID, "rf_exec_run: outs is NULL but nouts is %d", nouts);
    if (nouts > g->n_outputs)
        return rfi_error(RF_E_INVALID, "rf_exec_run: asked for %d outputs but the program "
                         "has %d", nouts, g->n_outputs);
    if (nargs != g->n_args)
        return rfi_error(RF_E_INVALID, "rf_exec_run: expected %d argument%s, got %d",
                         g->n_args, g->n_args == 1 ? "" : "s", nargs);
    if (nargs > 0 && !args)
        return rfi_error(RF_E_INVALID, "rf_exec_run: args is NULL but nargs is %d", nargs);
    for (int i = 0; i < nargs; i++) {
        rf_status st = check_arg(e, i, args[i]);
        if (st != RF_OK)
            return st;
    }
    return RF_OK;
}

/* The buffers of one run: output arrays and update staging memory. */
typedef struct run_buffers {
    void **ptrs;          /* args, captures, outputs, updates (one allocation) */
    rf_array **outputs;   /* n_outputs */
    void **staged;        /* n_updates */
} run_buffers;

static void free_buffers(const rfi_graph *g, run_buffers *b)
{
    for (int i = 0; b->outputs && i < g->n_outputs; i++)
        rfi_array_release(b->outputs[i]);
    for (int i = 0; b->staged && i < g->n_updates; i++)
        rfi_free(b->staged[i]);
    rfi_free(b->outputs);
    rfi_free(b->staged);
    rfi_free(b->ptrs);
    memset(b, 0, sizeof *b);
}

static rf_status make_buffers(const rf_exec *e, rf_array *const *args, run_buffers *b,
                              rfi_run_io *io)
{
    const rfi_graph *g = e->prog;
    size_t n = (size_t)g->n_args + (size_t)g->n_captures + (size_t)g->n_outputs +
               (size_t)g->n_updates;
    b->ptrs = rfi_calloc(n ? n : 1, sizeof(void *));
    b->outputs = rfi_calloc(g->n_outputs ? (size_t)g->n_outputs : 1, sizeof(rf_array *));
    b->staged = rfi_calloc(g->n_updates ? (size_t)g->n_updates : 1, sizeof(void *));
    if (!b->ptrs || !b->outputs || !b->staged)
        return rfi_error(RF_E_NOMEM, "rf_exec_run: out of memory");
    void **p = b->ptrs;
    for (int i = 0; i < g->n_args; i++)
        p[i] = args[i]->data;
    p += g->n_args;
    for (int i = 0; i < g->n_captures; i++)
        p[i] = g->captures[i]->data;
    p += g->n_captures;
    for (int i = 0; i < g->n_outputs; i++) {
        const rfi_node *x = g->outputs[i];
        b->outputs[i] = rfi_array_alloc(e->device, x->dtype, x->dims, x->rank);
        if (!b->outputs[i])
            return RF_E_NOMEM; /* message set by rfi_array_alloc */
        p[i] = b->outputs[i]->data;
    }
    p += g->n_outputs;
    for (int i = 0; i < g->n_updates; i++) {
        size_t nbytes = g->captures[g->updates[i].capture]->nbytes;
        b->staged[i] = rfi_malloc(nbytes ? nbytes : 1);
        if (!b->staged[i])
            return rfi_error(RF_E_NOMEM, "rf_exec_run: out of memory staging update %d", i);
        p[i] = b->staged[i];
    }
    io->args = b->ptrs;
    io->captures = b->ptrs + g->n_args;
    io->outputs = b->ptrs + g->n_args + g->n_captures;
    io->updates = b->ptrs + g->n_args + g->n_captures + g->n_outputs;
    return RF_OK;
}

rf_status rf_exec_run(rf_exec *e, rf_array *const *args, int nargs, rf_array **outs,
                      int nouts)
{
    for (int i = 0; outs && i < nouts; i++)
        outs[i] = NULL;
    if (!e)
        return rfi_error(RF_E_INVALID, "rf_exec_run: executable is NULL");
    rf_status st = check_run(e, args, nargs, outs, nouts);
    if (st != RF_OK)
        return st;

    const rfi_graph *g = e->prog;
    run_buffers b = {0};
    rfi_run_io io;
    st = make_buffers(e, args, &b, &io);
    if (st == RF_OK)
        st = e->backend->run(e->state, g, &io);
    if (st != RF_OK) {
        free_buffers(g, &b); /* captures untouched: updates were only staged */
        return st;
    }
    /* All outputs were computed from the old values; now apply the updates,
     * in declaration order. */
    for (int i = 0; i < g->n_updates; i++) {
        rf_array *target = g->captures[g->updates[i].capture];
        memcpy(target->data, b.staged[i], target->nbytes);
    }
    for (int i = 0; i < nouts; i++) {
        outs[i] = b.outputs[i];
        b.outputs[i] = NULL; /* handed to the caller */
    }
    free_buffers(g, &b); /* releases the outputs the caller did not ask for */
    return RF_OK;
}

/* ---- Accessors --------------------------------------------------------------------- */

int rf_exec_n_args(const rf_exec *e) { return e ? e->prog->n_args : 0; }
int rf_exec_n_outputs(const rf_exec *e) { return e ? e->prog->n_outputs : 0; }
int rf_exec_n_updates(const rf_exec *e) { return e ? e->prog->n_updates : 0; }

/* Output i's node, or NULL with RF_E_INVALID. */
static const rfi_node *output_node(const rf_exec *e, int i, const char *op)
{
    if (!e) {
        rfi_error(RF_E_INVALID, "%s: executable is NULL", op);
        return NULL;
    }
    if (i < 0 || i >= e->prog->n_outputs) {
        rfi_error(RF_E_INVALID, "%s: output %d is out of range (the program has %d)", op, i,
                  e->prog->n_outputs);
        return NULL;
    }
    return e->prog->outputs[i];
}

rf_dtype rf_exec_output_dtype(const rf_exec *e, int i)
{
    const rfi_node *x = output_node(e, i, "rf_exec_output_dtype");
    return x ? x->dtype : RF_DTYPE_COUNT;
}

int rf_exec_output_rank(const rf_exec *e, int i)
{
    const rfi_node *x = output_node(e, i, "rf_exec_output_rank");
    return x ? x->rank : -1;
}

const int64_t *rf_exec_output_dims(const rf_exec *e, int i)
{
    const rfi_node *x = output_node(e, i, "rf_exec_output_dims");
    return x ? x->dims : NULL;
}

uint64_t rf_exec_hash(const rf_exec *e) { return e ? e->hash : 0; }

/* Made on first use and cached in the executable: the first call must not
 * race with another rf_exec_program_text call on the same executable. */
const char *rf_exec_program_text(const rf_exec *e)
{
    if (!e)
        return NULL;
    if (!e->text)
        ((rf_exec *)e)->text = rfi_print(e->prog);
    if (!e->text)
        rfi_error(RF_E_NOMEM, "rf_exec_program_text: out of memory");
    return e->text;
}

const char *rf_exec_backend_name(const rf_exec *e) { return e ? e->backend->name : NULL; }
rf_device *rf_exec_device(const rf_exec *e) { return e ? e->device : NULL; }

void rf_exec_free(rf_exec *e)
{
    if (!e)
        return;
    if (e->backend && e->backend->release)
        e->backend->release(e->state);
    rfi_graph_free(e->prog); /* releases the capture references */
    rfi_free(e->text);
    rfi_free(e);
}
