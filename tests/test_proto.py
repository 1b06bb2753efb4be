"""The wire protocol: every frame round-trips, peers tolerate what they do not know."""

from __future__ import annotations

import msgspec
import pytest

from proto import (
    PROTOCOL_VERSION,
    CancelRun,
    Demand,
    Events,
    Grant,
    Hello,
    Load,
    ModelInfo,
    Ping,
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

FRAMES = [
    Hello(
        node_id="n1",
        protocol=PROTOCOL_VERSION,
        models=[
            ModelInfo(
                name="m", adapter="openai", target="t", max_concurrency=4, context_window=8192, native_tools=False
            )
        ],
    ),
    Welcome(edge_id="e", protocol=PROTOCOL_VERSION, ping_interval_s=5.0),
    RunRequest(
        run_id="r",
        model="m",
        target="t",
        request={"messages": [{"role": "user", "content": "hi"}], "temperature": 0.2},
        timeout_s=30.0,
        metadata={"attempt": "2"},
    ),
    Events(
        events=[
            RunEvent(run_id="r", seq=1, type="delta", text="hé"),
            RunEvent(
                run_id="r",
                seq=2,
                type="complete",
                finish_reason="tool_calls",
                tool_calls=[ToolCall(id="c", function=ToolCallFunction(name="f", arguments="{}"))],
                usage=Usage(prompt_tokens=3, completion_tokens=2),
            ),
            RunEvent(run_id="r2", seq=1, type="error", text="boom", status=429),
        ]
    ),
    CancelRun(run_id="r", reason="client_gone"),
    TunnelRequest(
        run_id="t",
        model="m",
        target="t",
        method="POST",
        path="/embeddings",
        body=b'{"input":"x"}',
        timeout_s=10.0,
        headers=[("content-type", "application/json")],
    ),
    TunnelFrame(run_id="t", seq=1, kind="response_start", status=200, headers=[("content-type", "text/event-stream")]),
    TunnelFrame(run_id="t", seq=2, kind="body", body=b"\x00\xffraw"),
    Load(in_flight={"m": 2}, draining=True),
    Ping(ts=1.5),
    Pong(ts=1.5),
    Grant(model="m", slots=3, seq=7),
    Demand(model="m", in_flight=2, waiting=5, seq=7),
]


@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: type(f).__name__)
def test_every_frame_round_trips(frame):
    """Encode then decode gives back the same frame."""
    assert decode_frame(encode_frame(frame)) == frame


def test_defaults_are_omitted_and_unknown_keys_ignored():
    """A newer peer's extra keys are ignored; default values are not sent at all."""
    encoded = encode_frame(
        RunEvent(run_id="r", seq=1, type="delta", text="x")
        and Events(events=[RunEvent(run_id="r", seq=1, type="delta", text="x")])
    )
    raw = msgspec.msgpack.decode(encoded)
    assert raw == {"t": "events", "events": [{"run_id": "r", "seq": 1, "type": "delta", "text": "x"}]}
    raw["events"][0]["from_the_future"] = [1, 2]
    raw["also_new"] = True
    assert decode_frame(msgspec.msgpack.encode(raw)) == Events(
        events=[RunEvent(run_id="r", seq=1, type="delta", text="x")]
    )


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        msgspec.msgpack.encode({"t": "nope"}),
        msgspec.msgpack.encode({"t": "events", "events": "x"}),
        msgspec.msgpack.encode({"t": "cancel"}),
        msgspec.msgpack.encode([1, 2, 3]),
        # a status is 0..999: a model server's "99999999999999999999999" once reached a frame
        msgspec.msgpack.encode(
            {"t": "tunnel_frame", "run_id": "r", "seq": 1, "kind": "response_start", "status": 1000}
        ),
        msgspec.msgpack.encode({"t": "events", "events": [{"run_id": "r", "seq": 1, "type": "error", "status": -1}]}),
    ],
)
def test_malformed_frames_raise_decode_errors(data):
    """Garbage is a msgspec error (which closes the link), never something else."""
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        decode_frame(data)
