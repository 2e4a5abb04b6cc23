/* replay.c: runs a fuzz target (fuzz_*.c) over files instead of libFuzzer's
 * generated inputs: every file named on the command line, and every file in
 * a directory named there. The ordinary builds link each target with this
 * main, so ctest replays the committed corpora (fuzz/corpus/<target>/), the
 * inputs that once crashed among them, under the sanitizers of build-asan/. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Runs the target on the file at path; -1 if it cannot be read. */
static int replay_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return -1;
    uint8_t *data = NULL;
    size_t size = 0, cap = 0;
    for (;;) {
        if (size == cap) {
            uint8_t *grown = realloc(data, cap = cap ? 2 * cap : 4096);
            if (!grown)
                break;
            data = grown;
        }
        size_t n = fread(data + size, 1, cap - size, f);
        if (n == 0)
            break;
        size += n;
    }
    int failed = ferror(f) != 0;
    fclose(f);
    if (!failed)
        LLVMFuzzerTestOneInput(data, size);
    free(data);
    return failed ? -1 : 0;
}

/* Replays every regular file directly in dir; returns how many, or -1. */
static int replay_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (e->d_name[0] == '.')
            continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (replay_file(path) != 0) {
            n = -1;
            break;
        }
        n++;
    }
    closedir(d);
    return n;
}

int main(int argc, char **argv)
{
    int total = 0;
    for (int i = 1; i < argc; i++) {
        int n = replay_dir(argv[i]);
        if (n < 0)
            n = replay_file(argv[i]) == 0 ? 1 : -1;
        if (n < 0) {
            fprintf(stderr, "%s: cannot read %s\n", argv[0], argv[i]);
            return 1;
        }
        total += n;
    }
    printf("%s: %d inputs replayed\n", argv[0], total);
    return total > 0 ? 0 : 1;
}
