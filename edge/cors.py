"""Cross-origin requests from browsers (CORS), for the client API only.

A web app that calls the edge from the browser (its own origin, a user's
key) needs the edge to say that its origin may read the answers: the
``Access-Control-Allow-Origin`` of every response, and an answer to the
preflight (``OPTIONS`` with ``Access-Control-Request-Method``) that a
request with an ``Authorization`` header or a JSON body is sent after.

Off unless ``cors_origins`` lists origins (``"*"``: any). Only the client
API has it (``/v1/...`` but the admin API, ``/v1/nodes`` and the node link):
the console is served from the edge itself, and ``/metrics`` and the admin
API are for operators' tools, not web pages. Keys are bearer tokens, never
cookies, so no credentials are allowed.
"""

from __future__ import annotations

import ipaddress
import re

_ORIGIN = re.compile(r"https?://[^/\s?#]+")
MAX_ORIGIN = 512  # bytes of an Origin header looked at
MAX_REQUEST_HEADERS = 2048  # bytes of Access-Control-Request-Headers echoed in a preflight's answer
PREFLIGHT_MAX_AGE = b"600"
_METHODS = b"GET, POST, OPTIONS"
_TOKEN_LIST = re.compile(rb"[A-Za-z0-9!#$%&'*+.^_`|~-]+(?:\s*,\s*[A-Za-z0-9!#$%&'*+.^_`|~-]+)*")


def origin_problem(origin: str) -> str | None:
    """Why ``origin`` cannot be a ``cors_origins`` entry (None: it can)."""
    if origin == "*":
        return None
    if not _ORIGIN.fullmatch(origin):
        return 'an origin is scheme://host[:port] (no path, no trailing "/"), or "*"'
    return None


_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"  # (of a host name)
_HOST = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")


def host_problem(host: str) -> str | None:
    """Why ``host`` cannot be an ``allowed_hosts`` entry (None: it can; any case, a root dot or not)."""
    if host == "*" or (len(host) <= 253 and _HOST.fullmatch(host)):
        return None
    return 'a host name, without scheme or port ("chat.example.com"), or "*"'


def local_host(host: bytes) -> bool:
    """``host`` (a Host header, its port aside) is an IP address or localhost: a name no web
    page can make its own through DNS (rebinding)."""
    if host.startswith(b"["):  # (an IPv6 literal)
        return True
    name = host_name(host)
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_name(host: bytes) -> str:
    """The name of a Host header, its port aside, lower case."""
    name = host.rpartition(b":")[0] if host.count(b":") == 1 else host
    return name.lower().rstrip(b".").decode("latin-1")


def for_api(path: str) -> bool:
    """Whether ``path`` is part of the client API (the routes CORS covers)."""
    return path.startswith("/v1/") and not path.startswith(("/v1/admin/", "/v1/node/")) and path != "/v1/nodes"


class Cors:
    __slots__ = ("_any", "_origins")

    def __init__(self, origins: list[str]) -> None:
        self._any = "*" in origins
        self._origins = frozenset(o.encode() for o in origins if o != "*")

    def allowed(self, origin: bytes | None) -> bytes | None:
        """The ``Access-Control-Allow-Origin`` value for a request from ``origin`` (None: none)."""
        if origin is None or len(origin) > MAX_ORIGIN:
            return None
        if self._any:
            return b"*"
        return origin if origin in self._origins else None

    def headers(self, allow: bytes) -> list[tuple[bytes, bytes]]:
        """An answer's headers for an allowed origin."""
        headers = [(b"access-control-allow-origin", allow), (b"access-control-expose-headers", b"*")]
        if allow != b"*":
            headers.append((b"vary", b"Origin"))
        return headers

    def preflight(self, allow: bytes, requested: bytes | None) -> list[tuple[bytes, bytes]]:
        """The headers of the 204 that answers a preflight: the methods, and the request's own
        header names (a list of header tokens, bounded), for ``max-age`` seconds."""
        headers = [
            (b"access-control-allow-origin", allow),
            (b"access-control-allow-methods", _METHODS),
            (b"access-control-max-age", PREFLIGHT_MAX_AGE),
            (b"vary", b"Origin, Access-Control-Request-Method, Access-Control-Request-Headers"),
        ]
        if requested and len(requested) <= MAX_REQUEST_HEADERS and _TOKEN_LIST.fullmatch(requested.strip()):
            headers.append((b"access-control-allow-headers", requested.strip()))
        return headers
