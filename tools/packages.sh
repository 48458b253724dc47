#!/usr/bin/env bash
# Builds what a cluster's users install, into dist/ (or the directory given):
#   ckptd_VERSION_amd64.deb              ckptd and ckptctl, the systemd unit, the config, the docs
#                                        (nothing of CUDA: the node's driver is loaded at run time)
#   libckpt-client-dev_VERSION_amd64.deb the C++ client: header, shared library, pkg-config
#                                        file and CMake package; nothing of the ckptd package
#   python3-ckptd_VERSION_amd64.deb      the Python package for Debian 12's python3
# Each package's Depends come from dpkg-shlibdeps on what it installs. tests/packaging/
# packages_test.sh installs them into a clean Debian 12 and builds a trainer against them.
# The wheels for pip (any current Linux, CPython 3.10 to 3.13) come from tools/wheels.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-dist}")
VERSION=0.1.0
bazel build //daemon:ckptd //client:ckptctl //client:shared/libckpt_client.so //client/python:ckptd
B=$(bazel info bazel-bin 2>/dev/null)
LIB=usr/lib/x86_64-linux-gnu
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$out"

# The Depends of a staged package: dpkg-shlibdeps on its ELF files.
depends() {
  local root=$1
  shift
  (cd "$stage" && mkdir -p debian && printf 'Source: ckptd\n\nPackage: ckptd\nArchitecture: amd64\n' > debian/control &&
   dpkg-shlibdeps -O --ignore-missing-info -l"$root/$LIB/ckptd" "$@" 2>/dev/null | sed -n 's/^shlibs:Depends=//p')
}

# control FIELDS... into $root/DEBIAN/control, then the .deb.
package() {
  local root=$1 name=$2 deps=$3 description=$4
  mkdir -p "$root/DEBIAN"
  cat > "$root/DEBIAN/control" <<CONTROL
Package: $name
Version: $VERSION
Architecture: amd64
Maintainer: ckptd developers <ckptd@localhost>
Section: admin
Priority: optional
Depends: $deps
Description: $description
CONTROL
  find "$root" -path "$root/DEBIAN" -prune -o -type f -print0 | xargs -0 chmod go-w
  dpkg-deb --root-owner-group --build "$root" "$out/${name}_${VERSION}_amd64.deb" >/dev/null
  echo "packages: $out/${name}_${VERSION}_amd64.deb"
}

# ckptd
P=$stage/ckptd
install -D -m 0755 "$B/daemon/ckptd" "$P/usr/bin/ckptd"
install -D -m 0755 "$B/client/ckptctl" "$P/usr/bin/ckptctl"
install -D -m 0644 deploy/systemd/ckptd.service "$P/lib/systemd/system/ckptd.service"
install -D -m 0644 deploy/ckptd.toml "$P/etc/ckptd/ckptd.toml"
install -D -m 0644 -t "$P/usr/share/doc/ckptd" README.md docs/*.md
mkdir -p "$P/DEBIAN"
echo /etc/ckptd/ckptd.toml > "$P/DEBIAN/conffiles"
cat > "$P/DEBIAN/postinst" <<'POSTINST'
#!/bin/sh
# The unit runs ckptd as user and group ckptd (trainers join the group to connect).
set -e
if [ "$1" = configure ] && ! getent passwd ckptd >/dev/null; then
  adduser --system --group --no-create-home --home /var/lib/ckptd ckptd >/dev/null
fi
if [ -d /run/systemd/system ]; then systemctl daemon-reload || true; fi
POSTINST
cat > "$P/DEBIAN/prerm" <<'PRERM'
#!/bin/sh
# Stopped before its files go (a running ckptd finishes its writes on SIGTERM).
set -e
if [ "$1" = remove ] && [ -d /run/systemd/system ]; then systemctl stop ckptd.service || true; fi
PRERM
cat > "$P/DEBIAN/postrm" <<'POSTRM'
#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then systemctl daemon-reload || true; fi
POSTRM
chmod 0755 "$P/DEBIAN/postinst" "$P/DEBIAN/prerm" "$P/DEBIAN/postrm"
package "$P" ckptd "$(depends "$P" -e"$P/usr/bin/ckptd" -e"$P/usr/bin/ckptctl"), adduser" \
  "per-node checkpoint daemon for GPU training
 ckptd copies trainers' registered buffers into its own memory at each checkpoint,
 releases the trainer, writes a sharded safetensors checkpoint in the background and
 commits it across nodes. Includes ckptctl and a hardened systemd unit (not enabled)."

# libckpt-client-dev
P=$stage/libckpt-client-dev
install -D -m 0644 client/ckpt_client.h "$P/usr/include/ckpt/ckpt_client.h"
install -D -m 0644 "$B/client/shared/libckpt_client.so" "$P/$LIB/libckpt_client.so.0"
ln -s libckpt_client.so.0 "$P/$LIB/libckpt_client.so"
mkdir -p "$P/$LIB/pkgconfig" "$P/$LIB/cmake/ckpt_client"
sed "s/@VERSION@/$VERSION/" packaging/ckpt_client.pc.in > "$P/$LIB/pkgconfig/ckpt_client.pc"
install -m 0644 packaging/ckpt_clientConfig.cmake "$P/$LIB/cmake/ckpt_client/"
sed "s/@VERSION@/$VERSION/" packaging/ckpt_clientConfigVersion.cmake.in > "$P/$LIB/cmake/ckpt_client/ckpt_clientConfigVersion.cmake"
# The client needs nothing of the ckptd package: the daemon may run in a container or on
# another install, and CUDA is the node's driver, loaded at run time.
client_deps=$(depends "$P" -e"$P/$LIB/libckpt_client.so.0")
package "$P" libckpt-client-dev "$client_deps, libabsl-dev, pkg-config" \
  "C++ client of ckptd (header, shared library, pkg-config file, CMake package)
 Trainers register their buffers with the ckptd on their node and checkpoint in
 microseconds of their own time: pkg-config --cflags --libs ckpt_client, or
 find_package(ckpt_client CONFIG) and ckpt_client::ckpt_client in CMake."

# python3-ckptd
P=$stage/python3-ckptd
mkdir -p "$P/usr/lib/python3/dist-packages/ckptd"
for f in "$B"/client/python/ckptd/*.py "$B/client/python/ckptd/_native.so"; do
  install -m 0644 "$f" "$P/usr/lib/python3/dist-packages/ckptd/"
done
chmod 0755 "$P/usr/lib/python3/dist-packages/ckptd/_native.so"
package "$P" python3-ckptd "$(depends "$P" -e"$P/usr/lib/python3/dist-packages/ckptd/_native.so"), python3 (>= 3.11), python3 (<< 3.12), ckptd (= $VERSION)" \
  "Python client of ckptd and its PyTorch checkpoint manager
 ckptd.torch.CheckpointManager saves and restores models, optimizers and train state
 through the ckptd on the node (PyTorch from python3-torch or pip)."

