"""Fixtures of the SGLang HiCache tests: the real kvbankd on loopback (with its shared-memory
plane), a client of it, and new kvbankd processes for the tests that stop one.

kvbankd is $KVBANK_KVBANKD (set by run_sglang_tests.py to the binary this build made), else
build/release/bin/kvbankd; it starts as in tests/python/conftest.py (--listen=127.0.0.1:0
--port-file --no-auth, no preset models), waited for with deadlines, stopped with SIGTERM.
"""

import os
import sys

import pytest

import kvbank

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "python"))

from kvbankd_process import Server  # noqa: E402


def start_server(tmp_path_factory, *flags):
    sock = str(tmp_path_factory.mktemp("kvbankd") / "kvbankd.sock")
    return Server(["--pool-bytes=256MiB", "--shm-socket=" + sock] + list(flags))


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    with kvbank.Client(server.target) as c:
        yield c


@pytest.fixture
def new_server(tmp_path_factory):
    """new_server(*flags): a kvbankd of the test's own (killed or stopped at the end)."""
    started = []

    def start(*flags):
        s = start_server(tmp_path_factory, *flags)
        started.append(s)
        return s

    yield start
    for s in started:
        if s.proc.poll() is None:
            s.stop()
