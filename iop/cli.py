"""``iop demo | edge | node | usage``."""

from __future__ import annotations

import argparse
import errno
import importlib.metadata
import os
import secrets
import signal
import socket
import ssl
import sys
from collections.abc import Callable

import msgspec
import structlog
import trio

from iop import gc_policy, logs
from iop.configfile import ConfigError
from iop.exceptions import first_leaf
from iop.limits import more_open_files

log = structlog.get_logger("iop")

DEMO_MODEL = "iop-sim"


def demo_model(tokens_per_s: float = 50.0):
    """The demo's simulated model. It answers in 64 tokens and stops, as a model would,
    whatever max_tokens asks (Claude Code asks 32,000), and takes a coding agent's prompt:
    Claude Code's system prompt and tools are about 19,000 tokens, plus its max_tokens."""
    from node.config import ModelConfig

    return ModelConfig(
        name=DEMO_MODEL,
        adapter="sim",
        max_concurrency=64,
        context_window=131072,
        sim_tokens=64,
        sim_stops=True,
        tokens_per_s=tokens_per_s,
    )


def _version() -> str:
    try:
        return importlib.metadata.version("iop")
    except importlib.metadata.PackageNotFoundError:  # (run from a checkout that was never installed)
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="iop", description="OpenAI-compatible edge for inference nodes")
    parser.add_argument("--log-level", default=None, help="debug, info, warning, error (default: info)")
    parser.add_argument("--version", action="version", version=f"iop {_version()}")
    # --log-level after the command too (`iop edge --config x --log-level debug`): SUPPRESS keeps a
    # subcommand's default from overwriting one given before it.
    after = argparse.ArgumentParser(add_help=False)
    after.add_argument("--log-level", default=argparse.SUPPRESS, help="as before the command")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="edge plus an in-process simulated node serving iop-sim", parents=[after])
    demo.add_argument("--bind", default="127.0.0.1:8080", help="HOST:PORT (default 127.0.0.1:8080)")
    demo.add_argument(
        "--tokens-per-s",
        type=_tokens_per_s,
        default=50.0,
        help="the simulated model's pace (default 50; 2 makes a run last 30 s, to watch or cancel in the console)",
    )
    edge = sub.add_parser("edge", help="run the edge", parents=[after])
    edge.add_argument(
        "--config",
        required=False,
        help="edge TOML file (default: $IOP_EDGE_CONFIG; with neither, the defaults: no node can link)",
    )
    edge.add_argument("--bind", default=None, help="HOST:PORT, overrides the config's bind")
    edge.add_argument("--certfile", default=None, help="TLS certificate (PEM)")
    edge.add_argument("--keyfile", default=None, help="TLS private key (PEM)")
    node = sub.add_parser("node", help="run a node", parents=[after])
    node.add_argument("--config", required=True, help="node TOML file")
    usage = sub.add_parser("usage", help="the edge's usage ledger, as a table", parents=[after])
    usage.add_argument("--config", required=False, help="edge TOML file (default: $IOP_EDGE_CONFIG)")
    usage.add_argument("--from", dest="start", default=None, help="ISO date/time (UTC) or unix seconds")
    usage.add_argument("--to", dest="end", default=None, help="ISO date/time (UTC) or unix seconds, exclusive")
    usage.add_argument("--group-by", default="key,model", help="comma-separated: key, model, node, api, day")
    usage.add_argument("--format", choices=("table", "csv", "json"), default="table")
    args = parser.parse_args(argv)
    if args.command == "usage":
        try:
            return _usage(args)
        except ConfigError as e:
            print(f"iop: {e}", file=sys.stderr)
            return 2
        except BrokenPipeError:  # (`iop usage | head`: its reader left; a traceback said so)
            # Python's own advice: stdout to devnull, so the interpreter's final flush is quiet too.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
    problem = logs.setting_problem(args.log_level)
    if problem:  # a typo fell back to info (or to console lines) saying nothing
        print(f"iop: {problem}", file=sys.stderr)
        return 2
    logs.configure(args.log_level)
    bind: str | None = None  # the address being listened on, for the error that names it
    try:
        if args.command == "demo":
            bind = _checked_bind(args.bind)
            trio.run(_demo, bind, args.tokens_per_s)
        elif args.command == "edge":
            from edge.config import load_edge_config

            config = load_edge_config(args.config)
            bind = _checked_bind(args.bind) if args.bind else config.bind
            config = msgspec.structs.replace(config, bind=bind)  # (what it warns of, when open, is this)
            certfile = _readable("--certfile", args.certfile) or _readable("certfile", config.certfile)
            keyfile = _readable("--keyfile", args.keyfile) or _readable("keyfile", config.keyfile)
            if bool(certfile) != bool(keyfile):  # one alone served plain HTTP, saying nothing
                given, missing = ("--certfile", "--keyfile") if certfile else ("--keyfile", "--certfile")
                raise ConfigError(f"{given}: TLS needs both a certificate and a key: {missing} is missing")
            if certfile and keyfile:
                _tls_pair(certfile, keyfile)
            trio.run(_edge, config, bind, certfile, keyfile)
        else:
            from node.config import load_node_config

            trio.run(_node, load_node_config(args.config))
    except ConfigError as e:
        print(f"iop: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # trio.Cancelled and KeyboardInterrupt are not Exceptions
        os_error = first_leaf(e)
        if not isinstance(os_error, OSError):
            raise
        print(f"iop {args.command}: {_cannot_start(os_error, bind)}", file=sys.stderr)
        return 1
    return 0


def _usage(args: argparse.Namespace) -> int:
    """Print the ledger's usage, grouped as ``/v1/admin/usage`` groups it."""
    import os
    import sqlite3

    import msgspec

    from edge.admin import parse_group_by, parse_time, usage_csv
    from edge.config import load_edge_config
    from edge.ledger import Dialect, is_postgres, query_usage

    config = load_edge_config(args.config)
    target = config.ledger_target
    if target is None:
        raise ConfigError('ledger: "off" in this config: there is no ledger')
    try:
        start, end = parse_time(args.start, "--from"), parse_time(args.end, "--to")
        groups = parse_group_by(args.group_by, "--group-by")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    errors: tuple[type[Exception], ...] = (sqlite3.Error,)
    if is_postgres(target):
        import psycopg

        errors = (psycopg.Error,)
        try:
            db = psycopg.connect(target, connect_timeout=5)
        except psycopg.Error as e:
            raise ConfigError(f"ledger: cannot connect: {e}") from None
    elif not os.path.exists(target):
        raise ConfigError(f"ledger: {target} does not exist (has this edge served a request?)")
    else:
        db = None
    try:
        if db is None:
            db = sqlite3.connect(f"file:{target}?mode=ro", uri=True)
        rows = query_usage(db, Dialect(is_postgres(target)), start, end, groups)
    except errors as e:  # (a file that is no database, a database no edge has written: a traceback)
        problem = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "usage" in problem and ("no such table" in problem or "does not exist" in problem):
            problem = "it holds no usage records (has an edge written to it?)"
        where = "" if is_postgres(target) else f" {target}:"  # (a URL may hold its password)
        raise ConfigError(f"ledger:{where} {problem}") from None
    finally:
        if db is not None:
            db.close()
    if args.format == "csv":
        sys.stdout.write(usage_csv(rows, groups).decode())
    elif args.format == "json":
        sys.stdout.write(msgspec.json.encode(rows).decode() + "\n")
    else:
        columns = [*groups, "requests", "not_completed", "prompt_tokens", "completion_tokens", "total_tokens"]
        columns.append("estimated_requests")  # (as csv and json have it)
        table = [[_printable(str(r.get(c))) if r.get(c) is not None else "-" for c in columns] for r in rows]
        widths = [max([len(c), *(len(row[i]) for row in table)]) for i, c in enumerate(columns)]
        print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
        for row in table:
            print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))
        if not table:
            print("(no requests in this range)")
    return 0


def _printable(text: str) -> str:
    """``text`` for a terminal: a character that is not printable (an escape sequence's
    ESC, CR, LF, a bidi override) as Python writes it in a string (``\\x1b``). A model
    name is the client's string: it could clear the screen or forge rows."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _checked_bind(bind: str) -> str:
    from edge.config import check_bind

    try:
        check_bind(bind)
    except ConfigError as e:
        raise ConfigError(f"--bind: {e}") from None
    return bind


def _readable(key: str, path: str | None) -> str | None:
    """``path`` if it can be read (TLS files are otherwise read only after binding, with no name)."""
    if not path:
        return None
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path}: {e.strerror}") from None
    return path


def _tls_pair(certfile: str, keyfile: str) -> None:
    """ConfigError naming both files unless they are a PEM certificate (chain) and its key
    (hypercorn read them only after binding: "TLS: [SSL] PEM lib", naming neither)."""
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except ssl.SSLError as e:
        raise ConfigError(
            f"certfile, keyfile: {certfile} and {keyfile} are not a PEM certificate and its private key"
            f" ({e.reason or e})"
        ) from None


# What binding a listening socket fails with (gaierror aside: the host does not resolve).
_LISTEN_ERRNOS = {errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES, errno.EAFNOSUPPORT}


def _cannot_start(error: OSError, bind: str | None) -> str:
    """One line for an OSError at start, naming the address when listening on it failed."""
    if isinstance(error, ssl.SSLError):
        return f"cannot start: TLS: {error.reason or error}"
    reason = error.strerror or str(error)
    if bind is not None and (isinstance(error, socket.gaierror) or error.errno in _LISTEN_ERRNOS):
        return f"cannot listen on {bind}: {reason}"
    return f"cannot start: {reason}"


SAME_SIGNAL_S = 0.1  # (0.5: a `kill; kill` 0.35 s apart was one signal, an outside audit)


async def _wait_for_signal(event: trio.Event, hurry: Callable[[], trio.Event] | None = None) -> None:
    """The first SIGTERM, SIGINT or SIGHUP sets ``event`` (the drain starts); a second sets
    ``hurry()``'s event: the drain ends its grace at once (running streams get
    their error and ``[DONE]``), instead of being ignored or killing the process.
    The same signal again within :data:`SAME_SIGNAL_S` is the same one: ``timeout``
    sends SIGTERM to its child and then to its process group, the child again. SIGHUP (a
    terminal closed, a service reloaded) killed the process at once, cutting every stream
    unbilled: an outside audit. The config is read at start only: there is no reload."""
    first: tuple[int, float] | None = None
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            if first is None:
                first = (signum, trio.current_time())
                event.set()
            elif first[0] == signum and trio.current_time() - first[1] < SAME_SIGNAL_S:
                continue
            elif hurry is not None:
                log.warning("second signal: ending the drain now", signal=signal.Signals(signum).name)
                hurry().set()


async def _edge(config, bind: str | None, certfile: str | None, keyfile: str | None) -> None:
    from edge.app import create_app, edge_of
    from edge.serve import serve_edge

    app = create_app(config)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_wait_for_signal, stop, lambda: edge_of(app).hurry)
        gc_policy.tune()
        more_open_files()
        nursery.start_soon(gc_policy.collect, stop)

        async def serve(task_status=trio.TASK_STATUS_IGNORED) -> None:
            await serve_edge(
                app,
                bind or config.bind,
                certfile=certfile or config.certfile or None,
                keyfile=keyfile or config.keyfile or None,
                shutdown_trigger=lambda: _drain_on(stop, app),
                task_status=task_status,
            )
            nursery.cancel_scope.cancel()  # drained and closed: the signal watcher ends too

        url = await nursery.start(serve)
        log.info("edge listening", url=url, node_link=url.replace("http", "ws", 1) + "/v1/node/link")


async def _drain_on(stop: trio.Event, app) -> None:
    from edge.app import edge_of

    await stop.wait()
    await edge_of(app).drain()


async def _node(config) -> None:
    from node.agent import NodeAgent

    agent = NodeAgent(config)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_wait_for_signal, stop, lambda: agent.hurry)
        gc_policy.tune()
        more_open_files()
        nursery.start_soon(gc_policy.collect, stop)
        nursery.start_soon(agent.serve)
        await stop.wait()
        await agent.drain()
        nursery.cancel_scope.cancel()


def _tokens_per_s(value: str) -> float:
    pace = float(value)
    if not 0 < pace <= 1_000_000:
        raise argparse.ArgumentTypeError(f"expected a number of tokens a second above 0, got {value}")
    return pace


async def _demo(bind: str, tokens_per_s: float = 50.0) -> None:
    from edge.app import create_app
    from edge.config import EdgeConfig
    from edge.serve import serve_edge
    from node.agent import NodeAgent
    from node.config import NodeConfig

    token = secrets.token_urlsafe(16)
    admin_key = "iop-admin-" + secrets.token_urlsafe(12)  # for the console; new each run
    # No ledger: the demo writes no files, and its console counts only its own requests.
    config = EdgeConfig(bind=bind, node_token=token, admin_keys=[admin_key], ledger="off")
    app = create_app(config)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_wait_for_signal, stop)
        gc_policy.tune()
        more_open_files()
        nursery.start_soon(gc_policy.collect, stop)
        url = await nursery.start(
            lambda task_status: serve_edge(app, bind, shutdown_trigger=stop.wait, task_status=task_status)
        )
        node_config = NodeConfig(
            node_id="demo-node",
            edges=[url.replace("http", "ws", 1) + "/v1/node/link"],
            token=token,
            models=[demo_model(tokens_per_s)],
        )
        agent = NodeAgent(node_config)
        await nursery.start(agent.serve)
        print(
            f"\niop demo: edge on {url}, simulated node serving model {DEMO_MODEL!r}.\n"
            f"Try:\n\n  curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{DEMO_MODEL}", "stream": true, '
            f'"messages": [{{"role": "user", "content": "Hello"}}]}}\'\n\n'
            f"Console: {url}/console (admin key: {admin_key})\n\n"
            "Ctrl-C stops it.\n",
            flush=True,
        )
        await stop.wait()
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    sys.exit(main())
