"""The process's limits a server of many connections needs."""

from __future__ import annotations

import resource

import structlog

log = structlog.get_logger("iop")


def more_open_files() -> None:
    """Raise the soft limit on open files to the hard one, as Go's runtime does for its
    servers: every connection and link is a descriptor, and systemd starts services with a
    soft 1,024 (its hard limit 524,288), where an edge meant to hold 10,000 streams stopped
    accepting at about 1,000 ("Too many open files", nothing answered)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == resource.RLIM_INFINITY or soft >= hard:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as e:  # (a sandbox may refuse it: the soft limit stays)
        log.warning("could not raise the open files limit", soft=soft, hard=hard, error=str(e))
