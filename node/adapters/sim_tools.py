"""What the sim model does with tools, deterministically.

The rule: a request with ``tools`` gets a call when ``tool_choice`` names a
function (that one) or is ``"required"`` (the tool the last user message
names, else the first tool; once an agent's loop is under way, the named
tool if it has not been called since, else the final-answer tool: the last
tool whose name has the word "final", else the last tool, where agent
frameworks put theirs, so that the loop ends); with ``"auto"`` (or none given) it
gets a call when the last user message names a tool and no tool result came
after it.
Otherwise, and always with ``tool_choice = "none"``, it answers with text:
after tool results, a sentence saying what each returned.

The arguments satisfy the tool's JSON Schema (:func:`sample`): ``const``,
``enum``, ``default`` and ``examples`` are used as given; otherwise a string,
number or integer is a plain value within its bounds (lengths, minimum and
maximum, ``multipleOf``, common formats), a string with a ``pattern`` one
made from the pattern (:class:`_PatternText`), an array has ``minItems``
items (none by default; distinct ones for ``uniqueItems``), an object its
required properties and up to ``minProperties`` (from ``properties``,
``patternProperties``, else names valid for ``propertyNames``); ``allOf``
is merged and local ``$ref``s are followed. ``anyOf``, ``oneOf``, ``if``
and ``not`` are tried (:func:`_first_valid`): a branch's value, checked
with ``jsonschema`` against the whole schema, else the next. The work is
bounded (:class:`_Budget`): past 10,000 values or 64 KiB of text a value is
cut short, and past a quarter of a second of checks and patterns the first
try is taken unchecked.

A ``response_format`` of ``json_schema`` gets a value of its schema made the
same way, as the answer's text; ``json_object`` gets a small object
(:func:`structured_text`).
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import re
import re._constants as _c
import re._parser as _parser
import string
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import jsonschema
import msgspec
import referencing
import referencing.exceptions
import regex

from proto import ToolCall, ToolCallFunction

_encode = msgspec.json.Encoder().encode
_MAX_DEPTH = 32  # a schema that requires itself has no finite value: stop there
_MAX_RESULT_CHARS = 200
_FORMATS = {
    "date": "2024-01-01",
    "date-time": "2024-01-01T00:00:00Z",
    "time": "00:00:00Z",
    "duration": "P1D",
    "email": "sim@example.com",
    "idn-email": "sim@example.com",
    "hostname": "example.com",
    "idn-hostname": "example.com",
    "ipv4": "127.0.0.1",
    "ipv6": "::1",
    "uri": "https://example.com/",
    "iri": "https://example.com/",
    "uri-reference": "https://example.com/",
    "iri-reference": "https://example.com/",
    "url": "https://example.com/",
    "uuid": "00000000-0000-4000-8000-000000000000",
}


def _functions(body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for tool in body.get("tools") or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]:
            out.append(fn)
    return out


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "" if content is None else _encode(content).decode()


def _since_last_user(messages: list[Any]) -> tuple[str, list[dict[str, Any]]]:
    """The last user message's text and the messages after it."""
    for i in range(len(messages) - 1, -1, -1):
        message = messages[i]
        if isinstance(message, dict) and message.get("role") == "user":
            return _text(message.get("content")), [m for m in messages[i + 1 :] if isinstance(m, dict)]
    return "", [m for m in messages if isinstance(m, dict)]


# Where the sim looks for tool names: the first and the last _SCAN characters of a message
# (a pasted document and "use tool_x" after it). A model server reads all of it, but the sim
# only guesses which tool is meant, on the node's event loop.
_SCAN = 16 * 1024
# A name as the sim reads one: a run of letters, digits and "_ - . : /" (what tool names are
# made of), bounded by anything else, with the punctuation that ends a sentence left off it. One
# pass over the text and a set lookup a word, whatever the names: a regex of the names tried
# them at every character (255 names sharing 61 dashes: 12.5 s a MB; as a trie, 256 names of
# 1 to 256 dashes still took 4.5 s on 40 K of dashes).
_WORD = re.compile(r"[\w.:/-]+")
_PART_WORD = re.compile(r"[\w.:/-]*")
_ENDS = ".:/-"
_SEPARATOR = re.compile(r"[.:/]")
_AFFIXES = 4
_CALL = re.compile(r"\s*\(")
_NAME_KEY = re.compile(r"""\bname['"]?\s*[:=]\s*$""")  # before a quoted value: 'name': , "name": , name=
_QUOTES = ("'", '"')


def _windows(text: str) -> list[str]:
    """The parts of ``text`` the sim reads for names; a word a cut splits is left out (not read
    as a shorter word)."""
    if len(text) <= 2 * _SCAN:
        return [text]
    head, tail = text[:_SCAN], text[-_SCAN:]
    if _PART_WORD.match(text, _SCAN, _SCAN + 1).end() > _SCAN:  # (one character: is it a word's?)
        head = head[: _SCAN - _PART_WORD.match(head[::-1]).end()]
    cut = len(text) - _SCAN - 1
    if _PART_WORD.match(text, cut, cut + 1).end() > cut:
        tail = tail[_PART_WORD.match(tail).end() :]
    return [head, tail]


def _named(functions: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The functions ``text`` names, as words ("researched" does not name search, nor
    "get-weather" get), in their order, letter case aside."""
    if not text:
        return []
    words = {w for part in _windows(text) for word in _WORD.findall(part.lower()) for w in _readings(word)}
    return [fn for fn in functions if fn["name"].lower() in words]


def _readings(word: str) -> list[str]:
    """A word as it may name a tool: itself; without the punctuation that ends a sentence; each
    of its parts between ``. : /`` ("use get_weather/get_time", ``Action:get_weather``); and
    what follows each of its last separators and precedes each of its first, for a name that
    has them itself (``default_api.weather.get``, "use weather.get/search"). (Only a few: a
    16 K word of dots has 8 K of them.)"""
    bare = word.strip(_ENDS)
    if not _SEPARATOR.search(bare):
        return [word, bare]
    starts = [bare[: m.start()] for m in itertools.islice(_SEPARATOR.finditer(bare), _AFFIXES)]
    return [word, bare, *_SEPARATOR.split(bare), *_ends(bare), *starts]


def _ends(bare: str) -> list[str]:
    """What follows each of the last few separators of a word."""
    return [bare[m.end() :] for m in collections.deque(_SEPARATOR.finditer(bare), _AFFIXES)]


def _record_readings(part: str, start: int, end: int) -> list[str]:
    """The word at ``part[start:end]`` as it may name a tool whose call an assistant's text
    records: called, as itself (``get_weather (...)``) or, with its "(" right after it, in any
    of its readings (``tools/get_weather(``, ``web_search.run(``), never in a URL; quoted, as
    itself, or after a namespace as the value of a name (``'name': 'functions.get_weather'``;
    not ``'module': 'app.web_search'``). Else none."""
    word = part[start:end]
    if part[end : end + 1] == "(" and "//" not in word:
        return _readings(word)
    if _CALL.match(part, end):
        return [word, word.rstrip(_ENDS)]  # ("get_weather: (...)"; not "x.org/#/web_search (docs)")
    if not (start > 0 and part[start - 1] in _QUOTES and part[end : end + 1] in _QUOTES):
        return []
    if _NAME_KEY.search(part, max(0, start - 32), start - 1):
        bare = word.strip(_ENDS)
        return [word, bare, *_ends(bare)]
    return [word]


def _recorded(functions: list[dict[str, Any]], text: str) -> set[str]:
    """The functions an assistant's text records calls of: a name quoted or called (smolagents:
    ``{'name': 'get_weather', ...}``), not merely said ("get_weather says sunny")."""
    names = {fn["name"] for fn in functions}
    found = set()
    for part in _windows(text):
        for m in _WORD.finditer(part):
            named = next((w for w in _record_readings(part, m.start(), m.end()) if w in names), None)
            if named is not None:
                found.add(named)
    return found


def _is_final(name: str) -> bool:
    """A final-answer tool's name: with the word "final" (final_answer, final_result, FinalAnswer;
    not finalize_order)."""
    words = re.split(r"[^a-zA-Z0-9]+|(?<=[a-z0-9])(?=[A-Z])", name)
    return any(word.lower() == "final" for word in words)


def _loop_calls(
    messages: list[Any], after: list[dict[str, Any]], functions: list[dict[str, Any]]
) -> tuple[set[str], bool] | None:
    """The tools an agent's loop under way has called, and whether they were only named in an
    assistant's text; None when no loop is under way. A loop is under way when tool results came
    after the last user message, or that message follows an assistant turn that called tools
    (with their results between: a framework's "Continue"), or whose text records calls (smolagents
    sends its calls as the assistant's text and their results as user messages: "Calling tools:
    ...", "Observation: ...")."""
    if any(m.get("role") == "tool" for m in after):
        turns = after
    else:
        last_user = next(
            (
                i
                for i in range(len(messages) - 1, -1, -1)
                if isinstance(messages[i], dict) and messages[i].get("role") == "user"
            ),
            -1,
        )
        at = last_user - 1  # (none: -2, no message before)
        while at >= 0 and isinstance(messages[at], dict) and messages[at].get("role") == "tool":
            at -= 1
        before = messages[at] if at >= 0 else None
        if not isinstance(before, dict) or before.get("role") != "assistant":
            return None
        if not before.get("tool_calls"):
            text = _text(before.get("content"))
            named = _recorded(functions, text)
            return (named, True) if named else None
        turns = [before]
    called = set()
    for m in turns:
        calls = m.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            if isinstance(call, dict) and isinstance(call.get("function"), dict):
                called.add(call["function"].get("name"))
    return called, False


def tool_call_for(body: dict[str, Any]) -> ToolCall | None:
    """The call the sim makes for this request, or None to answer with text."""
    functions = _functions(body)
    choice = body.get("tool_choice")
    if not functions or choice == "none":
        return None
    messages = body.get("messages")
    prompt, after = _since_last_user(messages if isinstance(messages, list) else [])
    named = _named(functions, prompt)
    chosen: dict[str, Any] | None = None
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        chosen = next((fn for fn in functions if fn["name"] == name), None)
    elif choice == "required":
        loop = _loop_calls(messages if isinstance(messages, list) else [], after, functions)
        if loop is None or (loop[1] and named):  # (a message naming a tool after mere text: asked anew)
            chosen = (named or functions)[0]
        else:  # the tool asked for if not called yet, else the final answer: the loop ends
            final = next((fn for fn in reversed(functions) if _is_final(fn["name"])), functions[-1])
            chosen = next((fn for fn in named if fn["name"] not in loop[0]), final)
    elif named and not any(m.get("role") == "tool" for m in after):
        chosen = named[0]
    if chosen is None:
        return None
    try:
        arguments = _encode(sample(chosen.get("parameters") or {"type": "object"}, object_root=True)).decode()
    except (ArithmeticError, ValueError, RecursionError):  # bounds no float can meet: the edge will say so
        arguments = "{}"
    return ToolCall(function=ToolCallFunction(name=chosen["name"], arguments=arguments))


def structured_text(body: dict[str, Any]) -> str | None:
    """The JSON the sim answers when ``response_format`` asks for JSON, else None."""
    fmt = body.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return '{"answer": "sim"}'
    if kind != "json_schema":
        return None
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    try:
        return _encode(sample(schema if isinstance(schema, dict) else {"type": "object"})).decode()
    except (ArithmeticError, ValueError, RecursionError):  # as for tool arguments
        return "{}"


def tool_results_text(body: dict[str, Any]) -> str | None:
    """After tool results (since the last user message): a sentence on each; else None."""
    messages = body.get("messages")
    _, after = _since_last_user(messages if isinstance(messages, list) else [])
    names: dict[str, str] = {}
    for message in after:
        calls = message.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(call.get("id"), str):
                names[call["id"]] = str(fn.get("name") or "")
    sentences = []
    for message in after:
        if message.get("role") == "tool":
            result = " ".join(_text(message.get("content")).split())
            if len(result) > _MAX_RESULT_CHARS:
                result = result[:_MAX_RESULT_CHARS] + "…"
            name = names.get(str(message.get("tool_call_id")), "")
            result = result or "(nothing)"
            said = f"The {name} tool returned: {result}" if name else f"The tool returned: {result}"
            sentences.append(said + ("" if result[-1] in ".!?…" else "."))
    return " ".join(sentences) if sentences else None


# -- a value for a JSON Schema ------------------------------------------------------------------


_MAX_OPTIONAL = 16  # optional properties of the arguments filled when none is required


class _Budget:
    """What one :func:`sample` may still make. Past it, values are cut short
    (a value is None, an array or string shorter than its minimum): a
    300-byte schema whose definition requires itself three times asked for
    3^32 values (the node at 100% CPU, growing 25 MB/s, deaf to SIGTERM),
    and ``minLength: 1e9`` for a 1 GB string. Checks (:meth:`valid`) and
    patterns (:meth:`matches`, :class:`_PatternText`) have their own bound:
    :data:`_MAX_CHECKS` checks and :data:`_CHECK_S` seconds in all, each
    regex with a deadline, as they run on the node's event loop."""

    __slots__ = (
        "values",
        "chars",
        "merged",
        "refs",
        "combined",
        "root",
        "checker",
        "checks",
        "deadline",
        "steps",
        "patterns",
        "tops",
    )

    def __init__(self, root: Any) -> None:
        self.values = _MAX_VALUES
        self.chars = _MAX_CHARS
        self.merged = _MAX_MERGED  # schema keys copied merging allOf parts and $ref siblings
        self.refs: dict[str, Any] = {}  # each $ref resolved once: a path may be as long as the request
        # What each schema with a $ref, allOf, anyOf, oneOf, if or not stands for, worked out once
        # (by id: the schema is kept with it, so the id is not reused): 10,000 items of a $ref
        # with a sibling copied its definition 10,000 times.
        self.combined: dict[int, tuple[Any, Any]] = {}
        self.root = root
        self.checker: Any = None  # made at the first check
        self.checks = _MAX_CHECKS
        self.deadline = time.monotonic() + _CHECK_S
        self.steps = _MAX_PATTERN_STEPS  # pattern characters parsed and pattern nodes walked
        self.patterns: dict[str, Any] = {}  # each pattern parsed once (None: it cannot be)
        self.tops: set[int] = set()  # ids of the schemas the root stands for (kept in `combined`)

    def text(self, value: str) -> str:
        self.chars -= len(value)
        return value

    def valid(self, value: Any, schema: Any) -> bool | None:
        """Whether ``value`` satisfies ``schema`` (a part of the root, or made of its parts),
        as the edge checks it; None: not known (past the bound, or a keyword not checked here)."""
        if self.checks <= 0 or not isinstance(self.root, dict) or time.monotonic() > self.deadline:
            return None
        self.checks -= 1
        _limits.deadline = self.deadline
        try:
            if self.checker is None:
                cls = jsonschema.validators.validator_for(self.root, default=jsonschema.Draft202012Validator)
                self.checker = _checking(cls)(self.root, registry=_NO_RETRIEVAL)
            return self.checker.evolve(schema=schema).is_valid(value)
        except Exception:  # _Unsure, or a schema the validator cannot use: the edge will say
            return None

    def matches(self, pattern: str, text: str) -> bool | None:
        """Whether ``pattern`` finds a match in ``text``, as the edge's ``regex`` does; None: not known."""
        _limits.deadline = self.deadline
        try:
            return _search(pattern, text) is not None
        except Exception:  # _Unsure, or a pattern `regex` does not take
            return None


_MAX_VALUES = 10_000
_MAX_CHARS = 64 * 1024  # of strings made or taken from the schema
_MAX_MERGED = 100_000
_MAX_CHECKS = 1_000
_CHECK_S = 0.25
_MAX_PATTERN_STEPS = 200_000
_MAX_PATTERN = 16 * 1024  # characters of one pattern the sim reads
_TRIES = 3  # variants of each alternative tried (:func:`_first_valid`)
_MAX_ALTERNATIVES = 8  # branches of an anyOf or oneOf tried
_PATTERN_TRIES = 3


def sample(schema: Any, *, object_root: bool = False) -> Any:
    """A value that satisfies ``schema`` (see the module docstring for what is
    covered), made in bounded time and space (:class:`_Budget`)."""
    value = _sample(schema, schema, 0, _Budget(schema))
    if object_root and not isinstance(value, dict):
        return {}
    return value


def _sample(schema: Any, root: Any, depth: int, budget: _Budget, nth: int = 0) -> Any:
    """A value of ``schema``; ``nth`` > 0 asks for another one where the schema allows
    (the nth variant: unique items, and a try that another branch matched too)."""
    if depth > _MAX_DEPTH or budget.values <= 0 or budget.merged < 0:
        return None
    if not isinstance(schema, dict):  # true, or a missing schema: anything goes
        budget.values -= 1
        return {} if depth == 0 or id(schema) in budget.tops else _plain(nth, None, None)
    if "const" in schema:
        return _given(schema["const"], budget)
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return _given(schema["enum"][nth % len(schema["enum"])], budget)
    given = [schema["default"]] if "default" in schema else []
    if isinstance(schema.get("examples"), list):
        given += schema["examples"]
    if given:  # a default or example the schema itself refuses (a string default of an integer) is not sent
        given = [value for value in given if budget.valid(value, schema) is not False]
    if nth < len(given):
        return _given(given[nth], budget)
    top = depth == 0 or id(schema) in budget.tops
    combined = budget.combined.get(id(schema))
    if combined is None:
        combined = budget.combined[id(schema)] = (schema, _combine(schema, root, budget))
        if top and combined[1] is not None:  # what the root stands for is the root too: an object by default
            budget.tops.update(map(id, combined[1] if isinstance(combined[1], list) else [combined[1]]))
    if isinstance(combined[1], list):
        return _first_valid(schema, combined[1], root, depth, budget, nth)
    if combined[1] is not None:  # a step toward a value (at most _MAX_DEPTH of them), not one
        return _sample(combined[1], root, depth + 1, budget, nth)
    budget.values -= 1
    kind = _type_of(schema, top)
    if kind == "object":
        return _object(schema, root, depth, budget, nth)
    if kind == "array":
        return _array(schema, root, depth, budget, nth)
    if kind in ("integer", "number"):
        return _number(schema, integer=kind == "integer", nth=nth)
    if kind == "boolean":
        return nth % 2 == 0
    if kind == "null":
        return None
    return _string(schema, budget, nth)


def _combine(schema: dict[str, Any], root: Any, budget: _Budget) -> dict[str, Any] | list[Any] | None:
    """The one schema a ``$ref`` or ``allOf`` stands for; the schemas to try, in turn, for
    ``anyOf``, ``oneOf``, ``if`` and ``not`` (:func:`_first_valid`); None: none there."""
    ref = schema.get("$ref")
    if isinstance(ref, str):
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        return _merge(rest, _resolve(ref, root, budget), budget)
    if isinstance(schema.get("allOf"), list):
        merged = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            if budget.merged < 0:
                break
            merged = _merge(merged, _deref(part, root, budget), budget)
        return merged
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            rest = {k: v for k, v in schema.items() if k != key}
            return [_merge(rest, _deref(b, root, budget), budget) for b in branches[:_MAX_ALTERNATIVES]]
    if "if" in schema:
        rest = {k: v for k, v in schema.items() if k not in ("if", "then", "else")}
        # The value of `then` when it matches `if`; else the value of `else`.
        return [_merge(rest, _deref(schema.get(k, True), root, budget), budget) for k in ("then", "else")]
    if "not" in schema:  # other variants of the rest until one is not what `not` says
        return [{k: v for k, v in schema.items() if k != "not"}]
    return None


def _first_valid(schema: dict[str, Any], tries: list[Any], root: Any, depth: int, budget: _Budget, nth: int) -> Any:
    """The first value of ``tries`` (each in up to :data:`_TRIES` variants) that ``schema``
    takes as a whole (a oneOf's branch that no other branch matches, a then that its if
    matches); the first value made when none does or the check cannot tell."""
    first: Any = None
    made = False
    for variant in range(_TRIES):
        for candidate in tries:
            if budget.values <= 0:
                return first
            value = _sample(candidate, root, depth + 1, budget, nth + variant)
            if not made:
                first, made = value, True
            verdict = budget.valid(value, schema)
            if verdict is None:  # past the bound: as the first try
                return first
            if verdict:
                return value
    return first


def _given(value: Any, budget: _Budget) -> Any:
    """A value the schema gives (const, enum, default, examples), counted as the text it
    adds: one taken a thousand times (the items of an array) is a thousand copies."""
    budget.values -= 1
    if budget.chars < 0:
        return None
    if isinstance(value, str):
        return budget.text(value)
    if isinstance(value, (dict, list)):
        budget.chars -= len(_encode(value))
    return value


def _type_of(schema: dict[str, Any], top: bool) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if isinstance(k, str)]
        return next((k for k in kinds if k != "null"), kinds[0] if kinds else "string")
    if isinstance(kind, str):
        return kind
    if any(k in schema for k in ("properties", "required", "additionalProperties", "minProperties")):
        return "object"
    if any(k in schema for k in ("items", "prefixItems", "minItems")):
        return "array"
    if any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")):
        return "number"
    return "object" if top else "string"


def _object(schema: dict[str, Any], root: Any, depth: int, budget: _Budget, nth: int) -> dict[str, Any]:
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    patterns = schema.get("patternProperties") if isinstance(schema.get("patternProperties"), dict) else {}
    required = schema.get("required")
    names = list(dict.fromkeys(n for n in required if isinstance(n, str))) if isinstance(required, list) else []
    wanted = schema.get("minProperties")
    wanted = wanted if isinstance(wanted, int) and not isinstance(wanted, bool) else 0
    if not names and not wanted and properties and depth == 0:
        # Nothing required of the arguments: a model fills what they offer (instructor's list of
        # tasks is an optional property; "{}" gave its client nothing), within maxProperties and
        # _MAX_OPTIONAL, if the whole schema takes that (dependentRequired, not, propertyNames,
        # ... may not); else {} as before. Only at the top: deeper, 5,000 items of 19,000
        # optional properties each would spend the whole budget (and cut values short).
        most = schema.get("maxProperties")
        most = most if isinstance(most, int) and not isinstance(most, bool) and most >= 0 else _MAX_OPTIONAL
        filled = _fill(list(itertools.islice(properties, min(most, _MAX_OPTIONAL))), schema, root, depth, budget, nth)
        return filled if budget.valid(filled, schema) is True else {}
    if wanted > len(names):
        chosen = set(names)
        names += itertools.islice((n for n in properties if n not in chosen), wanted - len(names))
    out = _fill(names, schema, root, depth, budget, nth)
    if wanted > len(out):
        _more_properties(out, wanted, schema, patterns, root, depth, budget)
    return out


def _fill(names: list[str], schema: dict[str, Any], root: Any, depth: int, budget: _Budget, nth: int) -> dict:
    """An object of these properties, each a value of its schema."""
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    patterns = schema.get("patternProperties") if isinstance(schema.get("patternProperties"), dict) else {}
    extra = schema.get("additionalProperties")
    out: dict[str, Any] = {}
    for name in names:
        if budget.values <= 0:
            break
        value_schema = _property_schema(name, properties, patterns, extra, budget)
        out[budget.text(name)] = _sample(value_schema, root, depth + 1, budget, 0 if out else nth)
    return out


def _property_schema(name: str, properties: dict[str, Any], patterns: dict[str, Any], extra: Any, budget: _Budget):
    """The schema a property's value must satisfy (the first pattern matching its name, of several)."""
    if name in properties:
        return properties[name]
    for pattern, subschema in patterns.items():
        if budget.matches(pattern, name):
            return subschema
    return extra if isinstance(extra, dict) else True


def _more_properties(
    out: dict[str, Any], wanted: int, schema: dict[str, Any], patterns: dict[str, Any], root, depth, budget
) -> None:
    """Properties past those ``properties`` has, up to ``minProperties``: names made for
    ``patternProperties`` when no others are allowed, else names valid for ``propertyNames``."""
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    extra = schema.get("additionalProperties")
    if extra is False:
        makers = [{"type": "string", "pattern": p} for p in patterns if isinstance(p, str)]
    else:
        names = schema.get("propertyNames")
        makers = [_merge({"type": "string"}, names, budget) if isinstance(names, dict) else {"type": "string"}]
    for k in range(wanted - len(out) + 16):  # names already taken are skipped: a few more tries
        if len(out) >= wanted or budget.values <= 0 or not makers:
            return
        name = _sample(makers[k % len(makers)], root, depth + 1, budget, k // len(makers))
        if isinstance(name, str) and name not in out and name not in properties:
            value_schema = _property_schema(name, properties, patterns, extra, budget)
            out[budget.text(name)] = _sample(value_schema, root, depth + 1, budget)


def _array(schema: dict[str, Any], root: Any, depth: int, budget: _Budget, nth: int) -> list[Any]:
    prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
    items = schema.get("items")
    if isinstance(items, list):  # draft 4-7 tuple form
        prefix, items = items, schema.get("additionalItems")
    minimum = schema.get("minItems") if isinstance(schema.get("minItems"), int) else 0
    maximum = schema.get("maxItems") if isinstance(schema.get("maxItems"), int) else None
    count = max(minimum, len(prefix)) if maximum is None else min(max(minimum, len(prefix)), maximum)
    if items is False:
        count = min(count, len(prefix))
    count = min(count, max(budget.values, 0))  # each item is a value at least
    contains = schema.get("contains")
    least = schema.get("minContains") if isinstance(schema.get("minContains"), int) else 1
    if (
        isinstance(contains, dict)
        and least > 0
        and items is not False
        and (maximum is None or len(prefix) + least <= maximum)
    ):
        # Items that `contains` asks for (a required list that must hold one got []): after the
        # prefix, each of both schemas; as many as the array's other bounds still allow.
        prefix = [*prefix, *[_merge(items, contains, budget) if isinstance(items, dict) else contains] * least]
        count = min(max(count, len(prefix)), maximum) if maximum is not None else max(count, len(prefix))
        count = min(count, max(budget.values, 0))
    if schema.get("uniqueItems") is not True:  # the first item varies with the array
        return [
            _sample(prefix[i] if i < len(prefix) else items, root, depth + 1, budget, 0 if i else nth)
            for i in range(count)
        ]
    out: list[Any] = []
    seen: set[Any] = set()
    variant = nth
    for i in range(count):
        for _ in range(_TRIES):  # the next variant until a new value (a few at most)
            value = _sample(prefix[i] if i < len(prefix) else items, root, depth + 1, budget, variant)
            variant += 1
            key = _unique_key(value)
            if key not in seen or budget.values <= 0:
                break
        seen.add(key)
        out.append(value)
    return out


def _unique_key(value: Any) -> Any:
    """Equal exactly when JSON Schema's uniqueItems calls two values equal (1 and 1.0, not true and 1)."""
    if isinstance(value, bool) or value is None:
        return (0, value)
    if isinstance(value, (int, float)):
        return (1, value)
    if isinstance(value, str):
        return (2, value)
    if isinstance(value, dict):
        return (3, frozenset((k, _unique_key(v)) for k, v in value.items()))
    return (4, tuple(_unique_key(v) for v in value))


def _number(schema: dict[str, Any], *, integer: bool, nth: int = 0) -> int | float:
    def bound(key: str) -> float | None:
        value = schema.get(key)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    low, high = bound("minimum"), bound("maximum")
    xlow, xhigh = bound("exclusiveMinimum"), bound("exclusiveMaximum")
    if schema.get("exclusiveMinimum") is True:  # draft 4: a flag on minimum
        low, xlow = None, low
    if schema.get("exclusiveMaximum") is True:
        high, xhigh = None, high
    step = bound("multipleOf")
    if integer:
        lows = [math.ceil(low)] if low is not None else []
        lows += [math.floor(xlow) + 1] if xlow is not None else []
        highs = [math.floor(high)] if high is not None else []
        highs += [math.ceil(xhigh) - 1] if xhigh is not None else []
        value: float = max(lows) if lows else min(1, min(highs)) if highs else 1
        whole = step is not None and step > 0 and step == int(step)
        if whole:
            value = math.ceil(value / step) * step
        if nth:  # the next values up (down, below a maximum)
            gap = nth * (int(step) if whole else 1)
            other = value + gap if not highs or value + gap <= min(highs) else value - gap
            value = other if not lows or other >= max(lows) else value
        return int(value)
    # The binding bound on each side, and whether it is exclusive.
    lo, lo_open = (low, False) if low is not None else (None, False)
    if xlow is not None and (lo is None or xlow >= lo):
        lo, lo_open = xlow, True
    hi, hi_open = (high, False) if high is not None else (None, False)
    if xhigh is not None and (hi is None or xhigh <= hi):
        hi, hi_open = xhigh, True
    if lo is not None and hi is not None:
        value = (lo + hi) / 2 if lo_open or hi_open else lo
    elif lo is not None:
        value = lo + 1 if lo_open else lo
    elif hi is not None:
        value = min(1, hi - 1 if hi_open else hi)
    else:
        value = 1
    if step is not None and step > 0 and value % step:
        value = math.ceil(value / step) * step
    if nth:  # the next multiples up (without a step, halves: not integers), or closer to a maximum
        up = value + nth * (step if step is not None and step > 0 else 0.5)
        if hi is None or up < hi or (up == hi and not hi_open):
            value = up
        elif step is None and hi > value:
            value += (hi - value) * nth / (nth + 1)
    return value


def _string(schema: dict[str, Any], budget: _Budget, nth: int = 0) -> str:
    shortest, longest = schema.get("minLength"), schema.get("maxLength")
    shortest = shortest if isinstance(shortest, int) else None
    longest = longest if isinstance(longest, int) else None
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        made = _pattern_text(pattern, shortest or 0, longest, budget, nth)
        if made is not None:
            return budget.text(made)
    if isinstance(schema.get("format"), str) and schema["format"] in _FORMATS:
        value = _FORMATS[schema["format"]]
        if shortest is not None and len(value) < shortest:
            value += "x" * max(min(shortest, budget.chars) - len(value), 0)
        return budget.text(value[: max(longest, 0)] if longest is not None else value)
    if shortest is not None:
        shortest = min(shortest, max(budget.chars, 0))
    return budget.text(_plain(nth, shortest, longest))


_LETTERS = "abcdefghijklmnopqrstuvwyz"  # no x: padding with x keeps variants apart


def _plain(nth: int, shortest: int | None, longest: int | None) -> str:
    """A plain string: "sim", then "", "a", "b", ... "z", "ba", ... (padded with "x" to
    ``shortest``, cut to ``longest``): variants that differ, lengths that differ too."""
    if nth == 0:
        value = "sim"
    elif nth == 1:
        value = ""
    else:
        n, value = nth - 2, ""
        while True:
            n, digit = divmod(n, len(_LETTERS))
            value = _LETTERS[digit] + value
            if not n:
                break
    if shortest is not None and len(value) < shortest:
        value += "x" * (shortest - len(value))
    if longest is not None and len(value) > longest:
        value = value[: max(longest, 0)]
    return value


def _merge(base: dict[str, Any], other: Any, budget: _Budget) -> dict[str, Any]:
    """Two schemas as one (for allOf and siblings of $ref): properties and required combine."""
    if not isinstance(other, dict):
        return base
    out = dict(other)
    cost = len(out) + len(base)
    for key, value in base.items():
        if key == "properties" and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
            cost += len(out[key])
        elif key == "required" and isinstance(value, list) and isinstance(out.get(key), list):
            out[key] = list(dict.fromkeys(n for n in (*out[key], *value) if isinstance(n, str)))
            cost += len(out[key])
        else:
            out.setdefault(key, value)
    budget.merged -= cost
    return out


def _deref(schema: Any, root: Any, budget: _Budget) -> Any:
    if isinstance(schema, dict) and isinstance(schema.get("$ref"), str):
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        return _merge(rest, _resolve(schema["$ref"], root, budget), budget)
    return schema


def _resolve(ref: str, root: Any, budget: _Budget) -> Any:
    if ref not in budget.refs:
        budget.refs[ref] = _lookup(ref, root)
    return budget.refs[ref]


def _lookup(ref: str, root: Any) -> Any:
    """A reference inside the schema (``#``, ``#/$defs/x``); anything else is "any value"."""
    if not ref.startswith("#"):
        return True
    node = root
    for part in ref[1:].split("/")[1:]:
        part = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return True
    return node


# -- a string for a pattern -------------------------------------------------------------------------

_PRINTABLE = "".join(dict.fromkeys(string.ascii_letters + string.digits + "_-. " + string.punctuation))
_CATEGORY_CHARS = {
    _c.CATEGORY_DIGIT: string.digits,
    _c.CATEGORY_NOT_DIGIT: "a",
    _c.CATEGORY_SPACE: " ",
    _c.CATEGORY_NOT_SPACE: "a",
    _c.CATEGORY_WORD: string.ascii_letters + string.digits + "_",
    _c.CATEGORY_NOT_WORD: " -.",
    _c.CATEGORY_LINEBREAK: "\n",
    _c.CATEGORY_NOT_LINEBREAK: "a",
}
_CATEGORY_TEST = {
    _c.CATEGORY_DIGIT: str.isdecimal,
    _c.CATEGORY_NOT_DIGIT: lambda ch: not ch.isdecimal(),
    _c.CATEGORY_SPACE: str.isspace,
    _c.CATEGORY_NOT_SPACE: lambda ch: not ch.isspace(),
    _c.CATEGORY_WORD: lambda ch: ch.isalnum() or ch == "_",
    _c.CATEGORY_NOT_WORD: lambda ch: not (ch.isalnum() or ch == "_"),
    _c.CATEGORY_LINEBREAK: lambda ch: ch == "\n",
    _c.CATEGORY_NOT_LINEBREAK: lambda ch: ch != "\n",
}
_MAX_CLASS_CHOICES = 26  # characters of a class a variant picks among
_NAMED_GROUP = re.compile(r"(?<!\\)\(\?<(?![=!])")  # ECMA-262's (?<name>, Python's (?P<name>


class _Unsure(Exception):
    """A check or pattern past its bound, or one the sim does not follow."""


def _pattern_text(pattern: str, shortest: int, longest: int | None, budget: _Budget, nth: int) -> str | None:
    """A string in which ``pattern`` finds a match (checked with ``regex``, as the edge checks it)
    with a length within the bounds; None: none made within the bound."""
    if pattern not in budget.patterns:
        budget.steps -= len(pattern)
        tree = None
        if len(pattern) <= _MAX_PATTERN and budget.steps > 0:
            try:
                tree = _parser.parse(_NAMED_GROUP.sub("(?P<", pattern))
            except (re.error, RecursionError, OverflowError, ValueError, TypeError):
                tree = None
        budget.patterns[pattern] = tree
    tree = budget.patterns[pattern]
    if tree is None:
        return None
    for variant in range(nth, nth + _PATTERN_TRIES):
        text = _PatternText.make(tree, variant, 0, budget)
        if text is not None and len(text) < shortest:  # again, with repeats as long as it takes
            text = _PatternText.make(tree, variant, shortest - len(text), budget)
        if text is None:
            return None
        if len(text) < shortest or (longest is not None and len(text) > longest):
            continue
        if budget.matches(pattern, text) is not False:  # (not known: as made)
            return text
    return None


class _PatternText:
    """A string a regex (as ``re._parser`` reads it) matches: literals, classes, ``\\d \\w \\s``,
    repeats at their minimum, the first alternative, groups and backreferences. Anchors and
    lookarounds write nothing (a lookaround is not followed). ``variant`` picks, left to right,
    other characters of a class, other alternatives and one more repeat; ``grow`` asks for that
    many characters more, from repeats that allow them. Bounded by the budget's steps."""

    def __init__(self, variant: int, grow: int, budget: _Budget) -> None:
        self.choice = variant
        self.grow = grow
        self.budget = budget
        self.limit = max(budget.chars, 0)
        self.out: list[str] = []
        self.size = 0
        self.groups: dict[int, str] = {}

    @classmethod
    def make(cls, tree: Any, variant: int, grow: int, budget: _Budget) -> str | None:
        maker = cls(variant, grow, budget)
        try:
            maker.walk(tree)
        except (_Unsure, RecursionError):
            return None
        return "".join(maker.out)

    def pick(self, n: int) -> int:
        if n <= 1 or not self.choice:
            return 0
        self.choice, i = divmod(self.choice, n)
        return i

    def emit(self, text: str) -> None:
        self.size += len(text)
        if self.size > self.limit:
            raise _Unsure
        self.out.append(text)

    def step(self) -> None:
        self.budget.steps -= 1
        if self.budget.steps < 0:
            raise _Unsure

    def walk(self, items: Any) -> None:
        for op, av in items:
            self.step()
            if op is _c.LITERAL:
                self.emit(chr(av))
            elif op is _c.NOT_LITERAL:
                options = [ch for ch in _PRINTABLE[: _MAX_CLASS_CHOICES + 1] if ord(ch) != av]
                self.emit(options[self.pick(len(options))])
            elif op is _c.ANY:
                self.emit(_PRINTABLE[self.pick(_MAX_CLASS_CHOICES)])
            elif op is _c.IN:
                options = _class_options(av)
                if not options:
                    raise _Unsure
                self.emit(options[self.pick(len(options))])
            elif op in (_c.MAX_REPEAT, _c.MIN_REPEAT, _c.POSSESSIVE_REPEAT):
                low, high, sub = av
                count = low + (self.pick(2) if high > low else 0)
                for _ in range(count):
                    self.step()
                    self.walk(sub)
                while self.grow > 0 and count < high:
                    self.step()
                    before = self.size
                    self.walk(sub)
                    count += 1
                    if self.size == before:
                        break
                    self.grow -= self.size - before
            elif op is _c.SUBPATTERN:
                group, _, _, sub = av
                mark = len(self.out)
                self.walk(sub)
                if group is not None:
                    self.groups[group] = "".join(self.out[mark:])
            elif op is _c.BRANCH:
                alternatives = av[1]
                self.walk(alternatives[self.pick(len(alternatives))])
            elif op is _c.ATOMIC_GROUP:
                self.walk(av)
            elif op is _c.GROUPREF:
                self.emit(self.groups.get(av, ""))
            elif op is _c.GROUPREF_EXISTS:
                group, yes, no = av
                self.walk(yes if group in self.groups else no or ())
            elif op not in (_c.AT, _c.ASSERT, _c.ASSERT_NOT):
                raise _Unsure


def _class_options(items: Any) -> str:
    """The characters a class (``[...]``, ``\\d``) may give, the first few of each part, in order."""
    negate = False
    chars: list[str] = []
    ranges: list[tuple[int, int]] = []
    categories: list[Any] = []
    for op, av in items:
        if op is _c.NEGATE:
            negate = True
        elif op is _c.LITERAL:
            chars.append(chr(av))
        elif op is _c.RANGE:
            ranges.append(av)
        elif op is _c.CATEGORY:
            categories.append(av)
        else:
            return ""
    if negate:

        def member(ch: str) -> bool:
            return (
                ch in chars
                or any(lo <= ord(ch) <= hi for lo, hi in ranges)
                or any(_CATEGORY_TEST.get(c, lambda _: True)(ch) for c in categories)
            )

        return "".join(ch for ch in _PRINTABLE if not member(ch))[:_MAX_CLASS_CHOICES]
    options = chars + [chr(lo + i) for lo, hi in ranges for i in range(min(hi - lo + 1, _MAX_CLASS_CHOICES))]
    for category in categories:
        options += _CATEGORY_CHARS.get(category, "")
    return "".join(dict.fromkeys(options))[: _MAX_CLASS_CHOICES * 4]


# -- checks, bounded -------------------------------------------------------------------------------

_limits = threading.local()  # .deadline: the monotonic time the running check must end by


def _search(pattern: str, text: str) -> Any:
    left = _limits.deadline - time.monotonic()
    if left <= 0:
        raise _Unsure
    try:
        return regex.search(pattern, text, timeout=left)
    except TimeoutError:
        raise _Unsure from None


def _bounded(keyword: Callable[..., Any]) -> Callable[..., Any]:
    """A validator keyword that first looks at the clock: a check ends at its deadline."""

    def check(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        if time.monotonic() > _limits.deadline:
            raise _Unsure
        return keyword(validator, value, instance, schema)

    return check


def _pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Any:
    if isinstance(instance, str) and _search(pattern, instance) is None:
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator: Any, patterns: dict[str, Any], instance: Any, schema: Any) -> Any:
    if isinstance(instance, dict):
        for pattern, subschema in patterns.items():
            for name, value in instance.items():
                if _search(pattern, name) is not None:
                    yield from validator.descend(value, subschema, path=name, schema_path=pattern)


def _additional_properties(validator: Any, extra: Any, instance: Any, schema: Any) -> Any:
    if not isinstance(instance, dict):
        return
    properties = schema.get("properties") or {}
    patterns = list(schema.get("patternProperties") or ())
    extras = [n for n in instance if n not in properties and not any(_search(p, n) is not None for p in patterns)]
    if isinstance(extra, dict):
        for name in extras:
            yield from validator.descend(instance[name], extra, path=name)
    elif extra is False and extras:
        yield jsonschema.ValidationError(f"additional properties {extras!r}")


def _unique_items(validator: Any, unique: Any, instance: Any, schema: Any) -> Any:
    if unique and isinstance(instance, list) and len({_unique_key(v) for v in instance}) < len(instance):
        yield jsonschema.ValidationError("non-unique items")


def _not_checked(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
    raise _Unsure  # (unevaluatedProperties: its patternProperties run on `re`, with no deadline)


_KEYWORDS = {
    "pattern": _pattern,
    "patternProperties": _pattern_properties,
    "additionalProperties": _additional_properties,
    "uniqueItems": _unique_items,
    "unevaluatedProperties": _not_checked,
}


@functools.cache
def _checking(cls: Any) -> Any:
    """``cls`` with every keyword bounded in time, regexes on ``regex`` with a deadline
    and uniqueItems in one pass (:data:`_KEYWORDS`)."""
    return jsonschema.validators.extend(
        cls, {name: _bounded(_KEYWORDS.get(name, keyword)) for name, keyword in cls.VALIDATORS.items()}
    )


def _no_retrieval(uri: str) -> Any:
    raise referencing.exceptions.NoSuchResource(ref=uri)  # only references inside the schema


_NO_RETRIEVAL = referencing.Registry(retrieve=_no_retrieval)
