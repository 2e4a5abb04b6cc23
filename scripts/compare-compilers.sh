#!/usr/bin/env bash
# compare-compilers.sh: checks that a gcc build and a clang build of reflux make the same
# programs: every stage RF_DUMP writes (traced, ad, final, optimised, plan, generated C) for
# the programs of a set of test binaries must be byte-identical between the two builds.
#
# Why: C leaves the order in which a call's arguments are evaluated to the compiler. Traced
# programs are put in a canonical order (src/passes/canonical_order.c), but the programs
# reflux makes itself afterwards (autodiff, the backend's passes, kernel lowering) follow
# the order its own code creates nodes in, so a node-creating call nested in two arguments
# of another would make the two builds differ. The test suite builds with one compiler;
# this script is the check across two.
#
# Usage: scripts/compare-compilers.sh [TEST ...]   (default: the tests listed below)
# Environment: CC_A (default gcc), CC_B (default clang), JOBS (default 2), OUT (default
# /tmp/reflux-compare-compilers: builds and dumps go there). Exits 1 if any dump differs,
# 2 if a build fails. Needs both compilers (Debian: gcc, clang).
set -uo pipefail

cd "$(dirname "$0")/.."
CC_A="${CC_A:-gcc}"
CC_B="${CC_B:-clang}"
JOBS="${JOBS:-2}"
OUT="${OUT:-/tmp/reflux-compare-compilers}"
tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
    tests=(test_optim_ref test_train test_model test_api test_steady_state test_layers_ref
           test_grad_fd test_composite_grad test_autodiff test_ops_forward test_kir test_plan
           test_pool_native test_direct_conv test_layouts test_losses_ref test_services)
fi

# build CC DIR: a Release build of the tests with that compiler.
build() {
    CC="$1" cmake -S . -B "$2" -DCMAKE_BUILD_TYPE=Release >/dev/null &&
        cmake --build "$2" -j "$JOBS" --target "${tests[@]}" >/dev/null
}

# dump DIR DEST: runs each test with RF_DUMP into DEST/<test> (and an empty disk cache, so
# that every program is made rather than found).
dump() {
    local t
    rm -rf "$2"
    for t in "${tests[@]}"; do
        local cache="$OUT/cache-$t"
        rm -rf "$cache"
        if ! (cd "$1" && RF_DUMP="$2/$t" RF_CACHE_DIR="$cache" "./$t" >/dev/null 2>&1); then
            echo "compare-compilers: $t failed in $1 (dumps kept)" >&2
        fi
        rm -rf "$cache"
    done
}

mkdir -p "$OUT"
for cc in "$CC_A" "$CC_B"; do
    if ! build "$cc" "$OUT/build-$cc"; then
        echo "compare-compilers: the $cc build failed" >&2
        exit 2
    fi
    dump "$OUT/build-$cc" "$OUT/dump-$cc"
done

files=$(find "$OUT/dump-$CC_A" -type f | wc -l)
if diff -rq "$OUT/dump-$CC_A" "$OUT/dump-$CC_B" >"$OUT/differences.txt"; then
    echo "compare-compilers: $files dump files, identical between $CC_A and $CC_B"
    exit 0
fi
echo "compare-compilers: $(wc -l <"$OUT/differences.txt") of $files dump files differ" \
     "between $CC_A and $CC_B (list: $OUT/differences.txt)"
head -20 "$OUT/differences.txt"
exit 1
