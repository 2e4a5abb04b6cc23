/* op_table.c: the name, operand count and flags of every op, generated from
 * the RFI_OPS X-macro in ir.h. It holds no behaviour: shape rules live in
 * infer.c, kernels in the backends, VJP rules in the autodiff pass.
 */
#include "ir.h"

const rfi_op_info rfi_op_table[RFI_OP_COUNT] = {
#define RFI_OP_INFO(e, opname, n, fl) [RFI_OP_##e] = {.name = opname, .n_operands = n, .flags = fl},
    RFI_OPS(RFI_OP_INFO)
#undef RFI_OP_INFO
};
