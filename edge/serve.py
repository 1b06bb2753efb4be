"""Serving the edge with hypercorn's trio worker, from ``iop`` or tests."""

from __future__ import annotations

import hypercorn.config
import hypercorn.trio
import trio
from quart_trio import QuartTrio

from edge.app import edge_of

SHUTDOWN_TAIL_S = 2.0


def hypercorn_config(app: QuartTrio, bind: str, *, certfile: str | None = None, keyfile: str | None = None):
    cfg = edge_of(app).config
    hc = hypercorn.config.Config()
    hc.bind = [bind]
    hc.backlog = cfg.backlog
    hc.accesslog = None
    # hypercorn's own grace comes after the edge's drain (shutdown_trigger), which gave runs
    # theirs and closed what was left: this is only for the last bytes (it was drain_grace_s
    # again: a request still sending its body held the exit twice the grace, then got a bare 500).
    hc.graceful_timeout = SHUTDOWN_TAIL_S
    hc.websocket_max_message_size = cfg.max_frame_bytes
    hc.h2_max_concurrent_streams = cfg.h2_max_streams
    hc.keep_alive_timeout = 75
    hc.read_timeout = None
    hc.iop_write_timeout_s = cfg.write_timeout_s  # (edge.send_lock: each connection's sends)
    hc.iop_edge = edge_of(app)  # (edge.connection.close_all: the connections this edge serves)
    if certfile:
        hc.certfile = certfile
        hc.keyfile = keyfile
    return hc


async def serve_edge(
    app: QuartTrio,
    bind: str,
    *,
    certfile: str | None = None,
    keyfile: str | None = None,
    shutdown_trigger=None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled (or ``shutdown_trigger`` returns); reports the bound URL."""
    hc = hypercorn_config(app, bind, certfile=certfile, keyfile=keyfile)

    async def started(task_status=trio.TASK_STATUS_IGNORED):
        await hypercorn.trio.serve(app, hc, shutdown_trigger=shutdown_trigger, task_status=task_status)

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(started)
        task_status.started(binds[0])
