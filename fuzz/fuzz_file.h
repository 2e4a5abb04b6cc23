/* fuzz_file.h: for the fuzz targets of readers that take a path: the input
 * written to this process's own file under /tmp (the caller unlinks it). */
#ifndef RF_FUZZ_FILE_H
#define RF_FUZZ_FILE_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* Writes data[0..size) to /tmp/rf-fuzz-<tag>-<pid> and returns that path
 * (static storage); aborts if it cannot, which is the harness's failure, not
 * the reader's. */
static const char *fuzz_input_file(const char *tag, const uint8_t *data, size_t size)
{
    static char path[96];
    snprintf(path, sizeof path, "/tmp/rf-fuzz-%s-%ld", tag, (long)getpid());
    FILE *f = fopen(path, "wb");
    if (!f || (size && fwrite(data, 1, size, f) != size) || fclose(f) != 0)
        abort();
    return path;
}

#endif
