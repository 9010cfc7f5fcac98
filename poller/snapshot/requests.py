"""What a snapshot is asked: the signal table's rows (requests, cancels, a chunk's high watermark),
the initial snapshot of the configuration, and the chunk size either gives.

Requests (``dbfanout snapshot``) are rows of the poller's signal table, like the watermarks its
chunk reads write (:mod:`poller.snapshot.chunks`): they arrive through the log, in order with the
changes, and never race the poller's own state writes. This module reads them as the log carries
them (:func:`signal_of`), turns a request into the snapshot's next state (:func:`apply_request`)
and gives a request row's values (:func:`request_params`); ``snapshot = "initial"`` is the
configuration's request (:func:`initial_state`). Each database's upsert of a request is its own
(:mod:`poller.snapshot.postgres`, :mod:`poller.snapshot.mysql`).
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypedDict, Unpack

from poller.snapshot.chunks import qualified
from shared.codec import dumps, loads
from shared.config import PollerConfig
from shared.models import SnapshotState

__all__ = [
    "CHUNK_MAX_ROWS",
    "CHUNK_PAGES",
    "KIND_REQUEST",
    "KIND_WATERMARK",
    "Request",
    "RequestRefused",
    "apply_request",
    "bounded",
    "chunk_size",
    "failed_request",
    "initial_state",
    "request_params",
    "signal_of",
]

KIND_WATERMARK = "watermark"
KIND_REQUEST = "request"


#: The default chunk: this many pages (``batch_size`` rows each), at most CHUNK_MAX_ROWS rows (at
#: least one page). A chunk costs a select, a watermark and a peek of the slot whatever its size;
#: its pages then come out of memory (with a peek before each only when the log grew meanwhile).
CHUNK_PAGES = 4
CHUNK_MAX_ROWS = 20_000


def chunk_size(config: PollerConfig, requested: Any = None) -> int:
    """Rows a chunk reads: the request's, else ``snapshot_chunk_size``, else :data:`CHUNK_PAGES` pages."""
    if isinstance(requested, int) and not isinstance(requested, bool) and requested > 0:
        return requested
    if config.snapshot_chunk_size:
        return config.snapshot_chunk_size
    return max(config.batch_size, min(CHUNK_PAGES * config.batch_size, CHUNK_MAX_ROWS))


def initial_state(
    config: PollerConfig, now: dt.datetime, estimate: int | None, *, qualify: Callable[[str], str] = qualified
) -> SnapshotState:
    """``snapshot = "initial"``: every table of the poller, from its start (``qualify``: how the
    log names a table; PostgreSQL's ``public.`` by default)."""
    return SnapshotState(
        id="initial",
        tables=tuple(qualify(t) for t in config.tables),
        chunk_size=chunk_size(config),
        estimate=estimate,
        started_at=now,
    )


class Request(TypedDict, total=False):
    """What a ``dbfanout snapshot`` asks: its tables (None: all the poller's), a condition, a chunk
    size (None: the poller's), or a cancel of the running snapshot."""

    tables: Sequence[str] | None
    where: str | None
    chunk_size: int | None
    cancel: bool


def request_params(config: PollerConfig, **request: Unpack[Request]) -> dict[str, Any]:
    """A request row's values (a new id each time), whatever the database's upsert looks like."""
    tables = request.get("tables")
    data: dict[str, Any] = {"action": "cancel"} if request.get("cancel") else {
        "action": "snapshot",
        "tables": list(tables) if tables else None,
        "where": request.get("where"),
        "chunk_size": request.get("chunk_size"),
    }  # fmt: skip
    return {"poller": config.name, "kind": KIND_REQUEST, "id": uuid.uuid4().hex, "data": dumps(data).decode()}


#: Bounds on a request row: anyone who can write the signal table can write one, and what the
#: state keeps of it is rewritten with every checkpoint.
MAX_REQUEST_ID = 128
MAX_TABLES = 1000
MAX_TABLE_NAME = 512
MAX_CHUNK_ROWS = 100_000  # a chunk's rows wait in memory for their watermark
MAX_KEPT_TEXT = 200  # of a refused where (or id) in the state and the log


class RequestRefused(ValueError):
    """A request row that is not a request this poller can run (the message says why)."""


def bounded(text: str, limit: int = MAX_KEPT_TEXT) -> str:
    """``text`` cut to ``limit`` characters (the cut is marked): what a state or a log keeps of input."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def apply_request(
    config: PollerConfig,
    state: SnapshotState | None,
    data: Mapping[str, Any],
    request_id: str,
    at: dt.datetime,
    *,
    qualify: Callable[[str], str] = qualified,
) -> tuple[SnapshotState | None, str | None]:
    """The state after a request row read from the log, and a warning when it was refused
    (``qualify``: how the log names a table). Never raises for what the row holds: a refused request
    ends as a finished snapshot with its ``error`` (unless one is running: that one goes on)."""
    try:
        return _apply(config, state, data, request_id, at, qualify)
    except RequestRefused as exc:
        reason = f"request {bounded(str(request_id), MAX_REQUEST_ID)} refused: {exc}"
        if state is not None and state.active:
            return state, f"{reason}; the running snapshot {state.id} goes on"
        where = data.get("where") if isinstance(data, Mapping) else None
        return failed_request(config, request_id, at, str(exc), where if isinstance(where, str) else None), reason


def failed_request(
    config: PollerConfig, request_id: Any, at: dt.datetime, error: str, where: str | None = None
) -> SnapshotState:
    """A refused request as the finished snapshot ``dbfanout status`` shows: what the state keeps
    of it (the id, the condition, the reason) bounded, since every checkpoint carries it."""
    return SnapshotState(
        id=bounded(str(request_id), MAX_REQUEST_ID),
        tables=(),
        chunk_size=chunk_size(config),
        where=bounded(where) if where is not None else None,
        started_at=at,
        finished_at=at,
        error=bounded(error, 2 * MAX_KEPT_TEXT),
    )


def _apply(
    config: PollerConfig,
    state: SnapshotState | None,
    data: Mapping[str, Any],
    request_id: str,
    at: dt.datetime,
    qualify: Callable[[str], str],
) -> tuple[SnapshotState | None, str | None]:
    if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID:
        raise RequestRefused(f"its id must be a text of 1 to {MAX_REQUEST_ID} characters")
    if not isinstance(data, Mapping):
        raise RequestRefused("its data is not a JSON object")
    action = data.get("action")
    if action == "cancel":
        if state is None or not state.active:
            return state, None
        return replace(state, tables=(), last_key=None, finished_at=at, cancelled=True), None
    if action != "snapshot":
        shown = (
            bounded(repr(action), 60) if isinstance(action, str | int | float | bool | None) else type(action).__name__
        )
        raise RequestRefused(f"unknown action {shown} (snapshot or cancel)")
    known = [qualify(t) for t in config.tables]
    tables = [qualify(t) for t in _tables(data.get("tables"))] or known
    unknown = [t for t in tables if t not in known]
    if unknown:
        raise RequestRefused(f"{bounded(', '.join(unknown))} not among the poller's tables")
    return SnapshotState(
        id=request_id,
        tables=tuple(tables),
        chunk_size=chunk_size(config, _chunk_rows(data.get("chunk_size"))),
        where=_where(data.get("where")),
        started_at=at,
    ), None


def _tables(value: Any) -> list[str]:
    """A request's ``tables``: null (every table of the poller) or a list of table names."""
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_TABLES:
        raise RequestRefused(f"tables must be null or a list of at most {MAX_TABLES} table names")
    if not all(isinstance(t, str) and 0 < len(t) <= MAX_TABLE_NAME for t in value):
        raise RequestRefused(f"each of tables must be a table name of 1 to {MAX_TABLE_NAME} characters")
    return value


def _chunk_rows(value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_CHUNK_ROWS:
        raise RequestRefused(f"chunk_size must be null or a whole number from 1 to {MAX_CHUNK_ROWS:,}")
    return value


def _where(value: Any) -> str | None:
    """A request's ``where`` (null or blank: none). Of another type it is refused, never dropped: a
    dropped condition would snapshot the whole table."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise RequestRefused(f"where must be null or a text, not {type(value).__name__}")
    return value if value.strip() else None


def signal_of(new: Mapping[str, Any] | None, poller: str) -> tuple[str, str, dict[str, Any]] | None:
    """``(kind, id, data)`` of a signal row of ``poller`` as the log carries it (None: not ours)."""
    if not new or new.get("poller") != poller:
        return None
    kind, signal_id, data = new.get("kind"), new.get("id"), new.get("data")
    if not isinstance(kind, str) or not isinstance(signal_id, str):
        return None
    try:
        parsed = loads(data) if isinstance(data, str) else {}
    except Exception:
        parsed = {}
    return kind, signal_id, parsed if isinstance(parsed, dict) else {}
