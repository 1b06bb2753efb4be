"""Turning run events into what the client sees: content and reasoning.

A :class:`Shaper` is made per response. In *live* mode it splits think tags
as text arrives and hands content and reasoning to callbacks at once; in
*collect* mode it keeps everything and decides at the end (so an unmatched
``</think>`` can move the text before it into reasoning).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import structlog

from edge.config import ModelPolicy
from edge.openai.filters import (
    DEFAULT_SENTINELS,
    THINK_CLOSE,
    THINK_CLOSE_RE,
    THINK_OPEN,
    THINK_OPEN_RE,
    FirstThinkTag,
    SentinelFilter,
    ThinkSplitter,
    ignore_text,
    template_head,
)
from proto import RunEvent
from proto.frames import DELTA, REASONING_DELTA

Around = Callable[[str, str, Callable[[str], None]], None]

log = structlog.get_logger()

MAX_TEMPLATE_MODELS = 4096  # names a TemplateThink remembers (a node's names are bounded, not all nodes')
# Switches between reasoning and content one streamed answer may show: past them the rest of
# its reasoning is not shown (its content is). Each switch is an output item (Responses) or a
# content block (Messages) the client is sent and the edge keeps to the answer's end: a model
# server alternating `reasoning_content` and `content` a chunk each made 40,000 items, 83 MB
# to the client and 70 MB of edge memory from 2.1 MB. (Think tags stop at as many: filters.)
MAX_REASONING_SWITCHES = 1024


class TemplateThink:
    """The models whose chat template opens ``<think>`` itself (DeepSeek-R1's,
    Qwen3 thinking's): their answers start inside reasoning and show only its
    ``</think>``. With ``think_tags = "auto"`` a whole answer is split right
    whatever it shows, but a live stream's text has gone out before its
    ``</think>`` comes. So an edge learns such a model from an answer that
    shows a ``</think>`` before any ``<think>``, and the model's next live
    streams hold their head, as a strict model's do, until it shows its
    reasoning ended (``</think>``: reasoning, then live content), starts with
    ``<think>``, or the run ends (then it is content): split as its whole
    answer is, nothing sent twice. A model learned wrong (an answer that only
    quoted the tag) costs streams their liveness until its next answer that
    ends (``stop``) with no ``</think>`` unlearns it."""

    __slots__ = ("_models",)

    def __init__(self) -> None:
        self._models: set[str] = set()

    def opens(self, model: str) -> bool:
        return model in self._models

    def learn(self, model: str) -> None:
        models = self._models
        if model not in models and len(models) < MAX_TEMPLATE_MODELS:
            models.add(model)
            log.info("think tags: the model's template opens <think>; its streams hold reasoning", model=model)

    def unlearn(self, model: str) -> None:
        if model in self._models:
            self._models.discard(model)
            log.info("think tags: the model answered without </think>; its streams are live again", model=model)


class Shaper:
    __slots__ = (
        "policy",
        "include_reasoning",
        "emit_reasoning",
        "_content_filter",
        "_reasoning_filter",
        "_think",
        "_on_content",
        "_on_reasoning",
        "_live",
        "content_parts",
        "reasoning_parts",
        "content_len",
        "reasoning_len",
        "has_content",
        "_held",
        "_first_tag",
        "_template",
        "_model",
        "_watch",
        "_learned_hold",
        "_fielded",
        "_open_head",
        "_unclosed",
        "_closed",
        "_showing_reasoning",
        "_switches",
        "_raw_parts",
    )

    def __init__(
        self,
        policy: ModelPolicy,
        *,
        include_reasoning: bool,
        live: bool,
        on_content: Callable[[str], None] = ignore_text,
        on_reasoning: Callable[[str], None] = ignore_text,
        template: TemplateThink | None = None,
        model: str = "",
        keep_raw: bool = False,
    ) -> None:
        self.policy = policy
        # ``keep_raw`` (a request with tools): the content as the model wrote it, before any filter
        # (its tool calls are read from it: :func:`~edge.openai.tools.parse_calls_of`).
        self._raw_parts: list[str] | None = [] if keep_raw else None
        self.include_reasoning = include_reasoning and not policy.strict_output
        self.emit_reasoning = self.include_reasoning
        sentinels = (*DEFAULT_SENTINELS, *policy.sentinels) if policy.default_sentinels else tuple(policy.sentinels)
        self._content_filter = SentinelFilter(sentinels)
        self._reasoning_filter = SentinelFilter(sentinels)
        self._on_content = on_content
        self._on_reasoning = on_reasoning
        self._live = live
        # Live think tags are split by a ThinkSplitter, made at the first "<" unless the stream
        # starts inside reasoning: until then text passes as it would through one (a stream that
        # never has a tag, most of them, holds and calls none).
        self._think: ThinkSplitter | None = None
        auto = policy.think_tags == "auto"
        self._template = template if auto else None
        self._model = model
        # A live stream of a model whose template opens <think> (learned: TemplateThink) holds its
        # head as a strict one does (below); one of a model not known to, watches its text for a
        # </think> before any <think> ("": watching, nothing partial; None: not watching).
        self._learned_hold = live and auto and template is not None and template.opens(model)
        self._unclosed = False  # the run ended with its head still held: no </think> came
        self._fielded = False  # reasoning came in its own field: the model server parts it
        self._closed = False  # a held head ended at its </think>: another in the answer is the answer's
        self._watch: str | None = "" if live and auto and template is not None and not self._learned_hold else None
        # think_tags "open": the content starts inside reasoning, unless reasoning comes first in its
        # own field (the model server parts them: its answer was taken for reasoning, an outside audit)
        self._open_head = live and policy.think_tags == "open"
        if self._open_head:
            self._think = ThinkSplitter(self._content_out, self._reasoning_out, starts_open=True, calls=keep_raw)
        # A strict live stream with think_tags "auto" holds its content until its first think tag
        # (outside tool-call blocks) shows, or it ends: a </think> first says the template consumed
        # <think>, so the head is reasoning, and strict reasoning never leaves the edge. Not if
        # reasoning came first in its own field: the model server parts them.
        self._held: list[str] | None = [] if auto and (live and policy.strict_output or self._learned_hold) else None
        # (what the held text is read with: its first think tag, past any call block)
        self._first_tag = FirstThinkTag(calls=keep_raw) if self._held is not None else None
        self.content_parts: list[str] = []
        self.reasoning_parts: list[str] = []
        self.content_len = 0
        self.reasoning_len = 0
        self.has_content = False
        self._showing_reasoning = False  # a live stream's last text shown was reasoning
        self._switches = 0  # between reasoning and content, shown

    # -- input -------------------------------------------------------------

    def content(self, text: str) -> None:
        if self._open_head and not text.isspace():
            self._open_head = False
        if self._raw_parts is not None:
            self._raw_parts.append(text)
        # (no sentinel spans the two: a "<" that ended the reasoning is its end, not held to the answer's)
        if self._reasoning_filter.pending and (rest := self._reasoning_filter.flush()):
            self._reasoning_out(rest)
        text = self._content_filter.append(text)
        if text:
            self._filtered(text)

    def _filtered(self, text: str) -> None:
        """Content past the sentinel filter."""
        if self._held is not None:
            self._hold(text)
            return
        self._shape_content(text)

    def _shape_content(self, text: str) -> None:
        if self._watch is not None and ("<" in text or self._watch):
            self._watch_tags(text)
        if self._think is None and ("<" in text or self._raw_parts is not None and "{" in text):
            self._split_think()  # (a "{": a call block of the other form, {{tool_call}})
        if self._think is not None:
            self._think.append(text)
        elif self._live:
            self._content_out(text)
        else:
            self.content_parts.append(text)

    def _hold(self, text: str) -> None:
        """A held live stream's head (see ``_held``), one more piece of it: held until its first
        think tag, outside tool-call blocks, as a whole answer is read (:func:`template_head`).
        A </think> ends the reasoning the template opened; a <think> (anywhere: text before it
        is the answer's) says the tags are as written, and the live splitter moves them."""
        held = self._held
        assert held is not None
        held.append(text)
        first = self._first_tag.feed(text)  # type: ignore[union-attr]  # (made with _held)
        if first is None:
            return
        if first[0] == THINK_OPEN:
            self._release()
            return
        whole = "".join(held)
        at = first[1]
        self._held = None
        self._closed = True
        self._learned()
        self._reasoning_out(whole[:at])
        rest = whole[at + len(THINK_CLOSE) :]
        if rest:
            self._shape_content(rest)

    def abandon(self) -> None:
        """The run failed: the head a learned stream holds goes out as reasoning, if the client
        shows reasoning (it may be; never as content), before the error; it was dropped."""
        if self._learned_hold and self._held:
            held, self._held = self._held, None
            self._reasoning_out("".join(held))

    def _watch_tags(self, text: str) -> None:
        """A live stream's text, for its first think tag: a </think> before any <think>
        teaches the edge that the model's template opens it (:class:`TemplateThink`)."""
        scan = self._watch + text  # type: ignore[operator]  # (watching: a str)
        close = THINK_CLOSE_RE.search(scan)
        if THINK_OPEN_RE.search(scan, 0, close.start() if close is not None else len(scan)) is not None:
            self._watch = None  # tags as written: nothing to learn
        elif close is not None:
            self._watch = None
            self._learned()
        else:
            tail = scan[-(len(THINK_CLOSE) - 1) :]
            self._watch = tail if "<" in tail else ""

    def _learned(self) -> None:
        if self._template is not None:
            self._template.learn(self._model)

    def _release(self) -> None:
        """The held head is content after all (or starts with its own <think>)."""
        held, self._held = self._held, None
        if held:
            self._shape_content("".join(held))

    def _split_think(self) -> None:
        """Text with a "<" in a live stream whose think tags are on: split from here."""
        if self._live and self.policy.think_tags != "off":
            calls = self._raw_parts is not None
            # (a </think> before any think tag: the template opened it; with think_tags "open", not
            # once the model server parted the reasoning itself: a whole answer keeps such a tag as
            # written then, and a stream dropped it, with what came before it not yet passed on)
            # (nor, with think_tags "auto", once the model server parted reasoning: a whole answer
            # read the text before such a tag as reasoning, a stream only the part not passed on,
            # so what a client saw hung on where the deltas split: an outside audit)
            stray = not (self._closed or self._fielded)
            self._think = ThinkSplitter(self._content_out, self._reasoning_out, calls=calls, stray_close=stray)

    def reasoning(self, text: str) -> None:
        if not (self._fielded or self._live):
            mode = self.policy.think_tags
            if self.content_parts:
                if mode == "open" and "".join(self.content_parts).strip():
                    self._opened_head()
                elif mode == "auto" and not self.policy.strict_output and self._template is not None:
                    self._released_head()
            if self._think is None and mode != "off":
                self._split_from_here()
        self._fielded = True
        self._watch = None  # (its content is the answer: a </think> in it teaches nothing)
        if self._open_head:  # (no content yet: the answer, when it comes, is the answer)
            self._open_head, self._think = False, None
        elif self._think is not None:
            self._think.parted()  # (content came first: from here it is the answer)
        if self._held == []:  # the model server parts reasoning from content itself: nothing to hold
            self._held = None
        elif self._held:
            # (content came first, held as the reasoning a learned template opens, or a strict
            # model's head: the model server parts them, so it is the answer, as a whole answer
            # reads it; it was held to the end and given as reasoning, the answer's order lost,
            # and a strict model's, cut by max_tokens, was dropped: outside audits)
            self._release()
        if self._content_filter.pending and (rest := self._content_filter.flush()):  # (as in content())
            self._filtered(rest)
        text = self._reasoning_filter.append(text)
        if text:
            self._reasoning_out(text)

    def _split_from_here(self) -> None:
        """A whole answer (think tags on), the model server's first reasoning of its own
        field: the content so far is read as it would be at the end ("auto": a </think> first is the
        template's: reasoning to it, call blocks too), and the content from here is split as it
        comes, as a live stream splits it, so that the reasoning in its tags keeps its place
        among the server's (it was split at the end: ``<think>A</think>B`` then "R" was
        reasoning "RA" whole and "AR" streamed; an outside audit). A </think> from here, before
        any <think>, is the answer's, as written: the server parts reasoning itself."""
        calls = self._raw_parts is not None
        raw = "".join(self.content_parts)
        self.content_parts = []
        at = template_head(raw, calls) if raw and self.policy.think_tags == "auto" else -1
        if at >= 0:
            self._learned()
            if at:
                self._reasoning_out(raw[:at])
            raw = raw[at + len(THINK_CLOSE) :]
        self._think = ThinkSplitter(self._content_out, self._reasoning_out, calls=calls)
        if raw:
            self._think.append(raw)

    def _opened_head(self) -> None:
        """think_tags "open", a whole answer: the content before the model server's first
        reasoning of its own field is the reasoning the template opened (to its </think>), as a
        live stream gives it (:meth:`ThinkSplitter.parted`); it was the answer (found from outside)."""
        raw, self.content_parts = "".join(self.content_parts), []
        splitter = ThinkSplitter(
            self._content_out, self._reasoning_out, starts_open=True, calls=self._raw_parts is not None
        )
        splitter.append(raw)
        splitter.parted()
        splitter.flush()

    def _released_head(self) -> None:
        """A whole answer of a model whose template opens <think> (learned), its server's own
        reasoning after content with no think tag yet: as a live stream releases the head it
        holds then (:meth:`reasoning`), the content so far is the answer, and what comes after
        is read as a live stream reads it, a </think> first being the template's (a re-check
        found the two apart: the whole answer read the tags of all of it as its head)."""
        calls = self._raw_parts is not None
        raw = "".join(self.content_parts)
        if not self._template.opens(self._model) or FirstThinkTag(calls=calls).feed(raw) is not None:  # type: ignore[union-attr]
            return  # (a live stream holds no head then: the tags are read in the whole, at its end)
        self.content_parts = []
        self._think = ThinkSplitter(self._content_out, self._reasoning_out, calls=calls, stray_close=not self._closed)
        self._think.append(raw)

    def take(self, events: list[RunEvent], around: Around | None = None) -> RunEvent | None:
        """Shape a batch of run events in order, up to the one that ended the
        run (complete, error, cancelled), which is returned (None: the run goes
        on). Consecutive deltas of one kind are shaped as one text: what was
        queued together becomes one chunk (never waited for). ``around(kind,
        text, shape)``, if given, wraps each shaping call (stream tracing)."""
        i, n = 0, len(events)
        while i < n:
            event = events[i]
            kind = event.type
            if kind == DELTA:
                shape = self.content
            elif kind == REASONING_DELTA:
                shape = self.reasoning
            else:
                return event
            j = i + 1
            while j < n and events[j].type == kind:
                j += 1
            text = event.text if j == i + 1 else "".join([e.text for e in events[i:j]])
            i = j
            if around is None:
                shape(text)
            else:
                around("content" if kind == DELTA else "reasoning", text, shape)
        return None

    def finish(self, finish_reason: str = "") -> None:
        """Flush every filter; in collect mode, split think tags now. ``finish_reason``: the
        run's; one cut by ``length`` before the </think> of a model whose template opens
        <think> (learned) was cut in its reasoning: the text is reasoning, never content (it
        went out as content: a strict model's client read the whole chain of thought, one
        with an XML completion tool read it as the task's result; found from outside)."""
        rest = self._content_filter.flush()
        if self._held is not None:
            if rest:
                self._held.append(rest)
            self._unclosed = bool(self._held)
            if self._learned_hold and finish_reason == "length":
                held, self._held = self._held, None
                if held:
                    self._reasoning_out("".join(held))
            else:
                self._release()
            rest = self._content_filter.flush()
        if self._think is None and ("<" in rest or self._raw_parts is not None and "{" in rest):
            self._split_think()
        if self._think is not None:
            if rest:
                self._think.append(rest)
            self._think.flush()
        elif self._live:
            if rest:
                self._content_out(rest)
        else:
            if rest:
                self.content_parts.append(rest)
            raw = "".join(self.content_parts)
            self.content_parts = []
            mode = self.policy.think_tags
            if mode != "off":
                # Opened by the template when the first </think> comes before any <think> (an
                # answer that then names <think> itself no longer hid that: the reasoning leaked):
                # reasoning to it, as a live stream holding its head splits it (think tags in a
                # call block before it were taken for the end: a re-check found them apart).
                calls = self._raw_parts is not None
                at = template_head(raw, calls) if mode == "auto" else -1
                if at < 0 and self._untagged_of_learned(raw, calls):
                    if finish_reason == "length":
                        at = len(raw)  # (all of it reasoning, as a live stream's held head: above)
                        raw += THINK_CLOSE
                    elif finish_reason == "stop":  # answered without thinking: unlearned, as a live stream is
                        self._template.unlearn(self._model)  # type: ignore[union-attr]  # (checked)
                if at >= 0:
                    self._learned()
                    if at:
                        self._reasoning_out(raw[:at])
                    raw = raw[at + len(THINK_CLOSE) :]
                opened = mode == "open" and not self._fielded
                splitter = ThinkSplitter(self._content_out, self._reasoning_out, starts_open=opened, calls=calls)
                splitter.append(raw)
                splitter.flush()
            elif raw:
                self._content_out(raw)
        rest = self._reasoning_filter.flush()
        if rest:
            self._reasoning_out(rest)

    def _untagged_of_learned(self, raw: str, calls: bool) -> bool:
        """A whole answer with no think tag (outside call blocks, as a held head is read) of a
        model whose template opens <think> (learned), and no reasoning of its own field (the
        model server parted it: its content is the answer; it was taken for reasoning, a
        re-check found): cut by ``length``, it was cut in its reasoning; ended by ``stop``, the
        model answered without thinking (a model only ever collected stayed learned wrong)."""
        template = self._template
        return (
            template is not None
            and not self._fielded
            and template.opens(self._model)
            and FirstThinkTag(calls=calls).feed(raw) is None
        )

    # -- output ------------------------------------------------------------

    def _content_out(self, text: str) -> None:
        self.content_len += len(text)
        if self._showing_reasoning:
            self._showing_reasoning = False
            self._switches += 1
        if not self.has_content and not text.isspace():
            self.has_content = True
            if self._live:  # the only use of a live stream's reasoning text, the fallback, is gone
                self.reasoning_parts = []
        if self._live:
            self._on_content(text)
        else:
            self.content_parts.append(text)

    def _reasoning_out(self, text: str) -> None:
        self.reasoning_len += len(text)
        if not (self._live and (self.has_content or self._switches > MAX_REASONING_SWITCHES)):
            # Kept for :meth:`fallback` until a live stream has content (a reasoning model's
            # thousands of deltas would otherwise stay in memory to its end) or passed the
            # switches (what was not shown is not shown as the answer either), and always when
            # collecting.
            self.reasoning_parts.append(text)
        if self.emit_reasoning and self._live:
            if not self._showing_reasoning:
                self._switches += 1
                if self._switches > MAX_REASONING_SWITCHES:
                    self.emit_reasoning = False
                    self.reasoning_parts = []  # (no fallback of it: whitespace content is the answer)
                    log.warning(
                        "reasoning: the answer switched to it too often; the rest is not shown",
                        model=self._model,
                        switches=MAX_REASONING_SWITCHES,
                    )
                    return
                self._showing_reasoning = True
            self._on_reasoning(text)

    # -- results -----------------------------------------------------------

    @property
    def content_text(self) -> str:
        return "".join(self.content_parts)

    @property
    def raw_content_text(self) -> str | None:
        """The content as the model wrote it, but its think blocks (None: not kept): what its
        calls are read from. A call the model wrote inside ``<think>`` is its reasoning, not a
        call (it was made one, its arguments sent even when strict output hid the reasoning)."""
        if self._raw_parts is None:
            return None
        raw = "".join(self._raw_parts)
        mode = self.policy.think_tags
        if mode == "off" or "<" not in raw:
            return raw
        kept: list[str] = []
        if mode == "auto" and (at := template_head(raw, calls=True)) >= 0:
            raw = raw[at + len(THINK_CLOSE) :]  # (reasoning the template opened, as the content is split)
        splitter = ThinkSplitter(kept.append, ignore_text, starts_open=mode == "open", calls=True)
        splitter.append(raw)
        splitter.flush()
        return "".join(kept)

    @property
    def reasoning_text(self) -> str:
        """All the reasoning (live: only until the stream has content)."""
        return "".join(self.reasoning_parts)

    def fallback(self, finish_reason: str, has_tool_calls: bool, *, own_block: bool = False) -> str:
        """Content for a run that produced reasoning but no answer ("" if none is due).
        ``own_block``: the API shows shown reasoning in a block of its own (a Messages
        ``thinking`` block, a Responses reasoning item), so it is not copied into the
        answer as well (it showed twice: an outside audit); chat's ``reasoning_content``
        is a field many clients never show, so chat gets the copy (the seeds' rule)."""
        if self._learned_hold and self._unclosed and finish_reason == "stop" and self._template is not None:
            # Held as learned, and no </think> came: the model answered without thinking (or an
            # answer that only quoted the tag taught the edge wrong). Its streams are live again.
            self._template.unlearn(self._model)
        if self.policy.strict_output or self.has_content or has_tool_calls:
            return ""
        reasoning = self.reasoning_text
        if not reasoning.strip():
            return ""
        if self.include_reasoning:
            return "" if own_block else reasoning
        return hidden_reasoning_notice(finish_reason)


def hidden_reasoning_notice(finish_reason: str) -> str:
    return (
        "The model produced only hidden reasoning and no answer "
        f"(finish_reason: {finish_reason}); try again with a larger max_tokens."
        if finish_reason == "length"
        else f"The model produced only hidden reasoning and no answer (finish_reason: {finish_reason})."
    )


_XML_TAG = re.compile(r"<(/?)([a-z][a-z0-9]*(?:_[a-z0-9]+)+)>")


def holds_xml_tool_use(text: str, completion_tool: str) -> bool:
    """An XML tool use: a snake_case element (``<read_file>…</read_file>``)
    or the completion tool's own element. One pass over the tags (a pattern
    with a back-reference rescanned to the end for every opening tag: 150k
    characters of ``<a_b>`` held the edge 17 s)."""
    if completion_tool and f"<{completion_tool}>" in text:
        return True
    first_open: dict[str, int] = {}
    for tag in _XML_TAG.finditer(text):
        name = tag.group(2)
        if not tag.group(1):
            first_open.setdefault(name, tag.end())
        elif first_open.get(name, len(text)) <= tag.start():
            return True
    return False


def wrap_in_completion_tool(text: str, tool: str) -> str:
    return f"<{tool}>\n<result>\n{text.strip()}\n</result>\n</{tool}>"
