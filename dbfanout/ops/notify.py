"""The notify triggers of ``wake = "notify"`` pollers: check, create (validate --fix), drop.

One trigger function per database (``dbfanout_notify(channel)``: ``pg_notify(channel, '')``) and,
per poller table, one statement-level trigger ``dbfanout_notify_<poller>`` after INSERT, UPDATE,
DELETE or TRUNCATE. A statement-level trigger costs one call per writing statement, not per row,
and PostgreSQL folds a transaction's identical notifications into one, sent at commit.
"""

from __future__ import annotations

import sqlalchemy as sa

from poller.snapshot.postgres import quote_table
from poller.sources.engines import source_engine
from poller.tick.wake import NOTIFY_FUNCTION, notify_channel, notify_tables, notify_trigger_name
from shared.config import PollerConfig

__all__ = ["create_notify_triggers", "drop_notify_triggers", "missing_notify_triggers"]

_FUNCTION_DDL = f"""
CREATE OR REPLACE FUNCTION {NOTIFY_FUNCTION}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_ARGV[0], '');
    RETURN NULL;
END
$$
"""

_EXISTS = sa.text("SELECT 1 FROM pg_trigger WHERE tgname = :name AND tgrelid = CAST(:table AS regclass)")


def missing_notify_triggers(poller: PollerConfig) -> list[str]:
    """The poller's tables that have no notify trigger yet."""
    name = notify_trigger_name(poller)
    with source_engine(poller).connect() as conn:
        return [
            t
            for t in notify_tables(poller)
            if conn.execute(_EXISTS, {"name": name, "table": quote_table(t)}).first() is None
        ]


def create_notify_triggers(poller: PollerConfig) -> list[str]:
    """Create the function (or replace it) and the missing triggers; returns what was created."""
    missing = missing_notify_triggers(poller)
    if not missing:
        return []
    name, channel = notify_trigger_name(poller), notify_channel(poller)
    with source_engine(poller).begin() as conn:
        conn.exec_driver_sql(_FUNCTION_DDL)
        for table in missing:
            conn.exec_driver_sql(
                f"CREATE TRIGGER {name} AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON {quote_table(table)} "
                f"FOR EACH STATEMENT EXECUTE FUNCTION {NOTIFY_FUNCTION}('{channel}')"
            )
    return [f"trigger {name} on {t}" for t in missing]


def drop_notify_triggers(poller: PollerConfig) -> list[str]:
    """Drop the poller's triggers (the shared function stays: other pollers may use it)."""
    name = notify_trigger_name(poller)
    present = [t for t in notify_tables(poller) if t not in missing_notify_triggers(poller)]
    with source_engine(poller).begin() as conn:
        for table in present:
            conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS {name} ON {quote_table(table)}")
    return [f"trigger {name} on {t}" for t in present]
