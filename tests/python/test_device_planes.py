"""Payloads in CUDA tensors: the plane the Python SDK picks for them (choose_device_plane's
order: CUDA IPC on the server's host with a GPU pool, then NCCL, then host memory), what
GetServerInfo tells it, and (where torch sees a GPU) the round trip through the chosen plane."""

import pytest

import kvbank
from kvbank._device import plane_refused

from kvbankd_process import Server

GPU_SERVER = {"cuda_ipc_device": 0, "on_this_host": True, "nccl": True}


@pytest.fixture(scope="module")
def server():
    s = Server(["--pool-bytes=64MiB"])
    yield s
    s.stop()


def test_cuda_ipc_first_on_the_servers_host():
    assert kvbank.choose_device_plane(GPU_SERVER, 0) == "cuda_ipc"
    # Any of this host's devices: kvbankd opens the handle on its own device (peer access).
    assert kvbank.choose_device_plane(GPU_SERVER, 3) == "cuda_ipc"


def test_nccl_when_cuda_ipc_cannot_reach():
    remote = dict(GPU_SERVER, on_this_host=False)
    assert kvbank.choose_device_plane(remote, 1) == "nccl"
    # A communicator already formed on another device: this payload goes through host memory.
    assert kvbank.choose_device_plane(remote, 1, nccl_device=0) == "cuda_staged"
    assert kvbank.choose_device_plane(remote, 0, nccl_device=0) == "nccl"
    # CUDA IPC turned down for this client (e.g. an allocation it cannot share): NCCL next.
    assert kvbank.choose_device_plane(GPU_SERVER, 0, ipc_ok=False) == "nccl"


def test_host_memory_when_no_gpu_plane_is_served():
    host_pool = {"cuda_ipc_device": None, "on_this_host": True, "nccl": False}
    assert kvbank.choose_device_plane(host_pool, 0) == "cuda_staged"
    remote_no_nccl = dict(GPU_SERVER, on_this_host=False, nccl=False)
    assert kvbank.choose_device_plane(remote_no_nccl, 0) == "cuda_staged"
    assert kvbank.choose_device_plane(GPU_SERVER, 0, ipc_ok=False, nccl_ok=False) == \
        "cuda_staged"


def test_the_mode_narrows_the_choice():
    assert kvbank.choose_device_plane(GPU_SERVER, 0, mode="host") == "cuda_staged"
    assert kvbank.choose_device_plane(GPU_SERVER, 0, mode="nccl") == "nccl"
    remote = dict(GPU_SERVER, on_this_host=False)
    assert kvbank.choose_device_plane(remote, 0, mode="cuda_ipc") == "cuda_staged"
    with pytest.raises(kvbank.InvalidArgumentError, match="device_plane must be one of"):
        kvbank.choose_device_plane(GPU_SERVER, 0, mode="rdma")


def test_only_plane_refusals_turn_a_plane_off():
    assert plane_refused(kvbank.FailedPreconditionError(
        "kvbankd serves no CUDA IPC plane: its pools are not in GPU memory (--device cuda:N)"))
    assert plane_refused(kvbank.FailedPreconditionError(
        "the NCCL communicator was aborted (...): call NcclConnect again"))
    assert plane_refused(kvbank.UnimplementedError("this kvbank SDK was built without NCCL"))
    # A call's own precondition (a freed sequence) is the caller's error, not the plane's.
    assert not plane_refused(kvbank.FailedPreconditionError("sequence 7 was freed"))
    assert not plane_refused(kvbank.NotFoundError("CUDA IPC region 3"))


def test_server_info_names_the_planes_and_the_host(server):
    with kvbank.Client(server.target) as c:
        info = c.server_info()
        assert info["version"]
        assert info["cuda_ipc_device"] is None  # a host-memory pool serves no CUDA IPC
        assert info["nccl"] is False and "NCCL" in info["nccl_off"]
        with open("/proc/sys/kernel/random/boot_id") as f:
            assert info["host_id"] == f.read().strip()
        assert info["on_this_host"] is True
        assert c.device_plane_for(0) == "cuda_staged"
        stats = c.plane_stats()
        for plane in kvbank.DEVICE_PLANES:
            assert stats[plane] == {"calls": 0, "bytes": 0}
    with kvbank.Client(server.target, device_plane="nccl") as c:
        assert c.device_plane_for(0) == "cuda_staged"
    with pytest.raises(kvbank.InvalidArgumentError, match="device_plane"):
        kvbank.Client(server.target, device_plane="gpu")


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch")
    return torch


def test_cuda_tensors_round_trip_through_the_chosen_plane(server):
    torch = _torch_cuda()
    layout = {"name": "dev-py", "num_layers": 2, "num_q_heads": 4, "num_kv_heads": 2,
              "head_dim": 64, "block_tokens": 16, "dtype": "fp16"}
    n = 48
    with kvbank.Client(server.target) as c:
        model = c.ensure_model(layout)
        nbytes = model.payload_bytes(n)
        payload = torch.randn(nbytes // 2, dtype=torch.float16, device="cuda")
        seq = c.create_sequence("dev-py")
        c.append("dev-py", seq.id, payload, num_tokens=n)
        out = torch.zeros_like(payload)
        info = c.fetch_into("dev-py", seq.id, out)
        assert info.payload_bytes == nbytes
        assert torch.equal(out, payload)
        plane = c.device_plane_for(payload.device.index or 0)
        stats = c.plane_stats()
        assert stats[plane]["calls"] == 2 and stats[plane]["bytes"] == 2 * nbytes
