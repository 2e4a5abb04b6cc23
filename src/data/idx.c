/* idx.c: rf_idx_load, the IDX format of MNIST-style datasets, raw or gzip.
 *
 * Layout: magic 0x00 0x00 <type> <rank>, then rank big-endian u32 dims, then
 * the elements, big-endian, row-major. Types: 0x08 u8, 0x09 i8, 0x0B i16,
 * 0x0C i32, 0x0D f32, 0x0E f64. The data must be exactly the product of the
 * dims times the element size: a truncated or overlong file is corrupt.
 * zlib reads both plain and gzip-compressed files through the same calls.
 * The dims size an allocation only once the data is known to be there: a
 * plain file's size is checked against them first, a compressed file's data
 * is staged in a buffer that grows as it decompresses.
 *
 * Deliberately not here: writing IDX files, memory mapping, i64 (IDX has no
 * such type).
 */
#include "../runtime/runtime.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

typedef struct idx_type {
    uint8_t code;
    const char *name;
    size_t file_size; /* bytes per element in the file */
    rf_dtype dtype;   /* element type of the array we return */
} idx_type;

static const idx_type idx_types[] = {
    {0x08, "u8", 1, RF_U8},   {0x09, "i8", 1, RF_I32},  {0x0B, "i16", 2, RF_I32},
    {0x0C, "i32", 4, RF_I32}, {0x0D, "f32", 4, RF_F32}, {0x0E, "f64", 8, RF_F64},
};

static const idx_type *find_type(uint8_t code)
{
    for (size_t i = 0; i < sizeof idx_types / sizeof idx_types[0]; i++)
        if (idx_types[i].code == code)
            return &idx_types[i];
    return NULL;
}

/* Reads up to n bytes (zlib's gzread takes an unsigned count, so in chunks).
 * Returns the bytes read, or -1 on a decompression error. */
static int64_t read_bytes(gzFile f, void *dst, size_t n)
{
    size_t got = 0;
    while (got < n) {
        size_t want = n - got;
        if (want > (size_t)1 << 30)
            want = (size_t)1 << 30;
        int r = gzread(f, (char *)dst + got, (unsigned)want);
        if (r < 0)
            return -1;
        if (r == 0)
            break;
        got += (size_t)r;
    }
    return (int64_t)got;
}

/* Counts the bytes left until the end of the stream (-1 on an error). */
static int64_t count_rest(gzFile f)
{
    char buf[1 << 14];
    int64_t total = 0;
    for (;;) {
        int r = gzread(f, buf, sizeof buf);
        if (r < 0)
            return -1;
        if (r == 0)
            return total;
        total += r;
    }
}

static rf_status gz_failure(gzFile f, const char *path)
{
    int err = 0;
    const char *msg = gzerror(f, &err);
    if (err == Z_ERRNO)
        return rfi_error(RF_E_IO, "rf_idx_load: %s: %s", path, strerror(errno));
    return rfi_error(RF_E_CORRUPT, "rf_idx_load: %s: corrupt compressed data (%s)", path,
                     msg ? msg : "unknown zlib error");
}

static uint32_t be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* Reads the magic and dims; on success *type, dims[0..*rank). */
static rf_status read_header(gzFile f, const char *path, const idx_type **type, int64_t *dims,
                             int *rank)
{
    uint8_t magic[4];
    int64_t got = read_bytes(f, magic, 4);
    if (got < 0)
        return gz_failure(f, path);
    if (got < 4)
        return rfi_error(RF_E_CORRUPT, "rf_idx_load: %s: file too short for an IDX header "
                         "(%lld bytes)", path, (long long)got);
    if (magic[0] != 0 || magic[1] != 0)
        return rfi_error(RF_E_CORRUPT, "rf_idx_load: %s: bad magic %02x %02x %02x %02x "
                         "(expected 00 00 <type> <rank>)", path, magic[0], magic[1],
                         magic[2], magic[3]);
    *type = find_type(magic[2]);
    if (!*type)
        return rfi_error(RF_E_CORRUPT, "rf_idx_load: %s: unknown element type 0x%02x "
                         "(expected 08, 09, 0B, 0C, 0D or 0E)", path, magic[2]);
    if (magic[3] < 1 || magic[3] > RF_MAX_RANK)
        return rfi_error(RF_E_CORRUPT, "rf_idx_load: %s: rank %d is outside 1..%d", path,
                         magic[3], RF_MAX_RANK);
    *rank = magic[3];
    uint8_t raw[4 * RF_MAX_RANK];
    size_t need = 4 * (size_t)*rank;
    got = read_bytes(f, raw, need);
    if (got < 0)
        return gz_failure(f, path);
    if ((size_t)got < need)
        return rfi_error(RF_E_CORRUPT, "rf_idx_load: %s: truncated header (%d dims need %zu "
                         "bytes, found %lld)", path, *rank, need, (long long)got);
    for (int i = 0; i < *rank; i++)
        dims[i] = be32(raw + 4 * i);
    return RF_OK;
}

/* Converts n big-endian elements of `t` at src into the array's dtype at dst
 * (src and dst may be the same buffer). */
static void decode(const idx_type *t, const uint8_t *src, void *dst, int64_t n)
{
    switch (t->code) {
    case 0x08:
        if ((const void *)src != dst)
            memcpy(dst, src, (size_t)n);
        break;
    case 0x09:        /* widen backwards so src and dst may overlap */
        for (int64_t i = n - 1; i >= 0; i--)
            ((int32_t *)dst)[i] = (int8_t)src[i];
        break;
    case 0x0B:
        for (int64_t i = n - 1; i >= 0; i--)
            ((int32_t *)dst)[i] = (int16_t)(uint16_t)(src[2 * i] << 8 | src[2 * i + 1]);
        break;
    case 0x0C:
    case 0x0D:
        for (int64_t i = 0; i < n; i++) {
            uint32_t v = be32(src + 4 * i);
            memcpy((char *)dst + 4 * i, &v, 4);
        }
        break;
    case 0x0E:
        for (int64_t i = 0; i < n; i++) {
            uint64_t v = (uint64_t)be32(src + 8 * i) << 32 | be32(src + 8 * i + 4);
            memcpy((char *)dst + 8 * i, &v, 8);
        }
        break;
    default: break;
    }
}

/* Rejects a header whose dims the file cannot possibly hold before allocating
 * for them (a corrupt header must not ask for terabytes). A plain file must
 * hold exactly the data; deflate expands at most ~1032:1. */
static rf_status check_plausible(gzFile f, const char *path, size_t expected, int64_t file_bytes,
                                 int64_t header_bytes)
{
    if (gzdirect(f)) {
        int64_t found = file_bytes - header_bytes;
        if ((int64_t)expected != found)
            return rfi_error(RF_E_CORRUPT, "rf_idx_load: %s: expected %zu bytes of data, "
                             "found %lld", path, expected, (long long)found);
        return RF_OK;
    }
    if ((double)expected > 1100.0 * (double)file_bytes + 4096.0)
        return rfi_error(RF_E_CORRUPT, "rf_idx_load: %s: expected %zu bytes of data, more than "
                         "the %lld-byte compressed file can hold", path, expected,
                         (long long)file_bytes);
    return RF_OK;
}

/* Up to `expected` bytes of a compressed stream into *out (rfi_malloc'd,
 * NULL when none came), in a buffer that grows with what actually arrives:
 * the header's dims are not trusted for an allocation, since damaged ones may
 * claim up to ~1100 times the file's size (one flipped byte in the image
 * count of Fashion-MNIST's 26 MB training images: 13 GB). Returns the bytes
 * read, -1 on a decompression error, -2 when out of memory. */
static int64_t read_growing(gzFile f, size_t expected, char **out)
{
    *out = NULL;
    size_t cap = 0, got = 0;
    char *buf = NULL;
    while (got < expected) {
        if (got == cap) {
            size_t grown = cap ? cap * 2 : (size_t)1 << 16;
            grown = grown < expected ? grown : expected;
            char *b = rfi_realloc(buf, grown);
            if (!b) {
                rfi_free(buf);
                return -2;
            }
            buf = b;
            cap = grown;
        }
        int64_t r = read_bytes(f, buf + got, cap - got);
        if (r < 0) {
            rfi_free(buf);
            return -1;
        }
        got += (size_t)r;
        if (got < cap)
            break; /* the stream ended */
    }
    *out = buf;
    return (int64_t)got;
}

/* Reads the elements into a new array, checking the byte count exactly. A
 * plain file holds exactly what its dims say (check_plausible), so its data
 * is read into the array's buffer and decoded in place (the array is at
 * least as large: i8/i16 widen); a compressed one's is staged first
 * (read_growing) and the array allocated once all of it has arrived. */
static rf_status read_data(gzFile f, const char *path, const idx_type *t, const int64_t *dims,
                           int rank, int64_t file_bytes, rf_array **out)
{
    uint64_t numel = 1;
    for (int i = 0; i < rank; i++) {
        if (dims[i] && numel > (uint64_t)INT64_MAX / 8 / (uint64_t)dims[i])
            return rfi_error(RF_E_CORRUPT, "rf_idx_load: %s: dims are too large", path);
        numel *= (uint64_t)dims[i];
    }
    size_t expected = (size_t)numel * t->file_size;
    rf_status st = check_plausible(f, path, expected, file_bytes, 4 + 4 * (int64_t)rank);
    if (st != RF_OK)
        return st;
    rf_array *a = NULL;
    char *staged = NULL;
    int64_t got;
    if (gzdirect(f)) {
        a = rfi_array_alloc("rf_idx_load", rf_device_host(), t->dtype, dims, rank);
        if (!a)
            return strstr(rf_errmsg(), "out of memory") ? RF_E_NOMEM : RF_E_CORRUPT;
        got = read_bytes(f, a->data, expected);
    } else {
        got = read_growing(f, expected, &staged);
        if (got == -2)
            return rfi_error(RF_E_NOMEM, "rf_idx_load: %s: out of memory reading the data",
                             path);
    }
    int64_t extra = got == (int64_t)expected ? count_rest(f) : 0;
    int err = Z_OK;
    gzerror(f, &err);
    if (got >= 0 && extra >= 0 && err == Z_BUF_ERROR) {
        /* zlib reads a stream cut short, even inside its CRC trailer, as a
         * short read and says so only here: unchecked data is corrupt data */
        st = rfi_error(RF_E_CORRUPT, "rf_idx_load: %s: the compressed stream is truncated "
                       "(its end and checksum are missing)", path);
    } else if (got < 0 || extra < 0) {
        st = gz_failure(f, path);
    } else if (got != (int64_t)expected || extra != 0) {
        st = rfi_error(RF_E_CORRUPT, "rf_idx_load: %s: expected %zu bytes of data, found %lld",
                       path, expected, (long long)(got + extra));
    } else if (!a) {
        a = rfi_array_alloc("rf_idx_load", rf_device_host(), t->dtype, dims, rank);
        if (!a)
            st = strstr(rf_errmsg(), "out of memory") ? RF_E_NOMEM : RF_E_CORRUPT;
    }
    if (st == RF_OK) {
        decode(t, staged ? (const uint8_t *)staged : a->data, a->data, (int64_t)numel);
        *out = a;
    } else {
        rfi_array_release(a);
    }
    rfi_free(staged);
    return st;
}

rf_status rf_idx_load(const char *path, rf_array **out)
{
    if (out)
        *out = NULL;
    if (!path || !out)
        return rfi_error(RF_E_INVALID, "rf_idx_load: %s is NULL", path ? "out" : "path");
    int64_t size;
    int fd = rfi_open_regular(path, &size);
    if (fd < 0)
        return rfi_error(RF_E_IO, "rf_idx_load: %s: %s", path,
                         errno == EINVAL ? "not a regular file" : strerror(errno));
    gzFile f = gzdopen(fd, "rb");
    if (!f) {
        close(fd);
        return rfi_error(RF_E_NOMEM, "rf_idx_load: %s: cannot open a zlib stream", path);
    }
    gzbuffer(f, 1 << 17);
    const idx_type *t = NULL;
    int64_t dims[RF_MAX_RANK];
    int rank = 0;
    rf_status st = read_header(f, path, &t, dims, &rank);
    if (st == RF_OK)
        st = read_data(f, path, t, dims, rank, size, out);
    gzclose(f);
    return st;
}
