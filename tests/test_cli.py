"""The `iop` command line as a user runs it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from scripts.stack import free_port
from tests.conftest import BOUND, write_toml

IOP = [sys.executable, "-m", "iop.cli"]


@pytest.mark.parametrize(
    ("kind", "config", "expected"),
    [
        ("edge", {"wait_timeout_s": "soon"}, "wait_timeout_s: expected `float`, got `str`"),
        ("edge", {"bind": "nowhere"}, "bind: expected HOST:PORT"),
        ("edge", {"colour": "blue"}, "colour: unknown key"),
        ("edge", {"models": [{"name": "m", "strict_outptu": True}]}, "models[0].strict_outptu: unknown key"),
        (
            "node",
            {"node_id": "n1", "edges": ["http://x"], "models": [{"name": "m", "adapter": "sim"}]},
            "edges[0]: expected a ws://",
        ),
        ("node", {"node_id": "n1", "edges": ["ws://127.0.0.1:1/v1/node/link"]}, "models: the node serves no model"),
        (
            "node",
            {"node_id": "n1", "edges": ["ws://h/v1/node/link"], "models": [{"name": "m", "adapter": "gpu"}]},
            "models[0].adapter",
        ),
        ("edge", {"drain_grace_s": -1}, "drain_grace_s: must not be negative"),
        ("edge", {"ping_misses": 1}, "ping_misses: must be at least 2"),
        ("edge", {"keys": [{"id": "a\u202eb", "key": "sk-x"}]}, "keys[0].id: 1 to 64 characters of printable ASCII"),
        (  # (it took the plain key's place: sk-plain was refused, unsaid)
            "edge",
            {"api_keys": ["sk-plain"], "keys": [{"id": "api_keys[0]", "key": "sk-other"}]},
            "keys[0].id: 'api_keys[0]' is reserved",
        ),
        ("edge", {"max_frame_bytes": 1}, "max_frame_bytes: at least 65536"),
        ("edge", {"backlog": 9223372036854775807}, "backlog: between 1 and 65535"),
        ("edge", {"ledger": "mysql://x"}, "ledger: a SQLite path"),
        ("edge", {"api_keys": [""]}, "api_keys: an empty key"),
        ("edge", {"models": [{"name": "m", "queue_timeout_ms": -5}]}, "models[0].queue_timeout_ms: must not be"),
        ("edge", {"models": [{"name": "m", "max_tool_attempts": 0}]}, "models[0].max_tool_attempts: between 1 and 10"),
        (
            "node",
            {
                "node_id": "n",
                "edges": ["ws://h/v1/node/link"],
                "drain_grace_s": -1,
                "models": [{"name": "m", "adapter": "sim"}],
            },
            "drain_grace_s: must not be negative",
        ),
        (
            "node",
            {
                "node_id": "n",
                "edges": ["ws://h/v1/node/link"],
                "connect_timeout_s": 0,
                "models": [{"name": "m", "adapter": "sim"}],
            },
            "connect_timeout_s: must be greater than 0",
        ),
        (
            "node",
            {"node_id": "n", "edges": ["ws://127.0.0.1:99999/x"], "models": [{"name": "m", "adapter": "sim"}]},
            "edges[0]: Port out of range",
        ),
        (
            "node",
            {
                "node_id": "n",
                "edges": ["ws://h/v1/node/link"],
                "ca_file": "/nonexistent.pem",
                "models": [{"name": "m", "adapter": "sim"}],
            },
            "ca_file: no file at /nonexistent.pem",
        ),
        (
            "node",
            {"node_id": "gpu 1\u202e", "edges": ["ws://h/v1/node/link"], "models": [{"name": "m", "adapter": "sim"}]},
            "node_id: holds a character that is not printable ASCII (or a space)",
        ),
        (
            "node",
            {"node_id": "n1", "edges": ["ws://h/v1/node/link"], "models": [{"name": "m" * 300, "adapter": "sim"}]},
            "models[0].name: longer than 256 characters",
        ),
    ],
)
def test_bad_config_fails_at_start_with_one_line(tmp_path, kind, config, expected):
    """A bad config file stops `iop edge` / `iop node` at once with one line naming the key."""
    path = write_toml(tmp_path / f"{kind}.toml", config)
    result = subprocess.run([*IOP, kind, "--config", path], capture_output=True, text=True, timeout=BOUND)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr


@pytest.mark.parametrize("pace", [[], ["--tokens-per-s", "10"]])
def test_demo_serves_the_simulated_model(pace):
    """`iop demo --bind` starts an edge with a simulated node and prints a curl line that works;
    `--tokens-per-s` slows the model (to watch a run in the console: the README's tip for it
    needed a node of one's own, and the demo's node token is never shown; a newcomer's audit)."""
    port = free_port()
    proc = subprocess.Popen(
        [*IOP, "demo", "--bind", f"127.0.0.1:{port}", *pace],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        deadline = time.monotonic() + BOUND
        printed = ""
        while "curl" not in printed:
            assert time.monotonic() < deadline
            printed += proc.stdout.readline()
        assert f"http://127.0.0.1:{port}/v1/chat/completions" in printed
        asked = time.monotonic()
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": "iop-sim", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5},
            timeout=BOUND,
        )
        took = time.monotonic() - asked
        assert r.status_code == 200
        assert len(r.json()["choices"][0]["message"]["content"].split()) == 5
        assert took >= 0.4 or not pace, took  # (5 tokens at 10 a second: 0.5 s; at 50, 0.1)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(BOUND)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert proc.returncode == 0


def test_python_dash_m_iop_is_the_iop_command():
    """`python -m iop` runs what `iop` runs (it was "No module named iop.__main__")."""
    result = subprocess.run([sys.executable, "-m", "iop", "--help"], capture_output=True, text=True, timeout=BOUND)
    assert result.returncode == 0 and result.stdout.startswith("usage: iop "), result.stderr
    assert "{demo,edge,node,usage}" in result.stdout
    version = subprocess.run([sys.executable, "-m", "iop", "--version"], capture_output=True, text=True, timeout=BOUND)
    assert version.returncode == 0 and version.stdout.startswith("iop 0."), (version.stdout, version.stderr)


def test_busy_address_is_one_line():
    """An address already in use stops `iop edge` with one line, not a traceback."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [*IOP, "edge", "--bind", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=BOUND
        )
    assert result.returncode == 1
    expected = f"iop edge: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert result.stderr.strip().splitlines()[-1] == expected
    assert "Traceback" not in result.stderr


def test_a_certificate_without_its_key_is_a_config_error(tmp_path):
    """`--certfile` without `--keyfile` served plain HTTP and said nothing (the same in edge.toml
    was refused): it is a one-line config error now."""
    cert = tmp_path / "cert.pem"
    cert.write_text("not read")
    result = subprocess.run(
        [*IOP, "edge", "--bind", "127.0.0.1:0", "--certfile", str(cert)], capture_output=True, text=True, timeout=BOUND
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "iop: --certfile: TLS needs both a certificate and a key: --keyfile is missing"
    result = subprocess.run(
        [*IOP, "edge", "--bind", "127.0.0.1:0", "--keyfile", str(cert)], capture_output=True, text=True, timeout=BOUND
    )
    assert result.stderr.strip() == "iop: --keyfile: TLS needs both a certificate and a key: --certfile is missing"


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["--log-level", "bogus", "demo"], {}, "iop: --log-level: 'bogus' is not one of debug, info, warning, error"),
        (["demo", "--log-level", "bogus"], {}, "iop: --log-level: 'bogus' is not one of debug, info, warning, error"),
        # Any case, as IOP_LOG_LEVEL: past the log settings, to the missing config
        (["edge", "--config", "/nonexistent.toml"], {"IOP_LOG_FORMAT": "JSON"}, "iop: /nonexistent.toml: cannot read"),
        (["demo"], {"IOP_LOG_LEVEL": "verbose"}, "iop: IOP_LOG_LEVEL: 'verbose' is not one of"),
        (["demo"], {"IOP_LOG_FORMAT": "yaml"}, "iop: IOP_LOG_FORMAT: 'yaml' is not one of json, console"),
    ],
)
def test_a_log_setting_that_is_not_one_is_an_error(argv, env, expected):
    """A log level or format with a typo fell back to info (or console lines) and said nothing."""
    result = subprocess.run([*IOP, *argv], capture_output=True, text=True, timeout=BOUND, env={**os.environ, **env})
    assert result.returncode == 2 and result.stderr.startswith(expected), result.stderr


NODE = {
    "node_id": "n",
    "edges": ["ws://127.0.0.1:9/v1/node/link"],
    "token": "t",
    "models": [{"name": "m", "adapter": "sim"}],
}


@pytest.mark.parametrize(
    ("kind", "config", "expected"),
    [
        ("edge", {"node_token": " s p "}, "node_token: printable ASCII with no spaces around it"),
        ("edge", {"node_tokens": {"n1": ""}}, "node_tokens.n1: printable ASCII"),
        ("edge", {"node_token": "s\u00e9cret"}, "node_token: printable ASCII"),
        ("edge", {"ping_interval_s": 1e-9}, "ping_interval_s: at least 0.1"),
        ("edge", {"write_timeout_s": 1e-9}, "write_timeout_s: at least 0.1"),
        ("edge", {"hello_timeout_s": 1e-9}, "hello_timeout_s: at least 0.1"),
        ("edge", {"keepalive_s": 1e-6}, "keepalive_s: at least 0.05"),
        ("edge", {"max_tool_attempts": 2**63 - 1}, "max_tool_attempts: at most 10"),
        ("edge", {"models": [{"name": "m", "max_tool_attempts": 11}]}, "models[0].max_tool_attempts: between 1 and 10"),
        ("edge", {"ledger": "sqlite://relative.db"}, "ledger: a SQLite path (or sqlite:///path)"),
        ("edge", {"ledger_retention_days": -1}, "ledger_retention_days: 0 (every record kept) to 36500"),
        ("edge", {"ledger_retention_days": 2**63}, "ledger_retention_days: 0 (every record kept) to 36500"),
        (
            "node",
            {**NODE, "edges": [NODE["edges"][0]] * 2},
            "edges[1]: 'ws://127.0.0.1:9/v1/node/link' is listed twice",
        ),
        ("node", {**NODE, "ca_file": "/etc/hostname"}, "ca_file: /etc/hostname holds no PEM certificate"),
        ("node", {**NODE, "relink_window_s": -1}, "relink_window_s: must not be negative"),  # (it named relink_max_s)
        ("node", {**NODE, "relink_max_s": 0}, "relink_max_s: must be > 0"),
    ],
)
def test_values_no_link_or_client_could_use_fail_at_start(tmp_path, kind, config, expected):
    """Values an outside audit found accepted, each leaving an edge or node that started and then
    could not work: node tokens no node can send, timings that dropped every link or closed every
    connection unanswered (1e-9 s) or sent a stream nothing but keep-alives, tool attempts that
    ran one request for ever (2^63), a `sqlite://` ledger that made a directory, an edge listed
    twice (redialled for ever), a ca_file that is no certificate (every wss:// dial failed)."""
    path = write_toml(tmp_path / f"{kind}.toml", config)
    result = subprocess.run([*IOP, kind, "--config", path], capture_output=True, text=True, timeout=BOUND)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr


def test_files_that_are_not_utf8_or_no_tls_pair_are_one_line(tmp_path):
    """A config or key file that is not UTF-8 (a traceback before), and a certfile/keyfile that
    are not a certificate and its key (hypercorn's "PEM lib" after binding, naming neither)."""
    latin1 = tmp_path / "edge.toml"
    latin1.write_bytes(b'node_token = "\xe9"\n')
    keys = tmp_path / "keys.txt"
    keys.write_bytes(b"sk-\xe9\n")
    with_keys = write_toml(tmp_path / "keys.toml", {"api_keys_file": str(keys)})
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    for argv, expected in (
        (["edge", "--config", str(latin1)], "edge.toml: not UTF-8 (byte 14)"),
        (["node", "--config", str(latin1)], "edge.toml: not UTF-8"),
        (["edge", "--config", str(with_keys)], "api_keys_file: " + str(keys) + " is not UTF-8 text"),
        (
            ["edge", "--bind", "127.0.0.1:0", "--certfile", str(junk), "--keyfile", str(junk)],
            "certfile, keyfile: " + f"{junk} and {junk} are not a PEM certificate and its private key",
        ),
    ):
        result = subprocess.run([*IOP, *argv], capture_output=True, text=True, timeout=BOUND)
        assert result.returncode == 2, argv
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], result.stderr
