"""kvbank.hf against the real kvbankd and a real (tiny, random) transformers Llama: a generation
whose cache is stored in kvbank, dropped, loaded back and continued gives exactly the tokens of an
uninterrupted run with bf16 and fp16 storage; with int8 storage the logit error is reported.
Needs torch and transformers (the vLLM venv has both: scripts/setup-vllm-venv.sh)."""

import numpy as np
import pytest

import kvbank

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import kvbank.hf  # noqa: E402  (after the skips: it imports torch when used)

GENERATE = 12


def tiny_llama(dtype):
    torch.manual_seed(2026)
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=2, vocab_size=512,
                                      max_position_embeddings=256)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def greedy(model, past, last_token, position, steps):
    """`steps` greedy tokens after `last_token` at `position`, continuing `past`; and the first
    step's logits."""
    tokens, first_logits = [], None
    token = last_token
    for i in range(steps):
        out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True,
                    cache_position=torch.tensor([position + i]))
        past = out.past_key_values
        if first_logits is None:
            first_logits = out.logits[0, -1].float()
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
    return tokens, first_logits


@pytest.mark.parametrize("storage,torch_dtype", [("bf16", "bfloat16"), ("fp16", "float16"),
                                                 ("int8", "bfloat16")])
def test_generation_continues_from_a_cache_stored_in_kvbank(client, model_name, storage,
                                                            torch_dtype):
    dtype = getattr(torch, torch_dtype)
    model = tiny_llama(dtype)
    layout = kvbank.hf.layout_for(model.config, model_name, storage=storage,
                                  input_dtype=kvbank.hf._TORCH_DTYPES[torch_dtype])
    client.ensure_model(layout)
    prompt = np.random.default_rng(11).integers(0, 512, size=40).tolist()
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        first = int(out.logits[0, -1].argmax())
        # The prompt's cache goes to kvbank (before generating: the cache grows in place).
        seq = client.create_sequence(model_name, prompt=prompt)
        info = kvbank.hf.store(client, model_name, seq.id, out.past_key_values, token_ids=prompt)
        assert info.length == len(prompt)
        want, want_logits = greedy(model, out.past_key_values, first, len(prompt), GENERATE)
        del out
        # Generation resumes from what kvbank gives back.
        cache = kvbank.hf.load(client, model_name, seq.id, dtype=dtype)
        assert cache.get_seq_length() == len(prompt)
        got, got_logits = greedy(model, cache, first, len(prompt), GENERATE)
    error = float((got_logits - want_logits).abs().max())
    scale = float(want_logits.abs().max())
    print(f"[hf] {storage} storage, {torch_dtype} cache: first-step logit error {error:.3g} "
          f"(logits up to {scale:.3g}); tokens {'equal' if got == want else 'differ'}")
    if storage in ("bf16", "fp16"):
        assert error == 0.0
        assert got == want
    else:
        assert error < 0.05 * scale  # int8: per token-head scale and zero point
    client.free(model_name, seq.id)


def test_legacy_tuple_form_and_a_store_from_the_middle(client, model_name):
    model = tiny_llama(torch.bfloat16)
    client.ensure_model(kvbank.hf.layout_for(model.config, model_name))
    prompt = list(range(100, 130))
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
    layers = kvbank.hf.cache_layers(out.past_key_values)
    seq = client.create_sequence(model_name)
    kvbank.hf.store(client, model_name, seq.id, out.past_key_values)
    legacy = kvbank.hf.load(client, model_name, seq.id, legacy=True)
    assert len(legacy) == len(layers)
    for (k, v), (lk, lv) in zip(legacy, layers):
        assert torch.equal(k, lk) and torch.equal(v, lv)
    # Tokens [20, 30) of a cache appended after the first 20 (a decode worker's new tokens).
    seq2 = client.create_sequence(model_name)
    prefix = tuple((k[:, :, :20], v[:, :, :20]) for k, v in layers)
    kvbank.hf.store(client, model_name, seq2.id, prefix)
    kvbank.hf.store(client, model_name, seq2.id, out.past_key_values, start=20)
    back = kvbank.hf.load(client, model_name, seq2.id, legacy=True)
    for (k, v), (lk, lv) in zip(back, layers):
        assert torch.equal(k, lk) and torch.equal(v, lv)
    with pytest.raises(kvbank.InvalidArgumentError):
        kvbank.hf.store(client, model_name, seq2.id, out.past_key_values, start=30)
