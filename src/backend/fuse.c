/* fuse.c: fusion decisions of the execution plan: which nodes are
 * materialised, the ordered steps that compute them, and where outputs and
 * updates go (written directly, in place, or copied at the end).
 *
 * The rules (plan.h explains the fusion model):
 *
 * Leaves. ARGUMENT -> LOC_ARG, CAPTURE -> LOC_CAPTURE. CONSTANT of rank > 0
 *   -> LOC_CONST (payload passed in the buffer table); a rank-0 CONSTANT is
 *   inline (a literal) unless it must be materialised (then LOC_CONST too).
 *   IOTA is inline unless it must be materialised (then a LOOP root).
 *
 * Always materialised: program outputs and update values; the operands of
 *   CALL steps (with opts.conv_transposed_views, the operand of an f32 CONV
 *   call without feature groups that transposes dims 0 and 1 stays inline
 *   and its own operand is materialised instead: the call reads it as a
 *   view; a MATMUL or FALLBACK call's operand that reshapes a fusible
 *   non-leaf value, a flatten, has that value materialised instead and
 *   becomes its alias); every op that is not
 *   fusible (REDUCE, REDUCE_WINDOW, ARGMAX, ARGMIN, DOT_GENERAL, CONVOLUTION,
 *   GATHER, SCATTER_ADD, SELECT_AND_SCATTER, RNG).
 *
 * Fusible ops: unary/binary elementwise (STOP_GRADIENT included), COMPARE,
 *   SELECT, CLAMP, CONVERT, BROADCAST_IN_DIM, RESHAPE, TRANSPOSE, SLICE,
 *   REVERSE, PAD, CONCATENATE, IOTA, rank-0 CONSTANT. A fusible node that is
 *   not forced is inline or materialised by one rule, decided from the users
 *   down (users have larger ids, so a reverse walk sees them decided):
 *   - "sites" of a user u: 1 if u is materialised, else the sites of u; an
 *     edge into an expanding BROADCAST_IN_DIM, a DOT_GENERAL, a
 *     CONVOLUTION or a REDUCE_WINDOW counts 2 (the operand would be
 *     re-evaluated per output element). A REDUCE user counts 1 (each input
 *     element is read once).
 *   - CHEAP ops (broadcast_in_dim, reshape, transpose, slice, reverse,
 *     convert, iota, constant, neg, abs, stop_gradient) and every rank-0
 *     node (a scalar is loop-invariant: a step evaluates it once, hoisted
 *     out of its loops) are always inline; their sites are the sum over
 *     their users (capped at 2).
 *   - any other fusible node is inline iff every edge to a user counts at
 *     most 1 AND (it has one user, or all its users are elementwise ops of
 *     its own shape, i.e. they read it at the index they compute: a shared
 *     subexpression of loops over one shape, computed once per element when
 *     those roots share a LOOP step and recomputed otherwise, or REDUCEs of
 *     it, which read each element once: a softmax's scaled and masked scores
 *     are recomputed by its row max and by the exp that reads that max,
 *     where storing them cost a write and two reads of a [B,H,T,T] value).
 *     A node that calls a math function (exp, tanh, ...) or reads more than
 *     one operand of its size (not a scalar or a broadcast of a smaller
 *     value) is not recomputed that way: such a node, or one under it, is
 *     materialised, so each step reads at most the one stream the stored
 *     value would cost it (opts.inline_reduce_operands), unless it reads
 *     exactly two streams (an operand forced to be materialised counting
 *     as one) and at most two steps would evaluate it (REDUCE roots of one
 *     form counting as one step, each other root as one): then the four
 *     reads cost less than storing it, the two reads, and a read back in
 *     each step. Else it is materialised. Its sites are then 1.
 *
 * Segment sources. A rank-1 node F that these rules materialise becomes
 *   inline when every materialised node it reaches through inline users is
 *   a SEGMENT root of F: a root v = f(reshape(slice(F, off))) whose every
 *   path to F is one stride-1 slice under elementwise ops and reshapes of v's
 *   element count (scalars and broadcast scalars aside), so v's element j is
 *   computed from F's element off + j. Such roots join a LOOP over F's shape
 *   (plan.h: segmented steps), stored at their own indices: the optimiser's
 *   per-parameter select(ok, reshape(slice(x_new)), p) then needs no [total]
 *   x_new and no loop of its own, and goes in place (rule (2) below follows
 *   the flat offsets).
 *
 * Aliases. A RESHAPE or STOP_GRADIENT whose operand is materialised and
 *   that is not an output becomes LOC_ALIAS of the operand's bytes (no step).
 *
 * Steps, in topological (id) order of their roots: each materialised
 *   non-leaf, non-alias node is a root. DOT_GENERAL with at least
 *   opts.matmul_call_min_flops multiply-adds -> CALL MATMUL, unless its lhs
 *   has at most opts.dot_loop_max_rows rows (a matrix-vector product: a
 *   REDUCE step whatever its size) or it is not f32 (the math library's
 *   type: an f64 product ran 3-4x faster as generated loops than in the
 *   reference kernel a call would fall back to); CONVOLUTION -> CALL CONV,
 *   unless rfi_plan_conv_as_loops (not f32, a depthwise weight gradient
 *   other than 3x3, or at most 3 output features; a transpose moving the
 *   last dim that one reads is then materialised); ARGMAX, ARGMIN, GATHER,
 *   SCATTER_ADD,
 *   SELECT_AND_SCATTER, RNG -> CALL FALLBACK; REDUCE, REDUCE_WINDOW, smaller
 *   DOT_GENERAL and those convolutions -> a REDUCE step (whose loads round
 *   the operands of one of RF_PRECISION_BF16); everything else
 *   -> LOOP. A new LOOP root joins an existing LOOP step of identical dims
 *   that reads at least one of the same inputs or one of whose roots it reads
 *   (the latest such step among the last JOIN_WINDOW steps) when it can run
 *   there: the step comes after every step producing the root's inputs, or
 *   else the step can be moved to the end (no later step reads its roots and
 *   the new root reads none of them), or the step's own roots are the only
 *   inputs it does not follow and the root reads each of them at the point
 *   the step computes it (reads_roots_in_place; the lowering then computes
 *   it there rather than loading it back).
 *   A segment root compares by its flat vector's shape. This puts the flat
 *   optimiser update of all parameters and moments (one shape, [total]) into
 *   one loop, parameters included.
 *   Likewise (opts.sibling_reductions) a REDUCE root joins, by the same
 *   placement rules, a REDUCE step of at most RFI_MAX_SIBLINGS - 1 REDUCE
 *   roots of the same kind, result type, operand shape and type and
 *   reduced axes (results of rank <= 2) that reads at least one of the same
 *   inputs: the kernel folds them side by side in one pass over the data
 *   (kir.h). BatchNorm's backward makes four such sums over its output
 *   gradient and its input.
 *
 * CALL epilogues (opts.call_epilogues; MATMULs only with opts.matmul_epilogues).
 *   An f32 MATMUL or CONV call node C takes the chain of its elementwise
 *   users into the call while each link is the sole user of the previous
 *   value (which is neither an output nor an update value), up to
 *   RFI_EPI_MAX ops, each of one of the forms:
 *   add(v, broadcast_in_dim(b)) with b one vector of length > 1 along one
 *   result dim (its other dims 1, or a reshape of such a vector: BIAS),
 *   add(v, y) with y of v's shape and certain to have a buffer (a leaf, an
 *   output, an update value, a non-fusible op or a call operand: ADD),
 *   max(v, +0) (RELU; only in that order: max(+0, v) is -0 at v = -0),
 *   tanh(v), logistic(v); the adds take their operands in either order. The
 *   last op's node becomes the CALL step's root; C and the ops before the
 *   last are inline; b and y are materialised. Because each link must be the
 *   sole user, a pre-activation the backward pass reads stops the chain
 *   before the activation, which then stays a LOOP; relu's gradient reads
 *   its result (y > 0), so training fuses bias and relu as inference does.
 *
 * REDUCE epilogues (opts.reduce_epilogues). A REDUCE or loop DOT_GENERAL node
 *   R of rank <= 2 that is materialised only because reductions are, has no
 *   possible sibling and is neither a result nor read by a call, and whose
 *   value reaches exactly one materialised node L through inline users, all
 *   of them (L too) elementwise ops of R's dims (so each reads R at the
 *   point it computes), becomes inline: L's step is a REDUCE step whose core
 *   is R, computing L at each point after R's fold. Not when L is a segment
 *   root, an update value (in place needs a LOOP step) or calls a math
 *   function anywhere in its inline expression (most REDUCE kernel forms
 *   compute their results a point at a time, unvectorised).
 *
 * Outputs. A root that is output i and not an update value, and not already
 *   placed, is LOC_OUTPUT i. Every other output (extra outputs of one node,
 *   leaves, aliases, update values) gets a COPY step at the end.
 *
 * Updates. Value v of the update of capture c is LOC_IN_PLACE c when
 *   opts.in_place_updates and: (1) v is a LOOP root with c's dims; (2) in v's
 *   step, every inline path from c's CAPTURE node (or an alias of it) to any
 *   root of the step reads c at the position v writes: through elementwise
 *   ops of one shape and reshapes (identity linear index), and in a
 *   segmented step also through rank-1 slices and concatenations of the
 *   flat extent, whose offsets must add up to v's own segment offset; (3) no
 *   later step and no final copy reads c; (4) v is not an output, not read by
 *   a later step, and the value of no other update; (5) no CALL step comes
 *   after v's step: a call can fail at run time (a reference kernel out of
 *   memory, library calls in a forked child), and a failed run must leave
 *   every capture as it was, while loops and copies cannot fail. Otherwise v
 *   lives in the arena (or where it already is) and a COPY step writes it
 *   into c at the end. A training step's updates (the optimiser's, and
 *   BatchNorm's running statistics, which nothing reads) are scheduled after
 *   its last call, so (5) costs it nothing: the mlp, cnn, ffn and ResNet
 *   steps write every update in place.
 *
 * Final COPY steps, in this order: copies to outputs; copies to captures
 *   whose source is another capture's bytes (they read old values), each
 *   before any copy that overwrites its source; the other copies to captures
 *   (a capture's copy onto itself among them: it changes nothing). A cycle of
 *   captures copied from each other (a swap) goes through the plan's copy
 *   scratch: one source is copied there first, and from there last.
 *
 * Not here: arena offsets (memplan.c), assembling/printing the plan (plan.c),
 * and anything about how steps become code.
 */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "plan_internal.h"

/* ---- Op classes --------------------------------------------------------------------- */

static bool is_elementwise(rfi_op op)
{
    unsigned f = rfi_op_table[op].flags;
    return (f & (RFI_UNARY | RFI_BINARY)) || op == RFI_OP_COMPARE || op == RFI_OP_SELECT ||
           op == RFI_OP_CLAMP || op == RFI_OP_CONVERT;
}

static bool is_fusible(rfi_op op)
{
    switch (op) {
    case RFI_OP_BROADCAST_IN_DIM:
    case RFI_OP_RESHAPE:
    case RFI_OP_TRANSPOSE:
    case RFI_OP_SLICE:
    case RFI_OP_REVERSE:
    case RFI_OP_PAD:
    case RFI_OP_CONCATENATE:
    case RFI_OP_IOTA:
    case RFI_OP_CONSTANT:
        return true;
    default:
        return is_elementwise(op);
    }
}

static bool is_cheap(rfi_op op)
{
    switch (op) {
    case RFI_OP_BROADCAST_IN_DIM:
    case RFI_OP_RESHAPE:
    case RFI_OP_TRANSPOSE:
    case RFI_OP_SLICE:
    case RFI_OP_REVERSE:
    case RFI_OP_CONVERT:
    case RFI_OP_IOTA:
    case RFI_OP_CONSTANT:
    case RFI_OP_NEG:
    case RFI_OP_ABS:
    case RFI_OP_STOP_GRADIENT:
        return true;
    default:
        return false;
    }
}

/* Rows of a DOT_GENERAL's lhs: its elements per contracted point (batch
 * elements times free elements). */
static int64_t dot_rows(const rfi_node *x)
{
    const rfi_node *lhs = x->in[0];
    int64_t k = 1;
    for (int i = 0; i < x->attr.nl[2]; i++)
        k *= lhs->dims[x->attr.l[2][i]];
    return k > 0 ? rfi_node_numel(lhs) / k : 0;
}

/* plan.h: f32 convolutions are calls but for depthwise weight gradients
 * with kernels other than 3x3, which oneDNN's depthwise kernel does not take
 * and im2col ran as one product per channel (a 7x7 one over 64 channels of
 * 64 16x16 images took 85 ms that way), and for convolutions with at most 3
 * output features, which oneDNN computes in blocks of 8 (a U-Net's last
 * 3x3 layer, 32 -> 1 channels on 64 32x32 images: 11.3 ms in the step, as
 * loops 1.8). */
bool rfi_plan_conv_as_loops(const rfi_node *x)
{
    if (x->dtype != RF_F32 || x->in[0]->dtype != RF_F32 || x->in[1]->dtype != RF_F32)
        return true;
    int64_t b_groups = x->attr.i[1];
    bool depthwise_grad = x->rank == 4 && b_groups > 1 && x->dims[0] == 1 &&
                          x->dims[1] == b_groups && x->attr.i[0] <= 1;
    if (depthwise_grad)
        return !(x->dims[2] == 3 && x->dims[3] == 3);
    /* at most 3 output features (an image's colours, a mask), no groups, a kernel no
     * larger than the result */
    const rfi_node *w = x->in[1];
    return x->rank == 4 && x->dims[1] <= 3 && x->attr.i[0] <= 1 && b_groups <= 1 &&
           w->dims[2] * w->dims[3] <= x->dims[2] * x->dims[3];
}

static rfi_call_kind call_kind(const rfi_plan_builder *b, const rfi_node *x)
{
    switch (x->op) {
    case RFI_OP_DOT_GENERAL:
        if (x->dtype != RF_F32 || dot_rows(x) <= b->opts.dot_loop_max_rows)
            return RFI_CALL_NONE;
        return rfi_dot_macs(x) >= b->opts.matmul_call_min_flops ? RFI_CALL_MATMUL : RFI_CALL_NONE;
    case RFI_OP_CONVOLUTION:
        return rfi_plan_conv_as_loops(x) ? RFI_CALL_NONE : RFI_CALL_CONV;
    case RFI_OP_ARGMAX:
    case RFI_OP_ARGMIN:
    case RFI_OP_GATHER:
    case RFI_OP_SCATTER_ADD:
    case RFI_OP_SELECT_AND_SCATTER:
    case RFI_OP_RNG:
        return RFI_CALL_FALLBACK;
    default:
        return RFI_CALL_NONE;
    }
}

static rfi_step_kind step_kind(const rfi_plan_builder *b, const rfi_node *x)
{
    if (call_kind(b, x) != RFI_CALL_NONE)
        return RFI_STEP_CALL;
    if (x->op == RFI_OP_REDUCE || x->op == RFI_OP_REDUCE_WINDOW || x->op == RFI_OP_DOT_GENERAL ||
        x->op == RFI_OP_CONVOLUTION)
        return RFI_STEP_REDUCE;
    return RFI_STEP_LOOP;
}

static bool is_leaf(const rfi_node *x) { return (rfi_op_table[x->op].flags & RFI_LEAF) != 0; }

/* ---- Materialisation ------------------------------------------------------------------- */

/* How many times one evaluation of user u re-evaluates its operand x. */
static int edge_weight(const rfi_node *x, const rfi_node *u)
{
    if (u->op == RFI_OP_BROADCAST_IN_DIM && rfi_node_numel(u) > rfi_node_numel(x))
        return 2;
    if (u->op == RFI_OP_DOT_GENERAL || u->op == RFI_OP_REDUCE_WINDOW ||
        u->op == RFI_OP_CONVOLUTION)
        return 2;
    return 1;
}

/* Sites of x seen through user u: 1 for a materialised user, else u's own. */
static int user_sites(const rfi_plan_builder *b, const int *sites, const rfi_node *x, int u)
{
    int s = b->mat[u] ? 1 : sites[u];
    int w = s * edge_weight(x, b->g->nodes[u]);
    return w > 2 ? 2 : w;
}

/* Operand k of CONV call x is read as a view (opts.conv_transposed_views): a
 * TRANSPOSE swapping dims 0 and 1 of an f32 value, in a convolution without
 * feature groups. Batch groups are allowed: the weight gradient of a grouped
 * convolution has them, and reads x and the cotangent transposed just as an
 * ungrouped one's does (the services transpose a view back where the path
 * does not read it in place). */
static bool conv_view(const rfi_plan_builder *b, const rfi_node *x, int k)
{
    const rfi_node *t = x->in[k];
    if (!b->opts.conv_transposed_views || x->op != RFI_OP_CONVOLUTION ||
        x->dtype != RF_F32 || x->attr.i[0] > 1 ||
        t->op != RFI_OP_TRANSPOSE || t->rank < 2 || t->attr.l[0][0] != 1 ||
        t->attr.l[0][1] != 0)
        return false;
    for (int d = 2; d < t->rank; d++)
        if (t->attr.l[0][d] != d)
            return false;
    return true;
}

/* The node whose buffer CALL x reads as its operand k: the operand itself,
 * or for a view the transpose's operand, or for a reshape of a fusible value
 * (a flatten before a matmul) the reshape's operand, so that the reshape is
 * an alias of its bytes and the loop computing them runs over the operand's
 * dims, in the order its own inputs are laid out, rather than over the
 * reshaped ones. Convolutions keep their reshaped operand: it may take a
 * blocked layout, an alias may not. */
static int call_reads(const rfi_plan_builder *b, const rfi_node *x, int k)
{
    const rfi_node *in = x->in[k];
    if (conv_view(b, x, k))
        return in->in[0]->id;
    if (in->op == RFI_OP_RESHAPE && x->op != RFI_OP_CONVOLUTION && !b->is_output[in->id] &&
        is_fusible(in->in[0]->op) && !is_leaf(in->in[0]))
        return in->in[0]->id;
    return in->id;
}

/* Nodes that must have a buffer whatever their users: outputs, update
 * values, non-fusible ops and what CALL steps read (call_reads). */
static void mark_forced(const rfi_plan_builder *b, bool *forced)
{
    const rfi_graph *g = b->g;
    for (int i = 0; i < g->n_outputs; i++)
        forced[g->outputs[i]->id] = true;
    for (int i = 0; i < g->n_updates; i++)
        forced[g->updates[i].value->id] = true;
    for (int i = 0; i < b->n; i++) {
        const rfi_node *x = g->nodes[i];
        if (!is_fusible(x->op) && !is_leaf(x))
            forced[i] = true;
        if (call_kind(b, x) != RFI_CALL_NONE)
            for (int k = 0; k < x->n_in; k++)
                forced[call_reads(b, x, k)] = true;
    }
}

/* ---- CALL epilogues ---------------------------------------------------------------------- */

/* The sole user of x, or -1 (several users, none, or x is a result). */
static int sole_user(const rfi_plan_builder *b, int x)
{
    if (b->is_output[x] || b->is_update_value[x] || b->user_start[x + 1] - b->user_start[x] != 1)
        return -1;
    return b->users[b->user_start[x]];
}

/* +0 as a scalar: a rank-0 f32/f64 constant whose bytes are all zero, or a broadcast of
 * one. (-0 is not: max(v, -0) gives -0 for v <= 0, where the relu epilogue writes +0.) */
static bool is_plus_zero_scalar(const rfi_node *z)
{
    static const unsigned char zero[8];
    z = rfi_splat_scalar(z);
    return z && z->attr.data && (z->dtype == RF_F32 || z->dtype == RF_F64) &&
           memcmp(z->attr.data, zero, rf_dtype_size(z->dtype)) == 0;
}

/* Whether y will certainly have a buffer whatever the fusion decides. */
static bool surely_materialised(const rfi_plan_builder *b, const bool *forced, int y)
{
    const rfi_node *n = b->g->nodes[y];
    return !b->epi_inline[y] &&
           (forced[y] || n->op == RFI_OP_ARGUMENT || n->op == RFI_OP_CAPTURE ||
            (n->op == RFI_OP_CONSTANT && n->rank > 0));
}

/* If o broadcasts a vector along one result dim (its operand has exactly one
 * dim of size > 1, possibly as a reshape of a node of that many elements),
 * the node holding the vector's elements contiguously, and *axis; else -1. */
static int bias_vector(const rfi_node *o, int *axis)
{
    if (o->op != RFI_OP_BROADCAST_IN_DIM)
        return -1;
    const rfi_node *src = o->in[0];
    int64_t len = 0;
    for (int j = 0; j < src->rank; j++) {
        if (src->dims[j] == 1)
            continue;
        if (len > 0)
            return -1;
        len = src->dims[j];
        *axis = (int)o->attr.l[0][j];
    }
    if (len < 2)
        return -1;
    if (src->op == RFI_OP_RESHAPE && rfi_node_numel(src->in[0]) == len)
        src = src->in[0];
    return src->id;
}

/* The epilogue op user u applies to value v (operand of u), or false. */
static bool classify_epilogue(const rfi_plan_builder *b, const bool *forced, int v, int u,
                              rfi_epi_op *op)
{
    const rfi_node *un = b->g->nodes[u], *vn = b->g->nodes[v];
    if (b->epi_inline[u] || b->epi_of[u] >= 0 || un->dtype != vn->dtype ||
        !rfi_node_same_dims(un, vn))
        return false;
    *op = (rfi_epi_op){RFI_EPI_RELU, u, -1, -1};
    switch (un->op) {
    case RFI_OP_TANH: op->kind = RFI_EPI_TANH; return true;
    case RFI_OP_LOGISTIC: op->kind = RFI_EPI_LOGISTIC; return true;
    case RFI_OP_MAX:
        /* max(v, +0) only: of equal operands max gives the second, so max(+0, v) is -0
         * at v = -0, where the epilogue writes +0 */
        return un->in[0]->id == v && is_plus_zero_scalar(un->in[1]);
    case RFI_OP_ADD: break;
    default: return false;
    }
    const rfi_node *o = un->in[un->in[0]->id == v ? 1 : 0];
    if (o->id == v)
        return false;
    int axis = -1, vec = bias_vector(o, &axis);
    if (vec >= 0 && !b->epi_inline[vec]) {
        op->kind = RFI_EPI_BIAS;
        op->operand = vec;
        op->axis = axis;
        return true;
    }
    if (!rfi_node_same_dims(o, vn) || !surely_materialised(b, forced, o->id))
        return false;
    op->kind = RFI_EPI_ADD;
    op->operand = o->id;
    return true;
}

/* Finds the epilogue chain of call node c and records it (forcing its root
 * and added operands to be materialised). false only on OOM. */
static bool find_epilogue(rfi_plan_builder *b, bool *forced, int c)
{
    rfi_epi_chain ch;
    memset(&ch, 0, sizeof ch);
    ch.core = c;
    int v = c;
    for (int u = sole_user(b, v); u >= 0 && ch.n < RFI_EPI_MAX; u = sole_user(b, v)) {
        if (!classify_epilogue(b, forced, v, u, &ch.ops[ch.n]))
            break;
        v = u;
        ch.n++;
    }
    if (ch.n == 0)
        return true;
    void *epis = b->epis;
    if (!rfi_grow(&epis, b->n_epis, &b->cap_epis, sizeof *b->epis))
        return false;
    b->epis = epis;
    b->epis[b->n_epis] = ch;
    b->epi_of[v] = b->n_epis++;
    forced[v] = true;
    b->epi_inline[c] = true;
    for (int k = 0; k < ch.n; k++) {
        if (k + 1 < ch.n)
            b->epi_inline[ch.ops[k].node] = true;
        if (ch.ops[k].operand >= 0)
            forced[ch.ops[k].operand] = true;
    }
    return true;
}

/* Epilogues of every f32 MATMUL / CONV call, in id order. */
static bool find_epilogues(rfi_plan_builder *b, bool *forced)
{
    if (!b->opts.call_epilogues)
        return true;
    for (int x = 0; x < b->n; x++) {
        const rfi_node *n = b->g->nodes[x];
        rfi_call_kind k = call_kind(b, n);
        bool takes = k == RFI_CALL_CONV || (k == RFI_CALL_MATMUL && b->opts.matmul_epilogues);
        if (takes && n->dtype == RF_F32 && !b->epi_inline[x] && !find_epilogue(b, forced, x))
            return false;
    }
    return true;
}

/* ---- REDUCE epilogues ------------------------------------------------------------------ */

/* The one materialised node that reduction r's value reaches through inline
 * users, when every node on the way and that node are elementwise ops of
 * r's dims (so each reads r at the point it computes) outside any CALL
 * epilogue; else -1. */
static int reduce_consumer(rfi_plan_builder *b, int r, rfi_intlist *stack)
{
    const rfi_node *rn = b->g->nodes[r];
    int gen = ++b->stamp_gen, found = -1;
    stack->n = 0;
    if (!rfi_intlist_push(stack, r))
        return -1;
    while (stack->n > 0) {
        int x = stack->v[--stack->n];
        for (int k = b->user_start[x]; k < b->user_start[x + 1]; k++) {
            int u = b->users[k];
            const rfi_node *un = b->g->nodes[u];
            if (b->stamp[u] == gen)
                continue;
            b->stamp[u] = gen;
            if (!is_elementwise(un->op) || !rfi_node_same_dims(un, rn) || b->epi_inline[u])
                return -1;
            if (b->mat[u]) { /* a root: its users read its buffer */
                if (found >= 0)
                    return -1;
                found = u;
            } else if (!rfi_intlist_push(stack, u)) {
                return -1;
            }
        }
    }
    return found;
}

bool rfi_op_calls_math(rfi_op op)
{
    switch (op) {
    case RFI_OP_EXP:
    case RFI_OP_EXPM1:
    case RFI_OP_LOG:
    case RFI_OP_LOG1P:
    case RFI_OP_TANH:
    case RFI_OP_LOGISTIC:
    case RFI_OP_SIN:
    case RFI_OP_COS:
    case RFI_OP_POW:
    case RFI_OP_REM:
        return true;
    default:
        return false;
    }
}

static bool walk_step(rfi_plan_builder *b, const int *roots, int n_roots, rfi_intlist *inputs,
                      rfi_intlist *fused);

/* Whether root l's inline expression calls no math function (fused:
 * scratch): most REDUCE kernel forms compute their results one point at a
 * time, where a vectorised loop would call a function's vector variant (a
 * [16,8] tanh epilogue took 2.1 us per run against 0.1 us as a LOOP step).
 * The reduction is still materialised here, so the walk stops at it. */
static bool arithmetic_epilogue(rfi_plan_builder *b, int l, rfi_intlist *fused)
{
    fused->n = 0;
    if (!walk_step(b, &l, 1, NULL, fused) || rfi_op_calls_math(b->g->nodes[l]->op))
        return false;
    for (int i = 0; i < fused->n; i++)
        if (rfi_op_calls_math(b->g->nodes[fused->v[i]]->op))
            return false;
    return true;
}

/* Whether root l can be computed after a reduction's fold in its step: a
 * plain LOOP root of its own (not a segment root, not an update value, whose
 * in-place write needs a LOOP step) of arithmetic alone. */
static bool takes_reduce_epilogue(rfi_plan_builder *b, int l, rfi_intlist *scratch)
{
    return l >= 0 && b->epi_of[l] < 0 && b->seg_flat[l] < 0 && !b->is_update_value[l] &&
           arithmetic_epilogue(b, l, scratch);
}

/* What makes two reductions siblings (sibling_reductions), as one key:
 * kind, result and operand types and dims, reduced axes. Returns its length. */
#define FORM_KEY_MAX (4 + 3 * RF_MAX_RANK)
static int reduction_form(const rfi_node *n, int64_t *key)
{
    const rfi_node *x = n->in[0];
    int i = 0;
    key[i++] = n->attr.i[0];
    key[i++] = (int64_t)n->dtype << 8 | x->dtype;
    key[i++] = n->rank;
    key[i++] = (int64_t)x->rank << 8 | n->attr.nl[0];
    for (int d = 0; d < n->rank; d++)
        key[i++] = n->dims[d];
    for (int d = 0; d < x->rank; d++)
        key[i++] = x->dims[d];
    for (int d = 0; d < n->attr.nl[0]; d++)
        key[i++] = n->attr.l[0][d];
    return i;
}

/* Orders REDUCE nodes by form: siblings become neighbours. */
static int compare_reduction_forms(const void *pa, const void *pb)
{
    int64_t ka[FORM_KEY_MAX], kb[FORM_KEY_MAX];
    int na = reduction_form(*(const rfi_node *const *)pa, ka);
    int nb = reduction_form(*(const rfi_node *const *)pb, kb);
    for (int i = 0; i < na && i < nb; i++)
        if (ka[i] != kb[i])
            return ka[i] < kb[i] ? -1 : 1;
    return (na > nb) - (na < nb);
}

/* has_sibling[x]: another materialised reduction could fold beside x in one
 * step (sibling_reductions); x then stays a step root, since a shared pass
 * over the operands saves more than an epilogue does. Sorting the
 * reductions by form finds them in O(r log r). false only on OOM. */
static bool find_possible_siblings(const rfi_plan_builder *b, bool *has_sibling)
{
    if (!b->opts.sibling_reductions)
        return true;
    const rfi_node **reds = rfi_malloc((size_t)(b->n > 0 ? b->n : 1) * sizeof *reds);
    if (!reds)
        return false;
    int r = 0;
    for (int x = 0; x < b->n; x++)
        if (b->g->nodes[x]->op == RFI_OP_REDUCE && b->g->nodes[x]->rank <= 2 && b->mat[x])
            reds[r++] = b->g->nodes[x];
    if (r > 1)
        qsort(reds, (size_t)r, sizeof *reds, compare_reduction_forms);
    for (int i = 1; i < r; i++)
        if (compare_reduction_forms(&reds[i - 1], &reds[i]) == 0)
            has_sibling[reds[i - 1]->id] = has_sibling[reds[i]->id] = true;
    rfi_free(reds);
    return true;
}

/* Whether r is a reduction a REDUCE epilogue can follow: a REDUCE or loop
 * DOT_GENERAL step's node of rank <= 2 (its result keeps the plain layout)
 * that is neither a result nor read by a call, and has no sibling. */
static bool reduction_with_epilogue(const rfi_plan_builder *b, int r, const bool *has_sibling)
{
    const rfi_node *n = b->g->nodes[r];
    return (n->op == RFI_OP_REDUCE || n->op == RFI_OP_DOT_GENERAL) &&
           step_kind(b, n) == RFI_STEP_REDUCE && n->rank <= 2 && rfi_node_numel(n) > 0 &&
           b->mat[r] && !b->is_output[r] && !b->is_update_value[r] && !b->epi_inline[r] &&
           !has_sibling[r];
}

/* Makes every reduction whose value one LOOP root alone reads inline in the
 * REDUCE step that then computes that root (plan.h reduce_epilogues): an
 * epilogue chain of no ops whose core is the reduction. false only on OOM. */
static bool find_reduce_epilogues(rfi_plan_builder *b)
{
    if (!b->opts.reduce_epilogues)
        return true;
    rfi_intlist stack = {0};
    bool *has_sibling = rfi_calloc((size_t)b->n + 1, sizeof *has_sibling);
    bool ok = has_sibling && find_possible_siblings(b, has_sibling);
    for (int r = 0; ok && r < b->n; r++) {
        if (!reduction_with_epilogue(b, r, has_sibling))
            continue;
        int l = reduce_consumer(b, r, &stack);
        if (!takes_reduce_epilogue(b, l, &stack))
            continue;
        void *epis = b->epis;
        ok = rfi_grow(&epis, b->n_epis, &b->cap_epis, sizeof *b->epis);
        if (!ok)
            break;
        b->epis = epis;
        b->epis[b->n_epis] = (rfi_epi_chain){.core = r, .n = 0};
        b->epi_of[l] = b->n_epis++;
        b->epi_inline[r] = true;
        b->mat[r] = false;
    }
    rfi_intlist_free(&stack);
    rfi_free(has_sibling);
    return ok;
}

/* Roots of x seen through user u: 1 for a materialised user, else u's own
 * count (capped at FAN_CAP). */
static int user_fan(const rfi_plan_builder *b, const int *fan, int u)
{
    return b->mat[u] ? 1 : fan[u];
}

/* Decides an unforced fusible non-leaf node (users already decided). fan[x]
 * bounds the number of materialised roots whose inline expression contains x
 * (the sum over its users, so a diamond counts twice): a node inline under
 * several roots is evaluated once per root when they fall in different steps,
 * and along a chain of shared subexpressions (the backward pass of a
 * recurrence unrolled over T steps, where each dh_t feeds dh_(t-1) and that
 * step's gate gradients) that count grows by one per link, which made every
 * root re-evaluate the whole chain before it: O(T^2) work and generated code.
 * A non-cheap node whose fan would exceed MAX_INLINE_FAN is materialised. */
enum { MAX_INLINE_FAN = 8, FAN_CAP = 1 << 20 };

static bool reduces_operand(const rfi_node *u, const rfi_node *x)
{
    return u->op == RFI_OP_REDUCE && u->n_in >= 1 && u->in[0] == x;
}

/* Whether a loop over x reads its operand y as a stream of x's size: not a
 * scalar, nor a broadcast of a smaller value (a mask, a row's max), which
 * stays in cache. */
static bool full_operand(const rfi_node *x, const rfi_node *y)
{
    bool small = y->rank == 0 || rfi_node_numel(y) < rfi_node_numel(x) ||
                 (y->op == RFI_OP_BROADCAST_IN_DIM && rfi_node_numel(y->in[0]) < rfi_node_numel(y));
    return !small;
}

/* How many of x's operands it reads as such streams. */
static int full_operands(const rfi_node *x)
{
    int n = 0;
    for (int k = 0; k < x->n_in; k++)
        n += full_operand(x, x->in[k]);
    return n;
}

/* Whether x is a transpose that moves its last dim and that a convolution
 * computed as loops reads (rfi_plan_conv_as_loops): inline, each term of the
 * convolution's rows would load it a whole stride apart (a ConvNeXt block's
 * depthwise weight gradient reading its cotangent from channels last: 53 ms
 * of gathers); stored, its rows are contiguous. */
static bool strided_conv_operand(const rfi_plan_builder *b, const rfi_node *x, const int *us,
                                 int n_users)
{
    if (x->op != RFI_OP_TRANSPOSE || x->rank < 2 || x->attr.l[0][x->rank - 1] == x->rank - 1)
        return false;
    for (int k = 0; k < n_users; k++) {
        const rfi_node *u = b->g->nodes[us[k]];
        if (u->op == RFI_OP_CONVOLUTION && rfi_plan_conv_as_loops(u))
            return true;
    }
    return false;
}

/* The streams of x's size an inline x reads (at most `most` + 1 counted):
 * its full operands (full_operands), each one stream when a leaf, forced or
 * not fusible, else what it reads inline in turn (operands are decided after
 * their users, so this assumes the most reading). */
static int inline_streams(const bool *forced, const rfi_node *x, int most, int depth)
{
    int n = 0;
    for (int k = 0; k < x->n_in && n <= most; k++) {
        const rfi_node *y = x->in[k];
        if (!full_operand(x, y))
            continue;
        if (y->n_in == 0 || !is_fusible(y->op) || forced[y->id] || depth == 0)
            n++;
        else
            n += inline_streams(forced, y, most - n, depth - 1);
    }
    return n;
}

/* The steps that would evaluate x inline, estimated from the materialised roots
 * reached through its inline users: REDUCE roots of one form (operand and
 * result shapes) join one REDUCE step as siblings; each other root counts as
 * a step of its own (two elementwise roots of one shape may be a layer's
 * input gradient and, after a convolution that reads it, the next layer's).
 * More than `most` (or a walk over budget) gives most + 1. */
static int evaluating_steps(const rfi_plan_builder *b, int x, int most)
{
    const rfi_node *seen[8];
    bool seen_reduce[8];
    int n_seen = 0, stack[64], top = 0, budget = 256;
    assert(most < 8);
    int n_users = b->user_start[x + 1] - b->user_start[x];
    for (int k = 0; k < n_users && top < 64; k++)
        stack[top++] = b->users[b->user_start[x] + k];
    if (top < n_users)
        return most + 1;
    while (top > 0) {
        if (--budget < 0)
            return most + 1;
        int u = stack[--top];
        const rfi_node *un = b->g->nodes[u];
        if (!b->mat[u]) {
            int m = b->user_start[u + 1] - b->user_start[u];
            if (top + m > 64)
                return most + 1;
            for (int k = 0; k < m; k++)
                stack[top++] = b->users[b->user_start[u] + k];
            continue;
        }
        bool red = un->op == RFI_OP_REDUCE;
        bool known = false;
        for (int k = 0; k < n_seen && !known; k++)
            known = red && seen_reduce[k] && rfi_node_same_dims(seen[k], un) &&
                    rfi_node_same_dims(seen[k]->in[0], un->in[0]);
        if (known)
            continue;
        if (n_seen == most || !(red || is_elementwise(un->op)))
            return most + 1;
        seen[n_seen] = un;
        seen_reduce[n_seen++] = red;
    }
    return n_seen;
}

/* Whether x, which reads two streams of its size and no math function, is
 * cheaper inline: evaluated by at most two steps, it costs each step those
 * two streams (four reads), where storing it costs them, a write, and a read
 * back in each step (five). BatchNorm's backward after a relu: the masked
 * gradient select(y > 0, g, 0) is read by the step of its sums and by the
 * input gradient's loop (in the ResNet example's step, 0.3-0.4 ms less per
 * 16-channel layer at 28x28). */
static bool two_streams_twice(const rfi_plan_builder *b, const bool *forced, const rfi_node *x,
                              bool under_shared)
{
    return b->opts.inline_reduce_operands && !under_shared && !rfi_op_calls_math(x->op) &&
           full_operands(x) == 2 && inline_streams(forced, x, 2, 4) <= 2 &&
           evaluating_steps(b, x->id, 2) <= 2;
}

/* shared[x]: x is inline in the operand of a REDUCE and also in another step
 * (the REDUCE rule of decide_fusible), or under such a node: each of those
 * steps evaluates it. */
static void decide_fusible(rfi_plan_builder *b, const bool *forced, int *sites, int *fan,
                           bool *shared, int x)
{
    const rfi_node *node = b->g->nodes[x];
    int n_users = b->user_start[x + 1] - b->user_start[x];
    const int *us = b->users + b->user_start[x];
    int f = 0;
    bool under_shared = false;
    for (int k = 0; k < n_users; k++) {
        f += user_fan(b, fan, us[k]);
        if (f > FAN_CAP)
            f = FAN_CAP;
        if (!b->mat[us[k]] && shared[us[k]])
            under_shared = true;
    }
    if (strided_conv_operand(b, node, us, n_users)) {
        b->mat[x] = true;
        return;
    }
    if (is_cheap(node->op) || node->rank == 0) {
        int total = 0;
        for (int k = 0; k < n_users; k++)
            total += user_sites(b, sites, node, us[k]);
        sites[x] = total > 2 ? 2 : total;
        fan[x] = f;
        shared[x] = under_shared;
        return;
    }
    bool all_single = true, all_elementwise = true, all_read_once = true;
    for (int k = 0; k < n_users; k++) {
        const rfi_node *u = b->g->nodes[us[k]];
        if (user_sites(b, sites, node, us[k]) > 1)
            all_single = false;
        if (!is_elementwise(u->op) || !rfi_node_same_dims(u, node)) {
            all_elementwise = false;
            if (!reduces_operand(u, node))
                all_read_once = false;
        }
    }
    /* A math function evaluated once per step that reads it costs more than
     * the memory traffic its buffer saves, and so does an expression that
     * reads more than one stream of its size (a residual add). */
    bool costly = rfi_op_calls_math(node->op) || full_operands(node) > 1;
    if (costly && two_streams_twice(b, forced, node, under_shared))
        costly = false;
    if (costly && under_shared) {
        b->mat[x] = true;
    } else if (all_single && (n_users <= 1 || (all_elementwise && f <= MAX_INLINE_FAN))) {
        sites[x] = 1;
        fan[x] = f;
        shared[x] = under_shared;
    } else if (all_single && all_read_once && !costly && f <= MAX_INLINE_FAN &&
               b->opts.inline_reduce_operands) {
        sites[x] = 1;
        fan[x] = f;
        shared[x] = true;
    } else {
        b->mat[x] = true;
    }
}

static void decide_leaf(rfi_plan_builder *b, const bool *forced, int x)
{
    const rfi_node *node = b->g->nodes[x];
    rfi_loc *loc = &b->p->loc[x];
    switch (node->op) {
    case RFI_OP_ARGUMENT:
        b->mat[x] = true;
        loc->kind = RFI_LOC_ARG;
        loc->index = (int)node->attr.i[0];
        break;
    case RFI_OP_CAPTURE:
        b->mat[x] = true;
        loc->kind = RFI_LOC_CAPTURE;
        loc->index = (int)node->attr.i[0];
        break;
    case RFI_OP_CONSTANT:
        if (forced[x] || node->rank > 0) {
            b->mat[x] = true;
            loc->kind = RFI_LOC_CONST; /* index: numbered in id order below */
        }
        break;
    default: /* IOTA: inline unless forced (then a LOOP root) */
        b->mat[x] = forced[x];
        break;
    }
}

static void make_aliases(rfi_plan_builder *b)
{
    for (int x = 0; x < b->n; x++) {
        const rfi_node *node = b->g->nodes[x];
        if ((node->op != RFI_OP_RESHAPE && node->op != RFI_OP_STOP_GRADIENT) ||
            b->is_output[x] || !b->mat[node->in[0]->id])
            continue;
        b->mat[x] = true;
        b->p->loc[x].kind = RFI_LOC_ALIAS;
        b->p->loc[x].alias = rfi_plan_resolve(b, node->in[0]->id);
    }
}

static rf_status number_consts(rfi_plan_builder *b)
{
    int n = 0;
    for (int x = 0; x < b->n; x++)
        if (b->p->loc[x].kind == RFI_LOC_CONST)
            n++;
    b->p->consts = rfi_arena_alloc(&b->p->mem, (size_t)(n > 0 ? n : 1) * sizeof(int));
    if (!b->p->consts)
        return rfi_error(RF_E_NOMEM, "plan: out of memory");
    b->p->n_consts = 0;
    for (int x = 0; x < b->n; x++) {
        if (b->p->loc[x].kind == RFI_LOC_CONST) {
            b->p->loc[x].index = b->p->n_consts;
            b->p->consts[b->p->n_consts++] = x;
        }
    }
    return RF_OK;
}

/* ---- Segment roots ----------------------------------------------------------------------- */

/* Bounds the node visits of one segment-root walk (shared subexpressions may be
 * seen more than once); a walk over budget just finds no segment. */
#define SEGMENT_WALK_BUDGET 4096

/* Whether root v reads a rank-1 node only through one stride-1 slice, at v's
 * own row-major linear index: v = f(reshape(slice(F, off))) where every other
 * inline node on the way is elementwise or a reshape of v's element count,
 * a broadcast of a scalar or a scalar, and every materialised input has v's
 * element count or is a scalar. Then *flat = F, *off = the slice's start. */
static bool segment_source(const rfi_plan_builder *b, int v, int *flat, int64_t *off)
{
    const rfi_node *vn = b->g->nodes[v];
    int64_t numel = rfi_node_numel(vn);
    if (is_leaf(vn) || !is_fusible(vn->op))
        return false;
    rfi_intlist stack = {0};
    bool ok = rfi_intlist_push(&stack, v);
    int visits = 0;
    *flat = -1;
    while (ok && stack.n > 0) {
        const rfi_node *u = b->g->nodes[stack.v[--stack.n]];
        if (++visits > SEGMENT_WALK_BUDGET) {
            ok = false;
            break;
        }
        if (u->op == RFI_OP_SLICE) {
            const rfi_node *f = u->in[0];
            int64_t start = u->attr.l[0][0];
            ok = u->rank == 1 && f->rank == 1 && u->attr.l[2][0] == 1 &&
                 (*flat < 0 || (*flat == f->id && *off == start));
            *flat = f->id;
            *off = start;
            continue;
        }
        if (u->op == RFI_OP_BROADCAST_IN_DIM) {
            ok = u->in[0]->rank == 0;
            continue;
        }
        ok = is_elementwise(u->op) || u->op == RFI_OP_RESHAPE;
        for (int k = 0; ok && k < u->n_in; k++) {
            const rfi_node *y = u->in[k];
            if (y->rank == 0)
                continue;
            ok = rfi_node_numel(y) == numel && y->op != RFI_OP_IOTA;
            if (ok && !b->mat[y->id] && !is_leaf(y)) /* leaves: buffers (decided later) */
                ok = rfi_intlist_push(&stack, y->id);
        }
    }
    rfi_intlist_free(&stack);
    return ok && *flat >= 0;
}

/* A rank-1 node f just materialised by the usual rules becomes inline when every
 * materialised node it reaches through inline users is a segment root of f (the
 * per-parameter pieces of a flat optimiser update): those roots compute f's
 * elements inside one segmented loop over f's shape, and f needs no buffer. */
static bool make_segment_source(rfi_plan_builder *b, int f)
{
    const rfi_node *fn = b->g->nodes[f];
    if (fn->rank != 1 || fn->dims[0] < 1 || is_leaf(fn))
        return false;
    int gen = ++b->stamp_gen;
    rfi_intlist stack = {0}, roots = {0};
    bool ok = rfi_intlist_push(&stack, f);
    while (ok && stack.n > 0) {
        int u = stack.v[--stack.n];
        for (int j = b->user_start[u]; ok && j < b->user_start[u + 1]; j++) {
            int w = b->users[j];
            if (b->stamp[w] == gen)
                continue;
            b->stamp[w] = gen;
            int flat = -1;
            int64_t off = 0;
            if (!b->mat[w])
                ok = rfi_intlist_push(&stack, w);
            else
                ok = segment_source(b, w, &flat, &off) && flat == f &&
                     rfi_intlist_push(&roots, w);
        }
    }
    ok = ok && roots.n > 0;
    for (int r = 0; ok && r < roots.n; r++) {
        int flat = -1;
        segment_source(b, roots.v[r], &flat, &b->seg_off[roots.v[r]]);
        b->seg_flat[roots.v[r]] = f;
    }
    rfi_intlist_free(&stack);
    rfi_intlist_free(&roots);
    return ok;
}

/* The materialisation decisions, from the users down, after the CALL
 * epilogues; false only on OOM. */
static bool decide_all(rfi_plan_builder *b, bool *forced, int *sites, int *fan, bool *shared)
{
    if (!find_epilogues(b, forced))
        return false;
    for (int x = b->n - 1; x >= 0; x--) {
        const rfi_node *node = b->g->nodes[x];
        if (b->epi_inline[x])
            sites[x] = fan[x] = 1; /* computed inside its CALL step */
        else if (is_leaf(node))
            decide_leaf(b, forced, x);
        else if (forced[x])
            b->mat[x] = true;
        else
            decide_fusible(b, forced, sites, fan, shared, x);
        if (!forced[x] && !b->epi_inline[x] && b->mat[x] && !is_leaf(node) &&
            make_segment_source(b, x)) {
            b->mat[x] = false;
            sites[x] = fan[x] = 1;
        }
    }
    return true;
}

rf_status rfi_fuse_decide(rfi_plan_builder *b)
{
    bool *forced = rfi_calloc((size_t)b->n + 1, sizeof *forced);
    int *sites = rfi_calloc((size_t)b->n + 1, sizeof *sites);
    int *fan = rfi_calloc((size_t)b->n + 1, sizeof *fan);
    bool *shared = rfi_calloc((size_t)b->n + 1, sizeof *shared);
    rf_status st = RF_OK;
    if (!forced || !sites || !fan || !shared)
        st = rfi_error(RF_E_NOMEM, "plan: out of memory");
    for (int x = 0; st == RF_OK && x < b->n; x++)
        if (b->g->nodes[x]->op == RFI_OP_GRAD)
            st = rfi_error(RF_E_INTERNAL, "plan: node %%%d is a grad (run autodiff first)", x);
    if (st == RF_OK) {
        mark_forced(b, forced);
        if (!decide_all(b, forced, sites, fan, shared))
            st = rfi_error(RF_E_NOMEM, "plan: out of memory");
    }
    if (st == RF_OK && !find_reduce_epilogues(b))
        st = rfi_error(RF_E_NOMEM, "plan: out of memory");
    if (st == RF_OK) {
        make_aliases(b);
        st = number_consts(b);
    }
    rfi_free(forced);
    rfi_free(sites);
    rfi_free(fan);
    rfi_free(shared);
    return st;
}

/* ---- Graph walks ------------------------------------------------------------------------ */

/* Walks the inline producers of `roots`: inputs (materialised nodes read,
 * aliases resolved) go to `inputs`, inline nodes to `fused` (either may be
 * NULL). Lists are appended without duplicates. */
static bool walk_step(rfi_plan_builder *b, const int *roots, int n_roots, rfi_intlist *inputs,
                      rfi_intlist *fused)
{
    int gen = ++b->stamp_gen;
    rfi_intlist stack = {0};
    bool ok = true;
    for (int r = 0; r < n_roots; r++) {
        b->stamp[roots[r]] = gen;
        ok = ok && rfi_intlist_push(&stack, roots[r]);
    }
    while (ok && stack.n > 0) {
        const rfi_node *u = b->g->nodes[stack.v[--stack.n]];
        for (int k = 0; ok && k < u->n_in; k++) {
            int y = u->in[k]->id;
            if (b->stamp[y] == gen)
                continue;
            b->stamp[y] = gen;
            if (b->mat[y]) {
                int t = rfi_plan_resolve(b, y);
                if (inputs && !rfi_intlist_has(inputs, t))
                    ok = rfi_intlist_push(inputs, t);
            } else {
                ok = (!fused || rfi_intlist_push(fused, y)) && rfi_intlist_push(&stack, y);
            }
        }
    }
    rfi_intlist_free(&stack);
    return ok;
}

bool rfi_fuse_step_fused(rfi_plan_builder *b, int s, rfi_intlist *out)
{
    const rfi_bstep *st = &b->steps[s];
    if (st->kind == RFI_STEP_COPY)
        return true;
    return walk_step(b, st->roots.v, st->roots.n, NULL, out);
}

/* ---- Steps ------------------------------------------------------------------------------- */

static int new_step(rfi_plan_builder *b, rfi_step_kind kind, rfi_call_kind call)
{
    if (b->n_steps == b->cap_steps) {
        int cap = b->cap_steps ? 2 * b->cap_steps : 32;
        rfi_bstep *s = rfi_realloc(b->steps, (size_t)cap * sizeof *s);
        if (s)
            b->steps = s;
        int *o = s ? rfi_realloc(b->order, (size_t)cap * sizeof *o) : NULL;
        if (o)
            b->order = o;
        int *pos = o ? rfi_realloc(b->pos_of, (size_t)cap * sizeof *pos) : NULL;
        if (!pos)
            return -1;
        b->pos_of = pos;
        b->cap_steps = cap;
    }
    int id = b->n_steps++;
    rfi_bstep *st = &b->steps[id];
    memset(st, 0, sizeof *st);
    st->kind = kind;
    st->call = call;
    st->copy_to_output = -1;
    st->copy_to_capture = -1;
    st->copy_scratch = RFI_COPY_DIRECT;
    st->epi = -1;
    b->order[id] = id; /* steps are appended at the end of the order */
    b->pos_of[id] = id;
    return id;
}

static bool lists_meet(const rfi_intlist *a, const rfi_intlist *c)
{
    for (int i = 0; i < a->n; i++)
        if (rfi_intlist_has(c, a->v[i]))
            return true;
    return false;
}

/* True if a step after position pos reads a root of step s. */
static bool roots_read_later(const rfi_plan_builder *b, int s, int pos)
{
    for (int q = pos + 1; q < b->n_steps; q++)
        if (lists_meet(&b->steps[s].roots, &b->steps[b->order[q]].inputs))
            return true;
    return false;
}

/* The node whose shape a LOOP root's loop runs over: its flat vector for a
 * segment root, else itself. */
static const rfi_node *loop_shape(const rfi_plan_builder *b, int x)
{
    return b->g->nodes[b->seg_flat[x] >= 0 ? b->seg_flat[x] : x];
}

/* How far back (in steps) a root looks for a step to join: bounds the
 * planner's time on long programs. */
#define JOIN_WINDOW 256

/* Whether reductions a and b are siblings: one kind, one operand shape and
 * type, one set of reduced axes, so one pass over the operand's points can
 * fold both. Results of rank <= 2 only: they keep the plain layout. */
static bool sibling_reductions(const rfi_node *a, const rfi_node *b)
{
    return a->op == RFI_OP_REDUCE && b->op == RFI_OP_REDUCE && a->rank <= 2 &&
           compare_reduction_forms(&a, &b) == 0;
}

/* Whether root x could run in step st: a LOOP root in a LOOP step of its
 * shape, a reduction in a REDUCE step of its siblings with room for one more. */
static bool step_takes(const rfi_plan_builder *b, const rfi_bstep *st, int x)
{
    const rfi_node *first = b->g->nodes[st->roots.v[0]];
    if (st->kind == RFI_STEP_LOOP)
        return rfi_node_same_dims(loop_shape(b, st->roots.v[0]), loop_shape(b, x));
    return st->kind == RFI_STEP_REDUCE && st->epi < 0 && st->roots.n < RFI_MAX_SIBLINGS &&
           sibling_reductions(first, b->g->nodes[x]);
}

/* The last position of a step other than `except` that produces one of
 * `inputs` (-1: none). */
static int ready_pos(const rfi_plan_builder *b, const rfi_intlist *inputs, int except)
{
    int ready = -1;
    for (int i = 0; i < inputs->n; i++) {
        int s = b->step_of[inputs->v[i]];
        int pos = s >= 0 && s != except ? rfi_plan_step_pos(b, s) : -1;
        ready = pos > ready ? pos : ready;
    }
    return ready;
}

static bool reads_roots_in_place(const rfi_plan_builder *b, int s, int x);

/* The step root x (reading `inputs`, of kind `kind`) joins, or -1; *move says
 * the step must first move to the end of the order. A LOOP root may join the
 * LOOP step whose roots it reads where they are computed (reads_roots_in_place):
 * the kernel computes a root of its own step where another reads it rather than
 * loading it (kir_lower.c), so the parameter update an unguarded optimiser step
 * derives from the new moments runs in the moments' loop, and they go in place. */
static int find_step_to_join(const rfi_plan_builder *b, int x, rfi_step_kind kind,
                             const rfi_intlist *inputs, bool *move)
{
    int ready = ready_pos(b, inputs, -1);
    int stop = b->n_steps > JOIN_WINDOW ? b->n_steps - JOIN_WINDOW : 0;
    for (int pos = b->n_steps - 1; pos >= stop; pos--) {
        int s = b->order[pos];
        const rfi_bstep *st = &b->steps[s];
        bool reads_roots = kind == RFI_STEP_LOOP && lists_meet(inputs, &st->roots);
        if (st->kind != kind || !step_takes(b, st, x) ||
            (!lists_meet(inputs, &st->inputs) && !reads_roots))
            continue;
        if (pos > ready ||
            (reads_roots && pos > ready_pos(b, inputs, s) && reads_roots_in_place(b, s, x))) {
            *move = false;
            return s;
        }
        if (!lists_meet(inputs, &st->roots) && !roots_read_later(b, s, pos)) {
            *move = true;
            return s;
        }
    }
    return -1;
}

static void move_to_end(rfi_plan_builder *b, int s)
{
    int pos = rfi_plan_step_pos(b, s);
    memmove(b->order + pos, b->order + pos + 1, (size_t)(b->n_steps - 1 - pos) * sizeof(int));
    b->order[b->n_steps - 1] = s;
    for (int q = pos; q < b->n_steps; q++)
        b->pos_of[b->order[q]] = q;
}

/* Adds root x to step s; of x's inputs, the step's own roots are computed in
 * it, not read. */
static bool join_step(rfi_plan_builder *b, int s, int x, const rfi_intlist *inputs)
{
    rfi_bstep *st = &b->steps[s];
    for (int i = 0; i < inputs->n; i++)
        if (b->step_of[inputs->v[i]] != s && !rfi_intlist_has(&st->inputs, inputs->v[i]) &&
            !rfi_intlist_push(&st->inputs, inputs->v[i]))
            return false;
    b->step_of[x] = s;
    return rfi_intlist_push(&st->roots, x);
}

static rf_status schedule_root(rfi_plan_builder *b, int x)
{
    const rfi_node *node = b->g->nodes[x];
    int epi = b->epi_of[x];
    const rfi_node *core = epi >= 0 ? b->g->nodes[b->epis[epi].core] : node;
    rfi_step_kind kind = step_kind(b, core);
    rfi_intlist inputs = {0};
    rf_status st = RF_OK;
    if (!walk_step(b, &x, 1, &inputs, NULL))
        st = rfi_error(RF_E_NOMEM, "plan: out of memory");
    bool move = false;
    int s = -1;
    if (st == RF_OK && (kind == RFI_STEP_LOOP ||
                        (kind == RFI_STEP_REDUCE && epi < 0 && b->opts.sibling_reductions)))
        s = find_step_to_join(b, x, kind, &inputs, &move);
    if (st == RF_OK && s >= 0 && move)
        move_to_end(b, s);
    if (st == RF_OK && s < 0) {
        s = new_step(b, kind, call_kind(b, core));
        if (s >= 0)
            b->steps[s].epi = epi;
    }
    if (st == RF_OK && (s < 0 || !join_step(b, s, x, &inputs)))
        st = rfi_error(RF_E_NOMEM, "plan: out of memory");
    rfi_intlist_free(&inputs);
    return st;
}

rf_status rfi_fuse_schedule(rfi_plan_builder *b)
{
    for (int x = 0; x < b->n; x++) {
        const rfi_node *node = b->g->nodes[x];
        bool root = b->mat[x] && (!is_leaf(node) || node->op == RFI_OP_IOTA) &&
                    b->p->loc[x].kind != RFI_LOC_ALIAS;
        if (!root)
            continue;
        rf_status st = schedule_root(b, x);
        if (st != RF_OK)
            return st;
    }
    return RF_OK;
}

/* ---- Outputs and updates ----------------------------------------------------------------- */

/* True if some output or update value is c's bytes (a final copy reads it). */
static bool copy_reads(const rfi_plan_builder *b, int cnode)
{
    const rfi_graph *g = b->g;
    for (int i = 0; i < g->n_outputs; i++)
        if (rfi_plan_resolve(b, g->outputs[i]->id) == cnode)
            return true;
    for (int i = 0; i < g->n_updates; i++)
        if (rfi_plan_resolve(b, g->updates[i].value->id) == cnode)
            return true;
    return false;
}

/* A read position during the rule (2) walk: node `node` is read, per loop
 * iteration i (the flat index of a segmented step, else the root's linear
 * index), at its own linear index i - t; lin = false: at some other index. */
typedef struct read_pos {
    int node;
    int64_t t;
    bool lin;
} read_pos;

/* Where operand k of u is read, given that u is read at `at`. Elementwise ops
 * and reshapes keep the linear index; in a segmented step over [extent], rank-1
 * stride-1 slices and concatenations of that extent shift it (the lowering
 * splits such a step where they change operand, so each read there is direct). */
static read_pos operand_pos(const rfi_node *u, int k, read_pos at, int64_t extent)
{
    const rfi_node *y = u->in[k];
    read_pos r = {y->id, at.t, false};
    if (!at.lin || (y->rank == 0 && u->rank > 0))
        return r;
    if ((is_elementwise(u->op) && rfi_node_same_dims(u, y)) || u->op == RFI_OP_RESHAPE ||
        u->op == RFI_OP_STOP_GRADIENT) {
        r.lin = true;
    } else if (u->op == RFI_OP_SLICE && extent > 0 && u->rank == 1 && y->dims[0] == extent &&
               u->attr.l[2][0] == 1) {
        r.lin = true;
        r.t = at.t - u->attr.l[0][0];
    } else if (u->op == RFI_OP_CONCATENATE && extent > 0 && u->rank == 1 &&
               u->dims[0] == extent) {
        int64_t start = 0;
        for (int j = 0; j < k; j++)
            start += u->in[j]->dims[0];
        r.lin = true;
        r.t = at.t + start;
    }
    return r;
}

static bool push_pos(read_pos **stack, int *n, int *cap, read_pos x)
{
    if (*n == *cap) {
        int ncap = *cap ? 2 * *cap : 64;
        read_pos *v = rfi_realloc(*stack, (size_t)ncap * sizeof *v);
        if (!v)
            return false;
        *stack = v;
        *cap = ncap;
    }
    (*stack)[(*n)++] = x;
    return true;
}

/* The root of step s that node y is, or whose bytes it aliases; else -1. */
static int root_in_step(const rfi_plan_builder *b, int s, int y)
{
    const rfi_loc *loc = &b->p->loc[y];
    if (b->mat[y] && b->step_of[y] == s)
        return y;
    return b->mat[y] && loc->kind == RFI_LOC_ALIAS && b->step_of[loc->alias] == s ? loc->alias
                                                                                  : -1;
}

/* Whether LOOP root x, were it to join LOOP step s, would read each root of s
 * it reaches only where that root is computed in the same iteration (so the
 * kernel computes it once for both, hash-consed; elsewhere it would compute it
 * again), through inline nodes and within the walk's budget. */
static bool reads_roots_in_place(const rfi_plan_builder *b, int s, int x)
{
    const rfi_bstep *st = &b->steps[s];
    int64_t extent = b->seg_flat[x] >= 0 ? b->g->nodes[b->seg_flat[x]]->dims[0] : 0;
    for (int r = 0; extent == 0 && r < st->roots.n; r++)
        if (b->seg_flat[st->roots.v[r]] >= 0)
            extent = b->g->nodes[b->seg_flat[st->roots.v[r]]]->dims[0];
    read_pos *stack = NULL;
    int n = 0, cap = 0, visits = 0;
    read_pos start = {x, b->seg_flat[x] >= 0 ? b->seg_off[x] : 0, true};
    bool ok = push_pos(&stack, &n, &cap, start);
    while (ok && n > 0) {
        read_pos at = stack[--n];
        const rfi_node *u = b->g->nodes[at.node];
        ok = ++visits <= SEGMENT_WALK_BUDGET;
        for (int k = 0; ok && k < u->n_in; k++) {
            read_pos y = operand_pos(u, k, at, extent);
            int r = root_in_step(b, s, y.node);
            if (r >= 0)
                ok = y.lin && y.t == (b->seg_flat[r] >= 0 ? b->seg_off[r] : 0);
            else if (!b->mat[y.node])
                ok = push_pos(&stack, &n, &cap, y);
        }
    }
    rfi_free(stack);
    return ok;
}

/* Rule (2): in step s, every read of capture node cnode (directly or through an
 * alias) that reaches a root is at the position update value v writes: the
 * same linear index (for a segment root, the same flat position). seen:
 * scratch per node (1: visited at offset 0, 2: at a non-linear position). */
static bool reads_capture_at_identity(const rfi_plan_builder *b, int s, int cnode, int v,
                                      unsigned char *seen)
{
    const rfi_bstep *st = &b->steps[s];
    int64_t extent = 0, target = b->seg_flat[v] >= 0 ? b->seg_off[v] : 0;
    for (int r = 0; r < st->roots.n; r++)
        if (b->seg_flat[st->roots.v[r]] >= 0)
            extent = b->g->nodes[b->seg_flat[st->roots.v[r]]]->dims[0];
    read_pos *stack = NULL;
    int n = 0, cap = 0, visits = 0;
    bool safe = true;
    for (int r = 0; safe && r < st->roots.n; r++) {
        int x = st->roots.v[r];
        read_pos at = {x, b->seg_flat[x] >= 0 ? b->seg_off[x] : 0, true};
        safe = push_pos(&stack, &n, &cap, at);
    }
    while (safe && n > 0) {
        read_pos at = stack[--n];
        const rfi_node *u = b->g->nodes[at.node];
        safe = ++visits <= 16 * SEGMENT_WALK_BUDGET;
        for (int k = 0; safe && k < u->n_in; k++) {
            read_pos y = operand_pos(u, k, at, extent);
            const rfi_loc *loc = &b->p->loc[y.node];
            if (y.node == cnode || (b->mat[y.node] && loc->kind == RFI_LOC_ALIAS &&
                                    loc->alias == cnode)) {
                safe = y.lin && y.t == target;
            } else if (!b->mat[y.node] || root_in_step(b, s, y.node) >= 0) {
                /* inline, or a root of this step (or its alias): computed here at y too */
                unsigned char mark = !y.lin ? 2 : y.t == 0 ? 1 : 0;
                if (!mark || !(seen[y.node] & mark)) {
                    seen[y.node] |= mark;
                    safe = push_pos(&stack, &n, &cap, y);
                }
            }
        }
    }
    rfi_free(stack);
    return safe;
}

static int updates_with_value(const rfi_graph *g, int v)
{
    int n = 0;
    for (int i = 0; i < g->n_updates; i++)
        n += g->updates[i].value->id == v;
    return n;
}

/* The in-place rules (1)-(4) of the header for the update capture c <- v. */
static bool can_update_in_place(const rfi_plan_builder *b, int c, int v, rf_status *st)
{
    const rfi_graph *g = b->g;
    int s = b->step_of[v];
    if (!b->opts.in_place_updates || s < 0 || b->steps[s].kind != RFI_STEP_LOOP ||
        b->placed[v] || b->is_output[v] || updates_with_value(g, v) != 1)
        return false;
    const rf_array *a = g->captures[c];
    const rfi_node *vn = g->nodes[v];
    if (a->rank != vn->rank || a->dtype != vn->dtype ||
        memcmp(a->dims, vn->dims, (size_t)a->rank * sizeof a->dims[0]) != 0)
        return false;
    const rfi_node *cn = g->capture_nodes[c];
    int pos = rfi_plan_step_pos(b, s);
    for (int q = pos + 1; q < b->n_steps; q++) {
        const rfi_bstep *later = &b->steps[b->order[q]];
        if (later->kind == RFI_STEP_CALL || rfi_intlist_has(&later->inputs, v) ||
            (cn && rfi_intlist_has(&later->inputs, cn->id)))
            return false;
    }
    if (!cn)
        return true; /* nothing reads the old value */
    if (copy_reads(b, cn->id))
        return false;
    unsigned char *seen = rfi_calloc((size_t)b->n + 1, 1);
    if (!seen) {
        *st = rfi_error(RF_E_NOMEM, "plan: out of memory");
        return false;
    }
    bool ok = reads_capture_at_identity(b, s, cn->id, v, seen);
    rfi_free(seen);
    return ok;
}

typedef struct pending_copy {
    int src, to_output, to_capture;
} pending_copy;

static rf_status add_copy_step(rfi_plan_builder *b, const pending_copy *c, rfi_copy_scratch how)
{
    int s = new_step(b, RFI_STEP_COPY, RFI_CALL_NONE);
    if (s < 0 || !rfi_intlist_push(&b->steps[s].roots, c->src) ||
        !rfi_intlist_push(&b->steps[s].inputs, rfi_plan_resolve(b, c->src)))
        return rfi_error(RF_E_NOMEM, "plan: out of memory");
    b->steps[s].copy_to_output = c->to_output;
    b->steps[s].copy_to_capture = c->to_capture;
    b->steps[s].copy_scratch = how;
    return RF_OK;
}

/* Capture index whose bytes `src` is, or -1. */
static int source_capture(const rfi_plan_builder *b, int src)
{
    const rfi_loc *l = &b->p->loc[rfi_plan_resolve(b, src)];
    return l->kind == RFI_LOC_CAPTURE ? l->index : -1;
}

/* Copy i of pc is one capture's bytes into another capture (not itself: that copy
 * changes nothing). */
static bool capture_to_capture(const rfi_plan_builder *b, const pending_copy *c)
{
    int from = c->to_capture >= 0 ? source_capture(b, c->src) : -1;
    return from >= 0 && from != c->to_capture;
}

/* Emits every capture-to-capture copy of pc not done whose target no copy not done still
 * reads; returns whether it emitted any. */
static bool emit_ready_copies(rfi_plan_builder *b, const pending_copy *pc, int n, bool *done,
                              rf_status *st)
{
    bool progress = false;
    for (int i = 0; *st == RF_OK && i < n; i++) {
        if (done[i] || !capture_to_capture(b, &pc[i]))
            continue;
        bool still_read = false;
        for (int j = 0; j < n && !still_read; j++)
            still_read = j != i && !done[j] && capture_to_capture(b, &pc[j]) &&
                         source_capture(b, pc[j].src) == pc[i].to_capture;
        if (!still_read) {
            *st = add_copy_step(b, &pc[i], RFI_COPY_DIRECT);
            done[i] = progress = true;
        }
    }
    return progress;
}

/* Emits the capture-to-capture copies of pc so that each capture is overwritten only
 * after every copy reading its old bytes: a chain a <- b, b <- c runs b's copy last,
 * in whichever order the updates were assigned. A cycle (a <- b, b <- a) is broken
 * by copying one source into the plan's copy scratch first and the scratch into its
 * target once the rest of the cycle is done. */
static rf_status emit_capture_copies(rfi_plan_builder *b, const pending_copy *pc, int n)
{
    bool *done = rfi_calloc((size_t)n + 1, sizeof *done);
    if (!done)
        return rfi_error(RF_E_NOMEM, "plan: out of memory");
    rf_status st = RF_OK;
    int staged = -1;
    while (st == RF_OK) {
        while (emit_ready_copies(b, pc, n, done, &st))
            ;
        if (st != RF_OK)
            break;
        if (staged >= 0) { /* its cycle is done: nothing reads its target any more */
            st = add_copy_step(b, &pc[staged], RFI_COPY_FROM_SCRATCH);
            staged = -1;
            continue;
        }
        for (int i = 0; i < n && staged < 0; i++)
            if (!done[i] && capture_to_capture(b, &pc[i]))
                staged = i;
        if (staged < 0)
            break;
        size_t bytes = rfi_node_nbytes(b->g->nodes[pc[staged].src]);
        if (bytes > b->p->copy_scratch_bytes)
            b->p->copy_scratch_bytes = bytes;
        st = add_copy_step(b, &pc[staged], RFI_COPY_TO_SCRATCH);
        done[staged] = true;
    }
    rfi_free(done);
    return st;
}

/* Appends the copies in the order of the header. */
static rf_status emit_copies(rfi_plan_builder *b, const pending_copy *pc, int n)
{
    rf_status st = RF_OK;
    for (int i = 0; st == RF_OK && i < n; i++)
        if (pc[i].to_output >= 0)
            st = add_copy_step(b, &pc[i], RFI_COPY_DIRECT);
    if (st == RF_OK)
        st = emit_capture_copies(b, pc, n);
    for (int i = 0; st == RF_OK && i < n; i++)
        if (pc[i].to_capture >= 0 && !capture_to_capture(b, &pc[i]))
            st = add_copy_step(b, &pc[i], RFI_COPY_DIRECT);
    return st;
}

rf_status rfi_fuse_place_results(rfi_plan_builder *b)
{
    const rfi_graph *g = b->g;
    int max_copies = g->n_outputs + g->n_updates;
    pending_copy *pc = rfi_calloc((size_t)max_copies + 1, sizeof *pc);
    if (!pc)
        return rfi_error(RF_E_NOMEM, "plan: out of memory");
    int n = 0;
    rf_status st = RF_OK;
    for (int i = 0; i < g->n_outputs; i++) {
        int x = g->outputs[i]->id;
        if (b->step_of[x] >= 0 && !b->placed[x] && !b->is_update_value[x]) {
            b->p->loc[x].kind = RFI_LOC_OUTPUT;
            b->p->loc[x].index = i;
            b->placed[x] = true;
        } else {
            pc[n++] = (pending_copy){x, i, -1};
        }
    }
    for (int i = 0; st == RF_OK && i < g->n_updates; i++) {
        int c = g->updates[i].capture, v = g->updates[i].value->id;
        if (can_update_in_place(b, c, v, &st)) {
            b->p->loc[v].kind = RFI_LOC_IN_PLACE;
            b->p->loc[v].index = c;
            b->placed[v] = true;
        } else {
            pc[n++] = (pending_copy){v, -1, c};
        }
    }
    for (int x = 0; x < b->n; x++) {
        if (b->step_of[x] >= 0 && !b->placed[x]) {
            b->p->loc[x].kind = RFI_LOC_ARENA;
            b->placed[x] = true;
        }
    }
    if (st == RF_OK)
        st = emit_copies(b, pc, n);
    rfi_free(pc);
    return st;
}
