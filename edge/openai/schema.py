"""OpenAI chat completion request and response structs.

Requests are validated with :func:`msgspec.convert` from the decoded JSON, so
the error names the field (``$.messages[0].role``); unknown fields are kept in
the forwarded body, since model servers take extra sampling parameters.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]


MAX_TOOL_NAME = 256  # characters of a function's name (the other APIs' front doors check theirs too)


class FunctionDef(msgspec.Struct, omit_defaults=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TOOL_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, omit_defaults=True):
    function: FunctionDef
    type: Literal["function"] = "function"


class ToolChoiceFunction(msgspec.Struct):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class ToolChoice(msgspec.Struct):
    """``tool_choice``'s object form: ``{"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: ToolChoiceFunction


class ToolChoiceShape(msgspec.Struct):
    """What ``tool_choice`` may be. :class:`ChatRequest` keeps the object form
    as a dict (the tool contract reads it so); the request parser checks it
    against this first, so a wrong shape is a 400 naming ``tool_choice``."""

    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None


class JsonSchemaFormat(msgspec.Struct):
    """``response_format.json_schema``: a name, as OpenAI (and vLLM) require; ``schema`` optional."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern="^[a-zA-Z0-9_-]+$")]
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextFormat(msgspec.Struct, tag_field="type", tag="text"):
    pass


class JsonObjectFormat(msgspec.Struct, tag_field="type", tag="json_object"):
    pass


class JsonSchemaResponseFormat(msgspec.Struct, tag_field="type", tag="json_schema"):
    json_schema: JsonSchemaFormat


class StructuralTagFormat(msgspec.Struct, tag_field="type", tag="structural_tag"):
    """vLLM's and SGLang's own kind, forwarded as sent."""


class ResponseFormatShape(msgspec.Struct):
    """What ``response_format`` may be (checked as :class:`ToolChoiceShape` is; forwarded as
    sent, other fields a model server reads included: llama.cpp's ``schema`` on ``json_object``).
    An unknown type, or a ``json_schema`` without its object, was served as plain text."""

    response_format: TextFormat | JsonObjectFormat | JsonSchemaResponseFormat | StructuralTagFormat


class Message(msgspec.Struct, omit_defaults=True):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class StreamOptions(msgspec.Struct, omit_defaults=True):
    include_usage: bool = False


class Reasoning(msgspec.Struct, omit_defaults=True):
    """OpenRouter's ``reasoning`` object, its known fields typed (a wrong type is a 400, so a
    client that asks to hide reasoning never has it shown); other fields go upstream untouched."""

    exclude: bool | None = None
    enabled: bool | None = None
    effort: str | None = None
    max_tokens: int | None = None


class ChatRequest(msgspec.Struct, omit_defaults=True):
    model: Annotated[str, msgspec.Meta(min_length=1)]
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: PosInt | None = None
    max_completion_tokens: PosInt | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=1)] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None  # see ToolChoiceShape
    parallel_tool_calls: bool | None = None
    user: str | None = None
    include_reasoning: bool | None = None
    reasoning: Reasoning | None = None
    metadata: dict[str, Any] | None = None  # an object, or a 400 (OpenAI's own rule)
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None  # true is refused (see request.py): nodes relay no log probabilities
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    # Checked as OpenAI checks them, then forwarded as sent (a model server may read them).
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def reasoning_included(self) -> bool:
        if self.include_reasoning is False:
            return False
        if self.reasoning is not None and self.reasoning.exclude:
            return False
        return True


# Fields the edge handles itself and never forwards upstream.
EDGE_ONLY_FIELDS = ("stream", "stream_options", "include_reasoning")


# -- responses ---------------------------------------------------------------


class ChunkDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: ChunkDelta
    finish_reason: str | None = None
    logprobs: None = None


class UsageOut(msgspec.Struct, omit_defaults=True):
    """Always three integers (see :mod:`edge.openai.usage`); details only when reported."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: dict[str, int] | None = None
    prompt_tokens_details: dict[str, int] | None = None  # cached_tokens, when the model server said
    estimated: bool = False  # a count is the edge's figure: sent as "estimated": true, else left out


class Chunk(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: UsageOut | None = None


class ResponseMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    refusal: str | None = None  # the model declined: its words (content is null then)


class CompletionChoice(msgspec.Struct):
    index: int
    message: ResponseMessage
    finish_reason: str
    logprobs: None = None


class ChatCompletion(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageOut | None = None


class ModelCard(msgspec.Struct):
    """A model as OpenAI's API lists it, with the fields Anthropic's has too (``type``,
    ``display_name``, ``created_at``, ``lifecycle``, ``max_input_tokens``), so that either
    SDK's ``models`` reads it whole (anthropic 2.17 requires ``lifecycle``)."""

    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "iop"
    nodes: list[str] = []  # ids of the nodes serving it now
    type: str = "model"
    display_name: str = ""
    created_at: str = ""  # RFC 3339, UTC
    lifecycle: str = "active"  # a model a node serves now is callable
    max_input_tokens: int | None = None  # the largest context_window its nodes advertised (None: unknown)


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
    # Anthropic's page (its SDK pages on has_more; every model is on the one page)
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None
