#!/usr/bin/env bash
# Makes (once) a venv with SGLang for CPUs and kvbank's Python package, outside the clone:
#
#   scripts/setup-sglang-venv.sh [--python PY] [--no-kvbank] [--with-mooncake]
#
# Prints the venv's interpreter on its last line. --no-kvbank: SGLang only, ./python not
# installed. --with-mooncake: also Mooncake Store's package (scripts/venv-mooncake.sh), for
# bench/sglang_bench.py --mooncake (SGLang's own Mooncake backend); the tests do not need it.
#
# The venv is $KVBANK_SGLANG_VENV (default: $XDG_CACHE_HOME or ~/.cache, then
# kvbank-sglang-venv). SGLang's own requirements pin another torch and pull GPU kernels; what its
# HiCache storage tier needs on a CPU is torch and a few small packages. So the venv starts as a
# copy of the vLLM venv (scripts/setup-vllm-venv.sh --no-kvbank: PyPI's torch, transformers,
# pytest, the build tools), then gets sglang==$KVBANK_SGLANG_VERSION with --no-deps and the few
# modules its HiCache path imports. A venv that already imports sglang's HiCache modules and
# carries the marker of a finished install is reused. Every run pip-installs ./python into it
# again (one build folder per clone next to the venv, so a rebuild compiles only what changed).
# A lock file keeps two runs apart.
#
# Exit 77 (ctest: skipped) when the packages cannot be fetched because PyPI cannot be reached.
set -euo pipefail

SGLANG_VERSION="${KVBANK_SGLANG_VERSION:-0.5.23}"
# What sglang's HiCache controller, host pool and storage modules import besides torch.
EXTRA_REQUIREMENTS=(orjson xxhash zstandard IPython gguf)
SKIP=77

PYTHON="${KVBANK_SGLANG_PYTHON:-}"
INSTALL_KVBANK=1
WITH_MOONCAKE=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) PYTHON="$2"; shift 2 ;;
    --no-kvbank) INSTALL_KVBANK=0; shift ;;
    --with-mooncake) WITH_MOONCAKE=1; shift ;;
    *) echo "usage: $0 [--python PY] [--no-kvbank] [--with-mooncake]" >&2; exit 2 ;;
  esac
done
if [[ -z "$PYTHON" ]]; then
  # Debian's interpreter when there is one: building ./python needs its headers (python3-dev).
  if [[ -x /usr/bin/python3 ]]; then PYTHON=/usr/bin/python3; else PYTHON="$(command -v python3)"; fi
fi

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}"
VENV="${KVBANK_SGLANG_VENV:-$CACHE/kvbank-sglang-venv}"
mkdir -p "$(dirname "$VENV")"
VENV="$(cd "$(dirname "$VENV")" && pwd)/$(basename "$VENV")"
case "$VENV/" in
  "$REPO"/*) echo "KVBANK_SGLANG_VENV=$VENV is inside the clone; put it outside" >&2; exit 2 ;;
esac
PY="$VENV/bin/python"
MARKER="$VENV/.kvbank-sglang-$SGLANG_VERSION-complete"
IMPORTS="import sglang, torch, pytest, scikit_build_core, pybind11
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.managers.cache_controller import HiCacheController"

log() { echo "[setup-sglang-venv] $*" >&2; }

pypi_reachable() {
  "$PYTHON" - <<'EOF'
import urllib.request, sys
try:
    urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=20).close()
except Exception as e:
    print("[setup-sglang-venv] PyPI unreachable: %s" % e, file=sys.stderr)
    sys.exit(1)
EOF
}

# A failed pip step: a skip when PyPI cannot be reached, else a failure.
pip_failed() {
  if ! pypi_reachable; then
    log "skipped: cannot fetch SGLang's packages into $VENV (PyPI unreachable)"
    exit $SKIP
  fi
  log "FAILED: $1 (PyPI is reachable; see pip's error above)"
  exit 1
}

exec 9>"$VENV.lock"
flock 9

start=$SECONDS
if [[ -f "$MARKER" ]] && "$PY" -c "$IMPORTS" >/dev/null 2>&1; then
  log "reusing $VENV"
else
  rm -f "$MARKER"
  # The vLLM venv (made once, under its own lock), copied whole: a venv's files name no other
  # place than its interpreter's, and every use here goes through "$PY -m".
  rc=0
  vllm_py="$("$REPO/scripts/setup-vllm-venv.sh" --no-kvbank --python "$PYTHON" | tail -1)" ||
    rc=$?
  [[ $rc == 0 ]] || { log "scripts/setup-vllm-venv.sh exited $rc"; exit $rc; }
  vllm_venv="$(dirname "$(dirname "$vllm_py")")"
  log "copying $vllm_venv to $VENV"
  rm -rf "$VENV" "$VENV.tmp"
  flock "$vllm_venv.lock" cp -a "$vllm_venv" "$VENV.tmp"  # not while it is being changed
  mv "$VENV.tmp" "$VENV"
  # The copy's scripts (activate, console entry points) still name the vLLM venv.
  { find "$VENV/bin" -maxdepth 1 -type f -exec grep -lI -- "$vllm_venv" {} + || true; } |
    xargs -r sed -i "s|$vllm_venv|$VENV|g"
  log "installing sglang==$SGLANG_VERSION (--no-deps) and ${EXTRA_REQUIREMENTS[*]}"
  "$PY" -m pip install --quiet --no-deps "sglang==$SGLANG_VERSION" >&2 ||
    pip_failed "installing sglang==$SGLANG_VERSION"
  "$PY" -m pip install --quiet "${EXTRA_REQUIREMENTS[@]}" >&2 ||
    pip_failed "installing ${EXTRA_REQUIREMENTS[*]}"
  "$PY" -c "$IMPORTS" >&2 || { log "FAILED: sglang's HiCache modules do not import"; exit 1; }
  touch "$MARKER"
  log "SGLang venv ready in $((SECONDS - start)) s ($(du -sh "$VENV" | cut -f1))"
fi

if [[ $WITH_MOONCAKE == 1 ]]; then
  source "$REPO/scripts/venv-mooncake.sh"
  install_mooncake "$PY"
fi

if [[ $INSTALL_KVBANK == 0 ]]; then
  echo "$PY"
  exit 0
fi

# kvbank's package, rebuilt incrementally in a build folder per clone.
tag="$(printf '%s' "$REPO" | sha256sum | cut -c1-12)"
build_dir="$VENV-build/$tag"
if command -v ccache >/dev/null && [[ "${CMAKE_ARGS:-}" != *CMAKE_CXX_COMPILER_LAUNCHER* ]]; then
  export CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_CXX_COMPILER_LAUNCHER=ccache"
fi
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-1}"  # shared machines
t=$SECONDS
"$PY" -m pip install --quiet --no-build-isolation --no-deps --force-reinstall \
  --config-settings=build-dir="$build_dir" "$REPO/python" >&2
log "kvbank installed in $((SECONDS - t)) s"
echo "$PY"
