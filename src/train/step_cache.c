/* step_cache.c: the per-model cache of compiled train steps.
 *
 * A step is keyed on everything that shapes its program: the model's
 * structure and train mode, the optimiser (its rule's structure and the
 * optimiser object itself, whose state arrays the step captures), the loss
 * function and its ctx pointer, the train mode of any other layer the loss
 * applied and the optimiser's frozen parameters (the executable's watches),
 * whether gradients and their norm are outputs, the
 * device, and the batch's count, dtypes and shapes. Hyperparameter values are not in
 * the key: they are device scalars the step reads at run time.
 *
 * The cache lives on the model stepped (model->cache: the root, or a layer
 * given its own optimiser), is created on first use and is freed with it;
 * rf_opt_free drops the entries of that optimiser. Lookups scan the entries
 * linearly: a healthy program has a handful (one per batch shape), and past 8
 * we warn, because that usually means a model or optimiser rebuilt every
 * iteration. A model or optimiser rebuilt every iteration whose predecessor
 * was freed leaves no cache growing, so the documented process-wide record
 * below counts, per key without the objects' identities, compiles for new
 * objects after the previous ones were freed, and warns past 8 of one such
 * key. It does not compile or run anything (trainstep.c does).
 */
#include "train_internal.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#define WARN_ENTRIES 8

typedef struct batch_type {
    rf_dtype dtype;
    int rank;
    int64_t dims[RF_MAX_RANK];
} batch_type;

struct rfi_step_entry {
    uint64_t model_hash;
    bool training;
    uint64_t rule_hash;
    uint64_t opt_uid;
    char rule_name[32];
    rf_loss_fn loss;
    void *ctx;
    bool with_grads;
    bool grad_norm;
    rf_device *device;
    int n_batch;
    batch_type *batch; /* rfi_malloc'd, n_batch entries */
    rf_exec *exec;     /* owned */
    rfi_step_outputs outs;
};

struct rfi_step_cache {
    rfi_step_entry **entries;
    int n, cap;
    uint64_t hits, misses, compiles;
};

rf_exec *rfi_step_entry_exec(const rfi_step_entry *e) { return e->exec; }
const rfi_step_outputs *rfi_step_entry_outputs(const rfi_step_entry *e) { return &e->outs; }

static void entry_free(rfi_step_entry *e)
{
    if (!e)
        return;
    rf_exec_free(e->exec);
    rfi_free(e->batch);
    rfi_free(e);
}

/* m's cache, created on first use (NULL on OOM). */
static rfi_step_cache *cache_of(rf_model *m)
{
    if (!m->cache)
        m->cache = rfi_calloc(1, sizeof *m->cache);
    return m->cache;
}

/* ---- Matching ---------------------------------------------------------------------- */

static bool same_batch(const rfi_step_entry *e, const rfi_step_probe *p)
{
    if (e->n_batch != p->n_batch)
        return false;
    for (int i = 0; i < e->n_batch; i++) {
        const rf_array *a = p->batch[i];
        const batch_type *b = &e->batch[i];
        if (a->dtype != b->dtype || a->rank != b->rank)
            return false;
        for (int d = 0; d < a->rank; d++)
            if (a->dims[d] != b->dims[d])
                return false;
    }
    return true;
}

/* The parts of a key, in the order a miss is explained. */
enum key_part {
    PART_TRAIN_MODE, PART_MODEL, PART_RULE, PART_OPT, PART_FROZEN, PART_LOSS, PART_CTX,
    PART_OTHER_MODE, PART_GRADS, PART_GRAD_NORM, PART_DEVICE, PART_BATCH, PART_COUNT
};

/* Bit k set when key part k of e and p differ. */
static unsigned key_diff(const rfi_step_entry *e, const rfi_step_probe *p)
{
    unsigned d = 0;
    if (e->model_hash != p->model_hash)
        d |= 1u << (e->training != p->training ? PART_TRAIN_MODE : PART_MODEL);
    if (e->rule_hash != p->rule_hash)
        d |= 1u << PART_RULE;
    else if (e->opt_uid != p->opt_uid)
        d |= 1u << PART_OPT;
    if (e->loss != p->loss)
        d |= 1u << PART_LOSS;
    if (e->ctx != p->ctx)
        d |= 1u << PART_CTX;
    /* with the model's own modes unchanged, a broken mode watch is a layer outside it */
    const rfi_watch *w = rfi_watch_broken(&e->exec->watches);
    if (w && w->kind == RFI_WATCH_FROZEN)
        d |= 1u << PART_FROZEN;
    else if (w && e->model_hash == p->model_hash)
        d |= 1u << PART_OTHER_MODE;
    if (e->with_grads != p->with_grads)
        d |= 1u << PART_GRADS;
    if (e->grad_norm != p->grad_norm)
        d |= 1u << PART_GRAD_NORM;
    if (e->device != p->device)
        d |= 1u << PART_DEVICE;
    if (!same_batch(e, p))
        d |= 1u << PART_BATCH;
    return d;
}

rfi_step_entry *rfi_step_cache_find(rf_model *m, const rfi_step_probe *p)
{
    rfi_step_cache *c = cache_of(m);
    if (!c)
        return NULL;
    for (int i = 0; i < c->n; i++) {
        if (key_diff(c->entries[i], p) == 0) {
            c->hits++;
            return c->entries[i];
        }
    }
    c->misses++;
    return NULL;
}

/* ---- The too-many-entries warning ------------------------------------------------------ */

static int popcount(unsigned v)
{
    int n = 0;
    for (; v; v &= v - 1)
        n++;
    return n;
}

static void describe_batch(rfi_strbuf *sb, const rfi_step_probe *p)
{
    for (int i = 0; i < p->n_batch; i++) {
        rfi_sb_printf(sb, "%s", i ? " " : "");
        rfi_sb_type(sb, p->batch[i]->dtype, p->batch[i]->dims, p->batch[i]->rank);
    }
}

static void describe_entry_batch(rfi_strbuf *sb, const rfi_step_entry *e)
{
    for (int i = 0; i < e->n_batch; i++) {
        rfi_sb_printf(sb, "%s", i ? " " : "");
        rfi_sb_type(sb, e->batch[i].dtype, e->batch[i].dims, e->batch[i].rank);
    }
}

/* Appends "<part> (<new> vs <old>)" for one differing key part. */
static void describe_part(rfi_strbuf *sb, int part, const rfi_step_probe *p,
                          const rfi_step_entry *e)
{
    switch (part) {
    case PART_TRAIN_MODE:
        rfi_sb_printf(sb, "train mode (%s vs %s)", p->training ? "train" : "test",
                      e->training ? "train" : "test");
        break;
    case PART_MODEL: rfi_sb_printf(sb, "model structure"); break;
    case PART_RULE:
        rfi_sb_printf(sb, "optimiser rule (%s vs %s)", p->rule_name, e->rule_name);
        break;
    case PART_OPT: rfi_sb_printf(sb, "optimiser instance (another rf_setup)"); break;
    case PART_FROZEN: {
        const rfi_watch *w = rfi_watch_broken(&e->exec->watches);
        rfi_sb_printf(sb, "frozen parameters (%s: %s vs %s)", w ? w->what : "a parameter",
                      w ? rfi_watch_state(w, !w->seen) : "?", w ? rfi_watch_state(w, w->seen)
                      : "?");
        break;
    }
    case PART_LOSS: rfi_sb_printf(sb, "loss function"); break;
    case PART_CTX: rfi_sb_printf(sb, "loss ctx pointer (%p vs %p)", p->ctx, e->ctx); break;
    case PART_OTHER_MODE: {
        const rfi_watch *w = rfi_watch_broken(&e->exec->watches);
        rfi_sb_printf(sb, "train mode of %s, which the loss applies (%s vs %s)",
                      w ? w->what : "a layer", w && w->seen ? "test" : "train",
                      w && w->seen ? "train" : "test");
        break;
    }
    case PART_GRADS:
        rfi_sb_printf(sb, "gradient outputs (%s vs %s)", p->with_grads ? "with" : "without",
                      e->with_grads ? "with" : "without");
        break;
    case PART_GRAD_NORM:
        rfi_sb_printf(sb, "gradient norm (%s vs %s)", p->grad_norm ? "tracked" : "not tracked",
                      e->grad_norm ? "tracked" : "not tracked");
        break;
    case PART_DEVICE:
        rfi_sb_printf(sb, "device (%s vs %s)", rf_device_name(p->device),
                      rf_device_name(e->device));
        break;
    default:
        rfi_sb_printf(sb, "batch shapes (");
        describe_batch(sb, p);
        rfi_sb_printf(sb, " vs ");
        describe_entry_batch(sb, e);
        rfi_sb_printf(sb, ")");
        break;
    }
}

/* m described for a warning, at most 159 characters ("...)" ending a cut one). */
static void describe_for_warning(const rf_model *m, char model[160])
{
    rfi_model_describe(m, model, 160);
    if (strlen(model) == 159) /* cut: say so */
        memcpy(model + 155, "...)", 5);
}

/* Warns that c holds many entries, naming how the new one (the last) differs
 * from the nearest other entry (fewest differing key parts; the newest wins ties). */
static void warn_many(const rf_model *m, const rfi_step_cache *c, const rfi_step_probe *p)
{
    const rfi_step_entry *nearest = NULL;
    unsigned diff = 0;
    for (int i = 0; i < c->n - 1; i++) {
        unsigned d = key_diff(c->entries[i], p);
        if (!nearest || popcount(d) <= popcount(diff)) {
            nearest = c->entries[i];
            diff = d;
        }
    }
    rfi_strbuf sb = {0};
    int listed = 0;
    for (int part = 0; nearest && part < PART_COUNT; part++) {
        if (!(diff & (1u << part)))
            continue;
        rfi_sb_printf(&sb, "%s", listed++ ? " and " : "");
        describe_part(&sb, part, p, nearest);
    }
    char model[160];
    describe_for_warning(m, model);
    bool shapes_only = diff == 1u << PART_BATCH;
    fprintf(stderr, "reflux: warning: %d compiled train steps cached for model %s: the new one "
            "differs from the nearest in %s; %s\n", c->n, model,
            sb.data && !sb.failed ? sb.data : "its key",
            shapes_only ? "batches whose shapes keep changing compile a step each (pad them to "
                          "a few sizes, or drop a ragged last batch with drop_last)"
                        : "rebuilding the model or optimiser every iteration compiles a new "
                          "step each time");
    rfi_sb_free(&sb);
}

/* ---- Steps compiled again for new objects ----------------------------------------------
 * Documented process-wide cache: for each step key less the identities of the model and
 * optimiser objects and the loss's ctx (REBUILD_SLOTS keys, the least recently compiled
 * replaced, under a mutex), the objects it was last compiled for and whether one of them
 * has been freed since. A compile for new objects after the previous ones were freed is a
 * rebuild; recompiles for living objects (rf_model_cache_clear, an ensemble of models of
 * one architecture) are not counted. */

#define REBUILD_SLOTS 64

typedef struct rebuild_record {
    uint64_t key, last_use;
    int compiles;           /* the first, and each rebuild since */
    bool warned, orphaned;  /* orphaned: last_cache's model or last_opt_uid freed */
    const rfi_step_cache *last_cache;
    uint64_t last_opt_uid;
} rebuild_record;

static pthread_mutex_t rebuild_lock = PTHREAD_MUTEX_INITIALIZER;
static rebuild_record rebuilds[REBUILD_SLOTS];
static uint64_t rebuild_clock;
static pthread_once_t rebuild_fork_once = PTHREAD_ONCE_INIT;

/* The lock is taken around every fork: a child forked while another thread
 * held it would otherwise keep it held by a thread it does not have, and its
 * next compile or free of a model would wait for ever. It is held only for a
 * scan of the slots, so a fork waits no longer than that. */
static void rebuild_before_fork(void) { pthread_mutex_lock(&rebuild_lock); }
static void rebuild_after_fork(void) { pthread_mutex_unlock(&rebuild_lock); }

static void watch_forks(void)
{
    pthread_atfork(rebuild_before_fork, rebuild_after_fork, rebuild_after_fork);
}

static void lock_rebuilds(void)
{
    pthread_once(&rebuild_fork_once, watch_forks);
    pthread_mutex_lock(&rebuild_lock);
}

static uint64_t structural_key(const rfi_step_probe *p)
{
    uint64_t h = rfi_hash_u64(RFI_HASH_INIT, p->model_hash);
    h = rfi_hash_u64(h, p->rule_hash);
    h = rfi_hash_bytes(h, &p->loss, sizeof p->loss);
    h = rfi_hash_u64(h, p->with_grads);
    h = rfi_hash_u64(h, p->grad_norm);
    h = rfi_hash_bytes(h, &p->device, sizeof p->device);
    for (int i = 0; i < p->n_batch; i++) {
        const rf_array *a = p->batch[i];
        h = rfi_hash_u64(h, (uint64_t)a->dtype);
        h = rfi_hash_bytes(h, a->dims, (size_t)a->rank * sizeof a->dims[0]);
    }
    return h;
}

/* Records a compile of p's key for the model whose cache is c; true the first time the
 * key's rebuilds pass WARN_ENTRIES. */
static bool compiled_again(const rfi_step_cache *c, const rfi_step_probe *p)
{
    uint64_t key = structural_key(p);
    lock_rebuilds();
    rebuild_record *r = NULL, *oldest = &rebuilds[0];
    for (int i = 0; i < REBUILD_SLOTS && !r; i++) {
        if (rebuilds[i].compiles > 0 && rebuilds[i].key == key)
            r = &rebuilds[i];
        else if (rebuilds[i].last_use < oldest->last_use)
            oldest = &rebuilds[i];
    }
    if (!r) {
        r = oldest;
        *r = (rebuild_record){.key = key};
    }
    if (r->compiles == 0 || r->orphaned)
        r->compiles++;
    r->orphaned = false;
    r->last_cache = c;
    r->last_opt_uid = p->opt_uid;
    r->last_use = ++rebuild_clock;
    bool warn = r->compiles > WARN_ENTRIES && !r->warned;
    r->warned = r->warned || warn;
    pthread_mutex_unlock(&rebuild_lock);
    return warn;
}

/* The model whose cache is c (c non-NULL), or the optimiser opt_uid, is being freed. */
static void objects_freed(const rfi_step_cache *c, uint64_t opt_uid)
{
    lock_rebuilds();
    for (int i = 0; i < REBUILD_SLOTS; i++)
        if (rebuilds[i].compiles > 0 &&
            (c ? rebuilds[i].last_cache == c : rebuilds[i].last_opt_uid == opt_uid))
            rebuilds[i].orphaned = true;
    pthread_mutex_unlock(&rebuild_lock);
}

static void warn_rebuilt(const rf_model *m, const rfi_step_probe *p)
{
    char model[160];
    describe_for_warning(m, model);
    fprintf(stderr, "reflux: warning: the train step of model %s with %s has been compiled "
            "more than %d times in this process, for new model or optimiser objects each "
            "time: build the model and optimiser once and reuse them\n", model,
            p->rule_name ? p->rule_name : "its optimiser", WARN_ENTRIES);
}

/* ---- Inserting, dropping, freeing ----------------------------------------------------- */

static rfi_step_entry *entry_new(const rfi_step_probe *p, rf_exec *exec,
                                 const rfi_step_outputs *outs)
{
    rfi_step_entry *e = rfi_calloc(1, sizeof *e);
    batch_type *b = rfi_calloc((size_t)(p->n_batch > 0 ? p->n_batch : 1), sizeof *b);
    if (!e || !b) {
        rfi_free(e);
        rfi_free(b);
        return NULL;
    }
    e->model_hash = p->model_hash;
    e->training = p->training;
    e->rule_hash = p->rule_hash;
    e->opt_uid = p->opt_uid;
    snprintf(e->rule_name, sizeof e->rule_name, "%s", p->rule_name ? p->rule_name : "?");
    e->loss = p->loss;
    e->ctx = p->ctx;
    e->with_grads = p->with_grads;
    e->grad_norm = p->grad_norm;
    e->device = p->device;
    e->n_batch = p->n_batch;
    for (int i = 0; i < p->n_batch; i++) {
        b[i].dtype = p->batch[i]->dtype;
        b[i].rank = p->batch[i]->rank;
        memcpy(b[i].dims, p->batch[i]->dims, sizeof b[i].dims);
    }
    e->batch = b;
    e->exec = exec;
    e->outs = *outs;
    return e;
}

rfi_step_entry *rfi_step_cache_insert(rf_model *m, const rfi_step_probe *p, rf_exec *exec,
                                      const rfi_step_outputs *outs)
{
    rfi_step_cache *c = cache_of(m);
    if (c && c->n == c->cap) {
        int cap = c->cap ? 2 * c->cap : 4;
        rfi_step_entry **grown = rfi_realloc(c->entries, (size_t)cap * sizeof *grown);
        if (grown) {
            c->entries = grown;
            c->cap = cap;
        }
    }
    rfi_step_entry *e = c && c->n < c->cap ? entry_new(p, exec, outs) : NULL;
    if (!e) {
        rf_exec_free(exec);
        rfi_error(RF_E_NOMEM, "rf_trainstep: out of memory caching the compiled step");
        return NULL;
    }
    c->entries[c->n++] = e;
    c->compiles++;
    bool again = compiled_again(c, p);
    if (c->n > WARN_ENTRIES)
        warn_many(m, c, p);
    else if (again)
        warn_rebuilt(m, p);
    return e;
}

void rfi_step_cache_drop_opt(rf_model *m, uint64_t opt_uid)
{
    rfi_step_cache *c = m ? m->cache : NULL;
    if (!c)
        return;
    objects_freed(NULL, opt_uid);
    int kept = 0;
    for (int i = 0; i < c->n; i++) {
        if (c->entries[i]->opt_uid == opt_uid)
            entry_free(c->entries[i]);
        else
            c->entries[kept++] = c->entries[i];
    }
    c->n = kept;
}

void rfi_step_cache_free(rfi_step_cache *c)
{
    if (!c)
        return;
    objects_freed(c, 0);
    for (int i = 0; i < c->n; i++)
        entry_free(c->entries[i]);
    rfi_free(c->entries);
    rfi_free(c);
}

/* ---- Public: statistics and clearing ------------------------------------------------- */

rf_cache_stats rf_model_cache_stats(const rf_model *m)
{
    rf_cache_stats s = {0, 0, 0, 0, 0};
    const rfi_step_cache *c = m ? m->cache : NULL;
    if (c) {
        s.hits = c->hits;
        s.misses = c->misses;
        s.compiles = c->compiles;
        s.entries = c->n;
        for (int i = 0; i < c->n; i++)
            s.memory += rf_exec_memory(c->entries[i]->exec);
    }
    return s;
}

void rf_model_cache_clear(rf_model *m)
{
    rfi_step_cache *c = m ? m->cache : NULL;
    if (!c)
        return;
    /* Counters survive: they describe the model's history, not the entries. */
    for (int i = 0; i < c->n; i++)
        entry_free(c->entries[i]);
    c->n = 0;
}
