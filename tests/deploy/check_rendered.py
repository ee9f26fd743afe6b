#!/usr/bin/env python3
"""Cross-checks of a rendered overlay that no schema knows (scripts/check-deploy.sh).

  check_rendered.py split RENDERED GROUPS CORE_OUT CRD_OUT
      writes the objects of the API groups GROUPS (comma-separated) to CRD_OUT, the rest to
      CORE_OUT (kubernetes-validate has schemas for the latter only)
  check_rendered.py check RENDERED DASHBOARD_JSON
      exit 0 iff every check below holds; each failure is printed

Every overlay has one kvbankd container (a StatefulSet's, a DaemonSet's, or a native sidecar
in an engine's Deployment). Its checks: the probes name the --health-listen port and the
kvbank.v1.KvBank service; ports and flags agree (a loopback --listen has no containerPort);
--replica-name comes from the downward API; the grace period covers the preStop sleep (a
sidecar: the engine's stop), --drain-timeout-ms and a margin; the pool fraction leaves headroom
under the memory limit; a GPU comes with nvidia.com/gpu or a resource claim; the flags' files
lie on mounted volumes whose Secrets exist. The Services, PodDisruptionBudgets, NetworkPolicies
and ServiceMonitors select pods and name real ports.

The cluster (StatefulSet): the headless Service, one PDB, the NetworkPolicy admits a pod
labelled only kvbank.io/client=true, the dashboard ConfigMap holds deploy/dashboards/kvbank.json
and its panels query every kvbank metric they are meant to.

An engine (a container whose --kv-transfer-config names kvbank.vllm's KvbankConnector) next to
kvbankd: kvbank_model is one of kvbankd's --models; the engine runs as kvbankd's uid and gid,
non-root, without privilege escalation or capabilities, on a read-only root; it mounts
kvbankd's socket folder (the same volume, or the same hostPath) at kvbankd's path; kvbankd
serves no TLS (the connector has none); kvbank_token is a Secret's key where kvbankd wants
tokens. A sidecar: kvbankd is an init container with restartPolicy Always and a startup probe,
kvbank_target is its 127.0.0.1 --listen, the folder an emptyDir; on a GPU both containers
name one resource claim of one device (no nvidia.com/gpu), the pod shares its process
namespace, and the two --gpu-memory-utilization add up to at most 0.95. Node-local: the folder
is a hostPath (DirectoryOrCreate) at its own path, an init container hands it to kvbankd's
uid:gid with mode 0700, kvbank_target is a Service of kvbankd's pods with internalTrafficPolicy
Local whose port leads to --listen, and kvbankd's NetworkPolicy admits the engine's pods.
"""

import json
import math
import re
import sys

import yaml

from rendered_pod import (
    CONNECTOR,
    LOOPBACK,
    flag,
    pod_containers,
    security,
    transfer_config,
    workload_pods,
)

HEALTH_SERVICE = "kvbank.v1.KvBank"
GRACE_MARGIN_S = 5
ENGINE_STOP_S = 30  # what a sidecar's pod leaves the engine to stop before kvbankd's turn
MAX_GPU_SHARE = 0.95  # kvbankd's and vLLM's memory fractions of one GPU, both contexts aside
CLIENT_LABELS = {"kvbank.io/client": "true"}  # what deploy/README.md tells clients to carry
MIN_HEADROOM_BYTES = 1 << 30
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


def workloads(by_kind):
    """(workload, pod template labels, pod spec) of every Deployment, DaemonSet, StatefulSet."""
    objects = [o for group in by_kind.values() for o in group]
    return [(w, w["spec"]["template"]["metadata"].get("labels", {}), spec)
            for w, spec in workload_pods(objects)]


def volume_identity(w, spec, mount_name):
    """What a volume is on the node: a hostPath's path, else the pod's own volume."""
    vol: dict = next((v for v in spec.get("volumes", []) if v["name"] == mount_name), {})
    if "hostPath" in vol:
        return ("hostPath", vol["hostPath"]["path"].rstrip("/"))
    return (w["kind"], w["metadata"]["name"], mount_name)


def check(rendered, dashboard_path):
    docs = load(rendered)
    by_kind: dict = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    c = Checker()
    servers = [(w, labels, spec, x) for w, labels, spec in workloads(by_kind)
               for x in pod_containers(spec) if x["name"] == "kvbankd"]
    if not c.expect(len(servers) == 1, "one kvbankd container"):
        return c.failures
    server = servers[0]
    check_kvbankd(c, by_kind, server)
    check_selectors(c, by_kind)
    engines = [(w, labels, spec, x) for w, labels, spec in workloads(by_kind)
               for x in pod_containers(spec)
               if (transfer_config(x) or {}).get("kv_connector") == CONNECTOR]
    kind = server[0]["kind"]
    if kind == "StatefulSet":
        check_cluster(c, by_kind, server, dashboard_path)
        return c.failures
    if not c.expect(len(engines) == 1, "one engine container with kvbank.vllm's " + CONNECTOR):
        return c.failures
    check_engine(c, by_kind, server, engines[0])
    if kind == "Deployment":
        check_sidecar(c, by_kind, server, engines[0])
    elif c.expect(kind == "DaemonSet", "kvbankd is a StatefulSet, a sidecar or a DaemonSet"):
        check_node_local(c, by_kind, server, engines[0])
    return c.failures


def check_kvbankd(c, by_kind, server):
    """What every kvbankd container needs, whatever runs it."""
    w, _, spec, container = server
    flags = flag_map(container["args"])
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    # Ports and flags. A loopback --listen is for the pod's own containers: no containerPort.
    if flags["--listen"].rsplit(":", 1)[0] in LOOPBACK:
        c.expect("grpc" not in ports, "--listen=%s: the pod's containers only, no containerPort "
                 "grpc" % flags["--listen"])
    else:
        c.expect(port_of(flags["--listen"]) == ports.get("grpc"),
                 "--listen port is containerPort grpc")
    c.expect(port_of(flags["--health-listen"]) == ports.get("health"),
             "--health-listen port is containerPort health")
    c.expect(port_of(flags["--metrics-listen"]) == ports.get("metrics"),
             "--metrics-listen port is containerPort metrics")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        g = container.get(probe, {}).get("grpc", {})
        c.expect(g.get("port") == ports.get("health") and g.get("service") == HEALTH_SERVICE,
                 "%s is a gRPC probe of %s on the health port" % (probe, HEALTH_SERVICE))
    # --replica-name from the downward API: the pod's stable name, or the node's.
    env = {e["name"]: e for e in container.get("env", [])}
    want = {"StatefulSet": "metadata.name", "DaemonSet": "spec.nodeName"}.get(w["kind"])
    if want is not None:
        name = flags.get("--replica-name", "")
        var = name[2:-1] if name.startswith("$(") and name.endswith(")") else None
        c.expect(var is not None and env.get(var, {}).get("valueFrom", {}).get("fieldRef", {})
                 .get("fieldPath") == want, "--replica-name is $(%s), the %s's name"
                 % (var, "pod" if want == "metadata.name" else "node"))
    # Shutdown budget. Behind a Service, preStop sleeps while the endpoint goes; a sidecar
    # stops after the engine, within the same grace period.
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {})
    if w["kind"] != "Deployment":
        c.expect("seconds" in pre_stop, "preStop sleeps while the Services drop the endpoint")
    sleep_s = pre_stop.get("seconds", 0)
    engine_s = ENGINE_STOP_S if w["kind"] == "Deployment" else 0
    drain_s = math.ceil(int(flags["--drain-timeout-ms"]) / 1000)
    grace = spec["terminationGracePeriodSeconds"]
    c.expect(grace >= engine_s + sleep_s + drain_s + GRACE_MARGIN_S,
             "terminationGracePeriodSeconds %d >= engine %d + preStop sleep %d + drain %d + "
             "margin %d" % (grace, engine_s, sleep_s, drain_s, GRACE_MARGIN_S))
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
        claims = container["resources"].get("claims", [])
        c.expect(str(limits.get("nvidia.com/gpu")) == "1" or len(claims) == 1,
                 "a cuda device comes with nvidia.com/gpu: 1 or a resource claim")
        c.expect("--pool-memory-fraction" not in flags,
                 "no --pool-memory-fraction on a GPU (kvbankd refuses it)")
    # Files named by flags lie on mounted volumes; secret volumes name rendered Secrets.
    mounts = {m["mountPath"].rstrip("/"): m["name"] for m in container.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    secrets = {s["metadata"]["name"]: s for s in by_kind.get("Secret", [])}
    for name in ("--auth-tokens-file", "--tls-cert", "--tls-key", "--shm-socket"):
        if name not in flags:
            continue
        path = flags[name]
        mount = next((m for m in mounts if path.startswith(m + "/")), None)
        c.expect(mount is not None, "%s=%s lies on a volumeMount" % (name, path))
        if mount is None:
            continue
        vol = volumes.get(mounts[mount], {})
        if "secret" in vol:
            secret = vol["secret"]["secretName"]
            key = path[len(mount) + 1:]
            c.expect(secret in secrets and key in secrets[secret].get("data", {}),
                     "%s: Secret %s has key %s" % (name, secret, key))


def check_selectors(c, by_kind):
    """Services, PDBs, NetworkPolicies and ServiceMonitors select pods and name real ports."""
    pods = workloads(by_kind)

    def selected(selector, namespace):
        return [(w, labels, spec) for w, labels, spec in pods
                if w["metadata"].get("namespace") == namespace and selects(selector, labels)]

    def port_names(matched):
        return {p["name"] for _, _, spec in matched for x in pod_containers(spec)
                for p in x.get("ports", [])}

    services = by_kind.get("Service", [])
    for s in services:
        name = s["metadata"]["name"]
        matched = selected(s["spec"]["selector"], s["metadata"].get("namespace"))
        c.expect(len(matched) >= 1, "Service %s selects the pods" % name)
        for p in s["spec"]["ports"]:
            c.expect(p["targetPort"] in port_names(matched),
                     "Service %s port %s targets a container port" % (name, p["name"]))
    for pdb in by_kind.get("PodDisruptionBudget", []):
        c.expect(len(selected(pdb["spec"]["selector"]["matchLabels"],
                              pdb["metadata"].get("namespace"))) >= 1, "PDB selects the pods")
    for np in by_kind.get("NetworkPolicy", []):
        matched = selected(np["spec"]["podSelector"]["matchLabels"],
                           np["metadata"].get("namespace"))
        c.expect(len(matched) >= 1, "NetworkPolicy %s selects the pods" % np["metadata"]["name"])
        named = [p["port"] for rule in np["spec"].get("ingress", []) for p in rule["ports"]]
        c.expect(all(p in port_names(matched) for p in named),
                 "NetworkPolicy %s admits ports of the pods by name (%s)"
                 % (np["metadata"]["name"], ", ".join(map(str, named))))
    for sm in by_kind.get("ServiceMonitor", []):
        sel = sm["spec"]["selector"]["matchLabels"]
        matched = [s for s in services if selects(sel, s["metadata"].get("labels", {}))]
        c.expect(len(matched) >= 1, "ServiceMonitor selects a Service")
        for ep in sm["spec"]["endpoints"]:
            c.expect(all(ep["port"] in [p["name"] for p in s["spec"]["ports"]] for s in matched)
                     and ep.get("path", "/metrics") == "/metrics",
                     "ServiceMonitor endpoint port %s is a port of the Service" % ep["port"])


def check_cluster(c, by_kind, server, dashboard_path):
    """The StatefulSet behind a headless Service (overlays cpu and gpu)."""
    sts = server[0]
    services = {s["metadata"]["name"]: s for s in by_kind.get("Service", [])}
    headless = services.get("kvbank-headless")
    c.expect(headless is not None and headless["spec"].get("clusterIP") == "None" and
             sts["spec"]["serviceName"] == "kvbank-headless",
             "headless Service kvbank-headless is the StatefulSet's serviceName")
    c.expect(len(by_kind.get("PodDisruptionBudget", [])) == 1, "one PodDisruptionBudget")
    named = [p["port"] for np in by_kind.get("NetworkPolicy", [])
             for rule in np["spec"]["ingress"] for p in rule["ports"]]
    c.expect({"grpc", "metrics"} <= set(named),
             "NetworkPolicy admits the grpc and metrics ports by name")
    c.expect(any(admits(np, CLIENT_LABELS, "grpc") for np in by_kind.get("NetworkPolicy", [])),
             "NetworkPolicy admits a pod labelled only %s to port grpc" % CLIENT_LABELS)
    c.expect(len(by_kind.get("ServiceMonitor", [])) == 1, "one ServiceMonitor")
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


def socket_mount(container):
    """kvbankd's --shm-socket folder: (mountPath, volume name), or (None, None)."""
    path = flag_map(container["args"]).get("--shm-socket", "")
    for m in container.get("volumeMounts", []):
        if path.startswith(m["mountPath"].rstrip("/") + "/"):
            return m["mountPath"].rstrip("/"), m["name"]
    return None, None


def check_engine(c, by_kind, server, engine):
    """An engine that uses a kvbankd on its host: the connector's settings, same uid, the socket
    folder at kvbankd's path, a token where kvbankd asks for one."""
    sw, _, sspec, sc = server
    ew, _, espec, ec = engine
    sflags = flag_map(sc["args"])
    config = transfer_config(ec)
    extra = config.get("kv_connector_extra_config", {})
    c.expect(config.get("kv_connector_module_path") == "kvbank.vllm" and
             config.get("kv_role") in ("kv_both", "kv_producer", "kv_consumer"),
             "--kv-transfer-config: %s from kvbank.vllm, kv_role %s"
             % (CONNECTOR, config.get("kv_role")))
    c.expect(str(extra.get("kvbank_shm", True)).lower() not in ("0", "false", "no", "off"),
             "kvbank_shm is not turned off")
    models = sflags.get("--models", "").split(",")
    c.expect(extra.get("kvbank_model") in models,
             "kvbank_model %r is registered by kvbankd at start (--models=%s): the engine "
             "needs no admin right" % (extra.get("kvbank_model"), sflags.get("--models")))
    # The same uid: kvbankd's socket is 0600 and the SDK wants its own uid at the other end.
    ssec, esec = security(sspec, sc), security(espec, ec)
    c.expect(esec.get("runAsUser") is not None and
             (esec.get("runAsUser"), esec.get("runAsGroup")) ==
             (ssec.get("runAsUser"), ssec.get("runAsGroup")),
             "the engine's uid:gid %s:%s is kvbankd's %s:%s"
             % (esec.get("runAsUser"), esec.get("runAsGroup"), ssec.get("runAsUser"),
                ssec.get("runAsGroup")))
    c.expect(esec.get("runAsNonRoot") is True and esec.get("allowPrivilegeEscalation") is False
             and esec.get("privileged") is not True and esec.get("readOnlyRootFilesystem") is True
             and "ALL" in esec.get("capabilities", {}).get("drop", []) and
             esec.get("seccompProfile", {}).get("type") == "RuntimeDefault",
             "the engine: non-root, no privilege escalation, read-only root, no capabilities, "
             "seccomp RuntimeDefault")
    # The socket folder: the same volume at the same path in both containers.
    mount, name = socket_mount(sc)
    emount = next((m for m in ec.get("volumeMounts", [])
                   if m["mountPath"].rstrip("/") == mount), None)
    c.expect(mount is not None and emount is not None and not emount.get("readOnly") and
             volume_identity(ew, espec, emount["name"]) == volume_identity(sw, sspec, name),
             "the engine mounts kvbankd's socket folder (%s) at the same path, writable" % mount)
    # Credentials: the connector has a token setting, no TLS one.
    c.expect("--tls-cert" not in sflags, "kvbankd serves no TLS (kvbank.vllm's connector has no "
             "TLS settings)")
    if "--auth-tokens-file" in sflags:
        token = extra.get("kvbank_token", "")
        var = token[2:-1] if token.startswith("$(") and token.endswith(")") else None
        env = {e["name"]: e for e in ec.get("env", [])}
        ref = env.get(var, {}).get("valueFrom", {}).get("secretKeyRef", {})
        secrets = {(s["metadata"].get("namespace"), s["metadata"]["name"]): s
                   for s in by_kind.get("Secret", [])}
        secret = secrets.get((ew["metadata"].get("namespace"), ref.get("name")), {})
        c.expect(var is not None and ref.get("key") in secret.get("data", {}),
                 "kvbank_token is $(%s), a key of a Secret in the engine's namespace" % var)
    else:
        c.expect("--no-auth" in sflags and "kvbank_token" not in extra,
                 "kvbankd without tokens (--no-auth), the engine sends none")


def check_sidecar(c, by_kind, server, engine):
    """kvbankd as a native sidecar in the engine's pod."""
    sw, _, spec, sc = server
    ew, _, _, ec = engine
    sflags = flag_map(sc["args"])
    extra = transfer_config(ec).get("kv_connector_extra_config", {})
    c.expect(sw is ew and sc in spec.get("initContainers", []) and
             sc.get("restartPolicy") == "Always" and "startupProbe" in sc,
             "kvbankd is a native sidecar of the engine's pod (an init container, restartPolicy "
             "Always, with a startupProbe: the engine starts once kvbankd serves)")
    c.expect(extra.get("kvbank_target", "").rsplit(":", 1) ==
             ["127.0.0.1", flags_port(sflags["--listen"])] and
             sflags["--listen"].rsplit(":", 1)[0] == "127.0.0.1",
             "kvbank_target %s is kvbankd's --listen=%s, on the pod's loopback"
             % (extra.get("kvbank_target"), sflags["--listen"]))
    _, name = socket_mount(sc)
    vol: dict = next((v for v in spec.get("volumes", []) if v["name"] == name), {})
    c.expect("emptyDir" in vol, "the socket folder is an emptyDir of the pod")
    if sflags.get("--device", "").startswith("cuda"):
        # CUDA IPC: the same GPU in both containers, one PID namespace.
        claims = {x["name"] for x in spec.get("resourceClaims", [])}
        sclaims = {x["name"] for x in sc["resources"].get("claims", [])}
        eclaims = {x["name"] for x in ec["resources"].get("claims", [])}
        c.expect(len(sclaims) == 1 and sclaims == eclaims and sclaims <= claims,
                 "kvbankd and the engine name the same pod resource claim (one GPU for both)")
        templates = {t["metadata"]["name"]: t for t in by_kind.get("ResourceClaimTemplate", [])}
        for x in spec.get("resourceClaims", []):
            t = templates.get(x.get("resourceClaimTemplateName"))
            requests = (t or {}).get("spec", {}).get("spec", {}).get("devices", {}) \
                .get("requests", [])
            c.expect(len(requests) == 1 and requests[0].get("exactly", {}).get("count") == 1,
                     "ResourceClaimTemplate %s asks for one device"
                     % x.get("resourceClaimTemplateName"))
        c.expect(all("nvidia.com/gpu" not in x["resources"].get(k, {}) for x in (sc, ec)
                     for k in ("limits", "requests")),
                 "no nvidia.com/gpu (each container's request would get a GPU of its own)")
        c.expect(spec.get("shareProcessNamespace") is True,
                 "shareProcessNamespace: CUDA IPC handles open only within one PID namespace")
        total = float(sflags.get("--gpu-memory-utilization", 0.9)) + \
            float(flag(ec.get("args", []), "--gpu-memory-utilization", 0.9))
        c.expect(total <= MAX_GPU_SHARE, "kvbankd's and vLLM's --gpu-memory-utilization add "
                 "up to %.2f <= %.2f of the GPU" % (total, MAX_GPU_SHARE))


def check_node_local(c, by_kind, server, engine):
    """One kvbankd per node, its socket folder a hostPath the engines mount."""
    sw, slabels, spec, sc = server
    ew, elabels, espec, ec = engine
    sflags = flag_map(sc["args"])
    ssec = security(spec, sc)
    mount, name = socket_mount(sc)
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    host = vols.get(name, {}).get("hostPath", {})
    c.expect(host.get("path", "").rstrip("/") == mount and host.get("type") == "DirectoryOrCreate",
             "the socket folder is the node's %s (hostPath, DirectoryOrCreate) at the same path"
             % mount)
    emount: dict = next((m for m in ec.get("volumeMounts", [])
                         if m["mountPath"].rstrip("/") == mount), {})
    evol: dict = next((v for v in espec.get("volumes", []) if v["name"] == emount.get("name")),
                      {})
    ehost = evol.get("hostPath", {})
    c.expect(ehost.get("type") in ("Directory", "DirectoryOrCreate"),
             "the engine's hostPath %s is a Directory" % ehost.get("path"))
    # The folder is handed to kvbankd's uid, owner only, before kvbankd starts.
    want = ["-d", "-o", str(ssec.get("runAsUser")), "-g", str(ssec.get("runAsGroup")), "-m",
            "0700", mount]
    handed = [i for i in spec.get("initContainers", [])
              if i.get("command", [])[-1:] == ["/usr/bin/install"] and i.get("args") == want and
              any(m["name"] == name and m["mountPath"].rstrip("/") == mount
                  for m in i.get("volumeMounts", []))]
    c.expect(len(handed) == 1, "an init container runs install %s on the hostPath"
             % " ".join(want))
    # The target: a Service that keeps the engine on its node, to kvbankd's --listen port.
    target = extra_target(ec)
    host_name, _, port = target.rpartition(":")
    parts = host_name.split(".")
    svc = next((s for s in by_kind.get("Service", [])
                if len(parts) >= 3 and parts[2] == "svc" and s["metadata"]["name"] == parts[0]
                and s["metadata"].get("namespace") == parts[1]), None)
    c.expect(svc is not None and svc["metadata"].get("namespace") ==
             sw["metadata"].get("namespace") and selects(svc["spec"]["selector"], slabels),
             "kvbank_target %s is a Service of kvbankd's pods" % target)
    if svc is None:
        return
    c.expect(svc["spec"].get("internalTrafficPolicy") == "Local",
             "Service %s: internalTrafficPolicy Local (each engine its own node's kvbankd)"
             % svc["metadata"]["name"])
    named = {p["name"]: p["containerPort"] for p in sc.get("ports", [])}
    sp: dict = next((p for p in svc["spec"]["ports"] if str(p["port"]) == port), {})
    tp = sp.get("targetPort", sp.get("port"))
    c.expect(named.get(tp, tp) == port_of(sflags["--listen"]),
             "Service port %s -> targetPort %s -> kvbankd's --listen=%s"
             % (port, tp, sflags["--listen"]))
    # The NetworkPolicy of kvbankd's pods admits the engine's pods to the gRPC port.
    admitted = any(selects(np["spec"]["podSelector"]["matchLabels"], slabels) and
                   admits(np, elabels, "grpc") for np in by_kind.get("NetworkPolicy", []))
    c.expect(admitted, "kvbankd's NetworkPolicy admits the engine's pods to port grpc")


def extra_target(container):
    return transfer_config(container).get("kv_connector_extra_config", {}).get(
        "kvbank_target", "")


def flags_port(address):
    return address.rsplit(":", 1)[1]


def split(rendered, groups, core_out, crd_out):
    groups = set(groups.split(","))
    core: list = []
    crd: list = []
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
