#!/usr/bin/env python3
"""An independent Python implementation of kvbank's fleet placement (client/PLACEMENT.md).

  python3 tests/data/placement.py --write   # regenerates placement_vectors.json
  python3 tests/data/placement.py           # checks itself against placement_vectors.json

Covers the placement key of a prompt, the rendezvous score and order of replica names, and the
bounded-load choice. The root and chain hashes come from prefix_hash.py beside this file. The C++
unit test (tests/unit/placement_vectors_test.cc) checks the C++ implementation against the same
file. Needs python3-xxhash; without it the check exits 77 (skipped).

Scores and per-name seeds are unsigned 64-bit integers written as decimal strings.
"""
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prefix_hash import chain_hash, root_hash  # noqa: E402


def placement_key(algo, root, prompt, block_tokens, extra_keys):
    """The key of a non-empty prompt: the chain hash of its first min(len, block_tokens) tokens.

    For a prompt of at least one block this is the first full block's prefix hash.
    """
    assert prompt, "an empty prompt's key is an SDK-local counter, not reproducible"
    return chain_hash(algo, root, prompt[:block_tokens], extra_keys)


def name_seed(name):
    import xxhash
    return xxhash.xxh3_64(name.encode("utf-8")).intdigest()


def rendezvous_score(name, key):
    import xxhash
    assert len(key) == 32
    return xxhash.xxh3_64(key, seed=name_seed(name)).intdigest()


def rendezvous_order(names, key):
    """Indices into `names`, best first: descending score, equal scores by name in byte order."""
    scores = [rendezvous_score(n, key) for n in names]
    return sorted(range(len(names)), key=lambda i: (-scores[i], names[i].encode("utf-8")))


def pick_bounded_load(order, loads, epsilon):
    """Returns (cap, chosen, home); chosen is an index into `loads`."""
    n, total = len(loads), sum(loads)
    assert n > 0 and sorted(order) == list(range(n)) and epsilon >= 0
    # IEEE double, left to right: ((1 + epsilon) * (T + 1)) / N, T + 1 converted to double.
    cap = max(1, math.floor((1.0 + epsilon) * float(total + 1) / float(n)))
    home = order[0]
    if loads[home] < cap:
        return cap, home, True
    chosen = home
    for i in order:  # strictly less: equal loads keep the earlier in the order
        if loads[i] < loads[chosen]:
            chosen = i
    return cap, chosen, chosen == home


FINGERPRINT = ("kvbank.layout.v1;kind=gqa;layers=2;q_heads=4;kv_heads=2;head_dim=8;head_dim_v=8;"
               "block_tokens=16;kv_lora_rank=0;rope_dim=0;input=fp16;storage=fp16,fp16")


def key_cases():
    prompt = list(range(1000, 1040))
    return [
        dict(name="full_prompt", algorithm="sha256", fingerprint=FINGERPRINT, tenant="acme",
             cache_salt="", block_tokens=16, prompt=prompt, extra_keys=[]),
        dict(name="full_prompt_xxh3", algorithm="xxh3_128", fingerprint=FINGERPRINT,
             tenant="acme", cache_salt="", block_tokens=16, prompt=prompt, extra_keys=[]),
        dict(name="exactly_one_block", algorithm="sha256", fingerprint=FINGERPRINT, tenant="acme",
             cache_salt="", block_tokens=16, prompt=prompt[:16], extra_keys=[]),
        dict(name="shorter_than_block", algorithm="sha256", fingerprint=FINGERPRINT,
             tenant="acme", cache_salt="", block_tokens=16, prompt=prompt[:5], extra_keys=[]),
        dict(name="shorter_than_block_xxh3", algorithm="xxh3_128", fingerprint="fp-b",
             tenant="", cache_salt="", block_tokens=4, prompt=[0xFFFFFFFF], extra_keys=[]),
        dict(name="extra_keys_salted", algorithm="sha256", fingerprint=FINGERPRINT,
             tenant="acme", cache_salt="s1", block_tokens=16, prompt=prompt[:20],
             extra_keys=[["lora", "sql-adapter"], ["multimodal", "img:3f2a"]]),
        dict(name="extra_keys_short_xxh3", algorithm="xxh3_128", fingerprint=FINGERPRINT,
             tenant="", cache_salt="x", block_tokens=16, prompt=[1, 2, 3],
             extra_keys=[["prompt_embeds", "e:9c"], ["custom", "v2"]]),
    ]


REPLICAS_3 = ["kvbank-0", "kvbank-1", "kvbank-2"]
# Not sorted: the order is indices into this list.
REPLICAS_8 = ["kvbank-10", "kvbank-1", "10.0.3.7:50051", "[fd00::7]:50051", "kvbank-0",
              "KVBANK-0", "kvbank-\u00e9t\u00e9", "\u7f13\u5b58-1"]


def bounded_cases():
    return [
        # cap = floor(1.15 * 10 / 3) = 3; home load 1 < 3.
        dict(name="home_under_cap", order=[2, 0, 1], loads=[3, 5, 1], epsilon=0.15),
        # cap = floor(10 / 3) = 3; home load 4 >= 3: the least loaded, replica 1.
        dict(name="home_at_cap_least_loaded", order=[0, 2, 1], loads=[4, 2, 3], epsilon=0.0),
        # cap = floor(1.15 * 14 / 4) = 4; home load 5; replicas 0 and 1 tie at 1: 1 comes
        # first in the order (not the lower index).
        dict(name="tie_earlier_in_order", order=[2, 1, 0, 3], loads=[1, 1, 5, 6],
             epsilon=0.15),
        # cap = floor(1.15 * 13 / 3) = 4; every load is 4: the home wins the tie but is not
        # "home" (it was not under the cap).
        dict(name="all_equal_at_cap", order=[1, 2, 0], loads=[4, 4, 4], epsilon=0.15),
        # cap = floor(1.5 * 13 / 3) = 6: all equal, under the cap.
        dict(name="all_equal_under_cap", order=[1, 2, 0], loads=[4, 4, 4], epsilon=0.5),
        # T = 0: floor(1.15 / 4) = 0, cap = 1.
        dict(name="empty_fleet", order=[3, 0, 2, 1], loads=[0, 0, 0, 0], epsilon=0.15),
        # N = 1: cap = floor(1.15 * 8) = 9 > T; the only replica always takes it.
        dict(name="single_replica", order=[0], loads=[7], epsilon=0.15),
        dict(name="single_replica_empty", order=[0], loads=[0], epsilon=0.0),
        # epsilon 0, exact: 6 / 3 = 2; home load 2 is not below 2.
        dict(name="epsilon_zero_exact", order=[0, 1, 2], loads=[2, 2, 1], epsilon=0.0),
        # 1.15 * 40 / 2 = 23.0 exactly in double; home load 23 is not below 23.
        dict(name="boundary_exact_in_double", order=[1, 0], loads=[16, 23], epsilon=0.15),
        dict(name="boundary_exact_in_double_under", order=[1, 0], loads=[17, 22],
             epsilon=0.15),
        # 1.15 * 100 / 5 = 23 in exact arithmetic, 22.999999999999996 in double: cap = 22,
        # so home load 22 is at the cap.
        dict(name="boundary_below_in_double", order=[4, 0, 1, 2, 3], loads=[20, 19, 21, 17, 22],
             epsilon=0.15),
        # Loads in the millions; 1.15 * 3300000 / 3 = 1265000 exactly, 1264999.99... in double.
        dict(name="large_loads", order=[2, 1, 0], loads=[1000000, 999999, 1300000],
             epsilon=0.15),
        # PLACEMENT.md's worked example: the order of key shorter_than_block_xxh3 over kvbank-0,
        # kvbank-1, kvbank-2; cap 3, home at 5; kvbank-1 and kvbank-2 tie at 2.
        dict(name="worked_example", order=[0, 1, 2], loads=[5, 2, 2], epsilon=0.15),
    ]


def compute_key(case):
    root = root_hash(case["algorithm"], case["fingerprint"], case["tenant"], case["cache_salt"])
    keys = [tuple(k) for k in case["extra_keys"]]
    return root, placement_key(case["algorithm"], root, case["prompt"], case["block_tokens"], keys)


def compute_rendezvous(key_hex, replicas):
    key = bytes.fromhex(key_hex)
    return dict(key=key_hex, replicas=replicas,
                seeds=[str(name_seed(n)) for n in replicas],
                scores=[str(rendezvous_score(n, key)) for n in replicas],
                order=rendezvous_order(replicas, key))


def build():
    keys = []
    for c in key_cases():
        root, key = compute_key(c)
        keys.append(dict(c, root=root.hex(), key=key.hex()))
    by_name = {k["name"]: k["key"] for k in keys}
    rendezvous = []
    for key_name in ("full_prompt", "full_prompt_xxh3", "extra_keys_salted",
                     "shorter_than_block_xxh3"):
        for label, replicas in (("3", REPLICAS_3), ("8", REPLICAS_8)):
            rendezvous.append(dict(name=f"{key_name}/{label}",
                                   **compute_rendezvous(by_name[key_name], replicas)))
    rendezvous.append(dict(name="zero_key/8", **compute_rendezvous("00" * 32, REPLICAS_8)))
    bounded = []
    for c in bounded_cases():
        cap, chosen, home = pick_bounded_load(c["order"], c["loads"], c["epsilon"])
        bounded.append(dict(c, cap=cap, chosen=chosen, home=home))
    return {
        "spec": "client/PLACEMENT.md",
        "u64": "decimal strings",
        "placement_keys": keys,
        "rendezvous": rendezvous,
        "bounded_load": bounded,
    }


def check(want):
    failed = passed = 0

    def expect(ok, what):
        nonlocal failed, passed
        if ok:
            passed += 1
        else:
            failed += 1
            print(f"MISMATCH {what}")

    for v in want["placement_keys"]:
        root, key = compute_key(v)
        expect(root.hex() == v["root"] and key.hex() == v["key"], f"placement key {v['name']}")
    for v in want["rendezvous"]:
        got = compute_rendezvous(v["key"], v["replicas"])
        for field in ("seeds", "scores", "order"):
            expect(got[field] == v[field], f"rendezvous {v['name']} {field}")
    for v in want["bounded_load"]:
        cap, chosen, home = pick_bounded_load(v["order"], v["loads"], v["epsilon"])
        expect((cap, chosen, home) == (v["cap"], v["chosen"], v["home"]),
               f"bounded load {v['name']}: got cap {cap} chosen {chosen} home {home}")
    # The vectors also hold what the cases are meant to show.
    rebuilt = build()
    expect(rebuilt == want, "placement_vectors.json differs from what --write would write")
    print(f"{passed} passed, {failed} failed")
    return failed


def main():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "placement_vectors.json")
    try:
        import xxhash  # noqa: F401
    except ImportError:
        print("python3-xxhash is not installed: skipped")
        return 77
    if "--write" in sys.argv:
        vectors = build()
        with open(path, "w", encoding="utf-8") as f:
            json.dump(vectors, f, indent=1, ensure_ascii=False)
            f.write("\n")
        print(f"wrote {len(vectors['placement_keys'])} placement keys, "
              f"{len(vectors['rendezvous'])} rendezvous and {len(vectors['bounded_load'])} "
              f"bounded-load vectors to {path}")
        return 0
    with open(path, encoding="utf-8") as f:
        want = json.load(f)
    return 1 if check(want) else 0


if __name__ == "__main__":
    sys.exit(main())
