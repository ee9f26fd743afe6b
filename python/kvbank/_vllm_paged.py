"""kvbank.vllm's paged layouts: vLLM's paged KV cache <-> kvbank's payload for one layer, on the
CPU attention backend (PagedLayout, its permutation found by probe_block_permutation) and on the
GPU backends that keep K and V apart (SplitKvLayout, split_kv_dim). Imported by kvbank.vllm
(which re-exports these names)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

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
