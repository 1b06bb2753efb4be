"""Parsing and validating a chat completion request body."""

from __future__ import annotations

import array
import re
from collections.abc import Iterator
from typing import Any

import msgspec
import trio

from edge import errors
from edge.openai.jsonbody import MAX_JSON_DEPTH, decoder_for, decoder_in_steps, too_large
from edge.openai.schema import EDGE_ONLY_FIELDS, ChatRequest, Message, ResponseFormatShape, ToolChoiceShape
from edge.per_run import per_run
from edge.runs.placement import prompt_chain
from edge.runs.service import check_int64, long_digits
from proto.jsoncost import nested_deeper_than


def _validation_message(err: msgspec.ValidationError) -> tuple[str, str | None]:
    text = str(err)
    if " - at `$." in text:
        text, _, path = text.partition(" - at `$.")
        param = path.rstrip("`")
        return f"Invalid value for `{param}`: {text[0].lower()}{text[1:]}.", param
    if text.startswith("Object missing required field `"):
        param = text.split("`")[1]
        return f"Missing required parameter: `{param}`.", param
    return f"Invalid request: {text}", None


# A \u escape of a high surrogate not followed by one of a low one, or a low one alone.
_LONE_SURROGATE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])|(?<![0-9a-fA-F]{4})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)


def _too_many_fields() -> errors.APIError:
    message = f"The request body has more than {MAX_TOP_MEMBERS} top-level fields."
    return errors.bad_request(message, code="json_too_large")


def _too_deep() -> errors.APIError:
    return errors.bad_request(
        f"The request body is nested more than {MAX_JSON_DEPTH} levels deep.", code="json_too_deep"
    )


# Past this size, a body is decoded a piece at a time. Its top level is split first (in
# msgspec's C, each value left as its text), so its lists of messages and tools are counted
# before anything is decoded into Python objects (100,000 tools in a 5.5 MB body held the loop
# 171-226 ms, decoded, before the count refused them; counted so: ~10 ms), a key given twice
# costs nothing (msgspec keeps the last, as a whole decode does), and the rest is decoded in
# pieces of about PIECE_BYTES with a checkpoint between them: the same 100,000 objects under a
# key no route reads held the loop ~140 ms in one go (three looping clients: /healthz p50
# 141-374 ms).
COUNT_FIRST_BYTES = 64 * 1024
PIECE_BYTES = 32 * 1024
# A value is decoded in one go, whatever its size, unless it holds more than PIECE_CONTAINERS
# arrays and objects and they are at least a quarter of its values: strings and numbers are
# what msgspec decodes fastest (7 MB of text: 2 ms; 490,000 numbers: 9 ms, against 63 ms split
# into items and joined again), containers the slowest (80,000 tools: 100-150 ms).
PIECE_CONTAINERS = 8_192
# Members of objects cost about as much each (their keys made Python strings): one object of
# 490,000 (6.4 MB) held the loop 131-148 ms in one go. An honest body seldom has this many
# (65,536 in one go: about 18 ms); past it, and a quarter of its values, it is split too.
PIECE_MEMBERS = 65_536
SPLIT_LEVELS = 3  # below the top level
# No route reads more than a few dozen top-level fields: past this many, a 400 before the
# top level is split (its keys made into Python strings: 490,000 held the loop 131 ms).
MAX_TOP_MEMBERS = 4_096

_split_object = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_split_array = msgspec.json.Decoder(list[msgspec.Raw]).decode
_decode_key = msgspec.json.Decoder(str).decode
_OPEN_ARRAY, _OPEN_OBJECT = 0x5B, 0x7B
# An object's text made an array's of the same length, its keys and values the items in turn
# (in strings the bytes change too, and stay a string's): msgspec splits it in C without
# making each key a Python string, which is most of an object's cost (490,000 members of
# one object: split as an object 135 ms, as an array 40 ms).
_AS_ARRAY = bytes.maketrans(b"{}:", b"[],")
_OBJECT_FIRST = re.compile(rb"[ \t\r\n]*\{")
# Objects of more than 2 x PIECE_MEMBERS items decoded at once in the process (a body's own
# nested ones aside): eight clients looping on 490,000 members each put /healthz at p99 767 ms
# when all eight went on together; two at a time, 224-238 ms. An object of a few members
# (a message whose text has many colons) never waits here.
_MANY_MEMBERS: trio.lowlevel.RunVar[trio.Semaphore] = trio.lowlevel.RunVar("iop_many_members")
# Bodies of HEAVY_BODY_BYTES or more are checked and decoded one at a time in the process, the
# next one waiting its turn without holding the loop. 8 MB of text is 40-50 ms of checks and
# decoding (counted, searched for long exponents, decoded, nested): 100 such bodies at once, each
# taking its turn between every other task's, held a small request's answer 1.4 s at p99 and
# 8.3 s at worst (200: 3.1 and 13.9 s, a node's link near its ping timeout; an outside audit).
# The bound was 1 MiB: 400 bodies of 2 bytes less at once held /healthz 5.4 s (a re-audit).
HEAVY_BODY_BYTES = 64 * 1024
_HEAVY_BODIES: trio.lowlevel.RunVar[trio.Semaphore] = trio.lowlevel.RunVar("iop_heavy_bodies")


def _not_json(body: bytes, error: msgspec.DecodeError, where: bool = True) -> errors.APIError:
    if str(error).startswith("Integer value out of range"):  # (past Python's 4,300 digits: valid JSON)
        held = _holding_bad_integer(body)
        if held is not _NOT_JSON:
            return errors.integer_out_of_range(held)
    why = str(error) if where else str(error).partition(" - at `$")[0]
    if _LONE_SURROGATE.search(body):  # (msgspec calls it "Input data was truncated")
        why = "a \\u escape of half a UTF-16 surrogate pair (\\ud800-\\udfff) with no other half"
    return errors.bad_request(f"The request body is not valid JSON: {why}.")


_NOT_JSON = "\0"  # (no field's name: the body is not JSON, whatever its integers)
_TOO_MANY_DIGITS = re.compile(rb"[0-9]{4301}")  # (past Python's int_max_str_digits: msgspec's error)


def _holding_bad_integer(body: bytes) -> str | None:
    """The top-level field of ``body`` whose value holds an integer msgspec cannot decode, if
    it can tell (only for the error); :data:`_NOT_JSON` if the body is not JSON besides (a
    truncated one was told its integer was out of range). The split checks the JSON's syntax
    in C, and a decode of its text its UTF-8; only a field with a run of digits that long is
    decoded (each field decoded held the loop 50 ms for 200,000 members)."""
    try:
        fields = _split_object(body)
        body.decode()
    except msgspec.ValidationError:  # (its integer, at the top level: no object to split)
        return None
    except (msgspec.DecodeError, UnicodeDecodeError):
        return _NOT_JSON
    for name, raw in fields.items():
        if _TOO_MANY_DIGITS.search(raw):  # (or a string of digits: then decoded whole, it passes)
            try:
                msgspec.json.decode(raw)
            except msgspec.DecodeError:
                return name
    return None


async def decode_body(
    body: bytes,
    *,
    max_messages: int | None = None,
    max_tools: int | None = None,
    items: str = "messages",
    int64: bool = False,
) -> dict[str, Any]:
    """The request body as a JSON object at most :data:`MAX_JSON_DEPTH` levels
    deep, or a 400 that says why not (see :mod:`edge.openai.jsonbody`).

    A body past :data:`COUNT_FIRST_BYTES` of many arrays and objects
    (:func:`in_one_go`) is decoded in pieces, with checkpoints between them; with
    ``max_messages`` and ``max_tools``, one with more ``items`` (the route's list
    of messages) or ``tools`` than that is refused before anything is decoded
    (the route counts again, decoded, the same way). A body of :data:`HEAVY_BODY_BYTES`
    or more waits for the others' to be decoded first. ``int64``: also
    :func:`~edge.runs.service.check_int64` (a route whose body the node gets
    only in part or not as decoded), a large body's in steps of its own."""
    if len(body) < HEAVY_BODY_BYTES:
        raw = await _decode_body(body, max_messages, max_tools, items, large=False)
        if int64:
            check_int64(raw, body)
        return raw
    async with per_run(_HEAVY_BODIES, lambda: trio.Semaphore(1)):
        raw = await _decode_body(body, max_messages, max_tools, items, large=True)
        if int64:
            await trio.lowlevel.checkpoint()
            if long_digits(body):
                await trio.lowlevel.checkpoint()
                check_int64(raw)
        return raw


async def _decode_body(
    body: bytes, max_messages: int | None, max_tools: int | None, items: str, *, large: bool
) -> dict[str, Any]:
    """:func:`decode_body`; a ``large`` body's steps (each a few ms a MB) with a turn for
    other tasks between them."""
    problem = too_large(body)
    if problem is not None:
        raise errors.bad_request(problem, code="json_too_large")
    if large:
        await trio.lowlevel.checkpoint()
    if len(body) <= COUNT_FIRST_BYTES or in_one_go(body):  # (then its lists are short, or cheap)
        if large:
            await trio.lowlevel.checkpoint()
        decode = await decoder_in_steps(body) if large else decoder_for(body)
        if large:
            await trio.lowlevel.checkpoint()
        try:
            raw = decode(body)
        except RecursionError:
            raise _too_deep() from None
        except msgspec.DecodeError as e:
            raise _not_json(body, e) from None
        if not isinstance(raw, dict):
            raise errors.bad_request("The request body must be a JSON object.")
        if large:
            await trio.lowlevel.checkpoint()
        if nested_deeper_than(body, MAX_JSON_DEPTH):
            raise _too_deep()
        if len(raw) > MAX_TOP_MEMBERS:  # (as a body split in pieces is)
            raise _too_many_fields()
        return raw
    await trio.lowlevel.checkpoint()
    try:
        if _OBJECT_FIRST.match(body) and len(_split_array(body.translate(_AS_ARRAY))) > 2 * MAX_TOP_MEMBERS:
            raise _too_many_fields()
    except msgspec.DecodeError:
        pass  # (not an object, or not JSON: said below)
    except RecursionError:
        raise _too_deep() from None
    await trio.lowlevel.checkpoint()
    try:
        top = _split_object(body)
    except RecursionError:
        raise _too_deep() from None
    except msgspec.ValidationError:  # (its top level is not an object)
        raise errors.bad_request("The request body must be a JSON object.") from None
    except msgspec.DecodeError as e:
        raise _not_json(body, e) from None
    split = {name: _array_items(top.get(name)) for name in (items, "tools")}
    if max_messages is not None and max_tools is not None:
        check_message_count(split[items], max_messages, items)
        check_tool_count(split["tools"], max_tools)
    await trio.lowlevel.checkpoint()
    try:
        return await _Pieces().object(top, MAX_JSON_DEPTH, SPLIT_LEVELS, split)
    except RecursionError:  # (msgspec's depth bound counts Python's frames: splits deeper in ours meet it sooner)
        raise _too_deep() from None
    except msgspec.DecodeError as e:  # (a float out of range; where in its piece says nothing of where in the body)
        raise _not_json(body, e, where=False) from None


def in_one_go(text: Any) -> bool:
    """Whether the JSON ``text`` is decoded in one go: at most :data:`PIECE_CONTAINERS`
    arrays and objects, or fewer than a quarter of its values, and at most
    :data:`PIECE_MEMBERS` object members or fewer than a quarter of its values (brackets,
    colons and commas in its strings counted too)."""
    text = bytes(text)
    commas = text.count(b",")
    members = text.count(b":")
    if members > PIECE_MEMBERS and 4 * members >= commas:
        return False
    containers = text.count(b"[") + text.count(b"{")
    return containers <= PIECE_CONTAINERS or 4 * containers < commas


def _array_items(raw: msgspec.Raw | None) -> list[msgspec.Raw] | None:
    """The items of a JSON array, each left as its text (None: absent, or not an array)."""
    if raw is None or not len(raw) or memoryview(raw)[0] != _OPEN_ARRAY:
        return None
    return _split_array(raw)


class _Pieces:
    """Decodes JSON values in pieces of about :data:`PIECE_BYTES`, a checkpoint between
    them: small array items, and small object members, decoded together; larger values
    split again, down to :data:`SPLIT_LEVELS` levels (each split walks the value once
    more: a large value under 62 levels of objects, split at each, held the loop 315 ms;
    below that it is one piece, as the whole body was before). Each piece's nesting is
    checked as it is decoded, against the levels left where it lies (``room``: the
    levels a value may nest, itself included)."""

    __slots__ = ("holding", "since")

    def __init__(self) -> None:
        self.since = 0  # bytes walked since the last checkpoint
        self.holding = False  # a place among the objects of many members decoded at once

    async def _spent(self, size: int) -> None:
        self.since += size
        if self.since >= PIECE_BYTES:
            self.since = 0
            await trio.lowlevel.checkpoint()

    async def _piece(self, raw: Any, room: int) -> Any:
        raw = bytes(raw)  # (a msgspec.Raw: a view of the body)
        if nested_deeper_than(raw, room):
            raise _too_deep()
        value = decoder_for(raw)(raw)
        await self._spent(len(raw))
        return value

    async def value(self, raw: msgspec.Raw, room: int, splits: int) -> Any:
        if len(raw) <= PIECE_BYTES or splits <= 0 or in_one_go(raw):
            return await self._piece(raw, room)
        first = memoryview(raw)[0]
        if first == _OPEN_ARRAY:
            items = _split_array(raw)
            await self._spent(len(raw))
            return await self.array(items, room, splits - 1)
        if first == _OPEN_OBJECT:
            return await self.members(bytes(raw), room, splits - 1)
        return await self._piece(raw, room)  # a long string

    async def members(self, text: bytes, room: int, splits: int) -> dict[str, Any]:
        """The object ``text``, its members decoded a batch at a time, as slices of its text
        (no key made a Python string but a large value's), ``room`` levels left for it.
        ``msgspec.json.format`` checks the object's structure as it compacts it, so its items
        alternate key and value and each member ends in a comma or the closing brace; each
        batch is decoded (and its values checked) by msgspec. Only the items' sizes outlive
        the split's step (4 bytes an item: the items themselves are ~80, and pieces of many
        bodies interleave)."""
        if room < 1:
            raise _too_deep()
        text = msgspec.json.format(text, indent=-1)  # (in C: no whitespace between its tokens)
        await self._spent(len(text))
        sizes = array.array("I", map(len, _split_array(text.translate(_AS_ARRAY))))
        await self._spent(len(text))
        if len(sizes) <= 2 * PIECE_MEMBERS or self.holding:  # (an object of a few members and a long text...)
            return await self._batches(text, sizes, room, splits)
        async with per_run(_MANY_MEMBERS, lambda: trio.Semaphore(2)):
            self.holding = True
            try:
                return await self._batches(text, sizes, room, splits)
            finally:
                self.holding = False

    async def _batches(self, text: bytes, sizes: array.array, room: int, splits: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        start = at = 1  # the batch's first byte; the next item's
        for i in range(0, len(sizes), 2):
            key, value = sizes[i], sizes[i + 1]
            value_at = at + key + 1
            end = value_at + value  # the member's end: a comma or the closing brace follows
            if value > PIECE_BYTES:
                if at > start:
                    out.update(await self._piece(b"{" + text[start : at - 1] + b"}", room))
                out[_decode_key(text[at : at + key])] = await self.value(text[value_at:end], room - 1, splits)
                start = end + 1
            elif end - start >= PIECE_BYTES:
                out.update(await self._piece(b"{" + text[start:end] + b"}", room))
                start = end + 1
            at = end + 1
        if at - 1 > start:
            out.update(await self._piece(b"{" + text[start : at - 1] + b"}", room))
        return out

    async def array(self, items: list[msgspec.Raw], room: int, splits: int) -> list[Any]:
        """The array of ``items``, ``room`` levels left for it."""
        if room < 1:
            raise _too_deep()
        out: list[Any] = []
        batch = _Batch(b"[", b"]")
        for item in items:
            if len(item) <= PIECE_BYTES:
                if batch.add(item):
                    out += await self._piece(batch.take(), room)
                continue
            if batch.parts:
                out += await self._piece(batch.take(), room)
            out.append(await self.value(item, room - 1, splits))
        if batch.parts:
            out += await self._piece(batch.take(), room)
        return out

    async def object(
        self,
        members: dict[str, msgspec.Raw],
        room: int,
        splits: int,
        lists: dict[str, list[msgspec.Raw] | None] | None = None,
    ) -> dict[str, Any]:
        """The object of ``members`` (each value as its text; ``lists``: some already split
        into their items), ``room`` levels left for it."""
        if room < 1:
            raise _too_deep()
        out: dict[str, Any] = {}
        batch = _Batch(b"{", b"}")
        for key, value in members.items():
            items = lists.get(key) if lists else None
            if items is None and len(value) <= PIECE_BYTES:
                if batch.add(_encode_key(key) + b":" + bytes(value)):
                    out.update(await self._piece(batch.take(), room))
                continue
            if batch.parts:
                out.update(await self._piece(batch.take(), room))
            if items is not None:
                out[key] = await self.array(items, room - 1, splits)
            else:
                out[key] = await self.value(value, room - 1, splits)
        if batch.parts:
            out.update(await self._piece(batch.take(), room))
        return out


class _Batch:
    """Small items of one array (or members of one object), gathered into one piece."""

    __slots__ = ("close", "open", "parts", "size")

    def __init__(self, open_: bytes, close: bytes) -> None:
        self.open, self.close = open_, close
        self.parts: list[Any] = []
        self.size = 0

    def add(self, part: Any) -> bool:
        """True once the batch holds :data:`PIECE_BYTES` or more."""
        self.parts.append(part)
        self.size += len(part) + 1
        return self.size >= PIECE_BYTES

    def take(self) -> bytes:
        """The batch as one JSON text; it starts again empty."""
        text = self.open + b",".join(self.parts) + self.close
        self.parts, self.size = [], 0
        return text


_encode_key = msgspec.json.Encoder().encode


# Content parts (text, image, tool-result blocks...) in one request, in all its messages: past
# this a 400 before any walk of them (200,000 empty parts, 6 MB, held the event loop a second).
MAX_CONTENT_PARTS = 10_000

# A chat tool message carries text only: the images of the Messages API's tool results and
# of the Responses API's function outputs go in a user message after the results, each
# result's after a line naming it, and the result's text says where they went.
TOOL_IMAGE_NOTE = "[image: in the user message after the tool results]"
UPLOADED_IMAGE_NOTE = "[image omitted: this edge passes no uploaded files to the model]"


_DATA_URL = re.compile(r"data:(image|video|audio)/[a-z0-9.+-]{1,32};base64,", re.IGNORECASE)
# A content part's media a model server fetches by URL (vLLM's: an image_url part may come
# without its type; video_url and audio_url are fetched the same way), by the key holding it.
MEDIA_URL_PARTS = {"image_url": "image", "video_url": "video", "audio_url": "audio"}


def image_url_problem(url: Any, kind: str = "image") -> str | None:
    """Why a media URL (an image's, or a ``kind``'s) is refused, or None: one that is not
    ``https://``, ``http://`` or a base64 ``data:`` URL of that kind (as OpenAI's and
    Anthropic's APIs answer). The model server reads the URL itself, from the node's
    network: ``file:///etc/passwd`` and ``gopher://`` went on to it (found from outside)."""
    if not isinstance(url, str):
        return "expected a string"
    head = url[:8].lower()
    if head.startswith(("https://", "http://")):
        return None
    data = _DATA_URL.match(url, 0, 64)
    if data is not None and data.group(1).lower() == kind:
        return None
    scheme = url[: url.find(":", 0, 32) + 1] or url[:16]
    article = "an" if kind[0] in "aeiou" else "a"
    return f"{article} {kind}'s URL must be https://, http:// or a data:{kind}/...;base64, URL, not {scheme!r}"


def tool_images_head(call_id: str) -> dict[str, Any]:
    """The text part before a tool result's images, in the user message after the results
    (the client's id, cut: a call id of megabytes is not sent twice)."""
    return {"type": "text", "text": f"[images of the tool result {call_id[:256]}]"}


def check_content_parts(messages: Any, param: str = "messages") -> None:
    """A 400 when ``messages`` (a list of dicts, each with a ``content``) hold
    more than :data:`MAX_CONTENT_PARTS` parts (or items) in all, a part's own
    ``content`` list (a tool result's blocks) counted too."""
    if not isinstance(messages, list):
        return
    total = len(messages)
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            total += len(content)
            for part in content:
                inner = part.get("content") if isinstance(part, dict) else None
                if isinstance(inner, list):
                    total += len(inner)
        if total > MAX_CONTENT_PARTS:
            break
    if total > MAX_CONTENT_PARTS:
        raise errors.bad_request(
            f"Too many content parts: {total} in all (at most {MAX_CONTENT_PARTS}).", param, "too_many_content_parts"
        )


def check_message_count(items: Any, max_messages: int, param: str) -> None:
    """A 400 when a front door's own list (Messages' ``messages``, Responses'
    ``input``) is longer than ``max_messages``: counted as the client sent it,
    not as chat messages (each tool result becomes one there)."""
    if isinstance(items, list) and len(items) > max_messages:
        raise errors.bad_request(
            f"Too many messages: {len(items)} (at most {max_messages}).", param, "too_many_messages"
        )


def check_tool_count(tools: Any, max_tools: int) -> None:
    """A 400 when a body's ``tools`` list is longer than ``max_tools``, counted before any tool
    is read or translated (100,000 tools in a 5.5 MB body took the loop 0.7-1.0 s on the
    Messages API, translated and converted, before the count refused them)."""
    if isinstance(tools, list) and len(tools) > max_tools:
        raise errors.bad_request(f"Too many tools: {len(tools)} (at most {max_tools}).", "tools", "too_many_tools")


def parse_chat_request(
    raw: dict[str, Any],
    *,
    max_messages: int,
    max_tools: int,
    max_output_tokens: int | None = None,
    paired: bool = False,
) -> tuple[ChatRequest, dict[str, Any]]:
    """The validated request, and the body to forward (edge-only keys removed).
    ``paired``: its tool results answer the calls before them (:func:`_check_tool_pairs`).

    Raises :class:`edge.errors.APIError` (400) naming the offending field.
    """
    check_message_count(raw.get("messages"), max_messages, "messages")  # (counted before they are read)
    check_tool_count(raw.get("tools"), max_tools)
    check_content_parts(raw.get("messages"))
    try:
        req = msgspec.convert(raw, ChatRequest)
        if isinstance(req.tool_choice, dict):
            msgspec.convert({"tool_choice": req.tool_choice}, ToolChoiceShape)
        if req.response_format is not None:
            msgspec.convert({"response_format": req.response_format}, ResponseFormatShape)
    except msgspec.ValidationError as e:
        message, param = _validation_message(e)
        if param == "response_format.type":
            message = f"{message[:-1]} (expected text, json_object, json_schema or structural_tag)."
        raise errors.bad_request(message, param) from None
    _check_text_parts(req)
    _check_unsupported(req)
    if paired:
        _check_tool_pairs(req.messages)
    if max_output_tokens is not None:
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(req, name)
            if value is not None and value > max_output_tokens:
                raise errors.bad_request(
                    f"Invalid value for `{name}`: this edge allows at most {max_output_tokens}.",
                    name,
                    "integer_above_max_value",
                )
    forward = {k: v for k, v in raw.items() if k not in EDGE_ONLY_FIELDS}
    order = _results_in_call_order(req.messages)
    if order is not None:
        req.messages = [req.messages[i] for i in order]
        forward["messages"] = [raw["messages"][i] for i in order]
    reasoning = forward.get("reasoning")
    if isinstance(reasoning, dict) and set(reasoning) <= {"exclude"}:
        del forward["reasoning"]
    return req, forward


def merge_turns(messages: list[dict[str, Any]], roles: tuple[str, ...] = ("assistant",)) -> list[dict[str, Any]]:
    """Consecutive messages of one of ``roles`` (of another API's request, translated) as one:
    their texts joined by a blank line, their calls in order, as Anthropic merges consecutive
    turns of one role. Kept apart, a call's results came after a later turn (a 400 for Claude Code's
    history of a text turn between two of calls; a Responses preamble message between two
    calls left the first call's result behind the second's). ``roles``: the roles merged so
    (the Messages API's user turns too, as Anthropic merges them: two in a row went upstream
    apart, and a chat template that wants roles to alternate, Gemma's, refused them)."""
    out: list[dict[str, Any]] = []
    i, n = 0, len(messages)
    while i < n:
        j = i + 1
        role = messages[i]["role"]
        if role in roles:
            while j < n and messages[j]["role"] == role:
                j += 1
        out.append(messages[i] if j == i + 1 else _merged(messages[i:j]))
        i = j
    return out


def _merged(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """One message of ``turns`` (of one role), each content read once (folding them pairwise
    copied the text and parts so far at every turn: quadratic in a long run)."""
    merged = dict(turns[0])
    contents = [t.get("content") for t in turns]
    said = [c for c in contents if c]
    if not said:
        merged["content"] = "" if any(c is not None for c in contents) else None
    elif all(isinstance(c, str) for c in said):
        merged["content"] = "\n\n".join(said)
    else:
        parts: list[Any] = []
        for c in said:
            if isinstance(c, str):
                parts.append({"type": "text", "text": c})
            else:
                parts.extend(c)
        merged["content"] = parts
    calls = [call for t in turns for call in t.get("tool_calls") or ()]
    if calls:
        merged["tool_calls"] = calls
    return merged


def _results_in_call_order(messages: list[Message]) -> list[int] | None:
    """The messages' order with each run of tool results in the order of the
    calls they answer (the assistant message before them), or None if it is so
    already. A coding agent sends results as its tools finish (Claude Code's
    Read before its Bash); a chat template that shows results by position, and
    a text-tools prompt, would give the model one call's output as another's."""
    order: list[int] | None = None
    i, n = 0, len(messages)
    while i < n:
        calls = messages[i].tool_calls
        i += 1
        if not calls or messages[i - 1].role != "assistant":
            continue
        start = i
        while i < n and messages[i].role == "tool":
            i += 1
        if i - start < 2:
            continue
        rank: dict[str, int] = {}
        for k, call in enumerate(calls):
            if isinstance(call_id := call.get("id"), str):  # (any JSON value: a list is no key)
                rank.setdefault(call_id, k)
        run = sorted(range(start, i), key=lambda j: rank.get(messages[j].tool_call_id, len(calls)))
        if run != list(range(start, i)):
            order = order if order is not None else list(range(n))
            order[start:i] = run
    return order


NO_LOGPROBS = "This edge does not return log probabilities (its nodes do not relay them): {fix}."


def _check_unsupported(req: ChatRequest) -> None:
    """A 400 for what would change the answer but cannot be honoured: log
    probabilities (the answer would say ``logprobs: null``), and a tool call
    required with no tools to call (OpenAI refuses it too)."""
    if req.logprobs:
        raise errors.bad_request(
            NO_LOGPROBS.format(fix="leave out `logprobs`, or set it to false"), "logprobs", "unsupported_parameter"
        )
    if req.top_logprobs:
        raise errors.bad_request(
            NO_LOGPROBS.format(fix="leave out `top_logprobs`, or set it to 0"), "top_logprobs", "unsupported_parameter"
        )
    if not req.tools and (req.tool_choice == "required" or isinstance(req.tool_choice, dict)):
        raise errors.bad_request(
            "Invalid value for `tool_choice`: a required or named tool call needs `tools`.", "tool_choice"
        )


# Roles whose message must say something (an assistant's may be its calls alone; a function's,
# OpenAI's deprecated form, is left as model servers take it).
_CONTENT_REQUIRED = frozenset(("system", "developer", "user", "tool"))


def _check_text_parts(req: ChatRequest) -> None:
    """A content part's ``text`` is a string (every adapter joins them), and a
    text part has one (as OpenAI's API answers); so is a tool call's function name.
    A message has ``content`` (but an assistant's), a tool result its ``tool_call_id``,
    and ``stream_options`` come with ``stream``, as OpenAI and vLLM answer: each was served."""
    if req.stream_options is not None and not req.stream:
        raise errors.bad_request(
            "Invalid value for `stream_options`: it is only allowed when `stream` is true.", "stream_options"
        )
    for i, message in enumerate(req.messages):
        if message.content is None and message.role in _CONTENT_REQUIRED:
            raise errors.bad_request(f"Missing required parameter: `messages[{i}].content`.", f"messages[{i}].content")
        if message.role == "tool" and not message.tool_call_id:
            param = f"messages[{i}].tool_call_id"
            raise errors.bad_request(f"Missing required parameter: `{param}` (the id of the call it answers).", param)
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if "text" in part and not isinstance(part["text"], str):
                    param = f"messages[{i}].content[{j}].text"
                    raise errors.bad_request(f"Invalid value for `{param}`: expected a string.", param)
                if "text" not in part and part.get("type") == "text":
                    param = f"messages[{i}].content[{j}].text"
                    raise errors.bad_request(f"Missing required parameter: `{param}`.", param)
                for name, kind in MEDIA_URL_PARTS.items():  # (whatever the part's type says)
                    if name in part:
                        media = part[name]
                        if media is None and isinstance(part.get("uuid"), str):
                            continue  # (vLLM's: media it has cached, by its uuid)
                        problem = image_url_problem(media.get("url") if isinstance(media, dict) else media, kind)
                        if problem is not None:
                            param = f"messages[{i}].content[{j}].{name}" + (".url" if isinstance(media, dict) else "")
                            code = "invalid_image_url" if kind == "image" else "invalid_media_url"
                            raise errors.bad_request(f"Invalid value for `{param}`: {problem}.", param, code)
        for j, call in enumerate(message.tool_calls or ()):
            # A history's tool call names its function, a string (as OpenAI's API answers): one
            # without was a 500 for a native_tools = false model, whose prompt shows each by name.
            function = call.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                param = f"messages[{i}].tool_calls[{j}].function.name"
                raise errors.bad_request(f"Missing required parameter: `{param}` (a string).", param)


def _check_tool_pairs(messages: list[Message]) -> None:
    """A tool result answers a call of the assistant message just before it (other results
    between), and every call of such a message has its result, as OpenAI's API answers (with
    these messages): a model server shown a result for no call, or a call with none, answers
    from a history no model was trained on, or refuses it in its own words. Calls without
    string ids (no client sends them) are not held to it."""
    unanswered: set[str] | None = None  # the calls of the assistant message at ``at`` not answered yet
    asked: frozenset[str] = frozenset()  # ...and all its calls
    at = -1
    for i, message in enumerate(messages):
        if message.role == "tool":
            if at < 0:
                raise errors.bad_request(
                    "Invalid parameter: messages with role 'tool' must be a response to a preceeding message"
                    " with 'tool_calls'.",
                    f"messages[{i}].role",
                )
            if unanswered is not None:
                if message.tool_call_id not in unanswered:
                    said = (
                        "answers a call of the previous message that an earlier tool message answered"
                        if message.tool_call_id in asked
                        else "not found in 'tool_calls' of previous message"
                    )
                    raise errors.bad_request(
                        f"Invalid parameter: 'tool_call_id' of {_shown(message.tool_call_id)} {said}.",
                        f"messages[{i}].tool_call_id",
                    )
                unanswered.discard(message.tool_call_id)
            continue
        _check_answered(unanswered, at)
        at, unanswered = -1, None
        if message.role == "assistant" and message.tool_calls:
            at = i
            ids = [call.get("id") for call in message.tool_calls]
            unanswered = set(ids) if all(isinstance(call_id, str) for call_id in ids) else None
            asked = frozenset(unanswered or ())
    _check_answered(unanswered, at)


def _check_answered(unanswered: set[str] | None, at: int) -> None:
    if unanswered:
        ids = sorted(unanswered)
        named = ", ".join(_shown(call_id) for call_id in ids[:8])
        if len(ids) > 8:
            named += f" and {len(ids) - 8} more"
        raise errors.bad_request(
            "An assistant message with 'tool_calls' must be followed by tool messages responding to each"
            f" 'tool_call_id'. The following tool_call_ids did not have response messages: {named}",
            f"messages[{at}].role",
        )


def _shown(call_id: str | None) -> str:
    """A client's id in an error, cut short (an id may be a megabyte)."""
    text = repr(call_id)
    return text if len(text) <= 66 else f"{text[:64]}…"


def estimate_input_tokens(req: ChatRequest) -> int:
    """A cheap, documented estimate: characters of text content, names and
    tool definitions divided by 4, plus 4 per message. Images count as 0."""
    chars = 0
    for message in req.messages:
        content = message.content
        if isinstance(content, str):
            chars += len(content)
        elif content:
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                if isinstance(text, str):
                    chars += len(text)
        if message.tool_calls:
            chars += len(msgspec.json.encode(message.tool_calls))
    if req.tools:
        chars += len(msgspec.json.encode(req.tools))
    return chars // 4 + 4 * len(req.messages)


def has_media(req: ChatRequest) -> bool:
    """The request has a content part that is not text (an image, audio, a file): its tokens
    are not in :func:`estimate_input_tokens`."""
    return any(
        not isinstance(part, dict) or part.get("type", "text") != "text"
        for message in req.messages
        if isinstance(message.content, list)
        for part in message.content
    )


def prompt_prefix(req: ChatRequest) -> tuple[tuple[int, ...], int]:
    """The request's prefix chain and its opening (:func:`edge.runs.placement.prompt_chain`)
    over what a chat template renders first: tool definitions, then each
    message's role and text (text parts joined; a non-text part counts by
    its type only), with its tool calls."""
    return prompt_chain(req.model, _rendered(req))


def _rendered(req: ChatRequest) -> Iterator[tuple[str, str]]:
    if req.tools:
        yield "tools", msgspec.json.encode(req.tools).decode()
    for message in req.messages:
        content = message.content
        if isinstance(content, str) or content is None:
            text = content or ""
        else:
            text = "".join(
                part["text"] if isinstance(part.get("text"), str) else f"<{part.get('type')}>"
                for part in content
                if isinstance(part, dict)
            )
        if message.tool_calls:
            text += msgspec.json.encode(message.tool_calls).decode()
        yield message.role, text


CONTEXT_CLASSES = ((4096, "small"), (32768, "medium"), (131072, "large"))


def context_class(tokens: int) -> str:
    for limit, name in CONTEXT_CLASSES:
        if tokens <= limit:
            return name
    return "xlarge"
