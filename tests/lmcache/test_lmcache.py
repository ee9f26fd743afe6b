"""kvbank.lmcache.KvbankConnector inside the real LMCacheEngine (LMCache 0.5.6): chunks stored by
one engine are looked up and retrieved bit for bit by a fresh engine in another process; lookups
are batched; keys that name nothing, chains cut short and bad configurations are misses, not
errors; a kvbankd that dies mid-retrieve leaves the engine serving, with misses and no wrong
bytes."""

import asyncio
import mmap
import os
import types

import pytest
import torch
from lmcache.utils import CacheEngineKey

import kvbank
from kvbank.lmcache import KvbankConnector, chunk_layout, shared_buffer

import lmc_engine as le

C = le.CHUNK


@pytest.fixture
def engine_at():
    """engine_at(extra_config, **kw) -> a fresh in-process engine, destroyed after the test."""
    made = []

    def make(extra_config, **kw):
        name = f"test-engine-{len(made)}"
        made.append(name)
        return le.make_engine(name, extra_config, **kw)

    yield make
    for name in made:
        le.destroy(name)


def keys_of(engine, tokens):
    return [key for _, _, key in engine.token_database.process_tokens(tokens)]


def test_layout_covers_odd_token_sizes():
    # An LMCache token of any even byte count fits a layout kvbank takes, g tokens per block.
    for token_bytes, chunk in [(2, 256), (6, 256), (512, 16), (1026, 256), (131072, 256),
                               (2 * 61 * 576 * 2, 64), (14, 7)]:
        layout, g = chunk_layout(token_bytes, chunk)
        assert chunk % g == 0
        assert layout["head_dim"] <= 4096 and layout["block_tokens"] <= 4096
        assert g * token_bytes == layout["block_tokens"] * layout["head_dim"] * 2, token_bytes
    with pytest.raises(ValueError):
        chunk_layout(3, 256)


def test_plugin_is_among_the_engine_backends(server, engine_at):
    engine = engine_at(le.plugin_config(server.target))
    assert "LocalCPUBackend" in le.backends(engine)
    conn = le.connector(engine)
    assert isinstance(conn, KvbankConnector)
    assert conn.plugin_name == le.PLUGIN and conn.target == server.target
    names = [m.name for m in kvbank.Client(server.target).list_models()]
    assert conn.model in names, names


def test_fresh_process_retrieves_bit_for_bit(server, run_worker):
    # Full chunks only, prompts ending in an unfull chunk of one and of two (padded) kvbank
    # blocks (save_unfull_chunk), one of one chunk.
    prompts = [[11, 5 * C], [12, 3 * C + 7], [14, 2 * C + 23], [13, C]]
    stored = run_worker(server.target, "store", prompts)
    assert stored["plugin"] == "KvbankConnector"
    got = run_worker(server.target, "retrieve", prompts)
    for p in got["prompts"]:
        assert p["lookup"] == p["tokens"], (p, got["log"][-3000:])
        assert p["retrieved"] == p["tokens"] and p["prefix"], p
        assert p["exact"], p
    print("[lmcache] retrieving engine's planes:", got["plane_stats"])
    # Every byte came from kvbank: the retrieving engine started empty.
    grpc = got["plane_stats"]["grpc"]
    shm = got["plane_stats"].get("shm", {}).get("bytes", 0)
    assert grpc.get("bytes", 0) + shm > 0, got["plane_stats"]
    # Prompts never stored: a miss in the fresh engine, nothing retrieved.
    none = run_worker(server.target, "retrieve", [[99, 2 * C]])
    assert none["prompts"][0]["lookup"] == 0 and none["prompts"][0]["retrieved"] == 0
    assert none["prompts"][0]["rest_untouched"]


def test_large_chunks_take_shared_memory(server, engine_at, tmp_path):
    # 2 MiB chunks (over the SDK's 1 MiB staging threshold): same host, so the shm plane.
    layers, hidden, chunk = 4, 512, 256
    cfg = le.plugin_config(server.target)
    a = engine_at(cfg, chunk=chunk, layers=layers, hidden=hidden, cpu_gb=0.1)
    tokens = le.prompt(21, 3 * chunk)
    kv = le.kv_for(21, 3 * chunk, layers, hidden)
    a.store(tokens, kv_source=kv)
    le.wait_stored(a, tokens)
    conn = le.connector(a)
    client = conn._connection().client
    assert client.data_plane == "shm"
    keys = keys_of(a, tokens)
    assert conn.batched_contains(keys) == 3
    out = [asyncio.run(conn.get(k)) for k in keys]
    try:
        for i, obj in enumerate(out):
            assert obj is not None
            assert le.same_bits(obj.tensor, kv[:, :, i * chunk:(i + 1) * chunk])
    finally:
        for obj in out:
            if obj is not None:
                obj.ref_count_down()
    stats = client.plane_stats()
    assert stats["shm_staged"]["bytes"] + stats["shm"]["bytes"] >= 6 * chunk * 2 * layers * \
        hidden * 2 // 2, stats


def shm_name(tag):
    """A POSIX shared-memory name of this test process's own (LMCache's extra_config shm_name)."""
    return f"kvbank-lmc-test-{os.getpid()}-{tag}"


# The CPU buffer (GB) of an engine whose buffer is in /dev/shm: small, so that the tests fit a
# container's 64 MiB /dev/shm too (a chunk here is 16 KiB).
SHM_CPU_GB = 0.015


def test_shared_cpu_buffer_moves_chunks_without_a_copy(server, engine_at):
    # LMCache's CPU buffer in /dev/shm (its shm_name): registered with kvbankd as a region,
    # chunks go straight from and into LMCache's MemoryObjs; a fresh engine reads them back bit
    # for bit, zero-copy or not.
    writer = engine_at(dict(le.plugin_config(server.target), shm_name=shm_name("w")),
                       cpu_gb=SHM_CPU_GB)
    conn = le.connector(writer)
    c = conn._connection()
    assert c.region is not None, "LMCache's shared CPU buffer was not registered"
    n = 3 * C
    tokens = le.prompt(25, n)
    kv = le.kv_for(25, n)
    writer.store(tokens, kv_source=kv)
    le.wait_stored(writer, tokens)
    stats = c.client.plane_stats()
    chunk_bytes = kv.numel() * kv.element_size() // 3
    assert stats["shm"]["bytes"] >= 3 * chunk_bytes, stats
    assert stats["shm_staged"]["bytes"] == 0 and stats["grpc"]["bytes"] == 0, stats

    for tag, extra in (("r", {"shm_name": shm_name("r")}), ("copied", {})):
        reader = engine_at(dict(le.plugin_config(server.target), **extra), cpu_gb=SHM_CPU_GB)
        rc = le.connector(reader)._connection()
        assert (rc.region is not None) == bool(extra), tag
        dest = torch.zeros_like(kv)
        assert int(reader.retrieve(tokens, kv_dest=dest).sum()) == n, tag
        assert le.same_bits(dest, kv), tag
        stats = rc.client.plane_stats()
        if extra:
            assert stats["shm"]["bytes"] >= 3 * chunk_bytes, stats
            assert stats["shm_staged"]["bytes"] == 0 and stats["grpc"]["bytes"] == 0, stats


def test_shared_buffer_is_the_mapped_file_only(tmp_path):
    # The connector takes LMCache's CPU buffer as a region only where the buffer is the very
    # file /dev/shm/<shm_name> maps, at the offset it maps it.
    name = shm_name("probe")
    path = os.path.join("/dev/shm", name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 4 * mmap.PAGESIZE)
        mapped = mmap.mmap(fd, 4 * mmap.PAGESIZE)
        whole = torch.frombuffer(mapped, dtype=torch.uint8)

        def backend(name_, buffer):
            return types.SimpleNamespace(memory_allocator=types.SimpleNamespace(
                shm_name=name_, buffer=buffer))

        got, why = shared_buffer(backend(name, whole))
        assert got is not None, why
        assert (got.address, got.size, got.offset) == (whole.data_ptr(), 4 * mmap.PAGESIZE, 0)
        os.close(got.fd)
        part = whole[mmap.PAGESIZE:3 * mmap.PAGESIZE]
        got, why = shared_buffer(backend("/" + name, part))
        assert got is not None and got.offset == mmap.PAGESIZE, why
        os.close(got.fd)
        # Private memory under the name of a file it is not: refused, the file left alone.
        got, why = shared_buffer(backend(name, torch.zeros(4 * mmap.PAGESIZE, dtype=torch.uint8)))
        assert got is None and "is not the file" in why
        got, why = shared_buffer(backend(name + "-missing", whole))
        assert got is None and "cannot open" in why
        got, why = shared_buffer(backend(None, whole))
        assert got is None and "shm_name" in why
        del whole, part
        mapped.close()
    finally:
        os.close(fd)
        os.unlink(path)


def test_batched_exists_counts_the_leading_hits(server, engine_at):
    engine = engine_at(le.plugin_config(server.target))
    conn = le.connector(engine)
    tokens = le.prompt(31, 4 * C)
    engine.store(tokens, kv_source=le.kv_for(31, 4 * C))
    le.wait_stored(engine, tokens)
    keys = keys_of(engine, tokens)
    other = keys_of(engine, le.prompt(32, 2 * C))
    assert conn.batched_contains(keys) == 4
    assert conn.batched_contains(keys[:2] + other[:1] + keys[2:]) == 2
    assert conn.batched_contains(other + keys) == 0
    assert conn.batched_contains([]) == 0
    assert conn.exists_sync(keys[3]) and not conn.exists_sync(other[0])

    async def lookups():
        return (await conn.exists(keys[1]), await conn.exists(other[1]),
                await conn.batched_async_contains("l1", keys + other))

    assert asyncio.run(lookups()) == (True, False, 4)
    # The engine's own lookup takes the batched path through the remote backend.
    assert le.remote(engine).batched_contains(keys) == 4


def test_bad_keys_are_misses(server, engine_at):
    engine = engine_at(le.plugin_config(server.target))
    conn = le.connector(engine)
    tokens = le.prompt(41, 2 * C)
    kv = le.kv_for(41, 2 * C)
    engine.store(tokens, kv_source=kv)
    le.wait_stored(engine, tokens)
    key = keys_of(engine, tokens)[0]
    # Another model name, worker or chunk hash: a different key, a miss.
    for bad in (CacheEngineKey("other-model", key.world_size, key.worker_id, key.chunk_hash,
                               key.dtype),
                CacheEngineKey(key.model_name, key.world_size, key.worker_id + 1,
                               key.chunk_hash, key.dtype),
                CacheEngineKey(key.model_name, key.world_size, key.worker_id,
                               key.chunk_hash ^ 1, key.dtype)):
        assert not conn.exists_sync(bad)
        assert asyncio.run(conn.get(bad)) is None

    # A chain cut short (blocks 0..k of a whole chunk's chain, as eviction from the tail leaves
    # it): not a chunk, neither at full length nor at a shorter one.
    cut = CacheEngineKey(key.model_name, key.world_size, key.worker_id, 12345, key.dtype)
    c = conn._connection()
    blocks = C // conn.g
    seq = c.client.create_sequence(conn.model, prompt=[C] * (blocks * conn.block_tokens),
                                   extra_keys=[("custom", conn._digest(cut))])
    half = (blocks // 2) * conn.block_tokens
    c.client.append(conn.model, seq.id, bytes(half * conn.block_bytes // conn.block_tokens),
                    num_tokens=half)
    c.client.free(conn.model, seq.id)
    chain = conn._chain(c, conn._digest(cut), C)
    assert c.client.match(conn.model, [chain]) == [half]
    assert not conn.exists_sync(cut)
    assert asyncio.run(conn.get(cut)) is None

    # A chunk of a size this engine does not make: not stored, no exception.
    class Odd:
        byte_array = memoryview(bytearray(conn.single_token_size + 2))

    asyncio.run(conn.put(cut, Odd()))  # type: ignore[arg-type]
    assert not conn.exists_sync(cut)

    # The engine still retrieves what it stored, bit for bit.
    dest = torch.zeros_like(kv)
    assert int(engine.retrieve(tokens, kv_dest=dest).sum()) == 2 * C
    assert le.same_bits(dest, kv)


@pytest.mark.parametrize("extra", [
    pytest.param({"remote_storage_plugin.kvbank.module_path": "kvbank.lmcache",
                  "remote_storage_plugin.kvbank.class_name": "KvbankConnector"},
                 id="no-target"),
    pytest.param(dict(le.plugin_config("127.0.0.1:1"), **{
        "remote_storage_plugin.kvbank.threads": "0"}), id="zero-threads"),
    pytest.param(dict(le.plugin_config("127.0.0.1:1"), **{
        "remote_storage_plugin.kvbank.zero_copy": "always"}), id="bad-zero-copy"),
])
def test_bad_config_leaves_the_plugin_out(engine_at, extra):
    engine = engine_at(extra)
    remote = le.backends(engine).get(le.REMOTE)
    assert remote is None or remote.connection is None
    # The engine serves from its CPU backend all the same.
    tokens = le.prompt(51, 2 * C)
    kv = le.kv_for(51, 2 * C)
    engine.store(tokens, kv_source=kv)
    dest = torch.zeros_like(kv)
    assert int(engine.retrieve(tokens, kv_dest=dest).sum()) == 2 * C
    assert le.same_bits(dest, kv)


def test_unreachable_server_is_a_miss(engine_at):
    # Nothing listens on port 1: the plugin constructs, every call is a miss.
    engine = engine_at(le.plugin_config("127.0.0.1:1", deadline_s="2"))
    conn = le.connector(engine)
    tokens = le.prompt(61, 2 * C)
    kv = le.kv_for(61, 2 * C)
    engine.store(tokens, kv_source=kv)  # its puts find no connection: nothing in flight
    keys = keys_of(engine, tokens)
    assert conn.batched_contains(keys) == 0 and not conn.exists_sync(keys[0])
    assert asyncio.run(conn.get(keys[0])) is None
    dest = torch.zeros_like(kv)
    assert int(engine.retrieve(tokens, kv_dest=dest).sum()) == 2 * C  # from the CPU backend
    assert le.same_bits(dest, kv)


@pytest.mark.parametrize("zero_copy", [False, True], ids=["copied", "zero-copy"])
def test_server_killed_mid_retrieve(own_server, engine_at, zero_copy):
    # LMCache's health monitor may find kvbank down: it then falls back to its CPU backend.
    cfg = dict(le.plugin_config(own_server.target, deadline_s="3", retry_s="60"),
               fallback_policy="local_cpu")
    writer = engine_at(cfg)
    if zero_copy:  # the reader's CPU buffer is a region: kvbankd writes straight into it
        cfg = dict(cfg, shm_name=shm_name("killed"))
    n = 6 * C
    tokens = le.prompt(71, n)
    kv = le.kv_for(71, n)
    writer.store(tokens, kv_source=kv)
    le.wait_stored(writer, tokens)

    reader = engine_at(cfg, cpu_gb=SHM_CPU_GB)  # empty: every chunk comes from kvbank
    conn = le.connector(reader)
    assert (conn._connection().region is not None) == zero_copy
    assert le.remote(reader).batched_contains(keys_of(reader, tokens)) == 6
    client = conn._connection().client
    fetch = client.fetch_blocks_into
    calls = []

    def fetch_then_die(*args, **kw):
        # kvbankd is killed while the third chunk's fetch is on its way.
        calls.append(1)
        if len(calls) == 3:
            own_server.proc.kill()
            own_server.proc.wait(timeout=30)
        return fetch(*args, **kw)

    client.fetch_blocks_into = fetch_then_die
    dest = torch.zeros_like(kv)
    got = int(reader.retrieve(tokens, kv_dest=dest).sum())
    assert own_server.proc.poll() is not None and len(calls) >= 3
    print(f"[lmcache] kvbankd killed at fetch 3 of {n // C}: {got} of {n} tokens retrieved")
    assert got % C == 0 and got < n, got
    assert le.same_bits(dest[:, :, :got], kv[:, :, :got])
    # Past the hits, a chunk is untouched or (fetched before the kill) exactly the stored one.
    for b in range(got, n, C):
        part = dest[:, :, b:b + C]
        assert bool((part.view(torch.int16) == 0).all()) or \
            le.same_bits(part, kv[:, :, b:b + C]), f"wrong bytes at token {b}"
    if zero_copy:  # a failed fetch's buffer stays out of LMCache's hands for a while
        assert conn._spoilt, "a failed zero-copy get gave its buffer straight back"
    assert asyncio.run(conn.ping()) != 0
    # The engine keeps serving: lookups miss, stores and retrieves go to its CPU backend.
    assert reader.lookup(le.prompt(72, 2 * C)) == 0
    tokens2 = le.prompt(73, 2 * C)
    kv2 = le.kv_for(73, 2 * C)
    reader.store(tokens2, kv_source=kv2)
    dest2 = torch.zeros_like(kv2)
    assert int(reader.retrieve(tokens2, kv_dest=dest2).sum()) == 2 * C
    assert le.same_bits(dest2, kv2)
    assert conn.batched_contains(keys_of(reader, tokens)) == 0
