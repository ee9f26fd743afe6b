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
import subprocess
import sys
import tempfile
import time
import urllib.request

import grpc

from rendered_pod import (
    DEFAULT_TEST_MEMORY,
    POD,
    SERVING,
    TLS_NAME,
    TOKEN,
    Failure,
    Kvbankd,
    MemoryCgroup,
    check,
    decode_fields,
    expand,
    field,
    fill_volumes,
    health_check,
    identity,
    render,
    resolve_env,
    rewrite_args,
    wait_started,
)


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
        server = Kvbankd(a.kvbankd, args, run_env, tmp, preexec_fn=cgroup.enter)
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
                              "SIGTERM" % grace) from None
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
