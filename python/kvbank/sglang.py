"""kvbank.sglang.KvbankHiCacheStorage: kvbank as the storage tier (L3) of SGLang's HiCache.

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvbank",
            "module_path": "kvbank.sglang", "class_name": "KvbankHiCacheStorage",
            "interface_v1": 1, "kvbank_target": "127.0.0.1:50051"}'

With "interface_v1": 1 SGLang's controller calls batch_set_v1 / batch_get_v1 with the host
pool's slots; batch_exists asks kvbank's Match for the leading run of pages it holds. Without
interface_v1 the get / set / batch_get / batch_set / exists path works too (a page a call).

Zero-copy (add "allocator": "shm" to the extra config, host layout layer_first or
page_first_direct, kvbankd on the same host): SGLang then keeps its host pool in a memfd, which
the backend registers with kvbankd as it is (register_region_fd). A page's layers, K and V,
are runs of that file, and kvbank's blocks are declared token-major (one kv head of heads x
head_dim values: per layer K [tokens][heads x head_dim] then V), so a store appends each page
straight from the pool and a load fetches a batch's pages straight into their slots, in one
call (fetch_blocks_into_runs): no copy in this process. Otherwise pages are copied between
the host pool and kvbank's MHA blocks through a shared-memory staging region (one strided copy
per page on this side, none in the SDK).

Mapping:
  page            one kvbank block: page_size tokens = the model's block_tokens, every layer of
                  the host pool, K and V, in kvbank's block layout (per layer K [kv_heads]
                  [tokens][head_dim] then V), the pool's dtype (bf16, fp16, fp32)
  model           registered with ensure_model from the host pool: layers, kv heads, head_dim,
                  page size, dtype; named "sglang/<served model>" (kvbank_model), with
                  "/tp<size>-<rank>" and "/pp<size>-<rank>" when there are several ranks (each
                  rank stores its own heads or layers in its own model), and "/token-major"
                  after it for the zero-copy layout (unless kvbank_model names it)
  page key        the extra key ("custom", UTF-8 bytes of SGLang's page key in hex) of a block
                  whose tokens are page_size zeros, hashed from the model's prefix root: every
                  page is a chain of one block, so it is found whichever pages came before it
                  (SGLang's key already names the whole prefix)
  exists          Match over those hashes: the leading run kvbank holds (pool or a tier)
  store           one sequence a page (created with the page's hash; a page kvbank already
                  holds is attached, not sent again), appended from the region, then freed: the
                  block stays in kvbank's prefix cache, evicted LRU like any other
  load            FetchBlocks of a batch's hashes into the region: the leading run kvbank holds

Limits:
  - Blocks are named by SGLang's page keys (its own hash chain over the token ids), not by
    kvbank's token hashes, and the v1 interface does not hand the tokens over: pages an SGLang
    instance stores are found by SGLang instances of the same model and kvbank model name, not
    by a vLLM instance through kvbank.vllm (whose blocks are named by token hashes), and the
    other way round. The block bytes are the same layout, so a client that knows SGLang's keys
    can read them with fetch_blocks.
  - MHA host pools (MHATokenToKVPoolHost) only: MLA, hybrid and sparse pools raise at start, as
    do fp8 KV caches. pp and tp ranks each write their own model; an instance of another tp
    size does not find them.
  - clear() does nothing: other instances may share the model.

Failures: every call answers a miss or False when kvbank cannot serve it (server down, a key
that is not a string, a page outside the pool, a block evicted between exists and get); it
never raises into SGLang's threads and never writes bytes it did not fetch whole into the host
pool. After a transport error the client is made again (at most every kvbank_retry_s), so a
kvbankd that comes back is used again, the model registered anew.

extra config (--hicache-storage-backend-extra-config; also the KVBANK_TARGET environment
variable for the target):
  kvbank_target        "host:port" of kvbankd (required)
  kvbank_token         bearer token (default: none); or kvbank_token_file, a file holding it
  kvbank_tls_ca        CA file of kvbankd's certificate: TLS (default: plaintext);
                       kvbank_tls_server_name, kvbank_tls_cert / kvbank_tls_key beside it
  kvbank_model         kvbank model name (default "sglang/" + the served model's name)
  kvbank_num_q_heads   query heads of the model (default: the kv heads)
  kvbank_pool_bytes    pool bytes when the model is first registered (default 0: the server's)
  kvbank_deadline_s    deadline of unary calls (default 30)
  kvbank_lease_s       lease of a store's sequence, in case this process dies mid-store (60)
  kvbank_region_bytes  bytes of each of the two staging regions, one for stores, one for loads
                       (default 64 MiB, at least one page)
  kvbank_io_threads    stores of a batch in flight at once (default 2)
  kvbank_shm           use kvbankd's shared-memory plane when it serves one (default true)
  kvbank_zero_copy     "auto" (default): zero-copy when the host pool allows it (see above);
                       false: always the staging copy and kvbank's MHA block layout
  kvbank_retry_s       least seconds between reconnections (default 2)
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageExtraInfo

import kvbank

from . import _kvbank
from ._connector_config import client_settings
from ._sglang_pages import PageLayout

__all__ = ["KvbankHiCacheStorage", "PageLayout", "page_key_value"]

logger = logging.getLogger("kvbank.sglang")

# Errors after which the connection is made again: the server went away or forgot the model.
_RECONNECT = (kvbank.UnavailableError, kvbank.DeadlineExceededError, kvbank.CancelledError,
              kvbank.FailedPreconditionError, kvbank.UnknownError, kvbank.InternalError)

# After a zero-copy load fails (a deadline, a broken connection), how long batch_get_v1 waits
# before it answers: kvbankd stops writing into the host slots at its next piece once the call
# has ended (well under a millisecond), and SGLang may hand those slots to another request as
# soon as the load answers False.
_LATE_WRITE_GRACE_S = 0.1


def page_key_value(key: Any) -> str | None:
    """The extra key value naming an SGLang page key: its UTF-8 bytes in hex (kvbank's extra
    keys are strings on the wire; hex keeps any key intact). None for what is not a key."""
    if isinstance(key, str):
        raw = key.encode("utf-8", "surrogatepass")
    elif isinstance(key, (bytes, bytearray)):
        raw = bytes(key)
    else:
        return None
    return raw.hex() if raw else None


def _model_name(name: str, token_major: bool = False) -> str:
    """The kvbank model of a backend: `name`, "/token-major" after it for the zero-copy
    mapping's blocks (another layout, so another model), cut to kvbank's 128 characters."""
    if token_major:
        name += "/token-major"
    if len(name) > 128:  # kvbank's limit: keep the end
        name = "sglang/..." + name[-118:]
    return name


class _Staging:
    """A flat buffer of whole blocks in the pool's dtype, in a shared-memory region registered
    with kvbankd where it can be (payloads there move without a copy in the SDK), and the lock
    of its one user at a time."""

    def __init__(self, client: kvbank.Client, nbytes: int, dtype: torch.dtype, use_shm: bool):
        self.region = None
        if use_shm and client.data_plane == "shm":
            try:
                self.region = client.register_region(nbytes)
            except kvbank.Error as e:
                logger.info("kvbank.sglang: no shared-memory region (%s): gRPC", e)
        if self.region is not None:
            self.buf = torch.from_numpy(self.region).view(dtype)
        else:
            self.buf = torch.empty(nbytes // torch.empty((), dtype=dtype).element_size(),
                                   dtype=dtype)
        self.lock = threading.Lock()


class _Conn:
    """One connection: the client, the model's prefix root and the staging buffers."""

    def __init__(self, client: kvbank.Client, root: bytes, algorithm: str, store: _Staging,
                 load: _Staging, pages: int):
        self.client = client
        self.root = root
        self.algorithm = algorithm
        self.store = store
        self.load = load
        self.pages = pages  # blocks each staging buffer holds
        # Zero-copy: the host pool's file as a region (register_region_fd), and the byte offset
        # of the pool's buffer in it.
        self.host_region: Any = None
        self.host_offset = 0

    def close(self) -> None:
        regions = [st.region for st in (self.store, self.load)] + [self.host_region]
        for region in regions:
            if region is not None:
                try:
                    self.client.unregister_region(region)
                except Exception:  # noqa: BLE001 - best effort on a connection being dropped
                    pass
        self.client.close()


class KvbankHiCacheStorage(HiCacheStorage):
    """SGLang's HiCacheStorage over kvbank (see the module docstring). Thread-safe: SGLang's
    backup thread stores while its prefetch threads look up and load."""

    def __init__(self, storage_config: Any, kwargs: dict | None = None):
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        if not extra.get("kvbank_target") and os.environ.get("KVBANK_TARGET"):
            extra["kvbank_target"] = os.environ["KVBANK_TARGET"]
        settings = client_settings(extra, "kvbank.sglang: the storage backend's extra config "
                                   "(or KVBANK_TARGET)")
        self._target = settings["target"]
        self._token = settings["token"]
        self._tls = settings["tls"]
        served = getattr(storage_config, "model_name", None) or "model"
        name = str(extra.get("kvbank_model") or "sglang/" + str(served))
        tp_size = int(getattr(storage_config, "tp_size", 1) or 1)
        pp_size = int(getattr(storage_config, "pp_size", 1) or 1)
        if tp_size > 1:
            name += f"/tp{tp_size}-{getattr(storage_config, 'tp_rank', 0)}"
        if pp_size > 1:
            name += f"/pp{pp_size}-{getattr(storage_config, 'pp_rank', 0)}"
        self._explicit_model = bool(extra.get("kvbank_model"))
        self._base_model = name
        self.model = _model_name(name)
        self._zero_copy_opt = str(extra.get("kvbank_zero_copy", "auto")).lower()
        self._q_heads = int(extra.get("kvbank_num_q_heads", 0))
        self._pool_bytes = int(extra.get("kvbank_pool_bytes", 0))
        self._deadline_s = float(settings["deadline_s"])
        self._lease_s = float(extra.get("kvbank_lease_s", 60.0))
        self._region_bytes = int(extra.get("kvbank_region_bytes", 64 << 20))
        self._io_threads = max(1, int(extra.get("kvbank_io_threads", 2)))
        self._shm = bool(settings["shm"])
        self._retry_s = float(extra.get("kvbank_retry_s", 2.0))
        self.pages: PageLayout | None = None
        # The host pool's shared file (fd, byte offset of its buffer) when it has one.
        self._host_file: tuple[int, int] | None = None
        self.zero_copy = False  # the connection moves v1 pages straight to / from the pool
        self._conn: _Conn | None = None
        self._conn_lock = threading.Lock()
        self._next_try = 0.0
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self._io_threads, thread_name_prefix="kvbank-sglang")


    # ---- setup ------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Maps the host pool's pages (raises NotImplementedError for a pool it cannot) and
        connects; a kvbankd that cannot be reached yet is tried again at the first call."""
        super().register_mem_pool_host(mem_pool_host)
        self.pages = PageLayout(mem_pool_host)
        self._host_file = None
        if self._zero_copy_opt not in ("0", "false", "no", "off"):
            why = self._find_host_file(mem_pool_host)
            if why:
                logger.info("kvbank.sglang: pages copied through a staging region: %s", why)
        if self._connection() is not None:
            logger.info("kvbank.sglang: model %s on %s (%d-token pages of %d bytes, %s, %s)",
                        self.model, self._target, self.pages.tokens, self.pages.page_bytes,
                        self._conn.client.data_plane if self._conn else "-",
                        "zero-copy" if self.zero_copy else "copied")

    def _find_host_file(self, host: Any) -> str:
        """Sets _host_file when the zero-copy path can serve this pool; else says why not."""
        pages = self.pages
        assert pages is not None
        if pages.layout not in PageLayout.RUN_LAYOUTS:
            return (f"layout {pages.layout} keeps a page's layer apart "
                    f"(zero-copy takes {' or '.join(PageLayout.RUN_LAYOUTS)})")
        allocator = getattr(host, "allocator", None)
        fds = getattr(allocator, "fds", None) or []
        mms = getattr(allocator, "mms", None) or []
        if len(fds) != 1 or len(mms) != 1:
            return ('the host pool is not in one shared file (set "allocator": "shm" in '
                    "--hicache-storage-backend-extra-config)")
        import numpy as np
        base = int(np.frombuffer(mms[0], dtype=np.uint8).ctypes.data)
        buf = host.kv_buffer
        offset = int(buf.data_ptr()) - base
        if offset < 0 or offset + buf.numel() * buf.element_size() > len(mms[0]):
            return "the host pool's buffer is not inside its shared file"
        self._host_file = (int(fds[0]), offset)
        return ""

    def _connection(self) -> _Conn | None:
        """The live connection, made (client, model, root, regions) when there is none and the
        last try is long enough ago; None when kvbank cannot be reached."""
        conn = self._conn
        if conn is not None or self.pages is None:
            return conn
        with self._conn_lock:
            if self._conn is not None:
                return self._conn
            now = time.monotonic()
            if now < self._next_try:
                return None
            self._next_try = now + self._retry_s
            pages = self.pages
            client = None
            try:
                client = kvbank.Client(self._target, self._token, deadline_s=self._deadline_s,
                                       tls=self._tls, shm=self._shm)
                # Zero-copy: the host pool's own file as a region, blocks token-major.
                region = None
                if self._host_file is not None and self._shm and client.data_plane == "shm":
                    try:
                        region = client.register_region_fd(self._host_file[0])
                    except kvbank.Error as e:
                        logger.warning("kvbank.sglang: the host pool cannot be a region (%s): "
                                       "pages copied through a staging region", e)
                pages.token_major = region is not None
                self.zero_copy = region is not None
                self.model = _model_name(self._base_model, self.zero_copy and
                                         not self._explicit_model)
                layout = (pages.token_major_layout if self.zero_copy
                          else pages.model_layout)(self.model, self._q_heads)
                client.ensure_model(layout, pool_bytes=self._pool_bytes)
                r = client.get_prefix_root(self.model)
                n = max(1, self._region_bytes // pages.page_bytes)
                nbytes = n * pages.page_bytes
                store = _Staging(client, nbytes, pages.torch_dtype, self._shm)
                load = _Staging(client, nbytes, pages.torch_dtype, self._shm)
                self._conn = _Conn(client, r.root, r.algorithm, store, load, n)
                if region is not None:
                    self._conn.host_region = region
                    self._conn.host_offset = self._host_file[1] if self._host_file else 0
            except Exception as e:  # noqa: BLE001 - kvbank down: a miss until it is back
                logger.warning("kvbank.sglang: cannot reach kvbank at %s: %s", self._target, e)
                if client is not None:
                    client.close()
                return None
            return self._conn

    def _drop(self, conn: _Conn, e: Exception) -> None:
        """Forgets a connection after a transport error (the next call makes a new one)."""
        with self._conn_lock:
            if self._conn is conn:
                self._conn = None
                logger.warning("kvbank.sglang: dropping the connection to %s: %s",
                               self._target, e)
            else:
                return
        try:
            conn.close()
        except Exception:  # noqa: BLE001 - best effort
            pass

    def _failed(self, conn: _Conn, what: str, e: Exception) -> None:
        if isinstance(e, _RECONNECT):
            self._drop(conn, e)
        else:
            logger.warning("kvbank.sglang: %s: %s", what, e)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._conn_lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    # ---- names ------------------------------------------------------------------------------

    def _hashes(self, conn: _Conn, keys: Sequence[Any]) -> list[bytes]:
        """The hashes of the leading keys that are keys (a bad key ends the run): each page's
        block is kvbank.chain_hash(root, [0] * page_size, [("custom", page_key_value(key))]),
        computed here without that wrapper's per-call argument checks."""
        assert self.pages is not None
        zeros = [0] * self.pages.tokens
        out = []
        for key in keys:
            value = page_key_value(key)
            if value is None:
                break
            out.append(_kvbank.chain_hash(conn.algorithm, conn.root, zeros,
                                          [("custom", value.encode())]))
        return out

    # ---- lookups ----------------------------------------------------------------------------

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages of `keys` kvbank holds (Match: no side effects)."""
        conn = self._connection()
        if conn is None or not keys:
            return 0
        try:
            hashes = self._hashes(conn, keys)
            if not hashes:
                return 0
            tokens = conn.client.match(self.model, [hashes])[0]
            assert self.pages is not None
            return min(len(hashes), int(tokens) // self.pages.tokens)
        except Exception as e:  # noqa: BLE001 - a miss, never an exception into SGLang
            self._failed(conn, "exists", e)
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ---- loads ------------------------------------------------------------------------------

    def _fetch(self, conn: _Conn, hashes: list[bytes], put: Any) -> int:
        """Fetches the leading run of `hashes` (a staging buffer of pages at a time) and hands
        each block to put(i, block view); returns how many pages it handed. (Overlapping the
        next fetch with this copy-out, on two halves of the buffer, did not pay on 2 cores: the
        copy-out and kvbankd's copy-in compete for the same cores and memory bandwidth.)"""
        pages = self.pages
        assert pages is not None
        done = 0
        st = conn.load
        while done < len(hashes):
            chunk = hashes[done:done + conn.pages]
            with st.lock:
                try:
                    info = conn.client.fetch_blocks_into(self.model, chunk, st.buf)
                except kvbank.NotFoundError:
                    return done  # not even the first block: a miss
                n = min(len(chunk), int(info.num_tokens) // pages.tokens)
                if int(info.payload_bytes) != n * pages.page_bytes:
                    raise kvbank.DataLossError(
                        f"kvbank.sglang: {info.payload_bytes} bytes for {n} pages")
                for j in range(n):
                    put(done + j, pages.fetched(st.buf, n, j))
            done += n
            if n < len(chunk):
                break
        return done

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Loads the leading run of pages kvbank holds into the host pool's slots
        (host_indices: page_size slots a page, in key order). Pages after the first miss, bad
        key or bad slot are not touched and answer False."""
        results = [False] * len(keys)
        conn = self._connection()
        if conn is None or not keys:
            return results
        pages = self.pages
        assert pages is not None
        starts = pages.page_starts(host_indices, len(keys))
        if -1 in starts:
            starts = starts[:starts.index(-1)]
        try:
            hashes = self._hashes(conn, keys[:len(starts)])
            if conn.host_region is not None:
                try:
                    loaded = self._fetch_runs(conn, hashes, starts)
                except Exception:
                    time.sleep(_LATE_WRITE_GRACE_S)
                    raise
                for i in range(loaded):
                    results[i] = True
                return results

            def put(i: int, block: torch.Tensor) -> None:
                pages.host_page(starts[i]).copy_(block)
                results[i] = True

            self._fetch(conn, hashes, put)
        except Exception as e:  # noqa: BLE001 - a miss, never an exception into SGLang
            self._failed(conn, "load", e)
        return results

    def _fetch_runs(self, conn: _Conn, hashes: list[bytes], starts: list[int]) -> int:
        """Zero-copy load: FetchBlocks of the leading run of `hashes` straight into the host
        pool's pages at `starts` (each page's layers, K and V, as runs of the pool's file);
        returns how many pages it loaded. When kvbank holds fewer pages than asked, the runs it
        wrote were laid out for the longer fetch: those pages are fetched again, exactly, and
        the slots past them (this call's, answered False) hold bytes of no meaning."""
        pages = self.pages
        assert pages is not None
        per_call = max(1, kvbank.MAX_REGION_RUNS // (2 * pages.layers))
        done = 0
        while done < len(hashes):
            want = min(per_call, len(hashes) - done)
            asked = want
            while True:
                offsets = pages.fetch_runs(starts[done:done + want], conn.host_offset)
                try:
                    info = conn.client.fetch_blocks_into_runs(
                        self.model, hashes[done:done + want], conn.host_region, offsets,
                        pages.run_bytes)
                except kvbank.NotFoundError:
                    return done  # not even the first page: a miss
                n = min(want, int(info.num_tokens) // pages.tokens)
                if int(info.payload_bytes) != n * pages.page_bytes:
                    raise kvbank.DataLossError(
                        f"kvbank.sglang: {info.payload_bytes} bytes for {n} pages")
                if n == want:
                    break
                want = n
            done += want
            if want < asked:
                break
        return done

    def batch_get(self, keys: list[str], target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> list[torch.Tensor | None]:
        """Flat pages in the host pool's order (into target_locations[i] when given: SGLang's
        dummy flat pages), None from the first page kvbank does not hold."""
        out: list[torch.Tensor | None] = [None] * len(keys)
        conn = self._connection()
        if conn is None or not keys:
            return out
        pages = self.pages
        assert pages is not None
        try:
            hashes = self._hashes(conn, keys)

            def put(i: int, block: torch.Tensor) -> None:
                dst = target_locations[i] if target_locations is not None else None
                if dst is None or dst.numel() != pages.page_elems or \
                        dst.dtype != pages.torch_dtype or not dst.is_contiguous():
                    dst = torch.empty(pages.page_elems, dtype=pages.torch_dtype)
                pages.flat_page(dst.view(-1)).copy_(block)
                out[i] = dst

            self._fetch(conn, hashes, put)
        except Exception as e:  # noqa: BLE001 - a miss, never an exception into SGLang
            self._failed(conn, "get", e)
            return [None] * len(keys)
        return out

    def get(self, key: str, target_location: Any | None = None,
            target_sizes: Any | None = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None
                              else None)[0]

    # ---- stores -----------------------------------------------------------------------------

    def _store_one(self, conn: _Conn, key_value: str, send: Any) -> bool:
        """One page: a sequence created with the page's name (a page kvbank holds is attached
        and not sent), its block appended by send(sequence id), the sequence freed."""
        pages = self.pages
        assert pages is not None
        client = conn.client
        seq = client.create_sequence(self.model, [0] * pages.tokens, lease_s=self._lease_s,
                                     extra_keys=[("custom", key_value)])
        try:
            if seq.cached_tokens < pages.tokens:
                send(seq.id)
        finally:
            try:
                client.free(self.model, seq.id)  # the published block stays cached
            except kvbank.Error:
                pass  # its lease frees it
        return True

    def _store_runs(self, conn: _Conn, values: list[str | None],
                    starts: list[int]) -> list[bool]:
        """Zero-copy stores: each page appended straight from the host pool's file (its layers,
        K and V, as runs), the whole batch in one SDK call that runs io_threads pages at once
        on the SDK's threads (put_pages_runs: no per-page work under the interpreter lock)."""
        pages = self.pages
        assert pages is not None
        idx = [i for i, v in enumerate(values) if v is not None]
        errors = conn.client.put_pages_runs(
            self.model, conn.host_region,
            [([("custom", str(values[i]))], pages.page_runs(starts[i], conn.host_offset))
             for i in idx],
            pages.run_bytes, num_tokens=pages.tokens, lease_s=self._lease_s,
            parallel=self._io_threads)
        results = [False] * len(values)
        for i, err in zip(idx, errors):
            if err is None:
                results[i] = True
            else:
                self._failed(conn, "store", err)
        return results

    def _store(self, conn: _Conn, values: list[str | None], fill: Any) -> list[bool]:
        """Stores pages i with values[i] (None: a bad key, not stored), fill(i, block view)
        copying page i into the staging buffer; a staging buffer of pages at a time, their
        sequences io_threads at once."""
        pages = self.pages
        assert pages is not None
        results = [False] * len(values)
        st = conn.store
        for c0 in range(0, len(values), conn.pages):
            idx = [i for i in range(c0, min(len(values), c0 + conn.pages))
                   if values[i] is not None]
            e = pages.page_elems
            with st.lock:
                # Each page goes out as soon as it is copied: the copies overlap the appends.
                futures = {}
                try:
                    for j, i in enumerate(idx):
                        fill(i, pages.block(st.buf, j))
                        payload = st.buf[j * e:(j + 1) * e]
                        futures[i] = self._pool.submit(
                            self._store_one, conn, str(values[i]),
                            lambda seq_id, p=payload: conn.client.append(
                                self.model, seq_id, p, num_tokens=pages.tokens))
                finally:
                    for i, f in futures.items():  # the buffer is reused once the lock is free
                        try:
                            results[i] = f.result()
                        except Exception as err:  # noqa: BLE001 - False, never an exception
                            self._failed(conn, "store", err)
        return results

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Stores the pages in the host pool's slots (page_size slots a page, in key order)
        under their keys; False for a page not stored (bad key or slot, kvbank unreachable)."""
        conn = self._connection()
        if conn is None or not keys:
            return [False] * len(keys)
        pages = self.pages
        assert pages is not None
        try:
            starts = pages.page_starts(host_indices, len(keys))
            values = [page_key_value(k) if s >= 0 else None for k, s in zip(keys, starts)]
            if conn.host_region is not None:
                return self._store_runs(conn, values, starts)
            return self._store(conn, values,
                               lambda i, block: block.copy_(pages.host_page(starts[i])))
        except Exception as e:  # noqa: BLE001 - False, never an exception into SGLang
            self._failed(conn, "store", e)
            return [False] * len(keys)

    def batch_set(self, keys: list[str], values: Any | None = None,
                  target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> bool:
        """Stores flat pages in the host pool's order (get_data_page); True when all were."""
        conn = self._connection()
        if conn is None or not keys or values is None or len(values) != len(keys):
            return False
        pages = self.pages
        assert pages is not None
        try:
            flats = [v.reshape(-1) if isinstance(v, torch.Tensor) and
                     v.numel() == pages.page_elems and v.dtype == pages.torch_dtype else None
                     for v in values]
            names = [page_key_value(k) if f is not None else None for k, f in zip(keys, flats)]
            return all(self._store(conn, names,
                                   lambda i, block: block.copy_(pages.flat_page(flats[i]))))
        except Exception as e:  # noqa: BLE001 - False, never an exception into SGLang
            self._failed(conn, "store", e)
            return False

    def set(self, key: str, value: Any | None = None, target_location: Any | None = None,
            target_sizes: Any | None = None) -> bool:
        return self.batch_set([key], [value])

    def clear(self) -> None:
        """Nothing: kvbank's blocks may be shared with other instances; they age out LRU."""

    def get_stats(self) -> None:
        return None
