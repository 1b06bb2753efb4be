"""Any OpenAI-compatible server (vLLM, llama.cpp, SGLang, Ollama, providers).

The request is always streamed upstream (``stream: true`` with usage), so a
cancel closes the HTTP response mid-generation and the server aborts it.

Every upstream failure is one warning line on the node naming the model, the
upstream's host:port and the error class or status, never the api_key,
headers or bodies (a chunk it could not read is logged by its size and
what msgspec said of it): the client's ``run_error`` is not the only trace of it.
"""

from __future__ import annotations

import email.utils
import json
import re
import time
from typing import Any

import msgspec
import structlog
import trio

from node import http1
from node.adapters import Counters, Sink, Via
from node.adapters.sse import ErrorEvent, EventTooLarge, SSEParser
from node.config import ModelConfig
from proto import RunRequest, ToolCall, ToolCallFunction, TunnelRequest, Usage, jsoncost
from proto.frames import MAX_TOKEN_COUNT, MAX_TOOL_CALLS, is_token_count


class _FunctionDelta(msgspec.Struct):
    name: str | None = None
    arguments: str | None = None


class _ToolCallDelta(msgspec.Struct):
    index: int | None = None  # some servers leave it out (see _merge_tool_calls)
    id: str | None = None
    type: str | None = None
    function: _FunctionDelta | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None  # OpenAI's: the model declined (content stays empty)
    tool_calls: list[_ToolCallDelta] | _ToolCallDelta | None = None  # TGI 2.x sends one call, not a list


class _Choice(msgspec.Struct):
    index: int = 0
    delta: _Delta | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM: the stop string (or token id) that ended it
    matched_stop: str | int | None = None  # SGLang's name for the same


class _Usage(msgspec.Struct):
    """Counts as a model server sends them: any JSON (``8.0``, ``"5"``, ``null``
    happen), each taken only when it is a count (:func:`_count`), so an odd
    usage never fails an answer that was already sent."""

    prompt_tokens: Any = None
    completion_tokens: Any = None
    total_tokens: Any = None
    completion_tokens_details: Any = None
    prompt_tokens_details: Any = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None  # null in some servers' usage chunks
    usage: _Usage | None = None
    error: Any = None


log = structlog.get_logger("iop.node")

_decode_chunk = msgspec.json.Decoder(_Chunk).decode
# What decoding a model server's JSON may raise: msgspec raises RecursionError, not
# DecodeError, for JSON nested past about 1,000 levels (a body of 1,000 "[" did it).
_UNDECODABLE = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)
_encode = msgspec.json.Encoder().encode
_SURROGATE = re.compile("[\ud800-\udfff]")
_NO_MESSAGE = "the model server reported an error, with no message"
_MAX_ERROR_BODY = 4096  # also the longest error message relayed from an error chunk
_KEY_SAID = "[the node's api_key]"  # in a model server's error text, in place of the key it quoted
_MIN_SECRET = 8  # a shorter api_key ("ollama", "EMPTY") is a placeholder, not a secret: left in the text
_ERROR_BODY_S = 5.0  # how long an error status's body may take to read (then what came is the message)
_DRAIN_S = 2.0  # after [DONE], how long the rest of the body may take
_MAX_FINISH = 64  # a finish_reason is looked up by this much of it
# finish_reason values of servers that are not OpenAI's, as OpenAI's: a client may only
# know these five (a typed client may fail to read any other). Anything else is "stop".
_FINISH = {
    **{reason: reason for reason in ("stop", "length", "tool_calls", "content_filter", "function_call")},
    "eos_token": "stop",  # TGI before 2.0
    "eos": "stop",
    "stop_sequence": "stop",  # Anthropic's words, from servers that relay them
    "end_turn": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    # Cut short, not finished: "length" is the one value that tells a client the answer is incomplete.
    "abort": "length",  # vLLM
    "error": "length",  # vLLM
    "insufficient_system_resource": "length",  # DeepSeek
}
# A run's tool calls as the model server streams them: past these the run fails (the node
# would hold them all until the end, and no frame could carry them).
_MAX_TOOL_BYTES = 8 * 1024 * 1024
# A refusal is held whole until the end (it travels on the run's complete event): past this
# many characters the run fails. OpenAI's are a sentence.
_MAX_REFUSAL = 64 * 1024
# A chunk's JSON values are bounded as any JSON a model wrote (proto.jsoncost.MAX_CONTAINERS,
# MAX_VALUES): 8 MiB of `{},` (an event's most) decoded to 265 MB on the node and held its
# loop 0.3-0.65 s. Past them the chunk is not decoded and the run fails. An honest chunk has
# tens; one that carries logprobs of a hundred tokens (which the node skips unread, but
# counts) a few thousand objects and tens of thousands of values.
# Bytes read that no output paid for (empty deltas, comments, role chunks): past this the run
# fails. Each character of text or tool call pays for _PAID bytes, as many as an honest chunk
# with logprobs takes for one; an honest server sends a keep-alive every few seconds while it
# thinks. A flood of empty deltas kept a node core busy until the edge's wait timeout (120 s);
# one character a MiB of them had reset the count.
_MAX_QUIET = 32 << 20  # four of the largest events
_PAID = 14  # (a shift: 16 KiB a character)
# A stream's bytes in all: past this the run fails. Output the client never sees (a sentinel
# the edge removes, hidden reasoning) pays for padding too: 10 characters of `<|im_end|>` and
# 160 KB of padding a chunk read 6 GB in 30 s (a node core) for 833 bytes to the client. An
# honest answer as long as the edge takes (16 MiB) at 60 bytes of stream a character is 1 GB.
_MAX_STREAM = 1 << 30
_COUNTED = jsoncost.COUNTED  # (a chunk shorter than this is not counted: one name lookup a chunk)
# What the operator checks when the model server answers so (a newcomer's base_url without /v1,
# or a target the server does not know, reached the client as its own 404, the node saying only
# the status).
_STATUS_FIXES = {
    401: "the model server refused the model's api_key",
    403: "the model server refused the model's api_key",
    404: "no such path or model on the model server: base_url must be the URL its /chat/completions is under"
    " (often ending in /v1), and target an id its GET <base_url>/models lists",
    508: "the model's base_url is an iop edge this node links to (a loop): give the model server's URL",
}
VIA_HEADER = "x-iop-via"  # the edges a request came through (an edge refuses one with its own id: a loop)
VIA_METADATA = "iop_via"  # (the run's: the x-iop-via its request came with)
_STREAM_HEADERS = {"content-type": "application/json", "accept": "text/event-stream"}
_CONTENT, _REASONING = 1, 2


class OpenAIAdapter:
    def __init__(
        self,
        model: ModelConfig,
        counters: Counters,
        *,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 600.0,
        ca_file: str = "",
        via: Via | None = None,
    ) -> None:
        self.model = model
        self.counters = counters
        self.via = via if via is not None else Via()  # (an iop edge of this node's, as its server: a loop)
        self.client = http1.Client(
            model.base_url,
            {"authorization": f"Bearer {model.api_key}"} if model.api_key else None,
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            ca_file=ca_file,
        )
        self.upstream = self.client.origin.host_port

    async def aclose(self) -> None:
        await self.client.aclose()

    def _log_failure(self, error: str, run_id: str) -> None:
        log.warning(
            "upstream request failed", model=self.model.name, upstream=self.upstream, error=error, run_id=run_id
        )

    def _log_status(self, status: int, run_id: str) -> None:
        fix = _STATUS_FIXES.get(status)
        log.warning(
            "upstream error status",
            model=self.model.name,
            upstream=self.upstream,
            status=status,
            run_id=run_id,
            **({"fix": fix} if fix else {}),
        )

    def _failed(self, what: str, e: http1.HTTPError) -> str:
        """The run's error for a request that failed, as a client reads it: the model
        server's address stays in the node's log (a refused connection quoted it)."""
        return f"{what} failed: {type(e).__name__}: {str(e).replace(self.upstream, 'the model server')}".rstrip(": ")

    def _unkeyed(self, message: str) -> str:
        return _unkey(message, self.model.api_key)

    async def run(self, request: RunRequest, sink: Sink) -> None:
        body = dict(request.request)
        body["model"] = request.target or self.model.target or self.model.name
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        self.counters.active_upstream += 1
        try:
            headers = _STREAM_HEADERS
            via = self.via.header((request.metadata or {}).get(VIA_METADATA, ""))
            if via:
                headers = {**_STREAM_HEADERS, VIA_HEADER: via}
            async with self.client.request("POST", "/chat/completions", _encode(body), headers) as response:
                if response.status != 200:
                    self._log_status(response.status, request.run_id)
                    text = await _error_text(response, self.model.api_key)
                    await sink.error(text, status=response.status, retry_after=_retry_after(response))
                    return
                encoded = _encoded(response)
                if encoded:
                    self._log_failure("encoded body", request.run_id)
                    await sink.error(encoded)
                    return
                await self._relay(response, sink, request.run_id)
        except http1.HTTPError as e:
            self._log_failure(type(e).__name__, request.run_id)
            # Not reached (refused, or no answer to the connect): its unavailability, as a 503 would
            # say it. The edge charges a key nothing for it, as for a 5xx before any output (a
            # model server restarting charged an agent's every retry its whole prompt: an audit).
            unreached = isinstance(e, (http1.ConnectError, http1.ConnectTimeout))
            await sink.error(self._failed("upstream request", e), status=503 if unreached else 0)
        finally:
            self.counters.active_upstream -= 1

    async def tunnel(self, request: TunnelRequest, sink) -> None:
        """Relay one raw request; the provider's status, headers and body bytes go back unchanged."""
        headers = {k.lower(): v for k, v in request.headers or () if k.lower() in ("accept", "content-type")}
        headers.setdefault("content-type", "application/json")
        via = self.via.header(dict(request.headers or ()).get(VIA_HEADER, ""))
        if via:
            headers[VIA_HEADER] = via
        self.counters.active_upstream += 1
        try:
            async with self.client.request(request.method, request.path, request.body or b"", headers) as response:
                encoded = _encoded(response)
                if encoded:  # (relayed, its bytes reached the client without their content-encoding)
                    self._log_failure("encoded body", request.run_id)
                    await sink.error(encoded)
                    return
                if response.status >= 400:
                    self._log_status(response.status, request.run_id)
                await sink.start(
                    response.status, [(k.decode("latin-1"), v.decode("latin-1")) for k, v in response.headers]
                )
                masked = _Masked(self.model.api_key) if response.status >= 400 else None
                while data := await response.read():
                    if masked is not None:
                        data = masked.feed(data)
                    if data:
                        await sink.body(data)
                if masked is not None and masked.held:
                    await sink.body(masked.held)
                await sink.end()
        except http1.HTTPError as e:
            self._log_failure(type(e).__name__, request.run_id)
            await sink.error(self._failed("provider request", e))
        finally:
            self.counters.active_upstream -= 1

    async def _relay(self, response: http1.Response, sink: Sink, run_id: str) -> None:
        """Relay the event stream: the process's poll of upstream sockets
        hands each read to :meth:`_Relay.feed` (no task switch per read); this
        task waits, for room in the link's outbox when it is full, and ends the run."""
        with response.reading():  # one timeout scope for every read of the stream
            relay = _Relay(sink, self.model.api_key)
            if b"application/json" in (_header(response, b"content-type") or b""):
                await _read_whole(response, relay)  # a server that ignored stream: true
            while not relay.end:
                await response.pump(relay.feed)
                if relay.end or response.done:
                    break
                if relay.finish_reason:  # it said why it stopped: the rest (usage, [DONE]) has _DRAIN_S
                    with trio.move_on_after(_DRAIN_S):
                        try:
                            while not (relay.end or response.done):
                                await response.pump(relay.feed)
                        except http1.HTTPError:  # the answer is whole: what broke after it does not fail it
                            pass
                    break
                await sink.room()  # feed() said stop and nothing ended: the outbox is full
            if relay.end == _DONE:
                await sink.complete(
                    relay.finish_reason or "stop",
                    _ordered(relay.calls),
                    relay.usage,
                    stop=relay.stop,
                    refusal=_whole("".join(relay.refusal)),
                )
                with trio.move_on_after(_DRAIN_S):  # the rest of the body, so the connection is reused
                    while await response.read():
                        pass
            elif relay.end == _FAILED:
                if relay.chunk:
                    log.warning(
                        "upstream request failed",
                        model=self.model.name,
                        upstream=self.upstream,
                        error=relay.failure,
                        run_id=run_id,
                        chunk_bytes=relay.chunk,
                        problem=relay.message,
                    )
                else:
                    self._log_failure(relay.failure, run_id)
                await sink.error(self._unkeyed(relay.message), status=relay.status)
            elif relay.finish_reason:  # the body ended without [DONE]: still an answer if it said why it stopped
                await sink.complete(
                    relay.finish_reason,
                    _ordered(relay.calls),
                    relay.usage,
                    stop=relay.stop,
                    refusal=_whole("".join(relay.refusal)),
                )
            else:
                self._log_failure("stream closed before it finished", run_id)
                kind = _header(response, b"content-type") or b"no content-type"
                if b"text/event-stream" in kind:
                    await sink.error("upstream closed the stream before it finished")
                else:  # a server that ignored stream: true
                    what = kind.decode("latin-1")[:80]
                    await sink.error(f"upstream answered {what}, not an event stream, and sent no finished answer")


_DONE, _FAILED = 1, 2
_MAX_WHOLE = 32 << 20  # a whole answer (to a stream asked for) is read into memory: at most this


class _WholeChoice(msgspec.Struct):
    index: int = 0
    message: _Delta | None = None  # (a message has a delta's fields: content, reasoning, tool_calls...)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    matched_stop: str | int | None = None


class _Whole(msgspec.Struct):
    choices: list[_WholeChoice] | None = None
    usage: _Usage | None = None
    error: Any = None


_decode_whole = msgspec.json.Decoder(_Whole).decode


async def _read_whole(response: http1.Response, relay: _Relay) -> None:
    """A ``chat.completion`` a model server sent whole, though the node asked for a stream
    (some servers and proxies ignore ``stream: true``): relayed as the one event it would
    have streamed, and its end (it was "answered application/json, not an event stream, and
    sent no finished answer"). A body that is no completion nor error is left to that."""
    first = await response.read()
    if not first.lstrip().startswith(b"{"):
        # (an event stream labelled application/json, as some servers do: read as one, as before)
        relay.feed(first)
        return
    body = bytearray(first)
    while data := await response.read():
        body += data
        if len(body) > _MAX_WHOLE:
            relay._fail("answer too large", f"upstream's answer passed {_MAX_WHOLE >> 20} MiB")
            return
    problem = _past_bounds(bytes(body))  # (as an event's: 32 MiB of `{},` decoded took 2 s and 866 MB)
    if problem is not None:
        relay._fail("undecodable answer", f"upstream sent an undecodable answer: {problem}")
        return
    try:
        whole = _decode_whole(body)
    except _UNDECODABLE:
        return
    if not whole.choices and whole.error is None:
        return
    choices = [_Choice(c.index, c.message, c.finish_reason, c.stop_reason, c.matched_stop) for c in whole.choices or ()]
    event = _encode(_Chunk(choices, whole.usage, whole.error))
    relay.feed(b"data: " + event + b"\n\ndata: [DONE]\n\n")


_MAX_STOP = 1024  # a longer "stop string" is no request's stop sequence: not relayed


class _Relay:
    """What one event stream said so far. :meth:`feed` takes a read of the
    body and reports its text: text of one kind that arrived in one read is
    one event, so a busy server's tokens travel together (never waited for)."""

    __slots__ = (
        "sink",
        "parser",
        "finish_reason",
        "stop",
        "usage",
        "calls",
        "tool_bytes",
        "refusal",
        "refusal_len",
        "end",
        "failure",
        "message",
        "status",
        "chunk",
        "room",
        "at",
        "key",
        "quiet",
        "read",
        "held",
    )

    def __init__(self, sink: Sink, key: str | None) -> None:
        self.sink = sink
        self.key = key  # the node's api_key, never in an error it relays
        self.parser = SSEParser()
        self.finish_reason = ""
        self.usage: Usage | None = None
        self.stop = ""  # the stop sequence the model server said ended it
        self.calls: dict[int, _Call] = {}
        self.at: dict[int, int] = {}  # the upstream's tool-call index: the key in calls of its latest call
        self.tool_bytes = 0  # what the calls hold so far
        self.refusal: list[str] = []  # the refusal's pieces, joined at the end
        self.refusal_len = 0
        self.end = 0  # _DONE ([DONE] came) or _FAILED (then failure and message)
        self.failure = ""
        self.message = ""
        self.status = 0  # the upstream's HTTP error status, when its error said one
        self.chunk = 0  # the size of a chunk that could not be read, for the node's log
        self.room = True  # the sink takes more now
        self.quiet = 0  # bytes read that no output paid for (_PAID)
        self.read = 0  # bytes read in all
        self.held: dict[int, str] = {}  # kind -> the start of a character a chunk cut (_mend)

    def _emit(self, kind: int, texts: list[str]) -> None:
        sink = self.sink
        if len(texts) == 1:
            text, parts = texts[0], 1
        else:
            text, parts = "".join(texts), len(texts)
        self._paid(len(text))
        self.room = sink.delta_nowait(text, parts) if kind == _CONTENT else sink.reasoning_nowait(text, parts)

    def _paid(self, characters: int) -> None:
        """``characters`` of output pay for the stream read before them (:data:`_PAID`)."""
        quiet = self.quiet - (characters << _PAID)
        self.quiet = quiet if quiet > 0 else 0

    def feed(self, data: bytes) -> bool:
        """Take body bytes; False: stop reading (the stream ended, or the sink is full)."""
        self.room = True
        self.quiet += len(data)
        self.read += len(data)
        kind = 0
        texts: list[str] = []
        try:
            payloads = self.parser.feed(data)
        except EventTooLarge as e:
            if self.finish_reason:  # the answer is whole: what broke after it does not fail it
                self.end = _DONE
                return False
            return self._fail("event too large", f"upstream sent {e}")
        for payload in payloads:
            if payload.__class__ is ErrorEvent:  # llama.cpp's `error:` line, an `event: error`
                if texts:
                    self._emit(kind, texts)
                if self.finish_reason:
                    return self._late_error("error event")
                self._error("error event", _error_of(payload))
                return False
            done = payload == b"[DONE]"
            chunk = None
            if not done:
                problem = _past_bounds(payload) if len(payload) >= _COUNTED else None
                if problem is None:
                    try:
                        chunk = _decode_chunk(payload)
                    except _UNDECODABLE as e:
                        problem = e
                        if e.__class__ is msgspec.DecodeError:  # (its text, perhaps: see _lenient)
                            chunk = self._lenient(payload)
                    else:
                        if self.held:
                            self._unheld(chunk)
                if chunk is None:
                    # "data: [DONE] " is done too; so is what cannot be read after the answer finished
                    # (a usage of 1e400 failed an answer the client already had)
                    done = payload.strip() == b"[DONE]" or bool(self.finish_reason)
            if done:
                if texts:
                    self._emit(kind, texts)
                self.end = _DONE
                return False
            if chunk is None or chunk.error is not None:
                if texts:
                    self._emit(kind, texts)
                if chunk is None:
                    # What msgspec says names the field and the types, never the payload's
                    # words (a model's completion text, or anything): nor does the log.
                    said = "JSON nested too deeply" if isinstance(problem, RecursionError) else str(problem)[:200]
                    self._fail("undecodable chunk", f"upstream sent an undecodable chunk: {said}")
                    self.chunk = len(payload)
                elif self.finish_reason:
                    return self._late_error("error chunk")
                else:
                    self._error("error chunk", chunk.error)
                return False
            if chunk.usage is not None:
                self.usage = _usage(chunk.usage)
            if self.finish_reason:  # finished: only its usage, [DONE] or an error may follow
                if chunk.usage is not None:  # (its usage: the answer is whole now, [DONE] or not; a
                    # server that kept the body open had it wait 2 s for a [DONE]: an outside audit)
                    if texts:  # (read with it: the answer's last text)
                        self._emit(kind, texts)
                    self.end = _DONE
                    return False
                continue
            for choice in chunk.choices or ():
                if choice.index != 0:
                    continue
                delta = choice.delta
                if delta is not None:
                    reasoning = delta.reasoning_content or delta.reasoning
                    if reasoning:
                        if kind != _REASONING and texts:
                            self._emit(kind, texts)
                            texts = []
                        kind = _REASONING
                        texts.append(reasoning)
                    if delta.content:
                        if kind != _CONTENT and texts:
                            self._emit(kind, texts)
                            texts = []
                        kind = _CONTENT
                        texts.append(delta.content)
                    if delta.refusal:
                        self.refusal.append(delta.refusal)
                        self.refusal_len += len(delta.refusal)
                        if self.refusal_len > _MAX_REFUSAL:
                            if texts:
                                self._emit(kind, texts)
                            return self._fail(
                                "refusal too large", f"upstream's refusal passed {_MAX_REFUSAL} characters"
                            )
                    if delta.tool_calls:
                        calls = delta.tool_calls
                        calls = calls if calls.__class__ is list else [calls]
                        added = _merge_tool_calls(self.calls, self.at, calls)
                        if added:  # (fragments that add nothing are no output: `{"index": 0}` per MiB)
                            self._paid(added)
                            self.tool_bytes += added
                            if not self.sink.progress_nowait(len(calls)):
                                self.room = False
                        if self.tool_bytes > _MAX_TOOL_BYTES or len(self.calls) > MAX_TOOL_CALLS:
                            if texts:
                                self._emit(kind, texts)
                            return self._fail(
                                "tool calls too large",
                                f"upstream's tool calls passed {MAX_TOOL_CALLS} calls or {_MAX_TOOL_BYTES} bytes",
                            )
                if choice.finish_reason:
                    self.finish_reason = _FINISH.get(choice.finish_reason[:_MAX_FINISH].lower(), "stop")
                    matched = choice.stop_reason if choice.stop_reason is not None else choice.matched_stop
                    if isinstance(matched, str) and len(matched) <= _MAX_STOP:
                        self.stop = matched
            if self.finish_reason and chunk.usage is not None:  # (the finish with its usage: vLLM's
                # usage in every chunk; the answer is whole, as for a usage chunk after the finish)
                if texts:
                    self._emit(kind, texts)
                self.end = _DONE
                return False
        if texts:
            self._emit(kind, texts)
        if (self.quiet > _MAX_QUIET or self.read > _MAX_STREAM) and not self.finish_reason:
            if self.quiet > _MAX_QUIET:
                return self._fail("no output", f"upstream sent {_MAX_QUIET >> 20} MiB with little or no output")
            return self._fail("stream too long", f"upstream sent more than {_MAX_STREAM >> 20} MiB for one answer")
        return self.room and not self.finish_reason  # after the finish: read on under a deadline

    def _lenient(self, payload: bytes) -> _Chunk | None:
        """A chunk msgspec could not read, read again as Go's decoder reads any (the seeds'):
        bytes that are not UTF-8 and lone UTF-16 surrogates do not fail the answer. A
        character a model server cut across two events (its UTF-8 bytes, or a surrogate
        pair's escapes: some servers send text a token at a time, and a token can be part of a
        character) is joined again, in content, reasoning, refusals and tool calls; what cannot
        be joined, or is followed by text of its kind in a chunk msgspec reads, is U+FFFD (the
        start of a character cut at the answer's very end is left out). (It failed the run:
        "upstream sent an undecodable chunk: Invalid UTF-8 encoded string", mid-stream too,
        found from outside.)"""
        try:
            chunk = msgspec.convert(json.loads(payload.decode("utf-8", "surrogateescape")), _Chunk)
        except (ValueError, RecursionError, msgspec.ValidationError):
            return None
        if chunk.error is not None:
            try:
                chunk.error = _whole_json(chunk.error)
            except RecursionError:  # (900 levels the decoder took: past the stack here, as msgspec's limit)
                return None
        for choice in chunk.choices or ():
            if choice.finish_reason is not None:
                choice.finish_reason = _whole(choice.finish_reason)
            for name in ("stop_reason", "matched_stop"):
                if isinstance(getattr(choice, name), str):
                    setattr(choice, name, _whole(getattr(choice, name)))
            delta = choice.delta
            if delta is None:
                continue
            if choice.index == 0:  # (the answer's: others are not read)
                reasoning = delta.reasoning_content or delta.reasoning
                delta.reasoning_content, delta.reasoning = reasoning and self._mend(_REASONING, reasoning), None
                delta.content = delta.content and self._mend(_CONTENT, delta.content)
            calls = delta.tool_calls  # (their arguments and a refusal are joined, and mended, whole)
            for call in calls if isinstance(calls, list) else (calls,) if calls is not None else ():
                call.id = call.id and _whole(call.id)
                call.type = call.type and _whole(call.type)
                if call.function is not None:
                    call.function.name = call.function.name and _whole(call.function.name)
        return chunk

    def _unheld(self, chunk: _Chunk) -> None:
        """A whole chunk (read by msgspec) after one that cut a character: its text of the kind
        held begins with U+FFFD for the cut one, which nothing completes now (it was dropped, or
        put after the text between: a re-check)."""
        for choice in chunk.choices or ():
            delta = choice.delta
            if choice.index != 0 or delta is None:
                continue
            reasoning = delta.reasoning_content or delta.reasoning
            if reasoning and self.held.pop(_REASONING, None) is not None:
                delta.reasoning_content, delta.reasoning = "\ufffd" + reasoning, None
            if delta.content and self.held.pop(_CONTENT, None) is not None:
                delta.content = "\ufffd" + delta.content

    def _mend(self, kind: int, text: str) -> str:
        """``text`` of ``kind`` from a chunk read by :meth:`_lenient`, after what the last one
        held of a character it cut; the start of a character cut at its end is held for the
        next (a trailing high surrogate, or the bytes of an incomplete UTF-8 sequence)."""
        held = self.held.pop(kind, "") if self.held else ""
        text = held + text if held else text
        if not _SURROGATE.search(text):
            return text
        cut = _cut_at_end(text)
        if cut:
            self.held[kind] = text[-cut:]
            text = text[:-cut]
        return _whole(text)

    def _fail(self, failure: str, message: str, status: int = 0) -> bool:
        self.end = _FAILED
        self.failure = failure
        self.message = message
        self.status = status
        return False

    def _late_error(self, what: str) -> bool:
        """An upstream error after the answer finished: the answer is whole, and stands (it
        failed an answer the client already had: a 502 for a whole one; an outside audit)."""
        log.info("upstream error after the answer finished: ignored", error=what)
        self.end = _DONE
        return False

    def _error(self, failure: str, error: Any) -> None:
        """The stream failed with the upstream's own error: its message, and its
        ``code`` as the run's status when that is an HTTP error status (a 400 is
        then the client's 400, which no SDK retries)."""
        if isinstance(error, dict) and isinstance(error.get("error"), dict):  # {"error": {...}}
            error = error["error"]
        code = error.get("code") if isinstance(error, dict) else None
        if isinstance(code, str) and len(code) == 3 and code.isdigit():  # ("400": some servers quote it)
            code = int(code)
        status = code if code.__class__ is int and 400 <= code <= 599 else 0
        said = _unkey_cut(_said(error), self.key).strip() if error is not None else ""
        self._fail(
            f"{failure}, status {status}" if status else failure,
            f"upstream error: {said}" if said and said != "None" else _NO_MESSAGE,
            status,
        )


def _count(value: Any) -> int | None:
    """A model server's token count, or None (unknown) when it is none a frame may
    carry: an int in range, or a float with no fraction (``8.0``)."""
    if isinstance(value, float) and value.is_integer() and 0 <= value <= MAX_TOKEN_COUNT:
        return int(value)
    return value if is_token_count(value) else None


def _usage(u: _Usage) -> Usage:
    completion = u.completion_tokens_details if isinstance(u.completion_tokens_details, dict) else {}
    prompt = u.prompt_tokens_details if isinstance(u.prompt_tokens_details, dict) else {}
    return Usage(
        prompt_tokens=_count(u.prompt_tokens),
        completion_tokens=_count(u.completion_tokens),
        total_tokens=_count(u.total_tokens),
        reasoning_tokens=_count(completion.get("reasoning_tokens")),
        cached_tokens=_count(prompt.get("cached_tokens")),
    )


class _Call:
    """One tool call as it streams: its pieces kept in lists, joined once at
    the end (``+=`` on a growing string copies it at each piece)."""

    __slots__ = ("id", "names", "arguments")

    def __init__(self) -> None:
        self.id = ""
        self.names: list[str] = []
        self.arguments: list[str] = []


def _merge_tool_calls(calls: dict[int, _Call], at: dict[int, int], deltas: list[_ToolCallDelta]) -> int:
    """Join streamed tool-call fragments by their ``index`` (``at`` maps it to the
    key in ``calls`` of its latest call). A fragment that names a function
    under an id other than that of the call at its index starts a new call:
    Ollama sends each call whole with ``index: 0``, SGLang its second call as
    ``index: 0, id: "1"``. One with a new id and no name goes on with the call
    (some servers mint an id per chunk: vLLM's gpt-oss streaming, Poolside's
    API), which keeps its first id; a name that repeats the call's whole name
    is not added again. A fragment with no index (servers that send each call
    whole, several in one delta) starts a new call when it names a function
    under a new id or is not the first of its delta's list, and continues the
    last call otherwise. Returns the characters added; stops once there are more
    than MAX_TOOL_CALLS calls (the caller fails the run). The largest key is kept as
    the calls grow: ``max(calls)`` per fragment made a chunk of 60,000 fragments
    hold the node's event loop 28 s, and its link was closed."""
    added = 0
    last = max(calls) if calls else -1
    for position, d in enumerate(deltas):
        index = d.index
        named = d.function is not None and bool(d.function.name)
        if index is None:
            if last < 0 or position > 0 or (named and d.id and d.id != calls[last].id):
                key = last + 1
            else:
                key = last
        else:
            key = at.get(index)
            if key is None:  # the index's first call: the index is its key, unless a moved call took it
                key = at[index] = index if index not in calls else last + 1
            elif named and d.id and calls[key].id and d.id != calls[key].id:
                key = at[index] = last + 1
        call = calls.get(key)
        if call is None:
            call = calls[key] = _Call()
            if key > last:
                last = key
            if len(calls) > MAX_TOOL_CALLS:
                break
        if d.id and not call.id:
            call.id = d.id
            added += len(d.id)
        if d.function is not None:
            name = d.function.name
            if name and not (len(call.names) == 1 and call.names[0] == name):
                call.names.append(name)
                added += len(name)
            if d.function.arguments:
                call.arguments.append(d.function.arguments)
                added += len(d.function.arguments)
    return added


def _ordered(calls: dict[int, _Call]) -> list[ToolCall] | None:
    if not calls:
        return None
    return [
        ToolCall(id=c.id, function=ToolCallFunction(name="".join(c.names), arguments=_whole("".join(c.arguments))))
        for _, c in sorted(calls.items())
    ]


def _whole(text: str) -> str:
    """``text`` with the characters :meth:`_Relay._lenient` read cut (UTF-8 bytes held as
    surrogate escapes, UTF-16 surrogates) joined, and what does not join as U+FFFD."""
    if not _SURROGATE.search(text):
        return text
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # (UTF-16 surrogates: pairs joined; bytes among them are lost)
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def _whole_json(value: Any) -> Any:
    """A value read by :meth:`_Relay._lenient`, every string in it :func:`_whole`."""
    if isinstance(value, str):
        return _whole(value)
    if isinstance(value, list):
        return [_whole_json(v) for v in value]
    if isinstance(value, dict):
        return {_whole(k): _whole_json(v) for k, v in value.items()}
    return value


def _cut_at_end(text: str) -> int:
    """How many characters at the end of ``text`` begin a character that goes on in the next
    piece: a high surrogate, or the UTF-8 bytes (held as surrogate escapes) of an incomplete
    sequence; 0 if none."""
    last = ord(text[-1])
    if 0xD800 <= last <= 0xDBFF:
        return 1
    for back in range(1, min(4, len(text) + 1)):
        byte = ord(text[-back]) - 0xDC00
        if not 0x80 <= byte <= 0xFF:
            return 0
        if byte >= 0xC0:  # a lead byte: the sequence it begins is this long
            if not 0xC2 <= byte <= 0xF4:
                return 0  # (none: it is U+FFFD)
            length = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return back if length > back else 0
    return 0


def _retry_after(response: http1.Response) -> float:
    """A 429's or 503's Retry-After in seconds (a number of them, or an HTTP date), within a
    day; 0 when none is said or it cannot be read. (The edge said 1 s whatever the server
    said: the SDKs retried a provider that asked for 30 s after 1; an outside audit.)"""
    if response.status not in (429, 503):
        return 0.0
    value = _header(response, b"retry-after").decode("latin-1").strip()
    if not value:
        return 0.0
    if value.isascii() and value.isdigit():  # (not "³": a digit to isdigit(), not to int())
        seconds = float(int(value[:6]))
    else:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, IndexError, OverflowError):
            return 0.0
    return min(max(seconds, 0.0), 86_400.0)


def _encoded(response: http1.Response) -> str:
    """What is wrong with an answer in a content-coding (never asked for: every request says
    ``accept-encoding: identity``), or ""."""
    encoding = _header(response, b"content-encoding")
    if not encoding or encoding.lower() == b"identity":
        return ""
    return f"upstream sent a {encoding.decode('latin-1')[:40]}-encoded body, not read here"


def _header(response: http1.Response, name: bytes) -> bytes:
    for key, value in response.headers:
        if key == name:
            return value.lower()
    return b""


def _unkey(text: str, key: str | None) -> str:
    """A model server's error text without the node's api_key: a provider that quotes the key
    it refused ("Incorrect API key provided: ...") would send it to the edge's log, its console
    and the client. Done before any cut, so that no part of the key is left at one."""
    if key and len(key) >= _MIN_SECRET and key in text:
        return text.replace(key, _KEY_SAID)
    return text


def _unkey_cut(text: str, key: str | None, limit: int = _MAX_ERROR_BODY) -> str:
    """:func:`_unkey`, then at most ``limit`` characters, less an end that begins the key:
    a text already cut in bytes (a body's first bytes, an event's) can end inside the key,
    where no replacement finds it (34 of a key's 35 characters reached a client)."""
    text = _unkey(text, key)[:limit]
    if key and len(key) >= _MIN_SECRET:
        for n in range(min(len(key) - 1, len(text)), 3, -1):
            if text.endswith(key[:n]):
                return text[:-n]
    return text


class _Masked:
    """An error status's body, relayed byte for byte but for the node's api_key, which
    becomes as many ``*`` (its length kept, so is the body's): the bytes that could be the
    start of a key split across two reads wait for the next."""

    __slots__ = ("key", "mask", "held")

    def __init__(self, key: str | None) -> None:
        self.key = key.encode() if key and len(key) >= _MIN_SECRET else b""
        self.mask = b"*" * len(self.key)
        self.held = b""

    def feed(self, data: bytes) -> bytes:
        if not self.key:
            return data
        data = (self.held + data).replace(self.key, self.mask)
        keep = len(self.key) - 1
        self.held = data[len(data) - keep :] if len(data) > keep else data
        return data[: len(data) - keep] if len(data) > keep else b""


async def _error_text(response: http1.Response, key: str | None) -> str:
    body = b""
    enough = _MAX_ERROR_BODY + len(key or "")  # a key across the cut is read whole, then replaced
    with trio.move_on_after(_ERROR_BODY_S):  # a body that never ends: what came is the message
        while len(body) < enough and (data := await response.read()):
            body += data
    message = body[:enough].decode("utf-8", "replace")
    try:
        parsed = msgspec.json.decode(body)
    except _UNDECODABLE:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict) and parsed["error"].get("message"):
        message = _said(parsed["error"])
    return f"upstream returned {response.status}: {_unkey_cut(message, key)}"


def _past_bounds(payload: bytes) -> str | None:
    """Why a model server's JSON is not decoded: more values than any chunk has, or None."""
    return jsoncost.past(payload, jsoncost.MAX_CONTAINERS, jsoncost.MAX_VALUES)


def _error_of(payload: bytes) -> Any:
    """An error event's error: its JSON, or its text when it is not JSON (or would cost
    more to decode than any error)."""
    try:
        if len(payload) < jsoncost.COUNTED or not _past_bounds(payload):
            return msgspec.json.decode(payload)
    except _UNDECODABLE:
        pass
    return payload[: 2 * _MAX_ERROR_BODY].decode("utf-8", "replace")  # (cut to the bound once unkeyed)


def _said(error: Any) -> str:
    """The message of an error a model server sent (an object with a message, or anything)."""
    said = error.get("message") if isinstance(error, dict) else error
    if isinstance(said, str):
        return said
    try:
        return str(said)
    except RecursionError:  # nested within msgspec's limit but past str()'s, deeper in the stack
        return "(an error too deeply nested to show)"
