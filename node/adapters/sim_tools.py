"""What the sim model does with tools, deterministically.

The rule: a request with ``tools`` gets a call when ``tool_choice`` names a
function (that one) or is ``"required"`` (the tool the last user message
names, else the first tool); with ``"auto"`` (or none given) it gets a call
when the last user message names a tool and no tool result came after it.
Otherwise, and always with ``tool_choice = "none"``, it answers with text:
after tool results, a sentence saying what each returned.

The arguments satisfy the tool's JSON Schema (:func:`sample`): ``const``,
``enum``, ``default`` and ``examples`` are used as given; otherwise a string,
number or integer is a plain value within its bounds (lengths, minimum and
maximum, ``multipleOf``, common formats), an array has ``minItems`` items
(none by default), an object its required properties (and up to
``minProperties``); ``allOf`` is merged, ``anyOf``/``oneOf`` take their first
branch and local ``$ref``s are followed. A ``pattern`` is not followed: give
such a property an example. The work is bounded (:class:`_Budget`): past
10,000 values or 64 KiB of text a value is cut short.

A ``response_format`` of ``json_schema`` gets a value of its schema made the
same way, as the answer's text; ``json_object`` gets a small object
(:func:`structured_text`).
"""

from __future__ import annotations

import itertools
import math
import urllib.parse
from typing import Any

import msgspec

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


def tool_call_for(body: dict[str, Any]) -> ToolCall | None:
    """The call the sim makes for this request, or None to answer with text."""
    functions = _functions(body)
    choice = body.get("tool_choice")
    if not functions or choice == "none":
        return None
    messages = body.get("messages")
    prompt, after = _since_last_user(messages if isinstance(messages, list) else [])
    named = [fn for fn in functions if fn["name"].lower() in prompt.lower()]
    chosen: dict[str, Any] | None = None
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        chosen = next((fn for fn in functions if fn["name"] == name), None)
    elif choice == "required":
        chosen = (named or functions)[0]
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


class _Budget:
    """What one :func:`sample` may still make. Past it, values are cut short
    (a value is None, an array or string shorter than its minimum): a
    300-byte schema whose definition requires itself three times asked for
    3^32 values (the node at 100% CPU, growing 25 MB/s, deaf to SIGTERM),
    and ``minLength: 1e9`` for a 1 GB string."""

    __slots__ = ("values", "chars", "merged", "refs", "combined")

    def __init__(self) -> None:
        self.values = _MAX_VALUES
        self.chars = _MAX_CHARS
        self.merged = _MAX_MERGED  # schema keys copied merging allOf parts and $ref siblings
        self.refs: dict[str, Any] = {}  # each $ref resolved once: a path may be as long as the request
        # What each schema with a $ref, allOf or anyOf stands for, worked out once (by id:
        # the schema is kept with it, so the id is not reused): 10,000 items of a $ref
        # with a sibling copied its definition 10,000 times.
        self.combined: dict[int, tuple[Any, Any]] = {}

    def text(self, value: str) -> str:
        self.chars -= len(value)
        return value


_MAX_VALUES = 10_000
_MAX_CHARS = 64 * 1024  # of strings made or taken from the schema
_MAX_MERGED = 100_000


def sample(schema: Any, *, object_root: bool = False) -> Any:
    """A value that satisfies ``schema`` (see the module docstring for what is
    covered), made in bounded time and space (:class:`_Budget`)."""
    value = _sample(schema, schema, 0, _Budget())
    if object_root and not isinstance(value, dict):
        return {}
    return value


def _sample(schema: Any, root: Any, depth: int, budget: _Budget) -> Any:
    if depth > _MAX_DEPTH or budget.values <= 0 or budget.merged < 0:
        return None
    if not isinstance(schema, dict):  # true, or a missing schema: anything goes
        budget.values -= 1
        return {} if depth == 0 else "sim"
    if "const" in schema:
        return _given(schema["const"], budget)
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return _given(schema["enum"][0], budget)
    if "default" in schema:
        return _given(schema["default"], budget)
    if isinstance(schema.get("examples"), list) and schema["examples"]:
        return _given(schema["examples"][0], budget)
    combined = budget.combined.get(id(schema))
    if combined is None:
        combined = budget.combined[id(schema)] = (schema, _combine(schema, root, budget))
    if combined[1] is not None:  # a step toward a value (at most _MAX_DEPTH of them), not one
        return _sample(combined[1], root, depth + 1, budget)
    budget.values -= 1
    kind = _type_of(schema, depth)
    if kind == "object":
        return _object(schema, root, depth, budget)
    if kind == "array":
        return _array(schema, root, depth, budget)
    if kind in ("integer", "number"):
        return _number(schema, integer=kind == "integer")
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return _string(schema, budget)


def _combine(schema: dict[str, Any], root: Any, budget: _Budget) -> dict[str, Any] | None:
    """The one schema a ``$ref``, ``allOf`` or ``anyOf``/``oneOf`` stands for; None: none there."""
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
            return _merge(rest, _deref(branches[0], root, budget), budget)
    return None


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


def _type_of(schema: dict[str, Any], depth: int) -> str:
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
    return "object" if depth == 0 else "string"


def _object(schema: dict[str, Any], root: Any, depth: int, budget: _Budget) -> dict[str, Any]:
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    extra = schema.get("additionalProperties")
    required = schema.get("required")
    names = list(dict.fromkeys(n for n in required if isinstance(n, str))) if isinstance(required, list) else []
    wanted = schema.get("minProperties")
    if isinstance(wanted, int) and wanted > len(names):
        chosen = set(names)
        names += itertools.islice((n for n in properties if n not in chosen), wanted - len(names))
    out: dict[str, Any] = {}
    for name in names:
        if budget.values <= 0:
            break
        out[budget.text(name)] = _sample(
            properties.get(name, extra if isinstance(extra, dict) else True), root, depth + 1, budget
        )
    return out


def _array(schema: dict[str, Any], root: Any, depth: int, budget: _Budget) -> list[Any]:
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
    return [_sample(prefix[i] if i < len(prefix) else items, root, depth + 1, budget) for i in range(count)]


def _number(schema: dict[str, Any], *, integer: bool) -> int | float:
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
        if step is not None and step > 0 and step == int(step):
            value = math.ceil(value / step) * step
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
    return value


def _string(schema: dict[str, Any], budget: _Budget) -> str:
    value = _FORMATS.get(schema.get("format"), "sim") if isinstance(schema.get("format"), str) else "sim"
    shortest, longest = schema.get("minLength"), schema.get("maxLength")
    if isinstance(shortest, int) and len(value) < shortest:
        value += "x" * max(min(shortest, budget.chars) - len(value), 0)
    if isinstance(longest, int) and len(value) > longest:
        value = value[: max(longest, 0)]
    return budget.text(value)


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
