/* render_conv.h: the C text of a direct convolution step (render_conv.c),
 * for render_c.c, and the few helpers of render_c.c it uses. */
#ifndef RF_BACKEND_CPU_RENDER_CONV_H
#define RF_BACKEND_CPU_RENDER_CONV_H

#include "../kir.h"

/* The kernel of RFI_KIR_STEP_CONV step st: its comment, ctx struct and
 * declaration into decl, its function into def; pool_name names the
 * function of its pool_kernel (kir.h), when it has one. */
RFI_FUNC void rfi_render_conv_kernel(const rfi_kir_step *st, const char *pool_name,
                                     rfi_strbuf *decl, rfi_strbuf *def);
/* Whether two direct convolutions run the same loop (only their buffers
 * differ): the later one calls the earlier one's kernel. */
RFI_FUNC bool rfi_render_conv_same(const rfi_kir_conv *a, const rfi_kir_conv *b);
/* Step st's block in the entry point (which has `s` and `bufs` in scope)
 * into sb, calling the kernel rendered for step kernel_step (st's own, or
 * an earlier step's that is the same); pool_ctx names the variable holding
 * its pool kernel's ctx, in scope, when it has one. */
RFI_FUNC void rfi_render_conv_call(const rfi_kir_step *st, int kernel_step, const char *pool_ctx,
                                   rfi_strbuf *sb);

/* render_c.c's helpers the direct convolutions share: `text` as a C
 * comment at `depth` (four spaces each; every line after the first gets
 * " * ", and no "*" + "/" in the text can close it early), and the typed
 * pointer to bufs[buffer] + offset bytes. */
RFI_FUNC void rfi_render_c_comment(rfi_strbuf *sb, const char *text, int depth);
RFI_FUNC void rfi_render_c_pointer(rfi_strbuf *sb, const char *type, int buffer, size_t offset);

#endif
