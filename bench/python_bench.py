#!/usr/bin/env python3
"""python_bench: the Python SDK (kvbank) against the C++ SDK (kvbank::Client), same server, same
run.

    python_bench.py [--build build/release] [--reps N] [--mib 2,16,128] [--quick]

Starts kvbankd (--no-auth, loopback, port 0) from the build, registers llama-3.1-8b in bf16
(128 KiB of payload per token) and, for each payload size, measures in pairs back to back:

  append:     Client.append of the whole payload (numpy uint8 array) to a new sequence, against
              Client::Append of the same size by bench/sdk_timing (sequence create / free untimed)
  fetch_into: Client.fetch_into a reused numpy array, against Client::FetchInto a reused buffer

The C++ side is sdk_timing, a child process driven over a pipe, so the pairs interleave. One
warm-up pair per size, then --reps pairs; GB/s columns are medians, the ratio (python / C++
throughput) is the median of the per-pair ratios. Run it with a Python where `kvbank` is
installed (ctest -L python's venv: ~/.cache/kvbank-venv/bin/python).
"""

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import kvbank

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MiB = 1 << 20
MODEL = "bench"


class Server:
    def __init__(self, kvbankd, pool_bytes, extra_args=()):
        self.dir = tempfile.mkdtemp(prefix="kvbank-pybench-")
        port_file = os.path.join(self.dir, "port")
        self.log = open(os.path.join(self.dir, "server.log"), "wb")
        self.proc = subprocess.Popen(
            [kvbankd, "--listen=127.0.0.1:0", "--port-file=" + port_file, "--no-auth",
             "--models=", "--pool-bytes=%d" % pool_bytes, "--max-pool-bytes=%d" % pool_bytes,
             *extra_args],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        port = 0
        while time.monotonic() < deadline and port <= 0:
            if self.proc.poll() is not None:
                sys.exit("kvbankd exited with %d; see %s" % (self.proc.returncode, self.dir))
            try:
                with open(port_file) as f:
                    port = int(f.read().strip() or 0)
            except (OSError, ValueError):
                port = 0
            time.sleep(0.01)
        if port <= 0:
            self.proc.kill()
            sys.exit("kvbankd wrote no port file within 30 s")
        self.target = "127.0.0.1:%d" % port

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Cxx:
    """bench/sdk_timing over a pipe: one command, one answer line."""

    def __init__(self, binary, target):
        self.proc = subprocess.Popen([binary, "--target", target, "--model", MODEL],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        if not answer:
            sys.exit("sdk_timing failed on '%s' (exit %s)" % (line, self.proc.poll()))
        return answer

    def close(self):
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=30)


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(REPO, "build", "release"))
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--mib", default="2,16,128")
    ap.add_argument("--quick", action="store_true", help="2 and 16 MiB, 3 pairs")
    args = ap.parse_args()
    sizes = [int(x) for x in args.mib.split(",")]
    reps = args.reps
    if args.quick:
        sizes, reps = [2, 16], 3
    kvbankd = os.path.join(args.build, "bin", "kvbankd")
    sdk_timing = os.path.join(args.build, "bin", "sdk_timing")
    for b in (kvbankd, sdk_timing):
        if not os.access(b, os.X_OK):
            sys.exit("%s is missing: build the kvbankd and sdk_timing targets" % b)

    # Per size at most 4 payloads live at once (each side's fetch sequence and append).
    server = Server(kvbankd, pool_bytes=(4 * max(sizes) + 64) * MiB)
    client = kvbank.Client(server.target)
    model = client.ensure_model(preset="llama-3.1-8b", name=MODEL, storage="bf16",
                                pool_bytes=(4 * max(sizes) + 64) * MiB)
    per_token = model.payload_bytes_per_token
    cxx = Cxx(sdk_timing, server.target)
    rng = np.random.default_rng(9002)
    rows = []
    try:
        for mib in sizes:
            tokens = mib * MiB // per_token
            nbytes = tokens * per_token
            bits = rng.integers(0, 1 << 16, nbytes // 2, dtype=np.uint16) & np.uint16(0x3FFF)
            payload = bits.view(np.uint8)
            out = np.zeros(nbytes, dtype=np.uint8)
            fetch_seq = client.create_sequence(MODEL, lease_s=0)
            client.append(MODEL, fetch_seq.id, payload, num_tokens=tokens)
            if cxx.ask("size %d" % tokens) != "ok":
                sys.exit("sdk_timing: size failed")

            def py_append():
                seq = client.create_sequence(MODEL, lease_s=0)
                t = timed(lambda: client.append(MODEL, seq.id, payload, num_tokens=tokens))
                client.free(MODEL, seq.id)
                return t

            def py_fetch():
                return timed(lambda: client.fetch_into(MODEL, fetch_seq.id, out))

            result = {}
            for op, py_fn in (("append", py_append), ("fetch_into", py_fetch)):
                cxx_cmd = "append" if op == "append" else "fetch"
                py_s, cxx_s, ratios = [], [], []
                for rep in range(reps + 1):  # the first pair warms up
                    # Alternate which side goes first: neither always gets the warmer cache.
                    if rep % 2 == 0:
                        c = float(cxx.ask(cxx_cmd))
                        p = py_fn()
                    else:
                        p = py_fn()
                        c = float(cxx.ask(cxx_cmd))
                    if rep == 0:
                        continue
                    py_s.append(p)
                    cxx_s.append(c)
                    ratios.append(c / p)  # python / C++ throughput
                result[op] = (nbytes / statistics.median(cxx_s) / 1e9,
                              nbytes / statistics.median(py_s) / 1e9, statistics.median(ratios))
            if cxx.ask("check") != "ok" or out.tobytes() != payload.tobytes():
                sys.exit("fetched bytes differ from the payload")
            client.free(MODEL, fetch_seq.id)
            rows.append((mib, tokens, result))
            print("%4d MiB done" % mib, file=sys.stderr, flush=True)
    finally:
        cxx.close()
        client.close()
        server.stop()

    print("| payload | tokens | op | C++ GB/s | Python GB/s | ratio (py / C++) |")
    print("|---:|---:|---|---:|---:|---:|")
    for mib, tokens, result in rows:
        for op in ("append", "fetch_into"):
            c, p, r = result[op]
            print("| %d MiB | %d | %s | %.2f | %.2f | %.2f |" % (mib, tokens, op, c, p, r))
    print("\n%d pairs per row after one warm-up pair; medians; kvbankd and both clients on one "
          "machine over loopback." % reps)


if __name__ == "__main__":
    main()
