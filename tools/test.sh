#!/usr/bin/env bash
# The one command that runs every test: installs what is missing, builds, runs
# `bazel test //...`, and ends with the line "N passed, N failed, N skipped" counting test
# cases (GPU tests are skipped, and say so, on machines without a GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh || exit 1

bazel test //... -k --test_env=CKPTD_PYTHON="$PWD/.venv/bin/python" "$@"
bazel_rc=$?

passed=0
failed=0
skipped=0
while IFS= read -r target; do
  path=${target#//}
  log="bazel-testlogs/${path/://}/test.log"
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
  printf '%-60s %4d passed %4d failed %4d skipped\n' "$target" "$p" "$f" "$k"
  passed=$((passed + p))
  failed=$((failed + f))
  skipped=$((skipped + k))
done < <(bazel query 'tests(//...)' 2>/dev/null | sort)

if [ "$bazel_rc" -ne 0 ] && [ "$failed" -eq 0 ]; then
  failed=1  # the build itself failed
fi
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
