#!/usr/bin/env bash
# Runs the GPU tests and the GPU benchmark from a bundle made by tools/gpu_bundle.sh, each
# bounded in time, and writes their logs and the benchmark's JSON to $1 (default: ./gpu-out).
# On a GPU host, from the repository root:   tools/gpu_checks.sh /tmp/gpu-out
# Exits non-zero when a test fails; a missing GPU makes the tests print SKIPPED.
set -uo pipefail
cd "$(dirname "$0")/../gpu-bundle"
out=${1:-../gpu-out}
mkdir -p "$out"
# The bundled tests find their helpers (gpu_trainer, ckptd, ckptctl) as runfiles here.
export TEST_SRCDIR=$(cd .. && pwd) TEST_WORKSPACE=gpu-bundle
export TMPDIR=${TMPDIR:-/tmp}
failed=0
step() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" ./run.sh "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || { failed=1; tail -n 40 "$out/$name.log"; }
}
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max \
  --format=csv >"$out/nvidia-smi.txt" 2>&1; cat "$out/nvidia-smi.txt"
step cuda_copy_engine_test 90 tests/gpu/cuda_copy_engine_test --durations yes
step gpu_integration_test 150 tests/gpu/gpu_integration_test --durations yes
# The GPU benchmark alone; the host benchmark (tests/bench/ckpt_bench without --gpu-only)
# is the same as on any machine.
step ckpt_bench 200 tests/bench/ckpt_bench --ckptd daemon/ckptd --gpu-only --gpu-bytes "${GPU_BENCH_BYTES:-4G}"
tail -n 40 "$out/ckpt_bench.log"
exit $failed
