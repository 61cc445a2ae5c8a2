"""Optional mutual TLS on the gateway-worker links: gRPC credentials from TlsSettings' PEM files."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc

from pdmesh.config import TlsSettings
from pdmesh.transport.grpc_options import GRPC_OPTIONS
from pdmesh.transport.mesh_auth import token_interceptors


def server_credentials(tls: TlsSettings) -> grpc.ServerCredentials | None:
    """A worker's TLS credentials (client certificates required when ca_file is set); None: plaintext."""
    _check_pair(tls)
    if not tls.enabled:
        return None
    if tls.cert_file is None:
        raise ValueError("TLS server needs cert_file and key_file (only ca_file is set)")
    ca = _read_optional(tls.ca_file)
    return grpc.ssl_server_credentials(
        [(_read(tls.key_file), _read(tls.cert_file))],
        root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(tls: TlsSettings) -> grpc.ChannelCredentials | None:
    """The gateway's TLS credentials: trusts servers signed by ca_file (the system roots if unset) and
    presents cert_file/key_file as its client certificate when set; None: plaintext."""
    _check_pair(tls)
    if not tls.enabled:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read_optional(tls.ca_file),
        private_key=_read_optional(tls.key_file),
        certificate_chain=_read_optional(tls.cert_file))


def open_channel(address: str, tls: TlsSettings, options: Sequence[tuple[str, object]] | None = None,
                 mesh_token: str | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to address: secure when tls is enabled, else insecure; every call carries
    mesh_token when given (a worker's ports refuse calls without it). options default to the shared
    GRPC_OPTIONS."""
    options = list(GRPC_OPTIONS if options is None else options)
    interceptors = token_interceptors(mesh_token) if mesh_token else None
    credentials = channel_credentials(tls)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


def _check_pair(tls: TlsSettings) -> None:
    if (tls.cert_file is None) != (tls.key_file is None):
        missing = "key_file" if tls.key_file is None else "cert_file"
        raise ValueError(f"TLS cert_file and key_file go together: {missing} is missing")


def _read(path: Path | None) -> bytes:
    assert path is not None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read TLS file {path}: {exc.strerror or exc}") from exc


def _read_optional(path: Path | None) -> bytes | None:
    return None if path is None else _read(path)
