#!/usr/bin/env bash
# Quick start, part 2: install what is missing, build, and run the whole test suite: the format
# check, the release build's tests (unit, integration, python client, GPU tests that skip without
# a device, benchmark smoke runs) and the same suite under AddressSanitizer + UBSan.
# SKIP_SANITIZERS=1 skips the sanitizer pass (for a quick local run).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/check-format.sh
jobs=$(nproc)
cmake --preset release >/dev/null
cmake --build --preset release -j "$jobs"
ctest --preset release -j "$jobs"
if [ "${SKIP_SANITIZERS:-0}" != "1" ]; then
  cmake --preset asan-ubsan >/dev/null
  cmake --build --preset asan-ubsan -j "$jobs"
  ctest --preset asan-ubsan -j "$jobs"
fi
