"""An OpenAI-compatible model server for tests and benchmarks.

Real HTTP/1.1 on loopback (trio sockets, chunked SSE), scripted per request,
and it records what it received and *when it saw each request aborted*: a
client that closes the connection before the response ended. That record is
how tests prove a cancel reached the model server.

    python scripts/upstream.py --port 8000 [--tokens 200] [--interval-ms 0]

Scripts are lists of steps: ``("chunk", delta_dict[, finish_reason])``,
``("raw", bytes)``, ``("sleep", seconds)``, ``("hang",)``, ``("usage",
dict)``, ``("status", code, body_bytes)`` and ``("response", bytes)`` (the
whole answer, head and all, as it is; then ``("hang",)`` may follow: as the
first step only) and ``("done",)``; ``script_for(model, fn)`` routes a target model to a script
builder ``fn(body) -> steps``.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import trio

Step = tuple
Script = list[Step]
ScriptFn = Callable[[dict[str, Any]], Script]

_encode = msgspec.json.Encoder().encode
_MAX_HEAD = 64 * 1024


@dataclass
class Record:
    """One request the upstream received."""

    id: int
    method: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any] | None
    raw_body: bytes
    started: float = field(default_factory=time.perf_counter)
    ended: float | None = None
    aborted: bool = False
    aborted_at: float | None = None  # time.perf_counter() when the close was seen
    # The answer's last bytes went to the socket: a close seen after it is the client's
    # (a pool closing a connection it read whole), not an abort. (The close can be seen
    # before the task that sent them resumes: 723 of 12,000 whole answers were counted.)
    whole: bool = False
    finished: trio.Event = field(default_factory=trio.Event)


def words(n: int, prefix: str = "tok") -> list[str]:
    return [f"{prefix}{i} " for i in range(n)]


def text_script(
    tokens: list[str],
    *,
    ttft: float = 0.0,
    interval: float = 0.0,
    finish: str = "stop",
    reasoning: list[str] | None = None,
    reasoning_field: str = "reasoning_content",
    usage: dict[str, int] | None = None,
) -> Script:
    steps: Script = []
    if ttft:
        steps.append(("sleep", ttft))
    for r in reasoning or ():
        steps.append(("chunk", {reasoning_field: r}))
        if interval:
            steps.append(("sleep", interval))
    for tok in tokens:
        steps.append(("chunk", {"content": tok}))
        if interval:
            steps.append(("sleep", interval))
    steps.append(("chunk", {}, finish))
    if usage is not None:
        steps.append(("usage", usage))
    steps.append(("done",))
    return steps


def steps(*deltas: dict[str, Any], finish: str = "stop", usage: dict[str, int] | None = None) -> Script:
    """A script of the given chunk deltas (content, reasoning, tool_calls), a
    finish chunk, optionally usage, and [DONE]."""
    out: Script = [*(("chunk", d) for d in deltas), ("chunk", {}, finish)]
    if usage is not None:
        out.append(("usage", usage))
    return [*out, ("done",)]


def native_call(call_id: str, name: str, arguments: str) -> list[dict[str, Any]]:
    """The deltas of one native tool call, its arguments in a second delta."""
    return [
        {"tool_calls": [{"index": 0, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": arguments}}]},
    ]


def default_script(body: dict[str, Any]) -> Script:
    n = body.get("max_tokens") or body.get("max_completion_tokens") or 8
    return text_script(
        words(int(n)), usage={"prompt_tokens": 5, "completion_tokens": int(n), "total_tokens": 5 + int(n)}
    )


class Upstream:
    def __init__(self, default: ScriptFn = default_script) -> None:
        self.default = default
        self.scripts: dict[str, ScriptFn] = {}
        self.records: list[Record] = []
        self.port = 0
        self.active = 0  # requests whose response has not ended
        self.max_active = 0  # high-water mark of active
        self._ids = itertools.count(1)
        self._arrivals = trio.lowlevel.ParkingLot()
        # GET /metrics answers this Prometheus text (a model server's own load); "": 404.
        # Not recorded in ``records``; ``metrics_scrapes`` counts them.
        self.metrics = ""
        self.metrics_scrapes = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def script_for(self, model: str, fn: ScriptFn | Script) -> None:
        self.scripts[model] = fn if callable(fn) else (lambda body, steps=fn: list(steps))

    async def wait_requests(self, n: int) -> list[Record]:
        """Wait until at least ``n`` requests have arrived."""
        while len(self.records) < n:
            await self._arrivals.park()
        return self.records[:n]

    async def serve(self, port: int = 0, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._connection, listeners)

    # -- HTTP/1.1 ---------------------------------------------------------------

    async def _connection(self, stream: trio.SocketStream) -> None:
        buf = b""
        try:
            while True:
                parsed = await _read_request(stream, buf)
                if parsed is None:
                    return
                method, path, headers, raw_body, buf = parsed
                keep, early = await self._exchange(stream, method, path, headers, raw_body)
                if not keep:
                    return
                buf += early  # the client's next request, read while we answered
        except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
            return
        finally:
            await trio.aclose_forcefully(stream)

    async def _exchange(
        self, stream, method: str, path: str, headers: dict[str, str], raw_body: bytes
    ) -> tuple[bool, bytes]:
        """Serve one request: (keep the connection, bytes of the next request already read)."""
        if method == "GET" and path.split("?")[0].endswith("/metrics"):
            self.metrics_scrapes += 1
            await _send_whole(stream, 200 if self.metrics else 404, self.metrics.encode())
            return True, b""
        try:
            body = msgspec.json.decode(raw_body) if raw_body else None
        except msgspec.DecodeError:
            body = None
        rec = Record(next(self._ids), method, path, headers, body if isinstance(body, dict) else None, raw_body)
        self.records.append(rec)
        self._arrivals.unpark_all()
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        leftover: list[bytes] = []

        def mark_aborted() -> None:
            if not rec.aborted:
                rec.aborted = True
                rec.aborted_at = time.perf_counter()

        try:
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    try:
                        data = await stream.receive_some(65536)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        data = b""
                    if not data:
                        if not rec.whole:
                            mark_aborted()
                        nursery.cancel_scope.cancel()
                    else:
                        leftover.append(data)

                async def respond() -> None:
                    try:
                        await self._respond(stream, rec)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        mark_aborted()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch)
                nursery.start_soon(respond)
        finally:
            self.active -= 1
            rec.ended = time.perf_counter()
            rec.finished.set()
        return not rec.aborted, b"".join(leftover)

    async def _respond(self, stream, rec: Record) -> None:
        if rec.method == "GET" and rec.path.rstrip("/").endswith("/models"):
            await _send_whole(
                stream,
                200,
                _encode({"object": "list", "data": [{"id": m, "object": "model"} for m in self.scripts]}),
                rec,
            )
            return
        if rec.body is None:
            await _send_whole(
                stream, 400, _encode({"error": {"message": "invalid JSON", "type": "invalid_request_error"}}), rec
            )
            return
        if rec.path.endswith("/embeddings"):
            inputs = rec.body.get("input")
            n = len(inputs) if isinstance(inputs, list) else 1
            data = [{"object": "embedding", "index": i, "embedding": [0.1 * (i + 1), 0.2, 0.3]} for i in range(n)]
            await _send_whole(
                stream, 200, _encode({"object": "list", "data": data, "model": rec.body.get("model")}), rec
            )
            return
        model = str(rec.body.get("model", ""))
        script = self.scripts.get(model, self.default)(rec.body)
        if script and script[0][0] == "status":
            await _send_whole(stream, script[0][1], script[0][2], rec)
            return
        if script and script[0][0] == "response":
            rec.whole = script[1:] != [("hang",)]
            await stream.send_all(script[0][1])
            if not rec.whole:
                await trio.sleep_forever()
            return
        if rec.body.get("stream"):
            await self._stream(stream, rec, model, script)
        else:
            await self._whole(stream, rec, model, script)

    async def _stream(self, stream, rec: Record, model: str, script: Script) -> None:
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        head = (
            b'data: {"id":"chatcmpl-up%d","object":"chat.completion.chunk","created":%d,"model":%s,"choices":[{"index":0,"delta":'
            % (
                rec.id,
                int(time.time()),
                _encode(model),
            )
        )
        for step in script:
            kind = step[0]
            if kind == "chunk":
                finish = _encode(step[2]) if len(step) > 2 else b"null"
                data = head + _encode(step[1]) + b',"finish_reason":' + finish + b"}]}\n\n"
            elif kind == "usage":
                data = b'data: {"id":"chatcmpl-up%d","object":"chat.completion.chunk","choices":[],"usage":%s}\n\n' % (
                    rec.id,
                    _encode(step[1]),
                )
            elif kind == "raw":
                data = step[1]
            elif kind == "done":
                data = b"data: [DONE]\n\n"
            elif kind == "sleep":
                await trio.sleep(step[1])
                continue
            elif kind == "hang":
                await trio.sleep_forever()
            else:
                raise ValueError(f"unknown step {kind!r}")
            await stream.send_all(b"%x\r\n%s\r\n" % (len(data), data))
        rec.whole = True
        await stream.send_all(b"0\r\n\r\n")

    async def _whole(self, stream, rec: Record, model: str, script: Script) -> None:
        content: list[str] = []
        reasoning: list[str] = []
        finish = "stop"
        usage = None
        tool_calls = None
        for step in script:
            kind = step[0]
            if kind == "chunk":
                delta = step[1]
                content.append(delta.get("content") or "")
                reasoning.append(delta.get("reasoning_content") or delta.get("reasoning") or "")
                if delta.get("tool_calls"):
                    tool_calls = (tool_calls or []) + delta["tool_calls"]
                if len(step) > 2:
                    finish = step[2]
            elif kind == "usage":
                usage = step[1]
            elif kind == "sleep":
                await trio.sleep(step[1])
            elif kind == "hang":
                await trio.sleep_forever()
        message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
        if any(reasoning):
            message["reasoning_content"] = "".join(reasoning)
        if tool_calls:
            message["tool_calls"] = tool_calls
        body = {
            "id": f"chatcmpl-up{rec.id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        }
        if usage is not None:
            body["usage"] = usage
        await _send_whole(stream, 200, _encode(body), rec)


async def _read_request(stream, buf: bytes):
    while b"\r\n\r\n" not in buf:
        data = await stream.receive_some(65536)
        if not data:
            return None
        buf += data
        if len(buf) > _MAX_HEAD:
            return None
    head, _, buf = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    length = int(headers.get("content-length", "0") or 0)
    while len(buf) < length:
        data = await stream.receive_some(65536)
        if not data:
            return None
        buf += data
    return method, path, headers, buf[:length], buf[length:]


_REASONS = {
    200: b"OK",
    400: b"Bad Request",
    404: b"Not Found",
    429: b"Too Many Requests",
    500: b"Internal Server Error",
}


async def _send_whole(stream, status: int, body: bytes, rec: Record | None = None) -> None:
    if rec is not None:
        rec.whole = True
    await stream.send_all(
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (status, _REASONS.get(status, b"Status"), len(body), body)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--tokens", type=int, default=0, help="tokens per answer (default: max_tokens or 8)")
    parser.add_argument("--interval-ms", type=float, default=0.0, help="pause between tokens")
    parser.add_argument("--ttft-ms", type=float, default=0.0, help="pause before the first token")
    args = parser.parse_args()

    def script(body: dict[str, Any]) -> Script:
        n = args.tokens or int(body.get("max_tokens") or body.get("max_completion_tokens") or 8)
        return text_script(
            words(n),
            ttft=args.ttft_ms / 1000,
            interval=args.interval_ms / 1000,
            usage={"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n},
        )

    upstream = Upstream(script)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from iop import gc_policy

    async def run() -> None:
        # As long-lived as the edge and node it serves, and on the same cores in
        # the benchmarks: their GC policy, so its pauses do not take the CPU
        # from the processes measured (untuned, 0.3 s full collections every few s).
        gc_policy.tune()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(gc_policy.collect, trio.Event())
            port = await nursery.start(upstream.serve, args.port)
            print(f"upstream listening on http://127.0.0.1:{port}/v1", flush=True)

    try:
        trio.run(run)
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
