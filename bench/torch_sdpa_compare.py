#!/usr/bin/env python3
"""kvbank's CUDA decode attention against torch's scaled_dot_product_attention, shape by shape.

    python3 bench/torch_sdpa_compare.py --csv gpu_attention_bench.csv [--reps N] [--max-gib G]

Reads the fp16 rows of the CSV that gpu_attention_bench --csv writes (batch, context, q/kv heads,
head_dim, decode_ms) and times torch.nn.functional.scaled_dot_product_attention on the same shape
with dense fp16 K/V: q [batch, q_heads, 1, head_dim], K/V [batch, kv_heads, context, head_dim]
(GQA through enable_gqa where torch has it, else K/V expanded with repeat_interleave before the
timing, so the expanded bytes are what torch reads). CUDA events around each call, one warm-up,
the median of N, the L2 flushed (a 256 MiB write, untimed) before each timed call, as the kvbank
bench does. Prints kvbank decode ms / torch ms per shape: below 1.0 means kvbank is faster.

NOTE: the comparison is not like for like: kvbank reads paged blocks (random block tables), takes
fp32 q and writes fp32 out plus lse; torch reads contiguous fp16 tensors.
Exits 0 with a message when torch, a GPU or the CSV is missing.
"""

import argparse
import csv
import os
import statistics
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", required=True, help="gpu_attention_bench --csv output")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--max-gib", type=float, default=48.0,
                    help="skip shapes whose dense K/V (as torch reads them) pass this size")
    args = ap.parse_args()

    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("torch_sdpa_compare: no torch: skipped")
        return 0
    if not torch.cuda.is_available():
        print("torch_sdpa_compare: no CUDA device: skipped")
        return 0
    if not os.path.isfile(args.csv):
        print(f"torch_sdpa_compare: no CSV at {args.csv} (gpu_attention_bench did not run): skipped")
        return 0

    with open(args.csv, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["dtype"] == "fp16"]
    if not rows:
        print("torch_sdpa_compare: no fp16 rows in the CSV: skipped")
        return 0

    import inspect
    try:
        has_gqa = "enable_gqa" in inspect.signature(F.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):
        has_gqa = False
    dev = torch.device("cuda")
    print(f"torch_sdpa_compare: torch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
          f"GQA via {'enable_gqa' if has_gqa else 'repeat_interleave'}, {args.reps} reps")
    print()
    print("| kv heads | batch | context | torch ms | torch KV GB/s | kvbank ms | kvbank / torch |")
    print("|---:|---:|---:|---:|---:|---:|---:|")

    torch.manual_seed(20261201)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ratios = []
    for r in rows:
        b, ctx = int(r["batch"]), int(r["context"])
        hq, hkv, d = int(r["num_q_heads"]), int(r["num_kv_heads"]), int(r["head_dim"])
        kv_ms = float(r["decode_ms"])
        read_heads = hkv if has_gqa else hq
        kv_bytes = 2 * b * read_heads * ctx * d * 2
        if kv_bytes > args.max_gib * (1 << 30):
            print(f"| {hkv} | {b} | {ctx} | skipped ({kv_bytes / (1 << 30):.0f} GiB) | | "
                  f"{kv_ms:.4f} | |")
            continue
        q = torch.randn(b, hq, 1, d, dtype=torch.float16, device=dev)
        k = torch.randn(b, hkv, ctx, d, dtype=torch.float16, device=dev)
        v = torch.randn(b, hkv, ctx, d, dtype=torch.float16, device=dev)
        kwargs = {}
        if hq != hkv:
            if has_gqa:
                kwargs["enable_gqa"] = True
            else:
                k = k.repeat_interleave(hq // hkv, dim=1)
                v = v.repeat_interleave(hq // hkv, dim=1)
        times = []
        with torch.no_grad():
            for i in range(args.reps + 1):  # i == 0: warm-up
                flush.fill_(i & 0xFF)
                start.record()
                F.scaled_dot_product_attention(q, k, v, **kwargs)
                end.record()
                end.synchronize()
                if i > 0:
                    times.append(start.elapsed_time(end))
        ms = statistics.median(times)
        ratio = kv_ms / ms
        ratios.append(ratio)
        print(f"| {hkv} | {b} | {ctx} | {ms:.4f} | {kv_bytes / 1e6 / ms:.1f} | {kv_ms:.4f} | "
              f"{ratio:.2f} |", flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    if ratios:
        print(f"\ngeometric mean kvbank / torch: "
              f"{statistics.geometric_mean(ratios):.2f} over {len(ratios)} shapes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
