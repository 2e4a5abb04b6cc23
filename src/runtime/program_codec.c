/* program_codec.c: programs as bytes (program_codec.h): the description that
 * keys the caches on disk and the encoding that rebuilds a program.
 *
 * Layout, every integer a varint:
 *   program  = name, n_args, type*, n_captures, capture*, n_rng_streams,
 *              n_nodes, node*, n_outputs, node id*, n_updates, (capture, node id)*
 *   type     = dtype, rank, dim*
 *   capture  = description: type, or -1 for none;
 *              encoding: index into the caller's list, then type
 *   node     = op, type, weak, attribute ints, each list (length, values),
 *              [constant], n_in, (node id - operand id)*
 *   constant = description: nbytes, then 0 + the bytes (small or no payload)
 *              or 1 + 32 hex digits of its digest (large);
 *              encoding: nbytes, then the bytes
 */
#include "program_codec.h"

#include "disk_cache.h"

#include <stdio.h>
#include <string.h>

typedef enum codec_mode { DESCRIBE, ENCODE } codec_mode;

/* ---- Writing ------------------------------------------------------------------------ */

/* LEB128 of a zigzag-encoded signed value. */
void rfi_codec_put_int(rfi_strbuf *b, int64_t v)
{
    uint64_t u = ((uint64_t)v << 1) ^ (uint64_t)(v >> 63);
    unsigned char out[10];
    size_t n = 0;
    do {
        out[n] = (unsigned char)(u & 0x7f);
        u >>= 7;
        out[n] |= u ? 0x80 : 0;
        n++;
    } while (u);
    rfi_sb_put(b, out, n);
}

static void put_str(rfi_strbuf *b, const char *s)
{
    size_t n = strlen(s);
    rfi_codec_put_int(b, (int64_t)n);
    rfi_sb_put(b, s, n);
}

static void put_type(rfi_strbuf *b, rf_dtype dt, const int64_t *dims, int rank)
{
    rfi_codec_put_int(b, dt);
    rfi_codec_put_int(b, rank);
    for (int i = 0; i < rank && i < RF_MAX_RANK; i++)
        rfi_codec_put_int(b, dims[i]);
}

static void put_constant(rfi_strbuf *b, const rfi_node *x, codec_mode mode)
{
    rfi_codec_put_int(b, (int64_t)x->attr.nbytes);
    if (mode == ENCODE) {
        if (x->attr.nbytes)
            rfi_sb_put(b, x->attr.data, x->attr.nbytes);
        return;
    }
    if (!x->attr.data || x->attr.nbytes <= RFI_DESC_INLINE_BYTES) {
        rfi_codec_put_int(b, 0);
        if (x->attr.data)
            rfi_sb_put(b, x->attr.data, x->attr.nbytes);
        return;
    }
    char digest[RFI_CACHE_KEY_HEX];
    rfi_disk_cache_digest(x->attr.data, x->attr.nbytes, digest);
    rfi_codec_put_int(b, 1);
    rfi_sb_put(b, digest, 32);
}

static void put_node(rfi_strbuf *b, const rfi_node *x, codec_mode mode)
{
    rfi_codec_put_int(b, x->op);
    put_type(b, x->dtype, x->dims, x->rank);
    rfi_codec_put_int(b, x->weak);
    for (int k = 0; k < RFI_N_INTS; k++)
        rfi_codec_put_int(b, x->attr.i[k]);
    for (int k = 0; k < RFI_N_LISTS; k++) {
        int n = x->attr.nl[k] >= 0 && x->attr.nl[k] <= RF_MAX_RANK ? x->attr.nl[k] : 0;
        rfi_codec_put_int(b, x->attr.nl[k]);
        for (int j = 0; j < n; j++)
            rfi_codec_put_int(b, x->attr.l[k][j]);
    }
    if (x->op == RFI_OP_CONSTANT)
        put_constant(b, x, mode);
    rfi_codec_put_int(b, x->n_in);
    for (int k = 0; k < x->n_in; k++)
        rfi_codec_put_int(b, x->id - x->in[k]->id); /* small: operands are usually near */
}

/* The index of a in pool, or -1. */
static int pool_index(rf_array *const *pool, int n_pool, const rf_array *a)
{
    for (int i = 0; a && i < n_pool; i++)
        if (pool[i] == a)
            return i;
    return -1;
}

static void put_program(rfi_strbuf *b, const rfi_graph *g, codec_mode mode,
                        rf_array *const *pool, int n_pool)
{
    put_str(b, g->name ? g->name : "");
    rfi_codec_put_int(b, g->n_args);
    for (int k = 0; k < g->n_args; k++)
        put_type(b, g->arg_dtypes[k], g->arg_dims[k], g->arg_ranks[k]);
    rfi_codec_put_int(b, g->n_captures);
    for (int k = 0; k < g->n_captures; k++) {
        const rf_array *a = g->captures[k];
        if (mode == ENCODE) {
            int at = pool_index(pool, n_pool, a);
            if (at < 0) { /* not rebuildable: no encoding */
                b->failed = true;
                return;
            }
            rfi_codec_put_int(b, at);
        }
        if (a)
            put_type(b, a->dtype, a->dims, a->rank);
        else
            rfi_codec_put_int(b, -1);
    }
    rfi_codec_put_int(b, g->n_rng_streams);
    rfi_codec_put_int(b, g->n_nodes);
    for (int i = 0; i < g->n_nodes; i++) {
        if (g->nodes[i]->id != i) { /* never in a verified program */
            b->failed = true;
            return;
        }
        put_node(b, g->nodes[i], mode);
    }
    rfi_codec_put_int(b, g->n_outputs);
    for (int k = 0; k < g->n_outputs; k++)
        rfi_codec_put_int(b, g->outputs[k]->id);
    rfi_codec_put_int(b, g->n_updates);
    for (int k = 0; k < g->n_updates; k++) {
        rfi_codec_put_int(b, g->updates[k].capture);
        rfi_codec_put_int(b, g->updates[k].value->id);
    }
}

void rfi_program_describe(rfi_strbuf *b, const rfi_graph *g)
{
    put_program(b, g, DESCRIBE, NULL, 0);
}

bool rfi_program_encode(rfi_strbuf *b, const rfi_graph *g, rf_array *const *pool, int n_pool)
{
    put_program(b, g, ENCODE, pool, n_pool);
    return !b->failed;
}

/* ---- Reading ------------------------------------------------------------------------ */

typedef struct reader {
    const unsigned char *p, *end;
    const char *bad; /* what was wrong first; NULL while all is well */
    char why[96];    /* a message with numbers in it, for bad */
} reader;

static int64_t get_int(reader *r)
{
    uint64_t u = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (r->p >= r->end) {
            r->bad = r->bad ? r->bad : "the bytes end inside a number";
            return 0;
        }
        unsigned char c = *r->p++;
        u |= (uint64_t)(c & 0x7f) << shift;
        if (!(c & 0x80))
            return (int64_t)(u >> 1) ^ -(int64_t)(u & 1);
    }
    r->bad = r->bad ? r->bad : "a number longer than 64 bits";
    return 0;
}

/* A count in [0, max], or 0 with r->bad set. */
static int get_count(reader *r, int64_t max, const char *what)
{
    int64_t v = get_int(r);
    if (v < 0 || v > max) {
        r->bad = r->bad ? r->bad : what;
        return 0;
    }
    return (int)v;
}

/* A count of items that each take at least `min_bytes` of what is left, in
 * [0, max], or 0 with r->bad set: a count is never trusted beyond the bytes
 * that could hold its items, so damaged bytes cannot ask for a large
 * allocation (four bytes once claimed 16 million arguments: 1.2 GB). */
static int get_items(reader *r, int64_t max, size_t min_bytes, const char *what)
{
    int64_t v = get_int(r);
    size_t left = (size_t)(r->end - r->p);
    if (r->bad)
        return 0;
    if (v < 0 || v > max) {
        snprintf(r->why, sizeof r->why, "%lld %s, outside [0, %lld]", (long long)v, what,
                 (long long)max);
        r->bad = r->why;
        return 0;
    }
    if ((uint64_t)v > left / min_bytes) {
        snprintf(r->why, sizeof r->why, "%lld %s, more than the %zu bytes left can hold",
                 (long long)v, what, left);
        r->bad = r->why;
        return 0;
    }
    return (int)v;
}

/* n raw bytes, or NULL with r->bad set. */
static const void *get_bytes(reader *r, size_t n)
{
    if ((size_t)(r->end - r->p) < n) {
        r->bad = r->bad ? r->bad : "the bytes end inside a payload";
        return NULL;
    }
    const void *at = r->p;
    r->p += n;
    return at;
}

static void get_type(reader *r, rf_dtype *dt, int64_t *dims, int *rank)
{
    int64_t d = get_int(r);
    *dt = rfi_dtype_valid((int)d) && d == (int)d ? (rf_dtype)d : RF_F32;
    if (*dt != d)
        r->bad = r->bad ? r->bad : "an invalid dtype";
    *rank = get_count(r, RF_MAX_RANK, "a rank out of range");
    for (int i = 0; i < *rank; i++) {
        dims[i] = get_int(r);
        if (dims[i] < 0)
            r->bad = r->bad ? r->bad : "a negative dim";
    }
}

enum { MAX_COUNT = 1 << 24 }; /* args, captures, nodes, operands: far beyond any program */

typedef struct node_fields {
    rfi_op op;
    rf_dtype dtype;
    int rank;
    int64_t dims[RF_MAX_RANK];
    bool weak;
    rfi_attrs attr;
} node_fields;

/* Reads one node and creates it in g (NULL with r->bad or g's error set). */
static rfi_node *read_node(reader *r, rfi_graph *g, rfi_node ***ins, int *cap_ins)
{
    node_fields f;
    memset(&f, 0, sizeof f);
    int64_t op = get_int(r);
    if (op < 0 || op >= RFI_OP_COUNT)
        r->bad = r->bad ? r->bad : "an unknown op";
    f.op = (rfi_op)(r->bad ? 0 : op);
    get_type(r, &f.dtype, f.dims, &f.rank);
    f.weak = get_count(r, 1, "a weak flag other than 0 or 1") != 0;
    for (int k = 0; k < RFI_N_INTS; k++)
        f.attr.i[k] = get_int(r);
    for (int k = 0; k < RFI_N_LISTS; k++) {
        f.attr.nl[k] = get_count(r, RF_MAX_RANK, "an attribute list too long");
        for (int j = 0; j < f.attr.nl[k]; j++)
            f.attr.l[k][j] = get_int(r);
    }
    if (f.op == RFI_OP_CONSTANT) {
        int64_t n = get_int(r);
        if (n < 0 || (uint64_t)n > (uint64_t)(r->end - r->p))
            r->bad = r->bad ? r->bad : "a constant longer than the bytes";
        else {
            f.attr.nbytes = (size_t)n;
            f.attr.data = get_bytes(r, (size_t)n);
        }
    }
    int n_in = get_items(r, MAX_COUNT, 1, "operands"); /* a varint each */
    if (r->bad)
        return NULL;
    if (n_in > *cap_ins) {
        rfi_node **grown = rfi_realloc(*ins, (size_t)n_in * sizeof **ins);
        if (!grown) {
            rfi_graph_fail(g, RF_E_NOMEM, "decoding a program: out of memory");
            return NULL;
        }
        *ins = grown;
        *cap_ins = n_in;
    }
    int id = g->n_nodes;
    for (int k = 0; k < n_in; k++) {
        int back = get_count(r, id, "an operand out of range");
        if (back < 1)
            r->bad = r->bad ? r->bad : "an operand that is not an earlier node";
        if (r->bad)
            return NULL;
        (*ins)[k] = g->nodes[id - back];
    }
    rfi_node *x = rfi_node_new(g, f.op, *ins, n_in, &f.attr, f.dtype, f.dims, f.rank);
    if (!x)
        return NULL;
    if (x->dtype != f.dtype || x->rank != f.rank ||
        memcmp(x->dims, f.dims, (size_t)f.rank * sizeof *f.dims) != 0) {
        r->bad = "a node whose type is not the one its operands give";
        return NULL;
    }
    x->weak = f.weak;
    return x;
}

static rf_status read_args(reader *r, rfi_graph *g)
{
    int n = get_items(r, MAX_COUNT, 2, "arguments"); /* dtype and rank each */
    if (r->bad || n == 0)
        return RF_OK;
    rf_dtype *dt = rfi_calloc((size_t)n, sizeof *dt);
    int *ranks = rfi_calloc((size_t)n, sizeof *ranks);
    int64_t(*dims)[RF_MAX_RANK] = rfi_calloc((size_t)n, sizeof *dims);
    rf_status st = dt && ranks && dims ? RF_OK : RF_E_NOMEM;
    for (int i = 0; i < n && st == RF_OK && !r->bad; i++)
        get_type(r, &dt[i], dims[i], &ranks[i]);
    if (st == RF_OK && !r->bad)
        st = rfi_graph_set_args(g, n, dt, ranks, (const int64_t(*)[RF_MAX_RANK])dims);
    rfi_free(dt);
    rfi_free(ranks);
    rfi_free(dims);
    return st;
}

static rf_status read_captures(reader *r, rfi_graph *g, rf_array *const *pool, int n_pool)
{
    int n = get_items(r, MAX_COUNT, 3, "captures"); /* index, dtype, rank */
    for (int i = 0; i < n && !r->bad; i++) {
        int at = get_count(r, n_pool - 1, "a capture not in the list");
        rf_dtype dt;
        int64_t dims[RF_MAX_RANK];
        int rank;
        get_type(r, &dt, dims, &rank);
        if (r->bad)
            break;
        const rf_array *a = pool[at];
        if (!a || a->dtype != dt || a->rank != rank ||
            memcmp(a->dims, dims, (size_t)rank * sizeof *dims) != 0) {
            r->bad = "a capture of another type";
            break;
        }
        if (rfi_graph_capture_index(g, pool[at]) != i) {
            if (g->status != RF_OK)
                return g->status;
            r->bad = "a capture listed twice";
        }
    }
    return RF_OK;
}

static rf_status read_nodes(reader *r, rfi_graph *g)
{
    int n = get_items(r, MAX_COUNT, 1, "nodes");
    rfi_node **ins = NULL;
    int cap_ins = 0;
    for (int i = 0; i < n && !r->bad; i++)
        if (!read_node(r, g, &ins, &cap_ins) && !r->bad)
            break; /* g's error is set */
    rfi_free(ins);
    return g->status;
}

static rf_status read_results(reader *r, rfi_graph *g)
{
    int n = get_items(r, MAX_COUNT, 1, "outputs");
    for (int k = 0; k < n && !r->bad; k++) {
        int id = get_count(r, g->n_nodes - 1, "an output that is not a node");
        if (!r->bad && rfi_graph_add_output(g, g->nodes[id]) != RF_OK)
            return g->status;
    }
    n = get_items(r, MAX_COUNT, 2, "updates"); /* capture, node */
    for (int k = 0; k < n && !r->bad; k++) {
        int capture = get_count(r, g->n_captures - 1, "an update of no capture");
        int id = get_count(r, g->n_nodes - 1, "an update that is not a node");
        if (!r->bad && rfi_graph_add_update(g, capture, g->nodes[id]) != RF_OK)
            r->bad = "an update that does not fit its capture";
    }
    return RF_OK;
}

rf_status rfi_program_decode(const void *data, size_t len, rf_device *dev,
                             rf_array *const *pool, int n_pool, rfi_graph **out, size_t *used)
{
    *out = NULL;
    *used = 0;
    reader r = {.p = data, .end = (const unsigned char *)data + len};
    size_t name_len = (size_t)get_count(&r, 4096, "a name too long");
    const char *name_bytes = r.bad ? NULL : get_bytes(&r, name_len);
    char name[4097];
    if (name_bytes) {
        memcpy(name, name_bytes, name_len);
        name[name_len] = '\0';
        if (strlen(name) != name_len)
            r.bad = "a name with a NUL byte";
    }
    if (r.bad)
        return rfi_error(RF_E_CORRUPT, "decoding a program: %s", r.bad);
    rfi_graph *g = rfi_graph_new(dev, name);
    if (!g)
        return RF_E_NOMEM;
    rf_status st = read_args(&r, g);
    if (st == RF_OK && !r.bad)
        st = read_captures(&r, g, pool, n_pool);
    if (st == RF_OK && !r.bad)
        g->n_rng_streams = get_count(&r, MAX_COUNT, "too many random streams");
    if (st == RF_OK && !r.bad)
        st = read_nodes(&r, g);
    if (st == RF_OK && !r.bad)
        st = read_results(&r, g);
    if (st == RF_OK && !r.bad && g->status != RF_OK)
        st = g->status;
    if (st != RF_OK || r.bad) {
        /* a rebuilt node failing its checks is corruption too: the encoder
         * wrote only verified programs */
        const char *why = r.bad ? r.bad : g->errmsg ? g->errmsg : "invalid program";
        st = st == RF_E_NOMEM ? st : rfi_error(RF_E_CORRUPT, "decoding a program: %s", why);
        rfi_graph_free(g);
        return st;
    }
    *out = g;
    *used = (size_t)(r.p - (const unsigned char *)data);
    return RF_OK;
}
