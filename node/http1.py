"""A lean HTTP/1.1 client for the node's calls to its model servers.

The node's hot path is reading one server-sent event stream per run. A
general client (httpx over httpcore over h11) builds request and response
models, an event object per chunk and an async generator chain per body;
measured, that was the largest CPU cost of a streamed token. This client does
only what the node needs: keep-alive connections to one origin, a request
with a body, the response's status and headers, and its body de-chunked with
bytes operations, a read at a time (every chunk already received is returned
at once, so a busy server's tokens arrive together).

- ``read()`` returns b"" at the end of the body; there are no async
  generators, so a cancel leaves nothing suspended for the garbage collector.
- Leaving a response before its end (a cancel, an error) closes the
  connection: that is what makes a model server abort the generation. Only a
  response read to its end returns its connection to the pool.
- A connection taken from the pool that the server had already closed is
  detected before use; a request that then fails before any byte of the
  answer arrived is sent again once, on a new connection.
- Timeouts: connect, read (each wait for bytes), write. Errors are the
  classes below, named as httpx names them (operators grep for them).
- No proxies, no redirects, no compression, no HTTP/2: model servers are
  addressed directly.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import select
import socket
import ssl
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar
from urllib.parse import urlsplit

import certifi
import outcome
import trio

MAX_HEAD_BYTES = 64 * 1024
MAX_INTERIM = 8  # 1xx heads (100 Continue, 103 Early Hints) skipped before the answer
MAX_CHUNK_LINE = 1024
MAX_IDLE = 256  # idle keep-alive connections kept per origin
# An idle connection is not used after this long: uvicorn, in front of vLLM and SGLang, closes
# one after 5 s, and a request sent as it closes gets no answer (sent again, it was a duplicate
# generation whenever the server had read it before closing; an outside audit). As httpcore's 5.
KEEPALIVE_EXPIRY_S = 4.0
# Not more: a buffer of 128 KiB or more makes each read grow and trim the heap (15-21 against 2.6 µs a read).
READ_SIZE = 64 * 1024
EARLY_ANSWER_S = 0.25  # after a write the server cut short: how long its answer may take to be read
WATCH_TICK = 1.0  # seconds: the most a read inside Response.reading() times out late (or a quarter of its timeout)
READY_READS = 8  # body reads that found bytes waiting, in a row, before one goes through trio (a schedule point)

_LENGTH, _CHUNKED, _CLOSE = 0, 1, 2
_T = TypeVar("_T")


class HTTPError(Exception):
    pass


class ConnectError(HTTPError):
    pass


class ConnectTimeout(HTTPError):
    pass


class ReadTimeout(HTTPError):
    pass


class WriteTimeout(HTTPError):
    pass


class RemoteProtocolError(HTTPError):
    pass


class NoAnswer(RemoteProtocolError):
    """The connection ended before any byte of an answer. Sent again (once) only when the
    request was not taken (:class:`_NotTaken`): a server may have read a request it did not
    answer, and would do the work twice."""


class _NotTaken(NoAnswer):
    """A kept-alive connection the server had closed: the request could not be written whole,
    or was reset unanswered (a reset is what a socket closed before it read says to bytes that
    reach it). The request was not read: it is sent again, once, on a new connection."""


class InvalidURL(HTTPError):
    pass


class Origin:
    __slots__ = ("scheme", "host", "port", "path", "host_header")

    def __init__(self, base_url: str) -> None:
        try:
            url = urlsplit(base_url)
            port = url.port
        except ValueError as e:
            raise InvalidURL(str(e)) from None
        if url.scheme not in ("http", "https") or not url.hostname:
            raise InvalidURL(f"not an http(s) URL: {base_url!r}")
        self.scheme = url.scheme
        self.host = url.hostname
        self.port = port or (443 if url.scheme == "https" else 80)
        self.path = url.path.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = self.port == (443 if url.scheme == "https" else 80)
        self.host_header = host if default else f"{host}:{self.port}"

    @property
    def host_port(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


# struct tcp_info (linux/tcp.h): its u64 tcpi_bytes_acked, since Linux 4.1.
_TCP_INFO = getattr(socket, "TCP_INFO", 11)
_BYTES_ACKED = 120
_TCP_INFO_BYTES = _BYTES_ACKED + 8


class _Connection:
    __slots__ = ("stream", "sock", "buf", "plain", "fd", "idle_since")

    def __init__(self, stream: trio.abc.Stream, sock: trio.socket.SocketType) -> None:
        self.stream = stream
        self.sock = sock
        self.buf = b""
        # No TLS: body reads go to the socket itself. A read waits (a stream
        # holds one open between tokens), and each layer it passes through is
        # objects that live that long: the garbage collector's work.
        self.plain = isinstance(stream, trio.SocketStream)
        self.fd = sock.fileno()
        self.idle_since = 0.0  # (trio's clock) when it went back to the pool

    def acked(self) -> int | None:
        """The bytes the server's TCP has acknowledged on this connection (Linux's
        ``tcpi_bytes_acked``); None where the system does not say."""
        try:
            info = self.sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_BYTES)
        except (OSError, ValueError, AttributeError):
            return None
        if len(info) < _TCP_INFO_BYTES:
            return None
        return int.from_bytes(info[_BYTES_ACKED : _BYTES_ACKED + 8], sys.byteorder)

    def closed_by_peer(self) -> bool:
        """An idle connection that is readable: the server closed it (or sent
        bytes on it, which an idle HTTP/1.1 connection must not have either). Over
        TLS, bytes the TLS layer has already taken from the socket count too: a
        record sent after an answer, there, was read as the next request's answer
        (an outside audit: a stale 200)."""
        if self.buf:
            return True
        if not self.plain:
            stream = self.stream
            incoming = getattr(stream, "_incoming", None)  # (trio's: what it read and has not decrypted)
            if stream.pending() or (incoming is not None and incoming.pending):
                return True
        poll = select.poll()
        poll.register(self.sock.fileno(), select.POLLIN)
        return bool(poll.poll(0))


class Response:
    """A response whose head has arrived; ``read()`` the body."""

    __slots__ = (
        "status",
        "headers",
        "_conn",
        "_timeout",
        "_mode",
        "_left",
        "_trailer",
        "done",
        "keep_alive",
        "_idle",
        "_ready",
        "_drained",
        "_line",
    )

    def __init__(self, conn: _Connection, status: int, headers: list[tuple[bytes, bytes]], timeout: float) -> None:
        self.status = status
        self.headers = headers
        self._conn = conn
        self._timeout = timeout
        self._idle: _Reading | None = None  # while inside reading(): what times the reads
        self._ready = 0  # reads in a row that found bytes waiting (see _recv)
        self._drained = False  # the last read took every byte the socket had (see _recv)
        self._line = b""  # _CHUNKED: the start of a size or trailer line, the rest of it not yet received
        self.done = False
        self._trailer = 0  # in the trailers: 1 + their bytes so far
        self._left = 0  # _LENGTH: body bytes to come; _CHUNKED: of this chunk, with its CRLF
        self.keep_alive = True
        length = None
        chunked = False
        for name, value in headers:
            if name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    raise RemoteProtocolError("invalid content-length") from None
                if length < 0:
                    raise RemoteProtocolError("invalid content-length")
            elif name == b"connection" and value.lower() == b"close":
                self.keep_alive = False
        if status in (204, 304):  # no body, whatever the head says (RFC 9112 6.3): one read to its close
            # had a 204 wait out the read timeout
            self._mode, self._left, self.done = _LENGTH, 0, True
        elif chunked:
            self._mode = _CHUNKED
        elif length is not None:
            self._mode, self._left = _LENGTH, length
            self.done = length == 0
        else:
            self._mode, self.keep_alive = _CLOSE, False

    def reading(self) -> _Reading:
        """Wrap a loop of :meth:`read` calls in this (``with``): a read then
        only notes when it started waiting for bytes, and one task per
        process (:class:`_ReadWatch`) ends a read that waited past the read
        timeout, rather than each wait arming a cancel scope's deadline (the
        streaming hot path: a wait per token). :class:`ReadTimeout` when the
        read timeout passes; the caller's own time between reads is not counted."""
        return _Reading(self)

    async def _recv(self) -> bytes:
        conn = self._conn
        if not conn.plain:
            return await self._wait(conn.stream.receive_some, READ_SIZE)
        # Plain TCP: read the socket directly. Bytes already waiting (a busy
        # server) cost one syscall: no read timeout armed, no pass through
        # the scheduler. Every READY_READS-th read in a row is still a
        # schedule point, so other runs, and a cancel, get their turn.
        # After a read that emptied the socket, more bytes arriving while
        # they were handled is the exception (about one read in ten, 200
        # streams at full speed): the next read waits for them first rather
        # than try a read that fails (EAGAIN: a syscall and an exception).
        if self._drained:
            self._drained = False
            self._ready = 0
            await self._wait(trio.lowlevel.wait_readable, conn.sock)
        elif self._ready >= READY_READS:
            self._ready = 0
            await trio.lowlevel.checkpoint()
        while True:
            try:
                data = os.read(conn.fd, READ_SIZE)
            except BlockingIOError:
                self._ready = 0
                await self._wait(trio.lowlevel.wait_readable, conn.sock)
                continue
            except OSError as e:
                raise RemoteProtocolError(f"connection lost: {e}") from None
            self._ready += 1
            self._drained = len(data) < READ_SIZE
            return data

    async def _wait(self, wait: Callable[..., Awaitable[_T]], arg) -> _T:
        """``await wait(arg)``, under the read timeout (:class:`ReadTimeout`)."""
        reading = self._idle
        try:
            if reading is None:
                with trio.move_on_after(self._timeout):
                    return await wait(arg)
            else:  # inside reading(): its watch times this wait
                reading.since = trio.current_time()
                try:
                    return await wait(arg)
                finally:
                    reading.since = math.inf  # what the caller does between reads is not timed
        except (trio.BrokenResourceError, OSError) as e:
            raise RemoteProtocolError(f"connection lost: {e}") from None
        raise ReadTimeout("no bytes from the server in the read timeout")  # our own timer fired

    async def read(self) -> bytes:
        """The next body bytes: everything received so far, at least one byte; b"" at the end."""
        conn = self._conn
        while not self.done:
            data = conn.buf or await self._recv()
            conn.buf = b""
            out = self._body(data)
            if out or self.done:
                return out
        return b""

    def _body(self, data: bytes) -> bytes:
        """The body bytes in ``data``, just received (b"": the connection
        closed); b"" too when it held none (a chunk size line, say): see ``done``."""
        if self._mode == _CHUNKED:
            if not data:
                raise RemoteProtocolError("connection closed inside a chunked body")
            return self._dechunk(data)
        if self._mode == _LENGTH:
            if not data:
                raise RemoteProtocolError("connection closed before the end of the body")
            if len(data) > self._left:
                data, self._conn.buf = data[: self._left], data[self._left :]
            self._left -= len(data)
            self.done = self._left == 0
            return data
        if not data:
            self.done = True
        return data

    async def pump(self, feed: Callable[[bytes], bool]) -> None:
        """Hand the body to ``feed``, a read at a time, until it returns False
        or the body ends (then ``done``). ``feed`` is called synchronously,
        and on a plain connection (Linux) not from this task: the process's
        :class:`_Poll` reads every streaming connection that has bytes in one
        pass, so a read costs no task switch. This task waits meanwhile; a
        cancel (or the read timeout of :meth:`reading`) ends the wait, and the
        connection is no longer read once this returns or raises. An
        exception from ``feed`` or the read is raised here."""
        conn = self._conn
        if conn.buf and not self.done:  # bytes that came with the head
            data, conn.buf = conn.buf, b""
            out = self._body(data)
            if out and not feed(out):
                return
        if self.done:
            return
        if conn.plain and _Poll.available:
            if self._idle is not None:
                await _Poll.of_this_run().pump(self, feed)
            else:
                with self.reading():  # the read timeout
                    await _Poll.of_this_run().pump(self, feed)
            return
        while data := await self.read():
            if not feed(data):
                return

    def _dechunk(self, buf: bytes) -> bytes:
        """The data of every chunk (or part of one) in ``buf``. A line cut by
        the end of ``buf`` waits in ``_line`` for the next bytes; bytes after
        the body's end go back to the connection."""
        if self._line:
            buf = self._line + buf
            self._line = b""
        out: list[bytes] = []
        pos, n = 0, len(buf)
        left = self._left  # of the current chunk: its data and CRLF still to come
        while pos < n:
            if left:
                avail = n - pos
                if left > 2:  # data first (a chunk whole in ``buf``, CRLF included, takes one turn)
                    out.append(buf[pos : pos + left - 2] if avail > left - 2 else buf[pos:])
                if avail >= left:
                    pos += left
                    left = 0
                else:
                    left -= avail
                    pos = n
                continue
            end = buf.find(b"\r\n", pos)
            if end < 0:
                if n - pos > MAX_CHUNK_LINE:
                    raise RemoteProtocolError("chunk size line too long")
                break
            line = buf[pos:end]
            pos = end + 2
            if self._trailer:
                self._trailer += len(line) + 2
                if self._trailer > MAX_HEAD_BYTES:
                    raise RemoteProtocolError("trailers too long")
                if not line:  # the empty line that ends the trailers
                    self.done = True
                    self._left = 0
                    self._conn.buf = buf[pos:]
                    return b"".join(out)
                continue
            try:
                size = int(line.split(b";", 1)[0], 16)
            except ValueError:
                raise RemoteProtocolError("invalid chunk size") from None
            if size < 0:
                raise RemoteProtocolError("invalid chunk size")
            if size == 0:
                self._trailer = 1
            else:
                left = size + 2
        self._left = left
        self._line = buf[pos:]
        return out[0] if len(out) == 1 else b"".join(out)


def _head_end(buf: bytes) -> int:
    """Where the head in ``buf`` ends (the ``\\n`` of its last line), or -1:
    the first line end followed by an empty line (``\\n\\n`` or ``\\n\\r\\n``)."""
    ends = [i for i in (buf.find(b"\n\n"), buf.find(b"\n\r\n")) if i >= 0]
    return min(ends, default=-1)


_One = TypeVar("_One", "_Poll", "_ReadWatch")


def _of_this_run(cls: type[_One]) -> _One:
    """The one ``cls`` of this trio run (made at first use), kept in ``cls._runvar``."""
    try:
        return cls._runvar.get()
    except LookupError:
        one = cls()
        cls._runvar.set(one)
        return one


class _Poll:
    """Reads the body of every :meth:`Response.pump` of one trio run: its own
    epoll set holds their sockets, and one system task waits for it to be
    readable, then reads each ready socket once and hands the bytes to its
    ``feed``, all in one step. With many streams, a read then costs a syscall
    and the parsing, not a wake-up of the stream's task (measured: most of a
    streamed token's CPU on the node was trio's per-read task switch).

    The task that pumps owns the connection: it waits, parked, while the poll
    reads for it, and is woken when ``feed`` says stop, the body ends or the
    read fails (the error is raised in it). A cancel of that task takes its
    socket out of the set before the cancel is delivered, so nothing reads a
    connection its owner left."""

    available = hasattr(select, "epoll")
    MAX_READY = 64  # sockets read in one step, at most: then a schedule point

    __slots__ = ("_epoll", "_pumps")
    _runvar: trio.lowlevel.RunVar[_Poll] = trio.lowlevel.RunVar("iop.node.http1.poll")

    def __init__(self) -> None:
        """Made at the first pump of a trio run (:meth:`of_this_run`); its task lives as long as the run."""
        self._epoll = select.epoll()
        self._pumps: dict[int, _Pump] = {}
        name, context = "iop.node.http1.poll", contextvars.Context()
        trio.lowlevel.spawn_system_task(self._serve, name=name, context=context)

    @classmethod
    def of_this_run(cls) -> _Poll:
        return _of_this_run(cls)

    async def pump(self, response: Response, feed: Callable[[bytes], bool]) -> None:
        fd = response._conn.fd
        pump = _Pump(response, feed, trio.lowlevel.current_task())
        self._epoll.register(fd, select.EPOLLIN)
        self._pumps[fd] = pump
        reading = response._idle
        if reading is not None:
            reading.since = trio.current_time()

        def abort(_: object) -> trio.lowlevel.Abort:
            self._drop(fd)
            if reading is not None:  # (as _end: what the caller does next is not a read's wait)
                reading.since = math.inf
            return trio.lowlevel.Abort.SUCCEEDED

        # Woken by _end (which took the socket out of the set), or cancelled
        # (abort took it out): either way nothing reads this connection now.
        await trio.lowlevel.wait_task_rescheduled(abort)

    def _drop(self, fd: int) -> None:
        del self._pumps[fd]
        self._epoll.unregister(fd)

    def _end(self, fd: int, pump: _Pump, result: outcome.Outcome) -> None:
        self._drop(fd)
        reading = pump.response._idle
        if reading is not None:
            reading.since = math.inf
        trio.lowlevel.reschedule(pump.task, result)

    async def _serve(self) -> None:
        epoll = self._epoll
        try:
            while True:
                await trio.lowlevel.wait_readable(epoll.fileno())
                self.read_ready()
        finally:  # the run is ending (a system task is cancelled only then)
            trio.lowlevel.notify_closing(epoll.fileno())
            epoll.close()

    def read_ready(self) -> None:
        """Read every pumped socket that has bytes now, once, and feed them."""
        pumps = self._pumps
        if not pumps:
            return
        now = trio.current_time()
        for fd, _ in self._epoll.poll(0, self.MAX_READY):
            pump = pumps.get(fd)
            if pump is None:
                continue
            try:
                data = os.read(fd, READ_SIZE)
            except BlockingIOError:
                continue
            except OSError as e:
                self._end(fd, pump, outcome.Error(RemoteProtocolError(f"connection lost: {e}")))
                continue
            response = pump.response
            try:
                out = response._body(data)
                go_on = pump.feed(out) if out else True
            except Exception as e:  # raised in the task that pumps, never here
                self._end(fd, pump, outcome.Error(e))
                continue
            if not go_on or response.done:
                self._end(fd, pump, outcome.Value(None))
            elif response._idle is not None:
                response._idle.since = now


class _Pump:
    __slots__ = ("response", "feed", "task")

    def __init__(self, response: Response, feed: Callable[[bytes], bool], task: trio.lowlevel.Task) -> None:
        self.response = response
        self.feed = feed
        self.task = task


class _Reading:
    """:meth:`Response.reading`: a cancel scope that the process's read watch
    cancels when a read inside it waited past the read timeout."""

    __slots__ = ("_response", "_scope", "timeout", "since")

    def __init__(self, response: Response) -> None:
        self._response = response
        self._scope = trio.CancelScope()
        self.timeout = response._timeout
        self.since = math.inf  # when the read now waiting started to wait (inf: none waits)

    def __enter__(self) -> None:
        self._scope.__enter__()
        self._response._idle = self
        _ReadWatch.of_this_run().add(self)

    def __exit__(self, etype, exc, tb) -> bool:
        self._response._idle = None
        _ReadWatch.of_this_run().readings.discard(self)
        swallowed = self._scope.__exit__(etype, exc, tb)
        if self._scope.cancelled_caught:  # only the watch cancels it
            raise ReadTimeout("no bytes from the server in the read timeout")
        return swallowed

    def expire(self) -> None:
        self._scope.cancel()


class _ReadWatch:
    """The read timeouts of every :meth:`Response.reading` of one trio run: a
    task, alive while any is open, that looks at them at least every
    :data:`WATCH_TICK` seconds (and every quarter of the shortest timeout),
    and ends each read that has waited past its timeout. So a read times out
    at most that much late, and a wait costs two float stores instead of
    arming and clearing a deadline (measured: 3.6 µs a wait)."""

    __slots__ = ("readings", "running", "_tick", "_sleep")
    _runvar: trio.lowlevel.RunVar[_ReadWatch] = trio.lowlevel.RunVar("iop.node.http1.read_watch")

    def __init__(self) -> None:
        self.readings: set[_Reading] = set()
        self.running = False
        self._tick = WATCH_TICK  # how long the watch sleeps now
        self._sleep: trio.CancelScope | None = None  # its sleep, cut short for a shorter timeout

    @classmethod
    def of_this_run(cls) -> _ReadWatch:
        return _of_this_run(cls)

    def add(self, reading: _Reading) -> None:
        self.readings.add(reading)
        if not self.running:
            self.running = True
            name, context = "iop.node.http1.read_watch", contextvars.Context()
            trio.lowlevel.spawn_system_task(self._watch, name=name, context=context)
        elif reading.timeout / 4 < self._tick and self._sleep is not None:
            self._sleep.cancel()  # look again sooner

    async def _watch(self) -> None:
        readings = self.readings
        try:
            while readings:
                now = trio.current_time()
                tick = WATCH_TICK
                for reading in list(readings):
                    tick = min(tick, reading.timeout / 4)
                    if reading.since + reading.timeout <= now:
                        readings.discard(reading)
                        reading.expire()
                self._tick = tick
                with trio.move_on_after(max(tick, 0.001)) as self._sleep:
                    await trio.sleep_forever()
                self._sleep = None
        finally:
            self.running = False


class Client:
    """Keep-alive HTTP/1.1 connections to one origin (the model's base URL)."""

    def __init__(
        self,
        base_url: str,
        headers: dict[str, str] | None = None,
        *,
        connect_timeout: float = 10.0,
        read_timeout: float = 600.0,
        write_timeout: float = 60.0,
        ca_file: str = "",
    ) -> None:
        """``ca_file``: a CA bundle (PEM) trusted for https, besides certifi's."""
        self.origin = Origin(base_url)
        self._headers = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in (headers or {}).items())
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._write_timeout = write_timeout
        self._idle: list[_Connection] = []
        self._ssl: ssl.SSLContext | None = None
        if self.origin.scheme == "https":
            self._ssl = ssl.create_default_context(cafile=certifi.where())
            if ca_file:
                self._ssl.load_verify_locations(cafile=ca_file)

    async def _connect(self) -> _Connection:
        origin = self.origin
        with trio.move_on_after(self._connect_timeout) as scope:
            try:
                tcp = await trio.open_tcp_stream(origin.host, origin.port)
            except OSError as e:
                raise ConnectError(str(e) or type(e).__name__) from None
            try:
                tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._ssl is None:
                    return _Connection(tcp, tcp.socket)
                tls = trio.SSLStream(tcp, self._ssl, server_hostname=origin.host, https_compatible=True)
                await tls.do_handshake()
                return _Connection(tls, tcp.socket)
            except BaseException as e:
                # Closed now, however the handshake ended (its timeout, the run's cancel): left
                # to the collector, under the node's GC policy it stayed open with the model
                # server's end of it until a full collection, which a steady load never brings.
                tcp.socket.close()
                if isinstance(e, (trio.BrokenResourceError, ssl.SSLError)):
                    # (trio's error says nothing; the reason, "certificate verify failed", is its cause)
                    said = str(e) or str(e.__cause__ or "") or type(e).__name__
                    raise ConnectError(f"TLS handshake failed: {said}") from None
                if isinstance(e, OSError):
                    raise ConnectError(str(e) or type(e).__name__) from None
                raise
        assert scope.cancelled_caught
        raise ConnectTimeout(f"no connection within {self._connect_timeout:g} s")

    def _pooled(self) -> _Connection | None:
        """The idle connection used last, unless the server closed it or it idled past
        :data:`KEEPALIVE_EXPIRY_S` (the older ones behind it too)."""
        fresh = trio.current_time() - KEEPALIVE_EXPIRY_S
        while self._idle:
            conn = self._idle.pop()
            if conn.idle_since < fresh:
                for old in (conn, *self._idle):
                    old.sock.close()
                self._idle.clear()
                return None
            if not conn.closed_by_peer():
                return conn
            conn.sock.close()
        return None

    def prune(self) -> None:
        """Close the idle connections the server has closed, or that idled past
        :data:`KEEPALIVE_EXPIRY_S`: they held a socket each (in CLOSE-WAIT) until the
        origin's next request, which may never come (an outside audit: 45 sockets)."""
        fresh = trio.current_time() - KEEPALIVE_EXPIRY_S
        keep = []
        for conn in self._idle:
            if conn.idle_since < fresh or conn.closed_by_peer():
                conn.sock.close()
            else:
                keep.append(conn)
        self._idle = keep

    async def _send(self, conn: _Connection, data: bytes) -> bytes:
        """Write the request as far as it goes at once (a request nearly always fits the
        socket's buffer: one write, no timeout scope and no wait; a cancelled run still sends
        nothing); a TLS one whole. What is left of a plain one (b"": nothing)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if not conn.plain:
            # Whole, then read. (Sent while reading, a server's early answer broke trio's TLS
            # stream when the send was stopped: its body unread, a 502; a re-check.)
            await self._send_rest(conn, data)
            return b""
        try:
            sent = os.write(conn.fd, data)
        except BlockingIOError:
            sent = 0
        except OSError as e:
            raise _NotTaken(f"connection lost while sending: {e}") from None
        return data[sent:]

    async def _send_rest(self, conn: _Connection, data: bytes) -> None:
        with trio.move_on_after(self._write_timeout) as scope:
            try:
                await conn.stream.send_all(data)
                return
            except trio.BrokenResourceError as e:
                raise _NotTaken(f"connection lost while sending: {e}") from None
        assert scope.cancelled_caught
        raise WriteTimeout(f"request not sent within {self._write_timeout:g} s")

    async def _send_reading(self, conn: _Connection, data: bytes) -> tuple[int, list[tuple[bytes, bytes]], bool]:
        """The rest of a plain request the socket did not take at once, sent while its answer
        is read: a server may answer before it has read the body (a 413 for a large one;
        nginx's client_max_body_size) and stop reading it; its answer was lost, the write
        failed, a 502 charged the whole prompt (an outside audit). An error answer stops the
        sending (RFC 9112 9.5); another waits for the body to go whole (a server may answer
        early and read on). The head is awaited with no read timeout while the body goes out:
        the read timeout runs from its end. The answer's head, and whether all was sent."""
        failed: list[HTTPError] = []
        error: HTTPError | None = None
        head: tuple[int, list[tuple[bytes, bytes]]] | None = None
        sent = trio.Event()
        with trio.CancelScope() as waiting:
            async with trio.open_nursery() as nursery:

                async def send() -> None:
                    try:
                        await self._send_rest(conn, data)
                        waiting.deadline = trio.current_time() + self._read_timeout
                    except HTTPError as e:
                        failed.append(e)
                        waiting.deadline = trio.current_time() + EARLY_ANSWER_S  # (an answer on its way is read)
                    sent.set()

                nursery.start_soon(send)
                try:
                    head = await self._head(conn, math.inf)
                except HTTPError as e:
                    error = e
                if head is not None and head[0] < 400:
                    await sent.wait()
                nursery.cancel_scope.cancel()  # (an error answer: the body's rest is not sent)
        if head is None:
            if failed:
                raise failed[0]
            if error is not None:
                raise error
            raise ReadTimeout("no response head in the read timeout")
        return head[0], head[1], sent.is_set() and not failed

    async def _head(self, conn: _Connection, read_wait: float | None = None) -> tuple[int, list[tuple[bytes, bytes]]]:
        """The answer's status and headers, past any interim 1xx heads; ``read_wait``: how
        long each read may wait (the client's read timeout)."""
        for _ in range(MAX_INTERIM + 1):
            status, lines = await self._one_head(conn, self._read_timeout if read_wait is None else read_wait)
            if not 100 <= status < 200:
                break
        else:
            raise RemoteProtocolError(f"more than {MAX_INTERIM} interim (1xx) responses")
        headers = []
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if sep:
                headers.append((name.strip().lower(), value.strip()))
        return status, headers

    async def _one_head(self, conn: _Connection, read_wait: float) -> tuple[int, list[bytes]]:
        buf, conn.buf = conn.buf, b""
        answered = bool(buf)
        while (end := _head_end(buf)) < 0:
            if len(buf) > MAX_HEAD_BYTES:
                raise RemoteProtocolError("response head too large")
            with trio.move_on_after(read_wait) as scope:
                try:
                    data = await conn.stream.receive_some(READ_SIZE)
                except trio.BrokenResourceError as e:
                    raise (RemoteProtocolError if answered else _NotTaken)(f"connection lost: {e}") from None
            if scope.cancelled_caught:
                raise ReadTimeout("no response head in the read timeout")
            if not data:
                if answered:
                    raise RemoteProtocolError("server closed the connection inside a response head")
                raise NoAnswer("server closed the connection without a response")
            answered = True
            buf += data
        # The blank line's \n (after a \n or a \r\n): the body starts after it.
        conn.buf = buf[buf.index(b"\n", end + 1) + 1 :]
        # Lines end in \r\n, or a bare \n (RFC 9112 2.2 lets a recipient take it: a
        # server that sent only \n had the node wait out the read timeout).
        lines = [line[:-1] if line[-1:] == b"\r" else line for line in buf[:end].split(b"\n")]
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise RemoteProtocolError(f"not an HTTP/1.x response: {lines[0][:80]!r}")
        code = parts[1]
        # Three digits, 100-599 (RFC 9110): int() would take "+200", "-1" or a hundred digits.
        if len(code) != 3 or not code.isdigit() or not b"100" <= code <= b"599":
            raise RemoteProtocolError(f"invalid status code: {code[:16]!r}")
        return int(code), lines

    @contextlib.asynccontextmanager
    async def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> AsyncIterator[Response]:
        """Send a request; the response's head has arrived when this enters.
        Its connection goes back to the pool only if the body was read to the end."""
        origin = self.origin
        start = f"{method} {origin.path}{path} HTTP/1.1\r\nhost: {origin.host_header}\r\n"
        # identity: with no accept-encoding any coding is acceptable (RFC 9110 12.5.3), and a server
        # that took it so sent gzip bytes a tunnel relayed as they were (an outside audit).
        start += f"content-length: {len(body)}\r\naccept-encoding: identity\r\n"
        head = (
            start.encode("latin-1")
            + self._headers
            + b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in (headers or {}).items())
            + b"\r\n"
        )
        message = head + body
        conn = self._pooled()
        reused = conn is not None
        while True:
            if conn is None:
                conn = await self._connect()
            acked = conn.acked() if reused else None
            try:
                try:
                    rest = await self._send(conn, message)
                    if rest:
                        status, response_headers, whole = await self._send_reading(conn, rest)
                    else:
                        status, response_headers = await self._head(conn)
                except NoAnswer as e:
                    # A kept-alive connection the server had closed: sent again, once, on a new one
                    # (a server that closes one idle at 1-2 s, and a request that went out as it did);
                    # so is one whose close came with no answer while its TCP acknowledged nothing
                    # of the request (the close had crossed it: the server never had it).
                    crossed = acked is not None and conn.acked() == acked
                    await trio.aclose_forcefully(conn.stream)
                    if not reused or not (isinstance(e, _NotTaken) or crossed):
                        if type(e) is _NotTaken:  # (its name is no client's business)
                            raise NoAnswer(str(e)) from None
                        raise
                    conn, reused = None, False
                    continue
                break
            except BaseException:  # Cancelled too: the connection is closed, the exception goes on
                await trio.aclose_forcefully(conn.stream)
                raise
        try:
            response = Response(conn, status, response_headers, self._read_timeout)
        except RemoteProtocolError:  # an answer whose framing cannot be read: not sent again
            await trio.aclose_forcefully(conn.stream)
            raise
        if rest and not whole:  # (answered before the body was all sent: the connection cannot go on)
            response.keep_alive = False
        try:
            yield response
        finally:
            if response.done and response.keep_alive and len(self._idle) < MAX_IDLE:
                conn.idle_since = trio.current_time()
                self._idle.append(conn)
            else:
                await trio.aclose_forcefully(conn.stream)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await trio.aclose_forcefully(conn.stream)
