"""Fixtures of the vLLM connector tests: the real kvbankd on loopback, a tiny random Llama, and
run_instance (one real vLLM instance per subprocess, see instance.py).

kvbankd is $KVBANK_KVBANKD (set by run_vllm_tests.py to the binary this build made), else
build/release/bin/kvbankd; it starts as in tests/python/conftest.py (--listen=127.0.0.1:0
--port-file --no-auth, no preset models), waited for with deadlines, stopped with SIGTERM.
"""

import json
import os
import subprocess
import sys
import time

import pytest

import kvbank

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "python"))

from kvbankd_process import Server  # noqa: E402
from tiny_llama import make_tiny_llama  # noqa: E402

INSTANCE_TIMEOUT_S = 300


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    # With the shared-memory plane: instances on this host use it unless told not to.
    sock = str(tmp_path_factory.mktemp("kvbankd") / "kvbankd.sock")
    s = Server(["--pool-bytes=256MiB", "--shm-socket=" + sock])
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    with kvbank.Client(server.target) as c:
        yield c


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def run_instance(model_dir, server, tmp_path_factory):
    """run_instance(batches, role=None, max_tokens=16, **spec) -> the instance's JSON result."""
    work = tmp_path_factory.mktemp("instances")
    counter = [0]

    def run(batches, role=None, max_tokens=16, **spec):
        counter[0] += 1
        spec_path = os.path.join(str(work), "spec%d.json" % counter[0])
        out_path = os.path.join(str(work), "out%d.json" % counter[0])
        log_path = os.path.join(str(work), "log%d.txt" % counter[0])
        spec.update(model=model_dir, batches=batches, role=role, max_tokens=max_tokens,
                    target=server.target)
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
        start = time.monotonic()
        with open(log_path, "wb") as log:
            p = subprocess.run([sys.executable, os.path.join(HERE, "instance.py"), spec_path,
                                out_path], stdout=log, stderr=subprocess.STDOUT, env=env,
                               timeout=INSTANCE_TIMEOUT_S)
        with open(log_path, errors="replace") as f:
            log_text = f.read()
        assert p.returncode == 0, "vLLM instance (%s) failed:\n%s" % (role, log_text[-6000:])
        with open(out_path) as f:
            out = json.load(f)
        out["log"] = log_text
        print("[vllm] instance %s: %.1f s (engine start %.1f s)"
              % (role or "no connector", time.monotonic() - start, out["startup_s"]))
        return out

    return run
