"""The edge's listen backlog: a config key, applied to the listening socket."""

from __future__ import annotations

import shutil

import pytest
import trio

from edge.config import EdgeConfig
from edge.serve import hypercorn_config
from iop.configfile import ConfigError, convert
from tests.conftest import BOUND, edge_config, start_edge


def test_backlog_is_a_config_key_with_a_burst_sized_default():
    """backlog defaults to 4096 (not hypercorn's 100), reaches hypercorn's config, and must be positive."""
    from edge.app import create_app

    assert EdgeConfig().backlog == 4096
    assert hypercorn_config(create_app(edge_config(backlog=321)), "127.0.0.1:0").backlog == 321
    with pytest.raises(ConfigError, match="backlog"):
        convert({"backlog": 0}, EdgeConfig)


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs iproute2's ss to read a listener's backlog")
async def test_listening_socket_has_the_configured_backlog(nursery):
    """The edge's listening socket is created with the configured backlog (ss shows it as Send-Q)."""
    edge = await start_edge(nursery, edge_config(backlog=123))
    with trio.fail_after(BOUND):
        ss = await trio.run_process(["ss", "-Hltn", f"sport = :{edge.port}"], capture_stdout=True)
    listeners = [line.split() for line in ss.stdout.decode().splitlines()]
    assert [(fields[0], fields[2]) for fields in listeners] == [("LISTEN", "123")]
