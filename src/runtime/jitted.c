/* jitted.c: rf_jitted, a traced function with a cache of executables keyed on its
 * arguments' types (JAX's jax.jit): the first call with arguments of a new count,
 * dtype, shape or device compiles (rf_compile), later calls with the same types run
 * what was compiled. An executable whose trace read a model's train/test mode
 * (its watches) is found only while that mode holds, so each mode gets its own.
 *
 * The cache is the jitted function's own (no process-wide state): a list scanned
 * linearly, since a healthy program has a handful of argument types (one per batch
 * shape); past 8 every new entry prints a warning, as the training-step cache does.
 * A mutex makes lookups and compiles from several threads safe; the runs themselves
 * take turns per executable (exec.c). It does not trace or compile anything itself.
 */
#include "runtime.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#define WARN_ENTRIES 8

typedef struct arg_type {
    rf_device *device;
    rf_dtype dtype;
    int rank;
    int64_t dims[RF_MAX_RANK];
} arg_type;

typedef struct jit_entry {
    int nargs;
    arg_type *types; /* nargs entries (rfi_calloc'd) */
    rf_exec *exec;   /* owned */
} jit_entry;

struct rf_jitted {
    rf_trace_fn fn;
    void *ctx;
    pthread_mutex_t lock;
    jit_entry *entries;
    int n, cap;
};

rf_jitted *rf_jitted_new(rf_trace_fn fn, void *ctx)
{
    if (!fn) {
        rfi_error(RF_E_INVALID, "rf_jitted_new: fn is NULL");
        return NULL;
    }
    rf_jitted *f = rfi_calloc(1, sizeof *f);
    if (!f) {
        rfi_error(RF_E_NOMEM, "rf_jitted_new: out of memory");
        return NULL;
    }
    f->fn = fn;
    f->ctx = ctx;
    /* error-checking: fn calling rf_jitted_run of f while it is traced would
     * otherwise wait for itself forever */
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ERRORCHECK);
    int rc = pthread_mutex_init(&f->lock, &attr);
    pthread_mutexattr_destroy(&attr);
    if (rc != 0) {
        rfi_free(f);
        rfi_error(RF_E_NOMEM, "rf_jitted_new: cannot make a lock");
        return NULL;
    }
    return f;
}

static bool same_type(const arg_type *t, const rf_array *a)
{
    return t->device == a->device && t->dtype == a->dtype && t->rank == a->rank &&
           memcmp(t->dims, a->dims, (size_t)a->rank * sizeof a->dims[0]) == 0;
}

static jit_entry *find(rf_jitted *f, rf_array *const *args, int nargs)
{
    for (int i = 0; i < f->n; i++) {
        jit_entry *e = &f->entries[i];
        bool same = e->nargs == nargs;
        for (int k = 0; same && k < nargs; k++)
            same = same_type(&e->types[k], args[k]);
        if (same && rfi_watch_broken(&e->exec->watches) == NULL)
            return e; /* traced for these types, and the models' modes it read still hold */
    }
    return NULL;
}

/* Warns that f holds many executables, naming the new one's argument types. */
static void warn_many(const rf_jitted *f, rf_array *const *args, int nargs)
{
    rfi_strbuf sb = {0};
    for (int k = 0; k < nargs; k++) {
        rfi_sb_printf(&sb, "%s", k ? " " : "");
        rfi_sb_type(&sb, args[k]->dtype, args[k]->dims, args[k]->rank);
    }
    fprintf(stderr, "reflux: warning: rf_jitted_run: %d executables compiled for one function, "
            "the new one for arguments %s; arguments whose shapes keep changing compile every "
            "time\n", f->n, sb.data && !sb.failed ? sb.data : "(none)");
    rfi_sb_free(&sb);
}

/* Compiles fn for args' types and adds the executable to f's cache. */
static rf_status compile_entry(rf_jitted *f, rf_array *const *args, int nargs, jit_entry **out)
{
    if (f->n == f->cap && !rfi_grow((void **)&f->entries, f->n, &f->cap, sizeof *f->entries))
        return rfi_error(RF_E_NOMEM, "rf_jitted_run: out of memory");
    arg_type *types = rfi_calloc((size_t)(nargs > 0 ? nargs : 1), sizeof *types);
    if (!types)
        return rfi_error(RF_E_NOMEM, "rf_jitted_run: out of memory");
    rf_exec *exec = NULL;
    rf_status st = rf_compile(f->fn, f->ctx, args, nargs, &exec);
    if (st != RF_OK) {
        rfi_free(types);
        return st;
    }
    for (int k = 0; k < nargs; k++) {
        types[k].device = args[k]->device;
        types[k].dtype = args[k]->dtype;
        types[k].rank = args[k]->rank;
        memcpy(types[k].dims, args[k]->dims, (size_t)args[k]->rank * sizeof args[k]->dims[0]);
    }
    jit_entry *e = &f->entries[f->n++];
    *e = (jit_entry){nargs, types, exec};
    if (f->n > WARN_ENTRIES)
        warn_many(f, args, nargs);
    *out = e;
    return RF_OK;
}

rf_status rf_jitted_run(rf_jitted *f, rf_array *const *args, int nargs, rf_array **outs,
                        int nouts)
{
    for (int i = 0; outs && i < nouts; i++)
        outs[i] = NULL;
    if (!f)
        return rfi_error(RF_E_INVALID, "rf_jitted_run: the jitted function is NULL");
    if (nargs < 0 || (nargs > 0 && !args))
        return rfi_error(RF_E_INVALID, "rf_jitted_run: invalid argument list (nargs = %d)",
                         nargs);
    for (int k = 0; k < nargs; k++)
        if (!args[k])
            return rfi_error(RF_E_INVALID, "rf_jitted_run: argument %d is NULL", k);
    if (pthread_mutex_lock(&f->lock) != 0) /* EDEADLK: this thread holds it */
        return rfi_error(RF_E_INVALID, "rf_jitted_run: called while its own function is traced "
                         "(from inside fn: run it after the call that compiles returns)");
    jit_entry *e = find(f, args, nargs);
    rf_status st = e ? RF_OK : compile_entry(f, args, nargs, &e);
    rf_exec *exec = st == RF_OK ? e->exec : NULL;
    pthread_mutex_unlock(&f->lock);
    if (st != RF_OK)
        return st;
    return rf_exec_run(exec, args, nargs, outs, nouts);
}

int rf_jitted_n_compiled(rf_jitted *f)
{
    if (!f)
        return 0;
    bool locked = pthread_mutex_lock(&f->lock) == 0; /* else this thread holds it */
    int n = f->n;
    if (locked)
        pthread_mutex_unlock(&f->lock);
    return n;
}

void rf_jitted_free(rf_jitted *f)
{
    if (!f)
        return;
    for (int i = 0; i < f->n; i++) {
        rf_exec_free(f->entries[i].exec);
        rfi_free(f->entries[i].types);
    }
    rfi_free(f->entries);
    pthread_mutex_destroy(&f->lock);
    rfi_free(f);
}
