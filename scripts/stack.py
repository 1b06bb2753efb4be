"""Start an upstream, an edge and a node as separate processes on loopback.

Used by scripts/bench.py and scripts/cancel_probe.py; every process is
killed when the context exits.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "stack-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return str(value)


def write_toml(path: Path, data: dict) -> Path:
    lines = [f"{k} = {_toml(v)}" for k, v in data.items() if not (isinstance(v, list) and v and isinstance(v[0], dict))]
    for key, value in data.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            for table in value:
                lines.append(f"\n[[{key}]]")
                lines += [f"{k} = {_toml(v)}" for k, v in table.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def wait_http(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


class Stack(ExitStack):
    """``with Stack() as s: s.upstream(...); s.edge(...); s.node(...)``"""

    def __init__(self, root: Path = ROOT) -> None:
        """``root``: the checkout whose edge and node run (the upstream is
        always this one's), e.g. a worktree of an older revision."""
        super().__init__()
        self.root = root
        self.auth: dict[str, dict[str, str]] = {}  # edge URL -> headers for its /v1/nodes
        self.dir = Path(self.enter_context(tempfile.TemporaryDirectory(prefix="iop-stack-")))
        self.env = {**os.environ, "IOP_LOG_LEVEL": "warning", "IOP_LOG_FORMAT": "json", "PYTHONPATH": str(root)}

    def _spawn(self, args: list[str], log_file: Path | None = None) -> subprocess.Popen:
        """``log_file``: the process logs there, at info level."""
        if log_file is not None:
            env = {**self.env, "IOP_LOG_LEVEL": "info"}
            stderr = self.enter_context(open(log_file, "wb"))  # closed with the stack
        else:
            env, stderr = self.env, None if os.environ.get("IOP_STACK_LOGS") else subprocess.DEVNULL
        proc = subprocess.Popen(args, cwd=self.root, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        self.callback(_kill, proc)
        return proc

    def stop(self, proc: subprocess.Popen) -> None:
        """SIGTERM (a node drains, an edge too) and wait; SIGKILL after 5 s."""
        _kill(proc)

    def upstream(self, *, tokens: int = 0, interval_ms: float = 0.0, ttft_ms: float = 0.0) -> str:
        port = free_port()
        args = [
            sys.executable,
            str(ROOT / "scripts/upstream.py"),
            "--port",
            str(port),
            "--interval-ms",
            str(interval_ms),
            "--ttft-ms",
            str(ttft_ms),
        ]
        if tokens:
            args += ["--tokens", str(tokens)]
        self.upstream_proc = self._spawn(args)  # the last one started
        wait_http(f"http://127.0.0.1:{port}/v1/models")
        return f"http://127.0.0.1:{port}/v1"

    def edge(self, port: int = 0, **config) -> str:
        port = port or free_port()
        if "state_dir" in (self.root / "edge/config.py").read_text():  # an older revision may not have it
            config.setdefault("state_dir", str(self.dir / f"state-{port}"))
        cfg = write_toml(self.dir / f"edge-{port}.toml", {"bind": f"127.0.0.1:{port}", "node_token": TOKEN, **config})
        self.edge_proc = self._spawn([sys.executable, "-m", "iop.cli", "edge", "--config", str(cfg)])
        wait_http(f"http://127.0.0.1:{port}/healthz")
        url = f"http://127.0.0.1:{port}"
        keys = config.get("admin_keys") or [k["key"] for k in config.get("keys", ()) if k.get("key")]
        if keys:  # /v1/nodes, which wait_linked reads, asks for a key
            self.auth[url] = {"Authorization": f"Bearer {keys[0]}"}
        return url

    def node(
        self,
        edge_url: str | list[str],
        models: list[dict],
        node_id: str = "stack-node",
        log_file: Path | None = None,
        **config,
    ) -> subprocess.Popen:
        """A node linked to one edge or several; ``log_file``: its info-level log."""
        edge_urls = [edge_url] if isinstance(edge_url, str) else edge_url
        links = [url.replace("http", "ws", 1) + "/v1/node/link" for url in edge_urls]
        cfg = write_toml(
            self.dir / f"{node_id}.toml",
            {"node_id": node_id, "edges": links, "token": TOKEN, "models": models, **config},
        )
        proc = self._spawn([sys.executable, "-m", "iop.cli", "node", "--config", str(cfg)], log_file)
        for url in edge_urls:
            wait_linked(url, node_id, self.auth.get(url))
        return proc


def wait_linked(edge_url: str, node_id: str, headers: dict[str, str] | None = None, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(edge_url + "/v1/nodes", timeout=1, headers=headers)
            if r.status_code == 200 and any(n["id"] == node_id for n in r.json()["data"]):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"node {node_id} did not link to {edge_url}")


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.kill(proc.pid, signal.SIGCONT)  # a stopped process cannot handle SIGTERM
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
