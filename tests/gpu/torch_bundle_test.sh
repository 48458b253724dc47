#!/usr/bin/env bash
# The GPU bundle's own test on a host without a GPU (issue 45 item 4): tools/gpu_bundle.sh
# builds it (binaries and libraries packed, the 3.11 and 3.12 wheels, the PyTorch check) and
# must stay under the 64 MiB a device run carries; tools/gpu_checks.sh --cpu then runs the
# PyTorch check from it on CPU tensors with the project's PyTorch 2 (.venv, Python 3.11): the
# bundle's ckptd and the wheel as shipped, a trainer killed and resumed bit for bit from
# ckptd's memory and from disk, and the loop-overhead measure against DCP at small sizes.
# Prints "gpu bundle (cpu): passed" at the end.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(mktemp -d /tmp/ckptd-gpu-out.XXXXXX)
trap 'rm -rf "$out"' EXIT
tools/gpu_bundle.sh
CKPTD_GPU_PYTHON="$PWD/.venv/bin/python" tools/gpu_checks.sh --cpu "$out"
python3 - "$out/torch_gpu_check.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
for where in ("resume_from_memory", "resume_from_disk"):
    assert report[where]["bit_exact"], f"{where}: {report[where]}"
for label in ("eager", "compiled"):
    loop = report["loop_overhead"][label]
    assert "error" not in loop, f"{label}: {loop['error']}"
    for key in ("ckptd every 1", "ckptd every 10", "dcp.async_save/pinned every 1", "dcp.async_save/pinned every 10"):
        entry = loop.get(key, {})
        assert entry.get("step_s", 0) > 0 and "last_save" not in entry, f"{label} {key}: {entry}"
PY
echo "gpu bundle (cpu): passed"
