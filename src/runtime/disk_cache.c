/* disk_cache.c: the on-disk cache of compiled modules (see disk_cache.h for
 * the layout, the locking and the security rules).
 *
 * This file finds the cache directory, computes keys, validates entries
 * (ownership, permissions, manifest, source and object hashes), serialises
 * builds of one key across processes with flock, and writes every file under
 * a temporary name before renaming it into place. It does not compile or load
 * anything itself (the caller's callbacks do) and never evicts entries.
 */
#include "disk_cache.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#define MANIFEST_MAGIC "reflux module cache entry v1\n"

/* ---- Keys: two independent 64-bit hashes --------------------------------------------- */

static uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static uint64_t fmix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

/* A word-at-a-time multiply-rotate hash; `rot` and `mul` pick one of two
 * independent members of the family (sources are hundreds of KB, so a
 * byte-at-a-time hash would cost a millisecond per warm compile). */
static uint64_t mix_bytes(uint64_t h, const void *p, size_t n, int rot, uint64_t mul)
{
    const unsigned char *b = p;
    for (; n >= 8; b += 8, n -= 8) {
        uint64_t w;
        memcpy(&w, b, 8);
        h = rotl64(h ^ fmix64(w), rot) * mul + 0x52dce729u;
    }
    uint64_t w = 0;
    memcpy(&w, b, n); /* the n < 8 tail bytes, plus their count in the top byte */
    w ^= (uint64_t)n << 56;
    return rotl64(h ^ fmix64(w), rot) * mul + 0x52dce729u;
}

static uint64_t hash1_bytes(uint64_t h, const void *p, size_t n)
{
    return mix_bytes(h, p, n, 31, 0xc2b2ae3d27d4eb4full);
}

static uint64_t hash2_bytes(uint64_t h, const void *p, size_t n)
{
    return mix_bytes(h, p, n, 29, 0x9e3779b97f4a7c15ull);
}

typedef struct hash128 {
    uint64_t a, b;
} hash128;

/* Feeds one length-prefixed part, so ("ab","c") and ("a","bc") differ. */
static void hash128_part(hash128 *h, const void *p, size_t n)
{
    uint64_t len = n;
    h->a = hash1_bytes(hash1_bytes(h->a, &len, sizeof len), p, n);
    h->b = hash2_bytes(hash2_bytes(h->b, &len, sizeof len), p, n);
}

static void hash128_hex(hash128 h, char out[RFI_CACHE_KEY_HEX])
{
    snprintf(out, RFI_CACHE_KEY_HEX, "%016llx%016llx",
             (unsigned long long)rfi_hash_u64(0, h.a), (unsigned long long)fmix64(h.b));
}

static hash128 hash128_init(void) { return (hash128){RFI_HASH_INIT, 0x243f6a8885a308d3ull}; }

void rfi_disk_cache_key(const char *source, const char *context, char out[RFI_CACHE_KEY_HEX])
{
    hash128 h = hash128_init();
    hash128_part(&h, source, strlen(source));
    hash128_part(&h, context, strlen(context));
    hash128_hex(h, out);
}

/* ---- The directory --------------------------------------------------------------------- */


/* The configured directory path into buf; false when no variable names one. */
static bool configured_dir(char *buf, size_t n)
{
    const char *v = getenv("RF_CACHE_DIR");
    if (v && *v)
        return (size_t)snprintf(buf, n, "%s", v) < n;
    v = getenv("XDG_CACHE_HOME");
    if (v && v[0] == '/')
        return (size_t)snprintf(buf, n, "%s/reflux", v) < n;
    v = getenv("HOME");
    if (v && *v)
        return (size_t)snprintf(buf, n, "%s/.cache/reflux", v) < n;
    return false;
}

/* Whether st is a directory this user may trust: owned by it, writable by no one else. */
static const char *untrusted_dir_reason(const struct stat *st)
{
    if (!S_ISDIR(st->st_mode))
        return "not a directory";
    if (st->st_uid != geteuid())
        return "not owned by the current user";
    if (st->st_mode & (S_IWGRP | S_IWOTH))
        return "writable by group or others";
    return NULL;
}

rf_status rfi_disk_cache_dir(char **out)
{
    *out = NULL;
    char path[PATH_MAX];
    if (!configured_dir(path, sizeof path - 64))
        return rfi_error(RF_E_INVALID, "module cache: none of RF_CACHE_DIR, XDG_CACHE_HOME, "
                                       "HOME names a usable directory");
    if (rfi_make_dirs(path) != 0)
        return rfi_error(RF_E_IO, "module cache: cannot create directory %s: %s", path,
                         strerror(errno));
    struct stat st;
    if (stat(path, &st) != 0)
        return rfi_error(RF_E_IO, "module cache: cannot stat %s: %s", path, strerror(errno));
    const char *why = untrusted_dir_reason(&st);
    if (!why && access(path, W_OK | X_OK) != 0)
        why = "not writable";
    if (why)
        return rfi_error(RF_E_INVALID, "module cache: refusing directory %s: %s", path, why);
    *out = rfi_strdup(path);
    return *out ? RF_OK : rfi_error(RF_E_NOMEM, "module cache: out of memory");
}

/* A fresh private directory under $TMPDIR (else /tmp), for when the cache is unusable. */
static rf_status make_private_dir(char **out)
{
    const char *tmp = getenv("TMPDIR");
    if (!tmp || !*tmp)
        tmp = "/tmp";
    char templ[PATH_MAX];
    if ((size_t)snprintf(templ, sizeof templ - 64, "%s/reflux-XXXXXX", tmp) >= sizeof templ - 64)
        return rfi_error(RF_E_IO, "module cache: TMPDIR too long");
    if (!mkdtemp(templ))
        return rfi_error(RF_E_IO, "module cache: cannot create a private directory %s: %s",
                         templ, strerror(errno));
    *out = rfi_strdup(templ);
    return *out ? RF_OK : rfi_error(RF_E_NOMEM, "module cache: out of memory");
}

/* Set once the fallback warning has been printed (once per process). */
static atomic_bool warned_fallback;

static void warn_fallback(const char *why)
{
    if (atomic_exchange(&warned_fallback, true))
        return;
    fprintf(stderr, "reflux: warning: %s; compiling modules in private temporary directories "
                    "(not cached)\n", why);
}

/* ---- Files ------------------------------------------------------------------------------- */

typedef enum file_state { FILE_OK, FILE_MISSING, FILE_BAD } file_state;

/* Reads a whole file that this user may trust (regular, owned by the user,
 * writable by no one else) into *data (rfi_malloc'd, NUL-terminated). */
static file_state read_trusted(const char *path, char **data, size_t *len)
{
    *data = NULL;
    *len = 0;
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT ? FILE_MISSING : FILE_BAD;
    struct stat st;
    file_state s = FILE_BAD;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
        (st.st_mode & (S_IWGRP | S_IWOTH)) || st.st_size < 0)
        goto done;
    size_t n = (size_t)st.st_size;
    char *d = rfi_malloc(n + 1);
    if (!d)
        goto done;
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, d + got, n - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        got += (size_t)r;
    }
    if (got != n) {
        rfi_free(d);
        goto done;
    }
    d[n] = '\0';
    *data = d;
    *len = n;
    s = FILE_OK;
done:
    close(fd);
    return s;
}

/* A unique temporary name next to `path` (counter: only for unique names).
 * Paths are shorter than PATH_MAX, so n = PATH_MAX + 64 never truncates. */
static atomic_uint tmp_counter;

static void tmp_name(char *buf, size_t n, const char *path)
{
    snprintf(buf, n, "%s.tmp.%ld.%u", path, (long)getpid(), atomic_fetch_add(&tmp_counter, 1));
}

/* Writes data to path atomically (temporary file, mode 0600, then rename). */
static int write_atomic(const char *path, const void *data, size_t len)
{
    char tmp[PATH_MAX + 64];
    tmp_name(tmp, sizeof tmp, path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0)
        return -1;
    const char *p = data;
    size_t done = 0;
    while (done < len) {
        ssize_t w = write(fd, p + done, len - done);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            break;
        done += (size_t)w;
    }
    int saved = errno;
    if (close(fd) != 0 || done != len || rename(tmp, path) != 0) {
        saved = errno ? errno : saved;
        unlink(tmp);
        errno = saved;
        return -1;
    }
    return 0;
}

/* ---- Entries ------------------------------------------------------------------------------- */

typedef struct entry_paths {
    char dir[PATH_MAX];
    char src[PATH_MAX], obj[PATH_MAX], ok[PATH_MAX], lock[PATH_MAX];
} entry_paths;

static void set_paths(entry_paths *p, const char *dir, const char *key,
                      const rfi_disk_cache_ops *ops)
{
    snprintf(p->dir, sizeof p->dir, "%s", dir);
    snprintf(p->src, sizeof p->src, "%s/%s%s", dir, key, ops->source_ext);
    snprintf(p->obj, sizeof p->obj, "%s/%s%s", dir, key, ops->object_ext);
    snprintf(p->ok, sizeof p->ok, "%s/%s.ok", dir, key);
    snprintf(p->lock, sizeof p->lock, "%s/%s.lock", dir, key);
}

static void remove_entry(const entry_paths *p, bool keep_source)
{
    unlink(p->ok); /* first: without a manifest the rest is never trusted */
    unlink(p->obj);
    if (!keep_source)
        unlink(p->src);
}

/* The manifest text for a context and an object of the given size and hash. */
static void manifest_text(rfi_strbuf *sb, const char *context, size_t obj_len,
                          const char *obj_hash)
{
    rfi_sb_printf(sb, "%s%s\nobject_size=%zu\nobject_hash=%s\n", MANIFEST_MAGIC, context,
                  obj_len, obj_hash);
}

static void content_hash(const char *data, size_t len, char out[RFI_CACHE_KEY_HEX])
{
    hash128 h = hash128_init();
    hash128_part(&h, data, len);
    hash128_hex(h, out);
}

/* Whether the entry's manifest, source and object are all present, trusted and
 * consistent with (source, context). */
static bool entry_valid(const entry_paths *p, const char *source, const char *context)
{
    char *man = NULL, *src = NULL, *obj = NULL;
    size_t man_len, src_len, obj_len;
    bool ok = false;
    if (read_trusted(p->ok, &man, &man_len) != FILE_OK ||
        read_trusted(p->src, &src, &src_len) != FILE_OK || src_len != strlen(source) ||
        memcmp(src, source, src_len) != 0 || read_trusted(p->obj, &obj, &obj_len) != FILE_OK)
        goto done;
    char hash[RFI_CACHE_KEY_HEX];
    content_hash(obj, obj_len, hash);
    rfi_strbuf want = {0};
    manifest_text(&want, context, obj_len, hash);
    ok = !want.failed && want.len == man_len && memcmp(want.data, man, man_len) == 0;
    rfi_sb_free(&want);
done:
    rfi_free(man);
    rfi_free(src);
    rfi_free(obj);
    return ok;
}

/* Writes the source, compiles it into a temporary object, renames the object
 * into place and writes the manifest last. On failure the source is kept. */
static rf_status build_entry(const entry_paths *p, const char *source, const char *context,
                             const rfi_disk_cache_ops *ops)
{
    remove_entry(p, false);
    if (write_atomic(p->src, source, strlen(source)) != 0)
        return rfi_error(RF_E_IO, "module cache: cannot write %s: %s", p->src, strerror(errno));
    char tmp[PATH_MAX + 64];
    tmp_name(tmp, sizeof tmp, p->obj);
    rf_status st = ops->compile(ops->ctx, p->src, tmp);
    if (st != RF_OK) {
        unlink(tmp);
        return st;
    }
    char *obj = NULL;
    size_t obj_len = 0;
    /* The compiler created it under the umask: make it private before trusting it. */
    if (chmod(tmp, 0700) != 0 || read_trusted(tmp, &obj, &obj_len) != FILE_OK) {
        int e = errno;
        unlink(tmp);
        return rfi_error(RF_E_IO, "module cache: cannot read back the compiled object %s: %s",
                         tmp, strerror(e));
    }
    char hash[RFI_CACHE_KEY_HEX];
    content_hash(obj, obj_len, hash);
    rfi_free(obj);
    if (rename(tmp, p->obj) != 0) {
        int e = errno;
        unlink(tmp);
        return rfi_error(RF_E_IO, "module cache: cannot rename %s to %s: %s", tmp, p->obj,
                         strerror(e));
    }
    rfi_strbuf man = {0};
    manifest_text(&man, context, obj_len, hash);
    if (man.failed) {
        rfi_sb_free(&man);
        return rfi_error(RF_E_NOMEM, "module cache: out of memory");
    }
    int w = write_atomic(p->ok, man.data, man.len);
    int e = errno;
    rfi_sb_free(&man);
    if (w != 0)
        return rfi_error(RF_E_IO, "module cache: cannot write %s: %s", p->ok, strerror(e));
    return RF_OK;
}

/* Opens and locks (LOCK_EX) the entry's lock file; returns the fd or -1. */
static int lock_entry(const entry_paths *p)
{
    int fd = open(p->lock, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0)
        return -1;
    while (flock(fd, LOCK_EX) != 0) {
        if (errno != EINTR) {
            int e = errno;
            close(fd);
            errno = e;
            return -1;
        }
    }
    return fd;
}

/* Under the entry's lock: load a valid entry, else (re)build and load it. A
 * valid entry whose load answers RF_E_CORRUPT is rebuilt once. */
static rf_status get_locked(const entry_paths *p, const char *source, const char *context,
                            const rfi_disk_cache_ops *ops, bool *compiled)
{
    *compiled = false;
    if (entry_valid(p, source, context)) {
        rf_status st = ops->load(ops->ctx, p->obj);
        if (st != RF_E_CORRUPT)
            return st;
    }
    rf_status st = build_entry(p, source, context, ops);
    if (st != RF_OK)
        return st;
    *compiled = true;
    st = ops->load(ops->ctx, p->obj);
    if (st != RF_OK) {
        remove_entry(p, true);
        if (st == RF_E_CORRUPT)
            st = RF_E_COMPILE; /* a fresh build that does not load is the compiler's failure */
    }
    return st;
}

static rf_status get_in_dir(const char *dir, const char *source, const char *context,
                            const rfi_disk_cache_ops *ops, rfi_disk_cache_result *res)
{
    entry_paths *p = rfi_malloc(sizeof *p);
    if (!p)
        return rfi_error(RF_E_NOMEM, "module cache: out of memory");
    set_paths(p, dir, res->key, ops);
    rf_status st;
    int fd = lock_entry(p);
    if (fd < 0) {
        st = rfi_error(RF_E_IO, "module cache: cannot lock %s: %s", p->lock, strerror(errno));
    } else {
        st = get_locked(p, source, context, ops, &res->compiled);
        close(fd); /* releases the lock */
    }
    if (st == RF_OK) {
        res->object_path = rfi_strdup(p->obj);
        res->source_path = rfi_strdup(p->src);
        if (!res->object_path || !res->source_path)
            st = rfi_error(RF_E_NOMEM, "module cache: out of memory");
    }
    rfi_free(p);
    return st;
}

/* Removes a private fallback directory's files (all but the source on failure). */
static void clean_private_dir(const char *dir, const char *key, const rfi_disk_cache_ops *ops,
                              bool keep_source)
{
    entry_paths *p = rfi_malloc(sizeof *p);
    if (!p)
        return;
    set_paths(p, dir, key, ops);
    remove_entry(p, keep_source);
    unlink(p->lock);
    if (!keep_source)
        rmdir(dir);
    rfi_free(p);
}

rf_status rfi_disk_cache_get(const char *source, const char *context,
                             const rfi_disk_cache_ops *ops, rfi_disk_cache_result *res)
{
    memset(res, 0, sizeof *res);
    if (!source || !context || !ops || !ops->compile || !ops->load || !ops->object_ext ||
        !ops->source_ext)
        return rfi_error(RF_E_INVALID, "module cache: NULL argument");
    rfi_disk_cache_key(source, context, res->key);
    char *dir = NULL;
    rf_status st = rfi_disk_cache_dir(&dir);
    if (st == RF_OK) {
        res->persistent = true;
        st = get_in_dir(dir, source, context, ops, res);
        rfi_free(dir);
    } else if (st != RF_E_NOMEM) {
        warn_fallback(rf_errmsg());
        st = make_private_dir(&dir);
        if (st == RF_OK) {
            st = get_in_dir(dir, source, context, ops, res);
            clean_private_dir(dir, res->key, ops, st != RF_OK);
            rfi_free(dir);
        }
    }
    if (st != RF_OK)
        rfi_disk_cache_result_free(res);
    return st;
}

/* ---- Memoised values ------------------------------------------------------------------- */

/* The memo file's path for name into buf, when the configured directory exists
 * and is private (never created or reported here: that is rfi_disk_cache_get's job). */
static bool memo_path(const char *name, char *buf, size_t n)
{
    size_t len = strlen(name);
    if (len == 0 || len > 64 || strspn(name, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                             "0123456789-_") != len)
        return false;
    char dir[PATH_MAX];
    struct stat st;
    if (!configured_dir(dir, sizeof dir - 80) || stat(dir, &st) != 0 ||
        untrusted_dir_reason(&st) != NULL)
        return false;
    return (size_t)snprintf(buf, n, "%s/%s.memo", dir, name) < n;
}

bool rfi_disk_cache_memo_get(const char *name, char **value)
{
    *value = NULL;
    char path[PATH_MAX];
    char *data = NULL;
    size_t len = 0;
    if (!memo_path(name, path, sizeof path) || read_trusted(path, &data, &len) != FILE_OK)
        return false;
    if (len == 0 || strlen(data) != len || strchr(data, '\n')) {
        rfi_free(data);
        return false;
    }
    *value = data;
    return true;
}

void rfi_disk_cache_memo_put(const char *name, const char *value)
{
    char path[PATH_MAX];
    if (value && *value && !strchr(value, '\n') && memo_path(name, path, sizeof path)) {
        int saved = errno;
        (void)write_atomic(path, value, strlen(value));
        errno = saved;
    }
}

void rfi_disk_cache_result_free(rfi_disk_cache_result *res)
{
    if (!res)
        return;
    rfi_free(res->object_path);
    rfi_free(res->source_path);
    res->object_path = res->source_path = NULL;
}
