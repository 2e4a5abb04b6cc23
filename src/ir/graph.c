/* graph.c: graph and node construction: the graph's lists (nodes, arguments,
 * captures, outputs, updates), its sticky first error, and rfi_node_new, the
 * one door through which every node enters a graph (operand checks, shape
 * inference, attribute and payload copies).
 *
 * It does not define result shapes (infer.c), check whole graphs (verify.c)
 * or know what any op computes.
 */
#include "ir.h"
#include "api.h"

#include <math.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "runtime/runtime.h"

/* ---- Graphs -------------------------------------------------------------------------- */

/* Numbers traces in creation order (only compared, never used as a key). */
static _Atomic uint64_t graph_seq;

rfi_graph *rfi_graph_new(rf_device *dev, const char *name)
{
    rfi_graph *g = rfi_calloc(1, sizeof *g);
    if (!g) {
        rfi_error(RF_E_NOMEM, "out of memory creating a trace");
        return NULL;
    }
    g->seq = atomic_fetch_add(&graph_seq, 1);
    g->flag_clock = rfi_flag_clock();
    g->device = dev;
    if (!name)
        name = "program";
    size_t n = strlen(name) + 1;
    char *copy = rfi_arena_alloc(&g->arena, n);
    if (!copy) {
        rfi_graph_free(g);
        rfi_error(RF_E_NOMEM, "out of memory creating a trace");
        return NULL;
    }
    memcpy(copy, name, n);
    g->name = copy;
    return g;
}

void rfi_graph_free(rfi_graph *g)
{
    if (!g)
        return;
    for (int i = 0; i < g->n_captures; i++)
        rfi_array_release(g->captures[i]);
    rfi_free(g->captures);
    rfi_free(g->capture_nodes);
    rfi_free(g->nodes);
    rfi_free(g->outputs);
    rfi_free(g->updates);
    rfi_free(g->errmsg);
    rfi_watch_list_free(&g->watches);
    rfi_arena_free(&g->arena);
    rfi_free(g);
}

int rfi_trace_watch(rf_trace *t, rfi_flag *f, bool seen)
{
    if (atomic_load(&f->set_at) > t->flag_clock)
        return -1; /* the traced function chose it: the program does not depend on it */
    int i = rfi_watch_add(&t->watches, f, seen);
    if (i == -2)
        rfi_graph_fail(t, RF_E_NOMEM, "out of memory recording a layer's train/test mode");
    return i < 0 ? -1 : i;
}

rf_status rfi_graph_set_args(rfi_graph *g, int n, const rf_dtype *dtypes, const int *ranks,
                             const int64_t (*dims)[RF_MAX_RANK])
{
    if (!g || n < 0 || (n > 0 && (!dtypes || !ranks || !dims)))
        return rfi_error(RF_E_INVALID, "rfi_graph_set_args: invalid arguments");
    if (g->arg_dtypes || g->n_args)
        return rfi_error(RF_E_INVALID, "rfi_graph_set_args: arguments already declared");
    for (int i = 0; i < n; i++) {
        if (!rfi_dtype_valid((int)dtypes[i]))
            return rfi_error(RF_E_DTYPE, "argument %d: invalid dtype %d", i, (int)dtypes[i]);
        if (ranks[i] < 0 || ranks[i] > RF_MAX_RANK)
            return rfi_error(RF_E_SHAPE, "argument %d: rank %d out of range [0, %d]", i,
                             ranks[i], RF_MAX_RANK);
        for (int d = 0; d < ranks[i]; d++)
            if (dims[i][d] < 0)
                return rfi_error(RF_E_SHAPE, "argument %d: negative dim %lld", i,
                                 (long long)dims[i][d]);
    }
    size_t k = n > 0 ? (size_t)n : 1;
    g->args = rfi_arena_alloc(&g->arena, k * sizeof *g->args);
    g->arg_dtypes = rfi_arena_alloc(&g->arena, k * sizeof *g->arg_dtypes);
    g->arg_ranks = rfi_arena_alloc(&g->arena, k * sizeof *g->arg_ranks);
    g->arg_dims = rfi_arena_alloc(&g->arena, k * sizeof *g->arg_dims);
    if (!g->args || !g->arg_dtypes || !g->arg_ranks || !g->arg_dims)
        return rfi_error(RF_E_NOMEM, "out of memory declaring %d arguments", n);
    for (int i = 0; i < n; i++) {
        g->arg_dtypes[i] = dtypes[i];
        g->arg_ranks[i] = ranks[i];
        for (int d = 0; d < ranks[i]; d++)
            g->arg_dims[i][d] = dims[i][d];
    }
    g->n_args = n;
    return RF_OK;
}

void rfi_graph_fail(rfi_graph *g, rf_status st, const char *fmt, ...)
{
    if (!g)
        return;
    if (g->status != RF_OK) {
        /* Sticky: the first error wins; keep showing it. */
        rfi_error(g->status, "%s", g->errmsg ? g->errmsg : "trace failed");
        return;
    }
    char buf[RFI_ERRMSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    g->status = st != RF_OK ? st : RF_E_INTERNAL;
    g->errmsg = rfi_strdup(buf); /* NULL on OOM: the status still records the failure */
    rfi_error(g->status, "%s", buf);
}

int rfi_graph_capture_index(rfi_graph *g, rf_array *a)
{
    if (!g || !a) {
        rfi_error(RF_E_INVALID, "capture: NULL array");
        return -1;
    }
    for (int i = 0; i < g->n_captures; i++)
        if (g->captures[i] == a)
            return i;
    void *caps = g->captures, *nodes = g->capture_nodes;
    int cap_a = g->cap_captures, cap_n = g->cap_captures;
    bool ok = rfi_grow(&caps, g->n_captures, &cap_a, sizeof *g->captures);
    g->captures = caps;
    ok = ok && rfi_grow(&nodes, g->n_captures, &cap_n, sizeof *g->capture_nodes);
    g->capture_nodes = nodes;
    if (!ok) {
        rfi_graph_fail(g, RF_E_NOMEM, "capture: out of memory");
        return -1;
    }
    g->cap_captures = cap_n;
    int idx = g->n_captures++;
    g->captures[idx] = rfi_array_retain(a);
    g->capture_nodes[idx] = NULL;
    return idx;
}

/* Checks that x is a node of g; records the graph error otherwise. */
static rf_status check_own(rfi_graph *g, const rfi_node *x, const char *what)
{
    if (!x) {
        if (g->status != RF_OK)
            return g->status; /* a NULL left by an earlier failure: stay silent */
        rfi_graph_fail(g, RF_E_INVALID, "%s: NULL tensor", what);
        return RF_E_INVALID;
    }
    if (x->g != g) {
        rfi_graph_fail(g, RF_E_INVALID, "%s: tensor belongs to another trace (mixing traces)",
                       what);
        return RF_E_INVALID;
    }
    return RF_OK;
}

rf_status rfi_graph_add_output(rfi_graph *g, rfi_node *x)
{
    if (!g)
        return rfi_error(RF_E_INVALID, "rf_return: NULL trace");
    rf_status st = check_own(g, x, "rf_return");
    if (st != RF_OK)
        return st;
    void *items = g->outputs;
    bool ok = rfi_grow(&items, g->n_outputs, &g->cap_outputs, sizeof *g->outputs);
    g->outputs = items;
    if (!ok) {
        rfi_graph_fail(g, RF_E_NOMEM, "rf_return: out of memory");
        return RF_E_NOMEM;
    }
    g->outputs[g->n_outputs++] = x;
    return RF_OK;
}

rf_status rfi_graph_add_update(rfi_graph *g, int capture, rfi_node *value)
{
    if (!g)
        return rfi_error(RF_E_INVALID, "rf_assign: NULL trace");
    rf_status st = check_own(g, value, "rf_assign");
    if (st != RF_OK)
        return st;
    if (capture < 0 || capture >= g->n_captures) {
        rfi_graph_fail(g, RF_E_INVALID, "rf_assign: capture index %d out of range (%d captures)",
                       capture, g->n_captures);
        return RF_E_INVALID;
    }
    const rf_array *a = g->captures[capture];
    if (a) {
        char ta[200], tv[200];
        rfi_type_str(ta, sizeof ta, a->dtype, a->dims, a->rank);
        rfi_type_str(tv, sizeof tv, value->dtype, value->dims, value->rank);
        if (a->dtype != value->dtype) {
            rfi_graph_fail(g, RF_E_DTYPE, "rf_assign: value %s does not match the array %s", tv,
                           ta);
            return RF_E_DTYPE;
        }
        if (a->rank != value->rank ||
            memcmp(a->dims, value->dims, (size_t)a->rank * sizeof a->dims[0]) != 0) {
            rfi_graph_fail(g, RF_E_SHAPE, "rf_assign: value %s does not match the array %s", tv,
                           ta);
            return RF_E_SHAPE;
        }
    }
    /* Assigning one array twice keeps the last value (in the first one's place). */
    for (int i = 0; i < g->n_updates; i++) {
        if (g->updates[i].capture == capture) {
            g->updates[i].value = value;
            return RF_OK;
        }
    }
    void *items = g->updates;
    bool ok = rfi_grow(&items, g->n_updates, &g->cap_updates, sizeof *g->updates);
    g->updates = items;
    if (!ok) {
        rfi_graph_fail(g, RF_E_NOMEM, "rf_assign: out of memory");
        return RF_E_NOMEM;
    }
    g->updates[g->n_updates++] = (rfi_update){.capture = capture, .value = value};
    return RF_OK;
}

/* ---- Nodes ------------------------------------------------------------------------- */

/* Leaves that name a slot of the graph must agree with that slot's type. */
static rf_status check_leaf_slot(rfi_graph *g, rfi_op op, const rfi_attrs *attr, rf_dtype dt,
                                 const int64_t *dims, int rank)
{
    char want[200], got[200];
    int64_t idx = attr->i[0];
    if (op == RFI_OP_ARGUMENT) {
        if (idx < 0 || idx >= g->n_args) {
            rfi_graph_fail(g, RF_E_INVALID, "argument: index %lld out of range (%d arguments)",
                           (long long)idx, g->n_args);
            return RF_E_INVALID;
        }
        int i = (int)idx;
        if (g->arg_dtypes[i] != dt || g->arg_ranks[i] != rank ||
            memcmp(g->arg_dims[i], dims, (size_t)rank * sizeof *dims) != 0) {
            rfi_graph_fail(g, RF_E_INVALID, "argument: node type %s differs from argument %d %s",
                           rfi_type_str(got, sizeof got, dt, dims, rank), i,
                           rfi_type_str(want, sizeof want, g->arg_dtypes[i], g->arg_dims[i],
                                        g->arg_ranks[i]));
            return RF_E_INVALID;
        }
    } else if (op == RFI_OP_CAPTURE) {
        if (idx < 0 || idx >= g->n_captures) {
            rfi_graph_fail(g, RF_E_INVALID, "capture: index %lld out of range (%d captures)",
                           (long long)idx, g->n_captures);
            return RF_E_INVALID;
        }
        const rf_array *a = g->captures[idx];
        if (a && (a->dtype != dt || a->rank != rank ||
                  memcmp(a->dims, dims, (size_t)rank * sizeof *dims) != 0)) {
            rfi_graph_fail(g, RF_E_INVALID, "capture: node type %s differs from capture %lld %s",
                           rfi_type_str(got, sizeof got, dt, dims, rank), (long long)idx,
                           rfi_type_str(want, sizeof want, a->dtype, a->dims, a->rank));
            return RF_E_INVALID;
        }
    }
    return RF_OK;
}

/* Makes x the graph's node for its argument/capture slot if the slot has none. */
static void bind_leaf_slot(rfi_graph *g, rfi_node *x)
{
    int64_t idx = x->attr.i[0];
    if (x->op == RFI_OP_ARGUMENT && idx >= 0 && idx < g->n_args && !g->args[idx])
        g->args[idx] = x;
    else if (x->op == RFI_OP_CAPTURE && idx >= 0 && idx < g->n_captures &&
             !g->capture_nodes[idx])
        g->capture_nodes[idx] = x;
}

/* rfi_node_new allocates a node up to its last stored list (ir.h): attr must end it. */
_Static_assert(offsetof(rfi_node, attr) + sizeof(rfi_attrs) == sizeof(rfi_node),
               "attr is the node's last member");

int rfi_attrs_lists(const rfi_attrs *a)
{
    int n = RFI_N_LISTS;
    while (n > 0 && a->nl[n - 1] <= 0)
        n--;
    return n;
}

/* The bytes of a's attributes a node stores: all but its lists past the last
 * non-empty one. */
static size_t stored_attr_bytes(const rfi_attrs *a)
{
    return offsetof(rfi_attrs, l) + (size_t)rfi_attrs_lists(a) * sizeof a->l[0];
}

void rfi_attrs_copy(rfi_attrs *dst, const rfi_attrs *src)
{
    memset(dst, 0, sizeof *dst);
    memcpy(dst, src, stored_attr_bytes(src));
}

void rfi_node_copy(rfi_node *dst, const rfi_node *src)
{
    memcpy(dst, src, offsetof(rfi_node, attr));
    rfi_attrs_copy(&dst->attr, &src->attr);
}

/* A pad's or convolution's attributes with every crop past its axis made the
 * crop of exactly the axis (rfi_clip_crop: the same result), into *canon;
 * then no backend computes offsets from amounts beyond the sizes involved
 * (a user's INT64_MIN crop beside an INT64_MAX padding overflowed them).
 * Lists rfi_infer will refuse are returned as they are. */
static const rfi_attrs *clip_crops(rfi_op op, rfi_node *const *in, int n_in, const rfi_attrs *a,
                                   rfi_attrs *canon)
{
    if (n_in < 1 || (op != RFI_OP_PAD && op != RFI_OP_CONVOLUTION))
        return a;
    const rfi_node *x = in[0];
    rfi_attrs_copy(canon, a); /* a node stores only the lists it uses */
    if (op == RFI_OP_PAD) {
        if (a->nl[0] != x->rank || a->nl[1] != x->rank || a->nl[2] != x->rank)
            return a;
        for (int i = 0; i < x->rank; i++) {
            int64_t d = x->dims[i], gaps, n;
            if (a->l[2][i] < 0 || !rfi_mul_ok(d > 0 ? d - 1 : 0, a->l[2][i], &gaps) ||
                !rfi_add_ok(d, gaps, &n) || !rfi_clip_crop(n, &canon->l[0][i], &canon->l[1][i]))
                return a;
        }
        return canon;
    }
    int ns = x->rank - 2;
    if (ns < 1 || a->nl[1] != ns || a->nl[2] != ns || a->nl[3] != ns)
        return a;
    for (int i = 0; i < ns; i++) {
        int64_t in_dil;
        if (a->l[3][i] < 1 || !rfi_dilate_ok(x->dims[2 + i], a->l[3][i], &in_dil) ||
            !rfi_clip_crop(in_dil, &canon->l[1][i], &canon->l[2][i]))
            return a;
    }
    return canon;
}

rfi_node *rfi_node_new(rfi_graph *g, rfi_op op, rfi_node *const *in, int n_in,
                       const rfi_attrs *attr, rf_dtype dtype, const int64_t *dims, int rank)
{
    if (!g) {
        rfi_error(RF_E_INVALID, "NULL trace");
        return NULL;
    }
    if ((unsigned)op >= RFI_OP_COUNT) {
        rfi_graph_fail(g, RF_E_INTERNAL, "invalid op %d", (int)op);
        return NULL;
    }
    const char *name = rfi_op_table[op].name;
    if (n_in < 0 || (n_in > 0 && !in)) {
        rfi_graph_fail(g, RF_E_INVALID, "%s: invalid operand list", name);
        return NULL;
    }
    for (int i = 0; i < n_in; i++)
        if (!in[i])
            return NULL; /* an earlier failure already recorded the error */
    for (int i = 0; i < n_in; i++) {
        if (in[i]->g != g) { /* g was named as the graph being built */
            rfi_graph_fail(g, RF_E_INVALID,
                           "%s: operand %d belongs to another trace (mixing traces)", name, i);
            return NULL;
        }
    }

    static const rfi_attrs no_attrs;
    rfi_attrs canon;
    const rfi_attrs *a = clip_crops(op, in, n_in, attr ? attr : &no_attrs, &canon);
    rf_dtype dt = dtype;
    int r = rank;
    int64_t d[RF_MAX_RANK] = {0};
    if (r < 0 || r > RF_MAX_RANK) {
        rfi_graph_fail(g, RF_E_SHAPE, "%s: rank %d out of range [0, %d]", name, r, RF_MAX_RANK);
        return NULL;
    }
    if (r > 0 && !dims) {
        rfi_graph_fail(g, RF_E_INVALID, "%s: NULL dims for rank %d", name, r);
        return NULL;
    }
    for (int i = 0; i < r; i++)
        d[i] = dims[i];

    char msg[RFI_ERRMSG_MAX];
    rf_status st = rfi_infer(op, in, n_in, a, &dt, d, &r, msg, sizeof msg);
    if (st != RF_OK) {
        rfi_graph_fail(g, st, "%s", msg);
        return NULL;
    }
    if (check_leaf_slot(g, op, a, dt, d, r) != RF_OK)
        return NULL;

    size_t attr_bytes = stored_attr_bytes(a);
    rfi_node *x = rfi_arena_alloc(&g->arena, offsetof(rfi_node, attr) + attr_bytes);
    rfi_node **ops = n_in ? rfi_arena_alloc(&g->arena, (size_t)n_in * sizeof *ops) : NULL;
    void *payload = NULL;
    if (op == RFI_OP_CONSTANT && a->nbytes) {
        payload = rfi_arena_alloc(&g->arena, a->nbytes);
        if (payload)
            memcpy(payload, a->data, a->nbytes);
    }
    void *nodes = g->nodes;
    bool grown = rfi_grow(&nodes, g->n_nodes, &g->cap_nodes, sizeof *g->nodes);
    g->nodes = nodes;
    if (!x || (n_in && !ops) || (op == RFI_OP_CONSTANT && a->nbytes && !payload) || !grown) {
        rfi_graph_fail(g, RF_E_NOMEM, "%s: out of memory", name);
        return NULL;
    }
    for (int i = 0; i < n_in; i++)
        ops[i] = in[i];
    memcpy(&x->attr, a, attr_bytes);
    if (op == RFI_OP_CONSTANT)
        x->attr.data = payload;
    else {
        x->attr.data = NULL; /* only constants carry a payload */
        x->attr.nbytes = 0;
    }
    x->g = g;
    x->id = g->n_nodes;
    x->op = op;
    x->dtype = dt;
    x->rank = r;
    memcpy(x->dims, d, sizeof d);
    x->weak = false;
    x->n_in = n_in;
    x->in = ops;
    g->nodes[g->n_nodes++] = x;
    bind_leaf_slot(g, x);
    return x;
}

rfi_node *rfi_node_clone(rfi_graph *g, const rfi_node *src, rfi_node *const *new_in)
{
    if (!g || !src) {
        rfi_error(RF_E_INVALID, "rfi_node_clone: NULL argument");
        return NULL;
    }
    rfi_node *x =
        rfi_node_new(g, src->op, new_in, src->n_in, &src->attr, src->dtype, src->dims, src->rank);
    if (x)
        x->weak = src->weak;
    return x;
}

int64_t rfi_node_numel(const rfi_node *x) { return rfi_numel(x->dims, x->rank); }

bool rfi_node_same_dims(const rfi_node *a, const rfi_node *b)
{
    return a->rank == b->rank &&
           (a->rank == 0 || memcmp(a->dims, b->dims, sizeof(int64_t) * (size_t)a->rank) == 0);
}

const rfi_node *rfi_splat_scalar(const rfi_node *x)
{
    if (x->op == RFI_OP_BROADCAST_IN_DIM)
        x = x->in[0];
    return x->op == RFI_OP_CONSTANT && x->rank == 0 ? x : NULL;
}

size_t rfi_node_nbytes(const rfi_node *x)
{
    return (size_t)rfi_node_numel(x) * rf_dtype_size(x->dtype);
}

rfi_node *rfi_node_scalar(rfi_graph *g, rf_dtype dt, double v)
{
    unsigned char payload[8] = {0};
    rfi_api_store(dt, v, payload);
    rfi_attrs at;
    memset(&at, 0, sizeof at);
    at.data = payload;
    at.nbytes = rf_dtype_size(dt);
    return rfi_node_new(g, RFI_OP_CONSTANT, NULL, 0, &at, dt, NULL, 0);
}

bool rfi_node_is_plus_zero(const rfi_node *x)
{
    const rfi_node *c = x->op == RFI_OP_BROADCAST_IN_DIM ? x->in[0] : x;
    if (c->op != RFI_OP_CONSTANT || c->rank != 0 || !c->attr.data)
        return false;
    double v = 1.0;
    if (c->dtype == RF_F32) {
        float f;
        memcpy(&f, c->attr.data, sizeof f);
        v = f;
    } else if (c->dtype == RF_F64) {
        memcpy(&v, c->attr.data, sizeof v);
    }
    return v == 0.0 && !signbit(v);
}

int rfi_max_operands(const rfi_graph *g)
{
    int most = 1;
    for (int id = 0; id < g->n_nodes; id++)
        if (g->nodes[id]->n_in > most)
            most = g->nodes[id]->n_in;
    return most;
}

int *rfi_use_counts(const rfi_graph *g)
{
    int *uses = rfi_calloc(g->n_nodes > 0 ? (size_t)g->n_nodes : 1, sizeof *uses);
    if (!uses) {
        rfi_error(RF_E_NOMEM, "out of memory counting uses");
        return NULL;
    }
    for (int i = 0; i < g->n_nodes; i++) {
        const rfi_node *x = g->nodes[i];
        for (int k = 0; k < x->n_in; k++)
            uses[x->in[k]->id]++;
    }
    for (int i = 0; i < g->n_outputs; i++)
        uses[g->outputs[i]->id]++;
    for (int i = 0; i < g->n_updates; i++)
        uses[g->updates[i].value->id]++;
    return uses;
}

rfi_graph *rfi_graph_inner(rfi_graph *a, rfi_graph *b)
{
    return a->seq > b->seq ? a : b;
}
