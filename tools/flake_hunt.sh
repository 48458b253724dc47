#!/usr/bin/env bash
# The flake hunt (docs/building.md, "Flake hunt"): every multi-process integration test run
# CKPTD_FLAKE_RUNS times (default 5) in each of the three builds (plain, ASan + UBSan, TSan),
# each in the output base tools/test.sh uses, optionally while another build loads the
# machine (CKPTD_FLAKE_LOAD=1: an ASan build of everything in an output base of its own,
# restarted until the hunt ends). Prints, per build and target, how many runs failed, and
# exits non-zero if any did. Long: hours on 2 cores; CI runs each test once per build instead.
#
#   tools/flake_hunt.sh                               # every target below, 5 runs per build
#   CKPTD_FLAKE_RUNS=10 tools/flake_hunt.sh //tests/integration:group_test
#   CKPTD_FLAKE_BUILDS="plain tsan" tools/flake_hunt.sh
set -uo pipefail
cd "$(dirname "$0")/.."

runs=${CKPTD_FLAKE_RUNS:-5}
builds=${CKPTD_FLAKE_BUILDS:-plain asan tsan}
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(//tests/integration:group_test //tests/integration:replication_test //tests/integration:remote_test
           //tests/integration:kill_loop_test //tests/integration:kill_loop_increments_test //tests/integration:lifecycle_test //tests/integration:step_reuse_test
           //tests/integration:ownership_test)
fi

load_pid=""
if [ "${CKPTD_FLAKE_LOAD:-0}" = 1 ]; then
  # Another build beside the tests, as CI's machine may have: a clean ASan build, again and again.
  load_base="$HOME/.cache/bazel_flake_load"
  ( while true; do
      bazel --output_base="$load_base" clean >/dev/null 2>&1
      bazel --output_base="$load_base" build --config=asan --symlink_prefix=/ //... >/dev/null 2>&1
    done ) &
  load_pid=$!
  trap 'kill -- -$load_pid 2>/dev/null; kill $load_pid 2>/dev/null; bazel --output_base="$load_base" shutdown >/dev/null 2>&1' EXIT
fi

failed=0
summary=()
for build in $builds; do
  case $build in
    plain) base=(); config=() ;;
    asan) base=(--output_base="${CKPTD_ASAN_OUTPUT_BASE:-$HOME/.cache/bazel_asan}"); config=(--config=asan --symlink_prefix=/) ;;
    tsan) base=(--output_base="${CKPTD_TSAN_OUTPUT_BASE:-$HOME/.cache/bazel_tsan}"); config=(--config=tsan --symlink_prefix=/) ;;
    *) echo "unknown build '$build' (plain, asan, tsan)" >&2; exit 2 ;;
  esac
  out=$(bazel "${base[@]}" test "${config[@]}" --runs_per_test="$runs" -k \
          --test_env=CKPTD_PYTHON="$(cd .venv && pwd -P)/bin/python" "${targets[@]}" 2>&1)
  echo "$out" | tail -n 40
  for target in "${targets[@]}"; do
    # Bazel's summary: "//t:x  PASSED in ...", or "FAILED in 2 out of 5 in ..." / "FLAKY, failed in ...".
    line=$(echo "$out" | grep -E "^$target[[:space:]]" | tail -n 1)
    if [[ $line =~ failed\ in\ ([0-9]+)\ out\ of\ ([0-9]+) ]] || [[ $line =~ FAILED\ in\ ([0-9]+)\ out\ of\ ([0-9]+) ]]; then
      summary+=("$build $target: ${BASH_REMATCH[1]} of ${BASH_REMATCH[2]} runs failed")
      failed=1
    elif [[ $line =~ PASSED ]]; then
      summary+=("$build $target: $runs of $runs runs passed")
    else
      summary+=("$build $target: no result (${line:-not built})")
      failed=1
    fi
  done
done
printf '%s\n' "${summary[@]}"
exit $failed
