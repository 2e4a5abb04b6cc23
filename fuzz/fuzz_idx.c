/* fuzz_idx.c: libFuzzer target for rf_idx_load, the reader of IDX files
 * (plain or gzip-compressed) behind the Fashion-MNIST loader. The input is
 * written to a file and loaded; every input must load or be refused with an
 * error status, never crash, and leak nothing. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "reflux.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static char path[64];
    if (!path[0])
        snprintf(path, sizeof path, "/tmp/rf-fuzz-idx-%ld", (long)getpid());
    FILE *f = fopen(path, "wb");
    if (!f)
        abort();
    if (size && fwrite(data, 1, size, f) != size)
        abort();
    fclose(f);
    rf_array *a = NULL;
    if (rf_idx_load(path, &a) == RF_OK)
        rf_array_free(a);
    unlink(path);
    return 0;
}
