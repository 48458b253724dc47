#!/usr/bin/env bash
# The packages as a cluster's users install them (issue 22 items 4 and 6): tools/packages.sh
# builds them, a clean Debian 12 (mmdebstrap, minbase) installs them with apt, which fetches
# their Depends from Debian's archive, a trainer is built against the installed client with
# pkg-config alone, and it saves and restores through the installed ckptd, started in that
# system. tests/packaging/image_test.sh does the same with the image tools/image.sh builds
# from the same package.
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
cp tests/packaging/trainer.cc "$root/trainer.cc"
in_root() { chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root "$@"; }

in_root apt-get update -qq
in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  /dist/ckptd_0.1.0_amd64.deb /dist/libckpt-client-dev_0.1.0_amd64.deb /dist/python3-ckptd_0.1.0_amd64.deb g++ >/dev/null
in_root getent passwd ckptd >/dev/null  # the package made its user
in_root sh -c 'g++ -O1 /trainer.cc $(pkg-config --cflags --libs ckpt-client) -o /trainer'

mkdir -p "$root/run/ckptd"
chroot "$root" /usr/bin/ckptd --root /var/lib/ckptd --socket /run/ckptd/ckptd.sock --staging-bytes 64M \
  --prefault-staging false > "$work/ckptd.log" 2>&1 &
daemon=$!
for _ in $(seq 100); do in_root ckptctl --socket /run/ckptd/ckptd.sock health >/dev/null 2>&1 && break; sleep 0.1; done
in_root /trainer /run/ckptd/ckptd.sock save
in_root /trainer /run/ckptd/ckptd.sock | tee "$work/restore.out"
grep -q "restore: step 7 bit-exact" "$work/restore.out"
in_root ckptctl --socket /run/ckptd/ckptd.sock --job packaged list | grep -q "packaged  7"
in_root python3 -c 'import ckptd, ckptd._native; print("python3-ckptd", ckptd.__file__)'
echo "packages: passed"
