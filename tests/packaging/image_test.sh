#!/usr/bin/env bash
# The image as a cluster runs it (issue 45 item 3): tools/image.sh builds it from Debian's
# archive alone (no base image), podman loads the OCI archive and runs ckptd from it the
# way the Kubernetes manifests do (the image's user 65532, entrypoint and command; a
# read-only root, no capabilities, the socket directory and the checkpoint root as
# volumes, the host's process namespace as the pod's shareProcessNamespace gives), the
# image's own ckptctl answers the health probe, and the example trainer, outside the
# container, trains through the mounted socket, is killed with SIGKILL after step 20 is
# committed and resumes from ckptd's memory; then a new container from the image
# restores step 30 from the checkpoint volume. Both resumed runs must end with the
# checksum of a run that never stopped. Prints the image's sizes, and "image: passed".
# Root, podman, runc, umoci, skopeo, mmdebstrap (tools/setup.sh) and Debian's archive.
#
# podman here: runc, not Debian's default crun (crun 1.8 refuses this machine's hybrid
# cgroups: "cgroups in hybrid mode not supported"); explicit rlimits (root here lacks
# CAP_SYS_RESOURCE, so podman's defaults, 1048576 open files, cannot be set); private
# storage (vfs) under the test's directory, so that nothing outside it is touched.
set -euo pipefail
cd "$(dirname "$0")/../.."
started=$SECONDS
work=$(mktemp -d /tmp/ckptd-image-test.XXXXXX)
name=ckptd-image-test-$$
podman=(podman --root "$work/storage" --runroot "$work/runroot" --tmpdir "$work/libpod" --storage-driver vfs
        --cgroup-manager cgroupfs --events-backend file --runtime "${CKPTD_PODMAN_RUNTIME:-runc}")
cleanup() {
  set +e
  [ -n "${trainer:-}" ] && kill -9 "$trainer" 2>/dev/null
  "${podman[@]}" rm --force --time 0 "$name" >/dev/null 2>&1
  "${podman[@]}" rmi --all --force >/dev/null 2>&1
  # Not `podman system reset`: it would reset the lock memory every podman here shares.
  awk -v w="$work/" 'index($2, w) == 1 {print $2}' /proc/mounts | sort -r | xargs -r -n1 umount -l
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "image: FAILED: $*" >&2
  "${podman[@]}" logs "$name" 2>&1 | tail -n 30 | sed 's/^/  ckptd: /' >&2 || true
  exit 1
}

# CKPTD_DIST: the packages tools/packages.sh built already (tools/test.sh builds them once
# for this test and packages_test.sh); a copy is used, since the image goes beside them.
mkdir -p "$work/dist"
if [ -n "${CKPTD_DIST:-}" ]; then
  cp "$CKPTD_DIST"/ckptd_*_amd64.deb "$work/dist/"
else
  tools/packages.sh "$work/dist" > "$work/build.log" 2>&1 ||
    { tail -n 30 "$work/build.log" >&2; fail "tools/packages.sh failed"; }
fi
bazel build //client:example_trainer > "$work/build.log" 2>&1 ||
  { tail -n 30 "$work/build.log" >&2; fail "the example trainer did not build"; }
trainer_bin=$(bazel info bazel-bin 2>/dev/null)/client/example_trainer
build_started=$SECONDS
tools/image.sh "$work/dist"
build_seconds=$((SECONDS - build_started))
archive=$(echo "$work"/dist/ckptd-image-*.oci.tar)
version=$(dpkg-deb --field "$work"/dist/ckptd_*_amd64.deb Version)
image=localhost/ckptd:$version

"${podman[@]}" load --quiet --input "$archive" >/dev/null
config=$("${podman[@]}" image inspect --format '{{.Config.User}} {{json .Config.Entrypoint}} {{json .Config.Cmd}}' "$image")
[ "$config" = '65532:65532 ["/usr/bin/ckptd"] ["--root=/ckpt","--socket=/run/ckptd/ckptd.sock"]' ] ||
  fail "the image's config is $config"
mapfile -t cmd < <("${podman[@]}" image inspect --format '{{range .Config.Cmd}}{{println .}}{{end}}' "$image" | sed '/^$/d')

# The volumes, owned by the image's user as fsGroup would make them.
mkdir -p "$work/run" "$work/ckpt"
chown 65532:65532 "$work/run" "$work/ckpt"
socket=$work/run/ckptd.sock
start_ckptd() {
  "${podman[@]}" run --detach --name "$name" --read-only --cap-drop ALL --security-opt no-new-privileges \
    --network host --pid host --ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit nproc=16384:16384 \
    --volume "$work/run:/run/ckptd" --volume "$work/ckpt:/ckpt" \
    "$image" "${cmd[@]}" --staging-bytes=64M --prefault-staging=false >/dev/null ||
    fail "podman could not start a container from $image"
  # The manifests' startup probe, with the image's own ckptctl.
  local deadline=$((SECONDS + 120))
  until "${podman[@]}" exec "$name" /usr/bin/ckptctl --socket /run/ckptd/ckptd.sock health --timeout 5 >/dev/null 2>&1; do
    [ "$("${podman[@]}" inspect --format '{{.State.Running}}' "$name" 2>/dev/null)" = true ] ||
      fail "ckptd exited in its container before it served"
    ((SECONDS < deadline)) || fail "ckptd in its container did not serve within 120 s"
    sleep 0.2
  done
  [ -S "$socket" ] || fail "ckptd serves, but its socket is not in the mounted directory ($socket)"
}
stop_ckptd() {
  "${podman[@]}" stop --time 60 "$name" >/dev/null
  local code
  code=$("${podman[@]}" inspect --format '{{.State.ExitCode}}' "$name")
  [ "$code" = 0 ] || fail "ckptd exited with $code on SIGTERM"
  "${podman[@]}" rm "$name" >/dev/null
}
trainer_args=(--socket "$socket" --job image --steps 30 --save-every 10 --state-bytes 4000000)
train() { "$trainer_bin" "${trainer_args[@]}" "$@"; }

want=$("$trainer_bin" --socket /nonexistent --job reference --steps 30 --save-every 10 --state-bytes 4000000 2>/dev/null |
       grep 'final checksum')

start_ckptd
: > "$work/first.log"
"$trainer_bin" "${trainer_args[@]}" --step-sleep-ms 100 > "$work/first.log" 2>&1 &  # $! is the trainer
trainer=$!
deadline=$((SECONDS + 120))
until grep -q "committed step=20" "$work/first.log"; do
  kill -0 "$trainer" 2>/dev/null || fail "the trainer ended before step 20 was committed: $(tail -n 5 "$work/first.log")"
  ((SECONDS < deadline)) || fail "step 20 was not committed within 120 s: $(tail -n 5 "$work/first.log")"
  sleep 0.05
done
kill -9 "$trainer"
wait "$trainer" 2>/dev/null || true
trainer=""
train --resume > "$work/resume.log" 2>&1 || fail "the resumed trainer failed: $(tail -n 5 "$work/resume.log")"
grep -q "resumed step=20 source=memory" "$work/resume.log" || fail "no resume from memory: $(head -n 3 "$work/resume.log")"
[ "$(grep 'final checksum' "$work/resume.log")" = "$want" ] ||
  fail "the resumed run differs from the uninterrupted one ($want): $(tail -n 1 "$work/resume.log")"
"${podman[@]}" exec "$name" /usr/bin/ckptctl --socket /run/ckptd/ckptd.sock --job image list | grep -q "image  30" ||
  fail "ckptctl list in the container does not show step 30"

# A new container from the image restores from the checkpoint volume.
stop_ckptd
start_ckptd
train --resume > "$work/disk.log" 2>&1 || fail "the trainer failed against a new container: $(tail -n 5 "$work/disk.log")"
grep -q "resumed step=30 source=disk" "$work/disk.log" || fail "no resume from disk: $(head -n 3 "$work/disk.log")"
[ "$(grep 'final checksum' "$work/disk.log")" = "$want" ] ||
  fail "the restored state differs from the uninterrupted run's ($want): $(tail -n 1 "$work/disk.log")"
stop_ckptd

compressed=$(du -m "$archive" | cut -f1)
unpacked=$("${podman[@]}" image inspect --format '{{.Size}}' "$image")
echo "image: $(basename "$archive"): ${compressed} MiB as an OCI archive, $((unpacked / 1048576)) MiB unpacked; built in ${build_seconds} s, the whole test in $((SECONDS - started)) s"
echo "image: passed"
