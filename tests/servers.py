"""Real PostgreSQL and Redis servers for tests, on loopback, in temporary
directories (Debian's packages; `.ci/run` installs them when missing).

Locally a missing server skips the tests that need it; in CI (``CI`` set)
it fails them, so a missing install step cannot pass unnoticed.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

from scripts.stack import free_port


def _missing(what: str):
    if os.environ.get("CI"):
        pytest.fail(f"{what} is not installed (.ci/run installs it)")
    pytest.skip(f"{what} is not installed")


class Postgres:
    """``initdb`` + ``pg_ctl`` as the unprivileged ``postgres`` user when run as root."""

    def __init__(self) -> None:
        bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        initdb = bins[-1] if bins else shutil.which("initdb")
        if not initdb:
            _missing("PostgreSQL (initdb)")
        self.bin = os.path.dirname(initdb)
        self.dir = tempfile.mkdtemp(prefix="iop-pg-")
        self.port = free_port()
        self.user: list[str] = []
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            self.user = ["runuser", "-u", "postgres", "--"]
        self._run("initdb", "-D", f"{self.dir}/data", "-U", "iop", "--auth=trust", "-E", "UTF8")
        self.start()
        self.url = f"postgresql://iop@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run([*self.user, f"{self.bin}/{tool}", *args], check=True, capture_output=True, timeout=60)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", f"{self.dir}/data", "-o", options, "-l", f"{self.dir}/log", "-w", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", f"{self.dir}/data", "-m", "fast", "-w", "stop")

    def pids(self) -> list[int]:
        """The server's processes: the postmaster and every backend."""
        with open(f"{self.dir}/data/postmaster.pid") as f:
            main = int(f.readline())
        children = subprocess.run(["pgrep", "-P", str(main)], capture_output=True, text=True).stdout.split()
        return [main, *map(int, children)]

    def pause(self) -> list[int]:
        """Stop every process of the server (SIGSTOP): it answers nothing, its sockets stay open."""
        stopped = []
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:  # a backend that ended meanwhile (a connection just closed)
                continue
            stopped.append(pid)
        return stopped

    @staticmethod
    def resume(paused: list[int]) -> None:
        """SIGCONT what :meth:`pause` stopped. A backend that had ended just before its SIGSTOP
        (a zombie then) is gone once the postmaster, resumed, reaps it: passed over."""
        for pid in paused:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        try:
            self.stop()
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


class Redis:
    def __init__(self) -> None:
        self.exe = shutil.which("redis-server")
        if not self.exe:
            _missing("redis-server")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                redis.Redis(port=self.port, socket_timeout=0.5).ping()
                return
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def close(self) -> None:
        self.stop()


@pytest.fixture(scope="session")
def postgres():
    server = Postgres()
    yield server
    server.close()


@pytest.fixture
def postgres_url(postgres):
    """A fresh database on the session's server."""
    import psycopg

    name = f"t{time.monotonic_ns()}"
    with psycopg.connect(postgres.url, autocommit=True) as db:
        db.execute(f"CREATE DATABASE {name}")
    return postgres.url.rsplit("/", 1)[0] + "/" + name


@pytest.fixture
def redis_server():
    server = Redis()
    yield server
    server.close()
