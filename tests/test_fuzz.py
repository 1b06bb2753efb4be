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

json_scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=40)
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
