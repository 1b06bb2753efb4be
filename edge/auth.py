"""Bearer credentials: client API keys and node tokens, compared in constant time."""

from __future__ import annotations

import hmac


def bearer_matches(header: bytes | str | None, keys: list[str]) -> bool:
    """``Authorization: Bearer <token>`` names one of ``keys``. Every key is
    compared (no early exit), so the time does not tell which one is close."""
    if not header:
        return False
    if isinstance(header, str):
        header = header.encode("latin-1")
    scheme, _, token = header.partition(b" ")
    if scheme.lower() != b"bearer" or not token:
        return False
    ok = False
    for key in keys:
        if key:
            ok |= hmac.compare_digest(token, key.encode())
    return ok
