#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz (CMake preset `fuzz`: clang, ASan + UBSan, in
# build/fuzz) and runs each for SECONDS from its seed corpus (tests/fuzz/corpus/<target>; what a
# run finds goes to build/fuzz/corpus/<target>, the seeds are never written). Prints the
# executions of each target and their total; fails when any target crashes, leaks, times out
# or breaks one of its properties (the input is then in build/fuzz/artifacts/).
#   scripts/fuzz.sh [SECONDS]   SECONDS per target, default 60; FUZZ_JOBS targets at a time
#                               (default: all eight, sharing the cores: SECONDS is then the wall
#                               time of the whole run, and no core idles while one target ends)
#   scripts/fuzz.sh --seeds     rewrites the seed corpora (tests/fuzz/fuzz_seeds.cc)
set -euo pipefail
cd "$(dirname "$0")/.."
targets=(append_message_fuzz fetch_decoder_fuzz auth_tokens_fuzz server_config_fuzz
         prefix_hash_fuzz shm_hello_fuzz metrics_http_fuzz shm_control_fuzz)
jobs=${FUZZ_JOBS:-${#targets[@]}}
cmake --preset fuzz >/dev/null
if [ "${1:-}" = "--seeds" ]; then
  cmake --build --preset fuzz --target fuzz_seeds
  for t in "${targets[@]}"; do rm -rf "tests/fuzz/corpus/$t" && mkdir -p "tests/fuzz/corpus/$t"; done
  build/fuzz/bin/fuzz_seeds tests/fuzz/corpus
  exit 0
fi
seconds=${1:-60}
cmake --build --preset fuzz -j "$(nproc)" --target "${targets[@]}"

out=build/fuzz/runs
rm -rf "$out" build/fuzz/artifacts
mkdir -p "$out" build/fuzz/artifacts
# Each target alone, `jobs` at a time: a fixed time each, 10 s at most for one input, inputs
# of up to 1 KiB, 2 GiB of memory.
run() {
  local t=$1
  mkdir -p "build/fuzz/corpus/$t"
  build/fuzz/bin/"$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=1024 \
    -print_final_stats=1 -artifact_prefix="build/fuzz/artifacts/$t-" \
    "build/fuzz/corpus/$t" "tests/fuzz/corpus/$t" >"$out/$t.log" 2>&1 && rc=0 || rc=$?
  echo "$rc" >"$out/$t.rc"
}
for t in "${targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  run "$t" &
done
wait
failed=()
for t in "${targets[@]}"; do
  [ "$(cat "$out/$t.rc")" = 0 ] || failed+=("$t")
done

total=0
printf '%-22s %14s %10s\n' target executions exec/s
for t in "${targets[@]}"; do
  n=$(sed -n 's/^stat::number_of_executed_units: *//p' "$out/$t.log" | tail -1)
  n=${n:-0}
  total=$((total + n))
  printf '%-22s %14s %10s\n' "$t" "$n" "$((n / seconds))"
done
printf '%-22s %14s\n' total "$total"
if [ ${#failed[@]} -ne 0 ]; then
  for t in "${failed[@]}"; do
    echo "fuzz: $t failed; its log ($out/$t.log) ends:"
    tail -40 "$out/$t.log"
  done
  ls build/fuzz/artifacts
  exit 1
fi
