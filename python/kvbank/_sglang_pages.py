"""kvbank.sglang's page copies: SGLang's MHA host pool (MHATokenToKVPoolHost) <-> kvbank blocks.

A kvbank block of an MHA model is, per layer, K [kv_heads][block_tokens][head_dim] then V:
[layers][2][kv_heads][tokens][head_dim]. SGLang's host pool keeps K and V apart, in one of four
orders (MHATokenToKVPoolHost.init_kv_buffer):

    layer_first        [2][layers][size][heads][dim]
    page_first         [2][size][layers][heads][dim]
    page_first_direct  [2][pages][layers][page_size][heads][dim]
    page_head          [2][pages][heads][page_size][layers][dim]

Every copy goes through one strided view per page, [2][layers][tokens][heads][dim], of either
side, and one torch copy_ between the two views: no Python loop over layers or heads. A store
appends one block at a time (its payload is the block); a fetch of n blocks answers the dense
payload of their n * page_size tokens, per layer K [heads][n * page_size][dim] then V, so a
fetched page is a strided slice of it. The flat
pages of SGLang's non-zero-copy interface (get_data_page / set_from_flat_data_page) are a page
of the pool in the pool's own order, so the same view reads and writes them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
_KV_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


class PageLayout:
    """One host pool's pages as kvbank blocks. Raises NotImplementedError for a pool it cannot
    map (not MHA, K and V of different widths, a layout or dtype kvbank does not store)."""

    def __init__(self, host: Any):
        layout = getattr(host, "layout", None)
        if layout not in LAYOUTS:
            raise NotImplementedError(f"kvbank.sglang: host pool layout {layout!r}: only "
                                      f"{', '.join(LAYOUTS)} are supported")
        for attr in ("kv_buffer", "head_num", "head_dim", "layer_num", "page_size", "size"):
            if not hasattr(host, attr):
                raise NotImplementedError(f"kvbank.sglang: {type(host).__name__} is not an MHA "
                                          f"host pool (no {attr}); MLA pools are not supported")
        if getattr(host, "v_head_dim", host.head_dim) != host.head_dim:
            raise NotImplementedError("kvbank.sglang: K and V of different head dims")
        dtype = _KV_DTYPES.get(host.dtype)
        if dtype is None:
            raise NotImplementedError(f"kvbank.sglang: host pool dtype {host.dtype}: only "
                                      f"{', '.join(str(d) for d in _KV_DTYPES)}")
        buf = host.kv_buffer
        if buf.device.type != "cpu":
            raise NotImplementedError(f"kvbank.sglang: a host pool on {buf.device}")
        self.host = host
        self.layout = layout
        self.dtype = dtype
        self.torch_dtype = host.dtype
        self.layers = int(host.layer_num)
        self.heads = int(host.head_num)
        self.dim = int(host.head_dim)
        self.tokens = int(host.page_size)
        self.size = int(host.size)
        self.page_elems = 2 * self.layers * self.tokens * self.heads * self.dim
        self.page_bytes = self.page_elems * buf.element_size()
        # Bytes of one (layer, K or V) of a page, and how far a page's runs move a token slot
        # of the pool (the zero-copy mapping's arithmetic, kept as plain ints: it is timed into
        # every load).
        self.run_bytes = self.tokens * self.heads * self.dim * buf.element_size()
        self._slot_shift = (self.run_bytes // self.tokens if layout == "layer_first"
                            else self.layers * self.run_bytes // self.tokens)
        # kvbank's blocks in the zero-copy mapping (token_major_layout) rather than its MHA one.
        self.token_major = False
        self._first_page_runs: np.ndarray | None = None  # page_runs of slot 0

    def model_layout(self, name: str, num_q_heads: int = 0) -> dict[str, Any]:
        """kvbank's layout dict: one block per page, the pool's layers, heads, dim and dtype."""
        q_heads = num_q_heads or self.heads
        kind = "mha" if q_heads == self.heads else ("mqa" if self.heads == 1 else "gqa")
        return {"name": name, "num_layers": self.layers, "num_q_heads": q_heads,
                "num_kv_heads": self.heads, "head_dim": self.dim, "block_tokens": self.tokens,
                "kind": kind, "dtype": self.dtype}

    # ---- the zero-copy mapping (token-major blocks, runs in the host pool) -----------------
    #
    # A model declared with one kv head of heads * dim values a token keeps, per layer, K
    # [tokens][heads * dim] then V: each (layer, K or V) of a page is one run of a host pool in
    # layer_first or page_first_direct order, so pages move between kvbankd and the host pool
    # with no copy on this side (RegionSlice runs).
    RUN_LAYOUTS = ("layer_first", "page_first_direct")

    def token_major_layout(self, name: str, num_q_heads: int = 0) -> dict[str, Any]:
        """kvbank's layout dict of the zero-copy mapping (see above)."""
        return {"name": name, "num_layers": self.layers, "num_q_heads": num_q_heads or 1,
                "num_kv_heads": 1, "head_dim": self.heads * self.dim,
                "block_tokens": self.tokens, "kind": "mqa", "dtype": self.dtype}

    def _runs_of_slot0(self) -> np.ndarray:
        """Run offsets of the page at slot 0, (layer, K or V) in a FetchBlocks' order."""
        if self._first_page_runs is None:
            t, rb = self.tokens, self.run_bytes
            layer = np.arange(self.layers, dtype=np.uint64)[:, None]
            kv = np.arange(2, dtype=np.uint64)[None, :]
            if self.layout == "layer_first":  # [2][layers][size][heads][dim]
                at = (kv * self.layers + layer) * self.size * (rb // t)
            else:  # page_first_direct: [2][pages][layers][tokens][heads][dim]
                at = (kv * (self.size // t) * self.layers + layer) * rb
            self._first_page_runs = at.reshape(-1)
        return self._first_page_runs

    def _shift(self, start: int) -> int:
        """How far the page at token slot `start` (a page start) lies from slot 0's, in bytes:
        layer_first keeps a page's runs `start` token rows further, page_first_direct
        start / page_size pages further."""
        return start * self._slot_shift

    def fetch_runs(self, starts: list[int], base: int = 0) -> np.ndarray:
        """Run offsets (uint64, from byte `base` of the host buffer) of a FetchBlocks of these
        pages (in this order) under the zero-copy mapping: its payload is, per layer, K of every
        page then V of every page, so run (layer, kv, page) = slot 0's run (layer, kv) + the
        page's shift: one outer sum (few array calls: this is timed into every load)."""
        shifts = np.array(starts, dtype=np.uint64)
        shifts *= np.uint64(self._slot_shift)
        shifts += np.uint64(base)
        return np.add.outer(self._runs_of_slot0(), shifts).reshape(-1)

    def page_runs(self, start: int, base: int = 0) -> np.ndarray:
        """Run offsets of one page's block (an append's payload): slot 0's, moved."""
        return self._runs_of_slot0() + np.uint64(base + self._shift(start))

    def page_starts(self, host_indices: torch.Tensor, n: int) -> list[int]:
        """page_start of pages 0 .. n-1 at once, each -1 where it is not a whole, aligned page
        inside the pool. One tolist() and plain ints: the call is timed into every load, and
        right after a large transfer the caches are cold, where a few numpy or torch calls
        per page cost more than the arithmetic."""
        t, size = self.tokens, self.size
        # Only each page's first and last slot are read, as slices of a numpy view of the
        # tensor (cold, right after a 64 MiB load: 25 us against 50 for a torch reshape and a
        # tolist() of every slot).
        a = host_indices.detach().cpu().numpy().reshape(-1)
        whole = min(n, a.size // t)
        out = [-1] * n
        firsts, lasts = a[:whole * t:t].tolist(), a[t - 1:whole * t:t].tolist()
        for i in range(whole):
            start = firsts[i]
            if 0 <= start and start % t == 0 and start + t <= size and lasts[i] == start + t - 1:
                out[i] = start
        return out

    def host_page(self, start: int) -> torch.Tensor:
        """The page at token slot `start` of the pool, as a [2][layers][tokens][heads][dim]
        view of its buffer."""
        buf, t = self.host.kv_buffer, self.tokens
        if self.layout == "layer_first":
            return buf[:, :, start:start + t]
        if self.layout == "page_first":
            return buf[:, start:start + t].permute(0, 2, 1, 3, 4)
        page = buf[:, start // t]
        if self.layout == "page_first_direct":
            return page
        return page.permute(0, 3, 2, 1, 4)  # page_head: [2][heads][tokens][layers][dim]

    def flat_page(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat page in the pool's own order (get_data_page, get_dummy_flat_data_page) as a
        [2][layers][tokens][heads][dim] view."""
        L, t, h, d = self.layers, self.tokens, self.heads, self.dim
        if self.layout == "layer_first":
            return flat.view(2, L, t, h, d)
        if self.layout == "page_first":
            return flat.view(2, t, L, h, d).permute(0, 2, 1, 3, 4)
        if self.layout == "page_first_direct":
            return flat.view(2, L, t, h, d)
        return flat.view(2, h, t, L, d).permute(0, 3, 2, 1, 4)

    def block(self, buf: torch.Tensor, j: int) -> torch.Tensor:
        """Block j of a staging buffer of single-block payloads (flat, the pool's dtype, one
        append's payload after the other) as a [2][layers][tokens][heads][dim] view of
        kvbank's [layers][2][heads][tokens][dim]."""
        e = self.page_elems
        flat = buf[j * e:(j + 1) * e]
        if self.token_major:
            return flat.view(self.layers, 2, self.tokens, self.heads, self.dim).transpose(0, 1)
        return flat.view(self.layers, 2, self.heads, self.tokens, self.dim).permute(1, 0, 3, 2, 4)

    def fetched(self, buf: torch.Tensor, n: int, j: int) -> torch.Tensor:
        """Block j of a fetch of n blocks (FetchBlocks' payload: per layer K [heads][n * tokens]
        [dim] then V, the blocks' tokens one after the other) as a [2][layers][tokens][heads]
        [dim] view."""
        t = self.tokens
        if self.token_major:
            payload = buf[:n * self.page_elems].view(self.layers, 2, n * t, self.heads, self.dim)
            return payload[:, :, j * t:(j + 1) * t].transpose(0, 1)
        payload = buf[:n * self.page_elems].view(self.layers, 2, self.heads, n * t, self.dim)
        return payload[:, :, :, j * t:(j + 1) * t].permute(1, 0, 3, 2, 4)
