/* cpu_backend.c: the compiling CPU backend: ties the pipeline together.
 *
 * prepare: optimise the program (simplify, CSE, unroll_pools with its DCE),
 * plan it (fusion and memory planning), get the module, and set up the
 * runtime services (thread pool, math-library calls) and the arena, all
 * once. The module comes from the disk cache's program index when the
 * optimised program was compiled before by this build (no C is generated:
 * see "The program description" below), else the plan is lowered to kernel
 * IR, rendered to C, and compiled and loaded through the disk cache. run:
 * fill the buffer table and call the module's one entry point. Nothing is
 * allocated per run.
 *
 * Optimising is a stage of its own (rfi_backend.optimise), so that rf_compile
 * can keep its result in the lowering memo on disk (runtime/lower_memo.h): a
 * warm compile then starts here at cpu_prepare_optimised.
 *
 * A warm compile of a ResNet training step (bench/rf_bench compile_resnet_warm)
 * is then, roughly (fresh processes, busy machine, oneDNN loaded by the
 * preload thread meanwhile: dnnl_loader.c): trace 0.6-0.9 ms, the lowered and
 * optimised programs from the memo 1.5 ms, plan 0.7 ms (on a guess of what
 * oneDNN will say: plan_on_guess), description and module from the index
 * 1 ms (its dlopen waits while oneDNN's holds the loader's lock), services
 * ~3.5 ms (creating oneDNN's primitives), which services.c makes on two
 * threads where there are enough convolutions ("Making the calls on two
 * threads"). That was measured twice before and left out (median of 20 warm
 * compiles: 10.2 ms on two threads, 9.8 ms on one; 9.60 against 9.55 ms,
 * median of 12 interleaved pairs): the helper thread started on its creator's
 * CPU and waited there for 2.4 ms, half the work. Started off that CPU, it
 * gains (7.9 -> 6.95 ms). Loading the module on a second thread while the
 * services are prepared was measured with the first of those and left out.
 *
 * RF_CHECK=1 (read at compile time) makes every run also execute the
 * reference interpreter first and compare outputs and updated captures, and
 * record each step's values (through the module's `mark`) to judge a
 * mismatch step by step: the differential mode the test suite uses to check
 * both backends agree (check.c).
 * RF_PROFILE=1 (read at compile time too) times every step of every run and
 * prints the profile when the executable is freed (profile.c).
 *
 * It does not know about layers or training, and it computes nothing itself.
 */
#include "../../passes/passes.h"
#include "../../runtime/program_codec.h"
#include "../kir.h"
#include "../plan.h"
#include "cc.h"
#include "check.h"
#include "profile.h"
#include "services.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct cpu_state {
    rfi_graph *opt;          /* the optimised program the plan refers to (owned) */
    rfi_plan *plan;
    rfi_module *module;
    rf_module_entry entry;
    rfi_cpu_services *services;
    rf_module_services table;
    void *arena_block;       /* rfi_malloc'd; the arena is its 64-byte aligned interior */
    void **buffers;          /* the buffer table, filled per run */
    int n_buffers;
    rfi_cpu_check *check;    /* when RF_CHECK is set, else NULL */
    rfi_cpu_profile *profile; /* when RF_PROFILE is set, else NULL */
} cpu_state;

static void cpu_release(void *state);

/* ---- prepare --------------------------------------------------------------------- */

typedef rf_status (*graph_pass)(const rfi_graph *, rfi_graph **);

/* Runs `pass` on *g, replacing it (the old graph is freed unless it is `keep`). */
static rf_status apply_pass(graph_pass pass, rfi_graph **g, const rfi_graph *keep)
{
    rfi_graph *out;
    rf_status st = pass(*g, &out);
    if (st != RF_OK)
        return st;
    if (*g != keep)
        rfi_graph_free(*g);
    *g = out;
    return rfi_verify(out);
}

/* rfi_pad_convs for the convolutions the plan computes as loops. */
static rf_status pad_loop_convs(const rfi_graph *g, rfi_graph **out)
{
    return rfi_pad_convs(g, rfi_plan_conv_as_loops, out);
}

static rf_status optimise(const rfi_graph *g, rfi_graph **out)
{
    rfi_graph *cur = (rfi_graph *)g;
    rf_status st = apply_pass(rfi_simplify, &cur, g);
    if (st == RF_OK)
        st = apply_pass(rfi_cse, &cur, g);
    if (st == RF_OK)
        st = apply_pass(rfi_one_pass_moments, &cur, g); /* ends with DCE */
    if (st == RF_OK)
        st = apply_pass(rfi_relu_masks, &cur, g); /* ends with DCE */
    if (st == RF_OK && rfi_sum_factors_enabled())
        st = apply_pass(rfi_sum_factors, &cur, g); /* ends with DCE */
    if (st == RF_OK && rfi_sum_factors_enabled())
        st = apply_pass(rfi_cse, &cur, g); /* merges the sums left equal */
    if (st == RF_OK)
        st = apply_pass(rfi_merge_dots, &cur, g); /* ends with DCE */
    if (st == RF_OK)
        st = apply_pass(rfi_stack_dots, &cur, g); /* ends with DCE */
    if (st == RF_OK)
        st = apply_pass(rfi_unroll_pools, &cur, g); /* ends with DCE */
    if (st == RF_OK)
        st = apply_pass(pad_loop_convs, &cur, g); /* ends with DCE */
    if (st != RF_OK) {
        if (cur != g)
            rfi_graph_free(cur);
        return st;
    }
    *out = cur;
    return RF_OK;
}

static rf_status make_arena(cpu_state *s)
{
    size_t bytes = s->plan->arena_bytes;
    s->arena_block = rfi_malloc(bytes + 64);
    if (!s->arena_block)
        return rfi_error(RF_E_NOMEM, "rf_compile: out of memory for a %zu-byte arena", bytes);
    s->n_buffers = rfi_plan_n_buffers(s->plan);
    s->buffers = rfi_calloc((size_t)s->n_buffers, sizeof(void *));
    if (!s->buffers)
        return rfi_error(RF_E_NOMEM, "rf_compile: out of memory");
    uintptr_t p = ((uintptr_t)s->arena_block + 63) & ~(uintptr_t)63;
    const rfi_graph *g = s->plan->g;
    s->buffers[rfi_plan_arena_buffer(s->plan)] = (void *)p;
    int first_const = rfi_plan_arena_buffer(s->plan) + 1;
    for (int i = 0; i < s->plan->n_consts; i++)
        s->buffers[first_const + i] = (void *)g->nodes[s->plan->consts[i]]->attr.data;
    return RF_OK;
}

/* ---- The program description (the disk cache's index key) ------------------------ *
 * A warm compile used to lower and render the whole program (~6 ms of the
 * ~16 ms a ResNet step's warm compile took) only to find that the disk cache
 * already held the module. The description below determines the generated
 * source exactly, so the cache's index (disk_cache.h) maps it to the module
 * instead.
 *
 * The source is a function of the optimised program, the plan options and
 * the code that generates it (no thread count, no CPU features: the CPU and
 * the compiler are in the cache's context). So the description holds:
 *   - the build-id of the object that holds the generator (the same object as
 *     this file, libreflux.so or an executable it is linked into statically):
 *     any change to the generator's code changes it, so nothing is ever
 *     hand-bumped; no build-id, no description, no index;
 *   - RF_MODULE_ABI and every plan option;
 *   - the program's description (program_codec.h): node by node in SSA
 *     order, with operands by node id. Not rfi_hash: that is 64 bits and
 *     ignores the order of independent nodes, which the plan's steps and
 *     buffer offsets follow, so two programs with one hash may have
 *     different modules. Constants up to RFI_DESC_INLINE_BYTES are copied
 *     (the renderer may inline them), larger ones as a 128-bit digest (they
 *     reach the module as buffers, never as code). It includes the
 *     program's name (the generator does not read it today; it is cheap).
 * Plan options are described field by field (the assertion below catches a
 * new field that changes the struct's size). The plan, the lowering and the
 * renderer read nothing but the program, these options (the environment only
 * through rfi_plan_opts_default) and RF_BF16_KERNELS (whether generated bf16
 * products may use the CPU's bf16 instructions): one that starts reading
 * anything else must put it in the description too.
 * The index stores the whole description and compares it byte for byte;
 * varints keep it small (18 KB for the ResNet step). */

#define DESC_MAGIC "reflux cpu program description v3"

/* Every field of rfi_plan_opts (see above for what the assertion catches). */
_Static_assert(sizeof(rfi_plan_opts) == 2 * sizeof(int64_t) + 24,
               "rfi_plan_opts changed: describe the new option in desc_plan_opts");

static void desc_plan_opts(rfi_strbuf *b, const rfi_plan_opts *o)
{
    rfi_codec_put_int(b, o->matmul_call_min_flops);
    rfi_codec_put_int(b, o->dot_loop_max_rows);
    rfi_codec_put_int(b, o->in_place_updates);
    rfi_codec_put_int(b, o->call_epilogues);
    rfi_codec_put_int(b, o->matmul_epilogues);
    rfi_codec_put_int(b, o->conv_transposed_views);
    rfi_codec_put_int(b, o->blocked_activations);
    rfi_codec_put_int(b, o->channel_blocks);
    rfi_codec_put_int(b, o->direct_convs);
    rfi_codec_put_int(b, o->sibling_reductions);
    rfi_codec_put_int(b, o->concurrent_calls);
    rfi_codec_put_int(b, o->reduce_epilogues);
    rfi_codec_put_int(b, o->inline_reduce_operands);
}

/* The description of (program, options) into b; false (b empty) when there is
 * no build-id or memory ran out: the compile then takes the full path. */
static bool describe(const rfi_graph *g, const rfi_plan_opts *opts, rfi_strbuf *b)
{
    char build_id[160];
    if (!rfi_cc_build_id((uintptr_t)rfi_render_c, build_id, sizeof build_id))
        return false;
    rfi_sb_printf(b, "%s\n%s\n", DESC_MAGIC, build_id);
    rfi_codec_put_int(b, RF_MODULE_ABI);
    desc_plan_opts(b, opts);
    rfi_codec_put_int(b, rfi_bf16_kernels_allowed()); /* the renderer reads it */
    rfi_program_describe(b, g);
    if (b->failed) {
        rfi_sb_free(b);
        return false;
    }
    return true;
}

/* ---- The module ------------------------------------------------------------------ */

typedef struct source_job {
    const rfi_plan *plan;
    const char *name;
    uint64_t hash;
} source_job;

/* Lowers and renders the plan (rfi_cc_source_fn); dumps the plan and the C. */
static rf_status generate_source(void *ctx, char **source)
{
    const source_job *job = ctx;
    rfi_kir_module *kir = NULL;
    *source = NULL;
    uint64_t failures = rfi_alloc_failures_here();
    rf_status st = rfi_kir_lower(job->plan, &kir);
    if (st == RF_OK)
        st = rfi_render_c(kir, source);
    if (st == RF_OK && rfi_alloc_failures_here() != failures) {
        /* a lowering choice may have been given up: the source must not be
         * recorded as this program's (the index assumes it is determined) */
        rfi_free(*source);
        *source = NULL;
        st = rfi_error(RF_E_NOMEM, "rf_compile: out of memory generating %s's source", job->name);
    }
    if (st == RF_OK && rfi_dump_wanted()) {
        char *plan_text = rfi_plan_print(job->plan);
        if (plan_text)
            rfi_dump(job->name, job->hash, "plan", plan_text);
        rfi_free(plan_text);
        rfi_dump(job->name, job->hash, "c", *source);
    }
    rfi_kir_free(kir);
    return st;
}

/* Loads the module: through the disk cache's index when the program can be
 * described, else by generating its source. RF_DUMP wants the plan and the C
 * text, so a dumping compile always generates them. */
static rf_status build_module(cpu_state *s, const rfi_plan_opts *opts, const char *name,
                              uint64_t hash)
{
    rfi_strbuf desc = {0};
    if (!rfi_dump_wanted())
        (void)describe(s->opt, opts, &desc);
    source_job job = {s->plan, name, hash};
    rf_status st = rfi_cc_load_program(desc.data, desc.len, generate_source, &job, name,
                                       &s->module);
    rfi_sb_free(&desc);
    if (st == RF_OK)
        s->entry = rfi_module_entry_fn(s->module);
    return st;
}

/* Activations in oneDNN's layouts (plan.h) need oneDNN, whose reorders the
 * services use around calls that do not take them; RF_BLOCKED=0 in the
 * environment turns them off (benches, tests). With `loaded` false this is
 * the guess made before oneDNN has loaded: that it will (plan_on_guess). */
static bool blocked_wanted(bool loaded)
{
    const char *v = getenv("RF_BLOCKED");
    if (v && strcmp(v, "0") == 0)
        return false;
    return !loaded || rfi_dnnl_load() == RF_OK;
}

/* The channel-blocked layout of those activations: the block oneDNN's
 * kernels use on this CPU (8 or 16 channels), unless RF_LAYOUT_BLOCK=8 or
 * 16 in the environment says (tests run both on any machine). A mismatch
 * costs speed only: oneDNN reorders to its own block inside the call. With
 * `loaded` false, the block the CPU's features say oneDNN will choose, where
 * they can tell, so that planning need not wait for the library. */
static rfi_layout channel_blocks_wanted(bool loaded)
{
    const char *v = getenv("RF_LAYOUT_BLOCK");
    int guess = loaded ? 0 : rfi_dnnl_channel_block_guess();
    int block = v && (!strcmp(v, "8") || !strcmp(v, "16")) ? atoi(v)
                : guess                                    ? guess
                : rfi_dnnl_load() == RF_OK                 ? rfi_dnnl_channel_block()
                                                           : 16;
    return block == 8 ? RFI_LAYOUT_C8 : RFI_LAYOUT_C16;
}

/* Bias, residual and activation users of a matmul as the call's epilogue
 * (plan.h matmul_epilogues) where oneDNN applies post-ops inside its matmul
 * kernels: its AVX-512 ones, which run convolutions on 16-channel blocks (so
 * RF_LAYOUT_BLOCK=16 plans as for AVX-512 here too, and the tests that force
 * it cover these epilogues on any machine). Its AVX2 matmul (gemm:jit)
 * applies them in a pass after the product, slower than the step's own loop:
 * on two AVX2 cores a 32x64 by 64x128 product took 5.3 us, 7.5 with a bias
 * post-op and 16-20 with tanh; the mlp's first layer 746 us and its bias and
 * relu loop 23-36 against 850-940 as one call; the mlp step faster in 5 of 6
 * interleaved pairs (median 2.60 against 2.88 ms) and an RNN of 64 steps
 * 4.6-4.9 against 5.8-6.0 ms. RF_MATMUL_EPILOGUES=0 or 1 in the environment
 * says. */
static bool matmul_epilogues_wanted(rfi_layout blocks)
{
    const char *v = getenv("RF_MATMUL_EPILOGUES");
    if (v && (!strcmp(v, "0") || !strcmp(v, "1")))
        return *v == '1';
    return blocks == RFI_LAYOUT_C16;
}

/* Few-channel convolutions as generated loops (kir_conv.c); RF_DIRECT_CONV=0
 * in the environment leaves them to the library (benches, tests). */
static bool direct_convs_wanted(void)
{
    const char *v = getenv("RF_DIRECT_CONV");
    return !(v && strcmp(v, "0") == 0);
}

/* Independent library calls side by side, a thread each (plan.h
 * concurrent_calls); RF_CONCURRENT_CALLS=0 in the environment: one after the
 * other on all threads. */
static bool concurrent_calls_wanted(void)
{
    const char *v = getenv("RF_CONCURRENT_CALLS");
    return !(v && strcmp(v, "0") == 0);
}

/* What optimise reads beyond the program (rfi_backend.optimise_context). */
static void cpu_optimise_context(rfi_strbuf *b)
{
    rfi_sb_printf(b, "unroll_pools=%d\n", (int)rfi_unroll_pools_enabled());
    rfi_sb_printf(b, "merge_dots=%d\n", (int)rfi_merge_dots_enabled());
    rfi_sb_printf(b, "stack_dots=%d\n", (int)rfi_stack_dots_enabled());
    rfi_sb_printf(b, "sum_factors=%d\n", (int)rfi_sum_factors_enabled());
}

/* The plan. Its layouts and epilogues depend on oneDNN (blocked_wanted,
 * channel_blocks_wanted, matmul_epilogues_wanted),
 * which the preload thread may still be loading when a compile gets here
 * (dnnl_loader.c); waiting for it left the main thread idle for 1-2 ms of a warm
 * compile. So the plan is made on a guess, checked against the loaded library
 * after, and made again in the rare case the guess was wrong (no oneDNN, or a CPU
 * whose features said otherwise), before any module is generated for it. */
static rf_status plan_on_guess(cpu_state *s, rfi_plan_opts *opts)
{
    for (int loaded = 0; loaded < 2; loaded++) {
        bool blocked = blocked_wanted(loaded);
        rfi_layout blocks = channel_blocks_wanted(loaded);
        if (loaded && blocked == opts->blocked_activations && blocks == opts->channel_blocks)
            return RF_OK; /* the guess held (the epilogues follow the blocks) */
        rfi_plan_free(s->plan);
        s->plan = NULL;
        opts->blocked_activations = blocked;
        opts->channel_blocks = blocks;
        opts->matmul_epilogues = matmul_epilogues_wanted(blocks);
        rf_status st = rfi_plan_build(s->opt, opts, &s->plan);
        if (st != RF_OK)
            return st;
    }
    return RF_OK;
}

/* Both the profile's and the checker's marks, for a program that has both. */
static void mark_both(void *ctx, int step)
{
    cpu_state *s = ctx;
    rfi_cpu_check_mark(s->check, step);
    rfi_cpu_profile_mark(s->profile, step);
}

/* Who the module tells where each step starts (module_abi.h `mark`): the
 * profile (RF_PROFILE), the checker's recording (RF_CHECK), both, or no one. */
static void set_mark(cpu_state *s)
{
    bool check = rfi_cpu_check_records(s->check);
    s->table.mark = check && s->profile ? mark_both
                    : check             ? rfi_cpu_check_mark
                    : s->profile        ? rfi_cpu_profile_mark
                                        : NULL;
    s->table.prof = check && s->profile ? (void *)s
                    : check             ? (void *)s->check
                                        : (void *)s->profile;
}

static rf_status cpu_prepare_optimised(const rfi_graph *g, rfi_graph *opt, void **state)
{
    cpu_state *s = rfi_calloc(1, sizeof *s);
    if (!s) {
        rfi_graph_free(opt);
        return rfi_error(RF_E_NOMEM, "rf_compile: out of memory");
    }
    s->opt = opt;
    const char *name = g->name ? g->name : "program";
    uint64_t hash = rfi_dump_wanted() ? rfi_hash(s->opt) : 0; /* names the dumps only */
    if (rfi_dump_wanted()) {
        char *text = rfi_print(s->opt);
        if (text)
            rfi_dump(name, hash, "optimised", text);
        rfi_free(text);
    }
    rfi_plan_opts opts = rfi_plan_opts_default();
    opts.conv_transposed_views = true; /* the services read or copy them (services.c) */
    opts.direct_convs = direct_convs_wanted();
    opts.concurrent_calls = concurrent_calls_wanted();
    rf_status st = plan_on_guess(s, &opts);
    if (st == RF_OK)
        st = build_module(s, &opts, name, hash);
    if (st == RF_OK)
        st = rfi_cpu_services_prepare(s->plan, &s->services);
    if (st == RF_OK) {
        rfi_cpu_services_table(s->services, &s->table);
        st = make_arena(s);
    }
    if (st == RF_OK && rfi_cpu_profile_wanted())
        s->profile = rfi_cpu_profile_new(s->plan, s->services, name);
    double check_scale = rfi_cpu_check_scale();
    if (st == RF_OK && check_scale > 0)
        st = rfi_cpu_check_new(g, s->plan, s->buffers, check_scale, &s->check);
    if (st == RF_OK)
        set_mark(s);
    if (st != RF_OK) {
        cpu_release(s);
        return st;
    }
    *state = s;
    return RF_OK;
}

static rf_status cpu_prepare(const rfi_graph *g, void **state)
{
    rfi_graph *opt;
    rf_status st = optimise(g, &opt);
    return st == RF_OK ? cpu_prepare_optimised(g, opt, state) : st;
}

/* ---- run --------------------------------------------------------------------------- */

static rf_status cpu_run(void *state, const rfi_graph *g, const rfi_run_io *io)
{
    cpu_state *s = state;
    if (s->check) {
        rf_status st = rfi_cpu_check_before(s->check, g, io);
        if (st != RF_OK)
            return st;
    }
    int b = 0;
    for (int i = 0; i < g->n_args; i++)
        s->buffers[b++] = io->args[i];
    for (int i = 0; i < g->n_captures; i++)
        s->buffers[b++] = io->captures[i];
    for (int i = 0; i < g->n_outputs; i++)
        s->buffers[b++] = io->outputs[i];
    rfi_cpu_services_start_run(s->services);
    int failed = s->entry(&s->table, s->buffers);
    if (failed) { /* a library call's failure: its message says why */
        char why[RFI_ERRMSG_MAX - 64];
        snprintf(why, sizeof why, "%s", rf_errmsg());
        return rfi_error(rfi_cpu_services_failure(s->services), "rf_exec_run: step %d of the "
                         "compiled program failed: %s", failed - 1, why);
    }
    return s->check ? rfi_cpu_check_after(s->check, g, io) : RF_OK;
}

static size_t cpu_memory(void *state)
{
    const cpu_state *s = state;
    return s->plan->arena_bytes + rfi_cpu_services_workspace(s->services);
}

static void cpu_release(void *state)
{
    cpu_state *s = state;
    if (!s)
        return;
    rfi_cpu_check_free(s->check);
    rfi_cpu_profile_free(s->profile); /* prints it: needs the plan and services */
    rfi_cpu_services_free(s->services);
    rfi_module_free(s->module);
    rfi_plan_free(s->plan);
    rfi_graph_free(s->opt);
    rfi_free(s->arena_block);
    rfi_free(s->buffers);
    rfi_free(s);
}

const rfi_backend rfi_cpu_backend = {
    .name = "cpu",
    .prepare = cpu_prepare,
    .run = cpu_run,
    .release = cpu_release,
    .writes_updates = true,
    .memory = cpu_memory,
    .warm_up = rfi_dnnl_preload,
    .settle = rfi_dnnl_settle,
    .optimise = optimise,
    .optimise_context = cpu_optimise_context,
    .prepare_optimised = cpu_prepare_optimised,
};
