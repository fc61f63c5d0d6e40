"""TLS for the services' ports and channels. Internal ports (scheduler, worker) take mutual TLS
against one CA; `internal_tls_dir` holds the files under the names a cert-manager Certificate
(or a kubernetes.io/tls Secret with ca.crt) mounts.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from pagedserve.services.common.config import PublicTlsConfig, TlsConfig
from pagedserve.services.common.errors import ConfigError

logger = logging.getLogger(__name__)

CA_FILE = "ca.crt"
CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"


@dataclass(frozen=True, slots=True)
class InternalPem:
    ca: bytes
    cert: bytes
    key: bytes


def read_pem(flag: str, path: str | Path) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{flag}: cannot read {str(path)!r}: {e.strerror}") from e
    if b"-----BEGIN" not in data:
        raise ConfigError(f"{flag}: {str(path)!r} is not a PEM file")
    return data


def internal_pem(tls: TlsConfig) -> InternalPem | None:
    if tls.internal_tls_dir:
        folder = Path(tls.internal_tls_dir)
        return InternalPem(*(read_pem("internal_tls_dir", folder / name)
                             for name in (CA_FILE, CERT_FILE, KEY_FILE)))
    if tls.tls_cert:
        return InternalPem(read_pem("tls_ca", tls.tls_ca), read_pem("tls_cert", tls.tls_cert),
                           read_pem("tls_key", tls.tls_key))
    return None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def internal_server_credentials(tls: TlsConfig, host: str, service: str
                                ) -> grpc.ServerCredentials | None:
    pem = internal_pem(tls)
    if pem is None:
        if not is_loopback(host):
            logger.warning(
                "the %s listens on %s without TLS: anyone who reaches that address can call it. "
                "Give it --internal-tls-dir (or --tls-cert, --tls-key, --tls-ca), or listen on "
                "127.0.0.1", service, host)
        return None
    return grpc.ssl_server_credentials([(pem.key, pem.cert)], root_certificates=pem.ca,
                                       require_client_auth=True)


def public_server_credentials(public: PublicTlsConfig) -> grpc.ServerCredentials | None:
    """Client certificates are required only with a client CA."""
    if not public.is_enabled:
        return None
    client_ca = (read_pem("public_tls_client_ca", public.public_tls_client_ca)
                 if public.public_tls_client_ca else None)
    return grpc.ssl_server_credentials(
        [(read_pem("public_tls_key", public.public_tls_key),
          read_pem("public_tls_cert", public.public_tls_cert))],
        root_certificates=client_ca, require_client_auth=client_ca is not None)


def _security(tls: TlsConfig | None) -> tuple[grpc.ChannelCredentials | None,
                                              list[tuple[str, Any]]]:
    pem = internal_pem(tls) if tls is not None else None
    if pem is None:
        return None, []
    credentials = grpc.ssl_channel_credentials(pem.ca, pem.key, pem.cert)
    override = [("grpc.ssl_target_name_override", tls.tls_server_name)] if tls.tls_server_name else []
    return credentials, override


def internal_channel(address: str, tls: TlsConfig | None,
                     options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    credentials, extra = _security(tls)
    if credentials is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, credentials, options=[*options, *extra])


def internal_aio_channel(address: str, tls: TlsConfig | None,
                         options: Sequence[tuple[str, Any]] = (),
                         interceptors: Sequence[Any] | None = None) -> grpc.aio.Channel:
    credentials, extra = _security(tls)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=list(options),
                                         interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=[*options, *extra],
                                   interceptors=interceptors)
