#!/usr/bin/env bash
# Bundles this machine's release build for an offline GPU machine that has CUDA's driver but no
# gRPC, protobuf or Abseil, so that the service itself runs there, not only the kernels and the
# core: kvbankd, every test labelled gpu (the kernel and core tests and the integration tests
# that start kvbankd on cuda:0), the integration suites that move KV bytes, run again there with
# their pools on cuda:0, and the benchmarks that tests/gpu/run_prebuilt_on_device.sh runs. Their
# debug information stripped (symbols kept), with the shared libraries they load that such a
# machine lacks (gRPC, protobuf, Abseil, c-ares, RE2, OpenSSL, ...; not glibc, libstdc++, the
# CUDA driver or NCCL, which it has), into .svc/ (git-ignored), compressed to about 15 MiB so
# that it travels with the working tree:
#
#   .svc/bundle.tar.xz   bin/ (the binaries) and lib/ (the libraries, for LD_LIBRARY_PATH)
#   .svc/tests.tsv       one test a line: name, environment (K=V,K=V or -), binary, arguments
#
# tests/gpu/run_on_device.sh unpacks it (Python's tarfile: no xz tool needed) and runs .svc's
# tests when it finds .svc/tests.tsv, with no build there.
# The binaries keep this machine's absolute paths for data they read (none of the listed tests
# reads any) and find kvbankd through KVBANK_KVBANKD.
#
#   cmake --build --preset release && scripts/bundle-device-service.sh
set -euo pipefail
cd "$(dirname "$0")/.."
build=build/release
if [[ ! -x $build/bin/kvbankd ]]; then
  echo "bundle-device-service.sh: no $build/bin/kvbankd (cmake --build --preset release)" >&2
  exit 2
fi
if ! grep -q '^KVBANK_ENABLE_CUDA:BOOL=ON' "$build/CMakeCache.txt"; then
  echo "bundle-device-service.sh: $build was configured without CUDA (no nvcc?)" >&2
  exit 2
fi

# The integration suites that move KV bytes (ctest's *_staged list) run again on cuda:0.
cuda_suites=(integ_lifecycle_test integ_quant_test integ_attend_test integ_prefix_test
  integ_tp_test integ_handoff_test)

stage=build/device-svc  # bin/ and lib/, packed into .svc/bundle.tar.xz
rm -rf .svc "$stage"
mkdir -p .svc "$stage/bin" "$stage/lib"
ctest --test-dir "$build" -L gpu --show-only=json-v1 >.svc/gpu-tests.json
python3 - "$build" "${cuda_suites[@]}" <<'EOF'
import json, os, sys
build, suites = sys.argv[1], sys.argv[2:]
bin_dir = os.path.abspath(build) + "/bin/"
rows = []
for t in json.load(open(".svc/gpu-tests.json"))["tests"]:
    cmd = t.get("command") or []
    if not cmd or not cmd[0].startswith(bin_dir):
        print(f"bundle: skipping {t['name']}: not a binary of {build}/bin", file=sys.stderr)
        continue
    env = next((p["value"] for p in t.get("properties", []) if p["name"] == "ENVIRONMENT"), [])
    rows.append([t["name"], ",".join(env) or "-", cmd[0][len(bin_dir):], *cmd[1:]])
for s in suites:
    rows.append([s.replace("_test", "") + "_cuda", "KVBANK_TEST_DEVICE=cuda:0", s])
with open(".svc/tests.tsv", "w") as f:
    for r in rows:
        f.write("\t".join(r) + "\n")
EOF
rm .svc/gpu-tests.json
mapfile -t binaries < <(cut -f 3 .svc/tests.tsv | sort -u)
binaries+=(kvbankd shm_bench pool_bench gpu_attention_bench)
for b in "${binaries[@]}"; do
  strip --strip-debug -o "$stage/bin/$b" "$build/bin/$b"  # symbols kept: readable stacks
done

# The libraries they load, less what every Linux machine with CUDA has.
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libpthread|libdl\.so|librt\.so|libstdc\+\+|libgcc_s|libcuda\.so|libnccl)'
for b in "$stage"/bin/*; do
  ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name path; do
  [[ $name =~ $skip ]] && continue
  cp -L "$path" "$stage/lib/$name"
done
strip --strip-unneeded "$stage"/lib/* 2>/dev/null || true
tar -C "$stage" -cJf .svc/bundle.tar.xz bin lib
echo "bundle-device-service.sh: $(wc -l <.svc/tests.tsv) tests, $(find "$stage/bin" -type f | wc -l)" \
  "binaries, $(find "$stage/lib" -type f | wc -l) libraries: .svc is $(du -sh .svc | cut -f 1)"
