"""Run a real agent CLI (Claude Code, Codex) against a test edge with nothing but loopback.

The CLIs come from tests/js (``npm ci --prefix tests/js``, pinned by its package-lock.json);
``IOP_CLAUDE`` / ``IOP_CODEX`` may name other binaries. Each run is inside ``unshare -rn``: a
fresh network namespace whose only interface is its own loopback, so whatever the CLI tries
to reach beyond the edge (its vendor's hosts, telemetry, updates) goes nowhere. The edge lives
in the test's namespace; this module bridges the two through a Unix socket: inside the
namespace a relay (this file, run as a script) listens on 127.0.0.1 at the edge's port and
forwards each connection to the socket, where the test forwards it on to the edge. The CLI
sees ``http://127.0.0.1:<edge port>``, as it would without the namespace.

Missing binaries or ``unshare`` skip the tests locally and fail them in CI (``CI`` set).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

RELAY = str(Path(__file__).resolve())  # this file, run as a script inside the namespace
JS_BIN = Path(RELAY).parent / "js" / "node_modules" / ".bin"


def agent_binary(name: str, env_var: str) -> str | None:
    """The CLI to run: $env_var, else tests/js/node_modules/.bin/<name>; None if neither exists."""
    path = os.environ.get(env_var) or str(JS_BIN / name)
    return path if os.access(path, os.X_OK) else None


def _namespaces_work() -> bool:
    if not shutil.which("unshare"):
        return False
    try:
        done = subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


NAMESPACES = _namespaces_work()


def require_agent(name: str, env_var: str) -> str:
    """The binary of `name`, or skip (locally) / fail (in CI) when it or `unshare -rn` is missing."""
    import pytest

    path = agent_binary(name, env_var)
    problem = None
    if path is None:
        problem = f"no {name} binary: run `npm ci --prefix tests/js` (or set {env_var})"
    elif not NAMESPACES:
        problem = "`unshare -rn` is unavailable: the agent CLIs run only without a route off the machine"
    if problem is None:
        return path  # type: ignore[return-value]
    if os.environ.get("CI"):
        pytest.fail(problem)
    pytest.skip(problem)


def quiet_env(home: Path, **extra: str) -> dict[str, str]:
    """A minimal environment: a throwaway HOME, no proxies, no inherited credentials."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        **extra,
    }


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


async def run_offline(argv: Sequence[str], *, port: int, env: dict[str, str], cwd: Path) -> Done:
    """Run `argv` inside `unshare -rn` (loopback only) with 127.0.0.1:`port` relayed to the
    test's 127.0.0.1:`port` (the edge). Bound it with trio.fail_after in the caller."""
    import trio

    sockdir = tempfile.mkdtemp(prefix="iop-agent-", dir="/tmp")  # short: AF_UNIX paths are <108 bytes
    sock_path = os.path.join(sockdir, "edge.sock")

    async def forward(conn: trio.SocketStream) -> None:
        async with conn:
            try:
                edge = await trio.open_tcp_stream("127.0.0.1", port)
            except OSError:
                return
            async with edge, trio.open_nursery() as pipes:

                async def pump(src, dst) -> None:
                    try:
                        while data := await src.receive_some(65536):
                            await dst.send_all(data)
                        await dst.send_eof()
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pipes.cancel_scope.cancel()

                pipes.start_soon(pump, conn, edge)
                pipes.start_soon(pump, edge, conn)

    listener_sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await listener_sock.bind(sock_path)
    listener_sock.listen(64)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, forward, [trio.SocketListener(listener_sock)])
            relay = [sys.executable, RELAY, str(port), sock_path, "--", *argv]
            done = await trio.run_process(
                ["unshare", "-rn", *relay],
                env=env,
                cwd=str(cwd),
                stdin=b"",
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
            nursery.cancel_scope.cancel()
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)
    return Done(done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace"))


# -- inside the namespace: bring lo up, check it is alone, relay, run the CLI ----------------


def _loopback_up() -> None:
    import fcntl
    import socket
    import struct

    SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH14x", b"lo", 0))
        flags = struct.unpack("16sH14x", ifreq)[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def _relay_main(port: int, sock_path: str, argv: list[str]) -> int:
    import socket
    import threading

    _loopback_up()
    names = [name for _, name in socket.if_nameindex()]
    if names != ["lo"]:  # the hard rule: nothing but loopback may be reachable
        print(f"agents relay: interfaces {names}, refusing to run", file=sys.stderr)
        return 97

    listener = socket.create_server(("127.0.0.1", port))

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:  # (one side reset: end both, or the CLI waits on its socket for ever)
            for end in (src, dst):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def serve(conn: socket.socket) -> None:
        with conn:
            try:
                up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                up.connect(sock_path)
            except OSError:
                return
            with up:
                back = threading.Thread(target=pump, args=(up, conn), daemon=True)
                back.start()
                pump(conn, up)
                back.join()

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    def die_with_relay() -> None:  # a killed relay (the test's timeout) takes the CLI with it
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    threading.Thread(target=accept, daemon=True).start()
    return subprocess.run(argv, preexec_fn=die_with_relay).returncode


if __name__ == "__main__":
    split = sys.argv.index("--")
    sys.exit(_relay_main(int(sys.argv[1]), sys.argv[2], sys.argv[split + 1 :]))
