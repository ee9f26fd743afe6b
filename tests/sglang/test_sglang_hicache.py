"""kvbank.sglang with the real SGLang on the CPU: HiCacheController's write-back to kvbank
(write_storage) and prefetch (batch_exists, then the load into the host pool) in every host
layout, through the zero-copy and the flat-page interfaces, bit-exact; a second process with a
fresh host pool finding the pages; bad keys and slots; a kvbankd that goes away mid-transfer
(misses, never wrong bytes, SGLang's threads go on) and comes back.

Copies are checked bit for bit (bf16 compared as int16): the host pages written, what kvbank
holds (fetched with the SDK, against kvbank's block layout built here), what a prefetch put in
the host pool.
"""

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import kvbank
from kvbank.sglang import page_key_value

from hicache_rig import Rig, page_tokens

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = "sglang/tiny-llama"
SEED = 20261203


def bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_same(a, b, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.equal(bits(a), bits(b)), f"{what} differs"


def block_hashes(client, model, keys, page_size):
    """kvbank's name of each page, computed here from the SDK's hash function."""
    root = client.get_prefix_root(model)
    return [kvbank.chain_hash(root.root, [0] * page_size, [("custom", page_key_value(k))],
                              algorithm=root.algorithm) for k in keys]


LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


def fetched_payload(pages):
    """What kvbank's FetchBlocks answers for pages [2][layers][tokens][heads][dim] (one block
    each): the dense payload of their tokens, per layer K [heads][tokens][dim] then V."""
    return torch.cat(pages, dim=2).permute(1, 0, 3, 2, 4).contiguous().view(-1)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("v1", [1, 0])
def test_write_back_prefetch_load_bit_exact(server, client, layout, v1):
    """write_storage stores every page (batch_set_v1, or batch_set of flat pages without
    interface_v1); kvbank holds them in its block layout; a prefetch finds the leading run
    (batch_exists) and loads it into fresh host slots (batch_get_v1 / batch_get)."""
    name = f"tiny-llama-{layout}-v{v1}"
    rig = Rig(server.target, layout=layout, model_name=name, interface_v1=v1)
    model = "sglang/" + name
    try:
        assert rig.storage.model == model
        assert rig.cc.page_set_func == (rig.cc._page_set_zero_copy if v1
                                        else rig.cc._generic_page_set)
        num_pages = 6
        tokens = page_tokens(num_pages, rig.page_size, SEED)
        host_slots, pages = rig.fill_host(num_pages, SEED)
        keys, done = rig.write_storage(host_slots, tokens)
        assert done == len(tokens), f"the backup thread stored {done} of {len(tokens)} tokens"
        # What kvbank holds: every page, bit-exact, in kvbank's block layout.
        hashes = block_hashes(client, model, keys, rig.page_size)
        assert client.match(model, [hashes]) == [len(tokens)]
        blocks = client.fetch_blocks(model, hashes)
        assert blocks.info.num_tokens == len(tokens)
        assert_same(torch.from_numpy(blocks.data.view("int16")), bits(fetched_payload(pages)),
                    "kvbank's blocks")
        assert rig.storage._conn.client.data_plane == "shm"
        assert not rig.storage.zero_copy  # the default allocator's pool is in no shared file
        # The host copies go; a prefetch brings the pages back into other slots.
        rig.host.free(host_slots)
        got_slots, got = rig.prefetch(tokens)
        assert got == len(tokens), f"prefetch loaded {got} of {len(tokens)} tokens"
        for i, page in enumerate(rig.host_pages(got_slots)):
            assert_same(page, pages[i], f"page {i} loaded back")
        # A prompt that shares the first 4 pages: the leading run only.
        other = tokens[:4 * rig.page_size] + page_tokens(2, rig.page_size, SEED + 1)
        _, hit = rig.prefetch(other, rid="other")
        assert hit == 4 * rig.page_size
        stats = rig.storage._conn.client.plane_stats()
        assert stats["shm"]["calls"] > 0, stats
    finally:
        rig.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_zero_copy_with_a_shared_host_pool(server, client, layout):
    """With SGLang's shm host allocator ("allocator": "shm") the host pool's own memfd is a
    kvbank region: write-back appends each page straight from the pool and loads fetch straight
    into it (the page's layers, K and V, as runs of the file), no staging copy; kvbank keeps
    the pages token-major in its own model; bit-exact both ways; a batch whose tail kvbank does
    not hold loads its leading pages exactly."""
    name = f"tiny-llama-zc-{layout}"
    rig = Rig(server.target, layout=layout, model_name=name, allocator="shm", interface_v1=1)
    model = "sglang/" + name + "/token-major"
    try:
        assert rig.storage.zero_copy, "the shm host pool was not taken as a region"
        assert rig.storage.model == model
        num_pages = 6
        tokens = page_tokens(num_pages, rig.page_size, SEED + 7)
        host_slots, pages = rig.fill_host(num_pages, SEED + 7)
        keys, done = rig.write_storage(host_slots, tokens)
        assert done == len(tokens), f"the backup thread stored {done} of {len(tokens)} tokens"
        hashes = block_hashes(client, model, keys, rig.page_size)
        blocks = client.fetch_blocks(model, hashes)
        assert blocks.info.num_tokens == len(tokens)
        # Token-major blocks: per layer K [tokens][heads][dim] then V.
        want = torch.cat(pages, dim=2).transpose(0, 1).contiguous().view(-1)
        assert_same(torch.from_numpy(blocks.data.view("int16")), bits(want), "kvbank's blocks")
        rig.host.free(host_slots)
        got_slots, got = rig.prefetch(tokens)
        assert got == len(tokens), f"prefetch loaded {got} of {len(tokens)} tokens"
        for i, page in enumerate(rig.host_pages(got_slots)):
            assert_same(page, pages[i], f"page {i} loaded back")
        # No page went through the staging regions (those transfers are what plane_stats
        # counts as "shm"; the runs go straight between kvbankd and the pool's file).
        stats = rig.storage._conn.client.plane_stats()
        assert stats["shm"]["calls"] == 0 and stats["shm_staged"]["calls"] == 0, stats
        # Six keys, the last two unknown: the first four load, exactly, the rest answer False.
        slots = rig.host.alloc(num_pages * rig.page_size)
        mixed = keys[:4] + ["f" * 64, "e" * 64]
        assert rig.storage.batch_get_v1(mixed, slots) == [True] * 4 + [False] * 2
        for i, page in enumerate(rig.host_pages(slots)[:4]):
            assert_same(page, pages[i], f"page {i} of the partial load")
        rig.host.free(slots)
    finally:
        rig.close()


def test_second_process_finds_pages(server, client, tmp_path):
    """Pages one instance wrote back are prefetched and loaded by another process with a fresh
    host pool and device pool."""
    rig = Rig(server.target, model_name="shared")
    try:
        tokens = page_tokens(5, rig.page_size, SEED + 7)
        slots, pages = rig.fill_host(5, SEED + 7)
        _, done = rig.write_storage(slots, tokens)
        assert done == len(tokens)
    finally:
        rig.close()
    spec = {"target": server.target, "tokens": tokens, "out": str(tmp_path / "kv.pt")}
    p = subprocess.run([sys.executable, os.path.join(HERE, "second_instance.py"),
                        json.dumps(spec)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, "second instance failed:\n" + p.stdout[-3000:] + p.stderr[-6000:]
    out = torch.load(spec["out"])
    assert out["loaded"] == len(tokens)
    assert len(out["pages"]) == len(pages)
    for i, page in enumerate(pages):
        assert_same(out["pages"][i], page, f"page {i} in the second instance")


def test_page_starts_checks_every_page():
    """Each page of a v1 call's host_indices on its own: whole, aligned, inside the pool and
    contiguous from its first slot to its last; a short tail is no page."""
    from types import SimpleNamespace

    from kvbank.sglang import PageLayout
    host = SimpleNamespace(layout="layer_first", head_num=1, head_dim=4, layer_num=1, page_size=4,
                           size=64, dtype=torch.bfloat16,
                           kv_buffer=torch.zeros(2, 1, 64, 1, 4, dtype=torch.bfloat16))
    pages = PageLayout(host)
    idx = torch.tensor([8, 9, 10, 11,  # a page
                        0, 1, 2, 3,  # a page
                        5, 6, 7, 8,  # misaligned
                        12, 13, 14, 99,  # not contiguous to its last slot
                        60, 61, 62, 63,  # the pool's last page
                        64, 65, 66, 67,  # past the pool
                        -4, -3, -2, -1,  # negative
                        20, 21], dtype=torch.int64)  # short
    assert pages.page_starts(idx, 9) == [8, 0, -1, -1, 60, -1, -1, -1, -1]
    assert pages.page_starts(idx[:0], 2) == [-1, -1]


def test_bad_keys_and_slots(server, client):
    rig = Rig(server.target, model_name="bad-keys")
    try:
        st, host, ps = rig.storage, rig.host, rig.page_size
        slots = host.alloc(3 * ps)
        host.kv_buffer[:, :, slots] = torch.randn(host.kv_buffer[:, :, slots].shape).to(
            host.dtype)
        # Keys that are not keys fail alone; odd strings (lone surrogates, non-ASCII) are keys.
        odd = ["\udc80\udcff-page", "ключ-страницы", "x" * 300]
        assert st.batch_set_v1([None, odd[1], 7], slots) == [False, True, False]
        assert st.batch_set_v1(odd, slots) == [True, True, True]
        assert st.batch_exists(odd) == 3
        assert st.batch_exists([None] + odd) == 0
        assert st.batch_exists(odd[:1] + ["never-stored"] + odd[1:]) == 1
        dst = host.alloc(3 * ps)
        before = host.kv_buffer[:, :, dst].clone()
        assert st.batch_get_v1(["never-stored"] + odd, dst) == [False] * 4
        assert_same(host.kv_buffer[:, :, dst], before, "host slots after a miss")
        assert st.batch_get_v1(odd, dst) == [True] * 3
        assert_same(host.kv_buffer[:, :, dst], host.kv_buffer[:, :, slots], "odd keys' pages")
        # Slots that are not whole pages inside the pool: nothing read or written there.
        bad = torch.tensor([host.size - 1] + [0] * (ps - 1), dtype=torch.int64)
        assert st.batch_set_v1(["bad-slot"], bad) == [False]
        assert st.batch_exists(["bad-slot"]) == 0
        misaligned = torch.arange(1, 1 + ps, dtype=torch.int64)
        before = host.kv_buffer.clone()
        assert st.batch_get_v1(odd[:1], misaligned) == [False]
        assert_same(host.kv_buffer, before, "host pool after a bad slot")
        assert st.batch_get_v1(odd[:1], slots[:ps - 1]) == [False]  # short
        assert st.get(None) is None
        assert st.set("flat", torch.zeros(3)) is False  # not a page
    finally:
        rig.close()


def test_server_goes_away_mid_transfer(new_server):
    """kvbankd killed while pages move: every load that answers True holds the exact bytes,
    the others leave the host slots alone; the controller's threads stay up, prefetch and
    write-back answer misses, and a kvbankd back on the same port serves again."""
    s = new_server()
    rig = Rig(s.target, model_name="goes-away", page_size=16, layers=8, heads=4, head_dim=64,
              device_tokens=4096, host_ratio=3.0, kvbank_region_bytes=1 << 20)
    try:
        st, host, ps = rig.storage, rig.host, rig.page_size
        n = 48  # pages: 6 MiB a batch, in 1 MiB staging chunks
        keys = [f"away-{i}" for i in range(n)]
        src = host.alloc(n * ps)
        host.kv_buffer[:, :, src] = torch.randn(host.kv_buffer[:, :, src].shape).to(host.dtype)
        assert st.batch_set_v1(keys, src) == [True] * n
        want = host.kv_buffer[:, :, src].clone()
        dst = host.alloc(n * ps)
        sentinel = torch.full_like(want, 7.0)
        results, stop, killed_at = [], threading.Event(), []

        def loads():
            while not stop.is_set():
                host.kv_buffer[:, :, dst] = sentinel
                r = st.batch_get_v1(keys, dst)
                results.append((time.monotonic(), r, host.kv_buffer[:, :, dst].clone()))

        t = threading.Thread(target=loads)
        t.start()
        deadline = time.monotonic() + 60
        while not results:  # at least one load done with the server up
            assert time.monotonic() < deadline
            time.sleep(0.01)
        s.proc.kill()
        s.proc.wait()
        killed_at.append(time.monotonic())
        while not any(at > killed_at[0] for at, _, _ in results):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        stop.set()
        t.join(60)
        before_kill = sum(1 for at, r, _ in results if at < killed_at[0] and all(r))
        assert before_kill >= 1
        partial = sum(1 for _, r, _ in results if any(r) and not all(r))
        print(f"[sglang] {len(results)} loads of {n} pages: {before_kill} whole before the kill,"
              f" {partial} cut short")
        for _at, r, got in results:
            hit = r.index(False) if False in r else n
            assert r == [True] * hit + [False] * (n - hit), r
            for i in range(n):  # [2][layers][slots][heads][dim]: page i's slots
                part = slice(i * ps, (i + 1) * ps)
                expect = want[:, :, part] if i < hit else sentinel[:, :, part]
                assert_same(got[:, :, part], expect, f"page {i} ({'hit' if i < hit else 'miss'})")
        assert not any(results[-1][1]), "a load after the kill hit"
        # SGLang goes on: misses, no dead threads.
        tokens = page_tokens(2, ps, SEED + 3)
        host_slots, pages = rig.fill_host(2, SEED + 3)
        _, done = rig.write_storage(host_slots, tokens)
        assert done == 0
        assert rig.prefetch(tokens, rid="after-kill")[1] == 0
        for th in (rig.cc.backup_thread, rig.cc.prefetch_thread, rig.cc.prefetch_io_aux_thread):
            assert th.is_alive()
        # kvbankd back on the same port (empty): the backend reconnects and stores again.
        s2 = new_server(f"--listen=127.0.0.1:{s.port}")
        assert s2.port == s.port
        deadline = time.monotonic() + 30
        while True:
            _, done = rig.write_storage(host_slots, tokens)
            if done == len(tokens):
                break
            assert time.monotonic() < deadline, "no reconnection within 30 s"
            time.sleep(0.05)  # the backend tries again 0.2 s after its last try
        got_slots, got = rig.prefetch(tokens, rid="after-restart")
        assert got == len(tokens)
        for i, page in enumerate(rig.host_pages(got_slots)):
            assert_same(page, pages[i], f"page {i} after the restart")
    finally:
        rig.close()
