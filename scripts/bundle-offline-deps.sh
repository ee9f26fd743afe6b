#!/usr/bin/env bash
# Bundles what an offline GPU machine lacks into git-ignored folders of the repository, so that
# the working tree copied there with .gtest and .deps builds the core and its GPU tests, not only
# the kernels. Such a machine has CUDA, CMake and ninja but no network, GoogleTest, Abseil,
# OpenSSL headers or xxHash; a Debian x86-64 machine with scripts/install-deps.sh has them all.
#
#   .gtest             GoogleTest's source (/usr/src/googletest), built by the top-level CMakeLists
#   .deps/absl/usr     Debian's Abseil: headers, shared libraries, CMake package config
#   .deps/openssl/usr  OpenSSL's headers and libcrypto (the prefix hashes' SHA-256)
#   .deps/xxhash/usr   xxHash's headers and library (the prefix hashes' XXH3)
#
# Each prefix keeps /usr's layout (include/, lib/x86_64-linux-gnu/), so Abseil's CMake config,
# which finds its files relative to itself, resolves inside the copy. tests/gpu/run_on_device.sh
# passes the prefixes to CMake (CMAKE_PREFIX_PATH) when .deps/absl exists.
#
# Run from anywhere; replaces earlier copies; prints the sizes (the tree and the bundle together
# are kept under 48 MiB, so that copying them stays quick).
#
#   scripts/bundle-offline-deps.sh
set -euo pipefail
cd "$(dirname "$0")/.."

arch=x86_64-linux-gnu  # the GPU machine's; Debian's multiarch directory for it
lib=/usr/lib/$arch
if [[ "$(uname -m)" != x86_64 ]]; then
  echo "bundle-offline-deps.sh: this machine is $(uname -m); the GPU machine needs x86-64 libraries" >&2
  exit 2
fi
missing=()
for p in /usr/src/googletest/CMakeLists.txt /usr/include/absl "$lib/cmake/absl/abslConfig.cmake" \
  /usr/include/openssl/sha.h "$lib/libcrypto.so" /usr/include/xxhash.h "$lib/libxxhash.so"; do
  [[ -e "$p" ]] || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "bundle-offline-deps.sh: missing ${missing[*]} (run scripts/install-deps.sh)" >&2
  exit 2
fi

# .gtest may be in use by a build: replaced only when it differs.
if ! diff -rq /usr/src/googletest .gtest >/dev/null 2>&1; then
  rm -rf .gtest
  cp -r /usr/src/googletest .gtest
fi
rm -rf .deps

# Abseil: the shared libraries (symbolic links kept: the config names the versioned files), not
# the static ones, which the config does not use.
absl=.deps/absl/usr
mkdir -p "$absl/include" "$absl/lib/$arch/cmake"
cp -r /usr/include/absl "$absl/include/"
cp -a "$lib"/libabsl_*.so* "$absl/lib/$arch/"
cp -r "$lib/cmake/absl" "$absl/lib/$arch/cmake/"

# OpenSSL: Debian splits the headers between include/openssl and the multiarch
# include/$arch/openssl (configuration.h, opensslconf.h); one include/openssl holds both here.
ssl=.deps/openssl/usr
mkdir -p "$ssl/include" "$ssl/lib/$arch"
cp -r /usr/include/openssl "$ssl/include/"
cp -r /usr/include/"$arch"/openssl/. "$ssl/include/openssl/"
cp -a "$lib"/libcrypto.so* "$ssl/lib/$arch/"

xxh=.deps/xxhash/usr
mkdir -p "$xxh/include" "$xxh/lib/$arch"
cp /usr/include/xxhash.h /usr/include/xxh3.h "$xxh/include/"
[[ -e /usr/include/xxh_x86dispatch.h ]] && cp /usr/include/xxh_x86dispatch.h "$xxh/include/"
cp -a "$lib"/libxxhash.so* "$xxh/lib/$arch/"

du -sh .gtest .deps/*
# What is copied: tracked files, untracked files git does not ignore, and the bundle.
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null |
  tail -n 1 | cut -f 1)
bundle_bytes=$(du -sb .gtest .deps | awk '{s += $1} END {print s}')
total=$((tree_bytes + bundle_bytes))
echo "working tree $((tree_bytes >> 10)) KiB + bundle $((bundle_bytes >> 10)) KiB = $((total >> 20)) MiB (limit 48 MiB)"
if ((total > 48 << 20)); then
  echo "bundle-offline-deps.sh: over 48 MiB with the tree; keep the copy small" >&2
  exit 1
fi
