"""Writing a run to the client: live SSE, buffered SSE, or one JSON body.

The two stream loops here (:func:`stream_live`, :func:`stream_buffered`) are
every API's: each front door brings an encoder that makes its bytes (opening,
events, keep-alive, in-stream error, closing) and owns no I/O. Chat's are
:class:`LiveStream` and :class:`ChatBuffered`.

A stream commits (sends ``200`` and its headers) only when its run's first
event arrives or a keep-alive is due, whichever comes first: a run that fails
before that is a real HTTP error (:func:`http_error`), so clients see the
status and their SDKs retry 5xx and 429. A run moved to another node before
its first event stays invisible either way.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import msgspec
import structlog

from edge.errors import (
    NO_RETRY,
    APIError,
    RunFailed,
    draining,
    lost_unanswered,
    operator_cancelled,
    upstream_context_error,
)
from edge.keys import OVER_BUDGET, insufficient_quota
from edge.openai.exchange import SSE_HEADERS
from edge.openai.schema import ChatCompletion, CompletionChoice, ResponseMessage
from edge.openai.shaping import Shaper
from edge.openai.sse import DONE, KEEPALIVE, OBJECT, ChunkEncoder, sse_error
from edge.openai.tools import (
    INLINE_PATTERN_S,
    NeedsTime,
    TextToolCalls,
    ToolTextFilter,
    calls_in_reasoning,
    parse_calls_of,
)
from edge.openai.trace import StreamTrace, trace_enabled
from edge.openai.turn import (
    OPERATOR_CANCELLED,
    TOOL_VALIDATION_ERROR,
    Collected,
    Turn,
    acquire_keeping_alive,
    collect_validated,
    end_reason,
    failure,
    finish_of,
    retry_not_started,
    retry_type,
)
from edge.runs import Run, Slot
from edge.runs.run import CANCELLED, NODE_LOST, NODE_STALLED, SHUTDOWN, SLOW_CLIENT, TEXT_TYPES, TIMEOUT
from proto import RunEvent, ToolCall
from proto.frames import COMPLETE, DELTA, REASONING_DELTA

log = structlog.get_logger("iop.edge.chat")
_encode = msgspec.json.Encoder().encode


def tool_calls_out(calls: list[ToolCall], *, indexed: bool = True) -> list[dict[str, Any]]:
    """``indexed``: stream deltas carry each call's ``index``; a whole message's calls do not."""
    out = [
        {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
        for c in calls
    ]
    if indexed:
        out = [{"index": i, **call} for i, call in enumerate(out)]
    return out


def _encoder(turn: Turn, run: Run) -> ChunkEncoder:
    return ChunkEncoder(f"chatcmpl-{run.id}", int(time.time()), turn.req.model, turn.policy.reasoning_field)


def refusal_chunk(enc: ChunkEncoder, text: str) -> bytes:
    """The model's refusal as OpenAI streams it: ``delta.refusal``, with ``content`` null."""
    delta = {"content": None, "refusal": text}
    chunk = {"id": enc.id, "object": OBJECT, "created": enc.created, "model": enc.model}
    choices = [{"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}]
    return b"data: " + _encode({**chunk, "choices": choices}) + b"\n\n"


def _wants_usage(turn: Turn) -> bool:
    opts = turn.req.stream_options
    return opts is not None and opts.include_usage


# -- non-streaming ---------------------------------------------------------------


# A model server's 4xx that the client's request caused, said to it with its own status.
_CLIENT_STATUSES = frozenset((400, 404, 409, 413, 422))


def http_error(failed: RunFailed, run: Run | None) -> APIError:
    """A failed run as an HTTP error (a whole response, or a stream not yet
    committed): an upstream 4xx keeps its status, but a 401 or 403 (the node's
    credentials, not the client's) is a 502; an upstream 5xx or a node's
    error is 502, a lost node 502 (a 503 ``no_node_available`` to retry
    when nothing was sent and no linked node takes new runs of the model:
    ``Run.unserved``), a wait timeout or run deadline 504, the edge
    shutting down 503; an upstream 429 is a 429 with ``Retry-After``;
    an operator's cancel is :func:`operator_cancelled`; tool calls still
    invalid after the edge's own attempts a 502 with ``x-should-retry: false``
    (a client's retry would only repeat them)."""
    if failed.refusal is not None:
        return failed.refusal
    cause = run.cause if run is not None else None
    if run is not None and run.unserved:
        return lost_unanswered(run.want.model)
    if cause == CANCELLED or failed.type == OPERATOR_CANCELLED:  # (a queued retry's: its run is not the last)
        return operator_cancelled(failed.message)
    if cause == OVER_BUDGET:
        return insufficient_quota(failed.message)
    if failed.type == TOOL_VALIDATION_ERROR:
        return APIError(502, failed.message, failed.type, code=INVALID_TOOL_CALL, headers=[NO_RETRY])
    if failed.type not in ("run_error", "timeout_error"):  # (a tool call's retry that failed: why, as in a stream)
        return APIError(502, failed.message, failed.type, code=stream_code(run, failed.type))
    if failed.status == 429:
        # The model server is saturated: the client may retry, after its Retry-After (1 s if it
        # said none, or a node too old to pass it on; at most an hour).
        wait = _wait_of(failed)
        return APIError(
            429, failed.message, "rate_limit_error", code="upstream_rate_limited", headers=[(b"retry-after", wait)]
        )
    if failed.status in (401, 403):  # the node's credentials: no fault of the client's key
        return APIError(
            502, failed.message, "upstream_error", code="upstream_auth_failed", headers=[(b"x-should-retry", b"false")]
        )
    if 400 <= failed.status < 500:
        too_long = upstream_context_error(failed.status, failed.message)
        if too_long is not None:
            return too_long
        if failed.status in _CLIENT_STATUSES:
            return APIError(failed.status, failed.message, "invalid_request_error", code="upstream_rejected")
        # The node's or its model server's own trouble (a 407 from its proxy, 402 out of credit,
        # 431, 499): not the client's to act on as said (a 407 asks it for proxy credentials).
        return APIError(502, failed.message, "upstream_error", code="upstream_rejected")
    if cause == TIMEOUT:
        return APIError(504, failed.message, "timeout_error", code="run_timed_out")
    if cause == NODE_LOST:
        return APIError(502, failed.message, "run_error", code="node_disconnected")
    if cause == NODE_STALLED:  # (ran again once already: its second node stalled too)
        return APIError(502, failed.message, "run_error", code="node_stalled")
    if cause == SHUTDOWN:  # (cut at the end of the edge's drain: another edge may take it)
        return draining()  # (in the words of a request refused during the drain)
    if cause == SLOW_CLIENT:
        return APIError(500, failed.message, "run_error")
    if failed.status == 503 and failed.retry_after:  # (a model server unavailable for that long: the SDKs wait it)
        return APIError(502, failed.message, failed.type, headers=[(b"retry-after", _wait_of(failed))])
    return APIError(502, failed.message, failed.type)


def _wait_of(failed: RunFailed) -> bytes:
    """A model server's Retry-After as the client's: 1 s to an hour (1 s when it said none)."""
    return b"%d" % min(max(math.ceil(failed.retry_after), 1), 3600)


# Tool calls still invalid after the edge's attempts. The word "invalid" is what clients that
# read no x-should-retry take as final in a stream: the Vercel AI SDK's OpenAI provider gives an
# error event a status by the words of its type and code, and retried a null code's 500 3 times.
INVALID_TOOL_CALL = "invalid_tool_call"

_STREAM_CODES = {
    NODE_LOST: "node_disconnected",
    NODE_STALLED: "node_stalled",
    TIMEOUT: "run_timed_out",
    SHUTDOWN: "draining",
    CANCELLED: "cancelled_by_operator",
    OVER_BUDGET: "insufficient_quota",
}


def futile(turn: Turn, type: str) -> bool:
    """A failure after the stream started that a client must not retry: an
    operator's cancel (the retry would start the cancelled work again), or tool
    calls still invalid after the edge's own attempts (it would repeat them).
    Each API's in-stream error says so in the words its agents obey."""
    run = turn.last_run
    return type in (TOOL_VALIDATION_ERROR, OPERATOR_CANCELLED) or (run is not None and run.cause == CANCELLED)


def stops_codex(turn: Turn, type: str) -> bool:
    """A streamed Responses request that fails before its stream started, where no
    retry can help (:func:`futile`): Codex sends a request again on any HTTP error
    status, a 499 with ``x-should-retry: false`` too (an operator's cancel ran the
    turn again in full, up to 5 times); in a stream, ``response.failed`` with
    ``invalid_prompt`` stops it."""
    return turn.ex.api == "responses" and turn.stream and futile(turn, type)


def stream_code(run: Run | None, type: str) -> str | None:
    """An in-stream error's ``code``: the one its HTTP error would carry (:func:`http_error`), by
    the run's cause (it was null in a stream, ``node_disconnected`` in a whole response's 502)."""
    if type == TOOL_VALIDATION_ERROR:
        return INVALID_TOOL_CALL
    if type == OPERATOR_CANCELLED:
        return _STREAM_CODES[CANCELLED]
    if run is None or run.cause is None:
        return None
    return "no_node_available" if run.unserved else _STREAM_CODES.get(run.cause)


async def fail(
    turn: Turn,
    failed: RunFailed,
    in_stream: Callable[..., bytes] = sse_error,
    opening: Callable[[], bytes] | None = None,
) -> None:
    """Tell the client: an HTTP error if nothing was sent yet, else the
    stream's closing error bytes (``in_stream(message, type)``: the API's).
    A Responses stream (its ``opening`` given) that no retry can help is
    committed to say so in the stream (:func:`stops_codex`)."""
    turn.outcome = failed.cause
    if opening is not None and not turn.ex.started and stops_codex(turn, failed.type):
        await turn.ex.start(200, SSE_HEADERS, opening())
    if turn.ex.started and failed.refusal is not None:  # (a retry refused a slot, after keep-alives)
        # In the refusal's words, as before the stream started (a 429 `queue_timeout`, which the
        # SDKs and agents wait and retry on), not a tool_validation_retry_error of no code.
        await turn.ex.finish(in_stream(failed.message, failed.refusal.type, failed.refusal.code))
    elif turn.ex.started:
        await turn.ex.finish(in_stream(failed.message, failed.type))
    else:
        turn.settle_failed()
        await turn.ex.respond_error(http_error(failed, turn.last_run))


async def respond_whole(turn: Turn, slot: Slot) -> None:
    try:
        result = await collect_validated(turn, slot)
    except RunFailed as failed:
        await fail(turn, failed)
        return
    run = turn.last_run
    message = ResponseMessage(
        role="assistant",
        content=result.content if result.content or not (result.tool_calls or result.refusal) else None,
        tool_calls=tool_calls_out(result.tool_calls, indexed=False) if result.tool_calls else None,
        refusal=result.refusal or None,
    )
    body = ChatCompletion(
        id=f"chatcmpl-{run.id}",
        object="chat.completion",
        created=int(time.time()),
        model=turn.req.model,
        choices=[CompletionChoice(index=0, message=message, finish_reason=result.finish_reason)],
        usage=result.usage,
    )
    data = msgspec.to_builtins(body)
    if result.reasoning is not None:
        data["choices"][0]["message"][turn.policy.reasoning_field] = result.reasoning
    await turn.ex.respond(200, _encode(data))


# -- buffered stream -------------------------------------------------------------


class BufferedEncoder(Protocol):
    """What :func:`stream_buffered` writes with: one API's bytes for a stream
    collected before the client sees any of it (:class:`ChatBuffered` for chat)."""

    keep_alive: bytes  # written each keepalive_s the run shows nothing

    def opening(self) -> bytes: ...  # written when the stream commits

    def error(self, message: str, type: str, code: str | None = None) -> bytes: ...  # a failed stream's last bytes

    def whole(self, run: Run, result: Collected) -> bytes: ...  # every event, then the closing bytes


class ChatBuffered:
    """Chat chunks for a collected run: nothing at the commit (the role
    chunk leads the rest), ``: keep-alive`` comments meanwhile."""

    keep_alive = KEEPALIVE

    def __init__(self, turn: Turn) -> None:
        self.turn = turn

    def opening(self) -> bytes:
        return b""

    def error(self, message: str, type: str, code: str | None = None) -> bytes:
        return sse_error(message, type, code or stream_code(self.turn.last_run, type))

    def whole(self, run: Run, result: Collected) -> bytes:
        return buffered_chunks(self.turn, run, result)


async def stream_buffered(turn: Turn, slot: Slot, enc: BufferedEncoder | None = None) -> None:
    """Collect (and validate, and retry) the whole run, sending only
    ``enc``'s keep-alives, then all of it at once. The stream commits at the
    run's first event or the first keep-alive; a run that fails before that
    is an HTTP error (:func:`http_error`)."""
    ex = turn.ex
    if enc is None:
        enc = ChatBuffered(turn)

    async def commit() -> None:
        if not ex.started:
            await ex.start(200, SSE_HEADERS)
            opening = enc.opening()
            if opening:
                await ex.write(opening)

    async def keep_alive() -> None:
        await commit()
        await ex.write(enc.keep_alive)

    result: Collected | None = None
    try:
        try:
            result = await collect_validated(turn, slot, on_idle=keep_alive, on_started=commit)
        except RunFailed as failed:
            await fail(turn, failed, enc.error, enc.opening)
            return
        await commit()
        await ex.finish(enc.whole(turn.last_run, result))
    finally:  # every stream's one summary line, however it ended (a failed one too: its run's error)
        policy = turn.policy
        log.info(
            "stream closed",
            api=ex.api,
            buffered=True,
            strict_output=policy.strict_output,
            strict_stream_buffer=policy.stream_buffer,
            xml_completion_tool=policy.xml_completion_tool,
            normalized=result.normalized if result is not None else False,
            content_len=len(result.content) if result is not None else 0,
            reasoning_len=result.reasoning_len if result is not None else 0,
        )


def buffered_chunks(turn: Turn, run: Run, result: Collected) -> bytes:
    enc = _encoder(turn, run)
    parts = [enc.role()]
    if result.reasoning is not None:
        parts.append(enc.reasoning(result.reasoning))
    if result.content:
        parts.append(enc.content(result.content))
    if result.refusal:
        parts.append(refusal_chunk(enc, result.refusal))
    if result.tool_calls:
        parts.append(enc.tool_calls(tool_calls_out(result.tool_calls)))
    parts.append(enc.finish(result.finish_reason))
    if _wants_usage(turn):
        parts.append(enc.usage(result.usage))
    parts.append(DONE)
    if trace_enabled(run.metadata):
        trace = StreamTrace()
        trace.chunk("role", 0)
        if result.reasoning is not None:
            trace.chunk("reasoning", len(result.reasoning))
        if result.content:
            trace.chunk("content", len(result.content))
        if result.tool_calls:
            trace.chunk("tool_calls", 0, tool_call_count=len(result.tool_calls))
        trace.chunk("finish", 0, finish_reason=result.finish_reason)
    return b"".join(parts)


# -- live stream -------------------------------------------------------------------


class Into:
    """Shaped text, encoded, onto a stream's ``out`` list: what a live
    :class:`Shaper` is given. An object of two slots, not a closure over the
    list and the encoder (208 bytes each, two held by every open stream), nor
    the stream's bound method (a cycle through its shaper: freed only by the
    cyclic collector)."""

    __slots__ = ("out", "encode")

    def __init__(self, out: list[bytes], encode: Callable[[str], bytes]) -> None:
        self.out = out
        self.encode = encode

    def __call__(self, text: str) -> None:
        self.out.append(self.encode(text))


class LiveEncoder:
    """What :func:`stream_live` writes with: one API's bytes for a run's
    events as they arrive. The loop (commit, keep-alives, writes) is
    :func:`stream_live`'s; an encoder only makes bytes, no I/O.

    A subclass sets ``shaper`` (its callbacks append to ``out``) and gives
    :meth:`opening`, :meth:`complete`, :meth:`error` and ``keep_alive``.
    """

    keep_alive = KEEPALIVE  # written each keepalive_s the run shows nothing
    again = False  # set at the end of a run another run follows on this stream (a tool retry)
    check_later: tuple | None = None  # set at an end whose closing bytes await :meth:`checked_end`

    async def checked_end(self) -> bytes:
        raise NotImplementedError

    def __init__(self, turn: Turn, run: Run) -> None:
        self.turn = turn
        self.run = run
        self.out: list[bytes] = []  # bytes shaped and not yet written
        self.shaper: Shaper

    def shape_into_out(self, content: Callable[[str], bytes], reasoning: Callable[[str], bytes]) -> Shaper:
        """A live :class:`Shaper` for this request whose shaped content and
        reasoning go to ``out`` through the API's ``content``/``reasoning``
        encoders."""
        out = self.out
        return self.turn.shaper(live=True, on_content=Into(out, content), on_reasoning=Into(out, reasoning))

    def opening(self) -> bytes:
        """Written when the stream commits."""
        return b""

    def complete(self, event: RunEvent) -> bytes:
        """The run ended well: its last events and the closing bytes."""
        raise NotImplementedError

    def error(self, message: str, type: str, code: str | None = None) -> bytes:
        """The closing bytes of a stream whose run failed after it committed."""
        return sse_error(message, type, code or stream_code(self.turn.last_run, type))

    def feed(self, batch: list[RunEvent]) -> bytes | None:
        """Shape a batch into ``out``; the closing bytes if the run ended."""
        end = self.shaper.take(batch)
        return None if end is None else self._end(end)

    def _end(self, event: RunEvent) -> bytes:
        return self.complete(event) if event.type == COMPLETE else self.failed(event)

    def failed(self, event: RunEvent) -> bytes:
        self.shaper.abandon()
        failed = failure(event, self.run)
        self.turn.outcome = failed.cause
        return self.error(failed.message, failed.type)


class ToolLive(LiveEncoder):
    """A live stream of any API whose request may have tools (``tool_stream =
    "live"``): content passes a filter that holds back possible tool-call
    text, and the calls are validated at the end: invalid calls before any
    content went out are retried on the same stream (:func:`stream_live`),
    after content they are an in-stream ``tool_validation_error``.

    A subclass gives :meth:`text` (its API's bytes for content), its shaper
    (content through :meth:`_content` when :attr:`tool_filter` is set) and
    :meth:`tail` (the closing bytes of a run that ended well).
    """

    # With tools, lists (made per stream): all content, for parsing calls at
    # the end, and what of it was sent. Without, nothing is kept.
    raw_content: Sequence[str] = ()
    emitted: Sequence[str] = ()

    def __init__(self, turn: Turn, run: Run, attempt: int = 1) -> None:
        super().__init__(turn, run)
        self.attempt = attempt
        # A retry of the turn: (reason, calls, content) of these invalid calls (:func:`_live_tools`).
        self.retry: tuple[str, list[ToolCall] | None, str] | None = None
        self.moved: RunFailed | None = None  # its run was lost, to run again (:meth:`_moves`): its failure
        self.tool_filter = ToolTextFilter() if turn.contract is not None else None
        if self.tool_filter is not None:
            self.raw_content: list[str] = []
            self.emitted: list[str] = []
        # While the end of the run is judged (:meth:`complete`): what its last text would encode,
        # as (encoder, text), encoded only once no retry drops it. The Responses and Messages
        # encoders keep state (items opened, block indexes, sequence numbers): encoded and then
        # dropped, a retry's stream went on from a state its client never saw (both SDKs raised).
        self._held: list[tuple[Callable[[str], bytes], str]] | None = None
        self._encode_reasoning: Callable[[str], bytes] | None = None
        # This attempt showed reasoning: a retry's is apart from it ("plan Aplan B" before)
        self._reasoned = False

    def shape_tools(self, content: Callable[[str], bytes], reasoning: Callable[[str], bytes]) -> Shaper:
        """:meth:`shape_into_out`, its content through the tool filter when the request has tools."""
        if self.tool_filter is None:
            return self.shape_into_out(content, reasoning)
        self._encode_reasoning = reasoning
        return self.turn.shaper(live=True, on_content=self._content, on_reasoning=self._reason)

    def _reason(self, text: str) -> None:
        self._encode(self._encode_reasoning, self._apart(text))  # type: ignore[arg-type]

    def _apart(self, text: str) -> str:
        """Reasoning to show: a retry's first starts a paragraph after what an attempt before it showed."""
        turn = self.turn
        if not self._reasoned:
            self._reasoned = True
            if turn.reasoning_shown:
                text = "\n\n" + text
        if self._held is None:  # (held at the run's end: a retry drops it unshown)
            turn.reasoning_shown = True
        return text

    def _encode(self, encode: Callable[[str], bytes], text: str) -> None:
        held = self._held
        if held is None:
            self.out.append(encode(text))
        else:
            held.append((encode, text))

    def _release(self) -> None:
        """What :meth:`complete` held back goes out (its calls stand, or end the stream)."""
        held, self._held = self._held, None
        for encode, text in held or ():
            self.out.append(encode(text))

    def text(self, text: str) -> bytes:
        raise NotImplementedError

    def tail(self, event: RunEvent, calls: list[ToolCall] | None, usage) -> bytes:
        raise NotImplementedError

    def _emit_content(self, text: str, **extra) -> None:
        if not text:
            return
        if self.tool_filter is not None:
            self.emitted.append(text)
        self._encode(self.text, text)

    def _content(self, text: str) -> None:
        if self.tool_filter is not None:
            self.raw_content.append(text)
            text = self.tool_filter.append(text)
        self._emit_content(text)

    def failed(self, event: RunEvent) -> bytes:
        if self._moves(event):
            return b""
        if self.attempt == 1:
            return super().failed(event)
        self.shaper.abandon()
        failed = failure(event, self.run)
        self.turn.outcome = failed.cause
        return self.error(f"the retry failed: {failed.message}", retry_type(failed))

    def _moves(self, event: RunEvent) -> bool:
        """A run lost (or stalled) mid-run, while this stream has shown none of it (its opening
        and keep-alives at most; tool-call text is held): run again, once, on the stream already
        open (:func:`_live_tools`), as a buffered stream's run is (:meth:`Turn.moves_lost_run`).
        Its client got "node disconnected" (an outside audit)."""
        if self.tool_filter is None or self._reasoned or any(not text.isspace() for text in self.emitted):
            return False
        failed = failure(event, self.run)
        if not self.turn.moves_lost_run(failed.cause):
            return False
        self.shaper.abandon()
        self.moved = failed
        self.again = True
        return True

    def complete(self, event: RunEvent) -> bytes:
        # Content went out (or goes with this batch): no retry from here on. (Whitespace
        # before a call is no answer: a model's retry may follow it.)
        sent = any(not text.isspace() for text in self.emitted)
        mark = len(self.out)  # what this end adds to ``out`` (a retry drops it)
        if self.tool_filter is not None:
            self._held = []
        usage = self.turn.usage_of(self.run, event)
        self.shaper.finish(finish_of(event))
        cut_off = finish_of(event) == "length"  # by max_tokens: what was produced goes out as it is
        calls = self.turn.native_calls(event)
        dropped = False  # text calls past the turn's most_calls were left unread
        if calls:
            if self.tool_filter is not None:
                self._emit_content(self.tool_filter.flush_non_candidate())
        elif self.tool_filter is not None:
            raw = self.shaper.raw_content_text
            parsed = parse_calls_of("".join(self.raw_content), raw, cut_off, self.turn.most_calls)
            if parsed.candidate and not (cut_off and (parsed.error or not parsed.calls)):  # (as _finish's)
                calls, dropped = parsed.calls or None, parsed.dropped
                if parsed.error:  # a block that could not be read fails the turn, as when buffered: what
                    # is left of the text is not sent (past 1,024 calls, the rest's markup went out as text)
                    return self._invalid(parsed.error, calls, parsed.content, sent, mark)
                self._emit_content(_unstreamed(parsed, "".join(self.emitted)))
            else:
                self._emit_content(self.tool_filter.flush())
            if not calls and not "".join(self.emitted).strip():
                found = calls_in_reasoning(self.shaper.reasoning_text, finish_of(event), self.turn.most_calls)
                if found is not None:
                    calls, dropped = found.calls or None, found.dropped
                    if found.error:
                        return self._invalid(found.error, calls, "", sent, mark)
        contract = self.turn.contract
        if contract is not None and not (event.refusal and not calls):
            sent_calls = self.turn.calls_to_send(calls)  # (a call not sent is not checked: it failed the turn)
            cut_off = cut_off and sent_calls is calls and not dropped  # (a call followed the last one sent)
            calls = sent_calls
            try:  # on the loop for a moment; past it (or for large arguments) in a worker thread
                if contract.needs_thread(calls):
                    raise NeedsTime
                reason = contract.validate(calls, INLINE_PATTERN_S, escalate=True, cut=cut_off)
            except NeedsTime:
                self.check_later = (event, calls, usage, sent, mark, cut_off)  # (:meth:`checked_end`)
                return b""
            if reason:
                return self._invalid(reason, calls, "".join(self.raw_content), sent, mark)
        self._release()
        return self.tail(event, calls, usage)

    async def checked_end(self) -> bytes:
        """The end :meth:`complete` left for its calls' check in a worker thread."""
        contract = self.turn.contract
        assert self.check_later is not None
        assert contract is not None
        event, calls, usage, sent, mark, cut_off = self.check_later
        self.check_later = None
        reason = await contract.check_in_thread(calls, cut_off)
        if reason:
            return self._invalid(reason, calls, "".join(self.raw_content), sent, mark)
        self._release()
        return self.tail(event, calls, usage)

    def _invalid(self, reason: str, calls: list[ToolCall] | None, content: str, sent: bool, mark: int) -> bytes:
        """Invalid calls end the run: retried if no content went out and attempts
        are left (this end's bytes dropped, ``again`` set), else the stream's
        ``tool_validation_error``."""
        turn = self.turn
        if sent or self.attempt >= turn.max_tool_attempts:
            self._release()
            turn.invalid_at_last(reason, self.attempt)
            turn.outcome = "tool_validation"
            return self.error(reason, TOOL_VALIDATION_ERROR)
        self._held = None
        del self.out[mark:]
        self.retry = (reason, calls, content)
        self.again = True
        return b""


class LiveStream(ToolLive):
    """Shapes a run's events into chat SSE chunks as they arrive: each batch of
    events becomes one write (with tools, :class:`ToolLive`)."""

    def __init__(self, turn: Turn, run: Run, previous: LiveStream | None = None, attempt: int = 1) -> None:
        super().__init__(turn, run, attempt)
        self.enc = enc = previous.enc if previous is not None else _encoder(turn, run)  # (one id throughout)
        self.trace = StreamTrace() if trace_enabled(run.metadata) else None
        if self.trace is None and self.tool_filter is None:
            on_content, on_reasoning = Into(self.out, enc.content), Into(self.out, enc.reasoning)
        else:
            on_content, on_reasoning = self._content, self._reasoning
        self.shaper = turn.shaper(live=True, on_content=on_content, on_reasoning=on_reasoning)

    def text(self, text: str) -> bytes:
        return self.enc.content(text)

    def _emit_content(self, text: str, **extra) -> None:
        if text and self.trace is not None:
            self.trace.chunk("content", len(text), **extra)
        super()._emit_content(text)

    def _reasoning(self, text: str) -> None:
        if self.trace is not None:
            self.trace.chunk("reasoning", len(text))
        self._encode(self.enc.reasoning, self._apart(text))

    def opening(self) -> bytes:
        return self.enc.role()

    def feed(self, batch: list[RunEvent]) -> bytes | None:
        if self.trace is None:
            return super().feed(batch)
        end = self.shaper.take(batch, self.trace.around)
        return None if end is None else self._end(end)

    def tail(self, event: RunEvent, calls: list[ToolCall] | None, usage) -> bytes:
        """The closing bytes of a run that ended well: a refusal, the calls, the finish, the usage."""
        enc = self.enc
        shaper = self.shaper
        finish_reason = finish_of(event)
        calls = self.turn.calls_to_send(calls)
        tail: list[bytes] = []
        if event.refusal:
            tail.append(refusal_chunk(enc, event.refusal))
        if calls:
            tail.append(enc.tool_calls(tool_calls_out(calls)))
            if self.trace is not None:
                self.trace.chunk("tool_calls", 0, tool_call_count=len(calls))
        finish_reason = end_reason(finish_reason, bool(calls))
        fallback = "" if event.refusal else shaper.fallback(finish_reason, bool(calls))
        if fallback:
            self._emit_content(fallback, fallback=True)
        if self.trace is not None:
            self.trace.chunk("finish", 0, finish_reason=finish_reason)
        tail.append(enc.finish(finish_reason))
        if _wants_usage(self.turn):
            tail.append(enc.usage(usage))
        tail.append(DONE)
        return b"".join(tail)


def _unstreamed(parsed: TextToolCalls, emitted: str) -> str:
    """The part of the final cleaned content the client has not seen yet: what follows
    ``emitted`` in the content as the model wrote it around its calls (its whitespace
    between them kept, as a whole answer's is; its end stripped, as a whole answer's is)."""
    if not emitted:  # (its leading whitespace too: held until text followed it)
        return parsed.content
    if parsed.unstripped.startswith(emitted):
        return parsed.unstripped[len(emitted) :].rstrip()
    cleaned = parsed.content
    if cleaned.startswith(emitted):
        return cleaned[len(emitted) :]
    cleaned, emitted = cleaned.strip(), emitted.strip()
    if cleaned.startswith(emitted):
        return cleaned[len(emitted) :].strip()
    return ""


# What a live stream's encoder is made with: (turn, run, the encoder of the stream's run before
# (a tool retry's), the attempt).
MakeLive = Callable[[Turn, Run, Any, int], ToolLive]


def stream_live(turn: Turn, slot: Slot, make: MakeLive = LiveStream) -> Awaitable[None]:
    """A live stream, its bytes made by ``make(turn, run, None, 1)``: commits
    (``200`` and the encoder's opening) at the run's first event or when a
    keep-alive is due, writes each batch's bytes, the encoder's keep-alive
    when the run is quiet, and its closing bytes. A run that fails before the
    stream commits is an HTTP error (:func:`http_error`). With tools, runs
    retried on the stream (:func:`_live_tools`). Await what this returns;
    not a coroutine: a stream holds no frame of this one's."""
    if turn.contract is not None:
        return _live_tools(turn, slot, make)
    return turn.run_on(slot, _LiveWrite(turn, make), keepalive=turn.edge.config.keepalive_s)


async def _live_tools(turn: Turn, slot: Slot, make_live: MakeLive) -> None:
    """A live stream with tools (``tool_stream = "live"``), of any API: a run
    whose calls are invalid before any content went out is retried, as a
    buffered stream's is (:func:`collect_validated`: attempts, metadata, the
    corrective message), on the stream already open: its events keep the
    stream's ids (the retry's encoder is made from the first's), and
    keep-alives flow while the retry waits for a slot."""
    keepalive = turn.edge.config.keepalive_s
    turn.settle_at_end = True  # a run's usage settles the key's lease only once no retry follows it
    made: list[ToolLive] = []
    metadata: dict[str, str] | None = None
    extra: list[dict[str, Any]] | None = None
    attempt = 1

    def make(turn: Turn, run: Run, previous: Any = None, _: int = 1) -> ToolLive:
        live = make_live(turn, run, made[0] if made else None, attempt)
        made[:] = [live]
        return live

    async def keep_alive() -> None:
        await turn.ex.write(KEEPALIVE)

    while True:
        try:
            await turn.run_on(
                slot, _LiveWrite(turn, make), metadata=metadata, extra_messages=extra, keepalive=keepalive
            )
        except APIError as e:  # a retry's body does not fit a frame (the first's was checked on arrival)
            if attempt == 1:
                raise
            await _retry_failed(turn, e)
            return
        live = made[-1] if made else None
        if live is not None and live.moved is not None:
            try:
                slot = await acquire_keeping_alive(turn, keep_alive)
            except APIError as e:
                # None linked again: the lost run's error, as it was before the move; a refusal
                # of another kind (the edge drains, the queue timed out) says itself.
                lost = live.moved
                turn.outcome = lost.cause
                if e.code == "no_node_available":
                    await turn.ex.finish(live.error(lost.message, lost.type))
                else:
                    await turn.ex.finish(live.error(e.message, e.type, e.code))
                return
            continue
        if live is None or live.retry is None:
            turn.settle()
            return
        attempt += 1
        metadata, extra = turn.retry_after(*live.retry, attempt)
        try:
            slot = await acquire_keeping_alive(turn, keep_alive)
        except APIError as e:
            await _retry_failed(turn, e)
            return


async def _retry_failed(turn: Turn, error: APIError) -> None:
    await fail(turn, retry_not_started(error))


class _LiveWrite:
    """What :func:`stream_live`'s run is consumed with (an object, not a
    closure: a fifth of the memory, held by every open stream)."""

    __slots__ = ("_turn", "_make")

    def __init__(self, turn: Turn, make: MakeLive) -> None:
        self._turn = turn
        self._make = make

    def __call__(self, run: Run) -> Awaitable[None]:
        turn = self._turn
        return _write_live(turn, run, self._make(turn, run, None, 1))


class _LiveSink:
    """Shapes a stream's text events and writes their chunks as they arrive,
    in the link reader's task, while the stream's own task waits
    (:attr:`Run.sink`): no wake-up of that task, nor a pass through its loop,
    per chunk (one token a chunk when a model server paces its tokens). The
    run's first text commits the stream from here too: the head, the
    opening and the first chunk in one write (:meth:`Exchange.start_now`).

    After that, an event that joins several of the model server's deltas
    (they came faster than the node sent them) is left to the stream's task,
    whose batches join what arrives meanwhile. Each chunk goes to the socket
    at once (:class:`~edge.openai.direct.DirectBody`) or not at all; whatever
    cannot be finished synchronously (a write the kernel took only part of
    or none of, a failure while shaping) is left to the stream's task, which
    is woken for it and takes every later event itself until it has dealt
    with it, so bytes keep their order."""

    __slots__ = ("_run", "_live", "_live_traced", "_ex", "_direct", "_writer", "rest", "error", "_handed", "opened")

    def __init__(self, run: Run, live: LiveEncoder, ex) -> None:
        self._run = run
        self._live = live
        self._live_traced = getattr(live, "trace", None) is not None
        self._ex = ex
        # None: not known yet (the stream has not committed); False: chunks go the ASGI way.
        self._direct = ex.direct if ex.started else None
        self._writer = self._direct  # what sends the end of a write the kernel took in part
        self.rest = b""  # what the kernel did not take of a write: the stream's task sends it first
        self.error: Exception | None = None  # raised in the stream's task
        self._handed = False  # the stream's task was woken to deal with something: it takes every event
        self.opened = False  # the opening is in ``live.out``, for the stream's task to commit with

    def take(self, event: RunEvent) -> bool:
        if self._handed or self._live_traced or event.type not in TEXT_TYPES:
            # (a traced stream's log lines carry the request's context: written by the request's task)
            return False
        direct = self._direct
        if direct is None:
            if not self._ex.started:
                return self._commit(event)
            direct = self._direct = self._ex.direct or False  # the stream's task committed it (a
            self._writer = direct  # keep-alive, say): the rest of a write taken in part goes by it too
        if direct is False or event.parts > 1:
            # The node joined several of the model server's deltas into it: tokens are coming
            # faster than they are sent, and the stream's task, woken, takes every event queued
            # by then in one chunk (fewer, larger writes when the edge is busiest).
            return False
        live = self._live
        out = live.out
        try:
            live.feed([event])  # text only: shaped into ``out``, never an end
            run = self._run
            if not out:
                if run.quiet_since is None:  # (held: keep-alives come from now)
                    run.quiet_since = run.last_event_at
                return True
            run.quiet_since = None
            data = out[0] if len(out) == 1 else b"".join(out)
            rest = direct.write(data)
        except Exception as error:  # noqa: BLE001 (a bug here must fail this request, not the node's link)
            return self._fail(error)
        if rest is None:  # the socket takes nothing now: the stream's task writes ``out``
            return self._hand_over()
        out.clear()
        if rest:
            self.rest = rest
            self._hand_over()
        return True

    def _commit(self, event: RunEvent) -> bool:
        """The run's first text: the stream's head, opening and first chunk."""
        live = self._live
        out = live.out
        try:
            out.append(live.opening())
            live.feed([event])
            done = self._ex.start_now(200, SSE_HEADERS, b"".join(out))
        except Exception as error:  # noqa: BLE001 (as in take)
            return self._fail(error)
        if done is None:  # the stream's task commits with what is in ``out``
            self.opened = True
            return self._hand_over()
        direct, rest, included = done
        self._writer = direct
        self._direct = direct if included else False  # False: every later chunk goes the ASGI way
        self.rest = rest
        if included:
            out.clear()
        if rest or not included:  # (not included: h11 framed the body otherwise; ``out`` goes after the head)
            self._hand_over()
        return True

    def _hand_over(self) -> bool:
        self._handed = True
        self._run.nudge()
        return True

    def _fail(self, error: Exception) -> bool:
        self.error = error
        return self._hand_over()

    async def settle(self) -> None:
        """In the stream's task: what :meth:`take` left to it."""
        self._handed = False
        if self.error is not None:
            raise self.error
        if self.rest:
            rest, self.rest = self.rest, b""
            await self._writer.send_rest(rest)


async def _write_live(turn: Turn, run: Run, live: LiveEncoder) -> None:
    """A run that fails before the stream commits is answered with an HTTP error."""
    ex = turn.ex
    out = live.out
    sink = _LiveSink(run, live, ex)
    try:
        while True:
            run.sink = sink.take
            try:
                batch = await run.next_batch_or_idle()
            finally:
                run.sink = None
            await sink.settle()
            commit = not ex.started
            if commit:
                if batch and batch[0].type not in (DELTA, REASONING_DELTA, COMPLETE):
                    await fail(turn, failure(batch[0], run), live.error, live.opening)
                    return
                if not sink.opened:  # else the sink put it in ``out`` with the first text
                    out.append(live.opening())
            end = None
            if batch is None:
                out.append(live.keep_alive)
            else:
                events = len(batch)
                end = run.shaped(live.feed, batch)
                if end is not None and live.check_later is not None:
                    end = await live.checked_end()
                if end is not None:
                    out.append(end)
                if not out:
                    if events and run.quiet_since is None:  # (held: keep-alives come from now)
                        run.quiet_since = run.last_event_at
                    continue
                run.quiet_since = None
            if not out:
                continue
            data = b"".join(out)
            out.clear()
            if commit:  # the head and the first bytes together: one packet to the client
                await ex.start(200, SSE_HEADERS, data)
                data = b""
            if end is not None and not live.again:
                await ex.finish(data)
                return
            if data:
                await ex.write(data)
            if end is not None:  # another run follows on this stream
                return
    finally:
        policy = turn.policy
        log.info(
            "stream closed",
            api=ex.api,
            strict_output=policy.strict_output,
            strict_stream_buffer=policy.stream_buffer,
            content_len=live.shaper.content_len,
            reasoning_len=live.shaper.reasoning_len,
        )
