#!/usr/bin/env bash
# The one command that runs every test: installs what is missing, builds, runs
# `bazel test //...`, the integration suite again under ASan + UBSan and the unit and integration
# suites under TSan, the fuzzers, the benchmarks briefly, the packages and the wheels
# (tests/packaging/), and ends with the line "N passed, N failed, N skipped" counting test
# cases (GPU tests are skipped, and say so, on machines without a GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh || exit 1

# Huge-page arenas and copy-on-write snapshots run where the operator reserved a pool of
# huge pages (docs/operators.md); elsewhere ckptd falls back to base pages and copying, and
# the tests check whichever path the machine takes. So that both are tested, a root run on
# a machine without a pool reserves 1 GiB for its duration (CKPTD_KEEP_HUGEPAGES=1: don't).
if [ "$(id -u)" = 0 ] && [ "${CKPTD_KEEP_HUGEPAGES:-0}" != 1 ] && [ -w /proc/sys/vm/nr_hugepages ] &&
   [ "$(cat /proc/sys/vm/nr_hugepages)" = 0 ]; then
  echo 512 > /proc/sys/vm/nr_hugepages
  echo "reserved $(cat /proc/sys/vm/nr_hugepages) huge pages for this run"
  trap 'echo 0 > /proc/sys/vm/nr_hugepages' EXIT
fi

# How long each stage took, printed before the last line (CI keeps the suite under 45 min).
stage_times=()
stage_start=$SECONDS
stamp=$(mktemp /tmp/ckptd-test-stamp.XXXXXX)  # test logs newer than this are this run's
stage_done() { stage_times+=("$1: $((SECONDS - stage_start)) s"); stage_start=$SECONDS; }

# The virtual environment's interpreter by its real path (tools/setup.sh links .venv to one
# shared by every clone): the same test environment from any checkout, so Bazel's cached result
# of a test whose inputs did not change holds in a fresh clone too. CKPTD_RERUN_ALL=1 runs
# every test again in all three builds.
venv_python="$(cd .venv && pwd -P)/bin/python"
rerun=()
[ "${CKPTD_RERUN_ALL:-0}" != 1 ] || rerun=(--nocache_test_results)

# Every clone shares the output bases: runfiles that a deleted clone left behind are written
# again from this one (tools/forget_stale_runfiles.py says why).
forget_stale_runfiles() { [ ! -d "$1" ] || python3 tools/forget_stale_runfiles.py "$1"; }

forget_stale_runfiles "$(bazel info output_base 2>/dev/null)"
bazel test //... -k "${rerun[@]}" --test_env=CKPTD_PYTHON="$venv_python" "$@"
bazel_rc=$?
stage_done "bazel test //..."
main_logs="$(bazel info bazel-testlogs 2>/dev/null)"

# The integration suite again, built with AddressSanitizer and UBSan (.bazelrc --config=asan),
# in an output base of its own so that neither build evicts the other. CKPTD_SKIP_ASAN=1
# leaves it out (a quick local run); CI always runs it.
asan_base="${CKPTD_ASAN_OUTPUT_BASE:-$HOME/.cache/bazel_asan}"
asan_rc=0
if [ "${CKPTD_SKIP_ASAN:-0}" != 1 ]; then
  # --symlink_prefix=/: leave the workspace's bazel-* links pointing at the main build.
  forget_stale_runfiles "$asan_base"
  bazel --output_base="$asan_base" test --config=asan --symlink_prefix=/ //tests/integration/... -k \
    "${rerun[@]}" --test_env=CKPTD_PYTHON="$venv_python"
  asan_rc=$?
  asan_logs="$(bazel --output_base="$asan_base" info --config=asan bazel-testlogs 2>/dev/null)"
  stage_done "integration suite under ASan + UBSan"
fi

# The unit and integration suites again under ThreadSanitizer (.bazelrc --config=tsan; what
# it must not report of Debian's uninstrumented gRPC, Abseil and OpenSSL:
# third_party/tsan_suppressions.cc, linked into ckptd and every test and helper binary), in
# an output base of its own. Integration tests stretch their time bounds and shrink their
# largest states under TSan (kSanitizerSlowdown, tests/integration/harness.h).
# CKPTD_SKIP_TSAN=1 leaves it out.
tsan_base="${CKPTD_TSAN_OUTPUT_BASE:-$HOME/.cache/bazel_tsan}"
tsan_rc=0
if [ "${CKPTD_SKIP_TSAN:-0}" != 1 ]; then
  forget_stale_runfiles "$tsan_base"
  bazel --output_base="$tsan_base" test --config=tsan --symlink_prefix=/ //tests/unit/... //tests/integration/... -k \
    "${rerun[@]}" --test_env=CKPTD_PYTHON="$venv_python"
  tsan_rc=$?
  tsan_logs="$(bazel --output_base="$tsan_base" info --config=tsan bazel-testlogs 2>/dev/null)"
  stage_done "unit and integration suites under TSan"
fi

# The libFuzzer targets, each for a bounded time (CKPTD_FUZZ_SECONDS, 30 by default) over
# its seed corpus; CKPTD_SKIP_FUZZ=1 leaves them out.
fuzz_out=""
if [ "${CKPTD_SKIP_FUZZ:-0}" != 1 ]; then
  fuzz_out=$(tests/fuzz/run.sh 2>&1)
  echo "$fuzz_out"
  stage_done "fuzzers"
fi

# The benchmarks, each run briefly at small sizes so that none rots unnoticed (their real
# figures are in docs/benchmarks.md); CKPTD_SKIP_BENCH=1 leaves them out.
bench_lines=()
if [ "${CKPTD_SKIP_BENCH:-0}" != 1 ]; then
  for bench in "ckpt_bench:bazel-bin/tests/bench/ckpt_bench --ranks 1 --bytes-per-rank 16M --rounds 1 --skip-torch --latency-samples 10" \
               "group_bench:bazel-bin/tests/bench/group_bench --nodes 2,4 --rounds 5" \
               "group_scale:bazel-bin/tests/bench/group_bench scale --nodes 16 --tensors 2 --steps 1" \
               "group_scale_tree:bazel-bin/tests/bench/group_bench scale --nodes 40 --tensors 2 --steps 1 --fanout 4" \
               "group_scale_shared_root:bazel-bin/tests/bench/group_bench scale --nodes 16 --tensors 2 --steps 1 --shared-root" \
               "cow_bench:bazel-bin/tests/bench/cow_bench --mib 64" \
               "erasure_bench:bazel-bin/tests/bench/erasure_bench --mib 8 --rounds 1" \
               "replica_transport_bench:bazel-bin/tests/bench/replica_transport_bench --mib 4 --streams 2 --rounds 1" \
               "remote_bench:.venv/bin/python tests/bench/remote_bench.py --quick" \
               "replica_bench:.venv/bin/python tests/bench/replica_bench.py --quick" \
               "increment_bench:.venv/bin/python tests/bench/increment_bench.py --quick --bucket"; do
    name=${bench%%:*}
    if out=$(timeout 600 ${bench#*:} 2>&1); then
      echo "$out"
      bench_lines+=("bench $name: passed")
    else
      echo "$out"
      bench_lines+=("bench $name: FAILED")
    fi
  done
  stage_done "benchmarks (quick)"
fi

# The packages, built once (tools/packages.sh), installed into a clean Debian 12 with a
# trainer built against them (tests/packaging/packages_test.sh), and the image built from
# them with Debian's archive alone, ckptd run from it by podman and a trainer outside it
# (tests/packaging/image_test.sh); CKPTD_SKIP_PACKAGES=1 leaves both out.
package_lines=()
if [ "${CKPTD_SKIP_PACKAGES:-0}" != 1 ]; then
  dist=$(mktemp -d /tmp/ckptd-dist.XXXXXX)
  if out=$(tools/packages.sh "$dist" 2>&1); then
    for t in packages image; do
      if out=$(CKPTD_DIST=$dist timeout 1200 tests/packaging/${t}_test.sh 2>&1); then
        package_lines+=("$t: passed")
      else
        package_lines+=("$t: FAILED")
      fi
      echo "$out" | tail -n 30
      stage_done "$t test$([ "$t" = packages ] && echo ' (with tools/packages.sh)')"
    done
  else
    echo "$out" | tail -n 30
    package_lines=("packages: FAILED" "image: FAILED")
  fi
  rm -rf "$dist"
fi

# The manylinux wheels, each installed into a fresh virtual environment of its Python and the
# 3.11 one into a bare Debian 12, saving, killed and resuming through ckptd
# (tests/packaging/wheels_test.sh); CKPTD_SKIP_WHEELS=1 leaves it out.
wheels_out=""
wheels_rc=0
if [ "${CKPTD_SKIP_WHEELS:-0}" != 1 ]; then
  wheels_out=$(timeout 1200 tests/packaging/wheels_test.sh 2>&1) || wheels_rc=1
  if [ "$wheels_rc" = 0 ]; then grep -E '^wheels: ' <<< "$wheels_out"; else tail -n 40 <<< "$wheels_out"; fi
  stage_done "wheels"
fi

# The GPU bundle as it travels to a GPU machine (tools/gpu_bundle.sh), its PyTorch check run
# here on CPU tensors (tests/gpu/torch_bundle_test.sh); CKPTD_SKIP_BUNDLE=1 leaves it out.
bundle_line=""
if [ "${CKPTD_SKIP_BUNDLE:-0}" != 1 ]; then
  if out=$(timeout 1200 tests/gpu/torch_bundle_test.sh 2>&1); then
    bundle_line="passed"
  else
    bundle_line="FAILED"
  fi
  echo "$out" | tail -n 30
  stage_done "gpu bundle (cpu)"
fi

passed=0
failed=0
skipped=0
failed_logs=()
# Adds up one test log: Catch2's or pytest's summary, and "SKIPPED:" lines.
report() {
  local target=$1 log=$2 label=$3
  local summary pytest_summary p f k
  summary=$(grep -aE "^All tests passed|^test cases:" "$log" 2>/dev/null | tail -n 1)
  # pytest's last line: "2 failed, 8 passed, 1 skipped in 28.34s" (Python package tests).
  pytest_summary=$(grep -aE "^=* ?[0-9]+ (passed|failed|error).* in [0-9.]+s" "$log" 2>/dev/null | tail -n 1)
  count() { [[ $pytest_summary =~ ([0-9]+)\ $1 ]] && echo "${BASH_REMATCH[1]}" || echo 0; }
  if [[ $summary =~ All\ tests\ passed.*in\ ([0-9]+)\ test\ case ]]; then
    p=${BASH_REMATCH[1]}; f=0
  elif [[ $summary =~ test\ cases:\ +([0-9]+)\ \|\ +([0-9]+)\ passed(\ \|\ +([0-9]+)\ failed)? ]]; then
    p=${BASH_REMATCH[2]}; f=${BASH_REMATCH[4]:-0}
  elif [ -n "$pytest_summary" ]; then
    p=$(count passed); f=$(( $(count failed) + $(count error) ))
    # A test run killed mid-way (timeout) prints no summary: counted as failed below.
  else
    p=0; f=1  # crashed or timed out before Catch2 could report
  fi
  # A test case that cannot run here (a GPU test without a GPU) prints "SKIPPED: why";
  # pytest counts its own.
  k=$(grep -ac "^SKIPPED:" "$log" 2>/dev/null)
  k=${k:-0}
  if [ -n "$pytest_summary" ]; then k=$(count skipped); p=$((p + k)); fi
  p=$((p > k ? p - k : 0))
  printf '%-60s %4d passed %4d failed %4d skipped\n' "$target$label" "$p" "$f" "$k"
  [ "$f" -eq 0 ] || failed_logs+=("$target$label|$log")
  passed=$((passed + p))
  failed=$((failed + f))
  skipped=$((skipped + k))
}

while IFS= read -r target; do
  path=${target#//}
  report "$target" "$main_logs/${path/://}/test.log" ""
done < <(bazel query 'tests(//...)' 2>/dev/null | sort)
if [ "${CKPTD_SKIP_ASAN:-0}" != 1 ]; then
  while IFS= read -r target; do
    path=${target#//}
    report "$target" "$asan_logs/${path/://}/test.log" " (asan)"
  done < <(bazel query 'tests(//tests/integration/...)' 2>/dev/null | sort)
fi
if [ "${CKPTD_SKIP_TSAN:-0}" != 1 ]; then
  while IFS= read -r target; do
    path=${target#//}
    report "$target" "$tsan_logs/${path/://}/test.log" " (tsan)"
  done < <(bazel query 'tests(//tests/unit/...) + tests(//tests/integration/...)' 2>/dev/null | sort)
fi

while IFS= read -r line; do
  if [[ $line =~ ^fuzz\ ([a-z_]+):\ passed ]]; then
    printf '%-60s %4d passed %4d failed %4d skipped\n' "//tests/fuzz:${BASH_REMATCH[1]} (30 s)" 1 0 0
    passed=$((passed + 1))
  elif [[ $line =~ ^fuzz\ ([a-z_]+):\ FAILED ]]; then
    printf '%-60s %4d passed %4d failed %4d skipped\n' "//tests/fuzz:${BASH_REMATCH[1]}" 0 1 0
    failed=$((failed + 1))
  fi
done <<< "$fuzz_out"
for line in "${bench_lines[@]}"; do
  if [[ $line =~ ^bench\ ([a-z_]+):\ passed ]]; then
    printf '%-60s %4d passed %4d failed %4d skipped\n' "//tests/bench:${BASH_REMATCH[1]} (quick)" 1 0 0
    passed=$((passed + 1))
  else
    printf '%-60s %4d passed %4d failed %4d skipped\n' "//tests/bench:${line#bench }" 0 1 0
    failed=$((failed + 1))
  fi
done

for line in "${package_lines[@]}"; do
  if [[ $line == *": passed" ]]; then
    printf '%-60s %4d passed %4d failed %4d skipped\n' "//tests/packaging:${line%%:*}_test.sh" 1 0 0
    passed=$((passed + 1))
  else
    printf '%-60s %4d passed %4d failed %4d skipped\n' "//tests/packaging:${line%%:*}_test.sh" 0 1 0
    failed=$((failed + 1))
  fi
done

if [ "${CKPTD_SKIP_WHEELS:-0}" != 1 ]; then
  # A case each: the wheels' tag as documented, and each install's save, kill and resume.
  p=$(grep -cE '^wheels: (tag .*docs/python.md says so|.*resumed bit-exact|wheel-torch: .*resumed from step 30)' <<< "$wheels_out" || true)
  printf '%-60s %4d passed %4d failed %4d skipped\n' "//tests/packaging:wheels_test.sh" "$p" "$wheels_rc" 0
  passed=$((passed + p))
  failed=$((failed + wheels_rc))
fi

if [ -n "$bundle_line" ]; then
  if [ "$bundle_line" = passed ]; then p=1; f=0; else p=0; f=1; fi
  printf '%-60s %4d passed %4d failed %4d skipped\n' "//tests/gpu:torch_bundle_test.sh (cpu)" "$p" "$f" 0
  passed=$((passed + p))
  failed=$((failed + f))
fi

# Why each failed target failed, where only the end of this output may be kept (a CI log):
# the end of its log, which holds pytest's or Catch2's failures or Bazel's TIMEOUT.
for entry in "${failed_logs[@]}"; do
  echo "--- ${entry%%|*}: the end of ${entry#*|}"
  tail -n 40 "${entry#*|}" 2>/dev/null | cut -c1-400
done

# The slowest test targets of each build (Bazel's test.xml), so that a CI log, of which only
# the end may be kept, says where the time went.
slowest() {
  local label=$1 logs=$2
  [ -d "$logs" ] || return 0
  local top
  top=$(find "$logs" -name test.xml -newer "$stamp" 2>/dev/null | while read -r f; do
          t=$(grep -o 'time="[0-9.]*"' "$f" | head -n 1 | tr -dc '0-9.')
          rel=${f#"$logs"/}
          echo "${t%.*} ${rel%/test.xml}"
        done | sort -rn | head -n 5 | awk '{printf "%s%s %s s", (NR > 1 ? ", " : ""), $2, $1}')
  [ -z "$top" ] || echo "slowest ($label): $top"
}
slowest plain "$main_logs"
[ "${CKPTD_SKIP_ASAN:-0}" = 1 ] || slowest asan "$asan_logs"
[ "${CKPTD_SKIP_TSAN:-0}" = 1 ] || slowest tsan "$tsan_logs"
rm -f "$stamp"
for t in "${stage_times[@]}"; do echo "stage $t"; done
if { [ "$bazel_rc" -ne 0 ] || [ "$asan_rc" -ne 0 ] || [ "$tsan_rc" -ne 0 ]; } && [ "$failed" -eq 0 ]; then
  failed=1  # a build itself failed
fi
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
