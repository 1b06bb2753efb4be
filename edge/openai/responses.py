"""The OpenAI Responses API as a codec over the chat path (sans-I/O).

    decode_request(raw, ...)  a ``POST /v1/responses`` body -> a chat completion
                              body (then :func:`parse_chat_request`, as chat)
    ResponseEncoder           what a run produced -> Responses SSE events
                              (``event:`` + ``data:``) or one ``response`` object

No sockets, clock or tasks here: the request's life (admission, runs, tool
validation and retries, shaping, keep-alives, cancellation) is the chat path's,
driven by :mod:`edge.openai.responses_route`.

Stateless: no response is stored (every response says ``store: false``), so
``previous_response_id``, ``conversation`` and stored ``prompt`` templates are
a 400; the output items of responses given with ``store`` not false are kept a
while (:mod:`edge.openai.items`), so that an ``item_reference`` to one becomes
the item again (a reference to an item the edge does not hold is a 400).
``function`` tools, and the functions of ``namespace`` tools (flattened to
``NAMESPACE__NAME``, :attr:`Decoded.namespaced`), are the model's tools; the
rest (``web_search``, ``file_search``, ``custom``, ...) are left out of the
request (:attr:`Decoded.ignored_tools`), never an error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from edge import errors
from edge.openai.request import (
    NO_LOGPROBS,
    TOOL_IMAGE_NOTE,
    UPLOADED_IMAGE_NOTE,
    check_content_parts,
    image_url_problem,
    merge_turns,
    tool_images_head,
)
from edge.openai.schema import MAX_TOOL_NAME, JsonSchemaFormat, UsageOut
from edge.openai.sse import KEEPALIVE
from proto import ToolCall

_encode = msgspec.json.Encoder().encode

STATELESS = (
    "This edge keeps no responses or conversations (it is stateless): "
    "send the full conversation in `input` instead of `{param}`."
)
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text")
_SKIPPED_ITEMS = ("reasoning",)  # the model's own reasoning: never sent back upstream


@dataclass
class Decoded:
    """A Responses request as the chat path's body, and what the response echoes."""

    chat: dict[str, Any]
    show_reasoning: bool = False
    ignored_tools: list[str] = field(default_factory=list)  # types of tools left out
    # A namespace's functions (Codex: MCP servers' tools, sub-agents) reach the model as one
    # function each, named NAMESPACE__NAME; a call of one goes back as (namespace, name).
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    ignored_items: list[str] = field(default_factory=list)  # types of input items left out
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response object repeats


def _bad(message: str, param: str | None) -> errors.APIError:
    return errors.bad_request(message, param)


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise _bad(f"Invalid value for `{param}`: expected a string.", param)
    return value


# Model servers' own request fields (vLLM, SGLang, llama.cpp, Ollama's OpenAI API): a Responses
# body's are forwarded as chat forwards them (they were dropped: chat_template_kwargs' enable_thinking
# did nothing). Only these: any other field could be one the Responses API has and a provider behind
# a node refuses by name ("Unrecognized request argument").
MODEL_SERVER_FIELDS = frozenset(
    {
        "top_k", "min_p", "typical_p", "repetition_penalty", "repeat_penalty", "repeat_last_n",
        "presence_penalty", "frequency_penalty", "length_penalty", "seed", "stop", "logit_bias",
        "min_tokens", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
        "include_stop_str_in_output", "chat_template_kwargs", "chat_template", "reasoning_effort",
        "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
        "structured_outputs", "regex", "ebnf", "json_schema", "grammar", "mirostat", "mirostat_tau",
        "mirostat_eta", "tfs_z", "dry_multiplier", "dry_base", "dry_allowed_length", "xtc_probability",
        "xtc_threshold", "cache_prompt", "priority", "separate_reasoning", "enable_thinking",
    }
)  # fmt: skip


Items = Callable[[str], "dict[str, Any] | None"]  # an item_reference's id -> the item it names


def decode_request(raw: dict[str, Any], *, max_output_tokens: int | None = None, items: Items | None = None) -> Decoded:
    """The chat completion body for a Responses request body. Raises
    :class:`edge.errors.APIError` (400) naming the Responses field at fault.
    ``items`` finds the items that ``item_reference`` input items name."""
    for param in ("previous_response_id", "conversation"):
        if raw.get(param) is not None:
            raise errors.APIError(
                400, STATELESS.format(param=param), "invalid_request_error", param=param, code="stateless_edge"
            )
    if raw.get("prompt") is not None:
        raise errors.APIError(
            400,
            "This edge keeps no stored prompts (it is stateless): send the prompt's text in `instructions` "
            "and `input` instead of `prompt`.",
            "invalid_request_error",
            param="prompt",
            code="stateless_edge",
        )
    if raw.get("background") is not None and raw["background"] is not False:
        raise errors.APIError(
            400,
            "This edge keeps no responses (it is stateless), so it cannot run one in the background: "
            "leave out `background`, or set it to false.",
            "invalid_request_error",
            param="background",
            code="stateless_edge",
        )
    _check_types(raw)
    _check_logprobs(raw)
    decoded = Decoded(chat={})
    chat = decoded.chat
    if "model" in raw:
        chat["model"] = raw["model"]
    messages: list[dict[str, Any]] = []
    instructions = raw.get("instructions")
    if instructions is not None:
        messages.append({"role": "system", "content": _text(instructions, "instructions")})
    check_content_parts(raw.get("input"), "input")
    messages.extend(_input_messages(raw.get("input"), decoded, items))
    if not any(m["role"] != "system" for m in messages):
        if decoded.ignored_items:  # (it said `input` was missing: its items were unknown, and left out)
            kinds = ", ".join(f"`{kind[:64]}`" for kind in dict.fromkeys(decoded.ignored_items[:16]))
            raise _bad(
                f"Invalid value for `input`: no item this edge can send (unsupported item types: {kinds}).", "input"
            )
        raise _bad("Missing required parameter: `input` (a string or a list of input items).", "input")
    _check_calls(messages)
    chat["messages"] = _one_leading_system(messages)
    if isinstance(raw.get("stream"), bool):
        chat["stream"] = raw["stream"]
    for name in ("temperature", "top_p"):
        if raw.get(name) is not None:
            chat[name] = raw[name]
    if raw.get("metadata") and raw.get("store") is True:
        # A response's metadata goes on with `store`, which chat wants beside it (OpenAI's chat is a 400
        # "The 'metadata' parameter is only allowed when 'store' is enabled" without: an outside audit).
        chat["metadata"], chat["store"] = raw["metadata"], True
    limit = raw.get("max_output_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise _bad("Invalid value for `max_output_tokens`: expected an integer >= 1.", "max_output_tokens")
        if max_output_tokens is not None and limit > max_output_tokens:
            raise errors.bad_request(
                f"Invalid value for `max_output_tokens`: this edge allows at most {max_output_tokens}.",
                "max_output_tokens",
                "integer_above_max_value",
            )
        chat["max_tokens"] = limit
    max_calls = raw.get("max_tool_calls")
    if max_calls is not None and (not isinstance(max_calls, int) or isinstance(max_calls, bool) or max_calls < 1):
        raise _bad("Invalid value for `max_tool_calls`: expected an integer >= 1.", "max_tool_calls")
    for name in ("user", "prompt_cache_key"):  # (as OpenAI's; a number was taken and kept no session)
        if raw.get(name) is not None and not isinstance(raw[name], str):
            raise _bad(f"Invalid value for `{name}`: expected a string.", name)
    # Forwarded as chat forwards them (`prompt_cache_key` went as `user`, the others not at all,
    # yet the response said the tier was served: an outside audit). The run's session is
    # `user`, else `prompt_cache_key` (Turn.session), as for chat.
    for name in ("user", "prompt_cache_key", "safety_identifier", "service_tier"):
        if raw.get(name):  # (an empty user is none)
            chat[name] = raw[name]
    _decode_tools(raw, decoded)
    _decode_text_format(raw.get("text"), chat)
    reasoning = raw.get("reasoning")
    summary = reasoning.get("summary") if isinstance(reasoning, dict) else None
    decoded.show_reasoning = summary is not None and summary != "none"
    chat["include_reasoning"] = decoded.show_reasoning  # the effort is ignored
    for name in MODEL_SERVER_FIELDS.intersection(raw):
        chat[name] = raw[name]
    decoded.echo = {
        "instructions": instructions,
        "max_output_tokens": limit,
        "max_tool_calls": max_calls,  # the turn returns no more calls than this (Turn.most_calls)
        "metadata": raw.get("metadata") if isinstance(raw.get("metadata"), dict) else {},
        "parallel_tool_calls": raw.get("parallel_tool_calls", True),
        "reasoning": {
            "effort": reasoning.get("effort") if isinstance(reasoning, dict) else None,
            "summary": summary,  # (as asked: "none" too, which was echoed as null)
        },
        "temperature": raw.get("temperature"),
        "text": raw.get("text") if isinstance(raw.get("text"), dict) else {"format": {"type": "text"}},
        "tool_choice": raw.get("tool_choice", "auto"),
        "tools": [
            t for t in raw.get("tools") or () if isinstance(t, dict) and t.get("type") in ("function", "namespace")
        ],
        "top_p": raw.get("top_p"),
        "user": raw.get("user"),
        # As sent (OpenAI's Response has them; they were left out: an outside audit). Their types
        # and values are checked above (_check_types).
        **{name: raw.get(name) for name in ("prompt_cache_key", "safety_identifier", "service_tier", "top_logprobs")},
    }
    return decoded


# -- input items ---------------------------------------------------------------------


def _input_messages(value: Any, decoded: Decoded, items: Items | None = None) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise _bad("Invalid value for `input`: expected a string or a list of input items.", "input")
    out: list[dict[str, Any]] = []
    inline: set[str] = set()  # the ids of items sent whole, and of those referenced
    referenced: set[str] = set()
    tool_images: list[dict[str, Any]] = []  # the images of the function outputs just read
    joinable: dict[str, Any] | None = None  # the user message of those images, until a user message joins it
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"Invalid value for `{param}`: expected an object.", param)
        kind = item.get("type", "message" if "role" in item else None)
        if not isinstance(kind, str):  # (an item of no type was dropped without a word: an outside audit)
            raise _bad(
                f"Missing required parameter: `{param}.type` (a string; or a message's `role`).", f"{param}.type"
            )
        if kind == "item_reference":
            _once(item.get("id"), referenced, inline, param)
            item = _referenced(item, param, items)
            kind = item.get("type")
        elif items is not None:
            _once(item.get("id"), inline, referenced, param)
        if tool_images and kind != "function_call_output":  # (the results' images, after the results)
            joinable = {"role": "user", "content": tool_images}
            out.append(joinable)
            tool_images = []
        if kind == "message":
            role = item.get("role")
            if role == "developer":
                role = "system"
            if role not in ("user", "assistant", "system"):
                raise _bad(f"Invalid value for `{param}.role`: expected user, assistant, system or developer.", param)
            content = _content(item.get("content"), f"{param}.content", role)
            if role == "user" and joinable is not None and out[-1] is joinable:  # one user turn, not two
                joinable["content"] += content if isinstance(content, list) else [{"type": "text", "text": content}]
            else:
                out.append({"role": role, "content": content})
        elif kind == "function_call":
            name = _text(item.get("name"), f"{param}.name")
            if isinstance(item.get("namespace"), str) and item["namespace"]:
                name = namespace_name(item["namespace"], name)
            call = {
                "id": _text(item.get("call_id"), f"{param}.call_id"),
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": _text(item.get("arguments", ""), f"{param}.arguments"),
                },
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # its text, or the calls before it
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            call_id = _text(item.get("call_id"), f"{param}.call_id")
            images: list[dict[str, Any]] = []
            text = output if isinstance(output, str) else _joined(output, f"{param}.output", images)
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
            if images:
                tool_images += [tool_images_head(call_id), *images]
        elif kind in _SKIPPED_ITEMS:
            continue
        else:  # (named in a 400 if nothing else is left, and in the log)
            decoded.ignored_items.append(kind)
    if tool_images:
        out.append({"role": "user", "content": tool_images})
    return merge_turns(out)


def _once(item_id: Any, mine: set[str], other: set[str], param: str) -> None:
    """An item both sent whole and referenced is a 400, as one referenced twice is (it reached
    the model twice: a call as two calls with one id)."""
    if not isinstance(item_id, str):
        return
    if item_id in other:
        raise errors.bad_request(
            f"Duplicate item found with id {item_id[:100]}: send each item once, whole or referenced.",
            param,
            "duplicate_item",
        )
    mine.add(item_id)


def _referenced(reference: dict[str, Any], param: str, items: Items | None) -> dict[str, Any]:
    """The item an ``item_reference`` names, from a response of this edge's (for this key)."""
    item_id = reference.get("id")
    if not isinstance(item_id, str) or not item_id:
        raise _bad(f"Missing required parameter: `{param}.id` (the referenced item's id).", f"{param}.id")
    found = items(item_id) if items is not None else None
    if found is None:
        raise errors.APIError(
            400,
            f"Item with id '{item_id[:100]}' not found: this edge keeps the output items of its own recent "
            "responses for an hour (in memory, for the key that made them, on this edge only). Send the "
            f"item itself in `{param}` instead of a reference to it (with the Vercel AI SDK: "
            "providerOptions.openai.store = false).",
            "invalid_request_error",
            param=param,
            code="item_not_found",
        )
    return found


def _one_leading_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Instructions and every developer/system message, in their order, as one
    system message first: many chat templates accept a system message only
    first, and only one (Codex sends a developer message mid-conversation when
    a session's sandbox or approvals change)."""
    system = [m for m in messages if m["role"] == "system"]
    if not system or (len(system) == 1 and messages[0] is system[0]):
        return messages
    joined = "\n\n".join(m["content"] for m in system if m["content"])
    return [{"role": "system", "content": joined}, *(m for m in messages if m["role"] != "system")]


def _check_calls(messages: list[dict[str, Any]]) -> None:
    """Every function call has its output and every output its call, as OpenAI
    checks (a chat template would fail on them, or the model be misled)."""
    called: dict[str, None] = {}
    answered: set[str] = set()
    for m in messages:
        for call in m.get("tool_calls") or ():
            if call["id"] in called:  # (two calls of one id went upstream, as one assistant turn)
                raise _bad(f"Duplicate function call with call_id {call['id'][:100]}: each is used once.", "input")
            called[call["id"]] = None
        if m["role"] == "tool":
            call_id = m["tool_call_id"]
            if call_id not in called:
                raise _bad(f"No tool call found for function call output with call_id {call_id}.", "input")
            if call_id in answered:
                raise _bad(f"Duplicate function call output for call_id {call_id[:100]}: one output a call.", "input")
            answered.add(call_id)
    for call_id in called:
        if call_id not in answered:
            raise _bad(f"No tool output found for function call {call_id}.", "input")


# Request fields of the Responses API the edge reads, and the JSON types each may be
# (a wrong one is a 400 naming it, as OpenAI's; ``None`` means left out).
_TYPES: dict[str, tuple[type, ...]] = {
    "stream": (bool,),
    "metadata": (dict,),
    "parallel_tool_calls": (bool,),
    "reasoning": (dict,),
    "text": (dict,),
    "tools": (list,),
    "include": (list,),
    "tool_choice": (str, dict),
    "store": (bool,),
    "top_logprobs": (int,),
    "prompt_cache_key": (str,),
    "safety_identifier": (str,),
    "service_tier": (str,),
}
_TOOL_CHOICES = ("auto", "none", "required")
_SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")
_JSON_TYPES = {list: "an array", str: "a string", int: "an integer", float: "a number", bool: "a boolean"}
_TEXT_FORMATS = ("text", "json_object", "json_schema")
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_SUMMARIES = ("auto", "concise", "detailed", "none")
_VERBOSITIES = ("low", "medium", "high")


def _check_types(raw: dict[str, Any]) -> None:
    for name, kinds in _TYPES.items():
        value = raw.get(name)
        if value is not None and (not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool))):
            wanted = " or ".join(
                {bool: "a boolean", dict: "an object", int: "an integer", list: "an array", str: "a string"}[k]
                for k in kinds
            )
            raise _bad(f"Invalid type for `{name}`: expected {wanted}.", name)
    metadata = raw.get("metadata") or {}
    if len(metadata) > 16:  # (OpenAI's bounds: 16 pairs, keys of 64 characters, string values of 512)
        raise _bad(f"Invalid `metadata`: at most 16 key-value pairs, got {len(metadata)}.", "metadata")
    for key, value in metadata.items():
        if len(key) > 64:
            raise _bad(f"Invalid `metadata`: a key is longer than 64 characters ({len(key)}).", "metadata")
        if not isinstance(value, str):  # (1 was a 200)
            raise _bad(f"Invalid type for `metadata.{key}`: expected a string.", f"metadata.{key}")
        if len(value) > 512:
            raise _bad(f"Invalid `metadata.{key}`: longer than 512 characters ({len(value)}).", f"metadata.{key}")
    tier = raw.get("service_tier")
    if isinstance(tier, str) and tier not in _SERVICE_TIERS:
        raise _bad(f"Invalid value for `service_tier`: expected one of {', '.join(_SERVICE_TIERS)}.", "service_tier")
    choice = raw.get("tool_choice")
    if isinstance(choice, str) and choice not in _TOOL_CHOICES:
        raise _bad(
            f"Invalid value for `tool_choice`: expected one of {', '.join(_TOOL_CHOICES)}, or an object.", "tool_choice"
        )
    if isinstance(choice, dict):
        if not isinstance(choice.get("type"), str):
            raise _bad("Missing required parameter: `tool_choice.type`.", "tool_choice.type")
        if choice["type"] == "function" and not (isinstance(choice.get("name"), str) and choice["name"]):
            raise _bad("Missing required parameter: `tool_choice.name`.", "tool_choice.name")
    fmt = raw["text"].get("format") if isinstance(raw.get("text"), dict) else None
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in _TEXT_FORMATS:
            raise _bad(
                f"Invalid value for `text.format.type`: expected one of {', '.join(_TEXT_FORMATS)}.", "text.format.type"
            )
        if fmt["type"] == "json_schema":
            try:  # (chat's rule, its one definition: the chat body made of it was refused naming `response_format`)
                msgspec.convert({"name": fmt.get("name")}, JsonSchemaFormat)
            except msgspec.ValidationError:
                raise _bad(
                    "Invalid value for `text.format.name`: 1 to 64 letters, digits, `_` or `-` (it is required).",
                    "text.format.name",
                ) from None
            schema = fmt.get("schema")
            if schema is None:  # (OpenAI's rule: chat's may be left out, this may not)
                raise _bad("Missing required parameter: `text.format.schema`.", "text.format.schema")
            if not isinstance(schema, dict):
                got = _JSON_TYPES.get(type(schema), type(schema).__name__)
                raise _bad(
                    f"Invalid type for `text.format.schema`: expected an object, but got {got} instead.",
                    "text.format.schema",
                )
    reasoning = raw["reasoning"] if isinstance(raw.get("reasoning"), dict) else {}
    for name, values in (("effort", _EFFORTS), ("summary", _SUMMARIES)):  # (any was a 200: an outside audit)
        value = reasoning.get(name)
        if value is not None and value not in values:
            param = f"reasoning.{name}"
            raise _bad(f"Invalid value for `{param}`: expected one of {', '.join(values)}.", param)


def _check_logprobs(raw: dict[str, Any]) -> None:
    """Log probabilities asked for are a 400: the nodes relay none, and an
    answer with ``logprobs: []`` would pass for one that had them."""
    if "message.output_text.logprobs" in (raw.get("include") or ()):
        raise errors.bad_request(
            NO_LOGPROBS.format(fix="leave `message.output_text.logprobs` out of `include`"),
            "include",
            "unsupported_parameter",
        )
    if raw.get("top_logprobs"):
        raise errors.bad_request(
            NO_LOGPROBS.format(fix="leave out `top_logprobs`, or set it to 0"), "top_logprobs", "unsupported_parameter"
        )


def _joined(parts: Any, param: str, images: list[dict[str, Any]]) -> str:
    """A tool output's parts as text, a line apart (as the Messages route joins a tool
    result's, and vLLM a message's; "Temperature: 18C.Sky: sunny." reached the model
    before: an outside audit); its images are added to ``images``, for the user message
    after the outputs (a chat tool message carries text only), and the text says so."""
    if not isinstance(parts, list):
        raise _bad(f"Invalid value for `{param}`: expected a string or a list of content parts.", param)
    texts = []
    for j, p in enumerate(parts):
        if isinstance(p, dict) and isinstance(p.get("text"), str):
            texts.append(p["text"])
        elif isinstance(p, dict) and p.get("type") in ("input_image", "image"):
            if isinstance(p.get("image_url"), str):
                images.append(_image(p, f"{param}[{j}]"))
                texts.append(TOOL_IMAGE_NOTE)
            else:
                texts.append(UPLOADED_IMAGE_NOTE)
    return "\n".join(texts)


def _image(part: dict[str, Any], param: str) -> dict[str, Any]:
    """An ``input_image`` given by ``image_url`` as a chat image part (its detail kept)."""
    problem = image_url_problem(part["image_url"])
    if problem is not None:
        raise _bad(f"Invalid value for `{param}.image_url`: {problem}.", f"{param}.image_url")
    image: dict[str, Any] = {"url": part["image_url"]}
    if isinstance(part.get("detail"), str):
        image["detail"] = part["detail"]
    return {"type": "image_url", "image_url": image}


def _file(part: dict[str, Any]) -> dict[str, Any]:
    """An ``input_file`` given inline (``file_data``) as chat's ``file`` part (its filename kept)."""
    file: dict[str, Any] = {"file_data": part["file_data"]}
    if isinstance(part.get("filename"), str):
        file["filename"] = part["filename"]
    return {"type": "file", "file": file}


def _content(value: Any, param: str, role: str) -> str | list[dict[str, Any]]:
    """A message's content: a string, or chat content parts (text, image_url).
    Only a user message keeps a list; others are joined, a line apart (chat
    templates expect strings there)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(f"Invalid value for `{param}`: expected a string or a list of content parts.", param)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(value):
        where = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": _text(part.get("text"), f"{where}.text")})
        elif kind == "refusal":
            parts.append({"type": "text", "text": _text(part.get("refusal"), f"{where}.refusal")})
        elif kind == "input_image":
            if not isinstance(part.get("image_url"), str):
                given = "a file id" if "file_id" in part else "no `image_url`"
                raise _bad(f"`{where}`: only images given by `image_url` are supported ({given} here).", where)
            if role != "user":  # (joined as text below: it was dropped without a word)
                parts.append({"type": "text", "text": f"[image omitted: a {role} message carries text only]"})
            else:
                parts.append(_image(part, where))
        elif kind == "input_file" and isinstance(part.get("file_data"), str) and role == "user":
            parts.append(_file(part))  # (inline: as chat's own `file` part, which passes as sent)
        else:
            raise _bad(f"`{where}`: content parts of type {kind!r} are not supported by this edge.", where)
    if role != "user" or (len(parts) <= 1 and all(p["type"] == "text" for p in parts)):
        return "\n".join(p.get("text", "") for p in parts)
    return parts


# -- tools and formats -----------------------------------------------------------------


def _decode_tools(raw: dict[str, Any], decoded: Decoded) -> None:
    tools = raw.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _bad("Invalid value for `tools`: expected a list.", "tools")
    functions: list[dict[str, Any]] = []
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, dict):
            raise _bad(f"Invalid value for `tools[{i}]`: expected an object.", f"tools[{i}]")
        if not isinstance(tool.get("type"), str):  # (dropped as a hosted tool: an outside audit)
            raise _bad(f"Missing required parameter: `tools[{i}].type` (a string).", f"tools[{i}].type")
        if tool.get("type") == "namespace":
            _namespace_functions(tool, f"tools[{i}]", functions, decoded)
            continue
        if tool.get("type") != "function":
            decoded.ignored_tools.append(tool["type"])
            continue
        functions.append(_function(tool, f"tools[{i}]"))
    if decoded.namespaced:  # (a plain function named as a namespaced one)
        plain = [f["function"]["name"] for f in functions]
        if len(plain) != len(set(plain)):
            seen: set[str] = set()
            for name in plain:
                if name in seen and name in decoded.namespaced:
                    _namespaced_clash(name)
                seen.add(name)
    choice = raw.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        functions, choice = _allowed_tools(choice, functions)
    if not functions:
        if choice == "required" or (isinstance(choice, dict) and choice.get("type") == "function"):
            # (as on chat and Messages: a call the model must make, and no function to call)
            raise _bad(
                "Invalid value for `tool_choice`: a required or named tool call needs function `tools`.", "tool_choice"
            )
        return  # tool_choice and parallel_tool_calls mean nothing without a tool the model can call
    chat = decoded.chat
    chat["tools"] = functions
    if isinstance(raw.get("parallel_tool_calls"), bool):
        chat["parallel_tool_calls"] = raw["parallel_tool_calls"]
    if choice in ("auto", "none", "required"):
        chat["tool_choice"] = choice
    elif isinstance(choice, dict) and choice.get("type") == "function":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    # any other choice (a hosted tool): the model chooses (auto)


def _entry_name(entry: dict[str, Any]) -> Any:
    """The function an ``allowed_tools`` entry names (Responses: ``name``, with its ``namespace``)."""
    name = entry.get("name")
    if isinstance(name, str) and isinstance(entry.get("namespace"), str):
        name = namespace_name(entry["namespace"], name)
    return name


def _chat_entry_name(entry: dict[str, Any]) -> Any:
    """The function a chat ``allowed_tools`` entry names: ``{"type": "function", "function": {"name"}}``."""
    function = entry.get("function")
    return function.get("name") if isinstance(function, dict) else None


def _allowed_tools(
    choice: dict[str, Any],
    functions: list[dict[str, Any]],
    where: str = "tool_choice",
    name_of: Callable[[dict[str, Any]], Any] = _entry_name,
) -> tuple[list[dict[str, Any]], str]:
    """``tool_choice: {"type": "allowed_tools", "mode", "tools"}`` (chat's: its
    ``allowed_tools`` object, ``where`` then names it): the functions it lists,
    the only ones the model is offered, and ``mode`` as the chat
    ``tool_choice``. A hosted or custom tool in the list is left out, as in ``tools``."""
    mode, allowed = choice.get("mode"), choice.get("tools")
    if mode not in ("auto", "required"):
        raise _bad(f"Invalid value for `{where}.mode`: expected auto or required.", f"{where}.mode")
    if not isinstance(allowed, list):
        raise _bad(f"Invalid value for `{where}.tools`: expected a list.", f"{where}.tools")
    offered = {f["function"]["name"] for f in functions}
    names: set[str] = set()
    for i, entry in enumerate(allowed):
        param = f"{where}.tools[{i}]"
        if not isinstance(entry, dict):
            raise _bad(f"Invalid value for `{param}`: expected an object.", param)
        if entry.get("type") != "function":
            continue
        name = name_of(entry)
        if not isinstance(name, str) or name not in offered:
            raise _bad(f"Invalid value for `{param}`: {name!r} is not a function in `tools`.", param)
        names.add(name)
    kept = [f for f in functions if f["function"]["name"] in names]
    if mode == "required" and not kept:
        raise _bad(
            f"Invalid value for `{where}.tools`: mode `required` needs a function tool among them.", f"{where}.tools"
        )
    return kept, mode


def chat_tools(chat: dict[str, Any]) -> list[str]:
    """A chat request's tools as the Responses route takes them, in place: a
    ``custom`` tool is left out of ``tools`` (its type is returned, to log), a
    ``custom`` ``tool_choice`` lets the model choose (``auto``), and
    ``tool_choice: {"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}``
    offers the model only the functions it lists (:func:`_allowed_tools`), its
    ``mode`` the ``tool_choice``. With no function left, ``tools``,
    ``tool_choice`` and ``parallel_tool_calls`` go (a required or named call is
    a 400). A malformed tool is kept, for the chat schema's 400 to name it."""
    tools, choice = chat.get("tools"), chat.get("tool_choice")
    is_dict = isinstance(choice, dict)
    kinds = [t.get("type") if isinstance(t, dict) else None for t in tools] if isinstance(tools, list) else []
    if "custom" not in kinds and not (is_dict and choice.get("type") in ("custom", "allowed_tools")):
        return []
    left_out = ["custom" for kind in kinds if kind == "custom"]
    kept = [t for t, kind in zip(tools or (), kinds, strict=False) if kind != "custom"]
    if is_dict and choice.get("type") == "custom":
        choice = "auto"
    elif is_dict and choice.get("type") == "allowed_tools":
        inner = choice.get("allowed_tools")
        if not isinstance(inner, dict):
            raise _bad(
                "Invalid value for `tool_choice.allowed_tools`: expected an object.", "tool_choice.allowed_tools"
            )
        functions = [t for t in kept if _chat_function(t)]
        chosen, choice = _allowed_tools(inner, functions, "tool_choice.allowed_tools", _chat_entry_name)
        chosen_ids = {id(t) for t in chosen}
        kept = [t for t in kept if not _chat_function(t) or id(t) in chosen_ids]
    if kept:
        chat["tools"] = kept
        if choice is not None:
            chat["tool_choice"] = choice
        return left_out
    if choice == "required" or (isinstance(choice, dict) and choice.get("type") == "function"):
        raise _bad(
            "Invalid value for `tool_choice`: a required or named tool call needs function `tools`.", "tool_choice"
        )
    for name in ("tools", "tool_choice", "parallel_tool_calls"):
        chat.pop(name, None)
    return left_out


def _chat_function(tool: Any) -> bool:
    """A well-formed chat function tool (others are left for the chat schema to refuse)."""
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
    return isinstance(function, dict) and isinstance(function.get("name"), str)


def _function(tool: dict[str, Any], param: str, name: str | None = None) -> dict[str, Any]:
    own = tool.get("name")
    if not isinstance(own, str) or not own:
        raise _bad(f"Missing required parameter: `{param}.name`.", f"{param}.name")
    if len(own) > MAX_TOOL_NAME:  # (checked here, named as this API names it: chat's check said `function.name`)
        raise _bad(f"Invalid value for `{param}.name`: at most {MAX_TOOL_NAME} characters.", f"{param}.name")
    fn: dict[str, Any] = {"name": name or own}
    for key, kind, expected in _FUNCTION_FIELDS:
        if tool.get(key) is not None:
            if not isinstance(tool[key], kind):
                raise _bad(f"Invalid value for `{param}.{key}`: expected {expected}.", f"{param}.{key}")
            fn[key] = tool[key]
    return {"type": "function", "function": fn}


_FUNCTION_FIELDS = (("description", str, "a string"), ("parameters", dict, "an object"), ("strict", bool, "a boolean"))


def _namespaced_clash(name: str) -> None:
    """A 400: a namespaced function's name as the model sees it (``NAMESPACE__NAME``) is
    another tool's too; its calls were reported under the last namespace (an outside re-check)."""
    raise _bad(
        f"Invalid value for `tools`: the model would see two tools named `{name[:100]}` (a namespace's "
        "functions are named NAMESPACE__NAME).",
        "tools",
    )


def _namespace_functions(tool: dict[str, Any], param: str, out: list[dict[str, Any]], decoded: Decoded) -> None:
    """A ``namespace`` tool's functions as plain ones named ``NAMESPACE__NAME``
    (its other tools, ``custom`` ones, are left out as elsewhere)."""
    namespace, inner = tool.get("name"), tool.get("tools")
    if not isinstance(namespace, str) or not namespace:
        raise _bad(f"Missing required parameter: `{param}.name`.", f"{param}.name")
    if not isinstance(inner, list):
        raise _bad(f"Invalid value for `{param}.tools`: expected a list.", f"{param}.tools")
    for j, fn in enumerate(inner):
        if not isinstance(fn, dict) or fn.get("type") != "function":
            decoded.ignored_tools.append(str(fn.get("type") if isinstance(fn, dict) else None))
            continue
        function = _function(fn, f"{param}.tools[{j}]")
        name = function["function"]["name"]
        flat = namespace_name(namespace, name)
        if len(flat) > MAX_TOOL_NAME:  # (named here: chat's check named the flat list's `function.name`)
            where = f"{param}.tools[{j}].name"
            raise _bad(f"Invalid value for `{where}`: with its namespace, at most {MAX_TOOL_NAME} characters.", where)
        function["function"]["name"] = flat
        if flat in decoded.namespaced:  # (two namespaces' names made one: a 400)
            _namespaced_clash(flat)
        decoded.namespaced[flat] = (namespace, name)
        out.append(function)


def namespace_name(namespace: str, name: str) -> str:
    return f"{namespace}__{name}"


def _decode_text_format(text: Any, chat: dict[str, Any]) -> None:
    verbosity = text.get("verbosity") if isinstance(text, dict) else None
    if verbosity is not None:
        if verbosity not in _VERBOSITIES:
            wanted = ", ".join(_VERBOSITIES)
            raise _bad(f"Invalid value for `text.verbosity`: expected one of {wanted}.", "text.verbosity")
        chat["verbosity"] = verbosity  # (chat's own field)
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict):
        return
    kind = fmt.get("type")
    if kind == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}


# -- the response ----------------------------------------------------------------------


def usage_json(usage: UsageOut) -> dict[str, Any]:
    details = usage.completion_tokens_details or {}
    out: dict[str, Any] = {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": (usage.prompt_tokens_details or {}).get("cached_tokens", 0),
            "cache_write_tokens": 0,  # no model server behind a node reports it
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
        "total_tokens": usage.total_tokens,
    }
    if usage.estimated:
        out["estimated"] = True
    return out


def status_of(finish_reason: str) -> tuple[str, dict[str, str] | None]:
    """A run's finish reason as a response's ``status`` and ``incomplete_details``."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


class ResponseEncoder:
    """One response's items and events. Each ``*`` method returns the SSE bytes
    of the events it makes (every one with the next ``sequence_number``); the
    items it finishes are kept for the final ``response`` object.

    Text and reasoning arrive as deltas: a delta of the other kind closes the
    open item and opens a new one. Reasoning is shown as ``reasoning_text``
    and as summary text (what Codex displays)."""

    def __init__(
        self,
        response_id: str,
        model: str,
        created_at: int,
        echo: dict[str, Any],
        namespaced: dict[str, tuple[str, str]] | None = None,
        keep: Callable[[list[dict[str, Any]]], None] | None = None,
    ) -> None:
        self.id = response_id
        self.model = model
        self.created_at = created_at
        self.echo = echo
        self.namespaced = namespaced or {}  # a namespace function's flat name -> (namespace, name)
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self._open: dict[str, Any] | None = None  # the item receiving deltas
        self._open_text: list[str] = []
        self._n = 0
        self._keep = keep  # given the output items of a response that finished (references to them)

    # -- objects ---------------------------------------------------------------

    def response(
        self,
        status: str,
        *,
        usage: UsageOut | None = None,
        error: dict[str, Any] | None = None,
        incomplete: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": list(self.output),
            "previous_response_id": None,
            "store": False,
            "truncation": "disabled",
            "usage": usage_json(usage) if usage is not None else None,
            **self.echo,
        }

    def _item_id(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}_{self.id.removeprefix('resp_')}_{self._n}"

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = _encode({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    # -- stream ----------------------------------------------------------------

    def opening(self) -> bytes:
        snapshot = self.response("in_progress")
        return self._event("response.created", response=snapshot) + self._event(
            "response.in_progress", response=snapshot
        )

    def text(self, delta: str) -> bytes:
        head = b""
        if self._open is None or self._open["type"] != "message":
            head = self._close() + self._open_message()
        self._open_text.append(delta)
        item_id = self._open["id"]
        index = len(self.output)
        return head + self._event(
            "response.output_text.delta",
            item_id=item_id,
            output_index=index,
            content_index=0,
            delta=delta,
            logprobs=[],
        )

    def reasoning(self, delta: str) -> bytes:
        head = b""
        if self._open is None or self._open["type"] != "reasoning":
            head = self._close() + self._open_reasoning()
        self._open_text.append(delta)
        where = {"item_id": self._open["id"], "output_index": len(self.output)}
        return (
            head
            + self._event("response.reasoning_summary_text.delta", **where, summary_index=0, delta=delta)
            + self._event("response.reasoning_text.delta", **where, content_index=0, delta=delta)
        )

    def _open_message(self) -> bytes:
        self._open = {"id": self._item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant"}
        index = len(self.output)
        return self._event("response.output_item.added", output_index=index, item={**self._open, "content": []}) + (
            self._event(
                "response.content_part.added",
                item_id=self._open["id"],
                output_index=index,
                content_index=0,
                part=_output_text(""),
            )
        )

    def _open_reasoning(self) -> bytes:
        self._open = {"id": self._item_id("rs"), "type": "reasoning"}
        index = len(self.output)
        return (
            self._event(
                "response.output_item.added", output_index=index, item={**self._open, "summary": [], "content": []}
            )
            + self._event(
                "response.reasoning_summary_part.added",
                item_id=self._open["id"],
                output_index=index,
                summary_index=0,
                part={"type": "summary_text", "text": ""},
            )
            + self._event(  # (openai-node's stream helper adds the reasoning_text part from this event alone)
                "response.content_part.added",
                item_id=self._open["id"],
                output_index=index,
                content_index=0,
                part={"type": "reasoning_text", "text": ""},
            )
        )

    def _close(self, status: str = "completed", announce: bool = True) -> bytes:
        """Close the open item (``b""`` if none); without ``announce``, it joins the output
        with no events of its own."""
        item = self._open
        if item is None:
            return b""
        self._open = None
        text = "".join(self._open_text)
        self._open_text = []
        index = len(self.output)
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            part = _output_text(text)
            done = {**item, "status": status, "content": [part]}
        else:
            summary = {"type": "summary_text", "text": text}
            part = {"type": "reasoning_text", "text": text}
            done = {**item, "summary": [summary], "content": [part]}
        self.output.append(done)
        if not announce:
            return b""
        if item["type"] == "message":
            events = self._event(
                "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
            ) + self._event("response.content_part.done", **where, content_index=0, part=part)
        else:
            events = (
                self._event("response.reasoning_summary_text.done", **where, summary_index=0, text=text)
                + self._event("response.reasoning_summary_part.done", **where, summary_index=0, part=summary)
                + self._event("response.reasoning_text.done", **where, content_index=0, text=text)
                + self._event("response.content_part.done", **where, content_index=0, part=part)
            )
        return events + self._event("response.output_item.done", output_index=index, item=done)

    def refusal(self, text: str) -> bytes:
        """The model's refusal: a message of its own whose one content part is
        ``{"type": "refusal"}`` (no ``output_text``), as OpenAI's, with its
        ``response.refusal.delta`` and ``.done`` events."""
        head = self._close()
        item = {"id": self._item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant"}
        index = len(self.output)
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        part = {"type": "refusal", "refusal": text}
        done = {**item, "status": "completed", "content": [part]}
        self.output.append(done)
        return (
            head
            + self._event("response.output_item.added", output_index=index, item={**item, "content": []})
            + self._event("response.content_part.added", **where, part={"type": "refusal", "refusal": ""})
            + self._event("response.refusal.delta", **where, delta=text)
            + self._event("response.refusal.done", **where, refusal=text)
            + self._event("response.content_part.done", **where, part=part)
            + self._event("response.output_item.done", output_index=index, item=done)
        )

    def function_calls(self, calls: list[ToolCall], status: str = "completed") -> bytes:
        """The calls' items; ``status`` is ``incomplete`` for calls cut off
        by ``max_output_tokens`` (their arguments may be cut too). The turn has
        left out calls past the request's ``max_tool_calls`` (Turn.most_calls)."""
        parts = [self._close()]
        for call in calls:
            item = {
                "id": self._item_id("fc"),
                "type": "function_call",
                "status": status,
                "call_id": call.id,
                "name": call.function.name,
                "arguments": call.function.arguments,
            }
            namespaced = self.namespaced.get(call.function.name)
            if namespaced is not None:
                item["namespace"], item["name"] = namespaced
            index = len(self.output)
            where = {"item_id": item["id"], "output_index": index}
            added = {**item, "status": "in_progress", "arguments": ""}
            parts.append(self._event("response.output_item.added", output_index=index, item=added))
            parts.append(self._event("response.function_call_arguments.delta", **where, delta=item["arguments"]))
            parts.append(self._event("response.function_call_arguments.done", **where, arguments=item["arguments"]))
            self.output.append(item)
            parts.append(self._event("response.output_item.done", output_index=index, item=item))
        return b"".join(parts)

    def completed(self, usage: UsageOut, finish_reason: str) -> bytes:
        """The closing events: ``response.completed``, or ``response.incomplete``."""
        status, incomplete = status_of(finish_reason)
        head = self._close("completed" if status == "completed" else "incomplete")
        if self._keep is not None:  # (before the client can see the ids)
            self._keep(self.output)
        response = self.response(status, usage=usage, incomplete=incomplete)
        return head + self._event(f"response.{status}", response=response)

    @property
    def empty(self) -> bool:
        """No item is out or open yet."""
        return not self.output and self._open is None

    def in_progress(self) -> bytes:
        """A keep-alive: an SSE comment, as on every stream, and one that
        clients count as an event (Codex's idle timer does not count SSE
        comments): ``response.in_progress`` again."""
        return KEEPALIVE + self._event("response.in_progress", response=self.response("in_progress"))

    def failed(self, message: str, type: str, final: bool = False) -> bytes:
        """The closing event of a response that failed after it started. Its
        ``error.code`` is one of OpenAI's (``server_error``,
        ``rate_limit_exceeded``), which clients such as Codex act on, not the
        edge's own error type. ``final``: no retry can help (an operator's
        cancel, tool calls still invalid): ``invalid_prompt``, the one code
        OpenAI documents that Codex neither retries nor replaces with words of
        its own (it shows the message and stops; on ``server_error`` it
        reconnects, up to 5 times, starting the run again). What was streamed
        stays in its ``output``: an open message is done first, ``incomplete``
        (it was left out, and a client that rebuilt the answer from the failed
        response lost the text it had shown: an outside audit), with its
        ``.done`` events only when ``final``: Codex keeps every item done in
        its history, and a retry (``server_error``) sent the cut-off text back
        to the model as an answer given, then showed the answer twice."""
        head = self._close("incomplete", announce=final)
        code = "invalid_prompt" if final else _FAILED_CODES.get(type, "server_error")
        response = self.response("failed", error={"code": code, "message": message})
        return head + self._event("response.failed", response=response)

    # -- whole -----------------------------------------------------------------

    def whole(
        self,
        content: str,
        reasoning: str | None,
        calls: list[ToolCall] | None,
        usage: UsageOut,
        finish_reason: str,
        refusal: str = "",
    ) -> tuple[dict[str, Any], bytes]:
        """A finished run as its output items: the ``response`` object, and the
        stream events that carry them (for a buffered stream)."""
        events = []
        if reasoning is not None:
            events.append(self.reasoning(reasoning))
        if content or not (calls or refusal or reasoning):  # (an empty answer alone: one empty message)
            events.append(self.text(content))
        if refusal:
            events.append(self.refusal(refusal))
        if calls:
            events.append(self.function_calls(calls, "incomplete" if finish_reason == "length" else "completed"))
        events.append(self.completed(usage, finish_reason))
        status, incomplete = status_of(finish_reason)
        return self.response(status, usage=usage, incomplete=incomplete), b"".join(events)


# The edge's error types as the codes of a failed response OpenAI documents; any
# other type (run_error, tool_validation_error, ...) is a ``server_error``.
_FAILED_CODES = {
    "server_error": "server_error",
    "rate_limit_error": "rate_limit_exceeded",
    "rate_limit_exceeded": "rate_limit_exceeded",  # (a key's limit: the type its 429 has)
    "insufficient_quota": "insufficient_quota",  # (Codex stops on it: it reconnected on server_error)
}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
