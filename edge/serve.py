"""Serving the edge with hypercorn's trio worker, from ``iop`` or tests."""

from __future__ import annotations

import hypercorn.config
import hypercorn.trio
import trio
from quart_trio import QuartTrio

from edge.app import edge_of


def hypercorn_config(app: QuartTrio, bind: str, *, certfile: str | None = None, keyfile: str | None = None):
    cfg = edge_of(app).config
    hc = hypercorn.config.Config()
    hc.bind = [bind]
    hc.backlog = cfg.backlog
    hc.accesslog = None
    hc.graceful_timeout = cfg.drain_grace_s
    hc.websocket_max_message_size = cfg.max_frame_bytes
    hc.keep_alive_timeout = 75
    hc.read_timeout = None
    hc.iop_write_timeout_s = cfg.write_timeout_s  # (edge.send_lock: each connection's sends)
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
