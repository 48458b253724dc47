#!/usr/bin/env bash
# The shipped alerting rules are valid (promtool check rules) and each alert fires on the
# recorded series of ckptd-rules.test.yml and clears (promtool test rules). promtool comes
# with Debian's prometheus package (tools/setup.sh installs it).
set -euo pipefail
dir="$(dirname "$0")"  # the rules and their tests beside it (Bazel's runfiles, or the source tree)
if ! command -v promtool >/dev/null; then
  echo "rules_test: promtool not found: install Debian's prometheus package (tools/setup.sh does)" >&2
  exit 1
fi
# promtool resolves rule_files beside the test file: run in a copy of both.
work="${TEST_TMPDIR:-$(mktemp -d)}/rules"
mkdir -p "$work"
cp "$dir/ckptd-rules.yml" "$dir/ckptd-rules.test.yml" "$work/"
promtool check rules "$work/ckptd-rules.yml"
cd "$work"
promtool test rules ckptd-rules.test.yml
# The summary line tools/test.sh counts (as Catch2 prints it): each test group of the file is
# a case, with its alert checks.
cases=$(grep -c '^  - name:' ckptd-rules.test.yml)
checks=$(grep -c 'alertname:' ckptd-rules.test.yml)
echo "All tests passed ($checks alert checks in $cases test cases)"
