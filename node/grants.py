"""A node's capacity for one model, split between the edges it is linked to.

Sans-I/O: the agent tells a :class:`GrantBook` what happens (an edge linked
or left, a run started or ended, an edge reported its demand) and sends the
``Grant`` frames :meth:`GrantBook.rebalance` returns.

Each edge holds a **grant**: the most runs of the model it may have on this
node at once. The rules:

- the sum of what the edges may be using never exceeds the capacity. What an
  edge may be using (``held``) is the largest of its grant, every grant it was
  sent and has not acknowledged yet (a shrink counts only once the edge says
  it has seen it: runs it sent under the larger grant may still be on the
  wire), and the runs it has running here;
- a grant is never below the edge's running runs (a running run keeps its
  slot; grants shrink as runs end);
- the target of each edge: a max-min fair share of the capacity by demand
  (the edge's in-flight plus waiting), never below its running runs; what no
  edge asks for evens the edges out (each at least its demand), so an idle
  edge keeps a little for a burst, an edge running within its even share
  takes nothing from another, and a lone edge holds the whole capacity. Shrinks are sent first; grows take only
  capacity no edge may be using;
- when the edges' demand exceeds the capacity and it does not split evenly,
  the slots left over take turns: every ``REMAINDER_TURN_S`` the next edge in
  link order is first in line for them. (Given to the older links always, two
  edges with equal demand on 3-slot nodes ran 2:1, as every node was linked to
  the same edge first.) A turn moves a slot only as a run ends; no run is
  stopped for it;
- an edge that stops answering while it holds grant it does not use and
  another edge waits (a SIGSTOP, a VM pause) is *lapsed* by the agent
  (:meth:`GrantBook.lapse`): its grant drops to its running runs at once,
  without its acknowledgement, and it is given nothing more until it is
  heard from again (:meth:`GrantBook.revive`). Its shrink is the first
  thing it reads when it wakes; a run it sent under the old grant before
  that is served all the same, waiting on the node's semaphore if it must
  (the upstream never runs more than the capacity). Before, the idle grant
  stayed with it until its link was judged dead (15 s by default).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

from proto import Grant

REMAINDER_TURN_S = 1.0  # how long one edge is first in line for the slots a fair split leaves over


class EdgeShare:
    """One edge's share of one model's capacity."""

    __slots__ = ("grant", "seq", "pending", "active", "in_flight", "waiting", "order", "lapsed")

    def __init__(self, order: int) -> None:
        self.grant = 0  # the last grant sent
        self.seq = 0  # its sequence number
        self.pending: list[tuple[int, int]] = []  # (seq, slots) sent and not acknowledged
        self.active = 0  # runs of this edge running here (not ended, not cancelled)
        self.in_flight = 0  # as the edge last reported
        self.waiting = 0  # as the edge last reported
        self.order = order  # link order
        self.lapsed = False  # the edge stopped answering: it holds its running runs' slots, no more

    @property
    def held(self) -> int:
        """The most runs this edge may have on the node, as far as the node can know."""
        return max(self.grant, self.active, max((slots for _, slots in self.pending), default=0))

    @property
    def demand(self) -> int:
        return self.active if self.lapsed else max(self.in_flight + self.waiting, self.active)

    @property
    def idle(self) -> int:
        """Slots it holds and runs nothing on."""
        return self.held - self.active


class GrantBook:
    """One model's capacity on this node and the edges' grants of it."""

    def __init__(self, model: str, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self.capacity = capacity
        self.shares: dict[Hashable, EdgeShare] = {}
        self._order = 0
        self._clock = clock

    # -- what happens ------------------------------------------------------------

    def add(self, edge: Hashable) -> None:
        self._order += 1
        self.shares[edge] = EdgeShare(self._order)

    def remove(self, edge: Hashable) -> None:
        """The edge's link is gone and its runs have ended."""
        self.shares.pop(edge, None)

    def report(self, edge: Hashable, in_flight: int, waiting: int, seq: int) -> None:
        """The edge's demand, and the last grant it has seen (``seq``)."""
        share = self.shares.get(edge)
        if share is None:
            return
        share.in_flight, share.waiting = max(in_flight, 0), max(waiting, 0)
        if share.pending and seq >= share.pending[0][0]:
            share.pending = [p for p in share.pending if p[0] > seq]

    def contended(self, edge: Hashable) -> bool:
        """``edge`` holds slots it runs nothing on while another edge has runs waiting."""
        share = self.shares.get(edge)
        if share is None or share.lapsed or share.idle <= 0:
            return False
        return any(other.waiting > 0 for other in self.shares.values() if other is not share)

    def lapse(self, edge: Hashable) -> None:
        """``edge`` stopped answering while :meth:`contended`: what it holds beyond its running
        runs is taken back now (no acknowledgement: runs it sent before it reads the shrink
        are served anyway, see the module's docstring), and it gets nothing more until
        :meth:`revive`."""
        share = self.shares.get(edge)
        if share is None or share.lapsed:
            return
        share.lapsed = True
        share.pending.clear()

    def revive(self, edge: Hashable) -> None:
        """``edge`` answers again: its demand counts once more."""
        share = self.shares.get(edge)
        if share is not None:
            share.lapsed = False

    def start(self, edge: Hashable) -> bool:
        """A run of ``edge`` wants to start: False if that would exceed its grant."""
        share = self.shares.get(edge)
        if share is None or share.active >= share.held:
            return False
        share.active += 1
        return True

    def end(self, edge: Hashable) -> None:
        share = self.shares.get(edge)
        if share is not None and share.active > 0:
            share.active -= 1

    # -- accounting --------------------------------------------------------------

    def held(self) -> int:
        return sum(s.held for s in self.shares.values())

    def targets(self) -> dict[Hashable, int]:
        """What each edge should hold: max-min fair by demand (each edge the
        same level, or its whole demand if less), never below its running
        runs; capacity no edge asks for evens the edges out, each at least its demand."""
        shares = sorted(self.shares.items(), key=lambda kv: kv[1].order)
        if not shares:
            return {}

        def at(level: int) -> list[int]:
            return [min(max(level, s.active), s.demand) for _, s in shares]

        wanted = sum(s.demand for _, s in shares)
        if wanted <= self.capacity:
            target = [s.demand for _, s in shares]
            live = [i for i, (_, s) in enumerate(shares) if not s.lapsed]  # (a lapsed edge gets none of it)
            if live:
                # What no edge asks for evens the live edges out: the highest level each may hold
                # (or its demand, if more), then a slot each to those at that level, in link
                # order, for what is left. (Added on top of each demand in link order, one run on
                # a 3-slot node shared by 3 edges took the last-linked edge's whole grant, none
                # waiting: until it came back, that edge saw the node full and sent a prompt the
                # node held elsewhere; an outside audit.)
                room = self.capacity - (wanted - sum(target[i] for i in live))
                low = _highest(room, lambda level: sum(max(target[i], level) for i in live) <= room)
                for i in live:
                    target[i] = max(target[i], low)
                left = room - sum(target[i] for i in live)
                for i in [i for i in live if target[i] == low][:left]:
                    target[i] += 1
        else:
            low = _highest(self.capacity, lambda level: sum(at(level)) <= self.capacity)
            target = at(low)
            left = self.capacity - sum(target)
            more = at(low + 1)
            # The remainder: one more each to the edges that want more, from the one whose turn it
            # is on (turns among those alone: with an idle third edge in the book, its turns fell
            # to the next edge in link order, which got the slot two turns in three).
            wanting = [i for i in range(len(shares)) if more[i] > target[i]]
            if wanting:
                first = int(self._clock() / REMAINDER_TURN_S) % len(wanting)
                for i in (wanting[first:] + wanting[:first])[:left]:
                    target[i] += 1
        return {edge: t for (edge, _), t in zip(shares, target, strict=True)}

    def rebalance(self) -> list[tuple[Hashable, Grant]]:
        """Move grants toward the targets; the ``Grant`` frames to send, per edge."""
        target = self.targets()
        out: list[tuple[Hashable, Grant]] = []
        for edge, share in self.shares.items():
            if target[edge] < share.grant:
                out.append((edge, self._set(share, target[edge])))
        free = self.capacity - self.held()
        growing = [(edge, share) for edge, share in self.shares.items() if target[edge] > share.grant]
        growing.sort(key=lambda kv: (kv[1].waiting == 0, kv[1].order))  # edges with waiting runs first
        for edge, share in growing:
            held = share.held
            slots = min(target[edge], held + max(free, 0))
            if slots <= share.grant:
                continue
            free -= max(slots - held, 0)
            out.append((edge, self._set(share, slots)))
        return out

    def _set(self, share: EdgeShare, slots: int) -> Grant:
        share.seq += 1
        if not share.lapsed:  # (a lapsed edge's old grant is taken back unacknowledged)
            share.pending.append((share.seq, share.grant))  # the old grant stays held until acknowledged
        share.grant = slots
        return Grant(model=self.model, slots=slots, seq=share.seq)


def _highest(most: int, fits: Callable[[int], bool]) -> int:
    """The highest level from 0 to ``most`` that ``fits`` (which holds for 0, and for every
    level below one it holds for)."""
    low, high = 0, most
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


__all__ = ["EdgeShare", "GrantBook"]
