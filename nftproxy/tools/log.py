"""Logging set-up: one structured line per record.

Layer: edge (configures the process's root logger; called by cli.py only).
Modules log through `logging.getLogger(__name__)` or an injected logger and
pass fields as `extra`: `log.info("synced", extra={"services": 3})` prints

    2025-01-02T03:04:05.678Z INFO nftproxy.agent.proxier synced services=3

or, with json_format, `{"time": ..., "level": "INFO", "logger": ...,
"msg": "synced", "services": 3}`. Verbosity: 0 INFO, 1 DEBUG, 2+ TRACE (5,
per-object detail); negative: WARNING.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

__all__ = ["TRACE", "setup_logging"]

TRACE = 5
"""Below DEBUG: per-object, per-op detail (-vv)."""

_STANDARD_ATTRS = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys() | {"message", "asctime"}
)


def _level(verbosity: int) -> int:
    if verbosity < 0:
        return logging.WARNING
    if verbosity == 0:
        return logging.INFO
    return logging.DEBUG if verbosity == 1 else TRACE


def _timestamp(record: logging.LogRecord) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD_ATTRS}


def _quote(value: Any) -> str:
    text = str(value)
    if not text or any(c.isspace() or c in '"=' for c in text):
        return json.dumps(text)
    return text


class _LineFormatter(logging.Formatter):
    """`time LEVEL logger message key=value ...`; an exception adds
    `error="Type: message"` and, when `tracebacks`, the traceback lines."""

    def __init__(self, *, tracebacks: bool) -> None:
        super().__init__()
        self.tracebacks = tracebacks

    def format(self, record: logging.LogRecord) -> str:
        parts = [_timestamp(record), record.levelname, record.name, record.getMessage()]
        fields = _extras(record)
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            fields["error"] = f"{type(exc).__name__}: {exc}"
        parts += [f"{k}={_quote(v)}" for k, v in fields.items()]
        line = " ".join(parts)
        if self.tracebacks and record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        doc.update(_extras(record))
        if record.exc_info:
            doc["error"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup_logging(
    verbosity: int, *, json_format: bool = False, stream: TextIO | None = None
) -> logging.Handler:
    """Send every record at or above the verbosity's level to `stream`
    (default stderr), one line each. Calling it again replaces the handler."""
    logging.addLevelName(TRACE, "TRACE")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.set_name("nftproxy")
    formatter: logging.Formatter = (
        _JsonFormatter() if json_format else _LineFormatter(tracebacks=verbosity >= 1)
    )
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "nftproxy"]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(_level(verbosity))
    return handler
