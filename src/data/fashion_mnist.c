/* fashion_mnist.c: rf_fashion_mnist, the Fashion-MNIST dataset from its four
 * IDX files (gzip-compressed as distributed, or already uncompressed).
 *
 * Images come back as [N, 1, 28, 28] f32 in [0, 1] (pixel / 255, NCHW with
 * one channel), labels as [N] i32 in 0..9. The files are checked: u8 images
 * of 28x28, u8 labels, the same N in both, labels below 10.
 *
 * Deliberately not here: downloading, normalising by the dataset's mean and
 * standard deviation, other MNIST-style datasets.
 */
#include "../runtime/runtime.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define FMNIST_DEFAULT_DIR "/usr/share/datasets/fashion-mnist"
#define FMNIST_SIDE 28
#define FMNIST_CLASSES 10

/* dir/base.gz when it exists, else dir/base (an uncompressed copy). */
static rf_status load_file(const char *dir, const char *base, rf_array **out)
{
    char path[4096];
    int n = snprintf(path, sizeof path, "%s/%s.gz", dir, base);
    if (n < 0 || (size_t)n >= sizeof path)
        return rfi_error(RF_E_INVALID, "rf_fashion_mnist: directory name too long: %s", dir);
    if (access(path, F_OK) != 0)
        path[n - 3] = '\0'; /* drop ".gz" */
    return rf_idx_load(path, out);
}

static rf_status check_images(const rf_array *img, const char *dir)
{
    if (img->dtype == RF_U8 && img->rank == 3 && img->dims[1] == FMNIST_SIDE &&
        img->dims[2] == FMNIST_SIDE)
        return RF_OK;
    char ty[128];
    return rfi_error(RF_E_CORRUPT, "rf_fashion_mnist: %s: images are %s, expected u8[N,28,28]",
                     dir, rfi_type_str(ty, sizeof ty, img->dtype, img->dims, img->rank));
}

static rf_status check_labels(const rf_array *lab, const rf_array *img, const char *dir)
{
    char ty[128];
    if (lab->dtype != RF_U8 || lab->rank != 1)
        return rfi_error(RF_E_CORRUPT, "rf_fashion_mnist: %s: labels are %s, expected u8[N]",
                         dir, rfi_type_str(ty, sizeof ty, lab->dtype, lab->dims, lab->rank));
    if (lab->dims[0] != img->dims[0])
        return rfi_error(RF_E_CORRUPT, "rf_fashion_mnist: %s: %lld images but %lld labels", dir,
                         (long long)img->dims[0], (long long)lab->dims[0]);
    const uint8_t *v = lab->data;
    for (int64_t i = 0; i < lab->numel; i++)
        if (v[i] >= FMNIST_CLASSES)
            return rfi_error(RF_E_CORRUPT, "rf_fashion_mnist: %s: label %lld is %d, expected "
                             "0..9", dir, (long long)i, v[i]);
    return RF_OK;
}

/* The owned f32 [N,1,28,28] and i32 [N] arrays from the raw u8 ones. */
static rf_status convert(const rf_array *img, const rf_array *lab, rf_array **images,
                         rf_array **labels)
{
    int64_t n = img->dims[0];
    rf_array *x = rfi_array_alloc("rf_fashion_mnist", rf_device_host(), RF_F32,
                                  (const int64_t[]){n, 1, FMNIST_SIDE, FMNIST_SIDE}, 4);
    rf_array *y = rfi_array_alloc("rf_fashion_mnist", rf_device_host(), RF_I32,
                                  (const int64_t[]){n}, 1);
    if (!x || !y) {
        rfi_array_release(x);
        rfi_array_release(y);
        return rfi_error(RF_E_NOMEM, "rf_fashion_mnist: out of memory for %lld images",
                         (long long)n);
    }
    const uint8_t *px = img->data;
    float *fx = x->data;
    for (int64_t i = 0; i < img->numel; i++)
        fx[i] = (float)px[i] / 255.0f;
    const uint8_t *pl = lab->data;
    int32_t *il = y->data;
    for (int64_t i = 0; i < n; i++)
        il[i] = pl[i];
    *images = x;
    *labels = y;
    return RF_OK;
}

rf_status rf_fashion_mnist(const char *dir, bool train, rf_array **images, rf_array **labels)
{
    if (images)
        *images = NULL;
    if (labels)
        *labels = NULL;
    if (!images || !labels)
        return rfi_error(RF_E_INVALID, "rf_fashion_mnist: %s is NULL",
                         images ? "labels" : "images");
    if (!dir)
        dir = FMNIST_DEFAULT_DIR;
    const char *split = train ? "train" : "t10k";
    char img_base[64], lab_base[64];
    snprintf(img_base, sizeof img_base, "%s-images-idx3-ubyte", split);
    snprintf(lab_base, sizeof lab_base, "%s-labels-idx1-ubyte", split);

    rf_array *img = NULL, *lab = NULL;
    rf_status st = load_file(dir, img_base, &img);
    if (st == RF_OK)
        st = load_file(dir, lab_base, &lab);
    if (st == RF_OK)
        st = check_images(img, dir);
    if (st == RF_OK)
        st = check_labels(lab, img, dir);
    if (st == RF_OK)
        st = convert(img, lab, images, labels);
    rfi_array_release(img);
    rfi_array_release(lab);
    return st;
}
