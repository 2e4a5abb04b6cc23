/* dnnl_matmul.c: f32 DOT_GENERAL through oneDNN's matmul primitive, created
 * once at prepare time, plus the small wrapper (rfi_dnnl_mm) that conv.c
 * reuses for its im2col products.
 *
 * A DOT_GENERAL's result is [batch, lhs free, rhs free] = [B, M, N] in
 * row-major order, so only the operands need describing: lhs as [B, M, K]
 * (batch dims, free dims, contracting dims in the attribute's order) and rhs
 * as [B, K, N]. When each of those groups of an operand's dims collapses to
 * one stride in its row-major layout (e.g. any transposed 2-D operand), the
 * operand is described in place as a strided tensor. Otherwise, or when
 * oneDNN would take the strided form only with its slow reference
 * implementation, both operands are packed per call into the workspace (a
 * plain strided copy with contiguous writes) and described as contiguous.
 * An operand read down its columns (an rhs with N contiguous, a transposed
 * lhs) whose rows lie a multiple of ALIASED_ROW_FLOATS apart is copied per
 * call into rows padded by ROW_PAD (below). Empty results do nothing; K == 0
 * writes zeros.
 *
 * A product of RF_PRECISION_BF16 rounds its operands as it converts them,
 * every call: into bf16 for oneDNN's bf16 kernels where the CPU has bf16
 * instructions, else into rounded f32 (make_bf16_primitive says how); an
 * aliased operand converted in its own layout goes into padded rows as well.
 *
 * A CALL step's epilogue (plan.h) becomes oneDNN post-ops when the primitive
 * takes them: a leading bias along the result's last dim as the matmul's
 * bias input (a [1, 1, N] tensor; its kernels add it 3-7% faster than the
 * same add as a binary post-op: the mlp's layers, 128 x 784 x 512 330 against
 * 343-349 us, 128 x 512 x 256 106 against 114), tanh as eltwise, a later bias
 * or a residual as a binary add of a [1, 1, N] or dst-shaped tensor; never a
 * relu or a logistic or what follows them
 * (rfi_dnnl_post_faithful). The services apply the ops the primitive does
 * not after the call (rfi_cpu_matmul_epilogue_ops).
 *
 * Deliberately not here: non-f32 dtypes (the services run the reference
 * kernel for them).
 */
#include <stdlib.h>
#include <string.h>

#include "../../runtime/threadpool.h"
#include "services.h"

/* ---- rfi_dnnl_mm ------------------------------------------------------------------ */

rf_status rfi_dnnl_error(dnnl_status_t st, const char *what, const char *call)
{
    return rfi_error(st == dnnl_out_of_memory ? RF_E_NOMEM : RF_E_INTERNAL,
                     "cpu: %s: oneDNN %s failed (status %d)", what, call, (int)st);
}

static dnnl_status_t tensor_md(dnnl_memory_desc_t *md, const rfi_dnnl_tensor *t,
                               dnnl_data_type_t type)
{
    return rfi_dnnl.memory_desc_init_by_strides(md, t->ndims, t->dims, type, t->strides);
}

/* ---- Post-ops ----------------------------------------------------------------------- */

static void plain_strides(rfi_dnnl_tensor *t)
{
    int64_t step = 1;
    for (int d = t->ndims - 1; d >= 0; d--) {
        t->strides[d] = step;
        step *= t->dims[d];
    }
}

bool rfi_dnnl_post_make(rfi_dnnl_post *post, const rfi_epi_op *ops, int n,
                        const rfi_dnnl_tensor *dst, int bias_dim)
{
    memset(post, 0, sizeof *post);
    if (n > RFI_EPI_MAX)
        return false;
    for (int k = 0; k < n; k++) {
        rfi_dnnl_tensor *t = &post->src1[k];
        post->kind[k] = ops[k].kind;
        t->ndims = dst->ndims;
        for (int d = 0; d < dst->ndims; d++)
            t->dims[d] = ops[k].kind == RFI_EPI_ADD || d == bias_dim ? dst->dims[d] : 1;
        if (ops[k].kind == RFI_EPI_BIAS && bias_dim < 0)
            return false;
        plain_strides(t);
    }
    post->n = n;
    return true;
}

static bool is_binary(rfi_epi_kind k) { return k == RFI_EPI_BIAS || k == RFI_EPI_ADD; }

/* Measured with oneDNN 2.6 on AVX2: a NaN input gave 0 after a relu post-op in
 * its jit convolutions and in the mlp's 128 x 784 x 512 matmul, and stayed NaN
 * after tanh and logistic, and after relu in a 64 x 32 x 32 matmul. Its logistic
 * flushes every result below x = -86.99 to 0 (the exact values there are normal
 * floats down to -87.34) and is up to 6 ulp from the interpreter above; its tanh
 * stays within 1.2 ulp. So the primitive takes the ops before the first relu or
 * logistic, and the services apply the rest in double. */
int rfi_dnnl_post_faithful(const rfi_epi_op *ops, int n)
{
    int k = 0;
    while (k < n && ops[k].kind != RFI_EPI_RELU && ops[k].kind != RFI_EPI_LOGISTIC)
        k++;
    return k;
}

dnnl_status_t rfi_dnnl_post_attr(dnnl_primitive_attr_t attr, const rfi_dnnl_post *post)
{
    if (!post || (post->n == 0 && !post->accumulate))
        return dnnl_success;
    dnnl_post_ops_t ops = NULL;
    dnnl_status_t st = rfi_dnnl.post_ops_create(&ops);
    if (st == dnnl_success && post->accumulate)
        st = rfi_dnnl.post_ops_append_sum(ops, 1.0f);
    for (int k = 0; k < post->n && st == dnnl_success; k++) {
        dnnl_memory_desc_t md;
        switch (post->kind[k]) {
        case RFI_EPI_BIAS:
        case RFI_EPI_ADD:
            st = rfi_dnnl.memory_desc_init_by_strides(&md, post->src1[k].ndims, post->src1[k].dims,
                                                      dnnl_f32, post->src1[k].strides);
            if (st == dnnl_success)
                st = rfi_dnnl.post_ops_append_binary(ops, dnnl_binary_add, &md);
            break;
        case RFI_EPI_TANH:
            st = rfi_dnnl.post_ops_append_eltwise(ops, 1.0f, dnnl_eltwise_tanh, 0.0f, 0.0f);
            break;
        case RFI_EPI_LOGISTIC:
            st = rfi_dnnl.post_ops_append_eltwise(ops, 1.0f, dnnl_eltwise_logistic, 0.0f, 0.0f);
            break;
        default: st = dnnl_invalid_arguments; break;
        }
    }
    if (st == dnnl_success)
        st = rfi_dnnl.primitive_attr_set_post_ops(attr, ops);
    if (ops)
        rfi_dnnl.post_ops_destroy(ops);
    return st;
}

dnnl_status_t rfi_dnnl_post_memories(const rfi_dnnl_post *post, dnnl_engine_t eng,
                                     dnnl_memory_t *mem)
{
    dnnl_status_t st = dnnl_success;
    for (int k = 0; post && k < post->n && st == dnnl_success; k++) {
        mem[k] = NULL;
        if (!is_binary(post->kind[k]))
            continue;
        dnnl_memory_desc_t md;
        st = rfi_dnnl.memory_desc_init_by_strides(&md, post->src1[k].ndims, post->src1[k].dims,
                                                  dnnl_f32, post->src1[k].strides);
        if (st == dnnl_success)
            st = rfi_dnnl.memory_create(&mem[k], &md, eng, DNNL_MEMORY_NONE);
    }
    return st;
}

int rfi_dnnl_post_args(const rfi_dnnl_post *post, dnnl_memory_t *mem, const void *const *src,
                       dnnl_exec_arg_t *args, int nargs)
{
    for (int k = 0; post && k < post->n; k++) {
        if (!mem[k])
            continue;
        if (!src || !src[k] ||
            rfi_dnnl.memory_set_data_handle(mem[k], (void *)src[k]) != dnnl_success)
            return -1;
        args[nargs++] = (dnnl_exec_arg_t){DNNL_ARG_ATTR_MULTIPLE_POST_OP(k) | DNNL_ARG_SRC_1,
                                          mem[k]};
    }
    return nargs;
}

/* ---- rfi_dnnl_mm (continued) ------------------------------------------------------------ */

/* Creates the primitive (user scratchpad) and its memory objects (no data),
 * src and wei of `operands` type (f32 or bf16), dst f32. */
static dnnl_status_t mm_create(rfi_dnnl_mm *mm, dnnl_engine_t eng, const rfi_dnnl_tensor *src,
                               const rfi_dnnl_tensor *wei, const rfi_dnnl_tensor *dst,
                               const rfi_dnnl_post *post, dnnl_data_type_t operands,
                               const char **failed)
{
    dnnl_memory_desc_t s_md, w_md, d_md, b_md;
    dnnl_matmul_desc_t desc;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_primitive_desc_t pd = NULL;
    dnnl_status_t st;
    *failed = "memory_desc_init_by_strides";
    if ((st = tensor_md(&s_md, src, operands)) != dnnl_success ||
        (st = tensor_md(&w_md, wei, operands)) != dnnl_success ||
        (st = tensor_md(&d_md, dst, dnnl_f32)) != dnnl_success)
        return st;
    bool bias = post && post->bias_input;
    if (bias && (st = tensor_md(&b_md, &post->bias, dnnl_f32)) != dnnl_success)
        return st;
    *failed = "matmul_desc_init";
    st = rfi_dnnl.matmul_desc_init(&desc, &s_md, &w_md, bias ? &b_md : NULL, &d_md);
    if (st != dnnl_success)
        return st;
    *failed = "primitive_attr";
    if ((st = rfi_dnnl.primitive_attr_create(&attr)) != dnnl_success)
        return st;
    st = rfi_dnnl.primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user);
    if (st == dnnl_success) {
        *failed = "post-ops";
        st = rfi_dnnl_post_attr(attr, post);
    }
    if (st == dnnl_success) {
        *failed = "primitive_desc_create (matmul)";
        st = rfi_dnnl.primitive_desc_create(&pd, &desc, attr, eng, NULL);
    }
    rfi_dnnl.primitive_attr_destroy(attr);
    if (st != dnnl_success)
        return st;
    const char *impl = NULL;
    if (rfi_dnnl.primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl) == dnnl_success &&
        impl) {
        mm->is_ref = strncmp(impl, "ref", 3) == 0;
        mm->bf16_isa = strstr(impl, "bf16") || strstr(impl, "amx");
    }
    const dnnl_memory_desc_t *sp_md =
        rfi_dnnl.primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    mm->scratch_bytes = sp_md ? rfi_dnnl.memory_desc_get_size(sp_md) : 0;
    *failed = "primitive_create";
    st = rfi_dnnl.primitive_create(&mm->prim, pd);
    *failed = "memory_create";
    if (st == dnnl_success)
        st = rfi_dnnl.memory_create(&mm->src, &s_md, eng, DNNL_MEMORY_NONE);
    if (st == dnnl_success)
        st = rfi_dnnl.memory_create(&mm->wei, &w_md, eng, DNNL_MEMORY_NONE);
    if (st == dnnl_success)
        st = rfi_dnnl.memory_create(&mm->dst, &d_md, eng, DNNL_MEMORY_NONE);
    if (st == dnnl_success && mm->scratch_bytes > 0)
        st = rfi_dnnl.memory_create(&mm->scratch, sp_md, eng, DNNL_MEMORY_NONE);
    if (st == dnnl_success && bias)
        st = rfi_dnnl.memory_create(&mm->bias, &b_md, eng, DNNL_MEMORY_NONE);
    if (st == dnnl_success && post) {
        st = rfi_dnnl_post_memories(post, eng, mm->post);
        mm->n_post = post->n;
    }
    rfi_dnnl.primitive_desc_destroy(pd);
    return st;
}

rf_status rfi_dnnl_mm_init(rfi_dnnl_mm *mm, dnnl_engine_t eng, const rfi_dnnl_tensor *src,
                           const rfi_dnnl_tensor *wei, const rfi_dnnl_tensor *dst,
                           const rfi_dnnl_post *post, const char *what)
{
    memset(mm, 0, sizeof *mm);
    const char *failed = "";
    dnnl_status_t st = mm_create(mm, eng, src, wei, dst, post, dnnl_f32, &failed);
    if (st != dnnl_success) {
        rfi_dnnl_mm_destroy(mm);
        return rfi_dnnl_error(st, what, failed);
    }
    return RF_OK;
}

/* rfi_dnnl_mm_init with bf16 src and wei, kept only where a kernel with bf16
 * instructions runs it: oneDNN 2.6 also takes bf16 on plain AVX-512 by
 * emulation, slower than f32. */
static rf_status mm_init_bf16(rfi_dnnl_mm *mm, dnnl_engine_t eng, const rfi_dnnl_tensor *src,
                              const rfi_dnnl_tensor *wei, const rfi_dnnl_tensor *dst,
                              const rfi_dnnl_post *post)
{
    memset(mm, 0, sizeof *mm);
    const char *failed = "";
    dnnl_status_t st = mm_create(mm, eng, src, wei, dst, post, dnnl_bf16, &failed);
    if (st == dnnl_success && mm->bf16_isa)
        return RF_OK;
    rfi_dnnl_mm_destroy(mm);
    return RF_E_UNSUPPORTED;
}

rf_status rfi_dnnl_mm_run(rfi_dnnl_mm *mm, dnnl_stream_t s, const float *src, const float *wei,
                          float *dst, void *scratch, const void *const *post_src,
                          const char *what)
{
    dnnl_status_t st = rfi_dnnl.memory_set_data_handle(mm->src, (void *)src);
    if (st == dnnl_success)
        st = rfi_dnnl.memory_set_data_handle(mm->wei, (void *)wei);
    if (st == dnnl_success)
        st = rfi_dnnl.memory_set_data_handle(mm->dst, dst);
    if (st == dnnl_success && mm->scratch)
        st = rfi_dnnl.memory_set_data_handle(mm->scratch, scratch);
    if (st != dnnl_success)
        return rfi_dnnl_error(st, what, "memory_set_data_handle");
    dnnl_exec_arg_t args[5 + RFI_EPI_MAX] = {
        {DNNL_ARG_SRC, mm->src},
        {DNNL_ARG_WEIGHTS, mm->wei},
        {DNNL_ARG_DST, mm->dst},
        {DNNL_ARG_SCRATCHPAD, mm->scratch},
    };
    int nargs = mm->scratch ? 4 : 3;
    if (mm->bias) {
        if (!post_src || !post_src[0] ||
            rfi_dnnl.memory_set_data_handle(mm->bias, (void *)post_src[0]) != dnnl_success)
            return rfi_error(RF_E_INTERNAL, "cpu: %s: the bias input has no operand", what);
        args[nargs++] = (dnnl_exec_arg_t){DNNL_ARG_BIAS, mm->bias};
        post_src++; /* the post-ops' operands follow the bias's */
    }
    for (int k = 0; k < mm->n_post; k++) {
        if (!mm->post[k])
            continue;
        if (!post_src || !post_src[k] ||
            rfi_dnnl.memory_set_data_handle(mm->post[k], (void *)post_src[k]) != dnnl_success)
            return rfi_error(RF_E_INTERNAL, "cpu: %s: post-op %d has no operand", what, k);
        args[nargs++] = (dnnl_exec_arg_t){DNNL_ARG_ATTR_MULTIPLE_POST_OP(k) | DNNL_ARG_SRC_1,
                                          mm->post[k]};
    }
    st = rfi_dnnl.primitive_execute(mm->prim, s, nargs, args);
    if (st == dnnl_success)
        st = rfi_dnnl.stream_wait(s);
    return st == dnnl_success ? RF_OK : rfi_dnnl_error(st, what, "matmul execute");
}

void rfi_dnnl_mm_destroy(rfi_dnnl_mm *mm)
{
    if (mm->prim)
        rfi_dnnl.primitive_destroy(mm->prim);
    if (mm->src)
        rfi_dnnl.memory_destroy(mm->src);
    if (mm->wei)
        rfi_dnnl.memory_destroy(mm->wei);
    if (mm->dst)
        rfi_dnnl.memory_destroy(mm->dst);
    if (mm->scratch)
        rfi_dnnl.memory_destroy(mm->scratch);
    if (mm->bias)
        rfi_dnnl.memory_destroy(mm->bias);
    for (int k = 0; k < RFI_EPI_MAX; k++)
        if (mm->post[k])
            rfi_dnnl.memory_destroy(mm->post[k]);
    memset(mm, 0, sizeof *mm);
}

/* ---- DOT_GENERAL ------------------------------------------------------------------ */

/* An operand visited as [B, rows, cols]: the dims of each group (in visiting
 * order) and their row-major strides; `flat` holds the strided 3-D view when
 * every group collapses to one stride. */
typedef struct operand_view {
    int rank;                           /* dims visited (all of the operand's) */
    int64_t dims[RF_MAX_RANK], step[RF_MAX_RANK];
    int group_end[3];                   /* visiting positions ending each group */
    int64_t size[3];                    /* B, rows, cols */
    int64_t stride[3];                  /* per group, if collapsible */
    bool collapsible;
} operand_view;

/* What a packed operand holds: its f32 values, or (RF_PRECISION_BF16) those
 * rounded to bfloat16, widened back to f32 or as bf16 bits. */
typedef enum pack_format { PACK_F32, PACK_ROUNDED, PACK_BF16 } pack_format;

struct rfi_cpu_matmul {
    const rfi_node *node;
    int64_t batch, m, k, n;
    bool pack;          /* operands packed into the workspace per call */
    bool pad_lhs, pad_rhs; /* the operand copied per call into rows ROW_PAD longer */
    pack_format format; /* of the packed operands: PACK_F32 unless RF_PRECISION_BF16 */
    bool convert;       /* RF_PRECISION_BF16, not packed: each operand converted per call
                           in its own layout, into `format` */
    operand_view lhs, rhs;
    size_t lhs_at, rhs_at; /* workspace offsets of the packed operands */
    rfi_dnnl_mm mm;
    rfi_dnnl_post post;    /* the epilogue's first post.n ops as post-ops (0: none) */
};

static void row_major_strides(const int64_t *dims, int rank, int64_t *strides)
{
    int64_t s = 1;
    for (int d = rank - 1; d >= 0; d--) {
        strides[d] = s;
        s *= dims[d];
    }
}

static void view_add(operand_view *v, const rfi_node *x, const int64_t *xs, const int64_t *list,
                     int count)
{
    for (int k = 0; k < count; k++) {
        v->dims[v->rank] = x->dims[list[k]];
        v->step[v->rank] = xs[list[k]];
        v->rank++;
    }
}


/* Finds each group's size and, if its non-unit dims are nested row-major
 * (stride of each = stride of the next * its size), its stride. */
static void view_collapse(operand_view *v)
{
    v->collapsible = true;
    int start = 0;
    for (int g = 0; g < 3; g++) {
        int64_t size = 1, stride = 0;
        bool any = false;
        for (int d = v->group_end[g] - 1; d >= start; d--) {
            if (v->dims[d] == 1)
                continue;
            if (!any)
                stride = v->step[d];
            else if (v->step[d] != size * stride)
                v->collapsible = false;
            any = true;
            size *= v->dims[d];
        }
        v->size[g] = size;
        v->stride[g] = any ? stride : -1; /* -1: a unit group, stride chosen later */
        start = v->group_end[g];
    }
}

/* A 3-D oneDNN tensor for [B, rows, cols]: the view's strides, or contiguous
 * when packed. Unit groups get strides that keep the layout plain (a unit
 * cols dim stride 1, a unit rows dim 1 or cols-wide, a unit batch outermost). */
static rfi_dnnl_tensor view_tensor(const operand_view *v, bool packed)
{
    rfi_dnnl_tensor t = {3, {v->size[0], v->size[1], v->size[2]}, {0, 0, 0}};
    if (packed) {
        t.strides[2] = 1;
        t.strides[1] = v->size[2];
        t.strides[0] = v->size[1] * v->size[2];
        return t;
    }
    int64_t sr = v->stride[1], sc = v->stride[2], sb = v->stride[0];
    if (sc < 0)
        sc = 1;
    if (sr < 0)
        sr = sc == 1 ? v->size[2] : 1;
    if (sb < 0) {
        int64_t a = sr * v->size[1], b = sc * v->size[2];
        sb = a > b ? a : b;
    }
    t.strides[0] = sb;
    t.strides[1] = sr;
    t.strides[2] = sc;
    return t;
}

/* ---- Packing ---------------------------------------------------------------------- */

typedef struct packing {
    const operand_view *v;
    const float *src;
    void *dst;        /* the operand in visiting order, contiguous */
    pack_format format;
    bool bf16_isa;    /* PACK_BF16 may use VCVTNEPS2BF16 */
} packing;

static uint16_t bf16_bits(float x)
{
    float r = rfi_round_bf16(x);
    uint32_t u;
    memcpy(&u, &r, sizeof u);
    return (uint16_t)(u >> 16);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define HAVE_X86_PATHS 1
/* PACK_ROUNDED's contiguous rows, vectorised for AVX2 (-O2 alone leaves the
 * loop scalar, 6x slower). */
__attribute__((target("avx2"), optimize("tree-vectorize"))) static void rounded_row_avx2(
    float *dst, const float *src, int64_t n) /* dst may be src (rfi_cpu_round_bf16) */
{
    for (int64_t j = 0; j < n; j++)
        dst[j] = rfi_round_bf16(src[j]);
}

/* The instruction rounds exactly as rfi_round_bf16 (which describes it). */
__attribute__((target("avx512f,avx512bf16"))) static void bf16_row_isa(uint16_t *dst,
                                                                      const float *src,
                                                                      int64_t n)
{
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + j));
        _mm256_storeu_si256((__m256i *)(dst + j), (__m256i)h);
    }
    for (; j < n; j++)
        dst[j] = bf16_bits(src[j]);
}
#endif

/* dst[j] = rfi_round_bf16(src[j]), vectorised where the CPU allows; dst may be src. */
static void rounded_row(float *dst, const float *src, int64_t n)
{
#ifdef HAVE_X86_PATHS
    if (__builtin_cpu_supports("avx2")) {
        rounded_row_avx2(dst, src, n);
        return;
    }
#endif
    for (int64_t j = 0; j < n; j++)
        dst[j] = rfi_round_bf16(src[j]);
}

/* One row of n values, src[j * step], into packed position `at`. */
static void pack_row(const packing *p, int64_t at, const float *src, int64_t n, int64_t step)
{
    if (p->format == PACK_F32) {
        float *d = (float *)p->dst + at;
        if (step == 1)
            memcpy(d, src, (size_t)n * sizeof(float));
        else
            for (int64_t j = 0; j < n; j++)
                d[j] = src[j * step];
    } else if (p->format == PACK_ROUNDED) {
        float *d = (float *)p->dst + at;
        if (step == 1) {
            rounded_row(d, src, n);
            return;
        }
        for (int64_t j = 0; j < n; j++)
            d[j] = rfi_round_bf16(src[j * step]);
    } else {
        uint16_t *d = (uint16_t *)p->dst + at;
#ifdef HAVE_X86_PATHS
        if (p->bf16_isa && step == 1) {
            bf16_row_isa(d, src, n);
            return;
        }
#endif
        for (int64_t j = 0; j < n; j++)
            d[j] = bf16_bits(src[j * step]);
    }
}

bool rfi_bf16_kernels_allowed(void)
{
    const char *env = getenv("RF_BF16_KERNELS");
    return !env || strcmp(env, "0") != 0;
}

/* Rows [lo, hi) of the operand (a row: its innermost visited dim) in
 * visiting order (contiguous writes). */
static void pack_rows(void *ctx, int64_t lo, int64_t hi)
{
    const packing *p = ctx;
    const operand_view *v = p->v;
    int r = v->rank;
    if (r == 0) {
        pack_row(p, 0, p->src, 1, 1);
        return;
    }
    int64_t inner = v->dims[r - 1], inner_step = v->step[r - 1];
    int64_t idx[RF_MAX_RANK] = {0}, offset = 0, rest = lo;
    for (int d = r - 2; d >= 0; d--) {
        idx[d] = rest % v->dims[d];
        rest /= v->dims[d];
        offset += idx[d] * v->step[d];
    }
    for (int64_t o = lo; o < hi; o++) {
        pack_row(p, o * inner, p->src + offset, inner, inner_step);
        for (int d = r - 2; d >= 0; d--) {
            offset += v->step[d];
            if (++idx[d] < v->dims[d])
                break;
            offset -= v->step[d] * v->dims[d];
            idx[d] = 0;
        }
    }
}

/* Below this many values a pack runs on the calling thread. */
#define PACK_GRAIN_VALUES 16384

/* Values [lo, hi) of an operand converted in place order (packing's v unused). */
static void convert_range(void *ctx, int64_t lo, int64_t hi)
{
    const packing *p = ctx;
    pack_row(p, lo, p->src + lo, hi - lo, 1);
}

/* The n values of src into dst in `format` (PACK_ROUNDED or PACK_BF16), their
 * layout kept, on the pool's threads when many. */
static void convert_operand(void *dst, const float *src, int64_t n, pack_format format,
                            bool bf16_isa)
{
    packing p = {NULL, src, dst, format, bf16_isa};
    rfi_parallel_for(n, PACK_GRAIN_VALUES, convert_range, &p);
}

void rfi_cpu_round_bf16(float *dst, const float *src, int64_t n)
{
    convert_operand(dst, src, n, PACK_ROUNDED, false);
}

/* Packs the operand into dst in `format`, on the pool's threads when large. */
static void pack_view(void *dst, const float *src, const operand_view *v, pack_format format,
                      bool bf16_isa)
{
    packing p = {v, src, dst, format, bf16_isa};
    int64_t inner = v->rank ? v->dims[v->rank - 1] : 1;
    int64_t rows = v->rank ? rfi_numel(v->dims, v->rank - 1) : 1;
    int64_t grain = inner > 0 ? (PACK_GRAIN_VALUES + inner - 1) / inner : rows;
    rfi_parallel_for(rows, grain, pack_rows, &p);
}

/* An operand read in place down its columns - the rhs [B, K, N] with its N
 * dim contiguous, or a transposed lhs [B, M, K] with its M dim contiguous -
 * whose rows (one per k) lie a multiple of ALIASED_ROW_FLOATS (2 KB) apart
 * falls on few cache sets when oneDNN's gemm walks down its columns, and the
 * product slows by a third or more. Measured on a 2-core AVX2 machine (AMD
 * EPYC; a standalone program, medians of 400 calls, two runs each): the mlp's
 * second layer's input gradient, 128 x 256 x 512, took 394-437 us with the rhs
 * rows 512 floats apart and 258-364 with them 528 apart; its weight gradient,
 * 256 x 128 x 512 with the lhs transposed, 425-515 against 295-307. With N =
 * 500, 520 or 640 a row-major rhs ran as fast as a transposed one; with N =
 * 1024 it took 960 us against 440. The ffn's weight gradient 1024 x 128 x 256,
 * whose transposed lhs has rows 1024 floats apart, ran at 70 GFLOP/s on two
 * threads and 33 on one (`build/bench_services ffn`), its other products at
 * 134-162 and 77-85; padded, at 102-139 and 78. Over the products with a
 * transposed lhs of M = 512 or 1024 rows and K, N in 128..1024 on two threads
 * (two runs each way), padding took M = 1024, N <= 256 from 58-73 GFLOP/s to
 * 78-152 and M = 512, N <= 512 from 96-132 to 109-158; with N = 1024 (and M =
 * 1024, N = 512) both ran at 127-168 but for one padded run at 86 (of 48).
 * Copying into rows ROW_PAD longer costs a pass over the operand, which pays
 * only when it is read for many rows or columns of the other (at least
 * PAD_MIN_ROWS): never at batch-1 inference. */
#define ALIASED_ROW_FLOATS 512
#define ROW_PAD 16
#define PAD_MIN_ROWS 64

/* Whether rows 512 floats apart are worth padding on this CPU: on AMD's (the
 * EPYC above). On an Intel Xeon (Emerald Rapids class, two AVX-512 cores,
 * build/bench_services mlp and ffn) every padded product ran as fast as in
 * place or slower: the mlp's first layer 420 against 365 us, its second
 * layer's weight gradient 134-147 against 112, its step 2.8% slower (4
 * interleaved pairs). RF_PAD_ALIASED_ROWS=0 or 1 in the environment at
 * prepare time decides instead (tests). */
static bool cpu_pads_aliased_rows(void)
{
    const char *env = getenv("RF_PAD_ALIASED_ROWS");
    if (env && (*env == '0' || *env == '1'))
        return *env == '1';
#if defined(__x86_64__) && defined(__GNUC__)
    return __builtin_cpu_is("amd");
#else
    return false;
#endif
}

static bool rows_aliased(int64_t row_stride, const rfi_cpu_matmul *m, int64_t reuse)
{
    if (!cpu_pads_aliased_rows())
        return false;
    return row_stride > 0 && row_stride % ALIASED_ROW_FLOATS == 0 && m->k > 1 &&
           reuse >= PAD_MIN_ROWS;
}

static bool rhs_rows_aliased(const rfi_cpu_matmul *m)
{
    const operand_view *r = &m->rhs;
    return r->collapsible && r->stride[2] == 1 && rows_aliased(r->stride[1], m, m->m);
}

static bool lhs_rows_aliased(const rfi_cpu_matmul *m)
{
    const operand_view *l = &m->lhs;
    return l->collapsible && l->stride[1] == 1 && rows_aliased(l->stride[2], m, m->n);
}

/* An operand's padded copy: `len` contiguous values per row, k rows per batch;
 * its row and batch strides in floats. */
static int64_t padded_row(int64_t len) { return len + ROW_PAD; }
static int64_t padded_batch(const rfi_cpu_matmul *m, int64_t len)
{
    return m->k * padded_row(len);
}

/* A padded copy in progress: batches of k rows of len values, src's rows `sr`
 * and batches `sb` floats apart (sb <= 0: one batch), written in the
 * matmul's format (rounded or bf16 under RF_PRECISION_BF16). */
typedef struct padding {
    packing pk; /* its dst: the padded rows; its v unused */
    const rfi_cpu_matmul *m;
    int64_t len, sr, sb;
} padding;

static void pad_rows(void *ctx, int64_t lo, int64_t hi)
{
    const padding *p = ctx;
    int64_t k = p->m->k, sb = p->sb > 0 ? p->sb : 0;
    for (int64_t row = lo; row < hi; row++)
        pack_row(&p->pk, row / k * padded_batch(p->m, p->len) + row % k * padded_row(p->len),
                 p->pk.src + row / k * sb + row % k * p->sr, p->len, 1);
}

/* Copies the operand into padded rows, on the pool's threads when large (inline
 * in a call that runs beside another). */
static void copy_padded(void *dst, const float *src, const rfi_cpu_matmul *m, int64_t len,
                        int64_t sr, int64_t sb)
{
    padding p = {{NULL, src, dst, m->format, m->mm.bf16_isa}, m, len, sr, sb};
    int64_t grain = (PACK_GRAIN_VALUES + len - 1) / len;
    rfi_parallel_for(m->batch * m->k, grain, pad_rows, &p);
}

static void copy_padded_lhs(void *dst, const float *src, const rfi_cpu_matmul *m)
{
    copy_padded(dst, src, m, m->m, m->lhs.stride[2], m->lhs.stride[0]);
}

static void copy_padded_rhs(void *dst, const float *src, const rfi_cpu_matmul *m)
{
    copy_padded(dst, src, m, m->n, m->rhs.stride[1], m->rhs.stride[0]);
}

/* The operands read in place: their views, an aliased one's padded copy in its
 * place (pad_lhs, pad_rhs set). */
static void in_place_tensors(rfi_cpu_matmul *m, rfi_dnnl_tensor *src, rfi_dnnl_tensor *wei)
{
    *src = view_tensor(&m->lhs, false);
    *wei = view_tensor(&m->rhs, false);
    m->pad_lhs = lhs_rows_aliased(m);
    m->pad_rhs = rhs_rows_aliased(m);
    if (m->pad_lhs)
        *src = (rfi_dnnl_tensor){3, {m->batch, m->m, m->k},
                                 {padded_batch(m, m->m), 1, padded_row(m->m)}};
    if (m->pad_rhs)
        *wei = (rfi_dnnl_tensor){3, {m->batch, m->k, m->n},
                                 {padded_batch(m, m->n), padded_row(m->n), 1}};
}

/* An operand's share of the workspace: its packed, padded or converted copy. */
static size_t operand_bytes(const rfi_cpu_matmul *m, bool lhs, size_t value)
{
    int64_t len = lhs ? m->m : m->n, n = 0; /* len: the operand's free dim */
    if (m->pack)
        n = m->batch * m->k * len;
    else if (lhs ? m->pad_lhs : m->pad_rhs)
        n = m->batch * padded_batch(m, len);
    else if (m->convert)
        n = rfi_node_numel(m->node->in[lhs ? 0 : 1]);
    return rfi_ws_align((size_t)n * value);
}

static void make_views(rfi_cpu_matmul *m, const rfi_node *n)
{
    const rfi_node *a = n->in[0], *b = n->in[1];
    const rfi_attrs *at = &n->attr;
    int nbatch = at->nl[0], ncontract = at->nl[2];
    int64_t a_free[RF_MAX_RANK], b_free[RF_MAX_RANK], as[RF_MAX_RANK], bs[RF_MAX_RANK];
    int na_free = rfi_dot_free_dims(a->rank, at->l[0], nbatch, at->l[2], ncontract, a_free);
    int nb_free = rfi_dot_free_dims(b->rank, at->l[1], nbatch, at->l[3], ncontract, b_free);
    row_major_strides(a->dims, a->rank, as);
    row_major_strides(b->dims, b->rank, bs);
    operand_view *l = &m->lhs, *r = &m->rhs;
    memset(l, 0, sizeof *l);
    memset(r, 0, sizeof *r);
    view_add(l, a, as, at->l[0], nbatch);
    l->group_end[0] = l->rank;
    view_add(l, a, as, a_free, na_free);
    l->group_end[1] = l->rank;
    view_add(l, a, as, at->l[2], ncontract);
    l->group_end[2] = l->rank;
    view_add(r, b, bs, at->l[1], nbatch);
    r->group_end[0] = r->rank;
    view_add(r, b, bs, at->l[3], ncontract);
    r->group_end[1] = r->rank;
    view_add(r, b, bs, b_free, nb_free);
    r->group_end[2] = r->rank;
    view_collapse(l);
    view_collapse(r);
}

/* A primitive over operands of `format` (PACK_BF16: bf16 ones, kept only with
 * bf16 instructions; PACK_ROUNDED: f32 ones), described as packed or as
 * their views; RF_OK only for a kernel better than oneDNN's reference one. */
static rf_status try_bf16_form(rfi_cpu_matmul *m, dnnl_engine_t eng, const rfi_dnnl_post *post,
                               pack_format format, bool packed)
{
    rfi_dnnl_tensor dst = {3, {m->batch, m->m, m->n}, {m->m * m->n, m->n, 1}};
    rfi_dnnl_tensor src, wei;
    if (packed) {
        src = view_tensor(&m->lhs, true);
        wei = view_tensor(&m->rhs, true);
        m->pad_lhs = m->pad_rhs = false;
    } else {
        in_place_tensors(m, &src, &wei);
    }
    rf_status st = format == PACK_BF16
                       ? mm_init_bf16(&m->mm, eng, &src, &wei, &dst, post)
                       : rfi_dnnl_mm_init(&m->mm, eng, &src, &wei, &dst, post, "dot_general");
    if (st == RF_OK && m->mm.is_ref) {
        rfi_dnnl_mm_destroy(&m->mm);
        st = RF_E_UNSUPPORTED;
    }
    if (st == RF_OK) {
        m->format = format;
        m->pack = packed;
        m->convert = !packed;
    } else {
        m->pad_lhs = m->pad_rhs = false;
    }
    return st;
}

/* RF_PRECISION_BF16: the call rounds the operands each time, as it converts
 * them: into bf16 for a primitive with bf16 instructions, else into rounded
 * f32 for an f32 one (the same products at f32 speed; RF_BF16_KERNELS=0
 * takes this way everywhere). An operand whose view is strided is converted
 * in its own layout (one contiguous pass, which vectorises; a transposed
 * operand stays transposed for oneDNN); others are packed. */
static rf_status make_bf16_primitive(rfi_cpu_matmul *m, dnnl_engine_t eng,
                                     const rfi_dnnl_post *post)
{
    bool isa_allowed = rfi_bf16_kernels_allowed();
    bool in_place = m->lhs.collapsible && m->rhs.collapsible;
    for (int format = isa_allowed ? PACK_BF16 : PACK_ROUNDED; format >= PACK_ROUNDED; format--) {
        if (in_place && try_bf16_form(m, eng, post, (pack_format)format, false) == RF_OK)
            return RF_OK;
        if (try_bf16_form(m, eng, post, (pack_format)format, true) == RF_OK)
            return RF_OK;
    }
    return RF_E_UNSUPPORTED;
}

/* Creates the primitive, strided if possible, else over packed operands; with
 * the post-ops `post` (NULL: none). */
static rf_status make_primitive(rfi_cpu_matmul *m, dnnl_engine_t eng, const rfi_dnnl_post *post)
{
    if (rfi_dot_bf16(m->node))
        return make_bf16_primitive(m, eng, post);
    rfi_dnnl_tensor dst = {3, {m->batch, m->m, m->n}, {m->m * m->n, m->n, 1}};
    m->pack = false;
    if (m->lhs.collapsible && m->rhs.collapsible) {
        rfi_dnnl_tensor src, wei;
        in_place_tensors(m, &src, &wei);
        rf_status st = rfi_dnnl_mm_init(&m->mm, eng, &src, &wei, &dst, post, "dot_general");
        if (st == RF_OK && !m->mm.is_ref)
            return RF_OK;
        rfi_dnnl_mm_destroy(&m->mm); /* a strided form oneDNN does not take well: pack */
    }
    m->pad_lhs = m->pad_rhs = false;
    m->pack = true;
    rfi_dnnl_tensor src = view_tensor(&m->lhs, true), wei = view_tensor(&m->rhs, true);
    rf_status st = rfi_dnnl_mm_init(&m->mm, eng, &src, &wei, &dst, post, "dot_general");
    if (st == RF_OK && post && m->mm.is_ref) {
        rfi_dnnl_mm_destroy(&m->mm);
        return RF_E_UNSUPPORTED;
    }
    return st;
}

/* The epilogue's faithful leading ops as post-ops if the primitive takes
 * them (a bias only along the result's last dim, which must be the whole of
 * N), else without. */
static rf_status make_fused_primitive(rfi_cpu_matmul *m, const rfi_node *n,
                                      const rfi_epi_op *epi, int n_epi, dnnl_engine_t eng)
{
    rfi_dnnl_tensor dst = {3, {m->batch, m->m, m->n}, {m->m * m->n, m->n, 1}};
    int bias_dim = n->rank >= 1 && n->dims[n->rank - 1] == m->n ? 2 : -1;
    int take = rfi_dnnl_post_faithful(epi, n_epi);
    for (int k = 0; k < take; k++)
        if (epi[k].kind == RFI_EPI_BIAS && epi[k].axis != n->rank - 1)
            bias_dim = -1;
    /* a leading bias as the bias input, the rest as post-ops */
    if (take > 0 && epi[0].kind == RFI_EPI_BIAS && bias_dim == 2 &&
        rfi_dnnl_post_make(&m->post, epi + 1, take - 1, &dst, bias_dim)) {
        m->post.bias_input = true;
        m->post.bias = (rfi_dnnl_tensor){3, {1, 1, m->n}, {m->n, m->n, 1}};
        if (make_primitive(m, eng, &m->post) == RF_OK)
            return RF_OK;
    }
    if (take > 0 && rfi_dnnl_post_make(&m->post, epi, take, &dst, bias_dim) &&
        make_primitive(m, eng, &m->post) == RF_OK)
        return RF_OK;
    memset(&m->post, 0, sizeof m->post);
    return make_primitive(m, eng, NULL);
}

rf_status rfi_cpu_matmul_prepare(const rfi_node *n, const rfi_epi_op *epi, int n_epi,
                                 dnnl_engine_t eng, rfi_cpu_matmul **out, size_t *workspace_bytes)
{
    *out = NULL;
    *workspace_bytes = 0;
    if (n->op != RFI_OP_DOT_GENERAL || n->n_in != 2 || n->dtype != RF_F32 ||
        n->in[0]->dtype != RF_F32 || n->in[1]->dtype != RF_F32)
        return RF_E_UNSUPPORTED;
    rfi_cpu_matmul *m = rfi_calloc(1, sizeof *m);
    if (!m)
        return rfi_error(RF_E_NOMEM, "cpu: dot_general: out of memory");
    m->node = n;
    make_views(m, n);
    m->batch = m->lhs.size[0];
    m->m = m->lhs.size[1];
    m->k = m->lhs.size[2];
    m->n = m->rhs.size[2];
    if (m->batch * m->m * m->n == 0 || m->k == 0) {
        *out = m; /* nothing to multiply: run writes zeros (or nothing) */
        return RF_OK;
    }
    rf_status st = make_fused_primitive(m, n, epi, n_epi, eng);
    if (st != RF_OK) {
        rfi_cpu_matmul_free(m);
        return st;
    }
    size_t ws = rfi_ws_align(m->mm.scratch_bytes);
    size_t value = m->format == PACK_BF16 ? sizeof(uint16_t) : sizeof(float);
    m->lhs_at = ws;
    ws += operand_bytes(m, true, value);
    m->rhs_at = ws;
    ws += operand_bytes(m, false, value);
    *workspace_bytes = ws;
    *out = m;
    return RF_OK;
}

rf_status rfi_cpu_matmul_run(rfi_cpu_matmul *m, dnnl_stream_t s, const void *lhs,
                             const void *rhs, void *out, const void *const *epi_src,
                             void *workspace)
{
    if (m->batch * m->m * m->n == 0)
        return RF_OK;
    if (m->k == 0) {
        memset(out, 0, (size_t)(m->batch * m->m * m->n) * sizeof(float));
        return RF_OK;
    }
    const float *a = lhs, *b = rhs;
    /* a matmul that packs, pads and converts nothing may have no workspace */
    void *ca = workspace ? (char *)workspace + m->lhs_at : NULL;
    void *cb = workspace ? (char *)workspace + m->rhs_at : NULL;
    if (m->pack) {
        pack_view(ca, a, &m->lhs, m->format, m->mm.bf16_isa);
        pack_view(cb, b, &m->rhs, m->format, m->mm.bf16_isa);
    } else {
        if (m->pad_lhs)
            copy_padded_lhs(ca, a, m);
        else if (m->convert)
            convert_operand(ca, a, rfi_node_numel(m->node->in[0]), m->format, m->mm.bf16_isa);
        if (m->pad_rhs)
            copy_padded_rhs(cb, b, m);
        else if (m->convert)
            convert_operand(cb, b, rfi_node_numel(m->node->in[1]), m->format, m->mm.bf16_isa);
    }
    if (m->pack || m->pad_lhs || m->convert)
        a = ca;
    if (m->pack || m->pad_rhs || m->convert)
        b = cb;
    bool operands = m->post.n > 0 || m->post.bias_input;
    return rfi_dnnl_mm_run(&m->mm, s, a, b, out, workspace, operands ? epi_src : NULL,
                           "dot_general");
}

int rfi_cpu_matmul_epilogue_ops(const rfi_cpu_matmul *m)
{
    return m ? m->post.n + m->post.bias_input : 0;
}

bool rfi_cpu_matmul_bias_input(const rfi_cpu_matmul *m) { return m && m->post.bias_input; }

const char *rfi_cpu_matmul_path(const rfi_cpu_matmul *m)
{
    static const char *const paths[3][5] = {
        [PACK_F32] = {"matmul", "matmul packed", "matmul padded lhs", "matmul padded rhs",
                      "matmul padded lhs and rhs"},
        [PACK_ROUNDED] = {"matmul bf16-rounded", "matmul bf16-rounded packed",
                          "matmul bf16-rounded padded lhs", "matmul bf16-rounded padded rhs",
                          "matmul bf16-rounded padded lhs and rhs"},
        [PACK_BF16] = {"matmul bf16", "matmul bf16 packed", "matmul bf16 padded lhs",
                       "matmul bf16 padded rhs", "matmul bf16 padded lhs and rhs"},
    };
    int form = m->pack                    ? 1
               : m->pad_lhs && m->pad_rhs ? 4
               : m->pad_rhs               ? 3
               : m->pad_lhs               ? 2
                                          : 0;
    return paths[m->format][form];
}

void rfi_cpu_matmul_free(rfi_cpu_matmul *m)
{
    if (!m)
        return;
    rfi_dnnl_mm_destroy(&m->mm);
    rfi_free(m);
}
