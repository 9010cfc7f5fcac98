"""A replication slot lost for real: a private PostgreSQL with a tiny ``max_slot_wal_keep_size``.

The shared servers' settings are never changed (others use them): the module that needs a lost slot
starts its own server (:mod:`tests.support.private_postgres`), where writing a little more WAL than
1 MB past a slot's position and a checkpoint make PostgreSQL invalidate it (``wal_status = 'lost'``).
"""

from __future__ import annotations

import time

import sqlalchemy as sa

#: Server settings under which a slot is lost after about one WAL segment.
LOSSY_SETTINGS = {
    "wal_level": "logical",
    "max_slot_wal_keep_size": "1MB",
    "max_wal_size": "32MB",
    "min_wal_size": "32MB",
    "max_replication_slots": "20",
}

_STATUS = sa.text("SELECT wal_status FROM pg_replication_slots WHERE slot_name = :slot")


def wal_status(engine: sa.Engine, slot: str) -> str | None:
    with engine.connect() as conn:
        value = conn.execute(_STATUS, {"slot": slot}).scalar()
    return None if value is None else str(value)


def lose_slot(engine: sa.Engine, slot: str, timeout: float = 60.0) -> None:
    """Write WAL past ``slot`` until PostgreSQL invalidates it: a write, a segment switch and a
    checkpoint per round (the slot must be inactive: no peek running), until wal_status = 'lost'."""
    deadline = time.monotonic() + timeout
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("CREATE TABLE IF NOT EXISTS wal_filler (n bigint)"))
        while conn.execute(_STATUS, {"slot": slot}).scalar() != "lost":
            if time.monotonic() > deadline:
                raise TimeoutError(f"slot {slot} was not invalidated within {timeout:.0f}s")
            conn.execute(sa.text("INSERT INTO wal_filler SELECT generate_series(1, 1000)"))
            conn.execute(sa.text("SELECT pg_switch_wal()"))
            conn.execute(sa.text("CHECKPOINT"))
