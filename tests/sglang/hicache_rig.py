"""SGLang's HiCache on the CPU, as the scheduler drives it, for the tests: a device KV pool
(MHATokenToKVPool on "cpu"), its paged allocator, a host pool (MHATokenToKVPoolHost, not
pinned) and the real HiCacheController over a one-process gloo group, its storage backend
kvbank.sglang.KvbankHiCacheStorage loaded the way --hicache-storage-backend dynamic loads it.

The scheduler's part (what HiRadixCache does) is done here by hand, with deadlines on every
wait: write_storage -> ack_backup_queue, prefetch -> prefetch_hit_queue -> host slots ->
prefetch_buffer -> ack_prefetch_queue. The device <-> host copies (write, load) need SGLang's
GPU kernels (transfer_kv_direct), so the tests fill and read the host pool directly.
"""

import os
import queue
import socket
import threading
import time

import torch
import torch.distributed as dist
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_parallel

WAIT_S = 60.0


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_rank():
    """One gloo rank and SGLang's single-rank parallel layout (what the launcher publishes)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                                rank=0, world_size=1)
    get_parallel().override_permanently(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_tp_rank=0, attn_tp_size=1,
        attn_dp_rank=0, attn_dp_size=1, attn_cp_rank=0, attn_cp_size=1, attn_dcp_rank=0,
        attn_dcp_size=1)


def extra_config(target, **more):
    cfg = {"backend_name": "kvbank", "module_path": "kvbank.sglang",
           "class_name": "KvbankHiCacheStorage", "interface_v1": 1, "kvbank_target": target,
           "kvbank_retry_s": 0.2}
    cfg.update(more)
    return cfg


class Rig:
    """One SGLang instance's KV side: device pool, host pool, controller."""

    def __init__(self, target, layout="layer_first", page_size=4, layers=3, heads=2,
                 head_dim=8, dtype=torch.bfloat16, device_tokens=256, host_ratio=4.0,
                 model_name="tiny-llama", allocator="default", **extra):
        init_single_rank()
        self.page_size = page_size
        self.kv = MHATokenToKVPool(device_tokens, page_size, dtype, heads, head_dim, layers,
                                   "cpu", False, start_layer=0, end_layer=layers)
        self.allocator = PagedTokenToKVPoolAllocator(device_tokens, page_size, dtype, "cpu",
                                                     self.kv, need_sort=False)
        cap = self.kv.size if getattr(self.kv, "host_capacity_tokens", None) is None \
            else self.kv.host_capacity_tokens
        self.host = MHATokenToKVPoolHost(
            self.kv.get_device_pool_infos()[0].buffer_info, host_ratio, 0, page_size, layout,
            pin_memory=False, device_capacity_tokens=cap, start_layer=self.kv.start_layer,
            end_layer=self.kv.end_layer,
            write_back_staging=getattr(self.kv, "hicache_write_back_staging", None),
            allocator_type=allocator)
        self.cc = HiCacheController(
            self.allocator, self.host, page_size, dist.group.WORLD, threading.Event(),
            write_policy="write_through", io_backend="direct", storage_backend="dynamic",
            prefetch_threshold=page_size, model_name=model_name,
            storage_backend_extra_config=extra_config(target, **extra))
        self.storage = self.cc.storage_backend

    def close(self):
        self.cc.detach_storage_backend()

    # ---- host KV ---------------------------------------------------------------------------

    def fill_host(self, num_pages, seed):
        """Random KV in num_pages freshly allocated pages of the host pool (what the device ->
        host backup leaves there; that copy needs SGLang's GPU kernels): (slots, pages), each
        page [2][layers][tokens][heads][dim] as written, through SGLang's flat-page API."""
        slots = self.host.alloc(num_pages * self.page_size)
        assert slots is not None, "host pool full"
        g = torch.Generator().manual_seed(seed)
        h = self.host
        pages = []
        for i in range(num_pages):
            page = torch.randn(2, h.layer_num, self.page_size, h.head_num, h.head_dim,
                               generator=g).to(h.dtype)
            h.set_from_flat_data_page(int(slots[i * self.page_size]),
                                      to_host_order(page, h.layout).reshape(-1))
            pages.append(page)
        return slots, pages

    def host_pages(self, slots):
        """The pages in host slots, each [2][layers][tokens][heads][dim] (get_data_page)."""
        h = self.host
        return [from_host_order(h.get_data_page(int(slots[i]), flat=True), h)
                for i in range(0, len(slots), self.page_size)]

    # ---- the scheduler's steps -------------------------------------------------------------

    def write_storage(self, host_slots, tokens):
        """Host -> kvbank (write_storage, then its ack on ack_backup_queue): the page keys and
        the tokens the backup thread reports done."""
        keys = get_storage_hash_str(tokens, None, page_size=self.page_size)
        op_id = self.cc.write_storage(host_slots, tokens, hash_value=keys, prefix_keys=[])
        op = self.cc.ack_backup_queue.get(timeout=WAIT_S)
        assert op.id == op_id
        return keys, op.completed_tokens

    def prefetch(self, tokens, rid="req"):
        """kvbank -> host: prefetch's hit query (batch_exists), host slots for the hit, the page
    transfer (batch_get_v1);
        (host slots, tokens loaded). Slots past what was loaded are freed."""
        op = self.cc.prefetch(rid, tokens, None, [])
        hit = self.cc.prefetch_hit_queue.get(timeout=WAIT_S)
        assert hit is op
        if op.storage_hit_count == 0:
            return None, 0  # the scheduler revokes it: nothing reaches the I/O thread
        host_slots = self.host.alloc(op.storage_hit_count)
        assert host_slots is not None, "host pool full"
        op.host_indices = host_slots
        self.cc.prefetch_buffer.put(op)
        self._wait_done(op)
        done = op.completed_tokens
        if done < len(host_slots):
            self.host.free(host_slots[done:])
        return host_slots[:done], done

    def _wait_done(self, op):
        deadline = time.monotonic() + WAIT_S
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"prefetch not done within {WAIT_S:.0f} s"
            try:
                ack = self.cc.ack_prefetch_queue.get(timeout=left)
            except queue.Empty:
                continue
            if ack.operation is not op:
                continue
            if ack.completed_tokens is not None:
                op.completed_tokens = max(op.completed_tokens, ack.completed_tokens)
            if ack.completed_req:
                return



def to_host_order(page, layout):
    """A page [2][layers][tokens][heads][dim] in the order of SGLang's flat pages for a host
    layout (MHATokenToKVPoolHost.init_kv_buffer's dims, less the pool's own)."""
    if layout in ("layer_first", "page_first_direct"):
        return page.contiguous()
    if layout == "page_first":
        return page.permute(0, 2, 1, 3, 4).contiguous()  # [2][tokens][layers][heads][dim]
    return page.permute(0, 3, 2, 1, 4).contiguous()  # page_head: [2][heads][tokens][layers][dim]


def from_host_order(flat, host):
    L, t, h, d = host.layer_num, host.page_size, host.head_num, host.head_dim
    if host.layout in ("layer_first", "page_first_direct"):
        return flat.reshape(2, L, t, h, d)
    if host.layout == "page_first":
        return flat.reshape(2, t, L, h, d).permute(0, 2, 1, 3, 4)
    return flat.reshape(2, h, t, L, d).permute(0, 3, 2, 1, 4)


def page_tokens(num_pages, page_size, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (num_pages * page_size,), generator=g).tolist()


def environ_target():
    return os.environ["KVBANK_TEST_TARGET"]
