"""The run service: linked nodes, capacity slots, the admission queue, runs.

Nothing here knows HTTP. The OpenAI layer asks :class:`RunService` for a slot
(:meth:`RunService.acquire`), starts a :class:`Run` on it, reads its events,
and closes it; closing is synchronous, so it needs no shield in a ``finally``.
"""

from edge.runs.link import NodeLink
from edge.runs.run import Run
from edge.runs.service import RunService, Slot, Want

__all__ = ["NodeLink", "Run", "RunService", "Slot", "Want"]
