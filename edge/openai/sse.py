"""Encoding chat completion chunks for SSE.

The parts of a chunk that never change within a completion (id, created,
model, the choice wrapper) are encoded once, by msgspec, into a head and a
tail; a content delta is then ``head + json(text) + tail``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from edge.errors import error_json
from edge.openai.schema import Chunk, ChunkChoice, ChunkDelta, UsageOut

_encode = msgspec.json.Encoder().encode
_MARK = "\x00iop-delta\x00"
_MARK_JSON = _encode(_MARK)

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"
OBJECT = "chat.completion.chunk"


def _template(obj: Any) -> tuple[bytes, bytes]:
    head, mark, tail = _encode(obj).rpartition(_MARK_JSON)
    assert mark, "delta marker not found"
    return b"data: " + head, tail + b"\n\n"


class ChunkEncoder:
    __slots__ = ("id", "created", "model", "_content", "_reasoning", "_reasoning_field")

    def __init__(self, completion_id: str, created: int, model: str, reasoning_field: str) -> None:
        self.id = completion_id
        self.created = created
        self.model = model
        self._reasoning_field = reasoning_field
        self._content = _template(self._chunk(ChunkDelta(content=_MARK)))
        self._reasoning: tuple[bytes, bytes] | None = None  # made at the first reasoning delta

    def _reasoning_template(self) -> tuple[bytes, bytes]:
        completion_id, created, model, reasoning_field = self.id, self.created, self.model, self._reasoning_field
        self._reasoning = _template(
            {
                "id": completion_id,
                "object": OBJECT,
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": {reasoning_field: _MARK}, "finish_reason": None, "logprobs": None}],
            }
        )
        return self._reasoning

    def _chunk(self, delta: ChunkDelta, finish_reason: str | None = None) -> Chunk:
        return Chunk(
            id=self.id,
            object=OBJECT,
            created=self.created,
            model=self.model,
            choices=[ChunkChoice(index=0, delta=delta, finish_reason=finish_reason)],
        )

    def content(self, text: str) -> bytes:
        head, tail = self._content
        return head + _encode(text) + tail

    def reasoning(self, text: str) -> bytes:
        head, tail = self._reasoning or self._reasoning_template()
        return head + _encode(text) + tail

    def role(self) -> bytes:
        return self._event(self._chunk(ChunkDelta(role="assistant")))

    def tool_calls(self, calls: list[dict[str, Any]]) -> bytes:
        """One chunk per call, as OpenAI and vLLM stream parallel calls (LlamaIndex's
        streaming reads only the first call of a chunk)."""
        return b"".join(self._event(self._chunk(ChunkDelta(tool_calls=[call]))) for call in calls)

    def finish(self, finish_reason: str) -> bytes:
        return self._event(self._chunk(ChunkDelta(), finish_reason))

    def usage(self, usage: UsageOut) -> bytes:
        return self._event(
            Chunk(id=self.id, object=OBJECT, created=self.created, model=self.model, choices=[], usage=usage)
        )

    @staticmethod
    def _event(obj: Any) -> bytes:
        return b"data: " + _encode(obj) + b"\n\n"


def sse_error(message: str, type: str = "run_error", code: str | None = None) -> bytes:
    """The seeds' in-stream error: an error event, then ``[DONE]``."""
    return b"data: " + error_json(message, type, code=code) + b"\n\n" + DONE
