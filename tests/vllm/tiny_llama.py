"""A small Llama with random weights, written locally with transformers (no download): the model
the vLLM tests and bench/vllm_ttft.py serve. No tokenizer: vLLM runs it on token ids
(skip_tokenizer_init). head_dim = hidden / heads must be one vLLM's CPU attention supports
(32, 64, 80, 96, 112, 128, ...)."""

import json
import os


def make_tiny_llama(path, *, hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256,
                    vocab=512, max_positions=512, init_range=0.3, seed=0):
    """Writes config.json and the safetensors weights under `path` (once: an existing model
    with the same settings is kept) and returns `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                    intermediate=intermediate, vocab=vocab, max_positions=max_positions,
                    init_range=init_range, seed=seed)
    stamp = os.path.join(path, "kvbank-tiny-llama.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == settings:
                return path
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         intermediate_size=intermediate, vocab_size=vocab,
                         max_position_embeddings=max_positions, initializer_range=init_range,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    with open(stamp, "w") as f:
        json.dump(settings, f)
    return path


# vLLM computes in bf16, so its greedy token may differ from float32's where two logits nearly
# tie, and how near depends on its CPU kernels: gaps up to 0.25 were measured with the AMX
# kernels (Intel Xeon), 0.64 with the vector ones (AMD EPYC). A wrong or misplaced KV shows as
# tokens several logits below the best (the logits' spread is about 3), at most positions.
MAX_GAP = 1.0


def assert_model_tokens(gaps):
    """The continuation is the model's (transformers_gaps' answer): the first token is the
    greedy choice, at least three quarters are, and none lies more than MAX_GAP below."""
    assert gaps[0] == 0, gaps
    assert max(gaps) <= MAX_GAP, gaps
    assert sum(g == 0 for g in gaps) >= 3 * len(gaps) // 4, gaps


def transformers_gaps(path, prompt, tokens):
    """Teacher-forced check of a continuation with transformers in float32 (the reference):
    for each token of `tokens`, how far its logit lies below the best one at that position
    (0: the token is transformers' greedy choice)."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(tokens)])).logits[0].float()
    logits = logits[len(prompt) - 1:-1]
    best = logits.max(dim=-1).values
    return [float(best[i] - logits[i, t]) for i, t in enumerate(tokens)]
