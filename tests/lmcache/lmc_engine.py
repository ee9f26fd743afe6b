"""The real LMCacheEngine (LMCacheEngineBuilder, the local CPU backend, kvbank as a remote
storage plugin) over CPU tensors: CpuKvConnector stands in for the GPU connector, so every step
below the GPU (memory objects, the storage manager, the remote backend, the plugin) is LMCache's
own code. Used by test_lmcache.py, engine_worker.py and bench/lmcache_bench.py.

KV of a prompt: [2 (K/V), layers, tokens, hidden] of DTYPE (MemoryFormat.KV_2LTD), random bits
from a fixed seed, so two processes make the same tensors.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata

PLUGIN = "kvbank"
REMOTE = "RemoteBackend-" + PLUGIN
LAYERS = 4
KV_HEADS = 2
HEAD_SIZE = 16
HIDDEN = KV_HEADS * HEAD_SIZE
DTYPE = torch.bfloat16
CHUNK = 32  # two kvbank blocks of 16 LMCache tokens per chunk


class CpuKvConnector(GPUConnectorInterface):
    """Copies between memory objects and a CPU KV tensor [2, layers, tokens, hidden] given as
    kv_source (store) or kv_dest (retrieve)."""

    def __init__(self, layers: int = LAYERS, hidden: int = HIDDEN, dtype: torch.dtype = DTYPE):
        self.layers = layers
        self.hidden = hidden
        self.dtype = dtype

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        memory_obj.tensor.copy_(kwargs["kv_source"][:, :, start:end, :])

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        kwargs["kv_dest"][:, :, start:end, :] = memory_obj.tensor

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None,
                       **kwargs: Any) -> None:
        for obj, start, end in zip(memory_objs, starts, ends):
            self.to_gpu(obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.layers, num_tokens, self.hidden])

    def get_dtype(self) -> torch.dtype:
        return self.dtype

    def get_format(self) -> MemoryFormat:
        return MemoryFormat.KV_2LTD


def plugin_config(target: str, **opts: Any) -> dict[str, Any]:
    """extra_config of the kvbank plugin: module_path, class_name, target and `opts`."""
    p = f"remote_storage_plugin.{PLUGIN}."
    extra = {p + "module_path": "kvbank.lmcache", p + "class_name": "KvbankConnector",
             p + "target": target}
    extra.update({p + k: v for k, v in opts.items()})
    return extra


def make_engine(instance_id: str, extra_config: dict[str, Any] | None, *,
                chunk: int = CHUNK, unfull: bool = True, layers: int = LAYERS,
                hidden: int = HIDDEN, cpu_gb: float = 0.25,
                plugins: list[str] | None = None,
                remote_url: str | None = None) -> LMCacheEngine:
    """An LMCacheEngine with the local CPU backend and (extra_config given) the kvbank plugin,
    or (remote_url given) LMCache's own connector for that URL, configured by extra_config."""
    if remote_url is not None and plugins is None:
        plugins = []
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=chunk, local_cpu=True, max_local_cpu_size=cpu_gb, remote_serde="naive",
        save_unfull_chunk=unfull, lmcache_instance_id=instance_id, remote_url=remote_url,
        remote_storage_plugins=(plugins if plugins is not None
                                else [PLUGIN] if extra_config is not None else None),
        extra_config=extra_config)
    metadata = LMCacheMetadata(model_name="kvbank-test-model", world_size=1,
                               local_world_size=1, worker_id=0, local_worker_id=0,
                               kv_dtype=DTYPE, kv_shape=(layers, 2, chunk, KV_HEADS,
                                                         hidden // KV_HEADS),
                               chunk_size=chunk)
    engine = LMCacheEngineBuilder.get_or_create(instance_id, config, metadata,
                                                CpuKvConnector(layers, hidden), None, None)
    engine.post_init()
    return engine


def destroy(instance_id: str) -> None:
    LMCacheEngineBuilder.destroy(instance_id)


def backends(engine: LMCacheEngine) -> dict[str, Any]:
    return dict(engine.storage_manager.storage_backends)


def remote(engine: LMCacheEngine) -> Any:
    """The kvbank RemoteBackend; AssertionError when the plugin is not among the backends (a
    plugin that fails to construct is only logged by LMCache)."""
    bs = backends(engine)
    assert REMOTE in bs, f"no {REMOTE} among the engine's backends: {list(bs)}"
    backend = bs[REMOTE]
    assert backend.connection is not None, "the kvbank plugin did not construct"
    return backend


def connector(engine: LMCacheEngine) -> Any:
    """The KvbankConnector inside LMCache's instrumenting wrapper."""
    conn = remote(engine).connection
    return conn.getWrappedConnector() if hasattr(conn, "getWrappedConnector") else conn


def prompt(seed: int, num_tokens: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (num_tokens,), generator=g, dtype=torch.long)


def kv_for(seed: int, num_tokens: int, layers: int = LAYERS,
           hidden: int = HIDDEN) -> torch.Tensor:
    """Random bits (any bf16 pattern, NaNs included) for a prompt's KV."""
    g = torch.Generator().manual_seed(seed + 1_000_003)
    bits = torch.randint(-32768, 32768, (2, layers, num_tokens, hidden), generator=g,
                         dtype=torch.int32).to(torch.int16)
    return bits.view(DTYPE)


def wait_stored(engine: LMCacheEngine, tokens: torch.Tensor, deadline_s: float = 60.0) -> None:
    """Waits until kvbank holds every chunk of `tokens` whole. Remote puts are asynchronous
    (LMCache does not track batched puts in flight), and LMCache 0.5.6 frees its CPU buffers
    before it closes its remote backends: an engine is destroyed only once its puts landed."""
    conn = connector(engine)
    keys = [key for _, _, key in engine.token_database.process_tokens(tokens)]
    end = time.monotonic() + deadline_s
    while conn.batched_contains(keys) < len(keys):
        if time.monotonic() > end:
            raise TimeoutError(f"kvbank holds {conn.batched_contains(keys)} of {len(keys)} "
                               f"chunks after {deadline_s} s")
        time.sleep(0.01)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))
