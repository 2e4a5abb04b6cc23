/* fuzz_bytes.h: for the fuzz targets that build programs from their input:
 * the input read one byte at a time, zeros once it runs out (so every input
 * describes a whole program).
 *
 * Read at most one value in the arguments of one call, the others into locals
 * first: C leaves the order of a call's arguments unspecified (gcc reads them
 * right to left, clang left to right), and an input must describe the same
 * program whichever compiler built the target. */
#ifndef RF_FUZZ_BYTES_H
#define RF_FUZZ_BYTES_H

#include <stddef.h>
#include <stdint.h>

typedef struct bytes {
    const uint8_t *p;
    size_t n, at;
} bytes;

static unsigned next(bytes *b) { return b->at < b->n ? b->p[b->at++] : 0; }

#endif
