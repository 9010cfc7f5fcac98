"""Structured logging helpers.

Log records carry their identifiers as ``extra`` fields (poller, batch_id, message_id,
fencing_token, window, ...) so that a JSON formatter or Application Insights can index them;
the human message stays short.
"""

from __future__ import annotations

import logging
from typing import Any

from shared.codec import dumps

__all__ = ["JsonFormatter", "get_logger", "ids"]

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(f"dbfanout.{name}")


def ids(**fields: Any) -> dict[str, Any]:
    """The ``extra`` mapping for a log call: only fields that have a value."""
    return {k: v for k, v in fields.items() if v is not None}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and every ``extra`` field."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                doc[key] = value if isinstance(value, str | int | float | bool | None) else str(value)
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return dumps(doc).decode()
