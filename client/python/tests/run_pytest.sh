#!/usr/bin/env bash
# Runs the Python package's tests with Debian's interpreter and PyTorch, against the ckptd
# binary and the package Bazel built (both in this test's runfiles).
set -euo pipefail
cd "${TEST_SRCDIR:-.}/${TEST_WORKSPACE:-ckptd}"
export PYTHONPATH="$PWD/client/python"
export CKPTD_BIN="$PWD/daemon/ckptd"
exec /usr/bin/python3 -m pytest -p no:cacheprovider -q client/python/tests "$@"
