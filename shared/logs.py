"""Structured logging helpers.

Log records carry their identifiers as ``extra`` fields (poller, batch_id, message_id,
fencing_token, window, ...) so that a JSON formatter or Application Insights can index them;
the human message stays short. Two formatters render them on a console: :class:`TextFormatter`
(``message key=value ...``, the default of ``dbfanout run``) and :class:`JsonFormatter` (one
JSON object per line).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from shared.codec import dumps
from shared.scrub import ScrubbingFilter

__all__ = ["JsonFormatter", "TextFormatter", "console_handler", "fields_of", "get_logger", "ids", "use_console_format"]

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


_SCRUB = ScrubbingFilter()


def get_logger(name: str) -> logging.Logger:
    """A ``dbfanout.<name>`` logger whose records are scrubbed of secrets before any handler sees
    them (a logger's filters run for its own records, so each dbfanout logger carries one)."""
    logger = logging.getLogger(f"dbfanout.{name}")
    if _SCRUB not in logger.filters:
        logger.addFilter(_SCRUB)
    return logger


def ids(**fields: Any) -> dict[str, Any]:
    """The ``extra`` mapping for a log call: only fields that have a value."""
    return {k: v for k, v in fields.items() if v is not None}


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields a log call passed as ``extra``, in the order it passed them."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


def _text(value: Any) -> str:
    """A field value for ``key=value``: quoted (JSON string rules) when it holds a space, quote or ``=``."""
    text = str(value)
    if not text or any(c.isspace() or c in '"=' for c in text):
        return json.dumps(text, ensure_ascii=False)
    return text


class TextFormatter(logging.Formatter):
    """A human-readable line: ``fmt`` (level, logger, message), then every ``extra`` field as
    ``key=value``; a traceback, if any, on the lines after."""

    def __init__(self, fmt: str = "%(levelname)s %(name)s: %(message)s") -> None:
        super().__init__(fmt)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields = fields_of(record)
        return line + "".join(f" {key}={_text(value)}" for key, value in fields.items())


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and every ``extra`` field."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in fields_of(record).items():
            doc[key] = value if isinstance(value, str | int | float | bool | None) else str(value)
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:  # a scrubbed record keeps only its formatted traceback
            doc["exception"] = record.exc_text
        return dumps(doc).decode()


def console_handler(stream: Any = None) -> logging.StreamHandler[Any]:
    """A stderr handler rendering fields as text; :func:`use_console_format` can switch it later."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(TextFormatter())
    handler.addFilter(_SCRUB)  # also the SDKs' and the host's records
    handler.dbfanout_console = True  # type: ignore[attr-defined]
    return handler


def use_console_format(formatter: logging.Formatter) -> None:
    """Render through ``formatter`` on every root handler :func:`console_handler` made."""
    for handler in logging.getLogger().handlers:
        if getattr(handler, "dbfanout_console", False):
            handler.setFormatter(formatter)
