/* kir_lower.c: lowering an execution plan (plan.h) to the kernel IR (kir.h).
 *
 * Each LOOP step becomes a kernel whose outer loops run over its roots'
 * shape; each REDUCE step a kernel whose outer loops run over the result and
 * whose inner loops run over the reduced axes, the window or the contracting
 * dims. The value of a root at the loop's index vector is emitted
 * recursively: materialised nodes are loads from their buffer at their
 * row-major linear index, inline nodes compute from their operands at the
 * indices their op maps to (broadcast, transpose, slice, reverse, reshape,
 * pad, concatenate, gather, iota), memoised per (node, index) so shared
 * subexpressions are computed once. Indices are carried as a linear index, a
 * multi-index or both, converted only on demand: an elementwise LOOP kernel
 * whose accesses need no multi-index runs as one flat loop.
 *
 * A segmented LOOP step (plan.h) becomes one flat kernel per piece between
 * the ends of its segment roots and of the flat concatenations and slices it
 * fuses: the index ranges then decide every concatenation's operand choice
 * and clamp (kir.h), so each piece reads gradients and parameters directly
 * and stores each parameter update into its own buffer.
 *
 * REDUCE steps (windows, their unrolled and padded forms, sibling folds) are
 * lowered by kir_lower_reduce.c; kir_lower.h holds what the two share.
 *
 * CALL and COPY steps become module steps the renderer emits as calls and
 * copies. Deliberately no loop order or thread-split decisions (tiling,
 * interchange, partial reductions: renderers choose those) and no C:
 * renderers print the result.
 */
#include "kir_lower.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- Index vectors (the types and small helpers: kir_lower.h) ------------------ */
static kidx idx_lin_of(lower *L, const rfi_node *n, int lin)
{
    if (n->rank == 0)
        return idx_scalar(L);
    kidx ix;
    memset(&ix, 0, sizeof ix);
    ix.rank = n->rank;
    memcpy(ix.dims, n->dims, sizeof(int64_t) * (size_t)n->rank);
    ix.lin = lin;
    ix.has_m = n->rank == 1;
    ix.m[0] = lin;
    return ix;
}

static int idx_lin(lower *L, kidx *ix)
{
    if (ix->lin >= 0 || !ix->has_m)
        return ix->lin;
    int lin = cst(L, 0);
    int64_t stride = 1;
    for (int d = ix->rank - 1; d >= 0; d--) {
        lin = iop(L, RFI_KIR_IADD, lin, iop(L, RFI_KIR_IMUL, ix->m[d], cst(L, stride)));
        stride *= ix->dims[d];
    }
    ix->lin = lin;
    return lin;
}

static const int *idx_multi(lower *L, kidx *ix)
{
    if (ix->has_m)
        return ix->m;
    int64_t stride = 1;
    for (int d = ix->rank - 1; d >= 0; d--) {
        int q = iop(L, RFI_KIR_IDIV, ix->lin, cst(L, stride));
        if (ix->dims[d] == 1)
            ix->m[d] = cst(L, 0);
        else
            ix->m[d] = d == 0 ? q : iop(L, RFI_KIR_IREM, q, cst(L, ix->dims[d]));
        stride *= ix->dims[d];
    }
    ix->has_m = true;
    L->wants_multi = true;
    return ix->m;
}

/* ---- Memo: (node, index) -> value ----------------------------------------------- */
static int memo_key(const kidx *ix, int *key)
{
    if (ix->has_m) {
        key[0] = 1;
        memcpy(key + 1, ix->m, sizeof(int) * (size_t)ix->rank);
        return ix->rank + 1;
    }
    key[0] = 0;
    key[1] = ix->lin;
    return 2;
}

static size_t memo_slot(const lower *L, int node, const int *key, int nkey)
{
    uint64_t h = rfi_hash_u64(RFI_HASH_INIT, (uint64_t)node);
    h = rfi_hash_bytes(h, key, sizeof(int) * (size_t)nkey);
    size_t mask = (size_t)L->memo_cap - 1, slot = (size_t)h & mask;
    while (L->memo[slot].nkey &&
           !(L->memo[slot].node == node && L->memo[slot].nkey == nkey &&
             memcmp(L->memo[slot].key, key, sizeof(int) * (size_t)nkey) == 0))
        slot = (slot + 1) & mask;
    return slot;
}

static int memo_get(const lower *L, int node, const kidx *ix)
{
    if (!L->memo_cap)
        return -1;
    int key[RF_MAX_RANK + 1];
    int nkey = memo_key(ix, key);
    const memo_entry *e = &L->memo[memo_slot(L, node, key, nkey)];
    return e->nkey ? e->value : -1;
}

static bool memo_grow(lower *L)
{
    int ncap = L->memo_cap ? L->memo_cap * 2 : 256;
    memo_entry *old = L->memo;
    int old_cap = L->memo_cap;
    L->memo = rfi_calloc((size_t)ncap, sizeof(memo_entry));
    if (!L->memo) {
        L->memo = old;
        return false;
    }
    L->memo_cap = ncap;
    for (int i = 0; i < old_cap; i++)
        if (old[i].nkey)
            L->memo[memo_slot(L, old[i].node, old[i].key, old[i].nkey)] = old[i];
    rfi_free(old);
    return true;
}

static void memo_put(lower *L, int node, const kidx *ix, int value)
{
    if (value < 0 || ((L->memo_n + 1) * 2 > L->memo_cap && !memo_grow(L)))
        return; /* a full memo only costs recomputation (hash-consing still merges) */
    int key[RF_MAX_RANK + 1];
    int nkey = memo_key(ix, key);
    memo_entry *e = &L->memo[memo_slot(L, node, key, nkey)];
    if (!e->nkey)
        L->memo_n++;
    e->node = node;
    e->nkey = nkey;
    memcpy(e->key, key, sizeof(int) * (size_t)nkey);
    e->value = value;
}

/* ---- Leaves ---------------------------------------------------------------------- */
static int base_of(lower *L, const rfi_node *n, bool written)
{
    int buffer = 0;
    size_t offset = 0;
    if (L->p->loc[n->id].kind == RFI_LOC_TILE && !written) /* read by its convolution's pool */
        return rfi_kir_base_get(L->k, RFI_KIR_TILE_BUFFER, 0, n->dtype, rfi_node_nbytes(n),
                                false, n->id);
    rfi_plan_buffer(L->p, n->id, &buffer, &offset);
    if (buffer < 0 || buffer >= rfi_plan_n_buffers(L->p)) {
        if (L->status == RF_OK)
            L->status = rfi_error(RF_E_INTERNAL, "kir: step %d: %%%d = %s has no buffer "
                                  "(location kind %d)", L->k->step, n->id,
                                  rfi_op_table[n->op].name, (int)L->p->loc[n->id].kind);
        return -1;
    }
    return rfi_kir_base_get(L->k, buffer, offset, n->dtype, rfi_node_nbytes(n), written, n->id);
}

/* The element offset of index ix in n's buffer: row-major, or by n's layout
 * (plan.h, rfi_layout_offset) from the multi-index: channels last, or
 * channel-blocked, which the division splitting (kir.c) makes affine when
 * the channel is block * B + lane. */
static int buffer_index(lower *L, const rfi_node *n, kidx *ix)
{
    if (rfi_node_numel(n) == 1)
        return cst(L, 0);
    rfi_layout layout = rfi_plan_layout(L->p, n->id);
    if (layout == RFI_LAYOUT_PLAIN)
        return idx_lin(L, ix);
    const int *m = idx_multi(L, ix);
    if (layout == RFI_LAYOUT_NHWC) {
        int at = iop(L, RFI_KIR_IADD, iop(L, RFI_KIR_IMUL, m[0], cst(L, n->dims[2])), m[2]);
        at = iop(L, RFI_KIR_IADD, iop(L, RFI_KIR_IMUL, at, cst(L, n->dims[3])), m[3]);
        return iop(L, RFI_KIR_IADD, iop(L, RFI_KIR_IMUL, at, cst(L, n->dims[1])), m[1]);
    }
    int64_t b = rfi_layout_block(layout);
    int lane = iop(L, RFI_KIR_IREM, m[1], cst(L, b));
    int block = iop(L, RFI_KIR_IDIV, m[1], cst(L, b));
    int at = iop(L, RFI_KIR_IADD, iop(L, RFI_KIR_IMUL, m[0], cst(L, n->dims[1] / b)), block);
    at = iop(L, RFI_KIR_IADD, iop(L, RFI_KIR_IMUL, at, cst(L, n->dims[2])), m[2]);
    at = iop(L, RFI_KIR_IADD, iop(L, RFI_KIR_IMUL, at, cst(L, n->dims[3])), m[3]);
    return iop(L, RFI_KIR_IADD, iop(L, RFI_KIR_IMUL, at, cst(L, b)), lane);
}

static int load_node(lower *L, const rfi_node *n, kidx *ix)
{
    int index = buffer_index(L, n, ix);
    return rfi_kir_load(L->k, base_of(L, n, false), index, n->id);
}

/* The constant's value when all its elements are equal (a literal), else -1. */
static int splat_constant(lower *L, const rfi_node *n)
{
    size_t esz = rf_dtype_size(n->dtype);
    int64_t count = rfi_node_numel(n);
    const unsigned char *d = n->attr.data;
    if (count < 1 || !d || n->attr.nbytes != (size_t)count * esz)
        return -1;
    for (int64_t e = 1; e < count; e++)
        if (memcmp(d, d + (size_t)e * esz, esz) != 0)
            return -1;
    switch (n->dtype) {
    case RF_F32: { float v; memcpy(&v, d, 4); return rfi_kir_const_f(L->k, RF_F32, v); }
    case RF_F64: { double v; memcpy(&v, d, 8); return rfi_kir_const_f(L->k, RF_F64, v); }
    case RF_I32: { int32_t v; memcpy(&v, d, 4); return rfi_kir_const_i(L->k, RF_I32, v); }
    case RF_I64: { int64_t v; memcpy(&v, d, 8); return rfi_kir_const_i(L->k, RF_I64, v); }
    case RF_U8: return rfi_kir_const_i(L->k, RF_U8, d[0]);
    case RF_BOOL: return rfi_kir_const_i(L->k, RF_BOOL, d[0] != 0);
    default: return -1;
    }
}

rf_status rfi_lower_unsupported(lower *L, const rfi_node *n, const char *why)
{
    if (L->k && rfi_kir_failed(L->k)) /* a failed allocation, not the node, is why */
        return rfi_error(RF_E_NOMEM, "kir: step %d: out of memory", L->k->step);
    return rfi_error(RF_E_INTERNAL, "kir: step %d: %%%d = %s %s", L->k->step, n->id,
                     rfi_op_table[n->op].name, why);
}

/* ---- Values ------------------------------------------------------------------------ */
static rf_status emit(lower *L, const rfi_node *n, kidx *ix, bool compute, int *out);

/* Operand k of n at index ix (the operand has n's shape, or is a scalar). */
static rf_status operand_same(lower *L, const rfi_node *n, int k, kidx *ix, int *out)
{
    const rfi_node *x = n->in[k];
    if (x->rank == 0 && n->rank > 0) {
        kidx s = idx_scalar(L);
        return emit(L, x, &s, false, out);
    }
    kidx xi = *ix;
    return emit(L, x, &xi, false, out);
}

rf_status rfi_lower_operand_at(lower *L, const rfi_node *x, const int *m, int *out)
{
    kidx xi = idx_multi_of(x, m);
    if (x->rank == 0)
        xi = idx_scalar(L);
    return emit(L, x, &xi, false, out);
}

/* min(max(q, 0), hi): an index clamped into [0, hi]. */
int rfi_lower_clamp_index(lower *L, int q, int64_t hi)
{
    int zero = cst(L, 0);
    return iop(L, RFI_KIR_IMAX, iop(L, RFI_KIR_IMIN, q, cst(L, hi)), zero);
}

static rf_status emit_elementwise(lower *L, const rfi_node *n, kidx *ix, int *out)
{
    int v[3] = {-1, -1, -1};
    for (int k = 0; k < n->n_in && k < 3; k++) {
        rf_status st = operand_same(L, n, k, ix, &v[k]);
        if (st != RF_OK)
            return st;
    }
    rfi_kir_kernel *K = L->k;
    unsigned flags = rfi_op_table[n->op].flags;
    if (n->op == RFI_OP_STOP_GRADIENT)
        *out = v[0];
    else if (flags & RFI_UNARY)
        *out = rfi_kir_unary(K, n->op, n->dtype, v[0], n->id);
    else if (flags & RFI_BINARY)
        *out = rfi_kir_binary(K, n->op, n->dtype, v[0], v[1], n->id);
    else if (n->op == RFI_OP_COMPARE)
        *out = rfi_kir_compare(K, (rf_cmp)n->attr.i[0], v[0], v[1], n->id);
    else if (n->op == RFI_OP_SELECT)
        *out = rfi_kir_select(K, v[0], v[1], v[2], n->id);
    else if (n->op == RFI_OP_CLAMP) /* min(max(x, lo), hi), NaN propagating */
        *out = rfi_kir_binary(K, RFI_OP_MIN, n->dtype,
                              rfi_kir_binary(K, RFI_OP_MAX, n->dtype, v[1], v[0], -1), v[2],
                              n->id);
    else /* CONVERT */
        *out = rfi_kir_convert(K, n->dtype, v[0], n->id);
    return RF_OK;
}

static rf_status emit_broadcast(lower *L, const rfi_node *n, kidx *ix, int *out)
{
    const rfi_node *x = n->in[0];
    const int64_t *map = n->attr.l[0];
    bool increasing = true;
    for (int i = 1; i < x->rank; i++)
        increasing &= map[i] > map[i - 1];
    if (x->rank == 0) {
        kidx s = idx_scalar(L);
        return emit(L, x, &s, false, out);
    }
    if (increasing && rfi_node_numel(x) == rfi_node_numel(n)) { /* only size-1 dims added */
        kidx xi = idx_lin_of(L, x, idx_lin(L, ix));
        return emit(L, x, &xi, false, out);
    }
    const int *m = idx_multi(L, ix);
    int xm[RF_MAX_RANK];
    for (int i = 0; i < x->rank; i++)
        xm[i] = x->dims[i] == 1 ? cst(L, 0) : m[map[i]];
    return rfi_lower_operand_at(L, x, xm, out);
}

/* Transpose, slice, reverse: each operand coordinate is an affine map of one result one. */
static rf_status emit_permuted(lower *L, const rfi_node *n, kidx *ix, int *out)
{
    const rfi_node *x = n->in[0];
    const rfi_attrs *at = &n->attr;
    const int *m = idx_multi(L, ix);
    int xm[RF_MAX_RANK];
    for (int d = 0; d < x->rank; d++)
        xm[d] = m[d];
    if (n->op == RFI_OP_TRANSPOSE)
        for (int d = 0; d < n->rank; d++)
            xm[at->l[0][d]] = m[d];
    else if (n->op == RFI_OP_SLICE)
        for (int d = 0; d < n->rank; d++) {
            int scaled = iop(L, RFI_KIR_IMUL, m[d], cst(L, at->l[2][d]));
            xm[d] = iop(L, RFI_KIR_IADD, cst(L, at->l[0][d]), scaled);
        }
    else /* REVERSE */
        for (int k = 0; k < at->nl[0]; k++) {
            int d = (int)at->l[0][k];
            int negated = iop(L, RFI_KIR_IMUL, m[d], cst(L, -1));
            xm[d] = iop(L, RFI_KIR_IADD, cst(L, n->dims[d] - 1), negated);
        }
    return rfi_lower_operand_at(L, x, xm, out);
}

static rf_status emit_reshape(lower *L, const rfi_node *n, kidx *ix, int *out)
{
    const rfi_node *x = n->in[0];
    kidx xi = idx_lin_of(L, x, idx_lin(L, ix));
    return emit(L, x, &xi, false, out);
}

/* Result element o takes operand element (o - low) / (interior + 1) where that divides
 * exactly and lands inside, else the padding value. */
static rf_status emit_pad(lower *L, const rfi_node *n, kidx *ix, int *out)
{
    const rfi_node *x = n->in[0];
    const rfi_attrs *at = &n->attr;
    kidx s = idx_scalar(L);
    int padv = -1;
    rf_status st = emit(L, n->in[1], &s, false, &padv);
    if (st != RF_OK || rfi_node_numel(x) == 0) {
        *out = padv;
        return st;
    }
    const int *m = idx_multi(L, ix);
    int xm[RF_MAX_RANK], inside = rfi_kir_const_i(L->k, RF_BOOL, 1);
    for (int d = 0; d < x->rank; d++) {
        int64_t low = at->l[0][d], high = at->l[1][d], step = at->l[2][d] + 1;
        if (low == 0 && high == 0 && step == 1) {
            xm[d] = m[d];
            continue;
        }
        int p = iop(L, RFI_KIR_IADD, m[d], cst(L, -low));
        int q = iop(L, RFI_KIR_IDIV, p, cst(L, step));
        int below = rfi_kir_icmp(L->k, RF_LT, q, cst(L, x->dims[d]));
        int ok = rfi_kir_land(L->k, rfi_kir_icmp(L->k, RF_GE, p, cst(L, 0)), below);
        if (step > 1) {
            int zero = cst(L, 0);
            int on_step = rfi_kir_icmp(L->k, RF_EQ, iop(L, RFI_KIR_IREM, p, cst(L, step)), zero);
            ok = rfi_kir_land(L->k, ok, on_step);
        }
        inside = rfi_kir_land(L->k, inside, ok);
        xm[d] = rfi_lower_clamp_index(L, q, x->dims[d] - 1);
    }
    int v = -1;
    st = rfi_lower_operand_at(L, x, xm, &v);
    *out = rfi_kir_select(L->k, inside, v, padv, n->id);
    return st;
}

/* The operand whose range along the axis holds the index, by a chain of selects
 * from the last operand backwards. */
static rf_status emit_concatenate(lower *L, const rfi_node *n, kidx *ix, int *out)
{
    int axis = (int)n->attr.i[0];
    const int *m = idx_multi(L, ix);
    /* the index's range (copied: emitting operands grows the instruction array) */
    const int64_t at_lo = L->k->ins[m[axis]].lo, at_hi = L->k->ins[m[axis]].hi;
    int64_t end = n->dims[axis]; /* where operand k ends along the axis */
    int v = -1;
    for (int k = n->n_in - 1; k >= 0; k--) {
        const rfi_node *x = n->in[k];
        int64_t start = end - x->dims[axis];
        bool outside = at_hi < start || at_lo >= end; /* a piece of a segmented loop */
        if (x->dims[axis] == 0 || (outside && (v >= 0 || k > 0))) {
            end = start; /* not read here: not loaded (400 loads per piece, all dead) */
            continue;
        }
        int xm[RF_MAX_RANK];
        memcpy(xm, m, sizeof(int) * (size_t)n->rank);
        int shifted = iop(L, RFI_KIR_IADD, m[axis], cst(L, -start));
        xm[axis] = rfi_lower_clamp_index(L, shifted, x->dims[axis] - 1);
        int xv = -1;
        rf_status st = rfi_lower_operand_at(L, x, xm, &xv);
        if (st != RF_OK)
            return st;
        v = v < 0 ? xv
                  : rfi_kir_select(L->k, rfi_kir_icmp(L->k, RF_LT, m[axis], cst(L, end)), xv, v,
                                   n->id);
        end = start;
    }
    /* Every operand empty along the axis: so is the result, whose loop never
     * runs; any value of its dtype stands for its elements. */
    *out = v >= 0 ? v : rfi_kir_const_i(L->k, n->dtype, 0);
    return RF_OK;
}

/* x[..., clamp(indices[j...]), ...] along the axis (NumPy take, clamped). */
static rf_status emit_gather(lower *L, const rfi_node *n, kidx *ix, int *out)
{
    const rfi_node *x = n->in[0], *ind = n->in[1];
    int axis = (int)n->attr.i[0];
    if (x->dims[axis] == 0) {
        *out = rfi_kir_const_i(L->k, n->dtype, 0);
        return RF_OK;
    }
    const int *m = idx_multi(L, ix);
    int j = -1;
    rf_status st = rfi_lower_operand_at(L, ind, m + axis, &j);
    if (st != RF_OK)
        return st;
    int xm[RF_MAX_RANK];
    for (int d = 0; d < axis; d++)
        xm[d] = m[d];
    xm[axis] = rfi_lower_clamp_index(L, rfi_kir_convert(L->k, RF_I64, j, -1), x->dims[axis] - 1);
    for (int d = axis + 1; d < x->rank; d++)
        xm[d] = m[d - 1 + ind->rank];
    return rfi_lower_operand_at(L, x, xm, out);
}

static rf_status emit_op(lower *L, const rfi_node *n, kidx *ix, int *out)
{
    unsigned flags = rfi_op_table[n->op].flags;
    if (flags & (RFI_UNARY | RFI_BINARY))
        return emit_elementwise(L, n, ix, out);
    switch (n->op) {
    case RFI_OP_COMPARE:
    case RFI_OP_SELECT:
    case RFI_OP_CLAMP:
    case RFI_OP_CONVERT: return emit_elementwise(L, n, ix, out);
    case RFI_OP_IOTA:
        *out = rfi_kir_convert(L->k, n->dtype, idx_multi(L, ix)[n->attr.i[0]], n->id);
        return RF_OK;
    case RFI_OP_BROADCAST_IN_DIM: return emit_broadcast(L, n, ix, out);
    case RFI_OP_TRANSPOSE:
    case RFI_OP_SLICE:
    case RFI_OP_REVERSE: return emit_permuted(L, n, ix, out);
    case RFI_OP_RESHAPE: return emit_reshape(L, n, ix, out);
    case RFI_OP_PAD: return emit_pad(L, n, ix, out);
    case RFI_OP_CONCATENATE: return emit_concatenate(L, n, ix, out);
    case RFI_OP_GATHER: return emit_gather(L, n, ix, out);
    default: return rfi_lower_unsupported(L, n, "has no loop form (it must be materialised)");
    }
}

/* Whether n is another root of this step or an alias of one (a reshape of its
 * bytes): computed where it is read, since loads see the values before the
 * kernel's stores. */
static bool computed_here(const lower *L, const rfi_node *n)
{
    const rfi_loc *loc = &L->p->loc[n->id];
    return L->is_root[n->id] || (loc->kind == RFI_LOC_ALIAS && L->is_root[loc->alias]);
}

/* n's value at ix: a load if n is materialised (unless `compute`: a root being
 * computed, or another root of this step, computed rather than read back). */
static rf_status emit(lower *L, const rfi_node *n, kidx *ix, bool compute, int *out)
{
    *out = -1;
    if (rfi_kir_failed(L->k))
        return RF_E_NOMEM;
    if (n->id == L->fold_node) { /* read at the point folded (fuse.c) */
        *out = L->fold_value;
        return RF_OK;
    }
    int known = memo_get(L, n->id, ix);
    if (known >= 0) {
        *out = known;
        return RF_OK;
    }
    rf_status st = RF_OK;
    rfi_loc_kind loc = L->p->loc[n->id].kind;
    if (n->op == RFI_OP_CONSTANT && (*out = splat_constant(L, n)) >= 0)
        st = RF_OK;
    else if (loc != RFI_LOC_INLINE && !compute && !computed_here(L, n))
        *out = load_node(L, n, ix);
    else if (n->op == RFI_OP_CONSTANT || n->op == RFI_OP_ARGUMENT || n->op == RFI_OP_CAPTURE)
        st = rfi_lower_unsupported(L, n, "is inline but its elements are data: it must be "
                                         "materialised");
    else
        st = emit_op(L, n, ix, out);
    if (st == RF_OK && rfi_kir_failed(L->k))
        st = RF_E_NOMEM;
    if (st == RF_OK)
        memo_put(L, n->id, ix, *out);
    return st;
}

/* ---- Comments -------------------------------------------------------------------- */
#define MAX_OPERANDS_LISTED 8

static void describe_node(rfi_strbuf *sb, const rfi_node *n)
{
    rfi_sb_printf(sb, "%%%d = %s(", n->id, rfi_op_table[n->op].name);
    for (int k = 0; k < n->n_in && k < MAX_OPERANDS_LISTED; k++)
        rfi_sb_printf(sb, k ? ", %%%d" : "%%%d", n->in[k]->id);
    if (n->n_in > MAX_OPERANDS_LISTED) /* an optimiser's concatenation of every gradient */
        rfi_sb_printf(sb, ", ... %d operands", n->n_in);
    rfi_sb_printf(sb, ") ");
    rfi_sb_type(sb, n->dtype, n->dims, n->rank);
}

#define MAX_FUSED_LISTED 48

static char *describe_step(const rfi_plan *p, int s, const char *what)
{
    const rfi_step *st = &p->steps[s];
    rfi_strbuf sb = {0};
    rfi_sb_printf(&sb, "step %d: %s", s, what);
    for (int r = 0; r < st->n_roots && r < MAX_FUSED_LISTED; r++) {
        rfi_sb_printf(&sb, "\n  ");
        describe_node(&sb, p->g->nodes[st->roots[r]]);
    }
    if (st->n_roots > MAX_FUSED_LISTED) /* each piece of a segmented loop repeats this */
        rfi_sb_printf(&sb, "\n  ... and %d more roots", st->n_roots - MAX_FUSED_LISTED);
    for (int f = 0; f < st->n_fused && f < MAX_FUSED_LISTED; f++) {
        rfi_sb_printf(&sb, f ? "\n    " : "\n  fused:\n    ");
        describe_node(&sb, p->g->nodes[st->fused[f]]);
    }
    if (st->n_fused > MAX_FUSED_LISTED)
        rfi_sb_printf(&sb, "\n    ... and %d more", st->n_fused - MAX_FUSED_LISTED);
    if (sb.failed) {
        rfi_sb_free(&sb);
        return NULL;
    }
    return sb.data;
}

/* ---- Steps -------------------------------------------------------------------------- */
/* The index along a dim of the given extent: constant 0 for extent 1 (no loop), else a
 * new outer or inner loop variable. Outer variables must all exist before inner ones. */
int rfi_lower_loop_var(lower *L, int64_t extent, bool inner)
{
    rfi_kir_kernel *k = L->k;
    if (extent == 1)
        return cst(L, 0);
    if (inner) {
        k->red_dims[k->red_rank] = extent;
        return rfi_kir_var(k, k->rank + k->red_rank++);
    }
    k->dims[k->rank++] = extent;
    return rfi_kir_var(k, k->rank - 1);
}

void rfi_lower_kernel_name(rfi_kir_kernel *k, const rfi_node *root)
{
    snprintf(k->name, sizeof k->name, "%s", rfi_op_table[root->op].name);
}

rf_status rfi_lower_store_root(lower *L, const rfi_node *r, kidx *ix, int value)
{
    int index = buffer_index(L, r, ix);
    int base = base_of(L, r, true);
    if (base < 0)
        return L->status != RF_OK ? L->status : RF_E_NOMEM;
    return rfi_kir_add_store(L->k, base, index, value, r->id);
}

/* Computes root r at ix and stores it: the body of every loop over roots. */
static rf_status compute_and_store(lower *L, const rfi_node *r, kidx *ix)
{
    int v = -1;
    rf_status s = emit(L, r, ix, true, &v);
    return s == RF_OK ? rfi_lower_store_root(L, r, ix, v) : s;
}

static void reset_kernel(lower *L, int step)
{
    rfi_kir_kernel_free(L->k);
    L->k = rfi_kir_kernel_new(step);
    memset(L->memo, 0, sizeof(memo_entry) * (size_t)L->memo_cap);
    L->memo_n = 0;
    L->wants_multi = false;
}

/* The outer loops over root r's shape, in the order a channel-blocked
 * buffer [N, C/b, H, W, b] stores it, with channel block * b + lane, so the
 * kernel walks the buffer contiguously. m receives r's multi-index. */
static void blocked_loops(lower *L, const rfi_node *r, int64_t b, int *m)
{
    m[0] = rfi_lower_loop_var(L, r->dims[0], false);
    int block = rfi_lower_loop_var(L, r->dims[1] / b, false);
    m[2] = rfi_lower_loop_var(L, r->dims[2], false);
    m[3] = rfi_lower_loop_var(L, r->dims[3], false);
    int lane = rfi_lower_loop_var(L, b, false);
    m[1] = iop(L, RFI_KIR_IADD, iop(L, RFI_KIR_IMUL, block, cst(L, b)), lane);
}

/* [N, H, W, C] order: channels innermost. */
static void channels_last_loops(lower *L, const rfi_node *r, int *m)
{
    m[0] = rfi_lower_loop_var(L, r->dims[0], false);
    m[2] = rfi_lower_loop_var(L, r->dims[2], false);
    m[3] = rfi_lower_loop_var(L, r->dims[3], false);
    m[1] = rfi_lower_loop_var(L, r->dims[1], false);
}

/* Row-major loops over n's shape; m receives the multi-index. */
static void shape_loops(lower *L, const rfi_node *n, int *m)
{
    for (int d = 0; d < n->rank; d++)
        m[d] = rfi_lower_loop_var(L, n->dims[d], false);
}

/* The outer loops over root r's shape in the order its buffer stores it. */
static void root_loops(lower *L, const rfi_node *r, int *m)
{
    rfi_layout layout = rfi_plan_layout(L->p, r->id);
    switch (layout) {
    case RFI_LAYOUT_C8:
    case RFI_LAYOUT_C16: blocked_loops(L, r, rfi_layout_block(layout), m); return;
    case RFI_LAYOUT_NHWC: channels_last_loops(L, r, m); return;
    default: shape_loops(L, r, m);
    }
}

/* Whether one of the nodes ids reads a buffer in layout l; with `like`, one
 * holding like's images and channels (rank 4, dims 0 and 1 equal). */
static bool reads_layout(const lower *L, const int *ids, int count, rfi_layout l,
                         const rfi_node *like)
{
    for (int i = 0; i < count; i++) {
        const rfi_node *v = L->g->nodes[ids[i]];
        for (int j = 0; j < v->n_in; j++) {
            const rfi_node *x = v->in[j];
            if (L->p->loc[x->id].kind != RFI_LOC_INLINE && rfi_plan_layout(L->p, x->id) == l &&
                (!like || (x->rank == 4 && x->dims[0] == like->dims[0] &&
                           x->dims[1] == like->dims[1])))
                return true;
        }
    }
    return false;
}

static bool step_reads_layout(const lower *L, const rfi_step *st, rfi_layout l,
                              const rfi_node *like)
{
    return reads_layout(L, st->roots, st->n_roots, l, like) ||
           reads_layout(L, st->fused, st->n_fused, l, like);
}

/* The outer loops of a REDUCE step's result n, ordered by the channel-blocked
 * layout where the step reads a blocked value (else root_loops): a pooling
 * walks its operand's blocks whatever its result's layout, and a reduction
 * keeping the channels (a bias gradient) runs them as block and lane loops,
 * the lane last, so that the renderer interchanges it (reduced loops outside,
 * the block's lanes contiguous inside) instead of striding through the
 * operand once per channel. */
void rfi_lower_reduce_loops(lower *L, const rfi_step *st, const rfi_node *n, int *m)
{
    const rfi_node *x = n->n_in > 0 ? n->in[0] : NULL;
    bool window = x && n->op == RFI_OP_REDUCE_WINDOW && x->rank == 4 && n->dims[1] == x->dims[1];
    if (window && rfi_plan_layout(L->p, n->id) == RFI_LAYOUT_PLAIN &&
        step_reads_layout(L, st, RFI_LAYOUT_NHWC, NULL)) {
        channels_last_loops(L, n, m);
        return;
    }
    int64_t b = rfi_layout_block(L->p->channel_blocks);
    bool blocked_x = x && x->rank == 4 && b > 0 && x->dims[1] % b == 0 &&
                     step_reads_layout(L, st, L->p->channel_blocks, NULL);
    if (blocked_x && window && rfi_plan_layout(L->p, n->id) != RFI_LAYOUT_NHWC) {
        blocked_loops(L, n, b, m);
        return;
    }
    bool reduced[RF_MAX_RANK] = {false};
    for (int a = 0; n->op == RFI_OP_REDUCE && a < n->attr.nl[0]; a++)
        reduced[n->attr.l[0][a]] = true;
    if (!blocked_x || n->op != RFI_OP_REDUCE || reduced[1] ||
        rfi_plan_layout(L->p, n->id) != RFI_LAYOUT_PLAIN) {
        root_loops(L, n, m);
        return;
    }
    int channel = reduced[0] ? 0 : 1, block = -1; /* the result's dim holding x's channels */
    for (int d = 0; d < n->rank; d++)
        if (d == channel)
            block = rfi_lower_loop_var(L, n->dims[d] / b, false);
        else
            m[d] = rfi_lower_loop_var(L, n->dims[d], false);
    int lane = rfi_lower_loop_var(L, b, false);
    m[channel] = iop(L, RFI_KIR_IADD, iop(L, RFI_KIR_IMUL, block, cst(L, b)), lane);
}

/* Whether a row-major rank-4 root r of step st reads a channel-blocked
 * buffer holding the same images and channels (a max pool written out
 * row-major for a flatten): its loops then walk that buffer's blocks, the
 * lanes innermost, and the stores stride instead of the loads. In row-major
 * order each of the pool's four loads per result strides by a block. */
static bool walks_blocked_input(const lower *L, const rfi_step *st, const rfi_node *r)
{
    int64_t b = rfi_layout_block(L->p->channel_blocks);
    return r->rank == 4 && b > 0 && r->dims[1] % b == 0 &&
           rfi_plan_layout(L->p, r->id) == RFI_LAYOUT_PLAIN &&
           step_reads_layout(L, st, L->p->channel_blocks, r);
}

/* Whether one of the nodes ids reads a row-major buffer of at least n elements. */
static bool reads_plain_of(const lower *L, const int *ids, int count, int64_t n)
{
    for (int i = 0; i < count; i++) {
        const rfi_node *v = L->g->nodes[ids[i]];
        for (int j = 0; j < v->n_in; j++) {
            const rfi_node *x = v->in[j];
            if (L->p->loc[x->id].kind != RFI_LOC_INLINE &&
                rfi_plan_layout(L->p, x->id) == RFI_LAYOUT_PLAIN && rfi_node_numel(x) >= n)
                return true;
        }
    }
    return false;
}

/* The converse of walks_blocked_input: whether a channel-blocked root r of
 * step st is computed from a row-major buffer as large and from no blocked
 * one (a GroupNorm's input gradient, computed over [N, G, C/G, H, W] and
 * written blocked for a convolution's weight gradient): its loops then walk
 * r's shape row-major, the loads contiguous and the stores strided. In
 * blocked order every load gathered across the channels. */
static bool walks_plain_input(const lower *L, const rfi_step *st, const rfi_node *r)
{
    int64_t n = rfi_node_numel(r);
    return rfi_layout_blocked(rfi_plan_layout(L->p, r->id)) &&
           !step_reads_layout(L, st, L->p->channel_blocks, NULL) &&
           (reads_plain_of(L, st->roots, st->n_roots, n) ||
            reads_plain_of(L, st->fused, st->n_fused, n));
}

/* The root whose layout orders a LOOP step's loops: one not row-major if
 * any (a pool's blocked codes beside its row-major result), else the first. */
static const rfi_node *ordering_root(const lower *L, const rfi_step *st)
{
    for (int r = 0; r < st->n_roots; r++)
        if (rfi_plan_layout(L->p, st->roots[r]) != RFI_LAYOUT_PLAIN)
            return L->g->nodes[st->roots[r]];
    return L->g->nodes[st->roots[0]];
}

/* The shape a row-major LOOP step's loops run over instead of its roots'
 * own: when its root is a reshape that merges dims of the value it reads
 * (a flatten), that value's shape, so the reshape's index needs no division
 * (kir.c splits them away); NULL: the roots' shape. On the cnn's evaluation
 * a max pool flattened into the dense layer's input took 7.2 ms per 1000
 * images with a division and remainder per dim per element. */
static const rfi_node *finer_shape(const lower *L, const rfi_step *st)
{
    const rfi_node *r0 = L->g->nodes[st->roots[0]];
    if (st->n_roots != 1 || r0->op != RFI_OP_RESHAPE ||
        rfi_plan_layout(L->p, r0->id) != RFI_LAYOUT_PLAIN)
        return NULL;
    const rfi_node *x = r0->in[0];
    if (x->rank <= r0->rank || L->p->loc[x->id].kind != RFI_LOC_INLINE)
        return NULL;
    /* Each root dim must be a product of consecutive dims of x. */
    int d = 0;
    for (int r = 0; r < r0->rank; r++) {
        int64_t run = 1;
        while (d < x->rank && run < r0->dims[r])
            run *= x->dims[d++];
        if (run != r0->dims[r])
            return NULL;
    }
    return d == x->rank ? x : NULL;
}

/* Emits and stores every root of LOOP step st at the loop variables vars (one
 * linear index when flat), the roots all of r0's shape. */
static rf_status store_roots(lower *L, const rfi_step *st, const rfi_node *r0, const int *vars,
                             bool flat)
{
    for (int r = 0; r < st->n_roots; r++) {
        const rfi_node *root = L->g->nodes[st->roots[r]];
        if (root->rank != r0->rank || rfi_node_numel(root) != rfi_node_numel(r0) ||
            memcmp(root->dims, r0->dims, sizeof(int64_t) * (size_t)r0->rank) != 0)
            return rfi_error(RF_E_INTERNAL, "kir: step %d: roots %%%d and %%%d differ in shape",
                             L->k->step, r0->id, root->id);
        kidx ix = flat ? idx_lin_of(L, root, vars[0]) : idx_multi_of(root, vars);
        if (root->rank == 0)
            ix = idx_scalar(L);
        rf_status s = compute_and_store(L, root, &ix);
        if (s != RF_OK)
            return s;
    }
    return RF_OK;
}

/* One attempt at a LOOP kernel: flat (one loop over all elements) or over the shape. */
static rf_status lower_loop_as(lower *L, const rfi_step *st, bool flat)
{
    const rfi_node *r0 = L->g->nodes[st->roots[0]];
    L->flat = flat;
    int vars[RF_MAX_RANK];
    const rfi_node *finer = flat ? NULL : finer_shape(L, st);
    if (finer) {
        shape_loops(L, finer, vars);
        kidx fine = idx_multi_of(finer, vars);
        kidx ix = idx_lin_of(L, r0, idx_lin(L, &fine));
        return compute_and_store(L, r0, &ix);
    }
    if (flat)
        vars[0] = rfi_lower_loop_var(L, rfi_node_numel(r0), false);
    else if (walks_blocked_input(L, st, ordering_root(L, st)))
        blocked_loops(L, r0, rfi_layout_block(L->p->channel_blocks), vars);
    else if (walks_plain_input(L, st, ordering_root(L, st)))
        shape_loops(L, r0, vars);
    else
        root_loops(L, ordering_root(L, st), vars);
    return store_roots(L, st, r0, vars, flat);
}

/* The concatenation whose operands a LOOP step is split along (a root, else
 * a fused node, of the roots' shape joining 2..MAX_CONCAT_PIECES operands), or
 * NULL. In one loop over the whole shape every element would evaluate every
 * operand and select one: the gradient of a GRU cell's gates, cut from one
 * [B, 3H] product, computed all three gates' logistic and tanh per element,
 * and a recurrent cell's 64 time steps concatenated for one weight-gradient
 * product (merge_dots.c) loaded all 64 per element (1 GB/s). */
static const rfi_node *splitting_concat(const lower *L, const rfi_step *st)
{
    const rfi_node *r0 = L->g->nodes[st->roots[0]];
    if (r0->rank < 1 || rfi_node_numel(r0) == 0 || walks_blocked_input(L, st, r0))
        return NULL;
    rfi_layout layout = rfi_plan_layout(L->p, st->roots[0]);
    for (int r = 0; r < st->n_roots; r++)
        if (rfi_plan_layout(L->p, st->roots[r]) != layout)
            return NULL;
    int64_t b = rfi_layout_block(layout);
    if (layout != RFI_LAYOUT_PLAIN && b == 0)
        return NULL; /* channels last */
    for (int i = 0; i < st->n_roots + st->n_fused; i++) {
        int id = i < st->n_roots ? st->roots[i] : st->fused[i - st->n_roots];
        const rfi_node *x = L->g->nodes[id];
        if (x->op != RFI_OP_CONCATENATE || x->n_in < 2 || x->n_in > MAX_CONCAT_PIECES ||
            x->rank != r0->rank ||
            memcmp(x->dims, r0->dims, sizeof(int64_t) * (size_t)r0->rank) != 0)
            continue;
        /* blocked roots: the channels of a U-Net's skip connection, each piece whole blocks */
        bool whole_blocks = layout == RFI_LAYOUT_PLAIN || x->attr.i[0] == 1;
        for (int k = 0; k < x->n_in && b > 0; k++)
            whole_blocks = whole_blocks && x->in[k]->dims[1] % b == 0;
        if (whole_blocks)
            return x;
    }
    return NULL;
}

/* The boxes of the roots' shape that the operands of concatenation c cover,
 * but those of its slabs (memplan.c) where c is the step's one root: they
 * are in place already (*in_place counts them). */
static int concat_boxes(const lower *L, const rfi_step *st, const rfi_node *c, box *boxes,
                        char (*names)[24], int *in_place)
{
    int axis = (int)c->attr.i[0], n = 0;
    int64_t at = 0;
    bool alone = st->n_roots == 1 && st->roots[0] == c->id;
    *in_place = 0;
    for (int k = 0; k < c->n_in; k++) {
        int64_t len = c->in[k]->dims[axis];
        if (len == 0)
            continue;
        if (alone && rfi_plan_slab_in_place(L->p, c, k)) {
            (*in_place)++;
            at += len;
            continue;
        }
        for (int d = 0; d < c->rank; d++) {
            boxes[n].lo[d] = d == axis ? at : 0;
            boxes[n].hi[d] = d == axis ? at + len : c->dims[d];
        }
        snprintf(names[n++], 24, "part%d", k);
        at += len;
    }
    return n;
}

/* One box of a LOOP step split by splitting_concat: row-major loops over the
 * box, so that the index along the axis lies inside one operand and the
 * concatenation reads that operand alone (emit_concatenate). */
static rf_status lower_loop_box(lower *L, const rfi_step *st, const box *part)
{
    const rfi_node *r0 = L->g->nodes[st->roots[0]];
    rfi_lower_kernel_name(L->k, r0);
    L->flat = false;
    int vars[RF_MAX_RANK];
    int64_t b = rfi_layout_block(rfi_plan_layout(L->p, r0->id));
    if (b > 0) { /* blocked roots, the box whole blocks of channels: their order */
        vars[0] = rfi_lower_loop_var(L, r0->dims[0], false);
        int block_var = rfi_lower_loop_var(L, (part->hi[1] - part->lo[1]) / b, false);
        int block = iop(L, RFI_KIR_IADD, block_var, cst(L, part->lo[1] / b));
        vars[2] = rfi_lower_loop_var(L, r0->dims[2], false);
        vars[3] = rfi_lower_loop_var(L, r0->dims[3], false);
        int lane = rfi_lower_loop_var(L, b, false);
        vars[1] = iop(L, RFI_KIR_IADD, iop(L, RFI_KIR_IMUL, block, cst(L, b)), lane);
        return store_roots(L, st, r0, vars, false);
    }
    for (int d = 0; d < r0->rank; d++) {
        int offset = cst(L, part->lo[d]);
        vars[d] = iop(L, RFI_KIR_IADD, rfi_lower_loop_var(L, part->hi[d] - part->lo[d], false),
                      offset);
    }
    return store_roots(L, st, r0, vars, false);
}

static rf_status lower_loop(lower *L, const rfi_step *st, const box *part)
{
    if (part)
        return lower_loop_box(L, st, part);
    const rfi_node *r0 = L->g->nodes[st->roots[0]];
    rfi_lower_kernel_name(L->k, r0);
    bool flat = r0->rank >= 2 &&
                rfi_plan_layout(L->p, ordering_root(L, st)->id) == RFI_LAYOUT_PLAIN &&
                !walks_blocked_input(L, st, ordering_root(L, st));
    rf_status s = lower_loop_as(L, st, flat);
    if (s == RF_OK && flat && L->wants_multi) { /* flat needs div/mod: use the shape */
        reset_kernel(L, L->k ? L->k->step : 0);
        if (!L->k)
            return RF_E_NOMEM;
        rfi_lower_kernel_name(L->k, r0);
        s = lower_loop_as(L, st, false);
    }
    return s;
}

/* ---- Segmented loops -------------------------------------------------------------- */
static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static bool add_cut(int64_t **cuts, int *n, int *cap, int64_t at)
{
    if (*n == *cap) {
        int ncap = *cap ? 2 * *cap : 32;
        int64_t *v = rfi_realloc(*cuts, (size_t)ncap * sizeof *v);
        if (!v)
            return false;
        *cuts = v;
        *cap = ncap;
    }
    (*cuts)[(*n)++] = at;
    return true;
}

/* Where a segmented step's flat loop splits (sorted, distinct, 0 and the extent
 * included): the ends of its segment roots and of the operands of the
 * concatenations and slices over the flat extent it fuses, so that inside a
 * piece every such op reads one operand at a direct index. */
static rf_status segment_cuts(const rfi_plan *p, const rfi_step *st, int64_t ext, int64_t **cuts,
                              int *n)
{
    int cap = 0;
    const int64_t *off = p->seg_offset;
    bool ok = add_cut(cuts, n, &cap, 0) && add_cut(cuts, n, &cap, ext);
    for (int r = 0; ok && r < st->n_roots; r++)
        if (off[st->roots[r]] >= 0)
            ok = add_cut(cuts, n, &cap, off[st->roots[r]]) &&
                 add_cut(cuts, n, &cap, off[st->roots[r]] +
                                            rfi_node_numel(p->g->nodes[st->roots[r]]));
    for (int f = 0; ok && f < st->n_fused; f++) {
        const rfi_node *x = p->g->nodes[st->fused[f]];
        if (x->op == RFI_OP_CONCATENATE && x->rank == 1 && x->dims[0] == ext) {
            int64_t at = 0;
            for (int k = 0; ok && k < x->n_in; k++)
                ok = add_cut(cuts, n, &cap, at += x->in[k]->dims[0]);
        } else if (x->op == RFI_OP_SLICE && x->rank == 1 && x->in[0]->dims[0] == ext &&
                   x->in[0]->rank == 1) {
            ok = add_cut(cuts, n, &cap, x->attr.l[0][0]) &&
                 add_cut(cuts, n, &cap, x->attr.l[1][0]);
        }
    }
    if (!ok)
        return rfi_error(RF_E_NOMEM, "kir: out of memory");
    qsort(*cuts, (size_t)*n, sizeof **cuts, cmp_i64);
    int m = 0;
    for (int i = 0; i < *n; i++)
        if ((m == 0 || (*cuts)[i] != (*cuts)[m - 1]) && (*cuts)[i] >= 0 && (*cuts)[i] <= ext)
            (*cuts)[m++] = (*cuts)[i];
    *n = m;
    return RF_OK;
}

/* One piece [a, b) of a segmented step: a flat loop whose index is var + a,
 * or, when `shape` (a segment root spanning exactly the piece) is given,
 * loops over its shape whose row-major index plus a is that flat index.
 * Every root covering the piece is computed at its own linear index and
 * stored. */
static rf_status lower_segment_as(lower *L, const rfi_step *st, int64_t ext, int64_t a,
                                  int64_t b, const rfi_node *shape)
{
    rfi_kir_kernel *k = L->k;
    L->flat = !shape;
    kidx shaped;
    int flat;
    if (shape) {
        int vars[RF_MAX_RANK];
        shape_loops(L, shape, vars);
        shaped = idx_multi_of(shape, vars);
        int offset = cst(L, a);
        flat = iop(L, RFI_KIR_IADD, idx_lin(L, &shaped), offset);
    } else {
        int offset = cst(L, a);
        flat = iop(L, RFI_KIR_IADD, rfi_lower_loop_var(L, b - a, false), offset);
    }
    for (int r = 0; r < st->n_roots; r++) {
        const rfi_node *root = L->g->nodes[st->roots[r]];
        int64_t seg = L->p->seg_offset[root->id];
        int64_t off = seg >= 0 ? seg : 0;
        int64_t numel = rfi_node_numel(root);
        if (off > a || off + numel < b)
            continue; /* the piece lies outside this root */
        if (seg < 0 && (root->rank != 1 || numel != ext))
            return rfi_error(RF_E_INTERNAL, "kir: step %d: root %%%d is neither a segment nor "
                             "of the flat extent %lld", k->step, root->id, (long long)ext);
        kidx ix = root == shape      ? shaped
                  : root->rank == 0 ? idx_scalar(L)
                                    : idx_lin_of(L, root, iop(L, RFI_KIR_IADD, flat, cst(L, -off)));
        rf_status s = compute_and_store(L, root, &ix);
        if (s != RF_OK)
            return s;
    }
    return RF_OK;
}

/* The segment root of rank >= 2 that spans exactly the piece [a, b), or NULL. */
static const rfi_node *piece_shape(const lower *L, const rfi_step *st, int64_t a, int64_t b)
{
    for (int r = 0; r < st->n_roots; r++) {
        const rfi_node *root = L->g->nodes[st->roots[r]];
        if (root->rank >= 2 && L->p->seg_offset[root->id] == a &&
            a + rfi_node_numel(root) == b)
            return root;
    }
    return NULL;
}

/* One piece [a, b) of a segmented step: a flat loop, unless that needs a
 * multi-index (a divide and a remainder per dim per element, as for a
 * transposed weight gradient read through the flat concatenation) and a
 * segment root's shape spans the piece: then loops over that shape, where
 * the divisions split away (kir.c). On the cnn's 64x32x3x3 kernel this took
 * the Adam update's piece off six divisions and remainders per element. */
static rf_status lower_segment(lower *L, const rfi_step *st, int64_t ext, int64_t a, int64_t b,
                               int piece)
{
    rf_status s = lower_segment_as(L, st, ext, a, b, NULL);
    const rfi_node *shape = s == RF_OK && L->wants_multi ? piece_shape(L, st, a, b) : NULL;
    if (shape) {
        reset_kernel(L, L->k->step);
        s = L->k ? lower_segment_as(L, st, ext, a, b, shape) : RF_E_NOMEM;
    }
    const rfi_node *r0 = L->g->nodes[st->roots[0]];
    if (L->k)
        snprintf(L->k->name, sizeof L->k->name, "%s_seg%d", rfi_op_table[r0->op].name, piece);
    return s;
}

/* ---- The module ---------------------------------------------------------------- */
static rfi_kir_step *add_step(rfi_kir_module *m, rfi_kir_step_kind kind, int step)
{
    if (m->n_steps == m->cap_steps) {
        int ncap = m->cap_steps ? m->cap_steps * 2 : 16;
        rfi_kir_step *s = rfi_realloc(m->steps, (size_t)ncap * sizeof *s);
        if (!s)
            return NULL;
        m->steps = s;
        m->cap_steps = ncap;
    }
    rfi_kir_step *s = &m->steps[m->n_steps++];
    memset(s, 0, sizeof *s);
    s->kind = kind;
    s->step = step;
    s->pooled_by = -1;
    return s;
}

/* Appends the finished kernel L->k as a module step (the module owns it). */
static rf_status add_kernel(lower *L, rfi_kir_module *m, int s, const char *what)
{
    rf_status st = rfi_kir_coalesce(&L->k);
    if (st == RF_OK)
        st = rfi_kir_rebase(L->k);
    if (st != RF_OK)
        return st;
    rfi_kir_mark_aliasing(L->k);
    L->k->comment = describe_step(L->p, s, what);
    rfi_kir_step *ks = add_step(m, RFI_KIR_STEP_KERNEL, s);
    if (!ks || !L->k->comment)
        return rfi_error(RF_E_NOMEM, "kir: out of memory lowering step %d", s);
    ks->kernel = L->k;
    L->k = NULL;
    return RF_OK;
}

/* A segmented LOOP step: one kernel per piece between its cuts. */
static rf_status lower_segmented_step(lower *L, rfi_kir_module *m, int s)
{
    const rfi_step *st = &L->p->steps[s];
    int64_t *cuts = NULL;
    int n = 0;
    int64_t ext = L->p->seg_extent[s];
    rf_status rc = segment_cuts(L->p, st, ext, &cuts, &n);
    bool *is_root = (bool *)L->is_root;
    for (int r = 0; r < st->n_roots; r++)
        is_root[st->roots[r]] = true;
    for (int i = 0; rc == RF_OK && i + 1 < n; i++) {
        reset_kernel(L, s);
        rc = !L->k ? RF_E_NOMEM : lower_segment(L, st, ext, cuts[i], cuts[i + 1], i);
        if (rc == RF_OK && L->status != RF_OK)
            rc = L->status;
        if (rc == RF_OK && rfi_kir_failed(L->k))
            rc = RF_E_NOMEM;
        if (rc == RF_OK && L->k->n_stores > 0)
            rc = add_kernel(L, m, s, "loop (one piece of a segmented loop)");
    }
    for (int r = 0; r < st->n_roots; r++)
        is_root[st->roots[r]] = false;
    rfi_free(cuts);
    return rc;
}

/* Lowers one kernel of step s: its whole result, or for a padded window the
 * box `part` of it (named by `piece`). */
static rf_status lower_one_kernel(lower *L, rfi_kir_module *m, int s, const box *part,
                                  const char *piece)
{
    const rfi_step *st = &L->p->steps[s];
    reset_kernel(L, s);
    rf_status rc = !L->k ? RF_E_NOMEM
                   : st->kind == RFI_STEP_LOOP ? lower_loop(L, st, piece ? part : NULL)
                                               : rfi_lower_reduce(L, st, part);
    if (rc == RF_OK && L->status != RF_OK)
        rc = L->status;
    if (rc == RF_OK && rfi_kir_failed(L->k))
        rc = RF_E_NOMEM;
    if (rc != RF_OK)
        return rc;
    if (piece) {
        size_t len = strlen(L->k->name);
        snprintf(L->k->name + len, sizeof L->k->name - len, "_%s", piece);
    }
    return add_kernel(L, m, s, st->kind == RFI_STEP_LOOP
                                   ? (piece ? "loop (one operand of a concatenation)" : "loop")
                               : piece ? "reduce (a piece of a padded window)" : "reduce");
}

static rf_status lower_kernel_step(lower *L, rfi_kir_module *m, int s)
{
    const rfi_step *st = &L->p->steps[s];
    if (st->n_roots < 1)
        return rfi_error(RF_E_INTERNAL, "kir: step %d has no roots", s);
    if (st->kind == RFI_STEP_LOOP && L->p->seg_extent && L->p->seg_extent[s] > 0)
        return lower_segmented_step(L, m, s);
    const rfi_node *root = L->g->nodes[st->roots[0]];
    if (rfi_node_numel(root) == 0)
        return RF_OK; /* nothing to compute */
    const rfi_node *cat = st->kind == RFI_STEP_LOOP ? splitting_concat(L, st) : NULL;
    if (!cat && st->kind == RFI_STEP_LOOP && rfi_plan_step_slabs(L->p, st) > 0)
        cat = root; /* split all the same: no slab may be copied onto itself */
    /* on the stack, but for a concatenation of more operands than that holds */
    box few_boxes[MAX_PIECES];
    char few_names[MAX_PIECES][24];
    bool many = cat && cat->n_in > MAX_PIECES;
    box *boxes = many ? rfi_malloc((size_t)cat->n_in * sizeof *boxes) : few_boxes;
    char(*names)[24] = many ? rfi_malloc((size_t)cat->n_in * sizeof *names) : few_names;
    if (!boxes || !names) {
        if (many) {
            rfi_free(boxes);
            rfi_free(names);
        }
        return rfi_error(RF_E_NOMEM, "kir: out of memory lowering step %d", s);
    }
    bool *is_root = (bool *)L->is_root;
    for (int r = 0; r < st->n_roots; r++)
        is_root[st->roots[r]] = true;
    int in_place = 0;
    int n_pieces = cat ? concat_boxes(L, st, cat, boxes, names, &in_place) : 0;
    rf_status rc = RF_OK;
    if (n_pieces > 1 || in_place > 0 || (st->kind == RFI_STEP_REDUCE &&
                         rfi_lower_window_pieces(root, boxes, names, &n_pieces))) {
        for (int i = 0; i < n_pieces && rc == RF_OK; i++)
            rc = lower_one_kernel(L, m, s, &boxes[i], names[i]);
    } else {
        for (int d = 0; d < root->rank; d++) {
            boxes[0].lo[d] = 0;
            boxes[0].hi[d] = root->dims[d];
        }
        rc = lower_one_kernel(L, m, s, &boxes[0], NULL);
    }
    for (int r = 0; r < st->n_roots; r++)
        is_root[st->roots[r]] = false;
    if (many) {
        rfi_free(boxes);
        rfi_free(names);
    }
    return rc;
}

/* A CALL step: a call, or the direct convolution the backend generates. */
static rf_status lower_call_step(const rfi_plan *p, rfi_kir_module *m, int s)
{
    const rfi_step *st = &p->steps[s];
    rfi_kir_conv conv;
    bool direct = st->direct;
    if (direct && !rfi_kir_direct_conv(p, s, &conv))
        return rfi_error(RF_E_INTERNAL, "kir: step %d is no longer a direct convolution", s);
    const char *what = direct                      ? "direct convolution"
                       : st->call == RFI_CALL_MATMUL ? "matmul call"
                       : st->call == RFI_CALL_CONV   ? "convolution call"
                                                     : "reference kernel call";
    rfi_kir_step *ks = add_step(m, direct ? RFI_KIR_STEP_CONV : RFI_KIR_STEP_CALL, s);
    if (!ks || !(ks->comment = describe_step(p, s, what)))
        return rfi_error(RF_E_NOMEM, "kir: out of memory lowering step %d", s);
    if (direct)
        ks->conv = conv;
    ks->with_previous = !direct && s > 0 && p->steps[s - 1].runs_with_next;
    return RF_OK;
}

static rf_status lower_copy_step(const rfi_plan *p, rfi_kir_module *m, int s)
{
    const rfi_step *st = &p->steps[s];
    const rfi_graph *g = p->g;
    if (st->n_roots < 1)
        return rfi_error(RF_E_INTERNAL, "kir: copy step %d has no value", s);
    const rfi_node *n = g->nodes[st->roots[0]];
    int src = 0, dst = 0;
    size_t src_off = 0, dst_off = 0;
    rfi_plan_buffer(p, n->id, &src, &src_off);
    if (st->copy_scratch == RFI_COPY_FROM_SCRATCH) {
        src = rfi_plan_arena_buffer(p);
        src_off = p->copy_scratch_offset;
    }
    if (st->copy_scratch == RFI_COPY_TO_SCRATCH) {
        dst = rfi_plan_arena_buffer(p);
        dst_off = p->copy_scratch_offset;
    } else if (st->copy_to_output >= 0 && st->copy_to_output < g->n_outputs)
        dst = g->n_args + g->n_captures + st->copy_to_output;
    else if (st->copy_to_capture >= 0 && st->copy_to_capture < g->n_captures)
        dst = g->n_args + st->copy_to_capture;
    else
        return rfi_error(RF_E_INTERNAL, "kir: copy step %d of %%%d has no valid destination "
                         "(output %d, capture %d)", s, n->id, st->copy_to_output,
                         st->copy_to_capture);
    size_t nbytes = rfi_node_nbytes(n);
    if (nbytes == 0 || (dst == src && src_off == dst_off))
        return RF_OK;
    rfi_kir_step *ks = add_step(m, RFI_KIR_STEP_COPY, s);
    if (!ks || !(ks->comment = describe_step(p, s, "copy")))
        return rfi_error(RF_E_NOMEM, "kir: out of memory lowering step %d", s);
    ks->src_buffer = src;
    ks->src_offset = src_off;
    ks->dst_buffer = dst;
    ks->dst_offset = dst_off;
    ks->nbytes = nbytes;
    return RF_OK;
}

/* The module's last step, the kernel of plan step s, when a direct forward
 * convolution before it pools over its result (kir.h pool_step): that
 * convolution runs it, if its outermost loop is [n][pool_groups][rows of
 * windows] (its first dim the product of those: a prefix of the result's
 * laid-out dims). Else the kernel runs on its own, which a tiled result
 * (kept in the convolution's tile only) does not allow. */
static rf_status link_pool(rfi_kir_module *m, int s)
{
    rfi_kir_step *ks = m->n_steps > 0 ? &m->steps[m->n_steps - 1] : NULL;
    if (!ks || ks->kind != RFI_KIR_STEP_KERNEL || ks->step != s)
        return RF_OK;
    for (int i = 0; i < m->n_steps - 1; i++) {
        rfi_kir_conv *d = &m->steps[i].conv;
        if (m->steps[i].kind != RFI_KIR_STEP_CONV || d->pool_step != s)
            continue;
        if (ks->kernel->rank >= 1 &&
            ks->kernel->dims[0] == d->n * d->pool_groups * (d->oh / d->pool_rows)) {
            d->pool_kernel = m->n_steps - 1;
            ks->pooled_by = i;
        } else if (d->tiled) {
            return rfi_error(RF_E_INTERNAL, "kir: step %d: the pool over the tiled result of "
                             "step %d does not loop over its windows' rows first", s,
                             m->steps[i].step);
        }
        return RF_OK;
    }
    return RF_OK;
}

rf_status rfi_kir_lower(const rfi_plan *p, rfi_kir_module **out)
{
    *out = NULL;
    rfi_kir_module *m = rfi_calloc(1, sizeof *m);
    lower L;
    memset(&L, 0, sizeof L);
    L.p = p;
    L.g = p->g;
    L.fold_node = -1;
    L.is_root = rfi_calloc((size_t)(p->g->n_nodes > 0 ? p->g->n_nodes : 1), sizeof(bool));
    if (!m || !L.is_root || !memo_grow(&L)) {
        rfi_free(m);
        rfi_free((void *)L.is_root);
        rfi_free(L.memo);
        return rfi_error(RF_E_NOMEM, "kir: out of memory");
    }
    m->n_buffers = rfi_plan_n_buffers(p);
    rf_status st = RF_OK;
    for (int s = 0; s < p->n_steps && st == RF_OK; s++) {
        if (p->steps[s].left_out) /* a direct convolution computes its root */
            continue;
        switch (p->steps[s].kind) {
        case RFI_STEP_LOOP:
            if ((st = lower_kernel_step(&L, m, s)) == RF_OK)
                st = link_pool(m, s);
            break;
        case RFI_STEP_REDUCE: st = lower_kernel_step(&L, m, s); break;
        case RFI_STEP_CALL: st = lower_call_step(p, m, s); break;
        case RFI_STEP_COPY: st = lower_copy_step(p, m, s); break;
        default: st = rfi_error(RF_E_INTERNAL, "kir: step %d has unknown kind %d", s,
                                (int)p->steps[s].kind);
        }
    }
    rfi_kir_kernel_free(L.k);
    rfi_free((void *)L.is_root);
    rfi_free(L.memo);
    if (st != RF_OK) {
        rfi_kir_free(m);
        /* the functions below return a bare RF_E_NOMEM when an instruction
         * could not be added: say so here, once */
        return st == RF_E_NOMEM ? rfi_error(st, "kir: out of memory lowering the program") : st;
    }
    *out = m;
    return RF_OK;
}
