/* model.c: the generic model tree (rf_model): construction, accessors,
 * capture of a layer's arrays in a trace, the depth-first walk with dotted
 * paths, copies to a device, train/test mode, summaries, structural hashing,
 * the optimiser back-links, and compiling a model's forward pass.
 *
 * It deliberately knows no layer: every layer, built-in or user-written, is a
 * type (forward + describe) plus named arrays, children and config bytes, and
 * everything here works on that shape alone. It never computes on array data.
 * The compiled-step cache (train/step_cache.c) and the optimisers (optim/)
 * own their halves of the links kept here.
 */
#include "model.h"

#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "../optim/optim.h"

/* ---- Identity ------------------------------------------------------------------------ */

/* Process-wide, never reset: ids key compile caches, so one must never be reused. */
static _Atomic uint64_t next_uid = 1;

uint64_t rfi_next_uid(void) { return atomic_fetch_add(&next_uid, 1); }

/* ---- Construction ------------------------------------------------------------------------- */

rf_model *rf_model_new(const rf_layer_type *type, const void *config, size_t config_size)
{
    if (!type || !type->forward || !type->name) {
        rfi_error(RF_E_INVALID, "rf_model_new: the layer type %s",
                  !type ? "is NULL" : !type->name ? "has no name" : "has no forward function");
        return NULL;
    }
    if (config_size > 0 && !config) {
        rfi_error(RF_E_INVALID, "rf_model_new(%s): config is NULL but config_size is %zu",
                  type->name, config_size);
        return NULL;
    }
    rf_model *m = rfi_calloc(1, sizeof *m);
    if (!m) {
        rfi_error(RF_E_NOMEM, "rf_model_new(%s): out of memory", type->name);
        return NULL;
    }
    if (config_size > 0) {
        m->config = rfi_malloc(config_size);
        if (!m->config) {
            rfi_free(m);
            rfi_error(RF_E_NOMEM, "rf_model_new(%s): out of memory", type->name);
            return NULL;
        }
        memcpy(m->config, config, config_size);
    }
    m->mode = rfi_flag_new(false);
    if (!m->mode) {
        rfi_free(m->config);
        rfi_free(m);
        rfi_error(RF_E_NOMEM, "rf_model_new(%s): out of memory", type->name);
        return NULL;
    }
    m->type = type;
    m->config_size = config_size;
    m->uid = rfi_next_uid();
    return m;
}

static bool name_taken(const rfi_named_array *list, int n, const char *name)
{
    for (int i = 0; i < n; i++)
        if (strcmp(list[i].name, name) == 0)
            return true;
    return false;
}

/* Array names become path components: non-empty, no '.', and unique in the layer. */
static rf_status check_array_name(const rf_model *m, const char *op, const char *name)
{
    if (!name || !*name)
        return rfi_error(RF_E_INVALID, "%s(%s): the array name is %s", op, m->type->name,
                         name ? "empty" : "NULL");
    if (!rfi_valid_utf8(name)) /* checkpoints keep names in a JSON header */
        return rfi_error(RF_E_INVALID, "%s(%s): array name \"%s\" is not valid UTF-8", op,
                         m->type->name, name);
    if (!strcmp(name, "__metadata__")) /* the safetensors header's own entry */
        return rfi_error(RF_E_INVALID, "%s(%s): array name \"__metadata__\" is reserved", op,
                         m->type->name);
    if (strchr(name, '.'))
        return rfi_error(RF_E_INVALID, "%s(%s): array name \"%s\" contains '.' (it is a path "
                         "separator)", op, m->type->name, name);
    if (name_taken(m->params, m->n_params, name) || name_taken(m->state, m->n_state, name))
        return rfi_error(RF_E_INVALID, "%s(%s): the layer already has an array named \"%s\"",
                         op, m->type->name, name);
    return RF_OK;
}

static rf_status add_array(rf_model *m, const char *op, bool trainable, const char *name,
                           rf_array *a)
{
    if (!m || !a) {
        rf_array_free(a);
        if (m && rf_errmsg()[0]) { /* the array's constructor failed: keep why */
            char why[RFI_ERRMSG_MAX];
            snprintf(why, sizeof why, "%s", rf_errmsg());
            return rfi_error(strstr(why, "out of memory") ? RF_E_NOMEM : RF_E_INVALID,
                             "%s(%s): array \"%s\" is NULL (its constructor failed: %s)", op,
                             m->type->name, name ? name : "", why);
        }
        return rfi_error(RF_E_INVALID, "%s: %s is NULL", op, m ? "array" : "model");
    }
    rf_status st = check_array_name(m, op, name);
    if (st != RF_OK) {
        rf_array_free(a);
        return st;
    }
    rfi_named_array **list = trainable ? &m->params : &m->state;
    int *n = trainable ? &m->n_params : &m->n_state;
    int *cap = trainable ? &m->cap_params : &m->cap_state;
    char *copy = rfi_strdup(name);
    if (!copy || !rfi_grow((void **)list, *n, cap, sizeof **list)) {
        rfi_free(copy);
        rf_array_free(a);
        return rfi_error(RF_E_NOMEM, "%s(%s): out of memory", op, m->type->name);
    }
    (*list)[*n].name = copy;
    (*list)[*n].a = a;
    (*n)++;
    return RF_OK;
}

rf_status rf_model_add_param(rf_model *m, const char *name, rf_array *a)
{
    return add_array(m, "rf_model_add_param", true, name, a);
}

rf_status rf_model_add_state(rf_model *m, const char *name, rf_array *a)
{
    return add_array(m, "rf_model_add_state", false, name, a);
}

/* Whether a is m or one of m's ancestors. */
static bool is_ancestor(const rf_model *a, const rf_model *m)
{
    for (; m; m = m->parent)
        if (m == a)
            return true;
    return false;
}

rf_status rf_model_add_child(rf_model *m, rf_model *child)
{
    if (!m || !child) {
        rf_model_free(child);
        return rfi_error(RF_E_INVALID, "rf_model_add_child: %s is NULL",
                         !m ? "model" : "child");
    }
    /* A tree, not a graph: a model has one owner (freed once, visited once),
     * so a shared layer (Flux's weight tying) or a cycle is refused, and the
     * child stays with whoever owns it. */
    if (child->parent || is_ancestor(child, m)) {
        char what[256], where[256];
        rfi_model_describe(child, what, sizeof what);
        rfi_model_describe(child->parent ? child->parent : m, where, sizeof where);
        return rfi_error(RF_E_INVALID, "rf_model_add_child: %s %s %s; a model has one owner "
                         "(sharing a layer between models or positions is not supported)",
                         what, child->parent ? "already belongs to" : "is, or contains,",
                         where);
    }
    if (!rfi_grow((void **)&m->children, m->n_children, &m->cap_children, sizeof *m->children)) {
        rf_model_free(child);
        return rfi_error(RF_E_NOMEM, "rf_model_add_child(%s): out of memory", m->type->name);
    }
    m->children[m->n_children++] = child;
    child->parent = m;
    return RF_OK;
}

/* ---- Accessors ------------------------------------------------------------------------------ */

int rf_model_n_params(const rf_model *m) { return m ? m->n_params : 0; }
int rf_model_n_state(const rf_model *m) { return m ? m->n_state : 0; }
int rf_model_n_children(const rf_model *m) { return m ? m->n_children : 0; }
const void *rf_model_config(const rf_model *m) { return m ? m->config : NULL; }
const char *rf_model_type_name(const rf_model *m) { return m ? m->type->name : NULL; }

rf_model *rf_model_child(const rf_model *m, int i)
{
    if (!m || i < 0 || i >= m->n_children) {
        rfi_error(RF_E_INVALID, "rf_model_child: index %d out of range (the layer has %d)", i,
                  m ? m->n_children : 0);
        return NULL;
    }
    return m->children[i];
}

rf_array *rf_model_param_array(const rf_model *m, int i)
{
    if (!m || i < 0 || i >= m->n_params) {
        rfi_error(RF_E_INVALID, "rf_model_param_array: index %d out of range (the layer has %d)",
                  i, m ? m->n_params : 0);
        return NULL;
    }
    return m->params[i].a;
}

rf_array *rf_model_state_array(const rf_model *m, int i)
{
    if (!m || i < 0 || i >= m->n_state) {
        rfi_error(RF_E_INVALID, "rf_model_state_array: index %d out of range (the layer has %d)",
                  i, m ? m->n_state : 0);
        return NULL;
    }
    return m->state[i].a;
}

/* ---- Capture inside a forward function ---------------------------------------------------- */

/* Captures array i of `list` in t, with a message naming the layer and the
 * array when it is out of range or on the wrong device (rf_capture's own
 * message would name neither). */
static rf_tensor *capture_named(rf_model *m, rf_trace *t, int i, bool trainable)
{
    const char *op = trainable ? "rf_model_param" : "rf_model_state";
    if (!t)
        return NULL;
    if (!m) {
        rf_trace_fail(t, RF_E_INVALID, "%s: model is NULL", op);
        return NULL;
    }
    const rfi_named_array *list = trainable ? m->params : m->state;
    int n = trainable ? m->n_params : m->n_state;
    if (i < 0 || i >= n) {
        rf_trace_fail(t, RF_E_INVALID, "%s: %s has no %s %d (it has %d)", op, m->type->name,
                      trainable ? "parameter" : "state array", i, n);
        return NULL;
    }
    rf_array *a = list[i].a;
    if (a->device != t->device) {
        char ty[128];
        rfi_type_str(ty, sizeof ty, a->dtype, a->dims, a->rank);
        rf_trace_fail(t, RF_E_DEVICE,
                      "%s: %s array \"%s\" (%s) lives on %s but the program runs on %s; move "
                      "the model with rf_model_to(model, dev)",
                      op, m->type->name, list[i].name, ty, rf_device_name(a->device),
                      rf_device_name(t->device));
        return NULL;
    }
    return rf_capture(t, a);
}

rf_tensor *rf_model_param(rf_model *m, rf_trace *t, int i) { return capture_named(m, t, i, true); }
rf_tensor *rf_model_state(rf_model *m, rf_trace *t, int i) { return capture_named(m, t, i, false); }

/* ---- Walking the tree ------------------------------------------------------------------------ */

/* The walk keeps the current path in one growable buffer: each level appends
 * its component and truncates back when done. */
typedef struct walk {
    char *path;       /* `inline_path` until a path outgrows it, then rfi_malloc'd */
    size_t len, cap;
    char inline_path[256]; /* so a walk (run every trainstep) allocates nothing */
    bool failed; /* out of memory: the walk stopped early */
    bool no_paths; /* every path is "": a per-step check formats none */
    /* Called for every array with its layer (for messages). */
    void (*fn)(struct walk *w, const rf_model *layer, const char *name, rf_array *a,
               bool trainable);
    void *ud;
} walk;

/* Appends "<sep><component>" (no separator at the root) to the path. */
static bool path_push(walk *w, const char *component)
{
    if (w->no_paths)
        return true;
    size_t add = strlen(component) + (w->len ? 1 : 0);
    if (w->len + add + 1 > w->cap) {
        size_t ncap = w->cap ? w->cap * 2 : 64;
        while (ncap < w->len + add + 1)
            ncap *= 2;
        bool on_heap = w->path && w->path != w->inline_path;
        char *p = rfi_realloc(on_heap ? w->path : NULL, ncap);
        if (!p) {
            w->failed = true;
            return false;
        }
        if (!on_heap && w->len)
            memcpy(p, w->path, w->len + 1);
        w->path = p;
        w->cap = ncap;
    }
    if (w->len)
        w->path[w->len++] = '.';
    memcpy(w->path + w->len, component, strlen(component) + 1);
    w->len += strlen(component);
    return true;
}

static void walk_list(walk *w, const rf_model *m, const rfi_named_array *list, int n,
                      bool trainable)
{
    for (int i = 0; i < n && !w->failed; i++) {
        size_t mark = w->len;
        if (!path_push(w, list[i].name))
            return;
        w->fn(w, m, list[i].name, list[i].a, trainable);
        w->len = mark;
        w->path[w->len] = '\0';
    }
}

static void walk_tree(walk *w, const rf_model *m)
{
    walk_list(w, m, m->params, m->n_params, true);
    walk_list(w, m, m->state, m->n_state, false);
    for (int i = 0; i < m->n_children && !w->failed; i++) {
        char idx[24] = "";
        if (!w->no_paths)
            snprintf(idx, sizeof idx, "%d", i);
        size_t mark = w->len;
        if (!path_push(w, idx))
            return;
        walk_tree(w, m->children[i]);
        w->len = mark;
        w->path[w->len] = '\0';
    }
}

/* Runs the walk and frees its buffer; false if it ran out of memory. */
static bool walk_run(walk *w, const rf_model *m)
{
    w->path = w->inline_path;
    w->path[0] = '\0';
    w->len = 0;
    w->cap = sizeof w->inline_path;
    if (m)
        walk_tree(w, m);
    if (w->path != w->inline_path)
        rfi_free(w->path);
    w->path = NULL;
    return !w->failed;
}

typedef struct visit_ud {
    rf_array_visitor fn;
    void *ud;
} visit_ud;

static void visit_one(walk *w, const rf_model *layer, const char *name, rf_array *a,
                      bool trainable)
{
    (void)layer;
    (void)name;
    const visit_ud *v = w->ud;
    v->fn(w->path, a, trainable, v->ud);
}

void rf_model_visit(rf_model *m, rf_array_visitor fn, void *ud)
{
    if (!m || !fn)
        return;
    visit_ud v = {fn, ud};
    walk w = {.fn = visit_one, .ud = &v};
    if (!walk_run(&w, m))
        rfi_error(RF_E_NOMEM, "rf_model_visit: out of memory building a path");
}

void rfi_model_each_array(rf_model *m, rf_array_visitor fn, void *ud)
{
    visit_ud v = {fn, ud};
    walk w = {.fn = visit_one, .ud = &v, .no_paths = true};
    walk_run(&w, m); /* builds no path, so it cannot run out of memory */
}

static void count_params(const char *path, rf_array *a, bool trainable, void *ud)
{
    (void)path;
    if (trainable)
        *(int64_t *)ud += rf_array_numel(a);
}

int64_t rf_model_n_parameters(rf_model *m)
{
    int64_t n = 0;
    rf_model_visit(m, count_params, &n);
    return n;
}

typedef struct collect_ud {
    rf_array **items;
    int n, cap;
} collect_ud;

static void collect_one(walk *w, const rf_model *layer, const char *name, rf_array *a,
                        bool trainable)
{
    (void)layer;
    (void)name;
    collect_ud *c = w->ud;
    if (!trainable)
        return;
    if (!rfi_grow((void **)&c->items, c->n, &c->cap, sizeof *c->items)) {
        w->failed = true;
        return;
    }
    c->items[c->n++] = a;
}

int rfi_model_collect_params(rf_model *m, rf_array ***out)
{
    *out = NULL;
    collect_ud c = {0};
    walk w = {.fn = collect_one, .ud = &c};
    if (!walk_run(&w, m)) {
        rfi_free(c.items);
        rfi_error(RF_E_NOMEM, "out of memory collecting the parameters of a model");
        return -1;
    }
    *out = c.items;
    return c.n;
}

/* ---- Structure hash ------------------------------------------------------------------------- */

static uint64_t hash_arrays(uint64_t h, const rfi_named_array *list, int n)
{
    h = rfi_hash_u64(h, (uint64_t)n);
    for (int i = 0; i < n; i++) {
        const rf_array *a = list[i].a;
        h = rfi_hash_bytes(h, list[i].name, strlen(list[i].name) + 1);
        h = rfi_hash_u64(h, (uint64_t)a->dtype);
        h = rfi_hash_u64(h, (uint64_t)a->device->kind);
        h = rfi_hash_u64(h, (uint64_t)a->device->index);
        h = rfi_hash_u64(h, (uint64_t)a->rank);
        for (int d = 0; d < a->rank; d++)
            h = rfi_hash_u64(h, (uint64_t)a->dims[d]);
    }
    return h;
}

/* `outer`: the matmul precision m's products get when m sets none (its parent's). */
static uint64_t hash_tree(uint64_t h, const rf_model *m, rf_precision outer)
{
    /* The type's address tells apart user types that share a name. */
    h = rfi_hash_u64(h, (uint64_t)(uintptr_t)m->type);
    h = rfi_hash_bytes(h, m->type->name, strlen(m->type->name) + 1);
    h = rfi_hash_u64(h, (uint64_t)m->config_size);
    if (m->config_size)
        h = rfi_hash_bytes(h, m->config, m->config_size);
    h = rfi_hash_u64(h, atomic_load(&m->mode->value) ? 1 : 0);
    rf_precision precision = m->sets_precision ? m->matmul_precision : outer;
    h = rfi_hash_u64(h, (uint64_t)precision);
    h = hash_arrays(h, m->params, m->n_params);
    h = hash_arrays(h, m->state, m->n_state);
    h = rfi_hash_u64(h, (uint64_t)m->n_children);
    for (int i = 0; i < m->n_children; i++)
        h = hash_tree(h, m->children[i], precision);
    return h;
}

uint64_t rfi_model_structure_hash(const rf_model *m)
{
    /* a root that sets none gets the trace's: F32 where models are traced for the cache */
    return m ? hash_tree(RFI_HASH_INIT, m, RF_PRECISION_F32) : 0;
}

/* ---- Describing and summarising -------------------------------------------------------------- */

/* "Dense(4 => 8, tanh)" for m alone: the type's describe() text wrapped in
 * the name (a describe() that already starts with "Name(" is taken as is). */
static void describe_self(const rf_model *m, rfi_strbuf *sb)
{
    char cfg[256] = "";
    if (m->type->describe)
        m->type->describe(m, cfg, sizeof cfg);
    cfg[sizeof cfg - 1] = '\0';
    size_t nl = strlen(m->type->name);
    if (strncmp(cfg, m->type->name, nl) == 0 && cfg[nl] == '(')
        rfi_sb_printf(sb, "%s", cfg);
    else
        rfi_sb_printf(sb, "%s(%s)", m->type->name, cfg);
}

/* Containers print as Name(config, child, child...) on one line. */
static void describe_tree(const rf_model *m, rfi_strbuf *sb)
{
    if (m->n_children == 0) {
        describe_self(m, sb);
        return;
    }
    char cfg[256] = "";
    if (m->type->describe)
        m->type->describe(m, cfg, sizeof cfg);
    cfg[sizeof cfg - 1] = '\0';
    rfi_sb_printf(sb, "%s(%s%s", m->type->name, cfg, *cfg ? ", " : "");
    for (int i = 0; i < m->n_children; i++) {
        if (i)
            rfi_sb_printf(sb, ", ");
        describe_tree(m->children[i], sb);
    }
    rfi_sb_printf(sb, ")");
}

/* Copies a strbuf's text into buf (capacity n, always NUL-terminated). */
static void sb_copy_out(rfi_strbuf *sb, char *buf, size_t n)
{
    if (!buf || n == 0)
        return;
    const char *s = sb->data && !sb->failed ? sb->data : "";
    snprintf(buf, n, "%s", s);
}

void rfi_model_describe(const rf_model *m, char *buf, size_t n)
{
    rfi_strbuf sb = {0};
    if (m)
        describe_tree(m, &sb);
    else
        rfi_sb_printf(&sb, "(null model)");
    sb_copy_out(&sb, buf, n);
    rfi_sb_free(&sb);
}

static int64_t own_parameters(const rf_model *m)
{
    int64_t n = 0;
    for (int i = 0; i < m->n_params; i++)
        n += rf_array_numel(m->params[i].a);
    return n;
}

/* The column the "# N parameters" comments start at. */
#define SUMMARY_COMMENT_COL 40

/* Pads the current line (started at `line_start`) to the comment column. */
static void pad_to_comment(rfi_strbuf *sb, size_t line_start)
{
    size_t used = sb->len - line_start;
    int pad = used < SUMMARY_COMMENT_COL ? (int)(SUMMARY_COMMENT_COL - used) : 1;
    rfi_sb_printf(sb, "%*s", pad, "");
}

/* Flux's layout: leaves on one line with their parameter count, containers
 * opening and closing around their indented children. */
static void summary_tree(const rf_model *m, rfi_strbuf *sb, int depth)
{
    size_t start = sb->len;
    rfi_sb_printf(sb, "%*s", 2 * depth, "");
    if (m->n_children == 0) {
        describe_self(m, sb);
        rfi_sb_printf(sb, "%s", depth > 0 ? "," : "");
        int64_t np = own_parameters(m);
        if (np > 0) {
            pad_to_comment(sb, start);
            rfi_sb_printf(sb, "# %lld parameters", (long long)np);
        }
        if (m->n_state > 0)
            rfi_sb_printf(sb, "%s%d non-trainable array%s", np > 0 ? ", " : "# ", m->n_state,
                          m->n_state == 1 ? "" : "s");
        rfi_sb_printf(sb, "\n");
        return;
    }
    rfi_sb_printf(sb, "%s(", m->type->name);
    int64_t own = own_parameters(m); /* a container's own, as a custom layer may have */
    if (own > 0) {
        pad_to_comment(sb, start);
        rfi_sb_printf(sb, "# %lld parameter%s of its own", (long long)own, own == 1 ? "" : "s");
    }
    rfi_sb_printf(sb, "\n");
    char cfg[256] = "";
    if (m->type->describe)
        m->type->describe(m, cfg, sizeof cfg);
    cfg[sizeof cfg - 1] = '\0';
    if (*cfg)
        rfi_sb_printf(sb, "%*s%s,\n", 2 * (depth + 1), "", cfg);
    for (int i = 0; i < m->n_children; i++)
        summary_tree(m->children[i], sb, depth + 1);
    rfi_sb_printf(sb, "%*s)%s\n", 2 * depth, "", depth > 0 ? "," : "");
}

typedef struct totals {
    int arrays, trainable;
    int64_t params;
    size_t bytes;
} totals;

static void add_totals(const char *path, rf_array *a, bool trainable, void *ud)
{
    (void)path;
    totals *t = ud;
    t->arrays++;
    if (trainable) {
        t->trainable++;
        t->params += rf_array_numel(a);
    }
    t->bytes += rf_array_nbytes(a);
}

void rf_model_summary(const rf_model *m, char *buf, size_t n)
{
    rfi_strbuf sb = {0};
    if (!m) {
        rfi_sb_printf(&sb, "(null model)\n");
    } else {
        summary_tree(m, &sb, 0);
        totals t = {0};
        rf_model_visit((rf_model *)m, add_totals, &t);
        rfi_sb_printf(&sb, "Total: %d trainable arrays, %lld parameters, %d arrays, %zu bytes\n",
                      t.trainable, (long long)t.params, t.arrays, t.bytes);
    }
    sb_copy_out(&sb, buf, n);
    rfi_sb_free(&sb);
}

/* ---- Applying ------------------------------------------------------------------------------- */

rf_tensor *rf_apply(rf_model *m, rf_tensor *x)
{
    if (!x)
        return NULL; /* the trace already holds the error that made x NULL */
    rf_trace *t = rf_tensor_trace(x);
    if (!m) {
        rf_trace_fail(t, RF_E_INVALID, "rf_apply: model is NULL");
        return NULL;
    }
    rf_precision outer = RF_PRECISION_F32;
    if (m->sets_precision)
        outer = rf_trace_set_matmul_precision(t, m->matmul_precision);
    rf_trace *outer_trace = m->applying; /* a layer applied inside its own forward */
    m->applying = t;
    rf_tensor *y = m->type->forward(m, x);
    m->applying = outer_trace;
    if (m->sets_precision)
        rf_trace_set_matmul_precision(t, outer);
    if (!y) {
        if (rf_trace_status(t) == RF_OK) {
            char what[256];
            rfi_model_describe(m, what, sizeof what);
            rf_trace_fail(t, RF_E_INVALID,
                          "rf_apply: %s: the forward function returned NULL without "
                          "recording an error (it should call rf_trace_fail)", what);
        }
        return NULL;
    }
    if (rf_tensor_trace(y) != t) {
        rf_trace_fail(t, RF_E_INVALID, "rf_apply: %s: the forward function returned a tensor "
                      "of another trace", m->type->name);
        return NULL;
    }
    return y;
}

/* ---- Copies to a device ---------------------------------------------------------------------- */

/* The status of a failed rf_array_to_opts, from its message (it does not return one). */
static rf_status array_to_failure(const char *what, const char *name, rf_device *dev)
{
    char why[RFI_ERRMSG_MAX];
    snprintf(why, sizeof why, "%s", rf_errmsg()); /* rfi_error overwrites the buffer */
    rf_status st = strstr(why, "out of memory") ? RF_E_NOMEM : RF_E_DEVICE;
    return rfi_error(st, "rf_model_to: could not copy %s array \"%s\" to %s: %s", what, name,
                     rf_device_name(dev), why);
}

static rf_status copy_arrays(rf_model *dst, const rfi_named_array *list, int n, bool trainable,
                             rf_device *dev, const rf_to_opts *opts)
{
    for (int i = 0; i < n; i++) {
        rf_array *a = rf_array_to_opts(list[i].a, dev, opts);
        if (!a)
            return array_to_failure(dst->type->name, list[i].name, dev);
        rf_status st = trainable ? rf_model_add_param(dst, list[i].name, a)
                                 : rf_model_add_state(dst, list[i].name, a);
        if (st != RF_OK)
            return st;
    }
    return RF_OK;
}

/* A deep copy of m with its arrays on dev; NULL with the message set on failure. */
static rf_model *copy_tree(const rf_model *m, rf_device *dev, const rf_to_opts *opts)
{
    rf_model *c = rf_model_new(m->type, m->config, m->config_size);
    if (!c)
        return NULL;
    atomic_store(&c->mode->value, atomic_load(&m->mode->value));
    c->sets_precision = m->sets_precision;
    c->matmul_precision = m->matmul_precision;
    rf_status st = copy_arrays(c, m->params, m->n_params, true, dev, opts);
    if (st == RF_OK)
        st = copy_arrays(c, m->state, m->n_state, false, dev, opts);
    for (int i = 0; i < m->n_children && st == RF_OK; i++) {
        rf_model *child = copy_tree(m->children[i], dev, opts);
        st = child ? rf_model_add_child(c, child) : RF_E_NOMEM;
    }
    if (st != RF_OK) {
        rf_model_free(c);
        return NULL;
    }
    return c;
}

rf_model *rf_model_to_opts(rf_model *m, rf_device *dev, const rf_to_opts *opts)
{
    if (!m || !dev) {
        rfi_error(RF_E_INVALID, "rf_model_to: %s is NULL", m ? "device" : "model");
        return NULL;
    }
    return copy_tree(m, dev, opts);
}

rf_model *rf_model_to(rf_model *m, rf_device *dev) { return rf_model_to_opts(m, dev, NULL); }

/* ---- Train / test mode ------------------------------------------------------------------- */

/* m's path from its root ("0.2", as arrays are named; "" for a root), cut to fit. */
static void layer_path(const rf_model *m, char *buf, size_t n)
{
    if (!m->parent)
        return;
    layer_path(m->parent, buf, n);
    int index = 0;
    while (index < m->parent->n_children && m->parent->children[index] != m)
        index++;
    size_t len = strlen(buf);
    if (len + 1 < n)
        snprintf(buf + len, n - len, "%s%d", len ? "." : "", index);
}

static void set_training(rf_model *m, bool on)
{
    rfi_flag_set(m->mode, on);
    for (int i = 0; i < m->n_children; i++)
        set_training(m->children[i], on);
}

void rf_trainmode(rf_model *m)
{
    if (m)
        set_training(m, true);
}

void rf_testmode(rf_model *m)
{
    if (m)
        set_training(m, false);
}

/* Read inside the forward of the layer or of one of its ancestors, the mode
 * becomes part of what the trace depends on: its executable checks, run after
 * run, that the mode still holds (rf_exec_run refuses, rf_jitted and the step
 * cache compile for the new one), unless the traced function set the mode
 * itself before this read (MC dropout, an evaluation function calling
 * rf_testmode first): then the program is the function's choice. */
bool rf_model_training(const rf_model *m)
{
    if (!m)
        return false;
    bool on = atomic_load(&m->mode->value);
    rf_trace *t = m->applying;
    for (const rf_model *p = m->parent; !t && p; p = p->parent)
        t = p->applying; /* a custom forward branching on a child's mode */
    int i = t ? rfi_trace_watch(t, m->mode, on) : -1;
    if (i >= 0) { /* named after it is listed: a describe that reads the mode finds it */
        char what[112], path[64] = "";
        rfi_model_describe(m, what, sizeof what);
        layer_path(m, path, sizeof path);
        size_t n = strlen(what);
        if (path[0])
            snprintf(what + n, sizeof what - n, " (layer \"%s\")", path);
        snprintf(t->watches.v[i].what, sizeof t->watches.v[i].what, "%s", what);
    }
    return on;
}

/* ---- Matmul precision -------------------------------------------------------------------- */

static void set_precision(rf_model *m, rf_precision p)
{
    m->sets_precision = true;
    m->matmul_precision = p;
    for (int i = 0; i < m->n_children; i++)
        set_precision(m->children[i], p);
}

rf_status rf_model_set_matmul_precision(rf_model *m, rf_precision p)
{
    if (!m)
        return rfi_error(RF_E_INVALID, "rf_model_set_matmul_precision: model is NULL");
    rf_status st = rfi_check_precision("rf_model_set_matmul_precision: precision", p);
    if (st == RF_OK)
        set_precision(m, p);
    return st;
}

/* ---- Optimiser links --------------------------------------------------------------------- */

rf_status rfi_model_attach_opt(rf_model *m, struct rf_opt *opt)
{
    if (!m || !opt)
        return rfi_error(RF_E_INVALID, "attaching an optimiser: %s is NULL",
                         m ? "optimiser" : "model");
    for (int i = 0; i < m->n_opts; i++)
        if (m->opts[i] == opt)
            return RF_OK;
    if (!rfi_grow((void **)&m->opts, m->n_opts, &m->cap_opts, sizeof *m->opts))
        return rfi_error(RF_E_NOMEM, "attaching an optimiser to %s: out of memory",
                         m->type->name);
    m->opts[m->n_opts++] = opt;
    return RF_OK;
}

bool rfi_model_has_opt(const rf_model *m, const struct rf_opt *opt)
{
    for (int i = 0; m && i < m->n_opts; i++)
        if (m->opts[i] == opt)
            return true;
    return false;
}

void rfi_model_detach_opt(rf_model *m, struct rf_opt *opt)
{
    if (!m)
        return;
    for (int i = 0; i < m->n_opts; i++) {
        if (m->opts[i] == opt) {
            memmove(&m->opts[i], &m->opts[i + 1], (size_t)(m->n_opts - i - 1) * sizeof *m->opts);
            m->n_opts--;
            return;
        }
    }
}

/* ---- Freeing ----------------------------------------------------------------------------- */

static void free_arrays(rfi_named_array *list, int n)
{
    for (int i = 0; i < n; i++) {
        rfi_free(list[i].name);
        rf_array_free(list[i].a);
    }
    rfi_free(list);
}

void rf_model_free(rf_model *m)
{
    if (!m)
        return;
    if (m->parent) { /* its owner frees it: freeing it here would free it twice */
        char what[256];
        rfi_model_describe(m, what, sizeof what);
        rfi_error(RF_E_INVALID, "rf_model_free: %s belongs to another model; free the root of "
                  "its tree", what);
        return;
    }
    /* Detach the optimisers first, so a callback that detaches itself finds
     * nothing to change while we iterate. */
    struct rf_opt **opts = m->opts;
    int n_opts = m->n_opts;
    m->opts = NULL;
    m->n_opts = m->cap_opts = 0;
    for (int i = 0; i < n_opts; i++)
        rfi_opt_model_gone(opts[i]);
    rfi_free(opts);

    rfi_step_cache_free(m->cache);
    m->cache = NULL;
    for (int i = 0; i < m->n_children; i++) {
        m->children[i]->parent = NULL;
        rf_model_free(m->children[i]);
    }
    rfi_free(m->children);
    free_arrays(m->params, m->n_params);
    free_arrays(m->state, m->n_state);
    rfi_free(m->config);
    rfi_flag_orphan(m->mode); /* executables watching it keep running as traced */
    rfi_free(m);
}

/* ---- Compiling the forward pass ---------------------------------------------------------- */

typedef struct device_check {
    rf_device *dev;
    rf_status st;
} device_check;

static void check_one_device(walk *w, const rf_model *layer, const char *name, rf_array *a,
                             bool trainable)
{
    (void)name;
    device_check *c = w->ud;
    if (c->st != RF_OK || a->device == c->dev)
        return;
    char ty[128];
    rfi_type_str(ty, sizeof ty, a->dtype, a->dims, a->rank);
    c->st = rfi_error(RF_E_DEVICE,
                      "rf_compile_model: %s %s \"%s\" (%s) lives on %s but x lives on %s; move "
                      "the model with rf_model_to(model, dev) and compile the copy",
                      layer->type->name, trainable ? "parameter" : "state array", w->path, ty,
                      rf_device_name(a->device), rf_device_name(c->dev));
}

/* Every array of the tree must live on dev: the message names the first that does not. */
static rf_status check_model_device(const rf_model *m, rf_device *dev)
{
    device_check c = {dev, RF_OK};
    walk w = {.fn = check_one_device, .ud = &c};
    if (!walk_run(&w, m))
        return rfi_error(RF_E_NOMEM, "rf_compile_model: out of memory");
    return c.st;
}

static void trace_model(rf_trace *t, void *ctx)
{
    rf_tensor *y = rf_apply(ctx, rf_arg(t, 0));
    if (y && t->n_outputs != 0) /* output 0 must be the model's */
        rfi_graph_fail(t, RF_E_INVALID, "rf_compile_model: a layer's forward called rf_return "
                       "%d time%s; a forward returns its result", t->n_outputs,
                       t->n_outputs == 1 ? "" : "s");
    else if (y)
        rf_return(t, y);
}

rf_status rf_compile_model(rf_model *m, rf_array *x, rf_exec **out)
{
    if (!out)
        return rfi_error(RF_E_INVALID, "rf_compile_model: out is NULL");
    *out = NULL;
    if (!m || !x)
        return rfi_error(RF_E_INVALID, "rf_compile_model: %s is NULL", m ? "x" : "model");
    if (!rfi_device_is_compute(x->device))
        return rfi_error(RF_E_DEVICE, "rf_compile_model: x lives on the %s; move it to a "
                         "compute device (e.g. cpu) with rf_array_to",
                         rf_device_name(x->device));
    rf_status st = check_model_device(m, x->device);
    if (st != RF_OK)
        return st;
    rf_compile_opts opts = {.device = x->device, .name = m->type->name};
    return rf_compile_with(trace_model, m, &x, 1, &opts, out);
}

rf_status rf_jit_model(rf_model *m, rf_array *x, rf_array **y)
{
    if (!y)
        return rfi_error(RF_E_INVALID, "rf_jit_model: y is NULL");
    *y = NULL;
    rf_exec *e;
    rf_status st = rf_compile_model(m, x, &e);
    if (st != RF_OK)
        return st;
    st = rf_exec_run(e, &x, 1, y, 1);
    rf_exec_free(e);
    return st;
}

rf_tensor *rfi_layer_input_error(rf_model *m, rf_tensor *x, rf_status st, const char *fmt, ...)
{
    char name[256], type[128], why[256];
    rfi_model_describe(m, name, sizeof name);
    rfi_type_str(type, sizeof type, rf_tensor_dtype(x), rf_tensor_dims(x), rf_tensor_rank(x));
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    rf_trace_fail(rf_tensor_trace(x), st, "%s: input %s %s", name, type, why);
    return NULL;
}

bool rfi_layer_check_dtype(rf_model *m, rf_tensor *x)
{
    if (m->n_params == 0 || rf_tensor_dtype(x) == m->params[0].a->dtype)
        return true;
    rfi_layer_input_error(m, x, RF_E_DTYPE, "has dtype %s, but the layer's parameters are %s; "
                          "convert the input (rf_convert) or keep the model in %s",
                          rf_dtype_name(rf_tensor_dtype(x)), rf_dtype_name(m->params[0].a->dtype),
                          rf_dtype_name(rf_tensor_dtype(x)));
    return false;
}
