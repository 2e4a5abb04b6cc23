/* test_grad_fd.c: the reverse-mode gradient of every differentiable op,
 * checked against central finite differences in float64.
 *
 * For an op f with float inputs x_k and a random cotangent w shaped like
 * f(x), L = sum(f(x) * w). One program returns L and rf_grad(L, x_k) for
 * every float input; a second returns L alone and is rerun with each input
 * element moved by +-eps (rf_array_write on the CPU argument) to form
 * (L(x + eps e_i) - L(x - eps e_i)) / (2 eps). Inputs are drawn away from
 * kinks and ties (abs, max, relu, floor, ...). One line per case reports the
 * largest error.
 *
 * It deliberately uses the public API only, and small shapes so that the
 * two runs per input element stay cheap.
 */
#include "test_prog.h"

#define N_OF(a) ((int)(sizeof(a) / sizeof((a)[0])))
#define DIMS(...) ((const int64_t[]){__VA_ARGS__})
#define VALS(...) ((const double[]){__VA_ARGS__})

static const double FD_EPS = 1e-6;
static const double FD_TOL = 2e-6; /* |ad - fd| <= FD_TOL * max(1, |fd|) */

/* One input of a case: f64 random in [lo, hi) (sym: random sign), or fixed
 * values; integer/bool inputs (indices, predicates) and nodiff inputs get no
 * gradient. */
typedef struct gin {
    rf_dtype dt;
    int rank;
    int64_t d[4];
    double lo, hi;
    bool sym;
    const double *vals;
    bool nodiff;
} gin;

typedef struct gcase gcase;
typedef rf_tensor *(*gfn)(rf_tensor *const *x, const gcase *c);
struct gcase {
    const char *name;
    gfn f;
    int nin;
    gin in[4];
    rf_conv_params conv;
};

static bool differentiable(const gin *g)
{
    return (g->dt == RF_F64 || g->dt == RF_F32) && !g->nodiff;
}

/* ---- The functions under test ---------------------------------------------------- */

#define GF(name, expr)                                            \
    static rf_tensor *name(rf_tensor *const *x, const gcase *c)  \
    {                                                             \
        (void)c;                                                  \
        return (expr);                                            \
    }

GF(f_neg, rf_neg(x[0]))
GF(f_abs, rf_abs(x[0]))
GF(f_sign, rf_sign(x[0]))
GF(f_exp, rf_exp(x[0]))
GF(f_expm1, rf_expm1(x[0]))
GF(f_log, rf_log(x[0]))
GF(f_log1p, rf_log1p(x[0]))
GF(f_sqrt, rf_sqrt(x[0]))
GF(f_rsqrt, rf_rsqrt(x[0]))
GF(f_tanh, rf_tanh(x[0]))
GF(f_logistic, rf_logistic(x[0]))
GF(f_sin, rf_sin(x[0]))
GF(f_cos, rf_cos(x[0]))
GF(f_floor, rf_floor(x[0]))
GF(f_ceil, rf_ceil(x[0]))
GF(f_round, rf_round(x[0]))
GF(f_add, rf_add(x[0], x[1]))
GF(f_sub, rf_sub(x[0], x[1]))
GF(f_mul, rf_mul(x[0], x[1]))
GF(f_div, rf_div(x[0], x[1]))
GF(f_pow, rf_pow(x[0], x[1]))
GF(f_max, rf_max(x[0], x[1]))
GF(f_min, rf_min(x[0], x[1]))
GF(f_rem, rf_rem(x[0], x[1]))
GF(f_scalar_ops, rf_div_s(rf_sub_s(rf_mul_s(rf_add_s(rf_pow_s(x[0], 3), 1), 2), 0.5), 4))
GF(f_select, rf_select(x[0], x[1], x[2]))
GF(f_clamp, rf_clamp(x[0], x[1], x[2]))
GF(f_bcast_in_dim, rf_broadcast_in_dim(x[0], RF_SHAPE(2, 3, 4), DIMS(1)))
GF(f_bcast_in_dim1, rf_broadcast_in_dim(x[0], RF_SHAPE(2, 3), DIMS(0, 1)))
GF(f_bcast_to, rf_broadcast_to(x[0], RF_SHAPE(2, 3, 1)))
GF(f_reshape, rf_reshape(x[0], RF_SHAPE(3, 2)))
GF(f_transpose, rf_transpose(x[0], DIMS(2, 0, 1)))
GF(f_slice, rf_slice(x[0], DIMS(1, 0), DIMS(4, 5), DIMS(2, 2)))
GF(f_slice2, rf_slice(x[0], DIMS(0, 1), DIMS(3, 5), DIMS(1, 3)))
GF(f_concat, rf_concatenate(x, 3, 1))
GF(f_pad, rf_pad(x[0], x[1], DIMS(1, -1), DIMS(0, 2), DIMS(1, 0)))
GF(f_pad2, rf_pad(x[0], x[1], DIMS(-1, 2), DIMS(1, -1), DIMS(0, 1)))
GF(f_reverse, rf_reverse(x[0], DIMS(0, 1), 2))
GF(f_reverse1, rf_reverse(x[0], DIMS(1), 1))
GF(f_sum, rf_sum(x[0], DIMS(0, 2), 2, false))
GF(f_sum_keep, rf_sum(x[0], DIMS(1), 1, true))
GF(f_rmax, rf_reduce(x[0], RF_REDUCE_MAX, DIMS(1), 1, false))
GF(f_rmin, rf_reduce(x[0], RF_REDUCE_MIN, NULL, 0, false))
GF(f_rprod, rf_reduce(x[0], RF_REDUCE_PROD, DIMS(1), 1, false))
GF(f_rprod_all, rf_reduce(x[0], RF_REDUCE_PROD, NULL, 0, false))
GF(f_mean, rf_mean(x[0], DIMS(-1), 1, false))
GF(f_var, rf_var(x[0], DIMS(1), 1, true))
GF(f_dot_batch, rf_dot_general(x[0], x[1], DIMS(0), DIMS(0), 1, DIMS(2), DIMS(1), 1))
GF(f_dot_t, rf_dot_general(x[0], x[1], NULL, NULL, 0, DIMS(0), DIMS(0), 1))
GF(f_dot_swapped, rf_dot_general(x[0], x[1], DIMS(0), DIMS(0), 1, DIMS(1), DIMS(2), 1))
GF(f_conv, rf_conv(x[0], x[1], &c->conv))
GF(f_rw_sum, rf_reduce_window(x[0], RF_REDUCE_SUM, DIMS(1, 1, 2, 3), DIMS(1, 1, 2, 1),
                              DIMS(0, 0, 1, 0), DIMS(0, 0, 0, 1)))
GF(f_rw_max, rf_reduce_window(x[0], RF_REDUCE_MAX, DIMS(1, 1, 3, 3), DIMS(1, 1, 2, 2),
                              DIMS(0, 0, 1, 1), DIMS(0, 0, 1, 1)))
GF(f_rw_max_overlap, rf_reduce_window(x[0], RF_REDUCE_MAX, DIMS(2, 3), DIMS(1, 1), DIMS(0, 0),
                                      DIMS(0, 0)))
GF(f_rw_min, rf_reduce_window(x[0], RF_REDUCE_MIN, DIMS(3), DIMS(2), DIMS(1), DIMS(1)))
GF(f_maxpool, rf_maxpool2d(x[0], DIMS(2, 2), DIMS(2, 2), NULL))
GF(f_maxpool_pad, rf_maxpool2d(x[0], DIMS(3, 3), DIMS(2, 2), DIMS(1, 1)))
GF(f_maxpool_s1, rf_maxpool2d(x[0], DIMS(3, 3), DIMS(1, 1), DIMS(1, 1)))
GF(f_meanpool, rf_meanpool2d(x[0], DIMS(2, 2), DIMS(1, 2), NULL))
GF(f_sel_scatter, rf_select_and_scatter(x[0], x[1], DIMS(1, 1, 2, 2), DIMS(1, 1, 1, 2),
                                        DIMS(0, 0, 1, 0), DIMS(0, 0, 0, 1)))
GF(f_sas_pad1, rf_select_and_scatter(x[0], x[1], DIMS(2), DIMS(1), DIMS(1), DIMS(0)))
GF(f_sas_w3, rf_select_and_scatter(x[0], x[1], DIMS(3), DIMS(1), DIMS(0), DIMS(0)))
GF(f_gather0, rf_gather(x[0], x[1], 0))
GF(f_gather1, rf_gather(x[0], x[1], 1))
GF(f_scatter0, rf_scatter_add(x[0], x[1], x[2], 0))
GF(f_scatter1, rf_scatter_add(x[0], x[1], x[2], 1))
GF(f_take_along, rf_take_along(x[0], x[1]))
GF(f_softmax1, rf_softmax(x[0], 1))
GF(f_softmax0, rf_softmax(x[0], 0))
GF(f_logsoftmax, rf_logsoftmax(x[0], -1))
GF(f_logsumexp, rf_logsumexp(x[0], 1, false))
GF(f_logsumexp_k, rf_logsumexp(x[0], 0, true))
/* Attention's softmax: scaled scores [B, H, T, T] plus a causal additive mask over the
 * last axis. The backend recomputes the masked scores in the row max and in the exp. */
static rf_tensor *f_attn_softmax(rf_tensor *const *x, const gcase *c)
{
    (void)c;
    rf_trace *t = rf_tensor_trace(x[0]);
    int64_t n = rf_tensor_dim(x[0], 3);
    rf_tensor *ri = rf_iota(t, RF_I32, DIMS(n, n), 2, 0);
    rf_tensor *ci = rf_iota(t, RF_I32, DIMS(n, n), 2, 1);
    rf_tensor *neg = rf_full(t, RF_F64, DIMS(n, n), 2, -1e9);
    rf_tensor *mask = rf_select(rf_compare(ci, ri, RF_LE), rf_zeros_like(neg), neg);
    return rf_softmax(rf_add(rf_mul_s(x[0], 0.5), mask), -1);
}
/* Softmaxes written by hand: over two axes at once (autodiff differentiates it as one, from
 * its result), and a square x's exp over the sums of its columns' indices' rows, e[i,j] /
 * sum_k e[j,k]: no softmax, though every shape matches one (the op-by-op rules apply). */
static rf_tensor *f_softmax_2axes(rf_tensor *const *x, const gcase *c)
{
    (void)c;
    rf_tensor *e = rf_exp(x[0]);
    return rf_div(e, rf_sum(e, DIMS(1, 2), 2, true));
}
static rf_tensor *f_not_softmax(rf_tensor *const *x, const gcase *c)
{
    (void)c;
    rf_tensor *e = rf_exp(x[0]);
    int64_t n = rf_tensor_dim(x[0], 0);
    return rf_div(e, rf_reshape(rf_sum(e, DIMS(1), 1, false), DIMS(1, n), 2));
}
GF(f_logsoftmax_mid, rf_logsoftmax(x[0], 1))
GF(f_gelu, rf_gelu(x[0]))
GF(f_softplus, rf_softplus(x[0]))
GF(f_elu, rf_elu(x[0], 0.7))
GF(f_relu, rf_relu(x[0]))
GF(f_leakyrelu, rf_leakyrelu(x[0], 0.1))
GF(f_swish, rf_swish(x[0]))
GF(f_sigmoid, rf_sigmoid(x[0]))
GF(f_matmul, rf_matmul(x[0], x[1]))
GF(f_linear, rf_linear(x[0], x[1], x[2]))
GF(f_linear_nob, rf_linear(x[0], x[1], NULL))
GF(f_chain, rf_mul(rf_tanh(rf_matmul(x[0], x[1])), rf_exp(rf_neg(rf_matmul(x[0], x[1])))))
GF(f_reuse, rf_add(rf_mul(x[0], x[0]), rf_sin(x[0])))
/* Split-and-use: slices that tile (or partly tile) their operand, whose
 * cotangents autodiff joins into one concatenation. COLS(x, a, b): columns
 * [a, b) of a rank-2 x with 2 rows. */
#define COLS(x, a, b) rf_slice(x, DIMS(0, a), DIMS(2, b), NULL)
GF(f_split_gates, rf_add(rf_mul(rf_sigmoid(COLS(x[0], 0, 3)), rf_tanh(COLS(x[0], 3, 6))),
                         rf_mul(COLS(x[0], 6, 9), COLS(x[0], 6, 9))))
GF(f_split_gaps, rf_mul(rf_exp(COLS(x[0], 5, 7)), COLS(x[0], 1, 3)))
GF(f_split_overlap, rf_mul(COLS(x[0], 0, 3), rf_sin(COLS(x[0], 2, 5))))
/* thirds along the middle axis of [2, 6, 3] */
#define MID(x, a) rf_slice(x, DIMS(0, a, 0), DIMS(2, (a) + 2, 3), NULL)
GF(f_split_mid, rf_add(rf_mul(rf_tanh(MID(x[0], 0)), MID(x[0], 2)), rf_sigmoid(MID(x[0], 4))))
/* halves of [4, 3] along axis 0, and x itself through a reshape */
GF(f_split_rows, rf_add(rf_mul(rf_slice(x[0], DIMS(0, 0), DIMS(2, 3), NULL),
                               rf_slice(x[0], DIMS(2, 0), DIMS(4, 3), NULL)),
                        rf_slice(rf_reshape(x[0], RF_SHAPE(2, 6)), DIMS(0, 1), DIMS(2, 4), NULL)))

/* ---- Inputs ---------------------------------------------------------------------- */

#define F64_IN(r, lo_, hi_, ...) {.dt = RF_F64, .rank = r, .d = {__VA_ARGS__}, .lo = lo_, .hi = hi_}
#define F64_SYM(r, lo_, hi_, ...) \
    {.dt = RF_F64, .rank = r, .d = {__VA_ARGS__}, .lo = lo_, .hi = hi_, .sym = true}
#define FIXED(dt_, r, vals_, ...) {.dt = dt_, .rank = r, .d = {__VA_ARGS__}, .vals = vals_}
#define U23(lo, hi) F64_IN(2, lo, hi, 2, 3)

#define UNARY(nm, fn, lo, hi) {nm, fn, 1, {U23(lo, hi)}, {0}}
#define UNARY_SYM(nm, fn, lo, hi) {nm, fn, 1, {F64_SYM(2, lo, hi, 2, 3)}, {0}}

static const gcase CASES[] = {
    UNARY("neg", f_neg, -2, 2),
    UNARY_SYM("abs", f_abs, 0.3, 2),
    UNARY_SYM("sign (zero)", f_sign, 0.3, 2),
    UNARY("exp", f_exp, -2, 2),
    UNARY("expm1", f_expm1, -2, 2),
    UNARY("log", f_log, 0.3, 3),
    UNARY("log1p", f_log1p, -0.5, 2),
    UNARY("sqrt", f_sqrt, 0.3, 3),
    UNARY("rsqrt", f_rsqrt, 0.3, 3),
    UNARY("tanh", f_tanh, -2, 2),
    UNARY("logistic", f_logistic, -3, 3),
    UNARY("sin", f_sin, -3, 3),
    UNARY("cos", f_cos, -3, 3),
    UNARY("floor (zero)", f_floor, -3, 3),
    UNARY("ceil (zero)", f_ceil, -3, 3),
    UNARY("round (zero)", f_round, -3, 3),
    {"add", f_add, 2, {U23(-2, 2), U23(-2, 2)}, {0}},
    {"sub", f_sub, 2, {U23(-2, 2), U23(-2, 2)}, {0}},
    {"mul", f_mul, 2, {U23(-2, 2), U23(-2, 2)}, {0}},
    {"div", f_div, 2, {U23(-2, 2), F64_SYM(2, 0.5, 2, 2, 3)}, {0}},
    {"pow (both)", f_pow, 2, {U23(0.5, 2.5), U23(-2, 2)}, {0}},
    /* x^0 = 1 everywhere: d/dx is 0 at x = 0 too (not 0 * 0^-1 = NaN); the exponent's
     * own derivative at 0^0 has no finite difference, so only x is checked */
    {"pow at x = 0, exponents 0 1 2 3", f_pow, 2,
     {FIXED(RF_F64, 1, VALS(0, -0.0, 0, 0, 2, -3), 6),
      {.dt = RF_F64, .rank = 1, .d = {6}, .vals = VALS(0, 0, 1, 2, 0, 3), .nodiff = true}},
     {0}},
    {"max", f_max, 2, {U23(-2, 2), U23(-2, 2)}, {0}},
    {"min", f_min, 2, {U23(-2, 2), U23(-2, 2)}, {0}},
    {"rem", f_rem, 2, {U23(-4, 4), F64_SYM(2, 0.7, 1.6, 2, 3)}, {0}},
    {"add broadcast [2,3]+[3]", f_add, 2, {U23(-2, 2), F64_IN(1, -2, 2, 3)}, {0}},
    {"sub broadcast [3]-[2,3]", f_sub, 2, {F64_IN(1, -2, 2, 3), U23(-2, 2)}, {0}},
    {"mul broadcast [2,1]*[1,3]", f_mul, 2, {F64_IN(2, -2, 2, 2, 1), F64_IN(2, -2, 2, 1, 3)},
     {0}},
    {"div broadcast [2,3]/[]", f_div, 2, {U23(-2, 2), F64_IN(0, 0.5, 2, 0)}, {0}},
    {"pow broadcast [4,1,3]^[2,1]", f_pow, 2,
     {F64_IN(3, 0.5, 2, 4, 1, 3), F64_IN(2, -1.5, 1.5, 2, 1)}, {0}},
    {"max broadcast [2,3] vs []", f_max, 2, {U23(-2, 2), F64_IN(0, -0.1, 0.1, 0)}, {0}},
    {"scalar ops (weak)", f_scalar_ops, 1, {U23(-2, 2)}, {0}},
    {"select (a and b)", f_select, 3,
     {FIXED(RF_BOOL, 2, VALS(1, 0, 0, 1, 1, 0), 2, 3), U23(-2, 2), U23(-2, 2)}, {0}},
    {"select broadcast pred [3], b []", f_select, 3,
     {FIXED(RF_BOOL, 1, VALS(0, 1, 1), 3), U23(-2, 2), F64_IN(0, -2, 2, 0)}, {0}},
    {"clamp (lo, x, hi scalars)", f_clamp, 3,
     {FIXED(RF_F64, 2, VALS(-1.5, -0.2, 0.3, 0.9, 1.7, -0.8), 2, 3),
      FIXED(RF_F64, 0, VALS(-0.5), 0), FIXED(RF_F64, 0, VALS(1.0), 0)},
     {0}},
    {"clamp (elementwise bounds)", f_clamp, 3,
     {U23(-2, 2), U23(-1, -0.5), U23(0.5, 1)}, {0}},
    {"broadcast_in_dim [3]->[2,3,4]", f_bcast_in_dim, 1, {F64_IN(1, -2, 2, 3)}, {0}},
    {"broadcast_in_dim [1,3]->[2,3]", f_bcast_in_dim1, 1, {F64_IN(2, -2, 2, 1, 3)}, {0}},
    {"broadcast_to [3,1]->[2,3,1]", f_bcast_to, 1, {F64_IN(2, -2, 2, 3, 1)}, {0}},
    {"reshape", f_reshape, 1, {U23(-2, 2)}, {0}},
    {"transpose", f_transpose, 1, {F64_IN(3, -2, 2, 2, 3, 4)}, {0}},
    {"slice strided", f_slice, 1, {F64_IN(2, -2, 2, 4, 5)}, {0}},
    {"slice stride 3", f_slice2, 1, {F64_IN(2, -2, 2, 4, 5)}, {0}},
    {"concatenate", f_concat, 3,
     {F64_IN(2, -2, 2, 2, 1), F64_IN(2, -2, 2, 2, 3), F64_IN(2, -2, 2, 2, 2)}, {0}},
    {"pad (operand and value)", f_pad, 2, {U23(-2, 2), F64_IN(0, -2, 2, 0)}, {0}},
    {"pad (negative, interior)", f_pad2, 2, {F64_IN(2, -2, 2, 3, 4), F64_IN(0, -2, 2, 0)}, {0}},
    {"reverse axes 0,1", f_reverse, 1, {U23(-2, 2)}, {0}},
    {"reverse axis 1", f_reverse1, 1, {F64_IN(3, -2, 2, 2, 3, 2)}, {0}},
    {"reduce sum axes 0,2", f_sum, 1, {F64_IN(3, -2, 2, 2, 3, 4)}, {0}},
    {"reduce sum keepdims", f_sum_keep, 1, {F64_IN(3, -2, 2, 2, 3, 4)}, {0}},
    {"reduce max", f_rmax, 1, {F64_IN(3, -2, 2, 2, 3, 4)}, {0}},
    {"reduce min all", f_rmin, 1, {F64_IN(3, -2, 2, 2, 3, 4)}, {0}},
    {"reduce prod", f_rprod, 1, {F64_SYM(3, 0.5, 1.5, 2, 3, 4)}, {0}},
    {"reduce prod all", f_rprod_all, 1, {F64_SYM(2, 0.5, 1.5, 2, 3)}, {0}},
    {"mean", f_mean, 1, {F64_IN(3, -2, 2, 2, 3, 4)}, {0}},
    {"var", f_var, 1, {F64_IN(3, -2, 2, 2, 3, 4)}, {0}},
    {"dot_general batch", f_dot_batch, 2, {F64_IN(3, -1, 1, 2, 3, 4), F64_IN(3, -1, 1, 2, 4, 5)},
     {0}},
    {"dot_general contract dim 0", f_dot_t, 2, {F64_IN(2, -1, 1, 4, 3), F64_IN(2, -1, 1, 4, 2)},
     {0}},
    {"dot_general batch, swapped", f_dot_swapped, 2,
     {F64_IN(3, -1, 1, 2, 4, 5), F64_IN(3, -1, 1, 2, 3, 4)}, {0}},
    {"conv2d stride 2 pad (non-divisible)", f_conv, 2,
     {F64_IN(4, -1, 1, 2, 3, 5, 6), F64_IN(4, -1, 1, 4, 3, 3, 2)},
     {2, {2, 2}, {1, 0}, {1, 1}, {1, 1}, {1, 1}, 1, 1}},
    {"conv2d rhs dilation 2", f_conv, 2,
     {F64_IN(4, -1, 1, 1, 2, 5, 5), F64_IN(4, -1, 1, 3, 2, 2, 2)},
     {2, {1, 1}, {1, 1}, {1, 1}, {1, 1}, {2, 2}, 1, 1}},
    {"conv2d lhs dilation 2 (transposed)", f_conv, 2,
     {F64_IN(4, -1, 1, 1, 2, 3, 4), F64_IN(4, -1, 1, 2, 2, 3, 3)},
     {2, {1, 1}, {2, 2}, {2, 1}, {2, 2}, {1, 1}, 1, 1}},
    {"conv2d feature groups 2", f_conv, 2,
     {F64_IN(4, -1, 1, 2, 4, 4, 4), F64_IN(4, -1, 1, 6, 2, 3, 3)},
     {2, {1, 1}, {1, 1}, {1, 1}, {1, 1}, {1, 1}, 2, 1}},
    {"conv2d groups 2 stride 2 dil 2", f_conv, 2,
     {F64_IN(4, -1, 1, 1, 4, 6, 5), F64_IN(4, -1, 1, 4, 2, 2, 2)},
     {2, {2, 2}, {1, 0}, {0, 1}, {1, 1}, {2, 1}, 2, 1}},
    {"conv1d stride 2 pad rhs dil 2", f_conv, 2,
     {F64_IN(3, -1, 1, 2, 3, 7), F64_IN(3, -1, 1, 2, 3, 3)},
     {1, {2}, {2}, {1}, {1}, {2}, 1, 1}},
    {"conv1d lhs dil 2 groups 2", f_conv, 2,
     {F64_IN(3, -1, 1, 1, 2, 5), F64_IN(3, -1, 1, 4, 1, 2)},
     {1, {1}, {1}, {1}, {2}, {1}, 2, 1}},
    {"conv1d stride 3 (non-divisible)", f_conv, 2,
     {F64_IN(3, -1, 1, 2, 2, 9), F64_IN(3, -1, 1, 3, 2, 2)},
     {1, {3}, {0}, {0}, {1}, {1}, 1, 1}},
    /* low (high) crops past the dilated input into the high (low) padding */
    {"conv1d lhs dil 2, low crop past the input", f_conv, 2,
     {F64_IN(3, -1, 1, 2, 2, 2), F64_IN(3, -1, 1, 3, 2, 2)},
     {1, {1}, {-4}, {5}, {2}, {1}, 1, 1}},
    {"conv1d lhs dil 2, high crop past the input", f_conv, 2,
     {F64_IN(3, -1, 1, 2, 2, 2), F64_IN(3, -1, 1, 3, 2, 2)},
     {1, {1}, {5}, {-4}, {2}, {1}, 1, 1}},
    {"conv1d lhs dil 3, crop -1 pad 2", f_conv, 2,
     {F64_IN(3, -1, 1, 2, 2, 3), F64_IN(3, -1, 1, 3, 2, 2)},
     {1, {1}, {-1}, {2}, {3}, {1}, 1, 1}},
    {"reduce_window sum (pad)", f_rw_sum, 1, {F64_IN(4, -2, 2, 1, 2, 5, 5)}, {0}},
    {"reduce_window max (pad)", f_rw_max, 1, {F64_IN(4, -2, 2, 1, 2, 5, 5)}, {0}},
    {"reduce_window max overlapping", f_rw_max_overlap, 1, {F64_IN(2, -2, 2, 4, 5)}, {0}},
    {"reduce_window min 1-D", f_rw_min, 1, {F64_IN(1, -2, 2, 7)}, {0}},
    {"maxpool2d", f_maxpool, 1, {F64_IN(4, -2, 2, 2, 2, 4, 5)}, {0}},
    {"maxpool2d pad", f_maxpool_pad, 1, {F64_IN(4, -2, 2, 1, 2, 5, 5)}, {0}},
    {"maxpool2d 3x3 stride 1 pad 1", f_maxpool_s1, 1, {F64_IN(4, -2, 2, 2, 3, 6, 7)}, {0}},
    {"meanpool2d", f_meanpool, 1, {F64_IN(4, -2, 2, 1, 2, 4, 5)}, {0}},
    {"select_and_scatter (x and source)", f_sel_scatter, 2,
     {F64_IN(4, -2, 2, 1, 2, 4, 5), F64_IN(4, -2, 2, 1, 2, 4, 3)}, {0}},
    /* the source's gradient follows the forward selection: padding never (window 0 is
     * [pad, -inf] and takes x0), a NaN above every number (both windows take x1) */
    {"select_and_scatter source, -inf beside padding", f_sas_pad1, 2,
     {{.dt = RF_F64, .rank = 1, .d = {4}, .vals = VALS(-INFINITY, -INFINITY, 1, 2), .nodiff = true},
      F64_IN(1, -2, 2, 4)},
     {0}},
    {"select_and_scatter source, NaN in windows", f_sas_w3, 2,
     {{.dt = RF_F64, .rank = 1, .d = {4}, .vals = VALS(1, NAN, 2, 0), .nodiff = true},
      F64_IN(1, -2, 2, 2)},
     {0}},
    {"conv2d batch groups 2", f_conv, 2,
     {F64_IN(4, -1, 1, 4, 2, 3, 3), F64_IN(4, -1, 1, 4, 2, 2, 2)},
     {2, {1, 1}, {0, 0}, {0, 0}, {1, 1}, {1, 1}, 1, 2}},
    {"gather axis 0 (dup, clamp)", f_gather0, 2,
     {F64_IN(2, -2, 2, 3, 4), FIXED(RF_I32, 1, VALS(2, 0, 2, -1, 7), 5)}, {0}},
    {"gather axis 1 (2-D idx)", f_gather1, 2,
     {F64_IN(2, -2, 2, 3, 4), FIXED(RF_I64, 2, VALS(3, 1, 1, 0), 2, 2)}, {0}},
    {"scatter_add axis 0", f_scatter0, 3,
     {F64_IN(2, -2, 2, 3, 4), FIXED(RF_I32, 1, VALS(2, 0, 2, -1, 7), 5), F64_IN(2, -2, 2, 5, 4)},
     {0}},
    {"scatter_add axis 1", f_scatter1, 3,
     {F64_IN(2, -2, 2, 3, 4), FIXED(RF_I64, 2, VALS(3, 1, 1, 9), 2, 2),
      F64_IN(3, -2, 2, 3, 2, 2)},
     {0}},
    {"take_along", f_take_along, 2,
     {F64_IN(2, -2, 2, 3, 4), FIXED(RF_I32, 1, VALS(1, 3, 3), 3)}, {0}},
    {"softmax axis 1", f_softmax1, 1, {F64_IN(2, -2, 2, 3, 4)}, {0}},
    {"softmax axis 0", f_softmax0, 1, {F64_IN(2, -2, 2, 3, 4)}, {0}},
    {"logsoftmax", f_logsoftmax, 1, {F64_IN(2, -2, 2, 3, 4)}, {0}},
    {"attention softmax, causal mask", f_attn_softmax, 1, {F64_IN(4, -3, 3, 2, 2, 4, 4)}, {0}},
    {"softmax over two axes, by hand", f_softmax_2axes, 1, {F64_IN(3, -2, 2, 2, 3, 4)}, {0}},
    {"exp over transposed row sums", f_not_softmax, 1, {F64_IN(2, -2, 2, 3, 3)}, {0}},
    {"logsoftmax, middle axis", f_logsoftmax_mid, 1, {F64_IN(3, -2, 2, 2, 3, 4)}, {0}},
    {"logsumexp", f_logsumexp, 1, {F64_IN(2, -2, 2, 3, 4)}, {0}},
    {"logsumexp keepdims axis 0", f_logsumexp_k, 1, {F64_IN(2, -2, 2, 3, 4)}, {0}},
    {"gelu", f_gelu, 1, {F64_IN(2, -3, 3, 3, 4)}, {0}},
    {"softplus", f_softplus, 1, {F64_IN(2, -3, 3, 3, 4)}, {0}},
    /* smooth at 0 (its max(x, 0) + log1p(exp(-|x|)) form has kinks that cancel) */
    {"softplus at 0", f_softplus, 1, {FIXED(RF_F64, 1, VALS(0, -0.0, 1e-3, -2, 40), 5)}, {0}},
    {"elu", f_elu, 1, {F64_SYM(2, 0.2, 2, 3, 4)}, {0}},
    {"relu", f_relu, 1, {F64_SYM(2, 0.2, 2, 3, 4)}, {0}},
    {"leakyrelu", f_leakyrelu, 1, {F64_SYM(2, 0.2, 2, 3, 4)}, {0}},
    {"swish", f_swish, 1, {F64_IN(2, -3, 3, 3, 4)}, {0}},
    {"sigmoid", f_sigmoid, 1, {F64_IN(2, -3, 3, 3, 4)}, {0}},
    {"matmul 2-D", f_matmul, 2, {F64_IN(2, -1, 1, 2, 3), F64_IN(2, -1, 1, 3, 4)}, {0}},
    {"matmul 1-D @ 2-D", f_matmul, 2, {F64_IN(1, -1, 1, 3), F64_IN(2, -1, 1, 3, 4)}, {0}},
    {"matmul 2-D @ 1-D", f_matmul, 2, {F64_IN(2, -1, 1, 2, 3), F64_IN(1, -1, 1, 3)}, {0}},
    {"matmul batch broadcast", f_matmul, 2,
     {F64_IN(4, -1, 1, 2, 1, 2, 3), F64_IN(3, -1, 1, 3, 3, 2)}, {0}},
    {"linear", f_linear, 3, {F64_IN(2, -1, 1, 4, 3), F64_IN(2, -1, 1, 2, 3), F64_IN(1, -1, 1, 2)},
     {0}},
    {"linear no bias", f_linear_nob, 2, {F64_IN(2, -1, 1, 4, 3), F64_IN(2, -1, 1, 2, 3)}, {0}},
    {"chain tanh(xw)*exp(-xw)", f_chain, 2, {F64_IN(2, -1, 1, 2, 3), F64_IN(2, -1, 1, 3, 2)},
     {0}},
    {"reused input x*x+sin(x)", f_reuse, 1, {U23(-2, 2)}, {0}},
    {"split into gates [2,9] -> 3 x [2,3]", f_split_gates, 1, {F64_IN(2, -2, 2, 2, 9)}, {0}},
    {"split with gaps [2,8]", f_split_gaps, 1, {F64_IN(2, -2, 2, 2, 8)}, {0}},
    {"split overlapping [2,5]", f_split_overlap, 1, {F64_IN(2, -2, 2, 2, 5)}, {0}},
    {"split middle axis [2,6,3]", f_split_mid, 1, {F64_IN(3, -2, 2, 2, 6, 3)}, {0}},
    {"split rows and reshape [4,3]", f_split_rows, 1, {F64_IN(2, -2, 2, 4, 3)}, {0}},
};

/* ---- The harness ------------------------------------------------------------------- */

typedef struct gctx {
    const gcase *c;
    int mode; /* 0: y; 1: L; 2: L and gradients */
} gctx;

static void build_grad(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n;
    gctx *g = u;
    rf_tensor *y = g->c->f(a, g->c);
    if (g->mode == 0) {
        rf_return(t, y);
        return;
    }
    rf_tensor *loss = rf_sum_all(rf_mul(y, a[g->c->nin]));
    rf_return(t, loss);
    if (g->mode == 1)
        return;
    rf_tensor *wrt[4], *grads[4] = {0};
    int nw = 0;
    for (int i = 0; i < g->c->nin; i++)
        if (differentiable(&g->c->in[i]))
            wrt[nw++] = a[i];
    rf_grad(t, loss, wrt, nw, grads);
    for (int i = 0; i < nw; i++)
        rf_return(t, grads[i]);
}

static rf_array *make_input(const gin *g, uint64_t *rng)
{
    int64_t n = tp_numel(g->d, g->rank);
    double v[512];
    for (int64_t i = 0; i < n && i < 512; i++) {
        if (g->vals)
            v[i] = g->vals[i];
        else
            v[i] = tp_rand(rng, g->lo, g->hi) * (g->sym && tp_rand(rng, 0, 1) < 0.5 ? -1 : 1);
    }
    return tp_dev(g->dt, g->d, g->rank, v);
}

static bool run_loss(rf_exec *e, rf_array *const *args, int nargs, double *loss)
{
    rf_array *o = NULL;
    rf_status st = rf_exec_run(e, args, nargs, &o, 1);
    *loss = st == RF_OK ? tp_scalar(o) : NAN;
    rf_array_free(o);
    return st == RF_OK;
}

/* Finite differences on every element of differentiable input k against the
 * AD gradient `ad`; returns the largest scaled error, reports the worst. */
static double fd_check_input(const gcase *c, int k, rf_exec *eloss, rf_array **args, int nargs,
                             const double *ad, int64_t *worst_i, double *worst_ad,
                             double *worst_fd)
{
    int64_t n = 0;
    double *x = tp_read(args[k], &n), max_err = 0;
    if (!x)
        return INFINITY;
    double *buf = malloc(sizeof(double) * (size_t)n);
    for (int64_t i = 0; buf && i < n; i++) {
        double lp, lm;
        memcpy(buf, x, sizeof(double) * (size_t)n);
        buf[i] = x[i] + FD_EPS;
        rf_array_write(args[k], buf, sizeof(double) * (size_t)n);
        bool ok = run_loss(eloss, args, nargs, &lp);
        buf[i] = x[i] - FD_EPS;
        rf_array_write(args[k], buf, sizeof(double) * (size_t)n);
        ok = run_loss(eloss, args, nargs, &lm) && ok;
        double fd = (lp - lm) / (2 * FD_EPS);
        double err = ok ? fabs(ad[i] - fd) / fmax(1.0, fabs(fd)) : INFINITY;
        if (isnan(err))
            err = INFINITY; /* a NaN must stay the worst, not be replaced by the next error */
        if (err > max_err) {
            max_err = err;
            *worst_i = i, *worst_ad = ad[i], *worst_fd = fd;
        }
    }
    rf_array_write(args[k], x, sizeof(double) * (size_t)n);
    (void)c;
    free(buf);
    free(x);
    return max_err;
}

static void run_case(const gcase *c, uint64_t seed)
{
    uint64_t rng = seed;
    rf_array *args[5] = {0};
    rf_exec *ey = NULL, *el = NULL, *eg = NULL;
    rf_array *outs[5] = {0};
    int nd = 0;
    bool ok = true;
    for (int i = 0; i < c->nin; i++) {
        args[i] = make_input(&c->in[i], &rng);
        ok = ok && args[i];
        nd += differentiable(&c->in[i]);
    }
    gctx gy = {c, 0}, gl = {c, 1}, gg = {c, 2};
    rf_status st = ok ? tp_compile(build_grad, &gy, args, c->nin, &ey) : RF_E_NOMEM;
    if (st == RF_OK) {
        /* the cotangent w, shaped like f(x) */
        int64_t nw = tp_numel(rf_exec_output_dims(ey, 0), rf_exec_output_rank(ey, 0));
        double w[1024];
        for (int64_t i = 0; i < nw && i < 1024; i++)
            w[i] = tp_rand(&rng, -1, 1);
        if (rf_exec_output_dtype(ey, 0) != RF_F64 || nw > 1024) {
            st = RF_E_DTYPE;
            fprintf(stderr, "grad %s: output is %s with %lld elements, expected f64\n", c->name,
                    rf_dtype_name(rf_exec_output_dtype(ey, 0)), (long long)nw);
        } else {
            args[c->nin] = tp_dev(RF_F64, rf_exec_output_dims(ey, 0), rf_exec_output_rank(ey, 0),
                                  w);
        }
    }
    if (st == RF_OK)
        st = tp_compile(build_grad, &gl, args, c->nin + 1, &el);
    if (st == RF_OK)
        st = tp_compile(build_grad, &gg, args, c->nin + 1, &eg);
    if (st == RF_OK)
        st = rf_exec_run(eg, args, c->nin + 1, outs, 1 + nd);
    tu_checks++;
    if (st != RF_OK) {
        tu_failures++;
        printf("grad %-40s FAILED to compile/run: %s (%s)\n", c->name, rf_status_str(st),
               rf_errmsg());
        fprintf(stderr, "grad %s: %s (%s)\n", c->name, rf_status_str(st), rf_errmsg());
    } else {
        double max_err = 0;
        char detail[256] = "";
        int g = 1;
        for (int k = 0; k < c->nin; k++) {
            if (!differentiable(&c->in[k]))
                continue;
            rf_array *ga = outs[g++];
            int64_t n = 0;
            double *ad = tp_read(ga, &n);
            bool shape_ok = ga && rf_array_dtype(ga) == RF_F64 &&
                            rf_array_numel(ga) == rf_array_numel(args[k]) &&
                            rf_array_rank(ga) == rf_array_rank(args[k]);
            if (!shape_ok || !ad) {
                max_err = INFINITY;
                snprintf(detail, sizeof detail, "gradient of input %d has the wrong type", k);
                free(ad);
                continue;
            }
            int64_t wi = -1;
            double wad = 0, wfd = 0;
            double err = fd_check_input(c, k, el, args, c->nin + 1, ad, &wi, &wad, &wfd);
            if (!(err <= max_err)) {
                max_err = err;
                snprintf(detail, sizeof detail, "input %d element %lld: AD %.10g, FD %.10g", k,
                         (long long)wi, wad, wfd);
            }
            free(ad);
        }
        bool pass = max_err <= FD_TOL;
        printf("grad %-40s max err %.3e%s%s\n", c->name, max_err, pass ? "" : "  FAIL: ",
               pass ? "" : detail);
        if (!pass) {
            tu_failures++;
            fprintf(stderr, "grad %s: max err %.3e: %s\n", c->name, max_err, detail);
        }
    }
    tp_free_all(outs, 5);
    tp_free_all(args, 5);
    rf_exec_free(ey);
    rf_exec_free(el);
    rf_exec_free(eg);
}

/* ---- Cases that finite differences cannot check ------------------------------------- */

static void build_convert_grad(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    /* f64 -> f32 -> f64 round trip: the gradient flows back as f64 of x's shape */
    rf_tensor *y = rf_convert(rf_convert(a[0], RF_F32), RF_F64);
    rf_tensor *loss = rf_sum_all(rf_mul(y, a[1]));
    rf_tensor *g = NULL;
    rf_grad(t, loss, &a[0], 1, &g);
    rf_return(t, g);
    /* f32 input, f64 compute */
    rf_tensor *z = rf_convert(a[2], RF_F64);
    rf_tensor *loss2 = rf_sum_all(rf_mul(rf_mul(z, z), a[1]));
    rf_tensor *g2 = NULL;
    rf_grad(t, loss2, &a[2], 1, &g2);
    rf_return(t, g2);
}

static void test_convert_grad(void)
{
    const double x[6] = {0.1, -1.3, 2.5, 3.75, -0.2, 1};
    const double w[6] = {0.5, -1, 2, 0.25, 1.5, -3};
    rf_array *in[3] = {tp_host(RF_F64, DIMS(2, 3), 2, x), tp_host(RF_F64, DIMS(2, 3), 2, w),
                       tp_host(RF_F32, DIMS(2, 3), 2, x)};
    rf_array *o[2] = {0};
    double want2[6];
    for (int i = 0; i < 6; i++)
        want2[i] = (float)(2 * (double)(float)x[i] * w[i]);
    CHECK_OK(tp_run(build_convert_grad, NULL, in, 3, o, 2));
    tp_expect("grad through convert f64->f32->f64", o[0], RF_F64, DIMS(2, 3), 2, w, 1e-7, 1e-7);
    tp_expect("grad of f32 input through convert to f64", o[1], RF_F32, DIMS(2, 3), 2, want2,
              1e-6, 1e-6);
    printf("grad %-40s checked (dtype, shape, value)\n", "convert f64<->f32");
    tp_free_all(o, 2);
    tp_free_all(in, 3);
}

static void build_stop_grad(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    rf_tensor *x = a[0], *g[3] = {0};
    /* L1 = sum(sg(x) * w): zero gradient */
    rf_tensor *l1 = rf_sum_all(rf_mul(rf_stop_gradient(x), a[1]));
    rf_grad(t, l1, &x, 1, &g[0]);
    /* L2 = sum(x * sg(x) * w): gradient sg(x) * w, not 2 x w */
    rf_tensor *l2 = rf_sum_all(rf_mul(rf_mul(x, rf_stop_gradient(x)), a[1]));
    rf_grad(t, l2, &x, 1, &g[1]);
    /* L3 does not depend on the second argument at all: zeros */
    rf_tensor *wrt[2] = {x, a[1]}, *g3[2] = {0};
    rf_tensor *l3 = rf_sum_all(rf_exp(x));
    rf_grad(t, l3, wrt, 2, g3);
    /* L4 = sum(exp(y) * w) with y = 2 x: gradient w.r.t. the intermediate y */
    rf_tensor *y = rf_mul_s(x, 2), *gy = NULL;
    rf_tensor *l4 = rf_sum_all(rf_mul(rf_exp(y), a[1]));
    rf_grad(t, l4, &y, 1, &gy);
    rf_return(t, g[0]);
    rf_return(t, g[1]);
    rf_return(t, g3[1]);
    rf_return(t, g3[0]);
    rf_return(t, gy);
}

static void test_stop_gradient(void)
{
    const double x[4] = {0.5, -1, 2, 0.25};
    const double w[4] = {1, 2, -3, 4};
    rf_array *in[2] = {tp_host(RF_F64, DIMS(4), 1, x), tp_host(RF_F64, DIMS(4), 1, w)};
    rf_array *o[5] = {0};
    double xw[4], ex[4], ey[4];
    for (int i = 0; i < 4; i++) {
        xw[i] = x[i] * w[i];
        ex[i] = exp(x[i]);
        ey[i] = exp(2 * x[i]) * w[i];
    }
    CHECK_OK(tp_run(build_stop_grad, NULL, in, 2, o, 5));
    tp_expect("grad of stop_gradient is zero", o[0], RF_F64, DIMS(4), 1,
              (const double[]){0, 0, 0, 0}, 0, 0);
    tp_expect("grad of x * stop_gradient(x)", o[1], RF_F64, DIMS(4), 1, xw, 1e-15, 1e-15);
    tp_expect("grad w.r.t. an unused input is zero", o[2], RF_F64, DIMS(4), 1,
              (const double[]){0, 0, 0, 0}, 0, 0);
    tp_expect("grad of sum(exp(x))", o[3], RF_F64, DIMS(4), 1, ex, 1e-15, 1e-14);
    tp_expect("grad w.r.t. an intermediate tensor", o[4], RF_F64, DIMS(4), 1, ey, 1e-15, 1e-14);
    printf("grad %-40s checked (zero / partial / intermediate)\n", "stop_gradient");
    tp_free_all(o, 5);
    tp_free_all(in, 2);
}

/* The same small network's gradient in f32 and f64 agree to f32 precision. */
static void build_net_grad(rf_trace *t, rf_tensor *const *a, int n, void *u)
{
    (void)n, (void)u;
    rf_tensor *h = rf_tanh(rf_linear(a[0], a[1], a[2]));
    rf_tensor *loss = rf_mean_all(rf_softplus(rf_sum(h, DIMS(1), 1, false)));
    rf_tensor *wrt[3] = {a[0], a[1], a[2]}, *g[3] = {0};
    rf_grad(t, loss, wrt, 3, g);
    for (int i = 0; i < 3; i++)
        rf_return(t, g[i]);
}

static void test_f32_grads(void)
{
    uint64_t rng = 5;
    double x[12], w[6], b[2];
    for (int i = 0; i < 12; i++) x[i] = tp_rand(&rng, -1, 1);
    for (int i = 0; i < 6; i++) w[i] = tp_rand(&rng, -1, 1);
    for (int i = 0; i < 2; i++) b[i] = tp_rand(&rng, -1, 1);
    rf_array *o32[3] = {0}, *o64[3] = {0};
    for (int d = 0; d < 2; d++) {
        rf_dtype dt = d ? RF_F64 : RF_F32;
        rf_array *in[3] = {tp_host(dt, DIMS(4, 3), 2, x), tp_host(dt, DIMS(2, 3), 2, w),
                           tp_host(dt, DIMS(2), 1, b)};
        CHECK_OK(tp_run(build_net_grad, NULL, in, 3, d ? o64 : o32, 3));
        tp_free_all(in, 3);
    }
    const char *names[3] = {"f32 grad of x", "f32 grad of w", "f32 grad of b"};
    for (int i = 0; i < 3; i++) {
        double *ref = tp_read(o64[i], NULL);
        if (ref && o32[i])
            tp_expect(names[i], o32[i], RF_F32, rf_array_dims(o64[i]), rf_array_rank(o64[i]), ref,
                      1e-6, 1e-5);
        free(ref);
    }
    printf("grad %-40s checked against f64\n", "f32 network");
    tp_free_all(o32, 3);
    tp_free_all(o64, 3);
}

int main(void)
{
    for (int i = 0; i < N_OF(CASES); i++)
        run_case(&CASES[i], 1000 + 17 * (uint64_t)i);
    test_convert_grad();
    test_stop_gradient();
    test_f32_grads();
    return tu_finish("test_grad_fd");
}
