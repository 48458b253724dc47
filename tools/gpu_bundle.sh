#!/usr/bin/env bash
# Builds ckptd's binaries and packs them, with every shared library that a stock CUDA +
# PyTorch image lacks (gRPC, Protobuf, Abseil, spdlog, fmt, xxhash...), into gpu-bundle/
# (at most 64 MiB), laid out like the workspace so that tests find each other. Binaries and
# libraries travel packed (payload.tar.xz); run.sh unpacks them on first use. On a GPU host:
#   cd gpu-bundle && ./run.sh tests/gpu/cuda_copy_engine_test
#   cd gpu-bundle && ./run.sh tests/gpu/gpu_integration_test
#   cd gpu-bundle && ./run.sh tests/bench/ckpt_bench --ckptd daemon/ckptd --json
# It also carries the Python package as manylinux wheels for CPython 3.11 (this machine's, for
# the bundle's CPU test) and 3.12 (the GPU machine's python3, which has PyTorch) and the
# PyTorch check tests/gpu/torch_gpu_check.py: tools/gpu_checks.sh runs them all.
set -euo pipefail
cd "$(dirname "$0")/.."
out=gpu-bundle
targets=(//daemon:ckptd //client:ckptctl //client:example_trainer //tests/bench:ckpt_bench
         //tests/gpu:cuda_copy_engine_test //tests/gpu:gpu_integration_test //tests/gpu:gpu_trainer
         //tests/integration:trainer_helper)
bazel build "$@" "${targets[@]}"  # e.g. -c opt for the benchmark
rm -rf "$out" && mkdir -p "$out/lib"
bins=()
for t in "${targets[@]}"; do
  path=${t#//}; rel="${path/://}"
  install -D -m 0755 "bazel-bin/$rel" "$out/$rel"
  strip --strip-debug "$out/$rel"
  bins+=("bazel-bin/$rel")  # resolve libraries where Bazel's relative rpaths still work
done
# Libraries every CUDA/PyTorch image has (glibc, the C++ runtime, the driver) stay out.
keep_out='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|librt\.so|libpthread\.so|libstdc\+\+|libgcc_s|libcuda\.so)'
for b in "${bins[@]}"; do
  ldd "$b" | awk '/=> \//{print $1, $3}' | while read -r name file; do
    [[ $name =~ $keep_out ]] && continue
    [ -e "$out/lib/$name" ] || { cp -L "$file" "$out/lib/$name"; strip --strip-debug "$out/lib/$name" 2>/dev/null || true; }
  done
done
# The Python package: the wheels pip users get (tools/wheels.sh), vendoring their libraries.
CKPTD_WHEEL_PYTHONS="311 312" tools/wheels.sh "$out/wheels" >/dev/null
install -D -m 0644 tests/gpu/torch_gpu_check.py "$out/tests/gpu/torch_gpu_check.py"
# Binaries and libraries packed (xz: 75 MiB unpacked would not travel to a GPU machine).
payload=(lib daemon client tests/bench tests/integration tests/gpu/cuda_copy_engine_test
         tests/gpu/gpu_integration_test tests/gpu/gpu_trainer)
XZ_OPT="-T2 -6" tar -C "$out" -cJf "$out/payload.tar.xz" "${payload[@]}"
(cd "$out" && rm -rf "${payload[@]}")
cat > "$out/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs a bundled binary with the bundle's libraries first on the search path, unpacking
# them first if need be (with Python's tarfile: no tar or xz needed on the host).
here=$(cd "$(dirname "$0")" && pwd)
if [ ! -d "$here/lib" ]; then
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
    "$here/payload.tar.xz" "$here" || exit 1
fi
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$@"
RUN
chmod +x "$out/run.sh"
size=$(du -sb "$out" | cut -f1)
echo "gpu-bundle: ${#bins[@]} binaries, $(tar -tJf "$out/payload.tar.xz" | grep -c '^lib/.') libraries, $(ls "$out/wheels" | wc -l) wheels, $((size / 1048576)) MiB packed"
if [ "$size" -gt $((64 * 1048576)) ]; then
  echo "gpu-bundle: larger than the 64 MiB a device run may carry" >&2
  exit 1
fi
