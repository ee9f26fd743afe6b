"""The Python SDK on kvbankd's same-host shared-memory plane: found through GetServerInfo, the
same bytes as the gRPC path for append, fetch_into and fetch_blocks_into (through staging
regions, and without a copy from a registered region), the same errors, and plane_stats saying
how each payload moved."""

import os
import tempfile

import numpy as np
import pytest

import kvbank

from kvbankd_process import Server


@pytest.fixture(scope="module")
def shm_server():
    d = tempfile.mkdtemp(prefix="kvbank-pyshm-")
    s = Server(["--pool-bytes=64MiB", "--shm-socket=" + os.path.join(d, "kvbankd.sock")])
    yield s
    s.stop()


def layout(name):
    return {"name": name, "num_layers": 4, "num_q_heads": 8, "num_kv_heads": 4, "head_dim": 64,
            "block_tokens": 16, "dtype": "fp16"}


def test_the_plane_is_found_and_moves_the_same_bytes(shm_server):
    n = 200  # 4 layers x 2 x 4 heads x 200 tokens x 64 x 2 bytes = 800 KiB
    payload = np.random.default_rng(7201).standard_normal((4, 2, 4, n, 64)).astype(np.float16)
    ids = list(range(1000, 1000 + n))
    with kvbank.Client(shm_server.target, shm_min_bytes=64 << 10) as c, \
            kvbank.Client(shm_server.target, shm=False) as g:
        assert c.data_plane == "shm" and g.data_plane == "grpc"
        c.ensure_model(layout("shm-py"))
        seq = c.create_sequence("shm-py", prompt=ids)
        c.append("shm-py", seq.id, payload, num_tokens=n, token_ids=ids)  # staged
        out = np.zeros(payload.size, np.float16)
        info = c.fetch_into("shm-py", seq.id, out)
        assert info.payload_bytes == payload.nbytes
        assert out.tobytes() == payload.tobytes()
        assert g.fetch("shm-py", seq.id).tobytes() == payload.tobytes()  # what gRPC reads

        # A registered region: the payload moves without a copy here, both ways.
        region = c.register_region(2 * payload.nbytes)
        src = region[:payload.nbytes].view(np.float16)
        src[:] = payload.reshape(-1)
        seq2 = c.create_sequence("shm-py")
        c.append("shm-py", seq2.id, src, num_tokens=n)
        dst = region[payload.nbytes:].view(np.float16)
        c.fetch_into("shm-py", seq2.id, dst)
        assert dst.tobytes() == payload.tobytes()

        # fetch_blocks_into: the prompt's 12 full blocks by hash.
        root = c.get_prefix_root("shm-py")
        hashes = kvbank.prefix_hashes(root.root, ids, 16, algorithm=root.algorithm)
        blocks = np.zeros(payload.size, np.float16)
        got = c.fetch_blocks_into("shm-py", hashes, blocks)
        assert got.num_tokens == 192
        want = g.fetch_blocks("shm-py", hashes).data
        assert blocks.view(np.uint8)[:got.payload_bytes].tobytes() == want.tobytes()

        st = c.plane_stats()
        print(f"[shm] plane_stats {st}")
        assert st["shm_staged"]["calls"] == 3  # append, fetch_into, fetch_blocks_into
        assert st["shm"]["calls"] == 2 and st["shm"]["bytes"] == 2 * payload.nbytes
        assert st["grpc"]["calls"] == 0

        # A buffer too small is OutOfRangeError on every plane, as on gRPC.
        with pytest.raises(kvbank.OutOfRangeError):
            c.fetch_into("shm-py", seq.id, np.zeros(payload.size // 2, np.float16))
        with pytest.raises(kvbank.OutOfRangeError):
            c.fetch_into("shm-py", seq2.id, region[:1024])
        c.unregister_region(region)


def test_an_engines_own_shared_file_is_a_region(shm_server):
    """register_region_fd: memory this process made (a memfd without seals, as an engine's host
    pool is) moves without a copy, landing in the process's own mapping of it; once truncated,
    transfers over it fail and the server goes on."""
    import mmap
    n = 64  # 4 layers x 2 x 4 heads x 64 tokens x 64 x 2 bytes = 256 KiB
    payload = np.random.default_rng(7202).standard_normal((4, 2, 4, n, 64)).astype(np.float16)
    size = 4 * payload.nbytes
    fd = os.memfd_create("engine-pool", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        mine = mmap.mmap(fd, size)
        # No page written: register_region_fd allocates them (kvbankd refuses holes).
        engine = np.frombuffer(mine, dtype=np.uint8)
        with kvbank.Client(shm_server.target, shm_min_bytes=64 << 10) as c:
            c.ensure_model(layout("shm-py-fd"))
            region = c.register_region_fd(fd)
            assert region.size == size
            region[:payload.nbytes].view(np.float16)[:] = payload.reshape(-1)
            assert engine[:payload.nbytes].tobytes() == payload.tobytes()  # the same pages
            seq = c.create_sequence("shm-py-fd")
            c.append("shm-py-fd", seq.id, region[:payload.nbytes].view(np.float16), num_tokens=n)
            c.fetch_into("shm-py-fd", seq.id, region[2 * payload.nbytes:3 * payload.nbytes])
            assert engine[2 * payload.nbytes:3 * payload.nbytes].tobytes() == payload.tobytes()
            st = c.plane_stats()
            assert st["shm"]["calls"] == 2 and st["shm_staged"]["calls"] == 0

            os.ftruncate(fd, payload.nbytes)  # the owner shrinks it
            with pytest.raises(kvbank.FailedPreconditionError, match="truncated by its owner"):
                c.fetch_into("shm-py-fd", seq.id, region[2 * payload.nbytes:3 * payload.nbytes])
            with pytest.raises(kvbank.FailedPreconditionError, match="truncated by its owner"):
                c.append("shm-py-fd", seq.id, region[:payload.nbytes].view(np.float16),
                         num_tokens=n)
            assert c.get_sequence("shm-py-fd", seq.id).length == n
            c.unregister_region(region)
            with pytest.raises(kvbank.InvalidArgumentError):
                r, w = os.pipe()
                try:
                    c.register_region_fd(r)
                finally:
                    os.close(r)
                    os.close(w)
        del engine
        mine.close()
    finally:
        os.close(fd)


def test_scattered_runs_in_one_call(shm_server):
    """fetch_blocks_into_runs / append_runs: a payload cut in runs lands at (is gathered from)
    offsets of a registered region, in one call, the same bytes as the contiguous payload."""
    n = 64  # 4 blocks; 4 layers x 2 x 4 heads x 64 tokens x 64 x 2 bytes = 256 KiB
    payload = np.random.default_rng(7203).standard_normal((4, 2, 4, n, 64)).astype(np.float16)
    ids = list(range(3000, 3000 + n))
    with kvbank.Client(shm_server.target) as c:
        c.ensure_model(layout("shm-py-runs"))
        seq = c.create_sequence("shm-py-runs", prompt=ids)
        c.append("shm-py-runs", seq.id, payload, num_tokens=n, token_ids=ids)
        root = c.get_prefix_root("shm-py-runs")
        hashes = kvbank.prefix_hashes(root.root, ids, 16, algorithm=root.algorithm)
        want = payload.tobytes()
        region = c.register_region(2 * len(want) + 4096)
        run = 4096
        runs = len(want) // run
        offsets = [(runs - 1 - r) * 2 * run for r in range(runs)]  # last to first, gaps between
        view = region[4096:]  # offsets count from the view
        view[:] = 0xEE
        info = c.fetch_blocks_into_runs("shm-py-runs", hashes, view, offsets, run)
        assert info.payload_bytes == len(want) and info.num_tokens == n
        got = b"".join(view[o:o + run].tobytes() for o in offsets)
        assert got == want
        assert view[run:2 * run].tobytes() == b"\xee" * run  # a gap
        seq2 = c.create_sequence("shm-py-runs")
        c.append_runs("shm-py-runs", seq2.id, view, offsets, run, num_tokens=n)
        assert c.fetch("shm-py-runs", seq2.id).tobytes() == want
        with pytest.raises(kvbank.InvalidArgumentError, match="overlap"):
            c.fetch_blocks_into_runs("shm-py-runs", hashes, view, [0, run // 2], run)
        with pytest.raises(kvbank.InvalidArgumentError, match="register_region"):
            c.fetch_blocks_into_runs("shm-py-runs", hashes, np.zeros(4096, np.uint8), [0], run)
        c.unregister_region(region)


def test_put_pages_runs_stores_each_page_under_its_key(shm_server):
    """put_pages_runs: many one-block pages under their own keys in one call, each gathered from
    runs of a region; a page held already is OK again; a bad page fails alone."""
    page = 4 * 2 * 4 * 16 * 64 * 2  # one block: 64 KiB
    run = page // 4
    with kvbank.Client(shm_server.target) as c:
        c.ensure_model(layout("shm-py-pages"))
        region = c.register_region(16 * page)
        region[:] = np.random.default_rng(7204).integers(0, 256, region.size, dtype=np.uint8)
        # page p's runs: run r at (4 * p + r) * run, last to first within the page
        def runs(p):
            return [(4 * p + 3 - r) * run for r in range(4)]

        def key(p):
            return [("custom", f"page-{p}")]

        pages = [(key(p), runs(p)) for p in range(5)]
        assert c.put_pages_runs("shm-py-pages", region, pages, run, num_tokens=16,
                                parallel=3) == [None] * 5
        for p in range(5):
            seq = c.create_sequence("shm-py-pages", prompt=[0] * 16, extra_keys=key(p))
            assert seq.cached_tokens == 16
            want = b"".join(region[o:o + run].tobytes() for o in runs(p))
            assert c.fetch("shm-py-pages", seq.id).tobytes() == want
            c.free("shm-py-pages", seq.id)
        again = c.put_pages_runs("shm-py-pages", region, pages, run, num_tokens=16)
        assert again == [None] * 5
        errs = c.put_pages_runs("shm-py-pages", region,
                                [(key(5), runs(5)), (key(6), runs(64)), (key(7), runs(7))],
                                run, num_tokens=16)
        assert errs[0] is None and errs[2] is None
        assert isinstance(errs[1], kvbank.InvalidArgumentError), errs[1]
        assert "runs past the region" in str(errs[1])
        assert c.match("shm-py-pages", [[0] * 16], extra_keys=key(6)) == [0]
        assert c.match("shm-py-pages", [[0] * 16], extra_keys=key(7)) == [16]
        c.unregister_region(region)


def test_small_payloads_and_a_plane_off_use_grpc(shm_server, server):
    small = np.zeros(4 * 2 * 4 * 2 * 64, np.float16)
    with kvbank.Client(shm_server.target) as c:
        c.ensure_model(layout("shm-py-small"))
        seq = c.create_sequence("shm-py-small")
        c.append("shm-py-small", seq.id, small, num_tokens=2)  # 8 KiB < shm_min_bytes
        assert c.plane_stats()["grpc"]["calls"] == 1
    off = Server(["--pool-bytes=16MiB", "--shm-socket="])  # the plane turned off
    try:
        with kvbank.Client(off.target) as c:
            assert c.data_plane == "grpc"
            with pytest.raises(kvbank.FailedPreconditionError, match="shared-memory"):
                c.register_region(4096)
    finally:
        off.stop()


def test_the_plane_is_on_by_default_and_asked_over_its_socket(server):
    """A kvbankd started with no --shm-socket serves the plane on a socket of its own (in this
    user's runtime folder); a client on this host takes it with no setting, and its region
    transfers are asked for with control frames on that socket, not gRPC calls."""
    with kvbank.Client(server.target) as c:
        info = c.server_info()
        assert info["shm_socket"], "the default kvbankd serves no shm socket"
        folder = os.path.dirname(info["shm_socket"])
        assert os.stat(folder).st_mode & 0o777 == 0o700
        assert os.stat(info["shm_socket"]).st_mode & 0o777 == 0o600
        assert c.data_plane == "shm"
        c.ensure_model(layout("shm-default"))
        seq = c.create_sequence("shm-default")
        # 256 tokens of 4 KiB: 1 MiB, shm_min_bytes, so through a staging region.
        payload = (np.arange(2048 * 256) % 1000).astype(np.float16)
        c.append("shm-default", seq.id, payload, num_tokens=256)
        back = np.zeros_like(payload)
        got = c.fetch_into("shm-default", seq.id, back)
        assert got.payload_bytes == payload.nbytes and np.array_equal(back, payload)
        st = c.plane_stats()
        assert st["shm_staged"]["calls"] == 2 and st["grpc"]["calls"] == 0
        assert st["shm_control"]["calls"] == 2, st


def test_cuda_ipc_calls_reach_the_server_without_a_gpu(server):
    """The CUDA IPC plane's SDK calls on a server with a host pool (CI has no GPU): the server's
    refusal comes back typed; a tensor that is not on a GPU is refused in the client."""
    with kvbank.Client(server.target) as c:
        with pytest.raises(kvbank.FailedPreconditionError, match="CUDA IPC plane"):
            c._c.register_device_region(b"\x01" * 64, 0, 4096)
        region = kvbank.DeviceRegion(region_id=7, size=1 << 20, device=0)
        c.ensure_model(layout("ipc-py"))
        seq = c.create_sequence("ipc-py")
        with pytest.raises(kvbank.FailedPreconditionError, match="CUDA IPC plane"):
            c.append_from_device("ipc-py", seq.id, region, num_tokens=2, dtype="fp16")
        with pytest.raises(kvbank.FailedPreconditionError, match="CUDA IPC plane"):
            c.fetch_to_device("ipc-py", seq.id, region)
        with pytest.raises(kvbank.InvalidArgumentError, match="CUDA tensor"):
            kvbank.cuda_ipc_handle(np.zeros(4))


def test_nccl_calls_reach_the_sdk_without_a_gpu(server):
    """The NCCL plane's calls on a server with a host pool (CI has no GPU): with no communicator
    nothing is sent (the address is never read); connecting is refused by the SDK (built without
    NCCL, or no device) or by the server (no cuda:N pool); a host array is refused in the client;
    the sequence is as before."""
    refused = (kvbank.FailedPreconditionError, kvbank.UnimplementedError)
    with kvbank.Client(server.target) as c:
        c.ensure_model(layout("nccl-py"))
        seq = c.create_sequence("nccl-py")
        with pytest.raises(refused):
            c._c.append_over_nccl("nccl-py", seq.id, 0x1000, 4096, 2)
        with pytest.raises(refused):
            c._c.fetch_over_nccl("nccl-py", seq.id, 0x1000, 4096)
        with pytest.raises(refused):
            c.nccl_connect(0)
        c.nccl_disconnect()  # a no-op without a communicator
        with pytest.raises(kvbank.InvalidArgumentError, match="CUDA tensor"):
            c.append_over_nccl("nccl-py", seq.id, np.zeros(4), num_tokens=2)
        with pytest.raises(kvbank.InvalidArgumentError, match="CUDA tensor"):
            c.fetch_over_nccl("nccl-py", seq.id, np.zeros(4))
        assert c.get_sequence("nccl-py", seq.id).length == 0
