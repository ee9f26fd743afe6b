"""A second SGLang instance for test_second_process_finds_pages: a fresh process, host pool and
controller that prefetches a prompt's pages from kvbank into its host pool.

    second_instance.py '{"target": ..., "tokens": [...], "out": "kv.pt"}'

Writes {"loaded": tokens prefetched, "pages": each [2][layers][tokens][heads][dim]} to out
with torch.save.
"""

import json
import sys

import torch

from hicache_rig import Rig


def main():
    spec = json.loads(sys.argv[1])
    rig = Rig(spec["target"], model_name="shared")
    try:
        host_slots, loaded = rig.prefetch(spec["tokens"], rid="second")
        pages = rig.host_pages(host_slots) if loaded else []
        torch.save({"loaded": loaded, "pages": [p.contiguous() for p in pages]}, spec["out"])
    finally:
        rig.close()


if __name__ == "__main__":
    main()
