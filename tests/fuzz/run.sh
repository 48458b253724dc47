#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (--config=fuzz, in an output base of its own) and
# runs each for CKPTD_FUZZ_SECONDS (default 30) over a scratch copy of its seed corpus
# (tests/fuzz/corpus/NAME/; every input there is replayed first, so a crash once found and
# added there is a regression test). Prints "fuzz NAME: passed (N runs)" or
# "fuzz NAME: FAILED ..." per target, with the crashing input kept under
# $CKPTD_FUZZ_ARTIFACTS (default /tmp/ckptd-fuzz-artifacts), and exits non-zero on any.
# CKPTD_FUZZ_JOBS targets at once (default: the cores).
# Long runs outside CI: CKPTD_FUZZ_SECONDS=3600 tests/fuzz/run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
seconds=${CKPTD_FUZZ_SECONDS:-30}
base=${CKPTD_FUZZ_OUTPUT_BASE:-$HOME/.cache/bazel_fuzz}
artifacts=${CKPTD_FUZZ_ARTIFACTS:-/tmp/ckptd-fuzz-artifacts}
names=(manifest_fuzzer safetensors_fuzzer payload_fuzzer request_fuzzer)
targets=()
for n in "${names[@]}"; do targets+=("//tests/fuzz:$n"); done

build_log=$(mktemp)
if ! bazel --output_base="$base" build --config=fuzz --symlink_prefix=/ "${targets[@]}" >"$build_log" 2>&1; then
  grep -v "ld.gold: warning" "$build_log" | tail -40
  rm -f "$build_log"
  for n in "${names[@]}"; do echo "fuzz $n: FAILED (build)"; done
  exit 2
fi
rm -f "$build_log"
bin="$(bazel --output_base="$base" info --config=fuzz bazel-bin 2>/dev/null)/tests/fuzz"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$artifacts"
# Runs one target and writes its verdict to $scratch/NAME.verdict (1 line, then the
# sanitizer's lines on a failure).
fuzz_one() {
  local n=$1 log="$scratch/$1.log" runs
  mkdir -p "$scratch/$n"
  cp tests/fuzz/corpus/"$n"/* "$scratch/$n/"
  if "$bin/$n" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
       -artifact_prefix="$artifacts/$n-" -print_final_stats=1 "$scratch/$n" >"$log" 2>&1; then
    runs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$')
    echo "fuzz $n: passed (${runs:-?} runs in ${seconds} s)" >"$scratch/$n.verdict"
  else
    { echo "fuzz $n: FAILED (input kept under $artifacts; add it to tests/fuzz/corpus/$n/ once fixed)"
      grep -aE "ERROR|SUMMARY|#[0-9]+ 0x|==[0-9]+==" "$log" | head -40; } >"$scratch/$n.verdict"
  fi
}
# Each target is one process on one core: CKPTD_FUZZ_JOBS of them at once (default: the
# machine's cores), so that the stage takes its per-target time about once per core, not
# once per target.
jobs=${CKPTD_FUZZ_JOBS:-$(nproc)}
running=0
for n in "${names[@]}"; do
  fuzz_one "$n" &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then wait -n; running=$((running - 1)); fi
done
wait
rc=0
for n in "${names[@]}"; do
  cat "$scratch/$n.verdict"
  grep -q "^fuzz $n: passed" "$scratch/$n.verdict" || rc=1
done
exit $rc
