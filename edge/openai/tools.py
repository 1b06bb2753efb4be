"""Tool calls: parsed from text, validated against the request, rendered for
models with no native tool support.

Text forms accepted (tag names case-insensitive, several calls in a row, text
around them stays content):

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>
    {{tool_call}}{"name": "get_weather", "arguments": {"city": "Paris"}}{{/tool_call}}

The second is the mustache form: exactly ``{{tool_call}}`` and
``{{/tool_call}}`` around the same JSON object. ``arguments`` may also be a
JSON string holding the object, and ``parameters`` is accepted for
``arguments``. A last block whose closing tag is missing (the model stopped on
it) is accepted when its JSON is complete.
"""

from __future__ import annotations

import functools
import itertools
import re
import re._constants as sre
import re._parser as sre_parse
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import jsonschema
import jsonschema._keywords
import jsonschema._utils
import msgspec
import referencing
import referencing.exceptions
import referencing.jsonschema
import regex
import trio

from edge.openai.filters import CALL_BODY_FIRST, CALL_BODY_XML, CALL_CLOSES, MAX_CALL_GAP, call_body
from edge.openai.request import TOOL_IMAGE_NOTE, tool_images_head
from edge.openai.schema import ChatRequest, Message
from edge.per_run import per_run
from proto import ToolCall, ToolCallFunction, jsoncost
from proto.frames import MAX_TOOL_CALLS

T = TypeVar("T")

_encode = msgspec.json.Encoder().encode

XML_OPEN = "<tool_call>"
MUSTACHE_OPEN = "{{tool_call}}"
_HINTS = ("<tool_call", "{{tool_call")  # what starts a candidate, for the live filter
# Found with ASCII case folding, at the text's own offsets: str.lower() can change a length
# ('İ' is two characters lowered), and its offsets put a call's markup into the content.
_HINT = re.compile("|".join(re.escape(h) for h in _HINTS), re.IGNORECASE | re.ASCII)
_BLOCK = re.compile(
    r"<tool_call>(?P<xml>.*?)(?:</tool_call>|\Z)|\{\{tool_call\}\}(?P<mustache>.*?)(?:\{\{/tool_call\}\}|\Z)",
    re.IGNORECASE | re.DOTALL,
)
# A block is a call's only when its body begins as one does (CALL_BODY_FIRST): prose that names
# the tag ("wrap calls in a <tool_call> tag") is text (it was read as a call, not valid JSON,
# retried and failed the request: an outside audit). Each opening is looked at once.
_OPENING = re.compile(re.escape(XML_OPEN) + "|" + re.escape(MUSTACHE_OPEN), re.IGNORECASE | re.ASCII)
_BODY_START = re.compile(
    rf"\s{{0,{MAX_CALL_GAP}}}+(?:[{re.escape(CALL_BODY_FIRST)}]|{re.escape(CALL_BODY_XML)})", re.IGNORECASE
)
# A block's body read as JSON reads it (:func:`~edge.openai.filters.call_body`): a closing tag inside
# a JSON string is the arguments (a file holding "</tool_call>"). It stops only at a closing tag
# outside strings, or at the end (an unterminated string runs to it). Used where the first closing
# tag cut a call short.
_KINDS = {"xml": "<", "mustache": "{"}  # a block's group in _BLOCK, by its first character
_JSON_BODY = {kind: call_body(first, r'"(?:[^"\\]++|\\.?)*+(?:"|\Z)') for kind, first in _KINDS.items()}
_CLOSE = {kind: len(CALL_CLOSES[first]) for kind, first in _KINDS.items()}


class TextToolCalls(msgspec.Struct):
    content: str  # the text with every call block removed (and stripped, when there was one)
    calls: list[ToolCall]
    candidate: bool  # some block looked like a tool call
    error: str = ""  # a block that could not be read as a call
    unstripped: str = ""  # ``content`` before it was stripped (when there was a block)
    dropped: bool = False  # blocks past the calls asked for were left unread (the last call is not the last written)


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


_NOT_IN_AN_ID = re.compile(r"[^A-Za-z0-9_-]")  # Anthropic's tool_use id pattern: ^[a-zA-Z0-9_-]+$


def id_key(call_id: str) -> str:
    """A call id as ids are compared, and as the Messages API shows it after its
    ``toolu_`` (:func:`edge.anthropic.codec.tool_use_id`): without that prefix, and
    each character Anthropic's pattern refuses as ``_`` (Kimi K2's ``functions.Read:0``
    is ``functions_Read_0``), so ``call_0`` and ``toolu_call_0`` are one, and a
    repeated id is seen in a history that holds it in either form."""
    return _NOT_IN_AN_ID.sub("_", call_id.removeprefix("toolu_"))


_NO_IDS: frozenset[str] = frozenset()


def history_call_ids(messages: list[Message]) -> frozenset[str]:
    """The tool-call ids a request's history holds (its assistant calls and tool results)."""
    ids: set[str] = set()
    for m in messages:
        if m.tool_call_id:
            ids.add(id_key(m.tool_call_id))
        for call in m.tool_calls or ():
            call_id = call.get("id")
            if isinstance(call_id, str) and call_id:
                ids.add(id_key(call_id))
    return frozenset(ids) if ids else _NO_IDS  # (an empty frozenset is an object of its own: 216 bytes a stream)


def with_ids(calls: list[ToolCall], taken: frozenset[str] = frozenset()) -> list[ToolCall]:
    """Native calls as a client gets them: ``{}`` where the upstream gave no
    arguments (a call of a function without parameters: ``""`` is no JSON
    object, and an SDK's ``json.loads`` fails), and ids unique in the response
    and unlike every id of the request's history (``taken``, from
    :func:`history_call_ids`). The upstream's id is kept when it is (some chat
    templates want their own format); else a fresh one. Model servers repeat
    ids (``call_0`` every turn; Kimi K2's ``functions.Read:0``) and give
    parallel calls one id: a client keys results by id, and Claude Code turns
    a repeated id's call into "[Tool use interrupted]"."""
    seen: set[str] = set()
    for call in calls:
        key = id_key(call.id)
        if not key or key in seen or key in taken:
            call.id = key = new_call_id()
        seen.add(key)
        if not call.function.arguments.strip():
            call.function.arguments = "{}"
    return calls


MAX_ERRORS_SAID = 4  # of a turn's unreadable text calls: the rest are counted


def parse_text_tool_calls(text: str, cut_off: bool = False, most: int | None = None) -> TextToolCalls:
    """``cut_off`` (the run ended by ``max_tokens``): the last block, cut before its closing tag,
    stays in the content as written if it cannot be read, not an error (no retry can help),
    and the blocks before it are calls (any of them unreadable is still an error).
    ``most`` (``parallel_tool_calls: false``: 1; Responses' ``max_tool_calls``): the blocks after
    that many calls are not read, and are no content (an unreadable one failed a turn whose call
    the client got alone)."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    pieces: list[str] = []
    pos = 0
    found = dropped = False
    budget = jsoncost.Budget()  # for the turn's calls together
    rereads = len(text)  # what bodies read as JSON may go through in all (each can run to the end)
    search = 0
    while (opening := _OPENING.search(text, search)) is not None:
        search = opening.end()
        if _BODY_START.match(text, search) is None:
            continue
        m = _BLOCK.match(text, opening.start())
        assert m is not None  # (a body runs to its closing tag or the end)
        found = True
        if len(calls) + len(errors) == MAX_TOOL_CALLS:  # (as a node bounds native calls: 400,000 made 39 MB)
            errors.append(f"the model wrote more than {MAX_TOOL_CALLS} tool calls")
            break
        pieces.append(text[pos : m.start()])
        if most is not None and len(calls) >= most:
            search = pos = m.end()
            dropped = True
            continue
        kind = "xml" if m.group("xml") is not None else "mustache"
        read_calls, error = _read_calls(m.group(kind).strip(), budget)
        pos = m.end()
        to_the_end = m.end(kind) == len(text)  # (no closing tag after it)
        if not read_calls and rereads > 0:  # a closing tag inside a JSON string may have cut it short
            start = m.start(kind)
            window = min(len(text), start + rereads)
            read = _JSON_BODY[kind].match(text, start, window)
            rereads -= read.end() - start
            to_the_end = to_the_end or read.end() == len(text)  # (its last string ran to the end)
            if read.end() > m.end(kind) and (read.end() < window or window == len(text)):
                whole, _ = _read_calls(read.group().strip(), budget)
                if whole:
                    read_calls, error, pos = whole, "", min(len(text), read.end() + _CLOSE[kind])
        if not read_calls and cut_off and to_the_end:  # the block the cut ended: text, as written
            pieces.append(text[m.start() :])
            pos = len(text)
        elif read_calls:
            if most is not None and len(calls) + len(read_calls) > most:  # (a list past the bound)
                del read_calls[most - len(calls) :]
                dropped = True
            if len(calls) + len(read_calls) + len(errors) > MAX_TOOL_CALLS:
                errors.append(f"the model wrote more than {MAX_TOOL_CALLS} tool calls")
                break
            calls.extend(read_calls)
        else:
            errors.append(error)
        search = pos
    pieces.append(text[pos:])
    joined = "".join(pieces) if found else ""
    if len(errors) > MAX_ERRORS_SAID:  # (1,024 unreadable calls were a 158 KB error, and retry message)
        errors[MAX_ERRORS_SAID:] = [f"and {len(errors) - MAX_ERRORS_SAID} more"]
    return TextToolCalls(joined.strip() if found else text, calls, found, "; ".join(errors), joined, dropped)


def parse_calls_of(filtered: str, raw: str | None, cut_off: bool = False, most: int | None = None) -> TextToolCalls:
    """The tool calls a model wrote as text, read from what it wrote (``raw``): the edge's
    filters take sentinels and think tags out of the content, and they were a call's arguments
    too (a file's ``</s>`` and ``[INST]`` lost, a ``"<think>"`` made the call unreadable, and its
    retry failed the same way: found from outside); the content around them as filtered. Read
    from ``filtered`` when ``raw`` has no call, or only ones it cannot read where ``filtered``
    can (a sentinel a model leaked inside a block). ``cut_off``, ``most``: as
    :func:`parse_text_tool_calls`."""
    parsed = parse_text_tool_calls(filtered, cut_off, most)
    if raw is None or raw == filtered or not parsed.candidate:
        return parsed
    written = parse_text_tool_calls(raw, cut_off, most)
    if not written.candidate or (written.error and not parsed.error):
        return parsed
    return TextToolCalls(parsed.content, written.calls, True, written.error, parsed.unstripped, written.dropped)


def calls_in_reasoning(reasoning: str, finish_reason: str, most: int | None = None) -> TextToolCalls | None:
    """The calls of a turn with tools that wrote no answer, only reasoning with call blocks in
    it, and stopped: a model that called before it closed its think block, or whose server's
    reasoning parser put all it wrote in the reasoning (Qwen3 on vLLM). The reasoning-only
    fallback pasted that reasoning into the answer, markup and all, a ``stop`` with no call
    (an outside audit). None when it holds no call block, or was cut off (``length``: it was
    still thinking, and a call it thought of is no call)."""
    if finish_reason == "length":
        return None
    parsed = parse_text_tool_calls(reasoning, most=most)
    return parsed if parsed.candidate else None


def _read_calls(body: str, budget: jsoncost.Budget) -> tuple[list[ToolCall], str]:
    """A block's calls: one object, or a list of them (some models write a turn's parallel
    calls in one block: it was read as a call with no name, retried and failed; an outside
    audit). None and why, when it holds none that can be read."""
    try:
        obj = budget.decode(body)
    except jsoncost.TooCostly as e:
        return [], f"the tool calls hold {e}"
    except msgspec.DecodeError:
        return [], f"a tool call is not valid JSON: {body[:120]!r}"
    except RecursionError:  # (msgspec's, past ~1,000 levels: not a DecodeError)
        return [], "a tool call is nested too deeply"
    objs = obj if isinstance(obj, list) and obj else [obj]
    if not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in objs):
        return [], "a tool call has no function name"
    calls = []
    for o in objs:
        args = o.get("arguments", o.get("parameters", {}))
        arguments = args if isinstance(args, str) else _encode(args).decode()
        calls.append(ToolCall(id=new_call_id(), function=ToolCallFunction(name=o["name"], arguments=arguments)))
    return calls, ""


# -- validation -----------------------------------------------------------------


class SchemaProblem(Exception):
    """A tool's parameters cannot be used as a JSON Schema here."""


# What a request's tool schemas may cost. Checking a schema against its draft's
# metaschema costs about 0.3 ms per property on this machine (jsonschema, 2020-12):
# a budget of nodes (objects and arrays) bounds it, and a schema past a few hundred
# nodes is compiled in a worker thread, one at a time, so the event loop (node
# links, streams) goes on meanwhile. Cached compiles (the same schema text) cost nothing.
MAX_SCHEMA_NODES = 20_000  # in all of a request's tool schemas (and the names and types they list)
THREAD_SCHEMA_NODES = 400
THREAD_SCHEMA_BYTES = 64 * 1024  # (a list of 200,000 strings is one node: 0.1 s to compile)
_COMPILES: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("iop_schema_compiles")


def _compiles() -> trio.CapacityLimiter:
    """One large compile at a time (per trio run: a limiter belongs to its run)."""
    return per_run(_COMPILES, lambda: trio.CapacityLimiter(1))


# A client's large compiles (and long validations, below) take their turns in the queue
# above one at a time: twenty huge schemas from one client make another client's wait one
# compile, not twenty.
_LANES: trio.lowlevel.RunVar[dict[str, list]] = trio.lowlevel.RunVar("iop_schema_lanes")


async def _off_loop(fn: Callable[[], T], lane: str) -> T:
    """``fn()`` in a worker thread, one at a time in the process and in ``lane``."""
    lanes = per_run(_LANES, dict)
    entry = lanes.get(lane)
    if entry is None:
        entry = lanes[lane] = [trio.Lock(), 0]  # the lane's lock and how many use it
    entry[1] += 1
    try:
        async with entry[0]:
            return await trio.to_thread.run_sync(fn, limiter=_compiles(), abandon_on_cancel=True)
    finally:
        entry[1] -= 1
        if not entry[1]:
            del lanes[lane]


# Every regex jsonschema runs (pattern, patternProperties, additionalProperties
# beside patternProperties) is a client's, matched against a model's output: a
# pattern such as ^(a+)+$ backtracks for minutes on Python's re. They run on the
# `regex` module with a deadline instead: PATTERN_BUDGET_S for one validation in
# all, after which the arguments count as not checkable. On the event loop a
# validation's patterns get INLINE_PATTERN_S (an honest one takes microseconds);
# one that needs more is done again in a worker thread, where `regex` lets go of
# the GIL while it matches: four clients looping on ^(a+)+$ held the loop 0.25 s
# a call and put everyone's p50 at 1.4 s.
#
# The same deadline holds for the whole check, not only its patterns: every keyword's
# check looks at the clock (:func:`_timed`). A schema of 77 nodes whose anyOf of two
# $refs nests 18 deep took 18 s of the loop and 1.5 GB; a 200,000-string enum checked
# against 1,000 items, 18 s (an outside audit).
PATTERN_BUDGET_S = 0.25
INLINE_PATTERN_S = 0.01
# In a worker thread the keywords' checks get longer than the patterns: large honest arguments
# (3,000 rows of a table) take 0.2-0.3 s, and the loop goes on meanwhile. Arguments past
# INLINE_ARGS_BYTES go there at once (one keyword's check, timed only as it starts, can be long).
CHECK_BUDGET_S = 2.0
INLINE_ARGS_BYTES = 64 * 1024
# A schema checked against its draft's metaschema, in a worker thread: linear in its size,
# which MAX_SCHEMA_NODES bounds (8,000 properties: 1.6 s here).
METASCHEMA_BUDGET_S = 10.0
# A pattern's counted repeats are expanded when `regex` compiles it (their lower bounds):
# (?:a{3000}){1000} took 0.9 s and 800 MB to compile (no timeout covers it). The sum, over
# a pattern's atoms, of the product of the lower bounds around them is bounded, read from
# Python's own parse of the pattern (comments and verbose mode as Python reads them: a
# parenthesis or a bracket in a comment misled a reading by hand); compiled patterns are
# the edge's own cache's, not the module's (500 of them, each up to this bound's size).
MAX_PATTERN_REPEATS = 10_000
# A pattern's characters, at most: compiled at its first match, in C, where no deadline reaches
# (4-8 µs a character of case-folded classes; 250 classes of 1,558 letters, 390 K characters,
# held the event loop 1.5-1.8 s a request: an outside re-check). A check's overshoot of its
# deadline is one compile then, 10-30 ms at worst.
MAX_PATTERN_CHARS = 4096
# The errors of one call's arguments weighed for the one the model is told about: a node's
# 290 KB of arguments wrong everywhere made 20,001 errors, 1.7-2 s of the event loop each call.
MAX_ERRORS_WEIGHED = 64


class _Deadlines(threading.local):
    """A thread's deadlines (None: none) and the clock they are read on."""

    at: float | None = None
    checks_at: float | None = None
    inline_until: float | None = None
    clock: Callable[[], float] = staticmethod(time.monotonic)


_deadline = _Deadlines()


class PatternTimeout(Exception):
    """A validation (its patterns, or any of its checks) took longer than its budget."""


class NeedsTime(Exception):
    """A validation's patterns took past :data:`INLINE_PATTERN_S` on the event loop."""


class _BoundedRe:
    """Stands in for the ``re`` module inside jsonschema: ``search`` with a deadline."""

    def __getattr__(self, name: str):
        import re as stdlib_re

        return getattr(stdlib_re, name)

    @staticmethod
    def search(pattern: str, string: str, flags: int = 0):
        end = _deadline.at
        left = PATTERN_BUDGET_S if end is None else end - _deadline.clock()
        if left <= 0:
            raise PatternTimeout
        try:
            return _compiled(pattern, flags).search(string, timeout=left, concurrent=True)
        except TimeoutError:
            raise PatternTimeout from None


class PatternProblem(Exception):
    """A schema's pattern that the edge does not compile (invalid, or its repeats too large)."""


@functools.lru_cache(maxsize=32)
def _compiled(pattern: str, flags: int = 0):
    check_pattern(pattern)
    try:
        return regex.compile(pattern, flags, cache_pattern=False)
    except (regex.error, ValueError, OverflowError, RecursionError) as e:
        raise PatternProblem(f"it is not a regular expression: {_cut(str(e), 200)}") from None


_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT)


def check_pattern(pattern: str) -> None:
    """Raises :class:`PatternProblem` if ``pattern`` is longer than :data:`MAX_PATTERN_CHARS`,
    Python cannot read it or its counted repeats expand past :data:`MAX_PATTERN_REPEATS`."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternProblem(f"it is longer than {MAX_PATTERN_CHARS} characters")
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError) as e:
        raise PatternProblem(f"it is not a regular expression: {_cut(str(e), 200)}") from None
    weight = 0
    stack = [(parsed, 1)]
    while stack:  # (iteratively: each node once, with the product of the repeats around it)
        items, times = stack.pop()
        for op, arg in items:
            if op in _REPEATS:
                stack.append((arg[2], min(times * max(arg[0], 1), 10**12)))
            elif op is sre.SUBPATTERN:
                stack.append((arg[3], times))
            elif op is sre.BRANCH:
                stack.extend((branch, times) for branch in arg[1])
            elif op in (sre.ASSERT, sre.ASSERT_NOT):
                stack.append((arg[1], times))
            elif op is sre.ATOMIC_GROUP:
                stack.append((arg, times))
            elif op is sre.GROUPREF_EXISTS:
                stack.extend((branch, times) for branch in arg[1:] if branch is not None)
            else:
                weight += times
        if weight > MAX_PATTERN_REPEATS:
            raise PatternProblem(f"its counted repeats expand past {MAX_PATTERN_REPEATS}")


def _timed(check: Callable) -> Callable:
    """A jsonschema keyword's check that first looks at the validation's deadline."""

    def timed(validator, value, instance, schema):
        _past_deadline()
        return check(validator, value, instance, schema)

    return timed


_TIMED: set[type] = set()  # every class _timed_class made


def _enum(validator, enums, instance, schema):
    """jsonschema's ``enum``, looking at the check's deadline between the values it compares
    (180 arrays of 20,000 numbers against a 40 KB argument: 0.64 s of the event loop in one
    keyword's call; an outside re-check), and quoting neither the values nor the instance whole."""
    for i, each in enumerate(enums):  # (a list: every draft's metaschema says so, checked first)
        if not i & 7:
            _past_deadline()
        if jsonschema._utils.equal(each, instance):
            return
    yield jsonschema.ValidationError(f"{_cut(repr(instance), 200)} is not one of the schema's enum values")


_OWN_KEYWORDS = {"enum": _enum}


@functools.cache
def _timed_class(cls: type) -> type:
    """``cls`` (a draft's validator) with every keyword's check timed (:func:`_timed`)."""
    if cls in _TIMED:
        return cls
    checks = {name: _timed(_OWN_KEYWORDS.get(name, fn)) for name, fn in cls.VALIDATORS.items()}
    timed = jsonschema.validators.extend(cls, checks)
    _TIMED.add(timed)
    return timed


def _timed_validator_for(schema, default=jsonschema.validators._UNSET):  # type: ignore[attr-defined]
    """``jsonschema.validators.validator_for``, timed for a timed validator's subschemas: a
    subschema with its own ``$schema`` had jsonschema step into that dialect's plain class,
    which no deadline reached (an anyOf chain of $refs 18 deep below one took 102 s, 17 s of
    it on the event loop, and node links timed out: an outside re-check)."""
    cls = _plain_validator_for(schema, default)
    if default in _TIMED and cls not in _TIMED:
        return _timed_class(cls)
    return cls


def _time_dialect_switches() -> None:
    """evolve() (how jsonschema steps into a subschema) calls the module's validator_for."""
    global _plain_validator_for
    current = jsonschema.validators.validator_for
    if current is _timed_validator_for:
        return
    if not hasattr(jsonschema.validators, "_UNSET"):
        raise RuntimeError("jsonschema.validators no longer has _UNSET: review edge.openai.tools")
    _plain_validator_for = current
    jsonschema.validators.validator_for = _timed_validator_for


_plain_validator_for = jsonschema.validators.validator_for
_time_dialect_switches()


def _bound_jsonschema_patterns() -> None:
    for module in (jsonschema._keywords, jsonschema._utils):
        current = getattr(module, "re", None)
        if isinstance(current, _BoundedRe):
            continue
        if current is None or getattr(current, "__name__", "") != "re":
            raise RuntimeError(f"{module.__name__} no longer uses the re module: review edge.openai.tools")
        module.re = _BoundedRe()  # type: ignore[attr-defined]


_bound_jsonschema_patterns()


# jsonschema checks uniqueItems (a client's schema asking it of a model's arguments, and the
# draft-04 metaschema asking it of every `enum`) by sorting, or, when the items do not sort
# (numbers beside strings), by comparing every pair: a 159 KB enum held the event loop 40-72 s
# and dropped the node links (outside audit). Instead each item gets a key that is equal
# exactly when jsonschema's `equal` says so (1 == 1.0, true != 1, objects by their members).
def _unique_key(value: Any) -> Any:
    if isinstance(value, bool) or value is None:
        return (0, value)
    if isinstance(value, (int, float)):
        return (1, value)  # (1 and 1.0: equal, with one hash)
    if isinstance(value, str):
        return (2, value)
    if isinstance(value, dict):
        return (3, frozenset((k, _unique_key(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (4, tuple(_unique_key(v) for v in value))
    raise TypeError(type(value).__name__)


def _uniq(container: Any) -> bool:
    """``jsonschema._utils.uniq`` in one pass, looking at the check's deadline as it goes:
    numbers Python hashes alike (``m * 2**61k`` all do) made the set quadratic again, 40,000
    such items 60 s in the worker thread (an outside re-check)."""
    keys = set()
    for i, item in enumerate(container):
        if not i & 15:
            _past_deadline()
        keys.add(_unique_key(item))
    return len(keys) == len(container)


def _linear_unique_items() -> None:
    current = getattr(jsonschema._keywords, "uniq", None)
    if current is _uniq:
        return
    if getattr(current, "__name__", "") != "uniq":
        raise RuntimeError("jsonschema._keywords no longer checks uniqueItems with uniq: review edge.openai.tools")
    jsonschema._keywords.uniq = _uniq  # type: ignore[attr-defined]


_linear_unique_items()


def _evaluated_as_sets() -> None:
    """jsonschema's unevaluatedItems and unevaluatedProperties look each item's index (each
    key) up in a list of those evaluated: quadratic within one keyword's call, which no
    deadline reaches (31,000 items, 62 KB of a call's arguments, held the event loop 3.1 s,
    ten such calls 28 s; 100,000 held the worker thread 42 s: an outside re-check). The lists
    those lookups read are sets here."""
    names = ("find_evaluated_item_indexes_by_schema", "find_evaluated_property_keys_by_schema")
    for module in (jsonschema._keywords, jsonschema._legacy_keywords):
        for name in names:
            current = getattr(module, name, None)
            if getattr(current, "iop_sets", False):
                continue
            if not callable(current):
                raise RuntimeError(f"{module.__name__} no longer has {name}: review edge.openai.tools")

            def as_set(validator, instance, schema, _find=current):
                return set(_find(validator, instance, schema))

            as_set.iop_sets = True  # type: ignore[attr-defined]
            setattr(module, name, as_set)


_evaluated_as_sets()


# Keywords whose values are data, not schema: their lists' items cost the metaschema
# check next to nothing (an `enum` of 200,000 strings compiles in 0.1 s); and those
# whose values map names (any, "enum" too) to schemas or to lists of names.
_DATA_KEYWORDS = frozenset(("enum", "const", "default", "examples", "example"))  # (example: OpenAPI's)
_NAME_MAPS = frozenset(
    ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependentRequired", "dependencies")
)
_SCHEMA, _NAMES, _DATA = 0, 1, 2  # what a dict is, to :func:`_schema_nodes`
_DEFINITIONS = frozenset(("$defs", "definitions"))


def _dialect_keywords(cls: Any) -> frozenset[str]:
    """The keywords a jsonschema validator class applies (``then`` and ``else`` with ``if``):
    another dialect's are annotations to it (draft-07's `$recursiveRef`, 2019-09's
    `$dynamicRef`, draft-07's `prefixItems`: refused as loops or unresolved, a re-check)."""
    known = frozenset(cls.VALIDATORS)
    return known | {"then", "else"} if "if" in known else known


# Keywords (of draft-04 to 2020-12) whose values are a subschema or lists of them; with
# _NAME_MAPS, where a schema's subschemas are. Under any other keyword a schema is an
# annotation: not applied, nor its references looked up, unless a reference points into it.
_SUBSCHEMA_KEYWORDS = frozenset(
    (
        "additionalItems",
        "additionalProperties",
        "allOf",
        "anyOf",
        "contains",
        "contentSchema",
        "else",
        "if",
        "items",
        "not",
        "oneOf",
        "prefixItems",
        "propertyNames",
        "then",
        "unevaluatedItems",
        "unevaluatedProperties",
    )
)


def _schema_nodes(schema: Any) -> int:
    """Objects and arrays in a decoded schema, the other items of the lists a schema
    keyword holds (`required`, `type`, `dependentRequired`'s names), and the boolean
    schemas of `properties` and the like: the metaschema checks each of those (9 µs a
    name in `required`: 490,000 of them held the one compile slot 4-6 s; 0.15 ms a
    `"k": true` property: 400,000 of them, 6 MB, held it 62 s). Iteratively."""
    count = 0
    stack: list[tuple[Any, int]] = [(schema, _SCHEMA)]
    while stack:
        node, kind = stack.pop()
        if isinstance(node, dict):
            count += 1
            for key, value in node.items():
                if kind == _DATA:
                    inner = _DATA
                elif kind == _NAMES:
                    inner = _SCHEMA
                else:
                    inner = _DATA if key in _DATA_KEYWORDS else _NAMES if key in _NAME_MAPS else _SCHEMA
                if isinstance(value, list):
                    if inner != _DATA:
                        count += sum(1 for v in value if not isinstance(v, (dict, list)))
                    stack.append((value, inner if inner == _DATA else _SCHEMA))
                elif isinstance(value, dict):
                    stack.append((value, inner))
                elif kind == _NAMES:  # a boolean schema (`"k": true`): checked as any other
                    count += 1
        elif isinstance(node, list):
            count += 1
            stack.extend((v, kind) for v in node if isinstance(v, (dict, list)))
    return count


def _no_retrieval(uri: str):
    # Schemas never trigger I/O: jsonschema would otherwise fetch http:// and
    # file:// references, blocking, on the event loop.
    raise referencing.exceptions.NoSuchResource(ref=uri)


_NO_RETRIEVAL = referencing.Registry(retrieve=_no_retrieval)
_REF_KEYS = ("$ref", "$dynamicRef", "$recursiveRef")
_NOWHERE = object()


# Compiled validators kept: 512 at most, of CACHED_SCHEMA_BYTES of schema text in all, the least
# recently used going first. A validator holds about 12 times its schema's text: 512 schemas of
# 60 KB held 385 MB, one key's minute of requests (an outside soak); 4 MiB of text, about 50 MB.
CACHED_SCHEMAS = 512
CACHED_SCHEMA_BYTES = 4 * 1024 * 1024


class _Validators:
    """The cache of :func:`_validator` (used from the loop and from the compiling thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[str, Any] = {}  # schema text -> validator, least recently used first
        self._bytes = 0

    def get(self, schema_json: str) -> Any:
        with self._lock:
            validator = self._kept.pop(schema_json, None)
            if validator is not None:
                self._kept[schema_json] = validator
            return validator

    def keep(self, schema_json: str, validator: Any) -> None:
        with self._lock:
            if self._kept.pop(schema_json, None) is None:
                self._bytes += len(schema_json)
            self._kept[schema_json] = validator
            while self._bytes > CACHED_SCHEMA_BYTES or len(self._kept) > CACHED_SCHEMAS:
                oldest = next(iter(self._kept))
                del self._kept[oldest]
                self._bytes -= len(oldest)


_VALIDATORS = _Validators()


def _validator(schema_json: str):
    """A compiled validator whose references resolve inside the schema only
    (:func:`_build_validator`), cached (:class:`_Validators`) when its text is at
    most :data:`THREAD_SCHEMA_BYTES` (a 7 MB schema's validator held 31-45 MB)."""
    if len(schema_json) > THREAD_SCHEMA_BYTES:
        return _build_validator(schema_json)
    validator = _VALIDATORS.get(schema_json)
    if validator is None:
        validator = _build_validator(schema_json)
        _VALIDATORS.keep(schema_json, validator)
    return validator


def _build_validator(schema_json: str):
    """Raises :class:`SchemaProblem` (not a schema; a reference that leaves the
    schema or does not resolve; references that loop without end; a pattern
    Python cannot read or that expands too far), or :class:`PatternTimeout`
    past the phase's deadline (:class:`_phase`): the metaschema's check,
    then the patterns and a first check of an empty object."""
    schema = msgspec.json.decode(schema_json)
    if not isinstance(schema, dict):
        raise SchemaProblem("it must be a JSON object")
    dialect = schema.get("$schema")
    if dialect is not None and not isinstance(dialect, str):  # (jsonschema's lookup of it raised: a 500)
        raise SchemaProblem("its `$schema` must be a string (a dialect's URI)")
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    if cls is jsonschema.Draft3Validator:
        # Draft 3 takes any name as a type: one it does not know failed the check of a call's
        # arguments (a 500 before any run when at the root). Nothing writes tools in it today.
        raise SchemaProblem("its `$schema` is draft-03, which the edge does not check: use draft-04 or later")
    try:
        with _phase(METASCHEMA_BUDGET_S):
            # (no format checks: the draft's `regex` format compiled every pattern with Python's re,
            # untimed: 2,500 full-range classes under (?i) took 17 s; patterns are read below)
            error = jsonschema.exceptions.best_match(_timed_class(cls)(cls.META_SCHEMA).iter_errors(schema))
    except RecursionError:
        raise SchemaProblem("it is nested too deeply") from None
    if error is not None:
        raise SchemaProblem(f"it is not a valid JSON Schema: {_cut(error.message, 500)}")
    spec = referencing.jsonschema.specification_with(
        cls.META_SCHEMA.get("$schema", ""), default=referencing.jsonschema.DRAFT202012
    )
    resource = spec.create_resource(schema)
    # Crawled once: every subschema's `$id` and anchor known before the lookups (each lookup of
    # one not known crawled the whole schema again: 800 subschemas with ids took 9.6 s).
    registry = _NO_RETRIEVAL.with_resource(resource.id() or "", resource).crawl()
    resolver = registry.resolver_with_root(resource)
    targets: dict[tuple[int, str], Any] = {}  # each reference's target, by its resolver, looked up once
    resolved: dict[tuple[int, str], Any] = {}  # ... by the object holding it
    try:
        known = _dialect_keywords(cls)
        ref_keys = tuple(key for key in _REF_KEYS if key in known)
        refs, anchors = _refs(schema, spec, resolver, ref_keys)
    except Exception as e:  # noqa: BLE001 (an `$id` referencing cannot read, as the check of a call would find)
        raise SchemaProblem(f"it cannot be checked: {type(e).__name__}: {_cut(str(e), 200)}") from None
    broken: dict[int, str] = {}  # the references that do not resolve, by the object holding them
    for node, ref, at in refs:
        target = targets.get((id(at), ref), _NOWHERE)
        if target is _NOWHERE:
            try:
                target = targets[(id(at), ref)] = at.lookup(ref).contents
            except Exception:  # noqa: BLE001 (Unresolvable; a pointer into a list or a number raised
                # ValueError or TypeError, a 500: an outside re-check)
                broken.setdefault(id(node), ref)
                continue
        if not isinstance(target, (dict, bool)):  # ("#/type": "object"; every call it reached failed)
            raise SchemaProblem(f"its reference `{ref[:200]}` points at no schema (an object or a boolean)")
        resolved[(id(node), ref)] = target
    # Only what is applied counts: a reference in an annotation (a keyword JSON Schema does not
    # know) that does not resolve, or a loop there, was refused, where jsonschema ignores it.
    ref_alone = cls in _REF_ALONE
    applied = _applied(schema, resolved, anchors, ref_alone, known)
    for held, ref in broken.items():
        if held in applied:
            raise SchemaProblem(
                f"its reference `{ref[:200]}` does not resolve (only references inside the schema are allowed)"
            )
    looped = _in_place_loop(schema, resolved, anchors, applied, known)
    if looped is not None:  # (below the root, only a model's arguments that reached it found it: a 502)
        raise SchemaProblem(f"its references loop without end (through `{_cut(looped, 200)}`)")
    if _false_in_whole(schema, resolved, ref_alone):
        raise SchemaProblem("it takes no JSON object (a `false` schema), and a call's arguments are one")
    validator = _timed_class(cls)(schema, registry=registry)
    with _phase(PATTERN_BUDGET_S):
        for where, pattern in _patterns(schema):
            _past_deadline()
            try:
                check_pattern(pattern)
            except PatternProblem as e:
                raise SchemaProblem(f"its {where} `{_cut(pattern, 100)}` cannot be used: {e}") from None
        try:
            for error in validator.iter_errors({}):
                _no_object_passes(error, resolved, ref_alone)
        except RecursionError:
            raise SchemaProblem("its references loop without end") from None
        except referencing.exceptions.Unresolvable as e:
            raise SchemaProblem(f"a reference does not resolve: {e}") from None
        except PatternProblem as e:
            raise SchemaProblem(f"a pattern cannot be used: {e}") from None
        except (PatternTimeout, SchemaProblem):  # (SchemaProblem: _no_object_passes')
            raise
        except Exception as e:  # noqa: BLE001 (jsonschema on what its draft's metaschema lets through:
            # draft-04's `"$ref": 1` raised AttributeError, a 500; the client's schema, not the edge's fault)
            raise SchemaProblem(f"it cannot be checked: {type(e).__name__}: {_cut(str(e), 200)}") from None
    return validator


# What the root's own keywords (and those it takes in whole: allOf, $ref) may say of an empty
# object that they say of every object.
_WHOLE_OF_ROOT = frozenset(("allOf", "$ref", "$dynamicRef"))


def _no_object_passes(error, resolved: dict[tuple[int, str], Any], ref_alone: bool) -> None:
    """An empty object's error that every object would have: a ``type`` without "object",
    a ``const`` or an ``enum`` with no object in it, ``not: {}``, or an ``anyOf``/``oneOf``
    each of whose branches says so, at the root or through what it takes in whole
    (``{"$ref": ...}`` to a string's schema, ``allOf``). Each spent a request's attempts on
    the model server before a 502 that blamed the model (outside audits)."""
    if _rejects_every_object(error, list(error.absolute_schema_path)[:-1], resolved, ref_alone):
        raise SchemaProblem(f"it takes no JSON object (its `{error.validator}`), and a call's arguments are one")


def _rejects_every_object(error, path: list, resolved: dict[tuple[int, str], Any], ref_alone: bool) -> bool:
    if error.absolute_path or not all(isinstance(step, int) or step in _WHOLE_OF_ROOT for step in path):
        return False
    if error.validator is None:  # (a `false` schema: jsonschema gives no path to it; :func:`_false_in_whole`)
        return False
    value = error.validator_value
    if error.validator == "type":
        return "object" not in (value if isinstance(value, list) else [value])
    if error.validator == "const":
        return not isinstance(value, dict)
    if error.validator == "enum":
        return isinstance(value, list) and not any(isinstance(item, dict) for item in value)
    if error.validator == "not":
        return value is True or value == {}
    if error.validator in ("anyOf", "oneOf") and isinstance(value, list) and error.context:
        refused = {
            sub.relative_schema_path[0]
            for sub in error.context
            if sub.relative_schema_path
            and _rejects_every_object(sub, list(sub.relative_schema_path)[1:-1], resolved, ref_alone)
        }
        refused.update(i for i, branch in enumerate(value) if _false_in_whole(branch, resolved, ref_alone))
        return refused >= set(range(len(value)))
    return False


# Dialects in which a `$ref` stands alone: the keywords beside it are not applied.
_REF_ALONE = frozenset((jsonschema.Draft4Validator, jsonschema.Draft6Validator, jsonschema.Draft7Validator))


def _false_in_whole(schema: Any, resolved: dict[tuple[int, str], Any], ref_alone: bool) -> bool:
    """A `false` schema the root takes in whole (through ``allOf`` and references): it takes
    no instance. (Accepted, every call failed: a re-check. jsonschema's error for a `false`
    schema has no path to it, so :func:`_no_object_passes` cannot tell it from one under
    ``then``, which takes some objects.)"""
    stack, seen = [schema], set()
    while stack:
        node = stack.pop()
        if node is False:
            return True
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        if ref_alone and isinstance(node.get("$ref"), str):  # (draft-07 and before: its siblings are not applied)
            stack.append(resolved.get((id(node), node["$ref"])))
            continue
        if isinstance(node.get("allOf"), list):
            stack.extend(node["allOf"])
        refs = (node.get("$ref"), None if ref_alone else node.get("$dynamicRef"))
        stack.extend(resolved.get((id(node), ref)) for ref in refs if isinstance(ref, str))
    return False


# Keywords whose subschemas apply to the instance itself, not to a part of it: a loop through
# them (and references) never ends, whatever the instance.
_IN_PLACE_ONE = ("not", "if", "then", "else")
_IN_PLACE_MANY = ("allOf", "anyOf", "oneOf")
_AFTER_IF = ("then", "else")  # applied only beside an `if` (jsonschema's `if` applies them)
_DEPENDENT = ("dependentSchemas", "dependencies")  # name -> a schema applied to the instance itself


def _applied(
    schema: Any,
    resolved: dict[tuple[int, str], Any],
    anchors: dict[str, list[dict]],
    ref_alone: bool,
    known: frozenset[str],
) -> set[int]:
    """The ids of the subschemas a validator may apply: the root, those under the keywords that
    hold subschemas, and what references resolve to (a `$dynamicRef`, any subschema of its
    anchor's name), from any of those (iteratively). In draft-07 and before, a `$ref`'s
    siblings are not applied; definitions (`$defs`, `definitions`) only where referenced;
    ``known``: the keywords of the schema's dialect (another's are annotations)."""
    applied: set[int] = set()
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or id(node) in applied:
            continue
        applied.add(id(node))
        if ref_alone and isinstance(node.get("$ref"), str):
            stack.append(resolved.get((id(node), node["$ref"])))
            continue
        for key, value in node.items():
            if key not in known or key in _AFTER_IF and "if" not in node:  # (then/else: only beside an if)
                continue
            if key in _REF_KEYS:
                if isinstance(value, str):
                    stack.append(resolved.get((id(node), value)))
                    if key == "$dynamicRef" and "#" in value:
                        stack.extend(anchors.get(value.rpartition("#")[2], ()))
            elif key in _NAME_MAPS and key not in _DEFINITIONS and isinstance(value, dict):
                stack.extend(value.values())
            elif key in _SUBSCHEMA_KEYWORDS:
                stack.extend(value if isinstance(value, list) else (value,))
    return applied


def _in_place_loop(
    schema: Any,
    resolved: dict[tuple[int, str], Any],
    anchors: dict[str, list[dict]],
    applied: set[int],
    known: frozenset[str],
) -> str | None:
    """A reference that closes a loop of subschemas applied to one instance (``$ref`` to
    ``$ref``, through ``allOf`` and the like), or None; ``resolved``: each reference's target,
    by the id of the object holding it and the reference.
    A loop below the root was found only when a model's arguments reached it: the turn's runs
    spent, then a 502 (an outside audit); one through ``properties`` or ``items`` (a tree)
    ends with the instance, and is no loop."""
    edges: dict[int, list[tuple[Any, str]]] = {}  # id(subschema) -> (subschema, how) it applies in place
    nodes: dict[int, Any] = {}
    # A `$dynamicRef` goes, by the scope it is reached in, to any subschema of its anchor's name
    # (``anchors``): each is taken as a successor, through one hub a name (looked up statically,
    # a loop through one went unseen, and spent a turn's runs before a 502; an edge from each
    # reference to each anchor made it quadratic, 24.7 s for 12,000 nodes: re-checks).
    hubs: dict[str, dict] = {}
    for name, targets in anchors.items():
        hub = hubs[name] = {}
        edges[id(hub)] = [(target, f"$dynamicAnchor {name}") for target in targets]
    stack = [schema]
    while stack:  # every subschema, and its in-place successors
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
            continue
        if not isinstance(node, dict) or id(node) in nodes:
            continue
        nodes[id(node)] = node
        out: list[tuple[Any, str]] = []
        for key in _REF_KEYS:
            if key not in known:
                continue
            ref = node.get(key)
            target = resolved.get((id(node), ref)) if isinstance(ref, str) else None
            if isinstance(target, dict):
                out.append((target, ref))
        ref = node.get("$dynamicRef") if "$dynamicRef" in known else None
        named = isinstance(ref, str) and "#" in ref and (id(node), ref) in resolved
        hub = hubs.get(ref.rpartition("#")[2]) if named else None
        if hub is not None:  # (a reference in a schema, not in data such as `examples`: a re-check)
            out.append((hub, ref))
        for key in _IN_PLACE_ONE:
            if key in known and isinstance(node.get(key), dict) and (key not in _AFTER_IF or "if" in node):
                out.append((node[key], key))
        for key in _IN_PLACE_MANY:
            if key in known and isinstance(node.get(key), list):
                out.extend((sub, key) for sub in node[key] if isinstance(sub, dict))
        for key in _DEPENDENT:  # (draft-07 and before: `dependencies`' schemas; a loop through them was a 502)
            if key in known and isinstance(node.get(key), dict):
                out.extend((sub, key) for sub in node[key].values() if isinstance(sub, dict))
        edges[id(node)] = out
        stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
    state: dict[int, int] = {}  # 1: on the path, 2: done
    for start in nodes:
        if start in state or start not in applied:  # (what is applied goes only where is applied)
            continue
        path = [(start, iter(edges[start]))]
        state[start] = 1
        while path:
            at, successors = path[-1]
            for target, how in successors:
                seen = state.get(id(target))
                if seen == 1:
                    return how
                if seen is None and id(target) in edges:
                    state[id(target)] = 1
                    path.append((id(target), iter(edges[id(target)])))
                    break
            else:
                state[at] = 2
                path.pop()
    return None


def _objects(schema: Any) -> Iterator[dict]:
    """Every object in a decoded schema, iteratively (depth is not a risk here)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield node
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))


def _patterns(schema: Any) -> list[tuple[str, str]]:
    """Every regex of a schema: ``pattern`` values and ``patternProperties`` keys."""
    found: list[tuple[str, str]] = []
    for node in _objects(schema):
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            found.append(("pattern", pattern))
        props = node.get("patternProperties")
        if isinstance(props, dict):
            found.extend(("patternProperties key", key) for key in props)
    return found


def _compile_within_budget(schema: str) -> Any:
    """A validator, in a worker thread (each phase with its own budget)."""
    try:
        return _validator(schema)
    except PatternTimeout:
        raise SchemaProblem("it takes too long to check") from None


def _past_deadline() -> None:
    """PatternTimeout once the current check's deadline (its keywords') has passed."""
    end = _deadline.checks_at
    if end is not None and _deadline.clock() > end:
        raise PatternTimeout


class _pattern_deadline:
    """One validation's patterns, together, within ``budget`` seconds
    (:data:`PATTERN_BUDGET_S` if None), and its keywords' checks within
    ``checks`` (``budget`` if None), read on ``clock``; the deadlines around
    it come back after."""

    def __init__(
        self, budget: float | None = None, checks: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.budget = PATTERN_BUDGET_S if budget is None else budget
        self.checks = self.budget if checks is None else checks
        self.clock = clock
        self.outer: tuple[Any, Any, Any] = (None, None, time.monotonic)

    def __enter__(self) -> None:
        self.outer = (_deadline.at, _deadline.checks_at, _deadline.clock)
        now = self.clock()
        _deadline.at, _deadline.checks_at, _deadline.clock = now + self.budget, now + self.checks, self.clock

    def __exit__(self, *_: object) -> None:
        _deadline.at, _deadline.checks_at, _deadline.clock = self.outer


class _phase(_pattern_deadline):
    """A phase of a compile within ``budget`` seconds of its worker thread's
    own CPU time (a wall-clock budget ran out for an honest schema's 23 ms
    of work while the thread waited for the GIL behind a busy loop); on the
    event loop (:class:`_inline`), within what is left of the request's
    moment there, in wall time."""

    def __init__(self, budget: float) -> None:
        until = _deadline.inline_until
        if until is not None:
            super().__init__(until - time.monotonic())
        else:
            super().__init__(budget, clock=time.thread_time)


class _inline:
    """Compiles on the event loop, all of a request's within ``until`` (a monotonic time)."""

    def __init__(self, until: float) -> None:
        self.until = until

    def __enter__(self) -> None:
        _deadline.inline_until = self.until

    def __exit__(self, *_: object) -> None:
        _deadline.inline_until = None


def _refs(
    schema: Any, spec: Any, resolver: Any, ref_keys: tuple[str, ...] = _REF_KEYS
) -> tuple[list[tuple[dict, str, Any]], dict[str, list[dict]]]:
    """Every reference in a schema: (the object holding it, the reference, the resolver its
    place gives it), iteratively (depth is not a risk here); and its subschemas by their
    ``$dynamicAnchor``. The resolver changes where a
    subschema names its own ``$id``, as referencing's pointer lookup changes it (a reference
    there is relative to that id: looked up from the root, a valid schema was refused and a
    loop went unseen, a 502 once a model's arguments reached it); the values of ``enum``,
    ``const``, ``default``, ``examples``, ``example`` and ``x-`` extensions are data, whose
    ``$ref`` keys are none. ``ref_keys``: the reference keywords of the schema's dialect."""
    found: list[tuple[dict, str, Any]] = []
    anchors: dict[str, list[dict]] = {}
    # (node, what it is, the resolver at it, the keys from where that resolver took its base)
    stack: list[tuple[Any, int, Any, list]] = [(schema, _SCHEMA, resolver, [])]
    while stack:
        node, kind, at, segments = stack.pop()
        if isinstance(node, dict):
            if kind == _SCHEMA:
                for key in ref_keys:
                    value = node.get(key)
                    if isinstance(value, str):
                        found.append((node, value, at))
                anchor = node.get("$dynamicAnchor")
                if isinstance(anchor, str):
                    anchors.setdefault(anchor, []).append(node)
            for key, value in node.items():
                if not isinstance(value, (dict, list)):
                    continue
                if kind == _NAMES:
                    inner = _SCHEMA
                else:
                    data = key in _DATA_KEYWORDS or key.startswith("x-")  # (an extension's: no keyword)
                    inner = _DATA if data else _NAMES if key in _NAME_MAPS else _SCHEMA
                if inner != _DATA:
                    stack.append((value, inner, *_step(spec, at, segments, key, value)))
        elif isinstance(node, list):
            for i, value in enumerate(node):
                if isinstance(value, (dict, list)):
                    stack.append((value, _SCHEMA, *_step(spec, at, segments, i, value)))
    return found, anchors


def _step(spec: Any, resolver: Any, segments: list, segment: str | int, contents: Any) -> tuple[Any, list]:
    """One step of a JSON pointer's walk (referencing's ``Resource.pointer``): the resolver
    there, and the segments since its base last changed."""
    segments = [*segments, segment]
    now = spec.maybe_in_subresource(segments=segments, resolver=resolver, subresource=spec.create_resource(contents))
    return now, ([] if now is not resolver else segments)


class ToolContract:
    """What a turn may call: the request's tools and its tool_choice."""

    def __init__(self, req: ChatRequest) -> None:
        self.schemas: dict[str, str] = {}
        self.twice = ""  # a name two tools give with different parameters (one tool given twice is one)
        for tool in req.tools or ():
            params = tool.function.parameters
            schema = _encode(params).decode() if params else ""
            if self.schemas.setdefault(tool.function.name, schema) != schema:
                self.twice = self.twice or tool.function.name
        choice = req.tool_choice
        self.none = choice == "none"
        self.required = choice == "required"
        self.forced: str | None = None
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            if isinstance(name, str):
                self.forced = name
                self.required = True
        self.lane = ""  # the client's, for work off the event loop: set by check_request
        self.validators: dict[str, Any] = {}  # by tool name: made by check_request

    async def check_request(self, req: ChatRequest, lane: str = "") -> str:
        """A problem with the request itself ("" if none). Every tool's schema
        is compiled (and cached) here: within :data:`MAX_SCHEMA_NODES`, and
        off the event loop when large, in the ``lane`` of its client (key or
        address): one large compile of a client's in the queue at a time."""
        self.lane = lane
        if self.twice:  # (a call's arguments were checked against the last one's schema)
            return f"tool names must be unique: `{_cut(self.twice, 100)}` names two tools"
        if self.forced is not None and self.forced not in self.schemas:
            return f"tool_choice names `{self.forced}`, which is not in tools"
        sizes = {
            tool.function.name: _schema_nodes(tool.function.parameters)
            for tool in req.tools or ()
            if tool.function.parameters
        }
        if sum(sizes.values()) > MAX_SCHEMA_NODES:
            return (
                f"the tools' parameter schemas hold {sum(sizes.values())} objects, arrays, boolean schemas and"
                " listed names (`required`, `type`) in all; "
                f"this edge takes at most {MAX_SCHEMA_NODES}"
            )
        # On the event loop, all of the request's compiles within one moment (50 tools of 399
        # nodes each, compiled one after the other, held it 5.8 s); the rest in a worker thread.
        inline_until = time.monotonic() + INLINE_PATTERN_S
        for name, schema in self.schemas.items():
            if not schema:
                continue
            try:
                small = sizes.get(name, 0) <= THREAD_SCHEMA_NODES and len(schema) <= THREAD_SCHEMA_BYTES
                if small and time.monotonic() < inline_until:
                    try:
                        with _inline(inline_until):
                            self.validators[name] = _validator(schema)
                        continue
                    except PatternTimeout:  # more than a moment: in a thread, with each phase's budget
                        pass
                self.validators[name] = await _off_loop(functools.partial(_compile_within_budget, schema), lane)
            except SchemaProblem as e:
                return f"the parameters of tool `{name}` cannot be used: {e}"
        return ""

    async def check_calls(self, calls: list[ToolCall] | None, cut: bool = False) -> str:
        """:meth:`validate`, on the event loop while it takes
        :data:`INLINE_PATTERN_S` or less and the arguments are at most
        :data:`INLINE_ARGS_BYTES`; else in a worker thread, the patterns
        within :data:`PATTERN_BUDGET_S` and the checks :data:`CHECK_BUDGET_S`,
        in the client's lane (see :meth:`check_request`)."""
        if not self.needs_thread(calls):
            try:
                return self.validate(calls, INLINE_PATTERN_S, escalate=True, cut=cut)
            except NeedsTime:
                pass
        return await self.check_in_thread(calls, cut)

    def check_in_thread(self, calls: list[ToolCall] | None, cut: bool = False) -> Awaitable[str]:
        """:meth:`validate` in a worker thread, with the whole budgets."""
        return _off_loop(functools.partial(self.validate, calls, None, cut=cut), self.lane)

    def needs_thread(self, calls: list[ToolCall] | None) -> bool:
        """Arguments too large to check on the event loop (one keyword's check on
        them can be long: unevaluatedProperties over 600,000 keys, 3.6 s)."""
        return any(len(call.function.arguments) > INLINE_ARGS_BYTES for call in calls or ())

    def validate(
        self, calls: list[ToolCall] | None, budget: float | None = None, escalate: bool = False, cut: bool = False
    ) -> str:
        """Why this turn's calls are invalid ("" if they are fine). The check gets
        ``budget`` seconds (if None, its patterns :data:`PATTERN_BUDGET_S` and
        its keywords :data:`CHECK_BUDGET_S`); past it the arguments are not
        checkable, or with ``escalate`` :class:`NeedsTime` is raised. ``cut``: the
        run was cut by max_tokens: no call is due, and its last call's arguments
        may be cut (only its name is checked: the client reads ``length``); its
        other calls are checked as any (they went out unchecked: a call to a tool
        the request does not have, with tool_choice none; found from outside)."""
        calls = calls or []
        json_budget = jsoncost.Budget()  # the turn's arguments together
        # and their checks together: 1,024 calls, each with its own 2 s, held the one compile
        # slot 254 s (on the event loop, each its own 10 ms: 2.5 s)
        patterns = PATTERN_BUDGET_S if budget is None else budget  # each call's, within the turn's checks
        checks_until = time.monotonic() + (CHECK_BUDGET_S if budget is None else budget)
        if self.none and calls:
            return f"tool_choice is none but the model called `{calls[0].function.name}`"
        if self.required and not calls and not cut:
            wanted = f"`{self.forced}`" if self.forced else "a tool"
            return f"tool_choice requires a call to {wanted} but the model answered with text only"
        for call in calls:
            name = call.function.name
            if name not in self.schemas:
                known = ", ".join(f"`{n}`" for n in self.schemas) or "none"
                return f"the model called `{name}`, which is not one of the request's tools ({known})"
            if self.forced is not None and name != self.forced:
                return f"tool_choice requires `{self.forced}` but the model called `{name}`"
            if cut and call is calls[-1]:  # (its arguments may be cut, even to none: "{}")
                break
            try:
                args = json_budget.decode(call.function.arguments or "{}")
            except jsoncost.TooCostly as e:
                return f"the tool calls' arguments hold {e}"
            except msgspec.DecodeError as e:
                return f"the arguments of `{name}` are not valid JSON: {e}"
            except RecursionError:
                return f"the arguments of `{name}` are nested too deeply"
            if not isinstance(args, dict):
                return f"the arguments of `{name}` must be a JSON object"
            schema = self.schemas[name]
            if schema:
                validator = self.validators.get(name)
                if validator is None:  # (check_request made them all)
                    return f"the arguments of `{name}` could not be checked: its schema was not compiled"
                try:
                    now = time.monotonic()
                    if now >= checks_until:
                        raise PatternTimeout
                    with _pattern_deadline(min(patterns, checks_until - now), checks_until - now):
                        errors = itertools.islice(validator.iter_errors(args), MAX_ERRORS_WEIGHED)
                        error = jsonschema.exceptions.best_match(errors)
                except RecursionError:
                    if _depth(args) > DEEP_ARGUMENTS:  # (a recursive schema followed them down: no loop)
                        return f"the arguments of `{name}` are nested too deeply to be checked"
                    return f"the arguments of `{name}` could not be checked: its schema loops on them"
                except referencing.exceptions.Unresolvable:
                    return f"the arguments of `{name}` could not be checked: its schema loops on them"
                except PatternTimeout:
                    if escalate:
                        raise NeedsTime from None
                    return f"the arguments of `{name}` could not be checked: its schema's checks take too long"
                except (SchemaProblem, PatternProblem) as e:  # (a schema compiled again here)
                    return f"the arguments of `{name}` could not be checked: {e}"
                except Exception as e:  # noqa: BLE001 (1e400 as an integer, multipleOf 0.5; whatever else
                    # jsonschema raises on a schema its metaschema let through is the schema's, not a 500)
                    return f"the arguments of `{name}` could not be checked: {type(e).__name__}: {_cut(str(e), 200)}"
                if error is not None:
                    where = _cut("/".join(str(p) for p in error.absolute_path) or "(root)", 200)
                    # (jsonschema's message quotes the value: a model's 8 MiB of arguments went to the client)
                    return f"the arguments of `{name}` do not match its schema at {where}: {_cut(error.message, 500)}"
        return ""


DEEP_ARGUMENTS = 64  # levels of arguments past which a check that ran out of stack blames them, not the schema


def _depth(value: object) -> int:
    """How deeply ``value`` (decoded JSON) nests its lists and objects (iterative: it can be deep)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in item)
    return deepest


def _cut(text: str, limit: int) -> str:
    """``text`` at most about ``limit`` characters: its start and its end (where jsonschema
    says what is wrong after quoting the value)."""
    return text if len(text) <= limit else f"{text[: limit // 2]}…{text[-(limit // 2) :]}"


def corrective_message(reason: str, calls: list[ToolCall] | None, content: str) -> dict[str, Any]:
    """Appended to the request for a retry only: what was wrong and what to do."""
    if calls:
        shown = "; ".join(f"`{c.function.name}` with arguments {c.function.arguments[:500]}" for c in calls)
        said = f"Your previous reply called {shown}."
    else:
        said = f"Your previous reply was: {content[:500]!r}."
    return {
        "role": "user",
        "content": (
            f"{said} That is invalid: {reason}. Reply again, and call only the provided tools "
            "with arguments that are a JSON object matching the tool's parameters schema."
        ),
    }


# -- models with no native tools --------------------------------------------------


def text_tools_request(request: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a request with tools for a model that has no tool support: the
    tools go into a system prompt asking for <tool_call> blocks, and earlier
    tool calls and tool results become text the model can read."""
    out = {k: v for k, v in request.items() if k not in ("tools", "tool_choice", "parallel_tool_calls")}
    tools = request.get("tools") or []
    lines = [
        "You can call functions. These are available, as JSON Schema:",
        "<tools>",
        *(_encode(t.get("function", t)).decode() for t in tools),
        "</tools>",
        "To call one, reply with exactly this, one block per call:",
        '<tool_call>{"name": "<function name>", "arguments": {<arguments as a JSON object>}}</tool_call>',
    ]
    choice = request.get("tool_choice")
    if choice == "required":
        lines.append("You must call at least one function in this reply.")
    elif isinstance(choice, dict):
        lines.append(f"You must call the function {choice.get('function', {}).get('name')!r} in this reply.")
    elif choice == "none":
        lines.append("Do not call any function in this reply.")
    prompt = "\n".join(lines)
    messages: list[dict[str, Any]] = []
    # A user turn of text is gathered whole (tool results in a row, the user's words after them, a
    # retry's correction after the user's message), as templates that want user and assistant to
    # alternate (Mistral's, Llama 2's) refuse two user turns in a row; joined once, at its end.
    texts: list[str] = []  # its pieces, and the separators between them
    alone: dict[str, Any] | None = None  # its one message as the client sent it, while it is the only one
    # The images of the tool results in that turn: a user message after it, which the turn joins.
    tool_images: list[dict[str, Any]] = []
    history = request.get("messages") or []
    shown = _arguments_newest_first(history)
    for message in history:
        role = message.get("role")
        content = message.get("content")
        if role == "tool" and isinstance(content, list) and any(_is_image(p) for p in content):
            tool_images += [tool_images_head(str(message.get("tool_call_id", "")))]
            tool_images += [p for p in content if _is_image(p)]
            content = [{"type": "text", "text": TOOL_IMAGE_NOTE} if _is_image(p) else p for p in content]
        if role == "tool" or (role == "user" and _text_only(content)):
            piece = f"<tool_response>\n{_text_of(content)}\n</tool_response>" if role == "tool" else _text_of(content)
            if texts:
                results = piece.startswith("<tool_response>") and texts[-1].endswith("</tool_response>")
                texts.append("\n" if results else "\n\n")
                alone = None
            else:
                alone = message if role == "user" and isinstance(content, str) else None
            texts.append(piece)
            continue
        if texts:
            messages.append(alone or {"role": "user", "content": "".join(texts)})
            texts = []
        if tool_images:
            messages.append({"role": "user", "content": tool_images})
            tool_images = []
        if role == "assistant" and message.get("tool_calls"):
            text = _text_of(content)
            blocks = [
                "<tool_call>"
                + _encode({"name": c["function"]["name"], "arguments": shown[id(c["function"])]}).decode()
                + "</tool_call>"
                for c in message["tool_calls"]
                if isinstance(c, dict) and isinstance(c.get("function"), dict)
            ]
            messages.append({"role": "assistant", "content": "\n".join(filter(None, [text, *blocks]))})
        elif role in ("system", "developer") and isinstance(content, list):
            messages.append({**message, "content": _text_of(content)})  # text parts only
        else:  # (a user message with an image keeps its own turn: the image is the model's to see)
            messages.append(message)
    if texts:
        messages.append(alone or {"role": "user", "content": "".join(texts)})
    if tool_images:
        messages.append({"role": "user", "content": tool_images})
    messages = _one_user_turn_at_a_time(messages)
    if messages and messages[0].get("role") in ("system", "developer") and isinstance(messages[0].get("content"), str):
        messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}
    else:
        messages.insert(0, {"role": "system", "content": prompt})
    out["messages"] = messages
    return out


def with_correction(messages: list[dict[str, Any]], correction: dict[str, Any]) -> list[dict[str, Any]]:
    """``messages`` and a retry's corrective (user) message: one user turn with the last
    one when that is a user's (two in a row failed the retry on templates that require
    turns to alternate: Mistral, Gemma; found from outside). Text with text stays a string."""
    last = messages[-1] if messages else None
    if last is None or last.get("role") != "user":
        return [*messages, correction]
    said, more = last.get("content"), correction["content"]
    if isinstance(said, str):
        merged = {**last, "content": f"{said}\n\n{more}"}
    else:
        merged = _one_user_turn_at_a_time([last, correction])[0]
    return [*messages[:-1], merged]


def _one_user_turn_at_a_time(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """User messages in a row that a text turn could not take (one has an image: the image is
    the model's to see) become one message of their parts, in order: a text turn and the image
    turn after it, two images, an image and a retry's correction."""
    out: list[dict[str, Any]] = []
    merged: dict[str, Any] | None = None  # the last message of ``out`` when it is ours to extend
    for message in messages:
        if out and message.get("role") == "user" and out[-1].get("role") == "user":
            if merged is not out[-1]:
                merged = {**out[-1], "content": _parts(out[-1].get("content"))}  # (the client's list is left as it is)
                out[-1] = merged
            merged["content"].extend(_parts(message.get("content")))
            if message.get("name") != merged.get("name"):  # (one name for the words of several)
                merged.pop("name", None)
            continue
        out.append(message)
    return out


def _parts(content: Any) -> list[Any]:
    if isinstance(content, list):
        return list(content)
    return [{"type": "text", "text": content if isinstance(content, str) else ""}]


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def _text_only(content: Any) -> bool:
    """Whether a user message's content is text: a string, parts that are all text, or none."""
    if isinstance(content, str) or content is None:
        return True
    return isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content)


_OMITTED = "[{} omitted: a model without tool support is sent text only]"
_PART_KINDS = {  # a part without text, by its type, as the text says it was left out
    "image_url": "image",
    "input_image": "image",
    "image": "image",
    "file": "file",
    "input_file": "file",
    "input_audio": "audio",
    "audio": "audio",
}


def _text_of(content: Any) -> str:
    """A message's content as the text a model without tool support reads: a string as it is,
    content parts' text one part a line, as vLLM joins them (an array of parts went out as its
    JSON, or was a 500), a part of another kind (image, file, audio) named as left out; anything
    else as its JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        texts = []
        for part in content:
            text = part.get("text", part.get("refusal"))
            if isinstance(text, str):
                texts.append(text)
            else:
                texts.append(_OMITTED.format(_PART_KINDS.get(part.get("type"), "content part")))
        return "\n".join(texts)
    return _encode(content).decode()


def _arguments_newest_first(messages: list[Any]) -> dict[int, Any]:
    """The history's calls' arguments (by their ``function``'s ``id``), decoded to be shown as
    JSON within one budget for them all, from the newest call back: past it the oldest are shown
    as the client wrote them, the model's recent calls as objects."""
    budget = jsoncost.Budget()
    shown: dict[int, Any] = {}
    for message in reversed(messages):
        if message.get("role") == "assistant" and message.get("tool_calls"):
            for c in reversed(message["tool_calls"]):
                if isinstance(c, dict) and isinstance(c.get("function"), dict):
                    shown[id(c["function"])] = _as_json(c["function"].get("arguments"), budget)
    return shown


def _as_json(arguments: Any, budget: jsoncost.Budget) -> Any:
    if isinstance(arguments, str):
        try:
            return budget.decode(arguments)
        except (msgspec.DecodeError, RecursionError):  # (as the client wrote them; or more than a call holds)
            return arguments
    return arguments


# -- live streams with tools (tool_stream = "live") ---------------------------------


class ToolTextFilter:
    """Passes content through while holding back anything that may be the start
    of a tool call; once a call starts, everything after it is held. What it
    releases is the text exactly as written, whitespace included, however the
    deltas split it. Whitespace the content starts with is held until text
    follows it: a whole answer with a call strips it."""

    __slots__ = ("_pending", "_held", "_lead")

    def __init__(self) -> None:
        self._pending = ""  # what may start a candidate (no more than the longest hint)
        self._held: list[str] | None = None  # from a candidate on: kept as it comes, never searched again
        self._lead: str | None = ""  # the leading whitespace so far (None: past it)

    def append(self, text: str) -> str:
        if self._held is not None:  # (joining and searching all of it per delta: 50k deltas took 8 s)
            self._held.append(text)
            return ""
        buf = self._pending + text
        idx = _first_candidate(buf)
        if idx >= 0:
            self._pending, self._held = "", [buf[idx:]]
            return self._past_lead(buf[:idx])
        cut = _safe_len(buf)
        self._pending = buf[cut:]
        return self._past_lead(buf[:cut])

    def _past_lead(self, out: str) -> str:
        lead = self._lead
        if lead is None:
            return out
        if not out or out.isspace():
            self._lead = lead + out
            return ""
        self._lead = None
        return lead + out if lead else out

    def flush(self) -> str:
        out = "".join(self._held) if self._held is not None else self._pending
        out, self._lead = (self._lead or "") + out, None
        self._pending, self._held = "", None
        return out

    def flush_non_candidate(self) -> str:
        """At the end of the text: what is held unless it is a tool call's start (the end of a
        text that might have begun one, ``<`` or ``{``, is text: nothing follows it)."""
        buf, held, lead = self._pending, self._held, self._lead or ""
        self._pending, self._held, self._lead = "", None, None
        return "" if held is not None else lead + buf


def before_tool_markup(text: str) -> str:
    """``text`` up to the first tool-call block (then without the whitespace
    before it): the content of a turn whose calls came natively (the live
    filter's :meth:`ToolTextFilter.flush_non_candidate`, on a whole text). A
    text ending in what might have begun one (``a < b{``) is text: it was cut there."""
    cut = _first_candidate(text)
    return text if cut < 0 else text[:cut].rstrip()


def _first_candidate(text: str) -> int:
    found = _HINT.search(text)
    return found.start() if found is not None else -1


def _safe_len(text: str) -> int:
    """Length of the prefix that cannot be the start of a candidate."""
    longest = max(len(h) for h in _HINTS)
    for i in range(max(0, len(text) - longest + 1), len(text)):
        tail = text[i:].lower()  # (a tail of at most 10 characters: its own length is what counts)
        if len(tail) == len(text) - i and any(h.startswith(tail) for h in _HINTS):
            return i
    return len(text)
