"""Frame definitions and the one codec both sides use.

New fields always get defaults so that older peers keep decoding newer frames
(msgspec schema evolution); a change that cannot be read that way bumps
:data:`PROTOCOL_VERSION`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

PROTOCOL_VERSION = 2  # 2: capacity shared across edges (grant, demand)
MAX_PREFIX_BLOCKS = 2048  # keys in a prompt's prefix chain (``run`` and ``placed``)
CLOSE_DUPLICATE = 4009  # the edge's close of a link whose node id is linked already

# A prompt's prefix chain: 60-bit block keys, each covering the prompt up to its block's end.
PrefixKey = Annotated[int, msgspec.Meta(ge=0, lt=1 << 60)]
PrefixChain = Annotated[list[PrefixKey], msgspec.Meta(max_length=MAX_PREFIX_BLOCKS)]

# Run event types.
DELTA = "delta"
REASONING_DELTA = "reasoning_delta"
# No output: the run's model server is streaming a tool call, which the node sends whole at its end
# (at most one a run each PROGRESS_S; PROTOCOL.md)
PROGRESS = "progress"
PROGRESS_S = 1.0
EARLY_PROGRESS_PARTS = 64  # ...or sooner, saying at least this many pieces, to an edge that asked (Welcome),
EARLY_PROGRESS_S = 1 / 32  # but no sooner than this after the one before
COMPLETE = "complete"
ERROR = "error"
CANCELLED = "cancelled"
TERMINAL_TYPES = frozenset({COMPLETE, ERROR, CANCELLED})


class _Frame(msgspec.Struct, tag_field="t", omit_defaults=True):
    pass


class ModelInfo(msgspec.Struct, omit_defaults=True):
    """One model a node serves."""

    name: str  # the model group clients ask for
    adapter: str  # "openai" | "sim"
    target: str  # the upstream's own model name
    max_concurrency: int = 1
    context_window: int = 0  # 0: unknown
    native_tools: bool = True
    passthrough: bool = False  # the node accepts TunnelRequests for it


class ToolCallFunction(msgspec.Struct, omit_defaults=True):
    name: str = ""
    arguments: str = ""


class ToolCall(msgspec.Struct, omit_defaults=True):
    id: str = ""
    type: str = "function"
    function: ToolCallFunction = msgspec.field(default_factory=ToolCallFunction)


MAX_TOKEN_COUNT = 1 << 40  # a usage count above this (or below 0) is no count: a frame with one is refused
TokenCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_COUNT)]


# An HTTP status in a frame: 0 (none) or three digits. A node's HTTP client takes 100-599 only;
# a frame past 999 is refused (a status past 2^64 once could not even be encoded).
HTTPStatus = Annotated[int, msgspec.Meta(ge=0, le=999)]


MAX_NODE_ID = 128  # characters
MAX_MODEL_NAME = 256  # characters
MAX_MODELS = 1024  # model groups one node serves
MAX_TOOL_CALLS = 1024  # tool calls in one run's answer
# Run events in one ``events`` frame (a node splits a larger batch; its outbox holds 4,096 by
# default). The edge hands a frame's events to their runs in one go, about 1.5 µs each: 64,000
# one-character deltas for a node's own live runs held the edge's loop about 100 ms a frame
# (/healthz p99 5.7 -> 91 ms; an outside audit). 8,192 hold it about 12 ms.
MAX_FRAME_EVENTS = 8192
# Cancelled runs one ``grant`` answers, and the longest run id a node answers a cancel of (the
# edge's are 24 characters): such a grant fits the smallest frame an edge takes (64 KiB; 8,192
# ids of any length did not, and a hostile edge's 16 MiB ids were each kept until sent).
MAX_FREED = 1024
MAX_ANSWERED_ID = 48
# Tool calls in one ``events`` frame, its events' together (a node splits a larger batch). Each
# list is bounded by MAX_TOOL_CALLS, but a frame holds many: 16 MB of events, each of 1,024
# empty calls, decoded to 15 million calls, 1.85 GB and 10 s of an edge's event loop.
MAX_FRAME_TOOL_CALLS = 4 * MAX_TOOL_CALLS
MAX_HEADERS = 256  # headers a tunnel frame carries (a node relays a provider's first ones)
# A collection in a frame is bounded by its length as well as by the frame's bytes: msgspec
# refuses a longer one at its header, before making any item. (An item can cost a byte on
# the wire: 16 MB of empty tool calls took 1.9 GB and 8 s of an edge's CPU to decode.)
ToolCalls = Annotated[list[ToolCall], msgspec.Meta(max_length=MAX_TOOL_CALLS)]
Headers = Annotated[list[tuple[str, str]], msgspec.Meta(max_length=MAX_HEADERS)]


def name_problem(value: str, limit: int) -> str:
    """Why ``value`` cannot be a node id or model name ("" if it can): 1 to
    ``limit`` characters of printable ASCII, no space. No newline, right-to-left
    override, zero-width or other invisible character (an id that shows as
    another in a console or a log: Unicode has many, U+034F, U+3164, ...), and a
    node id travels in an HTTP header, which is Latin-1."""
    if not value:
        return "must not be empty"
    if len(value) > limit:
        return f"longer than {limit} characters"
    if not (value.isascii() and value.isprintable()) or " " in value:
        return "holds a character that is not printable ASCII (or a space)"
    return ""


def is_token_count(value: object) -> bool:
    """``value`` is a token count a frame may carry: an int (not a bool, float or NaN) in 0..2^40."""
    return type(value) is int and 0 <= value <= MAX_TOKEN_COUNT


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: TokenCount | None = None
    completion_tokens: TokenCount | None = None
    total_tokens: TokenCount | None = None
    reasoning_tokens: TokenCount | None = None
    cached_tokens: TokenCount | None = None  # prompt tokens the model server found in its prefix cache


class RunEvent(msgspec.Struct, omit_defaults=True):
    """One event of a run. ``type`` is one of delta, reasoning_delta,
    complete, error, cancelled; the last three end the run."""

    run_id: str
    seq: int
    type: str
    text: str = ""
    finish_reason: str = ""
    tool_calls: ToolCalls | None = None
    usage: Usage | None = None
    status: HTTPStatus = 0  # error events: the upstream's HTTP status, when it gave one
    # error events: the upstream's Retry-After, in seconds (0: none said), for a 429 or 503
    retry_after: Annotated[float, msgspec.Meta(ge=0, le=86_400)] = 0.0
    # deltas: how many model-server deltas this text joins (0: one); usage estimates count them
    # (progress: the tool-call pieces read). Never negative: -2^62 erased a key's day of tokens.
    parts: Annotated[int, msgspec.Meta(ge=0)] = 0
    stop: str = ""  # complete: the stop sequence that ended the run, when the model server said which
    # complete: the model's refusal (OpenAI's ``refusal``), whole: it arrives with the end, so an
    # older edge that does not know the field still reads the event (and shows no refusal)
    refusal: str = ""


# -- node -> edge -------------------------------------------------------------


class Hello(_Frame, tag="hello"):
    node_id: str
    protocol: int
    models: Annotated[list[ModelInfo], msgspec.Meta(max_length=MAX_MODELS)]
    software: str = ""
    relays_prefixes: bool = False  # tells every other edge that asked for it where a prefix went (``placed``)
    # The largest message the node accepts (0: unknown, the edge's own limit): the edge sends
    # it no run whose frame is larger (a 20 MiB request under a node's 16 MiB closed the link).
    max_frame_bytes: int = 0
    holds_tunnels: bool = False  # takes ``hold`` frames: pauses a tunnel's body while its client is behind
    # Answers a ``cancel`` that names its run's model with a ``grant`` whose ``freed`` names the run:
    # until then the edge counts the run's slot as taken (its next run waits for the grants the
    # cancel moved, so another edge's fair share is not taken back by a queue at this one).
    answers_cancels: bool = False


class Events(_Frame, tag="events"):
    """A batch: every run event the node produced since its last send."""

    events: Annotated[list[RunEvent], msgspec.Meta(max_length=MAX_FRAME_EVENTS)]


class EngineLoad(msgspec.Struct, omit_defaults=True):
    """A model server's own load, sampled by the node from its Prometheus
    metrics; a field is None when the server does not export it."""

    waiting: float | None = None  # requests queued in the engine
    running: float | None = None  # requests it is generating for
    kv_cache_usage: float | None = None  # fraction of its KV cache in use, 0..1
    prefix_cache_hit_rate: float | None = None  # prompt tokens found in its prefix cache, 0..1, since it started


class Load(_Frame, tag="load"):
    in_flight: Annotated[dict[str, int], msgspec.Meta(max_length=MAX_MODELS)]
    draining: bool = False
    engine: Annotated[dict[str, EngineLoad], msgspec.Meta(max_length=MAX_MODELS)] | None = (
        None  # model -> its server's load; {} for a model: no longer known
    )


class Pong(_Frame, tag="pong"):
    ts: float = 0.0


class Placed(_Frame, tag="placed"):
    """Another edge sent this node a run of ``model`` whose prompt has this
    prefix chain: the node's model server now holds (or is computing) it."""

    model: str
    prefix: PrefixChain


class Grant(_Frame, tag="grant"):
    """The most runs of ``model`` this edge may have on the node at once
    (absolute). ``seq`` counts the grants of that model on this link: 1, 2, ...
    ``freed``: runs of the model whose ``cancel`` the node has taken, this grant
    standing after them (it may repeat the last ``seq``)."""

    model: str
    slots: int
    seq: int
    freed: Annotated[list[str], msgspec.Meta(max_length=MAX_FREED)] = []


class TunnelFrame(_Frame, tag="tunnel_frame"):
    run_id: str
    seq: int
    kind: Literal["response_start", "body", "error", "end", "usage"]
    status: HTTPStatus = 0
    headers: Headers | None = None
    body: bytes = b""
    error: str = ""


# -- edge -> node -------------------------------------------------------------


class Welcome(_Frame, tag="welcome"):
    edge_id: str
    protocol: int
    ping_interval_s: float
    max_frame_bytes: int = 0  # the largest message the edge accepts; 0: unknown (use the node's own limit)
    wants_prefixes: bool = False  # send this edge ``placed`` for other edges' runs (it routes by prefix)
    # A ``progress`` event saying at least this many pieces may come sooner than PROGRESS_S (0: never,
    # an edge that does not know it): the edge holds a run to its key's daily budget as they are read.
    progress_parts: int = 0


class RunRequest(_Frame, tag="run"):
    run_id: str
    model: str  # model group
    target: str
    # The OpenAI chat request, normalized by the edge. The edge sends a
    # pre-encoded msgspec.Raw here (encoded once, checked before dispatch).
    request: dict[str, Any]
    timeout_s: float  # the whole run's remaining budget, relative
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    prefix: PrefixChain | None = None  # the prompt's prefix chain, for a node that relays them


class TunnelRequest(_Frame, tag="tunnel"):
    run_id: str
    model: str
    target: str
    method: str
    path: str
    body: bytes
    timeout_s: float
    stream: bool = False
    headers: Headers | None = None


class CancelRun(_Frame, tag="cancel"):
    run_id: str
    reason: str = ""
    model: str = ""  # the run's: a node whose hello set ``answers_cancels`` answers with a ``grant`` (``freed``)


class Hold(_Frame, tag="hold"):
    """Pause (``hold``) or go on with a tunnel's body: its client is that far behind (sent
    only to a node whose hello set ``holds_tunnels``)."""

    run_id: str
    hold: bool = True


class Ping(_Frame, tag="ping"):
    ts: float = 0.0


class Demand(_Frame, tag="demand"):
    """The edge's use of and want for a node's model: runs it has on the node
    (sent and not ended), requests of the model waiting in its queue, and the
    ``seq`` of the last ``grant`` of that model it has applied."""

    model: str
    in_flight: int
    waiting: int
    seq: int = 0


NodeFrame = Hello | Events | Load | Pong | Grant | TunnelFrame | Placed
EdgeFrame = Welcome | RunRequest | TunnelRequest | CancelRun | Hold | Ping | Demand
Frame = NodeFrame | EdgeFrame

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Frame)


# A ``tool_calls`` key (as msgpack writes a 10-character string, any of its four ways) and the
# header of the array after it. Every one in the frame counts, repeated keys too: msgspec keeps a
# repeated key's last value but decodes the others first ("events": [15 million calls], "events":
# [] held the loop 12.6 s when only the kept value was counted).
_CALLS_HEADER = re.compile(
    rb"(?:\xaa|\xd9\x0a|\xda\x00\x0a|\xdb\x00\x00\x00\x0a)tool_calls([\x90-\x9f]|\xdc..|\xdd....)", re.DOTALL
)


def _array_length(header: bytes) -> int:
    """The length in a msgpack array's header."""
    kind = header[0]
    if kind <= 0x9F:
        return kind & 0x0F
    return int.from_bytes(header[1:], "big")


def tool_calls_in(data: bytes) -> int:
    """How many tool calls the frame ``data`` holds, read from the headers of the arrays
    after its ``tool_calls`` keys, none decoded (16 MB of empty calls: 0.1 s, nothing kept).
    Text that spells the key with an array header after it cannot be valid UTF-8 but for a
    few letters: it would count more, never less."""
    return sum(_array_length(m.group(1)) for m in _CALLS_HEADER.finditer(data))


def encode_frame(frame: Frame) -> bytes:
    return _encoder.encode(frame)


def decode_frame(data: bytes) -> Frame:
    """Decode one frame; raises :class:`msgspec.DecodeError` (or
    :class:`msgspec.ValidationError`) on anything malformed, or holding more
    than :data:`MAX_FRAME_TOOL_CALLS` tool calls. They are counted first only
    when the frame could hold that many: more bytes than the bound (a call
    is a byte at least), and more lists of them than the bound's share."""
    if (
        len(data) > MAX_FRAME_TOOL_CALLS
        and data.count(b"tool_calls") > MAX_FRAME_TOOL_CALLS // MAX_TOOL_CALLS
        and tool_calls_in(data) > MAX_FRAME_TOOL_CALLS
    ):
        raise msgspec.ValidationError(f"more than {MAX_FRAME_TOOL_CALLS} tool calls in one frame")
    return _decoder.decode(data)
