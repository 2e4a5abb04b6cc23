/* disk_cache.h: the on-disk cache of compiled modules.
 *
 * An entry is keyed by a 128-bit hash (two independent 64-bit hashes) of the
 * source text and a `context` string that names everything else the compiled
 * object depends on (compiler identity and version, flags, ABI version, CPU
 * features). The cache knows nothing about C or dlopen: the caller passes a
 * compile and a load callback, so a CUDA backend can reuse it for its objects.
 *
 * Directory: $RF_CACHE_DIR, else $XDG_CACHE_HOME/reflux, else
 * $HOME/.cache/reflux, created (mkdir -p) with mode 0700. A directory that is
 * not owned by the effective user, or is writable by group or others, is
 * refused: the module is then compiled in a private directory made with
 * mkdtemp under $TMPDIR (else /tmp), loaded, and its files removed (a warning
 * is printed once per process). A failed compile keeps that directory so the
 * source can be read.
 *
 * Entry files, in the cache directory, for key K (32 hex digits):
 *   K.c     the source, kept beside the object (byte-compared on every hit,
 *           so a hash collision can never load the wrong object)
 *   K<ext>  the object (ext from the caller, ".so" for the CPU backend)
 *   K.ok    the manifest, written last: the context string, then the object's
 *           size and content hash. An object without a matching manifest
 *           (interrupted write, truncated or modified file) is never loaded.
 *   K.lock  the per-key lock file (flock LOCK_EX around check-compile-rename,
 *           so concurrent processes compile once; a waiter then finds the
 *           entry). Lock files are left in place: removing them would race.
 *           A child forked while the lock is held closes its copy of the
 *           descriptor at the fork, so the lock stays the parent's alone.
 *   I.idx   an index entry (see "The program index" below)
 *   R.rec   a record (see "Records" below)
 * Every file is written under a temporary name and renamed into place.
 *
 * Security: an entry file that is not a regular file owned by the effective
 * user, or that is writable by group or others, is never loaded: the entry is
 * deleted and rebuilt. The directory itself is private (see above), so nobody
 * else can swap a file between the check and the load.
 *
 * Corruption: an entry whose object or source does not match its manifest, or
 * whose load callback answers RF_E_CORRUPT, is deleted and rebuilt once.
 *
 * The program index: a second map, from a caller's *description* of what
 * produced a source (bytes: for the CPU backend the optimised program, the
 * plan options and the identity of the build that generates the code) to the
 * entry built from that source, so a warm compile can load the module without
 * generating its source at all. I is the 128-bit hash of the description and
 * the context; I.idx holds a magic line, the entry's key, the entry's
 * manifest as it was when recorded (read under the entry's lock, right after
 * the entry was validated or built), and the whole description. A lookup
 * trusts I.idx only under the entry-file rules above (regular, owned by the
 * user, writable by no one else, in the private directory), compares the
 * stored description and context with the caller's byte for byte (so a hash
 * collision never maps to the wrong entry, as the source compare guarantees
 * for entries), and loads the entry, under its lock, only when its manifest
 * is still the recorded one and its object matches it (size and hash) and
 * its source is present and trusted. The source itself is not read: the
 * description that generated it was compared instead, and the pinned
 * manifest rejects an entry rebuilt since. Anything else (missing, foreign,
 * writable, truncated or stale index file; missing or changed entry; a load
 * failure) is a miss: the caller takes the full path, which rewrites I.idx.
 * Index files are written atomically like every other file; no index is
 * kept in a private fallback directory.
 *
 * Size: after a compile adds an entry, when the entries, index files and
 * records take more than RF_CACHE_MAX_MB megabytes (default 1024; 0: no
 * limit), those used least recently are deleted down to 80% of it. Reading
 * and trusting an entry, index file or record marks it used (its
 * modification time). An entry is deleted only under its lock, taken
 * without waiting, and never the one just built; lock files, memo files and
 * files the cache does not own stay (disk_cache.c, "The size limit").
 *
 * This file does not compile anything, does not know what a description
 * means, and keeps no global state beyond the once-per-process fallback
 * warning, a counter that makes temporary names unique and the list of the
 * lock descriptors open (which a forked child closes, disk_cache.c says why).
 */
#ifndef RF_RUNTIME_DISK_CACHE_H
#define RF_RUNTIME_DISK_CACHE_H

#include "../core/core.h"

#define RFI_CACHE_KEY_HEX 33 /* 32 hex digits + NUL */

typedef struct rfi_disk_cache_ops {
    /* Compiles the source file src_path into out_path (a temporary name in the
     * entry's directory). Returns RF_OK or an error with its message set. */
    rf_status (*compile)(void *ctx, const char *src_path, const char *out_path);
    /* Loads the object at path (the caller keeps whatever it loads in ctx).
     * RF_E_CORRUPT: the file is unusable, the cache deletes it and rebuilds
     * once; any other error is returned as it is. */
    rf_status (*load)(void *ctx, const char *path);
    void *ctx;
    const char *object_ext; /* e.g. ".so" */
    const char *source_ext; /* e.g. ".c" */
} rfi_disk_cache_ops;

typedef struct rfi_disk_cache_result {
    char key[RFI_CACHE_KEY_HEX];
    char *object_path; /* rfi_malloc'd; in fallback mode the file is already removed */
    char *source_path; /* rfi_malloc'd; idem */
    bool compiled;     /* this call ran the compiler (false: a disk hit) */
    bool persistent;   /* the entry lives in the cache directory (false: private fallback) */
} rfi_disk_cache_result;

/* The key of (source, context) as 32 lowercase hex digits. */
RFI_FUNC void rfi_disk_cache_key(const char *source, const char *context,
                                 char out[RFI_CACHE_KEY_HEX]);

/* The cache directory path (rfi_malloc'd into *out), created if missing.
 * RF_E_IO when it cannot be created; RF_E_INVALID when it exists but is not a
 * private directory of this user (the message says why). */
RFI_FUNC rf_status rfi_disk_cache_dir(char **out);

/* Finds or builds the entry for (source, context) and loads it through
 * ops->load. On success the caller owns res (free with
 * rfi_disk_cache_result_free); on failure res holds nothing to free. */
RFI_FUNC rf_status rfi_disk_cache_get(const char *source, const char *context,
                                      const rfi_disk_cache_ops *ops,
                                      rfi_disk_cache_result *res);
RFI_FUNC void rfi_disk_cache_result_free(rfi_disk_cache_result *res);

/* A description for the program index (see above); len 0: none. */
typedef struct rfi_disk_cache_index {
    const void *data;
    size_t len;
} rfi_disk_cache_index;

/* rfi_disk_cache_get, and on success (in the persistent directory only)
 * records index -> this entry. index NULL: rfi_disk_cache_get. */
RFI_FUNC rf_status rfi_disk_cache_get_indexed(const char *source, const char *context,
                                              const rfi_disk_cache_index *index,
                                              const rfi_disk_cache_ops *ops,
                                              rfi_disk_cache_result *res);
/* Loads the entry recorded for (index, context) through ops->load, when the
 * index has one and it is still valid (see above). true: loaded, the caller
 * owns res (compiled is false). false: nothing loaded and nothing to free;
 * the caller takes the full path (the thread's error message may have
 * changed). Never creates the directory and never compiles. */
RFI_FUNC bool rfi_disk_cache_find_indexed(const rfi_disk_cache_index *index,
                                          const char *context, const rfi_disk_cache_ops *ops,
                                          rfi_disk_cache_result *res);

/* The 128-bit content hash the manifests use (32 hex digits): for callers
 * that put a digest of large data into a description. */
RFI_FUNC void rfi_disk_cache_digest(const void *data, size_t len, char out[RFI_CACHE_KEY_HEX]);

/* Records: results cheaper to read than to compute again (rf_compile's
 * lowering memo), as files R.rec in the configured directory, R the 128-bit
 * hash of (key, context). A record holds its key and context, compared byte
 * for byte on every read (a hash collision never returns another's payload),
 * and its payload's content hash, checked on every read (a cut-short or
 * altered record reads as missing). Trusted like entry files (regular, owned
 * by the user, writable by no one else); written atomically. get: true with
 * *payload (rfi_malloc'd, NUL-terminated, *len bytes before the NUL) when a
 * valid record exists; false otherwise, silently. put: best effort, silent on
 * failure; never creates the directory. Neither touches the thread's error
 * message. */
RFI_FUNC bool rfi_disk_cache_record_get(const void *key, size_t key_len, const char *context,
                                        char **payload, size_t *len);
RFI_FUNC void rfi_disk_cache_record_put(const void *key, size_t key_len, const char *context,
                                        const void *payload, size_t len);

/* Small one-line values memoised in the cache directory as <name>.memo (the
 * C compiler's `--version` line and the flag that keeps it from emitting
 * gathers, keyed by the compiler binary's identity, so a warm process runs no
 * program at all). name: letters, digits, '-', '_', at
 * most 64 characters. get: true with *value (rfi_malloc'd) when the file
 * exists, is trusted (regular, owned by the user, writable by no one else) and
 * holds one line; false otherwise, silently (the caller recomputes). put: best
 * effort, atomic, silent on failure. Neither touches the thread's error message. */
RFI_FUNC bool rfi_disk_cache_memo_get(const char *name, char **value);
RFI_FUNC void rfi_disk_cache_memo_put(const char *name, const char *value);

#endif
