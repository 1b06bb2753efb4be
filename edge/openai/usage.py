"""A response's usage: the upstream's counts, or the edge's estimate of them.

Usage always carries three integers (client code adds ``total_tokens`` up).
A count the upstream did not report is estimated: prompt tokens as
:func:`edge.openai.request.estimate_input_tokens` does for admission
(characters / 4, plus 4 per message); completion tokens as one per generated
delta, content or reasoning (nodes always stream from the model server, which
sends about one token per delta; a node that joins deltas it read together
says how many in the event's ``parts``), plus the characters / 4 of native tool calls
and of a refusal (they arrive whole). A response with an estimated count says so to its client (``"estimated": true``
in its usage), is marked in the access line (``usage_estimated``) and counted in
``iop_usage_estimated_total``.
"""

from __future__ import annotations

import structlog

from edge.openai.schema import UsageOut
from proto import ToolCall, Usage

log = structlog.get_logger()

# A count past what the request allows is no model server's: a node holding a node token
# reported 2^40 tokens and spent a key's daily budget with one request (an outside attack). Such
# a count is cut to the bound and marked as the edge's figure. The bounds are what an honest
# server can reach:
# - prompt tokens: 4 a character of the prompt's text (16 x its estimate of a token per 4
#   characters) plus PROMPT_SLACK (a chat template); with images, audio or files (which count 0
#   in the estimate), the model's context window as its node advertised it, if more
#   (SEQUENCE_TOKENS without one, MAX_SEQUENCE_TOKENS at most), for each input (a prompt of
#   /v1/completions' list, an input of an embeddings list);
# - completion tokens: the request's max_tokens (a server stops there), plus the reasoning
#   tokens it reported (DeepSeek's max_tokens leaves its reasoning out) up to the window; the
#   window for each input and each choice of n without max_tokens; and at least the deltas the
#   client was sent (a server that ignores max_tokens);
# - total tokens: the two, plus a window (Gemini counts its thoughts in the total alone).
PROMPT_SLACK = 65_536
SEQUENCE_TOKENS = 1 << 20
MAX_SEQUENCE_TOKENS = 1 << 24


class Bounds:
    """The most tokens a request's usage may count (see above)."""

    __slots__ = ("prompt", "window", "max_output")

    def __init__(
        self,
        prompt_estimate: int,
        max_output: int,
        context_window: int = 0,
        inputs: int = 1,
        media: bool = False,
        copies: int = 1,
    ) -> None:
        window = min(context_window or SEQUENCE_TOKENS, MAX_SEQUENCE_TOKENS) * max(inputs, 1)
        text = 16 * prompt_estimate + PROMPT_SLACK
        self.prompt = max(window, text) if media else text  # (a prompt counts once, whatever its n)
        self.window = window * max(copies, 1)  # completions: one a choice
        self.max_output = max_output

    def cut(self, prompt: int, completion: int, reasoning: int = 0, shown: int = 0) -> tuple[int, int, bool]:
        """``prompt`` and ``completion`` within the bounds, and whether either was past them.
        ``shown``: the deltas (or events) the client was sent, which a completion may always
        count: a model server that ignored ``max_tokens`` streamed 2,000 tokens to a request of
        ``max_tokens`` 1, and its key was charged 1 (two edges' 400 such streams spent 800,000
        tokens and were charged 2,400, never cut by a budget of 300,000: an outside re-check)."""
        window = self.window
        completion_cap = self.max_output + min(reasoning, window) if self.max_output else window
        completion_cap = max(completion_cap, shown)
        if prompt <= self.prompt and completion <= completion_cap:
            return prompt, completion, False
        log.warning("usage past the request's bounds: cut", prompt_tokens=prompt, completion_tokens=completion)
        return min(prompt, self.prompt), min(completion, completion_cap), True

    def total(self, reported: int | None, prompt: int, completion: int) -> int:
        """The total to send: the reported one unless it is past the two and a window."""
        if reported is None or reported > prompt + completion + self.window:
            return prompt + completion
        return reported


def usage_out(
    reported: Usage | None,
    *,
    prompt_estimate: int,
    deltas: int,
    tool_calls: list[ToolCall] | None = None,
    max_output: int = 0,
    context_window: int = 0,
    media: bool = False,
    refusal: str | None = None,
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
            completion, estimated = deltas + calls // 4 + -(-len(refusal or "") // 4), True
    bounds = Bounds(prompt_estimate, max_output, context_window, media=media)
    prompt, completion, cut = bounds.cut(prompt, completion, r.reasoning_tokens or 0, deltas)
    estimated = estimated or cut
    total = bounds.total(r.total_tokens if not estimated else None, prompt, completion)
    details = {"reasoning_tokens": min(r.reasoning_tokens, completion)} if r.reasoning_tokens is not None else None
    cached = {"cached_tokens": min(r.cached_tokens, prompt)} if r.cached_tokens is not None else None
    return UsageOut(prompt, completion, total, details, cached, estimated), estimated
