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

import structlog

from edge.openai.schema import UsageOut
from proto import ToolCall, Usage

log = structlog.get_logger()

# A count past what the request allows is no model server's: a node holding a node token
# reported 2^40 tokens and spent a key's daily budget with one request (an outside attack). Such
# a count is cut to the bound and marked as the edge's figure: prompt tokens at most 4 a
# character of the prompt (16 x its estimate of a token per 4 characters) plus PROMPT_SLACK (a
# chat template, images); completion tokens at most the request's max_tokens, else the
# model's context window on its node, else UNASKED_OUTPUT.
PROMPT_SLACK = 65_536
UNASKED_OUTPUT = 1 << 20


def bounds(prompt_estimate: int, max_output: int) -> tuple[int, int]:
    """The most prompt and completion tokens a request's usage may count."""
    return 16 * prompt_estimate + PROMPT_SLACK, max_output or UNASKED_OUTPUT


def within_bounds(prompt: int, completion: int, prompt_estimate: int, max_output: int) -> tuple[int, int, bool]:
    """``prompt`` and ``completion`` cut to :func:`bounds`, and whether either was."""
    prompt_cap, completion_cap = bounds(prompt_estimate, max_output)
    if prompt <= prompt_cap and completion <= completion_cap:
        return prompt, completion, False
    log.warning("usage past the request's bounds: cut", prompt_tokens=prompt, completion_tokens=completion)
    return min(prompt, prompt_cap), min(completion, completion_cap), True


def usage_out(
    reported: Usage | None,
    *,
    prompt_estimate: int,
    deltas: int,
    tool_calls: list[ToolCall] | None = None,
    max_output: int = 0,
) -> tuple[UsageOut, bool]:
    """The usage to send, and whether any count in it is the edge's figure (an
    estimate, or a count cut to the request's bounds)."""
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
    prompt, completion, cut = within_bounds(prompt, completion, prompt_estimate, max_output)
    estimated = estimated or cut
    total = r.total_tokens if r.total_tokens is not None and not estimated else prompt + completion
    details = {"reasoning_tokens": min(r.reasoning_tokens, completion)} if r.reasoning_tokens is not None else None
    cached = {"cached_tokens": min(r.cached_tokens, prompt)} if r.cached_tokens is not None else None
    return UsageOut(prompt, completion, total, details, cached), estimated
