#!/usr/bin/env bash
# Fails when a tracked C++ / CUDA file is not clang-formatted (.clang-format, Google base).
set -euo pipefail
cd "$(dirname "$0")/.."
files=$(git ls-files '*.h' '*.cc' '*.cu' '*.cuh')
[ -z "$files" ] && exit 0
bad=$(for f in $files; do clang-format --dry-run -Werror "$f" >/dev/null 2>&1 || echo "$f"; done)
if [ -n "$bad" ]; then
  echo "check-format: not clang-formatted (run clang-format -i):"
  echo "$bad"
  exit 1
fi
echo "check-format: $(echo "$files" | wc -w) files formatted"
