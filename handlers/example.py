"""An example handler: replicate each change into a target table, exactly once per event.

``pollers.<name>.handler = "handlers.example:handle"``. The target database is the app setting
``TARGET_DB_URL`` (a SQLAlchemy URL). Three tables are created on first use:

* ``dbfanout_example_target`` - one row per live source row: ``(poller, pk)`` → the row as JSON.
  A delete (soft-delete column set) removes the row.
* ``dbfanout_example_versions`` - the newest cursor applied per key, kept after a delete, so a
  stale change that arrives late (a retry, a concurrent worker) never overwrites a newer one or
  resurrects a deleted row (the "apply only if newer" helper, :class:`worker.ordering.LatestVersions`).
* ``dbfanout_processed_events`` - the processed-events helper: one row per event id, written in
  the same transaction as the side effect, so a redelivered event is skipped.
* ``dbfanout_example_duplicates`` - one row per absorbed duplicate (an event seen again), to
  show what at-least-once delivery cost.

Everything for one message happens in one transaction: the message either leaves all its
effects or none (then it is retried).
"""

from __future__ import annotations

import datetime as dt
import os
import threading
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from shared.codec import dumps, encode_value
from shared.models import HandlerContext, RowChange
from worker.idempotency import ProcessedEvents
from worker.ordering import LatestVersions, encode_cursor, key_text, versions_table

__all__ = ["TARGET_SETTING", "handle", "target_tables"]

TARGET_SETTING = "TARGET_DB_URL"

_meta = sa.MetaData()
TARGET = sa.Table(
    "dbfanout_example_target",
    _meta,
    sa.Column("poller", sa.String(64), primary_key=True),
    sa.Column("pk", sa.String(512), primary_key=True),
    sa.Column("cursor", sa.Text, nullable=False),
    sa.Column("row", sa.Text, nullable=False),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
)
VERSIONS = versions_table("dbfanout_example_versions", _meta)  # worker.ordering.LatestVersions keeps it
DUPLICATES = sa.Table(
    "dbfanout_example_duplicates",
    _meta,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("event_id", sa.String(64), nullable=False),
    sa.Column("message_id", sa.String(128), nullable=False),
    sa.Column("delivery_count", sa.Integer, nullable=False),
    sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
)

_lock = threading.Lock()
_state: dict[str, Any] = {}


def target_tables() -> tuple[sa.Table, sa.Table, sa.Table]:
    """The target, versions and duplicates tables (for tests and the demo)."""
    return TARGET, VERSIONS, DUPLICATES


def _engine_and_helper() -> tuple[sa.Engine, ProcessedEvents]:
    # Created once, on the first message: importing the handler opens no connection.
    with _lock:
        if "engine" not in _state:
            url = os.environ.get(TARGET_SETTING)
            if not url:
                raise RuntimeError(f"the example handler needs the app setting {TARGET_SETTING} (a SQLAlchemy URL)")
            # SQLite: wait for the writer lock instead of failing at once when workers run in parallel.
            args = {"timeout": 30} if url.startswith("sqlite") else {}
            engine = sa.create_engine(url, connect_args=args, pool_pre_ping=True)
            _meta.create_all(engine, checkfirst=True)
            _state["engine"] = engine
            _state["processed"] = ProcessedEvents(engine)
            _state["versions"] = LatestVersions(engine, VERSIONS, create=False)
        return _state["engine"], _state["processed"]


key_of = key_text  # the primary key as canonical JSON text (kept for callers of the example)


def _row_json(after: Mapping[str, Any] | None) -> str:
    return dumps({k: encode_value(v)[0] for k, v in (after or {}).items()}).decode()


def handle(events: list[RowChange], context: HandlerContext) -> None:
    """Apply a batch of changes in one transaction; duplicates and stale changes are skipped."""
    engine, processed = _engine_and_helper()
    now = dt.datetime.now(dt.UTC)
    with engine.begin() as conn:
        # The processed-events insert is the first statement: on SQLite it takes the write lock
        # before any read, so two workers never deadlock upgrading a read lock.
        fresh = processed.fresh(conn, events)
        fresh_ids = {e.event_id for e in fresh}
        seen = [e for e in events if e.event_id not in fresh_ids]
        if seen:
            conn.execute(
                sa.insert(DUPLICATES),
                [
                    {
                        "event_id": e.event_id,
                        "message_id": context.message_id,
                        "delivery_count": context.delivery_count,
                        "seen_at": now,
                    }
                    for e in seen
                ],
            )
        for event in _state["versions"].newer(conn, fresh):  # a stale change (a newer one applied) is skipped
            _apply(conn, event, now)


def _apply(conn: sa.Connection, event: RowChange, now: dt.datetime) -> None:
    key = key_of(event.pk)
    target_where = (TARGET.c.poller == event.poller) & (TARGET.c.pk == key)
    conn.execute(sa.delete(TARGET).where(target_where))
    if event.op != "delete":
        conn.execute(
            sa.insert(TARGET).values(
                poller=event.poller,
                pk=key,
                cursor=encode_cursor(event.cursor, event.epoch),
                row=_row_json(event.after),
                updated_at=now,
            )
        )
