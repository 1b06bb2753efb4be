"""Admission and dispatch: which node runs a request, and when."""

from __future__ import annotations

import collections
import math
import random
import secrets
from collections.abc import Callable
from typing import Any

import structlog
import trio

from edge import errors
from edge.config import EdgeConfig
from edge.runs.link import NodeLink
from edge.runs.run import NODE_DISCONNECTED, NODE_LOST, Run
from proto import ModelInfo, RunRequest

log = structlog.get_logger("iop.edge.runs")


class Slot:
    """One unit of a node's capacity for one model, held from admission until
    the run is closed (or the waiter gives it back)."""

    __slots__ = ("link", "model", "released")

    def __init__(self, link: NodeLink, model: str) -> None:
        self.link = link
        self.model = model
        self.released = False

    @property
    def info(self) -> ModelInfo:
        return self.link.models[self.model]


class _Waiter:
    __slots__ = ("event", "slot", "gone", "session")

    def __init__(self, session: str | None) -> None:
        self.event = trio.Event()
        self.slot: Slot | None = None
        self.gone = False  # every node serving the model went away
        self.session = session


def new_run_id() -> str:
    return secrets.token_hex(12)


class RunService:
    def __init__(self, config: EdgeConfig) -> None:
        self.config = config
        self.links: dict[str, NodeLink] = {}
        self.runs: dict[str, Run] = {}
        self._queues: dict[str, collections.deque[_Waiter]] = collections.defaultdict(collections.deque)
        # Models some node has advertised since start, plus configured ones:
        # a request for one of these with no node linked is a 503, not a 404.
        self._known: set[str] = {m.name for m in config.models}
        self.on_run_closed: list[Callable[[Run], None]] = []

    # -- what is served --------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self.runs)

    def queue_depth(self, model: str | None = None) -> int:
        if model is not None:
            return len(self._queues.get(model, ()))
        return sum(len(q) for q in self._queues.values())

    def models(self) -> dict[str, list[NodeLink]]:
        """Model name -> links serving it now."""
        served: dict[str, list[NodeLink]] = {}
        for link in self.links.values():
            if link.closed:
                continue
            for name in link.models:
                served.setdefault(name, []).append(link)
        return served

    def _serving(self, model: str) -> list[NodeLink]:
        return [lk for lk in self.links.values() if model in lk.models and not lk.closed]

    # -- links -------------------------------------------------------------------

    def add_link(self, link: NodeLink) -> None:
        self.links[link.node_id] = link
        self._known.update(link.models)
        for model in link.models:
            self._wake(model)
        log.info("node linked", node_id=link.node_id, models=sorted(link.models))

    def remove_link(self, link: NodeLink) -> None:
        """The link is gone: fail its runs at once and wake waiters that can no
        longer be served."""
        link.closed = True
        if self.links.get(link.node_id) is link:
            del self.links[link.node_id]
        for run in list(link.runs.values()):
            run.fail(NODE_DISCONNECTED, NODE_LOST)
        for model in link.models:
            if not self._serving(model):
                for waiter in self._queues.get(model, ()):
                    waiter.gone = True
                    waiter.event.set()
                self._queues.pop(model, None)
        log.info("node unlinked", node_id=link.node_id, reason=link.close_reason or "closed")

    def set_draining(self, link: NodeLink, draining: bool) -> None:
        link.draining = draining
        if not draining:
            for model in link.models:
                self._wake(model)

    # -- admission -----------------------------------------------------------

    def _pick(self, model: str, session: str | None) -> NodeLink | None:
        best: list[NodeLink] = []
        best_load = math.inf
        for link in self.links.values():
            if link.free_slots(model) <= 0:
                continue
            load = link.load(model)
            if load < best_load:
                best, best_load = [link], load
            elif load == best_load:
                best.append(link)
        if not best:
            return None
        return best[0] if len(best) == 1 else random.choice(best)

    def _reserve(self, link: NodeLink, model: str) -> Slot:
        link.in_flight[model] += 1
        return Slot(link, model)

    def release(self, slot: Slot) -> None:
        if slot.released:
            return
        slot.released = True
        slot.link.in_flight[slot.model] -= 1
        self._wake(slot.model)

    def _wake(self, model: str) -> None:
        queue = self._queues.get(model)
        while queue:
            link = self._pick(model, queue[0].session)
            if link is None:
                return
            waiter = queue.popleft()
            waiter.slot = self._reserve(link, model)
            waiter.event.set()

    async def acquire(self, model: str, *, session: str | None = None) -> Slot:
        """A slot on a node serving ``model``: at once if one is free, else
        after waiting in the model's FIFO queue. Raises :class:`APIError`
        (404 unknown, 503 none linked, 429 queue full or timed out). A caller
        cancelled while queued leaves the queue at once."""
        if not self._serving(model):
            if model in self._known:
                raise errors.no_node(model)
            raise errors.model_not_found(model)
        queue = self._queues[model]
        if not queue:
            link = self._pick(model, session)
            if link is not None:
                return self._reserve(link, model)
        policy = self.config.policy(model)
        max_queue = self.config.max_queue if policy.max_queue is None else policy.max_queue
        timeout_ms = self.config.queue_timeout_ms if policy.queue_timeout_ms is None else policy.queue_timeout_ms
        retry_after = max(1, math.ceil(timeout_ms / 1000 / 4))
        if len(queue) >= max_queue:
            raise errors.queue_rejected(model, "queue is full", retry_after)
        waiter = _Waiter(session)
        queue.append(waiter)
        try:
            with trio.move_on_after(timeout_ms / 1000):
                await waiter.event.wait()
        except BaseException:
            # Cancelled (the client left) or worse: give back a slot that was
            # handed over in the same instant, or leave the queue.
            if waiter.slot is not None:
                self.release(waiter.slot)
            else:
                _discard(queue, waiter)
            raise
        if waiter.slot is None:
            _discard(queue, waiter)
        if waiter.slot is not None:
            return waiter.slot
        if waiter.gone:
            raise errors.no_node(model)
        raise errors.queue_rejected(model, "timed out waiting in the queue", retry_after)

    # -- runs ------------------------------------------------------------------

    def start(
        self,
        slot: Slot,
        request: dict[str, Any],
        *,
        metadata: dict[str, str],
        run_id: str | None = None,
    ) -> Run:
        """Create the run and send it to the slot's node (never blocks)."""
        cfg = self.config
        run = Run(
            run_id or new_run_id(),
            slot,
            wait_timeout=cfg.wait_timeout_s,
            run_timeout=cfg.run_timeout_s,
            max_buffered=cfg.max_buffered_events,
            metadata=metadata,
            on_close=self._closed,
        )
        self.runs[run.id] = run
        slot.link.runs[run.id] = run
        slot.link.send_nowait(
            RunRequest(
                run_id=run.id,
                model=slot.model,
                target=slot.info.target,
                request=request,
                timeout_s=cfg.run_timeout_s,
                metadata=metadata,
            )
        )
        return run

    def _closed(self, run: Run) -> None:
        self.runs.pop(run.id, None)
        run.slot.link.forget_run(run.id)
        self.release(run.slot)
        for hook in self.on_run_closed:
            hook(run)


def _discard(queue: collections.deque[_Waiter], waiter: _Waiter) -> None:
    try:
        queue.remove(waiter)
    except ValueError:
        pass


__all__ = ["RunService", "Slot", "NODE_LOST"]
