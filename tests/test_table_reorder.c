/* test_table_reorder.c: the CPU backend's table reorders (table_reorder.h)
 * against oneDNN's own reorder primitive, byte for byte, over the kernel
 * layouts convolutions ask for: plain to blocked with and without padded
 * channels, multi-level blocks, blocked back to plain and to a swapped plain
 * layout, and a destination with strides wider than the tensor, whose gaps
 * the table must leave alone. Also what the table refuses (too large,
 * mismatched dims, a non-f32 type).
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "backend/cpu/dnnl_loader.h"
#include "backend/cpu/table_reorder.h"
#include "test_util.h"

static dnnl_engine_t engine;
static dnnl_stream_t stream;

static dnnl_memory_desc_t by_tag(const dnnl_dims_t dims, int ndims, dnnl_format_tag_t tag)
{
    dnnl_memory_desc_t md;
    CHECK(rfi_dnnl.memory_desc_init_by_tag(&md, ndims, dims, dnnl_f32, tag) == dnnl_success);
    return md;
}

static size_t elements(const dnnl_memory_desc_t *md)
{
    return rfi_dnnl.memory_desc_get_size(md) / sizeof(float);
}

/* What oneDNN's reorder writes over `to` (filled with `fill` first). */
static void library_reorder(const dnnl_memory_desc_t *from, const dnnl_memory_desc_t *to,
                            const float *src, float *dst)
{
    dnnl_primitive_desc_t pd = NULL;
    dnnl_primitive_t prim = NULL;
    dnnl_memory_t a = NULL, b = NULL;
    CHECK(rfi_dnnl.reorder_primitive_desc_create(&pd, from, engine, to, engine, NULL) ==
          dnnl_success);
    CHECK(pd && rfi_dnnl.primitive_create(&prim, pd) == dnnl_success);
    CHECK(rfi_dnnl.memory_create(&a, from, engine, (void *)src) == dnnl_success);
    CHECK(rfi_dnnl.memory_create(&b, to, engine, dst) == dnnl_success);
    if (prim && a && b) {
        dnnl_exec_arg_t args[2] = {{DNNL_ARG_FROM, a}, {DNNL_ARG_TO, b}};
        CHECK(rfi_dnnl.primitive_execute(prim, stream, 2, args) == dnnl_success);
        CHECK(rfi_dnnl.stream_wait(stream) == dnnl_success);
    }
    if (a)
        rfi_dnnl.memory_destroy(a);
    if (b)
        rfi_dnnl.memory_destroy(b);
    if (prim)
        rfi_dnnl.primitive_destroy(prim);
    if (pd)
        rfi_dnnl.primitive_desc_destroy(pd);
}

/* One reorder from -> to: the table's result equals the library's, every
 * element of the destination's span compared (padding and gaps included). */
static void check_pair(const char *what, const dnnl_memory_desc_t *from,
                       const dnnl_memory_desc_t *to, bool zero_unmapped)
{
    size_t n_from = elements(from), n_to = elements(to);
    float *src = malloc(n_from * sizeof *src);
    float *want = malloc(n_to * sizeof *want), *got = malloc(n_to * sizeof *got);
    CHECK(src && want && got);
    if (!src || !want || !got)
        goto done;
    for (size_t i = 0; i < n_from; i++)
        src[i] = (float)i * 0.25f + 1.0f; /* every element distinct */
    for (size_t i = 0; i < n_to; i++)
        want[i] = got[i] = -7.0f; /* what the gaps must keep (and padding must lose) */
    library_reorder(from, to, src, want);
    CHECK(rfi_table_reorder_fits(from, to));
    rfi_table_reorder t;
    CHECK_OK(rfi_table_reorder_make(from, to, zero_unmapped, &t));
    CHECK(t.n == (int64_t)n_to);
    rfi_table_reorder_run(&t, src, got);
    size_t bad = 0;
    for (size_t i = 0; i < n_to; i++)
        bad += memcmp(&want[i], &got[i], sizeof want[i]) != 0;
    if (bad)
        fprintf(stderr, "%s: %zu of %zu elements differ from oneDNN's reorder\n", what, bad,
                n_to);
    CHECK(bad == 0);
    rfi_table_reorder_free(&t);
    CHECK(t.from == NULL);
done:
    free(src);
    free(want);
    free(got);
}

static void test_into_blocked(void)
{
    const struct {
        dnnl_dims_t dims;
        dnnl_format_tag_t tag;
        const char *what;
    } cases[] = {
        {{16, 16, 3, 3}, dnnl_ABcd8b8a, "16x16x3x3 -> ABcd8b8a"},
        {{32, 16, 1, 1}, dnnl_ABcd8b8a, "32x16x1x1 -> ABcd8b8a"},
        {{5, 3, 3, 3}, dnnl_ABcd8b8a, "5x3x3x3 -> ABcd8b8a (both padded)"},
        {{16, 8, 3, 3}, dnnl_ABcd8a8b, "16x8x3x3 -> ABcd8a8b"},
        {{32, 32, 3, 3}, dnnl_ABcd16b16a, "32x32x3x3 -> ABcd16b16a"},
        {{20, 24, 3, 3}, dnnl_ABcd2b8a4b, "20x24x3x3 -> ABcd2b8a4b (padded, three levels)"},
        {{32, 1, 3, 3}, dnnl_Abcd8a, "32x1x3x3 -> Abcd8a"},
        {{12, 1, 5, 5}, dnnl_Acdb8a, "12x1x5x5 -> Acdb8a (padded)"},
        {{2, 16, 8, 8}, dnnl_aBcd8b, "2x16x8x8 -> aBcd8b"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        dnnl_memory_desc_t plain = by_tag(cases[i].dims, 4, dnnl_abcd);
        dnnl_memory_desc_t blocked = by_tag(cases[i].dims, 4, cases[i].tag);
        check_pair(cases[i].what, &plain, &blocked, true);
    }
}

static void test_out_of_blocked(void)
{
    dnnl_dims_t dims = {16, 24, 3, 3};
    dnnl_memory_desc_t blocked = by_tag(dims, 4, dnnl_ABcd8b8a);
    dnnl_memory_desc_t plain = by_tag(dims, 4, dnnl_abcd);
    dnnl_memory_desc_t swapped = by_tag(dims, 4, dnnl_bacd);
    check_pair("ABcd8b8a -> abcd", &blocked, &plain, false);
    check_pair("ABcd8b8a -> bacd", &blocked, &swapped, false);
    dnnl_dims_t padded = {5, 3, 3, 3};
    dnnl_memory_desc_t from = by_tag(padded, 4, dnnl_ABcd8a8b);
    dnnl_memory_desc_t to = by_tag(padded, 4, dnnl_abcd);
    check_pair("ABcd8a8b (padded) -> abcd", &from, &to, false);
    /* rows of 5 floats with a gap of 3 after each: the gaps are not the tensor's */
    dnnl_dims_t d2 = {4, 5}, strides = {8, 1};
    dnnl_memory_desc_t gappy;
    CHECK(rfi_dnnl.memory_desc_init_by_strides(&gappy, 2, d2, dnnl_f32, strides) ==
          dnnl_success);
    dnnl_memory_desc_t dense = by_tag(d2, 2, dnnl_ba);
    check_pair("ba -> strided rows with gaps", &dense, &gappy, false);
}

static void test_refusals(void)
{
    dnnl_dims_t big = {256, 256, 3, 3}; /* 589824 elements */
    dnnl_memory_desc_t a = by_tag(big, 4, dnnl_abcd), b = by_tag(big, 4, dnnl_ABcd8b8a);
    CHECK(!rfi_table_reorder_fits(&a, &b));
    dnnl_dims_t d1 = {8, 8, 3, 3}, d2 = {8, 8, 3, 1};
    dnnl_memory_desc_t c = by_tag(d1, 4, dnnl_abcd), d = by_tag(d2, 4, dnnl_abcd);
    CHECK(!rfi_table_reorder_fits(&c, &d));
    dnnl_memory_desc_t e;
    CHECK(rfi_dnnl.memory_desc_init_by_tag(&e, 4, d1, dnnl_bf16, dnnl_abcd) == dnnl_success);
    CHECK(!rfi_table_reorder_fits(&c, &e));
    CHECK(rfi_table_reorder_fits(&c, &c));
}

int main(void)
{
    if (rfi_dnnl_load() != RF_OK) {
        fprintf(stderr, "test_table_reorder: oneDNN does not load: %s\n", rf_errmsg());
        return 1;
    }
    CHECK(rfi_dnnl.engine_create(&engine, dnnl_cpu, 0) == dnnl_success);
    CHECK(rfi_dnnl.stream_create(&stream, engine, dnnl_stream_default_flags) == dnnl_success);
    test_into_blocked();
    test_out_of_blocked();
    test_refusals();
    rfi_dnnl.stream_destroy(stream);
    rfi_dnnl.engine_destroy(engine);
    return tu_finish("test_table_reorder");
}
