"""The Anthropic Messages API as a codec: no I/O, no clock, no tasks.

:func:`chat_body` decodes a Messages request into the chat path's request
(an OpenAI chat completion body, validated afterwards by
:func:`edge.openai.request.parse_chat_request`). :class:`MessageStream`
encodes what a run produced (thinking, text, tool calls, the end) as the
Messages API's server-sent events; :func:`message_body` as one ``message``
object. :func:`error_body` and :func:`stream_error` give errors Anthropic's
shape (``{"type": "error", "error": {"type", "message"}}``).

What the decoder does with each part of a request:

- ``system`` (a string or text blocks) and any ``role: "system"`` entry in
  ``messages`` become one leading system message; ``cache_control`` and other
  block fields the edge has no use for are ignored, and so is Claude Code's
  ``x-anthropic-billing-header:`` line at its start;
- ``text`` and ``image`` blocks (base64 or url) become content parts;
  ``tool_use`` blocks an assistant message's ``tool_calls``; ``tool_result``
  blocks ``tool`` messages (``is_error``, a boolean, marks the text); an assistant
  turn's ``thinking`` and ``redacted_thinking`` blocks (and server tool history) are
  not sent upstream (in a user turn, a 400);
- ``tools`` with ``input_schema`` become functions; server tools (a ``type``
  other than ``custom``) are not model tools and are left out;
- ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` become ``auto`` /
  ``required`` / the named function / ``none`` (``any`` or ``tool`` without
  ``tools`` is a 400, as Anthropic's); ``stop_sequences`` ``stop``;
  ``metadata.user_id`` is the session (affinity: :func:`session_id`), not sent
  upstream; ``thinking`` enabled or
  adaptive shows reasoning as thinking blocks, otherwise it is hidden (as
  Anthropic sends no thinking unless asked); it is checked as Anthropic does
  (a known type, ``budget_tokens`` of at least 1024 and below ``max_tokens``,
  and not with a ``tool_choice`` that forces a tool);
- ``output_config.format`` (structured outputs: ``messages.parse(output_format=...)``)
  becomes a ``json_schema`` ``response_format``, as does the beta's top-level
  ``output_format``; the rest of ``output_config`` (``effort``) is ignored;
- other top-level fields (``context_management``, ...) are ignored.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import jiter
import msgspec

from edge import errors
from edge.errors import APIError
from edge.openai.request import (
    TOOL_IMAGE_NOTE,
    UPLOADED_IMAGE_NOTE,
    check_content_parts,
    image_url_problem,
    merge_turns,
    tool_images_head,
)
from edge.openai.schema import MAX_TOOL_NAME, UsageOut
from edge.openai.tools import id_key
from proto import ToolCall, jsoncost

_encode = msgspec.json.Encoder().encode

# -- decoding a request ----------------------------------------------------------


class MessageParam(msgspec.Struct):
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class MessagesRequest(msgspec.Struct):
    """The fields the edge reads; unknown ones are accepted and ignored."""

    model: Annotated[str, msgspec.Meta(min_length=1)]
    messages: list[MessageParam]
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    system: str | list[dict[str, Any]] | None = None
    stream: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's place for it


# History blocks that are never sent upstream: the model's own thinking, and
# server tools' calls and results (the edge runs no server tools).
_SKIPPED_BLOCKS = frozenset(
    {"thinking", "redacted_thinking", "server_tool_use", "web_search_tool_result", "web_fetch_tool_result"}
)


def _bad(message: str, param: str) -> APIError:
    return errors.bad_request(message, param)


def _block_type(block: dict[str, Any], where: str) -> str:
    """A content block's ``type``, a string (a list there was a 500: an outside audit)."""
    kind = block.get("type")
    if not isinstance(kind, str):
        raise _bad(f"Invalid value for `{where}.type`: expected a string.", f"{where}.type")
    return kind


def _text_of(block: dict[str, Any], param: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad(f"Invalid value for `{param}.text`: expected a string.", param)
    return text


# Claude Code opens its system prompt with a line for Anthropic's billing, whose last three hex
# digits come from the session's first message: every session's prompt differed from the
# first line on, so no model server's prefix cache (nor the edge's prefix routing) could serve
# one session from another's (673 against 68 ms to the first token on a prefix-cached sim).
# Anthropic's API reads it and leaves it out of the prompt; so does the edge.
# The line, as Claude Code writes it: "x-anthropic-billing-header: cc_version=2.1.197.40f;
# cc_entrypoint=sdk-cli;" (its fields name=value;), and the blank lines after it. Looked for in
# the first KiB only (8 MB of a system that starts so and runs on cost 0.4 s of the event loop).
_BILLING = "x-anthropic-billing-header:"
_BILLING_FIELD = re.compile(r" *[\w.-]+=[^\r]*")  # (one field, its ";" split off: nothing to backtrack)
_BILLING_MAX = 1024


def _without_billing_line(text: str) -> str:
    """``text`` without the billing line: its name=value fields, each ending in ";" (the last
    may not), then blanks and the line's end (``\r\n`` too)."""
    if not text.startswith(_BILLING):
        return text
    end = text.find("\n", 0, _BILLING_MAX)
    if end < 0:
        end = len(text)
    if end > _BILLING_MAX:
        return text
    fields = text[len(_BILLING) : end].rstrip("\r").rstrip(" \t").split(";")
    if fields[-1] == "":
        fields.pop()
    if not all(_BILLING_FIELD.fullmatch(field) for field in fields):
        return text
    return text[end:].lstrip("\r\n")


def _system_text(system: str | list[dict[str, Any]], param: str) -> str:
    if isinstance(system, str):
        return _without_billing_line(system)
    parts = []
    for i, block in enumerate(system):
        if block.get("type") != "text":
            raise _bad(f"Invalid value for `{param}[{i}]`: system blocks must be text blocks.", f"{param}[{i}]")
        text = _text_of(block, f"{param}[{i}]")
        if i == 0:
            text = _without_billing_line(text)
        if text:
            parts.append(text)
    return "\n\n".join(parts)


IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")  # a base64 image's, as Anthropic takes


def _image_source(block: dict[str, Any]) -> str | None:
    """The kind of an image block's source the edge passes on (base64, url), or None."""
    source = block.get("source")
    if not isinstance(source, dict):
        return None
    kind = source.get("type")
    if kind == "base64" and isinstance(source.get("data"), str) or kind == "url" and isinstance(source.get("url"), str):
        return kind
    return None


def _image_part(block: dict[str, Any], param: str) -> dict[str, Any]:
    kind = _image_source(block)
    if kind is None:
        raise _bad(f"Invalid value for `{param}.source`: expected a base64 or url image source.", param)
    source = block["source"]
    if kind == "base64":
        media = source.get("media_type")
        if media not in IMAGE_TYPES:  # (as Anthropic's API: "text/html" went on as an image's data URL)
            raise _bad(
                f"Invalid value for `{param}.source.media_type`: expected one of {', '.join(IMAGE_TYPES)}.", param
            )
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{source['data']}"}}
    problem = image_url_problem(source["url"])
    if problem is not None:
        raise _bad(f"Invalid value for `{param}.source.url`: {problem}.", f"{param}.source.url")
    return {"type": "image_url", "image_url": {"url": source["url"]}}


def _tool_result(block: dict[str, Any], param: str, images: list[dict[str, Any]]) -> str:
    """A ``tool_result`` as a chat tool message's text; its images are added to ``images``
    (a chat tool message carries text only: the images go in a user message after the
    results, where a vision model sees them: Claude Code's Read of a screenshot)."""
    content = block.get("content", "")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        pieces = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                pieces.append(_text_of(part, f"{param}.content[{j}]"))
            elif kind == "image" and _image_source(part) is not None:
                images.append(_image_part(part, f"{param}.content[{j}]"))
                pieces.append(TOOL_IMAGE_NOTE)
            elif kind == "image":  # (an uploaded file's id: nothing a model server can read)
                pieces.append(UPLOADED_IMAGE_NOTE)
            elif kind == "document":
                pieces.append(_document_text(part, f"{param}.content[{j}]"))
            elif kind == "search_result":
                pieces.append(_search_result_text(part))
            else:
                raise _bad(
                    f"Invalid value for `{param}.content[{j}]`: "
                    "expected a text, image, document or search_result block.",
                    param,
                )
        text = "\n".join(pieces)
    else:
        raise _bad(f"Invalid value for `{param}.content`: expected a string or blocks.", param)
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):  # ("yes" told the model a failed tool succeeded)
        raise _bad(f"Invalid value for `{param}.is_error`: expected a boolean.", f"{param}.is_error")
    if is_error:
        text = f"[tool error] {text}"
    return text


def _document_text(block: dict[str, Any], param: str) -> str:
    """A ``document`` block as text: a plain-text or content source inline,
    after its title; a PDF (base64, url) or an uploaded file (``file_id``, of
    a type the edge cannot know) as a note that it was left out, so the model
    can say so (Claude Code sends a PDF it reads as one, and again in every
    later request of the session)."""
    source = block.get("source")
    title = block.get("title") if isinstance(block.get("title"), str) else ""
    if isinstance(source, dict):
        kind = source.get("type")
        content = source.get("data") if kind == "text" else source.get("content") if kind == "content" else None
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        if isinstance(content, str):
            return f"[document: {title}]\n{content}" if title else content
        name = f" {title}" if title else ""
        media = source.get("media_type") if isinstance(source.get("media_type"), str) else None
        if kind == "file" and media is None:  # (a Files API upload: its type is the provider's to know)
            return f"[document{name} (an uploaded file) omitted: this edge passes no uploaded files to the model]"
        if kind in ("base64", "url", "file"):
            media = media or "application/pdf"  # (a url source is a PDF's)
            return f"[document{name} ({media}) omitted: this edge passes no PDF documents to the model]"
    raise _bad(f"Invalid value for `{param}.source`: expected a text, content, base64 or url document source.", param)


def _search_result_text(block: dict[str, Any]) -> str:
    """A ``search_result`` block (in a tool result) as text: its title and source, then its text."""
    head = " ".join(str(block[k]) for k in ("title", "source") if isinstance(block.get(k), str))
    content = block.get("content")
    texts = (
        [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        if isinstance(content, list)
        else []
    )
    return "\n".join([f"[search result: {head}]", *texts])


def _user_messages(
    content: list[dict[str, Any]], param: str, calls: set[str], answered: set[str]
) -> list[dict[str, Any]]:
    """A user message's blocks: ``tool`` messages for its tool results (first,
    right after the assistant's calls), then one user message for the rest:
    the results' images first, each result's after a line naming it. ``calls``:
    the ids of the assistant turn before its turn, ``answered`` those its turn
    answered so far (consecutive user messages are one turn, as Anthropic merges
    them): each result answers one of them, once, as Anthropic checks (an outside
    audit: a result sent again in the next user message, or after a later assistant
    text, went upstream as a second tool message, the latter after no calls at all)."""
    tool_messages: list[dict[str, Any]] = []
    tool_images: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        where = f"{param}[{i}]"
        kind = _block_type(block, where)
        if kind == "text":
            parts.append({"type": "text", "text": _text_of(block, where)})
        elif kind == "image":
            parts.append(_image_part(block, where))
        elif kind == "document":
            parts.append({"type": "text", "text": _document_text(block, where)})
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise _bad(f"Missing required parameter: `{where}.tool_use_id`.", where)
            if call_id in answered:  # (as Anthropic's 400: two results went upstream for one call)
                raise _bad(
                    f"Invalid value for `{where}`: each `tool_use` must have a single result. "
                    f"Found multiple `tool_result` blocks with id: {call_id[:64]}.",
                    where,
                )
            if call_id not in calls:
                raise _bad(
                    f"Invalid value for `{where}`: unexpected `tool_use_id` found in `tool_result` blocks: "
                    f"{call_id[:64]}. Each `tool_result` block must have a corresponding `tool_use` block "
                    "in the previous message.",
                    where,
                )
            answered.add(call_id)
            images: list[dict[str, Any]] = []
            tool_messages.append(
                {"role": "tool", "tool_call_id": call_id, "content": _tool_result(block, where, images)}
            )
            if images:
                tool_images += [tool_images_head(call_id), *images]
        elif kind in _SKIPPED_BLOCKS:  # (an assistant's blocks: such a turn was dropped unsaid, then "expected
            # `array` of length >= 1" for the messages a client did send; an outside audit)
            raise _bad(f"Invalid value for `{where}.type`: a user turn takes no `{kind}` blocks.", where)
        else:
            raise _bad(f"Invalid value for `{where}.type`: this edge does not take `{kind[:64]}` blocks.", where)
    if tool_images:
        parts = tool_images + parts
    if parts:
        return [*tool_messages, {"role": "user", "content": parts}]
    return tool_messages


def _assistant_message(content: list[dict[str, Any]], param: str, used: dict[str, str]) -> dict[str, Any]:
    """An assistant turn's blocks as one chat message: its texts, and its ``tool_use``
    blocks as ``tool_calls``. ``used``: where each ``tool_use`` id of the history so far
    was, since they must be unique, as Anthropic checks (an outside audit: two calls
    ``t1`` and one result went upstream; the pairing check compares the ids as sets)."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        where = f"{param}[{i}]"
        kind = _block_type(block, where)
        if kind == "text":
            texts.append(_text_of(block, where))
        elif kind == "tool_use":
            call_id, name = block.get("id"), block.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise _bad(f"Invalid value for `{where}`: a tool_use block needs an `id` and a `name`.", where)
            if call_id in used:
                raise _bad(
                    f"Invalid value for `{where}.id`: `tool_use` ids must be unique; "
                    f"{call_id[:64]} is also the id of `{used[call_id]}`.",
                    f"{where}.id",
                )
            used[call_id] = where
            arguments = block.get("input")
            if arguments is None:
                arguments = {}
            elif not isinstance(arguments, dict):  # (a list or number went to the model as its arguments)
                raise _bad(f"Invalid value for `{where}.input`: expected an object.", f"{where}.input")
            arguments = _encode(arguments).decode()
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind in _SKIPPED_BLOCKS:
            continue
        else:
            raise _bad(f"Invalid value for `{where}.type`: an assistant turn takes no `{kind[:64]}` blocks.", where)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _check_tool_results(messages: list[dict[str, Any]]) -> None:
    """Every ``tool_use`` but a last turn's is answered in the turn after it, as
    Anthropic checks (calls followed by a user's words fail or mislead chat templates
    upstream). Sets of ids suffice: the decoders refused a repeated ``tool_use`` id,
    and a result that answers no call of the turn before it, or one answered already."""
    for n, m in enumerate(messages):
        calls = m.get("tool_calls") or ()
        if calls and n + 1 < len(messages):
            answered = set()
            k = n + 1
            while k < len(messages) and messages[k]["role"] == "tool":
                answered.add(messages[k]["tool_call_id"])
                k += 1
            missing = [call["id"] for call in calls if call["id"] not in answered]
            if missing:
                shown = ", ".join(i[:64] for i in missing[:8]) + (", ..." if len(missing) > 8 else "")
                raise _bad(
                    f"`tool_use` ids were found without `tool_result` blocks immediately after: {shown}. "
                    "Each `tool_use` block must have a corresponding `tool_result` block in the next message.",
                    "messages",
                )


def _tools(tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    functions: list[dict[str, Any]] = []
    server: list[str] = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            server.append(str(tool.get("name") or kind))
            continue
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not isinstance(schema, dict):
            raise _bad(f"Invalid value for `tools[{i}]`: a tool needs a `name` and an `input_schema`.", f"tools[{i}]")
        if not 0 < len(name) <= MAX_TOOL_NAME:  # (here, named as Messages names it: chat's said `function.name`)
            where = f"tools[{i}].name"
            raise _bad(f"Invalid value for `{where}`: expected 1 to {MAX_TOOL_NAME} characters.", where)
        function: dict[str, Any] = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        functions.append({"type": "function", "function": function})
    return functions, server


def _tool_choice(choice: dict[str, Any], body: dict[str, Any], server: list[str]) -> None:
    kind = choice.get("type")
    name = choice.get("name")
    if kind == "auto":
        body["tool_choice"] = "auto"
    elif kind == "any":
        body["tool_choice"] = "required"
    elif kind == "none":
        body["tool_choice"] = "none"
    elif kind == "tool" and isinstance(name, str):
        if name in server and all(f["function"]["name"] != name for f in body["tools"]):
            body["tool_choice"] = "auto"  # (a server tool, left out with its kind: the model answers as it will)
        else:
            body["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        raise _bad("Invalid value for `tool_choice`: expected auto, any, none or tool with a name.", "tool_choice")
    if choice.get("disable_parallel_tool_use") is True:
        body["parallel_tool_calls"] = False


def _response_format(fmt: Any) -> dict[str, Any]:
    """Structured outputs' ``{"type": "json_schema", "schema": ...}`` as chat's
    ``response_format``, which the node passes to the model server (the
    Messages API names no schema: chat wants a name, so it is ``output``)."""
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _bad('output_config.format: expected {"type": "json_schema", "schema": {...}}.', "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


_THINKING_TYPES = ("enabled", "disabled", "adaptive")
MIN_THINKING_BUDGET = 1024  # Anthropic's least ``budget_tokens``


def _check_thinking(thinking: dict[str, Any]) -> None:
    """``thinking`` as Anthropic checks it (its 400s, in its words): a known
    ``type``; ``enabled`` with an integer ``budget_tokens`` of at least 1024
    (below ``max_tokens`` too: :func:`thinking_budget_problem`)."""
    kind = thinking.get("type")
    if kind not in _THINKING_TYPES:
        expected = ", ".join(f"'{t}'" for t in _THINKING_TYPES)
        raise _bad(
            f"thinking: Input tag {str(kind)[:64]!r} found using 'type' does not match any of the expected tags: "
            f"{expected}",
            "thinking.type",
        )
    if kind != "enabled":
        return
    budget = thinking.get("budget_tokens")
    if budget is None:
        raise _bad("thinking.enabled.budget_tokens: Field required", "thinking.budget_tokens")
    if type(budget) is not int:
        raise _bad("thinking.enabled.budget_tokens: Input should be a valid integer", "thinking.budget_tokens")
    if budget < MIN_THINKING_BUDGET:
        raise _bad(
            f"thinking.enabled.budget_tokens: Input should be greater than or equal to {MIN_THINKING_BUDGET}",
            "thinking.budget_tokens",
        )


def thinking_budget_problem(raw: dict[str, Any], beta: bytes) -> APIError | None:
    """A message request (checked by :func:`chat_body`) whose thinking budget is
    not below its ``max_tokens``: Anthropic's 400, unless interleaved thinking is
    on (its ``interleaved-thinking-*`` beta, in ``anthropic-beta``, lets the
    budget pass ``max_tokens``)."""
    thinking, max_tokens = raw.get("thinking"), raw.get("max_tokens")
    budget = thinking.get("budget_tokens") if isinstance(thinking, dict) and thinking.get("type") == "enabled" else None
    if budget is None or max_tokens is None or budget < max_tokens or b"interleaved-thinking" in beta:
        return None
    return _bad(
        "`max_tokens` must be greater than `thinking.budget_tokens`. Please consult our documentation at "
        "https://docs.claude.com/en/docs/build-with-claude/extended-thinking#max-tokens-and-context-window-size",
        "max_tokens",
    )


def chat_body(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The chat completion body for a Messages request, and the names of the
    server tools left out of it. Raises :class:`APIError` (400)."""
    check_content_parts(raw.get("messages"))
    try:
        req = msgspec.convert(raw, MessagesRequest)
    except msgspec.ValidationError as e:
        raise errors.bad_request(f"Invalid request: {e}.") from None
    if req.thinking is not None:
        _check_thinking(req.thinking)
    system: list[str] = []
    if req.system:
        system.append(_system_text(req.system, "system"))
    messages: list[dict[str, Any]] = []
    used: dict[str, str] = {}  # tool_use id -> where it was
    calls: set[str] = set()  # the ids of the last assistant turn's calls
    answered: set[str] = set()  # those the user turn after it answered
    turn = None  # the role of the turn so far (messages of one role in a row are one turn)
    for i, message in enumerate(req.messages):
        param = f"messages[{i}].content"
        content = message.content
        if message.role != "system" and message.role != turn:
            turn = message.role
            (calls if turn == "assistant" else answered).clear()
        if message.role == "system":
            system.append(_system_text(content, param))
        elif not content and message.role == "user":
            # Anthropic's 400 (an outside audit: a lone `[]` left no message, so the 400 named
            # `messages`; after others it was dropped, and `""` went upstream). An empty assistant
            # turn is taken: as the last, a prefill; before it, the edge's own empty answer (a model
            # that said nothing), which a client sends back in its history.
            raise _bad(f"Invalid value for `{param}`: a user message must have non-empty content.", param)
        elif isinstance(content, str):
            messages.append({"role": message.role, "content": content})
        elif message.role == "user":
            messages.extend(_user_messages(content, param, calls, answered))
        else:
            messages.append(_assistant_message(content, param, used))
            calls.update(call["id"] for call in messages[-1].get("tool_calls", ()))
    if not messages:  # (Anthropic's 400: a system prompt alone went on as a chat of one system message)
        raise _bad("messages: at least one user or assistant message is required.", "messages")
    messages = merge_turns(messages, ("assistant", "user"))
    _check_tool_results(messages)
    system = [text for text in system if text]  # (a system of the billing line alone is none)
    if system:
        messages.insert(0, {"role": "system", "content": "\n\n".join(system)})
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": bool(req.stream)}
    for name in ("max_tokens", "temperature", "top_p", "top_k"):
        value = getattr(req, name)
        if value is not None:
            body[name] = value
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    server: list[str] = []
    forced = (req.tool_choice or {}).get("type") in ("any", "tool")
    if not req.tools and forced:
        raise _bad("tool_choice: `any` and `tool` need `tools` (a tool the model must call).", "tool_choice")
    if forced and (req.thinking or {}).get("type") in ("enabled", "adaptive"):  # (Anthropic's 400, its words)
        raise _bad("Thinking may not be enabled when tool_choice forces tool use.", "tool_choice")
    if req.tools:
        functions, server = _tools(req.tools)
        if functions:
            body["tools"] = functions
            if req.tool_choice is not None:
                _tool_choice(req.tool_choice, body, server)
    fmt = (req.output_config or {}).get("format")
    fmt = req.output_format if fmt is None else fmt
    if fmt is not None:
        body["response_format"] = _response_format(fmt)
    thinking = (req.thinking or {}).get("type")
    body["include_reasoning"] = thinking in ("enabled", "adaptive")
    session_id(raw)  # (checked here, for count_tokens too; it is in no body: see session_id)
    return body, server


def session_id(raw: dict[str, Any]) -> str | None:
    """A request's ``metadata.user_id``: the session its runs keep to (a node's warm cache),
    or None. It is no chat ``user`` in the body sent upstream (an outside audit: Claude
    Code's, a JSON string of its device id, account uuid and session id, reached the model
    server); the issue asked only for session affinity."""
    metadata = raw.get("metadata")
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    if user is not None and not isinstance(user, str):  # (as Anthropic's; a number was taken and kept no session)
        raise _bad("Invalid value for `metadata.user_id`: expected a string.", "metadata.user_id")
    return user or None


# -- encoding a response -----------------------------------------------------------

_STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
    "refusal": "refusal",  # (the edge's own: see :func:`refused`)
}


def refused(finish_reason: str, refusal: str) -> str:
    """The finish of a run whose model declined (an OpenAI ``refusal``): ``refusal``,
    which is Anthropic's own ``stop_reason`` for it. One cut off stays ``length``."""
    return "refusal" if refusal and finish_reason == "stop" else finish_reason


def stop_reason(finish_reason: str) -> str:
    """A run's ``finish_reason`` as a Messages ``stop_reason`` (see :func:`stopped`)."""
    return _STOP_REASONS.get(finish_reason, "end_turn")


def stopped(finish_reason: str, stop: str, sequences: list[str] | None) -> tuple[str, str | None]:
    """``stop_reason`` and ``stop_sequence``: ``stop_sequence`` when the model
    server said which string ended the run (vLLM's ``stop_reason``, SGLang's
    ``matched_stop``) and it is one of the request's ``stop_sequences``; any
    other stop is ``end_turn``."""
    if finish_reason == "stop" and stop and sequences and stop in sequences:
        return "stop_sequence", stop
    return stop_reason(finish_reason), None


def tool_use_id(call_id: str) -> str:
    """A tool call's id as Anthropic clients expect it: ``toolu_…``, of the
    characters Anthropic's pattern takes (a client that sends the history on to
    Anthropic had its 400 for ``toolu_functions.Read:0``); sent back in the
    next request's history, it travels upstream as it is."""
    return "toolu_" + id_key(call_id)


def _input(arguments: str, budget: jsoncost.Budget) -> Any:
    try:
        value = budget.decode(arguments or "{}")
    except jsoncost.TooCostly:
        return {}
    except (msgspec.DecodeError, RecursionError):  # (msgspec's RecursionError: nested past ~1,000 levels)
        value = _partial(arguments)
    return value if isinstance(value, dict) else {}


def _partial(arguments: str) -> Any:
    """What a call cut off by ``max_tokens`` holds: ``{"city": "Paris", "u`` is
    ``{"city": "Paris"}``, as Anthropic's SDK reads the same call streamed (jiter's
    partial mode: an unfinished string is left out). JSON that is wrong, not only
    unfinished, or nested past jiter's 200 levels, holds nothing. Its size was
    charged to the budget by the decode that failed."""
    try:
        return jiter.from_json(arguments.encode(), partial_mode=True)
    except ValueError:
        return None


def _usage(usage: UsageOut) -> dict[str, Any]:
    """Anthropic counts cached prompt tokens apart: ``input_tokens`` are the others."""
    cached = (usage.prompt_tokens_details or {}).get("cached_tokens")
    if cached is None:
        out: dict[str, Any] = {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens}
    else:
        out = {
            "input_tokens": max(usage.prompt_tokens - cached, 0),
            "cache_read_input_tokens": cached,
            "output_tokens": usage.completion_tokens,
        }
    if usage.estimated:
        out["estimated"] = True
    return out


def message_body(
    message_id: str,
    model: str,
    *,
    reasoning: str | None,
    content: str,
    tool_calls: list[ToolCall] | None,
    finish_reason: str,
    usage: UsageOut,
    stop_sequence: str | None = None,
    refusal: str = "",
) -> bytes:
    """A whole response: one ``message`` object (``finish_reason`` and
    ``stop_sequence`` as :func:`stopped` gives them). A ``refusal`` is a text
    block of its own after the content (``finish_reason`` from :func:`refused`)."""
    blocks: list[dict[str, Any]] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if content:
        blocks.append({"type": "text", "text": content})
    if refusal:
        blocks.append({"type": "text", "text": refusal})
    budget = jsoncost.Budget()  # the calls' arguments together
    for call in tool_calls or ():
        blocks.append(
            {
                "type": "tool_use",
                "id": tool_use_id(call.id),
                "name": call.function.name,
                "input": _input(call.function.arguments, budget),
            }
        )
    return _encode(
        {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": blocks,
            "stop_reason": "stop_sequence" if stop_sequence is not None else stop_reason(finish_reason),
            "stop_sequence": stop_sequence,
            "usage": _usage(usage),
        }
    )


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _encode(data) + b"\n\n"


PING = _event("ping", {"type": "ping"})


_SIGNATURE_DELTA = (
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,'
    b'"delta":{"type":"signature_delta","signature":""}}\n\n'
)


class MessageStream:
    """The Messages API stream of one response, block by block: consecutive
    thinking (or text) pieces share a block; a change of kind closes it."""

    __slots__ = ("message_id", "model", "_index", "_open")

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model
        self._index = -1
        self._open: str | None = None  # the kind of the open block

    def start(self, input_tokens: int) -> bytes:
        """``message_start``; ``input_tokens`` is the edge's estimate (the
        final count comes in ``message_delta``)."""
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        }
        return _event("message_start", {"type": "message_start", "message": message})

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        # A thinking block ends with its signature, as Anthropic's always do (LangChain's
        # streamed thinking blocks had no `signature` key without it); the edge signs nothing.
        signed = _SIGNATURE_DELTA % self._index if self._open == "thinking" else b""
        self._open = None
        return signed + _event("content_block_stop", {"type": "content_block_stop", "index": self._index})

    def _begin(self, kind: str, block: dict[str, Any]) -> bytes:
        closed = self._close()
        self._index += 1
        self._open = kind
        return closed + _event(
            "content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block}
        )

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})

    def thinking(self, text: str) -> bytes:
        head = (
            b""
            if self._open == "thinking"
            else self._begin("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        )
        return head + self._delta({"type": "thinking_delta", "thinking": text})

    def text(self, text: str) -> bytes:
        if not text:
            return b""
        head = b"" if self._open == "text" else self._begin("text", {"type": "text", "text": ""})
        return head + self._delta({"type": "text_delta", "text": text})

    def refusal(self, text: str) -> bytes:
        """The model's refusal: a text block of its own."""
        return self._begin("text", {"type": "text", "text": ""}) + self._delta({"type": "text_delta", "text": text})

    def tool_use(self, call: ToolCall) -> bytes:
        head = self._begin(
            "tool_use", {"type": "tool_use", "id": tool_use_id(call.id), "name": call.function.name, "input": {}}
        )
        arguments = call.function.arguments or "{}"
        return head + self._delta({"type": "input_json_delta", "partial_json": arguments}) + self._close()

    def finish(self, finish_reason: str, usage: UsageOut, stop_sequence: str | None = None) -> bytes:
        """Close the open block; ``message_delta`` (stop reason, usage) and ``message_stop``."""
        reason = "stop_sequence" if stop_sequence is not None else stop_reason(finish_reason)
        delta = {"stop_reason": reason, "stop_sequence": stop_sequence}
        return (
            self._close()
            + _event("message_delta", {"type": "message_delta", "delta": delta, "usage": _usage(usage)})
            + _event("message_stop", {"type": "message_stop"})
        )

    def error(self, message: str, type: str, final: bool = False) -> bytes:
        """``event: error``. ``final``: no retry can help (an operator's cancel,
        tool calls still invalid): a block is complete before it (the open one,
        closed; else an empty text block), since Claude Code sends a turn whose
        stream failed before any block completed again, whole and unstreamed,
        whatever the error says; after one it gives up with the error."""
        if not final:
            return stream_error(message, type)
        if self._index < 0:
            closing = self._begin("text", {"type": "text", "text": ""}) + self._close()
        else:
            closing = self._close()
        return closing + stream_error(message, type)


# -- errors --------------------------------------------------------------------------

_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    499: "api_error",  # cancelled by an operator (not the client's doing)
    503: "overloaded_error",
    504: "timeout_error",  # (a run timed out: Anthropic's own type for a 504; it said api_error)
    529: "overloaded_error",
}
# The edge's own (OpenAI) error types, for an error inside a stream.
_TYPES = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "rate_limit_error": "rate_limit_error",
    "rate_limit_exceeded": "rate_limit_error",  # (a key's limit: the type its 429 has)
    "insufficient_quota": "rate_limit_error",  # a key's daily budget spent mid-stream (as its 429 before it)
    "service_unavailable_error": "overloaded_error",
    "timeout_error": "timeout_error",
}


def _error(type: str, message: str, details: dict[str, Any] | None = None) -> bytes:
    error: dict[str, Any] = {"type": type, "message": message}
    if details:
        error["details"] = details
    return _encode({"type": "error", "error": error})


def error_body(error: APIError) -> bytes:
    """An HTTP error in Anthropic's shape; the type follows the status."""
    status = error.status
    default = "invalid_request_error" if 400 <= status < 500 else "api_error"
    details = {"error_code": error.code} if error.code in _DETAILED_CODES else None
    return _error(_STATUS_TYPES.get(status, default), _message(error), details)


# Codes the Messages API puts in ``error.details`` (the SDK's thread helpers act on them).
_DETAILED_CODES = frozenset({"thread_not_found"})


def thread_problem(raw: dict[str, Any]) -> APIError | None:
    """A request that continues a stored thread (``thread: {"type": "continue"}``,
    which the SDK's tool runner sends after its first turn): this edge stores
    none, so it is ``thread_not_found``, on which the SDK sends the whole
    conversation again (and after a second, stops threading)."""
    thread = raw.get("thread")
    if isinstance(thread, dict) and thread.get("type") == "continue":
        return APIError(
            404,
            "This edge keeps no threads (it is stateless): send the whole conversation.",
            "not_found_error",
            param="thread",
            code="thread_not_found",
        )
    return None


def _message(error: APIError) -> str:
    """The error's message; a request too long for the context in Anthropic's
    words, which Claude Code reads (it retries with a smaller ``max_tokens``,
    or compacts the conversation)."""
    if error.context is None:
        if error.code == "context_length_exceeded":  # a model server's words, without its numbers
            return f"prompt is too long: {error.message}"
        return error.message
    prompt, max_tokens, limit = error.context
    if prompt >= limit:
        return f"prompt is too long: {prompt} tokens > {limit} maximum"
    return (
        f"input length and `max_tokens` exceed context limit: {prompt} + {max_tokens} > {limit}, "
        "decrease input length or `max_tokens` and try again"
    )


def stream_error(message: str, type: str, code: str | None = None) -> bytes:
    """An error after the stream started: ``event: error``, which ends it."""
    return b"event: error\ndata: " + _error(_TYPES.get(type, "api_error"), message) + b"\n\n"
