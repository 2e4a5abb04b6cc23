/* trace.c: the tracing entry points (arguments, captures, updates, outputs,
 * trace errors, tensor accessors) and the compile pipeline:
 *   validate arguments -> trace fn once -> canonical order -> autodiff -> verify ->
 *   dead-code elimination -> verify -> the backend's optimise stage -> backend
 *   prepare -> rf_exec, the stages from autodiff to optimise taken from the lowering
 *   memo on disk when it has them (lower_memo.h).
 *
 * It does not define ops (ir/api_*.c), graph storage (graph.c), the passes or the
 * backends; running an executable is exec.c.
 */
#include "lower_memo.h"
#include "runtime.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- Inside a traced function ------------------------------------------------------- */

rf_tensor *rf_arg(rf_trace *t, int i)
{
    if (!t)
        return NULL;
    if (i < 0 || i >= t->n_args) {
        rfi_graph_fail(t, RF_E_INVALID, "rf_arg: argument %d is out of range (the call has %d)",
                       i, t->n_args);
        return NULL;
    }
    if (!t->args[i]) {
        rfi_attrs attr = {0};
        attr.i[0] = i;
        t->args[i] = rfi_node_new(t, RFI_OP_ARGUMENT, NULL, 0, &attr, t->arg_dtypes[i],
                                  t->arg_dims[i], t->arg_ranks[i]);
    }
    return t->args[i];
}

int rf_n_args(const rf_trace *t) { return t ? t->n_args : 0; }

/* Checks that `a` may be captured by t (non-NULL, on t's device); records the
 * trace error and returns false otherwise. `op` names the caller. */
static bool capturable(rf_trace *t, const char *op, const rf_array *a)
{
    if (!a) {
        rfi_graph_fail(t, RF_E_INVALID, "%s: array is NULL", op);
        return false;
    }
    char ty[128];
    rfi_type_str(ty, sizeof ty, a->dtype, a->dims, a->rank);
    if (a->device->kind == RF_DEVICE_HOST) {
        rfi_graph_fail(t, RF_E_DEVICE,
                       "%s: array %s lives on the host; move it to %s with rf_array_to", op, ty,
                       rf_device_name(t->device));
        return false;
    }
    if (a->device != t->device) {
        rfi_graph_fail(t, RF_E_DEVICE, "%s: array %s lives on %s but the program runs on %s",
                       op, ty, rf_device_name(a->device), rf_device_name(t->device));
        return false;
    }
    return true;
}

static rf_tensor *capture_node(rf_trace *t, rf_array *a)
{
    int idx = rfi_graph_capture_index(t, a);
    if (idx < 0) {
        rfi_graph_fail(t, RF_E_NOMEM, "rf_capture: out of memory");
        return NULL;
    }
    if (!t->capture_nodes[idx]) {
        rfi_attrs attr = {0};
        attr.i[0] = idx;
        t->capture_nodes[idx] =
            rfi_node_new(t, RFI_OP_CAPTURE, NULL, 0, &attr, a->dtype, a->dims, a->rank);
    }
    return t->capture_nodes[idx];
}

rf_tensor *rf_capture(rf_trace *t, rf_array *a)
{
    if (!t || !capturable(t, "rf_capture", a))
        return NULL;
    return capture_node(t, a);
}

/* Checks a tensor handed to rf_assign/rf_return: NULL is silent when the trace
 * already failed (the NULL came from that failure), an error otherwise. */
static bool usable_value(rf_trace *t, const char *op, const rf_tensor *x)
{
    if (!x) {
        /* a call that could not name the trace (rf_concatenate of no
         * tensors) left only its message: quote it, as rf_chain does */
        char last[RFI_ERRMSG_MAX / 2];
        snprintf(last, sizeof last, "%s", rf_errmsg());
        if (last[0])
            rfi_graph_fail(t, RF_E_INVALID, "%s: tensor is NULL (the last error before this "
                           "call: %s)", op, last);
        else
            rfi_graph_fail(t, RF_E_INVALID, "%s: tensor is NULL", op);
        return false;
    }
    if (x->g != t) {
        rfi_graph_fail(t, RF_E_INVALID, "%s: the tensor belongs to another trace", op);
        return false;
    }
    return true;
}

static bool same_type(const rf_array *a, const rf_tensor *x)
{
    if (a->dtype != x->dtype || a->rank != x->rank)
        return false;
    for (int i = 0; i < a->rank; i++)
        if (a->dims[i] != x->dims[i])
            return false;
    return true;
}

void rf_assign(rf_trace *t, rf_array *a, rf_tensor *value)
{
    if (!t || !usable_value(t, "rf_assign", value) || !capturable(t, "rf_assign", a))
        return;
    if (!same_type(a, value)) {
        char ta[128], tv[128];
        rfi_graph_fail(t, a->dtype != value->dtype ? RF_E_DTYPE : RF_E_SHAPE,
                       "rf_assign: value %s does not match array %s",
                       rfi_type_str(tv, sizeof tv, value->dtype, value->dims, value->rank),
                       rfi_type_str(ta, sizeof ta, a->dtype, a->dims, a->rank));
        return;
    }
    rf_tensor *cap = capture_node(t, a);
    if (!cap)
        return;
    int idx = (int)cap->attr.i[0];
    for (int k = 0; k < t->n_updates; k++) {
        if (t->updates[k].capture == idx) { /* the last assignment wins */
            t->updates[k].value = value;
            return;
        }
    }
    if (rfi_graph_add_update(t, idx, value) != RF_OK)
        rfi_graph_fail(t, RF_E_NOMEM, "rf_assign: out of memory");
}

void rf_return(rf_trace *t, rf_tensor *x)
{
    if (!t || !usable_value(t, "rf_return", x))
        return;
    if (rfi_graph_add_output(t, x) != RF_OK)
        rfi_graph_fail(t, RF_E_NOMEM, "rf_return: out of memory");
}

void rf_trace_fail(rf_trace *t, rf_status st, const char *fmt, ...)
{
    if (!t)
        return;
    if (st == RF_OK || (unsigned)st >= RF_STATUS_COUNT)
        st = RF_E_INVALID; /* a failure must not read as success */
    char msg[RFI_ERRMSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt ? fmt : "(no message)", ap);
    va_end(ap);
    rfi_graph_fail(t, st, "%s", msg);
}

rf_status rf_trace_status(const rf_trace *t) { return t ? t->status : RF_E_INVALID; }

const char *rf_precision_name(rf_precision p)
{
    switch (p) {
    case RF_PRECISION_F32: return "f32";
    case RF_PRECISION_BF16: return "bf16";
    }
    return NULL;
}

rf_status rfi_check_precision(const char *what, rf_precision p)
{
    if (rf_precision_name(p))
        return RF_OK;
    return rfi_error(RF_E_INVALID, "%s %d is none of RF_PRECISION_F32 (0) and "
                     "RF_PRECISION_BF16 (1)", what, (int)p);
}

rf_precision rf_trace_set_matmul_precision(rf_trace *t, rf_precision p)
{
    if (!t)
        return RF_PRECISION_F32;
    rf_precision before = t->matmul_precision;
    if (rfi_check_precision("rf_trace_set_matmul_precision: precision", p) != RF_OK)
        rfi_graph_fail(t, RF_E_INVALID, "%s", rf_errmsg());
    else
        t->matmul_precision = p;
    return before;
}

/* ---- Tensor accessors ------------------------------------------------------------------ */

rf_trace *rf_tensor_trace(const rf_tensor *x) { return x ? x->g : NULL; }
rf_dtype rf_tensor_dtype(const rf_tensor *x) { return x ? x->dtype : RF_DTYPE_COUNT; }
int rf_tensor_rank(const rf_tensor *x) { return x ? x->rank : -1; }
const int64_t *rf_tensor_dims(const rf_tensor *x) { return x ? x->dims : NULL; }
int64_t rf_tensor_numel(const rf_tensor *x) { return x ? rfi_numel(x->dims, x->rank) : 0; }

int64_t rf_tensor_dim(const rf_tensor *x, int axis)
{
    if (!x)
        return -1;
    int a = axis < 0 ? axis + x->rank : axis;
    if (a < 0 || a >= x->rank) {
        char ty[128];
        rfi_graph_fail(x->g, RF_E_INVALID, "rf_tensor_dim: axis %d is out of range for %s",
                       axis, rfi_type_str(ty, sizeof ty, x->dtype, x->dims, x->rank));
        return -1;
    }
    return x->dims[a];
}

/* ---- Tracing ---------------------------------------------------------------------------- */

/* Checks the argument list of rf_compile/rf_trace_text: count, NULLs, all on
 * one compute device. */
static rf_status check_args(const char *op, rf_array *const *args, int nargs)
{
    if (nargs < 0)
        return rfi_error(RF_E_INVALID, "%s: nargs is negative (%d)", op, nargs);
    if (nargs > 0 && !args)
        return rfi_error(RF_E_INVALID, "%s: args is NULL but nargs is %d", op, nargs);
    for (int i = 0; i < nargs; i++) {
        if (!args[i])
            return rfi_error(RF_E_INVALID, "%s: argument %d is NULL", op, i);
        char ty[128];
        rfi_type_str(ty, sizeof ty, args[i]->dtype, args[i]->dims, args[i]->rank);
        if (!rfi_device_is_compute(args[i]->device))
            return rfi_error(RF_E_DEVICE,
                             "%s: argument %d (%s) lives on the %s; move it to a compute "
                             "device (e.g. cpu) with rf_array_to",
                             op, i, ty, rf_device_name(args[i]->device));
        if (args[i]->device != args[0]->device)
            return rfi_error(RF_E_DEVICE, "%s: argument %d (%s) lives on %s but argument 0 "
                             "lives on %s; all arguments must share one device",
                             op, i, ty, rf_device_name(args[i]->device),
                             rf_device_name(args[0]->device));
    }
    return RF_OK;
}

/* The device to compile for: the options' device, else the arguments', else
 * the default. The arguments must live on it. */
static rf_status pick_device(const char *op, rf_array *const *args, int nargs,
                             const rf_compile_opts *opts, rf_device **dev)
{
    if (opts && opts->device) {
        if (!rfi_device_is_compute(opts->device))
            return rfi_error(RF_E_DEVICE, "%s: cannot compile for %s (not a compute device)",
                             op, rf_device_name(opts->device));
        if (nargs > 0 && args[0]->device != opts->device)
            return rfi_error(RF_E_DEVICE, "%s: the arguments live on %s but the options ask "
                             "for %s", op, rf_device_name(args[0]->device),
                             rf_device_name(opts->device));
        *dev = opts->device;
    } else {
        *dev = nargs > 0 ? args[0]->device : rf_device_default();
    }
    return RF_OK;
}

/* Makes a graph with the arguments' types and calls fn on it once. On
 * failure (including a trace error) *out is NULL and the message is set. */
static rf_status trace_fn(const char *op, rf_trace_fn fn, void *ctx, rf_array *const *args,
                          int nargs, const rf_compile_opts *opts, rfi_graph **out)
{
    *out = NULL;
    if (!fn)
        return rfi_error(RF_E_INVALID, "%s: fn is NULL", op);
    rf_status st = check_args(op, args, nargs);
    rf_device *dev = NULL;
    if (st == RF_OK)
        st = pick_device(op, args, nargs, opts, &dev);
    if (st != RF_OK)
        return st;
    rf_precision precision = opts ? opts->matmul_precision : RF_PRECISION_F32;
    char what[64];
    snprintf(what, sizeof what, "%s: matmul_precision", op);
    if (rfi_check_precision(what, precision) != RF_OK)
        return RF_E_INVALID;
    const char *name = opts && opts->name ? opts->name : "program";
    rfi_graph *g = rfi_graph_new(dev, name);
    if (!g)
        return rfi_error(RF_E_NOMEM, "%s: out of memory creating the trace", op);
    g->matmul_precision = precision;

    rf_dtype dtypes[1];
    rf_dtype *dt = nargs > 0 ? rfi_malloc((size_t)nargs * sizeof *dt) : dtypes;
    int ranks[1];
    int *rk = nargs > 0 ? rfi_malloc((size_t)nargs * sizeof *rk) : ranks;
    int64_t (*dims)[RF_MAX_RANK] = rfi_malloc((size_t)(nargs > 0 ? nargs : 1) * sizeof *dims);
    if (!dt || !rk || !dims) {
        st = rfi_error(RF_E_NOMEM, "%s: out of memory", op);
    } else {
        for (int i = 0; i < nargs; i++) {
            dt[i] = args[i]->dtype;
            rk[i] = args[i]->rank;
            memcpy(dims[i], args[i]->dims, sizeof dims[i]);
        }
        st = rfi_graph_set_args(g, nargs, dt, rk, (const int64_t(*)[RF_MAX_RANK])dims);
    }
    if (dt != dtypes)
        rfi_free(dt);
    if (rk != ranks)
        rfi_free(rk);
    rfi_free(dims);
    if (st != RF_OK) {
        rfi_graph_free(g);
        return st;
    }

    rf_clear_error(); /* what rf_return quotes of a NULL tensor is then this trace's */
    fn(g, ctx);

    if (g->status != RF_OK) {
        /* The first failing op wrote the message into the graph; make it this
         * call's message (ops after it may have overwritten the thread's). */
        st = g->status;
        rfi_error(st, "%s", g->errmsg ? g->errmsg : "the trace failed");
        rfi_graph_free(g);
        return st;
    }
    /* C's argument evaluation order must not shape the program (canonical_order.c). */
    rfi_graph *canonical = NULL;
    st = rfi_canonical_order(g, &canonical);
    if (st == RF_OK) { /* what the program depends on goes with it */
        canonical->watches = g->watches;
        g->watches = (rfi_watch_list){0};
    }
    rfi_graph_free(g);
    if (st != RF_OK)
        return st;
    *out = canonical;
    return RF_OK;
}

rf_status rf_trace_text(rf_trace_fn fn, void *ctx, rf_array *const *args, int nargs,
                        char **text, uint64_t *hash)
{
    if (text)
        *text = NULL;
    if (hash)
        *hash = 0;
    if (!text)
        return rfi_error(RF_E_INVALID, "rf_trace_text: text is NULL");
    rfi_graph *g;
    rf_status st = trace_fn("rf_trace_text", fn, ctx, args, nargs, NULL, &g);
    if (st != RF_OK)
        return st;
    char *s = rfi_print(g);
    if (s) {
        /* Owned by the caller and freed with free(), not the library's hook. */
        size_t n = strlen(s) + 1;
        *text = malloc(n);
        if (*text)
            memcpy(*text, s, n);
        rfi_free(s);
    }
    if (!*text) {
        rfi_graph_free(g);
        return rfi_error(RF_E_NOMEM, "rf_trace_text: out of memory printing the program");
    }
    if (hash)
        *hash = rfi_hash(g);
    rfi_graph_free(g);
    return RF_OK;
}

/* ---- Compiling ------------------------------------------------------------------------ */

/* Writes the program text of one pipeline stage when RF_DUMP asks for it. */
static void dump_stage(const rfi_graph *g, const char *name, uint64_t hash, const char *stage)
{
    if (!rfi_dump_wanted())
        return;
    char *text = rfi_print(g);
    if (!text) {
        fprintf(stderr, "reflux: warning: RF_DUMP: out of memory printing %s.%s\n", name,
                stage);
        return;
    }
    rfi_dump(name, hash, stage, text);
    rfi_free(text);
}

/* The backend RF_BACKEND selects for programs on dev, or NULL when none
 * can run them (pick_backend says why): unset, the compiling backend of the
 * device (cpu); RF_BACKEND=interp, the reference interpreter. */
static const rfi_backend *backend_for(const rf_device *dev)
{
    const char *env = getenv("RF_BACKEND");
    if (env && strcmp(env, rfi_interp_backend.name) == 0)
        return &rfi_interp_backend;
    if ((!env || !*env || strcmp(env, rfi_cpu_backend.name) == 0) &&
        (!dev || dev->kind == RF_DEVICE_CPU))
        return &rfi_cpu_backend;
    return NULL;
}

static rf_status pick_backend(const char *op, const rf_device *dev, const rfi_backend **out)
{
    const char *env = getenv("RF_BACKEND");
    *out = backend_for(dev);
    if (*out)
        return RF_OK;
    if (!env || !*env || strcmp(env, rfi_cpu_backend.name) == 0)
        return rfi_error(RF_E_UNSUPPORTED, "%s: no compiling backend for device %s", op,
                         rf_device_name(dev));
    return rfi_error(RF_E_UNSUPPORTED, "%s: RF_BACKEND=%s is not available (available: %s, %s)",
                     op, env, rfi_cpu_backend.name, rfi_interp_backend.name);
}

/* Runs one graph -> graph pass, consuming *g (replaced by the result or freed). */
static rf_status run_pass(rf_status (*pass)(const rfi_graph *, rfi_graph **), rfi_graph **g)
{
    rfi_graph *next = NULL;
    rf_status st = pass(*g, &next);
    rfi_graph_free(*g);
    *g = next;
    if (st != RF_OK) {
        rfi_graph_free(next);
        *g = NULL;
        return st;
    }
    if (!next)
        return rfi_error(RF_E_INTERNAL, "rf_compile: a pass returned no program");
    return rfi_verify(next);
}

/* Turns a traced graph (consumed) into the final program: autodiff, DCE,
 * verified after each. */
static rf_status lower(rfi_graph *g, rfi_graph **out)
{
    *out = NULL;
    char name[256];
    snprintf(name, sizeof name, "%s", g->name ? g->name : "program");
    /* One prefix for the three dumps of this compile (hashed only when dumping). */
    uint64_t hash = rfi_dump_wanted() ? rfi_hash(g) : 0;
    dump_stage(g, name, hash, "traced");
    rf_status st = run_pass(rfi_autodiff, &g);
    if (st == RF_OK) {
        dump_stage(g, name, hash, "ad");
        st = run_pass(rfi_dce, &g);
    }
    if (st == RF_OK)
        dump_stage(g, name, hash, "final");
    if (st != RF_OK) {
        rfi_graph_free(g);
        return st;
    }
    *out = g;
    return RF_OK;
}

/* Lets the backend start loading its libraries while this thread traces and
 * differentiates: the one backend_for will pick for the device pick_device
 * will choose (unchecked here: tracing reports bad arguments). Returns that
 * backend, or NULL. */
static const rfi_backend *warm_up_backend(const rf_compile_opts *opts, rf_array *const *args,
                                          int nargs)
{
    const rf_device *dev = opts && opts->device              ? opts->device
                           : args && nargs > 0 && args[0] ? rf_array_device(args[0])
                                                          : rf_device_default();
    const rfi_backend *b = backend_for(dev);
    if (b && b->warm_up)
        b->warm_up();
    return b;
}

/* The lowered program and, for a backend with an optimise stage, the
 * optimised one, from the traced program g (consumed): out of the lowering
 * memo when it has them, else made here and kept in memo for recording. */
static rf_status lower_and_optimise(rfi_graph *g, const rfi_backend *backend, rfi_lower_memo *memo,
                                    bool use_memo, rfi_graph **prog, rfi_graph **opt,
                                    uint64_t *hash)
{
    if (use_memo && rfi_lower_memo_find(memo, prog, opt, hash)) {
        rfi_graph_free(g);
        return RF_OK;
    }
    rf_status st = lower(g, prog);
    if (st == RF_OK && backend->optimise)
        st = backend->optimise(*prog, opt);
    if (st != RF_OK) {
        rfi_graph_free(*prog);
        *prog = NULL;
        return st;
    }
    *hash = rfi_hash(*prog);
    if (use_memo)
        rfi_lower_memo_keep(memo, *prog, *opt, *hash);
    return RF_OK;
}

static rf_status compile_traced(rf_trace_fn fn, void *ctx, rf_array *const *args, int nargs,
                                const rf_compile_opts *opts, rf_exec **out)
{
    uint64_t failures = rfi_alloc_failures_here();
    rfi_graph *g;
    rf_status st = trace_fn("rf_compile", fn, ctx, args, nargs, opts, &g);
    if (st != RF_OK)
        return st;
    rfi_watch_list watches = g->watches; /* the executable's from here on */
    g->watches = (rfi_watch_list){0};
    if (g->n_outputs == 0 && g->n_updates == 0) {
        rfi_graph_free(g);
        rfi_watch_list_free(&watches);
        return rfi_error(RF_E_INVALID, "rf_compile: the traced function returned nothing "
                         "(call rf_return or rf_assign)");
    }
    const rfi_backend *backend;
    st = pick_backend("rf_compile", g->device, &backend);
    if (st != RF_OK) {
        rfi_graph_free(g);
        rfi_watch_list_free(&watches);
        return st;
    }
    rfi_lower_memo memo;
    bool use_memo = rfi_lower_memo_begin(&memo, g, backend);
    rfi_graph *prog = NULL, *opt = NULL;
    uint64_t hash = 0;
    st = lower_and_optimise(g, backend, &memo, use_memo, &prog, &opt, &hash);
    rf_exec *e = NULL;
    if (st == RF_OK) {
        e = rfi_exec_new();
        if (!e)
            st = rfi_error(RF_E_NOMEM, "rf_compile: out of memory");
        else
            e->backend = backend; /* so that rf_exec_free releases what prepare makes */
    }
    if (st == RF_OK)
        st = backend->optimise ? backend->prepare_optimised(prog, opt, &e->state)
                               : backend->prepare(prog, &e->state);
    else
        rfi_graph_free(opt);
    /* A pass may take a failed allocation as "leave it": such programs are
     * neither remembered nor used. */
    if (st == RF_OK && rfi_alloc_failures_here() != failures)
        st = rfi_error(RF_E_NOMEM, "rf_compile: out of memory");
    if (st == RF_OK && use_memo)
        rfi_lower_memo_record(&memo);
    if (use_memo)
        rfi_lower_memo_end(&memo);
    if (st != RF_OK) {
        rf_exec_free(e);
        rfi_graph_free(prog);
        rfi_watch_list_free(&watches);
        return st;
    }
    e->watches = watches;
    e->prog = prog;
    e->hash = hash;
    e->device = prog->device;
    st = rfi_exec_init_buffers(e);
    if (st != RF_OK) {
        rf_exec_free(e);
        return st;
    }
    *out = e;
    return RF_OK;
}

rf_status rf_compile_with(rf_trace_fn fn, void *ctx, rf_array *const *args, int nargs,
                          const rf_compile_opts *opts, rf_exec **out)
{
    if (!out)
        return rfi_error(RF_E_INVALID, "rf_compile: out is NULL");
    *out = NULL;
    const rfi_backend *warmed = warm_up_backend(opts, args, nargs);
    rf_status st = compile_traced(fn, ctx, args, nargs, opts, out);
    if (warmed && warmed->settle)
        warmed->settle();
    return st;
}

rf_status rf_compile(rf_trace_fn fn, void *ctx, rf_array *const *args, int nargs,
                     rf_exec **out)
{
    return rf_compile_with(fn, ctx, args, nargs, NULL, out);
}

rf_status rf_jit(rf_trace_fn fn, void *ctx, rf_array *const *args, int nargs,
                 rf_array **outs, int nouts)
{
    rf_exec *e;
    rf_status st = rf_compile(fn, ctx, args, nargs, &e);
    if (st != RF_OK) {
        for (int i = 0; outs && i < nouts; i++)
            outs[i] = NULL;
        return st;
    }
    st = rf_exec_run(e, args, nargs, outs, nouts);
    rf_exec_free(e);
    return st;
}
