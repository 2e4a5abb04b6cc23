/* cpu_backend.c: the compiling CPU backend: ties the pipeline together.
 *
 * prepare: optimise the program (simplify, CSE, DCE), plan it (fusion and
 * memory planning), lower the plan to kernel IR, render C, compile and load
 * the module through the disk cache, and set up the runtime services (thread
 * pool, math-library calls) and the arena, all once. run: fill the buffer
 * table and call the module's one entry point. Nothing is allocated per run.
 *
 * RF_CHECK=1 (read at compile time) makes every run also execute the
 * reference interpreter first and compare outputs and updated captures: the
 * differential mode the test suite uses to check both backends agree.
 * RF_PROFILE=1 (read at compile time too) times every step of every run and
 * prints the profile when the executable is freed (profile.c).
 *
 * It does not know about layers or training, and it computes nothing itself.
 */
#include "../../passes/passes.h"
#include "../kir.h"
#include "../plan.h"
#include "cc.h"
#include "profile.h"
#include "services.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct cpu_state {
    rfi_graph *opt;          /* the optimised program the plan refers to (owned) */
    rfi_plan *plan;
    rfi_module *module;
    rf_module_entry entry;
    rfi_cpu_services *services;
    rf_module_services table;
    void *arena_block;       /* rfi_malloc'd; the arena is its 64-byte aligned interior */
    void **buffers;          /* the buffer table, filled per run */
    int n_buffers;
    void *check;             /* interpreter state when RF_CHECK=1, else NULL */
    rfi_cpu_profile *profile; /* when RF_PROFILE is set, else NULL */
} cpu_state;

static void cpu_release(void *state);

/* ---- prepare --------------------------------------------------------------------- */

typedef rf_status (*graph_pass)(const rfi_graph *, rfi_graph **);

/* Runs `pass` on *g, replacing it (the old graph is freed unless it is `keep`). */
static rf_status apply_pass(graph_pass pass, rfi_graph **g, const rfi_graph *keep)
{
    rfi_graph *out;
    rf_status st = pass(*g, &out);
    if (st != RF_OK)
        return st;
    if (*g != keep)
        rfi_graph_free(*g);
    *g = out;
    return rfi_verify(out);
}

static rf_status optimise(const rfi_graph *g, rfi_graph **out)
{
    rfi_graph *cur = (rfi_graph *)g;
    rf_status st = apply_pass(rfi_simplify, &cur, g);
    if (st == RF_OK)
        st = apply_pass(rfi_cse, &cur, g);
    if (st == RF_OK)
        st = apply_pass(rfi_dce, &cur, g);
    if (st != RF_OK) {
        if (cur != g)
            rfi_graph_free(cur);
        return st;
    }
    *out = cur;
    return RF_OK;
}

static rf_status make_arena(cpu_state *s)
{
    size_t bytes = s->plan->arena_bytes;
    s->arena_block = rfi_malloc(bytes + 64);
    if (!s->arena_block)
        return rfi_error(RF_E_NOMEM, "rf_compile: out of memory for a %zu-byte arena", bytes);
    s->n_buffers = rfi_plan_n_buffers(s->plan);
    s->buffers = rfi_calloc((size_t)s->n_buffers, sizeof(void *));
    if (!s->buffers)
        return rfi_error(RF_E_NOMEM, "rf_compile: out of memory");
    uintptr_t p = ((uintptr_t)s->arena_block + 63) & ~(uintptr_t)63;
    const rfi_graph *g = s->plan->g;
    s->buffers[rfi_plan_arena_buffer(s->plan)] = (void *)p;
    int first_const = rfi_plan_arena_buffer(s->plan) + 1;
    for (int i = 0; i < s->plan->n_consts; i++)
        s->buffers[first_const + i] = (void *)g->nodes[s->plan->consts[i]]->attr.data;
    return RF_OK;
}

/* Whether RF_DUMP asks for the stage dumps (rfi_dump checks it too; this only
 * avoids printing programs and plans nobody reads: they cost milliseconds). */
static bool dumping(void)
{
    const char *dir = getenv("RF_DUMP");
    return dir && *dir;
}

/* Lowers, renders, compiles and loads the module; dumps the plan and the C. */
static rf_status build_module(cpu_state *s, const char *name, uint64_t hash)
{
    rfi_kir_module *kir = NULL;
    char *source = NULL;
    rf_status st = rfi_kir_lower(s->plan, &kir);
    if (st == RF_OK)
        st = rfi_render_c(kir, &source);
    if (st == RF_OK) {
        if (dumping()) {
            char *plan_text = rfi_plan_print(s->plan);
            if (plan_text)
                rfi_dump(name, hash, "plan", plan_text);
            rfi_free(plan_text);
            rfi_dump(name, hash, "c", source);
        }
        st = rfi_cc_load_module(source, name, &s->module);
    }
    if (st == RF_OK)
        s->entry = rfi_module_entry_fn(s->module);
    rfi_free(source);
    rfi_kir_free(kir);
    return st;
}

static bool check_mode(void)
{
    const char *v = getenv("RF_CHECK");
    return v && *v && strcmp(v, "0") != 0;
}

static rf_status cpu_prepare(const rfi_graph *g, void **state)
{
    cpu_state *s = rfi_calloc(1, sizeof *s);
    if (!s)
        return rfi_error(RF_E_NOMEM, "rf_compile: out of memory");
    const char *name = g->name ? g->name : "program";
    rf_status st = optimise(g, &s->opt);
    if (st == RF_OK) {
        uint64_t hash = dumping() ? rfi_hash(s->opt) : 0; /* names the dumps only */
        if (dumping()) {
            char *text = rfi_print(s->opt);
            if (text)
                rfi_dump(name, hash, "optimised", text);
            rfi_free(text);
        }
        rfi_plan_opts opts = rfi_plan_opts_default();
        opts.conv_transposed_views = true; /* the services read or copy them (services.c) */
        st = rfi_plan_build(s->opt, &opts, &s->plan);
        if (st == RF_OK)
            st = build_module(s, name, hash);
    }
    if (st == RF_OK)
        st = rfi_cpu_services_prepare(s->plan, &s->services);
    if (st == RF_OK) {
        rfi_cpu_services_table(s->services, &s->table);
        st = make_arena(s);
    }
    if (st == RF_OK && rfi_cpu_profile_wanted()) {
        s->profile = rfi_cpu_profile_new(s->plan, s->services, name);
        s->table.mark = s->profile ? rfi_cpu_profile_mark : NULL;
        s->table.prof = s->profile;
    }
    if (st == RF_OK && check_mode())
        st = rfi_interp_backend.prepare(g, &s->check);
    if (st != RF_OK) {
        cpu_release(s);
        return st;
    }
    *state = s;
    return RF_OK;
}

/* ---- run --------------------------------------------------------------------------- */

/* How far two buffers of one dtype are apart, in units of the tolerance
 * |a - b| <= atol + rtol * |a| (> 1 means out of tolerance). Integers and
 * bools must match exactly. The absolute term keeps values that are pure
 * rounding noise around zero (a gradient that is mathematically 0) from
 * failing the comparison. */
static double distance(rf_dtype dt, const void *a, const void *b, int64_t n, int64_t *where)
{
    const double rtol = 1e-4, atol = dt == RF_F64 ? 1e-12 : 1e-6;
    double worst = 0;
    for (int64_t i = 0; i < n; i++) {
        double x, y;
        switch (dt) {
        case RF_F32: x = ((const float *)a)[i], y = ((const float *)b)[i]; break;
        case RF_F64: x = ((const double *)a)[i], y = ((const double *)b)[i]; break;
        case RF_I32: x = ((const int32_t *)a)[i], y = ((const int32_t *)b)[i]; break;
        case RF_I64: x = (double)((const int64_t *)a)[i], y = (double)((const int64_t *)b)[i]; break;
        default: x = ((const uint8_t *)a)[i], y = ((const uint8_t *)b)[i]; break;
        }
        if (x == y || (isnan(x) && isnan(y)))
            continue;
        bool exact = dt != RF_F32 && dt != RF_F64;
        double d = exact ? INFINITY : fabs(x - y) / (atol + rtol * fabs(x));
        if (isnan(d) || d > worst) {
            worst = isnan(d) ? INFINITY : d;
            *where = i;
        }
    }
    return worst;
}

/* Runs the interpreter on the same inputs into scratch memory; returns the
 * scratch buffers (outputs then updates) for comparison after the compiled run. */
static rf_status check_before(cpu_state *s, const rfi_graph *g, const rfi_run_io *io,
                              void ***scratch)
{
    int n = g->n_outputs + g->n_updates;
    void **buf = rfi_calloc((size_t)(n ? n : 1), sizeof(void *));
    if (!buf)
        return rfi_error(RF_E_NOMEM, "RF_CHECK: out of memory");
    for (int i = 0; i < g->n_outputs; i++)
        buf[i] = rfi_malloc(rfi_node_nbytes(g->outputs[i]));
    for (int i = 0; i < g->n_updates; i++)
        buf[g->n_outputs + i] = rfi_malloc(g->captures[g->updates[i].capture]->nbytes);
    rfi_run_io ref = {io->args, io->captures, buf, buf + g->n_outputs};
    rf_status st = rfi_interp_backend.run(s->check, g, &ref);
    *scratch = buf;
    return st;
}

static rf_status check_after(const rfi_graph *g, const rfi_run_io *io, void **scratch)
{
    rf_status st = RF_OK;
    int64_t at = 0;
    for (int i = 0; i < g->n_outputs && st == RF_OK; i++) {
        const rfi_node *x = g->outputs[i];
        double d = distance(x->dtype, scratch[i], io->outputs[i], rfi_node_numel(x), &at);
        if (d > 1)
            st = rfi_error(RF_E_INTERNAL, "RF_CHECK: output %d (%%%d %s) element %lld differs "
                           "from the interpreter by %.3g tolerances", i, x->id,
                           rfi_op_table[x->op].name, (long long)at, d);
    }
    for (int i = 0; i < g->n_updates && st == RF_OK; i++) {
        const rf_array *a = g->captures[g->updates[i].capture];
        double d = distance(a->dtype, scratch[g->n_outputs + i], a->data, a->numel, &at);
        if (d > 1)
            st = rfi_error(RF_E_INTERNAL, "RF_CHECK: update %d (capture %d) element %lld "
                           "differs from the interpreter by %.3g tolerances", i,
                           g->updates[i].capture, (long long)at, d);
    }
    for (int i = 0; i < g->n_outputs + g->n_updates; i++)
        rfi_free(scratch[i]);
    rfi_free(scratch);
    return st;
}

static rf_status cpu_run(void *state, const rfi_graph *g, const rfi_run_io *io)
{
    cpu_state *s = state;
    void **scratch = NULL;
    if (s->check) {
        rf_status st = check_before(s, g, io, &scratch);
        if (st != RF_OK) {
            for (int i = 0; scratch && i < g->n_outputs + g->n_updates; i++)
                rfi_free(scratch[i]);
            rfi_free(scratch);
            return st;
        }
    }
    int b = 0;
    for (int i = 0; i < g->n_args; i++)
        s->buffers[b++] = io->args[i];
    for (int i = 0; i < g->n_captures; i++)
        s->buffers[b++] = io->captures[i];
    for (int i = 0; i < g->n_outputs; i++)
        s->buffers[b++] = io->outputs[i];
    int failed = s->entry(&s->table, s->buffers);
    if (failed) {
        for (int i = 0; scratch && i < g->n_outputs + g->n_updates; i++)
            rfi_free(scratch[i]);
        rfi_free(scratch);
        return rfi_error(RF_E_INTERNAL, "rf_exec_run: step %d of the compiled program failed",
                         failed - 1);
    }
    return s->check ? check_after(g, io, scratch) : RF_OK;
}

static size_t cpu_memory(void *state)
{
    const cpu_state *s = state;
    return s->plan->arena_bytes + rfi_cpu_services_workspace(s->services);
}

static void cpu_release(void *state)
{
    cpu_state *s = state;
    if (!s)
        return;
    if (s->check)
        rfi_interp_backend.release(s->check);
    rfi_cpu_profile_free(s->profile); /* prints it: needs the plan and services */
    rfi_cpu_services_free(s->services);
    rfi_module_free(s->module);
    rfi_plan_free(s->plan);
    rfi_graph_free(s->opt);
    rfi_free(s->arena_block);
    rfi_free(s->buffers);
    rfi_free(s);
}

const rfi_backend rfi_cpu_backend = {
    .name = "cpu",
    .prepare = cpu_prepare,
    .run = cpu_run,
    .release = cpu_release,
    .writes_updates = true,
    .memory = cpu_memory,
};
