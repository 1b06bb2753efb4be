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
  :data:`MAX_BYTES` (or their number :data:`MAX_ITEMS`);
- once the store is full, a key holding more than a :data:`SHARE` of either
  loses its own least recently used items first: a key that makes many large
  answers pushes out its own items, not every other key's.

A reference this edge does not hold (another edge answered, the item left,
the edge restarted) is a 400 that says to send the item itself. The items one
request's references name come to at most the edge's ``max_body_bytes``
(encoded): a few bytes of references may not expand to more than a body could
hold (a 413 before the item past it is decoded); an item referenced twice is a
400, as OpenAI answers it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec

from edge import errors

MAX_BYTES = 64 * 1024 * 1024  # the items' encoded size, all keys together
MAX_ITEMS = 65_536
TTL_S = 3600.0
SHARE = 4  # a full store takes from keys (scopes) over 1/SHARE of the bytes or of the items first

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


class _Scope:
    """One key's kept items: their encoded size, and their ids, the least recently used first."""

    __slots__ = ("size", "order")

    def __init__(self) -> None:
        self.size = 0
        self.order: OrderedDict[str, None] = OrderedDict()


class ResponseItems:
    __slots__ = ("_items", "_bytes", "_scopes", "_over", "max_bytes", "max_items", "ttl_s", "_clock")

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
        self._scopes: dict[str, _Scope] = {}
        self._over: dict[str, None] = {}  # the scopes over their share, in the order they went over
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
        for item in items:
            item_id = item.get("id")
            if not isinstance(item_id, str):
                continue
            if item.get("type") == "reasoning":  # never sent upstream again: its id is all a reference needs
                item = {"id": item_id, "type": "reasoning"}
            data = _encode(item)
            if len(data) > self.max_bytes:
                continue
            self._drop((scope, item_id))
            self._items[(scope, item_id)] = (expires, data)
            self._bytes += len(data)
            kept = self._scopes.get(scope)
            if kept is None:
                kept = self._scopes[scope] = _Scope()
            kept.size += len(data)
            kept.order[item_id] = None
            if self._is_over(kept):
                self._over[scope] = None
        self._trim()

    def get(self, scope: str, item_id: str) -> dict[str, Any] | None:
        """The item ``item_id`` of a response given to ``scope`` (None: not held)."""
        data = self._data(scope, item_id)
        return None if data is None else _decode(data)

    def finder(self, scope: str, budget: int) -> Callable[[str], dict[str, Any] | None]:
        """:meth:`get` for one request, whose references may name items of at
        most ``budget`` encoded bytes in all (past it, a 413), each once (a 400)."""
        spent = 0
        found: set[str] = set()

        def find(item_id: str) -> dict[str, Any] | None:
            nonlocal spent
            data = self._data(scope, item_id)
            if data is None:
                return None
            if item_id in found:  # (as OpenAI: twice, a call would reach the model as two with one id)
                raise errors.bad_request(
                    f"Duplicate item found with id {item_id[:100]}: reference each item once.",
                    "input",
                    "duplicate_item",
                )
            found.add(item_id)
            spent += len(data)
            if spent > budget:
                raise errors.APIError(
                    413,
                    f"The items that `input` references come to more than {budget} bytes, more than a "
                    "request body may hold here: send fewer references.",
                    param="input",
                    code="request_too_large",
                )
            item: dict[str, Any] = _decode(data)
            return item

        return find

    def _data(self, scope: str, item_id: str) -> bytes | None:
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
        self._scopes[scope].order.move_to_end(item_id)
        return found[1]

    def _is_over(self, kept: _Scope) -> bool:
        return kept.size > self.max_bytes // SHARE or len(kept.order) > self.max_items // SHARE

    def _drop(self, key: tuple[str, str]) -> None:
        expires_data = self._items.pop(key, None)
        if expires_data is None:
            return
        self._bytes -= len(expires_data[1])
        scope, item_id = key
        kept = self._scopes[scope]
        kept.size -= len(expires_data[1])
        del kept.order[item_id]
        if not kept.order:
            del self._scopes[scope]
        if scope in self._over and not self._is_over(kept):
            del self._over[scope]

    def _trim(self) -> None:
        kept = self._items
        now = self._clock()
        while kept:
            key, (expires, _) = next(iter(kept.items()))
            if expires <= now:
                self._drop(key)
            elif self._bytes <= self.max_bytes and len(kept) <= self.max_items:
                break
            elif self._over:  # full: a key over its share gives up its own oldest
                scope = next(iter(self._over))
                self._drop((scope, next(iter(self._scopes[scope].order))))
            else:
                self._drop(key)
