/* lower_memo.c: rf_compile's memo of the lowered and optimised programs, on
 * disk (lower_memo.h says what it keeps and when).
 *
 * A record's payload: the lowered program's rfi_hash (8 bytes, little
 * endian), then the lowered and the optimised program's encodings, one after
 * the other (each knows its own length).
 */
#include "lower_memo.h"

#include "../backend/cpu/cc.h"
#include "disk_cache.h"
#include "program_codec.h"

#include <stdatomic.h>
#include <string.h>

#define MEMO_MAGIC "reflux lowering memo v1"

static atomic_uint_fast64_t n_hits;

uint64_t rfi_lower_memo_n_hits(void) { return atomic_load(&n_hits); }

bool rfi_lower_memo_begin(rfi_lower_memo *m, const rfi_graph *t, const rfi_backend *b)
{
    memset(m, 0, sizeof *m);
    char build_id[160];
    if (!b->optimise || !b->optimise_context || !b->prepare_optimised || rfi_dump_wanted() ||
        !rfi_cc_build_id((uintptr_t)rfi_lower_memo_begin, build_id, sizeof build_id))
        return false;
    rfi_sb_printf(&m->context, "%s\nbuild=%s\nbackend=%s\n", MEMO_MAGIC, build_id, b->name);
    b->optimise_context(&m->context);
    rfi_program_describe(&m->key, t);
    m->pool = rfi_calloc(t->n_captures > 0 ? (size_t)t->n_captures : 1, sizeof *m->pool);
    if (m->context.failed || m->key.failed || !m->pool) {
        rfi_lower_memo_end(m);
        return false;
    }
    for (int i = 0; i < t->n_captures; i++)
        m->pool[i] = rfi_array_retain(t->captures[i]);
    m->n_pool = t->n_captures;
    m->device = t->device;
    return true;
}

bool rfi_lower_memo_find(rfi_lower_memo *m, rfi_graph **prog, rfi_graph **opt, uint64_t *hash)
{
    *prog = *opt = NULL;
    char *payload = NULL;
    size_t len = 0;
    if (!rfi_disk_cache_record_get(m->key.data, m->key.len, m->context.data, &payload, &len))
        return false;
    bool ok = false;
    size_t used = 0, used2 = 0;
    unsigned char h[8];
    if (len >= sizeof h) {
        memcpy(h, payload, sizeof h);
        const char *rest = payload + sizeof h;
        size_t rest_len = len - sizeof h;
        ok = rfi_program_decode(rest, rest_len, m->device, m->pool, m->n_pool, prog, &used) ==
                 RF_OK &&
             rfi_program_decode(rest + used, rest_len - used, m->device, m->pool, m->n_pool, opt,
                                &used2) == RF_OK &&
             used + used2 == rest_len;
    }
    rfi_free(payload);
    if (!ok) {
        rfi_graph_free(*prog);
        rfi_graph_free(*opt);
        *prog = *opt = NULL;
        return false;
    }
    *hash = 0;
    for (int i = 7; i >= 0; i--)
        *hash = *hash << 8 | h[i];
    atomic_fetch_add(&n_hits, 1);
    return true;
}

void rfi_lower_memo_keep(rfi_lower_memo *m, const rfi_graph *prog, const rfi_graph *opt,
                         uint64_t hash)
{
    rfi_sb_free(&m->payload);
    unsigned char h[8];
    for (int i = 0; i < 8; i++)
        h[i] = (unsigned char)(hash >> (8 * i));
    rfi_sb_put(&m->payload, h, sizeof h);
    if (!rfi_program_encode(&m->payload, prog, m->pool, m->n_pool) ||
        !rfi_program_encode(&m->payload, opt, m->pool, m->n_pool))
        rfi_sb_free(&m->payload); /* a capture the traced program did not have: no record */
}

void rfi_lower_memo_record(rfi_lower_memo *m)
{
    if (m->payload.len && !m->payload.failed)
        rfi_disk_cache_record_put(m->key.data, m->key.len, m->context.data, m->payload.data,
                                  m->payload.len);
}

void rfi_lower_memo_end(rfi_lower_memo *m)
{
    for (int i = 0; i < m->n_pool; i++)
        rfi_array_release(m->pool[i]);
    rfi_free(m->pool);
    rfi_sb_free(&m->key);
    rfi_sb_free(&m->context);
    rfi_sb_free(&m->payload);
    memset(m, 0, sizeof *m);
}
