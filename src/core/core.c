/* core.c: error messages, the allocation hook, string buffers, the arena,
 * hashing and dtype helpers. Nothing here knows about graphs or devices.
 */
#include "core.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- Errors ------------------------------------------------------------------ */

/* Per-thread state, one of two pieces (the other: failed_here below): the
 * last failure's message and status, and how many failures were recorded. */
static _Thread_local char errmsg[RFI_ERRMSG_MAX];
static _Thread_local rf_status errstatus;
static _Thread_local uint64_t errcount; /* failures recorded so far */

/* The message is formatted aside and then copied, because its arguments may
 * be the message itself: rf_set_error(st, "saving: %s", rf_errmsg()) quotes
 * the failure it wraps, and vsnprintf's output must not overlap its input. */
rf_status rfi_verror(rf_status st, const char *fmt, va_list ap)
{
    char msg[RFI_ERRMSG_MAX];
    vsnprintf(msg, sizeof msg, fmt, ap);
    memcpy(errmsg, msg, strlen(msg) + 1);
    errstatus = st;
    errcount++;
    return st;
}

uint64_t rfi_error_count(void) { return errcount; }

rf_status rfi_error(rf_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    rfi_verror(st, fmt, ap);
    va_end(ap);
    return st;
}

const char *rf_errmsg(void) { return errmsg; }
rf_status rf_errstatus(void) { return errstatus; }

void rf_clear_error(void)
{
    errmsg[0] = '\0';
    errstatus = RF_OK;
}

rf_status rf_set_error(rf_status st, const char *fmt, ...)
{
    if (st == RF_OK || (unsigned)st >= RF_STATUS_COUNT)
        return rfi_error(RF_E_INVALID, "rf_set_error: status %d is not an error status "
                         "(RF_E_INVALID .. RF_E_INTERNAL)", (int)st);
    if (!fmt)
        return rfi_error(st, "%s", rf_status_str(st));
    va_list ap;
    va_start(ap, fmt);
    rfi_verror(st, fmt, ap);
    va_end(ap);
    return st;
}

const char *rf_status_str(rf_status st)
{
    static const char *const names[RF_STATUS_COUNT] = {
        "RF_OK",     "RF_E_INVALID", "RF_E_SHAPE",   "RF_E_DTYPE",       "RF_E_DEVICE",
        "RF_E_NOMEM", "RF_E_DOMAIN", "RF_E_IO",      "RF_E_CORRUPT",     "RF_E_COMPILE",
        "RF_E_UNSUPPORTED", "RF_E_INTERNAL",
    };
    if ((unsigned)st >= RF_STATUS_COUNT)
        return "RF_E_UNKNOWN";
    return names[st];
}

const char *rf_version(void) { return "0.1.0"; }

/* ---- Allocation ---------------------------------------------------------------- */

/* Documented global state: the allocation count, and the failure hook tests
 * set (fail_at: the number of the first allocation that fails, 0 for none). */
static atomic_uint_fast64_t n_allocs;
static atomic_uint_fast64_t fail_at;
static atomic_bool fail_persistent;
static atomic_uint_fast64_t n_failed;
/* Allocations that failed on this thread, for rfi_alloc_failures_here. */
static _Thread_local uint64_t failed_here;

/* Counts one allocation; true if the hook says it fails. */
static bool allocation_fails(void)
{
    uint64_t k = atomic_fetch_add_explicit(&n_allocs, 1, memory_order_relaxed) + 1;
    uint64_t at = atomic_load_explicit(&fail_at, memory_order_relaxed);
    if (at == 0 || k < at || (k > at && !atomic_load(&fail_persistent)))
        return false;
    atomic_fetch_add(&n_failed, 1);
    failed_here++;
    return true;
}

bool rfi_alloc_hook_fails(void) { return allocation_fails(); }

/* Passes an allocation's result through, counting a failure. */
static void *counted(void *p)
{
    if (!p)
        failed_here++;
    return p;
}

uint64_t rfi_alloc_failures_here(void) { return failed_here; }

void rfi_alloc_fail_after(int64_t n, bool persistent)
{
    atomic_store(&fail_at, 0);
    atomic_store(&n_failed, 0);
    atomic_store(&fail_persistent, persistent);
    if (n >= 0)
        atomic_store(&fail_at, atomic_load(&n_allocs) + (uint64_t)n + 1);
}

uint64_t rfi_alloc_failures(void) { return atomic_load(&n_failed); }

void *rfi_malloc(size_t n)
{
    if (allocation_fails())
        return NULL;
    return counted(malloc(n ? n : 1));
}

void *rfi_calloc(size_t n, size_t size)
{
    if (allocation_fails())
        return NULL;
    return counted(n == 0 || size == 0 ? calloc(1, 1) : calloc(n, size));
}

void *rfi_malloc_aligned(size_t n)
{
    if (allocation_fails())
        return NULL;
    if (n > SIZE_MAX - RFI_DATA_ALIGN)
        return counted(NULL);
    /* C11 asks for a size that is a multiple of the alignment */
    size_t rounded = (n + RFI_DATA_ALIGN - 1) / RFI_DATA_ALIGN * RFI_DATA_ALIGN;
    return counted(aligned_alloc(RFI_DATA_ALIGN, rounded ? rounded : RFI_DATA_ALIGN));
}

/* A failed realloc leaves p allocated, as realloc does. */
void *rfi_realloc(void *p, size_t n)
{
    if (allocation_fails())
        return NULL;
    return counted(realloc(p, n ? n : 1));
}

void rfi_free(void *p) { free(p); }

bool rfi_grow(void **items, int n, int *cap, size_t size)
{
    if (n < *cap)
        return true;
    int new_cap = *cap ? *cap * 2 : 16;
    void *p = rfi_realloc(*items, (size_t)new_cap * size);
    if (!p)
        return false;
    *items = p;
    *cap = new_cap;
    return true;
}

char *rfi_strdup(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = rfi_malloc(n);
    if (d)
        memcpy(d, s, n);
    return d;
}

uint64_t rfi_alloc_count(void) { return atomic_load(&n_allocs); }

/* ---- Environment ----------------------------------------------------------------- */

uint64_t rfi_env_megabytes(const char *name, uint64_t dflt_mb)
{
    const char *v = getenv(name);
    uint64_t mb = dflt_mb;
    if (v && *v) {
        char *end = NULL;
        errno = 0;
        unsigned long long n = strtoull(v, &end, 10);
        if (errno == 0 && end && *end == '\0' && v[0] != '-' && n <= (1ull << 40))
            mb = n;
    }
    return mb << 20;
}

/* ---- Shared flags and watches ---------------------------------------------------- */

static atomic_uint_least64_t flag_clock; /* documented in core.h */

rfi_flag *rfi_flag_new(bool value)
{
    rfi_flag *f = rfi_malloc(sizeof *f);
    if (f) {
        atomic_init(&f->refs, 1);
        atomic_init(&f->value, value);
        atomic_init(&f->orphaned, false);
        atomic_init(&f->set_at, 0);
    }
    return f;
}

void rfi_flag_set(rfi_flag *f, bool value)
{
    atomic_store(&f->value, value);
    atomic_store(&f->set_at, atomic_fetch_add(&flag_clock, 1) + 1);
}

uint64_t rfi_flag_clock(void) { return atomic_load(&flag_clock); }

void rfi_flag_orphan(rfi_flag *f)
{
    if (f) {
        atomic_store(&f->orphaned, true);
        rfi_flag_release(f);
    }
}

rfi_flag *rfi_flag_retain(rfi_flag *f)
{
    if (f)
        atomic_fetch_add(&f->refs, 1);
    return f;
}

void rfi_flag_release(rfi_flag *f)
{
    if (f && atomic_fetch_sub(&f->refs, 1) == 1)
        rfi_free(f);
}

int rfi_watch_add(rfi_watch_list *l, rfi_flag *f, bool seen)
{
    for (int i = 0; i < l->n; i++)
        if (l->v[i].flag == f)
            return -1;
    if (!rfi_grow((void **)&l->v, l->n, &l->cap, sizeof *l->v))
        return -2;
    rfi_watch *w = &l->v[l->n];
    w->flag = rfi_flag_retain(f);
    w->seen = seen;
    w->kind = RFI_WATCH_MODE;
    w->what[0] = '\0';
    return l->n++;
}

const char *rfi_watch_state(const rfi_watch *w, bool value)
{
    if (w->kind == RFI_WATCH_FROZEN)
        return value ? "frozen" : "trained";
    return value ? "in train mode" : "in test mode";
}

const rfi_watch *rfi_watch_broken(const rfi_watch_list *l)
{
    for (int i = 0; i < l->n; i++) {
        const rfi_flag *f = l->v[i].flag;
        if (!atomic_load(&f->orphaned) && atomic_load(&f->value) != l->v[i].seen)
            return &l->v[i];
    }
    return NULL;
}

void rfi_watch_list_free(rfi_watch_list *l)
{
    for (int i = 0; i < l->n; i++)
        rfi_flag_release(l->v[i].flag);
    rfi_free(l->v);
    *l = (rfi_watch_list){0};
}

/* ---- String buffers ----------------------------------------------------------- */

bool rfi_sb_reserve(rfi_strbuf *sb, size_t extra)
{
    if (sb->failed)
        return false;
    if (sb->len + extra + 1 <= sb->cap)
        return true;
    size_t cap = sb->cap ? sb->cap : 256;
    while (cap < sb->len + extra + 1)
        cap *= 2;
    char *d = rfi_realloc(sb->data, cap);
    if (!d) {
        sb->failed = true;
        return false;
    }
    sb->data = d;
    sb->cap = cap;
    return true;
}

void rfi_sb_put(rfi_strbuf *sb, const void *p, size_t n)
{
    if (!rfi_sb_reserve(sb, n))
        return;
    memcpy(sb->data + sb->len, p, n);
    sb->len += n;
    sb->data[sb->len] = '\0';
}

void rfi_sb_vprintf(rfi_strbuf *sb, const char *fmt, va_list ap)
{
    if (sb->failed)
        return;
    /* Format straight into the free space; only when it does not fit, grow
     * and format again (printers call this a lot: one vsnprintf usually). */
    size_t room = sb->cap - sb->len;
    va_list again;
    va_copy(again, ap);
    int need = vsnprintf(room ? sb->data + sb->len : NULL, room, fmt, ap);
    if (need < 0)
        sb->failed = true;
    else if ((size_t)need < room)
        sb->len += (size_t)need;
    else if (rfi_sb_reserve(sb, (size_t)need)) {
        vsnprintf(sb->data + sb->len, sb->cap - sb->len, fmt, again);
        sb->len += (size_t)need;
    }
    va_end(again);
}

void rfi_sb_printf(rfi_strbuf *sb, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    rfi_sb_vprintf(sb, fmt, ap);
    va_end(ap);
}

void rfi_sb_free(rfi_strbuf *sb)
{
    rfi_free(sb->data);
    memset(sb, 0, sizeof *sb);
}

void rfi_sb_type(rfi_strbuf *sb, rf_dtype dt, const int64_t *dims, int rank)
{
    rfi_sb_printf(sb, "%s[", rf_dtype_name(dt));
    for (int i = 0; i < rank; i++)
        rfi_sb_printf(sb, i ? ",%lld" : "%lld", (long long)dims[i]);
    rfi_sb_printf(sb, "]");
}

const char *rfi_type_str(char *buf, size_t n, rf_dtype dt, const int64_t *dims, int rank)
{
    size_t len = (size_t)snprintf(buf, n, "%s[", rf_dtype_name(dt));
    for (int i = 0; i < rank && len < n; i++)
        len += (size_t)snprintf(buf + len, n - len, i ? ",%lld" : "%lld", (long long)dims[i]);
    if (len < n)
        snprintf(buf + len, n - len, "]");
    return buf;
}

/* ---- Arena ---------------------------------------------------------------------- */

struct rfi_arena_chunk {
    rfi_arena_chunk *next;
    size_t cap;
    _Alignas(16) unsigned char mem[];
};

/* Under AddressSanitizer every allocation is a chunk of its own, of exactly its size,
 * so that a read past one is caught, not served from its neighbour: a node's attr read
 * beyond the lists the node stores (ir.h), say. */
#ifdef __SANITIZE_ADDRESS__
enum { ARENA_CHUNK = 0, ARENA_ROUND = 1 };
#else
enum { ARENA_CHUNK = 65536, ARENA_ROUND = 16 };
#endif

void *rfi_arena_alloc(rfi_arena *a, size_t n)
{
    n = (n + ARENA_ROUND - 1) & ~(size_t)(ARENA_ROUND - 1);
    if (!a->head || a->used + n > a->cap) {
        size_t cap = n > ARENA_CHUNK ? n : ARENA_CHUNK;
        rfi_arena_chunk *c = rfi_malloc(sizeof *c + cap);
        if (!c)
            return NULL;
        c->next = a->head;
        c->cap = cap;
        a->head = c;
        a->used = 0;
        a->cap = cap;
    }
    void *p = a->head->mem + a->used;
    a->used += n;
    memset(p, 0, n);
    return p;
}

void rfi_arena_free(rfi_arena *a)
{
    rfi_arena_chunk *c = a->head;
    while (c) {
        rfi_arena_chunk *next = c->next;
        rfi_free(c);
        c = next;
    }
    memset(a, 0, sizeof *a);
}

/* ---- Hashing -------------------------------------------------------------------- */

uint64_t rfi_hash_bytes(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

uint64_t rfi_hash_u64(uint64_t h, uint64_t v)
{
    /* splitmix64 finaliser on the combination: FNV alone mixes 8-byte words poorly */
    v += h + 0x9e3779b97f4a7c15ull;
    v = (v ^ (v >> 30)) * 0xbf58476d1ce4e5b9ull;
    v = (v ^ (v >> 27)) * 0x94d049bb133111ebull;
    return v ^ (v >> 31);
}

/* ---- Shapes and dtypes ------------------------------------------------------------ */

int64_t rfi_numel(const int64_t *dims, int rank)
{
    int64_t n = 1;
    for (int i = 0; i < rank; i++)
        n *= dims[i];
    return n;
}

bool rfi_dtype_valid(int dt) { return dt >= 0 && dt < RF_DTYPE_COUNT; }
bool rfi_dtype_is_float(rf_dtype dt) { return dt == RF_F32 || dt == RF_F64; }
bool rfi_dtype_is_int(rf_dtype dt) { return dt == RF_I32 || dt == RF_I64 || dt == RF_U8; }

const char *rf_dtype_name(rf_dtype dt)
{
    static const char *const names[RF_DTYPE_COUNT] = {"f32", "f64", "i32", "i64", "u8", "bool"};
    return rfi_dtype_valid((int)dt) ? names[dt] : "?";
}

size_t rf_dtype_size(rf_dtype dt)
{
    static const size_t sizes[RF_DTYPE_COUNT] = {4, 8, 4, 8, 1, 1};
    return rfi_dtype_valid((int)dt) ? sizes[dt] : 0;
}

bool rfi_valid_utf8(const char *s)
{
    const unsigned char *p = (const unsigned char *)s;
    while (*p) {
        int n = *p < 0x80 ? 0 : (*p & 0xE0) == 0xC0 ? 1 : (*p & 0xF0) == 0xE0 ? 2
              : (*p & 0xF8) == 0xF0 ? 3 : -1;
        if (n < 0 || (n == 1 && *p < 0xC2) || (n == 3 && *p > 0xF4))
            return false;
        unsigned cp = n == 0 ? *p : *p & (0x3F >> n);
        for (int k = 1; k <= n; k++) {
            if ((p[k] & 0xC0) != 0x80)
                return false;
            cp = cp << 6 | (p[k] & 0x3F);
        }
        if ((n == 2 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) ||
            (n == 3 && (cp < 0x10000 || cp > 0x10FFFF)))
            return false;
        p += n + 1;
    }
    return true;
}
