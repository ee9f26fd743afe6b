"""The Python SDK against the real kvbankd: bytes, errors, threads, futures, prefix hashes."""

import asyncio
import importlib.metadata
import json
import os
import re
import sys
import threading
import time
import tracemalloc

import numpy as np
import pytest

import kvbank
import kvbank.aio

from conftest import REPO

MiB = 1 << 20


def small_layout(name, dtype="fp16", layers=4, kv_heads=2, head_dim=64, block_tokens=16):
    return {"name": name, "num_layers": layers, "num_q_heads": 2 * kv_heads,
            "num_kv_heads": kv_heads, "head_dim": head_dim, "block_tokens": block_tokens,
            "dtype": dtype}


def random_payload(rng, dtype, count):
    """count finite elements of `dtype` as the numpy array that holds them (bf16: uint16)."""
    if dtype == "fp32":
        return rng.standard_normal(count).astype(np.float32)
    if dtype == "fp16":
        return rng.standard_normal(count).astype(np.float16)
    # bf16: random sign and mantissa, exponent kept away from all-ones (no Inf / NaN).
    bits = rng.integers(0, 1 << 16, size=count, dtype=np.uint16)
    exponent = (bits >> 7) & 0xFF
    return np.where(exponent == 0xFF, bits & np.uint16(0xBFFF), bits).astype(np.uint16)


def elements(model, num_tokens, layer_begin=0, layer_end=None, dtype=None):
    nbytes = model.payload_bytes(num_tokens, layer_begin, layer_end, dtype)
    return nbytes // kvbank.numpy_dtype(dtype or model.layout["layer_dtypes"][0]).itemsize


# ---- bytes -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_round_trip_is_bit_exact(client, model_name, dtype):
    model = client.ensure_model(small_layout(model_name, dtype))
    assert model.created and model.name == model_name
    assert model.layout["layer_dtypes"] == [dtype] * 4
    rng = np.random.default_rng(7001)
    n = 37  # two full blocks and a partial one
    payload = random_payload(rng, dtype, elements(model, n))
    seq = client.create_sequence(model_name)
    info = client.append(model_name, seq.id, payload, num_tokens=n)
    assert info.length == n

    got = client.fetch(model_name, seq.id)
    assert got.dtype == kvbank.numpy_dtype(dtype)
    assert got.tobytes() == payload.tobytes()
    assert client.fetch(model_name, seq.id, as_bytes=True) == payload.tobytes()

    # A token range of a layer range: the same bytes as slicing the payload.
    part = client.fetch(model_name, seq.id, token_begin=5, token_end=21, layer_begin=1,
                        layer_end=3)
    layer = payload.reshape(4, 2, 2, n, 64)  # [layer][K,V][head][token][dim]
    assert part.tobytes() == np.ascontiguousarray(layer[1:3, :, :, 5:21, :]).tobytes()

    # k / v arrays: appended without building the payload, fetched back into arrays.
    k = random_payload(rng, dtype, 4 * 2 * 3 * 64).reshape(4, 2, 3, 64)
    v = random_payload(rng, dtype, 4 * 2 * 3 * 64).reshape(4, 2, 3, 64)
    info = client.append(model_name, seq.id, k=k, v=v)  # num_tokens from k's shape
    assert info.length == n + 3
    k_out, v_out = np.zeros_like(k), np.zeros_like(v)
    client.fetch_tensors(model_name, seq.id, k_out, v_out, token_begin=n)
    assert k_out.tobytes() == k.tobytes() and v_out.tobytes() == v.tobytes()
    assert client.free(model_name, seq.id) > 0


def test_each_tensor_parallel_rank_fetches_its_kv_heads(client, model_name):
    model = client.ensure_model(small_layout(model_name, "fp16", kv_heads=4))
    rng = np.random.default_rng(7101)
    n = 21
    payload = random_payload(rng, "fp16", elements(model, n))
    seq = client.create_sequence(model_name)
    client.append(model_name, seq.id, payload, num_tokens=n)
    layer = payload.reshape(4, 2, 4, n, 64)  # [layer][K,V][head][token][dim]
    for rank in range(2):  # a decode engine with TP 2: heads [2 rank, 2 rank + 2)
        h0, h1 = 2 * rank, 2 * rank + 2
        want = np.ascontiguousarray(layer[:, :, h0:h1]).tobytes()
        got = client.fetch(model_name, seq.id, kv_head_begin=h0, kv_head_end=h1)
        assert got.tobytes() == want
        out = np.empty(len(want) // 2, dtype=np.float16)
        info = client.fetch_into(model_name, seq.id, out, kv_head_begin=h0, kv_head_end=h1)
        assert (info.kv_head_begin, info.kv_head_end) == (h0, h1)
        assert out.tobytes() == want
        k, v = np.empty((4, 2, n, 64), np.float16), np.empty((4, 2, n, 64), np.float16)
        client.fetch_tensors(model_name, seq.id, k, v, kv_head_begin=h0, kv_head_end=h1)
        assert k.tobytes() == np.ascontiguousarray(layer[:, 0, h0:h1]).tobytes()
        assert v.tobytes() == np.ascontiguousarray(layer[:, 1, h0:h1]).tobytes()
    with pytest.raises(kvbank.InvalidArgumentError, match="kv head range"):
        client.fetch(model_name, seq.id, kv_head_begin=3, kv_head_end=6)
    client.free(model_name, seq.id)


def test_prefill_ranks_append_their_kv_heads_at_once(client, model_name):
    """A prefill with TP 2: each rank appends its two kv heads (a payload, and k / v tensors)
    from its own thread with append_async; the sequence holds what one all-heads append does."""
    client.ensure_model(small_layout(model_name, "fp16", kv_heads=4))
    rng = np.random.default_rng(7102)
    n = 37
    kv = rng.standard_normal((4, 2, 4, n, 64)).astype(np.float16)  # [layer][K,V][head][t][dim]
    seq = client.create_sequence(model_name)
    futures = []
    for rank in range(2):
        h0, h1 = 2 * rank, 2 * rank + 2
        part = np.ascontiguousarray(kv[:, :, h0:h1])
        if rank == 0:
            futures.append(client.append_async(model_name, seq.id, part, num_tokens=n,
                                               kv_head_begin=h0, kv_head_end=h1))
        else:
            futures.append(client.append_async(
                model_name, seq.id, k=np.ascontiguousarray(part[:, 0]),
                v=np.ascontiguousarray(part[:, 1]), kv_head_begin=h0, kv_head_end=h1))
    lengths = sorted(f.result(timeout=30).length for f in futures)
    assert lengths[1] == n  # the second commit completes every head
    assert client.get_sequence(model_name, seq.id).length == n
    assert client.fetch(model_name, seq.id).tobytes() == kv.tobytes()
    with pytest.raises(kvbank.InvalidArgumentError, match="kv head range"):
        client.append(model_name, seq.id, kv[:, :, :1].copy(), num_tokens=n, kv_head_begin=4)
    client.free(model_name, seq.id)


def test_fetch_waits_for_its_layer_to_be_committed(client, model_name):
    """Layer-wise handoff: a fetch with wait_s registered before layer 1 exists returns its
    bytes once the append of layer 1 commits; one whose layer never comes times out."""
    client.ensure_model(small_layout(model_name, "fp16", layers=2))
    rng = np.random.default_rng(7103)
    n = 19
    kv = rng.standard_normal((2, 2, 2, n, 64)).astype(np.float16)
    seq = client.create_sequence(model_name)
    pulled = client.fetch_async(model_name, seq.id, token_end=n, layer_begin=1, layer_end=2,
                                wait_s=30)

    def waiting():
        return {s["model"]: s for s in client.stats()}[model_name]["fetches_waiting"]

    deadline = time.monotonic() + 20
    while waiting() != 1:
        assert time.monotonic() < deadline, "the fetch never waited on the server"
        time.sleep(0.002)
    client.append(model_name, seq.id, kv[1:].copy(), num_tokens=n, layer_begin=1, layer_end=2)
    assert pulled.result(timeout=30).tobytes() == kv[1].tobytes()
    with pytest.raises(kvbank.DeadlineExceededError, match="wait_ms=200"):
        client.fetch(model_name, seq.id, token_end=n, layer_begin=0, layer_end=1, wait_s=0.2)
    assert waiting() == 0
    client.free(model_name, seq.id)


def test_fetch_into_numpy_writes_in_place_without_a_python_copy(client, model_name):
    model = client.ensure_model(small_layout(model_name, "fp16", head_dim=128), pool_bytes=48 * MiB)
    n = 1024  # 4 layers x 2 heads x 2 (K, V) x 128 x 2 bytes = 4 KiB a token: 4 MiB
    rng = np.random.default_rng(7002)
    payload = random_payload(rng, "fp16", elements(model, n))
    assert payload.nbytes == 4 * MiB
    seq = client.create_sequence(model_name)
    client.append(model_name, seq.id, payload, num_tokens=n)

    out = np.zeros(payload.size, dtype=np.float16)
    address = out.ctypes.data
    tracemalloc.start()
    try:
        info = client.fetch_into(model_name, seq.id, out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.payload_bytes == payload.nbytes and info.num_tokens == n
    assert info.dtype == "fp16" and (info.layer_begin, info.layer_end) == (0, 4)
    assert out.ctypes.data == address
    assert out.tobytes() == payload.tobytes()
    # Python allocated far less than the payload while fetching: no bytes object on the way.
    assert peak < payload.nbytes // 16, f"fetch_into allocated {peak} bytes in Python"

    # A bigger buffer: the payload lands at its start, the rest is untouched.
    big = np.full(payload.size + 100, 7, dtype=np.float16)
    info = client.fetch_into(model_name, seq.id, big)
    assert big[:payload.size].tobytes() == payload.tobytes()
    assert np.all(big[payload.size:] == 7)

    # A memoryview over part of a bytearray is a buffer like any other.
    raw = bytearray(payload.nbytes + 8)
    client.fetch_into(model_name, seq.id, memoryview(raw)[8:])
    assert bytes(raw[8:]) == payload.tobytes()


def test_fetch_into_refuses_small_readonly_and_strided_buffers(client, model_name):
    model = client.ensure_model(small_layout(model_name, "fp32"))
    seq = client.create_sequence(model_name)
    n = 8
    payload = random_payload(np.random.default_rng(7003), "fp32", elements(model, n))
    client.append(model_name, seq.id, payload, num_tokens=n)
    small = np.zeros(payload.size - 1, dtype=np.float32)
    with pytest.raises(kvbank.OutOfRangeError) as e:
        client.fetch_into(model_name, seq.id, small)
    assert str(payload.nbytes) in e.value.message and str(small.nbytes) in e.value.message
    assert e.value.code == 11
    with pytest.raises(BufferError):
        client.fetch_into(model_name, seq.id, bytes(payload.nbytes))  # read-only
    with pytest.raises((BufferError, ValueError), match="contiguous"):
        client.fetch_into(model_name, seq.id, np.zeros(2 * payload.size, np.float32)[::2])


class FakeTensor:
    """What kvbank asks of a torch tensor without the buffer protocol: data_ptr(), nbytes,
    device.type, is_contiguous() (the memory is a numpy array's)."""

    class device:
        type = "cpu"

    def __init__(self, array):
        self.array = array
        self.nbytes = array.nbytes

    def data_ptr(self):
        return self.array.ctypes.data

    def is_contiguous(self):
        return self.array.flags.c_contiguous


def test_fetch_into_and_append_through_data_ptr(client, model_name):
    model = client.ensure_model(small_layout(model_name, "bf16"))
    n = 20
    payload = random_payload(np.random.default_rng(7004), "bf16", elements(model, n))
    seq = client.create_sequence(model_name)
    client.append(model_name, seq.id, FakeTensor(payload), num_tokens=n)
    out = np.zeros_like(payload)
    info = client.fetch_into(model_name, seq.id, FakeTensor(out))
    assert info.payload_bytes == payload.nbytes
    assert out.tobytes() == payload.tobytes()


def test_fetch_into_torch_tensor(client, model_name):
    torch = pytest.importorskip("torch", reason="torch is not installed in the test venv")
    model = client.ensure_model(small_layout(model_name, "bf16"))
    n = 33
    k = torch.randn(4, 2, n, 64, dtype=torch.bfloat16)
    v = torch.randn(4, 2, n, 64, dtype=torch.bfloat16)
    seq = client.create_sequence(model_name)
    client.append(model_name, seq.id, k=k, v=v)
    out = torch.empty(model.payload_bytes(n) // 2, dtype=torch.bfloat16)
    client.fetch_into(model_name, seq.id, out)
    got = out.view(4, 2, 2, n, 64)
    assert torch.equal(got[:, 0], k) and torch.equal(got[:, 1], v)
    k_out, v_out = torch.empty_like(k), torch.empty_like(v)
    client.fetch_tensors(model_name, seq.id, k_out, v_out)
    assert torch.equal(k_out, k) and torch.equal(v_out, v)


# ---- errors ----------------------------------------------------------------------------------


def test_errors_map_to_typed_exceptions_with_the_servers_message(client, model_name):
    with pytest.raises(kvbank.NotFoundError) as e:
        client.get_sequence("no-such-model", 1)
    assert e.value.code == 5 and e.value.code_name == "NOT_FOUND"
    assert "no-such-model" in e.value.message
    assert isinstance(e.value, kvbank.Error) and isinstance(e.value, LookupError)

    client.ensure_model(small_layout(model_name, "fp16"), pool_bytes=1 * MiB)
    with pytest.raises(kvbank.NotFoundError) as not_found:
        client.get_sequence(model_name, 987654321)
    assert "987654321" in not_found.value.message

    bad = small_layout(model_name + "x", "fp16")
    bad["num_kv_heads"] = 3  # 4 q heads are not a multiple of 3 kv heads
    with pytest.raises(kvbank.InvalidArgumentError) as invalid:
        client.ensure_model(bad)
    assert invalid.value.code == 3 and "head" in invalid.value.message

    # The same name with another layout: the server refuses, naming the model.
    other = small_layout(model_name, "fp32")
    with pytest.raises(kvbank.Error) as refused:
        client.ensure_model(other)
    assert refused.value.code in (6, 9) and model_name in refused.value.message

    # A payload of the wrong size.
    seq = client.create_sequence(model_name)
    with pytest.raises(kvbank.InvalidArgumentError) as wrong_size:
        client.append(model_name, seq.id, np.zeros(10, np.float16), num_tokens=1)
    assert "20" in wrong_size.value.message or "bytes" in wrong_size.value.message

    # More tokens than the 1 MiB pool holds (4 KiB a token: 256 tokens at most).
    model = client.get_model(model_name)
    n = model.num_blocks * model.layout["block_tokens"] + 16
    with pytest.raises(kvbank.ResourceExhaustedError) as exhausted:
        client.append(model_name, seq.id, np.zeros(elements(model, n), np.float16), num_tokens=n)
    assert exhausted.value.code == 8 and exhausted.value.message
    assert client.get_sequence(model_name, seq.id).length == 0, "a failed append changes nothing"

    # Bad arguments the SDK refuses before any RPC are InvalidArgumentError too.
    with pytest.raises(kvbank.InvalidArgumentError, match="dtype 'fp64'"):
        client.fetch(model_name, seq.id, dtype="fp64")
    with pytest.raises(kvbank.InvalidArgumentError, match="unknown layout field 'heads'"):
        client.ensure_model({"name": "y", "heads": 2})


def test_unavailable_server_is_a_connection_error():
    c = kvbank.Client("127.0.0.1:1", deadline_s=2.0)
    with pytest.raises(kvbank.Error) as e:
        c.list_models()
    assert isinstance(e.value, (kvbank.UnavailableError, kvbank.DeadlineExceededError))


# ---- threads, futures, asyncio --------------------------------------------------------------


def _big_sequence(client, model_name, mib):
    layout = small_layout(model_name, "fp16", layers=8, kv_heads=8, head_dim=128, block_tokens=64)
    model = client.ensure_model(layout, pool_bytes=(2 * mib + 8) * MiB)  # room for two copies
    n = mib * MiB // model.payload_bytes(1)
    payload = np.random.default_rng(7005).integers(0, 1 << 14, elements(model, n),
                                                   dtype=np.uint16).view(np.float16)
    seq = client.create_sequence(model_name)
    return model, client.append(model_name, seq.id, payload, num_tokens=n), payload


def test_gil_is_released_during_a_fetch(server, model_name):
    # By gRPC: through shared memory the 96 MiB fetch is over too soon to tell a held GIL from a
    # released one (both paths release it around the same C++ call).
    with kvbank.Client(server.target, shm=False) as client:
        _gil_is_released_during_a_fetch(client, model_name)


def _gil_is_released_during_a_fetch(client, model_name):
    model, seq, payload = _big_sequence(client, model_name, 96)
    out = np.empty_like(payload)
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.monotonic())
            for _ in range(200):  # pure Python: runs only while it holds the GIL
                pass

    t = threading.Thread(target=ticker)
    t.start()
    try:
        while not ticks:
            time.sleep(0.001)
        fetches = []
        for _ in range(3):
            t0 = time.monotonic()
            client.fetch_into(model_name, seq.id, out)
            t1 = time.monotonic()
            fetches.append((t0, t1))
    finally:
        stop.set()
        t.join(timeout=30)
    assert out.tobytes() == payload.tobytes()
    # The ticker kept running through a fetch. Held, the GIL would stop it for the whole call
    # (the C++ call never gives it up): its longest pause would be the fetch's length. Released,
    # it only waits its turn in Python's switch interval (5 ms) and the OS scheduler's (2 busy
    # cores). Only a fetch of at least four switch intervals can tell the two apart; of those,
    # the best must show a pause under half the fetch.
    shares = []
    for t0, t1 in fetches:
        during = [x for x in ticks if t0 <= x <= t1]
        edges = [t0] + during + [t1]
        longest_gap = max(b - a for a, b in zip(edges, edges[1:]))
        print(f"fetch {(t1 - t0) * 1e3:.1f} ms, {len(during)} ticks during it, longest gap "
              f"{longest_gap * 1e3:.1f} ms")
        if t1 - t0 >= 4 * sys.getswitchinterval():
            shares.append(longest_gap / (t1 - t0))
    assert shares, "every fetch was too short to tell a held GIL from a released one"
    assert min(shares) < 0.5, f"the ticker stalled through every fetch: {shares}"


def test_futures_overlap_transfers_with_a_call_in_flight(client, model_name):
    model, seq, payload = _big_sequence(client, model_name, 8)
    # A call that stays in flight for seconds: a watch on a model with no events.
    slow = client._submit(lambda: list(client.watch(model_name, deadline_s=3.0)))
    outs = [np.empty_like(payload) for _ in range(3)]
    futures = [client.fetch_into_async(model_name, seq.id, o) for o in outs]
    compute = 0
    while not all(f.done() for f in futures):
        compute += 1  # the calling thread goes on while the fetches run
    for f, o in zip(futures, outs):
        assert f.result().payload_bytes == payload.nbytes
        assert o.tobytes() == payload.tobytes()
    assert not slow.done(), "the watch ended before the fetches did: they did not overlap"
    assert compute > 0
    assert slow.result(timeout=30) == []

    # Appends as futures too; their errors come back through the future.
    seq2 = client.create_sequence(model_name)
    f = client.append_async(model_name, seq2.id, payload, num_tokens=seq.length)
    assert f.result(timeout=60).length == seq.length
    bad = client.append_async(model_name, 123456789, payload, num_tokens=seq.length)
    with pytest.raises(kvbank.NotFoundError):
        bad.result(timeout=60)


def test_asyncio_wrapper_keeps_the_loop_running(client, model_name):
    model, seq, payload = _big_sequence(client, model_name, 8)
    aclient = kvbank.aio.AsyncClient(client)

    async def main():
        outs = [np.empty_like(payload) for _ in range(2)]
        ticks = 0
        done = False

        async def ticker():
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0)

        tick_task = asyncio.ensure_future(ticker())
        infos = await asyncio.gather(*[aclient.fetch_into(model_name, seq.id, o) for o in outs])
        fetched = await aclient.fetch(model_name, seq.id, token_end=1)
        info = await aclient.get_sequence(model_name, seq.id)  # every Client method, awaited
        done = True
        await tick_task
        return outs, infos, fetched, info, ticks

    outs, infos, fetched, info, ticks = asyncio.run(main())
    for o, i in zip(outs, infos):
        assert i.payload_bytes == payload.nbytes and o.tobytes() == payload.tobytes()
    assert info.length == seq.length
    assert fetched.size == elements(model, 1)
    assert ticks > 1, "the event loop ran while the fetches were in flight"


# ---- sequences, prefix cache, events, attention ----------------------------------------------


def test_sequence_lifecycle(client, model_name):
    model = client.ensure_model(small_layout(model_name, "fp16"))
    assert model_name in [m.name for m in client.list_models()]
    assert client.get_model(model_name).fingerprint == model.fingerprint
    rng = np.random.default_rng(7006)
    seq = client.create_sequence(model_name, lease_s=60)
    assert 0 < seq.lease_ttl_s <= 60
    payload = random_payload(rng, "fp16", elements(model, 40))
    client.append(model_name, seq.id, payload, num_tokens=40)
    fork = client.fork(model_name, seq.id)
    assert fork.id != seq.id and fork.length == 40
    assert client.truncate(model_name, fork.id, 10).length == 10
    want = np.ascontiguousarray(payload.reshape(4, 2, 2, 40, 64)[:, :, :, :10]).tobytes()
    assert client.fetch(model_name, fork.id, as_bytes=True) == want
    assert client.fetch(model_name, seq.id, as_bytes=True) == payload.tobytes()
    assert client.renew_lease(model_name, seq.id).lease_ttl_s > 0
    # Per-layer appends: layers [0, 2) then [2, 4).
    layered = client.create_sequence(model_name)
    half = payload.reshape(4, -1)
    client.append(model_name, layered.id, half[:2].copy(), num_tokens=40, layer_end=2)
    info = client.append(model_name, layered.id, half[2:].copy(), num_tokens=40, layer_begin=2)
    assert info.layer_lengths == [40] * 4
    assert client.fetch(model_name, layered.id, as_bytes=True) == payload.tobytes()
    stats = {s["model"]: s for s in client.stats()}[model_name]
    assert stats["sequences"] == 3 and stats["appends"] >= 3
    for s in (seq, fork, layered):
        client.free(model_name, s.id)
    with pytest.raises(kvbank.FailedPreconditionError, match="freed"):
        client.get_sequence(model_name, seq.id)
    client.drop_model(model_name)
    with pytest.raises(kvbank.NotFoundError):
        client.get_model(model_name)


def test_prefix_cache_match_fetch_blocks_pin_and_watch(client, model_name):
    bt = 16
    model = client.ensure_model(small_layout(model_name, "fp16", block_tokens=bt))
    root = client.get_prefix_root(model_name)
    assert root.block_tokens == bt and root.layout_fingerprint == model.fingerprint
    # The root the server uses is the one the SDK computes from the fingerprint and tenant.
    assert root.root == kvbank.root_hash(model.fingerprint, root.tenant, algorithm=root.algorithm)
    assert kvbank.layout_fingerprint(model.layout) == model.fingerprint

    prompt = list(range(1000, 1000 + 3 * bt + 5))  # 3 full blocks and 5 tokens
    hashes = kvbank.prefix_hashes(root.root, prompt, bt, algorithm=root.algorithm)
    assert len(hashes) == 3
    events = client.watch(model_name, after_sequence=0, deadline_s=30.0)  # every event retained

    rng = np.random.default_rng(7007)
    payload = random_payload(rng, "fp16", elements(model, len(prompt)))
    first = client.create_sequence(model_name, prompt)
    assert first.cached_tokens == 0
    client.append(model_name, first.id, payload, num_tokens=len(prompt))
    assert client.match(model_name, [prompt, hashes, prompt[:bt + 3], [1, 2, 3]]) == \
        [3 * bt, 3 * bt, bt, 0]
    assert client.match(model_name, [prompt], cache_salt="other") == [0]
    # A server without tiers: everything in its pool.
    assert client.match_tiers(model_name, [prompt]) == \
        [{"tokens": 3 * bt, "pool_tokens": 3 * bt, "host_tokens": 0, "disk_tokens": 0}]
    assert client.match_tiers(model_name, [prompt], prefetch=True) == \
        client.match_tiers(model_name, [prompt])

    second = client.create_sequence(model_name, prompt)
    assert second.cached_tokens == 3 * bt
    blocks = client.fetch_blocks(model_name, hashes)
    assert blocks.info.num_tokens == 3 * bt
    want = np.ascontiguousarray(payload.reshape(4, 2, 2, len(prompt), 64)[:, :, :, :3 * bt])
    assert blocks.data.tobytes() == want.tobytes()
    assert client.pin(model_name, hashes=hashes[:2]) == 2
    assert client.pin(model_name, tokens=prompt, pin=False) == 3

    # The watch started before the append: the stored events carry the same hashes.
    client.free(model_name, first.id)
    client.free(model_name, second.id)
    stored = []
    for e in events:
        if e.type == "stored":
            stored += e.hashes
        if len(stored) >= 3:
            break
    events.close()
    assert stored[:3] == hashes


def test_results_are_the_packages_dataclasses_as_the_extension_builds_them(server, client,
                                                                           model_name):
    # The extension builds kvbank's result classes itself: the binding's own return values are
    # them, nested ones included, and the wrappers hand them on.
    layout = small_layout(model_name, "fp16", block_tokens=16)
    model = client.ensure_model(layout)
    assert type(model) is kvbank.ModelInfo and type(client.list_models()[0]) is kvbank.ModelInfo
    assert isinstance(model.layout, dict)  # a layout stays a dict
    seq = client._c.create_sequence(model_name, None, list(range(40)))
    assert type(seq) is kvbank.SequenceInfo and seq.model == model_name and seq.length == 0
    assert type(client._c.get_sequence(model_name, seq.id)) is kvbank.SequenceInfo
    payload = np.zeros(elements(model, 40), np.float16)
    assert type(client.append(model_name, seq.id, payload, num_tokens=40)) is kvbank.SequenceInfo
    meta, _ = client._c.fetch(model_name, seq.id)
    assert type(meta) is kvbank.FetchInfo and meta.dtype == "fp16"
    assert type(client.fetch_into(model_name, seq.id, np.empty_like(payload))) is kvbank.FetchInfo
    root = client._c.get_prefix_root(model_name)
    assert type(root) is kvbank.PrefixRoot and len(root.root) == 32
    hashes = kvbank.prefix_hashes(root.root, list(range(40)), 16, algorithm=root.algorithm)
    assert type(client.fetch_blocks(model_name, hashes).info) is kvbank.FetchInfo
    event = next(client.watch(model_name, after_sequence=0, deadline_s=10.0))
    assert type(event) is kvbank.Event and event.type == "stored"
    assert all(type(h) is bytes for h in event.hashes)
    assert isinstance(client.stats(model_name)[0], dict)  # stats stay dicts
    client.free(model_name, seq.id)

    fleet = kvbank.Fleet(server.target)
    assert type(fleet.replicas()[0]) is kvbank.Replica
    assert type(fleet.ensure_model(layout)) is kvbank.ModelInfo
    fseq = fleet.create_sequence(model_name, prompt=list(range(40)))
    assert type(fseq) is kvbank.FleetSequence and type(fseq.info) is kvbank.SequenceInfo
    assert (fseq.model, fseq.id) == (fseq.info.model, fseq.info.id) == (model_name, fseq.id)
    fleet.free(fseq)


def test_attend_matches_a_numpy_reference(client, model_name):
    layout = small_layout(model_name, "fp32", layers=2, kv_heads=2, head_dim=16)
    client.ensure_model(layout)
    rng = np.random.default_rng(7008)
    n = 21
    k = rng.standard_normal((2, 2, n, 16)).astype(np.float32)
    v = rng.standard_normal((2, 2, n, 16)).astype(np.float32)
    seq = client.create_sequence(model_name)
    client.append(model_name, seq.id, k=k, v=v)
    q = rng.standard_normal((4, 16)).astype(np.float32)  # 4 q heads share 2 kv heads
    [(out, lse)] = client.attend(model_name, [(seq.id, 1, q)])
    scale = 1 / np.sqrt(16)
    for h in range(4):
        kv = h // 2
        s = (k[1, kv] @ q[h]).astype(np.float64) * scale
        m = s.max()
        p = np.exp(s - m)
        ref = (p / p.sum()) @ v[1, kv]
        np.testing.assert_allclose(out.reshape(4, 16)[h], ref, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(lse[h], m + np.log(p.sum()), rtol=1e-5, atol=1e-5)


# ---- prefix hashes, README -------------------------------------------------------------------


def test_prefix_hashes_equal_the_cpp_vectors():
    """The vectors tests/unit/prefix_hash_test.cc checks the C++ function against."""
    with open(os.path.join(REPO, "tests", "data", "prefix_hash_vectors.json")) as f:
        doc = json.load(f)
    checked = {"sha256": 0, "xxh3_128": 0}
    for v in doc["vectors"]:
        algo = v["algorithm"]
        root = kvbank.root_hash(v["fingerprint"], v["tenant"], v["salt"], algorithm=algo)
        assert root.hex() == v["root"], v["name"]
        keys = [tuple(k) for k in v["extra_keys"]]
        got = kvbank.prefix_hashes(root, v["tokens"], v["block_tokens"], keys, algorithm=algo)
        assert [h.hex() for h in got] == v["hashes"], v["name"]
        bt = v["block_tokens"]
        for i, h in enumerate(got):
            parent = root if i == 0 else got[i - 1]
            assert kvbank.chain_hash(parent, v["tokens"][i * bt:(i + 1) * bt], keys,
                                     algorithm=algo) == h
        checked[algo] += 1
    assert checked["sha256"] >= 7 and checked["sha256"] == checked["xxh3_128"]
    with pytest.raises(kvbank.InvalidArgumentError, match="32 bytes"):
        kvbank.prefix_hashes(b"short", [1, 2], 2)
    with pytest.raises(kvbank.InvalidArgumentError, match="algorithm"):
        kvbank.root_hash("fp", algorithm="md5")


def test_readme_example_runs(server):
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    m = re.search(r"<!-- python-example -->\s*```python\n(.*?)```", text, re.S)
    assert m, "README.md has no python example"
    code = m.group(1).replace("127.0.0.1:50051", server.target)
    assert len(code.strip().splitlines()) <= 14
    exec(compile(code, "README.md", "exec"), {})


# ---- version ---------------------------------------------------------------------------------


def test_version_is_the_projects(client):
    """kvbank.__version__, the package metadata and kvbankd's version are all the one written in
    project(kvbank VERSION ...)."""
    with open(os.path.join(REPO, "CMakeLists.txt")) as f:
        found = re.search(r"project\(kvbank\s+VERSION\s+([0-9.]+)", f.read())
    assert found is not None, "no project(kvbank VERSION ...) in CMakeLists.txt"
    assert kvbank.__version__ == found.group(1)
    assert importlib.metadata.version("kvbank") == kvbank.__version__
    assert client.server_info()["version"] == kvbank.__version__
