/* fuzz_idx.c: libFuzzer target for rf_idx_load, the reader of IDX files
 * (plain or gzip-compressed) behind the Fashion-MNIST loader. The input is
 * written to a file and loaded; every input must load or be refused with an
 * error status, never crash, and leak nothing. */
#include <stdint.h>
#include <unistd.h>

#include "fuzz_file.h"
#include "reflux.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *path = fuzz_input_file("idx", data, size);
    rf_array *a = NULL;
    if (rf_idx_load(path, &a) == RF_OK)
        rf_array_free(a);
    unlink(path);
    return 0;
}
