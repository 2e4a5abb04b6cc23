/* index_native.c: native f32/f64 kernels for the CALL FALLBACK steps of
 * indexing: GATHER (an embedding's lookup) and SCATTER_ADD (its gradient),
 * replacing the reference kernels (src/backend/interp/index.c) whose results
 * they reproduce bit for bit. The reference scatter_add allocates a double
 * copy of the whole operand per call and adds element by element through
 * dtype switches; in an embedding's training step it took most of the time.
 * With x viewed as [outer, len, inner] around the axis (attr i[0]) and the
 * index list flattened to `count` entries (i32 or i64, what the op accepts):
 *
 *   GATHER: result row (o, m) is x row (o, clamp(index[m], 0, len - 1)),
 *     copied; an empty axis gives zeros.
 *   SCATTER_ADD: the reference adds the update rows to a double copy of x in
 *     index-list order (out-of-range indices dropped) and rounds once. Here
 *     the list is first bucketed by destination in the workspace (a stable
 *     counting sort, once per call), then each destination row, in parallel,
 *     is formed as x plus its updates in list order, in double, a piece of
 *     the row at a time on the stack, and rounded once: the same sums in the
 *     same order whatever the thread count. A row no index names is x
 *     rounded through double, as in the reference, in one pass. Where x is
 *     a broadcast +0 (the zeros an embedding's gradient scatters into) it is
 *     never read: such rows are +0, the others start their sums at +0.
 *
 * Both run in parallel over result rows on the runtime's pool where a call
 * covers enough elements, and allocate nothing per call.
 *
 * Deliberately not here: other dtypes (the services keep the reference
 * kernel), index lists of 2^31 entries or more, laid-out operands (the
 * services reorder them), which ops reach this file (pool.c hands them over).
 */
#include <string.h>

#include "../../runtime/threadpool.h"
#include "services.h"

#define GRAIN_ELEMENTS 16384 /* elements a parallel chunk should at least cover */
#define ROW_PIECE 256        /* doubles of a row summed at once */

struct rfi_cpu_index {
    bool scatter; /* SCATTER_ADD (else GATHER) */
    bool f64;     /* values are f64 (else f32) */
    bool idx64;   /* indices are i64 (else i32) */
    bool zero_base; /* scatter: x is a broadcast +0 (a gradient's), never read */
    int64_t outer, len, inner, count;
    size_t order_at; /* scatter workspace: int32 starts[len + 1] at 0, then order[count] */
};

const char *rfi_cpu_index_path(const rfi_cpu_index *k)
{
    return k->scatter ? "native-scatter-add" : "native-gather";
}

static inline int64_t index_at(const void *p, bool idx64, int64_t m)
{
    return idx64 ? ((const int64_t *)p)[m] : ((const int32_t *)p)[m];
}

static int64_t grain_for(int64_t per_item)
{
    return GRAIN_ELEMENTS / (per_item > 0 ? per_item : 1) + 1;
}

/* ---- GATHER ------------------------------------------------------------------------ */

typedef struct gather_job {
    const rfi_cpu_index *k;
    const char *x;
    const void *idx;
    char *out;
} gather_job;

/* Result rows [lo, hi) in (outer, count) order. */
static void gather_rows(void *ctx, int64_t lo, int64_t hi)
{
    const gather_job *j = ctx;
    const rfi_cpu_index *k = j->k;
    size_t row = (size_t)k->inner * (k->f64 ? sizeof(double) : sizeof(float));
    for (int64_t r = lo; r < hi; r++) {
        int64_t o = r / k->count, at = index_at(j->idx, k->idx64, r % k->count);
        at = at < 0 ? 0 : at >= k->len ? k->len - 1 : at;
        memcpy(j->out + (size_t)r * row, j->x + (size_t)(o * k->len + at) * row, row);
    }
}

/* ---- SCATTER_ADD ------------------------------------------------------------------- */

typedef struct scatter_job {
    const rfi_cpu_index *k;
    const void *x, *upd;
    void *out;
    const int32_t *starts, *order;
} scatter_job;

/* Destination rows [lo, hi) in (outer, len) order: each element x + its
 * updates in list order, in double, rounded once. */
#define SCATTER_ROWS(T)                                                                      \
    static void scatter_rows_##T(void *ctx, int64_t lo, int64_t hi)                          \
    {                                                                                        \
        const scatter_job *j = ctx;                                                          \
        const rfi_cpu_index *k = j->k;                                                       \
        const int64_t inner = k->inner;                                                      \
        double acc[ROW_PIECE];                                                               \
        for (int64_t r = lo; r < hi; r++) {                                                  \
            int64_t o = r / k->len, at = r % k->len;                                         \
            const int32_t *bucket = j->order + j->starts[at];                                \
            int32_t updates = j->starts[at + 1] - j->starts[at];                             \
            const T *restrict x = (const T *)j->x + r * inner;                               \
            const T *upd = (const T *)j->upd + o * k->count * inner;                         \
            T *restrict out = (T *)j->out + r * inner;                                       \
            if (updates == 0) { /* most of an embedding table's rows: one pass */          \
                for (int64_t i = 0; i < inner; i++)                                          \
                    out[i] = k->zero_base ? (T)0 : (T)(double)x[i];                          \
                continue;                                                                    \
            }                                                                                \
            for (int64_t p = 0; p < inner; p += ROW_PIECE) {                                 \
                int64_t n = inner - p < ROW_PIECE ? inner - p : ROW_PIECE;                   \
                for (int64_t i = 0; i < n; i++)                                              \
                    acc[i] = k->zero_base ? 0.0 : (double)x[p + i];                          \
                for (int32_t u = 0; u < updates; u++) {                                      \
                    const T *restrict v = upd + (int64_t)bucket[u] * inner + p;              \
                    for (int64_t i = 0; i < n; i++)                                          \
                        acc[i] += (double)v[i];                                              \
                }                                                                            \
                for (int64_t i = 0; i < n; i++)                                              \
                    out[p + i] = (T)acc[i];                                                  \
            }                                                                                \
        }                                                                                    \
    }
SCATTER_ROWS(float)
SCATTER_ROWS(double)

/* starts[a] .. starts[a + 1]: where the list positions naming index a lie in
 * order[], increasing (a stable counting sort; out-of-range ones left out). */
static void bucket_indices(const rfi_cpu_index *k, const void *idx, int32_t *starts,
                           int32_t *order)
{
    memset(starts, 0, (size_t)(k->len + 1) * sizeof *starts);
    for (int64_t m = 0; m < k->count; m++) {
        int64_t at = index_at(idx, k->idx64, m);
        if (at >= 0 && at < k->len)
            starts[at + 1]++;
    }
    for (int64_t a = 0; a < k->len; a++)
        starts[a + 1] += starts[a];
    /* place each position at its bucket's cursor (starts[a] moves to the
     * bucket's end, the next one's start), then shift the starts back */
    for (int64_t m = 0; m < k->count; m++) {
        int64_t at = index_at(idx, k->idx64, m);
        if (at >= 0 && at < k->len)
            order[starts[at]++] = (int32_t)m;
    }
    memmove(starts + 1, starts, (size_t)k->len * sizeof *starts);
    starts[0] = 0;
}

/* ---- prepare / run ----------------------------------------------------------------- */

rf_status rfi_cpu_index_prepare(const rfi_node *n, rfi_cpu_index **out, size_t *workspace_bytes)
{
    *out = NULL;
    *workspace_bytes = 0;
    bool scatter = n->op == RFI_OP_SCATTER_ADD && n->n_in == 3;
    bool gather = n->op == RFI_OP_GATHER && n->n_in == 2;
    if (!scatter && !gather)
        return RF_E_UNSUPPORTED;
    const rfi_node *x = n->in[0], *idx = n->in[1];
    int axis = (int)n->attr.i[0];
    if ((n->dtype != RF_F32 && n->dtype != RF_F64) || x->dtype != n->dtype ||
        (scatter && n->in[2]->dtype != n->dtype) ||
        (idx->dtype != RF_I32 && idx->dtype != RF_I64) || axis < 0 || axis >= x->rank)
        return RF_E_UNSUPPORTED;
    int64_t count = rfi_numel(idx->dims, idx->rank);
    if (count >= INT32_MAX || (scatter && x->dims[axis] >= INT32_MAX))
        return RF_E_UNSUPPORTED;
    rfi_cpu_index *k = rfi_calloc(1, sizeof *k);
    if (!k)
        return rfi_error(RF_E_NOMEM, "cpu: %s: out of memory", rfi_op_table[n->op].name);
    k->scatter = scatter;
    /* the zeros an embedding's gradient scatters into need not be read */
    k->zero_base = scatter && x->op == RFI_OP_BROADCAST_IN_DIM && rfi_node_is_plus_zero(x);
    k->f64 = n->dtype == RF_F64;
    k->idx64 = idx->dtype == RF_I64;
    k->outer = rfi_numel(x->dims, axis);
    k->len = x->dims[axis];
    k->inner = rfi_numel(x->dims + axis + 1, x->rank - axis - 1);
    k->count = count;
    if (scatter) {
        k->order_at = rfi_ws_align((size_t)(k->len + 1) * sizeof(int32_t));
        *workspace_bytes = k->order_at + rfi_ws_align((size_t)count * sizeof(int32_t));
    }
    *out = k;
    return RF_OK;
}

rf_status rfi_cpu_index_run(const rfi_cpu_index *k, const void *const *in, void *out,
                            void *workspace)
{
    size_t esz = k->f64 ? sizeof(double) : sizeof(float);
    if (!k->scatter) {
        int64_t rows = k->outer * k->count;
        if (rows * k->inner == 0) /* an empty result: buffers may be NULL */
            return RF_OK;
        if (k->len == 0) { /* nothing to take from: the reference's zeros */
            memset(out, 0, (size_t)(rows * k->inner) * esz);
            return RF_OK;
        }
        gather_job job = {k, in[0], in[1], out};
        rfi_parallel_for(rows, grain_for(k->inner), gather_rows, &job);
        return RF_OK;
    }
    int64_t rows = k->outer * k->len;
    if (rows * k->inner == 0)
        return RF_OK;
    int32_t *starts = workspace, *order = (int32_t *)((char *)workspace + k->order_at);
    bucket_indices(k, in[1], starts, order);
    scatter_job job = {k, in[0], in[2], out, starts, order};
    /* a row's work: its elements and its share of the updates */
    int64_t per_row = k->inner + k->outer * k->count * k->inner / rows;
    rfi_parallel_for(rows, grain_for(per_row), k->f64 ? scatter_rows_double : scatter_rows_float,
                     &job);
    return RF_OK;
}

void rfi_cpu_index_free(rfi_cpu_index *k) { rfi_free(k); }
