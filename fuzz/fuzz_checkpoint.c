/* fuzz_checkpoint.c: libFuzzer target for rf_checkpoint_load into a small
 * model on the CPU device (two Dense layers and a Dropout) and its Adam
 * state. The input is written to a file and loaded, whole and then partially
 * (rf_load_opts.partial); every input must load or be refused with an error
 * status, never crash, and leak nothing; a refused load leaves every array
 * of the model and the optimiser bit-identical (checked). */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fuzz_file.h"
#include "reflux.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static rf_model *model;
static rf_opt *opt;

/* The bytes of every array of the model and the optimiser, in visit order. */
typedef struct snapshot {
    unsigned char bytes[4096];
    size_t len;
} snapshot;

static void snap_one(const char *path, rf_array *a, bool trainable, void *ud)
{
    (void)trainable;
    snapshot *s = ud;
    size_t n = rf_array_nbytes(a);
    if (s->len + n > sizeof s->bytes || rf_array_read(a, s->bytes + s->len, n) != RF_OK) {
        fprintf(stderr, "fuzz_checkpoint: cannot read %s: %s\n", path, rf_errmsg());
        abort();
    }
    s->len += n;
}

static void take(snapshot *s)
{
    s->len = 0;
    rf_model_visit(model, snap_one, s);
    rf_opt_visit(opt, snap_one, s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!model) {
        /* the Dropout's RNG key ("2.key") may be missing from a file (PyTorch's) */
        rf_model *host = rf_chain(rf_dense(3, 4, RF_ACT_TANH), rf_dense(4, 2, RF_ACT_IDENTITY),
                                  rf_dropout(0.5, 1));
        model = host ? rf_model_to(host, rf_device_cpu()) : NULL;
        rf_model_free(host);
        opt = model ? rf_setup(rf_adam(1e-3), model) : NULL;
        if (!model || !opt) {
            fprintf(stderr, "fuzz_checkpoint: %s\n", rf_errmsg());
            abort();
        }
    }
    const char *path = fuzz_input_file("checkpoint", data, size);
    /* a whole load, then a partial one (the names both have: other rules) */
    for (int partial = 0; partial < 2; partial++) {
        static snapshot before, after;
        take(&before);
        rf_load_opts o = {.partial = partial != 0};
        bool loaded = rf_checkpoint_load_opts(path, model, opt, &o) == RF_OK;
        take(&after);
        if (!loaded && (before.len != after.len || memcmp(before.bytes, after.bytes, before.len)))
            abort(); /* a refused load changed the model or the optimiser */
    }
    unlink(path);
    return 0;
}
