/* render_conv.h: the C text of a direct convolution step (render_conv.c),
 * for render_c.c. */
#ifndef RF_BACKEND_CPU_RENDER_CONV_H
#define RF_BACKEND_CPU_RENDER_CONV_H

#include "../kir.h"

/* The kernel of RFI_KIR_STEP_CONV step st: its comment, ctx struct and
 * declaration into decl, its function into def. */
RFI_FUNC void rfi_render_conv_kernel(const rfi_kir_step *st, rfi_strbuf *decl, rfi_strbuf *def);
/* Its block in the entry point (which has `s` and `bufs` in scope) into sb. */
RFI_FUNC void rfi_render_conv_call(const rfi_kir_step *st, rfi_strbuf *sb);

#endif
