"""The SDK's result types: what Client, Fleet and AsyncClient return.

The extension builds these instances itself (python/src/convert.cc looks the classes up here
and calls them with keyword arguments, one per field), so a field is named in this file and in
its converter only; the wrappers return what the extension returns.
"""

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from . import _kvbank

Layout = dict[str, Any]
"""A model layout as a dict: name, num_layers, num_q_heads, num_kv_heads, head_dim, head_dim_v,
block_tokens, kind ("mha", "gqa", "mqa", "mla"), kv_lora_rank, rope_dim, input_dtype,
layer_dtypes (one per layer), or "dtype" for every layer at once."""


@dataclass(frozen=True)
class ModelInfo:
    name: str
    layout: Layout
    fingerprint: str
    block_bytes: int
    num_blocks: int
    pool_bytes: int
    payload_bytes_per_token: int
    device: str
    max_sequences: int
    max_tokens_per_sequence: int
    created: bool

    def payload_bytes(self, num_tokens: int, layer_begin: int = 0,
                      layer_end: Optional[int] = None, dtype: Optional[str] = None) -> int:
        """Bytes of the dense payload of layers [layer_begin, layer_end) x num_tokens in `dtype`
        (default: what the server sends when none is named): the size of a fetch_into buffer."""
        return _kvbank.payload_bytes(self.layout, num_tokens, layer_begin, layer_end, dtype)


@dataclass(frozen=True)
class SequenceInfo:
    model: str
    id: int
    length: int
    layer_lengths: list[int]
    num_blocks: int
    cached_tokens: int
    lease_ttl_s: float  # 0: no lease
    compactions: int


@dataclass(frozen=True)
class FetchInfo:
    """What a fetch_into wrote: payload_bytes bytes at the start of the buffer."""
    token_begin: int
    num_tokens: int
    layer_begin: int
    layer_end: int
    kv_head_begin: int  # the kv heads the payload holds: [kv_head_begin, kv_head_end)
    kv_head_end: int
    dtype: str
    payload_bytes: int


@dataclass(frozen=True)
class PrefixRoot:
    root: bytes
    algorithm: str
    block_tokens: int
    layout_fingerprint: str
    tenant: str


@dataclass(frozen=True)
class Event:
    """A KV event: type "stored", "removed" or "all_cleared"."""
    type: str
    sequence: int
    tenant: str
    hashes: list[bytes]
    parent: Optional[bytes]
    token_ids: list[int]
    block_size: int
    lora: str


@dataclass(frozen=True)
class Blocks:
    """Cached full blocks from fetch_blocks: `data` in the payload layout."""
    info: FetchInfo
    data: np.ndarray = field(repr=False)


@dataclass(frozen=True)
class DeviceRegion:
    """A CUDA buffer kvbankd opened through CUDA IPC (Client.register_device_region)."""
    region_id: int
    size: int
    device: int  # the CUDA device kvbankd opened it on


@dataclass(frozen=True)
class FleetSequence:
    """A sequence and the replica that holds it (a plain value: copy it, keep it, pass it)."""
    replica: str
    model: str
    id: int
    info: SequenceInfo


@dataclass(frozen=True)
class Replica:
    name: str      # kvbankd's --replica-name (its host name by default), or its address
    address: str   # host:port
    healthy: bool  # takes new placements
    reason: str    # why not healthy (the last error)
    load: int = 0  # live sequences as the fleet knows them (last report + its creates - frees)


@dataclass(frozen=True)
class Route:
    """Where Fleet.create_sequence would place a prompt now, and why (Fleet.route)."""
    replica: str             # where it goes
    home: str                # the key's first choice among healthy replicas
    reason: str              # "home", "over_load_bound" (home at the bound) or "by_key"
    key: bytes               # the placement key (32 bytes)
    load: int                # live sequences on replica
    home_load: int
    load_bound: int          # home takes placements while its load is below this
    mean_load: float         # over healthy replicas, this placement counted
    prompt_tokens: int
    cached_tokens: int       # at replica now
    copy_from: str           # where a prefix copy would come from ("" when none would run)
    copy_from_cached_tokens: int  # tokens of the prompt copy_from holds now
    copy_tokens: int         # the tokens the copy would bring to replica
    cost: int                # tokens left to prefill at replica: prompt - cached - copied
