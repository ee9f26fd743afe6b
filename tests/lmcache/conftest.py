"""Fixtures of the LMCache plugin tests: the real kvbankd on loopback (with its shared-memory
socket) and run_worker (one LMCacheEngine per subprocess, see engine_worker.py).

kvbankd is $KVBANK_KVBANKD (set by run_lmcache_tests.py to the binary this build made), else
build/release/bin/kvbankd; it starts as in tests/python/conftest.py (--listen=127.0.0.1:0
--port-file --no-auth, no preset models), waited for with deadlines, stopped with SIGTERM.
"""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "python"))

from kvbankd_process import Server  # noqa: E402

WORKER_TIMEOUT_S = 300
# Chunk keys hash token ids with Python's hash(): the engines that share chunks share a seed.
HASH_SEED = "20261203"


def start_server(tmp_path_factory, *flags):
    sock = str(tmp_path_factory.mktemp("kvbankd") / "kvbankd.sock")
    return Server(["--pool-bytes=256MiB", "--shm-socket=" + sock, *flags])


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory)
    yield s
    s.stop()


@pytest.fixture
def own_server(tmp_path_factory):
    """A kvbankd of the test's own (one the test may kill)."""
    s = start_server(tmp_path_factory)
    yield s
    if s.proc.poll() is None:
        s.stop()


@pytest.fixture(scope="session")
def run_worker(tmp_path_factory):
    """run_worker(target, mode, prompts) -> engine_worker.py's JSON result."""
    work = tmp_path_factory.mktemp("workers")
    counter = [0]

    def run(target, mode, prompts):
        counter[0] += 1
        spec_path = os.path.join(str(work), f"spec{counter[0]}.json")
        out_path = os.path.join(str(work), f"out{counter[0]}.json")
        with open(spec_path, "w") as f:
            json.dump({"target": target, "mode": mode, "prompts": prompts}, f)
        env = dict(os.environ, PYTHONHASHSEED=HASH_SEED)
        p = subprocess.run([sys.executable, os.path.join(HERE, "engine_worker.py"), spec_path,
                            out_path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           env=env, timeout=WORKER_TIMEOUT_S)
        log = p.stdout.decode(errors="replace")
        assert p.returncode == 0, f"engine worker ({mode}) failed:\n{log[-6000:]}"
        with open(out_path) as f:
            out = json.load(f)
        out["log"] = log
        return out

    return run
