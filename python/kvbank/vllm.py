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
  kvbank_token_file  a file holding the bearer token instead (a Secret mounted as a file)
  kvbank_tls_ca      PEM file of the CAs of kvbankd's certificate: TLS (default: plaintext);
                     kvbank_tls_server_name, kvbank_tls_cert / kvbank_tls_key beside it
                     (kvbank/_connector_config.py says each)
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
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

import kvbank

# The layout, the paged copies and the messages live in private modules; their public names are
# kvbank.vllm's too.
from ._connector_config import client_settings
from ._vllm_layout import _DTYPE_BYTES, _KV_DTYPES, model_layout, rank_heads
from ._vllm_metadata import (
    KvbankConnectorMetadata,
    KvbankConnectorStats,
    LoadSpec,
    SaveSpec,
    _StoreState,
    plane_delta,
)
from ._vllm_paged import PagedLayout, SplitKvLayout, probe_block_permutation, split_kv_dim

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "KvbankConnector",
    "KvbankConnectorMetadata",
    "KvbankConnectorStats",
    "LoadSpec",
    "PagedLayout",
    "SaveSpec",
    "SplitKvLayout",
    "model_layout",
    "plane_delta",
    "probe_block_permutation",
    "rank_heads",
    "split_kv_dim",
]

logger = logging.getLogger("kvbank.vllm")


# ---- the connector ----------------------------------------------------------------------------


class KvbankConnector(KVConnectorBase_V1):

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        extra = dict(tc.kv_connector_extra_config or {})
        settings = client_settings(extra, "KvbankConnector: kv_connector_extra_config")
        target = settings["target"]
        self._layout = model_layout(vllm_config, extra.get("kvbank_model"))
        self._model = self._layout["name"]
        self._bs = int(self._layout["block_tokens"])
        self._load = bool(tc.is_kv_consumer)
        self._store = bool(tc.is_kv_producer)
        self._keep_finished = self._store and not self._load  # kv_producer
        lease = extra.get("kvbank_lease_s")
        self._lease_s = float(lease) if lease is not None else None
        self._client = kvbank.Client(target, settings["token"], tls=settings["tls"],
                                     deadline_s=settings["deadline_s"], shm=settings["shm"],
                                     device_plane=settings["device_plane"])
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
