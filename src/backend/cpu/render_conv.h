/* render_conv.h: the C text of a direct convolution step (render_conv.c),
 * for render_c.c. */
#ifndef RF_BACKEND_CPU_RENDER_CONV_H
#define RF_BACKEND_CPU_RENDER_CONV_H

#include "../kir.h"

/* The kernel of RFI_KIR_STEP_CONV step st: its comment, ctx struct and
 * declaration into decl, its function into def. */
RFI_FUNC void rfi_render_conv_kernel(const rfi_kir_step *st, rfi_strbuf *decl, rfi_strbuf *def);
/* Whether two direct convolutions run the same loop (only their buffers
 * differ): the later one calls the earlier one's kernel. */
RFI_FUNC bool rfi_render_conv_same(const rfi_kir_conv *a, const rfi_kir_conv *b);
/* Step st's block in the entry point (which has `s` and `bufs` in scope)
 * into sb, calling the kernel rendered for step kernel_step (st's own, or
 * an earlier step's that is the same). */
RFI_FUNC void rfi_render_conv_call(const rfi_kir_step *st, int kernel_step, rfi_strbuf *sb);

#endif
