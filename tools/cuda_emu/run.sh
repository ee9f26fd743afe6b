#!/usr/bin/env bash
# Runs kvbank's CUDA code on a CPU: the kernels (kernels/*.cu, rewritten by rewrite.py) and the
# cuda:N pool memory (server/core/cuda_memory.cc) built against an emulated CUDA runtime, under
# the GPU tests and the store tests with KVBANK_TEST_MEMORY=cuda. For a machine without a GPU: it
# checks index math, barriers, warp-op participation, pointer kinds and copy bounds, not speed,
# the GPU's memory model or nvcc's code generation (see README.md). scripts/test.sh runs it.
#
#   tools/cuda_emu/run.sh [ubsan] [TEST ...]     TEST: gpu_pool_memory_test, store_retention_test, ...
#
# Default: every GPU test and store test, EMU_ORDER=rand (threads and blocks in a shuffled order,
# so results that depend on scheduling or a missing barrier show). Outputs in build/cuda-emu.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
build="$root/build/cuda-emu"
san=()
if [[ "${1:-}" == ubsan ]]; then
  shift
  build="$root/build/cuda-emu-ubsan"
  san=(SAN="-fsanitize=undefined -fno-sanitize-recover=all -fno-sanitize=vptr")
fi
tests=("$@")
if [[ ${#tests[@]} == 0 ]]; then
  tests=(gpu_block_copy_test gpu_quant_test gpu_payload_codec_test gpu_attention_test
         gpu_pool_memory_test store_sequence_store_test store_quant_store_test
         store_quant_store_ops_test store_storage_format_test store_retention_test
         store_fp8_scale_test store_store_tenancy_test store_tiers_test)
fi
make -C "$here" -j"$(nproc)" BUILD="$build" "${san[@]}" "${tests[@]/#/$build/bin/}"
rc=0
for t in "${tests[@]}"; do
  echo "== $t (EMU_ORDER=${EMU_ORDER:-rand})"
  if ! EMU_ORDER="${EMU_ORDER:-rand}" KVBANK_TEST_MEMORY=cuda "$build/bin/$t" \
    ${KVBANK_EMU_GTEST_FILTER:+--gtest_filter="$KVBANK_EMU_GTEST_FILTER"}; then
    echo "== $t FAILED"
    rc=1
  fi
done
exit "$rc"
