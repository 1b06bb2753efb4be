"""The client's address behind a reverse proxy (``trusted_proxies``).

Behind nginx every client's socket peer is the proxy. When the peer is one of
``trusted_proxies`` (addresses or networks), the client is the rightmost
address of ``X-Forwarded-For`` that is not itself trusted: each proxy appends
the address it saw, and only what trusted proxies appended can be believed
(the leftmost entries are whatever the client sent). The request's
``scope["client"]`` is then that address, for everything that reads it: the
access line's ``client`` and the per-address fairness of schema checks.

A peer that is not trusted is the client, whatever it says. An entry that is
not an IP address ends the walk: the last trusted hop is then the client.
"""

from __future__ import annotations

import ipaddress
from typing import Any

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

MAX_HOPS = 32  # entries read from the right: a client can prepend any number


def parse_networks(entries: list[str]) -> list[IPNetwork]:
    """``"10.0.0.1"``, ``"10.0.0.0/8"``, ``"::1"``; raises ValueError naming the bad one."""
    nets = []
    for entry in entries:
        try:
            nets.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError:
            raise ValueError(f"{entry!r} is not an IP address or network") from None
    return nets


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(text.strip())
    except ValueError:
        return None
    return getattr(ip, "ipv4_mapped", None) or ip


class TrustedProxies:
    __slots__ = ("nets",)

    def __init__(self, nets: list[IPNetwork]) -> None:
        self.nets = nets

    def trusts(self, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        return any(ip in net for net in self.nets)

    def client_of(self, peer: str, forwarded: list[bytes]) -> str:
        """The client's address, given the socket peer and the X-Forwarded-For values in order."""
        ip = _address(peer)
        if ip is None or not self.trusts(ip) or not forwarded:
            return peer
        hops = b",".join(forwarded).decode("latin-1").split(",")[-MAX_HOPS:]
        client = peer
        for hop in reversed(hops):
            ip = _address(hop)
            if ip is None:
                break
            client = str(ip)
            if not self.trusts(ip):
                break
        return client

    def rewrite(self, scope: dict[str, Any]) -> None:
        """Set ``scope["client"]`` to the client behind the proxies (port 0: not known)."""
        peer = scope.get("client")
        if not peer:
            return
        forwarded = [v for k, v in scope["headers"] if k.lower() == b"x-forwarded-for"]
        client = self.client_of(str(peer[0]), forwarded)
        if client != peer[0]:
            scope["client"] = (client, 0)
