/* disk_cache.c: the on-disk cache of compiled modules (see disk_cache.h for
 * the layout, the locking and the security rules).
 *
 * This file finds the cache directory, computes keys, validates entries
 * (ownership, permissions, manifest, source and object hashes), serialises
 * builds of one key across processes with flock (and closes a forked child's
 * copies of the locks it holds), keeps the program index
 * (description -> entry, checked byte for byte and pinned to the entry's
 * manifest) and the records (key -> payload, checked byte for byte and by
 * the payload's hash), and writes every file under a temporary name before
 * renaming it into place, and keeps the directory under its size limit by
 * deleting what was used least recently (and the temporaries of writers
 * that died). It does not compile or load
 * anything itself (the caller's callbacks do).
 */
#include "disk_cache.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
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


/* The configured directory path into buf; NULL when it fits, else why not:
 * no variable names one, or the one named is too long. */
static const char *configured_dir(char *buf, size_t n)
{
    static const char too_long[] = "the directory's path is too long";
    const char *v = getenv("RF_CACHE_DIR");
    if (v && *v)
        return (size_t)snprintf(buf, n, "%s", v) < n ? NULL : too_long;
    v = getenv("XDG_CACHE_HOME");
    if (v && v[0] == '/')
        return (size_t)snprintf(buf, n, "%s/reflux", v) < n ? NULL : too_long;
    v = getenv("HOME");
    if (v && *v)
        return (size_t)snprintf(buf, n, "%s/.cache/reflux", v) < n ? NULL : too_long;
    return "none of RF_CACHE_DIR, XDG_CACHE_HOME, HOME names a directory";
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
    const char *unusable = configured_dir(path, sizeof path - 64);
    if (unusable)
        return rfi_error(RF_E_INVALID, "module cache: %s", unusable);
    struct stat st;
    if (rfi_make_dirs(path) != 0) {
        int e = errno;
        if (stat(path, &st) == 0 && !S_ISDIR(st.st_mode)) /* something else is there */
            return rfi_error(RF_E_INVALID, "module cache: refusing directory %s: %s", path,
                             untrusted_dir_reason(&st));
        return rfi_error(RF_E_IO, "module cache: cannot create directory %s: %s", path,
                         strerror(e));
    }
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

/* Whether a file may be trusted: regular, owned by the user, writable by no one else. */
static bool trusted_file(const struct stat *st)
{
    return S_ISREG(st->st_mode) && st->st_uid == geteuid() &&
           !(st->st_mode & (S_IWGRP | S_IWOTH)) && st->st_size >= 0;
}

/* Reads a whole file that this user may trust (trusted_file) into *data
 * (rfi_malloc'd, NUL-terminated). */
static file_state read_trusted(const char *path, char **data, size_t *len)
{
    *data = NULL;
    *len = 0;
    /* O_NONBLOCK: opening a FIFO for reading would wait for a writer (for
     * ever, holding the entry's lock); a regular file reads as usual */
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        return errno == ENOENT ? FILE_MISSING : FILE_BAD;
    struct stat st;
    file_state s = FILE_BAD;
    if (fstat(fd, &st) != 0 || !trusted_file(&st))
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

static void remove_path(const char *path);

/* rename(tmp, path), where an empty directory someone made at path is
 * removed first: renaming a file over a directory fails, so it would refuse
 * every later write of that index file, record or memo for good. */
static int rename_over(const char *tmp, const char *path)
{
    if (rename(tmp, path) == 0)
        return 0;
    if (errno != EISDIR)
        return -1;
    remove_path(path);
    return rename(tmp, path);
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
    if (close(fd) != 0 || done != len || rename_over(tmp, path) != 0) {
        saved = errno ? errno : saved;
        unlink(tmp);
        errno = saved;
        return -1;
    }
    return 0;
}

/* Marks a file as just used (its modification time: what the size limit
 * evicts by). Best effort. */
static void mark_used(const char *path)
{
    int saved = errno;
    (void)utimensat(AT_FDCWD, path, NULL, AT_SYMLINK_NOFOLLOW);
    errno = saved;
}

/* ---- Entries ------------------------------------------------------------------------------- */

typedef struct entry_paths {
    char dir[PATH_MAX];
    char src[PATH_MAX], obj[PATH_MAX], ok[PATH_MAX], lock[PATH_MAX];
} entry_paths;

/* false when a path does not fit (never for a directory from rfi_disk_cache_dir
 * or mkdtemp, which leave 64 characters to spare). */
static bool set_paths(entry_paths *p, const char *dir, const char *key,
                      const rfi_disk_cache_ops *ops)
{
    return (size_t)snprintf(p->dir, sizeof p->dir, "%s", dir) < sizeof p->dir &&
           (size_t)snprintf(p->src, sizeof p->src, "%s/%s%s", dir, key, ops->source_ext) <
               sizeof p->src &&
           (size_t)snprintf(p->obj, sizeof p->obj, "%s/%s%s", dir, key, ops->object_ext) <
               sizeof p->obj &&
           (size_t)snprintf(p->ok, sizeof p->ok, "%s/%s.ok", dir, key) < sizeof p->ok &&
           (size_t)snprintf(p->lock, sizeof p->lock, "%s/%s.lock", dir, key) < sizeof p->lock;
}

/* Removes what is at path: a file, or an (empty) directory someone made
 * there, which would otherwise make every later write of the entry fail. */
static void remove_path(const char *path)
{
    if (unlink(path) != 0 && (errno == EISDIR || errno == EPERM))
        rmdir(path);
}

static void remove_entry(const entry_paths *p, bool keep_source)
{
    remove_path(p->ok); /* first: without a manifest the rest is never trusted */
    remove_path(p->obj);
    if (!keep_source)
        remove_path(p->src);
}

/* The manifest text for a context and an object of the given size and hash. */
static void manifest_text(rfi_strbuf *sb, const char *context, size_t obj_len,
                          const char *obj_hash)
{
    rfi_sb_printf(sb, "%s%s\nobject_size=%zu\nobject_hash=%s\n", MANIFEST_MAGIC, context,
                  obj_len, obj_hash);
}

static void content_hash(const void *data, size_t len, char out[RFI_CACHE_KEY_HEX])
{
    hash128 h = hash128_init();
    hash128_part(&h, data, len);
    hash128_hex(h, out);
}

void rfi_disk_cache_digest(const void *data, size_t len, char out[RFI_CACHE_KEY_HEX])
{
    content_hash(data, len, out);
}

/* Whether the manifest text man is the one of object obj under context. */
static bool manifest_matches(const char *man, size_t man_len, const char *obj, size_t obj_len,
                             const char *context)
{
    char hash[RFI_CACHE_KEY_HEX];
    content_hash(obj, obj_len, hash);
    rfi_strbuf want = {0};
    manifest_text(&want, context, obj_len, hash);
    bool ok = !want.failed && want.len == man_len && memcmp(want.data, man, man_len) == 0;
    rfi_sb_free(&want);
    return ok;
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
    ok = manifest_matches(man, man_len, obj, obj_len, context);
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

/* ---- Held locks and fork ------------------------------------------------------------- *
 * A flock belongs to the open file description, which a forked child shares:
 * a child forked while a thread of this process holds an entry's lock keeps
 * that lock held until it too has closed its copy. A child that then uses the
 * same entry would wait for ever on its own copy, and the parent's (and every
 * other process's) next use of the entry would wait until the child exits;
 * O_CLOEXEC only helps a child that execs. So every lock file descriptor is
 * listed here from its open to its close, and the child of a fork closes its
 * copies of them (the parent's lock stays the parent's). The open and the
 * close happen under held_lock, which every fork takes, so no descriptor is
 * open but not yet listed, or closed (its number free for reuse) but still
 * listed, when a fork copies the list; the flock itself, which may wait for
 * another process, is taken outside it. Only the forking thread exists in the
 * child, so no code of the child uses the closed copies: a fork from inside a
 * compile callback (cc.c's, to run the compiler) execs or exits. */
static pthread_mutex_t held_lock = PTHREAD_MUTEX_INITIALIZER;
static int *held_fds;
static int n_held, cap_held;
static pthread_once_t held_fork_once = PTHREAD_ONCE_INIT;

static void held_before_fork(void) { pthread_mutex_lock(&held_lock); }
static void held_after_fork_in_parent(void) { pthread_mutex_unlock(&held_lock); }

static void held_after_fork_in_child(void)
{
    for (int i = 0; i < n_held; i++)
        close(held_fds[i]);
    n_held = 0;
    pthread_mutex_unlock(&held_lock);
}

static void watch_forks(void)
{
    pthread_atfork(held_before_fork, held_after_fork_in_parent, held_after_fork_in_child);
}

/* Opens a lock file and lists its descriptor; -1 with errno on failure. */
static int open_listed(const char *path)
{
    pthread_once(&held_fork_once, watch_forks);
    pthread_mutex_lock(&held_lock);
    int fd = -1;
    if (!rfi_grow((void **)&held_fds, n_held, &cap_held, sizeof *held_fds))
        errno = ENOMEM;
    else if ((fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, 0600)) >= 0)
        held_fds[n_held++] = fd;
    int e = errno;
    pthread_mutex_unlock(&held_lock);
    errno = e;
    return fd;
}

/* Closes a descriptor from lock_path, which releases its lock; errno is preserved. */
static void unlock_path(int fd)
{
    int e = errno;
    pthread_mutex_lock(&held_lock);
    for (int i = 0; i < n_held; i++) {
        if (held_fds[i] == fd) {
            held_fds[i] = held_fds[--n_held];
            break;
        }
    }
    close(fd);
    pthread_mutex_unlock(&held_lock);
    errno = e;
}

/* Opens and locks (LOCK_EX) a lock file, waiting for it or not; returns the
 * fd (release it with unlock_path) or -1 (errno EWOULDBLOCK: held by someone
 * else, when not waiting). */
static int lock_path(const char *path, bool wait)
{
    int fd = open_listed(path);
    if (fd < 0 && (errno == EISDIR || errno == ELOOP)) {
        /* a directory or a symlink someone made there would fail every compile of
         * the entry: removed, and the lock file made again */
        remove_path(path);
        fd = open_listed(path);
    }
    if (fd < 0)
        return -1;
    while (flock(fd, wait ? LOCK_EX : LOCK_EX | LOCK_NB) != 0) {
        if (errno != EINTR) {
            unlock_path(fd);
            return -1;
        }
    }
    return fd;
}

/* Opens and locks (LOCK_EX) the entry's lock file; returns the fd or -1. */
static int lock_entry(const entry_paths *p) { return lock_path(p->lock, true); }

/* Under the entry's lock: load a valid entry, else (re)build and load it. A
 * valid entry whose load answers RF_E_CORRUPT is rebuilt once. */
static rf_status get_locked(const entry_paths *p, const char *source, const char *context,
                            const rfi_disk_cache_ops *ops, bool *compiled)
{
    *compiled = false;
    if (entry_valid(p, source, context)) {
        rf_status st = ops->load(ops->ctx, p->obj);
        if (st == RF_OK)
            mark_used(p->ok);
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

static void index_record(const entry_paths *p, const char *key, const char *context,
                         const rfi_disk_cache_index *index);
static void trim_dir(const char *dir, const char *keep_key);

/* Finds or builds the entry in dir; with an index description (never for a
 * private fallback directory), records it for the entry, under the entry's lock. */
static rf_status get_in_dir(const char *dir, const char *source, const char *context,
                            const rfi_disk_cache_index *index, const rfi_disk_cache_ops *ops,
                            rfi_disk_cache_result *res)
{
    entry_paths *p = rfi_malloc(sizeof *p);
    if (!p)
        return rfi_error(RF_E_NOMEM, "module cache: out of memory");
    rf_status st;
    int fd = set_paths(p, dir, res->key, ops) ? lock_entry(p) : (errno = ENAMETOOLONG, -1);
    if (fd < 0) {
        st = rfi_error(errno == ENOMEM ? RF_E_NOMEM : RF_E_IO, "module cache: cannot lock %s: %s",
                       p->lock, strerror(errno));
    } else {
        st = get_locked(p, source, context, ops, &res->compiled);
        if (st == RF_OK && index)
            index_record(p, res->key, context, index);
        unlock_path(fd);
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
    if (!set_paths(p, dir, key, ops)) {
        rfi_free(p);
        return;
    }
    remove_entry(p, keep_source);
    unlink(p->lock);
    if (!keep_source)
        rmdir(dir);
    rfi_free(p);
}

rf_status rfi_disk_cache_get(const char *source, const char *context,
                             const rfi_disk_cache_ops *ops, rfi_disk_cache_result *res)
{
    return rfi_disk_cache_get_indexed(source, context, NULL, ops, res);
}

rf_status rfi_disk_cache_get_indexed(const char *source, const char *context,
                                     const rfi_disk_cache_index *index,
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
        st = get_in_dir(dir, source, context, index && index->len ? index : NULL, ops, res);
        if (st == RF_OK && res->compiled)
            trim_dir(dir, res->key);
        rfi_free(dir);
    } else if (st != RF_E_NOMEM) {
        warn_fallback(rf_errmsg());
        st = make_private_dir(&dir);
        if (st == RF_OK) {
            st = get_in_dir(dir, source, context, NULL, ops, res);
            clean_private_dir(dir, res->key, ops, st != RF_OK);
            rfi_free(dir);
        }
    }
    if (st != RF_OK)
        rfi_disk_cache_result_free(res);
    return st;
}

/* ---- The program index ------------------------------------------------------------------- */

#define INDEX_MAGIC "reflux program index v1\n"

/* dir/<the 128-bit hash of (magic, key, context)><ext> into buf. The magic
 * enters the name's hash, so index and record names never equal an entry key
 * or each other. */
static bool keyed_path(const char *dir, const char *magic, const void *key, size_t key_len,
                       const char *context, const char *ext, char *buf, size_t n)
{
    hash128 h = hash128_init();
    hash128_part(&h, magic, strlen(magic));
    hash128_part(&h, key, key_len);
    hash128_part(&h, context, strlen(context));
    char name[RFI_CACHE_KEY_HEX];
    hash128_hex(h, name);
    return (size_t)snprintf(buf, n, "%s/%s%s", dir, name, ext) < n;
}

/* The index file of (description, context) in dir. */
static bool index_file(const char *dir, const rfi_disk_cache_index *index, const char *context,
                       char *buf, size_t n)
{
    return keyed_path(dir, INDEX_MAGIC, index->data, index->len, context, ".idx", buf, n);
}

/* Writes the index file: the magic, the entry's key, its manifest as it is
 * now (read under the entry's lock: what was just validated or written), then
 * the description. Best effort: a failure only costs the next compile the
 * full path. errno is preserved. */
static void index_record(const entry_paths *p, const char *key, const char *context,
                         const rfi_disk_cache_index *index)
{
    int saved = errno;
    char path[PATH_MAX];
    char *man = NULL;
    size_t man_len = 0;
    rfi_strbuf head = {0};
    char *file = NULL;
    if (!index_file(p->dir, index, context, path, sizeof path) ||
        read_trusted(p->ok, &man, &man_len) != FILE_OK)
        goto done;
    rfi_sb_printf(&head, "%sentry=%s\nmanifest=%zu\n", INDEX_MAGIC, key, man_len);
    size_t total = head.len + man_len + index->len;
    if (head.failed || !(file = rfi_malloc(total)))
        goto done;
    memcpy(file, head.data, head.len);
    memcpy(file + head.len, man, man_len);
    memcpy(file + head.len + man_len, index->data, index->len);
    (void)write_atomic(path, file, total);
done:
    rfi_free(file);
    rfi_sb_free(&head);
    rfi_free(man);
    errno = saved;
}

/* What an index file says: the entry's key and the manifest it was recorded with. */
typedef struct index_entry {
    char key[RFI_CACHE_KEY_HEX];
    const char *manifest; /* into the file's data */
    size_t manifest_len;
} index_entry;

/* Parses an index file and checks that it holds exactly this description for
 * this context (byte for byte, as a source is on an entry hit). */
static bool parse_index(const char *data, size_t len, const rfi_disk_cache_index *index,
                        const char *context, index_entry *e)
{
    const char *p = data, *end = data + len;
    size_t magic = strlen(INDEX_MAGIC);
    if (len < magic || memcmp(p, INDEX_MAGIC, magic) != 0)
        return false;
    p += magic;
    if ((size_t)(end - p) < 6 + 32 + 1 || memcmp(p, "entry=", 6) != 0)
        return false;
    p += 6;
    if (strspn(p, "0123456789abcdef") < 32 || p[32] != '\n')
        return false;
    memcpy(e->key, p, 32);
    e->key[32] = '\0';
    p += 33;
    if ((size_t)(end - p) < 9 || memcmp(p, "manifest=", 9) != 0)
        return false;
    p += 9;
    size_t n = 0, digits = 0;
    for (; p < end && *p >= '0' && *p <= '9' && digits < 12; p++, digits++)
        n = n * 10 + (size_t)(*p - '0');
    if (digits == 0 || p >= end || *p != '\n')
        return false;
    p++;
    if ((size_t)(end - p) < n || (size_t)(end - p) - n != index->len ||
        memcmp(p + n, index->data, index->len) != 0)
        return false;
    e->manifest = p;
    e->manifest_len = n;
    /* The manifest names the context it was built for: it must be this one. */
    size_t mm = strlen(MANIFEST_MAGIC), cl = strlen(context);
    return n > mm + cl && memcmp(p, MANIFEST_MAGIC, mm) == 0 &&
           memcmp(p + mm, context, cl) == 0 && p[mm + cl] == '\n';
}

/* Whether path is a file this user may trust (no read). */
static bool trusted_present(const char *path)
{
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC); /* see read_trusted */
    if (fd < 0)
        return false;
    struct stat st;
    bool ok = fstat(fd, &st) == 0 && trusted_file(&st);
    close(fd);
    return ok;
}

/* Under the entry's lock: its manifest is the one the index recorded, and its
 * object (trusted) matches that manifest's size and hash; its source is there
 * and trusted. The source is not read: the description that produced it was
 * compared instead, and the recorded manifest pins the object built from it
 * (an entry rebuilt since, for any reason, no longer matches). */
static bool pinned_entry_valid(const entry_paths *p, const index_entry *e, const char *context)
{
    char *man = NULL, *obj = NULL;
    size_t man_len, obj_len;
    bool ok = false;
    if (read_trusted(p->ok, &man, &man_len) != FILE_OK || man_len != e->manifest_len ||
        memcmp(man, e->manifest, man_len) != 0 || !trusted_present(p->src) ||
        read_trusted(p->obj, &obj, &obj_len) != FILE_OK)
        goto done;
    ok = manifest_matches(man, man_len, obj, obj_len, context);
done:
    rfi_free(man);
    rfi_free(obj);
    return ok;
}

/* The configured directory into buf when it exists and is private (never
 * created or reported here: rfi_disk_cache_get does that). */
static bool existing_private_dir(char *buf, size_t n)
{
    struct stat st;
    return !configured_dir(buf, n) && stat(buf, &st) == 0 && untrusted_dir_reason(&st) == NULL;
}

/* Loads the entry the index names, under its lock. */
static bool load_pinned(const char *dir, const index_entry *e, const char *context,
                        const rfi_disk_cache_ops *ops, rfi_disk_cache_result *res)
{
    entry_paths *p = rfi_malloc(sizeof *p);
    if (!p)
        return false;
    bool ok = false;
    int fd = set_paths(p, dir, e->key, ops) ? lock_entry(p) : -1;
    if (fd >= 0) {
        ok = pinned_entry_valid(p, e, context) && ops->load(ops->ctx, p->obj) == RF_OK;
        if (ok)
            mark_used(p->ok);
        unlock_path(fd);
    }
    if (ok) {
        memcpy(res->key, e->key, sizeof res->key);
        res->object_path = rfi_strdup(p->obj);
        res->source_path = rfi_strdup(p->src);
        res->persistent = true;
        ok = res->object_path && res->source_path;
    }
    rfi_free(p);
    return ok;
}

bool rfi_disk_cache_find_indexed(const rfi_disk_cache_index *index, const char *context,
                                 const rfi_disk_cache_ops *ops, rfi_disk_cache_result *res)
{
    memset(res, 0, sizeof *res);
    if (!index || !index->data || index->len == 0 || !context || !ops || !ops->load ||
        !ops->object_ext || !ops->source_ext)
        return false;
    char dir[PATH_MAX], path[PATH_MAX + 64];
    if (!existing_private_dir(dir, sizeof dir - 64) ||
        !index_file(dir, index, context, path, sizeof path))
        return false;
    char *data = NULL;
    size_t len = 0;
    index_entry e;
    bool ok = read_trusted(path, &data, &len) == FILE_OK &&
              parse_index(data, len, index, context, &e) &&
              load_pinned(dir, &e, context, ops, res);
    if (ok)
        mark_used(path);
    rfi_free(data);
    if (!ok)
        rfi_disk_cache_result_free(res);
    return ok;
}

/* ---- Records ---------------------------------------------------------------------------- */

#define RECORD_MAGIC "reflux record v1\n"

/* The record file of (key, context) in the configured directory, when that
 * exists and is private. */
static bool record_path(const void *key, size_t key_len, const char *context, char *buf,
                        size_t n)
{
    char dir[PATH_MAX];
    return existing_private_dir(dir, sizeof dir - 64) &&
           keyed_path(dir, RECORD_MAGIC, key, key_len, context, ".rec", buf, n);
}

/* `name` then a decimal number of 1 to 19 digits at *p (before end), past
 * which *p moves; false for anything else: sscanf's %llu, used before, also
 * took a sign and blanks, and a number past its type's range is undefined
 * behaviour there. */
static bool header_number(const char **p, const char *end, const char *name,
                          unsigned long long *out)
{
    size_t name_len = strlen(name);
    const char *s = *p;
    if ((size_t)(end - s) <= name_len || memcmp(s, name, name_len) != 0)
        return false;
    s += name_len;
    unsigned long long v = 0;
    int digits = 0;
    for (; s < end && *s >= '0' && *s <= '9'; s++) {
        if (++digits > 19)
            return false;
        v = v * 10 + (unsigned long long)(*s - '0');
    }
    *p = s;
    *out = v;
    return digits > 0;
}

/* Parses "<magic>key=K context=C payload=P digest=D\n" and the three parts
 * after it; true when the file is exactly that, for this key and context, and
 * the payload matches its digest. *at: the payload's offset. */
static bool parse_record(const char *data, size_t len, const void *key, size_t key_len,
                         const char *context, size_t *at, size_t *payload_len)
{
    size_t magic = strlen(RECORD_MAGIC), context_len = strlen(context);
    if (len < magic || memcmp(data, RECORD_MAGIC, magic) != 0)
        return false;
    const char *head = data + magic;
    const char *nl = memchr(head, '\n', len - magic);
    unsigned long long k, c, n;
    static const char digest_field[] = " digest=";
    const size_t field = sizeof digest_field - 1;
    const char *p = head;
    if (!nl || !header_number(&p, nl, "key=", &k) || !header_number(&p, nl, " context=", &c) ||
        !header_number(&p, nl, " payload=", &n) || (size_t)(nl - p) != field + 32 ||
        memcmp(p, digest_field, field) != 0 || strspn(p + field, "0123456789abcdef") != 32)
        return false;
    const char *digest = p + field;
    size_t start = (size_t)(nl + 1 - data);
    if (k != key_len || c != context_len || n > len || len - start != k + c + n ||
        memcmp(data + start, key, key_len) != 0 ||
        memcmp(data + start + key_len, context, context_len) != 0)
        return false;
    char actual[RFI_CACHE_KEY_HEX];
    content_hash(data + start + k + c, (size_t)n, actual);
    if (memcmp(actual, digest, 32) != 0)
        return false;
    *at = start + (size_t)(k + c);
    *payload_len = (size_t)n;
    return true;
}

bool rfi_disk_cache_record_get(const void *key, size_t key_len, const char *context,
                               char **payload, size_t *len)
{
    *payload = NULL;
    *len = 0;
    char path[PATH_MAX];
    char *data = NULL;
    size_t data_len = 0, at = 0, n = 0;
    if (!key || key_len == 0 || !context ||
        !record_path(key, key_len, context, path, sizeof path) ||
        read_trusted(path, &data, &data_len) != FILE_OK)
        return false;
    if (!parse_record(data, data_len, key, key_len, context, &at, &n)) {
        rfi_free(data);
        return false;
    }
    memmove(data, data + at, n);
    data[n] = '\0';
    *payload = data;
    *len = n;
    mark_used(path);
    return true;
}

void rfi_disk_cache_record_put(const void *key, size_t key_len, const char *context,
                               const void *payload, size_t len)
{
    char path[PATH_MAX];
    if (!key || key_len == 0 || !context || !payload ||
        !record_path(key, key_len, context, path, sizeof path))
        return;
    int saved = errno;
    char digest[RFI_CACHE_KEY_HEX];
    content_hash(payload, len, digest);
    rfi_strbuf file = {0};
    rfi_sb_printf(&file, "%skey=%zu context=%zu payload=%zu digest=%s\n", RECORD_MAGIC, key_len,
                  strlen(context), len, digest);
    rfi_sb_put(&file, key, key_len);
    rfi_sb_put(&file, context, strlen(context));
    rfi_sb_put(&file, payload, len);
    if (!file.failed)
        (void)write_atomic(path, file.data, file.len);
    rfi_sb_free(&file);
    errno = saved;
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
    if (!existing_private_dir(dir, sizeof dir - 80))
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
    char path[PATH_MAX], dir[PATH_MAX];
    int saved = errno;
    /* the compiler's identity is worked out before the first entry makes the directory:
     * without it here a second process would ask the compiler again */
    if (!configured_dir(dir, sizeof dir - 80))
        (void)rfi_make_dirs(dir);
    if (value && *value && !strchr(value, '\n') && memo_path(name, path, sizeof path))
        (void)write_atomic(path, value, strlen(value));
    errno = saved;
}

/* ---- The size limit ---------------------------------------------------------------------- *
 * After a compile adds an entry, when the cache's files take more than
 * RF_CACHE_MAX_MB megabytes (default DEFAULT_MAX_MB; 0: no limit), the least
 * recently used entries, index files and records are deleted until they take
 * at most TRIM_TO_PERCENT of it. Used: an entry's manifest, an index file or a
 * record is marked (its modification time) whenever it is read and trusted,
 * so a warm process keeps what it uses. Only the cache's own files count and
 * go: K.idx, K.rec and an entry's files K<ext> (any other extension: another
 * backend's objects count too), K 32 hex digits, trusted (owned by the user,
 * writable by no one else); lock files stay (removing them would race), and
 * so do memo files, temporary files (someone's write in progress) and
 * anything else. A temporary file whose writer is gone (stale_temporary: a
 * process killed mid-compile) is deleted after every compile, limit or not.
 * An entry goes only under its lock, taken without waiting: one that another
 * process is building or loading stays, and so does the entry just built. A
 * process that has loaded an object keeps it mapped when its file goes. */
#define DEFAULT_MAX_MB 1024
#define TRIM_TO_PERCENT 80

/* The limit in bytes; 0: none. */
static uint64_t max_cache_bytes(void)
{
    return rfi_env_megabytes("RF_CACHE_MAX_MB", DEFAULT_MAX_MB);
}

/* A file the limit may delete: an entry's (K<ext>, any extension but .idx,
 * .rec and .lock, so another backend's objects count too), an index file or
 * a record. Temporary files (".tmp.") are someone's write in progress. */
typedef struct cache_file {
    char name[RFI_CACHE_KEY_HEX + 8];
    bool entry, manifest;
    struct timespec mtime;
    uint64_t bytes;
} cache_file;

typedef struct cache_files {
    cache_file *v;
    int n, cap;
} cache_files;

/* What goes at once: an entry's files (adjacent once sorted by name), or
 * one index file or record. used: the manifest's time (an entry without
 * one, a failed build's kept source, takes its newest file's). */
typedef struct cache_group {
    int first, count;
    bool entry, manifest;
    struct timespec used;
    uint64_t bytes;
} cache_group;

static bool later(struct timespec a, struct timespec b)
{
    return a.tv_sec != b.tv_sec ? a.tv_sec > b.tv_sec : a.tv_nsec > b.tv_nsec;
}

/* Adds dir's file `name` (stat st); false when it is none of the files the
 * limit may delete (or out of memory: the file is then left alone). */
static bool add_file(cache_files *files, const char *name, const struct stat *st)
{
    size_t len = strlen(name);
    if (len >= sizeof files->v[0].name || strspn(name, "0123456789abcdef") != 32 ||
        name[32] != '.' || strstr(name, ".tmp.") || strcmp(name + 32, ".lock") == 0 ||
        !trusted_file(st) ||
        !rfi_grow((void **)&files->v, files->n, &files->cap, sizeof *files->v))
        return false;
    const char *ext = name + 32;
    cache_file *f = &files->v[files->n++];
    memcpy(f->name, name, len + 1);
    f->entry = strcmp(ext, ".idx") != 0 && strcmp(ext, ".rec") != 0;
    f->manifest = strcmp(ext, ".ok") == 0;
    f->mtime = st->st_mtim;
    f->bytes = (uint64_t)st->st_size;
    return true;
}

static int by_name(const void *a, const void *b)
{
    return strcmp(((const cache_file *)a)->name, ((const cache_file *)b)->name);
}

static bool same_entry(const cache_file *a, const cache_file *b)
{
    return a->entry && b->entry && memcmp(a->name, b->name, 32) == 0;
}

/* Sorts the files by name and returns their groups (NULL: out of memory). */
static cache_group *group_files(cache_files *files, int *n_groups)
{
    qsort(files->v, (size_t)files->n, sizeof *files->v, by_name);
    cache_group *g = rfi_calloc((size_t)files->n + 1, sizeof *g);
    int n = 0;
    for (int i = 0; g && i < files->n; i++) {
        const cache_file *f = &files->v[i];
        cache_group *cur = n > 0 && same_entry(&files->v[i - 1], f) ? &g[n - 1] : NULL;
        if (!cur) {
            cur = &g[n++];
            cur->first = i;
            cur->entry = f->entry;
            cur->used = f->mtime;
        } else if (f->manifest || (!cur->manifest && later(f->mtime, cur->used))) {
            cur->used = f->mtime;
        }
        cur->manifest |= f->manifest;
        cur->count++;
        cur->bytes += f->bytes;
    }
    *n_groups = n;
    return g;
}

static int by_use(const void *a, const void *b)
{
    const cache_group *x = a, *y = b;
    return later(x->used, y->used) ? 1 : later(y->used, x->used) ? -1 : x->first - y->first;
}

/* Deletes a group's files, an entry's under its lock (the manifest first:
 * without it the rest is never trusted); false when someone holds the lock. */
static bool delete_group(const char *dir, const cache_files *files, const cache_group *g)
{
    char path[PATH_MAX];
    int fd = -1;
    if (g->entry) {
        if ((size_t)snprintf(path, sizeof path, "%s/%.32s.lock", dir,
                             files->v[g->first].name) >= sizeof path ||
            (fd = lock_path(path, false)) < 0)
            return false;
    }
    for (int pass = 0; pass < 2; pass++)
        for (int k = g->first; k < g->first + g->count; k++)
            if (files->v[k].manifest == (pass == 0) &&
                (size_t)snprintf(path, sizeof path, "%s/%s", dir, files->v[k].name) < sizeof path)
                unlink(path);
    if (fd >= 0)
        unlock_path(fd);
    return true;
}

/* A temporary file ("<name>.tmp.<pid>.<n>", a compiler's part objects after
 * it) whose writer is gone: it is over an hour old and its process does not
 * exist here, or it is a day old. A writer killed mid-write leaves one behind
 * for good otherwise; the hour spares the live writes of another host's
 * process on a shared home directory, whose pid means nothing here. */
#define STALE_TEMPORARY_SECONDS 3600
static bool stale_temporary(const char *name, const struct stat *st, time_t now)
{
    const char *t = strstr(name, ".tmp.");
    if (!t || !trusted_file(st))
        return false;
    double age = difftime(now, st->st_mtime);
    long pid = strtol(t + 5, NULL, 10);
    if (age > 24.0 * STALE_TEMPORARY_SECONDS)
        return true;
    return age > STALE_TEMPORARY_SECONDS && pid > 0 && kill((pid_t)pid, 0) != 0 &&
           errno == ESRCH;
}

/* After a build: deletes stale temporaries, and the least recently used
 * entries while the directory holds more than the limit. */
static void trim_dir(const char *dir, const char *keep_key)
{
    uint64_t limit = max_cache_bytes();
    DIR *d = opendir(dir);
    if (!d)
        return;
    int saved = errno;
    cache_files files = {0};
    uint64_t total = 0;
    time_t now = time(NULL);
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        struct stat st;
        if (fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0)
            continue;
        if (stale_temporary(de->d_name, &st, now))
            unlinkat(dirfd(d), de->d_name, 0);
        else if (limit && add_file(&files, de->d_name, &st))
            total += (uint64_t)st.st_size;
    }
    closedir(d);
    int n = 0;
    cache_group *groups = total > limit ? group_files(&files, &n) : NULL;
    if (groups) {
        qsort(groups, (size_t)n, sizeof *groups, by_use);
        uint64_t target = limit / 100 * TRIM_TO_PERCENT;
        for (int i = 0; i < n && total > target; i++) {
            const cache_group *g = &groups[i];
            if (g->entry && memcmp(files.v[g->first].name, keep_key, 32) == 0)
                continue;
            if (delete_group(dir, &files, g))
                total -= g->bytes < total ? g->bytes : total;
        }
    }
    rfi_free(groups);
    rfi_free(files.v);
    errno = saved;
}

void rfi_disk_cache_result_free(rfi_disk_cache_result *res)
{
    if (!res)
        return;
    rfi_free(res->object_path);
    rfi_free(res->source_path);
    res->object_path = res->source_path = NULL;
}
