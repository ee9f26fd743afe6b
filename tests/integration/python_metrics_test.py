#!/usr/bin/env python3
"""kvbankd's /metrics read by Prometheus' own Python parser.

Starts kvbankd with --metrics-listen=127.0.0.1:0, drives it through stubs generated from proto/
(as python_lifecycle_test.py does: create, append, fetch, free, a prefix hit, a refused call, a
model whose name needs escaping), scrapes /metrics and parses it with
prometheus_client.parser.text_string_to_metric_families (Debian: python3-prometheus-client).
Every family must parse and carry HELP and TYPE; the key figures must match the work done.

  python_metrics_test.py --kvbankd build/bin/kvbankd --proto-dir proto
  python_metrics_test.py --probe --proto-dir proto    # exit 0 iff prometheus_client and stubs work
"""

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import python_lifecycle_test as lifecycle  # noqa: E402  generate_stubs, Server, check

check = lifecycle.check
Failure = lifecycle.Failure
SEED = 6101
MiB = 1 << 20
MODEL = 'py "m" \\ x'  # a model name whose label value needs escaping


def wait_for_port_file(path, timeout=20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                port = int(f.read().strip() or 0)
            if port > 0:
                return port
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    raise Failure("no metrics port file %s within %d s" % (path, timeout))


def scrape(port):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read().decode("utf-8")


def work(grpc, pb, pbg, channel):
    """Returns what the scrape must show: payload bytes moved, prompt tokens queried and hit."""
    timeout = 30
    stub = pbg.KvBankStub(channel)
    layers, kv_heads, head_dim, elem, bt = 2, 2, 16, 2, 16
    spec = pb.ModelSpec(name=MODEL, num_layers=layers, num_q_heads=4, num_kv_heads=kv_heads,
                        head_dim=head_dim, block_tokens=bt, storage_dtype=pb.DTYPE_FP16,
                        pool_bytes=4 * MiB)
    check(stub.EnsureModel(pb.EnsureModelRequest(spec=spec), timeout=timeout).created,
          "EnsureModel creates %r" % MODEL)
    bpt = layers * kv_heads * 2 * head_dim * elem
    prompt = list(range(1000, 1000 + 2 * bt + 3))  # 2 full blocks and 3 tokens
    create = pb.CreateSequenceRequest(model=MODEL, prompt_token_ids=prompt)
    seq = stub.CreateSequence(create, timeout=timeout)
    rng = random.Random(SEED)
    print("  seed %d" % SEED)
    payload = rng.randbytes(len(prompt) * bpt)
    header = pb.AppendHeader(model=MODEL, sequence_id=seq.sequence_id, num_tokens=len(prompt),
                             dtype=pb.DTYPE_FP16, payload_bytes=len(payload))
    stub.Append(iter([pb.AppendRequest(header=header, data=payload)]), timeout=timeout)
    got = b"".join(m.data for m in stub.Fetch(
        pb.FetchRequest(model=MODEL, sequence_id=seq.sequence_id), timeout=timeout))
    check(got == payload, "Fetch returns the %d bytes appended" % len(payload))
    stub.Free(pb.FreeRequest(model=MODEL, sequence_id=seq.sequence_id), timeout=timeout)
    again = stub.CreateSequence(create, timeout=timeout)
    check(again.cached_tokens == 2 * bt, "the prompt again hits %d cached tokens" % (2 * bt))
    lifecycle.expect_code(grpc, lambda: stub.GetSequence(
        pb.GetSequenceRequest(model=MODEL, sequence_id=seq.sequence_id), timeout=timeout),
        grpc.StatusCode.FAILED_PRECONDITION, "freed", "GetSequence after Free")
    return {"bytes": len(payload), "queried": 2 * len(prompt), "hit": 2 * bt}


def check_families(text, families, want):
    names = [f.name for f in families]
    check(len(names) == len(set(names)), "%d families, no name twice" % len(names))
    for f in families:
        # The parser drops a counter's _total from the family name; the text keeps it.
        raw = f.name + "_total" if f.type == "counter" else f.name
        if not (f.documentation and f.type in ("counter", "gauge", "histogram")):
            raise Failure("family %s: HELP %r, TYPE %r" % (f.name, f.documentation, f.type))
        if ("# HELP %s " % raw) not in text or ("# TYPE %s %s\n" % (raw, f.type)) not in text:
            raise Failure("family %s: no HELP / TYPE line for %s" % (f.name, raw))
    check(True, "every family has HELP and TYPE (counter, gauge or histogram)")
    by_name = {f.name: f for f in families}

    def value(family, sample_name, **labels):
        for s in by_name[family].samples:
            if s.name == sample_name and s.labels == labels:
                return s.value
        raise Failure("no sample %s%s" % (sample_name, labels))

    rpc = "kvbank_rpc_total"
    check(value("kvbank_rpc", rpc, method="CreateSequence", code="OK") == 2,
          "kvbank_rpc_total counts 2 CreateSequence OK")
    check(value("kvbank_rpc", rpc, method="Append", code="OK") == 1 and
          value("kvbank_rpc", rpc, method="Fetch", code="OK") == 1, "1 Append, 1 Fetch OK")
    check(value("kvbank_rpc", rpc, method="GetSequence", code="FAILED_PRECONDITION") == 1,
          "the refused GetSequence counts under its code name")
    hist = by_name["kvbank_rpc_duration_seconds"]
    check(hist.type == "histogram", "kvbank_rpc_duration_seconds is a histogram")
    buckets = [(float(s.labels["le"]), s.value) for s in hist.samples
               if s.name.endswith("_bucket") and s.labels["method"] == "CreateSequence"]
    count = value("kvbank_rpc_duration_seconds", "kvbank_rpc_duration_seconds_count",
                  method="CreateSequence")
    check(buckets[0][0] == 5e-05 and buckets[-1] == (float("inf"), count) and count == 2 and
          all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])),
          "CreateSequence latency buckets: 5e-05 .. +Inf, cumulative, +Inf = count = 2")
    check(value("kvbank_bytes_received", "kvbank_bytes_received_total", plane="grpc") ==
          want["bytes"] and
          value("kvbank_bytes_sent", "kvbank_bytes_sent_total", plane="grpc") == want["bytes"],
          "%d payload bytes in and out over gRPC" % want["bytes"])
    check(value("kvbank_bytes_received", "kvbank_bytes_received_total", plane="shm") == 0,
          "nothing over shared memory")
    # The model name with a double quote and a backslash reads back as it was.
    check(value("kvbank_prefix_cache_queries", "kvbank_prefix_cache_queries_total",
                model=MODEL) == want["queried"] and
          value("kvbank_prefix_cache_hits", "kvbank_prefix_cache_hits_total", model=MODEL) ==
          want["hit"], "prefix cache in tokens: %d queried, %d hit (label %r unescaped intact)" %
          (want["queried"], want["hit"], MODEL))
    check(value("kvbank_tenant_prefix_cache_hits", "kvbank_tenant_prefix_cache_hits_total",
                model=MODEL, tenant="") == want["hit"], "the tenant's row has the same hits")
    total = value("kvbank_blocks_total", "kvbank_blocks_total", model=MODEL)
    used = value("kvbank_blocks", "kvbank_blocks", model=MODEL, state="used")
    free = value("kvbank_blocks", "kvbank_blocks", model=MODEL, state="free")
    cached = value("kvbank_blocks", "kvbank_blocks", model=MODEL, state="cached")
    check(used == 2 and free + cached + used == total, "blocks: %d used of %d" % (used, total))
    check(value("kvbank_kv_cache_usage_perc", "kvbank_kv_cache_usage_perc", model=MODEL) ==
          used / total, "kv_cache_usage_perc = used / total")
    version = [s.labels["version"] for s in by_name["kvbank_build_info"].samples]
    check(len(version) == 1 and version[0], "kvbank_build_info{version=%r}" % version)


def run(args):
    import grpc
    from prometheus_client.parser import text_string_to_metric_families

    tmp = tempfile.mkdtemp(prefix="kvbank-pymetrics-")
    server = None
    try:
        lifecycle.generate_stubs(args.proto_dir, tmp)
        pb, pbg = lifecycle.import_stubs(tmp)
        port_file = os.path.join(tmp, "metrics_port")
        server = lifecycle.Server(args.kvbankd, tmp, [
            "--models=", "--metrics-listen=127.0.0.1:0", "--metrics-port-file=" + port_file])
        metrics_port = wait_for_port_file(port_file)
        with grpc.insecure_channel("127.0.0.1:%d" % server.port) as channel:
            grpc.channel_ready_future(channel).result(timeout=20)
            want = work(grpc, pb, pbg, channel)
        status, content_type, text = scrape(metrics_port)
        check(status == 200 and content_type.startswith("text/plain; version=0.0.4"),
              "GET /metrics: %d, %s" % (status, content_type))
        families = list(text_string_to_metric_families(text))
        check_families(text, families, want)
        try:
            urllib.request.urlopen("http://127.0.0.1:%d/nope" % metrics_port, timeout=10)
            raise Failure("GET /nope succeeded")
        except urllib.error.HTTPError as e:
            check(e.code == 404, "GET /nope: 404")
        code = server.stop()
        check(code == 0, "kvbankd exits 0 on SIGTERM (got %s)" % code)
        print("python_metrics: 1 passed, 0 failed")
        return 0
    except Exception as e:  # report, with the server's log, and fail
        print("FAILED: %s: %s" % (type(e).__name__, e))
        if server is not None:
            server.kill()
            print("---- kvbankd log ----\n" + server.text() + "---- end of kvbankd log ----")
        print("python_metrics: 0 passed, 1 failed")
        return 1
    finally:
        if server is not None:
            server.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kvbankd")
    p.add_argument("--proto-dir", required=True)
    p.add_argument("--probe", action="store_true",
                   help="only check that prometheus_client imports and stubs generate")
    args = p.parse_args()
    if args.probe:
        tmp = tempfile.mkdtemp(prefix="kvbank-pymetrics-probe-")
        try:
            import grpc  # noqa: F401
            from prometheus_client.parser import text_string_to_metric_families  # noqa: F401
            lifecycle.generate_stubs(args.proto_dir, tmp)
            lifecycle.import_stubs(tmp)
            return 0
        except Exception as e:
            print("%s: %s" % (type(e).__name__, e))
            return 1
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if not args.kvbankd:
        p.error("--kvbankd is required")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
