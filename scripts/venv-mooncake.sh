# shellcheck shell=bash
# Sourced by scripts/setup-lmcache-venv.sh and setup-sglang-venv.sh (--with-mooncake): installs
# Mooncake Store's package into a venv, for the benchmarks that compare kvbank's plugins with
# the engines' own Mooncake backends. The caller defines log and pip_failed.
#
#   install_mooncake PY    # PY: the venv's interpreter; nothing to do when mooncake.store imports
#
# The package is $KVBANK_MOONCAKE_PKG (default mooncake-transfer-engine-non-cuda); its wheel links
# libibverbs.so.1 even for TCP transfers (Debian: apt-get install -y libibverbs1).
install_mooncake() {
  local py="$1" pkg="${KVBANK_MOONCAKE_PKG:-mooncake-transfer-engine-non-cuda}"
  "$py" -c "import mooncake.store" >/dev/null 2>&1 && return 0
  if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
    log "FAILED: Mooncake's wheel needs libibverbs.so.1 (apt-get install -y libibverbs1)"
    exit 1
  fi
  log "installing $pkg"
  "$py" -m pip install --quiet --disable-pip-version-check "$pkg" >&2 ||
    pip_failed "pip install $pkg"
}
