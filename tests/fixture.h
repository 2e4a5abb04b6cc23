/* fixture.h: reads the reference values that the scripts in tests/ref/ produce with
 * PyTorch (committed, so tests need no Python).
 *
 * Format: a text file of entries, one per line:
 *     <name> <rank> <d0> ... <d(rank-1)> <v0> <v1> ...
 * values in row-major order, printed with 17 significant digits ('%.17g'),
 * lines starting with '#' are comments. */
#ifndef RF_TEST_FIXTURE_H
#define RF_TEST_FIXTURE_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct fx_entry {
    char name[128];
    int rank;
    int64_t dims[8];
    int64_t n;
    double *v;
} fx_entry;

typedef struct fx_file {
    fx_entry *e;
    int n;
} fx_file;

/* Loads `path` (relative paths are taken from RF_SOURCE_DIR/tests/ref when
 * that macro is defined). Returns 0 on success. */
static inline int fx_load(fx_file *f, const char *path)
{
    char full[1024];
#ifdef RF_SOURCE_DIR
    if (path[0] != '/') {
        snprintf(full, sizeof full, "%s/tests/ref/%s", RF_SOURCE_DIR, path);
        path = full;
    }
#endif
    memset(f, 0, sizeof *f);
    FILE *fp = fopen(path, "r");
    if (!fp) {
        fprintf(stderr, "fixture: cannot open %s\n", path);
        return -1;
    }
    int cap = 0;
    char name[128];
    int c;
    while ((c = fgetc(fp)) != EOF) {
        if (c == '#') { /* comment line */
            while ((c = fgetc(fp)) != EOF && c != '\n') {}
            continue;
        }
        if (c == '\n' || c == ' ' || c == '\r')
            continue;
        ungetc(c, fp);
        if (fscanf(fp, "%127s", name) != 1)
            break;
        if (f->n == cap) {
            cap = cap ? cap * 2 : 64;
            f->e = realloc(f->e, (size_t)cap * sizeof *f->e);
        }
        fx_entry *e = &f->e[f->n++];
        memset(e, 0, sizeof *e);
        snprintf(e->name, sizeof e->name, "%s", name);
        if (fscanf(fp, "%d", &e->rank) != 1 || e->rank < 0 || e->rank > 8)
            goto bad;
        e->n = 1;
        for (int i = 0; i < e->rank; i++) {
            long long d;
            if (fscanf(fp, "%lld", &d) != 1)
                goto bad;
            e->dims[i] = d;
            e->n *= d;
        }
        e->v = malloc((size_t)(e->n ? e->n : 1) * sizeof(double));
        for (int64_t i = 0; i < e->n; i++)
            if (fscanf(fp, "%lf", &e->v[i]) != 1)
                goto bad;
    }
    fclose(fp);
    return 0;
bad:
    fprintf(stderr, "fixture: malformed entry %s in %s\n", name, path);
    fclose(fp);
    return -1;
}

/* The entry called `name`, or NULL (and a message). */
static inline const fx_entry *fx_get(const fx_file *f, const char *name)
{
    for (int i = 0; i < f->n; i++)
        if (!strcmp(f->e[i].name, name))
            return &f->e[i];
    fprintf(stderr, "fixture: no entry %s\n", name);
    return NULL;
}

/* The entry's values as a new float array (malloc). */
static inline float *fx_f32(const fx_entry *e)
{
    float *p = malloc((size_t)(e->n ? e->n : 1) * sizeof(float));
    for (int64_t i = 0; i < e->n; i++)
        p[i] = (float)e->v[i];
    return p;
}

static inline void fx_free(fx_file *f)
{
    for (int i = 0; i < f->n; i++)
        free(f->e[i].v);
    free(f->e);
    memset(f, 0, sizeof *f);
}

#endif
