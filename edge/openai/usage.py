"""A response's usage: the upstream's counts, or the edge's estimate of them.

Usage always carries three integers (client code adds ``total_tokens`` up).
A count the upstream did not report is estimated: prompt tokens as
:func:`edge.openai.request.estimate_input_tokens` does for admission
(characters / 4, plus 4 per message); completion tokens as one per generated
delta, content or reasoning (nodes always stream from the model server, which
sends about one token per delta; a node that joins deltas it read together
says how many in the event's ``parts``), plus the characters / 4 of native tool calls
(they arrive whole). A response with an estimated count is marked in the
access line (``usage_estimated``) and counted in ``iop_usage_estimated_total``.
"""

from __future__ import annotations

from edge.openai.schema import UsageOut
from proto import ToolCall, Usage


def usage_out(
    reported: Usage | None, *, prompt_estimate: int, deltas: int, tool_calls: list[ToolCall] | None = None
) -> tuple[UsageOut, bool]:
    """The usage to send, and whether any count in it is the edge's estimate."""
    r = reported or Usage()
    estimated = False
    prompt = r.prompt_tokens
    if prompt is None:
        prompt, estimated = prompt_estimate, True
    completion = r.completion_tokens
    if completion is None:
        if r.total_tokens is not None and not estimated:
            completion = max(r.total_tokens - prompt, 0)
        else:
            calls = sum(len(c.function.name) + len(c.function.arguments) for c in tool_calls or ())
            completion, estimated = deltas + calls // 4, True
    total = r.total_tokens if r.total_tokens is not None and not estimated else prompt + completion
    details = {"reasoning_tokens": r.reasoning_tokens} if r.reasoning_tokens is not None else None
    cached = {"cached_tokens": r.cached_tokens} if r.cached_tokens is not None else None
    return UsageOut(prompt, completion, total, details, cached), estimated
