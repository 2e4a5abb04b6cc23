/* print.c: rfi_print, the graph as human-readable text for dumps, tests and
 * error reports:
 *
 *   program mlp (1 args, 2 captures)
 *     arg0: f32[16,4]
 *     capture0: f32[8,4]
 *     capture1: f32[8]
 *   %0 = argument {index=0} : f32[16,4]
 *   %3 = add(%1, %2) : f32[16,8]
 *   %7 = reduce(%6) {kind=sum, axes=[1]} : f32[16]
 *   outputs: %9, %12
 *   update capture0 <- %15
 *
 * Attributes are printed by name; constants show their values when small and
 * a hash of their bytes otherwise. It is not a parser format: nothing reads
 * this text back.
 */
#include "ir.h"

#include <inttypes.h>
#include <string.h>

#include "runtime/runtime.h"

#define SMALL_CONSTANT 8 /* constants up to this many elements print their values */

static void print_list(rfi_strbuf *sb, const char *name, const int64_t *v, int n)
{
    rfi_sb_printf(sb, "%s=[", name);
    for (int i = 0; i < n; i++)
        rfi_sb_printf(sb, i ? ", %lld" : "%lld", (long long)v[i]);
    rfi_sb_printf(sb, "]");
}

/* Prints element i of a payload of dtype dt. */
static void print_element(rfi_strbuf *sb, rf_dtype dt, const void *data, int64_t i)
{
    switch (dt) {
    case RF_F32: {
        float v;
        memcpy(&v, (const char *)data + i * 4, sizeof v);
        rfi_sb_printf(sb, "%.9g", (double)v);
        break;
    }
    case RF_F64: {
        double v;
        memcpy(&v, (const char *)data + i * 8, sizeof v);
        rfi_sb_printf(sb, "%.17g", v);
        break;
    }
    case RF_I32: {
        int32_t v;
        memcpy(&v, (const char *)data + i * 4, sizeof v);
        rfi_sb_printf(sb, "%" PRId32, v);
        break;
    }
    case RF_I64: {
        int64_t v;
        memcpy(&v, (const char *)data + i * 8, sizeof v);
        rfi_sb_printf(sb, "%" PRId64, v);
        break;
    }
    case RF_U8: rfi_sb_printf(sb, "%u", (unsigned)((const uint8_t *)data)[i]); break;
    case RF_BOOL: rfi_sb_printf(sb, "%s", ((const uint8_t *)data)[i] ? "true" : "false"); break;
    default: rfi_sb_printf(sb, "?"); break;
    }
}

static void print_constant(rfi_strbuf *sb, const rfi_node *x)
{
    int64_t n = rfi_node_numel(x);
    if (x->rank == 0 && n == 1) {
        rfi_sb_printf(sb, "value=");
        print_element(sb, x->dtype, x->attr.data, 0);
    } else if (n <= SMALL_CONSTANT) {
        rfi_sb_printf(sb, "values=[");
        for (int64_t i = 0; i < n; i++) {
            if (i)
                rfi_sb_printf(sb, ", ");
            print_element(sb, x->dtype, x->attr.data, i);
        }
        rfi_sb_printf(sb, "]");
    } else {
        uint64_t h = rfi_hash_bytes(RFI_HASH_INIT, x->attr.data, x->attr.nbytes);
        rfi_sb_printf(sb, "bytes=%zu, hash=%016" PRIx64, x->attr.nbytes, h);
    }
    if (x->weak)
        rfi_sb_printf(sb, ", weak");
}

static const char *cmp_name(int64_t dir)
{
    static const char *const names[RF_CMP_COUNT] = {"eq", "ne", "lt", "le", "gt", "ge"};
    return dir >= 0 && dir < RF_CMP_COUNT ? names[dir] : "?";
}

static const char *kind_name(int64_t kind)
{
    static const char *const names[RF_REDUCE_KIND_COUNT] = {"sum", "max", "min",
                                                            "prod", "and", "or"};
    return kind >= 0 && kind < RF_REDUCE_KIND_COUNT ? names[kind] : "?";
}

static void print_window_lists(rfi_strbuf *sb, const rfi_attrs *a)
{
    print_list(sb, "window", a->l[0], a->nl[0]);
    print_list(sb, ", strides", a->l[1], a->nl[1]);
    print_list(sb, ", pad_lo", a->l[2], a->nl[2]);
    print_list(sb, ", pad_hi", a->l[3], a->nl[3]);
}

/* The "{...}" attribute block of x, or nothing for ops without attributes. */
static void print_attrs(rfi_strbuf *sb, const rfi_node *x)
{
    const rfi_attrs *a = &x->attr;
    size_t start = sb->len;
    rfi_sb_printf(sb, " {");
    size_t body = sb->len;
    switch (x->op) {
    case RFI_OP_CONSTANT: print_constant(sb, x); break;
    case RFI_OP_ARGUMENT:
    case RFI_OP_CAPTURE: rfi_sb_printf(sb, "index=%lld", (long long)a->i[0]); break;
    case RFI_OP_IOTA:
    case RFI_OP_CONCATENATE:
    case RFI_OP_ARGMAX:
    case RFI_OP_ARGMIN:
    case RFI_OP_GATHER:
    case RFI_OP_SCATTER_ADD: rfi_sb_printf(sb, "axis=%lld", (long long)a->i[0]); break;
    case RFI_OP_COMPARE: rfi_sb_printf(sb, "dir=%s", cmp_name(a->i[0])); break;
    case RFI_OP_BROADCAST_IN_DIM: print_list(sb, "map", a->l[0], a->nl[0]); break;
    case RFI_OP_TRANSPOSE: print_list(sb, "perm", a->l[0], a->nl[0]); break;
    case RFI_OP_SLICE:
        print_list(sb, "start", a->l[0], a->nl[0]);
        print_list(sb, ", limit", a->l[1], a->nl[1]);
        print_list(sb, ", stride", a->l[2], a->nl[2]);
        break;
    case RFI_OP_PAD:
        print_list(sb, "low", a->l[0], a->nl[0]);
        print_list(sb, ", high", a->l[1], a->nl[1]);
        print_list(sb, ", interior", a->l[2], a->nl[2]);
        break;
    case RFI_OP_REVERSE: print_list(sb, "axes", a->l[0], a->nl[0]); break;
    case RFI_OP_REDUCE:
        rfi_sb_printf(sb, "kind=%s, ", kind_name(a->i[0]));
        print_list(sb, "axes", a->l[0], a->nl[0]);
        break;
    case RFI_OP_DOT_GENERAL:
        print_list(sb, "lhs_batch", a->l[0], a->nl[0]);
        print_list(sb, ", rhs_batch", a->l[1], a->nl[1]);
        print_list(sb, ", lhs_contract", a->l[2], a->nl[2]);
        print_list(sb, ", rhs_contract", a->l[3], a->nl[3]);
        if (a->i[0] == RF_PRECISION_BF16)
            rfi_sb_printf(sb, ", precision=bf16");
        break;
    case RFI_OP_CONVOLUTION:
        print_list(sb, "stride", a->l[0], a->nl[0]);
        print_list(sb, ", pad_lo", a->l[1], a->nl[1]);
        print_list(sb, ", pad_hi", a->l[2], a->nl[2]);
        print_list(sb, ", lhs_dilation", a->l[3], a->nl[3]);
        print_list(sb, ", rhs_dilation", a->l[4], a->nl[4]);
        rfi_sb_printf(sb, ", feature_groups=%lld, batch_groups=%lld", (long long)a->i[0],
                      (long long)a->i[1]);
        if (a->i[2] == RF_PRECISION_BF16)
            rfi_sb_printf(sb, ", precision=bf16");
        break;
    case RFI_OP_REDUCE_WINDOW:
        rfi_sb_printf(sb, "kind=%s, ", kind_name(a->i[0]));
        print_window_lists(sb, a);
        break;
    case RFI_OP_SELECT_AND_SCATTER: print_window_lists(sb, a); break;
    case RFI_OP_RNG:
        rfi_sb_printf(sb, "dist=%s, stream=%lld", a->i[0] ? "normal" : "uniform",
                      (long long)a->i[1]);
        break;
    default: break;
    }
    if (sb->failed)
        return;
    if (sb->len == body) { /* nothing to show: drop the " {" */
        sb->len = start;
        sb->data[start] = '\0';
        return;
    }
    rfi_sb_printf(sb, "}");
}

static void print_node(rfi_strbuf *sb, const rfi_node *x)
{
    rfi_sb_printf(sb, "%%%d = %s", (int)x->id, rfi_op_table[x->op].name);
    if (x->n_in > 0) {
        rfi_sb_printf(sb, "(");
        for (int k = 0; k < x->n_in; k++)
            rfi_sb_printf(sb, k ? ", %%%d" : "%%%d", (int)x->in[k]->id);
        rfi_sb_printf(sb, ")");
    }
    print_attrs(sb, x);
    rfi_sb_printf(sb, " : ");
    rfi_sb_type(sb, x->dtype, x->dims, x->rank);
    rfi_sb_printf(sb, "\n");
}

static void print_header(rfi_strbuf *sb, const rfi_graph *g)
{
    rfi_sb_printf(sb, "program %s (%d args, %d captures)\n", g->name ? g->name : "program",
                  g->n_args, g->n_captures);
    for (int k = 0; k < g->n_args; k++) {
        rfi_sb_printf(sb, "  arg%d: ", k);
        rfi_sb_type(sb, g->arg_dtypes[k], g->arg_dims[k], g->arg_ranks[k]);
        rfi_sb_printf(sb, "\n");
    }
    for (int k = 0; k < g->n_captures; k++) {
        const rf_array *a = g->captures[k];
        rfi_sb_printf(sb, "  capture%d: ", k);
        if (a)
            rfi_sb_type(sb, a->dtype, a->dims, a->rank);
        else
            rfi_sb_printf(sb, "?");
        rfi_sb_printf(sb, "\n");
    }
}

char *rfi_print(const rfi_graph *g)
{
    if (!g) {
        rfi_error(RF_E_INVALID, "rfi_print: NULL graph");
        return NULL;
    }
    rfi_strbuf sb = {0};
    print_header(&sb, g);
    for (int i = 0; i < g->n_nodes; i++)
        print_node(&sb, g->nodes[i]);
    if (g->n_outputs > 0) {
        rfi_sb_printf(&sb, "outputs: ");
        for (int k = 0; k < g->n_outputs; k++)
            rfi_sb_printf(&sb, k ? ", %%%d" : "%%%d", (int)g->outputs[k]->id);
        rfi_sb_printf(&sb, "\n");
    }
    for (int k = 0; k < g->n_updates; k++)
        rfi_sb_printf(&sb, "update capture%d <- %%%d\n", g->updates[k].capture,
                      (int)g->updates[k].value->id);
    if (sb.failed) {
        rfi_sb_free(&sb);
        rfi_error(RF_E_NOMEM, "rfi_print: out of memory");
        return NULL;
    }
    return sb.data;
}
