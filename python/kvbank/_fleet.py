"""kvbank.Fleet: several kvbankd replicas behind one object (kvbank::Fleet, kvbank/fleet.h).

Sequences are placed by rendezvous hashing of their first full block's prefix hash, so prompts
that share a prefix meet on one replica; every call on a FleetSequence goes to the replica that
holds it, and fails with UnavailableError naming the replica and the sequence when that replica
is gone (never silently elsewhere).
"""

from collections.abc import Sequence
from typing import Any, Callable, Optional

from . import _kvbank
from ._client import (
    ExtraKeys,
    _buffer,
    _extra_keys,
    _num_tokens_of,
    normalize_layout,
    numpy_dtype,
)
from ._errors import InvalidArgumentError
from ._types import (
    Blocks,
    Event,
    FetchInfo,
    FleetSequence,
    Layout,
    ModelInfo,
    PrefixRoot,
    Replica,
    Route,
    SequenceInfo,
)


def _query(q: Any, cache_salt: str, extra_keys: ExtraKeys) -> tuple:
    if isinstance(q, dict):
        return (list(q.get("tokens", ())), [bytes(h) for h in q.get("hashes", ())],
                q.get("cache_salt", cache_salt), _extra_keys(q.get("extra_keys", extra_keys)))
    q = list(q)
    if q and isinstance(q[0], (bytes, bytearray)):
        return ([], [bytes(h) for h in q], cache_salt, _extra_keys(extra_keys))
    return (q, [], cache_salt, _extra_keys(extra_keys))


def _fetch_args(token_begin: int = 0, token_end: Optional[int] = None, layer_begin: int = 0,
                layer_end: Optional[int] = None, dtype: Optional[str] = None,
                kv_head_begin: int = 0, kv_head_end: Optional[int] = None,
                wait_s: float = 0.0) -> dict[str, Any]:
    return dict(token_begin=token_begin, token_end=token_end, layer_begin=layer_begin,
                layer_end=layer_end, dtype=dtype, kv_head_begin=kv_head_begin,
                kv_head_end=kv_head_end, wait_s=wait_s)


class Fleet:
    """kvbankd replicas behind one object. Thread-safe: share one per process.

        fleet = kvbank.Fleet("dns:///kvbank-headless.ns:50051")   # or "h1:50051,h2:50051"
        fleet.ensure_model(preset="llama-3.1-8b", name="llama")    # on every replica
        seq = fleet.create_sequence("llama", prompt=token_ids)     # placed by its prefix
        fleet.append(seq, payload, num_tokens=len(token_ids))      # on seq.replica

    The target's name is resolved again every resolve_interval_s (every A / AAAA record is a
    replica); every replica's health is checked every probe_interval_s. A replica that fails or
    drains takes no new placements (its keys go to their next choice) until it is SERVING again.

    Bounded load: a sequence goes to its key's first choice unless that replica holds
    (1 + load_epsilon) x the mean live sequences or more; then to the least-loaded replica.
    Before the create, the prefix blocks another replica holds for the prompt are copied where
    it lands (copy_prefixes): from where this fleet last placed the prompt's longest prefix (an
    earlier turn), else from the key's first choice; once per (prefix, replica).
    load_epsilon=None: placement by key only.
    """

    def __init__(self, target: str, token: Optional[str] = None, *, deadline_s: float = 30.0,
                 stream_deadline_s: float = 600.0, probe_interval_s: float = 1.0,
                 resolve_interval_s: float = 10.0, probe_deadline_s: float = 0.5,
                 load_epsilon: Optional[float] = 0.15, copy_prefixes: bool = True) -> None:
        self._f = _kvbank.Fleet(target, token or "", deadline_s, stream_deadline_s,
                                probe_interval_s, resolve_interval_s, probe_deadline_s,
                                load_epsilon, copy_prefixes)

    # ---- membership -----------------------------------------------------------------------

    def replicas(self) -> list[Replica]:
        """Every replica that joined, sorted by name."""
        return list(self._f.replicas())

    def refresh(self) -> None:
        """Resolves the target and checks every replica now (the fleet does it periodically)."""
        self._f.refresh()

    def placement_key(self, model: str, prompt: Sequence[int], *, cache_salt: str = "",
                      extra_keys: ExtraKeys = ()) -> bytes:
        """The 32-byte key a prompt is placed by: its first full block's prefix hash (a shorter
        prompt: the hash of its partial block)."""
        return self._f.placement_key(model, list(prompt), cache_salt, _extra_keys(extra_keys))

    def route(self, model: str, prompt: Any, *, cache_salt: str = "",
              extra_keys: ExtraKeys = ()) -> Route:
        """Where create_sequence would place `prompt` (token ids, or block hashes) now, and why:
        the replica, the key's first choice, their loads and the bound, the cached tokens there
        and at the replica a prefix copy would come from (one Match each), the tokens the copy
        would bring and the cost (tokens left to prefill there). For an engine-side router."""
        return self._f.route(model, _query(prompt, cache_salt, extra_keys))

    def stats(self) -> dict[str, int]:
        """What this fleet did since it connected: placements (home / moved by the load
        bound), prefix copies (copies, blocks, bytes, joined, skipped, failures)."""
        return dict(self._f.stats())

    def replica_for(self, key: bytes) -> str:
        """The healthy replica a new placement of `key` goes to now."""
        return self._f.replica_for(bytes(key))

    # ---- models ---------------------------------------------------------------------------

    def ensure_model(self, layout: Optional[Layout] = None, *, preset: Optional[str] = None,
                     name: Optional[str] = None, storage: Optional[str] = None,
                     pool_bytes: int = 0, block_tokens: int = 0) -> ModelInfo:
        """Registers the model on every replica (as Client.ensure_model), and on every replica
        that joins or recovers before it takes placements. pool_bytes: per replica."""
        if (layout is None) == (preset is None):
            raise InvalidArgumentError("give either a layout or a preset")
        if layout is None:
            if not name:
                raise InvalidArgumentError("a preset model needs a name")
            return self._f.ensure_preset(name, preset, storage, pool_bytes, block_tokens)
        d = dict(layout)
        if name is not None:
            d["name"] = name
        if storage is not None or block_tokens:
            raise InvalidArgumentError("storage and block_tokens go into the layout dict")
        return self._f.ensure_model(normalize_layout(d), pool_bytes)

    # ---- sequences ------------------------------------------------------------------------

    def create_sequence(self, model: str, prompt: Sequence[int] = (), *,
                        lease_s: Optional[float] = None, cache_salt: str = "",
                        extra_keys: ExtraKeys = (), priority: Optional[int] = None,
                        retention: str = "full", window: int = 0, sinks: int = 0,
                        budget: int = 0) -> FleetSequence:
        """A new sequence on the prompt's replica (as Client.create_sequence)."""
        kinds = {"full": 0, "sliding_window": 1, "heavy_hitter": 2}
        if retention not in kinds:
            raise InvalidArgumentError(f"retention must be one of {', '.join(kinds)}")
        return self._f.create_sequence(model, lease_s, list(prompt), cache_salt,
                                       _extra_keys(extra_keys), priority, kinds[retention],
                                       window, sinks, budget)

    def append(self, seq: FleetSequence, payload: Any = None, *, k: Any = None, v: Any = None,
               num_tokens: Optional[int] = None, layer_begin: int = 0,
               layer_end: Optional[int] = None, dtype: Optional[str] = None,
               token_ids: Optional[Sequence[int]] = None, kv_head_begin: int = 0,
               kv_head_end: Optional[int] = None) -> SequenceInfo:
        """As Client.append, on seq's replica."""
        if (payload is None) == (k is None):
            raise InvalidArgumentError("give either a payload or k (and v)")
        if k is not None and num_tokens is None:
            num_tokens = _num_tokens_of(k)
        if num_tokens is None:
            raise InvalidArgumentError("num_tokens is needed with a payload")
        args = dict(num_tokens=num_tokens, layer_begin=layer_begin, layer_end=layer_end,
                    dtype=dtype, token_ids=list(token_ids) if token_ids is not None else [],
                    kv_head_begin=kv_head_begin, kv_head_end=kv_head_end)
        if k is not None:
            # v None with k: an MLA model's K only, through the typed path.
            vb = _buffer(v, False) if v is not None else b""
            return self._f.append(seq.replica, seq.model, seq.id, _buffer(k, False), vb, args)
        return self._f.append(seq.replica, seq.model, seq.id, _buffer(payload, False), None,
                              args)

    def fetch(self, seq: FleetSequence, *, as_bytes: bool = False, **kwargs: Any) -> Any:
        """As Client.fetch (same keyword arguments), from seq's replica."""
        meta, data = self._f.fetch(seq.replica, seq.model, seq.id, _fetch_args(**kwargs))
        if as_bytes:
            return data.tobytes()
        return data.view(numpy_dtype(meta.dtype))

    def fetch_into(self, seq: FleetSequence, out: Any, **kwargs: Any) -> FetchInfo:
        """As Client.fetch_into, from seq's replica."""
        return self._f.fetch_into(seq.replica, seq.model, seq.id, _buffer(out, True),
                                  _fetch_args(**kwargs))

    def fork(self, seq: FleetSequence, *, lease_s: Optional[float] = None) -> FleetSequence:
        """A fork on seq's replica (it shares seq's blocks)."""
        return self._f.fork(seq.replica, seq.model, seq.id, lease_s)

    def truncate(self, seq: FleetSequence, num_tokens: int) -> SequenceInfo:
        return self._f.truncate(seq.replica, seq.model, seq.id, num_tokens)

    def free(self, seq: FleetSequence) -> int:
        """Frees the sequence; returns how many block references it dropped."""
        return self._f.free(seq.replica, seq.model, seq.id)

    def renew_lease(self, seq: FleetSequence) -> SequenceInfo:
        return self._f.renew_lease(seq.replica, seq.model, seq.id)

    def get_sequence(self, seq: FleetSequence) -> SequenceInfo:
        return self._f.get_sequence(seq.replica, seq.model, seq.id)

    # ---- prefix cache ---------------------------------------------------------------------

    def match(self, model: str, queries: Sequence[Any], *, cache_salt: str = "",
              extra_keys: ExtraKeys = ()) -> list[int]:
        """As Client.match; each query asked of the replica its prompt would be placed on."""
        return self._f.match(model, [_query(q, cache_salt, extra_keys) for q in queries])

    def get_prefix_root(self, model: str, cache_salt: str = "") -> PrefixRoot:
        """GetPrefixRoot, answered by the replica the root is placed on (every replica agrees:
        the fleet checks it)."""
        return self._f.prefix_root(model, cache_salt, True)

    def prefix_root(self, model: str, cache_salt: str = "") -> PrefixRoot:
        """The root computed here from what every replica agreed on (no call per salt)."""
        return self._f.prefix_root(model, cache_salt, False)

    def fetch_blocks(self, model: str, hashes: Sequence[bytes], **kwargs: Any) -> Blocks:
        """As Client.fetch_blocks, from the replica the first hash is placed on."""
        meta, data = self._f.fetch_blocks(model, [bytes(h) for h in hashes], _fetch_args(**kwargs))
        return Blocks(meta, data.view(numpy_dtype(meta.dtype)))

    def pin(self, model: str, *, tokens: Sequence[int] = (), hashes: Sequence[bytes] = (),
            cache_salt: str = "", extra_keys: ExtraKeys = (), pin: bool = True) -> int:
        q = (list(tokens), [bytes(h) for h in hashes], cache_salt, _extra_keys(extra_keys))
        return self._f.pin(model, q, pin)

    # ---- KV events ------------------------------------------------------------------------

    def watch(self, model: str, on_batch: Callable[[str, list[Event]], bool], *,
              from_now: bool = False, deadline_s: float = 60.0) -> bool:
        """Merged KV events of every replica: on_batch(replica, events) for each batch, one call
        at a time, until it returns False (then True is returned) or deadline_s passes (False).
        An "all_cleared" event with sequence 0 for a replica means: forget what you indexed of
        it (its stream broke or it left the fleet); its events start again from now when it is
        back. A KV-aware router keys its index by (replica, block hash)."""
        return self._f.watch(model, from_now, deadline_s,
                             lambda replica, events: bool(on_batch(replica, events)))
