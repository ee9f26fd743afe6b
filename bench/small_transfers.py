#!/usr/bin/env python3
"""small_transfers: what asking costs, from Python: 4 KiB into and out of a registered region.

    small_transfers.py [--build build/release] [-n 3000]

Starts kvbankd as the README's quick start does (no --shm-socket: the same-host plane is on by
default) and registers llama-3.1-8b in bf16 (4 KiB per token and layer). In rounds that
interleave them, n of each (p50 and p90 in microseconds):

  ping-pong   a 64-byte message to a child process and back over a Unix socket pair
  frames      Client.fetch_into / Client.append of one token of one layer (4 KiB) in an array
              from register_region: asked for with a control frame on kvbankd's shm socket
  gRPC        the same with kvbank.Client(shm=False): a gRPC call carrying the 4 KiB

ratio = p50 / the ping-pong's p50. Needs a Python where `kvbank` is installed (ctest -L python's
venv: ~/.cache/kvbank-venv/bin/python).
"""

import argparse
import os
import socket
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import kvbank  # noqa: E402
from python_bench import REPO, Server  # noqa: E402

MODEL = "small"
LAYERS, KV_HEADS, DIM = 32, 8, 128
SMALL = 2 * KV_HEADS * DIM * 2  # one token of one layer, K and V, bf16: 4 KiB


def ping_pong(n):
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        a.close()
        try:
            while True:
                m = b.recv(64, socket.MSG_WAITALL)
                if len(m) < 64:
                    break
                b.sendall(m)
        finally:
            os._exit(0)
    b.close()
    msg = b"x" * 64
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        a.sendall(msg)
        a.recv(64, socket.MSG_WAITALL)
        out.append((time.perf_counter() - t0) * 1e6)
    a.close()
    os.waitpid(pid, 0)
    return out


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * len(v)))]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--build", default=os.path.join(REPO, "build", "release"))
    p.add_argument("-n", type=int, default=3000)
    a = p.parse_args()
    server = Server(os.path.join(a.build, "bin", "kvbankd"), 256 << 20)
    rounds = 10
    per = max(1, a.n // rounds)
    try:
        frames = kvbank.Client(server.target)
        grpc = kvbank.Client(server.target, shm=False)
        frames.ensure_model({"name": MODEL, "num_layers": LAYERS, "num_q_heads": 32,
                             "num_kv_heads": KV_HEADS, "head_dim": DIM, "block_tokens": 16,
                             "dtype": "bf16"})
        if frames.data_plane != "shm":
            sys.exit("the quick-start kvbankd offered no shared-memory plane here")
        region = frames.register_region(1 << 20)
        region[:SMALL] = np.arange(SMALL, dtype=np.uint8) & 0x3F  # finite bf16 values
        plain = np.zeros(SMALL, np.uint8)
        plain[:] = region[:SMALL]
        times = {k: [] for k in ("ping", "fetch frames", "append frames", "fetch gRPC",
                                 "append gRPC")}
        for _ in range(rounds):
            times["ping"] += ping_pong(per)
            for name, c, buf in (("frames", frames, region[:SMALL]), ("gRPC", grpc, plain)):
                seq = c.create_sequence(MODEL)
                for i in range(per):
                    layer = i % LAYERS
                    if layer == 0 and i > 0:
                        c.free(MODEL, seq.id)
                        seq = c.create_sequence(MODEL)
                    t0 = time.perf_counter()
                    c.append(MODEL, seq.id, buf, num_tokens=1, layer_begin=layer,
                             layer_end=layer + 1)
                    times["append " + name].append((time.perf_counter() - t0) * 1e6)
                for _ in range(per):
                    t0 = time.perf_counter()
                    got = c.fetch_into(MODEL, seq.id, buf, token_end=1, layer_end=1)
                    times["fetch " + name].append((time.perf_counter() - t0) * 1e6)
                    assert got.payload_bytes == SMALL
                c.free(MODEL, seq.id)
        st = frames.plane_stats()
        if st["shm"]["calls"] != 2 * per * rounds or st["shm_control"]["calls"] != 2 * per * rounds:
            sys.exit("the region transfers did not go as frames: %s" % st)
        floor = statistics.median(times["ping"])
        print("small_transfers (Python): 4 KiB into / out of a registered region, %d each; "
              "p50 / p90 us, ratio = p50 / the Unix-socket ping-pong's p50" % (per * rounds))
        for k, v in times.items():
            print("  %-14s %8.1f / %8.1f  ratio %5.2f" % (k, statistics.median(v), pct(v, 0.9),
                                                       statistics.median(v) / floor))
        frames.close()
        grpc.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
