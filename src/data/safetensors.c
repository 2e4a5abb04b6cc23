/* safetensors.c: a strict parser for the JSON header of a safetensors file
 * and the checks that make its offsets safe to use.
 *
 * The grammar is exactly what the format allows: one object whose values are
 * tensor descriptions ({"dtype", "shape", "data_offsets"}, each once) or the
 * "__metadata__" object of string values. Numbers are non-negative integers
 * without sign, fraction or exponent. Anything else (unknown keys, duplicate
 * names, trailing text other than whitespace) is corrupt, and every error
 * names the byte offset in the header. The parser never reads past `len` and
 * allocates only names and the entry list, so a hostile header costs at most
 * a few times its own size.
 *
 * Deliberately not here: general JSON values, dtypes reflux lacks (F16,
 * BF16, I8, ...: reported as RF_E_DTYPE), writing (checkpoint.c prints).
 */
#include "safetensors.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct parser {
    const char *path;
    const char *s;
    size_t len, pos;
    rf_status st; /* first error, RF_OK while fine */
} parser;

static bool fail(parser *p, const char *what)
{
    if (p->st == RF_OK)
        p->st = rfi_error(RF_E_CORRUPT, "rf_checkpoint_load: %s: corrupt header at byte %zu: %s",
                          p->path, p->pos, what);
    return false;
}

static void skip_ws(parser *p)
{
    while (p->pos < p->len && (p->s[p->pos] == ' ' || p->s[p->pos] == '\t' ||
                               p->s[p->pos] == '\n' || p->s[p->pos] == '\r'))
        p->pos++;
}

/* Skips whitespace, then consumes c if it is next. */
static bool accept(parser *p, char c)
{
    skip_ws(p);
    if (p->pos < p->len && p->s[p->pos] == c) {
        p->pos++;
        return true;
    }
    return false;
}

static bool expect(parser *p, char c)
{
    if (accept(p, c))
        return true;
    char what[48];
    snprintf(what, sizeof what, "expected '%c'", c);
    return fail(p, what);
}

static int hex_value(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

static bool read_hex4(parser *p, uint32_t *out)
{
    if (p->len - p->pos < 4)
        return fail(p, "truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) {
        int h = hex_value(p->s[p->pos + (size_t)i]);
        if (h < 0)
            return fail(p, "bad \\u escape");
        v = v << 4 | (uint32_t)h;
    }
    p->pos += 4;
    *out = v;
    return true;
}

static size_t put_utf8(char *dst, uint32_t cp)
{
    if (cp < 0x80) {
        dst[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        dst[0] = (char)(0xC0 | cp >> 6);
        dst[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        dst[0] = (char)(0xE0 | cp >> 12);
        dst[1] = (char)(0x80 | (cp >> 6 & 0x3F));
        dst[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    dst[0] = (char)(0xF0 | cp >> 18);
    dst[1] = (char)(0x80 | (cp >> 12 & 0x3F));
    dst[2] = (char)(0x80 | (cp >> 6 & 0x3F));
    dst[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* One \uXXXX escape (a surrogate pair counts as one), the backslash and 'u'
 * already consumed; appends its UTF-8 to dst. */
static bool read_unicode_escape(parser *p, char *dst, size_t *n)
{
    uint32_t cp;
    if (!read_hex4(p, &cp))
        return false;
    if (cp >= 0xDC00 && cp <= 0xDFFF)
        return fail(p, "lone low surrogate in \\u escape");
    if (cp >= 0xD800 && cp <= 0xDBFF) {
        uint32_t lo;
        if (p->len - p->pos < 2 || p->s[p->pos] != '\\' || p->s[p->pos + 1] != 'u')
            return fail(p, "high surrogate without its low half");
        p->pos += 2;
        if (!read_hex4(p, &lo))
            return false;
        if (lo < 0xDC00 || lo > 0xDFFF)
            return fail(p, "high surrogate without its low half");
        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
    }
    if (cp == 0)
        return fail(p, "NUL character in a string");
    *n += put_utf8(dst + *n, cp);
    return true;
}

/* A JSON string into a new NUL-terminated buffer (rfi_malloc). Its decoded
 * form is never longer than its encoded one, so one allocation suffices. */
static bool parse_string(parser *p, char **out)
{
    *out = NULL;
    if (!expect(p, '"'))
        return false;
    size_t close = p->pos;
    while (close < p->len && p->s[close] != '"')
        close += p->s[close] == '\\' ? 2 : 1;
    if (close >= p->len)
        return fail(p, "unterminated string");
    char *dst = rfi_malloc(close - p->pos + 1);
    if (!dst) {
        if (p->st == RF_OK)
            p->st = rfi_error(RF_E_NOMEM, "rf_checkpoint_load: %s: out of memory", p->path);
        return false;
    }
    size_t n = 0;
    while (p->pos < close) {
        unsigned char c = (unsigned char)p->s[p->pos++];
        if (c < 0x20) {
            rfi_free(dst);
            return fail(p, "control character in a string");
        }
        if (c != '\\') {
            dst[n++] = (char)c;
            continue;
        }
        char e = p->s[p->pos++];
        const char *simple = strchr("\"\\/bfnrt", e);
        if (e && simple) {
            static const char decoded[] = "\"\\/\b\f\n\r\t";
            dst[n++] = decoded[simple - "\"\\/bfnrt"];
        } else if (e != 'u' || !read_unicode_escape(p, dst, &n)) {
            rfi_free(dst);
            return e == 'u' ? false : fail(p, "bad escape in a string");
        }
    }
    p->pos = close + 1;
    dst[n] = '\0';
    if (!rfi_valid_utf8(dst)) { /* JSON text is UTF-8; safetensors refuses the rest too */
        rfi_free(dst);
        return fail(p, "invalid UTF-8 in a string");
    }
    *out = dst;
    return true;
}

/* A non-negative integer without sign, fraction, exponent or leading zeros. */
static bool parse_uint(parser *p, uint64_t *out)
{
    skip_ws(p);
    size_t start = p->pos;
    uint64_t v = 0;
    while (p->pos < p->len && p->s[p->pos] >= '0' && p->s[p->pos] <= '9') {
        unsigned d = (unsigned)(p->s[p->pos] - '0');
        if (v > ((uint64_t)INT64_MAX - d) / 10)
            return fail(p, "integer too large");
        v = v * 10 + d;
        p->pos++;
    }
    if (p->pos == start)
        return fail(p, "expected a non-negative integer");
    if (p->s[start] == '0' && p->pos - start > 1)
        return fail(p, "leading zero in an integer");
    if (p->pos < p->len && strchr(".eE", p->s[p->pos]) && p->s[p->pos])
        return fail(p, "expected an integer, found a fraction or exponent");
    *out = v;
    return true;
}

/* [n, n, ...] with at most max items; *count receives the number read. */
static bool parse_uint_list(parser *p, uint64_t *items, int max, int *count)
{
    *count = 0;
    if (!expect(p, '['))
        return false;
    if (accept(p, ']'))
        return true;
    do {
        if (*count == max)
            return fail(p, max == 2 ? "data_offsets needs exactly two integers"
                                    : "shape has more than 8 dims");
        if (!parse_uint(p, &items[(*count)++]))
            return false;
    } while (accept(p, ','));
    return expect(p, ']');
}

static const struct {
    const char *name;
    rf_dtype dtype;
} st_dtypes[] = {{"F32", RF_F32}, {"F64", RF_F64}, {"I32", RF_I32},
                 {"I64", RF_I64}, {"U8", RF_U8},   {"BOOL", RF_BOOL}};

const char *rfi_st_dtype_name(rf_dtype dt)
{
    for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++)
        if (st_dtypes[i].dtype == dt)
            return st_dtypes[i].name;
    return NULL;
}

static bool set_dtype(parser *p, rfi_st_entry *e, const char *name)
{
    for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++)
        if (strcmp(st_dtypes[i].name, name) == 0) {
            e->dtype = st_dtypes[i].dtype;
            return true;
        }
    if (p->st == RF_OK)
        p->st = rfi_error(RF_E_DTYPE, "rf_checkpoint_load: %s: tensor \"%s\" has dtype %s, "
                          "which reflux does not support", p->path, e->name, name);
    return false;
}

/* One field of a tensor description; `seen` marks dtype/shape/offsets. */
static bool parse_tensor_field(parser *p, rfi_st_entry *e, unsigned *seen)
{
    char *key;
    if (!parse_string(p, &key))
        return false;
    unsigned bit = strcmp(key, "dtype") == 0          ? 1u
                   : strcmp(key, "shape") == 0        ? 2u
                   : strcmp(key, "data_offsets") == 0 ? 4u
                                                      : 0u;
    rfi_free(key);
    if (!bit)
        return fail(p, "unknown key in a tensor description");
    if (*seen & bit)
        return fail(p, "repeated key in a tensor description");
    *seen |= bit;
    if (!expect(p, ':'))
        return false;
    if (bit == 1u) {
        char *name;
        if (!parse_string(p, &name))
            return false;
        bool ok = set_dtype(p, e, name);
        rfi_free(name);
        return ok;
    }
    uint64_t items[RF_MAX_RANK];
    int count;
    if (!parse_uint_list(p, items, bit == 2u ? RF_MAX_RANK : 2, &count))
        return false;
    if (bit == 2u) {
        e->rank = count;
        for (int i = 0; i < count; i++)
            e->dims[i] = (int64_t)items[i];
        return true;
    }
    if (count != 2)
        return fail(p, "data_offsets needs exactly two integers");
    e->begin = items[0];
    e->end = items[1];
    return true;
}

static bool parse_tensor(parser *p, rfi_st_entry *e)
{
    if (!expect(p, '{'))
        return false;
    unsigned seen = 0;
    if (!accept(p, '}')) {
        do {
            if (!parse_tensor_field(p, e, &seen))
                return false;
        } while (accept(p, ','));
        if (!expect(p, '}'))
            return false;
    }
    if (seen != 7u)
        return fail(p, "a tensor description lacks dtype, shape or data_offsets");
    return true;
}

/* {"key": "value", ...}: checked and dropped (reflux keeps no metadata). */
static bool parse_metadata(parser *p)
{
    if (!expect(p, '{'))
        return false;
    if (accept(p, '}'))
        return true;
    do {
        char *key = NULL, *value = NULL;
        bool ok = parse_string(p, &key) && expect(p, ':') && parse_string(p, &value);
        rfi_free(key);
        rfi_free(value);
        if (!ok)
            return false;
    } while (accept(p, ','));
    return expect(p, '}');
}

static rfi_st_entry *new_entry(parser *p, rfi_st_header *h)
{
    if (h->n == h->cap) {
        int cap = h->cap ? h->cap * 2 : 16;
        rfi_st_entry *v = rfi_realloc(h->entries, (size_t)cap * sizeof *v);
        if (!v) {
            if (p->st == RF_OK)
                p->st = rfi_error(RF_E_NOMEM, "rf_checkpoint_load: %s: out of memory", p->path);
            return NULL;
        }
        h->entries = v;
        h->cap = cap;
    }
    rfi_st_entry *e = &h->entries[h->n++];
    memset(e, 0, sizeof *e);
    return e;
}

/* One "key": value member of the top-level object. */
static bool parse_member(parser *p, rfi_st_header *h, bool *seen_metadata)
{
    char *key;
    if (!parse_string(p, &key))
        return false;
    if (!expect(p, ':')) {
        rfi_free(key);
        return false;
    }
    if (strcmp(key, "__metadata__") == 0) {
        rfi_free(key);
        if (*seen_metadata)
            return fail(p, "repeated __metadata__");
        *seen_metadata = true;
        return parse_metadata(p);
    }
    rfi_st_entry *e = new_entry(p, h);
    if (!e) {
        rfi_free(key);
        return false;
    }
    e->name = key;
    return parse_tensor(p, e);
}

static bool parse_object(parser *p, rfi_st_header *h)
{
    bool seen_metadata = false;
    if (!expect(p, '{'))
        return false;
    if (!accept(p, '}')) {
        do {
            if (!parse_member(p, h, &seen_metadata))
                return false;
        } while (accept(p, ','));
        if (!expect(p, '}'))
            return false;
    }
    skip_ws(p);
    if (p->pos != p->len)
        return fail(p, "text after the header object");
    return true;
}

/* ---- Checks on the parsed entries ------------------------------------------------------ */

static int by_name(const void *a, const void *b)
{
    return strcmp(((const rfi_st_entry *)a)->name, ((const rfi_st_entry *)b)->name);
}

static int by_begin(const void *a, const void *b)
{
    const rfi_st_entry *x = *(const rfi_st_entry *const *)a, *y = *(const rfi_st_entry *const *)b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    return (x->end > y->end) - (x->end < y->end);
}

static rf_status check_entry(const char *path, const rfi_st_entry *e, uint64_t data_len)
{
    uint64_t bytes = rf_dtype_size(e->dtype);
    for (int i = 0; i < e->rank; i++) {
        uint64_t d = (uint64_t)e->dims[i];
        if (d && bytes > UINT64_MAX / 2 / d)
            return rfi_error(RF_E_CORRUPT, "rf_checkpoint_load: %s: tensor \"%s\": shape is "
                             "too large", path, e->name);
        bytes *= d;
    }
    if (e->end < e->begin || e->end > data_len)
        return rfi_error(RF_E_CORRUPT, "rf_checkpoint_load: %s: tensor \"%s\": data_offsets "
                         "[%llu, %llu] are outside the %llu-byte data section (truncated "
                         "file?)", path, e->name, (unsigned long long)e->begin,
                         (unsigned long long)e->end, (unsigned long long)data_len);
    if (e->end - e->begin != bytes)
        return rfi_error(RF_E_CORRUPT, "rf_checkpoint_load: %s: tensor \"%s\": data_offsets "
                         "span %llu bytes but its shape needs %llu", path, e->name,
                         (unsigned long long)(e->end - e->begin), (unsigned long long)bytes);
    return RF_OK;
}

static rf_status check_overlaps(const char *path, const rfi_st_header *h)
{
    if (h->n < 2)
        return RF_OK;
    const rfi_st_entry **order = rfi_malloc((size_t)h->n * sizeof *order);
    if (!order)
        return rfi_error(RF_E_NOMEM, "rf_checkpoint_load: %s: out of memory", path);
    for (int i = 0; i < h->n; i++)
        order[i] = &h->entries[i];
    qsort(order, (size_t)h->n, sizeof *order, by_begin);
    rf_status st = RF_OK;
    const rfi_st_entry *prev = NULL; /* the last non-empty range */
    for (int i = 0; i < h->n && st == RF_OK; i++) {
        if (order[i]->begin == order[i]->end)
            continue;
        if (prev && order[i]->begin < prev->end)
            st = rfi_error(RF_E_CORRUPT, "rf_checkpoint_load: %s: tensors \"%s\" and \"%s\" "
                           "overlap in the data section", path, prev->name, order[i]->name);
        prev = order[i];
    }
    rfi_free(order);
    return st;
}

rf_status rfi_st_parse(const char *path, const char *json, size_t len, uint64_t data_len,
                       rfi_st_header *h)
{
    parser p = {.path = path, .s = json, .len = len};
    if (!parse_object(&p, h))
        return p.st != RF_OK ? p.st : rfi_error(RF_E_INTERNAL, "rf_checkpoint_load: %s: parser "
                                               "failed without a message", path);
    for (int i = 0; i < h->n; i++) {
        rf_status st = check_entry(path, &h->entries[i], data_len);
        if (st != RF_OK)
            return st;
    }
    if (h->n > 1) /* an empty header has no entries array, and qsort's may not be NULL */
        qsort(h->entries, (size_t)h->n, sizeof *h->entries, by_name);
    for (int i = 1; i < h->n; i++)
        if (strcmp(h->entries[i - 1].name, h->entries[i].name) == 0)
            return rfi_error(RF_E_CORRUPT, "rf_checkpoint_load: %s: tensor \"%s\" appears "
                             "twice", path, h->entries[i].name);
    return check_overlaps(path, h);
}

const rfi_st_entry *rfi_st_find(const rfi_st_header *h, const char *name)
{
    if (!h->n)
        return NULL;
    rfi_st_entry key = {.name = (char *)name};
    return bsearch(&key, h->entries, (size_t)h->n, sizeof key, by_name);
}

void rfi_st_header_free(rfi_st_header *h)
{
    for (int i = 0; i < h->n; i++)
        rfi_free(h->entries[i].name);
    rfi_free(h->entries);
    h->entries = NULL;
    h->n = h->cap = 0;
}
