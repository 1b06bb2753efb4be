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
dropped). It keeps a few keys of each prompt, not all (:func:`anchors`): its
last block, which the conversation's next turn holds whole, and the blocks at
powers of two, which prompts sharing only a head (a system prompt, tools) have
in common. Matching finds the deepest block of the chain a candidate node
holds: O(prefix blocks), whatever the number of nodes or sessions.

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
    return prompt_chain(model, messages)[0]


def prompt_chain(model: str, messages: Iterable[tuple[str, str]]) -> tuple[tuple[int, ...], int]:
    """:func:`prefix_chain`, and the index of its block that ends the first ``user`` message
    (the last block when there is none): the conversation's opening, the same in each of its
    turns, and different in conversations that share a system prompt and tools."""
    h = hashlib.blake2b(model.encode(), digest_size=8)
    keys: list[int] = []
    opening = -1
    for role, text in messages:
        h.update(b"\x1e" + role.encode() + b"\x1f")
        data = memoryview(text.encode("utf-8", "surrogatepass"))
        end = max(len(data), 1)
        for start in range(0, end, BLOCK_BYTES):
            h.update(data[start : start + BLOCK_BYTES])
            keys.append(int.from_bytes(h.copy().digest(), "little") >> (64 - _KEY_BITS))
            if len(keys) >= MAX_BLOCKS:
                return tuple(keys), opening if opening >= 0 else len(keys) - 1
        if opening < 0 and role == "user":
            opening = len(keys) - 1
    return tuple(keys), opening if opening >= 0 else max(len(keys) - 1, 0)


class _Recent:
    """Block key -> the nodes (ids) it was sent to, most recent first: at most ``max_entries``
    keys, in two generations of plain dicts (a key recorded again moves to the young one;
    when the young one is full the old one is dropped)."""

    __slots__ = ("max_entries", "_half", "young", "old")

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._half = max(max_entries // 2, 1)
        self.young: dict[int, Holders] = {}
        self.old: dict[int, Holders] = {}

    def __len__(self) -> int:
        return len(self.young) + len(self.old)

    def record(self, chain: Iterable[int], node_id: str) -> None:
        if self.max_entries <= 0:
            return
        young = self.young
        for key in chain:
            held = young.get(key)
            if held is None:
                held = self.old.pop(key, None)
            if held is None or held == node_id:
                young[key] = node_id
            elif isinstance(held, str):
                young[key] = (node_id, held)
            elif held[0] != node_id:
                young[key] = (node_id, *(n for n in held if n != node_id))[:MAX_HOLDERS]
            if len(young) >= self._half:
                self.old, self.young = young, {}
                young = self.young

    def forget(self, chain: Iterable[int], node_id: str) -> None:
        for gen in (self.young, self.old):
            for key in chain:
                held = gen.get(key)
                if held is None:
                    continue
                if held == node_id:
                    del gen[key]
                elif not isinstance(held, str) and node_id in held:
                    rest = tuple(n for n in held if n != node_id)
                    gen[key] = rest[0] if len(rest) == 1 else rest

    def get(self, key: int) -> Holders | None:
        held = self.young.get(key)
        return self.old.get(key) if held is None else held


class PrefixIndex:
    """Block key -> the nodes (ids) the edge sent that prefix to, at most
    ``max_entries`` keys (0: remember nothing); and, apart, at most half as many
    that nodes relayed from other edges (:meth:`record` with ``relayed``), so a
    node flooding the link with relays evicts relays only, never the edge's own
    placements. Measured on CPython 3.11: about 80 bytes a key with one holder
    (dict slot and int key; node ids are shared references), about 150 with
    :data:`MAX_HOLDERS`."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._own = _Recent(max_entries)
        self._relayed = _Recent(max_entries // 2)

    def __len__(self) -> int:
        return len(self._own) + len(self._relayed)

    def record(self, chain: tuple[int, ...] | list[int], node_id: str, relayed: bool = False) -> None:
        """``node_id`` was sent a prompt with this chain (by another edge: ``relayed``):
        its :func:`anchors` now name it first."""
        (self._relayed if relayed else self._own).record(anchors(chain), node_id)

    def forget(self, chain: Iterable[int], node_id: str) -> None:
        """``node_id`` no longer holds any block of this chain (its run of the prompt failed):
        every key of it that names the node, whichever prompt recorded it."""
        self._own.forget(chain, node_id)
        self._relayed.forget(chain, node_id)

    def holders(self, key: int) -> Holders | None:
        held = self._own.get(key)
        return self._relayed.get(key) if held is None else held

    def match(self, chain: tuple[int, ...] | list[int], candidates: Collection[str]) -> tuple[int, set[str]]:
        """The deepest block of the chain some candidate holds, and the candidates holding it
        (0 and none when none does). A block's key covers every block before it, so a node
        sent that block was sent all of them, whatever the index lists for those: a block
        every node got (a shared system prompt) lists only the last :data:`MAX_HOLDERS`, and
        stopping there pulled each conversation off its node onto one of those. The walk
        goes from the deepest block up and stops at the first a candidate holds: the index
        keeps only some keys of each prompt, so a block it lacks says nothing of those before."""
        alive = candidates if isinstance(candidates, (set, frozenset)) else set(candidates)
        own, relayed = self._own, self._relayed
        young, old = own.young.get, own.old.get
        relays = relayed.young or relayed.old
        for at in range(len(chain), 0, -1):
            key = chain[at - 1]
            held = young(key)
            if held is None:
                held = old(key)
            if relays:
                more = relayed.get(key)
                if more is not None:
                    held = more if held is None else _joined(held, more)
            if held is not None and (hit := _among(held, alive)):
                return at, hit
        return 0, set()

    def relayed_match(self, chain: tuple[int, ...] | list[int], candidates: Collection[str]) -> tuple[int, set[str]]:
        """:meth:`match` among the blocks other edges placed (relayed) only."""
        relayed = self._relayed
        if relayed.young or relayed.old:
            alive = candidates if isinstance(candidates, (set, frozenset)) else set(candidates)
            for at in range(len(chain), 0, -1):
                held = relayed.get(chain[at - 1])
                if held is not None and (hit := _among(held, alive)):
                    return at, hit
        return 0, set()


def anchors(chain: tuple[int, ...] | list[int]) -> list[int]:
    """The keys of a chain the index keeps: the blocks at powers of two (1, 2, 4, ...: a prompt
    sharing any head with this one holds at least half of that head in them) and the last
    (what the conversation's next turn, or a retry, holds whole). A key per block of a
    growing conversation kept about 3,000 conversations of 20 KB in 500,000 keys; this keeps
    a few keys per turn."""
    n = len(chain)
    if n <= 2:
        return list(chain)
    keys = [chain[(1 << i) - 1] for i in range(n.bit_length()) if (1 << i) < n]
    keys.append(chain[-1])
    return keys


def _among(held: Holders, alive: set[str] | frozenset[str]) -> set[str]:
    """Those of ``held`` in ``alive``."""
    if isinstance(held, str):
        return {held} if held in alive else set()
    return alive.intersection(held)


def _joined(one: Holders, two: Holders) -> tuple[str, ...]:
    return (*((one,) if isinstance(one, str) else one), *((two,) if isinstance(two, str) else two))


def rendezvous(key: bytes, node_ids: Iterable[str]) -> str:
    """The node id with the highest weight for ``key`` (a stable hash, the
    same in every process); ties cannot favour insertion order."""
    return max(node_ids, key=lambda node_id: (_weight(key, node_id), node_id))


def _weight(key: bytes, node_id: str) -> bytes:
    return hashlib.blake2b(key + b"\x00" + node_id.encode(), digest_size=8).digest()


def ranked(key: bytes, node_ids: Iterable[str], first: Collection[str] = ()) -> list[str]:
    """``node_ids`` in rendezvous order for ``key`` (highest weight first), those in ``first``
    ahead of the rest."""
    return sorted(node_ids, key=lambda node_id: (node_id in first, _weight(key, node_id), node_id), reverse=True)


class HeadShares:
    """New conversations of late that opened with a shared head, in all and by head (a system prompt
    and tools: the deepest block of the index they matched, no deeper than their opening),
    counted with a half-life of ``half_life_s``. A head's share of them says over how many nodes
    its new conversations spread: every conversation's head (one agent's system prompt), all of
    them; one head of eight, one node, whose prefix cache then holds it once. (On one node, the
    first sent it, all of one agent's conversations piled up while others sat idle; spread over
    every node, eight agents' system prompts filled every cache.) At most ``max_heads`` heads,
    the least recently seen forgotten."""

    __slots__ = ("half_life_s", "max_heads", "_heads", "_all")

    def __init__(self, half_life_s: float = 300.0, max_heads: int = 4096) -> None:
        self.half_life_s = half_life_s
        self.max_heads = max_heads
        self._heads: dict[int, tuple[float, float]] = {}  # head block key -> (count, when)
        self._all = (0.0, 0.0)

    def _now(self, counted: tuple[float, float] | None, now: float) -> float:
        if counted is None:
            return 0.0
        count, when = counted
        return count * 0.5 ** ((now - when) / self.half_life_s) if now > when else count

    def counted(self, now: float) -> float:
        """The new conversations counted of late (decayed)."""
        return self._now(self._all, now)

    def share(self, head: int, now: float, counting: bool = False) -> float:
        """The head's share of the new conversations counted (``counting``: and one more of it)."""
        extra = 1.0 if counting else 0.0
        total = self._now(self._all, now) + extra
        return 1.0 if total <= 0 else min(1.0, (self._now(self._heads.get(head), now) + extra) / total)

    def started(self, head: int | None, now: float) -> None:
        """A new conversation was placed (``head``: the shared head it matched; None, it matched
        none, and is not counted: independent requests do not make heads rarer)."""
        if head is None:
            return
        self._all = (self._now(self._all, now) + 1, now)
        counted = self._heads.pop(head, None)  # (re-inserted: the most recent last)
        self._heads[head] = (self._now(counted, now) + 1, now)
        if len(self._heads) > self.max_heads:
            del self._heads[next(iter(self._heads))]


def rendezvous_key(session: str | None, chain: tuple[int, ...], opening: int = 0) -> bytes | None:
    """What rendezvous hashing keys on: the session id, else the conversation's opening
    (:func:`prompt_chain`: the first block shared a system prompt, and every conversation
    that started with it went to one node among equally loaded ones)."""
    if session:
        return b"s" + session.encode()
    if chain:
        return b"p" + chain[min(opening, len(chain) - 1)].to_bytes(8, "little")
    return None


def popular(held: Holders | None) -> bool:
    """A block sent to :data:`MAX_HOLDERS` nodes or more (the index lists that many)."""
    return held is not None and not isinstance(held, str) and len(held) >= MAX_HOLDERS
