/* exec.c: running an executable (argument checks, output and update
 * buffers, applying updates after a successful run) and the executable's
 * accessors.
 *
 * It does not compile (trace.c) or compute anything itself: the backend's run
 * function does. Updates are staged and applied here after a successful run,
 * so a failed run leaves every captured array untouched, unless the backend
 * writes them itself (rfi_backend.writes_updates: a compiled module, which
 * writes them after the last step that can fail). A run allocates only the
 * output arrays it returns, and a copy of any argument that is also a
 * captured array the run updates in place.
 */
#include "runtime.h"

#include <string.h>

/* Checks argument i against the compile-time type; the types are spelled out
 * only for a message (formatting them took ~2% of a batch-1 inference). */
static rf_status check_arg(const rf_exec *e, int i, const rf_array *a)
{
    const rfi_graph *g = e->prog;
    if (!a)
        return rfi_error(RF_E_INVALID, "rf_exec_run: argument %d is NULL", i);
    bool same = a->rank == g->arg_ranks[i];
    for (int d = 0; same && d < a->rank; d++)
        same = a->dims[d] == g->arg_dims[i][d];
    if (a->device == e->device && a->dtype == g->arg_dtypes[i] && same)
        return RF_OK;
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

/* RF_OK when every watched flag e was traced with (layers' modes, an optimiser's frozen
 * parameters) still holds, else RF_E_INVALID naming the layer or parameter. */
static rf_status check_modes(const rf_exec *e)
{
    const rfi_watch *w = rfi_watch_broken(&e->watches);
    if (!w)
        return RF_OK;
    if (w->kind == RFI_WATCH_FROZEN)
        return rfi_error(RF_E_INVALID, "rf_exec_run: %s was %s when this executable was "
                         "traced and is %s now; compile again (an executable keeps the "
                         "parameters it updates; rf_trainstep and rf_jitted compile again "
                         "themselves)", w->what, rfi_watch_state(w, w->seen),
                         rfi_watch_state(w, !w->seen));
    return rfi_error(RF_E_INVALID, "rf_exec_run: %s was in %s mode when this executable was "
                     "traced and is in %s mode now; compile again for this mode (an executable "
                     "keeps the mode it was traced in; rf_jitted keeps one per mode)", w->what,
                     w->seen ? "train" : "test", w->seen ? "test" : "train");
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

rf_exec *rfi_exec_new(void)
{
    rf_exec *e = rfi_calloc(1, sizeof *e);
    if (!e) {
        rfi_error(RF_E_NOMEM, "rf_compile: out of memory");
        return NULL;
    }
    pthread_mutex_init(&e->run_lock, NULL);
    return e;
}

/* ---- Buffers ------------------------------------------------------------------------
 * The pointer table and the update staging memory are made once per
 * executable (rfi_exec_init_buffers); a run only fills in the pointers. */

rf_status rfi_exec_init_buffers(rf_exec *e)
{
    const rfi_graph *g = e->prog;
    size_t n = (size_t)g->n_args + (size_t)g->n_captures + (size_t)g->n_outputs +
               (size_t)g->n_updates;
    e->ptrs = rfi_calloc(n ? n : 1, sizeof(void *));
    if (!e->ptrs)
        return rfi_error(RF_E_NOMEM, "rf_compile: out of memory");
    void **p = e->ptrs + g->n_args;
    for (int i = 0; i < g->n_captures; i++)
        p[i] = g->captures[i]->data;
    for (int i = 0; i < g->n_updates; i++) {
        const rf_array *c = g->captures[g->updates[i].capture];
        uintptr_t lo = (uintptr_t)c->data, hi = lo + c->nbytes;
        if (c->nbytes > 0 && (e->updated_lo == e->updated_hi || lo < e->updated_lo))
            e->updated_lo = lo;
        if (c->nbytes > 0 && hi > e->updated_hi)
            e->updated_hi = hi;
    }
    if (e->backend->writes_updates || g->n_updates == 0)
        return RF_OK;
    e->staged = rfi_calloc((size_t)g->n_updates, sizeof(void *));
    if (!e->staged)
        return rfi_error(RF_E_NOMEM, "rf_compile: out of memory");
    for (int i = 0; i < g->n_updates; i++) {
        size_t nbytes = g->captures[g->updates[i].capture]->nbytes;
        e->staged[i] = rfi_malloc(nbytes ? nbytes : 1);
        if (!e->staged[i])
            return rfi_error(RF_E_NOMEM, "rf_compile: out of memory staging update %d", i);
    }
    return RF_OK;
}

static void free_exec_buffers(rf_exec *e)
{
    for (int i = 0; e->staged && i < e->prog->n_updates; i++)
        rfi_free(e->staged[i]);
    rfi_free(e->staged);
    rfi_free(e->ptrs);
}

/* Whether a's bytes overlap a captured array the program updates (a range test first:
 * the per-array scan cost a small step's run 5%). */
static bool overlaps_updated_capture(const rf_exec *e, const rf_array *a)
{
    const rfi_graph *g = e->prog;
    uintptr_t lo = (uintptr_t)a->data, hi = lo + a->nbytes;
    if (a->nbytes == 0 || hi <= e->updated_lo || lo >= e->updated_hi)
        return false;
    for (int i = 0; i < g->n_updates; i++) {
        const rf_array *c = g->captures[g->updates[i].capture];
        uintptr_t clo = (uintptr_t)c->data, chi = clo + c->nbytes;
        if (lo < chi && clo < hi)
            return true;
    }
    return false;
}

/* Points the table's argument entries at the arguments' bytes. An argument that is also
 * a captured array the run updates is copied first (into *copies, made then) when the
 * backend writes updates while it runs (in place): the run must read the bytes as they
 * were before it, as the outputs and updates are defined. */
static rf_status point_at_arguments(rf_exec *e, rf_array *const *args, void ***copies)
{
    const rfi_graph *g = e->prog;
    *copies = NULL;
    for (int i = 0; i < g->n_args; i++) {
        e->ptrs[i] = args[i]->data;
        if (!e->backend->writes_updates || !overlaps_updated_capture(e, args[i]))
            continue;
        if (!*copies && !(*copies = rfi_calloc((size_t)g->n_args, sizeof **copies)))
            return rfi_error(RF_E_NOMEM, "rf_exec_run: out of memory");
        void *copy = rfi_malloc(args[i]->nbytes);
        if (!copy)
            return rfi_error(RF_E_NOMEM, "rf_exec_run: out of memory copying argument %d, "
                             "which is also a captured array the program updates", i);
        memcpy(copy, args[i]->data, args[i]->nbytes);
        e->ptrs[i] = (*copies)[i] = copy;
    }
    return RF_OK;
}

static void free_copies(void **copies, int n)
{
    for (int i = 0; copies && i < n; i++)
        rfi_free(copies[i]);
    rfi_free(copies);
}

/* Fills the pointer table for one run and runs the backend; on success
 * applies staged updates. Outputs go to out[i]. The caller holds run_lock. */
static rf_status run_locked(rf_exec *e, rf_array *const *args, void *const *out)
{
    const rfi_graph *g = e->prog;
    void **p = e->ptrs, **copies = NULL;
    rf_status st = point_at_arguments(e, args, &copies);
    if (st != RF_OK) {
        free_copies(copies, g->n_args);
        return st;
    }
    void **outputs = p + g->n_args + g->n_captures;
    for (int i = 0; i < g->n_outputs; i++)
        outputs[i] = out[i];
    void **updates = outputs + g->n_outputs;
    for (int i = 0; e->staged && i < g->n_updates; i++)
        updates[i] = e->staged[i];
    rfi_run_io io = {
        .args = p,
        .captures = p + g->n_args,
        .outputs = outputs,
        .updates = e->staged ? updates : NULL,
    };
    st = e->backend->run(e->state, g, &io);
    free_copies(copies, g->n_args);
    if (st != RF_OK || !e->staged)
        return st; /* on failure captures are untouched: updates were only staged */
    /* All outputs were computed from the old values; now apply the updates,
     * in declaration order. */
    for (int i = 0; i < g->n_updates; i++) {
        rf_array *target = g->captures[g->updates[i].capture];
        memcpy(target->data, e->staged[i], target->nbytes);
    }
    return RF_OK;
}

/* Runs e once; a run on another thread finishes first (the pointer table,
 * staging memory and the backend's arena serve one run at a time). */
static rf_status run_with(rf_exec *e, rf_array *const *args, void *const *out)
{
    pthread_mutex_lock(&e->run_lock);
    rf_status st = run_locked(e, args, out);
    pthread_mutex_unlock(&e->run_lock);
    return st;
}

rf_status rf_exec_run(rf_exec *e, rf_array *const *args, int nargs, rf_array **outs,
                      int nouts)
{
    for (int i = 0; outs && i < nouts; i++)
        outs[i] = NULL;
    if (!e)
        return rfi_error(RF_E_INVALID, "rf_exec_run: executable is NULL");
    rf_status st = check_run(e, args, nargs, outs, nouts);
    if (st == RF_OK)
        st = check_modes(e);
    if (st != RF_OK)
        return st;

    const rfi_graph *g = e->prog;
    enum { SMALL = 16 };
    rf_array *small[SMALL];
    void *small_data[SMALL];
    rf_array **arrays = small;
    void **data = small_data;
    if (g->n_outputs > SMALL) {
        arrays = rfi_calloc((size_t)g->n_outputs, sizeof *arrays);
        data = rfi_calloc((size_t)g->n_outputs, sizeof *data);
        if (!arrays || !data) {
            rfi_free(arrays == small ? NULL : arrays);
            rfi_free(data == small_data ? NULL : data);
            return rfi_error(RF_E_NOMEM, "rf_exec_run: out of memory");
        }
    }
    int made = 0;
    for (; made < g->n_outputs; made++) {
        const rfi_node *x = g->outputs[made];
        arrays[made] =
            rfi_array_alloc_recycled("rf_exec_run", e->device, x->dtype, x->dims, x->rank);
        if (!arrays[made]) {
            st = RF_E_NOMEM; /* message set by rfi_array_alloc */
            break;
        }
        data[made] = arrays[made]->data;
    }
    if (st == RF_OK)
        st = run_with(e, args, data);
    for (int i = 0; i < made; i++) {
        if (st == RF_OK && i < nouts)
            outs[i] = arrays[i]; /* handed to the caller */
        else
            rfi_array_release(arrays[i]);
    }
    if (arrays != small) {
        rfi_free(arrays);
        rfi_free(data);
    }
    return st;
}

rf_status rfi_exec_run_into(rf_exec *e, rf_array *const *args, int nargs, void *const *out)
{
    if (!e)
        return rfi_error(RF_E_INVALID, "rf_exec_run: executable is NULL");
    rf_status st = check_run(e, args, nargs, NULL, 0);
    if (st != RF_OK)
        return st;
    return run_with(e, args, out);
}

size_t rf_exec_memory(const rf_exec *e)
{
    if (!e || !e->backend->memory)
        return 0;
    return e->backend->memory(e->state);
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

/* Made on first use (under the run lock) and cached in the executable. */
const char *rf_exec_program_text(const rf_exec *e)
{
    if (!e)
        return NULL;
    rf_exec *m = (rf_exec *)e;
    pthread_mutex_lock(&m->run_lock);
    if (!m->text)
        m->text = rfi_print(m->prog);
    const char *text = m->text;
    pthread_mutex_unlock(&m->run_lock);
    if (!text)
        rfi_error(RF_E_NOMEM, "rf_exec_program_text: out of memory");
    return text;
}

const char *rf_exec_backend_name(const rf_exec *e) { return e ? e->backend->name : NULL; }
rf_device *rf_exec_device(const rf_exec *e) { return e ? e->device : NULL; }

void rf_exec_free(rf_exec *e)
{
    if (!e)
        return;
    if (e->backend && e->backend->release)
        e->backend->release(e->state);
    free_exec_buffers(e);
    rfi_graph_free(e->prog); /* releases the capture references */
    rfi_watch_list_free(&e->watches);
    rfi_free(e->text);
    pthread_mutex_destroy(&e->run_lock);
    rfi_free(e);
}
