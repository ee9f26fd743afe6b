#!/usr/bin/env python3
"""kvbankd started exactly as the rendered cpu overlay's StatefulSet starts it, probed as the
kubelet probes it.

  manifest_args_test.py --kvbankd build/release/bin/kvbankd --repo .

1. Renders deploy/overlays/cpu (kubectl from scripts/check-deploy.sh's venv) and takes the
   kvbankd container's args and env; env values and $(VAR) references resolve the way
   Kubernetes resolves them, the downward API with test values (the pod is kvbank-0).
2. Maps every volumeMount to a temp dir filled with what its volume would hold: Secrets from a
   generated tokens file and a self-signed TLS certificate and key (openssl), emptyDirs empty.
   Flag values under a mount path move to the temp dir; listen addresses move to free loopback
   ports. Nothing else in the args changes.
3. Starts kvbankd with those args and that env, in a memory cgroup whose limit stands for the
   pod's memory limit, scaled down to the test machine (KVBANK_MANIFEST_TEST_MEMORY bytes,
   default 2 GiB; the pool is --pool-memory-fraction of it); then, as the kubelet: the
   startupProbe's gRPC health check (grpc.health.v1.Health/Check, plaintext, the probe's port
   and service) until SERVING within the probe's budget, then the readiness and liveness
   probes once. Then GET
   /metrics on the metrics port, an authenticated call over TLS on the service port (ListModels,
   checked against --models and the pool against the cgroup's limit; refused without a token
   and without TLS), GetServerInfo's
   --shm-socket, JSON log lines for --log-format=json; then SIGTERM and exit 0 within
   terminationGracePeriodSeconds.

A flag the kvbankd build does not know fails the test with a message that names it. Exit 77
(a skip): kubectl could not be installed from PyPI, or no memory cgroup can be made here (kvbankd
would then size its pool from the whole machine's memory).
"""

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import grpc
import yaml

POD = {  # downward API values of the test pod
    "metadata.name": "kvbank-0",
    "metadata.namespace": "kvbank",
    "metadata.uid": "00000000-0000-0000-0000-000000000000",
    "spec.nodeName": "node-0",
    "spec.serviceAccountName": "kvbank",
    "status.podIP": "127.0.0.1",
    "status.hostIP": "127.0.0.1",
}
TENANT = "tenant-a"
TOKEN = "test-token-for-manifest-args"
TLS_NAME = "kvbank.kvbank.svc"
LISTEN_FLAG = re.compile(r"^--[a-z-]*listen$")
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
DEFAULT_TEST_MEMORY = 2 << 30
SERVING = 1


class Failure(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Failure(what)
    print("  ok: " + what)


# --- protobuf wire format, enough for HealthCheck and ListModels --------------------------------

def encode_string_field(number, text):
    data = text.encode()
    return bytes([number << 3 | 2]) + encode_varint(len(data)) + data


def encode_varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def decode_fields(data):
    """Yields (field number, wire type, value) of one message level."""
    i = 0

    def varint():
        nonlocal i
        shift = value = 0
        while True:
            b = data[i]
            i += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value

    while i < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            yield number, wire, varint()
        elif wire == 2:
            n = varint()
            yield number, wire, data[i:i + n]
            i += n
        elif wire == 1:
            yield number, wire, data[i:i + 8]
            i += 8
        elif wire == 5:
            yield number, wire, data[i:i + 4]
            i += 4
        else:
            raise ValueError("wire type %d" % wire)


def field(data, number, default=None):
    for n, _, v in decode_fields(data):
        if n == number:
            return v
    return default


def identity(b):
    return b


# --- the manifest ---------------------------------------------------------------------------------

def render(repo, overlay):
    r = subprocess.run(["bash", os.path.join(repo, "scripts", "check-deploy.sh"), "--venv-only"],
                       capture_output=True, text=True)
    if r.returncode == 77:
        print(r.stderr)
        sys.exit(77)
    if r.returncode != 0:
        raise Failure("scripts/check-deploy.sh --venv-only failed: " + r.stderr)
    kubectl = os.path.join(r.stdout.strip().splitlines()[-1], "kubectl")
    path = os.path.join(repo, "deploy", "overlays", overlay)
    r = subprocess.run([kubectl, "kustomize", path], capture_output=True, text=True)
    if r.returncode != 0:
        raise Failure("kubectl kustomize %s: %s" % (path, r.stderr))
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def expand(text, env):
    """Kubernetes' $(VAR) expansion: defined names are replaced, $$ is a literal $, anything
    else (an undefined name, an unclosed reference) stays as written."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i):
            end = text.find(")", i + 2)
            name = text[i + 2:end] if end != -1 else None
            if name is not None and name in env:
                out.append(env[name])
                i = end + 1
            else:
                out.append(text[i:i + 2])
                i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def resolve_env(container, objects):
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
            continue
        src = e["valueFrom"]
        if "fieldRef" in src:
            path = src["fieldRef"]["fieldPath"]
            if path not in POD:
                raise Failure("env %s: no test value for the downward API field %s"
                              % (e["name"], path))
            env[e["name"]] = POD[path]
        elif "resourceFieldRef" in src:
            res = src["resourceFieldRef"]["resource"]
            kind, _, what = res.partition(".")
            env[e["name"]] = str(container["resources"][kind][what])
        else:
            raise Failure("env %s: the test cannot resolve %s" % (e["name"], sorted(src)))
    return env


def make_tls(dir_path):
    key, crt = os.path.join(dir_path, "tls.key"), os.path.join(dir_path, "tls.crt")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=" + TLS_NAME, "-addext",
                    "subjectAltName=DNS:%s,DNS:*.kvbank-headless.kvbank.svc" % TLS_NAME,
                    "-keyout", key, "-out", crt], check=True, capture_output=True)
    with open(crt, "rb") as f:
        cert = f.read()
    with open(key, "rb") as f:
        key_pem = f.read()
    return {"tls.crt": cert, "tls.key": key_pem}


def fill_volumes(spec, container, objects, tmp, claims=()):
    """Returns {mountPath: temp dir} and the CA (the self-signed certificate) for the client.
    claims: the StatefulSet's volumeClaimTemplates names (a fresh claim is an empty folder)."""
    secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for name in claims:
        volumes.setdefault(name, {"persistentVolumeClaim": {"claimName": name}})
    tls_files = make_tls(tmp)
    tokens = ("%s %s admin\n" % (TOKEN, TENANT)).encode()
    mounts = {}
    for m in container.get("volumeMounts", []):
        vol = volumes[m["name"]]
        local = os.path.join(tmp, "volumes", m["name"])
        os.makedirs(local, exist_ok=True)
        if "secret" in vol:
            secret = secrets.get(vol["secret"]["secretName"])
            if secret is None:
                raise Failure("volume %s: Secret %s is not in the render"
                              % (m["name"], vol["secret"]["secretName"]))
            for key in secret.get("data", {}):
                if key == "tokens.txt":
                    content = tokens
                elif key in tls_files:
                    content = tls_files[key]
                else:
                    raise Failure("Secret %s: the test does not know what key %s holds"
                                  % (secret["metadata"]["name"], key))
                path = os.path.join(local, key)
                with open(path, "wb") as f:
                    f.write(content)
                os.chmod(path, vol["secret"].get("defaultMode", 0o644))
        elif "emptyDir" not in vol and "persistentVolumeClaim" not in vol:
            raise Failure("volume %s: the test maps only Secrets, emptyDirs and claims"
                          % m["name"])
        if "persistentVolumeClaim" in vol:
            os.chmod(local, 0o2775)  # as a claim with fsGroup is: group-writable, setgid
        if m.get("readOnly"):
            os.chmod(local, 0o555)
        mounts[m["mountPath"].rstrip("/")] = local
    return mounts, tls_files["tls.crt"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rewrite_args(args, mounts):
    """Listen addresses to free loopback ports, paths under mounts to their temp dirs. Returns
    the new args and {container port: loopback port}."""
    ports, out = {}, []
    for a in args:
        name, eq, value = a.partition("=")
        if eq and LISTEN_FLAG.match(name):
            port = free_port()
            ports[int(value.rsplit(":", 1)[1])] = port
            out.append("%s=127.0.0.1:%d" % (name, port))
            continue
        for mount, local in mounts.items():
            if eq and (value == mount or value.startswith(mount + "/")):
                a = "%s=%s%s" % (name, local, value[len(mount):])
                break
        out.append(a)
    return out, ports


# --- the kubelet's side ---------------------------------------------------------------------------

def health_check(port, service, timeout_s):
    """grpc.health.v1.Health/Check over plaintext: the status number, or None if no answer."""
    with grpc.insecure_channel("127.0.0.1:%d" % port) as channel:
        call = channel.unary_unary(HEALTH_CHECK, request_serializer=identity,
                                   response_deserializer=identity)
        try:
            reply = call(encode_string_field(1, service), timeout=timeout_s)
        except grpc.RpcError as e:
            return None, "%s: %s" % (e.code().name, e.details())
        return field(reply, 1, 0), None


class MemoryCgroup:
    """A child of this process's memory cgroup (v2, else v1) with a memory limit, for kvbankd."""

    def __init__(self, limit_bytes):
        self.limit = limit_bytes
        self.path = None
        name = "kvbank-manifest-%d" % os.getpid()
        with open("/proc/self/cgroup") as f:
            entries = [line.rstrip("\n").split(":", 2) for line in f]
        # Own cgroup first, then the root of the mount (a container whose cgroup namespace
        # starts at its own cgroup shows the host's path in /proc/self/cgroup).
        candidates = []
        for hierarchy, controllers, path in entries:
            if hierarchy == "0" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
                candidates += [("/sys/fs/cgroup" + path, "memory.max"),
                               ("/sys/fs/cgroup", "memory.max")]
            elif "memory" in controllers.split(","):
                candidates += [("/sys/fs/cgroup/memory" + path, "memory.limit_in_bytes"),
                               ("/sys/fs/cgroup/memory", "memory.limit_in_bytes")]
        self.errors = []
        for base, limit_file in candidates:
            d = os.path.join(base, name)
            if limit_file == "memory.max":
                try:  # cgroup v2: the parent must hand the memory controller to its children
                    with open(os.path.join(base, "cgroup.subtree_control"), "w") as f:
                        f.write("+memory")
                except OSError:
                    pass
            try:
                os.mkdir(d)
            except OSError as e:
                self.errors.append("%s: %s" % (d, e))
                continue
            try:
                with open(os.path.join(d, limit_file), "w") as f:
                    f.write(str(limit_bytes))
                self.path = d
                return
            except OSError as e:
                self.errors.append("%s/%s: %s" % (d, limit_file, e))
                os.rmdir(d)

    def enter(self):
        """Moves the calling process in (a preexec_fn: runs in the child before exec)."""
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def remove(self):
        if self.path is not None:
            deadline = time.monotonic() + 10
            while True:
                try:
                    os.rmdir(self.path)
                    return
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)


class Kvbankd:
    def __init__(self, binary, args, env, tmp, cgroup):
        self.log_path = os.path.join(tmp, "kvbankd.log")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([os.path.abspath(binary)] + args, env=env, cwd=tmp,
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     preexec_fn=cgroup.enter)

    def log_text(self):
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def exited(self):
        return self.proc.poll() is not None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def explain_exit(server, binary, cgroup):
    text = server.log_text()
    if server.proc.returncode == -signal.SIGKILL:
        raise Failure("kvbankd was killed (SIGKILL: out of memory?) in a memory cgroup of %d "
                      "bytes, which stands for the pod's memory limit: its pool "
                      "(--pool-memory-fraction) does not follow the cgroup's limit\n%s"
                      % (cgroup.limit, text))
    m = re.search(r"unknown flag (--[A-Za-z0-9_-]+)", text)
    if m:
        raise Failure("kvbankd (%s) does not know the flag %s that the rendered StatefulSet "
                      "passes: this build predates it (exit %d)\n%s"
                      % (binary, m.group(1), server.proc.returncode, text))
    raise Failure("kvbankd exited %d before its startup probe passed:\n%s"
                  % (server.proc.returncode, text))


def wait_started(server, binary, cgroup, port, probe):
    """Polls like the startupProbe until SERVING; its budget is the kubelet's."""
    budget = probe.get("initialDelaySeconds", 0) + \
        probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
    timeout = probe.get("timeoutSeconds", 1)
    service = probe["grpc"].get("service", "")
    deadline = time.monotonic() + budget
    last = None
    while time.monotonic() < deadline:
        if server.exited():
            explain_exit(server, binary, cgroup)
        status, last = health_check(port, service, timeout)
        if status == SERVING:
            return budget - (deadline - time.monotonic())
        time.sleep(0.1)
    raise Failure("startupProbe: no SERVING for %r on port %d within %d s (last: %s)\n%s"
                  % (service, port, budget, last, server.log_text()))


def tls_channel(port, ca):
    creds = grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.secure_channel("127.0.0.1:%d" % port, creds,
                               options=[("grpc.ssl_target_name_override", TLS_NAME)])


def kvbank_call(channel, method, token, timeout_s=10):
    call = channel.unary_unary("/kvbank.v1.KvBank/" + method, request_serializer=identity,
                               response_deserializer=identity)
    md = [("authorization", "Bearer " + token)] if token else []
    return call(b"", metadata=md, timeout=timeout_s)


def run(a):
    objects = render(a.repo, a.overlay)
    sts = next(o for o in objects if o["kind"] == "StatefulSet")
    spec = sts["spec"]["template"]["spec"]
    container = next(c for c in spec["containers"] if c["name"] == "kvbankd")
    grace = spec.get("terminationGracePeriodSeconds", 30)
    print("rendered overlays/%s: %d objects; kvbankd %s" % (a.overlay, len(objects),
                                                          " ".join(container["args"])))
    env = resolve_env(container, objects)
    check(env.get("POD_NAME") == POD["metadata.name"], "POD_NAME from the downward API")
    args = [expand(x, env) for x in container.get("args", [])]
    check("--replica-name=kvbank-0" in args, "--replica-name=$(POD_NAME) expands to kvbank-0")
    with tempfile.TemporaryDirectory(prefix="kvbank-manifest-") as tmp:
        claims = [c["metadata"]["name"] for c in sts["spec"].get("volumeClaimTemplates", [])]
        mounts, ca = fill_volumes(spec, container, objects, tmp, claims)
        args, ports = rewrite_args(args, mounts)
        for flag in ("--auth-tokens-file", "--tls-cert", "--tls-key"):
            value = next((x.split("=", 1)[1] for x in args if x.startswith(flag + "=")), None)
            check(value is not None and os.path.isfile(value),
                  "%s names a file of its mounted Secret (%s)" % (flag, value))
        probe_ports = {container[p]["grpc"]["port"] for p in
                       ("startupProbe", "readinessProbe", "livenessProbe")}
        check(len(probe_ports) == 1 and probe_ports <= set(ports),
              "the probes' port %s is a --*listen port of the args" % sorted(probe_ports))
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        check({named["grpc"], named["health"], named["metrics"]} <= set(ports),
              "containerPorts grpc, health and metrics are listen ports of the args")
        health_port = ports[probe_ports.pop()]
        run_env = dict(env, PATH=os.environ.get("PATH", "/usr/bin:/bin"))
        print("kvbankd %s" % " ".join(args))
        memory = int(os.environ.get("KVBANK_MANIFEST_TEST_MEMORY", DEFAULT_TEST_MEMORY))
        cgroup = MemoryCgroup(memory)
        if cgroup.path is None:
            print("skipped: no memory cgroup can be made here (%s); without one kvbankd would "
                  "size its pool from the whole machine's memory" % "; ".join(cgroup.errors))
            sys.exit(77)
        print("memory cgroup %s: limit %d bytes (the pod's is %s)"
              % (cgroup.path, memory, container["resources"]["limits"]["memory"]))
        server = Kvbankd(a.kvbankd, args, run_env, tmp, cgroup)
        try:
            took = wait_started(server, a.kvbankd, cgroup, health_port,
                                container["startupProbe"])
            check(True, "startupProbe: SERVING after %.1f s" % took)
            for p in ("readinessProbe", "livenessProbe"):
                probe = container[p]
                status, err = health_check(health_port, probe["grpc"].get("service", ""),
                                           probe.get("timeoutSeconds", 1))
                check(status == SERVING, "%s: SERVING (%s)" % (p, err or status))
            # /metrics on the metrics port.
            url = "http://127.0.0.1:%d/metrics" % ports[named["metrics"]]
            with urllib.request.urlopen(url, timeout=10) as r:
                body = r.read().decode()
                ctype = r.headers.get("Content-Type", "")
            check(ctype.startswith("text/plain"), "GET /metrics: %s" % ctype)
            for metric in ("kvbank_kv_cache_usage_perc", "kvbank_connections",
                           "kvbank_rpc_in_flight"):
                check(re.search(r"^%s(\{| )" % metric, body, re.M) is not None,
                      "/metrics has %s" % metric)
            # An authenticated call over TLS on the service port.
            service_port = ports[named["grpc"]]
            models = [m for m in next(x for x in args if x.startswith("--models=")).split("=", 1)[1]
                      .split(",") if m]
            with tls_channel(service_port, ca) as channel:
                reply = kvbank_call(channel, "ListModels", TOKEN)
                infos = [v for n, _, v in decode_fields(reply) if n == 1]
                names = [field(field(i, 1, b""), 1, b"").decode() for i in infos]
                devices = [field(i, 6, b"").decode() for i in infos]
                blocks = [field(i, 4, 0) for i in infos]
                check(names == models and all(b > 0 for b in blocks),
                      "ListModels over TLS with a bearer token: %s on %s, %s blocks"
                      % (names, devices, blocks))
                fraction = float(next(x for x in args if x.startswith(
                    "--pool-memory-fraction=")).split("=", 1)[1])
                budget = fraction * memory
                for info, n in zip(infos, blocks):
                    pool = n * field(info, 3, 0)
                    check(0.9 * budget <= pool <= budget,
                          "pool %d bytes = --pool-memory-fraction %.2f of the %d-byte limit"
                          % (pool, fraction, memory))
                info = kvbank_call(channel, "GetServerInfo", TOKEN)
                shm = field(info, 2, b"").decode()
                check(shm.startswith(mounts.get("/run/kvbank", "/nonexistent")) and
                      os.path.exists(shm), "GetServerInfo: the shm socket %s is on its emptyDir"
                      % shm)
                try:
                    kvbank_call(channel, "ListModels", None)
                    raise Failure("ListModels without a token succeeded")
                except grpc.RpcError as e:
                    check(e.code() == grpc.StatusCode.UNAUTHENTICATED,
                          "without a token: %s" % e.code().name)
            with grpc.insecure_channel("127.0.0.1:%d" % service_port) as plain:
                try:
                    kvbank_call(plain, "ListModels", TOKEN, timeout_s=5)
                    raise Failure("a plaintext call to the TLS port succeeded")
                except grpc.RpcError as e:
                    check(e.code() == grpc.StatusCode.UNAVAILABLE,
                          "plaintext to the service port: %s" % e.code().name)
            # SIGTERM, as the kubelet sends it after the preStop sleep.
            start = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            try:
                rc = server.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                raise Failure("kvbankd still running %d s (terminationGracePeriodSeconds) after "
                              "SIGTERM" % grace)
            log = server.log_text()
            check(rc == 0, "SIGTERM: exit %d after %.2f s (grace %d s)"
                  % (rc, time.monotonic() - start, grace))
            lines = [x for x in log.splitlines() if x.strip()]
            bad = [x for x in lines if not is_json_object(x)]
            check(lines and not bad, "--log-format=json: %d log lines, all JSON objects%s"
                  % (len(lines), (" (not: %r)" % bad[0]) if bad else ""))
            # The disk tier on the replica's claim: its file is there for the next start.
            for flag_value in (x.split("=", 1)[1] for x in args
                               if x.startswith("--disk-tier-path=")):
                files = [f for f in os.listdir(flag_value) if f.endswith(".kvbank-tier")]
                flushed = [json.loads(x) for x in lines
                           if is_json_object(x) and json.loads(x).get("event") == "tier_flush"]
                check(files and flushed, "--disk-tier-path: %s in the claim's folder, flushed at "
                      "SIGTERM (%s)" % (files, [f.get("msg") for f in flushed]))
        finally:
            server.stop()
            cgroup.remove()
            for local in mounts.values():
                os.chmod(local, 0o755)


def is_json_object(line):
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kvbankd", required=True)
    p.add_argument("--repo", required=True)
    p.add_argument("--overlay", default="cpu")
    a = p.parse_args()
    try:
        run(a)
    except Failure as e:
        print("FAILED: %s" % e)
        return 1
    print("manifest_args_test: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
