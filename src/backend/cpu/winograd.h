/* winograd.h: 2-D stride-1 convolutions by Winograd's minimal filtering
 * (winograd.c), the CPU backend's own, for CPUs where oneDNN has no Winograd
 * kernels (conv.c decides). Internal to the CPU backend.
 *
 * Two forms of the IR's CONVOLUTION (no groups, no dilation, stride 1, any
 * padding), with x [N, C, H, W], w [O, C, KH, KW], result [N, O, OH, OW]:
 *   - a 3x3 kernel (a forward convolution, or the input gradient of one):
 *     F(4x4, 3x3), the result cut into 4x4 tiles;
 *   - a 3x3 result (the weight gradient of a 3x3 convolution, whose kernel
 *     is the output gradient): F(3x3, 4x4), the kernel cut into 4x4 tiles.
 * Either way the contraction over channels (and tiles) runs position by
 * position over the 36 transformed positions: for the first form with up to
 * 64 input channels in a loop of winograd.c's own, fused with the
 * transforms; else as one batched oneDNN matmul.
 */
#ifndef RF_BACKEND_CPU_WINOGRAD_H
#define RF_BACKEND_CPU_WINOGRAD_H

#include "services.h"

typedef struct rfi_winograd rfi_winograd;

/* Prepares node n (a CONVOLUTION on f32) for this path: RF_E_UNSUPPORTED when
 * the form is not one of the two above or the transformed operands would
 * need more than a budget of workspace. views[k]: the buffer of operand k
 * holds it with dims 0 and 1 swapped. layouts: the buffers' layouts (plan.h;
 * a view's: its buffer's), read and written as they are where oneDNN can
 * describe them (rfi_winograd_laid_out). epi: the step's epilogue, whose
 * leading per-channel BIAS and RELU ops the result transform applies
 * (rfi_winograd_epilogue_ops). rule: which forms are taken (below). Keeps
 * pointers to nothing of the caller's; freed with rfi_winograd_free. */
typedef struct rfi_winograd_rule {
    int64_t min_channels[2]; /* the fewest channels (C and O) in form f (0: a 3x3 kernel,
                                1: a 3x3 result) */
    /* The first form only where its products fill: at least min_rows tiles in all
     * (fewer, and transforming the kernel, a pass over a 36x larger copy of it, costs
     * as much as the products), and results filling at least min_fill of the tiles'
     * outputs (a 2x2 result in one 4x4 tile computes 4 times the outputs it keeps,
     * which is what Winograd saves over a direct convolution). 0: any. */
    int64_t min_rows;
    double min_fill;
} rfi_winograd_rule;
RFI_FUNC rf_status rfi_winograd_prepare(const rfi_node *n, const bool views[2],
                                        const rfi_layout layouts[3], const rfi_epi_op *epi,
                                        int n_epi, const rfi_winograd_rule *rule,
                                        dnnl_engine_t eng, rfi_winograd **out,
                                        size_t *workspace_bytes);
/* epi_src: the operand of each epilogue op (conv.c's convention). */
RFI_FUNC rf_status rfi_winograd_run(rfi_winograd *w, dnnl_stream_t s, const float *x,
                                    const float *k, float *out, const void *const *epi_src,
                                    void *workspace);
/* How many leading epilogue ops the call applies. */
RFI_FUNC int rfi_winograd_epilogue_ops(const rfi_winograd *w);
/* Whether tensor k (0, 1: operands; 2: the result) is read or written in
 * its buffer's layout (else row-major, the services reordering it). */
RFI_FUNC bool rfi_winograd_laid_out(const rfi_winograd *w, int k);
/* "winograd 4x4" (the result in 4x4 tiles) or "winograd 3x3" (the kernel),
 * with " bf16-rounded" when the caller rounds the operands (`rounded`). */
RFI_FUNC const char *rfi_winograd_path(const rfi_winograd *w, bool rounded);
RFI_FUNC void rfi_winograd_free(rfi_winograd *w);

#endif
