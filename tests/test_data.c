/* test_data.c: data loaders, IDX and Fashion-MNIST readers, checkpoints.
 *
 * Loader: batch counts and sizes, drop_last, shuffling reproducible per seed
 * and different per epoch, every observation exactly once per epoch, rows
 * kept together across arrays (checked against the row index each array
 * encodes), the device-wrapped loader (prefetch thread), resets mid-epoch,
 * bad arguments. IDX: files written here by hand (raw and gzip) read back;
 * corrupt ones give errors. Fashion-MNIST: the installed test split, when
 * present. Checkpoints: a round trip is bit-identical, the header is checked
 * by a parser written here, and bad files give the right error and leave the
 * model untouched. Files PyTorch wrote (tests/ref/gen_checkpoint.py: most
 * layer kinds, a nested Sequential, BatchNorm's counter) load into the same
 * model built in reflux, which then computes what PyTorch computed, and save
 * again under the same names.
 */
#include "fixture.h"
#include "test_util.h"

#include "runtime/runtime.h" /* a fake device struct for the worker-error test */

#include <dirent.h>
#include <stdint.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

/* ---- Loader ------------------------------------------------------------------------------- */

#define NOBS 23

/* X [NOBS, 3] f32 with X[i, j] = 10 i + j, Y [NOBS] i32 = 7 i, Z [NOBS, 2, 2] f64 = i + k/4:
 * every row says which observation it is. */
static void make_xyz(rf_array **x, rf_array **y, rf_array **z)
{
    float xv[NOBS * 3];
    int32_t yv[NOBS];
    double zv[NOBS * 4];
    for (int i = 0; i < NOBS; i++) {
        for (int j = 0; j < 3; j++)
            xv[i * 3 + j] = (float)(10 * i + j);
        yv[i] = 7 * i;
        for (int k = 0; k < 4; k++)
            zv[i * 4 + k] = i + k / 4.0;
    }
    *x = rf_array_from(RF_F32, RF_SHAPE(NOBS, 3), xv);
    *y = rf_array_from(RF_I32, RF_SHAPE(NOBS), yv);
    *z = rf_array_from(RF_F64, RF_SHAPE(NOBS, 2, 2), zv);
}

/* Checks one batch of (X, Y, Z) and records the observations it holds;
 * returns the batch size, -1 on a malformed batch. z_f32: Z arrived as f32. */
static int check_batch(rf_array *const *b, int seen[NOBS], int order[NOBS], int *pos,
                       rf_device *dev, bool z_f32)
{
    int64_t n = rf_array_dims(b[0])[0];
    bool ok = rf_array_rank(b[0]) == 2 && rf_array_dims(b[0])[1] == 3 && rf_array_rank(b[1]) == 1 &&
              rf_array_dims(b[1])[0] == n && rf_array_rank(b[2]) == 3 &&
              rf_array_dims(b[2])[0] == n && rf_array_dims(b[2])[1] == 2;
    CHECK(ok);
    if (!ok)
        return -1;
    for (int j = 0; j < 3; j++)
        CHECK(rf_array_device(b[j]) == dev);
    CHECK(rf_array_dtype(b[2]) == (z_f32 ? RF_F32 : RF_F64));
    const float *x = rf_array_data(b[0]);
    const int32_t *y = rf_array_data(b[1]);
    for (int64_t r = 0; r < n; r++) {
        int i = (int)(x[r * 3] / 10);
        CHECK(i >= 0 && i < NOBS);
        if (i < 0 || i >= NOBS)
            return -1;
        seen[i]++;
        order[(*pos)++] = i;
        for (int j = 0; j < 3; j++)
            CHECK(x[r * 3 + j] == (float)(10 * i + j));
        CHECK(y[r] == 7 * i);
        for (int k = 0; k < 4; k++) {
            double zk = z_f32 ? ((const float *)rf_array_data(b[2]))[r * 4 + k]
                              : ((const double *)rf_array_data(b[2]))[r * 4 + k];
            CHECK(zk == i + k / 4.0);
        }
    }
    return (int)n;
}

/* Runs one epoch, checking every batch; sizes[] receives the batch sizes. */
static int run_epoch(rf_loader *l, int order[NOBS], int *sizes, rf_device *dev, bool z_f32)
{
    int seen[NOBS] = {0}, pos = 0, nb = 0;
    rf_array *const *b;
    for (;;) {
        rf_status st = rf_loader_next(l, &b);
        CHECK_OK(st);
        if (st != RF_OK || !b)
            break;
        int n = check_batch(b, seen, order, &pos, dev, z_f32);
        if (n < 0)
            break;
        sizes[nb++] = n;
    }
    return nb;
}

static void test_loader_batching(void)
{
    rf_array *x, *y, *z;
    make_xyz(&x, &y, &z);
    rf_array *arrs[3] = {x, y, z};
    rf_loader *l = rf_loader_new(arrs, 3, &(rf_loader_opts){.batchsize = 5});
    CHECK(l);
    rf_array_free(x); /* the loader holds its own references */
    CHECK(rf_loader_n_batches(l) == 5 && rf_loader_n_obs(l) == NOBS && rf_loader_n_arrays(l) == 3);
    int order[NOBS], sizes[8];
    for (int epoch = 0; epoch < 2; epoch++) {
        int nb = run_epoch(l, order, sizes, rf_device_host(), false);
        CHECK(nb == 5);
        CHECK(sizes[0] == 5 && sizes[3] == 5 && sizes[4] == 3); /* partial last batch */
        for (int i = 0; i < NOBS; i++)
            CHECK(order[i] == i); /* unshuffled: in order */
        rf_array *const *b = (rf_array *const *)1;
        CHECK_OK(rf_loader_next(l, &b)); /* stays at the end until reset */
        CHECK(b == NULL);
        CHECK_OK(rf_loader_reset(l));
    }
    rf_loader_free(l);

    l = rf_loader_new(arrs + 1, 2, &(rf_loader_opts){.batchsize = 5, .drop_last = true});
    CHECK(rf_loader_n_batches(l) == 4);
    int n = 0;
    rf_array *const *b;
    while (rf_loader_next(l, &b) == RF_OK && b) {
        CHECK(rf_array_dims(b[0])[0] == 5);
        n++;
    }
    CHECK(n == 4);
    rf_loader_free(l);

    /* Default options: batchsize 1. A batch larger than the data with drop_last: no batches. */
    l = rf_loader_new(arrs + 1, 1, NULL);
    CHECK(rf_loader_n_batches(l) == NOBS);
    rf_loader_free(l);
    l = rf_loader_new(arrs + 1, 1, &(rf_loader_opts){.batchsize = 100, .drop_last = true});
    CHECK(rf_loader_n_batches(l) == 0);
    CHECK_OK(rf_loader_next(l, &b));
    CHECK(b == NULL);
    rf_loader_free(l);
    rf_array_free(y);
    rf_array_free(z);
}

static bool same_order(const int *a, const int *b)
{
    return memcmp(a, b, NOBS * sizeof *a) == 0;
}

static void epoch_orders(uint64_t seed, int epochs, int orders[][NOBS], rf_device *dev)
{
    rf_array *x, *y, *z;
    make_xyz(&x, &y, &z);
    rf_loader *l = rf_loader_new((rf_array *[]){x, y, z}, 3,
                                 &(rf_loader_opts){.batchsize = 4, .shuffle = true, .seed = seed});
    if (dev)
        CHECK_OK(rf_loader_to(l, dev));
    int sizes[8];
    for (int e = 0; e < epochs; e++) {
        int nb = run_epoch(l, orders[e], sizes, dev ? dev : rf_device_host(), dev != NULL);
        CHECK(nb == 6 && sizes[5] == 3);
        int seen[NOBS] = {0};
        for (int i = 0; i < NOBS; i++)
            seen[orders[e][i]]++;
        for (int i = 0; i < NOBS; i++)
            CHECK(seen[i] == 1); /* every observation exactly once */
        CHECK_OK(rf_loader_reset(l));
    }
    rf_loader_free(l);
    rf_array_free(x);
    rf_array_free(y);
    rf_array_free(z);
}

static void test_loader_shuffle(void)
{
    int a[3][NOBS], b[3][NOBS], c[3][NOBS], d[3][NOBS];
    epoch_orders(42, 3, a, NULL);
    epoch_orders(42, 3, b, NULL);
    epoch_orders(43, 3, c, NULL);
    epoch_orders(42, 3, d, rf_device_cpu()); /* the device path shuffles the same way */
    int identity[NOBS];
    for (int i = 0; i < NOBS; i++)
        identity[i] = i;
    for (int e = 0; e < 3; e++) {
        CHECK(same_order(a[e], b[e])); /* reproducible per seed */
        CHECK(same_order(a[e], d[e]));
        CHECK(!same_order(a[e], c[e])); /* another seed, another order */
        CHECK(!same_order(a[e], identity));
    }
    CHECK(!same_order(a[0], a[1]) && !same_order(a[1], a[2])); /* reshuffled per epoch */
}

/* The first float of the next batch's X (10 * its first row), -1 at the end. */
static float next_first(rf_loader *l)
{
    rf_array *const *b = NULL;
    CHECK_OK(rf_loader_next(l, &b));
    float v[NOBS * 3] = {-1};
    if (b)
        CHECK_OK(rf_array_read(b[0], v, rf_array_nbytes(b[0])));
    return v[0];
}

/* rf_loader_position / rf_loader_seek: a loader built again and put where the first
 * one was gives the batches the first one gives next, on the host and through a
 * device (whose prefetched batch is dropped). */
static void test_loader_seek(rf_device *dev)
{
    rf_array *x, *y, *z;
    make_xyz(&x, &y, &z);
    rf_array *arrs[3] = {x, y, z};
    rf_loader_opts o = {.batchsize = 4, .shuffle = true, .seed = 5};
    rf_loader *a = rf_loader_new(arrs, 3, &o), *b = rf_loader_new(arrs, 3, &o);
    if (dev) {
        CHECK_OK(rf_loader_to(a, dev));
        CHECK_OK(rf_loader_to(b, dev));
    }
    CHECK(a && b);
    if (!a || !b)
        goto done;
    uint64_t epoch = 9;
    int64_t batches = 9;
    rf_loader_position(a, &epoch, &batches);
    CHECK(epoch == 0 && batches == 0);
    CHECK_OK(rf_loader_reset(a));
    CHECK_OK(rf_loader_reset(a));
    for (int i = 0; i < 3; i++)
        next_first(a);
    rf_loader_position(a, &epoch, &batches);
    CHECK(epoch == 2 && batches == 3);
    next_first(b); /* b mid-epoch 0, a batch in flight */
    CHECK_OK(rf_loader_seek(b, epoch, batches));
    for (int i = 3; i < 7; i++) { /* 6 batches an epoch, then the end */
        float fa = next_first(a);
        CHECK(fa == next_first(b));
        CHECK((i < 6) == (fa >= 0));
    }
    /* at the end of epoch 2, as after two rf_train passes: the next reset gives epoch 3 */
    CHECK_OK(rf_loader_seek(b, 2, rf_loader_n_batches(b)));
    CHECK(next_first(b) == -1);
    CHECK_OK(rf_loader_reset(a));
    CHECK_OK(rf_loader_reset(b));
    for (int i = 0; i < 6; i++)
        CHECK(next_first(a) == next_first(b));
    CHECK_STATUS(rf_loader_seek(b, 0, 7), RF_E_INVALID);
    CHECK_MSG("rf_loader_seek: batch 7 is out of range (the loader has 6 batches an epoch)");
    CHECK_STATUS(rf_loader_seek(b, 0, -1), RF_E_INVALID);
    CHECK_STATUS(rf_loader_seek(NULL, 0, 0), RF_E_INVALID);
    rf_loader_position(NULL, &epoch, NULL);
    CHECK(epoch == 0);
done:
    rf_loader_free(a);
    rf_loader_free(b);
    rf_array_free(x);
    rf_array_free(y);
    rf_array_free(z);
}

/* A child forked after rf_loader_to has no prefetch thread: the loader's calls refuse
 * there (they waited forever for it) and rf_loader_free frees it; the parent's loader
 * goes on. */
static void test_loader_fork(void)
{
    rf_array *x, *y, *z;
    make_xyz(&x, &y, &z);
    rf_array *arrs[3] = {x, y, z};
    rf_loader *l = rf_loader_new(arrs, 3, &(rf_loader_opts){.batchsize = 5});
    CHECK_OK(rf_loader_to(l, rf_device_cpu()));
    CHECK(next_first(l) == 0.0f); /* batch 1 is in flight now */
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        alarm(20); /* a hang fails the test instead of stopping it */
        rf_array *const *b = NULL;
        int bad = rf_loader_next(l, &b) != RF_E_INVALID || b != NULL;
        bad |= strstr(rf_errmsg(), "rf_loader_next: the loader was wrapped with a device "
                                   "(rf_loader_to) before this process was forked") == NULL;
        bad |= rf_loader_reset(l) != RF_E_INVALID;
        bad |= rf_loader_seek(l, 0, 0) != RF_E_INVALID;
        bad |= rf_loader_to(l, rf_device_cpu()) != RF_E_INVALID;
        rf_loader_free(l);
        _exit(bad);
    }
    CHECK(pid > 0);
    int status = -1;
    if (pid > 0)
        CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(next_first(l) == 50.0f); /* row 5 */
    rf_loader_free(l);
    rf_array_free(x);
    rf_array_free(y);
    rf_array_free(z);
}

static void test_loader_device(void)
{
    rf_array *x, *y, *z;
    make_xyz(&x, &y, &z);
    rf_array *arrs[3] = {x, y, z};
    rf_loader *l = rf_loader_new(arrs, 3, &(rf_loader_opts){.batchsize = 6});
    CHECK_OK(rf_loader_to(l, rf_device_cpu()));
    int order[NOBS], sizes[8];
    CHECK(run_epoch(l, order, sizes, rf_device_cpu(), true) == 4);
    CHECK(sizes[3] == 5);
    for (int i = 0; i < NOBS; i++)
        CHECK(order[i] == i);

    /* Reset mid-epoch (a batch prefetched and not taken), then a full epoch. */
    CHECK_OK(rf_loader_reset(l));
    rf_array *const *b;
    CHECK_OK(rf_loader_next(l, &b));
    CHECK(b && rf_array_dims(b[0])[0] == 6);
    CHECK_OK(rf_loader_reset(l));
    CHECK(run_epoch(l, order, sizes, rf_device_cpu(), true) == 4);
    for (int i = 0; i < NOBS; i++)
        CHECK(order[i] == i);

    /* Back to the host device; then free mid-epoch with a prefetch in flight. */
    CHECK_OK(rf_loader_reset(l));
    CHECK_OK(rf_loader_to(l, rf_device_host()));
    CHECK(run_epoch(l, order, sizes, rf_device_host(), false) == 4);
    CHECK_OK(rf_loader_reset(l));
    CHECK_OK(rf_loader_to(l, rf_device_cpu()));
    CHECK_OK(rf_loader_next(l, &b));
    rf_loader_free(l);

    /* Free right after wrapping (the first batch may still be in preparation). */
    l = rf_loader_new(arrs, 3, &(rf_loader_opts){.batchsize = 2});
    CHECK_OK(rf_loader_to(l, rf_device_cpu()));
    rf_loader_free(l);

    /* f64 on the CPU device: unwrapped, batches stay where and as they are;
     * wrapped with the CPU device, they become f32 as rf_array_to makes them. */
    double v64[6] = {1, 2, 3, 4, 5, 6};
    rf_array *h64 = rf_array_from(RF_F64, RF_SHAPE(6), v64);
    rf_array *c64 = rf_array_to_opts(h64, rf_device_cpu(), &(rf_to_opts){.keep_f64 = true});
    CHECK(c64 && rf_array_dtype(c64) == RF_F64);
    l = rf_loader_new(&c64, 1, &(rf_loader_opts){.batchsize = 4});
    CHECK_OK(rf_loader_next(l, &b));
    CHECK(b && rf_array_dtype(b[0]) == RF_F64 && rf_array_device(b[0]) == rf_device_cpu());
    double got64[4] = {0};
    CHECK(b && rf_array_numel(b[0]) == 4);
    CHECK_OK(b ? rf_array_read(b[0], got64, sizeof got64) : RF_E_INVALID);
    CHECK(got64[0] == 1.0 && got64[3] == 4.0);
    CHECK_OK(rf_loader_reset(l));
    CHECK_OK(rf_loader_to(l, rf_device_cpu()));
    CHECK_OK(rf_loader_next(l, &b));
    CHECK(b && rf_array_dtype(b[0]) == RF_F32);
    rf_loader_free(l);
    rf_array_free(c64);
    rf_array_free(h64);

    /* A device that cannot hold arrays: the worker's error reaches the caller. */
    rf_device *cuda = rf_device_cuda(0);
    if (!cuda) {
        rf_device fake = {RF_DEVICE_CUDA, 7, "cuda:7"};
        l = rf_loader_new(arrs, 3, &(rf_loader_opts){.batchsize = 8});
        CHECK_OK(rf_loader_to(l, &fake));
        b = (rf_array *const *)1;
        CHECK_STATUS(rf_loader_next(l, &b), RF_E_DEVICE);
        CHECK(b == NULL);
        CHECK_MSG("rf_loader_next: batch 0");
        CHECK_MSG("cuda:7");
        rf_loader_free(l);
    }
    rf_array_free(x);
    rf_array_free(y);
    rf_array_free(z);
}

static void test_loader_errors(void)
{
    rf_array *a = rf_zeros(RF_F32, RF_SHAPE(10, 2));
    rf_array *b = rf_zeros(RF_I32, RF_SHAPE(9));
    rf_array *s = rf_zeros(RF_F32, NULL, 0);
    CHECK(!rf_loader_new((rf_array *[]){a, b}, 2, NULL));
    CHECK(strstr(rf_errmsg(), "dim 0") && strstr(rf_errmsg(), "f32[10,2]") &&
          strstr(rf_errmsg(), "i32[9]"));
    CHECK(!rf_loader_new(NULL, 1, NULL));
    CHECK_MSG("NULL");
    CHECK(!rf_loader_new((rf_array *[]){a, NULL}, 2, NULL));
    CHECK_MSG("array 1 is NULL");
    CHECK(!rf_loader_new((rf_array *[]){a}, 0, NULL));
    CHECK(!rf_loader_new((rf_array *[]){s}, 1, NULL));
    CHECK_MSG("scalar");
    CHECK(!rf_loader_new((rf_array *[]){a}, 1, &(rf_loader_opts){.batchsize = 0}));
    CHECK_MSG("batchsize");
    CHECK(!rf_loader_new((rf_array *[]){a}, 1, &(rf_loader_opts){.batchsize = -3}));
    rf_loader *l = rf_loader_new((rf_array *[]){a}, 1, NULL);
    CHECK_STATUS(rf_loader_next(l, NULL), RF_E_INVALID);
    rf_array *const *batch;
    CHECK_STATUS(rf_loader_next(NULL, &batch), RF_E_INVALID);
    CHECK_STATUS(rf_loader_reset(NULL), RF_E_INVALID);
    CHECK_STATUS(rf_loader_to(l, NULL), RF_E_INVALID);
    CHECK_STATUS(rf_loader_to(NULL, rf_device_cpu()), RF_E_INVALID);
    CHECK(rf_loader_n_batches(NULL) == 0);
    rf_loader_free(l);
    rf_loader_free(NULL);
    /* a batch size near INT64_MAX: one smaller batch (10 rows), or none with drop_last */
    for (int drop = 0; drop < 2; drop++) {
        l = rf_loader_new((rf_array *[]){a}, 1,
                          &(rf_loader_opts){.batchsize = INT64_MAX - 5, .drop_last = drop});
        CHECK(l && rf_loader_n_batches(l) == 1 - drop);
        batch = NULL;
        CHECK_OK(rf_loader_next(l, &batch));
        CHECK(drop ? batch == NULL : batch && rf_array_dims(batch[0])[0] == 10);
        rf_loader_free(l);
    }
    /* 2^62 empty u8 observations: the shuffle's permutation has no byte count */
    rf_array *huge = rf_zeros(RF_U8, RF_SHAPE((int64_t)1 << 62, 0));
    CHECK(huge != NULL);
    rf_clear_error();
    CHECK(!rf_loader_new((rf_array *[]){huge}, 1, &(rf_loader_opts){.batchsize = 4,
                                                                      .shuffle = true}));
    CHECK_MSG("out of memory (4611686018427387904 observations)");
    rf_array_free(huge);
    rf_array_free(a);
    rf_array_free(b);
    rf_array_free(s);
}

/* ---- IDX ----------------------------------------------------------------------------------- */

static char tmpdir[256];

static const char *tmp_path(const char *name)
{
    static char buf[4][512];
    static int next;
    char *p = buf[next++ % 4];
    snprintf(p, sizeof buf[0], "%s/%s", tmpdir, name);
    return p;
}

static void write_file(const char *path, const void *data, size_t n, bool gz)
{
    if (gz) {
        gzFile f = gzopen(path, "wb");
        CHECK(f && gzwrite(f, data, (unsigned)n) == (int)n);
        if (f)
            gzclose(f);
        return;
    }
    FILE *f = fopen(path, "wb");
    CHECK(f && fwrite(data, 1, n, f) == n);
    if (f)
        fclose(f);
}

/* An IDX image: magic, big-endian u32 dims, then `data` (already big-endian). */
static size_t idx_bytes(uint8_t *out, uint8_t type, int rank, const uint32_t *dims,
                        const void *data, size_t n)
{
    size_t k = 0;
    out[k++] = 0;
    out[k++] = 0;
    out[k++] = type;
    out[k++] = (uint8_t)rank;
    for (int i = 0; i < rank; i++)
        for (int s = 24; s >= 0; s -= 8)
            out[k++] = (uint8_t)(dims[i] >> s);
    memcpy(out + k, data, n);
    return k + n;
}

static void put_be(uint8_t *p, uint64_t v, int bytes)
{
    for (int i = 0; i < bytes; i++)
        p[i] = (uint8_t)(v >> (8 * (bytes - 1 - i)));
}

static void test_idx_types(bool gz)
{
    uint8_t file[512], data[256];
    const uint32_t dims[2] = {2, 3};
    const char *path = tmp_path(gz ? "t.idx.gz" : "t.idx");
    rf_array *a = NULL;

    const uint8_t u8[6] = {0, 1, 2, 127, 128, 255};
    write_file(path, file, idx_bytes(file, 0x08, 2, dims, u8, 6), gz);
    CHECK_OK(rf_idx_load(path, &a));
    CHECK(a && rf_array_dtype(a) == RF_U8 && rf_array_rank(a) == 2 && rf_array_dims(a)[0] == 2 &&
          rf_array_dims(a)[1] == 3 && memcmp(rf_array_data(a), u8, 6) == 0);
    rf_array_free(a);

    const int8_t i8[6] = {-128, -1, 0, 1, 5, 127};
    write_file(path, file, idx_bytes(file, 0x09, 2, dims, i8, 6), gz);
    CHECK_OK(rf_idx_load(path, &a));
    CHECK(a && rf_array_dtype(a) == RF_I32);
    for (int i = 0; a && i < 6; i++)
        CHECK(((int32_t *)rf_array_data(a))[i] == i8[i]);
    rf_array_free(a);

    const int16_t i16[6] = {-32768, -300, -1, 0, 300, 32767};
    for (int i = 0; i < 6; i++)
        put_be(data + 2 * i, (uint16_t)i16[i], 2);
    write_file(path, file, idx_bytes(file, 0x0B, 2, dims, data, 12), gz);
    CHECK_OK(rf_idx_load(path, &a));
    CHECK(a && rf_array_dtype(a) == RF_I32);
    for (int i = 0; a && i < 6; i++)
        CHECK(((int32_t *)rf_array_data(a))[i] == i16[i]);
    rf_array_free(a);

    const int32_t i32[6] = {INT32_MIN, -70000, -1, 0, 70000, INT32_MAX};
    for (int i = 0; i < 6; i++)
        put_be(data + 4 * i, (uint32_t)i32[i], 4);
    write_file(path, file, idx_bytes(file, 0x0C, 2, dims, data, 24), gz);
    CHECK_OK(rf_idx_load(path, &a));
    CHECK(a && rf_array_dtype(a) == RF_I32 && memcmp(rf_array_data(a), i32, 24) == 0);
    rf_array_free(a);

    const float f32[6] = {-1.5f, 0.0f, 3.25f, 1e-30f, -7e20f, 0.1f};
    for (int i = 0; i < 6; i++) {
        uint32_t u;
        memcpy(&u, &f32[i], 4);
        put_be(data + 4 * i, u, 4);
    }
    write_file(path, file, idx_bytes(file, 0x0D, 2, dims, data, 24), gz);
    CHECK_OK(rf_idx_load(path, &a));
    CHECK(a && rf_array_dtype(a) == RF_F32 && memcmp(rf_array_data(a), f32, 24) == 0);
    rf_array_free(a);

    const double f64[3] = {-2.5, 1e300, 0.1};
    for (int i = 0; i < 3; i++) {
        uint64_t u;
        memcpy(&u, &f64[i], 8);
        put_be(data + 8 * i, u, 8);
    }
    write_file(path, file, idx_bytes(file, 0x0E, 1, (const uint32_t[]){3}, data, 24), gz);
    CHECK_OK(rf_idx_load(path, &a));
    CHECK(a && rf_array_dtype(a) == RF_F64 && rf_array_rank(a) == 1 &&
          memcmp(rf_array_data(a), f64, 24) == 0);
    rf_array_free(a);
}

static void test_idx_errors(void)
{
    uint8_t file[512] = {0}, data[64] = {0};
    const uint32_t dims[2] = {4, 6};
    rf_array *a = (rf_array *)1;
    const char *raw = tmp_path("bad.idx"), *gzp = tmp_path("bad.idx.gz");

    CHECK_STATUS(rf_idx_load(tmp_path("missing.idx"), &a), RF_E_IO);
    CHECK(a == NULL);
    CHECK_MSG("missing.idx");
    CHECK_MSG("No such file");

    size_t n = idx_bytes(file, 0x08, 2, dims, data, 24);
    file[0] = 0x12;
    file[1] = 0x34;
    write_file(raw, file, n, false);
    CHECK_STATUS(rf_idx_load(raw, &a), RF_E_CORRUPT);
    CHECK_MSG("bad magic 12 34 08 02");

    for (int gz = 0; gz < 2; gz++) {
        const char *p = gz ? gzp : raw;
        n = idx_bytes(file, 0x08, 2, dims, data, 24);
        write_file(p, file, n - 4, gz); /* truncated data */
        CHECK_STATUS(rf_idx_load(p, &a), RF_E_CORRUPT);
        CHECK_MSG("expected 24 bytes of data, found 20");
        write_file(p, file, n + 3, gz); /* trailing bytes */
        CHECK_STATUS(rf_idx_load(p, &a), RF_E_CORRUPT);
        CHECK_MSG("expected 24 bytes of data, found 27");
        n = idx_bytes(file, 0x08, 2, (const uint32_t[]){4000000000u, 4000000000u}, data, 24);
        write_file(p, file, n, gz); /* dims the file cannot hold: no huge allocation */
        CHECK_STATUS(rf_idx_load(p, &a), RF_E_CORRUPT);
        n = idx_bytes(file, 0x08, 9, (const uint32_t[]){1, 1, 1, 1, 1, 1, 1, 1, 1}, data, 1);
        write_file(p, file, n, gz);
        CHECK_STATUS(rf_idx_load(p, &a), RF_E_CORRUPT);
        CHECK_MSG("rank 9");
        n = idx_bytes(file, 0x08, 0, dims, data, 0);
        write_file(p, file, n, gz);
        CHECK_STATUS(rf_idx_load(p, &a), RF_E_CORRUPT);
        n = idx_bytes(file, 0x0A, 2, dims, data, 24);
        write_file(p, file, n, gz);
        CHECK_STATUS(rf_idx_load(p, &a), RF_E_CORRUPT);
        CHECK_MSG("0x0a");
        write_file(p, file, 6, gz); /* header cut inside the dims */
        CHECK_STATUS(rf_idx_load(p, &a), RF_E_CORRUPT);
        write_file(p, file, 2, gz);
        CHECK_STATUS(rf_idx_load(p, &a), RF_E_CORRUPT);
        CHECK(a == NULL);
    }

    /* A gzip stream cut short. */
    n = idx_bytes(file, 0x08, 2, dims, data, 24);
    write_file(gzp, file, n, true);
    FILE *f = fopen(gzp, "rb");
    uint8_t gzbuf[512];
    size_t gn = f ? fread(gzbuf, 1, sizeof gzbuf, f) : 0;
    if (f)
        fclose(f);
    write_file(gzp, gzbuf, gn - 10, false);
    CHECK_STATUS(rf_idx_load(gzp, &a), RF_E_CORRUPT);
    CHECK(a == NULL);
    /* Cut inside its 8-byte trailer (CRC-32, length): every data byte is
     * there, but nothing can vouch for them. */
    for (size_t cut = 1; cut <= 8; cut += 7) {
        write_file(gzp, gzbuf, gn - cut, false);
        CHECK_STATUS(rf_idx_load(gzp, &a), RF_E_CORRUPT);
        CHECK_MSG("truncated");
        CHECK(a == NULL);
    }

    CHECK_STATUS(rf_idx_load(NULL, &a), RF_E_INVALID);
    CHECK_STATUS(rf_idx_load(raw, NULL), RF_E_INVALID);
    CHECK_STATUS(rf_idx_load(tmpdir, &a), RF_E_IO); /* a directory */
    /* a FIFO: refused, where opening it waited for a writer forever */
    const char *fifo = tmp_path("fifo.idx");
    CHECK(mkfifo(fifo, 0600) == 0);
    CHECK_STATUS(rf_idx_load(fifo, &a), RF_E_IO);
    CHECK_MSG("fifo.idx: not a regular file");
    unlink(fifo);
}

/* Whether this build runs under AddressSanitizer, which reserves terabytes of
 * address space and so cannot run under an address-space limit. */
#if defined(__SANITIZE_ADDRESS__)
#define TD_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TD_ASAN 1
#endif
#endif
#ifndef TD_ASAN
#define TD_ASAN 0
#endif

/* A compressed IDX file whose header claims far more than its data: 1 MB of
 * incompressible i8 data claiming 10^9 elements, which the ~1100:1 bound on
 * deflate lets through and which widen to a 4 GB i32 array. The claim must
 * not size an allocation: in a child limited to 1 GB of address space above
 * what it has, the load reports the data it found, where allocating the
 * claim first made it "out of memory allocating i32[1000000000]". */
static void test_idx_claim_beyond_the_data(void)
{
    if (TD_ASAN) {
        printf("  (address-space limit skipped under AddressSanitizer)\n");
        return;
    }
    const size_t n = (size_t)1 << 20;
    uint8_t *file = malloc(n + 8);
    CHECK(file != NULL);
    if (!file)
        return;
    size_t k = idx_bytes(file, 0x09, 1, (const uint32_t[]){1000000000u}, file, 0);
    uint64_t x = 88172645463325252ull; /* xorshift: bytes deflate cannot shrink */
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        file[k + i] = (uint8_t)(x >> 32);
    }
    const char *gzp = tmp_path("claim.idx.gz");
    write_file(gzp, file, k + n, true);
    free(file);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        long pages = 0;
        FILE *statm = fopen("/proc/self/statm", "r");
        if (!statm || fscanf(statm, "%ld", &pages) != 1)
            _exit(3);
        fclose(statm);
        rlim_t have = (rlim_t)pages * (rlim_t)sysconf(_SC_PAGESIZE);
        struct rlimit lim = {have + ((rlim_t)1 << 30), have + ((rlim_t)1 << 30)};
        if (setrlimit(RLIMIT_AS, &lim) != 0)
            _exit(3);
        rf_array *a = NULL;
        rf_status st = rf_idx_load(gzp, &a);
        if (st != RF_E_CORRUPT || a ||
            !strstr(rf_errmsg(), "expected 1000000000 bytes of data, found 1048576")) {
            fprintf(stderr, "  claim beyond the data: status %d: %s\n", (int)st, rf_errmsg());
            _exit(1);
        }
        _exit(0);
    }
    int ws = 0;
    CHECK(pid > 0 && waitpid(pid, &ws, 0) == pid);
    CHECK(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
    unlink(gzp);
}

/* ---- Fashion-MNIST ----------------------------------------------------------------------- */

static void test_fashion_mnist(void)
{
    const char *dir = "/usr/share/datasets/fashion-mnist";
    if (access(dir, R_OK) != 0) {
        printf("test_data: skipping Fashion-MNIST (%s not installed)\n", dir);
        return;
    }
    rf_array *x = NULL, *y = NULL;
    CHECK_OK(rf_fashion_mnist(NULL, false, &x, &y));
    CHECK(x && rf_array_dtype(x) == RF_F32 && rf_array_rank(x) == 4);
    CHECK(y && rf_array_dtype(y) == RF_I32 && rf_array_rank(y) == 1);
    if (x && y) {
        const int64_t *d = rf_array_dims(x);
        CHECK(d[0] == 10000 && d[1] == 1 && d[2] == 28 && d[3] == 28);
        CHECK(rf_array_dims(y)[0] == 10000);
        const float *px = rf_array_data(x);
        float lo = 1, hi = 0;
        for (int64_t i = 0; i < rf_array_numel(x); i++) {
            lo = px[i] < lo ? px[i] : lo;
            hi = px[i] > hi ? px[i] : hi;
        }
        CHECK(lo == 0.0f && hi == 1.0f);
        const int32_t *py = rf_array_data(y);
        int count[10] = {0};
        bool in_range = true;
        for (int i = 0; i < 10000; i++) {
            in_range = in_range && py[i] >= 0 && py[i] <= 9;
            if (py[i] >= 0 && py[i] <= 9)
                count[py[i]]++;
        }
        CHECK(in_range);
        for (int c = 0; c < 10; c++)
            CHECK(count[c] == 1000); /* the test split is balanced */
    }
    rf_array_free(x);
    rf_array_free(y);
    CHECK_STATUS(rf_fashion_mnist(tmpdir, true, &x, &y), RF_E_IO);
    CHECK(x == NULL && y == NULL);
}

/* ---- Checkpoints ---------------------------------------------------------------------------- */

static rf_tensor *identity_forward(rf_model *m, rf_tensor *x)
{
    (void)m;
    return x;
}
static const rf_layer_type test_layer = {"TestLayer", identity_forward, NULL};

/* A two-level model: root {weight [3,4] f32, bias [3] f32, state steps i64 []},
 * child 0 {scale [2,2] f64, state flags [5] u8}. Values from seed. */
static rf_model *make_model(uint64_t seed, int64_t rows)
{
    rf_model *root = rf_model_new(&test_layer, NULL, 0);
    rf_model *child = rf_model_new(&test_layer, NULL, 0);
    rf_model_add_param(root, "weight", rf_randn(RF_F32, RF_SHAPE(rows, 4), seed));
    rf_model_add_param(root, "bias", rf_rand(RF_F32, RF_SHAPE(3), seed + 1));
    int64_t steps = (int64_t)seed * 1000 + 17;
    rf_model_add_state(root, "steps", rf_array_from(RF_I64, NULL, 0, &steps));
    rf_model_add_param(child, "scale", rf_randn(RF_F64, RF_SHAPE(2, 2), seed + 2));
    uint8_t flags[5];
    for (int i = 0; i < 5; i++)
        flags[i] = (uint8_t)(seed * 31 + (uint64_t)i);
    rf_model_add_state(child, "flags", rf_array_from(RF_U8, RF_SHAPE(5), flags));
    rf_model_add_child(root, child);
    return root;
}

/* A byte snapshot of every array of a model (and optimiser), in visit order. */
typedef struct snapshot {
    uint8_t bytes[4096];
    size_t len;
} snapshot;

static void snap_one(const char *path, rf_array *a, bool trainable, void *ud)
{
    (void)path;
    (void)trainable;
    snapshot *s = ud;
    size_t n = rf_array_nbytes(a);
    if (s->len + n <= sizeof s->bytes)
        rf_array_read(a, s->bytes + s->len, n);
    s->len += n;
}

static snapshot take_snapshot(rf_model *m, rf_opt *opt)
{
    snapshot s = {.len = 0};
    rf_model_visit(m, snap_one, &s);
    if (opt)
        rf_opt_visit(opt, snap_one, &s);
    return s;
}

static bool same_snapshot(const snapshot *a, const snapshot *b)
{
    return a->len == b->len && memcmp(a->bytes, b->bytes, a->len) == 0;
}

static uint8_t *read_all(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc((size_t)len + 1);
    *n = fread(buf, 1, (size_t)len, f);
    fclose(f);
    return buf;
}

static void count_one(const char *path, rf_array *a, bool trainable, void *ud)
{
    (void)path;
    (void)a;
    (void)trainable;
    ++*(int *)ud;
}

static int count_arrays(rf_model *m)
{
    int n = 0;
    rf_model_visit(m, count_one, &n);
    return n;
}

/* The format, checked without reflux: the header's length, its text for
 * each tensor, and the bytes its offsets point at. */
typedef struct format_check {
    const uint8_t *file;
    size_t size;
    const char *header;
    uint64_t header_len;
    int n_checked;
} format_check;

static void check_format_one(const char *path, rf_array *a, bool trainable, void *ud)
{
    (void)trainable;
    format_check *fc = ud;
    static const char *names[] = {"F32", "F64", "I32", "I64", "U8", "BOOL"};
    char key[256];
    snprintf(key, sizeof key, "\"%s\":{\"dtype\":\"%s\",\"shape\":[", path,
             names[rf_array_dtype(a)]);
    const char *at = strstr(fc->header, key);
    CHECK(at != NULL);
    if (!at)
        return;
    at += strlen(key);
    for (int d = 0; d < rf_array_rank(a); d++) {
        char *end;
        CHECK(strtoll(at, &end, 10) == rf_array_dims(a)[d]);
        at = end + (*end == ',');
    }
    unsigned long long begin = 0, end = 0;
    CHECK(sscanf(at, "],\"data_offsets\":[%llu,%llu]}", &begin, &end) == 2);
    CHECK(end - begin == rf_array_nbytes(a));
    CHECK(8 + fc->header_len + end <= fc->size);
    if (8 + fc->header_len + end > fc->size)
        return;
    uint8_t *buf = malloc(rf_array_nbytes(a) + 1);
    rf_array_read(a, buf, rf_array_nbytes(a));
    CHECK(memcmp(fc->file + 8 + fc->header_len + begin, buf, rf_array_nbytes(a)) == 0);
    free(buf);
    fc->n_checked++;
}

/* Checks that the safetensors file at `path` holds every array of `m` under its
 * name, with its dtype, shape and bytes (and `extra` tensors more); `writer`:
 * the format its metadata names, NULL for none. */
static void check_file_holds(const char *path, rf_model *m, const char *writer, int extra)
{
    size_t size = 0;
    uint8_t *file = read_all(path, &size);
    CHECK(file && size > 8);
    if (!file)
        return;
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--)
        hl = hl << 8 | file[i];
    CHECK(hl % 8 == 0 && 8 + hl <= size);
    char *header = malloc(hl + 1);
    memcpy(header, file + 8, hl);
    header[hl] = '\0';
    if (writer) {
        char meta[128];
        snprintf(meta, sizeof meta, "\"__metadata__\":{\"format\":\"%s\"}", writer);
        CHECK(strstr(header, meta) != NULL);
    }
    format_check fc = {file, size, header, hl, 0};
    rf_model_visit(m, check_format_one, &fc);
    CHECK(fc.n_checked == count_arrays(m));
    int n_tensors = 0;
    for (const char *at = header; (at = strstr(at, "\"data_offsets\"")); at++)
        n_tensors++;
    CHECK(n_tensors == fc.n_checked + extra);
    free(header);
    free(file);
}

static void write_bytes(const char *path, const void *p, size_t n)
{
    write_file(path, p, n, false);
}

/* Writes a safetensors file from a header text and data bytes. */
static void write_st(const char *path, const char *header, const void *data, size_t n)
{
    uint8_t buf[4096];
    uint64_t hl = strlen(header);
    for (int i = 0; i < 8; i++)
        buf[i] = (uint8_t)(hl >> (8 * i));
    memcpy(buf + 8, header, hl);
    memcpy(buf + 8 + hl, data, n);
    write_bytes(path, buf, 8 + hl + n);
}

/* The checkpoint temporaries left in tmpdir. */
static int count_temporaries(void)
{
    DIR *d = opendir(tmpdir);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d));)
        n += strncmp(e->d_name, ".reflux-checkpoint.", 19) == 0;
    if (d)
        closedir(d);
    return n;
}

static void test_checkpoint_roundtrip(void)
{
    const char *path = tmp_path("model.safetensors");
    rf_model *a = make_model(1, 3), *b = make_model(2, 3);
    snapshot sa = take_snapshot(a, NULL), sb = take_snapshot(b, NULL);
    CHECK(!same_snapshot(&sa, &sb));
    CHECK_OK(rf_checkpoint_save(path, a, NULL));
    check_file_holds(path, a, "reflux", 0);
    CHECK(count_arrays(a) == 5);
    CHECK_OK(rf_checkpoint_load(path, b, NULL));
    sb = take_snapshot(b, NULL);
    CHECK(same_snapshot(&sa, &sb)); /* bit-identical */
    /* Saving over an existing file replaces it; no temporary file is left behind. */
    CHECK_OK(rf_checkpoint_save(path, b, NULL));
    CHECK(count_temporaries() == 0);
    /* A name as long as the file system takes (255 bytes): the temporary
     * file's name does not grow with it. */
    char name[256];
    memset(name, 'c', 255);
    name[255] = '\0';
    const char *longp = tmp_path(name);
    CHECK_OK(rf_checkpoint_save(longp, a, NULL));
    CHECK_OK(rf_checkpoint_load(longp, b, NULL));
    CHECK(count_temporaries() == 0);
    unlink(longp);

    /* Saving through a symbolic link writes the file it leads to and leaves
     * the link; the file keeps its permissions. */
    char real[512], link[512];
    snprintf(real, sizeof real, "%s", tmp_path("real.safetensors"));
    snprintf(link, sizeof link, "%s", tmp_path("latest.safetensors"));
    CHECK_OK(rf_checkpoint_save(real, b, NULL));
    CHECK(chmod(real, 0600) == 0 && symlink(real, link) == 0);
    CHECK_OK(rf_checkpoint_save(link, a, NULL));
    struct stat ls, rs;
    CHECK(lstat(link, &ls) == 0 && S_ISLNK(ls.st_mode));
    CHECK(stat(real, &rs) == 0 && (rs.st_mode & 0777) == 0600);
    CHECK_OK(rf_checkpoint_load(real, b, NULL));
    sb = take_snapshot(b, NULL);
    CHECK(same_snapshot(&sa, &sb));
    CHECK(count_temporaries() == 0);
    /* a link to a file not made yet (relative): the save makes it */
    unlink(link);
    unlink(real);
    CHECK(symlink("real.safetensors", link) == 0);
    CHECK_OK(rf_checkpoint_save(link, a, NULL));
    CHECK(lstat(link, &ls) == 0 && S_ISLNK(ls.st_mode) && stat(real, &rs) == 0);
    CHECK_OK(rf_checkpoint_load(real, b, NULL));
    /* a path that is not a regular file is refused, not replaced */
    const char *fifo = tmp_path("fifo.safetensors");
    CHECK(mkfifo(fifo, 0600) == 0);
    CHECK_STATUS(rf_checkpoint_save(fifo, a, NULL), RF_E_IO);
    CHECK_MSG("fifo.safetensors: not a regular file");
    struct stat fs;
    CHECK(lstat(fifo, &fs) == 0 && S_ISFIFO(fs.st_mode));
    unlink(fifo);
    unlink(link);
    unlink(real);
    rf_model_free(a);
    rf_model_free(b);
}

/* Overwrites an array with values derived from a seed (any dtype). */
static void fill_distinct(const char *path, rf_array *a, bool trainable, void *ud)
{
    (void)path;
    (void)trainable;
    uint64_t seed = *(uint64_t *)ud;
    *(uint64_t *)ud = seed + 1;
    rf_array *r = rf_rand(RF_F64, rf_array_dims(a), rf_array_rank(a), seed);
    const double *rv = rf_array_data(r);
    size_t n = rf_array_nbytes(a);
    uint8_t *buf = malloc(n ? n : 1);
    for (int64_t i = 0; i < rf_array_numel(a); i++) {
        switch (rf_array_dtype(a)) {
        case RF_F32: ((float *)buf)[i] = (float)rv[i]; break;
        case RF_F64: ((double *)buf)[i] = rv[i]; break;
        case RF_I32: ((int32_t *)buf)[i] = (int32_t)(rv[i] * 1000); break;
        case RF_I64: ((int64_t *)buf)[i] = (int64_t)(rv[i] * 1000); break;
        default: buf[i] = (uint8_t)(rv[i] * 2); break;
        }
    }
    CHECK_OK(rf_array_write(a, buf, n));
    free(buf);
    rf_array_free(r);
}

/* Two models of make_model's structure on the CPU device, each with Adam. */
typedef struct adam_pair {
    rf_model *host_a, *host_b, *a, *b;
    rf_opt *oa, *ob;
} adam_pair;

static bool adam_pair_new(adam_pair *p, uint64_t seed_a, uint64_t seed_b)
{
    p->host_a = make_model(seed_a, 3);
    p->host_b = make_model(seed_b, 3);
    p->a = rf_model_to(p->host_a, rf_device_cpu());
    p->b = rf_model_to(p->host_b, rf_device_cpu());
    p->oa = p->a ? rf_setup(rf_adam(0.001), p->a) : NULL;
    p->ob = p->b ? rf_setup(rf_adam(0.001), p->b) : NULL;
    bool ok = p->a && p->b && p->oa && p->ob;
    CHECK(ok);
    if (!ok)
        fprintf(stderr, "optimiser setup failed: %s\n", rf_errmsg());
    return ok;
}

static void adam_pair_free(adam_pair *p)
{
    rf_opt_free(p->oa);
    rf_opt_free(p->ob);
    rf_model_free(p->a);
    rf_model_free(p->b);
    rf_model_free(p->host_a);
    rf_model_free(p->host_b);
}

static void test_checkpoint_optimiser(void)
{
    const char *path = tmp_path("opt.safetensors");
    adam_pair p;
    if (!adam_pair_new(&p, 3, 4))
        goto done;
    rf_model *a = p.a, *b = p.b;
    rf_opt *oa = p.oa, *ob = p.ob;
    /* Distinct values in every optimiser array of both. */
    uint64_t seed = 100;
    rf_opt_visit(oa, fill_distinct, &seed);
    rf_opt_visit(ob, fill_distinct, &seed);
    snapshot sa = take_snapshot(a, oa), sb = take_snapshot(b, ob);
    CHECK(sa.len > take_snapshot(a, NULL).len); /* the optimiser has arrays */
    CHECK(sa.len <= sizeof sa.bytes);
    CHECK(!same_snapshot(&sa, &sb));
    CHECK_OK(rf_checkpoint_save(path, a, oa));
    CHECK_OK(rf_checkpoint_load(path, b, ob));
    sb = take_snapshot(b, ob);
    CHECK(same_snapshot(&sa, &sb)); /* model and optimiser, bit-identical */
    /* A model-only load of a file with optimiser tensors is fine; loading an
     * optimiser from a model-only file reports what is missing. */
    CHECK_OK(rf_checkpoint_load(path, b, NULL));
    CHECK_OK(rf_checkpoint_save(path, a, NULL));
    CHECK_STATUS(rf_checkpoint_load(path, b, ob), RF_E_CORRUPT);
    CHECK_MSG("\"opt.");
    CHECK_MSG("is missing");
    /* another model's optimiser: refused both ways, b untouched */
    CHECK_STATUS(rf_checkpoint_save(path, a, ob), RF_E_INVALID);
    CHECK_MSG("rf_checkpoint_save: the optimiser (adam) was not set up for this model");
    CHECK_OK(rf_checkpoint_save(path, a, oa));
    sb = take_snapshot(b, ob);
    CHECK_STATUS(rf_checkpoint_load(path, b, oa), RF_E_INVALID);
    CHECK_MSG("rf_checkpoint_load: the optimiser (adam) was not set up for this model");
    snapshot after = take_snapshot(b, ob);
    CHECK(same_snapshot(&sb, &after));
done:
    adam_pair_free(&p);
}

/* Each bad file gives `expect`, a message containing `needle`, and leaves b as it was. */
static void expect_load_fails(const char *path, rf_model *b, rf_status expect, const char *needle)
{
    snapshot before = take_snapshot(b, NULL);
    CHECK_STATUS(rf_checkpoint_load(path, b, NULL), expect);
    CHECK_MSG(needle);
    snapshot after = take_snapshot(b, NULL);
    CHECK(same_snapshot(&before, &after));
}

static void test_checkpoint_errors(void)
{
    const char *good = tmp_path("good.safetensors"), *bad = tmp_path("bad.safetensors");
    rf_model *a = make_model(5, 3), *b = make_model(6, 3);
    CHECK_OK(rf_checkpoint_save(good, a, NULL));
    size_t size = 0;
    uint8_t *file = read_all(good, &size);
    CHECK(file != NULL);
    if (!file)
        return;

    const char *fifo = tmp_path("fifo.safetensors"); /* it waited for a writer */
    CHECK(mkfifo(fifo, 0600) == 0);
    expect_load_fails(fifo, b, RF_E_IO, "fifo.safetensors: not a regular file");
    unlink(fifo);

    write_bytes(bad, file, size - 3); /* truncated data */
    expect_load_fails(bad, b, RF_E_CORRUPT, "truncated");
    write_bytes(bad, file, 40); /* truncated header */
    expect_load_fails(bad, b, RF_E_CORRUPT, "header length");
    write_bytes(bad, file, 5);
    expect_load_fails(bad, b, RF_E_CORRUPT, "too short");

    uint8_t *copy = malloc(size);
    memcpy(copy, file, size);
    copy[8] = '['; /* corrupted header */
    write_bytes(bad, copy, size);
    expect_load_fails(bad, b, RF_E_CORRUPT, "corrupt header at byte 0");
    memcpy(copy, file, size);
    char *dt = strstr((char *)copy + 8, "\"dtype\"");
    dt[3] = 'x'; /* "dxype": an unknown key */
    write_bytes(bad, copy, size);
    expect_load_fails(bad, b, RF_E_CORRUPT, "unknown key");
    memcpy(copy, file, size);
    copy[7] = 0x40; /* an absurd header length */
    write_bytes(bad, copy, size);
    expect_load_fails(bad, b, RF_E_CORRUPT, "header length");
    free(copy);

    rf_model *wrong = make_model(7, 5); /* weight [5,4] instead of [3,4] */
    expect_load_fails(good, wrong, RF_E_SHAPE, "\"weight\": expected f32[5,4], found f32[3,4]");
    rf_model_free(wrong);

    rf_model *more = make_model(8, 3); /* a tensor the file lacks */
    rf_model_add_state(rf_model_child(more, 0), "extra", rf_zeros(RF_F32, RF_SHAPE(2)));
    expect_load_fails(good, more, RF_E_CORRUPT, "tensor \"0.extra\" is missing");
    CHECK_OK(rf_checkpoint_save(bad, more, NULL)); /* the file has one the model lacks */
    expect_load_fails(bad, b, RF_E_CORRUPT, "\"0.extra\", which the model lacks");
    rf_model_free(more);

    /* Hand-written headers: another writer's spacing and order load; overlaps,
     * bad dtypes, duplicates and malformed JSON do not. */
    rf_model *small = rf_model_new(&test_layer, NULL, 0);
    rf_model_add_param(small, "w", rf_zeros(RF_F32, RF_SHAPE(2)));
    rf_model_add_param(small, "v", rf_zeros(RF_F32, RF_SHAPE(1)));
    const float vals[3] = {1.5f, -2.0f, 4.25f};
    write_st(bad, "{ \"v\" : {\"shape\": [1], \"data_offsets\": [8, 12], \"dtype\": \"F32\"},\n"
                  "  \"__metadata__\": {\"format\": \"pt\", \"x\\u00e9\\\"\": \"\"},\n"
                  "  \"w\": {\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}   ",
             vals, sizeof vals);
    CHECK_OK(rf_checkpoint_load(bad, small, NULL));
    float w[2], v[1];
    rf_array_read(rf_model_param_array(small, 0), w, sizeof w);
    rf_array_read(rf_model_param_array(small, 1), v, sizeof v);
    CHECK(w[0] == 1.5f && w[1] == -2.0f && v[0] == 4.25f);
    /* PyTorch's BatchNorm counter (an i64 reflux has no use for) is passed over */
    const uint8_t with_counter[20] = {0, 0, 0x80, 0x3f, 0, 0, 0, 0x40, 0, 0, 0x80, 0x40, 7};
    write_st(bad, "{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                  "\"v\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]},"
                  "\"1.num_batches_tracked\":{\"dtype\":\"I64\",\"shape\":[],"
                  "\"data_offsets\":[12,20]}}",
             with_counter, sizeof with_counter);
    CHECK_OK(rf_checkpoint_load(bad, small, NULL));
    rf_array_read(rf_model_param_array(small, 0), w, sizeof w);
    CHECK(w[0] == 1.0f && w[1] == 2.0f);
    /* A PyTorch file has no Dropout RNG key: the layer keeps its own */
    rf_model *dropping = rf_chain(rf_dense(1, 2, RF_ACT_IDENTITY), rf_dropout(0.5, 3));
    rf_array *key = dropping ? rf_model_state_array(rf_model_child(dropping, 1), 0) : NULL;
    unsigned char key_before[64] = {0}, key_after[64] = {0};
    CHECK(key && rf_array_nbytes(key) <= sizeof key_before);
    if (key) {
        rf_array_read(key, key_before, rf_array_nbytes(key));
        const float dense[4] = {0.5f, -1.0f, 2.0f, 3.0f};
        write_st(bad, "{\"0.weight\":{\"dtype\":\"F32\",\"shape\":[2,1],\"data_offsets\":[0,8]},"
                      "\"0.bias\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}",
                 dense, sizeof dense);
        CHECK_OK(rf_checkpoint_load(bad, dropping, NULL));
        float got[2];
        rf_array_read(rf_model_param_array(rf_model_child(dropping, 0), 1), got, sizeof got);
        CHECK(got[0] == 2.0f && got[1] == 3.0f);
        rf_array_read(key, key_after, rf_array_nbytes(key));
        CHECK(memcmp(key_before, key_after, sizeof key_before) == 0);
    }
    rf_model_free(dropping);
    static const struct {
        const char *header;
        rf_status st;
        const char *needle;
    } cases[] = {
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"v\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
         RF_E_CORRUPT, "overlap"},
        {"{\"w\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[0,4]},"
         "\"v\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
         RF_E_DTYPE, "F16"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
         RF_E_CORRUPT, "twice"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"v\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,16]}}",
         RF_E_CORRUPT, "outside"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]},"
         "\"v\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
         RF_E_CORRUPT, "span 4 bytes"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"v\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[8,12]}}",
         RF_E_CORRUPT, "non-negative integer"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"v\":{\"dtype\":\"F32\",\"shape\":[1.0],\"data_offsets\":[8,12]}}",
         RF_E_CORRUPT, "fraction"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"v\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}} x",
         RF_E_CORRUPT, "text after"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"v\xff\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
         RF_E_CORRUPT, "invalid UTF-8"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"v\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}",
         RF_E_CORRUPT, "expected '}'"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"v\":{\"dtype\":\"F32\",\"shape\":[1]}}",
         RF_E_CORRUPT, "lacks"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"v\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12,16]}}",
         RF_E_CORRUPT, "exactly two"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"v\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]},\"\\ud800\":{}}",
         RF_E_CORRUPT, "surrogate"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"v\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]},\"unterminated",
         RF_E_CORRUPT, "unterminated"},
        {"", RF_E_CORRUPT, "expected '{'"},
        {"{}", RF_E_CORRUPT, "\"w\" is missing"}, /* no entries (found by fuzz/) */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        write_st(bad, cases[i].header, vals, sizeof vals);
        snapshot before = take_snapshot(small, NULL);
        CHECK_STATUS(rf_checkpoint_load(bad, small, NULL), cases[i].st);
        CHECK_MSG(cases[i].needle);
        snapshot after = take_snapshot(small, NULL);
        CHECK(same_snapshot(&before, &after));
    }
    rf_model_free(small);

    CHECK_STATUS(rf_checkpoint_load(tmp_path("none.safetensors"), b, NULL), RF_E_IO);
    CHECK_STATUS(rf_checkpoint_save(tmp_path("no/such/dir.safetensors"), a, NULL), RF_E_IO);
    CHECK_STATUS(rf_checkpoint_save(NULL, a, NULL), RF_E_INVALID);
    CHECK_STATUS(rf_checkpoint_load(good, NULL, NULL), RF_E_INVALID);
    free(file);
    rf_model_free(a);
    rf_model_free(b);
}

/* ---- Byte mutations -------------------------------------------------------------------------- */
/* Every byte of a valid file replaced in turn by a few values that break
 * JSON, numbers, lengths and magic words: each load must return a status
 * (under the sanitizers: without touching memory it should not), and a
 * failed load must leave the model and optimiser exactly as they were. */
/* ---- Loading part of a checkpoint ---------------------------------------------------------- */

static rf_model *trunk_of(uint64_t seed)
{
    return rf_chain(rf_dense_ex(4, 8, RF_ACT_RELU, &(rf_dense_opts){.seed = seed}),
                    rf_dense_ex(8, 8, RF_ACT_RELU, &(rf_dense_opts){.seed = seed + 1}));
}

static bool same_array(rf_array *a, rf_array *b)
{
    size_t n = rf_array_nbytes(a);
    if (n != rf_array_nbytes(b) || n > 4096)
        return false;
    unsigned char x[4096], y[4096];
    rf_array_read(a, x, n);
    rf_array_read(b, y, n);
    return memcmp(x, y, n) == 0;
}

/* rf_checkpoint_load_opts: a whole model's file loads into its trunk alone (prefix), into a
 * model with one more layer (partial: that layer keeps its weights), and a partial load
 * that matches nothing, or names of other shapes, is refused with nothing changed. */
static void test_checkpoint_partial(void)
{
    const char *path = tmp_path("whole.safetensors");
    rf_model *whole = rf_chain(trunk_of(1), rf_dense_ex(8, 3, RF_ACT_IDENTITY,
                                                         &(rf_dense_opts){.seed = 3}));
    rf_model *trunk = trunk_of(10);
    rf_model *longer = rf_chain(trunk_of(20), rf_dense_ex(8, 3, RF_ACT_IDENTITY,
                                                          &(rf_dense_opts){.seed = 22}),
                                rf_dense_ex(3, 2, RF_ACT_IDENTITY, &(rf_dense_opts){.seed = 23}));
    rf_model *wider = rf_chain(trunk_of(30), rf_dense_ex(8, 5, RF_ACT_IDENTITY,
                                                         &(rf_dense_opts){.seed = 32}));
    CHECK(whole && trunk && longer && wider);
    if (!whole || !trunk || !longer || !wider)
        goto done;
    CHECK_OK(rf_checkpoint_save(path, whole, NULL));

    int loaded = -1;
    CHECK_OK(rf_checkpoint_load_opts(path, trunk, NULL,
                                     &(rf_load_opts){.prefix = "0.", .loaded = &loaded}));
    CHECK(loaded == 4);
    for (int c = 0; c < 2; c++)
        for (int i = 0; i < 2; i++)
            CHECK(same_array(rf_model_param_array(rf_model_child(trunk, c), i),
                             rf_model_param_array(rf_model_child(rf_model_child(whole, 0), c),
                                                  i)));
    /* without the prefix the names are the whole model's */
    CHECK_STATUS(rf_checkpoint_load(path, trunk, NULL), RF_E_CORRUPT);
    CHECK_MSG("tensor \"0.weight\" is missing");
    /* a message names the file's tensor, prefix and all */
    rf_model *deeper = rf_chain(rf_dense(4, 8, RF_ACT_RELU), rf_dense(8, 8, RF_ACT_RELU),
                                rf_dense(8, 8, RF_ACT_RELU));
    CHECK_STATUS(rf_checkpoint_load_opts(path, deeper, NULL, &(rf_load_opts){.prefix = "0."}),
                 RF_E_CORRUPT);
    CHECK_MSG("tensor \"0.2.weight\" is missing");
    rf_model_free(deeper);

    rf_array *extra_w = rf_model_param_array(rf_model_child(longer, 2), 0);
    rf_array *before = rf_array_to(extra_w, rf_device_host());
    CHECK_OK(rf_checkpoint_load_opts(path, longer, NULL,
                                     &(rf_load_opts){.partial = true, .loaded = &loaded}));
    CHECK(loaded == 6);
    CHECK(same_array(rf_model_param_array(rf_model_child(longer, 1), 0),
                     rf_model_param_array(rf_model_child(whole, 1), 0)));
    CHECK(same_array(extra_w, before)); /* the file has no "2.weight": kept */
    rf_array_free(before);
    CHECK_STATUS(rf_checkpoint_load(path, longer, NULL), RF_E_CORRUPT); /* strict */

    /* matching names of other shapes are still an error, and change nothing */
    rf_array *trunk_w = rf_array_to(rf_model_param_array(rf_model_child(rf_model_child(wider,
                                                                                        0), 0),
                                                         0), rf_device_host());
    CHECK_STATUS(rf_checkpoint_load_opts(path, wider, NULL, &(rf_load_opts){.partial = true}),
                 RF_E_SHAPE);
    CHECK_MSG("\"1.weight\": expected f32[5,8], found f32[3,8]");
    CHECK(same_array(rf_model_param_array(rf_model_child(rf_model_child(wider, 0), 0), 0),
                     trunk_w));
    rf_array_free(trunk_w);
    /* the new head's model takes the trunk by prefix */
    CHECK_OK(rf_checkpoint_load_opts(path, rf_model_child(wider, 0), NULL,
                                     &(rf_load_opts){.prefix = "0."}));

    CHECK_STATUS(rf_checkpoint_load_opts(path, trunk, NULL,
                                         &(rf_load_opts){.prefix = "7.", .partial = true,
                                                         .loaded = &loaded}),
                 RF_E_INVALID);
    CHECK_MSG("none of the file's tensors under \"7.\" is one of the model's");
    CHECK(loaded == 0);
    /* an optimiser's tensors (whose learning rate and step count would fit any model) do not
     * make such a load count: nothing changes */
    const char *with_opt = tmp_path("with_opt.safetensors");
    rf_model *dev_whole = rf_model_to(whole, rf_device_cpu());
    rf_model *dev_trunk = rf_model_to(trunk, rf_device_cpu());
    rf_opt *wopt = dev_whole ? rf_setup(rf_descent(0.5), dev_whole) : NULL;
    rf_opt *topt = dev_trunk ? rf_setup(rf_descent(0.01), dev_trunk) : NULL;
    CHECK(wopt && topt);
    if (wopt && topt) {
        CHECK_OK(rf_checkpoint_save(with_opt, dev_whole, wopt));
        CHECK_STATUS(rf_checkpoint_load_opts(with_opt, dev_trunk, topt,
                                             &(rf_load_opts){.prefix = "typo.", .partial = true}),
                     RF_E_INVALID);
        CHECK_NEAR(rf_opt_lr(topt), 0.01, 1e-9, 1e-6);
    }
    rf_opt_free(wopt);
    rf_opt_free(topt);
    rf_model_free(dev_whole);
    rf_model_free(dev_trunk);
done:
    rf_model_free(whole);
    rf_model_free(trunk);
    rf_model_free(longer);
    rf_model_free(wider);
}

/* ---- Checkpoints PyTorch wrote (tests/ref/gen_checkpoint.py) ---------------------------- */

/* PyTorch's nn.Sequential of the fixture, layer for layer (so the names match):
 * Conv2d, BatchNorm2d, ReLU, ConvTranspose2d, GroupNorm, a grouped Conv2d
 * without bias, MaxPool2d, Flatten, Linear, LayerNorm, Sequential(Linear,
 * Tanh, Linear). */
static rf_model *torch_cnn(void)
{
    return rf_chain(rf_conv2d(3, 3, 2, 4, RF_ACT_IDENTITY, &(rf_conv_opts){.pad = {1, 1}}),
                    rf_batchnorm(4, RF_ACT_IDENTITY), rf_activation_layer(RF_ACT_RELU),
                    rf_conv_transpose2d(2, 2, 4, 6, RF_ACT_IDENTITY,
                                        &(rf_conv_opts){.stride = {2, 2}}),
                    rf_groupnorm(6, 3),
                    rf_conv2d(3, 3, 6, 6, RF_ACT_IDENTITY,
                              &(rf_conv_opts){.pad = {1, 1}, .groups = 2, .no_bias = true}),
                    rf_maxpool(2, 2, 0, 0), rf_flatten_layer(),
                    rf_dense(6 * 5 * 5, 8, RF_ACT_IDENTITY), rf_layernorm(8),
                    rf_chain(rf_dense(8, 8, RF_ACT_IDENTITY), rf_activation_layer(RF_ACT_TANH),
                             rf_dense(8, 3, RF_ACT_IDENTITY)));
}

/* Loads tests/ref/<file> into `m` and checks the eval-mode output on the
 * fixture's input against PyTorch's; `m` holds the weights afterwards. */
static void check_torch_model(const fx_file *fx, const char *file, rf_model *m,
                              const char *input, const char *output, bool ids)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/ref/%s", RF_SOURCE_DIR, file);
    CHECK_OK(rf_checkpoint_load(path, m, NULL));
    /* every array of the model came from the file, bit for bit; the file's one
     * more tensor (if any) is BatchNorm's num_batches_tracked */
    check_file_holds(path, m, NULL, strcmp(file, "torch_cnn.safetensors") ? 0 : 1);

    const fx_entry *in = fx_get(fx, input), *want = fx_get(fx, output);
    CHECK(in && want);
    if (!in || !want)
        return;
    rf_array *x;
    if (ids) {
        int32_t v[64];
        for (int64_t i = 0; i < in->n && i < 64; i++)
            v[i] = (int32_t)in->v[i];
        x = rf_array_from(RF_I32, in->dims, in->rank, v);
    } else {
        float *v = fx_f32(in);
        x = rf_array_from(RF_F32, in->dims, in->rank, v);
        free(v);
    }
    rf_device *cpu = rf_device_cpu();
    rf_model *dm = rf_model_to(m, cpu); /* loaded on the host, run on the CPU device */
    rf_testmode(dm);
    rf_array *dx = rf_array_to(x, cpu);
    rf_array *y = NULL;
    CHECK_OK(rf_jit_model(dm, dx, &y));
    CHECK(y && rf_array_rank(y) == want->rank && rf_array_numel(y) == want->n);
    if (y && rf_array_numel(y) == want->n) {
        float *got = malloc((size_t)want->n * sizeof *got);
        rf_array_read(y, got, (size_t)want->n * sizeof *got);
        for (int64_t i = 0; i < want->n; i++)
            CHECK_NEAR(got[i], want->v[i], 2e-5, 2e-5);
        free(got);
    }
    rf_array_free(y);
    rf_array_free(dx);
    rf_array_free(x);

    /* saved again from the device, the file holds the same names, shapes and bytes */
    const char *again = tmp_path("again.safetensors");
    CHECK_OK(rf_checkpoint_save(again, dm, NULL));
    check_file_holds(again, m, "reflux", 0);
    rf_model_free(dm);
    const char *out = getenv("RF_WRITE_TORCH_CNN"); /* for gen_checkpoint.py --check */
    if (out && !ids)
        CHECK_OK(rf_checkpoint_save(out, m, NULL));
}

static void test_checkpoint_from_pytorch(void)
{
    fx_file fx;
    CHECK(fx_load(&fx, "checkpoint.txt") == 0);
    if (fx.n == 0)
        return;
    rf_model *cnn = torch_cnn();
    CHECK(cnn != NULL);
    if (cnn)
        check_torch_model(&fx, "torch_cnn.safetensors", cnn, "cnn.x", "cnn.y", false);
    rf_model_free(cnn);
    rf_model *seq = rf_chain(rf_embedding(10, 4, 1), rf_layernorm(4));
    CHECK(seq != NULL);
    if (seq)
        check_torch_model(&fx, "torch_seq.safetensors", seq, "seq.ids", "seq.y", true);
    rf_model_free(seq);
    fx_free(&fx);
}

static const uint8_t mutations[] = {0x00, 0xff, '"', '9'};

static void test_checkpoint_mutations(void)
{
    const char *good = tmp_path("good.safetensors"), *bad = tmp_path("bad.safetensors");
    size_t size = 0;
    uint8_t *file = NULL, *copy = NULL;
    adam_pair p;
    if (!adam_pair_new(&p, 9, 10))
        goto done;
    rf_model *b = p.b;
    rf_opt *ob = p.ob;
    CHECK_OK(rf_checkpoint_save(good, p.a, p.oa));
    file = read_all(good, &size);
    copy = file ? malloc(size) : NULL;
    CHECK(copy != NULL);
    if (!copy)
        goto done;
    int loaded = 0, refused = 0, changed = 0;
    for (size_t at = 0; at < size; at++) {
        for (size_t k = 0; k < sizeof mutations; k++) {
            if (file[at] == mutations[k])
                continue;
            memcpy(copy, file, size);
            copy[at] = mutations[k];
            write_bytes(bad, copy, size);
            snapshot before = take_snapshot(b, ob);
            if (rf_checkpoint_load(bad, b, ob) == RF_OK) {
                loaded++;
                continue;
            }
            refused++;
            snapshot after = take_snapshot(b, ob);
            changed += !same_snapshot(&before, &after);
        }
    }
    for (size_t len = 0; len < size; len++) { /* every truncation */
        write_bytes(bad, file, len);
        snapshot before = take_snapshot(b, ob);
        CHECK(rf_checkpoint_load(bad, b, ob) != RF_OK);
        snapshot after = take_snapshot(b, ob);
        changed += !same_snapshot(&before, &after);
    }
    CHECK(changed == 0);
    CHECK(refused > 0 && loaded > 0); /* header bytes refuse, most data bytes load */
done:
    free(copy);
    free(file);
    adam_pair_free(&p);
}

static void test_idx_mutations(void)
{
    uint8_t file[128], copy[128], data[24];
    for (size_t i = 0; i < sizeof data; i++)
        data[i] = (uint8_t)(i * 7 + 1);
    const uint32_t dims[2] = {2, 3};
    const char *raw = tmp_path("bad.idx"), *gzp = tmp_path("bad.idx.gz");
    for (int type = 0; type < 2; type++) { /* u8 [2,3] (6 bytes), f32 [2,3] (24) */
        size_t n = idx_bytes(file, type ? 0x0D : 0x08, 2, dims, data, type ? 24 : 6);
        for (int gz = 0; gz < 2; gz++) {
            const char *p = gz ? gzp : raw;
            for (size_t at = 0; at < n; at++)
                for (size_t k = 0; k < sizeof mutations; k++) {
                    memcpy(copy, file, n);
                    copy[at] = mutations[k];
                    write_file(p, copy, n, gz);
                    rf_array *out = (rf_array *)1;
                    if (rf_idx_load(p, &out) == RF_OK)
                        rf_array_free(out);
                    else
                        CHECK(out == NULL);
                }
            for (size_t len = 0; len < n; len++) {
                write_file(p, file, len, gz);
                rf_array *out = (rf_array *)1;
                CHECK_STATUS(rf_idx_load(p, &out), RF_E_CORRUPT);
                CHECK(out == NULL);
            }
        }
    }
    /* The gzip stream itself corrupted: zlib's errors become statuses. */
    size_t n = idx_bytes(file, 0x08, 2, dims, data, 6);
    write_file(gzp, file, n, true);
    size_t gsize = 0;
    uint8_t *g = read_all(gzp, &gsize);
    CHECK(g != NULL && gsize <= sizeof copy);
    for (size_t at = 0; g && gsize <= sizeof copy && at < gsize; at++)
        for (size_t k = 0; k < sizeof mutations; k++) {
            memcpy(copy, g, gsize);
            copy[at] = mutations[k];
            write_bytes(gzp, copy, gsize);
            rf_array *out = (rf_array *)1;
            if (rf_idx_load(gzp, &out) == RF_OK)
                rf_array_free(out);
            else
                CHECK(out == NULL);
        }
    free(g);
}

/* ---- Main ------------------------------------------------------------------------------------ */

/* Every file a test left in the directory goes, whatever its name, so a new test's file
 * cannot be forgotten here. */
static void remove_tmpdir(void)
{
    DIR *dir = opendir(tmpdir);
    if (dir) {
        struct dirent *e;
        while ((e = readdir(dir)) != NULL)
            if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
                unlink(tmp_path(e->d_name));
        closedir(dir);
    }
    if (rmdir(tmpdir) != 0)
        fprintf(stderr, "test_data: %s left behind\n", tmpdir);
}

int main(void)
{
    snprintf(tmpdir, sizeof tmpdir, "/tmp/rf_test_data_XXXXXX");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    test_loader_batching();
    test_loader_shuffle();
    test_loader_device();
    test_loader_seek(NULL);
    test_loader_seek(rf_device_cpu());
    test_loader_fork();
    test_loader_errors();
    test_idx_types(false);
    test_idx_types(true);
    test_idx_errors();
    test_fashion_mnist();
    test_checkpoint_roundtrip();
    test_checkpoint_optimiser();
    test_checkpoint_errors();
    test_checkpoint_mutations();
    test_checkpoint_from_pytorch();
    test_checkpoint_partial();
    test_idx_mutations();
    test_idx_claim_beyond_the_data();
    remove_tmpdir();
    return tu_finish("test_data");
}
