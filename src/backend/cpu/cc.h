/* cc.h: the compiler driver of the CPU backend. Turns generated C source into
 * a loaded module: finds it in the disk cache (src/runtime/disk_cache.h) or
 * compiles it with the system C compiler, then dlopens it and resolves its one
 * entry point (RF_MODULE_ENTRY_NAME, module_abi.h).
 *
 * Compiler: $CC if set and non-empty, else `cc`. Its words (split at blanks,
 * no quoting, as make's) start every command: a program (a path, or a name
 * looked up in PATH), then a wrapper's compiler or flags ("ccache gcc",
 * "gcc -m64"). It runs without a shell (fork + exec of an argv array), in a
 * process group of its own, stdin from /dev/null, stdout and stderr captured
 * through a pipe, no other inherited file descriptors, killed with its group
 * after RF_CC_TIMEOUT seconds (default 600). Flags, and why:
 *   -O2               optimised, but far faster to compile than -O3
 *   -std=c11          the dialect the renderer writes
 *   -fPIC -shared     a shared object for dlopen
 *   -fopenmp-simd     honours `#pragma omp simd` and `declare simd` (libmvec
 *                     vector math) without linking an OpenMP runtime
 *   -fno-math-errno   lets libm calls (log, tanh, sqrt) vectorise and inline (errno is unused)
 *   -fno-trapping-math lets if-converted loops vectorise (no FP traps are enabled)
 *   -march=native     the CPU's vector units (the CPU features are in the cache key)
 *   -lm               libm/libmvec: the module's only undefined symbols
 * No -ffast-math: results must keep IEEE semantics (NaN/Inf, no reassociation)
 * to match the reference interpreter.
 *
 * Cache key context: resolved compiler path + first line of `cc --version`,
 * the flags, RF_MODULE_ABI and the CPU (vendor, family, model, feature flags
 * from /proc/cpuinfo). Computed once per process and kept (a documented cache,
 * recomputed when $CC or $PATH change).
 *
 * Program index: a backend that can describe exactly what its source is
 * generated from (rfi_cc_load_program) skips generating it on a warm compile:
 * the disk cache's index (disk_cache.h) maps (description, context) to the
 * entry built from that source. The description must change whenever the
 * source could: the backend puts in it the identity of the build that holds
 * its code generator (rfi_cc_build_id: the ELF build-id, which the linker
 * derives from the object's contents, so any change to the generator's code
 * gives a new one; no hand-bumped version). Without a build-id there is no
 * index.
 */
#ifndef RF_BACKEND_CPU_CC_H
#define RF_BACKEND_CPU_CC_H

#include "../../core/core.h"
#include "../../runtime/disk_cache.h"
#include "module_abi.h"

typedef struct rfi_module {
    void *handle;          /* dlopen handle (RTLD_NOW | RTLD_LOCAL) */
    rf_module_entry entry; /* RF_MODULE_ENTRY_NAME */
    char *so_path;         /* the loaded object (removed already when !cached) */
    char *src_path;        /* the source kept beside it (idem) */
    char key[RFI_CACHE_KEY_HEX];
    bool compiled; /* this load ran the compiler (false: disk-cache hit) */
    bool cached;   /* the entry is in the persistent cache directory */
} rfi_module;

/* Loads the module for `source` (from the disk cache, else compiling it).
 * `name` only labels messages. RF_E_COMPILE when the compiler is missing or
 * fails (the message holds the command line, the compiler's output and the
 * path of the kept source) or the fresh object does not load. */
RFI_FUNC rf_status rfi_cc_load_module(const char *source, const char *name, rfi_module **out);
/* Produces a program's C source (rfi_malloc'd into *source). */
typedef rf_status (*rfi_cc_source_fn)(void *ctx, char **source);

/* Loads the module of a program described by desc (desc_len bytes that
 * determine its source exactly; see "Program index" above): from the disk
 * cache's index when it names a valid entry for desc in the current context
 * (gen is not called: no source is generated), else gen's source as
 * rfi_cc_load_module does, recording desc for its entry. desc NULL or
 * desc_len 0: no index, always gen. */
RFI_FUNC rf_status rfi_cc_load_program(const void *desc, size_t desc_len, rfi_cc_source_fn gen,
                                       void *gen_ctx, const char *name, rfi_module **out);

/* The GNU build-id (lowercase hex) of the loaded ELF object (shared library
 * or executable) whose segments hold code_addr, found at run time with
 * dl_iterate_phdr. false (out "") when that object has none. */
RFI_FUNC bool rfi_cc_build_id(uintptr_t code_addr, char *out, size_t n);

/* dlcloses and frees; NULL is fine. */
RFI_FUNC void rfi_module_free(rfi_module *m);
RFI_FUNC rf_module_entry rfi_module_entry_fn(const rfi_module *m);

/* The cache-key context string described above (rfi_malloc'd into *out). */
RFI_FUNC rf_status rfi_cc_context(char **out);

/* Statistics, process-wide: compiler runs for modules (not the --version
 * probe); module loads served by the disk cache without a compiler (index
 * hits included); sources generated by rfi_cc_load_program's gen; loads of
 * rfi_cc_load_program served by the index (no source generated). */
RFI_FUNC uint64_t rfi_cc_n_compiles(void);
RFI_FUNC uint64_t rfi_cc_n_disk_hits(void);
RFI_FUNC uint64_t rfi_cc_n_sources(void);
RFI_FUNC uint64_t rfi_cc_n_index_hits(void);

#endif
