"""kvbankd as a child process for the Python test suites (tests/python, tests/vllm): started
like the C++ integration tests start it (tests/integration/server_fixture.cc):
--listen=127.0.0.1:0 --port-file --no-auth, no preset models; waited for (port file, then
SERVING) with deadlines; stopped with SIGTERM, expecting exit status 0 within a bounded wait.
kvbankd is $KVBANK_KVBANKD (set by ctest to the binary this build made), else
build/release/bin/kvbankd; $KVBANK_TEST_DEVICE picks its pool memory.
"""

import os
import signal
import subprocess
import tempfile
import time

import pytest

import kvbank

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def kvbankd_path():
    path = os.environ.get("KVBANK_KVBANKD") or os.path.join(REPO, "build", "release", "bin",
                                                            "kvbankd")
    if not os.access(path, os.X_OK):
        pytest.exit(f"no kvbankd at {path} (build it, or set KVBANK_KVBANKD)", returncode=2)
    return path


class Server:
    def __init__(self, flags=(), *, no_auth=True, client_args=None):
        """flags: kvbankd's beyond the defaults above; no_auth=False leaves --no-auth out (pass
        --auth-tokens-file). client_args: kvbank.Client's keyword arguments for the serving
        check (a token, tls)."""
        self.dir = tempfile.mkdtemp(prefix="kvbank-py-")
        port_file = os.path.join(self.dir, "port")
        self.log_path = os.path.join(self.dir, "server.log")
        args = [kvbankd_path(), "--listen=127.0.0.1:0", "--port-file=" + port_file, "--models="]
        if no_auth:
            args.append("--no-auth")
        device = os.environ.get("KVBANK_TEST_DEVICE")
        if device:
            args.append("--device=" + device)
        args += list(flags)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        self.port = 0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvbankd exited with {self.proc.returncode} before serving:\n"
                                   + self.log())
            try:
                with open(port_file) as f:
                    self.port = int(f.read().strip() or 0)
            except (OSError, ValueError):
                self.port = 0
            if self.port > 0:
                break
            time.sleep(0.01)
        if self.port <= 0:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError("kvbankd wrote no port file within 20 s:\n" + self.log())
        self.target = f"127.0.0.1:{self.port}"
        kvbank.Client(self.target, **(client_args or {})).check_serving(20.0)

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("kvbankd did not exit within 30 s of SIGTERM:\n"
                                 + self.log()) from None
        assert rc == 0, f"kvbankd exited with {rc}:\n{self.log()}"
