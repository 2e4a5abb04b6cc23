/* table_reorder.c: small reorders as tables of source offsets
 * (table_reorder.h says why).
 *
 * An element's offset in a blocked layout: each dim d is cut into blocks of
 * (the product of d's inner blocks); the block's index times d's stride,
 * plus the element's place inside the inner blocks, whose digits go
 * outermost first (oneDNN's inner_blks / inner_idxs order). A plain layout
 * is the case with no inner blocks.
 */
#include "table_reorder.h"

#include <string.h>

#include "dnnl_loader.h"

static bool plain_or_blocked_f32(const dnnl_memory_desc_t *md)
{
    if (md->format_kind != dnnl_blocked || md->data_type != dnnl_f32 ||
        md->extra.flags != dnnl_memory_extra_flag_none || md->ndims <= 0 ||
        md->ndims > DNNL_MAX_NDIMS)
        return false;
    for (int d = 0; d < md->ndims; d++)
        if (md->padded_offsets[d] != 0)
            return false;
    const dnnl_blocking_desc_t *b = &md->format_desc.blocking;
    if (b->inner_nblks < 0 || b->inner_nblks > DNNL_MAX_NDIMS)
        return false;
    for (int k = 0; k < b->inner_nblks; k++)
        if (b->inner_idxs[k] < 0 || b->inner_idxs[k] >= md->ndims || b->inner_blks[k] <= 0)
            return false;
    return true;
}

static int64_t span_elements(const dnnl_memory_desc_t *md)
{
    return (int64_t)(rfi_dnnl.memory_desc_get_size(md) / sizeof(float));
}

bool rfi_table_reorder_fits(const dnnl_memory_desc_t *from, const dnnl_memory_desc_t *to)
{
    if (!plain_or_blocked_f32(from) || !plain_or_blocked_f32(to) || from->ndims != to->ndims)
        return false;
    for (int d = 0; d < from->ndims; d++)
        if (from->dims[d] != to->dims[d] || from->dims[d] <= 0)
            return false;
    int64_t a = span_elements(from), b = span_elements(to);
    return a > 0 && b > 0 && a <= RFI_TABLE_REORDER_MAX && b <= RFI_TABLE_REORDER_MAX;
}

/* An element's offset in a layout is offset0 plus one term per dim that
 * depends on that dim's index alone (its block's place, by the stride, and
 * its digits in the inner blocks, by their weights): at[i] for index i of
 * dim d, so that a whole table costs ndims additions per element. */
static void dim_terms(const dnnl_memory_desc_t *md, int d, int64_t *at)
{
    const dnnl_blocking_desc_t *b = &md->format_desc.blocking;
    int64_t block = 1;
    for (int k = 0; k < b->inner_nblks; k++)
        if (b->inner_idxs[k] == d)
            block *= b->inner_blks[k];
    for (int64_t i = 0; i < md->dims[d]; i++) {
        int64_t term = i / block * b->strides[d], weight = 1, inside = 1;
        for (int k = b->inner_nblks - 1; k >= 0; k--) { /* innermost digit first */
            if (b->inner_idxs[k] == d) {
                term += i / inside % b->inner_blks[k] * weight;
                inside *= b->inner_blks[k];
            }
            weight *= b->inner_blks[k];
        }
        at[i] = term;
    }
}

/* The per-dim terms of md (dim_terms), dim after dim, in one allocation. */
static int64_t *layout_terms(const dnnl_memory_desc_t *md, int64_t **of_dim)
{
    int64_t total = 0;
    for (int d = 0; d < md->ndims; d++)
        total += md->dims[d];
    int64_t *terms = rfi_malloc((size_t)total * sizeof *terms);
    if (!terms)
        return NULL;
    for (int d = 0, at = 0; d < md->ndims; at += (int)md->dims[d], d++) {
        of_dim[d] = terms + at;
        dim_terms(md, d, of_dim[d]);
    }
    return terms;
}

/* Steps idx through dims 0 .. ndims - 1 in row-major order; false after the last. */
static bool next_index(int64_t *idx, const int64_t *dims, int ndims)
{
    for (int d = ndims - 1; d >= 0; d--) {
        if (++idx[d] < dims[d])
            return true;
        idx[d] = 0;
    }
    return false;
}

/* Whether every offset of md's terms lies in [0, span): checked once, so
 * that the loop below needs no test per element. */
static bool terms_in_span(const dnnl_memory_desc_t *md, int64_t *const *of_dim, int64_t span)
{
    int64_t lo = md->offset0, hi = md->offset0;
    for (int d = 0; d < md->ndims; d++) {
        int64_t a = of_dim[d][0], b = of_dim[d][0];
        for (int64_t i = 1; i < md->dims[d]; i++) {
            a = of_dim[d][i] < a ? of_dim[d][i] : a;
            b = of_dim[d][i] > b ? of_dim[d][i] : b;
        }
        lo += a;
        hi += b;
    }
    return lo >= 0 && hi < span;
}

/* Fills t->from (all -1) with the source offset of every element: the
 * outer dims by next_index, the last in an inner loop. */
static rf_status fill_table(const dnnl_memory_desc_t *from, const dnnl_memory_desc_t *to,
                            rfi_table_reorder *t)
{
    int64_t *src_dim[DNNL_MAX_NDIMS], *dst_dim[DNNL_MAX_NDIMS];
    int64_t *src_terms = layout_terms(from, src_dim), *dst_terms = layout_terms(to, dst_dim);
    rf_status st = RF_OK;
    if (!src_terms || !dst_terms)
        st = rfi_error(RF_E_NOMEM, "cpu: out of memory for a reorder table");
    else if (!terms_in_span(from, src_dim, span_elements(from)) ||
             !terms_in_span(to, dst_dim, t->n))
        st = rfi_error(RF_E_INTERNAL, "cpu: a reorder table's offsets leave their layout");
    int last = to->ndims - 1;
    int64_t idx[DNNL_MAX_NDIMS] = {0}, inner = to->dims[last];
    const int64_t *src_last = st == RF_OK ? src_dim[last] : NULL;
    const int64_t *dst_last = st == RF_OK ? dst_dim[last] : NULL;
    while (st == RF_OK) {
        int64_t src = from->offset0, dst = to->offset0;
        for (int d = 0; d < last; d++) {
            src += src_dim[d][idx[d]];
            dst += dst_dim[d][idx[d]];
        }
        for (int64_t i = 0; i < inner; i++)
            t->from[dst + dst_last[i]] = (int32_t)(src + src_last[i]);
        if (!next_index(idx, to->dims, last))
            break;
    }
    rfi_free(src_terms);
    rfi_free(dst_terms);
    return st;
}

rf_status rfi_table_reorder_make(const dnnl_memory_desc_t *from, const dnnl_memory_desc_t *to,
                                 bool zero_unmapped, rfi_table_reorder *t)
{
    memset(t, 0, sizeof *t);
    int64_t n = span_elements(to);
    t->from = rfi_malloc((size_t)n * sizeof *t->from);
    if (!t->from)
        return rfi_error(RF_E_NOMEM, "cpu: out of memory for a %lld-element reorder table",
                         (long long)n);
    t->n = n;
    t->zero_unmapped = zero_unmapped;
    for (int64_t j = 0; j < n; j++)
        t->from[j] = -1;
    rf_status st = fill_table(from, to, t);
    if (st != RF_OK)
        rfi_table_reorder_free(t);
    return st;
}

void rfi_table_reorder_run(const rfi_table_reorder *t, const float *from, float *to)
{
    const int32_t *restrict at = t->from;
    if (t->zero_unmapped) {
        for (int64_t j = 0; j < t->n; j++)
            to[j] = at[j] >= 0 ? from[at[j]] : 0.0f;
        return;
    }
    for (int64_t j = 0; j < t->n; j++)
        if (at[j] >= 0)
            to[j] = from[at[j]];
}

void rfi_table_reorder_free(rfi_table_reorder *t)
{
    rfi_free(t->from);
    memset(t, 0, sizeof *t);
}
