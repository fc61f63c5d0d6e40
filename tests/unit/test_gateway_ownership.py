"""Who owns a request: the caller's token, unless it is the shared API key (which tells no
client apart), else its TLS identity, else its host; only the exact admin token is admin."""

from __future__ import annotations

from pagedserve.services.gateway.ownership import ANONYMOUS, Ownership, caller_of, grpc_caller

OPEN = Ownership()
KEYED = Ownership(api_key="shared-k3y", admin_token="s3cret")


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
    by_key = OPEN.owner(caller_of("Bearer alice", "cn=gw", "10.0.0.7"))
    assert by_key == OPEN.owner(caller_of("bearer alice", "", "10.0.0.9"))  # any host
    assert by_key != OPEN.owner(caller_of("Bearer bob", "cn=gw", "10.0.0.7"))
    assert OPEN.owner(caller_of("", "cn=gw", "10.0.0.7")) == OPEN.owner(
        caller_of("", "cn=gw", "10.0.0.8"))
    assert OPEN.owner(caller_of("", "", "10.0.0.7")) != OPEN.owner(caller_of("", "", "10.0.0.8"))
    assert len(by_key) == 32 and "alice" not in by_key
    assert "alice" not in repr(caller_of("Bearer alice"))


def test_holders_of_the_shared_api_key_own_only_their_own_requests():
    """Every client of a keyed gateway sends the same key: it once made them all one owner, so
    that any of them could abort any request."""
    alice = KEYED.owner(caller_of("Bearer shared-k3y", "", "10.0.0.7"))
    assert alice != KEYED.owner(caller_of("Bearer shared-k3y", "", "10.0.0.8"))
    assert alice == KEYED.owner(caller_of("Bearer shared-k3y", "", "10.0.0.7"))
    assert KEYED.owner(caller_of("Bearer shared-k3y", "cn=alice", "10.0.0.7")) != KEYED.owner(
        caller_of("Bearer shared-k3y", "cn=bob", "10.0.0.7"))
    assert not KEYED.is_admin(caller_of("Bearer shared-k3y"))


def test_a_grpc_caller_is_its_host_whatever_its_port():
    first = OPEN.owner(grpc_caller(_Context(peer="ipv4:10.0.0.7:51234")))
    assert first == OPEN.owner(grpc_caller(_Context(peer="ipv4:10.0.0.7:40000")))
    assert first != OPEN.owner(grpc_caller(_Context(peer="ipv6:[::1]:40000")))
    assert grpc_caller(_Context(metadata=(("authorization", "Bearer k"),))) == caller_of(
        "Bearer k", "", "ipv4:10.0.0.7")
    assert grpc_caller(_Context(identities=[b"gateway"])).tls_identity == "gateway"


def test_only_the_exact_admin_token_is_admin():
    assert KEYED.is_admin(caller_of("Bearer s3cret"))
    assert not KEYED.is_admin(caller_of("Bearer s3cre"))
    assert not KEYED.is_admin(caller_of("s3cret"))  # not a bearer header
    assert not Ownership(admin_token="").is_admin(caller_of("Bearer "))  # none configured
    assert not OPEN.is_admin(ANONYMOUS)
