/* ir.h: the tensor IR: an SSA graph of nodes with static shapes and dtypes.
 *
 * A graph (struct rf_trace, called rfi_graph inside reflux) owns its nodes in
 * an arena; nodes are created in SSA order, so node->id orders operands
 * before users. The public rf_tensor is a node. A graph holds:
 *   arguments: passed per call (ARGUMENT nodes, attr i[0] = index)
 *   captures:  arrays read by reference at run time (CAPTURE nodes, i[0] = index)
 *   outputs:   returned per call
 *   updates:   capture <- value, applied when a call ends successfully
 *
 * The op table below is the single list of ops: it drives the enum, the
 * names, shape inference, the verifier, the printer, the hash, the VJP rules
 * and the interpreter, so an op cannot be half-added.
 *
 * Operand conventions (StableHLO semantics; elementwise ops take operands of
 * identical shape: broadcasting is explicit, done by the public op API):
 *
 *   op                 operands                attributes
 *   CONSTANT           -                       data/nbytes (row-major payload)
 *   IOTA               -                       i[0] axis
 *   ARGUMENT           -                       i[0] argument index
 *   CAPTURE            -                       i[0] capture index
 *   unary elementwise  x                       -
 *   binary elementwise a, b                    -
 *   COMPARE            a, b                    i[0] rf_cmp  (result bool)
 *   SELECT             pred(bool), a, b        -
 *   CLAMP              lo, x, hi               -            (StableHLO order)
 *   CONVERT            x                       result dtype
 *   BROADCAST_IN_DIM   x                       l[0] map (rank(x) entries)
 *   RESHAPE            x                       result dims
 *   TRANSPOSE          x                       l[0] perm
 *   SLICE              x                       l[0] start, l[1] limit, l[2] stride
 *   CONCATENATE        x0..xn-1                i[0] axis
 *   PAD                x, value (rank 0)       l[0] low, l[1] high, l[2] interior
 *   REVERSE            x                       l[0] axes
 *   REDUCE             x                       i[0] rf_reduce_kind, l[0] axes (sorted,
 *                                              unique; removed from the result)
 *   ARGMAX / ARGMIN    x                       i[0] axis (removed; result i64)
 *   DOT_GENERAL        a, b                    l[0] lhs batch, l[1] rhs batch,
 *                                              l[2] lhs contract, l[3] rhs contract,
 *                                              i[0] rf_precision (BF16: f32 operands
 *                                              only; rfi_round_bf16 rounds them)
 *   CONVOLUTION        x [N,C,sp..], w [O,I,k..] l[0] stride, l[1] pad_lo, l[2] pad_hi,
 *                                              l[3] lhs_dilation, l[4] rhs_dilation
 *                                              (nspatial entries each),
 *                                              i[0] feature_group_count, i[1] batch_group_count
 *                                              (both >= 1; 1 = ordinary convolution),
 *                                              i[2] rf_precision (as DOT_GENERAL's i[0])
 *   REDUCE_WINDOW      x                       i[0] kind (SUM/MAX/MIN), l[0] window,
 *                                              l[1] strides, l[2] pad_lo, l[3] pad_hi (rank(x))
 *   SELECT_AND_SCATTER x, source               l[0..3] as REDUCE_WINDOW (first max, add)
 *   GATHER             x, indices (int)        i[0] axis
 *   SCATTER_ADD        x, indices, updates     i[0] axis
 *   RNG                key (i64[2])            i[0] 0 uniform / 1 normal, i[1] stream;
 *                                              result dtype and dims
 *   GRAD               y (scalar), wrt         -   (removed by the autodiff pass)
 *
 * Result shapes: see rfi_infer() in infer.c, the one place that defines them.
 */
#ifndef RF_IR_H
#define RF_IR_H

#include "../core/core.h"

/* X(ENUM, name, n_operands (-1: variadic), flags) */
#define RFI_OPS(X)                                   \
    X(CONSTANT, "constant", 0, RFI_LEAF)             \
    X(IOTA, "iota", 0, RFI_LEAF)                     \
    X(ARGUMENT, "argument", 0, RFI_LEAF)             \
    X(CAPTURE, "capture", 0, RFI_LEAF)               \
    X(NEG, "neg", 1, RFI_UNARY)                      \
    X(ABS, "abs", 1, RFI_UNARY)                      \
    X(SIGN, "sign", 1, RFI_UNARY)                    \
    X(EXP, "exp", 1, RFI_UNARY | RFI_FLOAT)          \
    X(EXPM1, "expm1", 1, RFI_UNARY | RFI_FLOAT)      \
    X(LOG, "log", 1, RFI_UNARY | RFI_FLOAT)          \
    X(LOG1P, "log1p", 1, RFI_UNARY | RFI_FLOAT)      \
    X(SQRT, "sqrt", 1, RFI_UNARY | RFI_FLOAT)        \
    X(RSQRT, "rsqrt", 1, RFI_UNARY | RFI_FLOAT)      \
    X(TANH, "tanh", 1, RFI_UNARY | RFI_FLOAT)        \
    X(LOGISTIC, "logistic", 1, RFI_UNARY | RFI_FLOAT)\
    X(SIN, "sin", 1, RFI_UNARY | RFI_FLOAT)          \
    X(COS, "cos", 1, RFI_UNARY | RFI_FLOAT)          \
    X(FLOOR, "floor", 1, RFI_UNARY | RFI_FLOAT)      \
    X(CEIL, "ceil", 1, RFI_UNARY | RFI_FLOAT)        \
    X(ROUND, "round", 1, RFI_UNARY | RFI_FLOAT)      \
    X(IS_FINITE, "is_finite", 1, RFI_UNARY | RFI_FLOAT | RFI_NOGRAD) \
    X(NOT, "not", 1, RFI_UNARY | RFI_LOGIC | RFI_NOGRAD) \
    X(STOP_GRADIENT, "stop_gradient", 1, RFI_UNARY)  \
    X(ADD, "add", 2, RFI_BINARY)                     \
    X(SUB, "sub", 2, RFI_BINARY)                     \
    X(MUL, "mul", 2, RFI_BINARY)                     \
    X(DIV, "div", 2, RFI_BINARY)                     \
    X(POW, "pow", 2, RFI_BINARY | RFI_FLOAT)         \
    X(MAX, "max", 2, RFI_BINARY)                     \
    X(MIN, "min", 2, RFI_BINARY)                     \
    X(REM, "rem", 2, RFI_BINARY)                     \
    X(AND, "and", 2, RFI_BINARY | RFI_LOGIC | RFI_NOGRAD) \
    X(OR, "or", 2, RFI_BINARY | RFI_LOGIC | RFI_NOGRAD)   \
    X(COMPARE, "compare", 2, RFI_NOGRAD)             \
    X(SELECT, "select", 3, 0)                        \
    X(CLAMP, "clamp", 3, 0)                          \
    X(CONVERT, "convert", 1, 0)                      \
    X(BROADCAST_IN_DIM, "broadcast_in_dim", 1, 0)    \
    X(RESHAPE, "reshape", 1, 0)                      \
    X(TRANSPOSE, "transpose", 1, 0)                  \
    X(SLICE, "slice", 1, 0)                          \
    X(CONCATENATE, "concatenate", -1, 0)             \
    X(PAD, "pad", 2, 0)                              \
    X(REVERSE, "reverse", 1, 0)                      \
    X(REDUCE, "reduce", 1, 0)                        \
    X(ARGMAX, "argmax", 1, RFI_NOGRAD)               \
    X(ARGMIN, "argmin", 1, RFI_NOGRAD)               \
    X(DOT_GENERAL, "dot_general", 2, 0)              \
    X(CONVOLUTION, "convolution", 2, 0)              \
    X(REDUCE_WINDOW, "reduce_window", 1, 0)          \
    X(SELECT_AND_SCATTER, "select_and_scatter", 2, 0)\
    X(GATHER, "gather", 2, 0)                        \
    X(SCATTER_ADD, "scatter_add", 3, 0)              \
    X(RNG, "rng", 1, RFI_NOGRAD)                     \
    X(GRAD, "grad", 2, RFI_NOGRAD)

/* Op flags. */
#define RFI_LEAF 1u   /* no operands */
#define RFI_UNARY 2u  /* elementwise, one operand, result has its shape */
#define RFI_BINARY 4u /* elementwise, two operands of one shape and dtype */
#define RFI_FLOAT 8u  /* operands must be float */
#define RFI_LOGIC 16u /* operands must be bool or integer */
#define RFI_NOGRAD 32u /* result carries no gradient (bool/int result or pseudo op) */

typedef enum rfi_op {
#define RFI_OP_ENUM(e, name, n, flags) RFI_OP_##e,
    RFI_OPS(RFI_OP_ENUM)
#undef RFI_OP_ENUM
    RFI_OP_COUNT
} rfi_op;

typedef struct rfi_op_info {
    const char *name;
    int n_operands; /* -1: variadic */
    unsigned flags;
} rfi_op_info;
RFI_FUNC extern const rfi_op_info rfi_op_table[RFI_OP_COUNT];

#define RFI_N_INTS 4
#define RFI_N_LISTS 5
/* An op's attributes. A node keeps only its lists up to the last non-empty one
 * (rfi_attrs_lists): l is the last member here and attr the last of the node, and
 * rfi_node_new allocates no further. Most nodes carry no list at all, and the 5 x 8
 * entries were two thirds of a node: a traced or decoded program now touches half
 * the fresh pages, each of which costs more to fault in than to fill. So read a
 * node's attr through a pointer, or take a whole copy with rfi_attrs_copy; never
 * assign it whole. A builder's rfi_attrs on the stack is complete, as always. */
typedef struct rfi_attrs {
    int64_t i[RFI_N_INTS];                /* op-specific integers (see the table above) */
    int nl[RFI_N_LISTS];                  /* lengths of the op-specific lists */
    const void *data;                     /* CONSTANT payload (graph arena) */
    size_t nbytes;
    int64_t l[RFI_N_LISTS][RF_MAX_RANK];  /* last: see above */
} rfi_attrs;

/* How many lists a stores: one past its last non-empty list. */
RFI_FUNC int rfi_attrs_lists(const rfi_attrs *a);

typedef struct rf_trace rfi_graph;

/* A node. The public rf_tensor is this struct; users see it opaque. */
struct rf_tensor {
    rfi_graph *g;
    int32_t id;        /* index in g->nodes: operands always have smaller ids */
    rfi_op op;
    rf_dtype dtype;
    int rank;
    int64_t dims[RF_MAX_RANK];
    bool weak;         /* weakly typed scalar constant (rf_scalar): adopts the other dtype */
    int n_in;
    struct rf_tensor **in; /* graph arena */
    rfi_attrs attr;
};
typedef struct rf_tensor rfi_node;

/* A complete copy of src (a node's attr or a builder's) into *dst, unused entries zero. */
RFI_FUNC void rfi_attrs_copy(rfi_attrs *dst, const rfi_attrs *src);
/* A complete copy of node src into *dst (a node on the stack): never *dst = *src. */
RFI_FUNC void rfi_node_copy(rfi_node *dst, const rfi_node *src);

typedef struct rfi_update {
    int capture;    /* index into g->captures */
    rfi_node *value;
} rfi_update;

struct rf_trace {
    rfi_arena arena;
    rf_device *device;
    const char *name;        /* for dumps and messages (arena) */

    rfi_node **nodes;        /* SSA order */
    int n_nodes, cap_nodes;

    rfi_node **args;         /* ARGUMENT node of each argument (may be NULL if unused) */
    int n_args;
    rf_dtype *arg_dtypes;    /* the argument types (arena) */
    int *arg_ranks;
    int64_t (*arg_dims)[RF_MAX_RANK];

    rf_array **captures;     /* one reference held per capture */
    rfi_node **capture_nodes;
    int n_captures, cap_captures;

    rfi_node **outputs;
    int n_outputs, cap_outputs;

    rfi_update *updates;
    int n_updates, cap_updates;

    int n_rng_streams;       /* next RNG stream id */
    rf_precision matmul_precision; /* given to the f32 dot_generals built from now on
                                      (rf_trace_set_matmul_precision); tracing only */

    rfi_watch_list watches;  /* flags read while tracing (models' train/test modes), which
                                the program's executable keeps checking */
    uint64_t flag_clock;     /* rfi_flag_clock() when the trace began: a flag set since was
                                set by the traced function, and is not watched */

    rf_status status;        /* sticky: first error */
    char *errmsg;            /* its message (rfi_malloc) */
    uint64_t seq;            /* creation order: of two open traces, the later is the inner */
};

/* ---- Checked int64 arithmetic (attribute values come from users and may be huge) ----- */
static inline bool rfi_add_ok(int64_t a, int64_t b, int64_t *out)
{
    return !__builtin_add_overflow(a, b, out);
}

static inline bool rfi_mul_ok(int64_t a, int64_t b, int64_t *out)
{
    return !__builtin_mul_overflow(a, b, out);
}

/* (n - 1) * step + 1 for n >= 1 (a dilated extent), 0 for n == 0. */
static inline bool rfi_dilate_ok(int64_t n, int64_t step, int64_t *out)
{
    if (n <= 0) {
        *out = 0;
        return true;
    }
    return rfi_mul_ok(n - 1, step, out) && rfi_add_ok(*out, 1, out);
}

/* a + lo + hi */
static inline bool rfi_pad_ok(int64_t a, int64_t lo, int64_t hi, int64_t *out)
{
    return rfi_add_ok(a, lo, out) && rfi_add_ok(*out, hi, out);
}

/* Padding an axis of n elements by lo before and hi after, where a negative
 * amount crops: a crop past the axis (lo < -n: nothing of the axis is left,
 * the result is all padding) becomes the same result as a crop of exactly
 * the axis, lo = -n, with hi reduced to keep the size lo + n + hi; the same
 * for hi. Then |lo| and |hi| are at most the axis or the result, and every
 * offset computed from them fits in int64. false: the size is negative or
 * overflows. */
static inline bool rfi_clip_crop(int64_t n, int64_t *lo, int64_t *hi)
{
    int64_t size;
    if (*lo < -n || *hi < -n) {
        /* lo + hi may overflow although the result fits: add n first */
        if (*lo < -n ? !rfi_add_ok(n + *lo, *hi, &size) : !rfi_add_ok(n + *hi, *lo, &size))
            return false;
        if (size < 0)
            return false;
        if (*lo < -n)
            *lo = -n, *hi = size;
        else
            *hi = -n, *lo = size;
    }
    return true;
}

/* ---- Graphs ------------------------------------------------------------------------ */
/* Of the traces of two operands that differ, the one a mixing error belongs
 * to: the later (traces nest, so it is the one whose function is running). */
RFI_FUNC rfi_graph *rfi_graph_inner(rfi_graph *a, rfi_graph *b);
/* A new, empty graph for `dev` (NULL on OOM). */
RFI_FUNC rfi_graph *rfi_graph_new(rf_device *dev, const char *name);
/* Frees the graph, its nodes, and releases its capture references. NULL ok. */
RFI_FUNC void rfi_graph_free(rfi_graph *g);
/* Records that the traced program depends on flag f having the value `seen`,
 * unless the flag was set since the trace began; returns the new watch's index
 * (the caller names its owner in t->watches.v[i].what), -1 when there is none
 * (already watched, set inside the trace, or out of memory: the trace fails). */
RFI_FUNC int rfi_trace_watch(rf_trace *t, rfi_flag *f, bool seen);
/* Declares the n argument types (called once, before tracing). */
RFI_FUNC rf_status rfi_graph_set_args(rfi_graph *g, int n, const rf_dtype *dtypes,
                                      const int *ranks, const int64_t (*dims)[RF_MAX_RANK]);
/* Records the first error of the graph (later ones are ignored). */
RFI_FUNC void rfi_graph_fail(rfi_graph *g, rf_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* The capture index of `a` in g, adding it (with a reference) if new; -1 on OOM. */
RFI_FUNC int rfi_graph_capture_index(rfi_graph *g, rf_array *a);
RFI_FUNC rf_status rfi_graph_add_output(rfi_graph *g, rfi_node *x);
RFI_FUNC rf_status rfi_graph_add_update(rfi_graph *g, int capture, rfi_node *value);

/* ---- Nodes ------------------------------------------------------------------------ *
 * rfi_node_new creates a node of `op` over operands in[0..n_in) with `attr`
 * (may be NULL = all zero). `dtype`, `dims`, `rank` are used only by ops
 * whose result type is not implied by operands and attributes (CONSTANT, IOTA,
 * ARGUMENT, CAPTURE, CONVERT (dtype), RESHAPE (dims), BROADCAST_IN_DIM (dims),
 * RNG (both)). Shape/dtype inference and checks run here: on
 * failure the graph's sticky error is set (message "<op>: ...", naming the
 * shapes) and NULL is returned. Any NULL operand returns NULL at once.
 * Operands must belong to g ("mixing traces" error otherwise).
 * ARGUMENT/CAPTURE nodes must name a declared argument / an existing capture
 * (rfi_graph_set_args / rfi_graph_capture_index first) with its exact type;
 * the node becomes g->args[i] / g->capture_nodes[i] if that slot is empty.
 * The node's weak flag starts false (rf_scalar sets it afterwards). */
RFI_FUNC rfi_node *rfi_node_new(rfi_graph *g, rfi_op op, rfi_node *const *in, int n_in,
                                const rfi_attrs *attr, rf_dtype dtype, const int64_t *dims,
                                int rank);
/* Infers the result type of op over operands (no graph changes). Returns
 * RF_OK or an error status, with a message "<op>: ..." in msg.
 * dtype/rank/dims are in-out: on entry the requested type (read only by the
 * ops listed at rfi_node_new), on success the result; dims must hold
 * RF_MAX_RANK entries. */
RFI_FUNC rf_status rfi_infer(rfi_op op, rfi_node *const *in, int n_in, const rfi_attrs *attr,
                             rf_dtype *dtype, int64_t *dims, int *rank, char *msg, size_t msgn);
/* Copies node `src` (from another graph) into g with operands new_in
 * (src->n_in of them), attributes, constant payload and weak flag included. */
RFI_FUNC rfi_node *rfi_node_clone(rfi_graph *g, const rfi_node *src, rfi_node *const *new_in);

RFI_FUNC int64_t rfi_node_numel(const rfi_node *x);
/* Whether a and b have one rank and the same dims (dtypes aside). */
RFI_FUNC bool rfi_node_same_dims(const rfi_node *a, const rfi_node *b);
/* The rank-0 constant whose value every element of x is: x itself, or the
 * operand of x's broadcast; NULL when x is no such splat. */
RFI_FUNC const rfi_node *rfi_splat_scalar(const rfi_node *x);
/* The dims of a rank-`rank` operand in neither list a nor list b, in order:
 * a DOT_GENERAL operand's free dims given its batch and contracting dims. */
RFI_FUNC int rfi_dot_free_dims(int rank, const int64_t *a, int na, const int64_t *b, int nb,
                               int64_t *out);
/* A DOT_GENERAL's multiply-adds: result elements times contracted points. */
RFI_FUNC int64_t rfi_dot_macs(const rfi_node *dot);
/* Whether a DOT_GENERAL rounds its (f32) operands to bfloat16 first. */
RFI_FUNC bool rfi_dot_bf16(const rfi_node *dot);
/* The same for a CONVOLUTION. */
RFI_FUNC bool rfi_conv_bf16(const rfi_node *conv);
RFI_FUNC size_t rfi_node_nbytes(const rfi_node *x);
/* A rank-0 CONSTANT of dt holding v (converted as rfi_api_store does). */
RFI_FUNC rfi_node *rfi_node_scalar(rfi_graph *g, rf_dtype dt, double v);
/* Whether x is a float +0 everywhere: a rank-0 CONSTANT of f32 or f64 holding
 * +0, or a BROADCAST_IN_DIM of one (the zeros a gradient starts from). */
RFI_FUNC bool rfi_node_is_plus_zero(const rfi_node *x);

/* ---- Whole-graph services ------------------------------------------------------------ */
/* Checks SSA order, operand ownership and every node's type against rfi_infer;
 * RF_E_INTERNAL with a message naming the node on failure. */
RFI_FUNC rf_status rfi_verify(const rfi_graph *g);
/* The graph as text, one line per node, then outputs and updates. Owned (rfi_free). */
RFI_FUNC char *rfi_print(const rfi_graph *g);
/* Structural hash: equal for equal programs whatever the node creation order
 * of independent nodes or the pointers; changes with any op, attribute, type,
 * constant byte, argument/capture type, output or update. */
RFI_FUNC uint64_t rfi_hash(const rfi_graph *g);
/* The most operands any node of g has, and at least 1: the size of the operand
 * scratch array of a pass that copies nodes. */
RFI_FUNC int rfi_max_operands(const rfi_graph *g);
/* Number of users of each node (array of n_nodes, owned: rfi_free), counting
 * outputs and updates as users. */
RFI_FUNC int *rfi_use_counts(const rfi_graph *g);

#endif
