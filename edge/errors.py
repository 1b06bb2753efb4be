"""Errors the edge answers with, always in the OpenAI shape.

    APIError                  an HTTP error before the response started
    RunFailed                 a run ended without completing (after dispatch)

``APIError`` carries the status and the OpenAI ``error`` object; it is raised
anywhere on the request path and rendered once by the HTTP layer. One whose
status a retry cannot change (:data:`FINAL_STATUSES`) says ``x-should-retry: false``.
"""

from __future__ import annotations

import re

import msgspec


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


_encoder = msgspec.json.Encoder()

NO_RETRY = (b"x-should-retry", b"false")
RETRY_SOON = (b"retry-after", b"1")  # a 503 the client should try again, shortly
# Statuses a retry of the same request cannot change: they say ``x-should-retry: false``,
# which the OpenAI and Anthropic SDKs (and Claude Code, which retries even a 401) obey.
# Not 408, 409, 429 or a 5xx: SDKs retry those on purpose.
FINAL_STATUSES = frozenset({400, 401, 403, 404, 405, 413, 422})


def final_headers(status: int) -> dict[str, str]:
    """``x-should-retry: false`` for an answer of ``status`` built without an
    :class:`APIError` (the framework's own), as every APIError of it says."""
    return {"x-should-retry": "false"} if status in FINAL_STATUSES else {}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        *,
        param: str | None = None,
        code: str | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = list(headers) if headers else []
        if status in FINAL_STATUSES and not any(name == NO_RETRY[0] for name, _ in self.headers):
            self.headers.append(NO_RETRY)
        self.context: tuple[int, int, int] | None = None  # context_length_exceeded: prompt, max_tokens, limit
        self.estimated = True  # context: the prompt as the edge estimates it (False: as a model server counted it)

    def body(self) -> bytes:
        return error_json(self.message, self.type, param=self.param, code=self.code)


def error_json(message: str, type: str, *, param: str | None = None, code: str | None = None) -> bytes:
    return _encoder.encode(ErrorResponse(ErrorBody(message=message, type=type, param=param, code=code)))


# How model servers refuse a request too long for the model's context: OpenAI and vLLM ("This
# model's maximum context length is ..."), SGLang ("... is longer than the model's context
# length"), llama.cpp ("the request exceeds the available context size"), Ollama, Anthropic
# ("prompt is too long"), and OpenAI's own code when a server relays it in its message.
_CONTEXT_EXCEEDED = re.compile(
    r"maximum context length|context_length_exceeded|prompt is too long"
    r"|(?:exceed|longer than|too long|larger than|more than)[^.\n]{0,60}context (?:length|size|window|limit)",
    re.IGNORECASE,
)
# The statuses servers refuse it with (TGI's 422, a proxy's 413); the answer is OpenAI's 400,
# which SDKs do not retry (a 408 or 409 they would, whatever its words).
_CONTEXT_STATUSES = frozenset((400, 413, 422))
# The numbers in a refusal, for the Messages API's own words (which Claude Code reads: it asks again
# with a max_tokens that fits, and compacts the conversation only when the prompt alone is too long):
# vLLM's wordings since 0.9 (OpenAI's is the oldest of them) and SGLang's. Read apart, so a wording
# that orders them otherwise still gives all three.
_CONTEXT_LIMIT = re.compile(
    r"maximum context length (?:is|of) (\d{1,9}) tokens"  # vLLM, OpenAI; SGLang's total
    r"|context length \((\d{1,9}) tokens\)"  # SGLang, the prompt alone: "... context length (L tokens)"
)
_CONTEXT_PROMPT = re.compile(
    r"(\d{1,9}) in the messages"  # vLLM before 0.11: "you requested T tokens (P in the messages, C in the completion)"
    r"|requested (\d{1,9}) tokens in the messages"  # vLLM 0.9, the prompt alone
    r"|(?:request has|messages resulted in) (\d{1,9}) (?:input )?tokens"  # vLLM 0.11
    r"|prompt contains (?:at least )?(\d{1,9}) input tokens"  # vLLM 0.25 and later
    r"|(\d{1,9}) tokens from the input messages"  # SGLang
    r"|The input \((\d{1,9}) tokens\)"  # SGLang, the prompt alone
)
# vLLM 0.25: a prompt past this, counted in characters
_CONTEXT_PROMPT_OVER = re.compile(r"upper bound for (\d{1,9}) input tokens")
_CONTEXT_COMPLETION = re.compile(
    r"(\d{1,9}) in the completion"  # vLLM before 0.11
    r"|is too large: (\d{1,9})\b"  # vLLM 0.11: "'max_tokens' or 'max_completion_tokens' is too large: C"
    r"|requested (\d{1,9}) output tokens"  # vLLM 0.25 and later
    r"|(\d{1,9}) tokens for the completion"  # SGLang
)


def _number(match: re.Match | None) -> int | None:
    return None if match is None else int(next(g for g in match.groups() if g is not None))


def upstream_context_error(status: int, message: str) -> APIError | None:
    """A model server's 400 (413, 422) that says the request does not fit the model's context,
    as the edge's own refusal is (:func:`context_too_long`): 400 ``context_length_exceeded``, which
    clients act on (Claude Code asks again with a smaller ``max_tokens``, or compacts); the
    server's words are kept. None: it says something else."""
    if status not in _CONTEXT_STATUSES or _CONTEXT_EXCEEDED.search(message[:MAX_NODE_ERROR]) is None:
        return None
    error = APIError(400, message, "invalid_request_error", param="messages", code="context_length_exceeded")
    said = message[:MAX_NODE_ERROR]
    limit = _number(_CONTEXT_LIMIT.search(said))
    prompt = _number(_CONTEXT_PROMPT.search(said))
    if prompt is None and (over := _number(_CONTEXT_PROMPT_OVER.search(said))) is not None:
        prompt = over + 1
    if limit is not None and prompt is not None:
        error.context = (prompt, _number(_CONTEXT_COMPLETION.search(said)) or 0, limit)
        error.estimated = False
    return error


MAX_NODE_ERROR = 4096  # characters of a node's error message a client (or a log line) gets


# Control characters (but tab and newline) and bidirectional overrides in a node's error: a
# terminal's escapes for the CLI agents that print it, a line shown reversed in the console.
_UNSHOWABLE = dict.fromkeys(
    [*range(0x09), 0x0B, 0x0C, *range(0x0D, 0x20), *range(0x7F, 0xA0), 0x200E, 0x200F, 0x2028, 0x2029]
    + [*range(0x202A, 0x202F), *range(0x2066, 0x206A)],
    "\ufffd",
)


def node_error(text: str) -> str:
    """A node's error message, cut to :data:`MAX_NODE_ERROR` characters (a node's 15 MB
    error became a 15 MB answer, and a log line as long), what a screen would act on
    (:data:`_UNSHOWABLE`) shown as U+FFFD."""
    if len(text) > MAX_NODE_ERROR:
        text = f"{text[:MAX_NODE_ERROR]}... ({len(text) - MAX_NODE_ERROR} more characters)"
    return text.translate(_UNSHOWABLE) if not text.isprintable() else text


class RunFailed(Exception):
    """A run ended in error: ``message`` is what the client is told, ``type``
    the OpenAI error type, ``cause`` the reason for metrics and logs."""

    def __init__(
        self, message: str, *, type: str = "run_error", cause: str = "error", status: int = 0, retry_after: float = 0.0
    ) -> None:
        super().__init__(message)
        self.message = message
        self.type = type
        self.cause = cause
        self.status = status  # the upstream's HTTP status, when it gave one
        self.retry_after = retry_after  # and its Retry-After, in seconds (0: none said)
        self.refusal: APIError | None = None  # a retry refused a slot: that refusal, as its HTTP error


def operator_cancelled(message: str = "cancelled by an operator") -> APIError:
    """An operator cancelled the request (the console): 499, gRPC's CANCELLED
    over HTTP, and ``x-should-retry: false``, which the OpenAI and Anthropic
    SDKs obey. A 5xx would be retried, starting the run again; the cancel
    must end the request as a client leaving would."""
    return APIError(499, message, "cancelled", code="cancelled_by_operator", headers=[NO_RETRY])


def client_gone() -> APIError:
    """The client closed its connection while its request waited for a slot, before the
    edge heard of it: the slot goes back and the answer (499, nginx's client-closed) to no one."""
    return APIError(499, "The client closed its connection while the request waited.", "cancelled", code="client_gone")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param=param, code=code)


def integer_out_of_range(param: str | None) -> APIError:
    """400 for an integer the link cannot carry (msgpack's 64 bits), in ``param`` if known."""
    return bad_request(
        "The request holds an integer outside the 64-bit range" + (f" in `{param}`." if param else "."),
        param,
        "integer_out_of_range",
    )


_MAX_MODEL_SAID = 256  # of a model name a client sent, quoted back


def model_not_found(model: str, starting: bool = False) -> APIError:
    """``starting``: the edge started moments ago, and a node serving the model may not have
    linked yet: the SDKs are told to retry it (``x-should-retry: true``, which they obey on
    any status). A rolling restart's first seconds were a final 404 for every model not in
    ``[[models]]`` whose node linked second (an outside audit)."""
    if len(model) > _MAX_MODEL_SAID:  # (a 7 MB name came back as a 7 MB 404: an outside audit)
        model = model[:_MAX_MODEL_SAID] + "…"
    message = f"The model `{model}` does not exist or no node serves it; GET /v1/models lists those served now."
    if starting:
        message += " The edge has just started and its nodes may still be linking: retry shortly."
    headers = [(b"x-should-retry", b"true"), RETRY_SOON] if starting else None
    return APIError(404, message, "invalid_request_error", param="model", code="model_not_found", headers=headers)


def draining() -> APIError:
    """The edge drains: a request refused, or a run cut at the end of the drain's grace
    (behind a load balancer, another edge takes the retry)."""
    return APIError(
        503, "The edge is shutting down.", "service_unavailable_error", code="draining", headers=[RETRY_SOON]
    )


def lost_unanswered(model: str) -> APIError:
    """A run (or tunnel) whose node was lost before it answered, with no linked node left
    that takes new runs of its model (none, or only draining ones): a 503 to retry."""
    return no_node(
        model,
        f"The node running this request was lost before it answered, and no linked node takes new runs of "
        f"`{model}` now.",
    )


def no_node(model: str, message: str | None = None) -> APIError:
    return APIError(
        503,
        message or f"No node serving `{model}` is linked right now.",
        "service_unavailable_error",
        param="model",
        code="no_node_available",
        headers=[RETRY_SOON],  # (nodes relink within a second or two of an edge's start)
    )


def queue_rejected(model: str, reason: str, retry_after_s: int) -> APIError:
    return APIError(
        429,
        f"Model `{model}` is at capacity: {reason}. Retry after {retry_after_s} s.",
        "rate_limit_error",
        code="queue_full" if "full" in reason else "queue_timeout",
        headers=[(b"retry-after", str(retry_after_s).encode())],
    )


def context_too_long(prompt: int, max_tokens: int, largest: int) -> APIError:
    """The request does not fit any node's context: in OpenAI's words (which
    clients parse: "maximum context length"); ``context`` keeps the numbers for
    the Messages API's own words (:func:`edge.anthropic.codec.error_body`).
    ``prompt`` is the edge's estimate of the input."""
    if max_tokens:
        told = (
            f"you requested {prompt + max_tokens} tokens ({prompt} in the messages, {max_tokens} in the completion;"
            " the messages as this edge estimates them). Please reduce the length of the messages or completion."
        )
    else:  # no max_tokens: the prompt and one token must fit
        told = (
            f"your messages resulted in {prompt} tokens (as this edge estimates them), leaving no room for"
            " the completion. Please reduce the length of the messages."
        )
    error = APIError(
        400,
        f"This model's maximum context length is {largest} tokens. However, {told}",
        "invalid_request_error",
        param="messages",
        code="context_length_exceeded",
    )
    error.context = (prompt, max_tokens, largest)
    return error
