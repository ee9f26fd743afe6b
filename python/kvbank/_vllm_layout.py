"""kvbank.vllm's model layout: kvbank's layout dict from vLLM's config, and the kv heads each
tensor-parallel rank holds and stores. Imported by kvbank.vllm (which re-exports these names)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vllm.config import VllmConfig

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
