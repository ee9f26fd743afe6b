#!/usr/bin/env python3
"""The same-host topologies (deploy/overlays/sidecar, deploy/overlays/node-local): kvbankd
started as the rendered manifest starts it, and a client started as the rendered engine
container, take kvbank's shared-memory plane.

  topology_test.py --kvbankd build/release/bin/kvbankd --repo . [--overlay sidecar]...
                   [--python PY]

For each overlay:
1. Renders it (kubectl from scripts/check-deploy.sh's venv) and finds kvbankd's container (a
   native sidecar of the engine's pod, or a DaemonSet's) and the engine's (the container whose
   args carry a --kv-transfer-config for kvbank.vllm's KvbankConnector).
2. Maps every volume to one temp dir, as manifest_args_test.py does (rendered_pod.Volumes): a
   Secret's keys (a generated tokens file whose token is the engine's and no admin, the
   engine's token Secret), emptyDirs empty, a hostPath one dir for every pod that mounts that
   node path. The socket folder is the volume both containers mount: ONE temp dir for both.
3. Runs kvbankd's pod's init containers (not the native sidecar) as rendered: the node-local
   one that hands the hostPath folder to kvbankd's uid.
4. Starts kvbankd with the container's args and env (listen addresses on free loopback ports,
   other flag paths in their temp dirs), in a memory cgroup as manifest_args_test.py does
   (KVBANK_MANIFEST_TEST_MEMORY, default 2 GiB), until its startup probe says SERVING.
   --device=cuda:N becomes --device=host and --gpu-memory-utilization is dropped where this
   machine has no GPU (said in the output).
5. Resolves the connector's kvbank_target as the cluster would: 127.0.0.1 is kvbankd's
   --listen only in kvbankd's own pod; a Service name (NAME.NAMESPACE.svc...) goes through the
   rendered Service (its selector, internalTrafficPolicy, port and targetPort) to kvbankd's
   containerPort and --listen; the client dials the loopback port that stands for it.
6. Runs tests/deploy/engine_client.py with the engine container's env (the token from its
   Secret), making the client as the connector makes it from kv_connector_extra_config, then
   ensure_model with the connector's layout (the engine's --block-size and --dtype), and one
   block appended and fetched back. It must take the shm plane ("shm" data_plane), move both
   payloads through it (plane_stats: shm counters moved, none on grpc), read the bytes back
   unchanged and find the model registered (no admin right needed).
7. SIGTERM; kvbankd exits 0 within terminationGracePeriodSeconds.

As root, every process runs as the container would: with the rendered runAsUser, runAsGroup
and fsGroup, no_new_privs, only the capabilities the container adds, and the socket folder's
temp dir bind-mounted at the container's own mountPath in a mount namespace of its own
(kvbankd's --shm-socket unchanged). So the client takes the shm plane only if the engine runs
as kvbankd's uid and mounts the folder at kvbankd's path; the test then shows the converse too:
a client of another uid, and one without the mount, fall back to gRPC. Not as root (or as a
root that may not make mount namespaces), no process can change its uid or mounts: both run as
the current user, the socket folder's path is rewritten to its temp dir for both, the init
containers are not run, and the equal uids and mount paths are asserted from the manifest only.

The client is the Python that imports kvbank (--python; default: run_python_tests.py's venv,
$KVBANK_PY_VENV or ~/.cache/kvbank-venv, then /usr/bin/python3). Exit 77 (a skip): no such
Python, kubectl could not be installed from PyPI, or no memory cgroup can be made here.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from rendered_pod import (
    CONNECTOR,
    DEFAULT_TEST_MEMORY,
    LOOPBACK,
    TENANT,
    TOKEN,
    Failure,
    Kvbankd,
    MemoryCgroup,
    Volumes,
    check,
    expand,
    flag,
    pod_containers,
    render,
    resolve_env,
    rewrite_args,
    rewrite_path,
    secret_files,
    security,
    transfer_config,
    wait_started,
    workload_pods,
)

HERE = os.path.dirname(os.path.abspath(__file__))
OVERLAYS = ("sidecar", "node-local")
VLLM_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
               "float": "fp32"}
CLIENT_TIMEOUT_S = 120


def find(objects):
    """(workload, pod spec, container) of kvbankd and of the engine."""
    kvbankd, engine = [], []
    for w, spec in workload_pods(objects):
        for c in pod_containers(spec):
            if c["name"] == "kvbankd":
                kvbankd.append((w, spec, c))
            config = transfer_config(c)
            if config and config.get("kv_connector") == CONNECTOR:
                engine.append((w, spec, c))
    check(len(kvbankd) == 1 and len(engine) == 1,
          "one kvbankd container (%s) and one engine container with %s (%s)"
          % ([w["metadata"]["name"] for w, _, _ in kvbankd], CONNECTOR,
             [w["metadata"]["name"] for w, _, _ in engine]))
    return kvbankd[0], engine[0]


def pod_key(workload):
    return (workload["kind"], workload["metadata"]["name"])


def user_of(spec, container):
    s = security(spec, container)
    if "runAsUser" not in s:
        raise Failure("container %s sets no runAsUser (the image's user is not known here)"
                      % container["name"])
    return s["runAsUser"], s.get("runAsGroup", s["runAsUser"])


def launcher(spec, container, binds, isolated, cgroup=None, user=None):
    """rendered_pod.py exec ... -- : the container's cgroup, mounts, user and privileges."""
    cmd = [sys.executable, os.path.join(HERE, "rendered_pod.py"), "exec"]
    if cgroup is not None:
        cmd += ["--cgroup", cgroup.path]
    if isolated:
        for dst, src in binds.items():
            cmd += ["--bind", "%s:%s" % (src, dst)]
        uid, gid = user or user_of(spec, container)
        cmd += ["--user", str(uid), "--group", str(gid)]
        fs_group = spec.get("securityContext", {}).get("fsGroup")
        if fs_group is not None:
            cmd += ["--groups", str(fs_group)]
        s = security(spec, container)
        caps = s.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            raise Failure("container %s does not drop ALL capabilities" % container["name"])
        cmd += ["--caps", ",".join(caps.get("add", []))]
        if s.get("allowPrivilegeEscalation") is False:
            cmd.append("--no-new-privs")
    return cmd + ["--"]


def can_act_as_containers():
    """Root that may make mount namespaces and change uid (not, e.g., in a container without
    CAP_SYS_ADMIN): the reason why not, or None."""
    if os.geteuid() != 0:
        return "not root"
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="kvt-") as d:
        os.chmod(d, 0o755)
        probe = [sys.executable, os.path.join(HERE, "rendered_pod.py"), "exec", "--bind",
                 "%s:%s" % (d, d), "--user", "65534", "--group", "65534", "--caps", "",
                 "--no-new-privs", "--", "true"]
        r = subprocess.run(probe, capture_output=True, text=True)
    if r.returncode != 0:
        return "root, but no mount namespace or uid change here: " + \
            (r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[-1]
    return None


def gpu_present():
    return os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")


def find_sdk_python(given):
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    venv = os.environ.get("KVBANK_PY_VENV") or os.path.join(cache, "kvbank-venv")
    candidates = [given] if given else [os.path.join(venv, "bin", "python"), "/usr/bin/python3"]
    tried = []
    for py in candidates:
        if not os.path.exists(py):
            tried.append("%s: missing" % py)
            continue
        r = subprocess.run([py, "-c", "import json, sys, kvbank, numpy; "
                            "print(json.dumps([sys.prefix, sys.base_prefix]))"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            prefix, base = json.loads(r.stdout)
            return py, (prefix if prefix != base else None)
        tried.append("%s: %s" % (py, (r.stderr.strip().splitlines() or ["?"])[-1]))
    print("skipped: no Python imports kvbank (%s); tests/python/run_python_tests.py makes "
          "one (ctest: python_sdk_test)" % "; ".join(tried))
    sys.exit(77)


def resolve_target(target, objects, kv, en, kv_args, ports):
    """The loopback port that stands for the connector's kvbank_target, checked against the
    rendered objects on the way."""
    (kw, _, kc), (ew, _, _) = kv, en
    host, _, port = target.rpartition(":")
    port = int(port)
    listen = flag(kv_args, "--listen")
    listen_host, _, listen_port = listen.rpartition(":")
    if host in LOOPBACK:
        check(pod_key(kw) == pod_key(ew) and port == int(listen_port) and
              listen_host in LOOPBACK + ("0.0.0.0",),
              "kvbank_target %s is kvbankd's --listen=%s in the engine's own pod"
              % (target, listen))
        return ports[port]
    parts = host.split(".")
    check(len(parts) >= 3 and parts[2] == "svc",
          "kvbank_target %s names a Service (NAME.NAMESPACE.svc...)" % target)
    services = [o for o in objects if o["kind"] == "Service" and
                o["metadata"]["name"] == parts[0] and
                o["metadata"].get("namespace") == parts[1]]
    check(len(services) == 1, "Service %s/%s is in the render" % (parts[1], parts[0]))
    svc = services[0]
    labels = kw["spec"]["template"]["metadata"]["labels"]
    check(svc["metadata"].get("namespace") == kw["metadata"].get("namespace") and
          all(labels.get(k) == v for k, v in svc["spec"]["selector"].items()),
          "Service %s selects kvbankd's pods" % parts[0])
    if kw["kind"] == "DaemonSet":
        check(svc["spec"].get("internalTrafficPolicy") == "Local",
              "Service %s: internalTrafficPolicy Local (the node's own kvbankd)" % parts[0])
    sp = [p for p in svc["spec"]["ports"] if p["port"] == port]
    check(len(sp) == 1, "Service %s has port %d" % (parts[0], port))
    named = {p["name"]: p["containerPort"] for p in kc.get("ports", [])}
    target_port = sp[0].get("targetPort", port)
    container_port = named.get(target_port) if isinstance(target_port, str) else target_port
    check(container_port == int(listen_port),
          "Service port %d -> targetPort %s -> containerPort %s = --listen=%s"
          % (port, target_port, container_port, listen))
    return ports[container_port]


def run_client(py, venv, spec_json, env, binds, isolated, tmp, pod_spec, container, user=None):
    """engine_client.py as the engine's container would run it: its JSON line."""
    script = os.path.join(tmp, "engine_client.py")
    if not os.path.exists(script):
        shutil.copy(os.path.join(HERE, "engine_client.py"), script)
        os.chmod(script, 0o644)
    binds = dict(binds)
    if isolated and venv is not None:
        # The SDK's venv where the container's user can reach it (a home folder may not be).
        sdk = os.path.join(tmp, "sdk")
        os.makedirs(sdk, exist_ok=True)
        binds[sdk] = venv
        py = os.path.join(sdk, os.path.relpath(py, venv))
    cmd = launcher(pod_spec, container, binds, isolated, user=user) + [py, script, spec_json]
    r = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True,
                       timeout=CLIENT_TIMEOUT_S)
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        raise Failure("engine_client.py exited %d:\n%s%s" % (r.returncode, r.stdout, r.stderr))
    return json.loads(lines[-1])


def run_overlay(a, overlay, py, venv):
    print("== overlays/%s" % overlay)
    objects = render(a.repo, overlay)
    kv, en = find(objects)
    (kw, kspec, kc), (ew, espec, ec) = kv, en
    isolated = a.as_containers
    kv_user, en_user = user_of(kspec, kc), user_of(espec, ec)
    check(kv_user == en_user, "the engine runs as kvbankd's uid:gid (engine %d:%d, kvbankd "
          "%d:%d): the SDK hands memory only to a socket of its own uid, and kvbankd makes it "
          "0600" % (en_user + kv_user))
    grace = kspec.get("terminationGracePeriodSeconds", 30)
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="kvt-") as tmp:
        os.chmod(tmp, 0o711)
        files = secret_files(tmp, "%s %s\n" % (TOKEN, TENANT))  # the engine's, not an admin
        vols = Volumes(tmp, objects, files)
        kv_mounts = vols.mounts(pod_key(kw), kspec, kc)
        # The socket's folder and the volume behind it.
        kv_env = resolve_env(kc, objects, files)
        kv_args = [expand(x, kv_env) for x in kc.get("args", [])]
        socket_path = flag(kv_args, "--shm-socket")
        socket_mount = next((m for m in kv_mounts if socket_path.startswith(m + "/")), None)
        check(socket_mount is not None, "--shm-socket=%s lies on a volumeMount" % socket_path)
        socket_dir = kv_mounts[socket_mount]
        # Init containers of kvbankd's pod that run to completion, in order.
        for ic in kspec.get("initContainers", []):
            if ic.get("restartPolicy") == "Always":
                continue
            mounts = vols.mounts(pod_key(kw), kspec, ic)
            argv = [expand(x, kv_env) for x in ic.get("command", []) + ic.get("args", [])]
            if not isolated:
                print("  not run (needs root, mount namespaces): init container %s: %s"
                      % (ic["name"], " ".join(argv)))
                continue
            r = subprocess.run(launcher(kspec, ic, mounts, True) + argv, capture_output=True,
                               text=True, timeout=60)
            check(r.returncode == 0, "init container %s: %s (exit %d%s)"
                  % (ic["name"], " ".join(argv), r.returncode,
                     ": " + r.stderr.strip() if r.stderr.strip() else ""))
        # kvbankd: the socket folder at its own path (as root), the rest rewritten.
        binds = {socket_mount: socket_dir} if isolated else {}
        rewrite = {m: d for m, d in kv_mounts.items() if m not in binds}
        args, ports = rewrite_args(kv_args, rewrite)
        device = flag(args, "--device", "")
        if device.startswith("cuda") and not gpu_present():
            args = [x for x in args if not x.startswith("--gpu-memory-utilization")]
            args = ["--device=host" if x.startswith("--device") else x for x in args]
            print("  no GPU here: --device=%s runs as --device=host, without "
                  "--gpu-memory-utilization" % device)
        memory = int(os.environ.get("KVBANK_MANIFEST_TEST_MEMORY", DEFAULT_TEST_MEMORY))
        cgroup = MemoryCgroup(memory)
        if cgroup.path is None:
            print("skipped: no memory cgroup can be made here (%s)" % "; ".join(cgroup.errors))
            sys.exit(77)
        print("  kvbankd %s" % " ".join(args))
        run_env = dict(kv_env, PATH=os.environ.get("PATH", "/usr/bin:/bin"))
        server = Kvbankd(a.kvbankd, args, run_env, tmp,
                         prefix=launcher(kspec, kc, binds, isolated, cgroup))
        try:
            probe = kc["startupProbe"]
            took = wait_started(server, a.kvbankd, cgroup, ports[probe["grpc"]["port"]], probe)
            check(True, "startupProbe: SERVING after %.1f s" % took)
            sock = os.path.join(socket_dir, os.path.relpath(socket_path, socket_mount))
            st = os.stat(sock)
            check(oct(st.st_mode & 0o777) == oct(0o600) and
                  (not isolated or st.st_uid == kv_user[0]),
                  "the shm socket is mode %o, uid %d" % (st.st_mode & 0o777, st.st_uid))
            if isolated:
                st = os.stat(socket_dir)
                print("  the socket folder: mode %o, uid %d, gid %d"
                      % (st.st_mode & 0o7777, st.st_uid, st.st_gid))
            # The engine: its env, its connector's config, its mounts.
            en_env = resolve_env(ec, objects, files)
            en_args = [expand(x, en_env) for x in ec.get("args", [])]
            config = transfer_config({"args": en_args})
            extra = config.get("kv_connector_extra_config", {})
            check(config.get("kv_connector_module_path") == "kvbank.vllm",
                  "--kv-transfer-config: %s from kvbank.vllm, kv_role %s"
                  % (CONNECTOR, config.get("kv_role")))
            models = (flag(kv_args, "--models") or "").split(",")
            check(extra.get("kvbank_model") in models,
                  "kvbank_model %r is registered at start (--models=%s)"
                  % (extra.get("kvbank_model"), ",".join(models)))
            port = resolve_target(extra["kvbank_target"], objects, kv, en, kv_args, ports)
            en_mounts = vols.mounts(pod_key(ew), espec, ec)
            check(en_mounts.get(socket_mount) == socket_dir,
                  "the engine mounts the socket folder's volume at kvbankd's path %s"
                  % socket_mount)
            en_binds = {m: d for m, d in en_mounts.items() if d == socket_dir} if isolated \
                else {}
            en_rewrite = {m: d for m, d in en_mounts.items() if m not in en_binds}
            client_env = {k: rewrite_path(v, en_rewrite) for k, v in en_env.items()}
            client_env["PATH"] = os.environ.get("PATH", "/usr/bin:/bin")
            dtype = flag(en_args, "--dtype", "")
            spec = {"target": "127.0.0.1:%d" % port, "extra": extra,
                    "block_tokens": int(flag(en_args, "--block-size", "16")),
                    "dtype": VLLM_DTYPES.get(dtype, dtype)}
            got = run_client(py, venv, json.dumps(spec), client_env, en_binds, isolated, tmp,
                             espec, ec)
            print("  client: %s" % json.dumps(got, sort_keys=True))
            check(got["uid"] == (en_user[0] if isolated else os.geteuid()),
                  "the client runs as uid %d" % got["uid"])
            check(got["data_plane"] == "shm", "the client takes the shm plane (data_plane %r; "
                  "the server names %s)" % (got["data_plane"], got["server"].get("shm_socket")))
            error = got.get("ensure_model_error")
            check(error is None and got.get("created") is False,
                  "ensure_model with the connector's layout (--block-size %d, --dtype %s) finds "
                  "the model kvbankd registered%s" % (spec["block_tokens"], dtype,
                                                      ": " + error if error else ""))
            planes = got["planes"]
            shm_calls = sum(planes.get(p, {}).get("calls", 0) for p in ("shm", "shm_staged"))
            shm_bytes = sum(planes.get(p, {}).get("bytes", 0) for p in ("shm", "shm_staged"))
            check(shm_calls >= 2 and shm_bytes >= 2 * got["payload_bytes"] and
                  planes.get("grpc", {}).get("calls", 0) == 0,
                  "append and fetch_into of %d bytes went through shared memory (shm calls %d, "
                  "bytes %d; grpc calls %d)" % (got["payload_bytes"], shm_calls, shm_bytes,
                                                planes.get("grpc", {}).get("calls", 0)))
            check(got["equal"], "the block came back bit-identical (seed %d)" % got["seed"])
            if got["server"].get("cuda_ipc_device") is not None:
                check(got.get("device_plane") == "cuda_ipc",
                      "CUDA tensors would take %s" % got.get("device_plane"))
            if isolated:
                # The converse: another uid, or no mount of the folder, and the plane is gone.
                probe_spec = json.dumps(dict(spec, probe_only=True))
                other = (en_user[0] + 1, en_user[1] + 1)
                got = run_client(py, venv, probe_spec, client_env, en_binds, True, tmp, espec,
                                 ec, user=other)
                check(got["data_plane"] == "grpc",
                      "a client of uid %d with the same mount falls back to gRPC" % other[0])
                got = run_client(py, venv, probe_spec, client_env, {}, True, tmp, espec, ec)
                check(got["data_plane"] == "grpc",
                      "a client of uid %d without the mount falls back to gRPC" % en_user[0])
            server.proc.send_signal(signal.SIGTERM)
            try:
                rc = server.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                raise Failure("kvbankd still running %d s (terminationGracePeriodSeconds) "
                              "after SIGTERM" % grace) from None
            check(rc == 0, "SIGTERM: kvbankd exits %d" % rc)
        except Failure:
            print(server.log_text())
            raise
        finally:
            server.stop()
            cgroup.remove()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kvbankd", required=True)
    p.add_argument("--repo", required=True)
    p.add_argument("--overlay", action="append", choices=OVERLAYS)
    p.add_argument("--python", help="a Python that imports kvbank (default: see above)")
    a = p.parse_args()
    py, venv = find_sdk_python(a.python)
    why_not = can_act_as_containers()
    a.as_containers = why_not is None
    print("client Python: %s%s; processes run %s" % (
        py, " (venv %s)" % venv if venv else "",
        "with their containers' uids and mounts" if why_not is None else
        "as the current user (%s)" % why_not))
    try:
        for overlay in a.overlay or OVERLAYS:
            run_overlay(a, overlay, py, venv)
    except Failure as e:
        print("FAILED: %s" % e)
        return 1
    print("topology_test: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
