#!/usr/bin/env bash
# Quick start, part 2: install what is missing, build, and run the whole test suite: the format
# check, the Python lint (ruff, mypy), the release build's tests (unit, integration, python
# client, GPU tests that skip without a device, benchmark smoke runs), the same suite under
# AddressSanitizer + UBSan, the unit and integration tests under ThreadSanitizer (clang; its build
# also checks the lock annotations with -Wthread-safety -Werror), the fuzz targets
# (scripts/fuzz.sh: all of them at once for FUZZ_SECONDS of wall time, default 300) and the CUDA
# code on an emulated runtime.
# SKIP_SANITIZERS=1 skips the sanitizer, ThreadSanitizer and fuzz passes (for a quick local run).
set -euo pipefail
cd "$(dirname "$0")/.."
# Each stage's wall time, printed as it ends and again, all together, when the script exits
# (passed or not).
stage_log=()
run_start=$SECONDS
current=""
stage() {
  local name=$1 start=$SECONDS
  shift
  current=$name
  echo "== stage $name" >&2
  "$@"
  current=""
  stage_log+=("$(printf '%6d s  %s' $((SECONDS - start)) "$name")")
  echo "== stage $name: $((SECONDS - start)) s" >&2
}
summary() {
  local rc=$?
  echo "== stage times (wall)" >&2
  printf '%s\n' "${stage_log[@]}" >&2
  [ -z "$current" ] || echo "  failed in stage $current" >&2
  printf '%6d s  total (exit %d)\n' $((SECONDS - run_start)) "$rc" >&2
}
trap summary EXIT
stage install-deps scripts/install-deps.sh
stage check-format scripts/check-format.sh
# ruff and mypy over the Python SDK and its tests; 77: the tools could not be installed (offline).
lint_python() { scripts/lint-python.sh || [ $? -eq 77 ]; }
stage lint-python lint_python
jobs=$(nproc)
# The Python tests' venvs (the SDK's, vLLM's with torch, SGLang's: a copy of vLLM's) are mostly
# downloads: they are made while the release build compiles (their own locks keep the tests
# waiting for them; a failure here is the tests' to report, when they try again). Logs in build/.
mkdir -p build
py=/usr/bin/python3  # the interpreter ctest makes both venvs of (tests/python/CMakeLists.txt)
[ -x "$py" ] || py=$(command -v python3)
"$py" tests/python/run_python_tests.py --prepare --python "$py" >build/prepare-python-venv.log 2>&1 &
scripts/setup-vllm-venv.sh --no-kvbank --python "$py" >build/prepare-vllm-venv.log 2>&1 &
# LMCache's and SGLang's venvs are copies of vLLM's: their scripts wait for that one (the vLLM
# script's lock).
scripts/setup-lmcache-venv.sh --no-kvbank --python "$py" >build/prepare-lmcache-venv.log 2>&1 &
scripts/setup-sglang-venv.sh --no-kvbank --python "$py" >build/prepare-sglang-venv.log 2>&1 &
cmake --preset release >/dev/null
stage release-build cmake --build --preset release -j "$jobs"
stage release-tests ctest --preset release -j "$jobs" --output-on-failure
if [ "${SKIP_SANITIZERS:-0}" != "1" ]; then
  cmake --preset asan-ubsan >/dev/null
  stage asan-build cmake --build --preset asan-ubsan -j "$jobs"
  stage asan-tests ctest --preset asan-ubsan -j "$jobs" --output-on-failure
  # ThreadSanitizer: unit and integration tests. attention_test (label tsan-slow) runs only its
  # threaded cases there (attention_threads_test): its single-threaded reference sweeps take
  # minutes under TSan, and the release and ASan passes run them.
  cmake --preset tsan >/dev/null
  stage tsan-build cmake --build --preset tsan -j "$jobs"
  stage tsan-tests ctest --preset tsan -j "$jobs" --output-on-failure
  stage fuzz scripts/fuzz.sh "${FUZZ_SECONDS:-300}"
  # The CUDA code (kernels, cuda:N pool memory) under the GPU and store tests, on an emulated CUDA
  # runtime: index math, barriers and copy bounds are checked on a machine without a GPU.
  stage cuda-emu tools/cuda_emu/run.sh
fi
