#!/usr/bin/env python3
"""pd_handoff: layer-wise handoff between a prefill and a decode process through kvbankd.

    pd_handoff.py [--build build/release] [--tokens 2048] [--reps 5] [--compute-ms 0,5]

Starts kvbankd (--no-auth, loopback), registers llama-3.1-8b in bf16 (32 layers, 8 kv heads,
head_dim 128: 4 KiB per token and layer), and per run creates one sequence. Then two processes
start at the same moment:

  prefill  appends the prompt's KV one layer at a time (Client.append of layer l), after
           --compute-ms of simulated compute per layer (a busy loop, as a forward pass is),
  decode   pulls layer 0, 1, ..., 31 in order with fetch_into(token_end=N, wait_s=60): each
           fetch waits on the server until that layer is committed, then moves it.

Both note time.monotonic() (one clock for the machine) as each layer is pushed / pulled. The
figure is the time from the last layer pushed to the last layer pulled, divided by the time of
one layer's transfer (a fetch of one committed layer, alone, median of the same run): 1.0 means
the decode is done one layer's transfer after the prefill; pulling only after the whole prompt
is pushed would take 32. Medians over --reps runs. Needs a Python where `kvbank` is installed
(ctest -L python's venv: ~/.cache/kvbank-venv/bin/python).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import kvbank  # noqa: E402
from python_bench import REPO, Server  # noqa: E402

MODEL = "handoff"
LAYERS, KV_HEADS, DIM = 32, 8, 128


def layout():
    return {"name": MODEL, "num_layers": LAYERS, "num_q_heads": 32, "num_kv_heads": KV_HEADS,
            "head_dim": DIM, "block_tokens": 16, "dtype": "bf16"}


def layer_bytes(tokens):
    return 2 * KV_HEADS * tokens * DIM * 2


def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def role_main(args):
    """A child: prefill or decode of one run. Prints one JSON line: per-layer monotonic times."""
    client = kvbank.Client(args.target, deadline_s=120)
    n = args.tokens
    buf = np.full(layer_bytes(n), 0x3c, dtype=np.uint8)
    times = []
    while time.monotonic() < args.start:
        pass
    if args.role == "prefill":
        for layer in range(LAYERS):
            spin(args.compute_ms / 1000.0)
            buf[:8] = layer  # each layer's bytes differ
            client.append(MODEL, args.seq, buf, num_tokens=n, layer_begin=layer,
                          layer_end=layer + 1, dtype="bf16")
            times.append(time.monotonic())
    else:
        for layer in range(LAYERS):
            client.fetch_into(MODEL, args.seq, buf, token_end=n, layer_begin=layer,
                              layer_end=layer + 1, wait_s=60)
            times.append(time.monotonic())
            if buf[0] != layer:
                sys.exit("decode: layer %d holds the bytes of layer %d" % (layer, buf[0]))
    print(json.dumps(times), flush=True)
    if args.role == "prefill":
        # A prefill worker goes on serving (its client stays open): this one waits for the run to
        # end before it closes, so that its teardown does not compete with the decode's last pull.
        sys.stdin.read()
    client.close()


def one_run(target, client, tokens, compute_ms):
    seq = client.create_sequence(MODEL, lease_s=0)
    start = time.monotonic() + 0.3
    procs = {}
    for role in ("decode", "prefill"):
        procs[role] = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--role", role, "--target", target,
             "--seq", str(seq.id), "--tokens", str(tokens), "--start", repr(start),
             "--compute-ms", str(compute_ms)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True)
    out = {}
    for role, p in procs.items():  # decode first: the prefill's stdin closes once it is done
        text, _ = p.communicate(timeout=300)
        if p.returncode != 0:
            sys.exit("%s exited %d" % (role, p.returncode))
        out[role] = json.loads(text.strip().splitlines()[-1])
    # One layer's transfer alone: fetch a committed layer (the sequence is whole now).
    buf = np.empty(layer_bytes(tokens), dtype=np.uint8)
    alone = []
    for layer in range(8):
        t0 = time.perf_counter()
        client.fetch_into(MODEL, seq.id, buf, token_end=tokens, layer_begin=layer,
                          layer_end=layer + 1)
        alone.append(time.perf_counter() - t0)
    client.free(MODEL, seq.id)
    push, pull = out["prefill"], out["decode"]
    behind = [max(0.0, pull[i] - push[i]) for i in range(LAYERS)]
    return {"tail": pull[-1] - push[-1], "layer": statistics.median(alone),
            "push": push[-1] - start, "pull": pull[-1] - start,
            "behind_median": statistics.median(behind)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(REPO, "build", "release"))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compute-ms", default="0,5")
    ap.add_argument("--role")
    ap.add_argument("--target")
    ap.add_argument("--seq", type=int)
    ap.add_argument("--start", type=float)
    ap.add_argument("--server-arg", action="append", default=[],
                    help="a kvbankd flag (repeatable), e.g. --server-arg=--shm-lone-copy-bytes=0")
    args = ap.parse_args()
    if args.role:
        args.compute_ms = float(args.compute_ms)
        return role_main(args)

    # Room for the sequence twice over (a run's, and the next one's while it is freed).
    pool = max(1 << 30, 2 * LAYERS * layer_bytes(args.tokens) + (256 << 20))
    server = Server(os.path.join(args.build, "bin", "kvbankd"), pool, args.server_arg)
    try:
        client = kvbank.Client(server.target, deadline_s=120)
        client.ensure_model(layout())
        mib = layer_bytes(args.tokens) / (1 << 20)
        print("pd_handoff: llama-3.1-8b bf16 layout, %d tokens: %.1f MiB per layer, %d layers; "
              "kvbankd on loopback, prefill and decode in their own processes; medians of %d "
              "runs" % (args.tokens, mib, LAYERS, args.reps))
        print("| prefill compute per layer | prompt pushed | last layer pulled | one layer's "
              "transfer alone | last pushed -> last pulled | ÷ one layer | decode behind "
              "prefill per layer (median) |")
        print("|---|---|---|---|---|---|---|")
        for compute_ms in [float(x) for x in args.compute_ms.split(",")]:
            runs = [one_run(server.target, client, args.tokens, compute_ms)
                    for _ in range(args.reps)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            ratio = statistics.median(r["tail"] / r["layer"] for r in runs)
            print("| %.0f ms | %.1f ms | %.1f ms | %.2f ms | %.2f ms | %.2f | %.2f ms |"
                  % (compute_ms, med["push"] * 1e3, med["pull"] * 1e3, med["layer"] * 1e3,
                     med["tail"] * 1e3, ratio, med["behind_median"] * 1e3), flush=True)
        client.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
