/* runtime.h: internal view of devices, arrays, executables and the backend
 * interface that every executor (interp, cpu, cuda) implements.
 */
#ifndef RF_RUNTIME_H
#define RF_RUNTIME_H

#include "../ir/ir.h"

#include <pthread.h>

struct rf_device {
    rf_device_kind kind;
    int index;
    const char *name;
};

/* A dense row-major array. `refs` counts the user's reference plus one per
 * trace or executable that captures it; the memory is freed when it drops to
 * zero. Host and CPU arrays keep their elements in ordinary memory (`data`). */
struct rf_array {
    _Atomic int refs;    /* updated with C11 atomics (arrays may be retained
                            and freed from several threads, e.g. a loader) */
    rf_device *device;
    rf_dtype dtype;
    int rank;
    int64_t dims[RF_MAX_RANK];
    int64_t numel;
    size_t nbytes;
    void *data;
    bool recycle; /* its data goes to the block cache when freed (rfi_array_alloc_recycled) */
};

/* Array data: rfi_malloc_aligned(n), or a block of the same rounded size that
 * an array freed before (block_cache.c); freed with rfi_block_free(p, n, keep),
 * n as allocated; keep: the block may stay in the cache. */
RFI_FUNC void *rfi_block_alloc(size_t n);
RFI_FUNC void rfi_block_free(void *p, size_t n, bool keep);

/* Takes one more reference (returns a). */
RFI_FUNC rf_array *rfi_array_retain(rf_array *a);
/* Drops one reference, freeing the array at zero. NULL ok. */
RFI_FUNC void rfi_array_release(rf_array *a);
/* A new uninitialised array (refs = 1); NULL with RF_E_NOMEM/RF_E_INVALID set. */
RFI_FUNC rf_array *rfi_array_alloc(const char *op, rf_device *dev, rf_dtype dt,
                                   const int64_t *dims, int rank);
/* As rfi_array_alloc, for an array that a loop makes anew at every pass (a run's
 * output, a loader's batch, a copy): its data may stay in the block cache when
 * it is freed, for the next one. */
RFI_FUNC rf_array *rfi_array_alloc_recycled(const char *op, rf_device *dev, rf_dtype dt,
                                            const int64_t *dims, int rank);
RFI_FUNC bool rfi_device_is_compute(const rf_device *dev);
/* Element i of a buffer of dtype dt as a double (bool: 0 or 1; unknown
 * dtypes: NaN). */
RFI_FUNC double rfi_element_as_double(rf_dtype dt, const void *p, int64_t i);

/* ---- Backends --------------------------------------------------------------------
 * A backend turns a verified program into something it can run. `prepare`
 * borrows the program for the executable's lifetime and may keep a state
 * pointer; `run` reads arguments and captures, writes every output and the
 * staged value of every update (it must not write captures itself: the
 * executable applies updates after a successful run). */
typedef struct rfi_run_io {
    void *const *args;     /* g->n_args pointers */
    void *const *captures; /* g->n_captures pointers (read only) */
    void *const *outputs;  /* g->n_outputs preallocated buffers */
    void *const *updates;  /* g->n_updates preallocated staging buffers */
} rfi_run_io;

typedef struct rfi_backend {
    const char *name;
    rf_status (*prepare)(const rfi_graph *g, void **state);
    rf_status (*run)(void *state, const rfi_graph *g, const rfi_run_io *io);
    void (*release)(void *state);
    /* When true the backend applies the updates itself, in place (io->updates
     * is NULL and io->captures are writable): it must then never fail after
     * it has started writing a capture. A compiled module writes captures
     * only after its last call step (the steps that can fail: fuse.c's
     * in-place rule 5), so it can; the interpreter stages them instead. */
    bool writes_updates;
    /* Bytes the executable holds for intermediates and workspaces, known
     * before the first run (NULL: unknown, reported as 0). */
    size_t (*memory)(void *state);
    /* Starts, in the background, loading what prepare will need (a library),
     * so it overlaps tracing and autodiff; NULL: nothing to load. */
    void (*warm_up)(void);
    /* Waits until what warm_up started is done (NULL: nothing to wait for).
     * rf_compile calls it before it returns, failed or not, so no library
     * work runs behind the caller's back: a program that exits right after
     * a failed compile must not race the library's own teardown. */
    void (*settle)(void);
    /* A backend that rewrites the program before it plans it gives the
     * rewrite as a stage of its own (NULL: none; prepare alone is used), so
     * rf_compile can keep its result on disk (lower_memo.h). optimise must
     * be a pure function of the program, this build of the library, and what
     * optimise_context appends (the environment switches it reads).
     * prepare_optimised(g, opt, state) is prepare(g, state) given
     * opt = optimise(g); it takes opt over, even when it fails. */
    rf_status (*optimise)(const rfi_graph *g, rfi_graph **opt);
    void (*optimise_context)(rfi_strbuf *b);
    rf_status (*prepare_optimised)(const rfi_graph *g, rfi_graph *opt, void **state);
} rfi_backend;

RFI_FUNC extern const rfi_backend rfi_interp_backend;
RFI_FUNC extern const rfi_backend rfi_cpu_backend;

/* ---- Program pipeline ---------------------------------------------------------------
 * Autodiff: a copy of g in which every GRAD node is replaced by ordinary ops
 * computing the gradient. Programs without GRAD nodes are copied unchanged.
 * On failure *out is NULL and the message says why. */
RFI_FUNC rf_status rfi_autodiff(const rfi_graph *g, rfi_graph **out);
/* Dead-code elimination: a copy of g without nodes that reach no output or
 * update (arguments and captures keep their indices). */
RFI_FUNC rf_status rfi_dce(const rfi_graph *g, rfi_graph **out);
/* Canonical order: a copy of g whose node order, capture numbers and random
 * streams follow from its structure, not from the order its nodes were
 * created in (canonical_order.c); dead nodes and captures neither read nor
 * assigned are left out. Run on every traced program. */
RFI_FUNC rf_status rfi_canonical_order(const rfi_graph *g, rfi_graph **out);

/* RF_DUMP support: writes `text` to $RF_DUMP/<name>-<hash>.<stage>.txt when
 * RF_DUMP is set. Failures to write only warn on stderr. */
RFI_FUNC void rfi_dump(const char *name, uint64_t hash, const char *stage, const char *text);
/* Whether RF_DUMP is set: callers skip printing programs nobody reads (they
 * cost milliseconds), and the caches step aside, since a dump wants every stage. */
RFI_FUNC bool rfi_dump_wanted(void);

/* RF_OK for a valid rf_precision, else RF_E_INVALID with the message
 * "<what> <p> is none of RF_PRECISION_F32 (0) and RF_PRECISION_BF16 (1)". */
RFI_FUNC rf_status rfi_check_precision(const char *what, rf_precision p);

struct rf_exec {
    rfi_graph *prog;         /* final program (owned); holds the capture references */
    const rfi_backend *backend;
    void *state;             /* backend state */
    char *text;              /* rfi_print(prog), made on demand */
    uint64_t hash;
    rf_device *device;
    /* Made once at compile time so a run allocates nothing but the output
     * arrays it hands out: the pointer table (args, captures, outputs,
     * updates) and, unless the backend writes updates itself, the staging
     * memory of every update. An executable runs one call at a time: runs
     * hold run_lock, so calls from several threads wait for each other. */
    void **ptrs;
    void **staged;
    /* The address range spanning every updated captured array (empty: lo == hi): an
     * argument outside it overlaps none of them (exec.c checks every run). */
    uintptr_t updated_lo, updated_hi;
    /* The models' train/test modes the program was traced with: a run in
     * another mode would compute the other mode's forward with this one's
     * (Dropout still dropping after rf_testmode), so it is refused. */
    rfi_watch_list watches;
    pthread_mutex_t run_lock;
};

/* A new, empty executable (its run lock made), or NULL with RF_E_NOMEM set;
 * rf_exec_free takes it in any state. */
RFI_FUNC rf_exec *rfi_exec_new(void);

/* Runs e like rf_exec_run but writes the outputs into caller memory
 * (out[i] holds rfi_node_nbytes(output i) bytes) and allocates nothing: the
 * path rf_trainstep takes every step. The same argument checks and update
 * semantics; the watched modes are the caller's to check (the step cache
 * finds an entry only while they hold), not checked again every step. */
RFI_FUNC rf_status rfi_exec_run_into(rf_exec *e, rf_array *const *args, int nargs,
                                     void *const *out);
/* Makes e's pointer table and staging memory (called by rf_compile). */
RFI_FUNC rf_status rfi_exec_init_buffers(rf_exec *e);

#endif
