#!/usr/bin/env bash
# The packages as a cluster's users install them (issue 22 items 4 and 6): tools/packages.sh
# builds them, a clean Debian 12 (mmdebstrap, minbase) installs them with apt, which fetches
# their Depends from Debian's archive. The C++ client's package goes first and alone (it
# needs nothing of the ckptd package: issue 45 item 2): tests/packaging/trainer.cc is built
# against it outside Bazel twice, with pkg-config and with CMake's find_package(ckpt_client
# CONFIG), and both find every library before the ckptd package is installed. Then both
# trainers save and restore through the installed ckptd, started in that system.
# tests/packaging/image_test.sh does the same with the image tools/image.sh builds from the
# same package.
# Root (a chroot), and Debian's archive reachable. Prints "packages: passed" at the end.
set -euo pipefail
cd "$(dirname "$0")/../.."
work=$(mktemp -d /tmp/ckptd-packages.XXXXXX)
root=$work/root
cleanup() {
  [ -n "${daemon:-}" ] && kill "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null || true
  for m in dev/pts dev proc; do mountpoint -q "$root/$m" && umount -l "$root/$m"; done
  rm -rf "$work"
}
trap cleanup EXIT

# CKPTD_DIST: the packages tools/packages.sh built already (tools/test.sh builds them once
# for this test and image_test.sh).
if [ -n "${CKPTD_DIST:-}" ]; then
  cp -r "$CKPTD_DIST" "$work/dist"
else
  tools/packages.sh "$work/dist"
fi

# A clean Debian 12, kept between runs (it is the archive's, not ours).
base=${CKPTD_DEBIAN_TARBALL:-$HOME/.cache/ckptd/bookworm-minbase.tar}
if [ ! -f "$base" ] || [ ! -s "$base" ]; then
  rm -rf "$base" "$base.part.tar"
  mkdir -p "$(dirname "$base")"
  # mmdebstrap picks the output's format by its name: the partial file must end in .tar.
  mmdebstrap --quiet --variant=minbase bookworm "$base.part.tar"
  mv "$base.part.tar" "$base"
fi
mkdir -p "$root"
tar -xf "$base" -C "$root"
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
cp /etc/resolv.conf "$root/etc/resolv.conf"
cp -r "$work/dist" "$root/dist"
mkdir -p "$root/src"
cp tests/packaging/trainer.cc tests/packaging/CMakeLists.txt "$root/src/"
in_root() { chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root "$@"; }
apt_install() {
  in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

in_root apt-get update -qq
client=(/dist/libckpt-client-dev_0.1.0_amd64.deb)
# No CUDA library is linked by anything shipped (issue 45): readelf proves it of the client.
dpkg-deb -x "$work/dist/libckpt-client-dev_0.1.0_amd64.deb" "$work/client-deb"
if readelf -d "$work/client-deb/usr/lib/x86_64-linux-gnu/libckpt_client.so.0" | grep -qi 'NEEDED.*cuda'; then
  echo "packages: libckpt_client.so links a CUDA library" >&2
  exit 1
fi
apt_install "${client[@]}" g++ cmake make pkg-config
if in_root dpkg -s ckptd >/dev/null 2>&1; then
  echo "packages: libckpt-client-dev pulled in the ckptd package" >&2
  exit 1
fi
in_root sh -c 'g++ -O1 /src/trainer.cc $(pkg-config --cflags --libs ckpt_client) -o /trainer'
in_root sh -c 'cmake -S /src -B /build -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build /build >/dev/null'
for t in /trainer /build/trainer; do
  ! in_root ldd "$t" | grep "not found" || { echo "packages: $t lacks libraries" >&2; exit 1; }
done
apt_install /dist/ckptd_0.1.0_amd64.deb /dist/python3-ckptd_0.1.0_amd64.deb
in_root getent passwd ckptd >/dev/null  # the package made its user

mkdir -p "$root/run/ckptd"
chroot "$root" /usr/bin/ckptd --root /var/lib/ckptd --socket /run/ckptd/ckptd.sock --staging-bytes 64M \
  --prefault-staging false > "$work/ckptd.log" 2>&1 &
daemon=$!
for _ in $(seq 100); do in_root ckptctl --socket /run/ckptd/ckptd.sock health >/dev/null 2>&1 && break; sleep 0.1; done
in_root /trainer /run/ckptd/ckptd.sock save
in_root /trainer /run/ckptd/ckptd.sock | tee "$work/restore.out"
grep -q "restore: step 7 bit-exact" "$work/restore.out"
in_root ckptctl --socket /run/ckptd/ckptd.sock --job packaged list | grep -q "packaged  7"
# The CMake-built trainer restores the same step (its own save would be step 7 again).
in_root /build/trainer /run/ckptd/ckptd.sock | tee "$work/restore-cmake.out"
grep -q "restore: step 7 bit-exact" "$work/restore-cmake.out"
in_root python3 -c 'import ckptd, ckptd._native; print("python3-ckptd", ckptd.__file__)'
echo "packages: passed"
