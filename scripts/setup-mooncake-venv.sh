#!/usr/bin/env bash
# Makes (or updates) the venv bench/mooncake_compare.py runs in: Mooncake Store's Python package
# (mooncake-transfer-engine-non-cuda from PyPI: the store client, mooncake_master,
# mooncake_client) and kvbank's Python SDK built from ./python. Idempotent: an existing venv is
# reused, and only ./python is reinstalled on every run (the sources may have changed).
#
#   scripts/setup-mooncake-venv.sh            # venv in $KVBANK_MOONCAKE_VENV
#                                             # (default ~/.cache/kvbank-mooncake-venv)
#
# Mooncake's wheel links libibverbs even for TCP transfers: on Debian/Ubuntu install
# libibverbs1 first (apt-get install -y libibverbs1). The venv lives outside the clone.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cache="${XDG_CACHE_HOME:-$HOME/.cache}"
venv="${KVBANK_MOONCAKE_VENV:-$cache/kvbank-mooncake-venv}"
python="${PYTHON:-python3}"
mooncake_pkg="${KVBANK_MOONCAKE_PKG:-mooncake-transfer-engine-non-cuda}"

case "$(realpath -m "$venv")/" in
  "$repo"/*) echo "setup-mooncake-venv: $venv is inside the clone; put it outside" >&2; exit 1 ;;
esac
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
  echo "setup-mooncake-venv: libibverbs.so.1 not found (apt-get install -y libibverbs1)" >&2
  exit 1
fi

mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9  # two runs never install into the same venv at once

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
py="$venv/bin/python"
if ! "$py" -c 'import numpy, scikit_build_core, pybind11, mooncake.store' 2>/dev/null; then
  "$py" -m pip install --quiet "numpy>=1.21" "scikit-build-core>=0.8" "pybind11>=2.11" \
    "$mooncake_pkg"
fi

# kvbank from this clone, built in a folder next to the venv (incremental rebuilds), one compile
# at a time: the build machines are shared.
build_dir="$venv-build/$(printf '%s' "$repo" | sha256sum | cut -c1-12)"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-1}"
if command -v ccache >/dev/null && [[ "${CMAKE_ARGS:-}" != *COMPILER_LAUNCHER* ]]; then
  export CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_CXX_COMPILER_LAUNCHER=ccache"
fi
"$py" -m pip install --quiet --no-build-isolation --no-deps --force-reinstall \
  --config-settings=build-dir="$build_dir" "$repo/python"

"$py" - <<'EOF'
import importlib.metadata as md
import kvbank, mooncake.store  # noqa: F401  (both import: the venv is usable)
for name in ("kvbank", "numpy"):
    print("%s %s" % (name, md.version(name)))
for dist in md.distributions():
    if dist.metadata["Name"].lower().startswith("mooncake"):
        print("%s %s" % (dist.metadata["Name"], dist.version))
EOF
echo "setup-mooncake-venv: ready: $py"
