"""Who may abort a request: the caller that submitted it, or an admin.

The owner is an opaque hash of the caller's identity: its credential, else its TLS client
certificate, else its host; callers sharing one share an owner. The scheduler aborts only a
request of the same owner (NOT_FOUND otherwise, as for an unknown id).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Caller:
    owner: str
    credential: str = field(default="", repr=False)  # the bearer token it sent, if any


ANONYMOUS = Caller(owner="")


def owner_tag(kind: str, identity: str) -> str:
    """An opaque, fixed-size tag: the scheduler never sees the credential itself."""
    return hashlib.sha256(f"{kind}\0{identity}".encode()).hexdigest()[:32]


def caller_of(authorization: str = "", tls_identity: str = "", peer_host: str = "") -> Caller:
    credential = authorization.removeprefix("Bearer ").strip()
    if credential:
        return Caller(owner_tag("authorization", credential), credential)
    if tls_identity:
        return Caller(owner_tag("tls", tls_identity))
    return Caller(owner_tag("host", peer_host))


def grpc_caller(context: Any) -> Caller:
    metadata = dict(context.invocation_metadata() or ())
    identities = context.peer_identities() or []
    peer = context.peer() or ""  # "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:/path"
    host = peer.rsplit(":", 1)[0] if peer.startswith(("ipv4:", "ipv6:")) else peer
    return caller_of(str(metadata.get("authorization", "")),
                     b",".join(identities).decode(errors="replace"), host)


def is_admin(caller: Caller, admin_token: str) -> bool:
    """Compared in constant time; no admin token configured: nobody is."""
    return bool(admin_token) and hmac.compare_digest(caller.credential.encode(),
                                                     admin_token.encode())
