/* test_profile.c: RF_PROFILE on the compiling CPU backend: a program compiled
 * with it set times its steps, and freeing the executable prints the profile
 * (per-run time, the steps by cost with what they compute, the share of each
 * kind). Without it nothing is printed. Runs on the compiling backend only.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/cpu/dnnl_loader.h"
#include "test_util.h"

static void program(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_tensor *gram = rf_matmul(x, rf_transpose(x, (const int64_t[]){1, 0}));
    rf_return(t, rf_sum_all(rf_tanh(gram)));
    rf_return(t, rf_mean_all(rf_exp(gram)));
}

/* tanh(x x^T + b) with b a vector along the result's columns: a bias and tanh
 * after a matmul, its epilogue where the backend gives matmuls one. */
static void dense_tanh_program(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_tensor *gram = rf_matmul(x, rf_transpose(x, (const int64_t[]){1, 0}));
    rf_tensor *b = rf_sum(x, (const int64_t[]){1}, 1, false);
    rf_return(t, rf_sum_all(rf_tanh(rf_add(gram, b))));
}

/* Two products that read only x: the plan pairs their calls (runs_with_next). */
static void paired_program(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_tensor *xt = rf_transpose(x, (const int64_t[]){1, 0});
    rf_return(t, rf_add(rf_sum_all(rf_matmul(x, xt)), rf_sum_all(rf_matmul(xt, x))));
}

/* The weight gradient of a depthwise 3x3 convolution (16 channels, x read as
 * 4 images of 6x8, the kernel cut from its first rows): the autodiff's
 * batch-grouped form, which the services run as oneDNN's grouped
 * backward-weights (conv.c), so the profile names that path for it. */
static void depthwise_grad_program(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_tensor *img = rf_reshape(x, (const int64_t[]){4, 16, 6, 8}, 4);
    rf_tensor *rows = rf_slice(x, (const int64_t[]){0, 0}, (const int64_t[]){3, 48}, NULL);
    rf_tensor *w = rf_reshape(rows, (const int64_t[]){16, 1, 3, 3}, 4);
    rf_conv_params p = rf_conv_params_default(2);
    p.pad_lo[0] = p.pad_lo[1] = p.pad_hi[0] = p.pad_hi[1] = 1;
    p.feature_group_count = 16;
    rf_tensor *y = rf_conv(img, w, &p);
    rf_tensor *g = NULL;
    CHECK_OK(rf_grad(t, rf_sum_all(rf_mul(y, y)), &w, 1, &g));
    rf_return(t, g);
}

/* The weight gradient of a ConvTranspose(4x4, stride 2, pad 1) layer from 16
 * to 4 channels (x read as 2 images of 8x12, the kernel cut from its first
 * elements): the convolution of x dilated by 2 with the kernel, whose
 * weight gradient the services run as oneDNN's backward-weights with the
 * operands' roles swapped (conv.c), not as the input gradient it looks like. */
static void transposed_grad_program(rf_trace *t, void *ctx)
{
    (void)ctx;
    rf_tensor *x = rf_arg(t, 0);
    rf_tensor *img = rf_reshape(x, (const int64_t[]){2, 16, 8, 12}, 4);
    rf_tensor *flat = rf_reshape(x, (const int64_t[]){64 * 48}, 1);
    rf_tensor *first = rf_slice(flat, (const int64_t[]){0}, (const int64_t[]){1024}, NULL);
    rf_tensor *w = rf_reshape(first, (const int64_t[]){4, 16, 4, 4}, 4);
    rf_conv_params p = rf_conv_params_default(2);
    for (int d = 0; d < 2; d++) {
        p.lhs_dilation[d] = 2;
        p.pad_lo[d] = p.pad_hi[d] = 2;
    }
    rf_tensor *y = rf_conv(img, w, &p);
    rf_tensor *g = NULL;
    CHECK_OK(rf_grad(t, rf_sum_all(rf_mul(y, y)), &w, 1, &g));
    rf_return(t, g);
}

/* Compiles and runs `fn` `runs` times with RF_PROFILE as given, frees it, and
 * returns what was written on stderr meanwhile (malloc'd). */
static char *profiled_run(rf_trace_fn fn, const char *profile, int runs)
{
    if (profile)
        setenv("RF_PROFILE", profile, 1);
    else
        unsetenv("RF_PROFILE");
    char path[] = "/tmp/rf-profile-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    fflush(stderr);
    int saved = dup(2);
    dup2(fd, 2);
    rf_array *h = rf_randn(RF_F32, RF_SHAPE(64, 48), 1);
    rf_array *x = rf_array_to(h, rf_device_cpu());
    rf_exec *e = NULL;
    CHECK_OK(rf_compile(fn, NULL, &x, 1, &e));
    for (int i = 0; e && i < runs; i++) {
        rf_array *out = NULL;
        CHECK_OK(rf_exec_run(e, &x, 1, &out, 1));
        rf_array_free(out);
    }
    rf_exec_free(e);
    rf_array_free(x);
    rf_array_free(h);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    char *text = calloc(1, 65536);
    FILE *f = fdopen(fd, "r");
    if (f && text) {
        rewind(f);
        size_t n = fread(text, 1, 65535, f);
        text[n] = '\0';
    }
    if (f)
        fclose(f);
    unlink(path);
    unsetenv("RF_PROFILE");
    return text;
}

static char *profiled_output(const char *profile, int runs)
{
    return profiled_run(program, profile, runs);
}

static int count_of(const char *text, const char *what)
{
    int n = 0;
    for (const char *at = text ? strstr(text, what) : NULL; at; at = strstr(at + 1, what))
        n++;
    return n;
}

int main(void)
{
    char *text = profiled_output("1", 5);
    CHECK(text && strstr(text, "reflux profile: program"));
    CHECK(text && strstr(text, "5 runs (the first left out)") == NULL); /* 4 counted */
    CHECK(text && strstr(text, "4 runs (the first left out)"));
    CHECK(text && strstr(text, "CALL MATMUL matmul: dot_general"));
    CHECK(text && strstr(text, "by kind:"));
    if (text && getenv("RF_TEST_VERBOSE"))
        fputs(text, stdout);
    free(text);

    text = profiled_output("1", 1); /* a single run is reported as it is */
    CHECK(text && strstr(text, "1 runs,"));
    free(text);

    /* RF_PROFILE=1 lists every step of this 3-step program (a matmul, the two
     * sums folded side by side in one step, the mean's division), RF_PROFILE=2 two */
    /* and a number past int's range all of them (atoi made 2^32 + 2 two) */
    const char *const counts[] = {"1", "2", "4294967298"};
    for (int n = 0; n < 3; n++) {
        text = profiled_output(counts[n], 3);
        int listed = 0;
        for (const char *at = text ? strstr(text, "  #") : NULL; at; at = strstr(at + 1, "  #"))
            listed++;
        CHECK(listed == (n == 1 ? 2 : 3));
        free(text);
    }

    /* A pair's time is its first call's; that line names the second, which
     * has no line of its own. */
    text = profiled_run(paired_program, "1", 3);
    CHECK(count_of(text, "CALL MATMUL matmul") == 2);
    CHECK(count_of(text, " with #") == 1);
    CHECK(count_of(text, ", side by side") + count_of(text, ", one after the other") == 1);
    /* the pair, one sum, and the other sum with the addition after its fold */
    CHECK(count_of(text, "  #") == 3);
    CHECK(count_of(text, "REDUCE: reduce +add f32[]") == 1);
    CHECK(count_of(text, "% (2, 2 paired)") == 1); /* by kind: CALL MATMUL's two steps */
    if (text && getenv("RF_TEST_VERBOSE"))
        fputs(text, stdout);
    free(text);

    /* The grouped weight gradient is a oneDNN call, not im2col's products. */
    text = profiled_run(depthwise_grad_program, "100", 2);
    CHECK(count_of(text, "CALL CONV bwd-weights: convolution f32[1,16,3,3]") == 1);
    CHECK(count_of(text, "CALL CONV im2col") == 0);
    if (text && getenv("RF_TEST_VERBOSE"))
        fputs(text, stdout);
    free(text);

    /* So is a ConvTranspose layer's: [16, 4, 4, 4] before its transpose. */
    text = profiled_run(transposed_grad_program, "100", 2);
    CHECK(count_of(text, "CALL CONV bwd-weights: convolution f32[16,4,4,4]") == 1);
    CHECK(count_of(text, "CALL CONV im2col") == 0);
    if (text && getenv("RF_TEST_VERBOSE"))
        fputs(text, stdout);
    free(text);

    /* A matmul's bias and tanh are its epilogue only where oneDNN's matmul
     * applies post-ops in its kernels (AVX-512: 16-channel blocks, or forced),
     * else a loop of the step's own; RF_MATMUL_EPILOGUES says. */
    const char *const settings[] = {"1", "0", NULL};
    for (int i = 0; i < 3; i++) {
        if (settings[i])
            setenv("RF_MATMUL_EPILOGUES", settings[i], 1);
        bool wanted = settings[i] ? *settings[i] == '1' : rfi_dnnl_channel_block() == 16;
        text = profiled_run(dense_tanh_program, "100", 2);
        unsetenv("RF_MATMUL_EPILOGUES");
        CHECK(count_of(text, "CALL MATMUL matmul: dot_general +2 epilogue ops") == wanted);
        CHECK(count_of(text, "CALL MATMUL matmul: dot_general f32[64,64]") == !wanted);
        if (text && getenv("RF_TEST_VERBOSE"))
            fputs(text, stdout);
        free(text);
    }

    text = profiled_output(NULL, 3);
    CHECK(text && strstr(text, "reflux profile") == NULL);
    free(text);
    text = profiled_output("0", 3);
    CHECK(text && strstr(text, "reflux profile") == NULL);
    free(text);
    return tu_finish("test_profile");
}
