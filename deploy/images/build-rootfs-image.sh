#!/usr/bin/env bash
# Builds the CPU image without pulling a base image: a Debian 12 root filesystem made from
# Debian's packages by debootstrap, kvbankd and the kvbank CLI of a local build (on Debian 12,
# so the libraries match) installed into it, packed as an OCI image by buildah.
#
#   cmake --preset release && cmake --build --preset release --target kvbankd kvbank
#   sudo deploy/images/build-rootfs-image.sh [--build-dir build/release] \
#        [--tag kvbank/kvbankd-cpu:0.1.0] [--output kvbankd-cpu.oci.tar]
#
# Needs root (debootstrap chroots), the Debian packages debootstrap and buildah, and the Debian
# archive (MIRROR, default http://deb.debian.org/debian). Writes an OCI archive; load it with
# `podman load -i FILE` or `skopeo copy oci-archive:FILE docker://REGISTRY/...`.
set -euo pipefail

root_dir=$(cd "$(dirname "$0")/../.." && pwd)
build_dir="$root_dir/build/release"
tag="kvbank/kvbankd-cpu:0.1.0"
output="$root_dir/build/kvbankd-cpu.oci.tar"
mirror="${MIRROR:-http://deb.debian.org/debian}"
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) build_dir=$2; shift 2 ;;
    --tag) tag=$2; shift 2 ;;
    --output) output=$2; shift 2 ;;
    *) echo "usage: $0 [--build-dir DIR] [--tag NAME:TAG] [--output FILE]" >&2; exit 2 ;;
  esac
done
# The runtime libraries of kvbankd and kvbank (as in Containerfile.cpu's runtime stage).
runtime_packages=libgrpc++1.51,libgrpc29,libprotobuf32,libabsl20220623,libssl3,libxxhash0
runtime_packages+=,libc-ares2,libre2-9,zlib1g

for tool in debootstrap buildah; do
  command -v "$tool" >/dev/null || { echo "$0: needs $tool (apt-get install $tool)" >&2; exit 1; }
done
[ "$(id -u)" -eq 0 ] || { echo "$0: debootstrap needs root" >&2; exit 1; }
for bin in kvbankd kvbank; do
  [ -x "$build_dir/bin/$bin" ] || { echo "$0: no $build_dir/bin/$bin: build it first" >&2; exit 1; }
done
if ldd "$build_dir/bin/kvbankd" | grep -q -E 'libcudart|libnccl'; then
  echo "$0: $build_dir/bin/kvbankd links CUDA; configure with -DKVBANK_ENABLE_CUDA=OFF" >&2
  exit 1
fi

work=$(mktemp -d)
ctr=""
cleanup() {
  [ -n "$ctr" ] && buildah rm "$ctr" >/dev/null 2>&1
  rm -rf "$work"
}
trap cleanup EXIT
rootfs="$work/rootfs"

echo "== debootstrap bookworm (minbase + runtime libraries) from $mirror"
debootstrap --variant=minbase --include="$runtime_packages" bookworm "$rootfs" "$mirror" \
  >"$work/debootstrap.log" 2>&1 || { tail -30 "$work/debootstrap.log" >&2; exit 1; }

echo "== installing kvbankd and kvbank"
install -D -m 0755 -s "$build_dir/bin/kvbankd" "$rootfs/usr/local/bin/kvbankd"
install -D -m 0755 -s "$build_dir/bin/kvbank" "$rootfs/usr/local/bin/kvbank"
# Every library resolves inside the new root, not the build host.
if chroot "$rootfs" ldd /usr/local/bin/kvbankd /usr/local/bin/kvbank | grep 'not found'; then
  echo "$0: libraries missing from the root filesystem" >&2
  exit 1
fi
chroot "$rootfs" /usr/local/bin/kvbankd --help >/dev/null

echo "== trimming (apt lists and caches, documentation, locales, logs)"
rm -rf "$rootfs"/var/cache/apt/* "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/log/* \
  "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
  "$rootfs"/usr/share/locale/* "$rootfs"/tmp/*
# A fixed date for the files (reproducible layers) and a root tarball in one layer.
tar --numeric-owner --sort=name --mtime='2026-01-01 00:00:00' -C "$rootfs" -cf "$work/rootfs.tar" .

echo "== packing with buildah"
ctr=$(buildah from scratch)
buildah add "$ctr" "$work/rootfs.tar" / >/dev/null
buildah config --user 65532:65532 --workingdir / \
  --port 50051 --port 50052 --port 9400 \
  --entrypoint '["/usr/local/bin/kvbankd"]' --cmd '' \
  --label org.opencontainers.image.title=kvbankd \
  --label org.opencontainers.image.description="kvbank KV-cache server (host-memory pools)" \
  --os linux --arch amd64 "$ctr"
mkdir -p "$(dirname "$output")"
rm -f "$output"
buildah commit --format oci --rm "$ctr" "oci-archive:$output:$tag" >/dev/null
ctr=""
echo "== $output ($tag): $(du -h "$output" | cut -f1) archive (one uncompressed layer)," \
  "root filesystem $(du -sh "$rootfs" | cut -f1)"
