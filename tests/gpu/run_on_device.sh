#!/usr/bin/env bash
# Builds the kernels and the GPU tests and runs `ctest -L gpu` on a machine with an NVIDIA GPU,
# nvcc, cmake and ninja, but no gRPC, Abseil or installed GoogleTest (without Abseil the top-level
# CMakeLists builds the kernels and their tests only).
#
# Run from the repository root, with GoogleTest's source tree in ./.gtest (git-ignored; e.g.
# `cp -r /usr/src/googletest .gtest`). Logs go to "$OUT" (default ./out). Extra arguments go to
# cmake's configure step (e.g. -DCMAKE_CUDA_ARCHITECTURES=80).
#
#   tests/gpu/run_on_device.sh [cmake args...]
#
# After the tests it builds and runs the CUDA decode-attention bench (gpu_attention_bench: log and
# CSV in "$OUT") and then bench/torch_sdpa_compare.py on the CSV's shapes (python3 with torch,
# where present). Both are bounded by `timeout` (KVBANK_BENCH_TIMEOUT_S, default 180 s each; reps
# KVBANK_BENCH_REPS, default 15; KVBANK_SKIP_BENCH=1 skips them); neither changes the exit status.
#
# Exit status: ctest's (0 when every gpu test passed or skipped), or non-zero when the build fails.
set -euo pipefail

OUT="${OUT:-$PWD/out}"
BUILD="${KVBANK_GPU_BUILD_DIR:-$PWD/build-gpu}"
mkdir -p "$OUT"
: >"$OUT/configure.log"

if [[ ! -f CMakeLists.txt || ! -d kernels ]]; then
  echo "run_on_device.sh: run me from the kvbank repository root" >&2
  exit 2
fi
if [[ ! -f .gtest/CMakeLists.txt ]]; then
  echo "run_on_device.sh: no GoogleTest source in $PWD/.gtest (cp -r /usr/src/googletest .gtest)" >&2
  exit 2
fi

{
  echo "== $(date -u +%FT%TZ) kvbank GPU tests at $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi || echo "nvidia-smi failed (no driver or no GPU)"
  nvcc --version | tail -n 2 || echo "nvcc not on PATH"
} 2>&1 | tee "$OUT/nvidia-smi.log"

configure() {
  cmake -S . -B "$BUILD" -G Ninja \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DKVBANK_BUILD_SERVICE=OFF -DKVBANK_BUILD_BENCH=OFF -DKVBANK_BUILD_TESTS=ON \
    -DKVBANK_ENABLE_CUDA=ON \
    "$@" 2>&1 | tee -a "$OUT/configure.log"
}

if ! configure -DKVBANK_GTEST_SOURCE_DIR="$PWD/.gtest" "$@"; then
  # NOTE: GoogleTest >= 1.11 defines GTest::gtest itself, which clashes with the top-level
  # CMakeLists' own alias of it. Until that is guarded, install .gtest into a prefix instead.
  if ! grep -q 'ALIAS target "GTest::gtest"' "$OUT/configure.log"; then
    echo "== configure failed; see $OUT/configure.log" >&2
    exit 1
  fi
  echo "== GTest:: alias clash: building GoogleTest from .gtest into a prefix" | tee -a "$OUT/configure.log"
  rm -rf "$BUILD"
  prefix="$BUILD-gtest/prefix"
  cmake -S .gtest -B "$BUILD-gtest" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_GMOCK=OFF \
    -DCMAKE_INSTALL_PREFIX="$prefix" 2>&1 | tee -a "$OUT/configure.log"
  cmake --build "$BUILD-gtest" --target install 2>&1 | tee -a "$OUT/configure.log"
  gtest_dir="$(dirname "$(find "$prefix" -name GTestConfig.cmake | head -n 1)")"
  configure "$@" -DCMAKE_DISABLE_FIND_PACKAGE_GTest=OFF -DGTest_DIR="$gtest_dir"
fi

ninja -C "$BUILD" -j"$(nproc)" gpu_block_copy_test gpu_quant_test gpu_attention_test 2>&1 | tee "$OUT/build.log"

set +e
ctest --test-dir "$BUILD" -L gpu --output-on-failure -V 2>&1 | tee "$OUT/ctest.log"
rc=${PIPESTATUS[0]}
set -e
if grep -q "No tests were found" "$OUT/ctest.log"; then
  echo "== no gpu test was registered (KVBANK_ENABLE_CUDA off?)" | tee -a "$OUT/ctest.log"
  rc=1
fi
echo "== ctest -L gpu exit code $rc" | tee -a "$OUT/ctest.log"

# Bench: reported, never fatal (the exit status stays ctest's).
if [[ "${KVBANK_SKIP_BENCH:-0}" != 1 ]]; then
  set +e
  bench_timeout="${KVBANK_BENCH_TIMEOUT_S:-180}"
  bench_reps="${KVBANK_BENCH_REPS:-15}"
  {
    echo "== $(date -u +%FT%TZ) gpu_attention_bench (reps $bench_reps, timeout ${bench_timeout}s)"
    ninja -C "$BUILD" gpu_attention_bench 2>&1 &&
      timeout "$bench_timeout" "$BUILD/bin/gpu_attention_bench" --reps "$bench_reps" \
        --csv "$OUT/gpu_attention_bench.csv" 2>&1
    echo "== gpu_attention_bench exit code $?"
  } | tee "$OUT/gpu_attention_bench.log"
  {
    echo "== $(date -u +%FT%TZ) torch_sdpa_compare (timeout ${bench_timeout}s)"
    PYTHONUNBUFFERED=1 timeout "$bench_timeout" python3 bench/torch_sdpa_compare.py \
      --csv "$OUT/gpu_attention_bench.csv" --reps "$bench_reps" 2>&1
    echo "== torch_sdpa_compare exit code $?"
  } | tee "$OUT/torch_sdpa_compare.log"
  set -e
fi
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv 2>/dev/null |
  tee -a "$OUT/nvidia-smi.log" || true
exit "$rc"
