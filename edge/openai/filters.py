"""Streaming text filters: leaked special tokens and think tags.

Both are incremental and split-invariant: feeding a text in any number of
pieces yields the same output as feeding it whole (tests check this with
hypothesis). Each holds back at most the longest partial token/tag.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable

# Special tokens of the common chat templates that leak into text when a model
# server does not strip them.
DEFAULT_SENTINELS: tuple[str, ...] = (
    # ChatML (Qwen, Yi, many fine-tunes)
    "<|im_end|>",
    "<|im_start|>",
    "<|endoftext|>",
    # Llama 3
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|python_tag|>",  # (before a built-in tool's call; leaked as text, found from outside)
    # Mistral (its tokenizers' v3 and later control tokens; a server with no tool parser leaves a
    # call's [TOOL_CALLS] in the text, as Llama 3's <|python_tag|>)
    "</s>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    # Gemma
    "<end_of_turn>",
    "<start_of_turn>",
    "<eos>",
    # gpt-oss (harmony), Phi
    "<|start|>",
    "<|end|>",
    "<|return|>",
    "<|message|>",
    "<|channel|>",
    "<|call|>",
    "<|constrain|>",
    # DeepSeek (V3, R1: its turns, and the tool-call tokens a server with no tool parser leaves)
    "<｜end▁of▁sentence｜>",
    "<｜begin▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
)


class _Prepared:
    """A sentinel list, longest first; their first characters; one pattern
    of them all (an alternative matches where the scan by hand would: the
    longest at the leftmost position); the longest's length."""

    __slots__ = ("sentinels", "starts", "pattern", "longest")

    def __init__(self, sentinels: tuple[str, ...]) -> None:
        uniq = sorted({s for s in sentinels if s}, key=len, reverse=True)
        self.sentinels = tuple(uniq)
        self.starts = frozenset(s[0] for s in uniq)
        self.pattern = re.compile(_trie_pattern(uniq)) if uniq else None
        self.longest = len(uniq[0]) if uniq else 0


def _trie_pattern(words: Iterable[str]) -> str:
    """One regex of ``words`` as a trie: at a position, one character is
    tried against each branch (not every word against the text), and the
    longest word that matches there is the match (an ending is optional,
    tried after the longer words that go on)."""
    trie: dict = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def pattern(node: dict) -> str:
        branches = [re.escape(ch) + pattern(child) for ch, child in node.items() if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        if "" in node:
            return "(?:" + body + ")?"
        return body

    return pattern(trie)


@functools.lru_cache(maxsize=64)
def _prepared(sentinels: tuple[str, ...]) -> _Prepared:
    """One copy for every stream with the same list (a stream holds two
    filters; the list is per model)."""
    return _Prepared(sentinels)


class SentinelFilter:
    """Removes sentinel strings from a stream of text.

    Semantics (left to right): at each position, a sentinel that starts there
    is dropped (the longest if several do); otherwise the character is kept.
    Text that could still become a sentinel stays pending until the next
    :meth:`append` or :meth:`flush`.
    """

    __slots__ = ("_prepared", "_starts", "_pending")

    def __init__(self, sentinels: Iterable[str]) -> None:
        self._prepared = prepared = _prepared(tuple(sentinels))
        self._starts = prepared.starts
        self._pending = ""

    def append(self, text: str) -> str:
        if not self._pending:
            # Fast path: no character that can start a sentinel.
            starts = self._starts
            for ch in starts:
                if ch in text:
                    break
            else:
                return text
            buf = text
        else:
            buf = self._pending + text
            self._pending = ""
        return self._scan(buf, final=False)

    def flush(self) -> str:
        buf, self._pending = self._pending, ""
        return self._scan(buf, final=True) if buf else ""

    @property
    def pending(self) -> bool:
        """Text is held that could still begin a sentinel."""
        return bool(self._pending)

    def _scan(self, buf: str, *, final: bool) -> str:
        """The sentinels found by one pattern, in C, up to where one could still
        be partial (the last ``longest - 1`` characters, when not final); those
        by hand. (By hand alone, each of 25 sentinels tried at every ``<``: a
        model's 1 MiB of ``<`` held the loop 2.5 s, and other streams with it.)"""
        prepared = self._prepared
        out: list[str] = []
        n = len(buf)
        cut = n if final else max(0, n - prepared.longest + 1)
        i = emit_from = 0
        if cut and prepared.pattern is not None:  # (a short delta: all of it by hand)
            for found in prepared.pattern.finditer(buf):
                start = found.start()
                if start >= cut:
                    break
                out.append(buf[emit_from:start])
                i = emit_from = found.end()
        if final:
            out.append(buf[emit_from:])
            return "".join(out)
        i = max(i, cut)
        starts = self._starts
        sentinels = prepared.sentinels
        while i < n:
            if buf[i] not in starts:
                i += 1
                continue
            rest_len = n - i
            matched = 0
            partial = False
            for s in sentinels:
                if len(s) <= rest_len:
                    if buf.startswith(s, i):
                        matched = len(s)
                        break
                elif not final and s.startswith(buf[i:]):
                    partial = True
                    break
            if partial:
                out.append(buf[emit_from:i])
                self._pending = buf[i:]
                return "".join(out)
            if matched:
                out.append(buf[emit_from:i])
                i += matched
                emit_from = i
            else:
                i += 1
        out.append(buf[emit_from:])
        return "".join(out)


THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# ASCII case folding only: a match's offsets are the text's own (str.lower can change a length).
THINK_OPEN_RE = re.compile(THINK_OPEN, re.IGNORECASE | re.ASCII)
THINK_CLOSE_RE = re.compile(THINK_CLOSE, re.IGNORECASE | re.ASCII)
# Think tags one answer may switch on: past them the rest is content as written. Each switch
# is a chunk (or an output item) of its own: one 7 MiB delta of `<think>x</think>y` was
# 0.9 million chunks, 192 MB to the client, 847 MB of edge memory and a 1.9 s stall.
MAX_THINK_TAGS = 1024


# A request with tools: a tool-call block written as text is the call's, think tags inside it
# too (a file holding "<think>" moved the rest of the call, and the answer after it, into the
# reasoning). Its end is the closing tag outside the JSON's strings, as the calls are read.
_CALL_OPENS = ("<tool_call>", "{{tool_call}}")
_OPEN_OR_CALL_RE = re.compile("|".join(map(re.escape, (THINK_OPEN, *_CALL_OPENS))), re.IGNORECASE | re.ASCII)
# Before any think tag of a live stream (``stray_close``): a </think> too, which says the template opened it.
# Text ending in part of one is held whole until the tag is known, up to this many characters (each
# piece is searched with what is held: 32,000 deltas of "a<", held whole, took 6.5 s; now 0.3 s,
# against 0.05 s holding only the tag's part).
MAX_FIRST_HELD = 1024
_FIRST_TAGS = {False: (THINK_OPEN, THINK_CLOSE), True: (THINK_OPEN, THINK_CLOSE, *_CALL_OPENS)}
_FIRST_RE = {
    calls: re.compile("|".join(map(re.escape, tags)), re.IGNORECASE | re.ASCII) for calls, tags in _FIRST_TAGS.items()
}
CALL_CLOSES = {"<": "</tool_call>", "{": "{{/tool_call}}"}  # by a block's first character
# A call block's body begins so, past whitespace (JSON), or as CALL_BODY_XML (Qwen3-Coder's
# <function=...>, read as a call that cannot be read, and so retried): an opening tag followed by
# anything else is prose that names it ("wrap calls in a <tool_call> tag"; "<tool_call></tool_call>"
# and "<tool_call><name>" were read as calls, retried and failed: an outside audit), for the
# splitter as for the calls' reader (edge.openai.tools).
CALL_BODY_FIRST = "{["
CALL_BODY_XML = "<function="
MAX_CALL_GAP = 1024  # whitespace between the tag and its body's first character; past it, prose
_SPACES = re.compile(rf"\s{{0,{MAX_CALL_GAP + 1}}}+")
# A block's body, read as JSON reads it, up to its closing tag outside strings: its text, its whole
# strings (escapes in them), and a "<" (a "{") that does not begin the closing tag. Possessive
# throughout: one pass in C, whatever the text (a Python step per quote was seconds for a delta of
# quotes). ``string`` says how a string may end: at its quote only (as it streams, one not closed
# yet stops the body there), or at the text's end too (a whole text's last block).
_STRING_TEXT = r'(?:[^"\\]++|\\.)*+'


def call_body(first: str, string: str = '"' + _STRING_TEXT + '"') -> re.Pattern[str]:
    other = re.escape(first)
    close = re.escape(CALL_CLOSES[first][1:])
    return re.compile(rf'(?:[^"{other}]++|{string}|{other}(?!{close}))*+', re.IGNORECASE | re.ASCII | re.DOTALL)


_BODY_RE = {first: call_body(first) for first in CALL_CLOSES}
_STRING_TEXT_RE = re.compile(_STRING_TEXT, re.DOTALL)


class ThinkSplitter:
    """Moves ``<think>…</think>`` text out of content into reasoning.

    ``starts_open``: the chat template already consumed ``<think>`` so the
    stream begins inside reasoning; a ``<think>`` the model writes anyway
    before any other text (whitespace aside) is dropped, not passed on as
    reasoning. Tags match case-insensitively; a partial tag at the end of a
    piece is held back. Output goes to the two callbacks. Past
    :data:`MAX_THINK_TAGS` tags the rest is content, tags as written.
    ``calls`` (a request with tools): a tool-call block in the content is
    content as written, think tags inside it too. ``stray_close`` (a live
    stream, not known to start open): a ``</think>`` before any think tag
    says the template opened the reasoning after all, as a whole answer
    reads it; the tag is dropped and the text before it not yet passed on is
    reasoning (what was is content: it went out), and text that ends in a
    part of one is held until the tag is known (up to :data:`MAX_FIRST_HELD`
    characters). A think tag ends the watch; a call block does not (a call
    that went out stays one: a live stream cannot take it back).
    """

    __slots__ = (
        "_in_think",
        "_head",
        "_pending",
        "_content",
        "_reasoning",
        "_tags",
        "_calls",
        "_call",
        "_quoted",
        "_escaped",
        "_first",
    )

    def __init__(
        self,
        content: Callable[[str], None],
        reasoning: Callable[[str], None],
        *,
        starts_open: bool = False,
        calls: bool = False,
        stray_close: bool = False,
    ) -> None:
        self._in_think = starts_open
        self._first = stray_close and not starts_open  # no think tag yet, and a </think> would be one
        self._head = starts_open  # still before the first text of an open stream
        self._pending = ""
        self._content = content
        self._reasoning = reasoning
        self._tags = 0  # switched on so far
        self._calls = calls
        self._call = ""  # inside a call block: its first character ("<" or "{"), which says its closing tag
        self._quoted = False  # inside one of its JSON strings
        self._escaped = False  # right after a backslash there

    def parted(self) -> None:
        """The model server parts reasoning from content itself (reasoning came in its own
        field): a stream still in the reasoning it started in (``starts_open``, no tag yet)
        leaves it, what it held going out as that reasoning; the rest is the answer, and a
        ``</think>`` before any think tag in it is no longer one (``stray_close``)."""
        self._first = False
        if self._in_think and not self._tags:
            if self._pending:
                self._reasoning(self._pending)
                self._pending = ""
            self._in_think = self._head = False

    def append(self, text: str) -> None:
        if self._head:
            text = self._past_head(text)
            if text is None:
                return
        if (
            not self._pending
            and not self._call
            and ("<" not in text and (not self._calls or "{" not in text) or self._tags > MAX_THINK_TAGS)
        ):
            if text:
                (self._reasoning if self._in_think else self._content)(text)
            return
        buf = self._pending + text
        self._pending = ""
        at = 0  # (one pass over buf: a search from the start for each tag was quadratic in tags)
        while True:
            if self._call:
                at = self._through_call(buf, at)
                if at < 0:
                    return
                continue
            if self._in_think:
                tag = THINK_CLOSE_RE
            elif self._first:
                tag = _FIRST_RE[self._calls]
            else:
                tag = _OPEN_OR_CALL_RE if self._calls else THINK_OPEN_RE
            found = tag.search(buf, at)
            if found is not None and not self._in_think and found.end() - found.start() != len(THINK_OPEN):
                if buf[found.start() + 1] != "/":  # a call's opening tag: the answer, past any reasoning
                    body = _body_start(buf, found)
                    if body is None:  # (its body's first character not come yet: held from the tag)
                        self._emit(buf[at : found.start()])
                        self._pending = buf[found.start() :]
                        return
                    if not body:  # prose that names the tag
                        self._emit(buf[at : found.end()])
                        at = found.end()
                        continue
                    self._emit(buf[at : found.end()])
                    self._call = buf[found.start()]
                    at = found.end()  # (the watch goes on past it, as a whole answer reads the first
                    continue  # think tag past call blocks: a </think> after a call went out as text)
                if found.start() > at:  # (a </think> before any think tag: the head was reasoning)
                    self._reasoning(buf[at : found.start()])
                self._first = False
                self._tags += 1
                at = found.end()
                continue
            if found is not None:
                self._first = False
                self._emit(buf[at : found.start()])
                self._tags += 1
                if self._tags > MAX_THINK_TAGS:  # the rest as written (append passes it on at once)
                    self._in_think = False
                    self._content(buf[found.start() :])
                    return
                at = found.end()
                self._in_think = not self._in_think
                continue
            # Hold back a suffix that may be the start of a tag.
            rest = buf[at:]
            if tag is _OPEN_OR_CALL_RE:
                hold = max(_partial_suffix(rest, t) for t in (THINK_OPEN, *_CALL_OPENS))
            elif self._first and not self._in_think:
                hold = max(_partial_suffix(rest, t) for t in _FIRST_TAGS[self._calls])
                if hold and len(rest) <= MAX_FIRST_HELD and _partial_suffix(rest, THINK_CLOSE) == hold:
                    hold = len(rest)  # (all of it, until the tag is known: before a </think> it is reasoning)
            else:
                hold = _partial_suffix(rest, tag.pattern)
            self._emit(rest[: len(rest) - hold])
            self._pending = rest[len(rest) - hold :]
            return

    def _through_call(self, buf: str, at: int) -> int:
        """Content from ``at`` to the end of the call block it is inside: past its closing tag
        (returned), or to the end of ``buf`` (-1; a partial closing tag held back)."""
        start = at
        while True:
            if self._quoted:  # (the rest of a string an earlier piece began, or this one)
                if self._escaped:
                    if at >= len(buf):
                        break
                    at += 1
                    self._escaped = False
                at = _STRING_TEXT_RE.match(buf, at).end()  # type: ignore[union-attr]  # (it matches "")
                if at == len(buf) - 1 and buf[at] == "\\":  # (what it escapes comes in the next piece)
                    at, self._escaped = len(buf), True
                if at >= len(buf):
                    break
                at += 1  # (its closing quote)
                self._quoted = False
            at = _BODY_RE[self._call].match(buf, at).end()  # type: ignore[union-attr]
            if at < len(buf) and buf[at] == '"':  # a string this piece does not close
                self._quoted = True
                at += 1
                continue
            close = CALL_CLOSES[self._call]
            if at < len(buf):  # its closing tag
                at += len(close)
                self._call = ""
                self._content(buf[start:at])
                return at
            cut = len(buf) - _partial_suffix(buf[start:], close)
            self._pending = buf[cut:]
            if cut > start:
                self._content(buf[start:cut])
            return -1
        if len(buf) > start:
            self._content(buf[start:])
        return -1

    def _past_head(self, text: str) -> str | None:
        """An open stream's first text, with a leading ``<think>`` dropped;
        None while what came so far is whitespace or a part of the tag."""
        buf = self._pending + text
        rest = buf.lstrip()
        if len(rest) < len(THINK_OPEN) and THINK_OPEN.startswith(rest.lower()):
            self._pending = buf
            return None
        self._head = False
        self._pending = ""
        return rest[len(THINK_OPEN) :] if rest[: len(THINK_OPEN)].lower() == THINK_OPEN else buf

    def flush(self) -> None:
        buf, self._pending = self._pending, ""
        self._head = False
        self._emit(buf)

    def _emit(self, text: str) -> None:
        if text:
            (self._reasoning if self._in_think else self._content)(text)


def _body_start(buf: str, opening: re.Match[str]) -> bool | None:
    """Whether a call's opening tag in ``buf`` begins a block: its body's first character, past
    at most :data:`MAX_CALL_GAP` of whitespace, is one of :data:`CALL_BODY_FIRST`, or it begins
    :data:`CALL_BODY_XML` (more whitespace: prose, as the calls' reader has it); None while ``buf``
    ends before that is known."""
    at = _SPACES.match(buf, opening.end()).end()  # type: ignore[union-attr]  # (it matches "")
    if at - opening.end() > MAX_CALL_GAP:
        return False
    if at == len(buf):
        return None
    if buf[at] in CALL_BODY_FIRST:
        return True
    begun = buf[at : at + len(CALL_BODY_XML)].lower()
    if len(begun) < len(CALL_BODY_XML) and CALL_BODY_XML.startswith(begun):
        return None  # (it may yet be one)
    return begun == CALL_BODY_XML


class FirstThinkTag:
    """The first think tag of a text fed in pieces, outside tool-call blocks with ``calls``:
    what :func:`template_head` reads in a whole text, for a live stream holding its head."""

    __slots__ = ("_tail", "_blocks", "_fed")

    def __init__(self, calls: bool) -> None:
        self._tail = ""  # the end of what was fed that may begin a tag (or a call's closing tag)
        self._blocks = ThinkSplitter(ignore_text, ignore_text, calls=True) if calls else None  # (to step over them)
        self._fed = 0

    def feed(self, text: str) -> tuple[str, int] | None:
        """The first think tag (lower case) and where it starts in all the text fed, once known."""
        buf = self._tail + text
        base = self._fed - len(self._tail)
        self._fed += len(text)
        blocks = self._blocks
        tags = _FIRST_RE[blocks is not None]
        at = 0
        while True:
            if blocks is not None and blocks._call:
                at = blocks._through_call(buf, at)
                if at < 0:
                    self._tail, blocks._pending = blocks._pending, ""
                    return None
                continue
            found = tags.search(buf, at)
            if found is None:
                rest = buf[at:]
                keep = max(_partial_suffix(rest, t) for t in _FIRST_TAGS[blocks is not None])
                self._tail = rest[len(rest) - keep :] if keep else ""
                return None
            word = found.group().lower()
            if word in (THINK_OPEN, THINK_CLOSE):
                return word, base + found.start()
            body = _body_start(buf, found)
            if body is None:
                self._tail = buf[found.start() :]
                return None
            if body:
                blocks._call = word[0]  # type: ignore[union-attr]  # (a call's opening: calls only)
            at = found.end()


def template_head(text: str, calls: bool) -> int:
    """Where the first think tag of ``text`` (outside tool-call blocks, with ``calls``) starts
    when it is a ``</think>`` (the chat template opened the reasoning: what is before it is
    reasoning, call blocks too); -1 if it is not."""
    first = FirstThinkTag(calls).feed(text)
    return first[1] if first is not None and first[0] == THINK_CLOSE else -1


def ignore_text(_: str) -> None:
    pass


def _partial_suffix(buf: str, tag: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``tag``."""
    low = buf[-(len(tag) - 1) :].lower()
    for k in range(min(len(low), len(tag) - 1), 0, -1):
        if tag.startswith(low[-k:]):
            return k
    return 0
