/* device.c: the static device objects (host, cpu, cuda), the default-device
 * choice and the RF_DEVICE override.
 *
 * CUDA is only probed here: libcuda.so.1 is loaded with dlopen and cuInit is
 * called through dlsym, so the library builds and runs with no CUDA
 * installed. This file deliberately has no CUDA memory or kernel support:
 * until the CUDA backend exists, rf_device_cuda() reports that no CUDA device
 * is usable, and the default device is the CPU.
 */
#include "runtime.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static rf_device host_device = {RF_DEVICE_HOST, 0, "host"};
static rf_device cpu_device = {RF_DEVICE_CPU, 0, "cpu"};

rf_device *rf_device_host(void) { return &host_device; }
rf_device *rf_device_cpu(void) { return &cpu_device; }

/* ---- CUDA probe --------------------------------------------------------------
 * Documented cache: the result of loading libcuda and calling cuInit, computed
 * once per process (pthread_once) because dlopen and cuInit are slow and
 * their answer does not change. The library handle stays open for the life
 * of the process (cuInit state lives in it). */
typedef int (*cu_init_fn)(unsigned flags);

static pthread_once_t cuda_probe_once = PTHREAD_ONCE_INIT;
static char cuda_probe_error[256]; /* "" when libcuda loaded and cuInit succeeded */

static void probe_cuda(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(cuda_probe_error, sizeof cuda_probe_error,
                 "CUDA is not available (libcuda.so.1 could not be loaded)");
        return;
    }
    cu_init_fn cu_init;
    /* dlsym returns void *; copy it into the function pointer without a
     * pedantic object-to-function cast. */
    void *sym = dlsym(lib, "cuInit");
    memcpy(&cu_init, &sym, sizeof cu_init);
    if (!sym) {
        snprintf(cuda_probe_error, sizeof cuda_probe_error,
                 "CUDA is not available (libcuda.so.1 has no cuInit)");
        return;
    }
    /* Under AddressSanitizer cuInit fails with 2 (out of memory) unless
     * ASAN_OPTIONS=protect_shadow_gap=0: the driver needs the shadow gap. */
    int rc = cu_init(0);
    if (rc != 0) {
        snprintf(cuda_probe_error, sizeof cuda_probe_error,
                 "CUDA is not available (cuInit failed with error %d)", rc);
        return;
    }
    /* The driver works, but this version has no CUDA backend to use it. */
    snprintf(cuda_probe_error, sizeof cuda_probe_error,
             "a CUDA driver was found, but this build of reflux has no CUDA backend yet");
}

/* Why CUDA device `index` is unusable ("" never happens yet: see the file comment). */
static const char *cuda_unusable_reason(int index)
{
    (void)index;
    pthread_once(&cuda_probe_once, probe_cuda);
    return cuda_probe_error;
}

rf_device *rf_device_cuda(int index)
{
    if (index < 0) {
        rfi_error(RF_E_DEVICE, "rf_device_cuda: device index %d is negative", index);
        return NULL;
    }
    rfi_error(RF_E_DEVICE, "rf_device_cuda: %s", cuda_unusable_reason(index));
    return NULL;
}

/* ---- Default device ------------------------------------------------------------ */

/* Documented global: set once the first time an unusable RF_DEVICE is met, so
 * the fallback warning is printed once per process, not on every call. */
static atomic_bool warned_fallback;

static void warn_fallback(const char *value, const char *why)
{
    if (atomic_exchange(&warned_fallback, true))
        return;
    fprintf(stderr, "reflux: warning: RF_DEVICE=%s: %s; using the CPU\n", value, why);
}

/* Parses "cuda" or "cuda:N" into N; false if `s` is neither. */
static bool parse_cuda_index(const char *s, int *index)
{
    if (strcmp(s, "cuda") == 0) {
        *index = 0;
        return true;
    }
    if (strncmp(s, "cuda:", 5) != 0 || s[5] < '0' || s[5] > '9')
        return false;
    char *end;
    long v = strtol(s + 5, &end, 10);
    if (*end != '\0' || v > 1024)
        return false;
    *index = (int)v;
    return true;
}

/* RF_DEVICE is read on every call (no caching), so a program may change it
 * with setenv between calls. */
rf_device *rf_device_default(void)
{
    const char *env = getenv("RF_DEVICE");
    if (!env || !*env) {
        /* No preference: CUDA when usable, silently the CPU otherwise. */
        return cuda_unusable_reason(0)[0] ? &cpu_device : rf_device_cuda(0);
    }
    if (strcmp(env, "cpu") == 0)
        return &cpu_device;
    int index;
    if (!parse_cuda_index(env, &index)) {
        warn_fallback(env, "not one of cpu, cuda, cuda:N");
        return &cpu_device;
    }
    const char *why = cuda_unusable_reason(index);
    if (why[0]) {
        warn_fallback(env, why);
        return &cpu_device;
    }
    return rf_device_cuda(index);
}

rf_device_kind rf_device_kind_of(const rf_device *dev)
{
    return dev ? dev->kind : RF_DEVICE_KIND_COUNT;
}

const char *rf_device_name(const rf_device *dev) { return dev ? dev->name : "(no device)"; }

bool rfi_device_is_compute(const rf_device *dev)
{
    return dev && (dev->kind == RF_DEVICE_CPU || dev->kind == RF_DEVICE_CUDA);
}
