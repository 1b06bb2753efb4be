"""Adapters run one request against a model server and report through a sink.

An adapter is an object with ``async def run(request, sink)``. It reports
text with ``await sink.delta(...)`` / ``sink.reasoning(...)`` (or, from code
that must not wait, such as the node's poll of upstream sockets,
``sink.delta_nowait(...)``, then ``await sink.room()`` when it says the
link's outbox is full) and ends with ``sink.complete(...)`` or
``sink.error(...)``. Cancellation (the edge's
CancelRun, the run deadline, a lost link) arrives as ``trio.Cancelled``
inside ``run``; an adapter must let it propagate so its upstream request is
closed.
"""

from __future__ import annotations

from typing import Protocol

import trio

from node.config import ModelConfig
from proto import RunRequest, ToolCall, Usage


class Sink(Protocol):
    ended: bool  # complete() or error() was called
    started: bool  # some event was reported

    async def delta(self, text: str, parts: int = 1) -> None: ...
    async def reasoning(self, text: str, parts: int = 1) -> None: ...
    # Without waiting (called from the node's poll of upstream sockets);
    # False: await room() before reporting more.
    def delta_nowait(self, text: str, parts: int = 1) -> bool: ...
    def reasoning_nowait(self, text: str, parts: int = 1) -> bool: ...
    def progress_nowait(self, parts: int = 1) -> bool: ...  # a tool call is streaming (sent whole at the end)
    async def room(self) -> None: ...
    async def complete(
        self,
        finish_reason: str,
        tool_calls: list[ToolCall] | None = None,
        usage: Usage | None = None,
        stop: str = "",
        refusal: str = "",  # the model's refusal text, whole (OpenAI's ``refusal``)
    ) -> None: ...
    async def error(self, message: str, status: int = 0, retry_after: float = 0.0) -> None: ...


class Adapter(Protocol):
    async def run(self, request: RunRequest, sink: Sink) -> None: ...
    async def aclose(self) -> None: ...


class Counters:
    """What the node is doing right now, for tests, logs and the status report."""

    def __init__(self) -> None:
        self.active_upstream = 0  # open upstream requests (sim runs count too)
        self.active_runs = 0
        self.prefix_hit_tokens = 0  # sim models with a prefix cache: prompt tokens found cached...
        self.prefix_miss_tokens = 0  # ...and prefilled
        self.run_ended = trio.lowlevel.ParkingLot()  # unparked whenever a run ends


class Via:
    """The ``x-iop-via`` a node's upstream requests carry: the ids of the edges it links to
    now, after those the run's request came through (the edge passes them on), so an edge
    that finds its own id in a request it receives refuses it as a loop (a model whose
    base_url leads back to an edge of its node, directly or through other edges). Edge ids
    are random per edge: node ids repeat across tiers (a chain of edges whose nodes shared
    an id was refused; a re-check)."""

    __slots__ = ("edges",)

    MAX_IDS = 16  # (a chain longer than this is no deployment: what came before is dropped)

    def __init__(self) -> None:
        self.edges: dict[str, int] = {}  # edge id -> its links now (a node may dial an edge twice)

    def linked(self, edge_id: str) -> None:
        self.edges[edge_id] = self.edges.get(edge_id, 0) + 1

    def unlinked(self, edge_id: str) -> None:
        left = self.edges.get(edge_id, 0) - 1
        if left > 0:
            self.edges[edge_id] = left
        else:
            self.edges.pop(edge_id, None)

    def header(self, came: str = "") -> str:
        ids = [i for i in came.split(",") if i] if came else []
        ids += [i for i in self.edges if i not in ids]
        return ",".join(ids[-self.MAX_IDS :])


def make_adapter(
    model: ModelConfig,
    counters: Counters,
    *,
    connect_timeout_s: float,
    read_timeout_s: float,
    ca_file: str = "",
    via: Via | None = None,
) -> Adapter:
    if model.adapter == "openai":
        from node.adapters.openai import OpenAIAdapter

        return OpenAIAdapter(
            model,
            counters,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
            ca_file=ca_file,
            via=via,
        )
    from node.adapters.sim import SimAdapter

    return SimAdapter(model, counters)
