"""Secrets out of every error text dbfanout logs, records or exports.

A handler or an SDK may put a connection string, a URL with a password or a SAS token in an
exception message; that text then reaches the host log on every retry and split, the failure
record of a dead-lettered event and span events. :func:`scrub` replaces the secret values (not
the keys, so the reader still sees what kind of credential was there); :class:`ScrubbingFilter`
applies it to log records (message, ``extra`` fields and the formatted traceback), and
:func:`describe_error` is the bounded, scrubbed ``Type: message`` that failure records and spans
carry.
"""

from __future__ import annotations

import logging
import re
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = [
    "MAX_ERROR_CHARS",
    "ScrubbedError",
    "ScrubbingFilter",
    "describe_error",
    "safe_cause",
    "scrub",
    "scrub_record",
    "scrubbed_errors",
]

#: Failure records and span events keep at most this much of an exception's text.
MAX_ERROR_CHARS = 2048

MASK = "***"

# Connection-string and query-string keys whose value is a secret (Service Bus, storage,
# ADO.NET/ODBC, libpq, SAS tokens); the value runs to the next ';', '&', quote or whitespace.
_SECRET_KEYS = (
    r"SharedAccessKey|SharedAccessSignature|AccountKey|AccessKey|Password|pwd|passwd|secret|"
    r"client_secret|sig|token|api[_-]?key"
)
_KEY_VALUE = re.compile(rf"(?i)(?<![\w-])((?:{_SECRET_KEYS})\s*=\s*)([^;&\s'\"<>]+)")
# scheme://user:password@host — the password, whatever the scheme (postgresql, mysql, amqps, https).
_URL_PASSWORD = re.compile(r"(?i)([a-z][a-z0-9+.\-]*://[^/\s:@'\"]*:)([^@/\s'\"]+)(@)")
# 'password': 'x' / "password": "x" in reprs of dicts (SQLAlchemy URL reprs, connect kwargs).
_QUOTED_KEY = re.compile(rf"(?i)(['\"](?:{_SECRET_KEYS})['\"]\s*:\s*['\"])([^'\"]*)(['\"])")


def scrub(text: str) -> str:
    """``text`` with every secret value replaced by ``***`` (idempotent, cheap when there is none)."""
    if "=" not in text and "://" not in text and ":" not in text:
        return text
    text = _URL_PASSWORD.sub(rf"\g<1>{MASK}\g<3>", text)
    text = _QUOTED_KEY.sub(rf"\g<1>{MASK}\g<3>", text)
    return _KEY_VALUE.sub(rf"\g<1>{MASK}", text)


def describe_error(error: BaseException, limit: int = MAX_ERROR_CHARS) -> str:
    """``Type: message``, scrubbed and cut to ``limit`` characters (the cut is marked)."""
    try:
        text = f"{type(error).__name__}: {error}"
    except Exception:  # a __str__ that raises must not hide the failure it describes
        text = f"{type(error).__name__}: <unprintable>"
    text = scrub(text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def safe_cause(error: BaseException) -> BaseException | None:
    """``error`` to chain under an exception that leaves the process (``raise ... from``), or None
    when its text (or a cause's) holds a secret: the platform logs chained exceptions verbatim."""
    seen: BaseException | None = error
    while seen is not None:
        try:
            text = str(seen)
        except Exception:
            return None
        if scrub(text) != text:
            return None
        seen = seen.__cause__ or seen.__context__
    return error


class ScrubbedError(Exception):
    """An error whose text held a secret, raised again with the secret masked (its type is named)."""


@contextmanager
def scrubbed_errors() -> Iterator[None]:
    """At a function's entry point (what the Functions host logs): an exception whose text holds a
    secret leaves as a :class:`ScrubbedError` with the scrubbed text and the same frames; a clean
    one leaves untouched."""
    try:
        yield
    except Exception as exc:
        if safe_cause(exc) is exc:
            raise
        raise ScrubbedError(describe_error(exc)).with_traceback(exc.__traceback__) from None


def scrub_record(record: logging.LogRecord) -> logging.LogRecord:
    """Scrub a log record in place: its message (arguments merged), string ``extra`` fields and its
    traceback (when it holds a secret: formatted, scrubbed and kept as ``exc_text``, and ``exc_info``
    dropped so that no handler or exporter formats the raw exception again)."""
    try:
        message = record.getMessage()
    except Exception:  # a bad format string: leave it to logging's own error reporting
        return record
    record.msg, record.args = scrub(message), ()
    for key, value in list(vars(record).items()):
        if key in _SKIP or key.startswith("_"):
            continue
        if isinstance(value, str):
            setattr(record, key, scrub(value))
        elif isinstance(value, BaseException):
            setattr(record, key, describe_error(value))
    if record.exc_info and record.exc_info[1] is not None:
        text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
        clean = scrub(text)
        if clean != text:  # exporters read exc_info itself: keep it only when it holds no secret
            record.exc_text, record.exc_info = clean, None
    elif record.exc_text:
        record.exc_text = scrub(record.exc_text)
    if record.stack_info:
        record.stack_info = scrub(record.stack_info)
    return record


# Standard LogRecord attributes that never hold caller text (msg/args are handled above).
_SKIP = frozenset(
    {"name", "msg", "args", "levelname", "pathname", "filename", "module", "funcName", "exc_text", "stack_info"}
    | {"taskName", "processName", "threadName"}
)


class ScrubbingFilter(logging.Filter):
    """A logging filter that scrubs each record it sees (and never drops one).

    Attached to every dbfanout logger (:func:`shared.logs.get_logger`) — on Azure the Python
    worker's own handler then receives clean records — and to the console handlers of
    ``dbfanout run``, which also see the SDKs' and the host's records.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "_dbfanout_scrubbed", False):
            scrub_record(record)
            record._dbfanout_scrubbed = True
        return True
