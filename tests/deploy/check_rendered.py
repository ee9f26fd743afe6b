#!/usr/bin/env python3
"""Cross-checks of a rendered overlay that no schema knows (scripts/check-deploy.sh).

  check_rendered.py split RENDERED GROUPS CORE_OUT CRD_OUT
      writes the objects of the API groups GROUPS (comma-separated) to CRD_OUT, the rest to
      CORE_OUT (kubernetes-validate has schemas for the latter only)
  check_rendered.py check RENDERED DASHBOARD_JSON
      exit 0 iff every check below holds; each failure is printed

Checks: the probes name the --health-listen port and the kvbank.v1.KvBank service; ports and
flags agree; the grace period covers the preStop sleep, --drain-timeout-ms and a margin; the
pool fraction leaves headroom under the memory limit; the flags' files lie on mounted volumes
whose Secrets exist; the Services, the PodDisruptionBudget, the NetworkPolicy and the
ServiceMonitor select the pods and name real ports (the NetworkPolicy admits a pod labelled
only kvbank.io/client=true); the dashboard ConfigMap holds
deploy/dashboards/kvbank.json and its panels query every kvbank metric they are meant to.
"""

import json
import math
import re
import sys

import yaml

HEALTH_SERVICE = "kvbank.v1.KvBank"
GRACE_MARGIN_S = 5
MIN_HEADROOM_BYTES = 1 << 30
CLIENT_LABELS = {"kvbank.io/client": "true"}  # what deploy/README.md tells clients to carry
DASHBOARD_METRICS = [
    "kvbank_kv_cache_usage_perc",
    "kvbank_prefix_cache_hits_total",
    "kvbank_prefix_cache_queries_total",
    "kvbank_evictions_total",
    "kvbank_bytes_received_total",
    "kvbank_bytes_sent_total",
    "kvbank_rpc_duration_seconds_bucket",
    "kvbank_rpc_total",
    "kvbank_rpc_in_flight",
    "kvbank_connections",
    "kvbank_tenant_blocks",
]
UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
         "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def load(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def quantity_bytes(q):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i?|k)?", str(q))
    if not m:
        raise ValueError("not a memory quantity: %r" % q)
    return float(m.group(1)) * UNITS.get(m.group(2) or "", 1)


def flag_map(args):
    flags = {}
    for a in args:
        name, _, value = a.partition("=")
        flags[name] = value
    return flags


def port_of(address):
    return int(address.rsplit(":", 1)[1])


def selects(selector, labels):
    return all(labels.get(k) == v for k, v in (selector or {}).items())


def selector_matches(selector, labels):
    """A LabelSelector (matchLabels and matchExpressions) against a pod's labels."""
    if not selects(selector.get("matchLabels"), labels):
        return False
    for e in selector.get("matchExpressions", []):
        op, key, values = e["operator"], e["key"], e.get("values", [])
        if not {"In": key in labels and labels[key] in values,
                "NotIn": labels.get(key) not in values,
                "Exists": key in labels,
                "DoesNotExist": key not in labels}[op]:
            return False
    return True


def admits(np, labels, port):
    """Whether a NetworkPolicy's ingress lets pods with these labels (any namespace) reach
    port (by name)."""
    return any(port in [p["port"] for p in rule.get("ports", [])] and
               any("podSelector" in f and selector_matches(f["podSelector"], labels)
                   for f in rule.get("from", []))
               for rule in np["spec"].get("ingress", []))


class Checker:
    def __init__(self):
        self.failures = []

    def expect(self, cond, what):
        if cond:
            print("   ok: " + what)
        else:
            print("   FAIL: " + what)
            self.failures.append(what)
        return cond


def check(rendered, dashboard_path):
    docs = load(rendered)
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    c = Checker()
    sts_list = by_kind.get("StatefulSet", [])
    if not c.expect(len(sts_list) == 1, "one StatefulSet"):
        return c.failures
    sts = sts_list[0]
    pod = sts["spec"]["template"]
    pod_labels = pod["metadata"]["labels"]
    spec = pod["spec"]
    container = next(x for x in spec["containers"] if x["name"] == "kvbankd")
    flags = flag_map(container["args"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    # Ports and flags.
    c.expect(port_of(flags["--listen"]) == ports.get("grpc"), "--listen port is containerPort grpc")
    c.expect(port_of(flags["--health-listen"]) == ports.get("health"),
             "--health-listen port is containerPort health")
    c.expect(port_of(flags["--metrics-listen"]) == ports.get("metrics"),
             "--metrics-listen port is containerPort metrics")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        g = container.get(probe, {}).get("grpc", {})
        c.expect(g.get("port") == ports.get("health") and g.get("service") == HEALTH_SERVICE,
                 "%s is a gRPC probe of %s on the health port" % (probe, HEALTH_SERVICE))
    # --replica-name from the downward API.
    env = {e["name"]: e for e in container.get("env", [])}
    c.expect(flags.get("--replica-name") == "$(POD_NAME)" and
             env.get("POD_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
             == "metadata.name", "--replica-name is $(POD_NAME), the pod's name")
    # Shutdown budget.
    sleep_s = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain_s = math.ceil(int(flags["--drain-timeout-ms"]) / 1000)
    grace = spec["terminationGracePeriodSeconds"]
    c.expect(grace >= sleep_s + drain_s + GRACE_MARGIN_S,
             "terminationGracePeriodSeconds %d >= preStop sleep %d + drain %d + margin %d"
             % (grace, sleep_s, drain_s, GRACE_MARGIN_S))
    # Memory: the pool fraction of the limit leaves headroom.
    limits = container["resources"]["limits"]
    c.expect(container["resources"]["requests"].get("memory") is not None and "memory" in limits,
             "memory request and limit set")
    if "--pool-memory-fraction" in flags:
        limit = quantity_bytes(limits["memory"])
        f = float(flags["--pool-memory-fraction"])
        c.expect(0 < f < 1 and (1 - f) * limit >= MIN_HEADROOM_BYTES,
                 "--pool-memory-fraction %.2f of %s leaves >= 1 GiB headroom"
                 % (f, limits["memory"]))
    if flags.get("--device", "").startswith("cuda"):
        c.expect(str(limits.get("nvidia.com/gpu")) == "1",
                 "a cuda device comes with nvidia.com/gpu: 1")
        c.expect("--pool-memory-fraction" not in flags,
                 "no --pool-memory-fraction on a GPU (kvbankd refuses it)")
    # Files named by flags lie on mounted volumes; secret volumes name rendered Secrets.
    mounts = {m["mountPath"].rstrip("/"): m["name"] for m in container.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    secrets = {s["metadata"]["name"]: s for s in by_kind.get("Secret", [])}
    for flag in ("--auth-tokens-file", "--tls-cert", "--tls-key", "--shm-socket"):
        if flag not in flags:
            continue
        path = flags[flag]
        mount = next((m for m in mounts if path.startswith(m + "/")), None)
        c.expect(mount is not None, "%s=%s lies on a volumeMount" % (flag, path))
        if mount is None:
            continue
        vol = volumes.get(mounts[mount], {})
        if "secret" in vol:
            name = vol["secret"]["secretName"]
            key = path[len(mount) + 1:]
            c.expect(name in secrets and key in secrets[name].get("data", {}),
                     "%s: Secret %s has key %s" % (flag, name, key))
    # Services, PDB, NetworkPolicy, ServiceMonitor.
    services = {s["metadata"]["name"]: s for s in by_kind.get("Service", [])}
    headless = services.get("kvbank-headless")
    c.expect(headless is not None and headless["spec"].get("clusterIP") == "None" and
             sts["spec"]["serviceName"] == "kvbank-headless",
             "headless Service kvbank-headless is the StatefulSet's serviceName")
    for name, s in services.items():
        c.expect(selects(s["spec"]["selector"], pod_labels), "Service %s selects the pods" % name)
        for p in s["spec"]["ports"]:
            c.expect(p["targetPort"] in ports, "Service %s port %s targets a container port"
                     % (name, p["name"]))
    for pdb in by_kind.get("PodDisruptionBudget", []):
        c.expect(selects(pdb["spec"]["selector"]["matchLabels"], pod_labels),
                 "PDB selects the pods")
    c.expect(len(by_kind.get("PodDisruptionBudget", [])) == 1, "one PodDisruptionBudget")
    for np in by_kind.get("NetworkPolicy", []):
        c.expect(selects(np["spec"]["podSelector"]["matchLabels"], pod_labels),
                 "NetworkPolicy selects the pods")
        named = [p["port"] for rule in np["spec"]["ingress"] for p in rule["ports"]]
        c.expect(all(p in ports for p in named) and {"grpc", "metrics"} <= set(named),
                 "NetworkPolicy admits the grpc and metrics ports by name")
        c.expect(admits(np, CLIENT_LABELS, "grpc"),
                 "NetworkPolicy admits a pod labelled only %s to port grpc" % CLIENT_LABELS)
    monitors = by_kind.get("ServiceMonitor", [])
    c.expect(len(monitors) == 1, "one ServiceMonitor")
    for sm in monitors:
        sel = sm["spec"]["selector"]["matchLabels"]
        matched = [s for s in services.values() if selects(sel, s["metadata"].get("labels", {}))]
        c.expect(len(matched) >= 1, "ServiceMonitor selects a Service")
        for ep in sm["spec"]["endpoints"]:
            c.expect(all(ep["port"] in [p["name"] for p in s["spec"]["ports"]] for s in matched)
                     and ep.get("path", "/metrics") == "/metrics",
                     "ServiceMonitor endpoint port %s is a port of the Service" % ep["port"])
    # The dashboard.
    with open(dashboard_path) as f:
        dashboard_text = f.read()
    dashboard = json.loads(dashboard_text)
    maps = [m for m in by_kind.get("ConfigMap", [])
            if m["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    c.expect(len(maps) == 1 and maps[0]["data"].get("kvbank.json") == dashboard_text,
             "ConfigMap labelled grafana_dashboard holds deploy/dashboards/kvbank.json")
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    for metric in DASHBOARD_METRICS:
        c.expect(re.search(r"\b%s\b" % metric, exprs) is not None, "dashboard queries " + metric)
    return c.failures


def split(rendered, groups, core_out, crd_out):
    groups = set(groups.split(","))
    core, crd = [], []
    for d in load(rendered):
        (crd if d["apiVersion"].split("/")[0] in groups else core).append(d)
    for path, part in ((core_out, core), (crd_out, crd)):
        with open(path, "w") as f:
            yaml.safe_dump_all(part, f, sort_keys=False)


def main(argv):
    if len(argv) == 6 and argv[1] == "split":
        split(*argv[2:])
        return 0
    if len(argv) == 4 and argv[1] == "check":
        failures = check(argv[2], argv[3])
        if failures:
            print("%d cross-check(s) failed" % len(failures))
            return 1
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
