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
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

__all__ = [
    "MAX_ERROR_CHARS",
    "ScrubbedError",
    "ScrubbingFilter",
    "describe_error",
    "safe_cause",
    "scrub",
    "scrub_record",
    "scrub_value",
    "scrubbed_errors",
]

#: Failure records and span events keep at most this much of an exception's text.
MAX_ERROR_CHARS = 2048

MASK = "***"

# One pattern set for every text dbfanout logs, raises, records or exports (logs, failure records,
# span events, settings' redact_url). Each masks a value, never its key or scheme, so a reader still
# sees what kind of credential was there.

# A key whose value is a secret: one *ending* in one of these words (``password``, ``db_password``,
# ``PGPASSWORD``, ``client_secret``, ``ClientSecret``, ``access_token``, ``AccountKey``, ``sig``...),
# not ``SharedAccessKeyName`` or ``key`` alone; ``fencing_token`` is a number of ours.
_SECRET_WORDS = (
    r"password|passwd|pwd|secret|token|sig|signature|apikey|"
    r"(?:account|access|sharedaccess|api|private|secret|signing|master|subscription|client|encryption)[_-]?key"
)
_KEY = rf"(?<![A-Za-z0-9_.\-])(?!fencing[_-]?token)[A-Za-z0-9_.\-]*?(?:{_SECRET_WORDS})"
# A value: quoted with backslash escapes (libpq 'a b\'c', JSON "x\"y", .NET "a""b"), ODBC-braced
# ({a;b}}c}), or bare up to the next separator.
_TRIPLE = r"'''.*?'''|\"\"\".*?\"\"\""  # a Python literal's triple quotes: before the single ones
_SINGLE = r"'(?:[^'\\]|\\.)*'"
_DOUBLE = r'"(?:[^"\\]|\\.|"")*"'
_BRACED = r"\{(?:[^}]|\}\})*\}"
_QUOTED = re.compile(rf"({_SINGLE}|{_DOUBLE}|{_BRACED})", re.DOTALL)

# key=value (connection strings, libpq DSNs, query strings, env dumps): the value, whatever its form.
# A bare value may hold a quote inside (``password=x'y``), never at its end before a separator.
_BARE = r"[^;&\s'\"<>]+(?:['\"][^;&\s'\"<>,}\])]+)*"
_KEY_VALUE = re.compile(rf"(?i)({_KEY}\s*=\s*)(b?(?:{_TRIPLE})|b?{_SINGLE}|{_DOUBLE}|{_BRACED}|{_BARE})", re.DOTALL)
# key%3Dvalue: a query string or form URL-encoded once more (a SAS inside a URL): up to %26 (``&``).
_KEY_VALUE_ENCODED = re.compile(rf"(?i)({_KEY}%3D)((?:(?!%26)[^;&\s'\"<>])+)")
# ('password', 'x') and ["token", "x"]: a key and its value side by side in a tuple or list repr.
_KEY_TUPLE = re.compile(rf"(?i)(['\"]{_KEY}['\"]\s*,\s*)(b?{_SINGLE}|{_DOUBLE})", re.DOTALL)
# key: value (YAML, HTTP headers, JSON "password": "x", Python reprs {'token': b'x'}): a quoted
# value, or a bare one to the end of its line (a YAML value may hold spaces).
_KEY_COLON = re.compile(
    rf"(?i)(['\"]?{_KEY}['\"]?\s*:[ \t]*)(b?(?:{_TRIPLE})|b?{_SINGLE}|{_DOUBLE}|[^\s'\"][^\r\n]*)", re.DOTALL
)
# scheme://user:password@host — whatever the scheme; the password runs to the last '@' of the
# line that a host follows (SQLAlchemy takes a password with quotes or spaces unencoded), never
# into a second URL, so one holding '/', '@', quotes or spaces is masked whole.
_URL_PASSWORD = re.compile(
    r"(?i)([a-z][a-z0-9+.\-]*://[^/\s:@'\"]*:)((?:(?!://)[^\r\n])*)(@)(?=[\w.\-\[\]%]+(?:[:/?#\s'\"),;\]}]|$))"
)
# Authorization: <scheme> <credential> (and the schemes alone: Bearer, Basic, SharedKey account:sig).
_AUTHORIZATION = re.compile(r"(?i)(\bauthorization['\"]?\s*:\s*['\"]?(?:[A-Za-z][\w-]*\s+(?=\S))?)([^\s'\",;]+)")
_SCHEME_TOKEN = re.compile(r"(?i)(\b(?:Bearer|Basic|Digest)\s+)([A-Za-z0-9\-._~+/]+=*)")
_SHARED_KEY = re.compile(r"(?i)(\bSharedKey(?:Lite)?\s+[^\s:'\"]+:)([^\s'\",;]+)")

# A text with none of these cannot hold a secret any pattern above masks (the common log line).
_TRIGGER = re.compile(r"(?i)pass|pwd|secret|token|sig|key|://|bearer|basic|digest|authorization")


def _masked(match: re.Match[str]) -> str:
    """The key (group 1), then the value masked: quotes, braces and a bytes prefix kept."""
    value = match.group(2)
    prefix = "b" if value[:1] in ("b", "B") and value[1:2] in ("'", '"') else ""
    body = value[len(prefix) :]
    if body[:3] in ("'''", '"""') and len(body) >= 6 and body[-3:] == body[:3]:
        return f"{match.group(1)}{prefix}{body[:3]}{MASK}{body[:3]}"
    if body[:1] in ("'", '"', "{") and _QUOTED.fullmatch(body):
        return f"{match.group(1)}{prefix}{body[0]}{MASK}{body[-1]}"
    return f"{match.group(1)}{MASK}"


def scrub(text: str) -> str:
    """``text`` with every secret value replaced by ``***`` (idempotent, cheap when there is none)."""
    if not _TRIGGER.search(text):
        return text
    text = _URL_PASSWORD.sub(rf"\g<1>{MASK}\g<3>", text)
    text = _AUTHORIZATION.sub(rf"\g<1>{MASK}", text)
    text = _SCHEME_TOKEN.sub(rf"\g<1>{MASK}", text)
    text = _SHARED_KEY.sub(rf"\g<1>{MASK}", text)
    text = _KEY_TUPLE.sub(_masked, text)
    text = _KEY_COLON.sub(_masked, text)
    text = _KEY_VALUE_ENCODED.sub(rf"\g<1>{MASK}", text)
    return _KEY_VALUE.sub(_masked, text)


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
    """Scrub a log record in place: its message (arguments merged), ``extra`` fields of any type
    (:func:`scrub_value`) and its traceback (when it holds a secret: formatted, scrubbed and kept
    as ``exc_text``, and ``exc_info`` dropped so that no handler or exporter formats the raw
    exception again)."""
    try:
        message = record.getMessage()
    except Exception:  # a bad format string: leave it to logging's own error reporting
        return record
    record.msg, record.args = scrub(message), ()
    for key, value in list(vars(record).items()):
        if key in _SKIP or key.startswith("_"):
            continue
        clean = scrub_value(value)
        if clean is not value:
            setattr(record, key, clean)
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


_PLAIN = (int, float, bool, type(None))
_KEY_ONLY = re.compile(rf"(?i)['\"]?{_KEY}['\"]?")


def scrub_value(value: object) -> object:
    """``value`` with its secrets masked, or ``value`` itself when it holds none.

    A log call's ``extra`` values are any objects, which a formatter or an exporter renders later:
    a string is scrubbed; an exception becomes its scrubbed ``Type: message``; bytes are read as
    text; a mapping's value under a secret key (``{"password": ...}``) is masked whatever its type,
    and mappings, lists, tuples and sets are scrubbed item by item (same type); any other object
    becomes its scrubbed ``str`` when that holds a secret.
    """
    if isinstance(value, str):
        clean = scrub(value)
        return value if clean == value else clean
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, BaseException):
        return describe_error(value)
    if isinstance(value, bytes | bytearray | memoryview):
        text = bytes(value).decode("utf-8", "replace")
        clean = scrub(text)
        return value if clean == text else clean
    if isinstance(value, Mapping):
        items = {
            k: MASK if isinstance(k, str) and _KEY_ONLY.fullmatch(k) and v is not None else scrub_value(v)
            for k, v in value.items()
        }
        changed = any(items[k] is not v for k, v in value.items())
        return items if changed else value
    if isinstance(value, list | tuple | set | frozenset):
        parts = [scrub_value(v) for v in value]
        if all(p is v for p, v in zip(parts, value, strict=True)):
            return value
        return type(value)(parts) if not hasattr(value, "_fields") else tuple(parts)
    try:
        text = str(value)
    except Exception:  # a __str__ that raises: nothing of it can be rendered either
        return value
    clean = scrub(text)
    return value if clean == text else clean


# Standard LogRecord attributes: never caller text (msg/args are handled above; exc_info and
# stack_info below). Everything else on a record is an ``extra`` field.
_SKIP = frozenset(vars(logging.makeLogRecord({}))) | {"taskName", "asctime"}


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
