"""The output items of an edge's recent Responses, for the ``item_reference``
input items clients send back instead of the items themselves.

The Responses API stores a response by default (``store`` left out is true),
and a client that believes it may send its earlier output back as
``{"type": "item_reference", "id": "msg_..."}``: the Vercel AI SDK's default
OpenAI provider does, on every turn after the first. This edge keeps no
responses (no ``previous_response_id``, no ``GET /v1/responses/{id}``), but it
keeps the *items* of the responses it gave with ``store`` not false, in
memory, so that such a reference becomes the item it names again:

- per key (a reference resolves only for the key whose response made it; the
  ids themselves hold 96 random bits), on this edge only;
- each item for :data:`TTL_S` since it was made or last referenced, the
  least recently used leaving first once the items' encoded size passes
  :data:`MAX_BYTES` (or their number :data:`MAX_ITEMS`).

A reference this edge does not hold (another edge answered, the item left,
the edge restarted) is a 400 that says to send the item itself.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec

MAX_BYTES = 64 * 1024 * 1024  # the items' encoded size, all keys together
MAX_ITEMS = 65_536
TTL_S = 3600.0

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


class ResponseItems:
    __slots__ = ("_items", "_bytes", "max_bytes", "max_items", "ttl_s", "_clock")

    def __init__(
        self,
        max_bytes: int = MAX_BYTES,
        max_items: int = MAX_ITEMS,
        ttl_s: float = TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # (scope, item id) -> (expiry, the item encoded); oldest use first
        self._items: OrderedDict[tuple[str, str], tuple[float, bytes]] = OrderedDict()
        self._bytes = 0
        self.max_bytes = max_bytes
        self.max_items = max_items
        self.ttl_s = ttl_s
        self._clock = clock

    def __len__(self) -> int:
        return len(self._items)

    @property
    def size(self) -> int:
        """The kept items' encoded size in bytes."""
        return self._bytes

    def keep(self, scope: str, items: list[dict[str, Any]]) -> None:
        """Keep a finished response's output items (each by its ``id``)."""
        expires = self._clock() + self.ttl_s
        kept = self._items
        for item in items:
            item_id = item.get("id")
            if not isinstance(item_id, str):
                continue
            if item.get("type") == "reasoning":  # never sent upstream again: its id is all a reference needs
                item = {"id": item_id, "type": "reasoning"}
            data = _encode(item)
            if len(data) > self.max_bytes:
                continue
            key = (scope, item_id)
            old = kept.pop(key, None)
            if old is not None:
                self._bytes -= len(old[1])
            kept[key] = (expires, data)
            self._bytes += len(data)
        self._trim()

    def get(self, scope: str, item_id: str) -> dict[str, Any] | None:
        """The item ``item_id`` of a response given to ``scope`` (None: not held)."""
        key = (scope, item_id)
        found = self._items.get(key)
        if found is None:
            return None
        now = self._clock()
        if found[0] <= now:
            self._drop(key)
            return None
        self._items[key] = (now + self.ttl_s, found[1])
        self._items.move_to_end(key)
        item: dict[str, Any] = _decode(found[1])
        return item

    def _drop(self, key: tuple[str, str]) -> None:
        expires_data = self._items.pop(key, None)
        if expires_data is not None:
            self._bytes -= len(expires_data[1])

    def _trim(self) -> None:
        kept = self._items
        now = self._clock()
        while kept:
            key, (expires, data) = next(iter(kept.items()))
            if expires > now and self._bytes <= self.max_bytes and len(kept) <= self.max_items:
                break
            del kept[key]
            self._bytes -= len(data)
