"""The edge's view of one linked node."""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING

import structlog
import trio

from proto import Frame, ModelInfo

if TYPE_CHECKING:
    from edge.runs.run import Run

log = structlog.get_logger("iop.edge.link")

_RECENT_RUNS = 4096  # ended run ids remembered per link, to drop late events


class NodeLink:
    """A node's models, its capacity use, its runs and its outgoing frames.

    Frames to the node go through a bounded outbox drained by the link's
    sender task; :meth:`send_nowait` never blocks, and a full outbox means the
    node stopped reading, which kills the link.
    """

    def __init__(self, node_id: str, models: list[ModelInfo], *, outbox_size: int) -> None:
        self.node_id = node_id
        self.models: dict[str, ModelInfo] = {m.name: m for m in models}
        self.in_flight: dict[str, int] = {m.name: 0 for m in models}
        self.runs: dict[str, Run] = {}
        self.linked_at = trio.current_time()
        self.linked_wall = time.time()
        self.last_rx = self.linked_at
        self.draining = False
        self.closed = False
        self.close_reason = ""
        self.close_code = 1000
        self._recent: collections.deque[str] = collections.deque(maxlen=_RECENT_RUNS)
        self._recent_set: set[str] = set()
        self._outbox_send, self.outbox = trio.open_memory_channel[Frame](outbox_size)
        self._cancel_scope: trio.CancelScope | None = None

    # -- capacity ------------------------------------------------------------

    def free_slots(self, model: str) -> int:
        if self.closed or self.draining:
            return 0
        info = self.models.get(model)
        if info is None:
            return 0
        return info.max_concurrency - self.in_flight[model]

    def load(self, model: str) -> float:
        return self.in_flight[model] / max(self.models[model].max_concurrency, 1)

    # -- runs ----------------------------------------------------------------

    def forget_run(self, run_id: str) -> None:
        self.runs.pop(run_id, None)
        if len(self._recent) == self._recent.maxlen:
            self._recent_set.discard(self._recent[0])
        self._recent.append(run_id)
        self._recent_set.add(run_id)

    def recently_ended(self, run_id: str) -> bool:
        return run_id in self._recent_set

    # -- frames --------------------------------------------------------------

    def send_nowait(self, frame: Frame) -> None:
        if self.closed:
            return
        try:
            self._outbox_send.send_nowait(frame)
        except trio.WouldBlock:
            self.kill("node is not reading its link", code=1008)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    def bind_scope(self, scope: trio.CancelScope) -> None:
        self._cancel_scope = scope

    def kill(self, reason: str, code: int = 1011) -> None:
        """Close the link from anywhere (synchronous): the link task ends."""
        if not self.close_reason:
            self.close_reason = reason
            self.close_code = code
            log.warning("closing node link", node_id=self.node_id, reason=reason)
        if self._cancel_scope is not None:
            self._cancel_scope.cancel()

    def close_outbox(self) -> None:
        self._outbox_send.close()
