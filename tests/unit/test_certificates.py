"""The throw-away CA of `pagedserve serve`: private files, certificates that name their role and
the local hosts, a chain that verifies, and no CA key left behind."""

import ipaddress
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pagedserve.certificates import ThrowAwayCertificates

ROLES = ("gateway", "scheduler", "worker")


@pytest.fixture(scope="module")
def certificates():
    certificates = ThrowAwayCertificates(ROLES, ["pagedserve.example", "10.1.2.3"])
    yield certificates
    certificates.remove()


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_files_are_private_and_hold_no_ca_key(certificates):
    assert mode(certificates.folder) == 0o700
    assert sorted(p.name for p in certificates.folder.iterdir()) == sorted(ROLES)
    for role in ROLES:
        folder = certificates.folder / role
        assert mode(folder) == 0o700
        assert sorted(p.name for p in folder.iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
        assert mode(folder / "tls.key") == 0o600
        assert certificates.tls(role).internal_tls_dir == str(folder)


def test_each_role_has_a_certificate_the_ca_signed_for_the_local_hosts(certificates):
    ca = x509.load_pem_x509_certificate((certificates.folder / "worker" / "ca.crt").read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for role in ROLES:
        folder = certificates.folder / role
        assert (folder / "ca.crt").read_bytes() == (certificates.folder / "worker" / "ca.crt"
                                                    ).read_bytes()
        cert = x509.load_pem_x509_certificate((folder / "tls.crt").read_bytes())
        cert.verify_directly_issued_by(ca)  # raises if the chain does not verify
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == (
            f"pagedserve-{role}")
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usages)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert names.get_values_for_type(x509.UniformResourceIdentifier) == [
            f"spiffe://pagedserve/{role}"]  # what the internal servers check (roles.py)
        assert set(names.get_values_for_type(x509.DNSName)) == {"localhost", "pagedserve.example"}
        assert set(names.get_values_for_type(x509.IPAddress)) == {
            ipaddress.ip_address(h) for h in ("127.0.0.1", "::1", "10.1.2.3")}
        key = serialization.load_pem_private_key((folder / "tls.key").read_bytes(), None)
        assert key.public_key() == cert.public_key()


def test_two_runs_have_different_cas_and_remove_cleans_up():
    first, second = ThrowAwayCertificates(("worker",)), ThrowAwayCertificates(("worker",))
    try:
        read = [(c.folder / "worker" / "ca.crt").read_bytes() for c in (first, second)]
        assert read[0] != read[1]
    finally:
        first.remove()
        second.remove()
    assert not first.folder.exists() and not second.folder.exists()
