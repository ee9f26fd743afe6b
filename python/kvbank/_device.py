"""Payloads in CUDA memory: which data plane moves them, and the CUDA IPC registrations reused.

A CUDA tensor given to Client.append / fetch_into / fetch_blocks_into takes, in this order:
  cuda_ipc     kvbankd runs on this host (same boot id) with its pools in cuda:N memory: the
               tensor's allocation is registered once (CUDA IPC) and kvbankd copies device to
               device, converting on the device.
  nccl         kvbankd can form NCCL communicators: one is formed on the tensor's device at the
               first such payload (once: forming it takes a while) and the payload crosses NCCL.
  cuda_staged  otherwise: a copy through host memory here, then the host planes (shared memory
               or gRPC).
Client(device_plane=...) narrows the choice ("cuda_ipc", "nccl", "host"); plane_stats() counts
each. Neither GPU plane has run on a GPU yet: the SDK needs gRPC, and the GPU test build
(tests/gpu/run_on_device.sh) is made without it. The choice is tested on CPU, the planes' C++
halves in the gpu test suite.
"""

import collections
import ctypes
import threading
from collections.abc import Mapping
from typing import Any, Optional

from ._errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    UnimplementedError,
)

DEVICE_PLANES = ("cuda_ipc", "nccl", "cuda_staged")
_MODES = ("auto", "cuda_ipc", "nccl", "host")


def choose_device_plane(server: Mapping[str, Any], device: int, *, mode: str = "auto",
                        ipc_ok: bool = True, nccl_device: Optional[int] = None,
                        nccl_ok: bool = True) -> str:
    """The plane for a payload in CUDA memory on device `device`.

    server: Client.server_info()'s dict (cuda_ipc_device, on_this_host, nccl). mode: "auto" or
    the one plane allowed ("cuda_ipc", "nccl", "host": always through host memory). ipc_ok /
    nccl_ok: False once that plane failed for this client (it is not tried again).
    nccl_device: the device of this client's communicator, None when it has none (auto forms
    one on `device`; a communicator on another device sends this payload through host memory).
    """
    if mode not in _MODES:
        raise InvalidArgumentError(f"device_plane must be one of {', '.join(_MODES)}, "
                                   f"not {mode!r}")
    if mode in ("auto", "cuda_ipc") and ipc_ok and server.get("cuda_ipc_device") is not None \
            and server.get("on_this_host"):
        return "cuda_ipc"
    if mode in ("auto", "nccl") and nccl_ok and server.get("nccl") and \
            (nccl_device is None or nccl_device == device):
        return "nccl"
    return "cuda_staged"


def plane_refused(e: Exception) -> bool:
    """A FAILED_PRECONDITION or UNIMPLEMENTED that turns a GPU plane down (rather than the call:
    a freed sequence, say): kvbankd's and the SDK's refusals name the plane."""
    return isinstance(e, (FailedPreconditionError, UnimplementedError)) and any(
        w in str(e) for w in ("CUDA IPC", "NCCL", "communicator", "cuda:"))


class _Driver:
    """The few CUDA driver calls the registrations need (libcuda.so.1 through ctypes: the
    driver is wherever a GPU is; the SDK itself links no CUDA)."""

    def __init__(self) -> None:
        self._lib = ctypes.CDLL("libcuda.so.1")
        self._range = self._lib.cuMemGetAddressRange_v2
        self._range.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                ctypes.c_uint64]
        self._handle = self._lib.cuIpcGetMemHandle
        self._handle.argtypes = [ctypes.c_char_p, ctypes.c_uint64]

    def allocation(self, ptr: int) -> tuple[int, int, bytes]:
        """(base, size, 64-byte IPC handle) of the cudaMalloc allocation holding `ptr`."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        rc = self._range(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
        if rc != 0:
            raise InvalidArgumentError(f"cuMemGetAddressRange failed (CUresult {rc}) for "
                                       f"{ptr:#x}")
        handle = ctypes.create_string_buffer(64)
        rc = self._handle(handle, base)
        if rc != 0:
            # e.g. memory from cuMemCreate (torch's expandable segments) or cudaMallocAsync
            raise FailedPreconditionError(
                f"CUDA IPC: cuIpcGetMemHandle failed (CUresult {rc}): this allocation cannot be "
                "shared (torch's expandable_segments or cudaMallocAsync pools cannot)")
        return base.value, size.value, handle.raw


_driver: Optional[_Driver] = None
_driver_lock = threading.Lock()


def _cuda_driver() -> _Driver:
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


def cuda_span(tensor: Any) -> tuple[int, int, int]:
    """(device index, address, size in bytes) of a contiguous CUDA tensor."""
    device = getattr(tensor, "device", None)
    if device is None or getattr(device, "type", None) != "cuda":
        raise InvalidArgumentError("a CUDA tensor is needed")
    if not tensor.is_contiguous():
        raise InvalidArgumentError("the tensor is not contiguous")
    index = device.index if device.index is not None else 0
    return index, int(tensor.data_ptr()), tensor.numel() * tensor.element_size()


def is_cuda(obj: Any) -> bool:
    return getattr(getattr(obj, "device", None), "type", None) == "cuda"


class DeviceRouter:
    """Moves CUDA tensors' payloads for one Client (see the module's docstring). Thread-safe."""

    # Registrations kept (the least recently used is dropped past this); kvbankd also closes
    # one that no transfer named for its --cuda-ipc-lease-ms.
    MAX_REGIONS = 64

    def __init__(self, c: Any, mode: str) -> None:
        if mode not in _MODES:
            raise InvalidArgumentError(f"device_plane must be one of {', '.join(_MODES)}, "
                                       f"not {mode!r}")
        self._c = c
        self._mode = mode
        self._lock = threading.Lock()
        self._server: Optional[dict[str, Any]] = None
        self._ipc_ok = True
        self._nccl_ok = True
        self._nccl_device: Optional[int] = None
        self._regions: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._counts = {p: {"calls": 0, "bytes": 0} for p in DEVICE_PLANES}
        self.off_reasons: dict[str, str] = {}

    def stats(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {p: dict(c) for p, c in self._counts.items()}

    def _count(self, plane: str, nbytes: int) -> None:
        with self._lock:
            self._counts[plane]["calls"] += 1
            self._counts[plane]["bytes"] += nbytes

    def plane_for(self, device: int) -> str:
        with self._lock:
            if self._server is None:
                self._server = dict(self._c.server_info())
            return choose_device_plane(self._server, device, mode=self._mode,
                                       ipc_ok=self._ipc_ok, nccl_device=self._nccl_device,
                                       nccl_ok=self._nccl_ok)

    def _drop(self, plane: str, why: Exception) -> None:
        with self._lock:
            if plane == "cuda_ipc":
                self._ipc_ok = False
            else:
                self._nccl_ok = False
            self.off_reasons[plane] = str(why)

    # ---- CUDA IPC ---------------------------------------------------------------------------

    def _region(self, ptr: int) -> tuple[int, int]:
        """(region id, ptr's offset in it): the allocation's registration, made at first use."""
        try:
            driver = _cuda_driver()
        except OSError as e:
            raise FailedPreconditionError("CUDA IPC: the CUDA driver (libcuda.so.1) cannot be "
                                          f"loaded: {e}") from None
        base, size, handle = driver.allocation(ptr)
        with self._lock:
            rid = self._regions.get(handle)
            if rid is not None:
                self._regions.move_to_end(handle)
                return rid, ptr - base
        rid = self._c.register_device_region(handle, 0, size).region_id
        dropped = []
        with self._lock:
            if handle in self._regions:  # another thread registered it meanwhile: use theirs
                dropped.append(rid)
                rid = self._regions[handle]
            else:
                self._regions[handle] = rid
            while len(self._regions) > self.MAX_REGIONS:
                dropped.append(self._regions.popitem(last=False)[1])
        for old in dropped:
            try:
                self._c.unregister_device_region(old)
            except NotFoundError:
                pass  # kvbankd already closed it (its lease ran out)
        return rid, ptr - base

    def _forget(self, region_id: int) -> None:
        with self._lock:
            for h, rid in list(self._regions.items()):
                if rid == region_id:
                    del self._regions[h]

    def _with_region(self, ptr: int, call: Any) -> Any:
        """call(region_id, offset); once more after a NOT_FOUND (kvbankd closed the region:
        its lease ran out) with a fresh registration."""
        rid, offset = self._region(ptr)
        try:
            return call(rid, offset)
        except NotFoundError as e:
            if "device region" not in str(e):
                raise
            self._forget(rid)
            rid, offset = self._region(ptr)
            return call(rid, offset)

    # ---- the calls ----------------------------------------------------------------------------

    def _try(self, tensor: Any, ipc: Any, nccl: Optional[Any]) -> Optional[Any]:
        """Runs the payload on cuda_ipc (ipc(region_id, offset, nbytes)) or nccl (nccl(ptr,
        nbytes); None: this call has no NCCL form) as chosen; None when it is to go through host
        memory. A plane turned down as unavailable is dropped for this client, and the next one
        is tried; any other error is the call's."""
        device, ptr, nbytes = cuda_span(tensor)
        while True:
            plane = self.plane_for(device)
            try:
                if plane == "cuda_ipc":
                    r = self._with_region(ptr, lambda rid, off: ipc(rid, off, nbytes))
                elif plane == "nccl" and nccl is not None:
                    self._connect_nccl(device)
                    r = nccl(ptr, nbytes)
                else:
                    return None
            except (FailedPreconditionError, UnimplementedError) as e:
                if not plane_refused(e):
                    raise
                # The plane is off for this client (the pools are not on the GPU, the allocation
                # cannot be shared, no communicator could be formed): the next one.
                self._drop(plane, e)
                continue
            # A fetch counts what arrived (FetchInfo.payload_bytes), an append what it sent.
            self._count(plane, int(getattr(r, "payload_bytes", nbytes)))
            return r

    def _connect_nccl(self, device: int) -> None:
        with self._lock:
            if self._nccl_device is not None:
                return
        self._c.nccl_connect(device)
        with self._lock:
            self._nccl_device = device

    def append(self, tensor: Any, model: str, seq_id: int, args: tuple[Any, ...]) -> Optional[Any]:
        """append's payload in CUDA memory: the SequenceInfo, or None for the host path.
        args: (num_tokens, layer_begin, layer_end, dtype, token_ids, kv_head_begin,
        kv_head_end)."""
        return self._try(
            tensor,
            lambda rid, off, n: self._c.append_from_device(model, seq_id, rid, off, n, *args),
            lambda ptr, n: self._c.append_over_nccl(model, seq_id, ptr, n, *args))

    def fetch_into(self, out: Any, model: str, seq_id: int, args: tuple[Any, ...],
                   wait_s: float) -> Optional[Any]:
        """fetch_into a CUDA tensor: the FetchInfo, or None for the host path.
        args: (token_begin, token_end, layer_begin, layer_end, dtype, kv_head_begin,
        kv_head_end)."""
        if wait_s > 0 and self.plane_for(cuda_span(out)[0]) == "nccl":
            return None  # NCCL fetches do not wait; the host path does
        return self._try(
            out,
            lambda rid, off, n: self._c.fetch_to_device(model, seq_id, rid, off, n, *args,
                                                        wait_s),
            lambda ptr, n: self._c.fetch_over_nccl(model, seq_id, ptr, n, *args))

    def fetch_blocks_into(self, out: Any, model: str, hashes: Any,
                          args: tuple[Any, ...]) -> Optional[Any]:
        """fetch_blocks_into a CUDA tensor (CUDA IPC only; NCCL has no block fetch): the
        FetchInfo, or None for the host path. args: (layer_begin, layer_end, dtype,
        kv_head_begin, kv_head_end)."""
        if self.plane_for(cuda_span(out)[0]) != "cuda_ipc":
            return None
        return self._try(
            out,
            lambda rid, off, n: self._c.fetch_blocks_to_device(model, hashes, rid, off, n,
                                                               *args),
            None)

    def count_staged(self, nbytes: int) -> None:
        self._count("cuda_staged", nbytes)
