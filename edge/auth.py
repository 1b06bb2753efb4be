"""Bearer credentials: client API keys and node tokens, compared in constant time."""

from __future__ import annotations

import hmac


def bearer_matches(header: bytes | str | None, keys: list[str]) -> bool:
    """``Authorization: Bearer <token>`` names one of ``keys``."""
    if not header:
        return False
    if isinstance(header, str):
        header = header.encode("latin-1")
    scheme, _, token = header.partition(b" ")
    return scheme.lower() == b"bearer" and _names_one(token, keys)


def _names_one(token: bytes, keys: list[str]) -> bool:
    """Every key is compared (no early exit), so the time does not tell which one is close."""
    if not token:
        return False
    ok = False
    for key in keys:
        if key:
            ok |= hmac.compare_digest(token, key.encode())
    return ok


def client_key_matches(authorization: bytes | str | None, x_api_key: bytes | str | None, keys: list[str]) -> bool:
    """A client's API key, as ``Authorization: Bearer <key>`` (OpenAI clients)
    or ``x-api-key: <key>`` (Anthropic clients), names one of ``keys``: the one
    :func:`client_token` takes (a Bearer's, when there is one), as a client key is judged."""
    token = client_token(authorization, x_api_key)
    return token is not None and _names_one(token, keys)


def client_token(authorization: bytes | str | None, x_api_key: bytes | str | None) -> bytes | None:
    """The secret a client sent: ``Authorization: Bearer <key>`` or ``x-api-key: <key>``."""
    if authorization:
        if isinstance(authorization, str):
            authorization = authorization.encode("latin-1")
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() == b"bearer" and token:
            return token.strip()
    if x_api_key:
        return x_api_key.encode("latin-1") if isinstance(x_api_key, str) else x_api_key
    return None
