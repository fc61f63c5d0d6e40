"""Who owns a request: the caller's credential, else its TLS identity, else its host; an admin
token shown in constant time."""

from __future__ import annotations

from pagedserve.services.gateway.ownership import Caller, caller_of, grpc_caller, is_admin


class _Context:
    def __init__(self, metadata=(), identities=None, peer="ipv4:10.0.0.7:51234") -> None:
        self._metadata, self._identities, self._peer = metadata, identities, peer

    def invocation_metadata(self):
        return self._metadata

    def peer_identities(self):
        return self._identities

    def peer(self):
        return self._peer


def test_the_credential_wins_then_the_tls_identity_then_the_host():
    by_key = caller_of("Bearer alice", "cn=gw", "10.0.0.7")
    assert by_key == caller_of("alice", "", "10.0.0.9")  # same key, any host: same owner
    assert by_key.owner != caller_of("Bearer bob", "cn=gw", "10.0.0.7").owner
    assert caller_of("", "cn=gw", "10.0.0.7").owner == caller_of("", "cn=gw", "10.0.0.8").owner
    assert caller_of("", "", "10.0.0.7").owner != caller_of("", "", "10.0.0.8").owner
    assert len(by_key.owner) == 32 and "alice" not in by_key.owner and "alice" not in repr(by_key)


def test_a_grpc_caller_is_its_host_whatever_its_port():
    first = grpc_caller(_Context(peer="ipv4:10.0.0.7:51234"))
    assert first == grpc_caller(_Context(peer="ipv4:10.0.0.7:40000"))
    assert first != grpc_caller(_Context(peer="ipv6:[::1]:40000"))
    assert grpc_caller(_Context(metadata=(("authorization", "Bearer k"),))) == caller_of("k")
    assert grpc_caller(_Context(identities=[b"gateway"])) == caller_of("", "gateway", "x")


def test_only_the_exact_admin_token_is_admin():
    assert is_admin(caller_of("Bearer s3cret"), "s3cret")
    assert not is_admin(caller_of("Bearer s3cre"), "s3cret")
    assert not is_admin(caller_of("Bearer s3cret"), "")  # no admin token configured
    assert not is_admin(Caller(owner=""), "")
