#!/usr/bin/env python3
"""Draws `kvbank plan --sweep`'s CSV: KV cache memory vs context length, one line per KV dtype.

usage: plot_plan.py CSV PNG

The CSV starts with '# key=value' lines (model, batch, gpu_memory_gb, kv_budget_gb, ...) and then
a header row: tokens, kv_gb_<dtype>..., total_gb_<dtype>..., kvbank_kv_gb_<dtype>...
Exit status: 0 on success, 2 on bad usage or input, 3 when matplotlib cannot be imported (the CLI
tells the user how to install it).
"""
import csv
import sys

NO_MATPLOTLIB = 3


def read_sweep(path):
    meta, rows = {}, []
    with open(path, newline="") as f:
        data_lines = []
        for line in f:
            if line.startswith("#"):
                key, sep, value = line[1:].strip().partition("=")
                if sep:
                    meta[key.strip()] = value.strip()
            elif line.strip():
                data_lines.append(line)
    for r in csv.DictReader(data_lines):
        rows.append({k: float(v) for k, v in r.items()})
    if not rows:
        raise ValueError(f"{path}: no data rows")
    return meta, rows


def main(argv):
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    csv_path, png_path = argv[1], argv[2]
    try:
        meta, rows = read_sweep(csv_path)
    except (OSError, ValueError, KeyError) as e:
        print(f"plot_plan.py: {e}", file=sys.stderr)
        return 2
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FixedLocator, FuncFormatter
    except ImportError as e:
        print(f"plot_plan.py: matplotlib is not available ({e})", file=sys.stderr)
        return NO_MATPLOTLIB

    tokens = [r["tokens"] for r in rows]
    dtypes = [k[len("kv_gb_"):] for k in rows[0] if k.startswith("kv_gb_")]
    bytes_per_elem = {"fp32": "4 B", "fp16": "2 B", "bf16": "2 B", "int8": "1 B", "fp8": "1 B"}
    # int8 and fp8 both count 1 byte per element in the plan, so their lines coincide: draw them
    # with different markers and dashes so both stay visible.
    styles = {
        "fp16": dict(color="tab:blue", marker="o", linestyle="-"),
        "int8": dict(color="tab:orange", marker="s", linestyle="-", markersize=8),
        "fp8": dict(color="tab:green", marker="^", linestyle="--"),
    }

    fig, ax = plt.subplots(figsize=(9, 6.5), dpi=120)
    for d in dtypes:
        label = f"KV {d} ({bytes_per_elem.get(d, '?')}/element)"
        ax.plot(tokens, [r[f"kv_gb_{d}"] for r in rows], label=label, linewidth=2,
                **styles.get(d, {}))
    # What kvbank really stores for int8 (per-token scale and zero point) sits just above.
    if "kvbank_kv_gb_int8" in rows[0]:
        ax.plot(tokens, [r["kvbank_kv_gb_int8"] for r in rows], color="tab:orange",
                linestyle=":", linewidth=1.5, label="KV int8 as kvbank stores it (+ scales)")

    gpu = float(meta.get("gpu_memory_gb", "nan"))
    budget = float(meta.get("kv_budget_gb", "nan"))
    weights = float(meta.get("weights_gb", "nan"))
    overhead = float(meta.get("overhead_fraction", "0.15"))
    ax.axhline(gpu, color="tab:red", linewidth=1.5, label=f"GPU memory ({gpu:.1f} GB)")
    ax.axhline(budget, color="tab:red", linestyle="--", linewidth=1.2,
               label=f"room for KV after weights ({weights:.1f} GB) "
                     f"and {overhead * 100:.0f}% overhead ({budget:.1f} GB)")

    # Both axes log2: KV doubles with the length, and the small lengths stay readable next to the
    # GPU budget.
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(tokens))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{int(x) // 1024}K"))
    ax.xaxis.set_minor_locator(FixedLocator([]))
    ax.set_yscale("log", base=2)
    lowest = min(r[f"kv_gb_{d}"] for r in rows for d in dtypes)
    highest = max([gpu] + [r[k] for r in rows for k in r if "kv_gb" in k])
    ax.set_ylim(lowest / 1.5, highest * 1.5)
    ticks, t = [], 2.0 ** -10
    while t <= highest * 1.5:
        if t >= lowest / 1.5:
            ticks.append(t)
        t *= 2
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_minor_locator(FixedLocator([]))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.set_xlabel("context length (tokens per sequence, K = 1024; log2 scale)")
    ax.set_ylabel("KV cache memory (GB = 2^30 bytes; log2 scale)")
    model = meta.get("model", "?")
    batch = meta.get("batch", "1")
    formula = meta.get("kv_formula", "")
    shape = meta.get("shape", "")
    ax.set_title(f"KV cache memory vs context length: {model}, batch {batch}\n"
                 f"KV = {formula} ({shape}); weights {meta.get('weight_dtype', '?')}",
                 fontsize=11)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=9,
              frameon=False)
    fig.tight_layout()
    fig.savefig(png_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
