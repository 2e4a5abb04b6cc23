#!/usr/bin/env bash
# compare.sh: runs reflux (bench/rf_bench), PyTorch (bench/peers/torch_bench.py) and JAX
# (bench/peers/jax_bench.py) side by side, interleaved (one workload at a time, each tool's
# run a separate process, the tools' order rotating from round to round), then prints
# a table of the medians over the rounds: time per step, the torch/reflux and jax/reflux
# ratios (> 1: reflux is faster), compile times, each process's peak memory, and the issue's
# targets met or missed.
#
# It does not build anything (build rf_bench first: `make bench` or cmake) and does not set
# threads: all three read RF_NUM_THREADS (default: every core). A peer whose package is
# missing is reported as skipped.
#
# Usage: bench/compare.sh [--rounds N] [--compile-rounds N] [--time SECONDS]
#                         [--workload W1,W2,...] [--bench PATH] [--backend interp|cpu]
#                         [--torch-mode best|eager|compile|script]
#                         [--matmul-precision f32|bf16] [--out FILE]
#        bench/compare.sh --from FILE.raw
# --out FILE also keeps every round's lines in FILE.raw and the programs' stderr in FILE.log;
# --from prints the tables again from such a file (and its .log) without running anything.
# --matmul-precision bf16 runs all three with bfloat16 matrix products (the issue's targets
# are for f32: read them as such).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
rounds=3 compile_rounds=1 seconds=1 workloads="" backend="" torch_mode=best out="" from=""
precision=f32
bench="${RF_BENCH:-}"
all="tiny mlp cnn ffn resnet rnn infer1 infer1024 compile_mlp_cold compile_mlp_warm compile_resnet_cold compile_resnet_warm"

usage() { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) rounds="$2"; shift 2 ;;
        --compile-rounds) compile_rounds="$2"; shift 2 ;;
        --time) seconds="$2"; shift 2 ;;
        --workload) workloads="${2//,/ }"; shift 2 ;;
        --bench) bench="$2"; shift 2 ;;
        --backend) backend="$2"; shift 2 ;;
        --torch-mode) torch_mode="$2"; shift 2 ;;
        --matmul-precision) precision="$2"; shift 2 ;;
        --out) out="$2"; shift 2 ;;
        --from) from="$2"; shift 2 ;;
        *) usage ;;
    esac
done
[ -n "$backend" ] && export RF_BACKEND="$backend"
label="${RF_BACKEND:-default}"
[ "$precision" = f32 ] || label="$label, matmul precision $precision"

# Prints the tables from a results file (lines tagged tool= round=) and the runs' log.
# Arguments: results log label tools workloads cores threads rounds compile_rounds seconds
# loadavg (the last six "-" when re-printing with --from).
print_tables() {
python3 - "$@" <<'PY'
import re, sys
results, log, label, tools, workloads, cores, threads, rounds, crounds, secs, load = sys.argv[1:]
tools, workloads = tools.split(), workloads.split()
runs = {}
for line in open(results):
    f = dict(kv.split("=", 1) for kv in line.split())
    runs.setdefault((f["tool"], f["workload"]), []).append(f)
modes, peak = {}, None
for line in open(log):
    m = re.match(r"# torch: (\S+) .* -> mode=(\S+)", line)
    if m:
        modes.setdefault(m.group(1), []).append(m.group(2))
    m = re.match(r"peak_flops .*gflops_all=(\S+)", line)
    if m:  # the best of the runs: a neighbour can only slow one down
        peak = max(peak or 0, float(m.group(1)))

def med(tool, w, key):
    v = sorted(float(r[key]) for r in runs.get((tool, w), []))
    if not v:
        return None
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])

def fmt(x, digits=1):
    return "-" if x is None else "%.*f" % (digits, x)

def ratio(a, b):
    return "-" if a is None or b is None or b <= 0 else "%.2fx" % (a / b)

if secs == "-":
    print("reflux backend: %s; tables printed again from %s" % (label, results))
else:
    print("reflux backend: %s; %s cores, threads: %s; %s rounds (compile_*: %s), %s s per timed"
          " loop; load average after: %s" % (label, cores, threads, rounds, crounds, secs, load))
print("ratios: peer time / reflux time (> 1: reflux faster); compile_* rows compare compile_ms\n")

def table(rows):
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        print("| " + " | ".join(c.ljust(widths[j]) for j, c in enumerate(r)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (wd + 2) for wd in widths) + "|")
head = ("workload", "reflux(%s) us" % label, "torch us", "jax us", "torch/reflux", "jax/reflux",
        "reflux compile ms", "torch compile ms", "jax compile ms", "torch mode")
rows = [head]
for w in workloads:
    us = {t: med(t, w, "us_per_step") for t in ("reflux", "torch", "jax")}
    cm = {t: med(t, w, "compile_ms") for t in ("reflux", "torch", "jax")}
    basis = cm if w.startswith("compile_") else us
    mode = modes.get(w, [])
    rows.append((w, fmt(us["reflux"], 2), fmt(us["torch"], 2), fmt(us["jax"], 2),
                 ratio(basis["torch"], basis["reflux"]), ratio(basis["jax"], basis["reflux"]),
                 fmt(cm["reflux"]), fmt(cm["torch"]), fmt(cm["jax"]),
                 max(set(mode), key=mode.count) if mode else "-"))
table(rows)

# Memory: each workload runs in a process of its own, so a peak is that workload's (the
# peers' include their interpreter and framework).
print("\npeak memory: peak RSS of the process, MB (ratios: peer / reflux, > 1: reflux smaller)\n")
rows = [("workload", "reflux MB", "torch MB", "jax MB", "torch/reflux", "jax/reflux")]
for w in workloads:
    mb = {t: med(t, w, "peak_rss_mb") for t in ("reflux", "torch", "jax")}
    rows.append((w, fmt(mb["reflux"]), fmt(mb["torch"]), fmt(mb["jax"]),
                 ratio(mb["torch"], mb["reflux"]), ratio(mb["jax"], mb["reflux"])))
table(rows)

# How noisy the rounds were: slowest / fastest round of each tool.
def spread(tool, w):
    v = [float(r["us_per_step"]) for r in runs.get((tool, w), [])]
    return "-" if len(v) < 2 or min(v) <= 0 else "%.2f" % (max(v) / min(v))
print("\nspread over rounds (slowest / fastest us_per_step):")
for w in workloads:
    if not w.startswith("compile_"):
        print("  %-12s reflux %-6s torch %-6s jax %s" % (w, spread("reflux", w), spread("torch", w),
                                                        spread("jax", w)))

# The issue's targets. Its 1 ms for the mlp step is 60% of a 510 GFLOP/s peak; the machine's
# own peak (bench/peak_flops, run before the rounds) gives that share here.
MLP_STEP_MFLOP = 308.15  # 2 * 128 * (784*512 + 512*256 + 256*10) forward, as much for the
                         # weight gradients, 2 * 128 * (512*256 + 256*10) for two input gradients
def mlp_gflops():
    us = med("reflux", "mlp", "us_per_step")
    return None if not us else MLP_STEP_MFLOP / us * 1e3

def mlp_share_of_peak():
    g = mlp_gflops()
    return None if g is None or not peak else 100 * g / peak

def speedup(peer, w):
    a, b = med(peer, w, "us_per_step"), med("reflux", w, "us_per_step")
    return None if a is None or not b else a / b
targets = [
    ("tiny >= 50x torch", speedup("torch", "tiny"), 50, ">="),
    ("tiny >= 5x jax", speedup("jax", "tiny"), 5, ">="),
    ("mlp >= 3x torch", speedup("torch", "mlp"), 3, ">="),
    ("mlp >= 1.5x jax", speedup("jax", "mlp"), 1.5, ">="),
    ("cnn >= 3x torch", speedup("torch", "cnn"), 3, ">="),
    ("cnn >= 1.5x jax", speedup("jax", "cnn"), 1.5, ">="),
    ("resnet >= 2x torch", speedup("torch", "resnet"), 2, ">="),
    ("infer1 >= 5x torch", speedup("torch", "infer1"), 5, ">="),
    ("mlp step <= 1000 us", med("reflux", "mlp", "us_per_step"), 1000, "<="),
    ("mlp step >= 60% of peak", mlp_share_of_peak(), 60, ">="),
    ("compile_mlp_cold < 500 ms", med("reflux", "compile_mlp_cold", "compile_ms"), 500, "<"),
    ("compile_resnet_cold < 3000 ms", med("reflux", "compile_resnet_cold", "compile_ms"), 3000, "<"),
    ("compile_mlp_warm < 10 ms", med("reflux", "compile_mlp_warm", "compile_ms"), 10, "<"),
    ("compile_resnet_warm < 10 ms", med("reflux", "compile_resnet_warm", "compile_ms"), 10, "<"),
]
print("\ntargets (issue 4):")
for name, value, bound, op in targets:
    if value is None:
        print("  %-30s not measured" % name)
        continue
    ok = {">=": value >= bound, "<=": value <= bound, "<": value < bound}[op]
    print("  %-30s %-6s measured %.2f" % (name, "met" if ok else "MISSED", value))
if peak:
    print("  (peak: %.1f GFLOP/s, the best of 3 runs of peak_flops; the mlp step's %.0f MFLOP:"
          " %s GFLOP/s)" % (peak, MLP_STEP_MFLOP, fmt(mlp_gflops())))
PY
}

if [ -n "$from" ]; then  # print the tables of an earlier run again
    [ -r "$from" ] || { echo "compare.sh: cannot read $from" >&2; exit 1; }
    log="${from%.raw}.log"
    [ -r "$log" ] || log=/dev/null
    tools="" present=""
    for t in reflux torch jax; do grep -q "^tool=$t " "$from" && tools="$tools $t"; done
    for w in $all; do grep -q " workload=$w " "$from" && present="$present $w"; done
    print_tables "$from" "$log" "$label" "$tools" "${workloads:-$present}" - - - - - -
    exit 0
fi

workloads="${workloads:-$all}"
if [ -z "$bench" ]; then
    for candidate in "$root/build/rf_bench" "$PWD/build/rf_bench" "$PWD/rf_bench"; do
        if [ -x "$candidate" ]; then bench="$candidate"; break; fi
    done
fi
if [ -z "$bench" ] || [ ! -x "$bench" ]; then
    echo "compare.sh: rf_bench not found; build it first (make bench, or cmake --build build" \
         "--target rf_bench) or pass --bench PATH" >&2
    exit 1
fi

work="$(mktemp -d /tmp/rf_compare.XXXXXX)"
trap 'rm -rf "$work"' EXIT
results="$work/results" log="$work/log"
: > "$results"; : > "$log"

# A peer is usable if python3 can import its packages (its script would print a skip line).
peer_usable() {
    if python3 -c "import $2" >/dev/null 2>&1; then
        return 0
    fi
    echo "# skip: $1: python3 cannot import $2" | tee -a "$log" >&2
    return 1
}
tools="reflux"
if command -v python3 >/dev/null; then
    peer_usable torch_bench.py torch && tools="$tools torch"
    peer_usable jax_bench.py "jax, optax" && tools="$tools jax"
fi

# With --torch-mode best, the first round tries eager and torch.compile (or TorchScript) and
# later rounds run only the mode that won for that workload (it saves minutes on 2 cores).
torch_mode_for() {
    local won=""
    if [ "$torch_mode" = best ]; then
        won="$(sed -n "s/^# torch: $1 .* -> mode=\(.*\)$/\1/p" "$log" | head -n 1)"
    fi
    echo "${won:-$torch_mode}"
}

# Runs one tool on one workload; its lines go to $results tagged with the tool and round.
run_one() {
    local tool="$1" w="$2" round="$3" cmd
    case "$tool" in
        reflux) cmd=("$bench" --workload "$w" --time "$seconds" --matmul-precision "$precision") ;;
        torch) cmd=(python3 "$here/peers/torch_bench.py" --workload "$w" --time "$seconds"
                    --mode "$(torch_mode_for "$w")" --matmul-precision "$precision") ;;
        jax) cmd=(python3 "$here/peers/jax_bench.py" --workload "$w" --time "$seconds"
                  --matmul-precision "$precision") ;;
    esac
    "${cmd[@]}" 2>>"$log" | grep '^workload=' |
        sed "s/^/tool=$tool round=$round /" >>"$results" || \
        echo "# $tool $w round $round failed (see the log)" >&2
}

# Each tool's compiles must be its own and cold where the table says so: no cache the
# environment points at (the peers make their own per run), no compiler cache behind $CC.
unset JAX_COMPILATION_CACHE_DIR JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS \
      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES TORCHINDUCTOR_CACHE_DIR
case "${CC:-} ${CCACHE_DISABLE-x}" in
    *ccache*" x") echo "# warning: CC='$CC' goes through ccache: reflux's cold compiles may" \
                       "be cache hits (set CCACHE_DISABLE=1 or CC=gcc)" >&2 ;;
esac

start=$(date +%s)
echo "# compare.sh: $(nproc) cores, RF_NUM_THREADS=${RF_NUM_THREADS:-unset}," \
     "reflux backend: $label; tools: $tools" >&2
echo "# load average before: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
# The machine's multiply-add peak, for the mlp step's share of it (built next to rf_bench):
# three runs, the best counts.
if [ -x "$(dirname "$bench")/peak_flops" ]; then
    for _ in 1 2 3; do
        "$(dirname "$bench")/peak_flops" 2>/dev/null | grep '^peak_flops ' >>"$log" || true
    done
fi
# Each round starts with the next tool (reflux torch jax, then torch jax reflux, ...), so no
# tool always runs right after another one's process has warmed or loaded the machine.
read -r -a tool_list <<<"$tools"
for round in $(seq 1 "$rounds"); do
    for w in $workloads; do
        case "$w" in compile_*) [ "$round" -le "$compile_rounds" ] || continue ;; esac
        for k in "${!tool_list[@]}"; do
            run_one "${tool_list[$(( (k + round - 1) % ${#tool_list[@]} ))]}" "$w" "$round"
        done
    done
    echo "# round $round done after $(( $(date +%s) - start )) s" >&2
done
loadavg="$(cut -d' ' -f1-3 /proc/loadavg)"
if [ -n "$out" ]; then  # keep every round's lines and the programs' stderr next to the table
    cp "$results" "$out.raw"
    cp "$log" "$out.log"
fi

print_tables "$results" "$log" "$label" "$tools" "$workloads" "$(nproc)" "${RF_NUM_THREADS:-all}" \
    "$rounds" "$compile_rounds" "$seconds" "$loadavg" | tee ${out:+"$out"}
echo "# total $(( $(date +%s) - start )) s" >&2
