"""The engine connectors' kvbank_* settings (kvbank/_connector_config.py): what each becomes,
what is refused with the key named, and a kvbankd with TLS and bearer tokens reached through
them (a token file and a CA file, as a Kubernetes Secret mounts them)."""

import os
import subprocess
import tempfile

import pytest

import kvbank
from kvbank._connector_config import client_settings

from kvbankd_process import Server

WHO = "TestConnector: extra"


def write(path, text):
    with open(path, "w") as f:
        f.write(text)
    return path


def test_defaults_and_plain_settings():
    s = client_settings({"kvbank_target": "127.0.0.1:1", "kvbank_token": "t0k",
                         "kvbank_shm": "off", "kvbank_deadline_s": "7.5"}, WHO)
    assert s == {"target": "127.0.0.1:1", "token": "t0k", "tls": None, "deadline_s": 7.5,
                 "shm": False, "device_plane": "auto"}
    s = client_settings({"kvbank_target": "h:2"}, WHO)
    assert s["token"] is None and s["tls"] is None and s["shm"] is True


def test_token_file_is_read_and_stripped(tmp_path):
    path = write(tmp_path / "token", "  secret-token\n")
    s = client_settings({"kvbank_target": "h:1", "kvbank_token_file": str(path)}, WHO)
    assert s["token"] == "secret-token"


@pytest.mark.parametrize("extra, names", [
    ({}, "kvbank_target"),
    ({"kvbank_target": "h:1", "kvbank_token": "a", "kvbank_token_file": "/etc/hostname"},
     "kvbank_token and kvbank_token_file"),
    ({"kvbank_target": "h:1", "kvbank_token_file": "/nonexistent/token"},
     "kvbank_token_file '/nonexistent/token' is not a file"),
    ({"kvbank_target": "h:1", "kvbank_tls_server_name": "kvbank"}, "need kvbank_tls_ca"),
    ({"kvbank_target": "h:1", "kvbank_tls_ca": "/nonexistent/ca.pem"},
     "kvbank_tls_ca '/nonexistent/ca.pem' is not a file"),
    ({"kvbank_target": "h:1", "kvbank_tls_ca": "/etc/hostname", "kvbank_tls_cert": "/etc/hostname"},
     "kvbank_tls_cert and kvbank_tls_key go together"),
])
def test_bad_settings_name_the_key(extra, names):
    with pytest.raises(ValueError) as e:
        client_settings(extra, WHO)
    assert names in str(e.value)
    assert str(e.value).startswith(WHO)


def test_empty_token_file_is_refused(tmp_path):
    path = write(tmp_path / "token", "\n")
    with pytest.raises(ValueError, match="is empty"):
        client_settings({"kvbank_target": "h:1", "kvbank_token_file": str(path)}, WHO)


def openssl(*args):
    r = subprocess.run(["openssl", *args], capture_output=True, text=True)
    assert r.returncode == 0, f"openssl {' '.join(args)}: {r.stderr}"


@pytest.fixture(scope="module")
def tls_server():
    """kvbankd serving TLS (a test CA's certificate for 127.0.0.1) and bearer tokens."""
    d = tempfile.mkdtemp(prefix="kvbank-tls-py-")
    p = lambda name: os.path.join(d, name)  # noqa: E731
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", p("ca.key"), "-out", p("ca.pem"), "-days", "2",
            "-subj", "/CN=kvbank-test-ca", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    write(p("server.ext"), "basicConstraints=critical,CA:FALSE\n"
          "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
          "subjectAltName=IP:127.0.0.1,DNS:kvbank.test\n")
    openssl("req", "-new", *ec, "-keyout", p("server.key"), "-out", p("server.csr"),
            "-subj", "/CN=127.0.0.1")
    openssl("x509", "-req", "-in", p("server.csr"), "-CA", p("ca.pem"), "-CAkey", p("ca.key"),
            "-set_serial", "7001", "-days", "2", "-extfile", p("server.ext"), "-out",
            p("server.pem"))
    write(p("tokens"), "engine-token team-a admin\n")
    s = Server(["--pool-bytes=16MiB", "--tls-cert=" + p("server.pem"),
                "--tls-key=" + p("server.key"), "--auth-tokens-file=" + p("tokens")],
               no_auth=False,
               client_args={"token": "engine-token", "tls": {"root_ca_path": p("ca.pem")}})
    yield s, d
    s.stop()


def connect(settings):
    return kvbank.Client(settings["target"], settings["token"], tls=settings["tls"],
                         deadline_s=settings["deadline_s"], shm=settings["shm"])


def test_tls_and_token_file_reach_kvbankd(tls_server):
    server, d = tls_server
    token_file = write(os.path.join(d, "token"), "engine-token\n")
    extra = {"kvbank_target": server.target, "kvbank_token_file": token_file,
             "kvbank_tls_ca": os.path.join(d, "ca.pem")}
    with connect(client_settings(extra, WHO)) as c:
        info = c.ensure_model({"name": "cfg", "num_layers": 1, "num_q_heads": 1,
                               "num_kv_heads": 1, "head_dim": 8, "block_tokens": 4,
                               "dtype": "fp16"}, pool_bytes=1 << 20)
        assert info.num_blocks > 0
    # The certificate names kvbank.test too: a target by another name checks against it.
    extra["kvbank_tls_server_name"] = "kvbank.test"
    with connect(client_settings(extra, WHO)) as c:
        c.check_serving(10.0)


def test_without_the_ca_or_the_token_kvbankd_is_not_reached(tls_server):
    server, d = tls_server
    plain = client_settings({"kvbank_target": server.target, "kvbank_token": "engine-token",
                             "kvbank_deadline_s": 5}, WHO)
    with connect(plain) as c, pytest.raises(kvbank.Error):
        c.server_info()
    no_token = client_settings({"kvbank_target": server.target,
                                "kvbank_tls_ca": os.path.join(d, "ca.pem")}, WHO)
    with connect(no_token) as c, pytest.raises(kvbank.UnauthenticatedError):
        c.list_models()
    wrong_name = client_settings({"kvbank_target": server.target, "kvbank_token": "engine-token",
                                  "kvbank_tls_ca": os.path.join(d, "ca.pem"),
                                  "kvbank_tls_server_name": "other.test",
                                  "kvbank_deadline_s": 5}, WHO)
    with connect(wrong_name) as c, pytest.raises(kvbank.Error):
        c.server_info()


def test_another_prefix_and_default_deadline(tmp_path):
    # LMCache's plugin reads the same settings under its own prefix, with its own deadline.
    path = write(tmp_path / "token", "tok\n")
    s = client_settings({"p.target": "h:3", "p.token_file": str(path), "p.shm": "0"}, WHO,
                        prefix="p.", deadline_s=5.0)
    assert (s["target"], s["token"], s["deadline_s"], s["shm"]) == ("h:3", "tok", 5.0, False)
    with pytest.raises(ValueError, match="p.tls_cert and p.tls_key go together"):
        client_settings({"p.target": "h:3", "p.tls_ca": str(path), "p.tls_key": str(path)}, WHO,
                        prefix="p.")
    with pytest.raises(ValueError, match="p.deadline_s must be positive"):
        client_settings({"p.target": "h:3", "p.deadline_s": "0"}, WHO, prefix="p.")
