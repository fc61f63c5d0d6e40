"""The optional API key both front doors check: `Authorization: Bearer KEY` on HTTP, the gRPC
metadata `authorization` with the same value. Compared in constant time; never logged."""

from __future__ import annotations

import hmac

BEARER = "bearer "


def is_authorized(api_key: str, authorization: str | None) -> bool:
    """True when no key is set, or `authorization` is 'Bearer <api_key>' (scheme case-blind)."""
    if not api_key:
        return True
    if authorization is None or authorization[:len(BEARER)].lower() != BEARER:
        return False
    return hmac.compare_digest(authorization[len(BEARER):].strip().encode(), api_key.encode())
