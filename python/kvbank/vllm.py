"""kvbank.vllm.KvbankConnector: a vLLM (v1) KV connector over kvbank's prefix cache.

    --kv-transfer-config '{"kv_connector": "KvbankConnector",
                           "kv_connector_module_path": "kvbank.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kvbank_target": "127.0.0.1:50051"}}'

Roles:
  kv_producer  stores each prompt's full blocks (a prefill instance); the kvbank sequence is kept
               when the request finishes (its lease frees it) and named in kv_transfer_params.
  kv_consumer  loads the longest cached run of a prompt's full blocks (a decode instance).
  kv_both      both: prefix reuse across requests and instances; the sequence is freed when the
               request finishes, its published blocks stay in kvbank's prefix cache.

How: the scheduler side asks kvbank's Match (no side effects) how many leading tokens of a prompt
are cached, at most the prompt's full blocks short of its last token (vLLM computes at least one
token), and hands the workers the block hashes (kvbank.prefix_hashes over the root of kvbank's
GetPrefixRoot) with vLLM's block ids. The worker fetches them with FetchBlocks layer by layer on
threads from start_load_kv, and scatters each layer into the paged cache in wait_for_layer_load.
To store, the scheduler creates a kvbank sequence with the prompt's token ids (so kvbank attaches
the blocks it already holds and publishes the new full blocks by hash); the worker gathers each
layer's new full blocks out of the paged cache in save_kv_layer and appends them, layer by layer,
on a background thread; wait_for_save waits for the appends.

The kvbank model is registered from vLLM's model config: layers, kv heads, head_dim, block size
= vLLM's block_size, the model's dtype (bf16, fp16 or fp32). Only full blocks of the prompt move:
kvbank shares full blocks only, and generated tokens are not stored.

kv_connector_extra_config:
  kvbank_target      "host:port" of kvbankd (required)
  kvbank_token       bearer token (default: none)
  kvbank_model       the kvbank model name (default: "vllm/" + the served model name)
  kvbank_pool_bytes  pool bytes when the model is first registered (default 0: the server's)
  kvbank_lease_s     lease of the sequences a producer keeps (default: the server's)
  kvbank_deadline_s  deadline of unary calls (default 30)
  kvbank_fetch_threads  threads fetching layers (default 4)
  kvbank_shm         use kvbankd's same-host shared-memory plane when it serves one (default
                     true; the connector logs the plane it uses)
  kvbank_device_plane  how payloads of a GPU cache move (kvbank.Client's device_plane): "auto"
                     (default: CUDA IPC with a kvbankd on this host whose pools are on a GPU,
                     else NCCL for appends where kvbankd forms communicators, else through host
                     memory), "cuda_ipc", "nccl" or "host"

Supported: decoder attention layers on vLLM's CPU attention backend (the paged layout is
discovered by running the backend's own cache-write op on a probe block, so its packed AMX layout
is handled), any tensor-parallel size (each rank appends and fetches its own kv heads; a head
that ranks replicate is stored by the first of them; prefill and decode instances may use
different sizes), one pipeline-parallel rank, KV cache dtype = model dtype, prompts given as token
ids (no multimodal inputs). Anything else raises at start, naming what is unsupported.
GPU attention backends whose cache keeps K and V apart along a dimension of size 2
(FlashAttention, FlashInfer, Triton: SplitKvLayout) are handled too: payloads are gathered and
scattered on the GPU and move by the client's device plane (kvbank_device_plane), named in the
log. That path has not run on
a GPU yet: its layout is tested on CPU tensors, its planes in the gpu test suite.
Blocks evicted between the look-up and the fetch are reported through
get_block_ids_with_load_errors (vLLM's kv_load_failure_policy decides: recompute or fail).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

import kvbank

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvbank.vllm")

_KV_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


# ---- the layout of kvbank's model, from vLLM's config ------------------------------------------


def _default_model_name(vllm_config: VllmConfig) -> str:
    mc = vllm_config.model_config
    served = mc.served_model_name
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    name = "vllm/" + str(served or mc.model)
    if len(name) > 128:  # kvbank's limit: keep the end of the path
        name = "vllm/..." + name[-120:]
    return name


def model_layout(vllm_config: VllmConfig, name: str | None = None) -> dict[str, Any]:
    """kvbank's layout dict of the model vLLM serves: layers, every kv head (whatever the tensor
    parallel size: the ranks share one kvbank model), head_dim, vLLM's block size as
    block_tokens, the model's dtype. Raises NotImplementedError for what the connector does not
    support (MLA, pipeline parallelism, a KV cache dtype other than the model's)."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if mc.use_mla:
        raise NotImplementedError("KvbankConnector: MLA models are not supported")
    if pc.pipeline_parallel_size != 1:
        raise NotImplementedError(
            f"KvbankConnector: pipeline_parallel_size {pc.pipeline_parallel_size}: only one "
            "pipeline stage is supported")
    if cc.cache_dtype not in ("auto", None):
        raise NotImplementedError(f"KvbankConnector: kv cache dtype {cc.cache_dtype!r}: only the "
                                  "model's dtype ('auto') is supported")
    dtype = _KV_DTYPES.get(mc.dtype)
    if dtype is None:
        known = ", ".join(str(d) for d in _KV_DTYPES)
        raise NotImplementedError(f"KvbankConnector: model dtype {mc.dtype} is not one of {known}")
    q_heads = mc.get_num_attention_heads(pc) * pc.tensor_parallel_size
    kv_heads = mc.get_total_num_kv_heads()
    kind = "mha" if q_heads == kv_heads else ("mqa" if kv_heads == 1 else "gqa")
    return {
        "name": name or _default_model_name(vllm_config),
        "num_layers": mc.get_num_layers(pc),
        "num_q_heads": q_heads,
        "num_kv_heads": kv_heads,
        "head_dim": mc.get_head_size(),
        "block_tokens": cc.block_size,
        "kind": kind,
        "dtype": dtype,
    }


def rank_heads(total_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int, bool]:
    """The kv heads [begin, end) that tensor-parallel rank `tp_rank` of `tp_size` holds, as vLLM
    splits them (QKVParallelLinear), and whether the rank stores them: with fewer kv heads than
    ranks each head is replicated on tp_size / total_kv_heads ranks, and the first of them
    stores it (the others would append the same rows)."""
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise NotImplementedError(f"KvbankConnector: {total_kv_heads} kv heads over "
                                      f"{tp_size} ranks")
        local = total_kv_heads // tp_size
        return tp_rank * local, (tp_rank + 1) * local, True
    if tp_size % total_kv_heads:
        raise NotImplementedError(f"KvbankConnector: {total_kv_heads} kv heads over {tp_size} "
                                  "ranks")
    replicas = tp_size // total_kv_heads
    head = tp_rank // replicas
    return head, head + 1, tp_rank % replicas == 0


# ---- vLLM's paged layout <-> kvbank's payload layout ---------------------------------------------


def probe_block_permutation(isa: str, block_size: int, head_dim: int,
                            dtype: torch.dtype) -> torch.Tensor:
    """Where vLLM's CPU attention backend keeps each K / V element inside one (block, kv head)
    of its paged cache [num_blocks][kv_heads][block_size][2 * head_dim].

    Returns perm (int64, 2 * block_size * head_dim): element p of a (block, head) slice holds
    element perm[p] of the plain slice K [block_size][head_dim] then V [block_size][head_dim].
    Found by running the backend's own cache write (cpu_attn_reshape_and_cache with the layers'
    ISA) on one probe block whose K and V encode their token and dim in their bit patterns: the
    AMX ISA packs K in pairs of dims and V in pairs of tokens, the vector ISAs do not."""
    from vllm import _custom_ops as ops

    if block_size > 1024 or head_dim > 1024:
        raise NotImplementedError(f"KvbankConnector: block_size {block_size} / head_dim "
                                  f"{head_dim} too large for the layout probe")
    # Elements whose bit patterns are 0x4000.. + i (K) and 0x5000.. + i (V), i < 1024: finite
    # normal numbers, all different, so a copy of any kind keeps them apart.
    bits = {2: (torch.int16, 0), 4: (torch.int32, 16)}.get(dtype.itemsize)
    if bits is None:
        raise NotImplementedError(f"KvbankConnector: cache dtype {dtype}")
    int_dtype, shift = bits
    k_base, v_base = 0x4000 << shift, 0x5000 << shift

    def run(index_of: torch.Tensor) -> torch.Tensor:  # index_of: [block_size][head_dim]
        cache = torch.zeros(1, 1, block_size, 2 * head_dim, dtype=dtype)
        k_cache, v_cache = cache.view(1, 1, 2 * block_size, head_dim).chunk(2, dim=2)
        key = (index_of + k_base).to(int_dtype).view(dtype).reshape(block_size, 1, head_dim)
        value = (index_of + v_base).to(int_dtype).view(dtype).reshape(block_size, 1, head_dim)
        ops.cpu_attn_reshape_and_cache(key.contiguous(), value.contiguous(), k_cache, v_cache,
                                       torch.arange(block_size, dtype=torch.int64), isa)
        return cache.view(int_dtype).reshape(-1).to(torch.int64)

    tokens = torch.arange(block_size, dtype=torch.int64)[:, None].expand(block_size, head_dim)
    dims = torch.arange(head_dim, dtype=torch.int64)[None, :].expand(block_size, head_dim)
    by_token, by_dim = run(tokens), run(dims)
    is_v = by_token >= v_base
    token = by_token - torch.where(is_v, v_base, k_base)
    dim = by_dim - torch.where(is_v, v_base, k_base)
    ok = ((by_token >= k_base) & (token >= 0) & (token < block_size) & (dim >= 0)
          & (dim < head_dim) & ((by_dim >= v_base) == is_v))
    perm = is_v.to(torch.int64) * (block_size * head_dim) + token * head_dim + dim
    if not bool(ok.all()) or torch.unique(perm).numel() != perm.numel():
        raise NotImplementedError(
            f"KvbankConnector: the CPU attention backend's cache layout (ISA {isa!r}) is not a "
            "permutation of K and V within a block")
    return perm


class PagedLayout:
    """Moves one layer's blocks between vLLM's paged cache [num_blocks][kv_heads][block_size]
    [2 * head_dim] (each (block, head) slice a permutation of K [block][dim] then V) and kvbank's
    payload for one layer: K [kv_heads][tokens][head_dim] then V [kv_heads][tokens][head_dim].
    Whole blocks at once with index_select / index_copy_: no Python loop over blocks."""

    def __init__(self, perm: torch.Tensor, num_kv_heads: int, block_size: int, head_dim: int):
        self.perm = perm  # paged element p holds plain element perm[p]
        self.inv = torch.empty_like(perm)
        self.inv[perm] = torch.arange(perm.numel(), dtype=perm.dtype)
        self.identity = bool(torch.equal(perm, torch.arange(perm.numel())))
        self.h, self.bs, self.d = num_kv_heads, block_size, head_dim

    def gather(self, kv_layer: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """The payload of `block_ids` (in order): a contiguous [2][kv_heads][n*bs][head_dim]."""
        n = block_ids.numel()
        blocks = kv_layer.index_select(0, block_ids).reshape(n, self.h, 2 * self.bs * self.d)
        if not self.identity:
            blocks = blocks.index_select(2, self.inv)
        plain = blocks.reshape(n, self.h, 2, self.bs, self.d)
        return plain.permute(2, 1, 0, 3, 4).reshape(2, self.h, n * self.bs, self.d).contiguous()

    def scatter(self, kv_layer: torch.Tensor, block_ids: torch.Tensor,
                payload: torch.Tensor) -> None:
        """Writes a payload [2][kv_heads][n*bs][head_dim] (any shape of that size) into
        `block_ids`."""
        n = block_ids.numel()
        plain = payload.reshape(2, self.h, n, self.bs, self.d).permute(2, 1, 0, 3, 4)
        blocks = plain.reshape(n, self.h, 2 * self.bs * self.d)
        if not self.identity:
            blocks = blocks.index_select(2, self.perm)
        kv_layer.index_copy_(0, block_ids, blocks.reshape(n, *kv_layer.shape[1:]))


class SplitKvLayout:
    """Moves one layer's blocks between the paged cache of vLLM's GPU attention backends, K and
    V apart along a dimension of size 2 (`kv_dim`): FlashAttention's [2][num_blocks][block_size]
    [kv_heads][head_dim] (kv_dim 0), FlashInfer's and Triton's [num_blocks][2][block_size]
    [kv_heads][head_dim] (kv_dim 1); the tensor may be a strided view (a backend's HND stride
    order). Same interface as PagedLayout; torch ops only, so it runs on the cache's device and
    the payload stays there (the client then picks CUDA IPC, NCCL or host memory for it)."""

    identity = True

    def __init__(self, kv_dim: int, num_kv_heads: int, block_size: int, head_dim: int):
        if kv_dim not in (0, 1):
            raise ValueError("kv_dim must be 0 or 1")
        self.kv_dim = kv_dim
        self.h, self.bs, self.d = num_kv_heads, block_size, head_dim

    def _part(self, kv_layer: torch.Tensor, i: int) -> torch.Tensor:
        """K (i = 0) or V as a [num_blocks][block_size][kv_heads][head_dim] view."""
        return kv_layer.select(self.kv_dim, i)

    def gather(self, kv_layer: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """The payload of `block_ids` (in order): a contiguous [2][kv_heads][n*bs][head_dim]."""
        n = block_ids.numel()
        return torch.stack([
            self._part(kv_layer, i).index_select(0, block_ids).permute(2, 0, 1, 3)
            .reshape(self.h, n * self.bs, self.d) for i in (0, 1)]).contiguous()

    def scatter(self, kv_layer: torch.Tensor, block_ids: torch.Tensor,
                payload: torch.Tensor) -> None:
        """Writes a payload [2][kv_heads][n*bs][head_dim] (any shape of that size) into
        `block_ids`."""
        n = block_ids.numel()
        plain = payload.reshape(2, self.h, n, self.bs, self.d)
        for i in (0, 1):
            self._part(kv_layer, i).index_copy_(0, block_ids, plain[i].permute(1, 2, 0, 3))


def split_kv_dim(shape: Sequence[int], block_size: int, num_kv_heads: int, head_dim: int,
                 backend: Any = None) -> int:
    """Where a GPU backend's 5-D cache keeps K apart from V (SplitKvLayout's kv_dim), from the
    backend's get_kv_cache_shape where it has one (a probe with 3 blocks tells the two apart
    however many blocks the cache has), else from the shape. Raises NotImplementedError for any
    other layout."""
    tail = (block_size, num_kv_heads, head_dim)
    if backend is not None and hasattr(backend, "get_kv_cache_shape"):
        probe = tuple(backend.get_kv_cache_shape(3, block_size, num_kv_heads, head_dim))
        for kv_dim, want in ((0, (2, 3) + tail), (1, (3, 2) + tail)):
            if probe == want and tuple(shape[2:]) == tail and shape[kv_dim] == 2:
                return kv_dim
        name = getattr(backend, "__name__", backend)
        raise NotImplementedError(f"KvbankConnector: {name}'s cache shape {probe} is neither "
                                  "[2][blocks][block_size][kv_heads][head_dim] nor "
                                  "[blocks][2][...]")
    if len(shape) == 5 and tuple(shape[2:]) == tail:
        fits = [d for d in (0, 1) if shape[d] == 2]
        if len(fits) == 1:
            return fits[0]
    raise NotImplementedError(f"KvbankConnector: a GPU cache of shape {tuple(shape)}: expected "
                              f"[2][blocks]{list(tail)} or [blocks][2]{list(tail)}")


# ---- metadata: scheduler -> workers -----------------------------------------------------------


@dataclass
class LoadSpec:
    """Load the cached blocks `hashes` into vLLM's `block_ids` (same length, in order)."""
    req_id: str
    hashes: list[bytes]
    block_ids: list[int]


@dataclass
class SaveSpec:
    """Append tokens [token_begin, token_end) (whole blocks, vLLM's `block_ids`) of every layer
    to kvbank sequence `seq_id`."""
    req_id: str
    seq_id: int
    token_begin: int
    token_end: int
    block_ids: list[int]


@dataclass
class KvbankConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _StoreState:
    """A request whose prompt the scheduler side stores."""
    seq_id: int
    prompt_len: int
    stored: int  # tokens kvbank holds in every layer (cached at create + appended)


# ---- stats: which plane moved the bytes --------------------------------------------------------


@dataclass
class KvbankConnectorStats(KVConnectorStats):
    """Payload calls and bytes per data plane (the names of kvbank.Client.plane_stats: shm,
    shm_staged, grpc, cuda_ipc, nccl, cuda_staged) over an interval, summed over the workers;
    vLLM's stat loggers show reduce()'s summary."""

    def reset(self) -> None:
        self.data: dict[str, dict[str, int]] = {}

    def aggregate(self, other: KVConnectorStats) -> KvbankConnectorStats:
        for plane, c in (other.data or {}).items():
            mine = self.data.setdefault(plane, {"calls": 0, "bytes": 0})
            mine["calls"] += int(c.get("calls", 0))
            mine["bytes"] += int(c.get("bytes", 0))
        return self

    def reduce(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for plane, c in sorted(self.data.items()):
            if c.get("calls"):
                out[f"{plane} calls"] = int(c["calls"])
                out[f"{plane} MiB"] = round(c["bytes"] / (1 << 20), 1)
        return out

    def is_empty(self) -> bool:
        return not any(c.get("calls") for c in self.data.values())


def plane_delta(now: dict[str, dict[str, int]],
                before: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Calls and bytes per plane between two plane_stats() snapshots (planes that moved any)."""
    out = {}
    for plane, c in now.items():
        b = before.get(plane, {})
        d = {k: int(c.get(k, 0)) - int(b.get(k, 0)) for k in ("calls", "bytes")}
        if d["calls"]:
            out[plane] = d
    return out


# ---- the connector ----------------------------------------------------------------------------


class KvbankConnector(KVConnectorBase_V1):

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        extra = dict(tc.kv_connector_extra_config or {})
        target = extra.get("kvbank_target")
        if not target:
            raise ValueError("KvbankConnector: kv_connector_extra_config.kvbank_target "
                             "(\"host:port\" of kvbankd) is required")
        self._layout = model_layout(vllm_config, extra.get("kvbank_model"))
        self._model = self._layout["name"]
        self._bs = int(self._layout["block_tokens"])
        self._load = bool(tc.is_kv_consumer)
        self._store = bool(tc.is_kv_producer)
        self._keep_finished = self._store and not self._load  # kv_producer
        lease = extra.get("kvbank_lease_s")
        self._lease_s = float(lease) if lease is not None else None
        shm = extra.get("kvbank_shm", True)
        if isinstance(shm, str):
            shm = shm.lower() not in ("0", "false", "no", "off")
        self._client = kvbank.Client(target, extra.get("kvbank_token") or None,
                                     deadline_s=float(extra.get("kvbank_deadline_s", 30.0)),
                                     shm=bool(shm),
                                     device_plane=str(extra.get("kvbank_device_plane", "auto")))
        info = self._client.ensure_model(self._layout,
                                         pool_bytes=int(extra.get("kvbank_pool_bytes", 0)))
        logger.info("KvbankConnector (%s, %s): kvbank model %r at %s, %d-token blocks, "
                    "%d blocks, data plane %s", role.name, tc.kv_role, self._model, target,
                    self._bs, info.num_blocks, self._client.data_plane)

        # Scheduler side.
        self._roots: dict[str, tuple[bytes, str]] = {}  # cache salt -> (root, algorithm)
        self._matched: dict[str, tuple[int, int]] = {}  # req -> (local tokens, cached tokens)
        self._pending_loads: list[LoadSpec] = []
        self._requests: dict[str, Request] = {}
        self._stores: dict[str, _StoreState] = {}

        # Worker side.
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._paged: Any | None = None  # PagedLayout (CPU) or SplitKvLayout (GPU)
        self._device = torch.device("cpu")  # where the caches, and so the payloads, live
        self._fetch_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._append_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._layer_loads: dict[str, concurrent.futures.Future[Any]] = {}
        self._load_specs: list[LoadSpec] = []
        self._appends: list[concurrent.futures.Future[Any]] = []
        self._failed_block_ids: set[int] = set()
        self._broken_seqs: set[int] = set()
        self._planes_reported: dict[str, dict[str, int]] = {}  # plane_stats() at the last report
        self._lock = threading.Lock()
        # This rank's kv heads, and whether it appends them (rank_heads).
        self._heads: tuple[int, int] = (0, int(self._layout["num_kv_heads"]))
        self._stores_heads = True
        if role == KVConnectorRole.WORKER:
            tp = vllm_config.parallel_config.tensor_parallel_size
            if tp > 1:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

                rank = get_tensor_model_parallel_rank()
                h0, h1, self._stores_heads = rank_heads(int(self._layout["num_kv_heads"]), tp,
                                                        rank)
                self._heads = (h0, h1)
                logger.info("KvbankConnector: tensor-parallel rank %d of %d: kv heads [%d, %d)"
                            "%s", rank, tp, h0, h1, "" if self._stores_heads else
                            " (replicated: another rank stores them)")
            self._fetch_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=int(extra.get("kvbank_fetch_threads", 4)),
                thread_name_prefix="kvbank-fetch")
            # One thread: a kvbank sequence takes one append at a time, in layer order.
            self._append_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="kvbank-append")

    # ---- helpers (both sides) -----------------------------------------------------------------

    @staticmethod
    def _keys(request: Request) -> tuple[str, list[tuple[str, str]]]:
        salt = getattr(request, "cache_salt", None) or ""
        lora = getattr(request, "lora_request", None)
        keys = [("lora", lora.lora_name)] if lora is not None else []
        return salt, keys

    @staticmethod
    def _cacheable(request: Request) -> bool:
        return bool(request.prompt_token_ids) and not getattr(request, "mm_features", None)

    def _root(self, salt: str) -> tuple[bytes, str]:
        if salt not in self._roots:
            r = self._client.get_prefix_root(self._model, salt)
            if r.block_tokens != self._bs:
                raise RuntimeError(f"kvbank model {self._model!r} has {r.block_tokens}-token "
                                   f"blocks, vLLM {self._bs}")
            self._roots[salt] = (r.root, r.algorithm)
        return self._roots[salt]

    # ---- scheduler side -----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._load or not self._cacheable(request):
            return 0, False
        prompt = request.prompt_token_ids
        # At most the full blocks before the last prompt token: vLLM computes at least one.
        limit = (len(prompt) - 1) // self._bs * self._bs
        if limit <= num_computed_tokens:
            return 0, False
        salt, keys = self._keys(request)
        try:
            self._root(salt)  # update_state_after_alloc hashes the prompt with it
            hits = self._client.match(self._model, [{"tokens": prompt[:limit], "cache_salt": salt,
                                                      "extra_keys": keys}])[0]
        except kvbank.Error as e:  # kvbank unreachable: vLLM computes the prompt itself
            logger.warning("KvbankConnector: Match failed, computing the prompt: %s", e)
            return 0, False
        hits = min(int(hits), limit)
        if hits <= num_computed_tokens:
            return 0, False
        self._matched[request.request_id] = (num_computed_tokens, hits)
        return hits - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._requests[request.request_id] = request
        matched = self._matched.pop(request.request_id, None)
        if num_external_tokens <= 0 or matched is None:
            return
        _, hits = matched
        begin = hits - num_external_tokens
        if begin % self._bs or hits % self._bs:
            raise RuntimeError(f"KvbankConnector: a load of tokens [{begin}, {hits}) is not "
                               "block-aligned")
        salt, keys = self._keys(request)
        root, algorithm = self._root(salt)
        hashes = kvbank.prefix_hashes(root, request.prompt_token_ids[:hits], self._bs, keys,
                                      algorithm=algorithm)
        block_ids = blocks.get_block_ids()[0]
        b0, b1 = begin // self._bs, hits // self._bs
        self._pending_loads.append(LoadSpec(request.request_id, hashes[b0:b1],
                                            list(block_ids[b0:b1])))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvbankConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if not self._store:
            return meta
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed[req_id] = cached.num_computed_tokens[i]
        for req_id, num_computed in computed.items():
            state = self._stores.get(req_id)
            if state is None:
                request = self._requests.get(req_id)
                if request is None or not self._cacheable(request):
                    continue
                state = self._start_store(request)
                if state is None:
                    continue
            if state.stored >= state.prompt_len // self._bs * self._bs:
                continue
            done = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            end = min(done, state.prompt_len) // self._bs * self._bs
            if end <= state.stored:
                continue
            block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
            meta.saves.append(SaveSpec(req_id, state.seq_id, state.stored, end,
                                       list(block_ids[state.stored // self._bs:end // self._bs])))
            state.stored = end
        return meta

    def _start_store(self, request: Request) -> _StoreState | None:
        salt, keys = self._keys(request)
        try:
            seq = self._client.create_sequence(self._model, prompt=request.prompt_token_ids,
                                               lease_s=self._lease_s, cache_salt=salt,
                                               extra_keys=keys)
        except kvbank.Error as e:
            logger.warning("KvbankConnector: cannot store request %s: %s", request.request_id, e)
            return None
        state = _StoreState(seq.id, len(request.prompt_token_ids), seq.cached_tokens)
        self._stores[request.request_id] = state
        return state

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self._matched.pop(req_id, None)
        state = self._stores.pop(req_id, None)
        if state is None:
            return False, None
        # The step's appends finished in wait_for_save: vLLM may free its blocks now.
        if self._keep_finished:
            # A prefill instance keeps the sequence (its lease frees it), so its blocks stay
            # referenced for the decode instance; the parameters name it.
            return False, {"kvbank_model": self._model, "kvbank_sequence_id": state.seq_id,
                           "kvbank_stored_tokens": state.stored}
        try:
            self._client.free(self._model, state.seq_id)  # the published blocks stay cached
        except kvbank.Error as e:
            logger.warning("KvbankConnector: free of sequence %d: %s", state.seq_id, e)
        return False, None

    # ---- worker side --------------------------------------------------------------------------

    def _index_layers(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keeps each layer's cache under its model layer index; raises unless the layers
        cover the model's once each."""
        from vllm.model_executor.models.utils import extract_layer_index

        num_layers = self._layout["num_layers"]
        for name, kv in kv_caches.items():
            index = extract_layer_index(name)
            if not 0 <= index < num_layers:
                raise NotImplementedError(f"KvbankConnector: layer {name} has index {index} of "
                                          f"{num_layers}")
            self._layer_index[name] = index
            self._kv_caches[name] = kv
        if sorted(self._layer_index.values()) != list(range(num_layers)):
            raise NotImplementedError(f"KvbankConnector: attention layers "
                                      f"{sorted(self._layer_index.values())} do not cover the "
                                      f"model's {num_layers} layers once each")

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        h, d = self._heads[1] - self._heads[0], self._layout["head_dim"]
        expected = (h, self._bs, 2 * d)
        fwd = self._vllm_config.compilation_config.static_forward_context
        isa = None
        dtype = None
        devices = {kv.device for kv in kv_caches.values()}
        if len(devices) == 1 and next(iter(devices)).type == "cuda":
            return self._register_gpu_caches(kv_caches, h, d)
        for name, kv in kv_caches.items():
            if kv.device.type != "cpu":
                on = sorted(str(x) for x in devices)
                raise NotImplementedError(
                    f"KvbankConnector: layer {name}'s cache is on {kv.device} (caches on {on}); "
                    "supported: vLLM's CPU backend, or GPU backends on one CUDA device")
            if kv.dim() != 4 or tuple(kv.shape[1:]) != expected or not kv.is_contiguous():
                raise NotImplementedError(
                    f"KvbankConnector: layer {name}'s cache has shape {tuple(kv.shape)} "
                    f"(contiguous: {kv.is_contiguous()}); expected a contiguous "
                    f"[num_blocks]{list(expected)} (the CPU attention backend's layout, kernel "
                    "block size = block_size)")
            layer_isa = getattr(fwd.get(name), "isa", None)
            isa = isa or layer_isa
            dtype = dtype or kv.dtype
        self._index_layers(kv_caches)
        if isa is None:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
            isa = _get_attn_isa(dtype, self._bs, d)
        if _KV_DTYPES.get(dtype) != self._layout["dtype"]:
            raise NotImplementedError(f"KvbankConnector: cache dtype {dtype} vs kvbank's "
                                      f"{self._layout['dtype']}")
        self._paged = PagedLayout(probe_block_permutation(isa, self._bs, d, dtype), h, self._bs, d)
        logger.info("KvbankConnector: %d layers registered, CPU attention ISA %r (%s layout)",
                    len(kv_caches), isa, "plain" if self._paged.identity else "packed")

    def _register_gpu_caches(self, kv_caches: dict[str, torch.Tensor], h: int, d: int) -> None:
        """register_kv_caches for vLLM's GPU attention backends (SplitKvLayout). The payloads
        then live on the GPU and the client moves them by the plane it picks (logged)."""
        fwd = self._vllm_config.compilation_config.static_forward_context
        kv_dim = None
        for name, kv in kv_caches.items():
            layer = fwd.get(name)
            backend = getattr(layer, "attn_backend", None)
            if backend is None and hasattr(layer, "get_attn_backend"):
                backend = layer.get_attn_backend()
            dim = split_kv_dim(tuple(kv.shape), self._bs, h, d, backend)
            if kv_dim is not None and dim != kv_dim:
                raise NotImplementedError("KvbankConnector: layers with different cache layouts")
            kv_dim = dim
            if _KV_DTYPES.get(kv.dtype) != self._layout["dtype"]:
                raise NotImplementedError(f"KvbankConnector: cache dtype {kv.dtype} vs kvbank's "
                                          f"{self._layout['dtype']}")
        self._index_layers(kv_caches)
        assert kv_dim is not None
        self._paged = SplitKvLayout(kv_dim, h, self._bs, d)
        self._device = next(iter(kv_caches.values())).device
        logger.info("KvbankConnector: %d layers registered on %s (K/V split on dim %d); "
                    "payloads move by %s", len(kv_caches), self._device, kv_dim,
                    self._client.device_plane_for(self._device.index or 0))

    def _fetch_layer(self, layer: int,
                     loads: Sequence[LoadSpec]) -> list[tuple[int, torch.Tensor] | kvbank.Error]:
        """Per load: its layer's payload (the leading cached run of its blocks) as a uint8
        tensor, or the error. On the CPU the payload lands in a buffer of this thread's (a
        shared-memory region's staging copy on the same host, else gRPC's); on a GPU in a
        device buffer, by CUDA IPC where the client can (else through host memory)."""
        out: list[tuple[int, torch.Tensor] | kvbank.Error] = []
        token_bytes = 2 * (self._heads[1] - self._heads[0]) * self._layout["head_dim"] * \
            _DTYPE_BYTES[self._layout["dtype"]]
        for spec in loads:
            buf = torch.empty(len(spec.hashes) * self._bs * token_bytes, dtype=torch.uint8,
                              device=self._device)
            try:
                info = self._client.fetch_blocks_into(self._model, spec.hashes, buf,
                                                      layer_begin=layer, layer_end=layer + 1,
                                                      kv_head_begin=self._heads[0],
                                                      kv_head_end=self._heads[1])
                out.append((info.num_tokens, buf[:info.payload_bytes]))
            except kvbank.Error as e:  # NOT_FOUND: evicted since the look-up
                out.append(e)
        return out

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvbankConnectorMetadata)
        if not meta.loads:
            return
        self._load_specs = list(meta.loads)
        assert self._fetch_pool is not None  # made with the worker side
        for name, _ in sorted(self._layer_index.items(), key=lambda kv: kv[1]):
            self._layer_loads[name] = self._fetch_pool.submit(self._fetch_layer,
                                                              self._layer_index[name],
                                                              self._load_specs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        fut = self._layer_loads.pop(layer_name, None)
        if fut is None:
            return
        self._finish_layer_load(layer_name, fut.result())

    def _finish_layer_load(self, layer_name: str,
                           results: list[tuple[int, torch.Tensor] | kvbank.Error]) -> None:
        kv = self._kv_caches[layer_name]
        assert self._paged is not None  # register_kv_caches ran
        for spec, got in zip(self._load_specs, results):
            n = 0
            if isinstance(got, tuple):
                # The leading run of the hashes that is still cached: n <= len(spec.hashes).
                n = got[0] // self._bs
                if n:
                    self._paged.scatter(kv, torch.tensor(spec.block_ids[:n], dtype=torch.int64,
                                                         device=kv.device),
                                        got[1].view(kv.dtype))
                    if kv.device.type == "cuda":
                        # The fetch thread allocated the buffer; the scatter reads it on this
                        # stream: keep the allocator from reusing it before that is done.
                        got[1].record_stream(torch.cuda.current_stream(kv.device))
            if n < len(spec.block_ids):
                logger.warning("KvbankConnector: request %s: %d of %d blocks of layer %s "
                               "loaded (%s)", spec.req_id, n, len(spec.block_ids), layer_name,
                               got if not isinstance(got, tuple) else "evicted")
                self._failed_block_ids.update(spec.block_ids[n:])

    def _drain_loads(self) -> None:
        """Finishes loads whose layer the forward did not wait for."""
        for name in list(self._layer_loads):
            self._finish_layer_load(name, self._layer_loads.pop(name).result())

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def _append(self, spec: SaveSpec, layer: int, payload: torch.Tensor,
                gathered: Any | None = None) -> None:
        if spec.seq_id in self._broken_seqs:
            return
        if gathered is not None:
            gathered.synchronize()  # the gather ran on the forward's stream; the copy reads it
        try:
            self._client.append(self._model, spec.seq_id, payload,
                                num_tokens=spec.token_end - spec.token_begin, layer_begin=layer,
                                layer_end=layer + 1, dtype=self._layout["dtype"],
                                kv_head_begin=self._heads[0], kv_head_end=self._heads[1])
        except kvbank.Error as e:
            # Later appends of this sequence would start at the wrong position: stop storing it.
            with self._lock:
                self._broken_seqs.add(spec.seq_id)
            logger.warning("KvbankConnector: append of layer %d, tokens [%d, %d) of request %s "
                           "failed; not storing it further: %s", layer, spec.token_begin,
                           spec.token_end, spec.req_id, e)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvbankConnectorMetadata)
        if not meta.saves or not self._stores_heads:
            return
        layer = self._layer_index[layer_name]
        assert self._paged is not None and self._append_pool is not None  # the worker side
        for spec in meta.saves:
            # The gather copies the blocks out now; the append streams the copy meanwhile.
            payload = self._paged.gather(kv_layer, torch.tensor(spec.block_ids,
                                                                dtype=torch.int64,
                                                                device=kv_layer.device))
            gathered = None
            if payload.device.type == "cuda":
                gathered = torch.cuda.Event()
                gathered.record(torch.cuda.current_stream(payload.device))
            self._appends.append(self._append_pool.submit(self._append, spec, layer, payload,
                                                          gathered))

    def wait_for_save(self) -> None:
        self._drain_loads()
        appends, self._appends = self._appends, []
        for fut in appends:
            fut.result()

    # ---- stats ------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KvbankConnectorStats | None:
        """The planes this worker's payloads took since the last call (None: none moved)."""
        now = self._client.plane_stats()
        delta = plane_delta(now, self._planes_reported)
        self._planes_reported = now
        return KvbankConnectorStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(
            cls, data: dict[str, Any] | None = None) -> KvbankConnectorStats | None:
        return KvbankConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        for pool in (self._fetch_pool, self._append_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._client.close()
