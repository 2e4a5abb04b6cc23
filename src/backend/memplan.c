/* memplan.c: memory planning of the execution plan: the lifetime of every
 * arena buffer in step order and its offset in the one arena.
 *
 * A buffer lives from the step that produces it to the last step that reads
 * it (step inputs already resolve aliases to their target, so a read through
 * an alias extends the target's life; a buffer nobody reads lives for its
 * own step). Before the buffers of step s are placed, every buffer whose last
 * read came before s is freed: a step's results never share bytes with its
 * own inputs. Offsets come from a greedy best fit over a free list
 * (coalescing neighbours, the arena's top growing when nothing fits), every
 * size rounded up to RFI_PLAN_ALIGN bytes; arena_bytes is the peak top, plus
 * the copy scratch (fuse.c: a swap of captures) placed above it.
 *
 * Concatenations in place. A LOOP step whose one root C concatenates along
 * an axis with only 1s before it (so each operand's rows are one contiguous
 * run of C's bytes) gets, where it can, its operands written straight into
 * those runs: an operand o computed by an earlier step, plain (as C is) and
 * in the arena, read by C once, whose run starts at a multiple of
 * RFI_PLAN_ALIGN, and that is neither such a run of another concatenation
 * nor has runs of its own, is a "slab" of C. C and its slabs are placed as
 * one block that lives from the first of them to be computed to the last
 * read of any, each slab at its run; the lowering then has no piece to copy
 * for it (rfi_plan_slab_in_place). Concatenations of more operands choose
 * first. One that could take none of its operands because all are slabs of
 * one host, as one run in its order, lies at that run of the host and has
 * nothing to copy at all. A merged product's operand (passes/merge_dots.c:
 * an RNN's weight gradient, the concatenated hidden states of its 64 steps)
 * was copied there, 1 MB at a time, after every step had written its own
 * buffer; merge_dots orders its concatenations so that two sums over the
 * same steps' gradients (all 64, the last 63) share one run.
 *
 * Arguments, captures, constants, outputs, in-place updates and the unstored
 * roots of left-out steps are not in the arena. Runs after the plan's steps
 * and layouts are final (plan.c). Not here: deciding which nodes are
 * materialised (fuse.c).
 */
#include <stdlib.h>
#include <string.h>

#include "plan_internal.h"

typedef struct mem_block {
    size_t off, size;
} mem_block;

/* Free blocks sorted by offset, below `top`; `peak` is the highest top. */
typedef struct free_list {
    mem_block *v;
    int n, cap;
    size_t top, peak;
} free_list;

static size_t aligned(size_t n)
{
    return (n + RFI_PLAN_ALIGN - 1) / RFI_PLAN_ALIGN * RFI_PLAN_ALIGN;
}

static void remove_block(free_list *fl, int i)
{
    memmove(fl->v + i, fl->v + i + 1, (size_t)(fl->n - 1 - i) * sizeof *fl->v);
    fl->n--;
}

/* Best fit (smallest block that holds size), else the top grows. */
static size_t alloc_block(free_list *fl, size_t size)
{
    int best = -1;
    for (int i = 0; i < fl->n; i++)
        if (fl->v[i].size >= size && (best < 0 || fl->v[i].size < fl->v[best].size))
            best = i;
    if (best < 0) {
        size_t off = fl->top;
        fl->top += size;
        fl->peak = fl->top > fl->peak ? fl->top : fl->peak;
        return off;
    }
    size_t off = fl->v[best].off;
    fl->v[best].off += size;
    fl->v[best].size -= size;
    if (fl->v[best].size == 0)
        remove_block(fl, best);
    return off;
}

/* Returns [off, off+size) to the list, merging neighbours; a block that
 * reaches the top lowers the top instead. false on OOM. */
static bool free_block(free_list *fl, size_t off, size_t size)
{
    int i = 0;
    while (i < fl->n && fl->v[i].off < off)
        i++;
    if (i > 0 && fl->v[i - 1].off + fl->v[i - 1].size == off) {
        i--;
        fl->v[i].size += size;
    } else {
        void *v = fl->v;
        if (!rfi_grow(&v, fl->n, &fl->cap, sizeof *fl->v))
            return false;
        fl->v = v;
        memmove(fl->v + i + 1, fl->v + i, (size_t)(fl->n - i) * sizeof *fl->v);
        fl->v[i] = (mem_block){off, size};
        fl->n++;
    }
    if (i + 1 < fl->n && fl->v[i].off + fl->v[i].size == fl->v[i + 1].off) {
        fl->v[i].size += fl->v[i + 1].size;
        remove_block(fl, i + 1);
    }
    if (fl->v[i].off + fl->v[i].size == fl->top) {
        fl->top = fl->v[i].off;
        remove_block(fl, i);
    }
    return true;
}

/* def/last positions of every arena node (-1 for others). A left-out
 * step's root is computed by the step that reads it, from the left-out
 * step's own inputs (plan.h rfi_step), so those live until the root's last
 * read; the root itself takes no bytes. A convolution that runs its pool
 * (runs_pool) still reads its inputs while the pool's step, the next,
 * writes: they live until that step. A step that runs with the next one
 * (runs_with_next) reads its inputs and writes its roots while the next
 * step runs: both live until that step too. */
static void lifetimes(const rfi_plan_builder *b, int *def, int *last)
{
    const rfi_plan *p = b->p;
    for (int x = 0; x < b->n; x++) {
        def[x] = last[x] = -1;
        rfi_loc_kind kind = p->loc[x].kind;
        if ((kind == RFI_LOC_ARENA || kind == RFI_LOC_UNSTORED) && b->step_of[x] >= 0)
            def[x] = last[x] = rfi_plan_step_pos(b, b->step_of[x]);
    }
    for (int q = 0; q < b->n_steps; q++) {
        const rfi_intlist *in = &b->steps[b->order[q]].inputs;
        for (int i = 0; i < in->n; i++) {
            int t = in->v[i];
            if (def[t] >= 0 && q > last[t])
                last[t] = q;
        }
    }
    for (int q = 0; q + 1 < b->n_steps; q++) {
        if (!p->steps[q].runs_pool && !p->steps[q].runs_with_next)
            continue;
        const rfi_intlist *in = &b->steps[b->order[q]].inputs;
        for (int i = 0; i < in->n; i++)
            if (def[in->v[i]] >= 0 && last[in->v[i]] < q + 1)
                last[in->v[i]] = q + 1;
        for (int r = 0; p->steps[q].runs_with_next && r < p->steps[q].n_roots; r++) {
            int x = p->steps[q].roots[r];
            if (def[x] >= 0 && last[x] < q + 1)
                last[x] = q + 1;
        }
    }
    for (int q = 0; q < b->n_steps; q++) {
        if (!p->steps[q].left_out)
            continue;
        int root = p->steps[q].roots[0];
        const rfi_intlist *in = &b->steps[b->order[q]].inputs;
        for (int i = 0; i < in->n; i++)
            if (def[in->v[i]] >= 0 && last[in->v[i]] < last[root])
                last[in->v[i]] = last[root];
        def[root] = last[root] = -1;
    }
}

/* Node lists bucketed by step position: ids of bucket q are
 * ids[start[q] .. start[q+1]). */
static void bucket(const int *key, int n, int n_buckets, int *start, int *ids)
{
    memset(start, 0, (size_t)(n_buckets + 1) * sizeof *start);
    for (int x = 0; x < n; x++)
        if (key[x] >= 0)
            start[key[x] + 1]++;
    for (int q = 0; q < n_buckets; q++)
        start[q + 1] += start[q];
    int *fill = start + n_buckets + 1; /* scratch after the starts */
    memcpy(fill, start, (size_t)n_buckets * sizeof *fill);
    for (int x = 0; x < n; x++)
        if (key[x] >= 0)
            ids[fill[key[x]]++] = x;
}

/* ---- Concatenations in place -------------------------------------------------------- */

/* The byte offset of operand k's rows in concatenation c, or -1 when the
 * operands' rows are not contiguous runs of c (a 1 before the axis aside). */
static int64_t run_offset(const rfi_node *c, int k)
{
    int axis = (int)c->attr.i[0];
    for (int d = 0; d < axis; d++)
        if (c->dims[d] != 1)
            return -1;
    int64_t row_bytes = (int64_t)rfi_node_nbytes(c) / (c->dims[axis] > 0 ? c->dims[axis] : 1);
    int64_t rows = 0;
    for (int j = 0; j < k; j++)
        rows += c->in[j]->dims[axis];
    return rows * row_bytes;
}

bool rfi_plan_slab_in_place(const rfi_plan *p, const rfi_node *c, int k)
{
    int64_t at = run_offset(c, k);
    const rfi_loc *lc = &p->loc[c->id], *lo = &p->loc[c->in[k]->id];
    return at >= 0 && lc->kind == RFI_LOC_ARENA && lo->kind == RFI_LOC_ARENA &&
           rfi_node_numel(c->in[k]) > 0 && lo->offset == lc->offset + (size_t)at;
}

int rfi_plan_step_slabs(const rfi_plan *p, const rfi_step *st)
{
    const rfi_node *c = p->g->nodes[st->roots[0]];
    int n = 0;
    for (int k = 0; st->n_roots == 1 && c->op == RFI_OP_CONCATENATE && k < c->n_in; k++)
        n += rfi_plan_slab_in_place(p, c, k);
    return n;
}

/* Whether c's step is a LOOP of c alone whose operands could be slabs. */
static bool slab_host_step(const rfi_plan *p, int q, const rfi_node **c)
{
    const rfi_step *st = &p->steps[q];
    if (st->kind != RFI_STEP_LOOP || st->n_roots != 1 || st->left_out ||
        (p->seg_extent && p->seg_extent[q] > 0))
        return false;
    *c = p->g->nodes[st->roots[0]];
    return (*c)->op == RFI_OP_CONCATENATE && p->loc[(*c)->id].kind == RFI_LOC_ARENA &&
           rfi_plan_layout(p, (*c)->id) == RFI_LAYOUT_PLAIN && rfi_node_numel(*c) > 0 &&
           run_offset(*c, 0) == 0;
}

static bool read_once(const rfi_node *c, int k)
{
    for (int j = 0; j < c->n_in; j++)
        if (j != k && c->in[j] == c->in[k])
            return false;
    return true;
}

/* Steps whose concatenations could hold slabs, those of more operands first
 * (a sequence's gradients concatenated whole and again less the first: the
 * whole one takes them), then in step order. */
typedef struct host_cand {
    int q, operands;
    const rfi_node *c; /* step q's concatenation */
} host_cand;

static int more_operands_first(const void *a, const void *b)
{
    const host_cand *x = a, *y = b;
    return x->operands != y->operands ? y->operands - x->operands : x->q - y->q;
}

/* A concatenation that took no operand because all are slabs of one host h,
 * whole and in its order, lies at their rows of h too. */
static void nest_in_host(const rfi_node *c, int *host, int64_t *slab_at)
{
    int h = -1;
    int64_t first = -1, next = -1;
    for (int k = 0; k < c->n_in; k++) {
        int o = c->in[k]->id;
        if (rfi_node_numel(c->in[k]) == 0)
            continue;
        if (host[o] < 0 || (h >= 0 && (host[o] != h || slab_at[o] != next)))
            return;
        h = host[o];
        first = first < 0 ? slab_at[o] : first;
        next = slab_at[o] + (int64_t)rfi_node_nbytes(c->in[k]);
    }
    if (h >= 0) {
        host[c->id] = h;
        slab_at[c->id] = first;
    }
}

/* host[x]: the concatenation whose slab x is (slab_at[x] its byte offset
 * there), or -1; a host's own entry is -2. false when out of memory. */
static bool find_slabs(const rfi_plan_builder *b, int *host, int64_t *slab_at)
{
    const rfi_plan *p = b->p;
    for (int x = 0; x < b->n; x++)
        host[x] = -1;
    host_cand *cand = rfi_malloc((size_t)(p->n_steps > 0 ? p->n_steps : 1) * sizeof *cand);
    if (!cand)
        return false;
    int n = 0;
    const rfi_node *c;
    for (int q = 0; q < p->n_steps; q++)
        if (slab_host_step(p, q, &c))
            cand[n++] = (host_cand){q, c->n_in, c};
    qsort(cand, (size_t)n, sizeof *cand, more_operands_first);
    for (int i = 0; i < n; i++) {
        c = cand[i].c;
        for (int k = 0; host[c->id] < 0 && k < c->n_in; k++) {
            int o = c->in[k]->id;
            int64_t at = run_offset(c, k);
            if (p->loc[o].kind != RFI_LOC_ARENA || b->step_of[o] < 0 || host[o] != -1 ||
                rfi_plan_layout(p, o) != RFI_LAYOUT_PLAIN || rfi_node_numel(c->in[k]) == 0 ||
                at % RFI_PLAN_ALIGN != 0 || !read_once(c, k))
                continue;
            host[o] = c->id;
            slab_at[o] = at;
            host[c->id] = -2;
        }
    }
    for (int i = 0; i < n; i++)
        if (host[cand[i].c->id] == -1)
            nest_in_host(cand[i].c, host, slab_at);
    rfi_free(cand);
    return true;
}

/* A host lives from its first slab's step to the last read of any slab;
 * the slabs take no block of their own. */
static void join_lifetimes(int n, const int *host, int *def, int *last)
{
    for (int x = 0; x < n; x++) {
        int c = host[x];
        if (c < 0 || def[x] < 0)
            continue;
        def[c] = def[x] < def[c] ? def[x] : def[c];
        last[c] = last[x] > last[c] ? last[x] : last[c];
        def[x] = last[x] = -1;
    }
}

static bool place_buffers(rfi_plan_builder *b, const int *def, const int *last, int *scratch)
{
    int S = b->n_steps, n = b->n;
    int *def_start = scratch, *def_ids = def_start + 2 * S + 2;
    int *last_start = def_ids + n, *last_ids = last_start + 2 * S + 2;
    bucket(def, n, S, def_start, def_ids);
    bucket(last, n, S, last_start, last_ids);
    free_list fl = {0};
    bool ok = true;
    for (int q = 0; ok && q < S; q++) {
        for (int i = q > 0 ? last_start[q - 1] : 0; ok && q > 0 && i < last_start[q]; i++) {
            int x = last_ids[i];
            size_t size = aligned(rfi_node_nbytes(b->g->nodes[x]));
            ok = size == 0 || free_block(&fl, b->p->loc[x].offset, size);
        }
        for (int i = def_start[q]; i < def_start[q + 1]; i++) {
            int x = def_ids[i];
            size_t size = aligned(rfi_node_nbytes(b->g->nodes[x]));
            b->p->loc[x].offset = size ? alloc_block(&fl, size) : 0;
        }
    }
    b->p->arena_bytes = fl.peak;
    if (b->p->copy_scratch_bytes > 0) { /* above every buffer: copies run last */
        b->p->copy_scratch_offset = aligned(fl.peak);
        b->p->arena_bytes = b->p->copy_scratch_offset + aligned(b->p->copy_scratch_bytes);
    }
    rfi_free(fl.v);
    return ok;
}

rf_status rfi_memplan(rfi_plan_builder *b)
{
    size_t n = (size_t)b->n + 1, S = (size_t)b->n_steps + 1;
    int *def = rfi_malloc(n * sizeof *def);
    int *last = rfi_malloc(n * sizeof *last);
    int *scratch = rfi_malloc((2 * n + 4 * S + 4) * sizeof *scratch);
    int *host = rfi_malloc(n * sizeof *host);
    int64_t *slab_at = rfi_malloc(n * sizeof *slab_at);
    bool ok = def && last && scratch && host && slab_at;
    if (ok) {
        lifetimes(b, def, last);
        ok = find_slabs(b, host, slab_at);
        join_lifetimes(b->n, host, def, last);
        ok = ok && place_buffers(b, def, last, scratch);
        for (int x = 0; ok && x < b->n; x++)
            if (host[x] >= 0)
                b->p->loc[x].offset = b->p->loc[host[x]].offset + (size_t)slab_at[x];
    }
    rfi_free(def);
    rfi_free(last);
    rfi_free(scratch);
    rfi_free(host);
    rfi_free(slab_at);
    return ok ? RF_OK : rfi_error(RF_E_NOMEM, "plan: out of memory placing buffers");
}
