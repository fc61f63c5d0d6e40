"""A throw-away certificate authority for a stack this process starts (`pagedserve serve`, the
tensor-parallel ranks of `LLM`): mutual TLS between its services with nothing to configure.

The CA signs one certificate per role, the role named in a URI SAN (`spiffe://pagedserve/<role>`,
what the internal servers check: services/rpc/roles.py), and is then forgotten: its key never touches the disk, so
nobody can mint another peer. Each role gets a folder in the layout `--internal-tls-dir` reads
(ca.crt, tls.crt, tls.key). The parent folder is private (0700) and every key file 0600.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pagedserve.services.common.config import TlsConfig
from pagedserve.services.rpc.roles import role_uri
from pagedserve.services.rpc.tls import CA_FILE, CERT_FILE, KEY_FILE

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
VALIDITY = datetime.timedelta(days=30)
CLOCK_SKEW = datetime.timedelta(minutes=5)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pagedserve"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _subject_alt_names(role: str, hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(role_uri(role))]
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
             ) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + VALIDITY)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False))


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_certificates(folder: Path, roles: Sequence[str], hosts: Sequence[str]) -> None:
    """A new CA, and under folder/<role>/ a certificate for each role (CN pagedserve-<role>,
    both server and client use, SANs = the role's URI and `hosts`) with its key and the CA
    certificate."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("pagedserve throw-away CA")
    ca_cert = (_builder(ca_name, ca_name, ca_key.public_key())
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(
                   digital_signature=False, content_commitment=False, key_encipherment=False,
                   data_encipherment=False, key_agreement=False, key_cert_sign=True,
                   crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
    authority_key_id = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())
    for role in roles:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (_builder(_name(f"pagedserve-{role}"), ca_name, key.public_key())
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(authority_key_id, critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .add_extension(_subject_alt_names(role, hosts), critical=False)
                .sign(ca_key, hashes.SHA256()))
        role_folder = folder / role
        role_folder.mkdir(mode=0o700)
        _write(role_folder / CA_FILE, ca_pem, 0o644)
        _write(role_folder / CERT_FILE, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        _write(role_folder / KEY_FILE, key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()), 0o600)


class ThrowAwayCertificates:
    """write_certificates into a private temporary folder, removed by `remove()`."""

    def __init__(self, roles: Sequence[str], hosts: Sequence[str] = LOCAL_HOSTS) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="pagedserve-tls-"))  # mode 0700
        try:
            write_certificates(self.folder, roles, [*LOCAL_HOSTS, *hosts])
        except BaseException:
            self.remove()
            raise

    def tls(self, role: str) -> TlsConfig:
        return TlsConfig(internal_tls_dir=str(self.folder / role))

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
