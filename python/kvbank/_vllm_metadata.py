"""kvbank.vllm's messages and counters: what the scheduler side hands the workers
(KvbankConnectorMetadata of LoadSpec / SaveSpec), the scheduler's store state, and the per-plane
stats the workers report (KvbankConnectorStats, plane_delta). Imported by kvbank.vllm (which
re-exports these names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

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
