/* safetensors.h: the safetensors header (a small JSON object) as checkpoint.c
 * reads it: a strict parser and the checks that make offsets safe to use.
 *
 * File layout: u64 little-endian header length N, N bytes of JSON
 * {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]},
 *  ..., "__metadata__": {"key": "value", ...}}, then the data section, the
 * offsets being relative to its start.
 */
#ifndef RF_DATA_SAFETENSORS_H
#define RF_DATA_SAFETENSORS_H

#include "../core/core.h"

/* Headers above this many bytes are rejected before being read. */
#define RFI_ST_MAX_HEADER ((uint64_t)100 * 1000 * 1000)

typedef struct rfi_st_entry {
    char *name;   /* rfi_malloc */
    rf_dtype dtype;
    int rank;
    int64_t dims[RF_MAX_RANK];
    uint64_t begin, end; /* within the data section */
} rfi_st_entry;

typedef struct rfi_st_header {
    rfi_st_entry *entries; /* sorted by name after a successful parse */
    int n, cap;
} rfi_st_header;

/* The safetensors name of a dtype ("F32") or NULL. */
RFI_FUNC const char *rfi_st_dtype_name(rf_dtype dt);
/* Parses json[0..len) into h (which must be zeroed) and checks every entry
 * against a data section of data_len bytes: known dtype, size matching the
 * shape, offsets in range and not overlapping, no duplicate names. Errors
 * (RF_E_CORRUPT, RF_E_DTYPE, RF_E_NOMEM) name `path` and the problem. The
 * caller frees h with rfi_st_header_free in every case. */
RFI_FUNC rf_status rfi_st_parse(const char *path, const char *json, size_t len,
                                uint64_t data_len, rfi_st_header *h);
/* The entry named `name`, or NULL. */
RFI_FUNC const rfi_st_entry *rfi_st_find(const rfi_st_header *h, const char *name);
RFI_FUNC void rfi_st_header_free(rfi_st_header *h);

#endif
