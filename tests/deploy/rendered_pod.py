#!/usr/bin/env python3
"""A rendered pod's container on a test machine: what manifest_args_test.py and topology_test.py
share.

The manifest side: render an overlay (kubectl from scripts/check-deploy.sh's venv), resolve a
container's env as Kubernetes does ($(VAR), the downward API, Secrets), fill temp dirs with what
each volume would hold, move flag values under mount paths and listen addresses onto them. The
kubelet's side: its gRPC health probe, a memory cgroup standing for the pod's limit.

  rendered_pod.py exec [--cgroup DIR] [--bind SRC:DST]... [--user UID --group GID
                       [--groups G,...]] [--caps CAP,...] [--no-new-privs] -- ARGV...

runs ARGV as a container would (topology_test.py starts every process through it): in the
memory cgroup DIR; with each SRC bind-mounted at DST in a mount namespace of its own (a DST
that does not exist is made on a tmpfs over its parent, in that namespace only); as UID:GID
with those supplementary groups, only the capabilities CAP (none: all dropped) and
no_new_privs, through util-linux's setpriv. Everything but --cgroup needs root.
"""

import argparse
import ctypes
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

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
WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet")
CONNECTOR = "KvbankConnector"  # kvbank.vllm's vLLM KV connector
LOOPBACK = ("127.0.0.1", "localhost", "::1")


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

def tool_bin(repo):
    """scripts/check-deploy.sh's venv bin folder (made on first use); exits 77 without PyPI."""
    r = subprocess.run(["bash", os.path.join(repo, "scripts", "check-deploy.sh"), "--venv-only"],
                       capture_output=True, text=True)
    if r.returncode == 77:
        print(r.stderr)
        sys.exit(77)
    if r.returncode != 0:
        raise Failure("scripts/check-deploy.sh --venv-only failed: " + r.stderr)
    return r.stdout.strip().splitlines()[-1]


def render(repo, overlay):
    import yaml

    kubectl = os.path.join(tool_bin(repo), "kubectl")
    path = os.path.join(repo, "deploy", "overlays", overlay)
    r = subprocess.run([kubectl, "kustomize", path], capture_output=True, text=True)
    if r.returncode != 0:
        raise Failure("kubectl kustomize %s: %s" % (path, r.stderr))
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def workload_pods(objects):
    """(workload object, pod spec) of every Deployment, DaemonSet and StatefulSet."""
    return [(o, o["spec"]["template"]["spec"]) for o in objects if o["kind"] in WORKLOADS]


def pod_containers(spec):
    """Init containers (native sidecars among them) first, then the containers."""
    return list(spec.get("initContainers", [])) + list(spec.get("containers", []))


def security(spec, container):
    """The container's effective securityContext: the pod's, overridden field by field."""
    pod = spec.get("securityContext", {})
    merged = {k: pod[k] for k in ("runAsUser", "runAsGroup", "runAsNonRoot", "seccompProfile")
              if k in pod}
    merged.update(container.get("securityContext", {}))
    return merged


def flag(args, name, default=None):
    """The value of --name=value or --name value in args."""
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
        if a == name and i + 1 < len(args):
            return args[i + 1]
    return default


def transfer_config(container):
    """The --kv-transfer-config JSON of a vLLM container's args, or None."""
    text = flag(container.get("args", []), "--kv-transfer-config")
    return json.loads(text) if text else None


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


def resolve_env(container, objects, secret_files=None, pod=None):
    """The container's env as Kubernetes resolves it. secret_files: {key: bytes} the test puts
    in Secrets (secret_files()); pod: downward API values (default POD)."""
    pod = POD if pod is None else pod
    secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
            continue
        src = e["valueFrom"]
        if "fieldRef" in src:
            path = src["fieldRef"]["fieldPath"]
            if path not in pod:
                raise Failure("env %s: no test value for the downward API field %s"
                              % (e["name"], path))
            env[e["name"]] = pod[path]
        elif "resourceFieldRef" in src:
            res = src["resourceFieldRef"]["resource"]
            kind, _, what = res.partition(".")
            env[e["name"]] = str(container["resources"][kind][what])
        elif "secretKeyRef" in src and secret_files is not None:
            ref = src["secretKeyRef"]
            secret = secrets.get(ref["name"])
            if secret is None or ref["key"] not in secret.get("data", {}):
                if ref.get("optional"):
                    continue
                raise Failure("env %s: Secret %s with key %s is not in the render"
                              % (e["name"], ref["name"], ref["key"]))
            if ref["key"] not in secret_files:
                raise Failure("env %s: the test does not know what key %s holds"
                              % (e["name"], ref["key"]))
            env[e["name"]] = secret_files[ref["key"]].decode()
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


def secret_files(tmp, tokens_line=None):
    """What the test puts in the rendered Secrets, by key: a tokens file (tokens.txt: one line,
    TOKEN of TENANT, admin unless tokens_line says otherwise), a client's token (token: TOKEN)
    and a self-signed certificate and key (tls.crt, tls.key)."""
    files = make_tls(tmp)
    files["tokens.txt"] = (tokens_line or "%s %s admin\n" % (TOKEN, TENANT)).encode()
    files["token"] = TOKEN.encode()
    return files


class Volumes:
    """Temp dirs standing for volumes, filled as the kubelet fills them: a Secret's keys as files
    (defaultMode; group fsGroup where the test runs as root), emptyDirs and claims empty, a
    hostPath one dir per node path whoever mounts it (DirectoryOrCreate makes it root's, 0755,
    as the kubelet does; Directory needs it made before). Volumes of one pod (pod_key) map to
    one dir each, whichever of its containers mounts them."""

    def __init__(self, root, objects, files):
        self.root = root
        self.files = files
        self.secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
        self.dirs = {}

    @staticmethod
    def key(pod_key, volume):
        if "hostPath" in volume:
            return ("hostPath", volume["hostPath"]["path"].rstrip("/"))
        return (pod_key, volume["name"])

    def dir_for(self, pod_key, volume, fs_group=None):
        key = self.key(pod_key, volume)
        if key in self.dirs:
            return self.dirs[key]
        local = os.path.join(self.root, "v%d" % len(self.dirs))
        name = volume["name"]
        if "hostPath" in volume:
            kind = volume["hostPath"].get("type", "")
            if kind != "DirectoryOrCreate":
                raise Failure("hostPath %s (type %r): made by no pod before this one (a pod "
                              "with type DirectoryOrCreate starts first)" % (key[1], kind))
            os.mkdir(local, 0o755)
        elif "secret" in volume:
            os.mkdir(local)
            self._fill_secret(local, volume, fs_group)
        elif "emptyDir" in volume or "persistentVolumeClaim" in volume:
            os.mkdir(local)
            if "persistentVolumeClaim" in volume:
                os.chmod(local, 0o2775)  # as a claim with fsGroup is: group-writable, setgid
            else:
                os.chmod(local, 0o777 if os.geteuid() == 0 else 0o755)
            if fs_group is not None and os.geteuid() == 0:
                os.chown(local, 0, fs_group)
        else:
            raise Failure("volume %s: the test maps only Secrets, emptyDirs, claims and "
                          "hostPaths" % name)
        self.dirs[key] = local
        return local

    def _fill_secret(self, local, volume, fs_group):
        ref = volume["secret"]
        secret = self.secrets.get(ref["secretName"])
        if secret is None:
            if ref.get("optional"):
                return
            raise Failure("volume %s: Secret %s is not in the render"
                          % (volume["name"], ref["secretName"]))
        for key in secret.get("data", {}):
            if key not in self.files:
                raise Failure("Secret %s: the test does not know what key %s holds"
                              % (secret["metadata"]["name"], key))
            path = os.path.join(local, key)
            with open(path, "wb") as f:
                f.write(self.files[key])
            os.chmod(path, ref.get("defaultMode", 0o644))
            if fs_group is not None and os.geteuid() == 0:
                os.chown(path, 0, fs_group)

    def mounts(self, pod_key, spec, container, claims=()):
        """{mountPath: temp dir} of the container's volumeMounts."""
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for name in claims:
            volumes.setdefault(name, {"name": name,
                                      "persistentVolumeClaim": {"claimName": name}})
        fs_group = spec.get("securityContext", {}).get("fsGroup")
        out = {}
        for m in container.get("volumeMounts", []):
            if m["name"] not in volumes:
                raise Failure("volumeMount %s names no volume of the pod" % m["name"])
            out[m["mountPath"].rstrip("/")] = self.dir_for(pod_key, volumes[m["name"]],
                                                           fs_group)
        return out


def fill_volumes(spec, container, objects, tmp, claims=()):
    """Returns {mountPath: temp dir} and the CA (the self-signed certificate) for the client.
    claims: the StatefulSet's volumeClaimTemplates names (a fresh claim is an empty folder)."""
    files = secret_files(tmp)
    root = os.path.join(tmp, "volumes")
    os.makedirs(root, exist_ok=True)
    volumes = Volumes(root, objects, files)
    mounts = volumes.mounts("pod", spec, container, claims)
    readonly = {m["mountPath"].rstrip("/") for m in container.get("volumeMounts", [])
                if m.get("readOnly")}
    for path in readonly:
        os.chmod(mounts[path], 0o555)
    return mounts, files["tls.crt"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rewrite_path(value, mounts):
    """value with a leading mount path replaced by its temp dir (unchanged if under none)."""
    for mount, local in mounts.items():
        if value == mount or value.startswith(mount + "/"):
            return local + value[len(mount):]
    return value


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
        if eq:
            a = "%s=%s" % (name, rewrite_path(value, mounts))
        out.append(a)
    return out, ports


# --- the kubelet's side ---------------------------------------------------------------------------

def health_check(port, service, timeout_s):
    """grpc.health.v1.Health/Check over plaintext: the status number, or None if no answer."""
    import grpc

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
        assert self.path is not None
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
    """kvbankd with its log in tmp. preexec_fn / prefix: how it is started (cgroup.enter, or a
    `rendered_pod.py exec ... --` argv before the binary)."""

    def __init__(self, binary, args, env, tmp, preexec_fn=None, prefix=()):
        self.log_path = os.path.join(tmp, "kvbankd.log")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(list(prefix) + [os.path.abspath(binary)] + args, env=env,
                                     cwd=tmp, stdout=self.log, stderr=subprocess.STDOUT,
                                     preexec_fn=preexec_fn)

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
    import signal

    text = server.log_text()
    if server.proc.returncode == -signal.SIGKILL:
        raise Failure("kvbankd was killed (SIGKILL: out of memory?) in a memory cgroup of %d "
                      "bytes, which stands for the pod's memory limit: its pool "
                      "(--pool-memory-fraction) does not follow the cgroup's limit\n%s"
                      % (cgroup.limit, text))
    m = re.search(r"unknown flag (--[A-Za-z0-9_-]+)", text)
    if m:
        raise Failure("kvbankd (%s) does not know the flag %s that the rendered manifest "
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


# --- a container's process: rendered_pod.py exec --------------------------------------------------

CLONE_NEWNS = 0x20000
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000


def _libc_call(libc, what, *args):
    if getattr(libc, what)(*args) != 0:
        e = ctypes.get_errno()
        raise OSError(e, "%s%r: %s" % (what, args[:2], os.strerror(e)))


def enter_mounts(binds):
    """A mount namespace of this process's own, with each (src, dst) bind-mounted."""
    libc = ctypes.CDLL(None, use_errno=True)
    _libc_call(libc, "unshare", CLONE_NEWNS)
    _libc_call(libc, "mount", None, b"/", None, MS_REC | MS_PRIVATE, None)
    for src, dst in binds:
        if not os.path.isdir(dst):
            # A tmpfs over the parent, in this namespace only: the host's tree is not touched.
            parent = os.path.dirname(dst)
            if parent == "/" or not os.path.isdir(parent):
                raise OSError("cannot make a mount point for %s" % dst)
            _libc_call(libc, "mount", b"tmpfs", parent.encode(), b"tmpfs", 0, b"mode=0755")
            os.makedirs(dst)
        _libc_call(libc, "mount", src.encode(), dst.encode(), None, MS_BIND, None)


def exec_main(argv):
    p = argparse.ArgumentParser(prog="rendered_pod.py exec")
    p.add_argument("--cgroup")
    p.add_argument("--bind", action="append", default=[])
    p.add_argument("--user", type=int)
    p.add_argument("--group", type=int)
    p.add_argument("--groups", default="")
    p.add_argument("--caps", default="")
    p.add_argument("--no-new-privs", action="store_true")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    cmd = a.argv[1:] if a.argv[:1] == ["--"] else a.argv
    if a.cgroup:
        with open(os.path.join(a.cgroup, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    if a.bind:
        enter_mounts([b.split(":", 1) for b in a.bind])
    if os.geteuid() == 0 and a.user is not None:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            raise OSError("setpriv (util-linux) is needed to run as another user")
        caps = "".join(",+" + c.lower() for c in a.caps.split(",") if c)
        pre = [setpriv, "--reuid=%d" % a.user, "--regid=%d" % a.group,
               "--groups=" + a.groups if a.groups else "--clear-groups",
               "--inh-caps=-all", "--bounding-set=-all" + caps]
        if a.no_new_privs:
            pre.append("--no-new-privs")
        cmd = pre + ["--"] + cmd
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    if sys.argv[1:2] == ["exec"]:
        exec_main(sys.argv[2:])
    print(__doc__, file=sys.stderr)
    sys.exit(2)
