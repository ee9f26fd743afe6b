#!/usr/bin/env bash
# Runs a prebuilt bundle of kvbank (scripts/bundle-device-service.sh: .svc/bundle.tar.xz and
# .svc/tests.tsv) on a machine with an NVIDIA GPU and no gRPC, Abseil or GoogleTest: every test
# labelled gpu, the integration suites with kvbankd's pools on cuda:0, then the benchmarks. No
# build: the binaries are the release build of a Debian 12 machine with the same CUDA major
# version. tests/gpu/run_on_device.sh calls it when .svc/tests.tsv exists.
#
# Logs go to "$OUT" (default ./out): tests/<name>.log per test, summary.log (one line a test:
# PASS, FAIL or SKIP with the skip reason, and seconds), then the benchmarks' logs. Tests run
# KVBANK_CTEST_JOBS at once (default 6), each bounded by KVBANK_TEST_TIMEOUT_S (default 240);
# the benchmarks by KVBANK_BENCH_TIMEOUT_S (default 150) each, KVBANK_SKIP_BENCH=1 skips them.
# KVBANK_TESTS (a regular expression) runs only the tests whose names match.
#
# Exit status: 0 when every test passed or skipped, 1 when one failed or timed out.
set -euo pipefail

OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT/tests"
svc="${KVBANK_SVC_DIR:-/tmp/kvbank-svc}"
rm -rf "$svc"
mkdir -p "$svc"
python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
  .svc/bundle.tar.xz "$svc"

{
  echo "== $(date -u +%FT%TZ) kvbank prebuilt bundle: $(wc -l <.svc/tests.tsv) tests," \
    "tree at $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi || echo "nvidia-smi failed (no driver or no GPU)"
  nproc
} 2>&1 | tee "$OUT/nvidia-smi.log"

# Libraries: the bundle's, CUDA's runtime, and NCCL from the nvidia-nccl wheel where the CUDA
# toolkit has none (PyTorch's images).
lib_path="$svc/lib"
if command -v nvcc >/dev/null; then
  lib_path+=":$(dirname "$(command -v nvcc)")/../lib64"
fi
nccl_wheel="$(python3 -c 'import importlib.util as u; s = u.find_spec("nvidia.nccl")
print(next(iter(s.submodule_search_locations)) if s else "")' 2>/dev/null || true)"
[[ -n $nccl_wheel && -d $nccl_wheel/lib ]] && lib_path+=":$nccl_wheel/lib"
export LD_LIBRARY_PATH="$lib_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KVBANK_KVBANKD="$svc/bin/kvbankd"
if ldd "$KVBANK_KVBANKD" | grep "not found"; then
  echo "== kvbankd lacks libraries here (above): the tests that start it will fail" |
    tee "$OUT/missing-libraries.log"
fi

# One test: its environment, a timeout, a line in summary.log.
run_one() {
  local name=$1 env=$2 bin=$3
  shift 3
  local log="$OUT/tests/$name.log" start=$SECONDS rc=0
  local -a envs=()
  [[ $env != - ]] && IFS=, read -r -a envs <<<"$env"
  env "${envs[@]}" timeout "${KVBANK_TEST_TIMEOUT_S:-240}" "$svc/bin/$bin" "$@" >"$log" 2>&1 ||
    rc=$?
  local verdict=PASS
  if ((rc == 124)); then
    verdict="FAIL (timed out)"
  elif ((rc != 0)); then
    verdict="FAIL (exit $rc)"
  elif grep -q '^\[  PASSED  \] 0 tests' "$log" && grep -q '^\[  SKIPPED \]' "$log"; then
    verdict="SKIP ($(grep -m 1 -A 1 'Skipped$' "$log" | tail -n 1 | cut -c 1-120))"
  fi
  printf '%-44s %-60s %4d s\n' "$name" "$verdict" $((SECONDS - start)) >>"$OUT/summary.log"
}
: >"$OUT/summary.log"
jobs_max=${KVBANK_CTEST_JOBS:-6}
echo "== $(date -u +%FT%TZ) tests, $jobs_max at once" | tee -a "$OUT/nvidia-smi.log"
while IFS=$'\t' read -r -a f; do
  [[ ${f[0]} =~ ^(${KVBANK_TESTS:-.*})$ ]] || continue
  while (($(jobs -rp | wc -l) >= jobs_max)); do wait -n || true; done
  run_one "${f[@]}" &
done <.svc/tests.tsv
wait
sort -o "$OUT/summary.log" "$OUT/summary.log"
cat "$OUT/summary.log"
failed=$(grep -c ' FAIL ' "$OUT/summary.log" || true)
echo "== $(date -u +%FT%TZ) $(wc -l <"$OUT/summary.log") tests, $failed failed" |
  tee -a "$OUT/summary.log"

if [[ "${KVBANK_SKIP_BENCH:-0}" != 1 ]]; then
  t="${KVBANK_BENCH_TIMEOUT_S:-150}"
  reps="${KVBANK_BENCH_REPS:-7}"
  set +e
  # The same-host plane on this machine's cores: the default (one copy helper) and three.
  for helpers in 1 3; do
    echo "== $(date -u +%FT%TZ) shm_bench --reps 5 --region_copy_helpers=$helpers"
    timeout "$t" "$svc/bin/shm_bench" --reps 5 --kvbankd "$KVBANK_KVBANKD" \
      --server-arg "--region_copy_helpers=$helpers" 2>&1
    echo "== shm_bench exit code $?"
  done >"$OUT/shm_bench.log"
  {
    echo "== $(date -u +%FT%TZ) cuda_ipc_bench"
    timeout "$t" "$svc/bin/gpu_cuda_ipc_test" --gtest_filter='CudaIpcBench.*' \
      --gtest_also_run_disabled_tests 2>&1
    echo "== cuda_ipc_bench exit code $?"
  } >"$OUT/cuda_ipc_bench.log"
  if [[ -x $svc/bin/gpu_attention_bench ]]; then
    {
      echo "== $(date -u +%FT%TZ) gpu_attention_bench --reps $reps"
      timeout "$t" "$svc/bin/gpu_attention_bench" --reps "$reps" \
        --csv "$OUT/gpu_attention_bench.csv" 2>&1
      echo "== gpu_attention_bench exit code $?"
      echo "== $(date -u +%FT%TZ) torch_sdpa_compare"
      PYTHONUNBUFFERED=1 timeout "$t" python3 bench/torch_sdpa_compare.py \
        --csv "$OUT/gpu_attention_bench.csv" --reps "$reps" 2>&1
      echo "== torch_sdpa_compare exit code $?"
    } >"$OUT/gpu_attention_bench.log"
  fi
  if [[ -x $svc/bin/pool_bench ]]; then
    {
      echo "== $(date -u +%FT%TZ) pool_bench --device cuda:0"
      timeout "$t" "$svc/bin/pool_bench" --device cuda:0 --reps 5 2>&1
      echo "== pool_bench exit code $?"
    } >"$OUT/pool_bench.log"
  fi
  set -e
fi
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv 2>/dev/null |
  tee -a "$OUT/nvidia-smi.log" || true
[[ $failed == 0 ]]
