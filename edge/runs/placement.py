"""Where a run goes in a fleet: prompt prefix chains, the edge's index of the
prefixes it sent to each node, and rendezvous hashing.

A request's prefix chain is computed once, at the edge, from its rendered
messages: each message (role, then text) is cut into blocks of
:data:`BLOCK_BYTES`, and block *i*'s key is a hash of everything up to the end
of block *i* (one running BLAKE2b, copied at each block end; the model name
seeds it). A message ends its last, shorter block, so a conversation that grows
by messages matches all of its earlier messages, and a shared system prompt
with varying tails matches the system prompt's blocks. Keys are 60-bit ints (a
Python int of two digits, the smallest heap int that holds them).

:class:`PrefixIndex` maps a key to the nodes the edge recently sent it to:
a bounded, approximate LRU of two generations of plain dicts (a key recorded
again moves to the young one; when the young one is full the old one is
dropped). Matching walks the chain from its start while some candidate node
holds the block: O(prefix blocks), whatever the number of nodes or sessions.

:func:`rendezvous` (highest random weight) picks among equally good nodes the
same way on every edge, with no shared state: a stable hash of the key and
each node id, highest wins; removing a node moves only the keys it had.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable

from proto import MAX_PREFIX_BLOCKS

BLOCK_BYTES = 256  # of UTF-8 text: about 64 tokens, a few KV cache pages
MAX_BLOCKS = MAX_PREFIX_BLOCKS  # a chain stops here (512 KB of text, about 128k tokens)
MAX_HOLDERS = 4  # nodes remembered per block, most recent first
_KEY_BITS = 60

Holders = str | tuple[str, ...]


def prefix_chain(model: str, messages: Iterable[tuple[str, str]]) -> tuple[int, ...]:
    """The block keys of a prompt given as (role, text) pairs, in order,
    at most :data:`MAX_BLOCKS`."""
    h = hashlib.blake2b(model.encode(), digest_size=8)
    keys: list[int] = []
    for role, text in messages:
        h.update(b"\x1e" + role.encode() + b"\x1f")
        data = memoryview(text.encode("utf-8", "surrogatepass"))
        end = max(len(data), 1)
        for start in range(0, end, BLOCK_BYTES):
            h.update(data[start : start + BLOCK_BYTES])
            keys.append(int.from_bytes(h.copy().digest(), "little") >> (64 - _KEY_BITS))
            if len(keys) >= MAX_BLOCKS:
                return tuple(keys)
    return tuple(keys)


class PrefixIndex:
    """Block key -> the nodes (ids) the edge sent that prefix to, at most
    ``max_entries`` keys (0: remember nothing). Measured on CPython 3.11:
    about 80 bytes a key (dict slot and int key; node ids are shared
    references), so the default 500,000 keys are about 40 MB at most."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._half = max(max_entries // 2, 1)
        self._young: dict[int, Holders] = {}
        self._old: dict[int, Holders] = {}

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def record(self, chain: Iterable[int], node_id: str) -> None:
        """``node_id`` was sent a prompt with this chain: each of its keys
        now names it first."""
        if self.max_entries <= 0:
            return
        young = self._young
        for key in chain:
            held = young.get(key)
            if held is None:
                held = self._old.pop(key, None)
            if held is None or held == node_id:
                young[key] = node_id
            elif isinstance(held, str):
                young[key] = (node_id, held)
            elif held[0] != node_id:
                young[key] = (node_id, *(n for n in held if n != node_id))[:MAX_HOLDERS]
            if len(young) >= self._half:
                self._old, self._young = young, {}
                young = self._young

    def forget(self, chain: Iterable[int], node_id: str) -> None:
        """``node_id`` no longer holds any block of this chain (its run of the prompt failed)."""
        for gen in (self._young, self._old):
            for key in chain:
                held = gen.get(key)
                if held is None:
                    continue
                if held == node_id:
                    del gen[key]
                elif not isinstance(held, str) and node_id in held:
                    rest = tuple(n for n in held if n != node_id)
                    gen[key] = rest[0] if len(rest) == 1 else rest

    def holders(self, key: int) -> Holders | None:
        held = self._young.get(key)
        return self._old.get(key) if held is None else held

    def match(self, chain: Iterable[int], candidates: Collection[str]) -> tuple[int, set[str]]:
        """The longest run of leading blocks some candidate holds, and the
        candidates holding all of it (empty when nothing matches)."""
        alive = set(candidates)
        depth = 0
        young, old = self._young.get, self._old.get
        for key in chain:
            held = young(key)
            if held is None:
                held = old(key)
            if held is None:
                break
            if isinstance(held, str):
                if held not in alive:
                    break
                if len(alive) > 1:
                    alive = {held}
            else:
                hit = alive.intersection(held)
                if not hit:
                    break
                alive = hit
            depth += 1
        return depth, alive if depth else set()


def rendezvous(key: bytes, node_ids: Iterable[str]) -> str:
    """The node id with the highest weight for ``key`` (a stable hash, the
    same in every process); ties cannot favour insertion order."""
    return max(node_ids, key=lambda node_id: (_weight(key, node_id), node_id))


def _weight(key: bytes, node_id: str) -> bytes:
    return hashlib.blake2b(key + b"\x00" + node_id.encode(), digest_size=8).digest()


def rendezvous_key(session: str | None, chain: tuple[int, ...]) -> bytes | None:
    """What rendezvous hashing keys on: the session id, else the first prefix block."""
    if session:
        return b"s" + session.encode()
    if chain:
        return b"p" + chain[0].to_bytes(8, "little")
    return None
