#!/usr/bin/env bash
# The installed C++ SDK as an engine would use it: `cmake --install` of this build into a
# temporary prefix, a separate CMake project (tests/install/consumer) built against it with
# find_package(kvbank), the same program built with pkg-config's flags, both run against the
# installed kvbankd; and the installed `kvbank plan --sweep` finds its plot script.
# usage: install_test.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$1
src=$2
tmp=$(mktemp -d /tmp/kvbank-install.XXXXXX)
server_pid=
cleanup() {
  if [[ -n "$server_pid" ]]; then kill -9 "$server_pid" 2>/dev/null || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
prefix=$tmp/prefix

cmake --install "$build" --prefix "$prefix" >"$tmp/install.log"
for f in include/kvbank/client.h include/kvbank/plane_router.h include/kvbank/layout.h \
         include/kvbank/prefix_hash.h include/kvbank/version.h lib/libkvbank.so \
         lib/cmake/kvbank/kvbankConfig.cmake lib/pkgconfig/kvbank.pc bin/kvbankd bin/kvbank share/kvbank/plot_plan.py; do
  [[ -e "$prefix/$f" ]] || { echo "install_test: $f was not installed"; exit 1; }
done

# find_package(kvbank): nothing of the build tree on the include or library paths.
cmake -S "$src/tests/install/consumer" -B "$tmp/consumer" -G Ninja \
  -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release >"$tmp/consumer-configure.log"
cmake --build "$tmp/consumer" >"$tmp/consumer-build.log"
# pkg-config: the .pc file is relocatable (its prefix is where it was installed).
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
# shellcheck disable=SC2046
c++ -std=c++17 -O1 -o "$tmp/consumer-pc" "$src/tests/install/consumer/consumer.cc" \
  $(pkg-config --cflags --libs kvbank) -Wl,-rpath,"$prefix/lib"

"$prefix/bin/kvbankd" --listen=127.0.0.1:0 --port-file="$tmp/port" --no-auth \
  --models=llama-3.1-8b --pool-bytes=64MiB 2>"$tmp/kvbankd.log" &
server_pid=$!
for _ in $(seq 1 200); do  # up to 20 s for the port file
  [[ -s "$tmp/port" ]] && break
  kill -0 "$server_pid" 2>/dev/null || { cat "$tmp/kvbankd.log"; exit 1; }
  sleep 0.1
done
[[ -s "$tmp/port" ]] || { echo "install_test: kvbankd did not start"; cat "$tmp/kvbankd.log"; exit 1; }
target=127.0.0.1:$(cat "$tmp/port")
"$tmp/consumer/consumer" "$target"
"$tmp/consumer-pc" "$target"
kill -TERM "$server_pid"
wait "$server_pid"
server_pid=

out=$("$prefix/bin/kvbank" plan --sweep --out-prefix "$tmp/plan" 2>&1 || true)
if grep -q "not found" <<<"$out"; then
  echo "install_test: the installed kvbank did not find its plot script:"
  echo "$out"
  exit 1
fi
[[ -s "$tmp/plan.csv" ]] || { echo "install_test: plan --sweep wrote no CSV"; echo "$out"; exit 1; }
echo "install_test: SDK installed, used by find_package and pkg-config, plot script found"
