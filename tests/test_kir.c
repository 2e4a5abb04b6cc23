/* test_kir.c: the kernel IR lowering (kir_lower.c) and the C renderer
 * (cpu/render_c.c) against the reference interpreter.
 *
 * Plans are built by hand here (the rfi_plan struct is public): every
 * argument, capture, output and chosen intermediate is materialised, every
 * other node is inline, one LOOP or REDUCE step per materialised node unless
 * a test merges steps; several programs also go through the planner
 * (rfi_plan_build), end to end. Each program is lowered, rendered, compiled with the
 * system C compiler (cc -O2 -fopenmp-simd -fno-math-errno -std=c11 -Wall
 * -Wextra -Werror, linked with -lm), loaded with dlopen and run with
 * services whose parallel_for runs the chunks serially and whose call
 * fails; its outputs and updated captures are compared with the
 * interpreter's: bit-exact for integer and non-transcendental float ops,
 * within a few ulps for vectorised libm functions (the largest error per op
 * is printed), and within 1e-6 relative for reductions. Reduction tests also
 * check which loop form each kernel got (plain, interchanged, split into
 * partial folds, or an unrolled window), so every form is compared, and
 * sibling reductions the planner joins are checked folded side by side.
 */
#include <dlfcn.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/cpu/module_abi.h"
#include "backend/cpu/render_c.h"
#include "backend/kir.h"
#include "ir/ir.h"
#include "runtime/runtime.h"
#include "test_util.h"

/* ---- Building graphs ------------------------------------------------------------ */
typedef struct targ {
    rf_dtype dt;
    int rank;
    int64_t dims[RF_MAX_RANK];
} targ;

static rfi_graph *g_new(const targ *args, int n)
{
    rfi_graph *g = rfi_graph_new(rf_device_cpu(), "test_kir");
    CHECK(g != NULL);
    rf_dtype dt[16];
    int rank[16];
    int64_t dims[16][RF_MAX_RANK];
    for (int i = 0; i < n; i++) {
        dt[i] = args[i].dt;
        rank[i] = args[i].rank;
        memcpy(dims[i], args[i].dims, sizeof dims[i]);
    }
    if (n > 0)
        CHECK_OK(rfi_graph_set_args(g, n, dt, rank, (const int64_t(*)[RF_MAX_RANK])dims));
    return g;
}

static rfi_node *mk(rfi_graph *g, rfi_op op, rfi_node *const *in, int n_in, const rfi_attrs *a,
                    rf_dtype dt, const int64_t *dims, int rank)
{
    rfi_node *x = rfi_node_new(g, op, in, n_in, a, dt, dims, rank);
    if (!x)
        fprintf(stderr, "  %s: %s\n", rfi_op_table[op].name, rf_errmsg());
    CHECK(x != NULL);
    return x;
}

static rfi_node *g_arg(rfi_graph *g, int i)
{
    rfi_attrs a = {0};
    a.i[0] = i;
    return mk(g, RFI_OP_ARGUMENT, NULL, 0, &a, g->arg_dtypes[i], g->arg_dims[i], g->arg_ranks[i]);
}

static rfi_node *g_capture(rfi_graph *g, rf_dtype dt, const int64_t *dims, int rank,
                           const void *data)
{
    rf_array *arr = rfi_array_alloc("test", rf_device_cpu(), dt, dims, rank);
    CHECK(arr != NULL);
    memcpy(arr->data, data, arr->nbytes);
    int index = rfi_graph_capture_index(g, arr);
    rfi_array_release(arr);
    rfi_attrs a = {0};
    a.i[0] = index;
    return mk(g, RFI_OP_CAPTURE, NULL, 0, &a, dt, dims, rank);
}

static rfi_node *un(rfi_graph *g, rfi_op op, rfi_node *x)
{
    return mk(g, op, &x, 1, NULL, x->dtype, x->dims, x->rank);
}

static rfi_node *bin(rfi_graph *g, rfi_op op, rfi_node *a, rfi_node *b)
{
    rfi_node *in[2] = {a, b};
    return mk(g, op, in, 2, NULL, a->dtype, a->dims, a->rank);
}

static rfi_node *cmp(rfi_graph *g, rf_cmp dir, rfi_node *a, rfi_node *b)
{
    rfi_node *in[2] = {a, b};
    rfi_attrs at = {0};
    at.i[0] = dir;
    return mk(g, RFI_OP_COMPARE, in, 2, &at, RF_BOOL, a->dims, a->rank);
}

static rfi_node *cvt(rfi_graph *g, rfi_node *x, rf_dtype dt)
{
    return mk(g, RFI_OP_CONVERT, &x, 1, NULL, dt, x->dims, x->rank);
}

static rfi_node *scalar(rfi_graph *g, rf_dtype dt, double v)
{
    union { float f; double d; int32_t i; int64_t l; uint8_t b; } u;
    switch (dt) {
    case RF_F32: u.f = (float)v; break;
    case RF_F64: u.d = v; break;
    case RF_I32: u.i = (int32_t)v; break;
    case RF_I64: u.l = (int64_t)v; break;
    default: u.b = (uint8_t)v; break;
    }
    void *copy = rfi_arena_alloc(&g->arena, 8);
    memcpy(copy, &u, 8);
    rfi_attrs a = {0};
    a.data = copy;
    a.nbytes = rf_dtype_size(dt);
    return mk(g, RFI_OP_CONSTANT, NULL, 0, &a, dt, NULL, 0);
}

static rfi_node *constant(rfi_graph *g, rf_dtype dt, const int64_t *dims, int rank,
                          const void *data)
{
    rfi_attrs a = {0};
    a.nbytes = (size_t)rfi_numel(dims, rank) * rf_dtype_size(dt);
    void *copy = rfi_arena_alloc(&g->arena, a.nbytes);
    memcpy(copy, data, a.nbytes);
    a.data = copy;
    return mk(g, RFI_OP_CONSTANT, NULL, 0, &a, dt, dims, rank);
}

static void set_list(rfi_attrs *a, int k, const int64_t *v, int n)
{
    a->nl[k] = n;
    for (int i = 0; i < n; i++)
        a->l[k][i] = v[i];
}

static rfi_node *bcast(rfi_graph *g, rfi_node *x, const int64_t *map, const int64_t *dims,
                       int rank)
{
    rfi_attrs a = {0};
    set_list(&a, 0, map, x->rank);
    return mk(g, RFI_OP_BROADCAST_IN_DIM, &x, 1, &a, x->dtype, dims, rank);
}

static rfi_node *reduce(rfi_graph *g, rfi_node *x, rf_reduce_kind kind, const int64_t *axes,
                        int n)
{
    rfi_attrs a = {0};
    a.i[0] = kind;
    set_list(&a, 0, axes, n);
    int64_t dims[RF_MAX_RANK];
    int rank = 0;
    for (int d = 0; d < x->rank; d++) {
        bool r = false;
        for (int k = 0; k < n; k++)
            r |= axes[k] == d;
        if (!r)
            dims[rank++] = x->dims[d];
    }
    return mk(g, RFI_OP_REDUCE, &x, 1, &a, x->dtype, dims, rank);
}

/* ---- Hand-made plans -------------------------------------------------------------- */
typedef struct plan_opts {
    const int *extra; /* node ids materialised in the arena besides the obvious ones */
    int n_extra;
    bool in_place;    /* updates written into their captures */
} plan_opts;

static bool is_reduction(const rfi_node *n)
{
    return n->op == RFI_OP_REDUCE || n->op == RFI_OP_REDUCE_WINDOW ||
           n->op == RFI_OP_DOT_GENERAL || n->op == RFI_OP_CONVOLUTION;
}

static bool splat(const rfi_node *n)
{
    size_t esz = rf_dtype_size(n->dtype);
    const unsigned char *d = n->attr.data;
    for (int64_t e = 1; e < rfi_node_numel(n); e++)
        if (memcmp(d, d + (size_t)e * esz, esz) != 0)
            return false;
    return true;
}

/* Inline nodes reachable from `root` through inline nodes (for the comments). */
static void collect_fused(rfi_plan *p, const rfi_node *n, bool *seen, int *fused, int *count)
{
    for (int k = 0; k < n->n_in; k++) {
        const rfi_node *x = n->in[k];
        if (seen[x->id] || p->loc[x->id].kind != RFI_LOC_INLINE)
            continue;
        seen[x->id] = true;
        collect_fused(p, x, seen, fused, count);
        fused[(*count)++] = x->id;
    }
}

static void add_step(rfi_plan *p, rfi_step_kind kind, int root, int copy_out, int copy_cap)
{
    const rfi_graph *g = p->g;
    rfi_step *s = &p->steps[p->n_steps++];
    memset(s, 0, sizeof *s);
    s->kind = kind;
    s->roots = rfi_arena_alloc(&p->mem, sizeof(int) * 8);
    s->roots[0] = root;
    s->n_roots = 1;
    s->core = kind == RFI_STEP_REDUCE ? root : -1;
    s->copy_to_output = copy_out;
    s->copy_to_capture = copy_cap;
    if (kind == RFI_STEP_LOOP || kind == RFI_STEP_REDUCE) {
        bool *seen = rfi_calloc((size_t)g->n_nodes, sizeof(bool));
        s->fused = rfi_arena_alloc(&p->mem, sizeof(int) * (size_t)g->n_nodes);
        collect_fused(p, g->nodes[root], seen, s->fused, &s->n_fused);
        rfi_free(seen);
    }
}

static rfi_plan *hand_plan(const rfi_graph *g, const plan_opts *o)
{
    rfi_plan *p = rfi_calloc(1, sizeof *p);
    p->g = g;
    p->loc = rfi_arena_alloc(&p->mem, sizeof(rfi_loc) * (size_t)g->n_nodes);
    p->steps = rfi_arena_alloc(&p->mem, sizeof(rfi_step) * (size_t)(g->n_nodes + 16));
    p->consts = rfi_arena_alloc(&p->mem, sizeof(int) * (size_t)g->n_nodes);
    bool *copy_out = rfi_calloc((size_t)g->n_outputs + 1, sizeof(bool));
    bool *copy_upd = rfi_calloc((size_t)g->n_updates + 1, sizeof(bool));
    for (int i = 0; i < g->n_nodes; i++) {
        const rfi_node *n = g->nodes[i];
        rfi_loc *l = &p->loc[i];
        if (n->op == RFI_OP_ARGUMENT) {
            l->kind = RFI_LOC_ARG;
            l->index = (int)n->attr.i[0];
        } else if (n->op == RFI_OP_CAPTURE) {
            l->kind = RFI_LOC_CAPTURE;
            l->index = (int)n->attr.i[0];
        } else if (n->op == RFI_OP_CONSTANT && !splat(n)) {
            l->kind = RFI_LOC_CONST;
            l->index = p->n_consts;
            p->consts[p->n_consts++] = i;
        }
    }
    for (int o2 = 0; o2 < g->n_outputs; o2++) {
        rfi_loc *l = &p->loc[g->outputs[o2]->id];
        if (l->kind == RFI_LOC_INLINE && g->outputs[o2]->op != RFI_OP_CONSTANT) {
            l->kind = RFI_LOC_OUTPUT;
            l->index = o2;
        } else {
            copy_out[o2] = true;
        }
    }
    size_t arena = 0;
    for (int u = 0; u < g->n_updates; u++) {
        rfi_loc *l = &p->loc[g->updates[u].value->id];
        if (l->kind == RFI_LOC_INLINE && o->in_place) {
            l->kind = RFI_LOC_IN_PLACE;
            l->index = g->updates[u].capture;
        } else {
            copy_upd[u] = true;
        }
    }
    for (int i = 0; i < g->n_nodes; i++) {
        const rfi_node *n = g->nodes[i];
        bool want = is_reduction(n);
        for (int e = 0; e < o->n_extra; e++)
            want |= o->extra[e] == i;
        for (int u = 0; u < g->n_updates; u++)
            want |= g->updates[u].value->id == i;
        if (want && p->loc[i].kind == RFI_LOC_INLINE) {
            p->loc[i].kind = RFI_LOC_ARENA;
            p->loc[i].offset = arena;
            arena += (rfi_node_nbytes(n) + 63) / 64 * 64;
        }
    }
    p->arena_bytes = arena;
    for (int i = 0; i < g->n_nodes; i++) {
        rfi_loc_kind k = p->loc[i].kind;
        if (k == RFI_LOC_ARENA || k == RFI_LOC_OUTPUT || k == RFI_LOC_IN_PLACE)
            add_step(p, is_reduction(g->nodes[i]) ? RFI_STEP_REDUCE : RFI_STEP_LOOP, i, -1, -1);
    }
    for (int o2 = 0; o2 < g->n_outputs; o2++)
        if (copy_out[o2])
            add_step(p, RFI_STEP_COPY, g->outputs[o2]->id, o2, -1);
    for (int u = 0; u < g->n_updates; u++)
        if (copy_upd[u])
            add_step(p, RFI_STEP_COPY, g->updates[u].value->id, -1, g->updates[u].capture);
    rfi_free(copy_out);
    rfi_free(copy_upd);
    return p;
}

static void hand_plan_free(rfi_plan *p)
{
    if (!p)
        return;
    rfi_arena_free(&p->mem);
    rfi_free(p);
}

/* Moves the roots of step `from` into step `into` and deletes `from`. */
static void merge_steps(rfi_plan *p, int into, int from)
{
    rfi_step *a = &p->steps[into], *b = &p->steps[from];
    for (int r = 0; r < b->n_roots; r++)
        a->roots[a->n_roots++] = b->roots[r];
    memmove(b, b + 1, sizeof(rfi_step) * (size_t)(p->n_steps - from - 1));
    p->n_steps--;
}

/* ---- Compiling and running ---------------------------------------------------------- */
static char tmpdir[64];
static int n_modules;

typedef struct module {
    void *so;
    rf_module_entry entry;
    char *source;
} module;

static bool compile_module(const char *source, module *m)
{
    char c_path[128], so_path[128], log_path[128], cmd[768];
    int id = n_modules++;
    snprintf(c_path, sizeof c_path, "%s/m%d.c", tmpdir, id);
    snprintf(so_path, sizeof so_path, "%s/m%d.so", tmpdir, id);
    snprintf(log_path, sizeof log_path, "%s/m%d.log", tmpdir, id);
    FILE *f = fopen(c_path, "w");
    if (!f)
        return false;
    fputs(source, f);
    fclose(f);
    snprintf(cmd, sizeof cmd,
             "cc -O2 -fopenmp-simd -fno-math-errno -std=c11 -fPIC -shared -Wall -Wextra "
             "-Werror -o %s %s -lm > %s 2>&1",
             so_path, c_path, log_path);
    if (system(cmd) != 0) {
        fprintf(stderr, "compiling %s failed:\n", c_path);
        snprintf(cmd, sizeof cmd, "head -c 4000 %s >&2", log_path);
        if (system(cmd) != 0)
            fprintf(stderr, "(no log)\n");
        return false;
    }
    m->so = dlopen(so_path, RTLD_NOW | RTLD_LOCAL);
    if (!m->so) {
        fprintf(stderr, "dlopen %s: %s\n", so_path, dlerror());
        return false;
    }
    m->entry = (rf_module_entry)(uintptr_t)dlsym(m->so, RF_MODULE_ENTRY_NAME);
    if (getenv("TEST_KIR_KEEP")) /* keep the sources for reading */
        return m->entry != NULL;
    unlink(c_path);
    unlink(so_path);
    unlink(log_path);
    return m->entry != NULL;
}

static void serial_for(void *rt, int64_t n, int64_t grain,
                       void (*body)(void *ctx, int64_t lo, int64_t hi), void *ctx)
{
    (void)rt;
    CHECK(grain >= 1);
    for (int64_t lo = 0; lo < n; lo += grain)
        body(ctx, lo, lo + grain < n ? lo + grain : n);
}

static int failing_call(void *rt, int step, void *const *buffers)
{
    (void)rt;
    (void)step;
    (void)buffers;
    return 1;
}

/* Lowers, renders, compiles and loads p; NULL source on failure. */
static bool build(const rfi_plan *p, module *m, rfi_kir_module **km_out)
{
    memset(m, 0, sizeof *m);
    rfi_kir_module *km = NULL;
    rf_status st = rfi_kir_lower(p, &km);
    CHECK_OK(st);
    if (st != RF_OK)
        return false;
    st = rfi_render_c(km, &m->source);
    CHECK_OK(st);
    if (km_out)
        *km_out = km;
    else
        rfi_kir_free(km);
    if (st != RF_OK)
        return false;
    bool ok = compile_module(m->source, m);
    CHECK(ok);
    return ok;
}

static void module_free(module *m)
{
    if (m->so)
        dlclose(m->so);
    rfi_free(m->source);
}

/* ---- Comparing ------------------------------------------------------------------------- */
/* EXACT: equal values (either zero matches either, any NaN any NaN); BITS: equal
 * bits (any NaN matches any NaN): which zero a max or min keeps; ULPS: 4 ulps
 * or 1e-6 relative; SUM: float sums, which compiled code groups differently
 * and, split, adds in blocks of f32 values before the double fold (render_c.c,
 * PRESUM), as an f32 math library's sums do: error against max(|want|, 1) up
 * to 1e-5, the equivalence bound for f32 (the split ones' worst, 1.3e-6, shows
 * in the table of largest errors). */
typedef enum tol { EXACT, BITS, ULPS, SUM, ULP3, ULP4, SUM64 } tol;

/* Largest error seen per op label. */
typedef struct err_row {
    char label[48];
    double ulps, rel;
} err_row;
static err_row err_table[1024];
static int n_err_rows;

static void note_error(const char *label, double ulps, double rel)
{
    for (int i = 0; i < n_err_rows; i++)
        if (strcmp(err_table[i].label, label) == 0) {
            err_table[i].ulps = fmax(err_table[i].ulps, ulps);
            err_table[i].rel = fmax(err_table[i].rel, rel);
            return;
        }
    if (n_err_rows < 1024) {
        snprintf(err_table[n_err_rows].label, sizeof err_table[0].label, "%s", label);
        err_table[n_err_rows].ulps = ulps;
        err_table[n_err_rows].rel = rel;
        n_err_rows++;
    }
}

static int64_t ordered_f32(float v)
{
    int32_t b;
    memcpy(&b, &v, 4);
    return b < 0 ? (int64_t)INT32_MIN - b : b;
}

static int64_t ordered_f64(double v)
{
    int64_t b;
    memcpy(&b, &v, 8);
    return b < 0 ? INT64_MIN - b : b;
}

static double load_f(const void *p, rf_dtype dt, int64_t i)
{
    return dt == RF_F32 ? ((const float *)p)[i] : ((const double *)p)[i];
}

/* got vs want, n elements of dt; returns the number of mismatches. */
static int compare(const char *label, rf_dtype dt, const void *got, const void *want, int64_t n,
                   tol t)
{
    int bad = 0;
    size_t esz = rf_dtype_size(dt);
    double max_ulps = 0, max_rel = 0;
    for (int64_t i = 0; i < n; i++) {
        bool ok;
        if (!rfi_dtype_is_float(dt)) {
            ok = memcmp((const char *)got + i * (int64_t)esz, (const char *)want + i * (int64_t)esz,
                        esz) == 0;
        } else {
            double a = load_f(got, dt, i), b = load_f(want, dt, i);
            if (isnan(a) || isnan(b)) {
                ok = isnan(a) && isnan(b);
            } else if (t == BITS) {
                ok = memcmp((const char *)got + i * (int64_t)esz,
                            (const char *)want + i * (int64_t)esz, esz) == 0;
            } else {
                int64_t apart = dt == RF_F32 ? ordered_f32((float)a) - ordered_f32((float)b)
                                             : ordered_f64(a) - ordered_f64(b);
                double ulps = (double)llabs(apart);
                double tiny = dt == RF_F32 ? FLT_MIN : DBL_MIN;
                double rel = a == b ? 0 : fabs(a - b) / fmax(fabs(b), tiny);
                if (isinf(a) || isinf(b))
                    rel = a == b ? 0 : INFINITY;
                if (t == SUM || t == SUM64) {
                    ulps = 0;
                    rel = fabs(a - b) / fmax(fabs(b), 1.0);
                }
                max_ulps = fmax(max_ulps, ulps);
                max_rel = fmax(max_rel, rel);
                if (t == EXACT)
                    ok = ulps == 0;
                else if (t == ULPS)
                    ok = ulps <= 4 || rel <= 1e-6 || (dt == RF_F64 && rel <= 1e-14);
                else if (t == ULP3 || t == ULP4)
                    ok = ulps <= (t == ULP3 ? 3 : 4);
                else if (t == SUM64)
                    ok = rel <= 1e-12;
                else
                    ok = rel <= 1e-5;
            }
        }
        tu_checks++;
        if (!ok) {
            tu_failures++;
            if (bad++ < 6) {
                if (rfi_dtype_is_float(dt))
                    fprintf(stderr, "%s[%lld]: got %.17g, want %.17g\n", label, (long long)i,
                            load_f(got, dt, i), load_f(want, dt, i));
                else
                    fprintf(stderr, "%s[%lld]: bytes differ (dtype %s)\n", label, (long long)i,
                            rf_dtype_name(dt));
            }
        }
    }
    note_error(label, max_ulps, max_rel);
    return bad;
}

/* Runs g on the interpreter and the compiled plan p and compares every output and
 * update. labels[i] names output i (then update i - n_outputs); tols likewise. */
static void check_program(rfi_graph *g, rfi_plan *p, const void *const *args,
                          const char *const *labels, const tol *tols)
{
    CHECK_OK(rfi_verify(g));
    int no = g->n_outputs, nu = g->n_updates, nc = g->n_captures;
    void *want[64], *got[64], *staged[64], *caps[64], *caps_ro[64];
    for (int i = 0; i < no; i++) {
        want[i] = rfi_calloc(1, rfi_node_nbytes(g->outputs[i]) + 8);
        got[i] = rfi_calloc(1, rfi_node_nbytes(g->outputs[i]) + 8);
    }
    for (int u = 0; u < nu; u++)
        staged[u] = rfi_calloc(1, rfi_node_nbytes(g->updates[u].value) + 8);
    for (int c = 0; c < nc; c++) {
        caps_ro[c] = g->captures[c]->data;
        caps[c] = rfi_malloc(g->captures[c]->nbytes + 8);
        memcpy(caps[c], g->captures[c]->data, g->captures[c]->nbytes);
    }
    void *state = NULL;
    CHECK_OK(rfi_interp_backend.prepare(g, &state));
    rfi_run_io io = {(void *const *)args, caps_ro, want, staged};
    CHECK_OK(rfi_interp_backend.run(state, g, &io));
    rfi_interp_backend.release(state);

    module m;
    if (build(p, &m, NULL)) {
        int nb = rfi_plan_n_buffers(p);
        void **bufs = rfi_calloc((size_t)nb, sizeof(void *));
        void *arena = rfi_calloc(1, p->arena_bytes + 64);
        int b = 0;
        for (int i = 0; i < g->n_args; i++)
            bufs[b++] = (void *)args[i];
        for (int c = 0; c < nc; c++)
            bufs[b++] = caps[c];
        for (int i = 0; i < no; i++)
            bufs[b++] = got[i];
        bufs[b++] = arena;
        for (int k = 0; k < p->n_consts; k++)
            bufs[b++] = (void *)g->nodes[p->consts[k]]->attr.data;
        rf_module_services s = {RF_MODULE_ABI, NULL, serial_for, failing_call, NULL, NULL};
        int rc = m.entry(&s, bufs);
        CHECK(rc == 0);
        for (int i = 0; i < no; i++)
            compare(labels[i], g->outputs[i]->dtype, got[i], want[i],
                    rfi_node_numel(g->outputs[i]), tols[i]);
        for (int u = 0; u < nu; u++)
            compare(labels[no + u], g->updates[u].value->dtype, caps[g->updates[u].capture],
                    staged[u], rfi_node_numel(g->updates[u].value), tols[no + u]);
        rfi_free(bufs);
        rfi_free(arena);
    }
    module_free(&m);
    for (int i = 0; i < no; i++) {
        rfi_free(want[i]);
        rfi_free(got[i]);
    }
    for (int u = 0; u < nu; u++)
        rfi_free(staged[u]);
    for (int c = 0; c < nc; c++)
        rfi_free(caps[c]);
}

/* g through the planner (fusion and memory planning by rfi_plan_build), then as above. */
static void check_planned(rfi_graph *g, const void *const *args, const char *const *labels,
                          const tol *tols)
{
    rfi_plan_opts o = rfi_plan_opts_default();
    o.matmul_call_min_flops = INT64_MAX; /* dots as loops: this test's services have no calls */
    rfi_plan *p = NULL;
    CHECK_OK(rfi_plan_build(g, &o, &p));
    if (!p)
        return;
    CHECK(rfi_plan_count(p, RFI_STEP_CALL) == 0);
    char planned[64][64];
    const char *pl[64];
    for (int i = 0; i < g->n_outputs + g->n_updates && i < 64; i++) {
        snprintf(planned[i], sizeof planned[i], "%s (planned)", labels[i]);
        pl[i] = planned[i];
    }
    check_program(g, p, args, pl, tols);
    rfi_plan_free(p);
}

/* One output per node in ys, each its own step; labels prefixed. */
static bool also_planned; /* check_outputs also runs the planner's plan */

static void check_outputs(rfi_graph *g, rfi_node *const *ys, int n, const void *const *args,
                          const char *const *labels, const tol *tols)
{
    for (int i = 0; i < n; i++)
        CHECK_OK(rfi_graph_add_output(g, ys[i]));
    plan_opts o = {0};
    rfi_plan *p = hand_plan(g, &o);
    check_program(g, p, args, labels, tols);
    hand_plan_free(p);
    if (also_planned)
        check_planned(g, args, labels, tols);
}

/* ---- Inputs ------------------------------------------------------------------------------- */
static const double special[] = {
    0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1.5, 2.5, -2.5, 3.7, -3.7, 1e-3, -1e-3, 100.0, -100.0,
    88.5, 89.0, -87.0, -104.0, 710.0, 1e30, -1e30, INFINITY, -INFINITY, NAN, 1e-40, 0.49999997,
    3.14159265, 20.0, -20.0, 7.0, 0.1, 2.0, 1e-8, 0.75, -0.25,
};
#define N_SPECIAL ((int)(sizeof special / sizeof special[0]))

static void fill_float(void *p, rf_dtype dt, int64_t n, const double *v, int nv)
{
    for (int64_t i = 0; i < n; i++) {
        if (dt == RF_F32)
            ((float *)p)[i] = (float)v[i % nv];
        else
            ((double *)p)[i] = v[i % nv];
    }
}

/* n values: the specials, then scaled copies (so that the vectorised loop bodies see them) */
static void fill_specials(double *vals, int n)
{
    for (int i = 0; i < n; i++)
        vals[i] = special[i % N_SPECIAL] * (i < N_SPECIAL ? 1.0 : 0.37 * (i / N_SPECIAL));
}

/* ---- Tests -------------------------------------------------------------------------------- */
static const rfi_op float_unary[] = {
    RFI_OP_NEG, RFI_OP_ABS, RFI_OP_SIGN, RFI_OP_EXP, RFI_OP_EXPM1, RFI_OP_LOG, RFI_OP_LOG1P,
    RFI_OP_SQRT, RFI_OP_RSQRT, RFI_OP_TANH, RFI_OP_LOGISTIC, RFI_OP_SIN, RFI_OP_COS,
    RFI_OP_FLOOR, RFI_OP_CEIL, RFI_OP_ROUND, RFI_OP_IS_FINITE, RFI_OP_STOP_GRADIENT,
};
#define N_FLOAT_UNARY ((int)(sizeof float_unary / sizeof float_unary[0]))

static bool transcendental(rfi_op op)
{
    return op == RFI_OP_EXP || op == RFI_OP_EXPM1 || op == RFI_OP_LOG || op == RFI_OP_LOG1P ||
           op == RFI_OP_TANH || op == RFI_OP_LOGISTIC || op == RFI_OP_SIN || op == RFI_OP_COS ||
           op == RFI_OP_POW;
}

/* pow by these constant exponents: gcc's vectoriser rewrites some (0.5 into a square root,
 * which differs from pow at -0 and -inf; 2 into a product) */
static const double pow_exponents[] = {0.5, -0.5, 2, 3, 0.25, -1, 1, 0, 1.5, -2};
#define N_POW_EXPONENTS ((int)(sizeof pow_exponents / sizeof pow_exponents[0]))

/* Every unary float op, and pow by constant exponents, one output each, over the special
 * values (a few times and 3 more, so that the vectorised loop bodies and the scalar tails
 * both run). */
static void test_float_unary(rf_dtype dt)
{
    enum { N = N_SPECIAL * 4 + 3, N_OUT = N_FLOAT_UNARY + N_POW_EXPONENTS };
    targ a = {dt, 1, {N}};
    rfi_graph *g = g_new(&a, 1);
    rfi_node *x = g_arg(g, 0);
    rfi_node *ys[N_OUT];
    char names[N_OUT][48];
    const char *labels[N_OUT];
    tol tols[N_OUT];
    for (int i = 0; i < N_FLOAT_UNARY; i++) {
        rfi_op op = float_unary[i];
        ys[i] = op == RFI_OP_IS_FINITE ? mk(g, op, &x, 1, NULL, RF_BOOL, x->dims, 1) : un(g, op, x);
        snprintf(names[i], sizeof names[i], "%s %s", rfi_op_table[op].name, rf_dtype_name(dt));
        tols[i] = transcendental(op) ? ULPS : EXACT;
    }
    for (int e = 0; e < N_POW_EXPONENTS; e++) {
        int i = N_FLOAT_UNARY + e;
        double p = pow_exponents[e];
        ys[i] = bin(g, RFI_OP_POW, x, bcast(g, scalar(g, dt, p), NULL, x->dims, 1));
        snprintf(names[i], sizeof names[i], "pow(x, %g) %s", p, rf_dtype_name(dt));
        tols[i] = p == 0.5 ? BITS : ULPS; /* a square root: rounded once */
    }
    for (int i = 0; i < N_OUT; i++)
        labels[i] = names[i];
    double vals[N];
    fill_specials(vals, N);
    void *data = rfi_malloc(N * 8);
    fill_float(data, dt, N, vals, N);
    const void *args[1] = {data};
    check_outputs(g, ys, N_OUT, args, labels, tols);
    rfi_graph_free(g);
    rfi_free(data);
}

/* The documented bound of the vectorised math (ARCHITECTURE.md, the C renderer): every
 * math op within 3 ulp of the interpreter (f64 logistic 4), over a dense sweep of each
 * op's working range, so that the vector bodies of both widths and the scalar tails all
 * see thousands of values; exp also over the whole range of each dtype (overflow to
 * inf, subnormal results, results that round to 0) and expm1 where it is clamped. (f32 log through libmvec was 4 ulp off on 0.4% of [0.5, 2),
 * f32 logistic 4 ulp off too.) */
static void test_math_bounds(rf_dtype dt)
{
    static const struct {
        rfi_op op;
        double lo, hi;
    } sweeps[] = {
        {RFI_OP_EXP, -87, 88},       {RFI_OP_EXPM1, -20, 20}, {RFI_OP_LOG, 0.5, 2},
        {RFI_OP_EXP, -110, 90},      {RFI_OP_EXP, -760, 720}, {RFI_OP_EXPM1, -800, 0},
        {RFI_OP_LOG, 1e-30, 1e30},   {RFI_OP_LOG1P, -0.9, 10}, {RFI_OP_TANH, -10, 10},
        {RFI_OP_LOGISTIC, -100, 40}, {RFI_OP_SIN, -100, 100}, {RFI_OP_COS, -100, 100},
    };
    enum { N = 65536 + 13, K = (int)(sizeof sweeps / sizeof sweeps[0]) };
    targ a[K];
    for (int k = 0; k < K; k++)
        a[k] = (targ){dt, 1, {N}};
    rfi_graph *g = g_new(a, K);
    double *vals = rfi_malloc(N * sizeof *vals);
    void *data[K];
    rfi_node *ys[K];
    char names[K][48];
    const char *labels[K];
    tol tols[K];
    uint64_t state = 0x9e3779b97f4a7c15ull;
    for (int k = 0; k < K; k++) {
        bool wide = sweeps[k].lo > 0 && sweeps[k].hi / sweeps[k].lo > 1e6; /* log-uniform */
        for (int i = 0; i < N; i++) {
            state = state * 6364136223846793005ull + 1442695040888963407ull;
            double u = (double)(state >> 11) / 9007199254740992.0;
            vals[i] = wide ? exp(log(sweeps[k].lo) + u * log(sweeps[k].hi / sweeps[k].lo))
                           : sweeps[k].lo + u * (sweeps[k].hi - sweeps[k].lo);
        }
        data[k] = rfi_malloc(N * 8);
        fill_float(data[k], dt, N, vals, N);
        ys[k] = un(g, sweeps[k].op, g_arg(g, k));
        snprintf(names[k], sizeof names[k], "%s %s [%g, %g]", rfi_op_table[sweeps[k].op].name,
                 rf_dtype_name(dt), sweeps[k].lo, sweeps[k].hi);
        labels[k] = names[k];
        tols[k] = dt == RF_F64 && sweeps[k].op == RFI_OP_LOGISTIC ? ULP4 : ULP3;
    }
    check_outputs(g, ys, K, (const void *const *)data, labels, tols);
    for (int k = 0; k < K; k++)
        rfi_free(data[k]);
    rfi_free(vals);
    rfi_graph_free(g);
}

static const rfi_op float_binary[] = {RFI_OP_ADD, RFI_OP_SUB, RFI_OP_MUL, RFI_OP_DIV,
                                      RFI_OP_POW, RFI_OP_MAX, RFI_OP_MIN, RFI_OP_REM};
static const rfi_op int_binary[] = {RFI_OP_ADD, RFI_OP_SUB, RFI_OP_MUL, RFI_OP_DIV,
                                    RFI_OP_MAX, RFI_OP_MIN, RFI_OP_REM, RFI_OP_AND, RFI_OP_OR};

static const double int_values[] = {0, 1, -1, 2, -2, 3, 7, -7, 13, 100, -100, 255, 256, 65537,
                                    2147483647.0, -2147483648.0, 31, 63, -64, 1000003};
#define N_INT_VALUES ((int)(sizeof int_values / sizeof int_values[0]))

static void fill_int(void *p, rf_dtype dt, int64_t i, double v)
{
    switch (dt) {
    case RF_I32: ((int32_t *)p)[i] = (int32_t)(int64_t)v; break;
    case RF_I64:
        ((int64_t *)p)[i] = v == -2147483648.0 ? INT64_MIN : v == 2147483647.0 ? INT64_MAX
                                                                               : (int64_t)v;
        break;
    case RF_U8: ((uint8_t *)p)[i] = (uint8_t)(int64_t)v; break;
    default: ((uint8_t *)p)[i] = v != 0; break;
    }
}

/* Every binary op and every comparison on all pairs of special values, then select,
 * clamp and converts into every dtype. */
static void test_binary(rf_dtype dt)
{
    bool fl = rfi_dtype_is_float(dt);
    int nv = fl ? N_SPECIAL : N_INT_VALUES;
    int64_t n = (int64_t)nv * nv;
    targ a[2] = {{dt, 1, {n}}, {dt, 1, {n}}};
    rfi_graph *g = g_new(a, 2);
    rfi_node *x = g_arg(g, 0), *y = g_arg(g, 1);
    rfi_node *ys[64];
    char names[64][48];
    const char *labels[64];
    tol tols[64];
    int count = 0;
    const rfi_op *ops = fl ? float_binary : int_binary;
    int nops = fl ? 8 : 9;
    if (dt == RF_BOOL)
        nops = 0;
    for (int i = 0; i < nops; i++) {
        ys[count] = bin(g, ops[i], x, y);
        snprintf(names[count], 48, "%s %s", rfi_op_table[ops[i]].name, rf_dtype_name(dt));
        tols[count] = transcendental(ops[i]) ? ULPS : EXACT;
        count++;
    }
    if (dt == RF_BOOL) {
        rfi_op lops[] = {RFI_OP_AND, RFI_OP_OR};
        for (int i = 0; i < 2; i++) {
            ys[count] = bin(g, lops[i], x, y);
            snprintf(names[count], 48, "%s bool", rfi_op_table[lops[i]].name);
            tols[count++] = EXACT;
        }
    }
    for (int c = 0; c < RF_CMP_COUNT; c++) {
        ys[count] = cmp(g, (rf_cmp)c, x, y);
        snprintf(names[count], 48, "compare%d %s", c, rf_dtype_name(dt));
        tols[count++] = EXACT;
    }
    rfi_node *sel_in[3] = {cmp(g, RF_LT, x, y), x, y};
    ys[count] = mk(g, RFI_OP_SELECT, sel_in, 3, NULL, dt, x->dims, 1);
    snprintf(names[count], 48, "select %s", rf_dtype_name(dt));
    tols[count++] = EXACT;
    if (dt != RF_BOOL) {
        rfi_node *cl_in[3] = {scalar(g, dt, fl ? -1.5 : 2), x, y};
        ys[count] = mk(g, RFI_OP_CLAMP, cl_in, 3, NULL, dt, x->dims, 1);
        snprintf(names[count], 48, "clamp %s", rf_dtype_name(dt));
        tols[count++] = EXACT;
    }
    for (int t = 0; t < RF_DTYPE_COUNT; t++) {
        if (t == (int)dt)
            continue;
        ys[count] = cvt(g, x, (rf_dtype)t);
        snprintf(names[count], 48, "convert %s->%s", rf_dtype_name(dt), rf_dtype_name((rf_dtype)t));
        tols[count++] = EXACT;
    }
    if (!fl) {
        rfi_op uops[] = {RFI_OP_NEG, RFI_OP_ABS, RFI_OP_SIGN, RFI_OP_NOT};
        for (int i = dt == RF_BOOL ? 3 : 0; i < 4; i++) {
            ys[count] = un(g, uops[i], x);
            snprintf(names[count], 48, "%s %s", rfi_op_table[uops[i]].name, rf_dtype_name(dt));
            tols[count++] = EXACT;
        }
    }
    for (int i = 0; i < count; i++)
        labels[i] = names[i];
    void *xa = rfi_malloc((size_t)n * 8), *ya = rfi_malloc((size_t)n * 8);
    for (int i = 0; i < nv; i++)
        for (int j = 0; j < nv; j++) {
            int64_t k = (int64_t)i * nv + j;
            if (fl) {
                fill_float(xa, dt, 1, &special[i], 1);
                if (dt == RF_F32) {
                    ((float *)xa)[k] = (float)special[i];
                    ((float *)ya)[k] = (float)special[j];
                } else {
                    ((double *)xa)[k] = special[i];
                    ((double *)ya)[k] = special[j];
                }
            } else {
                fill_int(xa, dt, k, int_values[i]);
                fill_int(ya, dt, k, int_values[j]);
            }
        }
    const void *args[2] = {xa, ya};
    check_outputs(g, ys, count, args, labels, tols);
    rfi_graph_free(g);
    rfi_free(xa);
    rfi_free(ya);
}

/* A chain of data movement ops fused into one loop: transpose, broadcast, iota, reverse,
 * slice, reshape, pad (negative low, interior), concatenate, plus elementwise math;
 * `materialise` also puts the transpose in the arena (loads with index maps). */
static void test_shape_chain(bool materialise)
{
    targ a[2] = {{RF_F32, 3, {2, 3, 4}}, {RF_F32, 1, {4}}};
    rfi_graph *g = g_new(a, 2);
    rfi_node *x = g_arg(g, 0), *b = g_arg(g, 1);
    rfi_attrs at = {0};
    int64_t perm[] = {2, 0, 1}, tdims[] = {4, 2, 3};
    set_list(&at, 0, perm, 3);
    rfi_node *t = mk(g, RFI_OP_TRANSPOSE, &x, 1, &at, RF_F32, tdims, 3);
    int64_t map0[] = {0};
    rfi_node *bb = bcast(g, b, map0, tdims, 3);
    rfi_attrs ia = {0};
    ia.i[0] = 2;
    rfi_node *io = mk(g, RFI_OP_IOTA, NULL, 0, &ia, RF_F32, tdims, 3);
    rfi_node *s = bin(g, RFI_OP_ADD, bin(g, RFI_OP_MUL, t, bb), io);
    rfi_attrs ra = {0};
    int64_t raxes[] = {1};
    set_list(&ra, 0, raxes, 1);
    rfi_node *r = mk(g, RFI_OP_REVERSE, &s, 1, &ra, RF_F32, tdims, 3);
    rfi_attrs sa = {0};
    int64_t start[] = {1, 0, 0}, limit[] = {4, 2, 3}, stride[] = {2, 1, 2}, sdims[] = {2, 2, 2};
    set_list(&sa, 0, start, 3);
    set_list(&sa, 1, limit, 3);
    set_list(&sa, 2, stride, 3);
    rfi_node *sl = mk(g, RFI_OP_SLICE, &r, 1, &sa, RF_F32, sdims, 3);
    int64_t rdims[] = {4, 2};
    rfi_node *rs = mk(g, RFI_OP_RESHAPE, &sl, 1, NULL, RF_F32, rdims, 2);
    rfi_attrs pa = {0};
    int64_t lo[] = {1, -1}, hi[] = {0, 2}, interior[] = {1, 0}, pdims[] = {8, 3};
    set_list(&pa, 0, lo, 2);
    set_list(&pa, 1, hi, 2);
    set_list(&pa, 2, interior, 2);
    rfi_node *pin[2] = {rs, scalar(g, RF_F32, 0.5)};
    rfi_node *pd = mk(g, RFI_OP_PAD, pin, 2, &pa, RF_F32, pdims, 2);
    rfi_node *th = un(g, RFI_OP_TANH, pd);
    rfi_attrs ca = {0};
    ca.i[0] = 0;
    rfi_node *cin[3] = {pd, th, un(g, RFI_OP_NEG, pd)};
    int64_t cdims[] = {24, 3};
    rfi_node *cc = mk(g, RFI_OP_CONCATENATE, cin, 3, &ca, RF_F32, cdims, 2);
    /* a second concatenation along the last axis, operands of different widths */
    int64_t w1[] = {24, 1};
    rfi_attrs s2 = {0};
    int64_t st2[] = {0, 1}, li2[] = {24, 2}, sd2[] = {1, 1};
    set_list(&s2, 0, st2, 2);
    set_list(&s2, 1, li2, 2);
    set_list(&s2, 2, sd2, 2);
    rfi_node *col = mk(g, RFI_OP_SLICE, &cc, 1, &s2, RF_F32, w1, 2);
    rfi_attrs ca2 = {0};
    ca2.i[0] = 1;
    int64_t c2dims[] = {24, 4};
    /* scalar * tensor needs an explicit broadcast */
    int64_t nomap[1] = {0};
    rfi_node *three = bcast(g, scalar(g, RF_F32, 3), nomap, w1, 2);
    rfi_node *cin3[2] = {cc, bin(g, RFI_OP_MUL, col, three)};
    rfi_node *c2 = mk(g, RFI_OP_CONCATENATE, cin3, 2, &ca2, RF_F32, c2dims, 2);
    CHECK_OK(rfi_graph_add_output(g, c2));
    int extra[] = {t->id};
    plan_opts o = {materialise ? extra : NULL, materialise ? 1 : 0, false};
    rfi_plan *p = hand_plan(g, &o);
    CHECK(p->n_steps == (materialise ? 2 : 1));
    float xd[24], bd[4] = {0.5f, -2.0f, 3.0f, 1.25f};
    for (int i = 0; i < 24; i++)
        xd[i] = (float)(i * 0.7 - 5.0);
    const void *args[2] = {xd, bd};
    const char *labels[] = {materialise ? "shape chain (materialised transpose)" : "shape chain"};
    tol tols[] = {ULPS};
    check_program(g, p, args, labels, tols);
    hand_plan_free(p);
    if (!materialise)
        check_planned(g, args, labels, tols);
    rfi_graph_free(g);
}

/* Reductions of every kind over several axis sets, with a fused producer. */
static void test_reductions(rf_dtype dt)
{
    targ a = {dt, 3, {3, 4, 5}};
    rfi_graph *g = g_new(&a, 1);
    rfi_node *x = g_arg(g, 0);
    bool fl = rfi_dtype_is_float(dt);
    rfi_node *prod_in = dt == RF_BOOL ? x : bin(g, RFI_OP_ADD, x, x); /* fused producer */
    static const int64_t axes_sets[][3] = {{1}, {0, 2}, {0, 1, 2}, {2}};
    static const int n_axes[] = {1, 2, 3, 1};
    rfi_node *ys[32];
    char names[32][48];
    const char *labels[32];
    tol tols[32];
    int count = 0;
    for (int kind = 0; kind < RF_REDUCE_KIND_COUNT; kind++) {
        bool logic = kind == RF_REDUCE_AND || kind == RF_REDUCE_OR;
        if (logic && fl)
            continue;
        if (dt == RF_BOOL && !logic && kind != RF_REDUCE_MAX && kind != RF_REDUCE_MIN)
            continue;
        for (int s = 0; s < 4; s++) {
            ys[count] = reduce(g, prod_in, (rf_reduce_kind)kind, axes_sets[s], n_axes[s]);
            snprintf(names[count], 48, "reduce%d %s axes%d", kind, rf_dtype_name(dt), s);
            labels[count] = names[count];
            tols[count++] = fl && (kind == RF_REDUCE_SUM || kind == RF_REDUCE_PROD) ? SUM : EXACT;
        }
    }
    void *data = rfi_malloc(60 * 8);
    for (int i = 0; i < 60; i++) {
        double v = fl ? (i % 7 - 3) * 0.37 + (i == 17 && dt == RF_F64 ? NAN : 0)
                      : (i * 37 % 11) - 5;
        if (dt == RF_F32 || dt == RF_F64)
            fill_float((char *)data + (size_t)i * rf_dtype_size(dt), dt, 1, &v, 1);
        else
            fill_int(data, dt, i, dt == RF_BOOL ? (i % 5 != 0) : v);
    }
    const void *args[1] = {data};
    check_outputs(g, ys, count, args, labels, tols);
    rfi_graph_free(g);
    rfi_free(data);
}

static rfi_node *reduce_window(rfi_graph *g, rfi_node *x, rf_reduce_kind kind,
                               const int64_t *win, const int64_t *strides, const int64_t *lo,
                               const int64_t *hi)
{
    rfi_attrs a = {0};
    a.i[0] = kind;
    set_list(&a, 0, win, x->rank);
    set_list(&a, 1, strides, x->rank);
    set_list(&a, 2, lo, x->rank);
    set_list(&a, 3, hi, x->rank);
    int64_t dims[RF_MAX_RANK];
    for (int d = 0; d < x->rank; d++)
        dims[d] = (x->dims[d] + lo[d] + hi[d] - win[d]) / strides[d] + 1;
    return mk(g, RFI_OP_REDUCE_WINDOW, &x, 1, &a, x->dtype, dims, x->rank);
}

static void test_reduce_window(void)
{
    targ a = {RF_F32, 4, {2, 1, 6, 7}};
    rfi_graph *g = g_new(&a, 1);
    rfi_node *x = g_arg(g, 0);
    int64_t win[] = {1, 1, 3, 3}, st[] = {1, 1, 2, 2}, lo[] = {0, 0, 1, 1}, hi[] = {0, 0, 1, 1};
    int64_t win2[] = {1, 1, 2, 2}, st2[] = {1, 1, 2, 2}, z[] = {0, 0, 0, 0};
    rfi_node *ys[4] = {
        reduce_window(g, x, RF_REDUCE_MAX, win, st, lo, hi),
        reduce_window(g, un(g, RFI_OP_NEG, x), RF_REDUCE_SUM, win, st, lo, hi),
        reduce_window(g, x, RF_REDUCE_MAX, win2, st2, z, z), /* no padding: no guard */
        reduce_window(g, x, RF_REDUCE_MIN, win, st, lo, hi),
    };
    const char *labels[] = {"reduce_window max pad", "reduce_window sum pad",
                            "reduce_window max 2x2", "reduce_window min pad"};
    tol tols[] = {EXACT, SUM, EXACT, EXACT};
    float d[84];
    for (int i = 0; i < 84; i++)
        d[i] = (float)(-(i * 13 % 17) * 0.5 - 1.0); /* all negative: padding must not win */
    const void *args[1] = {d};
    check_outputs(g, ys, 4, args, labels, tols);
    rfi_graph_free(g);
}

/* The product of 2-D x and y (x's dtype) over x's dim lc and y's dim rc,
 * [rows, cols]. */
static rfi_node *dot_2d(rfi_graph *g, rfi_node *x, rfi_node *y, int64_t lc, int64_t rc,
                        int64_t rows, int64_t cols)
{
    rfi_attrs at = {0};
    set_list(&at, 2, &lc, 1);
    set_list(&at, 3, &rc, 1);
    int64_t dims[] = {rows, cols};
    rfi_node *in[2] = {x, y};
    return mk(g, RFI_OP_DOT_GENERAL, in, 2, &at, x->dtype, dims, 2);
}

/* The source of g's module from a hand plan, compiled and loaded once
 * (rfi_malloc'd; NULL, a failed check, when it does not build); *km_out,
 * when asked for, receives the lowered module (the caller frees it). */
static char *hand_source(rfi_graph *g, rfi_kir_module **km_out)
{
    plan_opts o = {0};
    rfi_plan *p = hand_plan(g, &o);
    module m;
    char *source = NULL;
    if (build(p, &m, km_out)) {
        source = m.source;
        m.source = NULL;
    }
    module_free(&m);
    hand_plan_free(p);
    return source;
}

static void test_dot(rf_dtype dt)
{
    targ a[2] = {{dt, 3, {2, 3, 4}}, {dt, 3, {4, 2, 5}}};
    rfi_graph *g = g_new(a, 2);
    rfi_node *x = g_arg(g, 0), *y = g_arg(g, 1);
    rfi_attrs at = {0};
    int64_t lb[] = {0}, rb[] = {1}, lc[] = {2}, rc[] = {0};
    set_list(&at, 0, lb, 1);
    set_list(&at, 1, rb, 1);
    set_list(&at, 2, lc, 1);
    set_list(&at, 3, rc, 1);
    int64_t dims[] = {2, 3, 5};
    rfi_node *in[2] = {un(g, RFI_OP_ABS, x), y};
    rfi_node *d1 = mk(g, RFI_OP_DOT_GENERAL, in, 2, &at, dt, dims, 3);
    /* two contracting dims, no batch: [2,3,4] x [4,2,5] over (0,2)/(1,0) -> [3,5] */
    rfi_attrs at2 = {0};
    int64_t lc2[] = {0, 2}, rc2[] = {1, 0};
    set_list(&at2, 2, lc2, 2);
    set_list(&at2, 3, rc2, 2);
    int64_t dims2[] = {3, 5};
    rfi_node *in2[2] = {x, y};
    rfi_node *d2 = mk(g, RFI_OP_DOT_GENERAL, in2, 2, &at2, dt, dims2, 2);
    rfi_node *ys[2] = {d1, d2};
    char n1[48], n2[48];
    snprintf(n1, 48, "dot_general batch %s", rf_dtype_name(dt));
    snprintf(n2, 48, "dot_general 2 contract %s", rf_dtype_name(dt));
    const char *labels[] = {n1, n2};
    tol tols[] = {rfi_dtype_is_float(dt) ? SUM : EXACT, rfi_dtype_is_float(dt) ? SUM : EXACT};
    char xd[24 * 8], yd[40 * 8];
    for (int i = 0; i < 40; i++) {
        double v = (i * 7 % 9) - 4 + (rfi_dtype_is_float(dt) ? 0.25 : 0);
        if (rfi_dtype_is_float(dt)) {
            if (i < 24)
                fill_float(xd + i * (int)rf_dtype_size(dt), dt, 1, &v, 1);
            double w = v * 0.5 - 1;
            fill_float(yd + i * (int)rf_dtype_size(dt), dt, 1, &w, 1);
        } else {
            if (i < 24)
                fill_int(xd, dt, i, v);
            fill_int(yd, dt, i, v * 3 + 1);
        }
    }
    const void *args[2] = {xd, yd};
    check_outputs(g, ys, 2, args, labels, tols);
    rfi_graph_free(g);
}

/* Runs g (one output, from args x of nx values and w of nw, dtype dt, filled
 * with short binary fractions) compiled from a hand plan against the
 * interpreter, within the sum tolerance; `label` names the output. */
static void check_two_operands(rfi_graph *g, rf_dtype dt, int64_t nx, int64_t nw,
                               const char *label)
{
    size_t esz = rf_dtype_size(dt);
    char *xd = rfi_malloc((size_t)nx * esz), *wd = rfi_malloc((size_t)nw * esz);
    for (int64_t i = 0; xd && i < nx; i++) {
        double v = (double)((i * 7 % 9) - 4) * 0.25;
        fill_float(xd + (size_t)i * esz, dt, 1, &v, 1);
    }
    for (int64_t i = 0; wd && i < nw; i++) {
        double v = (double)((i * 5 % 11) - 5) * 0.125;
        fill_float(wd + (size_t)i * esz, dt, 1, &v, 1);
    }
    const void *args[2] = {xd, wd};
    const char *labels[] = {label};
    tol tols[] = {SUM};
    plan_opts o = {0};
    rfi_plan *p = hand_plan(g, &o);
    if (xd && wd)
        check_program(g, p, args, labels, tols);
    hand_plan_free(p);
    rfi_free(xd);
    rfi_free(wd);
}

/* A matrix-vector product ([1,len] x [rows,len] over 1/1): the reduce kernel
 * takes outputs four at a time with one accumulator each (the source says
 * so), the remainder of every chunk one at a time; rows of at least 64
 * points are folded with 512-bit vectors (RF_LANES16 on the kernel), shorter
 * ones are not. The values match the interpreter, with enough outputs for
 * parallel_for to cut ranges that are not multiples of four. */
static void test_dot_unrolled(int64_t len, int64_t rows)
{
    targ a[2] = {{RF_F32, 2, {1, len}}, {RF_F32, 2, {rows, len}}};
    rfi_graph *g = g_new(a, 2);
    rfi_node *x = g_arg(g, 0), *w = g_arg(g, 1);
    rfi_node *d = dot_2d(g, x, w, 1, 1, 1, rows);
    CHECK_OK(rfi_graph_add_output(g, d));
    char *src = hand_source(g, NULL);
    if (src) {
        CHECK(strstr(src, "#pragma omp simd reduction(+:acc_0, acc_1, acc_2, acc_3)") != NULL);
        CHECK(strstr(src, "for (; i0 + 4 <= hi; i0 += 4) {") != NULL);
        CHECK(strstr(src, "const float x_1u3 = ") != NULL);
        bool wide = strstr(src, "RF_KERNEL RF_LANES16 void k0_dot_general(") != NULL;
        CHECK(wide == (len >= 64));
    }
    rfi_free(src);
    check_two_operands(g, RF_F32, len, rows * len, "dot_general unrolled f32");
    rfi_graph_free(g);
}

/* A matrix product that stays a loop ([m,len] x [n,len] over 1/1, f32 or
 * f64: every f64 product does): the reduce kernel keeps its rows split
 * across threads and takes four columns at a time, one accumulator each,
 * the last n % 4 one at a time. The values match the interpreter. */
static void test_dot_unrolled_rows(rf_dtype dt, int64_t m, int64_t n, int64_t len)
{
    targ a[2] = {{dt, 2, {m, len}}, {dt, 2, {n, len}}};
    rfi_graph *g = g_new(a, 2);
    CHECK_OK(rfi_graph_add_output(g, dot_2d(g, g_arg(g, 0), g_arg(g, 1), 1, 1, m, n)));
    char *src = hand_source(g, NULL), head[64];
    snprintf(head, sizeof head, "for (; i1 + 4 <= %lld; i1 += 4) {", (long long)n);
    if (src) {
        CHECK(strstr(src, "#pragma omp simd reduction(+:acc_0, acc_1, acc_2, acc_3)"));
        CHECK(strstr(src, head) != NULL);
        CHECK(strstr(src, "for (int64_t i0 = lo; i0 < hi; i0++) {") != NULL);
    }
    rfi_free(src);
    check_two_operands(g, dt, m * len, n * len,
                       dt == RF_F64 ? "dot_general rows unrolled f64"
                                    : "dot_general rows unrolled f32");
    rfi_graph_free(g);
}

/* A weight gradient's product ([len,m] x [len,n] over 0/0: both operands
 * contiguous along the result's row) runs in register tiles of 4 rows by
 * two vectors, the rows left over one at a time and the row's last points
 * as one more vector overlapping the one before (render_tiles.c); a row
 * shorter than a vector, or a sum of fewer than 8 points, runs
 * interchanged. The vectors are 32 bytes, or 64 with AVX-512 for rows of
 * two such vectors or more. The values match the interpreter's. */
static void test_product_tiles(rf_dtype dt, int64_t m, int64_t n, int64_t len)
{
    targ a[2] = {{dt, 2, {len, m}}, {dt, 2, {len, n}}};
    rfi_graph *g = g_new(a, 2);
    CHECK_OK(rfi_graph_add_output(g, dot_2d(g, g_arg(g, 0), g_arg(g, 1), 0, 0, m, n)));
    char *src = hand_source(g, NULL), last[64];
    int64_t size = (int64_t)rf_dtype_size(dt);
    bool wide = rfi_render_wide_vectors() && n >= 2 * (64 / size);
    int64_t lanes = (wide ? 64 : 32) / size;
    snprintf(last, sizeof last, "col1 = %lld;", (long long)(n - lanes));
    bool tiled = n >= lanes && len >= 8;
    if (src) {
        CHECK((strstr(src, "acc_3_1 += b_3 * a_1;") != NULL) == tiled);
        CHECK((strstr(src, "for (; row0 + 4 <= hi; row0 += 4) {") != NULL) == tiled);
        CHECK((strstr(src, last) != NULL) == (tiled && n % lanes != 0));
        CHECK((strstr(src, "double accs[") || strstr(src, "float accs[")) == !tiled);
        CHECK((strstr(src, "a_0 = *(const rf_wtile_") != NULL) == (tiled && wide));
    }
    rfi_free(src);
    check_two_operands(g, dt, len * m, len * n,
                       dt == RF_F64 ? "dot_general tiles f64" : "dot_general tiles f32");
    rfi_graph_free(g);
}

/* A product x w with w stored [len,n] ([m,len] x [len,n] over 1/0: w's column
 * strides along the sum) runs in the same tiles, w's row a vector and x one
 * value per row, instead of gathering the column a row apart per term; rows
 * left over, and all of them when there are fewer than 4, in tiles of one
 * row. The values match the interpreter's. */
static void test_column_tiles(rf_dtype dt, int64_t m, int64_t n, int64_t len)
{
    targ a[2] = {{dt, 2, {m, len}}, {dt, 2, {len, n}}};
    rfi_graph *g = g_new(a, 2);
    CHECK_OK(rfi_graph_add_output(g, dot_2d(g, g_arg(g, 0), g_arg(g, 1), 1, 0, m, n)));
    char *src = hand_source(g, NULL);
    if (src && m > 1) { /* (one row is a vector's product: its rows fold away) */
        CHECK(strstr(src, "acc_3_1 += b_3 * a_1;") != NULL);
        CHECK(strstr(src, "for (; row0 < hi; row0++) {") != NULL);
        CHECK(strstr(src, "#pragma omp simd reduction") == NULL);
    }
    rfi_free(src);
    check_two_operands(g, dt, m * len, len * n,
                       dt == RF_F64 ? "dot_general column tiles f64"
                                    : "dot_general column tiles f32");
    rfi_graph_free(g);
}

/* An elementwise kernel that reads x [b,c,r] transposed to [b,r,c] (exp(x^T) * w)
 * runs in tiles: the transposed points copied one at a time into an array on
 * the stack, the arithmetic vectorised over it; with a rest of the row (c not
 * a multiple of 8) and, at b = 1, the tiles of the threads' ranges. The values
 * match the interpreter's. */
static void test_transposed_reads(rf_dtype dt, int64_t b, int64_t c, int64_t r)
{
    targ a[2] = {{dt, 3, {b, c, r}}, {dt, 3, {b, r, c}}};
    rfi_graph *g = g_new(a, 2);
    rfi_node *x = g_arg(g, 0);
    rfi_attrs at = {0};
    int64_t perm[] = {0, 2, 1}, tdims[] = {b, r, c};
    set_list(&at, 0, perm, 3);
    rfi_node *t = mk(g, RFI_OP_TRANSPOSE, &x, 1, &at, dt, tdims, 3);
    rfi_node *e = mk(g, RFI_OP_EXP, &t, 1, NULL, dt, tdims, 3);
    CHECK_OK(rfi_graph_add_output(g, bin(g, RFI_OP_MUL, e, g_arg(g, 1))));
    char *src = hand_source(g, NULL);
    if (src) {
        CHECK(strstr(src, "tr_x_0[i") != NULL);
        CHECK((strstr(src, "for (int64_t tb0 = lo; tb0 < hi;") != NULL) == (b == 1));
        char rest[48];
        snprintf(rest, sizeof rest, "const int64_t tb%d = %lld;", b == 1 ? 1 : 2,
                 (long long)(c - c % 8));
        CHECK((strstr(src, rest) != NULL) == (c % 8 != 0));
    }
    rfi_free(src);
    check_two_operands(g, dt, b * c * r, b * r * c,
                       dt == RF_F64 ? "transposed reads f64" : "transposed reads f32");
    rfi_graph_free(g);
}

/* A relu gradient masked per point and scaled by one value per row of 256,
 * select(x > 0, g, 0) * x with g [32,16] broadcast over x [32,16,256], as a
 * loop (reduce_it false) or summed over its first and last axes (a GroupNorm's
 * gradient sums, split in chunks of its first): g's load comes before the
 * innermost loop, where gcc cannot sink it into the select (a conditional load
 * at a fixed address kept the loop scalar). The values match the
 * interpreter's. */
static void test_hoisted_invariants(bool reduce_it)
{
    targ a[2] = {{RF_F32, 3, {32, 16, 256}}, {RF_F32, 2, {32, 16}}};
    rfi_graph *g = g_new(a, 2);
    rfi_node *x = g_arg(g, 0);
    int64_t map[] = {0, 1};
    rfi_node *gb = bcast(g, g_arg(g, 1), map, x->dims, 3);
    rfi_node *zero = bcast(g, scalar(g, RF_F32, 0.0), NULL, x->dims, 3);
    rfi_node *sel_in[3] = {cmp(g, RF_GT, x, zero), gb, zero};
    rfi_node *sel = mk(g, RFI_OP_SELECT, sel_in, 3, NULL, RF_F32, x->dims, 3);
    rfi_node *y = bin(g, RFI_OP_MUL, sel, x);
    int64_t axes[] = {0, 2};
    CHECK_OK(rfi_graph_add_output(g, reduce_it ? reduce(g, y, RF_REDUCE_SUM, axes, 2) : y));
    char *src = hand_source(g, NULL);
    if (src) {
        const char *load = strstr(src, "= p_1[");
        const char *inner = strstr(src, reduce_it ? "#pragma omp simd reduction" : "#pragma omp simd");
        CHECK(load && inner && load < inner);
        CHECK(!reduce_it || strstr(src, "_combine(") != NULL);
    }
    rfi_free(src);
    check_two_operands(g, RF_F32, 32 * 16 * 256, 32 * 16,
                       reduce_it ? "hoisted invariants, sum" : "hoisted invariants");
    rfi_graph_free(g);
}

/* tanh of a nearest-upsampled x ([4,6,20] -> [4,6,40] through a reshape and a
 * broadcast: its index divides the loop variable), times w [4,6,40], as a loop
 * (reduce_it false) or summed over each pair of upsampled points (the
 * interchanged schedule, which gathers w every other point): the gathered
 * loads are copied into an array first, so the loop with its tanh vectorises
 * (the source says so). The values match the interpreter's within the math
 * bound. */
static void test_gathered_math(bool reduce_it)
{
    targ a[2] = {{RF_F32, 3, {4, 6, 20}}, {RF_F32, 3, {4, 6, 40}}};
    rfi_graph *g = g_new(a, 2);
    rfi_node *x = g_arg(g, 0);
    int64_t d4[] = {4, 6, 20, 1}, d4b[] = {4, 6, 20, 2}, d3[] = {4, 6, 40}, map[] = {0, 1, 2, 3};
    rfi_node *r = mk(g, RFI_OP_RESHAPE, &x, 1, NULL, RF_F32, d4, 4);
    rfi_node *b = bcast(g, r, map, d4b, 4);
    rfi_node *up = mk(g, RFI_OP_RESHAPE, &b, 1, NULL, RF_F32, d3, 3);
    rfi_node *t = un(g, RFI_OP_TANH, up);
    rfi_node *y = reduce_it ? bin(g, RFI_OP_MUL, t, g_arg(g, 1)) : t;
    if (reduce_it) {
        rfi_node *pairs = mk(g, RFI_OP_RESHAPE, &y, 1, NULL, RF_F32, d4b, 4);
        int64_t axes[] = {3};
        y = reduce(g, pairs, RF_REDUCE_SUM, axes, 1);
    }
    CHECK_OK(rfi_graph_add_output(g, y));
    char *src = hand_source(g, NULL);
    if (src) {
        CHECK(strstr(src, "float tr_x_") != NULL);
        CHECK(strstr(src, "tanhf(") != NULL);
    }
    rfi_free(src);
    const void *args[2] = {NULL, NULL};
    float xd[4 * 6 * 20], wd[4 * 6 * 40];
    for (int i = 0; i < 4 * 6 * 20; i++)
        xd[i] = (float)((i * 7 % 13) - 6) * 0.25f;
    for (int i = 0; i < 4 * 6 * 40; i++)
        wd[i] = (float)((i * 5 % 11) - 5) * 0.125f;
    args[0] = xd;
    args[1] = wd;
    const char *labels[] = {reduce_it ? "gathered tanh, sum" : "gathered tanh"};
    tol tols[] = {reduce_it ? SUM : ULP4};
    plan_opts o = {0};
    rfi_plan *p = hand_plan(g, &o);
    check_program(g, p, args, labels, tols);
    hand_plan_free(p);
    rfi_graph_free(g);
}

/* An f64 convolution computed as loops (x [batch,5,9,13] by w [6,5,3,3], no
 * padding) runs in register tiles of 4 output features by vectors along the
 * output row, with the feature rows outside the image rows; with a batch of
 * one, whose index folds to 0, the batch's loop merges into the features'
 * (kir.c, coalescing), which the threads then share. Its values match the
 * interpreter's. */
static void test_conv_tiles(int64_t batch)
{
    targ a[2] = {{RF_F64, 4, {batch, 5, 9, 13}}, {RF_F64, 4, {6, 5, 3, 3}}};
    rfi_graph *g = g_new(a, 2);
    rfi_node *in[2] = {g_arg(g, 0), g_arg(g, 1)};
    rfi_attrs at = {0};
    at.i[0] = at.i[1] = 1; /* one feature group, one batch group */
    for (int l = 0; l < 5; l++)
        at.nl[l] = 2;
    for (int d = 0; d < 2; d++) {
        at.l[0][d] = at.l[3][d] = at.l[4][d] = 1; /* strides, dilations */
        at.l[1][d] = at.l[2][d] = 0;               /* padding */
    }
    int64_t dims[4] = {batch, 6, 7, 11};
    CHECK_OK(rfi_graph_add_output(g, mk(g, RFI_OP_CONVOLUTION, in, 2, &at, RF_F64, dims, 4)));
    rfi_kir_module *km = NULL;
    char *src = hand_source(g, &km);
    if (src) {
        CHECK(km->steps[0].kernel->rank == (batch == 1 ? 3 : 4));
        CHECK(strstr(src, batch == 1 ? "for (; row0 + 4 <= hi; row0 += 4) {"
                                     : "for (; row1 + 4 <= 6; row1 += 4) {") != NULL);
        CHECK(strstr(src, batch == 1 ? "col2 = 7;" : "col3 = 7;") != NULL);
        CHECK(strstr(src, "a_0 = *(const rf_tile_f64_mem *)&") != NULL);
    }
    rfi_free(src);
    rfi_kir_free(km);
    check_two_operands(g, RF_F64, batch * 5 * 9 * 13, 6 * 5 * 3 * 3, "convolution tiles f64");
    rfi_graph_free(g);
}

/* A sum over two axes whose innermost is short (13 of 20 points) keeps a partial
 * per column across the outer reduced loop (render_reduce.c, "Row sums"),
 * f32 and f64, within the sum tolerance of the interpreter. */
static void test_row_sums(rf_dtype dt)
{
    targ a[1] = {{dt, 3, {6, 37, 20}}};
    rfi_graph *g = g_new(a, 1);
    rfi_attrs sa = {0}; /* x[:, :, 0:13]: rows 20 apart, not one run */
    sa.nl[0] = sa.nl[1] = sa.nl[2] = 3;
    const int64_t limit[3] = {6, 37, 13};
    for (int d = 0; d < 3; d++) {
        sa.l[1][d] = limit[d];
        sa.l[2][d] = 1;
    }
    rfi_node *x = g_arg(g, 0);
    rfi_node *cols = mk(g, RFI_OP_SLICE, &x, 1, &sa, dt, limit, 3);
    static const int64_t rows_cols[] = {1, 2};
    rfi_node *y = reduce(g, cols, RF_REDUCE_SUM, rows_cols, 2);
    CHECK_OK(rfi_graph_add_output(g, y));
    plan_opts o = {0};
    rfi_plan *p = hand_plan(g, &o);
    rfi_kir_module *km = NULL;
    module mod;
    if (build(p, &mod, &km))
        CHECK(strstr(mod.source, "column_sums[r1] += ") != NULL);
    module_free(&mod);
    rfi_kir_free(km);
    enum { N = 6 * 37 * 20 };
    double v[N];
    float vf[N];
    for (int i = 0; i < N; i++)
        vf[i] = (float)(v[i] = (double)((i * 7919) % 2001 - 1000) * 1e-3);
    const void *args[1] = {dt == RF_F64 ? (const void *)v : (const void *)vf};
    const char *labels[1] = {dt == RF_F64 ? "sum of rows f64 (columns)" : "sum of rows f32 (columns)"};
    const tol tols[1] = {SUM};
    check_program(g, p, args, labels, tols);
    hand_plan_free(p);
    rfi_graph_free(g);
}

/* Row maxima and minima over the last axis (softmax's row max) fold their
 * points in lanes (render_reduce.c, "Lane extremes"), and must keep what the
 * one accumulator keeps: bitwise the interpreter's on rows of random values,
 * of ties, of a zero extreme with both signs (the last one kept) in the
 * lanes or in the tail, of NaNs (the first kept), of infinities only, and
 * with extremes in the tail; f32 and f64, 64 and 67 points per row. */
static void test_lane_extremes(rf_dtype dt, int64_t n)
{
    enum { ROWS = 9 };
    targ a[1] = {{dt, 2, {ROWS, n}}};
    rfi_graph *g = g_new(a, 1);
    rfi_node *x = g_arg(g, 0);
    static const int64_t last[] = {1};
    rfi_node *ys[2] = {reduce(g, x, RF_REDUCE_MAX, last, 1), reduce(g, x, RF_REDUCE_MIN, last, 1)};
    double *v = rfi_malloc((size_t)(ROWS * n) * sizeof *v);
    for (int64_t r = 0; v && r < ROWS; r++)
        for (int64_t i = 0; i < n; i++) {
            double *e = &v[r * n + i];
            *e = (double)((i * 37 + r * 11) % 23 - 11) * 0.25; /* row 0: random */
            if (r == 1) /* ties: the extremes 5 and -5 several times */
                *e = i % 9 == 0 ? 5.0 : i % 9 == 4 ? -5.0 : *e * 0.1;
            if (r == 2 || r == 3) /* zero extremes, signs alternating, the last -0 or +0 */
                *e = i % 5 == 0 ? ((i / 5) % 2 == (r == 2) ? 0.0 : -0.0) : (r == 2 ? -1.0 : 1.0);
            if (r == 4 && (i == 9 || i == 30)) /* two NaNs */
                *e = i == 9 ? NAN : -NAN;
            if (r == 5)
                *e = i % 2 ? INFINITY : -INFINITY;
            if (r == 6 && i >= n - n % 8) /* extremes in the tail */
                *e = i % 2 ? 100.0 : -100.0;
            if (r == 7) /* zeros in the lanes, the other zero in the tail */
                *e = i < n - 2 ? (i % 3 == 0 ? 0.0 : -2.0) : -0.0;
            if (r == 8) /* every point -0 but one +0 */
                *e = i == 40 ? 0.0 : -0.0;
        }
    void *data = rfi_malloc((size_t)(ROWS * n) * rf_dtype_size(dt));
    for (int64_t i = 0; data && v && i < ROWS * n; i++) {
        if (dt == RF_F64)
            ((double *)data)[i] = v[i];
        else
            ((float *)data)[i] = (float)v[i];
    }
    for (int i = 0; i < 2; i++)
        CHECK_OK(rfi_graph_add_output(g, ys[i]));
    plan_opts o = {0};
    rfi_plan *p = hand_plan(g, &o);
    rfi_kir_module *km = NULL;
    module mod;
    if (build(p, &mod, &km))
        CHECK(strstr(mod.source, "lane_nan[l] |= ") != NULL);
    module_free(&mod);
    rfi_kir_free(km);
    const void *args[1] = {data};
    const char *labels[2] = {dt == RF_F64 ? "row max f64 (lanes)" : "row max f32 (lanes)",
                             dt == RF_F64 ? "row min f64 (lanes)" : "row min f32 (lanes)"};
    const tol tols[2] = {BITS, BITS};
    if (data && v)
        check_program(g, p, args, labels, tols);
    hand_plan_free(p);
    rfi_graph_free(g);
    rfi_free(v);
    rfi_free(data);
}

/* Products of RF_PRECISION_BF16 that stay generated loops (a matrix-vector one
 * and a small batched one) round both operands where they load them (or, in
 * the matrix-vector one, with AVX512-BF16 instructions where the CPU has them), to the
 * interpreter's values: the data carries bits below bfloat16's, so a kernel
 * that skipped the rounding would be some 2^-9 off, far outside SUM's 1e-5. */
static void test_dot_bf16(void)
{
    targ a[4] = {{RF_F32, 2, {1, 300}}, {RF_F32, 2, {70, 300}},
                 {RF_F32, 3, {2, 3, 4}}, {RF_F32, 3, {2, 4, 5}}};
    rfi_graph *g = g_new(a, 4);
    rfi_attrs at = {0};
    int64_t one[] = {1};
    set_list(&at, 2, one, 1);
    set_list(&at, 3, one, 1);
    at.i[0] = RF_PRECISION_BF16;
    rfi_node *in[2] = {g_arg(g, 0), g_arg(g, 1)};
    int64_t mv_dims[] = {1, 70};
    rfi_node *mv = mk(g, RFI_OP_DOT_GENERAL, in, 2, &at, RF_F32, mv_dims, 2);
    rfi_attrs bt = {0};
    int64_t batch[] = {0}, lc[] = {2}, rc[] = {1};
    set_list(&bt, 0, batch, 1);
    set_list(&bt, 1, batch, 1);
    set_list(&bt, 2, lc, 1);
    set_list(&bt, 3, rc, 1);
    bt.i[0] = RF_PRECISION_BF16;
    rfi_node *in2[2] = {un(g, RFI_OP_NEG, g_arg(g, 2)), g_arg(g, 3)};
    int64_t small_dims[] = {2, 3, 5};
    rfi_node *small = mk(g, RFI_OP_DOT_GENERAL, in2, 2, &bt, RF_F32, small_dims, 3);
    CHECK(rfi_dot_bf16(mv) && rfi_dot_bf16(small));
    CHECK_OK(rfi_graph_add_output(g, mv));
    CHECK_OK(rfi_graph_add_output(g, small));
    plan_opts o = {0};
    rfi_plan *p = hand_plan(g, &o);
    rfi_kir_module *km = NULL;
    module m;
    if (build(p, &m, &km)) {
        CHECK(strstr(m.source, "static inline float rf_round_bf16(float x)") &&
              strstr(m.source, "= rf_round_bf16(x_"));
        /* the matrix-vector product's 288 points in steps of 32 where the CPU
         * has AVX512-BF16 (render_reduce.c), the last 12 as above */
        CHECK(strstr(m.source, "for (int64_t r0 = 0; r0 < 288; r0 += 32) {") &&
              strstr(m.source, "dot_3 = rf_dpbf16(dot_3, vec, rf_bf16x32(&") &&
              strstr(m.source, "for (int64_t r0 = 288; r0 < 300; r0++) {"));
    }
    module_free(&m);
    rfi_kir_free(km);
    int64_t sizes[4] = {300, 70 * 300, 24, 40};
    float *data[4];
    for (int k = 0; k < 4; k++) {
        data[k] = rfi_malloc((size_t)sizes[k] * sizeof(float));
        for (int64_t i = 0; data[k] && i < sizes[k]; i++)
            data[k][i] = (float)((i * 7 + k) % 9 - 4) * 0.25f + (float)(i % 13) * 0.0007f;
    }
    const void *args[4] = {data[0], data[1], data[2], data[3]};
    const char *labels[] = {"dot_general bf16 matrix-vector", "dot_general bf16 small"};
    tol tols[] = {SUM, SUM};
    if (data[0] && data[1] && data[2] && data[3])
        check_program(g, p, args, labels, tols);
    hand_plan_free(p);
    rfi_graph_free(g);
    for (int k = 0; k < 4; k++)
        rfi_free(data[k]);
}

/* Two roots in one step, the second using the first: the first is computed, not read
 * back; a large shape so parallel_for splits it. */
static void test_multi_root(void)
{
    targ a[2] = {{RF_F32, 2, {300, 200}}, {RF_F32, 1, {200}}};
    rfi_graph *g = g_new(a, 2);
    rfi_node *x = g_arg(g, 0), *b = g_arg(g, 1);
    int64_t map[] = {1};
    rfi_node *bb = bcast(g, b, map, x->dims, 2);
    rfi_node *y1 = bin(g, RFI_OP_MUL, x, bb);
    rfi_node *y2 = bin(g, RFI_OP_MUL, y1, un(g, RFI_OP_EXP, x));
    CHECK_OK(rfi_graph_add_output(g, y1));
    CHECK_OK(rfi_graph_add_output(g, y2));
    plan_opts o = {0};
    rfi_plan *p = hand_plan(g, &o);
    CHECK(p->n_steps == 2);
    merge_steps(p, 0, 1);
    float *xd = rfi_malloc(60000 * sizeof(float)), bd[200];
    for (int i = 0; i < 60000; i++)
        xd[i] = (float)((i % 101) * 0.03 - 1.5);
    for (int i = 0; i < 200; i++)
        bd[i] = (float)(i * 0.01);
    const void *args[2] = {xd, bd};
    const char *labels[] = {"multi-root mul", "multi-root mul(exp)"};
    tol tols[] = {EXACT, ULPS};
    check_program(g, p, args, labels, tols);
    check_planned(g, args, labels, tols);

    rfi_kir_module *km = NULL;
    module m;
    if (build(p, &m, &km)) {
        CHECK(km->n_steps == 1 && km->steps[0].kernel->n_stores == 2);
        CHECK(strstr(m.source, "s->parallel_for(s->rt, 300,") != NULL);
        /* always inlined: gcc stopped inlining rf_exp_f64 once two kernels called it,
         * and their loops ran scalar */
        CHECK(strstr(m.source, "RF_INLINE float rf_exp_f32(float x)\n") != NULL);
        CHECK(strstr(m.source, "#define RF_INLINE static inline "
                               "__attribute__((always_inline))\n") != NULL);
    }
    module_free(&m);
    rfi_kir_free(km);
    hand_plan_free(p);
    rfi_graph_free(g);
    rfi_free(xd);
}

/* A loop of 8192 points runs inline when each point is a few plain ops, and
 * through parallel_for when each is a GELU's gradient (a tanh and two dozen
 * products): a point counts as much as its work (render_c.c, point_cost). */
static void test_costed_parallel(void)
{
    targ a[2] = {{RF_F32, 2, {64, 128}}, {RF_F32, 2, {64, 128}}};
    for (int heavy = 0; heavy < 2; heavy++) {
        rfi_graph *g = g_new(a, 2);
        rfi_node *x = g_arg(g, 0), *d = g_arg(g, 1);
        rfi_node *y = bin(g, RFI_OP_ADD, bin(g, RFI_OP_MUL, x, d), x);
        if (heavy) {
            rfi_node *x3 = bin(g, RFI_OP_MUL, bin(g, RFI_OP_MUL, x, x), x);
            rfi_node *t = un(g, RFI_OP_TANH, bin(g, RFI_OP_ADD, x, x3));
            rfi_node *tt = bin(g, RFI_OP_MUL, t, t);
            for (int k = 0; k < 8; k++)
                y = bin(g, RFI_OP_MUL, bin(g, RFI_OP_SUB, y, tt), bin(g, RFI_OP_ADD, t, d));
        }
        CHECK_OK(rfi_graph_add_output(g, y));
        plan_opts o = {0};
        rfi_plan *p = hand_plan(g, &o);
        float *xd = rfi_malloc(8192 * sizeof(float)), *dd = rfi_malloc(8192 * sizeof(float));
        for (int i = 0; i < 8192; i++) {
            xd[i] = (float)((i % 97) * 0.02 - 1.0);
            dd[i] = (float)((i % 13) * 0.05 - 0.3);
        }
        const void *args[2] = {xd, dd};
        const char *labels[] = {heavy ? "costed gelu-like" : "costed plain"};
        tol tols[] = {ULPS};
        check_program(g, p, args, labels, tols);
        module m;
        if (build(p, &m, NULL))
            CHECK((strstr(m.source, "s->parallel_for(s->rt, 8192,") != NULL) == heavy);
        module_free(&m);
        hand_plan_free(p);
        rfi_graph_free(g);
        rfi_free(xd);
        rfi_free(dd);
    }
}

/* Reductions whose one reader is an elementwise root of their shape compute
 * that root after their fold (REDUCE epilogues, fuse.c), never storing the
 * reduction: against the interpreter, and the plan's form. Reductions with a
 * sibling, with two readers, or that are outputs themselves stay roots. */
static void test_reduce_epilogues(void)
{
    targ a[3] = {{RF_F32, 2, {1, 300}}, {RF_F32, 2, {37, 300}}, {RF_F32, 1, {37}}};
    rfi_graph *g = g_new(a, 3);
    rfi_node *x = g_arg(g, 0), *w = g_arg(g, 1), *b = g_arg(g, 2);
    int64_t row_dims[] = {1, 37}, map1[] = {1}, row[] = {1}, col[] = {0}, all[] = {0, 1};
    int64_t flat[] = {300};
    /* relu(x.w' + b): a matrix-vector product's bias and activation; with a
     * tanh instead (a math function) the activation stays a loop */
    rfi_node *bb = bcast(g, b, map1, row_dims, 2);
    rfi_node *d = dot_2d(g, x, w, 1, 1, 1, 37);
    rfi_node *zero = bcast(g, scalar(g, RF_F32, 0.0), NULL, row_dims, 2);
    rfi_node *y1 = bin(g, RFI_OP_MAX, bin(g, RFI_OP_ADD, d, bb), zero);
    rfi_node *y0 = un(g, RFI_OP_TANH, bin(g, RFI_OP_ADD, dot_2d(g, x, w, 1, 1, 1, 37), bb));
    /* min over w's rows compared with x: a bool result */
    rfi_node *x_flat = mk(g, RFI_OP_RESHAPE, &x, 1, &(rfi_attrs){0}, RF_F32, flat, 1);
    rfi_node *y2 = cmp(g, RF_GT, reduce(g, w, RF_REDUCE_MIN, col, 1), x_flat);
    /* a max over columns read twice by its one reader; one over rows minus b */
    rfi_node *mx = reduce(g, w, RF_REDUCE_MAX, col, 1);
    rfi_node *y3 = bin(g, RFI_OP_MUL, mx, mx);
    rfi_node *y10 = bin(g, RFI_OP_SUB, reduce(g, w, RF_REDUCE_MAX, row, 1), b);
    /* a mean beside another reduction its reader reads (that one stays a root) */
    rfi_node *t = reduce(g, w, RF_REDUCE_SUM, all, 2);
    rfi_node *y4 = bin(g, RFI_OP_ADD, bin(g, RFI_OP_DIV, t, scalar(g, RF_F32, 11100.0)),
                       reduce(g, x, RF_REDUCE_SUM, all, 2));
    /* siblings: two row sums of w fold side by side; their reader stays a loop */
    rfi_node *s1 = reduce(g, w, RF_REDUCE_SUM, row, 1);
    rfi_node *s2 = reduce(g, bin(g, RFI_OP_MUL, w, w), RF_REDUCE_SUM, row, 1);
    rfi_node *y5 = bin(g, RFI_OP_SUB, s2, bin(g, RFI_OP_MUL, s1, s1));
    /* a reduction two roots read, and one that is an output */
    rfi_node *p = reduce(g, w, RF_REDUCE_PROD, row, 1);
    rfi_node *y6 = un(g, RFI_OP_NEG, p), *y7 = un(g, RFI_OP_ABS, p);
    rfi_node *y8 = reduce(g, w, RF_REDUCE_MIN, row, 1);
    rfi_node *y9 = un(g, RFI_OP_EXP, y8);
    rfi_node *ys[] = {y1, y2, y3, y4, y5, y6, y7, y8, y9, y0, y10};
    for (int i = 0; i < 11; i++)
        CHECK_OK(rfi_graph_add_output(g, ys[i]));

    rfi_plan_opts o = rfi_plan_opts_default();
    o.matmul_call_min_flops = INT64_MAX;
    o.reduce_epilogues = true;
    o.sibling_reductions = true;
    rfi_plan *pl = NULL;
    CHECK_OK(rfi_plan_build(g, &o, &pl));
    int epilogues = 0, siblings = 0;
    for (int q = 0; pl && q < pl->n_steps; q++) {
        const rfi_step *st = &pl->steps[q];
        if (st->kind != RFI_STEP_REDUCE)
            continue;
        bool epi = st->core != st->roots[0];
        epilogues += epi;
        siblings += st->n_roots == 2 && st->roots[0] == s1->id && st->roots[1] == s2->id;
        if (epi) /* the reduction has no buffer */
            CHECK(pl->loc[st->core].kind == RFI_LOC_INLINE && st->n_roots == 1);
    }
    CHECK(epilogues == 5 && siblings == 1);
    CHECK(pl && pl->loc[y0->in[0]->in[0]->id].kind != RFI_LOC_INLINE); /* the tanh's dot */
    CHECK(pl && pl->loc[p->id].kind != RFI_LOC_INLINE && pl->loc[y8->id].kind != RFI_LOC_INLINE);
    rfi_plan_free(pl);

    float xd[300], wd[37 * 300], bd[37];
    for (int i = 0; i < 300; i++)
        xd[i] = (float)((i * 7 % 13) - 6) * 0.1f;
    for (int i = 0; i < 37 * 300; i++)
        wd[i] = i % 301 == 5 ? -0.0f : (float)((i * 11 % 17) - 8) * 0.0625f + 1.0f / 64;
    wd[4000] = NAN;
    for (int i = 0; i < 37; i++)
        bd[i] = (float)(i % 5) - 2.0f;
    const void *args[3] = {xd, wd, bd};
    const char *labels[] = {"epilogue relu(dot + b)", "epilogue min > x", "epilogue max * max",
                            "epilogue sum / n + sum", "siblings s2 - s1^2",
                            "two readers -prod", "two readers |prod|", "output min",
                            "exp(output min)", "tanh(dot + b) as a loop",
                            "epilogue max - b"};
    tol tols[] = {SUM, EXACT, BITS, SUM, SUM, SUM, SUM, BITS, ULPS, SUM, BITS};
    check_planned(g, args, labels, tols);
    rfi_graph_free(g);
}

/* Updates: SGD written in place into its capture, Adam-style moments in one step (in place),
 * and the same program with updates computed into the arena and copied. */
static void test_updates(bool in_place)
{
    enum { N = 1000 };
    targ a = {RF_F32, 1, {N}};
    rfi_graph *g = g_new(&a, 1);
    float w0[N], m0[N], gd[N];
    for (int i = 0; i < N; i++) {
        w0[i] = (float)(i * 0.001);
        m0[i] = (float)((i % 13) * 0.1);
        gd[i] = (float)((i % 7) - 3) * 0.5f;
    }
    int64_t dims[] = {N};
    rfi_node *w = g_capture(g, RF_F32, dims, 1, w0);
    rfi_node *m = g_capture(g, RF_F32, dims, 1, m0);
    rfi_node *gr = g_arg(g, 0);
    int64_t nomap[1] = {0};
    rfi_node *lr = bcast(g, scalar(g, RF_F32, 0.1), nomap, dims, 1);
    rfi_node *beta = bcast(g, scalar(g, RF_F32, 0.9), nomap, dims, 1);
    rfi_node *m_new = bin(g, RFI_OP_ADD, bin(g, RFI_OP_MUL, beta, m), gr);
    rfi_node *w_new = bin(g, RFI_OP_SUB, w, bin(g, RFI_OP_MUL, lr, m_new));
    int64_t axes[] = {0};
    rfi_node *loss = reduce(g, bin(g, RFI_OP_MUL, gr, gr), RF_REDUCE_SUM, axes, 1);
    CHECK_OK(rfi_graph_add_output(g, loss));
    CHECK_OK(rfi_graph_add_update(g, 0, w_new));
    CHECK_OK(rfi_graph_add_update(g, 1, m_new));
    plan_opts o = {NULL, 0, in_place};
    rfi_plan *p = hand_plan(g, &o);
    if (in_place) { /* m_new and w_new in one step: w_new recomputes m_new */
        int sm = -1, sw = -1;
        for (int s = 0; s < p->n_steps; s++) {
            if (p->steps[s].roots[0] == m_new->id)
                sm = s;
            if (p->steps[s].roots[0] == w_new->id)
                sw = s;
        }
        CHECK(sm >= 0 && sw > sm);
        if (sm >= 0 && sw > sm)
            merge_steps(p, sm, sw);
    }
    const void *args[1] = {gd};
    const char *labels[] = {in_place ? "loss (in place)" : "loss (copied)",
                            in_place ? "sgd update in place" : "sgd update copied",
                            in_place ? "momentum in place" : "momentum copied"};
    tol tols[] = {SUM, EXACT, EXACT};
    check_program(g, p, args, labels, tols);
    hand_plan_free(p);
    if (in_place)
        check_planned(g, args, labels, tols);
    rfi_graph_free(g);
}

/* Gather inline (clamped indices), fused with an add; a non-splat constant operand. */
static void test_gather(void)
{
    targ a[2] = {{RF_F32, 2, {5, 3}}, {RF_I32, 1, {6}}};
    rfi_graph *g = g_new(a, 2);
    rfi_node *x = g_arg(g, 0), *ind = g_arg(g, 1);
    rfi_attrs at = {0};
    at.i[0] = 0;
    int64_t dims[] = {6, 3};
    rfi_node *in[2] = {x, ind};
    rfi_node *ga = mk(g, RFI_OP_GATHER, in, 2, &at, RF_F32, dims, 2);
    float cd[18];
    for (int i = 0; i < 18; i++)
        cd[i] = (float)i * 0.25f;
    rfi_node *c = constant(g, RF_F32, dims, 2, cd);
    rfi_node *y = bin(g, RFI_OP_ADD, ga, c);
    float xd[15];
    for (int i = 0; i < 15; i++)
        xd[i] = (float)(i * i) - 7.0f;
    int32_t id[6] = {4, 0, -3, 9, 2, 2};
    const void *args[2] = {xd, id};
    const char *labels[] = {"gather + constant"};
    tol tols[] = {EXACT};
    check_outputs(g, &y, 1, args, labels, tols);
    rfi_graph_free(g);
}

/* Bool and u8 values are held in ints (render_c.c, value_ctype: gcc vectorises
 * no loop converting a uint8_t temporary to float): a one-hot from a
 * comparison and u8 pixels, both converted to f32 and added, declare no
 * uint8_t temporary, and match the interpreter exactly. */
static void test_small_int_values(void)
{
    targ a[2] = {{RF_F32, 2, {16, 40}}, {RF_U8, 2, {16, 40}}};
    rfi_graph *g = g_new(a, 2);
    rfi_node *x = g_arg(g, 0), *px = g_arg(g, 1);
    int64_t none[1] = {0};
    rfi_node *half = bcast(g, scalar(g, RF_F32, 0.5), none, x->dims, 2);
    rfi_node *hot = cvt(g, cmp(g, RF_GT, x, half), RF_F32);
    rfi_node *y = bin(g, RFI_OP_ADD, bin(g, RFI_OP_ADD, hot, cvt(g, px, RF_F32)), x);
    CHECK_OK(rfi_graph_add_output(g, y));
    char *src = hand_source(g, NULL);
    if (src) {
        CHECK(strstr(src, "const uint8_t x_") == NULL);
        CHECK(strstr(src, "const int x_") != NULL);
    }
    rfi_free(src);
    float xd[640];
    uint8_t pd[640];
    for (int i = 0; i < 640; i++) {
        xd[i] = (float)((i * 7) % 13) * 0.125f;
        pd[i] = (uint8_t)(i * 37);
    }
    const void *args[2] = {xd, pd};
    const char *labels[] = {"bool and u8 values as ints"};
    tol tols[] = {EXACT};
    plan_opts o = {0};
    rfi_plan *p = hand_plan(g, &o);
    check_program(g, p, args, labels, tols);
    hand_plan_free(p);
    rfi_graph_free(g);
}

/* Structure: CSE, flat loops, comments, names, pragmas, the call step's failure code. */
static void test_structure(void)
{
    targ a[2] = {{RF_F32, 2, {16, 8}}, {RF_F32, 1, {8}}};
    rfi_graph *g = g_new(a, 2);
    rfi_node *x = g_arg(g, 0), *b = g_arg(g, 1);
    rfi_node *e = un(g, RFI_OP_EXP, x);
    rfi_node *y = bin(g, RFI_OP_ADD, bin(g, RFI_OP_MUL, e, e), e); /* exp shared */
    int64_t map[] = {1};
    rfi_node *z = bin(g, RFI_OP_ADD, x, bcast(g, b, map, x->dims, 2));
    rfi_node *w = un(g, RFI_OP_NEG, x);
    CHECK_OK(rfi_graph_add_output(g, y));
    CHECK_OK(rfi_graph_add_output(g, z));
    CHECK_OK(rfi_graph_add_output(g, w));
    plan_opts o = {0};
    rfi_plan *p = hand_plan(g, &o);
    p->steps[2].kind = RFI_STEP_CALL; /* the neg through the runtime */
    p->steps[2].call = RFI_CALL_FALLBACK;
    rfi_kir_module *km = NULL;
    module m;
    if (build(p, &m, &km)) {
        CHECK(km->n_steps == 3);
        const rfi_kir_kernel *k0 = km->steps[0].kernel, *k1 = km->steps[1].kernel;
        CHECK(k0->rank == 1 && k0->dims[0] == 128); /* flat */
        CHECK(k1->rank == 2);                         /* broadcast needs the shape */
        int n_exp = 0;
        for (int i = 0; i < k0->n_ins; i++)
            n_exp += k0->ins[i].op == RFI_KIR_UNARY && k0->ins[i].ir_op == RFI_OP_EXP;
        CHECK(n_exp == 1);
        CHECK(km->steps[2].kind == RFI_KIR_STEP_CALL);
        char want[64];
        snprintf(want, sizeof want, "/* step 0: loop\n *   %%%d = add(%%", y->id);
        CHECK(strstr(m.source, want) != NULL);
        snprintf(want, sizeof want, "const float x_%d = rf_exp_f32(", e->id);
        CHECK(strstr(m.source, want) != NULL);
        CHECK(strstr(m.source, "RF_KERNEL RF_LANES16 void k0_add(void *ctx, int64_t lo, "
                               "int64_t hi)\n{") != NULL); /* exp: 512-bit vectors */
        CHECK(strstr(m.source, "#pragma omp simd\n") != NULL);
        CHECK(strstr(m.source, "if (s->call(s->rt, 2, bufs))\n        return 3;") != NULL);
        CHECK(strstr(m.source, "const float *restrict p_") != NULL);
        char *text = rfi_kir_print(km);
        CHECK(text && strstr(text, "step 0: kernel add over [128]") != NULL);
        rfi_free(text);
        float xd[128], bd[8] = {0}, o0[128], o1[128], o2[128];
        for (int i = 0; i < 128; i++)
            xd[i] = (float)i * 0.01f;
        void *bufs[6] = {xd, bd, o0, o1, o2, NULL};
        rf_module_services s = {RF_MODULE_ABI, NULL, serial_for, failing_call, NULL, NULL};
        CHECK(m.entry(&s, bufs) == 3); /* the failing call reports step 2 + 1 */
        CHECK(o1[5] == xd[5]);
    }
    module_free(&m);
    rfi_kir_free(km);
    hand_plan_free(p);
    rfi_graph_free(g);
}

/* Coalescing: a per-channel expression over [4,6,5,7] loops over [4,6,35] (the
 * two spatial loops merge; the channel loop cannot), and its sum over axes
 * 0, 2, 3 reduces over [4,35]. With a batch of one (its index folds to 0)
 * the batch's loop merges: [6,35], the sum over [35]. The values match the
 * interpreter. */
static void test_coalesce(int64_t batch)
{
    targ a[2] = {{RF_F32, 4, {batch, 6, 5, 7}}, {RF_F32, 1, {6}}};
    rfi_graph *g = g_new(a, 2);
    rfi_node *x = g_arg(g, 0), *b = g_arg(g, 1);
    int64_t map[] = {1};
    rfi_node *z = bin(g, RFI_OP_MUL, x, bcast(g, b, map, x->dims, 4));
    static const int64_t axes[] = {0, 2, 3};
    rfi_node *r = reduce(g, z, RF_REDUCE_SUM, axes, 3);
    CHECK_OK(rfi_graph_add_output(g, z));
    CHECK_OK(rfi_graph_add_output(g, r));
    plan_opts o = {0};
    rfi_plan *p = hand_plan(g, &o);
    rfi_kir_module *km = NULL;
    module m;
    if (build(p, &m, &km)) {
        CHECK(km->n_steps == 2);
        const rfi_kir_kernel *k0 = km->steps[0].kernel, *k1 = km->steps[1].kernel;
        if (batch == 1) {
            CHECK(k0->rank == 2 && k0->dims[0] == 6 && k0->dims[1] == 35);
            CHECK(k1->red_rank == 1 && k1->red_dims[0] == 35);
        } else {
            CHECK(k0->rank == 3 && k0->dims[0] == batch && k0->dims[1] == 6 &&
                  k0->dims[2] == 35);
            CHECK(k1->red_rank == 2 && k1->red_dims[0] == batch && k1->red_dims[1] == 35);
        }
        CHECK(k1->rank == 1 && k1->dims[0] == 6);
    }
    module_free(&m);
    rfi_kir_free(km);
    hand_plan_free(p);
    float xd[840], bd[6]; /* batch <= 4 */
    for (int i = 0; i < 840; i++)
        xd[i] = (float)((i * 13 % 17) - 8) * 0.125f;
    for (int i = 0; i < 6; i++)
        bd[i] = 0.5f + (float)i;
    rfi_node *ys[2] = {z, r}; /* outputs 2 and 3, after the two above */
    const void *args[2] = {xd, bd};
    const char *labels[] = {"coalesced loop", "coalesced reduce", "coalesced loop",
                            "coalesced reduce"};
    tol tols[] = {EXACT, SUM, EXACT, SUM};
    check_outputs(g, ys, 2, args, labels, tols);
    rfi_graph_free(g);
}

/* Whether kernel k's function in the module source contains `needle`. */
static bool kernel_has(const char *source, const rfi_kir_kernel *k, const char *needle)
{
    char head[160];
    snprintf(head, sizeof head, " void k%d_%s(void *ctx, int64_t lo, int64_t hi)\n{", k->step,
             k->name); /* after RF_KERNEL and any attributes */
    const char *at = strstr(source, head);
    const char *end = at ? strstr(at, "\n}\n") : NULL;
    const char *hit = at ? strstr(at, needle) : NULL;
    return hit && (!end || hit < end);
}

/* The kernel of km that stores node `root` (the last one: the interior or the
 * upper edge of a padded window), or NULL. */
static const rfi_kir_kernel *kernel_of(const rfi_kir_module *km, const rfi_node *root)
{
    const rfi_kir_kernel *found = NULL;
    for (int s = 0; s < km->n_steps; s++) {
        const rfi_kir_kernel *k = km->steps[s].kernel;
        if (k && k->n_stores > 0 && k->stores[0].node == root->id &&
            (!found || !strstr(found->name, "_interior")))
            found = k;
    }
    return found;
}

/* The number of kernels of km that store node `root`. */
static int kernels_of(const rfi_kir_module *km, const rfi_node *root)
{
    int n = 0;
    for (int s = 0; s < km->n_steps; s++) {
        const rfi_kir_kernel *k = km->steps[s].kernel;
        n += k && k->n_stores > 0 && k->stores[0].node == root->id;
    }
    return n;
}

/* PRESUM: split, adding blocks of f32 values in f32 before the double fold. */
typedef enum form { PLAIN, INTERCHANGED, SPLIT, PRESUM, UNROLLED } form;

/* Checks which loop form the renderer chose for each root (in a hand plan):
 * for a padded window, its interior's; pieces[i]: the kernels root i takes
 * (NULL: one each); and, with a needle, whether root i's kernel holds it
 * (has[i]). */
static void check_forms_with(rfi_graph *g, rfi_node *const *ys, const form *forms,
                             const int *pieces, int n, const char *needle, const bool *has)
{
    plan_opts o = {0};
    rfi_plan *p = hand_plan(g, &o);
    rfi_kir_module *km = NULL;
    module m;
    if (build(p, &m, &km)) {
        for (int i = 0; i < n; i++) {
            const rfi_kir_kernel *k = kernel_of(km, ys[i]);
            CHECK(k != NULL);
            if (!k)
                continue;
            CHECK(kernels_of(km, ys[i]) == (pieces ? pieces[i] : 1));
            bool split = kernel_has(m.source, k, "c->part");
            bool interchanged = !split && kernel_has(m.source, k, "accs[");
            bool presum = split && kernel_has(m.source, k, "ps0 += ");
            form got = !k->is_reduce ? UNROLLED
                       : presum      ? PRESUM
                       : split       ? SPLIT
                       : interchanged ? INTERCHANGED
                                      : PLAIN;
            if (got != forms[i])
                fprintf(stderr, "root %%%d (k%d_%s): form %d, want %d\n", ys[i]->id, k->step,
                        k->name, (int)got, (int)forms[i]);
            CHECK(got == forms[i]);
            /* the block loop is unrolled by request: left to gcc's size limits, a
             * large block body stayed a loop and the kept loop around it scalar */
            if (got == PRESUM)
                CHECK(kernel_has(m.source, k, "#pragma GCC unroll 4"));
            if (needle)
                CHECK(kernel_has(m.source, k, needle) == has[i]);
        }
    }
    module_free(&m);
    rfi_kir_free(km);
    hand_plan_free(p);
}

static void check_forms(rfi_graph *g, rfi_node *const *ys, const form *forms, const int *pieces,
                        int n)
{
    check_forms_with(g, ys, forms, pieces, n, NULL, NULL);
}

/* Split reductions: reductions whose outermost reduced loop is outermost in
 * memory (BatchNorm statistics, a bias gradient, sums to a scalar) fold chunks
 * of it into partial accumulators, combined in chunk order. Every form of the
 * split body (kept loops around the inner reduced loops, the kept axis
 * innermost, no kept loop; two kept loops; chunks that do not divide the loop)
 * against the interpreter: sums within the sum tolerance, max and min bit for
 * bit (NaN, and which of -0 and +0 is kept), integer sums and products exactly.
 * Float products are never split. */
static void test_split_reductions(void)
{
    targ a[4] = {{RF_F32, 4, {24, 3, 20, 25}}, {RF_F32, 1, {3}}, {RF_F32, 2, {2000, 20}},
                 {RF_I32, 4, {24, 3, 20, 25}}};
    rfi_graph *g = g_new(a, 4);
    rfi_node *x = g_arg(g, 0), *mean = g_arg(g, 1), *rows = g_arg(g, 2), *xi = g_arg(g, 3);
    int64_t map[] = {1};
    rfi_node *d = bin(g, RFI_OP_SUB, x, bcast(g, mean, map, x->dims, 4));
    rfi_node *sq = bin(g, RFI_OP_MUL, d, d);
    static const int64_t nchw[] = {0, 2, 3}, nh[] = {0, 2}, all[] = {0, 1, 2, 3}, n[] = {0};
    rfi_node *milli = bcast(g, scalar(g, RF_F32, 1e-3), NULL, x->dims, 4);
    rfi_node *one = bcast(g, scalar(g, RF_F32, 1.0), NULL, x->dims, 4);
    rfi_node *near_one = bin(g, RFI_OP_ADD, bin(g, RFI_OP_MUL, x, milli), one);
    rfi_node *ys[] = {
        reduce(g, sq, RF_REDUCE_SUM, nchw, 3),          /* kept outer, chunks of 24 / 16 */
        reduce(g, x, RF_REDUCE_MAX, nchw, 3),
        reduce(g, x, RF_REDUCE_MIN, nchw, 3),
        reduce(g, x, RF_REDUCE_SUM, nh, 2),             /* two kept loops [3, 25] */
        reduce(g, x, RF_REDUCE_SUM, all, 4),            /* a scalar */
        reduce(g, rows, RF_REDUCE_SUM, n, 1),           /* a bias gradient: kept innermost */
        reduce(g, rows, RF_REDUCE_MAX, n, 1),
        reduce(g, xi, RF_REDUCE_SUM, nchw, 3),          /* wrapping integers */
        reduce(g, xi, RF_REDUCE_PROD, nchw, 3),
        reduce(g, near_one, RF_REDUCE_PROD, nchw, 3),   /* float product: not split */
    };
    enum { N = sizeof ys / sizeof ys[0] };
    /* f32 sums pre-add in blocks where the kept axis is innermost (two kept
     * axes, a bias gradient), not with the kept loops outside (NCHW's channel)
     * or without a kept loop (a scalar) */
    const form forms[N] = {SPLIT, SPLIT, SPLIT, PRESUM, SPLIT, PRESUM, SPLIT, SPLIT, SPLIT, PLAIN};
    const char *labels[N] = {"split sum of squares", "split max", "split min",
                             "split sum two kept", "split sum scalar", "split bias sum",
                             "split bias max", "split i32 sum", "split i32 prod",
                             "unsplit f32 prod"};
    const tol tols[N] = {SUM, BITS, BITS, SUM, SUM, SUM, BITS, EXACT, EXACT, SUM};
    check_forms(g, ys, forms, NULL, N);
    float *xd = rfi_malloc(36000 * sizeof *xd), md[3] = {0.25f, -0.5f, 0.0f};
    float *rd = rfi_malloc(40000 * sizeof *rd);
    int32_t *id = rfi_malloc(36000 * sizeof *id);
    for (int i = 0; i < 36000; i++) {
        int c = i / 500 % 3;
        float v = (float)((i * 7919 % 2001) - 1000) * 1e-3f;
        if (c == 2) /* channel 2: at most zero, zeros of both signs reach the max */
            v = i % 7 == 0 ? (i % 14 == 0 ? -0.0f : 0.0f) : -fabsf(v) - 1e-3f;
        xd[i] = c == 1 && i % 4999 == 17 ? NAN : v;
        id[i] = (int32_t)(((uint32_t)i * 2654435761u) >> 1) | 1; /* odd: products never 0 */
    }
    for (int i = 0; i < 40000; i++)
        rd[i] = i % 20 == 3 ? (i % 40 == 3 ? 0.0f : -0.0f) : (float)((i * 31 % 97) - 48) * 0.01f;
    rd[12345] = NAN;
    const void *args[4] = {xd, md, rd, id};
    also_planned = true;
    check_outputs(g, ys, N, args, labels, tols);
    also_planned = false;
    rfi_graph_free(g);
    rfi_free(xd);
    rfi_free(rd);
    rfi_free(id);
}

/* Split sums of f64 values (f64 data, or f32 data converted and squared in
 * f64: BatchNorm's statistics in one pass) add their blocks of PRESUM values
 * in double, not f32: within 1e-12 of the interpreter's double fold, where
 * f32 blocks would lose the low bits of data f32 cannot hold. Through the
 * planner too, whose sibling sums put an f32 value's sum beside them. */
static void test_split_f64_sums(void)
{
    targ a[2] = {{RF_F64, 2, {2000, 20}}, {RF_F32, 2, {2000, 20}}};
    rfi_graph *g = g_new(a, 2);
    rfi_node *x = g_arg(g, 0), *r = cvt(g, g_arg(g, 1), RF_F64);
    static const int64_t n[] = {0};
    rfi_node *ys[] = {
        reduce(g, x, RF_REDUCE_SUM, n, 1),
        reduce(g, bin(g, RFI_OP_MUL, x, x), RF_REDUCE_SUM, n, 1),
        reduce(g, r, RF_REDUCE_SUM, n, 1),
        reduce(g, bin(g, RFI_OP_MUL, r, r), RF_REDUCE_SUM, n, 1),
    };
    enum { N = sizeof ys / sizeof ys[0] };
    const form forms[N] = {PRESUM, PRESUM, PRESUM, PRESUM};
    const bool in_double[N] = {true, true, false, true}; /* the converted f32 values: in f32 */
    check_forms_with(g, ys, forms, NULL, N, "double ps0 = 0.0;", in_double);
    double *xd = rfi_malloc(40000 * sizeof *xd);
    float *rd = rfi_malloc(40000 * sizeof *rd);
    for (int i = 0; i < 40000; i++) {
        xd[i] = 1.0 + (double)(i % 977) * 1e-12 - (double)(i % 13) * 0.25;
        rd[i] = (float)((i * 31 % 97) - 48) * 0.01f + 3.0f;
    }
    const void *args[2] = {xd, rd};
    const char *labels[N] = {"split f64 sum", "split f64 sum of squares", "split f32->f64 sum",
                             "split f32->f64 sum of squares"};
    const tol tols[N] = {SUM64, SUM64, SUM, SUM64};
    also_planned = true;
    check_outputs(g, ys, N, args, labels, tols);
    also_planned = false;
    rfi_graph_free(g);
    rfi_free(xd);
    rfi_free(rd);
}

/* The kernel of km whose stores include node `root`, or NULL. */
static const rfi_kir_kernel *kernel_storing(const rfi_kir_module *km, const rfi_node *root)
{
    for (int s = 0; s < km->n_steps; s++) {
        const rfi_kir_kernel *k = km->steps[s].kernel;
        for (int t = 0; k && t < k->n_stores; t++)
            if (k->stores[t].node == root->id)
                return k;
    }
    return NULL;
}

/* Sibling reductions (fuse.c, kir.h): the planner joins reductions of one kind
 * over one operand shape and axes that share an input into one REDUCE step,
 * which folds them side by side (acc, acc1, ...) in one pass: BatchNorm's
 * backward sums (split form, kept outside the inner loops), sums over two
 * kept axes, sums to a scalar, and row sums (plain form; apart, each row sum
 * takes the unrolled form, whose tail loop must compile under -Werror once
 * inlined with constant bounds). A max beside sums,
 * a sum over other axes and a sum that reads another's result stay apart.
 * Against the interpreter, within the sum tolerance; with the option off,
 * every reduction is a step of its own. */
static void test_sibling_reductions(void)
{
    targ a[4] = {{RF_F32, 4, {24, 3, 20, 25}}, {RF_F32, 4, {24, 3, 20, 25}}, {RF_F32, 1, {3}},
                 {RF_F32, 2, {200, 50}}};
    rfi_graph *g = g_new(a, 4);
    rfi_node *x = g_arg(g, 0), *dy = g_arg(g, 1), *mean = g_arg(g, 2), *rows = g_arg(g, 3);
    int64_t map[] = {1};
    rfi_node *xc = bin(g, RFI_OP_SUB, x, bcast(g, mean, map, x->dims, 4));
    static const int64_t nchw[] = {0, 2, 3}, nh[] = {0, 2}, all[] = {0, 1, 2, 3}, last[] = {1};
    rfi_node *sum_dy = reduce(g, dy, RF_REDUCE_SUM, nchw, 3);
    rfi_node *shifted = bin(g, RFI_OP_SUB, dy, bcast(g, sum_dy, map, x->dims, 4));
    /* each product its own node: one used by several steps would be materialised */
    rfi_node *ys[] = {
        sum_dy,                                                     /* 0-2: one split step */
        reduce(g, bin(g, RFI_OP_MUL, dy, xc), RF_REDUCE_SUM, nchw, 3),
        reduce(g, un(g, RFI_OP_NEG, bin(g, RFI_OP_MUL, dy, x)), RF_REDUCE_SUM, nchw, 3),
        reduce(g, dy, RF_REDUCE_MAX, nchw, 3),                      /* another kind */
        reduce(g, shifted, RF_REDUCE_SUM, nchw, 3),                 /* reads sum_dy */
        reduce(g, dy, RF_REDUCE_SUM, nh, 2),                        /* 5-6: two kept axes */
        reduce(g, bin(g, RFI_OP_MUL, dy, x), RF_REDUCE_SUM, nh, 2),
        reduce(g, dy, RF_REDUCE_SUM, all, 4),                       /* 7-8: scalars */
        reduce(g, bin(g, RFI_OP_MUL, dy, x), RF_REDUCE_SUM, all, 4),
        reduce(g, rows, RF_REDUCE_SUM, last, 1),                    /* 9-10: plain rows */
        reduce(g, bin(g, RFI_OP_MUL, rows, rows), RF_REDUCE_SUM, last, 1),
    };
    enum { N = sizeof ys / sizeof ys[0] };
    for (int i = 0; i < N; i++)
        CHECK_OK(rfi_graph_add_output(g, ys[i]));
    const int step_of[N] = {0, 0, 0, 1, 2, 3, 3, 4, 4, 5, 5}; /* ys in one step share a group */
    const char *labels[N] = {"sum dy", "sum dy*xc", "sum -dy*x", "max dy", "sum dy - sum",
                             "nh sum dy", "nh sum dy*x", "scalar dy", "scalar dy*x",
                             "row sum", "row sum of squares"};
    const tol tols[N] = {SUM, SUM, SUM, BITS, SUM, SUM, SUM, SUM, SUM, SUM, SUM};
    float *xd = rfi_malloc(36000 * sizeof *xd), *dyd = rfi_malloc(36000 * sizeof *dyd);
    float *rd = rfi_malloc(10000 * sizeof *rd), md[3] = {0.25f, -0.5f, 0.0f};
    for (int i = 0; i < 36000; i++) {
        xd[i] = (float)((i * 7919 % 2001) - 1000) * 1e-3f;
        dyd[i] = (float)((i * 7907 % 1999) - 999) * 1e-3f;
    }
    for (int i = 0; i < 10000; i++)
        rd[i] = (float)((i * 31 % 97) - 48) * 0.01f;
    const void *args[4] = {xd, dyd, md, rd};
    rfi_plan_opts o = rfi_plan_opts_default();
    o.matmul_call_min_flops = INT64_MAX;
    o.sibling_reductions = false;
    rfi_plan *apart = NULL, *p = NULL;
    CHECK_OK(rfi_plan_build(g, &o, &apart));
    CHECK(apart && rfi_plan_count(apart, RFI_STEP_REDUCE) == N);
    o.sibling_reductions = true;
    CHECK_OK(rfi_plan_build(g, &o, &p));
    CHECK(p && rfi_plan_count(p, RFI_STEP_REDUCE) == 6);

    rfi_kir_module *km = NULL;
    module m;
    if (p && build(p, &m, &km)) {
        const rfi_kir_kernel *ks[N];
        for (int i = 0; i < N; i++) {
            ks[i] = kernel_storing(km, ys[i]);
            CHECK(ks[i] != NULL);
        }
        for (int i = 0; i < N; i++)
            for (int j = 0; j < N && ks[i] && ks[j]; j++)
                CHECK((ks[i] == ks[j]) == (step_of[i] == step_of[j]));
        if (ks[0] && ks[5] && ks[7] && ks[9]) {
            CHECK(ks[0]->n_folds == 3 && ks[5]->n_folds == 2 && ks[9]->n_folds == 2);
            CHECK(kernel_has(m.source, ks[0], "accs2[")); /* split, kept outer */
            CHECK(kernel_has(m.source, ks[5], "accs1["));
            CHECK(kernel_has(m.source, ks[7], "c->part[q * 2 + 1] = acc1;")); /* scalars */
            CHECK(kernel_has(m.source, ks[9], "reduction(+:acc, acc1)")); /* plain */
        }
        module_free(&m);
    }
    rfi_kir_free(km);
    if (p)
        check_program(g, p, args, labels, tols);
    if (apart)
        check_program(g, apart, args, labels, tols);
    rfi_plan_free(p);
    rfi_plan_free(apart);
    rfi_graph_free(g);
    rfi_free(xd);
    rfi_free(dyd);
    rfi_free(rd);
}

/* Sibling sums over the leading axis (LayerNorm's scale and shift gradients)
 * split from 4096 points on, though below the parallel size: [128,256] is
 * split, [16,64] stays plain. Against the interpreter. */
static void test_small_sibling_split(void)
{
    static const int64_t rows[] = {0};
    const int64_t shapes[2][2] = {{128, 256}, {16, 64}};
    for (int big = 0; big < 2; big++) {
        const int64_t *d = shapes[!big];
        targ a[2] = {{RF_F32, 2, {d[0], d[1]}}, {RF_F32, 2, {d[0], d[1]}}};
        rfi_graph *g = g_new(a, 2);
        rfi_node *x = g_arg(g, 0), *dy = g_arg(g, 1);
        rfi_node *ys[2] = {reduce(g, dy, RF_REDUCE_SUM, rows, 1),
                           reduce(g, bin(g, RFI_OP_MUL, dy, x), RF_REDUCE_SUM, rows, 1)};
        for (int i = 0; i < 2; i++)
            CHECK_OK(rfi_graph_add_output(g, ys[i]));
        int64_t n = d[0] * d[1];
        float *xd = rfi_malloc((size_t)n * sizeof *xd), *dyd = rfi_malloc((size_t)n * sizeof *dyd);
        for (int64_t i = 0; i < n; i++) {
            xd[i] = (float)((i * 7919 % 2001) - 1000) * 1e-3f;
            dyd[i] = (float)((i * 7907 % 1999) - 999) * 1e-3f;
        }
        const void *args[2] = {xd, dyd};
        const char *labels[2] = {big ? "split sum dy" : "plain sum dy",
                                 big ? "split sum dy*x" : "plain sum dy*x"};
        const tol tols[2] = {SUM, SUM};
        rfi_plan_opts o = rfi_plan_opts_default();
        o.matmul_call_min_flops = INT64_MAX;
        rfi_plan *p = NULL;
        CHECK_OK(rfi_plan_build(g, &o, &p));
        rfi_kir_module *km = NULL;
        module m;
        if (p && build(p, &m, &km)) {
            const rfi_kir_kernel *k = kernel_storing(km, ys[0]);
            CHECK(k && k == kernel_storing(km, ys[1]) && k->n_folds == 2);
            if (k) {
                CHECK(kernel_has(m.source, k, "accs1[") == big);
                CHECK(kernel_has(m.source, k, "reduction(+:acc, acc1)") == !big);
            }
            module_free(&m);
        }
        rfi_kir_free(km);
        if (p)
            check_program(g, p, args, labels, tols);
        rfi_plan_free(p);
        rfi_graph_free(g);
        rfi_free(xd);
        rfi_free(dyd);
    }
}

/* Shared functions (render_c.c) and rebased offsets (rfi_kir_rebase): 36
 * kernels, each exp(x[i : i + len]) * 2 + 1 for its own i, read x through a
 * base moved up by i elements and run the first one's function; one with
 * tanh instead, and one that reads x at two offsets (no single offset to take
 * out), have functions of their own. A module whose kernels iterate over
 * fewer than 2^16 points in all keeps one function per kernel. Against the
 * interpreter. */
static rfi_node *slice_1d(rfi_graph *g, rfi_node *x, int64_t start, int64_t len)
{
    rfi_attrs a = {0};
    int64_t lo[] = {start}, hi[] = {start + len}, stride[] = {1}, dims[] = {len};
    set_list(&a, 0, lo, 1);
    set_list(&a, 1, hi, 1);
    set_list(&a, 2, stride, 1);
    return mk(g, RFI_OP_SLICE, &x, 1, &a, x->dtype, dims, 1);
}

static int count_of(const char *text, const char *needle)
{
    int n = 0;
    for (const char *at = strstr(text, needle); at; at = strstr(at + 1, needle))
        n++;
    return n;
}

static void test_shared_functions(int64_t len)
{
    enum { ALIKE = 36, MAX_LEN = 2000 };
    const int n_alike = ALIKE;
    targ a = {RF_F32, 1, {len + ALIKE + 1}};
    rfi_graph *g = g_new(&a, 1);
    rfi_node *x = g_arg(g, 0), *ys[ALIKE + 2];
    int64_t map[1] = {0}, dims[] = {len};
    rfi_node *two = bcast(g, scalar(g, RF_F32, 2.0), map, dims, 1);
    rfi_node *one = bcast(g, scalar(g, RF_F32, 1.0), map, dims, 1);
    for (int i = 0; i < n_alike; i++)
        ys[i] = bin(g, RFI_OP_ADD,
                    bin(g, RFI_OP_MUL, un(g, RFI_OP_EXP, slice_1d(g, x, i, len)), two), one);
    ys[n_alike] = bin(g, RFI_OP_ADD,
                      bin(g, RFI_OP_MUL, un(g, RFI_OP_TANH, slice_1d(g, x, 3, len)), two), one);
    ys[n_alike + 1] = bin(g, RFI_OP_ADD, slice_1d(g, x, 5, len), slice_1d(g, x, 6, len));
    int n = n_alike + 2;
    for (int i = 0; i < n; i++)
        CHECK_OK(rfi_graph_add_output(g, ys[i]));
    plan_opts o = {0};
    rfi_plan *p = hand_plan(g, &o);
    rfi_kir_module *km = NULL;
    module m;
    if (build(p, &m, &km)) {
        bool shares = len * n >= (1 << 16);
        CHECK(count_of(m.source, "the functions of") == (shares ? n_alike - 1 : 0));
        const rfi_kir_kernel *k7 = kernel_of(km, ys[7]);
        CHECK(k7 && k7->n_bases >= 1);
        for (int b = 0; k7 && b < k7->n_bases; b++)
            if (!k7->bases[b].written)
                CHECK(k7->bases[b].offset == 7 * sizeof(float)); /* x moved up by 7 */
        const rfi_kir_kernel *k0 = kernel_of(km, ys[0]);
        char line[160];
        if (k0 && k7) {
            snprintf(line, sizeof line, "(k%d_%s: the functions of k%d_%s,", k7->step, k7->name,
                     k0->step, k0->name);
            CHECK((strstr(m.source, line) != NULL) == shares);
        }
        const rfi_kir_kernel *kt = kernel_of(km, ys[n_alike]), *k2 = kernel_of(km, ys[n - 1]);
        CHECK(kt && kernel_has(m.source, kt, "tanh"));
        CHECK(k2 && kernel_has(m.source, k2, "i0 + 5;") && kernel_has(m.source, k2, "i0 + 6;"));
        for (int b = 0; k2 && b < k2->n_bases; b++)
            CHECK(k2->bases[b].written || k2->bases[b].offset == 0); /* x stays put */
    }
    module_free(&m);
    rfi_kir_free(km);
    float xd[MAX_LEN + ALIKE + 1];
    for (int i = 0; i < len + ALIKE + 1 && i < MAX_LEN + ALIKE + 1; i++)
        xd[i] = (float)((i * 29 % 41) - 20) * 0.125f;
    const void *args[1] = {xd};
    const char *labels[ALIKE + 2];
    tol tols[ALIKE + 2];
    for (int i = 0; i < n; i++) {
        labels[i] = i < n_alike ? "shared exp kernel" : i == n_alike ? "tanh kernel"
                                                                     : "two-offset kernel";
        tols[i] = i <= n_alike ? ULPS : EXACT; /* vectorised exp and tanh */
    }
    check_program(g, p, args, labels, tols);
    hand_plan_free(p);
    rfi_graph_free(g);
}

/* Windows (pooling): small ones (up to 16 points) are unrolled into a loop
 * without reduced loops, vectorised along the last axis; larger ones run
 * interchanged (the kept axis innermost and vectorised, loads stepping by the
 * window's stride). A window padded along its last axis runs as edge pieces
 * plus an interior without guards or clamps (the form checked is the
 * interior's). Max and min bit for bit (NaNs and zeros of both signs inside
 * windows), sums within the sum tolerance; overlapping windows, padding on
 * both or one side, a kept axis longer than one block of accumulators. */
static void test_windows(void)
{
    targ a[3] = {{RF_F32, 4, {2, 3, 12, 26}}, {RF_F32, 4, {1, 2, 6, 140}},
                 {RF_F32, 4, {1, 2, 7, 25}}};
    rfi_graph *g = g_new(a, 3);
    rfi_node *x = g_arg(g, 0), *wide = g_arg(g, 1), *odd = g_arg(g, 2);
    int64_t w2[] = {1, 1, 2, 2}, s2[] = {1, 1, 2, 2}, w3[] = {1, 1, 3, 3}, s1[] = {1, 1, 1, 1};
    int64_t w5[] = {1, 1, 5, 5}, z[] = {0, 0, 0, 0}, p1[] = {0, 0, 1, 1}, p2[] = {0, 0, 2, 2};
    rfi_node *ys[] = {
        reduce_window(g, x, RF_REDUCE_MAX, w2, s2, z, z),
        reduce_window(g, x, RF_REDUCE_MIN, w2, s2, z, z),
        reduce_window(g, un(g, RFI_OP_NEG, x), RF_REDUCE_SUM, w2, s2, z, z),
        reduce_window(g, x, RF_REDUCE_MAX, w3, s1, z, z),    /* overlapping, stride 1 */
        reduce_window(g, x, RF_REDUCE_MAX, w3, s2, p1, p1),  /* padded: edge + interior */
        reduce_window(g, x, RF_REDUCE_SUM, w3, s2, p1, p1),
        reduce_window(g, x, RF_REDUCE_MAX, w5, s1, z, z),    /* 25 points */
        reduce_window(g, x, RF_REDUCE_SUM, w5, s1, z, z),
        reduce_window(g, wide, RF_REDUCE_MIN, w5, s1, z, z), /* 136 points: three blocks */
        reduce_window(g, x, RF_REDUCE_MAX, w5, s2, p2, p2),  /* padded: five pieces */
        reduce_window(g, odd, RF_REDUCE_MAX, w2, s2, z, p1), /* padded above only */
        reduce_window(g, odd, RF_REDUCE_MIN, w3, s1, p1, z), /* padded below only */
    };
    enum { N = sizeof ys / sizeof ys[0] };
    const form forms[N] = {UNROLLED, UNROLLED,     UNROLLED,     UNROLLED,
                           UNROLLED, UNROLLED,     INTERCHANGED, INTERCHANGED,
                           INTERCHANGED, INTERCHANGED, UNROLLED, UNROLLED};
    const int pieces[N] = {1, 1, 1, 1, 3, 3, 1, 1, 1, 5, 3, 3};
    const char *labels[N] = {"window max 2x2", "window min 2x2", "window sum 2x2",
                             "window max 3x3 stride 1", "window max 3x3 padded",
                             "window sum 3x3 padded", "window max 5x5", "window sum 5x5",
                             "window min 5x5 wide", "window max 5x5 padded",
                             "window max 2x2 padded above", "window min 3x3 padded below"};
    const tol tols[N] = {BITS, BITS, SUM, BITS, BITS, SUM, BITS, SUM, BITS, BITS, BITS, BITS};
    check_forms(g, ys, forms, pieces, N);
    float xd[1872], wd[1680], od[350];
    for (int i = 0; i < 1872; i++)
        xd[i] = i % 5 == 0 ? (i % 10 == 0 ? 0.0f : -0.0f) : (float)((i * 37 % 23) - 11) * 0.5f;
    xd[100] = NAN;
    xd[777] = NAN;
    for (int i = 0; i < 1680; i++)
        wd[i] = i % 3 == 0 ? (i % 6 == 0 ? -0.0f : 0.0f) : (float)(i * 13 % 29);
    wd[301] = NAN;
    for (int i = 0; i < 350; i++) /* all negative but zeros: padding must not win */
        od[i] = i % 4 == 0 ? (i % 8 == 0 ? -0.0f : 0.0f) : -(float)(i * 7 % 19) - 1.0f;
    od[49] = NAN;
    const void *args[3] = {xd, wd, od};
    also_planned = true;
    check_outputs(g, ys, N, args, labels, tols);
    also_planned = false;
    rfi_graph_free(g);
}

/* A padded window's edge piece one column wide (the first column of a 3x3
 * stride-2 max-pool padded by 1) has no loop over the last axis: its
 * innermost loop walks rows, and is not forced to vectorise (gcc took seconds
 * on it); the other pieces are. Results as the interpreter's, bit for bit. */
static void test_window_column_piece(void)
{
    targ a[1] = {{RF_F32, 4, {2, 16, 32, 32}}};
    rfi_graph *g = g_new(a, 1);
    int64_t w3[] = {1, 1, 3, 3}, s2[] = {1, 1, 2, 2}, p1[] = {0, 0, 1, 1};
    rfi_node *y = reduce_window(g, g_arg(g, 0), RF_REDUCE_MAX, w3, s2, p1, p1);
    plan_opts o = {0};
    rfi_plan *p = hand_plan(g, &o);
    rfi_kir_module *km = NULL;
    module m;
    int columns = 0, others = 0;
    if (build(p, &m, &km)) {
        for (int s = 0; s < km->n_steps; s++) {
            const rfi_kir_kernel *k = km->steps[s].kernel;
            if (!k || k->n_stores == 0 || k->stores[0].node != y->id)
                continue;
            bool column = strstr(k->name, "_edge3_") != NULL;
            columns += column, others += !column;
            CHECK(k->no_simd == column);
            CHECK(kernel_has(m.source, k, "#pragma omp simd") == !column);
        }
    }
    CHECK(columns == 1 && others == 2);
    module_free(&m);
    rfi_kir_free(km);
    hand_plan_free(p);
    float xd[2 * 16 * 32 * 32];
    for (int i = 0; i < (int)(sizeof xd / sizeof xd[0]); i++)
        xd[i] = (float)((i * 37 % 23) - 11) * 0.5f;
    const void *args[1] = {xd};
    const char *labels[1] = {"window max 3x3 padded, column piece"};
    const tol tols[1] = {BITS};
    check_outputs(g, &y, 1, args, labels, tols);
    rfi_graph_free(g);
}

/* Inline nodes without a loop form are reported, naming the node. */
/* Index arithmetic: the value of instruction id with the loop variables at v. */
static int64_t eval_index(const rfi_kir_kernel *k, int id, const int64_t *v)
{
    const rfi_kir_ins *x = &k->ins[id];
    switch (x->op) {
    case RFI_KIR_VAR: return v[x->var];
    case RFI_KIR_CONST: return x->i;
    case RFI_KIR_IADD: return eval_index(k, x->a, v) + eval_index(k, x->b, v);
    case RFI_KIR_IMUL: return eval_index(k, x->a, v) * eval_index(k, x->b, v);
    case RFI_KIR_IDIV: return eval_index(k, x->a, v) / eval_index(k, x->b, v);
    case RFI_KIR_IREM: return eval_index(k, x->a, v) % eval_index(k, x->b, v);
    default: return INT64_MIN;
    }
}

static int count_divisions(const rfi_kir_kernel *k, int id)
{
    const rfi_kir_ins *x = &k->ins[id];
    if (x->op != RFI_KIR_IADD && x->op != RFI_KIR_IMUL && x->op != RFI_KIR_IDIV &&
        x->op != RFI_KIR_IREM)
        return 0;
    return (x->op == RFI_KIR_IDIV || x->op == RFI_KIR_IREM) + count_divisions(k, x->a) +
           count_divisions(k, x->b);
}

/* Divisions the ranges decide vanish: the reversed, transposed 3x3 kernel's
 * index t = i0*9 + (8 - i1) (i0 < 32, i1 < 9) split into t / 9, (t / 3) % 3
 * and t % 3 needs none, and a group of 4 rows of 9 (s = i0*9 + i1 over 36)
 * divides only its row; the values agree with plain division everywhere, and
 * a sum with a possibly negative part, or whose low part reaches the row
 * length, keeps its division. */
static void test_split_division(void)
{
    rfi_kir_kernel *k = rfi_kir_kernel_new(0);
    k->rank = 2;
    k->dims[0] = 32;
    k->dims[1] = 9;
    int i0 = rfi_kir_var(k, 0), i1 = rfi_kir_var(k, 1);
    int c3 = rfi_kir_const_i(k, RF_I64, 3), c9 = rfi_kir_const_i(k, RF_I64, 9);
    int neg = rfi_kir_index(k, RFI_KIR_IMUL, i1, rfi_kir_const_i(k, RF_I64, -1));
    int rev = rfi_kir_index(k, RFI_KIR_IADD, neg, rfi_kir_const_i(k, RF_I64, 8));
    int t = rfi_kir_index(k, RFI_KIR_IADD, rev, rfi_kir_index(k, RFI_KIR_IMUL, i0, c9));
    int parts[4] = {rfi_kir_index(k, RFI_KIR_IDIV, t, c9),
                    rfi_kir_index(k, RFI_KIR_IREM, rfi_kir_index(k, RFI_KIR_IDIV, t, c3), c3),
                    rfi_kir_index(k, RFI_KIR_IREM, t, c3),
                    rfi_kir_index(k, RFI_KIR_IDIV, t, rfi_kir_const_i(k, RF_I64, 2))};
    CHECK(parts[0] == i0);
    CHECK(count_divisions(k, parts[1]) == 1 && count_divisions(k, parts[2]) == 1);
    int64_t mixed_c = 0;
    int mixed = rfi_kir_index(k, RFI_KIR_IADD, neg, rfi_kir_index(k, RFI_KIR_IMUL, i0, c9));
    int mixed_q = rfi_kir_index(k, RFI_KIR_IDIV, mixed, c9); /* -i1 may be negative */
    CHECK(k->ins[mixed_q].op == RFI_KIR_IDIV && !rfi_kir_is_const(k, mixed_q, &mixed_c));
    /* s = i0*9 + i1 over groups of 4 rows (c36 = 4 * 9): s / 36 is i0 / 4 and s % 36 is
     * (i0 % 4)*9 + i1, neither dividing the sum; s + 1 reaches 9 in its low part and keeps
     * its division */
    int c36 = rfi_kir_const_i(k, RF_I64, 36);
    int s9 = rfi_kir_index(k, RFI_KIR_IADD, rfi_kir_index(k, RFI_KIR_IMUL, i0, c9), i1);
    int s9_plus = rfi_kir_index(k, RFI_KIR_IADD, rfi_kir_index(k, RFI_KIR_IMUL, i0, c9),
                                rfi_kir_index(k, RFI_KIR_IADD, i1, rfi_kir_const_i(k, RF_I64, 1)));
    int group = rfi_kir_index(k, RFI_KIR_IDIV, s9, c36);
    int in_group = rfi_kir_index(k, RFI_KIR_IREM, s9, c36);
    int group_plus = rfi_kir_index(k, RFI_KIR_IDIV, s9_plus, c36);
    CHECK(k->ins[group].op == RFI_KIR_IDIV && k->ins[group].a == i0);
    CHECK(count_divisions(k, in_group) == 1);
    CHECK(k->ins[group_plus].op == RFI_KIR_IDIV && k->ins[group_plus].a == s9_plus);
    int bad = 0;
    for (int64_t a = 0; a < 32; a++)
        for (int64_t b = 0; b < 9; b++) {
            int64_t v[2] = {a, b}, tv = a * 9 + 8 - b, mv = a * 9 - b;
            bad += eval_index(k, parts[0], v) != tv / 9;
            bad += eval_index(k, parts[1], v) != (tv / 3) % 3;
            bad += eval_index(k, parts[2], v) != tv % 3;
            bad += eval_index(k, parts[3], v) != tv / 2;
            bad += eval_index(k, mixed_q, v) != mv / 9;
            bad += eval_index(k, group, v) != (a * 9 + b) / 36;
            bad += eval_index(k, in_group, v) != (a * 9 + b) % 36;
            bad += eval_index(k, group_plus, v) != (a * 9 + b + 1) / 36;
        }
    CHECK(bad == 0);
    printf("split division: t / 9 is i0, (t / 3) %% 3 and t %% 3 one division each, "
           "(i0*9 + i1) / 36 is i0 / 4, %d mismatches\n", bad);
    rfi_kir_kernel_free(k);
}

static void test_errors(void)
{
    targ a[2] = {{RF_F32, 2, {2, 3}}, {RF_F32, 2, {3, 2}}};
    rfi_graph *g = g_new(a, 2);
    rfi_node *x = g_arg(g, 0), *y = g_arg(g, 1);
    rfi_node *d = dot_2d(g, x, y, 1, 0, 2, 2);
    rfi_node *z = un(g, RFI_OP_NEG, d);
    CHECK_OK(rfi_graph_add_output(g, z));
    plan_opts o = {0};
    rfi_plan *p = hand_plan(g, &o);
    p->loc[d->id].kind = RFI_LOC_INLINE; /* a dot that is not materialised */
    p->n_steps = 0;
    add_step(p, RFI_STEP_LOOP, z->id, -1, -1);
    rfi_kir_module *km = NULL;
    CHECK_STATUS(rfi_kir_lower(p, &km), RF_E_INTERNAL);
    CHECK_MSG("dot_general");
    CHECK(km == NULL);
    /* a step root without a buffer */
    p->loc[z->id].kind = RFI_LOC_INLINE;
    p->loc[d->id].kind = RFI_LOC_ARENA;
    p->steps[0].kind = RFI_STEP_REDUCE;
    p->steps[0].roots[0] = d->id;
    p->steps[0].core = d->id;
    add_step(p, RFI_STEP_LOOP, z->id, -1, -1);
    CHECK_STATUS(rfi_kir_lower(p, &km), RF_E_INTERNAL);
    CHECK_MSG("has no buffer");
    hand_plan_free(p);
    rfi_graph_free(g);

    /* an inline constant with distinct elements */
    g = g_new(a, 1);
    x = g_arg(g, 0);
    float cd[6] = {1, 2, 3, 4, 5, 6};
    rfi_node *c = constant(g, RF_F32, x->dims, 2, cd);
    rfi_node *s = bin(g, RFI_OP_ADD, x, c);
    CHECK_OK(rfi_graph_add_output(g, s));
    p = hand_plan(g, &o);
    p->loc[c->id].kind = RFI_LOC_INLINE;
    CHECK_STATUS(rfi_kir_lower(p, &km), RF_E_INTERNAL);
    CHECK_MSG("constant");
    hand_plan_free(p);
    rfi_graph_free(g);
}

static void test_abi_block(void)
{
    char path[512];
    snprintf(path, sizeof path, "%s/src/backend/cpu/module_abi.h", RF_SOURCE_DIR);
    FILE *f = fopen(path, "r");
    CHECK(f != NULL);
    if (!f)
        return;
    static char text[8192];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    char *begin = strstr(text, "/* BEGIN MODULE ABI */");
    char *end = strstr(text, "/* END MODULE ABI */");
    CHECK(begin && end);
    if (begin && end) {
        end += strlen("/* END MODULE ABI */\n");
        *end = 0;
        CHECK(strcmp(begin, rfi_render_c_abi_block()) == 0);
    }
}

int main(void)
{
    snprintf(tmpdir, sizeof tmpdir, "/tmp/test_kir_XXXXXX");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    test_abi_block();
    test_structure();
    test_coalesce(4);
    test_coalesce(1);
    test_split_reductions();
    test_split_f64_sums();
    test_sibling_reductions();
    test_small_sibling_split();
    test_windows();
    test_window_column_piece();
    test_split_division();
    test_shared_functions(2000);
    test_shared_functions(100);
    test_errors();
    test_float_unary(RF_F32);
    test_float_unary(RF_F64);
    test_math_bounds(RF_F32);
    test_math_bounds(RF_F64);
    test_binary(RF_F64);
    test_binary(RF_I32);
    test_binary(RF_I64);
    test_binary(RF_U8);
    test_binary(RF_BOOL);
    test_shape_chain(false);
    test_shape_chain(true);
    also_planned = true;
    test_reductions(RF_F32);
    also_planned = false;
    test_reductions(RF_F64);
    test_reductions(RF_I32);
    test_reductions(RF_BOOL);
    also_planned = true;
    test_reduce_window();
    test_dot(RF_F32);
    test_binary(RF_F32);
    also_planned = false;
    test_dot(RF_I32);
    test_dot_unrolled(40, 2001);
    test_dot_unrolled(784, 300);
    test_dot_unrolled_rows(RF_F64, 33, 258, 100);
    test_dot_unrolled_rows(RF_F32, 5, 11, 40);
    test_product_tiles(RF_F64, 7, 23, 30);
    test_product_tiles(RF_F64, 9, 16, 8);
    test_product_tiles(RF_F64, 9, 16, 7);
    test_product_tiles(RF_F64, 5, 3, 12);
    test_product_tiles(RF_F32, 6, 37, 20);
    test_product_tiles(RF_F32, 5, 21, 20);
    test_column_tiles(RF_F64, 9, 40, 30);
    test_column_tiles(RF_F64, 2, 19, 12);
    test_column_tiles(RF_F32, 1, 37, 20);
    test_conv_tiles(2);
    test_conv_tiles(1);
    test_transposed_reads(RF_F32, 1, 45, 37);
    test_transposed_reads(RF_F32, 3, 32, 20);
    test_transposed_reads(RF_F64, 2, 19, 40);
    test_hoisted_invariants(false);
    test_hoisted_invariants(true);
    test_gathered_math(false);
    test_gathered_math(true);
    test_row_sums(RF_F32);
    test_row_sums(RF_F64);
    test_lane_extremes(RF_F32, 64);
    test_lane_extremes(RF_F32, 67);
    test_lane_extremes(RF_F64, 64);
    test_lane_extremes(RF_F64, 67);
    test_dot_bf16();
    test_multi_root();
    test_costed_parallel();
    test_reduce_epilogues();
    test_updates(true);
    test_updates(false);
    test_gather();
    test_small_int_values();
    rmdir(tmpdir);
    printf("largest error per op (compiled vs interpreter; ulps, relative):\n");
    for (int i = 0; i < n_err_rows; i++)
        if (err_table[i].ulps > 0 || err_table[i].rel > 0)
            printf("  %-40s %6.0f ulp  %.3g\n", err_table[i].label, err_table[i].ulps,
                   err_table[i].rel);
    printf("  (every other op: exact; %d modules compiled)\n", n_modules);
    return tu_finish("test_kir");
}
