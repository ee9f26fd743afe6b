#!/usr/bin/env python3
"""A client generated from proto/ by a stock Python toolchain drives kvbankd through a lifecycle.

Stubs are generated at test time into a temp dir, with `python3 -m grpc_tools.protoc` when that
protoc understands the proto (proto3 `optional` needs protoc >= 3.15; Debian 12's
python3-grpc-tools bundles 3.5.1), else with the system's `protoc` and `grpc_python_plugin`
(Debian: protobuf-compiler, protobuf-compiler-grpc). Runtime: python3-grpcio and its protobuf.

  python_lifecycle_test.py --kvbankd build/bin/kvbankd --proto-dir proto
  python_lifecycle_test.py --probe --proto-dir proto    # exit 0 iff stubs generate and import
"""

import argparse
import importlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

SEED = 6001
MiB = 1 << 20


def generate_stubs(proto_dir, out_dir):
    """Generates kvbank/v1 stubs into out_dir; returns the command that worked."""
    proto = os.path.join(proto_dir, "kvbank", "v1", "kvbank.proto")
    commands = [
        [sys.executable, "-m", "grpc_tools.protoc", "-I", proto_dir, "--python_out", out_dir,
         "--grpc_python_out", out_dir, proto],
    ]
    protoc, plugin = shutil.which("protoc"), shutil.which("grpc_python_plugin")
    if protoc and plugin:
        commands.append([protoc, "-I", proto_dir, "--python_out", out_dir, "--grpc_python_out",
                         out_dir, "--plugin=protoc-gen-grpc_python=" + plugin, proto])
    failures = []
    for cmd in commands:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode == 0:
            return cmd
        failures.append("%s: %s" % (" ".join(cmd[:3]), r.stderr.strip().splitlines()[-1:]))
    raise RuntimeError("no generator could compile %s: %s" % (proto, "; ".join(failures)))


def import_stubs(out_dir):
    sys.path.insert(0, out_dir)
    pb = importlib.import_module("kvbank.v1.kvbank_pb2")
    pbg = importlib.import_module("kvbank.v1.kvbank_pb2_grpc")
    return pb, pbg


class Failure(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Failure(what)
    print("  ok: " + what)


def expect_code(grpc, fn, code, needle, what):
    try:
        fn()
    except grpc.RpcError as e:
        check(e.code() == code and needle in e.details(),
              "%s -> %s (%s)" % (what, e.code().name, e.details()))
        return
    raise Failure("%s: succeeded, expected %s" % (what, code.name))


class Server:
    """kvbankd on a loopback port, its log in a temp dir."""

    def __init__(self, kvbankd, tmp, flags):
        self.port_file = os.path.join(tmp, "port")
        self.log_path = os.path.join(tmp, "server.log")
        self.log = open(self.log_path, "wb")
        args = [kvbankd, "--listen=127.0.0.1:0", "--port-file=" + self.port_file,
                "--no-auth"] + flags
        print("[server] " + " ".join(args))
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        self.port = 0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise Failure("kvbankd exited with %s before serving:\n%s" %
                              (self.proc.returncode, self.text()))
            try:
                with open(self.port_file) as f:
                    self.port = int(f.read().strip() or 0)
            except (OSError, ValueError):
                pass
            if self.port > 0:
                return
            time.sleep(0.01)
        self.kill()
        raise Failure("kvbankd wrote no port file within 20 s:\n" + self.text())

    def text(self):
        self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self, timeout=30):
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise Failure("kvbankd did not exit within %d s of SIGTERM" % timeout)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def payload_layout(num_layers, heads, head_dim, elem, n):
    """Byte ranges of a dense payload of n tokens: per layer K [heads][n][head_dim] then V."""
    row = head_dim * elem
    layer = 2 * heads * n * row
    return layer, row


def slice_payload(payload, n, num_layers, heads, head_dim, elem, t0, t1, l0, l1):
    """The payload a fetch of tokens [t0, t1) x layers [l0, l1) returns, cut from a full one."""
    layer_bytes, row = payload_layout(num_layers, heads, head_dim, elem, n)
    out = bytearray()
    for layer in range(l0, l1):
        base = layer * layer_bytes
        for part in range(2):  # K, then V
            for h in range(heads):
                start = base + (part * heads + h) * n * row
                out += payload[start + t0 * row:start + t1 * row]
    return bytes(out)


def run(args):
    import grpc

    tmp = tempfile.mkdtemp(prefix="kvbank-py-")
    server = None
    try:
        cmd = generate_stubs(args.proto_dir, tmp)
        print("stubs: " + " ".join(cmd[:3]))
        pb, pbg = import_stubs(tmp)
        server = Server(args.kvbankd, tmp, ["--models=", "--max-pool-bytes=1GiB"])
        target = "127.0.0.1:%d" % server.port
        options = [("grpc.max_receive_message_length", 4 * MiB),
                   ("grpc.max_send_message_length", 4 * MiB)]
        with grpc.insecure_channel(target, options=options) as channel:
            grpc.channel_ready_future(channel).result(timeout=20)
            lifecycle(grpc, pb, pbg, channel)
        code = server.stop()
        check(code == 0, "kvbankd exits 0 on SIGTERM (got %s)" % code)
        print("python_lifecycle: 1 passed, 0 failed")
        return 0
    except Exception as e:  # report, with the server's log, and fail
        print("FAILED: %s: %s" % (type(e).__name__, e))
        if server is not None:
            server.kill()
            print("---- kvbankd log ----\n" + server.text() + "---- end of kvbankd log ----")
        print("python_lifecycle: 0 passed, 1 failed")
        return 1
    finally:
        if server is not None:
            server.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def lifecycle(grpc, pb, pbg, channel):
    timeout = 30
    # Health: grpc.health.v1.Health/Check on the raw channel (empty request = service ""); the
    # reply HealthCheckResponse{status: SERVING} encodes as 08 01.
    check_health = channel.unary_unary("/grpc.health.v1.Health/Check",
                                       request_serializer=lambda b: b,
                                       response_deserializer=lambda b: b)
    check(check_health(b"", timeout=timeout) == b"\x08\x01", "health check reports SERVING")
    try:
        from grpc_health.v1 import health_pb2, health_pb2_grpc  # optional package
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=timeout)
        check(reply.status == health_pb2.HealthCheckResponse.SERVING, "grpc_health says SERVING")
    except ImportError:
        print("  (grpc_health not installed; the raw health call above stands)")

    stub = pbg.KvBankStub(channel)
    layers, q_heads, kv_heads, head_dim, elem, bt = 3, 4, 2, 32, 2, 16
    spec = pb.ModelSpec(name="py", num_layers=layers, num_q_heads=q_heads, num_kv_heads=kv_heads,
                        head_dim=head_dim, block_tokens=bt, storage_dtype=pb.DTYPE_FP16,
                        pool_bytes=8 * MiB)
    made = stub.EnsureModel(pb.EnsureModelRequest(spec=spec), timeout=timeout)
    check(made.created, "EnsureModel creates the model")
    again = stub.EnsureModel(pb.EnsureModelRequest(spec=spec), timeout=timeout)
    check(not again.created and again.model.fingerprint == made.model.fingerprint,
          "EnsureModel is idempotent")
    bpt = layers * kv_heads * 2 * head_dim * elem
    check(made.model.payload_bytes_per_token == bpt,
          "payload_bytes_per_token = %d" % made.model.payload_bytes_per_token)
    check(made.model.spec.kind == pb.ATTENTION_KIND_GQA, "4 q heads over 2 kv heads resolve to GQA")
    models = stub.ListModels(pb.ListModelsRequest(), timeout=timeout)
    check([m.spec.name for m in models.models] == ["py"], "ListModels lists it")

    seq = stub.CreateSequence(pb.CreateSequenceRequest(model="py"), timeout=timeout)
    check(seq.sequence_id > 0 and seq.length == 0 and seq.lease_ttl_ms > 0,
          "CreateSequence gives id %d with a lease" % seq.sequence_id)
    sid = seq.sequence_id

    rng = random.Random(SEED)
    print("  seed %d" % SEED)
    n1 = 1500  # 1.15 MB: several chunks
    first = rng.randbytes(n1 * bpt)

    def append_messages(header, payload, chunk=256 * 1024):
        yield pb.AppendRequest(header=header, data=payload[:chunk])
        for off in range(chunk, len(payload), chunk):
            yield pb.AppendRequest(data=payload[off:off + chunk])

    header = pb.AppendHeader(model="py", sequence_id=sid, num_tokens=n1, dtype=pb.DTYPE_FP16,
                             payload_bytes=len(first), token_ids=list(range(n1)))
    resp = stub.Append(append_messages(header, first), timeout=timeout)
    check(resp.sequence.length == n1 and resp.sequence.num_blocks == (n1 + bt - 1) // bt,
          "streamed Append of %d bytes commits %d tokens" % (len(first), n1))

    n2 = 7
    second = rng.randbytes(n2 * bpt)
    header = pb.AppendHeader(model="py", sequence_id=sid, num_tokens=n2,
                             token_ids=list(range(n1, n1 + n2)))
    # Sent raw, as one message whose data field comes before its header and which carries a
    # field the server does not know (15, a varint): protobuf's parse accepts that, and so must
    # the server's own decoder.
    raw_append = channel.stream_unary("/kvbank.v1.KvBank/Append",
                                      request_serializer=lambda b: b,
                                      response_deserializer=pb.AppendResponse.FromString)
    message = (pb.AppendRequest(data=second).SerializeToString() + b"\x78\x05" +
               pb.AppendRequest(header=header).SerializeToString())
    resp = raw_append(iter([message]), timeout=timeout)
    total = n1 + n2
    check(resp.sequence.length == total,
          "second Append (token ids; data before header, an unknown field) brings it to %d" % total)

    def fetch(req):
        head, data = None, bytearray()
        for msg in stub.Fetch(req, timeout=timeout):
            if msg.HasField("header"):
                if head is not None:
                    raise Failure("fetch stream repeated its header")
                head = msg.header
            data += msg.data
        return head, bytes(data)

    # The whole sequence: the two appends, per layer K then V, concatenated along tokens.
    want = bytearray()
    layer_bytes1, row = payload_layout(layers, kv_heads, head_dim, elem, n1)
    layer_bytes2, _ = payload_layout(layers, kv_heads, head_dim, elem, n2)
    for layer in range(layers):
        for part in range(2):
            for h in range(kv_heads):
                s1 = layer * layer_bytes1 + (part * kv_heads + h) * n1 * row
                s2 = layer * layer_bytes2 + (part * kv_heads + h) * n2 * row
                want += first[s1:s1 + n1 * row] + second[s2:s2 + n2 * row]
    want = bytes(want)
    head, data = fetch(pb.FetchRequest(model="py", sequence_id=sid))
    check(head.num_tokens == total and head.layer_begin == 0 and head.layer_end == layers and
          head.dtype == pb.DTYPE_FP16 and head.payload_bytes == len(want),
          "Fetch header describes %d tokens x %d layers" % (total, layers))
    check(data == want, "Fetch returns every byte appended (%d bytes)" % len(data))

    t0, t1, l0, l1 = 5, 40, 1, 3
    head, data = fetch(pb.FetchRequest(model="py", sequence_id=sid, token_begin=t0, token_end=t1,
                                       layer_begin=l0, layer_end=l1))
    check(head.token_begin == t0 and head.num_tokens == t1 - t0 and
          data == slice_payload(first, n1, layers, kv_heads, head_dim, elem, t0, t1, l0, l1),
          "Fetch of tokens [%d, %d) x layers [%d, %d) is bit-exact" % (t0, t1, l0, l1))

    def stats():
        r = stub.GetStats(pb.GetStatsRequest(model="py"), timeout=timeout)
        return r.models[0]

    used = stats().blocks_used
    check(used == (total + bt - 1) // bt, "GetStats: %d blocks used" % used)
    fork = stub.Fork(pb.ForkRequest(model="py", sequence_id=sid), timeout=timeout)
    check(fork.sequence_id != sid and fork.length == total, "Fork copies the length")
    check(stats().blocks_used == used + 1, "Fork adds only the partial last block")
    _, data = fetch(pb.FetchRequest(model="py", sequence_id=fork.sequence_id))
    check(data == want, "the fork reads the parent's bytes")

    cut = stub.Truncate(pb.TruncateRequest(model="py", sequence_id=fork.sequence_id,
                                           num_tokens=20), timeout=timeout)
    check(cut.length == 20 and cut.num_blocks == 2, "Truncate rolls the fork back to 20 tokens")
    _, data = fetch(pb.FetchRequest(model="py", sequence_id=fork.sequence_id))
    check(data == slice_payload(first, n1, layers, kv_heads, head_dim, elem, 0, 20, 0, layers),
          "the truncated fork keeps its first 20 tokens")
    st = stats()
    check(st.sequences == 2 and st.tokens_stored == total + 20 and st.appends == 2,
          "GetStats: 2 sequences, %d tokens, 2 appends" % st.tokens_stored)

    renewed = stub.RenewLease(pb.RenewLeaseRequest(model="py", sequence_id=sid), timeout=timeout)
    check(renewed.length == total, "RenewLease answers with the sequence")
    for s in (sid, fork.sequence_id):
        info = stub.GetSequence(pb.GetSequenceRequest(model="py", sequence_id=s), timeout=timeout)
        freed = stub.Free(pb.FreeRequest(model="py", sequence_id=s), timeout=timeout)
        check(freed.blocks_released == info.num_blocks,
              "Free releases %d blocks" % freed.blocks_released)
    st = stats()
    check(st.blocks_used == 0 and st.sequences == 0, "the pool is empty again")

    # Prefix sharing: the freed sequence's full blocks stay cached, and a prompt with the same
    # token ids, created twice, attaches them both times instead of taking new blocks.
    full = total // bt
    check(st.blocks_cached == full, "its %d full blocks stay cached after Free" % st.blocks_cached)
    prompt = pb.CreateSequenceRequest(model="py", prompt_token_ids=list(range(total)))
    shared = [stub.CreateSequence(prompt, timeout=timeout) for _ in range(2)]
    check(all(s.cached_tokens == full * bt and s.length == full * bt for s in shared),
          "the prompt created twice reports %d cached tokens both times" % (full * bt))
    st = stats()
    check(st.blocks_used == full and st.blocks_cached == 0,
          "both sequences share the same %d blocks" % st.blocks_used)
    check(st.prefix_query_tokens == 2 * total and st.prefix_hit_tokens == 2 * full * bt,
          "prefix counters: %d queried, %d hit" % (st.prefix_query_tokens, st.prefix_hit_tokens))
    cut = (n1 // bt) * bt  # blocks that hold only the first append's tokens
    _, data = fetch(pb.FetchRequest(model="py", sequence_id=shared[1].sequence_id, token_end=cut))
    check(data == slice_payload(first, n1, layers, kv_heads, head_dim, elem, 0, cut, 0, layers),
          "the shared blocks read back the first sequence's bytes")
    for s in shared:
        stub.Free(pb.FreeRequest(model="py", sequence_id=s.sequence_id), timeout=timeout)
    st = stats()
    check(st.blocks_used == 0 and st.blocks_cached == full, "freed again, the blocks stay cached")

    expect_code(grpc, lambda: stub.GetSequence(
        pb.GetSequenceRequest(model="py", sequence_id=sid), timeout=timeout),
        grpc.StatusCode.FAILED_PRECONDITION, "freed", "GetSequence after Free")
    expect_code(grpc, lambda: stub.CreateSequence(pb.CreateSequenceRequest(model="nope"),
                                                  timeout=timeout),
                grpc.StatusCode.NOT_FOUND, "nope", "CreateSequence in an unknown model")
    bad = pb.AppendHeader(model="py", sequence_id=sid, num_tokens=0)
    expect_code(grpc, lambda: stub.Append(iter([pb.AppendRequest(header=bad)]), timeout=timeout),
                grpc.StatusCode.INVALID_ARGUMENT, "num_tokens", "empty Append")
    expect_code(grpc, lambda: raw_append(iter([b"\x0a\xff"]), timeout=timeout),
                grpc.StatusCode.INVALID_ARGUMENT, "not a kvbank.v1.AppendRequest",
                "Append of bytes that are not an AppendRequest")
    # Fetch and FetchBlocks parse their own requests (raw methods on the server): bytes that are
    # not a request get INVALID_ARGUMENT naming the type. (0x0a 0xff: a field whose length runs
    # past the end.)
    for method, kind in (("Fetch", "FetchRequest"), ("FetchBlocks", "FetchBlocksRequest")):
        raw = channel.unary_stream("/kvbank.v1.KvBank/" + method,
                                   request_serializer=lambda b: b,
                                   response_deserializer=lambda b: b)
        expect_code(grpc, lambda: list(raw(b"\x0a\xff", timeout=timeout)),
                    grpc.StatusCode.INVALID_ARGUMENT, "kvbank.v1." + kind,
                    "%s of bytes that are not a %s" % (method, kind))


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kvbankd")
    p.add_argument("--proto-dir", required=True)
    p.add_argument("--probe", action="store_true",
                   help="only check that stubs generate and import (exit 0 iff they do)")
    args = p.parse_args()
    if args.probe:
        tmp = tempfile.mkdtemp(prefix="kvbank-py-probe-")
        try:
            import grpc  # noqa: F401  the runtime must be there too
            cmd = generate_stubs(args.proto_dir, tmp)
            import_stubs(tmp)
            print("stubs generate with: " + " ".join(cmd[:3]))
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
