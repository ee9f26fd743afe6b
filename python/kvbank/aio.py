"""asyncio face of kvbank.Client: every method a coroutine, run on the client's worker threads.

    async with kvbank.aio.AsyncClient(kvbank.Client(target)) as client:
        seq = await client.create_sequence(model, prompt=token_ids)
        await client.append(model, seq.id, payload, num_tokens=len(token_ids))
        infos = await asyncio.gather(*(client.fetch_into(model, seq.id, out) for out in outs))

Each call runs the blocking Client call on the client's worker threads (Client's max_workers;
the RPC releases the GIL), so the event loop keeps running and calls awaited together overlap,
max_workers at a time. The methods take the arguments of the Client methods of the same names
and return what they return; errors raise the same kvbank.Error subclasses. Cancelling a task
that awaits a call drops the result: a call already running on a worker finishes there.
"""

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any, Callable, Literal, Optional, TypeVar, Union, overload

import numpy as np

from ._client import Client, ExtraKeys
from ._errors import Error
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


class AsyncClient:
    """kvbank.Client for asyncio. Share one per process like the Client it wraps; closing it
    (aclose, or leaving `async with`) waits for the calls in flight and stops the client's
    worker threads without blocking the loop. The client stays usable: a later call starts
    new workers (as after Client.close)."""

    def __init__(self, client: Client) -> None:
        """client: the Client whose worker threads run the calls (Client(max_workers=...))."""
        self.client = client

    async def _call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        return await asyncio.wrap_future(self.client._submit(fn, *args, **kwargs))

    @property
    def target(self) -> str:
        """The server the client talks to (Client.target)."""
        return self.client.target

    # ---- lifetime -------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Client.close, awaited: waits for the calls in flight, then stops the worker threads.

        NOTE: close joins the client's worker threads, so it runs on a thread of the loop's
        default executor, never on one of those workers (which would then wait for itself)."""
        await asyncio.get_running_loop().run_in_executor(None, self.client.close)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def check_serving(self, deadline_s: float = 10.0) -> None:
        """Client.check_serving, awaited."""
        await self._call(self.client.check_serving, deadline_s)

    # ---- data planes ----------------------------------------------------------------------

    @property
    def data_plane(self) -> str:
        """Client.data_plane ("shm" or "grpc"; no call to the server)."""
        return self.client.data_plane

    async def plane_stats(self) -> dict[str, dict[str, int]]:
        """Client.plane_stats (local counters: runs on the loop, no worker thread)."""
        return self.client.plane_stats()

    async def server_info(self) -> dict[str, Any]:
        """Client.server_info, awaited."""
        return await self._call(self.client.server_info)

    async def device_plane_for(self, device: int = 0) -> str:
        """Client.device_plane_for, awaited."""
        return await self._call(self.client.device_plane_for, device)

    async def register_region(self, nbytes: int) -> np.ndarray:
        """Client.register_region, awaited."""
        return await self._call(self.client.register_region, nbytes)

    async def register_region_fd(self, fd: int) -> np.ndarray:
        """Client.register_region_fd, awaited."""
        return await self._call(self.client.register_region_fd, fd)

    async def unregister_region(self, array: np.ndarray) -> None:
        """Client.unregister_region, awaited."""
        await self._call(self.client.unregister_region, array)

    # ---- CUDA IPC and NCCL ----------------------------------------------------------------

    async def register_device_region(self, tensor: Any) -> DeviceRegion:
        """Client.register_device_region, awaited."""
        return await self._call(self.client.register_device_region, tensor)

    async def unregister_device_region(self, region: DeviceRegion) -> None:
        """Client.unregister_device_region, awaited."""
        await self._call(self.client.unregister_device_region, region)

    async def append_from_device(self, model: str, seq_id: int, region: DeviceRegion, *,
                                 num_tokens: int, offset: int = 0, length: Optional[int] = None,
                                 layer_begin: int = 0, layer_end: Optional[int] = None,
                                 dtype: Optional[str] = None,
                                 token_ids: Optional[Sequence[int]] = None,
                                 kv_head_begin: int = 0,
                                 kv_head_end: Optional[int] = None) -> SequenceInfo:
        """Client.append_from_device, awaited."""
        return await self._call(
            self.client.append_from_device, model, seq_id, region, num_tokens=num_tokens,
            offset=offset, length=length, layer_begin=layer_begin, layer_end=layer_end,
            dtype=dtype, token_ids=token_ids, kv_head_begin=kv_head_begin,
            kv_head_end=kv_head_end)

    async def fetch_to_device(self, model: str, seq_id: int, region: DeviceRegion, *,
                              offset: int = 0, length: Optional[int] = None,
                              token_begin: int = 0, token_end: Optional[int] = None,
                              layer_begin: int = 0, layer_end: Optional[int] = None,
                              dtype: Optional[str] = None, kv_head_begin: int = 0,
                              kv_head_end: Optional[int] = None,
                              wait_s: float = 0.0) -> FetchInfo:
        """Client.fetch_to_device, awaited."""
        return await self._call(
            self.client.fetch_to_device, model, seq_id, region, offset=offset, length=length,
            token_begin=token_begin, token_end=token_end, layer_begin=layer_begin,
            layer_end=layer_end, dtype=dtype, kv_head_begin=kv_head_begin,
            kv_head_end=kv_head_end, wait_s=wait_s)

    async def nccl_connect(self, device: int = 0) -> None:
        """Client.nccl_connect, awaited."""
        await self._call(self.client.nccl_connect, device)

    async def nccl_disconnect(self) -> None:
        """Client.nccl_disconnect, awaited."""
        await self._call(self.client.nccl_disconnect)

    async def append_over_nccl(self, model: str, seq_id: int, tensor: Any, *, num_tokens: int,
                               layer_begin: int = 0, layer_end: Optional[int] = None,
                               dtype: Optional[str] = None,
                               token_ids: Optional[Sequence[int]] = None,
                               kv_head_begin: int = 0,
                               kv_head_end: Optional[int] = None) -> SequenceInfo:
        """Client.append_over_nccl, awaited."""
        return await self._call(
            self.client.append_over_nccl, model, seq_id, tensor, num_tokens=num_tokens,
            layer_begin=layer_begin, layer_end=layer_end, dtype=dtype, token_ids=token_ids,
            kv_head_begin=kv_head_begin, kv_head_end=kv_head_end)

    async def fetch_over_nccl(self, model: str, seq_id: int, out: Any, *, token_begin: int = 0,
                              token_end: Optional[int] = None, layer_begin: int = 0,
                              layer_end: Optional[int] = None, dtype: Optional[str] = None,
                              kv_head_begin: int = 0,
                              kv_head_end: Optional[int] = None) -> FetchInfo:
        """Client.fetch_over_nccl, awaited."""
        return await self._call(
            self.client.fetch_over_nccl, model, seq_id, out, token_begin=token_begin,
            token_end=token_end, layer_begin=layer_begin, layer_end=layer_end, dtype=dtype,
            kv_head_begin=kv_head_begin, kv_head_end=kv_head_end)

    # ---- models ---------------------------------------------------------------------------

    async def ensure_model(self, layout: Optional[Layout] = None, *,
                           preset: Optional[str] = None, name: Optional[str] = None,
                           storage: Optional[str] = None, pool_bytes: int = 0,
                           block_tokens: int = 0) -> ModelInfo:
        """Client.ensure_model, awaited."""
        return await self._call(self.client.ensure_model, layout, preset=preset, name=name,
                                storage=storage, pool_bytes=pool_bytes,
                                block_tokens=block_tokens)

    async def list_models(self) -> list[ModelInfo]:
        """Client.list_models, awaited."""
        return await self._call(self.client.list_models)

    async def get_model(self, name: str) -> ModelInfo:
        """Client.get_model, awaited."""
        return await self._call(self.client.get_model, name)

    async def drop_model(self, name: str) -> None:
        """Client.drop_model, awaited."""
        await self._call(self.client.drop_model, name)

    async def stats(self, model: str = "") -> list[dict[str, Any]]:
        """Client.stats, awaited."""
        return await self._call(self.client.stats, model)

    # ---- sequences ------------------------------------------------------------------------

    async def create_sequence(self, model: str, prompt: Sequence[int] = (), *,
                              lease_s: Optional[float] = None, cache_salt: str = "",
                              extra_keys: ExtraKeys = (), priority: Optional[int] = None,
                              retention: str = "full", window: int = 0, sinks: int = 0,
                              budget: int = 0) -> SequenceInfo:
        """Client.create_sequence, awaited."""
        return await self._call(
            self.client.create_sequence, model, prompt, lease_s=lease_s, cache_salt=cache_salt,
            extra_keys=extra_keys, priority=priority, retention=retention, window=window,
            sinks=sinks, budget=budget)

    async def append(self, model: str, seq_id: int, payload: Any = None, *, k: Any = None,
                     v: Any = None, num_tokens: Optional[int] = None, layer_begin: int = 0,
                     layer_end: Optional[int] = None, dtype: Optional[str] = None,
                     token_ids: Optional[Sequence[int]] = None, kv_head_begin: int = 0,
                     kv_head_end: Optional[int] = None) -> SequenceInfo:
        """Client.append, awaited. The buffers must not change until it returns."""
        return await self._call(
            self.client.append, model, seq_id, payload, k=k, v=v, num_tokens=num_tokens,
            layer_begin=layer_begin, layer_end=layer_end, dtype=dtype, token_ids=token_ids,
            kv_head_begin=kv_head_begin, kv_head_end=kv_head_end)

    @overload
    async def fetch(self, model: str, seq_id: int, *, token_begin: int = ...,
                    token_end: Optional[int] = ..., layer_begin: int = ...,
                    layer_end: Optional[int] = ..., dtype: Optional[str] = ...,
                    kv_head_begin: int = ..., kv_head_end: Optional[int] = ...,
                    as_bytes: Literal[False] = ..., wait_s: float = ...) -> np.ndarray: ...

    @overload
    async def fetch(self, model: str, seq_id: int, *, token_begin: int = ...,
                    token_end: Optional[int] = ..., layer_begin: int = ...,
                    layer_end: Optional[int] = ..., dtype: Optional[str] = ...,
                    kv_head_begin: int = ..., kv_head_end: Optional[int] = ...,
                    as_bytes: Literal[True], wait_s: float = ...) -> bytes: ...

    @overload
    async def fetch(self, model: str, seq_id: int, *, token_begin: int = ...,
                    token_end: Optional[int] = ..., layer_begin: int = ...,
                    layer_end: Optional[int] = ..., dtype: Optional[str] = ...,
                    kv_head_begin: int = ..., kv_head_end: Optional[int] = ...,
                    as_bytes: bool, wait_s: float = ...) -> Union[np.ndarray, bytes]: ...

    async def fetch(self, model: str, seq_id: int, *, token_begin: int = 0,
                    token_end: Optional[int] = None, layer_begin: int = 0,
                    layer_end: Optional[int] = None, dtype: Optional[str] = None,
                    kv_head_begin: int = 0, kv_head_end: Optional[int] = None,
                    as_bytes: bool = False, wait_s: float = 0.0) -> Union[np.ndarray, bytes]:
        """Client.fetch, awaited."""
        return await self._call(
            self.client.fetch, model, seq_id, token_begin=token_begin, token_end=token_end,
            layer_begin=layer_begin, layer_end=layer_end, dtype=dtype,
            kv_head_begin=kv_head_begin, kv_head_end=kv_head_end, as_bytes=as_bytes,
            wait_s=wait_s)

    async def fetch_into(self, model: str, seq_id: int, out: Any, *, token_begin: int = 0,
                         token_end: Optional[int] = None, layer_begin: int = 0,
                         layer_end: Optional[int] = None, dtype: Optional[str] = None,
                         kv_head_begin: int = 0, kv_head_end: Optional[int] = None,
                         wait_s: float = 0.0) -> FetchInfo:
        """Client.fetch_into, awaited: `out` is complete when it returns."""
        return await self._call(
            self.client.fetch_into, model, seq_id, out, token_begin=token_begin,
            token_end=token_end, layer_begin=layer_begin, layer_end=layer_end, dtype=dtype,
            kv_head_begin=kv_head_begin, kv_head_end=kv_head_end, wait_s=wait_s)

    async def fetch_tensors(self, model: str, seq_id: int, k: Any, v: Any = None, *,
                            token_begin: int = 0, token_end: Optional[int] = None,
                            layer_begin: int = 0, layer_end: Optional[int] = None,
                            dtype: Optional[str] = None, kv_head_begin: int = 0,
                            kv_head_end: Optional[int] = None, wait_s: float = 0.0) -> None:
        """Client.fetch_tensors, awaited."""
        await self._call(
            self.client.fetch_tensors, model, seq_id, k, v, token_begin=token_begin,
            token_end=token_end, layer_begin=layer_begin, layer_end=layer_end, dtype=dtype,
            kv_head_begin=kv_head_begin, kv_head_end=kv_head_end, wait_s=wait_s)

    async def fork(self, model: str, seq_id: int, *,
                   lease_s: Optional[float] = None) -> SequenceInfo:
        """Client.fork, awaited."""
        return await self._call(self.client.fork, model, seq_id, lease_s=lease_s)

    async def truncate(self, model: str, seq_id: int, num_tokens: int) -> SequenceInfo:
        """Client.truncate, awaited."""
        return await self._call(self.client.truncate, model, seq_id, num_tokens)

    async def free(self, model: str, seq_id: int) -> int:
        """Client.free, awaited."""
        return await self._call(self.client.free, model, seq_id)

    async def renew_lease(self, model: str, seq_id: int) -> SequenceInfo:
        """Client.renew_lease, awaited."""
        return await self._call(self.client.renew_lease, model, seq_id)

    async def get_sequence(self, model: str, seq_id: int) -> SequenceInfo:
        """Client.get_sequence, awaited."""
        return await self._call(self.client.get_sequence, model, seq_id)

    # ---- prefix cache ---------------------------------------------------------------------

    async def match(self, model: str, queries: Sequence[Any], *, cache_salt: str = "",
                    extra_keys: ExtraKeys = ()) -> list[int]:
        """Client.match, awaited."""
        return await self._call(self.client.match, model, queries, cache_salt=cache_salt,
                                extra_keys=extra_keys)

    async def match_tiers(self, model: str, queries: Sequence[Any], *, cache_salt: str = "",
                          extra_keys: ExtraKeys = (),
                          prefetch: bool = False) -> list[dict[str, int]]:
        """Client.match_tiers, awaited."""
        return await self._call(self.client.match_tiers, model, queries, cache_salt=cache_salt,
                                extra_keys=extra_keys, prefetch=prefetch)

    async def fetch_blocks(self, model: str, hashes: Sequence[bytes], *, layer_begin: int = 0,
                           layer_end: Optional[int] = None, dtype: Optional[str] = None,
                           kv_head_begin: int = 0, kv_head_end: Optional[int] = None) -> Blocks:
        """Client.fetch_blocks, awaited."""
        return await self._call(
            self.client.fetch_blocks, model, hashes, layer_begin=layer_begin,
            layer_end=layer_end, dtype=dtype, kv_head_begin=kv_head_begin,
            kv_head_end=kv_head_end)

    async def fetch_blocks_into_runs(self, model: str, hashes: Sequence[bytes],
                                     region: np.ndarray,
                                     run_offsets: Union[Sequence[int], np.ndarray],
                                     run_bytes: int, *, layer_begin: int = 0,
                                     layer_end: Optional[int] = None,
                                     dtype: Optional[str] = None, kv_head_begin: int = 0,
                                     kv_head_end: Optional[int] = None) -> FetchInfo:
        """Client.fetch_blocks_into_runs, awaited."""
        return await self._call(
            self.client.fetch_blocks_into_runs, model, hashes, region, run_offsets, run_bytes,
            layer_begin=layer_begin, layer_end=layer_end, dtype=dtype,
            kv_head_begin=kv_head_begin, kv_head_end=kv_head_end)

    async def append_runs(self, model: str, seq_id: int, region: np.ndarray,
                          run_offsets: Union[Sequence[int], np.ndarray], run_bytes: int, *,
                          num_tokens: int, layer_begin: int = 0,
                          layer_end: Optional[int] = None, dtype: Optional[str] = None,
                          token_ids: Optional[Sequence[int]] = None, kv_head_begin: int = 0,
                          kv_head_end: Optional[int] = None) -> SequenceInfo:
        """Client.append_runs, awaited."""
        return await self._call(
            self.client.append_runs, model, seq_id, region, run_offsets, run_bytes,
            num_tokens=num_tokens, layer_begin=layer_begin, layer_end=layer_end, dtype=dtype,
            token_ids=token_ids, kv_head_begin=kv_head_begin, kv_head_end=kv_head_end)

    async def put_pages_runs(self, model: str, region: np.ndarray,
                             pages: Sequence[tuple[ExtraKeys, Union[Sequence[int], np.ndarray]]],
                             run_bytes: int, *, num_tokens: int, lease_s: Optional[float] = None,
                             parallel: int = 2) -> list[Optional[Error]]:
        """Client.put_pages_runs, awaited."""
        return await self._call(
            self.client.put_pages_runs, model, region, pages, run_bytes, num_tokens=num_tokens,
            lease_s=lease_s, parallel=parallel)

    async def fetch_blocks_into(self, model: str, hashes: Sequence[bytes], out: Any, *,
                                layer_begin: int = 0, layer_end: Optional[int] = None,
                                dtype: Optional[str] = None, kv_head_begin: int = 0,
                                kv_head_end: Optional[int] = None) -> FetchInfo:
        """Client.fetch_blocks_into, awaited."""
        return await self._call(
            self.client.fetch_blocks_into, model, hashes, out, layer_begin=layer_begin,
            layer_end=layer_end, dtype=dtype, kv_head_begin=kv_head_begin,
            kv_head_end=kv_head_end)

    async def pin(self, model: str, *, tokens: Sequence[int] = (),
                  hashes: Sequence[bytes] = (), cache_salt: str = "",
                  extra_keys: ExtraKeys = (), pin: bool = True) -> int:
        """Client.pin, awaited."""
        return await self._call(self.client.pin, model, tokens=tokens, hashes=hashes,
                                cache_salt=cache_salt, extra_keys=extra_keys, pin=pin)

    async def get_prefix_root(self, model: str, cache_salt: str = "") -> PrefixRoot:
        """Client.get_prefix_root, awaited."""
        return await self._call(self.client.get_prefix_root, model, cache_salt)

    async def watch(self, model: str, *, after_sequence: Optional[int] = None,
                    deadline_s: float = 60.0) -> AsyncIterator[Event]:
        """Client.watch as an async iterator (`async for event in client.watch(model)`).

        NOTE: each step waits for the next batch on one of the client's worker threads (up to
        deadline_s), so a watch holds one of them while it waits; aclose waits for it too."""
        events = self.client.watch(model, after_sequence=after_sequence, deadline_s=deadline_s)
        while True:
            event = await self._call(next, events, None)
            if event is None:
                return
            yield event

    # ---- attention ------------------------------------------------------------------------

    async def attend(self, model: str, queries: Sequence[tuple[int, int, Any]], *,
                     softmax_scale: float = 0.0, window: int = 0,
                     sinks: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
        """Client.attend, awaited."""
        return await self._call(self.client.attend, model, queries,
                                softmax_scale=softmax_scale, window=window, sinks=sinks)
