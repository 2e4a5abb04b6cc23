/* core.h: internal services every part of reflux uses: error messages,
 * the allocation hook, a growable arena, hashing, small helpers.
 *
 * Internal cross-file functions carry the rfi_ prefix and hidden visibility
 * (the library is built with -fvisibility=hidden; only RF_API is exported).
 */
#ifndef RF_CORE_INTERNAL_H
#define RF_CORE_INTERNAL_H

#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "reflux.h"

#define RFI_FUNC __attribute__((visibility("hidden")))

/* ---- Errors ------------------------------------------------------------------
 * The message buffer is thread-local (per-thread state, with the count of
 * allocations that failed on the thread: rfi_alloc_failures_here). */
#define RFI_ERRMSG_MAX 2048
/* Sets this thread's message (printf-style) and returns st. */
RFI_FUNC rf_status rfi_error(rf_status st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
RFI_FUNC rf_status rfi_verror(rf_status st, const char *fmt, va_list ap);
/* How many failures this thread has recorded (it only grows): a call that
 * records none leaves it, so comparing it tells whether a message is new. */
RFI_FUNC uint64_t rfi_error_count(void);

/* ---- Allocation ----------------------------------------------------------------
 * Every host allocation of the library goes through these (one hook, so tests
 * can count allocations and inject failures). They return NULL on failure and
 * never abort. */
RFI_FUNC void *rfi_malloc(size_t n);
RFI_FUNC void *rfi_calloc(size_t n, size_t size);
/* n bytes starting on a 64-byte boundary (RFI_DATA_ALIGN), freed with rfi_free:
 * for array data, whose rows kernels read in whole vectors. malloc's 16-byte
 * alignment makes every 64-byte load of such a row straddle two cache lines. */
#define RFI_DATA_ALIGN 64
RFI_FUNC void *rfi_malloc_aligned(size_t n);
/* Counts one allocation and says whether the test hook fails it: what each of
 * these does first, for an allocator that reuses memory (block_cache.c). */
RFI_FUNC bool rfi_alloc_hook_fails(void);
RFI_FUNC void *rfi_realloc(void *p, size_t n);
RFI_FUNC void rfi_free(void *p);
RFI_FUNC char *rfi_strdup(const char *s);
/* Makes room for one more element of `size` bytes in the array *items,
 * which holds n elements in a capacity of *cap (doubled from 16 when full,
 * through rfi_realloc). false: out of memory, *items and *cap unchanged. */
RFI_FUNC bool rfi_grow(void **items, int n, int *cap, size_t size);
/* Number of rfi_malloc/calloc/realloc calls that allocated so far (for tests
 * of "zero allocations per step"). */
RFI_FUNC uint64_t rfi_alloc_count(void);
/* Test hook: the allocation after the next n fails, and with `persistent`
 * every one after it too; n < 0 turns failures off. Resets the count of
 * failed allocations, which rfi_alloc_failures returns. */
RFI_FUNC void rfi_alloc_fail_after(int64_t n, bool persistent);
RFI_FUNC uint64_t rfi_alloc_failures(void);
/* Allocations that have failed on the calling thread so far (the hook's and
 * real ones). Code that treats a failed allocation as a "no" (a fusion or
 * layout not taken) compares this before and after, where a degraded answer
 * must not be kept: a plan is a function of its program and options, and
 * the disk cache's index relies on that (plan.c, cpu_backend.c, trace.c). */
RFI_FUNC uint64_t rfi_alloc_failures_here(void);

/* A growable string buffer for printers and messages. On allocation failure
 * it sets `failed` and drops further text. */
typedef struct rfi_strbuf {
    char *data;
    size_t len, cap;
    bool failed;
} rfi_strbuf;
RFI_FUNC void rfi_sb_printf(rfi_strbuf *sb, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
RFI_FUNC void rfi_sb_vprintf(rfi_strbuf *sb, const char *fmt, va_list ap)
    __attribute__((format(printf, 2, 0)));
/* Room for `extra` more bytes and a NUL; false (and `failed` set) when out of
 * memory or already failed. */
RFI_FUNC bool rfi_sb_reserve(rfi_strbuf *sb, size_t extra);
/* Appends n bytes, which may be any bytes (len counts them; a NUL follows). */
RFI_FUNC void rfi_sb_put(rfi_strbuf *sb, const void *p, size_t n);
RFI_FUNC void rfi_sb_free(rfi_strbuf *sb);
/* "f32[16,8]" into sb. */
RFI_FUNC void rfi_sb_type(rfi_strbuf *sb, rf_dtype dt, const int64_t *dims, int rank);
/* Writes "f32[16,8]" into buf (always NUL-terminated); returns buf. */
RFI_FUNC const char *rfi_type_str(char *buf, size_t n, rf_dtype dt, const int64_t *dims, int rank);

/* ---- Environment -------------------------------------------------------------------
 * A size in MiB from environment variable `name`, in bytes: `dflt_mb` when it
 * is unset, empty, or not a plain decimal count of at most 2^40 (the caches'
 * RF_CACHE_MAX_MB and RF_ARRAY_CACHE_MB). */
RFI_FUNC uint64_t rfi_env_megabytes(const char *name, uint64_t dflt_mb);

/* ---- Shared flags and the executables watching them -------------------------------
 * A flag is a bool shared by reference (a model's train/test mode): its owner
 * and every executable traced while it was read hold a reference, so a run can
 * tell whether the value the program was traced with still holds. Every set
 * is stamped from one process-wide clock (atomic), so a trace can tell a flag
 * its own function set (then the program does not depend on the caller's
 * value) from one the caller chose. Once the owner is gone (rfi_flag_orphan)
 * nobody can set it again, and a watch on it always holds. */
typedef struct rfi_flag {
    atomic_int refs;
    atomic_bool value;
    atomic_bool orphaned;      /* the owner released it */
    atomic_uint_least64_t set_at; /* the clock when last set; 0: never */
} rfi_flag;
RFI_FUNC rfi_flag *rfi_flag_new(bool value); /* one reference; NULL on out of memory */
RFI_FUNC rfi_flag *rfi_flag_retain(rfi_flag *f);
RFI_FUNC void rfi_flag_release(rfi_flag *f); /* NULL ok */
RFI_FUNC void rfi_flag_orphan(rfi_flag *f);  /* the owner's release (NULL ok) */
RFI_FUNC void rfi_flag_set(rfi_flag *f, bool value); /* stamps set_at */
/* The clock now: a flag with set_at above it was set later. */
RFI_FUNC uint64_t rfi_flag_clock(void);

/* The flags a program was traced with: the value read and whose flag it is. */
typedef enum rfi_watch_kind {
    RFI_WATCH_MODE,  /* a layer's train (true) or test mode */
    RFI_WATCH_FROZEN /* an optimiser's parameter frozen (true) or trained */
} rfi_watch_kind;
typedef struct rfi_watch {
    rfi_flag *flag; /* one reference */
    bool seen;
    rfi_watch_kind kind; /* RFI_WATCH_MODE unless the caller says otherwise */
    char what[112]; /* "Dropout(0.5) (layer \"1\")", for messages */
} rfi_watch;
/* The words for a watched value in messages: "in train mode", "frozen", ... */
RFI_FUNC const char *rfi_watch_state(const rfi_watch *w, bool value);
typedef struct rfi_watch_list {
    rfi_watch *v; /* rfi_malloc */
    int n, cap;
} rfi_watch_list;
/* Adds (f, seen) unless f is listed already: its index, -1 when listed, -2 when
 * out of memory. `what` is left empty for the caller. */
RFI_FUNC int rfi_watch_add(rfi_watch_list *l, rfi_flag *f, bool seen);
/* The first watch whose flag no longer has the value seen (an orphaned flag's
 * always holds); NULL when all hold. */
RFI_FUNC const rfi_watch *rfi_watch_broken(const rfi_watch_list *l);
RFI_FUNC void rfi_watch_list_free(rfi_watch_list *l); /* empties it */

/* ---- Arena -----------------------------------------------------------------------
 * Chunked bump allocator: objects are never freed one at a time; freeing the
 * arena frees them all. Memory is zeroed. Pointers stay valid (chunks never move). */
typedef struct rfi_arena_chunk rfi_arena_chunk;
typedef struct rfi_arena {
    rfi_arena_chunk *head;
    size_t used, cap; /* in the head chunk */
} rfi_arena;
RFI_FUNC void *rfi_arena_alloc(rfi_arena *a, size_t n); /* 16-byte aligned, zeroed; NULL on OOM */
RFI_FUNC void rfi_arena_free(rfi_arena *a);

/* ---- Hashing (FNV-1a 64 plus a mixer) ---------------------------------------------- */
#define RFI_HASH_INIT 0xcbf29ce484222325ull
RFI_FUNC uint64_t rfi_hash_bytes(uint64_t h, const void *p, size_t n);
RFI_FUNC uint64_t rfi_hash_u64(uint64_t h, uint64_t v);

/* ---- Shapes ------------------------------------------------------------------------ */
RFI_FUNC int64_t rfi_numel(const int64_t *dims, int rank);
RFI_FUNC bool rfi_dtype_is_float(rf_dtype dt);
RFI_FUNC bool rfi_dtype_is_int(rf_dtype dt); /* i32, i64, u8 */
RFI_FUNC bool rfi_dtype_valid(int dt);
/* Whether the NUL-terminated s is well-formed UTF-8 (no overlong forms,
 * surrogates or code points above U+10FFFF). */
RFI_FUNC bool rfi_valid_utf8(const char *s);
/* x rounded to bfloat16 (8 significant bits) and widened back: to nearest
 * even, a subnormal to a zero of its sign, a NaN stays a NaN (quiet): what
 * x86's VCVTNEPS2BF16 gives, and so oneDNN, whose results a matmul of
 * RF_PRECISION_BF16 must repeat on every backend. Selects, not branches, so
 * that a loop over it vectorises (dnnl_matmul.c). */
static inline float rfi_round_bf16(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    uint32_t r = u + 0x7fffu + ((u >> 16) & 1u);    /* ties to the even one; past the top, inf */
    r = (u & 0x7fffffffu) > 0x7f800000u ? u | 0x00400000u : r; /* NaN */
    r = (u & 0x7f800000u) == 0 ? u & 0x80000000u : r;         /* zero or subnormal */
    r &= 0xffff0000u;
    memcpy(&x, &r, sizeof x);
    return x;
}

/* ---- Files --------------------------------------------------------------------------- */
/* mkdir -p: creates every missing directory of `path` with mode 0700 and
 * checks the result is a directory. 0, or -1 with errno set. */
RFI_FUNC int rfi_make_dirs(const char *path);
/* Opens path for reading if it is a regular file, without waiting on a FIFO
 * (whose open blocks until a writer comes) or a device: the descriptor, or
 * -1 with errno set (EINVAL: not a regular file); *size receives its size. */
RFI_FUNC int rfi_open_regular(const char *path, int64_t *size);

/* ---- Counter-based random numbers (Philox4x32-10) ------------------------------------
 * Element i of a draw uses Philox block counter {i lo, i hi, counter lo32,
 * counter hi32 ^ stream << 16} under key {seed lo32, seed hi32}: the same (seed,
 * counter, stream) gives the same values on every platform. dist 0: uniform
 * [0,1); 1: standard normal (Box-Muller on the block's words). dt: f32 or f64. */
/* Philox4x32-10's round multipliers and key increments (Salmon et al.). */
#define RFI_PHILOX_M0 0xD2511F53u
#define RFI_PHILOX_M1 0xCD9E8D57u
#define RFI_PHILOX_W0 0x9E3779B9u
#define RFI_PHILOX_W1 0xBB67AE85u
RFI_FUNC void rfi_philox4x32(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);
RFI_FUNC void rfi_random_fill(uint64_t seed, uint64_t counter, uint32_t stream, int dist,
                              rf_dtype dt, void *out, int64_t n);
/* rfi_random_fill's values from a block's words, for kernels that compute the
 * blocks their own way: uniform in [0, 1) with 24 (f32: word 0) or 53 (f64:
 * words 0 and 1) random bits, and Box-Muller's normal from two uniforms
 * (f32: words 0 and 1; f64: words 0-1 and 2-3), in double. */
static inline double rfi_random_unit_f32(uint32_t w)
{
    return (double)(w >> 8) * (1.0 / 16777216.0);
}
static inline double rfi_random_unit_f64(uint32_t hi, uint32_t lo)
{
    return (double)(((uint64_t)hi << 32 | lo) >> 11) * (1.0 / 9007199254740992.0);
}
static inline double rfi_random_normal(double u1, double u2)
{
    /* 1 - u1 is in (0, 1], so the log is finite */
    return sqrt(-2.0 * log(1.0 - u1)) * cos(6.283185307179586476925 * u2);
}

#endif
