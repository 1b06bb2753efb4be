"""structlog setup: JSON lines in production, readable lines on a terminal.

Exception logs never show local variables: a frame's locals hold configs with
tokens and keys, request bodies with prompts. JSON logs get structured
tracebacks without locals; console logs get plain tracebacks (rich and
better-exceptions, when installed, would print locals).
"""

from __future__ import annotations

import logging
import os
import sys

import structlog
from structlog.tracebacks import ExceptionDictTransformer

# structlog.processors.dict_tracebacks, but without locals (show_locals=True there).
_DICT_TRACEBACKS = structlog.processors.ExceptionRenderer(ExceptionDictTransformer(show_locals=False))


def configure(level: str | None = None, *, json: bool | None = None, cache: bool = True) -> None:
    level_name = (level or os.environ.get("IOP_LOG_LEVEL") or "info").upper()
    numeric = logging.getLevelName(level_name)
    if not isinstance(numeric, int):
        numeric = logging.INFO
    if json is None:
        fmt = os.environ.get("IOP_LOG_FORMAT", "")
        json = fmt == "json" or (fmt != "console" and not sys.stderr.isatty())
    processors: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if json:
        processors += [
            _DICT_TRACEBACKS,
            structlog.processors.EventRenamer("msg"),
            structlog.processors.JSONRenderer(),
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
