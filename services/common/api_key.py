"""The optional API key both front doors check: `Authorization: Bearer KEY` on HTTP, the gRPC
metadata `authorization` with the same value. The admin token passes the check too. Compared in
constant time; never logged."""

from __future__ import annotations

import hmac

BEARER = "bearer "


def bearer_token(authorization: str | None) -> str:
    """The token of 'Bearer <token>' (scheme case-blind); '' for any other form."""
    if authorization is None or authorization[:len(BEARER)].lower() != BEARER:
        return ""
    return authorization[len(BEARER):].strip()


def is_token(token: str, secret: str) -> bool:
    """`token` is `secret` (compared in constant time); never for an empty secret."""
    return bool(secret) and hmac.compare_digest(token.encode(), secret.encode())


def is_authorized(api_key: str, authorization: str | None, admin_token: str = "") -> bool:
    """True when no key is set, or `authorization` is 'Bearer <api_key>' or
    'Bearer <admin_token>'."""
    if not api_key:
        return True
    token = bearer_token(authorization)
    is_key, is_admin = is_token(token, api_key), is_token(token, admin_token)
    return is_key or is_admin
