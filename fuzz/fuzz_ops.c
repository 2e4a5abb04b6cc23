/* fuzz_ops.c: libFuzzer target for the op API, autodiff and the reference
 * interpreter. The input is a little program: each op byte picks an op,
 * operands from the values made so far and its parameters (axes, shapes,
 * permutations, windows, convolution parameters, dtypes: in range or not)
 * from the bytes after it (a dot_general also sets the matmul precision of
 * the products and convolutions after it). The program is traced; when it traces, the
 * gradient of its last f32 value's sum with respect to the f32 argument is
 * traced too, and the whole is compiled on the interpreter and run once.
 * The compiled program then goes through the CPU backend's compiler as far
 * as its C (optimised, planned with blocked layouts, direct convolutions and
 * paired calls, lowered, rendered), without running a C compiler. Every
 * step must succeed or return an error status: never crash, never leak, and
 * never fail inside (RF_E_INTERNAL, RF_E_COMPILE). With RF_FUZZ_COMPILED=1
 * in the environment the programs run on the compiled CPU backend instead,
 * checked against the interpreter on every run (RF_CHECK: a disagreement is
 * RF_E_INTERNAL), a few programs a second (each is compiled by cc); one
 * where the interpreter's value is NaN or infinite is printed, not fatal (a
 * convolution with a non-finite weight near padding: its result depends on
 * the algorithm, a padding position skipped or multiplied as 0 * NaN, in
 * oneDNN as in other libraries).
 * Arrays of sizes are 8 entries long, whatever the rank, so the ops read
 * only what the harness wrote. An outer product of two padded values is
 * millions of elements, legitimately slow to run: values larger than
 * MAX_ELEMENTS are not used. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_backend.h"
#include "fuzz_bytes.h"
#include "backend/kir.h"
#include "backend/plan.h"
#include "reflux.h"
#include "runtime/runtime.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_VALUES 16
#define MAX_ELEMENTS 4096 /* values larger are made but not used */

/* A small integer in [-2, 5]: sizes, axes and offsets, sometimes invalid. */
static int64_t small(bytes *b) { return (int64_t)(next(b) % 8) - 2; }
static void smalls(bytes *b, int64_t v[8])
{
    for (int i = 0; i < 8; i++)
        v[i] = small(b);
}
/* A shape of rank 0-4 with dims 0-3 (at most 81 elements). */
static int shape(bytes *b, int64_t dims[8])
{
    int rank = (int)(next(b) % 5);
    memset(dims, 0, 8 * sizeof *dims);
    for (int i = 0; i < rank; i++)
        dims[i] = next(b) % 4;
    return rank;
}

typedef struct program {
    const uint8_t *data;
    size_t size;
} program;

typedef rf_tensor *(*unary_fn)(rf_tensor *);
typedef rf_tensor *(*binary_fn)(rf_tensor *, rf_tensor *);

static const unary_fn unaries[] = {
    rf_neg,     rf_abs,      rf_sign,       rf_exp,      rf_expm1,     rf_log,
    rf_log1p,   rf_sqrt,     rf_rsqrt,      rf_tanh,     rf_logistic,  rf_sin,
    rf_cos,     rf_floor,    rf_ceil,       rf_round,    rf_is_finite, rf_not,
    rf_relu,    rf_gelu,     rf_swish,      rf_softplus, rf_flatten,   rf_stop_gradient,
    rf_sum_all, rf_mean_all, rf_zeros_like, rf_ones_like,
};
static const binary_fn binaries[] = {rf_add, rf_sub, rf_mul, rf_div, rf_pow, rf_max,
                                     rf_min, rf_rem, rf_and, rf_or,  rf_matmul};

/* One op on the values v[0..*n); the result (possibly NULL) is pushed. */
static void one_op(rf_trace *t, bytes *b, rf_tensor **v, int *n)
{
    rf_tensor *x = v[next(b) % *n], *y = v[next(b) % *n], *z = v[next(b) % *n], *r = NULL;
    int64_t d[8], e[8], f[8], g[8];
    int rank, k;
    int64_t n_classes;
    rf_reduce_kind kind;
    rf_conv_params cp;
    unsigned precision;
    unsigned op = next(b) % 30;
    switch (op) {
    case 0: r = unaries[next(b) % (sizeof unaries / sizeof *unaries)](x); break;
    case 1: r = binaries[next(b) % (sizeof binaries / sizeof *binaries)](x, y); break;
    case 2: r = rf_compare(x, y, (rf_cmp)(next(b) % (RF_CMP_COUNT + 1))); break;
    case 3: r = rf_select(x, y, z); break;
    case 4: r = rf_convert(x, (rf_dtype)(next(b) % (RF_DTYPE_COUNT + 1))); break;
    case 5: rank = shape(b, d), smalls(b, e), r = rf_broadcast_in_dim(x, d, rank, e); break;
    case 6: rank = shape(b, d), r = rf_reshape(x, d, rank); break;
    case 7: smalls(b, d), r = rf_transpose(x, d); break;
    case 8:
        smalls(b, d), smalls(b, e), smalls(b, f);
        r = rf_slice(x, d, e, next(b) & 1 ? f : NULL);
        break;
    case 9:
        k = 1 + (int)(next(b) % 3);
        r = rf_concatenate((rf_tensor *[]){x, y, z}, k, (int)small(b));
        break;
    case 10:
        smalls(b, d), smalls(b, e), smalls(b, f);
        r = rf_pad(x, y, d, e, next(b) & 1 ? f : NULL);
        break;
    case 11: smalls(b, d), r = rf_reverse(x, d, (int)(next(b) % 4)); break;
    case 12:
        r = next(b) & 1 ? rf_squeeze(x, (int)small(b)) : rf_unsqueeze(x, (int)small(b));
        break;
    case 13:
        smalls(b, d);
        kind = (rf_reduce_kind)(next(b) % (RF_REDUCE_KIND_COUNT + 1));
        k = (int)(next(b) % 4);
        r = rf_reduce(x, kind, d, k, next(b) & 1);
        break;
    case 14: smalls(b, d), k = (int)(next(b) % 3), r = rf_mean(x, d, k, next(b) & 1); break;
    case 15: smalls(b, d), k = (int)(next(b) % 3), r = rf_var(x, d, k, next(b) & 1); break;
    case 16: r = next(b) & 1 ? rf_argmax(x, (int)small(b)) : rf_argmin(x, (int)small(b)); break;
    case 17:
        smalls(b, d), smalls(b, e), smalls(b, f), smalls(b, g);
        k = (int)(next(b) % 3);
        /* from here on, products and convolutions at f32 or bf16, or (rarely) an
         * invalid precision */
        precision = next(b) % 8;
        rf_trace_set_matmul_precision(t, precision < 4 ? RF_PRECISION_F32
                                         : precision < 7 ? RF_PRECISION_BF16
                                                         : (rf_precision)5);
        r = rf_dot_general(x, y, d, e, k, f, g, (int)(next(b) % 3));
        break;
    case 18:
        cp = rf_conv_params_default(1 + (int)(next(b) % 3));
        for (int i = 0; i < 3; i++) {
            cp.stride[i] = small(b), cp.pad_lo[i] = small(b), cp.pad_hi[i] = small(b);
            cp.lhs_dilation[i] = small(b), cp.rhs_dilation[i] = small(b);
        }
        cp.feature_group_count = small(b), cp.batch_group_count = small(b);
        r = rf_conv(x, y, next(b) & 1 ? &cp : NULL);
        break;
    case 19:
        smalls(b, d), smalls(b, e), smalls(b, f), smalls(b, g);
        r = rf_reduce_window(x, (rf_reduce_kind)(next(b) % RF_REDUCE_KIND_COUNT), d, e, f, g);
        break;
    case 20:
        smalls(b, d), smalls(b, e), smalls(b, f);
        r = next(b) & 1 ? rf_maxpool2d(x, d, e, next(b) & 1 ? f : NULL)
                        : rf_meanpool2d(x, d, e, next(b) & 1 ? f : NULL);
        break;
    case 21:
        smalls(b, d), smalls(b, e), smalls(b, f), smalls(b, g);
        r = rf_select_and_scatter(x, y, d, e, f, g);
        break;
    case 22: r = rf_gather(x, y, (int)small(b)); break;
    case 23: r = rf_scatter_add(x, y, z, (int)small(b)); break;
    case 24: r = rf_take_along(x, y); break;
    case 25:
        n_classes = small(b);
        r = rf_onehot(x, n_classes, (rf_dtype)(next(b) % RF_DTYPE_COUNT));
        break;
    case 26: {
        int axis = (int)small(b);
        unsigned which = next(b) % 3;
        r = which == 0   ? rf_softmax(x, axis)
            : which == 1 ? rf_logsoftmax(x, axis)
                         : rf_logsumexp(x, axis, next(b) & 1);
        break;
    }
    case 27:
        rank = shape(b, d);
        r = rf_iota(t, (rf_dtype)(next(b) % RF_DTYPE_COUNT), d, rank, (int)small(b));
        break;
    case 28:
        rank = shape(b, d);
        r = rf_full(t, (rf_dtype)(next(b) % RF_DTYPE_COUNT), d, rank, (double)small(b));
        break;
    default: r = rf_clamp(x, y, z); break;
    }
    if (r && rf_tensor_numel(r) > MAX_ELEMENTS)
        return; /* kept out of the program (dead code), so runs stay fast */
    if (*n < MAX_VALUES)
        v[(*n)++] = r;
    else
        v[next(b) % MAX_VALUES] = r;
}

static void trace_program(rf_trace *t, void *ctx)
{
    const program *p = ctx;
    bytes b = {p->data, p->size, 0};
    rf_tensor *v[MAX_VALUES] = {rf_arg(t, 0), rf_arg(t, 1), rf_arg(t, 2), rf_scalar(t, 0.5)};
    int n = 4;
    for (int ops = 0; ops < 12 && b.at < b.n; ops++)
        one_op(t, &b, v, &n);
    rf_tensor *last = v[n - 1];
    if (!last)
        last = rf_sum_all(v[0]); /* an op failed: the trace has its error already */
    rf_return(t, last);
    if (rf_trace_status(t) == RF_OK && rf_tensor_dtype(last) == RF_F32) {
        rf_tensor *grad = NULL;
        if (rf_grad(t, rf_sum_all(last), &v[0], 1, &grad) == RF_OK)
            rf_return(t, grad);
    }
}

/* The CPU backend's pipeline on prog, up to the generated C. */
static rf_status render(const rfi_graph *prog)
{
    rfi_graph *opt = NULL;
    rf_status st = rfi_cpu_backend.optimise(prog, &opt);
    if (st != RF_OK)
        return st;
    rfi_plan_opts o = rfi_plan_opts_default();
    o.conv_transposed_views = o.blocked_activations = o.direct_convs = true;
    o.concurrent_calls = true;
    rfi_plan *plan = NULL;
    rfi_kir_module *km = NULL;
    char *source = NULL;
    st = rfi_plan_build(opt, &o, &plan);
    if (st == RF_OK)
        st = rfi_kir_lower(plan, &km);
    if (st == RF_OK)
        st = rfi_render_c(km, &source);
    rfi_free(source);
    rfi_kir_free(km);
    rfi_plan_free(plan);
    rfi_graph_free(opt);
    return st;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static rf_array *args[3];
    static bool compiled;
    if (!args[0]) {
        compiled = fuzz_use_backend("1");
        const float x[24] = {0.5f, -1, 2, 0, 3, -0.25f, 1, 1, -2, 4, 0.125f, -3,
                             2, 2, -1, 0, 1, 5, -4, 0.75f, 1, -1, 3, 2};
        const int32_t idx[3] = {2, -1, 0};
        const uint8_t mask[8] = {1, 0, 0, 1, 1, 1, 0, 1};
        rf_device *cpu = rf_device_cpu();
        args[0] = rf_array_new(cpu, RF_F32, RF_SHAPE(2, 3, 4), x);
        args[1] = rf_array_new(cpu, RF_I32, RF_SHAPE(3), idx);
        args[2] = rf_array_new(cpu, RF_BOOL, RF_SHAPE(2, 1, 4), mask);
        if (!args[0] || !args[1] || !args[2])
            abort();
    }
    program p = {data, size};
    rf_exec *e = NULL;
    rf_status st = rf_compile(trace_program, &p, args, 3, &e);
    if (st == RF_OK) {
        rf_array *outs[2] = {NULL, NULL};
        int n_out = rf_exec_n_outputs(e);
        if (n_out <= 2)
            st = rf_exec_run(e, args, 3, outs, n_out);
        rf_array_free(outs[0]);
        rf_array_free(outs[1]);
        if (!compiled && st == RF_OK)
            st = render(e->prog);
        rf_exec_free(e);
    }
    bool internal = st == RF_E_INTERNAL && !fuzz_non_finite_disagreement(st, "fuzz_ops");
    if (internal || st == RF_E_COMPILE) {
        fprintf(stderr, "fuzz_ops: %s: %s\n", rf_status_str(st), rf_errmsg());
        abort();
    }
    return 0;
}
