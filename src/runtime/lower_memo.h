/* lower_memo.h: rf_compile's memo, on disk, of the stages before a backend
 * plans a program: autodiff and DCE (the lowered program) and the backend's
 * own rewrite (the optimised program, rfi_backend.optimise).
 *
 * A warm compile used to run those stages again only to arrive at programs
 * the disk cache already knew: for a ResNet training step, about 3 ms of a
 * fresh process's 9 ms (trace 0.5, autodiff and DCE 1.3, optimise 1.9). The
 * traced program and the build determine them, so a record of the disk
 * cache (disk_cache.h, "Records") maps the traced program's description
 * (program_codec.h) to the two programs' encodings, and a warm compile
 * decodes them instead. The record's context names what else they depend
 * on: the build-id of the library that lowers and optimises (any change to
 * that code gives a new one), the backend, and the backend's optimise
 * switches (optimise_context). The captures of both programs are the traced
 * program's arrays, by index.
 *
 * No memo is kept when the build has no build-id, when RF_DUMP is set (the
 * dumps want every stage), or for a backend without an optimise stage (the
 * interpreter runs the lowered program: lowering is all there is to save, and
 * the oracle should take the plain path). A record that is missing, foreign,
 * cut short, altered or does not decode is a miss: the compile lowers as
 * usual and writes the record again.
 */
#ifndef RF_RUNTIME_LOWER_MEMO_H
#define RF_RUNTIME_LOWER_MEMO_H

#include "runtime.h"

typedef struct rfi_lower_memo {
    rfi_strbuf key;     /* the traced program's description */
    rfi_strbuf context; /* build, backend, optimise switches */
    rfi_strbuf payload; /* what rfi_lower_memo_keep encoded, for _record */
    rf_device *device;
    rf_array **pool;    /* the traced program's captures (one reference each) */
    int n_pool;
} rfi_lower_memo;

/* Starts the memo of traced program t on backend b (the memo holds no pointer
 * to t: t may be consumed by lowering). false when no memo is kept (see
 * above, or out of memory): m then holds nothing and needs no _end. */
RFI_FUNC bool rfi_lower_memo_begin(rfi_lower_memo *m, const rfi_graph *t, const rfi_backend *b);
/* The lowered and optimised programs and the lowered one's rfi_hash, rebuilt
 * from the record: true with all three (owned by the caller), or false with
 * none when there is no valid record. */
RFI_FUNC bool rfi_lower_memo_find(rfi_lower_memo *m, rfi_graph **prog, rfi_graph **opt,
                                  uint64_t *hash);
/* Encodes the programs the full path made, for _record (nothing is written
 * yet: a compile that fails after this records nothing). */
RFI_FUNC void rfi_lower_memo_keep(rfi_lower_memo *m, const rfi_graph *prog, const rfi_graph *opt,
                                  uint64_t hash);
/* Writes what _keep encoded (best effort, silent). */
RFI_FUNC void rfi_lower_memo_record(rfi_lower_memo *m);
RFI_FUNC void rfi_lower_memo_end(rfi_lower_memo *m);

/* Process-wide count of compiles served by the memo (for tests). */
RFI_FUNC uint64_t rfi_lower_memo_n_hits(void);

#endif
