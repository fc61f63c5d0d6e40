"""How a client reaches the gateway: TLS (the gateway's --public-tls-* flags; a client
certificate when it asks for one) and the API key (metadata `authorization: Bearer KEY`, as the
gateway's --api-key checks)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.rpc.tls import read_pem


@dataclass(frozen=True, slots=True)
class Connection:
    address: str  # the gateway's host:port
    credentials: grpc.ChannelCredentials | None  # None = plaintext
    metadata: tuple[tuple[str, str], ...] = ()
    options: tuple[tuple[str, object], ...] = ()


def connection(address: str, *, api_key: str | None, tls: bool, tls_ca: str | Path | None,
               tls_cert: str | Path | None, tls_key: str | Path | None,
               options: tuple[tuple[str, object], ...]) -> Connection:
    """tls_ca implies TLS; tls=True alone verifies the gateway against the system's roots."""
    if not address:
        raise InvalidRequest("address must be the gateway's host:port, got ''")
    if bool(tls_cert) != bool(tls_key):
        raise InvalidRequest(f"tls_cert and tls_key go together, got tls_cert={tls_cert!r}, "
                             f"tls_key={tls_key!r}")
    credentials = None
    if tls or tls_ca or tls_cert:
        credentials = grpc.ssl_channel_credentials(
            read_pem("tls_ca", tls_ca) if tls_ca else None,
            read_pem("tls_key", tls_key) if tls_key else None,
            read_pem("tls_cert", tls_cert) if tls_cert else None)
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    return Connection(address, credentials, metadata, options)


def sync_channel(conn: Connection) -> grpc.Channel:
    if conn.credentials is None:
        return grpc.insecure_channel(conn.address, options=conn.options)
    return grpc.secure_channel(conn.address, conn.credentials, options=conn.options)


def aio_channel(conn: Connection) -> grpc.aio.Channel:
    if conn.credentials is None:
        return grpc.aio.insecure_channel(conn.address, options=conn.options)
    return grpc.aio.secure_channel(conn.address, conn.credentials, options=conn.options)
