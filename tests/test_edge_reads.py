"""The edge's connection reader (edge/reads.py): on plain TCP it reads the
socket itself. Every byte arrives in order, a flooding peer still lets the
other tasks run, and a paced peer costs no read that finds nothing."""

from __future__ import annotations

import tracemalloc

import trio
import trio.testing
from hypercorn.events import Closed, RawData

from edge import reads
from tests.conftest import BOUND, CountingOS


async def test_a_flooding_peer_is_read_whole_and_others_get_their_turn():
    """128 KB already waiting, read 1 KiB at a time by a handler that never yields: every byte
    arrives in order, then the end, and a task beside it runs at least once per
    READY_READS reads (without that limit it would not run until the flood is read)."""
    a, b = trio.socket.socketpair()
    flood = bytes(range(256)) * 512  # fits the socket's default buffers
    got: list[bytes] = []
    turns = 0

    async def handle(event: RawData | Closed) -> None:  # never a schedule point
        got.append(event.data if isinstance(event, RawData) else event)

    async def other() -> None:
        nonlocal turns
        while True:
            turns += 1
            await trio.lowlevel.checkpoint()

    with trio.fail_after(BOUND):
        sent = 0
        while sent < len(flood):  # all of it waits in the socket before the reader starts
            sent += await a.send(flood[sent:])
        a.close()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)
            await reads._read_socket(b, handle, 1024)
            nursery.cancel_scope.cancel()
    b.close()
    assert got[-1] == Closed() and got[-2] == b""  # the end, then the protocol is told
    assert b"".join(got[:-1]) == flood
    data_reads = len(got) - 2
    assert data_reads >= 128
    assert reads.READY_READS <= 8
    assert turns >= data_reads // 8 - 1, (turns, data_reads)  # 0 without the limit


async def test_a_paced_peer_costs_no_read_that_finds_nothing(monkeypatch):
    """A peer that sends a little, then more a while later (a node's frames, a client's next
    request): after a read that emptied the socket the reader waits for bytes, so no read
    finds nothing (a syscall and an exception each)."""
    counting = CountingOS()
    monkeypatch.setattr(reads, "os", counting)
    a, b = trio.socket.socketpair()
    got: list[bytes] = []

    async def handle(event: RawData | Closed) -> None:
        got.append(event.data if isinstance(event, RawData) else b"")

    async def paced() -> None:
        with a:
            for i in range(20):
                await a.send(b"frame%02d" % i)
                await trio.sleep(0.01)

    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(paced)
            await reads._read_socket(b, handle, 65536)
    b.close()
    assert b"".join(got) == b"".join(b"frame%02d" % i for i in range(20))
    assert counting.reads >= 20
    assert counting.empty <= 1, counting.empty


async def test_a_socket_closed_while_the_reader_waits_ends_it():
    """The protocol closes the connection (hypercorn's own close) while the reader waits for
    bytes: the reader returns, it does not raise or read a closed descriptor."""
    a, b = trio.socket.socketpair()
    got: list[bytes] = []
    closed: list[Closed] = []

    async def handle(event: RawData | Closed) -> None:
        if isinstance(event, Closed):
            closed.append(event)
            return
        got.append(event.data)
        b.close()  # as hypercorn does when the handler decides the connection is over

    with trio.fail_after(BOUND):
        await a.send(b"request")
        await reads._read_socket(b, handle, 65536)
        async with trio.open_nursery() as nursery:
            c, d = trio.socket.socketpair()
            nursery.start_soon(reads._read_socket, d, handle, 65536)
            await trio.sleep(0.05)
            d.close()  # trio tells the waiting reader
    a.close()
    c.close()
    assert got == [b"request"]
    assert len(closed) == 2  # each reader ended by telling the protocol, once


async def test_a_reader_waiting_for_bytes_holds_none_of_its_last_read():
    """A client's request (here 60 KB in one read) is the protocol's once handed over: the
    reader of a connection whose stream is open, waiting for the client's next bytes, does not
    keep the last read alive (a coding agent's prompt, per open stream)."""
    a, b = trio.socket.socketpair()
    handed: list[int] = []

    async def handle(event: RawData | Closed) -> None:
        if isinstance(event, RawData):
            handed.append(len(event.data))  # the protocol keeps nothing here

    with trio.fail_after(BOUND):
        await a.send(b"x" * 60_000)
        tracemalloc.start()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(reads._read_socket, b, handle, 65536)
                await trio.testing.wait_all_tasks_blocked()
                held = sum(
                    stat.size
                    for stat in tracemalloc.take_snapshot().statistics("filename")
                    if stat.traceback[0].filename == reads.__file__
                )
                a.close()
        finally:
            tracemalloc.stop()
    b.close()
    assert handed == [60_000, 0]  # the read, then the end
    assert held < 4096, held
