"""Per-chunk stream tracing, off unless asked for.

``IOP_OPENAI_COMPAT_TRACE_STREAM=1`` (any of 1/true/yes/on), or the run
metadata key ``iop_trace_stream`` (the request's ``metadata`` object), logs
every emitted chunk: run id (bound in the log context), sequence number, type,
length, and for each upstream delta whether the filters changed it; at most
:data:`MAX_TRACED_CHUNKS` lines a stream, of either kind (a client's metadata can ask for it:
``trace_requests = false`` in the edge's config refuses).
"""

from __future__ import annotations

import os

import structlog

log = structlog.get_logger("iop.edge.trace")

TRACE_ENV = "IOP_OPENAI_COMPAT_TRACE_STREAM"
TRACE_METADATA_KEY = "iop_trace_stream"
_TRUE = {"1", "true", "yes", "on"}
MAX_TRACED_CHUNKS = 10_000  # lines a stream's trace writes (~225 bytes each), then one that says it stopped


def trace_enabled(metadata: dict[str, str]) -> bool:
    return (
        os.environ.get(TRACE_ENV, "").strip().lower() in _TRUE
        or metadata.get(TRACE_METADATA_KEY, "").strip().lower() in _TRUE
    )


class StreamTrace:
    __slots__ = ("seq", "emitted", "lines")

    def __init__(self) -> None:
        self.seq = 0
        self.emitted = 0  # characters emitted so far
        self.lines = 0  # written, of both kinds

    def _room(self) -> bool:
        """Whether one more line may be written (the first past the bound says the trace stopped)."""
        if self.lines > MAX_TRACED_CHUNKS:
            return False
        self.lines += 1
        if self.lines > MAX_TRACED_CHUNKS:
            log.info("chat completion stream trace stopped", seq=self.seq, max_traced_chunks=MAX_TRACED_CHUNKS)
            return False
        return True

    def chunk(self, kind: str, length: int, **extra) -> None:
        self.seq += 1
        self.emitted += length
        if self._room():
            log.info("chat completion stream output chunk", seq=self.seq, type=kind, delta_len=length, **extra)

    def around(self, kind: str, text: str, shape) -> None:
        """Shape one upstream delta, then say whether the filters changed it."""
        emitted_before = self.emitted
        shape(text)
        emitted = self.emitted - emitted_before
        if emitted != len(text) and self._room():
            log.info(
                "chat completion stream output filtered",
                type=kind,
                source_len=len(text),
                emitted_len=emitted,
                suppressed=emitted == 0,
            )
