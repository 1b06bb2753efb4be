"""First contact (issue 10): what real clients and a newcomer ran into first.

GET /v1/models/{id}, start-up failures that are one line naming the key or the
address, the README's hypercorn line as written, and README commands and
samples that match what the code does.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import trio

from edge.config import EdgeConfig, check_bind
from iop.cli import demo_model
from iop.configfile import ConfigError, convert
from node.agent import NodeAgent
from node.config import NodeConfig
from scripts.stack import free_port
from tests.conftest import (
    BOUND,
    TOKEN,
    edge_config,
    eventually,
    http,
    model,
    node_config,
    sdk,
    start_edge,
    start_node,
    write_toml,
)

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
IOP = [sys.executable, "-m", "iop.cli"]


# -- GET /v1/models/{id} -------------------------------------------------------------


async def test_models_retrieve_returns_the_listed_card(nursery, edge, node):
    """`client.models.retrieve("m")` returns the same card as m's entry in /v1/models."""
    async with sdk(edge) as client:
        card = await client.models.retrieve("m")
        listed = (await client.models.list()).data
    assert card.id == "m" and card.object == "model"
    assert card.model_dump() == next(c for c in listed if c.id == "m").model_dump()
    assert card.model_extra["nodes"] == ["n1"]


async def test_models_retrieve_takes_ids_with_slashes(nursery, edge):
    """A model id holding `/` (Qwen/Qwen3-8B) is retrieved whole, as the SDK sends it (%2F)."""
    await start_node(nursery, edge, [model("Qwen/Qwen3-8B")])
    async with sdk(edge) as client:
        card = await client.models.retrieve("Qwen/Qwen3-8B")
    assert card.id == "Qwen/Qwen3-8B"
    async with http(edge) as client:
        r = await client.get("/v1/models/Qwen/Qwen3-8B")  # and with the slash left as it is
    assert r.status_code == 200 and r.json()["id"] == "Qwen/Qwen3-8B"


async def test_models_retrieve_unknown_id_is_model_not_found(nursery, edge, node):
    """An id no linked node serves is a 404 `model_not_found` in the OpenAI error shape."""
    async with sdk(edge) as client:
        with pytest.raises(openai.NotFoundError) as err:
            await client.models.retrieve("nope")
    assert err.value.code == "model_not_found"
    assert err.value.body["type"] == "invalid_request_error"


async def test_models_retrieve_needs_the_api_key_as_the_list_does(nursery):
    """With api_keys set, /v1/models/{id} refuses a missing key (401) and answers a right one."""
    edge = await start_edge(nursery, edge_config(api_keys=["sk-right"]))
    await start_node(nursery, edge, [model("m")])
    async with sdk(edge) as client:
        with pytest.raises(openai.AuthenticationError):
            await client.models.retrieve("m")
    async with sdk(edge, api_key="sk-right") as client:
        assert (await client.models.retrieve("m")).id == "m"


# -- start-up failures: one line naming the key or the address -----------------------


def _one_line_failure(args: list[str], **kw) -> str:
    result = subprocess.run([*IOP, *args], capture_output=True, text=True, timeout=BOUND, **kw)
    assert result.returncode != 0, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("bind", ["127.0.0.1:0", "127.0.0.1:8080", "localhost:65535", "[::1]:8080"])
def test_check_bind_accepts_host_and_port(bind):
    """HOST:PORT with a port of 0 (any free port) to 65535, IPv6 in brackets, is a bind."""
    check_bind(bind)
    assert convert({"bind": bind}, EdgeConfig).bind == bind


@pytest.mark.parametrize("bind", ["notaport", ":8080", "127.0.0.1:", "127.0.0.1:99999", "127.0.0.1:-1", "[::1:80"])
def test_check_bind_refuses_what_cannot_be_listened_on(bind):
    """A bind with no host, no port, a port above 65535 or unbalanced brackets is a config error."""
    with pytest.raises(ConfigError, match=re.escape(repr(bind))):
        check_bind(bind)


def test_bind_port_out_of_range_is_one_line(tmp_path):
    """`bind = "127.0.0.1:99999"` stops `iop edge` with one line naming the key and the address."""
    cfg = write_toml(tmp_path / "edge.toml", {"bind": "127.0.0.1:99999", "node_token": TOKEN})
    line = _one_line_failure(["edge", "--config", cfg])
    assert line == f"iop: {cfg}: bind: port must be 0-65535, got '127.0.0.1:99999'"


def test_a_wrong_choice_is_one_line_naming_the_right_ones(tmp_path):
    """`routing = "fastest"` in edge.toml, `adapter = "vllm"` in node.toml: the line names the
    values the key takes (it said only "invalid enum value")."""
    cfg = write_toml(tmp_path / "edge.toml", {"routing": "fastest", "node_token": TOKEN})
    line = _one_line_failure(["edge", "--config", cfg])
    assert line == (
        f"iop: {cfg}: routing: invalid enum value 'fastest' (one of 'least_loaded', 'prefix', 'random', 'session')"
    )
    node = {"node_id": "n1", "edges": ["ws://127.0.0.1:9/v1/node/link"], "token": TOKEN}
    cfg = write_toml(tmp_path / "node.toml", {**node, "models": [{"name": "q", "adapter": "vllm"}]})
    line = _one_line_failure(["node", "--config", cfg])
    assert line == f"iop: {cfg}: models[0].adapter: invalid enum value 'vllm' (one of 'openai', 'sim')"
    with pytest.raises(ConfigError) as odd:  # a value holding the words of a key's place
        convert({"routing": "x - at `$.y`"}, EdgeConfig)
    assert str(odd.value).startswith("config: routing: invalid enum value 'x - at `$.y`' (one of 'least_loaded'")


@pytest.mark.parametrize("setting", [{"stream_buffer": True}, {"xml_completion_tool": "attempt_completion"}])
def test_a_model_setting_that_needs_strict_output_says_so(tmp_path, setting):
    """`stream_buffer` and `xml_completion_tool` shape only a strict_output model: without it they
    are a config error naming the key (they started and did nothing)."""
    ((name, value),) = setting.items()
    cfg = write_toml(tmp_path / "edge.toml", {"node_token": TOKEN, "models": [{"name": "q", name: value}]})
    line = _one_line_failure(["edge", "--config", cfg])
    assert line == f"iop: {cfg}: models[0].{name}: takes effect only with strict_output = true"
    assert convert({"models": [{"name": "q", "strict_output": True, name: value}]}, EdgeConfig).models[0]


def test_bind_flag_that_is_not_an_address_is_one_line():
    """`iop edge --bind notaport` stops with one line naming the flag and the value."""
    line = _one_line_failure(["edge", "--bind", "notaport"])
    assert line == "iop: --bind: expected HOST:PORT, got 'notaport'"


def test_demo_bind_flag_is_checked_too():
    """`iop demo --bind` with a port above 65535 stops with one line naming the flag."""
    line = _one_line_failure(["demo", "--bind", "127.0.0.1:70000"])
    assert line == "iop: --bind: port must be 0-65535, got '127.0.0.1:70000'"


def test_busy_address_names_the_address(tmp_path):
    """An address already in use stops `iop edge` with one line naming that address."""
    cfg = write_toml(tmp_path / "edge.toml", {"node_token": TOKEN})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _one_line_failure(["edge", "--config", cfg, "--bind", f"127.0.0.1:{port}"])
    assert line == f"iop edge: cannot listen on 127.0.0.1:{port}: Address already in use"


def test_unreadable_tls_file_names_the_flag(tmp_path):
    """A --certfile that cannot be read stops `iop edge` with one line naming the flag and the file."""
    cfg = write_toml(tmp_path / "edge.toml", {"node_token": TOKEN})
    missing = tmp_path / "cert.pem"
    line = _one_line_failure(
        ["edge", "--config", cfg, "--bind", "127.0.0.1:0", "--certfile", str(missing), "--keyfile", str(missing)]
    )
    assert line == f"iop: --certfile: cannot read {missing}: No such file or directory"


def test_node_without_token_is_one_line(tmp_path):
    """A node config with no `token` stops `iop node` at start with one line naming the key."""
    cfg = write_toml(
        tmp_path / "node.toml",
        {"node_id": "n1", "edges": ["ws://127.0.0.1:1/v1/node/link"], "models": [{"name": "m", "adapter": "sim"}]},
    )
    line = _one_line_failure(["node", "--config", cfg])
    assert line.startswith(f"iop: {cfg}: token: ") and "node token" in line


# -- the README's hypercorn line, as written -----------------------------------------


def _readme_hypercorn_line() -> str:
    lines = [ln for ln in README.splitlines() if ln.startswith("IOP_EDGE_CONFIG=") and " hypercorn " in ln]
    assert len(lines) == 1, lines
    return lines[0]


async def test_readme_hypercorn_line_links_a_node_and_logs_json(nursery, tmp_path, upstream):
    """The README's hypercorn line, run as written (edge.toml here, a free port for 8080),
    serves on that port, links a node, and logs JSON lines only when stderr is a file."""
    line = _readme_hypercorn_line()
    assert "--bind 127.0.0.1:8080" in line, line
    port = free_port()
    argv = shlex.split(line.replace("127.0.0.1:8080", f"127.0.0.1:{port}"))
    env_assign, argv = argv[0], argv[1:]
    assert env_assign == "IOP_EDGE_CONFIG=edge.toml" and argv[0] == "hypercorn"
    argv[0] = os.path.join(os.path.dirname(sys.executable), "hypercorn")
    write_toml(tmp_path / "edge.toml", {"node_token": TOKEN})
    env = {k: v for k, v in os.environ.items() if not k.startswith("IOP_")}
    err_path = tmp_path / "stderr.log"
    with err_path.open("wb") as err:
        # Its own process group: hypercorn's CLI runs its worker in a child process.
        proc = await trio.lowlevel.open_process(
            argv, cwd=tmp_path, env={**env, "IOP_EDGE_CONFIG": "edge.toml"}, stderr=err, start_new_session=True
        )
    try:
        url = f"http://127.0.0.1:{port}"
        agent = NodeAgent(node_config([url.replace("http", "ws", 1) + "/v1/node/link"], [model("m", upstream)]))
        nursery.start_soon(agent.serve)
        await eventually(lambda: '"node linked"' in err_path.read_text(), what="the edge logged the node linked")
        async with httpx.AsyncClient(base_url=url, timeout=BOUND) as client:
            r = await client.get("/v1/models/m")
        assert r.status_code == 200 and r.json()["nodes"] == ["n1"]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        with trio.CancelScope(shield=True), trio.fail_after(BOUND):
            await proc.wait()
    events = [json.loads(ln) for ln in err_path.read_text().splitlines() if ln.strip()]  # every line is JSON
    msgs = [e["msg"] for e in events]
    assert "node linked" in msgs
    assert any(m.startswith(f"Running on http://127.0.0.1:{port}") for m in msgs)  # hypercorn's own line too


# -- README commands and samples match the code --------------------------------------


def _readme_toml(heading: str) -> dict:
    block = re.search(rf"### {re.escape(heading)}\n\n```toml\n(.*?)```", README, re.S)
    assert block, heading
    return tomllib.loads(block.group(1))


def test_readme_configs_load_and_keep_off_hypercorns_port():
    """The README's edge.toml and node.toml load as written, and no model server sits on 8000
    (hypercorn's default port)."""
    edge = convert(_readme_toml("edge.toml"), EdgeConfig)
    node = convert(_readme_toml("node.toml"), NodeConfig)
    assert edge.bind == "127.0.0.1:8080" and node.edges == ["ws://127.0.0.1:8080/v1/node/link"]
    base_urls = [m.base_url for m in node.models if m.base_url]
    assert base_urls and not any(":8000/" in u for u in base_urls), base_urls


async def test_readme_edge_and_node_files_work_together_with_its_curl_line(nursery):
    """The README's edge.toml and node.toml (its sim model; another port, no ledger file) and the
    curl line after them: its key may use its model (the key once allowed only qwen* and
    llama-3*, and its secret was in a comment alone: 401, then 404)."""
    edge_cfg = msgspec.structs.replace(convert(_readme_toml("edge.toml"), EdgeConfig), ledger="off")
    node_cfg = convert(_readme_toml("node.toml"), NodeConfig)
    line = re.search(r"### node\.toml\n.*?```sh\n(curl .*?)```", README, re.S).group(1)
    secret = re.search(r"Bearer (\S+?)'", line).group(1)
    body = json.loads(re.search(r"-d '(\{.*\})'", line).group(1))
    edge = await start_edge(nursery, edge_cfg)
    sims = [m for m in node_cfg.models if m.adapter == "sim"]
    assert [m.name for m in sims] == [body["model"]]
    await start_node(nursery, edge, sims, node_id=node_cfg.node_id, token=node_cfg.token)
    with trio.fail_after(BOUND):
        async with httpx.AsyncClient(base_url=edge.url, timeout=BOUND) as c:
            r = await c.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {secret}"})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
            # An agent's request (Claude Code asks max_tokens 32,000) gets an answer of its own
            # length, as from `iop demo`'s model of that name (it streamed 32,000 tokens at 50 a
            # second: an outside audit).
            long = {**body, "max_tokens": 32_000}
            r = await c.post("/v1/chat/completions", json=long, headers={"Authorization": f"Bearer {secret}"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 64, r.text


async def test_readme_python_blocks_run_as_written_against_the_demo_model(nursery):
    """The README's Python blocks (the OpenAI SDK's stream, the Anthropic SDK's message, the sim's
    tool round trip), run in order in one interpreter as a newcomer pastes them, against an edge
    serving the demo's model (its address for 127.0.0.1:8080): each runs, and what the comments
    say it prints, it prints."""
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert len(blocks) >= 3
    edge = await start_edge(nursery)
    await start_node(nursery, edge, [msgspec.structs.replace(demo_model(), tokens_per_s=0, ttft_ms=0)])
    code = "\n".join(blocks).replace("http://127.0.0.1:8080", edge.url)
    with trio.fail_after(60):
        done = await trio.run_process(
            [sys.executable, "-c", code], capture_stdout=True, capture_stderr=True, check=False
        )
    out = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    promised = re.findall(r"^print\(.*\)  # (.+)$|^# (.+)$", "\n".join(blocks), re.M)
    assert promised
    for said in (a or b for a, b in promised):
        assert said in out, (said, out)


def test_readme_sample_config_error_is_what_iop_prints(tmp_path):
    """The README's sample config error is the line `iop edge --config edge.toml` prints for it."""
    (tmp_path / "edge.toml").write_text('wait_timeout_s = "soon"\n')
    line = _one_line_failure(["edge", "--config", "edge.toml"], cwd=tmp_path)
    assert f"`` {line} ``" in README or f"`{line}`" in README, line


def test_readme_probe_round_count_is_the_probes_default():
    """The rounds the README's cancel-probe table names are what `make probe` runs."""
    documented = re.search(r"request aborted, (\d+) rounds each", README)
    default = re.search(r'"--rounds", type=int, default=(\d+)', (ROOT / "scripts" / "cancel_probe.py").read_text())
    assert documented and default and documented.group(1) == default.group(1)


def _script(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``scripts/<name> args`` run as a user runs it, from the repository's root."""
    return subprocess.run(
        [sys.executable, f"scripts/{name}", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_cancel_probe_runs_and_times_every_phase():
    """`scripts/cancel_probe.py` (`make probe`) runs end to end in seconds and times all four
    phases: before its edge kept alive every 0.2 s, each round waited out the 10 s keep-alive
    for the stream before its first token to commit (50 rounds, 9 minutes, nothing printed)."""
    result = _script("cancel_probe.py", "--rounds", "2", timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    for phase in ("queued", "first-token", "mid-stream", "non-stream"):
        row = re.search(rf"^{phase} +([\d.]+) +([\d.]+) +([\d.]+)$", result.stdout, re.M)
        assert row and 0 < float(row.group(1)) < 1000, result.stdout
    assert "round 2/2" in result.stderr


def test_cost_model_script_runs_as_the_readme_names_it():
    """`scripts/cost_model.py`, which the README's figures on where the CPU goes
    come from, runs end to end (a small run) and reports every part it names.
    300 requests: /proc counts CPU in 10 ms ticks, and a fast machine spends
    well under that on 60 requests of the bare app."""
    result = _script("cost_model.py", "--requests", "300", "--concurrency", "4")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for name in ("hypercorn, bare ASGI app", "edge", "node"):
        row = re.search(rf"^  {re.escape(name)} +(\d+)  \((\d+) \+ (\d+)\)$", out, re.M)
        assert row and int(row.group(1)) > 0, out
    # (a fit of coarse samples: any column but the first two may come out negative, e.g. an edge
    # whose 200-token streams were charged 0 ticks, seen once in CI: "-3.12 -0.0")
    assert re.search(r"^  edge +\d+ +\d+ +-?\d+ +-?[\d.]+ +-?[\d.]+$", out, re.M), out
    assert "cores in use meanwhile" in out and "per-request work" in out, out
    assert "scripts/cost_model.py" in README


def test_hops_script_times_every_segment_of_the_first_token_s_way():
    """`scripts/hops.py`, which the README's hop-by-hop table comes from, runs
    end to end and times every segment: each of the functions it wraps in the
    edge and the node is still called on a run's way (one renamed, and no
    request would carry every mark: the script stops saying so)."""
    result = _script("hops.py", "--requests", "30")
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert re.search(r"^30 sequential streamed requests", out, re.M), out
    ends = ("request in", "run out", "run in", "upstream out", "upstream in", "events out", "events in")
    for end in (*ends, "response out", "first content read"):
        row = re.search(rf"^\S.*: {end} +(\d+) +(\d+)", out, re.M)
        assert row and int(row.group(1)) > 0, (end, out)
    for end in ("run out", "upstream out", "events out", "response out"):  # within one process: its CPU too
        assert re.search(rf": {end} +\d+ +\d+ +\d+$", out, re.M), (end, out)
    assert "scripts/hops.py" in README


@pytest.mark.parametrize(
    ("more", "line"),
    [([], "iop demo --bind 127.0.0.1:9090"), (["TOKENS_PER_S=2"], "iop demo --bind 127.0.0.1:9090 --tokens-per-s 2")],
)
def test_make_demo_takes_bind(more, line):
    """`make demo BIND=HOST:PORT` runs the demo on that address (and `TOKENS_PER_S=N` at that pace)."""
    result = subprocess.run(
        ["make", "--no-print-directory", "-n", "demo", "BIND=127.0.0.1:9090", *more],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=BOUND,
    )
    assert result.returncode == 0, result.stderr
    # Under `make test` the outer make's MAKEFLAGS reach this one: look at the commands only.
    commands = [line for line in result.stdout.splitlines() if not line.startswith("make")]
    assert commands[-1].endswith(line), result.stdout


def test_a_ledger_that_cannot_be_opened_is_one_line(tmp_path):
    """`iop edge` whose state_dir cannot hold the ledger stops with one line saying what to set."""
    (tmp_path / "a-file").write_text("not a directory")
    cfg = write_toml(
        tmp_path / "edge.toml", {"bind": "127.0.0.1:0", "node_token": TOKEN, "state_dir": str(tmp_path / "a-file")}
    )
    line = _one_line_failure(["edge", "--config", cfg])
    assert line.startswith("iop: ledger: cannot open ") and 'ledger = "off"' in line


async def test_an_answer_before_the_body_closes_the_connection(nursery, edge, node):
    """A 404 (or 405, 401) that Quart answers before a POST's body has come in (httpx and the
    SDKs send head and body in two writes) left the connection open, and the next request on it
    was never answered: `client.moderations.create` (404), then `chat.completions.create` on the
    same client was an APIConnectionError. Such an answer now says `connection: close`."""
    with trio.fail_after(BOUND):
        stream = await trio.open_tcp_stream("127.0.0.1", edge.port)
        async with stream:
            await stream.send_all(b"POST /v1/nope HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n")
            head = b""
            while b"\r\n\r\n" not in head:
                head += await stream.receive_some(65536)
            await stream.send_all(b"{}GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            rest = b""
            while data := await stream.receive_some(65536):  # the edge closes: no wait for an answer
                rest += data
        assert head.startswith(b"HTTP/1.1 404") and b"connection: close" in head.lower()
        async with sdk(edge) as client:
            for _ in range(20):
                with pytest.raises(openai.NotFoundError):
                    await client.moderations.create(input="hi")
                r = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1
                )
                assert r.choices[0].message.content


def test_cost_model_says_when_a_run_measured_no_cpu():
    """/proc counts CPU in 10 ms ticks, so a small run (the one above, on a fast
    machine) can measure none: the script says so instead of dividing by zero."""
    from scripts.cost_model import verdict

    line = verdict([(0.0, 0.0), (0.0, 0.0)], (0.0, 0.0))
    assert "0.0 µs per token" in line and "too little CPU measured" in line
    line = verdict([(2000.0, 3.0), (2000.0, 4.0)], (3000.0, 1000.0))
    assert "27.0 µs per token, of which 20.0 is per-request work spread over the stream (74%)" in line


def test_a_sentinel_longer_than_a_special_token_is_a_config_error(tmp_path):
    """A `sentinels` entry of 500 characters started and made every request to its model a 500
    (the filter's pattern is a trie, a level a character): 1 to 64 characters, one line at start."""
    cfg = write_toml(tmp_path / "edge.toml", {"node_token": TOKEN, "models": [{"name": "q", "sentinels": ["x" * 500]}]})
    line = _one_line_failure(["edge", "--config", cfg])
    assert line == f"iop: {cfg}: models[0].sentinels: at most 256, each 1 to 64 characters"
    assert convert({"models": [{"name": "q", "sentinels": ["<|eot|>"]}]}, EdgeConfig).models[0]
