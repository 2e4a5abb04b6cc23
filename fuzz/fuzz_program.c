/* fuzz_program.c: libFuzzer target for rfi_program_decode, which rebuilds
 * programs kept in the disk caches. Every input must decode to a verified
 * program or be refused (RF_E_CORRUPT, RF_E_NOMEM), never crash, and leak
 * nothing. Two small captures are offered for the encoding to name. */
#include <stdint.h>

#include "reflux.h"
#include "runtime/program_codec.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static rf_array *pool[2];
    if (!pool[0]) {
        rf_array *f = rf_zeros(RF_F32, RF_SHAPE(4, 3)), *i = rf_zeros(RF_I32, RF_SHAPE(5));
        pool[0] = rf_array_to(f, rf_device_cpu());
        pool[1] = rf_array_to(i, rf_device_cpu());
        rf_array_free(f);
        rf_array_free(i);
    }
    rfi_graph *g = NULL;
    size_t used = 0;
    if (rfi_program_decode(data, size, rf_device_cpu(), pool, 2, &g, &used) == RF_OK)
        rfi_graph_free(g);
    return 0;
}
