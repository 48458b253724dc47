#!/usr/bin/env bash
# Runs the GPU tests, the GPU benchmark and the PyTorch check from a bundle made by
# tools/gpu_bundle.sh, each bounded in time, and writes their logs and JSON to OUT (default:
# ./gpu-out). On a GPU host, from the repository root:   tools/gpu_checks.sh /tmp/gpu-out
#   --cpu   the bundle's own test on a host without a GPU: the PyTorch check alone, on CPU
#           tensors at small sizes (tests/gpu/torch_bundle_test.sh)
# The PyTorch check runs under $CKPTD_GPU_PYTHON (default python3, which must have PyTorch 2)
# with the bundle's wheel for that Python unpacked beside it: nothing is installed.
# Exits non-zero when a test or check fails; a missing GPU makes the C++ tests print SKIPPED.
set -uo pipefail
cpu=0
if [ "${1:-}" = --cpu ]; then cpu=1; shift; fi
cd "$(dirname "$0")/../gpu-bundle"
bundle=$PWD
out=$(realpath -m "${1:-../gpu-out}")
mkdir -p "$out"
# The bundled tests find their helpers (gpu_trainer, ckptd, ckptctl) as runfiles here.
export TEST_SRCDIR=$(cd .. && pwd) TEST_WORKSPACE=gpu-bundle
export TMPDIR=${TMPDIR:-/tmp}
python=${CKPTD_GPU_PYTHON:-python3}
./run.sh true || { echo "gpu_checks: cannot unpack $bundle/payload.tar.xz"; exit 1; }
failed=0
step() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" ./run.sh "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || { failed=1; tail -n 40 "$out/$name.log"; }
}
if [ $cpu = 0 ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max \
    --format=csv >"$out/nvidia-smi.txt" 2>&1; cat "$out/nvidia-smi.txt"
  step cuda_copy_engine_test 90 tests/gpu/cuda_copy_engine_test --durations yes
  step gpu_integration_test 150 tests/gpu/gpu_integration_test --durations yes
  # The GPU benchmark alone; the host benchmark (tests/bench/ckpt_bench without --gpu-only)
  # is the same as on any machine.
  step ckpt_bench 200 tests/bench/ckpt_bench --ckptd daemon/ckptd --gpu-only --gpu-bytes "${GPU_BENCH_BYTES:-4G}"
  tail -n 40 "$out/ckpt_bench.log"
fi

# The Python package as pip would install it: the wheel for this Python, unpacked (a wheel
# is a zip; its vendored libraries are found through their own rpath).
tag=$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
wheel=$(ls "$bundle"/wheels/ckptd-*-"$tag"-"$tag"-manylinux*.whl 2>/dev/null | head -n 1)
if [ -z "$wheel" ]; then
  echo "torch_gpu_check: no wheel for $tag in the bundle ($(ls "$bundle/wheels" | tr '\n' ' '))"
  exit 1
fi
site=$(mktemp -d /tmp/ckptd-site.XXXXXX)
trap 'rm -rf "$site"' EXIT
"$python" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$wheel" "$site"
# The bundle's ckptd, with the bundle's libraries (which the Python process must not see).
printf '#!/bin/sh\nexec "%s/run.sh" "%s/daemon/ckptd" "$@"\n' "$bundle" "$bundle" > "$site/ckptd-daemon"
chmod +x "$site/ckptd-daemon"
if [ $cpu = 1 ]; then
  torch_args=(--device cpu --params 2M --loop-steps 6 --compile-backend aot_eager)
  limit=600
else
  torch_args=(--device cuda --params "${GPU_TORCH_PARAMS:-500M}")
  limit=420
fi
t0=$SECONDS
PYTHONPATH="$site" timeout --kill-after=10 $limit "$python" tests/gpu/torch_gpu_check.py \
  --ckptd "$site/ckptd-daemon" --out "$out" "${torch_args[@]}" >"$out/torch_gpu_check.log" 2>&1
rc=$?
echo "torch_gpu_check: rc=$rc in $((SECONDS - t0)) s"
[ $rc -eq 0 ] || { failed=1; tail -n 60 "$out/torch_gpu_check.log"; }
[ -f "$out/torch_gpu_check.json" ] && cat "$out/torch_gpu_check.json"
exit $failed
