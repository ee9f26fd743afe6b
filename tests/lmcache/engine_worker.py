#!/usr/bin/env python3
"""One LMCacheEngine in a process of its own (the kvbank plugin, local CPU backend), driven by
a JSON spec; writes a JSON result.

    engine_worker.py SPEC.json OUT.json

spec: target (kvbankd), mode ("store" or "retrieve"), prompts: [[seed, num_tokens], ...].
store: stores each prompt's KV (lmc_engine.kv_for) and waits until kvbank holds every chunk.
retrieve: a fresh engine (its CPU backend empty, so hits come from kvbank) looks each prompt up,
retrieves it into a zeroed tensor and reports per prompt the tokens looked up and retrieved and
whether the retrieved tokens are bit for bit the stored ones.
Both report the plugin's data plane and plane counters. Chunk keys use Python's hash(): the
processes that share chunks must run with the same PYTHONHASHSEED.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lmc_engine as le  # noqa: E402


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    instance = f"worker-{os.getpid()}"
    engine = le.make_engine(instance, le.plugin_config(spec["target"]))
    conn = le.connector(engine)
    out: dict = {"plugin": type(conn).__name__, "prompts": []}
    try:
        for seed, n in spec["prompts"]:
            tokens = le.prompt(seed, n)
            kv = le.kv_for(seed, n)
            if spec["mode"] == "store":
                engine.store(tokens, kv_source=kv)
                le.wait_stored(engine, tokens)
                out["prompts"].append({"seed": seed, "tokens": n})
                continue
            looked_up = engine.lookup(tokens)
            dest = torch.zeros_like(kv)
            mask = engine.retrieve(tokens, kv_dest=dest)
            got = int(mask.sum())
            out["prompts"].append({
                "seed": seed, "tokens": n, "lookup": looked_up, "retrieved": got,
                "prefix": bool(mask[:got].all()),
                "exact": le.same_bits(dest[:, :, :got], kv[:, :, :got]),
                "rest_untouched": bool((dest[:, :, got:].view(torch.int16) == 0).all()),
            })
        c = conn._connection()
        out["data_plane"] = c.client.data_plane if c else None
        out["plane_stats"] = c.client.plane_stats() if c else None
    finally:
        le.destroy(instance)
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
