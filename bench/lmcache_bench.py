#!/usr/bin/env python3
"""lmcache_bench: LMCache chunks through kvbank's LMCache plugin (kvbank.lmcache) against the
same bytes through the Python SDK directly, same server, same run.

    lmcache_bench.py --kvbankd build/release/bin/kvbankd [--reps 7] [--chunks 16]
                     [--layers 8] [--hidden 1024] [--mooncake] [--no-shm]

Starts kvbankd (--no-auth, loopback, port 0, its shared-memory socket), builds a real
LMCacheEngine with the plugin (tests/lmcache/lmc_engine.py: local CPU backend, bf16 chunks of
256 tokens, 2 x layers x hidden x 2 bytes per token) and, per rep, with fresh keys:

  store:    plugin: KvbankConnector.batched_put of `chunks` MemoryObjs (LMCache's buffers)
            SDK:    per chunk create_sequence (the plugin's token ids and extra key, so the server
                    does the same work) + append of the same bytes from a numpy array + free
  retrieve: plugin: KvbankConnector.batched_get (LMCache allocates, FetchBlocks by hash into it)
            SDK:    fetch_blocks_into a reused numpy array per chunk, by the same hashes

Both sides run their chunks on the same number of threads (the plugin's `threads`, 4), and the
order of the two alternates per rep. Reported: median seconds per op and side, and the median of
the per-rep ratios (SDK time / plugin time: 1.0 = the plugin costs nothing over the SDK). Run it
with the LMCache venv's Python (scripts/setup-lmcache-venv.sh prints it).

--mooncake: a third side, LMCache's own Mooncake Store connector (remote_url mooncakestore://)
in a second LMCacheEngine of the same shape, its batched_put / batched_get on the same MemoryObjs.
Mooncake runs as bench/mooncake_compare.py runs it: mooncake_master with its HTTP metadata
server and one mooncake_client storage node holding the store's memory, all on 127.0.0.1 over
TCP; the engine's store client holds no memory of its own (global_segment_size 0), so every
byte crosses loopback to the storage node as every kvbank byte crosses to kvbankd. Needs
Mooncake's package in the LMCache venv (pip install mooncake-transfer-engine-non-cuda).
Reported beside: Mooncake time / plugin time per op (above 1: the kvbank plugin is faster).
--no-shm: the plugin and the SDK both move their bytes through gRPC over loopback TCP (kvbankd
without its shared-memory socket), as Mooncake's client moves its bytes over TCP here.
--zero-copy: the plugin's engine keeps its CPU buffer in shared memory (LMCache's extra_config
shm_name), which the plugin registers with kvbankd: chunks move straight from and into the
MemoryObjs. The SDK side then stores from and fetches into registered regions (no copy on its
side either), and a third side, "copied", is the plugin in a second engine whose CPU buffer is
private memory (through the client's staging regions, one copy a chunk on this side); reported
beside: copied time / plugin time (above 1: zero-copy is faster).
"""

import argparse
import asyncio
import concurrent.futures
import os
import random
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from lmcache.utils import CacheEngineKey

import kvbank

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(REPO, "tests", "lmcache"))
sys.path.insert(0, os.path.join(REPO, "tests", "python"))
sys.path.insert(0, os.path.join(REPO, "bench"))

import lmc_engine as le  # noqa: E402
import mooncake_compare as mcc  # noqa: E402
from kvbankd_process import Server  # noqa: E402

CHUNK = 256
THREADS = 4


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvbankd", required=True)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--mooncake", action="store_true",
                    help="also LMCache's Mooncake Store connector, against a local Mooncake")
    ap.add_argument("--no-shm", action="store_true",
                    help="kvbankd without its shared-memory socket: every byte through gRPC")
    ap.add_argument("--zero-copy", action="store_true",
                    help="LMCache's CPU buffer in shared memory, registered with kvbankd")
    args = ap.parse_args()
    if args.zero_copy and args.no_shm:
        ap.error("--zero-copy needs kvbankd's shared-memory plane")
    os.environ["KVBANK_KVBANKD"] = os.path.abspath(args.kvbankd)

    token_bytes = 2 * args.layers * args.hidden * 2
    chunk_bytes = CHUNK * token_bytes
    batch = args.chunks * chunk_bytes
    # Two reps' chunks of both sides fit the pool: a rep's fetches never meet eviction.
    pool = 4 * batch + (256 << 20)
    sock = os.path.join(tempfile.mkdtemp(prefix="kvbank-lmcbench-"), "kvbankd.sock")
    server = Server([f"--pool-bytes={pool}", f"--max-pool-bytes={pool}",
                     "--shm-socket=" + ("" if args.no_shm else sock)])
    cpu_gb = 3 * batch / (1 << 30) + 0.1
    plugin_cfg = le.plugin_config(server.target, threads=str(THREADS))
    engines = ["bench"]
    engine = le.make_engine(
        "bench", dict(plugin_cfg, **({"shm_name": f"kvbank-lmcbench-{os.getpid()}"}
                                     if args.zero_copy else {})),
        chunk=CHUNK, layers=args.layers, hidden=args.hidden, cpu_gb=cpu_gb)
    conn = le.connector(engine)
    client = kvbank.Client(server.target)
    model, g, bt = conn.model, conn.g, conn.block_tokens
    root = client.get_prefix_root(model)
    zero = conn._connection().region is not None
    assert zero == args.zero_copy, "the plugin's zero-copy path is not what was asked for"
    print(f"chunk {chunk_bytes / (1 << 20):.1f} MiB x {args.chunks}, kvbank model {model} "
          f"({g} LMCache tokens, {conn.block_bytes >> 10} KiB per block), plugin plane "
          f"{conn._connection().client.data_plane}{', zero-copy' if zero else ''}, SDK plane "
          f"{client.data_plane}", flush=True)

    def memory_objs(c):
        """The batch's chunks as MemoryObjs of connector c's engine (its CPU buffer)."""
        out = []
        for i in range(args.chunks):
            obj = c.local_cpu_backend.allocate(c.meta_shapes, c.meta_dtypes, c.meta_fmt)
            obj.tensor.view(torch.int16).copy_(
                le.kv_for(i, CHUNK, args.layers, args.hidden).view(torch.int16))
            out.append(obj)
        return out

    # The payloads: LMCache MemoryObjs for the plugin, the same bytes in numpy arrays for the
    # SDK (in registered regions with --zero-copy: the SDK's own zero-copy use).
    objs = memory_objs(conn)
    held = list(objs)  # released at the end

    def buffer():
        return client.register_region(chunk_bytes) if zero else np.empty(chunk_bytes, np.uint8)

    arrays, outs = [], []
    for o in objs:
        arrays.append(buffer())
        arrays[-1][:] = np.frombuffer(memoryview(o.byte_array).cast("B"), np.uint8)
        outs.append(buffer())
    pool_ = concurrent.futures.ThreadPoolExecutor(THREADS)
    rng = random.Random(20261203)

    def fresh_keys():
        return [CacheEngineKey("bench", 1, 0, rng.getrandbits(63), torch.bfloat16)
                for _ in range(args.chunks)]

    def sdk_store(keys):
        def one(i):
            digest = conn._digest(keys[i])
            seq = client.create_sequence(model, prompt=[CHUNK] * (CHUNK // g * bt),
                                         extra_keys=[("custom", digest)])
            client.append(model, seq.id, arrays[i], num_tokens=CHUNK // g * bt)
            client.free(model, seq.id)
        list(pool_.map(one, range(len(keys))))

    def sdk_retrieve(keys):
        def one(i):
            hashes = kvbank.prefix_hashes(root.root, [CHUNK] * (CHUNK // g * bt), bt,
                                          [("custom", conn._digest(keys[i]))])
            info = client.fetch_blocks_into(model, hashes, outs[i])
            assert info.payload_bytes == chunk_bytes
        list(pool_.map(one, range(len(keys))))

    # One event loop for the whole run, as LMCache runs its connectors on a loop of its own (a
    # loop made and closed per batch, asyncio.run, would cost a millisecond a batch).
    loop = asyncio.new_event_loop()

    def connector_side(c, what, objs):
        """store and retrieve of the MemoryObjs through LMCache remote connector `c`, after
        checking that the bytes it returns are the bytes it stored."""
        def store(keys):
            loop.run_until_complete(c.batched_put(keys, objs))

        def retrieve(keys, check=False):
            got = loop.run_until_complete(c.batched_get(keys))
            assert all(o is not None for o in got), f"a {what} get missed"
            for o, a in zip(got, arrays):
                if check:
                    assert bytes(memoryview(o.byte_array).cast("B")) == a.tobytes(), \
                        f"{what} returned other bytes"
                o.ref_count_down()

        keys = fresh_keys()
        store(keys)
        retrieve(keys, check=True)
        return store, retrieve

    def timed(fn, keys):
        t = time.perf_counter()
        fn(keys)
        return time.perf_counter() - t

    plugin_side = connector_side(conn, "plugin", objs)
    copied = None
    if zero:
        engines.append("bench-copied")
        copied = le.connector(le.make_engine("bench-copied", plugin_cfg, chunk=CHUNK,
                                             layers=args.layers, hidden=args.hidden,
                                             cpu_gb=cpu_gb))
        assert copied._connection().region is None
        copied_objs = memory_objs(copied)
        copied_side = connector_side(copied, "copied plugin", copied_objs)
        held += copied_objs
    sdk_store(keys := fresh_keys())
    sdk_retrieve(keys)  # warm-up of the SDK side too

    mc = mc_conn = None
    if args.mooncake:
        os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"  # the storage node's and this client's
        # Every rep's chunks fit the storage node: its puts are never refused for room.
        mc = mcc.Procs(None, 0, (args.reps + 3) * batch + (256 << 20))
        # No segment of its own (objects live on the storage node only), TCP. Mooncake
        # 0.3.13's dict-based setup names the master "master_server_addr" (LMCache forwards
        # "mooncake_"-prefixed keys as they are); with LMCache's "master_server_address" alone
        # the setup fails and LMCache goes on with a store that answers nothing.
        mc_extra = {"local_hostname": "127.0.0.1", "metadata_server": mc.metadata,
                    "protocol": "tcp", "master_server_address": mc.master_addr,
                    "mooncake_master_server_addr": mc.master_addr, "global_segment_size": 0,
                    "local_buffer_size": batch + (64 << 20), "transfer_timeout": 30}
        engine_mc = le.make_engine(
            "bench-mooncake", mc_extra,
            remote_url=f"mooncakestore://{mc.master_addr}/", chunk=CHUNK, layers=args.layers,
            hidden=args.hidden, cpu_gb=cpu_gb)
        remotes = [b for n, b in le.backends(engine_mc).items() if n.startswith("RemoteBackend")]
        assert remotes and remotes[0].connection is not None, "no Mooncake remote backend"
        mc_conn = remotes[0].connection
        if hasattr(mc_conn, "getWrappedConnector"):
            mc_conn = mc_conn.getWrappedConnector()
        print(f"Mooncake: {type(mc_conn).__name__}, master {mc.master_addr}", flush=True)

    sides = {"plugin": plugin_side, "sdk": (sdk_store, sdk_retrieve)}
    if copied is not None:
        sides["copied"] = copied_side
    if mc_conn is not None:
        sides["mooncake"] = connector_side(mc_conn, "Mooncake", objs)

    res = {f"{side}_{op}": [] for side in sides for op in ("store", "retrieve")}
    for rep in range(args.reps):
        names = list(sides)
        order = [(n, fresh_keys()) for n in names[rep % len(names):] + names[:rep % len(names)]]
        for side, k in order:
            res[side + "_store"].append(timed(sides[side][0], k))
        for side, k in order:
            res[side + "_retrieve"].append(timed(sides[side][1], k))

    print(f"{args.reps} reps, medians; ratio = SDK time / plugin time (median of per-rep "
          "ratios)")
    print("| op | plugin s | SDK s | plugin GB/s | SDK GB/s | ratio | per-rep ratios |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for op in ("store", "retrieve"):
        p, s = res["plugin_" + op], res["sdk_" + op]
        ratios = [b / a for a, b in zip(p, s)]
        mp, ms = statistics.median(p), statistics.median(s)
        print(f"| {op} | {mp:.3f} | {ms:.3f} | {batch / mp / 1e9:.2f} | {batch / ms / 1e9:.2f} "
              f"| **{statistics.median(ratios):.2f}** | "
              f"{', '.join(f'{r:.2f}' for r in ratios)} |")
    for side, title in (("copied", "The plugin over a private CPU buffer (staging regions); "
                         "ratio = its time / the zero-copy plugin's time"),
                        ("mooncake", "Mooncake Store through LMCache's connector; ratio = "
                         "Mooncake time / kvbank plugin time")):
        if side + "_store" not in res:
            continue
        print(f"{title} (median of per-rep ratios; above 1: the kvbank plugin is faster)")
        print(f"| op | {side} s | {side} GB/s | ratio | per-rep ratios |")
        print("|---|---:|---:|---:|---|")
        for op in ("store", "retrieve"):
            p, m = res["plugin_" + op], res[f"{side}_{op}"]
            ratios = [b / a for a, b in zip(p, m)]
            mm = statistics.median(m)
            print(f"| {op} | {mm:.3f} | {batch / mm / 1e9:.2f} | "
                  f"**{statistics.median(ratios):.2f}** | "
                  f"{', '.join(f'{r:.2f}' for r in ratios)} |")
    stats = conn._connection().client.plane_stats()
    print("plugin planes:", {k: v for k, v in stats.items() if v.get("calls")})
    for o in held:
        o.ref_count_down()
    for name in engines:
        le.destroy(name)
    loop.close()
    if mc is not None:
        le.destroy("bench-mooncake")
        mc.stop()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
