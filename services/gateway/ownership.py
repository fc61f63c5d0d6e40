"""Who may abort a request: the caller that submitted it, or an admin.

A caller is what the front door knows of it: the bearer token it sent, its TLS client
certificate, its host. Its owner is an opaque hash of the first of these that tells it apart:
its token, unless that is the deployment's API key, which every client holds (so it tells none
apart); else its certificate; else its host. Callers sharing one share an owner. The scheduler
aborts only a request of the same owner (NOT_FOUND otherwise, as for an unknown id); the holder
of the admin token may abort any.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from pagedserve.services.common.api_key import bearer_token, is_token


@dataclass(frozen=True, slots=True)
class Caller:
    credential: str = field(default="", repr=False)  # the bearer token it sent, if any
    tls_identity: str = ""
    host: str = ""


ANONYMOUS = Caller()


def owner_tag(kind: str, identity: str) -> str:
    """An opaque, fixed-size tag: the scheduler never sees the credential itself."""
    return hashlib.sha256(f"{kind}\0{identity}".encode()).hexdigest()[:32]


def caller_of(authorization: str = "", tls_identity: str = "", peer_host: str = "") -> Caller:
    return Caller(bearer_token(authorization), tls_identity, peer_host)


def grpc_caller(context: Any) -> Caller:
    metadata = dict(context.invocation_metadata() or ())
    identities = context.peer_identities() or []
    peer = context.peer() or ""  # "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:/path"
    host = peer.rsplit(":", 1)[0] if peer.startswith(("ipv4:", "ipv6:")) else peer
    return caller_of(str(metadata.get("authorization", "")),
                     b",".join(identities).decode(errors="replace"), host)


@dataclass(frozen=True, slots=True)
class Ownership:
    """The deployment's shared API key and admin token (empty: none)."""

    api_key: str = field(default="", repr=False)
    admin_token: str = field(default="", repr=False)

    def owner(self, caller: Caller) -> str:
        if caller.credential and not is_token(caller.credential, self.api_key):
            return owner_tag("authorization", caller.credential)
        if caller.tls_identity:
            return owner_tag("tls", caller.tls_identity)
        return owner_tag("host", caller.host)

    def is_admin(self, caller: Caller) -> bool:
        return is_token(caller.credential, self.admin_token)
