#!/usr/bin/env python3
"""An independent Python implementation of kvbank's prefix hash (base/include/kvbank/prefix_hash.h).

  python3 tests/data/prefix_hash.py --write   # regenerates prefix_hash_vectors.json
  python3 tests/data/prefix_hash.py           # checks itself against prefix_hash_vectors.json

The C++ unit test checks the C++ implementation against the same file, so the two implementations
agree byte for byte. Needs python3-xxhash for the xxh3_128 vectors.
"""
import hashlib
import json
import os
import struct
import sys

EXTRA_KINDS = {"lora": 1, "multimodal": 2, "prompt_embeds": 3, "custom": 4}


def digest(algo, data):
    if algo == "sha256":
        return hashlib.sha256(data).digest()
    import xxhash  # canonical (big-endian) 128-bit digest, then 16 zero bytes
    return xxhash.xxh3_128(data).digest() + bytes(16)


def field(tag, value):
    return struct.pack("<BI", tag, len(value)) + value


def root_hash(algo, fingerprint, tenant, salt):
    data = b"kvbank.root.v1" + field(1, fingerprint.encode()) + field(2, tenant.encode()) + \
        field(3, salt.encode())
    return digest(algo, data)


def chain_hash(algo, parent, tokens, extra_keys):
    data = b"kvbank.block.v1" + parent + struct.pack("<I", len(tokens))
    data += b"".join(struct.pack("<I", t) for t in tokens)
    data += struct.pack("<I", len(extra_keys))
    data += b"".join(field(EXTRA_KINDS[k], v.encode()) for k, v in extra_keys)
    return digest(algo, data)


def prefix_hashes(algo, root, tokens, block_tokens, extra_keys):
    out, parent = [], root
    for i in range(len(tokens) // block_tokens):
        parent = chain_hash(algo, parent, tokens[i * block_tokens:(i + 1) * block_tokens],
                            extra_keys)
        out.append(parent)
    return out


def cases():
    base = list(range(40))
    return [
        dict(name="plain", fingerprint="fp-a", tenant="", salt="", tokens=base, block_tokens=16,
             extra_keys=[]),
        dict(name="tenant", fingerprint="fp-a", tenant="acme", salt="", tokens=base,
             block_tokens=16, extra_keys=[]),
        dict(name="salt", fingerprint="fp-a", tenant="", salt="x", tokens=base, block_tokens=16,
             extra_keys=[]),
        dict(name="lora_named_like_salt", fingerprint="fp-a", tenant="", salt="",
             tokens=base, block_tokens=16, extra_keys=[["lora", "x"]]),
        dict(name="multimodal", fingerprint="fp-a", tenant="t", salt="s", tokens=base,
             block_tokens=8, extra_keys=[["multimodal", "img:3f2a"], ["custom", "v2"]]),
        dict(name="other_layout", fingerprint="fp-b", tenant="", salt="", tokens=base,
             block_tokens=16, extra_keys=[]),
        dict(name="big_ids_odd_block", fingerprint="fp-a", tenant="", salt="",
             tokens=[0xFFFFFFFF, 0, 128000, 7, 1 << 31, 3, 5, 11, 13], block_tokens=3,
             extra_keys=[]),
    ]


def compute(case, algo):
    root = root_hash(algo, case["fingerprint"], case["tenant"], case["salt"])
    keys = [tuple(k) for k in case["extra_keys"]]
    return root.hex(), [h.hex() for h in prefix_hashes(algo, root, case["tokens"],
                                                        case["block_tokens"], keys)]


def main():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prefix_hash_vectors.json")
    if "--write" in sys.argv:
        vectors = []
        for algo in ("sha256", "xxh3_128"):
            for c in cases():
                root, hashes = compute(c, algo)
                vectors.append(dict(c, algorithm=algo, root=root, hashes=hashes))
        with open(path, "w") as f:
            json.dump({"spec": "base/include/kvbank/prefix_hash.h", "vectors": vectors}, f,
                      indent=1)
        print(f"wrote {len(vectors)} vectors to {path}")
        return 0
    with open(path) as f:
        vectors = json.load(f)["vectors"]
    passed = failed = skipped = 0
    for v in vectors:
        if v["algorithm"] == "xxh3_128":
            try:
                import xxhash  # noqa: F401
            except ImportError:
                skipped += 1
                continue
        root, hashes = compute(v, v["algorithm"])
        if root != v["root"] or hashes != v["hashes"]:
            print(f"MISMATCH {v['name']} {v['algorithm']}")
            failed += 1
        else:
            passed += 1
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    bad = failed
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
