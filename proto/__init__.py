"""The edge <-> node wire protocol.

One msgpack-encoded frame per binary websocket message; every frame is a
member of the tagged union :data:`Frame` (the tag travels in the ``t`` key).
This package depends on msgspec and the standard library only.
See ``PROTOCOL.md`` beside this file for a language-neutral description.
"""

from proto.frames import (
    CLOSE_DUPLICATE,
    MAX_PREFIX_BLOCKS,
    PROTOCOL_VERSION,
    CancelRun,
    Demand,
    EngineLoad,
    Events,
    Frame,
    Grant,
    Hello,
    Hold,
    Load,
    ModelInfo,
    Ping,
    Placed,
    Pong,
    RunEvent,
    RunRequest,
    ToolCall,
    ToolCallFunction,
    TunnelFrame,
    TunnelRequest,
    Usage,
    Welcome,
    decode_frame,
    encode_frame,
)

__all__ = [
    "CLOSE_DUPLICATE",
    "MAX_PREFIX_BLOCKS",
    "PROTOCOL_VERSION",
    "CancelRun",
    "Demand",
    "EngineLoad",
    "Events",
    "Frame",
    "Grant",
    "Hello",
    "Hold",
    "Load",
    "ModelInfo",
    "Ping",
    "Placed",
    "Pong",
    "RunEvent",
    "RunRequest",
    "ToolCall",
    "ToolCallFunction",
    "TunnelFrame",
    "TunnelRequest",
    "Usage",
    "Welcome",
    "decode_frame",
    "encode_frame",
]
