/* fuzz_checkpoint.c: libFuzzer target for rf_checkpoint_load into a small
 * model on the CPU device (two Dense layers and a Dropout) and its Adam state. The input is written to a
 * file and loaded; every input must load or be refused with an error status,
 * never crash, and leak nothing; a refused load leaves the model's first
 * weight as it was (checked). */
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

/* The first layer's weight, f32[4,3], copied into w. */
static void first_weight(float w[12])
{
    rf_array *a = rf_model_param_array(rf_model_child(model, 0), 0); /* "0.weight" */
    if (!a || rf_array_read(a, w, 12 * sizeof *w) != RF_OK) {
        fprintf(stderr, "fuzz_checkpoint: %s\n", rf_errmsg());
        abort();
    }
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
    float before[12], after[12];
    first_weight(before);
    bool loaded = rf_checkpoint_load(path, model, opt) == RF_OK;
    first_weight(after);
    if (!loaded && memcmp(before, after, sizeof before) != 0)
        abort(); /* a refused load changed the model */
    unlink(path);
    return 0;
}
