/* fuzz_safetensors.c: libFuzzer target for the checkpoint header parser
 * (src/data/safetensors.c). The input's first 8 bytes are the data section's
 * length (little-endian), the rest the JSON header; every input must be
 * refused or accepted with an error status, never crash, and leak nothing. */
#include <stdint.h>
#include <string.h>

#include "data/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint64_t data_len = 0;
    if (size >= 8) {
        for (int i = 7; i >= 0; i--)
            data_len = data_len << 8 | data[i];
        data += 8;
        size -= 8;
    }
    rfi_st_header h;
    memset(&h, 0, sizeof h);
    rfi_st_parse("fuzz.safetensors", (const char *)data, size, data_len, &h);
    rfi_st_header_free(&h);
    return 0;
}
