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
 * This file does not compile anything, does not evict old entries (delete the
 * directory to clear it), and keeps no global state beyond the once-per-process
 * fallback warning.
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

/* Small one-line values memoised in the cache directory as <name>.memo (the
 * C compiler's `--version` line, keyed by the compiler binary's identity, so a
 * warm process runs no program at all). name: letters, digits, '-', '_', at
 * most 64 characters. get: true with *value (rfi_malloc'd) when the file
 * exists, is trusted (regular, owned by the user, writable by no one else) and
 * holds one line; false otherwise, silently (the caller recomputes). put: best
 * effort, atomic, silent on failure. Neither touches the thread's error message. */
RFI_FUNC bool rfi_disk_cache_memo_get(const char *name, char **value);
RFI_FUNC void rfi_disk_cache_memo_put(const char *name, const char *value);

#endif
