"""The Python SDK against a server that lies (a fake kvbank.v1 server on grpcio, and fake
shared-memory sockets): it uses a shared-memory socket only for a server on this host, hands
memory only to a socket of this user or root, and never copies more than the buffer it was
given, whatever payload_bytes the server claims."""

import os
import socket
import struct
import tempfile
import threading
from concurrent import futures

import grpc
import numpy as np
import pytest

import kvbank

# ---- protobuf by hand (a few fields of kvbank.v1 messages) -----------------------------------


def _varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field_varint(field, n):
    return _varint(field << 3) + _varint(n)


def _field_bytes(field, data):
    if isinstance(data, str):
        data = data.encode()
    return _varint(field << 3 | 2) + _varint(len(data)) + data


def _boot_id():
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


SHM_MAGIC = b"KVBSHM01"


class FakeShmSocket:
    """A Unix socket that takes a region the way kvbankd's --shm-socket does (the hello and its
    memfd, then a reply with a handle and the size), and counts what it got."""

    def __init__(self, path):
        self.path = path
        self.connections = 0
        self.descriptors = 0
        self._held = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(16)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            try:
                msg, fds, _, _ = socket.recv_fds(conn, 8, 4)
            except OSError:
                conn.close()
                continue
            self.descriptors += len(fds)
            if msg != SHM_MAGIC or len(fds) != 1:
                conn.close()
                continue
            size = os.fstat(fds[0]).st_size
            conn.sendall(struct.pack("<8sII16sQ", SHM_MAGIC, 0, 0, os.urandom(16), size))
            self._held.append((conn, fds[0]))  # the region lives while the connection does

    def close(self):
        self._sock.close()
        for conn, fd in self._held:
            conn.close()
            os.close(fd)


class FakeKvbank(grpc.GenericRpcHandler):
    """kvbank.v1.KvBank as a liar: GetServerInfo names whatever socket and host it is told,
    RegisterRegion takes any handle, Fetch into a region claims `payload_bytes`."""

    def __init__(self, shm_socket, host_id, payload_bytes=0):
        self.shm_socket = shm_socket
        self.host_id = host_id
        self.payload_bytes = payload_bytes
        self.fetches = 0

    def service(self, details):
        m = details.method
        if m == "/kvbank.v1.KvBank/GetServerInfo":
            info = (_field_bytes(1, "0.1.0-fake") + _field_bytes(2, self.shm_socket) +
                    _field_bytes(7, self.host_id))
            return grpc.unary_unary_rpc_method_handler(lambda req, ctx: info)
        if m == "/kvbank.v1.KvBank/RegisterRegion":
            return grpc.unary_unary_rpc_method_handler(
                lambda req, ctx: _field_varint(1, 7) + _field_varint(2, 8 << 20))
        if m == "/kvbank.v1.KvBank/Fetch":
            def fetch(req, ctx):
                self.fetches += 1
                header = (_field_varint(2, 1) + _field_varint(4, 1) + _field_varint(5, 2) +
                          _field_varint(6, self.payload_bytes))
                yield _field_bytes(1, header)
            return grpc.unary_stream_rpc_method_handler(fetch)
        return None


@pytest.fixture
def fake():
    """(start(shm_socket, host_id, payload_bytes) -> (target, handler), tmpdir)."""
    servers = []
    tmp = tempfile.mkdtemp(prefix="kvbank-fake-")

    def start(shm_socket, host_id, payload_bytes=0):
        handler = FakeKvbank(shm_socket, host_id, payload_bytes)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}", handler

    yield start, tmp
    for s in servers:
        s.stop(0)


def test_a_socket_named_by_a_server_on_another_host_is_not_used(fake):
    start, tmp = fake
    shm = FakeShmSocket(os.path.join(tmp, "shm.sock"))
    target, _ = start(shm.path, "another-host-boot-id")
    with kvbank.Client(target) as c:
        assert c.data_plane == "grpc", "a remote server's socket path was taken as this host's"
        with pytest.raises(kvbank.FailedPreconditionError):
            c.register_region(1 << 20)
    assert shm.connections == 0
    shm.close()


def test_payload_bytes_past_the_buffer_are_an_error_not_a_copy(fake):
    start, tmp = fake
    shm = FakeShmSocket(os.path.join(tmp, "shm.sock"))
    # The server claims a 1 GiB payload for a 2 MiB buffer (through an 8 MiB staging region).
    target, handler = start(shm.path, _boot_id(), payload_bytes=1 << 30)
    with kvbank.Client(target) as c:
        assert c.data_plane == "shm"
        out = np.zeros(2 << 20, dtype=np.uint8)
        with pytest.raises(kvbank.InternalError, match="payload bytes"):
            c.fetch_into("m", 1, out)
        assert handler.fetches == 1
        assert not out.any(), "bytes were copied from a region the server lied about"
        # The staging region of the failed call is never used again.
        assert c.plane_stats()["shm_staged"]["dropped"] == 1
    shm.close()


def test_memory_goes_only_to_a_socket_of_this_user(fake):
    if os.geteuid() != 0:
        pytest.skip("serving a socket as another user needs root (setuid)")
    start, tmp = fake
    os.chmod(tmp, 0o777)
    path = os.path.join(tmp, "foreign.sock")
    ready_r, ready_w = os.pipe()
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other user's "server": reports whether a descriptor reached it
        try:
            os.close(ready_r)
            os.close(report_r)
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(path)
            s.listen(1)
            os.write(ready_w, b"1")
            conn, _ = s.accept()
            conn.settimeout(10)
            try:
                _, fds, _, _ = socket.recv_fds(conn, 8, 4)
            except OSError:
                fds = []
            os.write(report_w, str(len(fds)).encode())
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(report_w)
    assert os.read(ready_r, 1) == b"1"
    target, _ = start(path, _boot_id())
    try:
        with kvbank.Client(target, shm=path) as c:
            with pytest.raises(kvbank.PermissionDeniedError, match="uid 65534"):
                c.register_region(1 << 20)
        assert os.read(report_r, 16) == b"0", "a descriptor of this process reached another user"
    finally:
        os.waitpid(pid, 0)
