#!/usr/bin/env bash
# Builds ckptd's container image from Debian's archive alone, with no base image from a
# registry:
#   1. mmdebstrap makes a Debian 12 root file system of the Essential packages (variant
#      essential: no apt in the image) and the ckptd package, whose Depends apt resolves
#      from the archive (the runtime libraries dpkg-shlibdeps found, and nothing else), plus
#      ca-certificates (ckptd's remote tier speaks HTTPS to S3). Documentation, manual
#      pages and translations are left out, the copyright files kept.
#   2. That file system, less the device nodes mmdebstrap adds to /dev (the container
#      runtime makes /dev), is the image's one layer; umoci writes it and the config:
#      user 65532:65532, entrypoint /usr/bin/ckptd, command --root=/ckpt
#      --socket=/run/ckptd/ckptd.sock (the two volumes, made in the image and owned by
#      65532, so that a fresh volume mounted there is writable by ckptd).
#   3. skopeo packs it into an OCI archive named ckptd:VERSION.
# Usage: tools/image.sh [DIR]   DIR (dist/ by default) holds ckptd_VERSION_amd64.deb from
# tools/packages.sh (built first when it is missing); writes DIR/ckptd-image-VERSION.oci.tar.
# Load it with `podman load -i`, push it with `skopeo copy oci-archive:FILE docker://...`
# (docs/operators.md, "Packages and the image"). tests/packaging/image_test.sh runs it.
# Needs root (mmdebstrap --mode=root), mmdebstrap, umoci, skopeo and python3, and Debian's
# archive; the packages it downloads are kept in CKPTD_IMAGE_APT_CACHE
# (~/.cache/ckptd/image-apt by default; apt checks them against the archive's index).
# SOURCE_DATE_EPOCH (the last commit's time by default) dates the files and the image.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(realpath -m "${1:-dist}")
shopt -s nullglob
debs=("$dir"/ckptd_*_amd64.deb)
if ((${#debs[@]} == 0)); then
  tools/packages.sh "$dir"
  debs=("$dir"/ckptd_*_amd64.deb)
fi
if ((${#debs[@]} != 1)); then
  echo "image: want exactly one ckptd_*_amd64.deb in $dir, found ${#debs[@]}: ${debs[*]:-none}" >&2
  exit 1
fi
deb=${debs[0]}
version=$(dpkg-deb --field "$deb" Version)
out=$dir/ckptd-image-$version.oci.tar
if [ "$(id -u)" != 0 ]; then
  echo "image: needs root (mmdebstrap writes a root file system owned by root)" >&2
  exit 1
fi
for tool in mmdebstrap umoci skopeo python3; do
  command -v "$tool" >/dev/null || { echo "image: $tool is missing (tools/setup.sh installs it)" >&2; exit 1; }
done
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}
created=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)
cache=${CKPTD_IMAGE_APT_CACHE:-$HOME/.cache/ckptd/image-apt}
mkdir -p "$cache"
work=$(mktemp -d /tmp/ckptd-image-build.XXXXXX)
trap 'rm -rf "$work"' EXIT

# 1. The root file system. The merged-usr hook installs usr-is-merged (not usrmerge, which
# would bring perl); file-mirror-automount makes the .deb visible inside the chroot; the
# sync hooks keep the downloaded packages between runs; ckptd --version run inside proves
# that every library it links is there. Its chatter is shown only when it fails.
mmdebstrap --quiet --mode=root --variant=essential \
  --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
  --hook-dir=/usr/share/mmdebstrap/hooks/file-mirror-automount \
  --include=ca-certificates --include="$deb" \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --skip=essential/unlink \
  --setup-hook='mkdir -p "$1/var/cache/apt/archives"' \
  --setup-hook="sync-in $cache /var/cache/apt/archives/" \
  --customize-hook="sync-out /var/cache/apt/archives $cache" \
  --customize-hook='mkdir -p "$1/ckpt" "$1/run/ckptd" && chown 65532:65532 "$1/ckpt" "$1/run/ckptd"' \
  --customize-hook='chroot "$1" /usr/bin/ckptd --version >/dev/null' \
  --skip=cleanup/run --customize-hook='find "$1/run" -mindepth 1 -not -path "$1/run/ckptd" -delete' \
  bookworm "$work/rootfs.tar" >"$work/mmdebstrap.log" 2>&1 || {
  tail -n 40 "$work/mmdebstrap.log" >&2
  echo "image: mmdebstrap failed (its log's end above)" >&2
  exit 1
}

# 2. The layer: mmdebstrap's tar without its device nodes (everything else verbatim,
# ownership and extended attributes included).
python3 - "$work/rootfs.tar" "$work/layer.tar" <<'PY'
import sys, tarfile
with tarfile.open(sys.argv[1]) as src, tarfile.open(sys.argv[2], "w", format=tarfile.PAX_FORMAT) as dst:
    for m in src:
        if m.name.startswith("./dev/") and m.name != "./dev/":
            continue
        dst.addfile(m, src.extractfile(m) if m.isreg() else None)
PY
rm "$work/rootfs.tar"
layout=$work/oci
umoci init --layout "$layout"
umoci new --image "$layout:$version"
umoci raw add-layer --image "$layout:$version" --history.created "$created" \
  --history.created_by "tools/image.sh: mmdebstrap bookworm, essential + $(basename "$deb") + ca-certificates" \
  "$work/layer.tar"
umoci config --image "$layout:$version" --created "$created" --history.created "$created" \
  --author "ckptd developers" --os linux --architecture amd64 \
  --config.user 65532:65532 --config.workingdir / \
  --config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --config.entrypoint /usr/bin/ckptd \
  --config.cmd=--root=/ckpt --config.cmd=--socket=/run/ckptd/ckptd.sock \
  --config.label org.opencontainers.image.title=ckptd \
  --config.label org.opencontainers.image.version="$version" \
  --config.label org.opencontainers.image.created="$created"
umoci gc --layout "$layout"

# 3. The archive, named so that `podman load` makes it localhost/ckptd:VERSION.
rm -f "$out"
skopeo copy --quiet "oci:$layout:$version" "oci-archive:$out:ckptd:$version"
echo "image: $out ($(du -m "$out" | cut -f1) MiB; unpacked $(($(tar -tvf "$work/layer.tar" | awk '{s += $3} END {print s}') / 1048576)) MiB)"
