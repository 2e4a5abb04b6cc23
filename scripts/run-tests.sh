#!/usr/bin/env bash
# run-tests.sh: builds and runs the test suite twice, then prints one summary line.
#
#   build/       Release build, ctest
#   build-asan/  Debug build with AddressSanitizer + UndefinedBehaviorSanitizer, float-cast-overflow
#                included (-DRF_SANITIZE=ON), ctest (LeakSanitizer runs with ASan, so leaks fail
#                a test too), its tests' modules cached in build/module-cache with the first's
#
# The last line printed is exactly "N passed, N failed" summed over both runs; the script
# exits non-zero if anything failed. A configure or build failure counts as one failure of
# that run (its tests cannot be counted). Installs nothing: `make test` runs setup-deps.sh first.
# Environment: JOBS (default 2), TEST_TIMEOUT (seconds per test), CMAKE_ARGS (extra flags).
set -uo pipefail

cd "$(dirname "$0")/.."
JOBS="${JOBS:-2}"
# Extra configure flags for both builds, e.g. CMAKE_ARGS="-DRF_WERROR=OFF".
read -r -a EXTRA_CMAKE_ARGS <<<"${CMAKE_ARGS:-}"
TEST_TIMEOUT="${TEST_TIMEOUT:-600}"

total_passed=0
total_failed=0

# run_suite DIR CMAKE_ARGS... : configure, build, ctest; adds to the totals.
run_suite() {
    local dir="$1"
    shift
    echo "==== $dir: configure and build ===="
    if ! cmake -S . -B "$dir" "$@" ${EXTRA_CMAKE_ARGS[@]+"${EXTRA_CMAKE_ARGS[@]}"} || ! cmake --build "$dir" -j "$JOBS"; then
        echo "run-tests: configure/build failed in $dir" >&2
        total_failed=$((total_failed + 1))
        return
    fi

    echo "==== $dir: ctest ===="
    local log="$dir/ctest-summary.log"
    (cd "$dir" && ctest --output-on-failure -j "$JOBS" --timeout "$TEST_TIMEOUT") 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}

    # ctest ends with e.g. "80% tests passed, 1 tests failed out of 5".
    local summary
    summary=$(grep -E 'tests passed, [0-9]+ tests? failed out of [0-9]+' "$log" | tail -n 1 || true)
    if [ -n "$summary" ]; then
        local failed total
        failed=$(sed -E 's/.*tests passed, ([0-9]+) tests? failed out of ([0-9]+).*/\1/' <<<"$summary")
        total=$(sed -E 's/.*tests passed, ([0-9]+) tests? failed out of ([0-9]+).*/\2/' <<<"$summary")
        total_passed=$((total_passed + total - failed))
        total_failed=$((total_failed + failed))
    elif grep -q 'No tests were found' "$log"; then
        echo "run-tests: no tests in $dir" >&2 # a build that lost its tests is a failure
        total_failed=$((total_failed + 1))
    else
        echo "run-tests: ctest in $dir gave no summary (exit $rc)" >&2
        total_failed=$((total_failed + 1))
    fi
}

run_suite build -DCMAKE_BUILD_TYPE=Release

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:strict_string_checks=1:check_initialization_order=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
# The Release build's module cache: modules are the same bytes whichever build generated
# their C, so the sanitizer suite compiles none that the first suite compiled.
run_suite build-asan -DCMAKE_BUILD_TYPE=Debug -DRF_SANITIZE=ON \
    -DRF_TEST_CACHE="$PWD/build/module-cache"

echo "$total_passed passed, $total_failed failed"
[ "$total_failed" -eq 0 ]
