"""A chat completion request across the runs it takes, and collecting runs.

:class:`Turn` holds one request; :meth:`Turn.run_on` starts a run and
consumes it while the run service's timers enforce its timeouts, closing the
run on the way out whatever happens. :func:`collect_validated` reads whole
runs and retries those whose tool calls fail validation (not a run cut off
by ``max_tokens``: it is returned as it is, with ``finish_reason: "length"``).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import structlog
import trio

from edge.errors import APIError, RunFailed, bad_request, lost_unanswered, node_error
from edge.keys import OVER_BUDGET
from edge.openai.exchange import Exchange
from edge.openai.request import (
    HEAVY_BODY_BYTES,
    MAX_CONTENT_PARTS,
    context_class,
    estimate_input_tokens,
    has_media,
    parse_chat_request,
    prompt_prefix,
)
from edge.openai.schema import ChatRequest, UsageOut
from edge.openai.shaping import Shaper, holds_xml_tool_use, ignore_text, wrap_in_completion_tool
from edge.openai.tools import (
    ToolContract,
    before_tool_markup,
    calls_in_reasoning,
    corrective_message,
    history_call_ids,
    parse_calls_of,
    text_tools_request,
    with_correction,
    with_ids,
)
from edge.openai.trace import TRACE_METADATA_KEY, trace_enabled
from edge.openai.usage import usage_out
from edge.per_run import per_run
from edge.runs import Run, Slot, Want
from edge.runs.link import BROKE_THE_PROTOCOL
from edge.runs.run import CANCELLED, NODE_LOST, NODE_STALLED, TIMEOUT, consume_run
from edge.runs.service import encode_run_body, session_key
from proto import RunEvent, ToolCall
from proto.frames import COMPLETE, DELTA, REASONING_DELTA

if TYPE_CHECKING:
    from edge.app import Edge

log = structlog.get_logger("iop.edge.chat")
T = TypeVar("T")

TOOL_VALIDATION_ERROR = "tool_validation_error"
TOOL_VALIDATION_RETRY_ERROR = "tool_validation_retry_error"
OPERATOR_CANCELLED = "cancelled"  # the type of an operator's cancel (edge.errors.operator_cancelled's)


class Turn:
    """One chat completion request, across the runs it takes (tool retries)."""

    def __init__(
        self,
        edge: Edge,
        ex: Exchange,
        req: ChatRequest,
        forward: dict[str, Any],
        session: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        self.edge = edge
        self.ex = ex
        self.req = req
        # Encoded once: a body that cannot travel to a node is a 400/413 now. Without tools every
        # run sends this body, so the decoded one is not kept for as long as the stream lasts.
        self.body = encode_run_body(forward, edge.config.max_frame_bytes)
        self.forward = forward if req.tools else None
        self.policy = edge.config.policy(req.model)
        self.stream = bool(req.stream)
        # ``session``: a front door's own (Messages' metadata.user_id), which the body does not carry;
        # else `user`, else `prompt_cache_key` (OpenAI's own key for a shared prompt cache).
        self.session = (
            (ex.header(b"x-session-id") or b"").decode("latin-1") or session or req.user or req.prompt_cache_key
        )
        self.contract = ToolContract(req) if req.tools else None
        # Tools offered, as `tools` or as OpenAI's deprecated `functions` (forwarded as sent, not
        # read: a server that maps them answers with tool calls): without, calls are dropped.
        self.offered = bool(req.tools) or bool(forward.get("functions"))
        self.metadata = {"openai_stream": "true" if self.stream else "false", "attempt": "1"}
        user_meta = forward.get("metadata") if metadata is None else metadata  # (a front door's own, not sent)
        if isinstance(user_meta, dict) and TRACE_METADATA_KEY in user_meta and edge.config.trace_requests:
            # (a flag: "1", "true"; a 1 MB value went into the run's frame twice, past a node's limit)
            self.metadata[TRACE_METADATA_KEY] = str(user_meta[TRACE_METADATA_KEY])[:16]
        self.estimate = estimate_input_tokens(req)
        self.metadata["estimated_input_tokens"] = str(self.estimate)
        if ex.via:  # (the node passes it on: a loop through other edges comes back here)
            self.metadata["iop_via"] = ex.via
        self.metadata["context_class"] = context_class(self.estimate)
        # The prompt and the completion asked for must fit a node's context_window; with no
        # max_tokens (the SDKs' default), the prompt and one token (it was no check at all: a
        # long prompt went to a small-context node while a large one served the model).
        limit = req.max_completion_tokens or req.max_tokens or 0
        prefix, opening = prompt_prefix(req) if edge.config.routing == "prefix" else ((), 0)
        self.want = Want(
            req.model,
            session=session_key(self.session),
            min_context=self.estimate + (limit or 1),
            max_tokens=limit,
            prefix=prefix,
            opening=opening,
            body_bytes=len(self.body),
        )
        # Responses' ``max_tool_calls``: the calls past it are not the client's (set by its route)
        self.max_tool_calls: int | None = None
        self.last_run: Run | None = None
        self.node_id = ""
        self.outcome: str | None = None  # set when the client got an error the run's cause does not tell
        self.usage: UsageOut | None = None  # of the run that answered (for the access line)
        self.usage_estimated = False
        # Tokens of the runs before the one that answered (tool retries): charged with it, not shown to the client.
        self.earlier = (0, 0)
        self.earlier_estimated = False  # ...of them, a lost run's, counted by the edge's estimate
        # The last run's tokens are in ``earlier`` already (a tool retry or a move followed it, and
        # did not start): the access line charges it there only (a node lost under a whole answer,
        # none linked again, charged its estimate twice: an outside audit).
        self.last_in_earlier = False
        self.settle_at_end = False  # (collect_validated) a run's usage may not be the turn's last
        self.reasoning_shown = False  # a live stream showed an attempt's reasoning (a retry's starts apart)
        self.moved = False  # a run lost mid-run, its client shown none of it, ran again (once: moves_lost_run)
        self.media = has_media(req)  # (for its usage's bounds)
        if not req.tools:  # read above (the estimate, the prefix, the media): a stream need not keep them
            if self.offered:
                self.history_ids  # noqa: B018 (first: the calls of `functions` get ids unlike the history's)
            req.messages = []

    def shaper(
        self,
        *,
        live: bool,
        on_content: Callable[[str], None] = ignore_text,
        on_reasoning: Callable[[str], None] = ignore_text,
    ) -> Shaper:
        """This request's :class:`Shaper` (its model's policy and what the edge learned of its template)."""
        return Shaper(
            self.policy,
            include_reasoning=self.req.reasoning_included(),
            live=live,
            on_content=on_content,
            on_reasoning=on_reasoning,
            template=self.edge.template_think,
            model=self.req.model,
            keep_raw=self.contract is not None,  # (its calls are read from what the model wrote)
        )

    def report(self, access) -> None:
        """Fill in what the access line (edge.openai.routes) reports of this
        request's runs: outcome, node, usage."""
        run = self.last_run
        if self.outcome is not None:
            access.outcome = self.outcome
        elif run is not None:
            access.outcome = run.cause or "unknown"
        # The node that ran it: a run moved to another node before its first event (failover) says where.
        access.node_id = (run.slot.link.node_id if run is not None else self.node_id) or None
        # (a usage that carries a lost run's estimate is an estimate: the ledger said it was exact)
        access.usage, access.usage_estimated = self.usage, self.usage_estimated or self.earlier_estimated
        access.earlier = self.earlier
        if run is not None:
            if run.first_event_at is not None:
                access.ttft_ms = round((run.first_event_at - run.started_at) * 1000, 1)
            charged = self._charged()
            if charged is not None:
                access.partial = charged

    def _charged(self) -> tuple[int, int] | None:
        """What a turn that ended without usage is charged for its last run: its prompt's estimate
        and what it streamed; None if it has usage, or its model server refused it (or could not
        be reached: the node's 503) with nothing streamed (an agent's retries through an upstream
        outage were charged 19k tokens each, for nothing made: outside audits)."""
        run = self.last_run
        if run is None or self.usage is not None or self.last_in_earlier:
            return None
        streamed = run.deltas_seen + run.progress_parts  # (a tool call's pieces)
        if streamed == 0 and run.error_status >= 400:
            return None
        return (self.estimate, streamed)

    @functools.cached_property
    def history_ids(self) -> frozenset[str]:
        """The tool-call ids of the request's history: no call the edge sends reuses one."""
        return history_call_ids(self.req.messages)

    def native_calls(self, event: RunEvent) -> list[ToolCall] | None:
        """The calls the model server returned natively, as the client gets them
        (:func:`with_ids`); none when the request offered no tools (:attr:`offered`):
        the OpenAI and Anthropic APIs never return a call of a tool that was not
        offered, and a client that offered none has nothing to run it with (a
        model server's unasked ``rm_rf`` reached clients as a call: an outside
        audit). Its end is then ``stop`` (:func:`end_reason`)."""
        if not event.tool_calls:
            return None
        if not self.offered:
            log.warning(
                "the model server called a tool the request did not offer: dropped",
                model=self.req.model,
                tool=event.tool_calls[0].function.name[:64],
                calls=len(event.tool_calls),
            )
            return None
        return with_ids(event.tool_calls, self.history_ids)

    @property
    def buffered(self) -> bool:
        """Collect the whole run before the client sees anything. A strict
        model's ``xml_completion_tool`` wraps the whole text, so its streams
        are collected too, ``stream_buffer`` or not."""
        if self.contract is not None and self.policy.tool_stream != "live":
            return True
        policy = self.policy
        return policy.strict_output and (policy.stream_buffer or bool(policy.xml_completion_tool))

    async def acquire(self) -> Slot:
        slot = await self.edge.runs.acquire(self.want, self.ex)  # (its wait is in iop_queue_time_seconds)
        self.node_id = slot.link.node_id
        return slot

    def usage_of(self, run: Run, event: RunEvent) -> UsageOut:
        """The usage of ``run``, ended by ``event`` (complete): always numbers,
        estimated where the upstream gave none (:mod:`edge.openai.usage`)."""
        self.usage, self.usage_estimated = usage_out(
            event.usage,
            prompt_estimate=self.estimate,
            deltas=run.deltas_seen,
            tool_calls=event.tool_calls,
            max_output=self.want.max_tokens,
            context_window=run.slot.info.context_window,
            media=self.media,
            refusal=event.refusal,
        )
        if not self.settle_at_end:
            self.settle()
        return self.usage

    @property
    def most_calls(self) -> int | None:
        """The calls a turn's client gets at most: 1 with ``parallel_tool_calls: false``
        (Anthropic's ``disable_parallel_tool_use``), Responses' ``max_tool_calls``; None: all."""
        if self.req.parallel_tool_calls is False:
            return 1
        return self.max_tool_calls

    def calls_to_send(self, calls: list[ToolCall] | None) -> list[ToolCall] | None:
        """The first :attr:`most_calls` of ``calls``: the client gets no more, and the ones it does
        not get are not checked (a call it would never see failed its turn)."""
        most = self.most_calls
        if calls and most is not None and len(calls) > most:
            return calls[:most]
        return calls

    def settle(self) -> None:
        """Settle the key's lease with every run's tokens, before the client can send its next request."""
        usage = self.usage
        if usage is not None:
            self._settle(sum(self.earlier) + usage.prompt_tokens + usage.completion_tokens)

    def settle_failed(self) -> None:
        """Settle the lease of a turn that failed, with what it is charged (as the access line
        and the ledger have it), before its error goes: the error's x-ratelimit-* say what is
        left after it (a 502 said its reservation was spent, though nothing was charged: an
        outside audit)."""
        if self.usage is not None:
            self.settle()
            return
        charged = self._charged()
        self._settle(sum(self.earlier) + (sum(charged) if charged is not None else 0))

    def _settle(self, used: int) -> None:
        ex = self.ex
        lease = ex.lease
        if lease is not None:
            keys = self.edge.keys
            keys.settle(lease, used)
            if not ex.started and ex.key is not None and (ex.key.policy.rpm or ex.key.policy.tpm):
                # A whole answer's head goes after its usage settled: its x-ratelimit-* say what is
                # left after it, not what was before less its reservation (1,024 and more low with
                # no max_tokens, so a client pacing itself on them slowed to half; outside audit).
                kept = [h for h in ex.extra_headers if not h[0].startswith(b"x-ratelimit-")]
                ex.extra_headers = kept + keys.headers(ex.key)

    @property
    def max_tool_attempts(self) -> int:
        return self.policy.max_tool_attempts or self.edge.config.max_tool_attempts

    def invalid_at_last(self, reason: str, attempt: int) -> None:
        """The last attempt's calls are invalid too: logged (the reason quotes the
        model's arguments, completion text: only when tracing)."""
        why = {"reason": reason} if trace_enabled(self.metadata) else {}
        log.warning("tool validation failed", attempt=attempt, **why)
        if self.last_run is not None:
            self.edge.console.tool_calls_invalid(self.last_run, attempt)

    def retry_after(
        self, reason: str, calls: list[ToolCall] | None, content: str, attempt: int
    ) -> tuple[dict[str, str], list[dict[str, Any]]]:
        """A tool retry, numbered ``attempt``, follows the last run, whose calls
        were invalid: its tokens are spent (the key is charged them, the retry's
        usage answers the client). The retry's metadata and corrective message."""
        usage = self.usage
        if usage is not None:
            self.earlier = (self.earlier[0] + usage.prompt_tokens, self.earlier[1] + usage.completion_tokens)
            self.last_in_earlier = True
        self.usage = None
        failed_run = self.last_run.id if self.last_run else ""
        metrics = self.edge.metrics
        metrics.tool_retries.labels(self.ex.api, metrics.model_label(self.req.model)).inc()
        why = {"reason": reason} if trace_enabled(self.metadata) else {}  # (as in invalid_at_last)
        log.warning("tool validation retry", failed_run_id=failed_run, attempt=attempt, **why)
        metadata = {**self.metadata, "attempt": str(attempt), "failed_run_id": failed_run, "retry_reason": reason[:500]}
        return metadata, [corrective_message(reason, calls, content)]

    def moves_lost_run(self, cause: str) -> bool:
        """Whether the last run, lost (or stalled) mid-run, its client shown none of it (collected,
        or a live stream that showed nothing of it yet), runs again: once a turn, unless no node
        serves its model any more or, moved before its first event, it waited its turn out. If so,
        its prompt and deltas are spent, counted by the edge's estimate. Claude Code and Codex got
        "node disconnected" and ran the turn again themselves."""
        lost = self.last_run
        if (
            cause not in (NODE_LOST, NODE_STALLED)
            or self.moved
            or lost is None
            or lost.unserved
            or (lost.failed_over and lost.first_event_at is None)
        ):
            return False
        self.moved = True
        self.earlier = (self.earlier[0] + self.estimate, self.earlier[1] + lost.deltas_seen)
        self.earlier_estimated = self.last_in_earlier = True
        log.info(f"run moved: its node was {'lost' if cause == NODE_LOST else 'stalled'}", failed_run_id=lost.id)
        metrics = self.edge.metrics
        # (counted only in iop_runs_ended{cause=node_lost}: dashboards read it as clients' losses)
        why = "rerun_node_lost" if cause == NODE_LOST else "rerun_node_stalled"
        metrics.runs_moved.labels(metrics.model_label(self.req.model), why).inc()
        return True

    def request_for(self, slot: Slot, extra_messages: list[dict[str, Any]]) -> msgspec.Raw:
        """The encoded body for a run on ``slot`` (raises :class:`APIError` if a
        rewritten body no longer fits a frame)."""
        request = self.forward
        if request is None or (not extra_messages and not (self.req.tools and not slot.info.native_tools)):
            return self.body  # (no tools: never a corrective message or tools as text)
        if extra_messages:
            messages = request["messages"]
            for extra in extra_messages:
                messages = with_correction(messages, extra)
            request = {**request, "messages": messages}
        if self.req.tools and not slot.info.native_tools:
            request = text_tools_request(request)
        return encode_run_body(request, slot.link.frame_limit)  # (the node's, within the edge's)

    def run_on(
        self,
        slot: Slot,
        consume: Callable[[Run], Awaitable[T]],
        *,
        metadata: dict[str, str] | None = None,
        extra_messages: list[dict[str, Any]] | None = None,
        keepalive: float = 0.0,
    ) -> Awaitable[T]:
        """Start a run on ``slot`` and ``consume`` it while the service's
        timers enforce its timeouts (await what this returns). Whatever
        happens, the run is closed on the way out. Not a coroutine: it starts
        the run and hands :func:`consume_run` back, so a stream holds no frame
        of this one's."""
        try:
            body = self.request_for(slot, extra_messages or [])
        except BaseException:  # (any: a KeyError here held the node's slot for good)
            self.edge.runs.release(slot)
            raise
        run = self.edge.runs.start(
            slot, body, want=self.want, metadata=metadata or self.metadata, api=self.ex.api, client=self.ex
        )
        self.last_run = run
        self.last_in_earlier = False
        if self.ex.lease is not None:
            self.ex.lease.follow(run, self.estimate + sum(self.earlier))
        structlog.contextvars.bind_contextvars(run_id=run.id)
        return consume_run(run, consume, keepalive)


# A heavy body's request is read and its turn made (its checks, its prompt's estimate and prefix
# chain: 10-20 ms a MB) one at a time, as its body was decoded (edge.openai.request): 400 bodies
# of just under 1 MiB at once, each of them runnable, held /healthz 5.4 s (an outside audit).
_HEAVY_TURNS: trio.lowlevel.RunVar[trio.Semaphore] = trio.lowlevel.RunVar("iop_heavy_turns")


async def one_at_a_time(ex: Exchange, make: Callable[[], T]) -> T:
    """``make()``: for a heavy body's request, one at a time (:data:`_HEAVY_TURNS`)."""
    if ex.body_size < HEAVY_BODY_BYTES:
        return make()
    async with per_run(_HEAVY_TURNS, lambda: trio.Semaphore(1)):
        return make()


async def open_turn(
    edge: Edge,
    ex: Exchange,
    chat: dict[str, Any],
    *,
    converted: bool = False,
    session: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> Turn:
    """The turn for a chat request body (what every front door decodes into):
    validated, with its tools' schemas checked. Raises :class:`APIError` (400).
    ``converted``: the body came from another API's request, whose own items
    the front door held to ``max_messages`` (each tool result becomes a message
    here, so the chat count may be larger; content parts bound it). ``session``: the
    session the front door read from its request, kept to but not sent upstream;
    ``metadata``: its request's metadata (read for the trace flag), likewise."""
    cfg = edge.config
    max_messages = cfg.max_messages + MAX_CONTENT_PARTS if converted else cfg.max_messages

    def make() -> Turn:
        req, forward = parse_chat_request(
            chat,
            max_messages=max_messages,
            max_tools=cfg.max_tools,
            max_output_tokens=cfg.max_output_tokens,
            paired=not converted,
        )
        return Turn(edge, ex, req, forward, session, metadata)

    turn = await one_at_a_time(ex, make)
    req = turn.req
    if turn.contract is not None:
        lane = f"key {ex.key.id}" if ex.key is not None else f"address {(ex.scope.get('client') or ('',))[0]}"
        problem = await turn.contract.check_request(req, lane)
        if problem:
            raise bad_request(problem, "tools")
    await edge.admit(ex, req.model, turn.estimate, req.max_completion_tokens or req.max_tokens)
    return turn


# -- collecting a whole run ----------------------------------------------------


class Collected(msgspec.Struct):
    content: str
    reasoning: str | None
    finish_reason: str
    tool_calls: list[ToolCall] | None
    usage: UsageOut
    normalized: bool = False
    tool_error: str = ""  # a tool call block that could not be read
    stop: str = ""  # the stop sequence that ended the run, when the model server said which
    refusal: str = ""  # the model's refusal (OpenAI's ``refusal``): it declined to answer
    reasoning_len: int = 0  # the reasoning it produced, shown or not (the stream's summary line)
    dropped: bool = False  # text calls past the turn's most_calls were left unread


_FAILURE_TYPES = {OVER_BUDGET: "insufficient_quota", TIMEOUT: "timeout_error"}  # (by the run's cause)


def retry_type(failed: RunFailed) -> str:
    """The error type of a tool retry that failed: ``tool_validation_retry_error``, unless its
    run was cut by the key's budget, which keeps its own (clients act on it: Codex stops on
    ``insufficient_quota`` and retries ``server_error``, which a Responses stream said for a
    budget crossed by a retry; a Messages stream said ``api_error``). A retry that timed out
    says so in its code (``run_timed_out``)."""
    budget = _FAILURE_TYPES[OVER_BUDGET]
    return budget if failed.type == budget else TOOL_VALIDATION_RETRY_ERROR


def failure(event: RunEvent, run: Run) -> RunFailed:
    if run.unserved:  # (in a stream as in its 503: it said "node disconnected", a run_error, with this code)
        lost = lost_unanswered(run.want.model)
        return RunFailed(lost.message, type=lost.type, cause=run.cause or "run_error", status=event.status)
    message = node_error(event.text) or ("run cancelled" if event.type == "cancelled" else "run failed")
    if event.status in (401, 403):
        # The node's own credentials, not the client's: the client is told so, never the
        # provider's words (they can quote the node's key: "Incorrect API key provided: sk-...WXYZ").
        log.warning("model server refused the node's credentials", status=event.status, error=message[:500])
        message = (
            f"The model server refused the node's credentials (HTTP {event.status}); "
            "the edge's operator must fix the node's api_key for this model."
        )
    # A key's budget spent while it ran: the error of its 429 (on Messages, a rate_limit_error;
    # it was an api_error there, a server fault to the SDK: an outside re-audit).
    # A run timed out is a timeout_error in a stream as in its 504 (it was a run_error there).
    type = _FAILURE_TYPES.get(run.cause, "run_error")
    return RunFailed(
        message, type=type, cause=run.cause or "run_error", status=event.status, retry_after=event.retry_after
    )


Hook = Callable[[], Awaitable[None]]


async def collect(turn: Turn, run: Run, *, on_idle: Hook | None = None, on_started: Hook | None = None) -> Collected:
    """Read the run to its end. Raises :class:`RunFailed` if it fails.

    ``on_idle`` is awaited each ``keepalive_s`` the caller has had nothing to
    send (the run may be producing: a buffered stream shows none of it);
    ``on_started`` once, when the run's first event arrives, unless that
    event is its failure."""
    shaper = turn.shaper(live=False)
    keepalive = turn.edge.config.keepalive_s
    idle_at = trio.current_time() + keepalive
    while True:
        if on_idle is None:
            batch = await run.next_batch()
        else:
            batch = None
            with trio.move_on_at(idle_at):
                batch = await run.next_batch()
            if batch is None:
                await on_idle()
                idle_at = trio.current_time() + keepalive
                continue
        if on_started is not None:
            if batch[0].type in (DELTA, REASONING_DELTA, COMPLETE):
                await on_started()
            on_started = None
        end = run.shaped(shaper.take, batch)
        if end is None:
            continue
        if end.type != COMPLETE:
            raise failure(end, run)
        shaper.finish(finish_of(end))
        return _finish(turn, shaper, end, turn.usage_of(run, end))


FINISH_REASONS = frozenset(("stop", "length", "tool_calls", "content_filter"))  # (legacy function_call: none here)


def finish_of(event: RunEvent) -> str:
    """A run's ``finish_reason`` as the OpenAI chat API has them; anything else a node or its model
    server says (none, ``eos``, or a misbehaving node's 50,000 characters, which reached
    clients as they were: an outside audit) is ``stop``."""
    reason = event.finish_reason
    return reason if reason in FINISH_REASONS else "stop"


def end_reason(finish_reason: str, has_calls: bool) -> str:
    """The finish a client sees: ``tool_calls`` when calls came (unless cut off
    by ``length``, the seeds' rule), and never ``tool_calls`` without a call
    (clients look for the calls such an end promises)."""
    if has_calls and finish_reason != "length":
        return "tool_calls"
    if not has_calls and finish_reason == "tool_calls":
        return "stop"
    return finish_reason


def _finish(turn: Turn, shaper: Shaper, event: RunEvent, usage: UsageOut) -> Collected:
    policy = turn.policy
    finish_reason = finish_of(event)
    cut_off = finish_reason == "length"  # what was produced is returned as it is: no retry can help
    content = shaper.content_text
    tool_calls = turn.native_calls(event)
    tool_error = ""
    dropped = False
    if tool_calls and turn.contract is not None:
        content = before_tool_markup(content)  # native calls win: call markup in the text never shows (the seeds' rule)
    elif turn.contract is not None:
        parsed = parse_calls_of(content, shaper.raw_content_text, cut_off, turn.most_calls)
        if parsed.candidate and not (cut_off and (parsed.error or not parsed.calls)):  # a cut-off block stays text
            content = parsed.content
            tool_calls = parsed.calls or None
            tool_error = parsed.error
            dropped = parsed.dropped
    if turn.contract is not None and not tool_calls and not tool_error and not content.strip():
        found = calls_in_reasoning(shaper.reasoning_text, finish_reason, turn.most_calls)  # (no answer: its calls)
        if found is not None:
            tool_calls, tool_error, dropped = found.calls or None, found.error, found.dropped
    finish_reason = end_reason(finish_reason, bool(tool_calls))
    normalized = False
    # Nothing to wrap (hidden reasoning alone, a refusal): an empty completion would tell an
    # XML-tool agent its task is done.
    if policy.strict_output and policy.xml_completion_tool and not tool_calls and content.strip():
        if not holds_xml_tool_use(content, policy.xml_completion_tool):
            content = wrap_in_completion_tool(content, policy.xml_completion_tool)
            normalized = True
    own_block = turn.ex.api != "chat"  # (a Messages thinking block, a Responses reasoning item)
    called = bool(tool_calls or tool_error)  # (an unreadable call is retried: no fallback of its markup)
    fallback = "" if event.refusal else shaper.fallback(finish_reason, called, own_block=own_block)
    if fallback:  # after whitespace content alone: a stream has shown that already, so it stays
        content += fallback
    reasoning = shaper.reasoning_text if shaper.include_reasoning and shaper.reasoning_len else None
    return Collected(
        content,
        reasoning,
        finish_reason,
        tool_calls,
        usage,
        normalized,
        tool_error,
        event.stop,
        event.refusal,
        shaper.reasoning_len,
        dropped,
    )


async def collect_validated(
    turn: Turn, slot: Slot, *, on_idle: Hook | None = None, on_started: Hook | None = None
) -> Collected:
    """Collect a run; if its tool calls are invalid, retry as a new run (attempt
    metadata, a corrective message) up to the configured bound. A run that
    ended with ``finish_reason: "length"`` is returned unvalidated: cut off
    by ``max_tokens``, a retry would be cut off again. ``on_idle`` and
    ``on_started``: see :func:`collect` (each run's first event calls
    ``on_started``: it must be idempotent).

    Raises :class:`RunFailed`: the run's own failure, ``tool_validation_error``
    when attempts run out, ``tool_validation_retry_error`` when a retry fails.
    """
    max_attempts = turn.max_tool_attempts
    attempt = 1
    metadata = turn.metadata
    extra: list[dict[str, Any]] = []
    turn.settle_at_end = True  # a run's usage settles the key's lease only once no retry follows it

    def read(run: Run) -> Awaitable[Collected]:
        run.rerun_if_stalled = not turn.moved
        return collect(turn, run, on_idle=on_idle, on_started=on_started)

    while True:
        try:
            result = await turn.run_on(slot, read, metadata=metadata, extra_messages=extra)
        except RunFailed as failed:
            lost = turn.last_run
            if turn.moves_lost_run(failed.cause):
                # Its node lost (or stalled) mid-run, and the client has seen none of it (collected:
                # keep-alives at most): run it again, once, on a node linked now, as a run lost
                # before its first event moves.
                assert lost is not None
                try:
                    slot = await acquire_keeping_alive(turn, on_idle)
                except APIError as refused:
                    # None linked again: the 503 a queued request gets, unless the edge closed the
                    # link for breaking the protocol or flooding it (its node failed the run: a 502).
                    if refused.code == "no_node_available" and lost.slot.link.close_code not in BROKE_THE_PROTOCOL:
                        raise
                    raise failed from None
                continue
            if attempt > 1:
                message = f"the retry failed: {failed.message}"
                raise RunFailed(message, type=retry_type(failed), cause=failed.cause) from None
            raise
        except APIError as e:  # the retry's body does not fit a frame
            if attempt > 1:
                raise retry_not_started(e) from None
            raise
        # A model that declined (its refusal, no call) declines a forced call too: the refusal
        # goes to the client, as OpenAI's. Cut off by max_tokens, its calls but a cut last one
        # are checked (a retry of a cut-off call alone would be cut off again).
        if turn.contract is None or (result.refusal and not result.tool_calls):
            turn.settle()
            return result
        calls = turn.calls_to_send(result.tool_calls)  # (a call not sent is not checked: it failed the turn)
        # (the first of two is whole: calls past most_calls, dropped here or unread, followed it)
        cut = result.finish_reason == "length" and calls is result.tool_calls and not result.dropped
        reason = result.tool_error or await turn.contract.check_calls(calls, cut)
        if not reason:
            result.tool_calls = calls
            turn.settle()
            return result
        if attempt >= max_attempts:
            turn.invalid_at_last(reason, attempt)
            raise RunFailed(reason, type=TOOL_VALIDATION_ERROR, cause="tool_validation")
        attempt += 1
        metadata, extra = turn.retry_after(reason, result.tool_calls, result.content, attempt)
        try:
            slot = await acquire_keeping_alive(turn, on_idle)
        except APIError as e:
            raise retry_not_started(e) from None


def retry_not_started(refused: APIError) -> RunFailed:
    """A tool retry that could not start (refused a slot, or its body too large), as the
    turn's failure; an operator's cancel of it while it waited in the queue stays that cancel
    (:data:`OPERATOR_CANCELLED`): it was a 502 with no code and no x-should-retry, and the SDKs
    ran the request again, both attempts on the GPU (an outside audit)."""
    if refused.code == "cancelled_by_operator":
        return RunFailed(refused.message, type=OPERATOR_CANCELLED, cause=CANCELLED)
    message = f"the retry could not start: {refused.message}"
    failed = RunFailed(message, type=TOOL_VALIDATION_RETRY_ERROR, cause="retry_failed")
    if refused.status in (429, 503):  # (its queue timed out or was full, the edge drains, no node)
        # Told before anything was sent, it is that refusal with its Retry-After, as a request
        # queued itself is told (a 502 of no code: an outside re-check); in a stream, as before.
        failed.refusal = APIError(refused.status, message, refused.type, code=refused.code, headers=refused.headers)
    return failed


async def acquire_keeping_alive(turn: Turn, on_idle: Hook | None) -> Slot:
    """A slot for a retry. The stream has started by then, so while the
    retry waits in the queue the client gets keep-alive comments."""
    if on_idle is None:
        return await turn.acquire()
    keepalive = turn.edge.config.keepalive_s
    error: APIError | None = None
    slot: Slot | None = None

    async def keep_alive() -> None:
        while True:
            await trio.sleep(keepalive)
            await on_idle()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(keep_alive)
            try:
                slot = await turn.acquire()
            except APIError as e:  # raised below, unwrapped
                error = e
            nursery.cancel_scope.cancel()
    except BaseException:
        # The slot was taken, then the nursery's exit raised: the client's disconnect came in
        # that instant (its cancel, from the keep-alive task, outlives the nursery's own), or a
        # keep-alive write failed. No run will hold it: give it back (it was held for good, and
        # a node of one slot answered every request after that 429).
        if slot is not None:
            turn.edge.runs.release(slot)
        raise
    if error is not None:
        try:
            raise error
        finally:
            error = None  # (its traceback holds this frame: a cycle that held the turn's exchange)
    assert slot is not None
    return slot
