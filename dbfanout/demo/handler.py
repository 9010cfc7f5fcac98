"""The demo's handler: the example handler, with a bug on "poison" rows until it is fixed.

``handler = "dbfanout.demo.handler:handle"``. It replicates changes exactly like
``handlers.example`` (target table, processed-events helper), except that a batch holding a row
whose ``status`` is ``"poison"`` raises - the kind of bug a real handler has for one odd row.
The demo "deploys the fix" by creating the file named by the app setting
``DBFANOUT_DEMO_FIX_FILE``; the check runs on every call, so the running host sees the fix at
once without a restart.
"""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from pathlib import Path

import sqlalchemy as sa

from shared.models import HandlerContext, RowChange

__all__ = [
    "AUDIT_TABLE",
    "FIX_SETTING",
    "POISON_STATUS",
    "PoisonRowError",
    "as_row_change",
    "as_versioned_change",
    "handle",
    "handle_audit",
    "handle_mysql_binlog",
    "handle_outbox",
    "handle_pg_logical",
    "is_fixed",
    "is_poison",
]

FIX_SETTING = "DBFANOUT_DEMO_FIX_FILE"
POISON_STATUS = "poison"
#: ``dbfanout demo --topic``: the audit subscription's record, one row per event id it was given.
AUDIT_TABLE = "demo_audit"
_audit_lock = threading.Lock()
_audit_engine: list[sa.Engine] = []


class PoisonRowError(RuntimeError):
    """The demo's deliberate handler bug: raised for a poison row until the fix file exists."""


def is_poison(event: RowChange) -> bool:
    """Whether the change carries the demo's poison marker."""
    return event.after is not None and event.after.get("status") == POISON_STATUS


def is_fixed() -> bool:
    """Whether the fix is "deployed": the marker file named by the setting exists."""
    marker = os.environ.get(FIX_SETTING)
    return marker is not None and Path(marker).exists()


def handle(events: list[RowChange], context: HandlerContext) -> None:
    """Fail the whole message on a poison row (until fixed), else replicate like the example."""
    poison = [e for e in events if is_poison(e)]
    if poison and not is_fixed():
        pks = ", ".join(str(e.pk) for e in poison)
        raise PoisonRowError(f"demo bug: cannot handle poison row(s) {pks} (delivery {context.delivery_count})")
    # Imported here: ``handlers`` is the app folder's package, on sys.path only inside the host.
    from handlers.example import handle as replicate

    replicate(events, context)


def handle_outbox(events: list[RowChange], context: HandlerContext) -> None:
    """The ``--source outbox`` demo: outbox events (``pk = {"aggregate": id}``, ``after`` = the row,
    hard deletes) replicated like row events, with the row's ``version`` as the ordering key."""
    handle([as_row_change(e) for e in events], context)


def as_row_change(event: RowChange) -> RowChange:
    """An outbox event as the row change the example handler replicates (keyed by id, ordered by version)."""
    after = dict(event.after or {})
    return replace(event, pk={"id": int(event.pk["aggregate"])}, cursor=after["version"])


def handle_pg_logical(events: list[RowChange], context: HandlerContext) -> None:
    """The ``--source pg-logical`` demo: slot events (hard deletes with the old row as ``before``,
    the table has REPLICA IDENTITY FULL) replicated like row events, ordered by the row's version."""
    handle([as_versioned_change(e) for e in events], context)


def handle_mysql_binlog(events: list[RowChange], context: HandlerContext) -> None:
    """The ``--source mysql-binlog`` demo: binlog events (hard deletes with the old row as ``before``:
    ``binlog_row_image = FULL``) replicated like the slot's, ordered by the row's version."""
    handle([as_versioned_change(e) for e in events], context)


def as_versioned_change(event: RowChange) -> RowChange:
    """The example handler orders a row's changes by cursor: use the row's version. A hard delete
    has no new version; it sorts just after the row's last one (the old row's)."""
    if event.op == "delete":
        return replace(event, cursor=float((event.before or {})["version"]) + 0.5)
    return replace(event, cursor=(event.after or {})["version"])


def handle_audit(events: list[RowChange], context: HandlerContext) -> None:
    """``dbfanout demo --topic``: the second subscription's handler. It never fails, and counts how
    many times it was given each event: the demo checks every count is 1 (the replica subscription's
    retries, split and DLQ replay are addressed to that subscription only)."""
    engine = _audit()
    with engine.begin() as conn:
        for event in events:
            conn.execute(
                sa.text(
                    f"INSERT INTO {AUDIT_TABLE} (event_id, deliveries) VALUES (:id, 1) "
                    "ON CONFLICT (event_id) DO UPDATE SET deliveries = deliveries + 1"
                ),
                {"id": event.event_id},
            )


def _audit() -> sa.Engine:
    # Created on the first message (importing the handler opens nothing), in the target database.
    with _audit_lock:
        if not _audit_engine:
            url = os.environ.get("TARGET_DB_URL")
            if not url:
                raise RuntimeError("the demo's audit handler needs the app setting TARGET_DB_URL")
            engine = sa.create_engine(url, connect_args={"timeout": 30} if url.startswith("sqlite") else {})
            with engine.begin() as conn:
                conn.exec_driver_sql(
                    f"CREATE TABLE IF NOT EXISTS {AUDIT_TABLE} (event_id TEXT PRIMARY KEY, deliveries INTEGER NOT NULL)"
                )
            _audit_engine.append(engine)
        return _audit_engine[0]
