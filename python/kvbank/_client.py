"""kvbank.Client: the Python face of the C++ SDK (kvbank::Client)."""

import concurrent.futures
import ctypes
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable, Literal, Optional, TypeVar, Union, overload

import numpy as np

from . import _kvbank
from ._device import DeviceRouter, _cuda_driver, is_cuda
from ._errors import (
    DeadlineExceededError,
    Error,
    FailedPreconditionError,
    InvalidArgumentError,
    from_status,
)
from ._types import (
    Blocks,
    DeviceRegion,
    Event,
    FetchInfo,
    Layout,
    ModelInfo,
    PrefixRoot,
    SequenceInfo,
)

_T = TypeVar("_T")

ExtraKeys = Sequence[tuple[str, Union[str, bytes]]]
"""Extra keys of a prefix hash: (kind, value) pairs, kind one of "lora", "multimodal",
"prompt_embeds", "custom"."""

# numpy element type of each wire dtype. numpy has no bfloat16: bf16 comes as its raw 16 bits
# (uint16; torch: tensor.view(torch.bfloat16)), int8 and fp8 storage formats as bytes.
_NP_DTYPES = {
    "fp32": np.float32,
    "fp16": np.float16,
    "bf16": np.uint16,
    "int8": np.uint8,
    "fp8_e4m3": np.uint8,
    "fp8_e5m2": np.uint8,
}


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype that holds elements of a kvbank dtype (bf16: uint16 bits)."""
    try:
        return np.dtype(_NP_DTYPES[dtype])
    except KeyError:
        raise InvalidArgumentError(f"unknown dtype '{dtype}'") from None


def _extra_keys(keys: ExtraKeys) -> list[tuple[str, bytes]]:
    out = []
    for kind, value in keys:
        out.append((kind, value.encode() if isinstance(value, str) else bytes(value)))
    return out


def _buffer(obj: Any, writable: bool) -> Any:
    """An object exposing `obj`'s memory through the buffer protocol, without a copy.

    Buffer-protocol objects (numpy arrays, bytes, bytearray, memoryview) pass as they are; the
    extension asks for a C-contiguous (and, for writing, writable) view and raises BufferError
    otherwise. Objects with data_ptr() (a CPU torch tensor: it has no buffer protocol) are viewed
    through their address and byte count; the caller keeps `obj` alive for the call."""
    try:
        memoryview(obj).release()
        return obj
    except TypeError:
        pass
    if not hasattr(obj, "data_ptr"):
        raise TypeError(f"{type(obj).__name__} is neither a buffer (numpy array, bytes, "
                        "memoryview) nor a tensor with data_ptr()")
    device = getattr(obj, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        raise InvalidArgumentError(f"a {device} tensor: kvbank reads and writes host memory (move "
                                   "it to the CPU, ideally pinned)")
    if hasattr(obj, "is_contiguous") and not obj.is_contiguous():
        raise InvalidArgumentError("the tensor is not contiguous")
    nbytes = getattr(obj, "nbytes", None)
    if nbytes is None:
        nbytes = obj.numel() * obj.element_size()
    nbytes = int(nbytes)
    if nbytes == 0:
        return bytearray() if writable else b""
    view = memoryview((ctypes.c_ubyte * nbytes).from_address(int(obj.data_ptr())))
    return view if writable else view.toreadonly()


def _num_tokens_of(k: Any) -> int:
    shape = getattr(k, "shape", None)
    if shape is None or len(shape) != 4:
        raise InvalidArgumentError("num_tokens is needed unless k is 4-D "
                                   "[layers][kv_heads][tokens][head_dim]")
    return int(shape[2])


def cuda_ipc_handle(tensor: Any) -> tuple[bytes, int, int]:
    """The CUDA IPC handle of a contiguous CUDA torch tensor's allocation, the tensor's byte
    offset in it and its size in bytes (what RegisterDeviceRegion takes), from the CUDA driver
    (cuMemGetAddressRange, cuIpcGetMemHandle). Unlike torch's own sharing, this leaves the
    caching allocator's bookkeeping alone: the block is freed as usual once the tensor goes."""
    if not is_cuda(tensor):
        raise InvalidArgumentError("a CUDA tensor is needed for CUDA IPC")
    if not tensor.is_contiguous():
        raise InvalidArgumentError("the tensor is not contiguous")
    ptr = int(tensor.data_ptr())
    try:
        base, _, handle = _cuda_driver().allocation(ptr)
    except OSError as e:
        raise FailedPreconditionError("CUDA IPC: the CUDA driver (libcuda.so.1) cannot be "
                                      f"loaded: {e}") from None
    return handle, ptr - base, tensor.numel() * tensor.element_size()


def _cuda_span(tensor: Any) -> tuple[int, int]:
    """(device address, size in bytes) of a contiguous CUDA torch tensor."""
    if getattr(getattr(tensor, "device", None), "type", None) != "cuda":
        raise InvalidArgumentError("a CUDA tensor is needed for the NCCL plane")
    if not tensor.is_contiguous():
        raise InvalidArgumentError("the tensor is not contiguous")
    return int(tensor.data_ptr()), tensor.numel() * tensor.element_size()


# The most runs one scattered transfer may name (fetch_blocks_into_runs, append_runs).
MAX_REGION_RUNS = 1 << 18


def _offsets(run_offsets: Any) -> np.ndarray:
    """Run offsets as the binding takes them (a negative one raises OverflowError)."""
    if isinstance(run_offsets, np.ndarray) and run_offsets.dtype == np.uint64:
        return np.ascontiguousarray(run_offsets)
    return np.array([int(o) for o in run_offsets], dtype=np.uint64)


def _region_of(array: np.ndarray) -> tuple[Any, int]:
    """The registered region under an array from register_region / register_region_fd (or a
    view of one), and the array's byte offset in it."""
    base: object = array
    while isinstance(base, (np.ndarray, memoryview)):
        base = base.base if isinstance(base, np.ndarray) else base.obj
    if not isinstance(base, _kvbank.Region):
        raise InvalidArgumentError("not an array from register_region or register_region_fd")
    # __array_interface__, not .ctypes: that one runs Python code of numpy's on every call.
    start = np.frombuffer(base, dtype=np.uint8).__array_interface__["data"][0]
    return base, np.asarray(array).__array_interface__["data"][0] - start


class Client:
    """A connection to kvbankd. Thread-safe: share one per process.

    Every call blocks until the server answers (or the deadline passes) with the GIL released;
    a failure raises kvbank.Error's subclass for the gRPC code, with the server's message.

        client = kvbank.Client("127.0.0.1:50051")
        client.ensure_model(preset="llama-3.1-8b", name="llama")
        seq = client.create_sequence("llama", prompt=token_ids)
    """

    def __init__(self, target: str, token: Optional[str] = None, *, deadline_s: float = 30.0,
                 stream_deadline_s: float = 600.0, chunk_bytes: int = 1 << 20,
                 tls: Optional[Mapping[str, str]] = None, max_workers: int = 4,
                 shm: Union[bool, str] = True, shm_min_bytes: int = 1 << 20,
                 shm_staging_bytes: int = 1 << 30, device_plane: str = "auto"):
        """target: "host:port", "dns:///name:port" or "unix:/path". token: bearer token.
        deadline_s: unary calls; stream_deadline_s: appends, fetches. chunk_bytes: payload bytes
        per append message. tls: root_ca_path / root_ca_pem, cert_chain_*, private_key_*,
        server_name_override (unset: plaintext). max_workers: threads of the *_async calls
        and of kvbank.aio.AsyncClient's.

        shm: the same-host shared-memory plane (kvbankd serves it by default). True: used when
        the server names a --shm-socket that exists on this host (GetServerInfo); False: gRPC
        only; a path: that socket. Payloads in a region from register_region move without a copy
        on this side; others of at least shm_min_bytes go through staging regions (one memcpy
        here; shm_staging_bytes in all); either is asked for with a control frame on the socket,
        not a gRPC call, when the server takes them. append, fetch_into and fetch_blocks_into use
        it; data_plane and plane_stats() say how the bytes moved.

        device_plane: how payloads in CUDA tensors move. "auto": CUDA IPC when the server runs
        on this host with its pools on a GPU, else NCCL when the server can form communicators
        (one is formed on the tensor's device at the first such payload), else through host
        memory (a copy here, then the planes above); "cuda_ipc" / "nccl": that plane or host
        memory; "host": always through host memory. device_plane_for(device) says which a
        tensor would take now; plane_stats() counts cuda_ipc, nccl and cuda_staged."""
        shm_arg = "auto" if shm is True else ("" if shm is False else str(shm))
        self._c = _kvbank.Client(target, token or "", deadline_s, stream_deadline_s, chunk_bytes,
                                 dict(tls) if tls is not None else None, shm_arg, shm_min_bytes,
                                 shm_staging_bytes)
        self._device = DeviceRouter(self._c, device_plane)
        self.target = target
        self._max_workers = max_workers
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._pool_lock = threading.Lock()

    # ---- data planes ----------------------------------------------------------------------

    @property
    def data_plane(self) -> str:
        """"shm" when payloads can move through shared memory with the server, else "grpc"."""
        return self._c.data_plane

    def plane_stats(self) -> dict[str, dict[str, int]]:
        """Calls and payload bytes per plane so far: "shm" (in a registered region, no copy
        here), "shm_staged" (through a staging region; its "dropped" counts staging regions let
        go after a failed call, never reused), "grpc", "shm_control" (of the shm and shm_staged
        calls, those asked for with a control frame on the socket: calls only), and for payloads
        in CUDA tensors "cuda_ipc", "nccl" and "cuda_staged" (copied through host memory: their
        bytes also count on the host plane that took them)."""
        stats = dict(self._c.plane_stats())
        stats.update(self._device.stats())
        return stats

    def server_info(self) -> dict[str, Any]:
        """What the server serves: version, replica, shm_socket, cuda_ipc_device (None: no CUDA
        IPC plane), nccl and nccl_off (why not), host_id (its boot id) and on_this_host."""
        return dict(self._c.server_info())

    def device_plane_for(self, device: int = 0) -> str:
        """The plane a payload in a CUDA tensor on `device` takes now: "cuda_ipc", "nccl" or
        "cuda_staged" (see device_plane in the constructor). Asks the server once."""
        return self._device.plane_for(device)

    def register_region(self, nbytes: int) -> np.ndarray:
        """A shared-memory region of nbytes registered with the server, as a writable uint8
        numpy array: payloads that lie in it (views, tensors made over it with
        torch.frombuffer) move without a copy on this side. It stays registered while the array
        (or a view of it) lives, or until unregister_region. FailedPreconditionError when the
        shared-memory plane is off."""
        region = self._c.register_region(nbytes)
        return np.frombuffer(region, dtype=np.uint8)

    def register_region_fd(self, fd: int) -> np.ndarray:
        """Memory this process already has in a shared file (a memfd or a /dev/shm file: an
        engine's host pool, say) registered as a region: the whole file, mapped again and
        returned as a writable uint8 array over the same bytes. Pages of the file never touched
        are allocated here, on this process's memory, with no byte changed. Payloads in that
        array (views, tensors over it) move without a copy on this side; an offset into the
        file is the same offset into the array. The file need not be sealed: if its owner
        truncates it, transfers over it fail (FailedPreconditionError) and kvbankd goes on.
        The caller keeps and closes its own descriptor. InvalidArgumentError when kvbankd
        refuses the file (not on tmpfs, too large)."""
        region = self._c.register_region_fd(int(fd))
        return np.frombuffer(region, dtype=np.uint8)

    def unregister_region(self, array: np.ndarray) -> None:
        """Stops routing buffers in this region (from register_region) through it; the region
        goes with the last array viewing it."""
        self._c.unregister_region(_region_of(array)[0])

    def fetch_blocks_into_runs(self, model: str, hashes: Sequence[bytes], region: np.ndarray,
                               run_offsets: Union[Sequence[int], np.ndarray], run_bytes: int, *,
                               layer_begin: int = 0, layer_end: Optional[int] = None,
                               dtype: Optional[str] = None, kv_head_begin: int = 0,
                               kv_head_end: Optional[int] = None) -> FetchInfo:
        """fetch_blocks written into pieces of a registered region, in one call: the payload
        (per layer K [kv_heads][n][head_dim] then V) cut in runs of run_bytes, run r written at
        byte run_offsets[r] of `region` (an array from register_region / register_region_fd, or
        a view of one: offsets count from the view's first byte). Runs may not overlap; at most
        MAX_REGION_RUNS. So
        pages land where an engine's host pool keeps them, without a copy on this side.
        info.payload_bytes says how many leading runs' bytes the cached run filled."""
        reg, base = _region_of(region)
        return self._c.fetch_blocks_to_region_runs(
            model, [bytes(h) for h in hashes], reg, base, int(run_bytes),
            _offsets(run_offsets), layer_begin, layer_end, dtype, kv_head_begin, kv_head_end)

    def append_runs(self, model: str, seq_id: int, region: np.ndarray,
                    run_offsets: Union[Sequence[int], np.ndarray], run_bytes: int, *,
                    num_tokens: int,
                    layer_begin: int = 0, layer_end: Optional[int] = None,
                    dtype: Optional[str] = None, token_ids: Optional[Sequence[int]] = None,
                    kv_head_begin: int = 0, kv_head_end: Optional[int] = None) -> SequenceInfo:
        """append whose payload is gathered from pieces of a registered region (as
        fetch_blocks_into_runs): run r, run_bytes long, at byte run_offsets[r] of `region`;
        run_bytes x the runs must be the payload's size."""
        reg, base = _region_of(region)
        return self._c.append_from_region_runs(
            model, seq_id, reg, base, int(run_bytes), _offsets(run_offsets),
            num_tokens, layer_begin, layer_end, dtype, list(token_ids or ()), kv_head_begin,
            kv_head_end)

    def put_pages_runs(self, model: str, region: np.ndarray,
                       pages: Sequence[tuple[ExtraKeys, Union[Sequence[int], np.ndarray]]],
                       run_bytes: int, *, num_tokens: int, lease_s: Optional[float] = None,
                       parallel: int = 2) -> list[Optional[Error]]:
        """Pages stored under their own keys, many in one call, as an engine's page store keeps
        them (SGLang HiCache pages, LMCache chunks): pages[i] = (extra_keys, run_offsets). Page
        i becomes one block of num_tokens placeholder tokens named by its extra keys, its
        payload gathered from runs of `region` (as append_runs) unless kvbankd already holds
        it. `parallel` pages at once, on the SDK's threads (the interpreter lock is released
        for the whole batch). One entry a page: None when kvbankd holds it afterwards, else
        the error of that page alone."""
        reg, base = _region_of(region)
        out = self._c.put_pages_from_region_runs(
            model, reg, base, int(run_bytes),
            [(_extra_keys(keys), _offsets(runs)) for keys, runs in pages], int(num_tokens), lease_s,
            int(parallel))
        return [None if code == 0 else from_status(code, message) for code, message in out]

    # ---- CUDA IPC (same host, a kvbankd with a cuda:N pool) --------------------------------

    def register_device_region(self, tensor: Any) -> "DeviceRegion":
        """Registers a CUDA tensor's memory (contiguous) with kvbankd, which opens it through
        CUDA IPC: append_from_device / fetch_to_device then move payloads device to device,
        converting on the device. FailedPreconditionError when the server has no cuda:N pool."""
        handle, offset, size = cuda_ipc_handle(tensor)
        return self._c.register_device_region(handle, offset, size)

    def unregister_device_region(self, region: "DeviceRegion") -> None:
        self._c.unregister_device_region(region.region_id)

    def append_from_device(self, model: str, seq_id: int, region: "DeviceRegion", *,
                           num_tokens: int, offset: int = 0, length: Optional[int] = None,
                           layer_begin: int = 0, layer_end: Optional[int] = None,
                           dtype: Optional[str] = None,
                           token_ids: Optional[Sequence[int]] = None, kv_head_begin: int = 0,
                           kv_head_end: Optional[int] = None) -> SequenceInfo:
        """append whose payload is bytes [offset, offset + length) of a device region."""
        n = region.size - offset if length is None else length
        return self._c.append_from_device(
            model, seq_id, region.region_id, offset, n, num_tokens, layer_begin, layer_end,
            dtype, list(token_ids or []), kv_head_begin, kv_head_end)

    def fetch_to_device(self, model: str, seq_id: int, region: "DeviceRegion", *,
                        offset: int = 0, length: Optional[int] = None, token_begin: int = 0,
                        token_end: Optional[int] = None, layer_begin: int = 0,
                        layer_end: Optional[int] = None, dtype: Optional[str] = None,
                        kv_head_begin: int = 0, kv_head_end: Optional[int] = None,
                        wait_s: float = 0.0) -> FetchInfo:
        """fetch_into bytes [offset, offset + length) of a device region."""
        n = region.size - offset if length is None else length
        return self._c.fetch_to_device(
            model, seq_id, region.region_id, offset, n, token_begin, token_end, layer_begin,
            layer_end, dtype, kv_head_begin, kv_head_end, wait_s)

    def nccl_connect(self, device: int = 0) -> None:
        """Forms an NCCL communicator with kvbankd (this process rank 0 on CUDA device `device`,
        the server rank 1; the unique id crosses gRPC): append_over_nccl / fetch_over_nccl then
        move payloads GPU to GPU with ncclSend / ncclRecv. FailedPreconditionError when the
        server has no cuda:N pool or no NCCL; UnimplementedError when this SDK was built
        without CUDA and NCCL. Connecting again replaces the communicator."""
        self._c.nccl_connect(device)

    def nccl_disconnect(self) -> None:
        """Drops the communicator (the server's too); a no-op without one."""
        self._c.nccl_disconnect()

    def append_over_nccl(self, model: str, seq_id: int, tensor: Any, *, num_tokens: int,
                         layer_begin: int = 0, layer_end: Optional[int] = None,
                         dtype: Optional[str] = None, token_ids: Optional[Sequence[int]] = None,
                         kv_head_begin: int = 0,
                         kv_head_end: Optional[int] = None) -> SequenceInfo:
        """append whose payload (a contiguous CUDA tensor on the communicator's device, the
        payload's exact size; fp32 / fp16 / bf16) crosses NCCL. Atomic as append."""
        ptr, nbytes = _cuda_span(tensor)
        return self._c.append_over_nccl(
            model, seq_id, ptr, nbytes, num_tokens, layer_begin, layer_end, dtype,
            list(token_ids or []), kv_head_begin, kv_head_end)

    def fetch_over_nccl(self, model: str, seq_id: int, out: Any, *, token_begin: int = 0,
                        token_end: Optional[int] = None, layer_begin: int = 0,
                        layer_end: Optional[int] = None, dtype: Optional[str] = None,
                        kv_head_begin: int = 0, kv_head_end: Optional[int] = None) -> FetchInfo:
        """fetch_into a contiguous CUDA tensor over NCCL; payload_bytes says how much arrived
        (InvalidArgumentError, nothing sent, when it does not fit)."""
        ptr, capacity = _cuda_span(out)
        return self._c.fetch_over_nccl(
            model, seq_id, ptr, capacity, token_begin, token_end, layer_begin, layer_end,
            dtype, kv_head_begin, kv_head_end)

    # ---- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for the *_async calls in flight and stops their threads."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def check_serving(self, deadline_s: float = 10.0) -> None:
        """Returns once the server reports SERVING; raises UnavailableError (with gRPC's reason)
        or DeadlineExceededError otherwise."""
        self._c.check_serving(deadline_s)

    # ---- models ---------------------------------------------------------------------------

    def ensure_model(self, layout: Optional[Layout] = None, *, preset: Optional[str] = None,
                     name: Optional[str] = None, storage: Optional[str] = None,
                     pool_bytes: int = 0, block_tokens: int = 0) -> ModelInfo:
        """Registers a model (idempotent): from a layout dict, or from a built-in preset
        (llama-3.1-8b, ...) under `name`, its layers stored in `storage` (default bf16)."""
        if (layout is None) == (preset is None):
            raise InvalidArgumentError("give either a layout or a preset")
        if layout is None:
            if not name:
                raise InvalidArgumentError("a preset model needs a name")
            return self._c.ensure_preset(name, preset, storage, pool_bytes, block_tokens)
        d = dict(layout)
        if name is not None:
            d["name"] = name
        if storage is not None or block_tokens:
            raise InvalidArgumentError("storage and block_tokens go into the layout dict")
        return self._c.ensure_model(d, pool_bytes)

    def list_models(self) -> list[ModelInfo]:
        return list(self._c.list_models())

    def get_model(self, name: str) -> ModelInfo:
        return self._c.get_model(name)

    def drop_model(self, name: str) -> None:
        self._c.drop_model(name)

    def stats(self, model: str = "") -> list[dict[str, Any]]:
        """Per-model statistics (every model when `model` is empty), as dicts."""
        return self._c.stats(model)

    # ---- sequences ------------------------------------------------------------------------

    def create_sequence(self, model: str, prompt: Sequence[int] = (), *,
                        lease_s: Optional[float] = None, cache_salt: str = "",
                        extra_keys: ExtraKeys = (), priority: Optional[int] = None,
                        retention: str = "full", window: int = 0, sinks: int = 0,
                        budget: int = 0) -> SequenceInfo:
        """A new sequence; with a prompt, its cached full blocks are attached (cached_tokens).
        lease_s: None = the server's default, 0 = no lease. retention: "full",
        "sliding_window" (window, sinks) or "heavy_hitter" (budget, window)."""
        kinds = {"full": 0, "sliding_window": 1, "heavy_hitter": 2}
        if retention not in kinds:
            raise InvalidArgumentError(f"retention must be one of {', '.join(kinds)}")
        return self._c.create_sequence(
            model, lease_s, list(prompt), cache_salt, _extra_keys(extra_keys), priority,
            kinds[retention], window, sinks, budget)

    def append(self, model: str, seq_id: int, payload: Any = None, *, k: Any = None,
               v: Any = None, num_tokens: Optional[int] = None, layer_begin: int = 0,
               layer_end: Optional[int] = None, dtype: Optional[str] = None,
               token_ids: Optional[Sequence[int]] = None, kv_head_begin: int = 0,
               kv_head_end: Optional[int] = None) -> SequenceInfo:
        """Appends num_tokens tokens of layers [layer_begin, layer_end) (all by default).

        Either `payload`: the dense payload (per layer K [kv_heads][n][head_dim] then V), or `k`
        and `v`: [layers][kv_heads][n][head_dim(_v)] each (v None for MLA). Any C-contiguous
        buffer (numpy array, bytes, memoryview) or CPU torch tensor, read in place. dtype: the
        payload's element type (default: the layers' storage dtype when they share one).
        kv_head_begin / kv_head_end: only those kv heads (a tensor-parallel rank's share; the
        payload then has that many heads). The ranks of a prefill append their heads of the same
        tokens at once; the tokens count in the length once every head holds them."""
        ids = list(token_ids) if token_ids is not None else []
        if (payload is None) == (k is None):
            raise InvalidArgumentError("give either a payload or k (and v)")
        if payload is not None and is_cuda(payload):
            if num_tokens is None:
                raise InvalidArgumentError("num_tokens is needed with a payload")
            r = self._device.append(payload, model, seq_id, (num_tokens, layer_begin, layer_end,
                                                             dtype, ids, kv_head_begin,
                                                             kv_head_end))
            if r is not None:
                return r
            payload = self._staged(payload)
        if k is not None and is_cuda(k):
            k = self._staged(k)
        if v is not None and is_cuda(v):
            v = self._staged(v)
        if k is not None:
            n = num_tokens if num_tokens is not None else _num_tokens_of(k)
            kb = _buffer(k, False)
            vb = _buffer(v, False) if v is not None else None
            return self._c.append_tensors(model, seq_id, kb, vb, n, layer_begin, layer_end,
                                          dtype, ids, kv_head_begin, kv_head_end)
        if num_tokens is None:
            raise InvalidArgumentError("num_tokens is needed with a payload")
        return self._c.append(model, seq_id, _buffer(payload, False), num_tokens, layer_begin,
                              layer_end, dtype, ids, kv_head_begin, kv_head_end)

    @overload
    def fetch(self, model: str, seq_id: int, *, token_begin: int = ...,
              token_end: Optional[int] = ..., layer_begin: int = ...,
              layer_end: Optional[int] = ..., dtype: Optional[str] = ...,
              kv_head_begin: int = ..., kv_head_end: Optional[int] = ...,
              as_bytes: Literal[False] = ..., wait_s: float = ...) -> np.ndarray: ...

    @overload
    def fetch(self, model: str, seq_id: int, *, token_begin: int = ...,
              token_end: Optional[int] = ..., layer_begin: int = ...,
              layer_end: Optional[int] = ..., dtype: Optional[str] = ...,
              kv_head_begin: int = ..., kv_head_end: Optional[int] = ...,
              as_bytes: Literal[True], wait_s: float = ...) -> bytes: ...

    @overload
    def fetch(self, model: str, seq_id: int, *, token_begin: int = ...,
              token_end: Optional[int] = ..., layer_begin: int = ...,
              layer_end: Optional[int] = ..., dtype: Optional[str] = ...,
              kv_head_begin: int = ..., kv_head_end: Optional[int] = ...,
              as_bytes: bool, wait_s: float = ...) -> Union[np.ndarray, bytes]: ...

    def fetch(self, model: str, seq_id: int, *, token_begin: int = 0,
              token_end: Optional[int] = None, layer_begin: int = 0,
              layer_end: Optional[int] = None, dtype: Optional[str] = None,
              kv_head_begin: int = 0, kv_head_end: Optional[int] = None,
              as_bytes: bool = False, wait_s: float = 0.0) -> Union[np.ndarray, bytes]:
        """Tokens [token_begin, token_end) of layers [layer_begin, layer_end) as a flat numpy
        array of the wire dtype (bf16: uint16 bits) in the payload layout, owning the SDK's
        buffer (no copy); as_bytes: bytes instead (one copy). kv_head_begin / kv_head_end: only
        those kv heads (a tensor-parallel rank's share; the layout with that many heads).
        wait_s (layer-wise handoff, with token_end): wait up to that long for appends to commit
        the tokens (DeadlineExceededError when they do not), so a decode worker pulls each layer
        as soon as the prefill worker's append of it commits."""
        meta, data = self._c.fetch(model, seq_id, token_begin, token_end, layer_begin, layer_end,
                                   dtype, kv_head_begin, kv_head_end, wait_s)
        if as_bytes:
            return data.tobytes()
        return data.view(numpy_dtype(meta.dtype))

    def fetch_into(self, model: str, seq_id: int, out: Any, *, token_begin: int = 0,
                   token_end: Optional[int] = None, layer_begin: int = 0,
                   layer_end: Optional[int] = None, dtype: Optional[str] = None,
                   kv_head_begin: int = 0, kv_head_end: Optional[int] = None,
                   wait_s: float = 0.0) -> FetchInfo:
        """Writes the payload straight into `out` (a writable C-contiguous numpy array,
        bytearray, memoryview, or CPU torch tensor): no intermediate copy. OutOfRangeError when
        it does not fit (ModelInfo.payload_bytes sizes it). wait_s: as for fetch. A CUDA tensor
        takes the plane device_plane_for names (through host memory: one more copy here)."""
        if is_cuda(out):
            r = self._device.fetch_into(out, model, seq_id, (token_begin, token_end, layer_begin,
                                                             layer_end, dtype, kv_head_begin,
                                                             kv_head_end), wait_s)
            if r is not None:
                return r
            return self._into_device(out, lambda host: self.fetch_into(
                model, seq_id, host, token_begin=token_begin, token_end=token_end,
                layer_begin=layer_begin, layer_end=layer_end, dtype=dtype,
                kv_head_begin=kv_head_begin, kv_head_end=kv_head_end, wait_s=wait_s))
        return self._c.fetch_into(model, seq_id, _buffer(out, True), token_begin, token_end,
                                  layer_begin, layer_end, dtype, kv_head_begin, kv_head_end,
                                  wait_s)

    # ---- CUDA tensors through host memory --------------------------------------------------

    def _staged(self, tensor: Any) -> Any:
        """A host copy of a CUDA tensor's payload (counted as cuda_staged)."""
        if not tensor.is_contiguous():
            raise InvalidArgumentError("the tensor is not contiguous")
        host = tensor.cpu()
        self._device.count_staged(host.numel() * host.element_size())
        return host

    def _into_device(self, out: Any, fetch: Any) -> Any:
        """fetch(host) into a host buffer of out's size, then its payload_bytes into out."""
        import torch
        if not out.is_contiguous():
            raise InvalidArgumentError("the tensor is not contiguous")
        flat = out.reshape(-1).view(torch.uint8)
        host = torch.empty(flat.numel(), dtype=torch.uint8)
        info = fetch(host)
        flat[:info.payload_bytes].copy_(host[:info.payload_bytes])
        self._device.count_staged(info.payload_bytes)
        return info

    def fetch_tensors(self, model: str, seq_id: int, k: Any, v: Any = None, *,
                      token_begin: int = 0, token_end: Optional[int] = None,
                      layer_begin: int = 0, layer_end: Optional[int] = None,
                      dtype: Optional[str] = None, kv_head_begin: int = 0,
                      kv_head_end: Optional[int] = None, wait_s: float = 0.0) -> None:
        """Fills k [layers][kv_heads][tokens][head_dim] and v (head_dim_v; None for MLA), each
        exactly the size of the range fetched (kv_heads: those of the head range). wait_s: as
        for fetch. CUDA tensors are filled through host memory."""
        if is_cuda(k) or (v is not None and is_cuda(v)):
            hk = k.cpu() if is_cuda(k) else k
            hv = v.cpu() if v is not None and is_cuda(v) else v
            self.fetch_tensors(model, seq_id, hk, hv, token_begin=token_begin,
                               token_end=token_end, layer_begin=layer_begin, layer_end=layer_end,
                               dtype=dtype, kv_head_begin=kv_head_begin, kv_head_end=kv_head_end,
                               wait_s=wait_s)
            for dst, src in ((k, hk), (v, hv)):
                if dst is not None and dst is not src:
                    dst.copy_(src)
                    self._device.count_staged(src.numel() * src.element_size())
            return
        self._c.fetch_tensors(model, seq_id, _buffer(k, True),
                              _buffer(v, True) if v is not None else None, token_begin,
                              token_end, layer_begin, layer_end, dtype, kv_head_begin,
                              kv_head_end, wait_s)

    def fork(self, model: str, seq_id: int, *, lease_s: Optional[float] = None) -> SequenceInfo:
        return self._c.fork(model, seq_id, lease_s)

    def truncate(self, model: str, seq_id: int, num_tokens: int) -> SequenceInfo:
        return self._c.truncate(model, seq_id, num_tokens)

    def free(self, model: str, seq_id: int) -> int:
        """Frees a sequence; returns how many block references it dropped."""
        return self._c.free(model, seq_id)

    def renew_lease(self, model: str, seq_id: int) -> SequenceInfo:
        return self._c.renew_lease(model, seq_id)

    def get_sequence(self, model: str, seq_id: int) -> SequenceInfo:
        return self._c.get_sequence(model, seq_id)

    # ---- futures --------------------------------------------------------------------------

    def _submit(self, fn: Callable[..., _T], *args: Any,
                **kwargs: Any) -> "concurrent.futures.Future[_T]":
        """fn(*args, **kwargs) on one of this client's worker threads (started at the first)."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self._max_workers, thread_name_prefix="kvbank")
            return self._pool.submit(fn, *args, **kwargs)

    def append_async(self, model: str, seq_id: int, payload: Any = None,
                     **kwargs: Any) -> "concurrent.futures.Future[SequenceInfo]":
        """append on a worker thread: a Future of its SequenceInfo. The buffers must not change
        until it is done (the future holds them alive)."""
        return self._submit(self.append, model, seq_id, payload, **kwargs)

    def fetch_async(self, model: str, seq_id: int,
                    **kwargs: Any) -> "concurrent.futures.Future[Union[np.ndarray, bytes]]":
        return self._submit(self.fetch, model, seq_id, **kwargs)

    def fetch_into_async(self, model: str, seq_id: int, out: Any,
                         **kwargs: Any) -> "concurrent.futures.Future[FetchInfo]":
        """fetch_into on a worker thread: a Future of its FetchInfo; `out` is complete when the
        future is done. Overlaps a layer's transfer with compute on the calling thread."""
        return self._submit(self.fetch_into, model, seq_id, out, **kwargs)

    # ---- prefix cache ---------------------------------------------------------------------

    def match(self, model: str, queries: Sequence[Any], *, cache_salt: str = "",
              extra_keys: ExtraKeys = ()) -> list[int]:
        """Leading cached tokens of each query (in the server's pool or a tier below it): a
        sequence of token ids, a sequence of block hashes (bytes), or a dict with tokens /
        hashes / cache_salt / extra_keys."""
        return self._c.match(model, self._queries(queries, cache_salt, extra_keys))

    def match_tiers(self, model: str, queries: Sequence[Any], *, cache_salt: str = "",
                    extra_keys: ExtraKeys = (), prefetch: bool = False) -> list[dict[str, int]]:
        """As match, with where the tokens are: a dict per query with tokens, pool_tokens,
        host_tokens and disk_tokens (the last three add up to tokens). prefetch: the server also
        starts bringing the blocks it found in a tier back into its pool, in the background, so
        a create_sequence with the prompt shortly after finds them there."""
        return self._c.match_tiers(model, self._queries(queries, cache_salt, extra_keys),
                                   prefetch)

    @staticmethod
    def _queries(queries: Sequence[Any], cache_salt: str, extra_keys: ExtraKeys) -> list[Any]:
        qs = []
        for q in queries:
            if isinstance(q, Mapping):
                qs.append((list(q.get("tokens", ())), [bytes(h) for h in q.get("hashes", ())],
                           q.get("cache_salt", cache_salt),
                           _extra_keys(q.get("extra_keys", extra_keys))))
            else:
                q = list(q)
                if q and isinstance(q[0], (bytes, bytearray)):
                    qs.append(([], [bytes(h) for h in q], cache_salt, _extra_keys(extra_keys)))
                else:
                    qs.append((q, [], cache_salt, _extra_keys(extra_keys)))
        return qs

    def fetch_blocks(self, model: str, hashes: Sequence[bytes], *, layer_begin: int = 0,
                     layer_end: Optional[int] = None, dtype: Optional[str] = None,
                     kv_head_begin: int = 0, kv_head_end: Optional[int] = None) -> Blocks:
        """The longest cached run of the leading `hashes`, full blocks in the payload layout."""
        meta, data = self._c.fetch_blocks(model, [bytes(h) for h in hashes], layer_begin,
                                          layer_end, dtype, kv_head_begin, kv_head_end)
        return Blocks(meta, data.view(numpy_dtype(meta.dtype)))

    def fetch_blocks_into(self, model: str, hashes: Sequence[bytes], out: Any, *,
                          layer_begin: int = 0, layer_end: Optional[int] = None,
                          dtype: Optional[str] = None, kv_head_begin: int = 0,
                          kv_head_end: Optional[int] = None) -> FetchInfo:
        """fetch_blocks written into `out` (as fetch_into): info.payload_bytes says how much of
        it the cached run filled. A CUDA tensor: CUDA IPC where device_plane_for says so, else
        through host memory."""
        if is_cuda(out):
            hs = [bytes(h) for h in hashes]
            r = self._device.fetch_blocks_into(out, model, hs, (layer_begin, layer_end, dtype,
                                                               kv_head_begin, kv_head_end))
            if r is not None:
                return r
            return self._into_device(out, lambda host: self.fetch_blocks_into(
                model, hs, host, layer_begin=layer_begin, layer_end=layer_end, dtype=dtype,
                kv_head_begin=kv_head_begin, kv_head_end=kv_head_end))
        return self._c.fetch_blocks_into(model, [bytes(h) for h in hashes], _buffer(out, True),
                                         layer_begin, layer_end, dtype, kv_head_begin,
                                         kv_head_end)

    def pin(self, model: str, *, tokens: Sequence[int] = (), hashes: Sequence[bytes] = (),
            cache_salt: str = "", extra_keys: ExtraKeys = (), pin: bool = True) -> int:
        """Pins (pin=False: unpins) cached blocks, by hashes or the full blocks of `tokens`;
        returns how many named a cached block."""
        return self._c.pin(model, list(tokens), [bytes(h) for h in hashes], cache_salt,
                           _extra_keys(extra_keys), pin)

    def get_prefix_root(self, model: str, cache_salt: str = "") -> PrefixRoot:
        return self._c.get_prefix_root(model, cache_salt)

    def watch(self, model: str, *, after_sequence: Optional[int] = None,
              deadline_s: float = 60.0) -> Iterator[Event]:
        """KV events of the model after `after_sequence` (0: every event the server still
        keeps; None: from now on, where "now" is the first next(): the stream opens then), one
        by one, until deadline_s passes (then the iteration ends) or the server ends the stream.

        Each batch the server sends is read on its own stream, resumed from the batch's last
        sequence number: between items no stream is open, so the iteration can stop at any
        point without cancelling anything."""
        end = time.monotonic() + deadline_s
        after = after_sequence or 0
        from_now = after_sequence is None
        got: list[tuple[list[Event], int]] = []  # the batch of the current stream

        def on_batch(events: list[Event], last: int) -> bool:
            got.append((events, last))
            return False

        while True:
            left = end - time.monotonic()
            if left <= 0:
                return
            got.clear()
            try:
                self._c.watch(model, after, from_now, left, on_batch)
            except DeadlineExceededError:  # the deadline ends a watch; anything else is an error
                if not got:
                    return
                raise
            if not got:
                return  # the server ended the stream
            events, last = got[0]
            after, from_now = last, False
            yield from events

    # ---- attention ------------------------------------------------------------------------

    def attend(self, model: str, queries: Sequence[tuple[int, int, Any]], *,
               softmax_scale: float = 0.0, window: int = 0,
               sinks: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
        """Decode attention on the server: for each (sequence_id, layer, query
        [num_q_heads * head_dim] float32) the output [num_q_heads * head_dim_v] and the
        log-sum-exp per q head, both float32."""
        qs = [(int(seq), int(layer), np.ascontiguousarray(q, dtype=np.float32).reshape(-1))
              for seq, layer, q in queries]
        return self._c.attend(model, qs, softmax_scale, window, sinks)


# ---- prefix hashes (no server needed) --------------------------------------------------------


def root_hash(layout_fingerprint: str, tenant: str = "", cache_salt: str = "", *,
              algorithm: str = "sha256") -> bytes:
    """The prefix root of a model layout (its fingerprint), tenant and cache salt: 32 bytes."""
    return _kvbank.root_hash(algorithm, layout_fingerprint, tenant, cache_salt)


def chain_hash(parent: bytes, tokens: Sequence[int], extra_keys: ExtraKeys = (), *,
               algorithm: str = "sha256") -> bytes:
    """The hash of one full block given its parent's hash (or the root)."""
    return _kvbank.chain_hash(algorithm, bytes(parent), list(tokens), _extra_keys(extra_keys))


def prefix_hashes(root: bytes, tokens: Sequence[int], block_tokens: int,
                  extra_keys: ExtraKeys = (), *, algorithm: str = "sha256") -> list[bytes]:
    """The hashes of every full block of `tokens`, chained from `root` (the server's function,
    the same bytes as the C++ SDK's PrefixHashes)."""
    return _kvbank.prefix_hashes(algorithm, bytes(root), list(tokens), block_tokens,
                                 _extra_keys(extra_keys))


def layout_fingerprint(layout: Layout) -> str:
    return _kvbank.layout_fingerprint(dict(layout))


def preset_layout(preset: str, storage: str = "bf16") -> Layout:
    """A built-in preset's layout dict (name = the preset)."""
    return _kvbank.preset_layout(preset, storage)


def preset_names() -> list[str]:
    return list(_kvbank.preset_names())


def normalize_layout(layout: Layout) -> Layout:
    """The layout with every field filled in ("dtype" expanded, head_dim_v defaulted)."""
    return _kvbank.normalize_layout(dict(layout))
