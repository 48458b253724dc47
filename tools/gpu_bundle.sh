#!/usr/bin/env bash
# Builds ckptd's binaries and packs them, with every shared library that a stock CUDA +
# PyTorch image lacks (gRPC, Protobuf, Abseil, spdlog, fmt, xxhash...), into gpu-bundle/
# (at most 64 MiB), laid out like the workspace so that tests find each other. On a GPU host:
#   cd gpu-bundle && ./run.sh tests/gpu/cuda_copy_engine_test
#   cd gpu-bundle && ./run.sh tests/gpu/gpu_integration_test
#   cd gpu-bundle && ./run.sh tests/bench/ckpt_bench --ckptd daemon/ckptd --json
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
cat > "$out/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs a bundled binary with the bundle's libraries first on the search path.
here=$(cd "$(dirname "$0")" && pwd)
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$@"
RUN
chmod +x "$out/run.sh"
size=$(du -sb "$out" | cut -f1)
echo "gpu-bundle: ${#bins[@]} binaries, $(ls "$out/lib" | wc -l) libraries, $((size / 1048576)) MiB"
if [ "$size" -gt $((64 * 1048576)) ]; then
  echo "gpu-bundle: larger than the 64 MiB a device run may carry" >&2
  exit 1
fi
