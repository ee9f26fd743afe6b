"""How an engine connector reaches kvbankd, from the engine's own configuration mapping: the keys
below, turned into kvbank.Client arguments. vLLM's kv_connector_extra_config spells them with a
kvbank_ prefix (kvbank_target, ...); LMCache's extra_config under the plugin's
remote_storage_plugin.<name>. (target, ...). Kept apart from the connectors so that it is checked
without an engine installed.

  kvbank_target          "host:port" of kvbankd (required)
  kvbank_token           bearer token
  kvbank_token_file      a file holding the bearer token (a Kubernetes Secret mounted as a
                         file); read once at start, surrounding whitespace dropped
  kvbank_tls_ca          PEM file of the CAs that sign kvbankd's certificate: TLS on (unset:
                         plaintext, as kvbankd serves without --tls-cert)
  kvbank_tls_server_name the name to check kvbankd's certificate against, when it is not the
                         target's host (needs kvbank_tls_ca)
  kvbank_tls_cert, kvbank_tls_key
                         the client's certificate chain and key (PEM files) for a kvbankd that
                         asks for them (--tls-client-ca: mutual TLS); both or neither
  kvbank_deadline_s      deadline of unary calls (default 30)
  kvbank_shm             the same-host shared-memory plane when kvbankd serves one (default true)
  kvbank_device_plane    how payloads in CUDA tensors move: "auto" (default), "cuda_ipc",
                         "nccl" or "host"
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off")
    return bool(value)


def _readable(path: str, key: str, who: str) -> str:
    if not os.path.isfile(path):
        raise ValueError(f"{who}: {key} {path!r} is not a file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{who}: {key} {path!r} cannot be read")
    return path


def client_settings(extra: Mapping[str, Any], who: str, prefix: str = "kvbank_",
                    deadline_s: float = 30.0) -> dict[str, Any]:
    """kvbank.Client's arguments from `extra`'s keys (each spelled `prefix` + the name above):
    {"target", "token", "tls", "deadline_s", "shm", "device_plane"}; `deadline_s` is the default
    of <prefix>deadline_s. ValueError naming `who` and the key when a setting is missing,
    contradictory, out of range or names a file that is not there."""
    def name(key: str) -> str:
        return prefix + key

    def get(key: str) -> Any:
        return extra.get(name(key)) or None

    target = str(get("target") or "").strip()
    if not target:
        raise ValueError(f"{who}: {name('target')} (\"host:port\" of kvbankd) is required")
    token, token_file = get("token"), get("token_file")
    if token is not None and token_file is not None:
        raise ValueError(f"{who}: {name('token')} and {name('token_file')} are both set; "
                         "name one")
    if token_file is not None:
        with open(_readable(str(token_file), name("token_file"), who)) as f:
            token = f.read().strip()
        if not token:
            raise ValueError(f"{who}: {name('token_file')} {token_file!r} is empty")
    tls = None
    ca, server_name = get("tls_ca"), get("tls_server_name")
    cert, key = get("tls_cert"), get("tls_key")
    if ca is None and (server_name is not None or cert is not None or key is not None):
        raise ValueError(f"{who}: {name('tls_server_name')}, {name('tls_cert')} and "
                         f"{name('tls_key')} need {name('tls_ca')} (the CAs that sign kvbankd's "
                         "certificate)")
    if (cert is None) != (key is None):
        raise ValueError(f"{who}: {name('tls_cert')} and {name('tls_key')} go together")
    if ca is not None:
        tls = {"root_ca_path": _readable(str(ca), name("tls_ca"), who)}
        if server_name is not None:
            tls["server_name_override"] = str(server_name)
        if cert is not None:
            tls["cert_chain_path"] = _readable(str(cert), name("tls_cert"), who)
            tls["private_key_path"] = _readable(str(key), name("tls_key"), who)
    deadline = float(extra.get(name("deadline_s"), deadline_s))
    if not deadline > 0:
        raise ValueError(f"{who}: {name('deadline_s')} must be positive, not {deadline}")
    return {
        "target": target,
        "token": str(token) if token is not None else None,
        "tls": tls,
        "deadline_s": deadline,
        "shm": _flag(extra.get(name("shm"), True)),
        "device_plane": str(extra.get(name("device_plane"), "auto")),
    }
