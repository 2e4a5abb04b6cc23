"""common.py: what the peer benchmarks (torch_bench.py, jax_bench.py) share with each other
and with bench/rf_bench.c: the workload list, the thread count, the timed loop, the output
line, and the driver that runs every workload (and every mode) in its own child process.

Definitions match rf_bench.c exactly:
  us_per_step  median wall time of one step after a warm-up (at least one step, about a tenth
               of the budget), timed until both 3 steps and --time seconds, or exactly --steps
  compile_ms   wall time of the first call (trace + compile + first run); for compile_*
               workloads the compile alone where the framework can compile without running
               (JAX: lower().compile(), like rf_compile), else (torch.compile) the first call
               minus the fastest of the next 10 steps (after a warm start PyTorch's first
               several steps each take hundreds of ms, so a median of 3 could be one of them)
  peak_rss_mb  getrusage(RUSAGE_SELF).ru_maxrss of the child process, which runs one workload

It deliberately imports no framework: each script brings its own models and steps.
"""
import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

WORKLOADS = [
    "tiny", "mlp", "cnn", "ffn", "resnet", "rnn", "infer1", "infer1024",
    "compile_mlp_cold", "compile_mlp_warm", "compile_resnet_cold", "compile_resnet_warm",
]
MIN_TIMED_STEPS = 3
COMPILE_SETTLE_STEPS = 3
STEADY_STEPS = 10  # steps after a first call that compiled, the fastest taken as its run
RESNET_WIDTH = 16  # examples/resnet.c's default --width, as bench/rf_bench.c
FFN_WIDTH, FFN_BLOCKS = 256, 4  # bench/rf_bench.c's ffn model
RNN_STEPS, RNN_IN, RNN_HIDDEN = 64, 64, 128  # bench/rf_bench.c's rnn model (batch 32)


def num_threads():
    """RF_NUM_THREADS if set (the library's knob), else every core."""
    env = os.environ.get("RF_NUM_THREADS", "").strip()
    return int(env) if env.isdigit() and int(env) > 0 else os.cpu_count()


def median(values):
    v = sorted(values)
    n = len(v)
    if n == 0:
        return 0.0
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def time_steps(step, steps=0, seconds=1.5):
    """Median seconds per call of step() (which must block until its work is done)."""
    warm_end = time.perf_counter() + (0 if steps > 0 else 0.1 * seconds)
    while True:
        step()
        if time.perf_counter() >= warm_end:
            break
    samples = []
    start = time.perf_counter()
    while True:
        if steps > 0:
            if len(samples) >= steps:
                break
        elif len(samples) >= MIN_TIMED_STEPS and time.perf_counter() - start >= seconds:
            break
        t0 = time.perf_counter()
        step()
        samples.append(time.perf_counter() - t0)
    return median(samples)


def measure(first_call, step, workload, steps, seconds):
    """(us_per_step, compile_ms) of a workload whose first call is first_call()."""
    t0 = time.perf_counter()
    first_call()
    first = time.perf_counter() - t0
    if workload.startswith("compile_"):
        fastest = float("inf")
        for _ in range(STEADY_STEPS):
            t0 = time.perf_counter()
            step()
            fastest = min(fastest, time.perf_counter() - t0)
        return 1e6 * fastest, max(0.0, 1e3 * (first - fastest))
    return 1e6 * time_steps(step, steps, seconds), 1e3 * first


def measure_compile(compile_only, step):
    """(us_per_step, compile_ms) of a compile_* workload whose compile can be timed alone
    (as rf_bench times rf_compile): compile_only(), then COMPILE_SETTLE_STEPS steps."""
    t0 = time.perf_counter()
    compile_only()
    compile_s = time.perf_counter() - t0
    return 1e6 * time_steps(step, steps=COMPILE_SETTLE_STEPS), 1e3 * compile_s


def result_line(workload, us, compile_ms):
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return "workload=%s us_per_step=%.2f compile_ms=%.1f peak_rss_mb=%.1f" % (
        workload, us, compile_ms, rss_mb)


def parse_line(line):
    fields = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
    return fields if "workload" in fields and "us_per_step" in fields else None


def parse_args(name, modes):
    p = argparse.ArgumentParser(prog=name, description="reflux peer benchmark (" + name + ")")
    p.add_argument("--workload", default=None,
                   help="comma-separated workloads (default: all): " + " ".join(WORKLOADS))
    p.add_argument("--steps", type=int, default=0, help="exactly N timed steps")
    p.add_argument("--time", type=float, default=1.5, help="seconds per timed loop")
    p.add_argument("--mode", default=modes[0], choices=modes,
                   help="execution mode (default %(default)s)")
    p.add_argument("--matmul-precision", default="f32", choices=["f32", "bf16"],
                   help="bf16: matrix products on bfloat16 operands, f32 sums (default f32)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    names = WORKLOADS if not args.workload else args.workload.split(",")
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        p.error("unknown workload(s) %s; known: %s" % (",".join(unknown), " ".join(WORKLOADS)))
    args.names = names
    return args


def _run_child(script, tag, workload, mode, args, cache_dir, quiet=False):
    """Runs one workload in one mode in a fresh interpreter; the parsed line or None."""
    cmd = [sys.executable, script, "--child", "--workload", workload, "--mode", mode,
           "--time", str(args.time), "--steps", str(args.steps),
           "--matmul-precision", args.matmul_precision]
    if cache_dir:
        cmd += ["--cache-dir", cache_dir]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    fields = None
    for line in proc.stdout.splitlines():
        fields = parse_line(line) or fields
    if proc.returncode != 0 or fields is None:
        if not quiet:
            tail = "\n".join(proc.stderr.strip().splitlines()[-3:])
            sys.stderr.write("# %s: %s mode=%s failed (exit %d): %s\n"
                             % (tag, workload, mode, proc.returncode, tail))
        return None
    return fields


def drive(script, tag, args, modes_for, fallback=None, cold_always=False):
    """The parent: every selected workload in every mode of modes_for(workload), each in its
    own process; prints the best (lowest us_per_step) line per workload. A mode that fails is
    replaced by fallback[mode] when there is one. compile_* workloads get a fresh cache
    directory (cold) or the cold run's one (warm; primed if needed); with cold_always (a
    framework with an on-disk cache it would otherwise reuse) every other workload gets a
    fresh one too, so its first call compiles cold, as rf_bench's does."""
    fallback = fallback or {}
    cache_dirs = {}
    failures = 0
    try:
        for w in args.names:
            cache_dir = None
            if cold_always and not w.startswith("compile_"):
                cache_dir = tempfile.mkdtemp(prefix="%s_bench_cache." % tag)
                cache_dirs["run:" + w] = cache_dir
            if w.startswith("compile_"):
                model = w.split("_")[1]
                fresh = w.endswith("_cold") or model not in cache_dirs
                if fresh:
                    if model in cache_dirs:
                        shutil.rmtree(cache_dirs[model], ignore_errors=True)
                    cache_dirs[model] = tempfile.mkdtemp(prefix="%s_bench_cache." % tag)
                cache_dir = cache_dirs[model]
                if w.endswith("_warm") and fresh:
                    for mode in modes_for(w):
                        _run_child(script, tag, w, mode, args, cache_dir, quiet=True)
            results = []
            for mode in modes_for(w):
                fields = _run_child(script, tag, w, mode, args, cache_dir)
                if not fields and mode in fallback:
                    sys.stderr.write("# %s: %s: mode %s failed; trying %s\n"
                                     % (tag, w, mode, fallback[mode]))
                    mode = fallback[mode]
                    fields = _run_child(script, tag, w, mode, args, cache_dir)
                if fields:
                    results.append((float(fields["us_per_step"]), mode, fields))
            if not results:
                failures += 1
                continue
            results.sort(key=lambda r: r[0])
            us, mode, f = results[0]
            sys.stderr.write("# %s: %s %s -> mode=%s\n" % (
                tag, w, " ".join("%s=%.1fus" % (m, u) for u, m, _ in results), mode))
            print("workload=%s us_per_step=%s compile_ms=%s peak_rss_mb=%s" % (
                w, f["us_per_step"], f["compile_ms"], f["peak_rss_mb"]), flush=True)
    finally:
        for d in cache_dirs.values():
            shutil.rmtree(d, ignore_errors=True)
    return 1 if failures else 0
