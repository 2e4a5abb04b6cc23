/* checkpoint.c: rf_checkpoint_save / rf_checkpoint_load, a model's arrays
 * (and its optimiser's) in the safetensors format, so PyTorch and other
 * tools read reflux checkpoints (layouts follow PyTorch's, see nn.h).
 *
 * Names: every model array under its rf_model_visit path ("0.weight"), every
 * optimiser array under "opt." + its rf_opt_visit path. The data section
 * holds the tensors contiguously in that order, little-endian.
 *
 * Saving is atomic: the file is written beside the target under a temporary
 * name, flushed and fsync'ed, renamed over the target, and the directory is
 * fsync'ed, so a crash leaves the old checkpoint or the new one, never a mix.
 * The target is the file the path's symbolic links lead to; the new file
 * keeps the old one's permissions (and owner, where allowed).
 * Loading validates the whole file and reads every tensor into staging
 * memory before the first array is written, so a bad file changes nothing.
 * rf_checkpoint_load_opts loads a part: the model's names under a prefix of
 * the file's (a trunk out of a whole model's file), and with `partial` only
 * the names both have (PyTorch's strict=False).
 *
 * Deliberately not here: converting dtypes or shapes on load, memory
 * mapping, big-endian hosts (rejected).
 */
#include "../nn/model.h"
#include "safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- The arrays of a model and optimiser, by name ------------------------------------ */

typedef struct named {
    char *name; /* rfi_malloc */
    rf_array *a; /* borrowed from the model / optimiser */
} named;

typedef struct named_list {
    named *v;
    int n, cap;
    const char *prefix;
    bool oom;
} named_list;

static void collect_one(const char *path, rf_array *a, bool trainable, void *ud)
{
    (void)trainable;
    named_list *l = ud;
    if (l->oom)
        return;
    if (l->n == l->cap) {
        int cap = l->cap ? l->cap * 2 : 16;
        named *v = rfi_realloc(l->v, (size_t)cap * sizeof *v);
        if (!v) {
            l->oom = true;
            return;
        }
        l->v = v;
        l->cap = cap;
    }
    size_t len = strlen(l->prefix) + strlen(path) + 1;
    char *name = rfi_malloc(len);
    if (!name) {
        l->oom = true;
        return;
    }
    snprintf(name, len, "%s%s", l->prefix, path);
    l->v[l->n++] = (named){name, a};
}

static void named_list_free(named_list *l)
{
    for (int i = 0; i < l->n; i++)
        rfi_free(l->v[i].name);
    rfi_free(l->v);
}

/* Every array of m (and opt) with its checkpoint name, in visit order. */
static rf_status collect_arrays(const char *op, rf_model *m, rf_opt *opt, named_list *out)
{
    if (opt && !rfi_model_has_opt(m, opt)) /* its state would not be this model's */
        return rfi_error(RF_E_INVALID, "%s: the optimiser (%s) was not set up for this model; "
                         "pass the one rf_setup made for it", op, rf_rule_name(rf_opt_rule(opt)));
    rf_clear_error(); /* the visitors report running out of memory only by status */
    out->prefix = "";
    rf_model_visit(m, collect_one, out);
    if (opt && !out->oom) {
        out->prefix = "opt.";
        rf_opt_visit(opt, collect_one, out);
    }
    if (out->oom || rf_errstatus() == RF_E_NOMEM)
        return rfi_error(RF_E_NOMEM, "%s: out of memory listing the arrays", op);
    return RF_OK;
}

static int named_by_name(const void *a, const void *b)
{
    return strcmp((*(const named *const *)a)->name, (*(const named *const *)b)->name);
}

/* Two arrays under one name could not be told apart in the file. */
static rf_status check_unique(const char *op, const named_list *l)
{
    if (l->n < 2)
        return RF_OK;
    const named **order = rfi_malloc((size_t)l->n * sizeof *order);
    if (!order)
        return rfi_error(RF_E_NOMEM, "%s: out of memory", op);
    for (int i = 0; i < l->n; i++)
        order[i] = &l->v[i];
    qsort(order, (size_t)l->n, sizeof *order, named_by_name);
    rf_status st = RF_OK;
    for (int i = 1; i < l->n && st == RF_OK; i++)
        if (strcmp(order[i - 1]->name, order[i]->name) == 0)
            st = rfi_error(RF_E_INVALID, "%s: two arrays are named \"%s\"", op, order[i]->name);
    rfi_free(order);
    return st;
}

static bool host_is_little_endian(void)
{
    const uint16_t one = 1;
    uint8_t first;
    memcpy(&first, &one, 1);
    return first == 1;
}

/* ---- Saving ---------------------------------------------------------------------------- */

static void sb_json_string(rfi_strbuf *sb, const char *s)
{
    rfi_sb_printf(sb, "\"");
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        if (*c == '"' || *c == '\\')
            rfi_sb_printf(sb, "\\%c", *c);
        else if (*c < 0x20)
            rfi_sb_printf(sb, "\\u%04x", *c);
        else
            rfi_sb_printf(sb, "%c", *c);
    }
    rfi_sb_printf(sb, "\"");
}

/* The JSON header, padded with spaces to a multiple of 8 bytes so the data
 * section starts aligned (as the safetensors writers do). */
static rf_status build_header(const char *op, const named_list *l, rfi_strbuf *sb)
{
    rfi_sb_printf(sb, "{\"__metadata__\":{\"format\":\"reflux\"}");
    uint64_t offset = 0;
    for (int i = 0; i < l->n; i++) {
        const rf_array *a = l->v[i].a;
        rfi_sb_printf(sb, ",");
        sb_json_string(sb, l->v[i].name);
        rfi_sb_printf(sb, ":{\"dtype\":\"%s\",\"shape\":[", rfi_st_dtype_name(a->dtype));
        for (int d = 0; d < a->rank; d++)
            rfi_sb_printf(sb, d ? ",%lld" : "%lld", (long long)a->dims[d]);
        rfi_sb_printf(sb, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)offset,
                      (unsigned long long)(offset + a->nbytes));
        offset += a->nbytes;
    }
    rfi_sb_printf(sb, "}");
    while (!sb->failed && sb->len % 8 != 0)
        rfi_sb_printf(sb, " ");
    if (sb->failed)
        return rfi_error(RF_E_NOMEM, "%s: out of memory building the header", op);
    return RF_OK;
}

static rf_status io_error(const char *op, const char *what, const char *path)
{
    return rfi_error(RF_E_IO, "%s: %s %s: %s", op, what, path, strerror(errno));
}

/* Writes the header length, header and tensor data to f. */
static rf_status write_contents(const char *op, FILE *f, const char *tmp, const rfi_strbuf *hdr,
                                const named_list *l)
{
    uint8_t len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (uint8_t)((uint64_t)hdr->len >> (8 * i));
    if (fwrite(len8, 1, 8, f) != 8 || fwrite(hdr->data, 1, hdr->len, f) != hdr->len)
        return io_error(op, "cannot write", tmp);
    size_t most = 0;
    for (int i = 0; i < l->n; i++)
        if (l->v[i].a->nbytes > most)
            most = l->v[i].a->nbytes;
    void *buf = rfi_malloc(most ? most : 1);
    if (!buf)
        return rfi_error(RF_E_NOMEM, "%s: out of memory (%zu bytes)", op, most);
    rf_status st = RF_OK;
    for (int i = 0; i < l->n && st == RF_OK; i++) {
        const rf_array *a = l->v[i].a;
        st = rf_array_read(a, buf, a->nbytes); /* works for every device */
        if (st == RF_OK && fwrite(buf, 1, a->nbytes, f) != a->nbytes)
            st = io_error(op, "cannot write", tmp);
    }
    rfi_free(buf);
    return st;
}

/* The directory holding `path` (rfi_malloc'd; NULL when out of memory). */
static char *parent_dir(const char *path)
{
    size_t len = strlen(path);
    char *dir = rfi_malloc(len + 2);
    if (!dir)
        return NULL;
    memcpy(dir, path, len + 1);
    char *slash = strrchr(dir, '/');
    if (!slash)
        strcpy(dir, ".");
    else if (slash == dir)
        dir[1] = '\0';
    else
        *slash = '\0';
    return dir;
}

/* fsync of directory `dir`, so a rename in it is durable. File systems that
 * cannot sync directories (EINVAL) are not an error. */
static rf_status sync_dir(const char *op, const char *dir)
{
    rf_status st = RF_OK;
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0 || (fsync(fd) != 0 && errno != EINVAL))
        st = io_error(op, "cannot sync the directory", dir);
    if (fd >= 0)
        close(fd);
    return st;
}

/* A fresh temporary name in path's directory: <dir>/.reflux-checkpoint.<pid>.<n>.tmp
 * (short, so that any name the file system takes for path works). */
static char *temp_name(const char *path)
{
    static _Atomic uint64_t counter; /* documented: only makes names unique */
    const char *slash = strrchr(path, '/');
    int dir_len = slash ? (int)(slash - path + 1) : 0;
    size_t len = (size_t)dir_len + 80;
    char *tmp = rfi_malloc(len);
    if (tmp)
        snprintf(tmp, len, "%.*s.reflux-checkpoint.%ld.%llu.tmp", dir_len, path, (long)getpid(),
                 (unsigned long long)atomic_fetch_add(&counter, 1));
    return tmp;
}

/* Where the symbolic link `path` leads when that file does not exist yet
 * (malloc'd, as realpath's; NULL with errno set): its target, relative to
 * the link's directory unless absolute. One level only: a link to another
 * dangling link is refused. */
static char *dangling_target(const char *path)
{
    char target[PATH_MAX];
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n < 0)
        return NULL;
    target[n] = '\0';
    const char *slash = strrchr(path, '/');
    int dir_len = target[0] == '/' || !slash ? 0 : (int)(slash - path + 1);
    size_t len = (size_t)dir_len + (size_t)n + 1;
    char *full = len <= PATH_MAX ? malloc(len) : NULL;
    if (!full) {
        errno = len > PATH_MAX ? ENAMETOOLONG : ENOMEM;
        return NULL;
    }
    memcpy(full, path, (size_t)dir_len);
    memcpy(full + dir_len, target, (size_t)n + 1);
    struct stat sb;
    if (lstat(full, &sb) == 0 && S_ISLNK(sb.st_mode)) {
        free(full);
        errno = ELOOP;
        return NULL;
    }
    return full;
}

/* The file a save replaces: `path`, or the file its symbolic links lead to
 * (a save writes through them, as opening the path for writing would, and
 * leaves the links). *target is rfi_malloc'd; *old receives the existing
 * file's status, or st_nlink 0 when there is none. A path that exists but is
 * not a regular file (a directory, FIFO or device) is refused: renaming over
 * it would replace it. */
static rf_status save_target(const char *op, const char *path, char **target, struct stat *old)
{
    memset(old, 0, sizeof *old);
    *target = NULL;
    char *resolved = NULL; /* libc's */
    struct stat sb;
    if (lstat(path, &sb) == 0 && S_ISLNK(sb.st_mode)) {
        resolved = realpath(path, NULL);
        if (!resolved && errno == ENOENT)
            resolved = dangling_target(path); /* a link to a file not made yet */
        if (!resolved)
            return io_error(op, "cannot follow the symbolic link", path);
    }
    const char *real = resolved ? resolved : path;
    if (stat(real, old) != 0) {
        memset(old, 0, sizeof *old);
        if (errno != ENOENT) {
            rf_status st = io_error(op, "cannot reach", real);
            free(resolved);
            return st;
        }
    } else if (!S_ISREG(old->st_mode)) {
        rf_status st = rfi_error(RF_E_IO, "%s: %s: not a regular file (a checkpoint replaces "
                                 "a regular file)", op, real);
        free(resolved);
        return st;
    }
    *target = rfi_strdup(real);
    free(resolved);
    return *target ? RF_OK : rfi_error(RF_E_NOMEM, "%s: out of memory", op);
}

/* The new file keeps the replaced one's permissions and, where the process
 * may set them, its owner and group (an 0600 checkpoint stays private). */
static rf_status keep_attributes(const char *op, int fd, const char *tmp, const struct stat *old)
{
    if (old->st_nlink == 0)
        return RF_OK;
    if (fchown(fd, old->st_uid, old->st_gid) != 0 && errno != EPERM)
        return io_error(op, "cannot set the owner of", tmp);
    if (fchmod(fd, old->st_mode & 07777) != 0)
        return io_error(op, "cannot set the permissions of", tmp);
    return RF_OK;
}

static rf_status write_atomically(const char *op, const char *path, const rfi_strbuf *hdr,
                                  const named_list *l)
{
    char *target = NULL;
    struct stat old;
    rf_status st = save_target(op, path, &target, &old);
    if (st != RF_OK)
        return st;
    /* everything allocated before the rename, so no failure follows it */
    char *tmp = temp_name(target), *dir = parent_dir(target);
    if (!tmp || !dir) {
        rfi_free(tmp);
        rfi_free(dir);
        rfi_free(target);
        return rfi_error(RF_E_NOMEM, "%s: out of memory", op);
    }
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd < 0) {
        st = io_error(op, "cannot create a file beside", target);
        rfi_free(tmp);
        rfi_free(dir);
        rfi_free(target);
        return st;
    }
    st = keep_attributes(op, fd, tmp, &old);
    FILE *f = st == RF_OK ? fdopen(fd, "wb") : NULL;
    if (st == RF_OK && !f)
        st = io_error(op, "cannot open", tmp);
    if (st == RF_OK)
        st = write_contents(op, f, tmp, hdr, l);
    if (st == RF_OK && (fflush(f) != 0 || fsync(fileno(f)) != 0))
        st = io_error(op, "cannot flush", tmp);
    if (!f)
        close(fd);
    else if (fclose(f) != 0 && st == RF_OK)
        st = io_error(op, "cannot close", tmp);
    if (st == RF_OK && rename(tmp, target) != 0)
        st = io_error(op, "cannot rename the temporary file to", target);
    if (st != RF_OK)
        unlink(tmp);
    else
        st = sync_dir(op, dir);
    if (st != RF_OK && !strstr(rf_errmsg(), target)) { /* it names the temporary */
        char why[RFI_ERRMSG_MAX / 2];
        snprintf(why, sizeof why, "%s", rf_errmsg());
        st = rfi_error(st, "%s (saving %s)", why, target);
    }
    rfi_free(tmp);
    rfi_free(dir);
    rfi_free(target);
    return st;
}

rf_status rf_checkpoint_save(const char *path, rf_model *m, rf_opt *opt)
{
    static const char op[] = "rf_checkpoint_save";
    if (!path || !m)
        return rfi_error(RF_E_INVALID, "%s: %s is NULL", op, path ? "model" : "path");
    if (!host_is_little_endian())
        return rfi_error(RF_E_UNSUPPORTED, "%s: big-endian hosts are not supported", op);
    named_list l = {0};
    rfi_strbuf hdr = {0};
    rf_status st = collect_arrays(op, m, opt, &l);
    if (st == RF_OK)
        st = check_unique(op, &l);
    if (st == RF_OK)
        st = build_header(op, &l, &hdr);
    if (st == RF_OK)
        st = write_atomically(op, path, &hdr, &l);
    rfi_sb_free(&hdr);
    named_list_free(&l);
    return st;
}

/* ---- Loading ------------------------------------------------------------------------------- */

/* Reads exactly n bytes at offset; false on a short read (errno 0) or error. */
static bool read_at(int fd, void *dst, size_t n, uint64_t offset)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, (char *)dst + got, n - got, (off_t)(offset + got));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            if (r == 0)
                errno = 0;
            return false;
        }
        got += (size_t)r;
    }
    return true;
}

static rf_status read_failure(const char *op, const char *path, const char *what)
{
    if (errno)
        return rfi_error(RF_E_IO, "%s: %s: cannot read %s: %s", op, path, what, strerror(errno));
    return rfi_error(RF_E_CORRUPT, "%s: %s: truncated file (%s)", op, path, what);
}

/* Reads and parses the header of the open file. */
static rf_status read_header(const char *op, const char *path, int fd, uint64_t size,
                             rfi_st_header *h, uint64_t *data_start)
{
    if (size < 8)
        return rfi_error(RF_E_CORRUPT, "%s: %s: %llu bytes is too short for a safetensors "
                         "file (truncated?)", op, path, (unsigned long long)size);
    uint8_t len8[8];
    if (!read_at(fd, len8, 8, 0))
        return read_failure(op, path, "the header length");
    uint64_t len = 0;
    for (int i = 7; i >= 0; i--)
        len = len << 8 | len8[i];
    if (len > RFI_ST_MAX_HEADER || len > size - 8)
        return rfi_error(RF_E_CORRUPT, "%s: %s: header length %llu exceeds the %s (%llu bytes)",
                         op, path, (unsigned long long)len,
                         len > RFI_ST_MAX_HEADER ? "limit" : "file",
                         (unsigned long long)(len > RFI_ST_MAX_HEADER ? RFI_ST_MAX_HEADER
                                                                      : size - 8));
    char *json = rfi_malloc((size_t)len + 1);
    if (!json)
        return rfi_error(RF_E_NOMEM, "%s: %s: out of memory for a %llu-byte header", op, path,
                         (unsigned long long)len);
    rf_status st = RF_OK;
    if (!read_at(fd, json, (size_t)len, 8))
        st = read_failure(op, path, "the header");
    if (st == RF_OK)
        st = rfi_st_parse(path, json, (size_t)len, size - 8 - len, h);
    rfi_free(json);
    *data_start = 8 + len;
    return st;
}

/* e must match w; messages name the file's tensor (the prefix, when w's name
 * is the model's, then w's name). */
static rf_status check_match(const char *op, const char *path, const named *w,
                             const rfi_st_entry *e, const char *prefix)
{
    const rf_array *a = w->a;
    const char *pre = strncmp(w->name, "opt.", 4) ? prefix : "";
    if (!e)
        return rfi_error(RF_E_CORRUPT, "%s: %s: tensor \"%s%s\" is missing", op, path, pre,
                         w->name);
    char want[128], found[128];
    rfi_type_str(want, sizeof want, a->dtype, a->dims, a->rank);
    rfi_type_str(found, sizeof found, e->dtype, e->dims, e->rank);
    if (e->dtype != a->dtype)
        return rfi_error(RF_E_DTYPE, "%s: %s: tensor \"%s%s\": expected %s, found %s", op,
                         path, pre, w->name, want, found);
    bool same = e->rank == a->rank;
    for (int d = 0; same && d < a->rank; d++)
        same = e->dims[d] == a->dims[d];
    if (!same)
        return rfi_error(RF_E_SHAPE, "%s: %s: tensor \"%s%s\": expected %s, found %s", op,
                         path, pre, w->name, want, found);
    return RF_OK;
}

/* Whether an entry is one PyTorch's state_dict has and reflux has no use for:
 * BatchNorm's num_batches_tracked (its momentum is fixed), so a PyTorch model's
 * saved weights load. */
static bool torch_only(const char *name)
{
    static const char suffix[] = ".num_batches_tracked";
    size_t n = strlen(name), k = sizeof suffix - 1;
    return n >= k && !strcmp(name + n - k, suffix);
}

/* Whether a is the RNG key of a Dropout layer in m's tree: reflux's own
 * state, which a PyTorch state_dict has no counterpart for. */
static bool is_dropout_key(rf_model *m, const rf_array *a)
{
    if (!strcmp(rf_model_type_name(m), "Dropout"))
        for (int i = 0; i < rf_model_n_state(m); i++)
            if (rf_model_state_array(m, i) == a)
                return true;
    for (int i = 0; i < rf_model_n_children(m); i++)
        if (is_dropout_key(rf_model_child(m, i), a))
            return true;
    return false;
}

/* The file's entry for wanted array w: the model's under the prefix, the
 * optimiser's ("opt.") as they are. NULL when the file has none. */
static const rfi_st_entry *find_entry(const rfi_st_header *h, const named *w,
                                      const char *prefix, bool *oom)
{
    if (!prefix[0] || !strncmp(w->name, "opt.", 4))
        return rfi_st_find(h, w->name);
    size_t n = strlen(prefix) + strlen(w->name) + 1;
    char *name = rfi_malloc(n);
    if (!name) {
        *oom = true;
        return NULL;
    }
    snprintf(name, n, "%s%s", prefix, w->name);
    const rfi_st_entry *e = rfi_st_find(h, name);
    rfi_free(name);
    return e;
}

/* Whether the file's tensor `name` is one this load is about: the optimiser's
 * when one is given, the model's under the prefix. */
static bool in_scope(const char *name, const char *prefix, bool with_opt)
{
    if (!strncmp(name, "opt.", 4))
        return with_opt;
    return !strncmp(name, prefix, strlen(prefix));
}

/* Every wanted array has a matching entry, and every entry in scope is wanted
 * (PyTorch's entries reflux has no use for never need to be); `partial` drops
 * both rules, leaving arrays the file lacks as they are. A Dropout layer's key
 * the file lacks (a PyTorch model's file) keeps its value: found[i] stays NULL. */
static rf_status match_all(const char *op, const char *path, rf_model *m, const named_list *l,
                           const rfi_st_header *h, bool with_opt, const rf_load_opts *o,
                           const rfi_st_entry **found, int *loaded)
{
    bool *used = rfi_calloc((size_t)(h->n ? h->n : 1), sizeof *used);
    if (!used)
        return rfi_error(RF_E_NOMEM, "%s: out of memory", op);
    const char *prefix = o->prefix ? o->prefix : "";
    rf_status st = RF_OK;
    bool oom = false;
    int model_arrays = 0, model_loaded = 0; /* the optimiser's do not count for `partial` */
    *loaded = 0;
    for (int i = 0; i < l->n && st == RF_OK; i++) {
        found[i] = find_entry(h, &l->v[i], prefix, &oom);
        if (oom)
            st = rfi_error(RF_E_NOMEM, "%s: out of memory", op);
        else if (found[i] || (!o->partial && !is_dropout_key(m, l->v[i].a)))
            st = check_match(op, path, &l->v[i], found[i], prefix);
        bool model_array = strncmp(l->v[i].name, "opt.", 4) != 0;
        model_arrays += model_array;
        if (st == RF_OK && found[i]) {
            used[found[i] - h->entries] = true;
            ++*loaded;
            model_loaded += model_array;
        }
    }
    for (int i = 0; i < h->n && st == RF_OK && !o->partial; i++) {
        const char *name = h->entries[i].name;
        if (!used[i] && !torch_only(name) && in_scope(name, prefix, with_opt))
            st = rfi_error(RF_E_CORRUPT, "%s: %s: the file has tensor \"%s\", which the %s "
                           "lacks", op, path, name,
                           strncmp(name, "opt.", 4) == 0 ? "optimiser" : "model");
    }
    if (st == RF_OK && o->partial && model_loaded == 0 && model_arrays > 0)
        st = rfi_error(RF_E_INVALID, "%s: %s: none of the file's tensors%s%s%s is one of the "
                       "model's (the model's first is \"%s\")", op, path,
                       prefix[0] ? " under \"" : "", prefix, prefix[0] ? "\"" : "",
                       l->v[0].name);
    rfi_free(used);
    return st;
}

/* Reads every wanted tensor into one staging buffer, then writes them all. */
static rf_status stage_and_write(const char *op, const char *path, int fd, uint64_t data_start,
                                 const named_list *l, const rfi_st_entry **found)
{
    size_t total = 0;
    for (int i = 0; i < l->n; i++)
        total += found[i] ? l->v[i].a->nbytes : 0;
    char *staging = rfi_malloc(total ? total : 1);
    if (!staging)
        return rfi_error(RF_E_NOMEM, "%s: %s: out of memory staging %zu bytes", op, path, total);
    rf_status st = RF_OK;
    size_t at = 0;
    for (int i = 0; i < l->n && st == RF_OK; i++) {
        size_t n = found[i] ? l->v[i].a->nbytes : 0;
        if (n && !read_at(fd, staging + at, n, data_start + found[i]->begin))
            st = read_failure(op, path, l->v[i].name);
        at += n;
    }
    /* The file is fully read and valid: only now touch the arrays. */
    at = 0;
    for (int i = 0; i < l->n && st == RF_OK; i++) {
        if (!found[i])
            continue;
        st = rf_array_write(l->v[i].a, staging + at, l->v[i].a->nbytes);
        at += l->v[i].a->nbytes;
    }
    rfi_free(staging);
    return st;
}

rf_status rf_checkpoint_load(const char *path, rf_model *m, rf_opt *opt)
{
    return rf_checkpoint_load_opts(path, m, opt, NULL);
}

rf_status rf_checkpoint_load_opts(const char *path, rf_model *m, rf_opt *opt,
                                  const rf_load_opts *o)
{
    static const char op[] = "rf_checkpoint_load";
    rf_load_opts defaults = {0};
    if (!o)
        o = &defaults;
    if (o->loaded)
        *o->loaded = 0;
    if (!path || !m)
        return rfi_error(RF_E_INVALID, "%s: %s is NULL", op, path ? "model" : "path");
    if (!host_is_little_endian())
        return rfi_error(RF_E_UNSUPPORTED, "%s: big-endian hosts are not supported", op);
    int64_t size;
    int fd = rfi_open_regular(path, &size);
    if (fd < 0)
        return rfi_error(RF_E_IO, "%s: %s: %s", op, path,
                         errno == EINVAL ? "not a regular file" : strerror(errno));
    named_list l = {0};
    rfi_st_header h = {0};
    const rfi_st_entry **found = NULL;
    uint64_t data_start = 0;
    rf_status st = collect_arrays(op, m, opt, &l);
    if (st == RF_OK)
        st = read_header(op, path, fd, (uint64_t)size, &h, &data_start);
    if (st == RF_OK) {
        found = rfi_calloc((size_t)(l.n ? l.n : 1), sizeof *found);
        if (!found)
            st = rfi_error(RF_E_NOMEM, "%s: out of memory", op);
    }
    int loaded = 0;
    if (st == RF_OK)
        st = match_all(op, path, m, &l, &h, opt != NULL, o, found, &loaded);
    if (st == RF_OK)
        st = stage_and_write(op, path, fd, data_start, &l, found);
    if (st == RF_OK && o->loaded)
        *o->loaded = loaded;
    close(fd);
    rfi_free(found);
    rfi_st_header_free(&h);
    named_list_free(&l);
    return st;
}
