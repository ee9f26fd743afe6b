#!/usr/bin/env python3
"""sglang_bench: SGLang HiCache pages through kvbank.sglang against the same bytes through the
kvbank SDK directly, same kvbankd, same run.

    sglang_bench.py --kvbankd build/release/bin/kvbankd [--reps 7] [--pages 32]
                    [--layers 32] [--heads 8] [--head-dim 128] [--page-size 16]
                    [--layout layer_first] [--mooncake]

Run it with the SGLang venv's interpreter (scripts/setup-sglang-venv.sh prints it).

kvbankd starts on 127.0.0.1 (--no-auth, a --shm-socket, host memory). SGLang's side is a CPU
MHATokenToKVPool and an MHATokenToKVPoolHost (layer_first, not pinned) of a Llama-3.1-8B-shaped
layer stack by default (32 layers, 8 kv heads, head_dim 128, bf16, 16-token pages: 2 MiB a
page); the backend is KvbankHiCacheStorage with its defaults (shared-memory staging regions,
2 store threads), registered on that pool as SGLang's controller does.

Per rep, both sides move --pages pages of new keys (alternating which goes first):
  store     backend: batch_set_v1(keys, host slots) (the strided copy out of the host pool, then
            create + append + free a page, 2 at a time); SDK: the same calls on pages that
            already sit in kvbank's block layout in a registered region (no copy), 2 at a time.
  retrieve  backend: batch_get_v1(keys, host slots) (one fetch_blocks_into a region per staging
            region's worth of pages, then the strided copy into the host pool); SDK:
            fetch_blocks_into the same hashes into a registered region, nothing after.
Medians over --reps of each side's seconds; ratio = SDK seconds / backend seconds (1: the
backend costs nothing over the SDK; the goal is >= 0.9). "layout copy" times, on their own, the
copies the backend adds to the SDK's calls (every page between the host pool's token-major
slots and kvbank's head-major block layout, one torch copy_ a page); (SDK + copy) / backend
near 1 says the backend adds nothing beyond that conversion. The first retrieve is checked bit
for bit against the pages stored. --layout: the host pool's layout (layer_first, page_first,
page_first_direct, page_head). --allocator shm: SGLang keeps the host pool in a memfd, and the
backend moves pages straight between it and kvbankd (zero-copy: no layout copy; kvbank's
blocks token-major, the SDK's side then uses that layout too); "layout copy" then times what
the copy path would add. Only the warm-up rep's load, the one checked bit for bit, goes into
zeroed host slots: zeroing 64 MiB with torch right before a timed load slowed the side it
preceded (the SDK's destination was never zeroed).

--mooncake: a third side, SGLang's own Mooncake Store backend (MooncakeStore, the v1 zero-copy
calls on the same host pool, which it registers with Mooncake) against mooncake_master and one
mooncake_client storage node on 127.0.0.1 over TCP, started as bench/mooncake_compare.py
starts them; the backend's store client holds no memory of its own (global_segment_size 0), so
every byte crosses loopback to the storage node. Needs Mooncake's package in the SGLang venv
(scripts/setup-sglang-venv.sh --with-mooncake). Reported beside: Mooncake seconds / kvbank
backend seconds (above 1: the kvbank backend is faster). Mooncake's backend does not take an
MHA pool in layer_first (it moves one object per K and per V of a page, contiguous in the other
layouts): run it with --layout page_first_direct.
"""

import argparse
import concurrent.futures
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

# NOTE: torch's OpenMP threads spin for a while after each parallel op (GOMP's default active
# wait), and on a small machine they take the cores kvbankd's copies need: the side timed
# right after a torch op (the backend's load, after the host slots are zeroed) ran up to 1.5x
# slower than the same fetch after none. Passive waits keep every side's timing its own.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(REPO, "tests", "python"))
sys.path.insert(0, os.path.join(REPO, "tests", "sglang"))
sys.path.insert(0, os.path.join(REPO, "bench"))


class _Config:
    """The HiCacheStorageConfig fields the backend reads."""

    def __init__(self, target):
        self.tp_rank, self.tp_size, self.pp_rank, self.pp_size = 0, 1, 0, 1
        self.model_name = "bench"
        self.extra_config = {"kvbank_target": target}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvbankd", default=os.path.join(REPO, "build", "release", "bin",
                                                      "kvbankd"))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layout", default="layer_first",
                    choices=["layer_first", "page_first", "page_first_direct", "page_head"])
    ap.add_argument("--allocator", default="default", choices=["default", "shm"],
                    help="SGLang's host allocator; shm: the pool in a memfd, which the kvbank "
                         "backend registers as a region (zero-copy loads and stores)")
    ap.add_argument("--mooncake", action="store_true",
                    help="also SGLang's Mooncake Store backend, against a local Mooncake")
    args = ap.parse_args()
    if args.mooncake and args.layout == "layer_first":
        sys.exit("sglang_bench: SGLang's Mooncake backend does not take an MHA host pool in "
                 "layer_first: add --layout page_first_direct")
    os.environ["KVBANK_KVBANKD"] = os.path.abspath(args.kvbankd)

    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    import kvbank
    from kvbank.sglang import KvbankHiCacheStorage, page_key_value

    from hicache_rig import init_single_rank
    from kvbankd_process import Server

    ps, n = args.page_size, args.pages
    page_bytes = 2 * args.layers * ps * args.heads * args.head_dim * 2
    total = n * page_bytes
    pool_mib = max(512, 3 * total * (args.reps + 2) // (1 << 20))
    sock = os.path.join(tempfile.mkdtemp(prefix="kvbank-sglang-bench-"), "kvbankd.sock")
    server = Server([f"--pool-bytes={pool_mib}MiB", "--shm-socket=" + sock])
    mc = None  # Mooncake's servers, with --mooncake
    try:
        init_single_rank()
        tokens = 2 * n * ps
        kv = MHATokenToKVPool(tokens, ps, torch.bfloat16, args.heads, args.head_dim,
                              args.layers, "cpu", False, start_layer=0, end_layer=args.layers)
        host = MHATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, 1.0, 0, ps,
                                    args.layout, pin_memory=False,
                                    device_capacity_tokens=kv.size, start_layer=0,
                                    end_layer=args.layers, allocator_type=args.allocator)
        backend = KvbankHiCacheStorage(_Config(server.target), {})
        backend.register_mem_pool_host(host)
        model = backend.model
        src = host.alloc(n * ps)
        dst = host.alloc(n * ps)
        g = torch.Generator().manual_seed(20261203)
        for i in range(n):  # the source pages, through the backend's view of the layout
            page = backend.pages.host_page(int(src[i * ps]))
            page.copy_(torch.randn(page.shape, generator=g).to(torch.bfloat16))

        client = kvbank.Client(server.target)
        root = client.get_prefix_root(model)
        region = client.register_region(total)
        blocks = torch.from_numpy(region).view(torch.bfloat16)
        pages = backend.pages
        for i in range(n):  # the SDK's pages: kvbank's block layout, made once, untimed
            pages.block(blocks, i).copy_(pages.host_page(int(src[i * ps])))
        pool = concurrent.futures.ThreadPoolExecutor(2)

        def sdk_store(keys):
            def one(i):
                v = page_key_value(keys[i])
                seq = client.create_sequence(model, [0] * ps, lease_s=60,
                                             extra_keys=[("custom", v)])
                if seq.cached_tokens < ps:
                    client.append(model, seq.id, region[i * page_bytes:(i + 1) * page_bytes],
                                  num_tokens=ps)
                client.free(model, seq.id)
            list(pool.map(one, range(n)))

        def sdk_store_batch(keys):
            """The same pages in one SDK call (put_pages_runs), a run a page."""
            errs = client.put_pages_runs(
                model, region, [([("custom", page_key_value(k))], [i * page_bytes])
                                for i, k in enumerate(keys)],
                page_bytes, num_tokens=ps, lease_s=60, parallel=2)
            assert errs == [None] * n, errs

        def hashes(keys):
            return [kvbank.chain_hash(root.root, [0] * ps, [("custom", page_key_value(k))],
                                      algorithm=root.algorithm) for k in keys]

        def sdk_get(keys):
            info = client.fetch_blocks_into(model, hashes(keys), region)
            assert info.num_tokens == n * ps

        runs_call = {}

        def prepare_runs(keys):
            """The one SDK call the zero-copy backend's load makes (fetch_blocks_into_runs into
            the host slots), its hashes and run offsets computed here, before the clock."""
            conn = backend._conn
            starts = [int(dst[i * ps]) for i in range(n)]
            runs_call["args"] = (model, hashes(keys), conn.host_region,
                                 pages.fetch_runs(starts, conn.host_offset), pages.run_bytes)
            runs_call["client"] = conn.client

        def sdk_get_runs(keys):
            info = runs_call["client"].fetch_blocks_into_runs(*runs_call["args"])
            assert info.num_tokens == n * ps

        def layout_copy(to_host):
            """The copies the backend makes on top of the SDK's calls: every page between the
            host pool's token-major slots and kvbank's head-major block layout."""
            for i in range(n):
                host_page = pages.host_page(int((dst if to_host else src)[i * ps]))
                if to_host:
                    host_page.copy_(pages.fetched(blocks, n, i))
                else:
                    pages.block(blocks, i).copy_(host_page)

        def pages_of(slots):
            return [pages.host_page(int(slots[i * ps])) for i in range(n)]

        def zero(slots):
            for page in pages_of(slots):
                page.zero_()

        def same(a, b):
            return all(torch.equal(x.view(torch.int16), y.view(torch.int16))
                       for x, y in zip(pages_of(a), pages_of(b)))

        mstore = None
        if args.mooncake:
            from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
            from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

            import mooncake_compare as mcc
            os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
            mc = mcc.Procs(None, 0, (args.reps + 3) * total + (256 << 20))
            cfg = HiCacheStorageConfig(
                tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                is_mla_model=False, enable_storage_metrics=False,
                is_page_first_layout=args.layout != "layer_first", model_name="bench-mooncake",
                extra_config={"master_server_address": mc.master_addr,
                              "metadata_server": mc.metadata, "protocol": "tcp",
                              "global_segment_size": 0, "local_hostname": "127.0.0.1"})
            mstore = MooncakeStore(cfg, host)
            mstore.register_mem_pool_host(host)

        sides = {"backend": (lambda k: backend.batch_set_v1(k, src),
                             lambda k: backend.batch_get_v1(k, dst)),
                 "sdk": (sdk_store, sdk_get),
                 "sdk_batch": (sdk_store_batch, sdk_get_runs if backend.zero_copy else None)}
        if mstore is not None:
            sides["mooncake"] = (lambda k: mstore.batch_set_v1(k, src),
                                 lambda k: mstore.batch_get_v1(k, dst))
        times = {f"{op}_{side}": [] for side in sides for op in ("store", "get")}
        times.update(store_copy=[], get_copy=[])
        for rep in range(args.reps + 1):  # rep 0: warm-up
            names = list(sides)
            names = names[rep % len(names):] + names[:rep % len(names)]
            keys = {side: [f"{side}{rep}-{i}" for i in range(n)] for side in names}
            for side in names:
                t = time.perf_counter()
                ok = sides[side][0](keys[side])
                if rep:
                    times["store_" + side].append(time.perf_counter() - t)
                assert ok is None or ok == [True] * n, f"{side} stored {ok}"
            for side in names:
                if sides[side][1] is None:  # the copy path: its loads are the SDK's
                    continue
                if side not in ("sdk", "sdk_batch") and rep == 0:  # the checked load
                    zero(dst)
                if side == "sdk_batch":
                    prepare_runs(keys[side])
                t = time.perf_counter()
                ok = sides[side][1](keys[side])
                if rep:
                    times["get_" + side].append(time.perf_counter() - t)
                assert ok is None or ok == [True] * n, f"{side} loaded {ok}"
                if side not in ("sdk", "sdk_batch") and rep == 0:
                    assert same(dst, src), f"{side}: the pages loaded differ from those stored"
            # The copies alone, after every side's transfers: a copy just before a side's load
            # leaves the destination's lines dirty in the cache (layout_copy(True) writes the
            # host slots the backend loads into next), which slowed that load alone. The
            # copy-out then rewrites the host slots with the same bytes.
            for op, to_host in (("store", False), ("get", True)):
                t = time.perf_counter()
                layout_copy(to_host)
                if rep:
                    times[op + "_copy"].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items() if v}
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name")), platform.processor())
        print(f"# sglang_bench: commit {commit}, {cpu}, nproc {os.cpu_count()}, "
              f"load {os.getloadavg()[0]:.1f}")
        plane = backend._conn.client.data_plane if backend._conn else "-"
        mode = "zero-copy (runs of the host pool's memfd)" if backend.zero_copy else \
            "copied through a staging region"
        print(f"# {n} pages of {page_bytes >> 10} KiB ({total / (1 << 20):.0f} MiB) a rep, "
              f"{args.reps} reps; data plane {plane}; host layout {args.layout}, allocator "
              f"{args.allocator}; backend {mode}")
        print("| op | backend ms (GB/s) | SDK ms (GB/s) | ratio SDK/backend | layout copy ms |"
              " ratio (SDK + copy)/backend |")
        print("|---|---|---|---|---|---|")
        for op in ("store", "get"):
            b, s, c = med[op + "_backend"], med[op + "_sdk"], med[op + "_copy"]
            print(f"| {'retrieve' if op == 'get' else op} | {b * 1e3:.1f} ({total / b / 1e9:.2f})"
                  f" | {s * 1e3:.1f} ({total / s / 1e9:.2f}) | {s / b:.2f} | {c * 1e3:.1f} |"
                  f" {(s + c) / b:.2f} |")
        b, s = med["store_backend"], med["store_sdk_batch"]
        print(f"| store, SDK in one call (put_pages_runs) | {b * 1e3:.1f} | {s * 1e3:.1f} "
              f"({total / s / 1e9:.2f}) | {s / b:.2f} | | |")
        if "get_sdk_batch" in med:
            b, s = med["get_backend"], med["get_sdk_batch"]
            print(f"| retrieve, SDK into the same runs (fetch_blocks_into_runs) | {b * 1e3:.1f} "
                  f"| {s * 1e3:.1f} ({total / s / 1e9:.2f}) | {s / b:.2f} | | |")
        if mstore is not None:
            print("SGLang's Mooncake Store backend (v1 zero-copy, TCP); ratio = Mooncake seconds"
                  " / kvbank backend seconds (above 1: the kvbank backend is faster)")
            print("| op | Mooncake ms (GB/s) | kvbank backend ms | ratio |")
            print("|---|---|---|---|")
            for op in ("store", "get"):
                m, b = med[op + "_mooncake"], med[op + "_backend"]
                print(f"| {'retrieve' if op == 'get' else op} | {m * 1e3:.1f} "
                      f"({total / m / 1e9:.2f}) | {b * 1e3:.1f} | {m / b:.2f} |")
        backend.close()
        client.close()
    finally:
        if mc is not None:
            mc.stop()
        server.stop()


if __name__ == "__main__":
    main()
