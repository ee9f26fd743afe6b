#!/usr/bin/env bash
# Makes (once) a venv with LMCache and kvbank's Python package, outside the clone:
#
#   scripts/setup-lmcache-venv.sh [--python PY] [--no-kvbank] [--with-mooncake]
#
# Prints the venv's interpreter on its last line. --no-kvbank: LMCache only, ./python not
# installed. --with-mooncake: also Mooncake Store's package (scripts/venv-mooncake.sh), for
# bench/lmcache_bench.py --mooncake (LMCache's own Mooncake connector); the tests do not need it.
#
# The venv is $KVBANK_LMCACHE_VENV (default: $XDG_CACHE_HOME or ~/.cache, then
# kvbank-lmcache-venv). LMCache needs torch, which the vLLM venv already carries: the script runs
# scripts/setup-vllm-venv.sh --no-kvbank first (its own lock makes a concurrent run wait), copies
# that venv (cp -a, then the copied scripts' interpreter lines and activate files are pointed at
# the new place) and pip-installs lmcache==$KVBANK_LMCACHE_VERSION (default 0.5.6) into the copy;
# pip moves numpy to the version LMCache pins. The copy leaves the vLLM venv as it was. A venv
# that imports lmcache, torch and the build tools, and carries the marker of a finished install,
# is reused. Every run pip-installs ./python into it again (one build folder per clone next to
# the venv, so a rebuild compiles only what changed). A lock file keeps two runs apart.
#
# Exit 77 (ctest: skipped) when the packages cannot be fetched because PyPI cannot be reached.
set -euo pipefail

LMCACHE_VERSION="${KVBANK_LMCACHE_VERSION:-0.5.6}"
SKIP=77

PYTHON="${KVBANK_LMCACHE_PYTHON:-}"
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
VENV="${KVBANK_LMCACHE_VENV:-$CACHE/kvbank-lmcache-venv}"
mkdir -p "$(dirname "$VENV")"
VENV="$(cd "$(dirname "$VENV")" && pwd)/$(basename "$VENV")"
case "$VENV/" in
  "$REPO"/*) echo "KVBANK_LMCACHE_VENV=$VENV is inside the clone; put it outside" >&2; exit 2 ;;
esac
PY="$VENV/bin/python"
MARKER="$VENV/.kvbank-lmcache-$LMCACHE_VERSION-complete"

log() { echo "[setup-lmcache-venv] $*" >&2; }

pypi_reachable() {
  "$PYTHON" - <<'EOF'
import urllib.request, sys
try:
    urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=20).close()
except Exception as e:
    print("[setup-lmcache-venv] PyPI unreachable: %s" % e, file=sys.stderr)
    sys.exit(1)
EOF
}

# A failed pip step: a skip when PyPI cannot be reached, else a failure.
pip_failed() {
  if ! pypi_reachable; then
    log "skipped: cannot fetch LMCache's packages into $VENV (PyPI unreachable)"
    exit $SKIP
  fi
  log "FAILED: $1 (PyPI is reachable; see pip's error above)"
  exit 1
}

exec 9>"$VENV.lock"
flock 9

start=$SECONDS
if [[ -f "$MARKER" ]] && "$PY" -c "import lmcache, torch, pytest, scikit_build_core, pybind11" \
    >/dev/null 2>&1; then
  log "reusing $VENV"
else
  rm -f "$MARKER"
  # The vLLM venv (torch, the build tools, pytest): made or reused by its own script.
  set +e
  vllm_py="$("$REPO/scripts/setup-vllm-venv.sh" --no-kvbank --python "$PYTHON" | tail -1)"
  rc=${PIPESTATUS[0]}
  set -e
  if [[ $rc == "$SKIP" ]]; then
    log "skipped: the vLLM venv cannot be made (PyPI unreachable)"
    exit $SKIP
  elif [[ $rc != 0 || ! -x "$vllm_py" ]]; then
    log "FAILED: scripts/setup-vllm-venv.sh exited $rc"
    exit 1
  fi
  src="$(dirname "$(dirname "$vllm_py")")"
  log "copying $src to $VENV"
  rm -rf "$VENV"
  cp -a "$src" "$VENV"
  # A venv names its own path in its scripts' interpreter lines and in activate*: point them at
  # the copy (the interpreter itself finds the venv through pyvenv.cfg next to bin/).
  for f in "$VENV"/bin/*; do
    [[ -f "$f" && ! -L "$f" ]] || continue
    if head -c 1024 "$f" | grep -qF "$src"; then
      sed -i "s|$src|$VENV|g" "$f"
    fi
  done
  sed -i "s|$src|$VENV|g" "$VENV/pyvenv.cfg"
  rm -f "$VENV"/.kvbank-vllm-*-complete
  log "installing lmcache==$LMCACHE_VERSION"
  "$PY" -m pip install --quiet --disable-pip-version-check "lmcache==$LMCACHE_VERSION" >&2 ||
    pip_failed "pip install lmcache==$LMCACHE_VERSION"
  "$PY" -c "import lmcache, torch; from lmcache.v1.cache_engine import LMCacheEngineBuilder" >&2 ||
    { log "FAILED: lmcache does not import"; exit 1; }
  touch "$MARKER"
  log "LMCache venv ready in $((SECONDS - start)) s ($(du -sh "$VENV" | cut -f1))"
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
