#!/usr/bin/env python3
"""The engine's side of topology_test.py: what kvbank.vllm.KvbankConnector does with kvbankd
when vLLM starts, then one block through the planes it chose. Run by the Python that has the
kvbank package, with the engine container's uid, env and mounts; needs nothing but kvbank and
numpy.

  engine_client.py '{"target": "127.0.0.1:PORT", "extra": {kv_connector_extra_config},
                     "block_tokens": N, "dtype": "bf16", "probe_only": false}'

The client is made as the connector makes it (kvbank_target, kvbank_token, kvbank_shm,
kvbank_deadline_s, kvbank_device_plane; the target is the test's loopback port for it), then
ensure_model with the layout the connector would send for a model shaped like the preset that
kvbank_model names (vLLM's block size and dtype from the engine's args), then one block of
random bf16 values is appended and fetched back into a buffer. Prints one JSON object: the data
plane, the server's info, the ModelInfo's created flag, plane_stats() and whether the bytes came
back equal. probe_only: the client is made and the data plane reported, nothing else.
"""

import json
import os
import sys

import numpy as np

import kvbank

SEED = 20261203


def main() -> int:
    spec = json.loads(sys.argv[1])
    extra = spec["extra"]
    shm = extra.get("kvbank_shm", True)
    if isinstance(shm, str):
        shm = shm.lower() not in ("0", "false", "no", "off")
    c = kvbank.Client(spec["target"], extra.get("kvbank_token") or None,
                      deadline_s=float(extra.get("kvbank_deadline_s", 30.0)), shm=bool(shm),
                      device_plane=str(extra.get("kvbank_device_plane", "auto")))
    out: dict = {"uid": os.geteuid(), "data_plane": c.data_plane, "server": c.server_info()}
    if spec.get("probe_only"):
        print(json.dumps(out))
        return 0
    preset = kvbank.preset_layout(extra["kvbank_model"])
    # kvbank.vllm's model_layout() for a model with the preset's shape.
    layout = {
        "name": extra["kvbank_model"],
        "num_layers": preset["num_layers"],
        "num_q_heads": preset["num_q_heads"],
        "num_kv_heads": preset["num_kv_heads"],
        "head_dim": preset["head_dim"],
        "block_tokens": spec["block_tokens"],
        "kind": preset["kind"],
        "dtype": spec["dtype"],
    }
    try:
        info = c.ensure_model(layout)
    except kvbank.Error as e:
        out["ensure_model_error"] = "%s: %s" % (type(e).__name__, e)
        print(json.dumps(out))
        return 0
    out["created"] = info.created
    n = int(spec["block_tokens"])
    nbytes = info.payload_bytes(n)
    rng = np.random.default_rng(SEED)
    # Finite bf16 bit patterns in [1, 2): stored as bf16, they come back bit-identical.
    payload = rng.integers(0x3F80, 0x4000, size=nbytes // 2, dtype=np.uint16)
    seq = c.create_sequence(info.name)
    c.append(info.name, seq.id, payload, num_tokens=n)
    back = np.zeros_like(payload)
    c.fetch_into(info.name, seq.id, back)
    c.free(info.name, seq.id)
    out.update(payload_bytes=nbytes, equal=bool(np.array_equal(back, payload)),
               planes=c.plane_stats(), seed=SEED)
    if out["server"].get("cuda_ipc_device") is not None:
        out["device_plane"] = c.device_plane_for(0)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
