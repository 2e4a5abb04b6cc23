/* dump.c: RF_DUMP support: writes program text to
 * $RF_DUMP/<name>-<16 hex digit hash>.<stage>.txt, creating the directory
 * (mode 0700) if needed.
 *
 * Dumps are a debugging aid: a failure to write one only warns on stderr and
 * never fails a compile. This file does not decide what to dump (trace.c does).
 */
#include "runtime.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>


/* Copies `name` keeping only characters safe in a file name ("program" if empty). */
static void safe_name(char *dst, size_t n, const char *name)
{
    size_t k = 0;
    for (const char *p = name ? name : ""; *p && k + 1 < n; p++) {
        char c = *p;
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '_' || c == '-' || (c == '.' && k > 0); /* no hidden or ".." names */
        dst[k++] = ok ? c : '_';
    }
    dst[k] = '\0';
    if (k == 0)
        snprintf(dst, n, "program");
}

bool rfi_dump_wanted(void)
{
    const char *dir = getenv("RF_DUMP");
    return dir && *dir;
}

void rfi_dump(const char *name, uint64_t hash, const char *stage, const char *text)
{
    const char *dir = getenv("RF_DUMP");
    if (!dir || !*dir || !text)
        return;
    if (rfi_make_dirs(dir) != 0) {
        fprintf(stderr, "reflux: warning: RF_DUMP: cannot create directory %s: %s\n", dir,
                strerror(errno));
        return;
    }
    char base[128], path[4200], tmp[4300];
    safe_name(base, sizeof base, name);
    snprintf(path, sizeof path, "%s/%s-%016llx.%s.txt", dir, base, (unsigned long long)hash,
             stage ? stage : "program");
    /* Write a unique temporary file and rename it, so a reader never sees half
     * a dump and two threads dumping the same program do not interleave. */
    snprintf(tmp, sizeof tmp, "%s.XXXXXX", path);
    int fd = mkstemp(tmp);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!f) {
        fprintf(stderr, "reflux: warning: RF_DUMP: cannot write %s: %s\n", path,
                strerror(errno));
        if (fd >= 0) {
            close(fd);
            remove(tmp);
        }
        return;
    }
    size_t len = strlen(text);
    bool ok = fwrite(text, 1, len, f) == len;
    ok = (fclose(f) == 0) && ok;
    if (!ok || rename(tmp, path) != 0) {
        fprintf(stderr, "reflux: warning: RF_DUMP: cannot write %s: %s\n", path,
                strerror(errno));
        remove(tmp);
    }
}
