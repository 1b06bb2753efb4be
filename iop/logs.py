"""structlog setup: JSON lines in production, readable lines on a terminal.

Exception logs never show local variables: a frame's locals hold configs with
tokens and keys, request bodies with prompts. JSON logs get structured
tracebacks without locals; console logs get plain tracebacks (rich and
better-exceptions, when installed, would print locals).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time

import msgspec
import structlog
from structlog.tracebacks import ExceptionDictTransformer

# structlog.processors.dict_tracebacks, but its frames carry no variables (show_locals=False).
_DICT_TRACEBACKS = structlog.processors.ExceptionRenderer(ExceptionDictTransformer(show_locals=False))


class _UTCStamp:
    """``timestamp``: ISO 8601 UTC with microseconds ("2026-12-01T10:29:48.627192Z"),
    the date and time of day formatted once per second rather than per line."""

    __slots__ = ("_second", "_prefix")

    def __init__(self) -> None:
        self._second = -1
        self._prefix = ""

    def __call__(self, logger, name: str, event_dict: dict) -> dict:
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second, self._prefix = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        event_dict["timestamp"] = f"{self._prefix}.{int((now - second) * 1e6):06d}Z"
        return event_dict


_json_encode = msgspec.json.Encoder(enc_hook=repr).encode  # what JSON cannot say is logged as its repr


def _json_dumps(event_dict: dict, **_: object) -> str:
    return _json_encode(event_dict).decode()


def _as_event(record: logging.LogRecord, *, traceback: bool = True) -> None:
    """A stdlib log record as a structlog event (its traceback, if any, too, unless not asked)."""
    extra = {"exc_info": record.exc_info} if traceback and record.exc_info else {}
    level = min(max(record.levelno // 10 * 10, logging.DEBUG), logging.CRITICAL)  # structlog knows only these
    structlog.get_logger().log(level, record.getMessage(), logger=record.name, **extra)


class _HypercornAsEvents(logging.Filter):
    """hypercorn's own lines ("Running on ...", errors it catches) become structlog
    events, so JSON logs are JSON throughout. A filter on the logger, not a handler:
    hypercorn replaces that logger's handlers when it sets up (after the app is made)
    but leaves its filters alone."""

    def filter(self, record: logging.LogRecord) -> bool:
        _as_event(record)
        return False  # and not through hypercorn's own handler as well


_HYPERCORN_AS_EVENTS = _HypercornAsEvents()


class _AsEvents(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        _as_event(record)


_AS_EVENTS = _AsEvents()


class _TrioAsEvents(logging.Handler):
    """trio's own lines as structlog events (no handler took them: Python's last resort wrote
    them as plain text). Its listener's "accept returned EMFILE (Too many open files);
    retrying in 0.1 seconds", logged at each retry with a traceback of nine lines, ten a
    second for as long as the edge stays out of descriptors, goes at most once a second and
    without the traceback (the line names the error); every other line goes as it came."""

    def __init__(self) -> None:
        super().__init__()
        self.last = -math.inf

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith("accept returned"):
            _as_event(record)
            return
        now = time.monotonic()
        if now - self.last >= 1.0:
            self.last = now
            _as_event(record, traceback=False)


_TRIO_AS_EVENTS = _TrioAsEvents()


def as_events(name: str) -> None:
    """The stdlib logger ``name`` logs through structlog only (console or JSON, as
    configured): for Quart's ``app.logger`` (named after the app), whose own
    ``default_handler`` writes plain-text lines and tracebacks. Quart (Flask's
    ``create_logger``) adds that handler only to a logger that has none."""
    logger = logging.getLogger(name)
    logger.handlers = [_AS_EVENTS]
    logger.propagate = False


LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("json", "console")


def setting_problem(level: str | None) -> str:
    """Why the log level (``--log-level`` or ``IOP_LOG_LEVEL``) or ``IOP_LOG_FORMAT``
    cannot be used ("" if they can)."""
    name = level or os.environ.get("IOP_LOG_LEVEL")
    if name and name.lower() not in LEVELS:
        where = "--log-level" if level else "IOP_LOG_LEVEL"
        return f"{where}: {name[:40]!r} is not one of {', '.join(LEVELS)}"
    fmt = os.environ.get("IOP_LOG_FORMAT")
    if fmt and fmt.lower() not in FORMATS:  # (any case, as IOP_LOG_LEVEL)
        return f"IOP_LOG_FORMAT: {fmt[:40]!r} is not one of {', '.join(FORMATS)}"
    return ""


def configure(level: str | None = None, *, json: bool | None = None, cache: bool = True) -> None:
    level_name = (level or os.environ.get("IOP_LOG_LEVEL") or "info").upper()
    numeric = logging.getLevelName(level_name)
    if not isinstance(numeric, int):
        numeric = logging.INFO
    if json is None:
        fmt = os.environ.get("IOP_LOG_FORMAT", "").lower()
        json = fmt == "json" or (fmt != "console" and not sys.stderr.isatty())
    processors: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        _UTCStamp(),
    ]
    if json:
        processors += [
            _DICT_TRACEBACKS,
            structlog.processors.EventRenamer("msg"),
            structlog.processors.JSONRenderer(serializer=_json_dumps),
        ]
    else:
        processors += [
            structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback)
        ]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=cache,
    )
    trio_log = logging.getLogger("trio")
    trio_log.handlers = [_TRIO_AS_EVENTS]
    trio_log.propagate = False
    hypercorn_log = logging.getLogger("hypercorn.error")
    if json:
        hypercorn_log.addFilter(_HYPERCORN_AS_EVENTS)  # adds it once however often configure runs
    else:
        hypercorn_log.removeFilter(_HYPERCORN_AS_EVENTS)
