"""Runs one vLLM instance (the real vllm package, on the CPU) in this process and writes what it
generated as JSON: one process per instance, as vLLM keeps its KV connector in a process-wide
global.

    instance.py SPEC.json OUT.json

SPEC: model (a directory), max_model_len, max_tokens, prefix_caching (vLLM's own, default
true), batches (lists of token-id prompts; each batch is one LLM.generate call, in order), and
for the connector: role (kv_producer / kv_consumer / kv_both; absent: no connector), target,
kvbank_model (optional), extra (more kv_connector_extra_config); llm_args: more LLM(...)
keyword arguments (max_num_batched_tokens, tensor_parallel_size, ...).
OUT: startup_s, batches: per prompt its output token ids, num_cached_tokens (vLLM's: local
prefix cache + external), kv_transfer_params, and seconds (that generate call's wall time).
"""

import json
import logging
import os
import sys
import time


def main(spec_path, out_path):
    with open(spec_path) as f:
        spec = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # The connector's own log lines (its model, its data plane) go to this instance's log.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    logging.getLogger("kvbank").addHandler(handler)
    logging.getLogger("kvbank").setLevel(logging.INFO)
    tp = int((spec.get("llm_args") or {}).get("tensor_parallel_size", 1))
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # vLLM's CPU workers bind their OpenMP threads one NUMA node per rank by default; on a
        # machine with one node, give each rank its share of this process's CPUs instead.
        cpus = sorted(os.sched_getaffinity(0))
        per = len(cpus) // tp
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            ",".join(str(c) for c in cpus[r * per:(r + 1) * per]) for r in range(tp)
        ) if per else "nobind"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = dict(spec.get("llm_args") or {})
    if spec.get("role"):
        extra = {"kvbank_target": spec["target"]}
        if spec.get("kvbank_model"):
            extra["kvbank_model"] = spec["kvbank_model"]
        extra.update(spec.get("extra", {}))
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvbankConnector", kv_role=spec["role"],
            kv_connector_module_path="kvbank.vllm", kv_connector_extra_config=extra)
    start = time.monotonic()
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=spec.get("max_model_len", 256), enforce_eager=True, block_size=32,
              enable_prefix_caching=spec.get("prefix_caching", True), seed=0, **kwargs)
    startup = time.monotonic() - start
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True,
                            detokenize=False)
    batches = []
    for batch in spec["batches"]:
        t0 = time.monotonic()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        seconds = time.monotonic() - t0
        batches.append([{"tokens": list(o.outputs[0].token_ids),
                         "num_cached_tokens": o.num_cached_tokens or 0,
                         "kv_transfer_params": o.kv_transfer_params,
                         "seconds": seconds} for o in outs])
    with open(out_path, "w") as f:
        json.dump({"startup_s": startup, "batches": batches}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
