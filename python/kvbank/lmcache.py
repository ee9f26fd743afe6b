"""kvbank.lmcache.KvbankConnector: kvbank as a remote store of LMCache (v1).

LMCache loads it as a remote storage plugin (LMCache's YAML, or LMCACHE_* variables):

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 5
    remote_storage_plugins: ["kvbank"]
    extra_config:
      remote_storage_plugin.kvbank.module_path: kvbank.lmcache
      remote_storage_plugin.kvbank.class_name: KvbankConnector
      remote_storage_plugin.kvbank.target: "127.0.0.1:50051"

extra_config keys (remote_storage_plugin.<name>.<key>; <name> is the plugin's name in
remote_storage_plugins, one kvbank plugin per engine):
  target       "host:port", "dns:///name:port" or "unix:/path" of kvbankd (required)
  token        bearer token (default: none); or token_file, a file holding it
  tls_ca       path of the CA bundle that signs kvbankd's certificate (default: plaintext);
               tls_server_name, tls_cert / tls_key beside it (kvbank/_connector_config.py)
  model        the kvbank model the chunks are stored in (default: "lmcache-t<T>-d<D>", from the
               layout below, so every LMCache instance of the same KV shape finds the others')
  pool_bytes   pool bytes when the model is first registered (default 0: the server's)
  deadline_s   deadline of each kvbank call (default 5)
  shm          use kvbankd's same-host shared-memory plane when it serves one (default true)
  threads      threads making the kvbank calls (default 4)
  retry_s      after a failed connection, calls are misses for this long before the next try
               (default 1)
  zero_copy    "auto" (default): zero-copy when LMCache's CPU buffer is in shared memory (below);
               "false": always through the client's staging regions

Zero-copy. With LMCache's own `shm_name` in extra_config (extra_config: {shm_name: NAME}), its
local CPU buffer is the POSIX shared-memory file /dev/shm/NAME. When kvbankd serves the
same-host plane, the connector registers that file with kvbankd as a region
(register_region_fd): a put appends a chunk straight from its MemoryObj and a get fetches a chunk
straight into the MemoryObj LMCache allocated, with no copy in this process (LMCache's Mooncake
connector registers the same buffer with Mooncake). Chunks outside that buffer, unfull chunks
being stored (their last block padded) and a kvbankd on another host go through the client's
staging regions as before. A zero-copy get that fails keeps its MemoryObj from LMCache for 2 s:
kvbankd stops writing into it at its next piece, never into a chunk allocated meanwhile.

Mapping. kvbank stores KV by block under a prefix hash; LMCache stores opaque chunks under a
key. A chunk is stored as one kvbank sequence of a model registered for the purpose: one layer,
fp16, MLA-shaped (one vector of D elements per kvbank token, so a token range is a byte range),
with T kvbank tokens per block, chosen so that one kvbank block holds g LMCache tokens
(g = gcd(chunk_size, 16)): a full chunk is chunk_size / g blocks, and a chunk of n < chunk_size
tokens (save_unfull_chunk) is ceil(n / g) blocks, its last one padded. The chunk's bytes are
the payload as they are (an fp16 copy is bit-exact whatever the bytes). The sequence is created
with n repeated as its token ids and the hex SHA-256 of LMCache's key string as a "custom" extra
key, then freed: its blocks stay in kvbank's prefix cache, named by their prefix hashes, which
any process computes from the key alone (LMCache's chunk hashes use Python's hash(): the
processes that share chunks run with one PYTHONHASHSEED). Because the token count is hashed into
every block, a run of blocks cut short by eviction names no chunk of another length: get fetches
the chain of a full chunk (FetchBlocks straight into the MemoryObj's buffer, over shared memory
on the same host) and takes it only when every block came back; with save_unfull_chunk on, a
chunk that is not found whole (the last key of a lookup) is looked for at every shorter length
with one Match of their first blocks. exists and batched_contains are one Match call for all the
keys.

Failures (server down, deadline, a chain that is not whole, a chunk of a size this engine does
not use) are misses and False, logged, never an exception into LMCache and never other bytes:
a fetch that does not return every block of the chain gives the buffer back to LMCache's
allocator and reports a miss.

Not supported: list() (kvbank keeps hashes, not keys: it returns []), remove, layer-wise
LMCache (use_layerwise), several kvbank plugins in one engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import numpy as np
from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

import kvbank

from ._connector_config import client_settings

logger = init_logger(__name__)

_T = TypeVar("_T")

MAX_HEAD_DIM = 4096  # kvbank's bounds on a layout (base/layout.cc)
MAX_BLOCK_TOKENS = 4096
# How long the buffer of a failed zero-copy get is kept from LMCache: kvbankd's copy into it
# stops at its next piece (at most a few milliseconds) once the call has ended.
_SPOILT_S = 2.0
_RECONNECT_ERRORS = (kvbank.UnavailableError, kvbank.DeadlineExceededError,
                     kvbank.NotFoundError, kvbank.CancelledError)


def chunk_layout(token_bytes: int, chunk_tokens: int) -> tuple[dict[str, Any], int]:
    """The kvbank layout that holds LMCache chunks of `token_bytes` bytes per LMCache token, and
    g, the LMCache tokens per kvbank block. One fp16 MLA layer of D elements per kvbank token
    (D: the largest divisor of token_bytes / 2 kvbank takes), T kvbank tokens per block."""
    if token_bytes <= 0 or token_bytes % 2:
        raise ValueError(f"an LMCache token of {token_bytes} bytes is not a whole number of "
                         "fp16 elements")
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_size {chunk_tokens}")
    elems = token_bytes // 2
    d = next(x for x in range(min(MAX_HEAD_DIM, elems), 0, -1) if elems % x == 0)
    per_token = elems // d  # kvbank tokens per LMCache token
    g = math.gcd(chunk_tokens, 16)
    while g > 1 and g * per_token > MAX_BLOCK_TOKENS:
        g = math.gcd(chunk_tokens, g // 2)
    t = g * per_token
    if t > MAX_BLOCK_TOKENS:
        raise ValueError(f"an LMCache token of {token_bytes} bytes needs {t} kvbank tokens per "
                         f"block, more than kvbank's {MAX_BLOCK_TOKENS}")
    layout = {"num_layers": 1, "num_q_heads": 1, "num_kv_heads": 1, "kind": "mla",
              "kv_lora_rank": d, "rope_dim": 0, "head_dim": d, "head_dim_v": d,
              "block_tokens": t, "dtype": "fp16"}
    return layout, g


@dataclass
class _Connection:
    client: kvbank.Client
    root: bytes
    algorithm: str
    # Zero-copy: LMCache's CPU buffer's file as a region of this client (register_region_fd).
    region: np.ndarray | None = None


@dataclass
class _SharedBuffer:
    """LMCache's local CPU buffer where it lies in a shared-memory file: the file (a descriptor
    this connector holds until close), the buffer's address and size in this process, and its
    first byte's offset in the file."""
    fd: int
    address: int
    size: int
    offset: int


def _address(buf: memoryview) -> int:
    """The address of a buffer's first byte (numpy's array interface: no copy, no ctypes)."""
    return int(np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0])


def shared_buffer(local_cpu_backend: Any) -> tuple[_SharedBuffer | None, str]:
    """(LMCache's CPU buffer as a _SharedBuffer, "") when the buffer is in a shared-memory file
    (LMCache's extra_config shm_name); else (None, why not). The file is checked to be the one
    this process maps at the buffer's address (by device and inode in /proc/self/maps), so a
    stale file of the same name is never taken for it."""
    allocator = getattr(local_cpu_backend, "memory_allocator", None)
    name = getattr(allocator, "shm_name", None)
    buffer = getattr(allocator, "buffer", None)
    if not name or buffer is None:
        return None, "LMCache's CPU buffer is not in shared memory (set extra_config shm_name)"
    address, size = int(buffer.data_ptr()), int(buffer.numel() * buffer.element_size())
    path = os.path.join("/dev/shm", str(name).lstrip("/"))
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        return None, f"cannot open {path}: {e}"
    try:
        st = os.fstat(fd)
        with open("/proc/self/maps", encoding="ascii") as maps:
            for line in maps:
                fields = line.split()
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if not start <= address < end:
                    continue
                major, minor = (int(x, 16) for x in fields[3].split(":"))
                offset = int(fields[2], 16) + address - start
                if ((major, minor, int(fields[4])) != (os.major(st.st_dev), os.minor(st.st_dev),
                                                       st.st_ino)):
                    break
                if address + size > end or offset + size > st.st_size:
                    break
                return _SharedBuffer(fd, address, size, offset), ""
        os.close(fd)
        return None, f"LMCache's CPU buffer is not the file {path}"
    except (OSError, ValueError, IndexError) as e:
        os.close(fd)
        return None, f"cannot check {path}: {e}"


class KvbankConnector(RemoteConnector):
    """LMCache's RemoteConnector over kvbank (see the module's docstring).

    LMCache builds it as loop=, local_cpu_backend=, config= (a remote storage plugin); the
    coroutines run the blocking kvbank calls on the connector's own threads, exists_sync and
    batched_contains on the caller's. Thread-safe."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any):
        super().__init__(config, local_cpu_backend.metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.plugin_name = self._plugin_name(config)
        extra = dict(config.extra_config or {})
        prefix = f"remote_storage_plugin.{self.plugin_name}."
        opts = {k[len(prefix):]: v for k, v in extra.items() if k.startswith(prefix)}

        settings = client_settings(opts, f"KvbankConnector: extra_config {prefix}", prefix="",
                                   deadline_s=5.0)
        self.target = settings["target"]
        if getattr(config, "use_layerwise", False):
            raise ValueError("kvbank's LMCache connector does not store layer-wise chunks")
        self.chunk_tokens = int(local_cpu_backend.metadata.chunk_size)
        self.layout, self.g = chunk_layout(self.single_token_size, self.chunk_tokens)
        self.block_tokens = int(self.layout["block_tokens"])
        self.block_bytes = self.g * self.single_token_size
        self.model = str(opts.get("model") or
                         f"lmcache-t{self.block_tokens}-d{self.layout['head_dim']}")
        self.unfull = bool(getattr(config, "save_unfull_chunk", False))
        self._token = settings["token"]
        self._tls: dict[str, str] | None = settings["tls"]
        self._deadline_s = float(settings["deadline_s"])
        self._pool_bytes = int(opts.get("pool_bytes", 0))
        self._shm = bool(settings["shm"])
        self._retry_s = float(opts.get("retry_s", 1.0))
        threads = int(opts.get("threads", 4))
        if threads < 1:
            raise ValueError(f"extra_config {prefix}threads must be positive, not {threads}")

        zero_copy = str(opts.get("zero_copy", "auto")).lower()
        if zero_copy not in ("auto", "false"):
            raise ValueError(f"extra_config {prefix}zero_copy must be auto or false, not "
                             f"{zero_copy!r}")
        self._shared: _SharedBuffer | None = None
        if zero_copy == "auto" and self._shm:
            self._shared, why = shared_buffer(local_cpu_backend)
            if self._shared is None:
                logger.info("KvbankConnector: chunks copied through staging regions: %s", why)

        self._lock = threading.Lock()
        self._conn: _Connection | None = None
        # Buffers of failed zero-copy gets, held until (monotonic time) kvbankd cannot be
        # writing into them any more.
        self._spoilt: list[tuple[float, MemoryObj]] = []
        self._retry_at = 0.0
        self._closed = False
        self._threads = threads
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="kvbank-lmcache")
        conn = self._connection()
        logger.info("KvbankConnector %r: kvbank model %r at %s, %d LMCache tokens (%d bytes) per "
                    "block, data plane %s%s", self.plugin_name, self.model, self.target, self.g,
                    self.block_bytes, conn.client.data_plane if conn else "not connected yet",
                    ", zero-copy" if conn is not None and conn.region is not None else "")

    @classmethod
    def _plugin_name(cls, config: Any) -> str:
        """The name under which config's remote_storage_plugins names this class."""
        extra = config.extra_config or {}
        for name in config.remote_storage_plugins or ():
            if (extra.get(f"remote_storage_plugin.{name}.class_name") == cls.__name__
                    and extra.get(f"remote_storage_plugin.{name}.module_path") == __name__):
                return str(name)
        raise ValueError(f"no remote_storage_plugins entry names {__name__}.{cls.__name__}")

    # ---- connection -----------------------------------------------------------------------

    def _connection(self) -> _Connection | None:
        """The connection, made when there is none (not more often than every retry_s); None
        while kvbankd cannot be reached."""
        with self._lock:
            if self._conn is not None or self._closed:
                return self._conn
            now = time.monotonic()
            if now < self._retry_at:
                return None
            try:
                client = kvbank.Client(self.target, self._token, deadline_s=self._deadline_s,
                                       stream_deadline_s=self._deadline_s * 4, tls=self._tls,
                                       shm=self._shm)
                client.ensure_model(dict(self.layout, name=self.model),
                                    pool_bytes=self._pool_bytes)
                root = client.get_prefix_root(self.model)
                if root.block_tokens != self.block_tokens:
                    raise ValueError(f"kvbank model {self.model!r} has {root.block_tokens}-token "
                                     f"blocks, this engine's chunks need {self.block_tokens}")
            except Exception as e:  # a miss until the next try, whatever went wrong
                self._retry_at = now + self._retry_s
                logger.warning("KvbankConnector: cannot use kvbank at %s: %s", self.target, e)
                return None
            self._conn = _Connection(client, root.root, root.algorithm)
            if self._shared is not None and client.data_plane == "shm":
                try:
                    self._conn.region = client.register_region_fd(self._shared.fd)
                except kvbank.Error as e:
                    logger.warning("KvbankConnector: LMCache's CPU buffer cannot be a region "
                                   "(%s): chunks copied through staging regions", e)
            return self._conn

    def _in_region(self, conn: _Connection, buf: memoryview) -> Any:
        """buf's bytes as the same bytes of the registered region (a numpy view) when buf lies
        in LMCache's shared CPU buffer (then they move without a copy here); else buf itself."""
        shared = self._shared
        if conn.region is None or shared is None:
            return buf
        at = _address(buf) - shared.address
        if at < 0 or at + buf.nbytes > shared.size:
            return buf
        at += shared.offset  # the buffer's place in its file: the region's offset
        return conn.region[at:at + buf.nbytes]

    def _failed(self, what: str, conn: _Connection, e: BaseException) -> None:
        logger.warning("KvbankConnector: %s failed: %s", what, e)
        if isinstance(e, _RECONNECT_ERRORS):
            # kvbankd went away or restarted (its models with it): connect again next time.
            with self._lock:
                if self._conn is conn:
                    self._conn = None

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _map(self, fn: Callable[..., _T], calls: list[tuple[Any, ...]]) -> list[_T]:
        """[fn(*c) for c in calls] on the connector's threads, the event loop woken once a
        thread rather than once a call (on a busy host, a wake-up of the loop's thread a chunk
        takes CPU from the copies)."""
        out: list[Any] = [None] * len(calls)
        todo = iter(range(len(calls)))
        lock = threading.Lock()

        def work() -> None:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                out[i] = fn(*calls[i])

        await asyncio.gather(*(self._run(work) for _ in range(min(self._threads, len(calls)))))
        return out

    # ---- names ----------------------------------------------------------------------------

    @staticmethod
    def _digest(key: CacheEngineKey) -> str:
        # Hex, not the raw digest: extra keys travel as UTF-8 strings.
        return hashlib.sha256(key.to_string().encode()).hexdigest()

    def _chain(self, conn: _Connection, digest: str, n: int,
               blocks: int | None = None) -> list[bytes]:
        """The prefix hashes of the blocks of a chunk of n LMCache tokens (of its first
        `blocks` blocks when given)."""
        if blocks is None:
            blocks = -(-n // self.g)
        return kvbank.prefix_hashes(conn.root, [n] * (blocks * self.block_tokens),
                                    self.block_tokens, [("custom", digest)],
                                    algorithm=conn.algorithm)

    def _whole(self, conn: _Connection, chains: list[list[bytes]]) -> list[bool]:
        """Whether every block of each chain is cached: one Match call."""
        if not chains:
            return []
        tokens = conn.client.match(self.model, chains)
        return [t >= len(c) * self.block_tokens for t, c in zip(tokens, chains)]

    def _unfull_length(self, conn: _Connection, digest: str) -> int | None:
        """The length of the chunk under `digest` stored shorter than chunk_size, if one is
        whole in kvbank: one Match of every length's first block, one of the chain found."""
        firsts = [self._chain(conn, digest, n, 1) for n in range(1, self.chunk_tokens)]
        tokens = conn.client.match(self.model, firsts)
        for n in (i + 1 for i, t in enumerate(tokens) if t > 0):
            if self._whole(conn, [self._chain(conn, digest, n)])[0]:
                return n
        return None

    # ---- lookups --------------------------------------------------------------------------

    def _contains(self, keys: list[CacheEngineKey]) -> int:
        """How many leading keys name a whole chunk in kvbank (0 on any failure). Only the
        last key of a run can name an unfull chunk (LMCache's keys of one prompt are full
        chunks but the last), so only a miss there is looked for at shorter lengths."""
        conn = self._connection()
        if conn is None or not keys:
            return 0
        try:
            digests = [self._digest(k) for k in keys]
            whole = self._whole(conn, [self._chain(conn, d, self.chunk_tokens)
                                       for d in digests])
            count = 0
            while count < len(keys) and whole[count]:
                count += 1
            if (count == len(keys) - 1 and self.unfull and
                    self._unfull_length(conn, digests[count]) is not None):
                count += 1
            return count
        except Exception as e:
            self._failed("lookup", conn, e)
            return 0

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self._contains([key]) == 1

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self._run(self._contains, [key]) == 1

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        return self._contains(list(keys))

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey],
                                     pin: bool = False) -> int:
        return await self._run(self._contains, list(keys))

    # ---- get ------------------------------------------------------------------------------

    def _get(self, key: CacheEngineKey) -> MemoryObj | None:
        conn = self._connection()
        if conn is None:
            return None
        obj = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
        if obj is None:
            logger.warning("KvbankConnector: LMCache's CPU buffer is full; a miss")
            return None
        self._release_spoilt(time.monotonic())
        own = memoryview(obj.byte_array).cast("B")
        buf = own
        try:
            buf = self._in_region(conn, own)
            n = self._fetch_into(conn, self._digest(key), buf)
        except Exception as e:
            self._failed("get", conn, e)
            if buf is not own:
                # kvbankd stops writing into the buffer at its next piece once a failed call has
                # ended: the buffer goes back to LMCache only after that, not into another chunk.
                with self._lock:
                    self._spoilt.append((time.monotonic() + _SPOILT_S, obj))
                return None
            n = None
        if n is None:
            obj.ref_count_down()
            return None
        if n < self.chunk_tokens:
            obj = self.reshape_partial_chunk(obj, n * self.single_token_size)
        return obj

    def _release_spoilt(self, now: float) -> None:
        """Gives LMCache back the buffers of failed zero-copy gets held long enough."""
        with self._lock:
            due = [o for t, o in self._spoilt if t <= now]
            self._spoilt = [(t, o) for t, o in self._spoilt if t > now]
        for obj in due:
            obj.ref_count_down()

    def _fetch_into(self, conn: _Connection, digest: str, buf: Any) -> int | None:
        """Fetches the chunk into buf (a full chunk's bytes); its LMCache tokens, or None when
        no whole chain came back."""
        chain = self._chain(conn, digest, self.chunk_tokens)
        got = self._fetch_chain(conn, chain, buf)
        if got == len(chain) * self.block_bytes:
            return self.chunk_tokens
        if got or not self.unfull:
            return None  # cut short by eviction: not a chunk
        n = self._unfull_length(conn, digest)
        if n is None:
            return None
        chain = self._chain(conn, digest, n)
        return n if self._fetch_chain(conn, chain, buf) == len(chain) * self.block_bytes else None

    def _fetch_chain(self, conn: _Connection, chain: list[bytes], buf: Any) -> int:
        """FetchBlocks of the chain into buf: the bytes written (0 when its first block is not
        cached: kvbank answers NOT_FOUND then)."""
        try:
            return conn.client.fetch_blocks_into(self.model, chain, buf).payload_bytes
        except kvbank.NotFoundError:
            return 0

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return await self._run(self._get, key)

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        return await self._map(self._get, [(k,) for k in keys])

    # ---- put ------------------------------------------------------------------------------

    def _put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        """Stores the chunk unless kvbank holds it whole already. The caller keeps memory_obj
        (and its reference) until this returns."""
        data = memoryview(memory_obj.byte_array).cast("B")
        n, rest = divmod(data.nbytes, self.single_token_size)
        if rest or not 0 < n <= self.chunk_tokens:
            logger.warning("KvbankConnector: a chunk of %d bytes is not a whole number (1 to "
                           "%d) of %d-byte tokens; not stored", data.nbytes, self.chunk_tokens,
                           self.single_token_size)
            return
        conn = self._connection()
        if conn is None:
            return
        blocks = -(-n // self.g)
        total = blocks * self.block_tokens
        try:
            seq = conn.client.create_sequence(self.model, prompt=[n] * total,
                                              extra_keys=[("custom", self._digest(key))])
        except Exception as e:
            self._failed("put", conn, e)
            return
        try:
            if seq.cached_tokens < total:
                payload: Any = self._in_region(conn, data)
                if data.nbytes < blocks * self.block_bytes:  # an unfull chunk: pad its block
                    padded = bytearray(blocks * self.block_bytes)
                    padded[:data.nbytes] = data
                    payload = memoryview(padded)
                token_bytes = self.block_bytes // self.block_tokens
                conn.client.append(self.model, seq.id,
                                   payload[seq.cached_tokens * token_bytes:],
                                   num_tokens=total - seq.cached_tokens)
        except Exception as e:
            self._failed("put", conn, e)
        finally:
            try:
                conn.client.free(self.model, seq.id)  # the published blocks stay cached
            except Exception as e:
                self._failed("free", conn, e)

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self._run(self._put, key, memory_obj)

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey],
                          memory_objs: list[MemoryObj]) -> None:
        await self._map(self._put, list(zip(keys, memory_objs)))

    # ---- the rest -------------------------------------------------------------------------

    async def list(self) -> list[str]:
        """kvbank names chunks by hashes of their keys: the keys cannot be listed."""
        return []

    def remove_sync(self, key: CacheEngineKey) -> bool:
        return False  # kvbank evicts by LRU; a chunk is not removed by key

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        def check() -> int:
            conn = self._connection()
            if conn is None:
                return 1
            try:
                conn.client.check_serving(self._deadline_s)
                return 0
            except Exception as e:
                self._failed("ping", conn, e)
                return 1
        return await self._run(check)

    async def close(self) -> None:
        with self._lock:
            self._closed = True
            conn, self._conn = self._conn, None
        self._pool.shutdown(wait=True)
        if conn is not None:
            conn.client.close()
        self._release_spoilt(float("inf"))
        if self._shared is not None:
            os.close(self._shared.fd)
            self._shared = None

    def __repr__(self) -> str:
        return f"<KvbankConnector {self.target} model={self.model}>"
