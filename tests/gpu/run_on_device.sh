#!/usr/bin/env bash
# Builds the GPU tests and runs `ctest -L gpu` on a machine with an NVIDIA GPU, nvcc, cmake and
# ninja, but no gRPC, Abseil or installed GoogleTest.
#
# Run from the repository root, with GoogleTest's source tree in ./.gtest and, to build the core
# too, Abseil, OpenSSL and xxHash in ./.deps (both git-ignored; scripts/bundle-offline-deps.sh
# makes them on a Debian machine, to be copied along with the tree):
#   with .deps   the kernels, the core and every test labelled gpu: the kernel tests,
#                gpu_pool_memory_test and the store's tests on cuda:0 (KVBANK_TEST_MEMORY=cuda).
#                Should configuring with .deps fail, or not use its Abseil, the kernels only.
#   without      the kernels and their tests only (the top-level CMakeLists builds no core without
#                Abseil).
# Only the binaries the gpu tests run are built (ninja -k 0: what builds is tested, and a build
# failure still makes the exit status non-zero). Logs go to "$OUT" (default ./out). Extra
# arguments go to cmake's configure step (e.g. -DCMAKE_CUDA_ARCHITECTURES=80); KVBANK_CTEST_ARGS
# to ctest (e.g. "-E prefix_model"); KVBANK_CTEST_JOBS tests run at once (default 4).
#
#   tests/gpu/run_on_device.sh [cmake args...]
#
# With libnccl found, gpu_nccl_plane_test (label gpu) tests the NCCL plane's core on this GPU
# (a single-rank communicator sending to itself; two-rank cases need two GPUs) and
# gpu_nccl_bench (after the tests, gpu_nccl_bench.log) compares NCCL self send/recv with a
# device-to-device copy.
#
# After the tests it runs the CUDA IPC plane's benchmark (gpu_cuda_ipc_test's disabled
# CudaIpcBench: cuda_ipc_bench.log), pool_bench on cuda:0 and on host memory (with .deps: the store's append /
# fetch through the GPU data path; pool_bench.log), the CUDA decode-attention bench
# (gpu_attention_bench: log and CSV in "$OUT") and then bench/torch_sdpa_compare.py on the CSV's shapes (python3 with torch,
# where present). Both are bounded by `timeout` (KVBANK_BENCH_TIMEOUT_S, default 180 s each; reps
# KVBANK_BENCH_REPS, default 15; KVBANK_SKIP_BENCH=1 skips them); neither changes the exit status.
#
# Exit status: ctest's (0 when every gpu test passed or skipped), or non-zero when the
# configuration or the build fails.
set -euo pipefail

# A prebuilt bundle (scripts/bundle-device-service.sh) runs the service too, with no build here;
# KVBANK_DEVICE_BUILD=1 builds from source instead.
if [[ -f .svc/tests.tsv && "${KVBANK_DEVICE_BUILD:-0}" != 1 ]]; then
  exec "$(dirname "$0")/run_prebuilt_on_device.sh"
fi

OUT="${OUT:-$PWD/out}"
BUILD="${KVBANK_GPU_BUILD_DIR:-$PWD/build-gpu}"
mkdir -p "$OUT"
: >"$OUT/configure.log"

if [[ ! -f CMakeLists.txt || ! -d kernels ]]; then
  echo "run_on_device.sh: run me from the kvbank repository root" >&2
  exit 2
fi
if [[ ! -f .gtest/CMakeLists.txt ]]; then
  echo "run_on_device.sh: no GoogleTest source in $PWD/.gtest (scripts/bundle-offline-deps.sh)" >&2
  exit 2
fi

{
  echo "== $(date -u +%FT%TZ) kvbank GPU tests at $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi || echo "nvidia-smi failed (no driver or no GPU)"
  nvcc --version | tail -n 2 || echo "nvcc not on PATH"
} 2>&1 | tee "$OUT/nvidia-smi.log"

attempt_log="$(mktemp)"  # one configure's output (configure.log gathers them all)
trap 'rm -f "$attempt_log"' EXIT
configure() {
  cmake -S . -B "$BUILD" -G Ninja \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DKVBANK_BUILD_SERVICE=OFF -DKVBANK_BUILD_BENCH=ON -DKVBANK_BUILD_TESTS=ON \
    -DKVBANK_ENABLE_CUDA=ON \
    "$@" 2>&1 | tee "$attempt_log"
  local rc=${PIPESTATUS[0]}
  cat "$attempt_log" >>"$OUT/configure.log"
  return "$rc"
}

# configure with GoogleTest built from .gtest (or, on the alias clash, installed from it).
configure_with_gtest() {
  if configure -DKVBANK_GTEST_SOURCE_DIR="$PWD/.gtest" "$@"; then
    return 0
  fi
  # NOTE: GoogleTest >= 1.11 defines GTest::gtest itself, which clashed with the top-level
  # CMakeLists' own alias of it before that was guarded; then install .gtest into a prefix.
  grep -q 'ALIAS target "GTest::gtest"' "$attempt_log" || return 1
  echo "== GTest:: alias clash: building GoogleTest from .gtest into a prefix" | tee -a "$OUT/configure.log"
  rm -rf "$BUILD"
  local prefix="$BUILD-gtest/prefix"
  cmake -S .gtest -B "$BUILD-gtest" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_GMOCK=OFF \
    -DCMAKE_INSTALL_PREFIX="$prefix" 2>&1 | tee -a "$OUT/configure.log"
  cmake --build "$BUILD-gtest" --target install 2>&1 | tee -a "$OUT/configure.log"
  local gtest_dir
  gtest_dir="$(dirname "$(find "$prefix" -name GTestConfig.cmake | head -n 1)")"
  configure "$@" -DCMAKE_DISABLE_FIND_PACKAGE_GTest=OFF -DGTest_DIR="$gtest_dir"
}

# NCCL: the CUDA toolkit's where it has one, else the nvidia-nccl wheel of this machine's python3
# (PyTorch's images carry NCCL that way: headers in include/, only libnccl.so.2 in lib/).
nccl_args=()
cuda_include="$(dirname "$(command -v nvcc)")/../include"
if [[ ! -f $cuda_include/nccl.h ]]; then
  nccl_wheel="$(python3 -c 'import importlib.util as u; s = u.find_spec("nvidia.nccl")
print(next(iter(s.submodule_search_locations)) if s else "")' 2>/dev/null || true)"
  if [[ -n $nccl_wheel && -f $nccl_wheel/include/nccl.h && -f $nccl_wheel/lib/libnccl.so.2 ]]; then
    echo "== NCCL from the Python wheel at $nccl_wheel" | tee -a "$OUT/configure.log"
    export CPATH="$nccl_wheel/include${CPATH:+:$CPATH}"
    export LD_LIBRARY_PATH="$nccl_wheel/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    nccl_args=(-DKVBANK_NCCL_LIBRARY="$nccl_wheel/lib/libnccl.so.2")
  fi
fi
set -- "${nccl_args[@]}" "$@"

deps="$PWD/.deps"
arch=x86_64-linux-gnu
mode=kernels
if [[ -d "$deps/absl/usr" ]]; then
  echo "== configuring with Abseil, OpenSSL and xxHash from $deps" | tee -a "$OUT/configure.log"
  prefix="$deps/absl/usr;$deps/openssl/usr;$deps/xxhash/usr"
  if configure_with_gtest -DCMAKE_PREFIX_PATH="$prefix" "$@" &&
    grep -q "^absl_DIR:PATH=$deps/absl/" "$BUILD/CMakeCache.txt"; then
    mode=core
    # NOTE: the binaries' RUNPATH names the libraries they link directly, not what those need in
    # turn (one libabsl_* another), and this machine has no Abseil of its own.
    export LD_LIBRARY_PATH="$deps/absl/usr/lib/$arch${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  else
    echo "== configuring with $deps failed or did not use its Abseil: configuring without it" \
      "(the kernels only, unless this machine has an Abseil)" | tee -a "$OUT/configure.log"
    rm -rf "$BUILD"
  fi
fi
if [[ $mode == kernels ]] && ! configure_with_gtest -UCMAKE_PREFIX_PATH "$@"; then
  echo "== configure failed; see $OUT/configure.log" >&2
  exit 1
fi
if [[ $mode == kernels ]] && grep -q '^absl_DIR:PATH=/' "$BUILD/CMakeCache.txt"; then
  mode="core (this machine's Abseil)"
fi
grep -E '^(absl_DIR|OPENSSL_CRYPTO_LIBRARY|KVBANK_XXHASH_LIBRARY|GTest_DIR):' "$BUILD/CMakeCache.txt" |
  sed 's/^/== /' | tee -a "$OUT/configure.log" || true
echo "== build: $mode" | tee -a "$OUT/configure.log"

# The binaries of the tests labelled gpu, read from ctest's files (ctest itself names no command
# before the binary exists; awk implementations and CMake versions differ, so Python reads them).
# None found: everything is built.
gpu_binaries() {
  find "$BUILD" -name CTestTestfile.cmake -print0 | xargs -0 cat | python3 -c '
import re, sys
bin_dir = sys.argv[1] + "/bin/"
cmd, gpu = {}, set()
for line in sys.stdin:
    m = re.match(r"add_test\(\[=\[(.*?)\]=\]\s+\"([^\"]*)\"", line)
    if m:
        cmd[m.group(1)] = m.group(2)
    m = re.match(r"set_tests_properties\(\[=\[(.*?)\]=\].*\bLABELS\s+\"([^\"]*)\"", line)
    if m and "gpu" in m.group(2).split(";"):
        gpu.add(m.group(1))
print(" ".join(sorted({cmd[n][len(bin_dir):] for n in gpu if cmd.get(n, "").startswith(bin_dir)})))
' "$BUILD"
}
targets=$(gpu_binaries)
if [[ -z $targets ]]; then
  echo "== no gpu test binary read from $BUILD's CTestTestfile.cmake files: building everything" |
    tee -a "$OUT/configure.log"
  cp "$BUILD/tests/gpu/CTestTestfile.cmake" "$OUT/gpu-CTestTestfile.cmake" 2>/dev/null || true
  targets=all
fi
# The bench builds alongside (it runs after the tests).
if [[ "${KVBANK_SKIP_BENCH:-0}" != 1 ]]; then
  targets+=" gpu_attention_bench"
  [[ $mode == kernels ]] || targets+=" pool_bench"
  if ninja -C "$BUILD" -t targets all 2>/dev/null | grep -q '^gpu_nccl_bench:'; then
    targets+=" gpu_nccl_bench"
  fi
fi
echo "== building: ${targets:-(no gpu test registered)}" | tee "$OUT/build.log"
set +e
# shellcheck disable=SC2086  # one target per word
ninja -C "$BUILD" -k 0 -j"$(nproc)" $targets 2>&1 | tee -a "$OUT/build.log"
build_rc=${PIPESTATUS[0]}
set -e
[[ $build_rc == 0 ]] || echo "== build failed (exit code $build_rc); testing what built" | tee -a "$OUT/build.log"

set +e
# shellcheck disable=SC2086  # KVBANK_CTEST_ARGS: several words
ctest --test-dir "$BUILD" -L gpu --output-on-failure -V -j "${KVBANK_CTEST_JOBS:-4}" \
  ${KVBANK_CTEST_ARGS:-} 2>&1 | tee "$OUT/ctest.log"
rc=${PIPESTATUS[0]}
set -e
if grep -q "No tests were found" "$OUT/ctest.log"; then
  echo "== no gpu test was registered (KVBANK_ENABLE_CUDA off?)" | tee -a "$OUT/ctest.log"
  rc=1
fi
echo "== ctest -L gpu exit code $rc ($mode build)" | tee -a "$OUT/ctest.log"
if [[ $build_rc != 0 && $rc == 0 ]]; then rc=$build_rc; fi

# Bench: reported, never fatal (the exit status stays ctest's).
if [[ "${KVBANK_SKIP_BENCH:-0}" != 1 && -x "$BUILD/bin/pool_bench" ]]; then
  set +e
  {
    # The store's append / fetch through the cuda:0 data path (staging, H2D, scatter / quantize
    # kernels) against a host memcpy, then the same on host memory for the ratio between them.
    echo "== $(date -u +%FT%TZ) pool_bench --device cuda:0"
    timeout "${KVBANK_BENCH_TIMEOUT_S:-180}" "$BUILD/bin/pool_bench" --device cuda:0 --reps 7 2>&1
    echo "== pool_bench cuda:0 exit code $?"
    echo "== $(date -u +%FT%TZ) pool_bench --device host"
    timeout "${KVBANK_BENCH_TIMEOUT_S:-180}" "$BUILD/bin/pool_bench" --device host --reps 7 2>&1
    echo "== pool_bench host exit code $?"
  } | tee "$OUT/pool_bench.log"
  set -e
fi
if [[ "${KVBANK_SKIP_BENCH:-0}" != 1 && -x "$BUILD/bin/gpu_nccl_bench" ]]; then
  set +e
  {
    echo "== $(date -u +%FT%TZ) gpu_nccl_bench (NCCL self send/recv vs cudaMemcpy D2D)"
    timeout "${KVBANK_BENCH_TIMEOUT_S:-180}" "$BUILD/bin/gpu_nccl_bench" \
      --reps "${KVBANK_BENCH_REPS:-15}" 2>&1
    echo "== gpu_nccl_bench exit code $?"
  } | tee "$OUT/gpu_nccl_bench.log"
  set -e
fi
# The CUDA IPC plane: a pool -> device buffer fetch against cudaMemcpy device to device (goal:
# ratio >= 0.8), from gpu_cuda_ipc_test's disabled benchmark (with .deps only: it needs the core).
if [[ "${KVBANK_SKIP_BENCH:-0}" != 1 && -x "$BUILD/bin/gpu_cuda_ipc_test" ]]; then
  set +e
  {
    echo "== $(date -u +%FT%TZ) cuda_ipc_bench"
    timeout "${KVBANK_BENCH_TIMEOUT_S:-180}" "$BUILD/bin/gpu_cuda_ipc_test" \
      --gtest_filter='CudaIpcBench.*' --gtest_also_run_disabled_tests 2>&1
    echo "== cuda_ipc_bench exit code $?"
  } | tee "$OUT/cuda_ipc_bench.log"
  set -e
fi
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
    echo "== $(date -u +%FT%TZ) copy_bench: the host copy kernel (timeout ${bench_timeout}s)"
    ninja -C "$BUILD" copy_bench 2>&1 &&
      timeout "$bench_timeout" "$BUILD/bin/copy_bench" --reps 31 2>&1
    echo "== copy_bench exit code $?"
  } | tee "$OUT/copy_bench.log"
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
