#!/usr/bin/env python3
"""mooncake_compare: the kvbank Python SDK against Mooncake Store, same machine, same run.

    mooncake_compare.py [--build build/release] [--reps N] [--mib 2,16,128] [--clients 1,4]
                        [--small-calls N] [--quick]

Run it with the venv of scripts/setup-mooncake-venv.sh (~/.cache/kvbank-mooncake-venv/bin/python):
it needs `kvbank` and Mooncake's `mooncake-transfer-engine-non-cuda` package.

Every party is its own process, all on 127.0.0.1:
  kvbank:   kvbankd from the build (--no-auth, port 0, host memory); llama-3.1-8b in bf16 (128 KiB
            of payload per token).
  Mooncake: mooncake_master with its HTTP metadata server, and one mooncake_client storage node
            holding the store's memory (--protocol=tcp); MC_TCP_BIND_ADDRESS=127.0.0.1.
  Clients:  N worker processes, each with one kvbank.Client and one MooncakeDistributedStore
            (protocol tcp, no memory of its own: every byte crosses loopback to the storage
            node, as every kvbank byte crosses it to kvbankd). Each worker owns two arrays of the
            largest size, registered with Mooncake (register_buffer), used by both systems.

Per size and op, a rep runs both systems back to back (the order alternates per rep), each as:
every worker prepares, the parent releases them together, and aggregate GB/s = N x bytes /
(last worker's end - first worker's start), on CLOCK_MONOTONIC:
  fetch:   kvbank Client.fetch_into (a preallocated numpy array) of a sequence appended before;
           Mooncake get_into (the registered array) of a key put before.
  append:  kvbank Client.append of the whole payload to a new sequence (create and free untimed);
           Mooncake put_from (the registered array) to a new key (remove untimed).
One warm-up rep, then --reps; GB/s columns are medians; ratio = kvbank GB/s / Mooncake GB/s, the
median of per-rep ratios. The first measured fetch of each system is checked against the
payload. Small calls: one worker, p50 of a 4 KiB kvbank fetch_into (one token of a model with 4 KiB
per token) and of a 4 KiB Mooncake get_into, in alternating batches; ratio = kvbank p50 /
Mooncake p50 (below 1: kvbank answers sooner).
"""

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MiB = 1 << 20
MODEL = "bench"
SMALL_MODEL = "small4k"
# 4 layers x (K, V) x 4 kv heads x 64 x fp16 (2 bytes) = 4 KiB per token.
SMALL_LAYOUT = {"name": SMALL_MODEL, "num_layers": 4, "num_q_heads": 4, "num_kv_heads": 4,
                "head_dim": 64, "dtype": "fp16"}
SMALL_BYTES = 4096


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, proc, what, deadline_s=30):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit("%s exited with %d" % (what, proc.returncode))
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    sys.exit("%s did not listen on 127.0.0.1:%d within %d s" % (what, port, deadline_s))


def mooncake_bin(name):
    import mooncake  # the package ships its binaries next to its modules
    path = os.path.join(os.path.dirname(mooncake.__file__), name)
    if not os.access(path, os.X_OK):
        sys.exit("%s is missing or not executable (pip install mooncake-transfer-engine-non-cuda)"
                 % path)
    return path


class Procs:
    """The servers: kvbankd, mooncake_master, mooncake_client. Logs go to a temp folder.
    kvbankd None: Mooncake's two alone (bench/lmcache_bench.py and sglang_bench.py start their
    own kvbankd)."""

    def __init__(self, kvbankd, kvbank_pool, mooncake_segment):
        self.dir = tempfile.mkdtemp(prefix="kvbank-mooncake-")
        self.procs = []
        try:
            self._start_all(kvbankd, kvbank_pool, mooncake_segment)
        except BaseException:
            self.stop()
            raise

    def _start_all(self, kvbankd, kvbank_pool, mooncake_segment):
        # kvbankd
        port_file = os.path.join(self.dir, "port")
        kv = None
        if kvbankd is not None:
            kv = self._start("kvbankd", [kvbankd, "--listen=127.0.0.1:0",
                                         "--port-file=" + port_file, "--no-auth", "--models=",
                                         "--pool-bytes=%d" % kvbank_pool,
                                         "--max-pool-bytes=%d" % kvbank_pool])
        # Mooncake master with the HTTP metadata server in it.
        self.mc_rpc, self.mc_http, metrics = free_port(), free_port(), free_port()
        master = self._start("mooncake_master", [
            mooncake_bin("mooncake_master"), "--rpc_address=127.0.0.1",
            "--rpc_port=%d" % self.mc_rpc, "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            "--http_metadata_server_port=%d" % self.mc_http, "--metrics_host=127.0.0.1",
            "--metrics_port=%d" % metrics, "--enable_metric_reporting=false"])
        self.master_addr = "127.0.0.1:%d" % self.mc_rpc
        self.metadata = "http://127.0.0.1:%d/metadata" % self.mc_http
        wait_port(self.mc_rpc, master, "mooncake_master")
        wait_port(self.mc_http, master, "mooncake_master (HTTP metadata)")
        # The storage node: mounts the segment every client writes to and reads from.
        self._start("mooncake_client", [
            mooncake_bin("mooncake_client"), "--host=127.0.0.1", "--port=%d" % free_port(),
            "--master_server_address=" + self.master_addr, "--metadata_server=" + self.metadata,
            "--protocol=tcp", "--global_segment_size=%d" % mooncake_segment,
            "--local_buffer_size=0"])
        if kv is None:
            return
        deadline = time.monotonic() + 30
        port = 0
        while time.monotonic() < deadline and port <= 0:
            if kv.poll() is not None:
                sys.exit("kvbankd exited with %d; see %s" % (kv.returncode, self.dir))
            try:
                with open(port_file) as f:
                    port = int(f.read().strip() or 0)
            except (OSError, ValueError):
                port = 0
            time.sleep(0.01)
        if port <= 0:
            sys.exit("kvbankd wrote no port file within 30 s")
        self.kvbank_target = "127.0.0.1:%d" % port

    def _start(self, name, argv):
        log = open(os.path.join(self.dir, name + ".log"), "wb")
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.procs.append((name, p))
        return p

    def check_alive(self):
        for name, p in self.procs:
            if p.poll() is not None:
                sys.exit("%s exited with %d; logs in %s" % (name, p.returncode, self.dir))

    def stop(self):
        for name, p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# ---- worker process ------------------------------------------------------------------------


def mooncake_store(master_addr, metadata):
    from mooncake.store import MooncakeDistributedStore
    store = MooncakeDistributedStore()
    # No segment of its own (global_segment_size 0): objects live on the storage node only.
    rc = store.setup("127.0.0.1", metadata, 0, 16 * MiB, "tcp", "", master_addr)
    if rc != 0:
        raise RuntimeError("MooncakeDistributedStore.setup returned %d" % rc)
    return store


def worker(conn, wid, kvbank_target, master_addr, metadata, max_bytes, seed):
    import kvbank
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    try:
        kv = kvbank.Client(kvbank_target)
        mc = mooncake_store(master_addr, metadata)
        payload = np.random.default_rng(seed).integers(0, 1 << 16, max_bytes // 2,
                                                       dtype=np.uint16) & np.uint16(0x3FFF)
        payload = payload.view(np.uint8)
        out = np.zeros(max_bytes, dtype=np.uint8)
        for a in (payload, out):
            rc = mc.register_buffer(a.ctypes.data, a.nbytes)
            if rc != 0:
                raise RuntimeError("register_buffer returned %d" % rc)
        conn.send(("ok",))
    except Exception as e:  # reported to the parent, which stops the run
        conn.send(("error", "%s: %s" % (type(e).__name__, e)))
        return

    state = {}
    counter = [0]

    def new_key():
        counter[0] += 1
        return "w%d-k%d" % (wid, counter[0])

    while True:
        msg = conn.recv()
        cmd = msg[0]
        try:
            if cmd == "quit":
                mc.remove_all(True)
                mc.close()
                kv.close()
                conn.send(("ok",))
                return
            if cmd == "size":  # (size, model, nbytes, tokens): the values fetched later
                _, model, nbytes, tokens = msg
                if state:  # the previous size's values
                    kv.free(state["model"], state["kv_seq"])
                    mc.remove(state["mc_key"], True)
                seq = kv.create_sequence(model, lease_s=0)
                kv.append(model, seq.id, payload[:nbytes], num_tokens=tokens)
                key = new_key()
                rc = mc.put_from(key, payload.ctypes.data, nbytes)
                if rc != 0:
                    raise RuntimeError("put_from %d bytes returned %d" % (nbytes, rc))
                state.update(model=model, nbytes=nbytes, tokens=tokens, kv_seq=seq.id,
                             mc_key=key)
                conn.send(("ok",))
            elif cmd == "op":  # (op, system, op_name): prepare, wait for "go", run, report
                _, system, op = msg
                model, nbytes, tokens = state["model"], state["nbytes"], state["tokens"]
                cleanup = None
                if system == "kvbank" and op == "fetch":
                    def run():
                        kv.fetch_into(model, state["kv_seq"], out[:nbytes])
                elif system == "kvbank" and op == "append":
                    seq = kv.create_sequence(model, lease_s=0)

                    def run():
                        kv.append(model, seq.id, payload[:nbytes], num_tokens=tokens)
                    cleanup = lambda: kv.free(model, seq.id)  # noqa: E731
                elif system == "mooncake" and op == "fetch":
                    def run():
                        n = mc.get_into(state["mc_key"], out.ctypes.data, nbytes)
                        if n != nbytes:
                            raise RuntimeError("get_into returned %d, not %d" % (n, nbytes))
                elif system == "mooncake" and op == "append":
                    key = new_key()

                    def run():
                        rc = mc.put_from(key, payload.ctypes.data, nbytes)
                        if rc != 0:
                            raise RuntimeError("put_from returned %d" % rc)
                    cleanup = lambda: mc.remove(key, True)  # noqa: E731
                else:
                    raise ValueError("unknown op %s %s" % (system, op))
                if op == "fetch":
                    out[:nbytes] = 0  # the check after the call sees only bytes it wrote
                conn.send(("ready",))
                if conn.recv()[0] != "go":
                    raise RuntimeError("expected go")
                t0 = time.monotonic()
                run()
                t1 = time.monotonic()
                if cleanup is not None:
                    cleanup()
                same = None
                if op == "fetch":
                    same = bool(np.array_equal(out[:nbytes], payload[:nbytes]))
                conn.send(("done", t0, t1, same))
            elif cmd == "small":  # (small, calls, batch): p50 of 4 KiB gets, both systems
                _, calls, batch = msg
                seq = kv.create_sequence(SMALL_MODEL, lease_s=0)
                kv.append(SMALL_MODEL, seq.id, payload[:SMALL_BYTES], num_tokens=1)
                key = new_key()
                if mc.put_from(key, payload.ctypes.data, SMALL_BYTES) != 0:
                    raise RuntimeError("put_from 4 KiB failed")
                small_out = out[:SMALL_BYTES]
                kv_t, mc_t = [], []
                for _ in range(3):  # warm up
                    kv.fetch_into(SMALL_MODEL, seq.id, small_out)
                    mc.get_into(key, out.ctypes.data, SMALL_BYTES)
                deadline = time.monotonic() + 120
                b = 0
                while len(kv_t) < calls and time.monotonic() < deadline:
                    order = (("kv", "mc") if b % 2 == 0 else ("mc", "kv"))
                    b += 1
                    for who in order:
                        for _ in range(batch):
                            if who == "kv":
                                t0 = time.perf_counter()
                                kv.fetch_into(SMALL_MODEL, seq.id, small_out)
                                kv_t.append(time.perf_counter() - t0)
                            else:
                                t0 = time.perf_counter()
                                n = mc.get_into(key, out.ctypes.data, SMALL_BYTES)
                                mc_t.append(time.perf_counter() - t0)
                                if n != SMALL_BYTES:
                                    raise RuntimeError("get_into 4 KiB returned %d" % n)
                ok = True
                for fetch in (lambda: kv.fetch_into(SMALL_MODEL, seq.id, small_out),
                              lambda: mc.get_into(key, out.ctypes.data, SMALL_BYTES)):
                    small_out[:] = 0
                    fetch()
                    ok = ok and bool(np.array_equal(small_out, payload[:SMALL_BYTES]))
                kv.free(SMALL_MODEL, seq.id)
                mc.remove(key, True)
                conn.send(("small", kv_t, mc_t, ok))
            else:
                raise ValueError("unknown command %r" % (cmd,))
        except Exception as e:
            conn.send(("error", "%s: %s" % (type(e).__name__, e)))
            return


# ---- parent ---------------------------------------------------------------------------------


class Workers:
    def __init__(self, n, procs, max_bytes):
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for i in range(n):
            a, b = ctx.Pipe()
            p = ctx.Process(target=worker, args=(b, i, procs.kvbank_target, procs.master_addr,
                                                 procs.metadata, max_bytes, 1000 + i),
                            daemon=True)
            p.start()
            self.conns.append(a)
            self.procs.append(p)
        for c in self.conns:
            self.recv_check(c, "ok")

    def recv(self, conn, timeout=300):
        if not conn.poll(timeout):
            sys.exit("a worker did not answer within %d s" % timeout)
        msg = conn.recv()
        if msg[0] == "error":
            sys.exit("worker failed: " + msg[1])
        return msg

    def recv_check(self, conn, what):
        msg = self.recv(conn)
        if msg[0] != what:
            sys.exit("worker answered %r, expected %r" % (msg, what))
        return True

    def all(self, msg):
        for c in self.conns:
            c.send(msg)
        for c in self.conns:
            self.recv_check(c, "ok")

    def run_op(self, system, op):
        """Returns (aggregate seconds, every fetch matched the payload or None)."""
        for c in self.conns:
            c.send(("op", system, op))
        for c in self.conns:
            self.recv_check(c, "ready")
        for c in self.conns:
            c.send(("go",))
        answers = [self.recv(c) for c in self.conns]
        start = min(a[1] for a in answers)
        end = max(a[2] for a in answers)
        same = None if op == "append" else all(a[3] for a in answers)
        return end - start, same

    def close(self):
        for c in self.conns:
            try:
                c.send(("quit",))
            except OSError:  # a worker that failed has gone already
                pass
        for c in self.conns:
            try:
                if c.poll(30):
                    c.recv()
            except (OSError, EOFError):
                pass
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(REPO, "build", "release"))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--mib", default="2,16,128")
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--small-calls", type=int, default=400)
    ap.add_argument("--quick", action="store_true", help="2 and 16 MiB, 3 reps, 100 small calls")
    args = ap.parse_args()
    sizes = [int(x) for x in args.mib.split(",")]
    clients = [int(x) for x in args.clients.split(",")]
    reps, small_calls = args.reps, args.small_calls
    if args.quick:
        sizes, reps, small_calls = [2, 16], 3, 100
    kvbankd = os.path.join(args.build, "bin", "kvbankd")
    if not os.access(kvbankd, os.X_OK):
        sys.exit("%s is missing: build the kvbankd target" % kvbankd)
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"  # inherited by the storage node and workers
    # Mooncake's memcpy shortcut (auto-enabled on TCP-only hosts) serves only replicas in the
    # client's own segment, and these clients have none: every byte goes through the TCP transport
    # to the storage node. An inherited setting is dropped so that runs compare alike.
    os.environ.pop("MC_STORE_MEMCPY", None)

    import kvbank
    max_bytes = max(sizes) * MiB
    nmax = max(clients)
    # Live at once per worker: the value fetched and one appended (2 x size); headroom for
    # allocator rounding.
    pool = 2 * nmax * max_bytes + 256 * MiB
    procs = Procs(kvbankd, kvbank_pool=pool + 128 * MiB, mooncake_segment=2 * pool)
    rows = []
    small = None
    try:
        admin = kvbank.Client(procs.kvbank_target)
        admin.check_serving()
        model = admin.ensure_model(preset="llama-3.1-8b", name=MODEL, storage="bf16",
                                   pool_bytes=pool)
        small_model = admin.ensure_model(SMALL_LAYOUT, pool_bytes=64 * MiB)
        assert small_model.payload_bytes(1) == SMALL_BYTES, small_model
        per_token = model.payload_bytes_per_token
        admin.close()
        # The storage node mounts its segment after it starts: wait until a put succeeds.
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
        probe = mooncake_store(procs.master_addr, procs.metadata)
        buf = np.zeros(4096, dtype=np.uint8)
        probe.register_buffer(buf.ctypes.data, buf.nbytes)
        deadline = time.monotonic() + 60
        while probe.put_from("probe", buf.ctypes.data, buf.nbytes) != 0:
            procs.check_alive()
            if time.monotonic() > deadline:
                sys.exit("Mooncake: no put succeeded within 60 s; logs in %s" % procs.dir)
            time.sleep(0.2)
        probe.remove("probe", True)
        probe.close()

        for n in clients:
            workers = Workers(n, procs, max_bytes)
            try:
                if n == 1:
                    msg = ("small", small_calls, 20)
                    workers.conns[0].send(msg)
                    _, kv_t, mc_t, ok = workers.recv(workers.conns[0])
                    if not ok:
                        sys.exit("4 KiB fetch returned other bytes")
                    small = (statistics.median(kv_t), statistics.median(mc_t), len(kv_t),
                             len(mc_t))
                for mib in sizes:
                    tokens = mib * MiB // per_token
                    nbytes = tokens * per_token
                    workers.all(("size", MODEL, nbytes, tokens))
                    for op in ("fetch", "append"):
                        kv_s, mc_s, ratios = [], [], []
                        for rep in range(reps + 1):  # the first rep warms up
                            order = ("kvbank", "mooncake") if rep % 2 == 0 else ("mooncake",
                                                                                  "kvbank")
                            t = {}
                            for system in order:
                                t[system], same = workers.run_op(system, op)
                                if same is False:
                                    sys.exit("%s %s of %d MiB returned other bytes"
                                             % (system, op, mib))
                            if rep == 0:
                                continue
                            kv_s.append(t["kvbank"])
                            mc_s.append(t["mooncake"])
                            ratios.append(t["mooncake"] / t["kvbank"])  # kvbank / mc GB/s
                        total = n * nbytes
                        rows.append((n, mib, op, total / statistics.median(kv_s) / 1e9,
                                     total / statistics.median(mc_s) / 1e9,
                                     statistics.median(ratios)))
                        print("clients %d, %d MiB %s done" % (n, mib, op), file=sys.stderr,
                              flush=True)
            finally:
                workers.close()
    finally:
        procs.stop()

    print("| clients | payload | op (kvbank / Mooncake) | kvbank GB/s | Mooncake GB/s | "
          "ratio kvbank / Mooncake |")
    print("|---:|---:|---|---:|---:|---:|")
    names = {"fetch": "fetch_into / get_into", "append": "append / put_from"}
    for n, mib, op, kv_gbs, mc_gbs, r in rows:
        print("| %d | %d MiB | %s | %.2f | %.2f | %.2f |" % (n, mib, names[op], kv_gbs, mc_gbs, r))
    if small is not None:
        kv_p50, mc_p50, kn, mn = small
        print("\n4 KiB get p50 (1 client): kvbank fetch_into %.1f us (%d calls), Mooncake get_into "
              "%.1f us (%d calls); ratio kvbank / Mooncake latency %.2f"
              % (kv_p50 * 1e6, kn, mc_p50 * 1e6, mn, kv_p50 / mc_p50))
    print("\n%d reps per row after one warm-up rep; GB/s = clients x payload / wall time of the "
          "slowest; medians. kvbankd, mooncake_master, mooncake_client and the clients on one "
          "machine over loopback." % reps)
    shutil.rmtree(procs.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
