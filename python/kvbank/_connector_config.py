"""How an engine connector reaches kvbankd, from the engine's own configuration mapping (vLLM's
kv_connector_extra_config): the kvbank_* keys below, turned into kvbank.Client arguments. Kept
apart from the connectors so that it is checked without an engine installed.

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


def client_settings(extra: Mapping[str, Any], who: str) -> dict[str, Any]:
    """kvbank.Client's arguments from `extra`'s kvbank_* keys: {"target", "token", "tls",
    "deadline_s", "shm", "device_plane"}. ValueError naming `who` and the key when a setting is
    missing, contradictory or names a file that is not there."""
    target = str(extra.get("kvbank_target") or "")
    if not target:
        raise ValueError(f"{who}: kvbank_target (\"host:port\" of kvbankd) is required")
    token = extra.get("kvbank_token") or None
    token_file = extra.get("kvbank_token_file") or None
    if token is not None and token_file is not None:
        raise ValueError(f"{who}: kvbank_token and kvbank_token_file are both set; name one")
    if token_file is not None:
        with open(_readable(str(token_file), "kvbank_token_file", who)) as f:
            token = f.read().strip()
        if not token:
            raise ValueError(f"{who}: kvbank_token_file {token_file!r} is empty")
    tls = None
    ca = extra.get("kvbank_tls_ca") or None
    server_name = extra.get("kvbank_tls_server_name") or None
    cert = extra.get("kvbank_tls_cert") or None
    key = extra.get("kvbank_tls_key") or None
    if ca is None and (server_name is not None or cert is not None or key is not None):
        raise ValueError(f"{who}: kvbank_tls_server_name, kvbank_tls_cert and kvbank_tls_key "
                         "need kvbank_tls_ca (the CAs that sign kvbankd's certificate)")
    if (cert is None) != (key is None):
        raise ValueError(f"{who}: kvbank_tls_cert and kvbank_tls_key go together")
    if ca is not None:
        tls = {"root_ca_path": _readable(str(ca), "kvbank_tls_ca", who)}
        if server_name is not None:
            tls["server_name_override"] = str(server_name)
        if cert is not None:
            tls["cert_chain_path"] = _readable(str(cert), "kvbank_tls_cert", who)
            tls["private_key_path"] = _readable(str(key), "kvbank_tls_key", who)
    return {
        "target": target,
        "token": token,
        "tls": tls,
        "deadline_s": float(extra.get("kvbank_deadline_s", 30.0)),
        "shm": _flag(extra.get("kvbank_shm", True)),
        "device_plane": str(extra.get("kvbank_device_plane", "auto")),
    }
