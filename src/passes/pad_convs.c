/* pad_convs.c: a padded or lhs-dilated convolution that a backend computes
 * as generated loops becomes the same convolution, unpadded and undilated,
 * of its input padded by a PAD of zeros (rfi_pad_convs).
 *
 * Why: in a loop over the convolution's terms every point of a padded
 * input is a guarded load at clamped indices: a compare, a clamp and a
 * select per term, per spatial dim, where the unpadded loop is one load and
 * one multiply-add (the weight gradient of a 7x7 depthwise convolution over
 * 64 channels of 64 16x16 images spent most of its time there). The PAD is
 * its own loop, once per input element, and the convolution's loops then
 * read it directly.
 *
 * Exact: the pad holds +0 where the convolution would read padding or a
 * dilation hole, which it multiplies into its sums just as the interpreter
 * does (interp/conv.c: a NaN weight times padding is a NaN in both).
 *
 * Deliberately not here: which convolutions run as loops (the caller's
 * predicate), negative padding (a crop: rare, and the loops' guards keep
 * it exact).
 */
#include <string.h>

#include "passes/passes.h"

typedef struct padder {
    bool (*as_loops)(const rfi_node *conv);
} padder;

/* n with its input padded and dilated by a PAD, or NULL to keep n. */
static rfi_node *pad_conv(void *ctx, rfi_graph *c, const rfi_node *n, rfi_node *const *in,
                          rfi_node *const *map)
{
    (void)map;
    const padder *p = ctx;
    if (n->op != RFI_OP_CONVOLUTION || !p->as_loops(n))
        return NULL;
    const rfi_node *x = n->in[0];
    int nsp = x->rank - 2;
    bool padded = false;
    for (int d = 0; d < nsp; d++) {
        if (n->attr.l[1][d] < 0 || n->attr.l[2][d] < 0)
            return NULL;
        padded |= n->attr.l[1][d] > 0 || n->attr.l[2][d] > 0 || n->attr.l[3][d] > 1;
    }
    if (!padded)
        return NULL;
    rfi_attrs pa;
    memset(&pa, 0, sizeof pa);
    pa.nl[0] = pa.nl[1] = pa.nl[2] = x->rank;
    rfi_attrs ca = n->attr;
    for (int d = 0; d < nsp; d++) {
        pa.l[0][2 + d] = n->attr.l[1][d];
        pa.l[1][2 + d] = n->attr.l[2][d];
        pa.l[2][2 + d] = n->attr.l[3][d] > 1 ? n->attr.l[3][d] - 1 : 0;
        ca.l[1][d] = ca.l[2][d] = 0;
        ca.l[3][d] = 1;
    }
    rfi_node *pad_in[2] = {in[0], rfi_node_scalar(c, x->dtype, 0.0)};
    if (!pad_in[1])
        return NULL;
    rfi_node *padded_x = rfi_node_new(c, RFI_OP_PAD, pad_in, 2, &pa, x->dtype, NULL, 0);
    if (!padded_x)
        return NULL;
    rfi_node *ops[2] = {padded_x, in[1]};
    return rfi_node_new(c, RFI_OP_CONVOLUTION, ops, 2, &ca, n->dtype, NULL, 0);
}

rf_status rfi_pad_convs(const rfi_graph *g, bool (*as_loops)(const rfi_node *conv),
                        rfi_graph **out)
{
    padder p = {as_loops};
    return rfi_rewrite_graph(g, "pad_convs", pad_conv, &p, out);
}
