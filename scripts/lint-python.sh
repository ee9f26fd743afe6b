#!/usr/bin/env bash
# Lints and type-checks the Python SDK (python/kvbank) and its tests (tests/python): ruff check,
# then mypy, both configured in python/pyproject.toml; ruff also checks the engine plugins' tests
# (tests/lmcache, tests/sglang). Fails on any finding.
#
# The tools live in a venv outside the clone ($KVBANK_LINT_VENV, default
# ${XDG_CACHE_HOME:-~/.cache}/kvbank-lint-venv), made once from PyPI with the pinned versions
# below (numpy and pytest: their own type hints are what mypy checks the code against) and made
# again when the pins change. Exit 77 (skipped) when they cannot be installed (PyPI unreachable).
# Once the venv exists a run takes seconds: the caches sit next to the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
requirements=(ruff==0.17.6 mypy==2.4.1 numpy==2.4.6 pytest==9.2.0)

cache=${XDG_CACHE_HOME:-$HOME/.cache}
venv=${KVBANK_LINT_VENV:-$cache/kvbank-lint-venv}
case "$(realpath -m "$venv")/" in
  "$repo"/*) echo "lint-python: KVBANK_LINT_VENV=$venv is inside the clone; put it outside" >&2
             exit 2 ;;
esac
py=/usr/bin/python3
[ -x "$py" ] || py=$(command -v python3)
mkdir -p "$(dirname "$venv")"
(
  # One run at a time makes or updates the venv; the stamp names the pins it holds.
  flock 9
  stamp="$venv/kvbank-lint-requirements"
  if [ "$(cat "$stamp" 2>/dev/null)" != "${requirements[*]}" ]; then
    [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
    if ! "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        "${requirements[@]}"; then
      echo "lint-python: skipped: cannot install ${requirements[*]} into $venv" \
           "(is PyPI reachable?)"
      exit 77
    fi
    echo "${requirements[*]}" >"$stamp"
  fi
) 9>"$venv.lock"

export RUFF_CACHE_DIR="$venv.cache/ruff" MYPY_CACHE_DIR="$venv.cache/mypy"
config=python/pyproject.toml
status=0
"$venv/bin/ruff" check --config "$config" python/kvbank tests/python tests/lmcache tests/sglang \
  || status=1
"$venv/bin/mypy" --config-file "$config" || status=1
[ "$status" = 0 ] && echo "lint-python: ruff and mypy found nothing"
exit "$status"
