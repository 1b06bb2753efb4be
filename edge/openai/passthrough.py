"""The raw provider tunnel: byte-identical relay of a provider's response.

Used for models in ``response_mode = "passthrough"`` (chat completions) and
always for ``POST /v1/completions`` and ``POST /v1/embeddings``, on nodes
that allow passthrough for the model. Only ``model`` in the request body is
rewritten (to the node's target); the provider's status and body bytes reach
the client unchanged, and of its headers those an OpenAI client reads and
its own ``x-`` headers (:func:`_relayed`; its ``x-request-id`` as
``x-upstream-request-id``): not every header but the hop-by-hop ones, as
the Go reference did, since a provider's others (cookies, its server's
names, CORS, what a proxy in front acts on) are not the edge's to pass on. An error before the
provider's response starts is a 502 ``provider_tunnel_error`` (504 when the
run's time ran out first); after it, the response is cut (the connection
closes without the final chunk).

The edge's own bounds still hold: ``max_tokens`` / ``max_completion_tokens``
integers (or null) at most ``max_output_tokens``, and integers within 64 bits
(400s, as on chat). A keyed request is admitted on an estimate (characters / 4 of its
``prompt``, ``input`` or ``messages``, a token list counting its length, plus
its ``max_tokens``) and charged what the provider's ``usage`` said: the last
``usage`` object in the response's final :data:`_TAIL` bytes (a whole body
ends with it; a stream with ``include_usage`` sends it last). Without one the
charge is estimated: the prompt as admitted, plus a completion token per
streamed event (or characters / 4 of a whole body's text). Provider headers
that are not valid HTTP (a name with other characters than a token's, a
value with a control character or beyond Latin-1) are dropped, logged.
"""

from __future__ import annotations

import collections
import json
import re
from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from edge import errors
from edge.errors import APIError, node_error
from edge.keys import DEFAULT_OUTPUT_RESERVE, OVER_BUDGET, insufficient_quota
from edge.openai.exchange import Exchange
from edge.openai.request import decode_body
from edge.openai.schema import UsageOut
from edge.openai.usage import Bounds
from edge.runs import Run, Want
from edge.runs.run import CANCELLED, NODE_LOST, SHUTDOWN, TIMEOUT, consume_run
from edge.runs.service import FRAME_OVERHEAD, check_int64, session_key, too_large_for_a_frame, with_model
from proto import RunEvent, jsoncost
from proto.frames import is_token_count

if TYPE_CHECKING:
    from edge.app import Edge

log = structlog.get_logger("iop.edge.passthrough")

# A provider's headers the client gets: these, those of its own families and its other x-
# headers (x-should-retry, x-groq-region, ...). Nothing else: not framing the edge does itself (a
# content-length that was not the body's cut the response or hung the connection), not headers
# the edge sets (date, server, x-upstream-request-id), not what is the edge's origin's to decide,
# which also serves /console (cookies, CORS, CSP, HSTS, alt-svc, refresh, clear-site-data, link,
# x-frame-options and its kin), not what a proxy in front of the edge acts on (nginx's
# x-accel-redirect serves an internal location; x-sendfile a file) or reads as the client's
# (x-forwarded-*, x-real-ip). The provider's x-request-id goes out as x-upstream-request-id
# (Exchange._head), beside the edge's own.
_RELAYED = frozenset(
    {"content-type", "cache-control", "retry-after", "vary", "content-language", "etag", "last-modified", "expires"}
)
_RELAYED_FAMILIES = ("openai-", "x-ratelimit-", "anthropic-")
_X_HELD = frozenset(
    {
        "x-frame-options",
        "x-xss-protection",
        "x-content-type-options",
        "x-dns-prefetch-control",
        "x-permitted-cross-domain-policies",
        "x-download-options",
        "x-ua-compatible",
        "x-sendfile",
        "x-lighttpd-send-file",
        "x-real-ip",
        "x-upstream-request-id",
    }
)
_X_HELD_FAMILIES = ("x-accel-", "x-forwarded-", "x-iop-")
_MAX_RELAYED = 64
_MAX_HEADER_VALUE = 4096  # bytes of one relayed header's value, at most
_MAX_RELAYED_BYTES = 8192  # of all the relayed headers (a provider's: 20 lines of under 200 bytes)
# A body's type, if it is one an API answers with; any other is relayed as bytes to save, never
# as a page for a browser to render on the edge's origin.
_BODY_TYPES = ("application/json", "text/event-stream", "text/plain", "application/x-ndjson")
_NOSNIFF = (b"x-content-type-options", b"nosniff")
_NO_PROXY_BUFFERING = (b"x-accel-buffering", b"no")
_TAIL = 64 * 1024  # the response's last bytes kept to find its usage in
_encode_json = msgspec.json.Encoder().encode
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # a header name (RFC 9110)
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def tunnel_route(path: str):
    """A handler relaying ``POST /v1<path>`` through the tunnel."""

    async def handler(edge: Edge, ex: Exchange, body: bytes) -> None:
        handling = passthrough(edge, ex, await decode_body(body), path, body)
        del body  # (the relay holds neither the bytes nor the decoded request: routes._serve)
        await handling

    return handler


async def passthrough(edge: Edge, ex: Exchange, raw: dict[str, Any], path: str, body: bytes) -> None:
    """Relay one request whose body is ``body``, ``raw`` decoded (once, by the
    caller): only its ``model`` is rewritten, every other value goes as sent."""
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        if model is None or model == "":
            raise errors.bad_request("Missing required parameter: `model`.", "model")
        # (a 5 was "missing" here where chat names its type: an outside audit)
        raise errors.bad_request(f"Invalid value for `model`: expected `str`, got `{_json_type(model)}`.", "model")
    ex.access.model = model
    ex.access.stream = bool(raw.get("stream"))
    _check_bounds(raw, edge.config.max_output_tokens)
    session = (ex.header(b"x-session-id") or b"").decode("latin-1") or (
        raw.get("user") if isinstance(raw.get("user"), str) else None
    )
    headers = []
    for name in (b"accept", b"content-type"):
        value = ex.header(name)
        if value is not None:
            headers.append((name.decode(), value.decode("latin-1")))
    if ex.via:  # (the node passes it on: a loop through other edges comes back here)
        headers.append(("x-iop-via", ex.via))
    sent = len(body) + sum(len(value) for _, value in headers)  # (an Accept of 1,000 bytes: an outside re-audit)
    if sent + FRAME_OVERHEAD > edge.config.max_frame_bytes:  # (a 502 the SDKs retried, a slot taken)
        raise too_large_for_a_frame(sent, edge.config.max_frame_bytes)
    want = Want(model, session=session_key(session), tunnel=True, body_bytes=sent)
    prompt, media = _prompt_estimate(raw)
    max_tokens = 1 if path == "/embeddings" else _output_reserve(raw)
    (inputs, copies), per_choice, stream = _sequences(raw, path), _output_bound(raw, path), bool(raw.get("stream"))
    del raw  # what the relay needs of it is above; the body goes as it came
    await edge.admit(ex, model, prompt, max_tokens)
    slot = await edge.runs.acquire(want, ex)
    run = edge.runs.start_tunnel(
        slot,
        want=want,
        method="POST",
        path=path,
        body=with_model(body, slot.info.target),
        stream=stream,
        headers=headers,
        api=ex.api,
        client=ex,
    )
    del body  # the run's request holds the body sent
    if ex.lease is not None:
        ex.lease.follow(run, prompt)
    structlog.contextvars.bind_contextvars(run_id=run.id)
    seen = _Seen()
    try:
        await consume_run(run, partial(_relay, ex, seen), keepalive=edge.config.keepalive_s)
    finally:
        ex.access.outcome = run.cause or "unknown"  # the access line: edge.openai.routes
        ex.access.node_id = run.slot.link.node_id  # (the node that ran it: a run moved says where, as chat's)
        if ex.started:
            bounds = Bounds(prompt, per_choice * inputs * copies, slot.info.context_window, inputs, media, copies)
            ex.access.usage, ex.access.usage_estimated = seen.usage(prompt, bounds)
        else:  # ended before the provider's answer began (the client left, the run failed): its prompt, as in chat
            ex.access.partial = (prompt, 0)


class _Seen:
    """What the client was sent of a tunnelled response, for its usage: the last
    :data:`_TAIL` bytes, how many in all, and how many stream events."""

    __slots__ = ("parts", "kept", "size", "events")

    def __init__(self) -> None:
        self.parts: collections.deque[bytes] = collections.deque()
        self.kept = 0  # bytes in parts: at most _TAIL plus the oldest part's
        self.size = 0
        self.events = 0

    def add(self, data: bytes) -> None:
        self.size += len(data)
        self.events += data.count(b"data:")
        self.parts.append(data)
        self.kept += len(data)
        while self.kept - len(self.parts[0]) >= _TAIL:
            self.kept -= len(self.parts.popleft())

    @property
    def tail(self) -> bytes:
        return b"".join(self.parts)[-_TAIL:]

    def usage(self, prompt_estimate: int, bounds: Bounds) -> tuple[UsageOut, bool]:
        """The provider's usage if it sent one (within the request's ``bounds``:
        :class:`~edge.openai.usage.Bounds`), else the estimate (and whether it is
        the edge's figure)."""
        tail = self.tail
        found = _last_usage(tail)
        if found is not None:
            prompt, completion = found.get("prompt_tokens"), found.get("completion_tokens", 0)
            if is_token_count(prompt) and is_token_count(completion):  # each an int in 0..2^40, or it is no count
                details = found.get("completion_tokens_details")
                reasoning = details.get("reasoning_tokens") if isinstance(details, dict) else None
                reasoning = reasoning if is_token_count(reasoning) else 0
                # (a whole body's text counts as a stream's events do: one of a provider that ignored
                # max_tokens was charged max_tokens, its client told 5 times as many: an outside audit)
                shown = 0
                if self.events:
                    shown = max(self.events - 1, 0)
                elif bounds.max_output and completion > bounds.max_output and self.size <= _TAIL:
                    # (the text alone, never the body's size: 10 MB of logprobs or an embeddings
                    # answer's vectors raised the cap to millions, a re-check)
                    shown = len(_whole_text(tail)) // 4
                prompt, completion, cut = bounds.cut(prompt, completion, reasoning, shown)
                total = found.get("total_tokens")
                total = bounds.total(total if is_token_count(total) and not cut else None, prompt, completion)
                return UsageOut(prompt, completion, total), cut
        if self.events:
            completion = max(self.events - 1, 0)  # one a streamed event, less [DONE]
        elif self.size <= _TAIL:
            completion = len(_whole_text(tail)) // 4
        else:
            completion = self.size // 4
        return UsageOut(prompt_estimate, completion, prompt_estimate + completion), True


def _last_usage(tail: bytes) -> dict[str, Any] | None:
    """The last ``"usage": {...}`` object in ``tail`` (a few tries back past ``null`` ones)."""
    text = tail.decode("utf-8", "replace")
    end = len(text)
    decoder = json.JSONDecoder()
    for _ in range(8):
        i = text.rfind('"usage"', 0, end)
        if i < 0:
            return None
        rest = text[i + len('"usage"') :].lstrip()
        if rest.startswith(":"):
            rest = rest[1:].lstrip()
            if rest.startswith("{"):
                try:
                    found, _ = decoder.raw_decode(rest)
                except (ValueError, RecursionError):  # not JSON, or nested past the interpreter's depth
                    found = None
                if isinstance(found, dict):
                    return found
        end = i
    return None


def _whole_text(body: bytes) -> str:
    """The generated text of a whole (not streamed) completion body, for an estimate."""
    try:
        decoded = jsoncost.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return ""
    parts = []
    for choice in decoded.get("choices") or () if isinstance(decoded, dict) else ():
        if isinstance(choice, dict):
            message = choice.get("message")
            text = choice.get("text") or (message.get("content") if isinstance(message, dict) else None)
            if isinstance(text, str):
                parts.append(text)
    return "".join(parts)


def _prompt_estimate(raw: dict[str, Any]) -> tuple[int, bool]:
    """Characters / 4 of the request's prompt, input or messages' text, tools and tool calls (a token
    list counts its length), plus 4 a message; and whether a message has a part
    that is not text (an image, audio, a file: not in the estimate)."""
    chars = tokens = 0
    media = False
    stack: list[Any] = [raw.get("prompt"), raw.get("input")]
    messages = raw.get("messages")
    if isinstance(messages, list):
        tokens += 4 * len(messages)
        stack.extend(m.get("content") for m in messages if isinstance(m, dict))
        # Tool definitions and earlier calls are prompt too (as estimate_input_tokens counts them).
        calls = [m["tool_calls"] for m in messages if isinstance(m, dict) and m.get("tool_calls")]
        chars += len(_encode_json(calls)) if calls else 0
    if raw.get("tools"):
        chars += len(_encode_json(raw["tools"]))
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            chars += len(value)
        elif isinstance(value, list):
            if value and all(isinstance(v, int) for v in value):
                tokens += len(value)
            else:
                stack.extend(value)
        elif isinstance(value, dict):
            text = value.get("text")
            if isinstance(text, str):
                chars += len(text)
            else:
                media = True
    return chars // 4 + tokens, media


def _sequences(raw: dict[str, Any], path: str) -> tuple[int, int]:
    """A tunnelled request's inputs (a prompt of /v1/completions' list, of strings or of token
    lists; an input of /v1/embeddings') and its choices of each (``n`` or ``best_of``)."""
    items = raw.get("input" if path == "/embeddings" else "prompt")
    inputs = len(items) if isinstance(items, list) and items and not isinstance(items[0], int) else 1
    copies = max((v for v in (raw.get("n"), raw.get("best_of")) if type(v) is int and v > 1), default=1)
    return inputs, copies


def _output_bound(raw: dict[str, Any], path: str) -> int:
    """The most completion tokens a sequence of a tunnelled request may count (0: no limit asked)."""
    if path == "/embeddings":
        return 1
    limits = [raw.get(name) for name in ("max_tokens", "max_completion_tokens")]
    return max((v for v in limits if type(v) is int and v > 0), default=0)


def _output_reserve(raw: dict[str, Any]) -> int | None:
    """The output a tunnelled request may make, as its key is admitted on it: the larger of
    ``max_tokens`` and ``max_completion_tokens`` (a provider reads the one it knows: vLLM's
    /v1/completions only ``max_tokens``, and ``max_completion_tokens: 1`` beside it had a
    burst run 20 times a budget), for each of ``n`` or ``best_of`` choices; None (the
    default reservation) when it sets no limit and asks one choice."""
    limits = [raw.get(name) for name in ("max_tokens", "max_completion_tokens")]
    per_choice = max((v for v in limits if type(v) is int and v > 0), default=None)
    copies = max((v for v in (raw.get("n"), raw.get("best_of")) if type(v) is int and v > 1), default=1)
    if per_choice is None:
        return DEFAULT_OUTPUT_RESERVE * copies if copies > 1 else None
    return per_choice * copies


def _check_bounds(raw: dict[str, Any], max_output_tokens: int) -> None:
    """The edge's bounds on a body it relays: 400 as on chat. A ``max_tokens`` that
    is not an integer (``10.0``, ``"10"``) is one too: providers take such values,
    so it would pass the bound and be reserved as the default."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = raw.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise errors.bad_request(
                f"Invalid value for `{name}`: expected `int | null`, got `{_json_type(value)}`.", name
            )
        if value > max_output_tokens:
            raise errors.bad_request(
                f"Invalid value for `{name}`: this edge allows at most {max_output_tokens}.",
                name,
                "integer_above_max_value",
            )
    check_int64(raw)


_JSON_TYPES = {bool: "bool", float: "float", str: "str", list: "array", dict: "object"}


def _json_type(value: Any) -> str:
    """A decoded JSON value's type by its JSON name, as msgspec's errors on chat name it."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


async def _relay(ex: Exchange, seen: _Seen, run: Run) -> None:
    """Write the tunnel's frames to the client as they come. The provider's
    head waits for the body's first bytes (or its end), so that a node lost
    before them leaves nothing sent: the run moves to another node (whose own
    head replaces it), or the client gets an error it can retry, where a
    stream was cut after its head (an outside re-audit). It waits
    ``keepalive_s`` at most: a client or proxy with a limit on the time to
    the head (a long prefill) gets it then, and a node lost after that cuts
    the stream, as before."""
    head: tuple[int, list[tuple[bytes, bytes]]] | None = None
    moved_head = False  # (the head came after the run moved)
    while True:
        batch = await run.next_batch_or_idle()
        if not batch:  # (None: keepalive_s with nothing; []: nudged)
            if head is not None and run.failed_over and not moved_head:
                head = None  # (its lost node's provider's, unsent: the next node's replaces it)
            if batch is None and head is not None and not ex.started:
                await ex.start(*head)
            continue
        body: list[bytes] = []
        for item in batch:
            if isinstance(item, RunEvent):  # the edge ended it: timeout, node lost, slow client
                await _flush(ex, body)
                if run.cause == CANCELLED and not ex.started:
                    await ex.respond_error(errors.operator_cancelled(item.text))
                elif run.cause == OVER_BUDGET and not ex.started:  # (a 502 the SDKs retried)
                    await ex.respond_error(insufficient_quota(item.text))
                elif run.unserved and not ex.started:  # (lost before its answer, no node serving it now)
                    await ex.respond_error(errors.lost_unanswered(run.want.model))
                elif run.cause == SHUTDOWN and not ex.started:  # (cut at the end of the edge's drain)
                    await ex.respond_error(errors.draining())
                elif not ex.started:
                    status = 504 if run.cause == TIMEOUT else 502
                    code = "node_disconnected" if run.cause == NODE_LOST else TUNNEL_ERROR
                    await ex.respond_error(APIError(status, item.text or "tunnel failed", TUNNEL_ERROR, code=code))
                return  # after the start: cut
            kind = item.kind
            if kind == "body":
                if not ex.started:
                    await ex.start(*(head or (200, [])))
                body.append(item.body)
                seen.add(item.body)
            elif kind == "response_start":
                if not ex.started:
                    if not 200 <= item.status <= 599:  # 0, a 1xx or past 599: not an answer to relay
                        await ex.respond_error(_tunnel_error(f"the provider answered status {item.status}"))
                        return
                    if item.status in (401, 403):  # the node's key, not the client's: never relayed (it can quote it)
                        log.warning("provider refused the node's credentials", status=item.status)
                        await ex.respond_error(
                            APIError(
                                502,
                                f"The provider refused the node's credentials (HTTP {item.status}); "
                                "the edge's operator must fix the node's api_key for this model.",
                                "upstream_error",
                                code="upstream_auth_failed",
                                headers=[(b"x-should-retry", b"false")],
                            )
                        )
                        return
                    relayed = _response_headers(item.headers, ex.key is not None)
                    head, moved_head = (item.status, relayed), run.failed_over
            elif kind == "end":
                if not ex.started:
                    if head is None:
                        await ex.respond_error(_tunnel_error("tunnel ended before the provider's response"))
                        return
                    await ex.start(*head)
                await ex.finish(b"".join(body))
                return
            elif kind == "error":
                await _flush(ex, body)
                if not ex.started:
                    await ex.respond_error(_tunnel_error(node_error(item.error) or "provider tunnel failed"))
                else:
                    log.warning("tunnel error after the response started; cutting it", error=node_error(item.error))
                return
            # "usage" frames are sideband and never merged into the body.
        await _flush(ex, body)


TUNNEL_ERROR = "provider_tunnel_error"


def _tunnel_error(message: str) -> APIError:
    """A 502 before the provider's response: ``provider_tunnel_error`` as its type and its
    code (the code is what the SDKs show, ``e.code``)."""
    return APIError(502, message, TUNNEL_ERROR, code=TUNNEL_ERROR)


async def _flush(ex: Exchange, body: list[bytes]) -> None:
    if body and ex.started:
        data = b"".join(body)
        body.clear()
        await ex.write(data)


def _response_headers(headers: list[tuple[str, str]] | None, keyed: bool = False) -> list[tuple[bytes, bytes]]:
    """The provider's headers the client gets (:func:`_relayed`), less any that is not
    valid HTTP (dropped, logged: it would break the response). ``keyed``: the client's
    limits are its key's, and the provider's ``x-ratelimit-*`` (the node's account's) are
    not relayed (they went out beside the key's, two values of one name: a client's library
    joined them into one it could not read, or read the provider's)."""
    out = [_NOSNIFF]
    dropped = []
    room = _MAX_RELAYED_BYTES
    for name, value in headers or ():
        lower = name.lower()
        if not _relayed(lower) or len(out) > _MAX_RELAYED or keyed and lower.startswith("x-ratelimit-"):
            continue
        if not _TOKEN.fullmatch(name) or _BAD_VALUE.search(value) or not value.isascii() and not _latin1(value):
            dropped.append(name[:100])
            continue
        size = len(name) + len(value) + 4 if lower not in _RELAYED else 0  # (content-type and its kin: always)
        if len(value) > _MAX_HEADER_VALUE or size > room:
            # (a node's 100 KB value went to the client: most clients refuse a head past 8-16 KB,
            # httpx's past 16 KiB, so the answer was lost; an outside audit)
            dropped.append(name[:100])
            continue
        room -= size
        value = value.strip(" \t")
        if lower == "content-type":
            if not value.lower().startswith(_BODY_TYPES):
                value = "application/octet-stream"
            elif value.lower().startswith("text/event-stream"):
                out.append(_NO_PROXY_BUFFERING)  # as the edge's own streams (nginx reads it)
        out.append((lower.encode("latin-1"), value.encode("latin-1")))
    if dropped:
        log.warning("provider headers not valid HTTP or too large, dropped", headers=dropped[:20])
    return out


def _relayed(name: str) -> bool:
    if name in _RELAYED or name.startswith(_RELAYED_FAMILIES):
        return True
    return name.startswith("x-") and name not in _X_HELD and not name.startswith(_X_HELD_FAMILIES)


def _latin1(value: str) -> bool:
    try:
        value.encode("latin-1")
    except UnicodeEncodeError:
        return False
    return True
