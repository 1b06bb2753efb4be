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
import re
import sys
import threading
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
    events, so JSON logs are JSON throughout and the level asked for holds. A filter on the logger, not a handler:
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


class _StderrLogger:
    """structlog's PrintLogger (one line a call, flushed), but a line stderr does not take
    is dropped: its reader gone (a log shipper or ``tee`` restarting: EPIPE) or its disk
    full. Logging never fails a request: an access line raised BrokenPipeError, the
    connection's guard logged that and raised again, and the edge exited, cutting every
    stream and node link (an outside audit); the node did the same."""

    __slots__ = ("_file", "_lock")

    def __init__(self, file=None) -> None:
        self._file = file if file is not None else sys.stderr
        self._lock = threading.Lock()  # (lines from worker threads too)

    def msg(self, message: str) -> None:
        with self._lock:
            try:
                self._file.write(message + "\n")
                self._file.flush()
            except (OSError, ValueError):  # (ValueError: the file closed)
                pass

    log = debug = info = warn = warning = err = error = critical = exception = fatal = failure = msg


class _StderrLoggerFactory:
    def __init__(self, file=None) -> None:
        self._logger = _StderrLogger(file)

    def __call__(self, *args: object) -> _StderrLogger:
        return self._logger


_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _escaped(match: re.Match) -> str:
    return f"\\x{ord(match.group()):02x}"


def _escape_controls(logger, name: str, event_dict: dict) -> dict:
    """Console lines: control characters in string values as ``\\x1b``, as JSON escapes
    them. A request's path, a model's name, a link's node id reached the operator's terminal
    raw, escape sequences and all, from any client (an outside audit)."""
    for key, value in event_dict.items():
        if type(value) is str and _CONTROLS.search(value):
            event_dict[key] = _CONTROLS.sub(_escaped, value)
    return event_dict


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
            _escape_controls,
            structlog.dev.ConsoleRenderer(
                colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback
            ),
        ]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=_StderrLoggerFactory(sys.stderr),
        cache_logger_on_first_use=cache,
    )
    trio_log = logging.getLogger("trio")
    trio_log.handlers = [_TRIO_AS_EVENTS]
    trio_log.propagate = False
    # (console lines too: hypercorn's own handler wrote its INFO lines whatever the level asked)
    logging.getLogger("hypercorn.error").addFilter(_HYPERCORN_AS_EVENTS)  # once however often configure runs
