/* program_codec.h: programs as bytes, for the caches on disk.
 *
 * Two encodings share one layout (varints, the program node by node in SSA
 * order, operands by distance back to their node):
 *   - the *description* (rfi_program_describe) says what a program is, for a
 *     cache key: it is compared byte for byte, so two programs get one
 *     description only when every op, attribute, type, constant byte,
 *     argument and capture type, output, update and the node order agree.
 *     Constants larger than RFI_DESC_INLINE_BYTES appear as a 128-bit digest.
 *     Capture arrays appear by type only (their values are run-time data);
 *   - the *encoding* (rfi_program_encode) holds everything needed to build
 *     the program again with rfi_program_decode: constants in full, and each
 *     capture as its index into a list of arrays the caller passes to both
 *     (the traced program's captures), so the rebuilt program captures the
 *     same arrays.
 * Decoding rebuilds every node through rfi_node_new, so types are inferred
 * and checked again; bytes that do not make a valid program are refused with
 * RF_E_CORRUPT and nothing is leaked. The caches that store encodings also
 * check a content digest first: a refused decode is a second line of defence.
 */
#ifndef RF_RUNTIME_PROGRAM_CODEC_H
#define RF_RUNTIME_PROGRAM_CODEC_H

#include "runtime.h"

#define RFI_DESC_INLINE_BYTES 256

/* Appends g's description to b (b->failed on out of memory or when g is not a
 * verified program). */
RFI_FUNC void rfi_program_describe(rfi_strbuf *b, const rfi_graph *g);

/* Appends g's encoding to b. Every capture of g must be one of pool[0..n_pool);
 * false (b unchanged in meaning: the caller drops it) when one is not, or b failed. */
RFI_FUNC bool rfi_program_encode(rfi_strbuf *b, const rfi_graph *g, rf_array *const *pool,
                                 int n_pool);

/* Builds the program encoded at data[0..len) on dev, its captures taken from
 * pool as they were encoded. On success *out is the new program and *used the
 * bytes it took; RF_E_CORRUPT (message naming what was wrong) when the bytes
 * are not an encoding, RF_E_NOMEM when memory ran out. */
RFI_FUNC rf_status rfi_program_decode(const void *data, size_t len, rf_device *dev,
                                      rf_array *const *pool, int n_pool, rfi_graph **out,
                                      size_t *used);

/* Varints (LEB128 of zigzag-encoded values), for callers that frame encodings. */
RFI_FUNC void rfi_codec_put_int(rfi_strbuf *b, int64_t v);

#endif
