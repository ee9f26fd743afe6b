"""Fixtures of the Python SDK tests: the real kvbankd on loopback (kvbankd_process.Server), a
kvbank.Client on it."""

import pytest

import kvbank

from kvbankd_process import REPO, Server  # noqa: F401  (REPO: the tests import it from here)


@pytest.fixture(scope="session")
def server():
    s = Server(["--pool-bytes=64MiB"])
    yield s
    s.stop()


@pytest.fixture
def client(server):
    with kvbank.Client(server.target) as c:
        yield c


_model_counter = [0]


@pytest.fixture
def model_name():
    """A fresh model name per test (one server serves every test of the run)."""
    _model_counter[0] += 1
    return f"m{_model_counter[0]}"
