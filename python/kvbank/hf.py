"""transformers caches <-> kvbank sequences.

A `transformers` model's attention cache (a `DynamicCache`, or the legacy tuple of per-layer
(key, value) tensors) holds, per layer, keys and values shaped [batch, kv_heads, tokens,
head_dim]: for batch 1 exactly kvbank's payload rows, so a cache moves with one append and comes
back with one fetch, without a Python loop per token or block.

    import kvbank, kvbank.hf
    client = kvbank.Client(target)
    client.ensure_model(kvbank.hf.layout_for(model.config, "tiny", storage="bf16"))
    seq = client.create_sequence("tiny", prompt=ids)
    out = model(input_ids, use_cache=True)
    kvbank.hf.store(client, "tiny", seq.id, out.past_key_values, token_ids=ids)
    cache = kvbank.hf.load(client, "tiny", seq.id, dtype=torch.bfloat16)   # a DynamicCache

torch and transformers are imported when used; the rest of kvbank does not need them.
"""

from collections.abc import Sequence
from typing import Any, Optional

from ._client import Client
from ._errors import InvalidArgumentError
from ._types import SequenceInfo

_TORCH_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def layout_for(config: Any, name: str, *, storage: str = "bf16", input_dtype: Optional[str] = None,
               block_tokens: int = 16) -> dict:
    """A kvbank layout (for Client.ensure_model) of a transformers model config: its layers, q
    and kv heads and head_dim; every layer stored as `storage` (fp16 / bf16 / fp32, or int8 /
    fp8_e4m3 / fp8_e5m2 with the payload arriving as `input_dtype`, default bf16)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layout = {"name": name, "num_layers": config.num_hidden_layers, "num_q_heads": heads,
              "num_kv_heads": kv_heads, "head_dim": head_dim, "head_dim_v": head_dim,
              "block_tokens": block_tokens, "kind": "gqa" if kv_heads != heads else "mha",
              "dtype": storage}
    if storage in ("int8", "fp8_e4m3", "fp8_e5m2"):
        layout["input_dtype"] = input_dtype or "bf16"
    elif input_dtype is not None:
        layout["input_dtype"] = input_dtype
    return layout


def cache_layers(past: Any) -> list[tuple[Any, Any]]:
    """(keys, values) of each layer of a DynamicCache (any transformers version that has one)
    or of the legacy tuple form."""
    if hasattr(past, "layers"):  # transformers >= 4.56: DynamicCache.layers[i].keys / .values
        return [(layer.keys, layer.values) for layer in past.layers]
    if hasattr(past, "key_cache"):  # older DynamicCache
        return list(zip(past.key_cache, past.value_cache))
    return [(k, v) for k, v in past]


def _wire_dtype(tensor: Any) -> str:
    name = str(tensor.dtype).replace("torch.", "")
    if name not in _TORCH_DTYPES:
        raise InvalidArgumentError(f"cache tensors of {name}: kvbank takes float16, bfloat16 or "
                                   "float32")
    return _TORCH_DTYPES[name]


def store(client: Client, model: str, seq_id: int, past: Any, *, start: int = 0,
          token_ids: Optional[Sequence[int]] = None) -> SequenceInfo:
    """Appends tokens [start, cache length) of `past` (batch 1) to sequence `seq_id`: every layer
    in one append, in the cache's dtype (the server quantizes when the model stores int8 / fp8).
    token_ids: the ids of those tokens (full blocks are then published for prefix reuse)."""
    import torch

    layers = cache_layers(past)
    if not layers:
        raise InvalidArgumentError("the cache has no layers")
    k0 = layers[0][0]
    if k0.dim() != 4 or k0.shape[0] != 1:
        raise InvalidArgumentError(f"cache keys are {tuple(k0.shape)}; kvbank.hf stores batch 1 "
                                   "[1, kv_heads, tokens, head_dim]")
    n = k0.shape[2] - start
    if n <= 0:
        raise InvalidArgumentError(f"nothing to store: the cache holds {k0.shape[2]} tokens, "
                                   f"start is {start}")
    # [layers][kv_heads][tokens][head_dim], contiguous on the CPU: the payload's K and V rows.
    k = torch.stack([lk[0, :, start:, :] for lk, _ in layers]).to("cpu").contiguous()
    v = torch.stack([lv[0, :, start:, :] for _, lv in layers]).to("cpu").contiguous()
    ids = list(token_ids) if token_ids is not None else []
    if ids and len(ids) != n:
        raise InvalidArgumentError(f"token_ids has {len(ids)} ids for {n} tokens")
    return client.append(model, seq_id, k=k, v=v, num_tokens=n, dtype=_wire_dtype(k),
                         token_ids=ids)


def load(client: Client, model: str, seq_id: int, *, dtype: Any = None,
         token_end: Optional[int] = None, legacy: bool = False, device: Any = "cpu") -> Any:
    """Tokens [0, token_end) of sequence `seq_id` as a DynamicCache (legacy: the tuple form),
    batch 1, in `dtype` (default bfloat16), on `device`."""
    import torch
    from transformers import DynamicCache

    dtype = dtype or torch.bfloat16
    wire = _TORCH_DTYPES[str(dtype).replace("torch.", "")]
    info = client.get_model(model)
    layout = info.layout
    seq = client.get_sequence(model, seq_id)
    n = seq.length if token_end is None else token_end
    shape = (layout["num_layers"], layout["num_kv_heads"], n, layout["head_dim"])
    k = torch.empty(shape, dtype=dtype)
    v = torch.empty((shape[0], shape[1], n, layout.get("head_dim_v") or layout["head_dim"]),
                    dtype=dtype)
    client.fetch_tensors(model, seq_id, k, v, token_end=n, dtype=wire)
    pairs = [(k[i].unsqueeze(0).to(device), v[i].unsqueeze(0).to(device))
             for i in range(shape[0])]
    if legacy:
        return tuple(pairs)
    cache = DynamicCache()
    for i, (lk, lv) in enumerate(pairs):
        cache.update(lk, lv, i)
    return cache
