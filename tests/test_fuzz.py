"""Hostile input against a real `iop edge` process: never a 5xx, never a crash,
every refusal an OpenAI-shaped error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scripts.stack import TOKEN, free_port, write_toml

EXTREME_INTS = [2**64, -(2**64), 2**64 - 1, 2**63, -(2**63), 2**63 - 1, -(2**63) - 1, 2**200, 10**4000]
EXTREME_FLOATS = [1e308, -1e308, 1.7976931348623157e308, 1.5e300, 1e23, -0.0, 5e-324, 2.2250738585072014e-308]
extreme_numbers = st.sampled_from(EXTREME_INTS + EXTREME_FLOATS) | st.integers(-(2**66), 2**66)


class FloatRun(list):
    """``[x] * n`` that prints as that (a failing example stays readable)."""

    def __repr__(self) -> str:
        return f"[{self[0]!r}] * {len(self)}" if self else "[]"


# Long lists of floats, up to and past the fuzz edge's 64 KB body limit.
float_lists = st.builds(lambda x, n: FloatRun([x] * n), st.sampled_from(EXTREME_FLOATS), st.integers(0, 12_000))
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | extreme_numbers
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "wizard", 3])},
        optional={"content": json_values, "tool_calls": json_values, "name": json_values},
    ),
    max_size=4,
)
requests = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["iop-sim", "nope", "", 7]) | json_values,
        "messages": messages | json_values,
        "stream": st.booleans() | json_values,
        "max_tokens": st.integers(-3, 5) | json_values,
        "tools": st.lists(json_values, max_size=3) | json_values,
        "tool_choice": json_values,
        "temperature": json_values,
        "stream_options": json_values,
        "n": json_values,
    },
)


USER = [{"role": "user", "content": "hi"}]
REFS = ["#", "#/x", "#/$defs/a", "#/$defs/loop", "http://127.0.0.1:9/x", "file:///etc/passwd", "x.json", ""]
ref_schemas = st.sampled_from(REFS).flatmap(
    lambda ref: st.sampled_from(
        [
            {"$ref": ref},
            {"type": "object", "properties": {"a": {"$ref": ref}}},
            {"$defs": {"a": {"$ref": ref}, "loop": {"$ref": "#/$defs/loop"}}, "$ref": ref},
            {"type": "object", "properties": {"a": {"$dynamicRef": ref}}, "$id": ref},
        ]
    )
)
ref_tools = st.builds(
    lambda name, params: {"type": "function", "function": {"name": name, "parameters": params}},
    st.sampled_from(["f", "g"]),
    ref_schemas | json_values,
)
odd_tool_choices = (
    st.sampled_from(
        [
            "none",
            "auto",
            "required",
            "any",
            "",
            {"type": "function"},
            {"type": "function", "function": "f"},
            {"type": "function", "function": {}},
            {"type": "function", "function": {"name": 3}},
            {"type": "function", "function": {"name": "f"}},
            {"type": "function", "function": {"name": "nope"}},
            {"function": {"name": "f"}},
            {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}},
            ["auto"],
        ]
    )
    | json_values
)
# Valid enough to get past the schema: they reach the tool contract, the run
# frame's encoding and the node.
knob_requests = st.fixed_dictionaries(
    {"model": st.just("iop-sim"), "messages": st.just(USER)},
    optional={
        "stream": st.booleans(),
        "max_tokens": st.integers(-1, 5) | extreme_numbers,
        "max_completion_tokens": st.integers(-1, 5) | extreme_numbers,
        "seed": extreme_numbers,
        "top_logprobs": extreme_numbers,
        "temperature": extreme_numbers,
        "presence_penalty": extreme_numbers,
        "logit_bias": st.dictionaries(st.sampled_from(["1", "50256"]), extreme_numbers, max_size=2),
        "tools": st.lists(ref_tools, min_size=1, max_size=3),
        "tool_choice": odd_tool_choices,
        "metadata": float_lists | st.dictionaries(st.text(max_size=5), extreme_numbers, max_size=3),
        "x_extra": float_lists,
    },
)


def deep_json(depth: int, opener: bytes) -> bytes:
    """A JSON value ``depth`` levels deep (arrays or objects)."""
    if opener == b"[":
        return b"[" * depth + b"]" * depth
    return b'{"k":' * depth + b"1" + b"}" * depth


LITERALS = [b"1e400", b"-1e400", b"1e99999", b"-0", b"0e0", b"-0.0e-0", b"1" * 5000, b"9" * 4300, b"1.5e300"]
raw_bodies = st.one_of(
    st.builds(
        lambda depth, opener, where: where.replace(b"@", deep_json(depth, opener)),
        st.integers(1, 3000) | st.sampled_from([63, 64, 65, 998, 999, 1000, 1001]),
        st.sampled_from([b"[", b"{"]),
        st.sampled_from(
            [
                b"@",
                b'{"model": "iop-sim", "messages": [{"role": "user", "content": "hi"}], "metadata": @}',
                b'{"model": "iop-sim", "messages": [{"role": "user", "content": [{"type": "text", "text": @}]}]}',
                b'{"model": "iop-sim", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function",'
                b' "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": @}}}}]}',
                b'{"model": "iop-sim", "messages": [{"role": "user", "content": "hi"}], "tool_choice": @}',
            ]
        ),
    ),
    st.builds(
        lambda literal, n: (
            b'{"model": "iop-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "x": ['
            + b",".join([literal] * n)
            + b"]}"
        ),
        st.sampled_from(LITERALS),
        st.integers(1, 12),
    ),
)


def assert_node_linked(client: httpx.Client) -> None:
    nodes = client.get("/v1/nodes").json()["data"]
    assert [n["id"] for n in nodes] == ["fuzz"], nodes


@pytest.fixture(scope="module")
def edge_url(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    port = free_port()
    edge_cfg = write_toml(
        tmp / "edge.toml", {"bind": f"127.0.0.1:{port}", "node_token": TOKEN, "max_body_bytes": 65536}
    )
    node_cfg = write_toml(
        tmp / "node.toml",
        {
            "node_id": "fuzz",
            "edges": [f"ws://127.0.0.1:{port}/v1/node/link"],
            "token": TOKEN,
            "models": [
                {
                    "name": "iop-sim",
                    "adapter": "sim",
                    "ttft_ms": 0,
                    "tokens_per_s": 0,
                    "sim_tokens": 3,
                    "max_concurrency": 8,
                }
            ],
        },
    )
    env = {**os.environ, "IOP_LOG_LEVEL": "error"}
    procs = [
        subprocess.Popen([sys.executable, "-m", "iop.cli", "edge", "--config", str(edge_cfg)], env=env),
        subprocess.Popen([sys.executable, "-m", "iop.cli", "node", "--config", str(node_cfg)], env=env),
    ]
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "edge did not come up"
        time.sleep(0.05)
    yield url
    with httpx.Client(base_url=url, timeout=20) as client:
        assert_node_linked(client)  # no input, however hostile, cost the node its link
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert procs[0].returncode == -signal.SIGKILL  # it was alive until the end: no crash


def check_reply(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = msgspec.json.decode(r.content)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(body=requests)
def test_hostile_json_bodies(edge_url, body):
    """Random JSON request bodies get a completion or a 4xx OpenAI-shaped error."""
    with httpx.Client(base_url=edge_url, timeout=20) as client:
        r = client.post(
            "/v1/chat/completions", content=msgspec.json.encode(body), headers={"content-type": "application/json"}
        )
        check_reply(r)
        if r.status_code == 200 and body.get("stream") is True:
            assert r.content.endswith(b"data: [DONE]\n\n")


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(raw=st.binary(max_size=300), path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]))
def test_hostile_bytes(edge_url, raw, path):
    """Arbitrary bytes on the POST routes are refused cleanly."""
    with httpx.Client(base_url=edge_url, timeout=20) as client:
        check_reply(client.post(path, content=raw))
        assert client.get("/healthz").status_code == 200


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(body=knob_requests)
def test_hostile_numbers_tool_schemas_and_choices(edge_url, body):
    """Integers and floats at the extremes, long float lists, odd tool_choice shapes and tool schemas with
    $refs (local, looping, http, file) get a completion or a 4xx OpenAI-shaped error; the node stays linked."""
    with httpx.Client(base_url=edge_url, timeout=20) as client:
        r = client.post("/v1/chat/completions", content=msgspec.json.encode(body))
        if r.status_code == 502:  # a forced tool call the simulated model never makes: the model's failure
            assert r.json()["error"]["type"] == "tool_validation_error", r.text
        else:
            check_reply(r)
        assert_node_linked(client)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(raw=raw_bodies)
def test_hostile_nesting_and_literals(edge_url, raw):
    """Deep nesting anywhere in a body and number literals beyond every range are refused with a 4xx
    OpenAI-shaped error (or served); the node stays linked."""
    with httpx.Client(base_url=edge_url, timeout=20) as client:
        check_reply(client.post("/v1/chat/completions", content=raw))
        assert_node_linked(client)


def test_oversized_and_odd_requests(edge_url):
    """Huge bodies, wrong methods and odd headers: clear 4xx answers."""
    with httpx.Client(base_url=edge_url, timeout=20) as client:
        r = client.post("/v1/chat/completions", content=b"{" + b" " * 100_000 + b"}")
        assert r.status_code == 413
        check_reply(client.get("/v1/chat/completions"))
        check_reply(client.post("/v1/chat/completions", content=b"{}", headers={"content-type": "text/plain"}))
        check_reply(
            client.post(
                "/v1/chat/completions",
                content=b'{"model": "iop-sim", "messages": [{"role": "user", "content": "\\ud800"}]}',
            )
        )


block_types = (
    st.sampled_from(["text", "image", "tool_use", "tool_result", "thinking", "document", "nope"]) | json_values
)
blocks = st.lists(
    st.fixed_dictionaries(
        {"type": block_types},
        optional={
            "text": json_values,
            "source": json_values,
            "id": json_values,
            "name": json_values,
            "input": json_values,
            "tool_use_id": json_values,
            "content": json_values,
        },
    ),
    max_size=3,
)
block_messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": blocks | json_values}),
    min_size=1,
    max_size=3,
)
items = st.lists(
    st.fixed_dictionaries(
        {"type": block_types | st.sampled_from(["message", "function_call", "function_call_output"])},
        optional={"role": json_values, "content": blocks | json_values, "call_id": json_values, "output": json_values},
    ),
    max_size=3,
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    path=st.sampled_from(["/v1/messages", "/v1/messages/count_tokens", "/v1/responses"]),
    turns=block_messages,
    input_items=items,
)
def test_hostile_blocks_and_items_on_messages_and_responses(edge_url, path, turns, input_items):
    """Odd content blocks (a `type` that is a list or an object was a 500 on the Messages API: an
    outside audit) and Responses input items: an answer or a 4xx in the API's own shape."""
    if path == "/v1/responses":
        body = {"model": "iop-sim", "input": input_items, "max_output_tokens": 16}
    else:
        body = {"model": "iop-sim", "max_tokens": 3, "messages": turns}
    with httpx.Client(base_url=edge_url, timeout=20) as client:
        r = client.post(path, content=msgspec.json.encode(body))
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        answer = msgspec.json.decode(r.content)
        if path == "/v1/responses":
            assert answer["error"]["message"], answer
        else:
            assert answer["type"] == "error" and answer["error"]["type"] and answer["error"]["message"], answer
